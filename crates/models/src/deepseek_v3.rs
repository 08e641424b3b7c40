//! DeepSeek-V3 as mlx-lm's `deepseek_v3.py` defines it (the architecture of DeepSeek-V3/R1,
//! Kimi K2 and Moonlight): multi-head latent attention (MLA) and, after the first
//! `first_k_dense_replace` layers, mixtures of experts routed by sigmoid scores within groups,
//! beside shared experts.
//!
//! MLA compresses each token's keys and values into one normed latent vector
//! (`kv_lora_rank` wide) and one rotated key part that all heads share (`qk_rope_head_dim`).
//! It runs here in the absorbed form mlx-lm uses for decoding, for every token: each head's
//! query (its part without RoPE) is taken into the latent space by the head's `embed_q` matrix
//! and joined to its rotated part, so that attention is multi-query attention of one key/value
//! head over `[latent, rotated key]` rows; each head's output, a latent vector, leaves through
//! its `unembed_out` matrix. The cache holds those rows alone, `kv_lora_rank +
//! qk_rope_head_dim` numbers a token for the whole layer (as keys and again as values), where
//! plain attention would keep every head's keys and values.

use oxlm_engine::{ops, EngineError, Positions, Tensor};
use serde::Deserialize;
use serde_json::Value;

use crate::cache::{append_kv, attend_kv, Cache, KvCache, LayerCache, MlxForm};
use crate::checkpoint::{Checkpoint, Scope};
use crate::decoder_grad::{Decoder, DecoderBlock};
use crate::layers::{linear_shape, Embedding, Linear, Mlp, OpResult, OutputHead, RmsNorm, Rope};
use crate::lora::{Adaptable, LinearShape, ModuleAdapters, PassAdapters};
use crate::pass::{Architecture, LayerCaches, PassCaches};
use crate::switch::{
    load_stacked, ExpertMlps, FeedForward, MoeNames, Routing, Shared, SharedNames, SparseMoe,
};
use crate::{ForwardError, LoadError, ModelInfo};

/// `config.json`'s keys, as mlx-lm's `ModelArgs` reads them; absent ones take its defaults.
#[derive(Deserialize)]
#[serde(default)]
struct Args {
    vocab_size: usize,
    hidden_size: usize,
    intermediate_size: usize,
    moe_intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    n_shared_experts: Option<usize>,
    n_routed_experts: Option<usize>,
    routed_scaling_factor: f32,
    kv_lora_rank: usize,
    q_lora_rank: Option<usize>,
    qk_rope_head_dim: usize,
    v_head_dim: usize,
    qk_nope_head_dim: usize,
    topk_method: String,
    scoring_func: String,
    norm_topk_prob: bool,
    n_group: usize,
    topk_group: usize,
    num_experts_per_tok: usize,
    moe_layer_freq: usize,
    first_k_dense_replace: usize,
    max_position_embeddings: usize,
    rms_norm_eps: f32,
    rope_theta: f32,
    rope_scaling: Option<Value>,
    attention_bias: bool,
}

impl Default for Args {
    fn default() -> Self {
        Args {
            vocab_size: 102400,
            hidden_size: 4096,
            intermediate_size: 11008,
            moe_intermediate_size: 1407,
            num_hidden_layers: 30,
            num_attention_heads: 32,
            n_shared_experts: None,
            n_routed_experts: None,
            routed_scaling_factor: 1.0,
            kv_lora_rank: 512,
            q_lora_rank: Some(1536),
            qk_rope_head_dim: 64,
            v_head_dim: 128,
            qk_nope_head_dim: 128,
            topk_method: "noaux_tc".into(),
            scoring_func: "sigmoid".into(),
            norm_topk_prob: true,
            n_group: 1,
            topk_group: 1,
            num_experts_per_tok: 1,
            moe_layer_freq: 1,
            first_k_dense_replace: 0,
            max_position_embeddings: 2048,
            rms_norm_eps: 1e-6,
            rope_theta: 10000.0,
            rope_scaling: None,
            attention_bias: false,
        }
    }
}

/// The eps of MLA's own norms (`q_a_layernorm`, `kv_a_layernorm`), fixed in mlx-lm.
const LATENT_NORM_EPS: f32 = 1e-6;

/// How the queries are made: one projection, or through a normed low-rank bottleneck
/// (`q_lora_rank`).
// One per layer, held in a Vec: the variants' sizes do not matter.
#[allow(clippy::large_enum_variant)]
enum QueryProjection {
    Full(Linear),
    LowRank {
        down: Linear,
        norm: RmsNorm,
        up: Linear,
    },
}

