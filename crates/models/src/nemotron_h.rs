//! NVIDIA's Nemotron-H (mlx-lm's `nemotron_h.py`; Nemotron Nano 9B/12B v2): one mixer a block,
//! as `hybrid_override_pattern` spells the layers (or `layers_block_type` / `layer_types` name
//! them), each block `x + mixer(norm(x))`:
//! - `M`: a Mamba-2 mixer ([`Mamba2Mixer`]) whose gated norm works group by group;
//! - `*`: grouped-query attention without RoPE, scaled by `head_dim^-0.5`;
//! - `-`: an MLP `down(relu(up(x))²)`;
//! - `E` (Nemotron 3): a mixture of such MLPs, chosen by DeepSeek-V3's routing (sigmoid scores
//!   with a correction bias, groups, renormalized, scaled), working in a narrower latent space
//!   (`moe_latent_size`) where the config has one, beside a shared MLP.
//!
//! Only `M` and `*` blocks keep caches, as mlx-lm's `make_cache` makes them (so prompt-cache
//! files hold one state a mixer).

use std::borrow::Cow;

use oxlm_engine::{ops, EngineError, Tensor};
use serde::Deserialize;
use serde_json::Value;

use crate::cache::{Cache, LayerCache};
use crate::checkpoint::{Checkpoint, Scope};
use crate::decoder_grad::{Decoder, DecoderBlock};
use crate::layers::{
    linear_shape, load_host_vector, Attention, Embedding, Linear, OpResult, OutputHead, RmsNorm,
    Rope,
};
use crate::lora::{Adaptable, LinearShape, ModuleAdapters, PassAdapters};
use crate::mamba2::{caches_fit, CachedMixer, Mamba2Args, Mamba2Mixer, Mamba2Names};
use crate::pass::{Architecture, LayerCaches, PassCaches};
use crate::switch::{by_expert, dispatch, load_stacked, route, Routing};
use crate::{ForwardError, LoadError, ModelInfo};

/// `config.json`'s keys, with mlx-lm's defaults.
#[derive(Deserialize)]
struct Args {
    vocab_size: usize,
    hidden_size: usize,
    intermediate_size: usize,
    max_position_embeddings: Option<usize>,
    num_attention_heads: usize,
    num_key_value_heads: usize,
    #[serde(default)]
    attention_bias: bool,
    mamba_num_heads: usize,
    mamba_head_dim: usize,
    #[serde(default)]
    mamba_proj_bias: bool,
    ssm_state_size: usize,
    conv_kernel: usize,
    n_groups: usize,
    #[serde(default)]
    mlp_bias: bool,
    layer_norm_epsilon: f32,
    #[serde(default)]
    use_conv_bias: bool,
    /// A string of block characters, or a list of them.
    hybrid_override_pattern: Option<Value>,
    layers_block_type: Option<Vec<String>>,
    layer_types: Option<Vec<String>>,
    head_dim: Option<usize>,
    time_step_limit: Option<(f64, f64)>,
    moe_intermediate_size: Option<usize>,
    moe_shared_expert_intermediate_size: Option<usize>,
    moe_latent_size: Option<usize>,
    n_group: Option<usize>,
    n_routed_experts: Option<usize>,
    n_shared_experts: Option<usize>,
    topk_group: Option<usize>,
    num_experts_per_tok: Option<usize>,
    #[serde(default)]
    norm_topk_prob: bool,
    routed_scaling_factor: Option<f32>,
}

impl Args {
    /// Each block's character, from the pattern or from the named block types as mlx-lm maps
    /// them.
    fn pattern(&self) -> Result<Vec<char>, LoadError> {
        if let Some(pattern) = &self.hybrid_override_pattern {
            let chars: Option<Vec<char>> = match pattern {
                Value::String(s) => Some(s.chars().collect()),
                Value::Array(items) => items
                    .iter()
                    .map(|c| c.as_str().and_then(|s| s.chars().next()))
                    .collect(),
                _ => None,
            };
            return chars.ok_or_else(|| {
                LoadError::Config(format!(
                    "`hybrid_override_pattern` must be a string or a list of characters, not \
                     {pattern}"
                ))
            });
        }
        let types = self
            .layers_block_type
            .as_ref()
            .or(self.layer_types.as_ref())
            .ok_or_else(|| {
                LoadError::Config(
                    "the config names no blocks (`hybrid_override_pattern` or \
                     `layers_block_type`)"
                        .into(),
                )
            })?;
        types
            .iter()
            .map(|t| match t.as_str() {
                "full_attention" | "attention" => Ok('*'),
                "linear_attention" | "mamba" | "conv" => Ok('M'),
                "moe" => Ok('E'),
                "mlp" => Ok('-'),
                other => Err(LoadError::Config(format!(
                    "block type `{other}` (supported: mamba, attention, mlp)"
                ))),
            })
            .collect()
    }
}

