//! Qwen3.5 as mlx-lm's `qwen3_5.py` defines it, with the layers it takes from `qwen3_next.py`
//! and `gated_delta.py`: gated-DeltaNet linear attention in most layers and gated full attention
//! in every `full_attention_interval`-th one. `qwen3_5_moe` (mlx-lm's `qwen3_5_moe.py`) replaces
//! each MLP with a sparse mixture of experts, and `qwen3_next` (Qwen3-Next, `qwen3_next.py`) is
//! that model with fused linear-attention projections and some layers kept dense.
//!
//! Checkpoints: mlx-lm saves the text model under `language_model.` (`language_model.model.*`,
//! `language_model.lm_head`), the config possibly nested under `text_config`. Hugging Face
//! checkpoints (`model.language_model.*` or `model.*`) are read as mlx-lm's `sanitize` reads
//! them: their conv1d weights are `[channels, 1, kernel]` and their RMSNorms scale by `1 + w`.

use std::ops::Range;

use oxlm_engine::ops::recurrent::{self, DeltaRuleDims};
use oxlm_engine::{ops, DType, Device, EngineError, Positions, Tensor};
use serde::Deserialize;
use serde_json::Value;

use crate::cache::{append_kv, attend_kv, Cache, KvCache, LayerCache, RecurrentCache};
use crate::checkpoint::{Checkpoint, Scope};
use crate::decoder_grad::Decoder;
use crate::layers::{
    linear_shape, load_conv1d, load_host_vector, load_vector, place_vector, Embedding, Linear, Mlp,
    OpResult, OutputHead, RmsNorm, Rope,
};
use crate::lora::{Adaptable, LinearShape, ModuleAdapters, PassAdapters};
use crate::pass::{Architecture, LayerCaches, PassCaches};
use crate::switch::{ExpertMlps, FeedForward, MoeNames, Routing, Shared, SharedNames, SparseMoe};
use crate::{ForwardError, LoadError, ModelInfo};

mod grad;

/// The eps of the L2 normalization of q and k in the delta rule (`normalize_qk`'s `eps`).
const QK_NORM_EPS: f64 = 1e-6;

/// The linear-attention mixer (mlx-lm's `GatedDeltaNet`).
struct GatedDeltaNet {
    in_proj_qkv: Linear,
    in_proj_z: Linear,
    in_proj_b: Linear,
    in_proj_a: Linear,
    /// Depthwise convolution weights, `[conv_dim, kernel]`.
    conv1d: Tensor,
    kernel: usize,
    dt_bias: Tensor,
    /// `-exp(A_log)`: each value head's decay rate.
    neg_a: Tensor,
    /// RMSNorm of each head's output before the `silu(z)` gate.
    norm: RmsNorm,
    /// `normalize_qk`: L2 normalization as an unscaled RMSNorm with eps scaled by 1/k_dim.
    unit_norm: RmsNorm,
    out_proj: Linear,
    dims: DeltaRuleDims,
}

impl GatedDeltaNet {
    fn key_dim(&self) -> usize {
        self.dims.k_heads * self.dims.k_dim
    }

    /// Channels of the convolution: queries, keys and values side by side.
    fn conv_dim(&self) -> usize {
        2 * self.key_dim() + self.dims.v_heads * self.dims.v_dim
    }

    fn new_cache(&self, device: &Device) -> OpResult<RecurrentCache> {
        RecurrentCache::new(self.conv_dim(), self.kernel, self.dims, device)
    }

