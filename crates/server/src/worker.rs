//! The generation thread. Model forward passes are long, CPU-bound and blocking, so they run on
//! one dedicated thread, never on the async executor: HTTP keeps answering (health checks,
//! model lists, queueing) while a generation runs. Requests are served one at a time, in the
//! order they arrive. The thread owns the prompt cache, keyed by the adapter a job runs with.

use std::ops::ControlFlow;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;

use oxlm_models::lora::{AdaptedModel, AdapterError};
use oxlm_models::LanguageModel;
use oxlm_runtime::adapter_store::{Adapter, AdapterId};
use oxlm_runtime::generate::prefill;
use oxlm_runtime::prompt_cache::{is_truncatable, PromptCache};
use oxlm_runtime::{
    generate_stream, Event, FinishReason, GenerateOptions, LoadedModel, RuntimeError, StreamOptions,
};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

use crate::error::ApiError;

/// What the generation thread reports about one job, in order: `Started`, progress, tokens,
/// then `Done`.
#[derive(Debug)]
pub enum Update {
    Started {
        /// Prompt tokens whose state came from the prompt cache.
        cached_tokens: usize,
    },
    Prefill {
        done: usize,
        total: usize,
    },
    Token {
        id: u32,
        logprob: f32,
        top: Vec<(u32, f32)>,
        /// Output made final by this token.
        text: String,
    },
    /// Output released after the last token.
    Text(String),
    Done(Result<FinishReason, JobError>),
}

