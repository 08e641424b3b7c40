//! Gemma 4 as mlx-lm's `gemma4_text.py` defines it, and the text part of the multimodal `gemma4`
//! wrapper (`gemma4.py`: settings under `text_config`, weights under `language_model.`).
//!
//! Beyond Gemma 3: plain RMSNorm scales, attention scale 1 with an unscaled norm on the values,
//! global layers with their own head dim (and, in the large models, one projection for keys
//! and values) and proportional partial RoPE, per-layer input embeddings (E-series), the last
//! `num_kv_shared_layers` layers reading the cache of the last earlier layer of their kind, a
//! learned per-layer output scalar, an optional mixture-of-experts block beside the MLP, and
//! final logit softcapping.

mod grad;

use serde::Deserialize;
use serde_json::{json, Value};

use crate::cache::{
    append_kv, attend_kv, AttentionCache, Cache, KvCache, LayerCache, RotatingKvCache,
};
use crate::checkpoint::{Checkpoint, Config, Scope};
use crate::decoder_grad::Decoder;
use crate::gemma3::wrapped_text_config;
use crate::layers::{
    experts_shape, linear_shape, load_host_vector, Embedding, Linear, Mlp, OpResult, OutputHead,
    RmsNorm, Rope,
};
use crate::lora::{Adaptable, LinearShape, ModuleAdapters, PassAdapters};
use crate::pass::{Architecture, LayerCaches, PassCaches};
use crate::switch::{by_expert, dispatch, load_experts};
use crate::{ForwardError, LoadError, ModelInfo};
use oxlm_engine::cpu::elementwise::softmax_inplace;
use oxlm_engine::{ops, Device, EngineError, Positions, Tensor};

/// `config.json`'s keys for Gemma 4's text model, with mlx-lm's `ModelArgs` defaults for the
/// absent ones. [`Args::from_config`] checks them and derives the rest.
#[derive(Deserialize)]
#[serde(default)]
struct Gemma4Config {
    hidden_size: usize,
    num_hidden_layers: usize,
    intermediate_size: usize,
    num_attention_heads: usize,
    head_dim: usize,
    /// The global layers' head size; null, or 0, for `head_dim`.
    global_head_dim: usize,
    rms_norm_eps: f32,
    vocab_size: usize,
    vocab_size_per_layer_input: usize,
    num_key_value_heads: usize,
    num_global_key_value_heads: Option<usize>,
    /// Null, or 0, for a model without per-layer inputs.
    hidden_size_per_layer_input: usize,
    sliding_window: usize,
    /// Without `layer_types`: every this many layers one is global.
    sliding_window_pattern: usize,
    layer_types: Option<Vec<String>>,
    num_kv_shared_layers: usize,
    max_position_embeddings: usize,
    attention_k_eq_v: bool,
    /// Null for none.
    final_logit_softcapping: f32,
    use_double_wide_mlp: bool,
    tie_word_embeddings: bool,
    enable_moe_block: bool,
    num_experts: Option<usize>,
    top_k_experts: Option<usize>,
    moe_intermediate_size: Option<usize>,
    rope_traditional: bool,
    /// Per layer kind (`full_attention`, `sliding_attention`): `rope_theta`, `rope_type`,
    /// `partial_rotary_factor`.
    rope_parameters: Value,
}

impl Default for Gemma4Config {
    fn default() -> Self {
        Gemma4Config {
            hidden_size: 1536,
            num_hidden_layers: 35,
            intermediate_size: 6144,
            num_attention_heads: 8,
            head_dim: 256,
            global_head_dim: 512,
            rms_norm_eps: 1e-6,
            vocab_size: 262144,
            vocab_size_per_layer_input: 262144,
            num_key_value_heads: 1,
            num_global_key_value_heads: None,
            hidden_size_per_layer_input: 256,
            sliding_window: 512,
            sliding_window_pattern: 5,
            layer_types: None,
            num_kv_shared_layers: 20,
            max_position_embeddings: 131072,
            attention_k_eq_v: false,
            final_logit_softcapping: 30.0,
            use_double_wide_mlp: true,
            tie_word_embeddings: true,
            enable_moe_block: false,
            num_experts: None,
            top_k_experts: None,
            moe_intermediate_size: None,
            rope_traditional: false,
            rope_parameters: json!({
                "full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0,
                                   "rope_type": "proportional"},
                "sliding_attention": {"partial_rotary_factor": 1.0, "rope_theta": 10000.0,
                                      "rope_type": "default"},
            }),
        }
    }
}

/// The key and value projections of a layer that computes its own.
struct KvProjections {
    k_proj: Linear,
    /// `None` when values are the keys' projection (`attention_k_eq_v`, global layers).
    v_proj: Option<Linear>,
    k_norm: RmsNorm,
    v_norm: RmsNorm,
}

