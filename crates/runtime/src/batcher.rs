//! The continuous batcher: it serves generation jobs in arrival order, decoding their sequences
//! together, as mlx_lm.server's batch generator does. Each step runs every sequence's next
//! token through one forward pass (`forward_batch`), which reads each weight once for all of
//! them, up to a capacity; each sequence's adapters (none, one, or a stack) adapt its own row.
//! Between steps, prompts go through the model alone, at most one prefill step's worth of
//! tokens, those with the fewest tokens left first: many short ones at once, a long one a chunk
//! at a time while the others go on decoding; each streams its first token as soon as its
//! prompt is through. Adapters of a mixture's experts regroup a layer's rows by expert, so a
//! job whose adapters do that, or that meets a batch whose adapters do, waits until the batch
//! has drained, and the batch takes no more jobs meanwhile, so that it is served in its turn.
//!
//! The batcher owns the prompt cache, keyed by the adapters a job runs with, and the GPU's
//! recordings of a decoding step for each batch size. It runs on the caller's thread and
//! blocks there ([`Batcher::run`]); a server gives it a thread of its own and a channel, and
//! reads what it is doing from [`BatcherStats`].

use std::collections::{HashMap, HashSet, VecDeque};
use std::ops::ControlFlow;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use oxlm_engine::cpu::pool;
use oxlm_engine::DecodeSteps;
use oxlm_models::lora::{AdaptedModel, AdapterError, Adapters, RowAdapters};
use oxlm_models::{Cache, ForwardError, LanguageModel, Logits, ModelInfo};

use crate::adapter_store::{Adapter, AdapterId};
use crate::constraint::{AllowedTokens, TokenConstraint};
use crate::generate::{decode_step, NextToken, Picking, Sequence, Stepped};
use crate::prompt_cache::{is_truncatable, PromptCache};
use crate::tokenizer::Tokenizer;
use crate::{Event, FinishReason, GenerateOptions, Generation, RuntimeError, StreamOptions};

/// What the batcher reports about one job, in order: `Started`, progress, tokens, then `Done`.
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
        /// Output made final by this token (empty for a batcher without a tokenizer).
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
    /// A decoding step that several jobs shared failed.
    #[error("{0}")]
    Step(String),
    #[error("The server is shutting down")]
    ShuttingDown,
    /// The job ran past its [`Job::deadline`].
    #[error("The request did not finish within the server's time limit")]
    DeadlineExceeded,
    /// The job's cache would need more than the whole memory budget (see [`Job::memory`]).
    #[error(
        "This request needs {needed} bytes of cache memory (its prompt and max_tokens) but the \
         server's memory budget for caches is {budget} bytes"
    )]
    Memory { needed: usize, budget: usize },
}

/// Who waits for a job's updates.
pub trait Requester: Send {
    /// Hands over `update`; false once the requester is gone.
    fn deliver(&self, update: Update) -> bool;

    /// Whether the requester has given the job up (looked at between steps).
    fn cancelled(&self) -> bool;
}

/// One generation to serve.
pub struct Job {
    pub prompt: Vec<u32>,
    /// Through these adapters (their updates added in this order); none: the base model.
    pub adapters: Vec<Arc<Adapter>>,
    pub options: GenerateOptions,
    pub stream: StreamOptions,
    pub requester: Box<dyn Requester>,
    /// Past it, the job ends with [`JobError::DeadlineExceeded`], between two steps or before
    /// its prompt goes through the model.
    pub deadline: Option<Instant>,
    /// Bytes its cache may grow to (its prompt and `max_tokens`: see
    /// [`MemoryPlan`](crate::memory::MemoryPlan)), charged against
    /// [`BatcherSettings::memory_budget`] while it runs.
    pub memory: usize,
}

/// Work on the model other than generation (an embedding), run on the batcher's thread between
/// two steps: a GPU's stream and its step recordings are that thread's alone.
pub type Task = Box<dyn FnOnce(&dyn LanguageModel) + Send>;

/// What the batcher's queue carries.
pub enum Work {
    /// Boxed: a job is over a kilobyte, a task a pointer.
    Generate(Box<Job>),
    Run(Task),
}

impl Job {
    /// Its adapters, as the prompt cache keys model state.
    fn key(&self) -> Vec<AdapterId> {
        self.adapters.iter().map(|a| a.id.clone()).collect()
    }

    /// Its adapters' sets, in the order their updates add up.
    fn stack(&self) -> Vec<&Adapters> {
        self.adapters.iter().map(|a| &a.adapters).collect()
    }

    /// Whether its sequence and `other`'s can decode in one step: through the same adapters,
    /// or through adapters none of which adapts a mixture's experts (see
    /// [`RowAdapters::by_row`]).
    fn shares_steps_with(&self, other: &Job) -> bool {
        let plain = |job: &Job| job.adapters.iter().all(|a| a.adapters.experts.is_empty());
        (plain(self) && plain(other)) || self.key() == other.key()
    }
}