/// Multi-head latent attention (mlx-lm's `DeepseekV3Attention`).
struct LatentAttention {
    query: QueryProjection,
    /// `kv_a_proj_with_mqa`: the latent and the shared rotated key part.
    kv_down: Linear,
    kv_norm: RmsNorm,
    /// Per head, `[kv_lora_rank, qk_nope_head_dim]`: its query into the latent space.
    embed_q: Vec<Linear>,
    /// Per head, `[v_head_dim, kv_lora_rank]`: its output out of the latent space.
    unembed_out: Vec<Linear>,
    o_proj: Linear,
    rope: Rope,
    heads: usize,
    nope: usize,
    rope_dim: usize,
    latent: usize,
    v_dim: usize,
    scale: f32,
}

impl LatentAttention {
    fn load(vb: &mut Scope, c: &Args, rope: &Rope, scale: f32) -> Result<Self, LoadError> {
        let (hidden, heads, bias) = (c.hidden_size, c.num_attention_heads, c.attention_bias);
        let (nope, rope_dim, latent) = (c.qk_nope_head_dim, c.qk_rope_head_dim, c.kv_lora_rank);
        let q_width = heads * (nope + rope_dim);
        let query = match c.q_lora_rank {
            None => {
                QueryProjection::Full(Linear::load(&mut vb.pp("q_proj"), hidden, q_width, false)?)
            }
            Some(rank) => QueryProjection::LowRank {
                down: Linear::load(&mut vb.pp("q_a_proj"), hidden, rank, bias)?,
                norm: RmsNorm::load(&mut vb.pp("q_a_layernorm"), rank, LATENT_NORM_EPS)?,
                up: Linear::load(&mut vb.pp("q_b_proj"), rank, q_width, false)?,
            },
        };
        let linears = |stack: Vec<_>| {
            stack
                .into_iter()
                .map(|weight| Linear { weight, bias: None })
        };
        Ok(LatentAttention {
            query,
            kv_down: Linear::load(
                &mut vb.pp("kv_a_proj_with_mqa"),
                hidden,
                latent + rope_dim,
                bias,
            )?,
            kv_norm: RmsNorm::load(&mut vb.pp("kv_a_layernorm"), latent, LATENT_NORM_EPS)?,
            embed_q: linears(load_stacked(&mut vb.pp("embed_q"), heads, latent, nope)?).collect(),
            unembed_out: linears(load_stacked(
                &mut vb.pp("unembed_out"),
                heads,
                c.v_head_dim,
                latent,
            )?)
            .collect(),
            o_proj: Linear::load(&mut vb.pp("o_proj"), heads * c.v_head_dim, hidden, bias)?,
            rope: rope.clone(),
            heads,
            nope,
            rope_dim,
            latent,
            v_dim: c.v_head_dim,
            scale,
        })
    }

    /// The width of a cached row: the latent and the rotated key part.
    fn row_width(&self) -> usize {
        self.latent + self.rope_dim
    }

    fn forward(
        &self,
        x: &Tensor,
        positions: &Positions,
        caches: &mut [&mut KvCache],
        lora: ModuleAdapters,
    ) -> OpResult<Tensor> {
        let (n, heads, width) = (x.rows(), self.heads, self.row_width());
        let q = match &self.query {
            QueryProjection::Full(p) => p.forward_adapted(x, lora.get("q_proj"))?,
            QueryProjection::LowRank { down, norm, up } => {
                let mut a = down.forward_adapted(x, lora.get("q_a_proj"))?;
                norm.forward_inplace(&mut a)?;
                up.forward_adapted(&a, lora.get("q_b_proj"))?
            }
        };
        // One row per (token, head).
        let q = q.reshape(vec![n * heads, self.nope + self.rope_dim]);
        let q_nope = ops::columns(&q, 0, self.nope)?;
        let mut q_pe =
            ops::columns(&q, self.nope, self.rope_dim)?.reshape(vec![n, heads * self.rope_dim]);
        let compressed = self
            .kv_down
            .forward_adapted(x, lora.get("kv_a_proj_with_mqa"))?;
        let mut latent = ops::columns(&compressed, 0, self.latent)?;
        self.kv_norm.forward_inplace(&mut latent)?;
        let mut k_pe = ops::columns(&compressed, self.latent, self.rope_dim)?;
        let rope_dim = self.rope_dim;
        self.rope
            .apply_pair(&mut q_pe, heads, &mut k_pe, 1, rope_dim, positions)?;

        let device = x.device();
        let mut rows = Tensor::zeros(vec![n, width], &device)?;
        ops::place_columns(&mut rows, &latent, 0)?;
        ops::place_columns(&mut rows, &k_pe, self.latent)?;
        append_kv(caches, &rows, &rows, positions)?;

        let mut queries = Tensor::zeros(vec![n * heads, width], &device)?;
        ops::place_columns(&mut queries, &per_head(&self.embed_q, q_nope, heads)?, 0)?;
        ops::place_columns(
            &mut queries,
            &q_pe.reshape(vec![n * heads, rope_dim]),
            self.latent,
        )?;
        let queries = queries.reshape(vec![n, heads * width]);
        let options = ops::AttentionOptions::scaled(self.scale);
        let out = attend_kv(&queries, heads, width, positions, caches, options, None)?;
        let out = ops::columns(&out.reshape(vec![n * heads, width]), 0, self.latent)?;
        let out = per_head(&self.unembed_out, out, heads)?.reshape(vec![n, heads * self.v_dim]);
        self.o_proj.forward_adapted(&out, lora.get("o_proj"))
    }