    /// `x` holds one sequence's tokens, continuing the one cache of `caches`, or the next token
    /// of each sequence, continuing its own; the projections `lora` names are adapted.
    fn forward(
        &self,
        x: &Tensor,
        caches: &mut [&mut RecurrentCache],
        lora: ModuleAdapters,
    ) -> OpResult<Tensor> {
        let d = self.dims;
        let key_dim = self.key_dim();
        let qkv = self
            .in_proj_qkv
            .forward_adapted(x, lora.get("in_proj_qkv"))?;
        let mut z = self.in_proj_z.forward_adapted(x, lora.get("in_proj_z"))?;
        let b = self.in_proj_b.forward_adapted(x, lora.get("in_proj_b"))?;
        let a = self.in_proj_a.forward_adapted(x, lora.get("in_proj_a"))?;

        let mut convs: Vec<&mut Tensor> = caches.iter_mut().map(|c| &mut c.conv).collect();
        let mut mixed = recurrent::causal_conv1d(&qkv, &self.conv1d, self.kernel, &mut convs)?;
        ops::silu_inplace(&mut mixed)?;
        let mut q = ops::columns(&mixed, 0, key_dim)?;
        let mut k = ops::columns(&mixed, key_dim, key_dim)?;
        let v = ops::columns(&mixed, 2 * key_dim, self.conv_dim() - 2 * key_dim)?;

        // `normalize_qk`: L2-normalized q and k, with the 1/sqrt(k_dim) readout scale folded
        // into q.
        let inv_scale = (d.k_dim as f64).powf(-0.5);
        self.unit_norm.forward_inplace(&mut q)?;
        self.unit_norm.forward_inplace(&mut k)?;
        ops::scale_inplace(&mut q, (inv_scale * inv_scale) as f32)?;
        ops::scale_inplace(&mut k, inv_scale as f32)?;

        let (g, beta) = recurrent::delta_gates(&a, &b, &self.dt_bias, &self.neg_a)?;
        let mut states: Vec<&mut Tensor> = caches.iter_mut().map(|c| &mut c.state).collect();
        let mut y = recurrent::gated_delta_rule(&q, &k, &v, &g, &beta, d, &mut states)?;
        self.norm.forward_inplace(&mut y)?;
        ops::silu_mul_inplace(&mut z, &y)?;
        self.out_proj.forward_adapted(&z, lora.get("out_proj"))
    }

    /// Its projections, as mlx-lm's default LoRA keys select them.
    fn linears(&self) -> Vec<LinearShape> {
        vec![
            linear_shape("linear_attn.in_proj_qkv", &self.in_proj_qkv),
            linear_shape("linear_attn.in_proj_z", &self.in_proj_z),
            linear_shape("linear_attn.in_proj_b", &self.in_proj_b),
            linear_shape("linear_attn.in_proj_a", &self.in_proj_a),
            linear_shape("linear_attn.out_proj", &self.out_proj),
        ]
    }
}

/// Full attention whose query projection also yields an output gate (mlx-lm's
/// `Qwen3NextAttention`): per-head q/k RMSNorm, RoPE on the first features only, and the
/// attention output scaled by `sigmoid(gate)` before `o_proj`.
struct GatedAttention {
    /// `[heads × (head_dim queries, head_dim gates)]` per token.
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    o_proj: Linear,
    q_norm: RmsNorm,
    k_norm: RmsNorm,
    rope: Rope,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    scale: f32,
}

impl GatedAttention {
    /// `x` holds one sequence's tokens, over the one cache of `caches`, or the next token of
    /// each sequence, over its own; the projections `lora` names are adapted.
    fn forward(
        &self,
        x: &Tensor,
        positions: &Positions,
        caches: &mut [&mut KvCache],
        lora: ModuleAdapters,
    ) -> OpResult<Tensor> {
        let (n, hd) = (positions.len(), self.head_dim);
        // Per head, `head_dim` queries then `head_dim` gates.
        let projected = self
            .q_proj
            .forward_adapted(x, lora.get("q_proj"))?
            .reshape(vec![n * self.heads, 2 * hd]);
        let mut q = ops::columns(&projected, 0, hd)?.reshape(vec![n, self.heads * hd]);
        let gate = ops::columns(&projected, hd, hd)?.reshape(vec![n, self.heads * hd]);
        let mut k = self.k_proj.forward_adapted(x, lora.get("k_proj"))?;
        let v = self.v_proj.forward_adapted(x, lora.get("v_proj"))?;
        self.q_norm.forward_inplace(&mut q)?;
        self.k_norm.forward_inplace(&mut k)?;
        self.rope
            .apply_pair(&mut q, self.heads, &mut k, self.kv_heads, hd, positions)?;
        append_kv(caches, &k, &v, positions)?;
        let mut out = attend_kv(
            &q,
            self.heads,
            hd,
            positions,
            caches,
            ops::AttentionOptions::scaled(self.scale),
            None,
        )?;
        ops::sigmoid_mul_inplace(&mut out, &gate)?;
        self.o_proj.forward_adapted(&out, lora.get("o_proj"))
    }

