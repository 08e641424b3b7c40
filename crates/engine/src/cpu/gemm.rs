//! The blocked f32 GEMM both weight formats share, `y[m, n] = x[m, k] · Wᵀ`: weight rows arrive as
//! f32 panels (dequantized, converted or copied into a small tile) and a register-blocked kernel
//! multiplies activation rows by them. Two shapes of kernel:
//!
//! - AVX2 and portable: `MR × NR` dot products of activation rows with panel rows, lanes along
//!   `k`. Loops, outer to inner: `KC` columns, `MC` activation rows (kept in L2), `NC` weight
//!   rows (the panel, kept in L1), `MR` activation rows, `NR` weight rows.
//! - AVX-512 ([`wide`]): the panel is turned column-major, so that a vector holds one column of
//!   sixteen weight rows, and each activation element, broadcast, meets four such vectors: 24
//!   accumulators of 6 activation rows × 64 weight rows, no sums across lanes, and ten loads for
//!   24 FMAs (the dot-product shape needs seven for twelve).
//!
//! Either way a panel is built once for many activation rows, so unpacking is paid once for many
//! rows rather than once per row.

use super::pool::{self, SharedMut};
use super::{with_scratch, with_task_scratch, Isa};

/// Columns per panel; a multiple of every group size, so panels start on a group.
const KC: usize = 512;
/// Weight rows per panel: `NC × KC` f32 is 32 KiB, which stays in L1 while it is swept.
const NC: usize = 16;
/// Activation rows per sweep of the panels: `MC × KC` f32 is 384 KiB, which stays in L2.
const MC: usize = 192;
/// Activation rows × weight rows per kernel call: 12 accumulators, 3 activation vectors and one
/// weight vector fill the 16 AVX2 registers.
const MR: usize = 3;
const NR: usize = 4;

/// A `[rows, cols]` weight matrix seen as f32 panels.
pub(super) trait Panels {
    fn rows(&self) -> usize;
    fn cols(&self) -> usize;
    /// Writes rows `n0..n0 + nc`, columns `k0..k0 + kc` as f32 into `tile`, rows `kc` apart.
    ///
    /// Even f32 weights are copied: rows of the matrix itself lie a power of two apart in typical
    /// shapes, so a panel read in place would crowd a few L1 sets and miss.
    fn panel(&self, isa: Isa, n0: usize, nc: usize, k0: usize, kc: usize, tile: &mut [f32]);

    /// The same rows and columns column-major into `panel` as the AVX-512 kernel reads them
    /// (column `c` of [`wide::NR`] rows at `panel[c · NR..]`, rows past `nc` zero), by way of
    /// `tile` where the matrix writes no such panel directly.
    #[cfg(target_arch = "x86_64")]
    #[allow(clippy::too_many_arguments)]
    fn column_panel(
        &self,
        isa: Isa,
        n0: usize,
        nc: usize,
        k0: usize,
        kc: usize,
        tile: &mut [f32],
        panel: &mut [f32],
    ) {
        column_panel_via_tile(self, isa, (n0, nc, k0, kc), tile, panel);
    }
}

/// [`Panels::column_panel`] through a row-major `tile`: [`Panels::panel`], then transposed.
#[cfg(target_arch = "x86_64")]
pub(super) fn column_panel_via_tile(
    w: &(impl Panels + ?Sized),
    isa: Isa,
    (n0, nc, k0, kc): (usize, usize, usize, usize),
    tile: &mut [f32],
    panel: &mut [f32],
) {
    w.panel(isa, n0, nc, k0, kc, tile);
    // SAFETY: the AVX-512 kernels run only where the processor has them; `tile` holds `nc`
    // rows of `kc` and `panel` `kc · NR` floats.
    unsafe { super::avx512::column_major(tile, nc, kc, panel) };
}

/// Weight rows per pool task, a multiple of [`NC`]: each task re-reads the activations, so
/// tasks are kept large.
const TASK_N: usize = 8 * NC;

