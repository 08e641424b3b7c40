//! Layers shared by every architecture, each loaded from its own [`Scope`] of the checkpoint.

use oxlm_engine::quant::QuantMode;
use oxlm_engine::{
    ops, Bytes, DType, Device, EngineError, FloatMatrix, Positions, QuantizedMatrix, Tensor,
};
use serde_json::Value;
use std::borrow::Cow;

use crate::cache::{append_kv, attend_kv, AttentionCache};
use crate::checkpoint::{QuantSpec, RawTensor, Scope};
use crate::lora::{LayerAdapter, LinearShape, ModuleAdapters};
use crate::{LoadError, Logits};

/// What the ops of a forward pass may fail with (device errors, shapes).
pub type OpResult<T> = Result<T, EngineError>;

/// What a block's projections read: a tensor, or a tensor and the RMS norm still to apply to
/// it, which plain quantized projections fold into their own pass where the device can.
#[derive(Clone, Copy)]
pub enum Input<'a> {
    Plain(&'a Tensor),
    Normed(&'a Tensor, &'a RmsNorm),
}

impl<'a> Input<'a> {
    /// The input as one tensor, normed if it is to be.
    fn tensor(self) -> OpResult<Cow<'a, Tensor>> {
        let (x, norm) = self.parts();
        ops::normed(x, norm)
    }

    /// The tensor as given, and the norm an op is to apply to it.
    fn parts(self) -> (&'a Tensor, Option<ops::InputNorm<'a>>) {
        match self {
            Input::Plain(x) => (x, None),
            Input::Normed(x, norm) => (
                x,
                Some(ops::InputNorm {
                    weight: &norm.weight,
                    eps: norm.eps,
                }),
            ),
        }
    }
}

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
    /// Loads the module's `weight` (and `scales`, and `biases` in the affine mode, when
    /// quantized) as `[rows, cols]`.
    pub fn load(vb: &mut Scope, rows: usize, cols: usize) -> Result<Self, LoadError> {
        let name = vb.path_of("weight");
        let weight = vb.take("weight")?;
        let engine_err = |source| LoadError::Engine {
            name: name.clone(),
            source,
        };
        if !vb.contains("scales") {
            if weight.shape != [rows, cols] || !weight.dtype.is_float() {
                return Err(shape_error(
                    &name,
                    &weight,
                    format!("[{rows}, {cols}] floats"),
                ));
            }
            let mut dense =
                FloatMatrix::new(rows, cols, weight.dtype, weight.data).map_err(engine_err)?;
            dense.place(vb.device()).map_err(engine_err)?;
            return Ok(Weight::Dense(dense));
        }
        let arrays = QuantizedArrays::take(vb, weight, &[], rows, cols)?;
        let mut quantized = arrays.matrix(rows, cols, |t, _| Ok(t.data.clone()))?;
        quantized.place(vb.device()).map_err(engine_err)?;
        Ok(Weight::Quantized(quantized))
    }

    /// The quantized matrix, where the weights are one.
    pub fn quantized(&self) -> Option<&QuantizedMatrix> {
        match self {
            Weight::Quantized(w) => Some(w),
            Weight::Dense(_) => None,
        }
    }

    /// Copies the weights to `device`'s memory (for matrices made outside a checkpoint).
    pub fn place(&mut self, device: &Device) -> OpResult<()> {
        match self {
            Weight::Dense(w) => w.place(device),
            Weight::Quantized(w) => w.place(device),
        }
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

    /// `x[…, cols] · Wᵀ`: `[…, rows]`, on `x`'s device.
    pub fn matmul(&self, x: &Tensor) -> OpResult<Tensor> {
        match self {
            Weight::Dense(w) => ops::matmul(w, x),
            Weight::Quantized(w) => ops::matmul(w, x),
        }
    }

    /// `residual += x · Wᵀ`.
    pub fn matmul_add(&self, x: &Tensor, residual: &mut Tensor) -> OpResult<()> {
        match self {
            Weight::Dense(w) => ops::matmul_add(w, x, residual),
            Weight::Quantized(w) => ops::matmul_add(w, x, residual),
        }
    }

    /// Rows `ids` as f32 on `device` (an embedding lookup).
    pub fn rows_of(&self, ids: &[usize], device: &Device) -> OpResult<Tensor> {
        match self {
            Weight::Dense(w) => ops::matrix_rows(w, ids, device),
            Weight::Quantized(w) => ops::matrix_rows(w, ids, device),
        }
    }
}