impl From<Job> for Work {
    fn from(job: Job) -> Self {
        Work::Generate(Box::new(job))
    }
}

/// How the batcher serves.
#[derive(Debug, Clone)]
pub struct BatcherSettings {
    /// Sequences that decode together at most.
    pub capacity: usize,
    /// Prompt cache limits.
    pub cache_entries: usize,
    pub cache_bytes: usize,
    /// Set to end every job, running or queued, with [`JobError::ShuttingDown`].
    pub shutdown: Arc<AtomicBool>,
    /// Where the batcher tells what it is doing.
    pub stats: Arc<BatcherStats>,
    /// The longest the prompts going through between two steps should hold up the jobs
    /// decoding and those arriving: fewer prompt tokens than a prefill step go through where
    /// the model's measured prompt speed says a step would take longer. `None`: a whole step.
    pub prefill_pause: Option<Duration>,
    /// Bytes the running jobs' caches may take together ([`Job::memory`] each): a job that
    /// would take the running ones past it waits until enough of them have ended, and one that
    /// needs more than all of it ends with [`JobError::Memory`]. So no running job fails for
    /// memory. `None`: no limit.
    pub memory_budget: Option<usize>,
}

impl BatcherSettings {
    /// Puts the limits a batcher of these settings works within into [`stats`](Self::stats):
    /// done by [`Batcher::new`], and before it by whoever starts its thread, so that the
    /// figures are there from the first request for them.
    pub fn publish_limits(&self, info: &ModelInfo) {
        let context = info.max_context.unwrap_or(0);
        let tokens = self.capacity.max(1).saturating_mul(context);
        self.stats
            .kv_capacity_tokens
            .store(tokens, Ordering::Relaxed);
        (self.stats.memory_budget).store(self.memory_budget.unwrap_or(0), Ordering::Relaxed);
    }
}

/// What a batcher is doing, for whoever reports on it (a server's metrics): written by the
/// batcher between steps, read at any time through [`snapshot`](Self::snapshot).
#[derive(Debug, Default)]
pub struct BatcherStats {
    running: AtomicUsize,
    waiting: AtomicUsize,
    kv_tokens: AtomicUsize,
    kv_capacity_tokens: AtomicUsize,
    prompt_cache_entries: AtomicUsize,
    prompt_cache_bytes: AtomicUsize,
    prefix_cache_queries: AtomicU64,
    prefix_cache_hits: AtomicU64,
    memory_charged: AtomicUsize,
    memory_budget: AtomicUsize,
}

/// [`BatcherStats`] at one moment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BatcherSnapshot {
    /// Jobs in the batch: their prompts going through the model, or decoding.
    pub running: usize,
    /// Jobs taken from the queue and not yet in the batch: behind a full batch, or behind a
    /// batch whose adapters cannot share its steps.
    pub waiting: usize,
    /// Context tokens that the running jobs' caches hold.
    pub kv_tokens: usize,
    /// Context tokens the batch can hold: its capacity times the model's context length (0 for
    /// a model that states no context length).
    pub kv_capacity_tokens: usize,
    pub prompt_cache_entries: usize,
    /// Bytes of model state the prompt cache holds.
    pub prompt_cache_bytes: usize,
    /// Prompt tokens looked up in the prompt cache, and how many of them it held: in tokens, as
    /// vLLM counts its prefix cache's queries and hits.
    pub prefix_cache_queries: u64,
    pub prefix_cache_hits: u64,
    /// Bytes of the memory budget that the running jobs hold ([`Job::memory`] each).
    pub memory_charged: usize,
    /// [`BatcherSettings::memory_budget`] (0: none).
    pub memory_budget: usize,
}

impl BatcherStats {
    pub fn snapshot(&self) -> BatcherSnapshot {
        let load = |n: &AtomicUsize| n.load(Ordering::Relaxed);
        BatcherSnapshot {
            running: load(&self.running),
            waiting: load(&self.waiting),
            kv_tokens: load(&self.kv_tokens),
            kv_capacity_tokens: load(&self.kv_capacity_tokens),
            prompt_cache_entries: load(&self.prompt_cache_entries),
            prompt_cache_bytes: load(&self.prompt_cache_bytes),
            prefix_cache_queries: self.prefix_cache_queries.load(Ordering::Relaxed),
            prefix_cache_hits: self.prefix_cache_hits.load(Ordering::Relaxed),
            memory_charged: load(&self.memory_charged),
            memory_budget: load(&self.memory_budget),
        }
    }