/// A layer's attention: q/k norms, an unscaled value norm and attention scale 1, over its own
/// keys and values or (a KV-shared layer) those of an earlier layer. Gemma 3n's as well.
pub(crate) struct Attention {
    q_proj: Linear,
    /// `None` in a KV-shared layer.
    kv: Option<KvProjections>,
    o_proj: Linear,
    q_norm: RmsNorm,
    rope: Rope,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    sliding: bool,
}

/// What a layer's attention is made of, as [`Attention::load_layout`] reads it.
pub(crate) struct AttentionLayout {
    pub hidden: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub eps: f32,
    pub rope: Rope,
    pub sliding: bool,
    /// It computes keys and values of its own (else it reads an earlier layer's).
    pub own_kv: bool,
    /// Its values are its keys' projection (no `v_proj`).
    pub k_eq_v: bool,
}

impl Attention {
    /// Block `layer`'s attention of `x`: its keys and values appended to its caches (where it
    /// computes its own), then its queries over the caches of layer `source` (itself, or the
    /// layer a KV-shared one reads).
    pub(crate) fn run(
        &self,
        x: &Tensor,
        positions: &Positions,
        caches: &mut PassCaches,
        (layer, source): (usize, usize),
        lora: ModuleAdapters,
    ) -> Result<Tensor, ForwardError> {
        if let Some(kv) = &self.kv {
            self.store_kv(kv, x, positions, caches.layer(layer)?, lora)?;
        }
        self.forward(x, positions, caches.layer(source)?, lora)
    }

    /// Appends this layer's keys and values of `x` to its caches (not for KV-shared layers).
    fn store_kv(
        &self,
        kv: &KvProjections,
        x: &Tensor,
        positions: &Positions,
        caches: LayerCaches,
        lora: ModuleAdapters,
    ) -> Result<(), ForwardError> {
        let mut k = kv.k_proj.forward_adapted(x, lora.get("k_proj"))?;
        // Without a value projection the values are the keys before their norm and rotation.
        let v = match &kv.v_proj {
            Some(v_proj) => kv
                .v_norm
                .forward(&v_proj.forward_adapted(x, lora.get("v_proj"))?)?,
            None => kv.v_norm.forward(&k)?,
        };
        kv.k_norm.forward_inplace(&mut k)?;
        self.rope
            .apply(&mut k, self.kv_heads, self.head_dim, positions)?;
        match caches {
            LayerCaches::Kv(mut c) if self.fits(false, &c) => append_kv(&mut c, &k, &v, positions)?,
            LayerCaches::Rotating(mut c) if self.fits(true, &c) => {
                append_kv(&mut c, &k, &v, positions)?
            }
            _ => return Err(ForwardError::CacheMismatch),
        }
        Ok(())
    }

    /// Whether `caches` are of the kind (`sliding`) and shape this layer makes.
    fn fits<C: AttentionCache>(&self, sliding: bool, caches: &[&mut C]) -> bool {
        let shape = (self.kv_heads, self.head_dim);
        self.sliding == sliding && caches.iter().all(|c| c.shape() == shape)
    }

    /// Attends with queries of `x` over `caches`, which this layer's keys and values (or those
    /// of the layer it shares with) are already in.
    fn forward(
        &self,
        x: &Tensor,
        positions: &Positions,
        caches: LayerCaches,
        lora: ModuleAdapters,
    ) -> Result<Tensor, ForwardError> {
        let mut q = self.q_proj.forward_adapted(x, lora.get("q_proj"))?;
        self.q_norm.forward_inplace(&mut q)?;
        self.rope
            .apply(&mut q, self.heads, self.head_dim, positions)?;
        let (h, d, options) = (
            self.heads,
            self.head_dim,
            ops::AttentionOptions::scaled(1.0),
        );
        let out = match caches {
            LayerCaches::Kv(c) if self.fits(false, &c) => {
                attend_kv(&q, h, d, positions, &c, options, None)?
            }
            LayerCaches::Rotating(c) if self.fits(true, &c) => {
                attend_kv(&q, h, d, positions, &c, options, None)?
            }
            _ => return Err(ForwardError::CacheMismatch),
        };
        Ok(self.o_proj.forward_adapted(&out, lora.get("o_proj"))?)
    }

    /// Its projections, as mlx-lm's default LoRA keys select them (a KV-shared layer has no
    /// keys and values of its own, a global `attention_k_eq_v` layer no value projection).
    pub(crate) fn linears(&self) -> Vec<LinearShape> {
        let mut out = vec![linear_shape("self_attn.q_proj", &self.q_proj)];
        if let Some(kv) = &self.kv {
            out.push(linear_shape("self_attn.k_proj", &kv.k_proj));
            out.extend(
                kv.v_proj
                    .as_ref()
                    .map(|v| linear_shape("self_attn.v_proj", v)),
            );
        }
        out.push(linear_shape("self_attn.o_proj", &self.o_proj));
        out
    }