    /// Its projections, as mlx-lm's default LoRA keys select them.
    fn linears(&self) -> Vec<LinearShape> {
        vec![
            linear_shape("self_attn.q_proj", &self.q_proj),
            linear_shape("self_attn.k_proj", &self.k_proj),
            linear_shape("self_attn.v_proj", &self.v_proj),
            linear_shape("self_attn.o_proj", &self.o_proj),
        ]
    }
}

// One per layer, held in a Vec: the variants' sizes do not matter.
#[allow(clippy::large_enum_variant)]
enum Mixer {
    Linear(GatedDeltaNet),
    Attention(GatedAttention),
}

struct Block {
    input_layernorm: RmsNorm,
    mixer: Mixer,
    post_attention_layernorm: RmsNorm,
    mlp: FeedForward,
}

pub struct Qwen3_5 {
    info: ModelInfo,
    embed_tokens: Embedding,
    layers: Vec<Block>,
    head: OutputHead,
}

/// The text model's settings (mlx-lm's `TextModelArgs`), checked for what would not build.
struct Args {
    hidden: usize,
    layers: usize,
    eps: f32,
    vocab: usize,
    max_context: Option<usize>,
    tied: bool,
    full_attention_interval: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    attention_bias: bool,
    rope: Rope,
    linear: DeltaRuleDims,
    conv_kernel: usize,
    /// `None` for a dense MLP.
    moe: Option<MoeArgs>,
    intermediate: usize,
}

struct MoeArgs {
    routing: Routing,
    intermediate: usize,
    shared_intermediate: usize,
    /// Which layers have experts (Qwen3-Next's `decoder_sparse_step` and `mlp_only_layers`); the
    /// others a dense MLP of `intermediate_size`.
    sparse: Vec<bool>,
}

/// `config.json`'s keys for Qwen3.5's text model (dense and MoE), as mlx-lm's `ModelArgs` reads
/// them, with its defaults for the absent ones; [`Args::from_config`] checks them and derives
/// the rest.
#[derive(Deserialize)]
struct Qwen35Config {
    hidden_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: usize,
    /// `hidden_size / num_attention_heads` when absent.
    head_dim: Option<usize>,
    #[serde(default = "default_full_attention_interval")]
    full_attention_interval: usize,
    layer_types: Option<Vec<String>>,
    linear_num_key_heads: usize,
    linear_num_value_heads: usize,
    linear_key_head_dim: usize,
    linear_value_head_dim: usize,
    #[serde(default = "default_conv_kernel")]
    linear_conv_kernel_dim: usize,
    /// transformers ≥ 5 keeps `rope_theta` and `partial_rotary_factor` here, over the flat keys.
    rope_parameters: Option<Value>,
    #[serde(default = "default_rope_theta")]
    rope_theta: f64,
    #[serde(default = "default_partial_rotary_factor")]
    partial_rotary_factor: f64,
    #[serde(default = "default_rms_norm_eps")]
    rms_norm_eps: f32,
    vocab_size: usize,
    #[serde(default)]
    tie_word_embeddings: bool,
    #[serde(default)]
    attention_bias: bool,
    /// Dense models only.
    intermediate_size: Option<usize>,
    /// MoE models: more than 0 experts.
    #[serde(default)]
    num_experts: usize,
    num_experts_per_tok: Option<usize>,
    moe_intermediate_size: Option<usize>,
    shared_expert_intermediate_size: Option<usize>,
    /// True for Qwen3.5, false for Qwen3-Next, where absent.
    norm_topk_prob: Option<bool>,
    #[serde(default = "default_sparse_step")]
    decoder_sparse_step: usize,
    #[serde(default)]
    mlp_only_layers: Vec<usize>,
    max_position_embeddings: Option<usize>,
}

