//! Layers shared by every architecture, each built from a [`Checkpoint`] by its weight prefix.

use oxlm_engine::ops::{self, KvView};
use oxlm_engine::{DType, FloatMatrix, QuantizedMatrix};
use serde_json::Value;

use crate::cache::{KvCache, RotatingKvCache};
use crate::checkpoint::{Checkpoint, RawTensor};
use crate::lora::{LoraLinear, ModuleAdapters};
use crate::LoadError;

/// A `[rows, cols]` weight matrix, quantized (when the checkpoint has `.scales` for it) or not.
#[derive(Debug, Clone)]
pub enum Weight {
    Dense(FloatMatrix),
    Quantized(QuantizedMatrix),
}

fn shape_error(name: &str, t: &RawTensor, expected: String) -> LoadError {
    LoadError::TensorShape {
        name: name.to_string(),
        found: t.shape.clone(),
        dtype: t.dtype.to_string(),
        expected,
    }
}

impl Weight {
    /// Loads `{prefix}.weight` (and `.scales`/`.biases` when quantized) as `[rows, cols]`.
    pub fn load(
        ckpt: &mut Checkpoint,
        prefix: &str,
        rows: usize,
        cols: usize,
    ) -> Result<Self, LoadError> {
        let name = format!("{prefix}.weight");
        let weight = ckpt.take(&name)?;
        let engine_err = |source| LoadError::Engine {
            name: name.clone(),
            source,
        };
        if !ckpt.contains(&format!("{prefix}.scales")) {
            if weight.shape != [rows, cols] || !weight.dtype.is_float() {
                return Err(shape_error(
                    &name,
                    &weight,
                    format!("[{rows}, {cols}] floats"),
                ));
            }
            return FloatMatrix::new(rows, cols, weight.dtype, weight.data)
                .map(Weight::Dense)
                .map_err(engine_err);
        }
        let scales = ckpt.take(&format!("{prefix}.scales"))?;
        let biases = ckpt.take(&format!("{prefix}.biases"))?;
        let spec = ckpt.quantization.for_module(prefix).ok_or_else(|| {
            LoadError::Config(format!(
                "`{prefix}` is quantized in the weights but config.json has no `quantization`"
            ))
        })?;
        let words = cols * spec.bits as usize / 32;
        if weight.dtype != DType::U32 || weight.shape != [rows, words] {
            return Err(shape_error(
                &name,
                &weight,
                format!(
                    "[{rows}, {words}] uint32 ({}-bit, group size {})",
                    spec.bits, spec.group_size
                ),
            ));
        }
        let groups = cols / spec.group_size.max(1);
        for (t, what) in [(&scales, "scales"), (&biases, "biases")] {
            if t.shape != [rows, groups] || t.dtype != scales.dtype {
                return Err(shape_error(
                    &format!("{prefix}.{what}"),
                    t,
                    format!("[{rows}, {groups}] (group size {})", spec.group_size),
                ));
            }
        }
        QuantizedMatrix::new(
            rows,
            cols,
            spec.bits,
            spec.group_size,
            weight.data,
            scales.dtype,
            scales.data,
            biases.data,
        )
        .map(Weight::Quantized)
        .map_err(engine_err)
    }

    pub fn rows(&self) -> usize {
        match self {
            Weight::Dense(w) => w.rows,
            Weight::Quantized(w) => w.rows,
        }
    }

    pub fn cols(&self) -> usize {
        match self {
            Weight::Dense(w) => w.cols,
            Weight::Quantized(w) => w.cols,
        }
    }

    /// `x[m, cols] · Wᵀ` as a new `[m, rows]` buffer.
    pub fn matmul(&self, x: &[f32], m: usize) -> Vec<f32> {
        let mut y = vec![0.0; m * self.rows()];
        match self {
            Weight::Dense(w) => w.matmul(x, m, &mut y),
            Weight::Quantized(w) => w.matmul(x, m, &mut y),
        }
        y
    }

    /// Row `row` as f32 (an embedding lookup).
    pub fn row(&self, row: usize, out: &mut [f32]) {
        match self {
            Weight::Dense(w) => w.row_to_f32(row, out),
            Weight::Quantized(w) => w.dequantize_row(row, out),
        }
    }
}

