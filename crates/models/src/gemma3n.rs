//! Gemma 3n's text model as mlx-lm's `gemma3n.py` defines it: `model_type: gemma3n`, settings
//! under `text_config`, weights under `model.language_model.` (the audio and vision towers beside
//! it are dropped, as its `sanitize` drops them).
//!
//! Over the pieces it shares with Gemma 4's E-series (per-layer input embeddings and gates,
//! KV-shared layers, attention with q/k/v norms and scale 1):
//! - AltUp: `altup_num_inputs` streams of the hidden state. Each block predicts every stream
//!   from all of them, runs its attention and MLP on the active one, and corrects the others by
//!   what that changed, with coefficients routed per token; the streams start as projections of
//!   the embeddings and end projected back and averaged.
//! - LAuReL: a low-rank branch beside attention, `x + norm(right(left(x)))`.
//! - Activation sparsity: the MLPs of the layers `activation_sparsity_pattern` names keep only the
//!   gate values above a normal quantile of their row (a gaussian top-k).
//! - MLP widths per layer, and per-layer embeddings only for ids below
//!   `vocab_size_per_layer_input` (higher ids read its row 0).
//!
//! AltUp mixes rows by coefficients of their own and the top-k cuts each row at its own mean and
//! deviation, which no engine op does: both run on the host, where the streams stay (on a GPU the
//! active stream and the block's output cross over each layer).

use serde::Deserialize;
use serde_json::Value;

use crate::cache::{Cache, LayerCache};
use crate::checkpoint::{Checkpoint, Config, Scope};
use crate::decoder_grad::{Decoder, DecoderBlock};
use crate::gemma4::{
    attention_caches, discard_towers, kv_sources, sliding_layers, Attention, AttentionLayout,
    PerLayerGate, PerLayerInputs,
};
use crate::layers::{
    linear_shape, load_host_array, load_vector, Embedding, Linear, Mlp, OpResult, OutputHead,
    RmsNorm, Rope,
};
use crate::lora::{Adaptable, LinearShape, ModuleAdapters, PassAdapters};
use crate::pass::{Architecture, PassCaches};
use crate::{ForwardError, LoadError, ModelInfo};
use oxlm_engine::{ops, Device, EngineError, Positions, Tensor};

/// `text_config`'s keys. mlx-lm's `TextConfig` has no defaults: every key is required, but those
/// it reads as `None` (null or absent here).
#[derive(Deserialize)]
struct Gemma3nConfig {
    hidden_size: usize,
    num_hidden_layers: usize,
    intermediate_size: Widths,
    num_attention_heads: usize,
    head_dim: usize,
    rms_norm_eps: f32,
    vocab_size: usize,
    num_key_value_heads: usize,
    num_kv_shared_layers: usize,
    vocab_size_per_layer_input: usize,
    sliding_window: usize,
    max_position_embeddings: usize,
    rope_local_base_freq: f32,
    rope_theta: f32,
    final_logit_softcapping: Option<f32>,
    layer_types: Vec<String>,
    /// Per layer, the share of its MLP's gate values the gaussian top-k zeroes (f64: mlx-lm
    /// takes `2s - 1` in Python floats).
    activation_sparsity_pattern: Option<Vec<f64>>,
    hidden_size_per_layer_input: usize,
    altup_num_inputs: usize,
    altup_coef_clip: Option<f32>,
    altup_correct_scale: bool,
    altup_active_idx: usize,
    laurel_rank: usize,
}

/// `intermediate_size`: one MLP width for every layer, or one per layer.
#[derive(Deserialize)]
#[serde(untagged)]
enum Widths {
    All(usize),
    PerLayer(Vec<usize>),
}

