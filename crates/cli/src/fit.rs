//! `oxlm fit`: what a model needs on a device and what fits there. It loads the model and runs
//! one prompt chunk through it, measuring what does not grow with the context (the loaded
//! weights and buffers, a chunk's activations), then predicts what does from the cache's layers:
//! the peak memory at a context, the largest context, the sequences that fit at once, and the
//! decode speed the measured memory bandwidth allows.

use std::path::PathBuf;

use anyhow::{Context, Result};
use oxlm_models::cache::{CacheFootprint, LayerFootprint};
use oxlm_models::Logits;
use oxlm_runtime::generate::DEFAULT_PREFILL_STEP;
use oxlm_runtime::hub::resolve_model;
use oxlm_runtime::memory::{measure_bandwidth, weights_bytes, MemoryPlan, Meter};
use oxlm_runtime::{GenerateOptions, LoadedModel};
use serde_json::json;

#[derive(clap::Args)]
pub struct Args {
    /// The MLX model: a local directory, or a Hugging Face repo id.
    #[arg(long)]
    model: PathBuf,
    /// The context (prompt and generated tokens) to predict for.
    #[arg(long, default_value_t = 4096)]
    ctx: usize,
    /// Where the model would run: cpu, cuda (GPU 0) or cuda:N.
    #[arg(long, default_value = "cpu", value_parser = crate::parse_device)]
    device: oxlm_engine::Device,
    #[command(flatten)]
    kv: crate::kv_cache::KvCacheArgs,
    /// Prompt tokens that go through the model at once (as `generate` and `serve` take it).
    #[arg(long, default_value_t = DEFAULT_PREFILL_STEP)]
    prefill_step_size: usize,
    /// Print the figures as one JSON object.
    #[arg(long)]
    json: bool,
}

const MB: f64 = 1e6;

