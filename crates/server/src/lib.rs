//! `oxlm serve`: an HTTP server with the OpenAI API that mlx_lm.server (mlx-lm 0.32.2) offers,
//! over the oxlm runtime: `POST /v1/chat/completions` and `/v1/completions` (JSON or SSE
//! streams), `GET /v1/models` and `GET /health`.
//!
//! Everything HTTP lives here: request validation, response and error shapes, streaming, tool
//! call and reasoning parsing, per-request LoRA adapters (mlx_lm.server's `adapters` field,
//! resolved inside one adapter directory). Generation itself runs on one dedicated thread
//! ([`worker`]), fed in arrival order.

mod api;
pub mod error;
pub mod parsers;
mod request;
mod worker;

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use oxlm_runtime::adapter_store::{Adapter, AdapterStore};
use oxlm_runtime::generate::DEFAULT_PREFILL_STEP;
use oxlm_runtime::generation_config::SamplingDefaults;
use oxlm_runtime::{LoadedModel, RuntimeError};
use serde_json::{Map, Value};

pub use error::{ApiError, ServeError};

use crate::parsers::ToolFormat;
use crate::request::Defaults;
use crate::worker::{CacheLimits, Worker};

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
    /// Larger request bodies are refused with 413.
    pub max_request_bytes: usize,
    pub prefill_step: usize,
    /// The adapter of requests that name none (mlx_lm.server's `--adapter-path`).
    pub adapter_path: Option<PathBuf>,
    /// Where the adapters that requests name live; names resolve inside it only.
    pub adapters_dir: Option<PathBuf>,
    /// Most adapters from `adapters_dir` kept loaded.
    pub adapter_cache_size: usize,
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
            prefill_step: DEFAULT_PREFILL_STEP,
            adapter_path: None,
            adapters_dir: None,
            adapter_cache_size: 8,
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
    worker: Worker,
}

/// A loaded model and its generation thread, ready to serve.
pub struct Server {
    state: Arc<AppState>,
}

impl Server {
    /// Loads the model directory and starts the generation thread.
    pub fn load(model_dir: &Path, settings: Settings) -> Result<Self, ServeError> {
        Self::new(LoadedModel::load(model_dir)?, settings)
    }

    /// Serves a model already loaded (its `dir` gives generation_config.json and the model id).
    pub fn new(model: LoadedModel, settings: Settings) -> Result<Self, ServeError> {
        let model = Arc::new(model);
        let model_dir = model.dir.as_path();
        let recommended = SamplingDefaults::from_dir(model_dir)?;
        let mut xtc_special_tokens = model
            .tokenizer
            .encode("\n", false)
            .map_err(RuntimeError::from)?;
        xtc_special_tokens.extend(&model.eos_ids);
        let defaults = Defaults {
            max_tokens: settings.max_tokens,
            temperature: settings
                .temperature
                .or(recommended.temperature)
                .unwrap_or(0.0),
            top_p: settings.top_p.or(recommended.top_p).unwrap_or(1.0),
            top_k: settings.top_k.or(recommended.top_k).unwrap_or(0),
            min_p: settings.min_p.or(recommended.min_p).unwrap_or(0.0),
            repetition_penalty: recommended.repetition_penalty,
            xtc_special_tokens,
        };
        let tool_format = ToolFormat::from_template(
            model
                .chat_template
                .iter()
                .flat_map(|template| template.sources()),
        );
        let think = model.tokenizer.think_markers();
        let model_id = model_dir
            .canonicalize()
            .unwrap_or_else(|_| model_dir.to_path_buf())
            .display()
            .to_string();
        let base = model.model.as_ref();
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
        let limits = CacheLimits {
            entries: settings.prompt_cache_size,
            bytes: settings.prompt_cache_bytes,
        };
        let worker = Worker::spawn(model.clone(), limits)?;
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
                worker,
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
        axum::serve(listener, self.router()).await
    }
}

/// Loads the model, listens on `host:port` and serves, blocking (the CLI's entry point).
pub fn run(model_dir: &Path, settings: Settings, host: &str, port: u16) -> Result<(), ServeError> {
    let server = Server::load(model_dir, settings)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async {
        let address = format!("{host}:{port}");
        let listener = tokio::net::TcpListener::bind(&address)
            .await
            .map_err(|source| ServeError::Bind {
                address: address.clone(),
                source,
            })?;
        eprintln!(
            "Serving {} at http://{} (OpenAI API: /v1/chat/completions, /v1/completions, /v1/models)",
            server.model_id(),
            listener.local_addr()?
        );
        server.serve(listener).await?;
        Ok(())
    })
}

fn unix_time() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}