const MIXER: Mamba2Names = Mamba2Names {
    module: "mixer",
    keys: ["mixer.in_proj", "mixer.out_proj"],
};

/// The MLP of a `-` block, and each expert of an `E` block.
struct ReluSquaredMlp {
    up_proj: Linear,
    down_proj: Linear,
}

impl ReluSquaredMlp {
    fn load(vb: &mut Scope, dim: usize, width: usize, bias: bool) -> Result<Self, LoadError> {
        Ok(ReluSquaredMlp {
            up_proj: Linear::load(&mut vb.pp("up_proj"), dim, width, bias)?,
            down_proj: Linear::load(&mut vb.pp("down_proj"), width, dim, bias)?,
        })
    }

    fn forward(&self, x: &Tensor, lora: ModuleAdapters) -> OpResult<Tensor> {
        let mut h = self.up_proj.forward_adapted(x, lora.get("up_proj"))?;
        ops::relu_squared_inplace(&mut h)?;
        self.down_proj.forward_adapted(&h, lora.get("down_proj"))
    }
}

/// An `E` block's mixture (mlx-lm's `NemotronHMoE`).
struct Moe {
    /// `gate.weight`, `[experts, hidden]`, as a layer.
    router: Linear,
    correction_bias: Vec<f32>,
    routing: Routing,
    /// `switch_mlp`'s `fc1` and `fc2` per expert.
    experts: Vec<ReluSquaredMlp>,
    /// `fc1_latent_proj` and `fc2_latent_proj`: into the experts' latent space and out of it.
    latent: Option<(Linear, Linear)>,
    shared: Option<ReluSquaredMlp>,
}

impl Moe {
    fn load(vb: &mut Scope, c: &Args) -> Result<Self, LoadError> {
        let need = |v: Option<usize>, key: &str| {
            v.ok_or_else(|| LoadError::Config(format!("`{key}` is missing")))
        };
        let (h, bias) = (c.hidden_size, c.mlp_bias);
        let experts = need(c.n_routed_experts, "n_routed_experts")?;
        let width = need(c.moe_intermediate_size, "moe_intermediate_size")?;
        let routing = Routing::new(
            experts,
            need(c.num_experts_per_tok, "num_experts_per_tok")?,
            c.norm_topk_prob,
        )?
        .sigmoid_grouped(
            c.n_group.unwrap_or(1),
            c.topk_group.unwrap_or(1),
            c.routed_scaling_factor.unwrap_or(1.0),
        )?;
        let inner = c.moe_latent_size.unwrap_or(h);
        let latent = c
            .moe_latent_size
            .map(|l| {
                Ok::<_, LoadError>((
                    Linear::load(&mut vb.pp("fc1_latent_proj"), h, l, bias)?,
                    Linear::load(&mut vb.pp("fc2_latent_proj"), l, h, bias)?,
                ))
            })
            .transpose()?;
        let fc1 = load_stacked(&mut vb.pp("switch_mlp.fc1"), experts, width, inner)?;
        let fc2 = load_stacked(&mut vb.pp("switch_mlp.fc2"), experts, inner, width)?;
        let unbiased = |weight| Linear { weight, bias: None };
        let shared = match c.n_shared_experts {
            Some(n) if n > 0 => {
                let key = "moe_shared_expert_intermediate_size";
                let width = need(c.moe_shared_expert_intermediate_size, key)?;
                Some(ReluSquaredMlp::load(
                    &mut vb.pp("shared_experts"),
                    h,
                    width,
                    bias,
                )?)
            }
            _ => None,
        };
        let mut gate = vb.pp("gate");
        Ok(Moe {
            correction_bias: load_host_vector(&mut gate, "e_score_correction_bias", experts)?,
            router: Linear::load(&mut gate, h, experts, false)?,
            routing,
            experts: fc1
                .into_iter()
                .zip(fc2)
                .map(|(up, down)| ReluSquaredMlp {
                    up_proj: unbiased(up),
                    down_proj: unbiased(down),
                })
                .collect(),
            latent,
            shared,
        })
    }

