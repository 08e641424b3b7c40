//! Gemma 3 as mlx-lm's `gemma3_text.py` defines it, and the text part of the multimodal
//! `gemma3` wrapper (`gemma3.py`): settings under `text_config`, weights under `language_model.`.
//!
//! Gemma's departures from llama: embeddings scaled by √hidden, RMSNorm by `1 + weight`, q/k norms,
//! GeGLU feed-forward, norms after attention and MLP as well as before, `query_pre_attn_scalar`,
//! and every `sliding_window_pattern`-th layer global, the others sliding-window layers with their
//! own RoPE base and a ring cache.

use half::bf16;
use serde::Deserialize;
use serde_json::{Map, Value};

use crate::cache::{Cache, KvCache, LayerCache, RotatingKvCache};
use crate::checkpoint::{Checkpoint, Config};
use crate::decoder_grad::{AttentionGrad, Decoder, DecoderBlock, GatedMlpGrad};
use crate::layers::{Attention, Embedding, Linear, Mlp, OpResult, OutputHead, RmsNorm, Rope};
use crate::lora::{Adaptable, LinearShape, ModuleAdapters, PassAdapters};
use crate::pass::{Architecture, LayerCaches, PassCaches};
use crate::{ForwardError, LoadError, ModelInfo};
use oxlm_engine::{ops, EngineError, Positions, Tensor};

/// `config.json`'s keys for Gemma 3's text model, with mlx-lm's `ModelArgs` defaults for the
/// absent or null ones.
#[derive(Deserialize)]
#[serde(default)]
struct Gemma3Config {
    hidden_size: usize,
    num_hidden_layers: usize,
    intermediate_size: usize,
    num_attention_heads: usize,
    head_dim: usize,
    rms_norm_eps: f32,
    vocab_size: usize,
    num_key_value_heads: usize,
    rope_theta: f32,
    rope_local_base_freq: f32,
    query_pre_attn_scalar: f64,
    sliding_window: usize,
    /// Every this many layers one attends globally; the others through the window.
    sliding_window_pattern: usize,
    max_position_embeddings: usize,
    rope_scaling: Option<Value>,
}

impl Default for Gemma3Config {
    fn default() -> Self {
        Gemma3Config {
            hidden_size: 1152,
            num_hidden_layers: 26,
            intermediate_size: 6912,
            num_attention_heads: 4,
            head_dim: 256,
            rms_norm_eps: 1e-6,
            vocab_size: 262144,
            num_key_value_heads: 1,
            rope_theta: 1_000_000.0,
            rope_local_base_freq: 10_000.0,
            query_pre_attn_scalar: 256.0,
            sliding_window: 512,
            sliding_window_pattern: 6,
            max_position_embeddings: 32768,
            rope_scaling: None,
        }
    }
}

/// The text model's settings inside a multimodal wrapper, completed as the wrapper's `ModelArgs`
/// does: the wrapper's `vocab_size` (or `vocab_default`) replaces the nested one, and the head
/// counts get the wrapper's defaults.
pub(crate) fn wrapped_text_config(
    config: &Config,
    vocab_default: usize,
    heads_default: usize,
    kv_heads_default: usize,
) -> Result<Config, LoadError> {
    let mut text = match config.top_level("text_config") {
        Some(Value::Object(text)) => text.clone(),
        _ => Map::new(),
    };
    let vocab = match config.top_level("vocab_size") {
        Some(v) => v.clone(),
        None => vocab_default.into(),
    };
    text.insert("vocab_size".into(), vocab);
    for (key, default) in [
        ("num_attention_heads", heads_default),
        ("num_key_value_heads", kv_heads_default),
    ] {
        text.entry(key).or_insert(default.into());
    }
    Config::from_value(Value::Object(text))
}

struct Block {
    input_layernorm: RmsNorm,
    self_attn: Attention,
    post_attention_layernorm: RmsNorm,
    pre_feedforward_layernorm: RmsNorm,
    mlp: Mlp,
    post_feedforward_layernorm: RmsNorm,
    /// A sliding-window layer (else global).
    sliding: bool,
}

impl Block {
    /// Attention over this layer's caches, plain for a global layer, rings for a sliding one,
    /// with the projections `lora` names adapted.
    fn attention(
        &self,
        x: &Tensor,
        positions: &Positions,
        caches: LayerCaches,
        lora: ModuleAdapters,
    ) -> Result<Tensor, ForwardError> {
        let shape = (self.self_attn.kv_heads, self.self_attn.head_dim);
        let fits = |s: (usize, usize)| s == shape;
        match caches {
            LayerCaches::Kv(mut kvs) if !self.sliding && kvs.iter().all(|c| fits(c.shape())) => {
                Ok(self.self_attn.forward(x, positions, &mut kvs, lora)?)
            }
            LayerCaches::Rotating(mut rings)
                if self.sliding && rings.iter().all(|c| fits(c.shape())) =>
            {
                Ok(self.self_attn.forward(x, positions, &mut rings, lora)?)
            }
            _ => Err(ForwardError::CacheMismatch),
        }
    }
}

