//! The generation thread. Model forward passes are long, CPU-bound and blocking, so they run on
//! one dedicated thread, never on the async executor: HTTP keeps answering (health checks,
//! model lists, queueing) while a generation runs. The thread runs the runtime's continuous
//! batcher over the jobs the requests submit, in arrival order, and times each request's
//! updates as it hands them over (see [`crate::metrics`]).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use oxlm_models::LanguageModel;
use oxlm_runtime::adapter_store::Adapter;
use oxlm_runtime::batcher::{Batcher, BatcherSettings, Job, JobError, Requester, Update, Work};
use oxlm_runtime::memory::MemoryPlan;
use oxlm_runtime::{FinishReason, GenerateOptions, LoadedModel, StreamOptions};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};
use tokio::sync::watch;

use crate::error::ApiError;
use crate::metrics::{RequestTimer, Telemetry};
use crate::Settings;

/// What requests are admitted by: how their caches grow, and the bytes all of them running may
/// take (see [`BatcherSettings::memory_budget`]).
pub struct Admission {
    pub plan: MemoryPlan,
    pub budget: usize,
}

/// A request waiting for its job's updates.
struct Request {
    updates: UnboundedSender<Update>,
    /// Set when the request is dropped.
    cancel: Arc<AtomicBool>,
    timer: RequestTimer,
}

impl Requester for Request {
    fn deliver(&self, update: Update) -> bool {
        self.timer.record(&update);
        self.updates.send(update).is_ok()
    }

    fn cancelled(&self) -> bool {
        self.cancel.load(Ordering::Relaxed) || self.updates.is_closed()
    }
}

/// A job in progress, seen from the request: its updates, and cancellation when dropped
/// (the client disconnected and the response future or stream was dropped).
pub struct Running {
    updates: UnboundedReceiver<Update>,
    cancel: Arc<AtomicBool>,
    /// Set when the reply is complete before the generation ends (see [`Running::ender`]).
    complete: Arc<AtomicBool>,
    shutdown: watch::Receiver<bool>,
    /// This request among those not yet answered.
    _counted: Counted,
    /// When the request gives up, under `--request-timeout`.
    deadline: Option<Instant>,
}

/// A request counted among the worker's outstanding ones until it is dropped.
struct Counted(Arc<AtomicUsize>);

impl Drop for Counted {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Running {
    /// The job's next update; at shutdown or past its deadline, its end with
    /// [`JobError::ShuttingDown`] or [`JobError::DeadlineExceeded`] at once, whatever the
    /// generation thread is doing: a prompt's forward pass may hold it for longer.
    pub async fn next(&mut self) -> Option<Update> {
        if self.complete.load(Ordering::Relaxed) {
            self.cancel.store(true, Ordering::Relaxed);
            return Some(Update::Done(Ok(FinishReason::Stop)));
        }
        let deadline = async {
            match self.deadline {
                Some(deadline) => tokio::time::sleep_until(deadline.into()).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            biased;
            update = self.updates.recv() => update,
            _ = self.shutdown.wait_for(|&down| down) => {
                Some(Update::Done(Err(JobError::ShuttingDown)))
            }
            () = deadline => {
                self.cancel.store(true, Ordering::Relaxed);
                Some(Update::Done(Err(JobError::DeadlineExceeded)))
            }
        }
    }

    /// A flag that, once set, ends the job: [`next`](Running::next) then gives its end, a
    /// stop, whatever it has still to say (the reply was complete, at its one tool call).
    pub fn ender(&self) -> Arc<AtomicBool> {
        self.complete.clone()
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        self.cancel.store(true, Ordering::Relaxed);
    }
}

/// Handle to the generation thread.
pub struct Worker {
    jobs: mpsc::Sender<Work>,
    thread: JoinHandle<()>,
    /// Set when the server shuts down: every job, running or queued, ends with an error.
    shutdown: Arc<AtomicBool>,
    /// The same, for the requests waiting on their jobs.
    shutdown_watch: watch::Sender<bool>,
    /// Requests submitted and not yet answered (decoding or queued).
    outstanding: Arc<AtomicUsize>,
    /// Most requests answered at once: decoding, then queued (`None`: no limit).
    max_outstanding: Option<usize>,
    /// How long a request may take, from its submission to its last token.
    request_timeout: Option<Duration>,
    /// Where the batcher and the requests' timers report.
    telemetry: Arc<Telemetry>,
    admission: Admission,
}

/// What a refused request is told to wait before it tries again.
const RETRY_AFTER_SECONDS: u64 = 1;

impl Worker {
    /// Starts the thread, which decodes up to `--decode-concurrency` sequences together; at
    /// most `--max-queued-requests` more wait for a place; each request has
    /// `--request-timeout` to finish.
    pub fn spawn(
        model: Arc<LoadedModel>,
        serving: &Settings,
        admission: Admission,
        telemetry: Arc<Telemetry>,
    ) -> std::io::Result<Self> {
        let (jobs, queue) = mpsc::channel::<Work>();
        let shutdown = Arc::new(AtomicBool::new(false));
        let decode_concurrency = serving.decode_concurrency;
        let settings = BatcherSettings {
            capacity: decode_concurrency,
            cache_entries: serving.prompt_cache_size,
            cache_bytes: serving.prompt_cache_bytes,
            shutdown: shutdown.clone(),
            stats: telemetry.batcher_stats(),
            prefill_pause: serving.prefill_pause,
            memory_budget: Some(admission.budget),
        };
        settings.publish_limits(model.model.info());
        let thread = std::thread::Builder::new()
            .name("oxlm-generate".into())
            .spawn(move || {
                let loaded = &*model;
                let mut batcher = Batcher::new(
                    loaded.model.as_ref(),
                    Some(&loaded.tokenizer),
                    &loaded.eos_ids,
                    settings,
                );
                batcher.warm_up();
                batcher.run(&queue);
            })?;
        Ok(Worker {
            jobs,
            thread,
            shutdown,
            shutdown_watch: watch::Sender::new(false),
            outstanding: Arc::new(AtomicUsize::new(0)),
            max_outstanding: (serving.max_queued_requests)
                .map(|queued| decode_concurrency + queued),
            request_timeout: serving.request_timeout,
            telemetry,
            admission,
        })
    }

