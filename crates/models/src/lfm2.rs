//! LFM2 (Liquid AI) as mlx-lm's `lfm2.py` defines it: a hybrid of gated short-convolution
//! layers and grouped-query attention layers, each followed by a SwiGLU feed-forward.
//!
//! - The short convolution (`ShortConv`): `in_proj` gives three thirds `B`, `C`, `x`; a causal
//!   depthwise convolution over the last `conv_L_cache` positions of `B · x` is gated by `C`
//!   and projected by `out_proj`. Its cache holds the last `conv_L_cache - 1` values of `B · x`
//!   per sequence ([`RecurrentCache::conv_only`]): it cannot be cut back, so a prompt cache
//!   resumes from snapshots, as for Qwen3.5.
//! - Attention: per-head RMSNorms of queries and keys (`q_layernorm`, `k_layernorm`), RoPE over
//!   whole heads of `hidden_size / num_attention_heads` with `rope_theta` alone (mlx-lm reads no
//!   RoPE scaling for LFM2), output projection `out_proj`.
//! - Which layers attend: `full_attn_idxs`, else the `full_attention` entries of `layer_types`
//!   (the others being `conv`).
//! - The feed-forward (`w1` gate, `w3` up, `w2` down) is `block_ff_dim` (or `intermediate_size`)
//!   wide, or with `block_auto_adjust_ff_dim` that width's 2/3, times
//!   `block_ffn_dim_multiplier`, rounded up to a multiple of `block_multiple_of`.
//! - The final norm is `embedding_norm`, and the head is always the embeddings.
//!
//! `lfm2_moe` (mlx-lm's `lfm2_moe.py`) has the same layers but for the feed-forwards: the first
//! `num_dense_layers` are SwiGLU MLPs `intermediate_size` wide (`gate_proj`, `up_proj`,
//! `down_proj`), the others mixtures of experts routed by a sigmoid ([`SigmoidMoe`]).
//!
//! Checkpoints: mlx-lm's layout (`model.*`, convolution weights `[hidden, kernel, 1]`, stacked
//! experts under `switch_mlp`) and Hugging Face's, which mlx-lm's `sanitize` converts:
//! convolution weights `[hidden, 1, kernel]`; for `lfm2_moe`, `w1`/`w3`/`w2` weights for
//! `gate_proj`/`up_proj`/`down_proj` and one module per expert (`experts.{e}`). mlx-lm's
//! `lfm2-vl` wrapper keeps the LFM2 text model under `language_model.` beside a vision tower and
//! a projector, which are dropped.

mod grad;

use oxlm_engine::ops::recurrent;
use oxlm_engine::{ops, EngineError, Tensor};
use serde::Deserialize;
use serde_json::Value;

use crate::cache::{Cache, KvCache, LayerCache, RecurrentCache};
use crate::checkpoint::{Checkpoint, Scope};
use crate::decoder_grad::Decoder;
use crate::layers::{
    experts_shape, linear_shape, load_conv1d, load_host_vector, load_vector, Attention, Embedding,
    Input, Linear, Mlp, OpResult, OutputHead, RmsNorm, Rope,
};
use crate::lora::{Adaptable, LinearShape, ModuleAdapters, PassAdapters};
use crate::pass::{Architecture, LayerCaches, PassCaches};
use crate::switch::{by_expert, dispatch, load_experts};
use crate::{ForwardError, LoadError, ModelInfo};

/// The gated short convolution (mlx-lm's `ShortConv`): `out_proj(C · conv(B · x))`, where `B`,
/// `C` and `x` are the thirds of `in_proj`'s output and `conv` a causal depthwise convolution.
struct ShortConv {
    in_proj: Linear,
    /// The depthwise convolution's weights, `[hidden, kernel]`.
    conv: Tensor,
    /// With `conv_bias` (as `in_proj`'s and `out_proj`'s biases).
    conv_bias: Option<Tensor>,
    kernel: usize,
    out_proj: Linear,
    hidden: usize,
}

impl ShortConv {
    fn new_cache(&self, device: &oxlm_engine::Device) -> OpResult<RecurrentCache> {
        RecurrentCache::conv_only(self.hidden, self.kernel, device)
    }