fn default_full_attention_interval() -> usize {
    4
}
fn default_conv_kernel() -> usize {
    4
}
fn default_rope_theta() -> f64 {
    100000.0
}
fn default_partial_rotary_factor() -> f64 {
    0.25
}
fn default_rms_norm_eps() -> f32 {
    1e-6
}
fn default_sparse_step() -> usize {
    1
}

impl Args {
    fn from_config(ckpt: &Checkpoint) -> Result<Self, LoadError> {
        let c: Qwen35Config = ckpt.config.args()?;
        let (hidden, layers) = (c.hidden_size, c.num_hidden_layers);
        let (heads, kv_heads) = (c.num_attention_heads, c.num_key_value_heads);
        let head_dim = c.head_dim.unwrap_or(hidden / heads.max(1));
        let full_attention_interval = c.full_attention_interval;
        let linear = DeltaRuleDims {
            k_heads: c.linear_num_key_heads,
            v_heads: c.linear_num_value_heads,
            k_dim: c.linear_key_head_dim,
            v_dim: c.linear_value_head_dim,
        };
        let conv_kernel = c.linear_conv_kernel_dim;
        let d = linear;
        let sizes = [
            hidden, heads, kv_heads, head_dim, d.k_heads, d.v_heads, d.k_dim, d.v_dim,
        ];
        if sizes.contains(&0) {
            return Err(LoadError::Config(
                "sizes and head counts must be positive".into(),
            ));
        }
        if !heads.is_multiple_of(kv_heads) {
            return Err(LoadError::Config(format!(
                "{heads} attention heads cannot be grouped over {kv_heads} key/value heads"
            )));
        }
        if !linear.v_heads.is_multiple_of(linear.k_heads) {
            return Err(LoadError::Config(format!(
                "{} linear value heads cannot be grouped over {} key heads",
                linear.v_heads, linear.k_heads
            )));
        }
        if full_attention_interval == 0 || conv_kernel == 0 {
            return Err(LoadError::Config(
                "`full_attention_interval` and `linear_conv_kernel_dim` must be positive".into(),
            ));
        }
        // mlx-lm places the layers by the interval alone; a `layer_types` list must agree.
        if let Some(types) = &c.layer_types {
            let expected = (0..layers).map(|i| {
                if is_linear(i, full_attention_interval) {
                    "linear_attention"
                } else {
                    "full_attention"
                }
            });
            if types.len() != layers || !types.iter().map(String::as_str).eq(expected) {
                return Err(LoadError::Config(format!(
                    "`layer_types` does not put full attention every {full_attention_interval} \
                     layers, as `full_attention_interval` does"
                )));
            }
        }

        let params = c.rope_parameters;
        let param = |key: &str, default: f64| -> Result<f64, LoadError> {
            match params.as_ref().and_then(|p| p.get(key)) {
                None | Some(Value::Null) => Ok(default),
                Some(v) => v.as_f64().ok_or_else(|| {
                    LoadError::Config(format!("`rope_parameters.{key}` is not a number"))
                }),
            }
        };
        let rope_theta = param("rope_theta", c.rope_theta)?;
        let partial = param("partial_rotary_factor", c.partial_rotary_factor)?;
        let rotary_dims = (head_dim as f64 * partial) as usize;
        if !rotary_dims.is_multiple_of(2) || rotary_dims > head_dim {
            return Err(LoadError::Config(format!(
                "partial_rotary_factor {partial} gives {rotary_dims} rotated features of \
                 {head_dim}: an even number up to head_dim is needed"
            )));
        }
        let rope = Rope::new(
            rotary_dims,
            rope_theta as f32,
            false,
            params.as_ref(),
            c.max_position_embeddings,
            &ckpt.device,
        )?;

        let missing = |key: &str| LoadError::Config(format!("`{key}` is missing"));
        let experts = c.num_experts;
        let next = ckpt.config.model_type()? == "qwen3_next";
        let moe = if experts > 0 {
            let top_k = c
                .num_experts_per_tok
                .ok_or_else(|| missing("num_experts_per_tok"))?;
            let norm_topk_prob = c.norm_topk_prob.unwrap_or(!next);
            let step = c.decoder_sparse_step.max(1);
            let sparse = (0..layers)
                .map(|i| !c.mlp_only_layers.contains(&i) && (i + 1).is_multiple_of(step))
                .collect();
            Some(MoeArgs {
                routing: Routing::new(experts, top_k, norm_topk_prob)?,
                sparse,
                intermediate: c
                    .moe_intermediate_size
                    .ok_or_else(|| missing("moe_intermediate_size"))?,
                shared_intermediate: c
                    .shared_expert_intermediate_size
                    .ok_or_else(|| missing("shared_expert_intermediate_size"))?,
            })
        } else {
            None
        };
        let all_sparse = moe.as_ref().is_some_and(|m| m.sparse.iter().all(|&s| s));
        let intermediate = match all_sparse {
            true => 0,
            false => c
                .intermediate_size
                .ok_or_else(|| missing("intermediate_size"))?,
        };
        Ok(Args {
            hidden,
            layers,
            eps: c.rms_norm_eps,
            vocab: c.vocab_size,
            max_context: c.max_position_embeddings,
            tied: c.tie_word_embeddings,
            full_attention_interval,
            heads,
            kv_heads,
            head_dim,
            attention_bias: c.attention_bias,
            rope,
            linear,
            conv_kernel,
            moe,
            intermediate,
        })
    }
}

