//! Granite 4.0's hybrid (IBM; mlx-lm's `granitemoehybrid.py`): Mamba-2 layers
//! ([`Mamba2Mixer`], under `mamba`) and grouped-query attention layers (`self_attn`, RoPE unless
//! `position_embedding_type` is `nope`, scaled by `attention_multiplier`) as `layer_types`
//! lists them, each followed by a mixture of experts (`block_sparse_moe`: top-k of a softmax
//! over `num_local_experts`, renormalized) beside an ungated shared MLP (`shared_mlp`, whose
//! `input_linear` holds the gate and up halves), or by a dense SwiGLU MLP where the config has
//! no experts. Granite's multipliers: the embeddings times `embedding_multiplier`, each branch
//! times `residual_multiplier`, the logits over `logits_scaling`.

use oxlm_engine::{ops, EngineError, Tensor};
use serde::Deserialize;
use serde_json::Value;

use crate::cache::{Cache, LayerCache};
use crate::checkpoint::{Checkpoint, Scope};
use crate::decoder_grad::{Decoder, DecoderBlock};
use crate::layers::{
    linear_shape, Attention, Embedding, Linear, Mlp, OpResult, OutputHead, RmsNorm, Rope,
};
use crate::lora::{Adaptable, LinearShape, ModuleAdapters, PassAdapters};
use crate::mamba2::{caches_fit, CachedMixer, Mamba2Args, Mamba2Mixer, Mamba2Names};
use crate::pass::{Architecture, LayerCaches, PassCaches};
use crate::switch::{ExpertMlps, MoeNames, Routing, SparseMoe};
use crate::{ForwardError, LoadError, ModelInfo};

/// `config.json`'s keys, with mlx-lm's defaults.
#[derive(Deserialize)]
struct Args {
    vocab_size: usize,
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    max_position_embeddings: Option<usize>,
    num_attention_heads: usize,
    num_key_value_heads: usize,
    #[serde(default)]
    attention_bias: bool,
    embedding_multiplier: f32,
    attention_multiplier: f32,
    logits_scaling: f32,
    residual_multiplier: f32,
    layer_types: Vec<String>,
    rms_norm_eps: f32,
    num_local_experts: Option<usize>,
    num_experts_per_tok: Option<usize>,
    shared_intermediate_size: Option<usize>,
    mamba_n_heads: Option<usize>,
    mamba_d_head: Option<usize>,
    #[serde(default)]
    mamba_proj_bias: bool,
    mamba_d_state: Option<usize>,
    mamba_d_conv: Option<usize>,
    mamba_n_groups: Option<usize>,
    #[serde(default)]
    mamba_conv_bias: bool,
    #[serde(default)]
    mlp_bias: bool,
    position_embedding_type: Option<String>,
    tie_word_embeddings: Option<bool>,
    time_step_limit: Option<(f32, f32)>,
    rope_theta: Option<f32>,
    rope_parameters: Option<Value>,
}

impl Args {
    fn missing(key: &str) -> LoadError {
        LoadError::Config(format!("`{key}` is missing"))
    }

    fn mamba(&self) -> Result<Mamba2Args, LoadError> {
        let need = |v: Option<usize>, key: &str| v.ok_or_else(|| Args::missing(key));
        Ok(Mamba2Args {
            hidden: self.hidden_size,
            heads: need(self.mamba_n_heads, "mamba_n_heads")?,
            head_dim: need(self.mamba_d_head, "mamba_d_head")?,
            groups: need(self.mamba_n_groups, "mamba_n_groups")?,
            state: need(self.mamba_d_state, "mamba_d_state")?,
            conv_kernel: need(self.mamba_d_conv, "mamba_d_conv")?,
            conv_bias: self.mamba_conv_bias,
            proj_bias: self.mamba_proj_bias,
            norm_groups: 1,
            eps: self.rms_norm_eps,
            time_step_limit: self.time_step_limit.unwrap_or((0.001, 100.0)),
        })
    }

    /// `rope_theta`, or where newer configs nest it.
    fn rope_theta(&self) -> f32 {
        let nested = self
            .rope_parameters
            .as_ref()
            .and_then(|p| p.get("rope_theta"));
        nested
            .and_then(Value::as_f64)
            .map(|t| t as f32)
            .or(self.rope_theta)
            .unwrap_or(10000.0)
    }
}