    /// A prompt of `queried` tokens looked up in the prompt cache, `hits` of them found there.
    fn count_lookup(&self, queried: usize, hits: usize) {
        let add = |n: &AtomicU64, value: usize| n.fetch_add(value as u64, Ordering::Relaxed);
        add(&self.prefix_cache_queries, queried);
        add(&self.prefix_cache_hits, hits);
    }
}

impl BatcherSnapshot {
    /// The share of the batch's context in use: `kv_tokens` over `kv_capacity_tokens`, from 0
    /// to 1 (0 when the capacity is unknown).
    pub fn kv_usage(&self) -> f64 {
        if self.kv_capacity_tokens == 0 {
            return 0.0;
        }
        self.kv_tokens as f64 / self.kv_capacity_tokens as f64
    }
}

/// Prompt tokens between two steps before the prompt speed is known, and at the least: a
/// chunk small enough for a CPU, large enough that its speed is not all per-pass overhead.
const FIRST_PREFILL_BUDGET: usize = 256;
const MIN_PREFILL_BUDGET: usize = 16;

/// The prompt cache: model state by the adapters that computed it (none: the base model).
type StateCache = PromptCache<Vec<AdapterId>>;

/// A job as the batcher holds it: the job, and the flag that ends it at shutdown.
struct Held {
    job: Job,
    shutdown: Arc<AtomicBool>,
}

impl Held {
    fn cancelled(&self) -> bool {
        self.shutdown.load(Ordering::Relaxed)
            || self.job.requester.cancelled()
            || self.past_deadline()
    }

    fn past_deadline(&self) -> bool {
        self.job.deadline.is_some_and(|d| Instant::now() >= d)
    }

    /// Sends an update; false once the requester is gone or the batcher is shutting down.
    fn send(&self, update: Update) -> bool {
        self.job.requester.deliver(update) && !self.cancelled()
    }

    /// Reports how the job ended (past `cancelled`, as the requester may still be there to
    /// read why): a job cancelled by the shutdown ends with [`JobError::ShuttingDown`], one
    /// past its deadline with [`JobError::DeadlineExceeded`].
    fn end(&self, result: Result<FinishReason, JobError>) {
        let result = match result {
            Ok(FinishReason::Cancelled) if self.shutdown.load(Ordering::Relaxed) => {
                Err(JobError::ShuttingDown)
            }
            Ok(FinishReason::Cancelled) if self.past_deadline() => Err(JobError::DeadlineExceeded),
            result => result,
        };
        self.job.requester.deliver(Update::Done(result));
    }

    /// The adapters the job runs with, as the prompt cache keys model state.
    fn key(&self) -> Vec<AdapterId> {
        self.job.key()
    }

    /// `on_event` for its generation: tokens and text become updates, and a requester gone
    /// stops it.
    fn on_event(&self) -> impl FnMut(Event<'_>) -> ControlFlow<()> + '_ {
        move |event| {
            let update = match event {
                // The batcher reports prompt progress itself.
                Event::Prefill { .. } => return ControlFlow::Continue(()),
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
            if self.send(update) {
                ControlFlow::Continue(())
            } else {
                ControlFlow::Break(())
            }
        }
    }
}

/// Serves jobs of one model: see the module's documentation.
pub struct Batcher<'a> {
    model: &'a dyn LanguageModel,
    /// `None`: jobs stream token ids only (a benchmark's model need not have a tokenizer).
    tokenizer: Option<&'a Tokenizer>,
    eos_ids: &'a HashSet<u32>,
    prompt_cache: StateCache,
    capacity: usize,
    shutdown: Arc<AtomicBool>,
    stats: Arc<BatcherStats>,
    steps: StepTotals,
    prefill_pause: Option<Duration>,
    memory_budget: Option<usize>,
    /// Bytes of the budget the jobs in the batch hold, as last counted.
    charged: usize,
    /// Prompt tokens per second of the last chunk that went through the model.
    prefill_rate: Option<f64>,
}

/// The decoding steps of the batches served so far.
#[derive(Debug, Clone, Copy, Default)]
pub struct StepTotals {
    pub steps: u64,
    /// Steps replayed from a recording (GPU).
    pub replayed: u64,
    /// The host's time up to each step's download (GPU): see [`DecodeSteps::host_time`].
    pub host: Duration,
    /// The GPU's time over the replayed steps: see [`DecodeSteps::gpu_time`].
    pub gpu: Duration,
}

impl StepTotals {
    fn add(&mut self, steps: &DecodeSteps) {
        self.replayed += steps.replayed();
        self.host += steps.host_time().unwrap_or_default();
        self.gpu += steps.gpu_time().unwrap_or_default();
    }
}

/// Bytes of the memory budget that the jobs in the batch hold.
fn charged(prompting: &VecDeque<Prompting>, active: &[Active]) -> usize {
    let prompting = prompting.iter().map(|p| p.held.job.memory);
    prompting
        .chain(active.iter().map(|a| a.held.job.memory))
        .sum()
}

/// Tokens of the prompt a GPU batcher runs once before its first job: enough for the paths a
/// long prompt takes (products on tensor cores, attention as matrix products), whatever
/// prefill step is set.
const WARM_UP_TOKENS: usize = 256;

/// A job whose sequence is decoding.
struct Active {
    held: Held,
    cache: Cache,
    sequence: Sequence,
    /// The token the model takes next.
    token: u32,
}

/// A job whose prompt is going through the model, a chunk at a time between steps.
struct Prompting {
    held: Held,
    cache: Cache,
    sequence: Sequence,
    /// Prompt tokens whose state came from the prompt cache.
    cached_tokens: usize,
    /// Whether a snapshot of the prompt without its last token is still to be kept.
    snapshot: bool,
    /// The logits after the last chunk.
    logits: Vec<f32>,
}

/// Where [`Batcher::prompt`] left a job.
enum Prompted {
    /// More of its prompt is to go through.
    More(Prompting),
    Decoding(Active),
    /// Reported as ended.
    Ended,
}

impl<'a> Batcher<'a> {
    pub fn new(
        model: &'a dyn LanguageModel,
        tokenizer: Option<&'a Tokenizer>,
        eos_ids: &'a HashSet<u32>,
        settings: BatcherSettings,
    ) -> Self {
        settings.publish_limits(model.info());
        Batcher {
            model,
            tokenizer,
            eos_ids,
            prompt_cache: StateCache::new(settings.cache_entries, settings.cache_bytes),
            capacity: settings.capacity.max(1),
            shutdown: settings.shutdown,
            stats: settings.stats,
            steps: StepTotals::default(),
            prefill_pause: settings.prefill_pause,
            memory_budget: settings.memory_budget,
            charged: 0,
            prefill_rate: None,
        }
    }

