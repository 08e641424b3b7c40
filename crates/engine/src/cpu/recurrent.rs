//! CPU kernels of recurrent sequence mixers (linear attention, state-space layers): a causal
//! depthwise convolution that carries its last inputs between calls, the gated delta rule and
//! Mamba-2's selective state-space scan.
//!
//! Both run a whole chunk of tokens in one call, looping over the tokens inside, so a prompt is
//! prefilled without a per-token pass through the model; a decode step is the same call with one
//! token. Activations and state are f32.

use super::dense::dot;
use crate::params::DeltaRuleDims;

/// Causal depthwise 1-D convolution of `x` (`[tokens, channels]`) continuing from `state`.
///
/// `weight` is `[channels, kernel]`; `state` holds the `kernel - 1` inputs before `x`
/// (`[kernel - 1, channels]`, oldest first, zeros at the start of a sequence). With
/// `input = state ++ x`, `out[t, c] = Σ_j weight[c, j] · input[t + j, c]`, written to `out`
/// (`[tokens, channels]`). Afterwards `state` holds the last `kernel - 1` rows of `input`.
pub fn causal_conv1d(
    x: &[f32],
    channels: usize,
    weight: &[f32],
    kernel: usize,
    state: &mut [f32],
    out: &mut [f32],
) {
    assert!(
        kernel >= 1 && channels > 0,
        "kernel {kernel}, channels {channels}"
    );
    let keep = kernel - 1;
    assert_eq!(weight.len(), channels * kernel, "weight");
    assert_eq!(state.len(), keep * channels, "state");
    assert_eq!(x.len() % channels, 0, "x");
    assert_eq!(out.len(), x.len(), "out");
    let tokens = x.len() / channels;
    let mut input = Vec::with_capacity(state.len() + x.len());
    input.extend_from_slice(state);
    input.extend_from_slice(x);
    for (t, row) in out.chunks_exact_mut(channels).enumerate() {
        let window = &input[t * channels..(t + kernel) * channels];
        for (c, o) in row.iter_mut().enumerate() {
            let w = &weight[c * kernel..(c + 1) * kernel];
            let mut acc = 0.0f32;
            for (j, &wj) in w.iter().enumerate() {
                acc += wj * window[j * channels + c];
            }
            *o = acc;
        }
    }
    state.copy_from_slice(&input[tokens * channels..]);
}

/// Per token and value head, the decay `g = exp(neg_a · softplus(a + dt_bias))` and the write
/// strength `beta = sigmoid(b)` of the delta rule, in f32 as mlx-lm's `compute_g`.
pub fn delta_gates(
    a: &[f32],
    b: &[f32],
    dt_bias: &[f32],
    neg_a: &[f32],
    g: &mut [f32],
    beta: &mut [f32],
) {
    let heads = dt_bias.len();
    for (i, ((&a, &b), (g, beta))) in a.iter().zip(b).zip(g.iter_mut().zip(beta)).enumerate() {
        let z = a + dt_bias[i % heads];
        // `nn.softplus` is `logaddexp(z, 0)`.
        let softplus = z.max(0.0) + (-z.abs()).exp().ln_1p();
        *g = (neg_a[i % heads] * softplus).exp();
        *beta = 1.0 / (1.0 + (-b).exp());
    }
}

/// Per token and head, Mamba-2's step `Δ = clip(softplus(a + dt_bias), limits)` and decay
/// `g = exp(neg_a · Δ)`, in f32 as mlx-lm's `compute_dt`.
pub fn ssm_gates(
    a: &[f32],
    dt_bias: &[f32],
    neg_a: &[f32],
    (lo, hi): (f32, f32),
    g: &mut [f32],
    dt: &mut [f32],
) {
    let heads = dt_bias.len();
    for (i, ((&a, g), dt)) in a.iter().zip(g.iter_mut()).zip(dt).enumerate() {
        let z = a + dt_bias[i % heads];
        let softplus = z.max(0.0) + (-z.abs()).exp().ln_1p();
        *dt = softplus.clamp(lo, hi);
        *g = (neg_a[i % heads] * *dt).exp();
    }
}