/// A quantized module's arrays: its `weight`, its `scales` and, in the affine mode only, its
/// `biases`, checked against `[lead.., rows, cols]` (`lead` the experts of a stack) and the
/// config's spec for the module.
pub(crate) struct QuantizedArrays {
    /// The weight's full name, for errors.
    name: String,
    spec: QuantSpec,
    weight: RawTensor,
    scales: RawTensor,
    biases: Option<RawTensor>,
}

impl QuantizedArrays {
    /// Takes the module's `scales` (and `biases`) beside its `weight`, taken already.
    pub(crate) fn take(
        vb: &mut Scope,
        weight: RawTensor,
        lead: &[usize],
        rows: usize,
        cols: usize,
    ) -> Result<Self, LoadError> {
        let spec = vb.quantization().ok_or_else(|| {
            LoadError::Config(format!(
                "`{}` is quantized in the weights but config.json has no `quantization`",
                vb.path()
            ))
        })?;
        let scales = vb.take("scales")?;
        let biases = match spec.mode {
            QuantMode::Affine => Some(vb.take("biases")?),
            _ => None,
        };
        let shape =
            |last: usize| -> Vec<usize> { lead.iter().copied().chain([rows, last]).collect() };
        let (bits, g) = (spec.bits, spec.group_size);
        let words = cols * bits as usize / 32;
        if weight.dtype != DType::U32 || weight.shape != shape(words) {
            return Err(shape_error(
                &vb.path_of("weight"),
                &weight,
                format!(
                    "{:?} uint32 ({bits}-bit, group size {g}, {})",
                    shape(words),
                    spec.mode
                ),
            ));
        }
        // Affine scales and biases share the weights' float type; a float mode's scales are
        // uint8 codes.
        let (scale_dtype, dtype_name) = match spec.mode {
            QuantMode::Affine => (scales.dtype, ""),
            _ => (DType::U8, " uint8"),
        };
        let groups = cols / g.max(1);
        for (t, what) in [(Some(&scales), "scales"), (biases.as_ref(), "biases")] {
            match t {
                Some(t) if t.shape != shape(groups) || t.dtype != scale_dtype => {
                    return Err(shape_error(
                        &vb.path_of(what),
                        t,
                        format!("{:?}{dtype_name} (group size {g})", shape(groups)),
                    ));
                }
                _ => {}
            }
        }
        Ok(QuantizedArrays {
            name: vb.path_of("weight"),
            spec,
            weight,
            scales,
            biases,
        })
    }

    /// The `[rows, cols]` matrix of the bytes `part` cuts out of each array (the whole array,
    /// or an expert's slice of a stack; its second argument names the array).
    pub(crate) fn matrix(
        &self,
        rows: usize,
        cols: usize,
        part: impl Fn(&RawTensor, &str) -> Result<Bytes, LoadError>,
    ) -> Result<QuantizedMatrix, LoadError> {
        let (spec, weight) = (self.spec, part(&self.weight, "weight")?);
        let scales = part(&self.scales, "scales")?;
        let matrix = match &self.biases {
            Some(biases) => QuantizedMatrix::new(
                rows,
                cols,
                spec.bits,
                spec.group_size,
                weight,
                self.scales.dtype,
                scales,
                part(biases, "biases")?,
            ),
            None => QuantizedMatrix::new_float(
                spec.mode,
                rows,
                cols,
                spec.bits,
                spec.group_size,
                weight,
                scales,
            ),
        };
        matrix.map_err(|source| LoadError::Engine {
            name: self.name.clone(),
            source,
        })
    }
}

/// Loads a 1-D float array of `len` values as f32, in host memory.
pub fn load_host_vector(vb: &mut Scope, name: &str, len: usize) -> Result<Vec<f32>, LoadError> {
    load_host_array(vb, name, &[len])
}

/// Loads a float array of `shape` as f32, flat, in host memory.
pub fn load_host_array(vb: &mut Scope, name: &str, shape: &[usize]) -> Result<Vec<f32>, LoadError> {
    let t = vb.take(name)?;
    let name = vb.path_of(name);
    if t.shape != shape || !t.dtype.is_float() {
        return Err(shape_error(&name, &t, format!("{shape:?} floats")));
    }
    FloatMatrix::new(1, shape.iter().product(), t.dtype, t.data)
        .map(|m| m.to_f32_vec())
        .map_err(|source| LoadError::Engine { name, source })
}

/// Loads a 1-D float array of `len` values as f32 on the checkpoint's device (norm weights,
/// biases).
pub fn load_vector(vb: &mut Scope, name: &str, len: usize) -> Result<Tensor, LoadError> {
    let values = load_host_vector(vb, name, len)?;
    place_vector(&values, vb.device(), &vb.path_of(name))
}