/// Loads a 1-D float array of `len` values as f32 (norm weights, biases).
pub fn load_vector(ckpt: &mut Checkpoint, name: &str, len: usize) -> Result<Vec<f32>, LoadError> {
    let t = ckpt.take(name)?;
    if t.shape != [len] || !t.dtype.is_float() {
        return Err(shape_error(name, &t, format!("[{len}] floats")));
    }
    FloatMatrix::new(1, len, t.dtype, t.data)
        .map(|m| m.to_f32_vec())
        .map_err(|source| LoadError::Engine {
            name: name.to_string(),
            source,
        })
}

/// `y = x Wᵀ (+ b)`.
#[derive(Debug, Clone)]
pub struct Linear {
    pub weight: Weight,
    pub bias: Option<Vec<f32>>,
}

impl Linear {
    pub fn load(
        ckpt: &mut Checkpoint,
        prefix: &str,
        in_features: usize,
        out_features: usize,
        bias: bool,
    ) -> Result<Self, LoadError> {
        let weight = Weight::load(ckpt, prefix, out_features, in_features)?;
        let bias = bias
            .then(|| load_vector(ckpt, &format!("{prefix}.bias"), out_features))
            .transpose()?;
        Ok(Linear { weight, bias })
    }

    /// Applies the layer to `m` rows of `x`.
    pub fn forward(&self, x: &[f32], m: usize) -> Vec<f32> {
        self.forward_adapted(x, m, None)
    }

    /// [`Linear::forward`] plus a LoRA adapter's low-rank update, when one is given.
    pub fn forward_adapted(&self, x: &[f32], m: usize, adapter: Option<&LoraLinear>) -> Vec<f32> {
        let mut y = self.weight.matmul(x, m);
        if let Some(b) = &self.bias {
            for row in y.chunks_exact_mut(b.len()) {
                ops::add_inplace(row, b);
            }
        }
        if let Some(adapter) = adapter {
            adapter.add_to(x, m, &mut y);
        }
        y
    }
}

/// Token embeddings; also the output head when the model ties them.
#[derive(Debug, Clone)]
pub struct Embedding {
    pub weight: Weight,
}

impl Embedding {
    pub fn load(
        ckpt: &mut Checkpoint,
        prefix: &str,
        vocab: usize,
        dim: usize,
    ) -> Result<Self, LoadError> {
        Ok(Embedding {
            weight: Weight::load(ckpt, prefix, vocab, dim)?,
        })
    }

    pub fn vocab_size(&self) -> usize {
        self.weight.rows()
    }

    pub fn dim(&self) -> usize {
        self.weight.cols()
    }

    /// `[tokens, dim]` embeddings of `tokens` (ids already checked against the vocabulary).
    pub fn forward(&self, tokens: &[u32]) -> Vec<f32> {
        let dim = self.dim();
        let mut out = vec![0.0; tokens.len() * dim];
        for (&t, row) in tokens.iter().zip(out.chunks_exact_mut(dim)) {
            self.weight.row(t as usize, row);
        }
        out
    }

    /// Logits `x · Eᵀ` (a tied output head).
    pub fn as_linear(&self, x: &[f32], m: usize) -> Vec<f32> {
        self.weight.matmul(x, m)
    }
}

#[derive(Debug, Clone)]
pub struct RmsNorm {
    pub weight: Vec<f32>,
    pub eps: f32,
}

impl RmsNorm {
    pub fn load(
        ckpt: &mut Checkpoint,
        prefix: &str,
        dim: usize,
        eps: f32,
    ) -> Result<Self, LoadError> {
        Ok(RmsNorm {
            weight: load_vector(ckpt, &format!("{prefix}.weight"), dim)?,
            eps,
        })
    }

    pub fn forward(&self, x: &[f32]) -> Vec<f32> {
        let mut out = vec![0.0; x.len()];
        ops::rms_norm(x, &self.weight, self.eps, &mut out);
        out
    }

    pub fn forward_inplace(&self, x: &mut [f32]) {
        ops::rms_norm_inplace(x, &self.weight, self.eps);
    }
}

/// Rotary position embedding with the frequencies of one of mlx-lm's RoPE variants.
#[derive(Debug, Clone)]
pub struct Rope {
    /// Angle per position for each rotated pair.
    pub inv_freqs: Vec<f32>,
    pub traditional: bool,
}

