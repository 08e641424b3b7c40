//! The llama-like family: decoder-only models that differ from mlx-lm's `llama.py` by switches
//! rather than by structure. Each member is one entry of [`MEMBERS`]: its `model_type` and a
//! function that reads its config into [`Switches`] (norm placement, q/k norms, biases, fused
//! projections, RoPE variant and partial rotary, NoPE layers, sliding-window layers, embedding,
//! residual and logit multipliers, tied head, mixture-of-experts MLPs). One model, [`Llama`],
//! runs them all.
//!
//! Members: `llama`, `mistral`, `mistral3` (its text model), `qwen2`, `qwen3`, `qwen3_moe`,
//! `mixtral`, `smollm3`, `phi3`, `olmo2`, `olmo3`, `granite`, `minicpm`, `glm4`, `exaone4`,
//! `ernie4_5`, `seed_oss`, `llama4` (its text model), each as the mlx-lm file of that name
//! defines it.

use serde::Deserialize;
use serde_json::Value;

use crate::cache::{Cache, KvCache, LayerCache, MlxForm, RotatingKvCache};
use crate::checkpoint::{Checkpoint, Scope};
use crate::decoder_grad::{AttentionGrad, Decoder, DecoderBlock, GatedMlpGrad};
use crate::layers::{
    load_vector, Attention, Embedding, Input, Linear, Mlp, OpResult, OutputHead, PositionScale,
    RmsNorm, Rope,
};
use crate::lora::{Adaptable, LinearShape, ModuleAdapters, PassAdapters};
use crate::pass::{Architecture, LayerCaches, PassCaches};
use crate::switch::{ExpertMlps, FeedForward, MoeNames, Routing, Shared, SharedNames, SparseMoe};
use crate::{ForwardError, LoadError, ModelInfo};
use oxlm_engine::{ops, EngineError, Positions, Tensor};

/// `config.json`'s keys that any member reads, as mlx-lm's `ModelArgs` name them; which of
/// them a member honours, and its defaults for the absent ones, are in its entry of
/// [`MEMBERS`].
#[derive(Deserialize)]
struct Args {
    /// The text model's own `model_type` (a multimodal wrapper's `text_config` sets it).
    model_type: String,
    hidden_size: usize,
    num_hidden_layers: usize,
    #[serde(default)]
    intermediate_size: usize,
    num_attention_heads: usize,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    vocab_size: usize,
    rms_norm_eps: f32,
    tie_word_embeddings: Option<bool>,
    max_position_embeddings: Option<usize>,
    rope_theta: Option<f32>,
    rope_scaling: Option<Value>,
    /// transformers ≥ 5 nests `rope_theta` and the scaling here (by layer type, at times: see
    /// [`Args::model_wide_rope`]).
    rope_parameters: Option<Value>,
    rope_traditional: Option<bool>,
    partial_rotary_factor: Option<f32>,
    /// Phi-3's LongRoPE reads the old context here, not in `rope_scaling`.
    original_max_position_embeddings: Option<usize>,
    layer_types: Option<Vec<String>>,
    sliding_window: Option<usize>,
    /// EXAONE 4's `"LLLG"`: local (windowed) and global layers, repeating.
    sliding_window_pattern: Option<String>,
    attention_bias: Option<bool>,
    attention_out_bias: Option<bool>,
    #[serde(default)]
    mlp_bias: bool,
    /// ERNIE 4.5's one switch for every projection's bias.
    #[serde(default)]
    use_bias: bool,
    /// SmolLM3: 0 where a layer has no RoPE.
    no_rope_layers: Option<Vec<u8>>,
    no_rope_layer_interval: Option<usize>,
    attention_multiplier: Option<f32>,
    attn_logit_softcapping: Option<f32>,
    final_logit_softcapping: Option<f32>,
    query_pre_attn_scalar: Option<f32>,
    embedding_multiplier: Option<f32>,
    residual_multiplier: Option<f32>,
    logits_scaling: Option<f32>,
    scale_emb: Option<f32>,
    scale_depth: Option<f32>,
    dim_model_base: Option<f32>,
    num_experts: Option<usize>,
    num_local_experts: Option<usize>,
    n_routed_experts: Option<usize>,
    n_shared_experts: Option<usize>,
    n_group: Option<usize>,
    topk_group: Option<usize>,
    routed_scaling_factor: Option<f32>,
    scoring_func: Option<String>,
    topk_method: Option<String>,
    first_k_dense_replace: Option<usize>,
    use_qk_norm: Option<bool>,
    /// ERNIE 4.5-MoE's names for the mixture's settings.
    moe_num_experts: Option<usize>,
    moe_k: Option<usize>,
    moe_num_shared_experts: Option<usize>,
    moe_layer_start_index: Option<Value>,
    moe_layer_end_index: Option<Value>,
    moe_layer_interval: Option<usize>,
    moe_gate_act: Option<String>,
    num_experts_per_tok: Option<usize>,
    moe_intermediate_size: Option<usize>,
    norm_topk_prob: Option<bool>,
    decoder_sparse_step: Option<usize>,
    #[serde(default)]
    mlp_only_layers: Vec<usize>,
    /// Llama 4's: the dense MLPs' width, the mixtures' spacing, the attention's chunks and the
    /// queries' temperature tuning on its layers without RoPE.
    intermediate_size_mlp: Option<usize>,
    interleave_moe_layer_step: Option<usize>,
    attention_chunk_size: Option<usize>,
    attn_temperature_tuning: Option<Value>,
    floor_scale: Option<usize>,
    attn_scale: Option<f32>,
}

impl Args {
    fn missing(key: &str) -> LoadError {
        LoadError::Config(format!("`{key}` is missing"))
    }

    fn head_dim(&self) -> usize {
        self.head_dim
            .unwrap_or(self.hidden_size / self.num_attention_heads.max(1))
    }

    /// `rope_parameters` as one section for every layer. transformers 5 keys it by layer type
    /// where layers could differ (MiniCPM5's `{"full_attention": {"rope_theta": ...}}`); these
    /// models rotate every layer alike (as mlx-lm's and llama.cpp's do), so the sections are
    /// `full_attention`'s, and a `sliding_attention` section unlike it is refused rather than
    /// run wrong.
    fn model_wide_rope(&self) -> Result<Option<Value>, LoadError> {
        let Some(params) = &self.rope_parameters else {
            return Ok(None);
        };
        let (full, sliding) = (
            params.get("full_attention"),
            params.get("sliding_attention"),
        );
        match (full, sliding) {
            (None, None) => Ok(Some(params.clone())),
            (Some(full), Some(sliding)) if full != sliding => Err(LoadError::Config(
                "`rope_parameters` gives sliding_attention layers a RoPE of their own, which this \
                 architecture does not have"
                    .into(),
            )),
            (Some(section), _) | (None, Some(section)) => Ok(Some(section.clone())),
        }
    }
}

/// Where a block's RMS norms sit, by the names its checkpoint gives them: before and after
/// attention, before and after the MLP.
#[derive(Clone, Copy)]
struct Norms {
    attn_in: Option<&'static str>,
    attn_out: Option<&'static str>,
    mlp_in: Option<&'static str>,
    mlp_out: Option<&'static str>,
}

/// llama's pre-norm blocks.
const PRE_NORM: Norms = Norms {
    attn_in: Some("input_layernorm"),
    attn_out: None,
    mlp_in: Some("post_attention_layernorm"),
    mlp_out: None,
};