    /// The `self_attn` module of block `i`.
    fn load(a: &mut Scope, args: &Args, i: usize) -> Result<Self, LoadError> {
        let sliding = args.sliding[i];
        let k_eq_v = args.k_eq_v && !sliding;
        let layout = AttentionLayout {
            hidden: args.hidden,
            heads: args.heads,
            kv_heads: match args.global_kv_heads {
                Some(g) if k_eq_v => g,
                _ => args.kv_heads,
            },
            head_dim: if sliding {
                args.head_dim
            } else {
                args.global_head_dim
            },
            eps: args.eps,
            rope: if sliding {
                args.sliding_rope.clone()
            } else {
                args.global_rope.clone()
            },
            sliding,
            own_kv: i < args.cached_layers,
            k_eq_v,
        };
        Self::load_layout(a, layout)
    }

    /// A `self_attn` module of `layout`.
    pub(crate) fn load_layout(a: &mut Scope, layout: AttentionLayout) -> Result<Self, LoadError> {
        let AttentionLayout {
            hidden,
            heads,
            kv_heads,
            head_dim: d,
            eps,
            rope,
            sliding,
            own_kv,
            k_eq_v,
        } = layout;
        if heads == 0 || kv_heads == 0 || !heads.is_multiple_of(kv_heads) {
            return Err(LoadError::Config(format!(
                "{heads} attention heads cannot be grouped over {kv_heads} key/value heads"
            )));
        }
        let mut linear =
            |name: &str, inputs, outputs| Linear::load(&mut a.pp(name), inputs, outputs, false);
        let kv = if own_kv {
            Some(KvProjections {
                k_proj: linear("k_proj", hidden, kv_heads * d)?,
                v_proj: (!k_eq_v)
                    .then(|| linear("v_proj", hidden, kv_heads * d))
                    .transpose()?,
                k_norm: RmsNorm::load(&mut a.pp("k_norm"), d, eps)?,
                v_norm: RmsNorm::unscaled(d, eps, a.device())?,
            })
        } else {
            // As mlx-lm's `sanitize`: a KV-shared layer's own projections go unused.
            for unused in ["k_proj", "v_proj", "k_norm"] {
                a.discard(unused);
            }
            None
        };
        Ok(Attention {
            q_proj: Linear::load(&mut a.pp("q_proj"), hidden, heads * d, false)?,
            kv,
            o_proj: Linear::load(&mut a.pp("o_proj"), heads * d, hidden, false)?,
            q_norm: RmsNorm::load(&mut a.pp("q_norm"), d, eps)?,
            rope,
            heads,
            kv_heads,
            head_dim: d,
            sliding,
        })
    }
}

/// The E-series gate that mixes a layer's slice of the per-layer inputs into the residual.
pub(crate) struct PerLayerGate {
    per_layer_input_gate: Linear,
    per_layer_projection: Linear,
    post_per_layer_input_norm: RmsNorm,
}

impl PerLayerGate {
    /// From the tensors of its block (its layers sit there).
    pub(crate) fn load(
        block: &mut Scope,
        hidden: usize,
        dim: usize,
        eps: f32,
    ) -> Result<Self, LoadError> {
        Ok(PerLayerGate {
            per_layer_input_gate: Linear::load(
                &mut block.pp("per_layer_input_gate"),
                hidden,
                dim,
                false,
            )?,
            per_layer_projection: Linear::load(
                &mut block.pp("per_layer_projection"),
                dim,
                hidden,
                false,
            )?,
            post_per_layer_input_norm: RmsNorm::load(
                &mut block.pp("post_per_layer_input_norm"),
                hidden,
                eps,
            )?,
        })
    }

    /// What it adds to the residual: `norm(projection(gelu(gate(h)) · input))`, `input` the
    /// layer's slice of the per-layer inputs, with the layers the block's own adapters (`lora`)
    /// name adapted.
    pub(crate) fn forward(
        &self,
        h: &Tensor,
        input: &Tensor,
        lora: ModuleAdapters,
    ) -> OpResult<Tensor> {
        let input_gate = &self.per_layer_input_gate;
        let mut g = input_gate.forward_adapted(h, lora.get("per_layer_input_gate"))?;
        ops::gelu_approx_mul_inplace(&mut g, input)?;
        let projection = &self.per_layer_projection;
        let mut g = projection.forward_adapted(&g, lora.get("per_layer_projection"))?;
        self.post_per_layer_input_norm.forward_inplace(&mut g)?;
        Ok(g)
    }

