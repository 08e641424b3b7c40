//! `oxlm serve`: an HTTP server with the OpenAI API that mlx_lm.server (mlx-lm 0.32.2) offers,
//! over the oxlm runtime: `POST /v1/chat/completions` and `/v1/completions` (JSON or SSE
//! streams), `GET /v1/models` and `GET /health`; the APIs agents speak: OpenAI's Responses
//! (`/v1/responses`), Anthropic's Messages (`/v1/messages`) and embeddings (`/v1/embeddings`);
//! and for orchestrators, `GET /ready`, `GET /metrics` (Prometheus, under vLLM's names) and
//! `GET /stats`.
//!
//! Everything HTTP lives here: request validation, response and error shapes, streaming, tool
//! call and reasoning parsing, structured output (`response_format` and `tool_choice` as
//! grammars), per-request LoRA adapters (mlx_lm.server's `adapters` field,
//! resolved inside one adapter directory), request log lines, metrics, serving while the model
//! loads ([`Loading`]) and graceful shutdown. Generation itself runs on one dedicated thread
//! ([`worker`]), fed in arrival order, which decodes the requests of one adapter together.

mod anthropic;
mod api;
mod body;
mod connections;
mod embeddings;
pub mod error;
mod harmony;
mod loading;
mod log;
mod metrics;
pub mod parsers;
/// Request bodies parsed and checked into what generation takes (public for the fuzz targets).
pub mod request;
mod response_store;
mod responses;
mod sse;
mod structured;
mod worker;

use std::future::Future;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use oxlm_engine::{Device, KvPrecision};
use oxlm_models::{KvQuantization, QuantizedLayers};
use oxlm_runtime::adapter_store::{Adapter, AdapterStore};
use oxlm_runtime::constraint::Grammars;
use oxlm_runtime::embed::{EmbedError, Embedder};
use oxlm_runtime::generate::DEFAULT_PREFILL_STEP;
use oxlm_runtime::generation_config::SamplingDefaults;
use oxlm_runtime::memory::{weights_bytes, CacheBudget, MemoryPlan};
use oxlm_runtime::{GenerateOptions, LoadedModel, RuntimeError};
use serde_json::{Map, Value};

pub use error::{ApiError, ServeError};
pub use loading::Loading;

use crate::connections::ConnectionLimits;
use crate::metrics::{Readiness, Telemetry};
use crate::parsers::ToolFormat;
use crate::request::Defaults;
use crate::response_store::{ResponseStore, StoreLimits};
use crate::worker::{Admission, Worker};

