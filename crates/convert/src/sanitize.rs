//! The renames mlx-lm's models apply to a Hugging Face checkpoint as they load it (each
//! architecture's `sanitize`), so that `oxlm convert` writes the names `mlx_lm.convert` writes:
//! experts stacked into one `switch_mlp` array per projection, tied or unused arrays dropped,
//! a multimodal checkpoint's text model under `language_model.`, LFM2's convolutions laid out
//! as MLX's `Conv1d` reads them.

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
    /// A `[C, 1, K]` convolution weight as `[C, K, 1]`.
    SwapLastAxes(String),
    /// Part `part` of `parts` equal slices of the second-to-last axis, per leading index:
    /// Granite-MoE's fused `[E, 2I, H]` expert input projection split into gate and up.
    RowSlice {
        name: String,
        part: usize,
        parts: usize,
    },
}

/// The architectures whose checkpoints `oxlm convert` reads from the Hugging Face layout.
pub const SUPPORTED: &[&str] = &[
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "qwen3_moe",
    "mixtral",
    "phi3",
    "gemma2",
    "gemma3_text",
    "smollm3",
    "olmo2",
    "olmo3",
    "olmoe",
    "granite",
    "granitemoe",
    "minicpm",
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
];

/// Models whose text model is saved under `language_model.` with the vision tower dropped.
const TEXT_OF_MULTIMODAL: &[&str] = &["mistral3"];

/// The output arrays and where each comes from, for a checkpoint of `config`'s model type
/// holding `names`.
pub fn sanitize(
    config: &Value,
    names: impl IntoIterator<Item = String>,
) -> Result<BTreeMap<String, Origin>, ConvertError> {
    let model_type = config["model_type"].as_str().unwrap_or_default();
    if !SUPPORTED.contains(&model_type) {
        return Err(ConvertError::UnsupportedModelType {
            found: model_type.to_string(),
            supported: SUPPORTED,
        });
    }
    let arrays = names.into_iter().map(|n| (n.clone(), Origin::Tensor(n)));
    if TEXT_OF_MULTIMODAL.contains(&model_type) {
        let text = &config["text_config"];
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
        let sanitized = sanitize_text(text, text_arrays.collect())?;
        return Ok(sanitized
            .into_iter()
            .map(|(name, origin)| (format!("language_model.{name}"), origin))
            .collect());
    }
    sanitize_text(config, arrays.collect())
}

/// A text model's `sanitize`.
fn sanitize_text(
    config: &Value,
    mut arrays: BTreeMap<String, Origin>,
) -> Result<BTreeMap<String, Origin>, ConvertError> {
    let model_type = config["model_type"].as_str().unwrap_or_default();
    // Precomputed RoPE frequencies: the runtime computes its own.
    arrays.retain(|name, _| !name.contains("rotary_emb.inv_freq"));
    if config["tie_word_embeddings"].as_bool().unwrap_or(true) {
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
            let prediction = format!("model.layers.{layers}.");
            arrays.retain(|name, _| !name.starts_with(&prediction));
        }
        "granitemoe" => split_granite_experts(&mut arrays),
        "lfm2" => {
            for (name, origin) in arrays.iter_mut() {
                if name.contains("conv.weight") {
                    if let Origin::Tensor(source) = origin {
                        *origin = Origin::SwapLastAxes(source.clone());
                    }
                }
            }
        }
        _ => {}
    }
    let renames: &[(&str, &str)] = match model_type {
        "mixtral" => &[("w1", "gate_proj"), ("w2", "down_proj"), ("w3", "up_proj")],
        _ => &[],
    };
    stack_experts(&mut arrays, renames)?;
    Ok(arrays)
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

/// Granite-MoE keeps each layer's experts fused: `input_linear` `[E, 2I, H]` (gate, then up)
/// and `output_linear` `[E, H, I]`.
fn split_granite_experts(arrays: &mut BTreeMap<String, Origin>) {
    let fused: Vec<String> = arrays
        .keys()
        .filter(|n| n.ends_with("block_sparse_moe.input_linear.weight"))
        .cloned()
        .collect();
    for name in fused {
        arrays.remove(&name);
        for (part, projection) in ["gate_proj", "up_proj"].into_iter().enumerate() {
            let split = name.replace("input_linear", &format!("switch_mlp.{projection}"));
            let origin = Origin::RowSlice {
                name: name.clone(),
                part,
                parts: 2,
            };
            arrays.insert(split, origin);
        }
        let output = name.replace("input_linear", "output_linear");
        if let Some(origin) = arrays.remove(&output) {
            arrays.insert(name.replace("input_linear", "switch_mlp.down_proj"), origin);
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

    #[test]
    fn mixtral_experts_are_stacked_and_renamed() {
        let config = json!({"model_type": "mixtral", "tie_word_embeddings": false});
        let out = sanitize(
            &config,
            names(&[
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
            names(&[
                "model.layers.0.mlp.experts.0.up_proj.weight",
                "model.layers.0.mlp.experts.2.up_proj.weight",
            ]),
        )
        .unwrap_err();
        assert!(err.to_string().contains("not numbered 0 to 1"), "{err}");
    }

    #[test]
    fn an_unknown_architecture_names_the_supported_ones() {
        let err = sanitize(&json!({"model_type": "bert"}), names(&[])).unwrap_err();
        let text = err.to_string();
        assert!(
            text.contains("`bert`") && text.contains("qwen3_moe"),
            "{text}"
        );
    }
}
