//! Every backward function against central finite differences of its forward, and the transposed
//! matmuls against the dequantized weights in f64.
//!
//! The scalar checked is `L = Σ r·f(x)` for a fixed random `r`, so `∂L/∂x` is the backward of `r`.
//! Step 1e-2 in f32 leaves about 1e-4 of truncation and rounding error; the tolerance is 1e-3
//! of the largest gradient.

use oxlm_engine::cpu::attention::{attention, KvView, Options};
use oxlm_engine::cpu::elementwise::{
    gelu_approx_mul_inplace, silu_mul_inplace, swiglu_oai_mul_inplace,
};
use oxlm_engine::cpu::norm::{rms_norm, rope_inplace};
use oxlm_engine::cpu::recurrent::{causal_conv1d, delta_gates, gated_delta_rule};
use oxlm_engine::cpu::Isa;
use oxlm_engine::grad::{
    attention_backward, causal_conv1d_backward, cross_entropy, cross_entropy_backward_inplace,
    delta_gates_backward, dense_matmul_backward, gated_delta_rule_backward,
    gelu_approx_mul_backward, quantized_matmul_backward, rms_norm_backward, rope_backward_inplace,
    silu_mul_backward, swiglu_oai_mul_backward,
};
use oxlm_engine::params::DeltaRuleDims;
use oxlm_engine::quant::quantize;
use oxlm_engine::{Bytes, DType, FloatMatrix, QuantizedMatrix};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const STEP: f32 = 1e-2;
const TOLERANCE: f32 = 1e-3;

fn random(rng: &mut StdRng, n: usize, range: f32) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-range..range)).collect()
}

fn weighted_sum(r: &[f32], y: &[f32]) -> f64 {
    r.iter().zip(y).map(|(&a, &b)| a as f64 * b as f64).sum()
}

/// `∂/∂x_i Σ r·f(x)` by central differences.
fn numeric_grad(x: &[f32], r: &[f32], f: impl Fn(&[f32]) -> Vec<f32>) -> Vec<f32> {
    let mut x = x.to_vec();
    (0..x.len())
        .map(|i| {
            let keep = x[i];
            x[i] = keep + STEP;
            let up = weighted_sum(r, &f(&x));
            x[i] = keep - STEP;
            let down = weighted_sum(r, &f(&x));
            x[i] = keep;
            ((up - down) / (2.0 * STEP as f64)) as f32
        })
        .collect()
}

fn assert_close(what: &str, analytic: &[f32], numeric: &[f32]) {
    let scale = numeric.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let worst = analytic
        .iter()
        .zip(numeric)
        .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
    println!("{what}: max |analytic - numeric| {worst:.2e} (largest gradient {scale:.2e})");
    assert!(scale > 1e-3, "{what}: degenerate test");
    assert!(
        worst <= TOLERANCE * scale,
        "{what}: {worst} > {TOLERANCE} · {scale}"
    );
}

#[test]
fn rms_norm_matches_finite_differences() {
    let mut rng = StdRng::seed_from_u64(1);
    let (rows, dim) = (3, 16);
    let x = random(&mut rng, rows * dim, 2.0);
    let w = random(&mut rng, dim, 1.5);
    let r = random(&mut rng, rows * dim, 1.0);
    let f = |x: &[f32]| {
        let mut y = vec![0.0; x.len()];
        rms_norm(x, &w, 1e-5, &mut y);
        y
    };
    let mut dx = vec![0.0; x.len()];
    rms_norm_backward(&x, &w, 1e-5, &r, &mut dx);
    assert_close("rms_norm", &dx, &numeric_grad(&x, &r, f));
}