/// `y[m, w.rows] = x[m, w.cols] · Wᵀ`, weight rows split over the pool.
pub(super) fn gemm(isa: Isa, w: &(impl Panels + Sync), x: &[f32], m: usize, y: &mut [f32]) {
    let (n, k) = (w.rows(), w.cols());
    assert!(
        x.len() >= m * k && y.len() >= m * n,
        "matmul operands too short"
    );
    if k == 0 {
        y[..m * n].fill(0.0);
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if matches!(isa, Isa::Avx512 | Isa::Amx) {
        return wide::gemm(isa, w, x, m, y);
    }
    // The activations copied once into line-aligned rows of `KC`, one block of columns after
    // another: the kernels' loads then never straddle two lines, and rows lie a small stride
    // apart whatever `k` is.
    let blocks = k.div_ceil(KC);
    with_scratch(blocks * m * KC, |xp| {
        for (kb, block) in xp.chunks_exact_mut(m * KC).enumerate() {
            let (k0, kc) = (kb * KC, KC.min(k - kb * KC));
            for (row, xr) in block.chunks_exact_mut(KC).zip(x.chunks_exact(k)) {
                row[..kc].copy_from_slice(&xr[k0..k0 + kc]);
            }
        }
        let xp = &*xp;
        let y = SharedMut::new(&mut y[..m * n]);
        pool::parallel_for(n.div_ceil(TASK_N), &|t| {
            let (t0, t1) = (t * TASK_N, (t * TASK_N + TASK_N).min(n));
            with_task_scratch(NC * KC, |tile| {
                for (kb, block) in xp.chunks_exact(m * KC).enumerate() {
                    let (k0, kc) = (kb * KC, KC.min(k - kb * KC));
                    for i0 in (0..m).step_by(MC) {
                        let mc = MC.min(m - i0);
                        for n0 in (t0..t1).step_by(NC) {
                            let nc = NC.min(t1 - n0);
                            w.panel(isa, n0, nc, k0, kc, tile);
                            let blk = Block {
                                x: &block[i0 * KC..],
                                xs: KC,
                                w: tile,
                                ws: kc,
                                kc,
                                accumulate: k0 > 0,
                            };
                            blk.run(isa, mc, nc, y, i0 * n + n0, n);
                        }
                    }
                }
            })
        });
    })
}

/// Calls `$k.$f::<MR, NR>()` for the runtime shape `($mr, $nr)`.
macro_rules! by_shape {
    ($mr:expr, $nr:expr, $k:ident . $f:ident) => {
        match ($mr, $nr) {
            (3, 4) => $k.$f::<3, 4>(),
            (3, 3) => $k.$f::<3, 3>(),
            (3, 2) => $k.$f::<3, 2>(),
            (3, 1) => $k.$f::<3, 1>(),
            (2, 4) => $k.$f::<2, 4>(),
            (2, 3) => $k.$f::<2, 3>(),
            (2, 2) => $k.$f::<2, 2>(),
            (2, 1) => $k.$f::<2, 1>(),
            (1, 4) => $k.$f::<1, 4>(),
            (1, 3) => $k.$f::<1, 3>(),
            (1, 2) => $k.$f::<1, 2>(),
            (1, 1) => $k.$f::<1, 1>(),
            _ => unreachable!(),
        }
    };
}

/// Activation rows (stride `xs`) and panel rows (stride `ws`), `kc` columns of each.
struct Block<'a> {
    x: &'a [f32],
    xs: usize,
    w: &'a [f32],
    ws: usize,
    kc: usize,
    /// Add to `y` (a later column block) rather than overwrite it.
    accumulate: bool,
}

impl Block<'_> {
    /// `y[y0 + i·ys + j] (+)= x_i · w_j` for `mc` activation rows and `nc` panel rows: a block
    /// of the output that no other task writes.
    fn run(&self, isa: Isa, mc: usize, nc: usize, y: SharedMut<f32>, y0: usize, ys: usize) {
        for i in (0..mc).step_by(MR) {
            let mr = MR.min(mc - i);
            for j in (0..nc).step_by(NR) {
                let nr = NR.min(nc - j);
                let x = &self.x[i * self.xs..];
                let w = &self.w[j * self.ws..];
                // The AVX2 kernel reads through raw pointers within exactly these bounds.
                assert!(
                    x.len() >= (mr - 1) * self.xs + self.kc
                        && w.len() >= (nr - 1) * self.ws + self.kc
                );
                let y = y.ptr(y0 + i * ys + j, (mr - 1) * ys + nr);
                let k = Kernel {
                    x,
                    xs: self.xs,
                    w,
                    ws: self.ws,
                    kc: self.kc,
                    y,
                    ys,
                    accumulate: self.accumulate,
                };
                match isa {
                    Isa::Portable => by_shape!(mr, nr, k.portable),
                    // SAFETY: the caller checked that the processor has AVX2 and FMA, and the
                    // bounds were asserted above.
                    #[cfg(target_arch = "x86_64")]
                    Isa::Avx2 => unsafe { by_shape!(mr, nr, k.avx2) },
                    #[cfg(target_arch = "x86_64")]
                    Isa::Avx512 | Isa::Amx => unreachable!("AVX-512 takes the wide GEMM"),
                    #[cfg(not(target_arch = "x86_64"))]
                    Isa::Avx2 | Isa::Avx512 | Isa::Amx => unreachable!(),
                }
            }
        }
    }
}

/// One kernel call's operands: `y[i * ys + j] (+)= Σ_c x[i * xs + c] · w[j * ws + c]`.
pub(super) struct Kernel<'a> {
    pub x: &'a [f32],
    pub xs: usize,
    pub w: &'a [f32],
    pub ws: usize,
    pub kc: usize,
    /// `(R - 1)·ys + C` writable floats, written by this kernel alone.
    pub y: *mut f32,
    pub ys: usize,
    pub accumulate: bool,
}

