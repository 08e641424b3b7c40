//! The renames mlx-lm's models apply to a Hugging Face checkpoint as they load it (each
//! architecture's `sanitize`), so that `oxlm convert` writes the names `mlx_lm.convert` writes:
//! experts stacked into one `switch_mlp` array per projection (or fused ones split), tied or
//! unused arrays dropped, a multimodal checkpoint's text model under `language_model.`,
//! convolutions laid out as MLX's `Conv1d` reads them, norm weights stored as offsets from 1
//! shifted back.

use std::collections::BTreeMap;

use serde_json::Value;

use crate::ConvertError;

/// Where an output array's values come from, in the source's names.
#[derive(Debug, Clone, PartialEq)]
pub enum Origin {
    /// One source array, as it is.
    Tensor(String),
    /// Arrays of one shape stacked on a new leading axis (a mixture's experts, in order).
    Stack(Vec<String>),
    /// Part `part` of `parts` equal slices of the last axis, with the last two axes swapped: a
    /// `[C, 1, K]` convolution weight as `[C, K, 1]` (one part), Llama 4's fused experts
    /// `[E, H, 2I]` as gate and up `[E, I, H]` (two).
    SwapLastAxes {
        name: String,
        part: usize,
        parts: usize,
    },
    /// Part `part` of `parts` equal slices of the second-to-last axis, per leading index:
    /// a fused `[E, 2I, H]` expert input projection split into gate and up.
    RowSlice {
        name: String,
        part: usize,
        parts: usize,
    },
    /// Every `step`-th slice of axis `axis` (counted from the end: 0 the last axis, 1 the one
    /// before), from `start`: gpt-oss's interleaved gate and up rows.
    Strided {
        name: String,
        axis: usize,
        start: usize,
        step: usize,
    },
    /// Packed 4-bit blocks `[.., R, G, B]` (bytes) as `[.., R', G * B / 4]` uint32 words (mlx-lm's
    /// `view(uint32).flatten(-2)`), keeping every `step`-th of the `R` rows from `start`:
    /// gpt-oss's MXFP4 experts.
    Words {
        name: String,
        start: usize,
        step: usize,
    },
    /// A source array plus a constant, computed in the source's dtype: a norm weight stored as
    /// its offset from 1.
    Shifted { name: String, by: f32 },
    /// Rows `start..start + rows` of each of `heads` equal row blocks of a matrix, as
    /// `[heads, rows, cols]`, or `[heads, cols, rows]` when `transposed`: DeepSeek-V3's
    /// `kv_b_proj` as its per-head `embed_q` and `unembed_out`.
    HeadRows {
        name: String,
        heads: usize,
        start: usize,
        rows: usize,
        transposed: bool,
    },
}

impl Origin {
    /// `name` with its last two axes swapped.
    pub fn swapped(name: &str) -> Origin {
        Origin::SwapLastAxes {
            name: name.to_string(),
            part: 0,
            parts: 1,
        }
    }

    /// The source arrays it reads.
    pub fn sources(&self) -> Vec<&String> {
        match self {
            Origin::Tensor(n) => vec![n],
            Origin::SwapLastAxes { name, .. }
            | Origin::RowSlice { name, .. }
            | Origin::Strided { name, .. }
            | Origin::Words { name, .. }
            | Origin::Shifted { name, .. }
            | Origin::HeadRows { name, .. } => vec![name],
            Origin::Stack(names) => names.iter().collect(),
        }
    }
}

/// The architectures whose checkpoints `oxlm convert` reads from the Hugging Face layout.
pub const SUPPORTED: &[&str] = &[
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "qwen3_moe",
    "qwen3_next",
    "qwen3_5",
    "qwen3_5_moe",
    "mixtral",
    "phi3",
    "gemma2",
    "gemma3_text",
    "gemma3",
    "gemma4_text",
    "gemma4",
    "smollm3",
    "olmo2",
    "olmo3",
    "olmoe",
    "granite",
    "granitemoe",
    "granitemoehybrid",
    "nemotron_h",
    "minicpm",
    "llama4",
    "glm4",
    "glm4_moe",
    "exaone4",
    "ernie4_5",
    "ernie4_5_moe",
    "seed_oss",
    "hunyuan_v1_dense",
    "iquestcoder",
    "xverse",
    "ministral3",
    "mistral3",
    "lfm2",
    "lfm2_moe",
    "gpt_oss",
    "deepseek_v3",
    "kimi_k2",
];

