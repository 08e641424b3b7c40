//! Launchers of the norm and rotation kernels (`kernels/norm.cu`): RMS norm and RoPE.
//!
//! Shapes are checked by the callers in [`crate::ops`]; these take buffers of the right lengths,
//! and kernel arguments are raw device addresses, so that an op may read and write one buffer.

use super::launch::{blocks, elements, int, Result};
use super::{Arg, Buffer, Gpu, GpuPositions};

/// RMSNorm of each `cols`-wide row of `x` into `out` (which may be `x`'s own address).
pub fn rms_norm(
    x: u64,
    weight: &Buffer,
    out: u64,
    rows: usize,
    cols: usize,
    eps: f32,
) -> Result<()> {
    let g = weight.gpu().clone();
    let threads = if cols >= 1024 { 512 } else { 128 };
    launch!(&g, "rms_norm", blocks(rows, threads); x, weight.ptr(), out, int(cols)?, eps);
    Ok(())
}

/// Row `t` of `x` (`cols` wide) times `1 + beta · ln(1 + ⌊(positions[t] + shift) / period⌋)`.
pub fn scale_by_position(
    x: &mut Buffer,
    cols: usize,
    positions: GpuPositions,
    beta: f32,
    period: usize,
    shift: usize,
) -> Result<()> {
    let g = x.gpu().clone();
    launch!(&g, "scale_by_position", elements(&g, x.len());
        x.ptr(), positions.ptr(), x.len() as i64, int(cols)?, beta, int(period)?, int(shift)?);
    Ok(())
}

/// Rotates `x` (`heads` heads a token) and, when given, `y` (a second tensor of the same
/// tokens: a layer's keys beside its queries) in one launch.
#[allow(clippy::too_many_arguments)]
pub fn rope(
    x: &mut Buffer,
    heads: usize,
    y: Option<(&mut Buffer, usize)>,
    head_dim: usize,
    positions: GpuPositions,
    (inv_freqs, traditional, amplitude): (&Buffer, bool, f32),
) -> Result<()> {
    let g = x.gpu().clone();
    let half = inv_freqs.len();
    let (y_ptr, heads_y) = y.map_or((0, 0), |(y, h)| (y.ptr(), h));
    let pairs = positions.len() * (heads + heads_y) * half;
    launch!(&g, "rope", elements(&g, pairs);
        x.ptr(), y_ptr, positions.ptr(), inv_freqs.ptr(), int(positions.len())?, int(heads)?,
        int(heads_y)?, int(head_dim)?, int(half)?, traditional as i32, amplitude);
    Ok(())
}