#[derive(Debug, thiserror::Error)]
pub enum JobError {
    #[error(transparent)]
    Runtime(#[from] RuntimeError),
    #[error(transparent)]
    Adapter(#[from] AdapterError),
    #[error("generation panicked: {0}")]
    Panic(String),
    #[error("The server is shutting down")]
    ShuttingDown,
}

/// The prompt cache: model state by the adapter that computed it (`None`: the base model).
type StateCache = PromptCache<Option<AdapterId>>;

struct Job {
    prompt: Vec<u32>,
    adapter: Option<Arc<Adapter>>,
    options: GenerateOptions,
    stream: StreamOptions,
    updates: UnboundedSender<Update>,
    cancel: Arc<AtomicBool>,
    shutdown: Arc<AtomicBool>,
}

impl Job {
    fn cancelled(&self) -> bool {
        self.cancel.load(Ordering::Relaxed)
            || self.shutdown.load(Ordering::Relaxed)
            || self.updates.is_closed()
    }

    /// Sends an update; false once the requester is gone or the server is shutting down.
    fn send(&self, update: Update) -> bool {
        self.updates.send(update).is_ok() && !self.cancelled()
    }
}

/// A job in progress, seen from the request: its updates, and cancellation when dropped
/// (the client disconnected and the response future or stream was dropped).
pub struct Running {
    pub updates: UnboundedReceiver<Update>,
    cancel: Arc<AtomicBool>,
}

impl Drop for Running {
    fn drop(&mut self) {
        self.cancel.store(true, Ordering::Relaxed);
    }
}

/// Handle to the generation thread.
pub struct Worker {
    jobs: mpsc::Sender<Job>,
    thread: JoinHandle<()>,
    /// Set when the server shuts down: every job, running or queued, ends with an error.
    shutdown: Arc<AtomicBool>,
}

/// Prompt cache limits.
#[derive(Debug, Clone, Copy)]
pub struct CacheLimits {
    pub entries: usize,
    pub bytes: usize,
}

impl Worker {
    pub fn spawn(model: Arc<LoadedModel>, limits: CacheLimits) -> std::io::Result<Self> {
        let (jobs, queue) = mpsc::channel::<Job>();
        let thread = std::thread::Builder::new()
            .name("oxlm-generate".into())
            .spawn(move || {
                let mut cache = StateCache::new(limits.entries, limits.bytes);
                for job in queue {
                    let result = if job.cancelled() {
                        Ok(FinishReason::Cancelled)
                    } else {
                        // Requests are validated before they get here; this keeps one that
                        // still trips a bug from taking the thread (and the server) down.
                        catch_unwind(AssertUnwindSafe(|| run(&model, &mut cache, &job)))
                            .unwrap_or_else(|panic| Err(JobError::Panic(panic_message(&*panic))))
                    };
                    let result = match result {
                        Ok(FinishReason::Cancelled) if job.shutdown.load(Ordering::Relaxed) => {
                            Err(JobError::ShuttingDown)
                        }
                        result => result,
                    };
                    // Past `cancelled`, as the requester may still be there to read why.
                    let _ = job.updates.send(Update::Done(result));
                }
            })?;
        Ok(Worker {
            jobs,
            thread,
            shutdown: Arc::new(AtomicBool::new(false)),
        })
    }

    /// Ends every job, running or queued, with [`JobError::ShuttingDown`], and refuses new ones.
    pub fn shut_down(&self) {
        self.shutdown.store(true, Ordering::Relaxed);
    }

    /// Whether the thread still takes jobs.
    pub fn is_alive(&self) -> bool {
        !self.thread.is_finished()
    }

    /// Queues a generation of `prompt`, through `adapter` when given.
    pub fn submit(
        &self,
        prompt: Vec<u32>,
        adapter: Option<Arc<Adapter>>,
        options: GenerateOptions,
        stream: StreamOptions,
    ) -> Result<Running, ApiError> {
        if self.shutdown.load(Ordering::Relaxed) {
            return Err(JobError::ShuttingDown.into());
        }
        let (updates, receiver) = unbounded_channel();
        let cancel = Arc::new(AtomicBool::new(false));
        let job = Job {
            prompt,
            adapter,
            options,
            stream,
            updates,
            cancel: cancel.clone(),
            shutdown: self.shutdown.clone(),
        };
        self.jobs
            .send(job)
            .map_err(|_| ApiError::unavailable("the generation thread has stopped"))?;
        Ok(Running {
            updates: receiver,
            cancel,
        })
    }
}

fn run(
    loaded: &LoadedModel,
    prompt_cache: &mut StateCache,
    job: &Job,
) -> Result<FinishReason, JobError> {
    let adapted = job
        .adapter
        .as_ref()
        .map(|adapter| AdaptedModel::new(loaded.model.as_ref(), &adapter.adapters))
        .transpose()?;
    let model: &dyn LanguageModel = match &adapted {
        Some(adapted) => adapted,
        None => loaded.model.as_ref(),
    };
    let key = job.adapter.as_ref().map(|adapter| adapter.id.clone());
    let prompt = &job.prompt;
    let (mut cache, cached_tokens) = match prompt_cache.fetch(&key, prompt) {
        Some(hit) => (hit.cache, hit.tokens),
        None => (job.options.new_cache(model)?, 0),
    };
    if !job.send(Update::Started { cached_tokens }) {
        return Ok(FinishReason::Cancelled);
    }
    // Recurrent and sliding-window state cannot be cut back later, so keep a snapshot of the
    // prompt without its last token: the next turn of a chat, or a retry, resumes from it.
    let snapshot_at = prompt.len() - 1;
    if !is_truncatable(&cache) && cached_tokens < snapshot_at {
        let total = prompt.len() - cached_tokens;
        for chunk in prompt[cached_tokens..snapshot_at].chunks(job.options.prefill_step.max(1)) {
            prefill(model, chunk, &mut cache, job.options.prefill_step)
                .map_err(RuntimeError::from)?;
            let done = cache.offset - cached_tokens;
            if !job.send(Update::Prefill { done, total }) {
                prompt_cache.insert(key, prompt[..cache.offset].to_vec(), cache);
                return Ok(FinishReason::Cancelled);
            }
        }
        // A snapshot that does not fit in device memory is only a later cache miss.
        if let Ok(snapshot) = cache.try_clone() {
            prompt_cache.insert(key.clone(), prompt[..snapshot_at].to_vec(), snapshot);
        }
    }
    // Progress counts every uncached prompt token, the snapshot's included.
    let (prefilled, to_prefill) = (cache.offset - cached_tokens, prompt.len() - cached_tokens);
    let generation = generate_stream(
        model,
        &loaded.tokenizer,
        prompt,
        &mut cache,
        &loaded.eos_ids,
        &job.options,
        &job.stream,
        &mut |event| {
            let update = match event {
                Event::Prefill { done, .. } => Update::Prefill {
                    done: prefilled + done,
                    total: to_prefill,
                },
                Event::Token {
                    id,
                    logprob,
                    top,
                    text,
                } => Update::Token {
                    id,
                    logprob,
                    top: top.to_vec(),
                    text: text.to_owned(),
                },
                Event::Text(text) => Update::Text(text.to_owned()),
            };
            if job.send(update) {
                ControlFlow::Continue(())
            } else {
                ControlFlow::Break(())
            }
        },
    )?;
    // What the cache holds: the prompt, then the generated tokens that went through the model.
    let tokens: Vec<u32> = prompt
        .iter()
        .chain(&generation.tokens)
        .take(cache.offset)
        .copied()
        .collect();
    if tokens.len() == cache.offset {
        prompt_cache.insert(key, tokens, cache);
    }
    Ok(generation.finish_reason)
}

fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".into())
}
