//! `oxlm bench`: times prefill and greedy decode on fixed token ids, with no tokenizer and no
//! end-of-sequence stop, for the peer benchmark in `benches/`. Prints one JSON object; on a GPU
//! with `OXLM_TRACE` set, it also holds where a decode step's time went (`trace`).

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::sync::{mpsc, Arc, Mutex};
use std::time::Instant;

use anyhow::{Context, Result};
use oxlm_engine::cpu::{pool, qint};
use oxlm_engine::cuda::{
    TracedLaunch, TRACE_DONE, TRACE_FIRST_READY, TRACE_STAGES, TRACE_STAGE_NAMES,
};
use oxlm_engine::{ops, DecodeSteps, KvPrecision, KvQuant};
use oxlm_models::lora::{AdaptedModel, Adapters, LoraConfig};
use oxlm_models::{Cache, LanguageModel, Logits};
use oxlm_runtime::adapter_store::Adapter;
use oxlm_runtime::batcher::{Batcher, BatcherSettings, Job, Requester, Update};
use oxlm_runtime::constraint::{Grammar, Grammars};
use oxlm_runtime::generate::{decode_step, Picking, Stepped, DEFAULT_PREFILL_STEP};
use oxlm_runtime::hub::resolve_model;
use oxlm_runtime::memory::peak_resident_bytes;
use oxlm_runtime::sampler::SamplerConfig;
use oxlm_runtime::tokenizer::Tokenizer;
use oxlm_runtime::{GenerateOptions, StreamOptions};
use serde_json::json;

#[derive(clap::Args)]
pub struct Args {
    /// The MLX model: a local directory, or a Hugging Face repo id (org/name or
    /// org/name@revision) fetched into the Hugging Face cache.
    #[arg(long)]
    model: PathBuf,
    /// Prompt length: the prefill that is timed.
    #[arg(long, default_value_t = 512)]
    prompt_tokens: usize,
    /// Tokens decoded after the prompt.
    #[arg(long, default_value_t = 128)]
    gen_tokens: usize,
    /// Kernel threads (default: one per physical core).
    #[arg(long, value_parser = crate::parse_threads)]
    threads: Option<usize>,
    /// Timed runs; the medians are reported.
    #[arg(long, default_value_t = 3)]
    repeats: usize,
    /// Also time decoding `--depth-tokens` tokens that end at this many tokens of context
    /// (repeatable).
    #[arg(long)]
    depth: Vec<usize>,
    #[arg(long, default_value_t = 32)]
    depth_tokens: usize,
    /// Also time decoding `--gen-tokens` tokens for this many sequences at once, each first
    /// prefilled with its own `--prompt-tokens` prompt (repeatable), through the batcher that
    /// serves concurrent requests; reports the tokens/s of all sequences together.
    #[arg(long)]
    batch: Vec<usize>,
    /// Prompts of a `--batch` of different lengths, spread over the 256 tokens up to
    /// `--prompt-tokens`, as a server's requests come: the sequences then outgrow their caches
    /// at different steps.
    #[arg(long)]
    stagger: bool,
    /// Activations of the CPU decode GEMV: int8 triples or int16 pairs (as exact as f32; the
    /// default is whichever this processor runs faster), f32, or int16 and int8 (faster, less
    /// exact); see `oxlm_engine::cpu::qint`.
    #[arg(long, value_enum)]
    activations: Option<GemvActivations>,
    /// Where the model runs: cpu, cuda (GPU 0) or cuda:N.
    #[arg(long, default_value = "cpu", value_parser = crate::parse_device)]
    device: oxlm_engine::Device,
    /// f16 (the default), f32, or q8 and q4 (mlx-lm's quantized cache in groups of 64, from the
    /// first token).
    #[arg(long, value_parser = parse_kv_cache)]
    kv_cache: Option<KvPrecision>,
    /// Also time each `--batch` with every sequence constrained to JSON valid under the JSON
    /// Schema in this file (one that no `--gen-tokens` output completes, such as
    /// benches/structured_schema.json), and report the cost against the free batch. Needs the
    /// model's tokenizer.
    #[arg(long)]
    json_schema: Option<PathBuf>,
    /// Also time each `--batch` through this many LoRA adapters of mlx_lm.lora's default shape
    /// (rank 8 on every linear layer of the last 16 blocks; made here, with zero weights: the
    /// work does not depend on them): every sequence through the first, then the sequences
    /// spread over all of them, in turn, and report the cost of the mix against one adapter.
    #[arg(long, value_parser = clap::value_parser!(u64).range(2..))]
    adapters: Option<u64>,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum GemvActivations {
    Int8Triple,
    Int16Pair,
    F32,
    Int16,
    Int8,
}

impl GemvActivations {
    fn precision(self) -> qint::Precision {
        use qint::{Activations, Precision};
        match self {
            GemvActivations::Int8Triple => Precision::Int(Activations::I8Triple),
            GemvActivations::Int16Pair => Precision::Int(Activations::I16Pair),
            GemvActivations::F32 => Precision::F32,
            GemvActivations::Int16 => Precision::Int(Activations::I16),
            GemvActivations::Int8 => Precision::Int(Activations::I8),
        }
    }
}

/// Deterministic ids spread over the vocabulary (random weights make any ids equally good).
fn prompt(len: usize, vocab: usize, seed: u64) -> Vec<u32> {
    let mut s = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..len)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 33) % vocab as u64) as u32
        })
        .collect()
}