pub fn run(args: Args) -> Result<()> {
    let device = &args.device;
    let meter = Meter::start(device)?;
    let before = meter.used()?;
    let dir = resolve_model(&args.model)?;
    let loaded = LoadedModel::load_on(&dir, device)
        .with_context(|| format!("loading {}", args.model.display()))?;
    let model = loaded.model.as_ref();
    let info = model.info();
    let loaded_bytes = meter.used()?.saturating_sub(before);
    // Loading may pass through more than it keeps (a tensor read whole, then converted).
    let load_peak = meter.peak()?;
    let options = GenerateOptions {
        max_tokens: 0,
        sampler: Default::default(),
        prefill_step: args.prefill_step_size.max(1),
        kv_cache: args.kv.kv_cache,
        kv_quantization: args.kv.quantization(&dir, info.num_layers, 0)?,
        max_kv_size: None,
    };
    let plan = MemoryPlan::new(model, &options)?;

    // One chunk of the prompt, as long as a prompt of the context would send.
    let chunk_tokens = plan
        .chunk
        .min(args.ctx)
        .min(info.max_context.unwrap_or(usize::MAX));
    let tokens: Vec<u32> = (0..chunk_tokens)
        .map(|i| (i * 7919 % info.vocab_size) as u32)
        .collect();
    let mut cache = options.new_cache(model)?;
    meter.reset_peak();
    let at_rest = meter.used()?;
    model.forward(&tokens, &mut cache, Logits::Last)?;
    let chunk_peak = meter.peak()?;
    let activations = chunk_peak.saturating_sub(at_rest + cache.size_in_bytes());
    drop(cache);

    let bandwidth = measure_bandwidth(device)?;
    let free = device.available_memory()?;
    let weights = weights_bytes(&dir)?;
    let ctx = info
        .max_context
        .map_or(args.ctx, |limit| args.ctx.min(limit));
    let first_chunk = plan.first_chunk.as_ref();
    let cache_at_ctx = plan.cache_bytes(&plan.footprint, first_chunk, ctx);
    // The process's peak for one sequence of the context, as `generate` reports it.
    // The host commits a cache's zeroed pages as positions are written, a GPU all it reserves.
    let cache_resident = if device.is_cpu() {
        let first_chunk = first_chunk.map(written);
        plan.cache_bytes(&written(&plan.footprint), first_chunk.as_ref(), ctx)
    } else {
        cache_at_ctx
    };
    let peak = load_peak.max(before + loaded_bytes + cache_resident + activations);
    let room = free.saturating_sub(activations);
    let longest = plan.footprint.max_tokens_within(room, plan.chunk);
    let longest = info.max_context.map_or(longest, |limit| longest.min(limit));
    let sequences = room.checked_div(cache_at_ctx).unwrap_or(usize::MAX);
    // Each decoded token reads every weight and the positions cached so far.
    let read_per_token = weights + plan.footprint.bytes_at(ctx, 1);
    let tokens_per_second = bandwidth / read_per_token as f64;

    let layers = layer_kinds(&plan.footprint.layers);
    if args.json {
        let report = json!({
            "model": args.model.display().to_string(),
            "model_type": info.model_type,
            "device": if device.is_cpu() { "cpu" } else { "cuda" },
            "weights_bytes": weights,
            "loaded_bytes": loaded_bytes,
            "load_peak_bytes": load_peak,
            "layers": layers.iter().map(|k| json!({
                "kind": k.kind, "count": k.count, "bytes_per_token": k.per_token,
                "window": k.window, "fixed_bytes": k.fixed,
            })).collect::<Vec<_>>(),
            "prefill_chunk_tokens": chunk_tokens,
            "prefill_activation_bytes": activations,
            "ctx": ctx,
            "cache_bytes_at_ctx": cache_at_ctx,
            "predicted_peak_bytes": peak,
            "free_bytes": free,
            "max_context": longest,
            "sequences_at_ctx": sequences,
            "bandwidth_bytes_per_second": bandwidth,
            "predicted_decode_tokens_per_second": tokens_per_second,
        });
        say!("{report}");
        return Ok(());
    }
    let where_ = if device.is_cpu() {
        "host RAM"
    } else {
        "GPU memory"
    };
    say!(
        "{} ({}, {} layers) on {}",
        args.model.display(),
        info.model_type,
        info.num_layers,
        if device.is_cpu() {
            "the CPU"
        } else {
            "the GPU"
        }
    );
    say!(
        "Weights: {:.1} MB as stored; loaded, with the tokenizer and buffers: {:.1} MB",
        weights as f64 / MB,
        loaded_bytes as f64 / MB
    );
    if load_peak > before + loaded_bytes {
        say!(
            "Loading passes through a peak of {:.1} MB (the process's)",
            load_peak as f64 / MB
        );
    }
    say!("Cache of one sequence:");
    for k in &layers {
        match (k.kind, k.window) {
            ("recurrent", _) => say!(
                "  {} recurrent layer(s): {} bytes, at any length",
                k.count,
                k.fixed
            ),
            ("chunked_attention", Some(window)) => say!(
                "  {} chunked-attention layer(s): {} bytes a token, up to {window} tokens (a chunk)",
                k.count,
                k.per_token
            ),
            (_, Some(window)) => say!(
                "  {} sliding-window layer(s): {} bytes a token, up to {window} tokens",
                k.count,
                k.per_token
            ),
            _ => say!(
                "  {} full-attention layer(s): {} bytes a token",
                k.count,
                k.per_token
            ),
        }
    }
    say!(
        "A prompt chunk of {chunk_tokens} tokens: {:.1} MB of activations (measured)",
        activations as f64 / MB
    );
    say!("Free {where_}: {:.1} MB", free as f64 / MB);
    say!(
        "At a context of {ctx}: {:.1} MB of cache, a peak of {:.1} MB for one sequence; {} \
         sequences of it fit at once",
        cache_at_ctx as f64 / MB,
        peak as f64 / MB,
        if sequences == usize::MAX {
            "any number of".to_string()
        } else {
            sequences.to_string()
        }
    );
    match longest {
        usize::MAX => say!("Largest context: any (the cache stops growing)"),
        n if Some(n) == info.max_context => say!("Largest context: {n} (the model's limit)"),
        n => say!("Largest context: {n} tokens"),
    }
    say!(
        "Memory bandwidth: {:.1} GB/s (measured); decode at {ctx}: about {:.1} tokens/s",
        bandwidth / 1e9,
        tokens_per_second
    );
    Ok(())
}

/// The cache as far as positions are written: each layer grown one position at a time.
fn written(footprint: &CacheFootprint) -> CacheFootprint {
    let layers = footprint.layers.iter().map(|layer| match *layer {
        LayerFootprint::Full { slot, .. } => LayerFootprint::Full { slot, step: 1 },
        LayerFootprint::Window {
            slot,
            window,
            chunked,
            ..
        } => LayerFootprint::Window {
            slot,
            window,
            step: 1,
            chunked,
        },
        fixed => fixed,
    });
    CacheFootprint {
        layers: layers.collect(),
    }
}

/// Layers of one kind, summed.
struct LayerKind {
    kind: &'static str,
    count: usize,
    per_token: usize,
    window: Option<usize>,
    fixed: usize,
}

fn layer_kinds(layers: &[LayerFootprint]) -> Vec<LayerKind> {
    let mut kinds: Vec<LayerKind> = Vec::new();
    for layer in layers {
        let (kind, per_token, window, fixed) = match *layer {
            LayerFootprint::Full { slot, .. } => ("full_attention", slot, None, 0),
            LayerFootprint::Window {
                slot,
                window,
                chunked,
                ..
            } => match chunked {
                true => ("chunked_attention", slot, Some(window), 0),
                false => ("sliding_window", slot, Some(window), 0),
            },
            LayerFootprint::Fixed { bytes } => ("recurrent", 0, None, bytes),
        };
        match kinds
            .iter_mut()
            .find(|k| k.kind == kind && k.window == window)
        {
            Some(k) => {
                k.count += 1;
                k.per_token += per_token;
                k.fixed += fixed;
            }
            None => kinds.push(LayerKind {
                kind,
                count: 1,
                per_token,
                window,
                fixed,
            }),
        }
    }
    kinds
}