    /// Its output for the rows `x`, with the adapters `lora` gives for each module of the block
    /// (`mixer`, `mixer.shared_experts`). The routing is decided on the host from the router's
    /// logits; each expert runs once on its tokens.
    fn forward<'a>(
        &self,
        x: &Tensor,
        lora: impl Fn(&'static str) -> ModuleAdapters<'a>,
    ) -> OpResult<Tensor> {
        let mixer = lora("mixer");
        let mut scores = self.router.forward(x)?.into_vec()?;
        let chosen = route(&self.routing, Some(&self.correction_bias), &mut scores);
        let routed = by_expert(&chosen, self.routing.top_k(), self.experts.len());
        let inner = match &self.latent {
            Some((into, _)) => Cow::Owned(into.forward_adapted(x, mixer.get("fc1_latent_proj"))?),
            None => Cow::Borrowed(x),
        };
        // The experts take no adapters (their layers are not among the block's linears).
        let mut y = dispatch(&inner, &routed, |e, rows| {
            self.experts[e].forward(rows, ModuleAdapters::NONE)
        })?;
        if let Some((_, out_of)) = &self.latent {
            y = out_of.forward_adapted(&y, mixer.get("fc2_latent_proj"))?;
        }
        if let Some(shared) = &self.shared {
            let out = shared.forward(x, lora("mixer.shared_experts"))?;
            ops::add_inplace(&mut y, &out)?;
        }
        Ok(y)
    }

    fn linears(&self) -> Vec<LinearShape> {
        let mut out = vec![];
        if let Some((into, out_of)) = &self.latent {
            out.push(linear_shape("mixer.fc1_latent_proj", into));
            out.push(linear_shape("mixer.fc2_latent_proj", out_of));
        }
        if let Some(shared) = &self.shared {
            out.push(linear_shape(
                "mixer.shared_experts.up_proj",
                &shared.up_proj,
            ));
            out.push(linear_shape(
                "mixer.shared_experts.down_proj",
                &shared.down_proj,
            ));
        }
        out
    }
}

// One per layer, held in a Vec: the variants' sizes do not matter.
#[allow(clippy::large_enum_variant)]
enum Mixer {
    Mamba(Mamba2Mixer),
    Attention(Attention),
    Mlp(ReluSquaredMlp),
    Moe(Moe),
}

struct Block {
    norm: RmsNorm,
    mixer: Mixer,
}

impl Block {
    fn linears(&self) -> Vec<LinearShape> {
        match &self.mixer {
            Mixer::Mamba(m) => m.linears(),
            Mixer::Attention(a) => a.linears_named([
                "mixer.q_proj",
                "mixer.k_proj",
                "mixer.v_proj",
                "mixer.o_proj",
            ]),
            Mixer::Mlp(mlp) => vec![
                linear_shape("mixer.up_proj", &mlp.up_proj),
                linear_shape("mixer.down_proj", &mlp.down_proj),
            ],
            Mixer::Moe(moe) => moe.linears(),
        }
    }
}

pub struct NemotronH {
    info: ModelInfo,
    embeddings: Embedding,
    layers: Vec<Block>,
    head: OutputHead,
}

impl NemotronH {
    pub fn load(mut ckpt: Checkpoint) -> Result<Self, LoadError> {
        let model_type = ckpt.config.model_type()?.to_string();
        let c: Args = ckpt.config.args()?;
        let pattern = c.pattern()?;
        let (h, eps) = (c.hidden_size, c.layer_norm_epsilon);
        let (heads, kv_heads) = (c.num_attention_heads, c.num_key_value_heads);
        if heads == 0 || kv_heads == 0 || !heads.is_multiple_of(kv_heads) {
            return Err(LoadError::Config(format!(
                "{heads} attention heads cannot be grouped over {kv_heads} key/value heads"
            )));
        }
        let head_dim = c.head_dim.unwrap_or(h / heads);
        let device = ckpt.device.clone();
        let (lo, hi) = c.time_step_limit.unwrap_or((0.0, f64::INFINITY));
        let mamba = Mamba2Args {
            hidden: h,
            heads: c.mamba_num_heads,
            head_dim: c.mamba_head_dim,
            groups: c.n_groups,
            state: c.ssm_state_size,
            conv_kernel: c.conv_kernel,
            conv_bias: c.use_conv_bias,
            proj_bias: c.mamba_proj_bias,
            norm_groups: c.n_groups,
            eps,
            time_step_limit: (lo as f32, hi as f32),
        };
        // Multi-token prediction heads, which mlx-lm's `sanitize` drops.
        ckpt.discard_where(|name| name.starts_with("mtp."));
        let mut root = ckpt.scope("");
        let mut backbone = root.pp("backbone");
        let embeddings = Embedding::load(&mut backbone.pp("embeddings"), c.vocab_size, h)?;
        let mut layers = Vec::with_capacity(pattern.len());
        for (i, &kind) in pattern.iter().enumerate() {
            let mut block = backbone.pp(format_args!("layers.{i}"));
            let mixer = match kind {
                'M' => Mixer::Mamba(Mamba2Mixer::load(&mut block, mamba, MIXER)?),
                '*' => {
                    let vb = &mut block.pp("mixer");
                    let (q_width, kv_width) = (heads * head_dim, kv_heads * head_dim);
                    let bias = c.attention_bias;
                    Mixer::Attention(Attention {
                        q_proj: Linear::load(&mut vb.pp("q_proj"), h, q_width, bias)?,
                        k_proj: Linear::load(&mut vb.pp("k_proj"), h, kv_width, bias)?,
                        v_proj: Linear::load(&mut vb.pp("v_proj"), h, kv_width, bias)?,
                        o_proj: Linear::load(&mut vb.pp("o_proj"), q_width, h, bias)?,
                        q_norm: None,
                        k_norm: None,
                        rope: Rope::none(head_dim, &device)?,
                        heads,
                        kv_heads,
                        head_dim,
                        scale: (head_dim as f32).powf(-0.5),
                        query_scale: None,
                        norm_after_rope: false,
                        softcap: None,
                        sinks: None,
                        chunk: None,
                    })
                }
                '-' => Mixer::Mlp(ReluSquaredMlp::load(
                    &mut block.pp("mixer"),
                    h,
                    c.intermediate_size,
                    c.mlp_bias,
                )?),
                'E' => Mixer::Moe(Moe::load(&mut block.pp("mixer"), &c)?),
                other => {
                    return Err(LoadError::Config(format!(
                        "block `{other}` in `hybrid_override_pattern` (supported: M, *, -, E)"
                    )))
                }
            };
            layers.push(Block {
                norm: RmsNorm::load(&mut block.pp("norm"), h, eps)?,
                mixer,
            });
        }
        let norm = RmsNorm::load(&mut backbone.pp("norm_f"), h, eps)?;
        let lm_head = Linear::load(&mut root.pp("lm_head"), h, c.vocab_size, false)?;
        ckpt.finish()?;
        Ok(NemotronH {
            info: ModelInfo {
                model_type,
                vocab_size: c.vocab_size,
                hidden_size: h,
                num_layers: pattern.len(),
                max_context: c.max_position_embeddings,
                device,
            },
            embeddings,
            layers,
            head: OutputHead {
                norm,
                lm_head: Some(lm_head),
                softcap: None,
            },
        })
    }