#[test]
fn rope_matches_finite_differences() {
    let mut rng = StdRng::seed_from_u64(2);
    let (heads, head_dim) = (3, 8);
    let positions = [0, 5, 17, 1000];
    let inv_freqs: Vec<f32> = (0..head_dim / 2)
        .map(|i| 10000f32.powf(-((2 * i) as f32) / head_dim as f32))
        .collect();
    for traditional in [false, true] {
        let x = random(&mut rng, positions.len() * heads * head_dim, 1.0);
        let r = random(&mut rng, x.len(), 1.0);
        let f = |x: &[f32]| {
            let mut y = x.to_vec();
            rope_inplace(
                &mut y,
                heads,
                head_dim,
                &positions,
                &inv_freqs,
                traditional,
                1.25,
            );
            y
        };
        let mut dx = r.clone();
        rope_backward_inplace(
            &mut dx,
            heads,
            head_dim,
            &positions,
            &inv_freqs,
            traditional,
            1.25,
        );
        assert_close(
            &format!("rope traditional={traditional}"),
            &dx,
            &numeric_grad(&x, &r, f),
        );
    }
}

/// A gated activation's forward (`gate = act(gate) · up`) and backward.
type Gated = (
    &'static str,
    fn(&mut [f32], &[f32]),
    fn(&[f32], &[f32], &[f32]) -> (Vec<f32>, Vec<f32>),
);

#[test]
fn gated_activations_match_finite_differences() {
    let cases: [Gated; 3] = [
        ("swiglu", silu_mul_inplace, silu_mul_backward),
        ("geglu", gelu_approx_mul_inplace, gelu_approx_mul_backward),
        (
            "swiglu_oai",
            swiglu_oai_mul_inplace,
            swiglu_oai_mul_backward,
        ),
    ];
    for (name, forward, backward) in cases {
        let mut rng = StdRng::seed_from_u64(3);
        let gate = random(&mut rng, 40, 4.0);
        let up = random(&mut rng, 40, 2.0);
        let r = random(&mut rng, 40, 1.0);
        let (dgate, dup) = backward(&gate, &up, &r);
        let by_gate = |g: &[f32]| {
            let mut y = g.to_vec();
            forward(&mut y, &up);
            y
        };
        let by_up = |u: &[f32]| {
            let mut y = gate.clone();
            forward(&mut y, u);
            y
        };
        assert_close(
            &format!("{name} gate"),
            &dgate,
            &numeric_grad(&gate, &r, by_gate),
        );
        assert_close(&format!("{name} up"), &dup, &numeric_grad(&up, &r, by_up));
    }
}

#[test]
fn attention_matches_finite_differences() {
    // Causal, and through a sliding window shorter than the sequence; plain, with Gemma 2's
    // soft-capped scores, with gpt-oss's sinks, and with both.
    let sinks = [0.5, -1.0, 2.5, 0.0];
    for window in [None, Some(3)] {
        for (softcap, sinks) in [
            (None, None),
            (Some(1.0), None),
            (None, Some(&sinks[..])),
            (Some(1.0), Some(&sinks[..])),
        ] {
            check_attention(window, softcap, sinks);
        }
    }
}

fn check_attention(window: Option<usize>, softcap: Option<f32>, sinks: Option<&[f32]>) {
    let mut rng = StdRng::seed_from_u64(4);
    let (n, heads, kv_heads, d) = (7, 4, 2, 8);
    let options = Options {
        scale: (d as f32).powf(-0.5),
        softcap,
        sinks,
    };
    let positions: Vec<usize> = (0..n).collect();
    let q = random(&mut rng, n * heads * d, 1.5);
    let k = random(&mut rng, kv_heads * n * d, 1.5);
    let v = random(&mut rng, kv_heads * n * d, 1.5);
    let r = random(&mut rng, n * heads * d, 1.0);
    let run = |q: &[f32], k: &[f32], v: &[f32]| {
        let mut out = vec![0.0; q.len()];
        attention(
            q,
            heads,
            d,
            &positions,
            &KvView::sequence(k, v, kv_heads, n).within(window),
            options,
            &mut out,
        );
        out
    };
    let kv = KvView::sequence(&k[..], &v[..], kv_heads, n).within(window);
    let g = attention_backward(&q, heads, d, &kv, options, &r);
    let what = format!("window {window:?}, soft cap {softcap:?}, sinks {sinks:?}");
    assert_close(
        &format!("attention dq, {what}"),
        &g.dq,
        &numeric_grad(&q, &r, |q| run(q, &k, &v)),
    );
    assert_close(
        &format!("attention dk, {what}"),
        &g.dk,
        &numeric_grad(&k, &r, |k| run(&q, k, &v)),
    );
    assert_close(
        &format!("attention dv, {what}"),
        &g.dv,
        &numeric_grad(&v, &r, |v| run(&q, &k, v)),
    );
}

