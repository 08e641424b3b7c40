//! The ops the models are written in, on [`Tensor`]s wherever they live: each checks shapes,
//! then runs the CPU kernels (`crate::cpu`) on host tensors or the CUDA kernels
//! (`crate::cuda`) on GPU tensors. Operands must share a device.

mod attention;
mod elementwise;
pub mod experts;
mod matmul;
mod norm;
pub mod recurrent;

pub use attention::*;
pub use elementwise::*;
pub use matmul::*;
pub use norm::*;

use crate::cuda::Buffer;
pub use crate::params::{Heads, Pick};
use crate::tensor::Storage;
use crate::{EngineError, Tensor};

type Result<T> = std::result::Result<T, EngineError>;

/// Two operands' storage, known to be on one device.
enum Pair<'a> {
    Host(&'a mut Vec<f32>, &'a [f32]),
    Cuda(&'a mut Buffer, &'a Buffer),
}

fn pair<'a>(op: &str, x: &'a mut Tensor, y: &'a Tensor) -> Result<Pair<'a>> {
    match (&mut x.storage, &y.storage) {
        (Storage::Host(a), Storage::Host(b)) => Ok(Pair::Host(a, b)),
        (Storage::Cuda(a), Storage::Cuda(b)) if a.gpu().same(b.gpu()) => Ok(Pair::Cuda(a, b)),
        _ => Err(mismatch(op)),
    }
}

fn mismatch(op: &str) -> EngineError {
    EngineError::Device(format!("{op}: operands are on different devices"))
}

fn check(ok: bool, what: impl FnOnce() -> String) -> Result<()> {
    if ok {
        Ok(())
    } else {
        Err(EngineError::Shape(what()))
    }
}

fn same_len(op: &str, x: &Tensor, y: &Tensor) -> Result<()> {
    check(x.len() == y.len(), || {
        format!("{op}: {:?} and {:?} differ in size", x.shape(), y.shape())
    })
}

/// `shape` with its last axis replaced by `last`.
fn with_last(shape: &[usize], last: usize) -> Vec<usize> {
    let mut s = shape.to_vec();
    match s.last_mut() {
        Some(l) => *l = last,
        None => s.push(last),
    }
    s
}