impl Kernel<'_> {
    /// One dot product per output in eight-lane arrays, which the compiler vectorises for any
    /// target (the compiler leaves a register-blocked version in arrays scalar).
    fn portable<const R: usize, const C: usize>(self) {
        for i in 0..R {
            let x = &self.x[i * self.xs..][..self.kc];
            for j in 0..C {
                let s = super::dense::dot_portable(x, &self.w[j * self.ws..][..self.kc]);
                // SAFETY: within the bounds `Block::run` checked, and this kernel's alone.
                let out = unsafe { &mut *self.y.add(i * self.ys + j) };
                *out = if self.accumulate { *out + s } else { s };
            }
        }
    }
}

/// The AVX-512 GEMM on column-major panels (see the module's documentation).
#[cfg(target_arch = "x86_64")]
pub(super) mod wide {
    use super::super::avx512;
    use super::super::pool::{self, SharedMut};
    use super::super::{with_scratch, with_task_scratch, Isa};
    use super::Panels;

    /// Columns per panel: a multiple of every group size; a column-major panel of `NR × KC`
    /// f32 is 32 KiB, in L1 while activation rows sweep it.
    const KC: usize = 128;
    /// Weight rows per panel: four vectors of sixteen.
    pub(in super::super) const NR: usize = 64;
    /// Activation rows per kernel call: 24 accumulators, four weight vectors and a broadcast,
    /// ten loads for 24 FMAs. (In L1 on a Sapphire Rapids core 6 × 64 reaches the FMAs' peak,
    /// 14 × 32 and 8 × 48 about 85% of it.)
    pub(in super::super) const MR: usize = 6;
    /// Kernel calls' worth of activation rows swept per panel (a 512-token prompt in one sweep):
    /// `MC · MR · KC` f32 is 288 KiB, in L2.
    const MC: usize = 96;
    /// Weight rows per pool task.
    const TASK_N: usize = 2 * NR;

    pub(super) fn gemm(isa: Isa, w: &(impl Panels + Sync), x: &[f32], m: usize, y: &mut [f32]) {
        let (n, k) = (w.rows(), w.cols());
        let (blocks, row_blocks) = (k.div_ceil(KC), m.div_ceil(MR));
        // The activations packed once per call, column block by column block: each `MR` rows
        // × `kc` columns column-major, so that a kernel call reads one line after another
        // (rows past `m` are zeros, their outputs never stored).
        let block_len = row_blocks * MR * KC;
        with_scratch(blocks * block_len, |xp| {
            for (kb, block) in xp.chunks_exact_mut(block_len).enumerate() {
                let (k0, kc) = (kb * KC, KC.min(k - kb * KC));
                for (rb, packed) in block.chunks_exact_mut(MR * KC).enumerate() {
                    let packed = &mut packed[..MR * kc];
                    for i in 0..MR {
                        let row = rb * MR + i;
                        if row < m {
                            for (c, &v) in x[row * k + k0..][..kc].iter().enumerate() {
                                packed[c * MR + i] = v;
                            }
                        } else {
                            (0..kc).for_each(|c| packed[c * MR + i] = 0.0);
                        }
                    }
                }
            }
            let xp = &*xp;
            let y = SharedMut::new(&mut y[..m * n]);
            // Sweeps of at most `MC` kernel calls, of even sizes.
            let sweeps = row_blocks.div_ceil(MC);
            let per_sweep = row_blocks.div_ceil(sweeps);
            pool::parallel_for(n.div_ceil(TASK_N), &|t| {
                let (t0, t1) = (t * TASK_N, (t * TASK_N + TASK_N).min(n));
                with_task_scratch(2 * NR * KC, |tile| {
                    let (rows, panel) = tile.split_at_mut(NR * KC);
                    for (kb, block) in xp.chunks_exact(block_len).enumerate() {
                        let (k0, kc) = (kb * KC, KC.min(k - kb * KC));
                        for r0 in (0..row_blocks).step_by(per_sweep) {
                            for n0 in (t0..t1).step_by(NR) {
                                let nc = NR.min(t1 - n0);
                                w.column_panel(isa, n0, nc, k0, kc, rows, panel);
                                for rb in r0..(r0 + per_sweep).min(row_blocks) {
                                    let mr = MR.min(m - rb * MR);
                                    let out = y.ptr(rb * MR * n + n0, (mr - 1) * n + nc);
                                    // SAFETY: as above; the packed block holds `MR · kc`
                                    // floats, and `out` spans the `mr × nc` outputs this task
                                    // alone writes, rows `n` apart.
                                    unsafe {
                                        avx512::gemm_kernel(
                                            &block[rb * MR * KC..][..MR * kc],
                                            &panel[..NR * kc],
                                            kc,
                                            out,
                                            n,
                                            mr,
                                            nc,
                                            kb > 0,
                                        )
                                    };
                                }
                            }
                        }
                    }
                })
            });
        })
    }
}