/// Feeds `ids` in chunks as `generate` does; returns the greedy pick of the last logits.
fn prefill(model: &dyn LanguageModel, ids: &[u32], cache: &mut Cache) -> Result<u32> {
    let mut logits = Vec::new();
    for chunk in ids.chunks(DEFAULT_PREFILL_STEP) {
        logits = model.forward(chunk, cache, Logits::Last)?.into_data();
    }
    Ok(ops::argmax(&logits))
}

/// One greedy decoding step for every sequence of `caches`, from each one's last token, as
/// `generate` and the server take it (`decode_step`: the picks made where the logits are; one
/// sequence through `forward`, more through `forward_batch`), replayed by `steps`.
fn greedy_step(
    model: &dyn LanguageModel,
    steps: &mut DecodeSteps,
    tokens: &[u32],
    caches: &mut [Cache],
) -> Result<Vec<u32>> {
    let mut caches: Vec<&mut Cache> = caches.iter_mut().collect();
    let Stepped::Picks(picks) = decode_step(model, steps, tokens, &mut caches, Picking::Greedy)?
    else {
        anyhow::bail!("a greedy step gave logits rather than picks");
    };
    Ok(picks.iter().map(|p| p.id).collect())
}

/// New caches for sequences of prompts `lengths` tokens long (seeded from `seed`), each
/// prefilled with its own, and each one's first pick.
fn prefill_sequences(
    model: &dyn LanguageModel,
    kv_cache: KvPrecision,
    lengths: &[usize],
    seed: u64,
) -> Result<(Vec<u32>, Vec<Cache>)> {
    let vocab = model.info().vocab_size;
    let mut caches = Vec::with_capacity(lengths.len());
    let mut tokens = Vec::with_capacity(lengths.len());
    for (seq, &len) in (seed..).zip(lengths) {
        let mut cache = model.new_cache_in(kv_cache)?;
        tokens.push(prefill(model, &prompt(len, vocab, seq), &mut cache)?);
        caches.push(cache);
    }
    Ok((tokens, caches))
}

/// The prompt lengths of a batch of `sequences`: all `len`, or with `stagger` spread evenly
/// over the 256 tokens up to `len` (a cache's growth step), so that each sequence outgrows its
/// cache at a step of its own.
fn batch_lengths(sequences: usize, len: usize, stagger: bool) -> Vec<usize> {
    (0..sequences)
        .map(|i| {
            if stagger {
                len.saturating_sub(i * 256 / sequences).max(1)
            } else {
                len
            }
        })
        .collect()
}

