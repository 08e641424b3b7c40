//! GGUF tensor names to Hugging Face names, and the changes llama.cpp's converter made to the
//! values undone, so that a GGUF model converts to the checkpoint it came from.
//!
//! The port of `scripts/models/gguf_to_hf.py` and `gguf_q4_to_mlx.py`. Two changes are undone:
//! - for `llama`, llama.cpp reorders the rows of the q and k projections (each head's rotary
//!   pairs, interleaved in Hugging Face's layout, become two halves); the reorder moves whole
//!   rows (output features), so it is undone on float rows and on quantized rows alike;
//! - for `gemma3`, llama.cpp stores each RMSNorm's weight as `1 + w`.

use thiserror::Error;

#[derive(Debug, Error, PartialEq)]
pub enum TensorNameError {
    #[error(
        "GGUF architecture `{0}` is not one oxlm converts (it converts llama, qwen2, qwen3 and gemma3)"
    )]
    UnknownArchitecture(String),
    #[error("{arch} GGUF tensor `{name}` has no Hugging Face counterpart that oxlm knows")]
    UnknownTensor { arch: &'static str, name: String },
    #[error("tensor `{name}` has {rows} rows, which do not split into {heads} heads of pairs")]
    HeadsDoNotDivide {
        name: String,
        rows: usize,
        heads: usize,
    },
}

/// The architectures whose tensor names and transforms this module knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Arch {
    Llama,
    Qwen2,
    Qwen3,
    Gemma3,
}

impl Arch {
    fn name(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Qwen2 => "qwen2",
            Arch::Qwen3 => "qwen3",
            Arch::Gemma3 => "gemma3",
        }
    }
}

/// Where one GGUF tensor goes in the Hugging Face checkpoint, and what to undo on the way.
#[derive(Debug, Clone, PartialEq)]
pub struct HfTensor {
    pub name: String,
    /// Row `i` of the Hugging Face tensor is row `row_order[i]` of the GGUF one (rows are the
    /// outermost dimension); see [`reorder_rows`].
    pub row_order: Option<Vec<usize>>,
    /// The values are `1 + w`: subtract 1 (in f32, after dequantizing).
    pub subtract_one: bool,
}

/// The names of one model's tensors: its architecture and head counts.
#[derive(Debug, Clone)]
pub struct TensorNames {
    arch: Arch,
    heads: usize,
    kv_heads: usize,
}

impl TensorNames {
    /// `arch` is `general.architecture`; the head counts (`{arch}.attention.head_count` and
    /// `head_count_kv`) give the q and k row order for `llama`.
    pub fn new(arch: &str, heads: usize, kv_heads: usize) -> Result<Self, TensorNameError> {
        let arch = match arch {
            "llama" => Arch::Llama,
            "qwen2" => Arch::Qwen2,
            "qwen3" => Arch::Qwen3,
            "gemma3" => Arch::Gemma3,
            _ => return Err(TensorNameError::UnknownArchitecture(arch.to_string())),
        };
        Ok(TensorNames {
            arch,
            heads,
            kv_heads,
        })
    }

    /// The Hugging Face tensor for GGUF tensor `gguf_name`, which has `rows` rows (its outermost
    /// dimension: `shape[0]`).
    pub fn hf_tensor(&self, gguf_name: &str, rows: usize) -> Result<HfTensor, TensorNameError> {
        let unknown = || TensorNameError::UnknownTensor {
            arch: self.arch.name(),
            name: gguf_name.to_string(),
        };
        let (base, suffix) = gguf_name
            .rsplit_once('.')
            .filter(|(_, s)| matches!(*s, "weight" | "bias"))
            .ok_or_else(unknown)?;
        let mut row_order = None;
        let name = match base {
            "token_embd" => "model.embed_tokens".to_string(),
            "output_norm" => "model.norm".to_string(),
            "output" => "lm_head".to_string(),
            _ => {
                let (layer, part) = base
                    .strip_prefix("blk.")
                    .and_then(|rest| rest.split_once('.'))
                    .filter(|(n, _)| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
                    .ok_or_else(unknown)?;
                let hf_part = self.layer_part(part).ok_or_else(unknown)?;
                let heads = match part {
                    "attn_q" => Some(self.heads),
                    "attn_k" => Some(self.kv_heads),
                    _ => None,
                };
                if let (Arch::Llama, Some(heads)) = (self.arch, heads) {
                    row_order = Some(unpermute_rows(rows, heads).ok_or_else(|| {
                        TensorNameError::HeadsDoNotDivide {
                            name: gguf_name.to_string(),
                            rows,
                            heads,
                        }
                    })?);
                }
                format!("model.layers.{layer}.{hf_part}")
            }
        };
        let subtract_one =
            self.arch == Arch::Gemma3 && name.ends_with("norm") && suffix == "weight";
        Ok(HfTensor {
            name: format!("{name}.{suffix}"),
            row_order,
            subtract_one,
        })
    }

    /// The Hugging Face name, within a layer, of a layer's GGUF tensor `part`.
    fn layer_part(&self, part: &str) -> Option<&'static str> {
        Some(match (part, self.arch) {
            ("attn_q", _) => "self_attn.q_proj",
            ("attn_k", _) => "self_attn.k_proj",
            ("attn_v", _) => "self_attn.v_proj",
            ("attn_output", _) => "self_attn.o_proj",
            ("attn_q_norm", _) => "self_attn.q_norm",
            ("attn_k_norm", _) => "self_attn.k_norm",
            ("ffn_gate", _) => "mlp.gate_proj",
            ("ffn_up", _) => "mlp.up_proj",
            ("ffn_down", _) => "mlp.down_proj",
            ("attn_norm", _) => "input_layernorm",
            // Gemma 3 norms both sides of the attention and of the MLP; llama.cpp calls the norm
            // before the MLP `ffn_norm`, as it does the others' post-attention norm.
            ("ffn_norm", Arch::Gemma3) => "pre_feedforward_layernorm",
            ("ffn_norm", _) => "post_attention_layernorm",
            ("post_attention_norm", Arch::Gemma3) => "post_attention_layernorm",
            ("post_ffw_norm", Arch::Gemma3) => "post_feedforward_layernorm",
            _ => return None,
        })
    }
}