    /// Its projections, as mlx-lm's default LoRA keys select them (under `self_attn`; the
    /// per-head matrices are not linear layers there).
    fn linears(&self) -> Vec<LinearShape> {
        let mut out = match &self.query {
            QueryProjection::Full(p) => vec![linear_shape("self_attn.q_proj", p)],
            QueryProjection::LowRank { down, up, .. } => vec![
                linear_shape("self_attn.q_a_proj", down),
                linear_shape("self_attn.q_b_proj", up),
            ],
        };
        out.push(linear_shape("self_attn.kv_a_proj_with_mqa", &self.kv_down));
        out.push(linear_shape("self_attn.o_proj", &self.o_proj));
        out
    }
}

/// Row `t · heads + j` of `x` through matrix `j` of `per_head`. Seen as `[tokens, heads · in]`,
/// head `j`'s rows of `x` are a run of columns, and so are its rows of the output: each head is
/// a column slice in and out, with no row indices to upload.
fn per_head(per_head: &[Linear], x: Tensor, heads: usize) -> OpResult<Tensor> {
    let (tokens, inputs) = (x.rows() / heads, x.cols());
    let width = per_head.first().map_or(0, |m| m.weight.rows());
    let x = x.reshape(vec![tokens, heads * inputs]);
    let mut y = Tensor::zeros(vec![tokens, heads * width], &x.device())?;
    for (j, matrix) in per_head.iter().enumerate() {
        let out = matrix.forward(&ops::columns(&x, j * inputs, inputs)?)?;
        ops::place_columns(&mut y, &out, j * width)?;
    }
    Ok(y.reshape(vec![tokens * heads, width]))
}

struct Block {
    input_layernorm: RmsNorm,
    self_attn: LatentAttention,
    post_attention_layernorm: RmsNorm,
    mlp: FeedForward,
}

pub struct DeepseekV3 {
    info: ModelInfo,
    embed_tokens: Embedding,
    layers: Vec<Block>,
    head: OutputHead,
}

