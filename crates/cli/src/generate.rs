//! `oxlm generate`: a drop-in for `mlx_lm.generate`, printing the same report.

use std::io::{Read, Write};
use std::ops::ControlFlow;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use oxlm_models::lora::AdaptedModel;
use oxlm_models::LanguageModel;
use oxlm_runtime::constraint::Grammar;
use oxlm_runtime::generate::{
    generate_stream, generate_stream_after_cache, Event, StreamOptions, DEFAULT_PREFILL_STEP,
};
use oxlm_runtime::hub::resolve_model;
use oxlm_runtime::memory::peak_resident_bytes;
use oxlm_runtime::prompt_cache_file::{prompt_after_cache, PromptCacheFile};
use oxlm_runtime::sampler::SamplerConfig;
use oxlm_runtime::{GenerateOptions, LoadedModel};
use serde_json::{json, Map, Value};

#[derive(clap::Args)]
pub struct Args {
    /// The MLX model (config.json, *.safetensors, tokenizer files): a local directory, or a
    /// Hugging Face repo id (org/name or org/name@revision) fetched into the Hugging Face cache.
    /// With --prompt-cache-file, the model the file names unless given (and then the same).
    #[arg(long, required_unless_present = "prompt_cache_file")]
    model: Option<PathBuf>,
    /// The message to send; `-` reads it from standard input.
    #[arg(long, short = 'p', default_value = "hello")]
    prompt: String,
    /// Maximum number of tokens to generate.
    #[arg(long, short = 'm', default_value_t = 100)]
    max_tokens: usize,
    /// Sampling temperature; 0 picks the most likely token (greedy).
    #[arg(long, default_value_t = 0.0, value_parser = crate::parse_temperature)]
    temp: f32,
    /// Nucleus sampling: keep the most likely tokens whose probabilities sum to this.
    #[arg(long, default_value_t = 1.0, value_parser = crate::parse_probability)]
    top_p: f32,
    /// Keep only the K most likely tokens (0 keeps all).
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    /// Drop tokens less likely than this fraction of the most likely one.
    #[arg(long, default_value_t = 0.0, value_parser = crate::parse_probability)]
    min_p: f32,
    /// Seed of the sampler's random numbers.
    #[arg(long)]
    seed: Option<u64>,
    /// A system message placed before the prompt in the chat template.
    #[arg(long)]
    system_prompt: Option<String>,
    /// Send the prompt as raw text, without the tokenizer's chat template.
    #[arg(long)]
    ignore_chat_template: bool,
    /// Extra variables for the chat template, as a JSON object (e.g. '{"enable_thinking": false}').
    #[arg(long)]
    chat_template_config: Option<String>,
    /// A LoRA adapter directory (adapter_config.json, adapters.safetensors) to apply.
    #[arg(long)]
    adapter_path: Option<PathBuf>,
    /// Prompt tokens processed per forward pass.
    #[arg(long, default_value_t = DEFAULT_PREFILL_STEP)]
    prefill_step_size: usize,
    /// Kernel threads (default: one per physical core).
    #[arg(long, value_parser = crate::parse_threads)]
    threads: Option<usize>,
    /// Where the model runs: cpu, cuda (GPU 0) or cuda:N.
    #[arg(long, default_value = "cpu", value_parser = crate::parse_device)]
    device: oxlm_engine::Device,
    #[command(flatten)]
    kv: crate::kv_cache::KvCacheArgs,
    /// With --kv-bits, how many tokens the cache holds before it is quantized (mlx-lm's
    /// --quantized-kv-start: checked after each prompt chunk and each generated token; a
    /// checkpoint's kv_config.json applies from the first chunk on).
    #[arg(long)]
    quantized_kv_start: Option<usize>,
    /// Constrain the output to JSON valid under the JSON Schema in this file (each token is
    /// picked among those that keep the output valid).
    #[arg(long, group = "structure")]
    json_schema: Option<PathBuf>,
    /// Constrain the output to the Lark grammar in this file (llguidance's dialect: `%json
    /// {...}` embeds a JSON Schema, `<name>` a special token).
    #[arg(long, group = "structure")]
    grammar: Option<PathBuf>,
    /// Constrain the whole output to match this regular expression.
    #[arg(long, group = "structure")]
    regex: Option<String>,
    /// A prompt cache (from `oxlm cache-prompt` or `mlx_lm.cache_prompt`) to continue from:
    /// the prompt follows the cached one (with a chat template, as more of its message).
    #[arg(long)]
    prompt_cache_file: Option<PathBuf>,
    /// Bound each layer's cache to a ring of this many positions that keeps the first 4, as
    /// mlx-lm's --max-kv-size does: memory stops growing, and past it the model sees the
    /// prompt's start and its most recent tokens. Only for the model types mlx-lm bounds (those
    /// that build no cache of their own, such as qwen2, qwen3 and phi3; llama and mistral do);
    /// elsewhere it is left unused, as in mlx-lm, with a note. With --prompt-cache-file, the
    /// file's caches are used as it holds them (bounded where it was made with --max-kv-size),
    /// and this is left unused, as in mlx-lm.
    #[arg(long, value_parser = crate::kv_cache::parse_max_kv_size, conflicts_with = "kv_bits")]
    max_kv_size: Option<usize>,
}