const MAMBA: Mamba2Names = Mamba2Names {
    module: "mamba",
    keys: ["mamba.in_proj", "mamba.out_proj"],
};

/// A block's sequence mixer, as `layer_types` says.
// One per layer, held in a Vec: the variants' sizes do not matter.
#[allow(clippy::large_enum_variant)]
enum Mixer {
    Mamba(Mamba2Mixer),
    Attention(Attention),
}

/// The shared MLP beside a block's experts: `input_linear` gives the gate and up halves.
struct SharedMlp {
    input_linear: Linear,
    output_linear: Linear,
    width: usize,
}

impl SharedMlp {
    fn load(vb: &mut Scope, hidden: usize, width: usize) -> Result<Self, LoadError> {
        Ok(SharedMlp {
            input_linear: Linear::load(&mut vb.pp("input_linear"), hidden, 2 * width, false)?,
            output_linear: Linear::load(&mut vb.pp("output_linear"), width, hidden, false)?,
            width,
        })
    }

    fn forward(&self, x: &Tensor, lora: ModuleAdapters) -> OpResult<Tensor> {
        let both = self
            .input_linear
            .forward_adapted(x, lora.get("input_linear"))?;
        let mut gate = ops::columns(&both, 0, self.width)?;
        ops::silu_mul_inplace(&mut gate, &ops::columns(&both, self.width, self.width)?)?;
        self.output_linear
            .forward_adapted(&gate, lora.get("output_linear"))
    }
}

/// A block's feed-forward part.
// One per layer, held in a Vec: the variants' sizes do not matter.
#[allow(clippy::large_enum_variant)]
enum FeedForward {
    Dense(Mlp),
    Moe { moe: SparseMoe, shared: SharedMlp },
}

struct Block {
    input_layernorm: RmsNorm,
    mixer: Mixer,
    post_attention_layernorm: RmsNorm,
    feed_forward: FeedForward,
}

impl Block {
    fn linears(&self) -> Vec<LinearShape> {
        let mut out = match &self.mixer {
            Mixer::Mamba(m) => m.linears(),
            Mixer::Attention(a) => a.linears(),
        };
        match &self.feed_forward {
            FeedForward::Dense(mlp) => out.extend(mlp.linears()),
            FeedForward::Moe { moe, shared } => {
                out.extend(moe.linears());
                out.push(linear_shape(
                    "shared_mlp.input_linear",
                    &shared.input_linear,
                ));
                out.push(linear_shape(
                    "shared_mlp.output_linear",
                    &shared.output_linear,
                ));
            }
        }
        out
    }
}

pub struct GraniteMoeHybrid {
    info: ModelInfo,
    embed_tokens: Embedding,
    layers: Vec<Block>,
    head: OutputHead,
    embedding_multiplier: f32,
    residual_multiplier: f32,
}

