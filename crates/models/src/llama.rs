//! The llama family as mlx-lm's `llama.py`, `qwen2.py` and `qwen3.py` define it: Llama 2/3
//! (with llama3 RoPE scaling), Mistral, SmolLM, Qwen2 (q/k/v biases) and Qwen3 (q/k RMSNorm).

use serde::Deserialize;
use serde_json::Value;

use crate::cache::{Cache, KvCache, LayerCache};
use crate::checkpoint::{Checkpoint, Scope};
use crate::decoder_grad::{AttentionGrad, Decoder, DecoderBlock, GatedMlpGrad};
use crate::layers::{
    Attention, Embedding, Input, Linear, Mlp, OpResult, OutputHead, RmsNorm, Rope,
};
use crate::lora::{Adaptable, Adapters, LinearShape, ModuleAdapters};
use crate::pass::{Architecture, LayerCaches, PassCaches};
use crate::{LoadError, ModelInfo};
use oxlm_engine::{ops, EngineError, Tensor};

use crate::ForwardError;

struct Block {
    input_layernorm: RmsNorm,
    self_attn: Attention,
    post_attention_layernorm: RmsNorm,
    mlp: Mlp,
}

pub struct Llama {
    info: ModelInfo,
    embed_tokens: Embedding,
    layers: Vec<Block>,
    head: OutputHead,
}

/// `config.json`'s keys for this family, as mlx-lm's `ModelArgs` reads them (absent or null
/// keys take the defaults noted; [`Llama::load`] derives the rest).
#[derive(Deserialize)]
struct LlamaConfig {
    hidden_size: usize,
    num_hidden_layers: usize,
    intermediate_size: usize,
    num_attention_heads: usize,
    /// `num_attention_heads` when absent.
    num_key_value_heads: Option<usize>,
    /// `hidden_size / num_attention_heads` when absent.
    head_dim: Option<usize>,
    vocab_size: usize,
    rms_norm_eps: f32,
    /// Tied when absent, but for qwen3.
    tie_word_embeddings: Option<bool>,
    max_position_embeddings: Option<usize>,
    /// `rope_parameters.rope_theta`, else 10000, when absent.
    rope_theta: Option<f32>,
    rope_scaling: Option<Value>,
    /// transformers ≥ 5 nests `rope_theta` and the scaling here.
    rope_parameters: Option<Value>,
    #[serde(default)]
    rope_traditional: bool,
    layer_types: Option<Vec<String>>,
    /// Llama's and Mistral's switches; qwen2 always has q/k/v biases, and neither qwen has
    /// MLP biases.
    #[serde(default)]
    attention_bias: bool,
    #[serde(default)]
    mlp_bias: bool,
}

