//! Which layers' keys and values a cache keeps as affine codes, and from which token on: mlx-lm's
//! `--kv-bits`, `--kv-group-size` and `--quantized-kv-start`, or a checkpoint's per-layer
//! `kv_config.json`.

use std::collections::BTreeMap;
use std::path::Path;

use oxlm_engine::KvQuant;
use serde::Deserialize;

use crate::LoadError;

/// The file in a model directory that gives some layers' cache bits.
pub const KV_CONFIG_FILE: &str = "kv_config.json";

/// The layers quantized.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum QuantizedLayers {
    /// Every attention layer in these codes (`--kv-bits`).
    All(KvQuant),
    /// These layers (by index) in their codes; the rest keep their precision.
    Listed(BTreeMap<usize, KvQuant>),
}

/// A cache's quantization: its layers, and the number of tokens a cache holds once it is
/// quantized (mlx-lm converts the cache after the forward pass that takes it to `start`
/// tokens or more; keys and values written afterwards are quantized as they are written).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvQuantization {
    pub layers: QuantizedLayers,
    pub start: usize,
}

/// One entry of `kv_config.json`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct LayerEntry {
    layer_idx: usize,
    bits: u8,
    group_size: usize,
}

impl KvQuantization {
    /// Every attention layer in `quant`'s codes once the cache holds `start` tokens.
    pub fn all(quant: KvQuant, start: usize) -> Self {
        KvQuantization {
            layers: QuantizedLayers::All(quant),
            start,
        }
    }

    /// The codes of layer `layer`, if it is quantized.
    pub fn layer(&self, layer: usize) -> Option<KvQuant> {
        match &self.layers {
            QuantizedLayers::All(quant) => Some(*quant),
            QuantizedLayers::Listed(layers) => layers.get(&layer).copied(),
        }
    }

    /// The per-layer bits of `dir/kv_config.json` (`[{"layer_idx", "bits", "group_size"}, …]`,
    /// as OptiQ's checkpoints carry them), from `start` tokens on; `None` without that file.
    /// A layer at or past `layers`, a layer listed twice, or bits and group sizes the cache
    /// cannot take are errors naming the entry.
    pub fn from_kv_config(
        dir: &Path,
        layers: usize,
        start: usize,
    ) -> Result<Option<Self>, LoadError> {
        let path = dir.join(KV_CONFIG_FILE);
        let text = match std::fs::read_to_string(&path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(source) => return Err(LoadError::Io { path, source }),
        };
        let entries: Vec<LayerEntry> =
            serde_json::from_str(&text).map_err(|source| LoadError::Json {
                path: path.clone(),
                source,
            })?;
        let invalid = |i: usize, why: String| LoadError::Invalid {
            path: path.clone(),
            reason: format!("entry {i}: {why}"),
        };
        let mut listed = BTreeMap::new();
        for (i, e) in entries.iter().enumerate() {
            if e.layer_idx >= layers {
                let why = format!("layer_idx {} of a model of {layers} layers", e.layer_idx);
                return Err(invalid(i, why));
            }
            let quant =
                KvQuant::new(e.bits, e.group_size).map_err(|e| invalid(i, e.to_string()))?;
            if listed.insert(e.layer_idx, quant).is_some() {
                return Err(invalid(
                    i,
                    format!("layer_idx {} listed twice", e.layer_idx),
                ));
            }
        }
        Ok(Some(KvQuantization {
            layers: QuantizedLayers::Listed(listed),
            start,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(json: &str, layers: usize) -> Result<Option<KvQuantization>, LoadError> {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(KV_CONFIG_FILE), json).unwrap();
        KvQuantization::from_kv_config(dir.path(), layers, 0)
    }

    #[test]
    fn kv_config_lists_layers_and_refuses_what_the_cache_cannot_hold() {
        let q = read(
            r#"[{"layer_idx": 1, "bits": 4, "group_size": 64},
                {"layer_idx": 3, "bits": 8, "group_size": 32}]"#,
            4,
        )
        .unwrap()
        .unwrap();
        let got: Vec<_> = (0..4).map(|l| q.layer(l)).collect();
        let (q4, q8) = (KvQuant::new(4, 64).unwrap(), KvQuant::new(8, 32).unwrap());
        assert_eq!(got, [None, Some(q4), None, Some(q8)]);

        let missing = tempfile::tempdir().unwrap();
        assert!(KvQuantization::from_kv_config(missing.path(), 4, 0)
            .unwrap()
            .is_none());
        for (json, why) in [
            (
                r#"[{"layer_idx": 4, "bits": 4, "group_size": 64}]"#,
                "entry 0: layer_idx 4 of a model of 4 layers",
            ),
            (
                r#"[{"layer_idx": 0, "bits": 3, "group_size": 64}]"#,
                "entry 0: unsupported quantization: a KV cache of 3 bits",
            ),
            (
                r#"[{"layer_idx": 0, "bits": 4, "group_size": 64}, {"layer_idx": 0, "bits": 8, "group_size": 64}]"#,
                "entry 1: layer_idx 0 listed twice",
            ),
            (
                r#"[{"layer_idx": 0, "bits": 4}]"#,
                "missing field `group_size`",
            ),
            (r#"{"bits": 4}"#, "malformed JSON"),
        ] {
            let err = read(json, 4).unwrap_err().to_string();
            assert!(err.contains(why) && err.contains(KV_CONFIG_FILE), "{err}");
        }
    }
}