/// The row order that undoes llama.cpp's q/k permutation of a projection with `rows` rows and
/// `heads` heads: HF row `i` is GGUF row `order[i]`. llama.cpp's converter rewrote each head's
/// rows `(half, pair)` as `(pair, half)` (its `permute`: reshape to `heads × 2 × rows/heads/2`,
/// swap the last two axes); this is its inverse. `None` if the rows are not `heads` heads of
/// pairs.
pub fn unpermute_rows(rows: usize, heads: usize) -> Option<Vec<usize>> {
    if heads == 0 || !rows.is_multiple_of(2 * heads) {
        return None;
    }
    let head_dim = rows / heads;
    let half = head_dim / 2;
    Some(
        (0..rows)
            .map(|i| {
                let (head, within) = (i / head_dim, i % head_dim);
                let (side, pair) = (within / half, within % half);
                head * head_dim + 2 * pair + side
            })
            .collect(),
    )
}

/// `data`'s rows (of `data.len() / order.len()` items) in `order`: row `i` of the result is row
/// `order[i]` of `data`. For float values, packed quantized words, scales and biases alike.
///
/// Panics if `data` is not `order.len()` rows: `order` comes from [`unpermute_rows`] for the same
/// tensor, so a mismatch is a bug in the caller.
pub fn reorder_rows<T: Copy>(data: &[T], order: &[usize]) -> Vec<T> {
    assert!(
        !order.is_empty() && data.len().is_multiple_of(order.len()),
        "{} items are not {} rows",
        data.len(),
        order.len()
    );
    let row = data.len() / order.len();
    let mut out = Vec::with_capacity(data.len());
    for &r in order {
        out.extend_from_slice(&data[r * row..(r + 1) * row]);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hf(arch: &str, name: &str, rows: usize) -> Result<HfTensor, TensorNameError> {
        TensorNames::new(arch, 4, 2)?.hf_tensor(name, rows)
    }

    #[test]
    fn names_map_per_architecture() {
        let cases = [
            ("llama", "token_embd.weight", "model.embed_tokens.weight"),
            ("llama", "output_norm.weight", "model.norm.weight"),
            ("llama", "output.weight", "lm_head.weight"),
            (
                "llama",
                "blk.0.attn_v.weight",
                "model.layers.0.self_attn.v_proj.weight",
            ),
            (
                "llama",
                "blk.3.ffn_norm.weight",
                "model.layers.3.post_attention_layernorm.weight",
            ),
            (
                "qwen2",
                "blk.12.attn_q.bias",
                "model.layers.12.self_attn.q_proj.bias",
            ),
            (
                "qwen2",
                "blk.1.attn_output.weight",
                "model.layers.1.self_attn.o_proj.weight",
            ),
            (
                "qwen3",
                "blk.2.attn_k_norm.weight",
                "model.layers.2.self_attn.k_norm.weight",
            ),
            (
                "qwen3",
                "blk.2.ffn_down.weight",
                "model.layers.2.mlp.down_proj.weight",
            ),
            (
                "gemma3",
                "blk.5.attn_norm.weight",
                "model.layers.5.input_layernorm.weight",
            ),
            (
                "gemma3",
                "blk.5.post_attention_norm.weight",
                "model.layers.5.post_attention_layernorm.weight",
            ),
            (
                "gemma3",
                "blk.5.ffn_norm.weight",
                "model.layers.5.pre_feedforward_layernorm.weight",
            ),
            (
                "gemma3",
                "blk.5.post_ffw_norm.weight",
                "model.layers.5.post_feedforward_layernorm.weight",
            ),
            (
                "gemma3",
                "blk.5.ffn_gate.weight",
                "model.layers.5.mlp.gate_proj.weight",
            ),
        ];
        for (arch, gguf, want) in cases {
            assert_eq!(hf(arch, gguf, 8).unwrap().name, want, "{arch} {gguf}");
        }
    }

    #[test]
    fn only_llama_q_and_k_rows_are_reordered() {
        let q = hf("llama", "blk.0.attn_q.weight", 16).unwrap();
        assert_eq!(q.row_order, unpermute_rows(16, 4));
        let k = hf("llama", "blk.0.attn_k.bias", 8).unwrap();
        assert_eq!(k.row_order, unpermute_rows(8, 2));
        assert_eq!(
            hf("llama", "blk.0.attn_v.weight", 8).unwrap().row_order,
            None
        );
        assert_eq!(
            hf("qwen2", "blk.0.attn_q.weight", 16).unwrap().row_order,
            None
        );
        assert_eq!(
            hf("gemma3", "blk.0.attn_k.weight", 8).unwrap().row_order,
            None
        );
    }

    #[test]
    fn only_gemma3_norm_weights_subtract_one() {
        for name in [
            "output_norm.weight",
            "blk.0.attn_q_norm.weight",
            "blk.0.post_ffw_norm.weight",
            "blk.0.ffn_norm.weight",
        ] {
            assert!(hf("gemma3", name, 8).unwrap().subtract_one, "{name}");
        }
        assert!(!hf("gemma3", "blk.0.ffn_up.weight", 8).unwrap().subtract_one);
        assert!(!hf("gemma3", "token_embd.weight", 8).unwrap().subtract_one);
        assert!(
            !hf("qwen3", "blk.0.attn_q_norm.weight", 8)
                .unwrap()
                .subtract_one
        );
        assert!(!hf("llama", "output_norm.weight", 8).unwrap().subtract_one);
    }

    /// llama.cpp's `permute` (reshape to heads × 2 × half, swap the last two axes), written out,
    /// then undone.
    #[test]
    fn unpermute_inverts_llama_cpps_permute() {
        let (heads, head_dim) = (3, 8);
        let rows = heads * head_dim;
        let hf_rows: Vec<usize> = (0..rows).collect();
        // GGUF row h·hd + 2p + s holds HF row h·hd + s·hd/2 + p.
        let mut gguf_rows = vec![0; rows];
        for h in 0..heads {
            for s in 0..2 {
                for p in 0..head_dim / 2 {
                    gguf_rows[h * head_dim + 2 * p + s] =
                        hf_rows[h * head_dim + s * head_dim / 2 + p];
                }
            }
        }
        let order = unpermute_rows(rows, heads).unwrap();
        assert_eq!(reorder_rows(&gguf_rows, &order), hf_rows);
        // Rows of several items move whole.
        let wide: Vec<usize> = gguf_rows
            .iter()
            .flat_map(|&r| [10 * r, 10 * r + 1])
            .collect();
        let back = reorder_rows(&wide, &order);
        assert_eq!(&back[..6], [0, 1, 10, 11, 20, 21]);
        assert_eq!(unpermute_rows(10, 3), None);
        assert_eq!(unpermute_rows(12, 0), None);
    }

    #[test]
    fn unknown_architectures_and_names_are_errors() {
        let err = hf("mamba", "token_embd.weight", 8).unwrap_err();
        assert_eq!(err, TensorNameError::UnknownArchitecture("mamba".into()));
        assert!(
            err.to_string().contains("llama, qwen2, qwen3 and gemma3"),
            "{err}"
        );
        for name in [
            "rope_freqs.weight",
            "blk.0.ffn_gate_inp.weight",
            "blk.x.attn_q.weight",
            "blk.0.attn_q",
            "blk.0.attn_q.scales",
            "token_embd",
        ] {
            let err = hf("llama", name, 8).unwrap_err().to_string();
            assert!(
                err.contains(&format!("llama GGUF tensor `{name}` has no")),
                "{err}"
            );
        }
        // Gemma's extra norms are Gemma's only.
        assert!(hf("qwen2", "blk.0.post_ffw_norm.weight", 8).is_err());
        let err = hf("llama", "blk.0.attn_q.weight", 10)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("`blk.0.attn_q.weight` has 10 rows, which do not split into 4 heads"),
            "{err}"
        );
    }
}
