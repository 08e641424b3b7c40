//! `oxlm cache-prompt`: a drop-in for `mlx_lm.cache_prompt`. Runs a prompt through the model
//! and saves the model's state after it in mlx-lm's prompt cache format, for `oxlm generate
//! --prompt-cache-file` (or `mlx_lm generate`) to continue from.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::ops::ControlFlow;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use oxlm_models::lora::AdaptedModel;
use oxlm_models::LanguageModel;
use oxlm_runtime::generate::{prefill_reporting, Event, DEFAULT_PREFILL_STEP};
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
    /// A rotating cache of this many positions: not supported.
    #[arg(long)]
    max_kv_size: Option<usize>,
    /// The file to save the prompt cache in (safetensors).
    #[arg(long)]
    prompt_cache_file: PathBuf,
    /// The message to process; `-` reads it from standard input.
    #[arg(long, short = 'p')]
    prompt: String,
    /// Bits of a quantized cache: mlx-lm quantizes only from --quantized-kv-start tokens on,
    /// and a longer prompt is refused.
    #[arg(long)]
    kv_bits: Option<u32>,
    /// Group size of a quantized cache (with --kv-bits).
    #[arg(long, default_value_t = 64)]
    kv_group_size: usize,
    /// With --kv-bits, the token count from which mlx-lm would quantize the cache.
    #[arg(long, default_value_t = 5000)]
    quantized_kv_start: usize,
    /// Kernel threads (default: one per physical core).
    #[arg(long, value_parser = crate::parse_threads)]
    threads: Option<usize>,
    /// Where the model runs: cpu, cuda (GPU 0) or cuda:N.
    #[arg(long, default_value = "cpu", value_parser = crate::parse_device)]
    device: oxlm_engine::Device,
    /// How the keys and values are kept while the prompt runs, and so written: f16 (the
    /// default) or f32; q8 codes are written as the f32 values they stand for.
    #[arg(long, value_parser = crate::kv_cache::parse_kv_cache)]
    kv_cache: Option<oxlm_engine::KvPrecision>,
}

pub fn run(args: Args) -> Result<()> {
    if args.max_kv_size.is_some() {
        bail!("--max-kv-size is not supported (a rotating cache that drops the prompt's start)");
    }
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
    if args.kv_bits.is_some() && ids.len() >= args.quantized_kv_start {
        // mlx-lm would save a QuantizedKVCache, which oxlm does not keep.
        bail!(
            "--kv-bits: the prompt's {} tokens reach --quantized-kv-start ({}), from which \
             mlx-lm quantizes the cache; quantized prompt caches are not supported",
            ids.len(),
            args.quantized_kv_start
        );
    }
    model.info().check_context(0, ids.len())?;
    let options = GenerateOptions {
        max_tokens: 0,
        sampler: Default::default(),
        prefill_step: DEFAULT_PREFILL_STEP,
        kv_cache: args.kv_cache,
        kv_quantization: None,
    };
    let mut cache = options.new_cache(model)?;
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
    prefill_reporting(
        model,
        &ids,
        &mut cache,
        DEFAULT_PREFILL_STEP,
        &mut |event| {
            if let Event::Prefill { done, .. } = event {
                if let Err(err) = progress(done) {
                    failed = Some(err);
                    return ControlFlow::Break(());
                }
            }
            ControlFlow::Continue(())
        },
    )?;
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
