//! Memory: what a model's weights and each sequence's cache take, what the device has, and the
//! budget a server admits requests by (see [`crate::batcher::BatcherSettings::memory_budget`]).
//! The cache's growth is exact ([`CacheFootprint`]); a prompt chunk's activations are bounded
//! by an estimate, reserved once since one chunk goes through at a time.

use std::path::Path;

use oxlm_engine::Device;
use oxlm_models::cache::CacheFootprint;
use oxlm_models::{Cache, ForwardError, LanguageModel, ModelInfo};

use crate::{GenerateOptions, RuntimeError};

/// Of what the device has free after loading, the share a default budget takes: the rest is
/// left for what is not counted (the tokenizer, the allocator's slack, other processes).
const DEFAULT_SHARE: f64 = 0.9;

/// f32 rows of the model's width that one prompt token's activations take at most, across a
/// layer's norms, projections and its MLP's expansion (about 3-4 widths each for gate, up and
/// their product), and the quantized copies of the inputs: a bound that held with room to spare
/// on every architecture measured.
const ACTIVATION_ROWS_PER_TOKEN: usize = 16;

/// What one model's sequences need, as they grow.
#[derive(Debug, Clone)]
pub struct MemoryPlan {
    /// How each cache layer grows (in the precision the server keeps caches in).
    pub footprint: CacheFootprint,
    /// Where caches are quantized once their first chunk has gone through: how they grow
    /// until then, unquantized.
    pub first_chunk: Option<CacheFootprint>,
    /// Prompt tokens that go through the model at once at most (the prefill step).
    pub chunk: usize,
    pub max_context: Option<usize>,
    /// Bytes of a prompt chunk's activations at most (see [`prefill_reserve`]).
    pub prefill_reserve: usize,
}

impl MemoryPlan {
    /// The plan for `model`'s caches as `options` makes them. Makes one empty cache (on the
    /// model's device: call it where the model's device may be used).
    pub fn new(model: &dyn LanguageModel, options: &GenerateOptions) -> Result<Self, RuntimeError> {
        let info = model.info();
        let cache = options.new_cache(model)?;
        let first_chunk = match &options.kv_quantization {
            Some(quantization) if quantization.start == 0 => Some(cache.footprint()),
            _ => None,
        };
        Ok(MemoryPlan {
            footprint: quantized_from_the_start(cache, options)?.footprint(),
            first_chunk,
            chunk: options.prefill_step.max(1),
            max_context: info.max_context,
            prefill_reserve: prefill_reserve(info, options.prefill_step),
        })
    }

    /// The most bytes the cache of a sequence of `prompt` tokens and up to `max_tokens` more
    /// holds (never past the model's context).
    pub fn sequence_bytes(&self, prompt: usize, max_tokens: usize) -> usize {
        let tokens = prompt.saturating_add(max_tokens);
        let tokens = self.max_context.map_or(tokens, |limit| tokens.min(limit));
        self.cache_bytes(&self.footprint, self.first_chunk.as_ref(), tokens)
    }

    /// The most bytes a cache growing as `footprint` holds by `tokens` tokens, or (quantized
    /// after its first chunk) as `first_chunk` holds that chunk, whichever is more.
    pub fn cache_bytes(
        &self,
        footprint: &CacheFootprint,
        first_chunk: Option<&CacheFootprint>,
        tokens: usize,
    ) -> usize {
        let unquantized = first_chunk.map_or(0, |f| f.bytes_at(tokens.min(self.chunk), self.chunk));
        footprint.bytes_at(tokens, self.chunk).max(unquantized)
    }
}

/// `cache` as a sequence is charged for it: in its codes where `options` quantize it once its
/// first chunk has gone through (a server's `--kv-bits`; the first chunk is charged unquantized
/// too, see [`MemoryPlan::first_chunk`]), otherwise as it is made (a quantization from a later
/// token leaves the sequence the larger cache until then).
fn quantized_from_the_start(
    cache: Cache,
    options: &GenerateOptions,
) -> Result<Cache, RuntimeError> {
    Ok(match &options.kv_quantization {
        Some(quantization) if quantization.start == 0 => cache
            .with_quantization(quantization)
            .map_err(ForwardError::from)?,
        _ => cache,
    })
}

/// Bytes that a prompt chunk of `chunk` tokens takes while it goes through `info`'s model, at
/// most ([`ACTIVATION_ROWS_PER_TOKEN`] f32 rows of its width a token).
pub fn prefill_reserve(info: &ModelInfo, chunk: usize) -> usize {
    chunk.max(1) * info.hidden_size * ACTIVATION_ROWS_PER_TOKEN * 4
}

/// Bytes of the checkpoint's weights as stored (its safetensors files), which the model holds
/// once loaded, on the host or on a GPU.
pub fn weights_bytes(dir: &Path) -> std::io::Result<usize> {
    let mut total = 0;
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if path.extension().is_some_and(|e| e == "safetensors") {
            total += std::fs::metadata(&path)?.len() as usize;
        }
    }
    Ok(total)
}

/// How a server's memory is divided: what its caches may take together, and what it was
/// worked out from (for the log and for a refusal's message).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheBudget {
    /// Bytes the running sequences' caches may take together.
    pub caches: usize,
    /// The whole budget: `--memory-budget`, or the default worked out from the device.
    pub total: usize,
    pub weights: usize,
    /// Set aside for a prompt chunk's activations.
    pub reserved: usize,
}

