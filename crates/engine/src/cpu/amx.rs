//! The prefill GEMM on AMX tiles (Sapphire Rapids and later) for 4- and 8-bit weights.
//!
//! `tdpbf16ps` multiplies a 16×32 and a 32×16 bf16 tile into 16×16 f32 accumulators: about ten
//! times the multiply-adds per cycle of 512-bit FMAs. Both operands are made exact in bf16: the
//! weights as their integers (at most 255, within bf16's 8 significant bits) and each activation
//! as the sum of three bf16, its f32 bits cut into three 8-bit pieces. The products are then
//! those of f32 and are summed in f32, as the FMA kernels sum them; each group's sums meet its
//! scale and bias (`y += s·Σq·x + b·Σx`) as in the GEMV.
//!
//! Tiles 0-1 accumulate 16 activation rows × two blocks of 16 weight rows; tiles 2-5 hold those
//! weight rows' integers for 64 columns (per 32 columns a 16×16 grid of bf16 pairs, pairs along
//! K, as the instruction takes its second operand); tiles 6 and 7 alternate pieces of 16
//! activation rows × 32 columns.
//! The instructions are written in `asm!`: Rust's AMX intrinsics are not stable.

use std::arch::asm;
use std::arch::x86_64::*;
use std::sync::OnceLock;

use super::avx2::Elem;
use super::pool::{self, SharedMut};
use super::{with_scratch, with_task_scratch};
use crate::params::FloatSlice;
use crate::params::QuantizedView;

/// Rows of a tile, and bytes of each row.
const TILE_ROWS: usize = 16;
const TILE_BYTES: usize = 64;
/// Columns of K per tile: 32 bf16.
const TILE_K: usize = 32;
/// Weight rows per tile of integers, and blocks of them accumulated together.
const BLOCK_N: usize = 16;
const BLOCKS: usize = 2;
/// Weight rows per pool task: each task streams all the activations' pieces once per group
/// (from L2: a group's are `m × g × 6` bytes), so tasks are several pairs of blocks.
const TASK_N: usize = 6 * BLOCKS * BLOCK_N;
/// bf16 pieces per activation.
const PIECES: usize = 3;

/// Whether this processor has AMX-BF16 tiles and Linux lets this process use them, asked once.
pub(super) fn detected() -> bool {
    static OK: OnceLock<bool> = OnceLock::new();
    *OK.get_or_init(|| {
        // SAFETY: CPUID and XGETBV only read processor state; XGETBV runs only where CPUID
        // says the OS enabled it.
        let (tile, bf16, os) = unsafe {
            let leaf7 = __cpuid_count(7, 0);
            let osxsave = __cpuid(1).ecx & (1 << 27) != 0;
            // XCR0 bits 17 and 18: the OS saves tile configuration and data.
            let os = osxsave && xcr0() & (0b11 << 17) == 0b11 << 17;
            (leaf7.edx & (1 << 24) != 0, leaf7.edx & (1 << 22) != 0, os)
        };
        tile && bf16 && os && request_tile_permission()
    })
}

#[target_feature(enable = "xsave")]
unsafe fn xcr0() -> u64 {
    _xgetbv(0)
}

/// Asks Linux for the tile data state (`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`),
/// without which the first tile instruction faults. The permission is the process's.
#[cfg(target_os = "linux")]
fn request_tile_permission() -> bool {
    const SYS_ARCH_PRCTL: i64 = 158;
    const ARCH_REQ_XCOMP_PERM: i64 = 0x1023;
    const XFEATURE_XTILEDATA: i64 = 18;
    let ret: i64;
    // SAFETY: a system call that only changes this process's permissions; it clobbers rcx and
    // r11 and nothing else.
    unsafe {
        asm!(
            "syscall",
            inlateout("rax") SYS_ARCH_PRCTL => ret,
            in("rdi") ARCH_REQ_XCOMP_PERM,
            in("rsi") XFEATURE_XTILEDATA,
            lateout("rcx") _,
            lateout("r11") _,
            options(nostack)
        );
    }
    ret == 0
}

#[cfg(not(target_os = "linux"))]
fn request_tile_permission() -> bool {
    false
}

/// Activation rows from which the tiles beat the FMA kernels: each weight tile is unpacked for
/// the whole batch, which fewer rows do not repay.
const MIN_ROWS: usize = 32;