    /// The blocks that keep caches, in order, as their caches are made and checked.
    fn cached(&self) -> impl Iterator<Item = CachedMixer<'_>> + Clone {
        self.layers.iter().filter_map(|b| match &b.mixer {
            Mixer::Mamba(m) => Some(CachedMixer::Mamba(m)),
            Mixer::Attention(a) => Some(CachedMixer::Attention(a)),
            Mixer::Mlp(_) | Mixer::Moe(_) => None,
        })
    }
}

impl Architecture for NemotronH {
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
            PassCaches::fitting(&self.info, tokens, caches, self.cached().count(), |c| {
                caches_fit(self.cached(), c)
            })?;
        let mut h = self.embeddings.forward(tokens)?;
        let mut cache_layer = 0;
        for (i, block) in self.layers.iter().enumerate() {
            let modules = |module| adapters.map_or(ModuleAdapters::NONE, |a| a.module(i, module));
            let lora = modules("mixer");
            let x = block.norm.forward(&h)?;
            let r = match &block.mixer {
                Mixer::Mlp(mlp) => mlp.forward(&x, lora)?,
                Mixer::Moe(moe) => moe.forward(&x, modules)?,
                mixer => {
                    let layer = caches.layer(cache_layer)?;
                    cache_layer += 1;
                    match (mixer, layer) {
                        (Mixer::Mamba(m), LayerCaches::Recurrent(mut c)) => {
                            m.forward(&x, &mut c, lora)?
                        }
                        (Mixer::Attention(a), LayerCaches::Kv(mut c)) => {
                            a.forward(&x, &positions, &mut c, lora)?
                        }
                        _ => return Err(ForwardError::CacheMismatch),
                    }
                }
            };
            ops::add_inplace(&mut h, &r)?;
        }
        caches.finish();
        Ok(h)
    }

    fn output(&self) -> (&OutputHead, &Embedding) {
        (&self.head, &self.embeddings)
    }
}

impl Adaptable for NemotronH {
    fn block_linears(&self) -> Vec<Vec<LinearShape>> {
        self.layers.iter().map(Block::linears).collect()
    }

    fn decoder(&self) -> &dyn Decoder {
        self
    }

    fn blocks_path(&self) -> &'static str {
        "backbone.layers"
    }
}

impl Decoder for NemotronH {
    fn embed(&self, tokens: &[u32]) -> OpResult<Tensor> {
        self.embeddings.forward(tokens)
    }

    fn blocks(&self, _tokens: &[u32]) -> OpResult<Vec<DecoderBlock<'_>>> {
        Err(EngineError::Unsupported(
            "LoRA training through Mamba-2 layers".into(),
        ))
    }
}
