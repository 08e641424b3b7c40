//! Launchers of the low-rank update kernels (`kernels/low_rank.cu`): LoRA adapters' updates of a
//! few rows, each row through updates of its own, in two launches whatever the mix, for one
//! layer or for several that read the same input.

use super::launch::{addr, int, sliced_blocks, Result};
use super::{Arg, Buffer, DenseWeights, Gpu};

/// Threads of a `low_rank_down` block.
pub(crate) const LOW_RANK_THREADS: usize = 256;
/// Inputs a `low_rank_down` block takes (four a thread): a decoding step's few rows are
/// spread over the blocks of each row's slices.
pub(crate) const LOW_RANK_SLICE: usize = 4 * LOW_RANK_THREADS;

/// One update's f32 matrices on the GPU: `down` `[rank, inputs]` and `up` `[width, rank]`, and
/// the output (of the launch's) it adds to.
pub struct LowRankWeights<'a> {
    pub down: &'a DenseWeights,
    pub up: &'a DenseWeights,
    pub rank: usize,
    pub scale: f32,
    pub output: usize,
}

/// `y[r] += scale · (x[r] · downᵀ) · upᵀ` for each `(r, update)` of `pairs`, sorted by row and,
/// within a row, in the order its updates add up; `y` the update's output of `outputs` (each
/// `[rows of x, width]` with its width).
pub fn add_low_rank(
    x: &Buffer,
    inputs: usize,
    updates: &[LowRankWeights],
    pairs: &[(usize, usize)],
    outputs: &mut [(&mut Buffer, usize)],
) -> Result<()> {
    let (Some(max_rank), Some(max_width)) = (
        updates.iter().map(|w| w.rank).max(),
        outputs.iter().map(|o| o.1).max(),
    ) else {
        return Ok(());
    };
    if pairs.is_empty() {
        return Ok(());
    }
    let g = x.gpu().clone();
    let rows = x.len() / inputs;
    // The kernels' `LowRankUpdate`: two addresses, the rank and the scale's bits, the output.
    let table: Vec<u64> = updates
        .iter()
        .flat_map(|w| {
            let rank_and_scale = w.rank as u32 as u64 | (w.scale.to_bits() as u64) << 32;
            let (down, up) = (addr(&g, &w.down.data), addr(&g, &w.up.data));
            [down, up, rank_and_scale, w.output as u64]
        })
        .collect();
    let table = g.addresses(&table)?;
    // And `LowRankOutput`: an address and a width.
    let widths: Vec<u64> = (outputs.iter())
        .flat_map(|(y, width)| [y.ptr(), *width as u64])
        .collect();
    let widths = g.addresses(&widths)?;
    let mut row_start = vec![0; rows + 1];
    for &(row, _) in pairs {
        row_start[row + 1] += 1;
    }
    for r in 0..rows {
        row_start[r + 1] += row_start[r];
    }
    // One upload of the pairs' rows, their updates and where each row's begin: the same for
    // every layer of a kind in a step, so staged once.
    let indices = pairs
        .iter()
        .map(|p| p.0)
        .chain(pairs.iter().map(|p| p.1))
        .chain(row_start);
    let indices = g.indices(indices)?;
    let n = pairs.len();
    let (pair_row, pair_update) = (indices.ptr(), indices.ptr() + 4 * n as u64);
    let row_start = indices.ptr() + 8 * n as u64;
    let slices = inputs.div_ceil(LOW_RANK_SLICE);
    let partial = g.scratch(n * slices * max_rank * 4)?;
    launch!(&g, "low_rank_down", sliced_blocks(n, slices, LOW_RANK_THREADS as u32);
        x.ptr(), table.ptr(), pair_row, pair_update, partial.ptr(), int(inputs)?,
        int(max_rank)?);
    let mut up = sliced_blocks(max_width.div_ceil(128), rows, 128);
    up.grid_dim.2 = outputs.len() as u32;
    up.shared_mem_bytes = (max_rank * 4) as u32;
    launch!(&g, "low_rank_up", up;
        widths.ptr(), partial.ptr(), table.ptr(), row_start, pair_update, int(max_rank)?,
        int(slices)?);
    Ok(())
}