#[derive(Debug, thiserror::Error)]
pub enum BudgetError {
    #[error(
        "--memory-budget {total} bytes leaves nothing for caches: the weights take {weights} bytes \
         and {reserved} more are set aside for a prompt chunk's activations"
    )]
    TooSmall {
        total: usize,
        weights: usize,
        reserved: usize,
    },
    #[error("cannot tell how much memory the device has: {0}")]
    Device(#[from] oxlm_engine::EngineError),
}

impl CacheBudget {
    /// The caches' share of `total` bytes (`None`: the weights, loaded, and what is free on
    /// `device`, less a margin), once `weights` and `reserved` bytes are set aside. Refuses a
    /// budget that leaves nothing for caches.
    pub fn new(
        total: Option<usize>,
        device: &Device,
        weights: usize,
        reserved: usize,
    ) -> Result<Self, BudgetError> {
        let total = match total {
            Some(total) => total,
            // Loaded weights are no longer free: the default counts them back in.
            None => weights + (device.available_memory()? as f64 * DEFAULT_SHARE) as usize,
        };
        let caches = total.saturating_sub(weights + reserved);
        if caches == 0 {
            return Err(BudgetError::TooSmall {
                total,
                weights,
                reserved,
            });
        }
        Ok(CacheBudget {
            caches,
            total,
            weights,
            reserved,
        })
    }
}

/// Bytes of this process's memory resident now (`VmRSS`); `None` where /proc cannot tell.
pub fn resident_bytes() -> Option<usize> {
    proc_status_kib("VmRSS:").map(|kib| kib * 1024)
}

/// The most bytes this process has had resident (`VmHWM`): the peak memory mlx-lm reports.
pub fn peak_resident_bytes() -> Option<usize> {
    proc_status_kib("VmHWM:").map(|kib| kib * 1024)
}

/// Starts [`peak_resident_bytes`] over from what is resident now (Linux's `clear_refs` 5);
/// false where the kernel does not allow it.
pub fn reset_peak_resident() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

fn proc_status_kib(field: &str) -> Option<usize> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with(field))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

/// Memory the device holds for this process, as a measure around a piece of work: resident
/// bytes on the host, bytes taken from the GPU's free memory on a GPU.
#[derive(Debug, Clone)]
pub struct Meter {
    device: Device,
    /// The GPU's free bytes when the meter started.
    gpu_free: usize,
}

impl Meter {
    pub fn start(device: &Device) -> Result<Self, oxlm_engine::EngineError> {
        let gpu_free = match device {
            Device::Cpu => 0,
            Device::Cuda(_) => device.available_memory()?,
        };
        Ok(Meter {
            device: device.clone(),
            gpu_free,
        })
    }

    /// Bytes held now: resident on the host; taken since the start on a GPU.
    pub fn used(&self) -> Result<usize, oxlm_engine::EngineError> {
        match &self.device {
            Device::Cpu => Ok(resident_bytes().unwrap_or(0)),
            Device::Cuda(_) => {
                self.device.synchronize()?;
                Ok(self
                    .gpu_free
                    .saturating_sub(self.device.available_memory()?))
            }
        }
    }

    /// The most bytes held since [`reset_peak`](Self::reset_peak) on the host; on a GPU, what
    /// is held now (a pool keeps what a pass took until it is asked back).
    pub fn peak(&self) -> Result<usize, oxlm_engine::EngineError> {
        match &self.device {
            Device::Cpu => Ok(peak_resident_bytes().unwrap_or(0)),
            Device::Cuda(_) => self.used(),
        }
    }

    pub fn reset_peak(&self) {
        if self.device.is_cpu() {
            reset_peak_resident();
        }
    }
}

/// Bytes a second the device's memory streams, measured: on the host, every thread summing its
/// share of a buffer larger than any cache; on a GPU, a device-to-device copy (which reads and
/// writes each byte). The best of a few passes.
pub fn measure_bandwidth(device: &Device) -> Result<f64, oxlm_engine::EngineError> {
    const BYTES: usize = 512 << 20;
    const PASSES: usize = 4;
    let mut best = f64::MAX;
    match device {
        Device::Cpu => {
            let words: Vec<u64> = (0..BYTES / 8).map(|i| i as u64).collect();
            let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
            let share = words.len().div_ceil(threads);
            for _ in 0..PASSES {
                let start = std::time::Instant::now();
                let sum: u64 = std::thread::scope(|scope| {
                    let parts: Vec<_> = words
                        .chunks(share)
                        .map(|part| scope.spawn(move || part.iter().fold(0u64, |a, &w| a ^ w)))
                        .collect();
                    parts.into_iter().map(|p| p.join().unwrap_or(0)).sum()
                });
                std::hint::black_box(sum);
                best = best.min(start.elapsed().as_secs_f64());
            }
            Ok(BYTES as f64 / best)
        }
        Device::Cuda(_) => {
            let buffer = oxlm_engine::Tensor::zeros(vec![BYTES / 4], device)?;
            for _ in 0..PASSES {
                device.synchronize()?;
                let start = std::time::Instant::now();
                let copy = buffer.try_clone()?;
                device.synchronize()?;
                best = best.min(start.elapsed().as_secs_f64());
                drop(copy);
            }
            Ok(2.0 * BYTES as f64 / best)
        }
    }
}