/// Whether the tile GEMM takes `w` against `m` activation rows.
pub(super) fn supports(w: &QuantizedView, m: usize) -> bool {
    matches!(w.bits, 4 | 8) && m >= MIN_ROWS
}

/// `y[m, rows] = x[m, cols] · Wᵀ` on tiles. The caller checked [`detected`], [`supports`] and the
/// operands' lengths.
pub(super) fn gemm(w: &QuantizedView, x: &[f32], m: usize, y: &mut [f32]) {
    let (n, k, g) = (w.rows, w.cols, w.group_size);
    let groups = k / g;
    let m_pad = m.next_multiple_of(TILE_ROWS);
    // The activations' pieces (bf16 bits) and their sums per group. Each piece is laid out by
    // 32 columns, `[k / 32][row][32]`, rows padded with zeros to whole tiles, so that a group's
    // tiles lie together: with rows `2k` bytes apart they would crowd a few cache sets.
    let piece_len = m_pad * k;
    with_scratch(PIECES * piece_len / 2 + m_pad * groups, |s| {
        let (p, sums) = s.split_at_mut(PIECES * piece_len / 2);
        let pieces: &mut [u16] = bytemuck::cast_slice_mut(p);
        pieces.fill(0);
        let (p0, rest) = pieces.split_at_mut(piece_len);
        let (p1, p2) = rest.split_at_mut(piece_len);
        for (i, xi) in x.chunks_exact(k).take(m).enumerate() {
            // SAFETY: the caller checked the processor (AMX implies AVX-512).
            unsafe { split(xi, i, m_pad, [&mut *p0, &mut *p1, &mut *p2]) };
            for (s, xg) in sums[i * groups..(i + 1) * groups]
                .iter_mut()
                .zip(xi.chunks_exact(g))
            {
                *s = xg.iter().sum();
            }
        }
        sums[m * groups..].fill(0.0);
        let pieces = [&*p0, &*p1, &*p2];
        let sums = &*sums;
        let out = SharedMut::new(&mut y[..m * n]);
        pool::parallel_for(n.div_ceil(TASK_N), &|t| {
            let rows = t * TASK_N..(t * TASK_N + TASK_N).min(n);
            let job = Job {
                w,
                pieces,
                sums,
                m,
                m_pad,
                out,
            };
            match (w.scales, w.biases) {
                (FloatSlice::F32(s), FloatSlice::F32(b)) => job.rows(s, b, rows),
                (FloatSlice::F16(s), FloatSlice::F16(b)) => job.rows(s, b, rows),
                (FloatSlice::BF16(s), FloatSlice::BF16(b)) => job.rows(s, b, rows),
                _ => unreachable!("scales and biases share a dtype"),
            }
        });
    })
}

/// Cuts activation row `row` into three bf16 (as bits) that sum to it exactly, each piece the
/// top 8 significant bits of what the earlier ones left (so the third holds the last 8 bits
/// whole), stored as `[k / 32][row][32]` of `m_pad` rows.
#[target_feature(enable = "avx512f")]
unsafe fn split(x: &[f32], row: usize, m_pad: usize, mut pieces: [&mut [u16]; PIECES]) {
    let n = x.len();
    assert!(n.is_multiple_of(TILE_K) && row < m_pad && pieces.iter().all(|p| p.len() >= m_pad * n));
    let top = _mm512_set1_epi32(0xffff_0000u32 as i32);
    for c in (0..n).step_by(16) {
        let v = _mm512_loadu_ps(x.as_ptr().add(c));
        let h = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v), top));
        let r = _mm512_sub_ps(v, h);
        let m = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(r), top));
        let l = _mm512_sub_ps(r, m);
        let at = (c / TILE_K * m_pad + row) * TILE_K + c % TILE_K;
        for (piece, p) in [h, m, l].into_iter().zip(pieces.iter_mut()) {
            let bits = _mm512_srli_epi32::<16>(_mm512_castps_si512(piece));
            _mm256_storeu_si256(p.as_mut_ptr().add(at).cast(), _mm512_cvtepi32_epi16(bits));
        }
    }
}

/// What every task of one GEMM shares.
#[derive(Clone, Copy)]
struct Job<'a> {
    w: &'a QuantizedView<'a>,
    pieces: [&'a [u16]; PIECES],
    sums: &'a [f32],
    m: usize,
    m_pad: usize,
    out: SharedMut<f32>,
}