    /// Its layers, as mlx-lm's default LoRA keys select them (at the block's top level).
    pub(crate) fn linears(&self) -> [LinearShape; 2] {
        [
            linear_shape("per_layer_input_gate", &self.per_layer_input_gate),
            linear_shape("per_layer_projection", &self.per_layer_projection),
        ]
    }
}

/// The 26B-A4B model's routed experts, run beside the dense MLP of every layer.
struct MoeBlock {
    router_proj: Linear,
    /// `router.scale / √hidden`, the router's input norm.
    router_norm: RmsNorm,
    /// Host values: routing is decided on the host.
    per_expert_scale: Vec<f32>,
    top_k: usize,
    /// GeGLU experts, each viewing its slice of the stacked `switch_glu` weights.
    experts: Vec<Mlp>,
    pre_feedforward_layernorm_2: RmsNorm,
    post_feedforward_layernorm_1: RmsNorm,
    post_feedforward_layernorm_2: RmsNorm,
}

impl MoeBlock {
    /// From the tensors of its block (`router`, `experts` and the extra norms sit there).
    fn load(block: &mut Scope, hidden: usize, args: &MoeArgs, eps: f32) -> Result<Self, LoadError> {
        let MoeArgs {
            experts,
            top_k,
            intermediate,
        } = *args;
        let mlps = load_experts(
            &mut block.pp("experts.switch_glu"),
            experts,
            hidden,
            intermediate,
            false,
        )?;
        let mut router = block.pp("router");
        let root = (hidden as f64).powf(-0.5) as f32;
        let scale = load_host_vector(&mut router, "scale", hidden)?;
        let scale: Vec<f32> = scale.iter().map(|s| s * root).collect();
        let router_norm = RmsNorm::new(&scale, eps, router.device())?;
        let router_proj = Linear::load(&mut router.pp("proj"), hidden, experts, false)?;
        let per_expert_scale = load_host_vector(&mut router, "per_expert_scale", experts)?;
        let mut norm = |name: &str| RmsNorm::load(&mut block.pp(name), hidden, eps);
        Ok(MoeBlock {
            router_proj,
            router_norm,
            per_expert_scale,
            top_k,
            experts: mlps,
            pre_feedforward_layernorm_2: norm("pre_feedforward_layernorm_2")?,
            post_feedforward_layernorm_1: norm("post_feedforward_layernorm_1")?,
            post_feedforward_layernorm_2: norm("post_feedforward_layernorm_2")?,
        })
    }

    /// `Router`: each token's top-k experts, best first, from the router's scores `[n,
    /// experts]`, and their weights: a softmax over the top-k scores, times the expert's own
    /// scale. `[n, top_k]`.
    fn choose(&self, scores: &[f32]) -> Vec<(usize, f32)> {
        let count = self.experts.len();
        let mut chosen = Vec::with_capacity(scores.len() / count * self.top_k);
        let mut order: Vec<usize> = Vec::with_capacity(count);
        for scores in scores.chunks_exact(count) {
            order.clear();
            order.extend(0..count);
            order.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]).then(a.cmp(&b)));
            let top = &order[..self.top_k];
            let mut weights: Vec<f32> = top.iter().map(|&e| scores[e]).collect();
            softmax_inplace(&mut weights);
            let scaled = top.iter().zip(weights);
            chosen.extend(scaled.map(|(&e, w)| (e, w * self.per_expert_scale[e])));
        }
        chosen
    }

    /// The feed-forward output of a MoE layer: dense MLP and experts, each normed, summed.
    /// Each expert runs once, on all the rows routed to it, reading only the chosen experts'
    /// weights. `lora` gives the adapters of the block's modules by name.
    fn forward<'a>(
        &self,
        mlp: &Mlp,
        pre_feedforward_layernorm: &RmsNorm,
        h: &Tensor,
        lora: impl Fn(&'static str) -> ModuleAdapters<'a>,
    ) -> OpResult<Tensor> {
        let mut dense = mlp.forward_geglu(&pre_feedforward_layernorm.forward(h)?, lora("mlp"))?;
        self.post_feedforward_layernorm_1
            .forward_inplace(&mut dense)?;
        let router_in = self.router_norm.forward(h)?;
        let scores = (self.router_proj)
            .forward_adapted(&router_in, lora("router").get("proj"))?
            .into_vec()?;
        let routed = by_expert(&self.choose(&scores), self.top_k, self.experts.len());
        let x = self.pre_feedforward_layernorm_2.forward(h)?;
        let experts = lora("experts.switch_glu");
        let mut sparse = dispatch(&x, &routed, |e, rows| {
            self.experts[e].forward_geglu(rows, experts.expert(e))
        })?;
        self.post_feedforward_layernorm_2
            .forward_inplace(&mut sparse)?;
        ops::add_inplace(&mut dense, &sparse)?;
        Ok(dense)
    }
}