#[test]
fn causal_conv1d_matches_finite_differences() {
    let mut rng = StdRng::seed_from_u64(6);
    let (tokens, channels, kernel) = (6, 5, 4);
    let x = random(&mut rng, tokens * channels, 1.0);
    let w = random(&mut rng, channels * kernel, 1.0);
    let r = random(&mut rng, tokens * channels, 1.0);
    let run = |x: &[f32]| {
        let mut state = vec![0.0; (kernel - 1) * channels];
        let mut out = vec![0.0; x.len()];
        causal_conv1d(x, channels, &w, kernel, &mut state, &mut out);
        out
    };
    let dx = causal_conv1d_backward(&r, channels, &w, kernel);
    assert_close("conv1d", &dx, &numeric_grad(&x, &r, run));
}

#[test]
fn delta_gates_match_finite_differences() {
    let mut rng = StdRng::seed_from_u64(7);
    let (tokens, heads) = (5, 3);
    let a = random(&mut rng, tokens * heads, 3.0);
    let b = random(&mut rng, tokens * heads, 3.0);
    let dt_bias = random(&mut rng, heads, 1.0);
    let neg_a: Vec<f32> = random(&mut rng, heads, 1.0)
        .iter()
        .map(|x| -x.exp())
        .collect();
    let (rg, rb) = (
        random(&mut rng, a.len(), 1.0),
        random(&mut rng, a.len(), 1.0),
    );
    let gates = |a: &[f32], b: &[f32]| {
        let (mut g, mut beta) = (vec![0.0; a.len()], vec![0.0; a.len()]);
        delta_gates(a, b, &dt_bias, &neg_a, &mut g, &mut beta);
        [g, beta].concat()
    };
    let r = [rg.clone(), rb.clone()].concat();
    let (da, db) = delta_gates_backward(&a, &b, &dt_bias, &neg_a, &rg, &rb);
    assert_close("gates a", &da, &numeric_grad(&a, &r, |a| gates(a, &b)));
    assert_close("gates b", &db, &numeric_grad(&b, &r, |b| gates(&a, b)));
}

/// Over more tokens than the backward pass runs between the states it keeps.
#[test]
fn gated_delta_rule_matches_finite_differences() {
    let mut rng = StdRng::seed_from_u64(8);
    let dims = DeltaRuleDims {
        k_heads: 1,
        v_heads: 2,
        k_dim: 4,
        v_dim: 3,
    };
    let tokens = 70;
    let q = random(&mut rng, tokens * dims.k_heads * dims.k_dim, 0.5);
    let k = random(&mut rng, q.len(), 0.5);
    let v = random(&mut rng, tokens * dims.v_heads * dims.v_dim, 1.0);
    let g: Vec<f32> = (0..tokens * dims.v_heads)
        .map(|_| rng.random_range(0.8..1.0))
        .collect();
    let beta: Vec<f32> = (0..g.len()).map(|_| rng.random_range(0.1..0.9)).collect();
    let r = random(&mut rng, v.len(), 1.0);
    let run = |q: &[f32], k: &[f32], v: &[f32], g: &[f32], beta: &[f32]| {
        let mut state = vec![0.0; dims.state_len()];
        let mut y = vec![0.0; v.len()];
        gated_delta_rule(q, k, v, g, beta, dims, &mut state, &mut y);
        y
    };
    let grads = gated_delta_rule_backward(&q, &k, &v, &g, &beta, dims, &r);
    let checks = [
        (
            "delta q",
            &grads.dq,
            numeric_grad(&q, &r, |q| run(q, &k, &v, &g, &beta)),
        ),
        (
            "delta k",
            &grads.dk,
            numeric_grad(&k, &r, |k| run(&q, k, &v, &g, &beta)),
        ),
        (
            "delta v",
            &grads.dv,
            numeric_grad(&v, &r, |v| run(&q, &k, v, &g, &beta)),
        ),
        (
            "delta g",
            &grads.dg,
            numeric_grad(&g, &r, |g| run(&q, &k, &v, g, &beta)),
        ),
        (
            "delta beta",
            &grads.dbeta,
            numeric_grad(&beta, &r, |b| run(&q, &k, &v, &g, b)),
        ),
    ];
    for (what, analytic, numeric) in checks {
        assert_close(what, analytic, &numeric);
    }
}

