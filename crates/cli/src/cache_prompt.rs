//! `oxlm cache-prompt`: a drop-in for `mlx_lm.cache_prompt`. Runs a prompt through the model
//! and saves the model's state after it in mlx-lm's prompt cache format, for `oxlm generate
//! --prompt-cache-file` (or `mlx_lm generate`) to continue from.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::ops::ControlFlow;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result};
use oxlm_engine::KvQuant;
use oxlm_models::lora::AdaptedModel;
use oxlm_models::{KvQuantization, LanguageModel};
use oxlm_runtime::generate::{prefill_quantizing, Event, DEFAULT_PREFILL_STEP};
use oxlm_runtime::hub::resolve_model;
use oxlm_runtime::memory::peak_resident_bytes;
use oxlm_runtime::prompt_cache_file::{
    self, cached_prompt_ids, tokenizer_config_json, MODEL_KEY, TOKENIZER_CONFIG_KEY,
};
use oxlm_runtime::{GenerateOptions, LoadedModel};

#[derive(clap::Args)]
pub struct Args {
    /// The MLX model (config.json, *.safetensors, tokenizer files): a local directory, or a
    /// Hugging Face repo id. The file records it as given, for `generate` to load.
    #[arg(long)]
    model: PathBuf,
    /// A LoRA adapter directory (adapter_config.json, adapters.safetensors) to apply.
    #[arg(long)]
    adapter_path: Option<PathBuf>,
    /// Recorded in the file's tokenizer_config, as mlx-lm records it (no remote code runs here).
    #[arg(long)]
    trust_remote_code: bool,
    /// An end-of-sequence token, recorded in the file's tokenizer_config: `generate` stops at
    /// it too.
    #[arg(long)]
    eos_token: Option<String>,
    /// Bound each layer's cache to a ring of this many positions that keeps the first 4, as
    /// mlx_lm.cache_prompt's --max-kv-size does: the file then holds mlx-lm's RotatingKVCache
    /// layers (the prompt's first 4 positions and its last N - 4, as mlx-lm lays them out), which
    /// `generate --prompt-cache-file` continues. Only for the model types mlx-lm bounds (those
    /// that build no cache of their own, such as qwen2, qwen3 and phi3; llama and mistral do);
    /// elsewhere it is left unused, as in mlx-lm, with a note.
    #[arg(long, value_parser = crate::kv_cache::parse_max_kv_size, conflicts_with = "kv_bits")]
    max_kv_size: Option<usize>,
    /// The file to save the prompt cache in (safetensors).
    #[arg(long)]
    prompt_cache_file: PathBuf,
    /// The message to process; `-` reads it from standard input.
    #[arg(long, short = 'p')]
    prompt: String,
    /// Keep the attention layers' keys and values as 4- or 8-bit codes once the cache holds
    /// --quantized-kv-start tokens, as mlx-lm does; such layers are written as mlx-lm's
    /// QuantizedKVCache.
    #[arg(long, value_parser = crate::kv_cache::parse_kv_bits)]
    kv_bits: Option<u8>,
    /// Features per scale and bias of a quantized cache: 32, 64 or 128.
    #[arg(long, default_value_t = 64, requires = "kv_bits")]
    kv_group_size: usize,
    /// With --kv-bits, how many tokens the cache holds before it is quantized (checked after
    /// each prompt chunk and after the last token, which goes through alone).
    #[arg(long, default_value_t = 5000)]
    quantized_kv_start: usize,
    /// Kernel threads (default: one per physical core).
    #[arg(long, value_parser = crate::parse_threads)]
    threads: Option<usize>,
    /// Where the model runs: cpu, cuda (GPU 0) or cuda:N.
    #[arg(long, default_value = "cpu", value_parser = crate::parse_device)]
    device: oxlm_engine::Device,
    /// How the keys and values are kept while the prompt runs (before any quantization), and
    /// so written: f16 (the default) or f32.
    #[arg(long, value_parser = crate::kv_cache::parse_kv_cache)]
    kv_cache: Option<oxlm_engine::KvPrecision>,
}

pub fn run(args: Args) -> Result<()> {
    if let Some(threads) = args.threads {
        oxlm_engine::cpu::pool::set_threads(threads);
    }
    let loaded = LoadedModel::load_on(&resolve_model(&args.model)?, &args.device)
        .with_context(|| format!("loading {}", args.model.display()))?;
    let adapters = crate::load_adapters(args.adapter_path.as_deref(), loaded.model.as_ref())?;
    let adapted = adapters
        .as_ref()
        .map(|a| AdaptedModel::new(loaded.model.as_ref(), a))
        .transpose()?;
    let model: &dyn LanguageModel = match &adapted {
        Some(adapted) => adapted,
        None => loaded.model.as_ref(),
    };
    let mut prompt = args.prompt.clone();
    if prompt == "-" {
        prompt.clear();
        std::io::stdin().read_to_string(&mut prompt)?;
    }
    let ids = cached_prompt_ids(&loaded.tokenizer, loaded.chat_template.as_ref(), &prompt)?;
    model.info().check_context(0, ids.len())?;
    let kv_quantization = match args.kv_bits {
        Some(bits) => Some(KvQuantization::all(
            KvQuant::new(bits, args.kv_group_size)?,
            args.quantized_kv_start,
        )),
        None => None,
    };
    let options = GenerateOptions {
        max_tokens: 0,
        sampler: Default::default(),
        prefill_step: DEFAULT_PREFILL_STEP,
        kv_cache: args.kv_cache,
        kv_quantization,
        max_kv_size: args
            .max_kv_size
            .filter(|_| crate::kv_cache::max_kv_size_applies(&model.info().model_type)),
    };
    let mut cache = options.new_cache(model)?;
    if let Some(quantization) = options
        .kv_quantization
        .as_ref()
        .filter(|q| ids.len() >= q.start)
    {
        // Heads the codes cannot group are refused before the prompt goes through (where it
        // reaches the start).
        cache.try_clone()?.with_quantization(quantization)?;
    }
    let start = Instant::now();
    let mut out = std::io::stdout().lock();
    // mlx-lm's progress line, rewritten after each chunk.
    let mut progress = |done: usize| -> std::io::Result<()> {
        let speed = done as f64 / start.elapsed().as_secs_f64().max(1e-9);
        write!(out, "\rProcessed {done:6} tokens ({speed:6.2} tok/s)")?;
        out.flush()
    };
    progress(0)?;
    // A failed write (a closed pipe) stops the prompt and is reported after it.
    let mut failed = None;
    prefill_quantizing(model, &ids, &mut cache, &options, &mut |event| {
        if let Event::Prefill { done, .. } = event {
            if let Err(err) = progress(done) {
                failed = Some(err);
                return ControlFlow::Break(());
            }
        }
        ControlFlow::Continue(())
    })?;
    if let Some(err) = failed {
        return Err(err.into());
    }
    let peak = peak_resident_bytes().unwrap_or(0) as f64 / 1e9;
    say!("");
    say!("Peak memory: {peak:.3} GB");
    say!("Saving...");
    // Interrupted, the write leaves no temporary file behind.
    crate::remove_partial_files_on_signal()?;
    let metadata = BTreeMap::from([
        (
            MODEL_KEY.to_string(),
            args.model.to_string_lossy().into_owned(),
        ),
        (
            TOKENIZER_CONFIG_KEY.to_string(),
            tokenizer_config_json(args.trust_remote_code, args.eos_token.as_deref()),
        ),
    ]);
    prompt_cache_file::save(&args.prompt_cache_file, &cache, &metadata)?;
    Ok(())
}