/// The output arrays and where each comes from, for a checkpoint of `config`'s model type
/// holding `shapes` (each source array's name and shape).
pub fn sanitize(
    config: &Value,
    shapes: &BTreeMap<String, Vec<usize>>,
) -> Result<BTreeMap<String, Origin>, ConvertError> {
    let model_type = config["model_type"].as_str().unwrap_or_default();
    if !SUPPORTED.contains(&model_type) {
        return Err(ConvertError::UnsupportedModelType {
            found: model_type.to_string(),
            supported: SUPPORTED,
        });
    }
    let arrays = shapes
        .keys()
        .map(|n| (n.clone(), Origin::Tensor(n.clone())));
    let text = config.get("text_config").unwrap_or(config);
    match model_type {
        // Llama 4: the text model's arrays as they are but the experts, vision dropped.
        "llama4" => Ok(sanitize_llama4(arrays.collect())),
        // Mistral 3 (llava): the text model's arrays under `language_model.`, vision dropped.
        "mistral3" => {
            let text_arrays = arrays.filter_map(|(name, origin)| {
                if name.contains("vision_tower") || name.contains("multi_modal_projector") {
                    return None;
                }
                let text_name = match name.strip_prefix("model.language_model.") {
                    Some(rest) => format!("model.{rest}"),
                    None => name
                        .strip_prefix("language_model.")
                        .unwrap_or(&name)
                        .to_string(),
                };
                Some((text_name, origin))
            });
            let sanitized = sanitize_text(text, text_arrays.collect(), shapes)?;
            Ok(prefixed("language_model.", sanitized))
        }
        // Gemma 3: the `language_model` subtree sanitized as gemma3_text; the top-level
        // `vision_tower` and `multi_modal_projector` subtrees dropped, anything else kept.
        "gemma3" => {
            let mut kept = BTreeMap::new();
            let mut language = BTreeMap::new();
            for (name, origin) in arrays {
                if let Some(rest) = name.strip_prefix("language_model.") {
                    language.insert(rest.to_string(), origin);
                } else if !name.starts_with("vision_tower.")
                    && !name.starts_with("multi_modal_projector.")
                {
                    kept.insert(name, origin);
                }
            }
            kept.extend(prefixed(
                "language_model.",
                sanitize_text(text, language, shapes)?,
            ));
            Ok(kept)
        }
        // Qwen3.5: `model.language_model.` -> `language_model.model.`, anything else not yet
        // under `language_model.` moved there, the vision tower dropped; the text model's
        // sanitize then sees the prefixed names.
        "qwen3_5" | "qwen3_5_moe" => {
            let renamed = arrays.filter_map(|(name, origin)| {
                if name.starts_with("vision_tower") || name.starts_with("model.visual") {
                    return None;
                }
                let name = match name.strip_prefix("model.language_model") {
                    Some(rest) => format!("language_model.model{rest}"),
                    None if name.starts_with("language_model.") => name,
                    None => format!("language_model.{name}"),
                };
                Some((name, origin))
            });
            let mut arrays: BTreeMap<String, Origin> = renamed.collect();
            if model_type == "qwen3_5_moe" {
                split_fused_experts(&mut arrays, text, "language_model.model.layers.{}.mlp");
            }
            Ok(sanitize_qwen3_5_text(text, arrays, shapes))
        }
        // Gemma 4: `model.` dropped and `language_model.` -> `language_model.model.` on the
        // names that had it, the vision and audio towers and their embedders dropped; the text
        // model's sanitize then sees the prefixed names.
        "gemma4" => {
            const DROPPED: [&str; 6] = oxlm_models::gemma4::NON_TEXT_MODULES;
            let renamed = arrays.filter_map(|(name, origin)| {
                let Some(rest) = name.strip_prefix("model.") else {
                    return (!DROPPED.iter().any(|d| name.starts_with(d)))
                        .then_some((name, origin));
                };
                if DROPPED.iter().any(|d| rest.starts_with(d)) {
                    return None;
                }
                let name = match rest.starts_with("language_model") {
                    true => rest.replace("language_model.", "language_model.model."),
                    false => rest.to_string(),
                };
                Some((name, origin))
            });
            Ok(sanitize_gemma4_text(text, renamed.collect()))
        }
        _ => sanitize_text(config, arrays.collect(), shapes),
    }
}