/// Server settings; `Default` gives mlx_lm.server's defaults.
#[derive(Debug, Clone)]
pub struct Settings {
    /// `max_tokens` of requests that do not set it.
    pub max_tokens: usize,
    /// Sampling defaults for requests that leave them unset; `None` falls back to the model's
    /// generation_config.json, then to mlx-lm's defaults (greedy, no filters).
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<usize>,
    pub min_p: Option<f32>,
    /// Chat template variables for every request (a request's `chat_template_kwargs` win).
    pub chat_template_args: Map<String, Value>,
    /// Prompt cache limits: entries, and bytes of model state.
    pub prompt_cache_size: usize,
    pub prompt_cache_bytes: usize,
    /// When set, `/v1/*` requests need `Authorization: Bearer <key>`.
    pub api_key: Option<String>,
    /// CORS origins; `*` allows any.
    pub allowed_origins: Vec<String>,
    /// Larger request bodies are refused with 413 (before any of the body is read when its
    /// length is declared).
    pub max_request_bytes: usize,
    /// A connection with no request in progress (new, or between keep-alive requests) is closed
    /// after this long.
    pub idle_timeout: Duration,
    /// From a request's first byte, its whole head (request line and headers) must arrive within
    /// this long, else the connection is closed.
    pub header_timeout: Duration,
    /// A request's body must arrive within this long of its head, else it is answered 408 and
    /// its connection closed.
    pub body_timeout: Duration,
    /// A response that its client takes nothing of for this long (a client that stopped reading)
    /// has its connection closed.
    pub send_timeout: Duration,
    /// Most connections open at once; one more is answered 503 with `Retry-After` and closed.
    pub max_connections: usize,
    pub prefill_step: usize,
    /// The longest the prompts going through between two decoding steps should hold up the
    /// requests decoding and those arriving: a prompt goes through in chunks as small as the
    /// model's measured prompt speed needs (`None`: whole `prefill_step` chunks).
    pub prefill_pause: Option<Duration>,
    /// Most sequences decoded together (mlx_lm.server's `--decode-concurrency`): requests of
    /// one adapter share each decoding step, reading the weights once for all of them.
    pub decode_concurrency: usize,
    /// Most requests waiting for a place beyond those decoding; more get 429 with
    /// `Retry-After` (`None`: no limit).
    pub max_queued_requests: Option<usize>,
    /// How long a request may take from its arrival to its last token, queueing included;
    /// past it, it ends with a 504 error object (`None`: no limit).
    pub request_timeout: Option<Duration>,
    /// The KV cache's precision; `None`: the device's default.
    pub kv_cache: Option<KvPrecision>,
    /// Which layers' caches go to affine codes once a prompt's first chunk has gone through
    /// (`--kv-bits`, or the checkpoint's `kv_config.json`); `None`: none. A server quantizes
    /// from the first chunk on, not from a later token: the caches decoding in one batch
    /// share their precision.
    pub kv_quantization: Option<QuantizedLayers>,
    /// Whether, without `kv_quantization`, the checkpoint's `kv_config.json` (where it has one)
    /// sets it when the model loads.
    pub kv_config: bool,
    /// Bytes the server may take on its device: weights, the running requests' caches, the
    /// prompt cache and a prompt chunk's activations. A request is admitted when its cache at
    /// its longest (prompt and `max_tokens`) fits what the running ones leave, waits while it
    /// does not, and is refused with a 400 if it never could (`None`: the weights and nine
    /// tenths of what the device has free once they are loaded).
    pub memory_budget: Option<usize>,
    /// The adapter of requests that name none (mlx_lm.server's `--adapter-path`).
    pub adapter_path: Option<PathBuf>,
    /// Where the adapters that requests name live; names resolve inside it only.
    pub adapters_dir: Option<PathBuf>,
    /// Most adapters from `adapters_dir` kept loaded.
    pub adapter_cache_size: usize,
    /// Limits of the Responses API's store (what `previous_response_id` and
    /// `GET /v1/responses/{id}` find): responses, bytes of them as JSON, and how long one is
    /// kept after it was last used. The least recently used go first.
    pub response_store_size: usize,
    pub response_store_bytes: usize,
    pub response_store_ttl: Duration,
    /// `Info` and `Debug` print the startup, shutdown and per-request lines; higher levels do not.
    pub log_level: LogLevel,
    /// How long requests in progress may run on after a shutdown signal before being cancelled.
    pub shutdown_grace: Duration,
    /// Where the model runs.
    pub device: Device,
}

/// mlx_lm.server's `--log-level` values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum LogLevel {
    Debug,
    Info,
    Warning,
    Error,
    Critical,
}

impl FromStr for LogLevel {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        match text.to_ascii_uppercase().as_str() {
            "DEBUG" => Ok(LogLevel::Debug),
            "INFO" => Ok(LogLevel::Info),
            "WARNING" => Ok(LogLevel::Warning),
            "ERROR" => Ok(LogLevel::Error),
            "CRITICAL" => Ok(LogLevel::Critical),
            _ => Err(format!(
                "`{text}` is not a log level (DEBUG, INFO, WARNING, ERROR or CRITICAL)"
            )),
        }
    }
}

impl Settings {
    /// Whether the log level shows the startup, shutdown and request lines.
    fn logs_info(&self) -> bool {
        self.log_level <= LogLevel::Info
    }

    /// Prints an informational line on stderr, unless the log level hides them.
    fn info(&self, line: impl std::fmt::Display) {
        if self.logs_info() {
            eprintln!("{line}");
        }
    }