/// Whether layer `i` is a gated-DeltaNet layer (mlx-lm's `is_linear`).
fn is_linear(i: usize, full_attention_interval: usize) -> bool {
    !(i + 1).is_multiple_of(full_attention_interval)
}

/// Where mlx-lm keeps the text model's weights (what `sanitize` renames the others to).
const MODEL: &str = "language_model.model";
const LM_HEAD: &str = "language_model.lm_head";

/// Whether the checkpoint is a Hugging Face export, whose conv1d weights are
/// `[channels, 1, kernel]` and whose RMSNorms scale by `1 + w`.
struct Layout {
    hugging_face: bool,
}

impl Layout {
    /// mlx-lm's `sanitize`: weights move under `language_model.` (`model.language_model.*` →
    /// `language_model.model.*`), vision-tower and multi-token-prediction weights are dropped,
    /// and a conv1d weight whose last axis is not 1 marks a Hugging Face export.
    fn sanitize(ckpt: &mut Checkpoint, args: &Args) -> Self {
        ckpt.discard_where(|name| {
            name.starts_with("vision_tower")
                || name.starts_with("model.visual")
                || name.contains("mtp.")
        });
        ckpt.rename(|name| {
            if let Some(rest) = name.strip_prefix("model.language_model") {
                Some(format!("{MODEL}{rest}"))
            } else if name.starts_with("language_model.") {
                None
            } else {
                Some(format!("language_model.{name}"))
            }
        });
        let hugging_face = (0..args.layers)
            .find(|&i| is_linear(i, args.full_attention_interval))
            .and_then(|i| ckpt.peek(&format!("{MODEL}.layers.{i}.linear_attn.conv1d.weight")))
            .is_some_and(|t| t.shape.last() != Some(&1));
        Layout { hugging_face }
    }

