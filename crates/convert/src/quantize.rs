//! Which arrays `mlx_lm.convert -q` quantizes and how: every linear, embedding and
//! switch-linear weight whose rows are whole groups, at the default bits, unless the model's own
//! predicate or a mixed recipe (`--quant-predicate mixed_3_6`, …) picks other bits for it; and
//! the config section that records the choices.

use oxlm_engine::quant::{QuantMode, SUPPORTED_BITS, SUPPORTED_GROUP_SIZES};
use oxlm_models::checkpoint::QuantSpec;
use serde_json::{json, Map, Value};

use crate::ConvertError;

/// mlx-lm's mixed-precision recipes, after llama.cpp's `Q4_K_M` choices: the value projections
/// and down projections of the first and last eighth of the layers and of every third layer
/// between, and the head, get more bits than the rest.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Recipe {
    Mixed2_6,
    Mixed3_4,
    Mixed3_6,
    Mixed4_6,
}

impl Recipe {
    pub const ALL: [Recipe; 4] = [
        Recipe::Mixed2_6,
        Recipe::Mixed3_4,
        Recipe::Mixed3_6,
        Recipe::Mixed4_6,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Recipe::Mixed2_6 => "mixed_2_6",
            Recipe::Mixed3_4 => "mixed_3_4",
            Recipe::Mixed3_6 => "mixed_3_6",
            Recipe::Mixed4_6 => "mixed_4_6",
        }
    }

    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|r| r.name() == name)
    }

    /// The (low, high) bits.
    fn bits(self) -> (u32, u32) {
        match self {
            Recipe::Mixed2_6 => (2, 6),
            Recipe::Mixed3_4 => (3, 4),
            Recipe::Mixed3_6 => (3, 6),
            Recipe::Mixed4_6 => (4, 6),
        }
    }
}

/// What the user asked for: `-q` with `--q-bits`, `--q-group-size`, `--q-mode` and
/// `--quant-predicate`.
#[derive(Debug, Clone, Copy)]
pub struct QuantRequest {
    pub bits: Option<u32>,
    pub group_size: Option<usize>,
    pub mode: QuantMode,
    pub recipe: Option<Recipe>,
}

/// How one module is quantized, and what the config records for it beyond the default.
#[derive(Debug, Clone, PartialEq)]
pub struct Choice {
    pub spec: QuantSpec,
    pub config_entry: Option<Value>,
}

/// The quantization of a whole checkpoint.
pub struct QuantPlan {
    default: QuantSpec,
    /// The recipe's group size as given (`None`: the config says `null`, as mlx-lm writes it).
    requested_group_size: Option<usize>,
    recipe: Option<(Recipe, MixedLayers)>,
    model_predicate: fn(&str) -> bool,
    not_linear: fn(&str) -> bool,
}

/// Where the layer index sits in a module path, and how many layers there are.
#[derive(Debug, Clone, Copy)]
struct MixedLayers {
    index_position: usize,
    layers: usize,
}