/// `values` as a 1-D tensor on `device`; `name` labels an error.
pub fn place_vector(values: &[f32], device: &Device, name: &str) -> Result<Tensor, LoadError> {
    Tensor::from_slice(vec![values.len()], values, device).map_err(|source| LoadError::Engine {
        name: name.to_string(),
        source,
    })
}

/// The module's depthwise convolution weights `name`, as `[channels, kernel]` on its device:
/// mlx-lm's `[channels, kernel, 1]` or Hugging Face's `[channels, 1, kernel]`, the same values
/// in the same order.
pub fn load_conv1d(
    vb: &mut Scope,
    name: &str,
    channels: usize,
    kernel: usize,
) -> Result<Tensor, LoadError> {
    let path = vb.path_of(name);
    let raw = vb
        .peek(name)
        .ok_or_else(|| LoadError::MissingTensor(path.clone()))?;
    if (raw.shape != [channels, kernel, 1] && raw.shape != [channels, 1, kernel])
        || !raw.dtype.is_float()
    {
        return Err(LoadError::TensorShape {
            name: path,
            found: raw.shape.clone(),
            dtype: raw.dtype.to_string(),
            expected: format!("[{channels}, {kernel}, 1] or [{channels}, 1, {kernel}] floats"),
        });
    }
    let t = vb.take(name)?;
    let engine = |source| LoadError::Engine {
        name: path.clone(),
        source,
    };
    let values = FloatMatrix::new(1, channels * kernel, t.dtype, t.data)
        .map(|m| m.to_f32_vec())
        .map_err(engine)?;
    Ok(place_vector(&values, vb.device(), &path)?.reshape(vec![channels, kernel]))
}

/// `y = x Wᵀ (+ b)`.
#[derive(Debug, Clone)]
pub struct Linear {
    pub weight: Weight,
    pub bias: Option<Tensor>,
}

impl Linear {
    pub fn load(
        vb: &mut Scope,
        in_features: usize,
        out_features: usize,
        bias: bool,
    ) -> Result<Self, LoadError> {
        let weight = Weight::load(vb, out_features, in_features)?;
        let bias = bias
            .then(|| load_vector(vb, "bias", out_features))
            .transpose()?;
        Ok(Linear { weight, bias })
    }

    /// Applies the layer to the rows of `x`.
    pub fn forward(&self, x: &Tensor) -> OpResult<Tensor> {
        self.forward_adapted(x, None)
    }

    /// `residual += layer(x)` (with the adapter's update, if any), in one pass where it can be:
    /// the product, then the update, summed into `residual` in place.
    pub fn add_forward(
        &self,
        x: &Tensor,
        adapter: Option<LayerAdapter>,
        residual: &mut Tensor,
    ) -> OpResult<()> {
        if self.bias.is_some() {
            return ops::add_inplace(residual, &self.forward_adapted(x, adapter)?);
        }
        self.weight.matmul_add(x, residual)?;
        match adapter {
            Some(adapter) => adapter.add_to_tensor(x, residual),
            None => Ok(()),
        }
    }

    /// [`Linear::forward`] plus a LoRA adapter's low-rank update, when one is given.
    pub fn forward_adapted(&self, x: &Tensor, adapter: Option<LayerAdapter>) -> OpResult<Tensor> {
        let mut y = self.weight.matmul(x)?;
        if let Some(b) = &self.bias {
            ops::add_row_inplace(&mut y, b)?;
        }
        if let Some(adapter) = adapter {
            adapter.add_to_tensor(x, &mut y)?;
        }
        Ok(y)
    }
}

/// Token embeddings; also the output head when the model ties them.
#[derive(Debug, Clone)]
pub struct Embedding {
    pub weight: Weight,
    /// Where lookups put their rows: the device the model was loaded for.
    pub device: Device,
}

impl Embedding {
    pub fn load(vb: &mut Scope, vocab: usize, dim: usize) -> Result<Self, LoadError> {
        Ok(Embedding {
            weight: Weight::load(vb, vocab, dim)?,
            device: vb.device().clone(),
        })
    }

    pub fn vocab_size(&self) -> usize {
        self.weight.rows()
    }

    pub fn dim(&self) -> usize {
        self.weight.cols()
    }

    /// `[tokens, dim]` embeddings of `tokens` (ids already checked against the vocabulary).
    pub fn forward(&self, tokens: &[u32]) -> OpResult<Tensor> {
        let ids: Vec<usize> = tokens.iter().map(|&t| t as usize).collect();
        self.weight.rows_of(&ids, &self.device)
    }

    /// Logits `x · Eᵀ` (a tied output head).
    pub fn as_linear(&self, x: &Tensor) -> OpResult<Tensor> {
        self.weight.matmul(x)
    }
}

