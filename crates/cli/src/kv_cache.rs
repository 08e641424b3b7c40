//! The flags that say how a command keeps its KV cache: `--kv-cache`, mlx-lm's `--kv-bits` and
//! `--kv-group-size`, and whether a checkpoint's `kv_config.json` applies.

use std::path::Path;

use anyhow::Result;
use oxlm_engine::{KvPrecision, KvQuant};
use oxlm_models::{KvQuantization, QuantizedLayers};

const KV_CACHE_HELP: &str = "How the cache keeps keys and values before (or without) \
    quantization: f16 (the default: half the memory, and long contexts decode faster) or f32 \
    (exactly what the layers computed, as mlx-lm's f32 run keeps them)";

#[derive(clap::Args, Debug, Clone)]
pub struct KvCacheArgs {
    #[arg(long, value_parser = parse_kv_cache, help = KV_CACHE_HELP)]
    pub kv_cache: Option<KvPrecision>,
    /// Keep every attention layer's keys and values as 4- or 8-bit affine codes, as mlx-lm's
    /// quantized cache does (in groups of 64: 31% or 56% of f16's memory, at a small cost in
    /// accuracy); head dims must be multiples of --kv-group-size. Overrides the checkpoint's
    /// kv_config.json.
    #[arg(long, value_parser = parse_kv_bits)]
    pub kv_bits: Option<u8>,
    /// Features per scale and bias of a quantized cache: 32, 64 or 128.
    #[arg(long, default_value_t = 64, requires = "kv_bits")]
    pub kv_group_size: usize,
    /// Leave the checkpoint's kv_config.json (per-layer cache bits, as OptiQ's checkpoints carry
    /// them) unused: without --kv-bits, the cache is then not quantized.
    #[arg(long, conflicts_with = "kv_bits")]
    pub no_kv_config: bool,
}

impl KvCacheArgs {
    /// The layers these flags quantize, for a model of `layers` layers in `dir`: every
    /// attention layer with --kv-bits, else those the checkpoint's kv_config.json lists.
    pub fn quantized_layers(&self, dir: &Path, layers: usize) -> Result<Option<QuantizedLayers>> {
        if let Some(bits) = self.kv_bits {
            let quant = KvQuant::new(bits, self.kv_group_size)?;
            return Ok(Some(QuantizedLayers::All(quant)));
        }
        if self.no_kv_config {
            return Ok(None);
        }
        Ok(KvQuantization::from_kv_config(dir, layers, 0)?.map(|q| q.layers))
    }

    /// [`quantized_layers`](Self::quantized_layers) from `start` tokens on.
    pub fn quantization(
        &self,
        dir: &Path,
        layers: usize,
        start: usize,
    ) -> Result<Option<KvQuantization>> {
        let quantized = self.quantized_layers(dir, layers)?;
        Ok(quantized.map(|layers| KvQuantization { layers, start }))
    }
}

pub(crate) fn parse_kv_cache(spec: &str) -> Result<KvPrecision, String> {
    match spec {
        "f16" => Ok(KvPrecision::F16),
        "f32" => Ok(KvPrecision::F32),
        "q8" => Err("`q8`: use --kv-bits 8 (from the first token: --quantized-kv-start 0)".into()),
        _ => Err(format!("`{spec}`: expected f16 or f32")),
    }
}

pub(crate) fn parse_kv_bits(spec: &str) -> Result<u8, String> {
    match spec {
        "4" => Ok(4),
        "8" => Ok(8),
        _ => Err(format!("`{spec}`: the cache takes 4 or 8 bits")),
    }
}

/// `--max-kv-size`: more positions than the ring keeps from the start.
pub(crate) fn parse_max_kv_size(value: &str) -> Result<usize, String> {
    let keep = oxlm_models::cache::MAX_KV_SIZE_KEEP;
    match value.parse::<usize>() {
        Ok(size) if size > keep => Ok(size),
        _ => Err(format!(
            "`{value}`: a whole number of positions above the {keep} the cache keeps from the start"
        )),
    }
}

/// Says on stderr that `--max-kv-size` is left unused for a `model_type` whose mlx-lm model
/// builds its own cache, as mlx-lm leaves it; true where it bounds the cache.
pub(crate) fn max_kv_size_applies(model_type: &str) -> bool {
    let applies = oxlm_models::takes_max_kv_size(model_type);
    if !applies {
        eprintln!(
            "note: --max-kv-size is left unused for `{model_type}`, whose mlx-lm model builds \
             its own cache (mlx-lm leaves it unused too)"
        );
    }
    applies
}