impl Llama {
    pub fn load(mut ckpt: Checkpoint) -> Result<Self, LoadError> {
        let model_type = ckpt.config.model_type()?.to_string();
        let c: LlamaConfig = ckpt.config.args()?;
        let (qkv_bias, qk_norm, mlp_bias) = match model_type.as_str() {
            "qwen2" => (true, false, false),
            "qwen3" => (false, true, false),
            _ => (c.attention_bias, false, c.mlp_bias),
        };
        let (hidden, layers, intermediate) =
            (c.hidden_size, c.num_hidden_layers, c.intermediate_size);
        let heads = c.num_attention_heads;
        let kv_heads = c.num_key_value_heads.unwrap_or(heads);
        let head_dim = c.head_dim.unwrap_or(hidden / heads.max(1));
        let (vocab, eps) = (c.vocab_size, c.rms_norm_eps);
        // Embedding checkpoints saved as a bare `Qwen3Model` (Qwen3-Embedding-8B, which is untied)
        // have no head: their hidden states are what they are for, so the embeddings stand in.
        let tied = c.tie_word_embeddings.unwrap_or(model_type != "qwen3")
            || !ckpt.contains("lm_head.weight");
        let max_context = c.max_position_embeddings;
        let rope_theta = c.rope_theta.unwrap_or_else(|| {
            c.rope_parameters
                .as_ref()
                .and_then(|p| p.get("rope_theta"))
                .and_then(Value::as_f64)
                .unwrap_or(10000.0) as f32
        });
        let scaling = c.rope_scaling.or(c.rope_parameters);
        let traditional = c.rope_traditional;
        if let Some(types) = &c.layer_types {
            if types.iter().any(|t| t != "full_attention") {
                return Err(LoadError::Config(
                    "sliding-window llama layers are not supported yet".into(),
                ));
            }
        }
        if heads == 0 || kv_heads == 0 || !heads.is_multiple_of(kv_heads) {
            return Err(LoadError::Config(format!(
                "{heads} attention heads cannot be grouped over {kv_heads} key/value heads"
            )));
        }
        let rope = Rope::new(
            head_dim,
            rope_theta,
            traditional,
            scaling.as_ref(),
            &ckpt.device,
        )?;
        ckpt.discard_where(|name| name.contains("self_attn.rotary_emb.inv_freq"));
        if tied {
            ckpt.discard_where(|name| name.starts_with("lm_head."));
        }

        let mut root = ckpt.scope("");
        let mut model = root.pp("model");
        let embed_tokens = Embedding::load(&mut model.pp("embed_tokens"), vocab, hidden)?;
        let mut blocks = Vec::new();
        for i in 0..layers {
            let mut block = model.pp(format_args!("layers.{i}"));
            let mut a = block.pp("self_attn");
            let q_k_norm = |a: &mut Scope, which: &str| {
                qk_norm
                    .then(|| RmsNorm::load(&mut a.pp(which), head_dim, eps))
                    .transpose()
            };
            let (q_width, kv_width) = (heads * head_dim, kv_heads * head_dim);
            let self_attn = Attention {
                q_proj: Linear::load(&mut a.pp("q_proj"), hidden, q_width, qkv_bias)?,
                k_proj: Linear::load(&mut a.pp("k_proj"), hidden, kv_width, qkv_bias)?,
                v_proj: Linear::load(&mut a.pp("v_proj"), hidden, kv_width, qkv_bias)?,
                o_proj: Linear::load(&mut a.pp("o_proj"), q_width, hidden, false)?,
                q_norm: q_k_norm(&mut a, "q_norm")?,
                k_norm: q_k_norm(&mut a, "k_norm")?,
                rope: rope.clone(),
                heads,
                kv_heads,
                head_dim,
                scale: (head_dim as f32).powf(-0.5),
            };
            blocks.push(Block {
                input_layernorm: RmsNorm::load(&mut block.pp("input_layernorm"), hidden, eps)?,
                self_attn,
                post_attention_layernorm: RmsNorm::load(
                    &mut block.pp("post_attention_layernorm"),
                    hidden,
                    eps,
                )?,
                mlp: Mlp::load(&mut block.pp("mlp"), hidden, intermediate, mlp_bias)?,
            });
        }
        let norm = RmsNorm::load(&mut model.pp("norm"), hidden, eps)?;
        let lm_head = (!tied)
            .then(|| Linear::load(&mut root.pp("lm_head"), hidden, vocab, false))
            .transpose()?;
        let device = ckpt.device.clone();
        ckpt.finish()?;
        Ok(Llama {
            info: ModelInfo {
                model_type,
                vocab_size: vocab,
                hidden_size: hidden,
                num_layers: layers,
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
}

impl Architecture for Llama {
    fn info(&self) -> &ModelInfo {
        &self.info
    }

    fn layer_caches(&self) -> Result<Vec<LayerCache>, EngineError> {
        let device = &self.info.device;
        self.layers
            .iter()
            .map(|b| {
                let a = &b.self_attn;
                Ok(LayerCache::Kv(KvCache::new(
                    a.kv_heads, a.head_dim, device,
                )?))
            })
            .collect()
    }

    fn hidden_states(
        &self,
        tokens: &[u32],
        caches: &mut [&mut Cache],
        adapters: Option<&Adapters>,
    ) -> Result<Tensor, ForwardError> {
        let (mut caches, positions) =
            PassCaches::new(&self.info, tokens, caches, self.layers.len())?;
        let mut h = self.embed_tokens.forward(tokens)?;
        for (i, block) in self.layers.iter().enumerate() {
            let LayerCaches::Kv(mut kvs) = caches.layer(i)? else {
                return Err(ForwardError::CacheMismatch);
            };
            let lora = |module| adapters.map_or(ModuleAdapters::NONE, |a| a.module(i, module));
            let (attn, mlp) = (&block.self_attn, &block.mlp);
            // The norms are folded into the projections where the device can.
            let (attn_lora, mlp_lora) = (lora("self_attn"), lora("mlp"));
            let normed = Input::Normed(&h, &block.input_layernorm);
            let out = attn.attend(normed, &positions, &mut kvs, attn_lora)?;
            attn.o_proj
                .add_forward(&out, attn_lora.get("o_proj"), &mut h)?;
            let normed = Input::Normed(&h, &block.post_attention_layernorm);
            let act = mlp.gated(normed, mlp_lora, ops::Activation::Silu)?;
            mlp.down_proj
                .add_forward(&act, mlp_lora.get("down_proj"), &mut h)?;
        }
        caches.finish();
        Ok(h)
    }

    fn output(&self) -> (&OutputHead, &Embedding) {
        (&self.head, &self.embed_tokens)
    }
}

impl Adaptable for Llama {
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

impl Decoder for Llama {
    fn embed(&self, tokens: &[u32]) -> OpResult<Tensor> {
        self.embed_tokens.forward(tokens)
    }

    fn blocks(&self, _tokens: &[u32]) -> OpResult<Vec<DecoderBlock<'_>>> {
        let blocks = self.layers.iter();
        Ok(blocks
            .map(|b| DecoderBlock {
                input_norm: &b.input_layernorm,
                mixer: Box::new(AttentionGrad {
                    attn: &b.self_attn,
                    window: None,
                }),
                mixer_out_norm: None,
                mlp_norm: Some(&b.post_attention_layernorm),
                mlp: Box::new(GatedMlpGrad {
                    mlp: &b.mlp,
                    activation: ops::Activation::Silu,
                }),
                mlp_out_norm: None,
                tail: None,
                output_scale: 1.0,
            })
            .collect())
    }
}
