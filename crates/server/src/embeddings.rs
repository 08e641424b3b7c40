//! `POST /v1/embeddings`: OpenAI's embeddings API over the runtime's [`Embedder`], for embedding
//! checkpoints (Qwen3-Embedding). `input` is a string, a list of strings, a list of token ids or
//! a list of such lists; `encoding_format` is `float` or `base64` (little-endian f32s);
//! `dimensions` keeps a vector's first values and normalizes them again. An extension,
//! `prompt_name`, puts one of the model's sentence-transformers prompts (Qwen3-Embedding's
//! `query` instruction) before each text.
//!
//! Texts are tokenized off the executor; the forward passes run on the generation thread
//! ([`Worker::run`](crate::worker::Worker::run)), between its decoding steps.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Extension, State};
use axum::response::{IntoResponse, Response};
use base64::Engine;
use oxlm_runtime::embed::{EmbedError, EmbedInput, Embedder};
use serde_json::{json, Map, Value};

use crate::api::{blocking, read_body, Json};
use crate::error::ApiError;
use crate::log::TokenCounts;
use crate::AppState;

/// A request, checked.
struct EmbeddingRequest {
    inputs: Vec<EmbedInput>,
    base64: bool,
    dimensions: Option<usize>,
    prompt_name: Option<String>,
}

pub(crate) async fn embeddings(
    State(state): State<Arc<AppState>>,
    Extension(tokens): Extension<TokenCounts>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let result = async {
        let request = EmbeddingRequest::parse(&read_body(body)?)?;
        let st = state.clone();
        let (inputs, prompt_name) = (request.inputs, request.prompt_name);
        let dimensions = request.dimensions;
        let ids = blocking(move || {
            let embedder = embedder(&st)?;
            let ids = embedder
                .tokenize(&st.model.tokenizer, &inputs, prompt_name.as_deref())
                .map_err(api_error)?;
            embedder
                .check(st.model.model.info(), &ids, dimensions)
                .map_err(api_error)?;
            Ok(ids)
        })
        .await?;
        let prompt_tokens: usize = ids.iter().map(Vec::len).sum();
        tokens.start(prompt_tokens);
        let st = state.clone();
        let vectors = state
            .worker
            .run(move |model| {
                embedder(&st)?
                    .embed(model, &ids, dimensions)
                    .map_err(api_error)
            })
            .await??;
        let data: Vec<Value> = vectors
            .iter()
            .enumerate()
            .map(|(index, vector)| {
                let embedding = if request.base64 {
                    base64_floats(vector)
                } else {
                    float_list(vector)
                };
                json!({"object": "embedding", "index": index, "embedding": embedding})
            })
            .collect();
        Ok::<_, ApiError>(Json(json!({
            "object": "list",
            "data": data,
            "model": state.model_id,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
        })))
    };
    result.await.into_response()
}

/// How the served model embeds, or the 400 of one that cannot.
fn embedder(state: &AppState) -> Result<&Embedder, ApiError> {
    state.embedder.as_ref().map_err(|error| {
        ApiError::invalid_param("model", format!("This model cannot embed: {error}"))
    })
}

/// The API's error for `error`: the request's fault (400, naming its field), else the server's.
fn api_error(error: EmbedError) -> ApiError {
    let message = error.to_string();
    match error {
        EmbedError::NoInput
        | EmbedError::EmptyInput { .. }
        | EmbedError::TokenOutOfRange { .. } => ApiError::invalid_param("input", message),
        EmbedError::TooLong { .. } => ApiError {
            code: Some("context_length_exceeded"),
            ..ApiError::invalid_param("input", message)
        },
        EmbedError::Dimensions { .. } => ApiError::invalid_param("dimensions", message),
        EmbedError::UnknownPrompt { .. } => ApiError::invalid_param("prompt_name", message),
        EmbedError::NotAnEmbeddingModel
        | EmbedError::Config { .. }
        | EmbedError::Load(_)
        | EmbedError::Tokenizer(_)
        | EmbedError::Forward(_) => ApiError::server(message),
    }
}

/// The values as JSON numbers, each written as the shortest decimal that reads back as the same
/// f32 (widened to f64 as they are, they would print twice as many digits).
fn float_list(vector: &[f32]) -> Value {
    let shortest = |x: &f32| x.to_string().parse::<f64>().unwrap_or(f64::from(*x));
    vector.iter().map(shortest).collect()
}

/// The values as OpenAI's `base64` format: little-endian f32s, base64-encoded.
fn base64_floats(vector: &[f32]) -> Value {
    let bytes: Vec<u8> = vector.iter().flat_map(|x| x.to_le_bytes()).collect();
    base64::engine::general_purpose::STANDARD
        .encode(bytes)
        .into()
}

impl EmbeddingRequest {
    fn parse(body: &Map<String, Value>) -> Result<Self, ApiError> {
        let field = |name: &str| body.get(name).filter(|v| !v.is_null());
        let string = |name: &str| match field(name) {
            None => Ok(None),
            Some(Value::String(text)) => Ok(Some(text.clone())),
            Some(_) => Err(ApiError::invalid_param(
                name,
                format!("`{name}` must be a string"),
            )),
        };
        string("model")?;
        let base64 = match string("encoding_format")?.as_deref() {
            None | Some("float") => false,
            Some("base64") => true,
            Some(other) => {
                return Err(ApiError::invalid_param(
                    "encoding_format",
                    format!("`encoding_format` must be `float` or `base64`, not `{other}`"),
                ))
            }
        };
        let dimensions = match field("dimensions") {
            None => None,
            Some(value) => Some(
                value
                    .as_u64()
                    .and_then(|n| usize::try_from(n).ok())
                    .ok_or_else(|| {
                        ApiError::invalid_param(
                            "dimensions",
                            "`dimensions` must be a positive integer",
                        )
                    })?,
            ),
        };
        let input = field("input")
            .ok_or_else(|| ApiError::invalid_param("input", "Request did not contain an input"))?;
        Ok(EmbeddingRequest {
            inputs: inputs(input)?,
            base64,
            dimensions,
            prompt_name: string("prompt_name")?,
        })
    }
}

/// `input` as OpenAI takes it: a string, a list of strings, a list of token ids, or a list of
/// lists of token ids.
fn inputs(input: &Value) -> Result<Vec<EmbedInput>, ApiError> {
    let bad = || {
        ApiError::invalid_param(
            "input",
            "`input` must be a string, a list of strings, a list of token ids or a list of lists \
             of token ids",
        )
    };
    let token_ids = |list: &[Value]| -> Option<Vec<u32>> {
        list.iter()
            .map(|id| id.as_u64().and_then(|id| u32::try_from(id).ok()))
            .collect()
    };
    let list = match input {
        Value::String(text) => return Ok(vec![EmbedInput::Text(text.clone())]),
        Value::Array(list) => list,
        _ => return Err(bad()),
    };
    match list.first() {
        None => Ok(Vec::new()),
        Some(Value::Number(_)) => Ok(vec![EmbedInput::Tokens(token_ids(list).ok_or_else(bad)?)]),
        Some(_) => list
            .iter()
            .map(|item| match item {
                Value::String(text) => Ok(EmbedInput::Text(text.clone())),
                Value::Array(ids) => Ok(EmbedInput::Tokens(token_ids(ids).ok_or_else(bad)?)),
                _ => Err(bad()),
            })
            .collect(),
    }
}