/// OLMo 2's and EXAONE 4's: each branch's output normed before the residual, its input not.
const POST_NORM: Norms = Norms {
    attn_in: None,
    attn_out: Some("post_attention_layernorm"),
    mlp_in: None,
    mlp_out: Some("post_feedforward_layernorm"),
};

/// Gemma's: both, under its own names.
const GEMMA_NORMS: Norms = Norms {
    attn_in: Some("input_layernorm"),
    attn_out: Some("post_attention_layernorm"),
    mlp_in: Some("pre_feedforward_layernorm"),
    mlp_out: Some("post_feedforward_layernorm"),
};

/// GLM-4's: both.
const SANDWICH_NORM: Norms = Norms {
    attn_in: Some("input_layernorm"),
    attn_out: Some("post_self_attn_layernorm"),
    mlp_in: Some("post_attention_layernorm"),
    mlp_out: Some("post_mlp_layernorm"),
};

/// Norms of the queries and keys after their projections.
#[derive(Clone, Copy, PartialEq)]
enum QkNorm {
    None,
    /// Over each head (Qwen3).
    PerHead,
    /// Over all heads at once (OLMo 2).
    Full,
    /// Over each head after the rotation, named `query_layernorm` and `key_layernorm`
    /// (Hunyuan).
    PerHeadAfterRope,
    /// Over each head after the rotation, without weights, ε 1e-6, on the rotary layers only
    /// (Llama 4).
    UnweightedAfterRope,
}

/// What a layer's attention rotates by.
#[derive(Clone, Copy, PartialEq)]
enum Rotary {
    /// The config's RoPE, with its scaling.
    Scaled,
    /// The base RoPE without the scaling (OLMo 3's sliding layers).
    Plain,
    /// None (SmolLM3's and EXAONE 4's NoPE layers).
    None,
}

/// One layer's switches.
#[derive(Clone, Copy)]
struct LayerSwitches {
    rotary: Rotary,
    /// Attends through a window of this many positions (a ring cache), else globally.
    window: Option<usize>,
    /// A mixture of experts in place of the MLP.
    moe: bool,
    /// Attends within chunks of this many positions (a ring cache; Llama 4's), else per
    /// `window`.
    chunk: Option<usize>,
    /// Scales the queries by their positions.
    query_scale: Option<PositionScale>,
}

/// A mixture of experts' settings, where a member has one.
struct MoeSwitches {
    routing: Routing,
    experts: ExpertMlps,
    shared: Option<Shared>,
}

/// How a member departs from llama.
struct Switches {
    qkv_bias: bool,
    o_bias: bool,
    mlp_bias: bool,
    qk_norm: QkNorm,
    norms: Norms,
    /// One `qkv_proj` (Phi-3), split into the three on load.
    fused_qkv: bool,
    /// One `gate_up_proj` (Phi-3, GLM-4), split into the two on load.
    fused_gate_up: bool,
    tied: bool,
    traditional: bool,
    head_dim: usize,
    /// The share of each head's features that turn (the rest pass through).
    rotary_fraction: f32,
    layers: Vec<LayerSwitches>,
    /// Multiplies the embeddings (Granite, MiniCPM).
    embed_scale: f32,
    /// Multiplies each branch's output before the residual (Granite, MiniCPM).
    residual_scale: f32,
    /// Multiplies the logits (Granite's `1 / logits_scaling`, MiniCPM's).
    logit_scale: f32,
    /// The attention's softmax scale where it is not `head_dim^-0.5` (Granite).
    attention_scale: Option<f32>,
    moe: Option<MoeSwitches>,
    /// Where the text model's weights are (`language_model.` in a multimodal wrapper).
    prefix: &'static str,
    /// Where its mixtures' layers are.
    moe_names: MoeNames,
    /// The module of a block's MLP (`mlp`, Llama 4's `feed_forward`), and its width where it is
    /// not `intermediate_size`.
    mlp_module: MlpModule,
    mlp_width: Option<usize>,
    /// The context the RoPE scaling starts from where the member reads it outside
    /// `rope_scaling` (Phi-3).
    original_context: Option<usize>,
    /// The RoPE base where the member derives it rather than reading `rope_theta` (Hunyuan).
    rope_base: Option<f32>,
    /// Norms scale by `1 + weight` (Gemma's).
    norm_plus_one: bool,
    /// The gated MLPs' activation.
    activation: ops::Activation,
    /// Gemma 2's soft caps on the attention scores and on the logits.
    attention_softcap: Option<f32>,
    final_softcap: Option<f32>,
    /// gpt-oss's per-head attention sinks (`self_attn.sinks`).
    sinks: bool,
}

impl Switches {
    /// llama's, as mlx-lm's `llama.py` reads its config (which `mistral` shares): biases on
    /// every attention projection with `attention_bias`, on the MLP's with `mlp_bias`, and
    /// `layer_types`' `sliding_attention` layers attending through `sliding_window`.
    fn llama(c: &Args) -> Result<Self, LoadError> {
        let window = c.sliding_window;
        let layers = match &c.layer_types {
            None => vec![LayerSwitches::GLOBAL; c.num_hidden_layers],
            Some(types) => types
                .iter()
                .map(|t| match t.as_str() {
                    "full_attention" => Ok(LayerSwitches::GLOBAL),
                    "sliding_attention" => Ok(LayerSwitches {
                        window: Some(window.ok_or_else(|| Args::missing("sliding_window"))?),
                        ..LayerSwitches::GLOBAL
                    }),
                    other => Err(LoadError::Config(format!(
                        "layer type `{other}` (supported: full_attention, sliding_attention)"
                    ))),
                })
                .collect::<Result<_, _>>()?,
        };
        let bias = c.attention_bias.unwrap_or(false);
        Ok(Switches {
            qkv_bias: bias,
            o_bias: bias,
            mlp_bias: c.mlp_bias,
            qk_norm: QkNorm::None,
            norms: PRE_NORM,
            fused_qkv: false,
            fused_gate_up: false,
            tied: c.tie_word_embeddings.unwrap_or(true),
            traditional: c.rope_traditional.unwrap_or(false),
            head_dim: c.head_dim(),
            rotary_fraction: 1.0,
            layers,
            embed_scale: 1.0,
            residual_scale: 1.0,
            logit_scale: 1.0,
            attention_scale: None,
            moe: None,
            prefix: "",
            moe_names: MoeNames::MLP,
            mlp_module: MlpModule::MLP,
            mlp_width: None,
            original_context: None,
            rope_base: None,
            norm_plus_one: false,
            activation: ops::Activation::Silu,
            attention_softcap: None,
            final_softcap: None,
            sinks: false,
        })
    }

    /// Partial rotary: `partial_rotary_factor` of each head's features turn.
    fn partial_rotary(mut self, c: &Args) -> Self {
        self.rotary_fraction = c.partial_rotary_factor.unwrap_or(1.0);
        self
    }

    /// Heads as wide as the model over the heads, whatever `head_dim` says.
    fn head_dim_from_width(mut self, c: &Args) -> Self {
        self.head_dim = c.hidden_size / c.num_attention_heads.max(1);
        self
    }