/// Llama 4's `sanitize`: the vision model and projector dropped; each layer's fused experts
/// (`experts.gate_up_proj` `[E, H, 2I]`, `experts.down_proj` `[E, I, H]`) as mlx-lm's
/// `SwitchGLU` layers, transposed, gate the first half of the fused columns.
fn sanitize_llama4(mut arrays: BTreeMap<String, Origin>) -> BTreeMap<String, Origin> {
    arrays.retain(|name, _| {
        !name.contains("vision_model") && !name.contains("multi_modal_projector")
    });
    let fused: Vec<String> = arrays
        .keys()
        .filter(|n| n.ends_with("feed_forward.experts.gate_up_proj"))
        .cloned()
        .collect();
    for name in fused {
        arrays.remove(&name);
        let experts = name.trim_end_matches("gate_up_proj");
        for (part, projection) in ["gate_proj", "up_proj"].into_iter().enumerate() {
            let origin = Origin::SwapLastAxes {
                name: name.clone(),
                part,
                parts: 2,
            };
            arrays.insert(format!("{experts}{projection}.weight"), origin);
        }
        let down = format!("{experts}down_proj");
        if arrays.remove(&down).is_some() {
            arrays.insert(format!("{down}.weight"), Origin::swapped(&down));
        }
    }
    arrays
}

fn prefixed(prefix: &str, arrays: BTreeMap<String, Origin>) -> BTreeMap<String, Origin> {
    arrays
        .into_iter()
        .map(|(name, origin)| (format!("{prefix}{name}"), origin))
        .collect()
}

/// The shape of the source array an unchanged origin reads.
fn shape<'a>(shapes: &'a BTreeMap<String, Vec<usize>>, origin: &Origin) -> &'a [usize] {
    match origin {
        Origin::Tensor(n) => shapes.get(n).map_or(&[], Vec::as_slice),
        _ => &[],
    }
}

/// A text model's `sanitize`.
fn sanitize_text(
    config: &Value,
    mut arrays: BTreeMap<String, Origin>,
    shapes: &BTreeMap<String, Vec<usize>>,
) -> Result<BTreeMap<String, Origin>, ConvertError> {
    let model_type = config["model_type"].as_str().unwrap_or_default();
    if model_type == "qwen3_next" {
        return sanitize_qwen3_next(config, arrays, shapes);
    }
    if model_type == "gemma4_text" {
        return Ok(sanitize_gemma4_text(config, arrays));
    }
    // Precomputed RoPE frequencies: the runtime computes its own.
    arrays.retain(|name, _| !name.contains("rotary_emb.inv_freq"));
    // MiniCPM never drops its head (it copies the embedding when there is none); Gemma 3 keeps
    // one the checkpoint holds and drops its module otherwise.
    let drops_tied_head = !matches!(model_type, "minicpm" | "gemma3_text" | "nemotron_h");
    if drops_tied_head && config["tie_word_embeddings"].as_bool().unwrap_or(true) {
        arrays.remove("lm_head.weight");
    }
    match model_type {
        "minicpm" if !arrays.contains_key("lm_head.weight") => {
            // MiniCPM's head is a copy of the embedding when the checkpoint has none.
            let embedding = arrays.get("model.embed_tokens.weight").cloned();
            if let Some(origin) = embedding {
                arrays.insert("lm_head.weight".into(), origin);
            }
        }
        "ernie4_5_moe" => {
            const UNUSED: [&str; 5] = [
                "mtp_block.",
                "mtp_linear_proj.",
                "mtp_hidden_norm.",
                "mtp_emb_norm.",
                "e_score_correction_bias",
            ];
            arrays.retain(|name, _| !UNUSED.iter().any(|u| name.contains(u)));
        }
        "glm4_moe" => {
            // The multi-token prediction layer, after the last decoder layer.
            let layers = config["num_hidden_layers"].as_u64().unwrap_or(0);
            let prediction = format!("model.layers.{layers}");
            arrays.retain(|name, _| !name.starts_with(&prediction));
        }
        "deepseek_v3" | "kimi_k2" => sanitize_deepseek_v3(config, &mut arrays)?,
        "granitemoe" => split_granite(
            &mut arrays,
            "block_sparse_moe",
            "block_sparse_moe.switch_mlp",
        ),
        "granitemoehybrid" => {
            qwen_linear_attention_layout(&mut arrays, shapes, false);
            if config["num_local_experts"].as_u64().unwrap_or(0) > 0 {
                split_granite(
                    &mut arrays,
                    "block_sparse_moe",
                    "block_sparse_moe.switch_mlp",
                );
            } else {
                split_granite(&mut arrays, "shared_mlp", "mlp");
            }
        }
        "nemotron_h" => {
            // The multi-token prediction layers.
            arrays.retain(|name, _| !name.starts_with("mtp."));
            qwen_linear_attention_layout(&mut arrays, shapes, false);
            stack_experts(&mut arrays, &[("up_proj", "fc1"), ("down_proj", "fc2")])?;
        }
        "lfm2" | "lfm2_moe" => {
            for (name, origin) in arrays.iter_mut() {
                // `[C, 1, K]` to `[C, K, 1]`, where the kernel axis is the last (mlx-lm's
                // `shape[-1] > shape[1]`).
                let swap = matches!(shape(shapes, origin), [_, b, k] if k > b);
                if let (Origin::Tensor(source), true) =
                    (&*origin, name.contains("conv.weight") && swap)
                {
                    *origin = Origin::swapped(source);
                }
            }
            if model_type == "lfm2_moe" {
                arrays = arrays
                    .into_iter()
                    .map(|(name, origin)| (lfm2_moe_rename(&name), origin))
                    .collect();
            }
        }
        "gpt_oss" => return Ok(sanitize_gpt_oss(arrays)),
        _ => {}
    }
    let renames: &[(&str, &str)] = match model_type {
        "mixtral" => &[("w1", "gate_proj"), ("w2", "down_proj"), ("w3", "up_proj")],
        _ => &[],
    };
    stack_experts(&mut arrays, renames)?;
    Ok(arrays)
}

