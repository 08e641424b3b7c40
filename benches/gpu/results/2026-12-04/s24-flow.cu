// Session 24: what a decode step made of ONE persistent kernel could take on this GPU, against
// the twenty-second session's floor of one kernel per operation (s22-floor.cu). s24-flow.py
// launches it. One block an SM; each block's last warp copies the block's share of each
// operation's weights into a ring of shared-memory stages with bulk copies (TMA), running ahead
// of the other warps by as many stages as the ring holds, across operations; the other warps
// wait until every block taking part in the operation before has counted itself done, read
// that operation's output through L2 and round it to int16 in shared memory, as the GEMVs do,
// then take each stage as it lands (dp2a over 4-bit weights, as qdot_run does), write their
// share of the output and count themselves done. Nothing is computed that a model would use:
// the chain measures the waits, reads and bytes of a step, not its arithmetic's results.
typedef unsigned long long u64;
typedef unsigned int u32;

struct Op {
    u64 offset;  // the operation's first weight byte
    u32 slice;   // bytes each taking block streams, a multiple of 16
    int blocks;  // blocks that take part: 0 .. blocks - 1
    int in_n;    // floats read from the output of the operation before
    int out_n;   // floats written
};

#define ACT_WORDS 4096 // int16 pairs: the first 8,192 inputs, the rest read and summed

// Modes (bits): wait for the operation before (without: no dependencies, the chain's streaming
// and arithmetic alone); copy an operation's weights only once the operation before is done
// (no prefetch ahead of the wait).
#define MODE_WAIT 1
#define MODE_LATE_COPY 2
#define MODE_NO_MATH 4 // the weights copied in, not read
#define MODE_NO_FENCE 8 // counted done by the release alone, without a fence before it
#define MODE_NO_INPUT 16 // no reads of the operation before's output, no writes of its own