/// Mamba-2's selective state-space scan (mlx-lm's `ssm_update`) over every token of the chunk,
/// in the delta rule's terms: `q` the output mixing `C` and `k` the input mixing `B`
/// (`[tokens, k_heads, k_dim]`: groups of the state dim), `v` the inputs `x`
/// (`[tokens, v_heads, v_dim]`: heads of the head dim), per token and head the decay `g` and
/// the step `dt`, and per head the skip `d`. For each head, with `S` its `[v_dim, k_dim]` state:
///
/// ```text
/// S ← g_t · S + Δ_t · v_t k_tᵀ;   y_t = S q_t + d · v_t
/// ```
///
/// `state` (`[v_heads, v_dim, k_dim]`) is updated in place; `y` is `[tokens, v_heads, v_dim]`.
#[allow(clippy::too_many_arguments)]
pub fn ssm_scan(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    dt: &[f32],
    d: &[f32],
    dims: DeltaRuleDims,
    state: &mut [f32],
    y: &mut [f32],
) {
    recurrent_scan(q, k, v, g, dt, Some(d), dims, state, y);
}

/// The gated delta rule (Yang, Kautz & Hatamizadeh, "Gated Delta Networks"), as mlx-lm's
/// `gated_delta_ops` computes it, over every token of the chunk.
///
/// Inputs per token `t`: `q`, `k` `[tokens, k_heads, k_dim]` (already normalized and scaled),
/// `v` `[tokens, v_heads, v_dim]`, and per value head the decay `g` and the write strength `beta`
/// (`[tokens, v_heads]`). For each value head, with `S` its `[v_dim, k_dim]` state:
///
/// ```text
/// S ← g_t · S;   δ = β_t · (v_t − S k_t);   S ← S + δ k_tᵀ;   y_t = S q_t
/// ```
///
/// `state` (`[v_heads, v_dim, k_dim]`) is updated in place; `y` is `[tokens, v_heads, v_dim]`.
#[allow(clippy::too_many_arguments)]
pub fn gated_delta_rule(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: &[f32],
    dims: DeltaRuleDims,
    state: &mut [f32],
    y: &mut [f32],
) {
    recurrent_scan(q, k, v, g, beta, None, dims, state, y);
}

