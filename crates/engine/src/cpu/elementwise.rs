//! Element-wise ops on f32 activations in host memory: activations, sums and softmax.

use super::Isa;

/// `gate = silu(gate) * up`, the SwiGLU activation.
pub fn silu_mul_inplace(gate: &mut [f32], up: &[f32]) {
    for (g, &u) in gate.iter_mut().zip(up) {
        *g = *g / (1.0 + (-*g).exp()) * u;
    }
}

/// `x += y`.
pub fn add_inplace(x: &mut [f32], y: &[f32]) {
    for (a, &b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

/// `x *= y`.
pub fn mul_inplace(x: &mut [f32], y: &[f32]) {
    for (a, &b) in x.iter_mut().zip(y) {
        *a *= b;
    }
}

/// `Σ exp(scale · x[i] − shift)`, summed in f64 from f32 exponentials (eight at a time where
/// the processor has AVX2, within 2 ulp of libm's), −∞ entries adding exactly 0: a softmax's
/// normaliser over a vocabulary, with `shift` the largest `scale · x`.
pub fn exp_sum(x: &[f32], scale: f32, shift: f32) -> f64 {
    exp_into_with(Isa::best(), x, scale, shift, &mut [])
}

/// [`exp_sum`], writing each term to `out` (as long as `x`): a softmax's unnormalised weights.
pub fn exp_into(x: &[f32], scale: f32, shift: f32, out: &mut [f32]) -> f64 {
    assert_eq!(
        x.len(),
        out.len(),
        "exp_into needs an output as long as its input"
    );
    exp_into_with(Isa::best(), x, scale, shift, out)
}

/// [`exp_into`] on the given kernels (panics if the processor lacks them), writing nowhere
/// when `out` is empty.
pub fn exp_into_with(isa: Isa, x: &[f32], scale: f32, shift: f32, out: &mut [f32]) -> f64 {
    isa.check();
    match isa {
        // SAFETY: just checked.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 | Isa::Avx512 | Isa::Amx => unsafe {
            super::avx2::exp_scaled_sum(x, scale, shift, out)
        },
        _ => {
            let write = out.len() == x.len();
            let mut sum = 0.0;
            for (i, &v) in x.iter().enumerate() {
                let e = if v == f32::NEG_INFINITY {
                    0.0
                } else {
                    v.mul_add(scale, -shift).exp()
                };
                if write {
                    out[i] = e;
                }
                sum += f64::from(e);
            }
            sum
        }
    }
}

/// Numerically stable softmax in place.
pub fn softmax_inplace(x: &mut [f32]) {
    let max = x.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    let mut sum = 0.0;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    let inv = 1.0 / sum;
    for v in x.iter_mut() {
        *v *= inv;
    }
}

/// `gate = gelu_approx(gate) * up`, the GeGLU activation (GELU with the tanh approximation, as
/// `mlx.nn.gelu_approx`).
pub fn gelu_approx_mul_inplace(gate: &mut [f32], up: &[f32]) {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    for (g, &u) in gate.iter_mut().zip(up) {
        let x = *g;
        *g = 0.5 * x * (1.0 + (SQRT_2_OVER_PI * (x + 0.044715 * x * x * x)).tanh()) * u;
    }
}

/// gpt-oss's clamped SwiGLU: `gate = (clip(up, ±limit) + 1) · g · sigmoid(alpha · g)` with
/// `g = min(gate, limit)`.
pub fn swiglu_oai_mul_inplace(gate: &mut [f32], up: &[f32]) {
    use crate::params::{SWIGLU_OAI_ALPHA as ALPHA, SWIGLU_OAI_LIMIT as LIMIT};
    for (g, &u) in gate.iter_mut().zip(up) {
        let x = g.min(LIMIT);
        *g = (u.clamp(-LIMIT, LIMIT) + 1.0) * x / (1.0 + (-ALPHA * x).exp());
    }
}

/// `x = tanh(x / cap) * cap`: squashes logits smoothly into `(-cap, cap)`.
pub fn softcap_inplace(x: &mut [f32], cap: f32) {
    for v in x.iter_mut() {
        *v = (*v / cap).tanh() * cap;
    }
}

/// `x *= s`.
pub fn scale_inplace(x: &mut [f32], s: f32) {
    for v in x.iter_mut() {
        *v *= s;
    }
}

/// `x = silu(x) = x · sigmoid(x)`.
/// `x = relu(x)²`.
pub fn relu_squared_inplace(x: &mut [f32]) {
    for v in x {
        *v = v.max(0.0).powi(2);
    }
}

pub fn silu_inplace(x: &mut [f32]) {
    for v in x {
        *v /= 1.0 + (-*v).exp();
    }
}

/// The logistic function `1 / (1 + e^-x)`.
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// `x = x · sigmoid(gate)`.
pub fn sigmoid_mul_inplace(x: &mut [f32], gate: &[f32]) {
    for (v, &g) in x.iter_mut().zip(gate) {
        *v *= sigmoid(g);
    }
}
