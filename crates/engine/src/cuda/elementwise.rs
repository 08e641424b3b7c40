//! Launchers of the element-wise kernels (`kernels/elementwise.cu`): arithmetic in place, copies
//! of columns and rows, gathers and scatters, and greedy picks.
//!
//! Shapes are checked by the callers in [`crate::ops`]; these take buffers of the right lengths,
//! and kernel arguments are raw device addresses, so that an op may read and write one buffer.

use super::launch::{blocks, elements, int, Result};
use super::{Arg, Buffer, Gpu};

/// `x[r] = op(x[r], row)` for every row, by the kernels `add_row` and `mul_row`.
pub fn row_op(kernel: &str, x: &mut Buffer, row: &Buffer) -> Result<()> {
    let g = x.gpu().clone();
    launch!(&g, kernel, elements(&g, x.len()); x.ptr(), row.ptr(), x.len() as i64, int(row.len())?);
    Ok(())
}

pub fn scale(x: &mut Buffer, s: f32) -> Result<()> {
    let g = x.gpu().clone();
    launch!(&g, "scale", elements(&g, x.len()); x.ptr(), s, x.len() as i64);
    Ok(())
}

pub fn softcap(x: &mut Buffer, cap: f32) -> Result<()> {
    let g = x.gpu().clone();
    launch!(&g, "softcap", elements(&g, x.len()); x.ptr(), cap, x.len() as i64);
    Ok(())
}

/// `x = f(x)` for the unary kernels `silu` and `relu_squared`.
pub fn unary(kernel: &str, x: &mut Buffer) -> Result<()> {
    let g = x.gpu().clone();
    launch!(&g, kernel, elements(&g, x.len()); x.ptr(), x.len() as i64);
    Ok(())
}

/// `x = op(x, y)` for the binary kernels `add`, `mul`, `silu_mul`, `gelu_mul` and `sigmoid_mul`.
pub fn binary(kernel: &str, x: &mut Buffer, y: &Buffer) -> Result<()> {
    let g = x.gpu().clone();
    launch!(&g, kernel, elements(&g, x.len()); x.ptr(), y.ptr(), x.len() as i64);
    Ok(())
}

/// Columns `start..start + width` of every `cols`-wide row.
pub fn columns(x: &Buffer, cols: usize, start: usize, width: usize) -> Result<Buffer> {
    let g = x.gpu().clone();
    let rows = x.len() / cols;
    let out = g.output(rows * width)?;
    launch!(&g, "columns", elements(&g, rows * width);
        x.ptr(), out.ptr(), rows as i64, int(cols)?, int(start)?, int(width)?);
    Ok(out)
}

/// `src` (`[rows, width]`) into columns `start..start + width` of `dst` (`[rows, cols]`).
pub fn place_columns(
    dst: &mut Buffer,
    cols: usize,
    src: &Buffer,
    start: usize,
    width: usize,
) -> Result<()> {
    let g = dst.gpu().clone();
    let rows = src.len() / width.max(1);
    launch!(&g, "place_columns", elements(&g, rows * width);
        src.ptr(), dst.ptr(), rows as i64, int(cols)?, int(start)?, int(width)?);
    Ok(())
}

/// Elements `start..start + len`, copied.
pub fn range(x: &Buffer, start: usize, len: usize) -> Result<Buffer> {
    let g = x.gpu().clone();
    let out = g.output(len)?;
    g.copy(out.ptr(), x.ptr() + 4 * start as u64, 4 * len)?;
    Ok(out)
}

/// Each row's greedy pick (`greedy_rows` in the kernels), row `r` among the columns
/// `allowed[r]` allows where it is given (bit `c % 32` of word `c / 32`; an empty `allowed`
/// leaves every row free): only the picks, two numbers a row, are copied back. The masks go up
/// with the step's other uploads, so a replayed step carries this step's.
pub fn greedy_rows(
    x: &Buffer,
    cols: usize,
    allowed: &[Option<&[u32]>],
) -> Result<Vec<crate::params::Pick>> {
    let g = x.gpu().clone();
    let rows = x.len() / cols;
    if rows == 0 {
        return Ok(Vec::new());
    }
    let words = cols.div_ceil(32);
    let masked = allowed.iter().flatten().count();
    // Held until the launch is queued: outside a step they are allocations of their own.
    let masks = if masked == 0 {
        None
    } else {
        let mut packed = Vec::with_capacity(masked * words);
        let mut mask_of = Vec::with_capacity(rows);
        for mask in allowed {
            match mask {
                Some(mask) => {
                    mask_of.push((packed.len() / words) as i32);
                    packed.extend_from_slice(&mask[..words]);
                }
                None => mask_of.push(-1),
            }
        }
        Some((g.words(&packed)?, g.words(bytemuck::cast_slice(&mask_of))?))
    };
    let (mask_ptr, mask_of_ptr) = masks.as_ref().map_or((0, 0), |(m, o)| (m.ptr(), o.ptr()));
    let launch = |picks: u64| -> Result<()> {
        launch!(&g, "greedy_rows", blocks(rows, 1024);
            x.ptr(), picks, int(cols)?, mask_ptr, mask_of_ptr, int(words)?);
        Ok(())
    };
    if 8 * rows > super::PINNED_DOWNLOAD_BYTES {
        let picks = g.output(2 * rows)?;
        launch(picks.ptr())?;
        return Ok(picks_of(&picks.download()?));
    }
    // Written by the kernel straight into pinned host memory: a decode step's end waits for no
    // copy after its last kernel.
    g.with_pinned(|host, device| {
        launch(device)?;
        g.finish_queued()?;
        // SAFETY: the kernel wrote 2 · rows floats there, and has finished.
        let landed = unsafe { std::slice::from_raw_parts(host.cast::<f32>(), 2 * rows) };
        Ok(picks_of(landed))
    })
}

/// Picks from greedy_rows' pairs (id, log-probability).
fn picks_of(pairs: &[f32]) -> Vec<crate::params::Pick> {
    pairs
        .chunks_exact(2)
        .map(|p| crate::params::Pick {
            id: p[0] as u32,
            logprob: p[1],
        })
        .collect()
}

pub fn gather_rows(x: &Buffer, cols: usize, rows: &[usize]) -> Result<Buffer> {
    let g = x.gpu().clone();
    let idx = g.indices(rows.iter().copied())?;
    let out = g.output(rows.len() * cols)?;
    launch!(&g, "gather_rows", elements(&g, rows.len() * cols);
        x.ptr(), idx.ptr(), out.ptr(), rows.len() as i64, int(cols)?);
    Ok(out)
}

/// `y[rows[i]] += weights[i] · src[i]` (distinct rows).
pub fn scatter_add_rows(
    y: &mut Buffer,
    src: &Buffer,
    cols: usize,
    rows: &[usize],
    weights: &[f32],
) -> Result<()> {
    let g = y.gpu().clone();
    let idx = g.indices(rows.iter().copied())?;
    let w = g.upload(weights)?;
    launch!(&g, "scatter_add_rows", elements(&g, rows.len() * cols);
        y.ptr(), src.ptr(), idx.ptr(), w.ptr(), rows.len() as i64, int(cols)?);
    Ok(())
}