/// What a run of decode steps measured.
struct Decoded {
    seconds: f64,
    /// Steps replayed from a captured graph (GPU).
    replayed: u64,
    /// Microseconds per step of host work before each step's download (GPU).
    host_us: Option<f64>,
    /// Microseconds per replayed step of the GPU's span, from its first graph's launch to its
    /// last replayed call's end (GPU): the rest of a step's wall time the GPU is idle.
    gpu_us: Option<f64>,
}

/// Decodes `n` greedy tokens for every sequence of `caches` at once, starting from `tokens`,
/// as `generate` does (GPU steps replayed as graphs).
fn decode(
    model: &dyn LanguageModel,
    mut tokens: Vec<u32>,
    caches: &mut [Cache],
    n: usize,
) -> Result<Decoded> {
    let mut steps = DecodeSteps::new(&model.info().device);
    let start = Instant::now();
    for _ in 0..n {
        tokens = greedy_step(model, &mut steps, &tokens, caches)?;
    }
    Ok(Decoded {
        seconds: start.elapsed().as_secs_f64(),
        replayed: steps.replayed(),
        host_us: steps
            .host_time()
            .map(|host| host.as_secs_f64() * 1e6 / n.max(1) as f64),
        gpu_us: steps
            .gpu_time()
            .filter(|_| steps.replayed() > 0)
            .map(|span| span.as_secs_f64() * 1e6 / steps.replayed() as f64),
    })
}

/// When the jobs of a batch got their first token and ended, and the first error met.
struct BatchTimes {
    first_token: Vec<Option<Instant>>,
    done: Vec<Option<Instant>>,
    error: Option<String>,
}

/// A benchmark's job: it only notes the times of its updates.
struct Timed {
    times: Arc<Mutex<BatchTimes>>,
    job: usize,
}

impl Requester for Timed {
    fn deliver(&self, update: Update) -> bool {
        let mut times = self.times.lock().unwrap_or_else(|e| e.into_inner());
        match update {
            Update::Token { .. } => {
                times.first_token[self.job].get_or_insert_with(Instant::now);
            }
            Update::Done(result) => {
                times.done[self.job] = Some(Instant::now());
                if let Err(e) = result {
                    times.error.get_or_insert(e.to_string());
                }
            }
            _ => {}
        }
        true
    }

    fn cancelled(&self) -> bool {
        false
    }
}

/// Decodes `n` greedy tokens for each of prompts `lengths` tokens long through the runtime's
/// batcher, as `serve` decodes concurrent requests; times the steps from the last first token
/// (every prompt goes through before the first step) to the last job's end.
fn decode_batch(
    model: &dyn LanguageModel,
    kv_cache: KvPrecision,
    lengths: &[usize],
    n: usize,
    constrained: Option<&Constrained>,
    adapters: &[Arc<Adapter>],
) -> Result<Decoded> {
    let vocab = model.info().vocab_size;
    let times = Arc::new(Mutex::new(BatchTimes {
        first_token: vec![None; lengths.len()],
        done: vec![None; lengths.len()],
        error: None,
    }));
    let (jobs, queue) = mpsc::channel();
    for (job, (seed, &len)) in (1000..).zip(lengths).enumerate() {
        let options = GenerateOptions {
            max_tokens: n + 1,
            sampler: SamplerConfig::default(),
            // All prompts in the first prefill turn, each in one pass.
            prefill_step: lengths.iter().sum::<usize>().max(1),
            kv_cache: Some(kv_cache),
            kv_quantization: None,
            max_kv_size: None,
        };
        let requester = Timed {
            times: times.clone(),
            job,
        };
        jobs.send(Job {
            prompt: prompt(len, vocab, seed),
            // The sequences in turn through each adapter.
            adapters: adapters
                .get(job % adapters.len().max(1))
                .cloned()
                .into_iter()
                .collect(),
            options,
            stream: StreamOptions {
                constraint: constrained
                    .map(|c| c.grammars.constraint(&c.grammar))
                    .transpose()?,
                ..StreamOptions::default()
            },
            requester: Box::new(requester),
            deadline: None,
            memory: 0,
        })
        .map_err(|_| anyhow::anyhow!("the batcher's queue closed"))?;
    }
    drop(jobs);
    let settings = BatcherSettings {
        capacity: lengths.len(),
        cache_entries: 0,
        cache_bytes: 0,
        shutdown: Arc::new(AtomicBool::new(false)),
        stats: Arc::default(),
        // Whole steps: the figures are the model's, not a schedule's.
        prefill_pause: None,
        memory_budget: None,
    };
    // No end-of-sequence stop: every sequence decodes `n` tokens.
    let eos_ids = HashSet::new();
    let mut batcher = Batcher::new(model, None, &eos_ids, settings);
    batcher.run(&queue);
    let times = times.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(e) = &times.error {
        anyhow::bail!("a batched job failed: {e}");
    }
    let start = times.first_token.iter().flatten().max();
    let end = times.done.iter().flatten().max();
    let (Some(start), Some(end)) = (start, end) else {
        anyhow::bail!("the batch ended without its tokens");
    };
    let totals = batcher.step_totals();
    let per_step = |d: std::time::Duration| d.as_secs_f64() * 1e6 / totals.steps.max(1) as f64;
    let on_gpu = !model.info().device.is_cpu();
    Ok(Decoded {
        seconds: (*end - *start).as_secs_f64(),
        replayed: totals.replayed,
        host_us: on_gpu.then(|| per_step(totals.host)),
        gpu_us: (on_gpu && totals.replayed > 0)
            .then(|| totals.gpu.as_secs_f64() * 1e6 / totals.replayed as f64),
    })
}

