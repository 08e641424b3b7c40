//! Errors: the OpenAI API's error objects for clients, and what can stop the server starting.

use std::path::{Path, PathBuf};

use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use oxlm_models::lora::AdapterError;
use oxlm_models::LoadError;
use oxlm_runtime::adapter_store::AdapterStoreError;
use serde_json::{json, Value};

use oxlm_runtime::batcher::JobError;

/// An error answered to a client as `{"error": {"message", "type", "param", "code"}}`.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{status}: {message}")]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    /// OpenAI's `type`: `invalid_request_error`, `authentication_error`, `server_error`, ...
    pub kind: &'static str,
    /// The request field at fault.
    pub param: Option<String>,
    pub code: Option<&'static str>,
    /// Seconds a client should wait before trying again (`Retry-After`).
    pub retry_after: Option<u64>,
}

impl ApiError {
    fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            status,
            message: message.into(),
            kind,
            param: None,
            code: None,
            retry_after: None,
        }
    }

    /// 400: a request the server will not run.
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
    }

    /// 400 naming the field at fault.
    pub fn invalid_param(param: &str, message: impl Into<String>) -> Self {
        ApiError {
            param: Some(param.to_owned()),
            ..Self::invalid(message)
        }
    }

    pub fn context_length(param: &str, prompt: usize, limit: usize) -> Self {
        ApiError {
            code: Some("context_length_exceeded"),
            ..Self::invalid_param(
                param,
                format!(
                    "This model's maximum context length is {limit} tokens. However, your \
                     prompt has {prompt} tokens."
                ),
            )
        }
    }

    pub fn unauthorized() -> Self {
        ApiError {
            code: Some("invalid_api_key"),
            ..Self::new(
                StatusCode::UNAUTHORIZED,
                "authentication_error",
                "Incorrect or missing API key: send `Authorization: Bearer <key>` with the key \
                 the server was started with.",
            )
        }
    }

    pub fn not_found(message: impl Into<String>) -> Self {
        ApiError {
            code: Some("not_found"),
            ..Self::new(StatusCode::NOT_FOUND, "invalid_request_error", message)
        }
    }

    pub fn method_not_allowed(message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::METHOD_NOT_ALLOWED,
            "invalid_request_error",
            message,
        )
    }

    pub fn too_large(message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            message,
        )
    }

    /// 408: the request did not arrive in time.
    pub fn request_timeout(message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::REQUEST_TIMEOUT,
            "invalid_request_error",
            message,
        )
    }

    /// 429: the queue is full; try again after `seconds`.
    pub fn too_many_requests(message: impl Into<String>, seconds: u64) -> Self {
        ApiError {
            code: Some("too_many_requests"),
            retry_after: Some(seconds),
            ..Self::new(StatusCode::TOO_MANY_REQUESTS, "rate_limit_error", message)
        }
    }

    /// 400: a request whose cache at its longest (prompt and `max_tokens`) would need more
    /// than the server's whole memory budget for caches.
    pub fn memory_admission(needed: usize, budget: usize) -> Self {
        ApiError {
            code: Some("memory_admission"),
            ..Self::invalid(JobError::Memory { needed, budget }.to_string())
        }
    }

    pub fn server(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", message)
    }

    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::new(StatusCode::SERVICE_UNAVAILABLE, "server_error", message)
    }

    /// 504: the request ran past the server's `--request-timeout`.
    pub fn timed_out(message: impl Into<String>) -> Self {
        ApiError {
            code: Some("timeout"),
            ..Self::new(StatusCode::GATEWAY_TIMEOUT, "server_error", message)
        }
    }

    /// The JSON body, also sent as an event when a stream fails after it started.
    pub fn body(&self) -> Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.code,
        }})
    }

    /// The body in the Anthropic Messages API's shape, its `type` following the status.
    pub fn anthropic_body(&self) -> Value {
        let kind = match self.status {
            StatusCode::UNAUTHORIZED => "authentication_error",
            StatusCode::NOT_FOUND => "not_found_error",
            StatusCode::PAYLOAD_TOO_LARGE => "request_too_large",
            StatusCode::TOO_MANY_REQUESTS => "rate_limit_error",
            StatusCode::SERVICE_UNAVAILABLE => "overloaded_error",
            StatusCode::GATEWAY_TIMEOUT => "timeout_error",
            status if status.is_client_error() => "invalid_request_error",
            _ => "api_error",
        };
        json!({"type": "error", "error": {"type": kind, "message": self.message}})
    }

    /// The response of the Anthropic routes: [`Self::anthropic_body`], status and headers as
    /// any other.
    pub fn into_anthropic_response(self) -> Response {
        self.response(&self.anthropic_body())
    }

    /// The response in the shape of the API whose route `path` is: Anthropic's for its
    /// Messages routes, OpenAI's elsewhere (errors raised before a route's handler runs:
    /// methods, sizes, timeouts, keys).
    pub fn into_response_for(self, path: &str) -> Response {
        if is_anthropic_route(path) {
            self.into_anthropic_response()
        } else {
            self.into_response()
        }
    }

    fn response(&self, body: &Value) -> Response {
        let mut response = (
            self.status,
            [(header::CONTENT_TYPE, "application/json")],
            body.to_string(),
        )
            .into_response();
        if let Some(seconds) = self.retry_after {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, header::HeaderValue::from(seconds));
        }
        response
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        self.response(&self.body())
    }
}