#[test]
fn cross_entropy_matches_finite_differences() {
    let mut rng = StdRng::seed_from_u64(5);
    let logits = random(&mut rng, 30, 5.0);
    let target = 7;
    let mut grad = logits.clone();
    cross_entropy_backward_inplace(&mut grad, target, 0.5);
    let f = |z: &[f32]| vec![cross_entropy(z, target)];
    assert_close("cross entropy", &grad, &numeric_grad(&logits, &[0.5], f));
    // logsumexp(z) - z[t], directly.
    let lse = logits.iter().map(|&v| (v as f64).exp()).sum::<f64>().ln();
    assert!((cross_entropy(&logits, target) as f64 - (lse - logits[target] as f64)).abs() < 1e-5);
}

/// `dy · W` in f64 on the f32 weights `w` (`[rows, cols]`).
fn reference(w: &[f32], rows: usize, cols: usize, dy: &[f32], m: usize) -> Vec<f32> {
    let mut out = vec![0.0f32; m * cols];
    for i in 0..m {
        for c in 0..cols {
            let s: f64 = (0..rows)
                .map(|r| dy[i * rows + r] as f64 * w[r * cols + c] as f64)
                .sum();
            out[i * cols + c] = s as f32;
        }
    }
    out
}

fn assert_matmul_close(what: &str, got: &[f32], want: &[f32]) {
    let worst = got
        .iter()
        .zip(want)
        .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
    assert!(worst < 1e-4, "{what}: {worst}");
}

#[test]
fn transposed_matmuls_match_the_weights() {
    let mut rng = StdRng::seed_from_u64(6);
    assert!(Isa::available().contains(&Isa::Portable));
    // Rows and columns past one GEMM panel and block, and not multiples of them.
    for (rows, cols, m) in [(40, 64, 1), (96, 192, 7), (33, 576, 200)] {
        let values = random(&mut rng, rows * cols, 0.5);
        let dy = random(&mut rng, m * rows, 1.0);
        let dense = FloatMatrix::from_f32(rows, cols, &values).unwrap();
        let mut dx = vec![0.0; m * cols];
        dense_matmul_backward(&dense, &dy, m, &mut dx);
        assert_matmul_close("dense", &dx, &reference(&values, rows, cols, &dy, m));
        for (bits, g) in [(4, 64), (8, 32), (3, 32), (6, 64)] {
            let (packed, scales, biases) = quantize(&values, rows, cols, bits, g);
            let w = QuantizedMatrix::new(
                rows,
                cols,
                bits,
                g,
                Bytes::from_values(&packed),
                DType::F32,
                Bytes::from_values(&scales),
                Bytes::from_values(&biases),
            )
            .unwrap();
            let mut dx = vec![0.0; m * cols];
            quantized_matmul_backward(&w, &dy, m, &mut dx);
            let want = reference(&w.view().dequantize(), rows, cols, &dy, m);
            assert_matmul_close(
                &format!("{bits}-bit g{g} [{rows}, {cols}] m={m}"),
                &dx,
                &want,
            );
        }
    }
}
