//! What every launcher shares: kernel arguments from device allocations and launch shapes.

use cudarc::driver::{CudaSlice, DevicePtr, LaunchConfig};

use super::Gpu;
use crate::EngineError;

pub(super) type Result<T> = std::result::Result<T, EngineError>;

/// The raw address of a device allocation.
pub(super) fn addr<T>(gpu: &Gpu, slice: &CudaSlice<T>) -> u64 {
    slice.device_ptr(gpu.stream()).0
}

/// Launches kernel `$name` with `$cfg` and the arguments in order (each an expression of the
/// exact type of the kernel's parameter: u64 for pointers, i32 for int, i64, f32). The callers
/// size the buffers for the indices the kernel computes from them.
macro_rules! launch {
    ($gpu:expr, $name:expr, $cfg:expr; $($arg:expr),* $(,)?) => {{
        let gpu: &Gpu = $gpu;
        gpu.launch($name, $cfg, &[$(Arg::from($arg)),*])?;
    }};
}

pub(super) fn int(v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| EngineError::Shape(format!("{v} does not fit the kernels' int")))
}

/// A grid-stride launch over `n` elements.
pub(super) fn elements(gpu: &Gpu, n: usize) -> LaunchConfig {
    let blocks = n.div_ceil(256).clamp(1, gpu.multiprocessors() * 16);
    LaunchConfig {
        grid_dim: (blocks as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

pub(super) fn blocks(grid: usize, threads: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (grid as u32, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// `grid` blocks of `threads` for each of `slices` (`blockIdx.y`).
pub(super) fn sliced_blocks(grid: usize, slices: usize, threads: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (grid as u32, slices as u32, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// One warp per block for each of `items` and each of their `slices` (`blockIdx.y`).
pub(super) fn sliced_warps(items: usize, slices: usize) -> LaunchConfig {
    sliced_blocks(items, slices, 32)
}
