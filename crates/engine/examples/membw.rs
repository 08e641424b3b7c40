//! Memory-read bandwidth probe: the roofline a batch-1 decode is measured against.
//!
//! `cargo run --release -p oxlm-engine --example membw [MiB] [threads]`
//!
//! Sums a buffer far larger than the caches with independent vector accumulators (so the sum is
//! never the bottleneck), best of several passes, split over `threads` threads (default 1). The
//! buffer is a [`WeightBuffer`], huge pages where Linux gives them, as the CPU's weights are:
//! 4 KiB pages read 10-12% slower here.
//! Prints `read_gbps=<GB/s> mib=<size> threads=<n>` on one line for scripts to parse.

use std::time::Instant;

use oxlm_engine::WeightBuffer;

/// Sums `v` in eight independent chains (AVX2 where the processor has it), so that the adds
/// keep up with any memory system.
fn sum(v: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") {
        // SAFETY: AVX2 was just detected.
        return unsafe { sum_avx2(v) };
    }
    let mut acc = [0.0f32; 8];
    for c in v.chunks_exact(8) {
        for (a, x) in acc.iter_mut().zip(c) {
            *a += x;
        }
    }
    acc.iter().sum()
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn sum_avx2(v: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    let mut acc = [_mm256_setzero_ps(); 8];
    for c in v.chunks_exact(64) {
        for (j, a) in acc.iter_mut().enumerate() {
            // SAFETY: `c` holds 64 floats.
            *a = _mm256_add_ps(*a, unsafe { _mm256_loadu_ps(c.as_ptr().add(8 * j)) });
        }
    }
    let mut lanes = [0.0f32; 8];
    for a in acc {
        let mut l = [0.0f32; 8];
        // SAFETY: `l` holds 8 floats.
        unsafe { _mm256_storeu_ps(l.as_mut_ptr(), a) };
        for (x, y) in lanes.iter_mut().zip(l) {
            *x += y;
        }
    }
    lanes.iter().sum()
}

fn main() {
    let mut args = std::env::args().skip(1);
    let mib: usize = args.next().map_or(1024, |a| a.parse().expect("MiB"));
    let threads: usize = args.next().map_or(1, |a| a.parse().expect("threads"));
    let n = mib * (1 << 20) / 4;
    let mut buffer = WeightBuffer::new(n * 4).expect("memory for the probe");
    // Touch every page so the passes read memory, not the zero page.
    for (i, v) in buffer.as_mut_slice().chunks_exact_mut(4).enumerate() {
        v.copy_from_slice(&((i % 7) as f32).to_ne_bytes());
    }
    let bytes = buffer.freeze().expect("a read-only probe buffer");
    let data: &[f32] = bytes.view();
    let parts: Vec<&[f32]> = data.chunks(n.div_ceil(threads)).collect();
    let mut best = f64::INFINITY;
    let mut check = 0.0;
    for _ in 0..7 {
        let t = Instant::now();
        check += std::thread::scope(|s| {
            let handles: Vec<_> = parts.iter().map(|p| s.spawn(|| sum(p))).collect();
            handles.into_iter().map(|h| h.join().unwrap()).sum::<f32>()
        });
        best = best.min(t.elapsed().as_secs_f64());
    }
    let gbps = (n * 4) as f64 / best / 1e9;
    // `check` keeps the sums from being optimised away.
    println!("read_gbps={gbps:.2} mib={mib} threads={threads} check={check:.0}");
}