    /// The MLPs of the layers `sparse` picks become mixtures of `num_experts` (or
    /// `num_local_experts`) experts of `moe_intermediate_size` (or `intermediate_size`), their
    /// weights renormalized with `norm_topk_prob` (`renormalize` where absent).
    fn experts(
        mut self,
        c: &Args,
        renormalize: bool,
        sparse: impl Fn(usize) -> bool,
    ) -> Result<Self, LoadError> {
        let experts = c
            .num_experts
            .or(c.num_local_experts)
            .or(c.n_routed_experts)
            .ok_or_else(|| Args::missing("num_experts"))?;
        let top_k = c
            .num_experts_per_tok
            .ok_or_else(|| Args::missing("num_experts_per_tok"))?;
        self.moe = Some(MoeSwitches {
            routing: Routing::new(experts, top_k, c.norm_topk_prob.unwrap_or(renormalize))?,
            experts: ExpertMlps::swiglu(c.moe_intermediate_size.unwrap_or(c.intermediate_size)),
            shared: None,
        });
        for (i, layer) in self.layers.iter_mut().enumerate() {
            layer.moe = experts > 0 && sparse(i);
        }
        Ok(self)
    }
}

impl LayerSwitches {
    const GLOBAL: LayerSwitches = LayerSwitches {
        rotary: Rotary::Scaled,
        window: None,
        moe: false,
        chunk: None,
        query_scale: None,
    };
}

/// A block's dense MLP as its checkpoint and mlx-lm's adapters name it: the module, and its
/// three layers' keys.
#[derive(Clone, Copy)]
struct MlpModule {
    name: &'static str,
    keys: [&'static str; 3],
}

impl MlpModule {
    const MLP: MlpModule = MlpModule {
        name: "mlp",
        keys: ["mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"],
    };
    /// Llama 4's.
    const FEED_FORWARD: MlpModule = MlpModule {
        name: "feed_forward",
        keys: [
            "feed_forward.gate_proj",
            "feed_forward.up_proj",
            "feed_forward.down_proj",
        ],
    };
}

type Member = fn(&Args) -> Result<Switches, LoadError>;

/// The family's members: `model_type` and how its config sets the switches.
const MEMBERS: &[(&str, Member)] = &[
    ("llama", Switches::llama),
    ("mistral", Switches::llama),
    ("qwen2", qwen2),
    ("qwen3", qwen3),
    ("qwen3_moe", qwen3_moe),
    ("mistral3", mistral3),
    ("ministral3", ministral3),
    ("llava", mistral3),
    ("mixtral", mixtral),
    ("smollm3", smollm3),
    ("phi3", phi3),
    ("olmo2", olmo2),
    ("olmo3", olmo3),
    ("granite", granite),
    ("minicpm", minicpm),
    ("glm4", glm4),
    ("exaone4", exaone4),
    ("ernie4_5", ernie4_5),
    ("seed_oss", seed_oss),
    ("glm4_moe", glm4_moe),
    ("olmoe", olmoe),
    ("hunyuan_v1_dense", hunyuan_v1_dense),
    ("gemma2", gemma2),
    ("ernie4_5_moe", ernie4_5_moe),
    ("gpt_oss", gpt_oss),
    ("granitemoe", granitemoe),
    ("llama4", llama4),
    // mlx-lm reads these as llama.
    ("iquestcoder", Switches::llama),
    ("xverse", Switches::llama),
];

/// Whether `model_type` is one of the family's.
pub fn is_member(model_type: &str) -> bool {
    member(model_type).is_some()
}

/// The family's `model_type`s.
pub fn member_types() -> impl Iterator<Item = &'static str> {
    MEMBERS.iter().map(|(name, _)| *name)
}

fn member(model_type: &str) -> Option<Member> {
    MEMBERS
        .iter()
        .find(|(name, _)| *name == model_type)
        .map(|(_, m)| *m)
}

/// Mistral 3's multimodal wrapper: its llama or Ministral 3 text model under
/// `language_model.`, untied unless `text_config` says so.
fn mistral3(c: &Args) -> Result<Switches, LoadError> {
    let text = match c.model_type.as_str() {
        "llama" | "mistral" | "mistral3" | "llava" => Switches::llama(c)?,
        "ministral3" => ministral3(c)?,
        other => {
            return Err(LoadError::Config(format!(
                "mistral3 with a `{other}` text model is not supported \
                 (supported: llama, mistral, ministral3)"
            )))
        }
    };
    Ok(Switches {
        tied: c.tie_word_embeddings.unwrap_or(false),
        prefix: "language_model.",
        ..text
    })
}

/// Ministral 3: llama without biases, its RoPE in `rope_parameters`, and the queries scaled
/// by Llama 4's `llama_4_scaling_beta` beyond `original_max_position_embeddings`.
fn ministral3(c: &Args) -> Result<Switches, LoadError> {
    let params = c.rope_parameters.as_ref();
    let number = |key: &str| {
        params
            .and_then(|p| p.get(key))
            .and_then(Value::as_f64)
            .ok_or_else(|| Args::missing(&format!("rope_parameters.{key}")))
    };
    let period = number("original_max_position_embeddings")? as usize;
    if period == 0 {
        return Err(LoadError::Config(
            "`rope_parameters.original_max_position_embeddings` must be positive".into(),
        ));
    }
    let query_scale = Some(PositionScale {
        beta: number("llama_4_scaling_beta")? as f32,
        period,
        shift: 0,
    });
    let mut switches = Switches {
        qkv_bias: false,
        o_bias: false,
        mlp_bias: false,
        ..Switches::llama(c)?
    };
    for layer in &mut switches.layers {
        layer.query_scale = query_scale;
    }
    Ok(switches)
}

/// Llama 4's text model (under `language_model.`): three layers of four rotate (interleaved,
/// with weightless q/k norms after the rotation) and attend within chunks of
/// `attention_chunk_size`; the fourth attends globally without RoPE, its queries
/// temperature-tuned by position (`attn_temperature_tuning`, `floor_scale`, `attn_scale`).
/// Every `interleave_moe_layer_step`-th layer holds a mixture (`num_local_experts`, one a
/// token by the sigmoid of its router logit, which weighs the token's input) beside an
/// ungated shared expert; the others dense MLPs of `intermediate_size_mlp`.
fn llama4(c: &Args) -> Result<Switches, LoadError> {
    let chunk = c
        .attention_chunk_size
        .filter(|&n| n > 0)
        .ok_or_else(|| Args::missing("attention_chunk_size"))?;
    let tuned = match &c.attn_temperature_tuning {
        None => true,
        Some(Value::Bool(on)) => *on,
        Some(Value::Number(n)) => n.as_f64() != Some(0.0),
        Some(other) => {
            return Err(LoadError::Config(format!(
                "`attn_temperature_tuning` must be a boolean or a number, not {other}"
            )))
        }
    };
    let period = c.floor_scale.unwrap_or(8192);
    if period == 0 {
        return Err(LoadError::Config("`floor_scale` must be positive".into()));
    }
    let temperature = tuned.then_some(PositionScale {
        beta: c.attn_scale.unwrap_or(0.1),
        period,
        shift: 1,
    });
    let layers = (0..c.num_hidden_layers)
        .map(|i| match (i + 1).is_multiple_of(4) {
            true => LayerSwitches {
                rotary: Rotary::None,
                query_scale: temperature,
                ..LayerSwitches::GLOBAL
            },
            false => LayerSwitches {
                chunk: Some(chunk),
                ..LayerSwitches::GLOBAL
            },
        })
        .collect();
    let step = c.interleave_moe_layer_step.unwrap_or(1).max(1);
    let mut switches = Switches {
        qk_norm: match c.use_qk_norm.unwrap_or(false) {
            true => QkNorm::UnweightedAfterRope,
            false => QkNorm::None,
        },
        tied: false,
        traditional: true,
        layers,
        prefix: "language_model.",
        moe_names: MoeNames::FEED_FORWARD,
        mlp_module: MlpModule::FEED_FORWARD,
        mlp_width: c.intermediate_size_mlp,
        ..Switches::llama(c)?
    }
    .experts(c, false, |i| i % step == step - 1)?;
    if let Some(moe) = &mut switches.moe {
        if c.num_experts_per_tok != Some(1) {
            return Err(LoadError::Config(format!(
                "Llama 4 routes each token to one expert, not {:?}",
                c.num_experts_per_tok
            )));
        }
        moe.routing = moe.routing.weighing_inputs();
        moe.shared = Some(Shared {
            intermediate: c.intermediate_size,
            gated: false,
            names: SharedNames::FEED_FORWARD,
        });
    }
    Ok(switches)
}