    /// Whether `cache` is a state of this layer's shape.
    fn fits(&self, cache: &RecurrentCache) -> bool {
        cache.conv.len() == (self.kernel - 1) * self.hidden && cache.state.is_empty()
    }

    /// `B`, `C` and `x` of the input rows `x`, with `in_proj` adapted as `lora` says.
    fn thirds(&self, x: &Tensor, lora: ModuleAdapters) -> OpResult<[Tensor; 3]> {
        let bcx = self.in_proj.forward_adapted(x, lora.get("in_proj"))?;
        let h = self.hidden;
        Ok([
            ops::columns(&bcx, 0, h)?,
            ops::columns(&bcx, h, h)?,
            ops::columns(&bcx, 2 * h, h)?,
        ])
    }

    /// `out_proj`'s input, `C · conv(B · x)`, for `x`: one sequence's tokens continuing the one
    /// state of `caches`, or the next token of each sequence continuing its own.
    fn gated(
        &self,
        x: &Tensor,
        caches: &mut [&mut RecurrentCache],
        lora: ModuleAdapters,
    ) -> OpResult<Tensor> {
        let [mut bx, c, xs] = self.thirds(x, lora)?;
        ops::mul_inplace(&mut bx, &xs)?;
        let mut states: Vec<&mut Tensor> = caches.iter_mut().map(|c| &mut c.conv).collect();
        let mut y = recurrent::causal_conv1d(&bx, &self.conv, self.kernel, &mut states)?;
        if let Some(bias) = &self.conv_bias {
            ops::add_row_inplace(&mut y, bias)?;
        }
        ops::mul_inplace(&mut y, &c)?;
        Ok(y)
    }

    /// Its projections, as mlx-lm's default LoRA keys select them.
    fn linears(&self) -> Vec<LinearShape> {
        vec![
            linear_shape("conv.in_proj", &self.in_proj),
            linear_shape("conv.out_proj", &self.out_proj),
        ]
    }
}

/// A block's sequence mixer (mlx-lm's `is_attention_layer` picks one).
// One per layer, held in a Vec: the variants' sizes do not matter.
#[allow(clippy::large_enum_variant)]
enum Operator {
    Conv(ShortConv),
    /// Its `o_proj` is the checkpoint's `out_proj`.
    Attention(Attention),
}