    /// An RMSNorm that Hugging Face stores as an offset from 1: `sanitize` adds the 1 in the
    /// weight's own dtype, so the sum is rounded to it here as well.
    fn shifted_norm(&self, vb: &mut Scope, dim: usize, eps: f32) -> Result<RmsNorm, LoadError> {
        let dtype = vb.peek("weight").map(|t| t.dtype);
        let mut weight = load_host_vector(vb, "weight", dim)?;
        if self.hugging_face {
            for w in &mut weight {
                *w = match dtype {
                    Some(DType::BF16) => half::bf16::from_f32(*w + 1.0).to_f32(),
                    Some(DType::F16) => half::f16::from_f32(*w + 1.0).to_f32(),
                    _ => *w + 1.0,
                };
            }
        }
        RmsNorm::new(&weight, eps, vb.device())
    }
}

/// Qwen3-Next's fused `in_proj_qkvz` and `in_proj_ba` hold each key head's rows together
/// (its query, key, values and gates; its `b` and `a`): regrouped into Qwen3.5's `in_proj_qkv`
/// (all queries, all keys, all values), `in_proj_z`, `in_proj_b` and `in_proj_a`.
fn unfuse_linear_projections(ckpt: &mut Checkpoint, args: &Args) -> Result<(), LoadError> {
    let d = args.linear;
    let group = d.v_heads / d.k_heads;
    let (q, v) = (d.k_dim, group * d.v_dim);
    let per_head = 2 * q + 2 * v;
    let runs = |offset: usize, len: usize, stride: usize| -> Vec<Range<usize>> {
        (0..d.k_heads)
            .map(|h| h * stride + offset..h * stride + offset + len)
            .collect()
    };
    for i in (0..args.layers).filter(|&i| is_linear(i, args.full_attention_interval)) {
        let at = |name: &str| format!("{MODEL}.layers.{i}.linear_attn.{name}");
        let qkv = [
            runs(0, q, per_head),
            runs(q, q, per_head),
            runs(2 * q, v, per_head),
        ]
        .concat();
        let qkvz = [
            (at("in_proj_qkv"), qkv),
            (at("in_proj_z"), runs(2 * q + v, v, per_head)),
        ];
        ckpt.regroup_rows(&at("in_proj_qkvz"), d.k_heads * per_head, &qkvz)?;
        let ba = [
            (at("in_proj_b"), runs(0, group, 2 * group)),
            (at("in_proj_a"), runs(group, group, 2 * group)),
        ];
        ckpt.regroup_rows(&at("in_proj_ba"), 2 * d.v_heads, &ba)?;
    }
    Ok(())
}

/// The `linear_attn` module of a block.
fn load_linear_attn(vb: &mut Scope, args: &Args) -> Result<GatedDeltaNet, LoadError> {
    let d = args.linear;
    let key_dim = d.k_heads * d.k_dim;
    let value_dim = d.v_heads * d.v_dim;
    let conv_dim = 2 * key_dim + value_dim;
    let h = args.hidden;

    let kernel = args.conv_kernel;
    let conv1d = load_conv1d(vb, "conv1d.weight", conv_dim, kernel)?;
    let device = vb.device().clone();
    let a_log = load_host_vector(vb, "A_log", d.v_heads)?;
    let neg_a: Vec<f32> = a_log.iter().map(|&x| -x.exp()).collect();
    let inv_scale = (d.k_dim as f64).powf(-0.5);
    let qk_eps = QK_NORM_EPS * inv_scale * inv_scale;
    Ok(GatedDeltaNet {
        in_proj_qkv: Linear::load(&mut vb.pp("in_proj_qkv"), h, conv_dim, false)?,
        in_proj_z: Linear::load(&mut vb.pp("in_proj_z"), h, value_dim, false)?,
        in_proj_b: Linear::load(&mut vb.pp("in_proj_b"), h, d.v_heads, false)?,
        in_proj_a: Linear::load(&mut vb.pp("in_proj_a"), h, d.v_heads, false)?,
        conv1d,
        kernel,
        dt_bias: load_vector(vb, "dt_bias", d.v_heads)?,
        neg_a: place_vector(&neg_a, &device, &vb.path_of("A_log"))?,
        norm: RmsNorm::load(&mut vb.pp("norm"), d.v_dim, args.eps)?,
        unit_norm: RmsNorm::unscaled(d.k_dim, qk_eps as f32, &device)?,
        out_proj: Linear::load(&mut vb.pp("out_proj"), value_dim, h, false)?,
        dims: d,
    })
}