impl GraniteMoeHybrid {
    pub fn load(mut ckpt: Checkpoint) -> Result<Self, LoadError> {
        let model_type = ckpt.config.model_type()?.to_string();
        let c: Args = ckpt.config.args()?;
        let (h, eps) = (c.hidden_size, c.rms_norm_eps);
        if c.layer_types.len() != c.num_hidden_layers {
            return Err(LoadError::Config(format!(
                "{} layer types for {} layers",
                c.layer_types.len(),
                c.num_hidden_layers
            )));
        }
        let (heads, kv_heads) = (c.num_attention_heads, c.num_key_value_heads);
        if heads == 0 || kv_heads == 0 || !heads.is_multiple_of(kv_heads) {
            return Err(LoadError::Config(format!(
                "{heads} attention heads cannot be grouped over {kv_heads} key/value heads"
            )));
        }
        let head_dim = h / heads;
        let device = ckpt.device.clone();
        let rope = match c.position_embedding_type.as_deref().unwrap_or("rope") {
            "nope" => Rope::none(head_dim, &device)?,
            "rope" => Rope::new(
                head_dim,
                c.rope_theta(),
                false,
                None,
                c.max_position_embeddings,
                &device,
            )?,
            other => {
                return Err(LoadError::Config(format!(
                    "`position_embedding_type` `{other}` (supported: rope, nope)"
                )))
            }
        };
        let moe = match (c.num_local_experts, c.num_experts_per_tok) {
            (Some(experts), Some(top_k)) if experts > 0 => Some((
                Routing::new(experts, top_k, true)?,
                c.shared_intermediate_size
                    .ok_or_else(|| Args::missing("shared_intermediate_size"))?,
            )),
            (Some(e), None) if e > 0 => return Err(Args::missing("num_experts_per_tok")),
            _ => None,
        };
        let tied = c.tie_word_embeddings.unwrap_or(true);
        if tied {
            // Some checkpoints carry a head their tied model never reads (mlx-lm drops it).
            ckpt.discard_where(|name| name.starts_with("lm_head."));
        }
        let mut root = ckpt.scope("");
        let mut model = root.pp("model");
        let embed_tokens = Embedding::load(&mut model.pp("embed_tokens"), c.vocab_size, h)?;
        let mut layers = Vec::with_capacity(c.num_hidden_layers);
        for (i, kind) in c.layer_types.iter().enumerate() {
            let mut block = model.pp(format_args!("layers.{i}"));
            let mixer = match kind.as_str() {
                "mamba" => Mixer::Mamba(Mamba2Mixer::load(&mut block, c.mamba()?, MAMBA)?),
                "attention" => Mixer::Attention(load_attention(
                    &mut block.pp("self_attn"),
                    &c,
                    rope.clone(),
                )?),
                other => {
                    return Err(LoadError::Config(format!(
                        "layer type `{other}` (supported: mamba, attention)"
                    )))
                }
            };
            let feed_forward = match moe {
                Some((routing, shared)) => FeedForward::Moe {
                    moe: SparseMoe::load(
                        &mut block,
                        MoeNames::GRANITE,
                        h,
                        routing,
                        ExpertMlps::swiglu(c.intermediate_size),
                        None,
                    )?,
                    shared: SharedMlp::load(&mut block.pp("shared_mlp"), h, shared)?,
                },
                None => FeedForward::Dense(Mlp::load(
                    &mut block.pp("mlp"),
                    h,
                    c.intermediate_size,
                    c.mlp_bias,
                )?),
            };
            layers.push(Block {
                input_layernorm: RmsNorm::load(&mut block.pp("input_layernorm"), h, eps)?,
                mixer,
                post_attention_layernorm: RmsNorm::load(
                    &mut block.pp("post_attention_layernorm"),
                    h,
                    eps,
                )?,
                feed_forward,
            });
        }
        let mut norm = RmsNorm::load(&mut model.pp("norm"), h, eps)?;
        // The head is linear and the norm's output feeds only it.
        ops::scale_inplace(&mut norm.weight, 1.0 / c.logits_scaling).map_err(|source| {
            LoadError::Engine {
                name: "model.norm.weight".into(),
                source,
            }
        })?;
        let lm_head = (!tied)
            .then(|| Linear::load(&mut root.pp("lm_head"), h, c.vocab_size, false))
            .transpose()?;
        ckpt.finish()?;
        Ok(GraniteMoeHybrid {
            info: ModelInfo {
                model_type,
                vocab_size: c.vocab_size,
                hidden_size: h,
                num_layers: c.num_hidden_layers,
                max_context: c.max_position_embeddings,
                device,
            },
            embed_tokens,
            layers,
            head: OutputHead {
                norm,
                lm_head,
                softcap: None,
            },
            embedding_multiplier: c.embedding_multiplier,
            residual_multiplier: c.residual_multiplier,
        })
    }

    /// Each block's mixer, as its cache is made and checked.
    fn cached(&self) -> impl Iterator<Item = CachedMixer<'_>> + Clone {
        self.layers.iter().map(|b| match &b.mixer {
            Mixer::Mamba(m) => CachedMixer::Mamba(m),
            Mixer::Attention(a) => CachedMixer::Attention(a),
        })
    }

    /// `h += residual_multiplier · r`.
    fn add_branch(&self, h: &mut Tensor, mut r: Tensor) -> OpResult<()> {
        ops::scale_inplace(&mut r, self.residual_multiplier)?;
        ops::add_inplace(h, &r)
    }
}