/// Messages name adapters and their files as the client named them, never by where they are on
/// the server.
impl From<AdapterStoreError> for ApiError {
    fn from(error: AdapterStoreError) -> Self {
        match error {
            AdapterStoreError::NotFound(_) => ApiError {
                code: Some("adapter_not_found"),
                param: Some("adapters".into()),
                ..ApiError::not_found(error.to_string())
            },
            AdapterStoreError::OutsideRoot(_) => {
                ApiError::invalid_param("adapters", error.to_string())
            }
            AdapterStoreError::Unusable { name, error } => {
                let error = AdapterStoreError::Unusable {
                    error: adapter_error_within(error, Path::new(&name)),
                    name,
                };
                ApiError::invalid_param("adapters", error.to_string())
            }
            AdapterStoreError::Root { source, .. } => {
                ApiError::server(format!("The adapter directory cannot be used: {source}"))
            }
            AdapterStoreError::Model(error) => {
                ApiError::server(adapter_error_within(error, Path::new("")).to_string())
            }
        }
    }
}

/// `error` with each path in it replaced by `dir` joined with the path's file name: an adapter
/// is read from the files directly inside its directory, so `dir` (the adapter's name) locates
/// them for a client. Every variant is listed so that a new one is looked at for paths.
fn adapter_error_within(error: AdapterError, dir: &Path) -> AdapterError {
    let within = |path: PathBuf| dir.join(path.file_name().unwrap_or_default());
    match error {
        AdapterError::NotFound(_) => AdapterError::NotFound(dir.to_path_buf()),
        AdapterError::Config { path, reason } => AdapterError::Config {
            path: within(path),
            reason,
        },
        AdapterError::Mismatch { path, problems } => AdapterError::Mismatch {
            path: within(path),
            problems,
        },
        AdapterError::NonFiniteWeights { path, tensors } => AdapterError::NonFiniteWeights {
            path: within(path),
            tensors,
        },
        AdapterError::Load(error) => AdapterError::Load(match error {
            LoadError::Io { path, source } => LoadError::Io {
                path: within(path),
                source,
            },
            LoadError::Json { path, source } => LoadError::Json {
                path: within(path),
                source,
            },
            LoadError::MissingFile(path) => LoadError::MissingFile(within(path)),
            LoadError::Safetensors { path, reason } => LoadError::Safetensors {
                path: within(path),
                reason,
            },
            LoadError::Invalid { path, reason } => LoadError::Invalid {
                path: within(path),
                reason,
            },
            error @ (LoadError::MissingTensor(_)
            | LoadError::TensorShape { .. }
            | LoadError::UnusedTensors(_)
            | LoadError::UnsupportedModelType { .. }
            | LoadError::UnsupportedQuantization(_)
            | LoadError::Config(_)
            | LoadError::Engine { .. }) => error,
        }),
        error @ (AdapterError::UnsupportedType(_)
        | AdapterError::UnsupportedModel(_)
        | AdapterError::FusedTraining(_)
        | AdapterError::Device(_)) => error,
    }
}

impl From<JobError> for ApiError {
    fn from(error: JobError) -> Self {
        match error {
            JobError::ShuttingDown => ApiError::unavailable(error.to_string()),
            JobError::DeadlineExceeded => ApiError::timed_out(error.to_string()),
            JobError::Memory { needed, budget } => ApiError::memory_admission(needed, budget),
            error => ApiError::server(error.to_string()),
        }
    }
}

/// Why the server could not start.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error(transparent)]
    Runtime(#[from] oxlm_runtime::RuntimeError),
    #[error(transparent)]
    Load(#[from] oxlm_models::LoadError),
    #[error("loading the adapter: {0}")]
    Adapter(#[from] oxlm_models::lora::AdapterError),
    #[error(transparent)]
    AdapterStore(#[from] AdapterStoreError),
    /// Caches of the asked precision cannot be made for this model (heads too narrow for 8-bit
    /// groups): refused at start rather than failing every request.
    #[error("--kv-cache: {0}")]
    KvCache(#[source] oxlm_models::ForwardError),
    #[error(transparent)]
    Budget(#[from] oxlm_runtime::memory::BudgetError),
    #[error("cannot listen on {address}: {source}")]
    Bind {
        address: String,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

/// Whether `path` is one of the Anthropic Messages API's routes.
pub(crate) fn is_anthropic_route(path: &str) -> bool {
    path == "/v1/messages" || path.starts_with("/v1/messages/")
}