    /// The decoding steps of the batches served so far.
    pub fn step_totals(&self) -> StepTotals {
        self.steps
    }

    /// On a GPU, runs one prompt through the model and forgets it, so that the first long
    /// prompt served does not pay for what a device sets up on first use: on an H200 that
    /// stalls every other request's stream for over a tenth of a second, whatever the prefill
    /// step, where a warm device stalls them for milliseconds. Nothing of the kind shows on
    /// the CPU.
    pub fn warm_up(&self) {
        let model = self.model;
        if model.info().device.is_cpu() {
            return;
        }
        let tokens = model.info().max_context.unwrap_or(usize::MAX);
        let prompt = vec![0; WARM_UP_TOKENS.min(tokens)];
        // A failure here (device memory, say) is left for the jobs to meet and report.
        let _ = model
            .new_cache()
            .and_then(|mut cache| model.forward(&prompt, &mut cache, Logits::Last));
    }

    /// Serves the jobs of `queue` in their order until it is closed and empty; its tasks run as
    /// soon as the batcher meets them.
    pub fn run<W: Into<Work>>(&mut self, queue: &mpsc::Receiver<W>) {
        let mut waiting = VecDeque::new();
        while let Some(first) = waiting
            .pop_front()
            .or_else(|| queue.iter().find_map(|work| self.take(work.into())))
        {
            self.serve(first, queue, &mut waiting);
        }
    }

    /// A job, held to be served; a task is run now, on the model without adapters (a panic in
    /// it drops its reply channel, which its requester sees).
    fn take(&self, work: Work) -> Option<Held> {
        match work {
            Work::Generate(job) => Some(Held {
                job: *job,
                shutdown: self.shutdown.clone(),
            }),
            Work::Run(task) => {
                let model = self.model;
                let _ = catch_unwind(AssertUnwindSafe(|| task(model)));
                None
            }
        }
    }