/// Qwen2: q/k/v biases, none on the output.
fn qwen2(c: &Args) -> Result<Switches, LoadError> {
    Ok(Switches {
        qkv_bias: true,
        o_bias: false,
        mlp_bias: false,
        ..Switches::llama(c)?
    })
}

/// Qwen3: q/k norms per head, no biases, untied unless the config says so.
fn qwen3(c: &Args) -> Result<Switches, LoadError> {
    Ok(Switches {
        qkv_bias: false,
        o_bias: false,
        mlp_bias: false,
        qk_norm: QkNorm::PerHead,
        tied: c.tie_word_embeddings.unwrap_or(false),
        ..Switches::llama(c)?
    })
}

/// Qwen3-MoE: Qwen3 with every `decoder_sparse_step`-th layer (but `mlp_only_layers`) a
/// mixture of experts.
fn qwen3_moe(c: &Args) -> Result<Switches, LoadError> {
    let step = c.decoder_sparse_step.unwrap_or(1).max(1);
    qwen3(c)?.experts(c, true, |i| {
        !c.mlp_only_layers.contains(&i) && (i + 1).is_multiple_of(step)
    })
}

/// Mixtral: Mistral with a mixture of experts in every layer, under `block_sparse_moe`.
fn mixtral(c: &Args) -> Result<Switches, LoadError> {
    Switches {
        tied: c.tie_word_embeddings.unwrap_or(false),
        moe_names: MoeNames::BLOCK_SPARSE,
        ..Switches::llama(c)?
    }
    .experts(c, true, |_| true)
}

/// SmolLM3: llama with RoPE left out of every `no_rope_layer_interval`-th layer, or of the
/// layers `no_rope_layers` marks 0.
fn smollm3(c: &Args) -> Result<Switches, LoadError> {
    let n = c.num_hidden_layers;
    let interval = c.no_rope_layer_interval.unwrap_or(4).max(1);
    let uses_rope: Vec<bool> = match &c.no_rope_layers {
        Some(flags) if flags.len() != n => {
            return Err(LoadError::Config(format!(
                "`no_rope_layers` has {} entries for {n} layers",
                flags.len()
            )))
        }
        Some(flags) => flags.iter().map(|&f| f != 0).collect(),
        None => (0..n).map(|i| !(i + 1).is_multiple_of(interval)).collect(),
    };
    let mut switches = Switches::llama(c)?;
    for (layer, rope) in switches.layers.iter_mut().zip(uses_rope) {
        if !rope {
            layer.rotary = Rotary::None;
        }
    }
    Ok(switches)
}

/// Phi-3 and Phi-4-mini: fused `qkv_proj` and `gate_up_proj`, partial rotary, no biases,
/// LongRoPE from the top-level `original_max_position_embeddings` (4096 where absent).
fn phi3(c: &Args) -> Result<Switches, LoadError> {
    Ok(Switches {
        original_context: Some(c.original_max_position_embeddings.unwrap_or(4096)),
        qkv_bias: false,
        o_bias: false,
        mlp_bias: false,
        fused_qkv: true,
        fused_gate_up: true,
        tied: c.tie_word_embeddings.unwrap_or(false),
        ..Switches::llama(c)?
    }
    .head_dim_from_width(c)
    .partial_rotary(c))
}

/// OLMo 2: norms after each branch, not before; q/k norms over all heads at once.
fn olmo2(c: &Args) -> Result<Switches, LoadError> {
    Ok(Switches {
        qk_norm: QkNorm::Full,
        norms: POST_NORM,
        ..Switches::llama(c)?
    })
}

/// OLMo 3: OLMo 2 with three sliding-window layers (plain RoPE) to each global one (scaled
/// RoPE) unless `layer_types` says otherwise, untied by default.
fn olmo3(c: &Args) -> Result<Switches, LoadError> {
    let window = c
        .sliding_window
        .ok_or_else(|| Args::missing("sliding_window"))?;
    let types: Vec<String> = match &c.layer_types {
        Some(types) => types.clone(),
        None => (0..c.num_hidden_layers)
            .map(|i| match (i + 1) % 4 {
                0 => "full_attention".to_string(),
                _ => "sliding_attention".to_string(),
            })
            .collect(),
    };
    let layers = types
        .iter()
        .map(|t| match t.as_str() {
            "full_attention" => LayerSwitches::GLOBAL,
            _ => LayerSwitches {
                rotary: Rotary::Plain,
                window: Some(window),
                ..LayerSwitches::GLOBAL
            },
        })
        .collect();
    Ok(Switches {
        qk_norm: QkNorm::Full,
        norms: POST_NORM,
        tied: c.tie_word_embeddings.unwrap_or(false),
        mlp_bias: false,
        layers,
        ..Switches::llama(c)?
    })
}

/// Granite-MoE: Granite with every MLP a mixture of `num_local_experts` (the router under
/// `block_sparse_moe.router.layer`), top-k renormalized.
fn granitemoe(c: &Args) -> Result<Switches, LoadError> {
    Switches {
        moe_names: MoeNames::GRANITE,
        ..granite(c)?
    }
    .experts(c, true, |_| true)
}

/// OLMoE: llama with q/k norms over all heads and a mixture of experts in every layer, not
/// renormalized unless `norm_topk_prob` says.
fn olmoe(c: &Args) -> Result<Switches, LoadError> {
    Switches {
        qk_norm: QkNorm::Full,
        ..Switches::llama(c)?
    }
    .experts(c, false, |_| true)
}

/// Granite: embedding, attention, residual and logit multipliers; `head_dim` from the width.
fn granite(c: &Args) -> Result<Switches, LoadError> {
    let get = |value: Option<f32>, key: &str| value.ok_or_else(|| Args::missing(key));
    Ok(Switches {
        embed_scale: get(c.embedding_multiplier, "embedding_multiplier")?,
        residual_scale: get(c.residual_multiplier, "residual_multiplier")?,
        logit_scale: 1.0 / get(c.logits_scaling, "logits_scaling")?,
        attention_scale: Some(get(c.attention_multiplier, "attention_multiplier")?),
        traditional: false,
        ..Switches::llama(c)?
    }
    .head_dim_from_width(c))
}