/// The tile configuration: palette 1, tiles 0-7 of 16 rows × 64 bytes.
#[repr(C, align(64))]
struct TileConfig([u8; 64]);

impl TileConfig {
    fn new() -> TileConfig {
        let mut c = [0u8; 64];
        c[0] = 1;
        for t in 0..8 {
            c[16 + 2 * t..18 + 2 * t].copy_from_slice(&(TILE_BYTES as u16).to_le_bytes());
            c[48 + t] = TILE_ROWS as u8;
        }
        TileConfig(c)
    }
}

/// `tdpbf16ps` into accumulator `$c` from activations tile `$a` and weight tile `$b`.
macro_rules! tdp {
    ($c:literal, $a:literal, $b:literal) => {
        asm!(
            concat!("tdpbf16ps tmm", $c, ", tmm", $a, ", tmm", $b),
            options(nostack)
        )
    };
}

/// `tileloadd` of tile `$t` from `$p`, rows `$stride` bytes apart.
macro_rules! tile_load {
    ($t:literal, $p:expr, $stride:expr) => {
        asm!(
            concat!("tileloadd tmm", $t, ", [{p} + {s}*1]"),
            p = in(reg) $p,
            s = in(reg) $stride,
            options(nostack, readonly)
        )
    };
}

/// `tilestored` of tile `$t` to `$p`, rows `$stride` bytes apart.
macro_rules! tile_store {
    ($t:literal, $p:expr, $stride:expr) => {
        asm!(
            concat!("tilestored [{p} + {s}*1], tmm", $t),
            p = in(reg) $p,
            s = in(reg) $stride,
            options(nostack)
        )
    };
}

