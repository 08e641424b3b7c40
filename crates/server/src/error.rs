//! Errors: the OpenAI API's error objects for clients, and what can stop the server starting.

use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
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
}

impl ApiError {
    fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            status,
            message: message.into(),
            kind,
            param: None,
            code: None,
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

    pub fn server(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", message)
    }

    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::new(StatusCode::SERVICE_UNAVAILABLE, "server_error", message)
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
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = self.body().to_string();
        (
            self.status,
            [(header::CONTENT_TYPE, "application/json")],
            body,
        )
            .into_response()
    }
}

impl From<AdapterStoreError> for ApiError {
    fn from(error: AdapterStoreError) -> Self {
        let message = error.to_string();
        match error {
            AdapterStoreError::NotFound(_) => ApiError {
                code: Some("adapter_not_found"),
                param: Some("adapters".into()),
                ..ApiError::not_found(message)
            },
            AdapterStoreError::OutsideRoot(_) | AdapterStoreError::Unusable { .. } => {
                ApiError::invalid_param("adapters", message)
            }
            AdapterStoreError::Root { .. } | AdapterStoreError::Model(_) => {
                ApiError::server(message)
            }
        }
    }
}

impl From<JobError> for ApiError {
    fn from(error: JobError) -> Self {
        match error {
            JobError::ShuttingDown => ApiError::unavailable(error.to_string()),
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
    #[error("cannot listen on {address}: {source}")]
    Bind {
        address: String,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Io(#[from] std::io::Error),
}