    /// The caches' quantization, from the first chunk of each prompt on.
    fn kv_quantization(&self) -> Option<KvQuantization> {
        let layers = self.kv_quantization.clone()?;
        Some(KvQuantization { layers, start: 0 })
    }
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            max_tokens: 512,
            temperature: None,
            top_p: None,
            top_k: None,
            min_p: None,
            chat_template_args: Map::new(),
            prompt_cache_size: 10,
            prompt_cache_bytes: 8_000_000_000,
            api_key: None,
            allowed_origins: vec!["*".into()],
            max_request_bytes: 32_000_000,
            // nginx's (client_header_timeout, client_body_timeout and send_timeout 60 s,
            // keepalive_timeout 75 s). uvicorn's 5 s keep-alive, and so vLLM's, is no longer than
            // clients keep pooled connections (httpx 5 s, load balancers 60 s): one can be reused
            // just as the server closes it.
            idle_timeout: Duration::from_secs(75),
            header_timeout: Duration::from_secs(60),
            body_timeout: Duration::from_secs(60),
            send_timeout: Duration::from_secs(60),
            max_connections: connections::default_max_connections(),
            prefill_step: DEFAULT_PREFILL_STEP,
            // A short request's first token within about a second of its arrival, whatever long
            // prompt is going through (on a GPU, a whole step takes less).
            prefill_pause: Some(Duration::from_millis(500)),
            decode_concurrency: 32,
            max_queued_requests: None,
            request_timeout: None,
            kv_cache: None,
            kv_quantization: None,
            kv_config: true,
            memory_budget: None,
            adapter_path: None,
            adapters_dir: None,
            adapter_cache_size: 8,
            response_store_size: 1000,
            response_store_bytes: 256_000_000,
            response_store_ttl: Duration::from_secs(3600),
            log_level: LogLevel::Info,
            shutdown_grace: Duration::from_secs(5),
            device: Device::Cpu,
        }
    }
}

/// What every request handler shares.
struct AppState {
    model: Arc<LoadedModel>,
    /// The id `/v1/models` lists and responses echo: the model directory's absolute path, as
    /// mlx_lm.server names a model given by path.
    model_id: String,
    created: u64,
    defaults: Defaults,
    settings: Settings,
    tool_format: ToolFormat,
    think: Option<(&'static str, &'static str)>,
    /// `Settings::adapter_path`, loaded.
    default_adapter: Option<Arc<Adapter>>,
    /// Loaded on demand; one load at a time.
    adapters: Option<Mutex<AdapterStore>>,
    /// Responses kept for `previous_response_id` and `GET /v1/responses/{id}`.
    responses: ResponseStore,
    worker: Worker,
    telemetry: Arc<Telemetry>,
    /// The grammar compiler for structured output, made when a request first needs it.
    grammars: OnceLock<Grammars>,
    /// How the model embeds (`/v1/embeddings`), or why it cannot.
    embedder: Result<Embedder, EmbedError>,
}

impl AppState {
    fn readiness(&self) -> Readiness {
        self.telemetry.readiness(self.worker.is_alive())
    }

    /// The grammar compiler over the model's vocabulary (walking it takes a moment, so only
    /// servers that get structured requests pay for it).
    fn grammars(&self) -> Result<&Grammars, ApiError> {
        if let Some(grammars) = self.grammars.get() {
            return Ok(grammars);
        }
        let grammars = (self.model.grammars()).map_err(|e| ApiError::server(e.to_string()))?;
        Ok(self.grammars.get_or_init(|| grammars))
    }
}

/// A loaded model and its generation thread, ready to serve.
pub struct Server {
    state: Arc<AppState>,
}

impl Server {
    /// Loads the model directory and starts the generation thread.
    pub fn load(model_dir: &Path, settings: Settings) -> Result<Self, ServeError> {
        Self::new(LoadedModel::load_on(model_dir, &settings.device)?, settings)
    }

    /// Serves a model already loaded (its `dir` gives generation_config.json and the model id).
    pub fn new(model: LoadedModel, settings: Settings) -> Result<Self, ServeError> {
        let telemetry = Arc::new(Telemetry::new(model_id(&model.dir)));
        Self::with_telemetry(model, settings, telemetry)
    }