    /// Serves `first` and the jobs of its adapter that arrive while its batch runs, until the
    /// batch is empty; jobs of other adapters are left in `waiting`, in their order.
    fn serve<W: Into<Work>>(
        &mut self,
        first: Held,
        queue: &mpsc::Receiver<W>,
        waiting: &mut VecDeque<Held>,
    ) {
        let model = self.model;
        waiting.push_front(first);
        let mut prompting: VecDeque<Prompting> = VecDeque::new();
        let mut active: Vec<Active> = Vec::new();
        // Replays the steps of a batch of each size met: a step of as many sequences issues
        // the same calls whichever they are (their cache tables are uploaded each step), and a
        // replay checks each call before it skips it.
        let mut steps_by_size: HashMap<usize, DecodeSteps> = HashMap::new();
        // Set once a job whose adapters cannot share the batch's steps waits: this batch then
        // takes no more.
        let mut draining = false;
        loop {
            waiting.extend(queue.try_iter().filter_map(|work| self.take(work.into())));
            while !draining && prompting.len() + active.len() < self.capacity {
                let Some(held) = waiting.front() else { break };
                let in_batch = prompting
                    .iter()
                    .map(|p| &p.held)
                    .chain(active.iter().map(|a| &a.held));
                if !in_batch
                    .into_iter()
                    .all(|h| h.job.shares_steps_with(&held.job))
                {
                    draining = true;
                    break;
                }
                if let Some(budget) = self.memory_budget {
                    let needed = held.job.memory;
                    if needed > budget {
                        let held = waiting.pop_front().expect("a waiting job");
                        held.end(Err(JobError::Memory { needed, budget }));
                        continue;
                    }
                    // In its turn: the jobs behind it wait too, so that it is not starved.
                    if charged(&prompting, &active) + needed > budget {
                        break;
                    }
                }
                let held = waiting.pop_front().expect("a waiting job");
                if let Some(p) = self.begin(model, held) {
                    prompting.push_back(p);
                }
                // The prompt cache gives way (once the job has taken what it reuses of it).
                self.charged = charged(&prompting, &active);
                self.fit_prompt_cache();
            }
            self.publish(waiting.len(), &prompting, &active);
            // Between steps, at most one prefill step's worth of prompt tokens: many short
            // prompts at once, a long one a chunk at a time while the others go on decoding.
            // The prompts with the least left go first, so that one arriving while a long one
            // goes through waits for one chunk of it, not for all of it.
            prompting
                .make_contiguous()
                .sort_by_key(|p| p.held.job.prompt.len() - p.cache.offset);
            let mut budget = prompting
                .front()
                .map_or(0, |p| self.prefill_budget(p.held.job.options.prefill_step));
            while budget > 0 {
                let Some(p) = prompting.pop_front() else {
                    break;
                };
                match self.prompt(model, p, &mut budget) {
                    Prompted::More(p) => prompting.push_front(p),
                    Prompted::Decoding(joined) => active.push(joined),
                    Prompted::Ended => {}
                }
            }
            self.publish(waiting.len(), &prompting, &active);
            if active.is_empty() {
                if prompting.is_empty() {
                    break;
                }
                continue;
            }
            active = self.step(model, &mut steps_by_size, active);
        }
        steps_by_size
            .values()
            .for_each(|steps| self.steps.add(steps));
        self.publish(waiting.len(), &prompting, &active);
    }

    /// Drops the least recently used prompt cache entries that the running jobs' share of the
    /// memory budget leaves no room for: the budget covers both.
    fn fit_prompt_cache(&mut self) {
        if let Some(budget) = self.memory_budget {
            self.prompt_cache
                .shrink_to(budget.saturating_sub(self.charged));
        }
    }

    /// Prompt tokens to put through between two steps: a prefill step, or fewer where the
    /// measured prompt speed says it would take longer than the prefill pause.
    fn prefill_budget(&self, step: usize) -> usize {
        let step = step.max(1);
        let Some(pause) = self.prefill_pause else {
            return step;
        };
        let fits = match self.prefill_rate {
            Some(rate) => (rate * pause.as_secs_f64()) as usize,
            None => FIRST_PREFILL_BUDGET,
        };
        step.min(fits.max(MIN_PREFILL_BUDGET))
    }

    /// Tells [`BatcherStats`] where the batch stands: the jobs in it and behind it, the
    /// context their caches hold, and the prompt cache's size.
    fn publish(&mut self, waiting: usize, prompting: &VecDeque<Prompting>, active: &[Active]) {
        self.charged = charged(prompting, active);
        let stats = &self.stats;
        let kv_tokens = prompting.iter().map(|p| p.cache.offset);
        let kv_tokens: usize = kv_tokens.chain(active.iter().map(|a| a.cache.offset)).sum();
        let store = |n: &AtomicUsize, value| n.store(value, Ordering::Relaxed);
        store(&stats.running, prompting.len() + active.len());
        store(&stats.waiting, waiting);
        store(&stats.kv_tokens, kv_tokens);
        store(&stats.prompt_cache_entries, self.prompt_cache.len());
        store(&stats.prompt_cache_bytes, self.prompt_cache.bytes());
        store(&stats.memory_charged, self.charged);
    }

    /// Takes `held` into the batch: its cache (from the prompt cache where a prefix is there)
    /// and its sequence; `None` when it has already ended (and been reported).
    fn begin(&mut self, model: &dyn LanguageModel, held: Held) -> Option<Prompting> {
        if held.cancelled() {
            held.end(Ok(FinishReason::Cancelled));
            return None;
        }
        let state = catch_unwind(AssertUnwindSafe(|| self.state_for(model, &held.job)))
            .unwrap_or_else(|panic| Err(JobError::Panic(panic_message(&*panic))));
        match state {
            Ok((cache, cached_tokens, sequence)) => {
                if !held.send(Update::Started { cached_tokens }) {
                    held.end(Ok(FinishReason::Cancelled));
                    return None;
                }
                // Recurrent and sliding-window state cannot be cut back later, so such a cache
                // keeps a snapshot of the prompt without its last token: the next turn of a
                // chat, or a retry, resumes from it.
                let snapshot_at = held.job.prompt.len() - 1;
                let snapshot = !is_truncatable(&cache) && cached_tokens < snapshot_at;
                Some(Prompting {
                    held,
                    cache,
                    sequence,
                    cached_tokens,
                    snapshot,
                    logits: Vec::new(),
                })
            }
            Err(e) => {
                held.end(Err(e));
                None
            }
        }
    }