/// LFM2-MoE names its projections `w1`, `w2`, `w3` (its dense layers' and its experts').
fn lfm2_moe_rename(name: &str) -> String {
    [
        ("w1.weight", "gate_proj.weight"),
        ("w2.weight", "down_proj.weight"),
        ("w3.weight", "up_proj.weight"),
    ]
    .iter()
    .fold(name.to_string(), |n, (from, to)| n.replace(from, to))
}

/// The norms Qwen3-Next and Qwen3.5 checkpoints store as offsets from 1.
const QWEN_OFFSET_NORMS: [&str; 5] = [
    ".input_layernorm.weight",
    ".post_attention_layernorm.weight",
    "model.norm.weight",
    ".q_norm.weight",
    ".k_norm.weight",
];

/// A `[C, 1, K]` conv1d weight as `[C, K, 1]` and each offset norm plus 1.0 (`shift_norms`).
fn qwen_linear_attention_layout(
    arrays: &mut BTreeMap<String, Origin>,
    shapes: &BTreeMap<String, Vec<usize>>,
    shift_norms: bool,
) {
    for (name, origin) in arrays.iter_mut() {
        let Origin::Tensor(source) = &*origin else {
            continue;
        };
        let shape = shapes.get(source).map_or(&[][..], Vec::as_slice);
        if name.contains("conv1d.weight") && shape.last().is_some_and(|&k| k != 1) {
            *origin = Origin::swapped(source);
        } else if shift_norms
            && shape.len() == 1
            && QWEN_OFFSET_NORMS.iter().any(|n| name.ends_with(n))
        {
            *origin = Origin::Shifted {
                name: source.clone(),
                by: 1.0,
            };
        }
    }
}

/// Qwen3-Next's `sanitize`: only a checkpoint with unstacked experts is touched; then the
/// multi-token-prediction arrays and a tied head are dropped, the experts stacked, the conv
/// weights laid out for MLX and the offset norms shifted.
fn sanitize_qwen3_next(
    config: &Value,
    mut arrays: BTreeMap<String, Origin>,
    shapes: &BTreeMap<String, Vec<usize>>,
) -> Result<BTreeMap<String, Origin>, ConvertError> {
    let unstacked = arrays
        .keys()
        .any(|n| n.starts_with("model.layers.") && n.ends_with(".mlp.experts.0.up_proj.weight"));
    if !unstacked {
        return Ok(arrays);
    }
    arrays.retain(|name, _| !name.contains("mtp."));
    if config["tie_word_embeddings"].as_bool().unwrap_or(false) {
        arrays.remove("lm_head.weight");
    }
    stack_experts(&mut arrays, &[])?;
    qwen_linear_attention_layout(&mut arrays, shapes, true);
    Ok(arrays)
}

/// Qwen3.5's text model `sanitize` (on `language_model.` names): the multi-token-prediction
/// arrays dropped, the conv weights laid out for MLX, and the offset norms shifted when the
/// conv weights were not yet (a Hugging Face checkpoint).
fn sanitize_qwen3_5_text(
    config: &Value,
    mut arrays: BTreeMap<String, Origin>,
    shapes: &BTreeMap<String, Vec<usize>>,
) -> BTreeMap<String, Origin> {
    let hf_layout = arrays.iter().any(|(name, origin)| {
        name.contains("conv1d.weight") && shape(shapes, origin).last().is_some_and(|&k| k != 1)
    });
    arrays.retain(|name, _| !name.contains("mtp."));
    // mlx-lm pops the unprefixed `lm_head.weight`: nothing, under the wrapper.
    if config["tie_word_embeddings"].as_bool().unwrap_or(false) {
        arrays.remove("lm_head.weight");
    }
    qwen_linear_attention_layout(&mut arrays, shapes, hf_layout);
    arrays
}