/// mlx-lm's `TextConfig`, checked, and what the model's `__init__` derives from it.
struct Args {
    hidden: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    eps: f32,
    vocab: usize,
    per_layer_vocab: usize,
    per_layer_dim: usize,
    sliding_window: usize,
    max_context: usize,
    softcap: Option<f32>,
    /// Per layer: its MLP's width, and its gaussian top-k's multiplier (none for a dense MLP).
    widths: Vec<usize>,
    std_multipliers: Vec<Option<f32>>,
    /// Per layer: a sliding-window layer (else global).
    sliding: Vec<bool>,
    /// Per layer: the layer whose cache it attends over (itself unless KV-shared).
    kv_sources: Vec<usize>,
    /// Layers with a cache of their own: the first `num_hidden_layers - num_kv_shared_layers`.
    cached_layers: usize,
    streams: usize,
    active: usize,
    coef_clip: Option<f32>,
    correct_scale: bool,
    laurel_rank: usize,
    sliding_rope: Rope,
    global_rope: Rope,
}

impl Args {
    fn from_config(cfg: &Config, device: &Device) -> Result<Self, LoadError> {
        let bad = |msg: String| LoadError::Config(msg);
        let c: Gemma3nConfig = cfg.args()?;
        let layers = c.num_hidden_layers;
        let per_layer = |key: &str, len: usize| match len < layers {
            true => Err(bad(format!("`{key}` names {len} of {layers} layers"))),
            false => Ok(()),
        };
        let widths = match c.intermediate_size {
            Widths::All(width) => vec![width; layers],
            Widths::PerLayer(widths) => {
                per_layer("intermediate_size", widths.len())?;
                widths[..layers].to_vec()
            }
        };
        let sparsity = c
            .activation_sparsity_pattern
            .unwrap_or_else(|| vec![0.0; layers]);
        per_layer("activation_sparsity_pattern", sparsity.len())?;
        let std_multipliers = sparsity[..layers]
            .iter()
            .map(|&s| match s {
                // As mlx-lm: the top-k runs where the share is positive.
                s if s > 0.0 && s < 1.0 => Ok(Some(std_multiplier(s))),
                s if s > 0.0 => Err(bad(format!(
                    "`activation_sparsity_pattern` holds {s}: a share must be below 1"
                ))),
                _ => Ok(None),
            })
            .collect::<Result<_, _>>()?;
        let (streams, active) = (c.altup_num_inputs, c.altup_active_idx);
        if active >= streams {
            return Err(bad(format!(
                "`altup_active_idx` {active} is not one of the {streams} streams of \
                 `altup_num_inputs`"
            )));
        }
        if c.sliding_window == 0 || c.vocab_size_per_layer_input == 0 {
            return Err(bad(
                "`sliding_window` and `vocab_size_per_layer_input` must be positive".into(),
            ));
        }
        let sliding = sliding_layers(&c.layer_types, layers)?;
        let cached_layers = layers.saturating_sub(c.num_kv_shared_layers);
        let head_dim = c.head_dim;
        let rope = |base| Rope::new(head_dim, base, false, None, None, device);
        Ok(Args {
            hidden: c.hidden_size,
            heads: c.num_attention_heads,
            kv_heads: c.num_key_value_heads,
            head_dim,
            eps: c.rms_norm_eps,
            vocab: c.vocab_size,
            per_layer_vocab: c.vocab_size_per_layer_input,
            per_layer_dim: c.hidden_size_per_layer_input,
            sliding_window: c.sliding_window,
            max_context: c.max_position_embeddings,
            softcap: c.final_logit_softcapping,
            widths,
            std_multipliers,
            kv_sources: kv_sources(&sliding, cached_layers)?,
            sliding,
            cached_layers,
            streams,
            active,
            coef_clip: c.altup_coef_clip,
            correct_scale: c.altup_correct_scale,
            laurel_rank: c.laurel_rank,
            sliding_rope: rope(c.rope_local_base_freq)?,
            global_rope: rope(c.rope_theta)?,
        })
    }
}

/// `√2 · erfinv(2s − 1)`, the standard normal quantile of `sparsity` (as mlx computes it, in f32):
/// the gaussian top-k keeps a gate value this many standard deviations above its row's mean.
fn std_multiplier(sparsity: f64) -> f32 {
    erfinv((2.0 * sparsity - 1.0) as f32) * std::f32::consts::SQRT_2
}