    /// `job`'s cache (from the prompt cache where a prefix of its prompt is there), the prompt
    /// tokens that came from there, and its sequence.
    fn state_for(
        &mut self,
        model: &dyn LanguageModel,
        job: &Job,
    ) -> Result<(Cache, usize, Sequence), JobError> {
        if job.prompt.is_empty() {
            return Err(RuntimeError::from(ForwardError::EmptyInput).into());
        }
        // Refused before prefill, which would otherwise run up to the limit before failing.
        model
            .info()
            .check_context(0, job.prompt.len())
            .map_err(RuntimeError::from)?;
        // Its adapters, checked against the model once: its passes trust them.
        AdaptedModel::by_rows(model, RowAdapters::stack(&job.stack()))?;
        let (cache, cached_tokens) = match self.prompt_cache.fetch(&job.key(), &job.prompt) {
            Some(hit) => (hit.cache, hit.tokens),
            None => (job.options.new_cache(model)?, 0),
        };
        self.stats.count_lookup(job.prompt.len(), cached_tokens);
        let sequence = Sequence::new(
            self.tokenizer,
            &job.prompt,
            job.prompt.len() - cached_tokens,
            self.eos_ids,
            &job.options,
            &job.stream,
        )?;
        Ok((cache, cached_tokens, sequence))
    }

    /// Runs up to `budget` more tokens of `p`'s prompt through `model` (taking them off the
    /// budget), in chunks of at most one prefill step; once the whole prompt has gone through,
    /// reports the first token. An error or a panic ends the job with its message.
    fn prompt(
        &mut self,
        model: &dyn LanguageModel,
        mut p: Prompting,
        budget: &mut usize,
    ) -> Prompted {
        // Requests are validated before they get here; this keeps one that still trips a bug
        // from taking the thread (and the server) down.
        let ran = catch_unwind(AssertUnwindSafe(|| {
            let through = self.prompt_chunks(model, &mut p, budget)?;
            if !through {
                return Ok(None);
            }
            let next = NextToken::Logits(&mut p.logits);
            Ok(Some(p.sequence.advance(next, &mut p.held.on_event())?))
        }));
        let error = match ran {
            Ok(Ok(None)) if p.held.cancelled() => {
                // What went through is kept, as for a generation cut short.
                let tokens = p.held.job.prompt[..p.cache.offset].to_vec();
                self.prompt_cache.insert(p.held.key(), tokens, p.cache);
                self.charged = self.charged.saturating_sub(p.held.job.memory);
                self.fit_prompt_cache();
                p.held.end(Ok(FinishReason::Cancelled));
                return Prompted::Ended;
            }
            Ok(Ok(None)) => return Prompted::More(p),
            Ok(Ok(Some(Some(token)))) => {
                return Prompted::Decoding(Active {
                    held: p.held,
                    cache: p.cache,
                    sequence: p.sequence,
                    token,
                })
            }
            Ok(Ok(Some(None))) => {
                self.finish(&p.held, p.cache, p.sequence);
                return Prompted::Ended;
            }
            Ok(Err(e)) => e,
            Err(panic) => JobError::Panic(panic_message(&*panic)),
        };
        p.held.end(Err(error));
        Prompted::Ended
    }