/// [`gated_delta_rule`], or with Mamba-2's skip `d` [`ssm_scan`] (`w` then its step Δ): the
/// shapes, the heads' slices and the rows of their states are the same, only a row's write and
/// output differ.
#[allow(clippy::too_many_arguments)]
pub(crate) fn recurrent_scan(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    w: &[f32],
    d: Option<&[f32]>,
    dims: DeltaRuleDims,
    state: &mut [f32],
    y: &mut [f32],
) {
    let DeltaRuleDims {
        k_heads,
        v_heads,
        k_dim,
        v_dim,
    } = dims;
    assert!(
        k_heads > 0 && v_heads.is_multiple_of(k_heads),
        "{v_heads} value heads over {k_heads} key heads"
    );
    let tokens = g.len() / v_heads;
    assert_eq!(g.len(), tokens * v_heads, "g");
    assert_eq!(w.len(), g.len(), "beta or dt");
    assert!(d.is_none_or(|d| d.len() == v_heads), "d");
    assert_eq!(q.len(), tokens * k_heads * k_dim, "q");
    assert_eq!(k.len(), q.len(), "k");
    assert_eq!(v.len(), tokens * v_heads * v_dim, "v");
    assert_eq!(y.len(), v.len(), "y");
    assert_eq!(state.len(), dims.state_len(), "state");
    let group = v_heads / k_heads;
    for t in 0..tokens {
        for h in 0..v_heads {
            let kh = (t * k_heads + h / group) * k_dim;
            let (qt, kt) = (&q[kh..kh + k_dim], &k[kh..kh + k_dim]);
            let vt = &v[(t * v_heads + h) * v_dim..][..v_dim];
            let yt = &mut y[(t * v_heads + h) * v_dim..][..v_dim];
            let (decay, strength) = (g[t * v_heads + h], w[t * v_heads + h]);
            let head_state = &mut state[h * v_dim * k_dim..(h + 1) * v_dim * k_dim];
            // Each row of S (one value feature) evolves independently of the others.
            for ((row, &vd), yd) in head_state
                .chunks_exact_mut(k_dim)
                .zip(vt)
                .zip(yt.iter_mut())
            {
                for s in row.iter_mut() {
                    *s *= decay;
                }
                let write = match d {
                    None => (vd - dot(row, kt)) * strength,
                    Some(_) => strength * vd,
                };
                for (s, &kj) in row.iter_mut().zip(kt) {
                    *s += kj * write;
                }
                *yd = match d {
                    None => dot(row, qt),
                    Some(d) => dot(row, qt) + d[h] * vd,
                };
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: &[f32], b: &[f32]) -> bool {
        a.len() == b.len() && a.iter().zip(b).all(|(x, y)| (x - y).abs() <= 1e-5)
    }

    /// A deterministic pseudo-random sequence in [-1, 1).
    fn values(n: usize, seed: u32) -> Vec<f32> {
        let mut s = seed.wrapping_mul(2_654_435_761).wrapping_add(1);
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 17;
                s ^= s << 5;
                (s as f32 / u32::MAX as f32) * 2.0 - 1.0
            })
            .collect()
    }

    #[test]
    fn conv1d_matches_the_definition_and_keeps_the_last_inputs() {
        // 2 channels, kernel 3, a state of 2 earlier inputs.
        let weight = [1.0, 2.0, 3.0, -1.0, 0.5, 0.25];
        let mut state = vec![1.0, 10.0, 2.0, 20.0];
        let x = [3.0, 30.0, 4.0, 40.0];
        let mut out = vec![0.0; 4];
        causal_conv1d(&x, 2, &weight, 3, &mut state, &mut out);
        // channel 0: inputs 1 2 3 4; channel 1: 10 20 30 40
        let expected = [
            1.0 + 2.0 * 2.0 + 3.0 * 3.0,
            -10.0 + 0.5 * 20.0 + 0.25 * 30.0,
            2.0 + 2.0 * 3.0 + 3.0 * 4.0,
            -20.0 + 0.5 * 30.0 + 0.25 * 40.0,
        ];
        assert!(close(&out, &expected), "{out:?}");
        assert_eq!(state, [3.0, 30.0, 4.0, 40.0]);
    }

    #[test]
    fn conv1d_in_chunks_equals_conv1d_at_once() {
        let (channels, kernel, tokens) = (5, 4, 9);
        let weight = values(channels * kernel, 1);
        let x = values(tokens * channels, 2);
        let mut state = vec![0.0; (kernel - 1) * channels];
        let mut whole = vec![0.0; x.len()];
        causal_conv1d(&x, channels, &weight, kernel, &mut state, &mut whole);

        let mut chunked_state = vec![0.0; (kernel - 1) * channels];
        let mut chunked = vec![0.0; x.len()];
        // chunks of 1, 2 and 6 tokens: shorter and longer than the kernel
        for (start, end) in [(0, 1), (1, 3), (3, 9)] {
            let (a, b) = (start * channels, end * channels);
            causal_conv1d(
                &x[a..b],
                channels,
                &weight,
                kernel,
                &mut chunked_state,
                &mut chunked[a..b],
            );
        }
        assert!(close(&whole, &chunked));
        assert!(close(&state, &chunked_state));
    }

    #[test]
    fn delta_rule_on_scalars_follows_the_recurrence() {
        // k_dim = v_dim = 1: S is a number.
        let dims = DeltaRuleDims {
            k_heads: 1,
            v_heads: 1,
            k_dim: 1,
            v_dim: 1,
        };
        let (q, k, v) = ([0.5, -1.0], [2.0, 1.0], [3.0, 4.0]);
        let (g, beta) = ([0.9, 0.5], [0.25, 1.0]);
        let mut state = vec![1.0];
        let mut y = vec![0.0; 2];
        gated_delta_rule(&q, &k, &v, &g, &beta, dims, &mut state, &mut y);
        let mut s = 1.0f32;
        let mut expected = Vec::new();
        for t in 0..2 {
            s *= g[t];
            let delta = (v[t] - s * k[t]) * beta[t];
            s += k[t] * delta;
            expected.push(s * q[t]);
        }
        assert!(close(&y, &expected), "{y:?} vs {expected:?}");
        assert!(close(&state, &[s]));
    }

    /// A plain reference with value heads expanded from key heads, as mlx-lm's `mx.repeat` does.
    fn reference(
        q: &[f32],
        k: &[f32],
        v: &[f32],
        g: &[f32],
        beta: &[f32],
        d: DeltaRuleDims,
        state: &mut [f32],
    ) -> Vec<f32> {
        let tokens = g.len() / d.v_heads;
        let mut y = vec![0.0; tokens * d.v_heads * d.v_dim];
        for t in 0..tokens {
            for h in 0..d.v_heads {
                let kh = h / (d.v_heads / d.k_heads);
                let at = |x: &[f32], i| x[(t * d.k_heads + kh) * d.k_dim + i];
                let s = &mut state[h * d.v_dim * d.k_dim..][..d.v_dim * d.k_dim];
                let gt = g[t * d.v_heads + h];
                s.iter_mut().for_each(|x| *x *= gt);
                for i in 0..d.v_dim {
                    let kv: f32 = (0..d.k_dim).map(|j| s[i * d.k_dim + j] * at(k, j)).sum();
                    let delta =
                        (v[(t * d.v_heads + h) * d.v_dim + i] - kv) * beta[t * d.v_heads + h];
                    for j in 0..d.k_dim {
                        s[i * d.k_dim + j] += at(k, j) * delta;
                    }
                    y[(t * d.v_heads + h) * d.v_dim + i] =
                        (0..d.k_dim).map(|j| s[i * d.k_dim + j] * at(q, j)).sum();
                }
            }
        }
        y
    }

    #[test]
    fn delta_rule_with_grouped_heads_matches_the_reference_in_any_chunking() {
        let dims = DeltaRuleDims {
            k_heads: 2,
            v_heads: 6,
            k_dim: 8,
            v_dim: 4,
        };
        let tokens = 5;
        let q = values(tokens * 2 * 8, 3);
        let k = values(tokens * 2 * 8, 4);
        let v = values(tokens * 6 * 4, 5);
        let g: Vec<f32> = values(tokens * 6, 6)
            .iter()
            .map(|x| 0.5 + 0.4 * x)
            .collect();
        let beta: Vec<f32> = values(tokens * 6, 7)
            .iter()
            .map(|x| 0.5 + 0.5 * x)
            .collect();
        let initial = values(dims.state_len(), 8);

        let mut expected_state = initial.clone();
        let expected = reference(&q, &k, &v, &g, &beta, dims, &mut expected_state);

        let mut state = initial.clone();
        let mut y = vec![0.0; expected.len()];
        gated_delta_rule(&q, &k, &v, &g, &beta, dims, &mut state, &mut y);
        assert!(close(&y, &expected));
        assert!(close(&state, &expected_state));

        // one token at a time, as decoding runs it
        let mut state = initial;
        let mut y = vec![0.0; expected.len()];
        let (qk, vv, hv) = (2 * 8, 6 * 4, 6);
        for t in 0..tokens {
            gated_delta_rule(
                &q[t * qk..(t + 1) * qk],
                &k[t * qk..(t + 1) * qk],
                &v[t * vv..(t + 1) * vv],
                &g[t * hv..(t + 1) * hv],
                &beta[t * hv..(t + 1) * hv],
                dims,
                &mut state,
                &mut y[t * vv..(t + 1) * vv],
            );
        }
        assert!(close(&y, &expected));
        assert!(close(&state, &expected_state));
    }

    #[test]
    fn ssm_gates_clip_the_softplus_step() {
        let (a, bias, neg_a) = ([-20.0, 0.0, 30.0], [0.5], [-2.0]);
        let (mut g, mut dt) = ([0.0; 3], [0.0; 3]);
        ssm_gates(&a, &bias, &neg_a, (0.001, 10.0), &mut g, &mut dt);
        let softplus = |z: f32| (1.0 + z.exp()).ln();
        let want = [0.001, softplus(0.5), 10.0];
        assert!(close(&dt, &want), "{dt:?}");
        let decay: Vec<f32> = want.iter().map(|d| (-2.0 * d).exp()).collect();
        assert!(close(&g, &decay), "{g:?}");
    }

    /// Mamba-2's scan in closed form, as its chunked (SSD) formulation reads it: each output sums
    /// the inputs so far, each decayed by the gates since, plus the decayed initial state.
    #[test]
    fn ssm_scan_matches_its_closed_form_in_any_chunking() {
        let dims = DeltaRuleDims {
            k_heads: 2,
            v_heads: 4,
            k_dim: 8,
            v_dim: 3,
        };
        let tokens = 6;
        let (c, b) = (values(tokens * 2 * 8, 11), values(tokens * 2 * 8, 12));
        let x = values(tokens * 4 * 3, 13);
        let g: Vec<f32> = values(tokens * 4, 14)
            .iter()
            .map(|x| 0.5 + 0.4 * x)
            .collect();
        let dt: Vec<f32> = values(tokens * 4, 15)
            .iter()
            .map(|x| 0.6 + 0.5 * x)
            .collect();
        let d = [0.5, -1.0, 2.0, 0.0];
        let initial = values(dims.state_len(), 16);

        let (heads, group) = (4, 2);
        let mut expected = vec![0.0; x.len()];
        for t in 0..tokens {
            for h in 0..heads {
                let kh = h / group;
                let bc = |m: &[f32], s: usize, n: usize| m[(s * 2 + kh) * 8 + n];
                let decay = |from: usize| -> f32 { (from..=t).map(|r| g[r * heads + h]).product() };
                for i in 0..3 {
                    let xi = |s: usize| x[(s * heads + h) * 3 + i];
                    let mut y: f32 = (0..=t)
                        .map(|s| {
                            let cb: f32 = (0..8).map(|n| bc(&c, t, n) * bc(&b, s, n)).sum();
                            decay(s + 1) * dt[s * heads + h] * cb * xi(s)
                        })
                        .sum();
                    let row = &initial[(h * 3 + i) * 8..][..8];
                    y += decay(0) * (0..8).map(|n| row[n] * bc(&c, t, n)).sum::<f32>();
                    expected[(t * heads + h) * 3 + i] = y + d[h] * xi(t);
                }
            }
        }

        let mut whole_state = initial.clone();
        let mut y = vec![0.0; x.len()];
        ssm_scan(&c, &b, &x, &g, &dt, &d, dims, &mut whole_state, &mut y);
        assert!(close(&y, &expected), "{y:?} vs {expected:?}");

        // one token at a time, as decoding runs it
        let mut state = initial;
        let mut y = vec![0.0; x.len()];
        let (bc, xs, hs) = (2 * 8, 4 * 3, 4);
        for t in 0..tokens {
            ssm_scan(
                &c[t * bc..][..bc],
                &b[t * bc..][..bc],
                &x[t * xs..][..xs],
                &g[t * hs..][..hs],
                &dt[t * hs..][..hs],
                &d,
                dims,
                &mut state,
                &mut y[t * xs..][..xs],
            );
        }
        assert!(close(&y, &expected));
        assert!(close(&state, &whole_state));
    }
}