struct Block {
    input_layernorm: RmsNorm,
    self_attn: Attention,
    post_attention_layernorm: RmsNorm,
    pre_feedforward_layernorm: RmsNorm,
    mlp: Mlp,
    moe: Option<MoeBlock>,
    post_feedforward_layernorm: RmsNorm,
    per_layer: Option<PerLayerGate>,
    layer_scalar: f32,
    /// The cache this layer attends over: its own, or for a KV-shared layer that of the last
    /// earlier layer of the same kind.
    kv_source: usize,
}

/// The per-layer input embeddings of the E-series models.
pub(crate) struct PerLayerInputs {
    embed_tokens_per_layer: Embedding,
    per_layer_model_projection: Linear,
    per_layer_projection_norm: RmsNorm,
    /// `hidden_size_per_layer_input`.
    dim: usize,
}

impl PerLayerInputs {
    /// `[tokens, layers * dim]`: each layer's input, from the token ids and the scaled embeddings `h`.
    pub(crate) fn forward(&self, tokens: &[u32], h: &Tensor, hidden: usize) -> OpResult<Tensor> {
        let mut from_ids = self.embed_tokens_per_layer.forward(tokens)?;
        ops::scale_inplace(&mut from_ids, (self.dim as f64).sqrt() as f32)?;
        let mut projected = self.per_layer_model_projection.forward(h)?;
        ops::scale_inplace(&mut projected, (hidden as f64).powf(-0.5) as f32)?;
        self.per_layer_projection_norm
            .forward_inplace(&mut projected)?;
        ops::add_inplace(&mut projected, &from_ids)?;
        ops::scale_inplace(&mut projected, 2f64.powf(-0.5) as f32)?;
        Ok(projected)
    }

    /// From the tensors of the model (they sit beside its blocks): `dim` features for each of
    /// `layers` layers, from an embedding of `vocab` rows and the `hidden`-wide embeddings.
    pub(crate) fn load(
        model: &mut Scope,
        (vocab, hidden): (usize, usize),
        (layers, dim): (usize, usize),
        eps: f32,
    ) -> Result<Self, LoadError> {
        let width = layers * dim;
        Ok(PerLayerInputs {
            embed_tokens_per_layer: Embedding::load(
                &mut model.pp("embed_tokens_per_layer"),
                vocab,
                width,
            )?,
            per_layer_model_projection: Linear::load(
                &mut model.pp("per_layer_model_projection"),
                hidden,
                width,
                false,
            )?,
            per_layer_projection_norm: RmsNorm::load(
                &mut model.pp("per_layer_projection_norm"),
                dim,
                eps,
            )?,
            dim,
        })
    }
}

pub struct Gemma4 {
    info: ModelInfo,
    embed_tokens: Embedding,
    embed_scale: f32,
    per_layer_inputs: Option<PerLayerInputs>,
    layers: Vec<Block>,
    head: OutputHead,
    sliding_window: usize,
    /// Layers with a cache of their own: the first `num_hidden_layers - num_kv_shared_layers`.
    cached_layers: usize,
}

/// The RoPE of one layer kind from `rope_parameters`, as `Attention.__init__` builds it.
fn rope_for(
    rope_parameters: &Value,
    kind: &str,
    head_dim: usize,
    traditional: bool,
    device: &Device,
) -> Result<Rope, LoadError> {
    let params = rope_parameters.get(kind).cloned().unwrap_or(json!({}));
    let theta = params
        .get("rope_theta")
        .and_then(Value::as_f64)
        .unwrap_or(10000.0);
    Rope::new(
        head_dim,
        theta as f32,
        traditional,
        Some(&params),
        None,
        device,
    )
}

/// Per layer, whether `layer_types` makes it a sliding-window layer (else global).
pub(crate) fn sliding_layers(
    layer_types: &[String],
    layers: usize,
) -> Result<Vec<bool>, LoadError> {
    if layer_types.len() < layers {
        return Err(LoadError::Config(format!(
            "`layer_types` names {} of {layers} layers",
            layer_types.len()
        )));
    }
    layer_types[..layers]
        .iter()
        .map(|t| match t.as_str() {
            "sliding_attention" => Ok(true),
            "full_attention" => Ok(false),
            other => Err(LoadError::Config(format!(
                "layer type `{other}` is not supported"
            ))),
        })
        .collect()
}

/// Per layer, the layer whose cache it attends over: itself among the first `cached_layers`,
/// and for each later (KV-shared) layer the last cached layer of its kind (`sliding`).
pub(crate) fn kv_sources(sliding: &[bool], cached_layers: usize) -> Result<Vec<usize>, LoadError> {
    let mut sources: Vec<usize> = (0..sliding.len()).collect();
    for j in cached_layers..sliding.len() {
        sources[j] = (0..cached_layers)
            .rev()
            .find(|&i| sliding[i] == sliding[j])
            .ok_or_else(|| {
                let kind = match sliding[j] {
                    true => "sliding_attention",
                    false => "full_attention",
                };
                LoadError::Config(format!(
                    "KV-shared layer {j} has no earlier {kind} to share with"
                ))
            })?;
    }
    Ok(sources)
}