    /// The chunks of [`prompt`](Self::prompt): whether the whole prompt has gone through
    /// (false when the budget ran out, or the requester went away).
    fn prompt_chunks(
        &mut self,
        model: &dyn LanguageModel,
        p: &mut Prompting,
        budget: &mut usize,
    ) -> Result<bool, JobError> {
        let model = AdaptedModel::of_checked(model, RowAdapters::stack(&p.held.job.stack()))?;
        let prompt = &p.held.job.prompt;
        // Progress counts every uncached prompt token.
        let total = prompt.len() - p.cached_tokens;
        let step = p.held.job.options.prefill_step.max(1);
        while p.cache.offset < prompt.len() {
            if *budget == 0 || p.held.cancelled() {
                return Ok(false);
            }
            let end = if p.snapshot {
                prompt.len() - 1
            } else {
                prompt.len()
            };
            let chunk = &prompt[p.cache.offset..end.min(p.cache.offset + step.min(*budget))];
            let started = Instant::now();
            p.logits = model
                .forward(chunk, &mut p.cache, Logits::Last)
                .map_err(RuntimeError::from)?
                .into_data();
            // Quantized (where the options ask) before the cache joins a batch or a snapshot.
            let options = &p.held.job.options;
            options
                .quantize_when_due(&mut p.cache)
                .map_err(RuntimeError::from)?;
            let seconds = started.elapsed().as_secs_f64();
            if seconds > 0.0 {
                self.prefill_rate = Some(chunk.len() as f64 / seconds);
            }
            *budget -= chunk.len();
            let done = p.cache.offset - p.cached_tokens;
            if !p.held.send(Update::Prefill { done, total }) {
                return Ok(false);
            }
            if p.snapshot && p.cache.offset == end {
                p.snapshot = false;
                // A snapshot that does not fit in device memory is only a later cache miss.
                if let Ok(snapshot) = p.cache.try_clone() {
                    let tokens = prompt[..end].to_vec();
                    self.prompt_cache.insert(p.held.key(), tokens, snapshot);
                    self.fit_prompt_cache();
                }
            }
        }
        Ok(true)
    }

    /// One decoding step of every sequence of `active`, through the recording of its batch size
    /// in `steps_by_size`; returns those still decoding. A sequence at the model's context
    /// limit ends alone with that error, before the step; a step that fails or panics otherwise
    /// ends every job of the batch with its message.
    fn step(
        &mut self,
        model: &dyn LanguageModel,
        steps_by_size: &mut HashMap<usize, DecodeSteps>,
        active: Vec<Active>,
    ) -> Vec<Active> {
        let mut active: Vec<Active> = active
            .into_iter()
            .filter_map(|a| match model.info().check_context(a.cache.offset, 1) {
                Ok(()) => Some(a),
                Err(overflow) => {
                    a.held.end(Err(RuntimeError::from(overflow).into()));
                    None
                }
            })
            .collect();
        if active.is_empty() {
            return active;
        }
        // Each sequence's row through its own adapters (the batch admits only sets that can
        // share a step: see `Job::shares_steps_with`).
        let adapters: Vec<Vec<Arc<Adapter>>> =
            active.iter().map(|a| a.held.job.adapters.clone()).collect();
        let stacks: Vec<Vec<&Adapters>> = adapters
            .iter()
            .map(|stack| stack.iter().map(|a| &a.adapters).collect())
            .collect();
        let adapted = RowAdapters::by_row(&stacks)
            .ok_or_else(|| "adapters of a mixture's experts cannot share a step".to_string())
            .and_then(|rows| AdaptedModel::of_checked(model, rows).map_err(|e| e.to_string()));
        let adapted = match adapted {
            Ok(adapted) => adapted,
            Err(message) => return end_all(active, || JobError::Step(message.clone())),
        };
        let model: &dyn LanguageModel = &adapted;
        // Sized after the sequences at their limit have left, so that a size's recording only
        // ever sees steps of that size.
        let steps = steps_by_size
            .entry(active.len())
            .or_insert_with(|| DecodeSteps::new(&model.info().device));
        let greedy = active.iter().all(|a| a.sequence.picks_greedily());
        self.steps.steps += 1;
        let stepped = catch_unwind(AssertUnwindSafe(|| {
            let tokens: Vec<u32> = active.iter().map(|a| a.token).collect();
            let rows = active.len();
            let mut caches = Vec::with_capacity(rows);
            let mut constraints = Vec::new();
            for (row, a) in active.iter_mut().enumerate() {
                caches.push(&mut a.cache);
                constraints.extend(a.sequence.constraint_mut().map(|c| (row, c)));
            }
            if constraints.is_empty() {
                let picking = if greedy {
                    Picking::Greedy
                } else {
                    Picking::Logits
                };
                return decode_step(model, steps, &tokens, &mut caches, picking);
            }
            // Grammars' masks need only the tokens already taken: they are computed while the
            // model runs the step, not after it. A GPU runs it once the host has queued it, so
            // the masks are computed then, side by side on the host's cores, and go up for the
            // picks made there; a CPU runs it before `forward` returns, beside a thread that
            // computes them.
            if greedy && !model.info().device.is_cpu() {
                let allowed = move || {
                    each_side_by_side(&mut constraints, |(_, c)| c.prepare());
                    allowed_by_row(rows, constraints)
                };
                let picking = Picking::GreedyAllowed(Box::new(allowed));
                return decode_step(model, steps, &tokens, &mut caches, picking);
            }
            std::thread::scope(|scope| {
                let masks = scope.spawn(move || {
                    constraints.iter_mut().for_each(|(_, c)| c.prepare());
                    constraints
                });
                let prepared = move || match masks.join() {
                    Ok(constraints) => constraints,
                    Err(panic) => std::panic::resume_unwind(panic),
                };
                if !greedy {
                    let stepped = decode_step(model, steps, &tokens, &mut caches, Picking::Logits);
                    prepared();
                    return stepped;
                }
                let allowed = move || allowed_by_row(rows, prepared());
                let picking = Picking::GreedyAllowed(Box::new(allowed));
                decode_step(model, steps, &tokens, &mut caches, picking)
            })
        }));
        let mut stepped = match stepped {
            Ok(Ok(stepped)) => stepped,
            Ok(Err(e)) => return end_all(active, || JobError::Step(e.to_string())),
            Err(panic) => {
                let message = panic_message(&*panic);
                return end_all(active, || JobError::Panic(message.clone()));
            }
        };
        if let Stepped::Picks(picks) = &stepped {
            let mut ahead: Vec<(&mut TokenConstraint, u32)> = active
                .iter_mut()
                .zip(picks)
                .filter_map(|(a, pick)| Some((a.sequence.grammar_advanced_by(pick.id)?, pick.id)))
                .collect();
            if ahead.len() > 1 {
                // The device waits for the next step while the host takes this one's tokens. A
                // grammar that panics here has not advanced: its sequence's own `advance` takes
                // the token again, and ends alone if it panics there too.
                let _ = catch_unwind(AssertUnwindSafe(|| {
                    each_side_by_side(&mut ahead, |(c, token)| c.accept_ahead(*token))
                }));
            }
        }
        let vocab = model.info().vocab_size;
        let mut decoding = Vec::with_capacity(active.len());
        for (i, mut a) in active.into_iter().enumerate() {
            let next = stepped.next(i, vocab);
            let advanced = catch_unwind(AssertUnwindSafe(|| {
                a.sequence.advance(next, &mut a.held.on_event())
            }));
            match advanced {
                Ok(Ok(Some(token))) => {
                    a.token = token;
                    decoding.push(a);
                }
                Ok(Ok(None)) => self.finish(&a.held, a.cache, a.sequence),
                Ok(Err(e)) => a.held.end(Err(e.into())),
                Err(panic) => a.held.end(Err(JobError::Panic(panic_message(&*panic)))),
            }
        }
        decoding
    }