/// MiniCPM: embeddings times `scale_emb`, branches times `scale_depth / √layers`, and an untied
/// head's input divided by `hidden_size / dim_model_base`.
fn minicpm(c: &Args) -> Result<Switches, LoadError> {
    let get = |value: Option<f32>, key: &str| value.ok_or_else(|| Args::missing(key));
    let tied = c.tie_word_embeddings.unwrap_or(false);
    let logit_scale = match tied {
        true => 1.0,
        false => get(c.dim_model_base, "dim_model_base")? / c.hidden_size as f32,
    };
    Ok(Switches {
        qkv_bias: false,
        o_bias: false,
        mlp_bias: false,
        tied,
        embed_scale: get(c.scale_emb, "scale_emb")?,
        residual_scale: get(c.scale_depth, "scale_depth")? / (c.num_hidden_layers as f32).sqrt(),
        logit_scale,
        ..Switches::llama(c)?
    }
    .head_dim_from_width(c))
}

/// GLM-4: norms before and after each branch, a fused `gate_up_proj`, q/k/v biases with
/// `attention_bias`, partial rotary over interleaved pairs, an untied head.
fn glm4(c: &Args) -> Result<Switches, LoadError> {
    Ok(Switches {
        o_bias: false,
        mlp_bias: false,
        norms: SANDWICH_NORM,
        fused_gate_up: true,
        tied: false,
        traditional: c.rope_traditional.unwrap_or(true),
        ..Switches::llama(c)?
    }
    .partial_rotary(c))
}

/// EXAONE 4: post-norm blocks with q/k norms per head; with a `sliding_window_pattern`, its
/// `L` layers attend through the window with RoPE and its `G` layers globally without.
fn exaone4(c: &Args) -> Result<Switches, LoadError> {
    let layers = match c.sliding_window_pattern.as_deref() {
        None | Some("") => vec![LayerSwitches::GLOBAL; c.num_hidden_layers],
        Some(pattern) => {
            let window = c
                .sliding_window
                .ok_or_else(|| Args::missing("sliding_window"))?;
            let pattern: Vec<char> = pattern.chars().collect();
            (0..c.num_hidden_layers)
                .map(|i| match pattern[i % pattern.len()] {
                    'L' => LayerSwitches {
                        window: Some(window),
                        ..LayerSwitches::GLOBAL
                    },
                    _ => LayerSwitches {
                        rotary: Rotary::None,
                        ..LayerSwitches::GLOBAL
                    },
                })
                .collect()
        }
    };
    Ok(Switches {
        qkv_bias: false,
        o_bias: false,
        mlp_bias: false,
        qk_norm: QkNorm::PerHead,
        norms: POST_NORM,
        tied: c.tie_word_embeddings.unwrap_or(false),
        traditional: false,
        layers,
        ..Switches::llama(c)?
    })
}

/// ERNIE 4.5: one `use_bias` for every projection, interleaved RoPE pairs, no scaling.
fn ernie4_5(c: &Args) -> Result<Switches, LoadError> {
    Ok(Switches {
        qkv_bias: c.use_bias,
        o_bias: c.use_bias,
        mlp_bias: c.use_bias,
        traditional: true,
        ..Switches::llama(c)?
    })
}

/// GLM-4.5: q/k norms per head with `use_qk_norm`, q/k/v biases with `attention_bias`, partial
/// rotary without scaling, an untied head, and after `first_k_dense_replace` dense layers,
/// mixtures of experts routed DeepSeek-V3's way (sigmoid scores with a correction bias, expert
/// groups, `routed_scaling_factor`) beside `n_shared_experts` shared ones.
fn glm4_moe(c: &Args) -> Result<Switches, LoadError> {
    for (key, value, supported) in [
        ("scoring_func", &c.scoring_func, "sigmoid"),
        ("topk_method", &c.topk_method, "noaux_tc"),
    ] {
        if let Some(other) = value.as_deref().filter(|v| *v != supported) {
            return Err(LoadError::Config(format!(
                "`{key}` `{other}` is not supported (supported: {supported})"
            )));
        }
    }
    let dense = c.first_k_dense_replace.unwrap_or(0);
    let layers = vec![
        LayerSwitches {
            rotary: Rotary::Plain,
            ..LayerSwitches::GLOBAL
        };
        c.num_hidden_layers
    ];
    let mut switches = Switches {
        o_bias: false,
        mlp_bias: false,
        qk_norm: match c.use_qk_norm.unwrap_or(false) {
            true => QkNorm::PerHead,
            false => QkNorm::None,
        },
        tied: false,
        layers,
        ..Switches::llama(c)?
    }
    .partial_rotary(c)
    .experts(c, true, |i| i >= dense)?;
    if let Some(moe) = &mut switches.moe {
        moe.routing = moe.routing.sigmoid_grouped(
            c.n_group.unwrap_or(1),
            c.topk_group.unwrap_or(1),
            c.routed_scaling_factor.unwrap_or(1.0),
        )?;
        moe.shared = c.n_shared_experts.map(|n| Shared {
            intermediate: moe.experts.intermediate * n,
            gated: false,
            names: SharedNames::SHARED_EXPERTS,
        });
    }
    Ok(switches)
}

/// Hunyuan (dense): q/k norms per head after the rotation with `use_qk_norm`, biases on every
/// attention projection with `attention_bias`, and NTK-alpha RoPE: the base raised by
/// `alpha^(d / (d - 2))` with `rope_scaling.alpha`, no other scaling.
fn hunyuan_v1_dense(c: &Args) -> Result<Switches, LoadError> {
    let dims = c.head_dim() as f64;
    let alpha = c
        .rope_scaling
        .as_ref()
        .and_then(|s| s.get("alpha"))
        .and_then(Value::as_f64)
        .unwrap_or(1.0);
    let base = c.rope_theta.unwrap_or(10000.0) as f64 * alpha.powf(dims / (dims - 2.0));
    let layers = vec![
        LayerSwitches {
            rotary: Rotary::Plain,
            ..LayerSwitches::GLOBAL
        };
        c.num_hidden_layers
    ];
    Ok(Switches {
        mlp_bias: false,
        qk_norm: match c.use_qk_norm.unwrap_or(true) {
            true => QkNorm::PerHeadAfterRope,
            false => QkNorm::None,
        },
        tied: c.tie_word_embeddings.unwrap_or(false),
        rope_base: Some(base as f32),
        layers,
        ..Switches::llama(c)?
    })
}

/// Gemma 2: Gemma's norms (`1 + weight`) before and after each branch, GeGLU, embeddings times
/// √hidden, `query_pre_attn_scalar` for the attention scale, soft caps on the attention scores
/// and the logits, a tied head. (mlx-lm's `gemma2.py` attends globally in every layer.)
fn gemma2(c: &Args) -> Result<Switches, LoadError> {
    let hidden = c.hidden_size as f32;
    let pre_attn = c.query_pre_attn_scalar.unwrap_or(144.0);
    positive_setting("query_pre_attn_scalar", pre_attn)?;
    let attention_softcap = c.attn_logit_softcapping.unwrap_or(50.0);
    let final_softcap = c.final_logit_softcapping.unwrap_or(30.0);
    positive_setting("attn_logit_softcapping", attention_softcap)?;
    positive_setting("final_logit_softcapping", final_softcap)?;
    Ok(Switches {
        qkv_bias: false,
        o_bias: false,
        mlp_bias: false,
        norms: GEMMA_NORMS,
        tied: true,
        layers: vec![LayerSwitches::GLOBAL; c.num_hidden_layers],
        embed_scale: hidden.sqrt(),
        attention_scale: Some(pre_attn.powf(-0.5)),
        norm_plus_one: true,
        activation: ops::Activation::GeluApprox,
        attention_softcap: Some(attention_softcap),
        final_softcap: Some(final_softcap),
        ..Switches::llama(c)?
    })
}