/// A fresh cache for each of `attentions` (the layers that keep one): a ring of `window`
/// positions for a sliding-window layer, else every position.
pub(crate) fn attention_caches<'a>(
    attentions: impl Iterator<Item = &'a Attention>,
    window: usize,
    device: &Device,
) -> Result<Vec<LayerCache>, EngineError> {
    attentions
        .map(|a| {
            Ok(if a.sliding {
                LayerCache::Rotating(RotatingKvCache::new(
                    a.kv_heads, a.head_dim, window, device,
                )?)
            } else {
                LayerCache::Kv(KvCache::new(a.kv_heads, a.head_dim, device)?)
            })
        })
        .collect()
}

/// Drops the tensors of a multimodal checkpoint's `towers` (at the top level or under
/// `model.`), as its `sanitize` drops them.
pub(crate) fn discard_towers(ckpt: &mut Checkpoint, towers: &[&str]) {
    ckpt.discard_where(|name| {
        let name = name.strip_prefix("model.").unwrap_or(name);
        towers.iter().any(|t| name.starts_with(t))
    });
}

#[derive(Clone, Copy)]
struct MoeArgs {
    experts: usize,
    top_k: usize,
    intermediate: usize,
}

/// mlx-lm's `ModelArgs`, with its defaults, checked, and what `__init__` derives from it.
struct Args {
    hidden: usize,
    intermediate: usize,
    heads: usize,
    head_dim: usize,
    global_head_dim: usize,
    eps: f32,
    vocab: usize,
    vocab_per_layer: usize,
    kv_heads: usize,
    global_kv_heads: Option<usize>,
    /// `hidden_size_per_layer_input`, when the model has per-layer inputs.
    per_layer_dim: Option<usize>,
    sliding_window: usize,
    max_context: usize,
    k_eq_v: bool,
    softcap: Option<f32>,
    double_wide: bool,
    tied: bool,
    moe: Option<MoeArgs>,
    /// Per layer: a sliding-window layer (else global).
    sliding: Vec<bool>,
    /// Per layer: the layer whose cache it attends over (itself unless KV-shared).
    kv_sources: Vec<usize>,
    /// Layers with a cache of their own: the first `num_hidden_layers - num_kv_shared_layers`.
    cached_layers: usize,
    sliding_rope: Rope,
    global_rope: Rope,
}

impl Args {
    fn from_config(cfg: &Config, device: &Device) -> Result<Self, LoadError> {
        let bad = |msg: String| LoadError::Config(msg);
        let c: Gemma4Config = cfg.args()?;
        // mlx-lm passes a null as `None`, over the default: these settings are then off.
        fn unless_null<T>(cfg: &Config, key: &str, value: T) -> Option<T> {
            (!cfg.is_null(key)).then_some(value)
        }
        let layers = c.num_hidden_layers;
        let head_dim = c.head_dim;
        let global_head_dim = unless_null(cfg, "global_head_dim", c.global_head_dim)
            .filter(|&d| d > 0)
            .unwrap_or(head_dim);
        let pattern = c.sliding_window_pattern;
        let layer_types: Vec<String> = match c.layer_types {
            Some(types) => types,
            None if pattern > 0 => (0..layers)
                .map(|i| match (i + 1) % pattern {
                    0 => "full_attention".into(),
                    _ => "sliding_attention".into(),
                })
                .collect(),
            None => return Err(bad("`sliding_window_pattern` must be positive".into())),
        };
        let sliding = sliding_layers(&layer_types, layers)?;
        let cached_layers = layers.saturating_sub(c.num_kv_shared_layers);
        let kv_sources = kv_sources(&sliding, cached_layers)?;
        let missing = |key: &str| bad(format!("`{key}` is missing"));
        let moe = if c.enable_moe_block {
            let experts = c.num_experts.ok_or_else(|| missing("num_experts"))?;
            let top_k = c.top_k_experts.ok_or_else(|| missing("top_k_experts"))?;
            if top_k == 0 || top_k > experts {
                return Err(bad(format!("{top_k} experts per token of {experts}")));
            }
            Some(MoeArgs {
                experts,
                top_k,
                intermediate: c
                    .moe_intermediate_size
                    .ok_or_else(|| missing("moe_intermediate_size"))?,
            })
        } else {
            None
        };
        let traditional = c.rope_traditional;
        let rope_parameters = c.rope_parameters;
        let args = Args {
            hidden: c.hidden_size,
            intermediate: c.intermediate_size,
            heads: c.num_attention_heads,
            head_dim,
            global_head_dim,
            eps: c.rms_norm_eps,
            vocab: c.vocab_size,
            vocab_per_layer: c.vocab_size_per_layer_input,
            kv_heads: c.num_key_value_heads,
            global_kv_heads: c.num_global_key_value_heads,
            per_layer_dim: unless_null(
                cfg,
                "hidden_size_per_layer_input",
                c.hidden_size_per_layer_input,
            )
            .filter(|&d| d > 0),
            sliding_window: c.sliding_window,
            max_context: c.max_position_embeddings,
            k_eq_v: c.attention_k_eq_v,
            softcap: unless_null(cfg, "final_logit_softcapping", c.final_logit_softcapping),
            double_wide: c.use_double_wide_mlp,
            tied: c.tie_word_embeddings,
            moe,
            sliding,
            kv_sources,
            cached_layers,
            sliding_rope: rope_for(
                &rope_parameters,
                "sliding_attention",
                head_dim,
                traditional,
                device,
            )?,
            global_rope: rope_for(
                &rope_parameters,
                "full_attention",
                global_head_dim,
                traditional,
                device,
            )?,
        };
        if args.sliding_window == 0 {
            return Err(bad("`sliding_window` must be positive".into()));
        }
        if args.per_layer_dim.is_some() && args.vocab_per_layer < args.vocab {
            return Err(bad(format!(
                "`vocab_size_per_layer_input` {} is smaller than `vocab_size` {}",
                args.vocab_per_layer, args.vocab
            )));
        }
        Ok(args)
    }