impl Args {
    /// The grammar the output must follow, if one is asked for.
    fn grammar(&self) -> Result<Option<Grammar>> {
        let read = |path: &PathBuf| {
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))
        };
        Ok(if let Some(path) = &self.json_schema {
            let schema = serde_json::from_str(&read(path)?)
                .with_context(|| format!("{} is not JSON", path.display()))?;
            Some(Grammar::JsonSchema(schema))
        } else if let Some(path) = &self.grammar {
            Some(Grammar::Lark(read(path)?))
        } else {
            self.regex.clone().map(Grammar::Regex)
        })
    }
}

/// The model a prompt cache was made with, as `mlx_lm generate` takes it: the file's unless
/// `--model` is given, and then it must be the same (the same text, or the same directory).
fn cached_model(given: Option<&Path>, file: &PromptCacheFile) -> Result<PathBuf> {
    let cached = file.model().map(PathBuf::from);
    match (given, cached) {
        (Some(given), Some(cached)) => {
            let same_dir = given
                .canonicalize()
                .ok()
                .is_some_and(|g| cached.canonicalize().ok() == Some(g));
            if given != cached && !same_dir {
                bail!(
                    "Providing a different model ({}) than that used to create the prompt \
                     cache ({}) is an error.",
                    given.display(),
                    cached.display()
                );
            }
            Ok(given.to_path_buf())
        }
        (Some(given), None) => Ok(given.to_path_buf()),
        (None, Some(cached)) => Ok(cached),
        (None, None) => bail!("{} names no model: pass --model", file.path().display()),
    }
}

/// mlx-lm's `--quantized-kv-start` default.
const DEFAULT_QUANTIZED_KV_START: usize = 5000;