impl Rope {
    /// Builds the RoPE that mlx-lm's `initialize_rope` builds for `dims` rotated features, with
    /// `base` and the `rope_scaling` section (`None`, default, linear or llama3).
    pub fn new(
        dims: usize,
        base: f32,
        traditional: bool,
        scaling: Option<&Value>,
    ) -> Result<Self, LoadError> {
        let rope_type = scaling
            .and_then(|s| s.get("type").or_else(|| s.get("rope_type")))
            .and_then(Value::as_str)
            .unwrap_or("default");
        let number = |key: &str, default: Option<f64>| -> Result<f64, LoadError> {
            scaling
                .and_then(|s| s.get(key))
                .and_then(Value::as_f64)
                .or(default)
                .ok_or_else(|| LoadError::Config(format!("`rope_scaling.{key}` is missing")))
        };
        // mlx-lm's "periods": base^(2i/dims); the angle of pair i at position p is p / period_i.
        let periods: Vec<f64> = (0..dims / 2)
            .map(|i| (base as f64).powf((2 * i) as f64 / dims as f64))
            .collect();
        let periods = match rope_type {
            "default" => periods,
            "linear" => {
                let factor = number("factor", None)?;
                periods.into_iter().map(|p| p * factor).collect()
            }
            "llama3" => {
                let factor = number("factor", None)?;
                let low = number("low_freq_factor", Some(1.0))?;
                let high = number("high_freq_factor", Some(4.0))?;
                let old_context = number("original_max_position_embeddings", Some(8192.0))?;
                let (low_wavelen, high_wavelen) = (old_context / low, old_context / high);
                periods
                    .into_iter()
                    .map(|p| {
                        let wavelen = 2.0 * std::f64::consts::PI * p;
                        let scaled = if wavelen > low_wavelen { p * factor } else { p };
                        if wavelen > high_wavelen && wavelen < low_wavelen {
                            let smooth = (old_context / wavelen - low) / (high - low);
                            scaled / ((1.0 - smooth) / factor + smooth)
                        } else {
                            scaled
                        }
                    })
                    .collect()
            }
            "proportional" => {
                // Gemma 4's global layers: the first `rotated` features of each half turn, with
                // periods still spaced over all `dims`; the other pairs never turn.
                let factor = number("factor", Some(1.0))?;
                let rotated = (dims as f64 * number("partial_rotary_factor", Some(1.0))?) as usize;
                if rotated > dims {
                    return Err(LoadError::Config(format!(
                        "partial rotary factor gives {rotated} rotated features of {dims}"
                    )));
                }
                periods
                    .into_iter()
                    .enumerate()
                    .map(|(i, p)| if 2 * i < rotated { p * factor } else { f64::INFINITY })
                    .collect()
            }
            other => {
                return Err(LoadError::Config(format!(
                "rope_scaling type `{other}` is not supported (supported: default, linear, llama3, proportional)"
            )))
            }
        };
        Ok(Rope {
            inv_freqs: periods.iter().map(|&p| (1.0 / p) as f32).collect(),
            traditional,
        })
    }

    /// Rotates `x` (`[tokens, heads, head_dim]`) in place for the given positions.
    pub fn apply(&self, x: &mut [f32], heads: usize, head_dim: usize, positions: &[usize]) {
        ops::rope_inplace(
            x,
            heads,
            head_dim,
            positions,
            &self.inv_freqs,
            self.traditional,
        );
    }
}

/// Multi-head attention with grouped KV heads, optional q/k biases and per-head q/k norms.
#[derive(Debug, Clone)]
pub struct Attention {
    pub q_proj: Linear,
    pub k_proj: Linear,
    pub v_proj: Linear,
    pub o_proj: Linear,
    pub q_norm: Option<RmsNorm>,
    pub k_norm: Option<RmsNorm>,
    pub rope: Rope,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub scale: f32,
}

impl Attention {
    /// `x` is `[tokens, hidden]`; the new keys and values are appended to `cache`.
    pub fn forward(&self, x: &[f32], positions: &[usize], cache: &mut KvCache) -> Vec<f32> {
        self.forward_adapted(x, positions, cache, ModuleAdapters::NONE)
    }

    /// [`Attention::forward`] with the projections `lora` names adapted.
    pub fn forward_adapted(
        &self,
        x: &[f32],
        positions: &[usize],
        cache: &mut KvCache,
        lora: ModuleAdapters,
    ) -> Vec<f32> {
        let n = positions.len();
        let (q, k, v) = self.project_adapted(x, positions, lora);
        cache.append(&k, &v);
        let mut out = vec![0.0; n * self.heads * self.head_dim];
        let kv: KvView = cache.view();
        ops::attention(
            &q,
            self.heads,
            self.head_dim,
            positions,
            &kv,
            self.scale,
            &mut out,
        );
        self.o_proj.forward_adapted(&out, n, lora.get("o_proj"))
    }
}