/// The `self_attn` module of a block.
fn load_self_attn(
    vb: &mut Scope,
    args: &Args,
    layout: &Layout,
) -> Result<GatedAttention, LoadError> {
    let (h, hd, bias) = (args.hidden, args.head_dim, args.attention_bias);
    let (q_dim, kv_dim) = (args.heads * hd, args.kv_heads * hd);
    Ok(GatedAttention {
        q_proj: Linear::load(&mut vb.pp("q_proj"), h, 2 * q_dim, bias)?,
        k_proj: Linear::load(&mut vb.pp("k_proj"), h, kv_dim, bias)?,
        v_proj: Linear::load(&mut vb.pp("v_proj"), h, kv_dim, bias)?,
        o_proj: Linear::load(&mut vb.pp("o_proj"), q_dim, h, bias)?,
        q_norm: layout.shifted_norm(&mut vb.pp("q_norm"), hd, args.eps)?,
        k_norm: layout.shifted_norm(&mut vb.pp("k_norm"), hd, args.eps)?,
        rope: args.rope.clone(),
        heads: args.heads,
        kv_heads: args.kv_heads,
        head_dim: hd,
        scale: (hd as f32).powf(-0.5),
    })
}

impl Qwen3_5 {
    pub fn load(mut ckpt: Checkpoint) -> Result<Self, LoadError> {
        let model_type = ckpt.config.model_type()?.to_string();
        let args = Args::from_config(&ckpt)?;
        let max_context = args.max_context;
        let layout = Layout::sanitize(&mut ckpt, &args);
        if model_type == "qwen3_next" {
            unfuse_linear_projections(&mut ckpt, &args)?;
        }
        if args.tied {
            ckpt.discard_where(|name| name.starts_with(&format!("{LM_HEAD}.")));
        }

        let (h, eps) = (args.hidden, args.eps);
        let mut model = ckpt.scope(MODEL);
        let embed_tokens = Embedding::load(&mut model.pp("embed_tokens"), args.vocab, h)?;
        let mut blocks = Vec::new();
        for i in 0..args.layers {
            let mut block = model.pp(format_args!("layers.{i}"));
            let mixer = if is_linear(i, args.full_attention_interval) {
                Mixer::Linear(load_linear_attn(&mut block.pp("linear_attn"), &args)?)
            } else {
                Mixer::Attention(load_self_attn(&mut block.pp("self_attn"), &args, &layout)?)
            };
            let moe = args.moe.as_ref().filter(|m| m.sparse[i]);
            let mlp = match moe {
                None => FeedForward::Dense(Mlp::load(
                    &mut block.pp("mlp"),
                    h,
                    args.intermediate,
                    false,
                )?),
                Some(moe) => FeedForward::Moe(SparseMoe::load(
                    &mut block,
                    MoeNames::MLP,
                    h,
                    moe.routing,
                    ExpertMlps::swiglu(moe.intermediate),
                    Some(Shared {
                        intermediate: moe.shared_intermediate,
                        gated: true,
                        names: SharedNames::SHARED_EXPERT,
                    }),
                )?),
            };
            blocks.push(Block {
                input_layernorm: layout.shifted_norm(&mut block.pp("input_layernorm"), h, eps)?,
                mixer,
                post_attention_layernorm: layout.shifted_norm(
                    &mut block.pp("post_attention_layernorm"),
                    h,
                    eps,
                )?,
                mlp,
            });
        }
        let norm = layout.shifted_norm(&mut model.pp("norm"), h, eps)?;
        let lm_head = (!args.tied)
            .then(|| Linear::load(&mut ckpt.scope(LM_HEAD), h, args.vocab, false))
            .transpose()?;
        let device = ckpt.device.clone();
        ckpt.finish()?;
        Ok(Qwen3_5 {
            info: ModelInfo {
                model_type,
                vocab_size: args.vocab,
                hidden_size: h,
                num_layers: args.layers,
                max_context,
                device,
            },
            embed_tokens,
            layers: blocks,
            head: OutputHead {
                norm,
                lm_head,
                softcap: None,
            },
        })
    }

