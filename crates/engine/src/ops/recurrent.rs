//! The ops of recurrent sequence mixers (Qwen3.5's gated DeltaNet, Mamba-2) on [`Tensor`]s: a
//! causal depthwise convolution that carries its last inputs between calls, the delta rule's
//! gates and the gated delta rule, and Mamba-2's gates and selective scan. Each runs a whole chunk of tokens in one call, so a prompt is prefilled
//! without a per-token pass through the model; a decode step is the same call with one token.

use super::{check, mismatch, Result};
pub use crate::params::DeltaRuleDims;
use crate::tensor::Storage;
use crate::{cpu, cuda, EngineError, Tensor};

/// The state each token of a chunk continues: every token one sequence's (`states` of one), or
/// token `i` sequence `i`'s (a batched decoding step).
fn tokens_per_state(tokens: usize, states: usize, op: &str) -> Result<usize> {
    match states {
        1 => Ok(tokens),
        n if n == tokens => Ok(1),
        n => Err(EngineError::Shape(format!(
            "{op} of {tokens} tokens over {n} sequences' states"
        ))),
    }
}

/// The host slices of `states`, or `None` where one is not on the host.
fn host_states<'a>(states: &'a mut [&mut Tensor]) -> Option<Vec<&'a mut [f32]>> {
    states
        .iter_mut()
        .map(|s| match &mut s.storage {
            Storage::Host(v) => Some(&mut v[..]),
            Storage::Cuda(_) => None,
        })
        .collect()
}

/// The addresses of `states` on the GPU of `input`, or `None` where one is elsewhere.
fn gpu_states(states: &[&mut Tensor], input: &cuda::Buffer) -> Option<Vec<u64>> {
    states
        .iter()
        .map(|s| match &s.storage {
            Storage::Cuda(b) if b.gpu().same(input.gpu()) => Some(b.ptr()),
            _ => None,
        })
        .collect()
}

/// Causal depthwise 1-D convolution of `x` (`[tokens, channels]`) with `weight`
/// (`[channels, kernel]`), continuing from the inputs before (`[kernel - 1, channels]` per
/// state, oldest first; zeros at the start of a sequence). With one state, `x` is one
/// sequence's tokens; with several, row `i` is the next token of sequence `i` (a batched
/// decoding step). Each state then holds its sequence's last `kernel - 1` inputs.
pub fn causal_conv1d(
    x: &Tensor,
    weight: &Tensor,
    kernel: usize,
    states: &mut [&mut Tensor],
) -> Result<Tensor> {
    let channels = x.cols();
    let tokens = tokens_per_state(x.rows(), states.len(), "conv1d")?;
    check(
        kernel >= 1
            && weight.len() == channels * kernel
            && states.iter().all(|s| s.len() == (kernel - 1) * channels),
        || format!("conv1d of {:?} with kernel {kernel}", x.shape()),
    )?;
    match (&x.storage, &weight.storage) {
        (Storage::Host(x_), Storage::Host(w)) => {
            let states = host_states(states).ok_or_else(|| mismatch("causal_conv1d"))?;
            let mut out = vec![0.0; x_.len()];
            let chunk = tokens * channels;
            for ((x_, out), state) in x_.chunks(chunk).zip(out.chunks_mut(chunk)).zip(states) {
                cpu::recurrent::causal_conv1d(x_, channels, w, kernel, state, out);
            }
            Ok(Tensor::new(x.shape().to_vec(), out))
        }
        (Storage::Cuda(x_), Storage::Cuda(w)) => {
            let out = match &mut states[..] {
                [one] => match &mut one.storage {
                    Storage::Cuda(s) => cuda::recurrent::causal_conv1d(x_, w, s, channels, kernel)?,
                    Storage::Host(_) => return Err(mismatch("causal_conv1d")),
                },
                many => {
                    let table = gpu_states(many, x_).ok_or_else(|| mismatch("causal_conv1d"))?;
                    cuda::recurrent::causal_conv1d_batch(x_, w, &table, channels, kernel)?
                }
            };
            Ok(Tensor::on_gpu(x.shape().to_vec(), out))
        }
        _ => Err(mismatch("causal_conv1d")),
    }
}
/// The decay `g = exp(neg_a · softplus(a + dt_bias))` and write strength `beta = sigmoid(b)`
/// per token and value head, from `a` and `b` (`[tokens, v_heads]`).
pub fn delta_gates(
    a: &Tensor,
    b: &Tensor,
    dt_bias: &Tensor,
    neg_a: &Tensor,
) -> Result<(Tensor, Tensor)> {
    check(
        a.len() == b.len() && dt_bias.len() == neg_a.len() && a.cols() == dt_bias.len(),
        || {
            format!(
                "delta gates of {:?} over {} heads",
                a.shape(),
                dt_bias.len()
            )
        },
    )?;
    let s = a.shape().to_vec();
    match (&a.storage, &b.storage, &dt_bias.storage, &neg_a.storage) {
        (Storage::Host(a_), Storage::Host(b_), Storage::Host(dt), Storage::Host(na)) => {
            let (mut g, mut beta) = (vec![0.0; a_.len()], vec![0.0; a_.len()]);
            cpu::recurrent::delta_gates(a_, b_, dt, na, &mut g, &mut beta);
            Ok((Tensor::new(s.clone(), g), Tensor::new(s, beta)))
        }
        (Storage::Cuda(a_), Storage::Cuda(b_), Storage::Cuda(dt), Storage::Cuda(na)) => {
            let (g, beta) = cuda::recurrent::delta_gates(a_, b_, dt, na)?;
            Ok((Tensor::on_gpu(s.clone(), g), Tensor::on_gpu(s, beta)))
        }
        _ => Err(mismatch("delta_gates")),
    }
}