fn positive_setting(key: &str, value: f32) -> Result<(), LoadError> {
    match value > 0.0 && value.is_finite() {
        true => Ok(()),
        false => Err(LoadError::Config(format!(
            "`{key}` must be a positive number, not {value}"
        ))),
    }
}

/// gpt-oss: biases on every attention projection, attention sinks, sliding-window and global
/// layers in turn (unless `layer_types` says), an untied head, and in every layer a mixture of
/// `num_local_experts` experts with biases and the clamped SwiGLU, chosen by a biased `router`.
fn gpt_oss(c: &Args) -> Result<Switches, LoadError> {
    let window = c.sliding_window.unwrap_or(128);
    let base = Switches::llama(c)?;
    let layers = match c.layer_types {
        Some(_) => base.layers.clone(),
        None => (0..c.num_hidden_layers)
            .map(|i| LayerSwitches {
                window: i.is_multiple_of(2).then_some(window),
                ..LayerSwitches::GLOBAL
            })
            .collect(),
    };
    let mut switches = Switches {
        qkv_bias: true,
        o_bias: true,
        mlp_bias: false,
        tied: false,
        layers,
        sinks: true,
        moe_names: MoeNames::GPT_OSS,
        ..base
    }
    .experts(c, true, |_| true)?;
    if let Some(moe) = &mut switches.moe {
        moe.routing = moe.routing.with_router_bias();
        moe.experts = ExpertMlps {
            intermediate: c.intermediate_size,
            activation: ops::Activation::SwigluOai,
            biased: true,
        };
    }
    Ok(switches)
}

/// ERNIE 4.5-MoE: ERNIE 4.5 with mixtures of `moe_num_experts` experts (top `moe_k` by a
/// softmax, renormalized) in every `moe_layer_interval`-th layer from `moe_layer_start_index` to
/// `moe_layer_end_index`, beside `moe_num_shared_experts` ungated shared experts; the experts'
/// projections biased with `use_bias`.
fn ernie4_5_moe(c: &Args) -> Result<Switches, LoadError> {
    if let Some(act) = c.moe_gate_act.as_deref().filter(|a| *a != "softmax") {
        return Err(LoadError::Config(format!(
            "`moe_gate_act` `{act}` is not supported (supported: softmax)"
        )));
    }
    // Each index may be one number or a list (a range per modality): the text model's span.
    let index = |value: &Option<Value>, pick: fn(u64, u64) -> u64| -> Option<usize> {
        match value.as_ref()? {
            Value::Array(items) => items.iter().filter_map(Value::as_u64).reduce(pick),
            other => other.as_u64(),
        }
        .map(|i| i as usize)
    };
    let start = index(&c.moe_layer_start_index, u64::min).unwrap_or(0);
    let end = index(&c.moe_layer_end_index, u64::max).unwrap_or(c.num_hidden_layers.max(1) - 1);
    let interval = c.moe_layer_interval.unwrap_or(1).max(1);
    let experts = c
        .moe_num_experts
        .ok_or_else(|| Args::missing("moe_num_experts"))?;
    let width = c
        .moe_intermediate_size
        .filter(|&w| w > 0)
        .unwrap_or(c.intermediate_size);
    let mut switches = ernie4_5(c)?;
    switches.moe = Some(MoeSwitches {
        routing: Routing::new(experts, c.moe_k.unwrap_or(1), true)?,
        experts: ExpertMlps {
            biased: c.use_bias,
            ..ExpertMlps::swiglu(width)
        },
        shared: c.moe_num_shared_experts.filter(|&n| n > 0).map(|n| Shared {
            intermediate: width * n,
            gated: false,
            names: SharedNames::SHARED_EXPERTS,
        }),
    });
    for (i, layer) in switches.layers.iter_mut().enumerate() {
        layer.moe = (i + 1).is_multiple_of(interval) && (start..=end).contains(&i);
    }
    Ok(switches)
}

/// Seed-OSS: q/k/v biases with `attention_bias`, the output's with `attention_out_bias`.
fn seed_oss(c: &Args) -> Result<Switches, LoadError> {
    Ok(Switches {
        qkv_bias: c.attention_bias.unwrap_or(false),
        o_bias: c.attention_out_bias.unwrap_or(false),
        ..Switches::llama(c)?
    })
}

struct Block {
    attn_norm: Option<RmsNorm>,
    self_attn: Attention,
    attn_out_norm: Option<RmsNorm>,
    mlp_norm: Option<RmsNorm>,
    mlp: FeedForward,
    mlp_out_norm: Option<RmsNorm>,
    window: Option<usize>,
    /// Attends within chunks of this many positions (over a ring of as many).
    chunk: Option<usize>,
    /// How mlx-lm holds this layer's cached keys (see [`MlxForm`]).
    mlx: MlxForm,
}

impl Block {
    /// The positions a ring cache of this layer keeps: its window's, or its chunk's.
    fn ring(&self) -> Option<usize> {
        self.window.or(self.chunk)
    }
}

pub struct Llama {
    info: ModelInfo,
    embed_tokens: Embedding,
    layers: Vec<Block>,
    head: OutputHead,
    embed_scale: f32,
    residual_scale: f32,
    activation: ops::Activation,
    prefix: &'static str,
    mlp_module: MlpModule,
    /// The checkpoint's fused `qkv_proj` and `gate_up_proj`, split on load: adapters name them
    /// whole.
    fused_qkv: bool,
    fused_gate_up: bool,
}

/// Llama 4's q/k norms' ε, which its config does not set.
const UNWEIGHTED_QK_NORM_EPS: f32 = 1e-6;