/// The inverse error function as MLX computes it in f32 (`mlx/backend/common/erf.cpp`:
/// polynomials in `ln(1 - a²)`, at most 2.4 ulp from the true value).
fn erfinv(a: f32) -> f32 {
    let t = a.mul_add(-a, 1.0).ln();
    let coefficients: &[f32] = if t.abs() > 6.125 {
        &[
            3.0369757e-10,
            2.932431e-8,
            1.2215033e-6,
            2.8410896e-5,
            0.00039355297,
            0.0030269881,
            0.004831858,
            -0.26464614,
            0.8400165,
        ]
    } else {
        &[
            5.4387783e-9,
            1.4328545e-7,
            1.2277479e-6,
            1.12963626e-7,
            -5.6153076e-5,
            -0.00014769763,
            0.0023146868,
            0.011539258,
            -0.23201548,
            0.8862269,
        ]
    };
    let p = coefficients[1..]
        .iter()
        .fold(coefficients[0], |p, &c| p.mul_add(t, c));
    a * p
}

/// The root mean square of each `hidden`-wide row of `x`.
fn row_rms(x: &[f32], hidden: usize) -> Vec<f32> {
    let mean_square = |row: &[f32]| row.iter().map(|&v| v as f64 * v as f64).sum::<f64>();
    (x.chunks_exact(hidden))
        .map(|row| (mean_square(row) / hidden as f64).sqrt() as f32)
        .collect()
}

/// Scales each row of `x` to the root mean square `target[row]`: AltUp keeps its streams at the
/// first one's magnitude.
fn match_magnitude(x: &mut [f32], target: &[f32], hidden: usize) {
    let magnitudes = row_rms(x, hidden);
    for ((row, t), m) in x.chunks_exact_mut(hidden).zip(target).zip(magnitudes) {
        // mlx-lm divides by max(m, finfo.min), the most negative float: by m itself.
        let ratio = t / m;
        row.iter_mut().for_each(|v| *v *= ratio);
    }
}

/// Each row's `outputs` routed coefficients, `weights · modalities[row]`: `[rows, outputs]`
/// from `weights` `[outputs, streams]` and `modalities` `[rows, streams]`.
fn route(weights: &[f32], modalities: &[f32], streams: usize) -> Vec<f32> {
    (modalities.chunks_exact(streams))
        .flat_map(|m| {
            (weights.chunks_exact(streams))
                .map(move |w| w.iter().zip(m).map(|(w, m)| w * m).sum::<f32>())
        })
        .collect()
}

/// AltUp's streams of the hidden state: `[rows, hidden]` each, on the host.
struct Streams {
    hidden: usize,
    streams: Vec<Vec<f32>>,
}

impl Streams {
    fn rows(&self) -> usize {
        self.streams[0].len() / self.hidden
    }

    /// `data`, rows as wide as a stream's, on `device`.
    fn placed(&self, data: &[f32], device: &Device) -> OpResult<Tensor> {
        Tensor::from_slice(vec![self.rows(), self.hidden], data, device)
    }
}

/// A block's AltUp: its router and the coefficients it routes.
struct AltUp {
    router_norm: RmsNorm,
    modality_router: Linear,
    /// `[streams², streams]`: row `j · streams + i` routes stream `i`'s weight in stream `j`'s
    /// prediction. Host values, clipped as mlx-lm clips them before each use.
    prediction_coefs: Vec<f32>,
    /// `[streams, streams]`: row `j` routes the weight, less one, of what the block changed in
    /// stream `j`'s correction. Clipped likewise.
    correction_coefs: Vec<f32>,
    /// Scales the corrected active stream on its way to the per-layer gate
    /// (`altup_correct_scale`).
    correct_output_scale: Option<Tensor>,
    active: usize,
}