/// The gated delta rule (Yang, Kautz & Hatamizadeh, "Gated Delta Networks"), as mlx-lm's
/// `gated_delta_ops` computes it, over every token of the chunk: `q`, `k` `[tokens, k_heads ·
/// k_dim]` (normalized and scaled), `v` `[tokens, v_heads · v_dim]`, `g` and `beta`
/// `[tokens, v_heads]`. For each value head, with `S` its `[v_dim, k_dim]` slice of a state:
///
/// ```text
/// S ← g_t · S;   δ = β_t · (v_t − S k_t);   S ← S + δ k_tᵀ;   y_t = S q_t
/// ```
///
/// With one state the tokens are one sequence's; with several, token `i` is the next of
/// sequence `i` (a batched decoding step). Returns `y` (`[tokens, v_heads · v_dim]`); the states
/// are updated in place.
#[allow(clippy::too_many_arguments)]
pub fn gated_delta_rule(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    g: &Tensor,
    beta: &Tensor,
    dims: DeltaRuleDims,
    states: &mut [&mut Tensor],
) -> Result<Tensor> {
    recurrent_scan(q, k, v, g, beta, None, dims, states)
}

/// Mamba-2's step `Δ = clip(softplus(a + dt_bias), limits)` and decay `g = exp(neg_a · Δ)` per
/// token and head, from `a` (`[tokens, heads]`): `(g, Δ)`.
pub fn ssm_gates(
    a: &Tensor,
    dt_bias: &Tensor,
    neg_a: &Tensor,
    limits: (f32, f32),
) -> Result<(Tensor, Tensor)> {
    check(
        dt_bias.len() == neg_a.len() && a.cols() == dt_bias.len(),
        || format!("ssm gates of {:?} over {} heads", a.shape(), dt_bias.len()),
    )?;
    check(limits.0 <= limits.1, || {
        format!("ssm gates clipped to [{}, {}]", limits.0, limits.1)
    })?;
    let s = a.shape().to_vec();
    match (&a.storage, &dt_bias.storage, &neg_a.storage) {
        (Storage::Host(a_), Storage::Host(bias), Storage::Host(na)) => {
            let (mut g, mut dt) = (vec![0.0; a_.len()], vec![0.0; a_.len()]);
            cpu::recurrent::ssm_gates(a_, bias, na, limits, &mut g, &mut dt);
            Ok((Tensor::new(s.clone(), g), Tensor::new(s, dt)))
        }
        (Storage::Cuda(a_), Storage::Cuda(bias), Storage::Cuda(na)) => {
            let (g, dt) = cuda::recurrent::ssm_gates(a_, bias, na, limits)?;
            Ok((Tensor::on_gpu(s.clone(), g), Tensor::on_gpu(s, dt)))
        }
        _ => Err(mismatch("ssm_gates")),
    }
}