impl Llama {
    pub fn load(mut ckpt: Checkpoint) -> Result<Self, LoadError> {
        let model_type = ckpt.config.model_type()?.to_string();
        let member = member(&model_type).ok_or_else(|| LoadError::UnsupportedModelType {
            found: model_type.clone(),
            supported: member_types().collect(),
        })?;
        let mut c: Args = ckpt.config.args()?;
        c.rope_parameters = c.model_wide_rope()?;
        let s = member(&c)?;
        let (hidden, n_layers, intermediate) =
            (c.hidden_size, c.num_hidden_layers, c.intermediate_size);
        let heads = c.num_attention_heads;
        let kv_heads = c.num_key_value_heads.unwrap_or(heads);
        let head_dim = s.head_dim;
        let rotary_dims = (head_dim as f32 * s.rotary_fraction) as usize;
        let (vocab, eps) = (c.vocab_size, c.rms_norm_eps);
        if heads == 0 || kv_heads == 0 || !heads.is_multiple_of(kv_heads) {
            return Err(LoadError::Config(format!(
                "{heads} attention heads cannot be grouped over {kv_heads} key/value heads"
            )));
        }
        if s.layers.len() != n_layers {
            return Err(LoadError::Config(format!(
                "{} layer types for {n_layers} layers",
                s.layers.len()
            )));
        }
        if rotary_dims > head_dim || !rotary_dims.is_multiple_of(2) {
            return Err(LoadError::Config(format!(
                "{rotary_dims} rotary features of a {head_dim}-wide head"
            )));
        }
        let prefix = s.prefix;
        if !prefix.is_empty() {
            ckpt.discard_where(|name| {
                ["vision_tower.", "vision_model.", "multi_modal_projector."]
                    .iter()
                    .any(|tower| name.starts_with(tower))
            });
        }
        // Embedding checkpoints saved as a bare `Qwen3Model` (Qwen3-Embedding-8B, which is untied)
        // have no head: their hidden states are what they are for, so the embeddings stand in.
        let tied = s.tied || !ckpt.contains(&format!("{prefix}lm_head.weight"));
        let theta = s.rope_base.or(c.rope_theta).unwrap_or_else(|| {
            c.rope_parameters
                .as_ref()
                .and_then(|p| p.get("rope_theta"))
                .and_then(Value::as_f64)
                .unwrap_or(10000.0) as f32
        });
        let mut scaling = c.rope_scaling.clone().or(c.rope_parameters.clone());
        if let (Some(Value::Object(section)), Some(context)) = (&mut scaling, s.original_context) {
            let key = "original_max_position_embeddings".to_string();
            section.entry(key).or_insert(context.into());
        }
        let scaling = scaling.as_ref();
        let device = ckpt.device.clone();
        let context = c.max_position_embeddings;
        let rope = |rotary: Rotary| {
            let dims = rotary_dims;
            match rotary {
                Rotary::Scaled => Rope::new(dims, theta, s.traditional, scaling, context, &device),
                Rotary::Plain => Rope::new(dims, theta, s.traditional, None, context, &device),
                Rotary::None => Rope::none(dims, &device),
            }
        };
        let ropes = [Rotary::Scaled, Rotary::Plain, Rotary::None]
            .into_iter()
            .filter(|r| s.layers.iter().any(|l| l.rotary == *r))
            .map(|r| Ok((r, rope(r)?)))
            .collect::<Result<Vec<_>, LoadError>>()?;
        ckpt.discard_where(|name| name.contains("self_attn.rotary_emb.inv_freq"));
        if tied {
            ckpt.discard_where(|name| name.starts_with(&format!("{prefix}lm_head.")));
        }
        let (q_width, kv_width) = (heads * head_dim, kv_heads * head_dim);
        for i in 0..n_layers {
            let block = format!("{prefix}model.layers.{i}");
            if s.fused_qkv {
                let parts = [
                    ("q_proj", q_width),
                    ("k_proj", kv_width),
                    ("v_proj", kv_width),
                ]
                .map(|(name, rows)| (format!("{block}.self_attn.{name}"), rows));
                ckpt.split_rows(&format!("{block}.self_attn.qkv_proj"), &parts)?;
            }
            if s.fused_gate_up {
                let parts = [("gate_proj", intermediate), ("up_proj", intermediate)]
                    .map(|(name, rows)| (format!("{block}.mlp.{name}"), rows));
                ckpt.split_rows(&format!("{block}.mlp.gate_up_proj"), &parts)?;
            }
        }

        let mut root = ckpt.scope(prefix.trim_end_matches('.'));
        let mut model = root.pp("model");
        let embed_tokens = Embedding::load(&mut model.pp("embed_tokens"), vocab, hidden)?;
        let load_norm = |vb: &mut Scope, dim: usize| match s.norm_plus_one {
            true => RmsNorm::load_plus_one(vb, dim, eps),
            false => RmsNorm::load(vb, dim, eps),
        };
        let norm = |vb: &mut Scope, name: Option<&str>, dim: usize| {
            name.map(|name| load_norm(&mut vb.pp(name), dim))
                .transpose()
        };
        let mut blocks = Vec::with_capacity(n_layers);
        for (i, layer) in s.layers.iter().enumerate() {
            let mut block = model.pp(format_args!("layers.{i}"));
            let mut a = block.pp("self_attn");
            let qk_norm = |a: &mut Scope, which: &str, width: usize| match s.qk_norm {
                QkNorm::None => Ok(None),
                QkNorm::UnweightedAfterRope => Ok((layer.rotary != Rotary::None)
                    .then(|| RmsNorm::unscaled(head_dim, UNWEIGHTED_QK_NORM_EPS, &device))
                    .transpose()?),
                QkNorm::PerHead => RmsNorm::load(&mut a.pp(which), head_dim, eps).map(Some),
                QkNorm::Full => RmsNorm::load(&mut a.pp(which), width, eps).map(Some),
                QkNorm::PerHeadAfterRope => {
                    let name = if which == "q_norm" {
                        "query_layernorm"
                    } else {
                        "key_layernorm"
                    };
                    RmsNorm::load(&mut a.pp(name), head_dim, eps).map(Some)
                }
            };
            let mut rope = ropes
                .iter()
                .find(|(r, _)| *r == layer.rotary)
                .map(|(_, rope)| rope.clone())
                .expect("a RoPE was made for each kind in use");
            // The rotation's amplitude moves onto the softmax scale; mlx-lm's cached keys keep it.
            let gain = rope.take_amplitude(head_dim);
            let mlx = MlxForm {
                key_scale: gain.sqrt(),
                chunked: layer.chunk.is_some(),
                ..MlxForm::default()
            };
            let self_attn = Attention {
                q_proj: Linear::load(&mut a.pp("q_proj"), hidden, q_width, s.qkv_bias)?,
                k_proj: Linear::load(&mut a.pp("k_proj"), hidden, kv_width, s.qkv_bias)?,
                v_proj: Linear::load(&mut a.pp("v_proj"), hidden, kv_width, s.qkv_bias)?,
                o_proj: Linear::load(&mut a.pp("o_proj"), q_width, hidden, s.o_bias)?,
                q_norm: qk_norm(&mut a, "q_norm", q_width)?,
                k_norm: qk_norm(&mut a, "k_norm", kv_width)?,
                heads,
                kv_heads,
                head_dim,
                scale: s.attention_scale.unwrap_or((head_dim as f32).powf(-0.5)) * gain,
                rope,
                query_scale: layer.query_scale,
                norm_after_rope: matches!(
                    s.qk_norm,
                    QkNorm::PerHeadAfterRope | QkNorm::UnweightedAfterRope
                ),
                softcap: s.attention_softcap,
                sinks: s
                    .sinks
                    .then(|| load_vector(&mut a, "sinks", heads))
                    .transpose()?,
                chunk: layer.chunk,
            };
            let mlp = match (&s.moe, layer.moe) {
                (Some(moe), true) => FeedForward::Moe(SparseMoe::load(
                    &mut block,
                    s.moe_names,
                    hidden,
                    moe.routing,
                    moe.experts,
                    moe.shared,
                )?),
                _ => FeedForward::Dense(Mlp::load(
                    &mut block.pp(s.mlp_module.name),
                    hidden,
                    s.mlp_width.unwrap_or(intermediate),
                    s.mlp_bias,
                )?),
            };
            blocks.push(Block {
                attn_norm: norm(&mut block, s.norms.attn_in, hidden)?,
                self_attn,
                attn_out_norm: norm(&mut block, s.norms.attn_out, hidden)?,
                mlp_norm: norm(&mut block, s.norms.mlp_in, hidden)?,
                mlp,
                mlp_out_norm: norm(&mut block, s.norms.mlp_out, hidden)?,
                window: layer.window,
                chunk: layer.chunk,
                mlx,
            });
        }
        let mut norm = load_norm(&mut model.pp("norm"), hidden)?;
        if s.logit_scale != 1.0 {
            // The head is linear and the norm's output feeds only it.
            ops::scale_inplace(&mut norm.weight, s.logit_scale).map_err(|source| {
                LoadError::Engine {
                    name: "model.norm.weight".into(),
                    source,
                }
            })?;
        }
        let lm_head = (!tied)
            .then(|| Linear::load(&mut root.pp("lm_head"), hidden, vocab, false))
            .transpose()?;
        ckpt.finish()?;
        Ok(Llama {
            info: ModelInfo {
                model_type,
                vocab_size: vocab,
                hidden_size: hidden,
                num_layers: n_layers,
                max_context: c.max_position_embeddings,
                device,
            },
            embed_tokens,
            layers: blocks,
            head: OutputHead {
                norm,
                lm_head,
                softcap: s.final_softcap,
            },
            embed_scale: s.embed_scale,
            activation: s.activation,
            residual_scale: s.residual_scale,
            prefix,
            mlp_module: s.mlp_module,
            fused_qkv: s.fused_qkv,
            fused_gate_up: s.fused_gate_up,
        })
    }