impl AltUp {
    fn load(a: &mut Scope, args: &Args) -> Result<Self, LoadError> {
        let (hidden, k) = (args.hidden, args.streams);
        let mut coefs = |name: &str, rows: usize| -> Result<Vec<f32>, LoadError> {
            let weights = load_host_array(&mut a.pp(name), "weight", &[rows, k])?;
            Ok(match args.coef_clip {
                // `mx.clip`: a maximum, then a minimum.
                Some(c) => weights.iter().map(|w| w.max(-c).min(c)).collect(),
                None => weights,
            })
        };
        let prediction_coefs = coefs("prediction_coefs", k * k)?;
        let correction_coefs = coefs("correction_coefs", k)?;
        let scale = load_vector(a, "correct_output_scale", hidden)?;
        Ok(AltUp {
            router_norm: RmsNorm::load(&mut a.pp("router_norm"), hidden, args.eps)?,
            modality_router: Linear::load(&mut a.pp("modality_router"), hidden, k, false)?,
            prediction_coefs,
            correction_coefs,
            correct_output_scale: args.correct_scale.then_some(scale),
            active: args.active,
        })
    }

    /// `tanh(router(norm(x) / hidden))`: each row's routing over the streams, `[rows, streams]`
    /// on the host.
    fn modalities(&self, x: &Tensor, lora: ModuleAdapters) -> OpResult<Vec<f32>> {
        let mut routed = self.router_norm.forward(x)?;
        ops::scale_inplace(&mut routed, (x.cols() as f64).recip() as f32)?;
        let routed =
            (self.modality_router).forward_adapted(&routed, lora.get("modality_router"))?;
        Ok(routed.into_vec()?.into_iter().map(f32::tanh).collect())
    }

    /// Each stream predicted from all of them: `x_j + Σ_i c_ji · x_i`, the coefficients routed
    /// from the active stream.
    fn predict(&self, x: &Streams, device: &Device, lora: ModuleAdapters) -> OpResult<Streams> {
        let (hidden, k) = (x.hidden, x.streams.len());
        let active = x.placed(&x.streams[self.active], device)?;
        let coefs = route(&self.prediction_coefs, &self.modalities(&active, lora)?, k);
        let predict = |j: usize| {
            let mut out = vec![0.0; x.streams[j].len()];
            let rows = out.chunks_exact_mut(hidden).enumerate();
            for ((r, row), c) in rows.zip(coefs.chunks_exact(k * k)) {
                for (i, &c) in c[j * k..(j + 1) * k].iter().enumerate() {
                    let from = &x.streams[i][r * hidden..(r + 1) * hidden];
                    row.iter_mut().zip(from).for_each(|(o, v)| *o += c * v);
                }
            }
            out.iter_mut().zip(&x.streams[j]).for_each(|(o, v)| *o += v);
            out
        };
        Ok(Streams {
            hidden,
            streams: (0..k).map(predict).collect(),
        })
    }

    /// The predictions corrected by what the block made of the active one (`activated`):
    /// `p_j + (c_j + 1) · (activated − p_active)`, the coefficients routed from `activated`.
    fn correct(
        &self,
        mut predictions: Streams,
        activated: &Tensor,
        lora: ModuleAdapters,
    ) -> OpResult<Streams> {
        let (hidden, k) = (predictions.hidden, predictions.streams.len());
        let coefs = route(
            &self.correction_coefs,
            &self.modalities(activated, lora)?,
            k,
        );
        let mut innovation = activated.to_vec()?;
        (innovation.iter_mut())
            .zip(&predictions.streams[self.active])
            .for_each(|(a, p)| *a -= p);
        for (j, stream) in predictions.streams.iter_mut().enumerate() {
            let rows = stream
                .chunks_exact_mut(hidden)
                .zip(innovation.chunks_exact(hidden));
            for ((row, change), c) in rows.zip(coefs.chunks_exact(k)) {
                let weight = c[j] + 1.0;
                row.iter_mut()
                    .zip(change)
                    .for_each(|(p, d)| *p += d * weight);
            }
        }
        Ok(predictions)
    }
}

/// LAuReL: `x + norm(right(left(x)))`, a low-rank branch beside attention.
struct Laurel {
    linear_left: Linear,
    linear_right: Linear,
    post_laurel_norm: RmsNorm,
}

impl Laurel {
    fn load(l: &mut Scope, args: &Args) -> Result<Self, LoadError> {
        let (hidden, rank) = (args.hidden, args.laurel_rank);
        Ok(Laurel {
            linear_left: Linear::load(&mut l.pp("linear_left"), hidden, rank, false)?,
            linear_right: Linear::load(&mut l.pp("linear_right"), rank, hidden, false)?,
            post_laurel_norm: RmsNorm::load(&mut l.pp("post_laurel_norm"), hidden, args.eps)?,
        })
    }