/// Mamba-2's selective state-space scan (mlx-lm's `ssm_update`) over every token of the chunk,
/// in [`gated_delta_rule`]'s terms: `q` the output mixing `C` and `k` the input mixing `B`
/// (`[tokens, k_heads · k_dim]`: groups of the state dim), `v` the inputs `x` (`[tokens,
/// v_heads · v_dim]`: heads of the head dim), `g` and `dt` from [`ssm_gates`] and `d` the
/// heads' skip. For each head, with `S` its `[v_dim, k_dim]` slice of a state:
///
/// ```text
/// S ← g_t · S + Δ_t · v_t k_tᵀ;   y_t = S q_t + d · v_t
/// ```
///
/// States and batching as in [`gated_delta_rule`].
#[allow(clippy::too_many_arguments)]
pub fn ssm_scan(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    g: &Tensor,
    dt: &Tensor,
    d: &Tensor,
    dims: DeltaRuleDims,
    states: &mut [&mut Tensor],
) -> Result<Tensor> {
    check(d.len() == dims.v_heads, || {
        format!("a skip of {} over {} heads", d.len(), dims.v_heads)
    })?;
    recurrent_scan(q, k, v, g, dt, Some(d), dims, states)
}

/// [`gated_delta_rule`], or with Mamba-2's skip `d` [`ssm_scan`] (`w` then its step Δ).
#[allow(clippy::too_many_arguments)]
fn recurrent_scan(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    g: &Tensor,
    w: &Tensor,
    d: Option<&Tensor>,
    dims: DeltaRuleDims,
    states: &mut [&mut Tensor],
) -> Result<Tensor> {
    let op = match d {
        None => "gated_delta_rule",
        Some(_) => "ssm_scan",
    };
    let tokens = g.len() / dims.v_heads.max(1);
    let per_state = tokens_per_state(tokens, states.len(), op)?;
    check(
        dims.k_heads > 0
            && dims.v_heads.is_multiple_of(dims.k_heads)
            && g.len() == tokens * dims.v_heads
            && w.len() == g.len()
            && q.len() == tokens * dims.k_heads * dims.k_dim
            && k.len() == q.len()
            && v.len() == tokens * dims.v_heads * dims.v_dim
            && states.iter().all(|s| s.len() == dims.state_len()),
        || format!("{op} of {:?} with {dims:?}", v.shape()),
    )?;
    let s = v.shape().to_vec();
    match (
        &q.storage,
        &k.storage,
        &v.storage,
        &g.storage,
        &w.storage,
        d.map(|d| &d.storage),
    ) {
        (
            Storage::Host(q),
            Storage::Host(k),
            Storage::Host(v),
            Storage::Host(g),
            Storage::Host(w),
            None | Some(Storage::Host(_)),
        ) => {
            let states = host_states(states).ok_or_else(|| mismatch(op))?;
            let skip = match d.map(|d| &d.storage) {
                Some(Storage::Host(d)) => Some(&d[..]),
                _ => None,
            };
            let mut y = vec![0.0; v.len()];
            let (qk, vy, gw) = (
                per_state * dims.k_heads * dims.k_dim,
                per_state * dims.v_heads * dims.v_dim,
                per_state * dims.v_heads,
            );
            let chunks = q
                .chunks(qk)
                .zip(k.chunks(qk))
                .zip(v.chunks(vy).zip(y.chunks_mut(vy)))
                .zip(g.chunks(gw).zip(w.chunks(gw)))
                .zip(states);
            for ((((q, k), (v, y)), (g, w)), state) in chunks {
                cpu::recurrent::recurrent_scan(q, k, v, g, w, skip, dims, state, y);
            }
            Ok(Tensor::new(s, y))
        }
        (
            Storage::Cuda(q),
            Storage::Cuda(k),
            Storage::Cuda(v),
            Storage::Cuda(g),
            Storage::Cuda(w),
            None | Some(Storage::Cuda(_)),
        ) => {
            let skip = match d.map(|d| &d.storage) {
                Some(Storage::Cuda(d)) => Some(d),
                _ => None,
            };
            let y = match &mut states[..] {
                [one] => match &mut one.storage {
                    Storage::Cuda(st) => {
                        cuda::recurrent::recurrent_scan(q, k, v, g, w, skip, st, dims)?
                    }
                    Storage::Host(_) => return Err(mismatch(op)),
                },
                many => {
                    let table = gpu_states(many, q).ok_or_else(|| mismatch(op))?;
                    cuda::recurrent::recurrent_scan_batch(q, k, v, g, w, skip, &table, dims)?
                }
            };
            Ok(Tensor::on_gpu(s, y))
        }
        _ => Err(mismatch(op)),
    }
}