/// A batch run's steps: how many were replayed, and the host's and the GPU's time per step.
fn steps_json(decoded: &Decoded) -> serde_json::Value {
    json!({
        "replayed_steps": decoded.replayed,
        "host_us_per_step": decoded.host_us,
        "gpu_us_per_step": decoded.gpu_us,
    })
}

/// A grammar every sequence of a constrained batch follows.
struct Constrained {
    grammars: Grammars,
    grammar: Grammar,
}

impl Constrained {
    fn load(model_dir: &Path, vocab_size: usize, schema: &Path) -> Result<Self> {
        let tokenizer = Tokenizer::from_dir(model_dir)?;
        let eos = tokenizer
            .eos_token_id()
            .context("the tokenizer has no eos token")?;
        let text = std::fs::read_to_string(schema)
            .with_context(|| format!("reading {}", schema.display()))?;
        let schema = serde_json::from_str(&text)
            .with_context(|| format!("{} is not JSON", schema.display()))?;
        Ok(Constrained {
            grammars: Grammars::new(&tokenizer, &[eos], vocab_size)?,
            grammar: Grammar::JsonSchema(schema),
        })
    }
}

/// With `OXLM_TRACE` set on a GPU (see `Gpu::take_trace`): more prefills, of prompts `lengths`
/// tokens long, and `n` decode steps of them all, traced step by step, and where the steps'
/// time went: for each kernel, its launches a step and the microseconds a step it held the
/// chain (from its inputs being ready to the next launch's), and how long after the launch
/// before it was ready it started (its early start), medians over the steps; then the same for
/// the first launches of a step. Each also holds when, from its first block's inputs ready, it
/// reached the stages its kernel marks (`TRACE_STAGE_NAMES`: its last block ready, the last
/// warp's activations rounded, keys summed, end...), and its end to the next launch's start.
/// Only steps of the usual length count (not the first, which captures the graphs, nor those
/// that grow the caches); the last launch of a step, whose chain runs on through the download
/// and the host's turn, is left out. `None` off the GPU or untraced.
fn traced_decode(
    model: &dyn LanguageModel,
    kv_cache: KvPrecision,
    lengths: &[usize],
    n: usize,
) -> Result<Option<serde_json::Value>> {
    let oxlm_engine::Device::Cuda(gpu) = &model.info().device else {
        return Ok(None);
    };
    // Empties the trace of the runs before, which may have overflowed it.
    if let Ok(None) = gpu.take_trace() {
        return Ok(None);
    }
    if n < 3 {
        anyhow::bail!("a traced decode needs --gen-tokens 3 or more");
    }
    let (mut tokens, mut caches) = prefill_sequences(model, kv_cache, lengths, 0)?;
    gpu.take_trace()?;
    let mut decode_steps = DecodeSteps::new(&model.info().device);
    let mut steps = Vec::with_capacity(n);
    for _ in 0..n {
        tokens = greedy_step(model, &mut decode_steps, &tokens, &mut caches)?;
        steps.push(gpu.take_trace()?.unwrap_or_default());
    }
    let per_step = median(steps.iter().map(|s| s.len() as f64).collect()) as usize;
    let steps: Vec<_> = steps
        .into_iter()
        .skip(1)
        .filter(|s| s.len() == per_step && per_step > 1)
        .collect();
    if steps.is_empty() {
        anyhow::bail!("no decode step of {per_step} launches was traced");
    }
    let us = |a: u64, b: u64| (b as f64 - a as f64) / 1e3;
    let positions: Vec<(f64, f64)> = (0..per_step - 1)
        .map(|p| {
            let chain = steps.iter().map(|s| us(s[p].ready_ns, s[p + 1].ready_ns));
            let lag = steps.iter().map(|s| {
                p.checked_sub(1)
                    .map_or(0.0, |q| us(s[q].ready_ns, s[p].started_ns))
            });
            (median(chain.collect()), median(lag.collect()))
        })
        .collect();
    // Within a launch, from its first block's inputs ready: each stage it marks (its last
    // block's inputs ready, its last warp's activations rounded, keys summed, end...), then its
    // end to the next launch's first block ready (medians over the steps; NaN where unmarked).
    let stages: Vec<Vec<f64>> = (0..per_step - 1)
        .map(|p| {
            let stage = |at: &dyn Fn(&[TracedLaunch]) -> Option<f64>| {
                let v: Vec<f64> = steps.iter().filter_map(|s| at(s)).collect();
                if v.is_empty() {
                    f64::NAN
                } else {
                    median(v)
                }
            };
            let mut v: Vec<f64> = (1..TRACE_STAGES)
                .map(|i| {
                    stage(&|s| Some(us(s[p].stages_ns[TRACE_FIRST_READY]?, s[p].stages_ns[i]?)))
                })
                .collect();
            v.push(stage(&|s| {
                Some(us(
                    s[p].stages_ns[TRACE_DONE]?,
                    s[p + 1].stages_ns[TRACE_FIRST_READY]?,
                ))
            }));
            v
        })
        .collect();
    let names = |p: usize| &steps[0][p].kernel;
    let mut by_kernel: Vec<(&String, usize, f64, f64, Vec<f64>)> = Vec::new();
    for (p, &(chain, lag)) in positions.iter().enumerate() {
        let stage = stages[p].clone();
        match by_kernel.iter_mut().find(|k| k.0 == names(p)) {
            Some(k) => {
                (k.1, k.2, k.3) = (k.1 + 1, k.2 + chain, k.3 + lag);
                k.4.iter_mut().zip(stage).for_each(|(a, b)| *a += b);
            }
            None => by_kernel.push((names(p), 1, chain, lag, stage)),
        }
    }
    by_kernel.sort_by(|a, b| b.2.total_cmp(&a.2));
    let stage_json = |v: &[f64], count: f64| {
        let names = TRACE_STAGE_NAMES[1..]
            .iter()
            .copied()
            .chain(["done_to_next"]);
        let at = |x: f64| (!x.is_nan()).then_some(x / count);
        names
            .zip(v)
            .map(|(name, &x)| (format!("{name}_us"), json!(at(x))))
            .collect::<serde_json::Map<_, _>>()
    };
    Ok(Some(json!({
        "steps": steps.len(),
        "launches_per_step": per_step,
        "last_kernel": names(per_step - 1),
        "chain_us_but_last": positions.iter().map(|p| p.0).sum::<f64>(),
        "by_kernel": by_kernel.iter().map(|(name, count, chain, lag, stage)| json!({
            "kernel": name, "per_step": count, "chain_us": chain,
            "mean_lag_us": lag / *count as f64,
            "mean_stages": stage_json(stage, *count as f64),
        })).collect::<Vec<_>>(),
        "first_positions": positions.iter().take(24).enumerate().map(|(p, (chain, lag))| json!({
            "kernel": names(p), "chain_us": chain, "lag_us": lag,
            "stages": stage_json(&stages[p], 1.0),
        })).collect::<Vec<_>>(),
    })))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

pub fn run(args: Args) -> Result<()> {
    if let Some(threads) = args.threads {
        pool::set_threads(threads);
    }
    if let Some(a) = args.activations {
        qint::set_precision(a.precision());
    }
    let model_dir = resolve_model(&args.model)?;
    let start = Instant::now();
    let model = oxlm_models::load_on(&model_dir, &args.device)
        .with_context(|| format!("loading {}", args.model.display()))?;
    let load_s = start.elapsed().as_secs_f64();
    let kv_cache = args.kv_cache.unwrap_or_default();
    let constrained = args
        .json_schema
        .as_deref()
        .map(|schema| Constrained::load(&model_dir, model.info().vocab_size, schema))
        .transpose()?;
    let adapters: Vec<Arc<Adapter>> = (0..args.adapters.unwrap_or(0))
        .map(|i| {
            let mut zeros = Adapters::zeros(LoraConfig::new(16), model.as_ref())?;
            // Where a loaded adapter's matrices would be: on the model's GPU.
            zeros.place(&model.info().device)?;
            Ok(Arc::new(Adapter::unsaved(&format!("bench-{i}"), zeros)))
        })
        .collect::<Result<_>>()?;
    let (mut prefill_tps, mut decode_tps) = (Vec::new(), Vec::new());
    let mut replayed_steps = 0;
    let (mut host_us, mut gpu_us) = (Vec::new(), Vec::new());
    // One untimed run first: page in the weights and grow the caches.
    for rep in 0..=args.repeats.max(1) {
        let t = Instant::now();
        let (tokens, mut caches) =
            prefill_sequences(model.as_ref(), kv_cache, &[args.prompt_tokens], rep as u64)?;
        let prefill_s = t.elapsed().as_secs_f64();
        let decoded = decode(model.as_ref(), tokens, &mut caches, args.gen_tokens)?;
        replayed_steps = decoded.replayed;
        if rep > 0 {
            prefill_tps.push(args.prompt_tokens as f64 / prefill_s);
            decode_tps.push(args.gen_tokens as f64 / decoded.seconds);
            host_us.extend(decoded.host_us);
            gpu_us.extend(decoded.gpu_us);
        }
    }
    let trace = traced_decode(
        model.as_ref(),
        kv_cache,
        &[args.prompt_tokens],
        args.gen_tokens,
    )?;
    let mut depths = Vec::new();
    for &depth in &args.depth {
        let len = depth.saturating_sub(args.depth_tokens).max(1);
        let (tokens, mut caches) = prefill_sequences(model.as_ref(), kv_cache, &[len], 99)?;
        let s = decode(model.as_ref(), tokens, &mut caches, args.depth_tokens)?.seconds;
        depths.push(json!({"context": depth, "decode_tps": args.depth_tokens as f64 / s}));
    }
    let mut batches = Vec::new();
    for &sequences in &args.batch {
        let lengths = batch_lengths(sequences, args.prompt_tokens, args.stagger);
        // As for one sequence, an untimed run first: the batch's kernels are loaded, its
        // graphs captured and its temporaries allocated on their first step.
        let run_with = |constrained, adapters: &[Arc<Adapter>]| {
            decode_batch(
                model.as_ref(),
                kv_cache,
                &lengths,
                args.gen_tokens,
                constrained,
                adapters,
            )
        };
        let run = |constrained| run_with(constrained, &[]);
        run(None)?;
        let decoded = run(None)?;
        let tps = |decoded: &Decoded| (sequences * args.gen_tokens) as f64 / decoded.seconds;
        // The free and the constrained runs in turn, so that both meet the same machine.
        let constrained_tps = match &constrained {
            Some(constrained) => {
                run(Some(constrained))?;
                let mut runs = Vec::new();
                for _ in 0..args.repeats.max(1) {
                    runs.push((tps(&run(None)?), tps(&run(Some(constrained))?)));
                }
                Some(runs)
            }
            None => None,
        };
        // One adapter and the mix in turn, likewise; the steps of the last of each as the free
        // run's are reported.
        let (mut adapter_tps, mut adapter_steps) = (None, None);
        if let Some(first) = adapters.first() {
            let one = std::slice::from_ref(first);
            run_with(None, one)?;
            run_with(None, &adapters)?;
            let mut runs = Vec::new();
            for _ in 0..args.repeats.max(1) {
                let (single, mixed) = (run_with(None, one)?, run_with(None, &adapters)?);
                runs.push((tps(&single), tps(&mixed)));
                adapter_steps =
                    Some(json!({"one": steps_json(&single), "mixed": steps_json(&mixed)}));
            }
            adapter_tps = Some(runs);
        }
        let trace = traced_decode(model.as_ref(), kv_cache, &lengths, args.gen_tokens)?;
        let adapter_trace = match adapters.first() {
            Some(first) => {
                let adapted = AdaptedModel::new(model.as_ref(), &first.adapters)?;
                traced_decode(&adapted, kv_cache, &lengths, args.gen_tokens)?
            }
            None => None,
        };
        batches.push(json!({
            "sequences": sequences,
            "decode_tps": tps(&decoded),
            // Pairs of (free, constrained) tokens/s, and the median cost of the constraint.
            "constrained_runs": constrained_tps,
            "constraint_overhead": constrained_tps.as_ref().map(|runs| {
                median(runs.iter().map(|(free, constrained)| 1.0 - constrained / free).collect())
            }),
            // Pairs of (one adapter, the mix) tokens/s, and the median cost of the mix.
            "adapter_runs": adapter_tps,
            "mixed_adapter_overhead": adapter_tps.as_ref().map(|runs| {
                median(runs.iter().map(|(one, mixed)| 1.0 - mixed / one).collect())
            }),
            "adapter_steps": adapter_steps,
            "replayed_steps": decoded.replayed,
            "host_us_per_step": decoded.host_us,
            "gpu_us_per_step": decoded.gpu_us,
            "trace": trace,
            // Every sequence through the first adapter.
            "adapter_trace": adapter_trace,
        }));
    }
    let report = json!({
        "model": args.model.display().to_string(),
        "device": args.device.to_string(),
        "threads": pool::threads(),
        "activations": format!("{:?}", qint::precision()),
        "kv_cache": format!("{kv_cache:?}"),
        "load_s": load_s,
        "prompt_tokens": args.prompt_tokens,
        "gen_tokens": args.gen_tokens,
        "prefill_tps": median(prefill_tps.clone()),
        "decode_tps": median(decode_tps.clone()),
        "prefill_tps_runs": prefill_tps,
        "decode_tps_runs": decode_tps,
        "replayed_steps": replayed_steps,
        "decode_host_us_per_step": (!host_us.is_empty()).then(|| median(host_us)),
        "decode_gpu_us_per_step": (!gpu_us.is_empty()).then(|| median(gpu_us)),
        "depths": depths,
        "batches": batches,
        "peak_rss_bytes": peak_resident_bytes(),
        "trace": trace,
    });
    say!("{report}");
    Ok(())
}

fn parse_kv_cache(spec: &str) -> Result<KvPrecision, String> {
    let quantized = |bits| KvPrecision::Quantized(KvQuant { bits, group: 64 });
    match spec {
        "q8" => Ok(quantized(8)),
        "q4" => Ok(quantized(4)),
        _ => crate::kv_cache::parse_kv_cache(spec),
    }
}