    /// Ends every job, running or queued, with [`JobError::ShuttingDown`], and refuses new ones.
    pub fn shut_down(&self) {
        self.shutdown.store(true, Ordering::Relaxed);
        self.shutdown_watch.send_replace(true);
    }

    /// Whether the thread still takes jobs.
    pub fn is_alive(&self) -> bool {
        !self.thread.is_finished()
    }

    /// Queues a generation of `prompt`, through `adapters` (none: the base model).
    pub fn submit(
        &self,
        prompt: Vec<u32>,
        adapters: Vec<Arc<Adapter>>,
        options: GenerateOptions,
        stream: StreamOptions,
    ) -> Result<Running, ApiError> {
        if self.shutdown.load(Ordering::Relaxed) {
            return Err(JobError::ShuttingDown.into());
        }
        // One that could never fit is refused here; one that fits later waits in the queue.
        let memory = (self.admission.plan).sequence_bytes(prompt.len(), options.max_tokens);
        if memory > self.admission.budget {
            return Err(ApiError::memory_admission(memory, self.admission.budget));
        }
        let counted = self.count()?;
        let (updates, receiver) = unbounded_channel();
        let cancel = Arc::new(AtomicBool::new(false));
        let timer = self.telemetry.timer(prompt.len());
        let deadline = self.request_timeout.map(|timeout| Instant::now() + timeout);
        let job = Job {
            prompt,
            adapters,
            options,
            stream,
            requester: Box::new(Request {
                updates,
                cancel: cancel.clone(),
                timer,
            }),
            deadline,
            memory,
        };
        let running = Running {
            updates: receiver,
            cancel,
            complete: Arc::default(),
            shutdown: self.shutdown_watch.subscribe(),
            _counted: counted,
            deadline,
        };
        self.jobs
            .send(job.into())
            .map_err(|_| ApiError::unavailable("the generation thread has stopped"))?;
        Ok(running)
    }

    /// Counts a request among the outstanding ones, or refuses it past
    /// `--max-queued-requests`.
    fn count(&self) -> Result<Counted, ApiError> {
        let taken = self.outstanding.fetch_add(1, Ordering::Relaxed);
        let counted = Counted(self.outstanding.clone());
        if self.max_outstanding.is_some_and(|max| taken >= max) {
            return Err(ApiError::too_many_requests(
                "Too many requests are waiting: try again shortly",
                RETRY_AFTER_SECONDS,
            ));
        }
        Ok(counted)
    }

    /// Runs `task` on the generation thread, between two decoding steps (a GPU's stream and its
    /// step recordings are that thread's alone), unless its request has gone by then. It counts
    /// among the outstanding requests and has `--request-timeout`, as a generation does.
    pub async fn run<T: Send + 'static>(
        &self,
        task: impl FnOnce(&dyn LanguageModel) -> T + Send + 'static,
    ) -> Result<T, ApiError> {
        if self.shutdown.load(Ordering::Relaxed) {
            return Err(JobError::ShuttingDown.into());
        }
        let _counted = self.count()?;
        let (reply, result) = tokio::sync::oneshot::channel();
        let task = Box::new(move |model: &dyn LanguageModel| {
            if !reply.is_closed() {
                let _ = reply.send(task(model));
            }
        });
        self.jobs
            .send(Work::Run(task))
            .map_err(|_| ApiError::unavailable("the generation thread has stopped"))?;
        // The reply is dropped unsent where the task panicked.
        let answered = async {
            result
                .await
                .map_err(|_| ApiError::server("the model failed on the generation thread"))
        };
        match self.request_timeout {
            // Past it the reply is dropped, and a task not yet begun is skipped.
            Some(timeout) => tokio::time::timeout(timeout, answered)
                .await
                .unwrap_or_else(|_| Err(JobError::DeadlineExceeded.into())),
            None => answered.await,
        }
    }
}