pub struct Gemma3 {
    info: ModelInfo,
    embed_tokens: Embedding,
    /// √hidden rounded to bf16, as mlx-lm multiplies it in.
    embed_scale: f32,
    layers: Vec<Block>,
    head: OutputHead,
    sliding_window: usize,
}

impl Gemma3 {
    pub fn load(mut ckpt: Checkpoint) -> Result<Self, LoadError> {
        let model_type = ckpt.config.model_type()?.to_string();
        let (cfg, prefix) = if model_type == "gemma3" {
            ckpt.discard_where(|name| {
                name.starts_with("vision_tower.") || name.starts_with("multi_modal_projector.")
            });
            (
                wrapped_text_config(&ckpt.config, 262208, 8, 4)?,
                "language_model.",
            )
        } else {
            (ckpt.config.clone(), "")
        };
        let c: Gemma3Config = cfg.args()?;
        let (hidden, layers, intermediate) =
            (c.hidden_size, c.num_hidden_layers, c.intermediate_size);
        let (heads, kv_heads, head_dim) =
            (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
        let (eps, vocab, max_context) = (c.rms_norm_eps, c.vocab_size, c.max_position_embeddings);
        let (rope_theta, rope_local_base) = (c.rope_theta, c.rope_local_base_freq);
        let query_pre_attn_scalar = c.query_pre_attn_scalar;
        let (sliding_window, pattern) = (c.sliding_window, c.sliding_window_pattern);
        let scaling = c.rope_scaling;
        if heads == 0 || kv_heads == 0 || !heads.is_multiple_of(kv_heads) {
            return Err(LoadError::Config(format!(
                "{heads} attention heads cannot be grouped over {kv_heads} key/value heads"
            )));
        }
        if pattern == 0 || sliding_window == 0 {
            return Err(LoadError::Config(
                "`sliding_window` and `sliding_window_pattern` must be positive".into(),
            ));
        }
        let device = ckpt.device.clone();
        let context = Some(max_context);
        let local_rope = Rope::new(head_dim, rope_local_base, false, None, context, &device)?;
        let global_rope = Rope::new(
            head_dim,
            rope_theta,
            false,
            scaling.as_ref(),
            context,
            &device,
        )?;

        let mut root = ckpt.scope(prefix.trim_end_matches('.'));
        let mut model = root.pp("model");
        let embed_tokens = Embedding::load(&mut model.pp("embed_tokens"), vocab, hidden)?;
        let mut blocks = Vec::new();
        for i in 0..layers {
            let mut block = model.pp(format_args!("layers.{i}"));
            let mut a = block.pp("self_attn");
            let sliding = (i + 1) % pattern != 0;
            let (q_width, kv_width) = (heads * head_dim, kv_heads * head_dim);
            let self_attn = Attention {
                q_proj: Linear::load(&mut a.pp("q_proj"), hidden, q_width, false)?,
                k_proj: Linear::load(&mut a.pp("k_proj"), hidden, kv_width, false)?,
                v_proj: Linear::load(&mut a.pp("v_proj"), hidden, kv_width, false)?,
                o_proj: Linear::load(&mut a.pp("o_proj"), q_width, hidden, false)?,
                q_norm: Some(RmsNorm::load_plus_one(&mut a.pp("q_norm"), head_dim, eps)?),
                k_norm: Some(RmsNorm::load_plus_one(&mut a.pp("k_norm"), head_dim, eps)?),
                rope: if sliding {
                    local_rope.clone()
                } else {
                    global_rope.clone()
                },
                heads,
                kv_heads,
                head_dim,
                scale: query_pre_attn_scalar.powf(-0.5) as f32,
                query_scale: None,
                norm_after_rope: false,
                softcap: None,
                sinks: None,
                chunk: None,
            };
            let mut norm = |name: &str| RmsNorm::load_plus_one(&mut block.pp(name), hidden, eps);
            let input_layernorm = norm("input_layernorm")?;
            let post_attention_layernorm = norm("post_attention_layernorm")?;
            let pre_feedforward_layernorm = norm("pre_feedforward_layernorm")?;
            let post_feedforward_layernorm = norm("post_feedforward_layernorm")?;
            blocks.push(Block {
                input_layernorm,
                self_attn,
                post_attention_layernorm,
                pre_feedforward_layernorm,
                mlp: Mlp::load(&mut block.pp("mlp"), hidden, intermediate, false)?,
                post_feedforward_layernorm,
                sliding,
            });
        }
        let norm = RmsNorm::load_plus_one(&mut model.pp("norm"), hidden, eps)?;
        // As mlx-lm's `sanitize`: the head is tied exactly when the checkpoint has none.
        let lm_head = root
            .contains("lm_head.weight")
            .then(|| Linear::load(&mut root.pp("lm_head"), hidden, vocab, false))
            .transpose()?;
        ckpt.finish()?;
        Ok(Gemma3 {
            info: ModelInfo {
                model_type,
                vocab_size: vocab,
                hidden_size: hidden,
                num_layers: layers,
                max_context: Some(max_context),
                device,
            },
            embed_tokens,
            embed_scale: bf16::from_f32((hidden as f64).sqrt() as f32).to_f32(),
            layers: blocks,
            head: OutputHead {
                norm,
                lm_head,
                softcap: None,
            },
            sliding_window,
        })
    }
}

impl Architecture for Gemma3 {
    fn info(&self) -> &ModelInfo {
        &self.info
    }

