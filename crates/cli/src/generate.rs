//! `oxlm generate`: a drop-in for `mlx_lm.generate`, printing the same report.

use std::io::{Read, Write};
use std::ops::ControlFlow;
use std::path::PathBuf;

use anyhow::{Context, Result};
use oxlm_models::lora::{AdaptedModel, Adapters};
use oxlm_models::LanguageModel;
use oxlm_runtime::constraint::Grammar;
use oxlm_runtime::generate::{
    generate_stream, peak_memory_bytes, Event, StreamOptions, DEFAULT_PREFILL_STEP,
};
use oxlm_runtime::hub::resolve_model;
use oxlm_runtime::sampler::SamplerConfig;
use oxlm_runtime::{GenerateOptions, LoadedModel};
use serde_json::{json, Map, Value};

#[derive(clap::Args)]
pub struct Args {
    /// The MLX model (config.json, *.safetensors, tokenizer files): a local directory, or a
    /// Hugging Face repo id (org/name or org/name@revision) fetched into the Hugging Face cache.
    #[arg(long)]
    model: PathBuf,
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
    #[arg(long, value_parser = crate::parse_kv_cache, help = crate::KV_CACHE_HELP)]
    kv_cache: Option<oxlm_engine::KvPrecision>,
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

pub fn run(args: Args) -> Result<()> {
    if let Some(threads) = args.threads {
        oxlm_engine::cpu::pool::set_threads(threads);
    }
    let loaded = LoadedModel::load_on(&resolve_model(&args.model)?, &args.device)
        .with_context(|| format!("loading {}", args.model.display()))?;
    let adapters = args
        .adapter_path
        .as_deref()
        .map(|dir| {
            Adapters::load(dir, loaded.model.as_ref())
                .with_context(|| format!("loading adapters from {}", dir.display()))
        })
        .transpose()?;
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
            let text = template.render(&Value::Array(messages), None, true, &extra)?;
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
    let options = GenerateOptions {
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
        kv_cache: args.kv_cache,
    };
    let mut out = std::io::stdout().lock();
    writeln!(out, "==========")?;
    // A failed write (a closed pipe) stops the generation and is reported after it.
    let mut written = Ok(());
    let mut cache = options.new_cache(model)?;
    let generation = generate_stream(
        model,
        &loaded.tokenizer,
        &ids,
        &mut cache,
        &loaded.eos_ids,
        &options,
        &stream,
        &mut |event| {
            let (Event::Token { text, .. } | Event::Text(text)) = event else {
                return ControlFlow::Continue(());
            };
            written = out.write_all(text.as_bytes()).and_then(|()| out.flush());
            match written {
                Ok(()) => ControlFlow::Continue(()),
                Err(_) => ControlFlow::Break(()),
            }
        },
    )?;
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
    let peak = peak_memory_bytes().unwrap_or(0) as f64 / 1e9;
    writeln!(out, "Peak memory: {peak:.3} GB")?;
    Ok(())
}