    fn forward(&self, x: &Tensor, lora: ModuleAdapters) -> OpResult<Tensor> {
        let low = self
            .linear_left
            .forward_adapted(x, lora.get("linear_left"))?;
        let mut out = self
            .linear_right
            .forward_adapted(&low, lora.get("linear_right"))?;
        self.post_laurel_norm.forward_inplace(&mut out)?;
        ops::add_inplace(&mut out, x)?;
        Ok(out)
    }

    fn linears(&self) -> [LinearShape; 2] {
        [
            linear_shape("laurel.linear_left", &self.linear_left),
            linear_shape("laurel.linear_right", &self.linear_right),
        ]
    }
}

/// `max(0, g − (mean + std · multiplier))` of each row of the gate values `gate`: what lies above
/// the row's normal quantile (mlx-lm's `gelu_topk`, before its GeLU).
fn gaussian_top_k(gate: Tensor, multiplier: f32) -> OpResult<Tensor> {
    let (shape, device, width) = (gate.shape().to_vec(), gate.device(), gate.cols());
    let mut values = gate.into_vec()?;
    for row in values.chunks_exact_mut(width) {
        let n = width as f64;
        let mean = row.iter().map(|&v| v as f64).sum::<f64>() / n;
        let variance = row.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / n;
        let cutoff = mean as f32 + variance.sqrt() as f32 * multiplier;
        row.iter_mut().for_each(|v| *v = (*v - cutoff).max(0.0));
    }
    Tensor::from_slice(shape, &values, &device)
}

struct Block {
    altup: AltUp,
    input_layernorm: RmsNorm,
    laurel: Laurel,
    self_attn: Attention,
    post_attention_layernorm: RmsNorm,
    pre_feedforward_layernorm: RmsNorm,
    mlp: Mlp,
    /// The gaussian top-k's multiplier on a sparse layer's MLP gate.
    std_multiplier: Option<f32>,
    post_feedforward_layernorm: RmsNorm,
    per_layer: PerLayerGate,
    /// The cache this layer attends over: its own, or for a KV-shared layer that of the last
    /// earlier layer of the same kind.
    kv_source: usize,
}

impl Block {
    /// Block `i` of the model, from its scope (`model.language_model.layers.{i}`).
    fn load(block: &mut Scope, args: &Args, i: usize) -> Result<Self, LoadError> {
        let (hidden, eps) = (args.hidden, args.eps);
        let sliding = args.sliding[i];
        let layout = AttentionLayout {
            hidden,
            heads: args.heads,
            kv_heads: args.kv_heads,
            head_dim: args.head_dim,
            eps,
            rope: match sliding {
                true => args.sliding_rope.clone(),
                false => args.global_rope.clone(),
            },
            sliding,
            own_kv: i < args.cached_layers,
            k_eq_v: false,
        };
        let norm = |block: &mut Scope, name: &str| RmsNorm::load(&mut block.pp(name), hidden, eps);
        Ok(Block {
            altup: AltUp::load(&mut block.pp("altup"), args)?,
            input_layernorm: norm(block, "input_layernorm")?,
            laurel: Laurel::load(&mut block.pp("laurel"), args)?,
            self_attn: Attention::load_layout(&mut block.pp("self_attn"), layout)?,
            post_attention_layernorm: norm(block, "post_attention_layernorm")?,
            pre_feedforward_layernorm: norm(block, "pre_feedforward_layernorm")?,
            mlp: Mlp::load(&mut block.pp("mlp"), hidden, args.widths[i], false)?,
            std_multiplier: args.std_multipliers[i],
            post_feedforward_layernorm: norm(block, "post_feedforward_layernorm")?,
            per_layer: PerLayerGate::load(block, hidden, args.per_layer_dim, eps)?,
            kv_source: args.kv_sources[i],
        })
    }