    fn layer_caches(&self) -> Result<Vec<LayerCache>, EngineError> {
        let device = &self.info.device;
        self.layers
            .iter()
            .map(|b| {
                let (kv_heads, head_dim) = (b.self_attn.kv_heads, b.self_attn.head_dim);
                Ok(if b.sliding {
                    LayerCache::Rotating(RotatingKvCache::new(
                        kv_heads,
                        head_dim,
                        self.sliding_window,
                        device,
                    )?)
                } else {
                    LayerCache::Kv(KvCache::new(kv_heads, head_dim, device)?)
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
            PassCaches::new(&self.info, tokens, caches, self.layers.len())?;
        let mut h = self.embed(tokens)?;
        for (i, block) in self.layers.iter().enumerate() {
            let lora = |module| adapters.map_or(ModuleAdapters::NONE, |a| a.module(i, module));
            let x = block.input_layernorm.forward(&h)?;
            let mut r = block.attention(&x, &positions, caches.layer(i)?, lora("self_attn"))?;
            block.post_attention_layernorm.forward_inplace(&mut r)?;
            ops::add_inplace(&mut h, &r)?;
            let x = block.pre_feedforward_layernorm.forward(&h)?;
            let mut r = block.mlp.forward_geglu(&x, lora("mlp"))?;
            block.post_feedforward_layernorm.forward_inplace(&mut r)?;
            ops::add_inplace(&mut h, &r)?;
        }
        caches.finish();
        Ok(h)
    }

    fn output(&self) -> (&OutputHead, &Embedding) {
        (&self.head, &self.embed_tokens)
    }
}

impl Adaptable for Gemma3 {
    /// mlx-lm's multimodal `gemma3` nests the text model under `language_model`.
    fn blocks_path(&self) -> &'static str {
        match self.info.model_type.as_str() {
            "gemma3" => "language_model.model.layers",
            _ => "model.layers",
        }
    }

    fn block_linears(&self) -> Vec<Vec<LinearShape>> {
        let blocks = self.layers.iter();
        blocks
            .map(|b| [b.self_attn.linears(), b.mlp.linears()].concat())
            .collect()
    }

    fn decoder(&self) -> &dyn Decoder {
        self
    }
}

impl Decoder for Gemma3 {
    fn embed(&self, tokens: &[u32]) -> OpResult<Tensor> {
        let mut h = self.embed_tokens.forward(tokens)?;
        ops::scale_inplace(&mut h, self.embed_scale)?;
        Ok(h)
    }

    fn blocks(&self, _tokens: &[u32]) -> OpResult<Vec<DecoderBlock<'_>>> {
        let blocks = self.layers.iter();
        Ok(blocks
            .map(|b| DecoderBlock {
                input_norm: Some(&b.input_layernorm),
                mixer: Box::new(AttentionGrad {
                    attn: &b.self_attn,
                    window: b.sliding.then_some(self.sliding_window),
                }),
                mixer_out_norm: Some(&b.post_attention_layernorm),
                mlp_norm: Some(&b.pre_feedforward_layernorm),
                mlp: Box::new(GatedMlpGrad {
                    mlp: &b.mlp,
                    activation: ops::Activation::GeluApprox,
                }),
                mlp_out_norm: Some(&b.post_feedforward_layernorm),
                tail: None,
                output_scale: 1.0,
                branch_scale: 1.0,
            })
            .collect())
    }
}