#[derive(Debug, Clone)]
pub struct RmsNorm {
    /// `[dim]`: each run of `dim` features is normed on its own (a row, or a head).
    pub weight: Tensor,
    pub eps: f32,
}

/// `value` of the config's `key` where it must be a positive number (a norm's epsilon, RoPE's
/// base): zero, negative or NaN values load and then compute garbage.
fn positive(key: &str, value: f32) -> Result<f32, LoadError> {
    if value > 0.0 && value.is_finite() {
        Ok(value)
    } else {
        Err(LoadError::Config(format!(
            "`{key}` must be a positive number, not {value}"
        )))
    }
}

impl RmsNorm {
    pub fn load(vb: &mut Scope, dim: usize, eps: f32) -> Result<Self, LoadError> {
        Ok(RmsNorm {
            weight: load_vector(vb, "weight", dim)?,
            eps: positive("rms_norm_eps", eps)?,
        })
    }

    /// A norm with the scale `weight`, on `device`.
    pub fn new(weight: &[f32], eps: f32, device: &Device) -> Result<Self, LoadError> {
        Ok(RmsNorm {
            weight: place_vector(weight, device, "norm weight")?,
            eps: positive("rms_norm_eps", eps)?,
        })
    }

    pub fn dim(&self) -> usize {
        self.weight.len()
    }

    pub fn forward(&self, x: &Tensor) -> OpResult<Tensor> {
        ops::rms_norm(x, &self.weight, self.eps)
    }

    pub fn forward_inplace(&self, x: &mut Tensor) -> OpResult<()> {
        ops::rms_norm_inplace(x, &self.weight, self.eps)
    }

    /// Gemma's norm, which scales by `1 + weight`: the checkpoint stores offsets from 1.
    pub fn load_plus_one(vb: &mut Scope, dim: usize, eps: f32) -> Result<Self, LoadError> {
        let mut weight = load_host_vector(vb, "weight", dim)?;
        for w in &mut weight {
            *w += 1.0;
        }
        RmsNorm::new(&weight, eps, vb.device())
    }

    /// A norm without a learned scale (`mx.fast.rms_norm(x, None, eps)`).
    pub fn unscaled(dim: usize, eps: f32, device: &Device) -> Result<Self, LoadError> {
        RmsNorm::new(&vec![1.0; dim], eps, device)
    }
}

/// Rotary position embedding with the frequencies of one of mlx-lm's RoPE variants.
#[derive(Debug, Clone)]
pub struct Rope {
    /// Angle per position for each rotated pair, on the model's device.
    pub inv_freqs: Tensor,
    pub traditional: bool,
    /// What the turned features are multiplied by (YaRN's and LongRoPE's mscale).
    pub amplitude: f32,
}