/// `….experts.gate_up_proj` `[E, 2I, H]` (gate rows, then up) and `….experts.down_proj`
/// of each layer (`prefix` with `{}` for the layer) as `switch_mlp` projections.
fn split_fused_experts(arrays: &mut BTreeMap<String, Origin>, config: &Value, prefix: &str) {
    let layers = config["num_hidden_layers"].as_u64().unwrap_or(0);
    for layer in 0..layers {
        let prefix = prefix.replace("{}", &layer.to_string());
        let Some(Origin::Tensor(fused)) = arrays.remove(&format!("{prefix}.experts.gate_up_proj"))
        else {
            continue;
        };
        for (part, projection) in ["gate_proj", "up_proj"].into_iter().enumerate() {
            let origin = Origin::RowSlice {
                name: fused.clone(),
                part,
                parts: 2,
            };
            arrays.insert(format!("{prefix}.switch_mlp.{projection}.weight"), origin);
        }
        if let Some(down) = arrays.remove(&format!("{prefix}.experts.down_proj")) {
            arrays.insert(format!("{prefix}.switch_mlp.down_proj.weight"), down);
        }
    }
}

/// Gemma 4's text model `sanitize`: rotary buffers and the clipping bounds dropped, the
/// KV-shared layers' own K/V projections (unused) dropped, fused experts split.
fn sanitize_gemma4_text(
    config: &Value,
    arrays: BTreeMap<String, Origin>,
) -> BTreeMap<String, Origin> {
    const DROPPED: [&str; 5] = [
        "self_attn.rotary_emb",
        "input_max",
        "input_min",
        "output_max",
        "output_min",
    ];
    const SHARED_KV: [&str; 3] = [
        ".self_attn.k_proj",
        ".self_attn.v_proj",
        ".self_attn.k_norm",
    ];
    // mlx-lm's defaults where the config says nothing.
    let layers = config["num_hidden_layers"].as_u64().unwrap_or(35);
    let first_shared = layers as i64 - config["num_kv_shared_layers"].as_i64().unwrap_or(20);
    let mut out = BTreeMap::new();
    for (name, origin) in arrays {
        if DROPPED.iter().any(|d| name.contains(d)) {
            continue;
        }
        if SHARED_KV.iter().any(|s| name.contains(s)) {
            let layer = name
                .split_once("layers.")
                .and_then(|(_, rest)| rest.split('.').next())
                .and_then(|l| l.parse::<i64>().ok());
            if layer.is_some_and(|l| l >= first_shared) {
                continue;
            }
        }
        if let Some(base) = name.strip_suffix(".experts.gate_up_proj") {
            let Origin::Tensor(fused) = origin else {
                unreachable!("source arrays are as they are");
            };
            for (part, projection) in ["gate_proj", "up_proj"].into_iter().enumerate() {
                let origin = Origin::RowSlice {
                    name: fused.clone(),
                    part,
                    parts: 2,
                };
                out.insert(
                    format!("{base}.experts.switch_glu.{projection}.weight"),
                    origin,
                );
            }
            continue;
        }
        if let Some(base) = name.strip_suffix(".experts.down_proj") {
            out.insert(
                format!("{base}.experts.switch_glu.down_proj.weight"),
                origin,
            );
            continue;
        }
        out.insert(name, origin);
    }
    out
}