    fn layers(&self) -> usize {
        self.sliding.len()
    }
}

impl Block {
    /// Block `i` of the model, from its scope (`model.layers.{i}`).
    fn load(block: &mut Scope, args: &Args, i: usize) -> Result<Self, LoadError> {
        let (hidden, eps) = (args.hidden, args.eps);
        let norm = |block: &mut Scope, name: &str| RmsNorm::load(&mut block.pp(name), hidden, eps);
        // KV-shared layers have a double-wide MLP.
        let kv_shared = i >= args.cached_layers && args.cached_layers > 0;
        let mlp_width = args.intermediate * if args.double_wide && kv_shared { 2 } else { 1 };
        let per_layer = args
            .per_layer_dim
            .map(|dim| PerLayerGate::load(block, hidden, dim, eps))
            .transpose()?;
        Ok(Block {
            input_layernorm: norm(block, "input_layernorm")?,
            self_attn: Attention::load(&mut block.pp("self_attn"), args, i)?,
            post_attention_layernorm: norm(block, "post_attention_layernorm")?,
            pre_feedforward_layernorm: norm(block, "pre_feedforward_layernorm")?,
            mlp: Mlp::load(&mut block.pp("mlp"), hidden, mlp_width, false)?,
            moe: args
                .moe
                .as_ref()
                .map(|moe| MoeBlock::load(block, hidden, moe, eps))
                .transpose()?,
            post_feedforward_layernorm: norm(block, "post_feedforward_layernorm")?,
            per_layer,
            layer_scalar: load_host_vector(block, "layer_scalar", 1)?[0],
            kv_source: args.kv_sources[i],
        })
    }
}

/// The modules of a `gemma4` checkpoint besides its language model (vision and audio towers and
/// their embedders), which mlx-lm's text model drops.
pub const NON_TEXT_MODULES: [&str; 6] = [
    "vision_tower",
    "multi_modal_projector",
    "audio_tower",
    "embed_audio",
    "embed_vision",
    "vision_embedder",
];