    /// Ends `held`'s generation: reports it, and keeps what `cache` holds for later prompts.
    fn finish(&mut self, held: &Held, cache: Cache, sequence: Sequence) {
        let generation = catch_unwind(AssertUnwindSafe(|| sequence.finish(&mut held.on_event())));
        match generation {
            Ok(Ok(generation)) => {
                self.keep(held, cache, &generation);
                held.end(Ok(generation.finish_reason));
            }
            Ok(Err(e)) => held.end(Err(e.into())),
            Err(panic) => held.end(Err(JobError::Panic(panic_message(&*panic)))),
        }
    }

    /// Keeps `cache` in the prompt cache: the prompt, then the generated tokens that went
    /// through the model.
    fn keep(&mut self, held: &Held, cache: Cache, generation: &Generation) {
        let tokens: Vec<u32> = held
            .job
            .prompt
            .iter()
            .chain(&generation.tokens)
            .take(cache.offset)
            .copied()
            .collect();
        if tokens.len() == cache.offset {
            self.prompt_cache.insert(held.key(), tokens, cache);
            // The job has ended: its share of the budget is the prompt cache's now.
            self.charged = self.charged.saturating_sub(held.job.memory);
            self.fit_prompt_cache();
        }
    }
}

/// Ends every job of `active` with the error of a step they shared.
fn end_all(active: Vec<Active>, error: impl Fn() -> JobError) -> Vec<Active> {
    for a in active {
        a.held.end(Err(error()));
    }
    Vec::new()
}

fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".into())
}

/// The tokens each of a step's `rows` sequences may take: those its grammar allows (from
/// `constraints`, a sequence's row beside its grammar), any token where it has none.
fn allowed_by_row(
    rows: usize,
    constraints: Vec<(usize, &mut TokenConstraint)>,
) -> Vec<Option<AllowedTokens>> {
    let mut allowed: Vec<Option<AllowedTokens>> = (0..rows).map(|_| None).collect();
    for (row, constraint) in constraints {
        allowed[row] = constraint.take_allowed();
    }
    allowed
}

/// Runs `f` on each of `items` on the engine's threads, the caller's among them (on the caller
/// alone while the pool runs a model's kernels).
fn each_side_by_side<T: Send>(items: &mut [T], f: impl Fn(&mut T) + Sync) {
    let items: Vec<std::sync::Mutex<&mut T>> =
        items.iter_mut().map(std::sync::Mutex::new).collect();
    pool::parallel_for(items.len(), &|i| {
        f(&mut items[i].lock().unwrap_or_else(|e| e.into_inner()))
    });
}