    /// The GeGLU MLP, its gate through the gaussian top-k on a sparse layer.
    fn mlp(&self, x: &Tensor, lora: ModuleAdapters) -> OpResult<Tensor> {
        let Some(multiplier) = self.std_multiplier else {
            return self.mlp.forward_geglu(x, lora);
        };
        let mlp = &self.mlp;
        let gate = mlp.gate_proj.forward_adapted(x, lora.get("gate_proj"))?;
        let mut h = gaussian_top_k(gate, multiplier)?;
        let up = mlp.up_proj.forward_adapted(x, lora.get("up_proj"))?;
        ops::gelu_approx_mul_inplace(&mut h, &up)?;
        mlp.down_proj.forward_adapted(&h, lora.get("down_proj"))
    }

    /// The block over the streams `x`, as block `layer` of the pass: `input` is its slice of the
    /// per-layer inputs, `lora` gives its modules' adapters by name.
    fn forward<'a>(
        &self,
        x: Streams,
        input: &Tensor,
        positions: &Positions,
        caches: &mut PassCaches,
        layer: usize,
        lora: impl Fn(&'static str) -> ModuleAdapters<'a>,
    ) -> Result<Streams, ForwardError> {
        let device = input.device();
        let altup = &self.altup;
        let predictions = altup.predict(&x, &device, lora("altup"))?;
        let active = predictions.placed(&predictions.streams[altup.active], &device)?;
        let normed = self.input_layernorm.forward(&active)?;
        let laurel = self.laurel.forward(&normed, lora("laurel"))?;
        let layers = (layer, self.kv_source);
        let attn = &self.self_attn;
        let mut h = attn.run(&normed, positions, caches, layers, lora("self_attn"))?;
        self.post_attention_layernorm.forward_inplace(&mut h)?;
        ops::add_inplace(&mut h, &active)?;
        ops::add_inplace(&mut h, &laurel)?;
        ops::scale_inplace(&mut h, std::f32::consts::FRAC_1_SQRT_2)?;
        let mut r = self.mlp(&self.pre_feedforward_layernorm.forward(&h)?, lora("mlp"))?;
        self.post_feedforward_layernorm.forward_inplace(&mut r)?;
        ops::add_inplace(&mut h, &r)?;

        let mut corrected = altup.correct(predictions, &h, lora("altup"))?;
        let mut first = corrected.placed(&corrected.streams[altup.active], &device)?;
        if let Some(scale) = &altup.correct_output_scale {
            ops::mul_row_inplace(&mut first, scale)?;
        }
        let gated = self
            .per_layer
            .forward(&first, input, lora(""))?
            .into_vec()?;
        // Every stream but the first takes the per-layer input, whichever is active.
        for stream in &mut corrected.streams[1..] {
            stream.iter_mut().zip(&gated).for_each(|(s, g)| *s += g);
        }
        Ok(corrected)
    }

    /// Its layers, as mlx-lm's LoRA keys select them (those its adapters can run: mlx-lm reads
    /// AltUp's coefficient layers' `weight` directly, which an adapted layer has not). A
    /// KV-shared layer has projections of keys and values of `shared_kv`'s shape in mlx-lm,
    /// which adapters may name; reading an earlier layer's cache, it never runs them.
    fn linears(&self, shared_kv: Option<(usize, usize)>) -> Vec<LinearShape> {
        let mut linears = self.self_attn.linears();
        if let Some((inputs, outputs)) = shared_kv {
            linears.extend(
                ["self_attn.k_proj", "self_attn.v_proj"].map(|key| LinearShape {
                    key,
                    in_features: inputs,
                    out_features: outputs,
                    experts: 0,
                    parts: Vec::new(),
                }),
            );
        }
        linears.extend(self.mlp.linears());
        linears.push(linear_shape(
            "altup.modality_router",
            &self.altup.modality_router,
        ));
        linears.extend(self.laurel.linears());
        linears.extend(self.per_layer.linears());
        linears
    }
}

/// The modules of a `gemma3n` checkpoint besides its language model, which mlx-lm drops.
const NON_TEXT_MODULES: [&str; 4] = ["vision_tower", "audio_tower", "embed_audio", "embed_vision"];