impl Rope {
    /// Builds the RoPE that mlx-lm's `initialize_rope` builds for `dims` rotated features, with
    /// `base` and the `rope_scaling` section: default, linear, llama3, yarn, longrope (`su`),
    /// dynamic and proportional. `max_positions` is the model's `max_position_embeddings`, which
    /// LongRoPE's amplitude depends on. Dynamic NTK scaling changes nothing within that context
    /// (the longest this model then serves), so it is the default RoPE here.
    pub fn new(
        dims: usize,
        base: f32,
        traditional: bool,
        scaling: Option<&Value>,
        max_positions: Option<usize>,
        device: &Device,
    ) -> Result<Self, LoadError> {
        positive("rope_theta", base)?;
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
        let mut amplitude = 1.0;
        let periods = match rope_type {
            "default" | "dynamic" | "mrope" => periods,
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
            "yarn" | "deepseek_yarn" => {
                let factor = number("factor", None)?;
                positive("rope_scaling.factor", factor as f32)?;
                let old_context = number("original_max_position_embeddings", Some(4096.0))?;
                let beta_fast = number("beta_fast", Some(32.0))?;
                let beta_slow = number("beta_slow", Some(1.0))?;
                let mscale = |m: f64| match factor <= 1.0 {
                    true => 1.0,
                    false => 0.1 * m * factor.ln() + 1.0,
                };
                amplitude = (mscale(number("mscale", Some(1.0))?)
                    / mscale(number("mscale_all_dim", Some(0.0))?)) as f32;
                // The pairs that turn fewer than `beta_slow` times over the old context are
                // interpolated, those that turn more than `beta_fast` times kept, a ramp between.
                let turns_at = |rotations: f64| {
                    dims as f64 * (old_context / (rotations * 2.0 * std::f64::consts::PI)).ln()
                        / (2.0 * (base as f64).ln())
                };
                let low = turns_at(beta_fast).floor().max(0.0);
                let high = turns_at(beta_slow).ceil().min(dims as f64 - 1.0);
                let high = if low == high { high + 0.001 } else { high };
                periods
                    .into_iter()
                    .enumerate()
                    .map(|(i, p)| {
                        let keep = 1.0 - ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
                        let stretched = factor * p;
                        stretched * p / (stretched * keep + p * (1.0 - keep))
                    })
                    .collect()
            }
            "longrope" | "su" => {
                // mlx-lm always turns by the long factors, and scales the turned features by
                // √(1 + ln(context growth) / ln(old context)) unless `long_mscale` says.
                let old_context = number("original_max_position_embeddings", None)?;
                let factors = scaling
                    .and_then(|s| s.get("long_factor"))
                    .and_then(Value::as_array)
                    .filter(|f| f.len() == dims / 2)
                    .ok_or_else(|| {
                        LoadError::Config(format!(
                            "`rope_scaling.long_factor` must hold {} numbers",
                            dims / 2
                        ))
                    })?;
                let growth = max_positions.map_or(1.0, |m| m as f64 / old_context);
                amplitude = match scaling.and_then(|s| s.get("long_mscale")).and_then(Value::as_f64) {
                    Some(m) => m as f32,
                    None if growth <= 1.0 => 1.0,
                    None => (1.0 + growth.ln() / old_context.ln()).sqrt() as f32,
                };
                periods
                    .into_iter()
                    .zip(factors)
                    .map(|(p, f)| {
                        f.as_f64().map(|f| p * f).ok_or_else(|| {
                            LoadError::Config("`rope_scaling.long_factor` holds a non-number".into())
                        })
                    })
                    .collect::<Result<_, _>>()?
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
                "rope_scaling type `{other}` is not supported (supported: default, linear, llama3, yarn, longrope, su, dynamic, proportional)"
            )))
            }
        };
        let inv_freqs: Vec<f32> = periods.iter().map(|&p| (1.0 / p) as f32).collect();
        Ok(Rope {
            inv_freqs: place_vector(&inv_freqs, device, "rope frequencies")?,
            traditional,
            amplitude,
        })
    }

    /// No rotation at all (a NoPE layer): every pair turns by angle 0, which leaves it exactly as
    /// it was, so the layer still takes the paths every other one takes.
    pub fn none(dims: usize, device: &Device) -> Result<Self, LoadError> {
        Ok(Rope {
            inv_freqs: place_vector(&vec![0.0; dims / 2], device, "rope frequencies")?,
            traditional: false,
            amplitude: 1.0,
        })
    }

    /// Rotates `x` (`[tokens, heads · head_dim]`) in place for the given positions.
    pub fn apply(
        &self,
        x: &mut Tensor,
        heads: usize,
        head_dim: usize,
        positions: &Positions,
    ) -> OpResult<()> {
        ops::rope_inplace(x, heads, head_dim, positions, self.rotation())
    }

    fn rotation(&self) -> ops::Rotation<'_> {
        ops::Rotation {
            inv_freqs: &self.inv_freqs,
            traditional: self.traditional,
            amplitude: self.amplitude,
        }
    }

    /// Where it turns whole heads of `head_dim` features, its amplitude as a factor of the
    /// attention scores (queries and keys each carry it once), which the softmax scale then
    /// takes so that the rotation itself need not: 1 otherwise, the amplitude staying on the
    /// rotation.
    pub fn take_amplitude(&mut self, head_dim: usize) -> f32 {
        if 2 * self.inv_freqs.len() != head_dim {
            return 1.0;
        }
        let a = std::mem::replace(&mut self.amplitude, 1.0);
        a * a
    }

    /// [`Rope::apply`] to a layer's queries and keys at the same positions, in one pass where
    /// the device allows.
    pub fn apply_pair(
        &self,
        q: &mut Tensor,
        heads: usize,
        k: &mut Tensor,
        kv_heads: usize,
        head_dim: usize,
        positions: &Positions,
    ) -> OpResult<()> {
        ops::rope_pair_inplace(q, heads, k, kv_heads, head_dim, positions, self.rotation())
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
    /// Scales the queries by position beyond an original context (Ministral 3's Llama 4
    /// scaling), where the model does.
    pub query_scale: Option<PositionScale>,
    /// The q/k norms come after the rotation (Hunyuan), not before.
    pub norm_after_rope: bool,
    /// Gemma 2's soft cap on the scaled scores.
    pub softcap: Option<f32>,
    /// gpt-oss's sink logit of each query head (`[heads]`).
    pub sinks: Option<Tensor>,
    /// Llama 4's chunked attention: a query sees only the positions of its own chunk of this
    /// many (from the last multiple of it up to its own).
    pub chunk: Option<usize>,
}