/// gpt-oss keeps each layer's experts stacked, gate and up interleaved row by row
/// (`gate_up_proj` `[E, 2I, H]`, its bias `[E, 2I]`), as MXFP4 `_blocks` and `_scales` in
/// OpenAI's release; mlx-lm views the blocks as words and splits the even and odd rows.
fn sanitize_gpt_oss(arrays: BTreeMap<String, Origin>) -> BTreeMap<String, Origin> {
    if arrays.keys().any(|k| k.contains("gate_proj.weight")) {
        return arrays; // already sanitized
    }
    let mut out = BTreeMap::new();
    for (name, origin) in arrays {
        let Origin::Tensor(source) = &origin else {
            unreachable!("source arrays are as they are");
        };
        let rows = |start: usize, step: usize| match name.contains("_blocks") {
            true => Origin::Words {
                name: source.clone(),
                start,
                step,
            },
            false if step == 1 => origin.clone(),
            false => Origin::Strided {
                name: source.clone(),
                axis: 1,
                start,
                step,
            },
        };
        let columns = |start: usize| Origin::Strided {
            name: source.clone(),
            axis: 0,
            start,
            step: 2,
        };
        let leaf = name
            .replace("_blocks", ".weight")
            .replace("_scales", ".scales");
        if name.contains("gate_up_proj") && !name.contains("bias") {
            out.insert(leaf.replace("gate_up_proj", "gate_proj"), rows(0, 2));
            out.insert(leaf.replace("gate_up_proj", "up_proj"), rows(1, 2));
        } else if name.contains("down_proj") && !name.contains("bias") {
            out.insert(leaf, rows(0, 1));
        } else if name.contains("gate_up_proj_bias") {
            out.insert(
                name.replace("gate_up_proj_bias", "gate_proj.bias"),
                columns(0),
            );
            out.insert(
                name.replace("gate_up_proj_bias", "up_proj.bias"),
                columns(1),
            );
        } else if name.contains("down_proj_bias") {
            out.insert(name.replace("down_proj_bias", "down_proj.bias"), origin);
        } else {
            out.insert(name, origin);
        }
    }
    out
}

/// DeepSeek-V3's `sanitize`: each layer's `kv_b_proj` `[H * (nope + v), rank]` as per-head
/// `embed_q` `[H, rank, nope]` and `unembed_out` `[H, v, rank]`, the experts stacked (below),
/// the multi-token-prediction layer 61 and rotary buffers dropped. fp8 and packed-int4
/// checkpoints, which mlx-lm dequantizes or repacks, are refused.
fn sanitize_deepseek_v3(
    config: &Value,
    arrays: &mut BTreeMap<String, Origin>,
) -> Result<(), ConvertError> {
    if let Some(name) = arrays
        .keys()
        .find(|k| k.ends_with("weight_scale_inv") || k.ends_with("weight_packed"))
    {
        return Err(ConvertError::Weights(format!(
            "`{name}`: fp8 and packed-int4 DeepSeek checkpoints are not supported by oxlm \
             convert; convert a bfloat16 release"
        )));
    }
    let dim = |key: &str| config[key].as_u64().unwrap_or(0) as usize;
    let (heads, nope, v) = (
        dim("num_attention_heads"),
        dim("qk_nope_head_dim"),
        dim("v_head_dim"),
    );
    let fused: Vec<String> = arrays
        .keys()
        .filter(|n| n.ends_with(".self_attn.kv_b_proj.weight"))
        .cloned()
        .collect();
    for name in fused {
        let prefix = name.strip_suffix(".kv_b_proj.weight").expect("filtered");
        if arrays.contains_key(&format!("{prefix}.kv_b_proj.scales")) {
            return Err(ConvertError::Weights(format!(
                "`{prefix}.kv_b_proj` is quantized: oxlm convert reads only unquantized \
                 DeepSeek checkpoints"
            )));
        }
        arrays.remove(&name);
        let part = |start, rows, transposed| Origin::HeadRows {
            name: name.clone(),
            heads,
            start,
            rows,
            transposed,
        };
        arrays.insert(format!("{prefix}.embed_q.weight"), part(0, nope, true));
        arrays.insert(format!("{prefix}.unembed_out.weight"), part(nope, v, false));
    }
    arrays.retain(|name, _| {
        !name.starts_with("model.layers.61") && !name.contains("rotary_emb.inv_freq")
    });
    Ok(())
}

/// `….experts.E.PROJ.LEAF` arrays stacked over `E` into `….switch_mlp.PROJ.LEAF`, each `PROJ`
/// renamed by `renames`.
fn stack_experts(
    arrays: &mut BTreeMap<String, Origin>,
    renames: &[(&str, &str)],
) -> Result<(), ConvertError> {
    let mut stacks: BTreeMap<String, BTreeMap<usize, String>> = BTreeMap::new();
    for name in arrays.keys() {
        let Some((prefix, rest)) = name.split_once(".experts.") else {
            continue;
        };
        let Some((index, tail)) = rest.split_once('.') else {
            continue;
        };
        let Ok(index) = index.parse::<usize>() else {
            continue;
        };
        let Some((projection, leaf)) = tail.split_once('.') else {
            continue;
        };
        let projection = renames
            .iter()
            .find(|(from, _)| *from == projection)
            .map_or(projection, |(_, to)| to);
        let stacked = format!("{prefix}.switch_mlp.{projection}.{leaf}");
        stacks
            .entry(stacked)
            .or_default()
            .insert(index, name.clone());
    }
    for (stacked, experts) in stacks {
        let count = experts.len();
        if experts.keys().copied().ne(0..count) {
            return Err(ConvertError::Weights(format!(
                "the experts of `{stacked}` are not numbered 0 to {}: {:?}",
                count - 1,
                experts.keys().collect::<Vec<_>>()
            )));
        }
        let mut sources = Vec::with_capacity(count);
        for name in experts.into_values() {
            let Some(Origin::Tensor(source)) = arrays.remove(&name) else {
                unreachable!("expert arrays come from the source as they are");
            };
            sources.push(source);
        }
        arrays.insert(stacked, Origin::Stack(sources));
    }
    Ok(())
}