impl DeepseekV3 {
    pub fn load(mut ckpt: Checkpoint) -> Result<Self, LoadError> {
        let model_type = ckpt.config.model_type()?.to_string();
        let c: Args = ckpt.config.args()?;
        for (key, value, supported) in [
            ("scoring_func", &c.scoring_func, "sigmoid"),
            ("topk_method", &c.topk_method, "noaux_tc"),
        ] {
            if value != supported {
                return Err(LoadError::Config(format!(
                    "`{key}` `{value}` is not supported (supported: {supported})"
                )));
            }
        }
        let (hidden, heads) = (c.hidden_size, c.num_attention_heads);
        let sizes = [
            hidden,
            heads,
            c.kv_lora_rank,
            c.qk_rope_head_dim,
            c.v_head_dim,
        ];
        if sizes.contains(&0) || !c.qk_rope_head_dim.is_multiple_of(2) {
            return Err(LoadError::Config(
                "sizes and head counts must be positive, qk_rope_head_dim even".into(),
            ));
        }
        let moe =
            match c.n_routed_experts {
                Some(experts) => Some(
                    Routing::new(experts, c.num_experts_per_tok, c.norm_topk_prob)?
                        .sigmoid_grouped(c.n_group, c.topk_group, c.routed_scaling_factor)?,
                ),
                None => None,
            };
        let freq = c.moe_layer_freq.max(1);
        let sparse = |i: usize| i >= c.first_k_dense_replace && i.is_multiple_of(freq);
        let device = ckpt.device.clone();
        let scaling = c.rope_scaling.as_ref();
        let rope = Rope::new(
            c.qk_rope_head_dim,
            c.rope_theta,
            true,
            scaling,
            Some(c.max_position_embeddings),
            &device,
        )?;
        let scale = ((c.qk_nope_head_dim + c.qk_rope_head_dim) as f32).powf(-0.5)
            * yarn_attention_factor(scaling);
        // The multi-token-prediction layers after the last are not part of the model.
        let layers = c.num_hidden_layers;
        ckpt.discard_where(|name| {
            name.strip_prefix("model.layers.")
                .and_then(|rest| rest.split('.').next())
                .and_then(|i| i.parse::<usize>().ok())
                .is_some_and(|i| i >= layers)
        });

        let eps = c.rms_norm_eps;
        let mut root = ckpt.scope("");
        let mut model = root.pp("model");
        let embed_tokens = Embedding::load(&mut model.pp("embed_tokens"), c.vocab_size, hidden)?;
        let mut blocks = Vec::with_capacity(layers);
        for i in 0..layers {
            let mut block = model.pp(format_args!("layers.{i}"));
            let self_attn = LatentAttention::load(&mut block.pp("self_attn"), &c, &rope, scale)?;
            let mlp = match moe {
                Some(routing) if sparse(i) => FeedForward::Moe(SparseMoe::load(
                    &mut block,
                    MoeNames::MLP,
                    hidden,
                    routing,
                    ExpertMlps::swiglu(c.moe_intermediate_size),
                    c.n_shared_experts.map(|n| Shared {
                        intermediate: c.moe_intermediate_size * n,
                        gated: false,
                        names: SharedNames::SHARED_EXPERTS,
                    }),
                )?),
                _ => FeedForward::Dense(Mlp::load(
                    &mut block.pp("mlp"),
                    hidden,
                    c.intermediate_size,
                    false,
                )?),
            };
            blocks.push(Block {
                input_layernorm: RmsNorm::load(&mut block.pp("input_layernorm"), hidden, eps)?,
                self_attn,
                post_attention_layernorm: RmsNorm::load(
                    &mut block.pp("post_attention_layernorm"),
                    hidden,
                    eps,
                )?,
                mlp,
            });
        }
        let norm = RmsNorm::load(&mut model.pp("norm"), hidden, eps)?;
        let lm_head = Linear::load(&mut root.pp("lm_head"), hidden, c.vocab_size, false)?;
        ckpt.finish()?;
        Ok(DeepseekV3 {
            info: ModelInfo {
                model_type,
                vocab_size: c.vocab_size,
                hidden_size: hidden,
                num_layers: layers,
                max_context: Some(c.max_position_embeddings),
                device,
            },
            embed_tokens,
            layers: blocks,
            head: OutputHead {
                norm,
                lm_head: Some(lm_head),
                softcap: None,
            },
        })
    }
}

/// YaRN's `mscale_all_dim` part, which DeepSeek puts on the attention scale (squared: queries
/// and keys each carry it); 1 without it.
fn yarn_attention_factor(scaling: Option<&Value>) -> f32 {
    let number = |key: &str| scaling.and_then(|s| s.get(key)).and_then(Value::as_f64);
    let (Some(all_dims), Some(factor)) = (number("mscale_all_dim"), number("factor")) else {
        return 1.0;
    };
    if all_dims == 0.0 || factor <= 1.0 {
        return 1.0;
    }
    let s = 0.1 * all_dims * factor.ln() + 1.0;
    (s * s) as f32
}

impl Architecture for DeepseekV3 {
    fn info(&self) -> &ModelInfo {
        &self.info
    }

    fn layer_caches(&self) -> Result<Vec<LayerCache>, EngineError> {
        let device = &self.info.device;
        self.layers
            .iter()
            .map(|b| {
                // mlx-lm caches the latent as keys and the rotated key part as values.
                let a = &b.self_attn;
                let form = MlxForm {
                    split: Some(a.latent),
                    ..MlxForm::default()
                };
                let kv = KvCache::new(1, a.row_width(), device)?.with_mlx_form(form);
                Ok(LayerCache::Kv(kv))
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
        let mut h = self.embed_tokens.forward(tokens)?;
        for (i, block) in self.layers.iter().enumerate() {
            let lora = |module| adapters.map_or(ModuleAdapters::NONE, |a| a.module(i, module));
            let LayerCaches::Kv(mut kvs) = caches.layer(i)? else {
                return Err(ForwardError::CacheMismatch);
            };
            let width = block.self_attn.row_width();
            if kvs.iter().any(|c| c.shape() != (1, width)) {
                return Err(ForwardError::CacheMismatch);
            }
            let x = block.input_layernorm.forward(&h)?;
            let r = block
                .self_attn
                .forward(&x, &positions, &mut kvs, lora("self_attn"))?;
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

impl Adaptable for DeepseekV3 {
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

impl Decoder for DeepseekV3 {
    fn embed(&self, tokens: &[u32]) -> OpResult<Tensor> {
        self.embed_tokens.forward(tokens)
    }

    fn blocks(&self, _tokens: &[u32]) -> OpResult<Vec<DecoderBlock<'_>>> {
        Err(EngineError::Unsupported(
            "LoRA training through multi-head latent attention".into(),
        ))
    }
}