/// The `self_attn` module of a block: no q/k norms, `attention_multiplier` as the softmax's
/// scale.
fn load_attention(vb: &mut Scope, c: &Args, rope: Rope) -> Result<Attention, LoadError> {
    let (h, heads, kv_heads) = (c.hidden_size, c.num_attention_heads, c.num_key_value_heads);
    let head_dim = h / heads;
    let (q_width, kv_width, bias) = (heads * head_dim, kv_heads * head_dim, c.attention_bias);
    Ok(Attention {
        q_proj: Linear::load(&mut vb.pp("q_proj"), h, q_width, bias)?,
        k_proj: Linear::load(&mut vb.pp("k_proj"), h, kv_width, bias)?,
        v_proj: Linear::load(&mut vb.pp("v_proj"), h, kv_width, bias)?,
        o_proj: Linear::load(&mut vb.pp("o_proj"), q_width, h, bias)?,
        q_norm: None,
        k_norm: None,
        rope,
        heads,
        kv_heads,
        head_dim,
        scale: c.attention_multiplier,
        query_scale: None,
        norm_after_rope: false,
        softcap: None,
        sinks: None,
        chunk: None,
    })
}

impl Architecture for GraniteMoeHybrid {
    fn info(&self) -> &ModelInfo {
        &self.info
    }

    fn layer_caches(&self) -> Result<Vec<LayerCache>, EngineError> {
        let device = &self.info.device;
        self.cached().map(|m| m.new_cache(device)).collect()
    }

    fn hidden_states(
        &self,
        tokens: &[u32],
        caches: &mut [&mut Cache],
        adapters: Option<PassAdapters>,
    ) -> Result<Tensor, ForwardError> {
        let (mut caches, positions) =
            PassCaches::fitting(&self.info, tokens, caches, self.layers.len(), |c| {
                caches_fit(self.cached(), c)
            })?;
        let mut h = self.embed(tokens)?;
        for (i, block) in self.layers.iter().enumerate() {
            let lora = |module| adapters.map_or(ModuleAdapters::NONE, |a| a.module(i, module));
            let x = block.input_layernorm.forward(&h)?;
            let r = match (&block.mixer, caches.layer(i)?) {
                (Mixer::Mamba(m), LayerCaches::Recurrent(mut c)) => {
                    m.forward(&x, &mut c, lora(MAMBA.module))?
                }
                (Mixer::Attention(a), LayerCaches::Kv(mut c)) => {
                    a.forward(&x, &positions, &mut c, lora("self_attn"))?
                }
                _ => return Err(ForwardError::CacheMismatch),
            };
            self.add_branch(&mut h, r)?;
            let x = block.post_attention_layernorm.forward(&h)?;
            let r = match &block.feed_forward {
                FeedForward::Dense(mlp) => mlp.forward_adapted(&x, lora("mlp"))?,
                FeedForward::Moe { moe, shared } => {
                    let mut r = moe.forward(&x, lora)?;
                    ops::add_inplace(&mut r, &shared.forward(&x, lora("shared_mlp"))?)?;
                    r
                }
            };
            self.add_branch(&mut h, r)?;
        }
        caches.finish();
        Ok(h)
    }

    fn output(&self) -> (&OutputHead, &Embedding) {
        (&self.head, &self.embed_tokens)
    }
}

impl Adaptable for GraniteMoeHybrid {
    fn block_linears(&self) -> Vec<Vec<LinearShape>> {
        self.layers.iter().map(Block::linears).collect()
    }

    fn decoder(&self) -> &dyn Decoder {
        self
    }
}

impl Decoder for GraniteMoeHybrid {
    fn embed(&self, tokens: &[u32]) -> OpResult<Tensor> {
        let mut h = self.embed_tokens.forward(tokens)?;
        ops::scale_inplace(&mut h, self.embedding_multiplier)?;
        Ok(h)
    }

    fn blocks(&self, _tokens: &[u32]) -> OpResult<Vec<DecoderBlock<'_>>> {
        Err(EngineError::Unsupported(
            "LoRA training through Mamba-2 layers".into(),
        ))
    }
}
