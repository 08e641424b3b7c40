//! Launchers of the recurrent layers' kernels (`kernels/recurrent.cu`): the causal convolution,
//! the gated delta rule and Mamba-2's selective scan.
//!
//! Shapes are checked by the callers in [`crate::ops`]; these take buffers of the right lengths,
//! and kernel arguments are raw device addresses, so that an op may read and write one buffer.

use super::launch::{blocks, elements, int, sliced_blocks, Result};
use super::{Arg, Buffer, Gpu};
use crate::EngineError;

pub fn causal_conv1d(
    x: &Buffer,
    weight: &Buffer,
    state: &mut Buffer,
    channels: usize,
    kernel: usize,
) -> Result<Buffer> {
    conv_kernel_fits(kernel)?;
    let g = x.gpu().clone();
    let tokens = x.len() / channels;
    let out = g.output(x.len())?;
    launch!(&g, "causal_conv1d", blocks(channels.div_ceil(128), 128);
        x.ptr(), weight.ptr(), state.ptr(), out.ptr(), int(tokens)?, int(channels)?, int(kernel)?);
    Ok(out)
}

/// The conv1d kernels hold at most 8 taps in registers.
fn conv_kernel_fits(kernel: usize) -> Result<()> {
    if kernel > 8 {
        return Err(EngineError::Shape(format!(
            "conv1d kernel {kernel} over the GPU's 8"
        )));
    }
    Ok(())
}

/// [`causal_conv1d`] of one token of each sequence: row `s` of `x` continues from the state at
/// `states[s]`.
pub fn causal_conv1d_batch(
    x: &Buffer,
    weight: &Buffer,
    states: &[u64],
    channels: usize,
    kernel: usize,
) -> Result<Buffer> {
    conv_kernel_fits(kernel)?;
    let g = x.gpu().clone();
    let table = g.addresses(states)?;
    let out = g.output(x.len())?;
    launch!(&g, "causal_conv1d_batch", sliced_blocks(channels.div_ceil(128), states.len(), 128);
        x.ptr(), weight.ptr(), table.ptr(), out.ptr(), int(channels)?, int(kernel)?);
    Ok(out)
}

pub fn delta_gates(
    a: &Buffer,
    b: &Buffer,
    dt_bias: &Buffer,
    neg_a: &Buffer,
) -> Result<(Buffer, Buffer)> {
    let g = a.gpu().clone();
    let (decay, beta) = (g.output(a.len())?, g.output(a.len())?);
    launch!(&g, "delta_gates", elements(&g, a.len());
        a.ptr(), b.ptr(), dt_bias.ptr(), neg_a.ptr(), decay.ptr(), beta.ptr(), a.len() as i64,
        int(dt_bias.len())?);
    Ok((decay, beta))
}

/// Mamba-2's step and decay per token and head (`ssm_gates` in the kernels).
pub fn ssm_gates(
    a: &Buffer,
    dt_bias: &Buffer,
    neg_a: &Buffer,
    (lo, hi): (f32, f32),
) -> Result<(Buffer, Buffer)> {
    let g = a.gpu().clone();
    let (decay, dt) = (g.output(a.len())?, g.output(a.len())?);
    launch!(&g, "ssm_gates", elements(&g, a.len());
        a.ptr(), dt_bias.ptr(), neg_a.ptr(), decay.ptr(), dt.ptr(), a.len() as i64,
        int(dt_bias.len())?, lo, hi);
    Ok((decay, dt))
}

/// The kernels of a recurrent scan: the gated delta rule, or with Mamba-2's `skip` (its heads'
/// D) the selective state-space scan.
fn scan_kernel(skip: Option<&Buffer>) -> (&'static str, u64) {
    match skip {
        None => ("gated_delta", 0),
        Some(d) => ("ssm_scan", d.ptr()),
    }
}

/// One sequence's tokens through a recurrent scan (see [`scan_kernel`]): `w` is the delta
/// rule's write strength β or Mamba-2's step Δ.
#[allow(clippy::too_many_arguments)]
pub fn recurrent_scan(
    q: &Buffer,
    k: &Buffer,
    v: &Buffer,
    decay: &Buffer,
    w: &Buffer,
    skip: Option<&Buffer>,
    state: &mut Buffer,
    dims: crate::params::DeltaRuleDims,
) -> Result<Buffer> {
    let g = q.gpu().clone();
    let tokens = decay.len() / dims.v_heads;
    let per_lane = delta_lanes(dims)?;
    let y = g.output(v.len())?;
    let rows = dims.v_heads * dims.v_dim;
    let (name, skip) = scan_kernel(skip);
    launch!(&g, &format!("{name}_{per_lane}"), blocks(rows.div_ceil(4), 128);
        q.ptr(), k.ptr(), v.ptr(), decay.ptr(), w.ptr(), skip, state.ptr(), y.ptr(),
        int(tokens)?, int(dims.k_heads)?, int(dims.v_heads)?, int(dims.k_dim)?,
        int(dims.v_dim)?);
    Ok(y)
}

/// [`recurrent_scan`] of one token of each sequence: row `s` of the inputs updates the state
/// at `states[s]`.
#[allow(clippy::too_many_arguments)]
pub fn recurrent_scan_batch(
    q: &Buffer,
    k: &Buffer,
    v: &Buffer,
    decay: &Buffer,
    w: &Buffer,
    skip: Option<&Buffer>,
    states: &[u64],
    dims: crate::params::DeltaRuleDims,
) -> Result<Buffer> {
    let g = q.gpu().clone();
    let per_lane = delta_lanes(dims)?;
    let table = g.addresses(states)?;
    let y = g.output(v.len())?;
    let rows = dims.v_heads * dims.v_dim;
    let (name, skip) = scan_kernel(skip);
    launch!(&g, &format!("{name}_batch_{per_lane}"),
        sliced_blocks(rows.div_ceil(4), states.len(), 128);
        q.ptr(), k.ptr(), v.ptr(), decay.ptr(), w.ptr(), skip, table.ptr(), y.ptr(),
        int(dims.k_heads)?, int(dims.v_heads)?, int(dims.k_dim)?, int(dims.v_dim)?);
    Ok(y)
}

/// Key features each lane of the delta-rule kernels holds (their template parameter).
fn delta_lanes(dims: crate::params::DeltaRuleDims) -> Result<usize> {
    [1, 2, 4, 8]
        .into_iter()
        .find(|&e| 32 * e >= dims.k_dim)
        .ok_or_else(|| {
            EngineError::Shape(format!("key head dim {} over the GPU's 256", dims.k_dim))
        })
}