pub struct Gemma3n {
    info: ModelInfo,
    embed_tokens: Embedding,
    embed_scale: f32,
    per_layer_inputs: PerLayerInputs,
    /// `vocab_size_per_layer_input`: ids from it on read the per-layer embeddings' row 0.
    per_layer_vocab: usize,
    per_layer_dim: usize,
    /// Streams 1.. from the embeddings, and back to the hidden state.
    altup_projections: Vec<Linear>,
    altup_unembed_projections: Vec<Linear>,
    layers: Vec<Block>,
    head: OutputHead,
    sliding_window: usize,
    /// Layers with a cache of their own: the first `num_hidden_layers - num_kv_shared_layers`.
    cached_layers: usize,
    /// `(hidden, kv_heads · head_dim)`: the shape of a layer's key and value projections.
    kv_shape: (usize, usize),
}

impl Gemma3n {
    pub fn load(mut ckpt: Checkpoint) -> Result<Self, LoadError> {
        let model_type = ckpt.config.model_type()?.to_string();
        // As `gemma3n.py`'s `sanitize`: only the language model is kept.
        discard_towers(&mut ckpt, &NON_TEXT_MODULES);
        let text = match ckpt.config.top_level("text_config") {
            Some(text @ Value::Object(_)) => Config::from_value(text.clone())?,
            _ => return Err(LoadError::Config("`text_config` is missing".into())),
        };
        let device = ckpt.device.clone();
        let args = Args::from_config(&text, &device)?;
        let (hidden, vocab, layers) = (args.hidden, args.vocab, args.sliding.len());
        let mut model = ckpt.scope("model.language_model");
        let embed_tokens = Embedding::load(&mut model.pp("embed_tokens"), vocab, hidden)?;
        let per_layer_inputs = PerLayerInputs::load(
            &mut model,
            (args.per_layer_vocab, hidden),
            (layers, args.per_layer_dim),
            args.eps,
        )?;
        let mut projections = |name: &str| {
            (0..args.streams - 1)
                .map(|k| {
                    Linear::load(
                        &mut model.pp(format_args!("{name}.{k}")),
                        hidden,
                        hidden,
                        false,
                    )
                })
                .collect::<Result<Vec<_>, _>>()
        };
        let altup_projections = projections("altup_projections")?;
        let altup_unembed_projections = projections("altup_unembed_projections")?;
        let blocks = (0..layers)
            .map(|i| Block::load(&mut model.pp(format_args!("layers.{i}")), &args, i))
            .collect::<Result<Vec<_>, _>>()?;
        let norm = RmsNorm::load(&mut model.pp("norm"), hidden, args.eps)?;
        ckpt.finish()?;
        Ok(Gemma3n {
            info: ModelInfo {
                model_type,
                vocab_size: vocab,
                hidden_size: hidden,
                num_layers: layers,
                max_context: Some(args.max_context),
                device,
            },
            embed_tokens,
            embed_scale: (hidden as f64).sqrt() as f32,
            per_layer_inputs,
            per_layer_vocab: args.per_layer_vocab,
            per_layer_dim: args.per_layer_dim,
            altup_projections,
            altup_unembed_projections,
            layers: blocks,
            head: OutputHead {
                norm,
                lm_head: None,
                softcap: args.softcap,
            },
            sliding_window: args.sliding_window,
            cached_layers: args.cached_layers,
            kv_shape: (hidden, args.kv_heads * args.head_dim),
        })
    }

    /// AltUp's streams from the scaled embeddings `h`: `h`, and each projection of it scaled to
    /// its magnitude.
    fn spread(&self, h: &Tensor) -> OpResult<Streams> {
        let hidden = self.info.hidden_size;
        let first = h.to_vec()?;
        let target = row_rms(&first, hidden);
        let mut streams = vec![first];
        for projection in &self.altup_projections {
            let mut stream = projection.forward(h)?.into_vec()?;
            match_magnitude(&mut stream, &target, hidden);
            streams.push(stream);
        }
        Ok(Streams { hidden, streams })
    }