pub fn run(args: Args) -> Result<()> {
    if let Some(threads) = args.threads {
        oxlm_engine::cpu::pool::set_threads(threads);
    }
    // Read first, as mlx-lm reads it: it names the model.
    let cache_file = args
        .prompt_cache_file
        .as_deref()
        .map(PromptCacheFile::load)
        .transpose()?;
    let model_path = match &cache_file {
        Some(file) => cached_model(args.model.as_deref(), file)?,
        None => args.model.clone().context("--model is required")?,
    };
    let mut loaded = LoadedModel::load_on(&resolve_model(&model_path)?, &args.device)
        .with_context(|| format!("loading {}", model_path.display()))?;
    if let Some(file) = &cache_file {
        // The cache's `--eos-token` ends generation too, as mlx-lm's tokenizer takes it.
        if let Some(Value::String(eos)) = file.tokenizer_config()?.get("eos_token") {
            let id = loaded.tokenizer.token_to_id(eos).with_context(|| {
                format!("the prompt cache's eos_token `{eos}` is not a token of this tokenizer")
            })?;
            loaded.eos_ids.insert(id);
        }
    }
    let adapters = crate::load_adapters(args.adapter_path.as_deref(), loaded.model.as_ref())?;
    let adapted = adapters
        .as_ref()
        .map(|a| AdaptedModel::new(loaded.model.as_ref(), a))
        .transpose()?;
    let model: &dyn LanguageModel = match &adapted {
        Some(adapted) => adapted,
        None => loaded.model.as_ref(),
    };
    let mut prompt = args.prompt.replace("\\n", "\n").replace("\\t", "\t");
    if prompt == "-" {
        prompt.clear();
        std::io::stdin().read_to_string(&mut prompt)?;
    }
    let template = loaded
        .chat_template
        .as_ref()
        .filter(|_| !args.ignore_chat_template);
    let ids = match template {
        Some(template) => {
            let extra: Map<String, Value> = match &args.chat_template_config {
                Some(text) => serde_json::from_str(text).context("--chat-template-config")?,
                None => Map::new(),
            };
            let mut messages = Vec::new();
            if let Some(system) = &args.system_prompt {
                messages.push(json!({"role": "system", "content": system}));
            }
            messages.push(json!({"role": "user", "content": prompt}));
            let text = match &cache_file {
                // The cached prompt holds the message's start; this is the rest of it on.
                Some(_) => prompt_after_cache(template, &messages, &extra)?,
                None => template.render(&Value::Array(messages), None, true, &extra)?,
            };
            loaded.tokenizer.encode(&text, false)?
        }
        None => loaded.tokenizer.encode(&prompt, true)?,
    };
    let constraint = match args.grammar()? {
        Some(grammar) => Some(loaded.grammars()?.constraint(&grammar)?),
        None => None,
    };
    let stream = StreamOptions {
        constraint,
        ..StreamOptions::default()
    };
    // mlx-lm's default start for --kv-bits; a kv_config.json's layers from the first chunk on.
    let quantized_kv_start = args.quantized_kv_start.unwrap_or(match args.kv.kv_bits {
        Some(_) => DEFAULT_QUANTIZED_KV_START,
        None => 0,
    });
    let mut options = GenerateOptions {
        max_tokens: args.max_tokens,
        sampler: SamplerConfig {
            temperature: args.temp,
            top_p: args.top_p,
            top_k: args.top_k,
            min_p: args.min_p,
            seed: args.seed,
            ..SamplerConfig::default()
        },
        prefill_step: args.prefill_step_size,
        kv_cache: args.kv.kv_cache,
        kv_quantization: args.kv.quantization(
            &loaded.dir,
            model.info().num_layers,
            quantized_kv_start,
        )?,
        max_kv_size: args.max_kv_size,
    };
    if options.max_kv_size.is_some() {
        if cache_file.is_some() {
            // mlx-lm's generate_step makes no cache where it is given one.
            eprintln!(
                "note: --max-kv-size is left unused: the prompt cache's layers are used as the \
                 file holds them (mlx-lm uses them as loaded too)"
            );
            options.max_kv_size = None;
        } else if !crate::kv_cache::max_kv_size_applies(&model.info().model_type) {
            options.max_kv_size = None;
        }
    }
    let mut cache = options.new_cache(model)?;
    if let Some(file) = &cache_file {
        // Before the report starts: a file that does not fit the model is refused here.
        file.restore(&mut cache)?;
        if cache.keeps_first_positions() && args.kv.kv_bits.is_some() {
            bail!(
                "--kv-bits cannot be used with a prompt cache made with --max-kv-size (mlx-lm \
                 cannot quantize its RotatingKVCache layers)"
            );
        }
    }
    let reach = cache.offset + ids.len() + args.max_tokens;
    if let Some(quantization) = options
        .kv_quantization
        .as_ref()
        .filter(|q| reach >= q.start)
    {
        // Heads the codes cannot group are refused before the prompt goes through (where the
        // sequence can reach the start).
        options.new_cache(model)?.with_quantization(quantization)?;
    }
    let mut out = std::io::stdout().lock();
    writeln!(out, "==========")?;
    // A failed write (a closed pipe) stops the generation and is reported after it.
    let mut written = Ok(());
    let mut on_event = |event: Event| {
        let (Event::Token { text, .. } | Event::Text(text)) = event else {
            return ControlFlow::Continue(());
        };
        written = out.write_all(text.as_bytes()).and_then(|()| out.flush());
        match written {
            Ok(()) => ControlFlow::Continue(()),
            Err(_) => ControlFlow::Break(()),
        }
    };
    let (tokenizer, eos_ids) = (&loaded.tokenizer, &loaded.eos_ids);
    let generation = match &cache_file {
        Some(_) => {
            let (prompt, cache) = (&ids, &mut cache);
            let event = &mut on_event;
            generate_stream_after_cache(
                model, tokenizer, prompt, cache, eos_ids, &options, &stream, event,
            )?
        }
        None => generate_stream(
            model,
            tokenizer,
            &ids,
            &mut cache,
            eos_ids,
            &options,
            &stream,
            &mut on_event,
        )?,
    };
    written?;
    writeln!(out)?;
    writeln!(out, "==========")?;
    if generation.text.is_empty() {
        writeln!(out, "No text generated for this prompt")?;
        return Ok(());
    }
    writeln!(
        out,
        "Prompt: {} tokens, {:.3} tokens-per-sec",
        generation.prompt_tokens, generation.prompt_tps
    )?;
    writeln!(
        out,
        "Generation: {} tokens, {:.3} tokens-per-sec",
        generation.tokens.len(),
        generation.generation_tps
    )?;
    let peak = peak_resident_bytes().unwrap_or(0) as f64 / 1e9;
    writeln!(out, "Peak memory: {peak:.3} GB")?;
    Ok(())
}