impl Gemma4 {
    pub fn load(mut ckpt: Checkpoint) -> Result<Self, LoadError> {
        let model_type = ckpt.config.model_type()?.to_string();
        let (args, prefix) = if model_type == "gemma4" {
            // As `gemma4.py`'s `sanitize`: only the language model is kept.
            discard_towers(&mut ckpt, &NON_TEXT_MODULES);
            let text = wrapped_text_config(&ckpt.config, 262144, 8, 1)?;
            (Args::from_config(&text, &ckpt.device)?, "language_model.")
        } else {
            (Args::from_config(&ckpt.config, &ckpt.device)?, "")
        };
        ckpt.discard_where(|name| {
            let unused = ["input_max", "input_min", "output_max", "output_min"];
            name.contains("self_attn.rotary_emb") || unused.iter().any(|s| name.contains(s))
        });
        let (hidden, vocab) = (args.hidden, args.vocab);
        let mut root = ckpt.scope(prefix.trim_end_matches('.'));
        let mut model = root.pp("model");
        let embed_tokens = Embedding::load(&mut model.pp("embed_tokens"), vocab, hidden)?;
        let per_layer_inputs = args
            .per_layer_dim
            .map(|dim| {
                let (sizes, eps) = ((args.vocab_per_layer, hidden), args.eps);
                PerLayerInputs::load(&mut model, sizes, (args.layers(), dim), eps)
            })
            .transpose()?;
        let layers = (0..args.layers())
            .map(|i| Block::load(&mut model.pp(format_args!("layers.{i}")), &args, i))
            .collect::<Result<Vec<_>, _>>()?;
        let norm = RmsNorm::load(&mut model.pp("norm"), hidden, args.eps)?;
        let lm_head = (!args.tied)
            .then(|| Linear::load(&mut root.pp("lm_head"), hidden, vocab, false))
            .transpose()?;
        let device = ckpt.device.clone();
        ckpt.finish()?;
        Ok(Gemma4 {
            info: ModelInfo {
                model_type,
                vocab_size: vocab,
                hidden_size: hidden,
                num_layers: layers.len(),
                max_context: Some(args.max_context),
                device,
            },
            embed_tokens,
            embed_scale: (hidden as f64).sqrt() as f32,
            per_layer_inputs,
            layers,
            head: OutputHead {
                norm,
                lm_head,
                softcap: args.softcap,
            },
            sliding_window: args.sliding_window,
            cached_layers: args.cached_layers,
        })
    }
}

impl Architecture for Gemma4 {
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

    /// Takes no adapters yet (not [`Adaptable`](crate::lora::Adaptable)).
    fn hidden_states(
        &self,
        tokens: &[u32],
        caches: &mut [&mut Cache],
        adapters: Option<PassAdapters>,
    ) -> Result<Tensor, ForwardError> {
        let (mut caches, positions) =
            PassCaches::new(&self.info, tokens, caches, self.cached_layers)?;
        let hidden = self.info.hidden_size;
        let mut h = self.embed_tokens.forward(tokens)?;
        ops::scale_inplace(&mut h, self.embed_scale)?;
        let per_layer_inputs = match &self.per_layer_inputs {
            Some(p) => Some((p.forward(tokens, &h, hidden)?, p.dim)),
            None => None,
        };
        for (i, block) in self.layers.iter().enumerate() {
            let lora = |module| adapters.map_or(ModuleAdapters::NONE, |a| a.module(i, module));
            let x = block.input_layernorm.forward(&h)?;
            let layers = (i, block.kv_source);
            let attn = &block.self_attn;
            let mut r = attn.run(&x, &positions, &mut caches, layers, lora("self_attn"))?;
            block.post_attention_layernorm.forward_inplace(&mut r)?;
            ops::add_inplace(&mut h, &r)?;

            let mut r = match &block.moe {
                Some(moe) => moe.forward(&block.mlp, &block.pre_feedforward_layernorm, &h, lora)?,
                None => block
                    .mlp
                    .forward_geglu(&block.pre_feedforward_layernorm.forward(&h)?, lora("mlp"))?,
            };
            block.post_feedforward_layernorm.forward_inplace(&mut r)?;
            ops::add_inplace(&mut h, &r)?;

            if let (Some(gate), Some((inputs, dim))) = (&block.per_layer, &per_layer_inputs) {
                let input = ops::columns(inputs, i * dim, *dim)?;
                let g = gate.forward(&h, &input, lora(""))?;
                ops::add_inplace(&mut h, &g)?;
            }
            ops::scale_inplace(&mut h, block.layer_scalar)?;
        }
        caches.finish();
        Ok(h)
    }

    fn output(&self) -> (&OutputHead, &Embedding) {
        (&self.head, &self.embed_tokens)
    }
}

impl Adaptable for Gemma4 {
    fn decoder(&self) -> &dyn Decoder {
        self
    }

    /// mlx-lm's multimodal `gemma4` nests the text model under `language_model`.
    fn blocks_path(&self) -> &'static str {
        match self.info.model_type.as_str() {
            "gemma4" => "language_model.model.layers",
            _ => "model.layers",
        }
    }

    fn block_linears(&self) -> Vec<Vec<LinearShape>> {
        let blocks = self.layers.iter();
        blocks
            .map(|b| {
                let mut linears = [b.self_attn.linears(), b.mlp.linears()].concat();
                if let Some(moe) = &b.moe {
                    linears.push(linear_shape("router.proj", &moe.router_proj));
                    let experts = &moe.experts;
                    linears.extend([
                        experts_shape("experts.switch_glu.gate_proj", experts, |m| &m.gate_proj),
                        experts_shape("experts.switch_glu.up_proj", experts, |m| &m.up_proj),
                        experts_shape("experts.switch_glu.down_proj", experts, |m| &m.down_proj),
                    ]);
                }
                if let Some(gate) = &b.per_layer {
                    linears.extend(gate.linears());
                }
                linears
            })
            .collect()
    }
}