/// What a dense feed-forward's gate, up and down layers are called: their names within
/// `feed_forward`, and their LoRA keys.
struct DenseNames {
    layers: [&'static str; 3],
    keys: [&'static str; 3],
}

/// LFM2's.
const W_NAMES: DenseNames = DenseNames {
    layers: ["w1", "w3", "w2"],
    keys: ["feed_forward.w1", "feed_forward.w3", "feed_forward.w2"],
};

/// LFM2-MoE's (what its `sanitize` renames `w1`, `w3` and `w2` to).
const PROJ_NAMES: DenseNames = DenseNames {
    layers: ["gate_proj", "up_proj", "down_proj"],
    keys: [
        "feed_forward.gate_proj",
        "feed_forward.up_proj",
        "feed_forward.down_proj",
    ],
};

/// A block's feed-forward part.
// One per layer, held in a Vec: the variants' sizes do not matter.
#[allow(clippy::large_enum_variant)]
enum FeedForward {
    /// A SwiGLU MLP whose layers are named as `names` says.
    Dense {
        mlp: Mlp,
        names: &'static DenseNames,
    },
    Moe(SigmoidMoe),
}

/// LFM2-MoE's mixture of experts (mlx-lm's `Lfm2MoeSparseMoeBlock`): each token goes to the
/// `top_k` experts of the highest sigmoid scores of the router `gate` (plus `expert_bias` where
/// there is one: it picks the experts but does not weigh them), weighted by those scores,
/// renormalized where `norm_topk_prob` and scaled by `routed_scaling_factor`.
struct SigmoidMoe {
    gate: Linear,
    /// One SwiGLU MLP per expert (`switch_mlp` holds them stacked).
    experts: Vec<Mlp>,
    expert_bias: Option<Vec<f32>>,
    top_k: usize,
    norm_topk_prob: bool,
    scaling: f32,
}

/// mlx-lm's guard against a zero sum of the chosen scores.
const NORM_EPS: f32 = 1e-6;

impl SigmoidMoe {
    /// Turns each token's router logits (`[n, experts]`) into sigmoid scores, in place, and
    /// returns its `top_k` experts with their weights: `[n, top_k]`.
    fn route(&self, scores: &mut [f32]) -> Vec<(usize, f32)> {
        let count = self.experts.len();
        let mut chosen = Vec::with_capacity(scores.len() / count * self.top_k);
        let mut keys = vec![0.0f32; count];
        let mut order: Vec<usize> = Vec::with_capacity(count);
        for s in scores.chunks_exact_mut(count) {
            for (e, (v, key)) in s.iter_mut().zip(&mut keys).enumerate() {
                *v = 1.0 / (1.0 + (-*v).exp());
                *key = *v + self.expert_bias.as_ref().map_or(0.0, |b| b[e]);
            }
            order.clear();
            order.extend(0..count);
            order.sort_by(|&a, &b| keys[b].total_cmp(&keys[a]).then(a.cmp(&b)));
            let top = &order[..self.top_k];
            let total = if self.norm_topk_prob {
                top.iter().map(|&e| s[e]).sum::<f32>() + NORM_EPS
            } else {
                1.0
            };
            chosen.extend(top.iter().map(|&e| (e, s[e] / total * self.scaling)));
        }
        chosen
    }

    /// `x` is `[n, dim]`; each expert runs once on the rows routed to it. `lora` holds the
    /// adapters of `feed_forward` (the router), `experts` those of its `switch_mlp`.
    fn forward(
        &self,
        x: &Tensor,
        lora: ModuleAdapters,
        experts: ModuleAdapters,
    ) -> OpResult<Tensor> {
        let mut scores = self.gate.forward_adapted(x, lora.get("gate"))?.into_vec()?;
        let chosen = self.route(&mut scores);
        let routed = by_expert(&chosen, self.top_k, self.experts.len());
        dispatch(x, &routed, |e, rows| {
            self.experts[e].forward_adapted(rows, experts.expert(e))
        })
    }
}

struct Block {
    operator_norm: RmsNorm,
    operator: Operator,
    ffn_norm: RmsNorm,
    feed_forward: FeedForward,
}

impl Block {
    /// `h += feed_forward(ffn_norm(h))`, the layers `lora` (`feed_forward`) and `experts` (its
    /// `switch_mlp`) name adapted; a dense one's norm folded into its projections where the
    /// device can.
    fn add_feed_forward(
        &self,
        h: &mut Tensor,
        lora: ModuleAdapters,
        experts: ModuleAdapters,
    ) -> OpResult<()> {
        let (mlp, names) = match &self.feed_forward {
            FeedForward::Dense { mlp, names } => (mlp, names),
            FeedForward::Moe(moe) => {
                let x = self.ffn_norm.forward(h)?;
                return ops::add_inplace(h, &moe.forward(&x, lora, experts)?);
            }
        };
        let [gate, up, down] = names.layers.map(|name| lora.get(name));
        let act = if gate.is_none() && up.is_none() {
            let normed = Input::Normed(&*h, &self.ffn_norm);
            mlp.gated(normed, ModuleAdapters::NONE, ops::Activation::Silu)?
        } else {
            let x = self.ffn_norm.forward(h)?;
            let mut g = mlp.gate_proj.forward_adapted(&x, gate)?;
            ops::silu_mul_inplace(&mut g, &mlp.up_proj.forward_adapted(&x, up)?)?;
            g
        };
        mlp.down_proj.add_forward(&act, down, h)
    }

    /// Its layers, as mlx-lm's default LoRA keys select them.
    fn linears(&self) -> Vec<LinearShape> {
        let mut linears = match &self.operator {
            Operator::Conv(conv) => conv.linears(),
            Operator::Attention(a) => vec![
                linear_shape("self_attn.q_proj", &a.q_proj),
                linear_shape("self_attn.k_proj", &a.k_proj),
                linear_shape("self_attn.v_proj", &a.v_proj),
                linear_shape("self_attn.out_proj", &a.o_proj),
            ],
        };
        match &self.feed_forward {
            FeedForward::Dense { mlp, names } => {
                let [gate, up, down] = names.keys;
                linears.extend([
                    linear_shape(gate, &mlp.gate_proj),
                    linear_shape(up, &mlp.up_proj),
                    linear_shape(down, &mlp.down_proj),
                ]);
            }
            FeedForward::Moe(moe) => {
                let experts = &moe.experts;
                linears.extend([
                    linear_shape("feed_forward.gate", &moe.gate),
                    experts_shape("feed_forward.switch_mlp.gate_proj", experts, |m| {
                        &m.gate_proj
                    }),
                    experts_shape("feed_forward.switch_mlp.up_proj", experts, |m| &m.up_proj),
                    experts_shape("feed_forward.switch_mlp.down_proj", experts, |m| {
                        &m.down_proj
                    }),
                ]);
            }
        }
        linears
    }
}

pub struct Lfm2 {
    info: ModelInfo,
    embed_tokens: Embedding,
    layers: Vec<Block>,
    /// `embedding_norm` and the tied head.
    head: OutputHead,
    /// Where the text model's weights are: `""`, or `language_model.` in `lfm2-vl`.
    prefix: &'static str,
}

/// `config.json`'s keys for LFM2 and LFM2-MoE, as mlx-lm's `ModelArgs` read them (required where
/// both require them; [`Args::from_config`] checks the keys one of them requires), with their
/// defaults for the others.
#[derive(Deserialize)]
struct Lfm2Config {
    vocab_size: usize,
    hidden_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    /// `num_attention_heads` when absent.
    num_key_value_heads: Option<usize>,
    max_position_embeddings: Option<usize>,
    norm_eps: f32,
    conv_bias: bool,
    #[serde(rename = "conv_L_cache")]
    conv_l_cache: usize,
    // LFM2's feed-forward.
    block_dim: Option<usize>,
    block_multiple_of: Option<usize>,
    block_ffn_dim_multiplier: Option<f64>,
    block_auto_adjust_ff_dim: Option<bool>,
    /// `intermediate_size` when absent.
    block_ff_dim: Option<usize>,
    /// LFM2-MoE's dense layers' width.
    intermediate_size: Option<usize>,
    // LFM2-MoE's mixtures.
    moe_intermediate_size: Option<usize>,
    num_experts: Option<usize>,
    num_experts_per_tok: Option<usize>,
    norm_topk_prob: Option<bool>,
    use_expert_bias: Option<bool>,
    num_dense_layers: Option<usize>,
    #[serde(default = "default_routed_scaling_factor")]
    routed_scaling_factor: f32,
    #[serde(default = "default_rope_theta")]
    rope_theta: f64,
    /// transformers ≥ 5 keeps `rope_theta` here, over the flat key.
    rope_parameters: Option<Value>,
    full_attn_idxs: Option<Vec<usize>>,
    layer_types: Option<Vec<String>>,
}

fn default_rope_theta() -> f64 {
    1_000_000.0
}

fn default_routed_scaling_factor() -> f32 {
    1.0
}

fn missing(key: &str) -> LoadError {
    LoadError::Config(format!("`{key}` is missing"))
}

/// LFM2-MoE's mixtures: their settings, and how many dense layers come first.
struct MoeArgs {
    experts: usize,
    top_k: usize,
    intermediate: usize,
    norm_topk_prob: bool,
    expert_bias: bool,
    scaling: f32,
    dense_layers: usize,
}

/// The model's settings, checked for what would not build.
struct Args {
    hidden: usize,
    layers: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    eps: f32,
    vocab: usize,
    max_context: Option<usize>,
    conv_bias: bool,
    kernel: usize,
    /// The dense feed-forwards' width and layer names.
    ff_dim: usize,
    ff_names: &'static DenseNames,
    /// `lfm2_moe`'s mixtures.
    moe: Option<MoeArgs>,
    /// Per layer: attention (else the short convolution).
    attention: Vec<bool>,
    rope: Rope,
}

impl Args {
    fn from_config(ckpt: &Checkpoint, moe: bool) -> Result<Self, LoadError> {
        let c: Lfm2Config = ckpt.config.args()?;
        let (hidden, heads) = (c.hidden_size, c.num_attention_heads);
        let kv_heads = c.num_key_value_heads.unwrap_or(heads);
        if hidden == 0 || heads == 0 || kv_heads == 0 || c.num_hidden_layers == 0 {
            return Err(LoadError::Config(
                "sizes, layer and head counts must be positive".into(),
            ));
        }
        if !heads.is_multiple_of(kv_heads) {
            return Err(LoadError::Config(format!(
                "{heads} attention heads cannot be grouped over {kv_heads} key/value heads"
            )));
        }
        let head_dim = hidden / heads;
        if head_dim == 0 || !head_dim.is_multiple_of(2) {
            return Err(LoadError::Config(format!(
                "heads of {head_dim} features ({hidden} / {heads}): RoPE needs an even number"
            )));
        }
        if c.conv_l_cache == 0 {
            return Err(LoadError::Config("`conv_L_cache` must be positive".into()));
        }
        let attention = attention_layers(&c)?;
        let (ff_dim, ff_names, moe) = if moe {
            let width = c
                .intermediate_size
                .ok_or_else(|| missing("intermediate_size"))?;
            (width, &PROJ_NAMES, Some(moe_args(&c)?))
        } else {
            (ff_dim(&c, hidden)?, &W_NAMES, None)
        };
        let theta = match c.rope_parameters.as_ref().and_then(|p| p.get("rope_theta")) {
            None | Some(Value::Null) => c.rope_theta,
            Some(v) => v.as_f64().ok_or_else(|| {
                LoadError::Config("`rope_parameters.rope_theta` is not a number".into())
            })?,
        };
        let rope = Rope::new(
            head_dim,
            theta as f32,
            false,
            None,
            c.max_position_embeddings,
            &ckpt.device,
        )?;
        Ok(Args {
            hidden,
            layers: c.num_hidden_layers,
            heads,
            kv_heads,
            head_dim,
            eps: c.norm_eps,
            vocab: c.vocab_size,
            max_context: c.max_position_embeddings,
            conv_bias: c.conv_bias,
            kernel: c.conv_l_cache,
            ff_dim,
            ff_names,
            moe,
            attention,
            rope,
        })
    }
}

/// Which layers attend: those `full_attn_idxs` lists, else the `full_attention` entries of
/// `layer_types`; where both are given they must agree.
fn attention_layers(c: &Lfm2Config) -> Result<Vec<bool>, LoadError> {
    let n = c.num_hidden_layers;
    let from_types = match &c.layer_types {
        None => None,
        Some(types) if types.len() != n => {
            return Err(LoadError::Config(format!(
                "`layer_types` has {} entries for {n} layers",
                types.len()
            )))
        }
        Some(types) => Some(
            types
                .iter()
                .map(|t| match t.as_str() {
                    "full_attention" => Ok(true),
                    "conv" => Ok(false),
                    other => Err(LoadError::Config(format!(
                        "layer type `{other}` (supported: conv, full_attention)"
                    ))),
                })
                .collect::<Result<Vec<_>, _>>()?,
        ),
    };
    let from_indices = match &c.full_attn_idxs {
        None => None,
        Some(indices) => {
            let mut attends = vec![false; n];
            for &i in indices {
                *attends.get_mut(i).ok_or_else(|| {
                    LoadError::Config(format!(
                        "`full_attn_idxs` names layer {i} of a model of {n} layers"
                    ))
                })? = true;
            }
            Some(attends)
        }
    };
    match (from_indices, from_types) {
        (Some(a), Some(b)) if a != b => Err(LoadError::Config(
            "`full_attn_idxs` and `layer_types` place the attention layers differently".into(),
        )),
        (Some(a), _) | (None, Some(a)) => Ok(a),
        (None, None) => Err(LoadError::Config(
            "neither `full_attn_idxs` nor `layer_types` says which layers attend".into(),
        )),
    }
}

/// LFM2's feed-forward width, as mlx-lm's `MLP` works it out, for a model `hidden` wide.
fn ff_dim(c: &Lfm2Config, hidden: usize) -> Result<usize, LoadError> {
    let block_dim = c.block_dim.ok_or_else(|| missing("block_dim"))?;
    if block_dim != hidden {
        return Err(LoadError::Config(format!(
            "`block_dim` {block_dim} differs from `hidden_size` {hidden}: the feed-forward's \
             output is added to the residual stream"
        )));
    }
    let mut ff = c.block_ff_dim.or(c.intermediate_size).ok_or_else(|| {
        LoadError::Config("config must specify either `block_ff_dim` or `intermediate_size`".into())
    })?;
    let auto_adjust = c.block_auto_adjust_ff_dim;
    let multiple = c
        .block_multiple_of
        .ok_or_else(|| missing("block_multiple_of"))?;
    if auto_adjust.ok_or_else(|| missing("block_auto_adjust_ff_dim"))? {
        ff = 2 * ff / 3;
        if let Some(m) = c.block_ffn_dim_multiplier {
            if !(m > 0.0 && m.is_finite()) {
                return Err(LoadError::Config(format!(
                    "`block_ffn_dim_multiplier` must be a positive number, not {m}"
                )));
            }
            ff = (m * ff as f64) as usize;
        }
        if multiple == 0 {
            return Err(LoadError::Config(
                "`block_multiple_of` must be positive".into(),
            ));
        }
        ff = ff.div_ceil(multiple) * multiple;
    }
    if ff == 0 {
        return Err(LoadError::Config("the feed-forward has no width".into()));
    }
    Ok(ff)
}

/// LFM2-MoE's mixtures, as its `ModelArgs` requires them.
fn moe_args(c: &Lfm2Config) -> Result<MoeArgs, LoadError> {
    let experts = c.num_experts.ok_or_else(|| missing("num_experts"))?;
    let top_k = c
        .num_experts_per_tok
        .ok_or_else(|| missing("num_experts_per_tok"))?;
    if top_k == 0 || top_k > experts {
        return Err(LoadError::Config(format!(
            "{top_k} experts per token of {experts}"
        )));
    }
    let scaling = c.routed_scaling_factor;
    if !scaling.is_finite() {
        return Err(LoadError::Config(format!(
            "`routed_scaling_factor` must be a number, not {scaling}"
        )));
    }
    Ok(MoeArgs {
        experts,
        top_k,
        intermediate: c
            .moe_intermediate_size
            .ok_or_else(|| missing("moe_intermediate_size"))?,
        norm_topk_prob: c.norm_topk_prob.ok_or_else(|| missing("norm_topk_prob"))?,
        expert_bias: c
            .use_expert_bias
            .ok_or_else(|| missing("use_expert_bias"))?,
        scaling,
        dense_layers: c
            .num_dense_layers
            .ok_or_else(|| missing("num_dense_layers"))?,
    })
}

/// The `conv` module of a block; its convolution weights in either layout.
fn load_conv(vb: &mut Scope, args: &Args) -> Result<ShortConv, LoadError> {
    let (h, kernel, bias) = (args.hidden, args.kernel, args.conv_bias);
    let conv = load_conv1d(vb, "conv.weight", h, kernel)?;
    Ok(ShortConv {
        in_proj: Linear::load(&mut vb.pp("in_proj"), h, 3 * h, bias)?,
        conv,
        conv_bias: bias
            .then(|| load_vector(&mut vb.pp("conv"), "bias", h))
            .transpose()?,
        kernel,
        out_proj: Linear::load(&mut vb.pp("out_proj"), h, h, bias)?,
        hidden: h,
    })
}

/// The `self_attn` module of a block.
fn load_attention(vb: &mut Scope, args: &Args) -> Result<Attention, LoadError> {
    let (h, hd) = (args.hidden, args.head_dim);
    let (q_width, kv_width) = (args.heads * hd, args.kv_heads * hd);
    Ok(Attention {
        q_proj: Linear::load(&mut vb.pp("q_proj"), h, q_width, false)?,
        k_proj: Linear::load(&mut vb.pp("k_proj"), h, kv_width, false)?,
        v_proj: Linear::load(&mut vb.pp("v_proj"), h, kv_width, false)?,
        o_proj: Linear::load(&mut vb.pp("out_proj"), q_width, h, false)?,
        q_norm: Some(RmsNorm::load(&mut vb.pp("q_layernorm"), hd, args.eps)?),
        k_norm: Some(RmsNorm::load(&mut vb.pp("k_layernorm"), hd, args.eps)?),
        rope: args.rope.clone(),
        heads: args.heads,
        kv_heads: args.kv_heads,
        head_dim: hd,
        scale: (hd as f32).powf(-0.5),
        query_scale: None,
        norm_after_rope: false,
        softcap: None,
        sinks: None,
        chunk: None,
    })
}

/// The `feed_forward` module of block `i`.
fn load_feed_forward(vb: &mut Scope, args: &Args, i: usize) -> Result<FeedForward, LoadError> {
    let h = args.hidden;
    let moe = match &args.moe {
        Some(moe) if i >= moe.dense_layers => moe,
        _ => {
            let (ff, names) = (args.ff_dim, args.ff_names);
            let [gate, up, down] = names.layers;
            let mlp = Mlp {
                gate_proj: Linear::load(&mut vb.pp(gate), h, ff, false)?,
                up_proj: Linear::load(&mut vb.pp(up), h, ff, false)?,
                down_proj: Linear::load(&mut vb.pp(down), ff, h, false)?,
            };
            return Ok(FeedForward::Dense { mlp, names });
        }
    };
    let (count, width) = (moe.experts, moe.intermediate);
    let experts = if vb.contains("switch_mlp.gate_proj.weight") {
        load_experts(&mut vb.pp("switch_mlp"), count, h, width, false)?
    } else {
        // Hugging Face's experts, one module each, which mlx-lm's `sanitize` stacks.
        (0..count)
            .map(|e| Mlp::load(&mut vb.pp(format_args!("experts.{e}")), h, width, false))
            .collect::<Result<_, _>>()?
    };
    Ok(FeedForward::Moe(SigmoidMoe {
        gate: Linear::load(&mut vb.pp("gate"), h, count, false)?,
        experts,
        expert_bias: moe
            .expert_bias
            .then(|| load_host_vector(vb, "expert_bias", count))
            .transpose()?,
        top_k: moe.top_k,
        norm_topk_prob: moe.norm_topk_prob,
        scaling: moe.scaling,
    }))
}

impl Lfm2 {
    pub fn load(mut ckpt: Checkpoint) -> Result<Self, LoadError> {
        let model_type = ckpt.config.model_type()?.to_string();
        let moe = model_type == "lfm2_moe";
        let args = Args::from_config(&ckpt, moe)?;
        if moe {
            // mlx-lm's `sanitize`: Hugging Face's names of the feed-forwards' weights.
            ckpt.rename(|name| {
                [("w1", "gate_proj"), ("w2", "down_proj"), ("w3", "up_proj")]
                    .iter()
                    .find_map(|(old, new)| {
                        let stem = name.strip_suffix(&format!(".{old}.weight"))?;
                        Some(format!("{stem}.{new}.weight"))
                    })
            });
        }
        // mlx-lm's `lfm2-vl`: the text model under `language_model.`, whose `sanitize` drops the
        // vision tower and the projector.
        let prefix = match model_type.as_str() {
            "lfm2-vl" => "language_model.",
            _ => "",
        };
        if !prefix.is_empty() {
            ckpt.discard_where(|name| {
                name.starts_with("vision_tower.") || name.starts_with("multi_modal_projector.")
            });
        }
        let (h, eps) = (args.hidden, args.eps);
        let mut model = ckpt.scope(&format!("{prefix}model"));
        let embed_tokens = Embedding::load(&mut model.pp("embed_tokens"), args.vocab, h)?;
        let mut layers = Vec::with_capacity(args.layers);
        for (i, &attends) in args.attention.iter().enumerate() {
            let mut block = model.pp(format_args!("layers.{i}"));
            let operator = if attends {
                Operator::Attention(load_attention(&mut block.pp("self_attn"), &args)?)
            } else {
                Operator::Conv(load_conv(&mut block.pp("conv"), &args)?)
            };
            layers.push(Block {
                operator_norm: RmsNorm::load(&mut block.pp("operator_norm"), h, eps)?,
                operator,
                ffn_norm: RmsNorm::load(&mut block.pp("ffn_norm"), h, eps)?,
                feed_forward: load_feed_forward(&mut block.pp("feed_forward"), &args, i)?,
            });
        }
        let norm = RmsNorm::load(&mut model.pp("embedding_norm"), h, eps)?;
        let device = ckpt.device.clone();
        ckpt.finish()?;
        Ok(Lfm2 {
            info: ModelInfo {
                model_type,
                vocab_size: args.vocab,
                hidden_size: h,
                num_layers: args.layers,
                max_context: args.max_context,
                device,
            },
            embed_tokens,
            layers,
            head: OutputHead {
                norm,
                lm_head: None,
                softcap: None,
            },
            prefix,
        })
    }

    /// Whether `cache` has this model's layers, each of the kind and shape its operator keeps.
    fn fits(&self, cache: &Cache) -> bool {
        cache.layers.len() == self.layers.len()
            && self
                .layers
                .iter()
                .zip(&cache.layers)
                .all(|(b, c)| match (&b.operator, c) {
                    (Operator::Conv(conv), LayerCache::Recurrent(r)) => conv.fits(r),
                    (Operator::Attention(a), LayerCache::Kv(kv)) => {
                        kv.shape() == (a.kv_heads, a.head_dim)
                    }
                    _ => false,
                })
    }
}

impl Architecture for Lfm2 {
    fn info(&self) -> &ModelInfo {
        &self.info
    }

    fn layer_caches(&self) -> Result<Vec<LayerCache>, EngineError> {
        let device = &self.info.device;
        self.layers
            .iter()
            .map(|b| {
                Ok(match &b.operator {
                    Operator::Conv(conv) => LayerCache::Recurrent(conv.new_cache(device)?),
                    Operator::Attention(a) => {
                        LayerCache::Kv(KvCache::new(a.kv_heads, a.head_dim, device)?)
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
            match (&block.operator, caches.layer(i)?) {
                (Operator::Conv(conv), LayerCaches::Recurrent(mut c)) => {
                    let lora = lora("conv");
                    let x = block.operator_norm.forward(&h)?;
                    let y = conv.gated(&x, &mut c, lora)?;
                    conv.out_proj
                        .add_forward(&y, lora.get("out_proj"), &mut h)?;
                }
                (Operator::Attention(a), LayerCaches::Kv(mut c)) => {
                    let lora = lora("self_attn");
                    // The norm is folded into the projections where the device can.
                    let normed = Input::Normed(&h, &block.operator_norm);
                    let out = a.attend(normed, &positions, &mut c, lora)?;
                    a.o_proj.add_forward(&out, lora.get("out_proj"), &mut h)?;
                }
                _ => return Err(ForwardError::CacheMismatch),
            }
            let experts = lora("feed_forward.switch_mlp");
            block.add_feed_forward(&mut h, lora("feed_forward"), experts)?;
        }
        caches.finish();
        Ok(h)
    }

    fn output(&self) -> (&OutputHead, &Embedding) {
        (&self.head, &self.embed_tokens)
    }
}

impl Adaptable for Lfm2 {
    fn block_linears(&self) -> Vec<Vec<LinearShape>> {
        self.layers.iter().map(Block::linears).collect()
    }

    fn decoder(&self) -> &dyn Decoder {
        self
    }

    fn blocks_path(&self) -> &'static str {
        match self.prefix {
            "" => "model.layers",
            _ => "language_model.model.layers",
        }
    }
}