impl QuantPlan {
    /// `module_paths`: every module that holds a weight, for the recipes' layer numbering;
    /// `layers`: the text model's `num_hidden_layers`.
    pub fn new(
        request: QuantRequest,
        model_type: &str,
        module_paths: &[&str],
        layers: usize,
    ) -> Result<Self, ConvertError> {
        let (default_bits, default_group_size) = request.mode.float_format().unwrap_or((4, 64));
        let bits = request.bits.unwrap_or(default_bits);
        let group_size = request.group_size.unwrap_or(default_group_size);
        match request.mode.float_format() {
            Some((b, g)) if (bits, group_size) != (b, g) => {
                return Err(ConvertError::Options(format!(
                    "--q-mode {} takes {b} bits and group size {g}, not {bits} and {group_size}",
                    request.mode
                )))
            }
            None if !SUPPORTED_BITS.contains(&bits) => {
                return Err(ConvertError::Options(format!(
                    "--q-bits {bits}: affine quantization takes {SUPPORTED_BITS:?}"
                )))
            }
            None if !SUPPORTED_GROUP_SIZES.contains(&group_size) => {
                return Err(ConvertError::Options(format!(
                    "--q-group-size {group_size}: affine quantization takes {SUPPORTED_GROUP_SIZES:?}"
                )))
            }
            _ => {}
        }
        let recipe = match request.recipe {
            None => None,
            Some(_) if request.mode != QuantMode::Affine => {
                return Err(ConvertError::Options(
                    "--quant-predicate recipes only support affine quantization".into(),
                ))
            }
            Some(recipe) => {
                let first_down = module_paths
                    .iter()
                    .find(|p| p.contains("down_proj"))
                    .ok_or_else(|| {
                        ConvertError::Options(format!(
                            "--quant-predicate {}: the model has no down_proj layers",
                            recipe.name()
                        ))
                    })?;
                // mlx-lm takes the first numeric part, or the last part when there is none.
                let parts: Vec<&str> = first_down.split('.').collect();
                let index_position = parts
                    .iter()
                    .position(|p| p.bytes().all(|b| b.is_ascii_digit()))
                    .unwrap_or(parts.len() - 1);
                Some((
                    recipe,
                    MixedLayers {
                        index_position,
                        layers,
                    },
                ))
            }
        };
        Ok(QuantPlan {
            default: QuantSpec {
                mode: request.mode,
                bits,
                group_size,
            },
            requested_group_size: request.group_size,
            recipe,
            model_predicate: model_predicate(model_type),
            not_linear: not_linear(model_type),
        })
    }

    /// The `quantization` section before any module's entry.
    pub fn default_section(&self) -> Map<String, Value> {
        let d = self.default;
        let section = json!({"group_size": d.group_size, "bits": d.bits, "mode": d.mode.name()});
        section.as_object().expect("an object").clone()
    }

    /// How the weight `name` of `shape` is quantized, or `None` where it stays as it is.
    pub fn choose(&self, name: &str, shape: &[usize]) -> Option<Choice> {
        let path = name.strip_suffix(".weight")?;
        // Linear and embedding weights are matrices (but for a few modules of other kinds); a
        // mixture's experts and DeepSeek's per-head `MultiLinear`s are stacks of them.
        let quantizable = match shape.len() {
            2 => !(self.not_linear)(path),
            3 => STACKED_LINEARS.iter().any(|s| path.contains(s)),
            _ => false,
        };
        let cols = *shape.last()?;
        if !quantizable || cols % self.default.group_size != 0 {
            return None;
        }
        if let Some((recipe, layers)) = self.recipe {
            return Some(self.mixed(recipe, layers, path));
        }
        if (self.model_predicate)(path) {
            // The model's own exceptions: 8 bits, groups of 64, affine.
            let spec = QuantSpec {
                mode: QuantMode::Affine,
                bits: 8,
                group_size: 64,
            };
            let config_entry = Some(json!({"group_size": 64, "bits": 8}));
            return Some(Choice { spec, config_entry });
        }
        Some(Choice {
            spec: self.default,
            config_entry: None,
        })
    }

    fn mixed(&self, recipe: Recipe, layers: MixedLayers, path: &str) -> Choice {
        let (low, high) = recipe.bits();
        let index = path
            .split('.')
            .nth(layers.index_position)
            .and_then(|p| p.parse::<usize>().ok())
            .unwrap_or(0);
        let n = layers.layers;
        let more_bits = index < n / 8
            || index >= 7 * n / 8
            || (index as isize - (n / 8) as isize).rem_euclid(3) == 2;
        let value = ["v_proj", "v_a_proj", "v_b_proj"]
            .iter()
            .any(|v| path.contains(v));
        let bits =
            if ((value || path.contains("down_proj")) && more_bits) || path.contains("lm_head") {
                high
            } else {
                low
            };
        let group_size = self.requested_group_size;
        Choice {
            spec: QuantSpec {
                mode: QuantMode::Affine,
                bits,
                group_size: group_size.unwrap_or(64),
            },
            config_entry: Some(json!({"group_size": group_size, "bits": bits, "mode": "affine"})),
        }
    }
}