impl Job<'_> {
    /// Output columns `rows` (weight rows) for every activation row.
    fn rows<T: Elem>(&self, scales: &[T], biases: &[T], rows: std::ops::Range<usize>) {
        let w = self.w;
        let (n, k, g) = (w.rows, w.cols, w.group_size);
        let groups = k / g;
        let nr = rows.len();
        // Per task: the weight tiles of one group; the rows' scales and biases as f32 by group
        // (`[group][row]`, zero past the rows); two tile stores per pair of accumulators; and
        // the task's outputs `[row][column]`, contiguous (the output's rows lie `4n` bytes apart,
        // which would crowd a few cache sets over the groups' passes).
        let ktiles = g / TILE_K;
        let tiles_len = ktiles * BLOCKS * TILE_ROWS * TILE_BYTES / 4;
        let table = groups * TASK_N;
        let store = BLOCKS * TILE_ROWS * BLOCK_N;
        let stash_len = if ktiles > 2 {
            self.m_pad * BLOCKS * BLOCK_N
        } else {
            0
        };
        let out_len = self.m_pad * TASK_N;
        with_task_scratch(tiles_len + 2 * table + store + stash_len + out_len, |s| {
            let (tiles, s) = s.split_at_mut(tiles_len);
            let tiles: &mut [u32] = bytemuck::cast_slice_mut(tiles);
            let (sc, s) = s.split_at_mut(table);
            let (bi, s) = s.split_at_mut(table);
            let (acc, s) = s.split_at_mut(store);
            let (stash, ys) = s.split_at_mut(stash_len);
            for (gi, (sc, bi)) in sc
                .chunks_exact_mut(TASK_N)
                .zip(bi.chunks_exact_mut(TASK_N))
                .enumerate()
            {
                for (j, (s, b)) in sc.iter_mut().zip(bi.iter_mut()).enumerate() {
                    let (ss, bb) = if j < nr {
                        let at = (rows.start + j) * groups + gi;
                        (scales[at].to_f32(), biases[at].to_f32())
                    } else {
                        (0.0, 0.0)
                    };
                    (*s, *b) = (ss, bb);
                }
            }
            // SAFETY: the caller checked the processor and the permission; every tile access
            // below stays within the buffers, as `sweep` checks.
            unsafe {
                let cfg = TileConfig::new();
                asm!("ldtilecfg [{}]", in(reg) cfg.0.as_ptr(), options(nostack, readonly));
                // Groups outside, so that a group's activations stay in L2 for every pair.
                for gi in 0..groups {
                    for c0 in (0..nr).step_by(BLOCKS * BLOCK_N) {
                        let n0 = rows.start + c0;
                        self.unpack(n0, (rows.end - n0).min(BLOCKS * BLOCK_N), gi, tiles);
                        let at = gi * TASK_N + c0;
                        let sb = (
                            &sc[at..at + BLOCKS * BLOCK_N],
                            &bi[at..at + BLOCKS * BLOCK_N],
                        );
                        self.sweep(gi, tiles, sb, (&mut *acc, &mut *stash), &mut ys[c0..]);
                    }
                }
                asm!("tilerelease", options(nostack));
            }
            for (row, yr) in ys.chunks_exact(TASK_N).take(self.m).enumerate() {
                // SAFETY: this task owns columns `rows` of every output row.
                let out = unsafe { self.out.range(row * n + rows.start, nr) };
                out.copy_from_slice(&yr[..nr]);
            }
        })
    }

    /// The integers of weight rows `n0..n0 + rows` (at most two blocks), group `gi`, as tiles:
    /// for each 32 columns, each block a 16×16 grid of bf16 pairs, pair `k'` of row `n` at
    /// `[k'][n]`. Rows past `rows` are zero.
    fn unpack(&self, n0: usize, rows: usize, gi: usize, tiles: &mut [u32]) {
        let w = self.w;
        let (k, g) = (w.cols, w.group_size);
        let bytes: &[u8] = bytemuck::cast_slice(w.packed);
        let grid = TILE_ROWS * BLOCK_N;
        for (kt, kt_tiles) in tiles.chunks_exact_mut(BLOCKS * grid).enumerate() {
            let col0 = gi * g + kt * TILE_K;
            for (b, tile) in kt_tiles.chunks_exact_mut(grid).enumerate() {
                for nl in 0..BLOCK_N {
                    let r = b * BLOCK_N + nl;
                    for kp in 0..TILE_ROWS {
                        tile[kp * BLOCK_N + nl] = if r < rows {
                            let e = (n0 + r) * k + col0 + 2 * kp;
                            if w.bits == 4 {
                                NIBBLE_PAIRS[bytes[e / 2] as usize]
                            } else {
                                bf16_int(bytes[e]) | bf16_int(bytes[e + 1]) << 16
                            }
                        } else {
                            0
                        };
                    }
                }
            }
        }
    }

    /// Group `gi` of one pair of weight-row blocks (their tiles in `tiles`) against every
    /// activation row: tile products, then `y += s·C + b·Σx` into `ys` (rows `TASK_N` apart).
    ///
    /// A tile load costs about as much as two products and a load into a tile that products
    /// still read waits for them (tiles are not renamed), so the weight tiles of up to 64
    /// columns stay loaded for every activation block, each activation tile meets both weight
    /// blocks, and activation loads alternate between two tiles. Groups of 128 go in two halves,
    /// the accumulators parked in `stash` between them.
    ///
    /// # Safety
    /// The tile configuration must be loaded and the processor must have AMX and AVX-512.
    #[target_feature(enable = "avx512f")]
    unsafe fn sweep(
        &self,
        gi: usize,
        tiles: &[u32],
        (sc, bi): (&[f32], &[f32]),
        (acc, stash): (&mut [f32], &mut [f32]),
        ys: &mut [f32],
    ) {
        let k = self.w.cols;
        let ktiles = self.w.group_size / TILE_K;
        let groups = k / self.w.group_size;
        let grid = TILE_ROWS * BLOCK_N;
        let blocks = self.m_pad / TILE_ROWS;
        let halves = ktiles.div_ceil(2);
        assert!(
            tiles.len() >= ktiles * BLOCKS * grid
                && acc.len() >= BLOCKS * grid
                && (halves == 1 || stash.len() >= blocks * BLOCKS * grid)
                && sc.len() >= BLOCKS * BLOCK_N
                && bi.len() >= BLOCKS * BLOCK_N
                && self.pieces.iter().all(|p| p.len() >= self.m_pad * k)
                && self.sums.len() >= self.m_pad * groups
                && ys.len() >= (self.m_pad - 1) * TASK_N + BLOCKS * BLOCK_N
        );
        // Piece `$p` of activation block `mb`, column tile `$kt` of the group, into tile `$a`,
        // then its products with weight tiles `$b0`, `$b1` into accumulators 0 and 1.
        macro_rules! piece {
            ($mb:expr, $kt:expr, $p:literal, $a:literal, $b0:literal, $b1:literal) => {{
                let col = gi * ktiles + $kt;
                let at = self.pieces[$p]
                    .as_ptr()
                    .add((col * self.m_pad + $mb * TILE_ROWS) * TILE_K);
                tile_load!($a, at, TILE_BYTES);
                tdp!(0, $a, $b0);
                tdp!(1, $a, $b1);
            }};
        }
        for half in 0..halves {
            // Weight tiles 2-3 for the half's first 32 columns, 4-5 for its second.
            let kt0 = 2 * half;
            let two = kt0 + 1 < ktiles;
            let wt = tiles.as_ptr().add(kt0 * BLOCKS * grid);
            tile_load!(2, wt, TILE_BYTES);
            tile_load!(3, wt.add(grid), TILE_BYTES);
            if two {
                tile_load!(4, wt.add(2 * grid), TILE_BYTES);
                tile_load!(5, wt.add(3 * grid), TILE_BYTES);
            }
            for mb in 0..blocks {
                let parked = stash.as_mut_ptr().add(mb * BLOCKS * grid);
                if half == 0 {
                    asm!("tilezero tmm0", "tilezero tmm1", options(nostack));
                } else {
                    tile_load!(0, parked, TILE_BYTES);
                    tile_load!(1, parked.add(grid), TILE_BYTES);
                }
                piece!(mb, kt0, 0, 6, 2, 3);
                piece!(mb, kt0, 1, 7, 2, 3);
                piece!(mb, kt0, 2, 6, 2, 3);
                if two {
                    piece!(mb, kt0 + 1, 0, 7, 4, 5);
                    piece!(mb, kt0 + 1, 1, 6, 4, 5);
                    piece!(mb, kt0 + 1, 2, 7, 4, 5);
                }
                if half + 1 < halves {
                    tile_store!(0, parked, TILE_BYTES);
                    tile_store!(1, parked.add(grid), TILE_BYTES);
                } else {
                    let pa = acc.as_mut_ptr();
                    tile_store!(0, pa, TILE_BYTES);
                    tile_store!(1, pa.add(grid), TILE_BYTES);
                    self.scale_into(mb, gi, pa, (sc, bi), ys);
                }
            }
        }
    }

    /// `ys[row][col] += s[col]·C[row][col] + b[col]·Σx[row]` for the rows of activation block
    /// `mb`, `C` the stored accumulators at `c` (two blocks of 16×16).
    #[target_feature(enable = "avx512f")]
    unsafe fn scale_into(
        &self,
        mb: usize,
        gi: usize,
        c: *const f32,
        (sc, bi): (&[f32], &[f32]),
        ys: &mut [f32],
    ) {
        let groups = self.w.cols / self.w.group_size;
        let first = gi == 0;
        for b in 0..BLOCKS {
            let s = _mm512_loadu_ps(sc.as_ptr().add(b * BLOCK_N));
            let bias = _mm512_loadu_ps(bi.as_ptr().add(b * BLOCK_N));
            for r in 0..TILE_ROWS {
                let row = mb * TILE_ROWS + r;
                let cv = _mm512_loadu_ps(c.add((b * TILE_ROWS + r) * BLOCK_N));
                let sum = _mm512_set1_ps(self.sums[row * groups + gi]);
                let y = ys.as_mut_ptr().add(row * TASK_N + b * BLOCK_N);
                let old = if first {
                    _mm512_setzero_ps()
                } else {
                    _mm512_loadu_ps(y)
                };
                _mm512_storeu_ps(y, _mm512_fmadd_ps(bias, sum, _mm512_fmadd_ps(cv, s, old)));
            }
        }
    }
}

/// The bf16 bits of a small integer (exact: at most 8 significant bits).
const fn bf16_int(v: u8) -> u32 {
    (v as f32).to_bits() >> 16
}

/// For each byte of two 4-bit integers: their bf16 bits, low nibble in the low half.
static NIBBLE_PAIRS: [u32; 256] = {
    let mut t = [0u32; 256];
    let mut i = 0;
    while i < 256 {
        t[i] = bf16_int((i & 15) as u8) | bf16_int((i >> 4) as u8) << 16;
        i += 1;
    }
    t
};