    /// [`new`](Self::new), reporting through `telemetry`, which has answered since before the
    /// model loaded.
    fn with_telemetry(
        mut model: LoadedModel,
        mut settings: Settings,
        telemetry: Arc<Telemetry>,
    ) -> Result<Self, ServeError> {
        if settings.kv_quantization.is_none() && settings.kv_config {
            let layers = model.model.info().num_layers;
            settings.kv_quantization =
                KvQuantization::from_kv_config(&model.dir, layers, 0)?.map(|q| q.layers);
        }
        let tool_format = ToolFormat::from_template(
            model
                .chat_template
                .iter()
                .flat_map(|template| template.sources()),
        );
        if tool_format == ToolFormat::Harmony {
            // Harmony's replies end at `<|return|>` and `<|call|>` (after them comes the
            // tool's answer, which the model would make up), whatever generation_config.json
            // says.
            let ends = [harmony::RETURN, harmony::CALL].into_iter();
            model
                .eos_ids
                .extend(ends.filter_map(|end| model.tokenizer.token_to_id(end)));
        }
        let model = Arc::new(model);
        let model_dir = model.dir.as_path();
        let recommended = SamplingDefaults::from_dir(model_dir)?;
        let embedder = Embedder::from_dir(model_dir);
        let mut xtc_special_tokens = model
            .tokenizer
            .encode("\n", false)
            .map_err(RuntimeError::from)?;
        xtc_special_tokens.extend(&model.eos_ids);
        let mlx = Defaults::default();
        let defaults = Defaults {
            max_tokens: settings.max_tokens,
            temperature: settings
                .temperature
                .or(recommended.temperature)
                .unwrap_or(mlx.temperature),
            top_p: settings.top_p.or(recommended.top_p).unwrap_or(mlx.top_p),
            top_k: settings.top_k.or(recommended.top_k).unwrap_or(mlx.top_k),
            min_p: settings.min_p.or(recommended.min_p).unwrap_or(mlx.min_p),
            repetition_penalty: recommended.repetition_penalty,
            xtc_special_tokens,
        };
        let think = model.tokenizer.think_markers();
        let model_id = telemetry.model_id().to_owned();
        let base = model.model.as_ref();
        let plan_options = GenerateOptions {
            max_tokens: settings.max_tokens,
            sampler: Default::default(),
            prefill_step: settings.prefill_step,
            kv_cache: settings.kv_cache,
            kv_quantization: settings.kv_quantization(),
            max_kv_size: None,
        };
        // Also refuses caches of a precision this model's heads cannot take, at start rather
        // than in every request.
        let plan = MemoryPlan::new(base, &plan_options).map_err(|e| match e {
            RuntimeError::Forward(e) => ServeError::KvCache(e),
            e => ServeError::Runtime(e),
        })?;
        let weights = weights_bytes(model_dir)?;
        let budget = CacheBudget::new(
            settings.memory_budget,
            &settings.device,
            weights,
            plan.prefill_reserve,
        )?;
        settings.info(format_args!(
            "Memory budget: {:.1} MB ({:.1} MB of weights, {:.1} MB for a prompt chunk, {:.1} MB \
             for the caches)",
            budget.total as f64 / 1e6,
            budget.weights as f64 / 1e6,
            budget.reserved as f64 / 1e6,
            budget.caches as f64 / 1e6
        ));
        let default_adapter = match &settings.adapter_path {
            Some(dir) => Some(Arc::new(Adapter::load(dir, base)?)),
            None => None,
        };
        let adapters = match &settings.adapters_dir {
            Some(root) => Some(Mutex::new(AdapterStore::open(
                root,
                settings.adapter_cache_size,
                base,
            )?)),
            None => None,
        };
        let responses = ResponseStore::new(StoreLimits {
            entries: settings.response_store_size,
            bytes: settings.response_store_bytes,
            max_idle: settings.response_store_ttl,
        });
        let worker = Worker::spawn(
            model.clone(),
            &settings,
            Admission {
                plan,
                budget: budget.caches,
            },
            telemetry.clone(),
        )?;
        Ok(Server {
            state: Arc::new(AppState {
                model,
                model_id,
                created: unix_time(),
                defaults,
                settings,
                tool_format,
                think,
                default_adapter,
                adapters,
                responses,
                worker,
                telemetry,
                grammars: OnceLock::new(),
                embedder,
            }),
        })
    }

    pub fn model_id(&self) -> &str {
        &self.state.model_id
    }