/// Where the 3-D weights that `to_quantized` takes live: `SwitchLinear` (a mixture's experts:
/// `switch_mlp`, Gemma 4's `switch_glu`, gpt-oss's `mlp.experts`, Llama 4's
/// `feed_forward.experts`) and `MultiLinear`.
const STACKED_LINEARS: [&str; 6] = [
    "switch_mlp",
    "switch_glu",
    "mlp.experts.",
    "feed_forward.experts.",
    "embed_q",
    "unembed_out",
];

/// The matrices of modules without `to_quantized`: DeepSeek's, GLM's and Nemotron-H's
/// `MoEGate` router.
fn not_linear(model_type: &str) -> fn(&str) -> bool {
    match model_type {
        "deepseek_v3" | "kimi_k2" | "glm4_moe" => |p| p.ends_with("mlp.gate"),
        "nemotron_h" => |p| p.ends_with("mixer.gate"),
        _ => |_| false,
    }
}

/// The modules an architecture's own `quant_predicate` keeps at 8 bits (for `qwen3_5`, only
/// when it has experts: the caller passes `qwen3_5_moe` then).
fn model_predicate(model_type: &str) -> fn(&str) -> bool {
    match model_type {
        "qwen3_moe" => |p| p.ends_with("mlp.gate"),
        "qwen3_next" | "qwen3_5_moe" => {
            |p| p.ends_with("mlp.gate") || p.ends_with("shared_expert_gate")
        }
        "lfm2_moe" => |p| p.ends_with("feed_forward.gate"),
        "gemma4" | "gemma4_text" => |p| p.ends_with("router.proj"),
        "gpt_oss" => |p| p.ends_with("router"),
        "granite" => {
            |p| p.ends_with("self_attn.o_proj") || p.ends_with("mlp.down_proj") || p == "lm_head"
        }
        "granitemoehybrid" => |p| p.ends_with("block_sparse_moe.router.layer"),
        "granitemoe" => |p| {
            p.ends_with("block_sparse_moe.router.layer")
                || p.ends_with("self_attn.o_proj")
                || p.ends_with("mlp.down_proj")
                || p == "lm_head"
        },
        _ => |_| false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(recipe: Option<Recipe>) -> QuantRequest {
        QuantRequest {
            bits: None,
            group_size: None,
            mode: QuantMode::Affine,
            recipe,
        }
    }

    #[test]
    fn mixed_recipes_give_the_edge_layers_more_bits() {
        let paths = ["model.layers.0.mlp.down_proj"];
        let plan = QuantPlan::new(request(Some(Recipe::Mixed3_6)), "llama", &paths, 16).unwrap();
        let bits = |name: &str| plan.choose(name, &[8, 64]).unwrap().spec.bits;
        // Layers 0-1 and 14-15 are the edges; between them every third from layer 4.
        let down: Vec<u32> = (0..16)
            .map(|l| bits(&format!("model.layers.{l}.mlp.down_proj.weight")))
            .collect();
        assert_eq!(down, [6, 6, 3, 3, 6, 3, 3, 6, 3, 3, 6, 3, 3, 6, 6, 6]);
        assert_eq!(bits("model.layers.5.self_attn.q_proj.weight"), 3);
        assert_eq!(bits("lm_head.weight"), 6);
    }

    #[test]
    fn rows_that_are_not_whole_groups_stay_dense() {
        let plan = QuantPlan::new(request(None), "llama", &[], 2).unwrap();
        assert!(plan
            .choose("model.layers.0.mlp.down_proj.weight", &[64, 96])
            .is_none());
        assert!(plan.choose("model.norm.weight", &[64]).is_none());
        assert!(plan
            .choose("model.embed_tokens.weight", &[512, 64])
            .is_some());
    }

    #[test]
    fn a_float_mode_refuses_other_bits() {
        let mut r = request(None);
        (r.mode, r.bits) = (QuantMode::Mxfp4, Some(8));
        let err = QuantPlan::new(r, "llama", &[], 2)
            .err()
            .unwrap()
            .to_string();
        assert!(
            err.contains("mxfp4 takes 4 bits and group size 32"),
            "{err}"
        );
    }
}
