//! RMS norm and rotations by position (RoPE).

use crate::cpu;
use crate::cuda::{self, Buffer};
use crate::tensor::Storage;
use crate::{Positions, Tensor};

use super::{check, mismatch, pair, Pair, Result, Rotation};

fn check_norm(x: &Tensor, weight: &Tensor) -> Result<()> {
    check(
        !weight.is_empty() && x.len().is_multiple_of(weight.len()),
        || format!("RMSNorm of width {} over {:?}", weight.len(), x.shape()),
    )
}

/// RMSNorm of each `weight.len()`-wide run of `x`: `x / sqrt(mean(x²) + eps) · weight`.
pub fn rms_norm(x: &Tensor, weight: &Tensor, eps: f32) -> Result<Tensor> {
    check_norm(x, weight)?;
    match (&x.storage, &weight.storage) {
        (Storage::Cuda(b), Storage::Cuda(w)) if b.gpu().same(w.gpu()) => {
            let width = weight.len();
            let out = b.gpu().output(x.len())?;
            cuda::norm::rms_norm(b.ptr(), w, out.ptr(), x.len() / width, width, eps)?;
            Ok(Tensor::on_gpu(x.shape().to_vec(), out))
        }
        _ => {
            let mut out = x.try_clone()?;
            rms_norm_inplace(&mut out, weight, eps)?;
            Ok(out)
        }
    }
}

/// [`rms_norm`] in place.
pub fn rms_norm_inplace(x: &mut Tensor, weight: &Tensor, eps: f32) -> Result<()> {
    check_norm(x, weight)?;
    let width = weight.len();
    let rows = x.len() / width;
    match pair("rms_norm", x, weight)? {
        Pair::Host(a, w) => {
            cpu::norm::rms_norm_inplace(a, w, eps);
            Ok(())
        }
        Pair::Cuda(a, w) => cuda::norm::rms_norm(a.ptr(), w, a.ptr(), rows, width, eps),
    }
}

/// Rotary position embedding in place on `x` (`[tokens, heads · head_dim]`): token `t` sits at
/// `positions[t]`; pair `i` of the first `2 · inv_freqs.len()` features of each head turns by
/// `positions[t] · inv_freqs[i]` and is scaled by the amplitude. `traditional` pairs neighbours
/// `(2i, 2i+1)`, otherwise the halves `(i, i + dims/2)`, as `mx.fast.rope` does.
pub fn rope_inplace(
    x: &mut Tensor,
    heads: usize,
    head_dim: usize,
    positions: &Positions,
    rope: Rotation,
) -> Result<()> {
    let Rotation {
        inv_freqs,
        traditional,
        amplitude,
    } = rope;
    check(
        x.len() == positions.len() * heads * head_dim && 2 * inv_freqs.len() <= head_dim,
        || {
            format!(
                "RoPE of {} pairs over {:?} as {} tokens × {heads} heads × {head_dim}",
                inv_freqs.len(),
                x.shape(),
                positions.len()
            )
        },
    )?;
    match pair("rope", x, inv_freqs)? {
        Pair::Host(a, f) => {
            let p = positions.as_slice();
            cpu::norm::rope_inplace(a, heads, head_dim, p, f, traditional, amplitude);
            Ok(())
        }
        Pair::Cuda(a, f) => cuda::norm::rope(
            a,
            heads,
            None,
            head_dim,
            positions.on_gpu()?,
            (f, traditional, amplitude),
        ),
    }
}

/// Llama 4's query scale by position, in place: row `t` of `x` times
/// `1 + beta · ln(1 + ⌊(positions[t] + shift) / period⌋)` (1 until `positions[t] + shift`
/// reaches `period`).
pub fn scale_by_position(
    x: &mut Tensor,
    positions: &Positions,
    beta: f32,
    period: usize,
    shift: usize,
) -> Result<()> {
    check(x.rows() == positions.len() && period > 0, || {
        format!(
            "{} positions for {:?}, period {period}",
            positions.len(),
            x.shape()
        )
    })?;
    let cols = x.cols();
    match &mut x.storage {
        Storage::Host(v) => {
            for (row, &p) in v.chunks_exact_mut(cols).zip(positions.as_slice()) {
                let factor = 1.0 + beta * ((1 + (p + shift) / period) as f32).ln();
                row.iter_mut().for_each(|x| *x *= factor);
            }
            Ok(())
        }
        Storage::Cuda(b) => {
            cuda::norm::scale_by_position(b, cols, positions.on_gpu()?, beta, period, shift)
        }
    }
}

/// [`rope_inplace`] of a layer's queries `q` (`heads` a token) and keys `k` (`kv_heads` a
/// token) at the same positions; one launch on a GPU.
#[allow(clippy::too_many_arguments)]
pub fn rope_pair_inplace(
    q: &mut Tensor,
    heads: usize,
    k: &mut Tensor,
    kv_heads: usize,
    head_dim: usize,
    positions: &Positions,
    rope: Rotation,
) -> Result<()> {
    let Rotation {
        inv_freqs,
        traditional,
        amplitude,
    } = rope;
    if let (Storage::Cuda(qb), Storage::Cuda(kb), Storage::Cuda(f)) =
        (&mut q.storage, &mut k.storage, &inv_freqs.storage)
    {
        let fits = |b: &Buffer, h: usize| b.len() == positions.len() * h * head_dim;
        if fits(qb, heads) && fits(kb, kv_heads) && 2 * f.len() <= head_dim {
            if !(qb.gpu().same(kb.gpu()) && qb.gpu().same(f.gpu())) {
                return Err(mismatch("rope"));
            }
            let y = Some((kb, kv_heads));
            let rotation = (f, traditional, amplitude);
            return cuda::norm::rope(qb, heads, y, head_dim, positions.on_gpu()?, rotation);
        }
    }
    rope_inplace(q, heads, head_dim, positions, rope)?;
    rope_inplace(k, kv_heads, head_dim, positions, rope)
}