    /// Whether `cache` has this model's layers, each of the kind its mixer keeps.
    fn fits(&self, cache: &Cache) -> bool {
        cache.layers.len() == self.layers.len()
            && self.layers.iter().zip(&cache.layers).all(|(b, c)| {
                matches!(
                    (&b.mixer, c),
                    (Mixer::Linear(_), LayerCache::Recurrent(_))
                        | (Mixer::Attention(_), LayerCache::Kv(_))
                )
            })
    }
}

impl Architecture for Qwen3_5 {
    fn info(&self) -> &ModelInfo {
        &self.info
    }

    fn layer_caches(&self) -> Result<Vec<LayerCache>, EngineError> {
        let device = &self.info.device;
        self.layers
            .iter()
            .map(|b| {
                Ok(match &b.mixer {
                    Mixer::Linear(m) => LayerCache::Recurrent(m.new_cache(device)?),
                    Mixer::Attention(m) => {
                        LayerCache::Kv(KvCache::new(m.kv_heads, m.head_dim, device)?)
                    }
                })
            })
            .collect()
    }

    fn hidden_states(
        &self,
        tokens: &[u32],
        caches: &mut [&mut Cache],
        adapters: Option<PassAdapters>,
    ) -> Result<Tensor, ForwardError> {
        let (mut caches, positions) =
            PassCaches::fitting(&self.info, tokens, caches, self.layers.len(), |c| {
                self.fits(c)
            })?;
        let mut h = self.embed_tokens.forward(tokens)?;
        for (i, block) in self.layers.iter().enumerate() {
            let lora = |module| adapters.map_or(ModuleAdapters::NONE, |a| a.module(i, module));
            let x = block.input_layernorm.forward(&h)?;
            let r = match (&block.mixer, caches.layer(i)?) {
                (Mixer::Linear(m), LayerCaches::Recurrent(mut c)) => {
                    m.forward(&x, &mut c, lora("linear_attn"))?
                }
                (Mixer::Attention(m), LayerCaches::Kv(mut c)) => {
                    m.forward(&x, &positions, &mut c, lora("self_attn"))?
                }
                _ => return Err(ForwardError::CacheMismatch),
            };
            ops::add_inplace(&mut h, &r)?;
            let x = block.post_attention_layernorm.forward(&h)?;
            let r = block.mlp.forward(&x, lora)?;
            ops::add_inplace(&mut h, &r)?;
        }
        caches.finish();
        Ok(h)
    }

    fn output(&self) -> (&OutputHead, &Embedding) {
        (&self.head, &self.embed_tokens)
    }
}

impl Adaptable for Qwen3_5 {
    fn block_linears(&self) -> Vec<Vec<LinearShape>> {
        let blocks = self.layers.iter();
        blocks
            .map(|b| {
                let mut linears = match &b.mixer {
                    Mixer::Linear(m) => m.linears(),
                    Mixer::Attention(m) => m.linears(),
                };
                linears.extend(b.mlp.linears());
                linears
            })
            .collect()
    }

    fn decoder(&self) -> &dyn Decoder {
        self
    }

    /// mlx-lm's `qwen3_5` nests the text model under `language_model`.
    fn blocks_path(&self) -> &'static str {
        match self.info.model_type.as_str() {
            "qwen3_5_text" => "model.layers",
            _ => "language_model.model.layers",
        }
    }
}