    /// `h += residual_scale · out_norm(linear(x))`, in one op where there is no norm or scale.
    fn add_branch(
        &self,
        linear: &Linear,
        x: &Tensor,
        lora: ModuleAdapters,
        name: &str,
        out_norm: Option<&RmsNorm>,
        h: &mut Tensor,
    ) -> OpResult<()> {
        let adapter = lora.get(name);
        if out_norm.is_none() && self.residual_scale == 1.0 {
            return linear.add_forward(x, adapter, h);
        }
        let mut r = linear.forward_adapted(x, adapter)?;
        if let Some(norm) = out_norm {
            norm.forward_inplace(&mut r)?;
        }
        if self.residual_scale != 1.0 {
            ops::scale_inplace(&mut r, self.residual_scale)?;
        }
        ops::add_inplace(h, &r)
    }
}

impl Block {
    /// The heads' outputs over this layer's caches: plain ones for a global layer, rings for a
    /// windowed one (or a global one's bounded by `--max-kv-size`).
    fn attend(
        &self,
        input: Input,
        positions: &Positions,
        caches: LayerCaches,
        lora: ModuleAdapters,
    ) -> Result<Tensor, ForwardError> {
        let a = &self.self_attn;
        let fits = |s: (usize, usize)| s == (a.kv_heads, a.head_dim);
        match caches {
            LayerCaches::Kv(mut kvs)
                if self.ring().is_none() && kvs.iter().all(|c| fits(c.shape())) =>
            {
                Ok(a.attend(input, positions, &mut kvs, lora)?)
            }
            LayerCaches::Rotating(mut rings)
                if rings.iter().all(|c| {
                    fits(c.shape()) && (self.ring().is_some() || c.keeps_first_positions())
                }) =>
            {
                Ok(a.attend(input, positions, &mut rings, lora)?)
            }
            _ => Err(ForwardError::CacheMismatch),
        }
    }
}

fn input<'a>(h: &'a Tensor, norm: &'a Option<RmsNorm>) -> Input<'a> {
    match norm {
        Some(norm) => Input::Normed(h, norm),
        None => Input::Plain(h),
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
                Ok(match b.ring() {
                    Some(window) => LayerCache::Rotating(
                        RotatingKvCache::new(a.kv_heads, a.head_dim, window, device)?
                            .with_mlx_form(b.mlx),
                    ),
                    None => LayerCache::Kv(
                        KvCache::new(a.kv_heads, a.head_dim, device)?.with_mlx_form(b.mlx),
                    ),
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
            let (attn_lora, mlp_lora) = (lora("self_attn"), lora(self.mlp_module.name));
            // Norms are folded into the projections where the device can.
            let normed = input(&h, &block.attn_norm);
            let out = block.attend(normed, &positions, caches.layer(i)?, attn_lora)?;
            let (o_proj, out_norm) = (&block.self_attn.o_proj, block.attn_out_norm.as_ref());
            self.add_branch(o_proj, &out, attn_lora, "o_proj", out_norm, &mut h)?;
            match &block.mlp {
                FeedForward::Dense(mlp) => {
                    let normed = input(&h, &block.mlp_norm);
                    let act = mlp.gated(normed, mlp_lora, self.activation)?;
                    let out_norm = block.mlp_out_norm.as_ref();
                    self.add_branch(
                        &mlp.down_proj,
                        &act,
                        mlp_lora,
                        "down_proj",
                        out_norm,
                        &mut h,
                    )?;
                }
                FeedForward::Moe(moe) => {
                    let x = match &block.mlp_norm {
                        Some(norm) => norm.forward(&h)?,
                        None => h.try_clone()?,
                    };
                    let mut r = moe.forward(&x, lora)?;
                    if let Some(norm) = &block.mlp_out_norm {
                        norm.forward_inplace(&mut r)?;
                    }
                    if self.residual_scale != 1.0 {
                        ops::scale_inplace(&mut r, self.residual_scale)?;
                    }
                    ops::add_inplace(&mut h, &r)?;
                }
            }
        }
        caches.finish();
        Ok(h)
    }

    fn output(&self) -> (&OutputHead, &Embedding) {
        (&self.head, &self.embed_tokens)
    }
}

impl Adaptable for Llama {
    fn blocks_path(&self) -> &'static str {
        match self.prefix {
            "" => "model.layers",
            _ => "language_model.model.layers",
        }
    }

    fn block_linears(&self) -> Vec<Vec<LinearShape>> {
        let blocks = self.layers.iter();
        blocks
            .map(|b| {
                let mut attn = b.self_attn.linears();
                if self.fused_qkv {
                    let qkv = LinearShape::fused("self_attn.qkv_proj", &attn[..3]);
                    attn.splice(..3, [qkv]);
                }
                let mut mlp = match &b.mlp {
                    FeedForward::Dense(mlp) => mlp.linears_named(self.mlp_module.keys),
                    moe => moe.linears(),
                };
                if self.fused_gate_up && matches!(b.mlp, FeedForward::Dense(_)) {
                    let gate_up = LinearShape::fused("mlp.gate_up_proj", &mlp[..2]);
                    mlp.splice(..2, [gate_up]);
                }
                [attn, mlp].concat()
            })
            .collect()
    }

    fn decoder(&self) -> &dyn Decoder {
        self
    }
}

impl Decoder for Llama {
    fn embed(&self, tokens: &[u32]) -> OpResult<Tensor> {
        let mut h = self.embed_tokens.forward(tokens)?;
        if self.embed_scale != 1.0 {
            ops::scale_inplace(&mut h, self.embed_scale)?;
        }
        Ok(h)
    }

    fn blocks(&self, _tokens: &[u32]) -> OpResult<Vec<DecoderBlock<'_>>> {
        let blocks = self.layers.iter();
        Ok(blocks
            .map(|b| DecoderBlock {
                input_norm: b.attn_norm.as_ref(),
                mixer: Box::new(AttentionGrad {
                    attn: &b.self_attn,
                    window: b.window,
                }),
                mixer_out_norm: b.attn_out_norm.as_ref(),
                mlp_norm: b.mlp_norm.as_ref(),
                mlp: match &b.mlp {
                    FeedForward::Dense(mlp) => Box::new(GatedMlpGrad {
                        mlp,
                        activation: self.activation,
                    }),
                    moe => moe.grad(),
                },
                mlp_out_norm: b.mlp_out_norm.as_ref(),
                tail: None,
                output_scale: 1.0,
                branch_scale: self.residual_scale,
            })
            .collect())
    }
}