/// Granite's fused layers: `FUSED.input_linear` (gate, then up, on the second-to-last axis) and
/// `FUSED.output_linear` as mlx-lm's `INTO.gate_proj`, `up_proj` and `down_proj`. Granite-MoE's
/// and Granite 4.0-H's experts (`[E, 2I, H]`) go from `block_sparse_moe` into its `switch_mlp`;
/// Granite 4.0-H's dense MLP, which the hub keeps as `shared_mlp` (`[2I, H]`), into `mlp` (a
/// model with experts keeps its `shared_mlp`).
fn split_granite(arrays: &mut BTreeMap<String, Origin>, fused: &str, into: &str) {
    let input = format!("{fused}.input_linear.weight");
    let names: Vec<String> = arrays
        .keys()
        .filter(|n| n.ends_with(&input))
        .cloned()
        .collect();
    for name in names {
        arrays.remove(&name);
        let target =
            |projection: &str| name.replace(&input, &format!("{into}.{projection}.weight"));
        for (part, projection) in ["gate_proj", "up_proj"].into_iter().enumerate() {
            let origin = Origin::RowSlice {
                name: name.clone(),
                part,
                parts: 2,
            };
            arrays.insert(target(projection), origin);
        }
        let output = name.replace("input_linear", "output_linear");
        if let Some(origin) = arrays.remove(&output) {
            arrays.insert(target("down_proj"), origin);
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn names(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    /// Source arrays of these names, all of one (matrix) shape.
    fn arrays(list: &[&str]) -> BTreeMap<String, Vec<usize>> {
        list.iter().map(|s| (s.to_string(), vec![4, 4])).collect()
    }

    #[test]
    fn mixtral_experts_are_stacked_and_renamed() {
        let config = json!({"model_type": "mixtral", "tie_word_embeddings": false});
        let out = sanitize(
            &config,
            &arrays(&[
                "model.layers.0.block_sparse_moe.experts.1.w1.weight",
                "model.layers.0.block_sparse_moe.experts.0.w1.weight",
                "lm_head.weight",
            ]),
        )
        .unwrap();
        assert_eq!(
            out["model.layers.0.block_sparse_moe.switch_mlp.gate_proj.weight"],
            Origin::Stack(names(&[
                "model.layers.0.block_sparse_moe.experts.0.w1.weight",
                "model.layers.0.block_sparse_moe.experts.1.w1.weight"
            ]))
        );
        assert!(out.contains_key("lm_head.weight"));
    }

    #[test]
    fn a_gap_in_the_experts_is_an_error() {
        let config = json!({"model_type": "qwen3_moe"});
        let err = sanitize(
            &config,
            &arrays(&[
                "model.layers.0.mlp.experts.0.up_proj.weight",
                "model.layers.0.mlp.experts.2.up_proj.weight",
            ]),
        )
        .unwrap_err();
        assert!(err.to_string().contains("not numbered 0 to 1"), "{err}");
    }

    fn shaped(list: &[(&str, &[usize])]) -> BTreeMap<String, Vec<usize>> {
        list.iter()
            .map(|(n, s)| (n.to_string(), s.to_vec()))
            .collect()
    }

    #[test]
    fn qwen3_5_shifts_the_norms_of_a_hugging_face_checkpoint_only() {
        let config = json!({"model_type": "qwen3_5", "text_config": {"num_hidden_layers": 1}});
        let hf = shaped(&[
            (
                "model.language_model.layers.0.linear_attn.conv1d.weight",
                &[8, 1, 4],
            ),
            ("model.language_model.layers.0.input_layernorm.weight", &[4]),
            ("model.language_model.norm.weight", &[4]),
            ("model.visual.blocks.0.attn.qkv.weight", &[4, 4]),
            ("mtp.fc.weight", &[4, 4]),
            ("lm_head.weight", &[4, 4]),
        ]);
        let out = sanitize(&config, &hf).unwrap();
        let names: Vec<&str> = out.keys().map(String::as_str).collect();
        assert_eq!(
            names,
            [
                "language_model.lm_head.weight",
                "language_model.model.layers.0.input_layernorm.weight",
                "language_model.model.layers.0.linear_attn.conv1d.weight",
                "language_model.model.norm.weight",
            ]
        );
        let norm = "model.language_model.norm.weight".to_string();
        assert_eq!(
            out["language_model.model.norm.weight"],
            Origin::Shifted {
                name: norm,
                by: 1.0
            }
        );
        // mlx-lm's own layout (conv1d already [C, K, 1]): left as it is.
        let mlx = shaped(&[
            (
                "language_model.model.layers.0.linear_attn.conv1d.weight",
                &[8, 4, 1],
            ),
            ("language_model.model.norm.weight", &[4]),
        ]);
        let out = sanitize(&config, &mlx).unwrap();
        assert!(out.values().all(|o| matches!(o, Origin::Tensor(_))));
    }

    #[test]
    fn deepseek_attention_is_split_per_head_and_fp8_is_refused() {
        for model_type in ["deepseek_v3", "kimi_k2"] {
            let config = json!({"model_type": model_type, "tie_word_embeddings": false,
                "num_attention_heads": 2, "qk_nope_head_dim": 8, "v_head_dim": 4});
            let kv_b = "model.layers.0.self_attn.kv_b_proj.weight";
            let out = sanitize(&config, &shaped(&[(kv_b, &[24, 16])])).unwrap();
            let part = |start, rows, transposed| Origin::HeadRows {
                name: kv_b.into(),
                heads: 2,
                start,
                rows,
                transposed,
            };
            assert_eq!(
                out["model.layers.0.self_attn.embed_q.weight"],
                part(0, 8, true)
            );
            assert_eq!(
                out["model.layers.0.self_attn.unembed_out.weight"],
                part(8, 4, false)
            );
            let fp8 = shaped(&[
                (kv_b, &[24, 16]),
                ("model.layers.0.mlp.weight_scale_inv", &[1, 1]),
            ]);
            let err = sanitize(&config, &fp8).unwrap_err().to_string();
            assert!(err.contains("fp8"), "{err}");
        }
    }

    #[test]
    fn gpt_oss_mxfp4_experts_become_words_split_by_row_parity() {
        let config = json!({"model_type": "gpt_oss"});
        let p = "model.layers.0.mlp.experts";
        let out = sanitize(
            &config,
            &shaped(&[
                (&format!("{p}.gate_up_proj_blocks"), &[2, 8, 2, 16]),
                (&format!("{p}.gate_up_proj_scales"), &[2, 8, 2]),
                (&format!("{p}.gate_up_proj_bias"), &[2, 8]),
                (&format!("{p}.down_proj_blocks"), &[2, 4, 1, 16]),
            ]),
        )
        .unwrap();
        let blocks = format!("{p}.gate_up_proj_blocks");
        let words = |start, step| Origin::Words {
            name: blocks.clone(),
            start,
            step,
        };
        assert_eq!(out[&format!("{p}.gate_proj.weight")], words(0, 2));
        assert_eq!(out[&format!("{p}.up_proj.weight")], words(1, 2));
        let bias = Origin::Strided {
            name: format!("{p}.gate_up_proj_bias"),
            axis: 0,
            start: 1,
            step: 2,
        };
        assert_eq!(out[&format!("{p}.up_proj.bias")], bias);
        assert!(out.contains_key(&format!("{p}.up_proj.scales")));
        assert!(out.contains_key(&format!("{p}.down_proj.weight")));
    }

    #[test]
    fn lfm2_convolutions_already_in_mlx_layout_are_kept() {
        let config = json!({"model_type": "lfm2"});
        let conv = "model.layers.0.conv.conv.weight";
        let hf = sanitize(&config, &shaped(&[(conv, &[8, 1, 3])])).unwrap();
        assert_eq!(hf[conv], Origin::swapped(conv));
        let mlx = sanitize(&config, &shaped(&[(conv, &[8, 3, 1])])).unwrap();
        assert_eq!(mlx[conv], Origin::Tensor(conv.into()));
    }

    #[test]
    fn an_unknown_architecture_names_the_supported_ones() {
        let err = sanitize(&json!({"model_type": "bert"}), &arrays(&[])).unwrap_err();
        let text = err.to_string();
        assert!(
            text.contains("`bert`") && text.contains("qwen3_moe"),
            "{text}"
        );
    }
}