    /// The HTTP routes, to serve with `axum::serve`.
    pub fn router(&self) -> axum::Router {
        api::router(self.state.clone())
    }

    /// Serves on `listener` until the process ends.
    pub async fn serve(self, listener: tokio::net::TcpListener) -> std::io::Result<()> {
        let limits = ConnectionLimits::from(&self.state.settings);
        connections::serve(listener, self.router(), limits, std::future::pending()).await;
        Ok(())
    }

    /// Serves on `listener` until `shutdown` resolves (to the reason, for the log line). Then no
    /// connection is accepted; requests in progress have `Settings::shutdown_grace` to finish,
    /// after which their generations are cancelled and they end with a 503 error object.
    pub async fn serve_until(
        self,
        listener: tokio::net::TcpListener,
        shutdown: impl Future<Output = String> + Send + 'static,
    ) -> std::io::Result<()> {
        let state = self.state.clone();
        let (signalled, on_signal) = tokio::sync::oneshot::channel();
        let stop = async move {
            let _ = signalled.send(shutdown.await);
        };
        let limits = ConnectionLimits::from(&state.settings);
        let serving = connections::serve(listener, self.router(), limits, stop);
        tokio::pin!(serving);
        let reason = tokio::select! {
            // The signal first: with no connection open, serving ends as soon as it has come,
            // and the shutdown must still drain and say so.
            biased;
            reason = on_signal => reason.unwrap_or_default(),
            () = &mut serving => return Ok(()),
        };
        state.telemetry.start_draining();
        let grace = state.settings.shutdown_grace;
        state.settings.info(format_args!(
            "Shutting down ({reason}): requests in progress have {:.1}s to finish",
            grace.as_secs_f64()
        ));
        if tokio::time::timeout(grace, &mut serving).await.is_err() {
            state
                .settings
                .info("Cancelling the generations still in progress");
            state.worker.shut_down();
            // Cancelled responses end at once; a client that reads nothing more is not waited
            // for.
            let _ = tokio::time::timeout(CLOSE_TIMEOUT, serving).await;
        }
        state.settings.info("Server stopped");
        Ok(())
    }
}

/// How long cancelled responses get to reach their clients at shutdown.
const CLOSE_TIMEOUT: Duration = Duration::from_secs(2);

/// Listens on `host:port`, loads the model meanwhile (see [`Loading`]) and serves until SIGINT
/// or SIGTERM, blocking (the CLI's entry point).
pub fn run(model_dir: &Path, settings: Settings, host: &str, port: u16) -> Result<(), ServeError> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let loading = runtime.block_on(async {
        let address = format!("{host}:{port}");
        let listener = tokio::net::TcpListener::bind(&address)
            .await
            .map_err(|source| ServeError::Bind {
                address: address.clone(),
                source,
            })?;
        Ok::<_, ServeError>(Loading::start(listener, model_dir, &settings)?)
    })?;
    // On this thread, while the runtime's threads answer for the loading server. A signal now
    // ends the process as it always has: there is nothing to drain.
    let model = LoadedModel::load_on(model_dir, &settings.device)?;
    runtime.block_on(async {
        // Before any request reaches the model, so that a signal from then on drains them.
        let shutdown = shutdown_signal()?;
        let (server, listener) = loading.finish(model, settings)?;
        server.serve_until(listener, shutdown).await?;
        Ok(())
    })
}

/// Resolves to the name of the first SIGINT or SIGTERM received.
fn shutdown_signal() -> std::io::Result<impl Future<Output = String>> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut interrupt = signal(SignalKind::interrupt())?;
    let mut terminate = signal(SignalKind::terminate())?;
    Ok(async move {
        tokio::select! {
            _ = interrupt.recv() => "SIGINT".to_owned(),
            _ = terminate.recv() => "SIGTERM".to_owned(),
        }
    })
}

/// The id `/v1/models` lists and metrics are labelled with: the model directory's absolute path,
/// as mlx_lm.server names a model given by path.
fn model_id(model_dir: &Path) -> String {
    model_dir
        .canonicalize()
        .unwrap_or_else(|_| model_dir.to_path_buf())
        .display()
        .to_string()
}

fn unix_time() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}