/// The SwiGLU feed-forward block: `down(silu(gate(x)) * up(x))`.
#[derive(Debug, Clone)]
pub struct Mlp {
    pub gate_proj: Linear,
    pub up_proj: Linear,
    pub down_proj: Linear,
}

impl Mlp {
    pub fn load(
        ckpt: &mut Checkpoint,
        prefix: &str,
        dim: usize,
        hidden: usize,
        bias: bool,
    ) -> Result<Self, LoadError> {
        Ok(Mlp {
            gate_proj: Linear::load(ckpt, &format!("{prefix}.gate_proj"), dim, hidden, bias)?,
            up_proj: Linear::load(ckpt, &format!("{prefix}.up_proj"), dim, hidden, bias)?,
            down_proj: Linear::load(ckpt, &format!("{prefix}.down_proj"), hidden, dim, bias)?,
        })
    }

    pub fn forward(&self, x: &[f32], n: usize) -> Vec<f32> {
        self.forward_adapted(x, n, ModuleAdapters::NONE)
    }

    /// [`Mlp::forward`] with the projections `lora` names adapted.
    pub fn forward_adapted(&self, x: &[f32], n: usize, lora: ModuleAdapters) -> Vec<f32> {
        let mut gate = self.gate_proj.forward_adapted(x, n, lora.get("gate_proj"));
        let up = self.up_proj.forward_adapted(x, n, lora.get("up_proj"));
        ops::silu_mul_inplace(&mut gate, &up);
        self.down_proj
            .forward_adapted(&gate, n, lora.get("down_proj"))
    }
}

impl RmsNorm {
    /// Gemma's norm, which scales by `1 + weight`: the checkpoint stores offsets from 1.
    pub fn load_plus_one(
        ckpt: &mut Checkpoint,
        prefix: &str,
        dim: usize,
        eps: f32,
    ) -> Result<Self, LoadError> {
        let mut norm = RmsNorm::load(ckpt, prefix, dim, eps)?;
        for w in &mut norm.weight {
            *w += 1.0;
        }
        Ok(norm)
    }

    /// A norm without a learned scale (`mx.fast.rms_norm(x, None, eps)`).
    pub fn unscaled(dim: usize, eps: f32) -> Self {
        RmsNorm {
            weight: vec![1.0; dim],
            eps,
        }
    }
}

impl Mlp {
    /// The GeGLU feed-forward block of Gemma: `down(gelu_approx(gate(x)) * up(x))`.
    pub fn forward_geglu(&self, x: &[f32], n: usize) -> Vec<f32> {
        let mut gate = self.gate_proj.forward(x, n);
        let up = self.up_proj.forward(x, n);
        ops::gelu_approx_mul_inplace(&mut gate, &up);
        self.down_proj.forward(&gate, n)
    }
}

impl Attention {
    /// Queries, keys and values of `x` (`[tokens, hidden]`), normed and rotated.
    pub fn project(&self, x: &[f32], positions: &[usize]) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
        self.project_adapted(x, positions, ModuleAdapters::NONE)
    }

    /// [`Attention::project`] with the projections `lora` names adapted.
    pub fn project_adapted(
        &self,
        x: &[f32],
        positions: &[usize],
        lora: ModuleAdapters,
    ) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
        let n = positions.len();
        let mut q = self.q_proj.forward_adapted(x, n, lora.get("q_proj"));
        let mut k = self.k_proj.forward_adapted(x, n, lora.get("k_proj"));
        let v = self.v_proj.forward_adapted(x, n, lora.get("v_proj"));
        if let Some(norm) = &self.q_norm {
            norm.forward_inplace(&mut q);
        }
        if let Some(norm) = &self.k_norm {
            norm.forward_inplace(&mut k);
        }
        self.rope
            .apply(&mut q, self.heads, self.head_dim, positions);
        self.rope
            .apply(&mut k, self.kv_heads, self.head_dim, positions);
        (q, k, v)
    }

    /// As [`Attention::forward`] for a sliding-window layer: each query sees the window its
    /// `cache` keeps.
    pub fn forward_sliding(
        &self,
        x: &[f32],
        positions: &[usize],
        cache: &mut RotatingKvCache,
    ) -> Vec<f32> {
        let (q, k, v) = self.project(x, positions);
        cache.append(&k, &v);
        let mut out = vec![0.0; q.len()];
        ops::sliding_window_attention(
            &q,
            self.heads,
            self.head_dim,
            positions,
            &cache.view(),
            self.scale,
            &mut out,
        );
        self.o_proj.forward(&out, positions.len())
    }
}