    /// The hidden state after the last block: each stream but the first projected back and
    /// scaled to the first's magnitude, then the streams' mean.
    fn merge(&self, mut x: Streams) -> OpResult<Tensor> {
        let (hidden, device) = (x.hidden, &self.info.device);
        let target = row_rms(&x.streams[0], hidden);
        for k in 1..x.streams.len() {
            let stream = x.placed(&x.streams[k], device)?;
            let mut back = self.altup_unembed_projections[k - 1]
                .forward(&stream)?
                .into_vec()?;
            match_magnitude(&mut back, &target, hidden);
            x.streams[k] = back;
        }
        let mut mean = x.streams[0].clone();
        for stream in &x.streams[1..] {
            mean.iter_mut().zip(stream).for_each(|(m, s)| *m += s);
        }
        let share = (x.streams.len() as f32).recip();
        mean.iter_mut().for_each(|m| *m *= share);
        x.placed(&mean, device)
    }
}

impl Architecture for Gemma3n {
    fn info(&self) -> &ModelInfo {
        &self.info
    }

    /// Only the first `cached_layers` keep a cache; the KV-shared layers read theirs.
    fn layer_caches(&self) -> Result<Vec<LayerCache>, EngineError> {
        let attentions = self.layers[..self.cached_layers]
            .iter()
            .map(|b| &b.self_attn);
        attention_caches(attentions, self.sliding_window, &self.info.device)
    }

    fn hidden_states(
        &self,
        tokens: &[u32],
        caches: &mut [&mut Cache],
        adapters: Option<PassAdapters>,
    ) -> Result<Tensor, ForwardError> {
        let (mut caches, positions) =
            PassCaches::new(&self.info, tokens, caches, self.cached_layers)?;
        let (hidden, dim) = (self.info.hidden_size, self.per_layer_dim);
        let h = self.embed(tokens)?;
        let per_layer_ids: Vec<u32> = (tokens.iter())
            .map(|&t| match (t as usize) < self.per_layer_vocab {
                true => t,
                false => 0,
            })
            .collect();
        let inputs = (self.per_layer_inputs).forward(&per_layer_ids, &h, hidden)?;
        let mut x = self.spread(&h)?;
        for (i, block) in self.layers.iter().enumerate() {
            let lora = |module| adapters.map_or(ModuleAdapters::NONE, |a| a.module(i, module));
            let input = ops::columns(&inputs, i * dim, dim)?;
            x = block.forward(x, &input, &positions, &mut caches, i, lora)?;
        }
        caches.finish();
        Ok(self.merge(x)?)
    }

    fn output(&self) -> (&OutputHead, &Embedding) {
        (&self.head, &self.embed_tokens)
    }
}

impl Adaptable for Gemma3n {
    fn decoder(&self) -> &dyn Decoder {
        self
    }

    fn blocks_path(&self) -> &'static str {
        "model.language_model.layers"
    }

    fn block_linears(&self) -> Vec<Vec<LinearShape>> {
        let blocks = self.layers.iter().enumerate();
        blocks
            .map(|(i, b)| b.linears((i >= self.cached_layers).then_some(self.kv_shape)))
            .collect()
    }
}

impl Decoder for Gemma3n {
    fn embed(&self, tokens: &[u32]) -> OpResult<Tensor> {
        let mut h = self.embed_tokens.forward(tokens)?;
        ops::scale_inplace(&mut h, self.embed_scale)?;
        Ok(h)
    }

    fn blocks(&self, _tokens: &[u32]) -> OpResult<Vec<DecoderBlock<'_>>> {
        Err(EngineError::Unsupported(
            "LoRA training through AltUp's streams".into(),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// mlx's own values of `math.sqrt(2.0) * mx.erfinv(2 * s - 1)`, bit for bit.
    #[test]
    fn std_multipliers_are_mlxs() {
        for (sparsity, mlx) in [
            (0.95, 1.6448533535003662),
            (0.75, 0.6744897365570068),
            (0.99, 2.326348304748535),
            (0.5, 0.0),
        ] {
            assert_eq!(std_multiplier(sparsity), mlx as f32, "{sparsity}");
        }
    }
}