/// Llama 4's query scale: `1 + beta · ln(1 + ⌊(position + shift) / period⌋)`.
#[derive(Debug, Clone, Copy)]
pub struct PositionScale {
    pub beta: f32,
    pub period: usize,
    /// 1 where the positions count from 1 (Llama 4's own layers), 0 where from 0 (Ministral 3).
    pub shift: usize,
}

impl Attention {
    /// What its attention does besides the softmax: the scale, the soft cap and the sinks.
    pub fn options(&self) -> ops::AttentionOptions<'_> {
        let mut options = ops::AttentionOptions::scaled(self.scale);
        if let Some(cap) = self.softcap {
            options = options.with_softcap(cap);
        }
        if let Some(sinks) = &self.sinks {
            options = options.with_sinks(sinks);
        }
        options
    }

    /// `x` is `[tokens, hidden]`: one sequence's tokens over the one cache of `caches`, or the
    /// next token of each sequence over its own (see [`Attention::attend`]), with the
    /// projections `lora` names adapted.
    pub fn forward<C: AttentionCache>(
        &self,
        x: &Tensor,
        positions: &Positions,
        caches: &mut [&mut C],
        lora: ModuleAdapters,
    ) -> OpResult<Tensor> {
        let out = self.attend(Input::Plain(x), positions, caches, lora)?;
        self.o_proj.forward_adapted(&out, lora.get("o_proj"))
    }

    /// The heads' outputs before the output projection, with the projections `lora` names
    /// adapted. The input holds one sequence's tokens, which attend over the one cache of
    /// `caches`, or (several caches) one token of each sequence: row `i` sits at
    /// `positions[i]` and attends over `caches[i]`. Projections, cache writes and attention
    /// each run once for all rows; the new keys and values are appended.
    pub fn attend<C: AttentionCache>(
        &self,
        input: Input,
        positions: &Positions,
        caches: &mut [&mut C],
        lora: ModuleAdapters,
    ) -> OpResult<Tensor> {
        let fused = match caches {
            [cache] => self.project_into(input, positions, *cache, lora)?,
            _ => None,
        };
        let mut q = match fused {
            Some(q) => q,
            None => {
                let (q, k, v) = self.project_input(input, positions, lora)?;
                append_kv(caches, &k, &v, positions)?;
                q
            }
        };
        if let Some(PositionScale {
            beta,
            period,
            shift,
        }) = self.query_scale
        {
            ops::scale_by_position(&mut q, positions, beta, period, shift)?;
        }
        let (heads, head_dim, options) = (self.heads, self.head_dim, self.options());
        attend_kv(&q, heads, head_dim, positions, caches, options, self.chunk)
    }

    /// The rotated queries of one token whose keys and values went straight into `cache`, by
    /// one fused op (a GPU's decode step, saving the biases', the rotation's and the cache
    /// write's launches); `None` where it does not apply (adapters, per-head norms, unquantized
    /// projections, the host), having changed nothing.
    fn project_into<C: AttentionCache>(
        &self,
        input: Input,
        positions: &Positions,
        cache: &mut C,
        lora: ModuleAdapters,
    ) -> OpResult<Option<Tensor>> {
        let adapted = ["q_proj", "k_proj", "v_proj"]
            .iter()
            .any(|name| lora.get(name).is_some());
        let plain = !adapted && self.q_norm.is_none() && self.k_norm.is_none();
        let (Weight::Quantized(wq), Weight::Quantized(wk), Weight::Quantized(wv)) = (
            &self.q_proj.weight,
            &self.k_proj.weight,
            &self.v_proj.weight,
        ) else {
            return Ok(None);
        };
        if !plain {
            return Ok(None);
        }
        let (x, norm) = input.parts();
        let shape = ops::Heads {
            heads: self.heads,
            kv_heads: self.kv_heads,
            head_dim: self.head_dim,
        };
        let rope = self.rope.rotation();
        cache.append_with(positions, |target| {
            let ws = [
                (wq, self.q_proj.bias.as_ref()),
                (wk, self.k_proj.bias.as_ref()),
                (wv, self.v_proj.bias.as_ref()),
            ];
            ops::qkv_rope_write(ws, x, norm, shape, rope, positions, target)
        })
    }

    /// Queries, keys and values of the input (`[tokens, hidden]`, possibly still to be normed),
    /// normed and rotated (rotated and normed, with `norm_after_rope`).
    fn project_input(
        &self,
        input: Input,
        positions: &Positions,
        lora: ModuleAdapters,
    ) -> OpResult<(Tensor, Tensor, Tensor)> {
        let (mut q, mut k, v) = self.qkv(input, lora)?;
        let (heads, kv_heads, head_dim) = (self.heads, self.kv_heads, self.head_dim);
        if self.norm_after_rope {
            self.rope
                .apply_pair(&mut q, heads, &mut k, kv_heads, head_dim, positions)?;
        }
        if let Some(norm) = &self.q_norm {
            norm.forward_inplace(&mut q)?;
        }
        if let Some(norm) = &self.k_norm {
            norm.forward_inplace(&mut k)?;
        }
        if !self.norm_after_rope {
            self.rope
                .apply_pair(&mut q, heads, &mut k, kv_heads, head_dim, positions)?;
        }
        Ok((q, k, v))
    }

    /// The three projections of the input; one job for all three (and the input's norm) where
    /// they are plain quantized layers (biases are added after).
    fn qkv(&self, input: Input, lora: ModuleAdapters) -> OpResult<(Tensor, Tensor, Tensor)> {
        let projections = [&self.q_proj, &self.k_proj, &self.v_proj];
        let names = ["q_proj", "k_proj", "v_proj"];
        let quantized: Vec<&QuantizedMatrix> = projections
            .iter()
            .zip(names)
            .filter(|(_, name)| lora.get(name).is_none())
            .filter_map(|(p, _)| p.weight.quantized())
            .collect();
        if quantized.len() < 3 {
            let x = &*input.tensor()?;
            let (mut q, mut k, mut v) = (
                self.q_proj.forward(x)?,
                self.k_proj.forward(x)?,
                self.v_proj.forward(x)?,
            );
            LayerAdapter::add_all(
                x,
                &mut [
                    (lora.get("q_proj"), &mut q),
                    (lora.get("k_proj"), &mut k),
                    (lora.get("v_proj"), &mut v),
                ],
            )?;
            return Ok((q, k, v));
        }
        let (x, norm) = input.parts();
        let mut out = ops::quantized_matmul_group(&quantized, x, norm)?;
        for (y, p) in out.iter_mut().zip(projections) {
            if let Some(b) = &p.bias {
                ops::add_row_inplace(y, b)?;
            }
        }
        let mut out = out.into_iter();
        Ok((
            out.next().unwrap(),
            out.next().unwrap(),
            out.next().unwrap(),
        ))
    }

    /// Its projections, as mlx-lm's default LoRA keys select them (under `self_attn`).
    pub(crate) fn linears(&self) -> Vec<LinearShape> {
        self.linears_named([
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
        ])
    }

    /// Its projections under the keys `[q, k, v, o]`.
    pub(crate) fn linears_named(&self, [q, k, v, o]: [&'static str; 4]) -> Vec<LinearShape> {
        vec![
            linear_shape(q, &self.q_proj),
            linear_shape(k, &self.k_proj),
            linear_shape(v, &self.v_proj),
            linear_shape(o, &self.o_proj),
        ]
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
    pub fn load(vb: &mut Scope, dim: usize, hidden: usize, bias: bool) -> Result<Self, LoadError> {
        Ok(Mlp {
            gate_proj: Linear::load(&mut vb.pp("gate_proj"), dim, hidden, bias)?,
            up_proj: Linear::load(&mut vb.pp("up_proj"), dim, hidden, bias)?,
            down_proj: Linear::load(&mut vb.pp("down_proj"), hidden, dim, bias)?,
        })
    }

    pub fn forward(&self, x: &Tensor) -> OpResult<Tensor> {
        self.forward_adapted(x, ModuleAdapters::NONE)
    }

    /// [`Mlp::forward`] with the projections `lora` names adapted.
    pub fn forward_adapted(&self, x: &Tensor, lora: ModuleAdapters) -> OpResult<Tensor> {
        self.forward_with(x, lora, ops::Activation::Silu)
    }

    /// `down(act(gate(x)) · up(x))`, with the projections `lora` names adapted.
    pub fn forward_with(
        &self,
        x: &Tensor,
        lora: ModuleAdapters,
        act: ops::Activation,
    ) -> OpResult<Tensor> {
        let h = self.gated(Input::Plain(x), lora, act)?;
        self.down_proj.forward_adapted(&h, lora.get("down_proj"))
    }

    /// `act(gate(x)) · up(x)`, the input to the down projection: one pass over both
    /// projections (and the input's norm) where they are plain quantized layers of one format.
    pub fn gated(
        &self,
        input: Input,
        lora: ModuleAdapters,
        act: ops::Activation,
    ) -> OpResult<Tensor> {
        let (g, u) = (&self.gate_proj, &self.up_proj);
        let (ga, ua) = (lora.get("gate_proj"), lora.get("up_proj"));
        let plain = g.bias.is_none() && u.bias.is_none() && ga.is_none() && ua.is_none();
        if let (true, Weight::Quantized(gw), Weight::Quantized(uw)) = (plain, &g.weight, &u.weight)
        {
            let (x, norm) = input.parts();
            return ops::quantized_glu(gw, uw, x, norm, act);
        }
        let x = &*input.tensor()?;
        let (mut h, mut up) = (g.forward(x)?, u.forward(x)?);
        LayerAdapter::add_all(x, &mut [(ga, &mut h), (ua, &mut up)])?;
        ops::glu_inplace(&mut h, &up, act)?;
        Ok(h)
    }

    /// The GeGLU feed-forward block of Gemma: `down(gelu_approx(gate(x)) * up(x))`, with the
    /// projections `lora` names adapted.
    pub fn forward_geglu(&self, x: &Tensor, lora: ModuleAdapters) -> OpResult<Tensor> {
        self.forward_with(x, lora, ops::Activation::GeluApprox)
    }

    /// Its projections, as mlx-lm's default LoRA keys select them (under `mlp`).
    pub(crate) fn linears(&self) -> Vec<LinearShape> {
        self.linears_named(["mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"])
    }

    /// Its layers under the keys `[gate, up, down]`.
    pub(crate) fn linears_named(&self, [gate, up, down]: [&'static str; 3]) -> Vec<LinearShape> {
        vec![
            linear_shape(gate, &self.gate_proj),
            linear_shape(up, &self.up_proj),
            linear_shape(down, &self.down_proj),
        ]
    }
}

/// The end of every model: the last positions' hidden states (all for [`Logits::All`]), the
/// final norm, the output head (the embeddings when tied), optional soft-capping, and the logits
/// copied to the host for sampling (but for [`Logits::LastOnDevice`]).
pub struct OutputHead {
    pub norm: RmsNorm,
    /// `None` when the head is tied to the embeddings.
    pub lm_head: Option<Linear>,
    pub softcap: Option<f32>,
}

impl OutputHead {
    /// Logits `[rows, vocab]` of `h` (`[tokens, hidden]`), or its normed rows for the hidden
    /// states; on the host but for [`Logits::LastOnDevice`].
    pub fn forward(&self, h: Tensor, logits: Logits, embed: &Embedding) -> OpResult<Tensor> {
        let out = self.forward_on_device(h, logits, embed)?;
        match logits {
            Logits::LastOnDevice => Ok(out),
            Logits::Last | Logits::All | Logits::HiddenLast | Logits::HiddenAll => out.into_host(),
        }
    }

    /// [`OutputHead::forward`] left where it was computed, for a caller that reads only a
    /// little of it (greedy picks).
    pub fn forward_on_device(
        &self,
        h: Tensor,
        logits: Logits,
        embed: &Embedding,
    ) -> OpResult<Tensor> {
        let n = h.rows();
        let mut h = match logits {
            Logits::All | Logits::HiddenAll => h,
            Logits::Last | Logits::LastOnDevice | Logits::HiddenLast => ops::rows(&h, n - 1, 1)?,
        };
        if matches!(logits, Logits::HiddenLast | Logits::HiddenAll) {
            self.norm.forward_inplace(&mut h)?;
            return Ok(h);
        }
        let head = match &self.lm_head {
            Some(head) => head.bias.is_none().then_some(&head.weight),
            None => Some(&embed.weight),
        };
        let mut out = if let Some(Weight::Quantized(w)) = head {
            // The norm folded into the head's pass where the device can (a launch saved).
            let norm = ops::InputNorm {
                weight: &self.norm.weight,
                eps: self.norm.eps,
            };
            let mut out = ops::quantized_matmul_group(&[w], &h, Some(norm))?;
            out.pop().expect("one product")
        } else {
            self.norm.forward_inplace(&mut h)?;
            match &self.lm_head {
                Some(head) => head.forward(&h)?,
                None => embed.as_linear(&h)?,
            }
        };
        if let Some(cap) = self.softcap {
            ops::softcap_inplace(&mut out, cap)?;
        }
        Ok(out)
    }
}

/// Linear layer `l` as adapters see it: its key within its block (`self_attn.q_proj`) and its
/// shape.
pub(crate) fn linear_shape(key: &'static str, l: &Linear) -> LinearShape {
    LinearShape {
        key,
        in_features: l.weight.cols(),
        out_features: l.weight.rows(),
        experts: 0,
        parts: Vec::new(),
    }
}

/// The stacked layer `key` of a mixture's `experts` (each expert's `layer`), as adapters see it.
pub(crate) fn experts_shape(
    key: &'static str,
    experts: &[Mlp],
    layer: fn(&Mlp) -> &Linear,
) -> LinearShape {
    LinearShape {
        experts: experts.len(),
        ..linear_shape(key, layer(&experts[0]))
    }
}