__device__ __forceinline__ u32 smem_addr(const void *p) {
    return (u32)__cvta_generic_to_shared(p);
}
__device__ __forceinline__ void mbar_init(u64 *b, u32 count) {
    asm volatile("mbarrier.init.shared.b64 [%0], %1;" ::"r"(smem_addr(b)), "r"(count));
}
__device__ __forceinline__ void mbar_expect(u64 *b, u32 bytes) {
    asm volatile("{ .reg .b64 st; mbarrier.arrive.expect_tx.shared.b64 st, [%0], %1; }" ::"r"(
                     smem_addr(b)),
                 "r"(bytes)
                 : "memory");
}
__device__ __forceinline__ void mbar_arrive(u64 *b) {
    asm volatile("{ .reg .b64 st; mbarrier.arrive.shared.b64 st, [%0]; }" ::"r"(smem_addr(b))
                 : "memory");
}
__device__ __forceinline__ void mbar_wait(u64 *b, u32 parity) {
    u32 done;
    do {
        asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared.b64 p, [%1], %2; "
                     "selp.u32 %0, 1, 0, p; }"
                     : "=r"(done)
                     : "r"(smem_addr(b)), "r"(parity)
                     : "memory");
    } while (!done);
}
__device__ __forceinline__ void bulk_copy(void *dst, const void *src, u32 bytes, u64 *bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], "
                 "%2, [%3];" ::"r"(smem_addr(dst)),
                 "l"(src), "r"(bytes), "r"(smem_addr(bar))
                 : "memory");
}
__device__ __forceinline__ void wait_count(const u32 *c, u32 target) {
    u32 v;
    do {
        asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(c) : "memory");
    } while (v < target);
}
__device__ __forceinline__ void count_done(u32 *c) {
    asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(c) : "memory");
}
__device__ __forceinline__ int dp2a_lo(u32 a, u32 b, int d) {
    int r;
    asm("dp2a.lo.s32.u32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(d));
    return r;
}
__device__ __forceinline__ int dp2a_hi(u32 a, u32 b, int d) {
    int r;
    asm("dp2a.hi.s32.u32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(d));
    return r;
}

template <int CW, int STAGES, int STAGE_BYTES>
__device__ void flow(const unsigned char *weights, const Op *ops, int nops, float *acts,
                     int act_stride, u32 *counts, u32 epoch, int mode) {
    constexpr int CT = CW * 32;
    extern __shared__ __align__(128) unsigned char smem[];
    uint4 *stages = reinterpret_cast<uint4 *>(smem);
    u32 *act = reinterpret_cast<u32 *>(smem + STAGES * STAGE_BYTES);
    u64 *full = reinterpret_cast<u64 *>(act + ACT_WORDS);
    u64 *empty = full + STAGES;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; s++) mbar_init(full + s, 1), mbar_init(empty + s, CW);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    int s = 0;
    u32 round = 0;
    if (warp == CW) {  // the copying warp
        if (lane != 0) return;
        for (int k = 0; k < nops; k++) {
            const Op op = ops[k];
            if ((int)blockIdx.x >= op.blocks) continue;
            if ((mode & MODE_LATE_COPY) && k > 0)
                wait_count(counts + k - 1, (u32)ops[k - 1].blocks * (epoch + 1));
            const unsigned char *src = weights + op.offset + (u64)blockIdx.x * op.slice;
            for (u32 off = 0; off < op.slice; off += STAGE_BYTES) {
                const u32 bytes = min((u32)STAGE_BYTES, op.slice - off);
                mbar_wait(empty + s, (round & 1) ^ 1);
                mbar_expect(full + s, bytes);
                bulk_copy(stages + s * (STAGE_BYTES / 16), src + off, bytes, full + s);
                if (++s == STAGES) s = 0, round++;
            }
        }
        return;
    }
    const int tid = threadIdx.x;
    for (int k = 0; k < nops; k++) {
        const Op op = ops[k];
        if ((int)blockIdx.x >= op.blocks) continue;
        if ((mode & MODE_WAIT) && k > 0) {
            if (tid == 0) wait_count(counts + k - 1, (u32)ops[k - 1].blocks * (epoch + 1));
            asm volatile("bar.sync 1, %0;" ::"r"(CT) : "memory");
        }
        const float2 *in = reinterpret_cast<const float2 *>(acts + (u64)k * act_stride);
        // Eight loads a thread in flight at once: a loop of one at a time waits for L2 on each.
        float rest = 0.f;
        constexpr int LOADS = 8;
        const int in_pairs = (mode & MODE_NO_INPUT) ? 0 : op.in_n / 2;
        for (int first = 0; first < in_pairs; first += LOADS * CT) {
            float2 v[LOADS];
#pragma unroll
            for (int j = 0; j < LOADS; j++) {
                const int i = first + j * CT + tid;
                v[j] = i < in_pairs ? __ldcg(in + i) : make_float2(0.f, 0.f);
            }
#pragma unroll
            for (int j = 0; j < LOADS; j++) {
                const int i = first + j * CT + tid;
                if (i < ACT_WORDS)
                    act[i] = ((u32)__float2int_rn(v[j].x * 64.f) & 0xffffu) |
                             ((u32)__float2int_rn(v[j].y * 64.f) << 16);
                else
                    rest += v[j].x + v[j].y;
            }
        }
        asm volatile("bar.sync 1, %0;" ::"r"(CT) : "memory");
        int d = 0;
        for (u32 off = 0; off < op.slice; off += STAGE_BYTES) {
            const u32 units = min((u32)STAGE_BYTES, op.slice - off) / 16;
            mbar_wait(full + s, round & 1);
            const uint4 *st = stages + s * (STAGE_BYTES / 16);
            for (u32 u = tid; u < ((mode & MODE_NO_MATH) ? 0 : units); u += CT) {
                const uint4 w = st[u];
                // As quantize_acts lays them out: a warp's lanes read consecutive chunks.
                const uint4 *x = reinterpret_cast<const uint4 *>(act) +
                                 (((u >> 5) * 128) & (ACT_WORDS / 4 - 1)) + (u & 31);
                const u32 ws[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    const uint4 p = x[32 * j];
                    const u32 even = ws[j] & 0x0F0F0F0Fu, odd = (ws[j] >> 4) & 0x0F0F0F0Fu;
                    d = dp2a_lo(p.x, even, d);
                    d = dp2a_hi(p.y, even, d);
                    d = dp2a_lo(p.z, odd, d);
                    d = dp2a_hi(p.w, odd, d);
                }
            }
            __syncwarp();
            if (lane == 0) mbar_arrive(empty + s);
            if (++s == STAGES) s = 0, round++;
        }
        // The block's share of the output.
        float *out = acts + (u64)(k + 1) * act_stride;
        const int per = (op.out_n + op.blocks - 1) / op.blocks;
        const int lo = blockIdx.x * per, hi = (mode & MODE_NO_INPUT) ? lo : min(op.out_n, lo + per);
        const float v = (float)d * 1e-12f + rest * 1e-30f;
        for (int j = lo + tid; j < hi; j += CT) __stcg(out + j, v);
        asm volatile("bar.sync 1, %0;" ::"r"(CT) : "memory");
        if (tid == 0) {
            if (!(mode & MODE_NO_FENCE)) __threadfence();
            count_done(counts + k);
        }
    }
}

#define FLOW(CW, STAGES, KB)                                                                      \
    extern "C" __global__ void __launch_bounds__((CW + 1) * 32, 1)                                 \
        flow##CW##_##STAGES##x##KB(const unsigned char *weights, const Op *ops, int nops,          \
                                   float *acts, int act_stride, u32 *counts, u32 epoch, int mode) { \
        flow<CW, STAGES, KB * 1024>(weights, ops, nops, acts, act_stride, counts, epoch, mode);    \
    }
FLOW(16, 6, 32)
FLOW(8, 6, 32)
FLOW(16, 12, 16)
FLOW(16, 3, 64)
