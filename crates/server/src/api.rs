//! Routes, handlers and response shapes (OpenAI's, with mlx_lm.server's extras).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, PoisonError};

use axum::body::Bytes;
use axum::extract::rejection::{BytesRejection, PathRejection};
use axum::extract::{DefaultBodyLimit, Extension, Path as UrlPath, Request, State};
use axum::http::{header, HeaderValue, Method, StatusCode, Uri};
use axum::middleware::{self, Next};
use axum::response::sse::{Event as SseEvent, KeepAlive};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use oxlm_runtime::adapter_store::{Adapter, AdapterStore, AdapterStoreError};
use oxlm_runtime::reasoning_budget::ReasoningBudget;
use oxlm_runtime::{FinishReason, GenerateOptions, StreamOptions};
use rand::Rng;
use serde_json::{json, Map, Value};

use crate::error::ApiError;
use crate::harmony;
use crate::log::{log_requests, TokenCounts};
use crate::parsers::{OutputParser, Piece, ToolCall, ToolFormat};
use crate::request::{self, Params, Prompt};
use crate::sse::{self, EventSource, Events};
use crate::structured::{self, Markup};
use oxlm_runtime::batcher::Update;

use crate::worker::Running;
use crate::{unix_time, AppState};

type Shared = State<Arc<AppState>>;

pub(crate) fn router(state: Arc<AppState>) -> Router {
    let api = Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/v1/messages", post(crate::anthropic::messages))
        .route(
            "/v1/messages/count_tokens",
            post(crate::anthropic::count_tokens),
        )
        .route("/v1/responses", post(crate::responses::create))
        .route(
            "/v1/responses/{id}",
            get(crate::responses::retrieve).delete(crate::responses::delete),
        )
        .route("/v1/embeddings", post(crate::embeddings::embeddings))
        .route("/v1/models", get(models))
        .route("/v1/models/{*id}", get(model))
        .route_layer(middleware::from_fn_with_state(state.clone(), authorize));
    Router::new()
        .merge(api)
        // Not behind the API key, as vLLM's are not: probes and scrapers carry none, and none
        // tells anything of a request's content.
        .route("/health", get(health))
        .route("/ready", get(ready))
        .route("/metrics", get(metrics))
        .route("/stats", get(stats))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(state.settings.max_request_bytes))
        .layer(middleware::from_fn_with_state(state.clone(), cors))
        .layer(middleware::from_fn_with_state(state.clone(), log_requests))
        .with_state(state)
}

async fn authorize(State(state): Shared, request: Request, next: Next) -> Response {
    if let Some(key) = &state.settings.api_key {
        let headers = request.headers();
        let bearer = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        // Anthropic's clients send the key as `x-api-key`.
        let api_key = headers.get("x-api-key").and_then(|v| v.to_str().ok());
        let mut given = [bearer, api_key].into_iter().flatten();
        if !given.any(|given| same_secret(given.trim(), key)) {
            return if crate::error::is_anthropic_route(request.uri().path()) {
                crate::anthropic::unauthorized()
            } else {
                ApiError::unauthorized().into_response()
            };
        }
    }
    next.run(request).await
}

/// Compares without stopping at the first difference, so timing does not reveal the key.
fn same_secret(a: &str, b: &str) -> bool {
    a.len() == b.len() && a.bytes().zip(b.bytes()).fold(0, |d, (x, y)| d | (x ^ y)) == 0
}

/// mlx_lm.server's CORS: the allowed origins (any by default), any method and header; a
/// preflight `OPTIONS` is answered 204 on every path.
async fn cors(State(state): Shared, request: Request, next: Next) -> Response {
    let origin = request.headers().get(header::ORIGIN).cloned();
    let mut response = if request.method() == Method::OPTIONS {
        StatusCode::NO_CONTENT.into_response()
    } else {
        next.run(request).await
    };
    let allowed = &state.settings.allowed_origins;
    let headers = response.headers_mut();
    if allowed.iter().any(|o| o == "*") {
        headers.insert(
            header::ACCESS_CONTROL_ALLOW_ORIGIN,
            HeaderValue::from_static("*"),
        );
    } else if let Some(origin) =
        origin.filter(|o| allowed.iter().any(|a| a.as_bytes() == o.as_bytes()))
    {
        headers.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, origin);
        headers.insert(header::VARY, HeaderValue::from_static("Origin"));
    }
    headers.insert(
        header::ACCESS_CONTROL_ALLOW_METHODS,
        HeaderValue::from_static("*"),
    );
    headers.insert(
        header::ACCESS_CONTROL_ALLOW_HEADERS,
        HeaderValue::from_static("*"),
    );
    response
}

async fn not_found(method: Method, uri: Uri) -> ApiError {
    ApiError::not_found(format!("Invalid URL ({method} {})", uri.path()))
}

async fn method_not_allowed(method: Method, uri: Uri) -> Response {
    ApiError::method_not_allowed(format!("Method {method} is not allowed for {}", uri.path()))
        .into_response_for(uri.path())
}

/// Liveness, as mlx_lm.server answers it.
async fn health(State(state): Shared) -> Response {
    health_response(state.worker.is_alive())
}

pub(crate) fn health_response(alive: bool) -> Response {
    if alive {
        Json(json!({"status": "ok"})).into_response()
    } else {
        let body = Json(json!({"status": "unavailable"}));
        (StatusCode::SERVICE_UNAVAILABLE, body).into_response()
    }
}

/// Readiness: false once a shutdown signal has come, while requests in progress drain.
async fn ready(State(state): Shared) -> Response {
    state.readiness().response()
}

async fn metrics(State(state): Shared) -> Response {
    state.telemetry.metrics_response()
}

async fn stats(State(state): Shared) -> Json {
    Json(state.telemetry.stats(state.readiness()))
}

/// The served model; with an adapter directory, also the adapter names a request's `adapters`
/// may give (an extension: OpenAI's model object has no such field).
async fn model_object(state: Arc<AppState>) -> Result<Value, ApiError> {
    let mut model = json!({"id": state.model_id, "object": "model", "created": state.created,
                           "owned_by": "oxlm"});
    if state.adapters.is_some() {
        let names = blocking(move || Ok(adapters(&state)?.names())).await?;
        model["adapters"] = names.into();
    }
    Ok(model)
}

async fn models(State(state): Shared) -> Result<Json, ApiError> {
    let model = model_object(state).await?;
    Ok(Json(json!({"object": "list", "data": [model]})))
}

async fn model(
    State(state): Shared,
    id: Result<UrlPath<String>, PathRejection>,
) -> Result<Json, ApiError> {
    // A path that is not UTF-8 once decoded (`%ff`) gets the API's error, not axum's text.
    let UrlPath(id) = id.map_err(|e| ApiError::invalid(e.body_text()))?;
    let wanted = id.trim_start_matches('/');
    if wanted == state.model_id.trim_start_matches('/') {
        Ok(Json(model_object(state).await?))
    } else {
        Err(ApiError {
            code: Some("model_not_found"),
            ..ApiError::not_found(format!("The model `{id}` does not exist"))
        })
    }
}

/// A JSON response (axum's `Json` needs serde's derive; values are built with `json!` here).
pub(crate) struct Json(pub(crate) Value);

impl IntoResponse for Json {
    fn into_response(self) -> Response {
        let body = self.0.to_string();
        ([(header::CONTENT_TYPE, "application/json")], body).into_response()
    }
}

pub(crate) fn read_body(
    body: Result<Bytes, BytesRejection>,
) -> Result<Map<String, Value>, ApiError> {
    match body {
        Ok(bytes) => request::parse_body(&bytes),
        Err(rejection) if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE => Err(
            ApiError::too_large("The request body is larger than the server accepts"),
        ),
        Err(rejection) => Err(ApiError::invalid(rejection.body_text())),
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Chat,
    Text,
}

/// One request on its way: the ids and settings its responses carry.
struct Exchange {
    state: Arc<AppState>,
    kind: Kind,
    id: String,
    created: u64,
    params: Params,
}

async fn chat_completions(
    State(state): Shared,
    Extension(tokens): Extension<TokenCounts>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let result = async {
        let mut req = request::chat_request(&read_body(body)?, &state.defaults)?;
        let (running, reply) = start_chat(&state, &mut req, &tokens).await?;
        let id = format!("chatcmpl-{}", uuid4());
        let exchange = Exchange::new(state, Kind::Chat, id, req.params);
        respond(exchange, running, reply).await
    };
    result.await.unwrap_or_else(IntoResponse::into_response)
}

async fn completions(
    State(state): Shared,
    Extension(tokens): Extension<TokenCounts>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let result = async {
        let mut req = request::completion_request(&read_body(body)?, &state.defaults)?;
        let st = state.clone();
        let prompt = req.prompt;
        let ids = blocking(move || text_prompt(&st, &prompt)).await?;
        let shaping = StreamOptions::default();
        let running = submit(&state, &mut req.params, ids, "prompt", shaping, &tokens).await?;
        let reply = Reply::new(&state, &req.params, &tokens, None);
        let id = format!("cmpl-{}", uuid4());
        let exchange = Exchange::new(state, Kind::Text, id, req.params);
        respond(exchange, running, reply).await
    };
    result.await.unwrap_or_else(IntoResponse::into_response)
}

/// A chat request on its way: its messages rendered through the chat template and queued
/// (`req.params.max_tokens` cut to what the context holds), and the parser that splits its
/// reply into content, reasoning and tool calls. Every chat API (OpenAI's chat completions
/// and Responses, Anthropic's Messages) starts its requests here.
pub(crate) async fn start_chat(
    state: &Arc<AppState>,
    req: &mut request::ChatRequest,
    tokens: &TokenCounts,
) -> Result<(Running, Reply), ApiError> {
    let st = state.clone();
    let rendered = req.clone();
    let (prompt, shaping) = blocking(move || {
        let prompt = chat_prompt(&st, &rendered)?;
        let markup = Markup {
            format: st.tool_format,
            think: st.think,
            in_reasoning: prompt.in_reasoning,
        };
        let constraint = if structured::enforces(&rendered) {
            Some(structured::constraint(&rendered, &markup, st.grammars()?)?)
        } else {
            None
        };
        let reasoning_budget = rendered
            .thinking_budget
            .and_then(|budget| reasoning_budget(&st, budget, prompt.in_reasoning));
        let shaping = StreamOptions {
            constraint,
            reasoning_budget,
            continues_text: rendered.reply_prefix.is_some(),
            ..StreamOptions::default()
        };
        Ok((prompt, shaping))
    })
    .await?;
    let parser = OutputParser::for_model(
        state.tool_format,
        state.think,
        prompt.in_reasoning,
        req.tools.clone(),
    );
    let running = submit(
        state,
        &mut req.params,
        prompt.ids,
        "messages",
        shaping,
        tokens,
    )
    .await?;
    let mut reply = Reply::new(state, &req.params, tokens, Some(parser));
    if !req.parallel_tool_calls && req.tools.is_some() {
        reply.one_call = Some(running.ender());
    }
    Ok((running, reply))
}

/// Runs CPU work (templates, tokenizers) off the async executor.
pub(crate) async fn blocking<T: Send + 'static>(
    work: impl FnOnce() -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(work)
        .await
        .unwrap_or_else(|e| Err(ApiError::server(format!("request preparation failed: {e}"))))
}

pub(crate) struct ChatPrompt {
    pub(crate) ids: Vec<u32>,
    /// The template opened a reasoning block that the reply continues.
    pub(crate) in_reasoning: bool,
}

pub(crate) fn chat_prompt(
    state: &AppState,
    req: &request::ChatRequest,
) -> Result<ChatPrompt, ApiError> {
    let tokenizer = &state.model.tokenizer;
    let prefix = req.reply_prefix.as_deref().unwrap_or_default();
    let Some(template) = &state.model.chat_template else {
        let text = plain_chat(&req.messages, req.role_mapping.as_ref()) + prefix;
        let ids = tokenizer.encode(&text, true).map_err(internal)?;
        return Ok(ChatPrompt {
            ids,
            in_reasoning: false,
        });
    };
    let mut kwargs = state.settings.chat_template_args.clone();
    kwargs.extend(req.template_kwargs.clone());
    // mlx-lm turns thinking on for models that have think tokens unless told otherwise.
    if state.think.is_some() {
        kwargs.entry("enable_thinking").or_insert(Value::Bool(true));
    }
    let (messages, tools) = if state.tool_format == ToolFormat::Harmony {
        crate::harmony::prepare_template_kwargs(&mut kwargs);
        let tools = req.tools.as_ref().map(crate::harmony::prepare_tools);
        (crate::harmony::prepare_history(&req.messages), tools)
    } else {
        (req.messages.clone(), req.tools.clone())
    };
    let messages = Value::Array(messages);
    let text = template
        .render(&messages, tools.as_ref(), true, &kwargs)
        .map_err(|e| ApiError::invalid_param("messages", e.to_string()))?
        + prefix;
    let ids = tokenizer.encode(&text, false).map_err(internal)?;
    let in_reasoning = state
        .think
        .is_some_and(|(start, end)| text.rfind(start) > text.rfind(end));
    Ok(ChatPrompt { ids, in_reasoning })
}

/// mlx_lm.server's `convert_chat`, for models without a chat template.
fn plain_chat(messages: &[Value], role_mapping: Option<&Map<String, Value>>) -> String {
    let default: Map<String, Value> = [
        ("system", "ASSISTANT's RULE: "),
        ("user", "USER: "),
        ("assistant", "ASSISTANT: "),
        ("stop", "\n"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), Value::from(v)))
    .collect();
    let mapping = role_mapping.unwrap_or(&default);
    let get = |key: &str| mapping.get(key).and_then(Value::as_str).unwrap_or("");
    let mut prompt = String::new();
    for message in messages {
        let role = message["role"].as_str().unwrap_or("");
        let content = message["content"].as_str().unwrap_or("");
        prompt.push_str(get(role));
        prompt.push_str(content);
        prompt.push_str(get("stop"));
    }
    prompt.push_str(get("assistant"));
    prompt.trim_end().to_owned()
}

fn text_prompt(state: &AppState, prompt: &Prompt) -> Result<Vec<u32>, ApiError> {
    match prompt {
        Prompt::Text(text) => state.model.tokenizer.encode(text, true).map_err(internal),
        Prompt::Tokens(ids) => {
            let vocab = state.model.model.info().vocab_size;
            match ids.iter().find(|&&id| id as usize >= vocab) {
                Some(id) => Err(ApiError::invalid_param(
                    "prompt",
                    format!("token id {id} is outside the vocabulary of {vocab} tokens"),
                )),
                None => Ok(ids.clone()),
            }
        }
    }
}

pub(crate) fn internal(e: impl std::fmt::Display) -> ApiError {
    ApiError::server(e.to_string())
}

/// The store of `--adapters-dir`, or the 400 of a server started without one.
fn adapters(state: &AppState) -> Result<std::sync::MutexGuard<'_, AdapterStore>, ApiError> {
    let store = state.adapters.as_ref().ok_or_else(|| {
        ApiError::invalid_param(
            "adapters",
            "This server takes no per-request adapters (start it with --adapters-dir)",
        )
    })?;
    // A load that panicked changed nothing in the store.
    Ok(store.lock().unwrap_or_else(PoisonError::into_inner))
}

/// The `adapters` value that runs a request on the base model alone.
const NO_ADAPTER: &str = "none";

/// The adapters a request runs with: those it names (`a+b` stacks them, their updates added
/// in that order; `none` is the base model alone), else the server's default.
pub(crate) async fn adapters_for(
    state: &Arc<AppState>,
    name: Option<String>,
) -> Result<Vec<Arc<Adapter>>, ApiError> {
    let Some(name) = name else {
        return Ok(state.default_adapter.iter().cloned().collect());
    };
    if name == NO_ADAPTER {
        return Ok(Vec::new());
    }
    let state = state.clone();
    blocking(move || {
        let mut store = adapters(&state)?;
        let model = state.model.model.as_ref();
        (name.split('+'))
            .map(|part| {
                if part == NO_ADAPTER {
                    let why = "`none` stands alone: it cannot be stacked with other adapters";
                    return Err(ApiError::invalid_param("adapters", why));
                }
                // The client is told of the adapter's files by its name; the log says where
                // they are, for whoever has to mend them.
                let adapter = store.get(part, model).inspect_err(|error| {
                    if matches!(error, AdapterStoreError::Unusable { .. }) {
                        state.settings.info(error);
                    }
                })?;
                Ok(adapter)
            })
            .collect()
    })
    .await
}

/// `budget` tokens of reasoning for the model's reasoning markers (none: it does not reason);
/// `in_reasoning` when the prompt opened the block.
fn reasoning_budget(
    state: &AppState,
    budget: usize,
    in_reasoning: bool,
) -> Option<ReasoningBudget> {
    let harmony_markers = (state.tool_format == ToolFormat::Harmony).then_some(harmony::ANALYSIS);
    let (open, close) = state.think.or(harmony_markers)?;
    let encode = |marker: &str| state.model.tokenizer.encode(marker, false).ok();
    Some(ReasoningBudget::new(
        encode(open)?,
        encode(close)?,
        budget,
        in_reasoning,
    ))
}

/// Checks the prompt against the context (cutting `params.max_tokens` to what it holds) and
/// queues it; `prompt_param` names the field an error about it points at. `shaping` holds
/// the reply beside `params` (a grammar, a reasoning budget, a prefilled start it continues).
pub(crate) async fn submit(
    state: &Arc<AppState>,
    params: &mut Params,
    prompt: Vec<u32>,
    prompt_param: &str,
    shaping: StreamOptions,
    tokens: &TokenCounts,
) -> Result<Running, ApiError> {
    if prompt.is_empty() {
        return Err(ApiError::invalid_param(prompt_param, "The prompt is empty"));
    }
    if let Some(limit) = state.model.model.info().max_context {
        if prompt.len() > limit {
            return Err(ApiError::context_length(prompt_param, prompt.len(), limit));
        }
        // The last token never goes through the model, so the context holds one more.
        params.max_tokens = params.max_tokens.min(limit + 1 - prompt.len());
    }
    let adapters = adapters_for(state, params.adapter.clone()).await?;
    let options = GenerateOptions {
        max_tokens: params.max_tokens,
        sampler: params.sampler.clone(),
        prefill_step: state.settings.prefill_step,
        kv_cache: state.settings.kv_cache,
        kv_quantization: state.settings.kv_quantization(),
        max_kv_size: None,
    };
    let stream = StreamOptions {
        stop: params.stop.clone(),
        top_logprobs: params.top_logprobs,
        ..shaping
    };
    tokens.start(prompt.len());
    state.worker.submit(prompt, adapters, options, stream)
}

/// Answers as JSON or as a stream, as the request asked.
async fn respond(exchange: Exchange, running: Running, reply: Reply) -> Result<Response, ApiError> {
    if exchange.params.stream {
        Ok(stream_response(exchange, running, reply))
    } else {
        complete_response(exchange, running, reply).await
    }
}

/// Generated output as it comes: pieces of the message, token log-probabilities, counts.
pub(crate) struct Reply {
    /// Chat replies are split into content, reasoning and tool calls; text completions are not.
    parser: Option<OutputParser>,
    tokenizer: oxlm_runtime::tokenizer::Tokenizer,
    logprobs: bool,
    pub(crate) tokens: TokenCounts,
    /// Prompt tokens that came from the prompt cache.
    pub(crate) cached_tokens: usize,
    /// Log-probabilities not yet sent.
    entries: Vec<Value>,
    /// Set at the reply's first tool call where it may make only one: what follows it is
    /// dropped, and the job ends (a [`Running`]'s [`ender`](Running::ender)).
    one_call: Option<Arc<AtomicBool>>,
}

impl Reply {
    pub(crate) fn new(
        state: &AppState,
        params: &Params,
        tokens: &TokenCounts,
        parser: Option<OutputParser>,
    ) -> Self {
        Reply {
            parser,
            tokenizer: state.model.tokenizer.clone(),
            logprobs: params.logprobs,
            tokens: tokens.clone(),
            cached_tokens: 0,
            entries: Vec::new(),
            one_call: None,
        }
    }

    /// The pieces text released at the end of generation completes.
    pub(crate) fn text(&mut self, text: &str) -> Vec<Piece> {
        let pieces = match &mut self.parser {
            Some(parser) => parser.push(text),
            None if text.is_empty() => Vec::new(),
            None => vec![Piece::Content(text.to_owned())],
        };
        self.up_to_one_call(pieces)
    }

    /// `pieces` up to the reply's first tool call where it may make only one; none after it.
    fn up_to_one_call(&mut self, pieces: Vec<Piece>) -> Vec<Piece> {
        let Some(ended) = &self.one_call else {
            return pieces;
        };
        let mut kept = Vec::with_capacity(pieces.len());
        for piece in pieces {
            if ended.load(Ordering::Relaxed) {
                break;
            }
            if matches!(piece, Piece::ToolCall(_)) {
                ended.store(true, Ordering::Relaxed);
            }
            kept.push(piece);
        }
        kept
    }

    /// Counts a generated token; the pieces its text completes.
    pub(crate) fn token(
        &mut self,
        id: u32,
        logprob: f32,
        top: &[(u32, f32)],
        text: &str,
    ) -> Vec<Piece> {
        self.tokens.add_completion_token();
        if self.logprobs {
            let mut entry = self.token_info(id, logprob);
            entry["top_logprobs"] = top.iter().map(|&(t, l)| self.token_info(t, l)).collect();
            self.entries.push(entry);
        }
        self.text(text)
    }

    /// What the parser still held once generation ended.
    pub(crate) fn finish(&mut self) -> Vec<Piece> {
        let pieces = self
            .parser
            .as_mut()
            .map(OutputParser::finish)
            .unwrap_or_default();
        self.up_to_one_call(pieces)
    }

    /// OpenAI's token entry, with mlx_lm.server's `id`.
    fn token_info(&self, id: u32, logprob: f32) -> Value {
        let token = self.tokenizer.decode(&[id], false).unwrap_or_default();
        json!({"id": id, "token": token, "logprob": logprob, "bytes": token.as_bytes()})
    }

    /// The `logprobs` of a choice for the entries gathered since the last call.
    fn take_logprobs(&mut self, kind: Kind) -> Value {
        if !self.logprobs {
            return Value::Null;
        }
        let entries = std::mem::take(&mut self.entries);
        match kind {
            Kind::Chat => json!({"content": entries}),
            // OpenAI's legacy completion fields, and mlx_lm.server's `content` list.
            Kind::Text => json!({
                "tokens": entries.iter().map(|e| e["token"].clone()).collect::<Vec<_>>(),
                "token_logprobs": entries.iter().map(|e| e["logprob"].clone()).collect::<Vec<_>>(),
                "top_logprobs": entries.iter().map(|e| {
                    e["top_logprobs"].as_array().map(|top| top.iter()
                        .map(|t| (t["token"].as_str().unwrap_or("").to_owned(), t["logprob"].clone()))
                        .collect::<Map<_, _>>())
                }).collect::<Vec<_>>(),
                "content": entries,
            }),
        }
    }

    fn usage(&self) -> Value {
        let (prompt_tokens, completion_tokens) = (self.tokens.prompt(), self.tokens.completion());
        json!({
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        })
    }
}

/// The `finish_reason` a client sees.
fn finish_reason(reason: FinishReason, tool_calls: bool) -> &'static str {
    match reason {
        FinishReason::Stop if tool_calls => "tool_calls",
        reason => reason.as_str(),
    }
}

fn tool_call_json(call: &ToolCall, format: ToolFormat, index: Option<usize>) -> Value {
    let mut value = json!({
        "id": format.call_id("call_"),
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    });
    if let Some(index) = index {
        value["index"] = index.into();
    }
    value
}

/// A chat message (or stream delta) from reply pieces. Reasoning goes under both
/// `reasoning_content` (the field most clients read) and `reasoning` (mlx_lm.server's name).
fn message(
    pieces: &[Piece],
    format: ToolFormat,
    first_tool_index: Option<usize>,
    full: bool,
) -> Value {
    let mut content = String::new();
    let mut reasoning = String::new();
    let mut calls = Vec::new();
    for piece in pieces {
        match piece {
            Piece::Content(text) => content.push_str(text),
            Piece::Reasoning(text) => reasoning.push_str(text),
            Piece::ToolCall(call) => {
                let index = first_tool_index.map(|first| first + calls.len());
                calls.push(tool_call_json(call, format, index));
            }
        }
    }
    let mut message = json!({"role": "assistant"});
    if full || !content.is_empty() {
        // A full message always has `content`, null when empty (as the schema asks).
        message["content"] = if content.is_empty() {
            Value::Null
        } else {
            content.into()
        };
    }
    if !reasoning.is_empty() {
        message["reasoning_content"] = reasoning.clone().into();
        message["reasoning"] = reasoning.into();
    }
    if !calls.is_empty() {
        message["tool_calls"] = calls.into();
    }
    message
}

fn text_of(pieces: &[Piece]) -> String {
    pieces
        .iter()
        .map(|p| match p {
            Piece::Content(t) | Piece::Reasoning(t) => t.as_str(),
            Piece::ToolCall(_) => "",
        })
        .collect()
}

impl Exchange {
    fn new(state: Arc<AppState>, kind: Kind, id: String, params: Params) -> Self {
        Exchange {
            state,
            kind,
            id,
            created: unix_time(),
            params,
        }
    }

    fn object(&self, chunk: bool) -> &'static str {
        match (self.kind, chunk) {
            (Kind::Chat, false) => "chat.completion",
            (Kind::Chat, true) => "chat.completion.chunk",
            (Kind::Text, _) => "text_completion",
        }
    }

    /// The fields every response and chunk starts with.
    fn envelope(&self, chunk: bool, choices: Vec<Value>) -> Value {
        json!({
            "id": self.id,
            "object": self.object(chunk),
            "created": self.created,
            "model": self.state.model_id,
            "system_fingerprint": concat!("oxlm-", env!("CARGO_PKG_VERSION")),
            "choices": choices,
        })
    }

    fn choice(&self, body: (&str, Value), logprobs: Value, finish: Option<&str>) -> Value {
        let mut choice = json!({"index": 0});
        choice[body.0] = body.1;
        choice["logprobs"] = logprobs;
        choice["finish_reason"] = finish.into();
        choice
    }
}

async fn complete_response(
    exchange: Exchange,
    mut running: Running,
    mut reply: Reply,
) -> Result<Response, ApiError> {
    let mut pieces = Vec::new();
    let reason = loop {
        match running.next().await {
            Some(Update::Started { cached_tokens }) => reply.cached_tokens = cached_tokens,
            Some(Update::Prefill { .. }) => {}
            Some(Update::Token {
                id,
                logprob,
                top,
                text,
            }) => pieces.extend(reply.token(id, logprob, &top, &text)),
            Some(Update::Text(text)) => pieces.extend(reply.text(&text)),
            Some(Update::Done(result)) => break result?,
            None => return Err(ApiError::server("the generation thread stopped")),
        }
    };
    pieces.extend(reply.finish());
    let tool_calls = pieces.iter().any(|p| matches!(p, Piece::ToolCall(_)));
    let finish = finish_reason(reason, tool_calls);
    let body = match exchange.kind {
        Kind::Chat => {
            let format = exchange.state.tool_format;
            ("message", message(&pieces, format, None, true))
        }
        Kind::Text => ("text", text_of(&pieces).into()),
    };
    let logprobs = reply.take_logprobs(exchange.kind);
    let choice = exchange.choice(body, logprobs, Some(finish));
    let mut response = exchange.envelope(false, vec![choice]);
    response["usage"] = reply.usage();
    Ok(Json(response).into_response())
}

/// Turns generation updates into SSE events: `data: {chunk}` per piece of output, SSE
/// comments while the prompt is processed, the final chunk, usage when asked, `data: [DONE]`.
struct ChunkStream {
    exchange: Exchange,
    running: Running,
    reply: Reply,
    tool_calls: usize,
}

fn stream_response(exchange: Exchange, running: Running, reply: Reply) -> Response {
    let chunks = ChunkStream {
        exchange,
        running,
        reply,
        tool_calls: 0,
    };
    sse::response(chunks, Events::default(), KeepAlive::default())
}

impl EventSource for ChunkStream {
    async fn advance(&mut self, events: &mut Events) {
        match self.running.next().await {
            Some(update) => self.update(update, events),
            None => fail(ApiError::server("the generation thread stopped"), events),
        }
    }
}

impl ChunkStream {
    fn update(&mut self, update: Update, events: &mut Events) {
        match update {
            Update::Started { cached_tokens } => self.reply.cached_tokens = cached_tokens,
            Update::Prefill { done, total } => {
                events.push(SseEvent::default().comment(format!("keepalive {done}/{total}")))
            }
            Update::Token {
                id,
                logprob,
                top,
                text,
            } => {
                let pieces = self.reply.token(id, logprob, &top, &text);
                self.chunk(&pieces, None, events);
            }
            Update::Text(text) => {
                let pieces = self.reply.text(&text);
                self.chunk(&pieces, None, events);
            }
            Update::Done(Ok(reason)) => {
                let pieces = self.reply.finish();
                let tool_calls =
                    self.tool_calls > 0 || pieces.iter().any(|p| matches!(p, Piece::ToolCall(_)));
                self.chunk(&pieces, Some(finish_reason(reason, tool_calls)), events);
                if self.exchange.params.include_usage {
                    let mut usage = self.exchange.envelope(true, Vec::new());
                    usage["usage"] = self.reply.usage();
                    events.push(data(&usage));
                }
                events.push(SseEvent::default().data("[DONE]"));
                events.end();
            }
            Update::Done(Err(e)) => fail(e.into(), events),
        }
    }

    /// Queues a chunk for `pieces`; nothing when there is nothing to say.
    fn chunk(&mut self, pieces: &[Piece], finish: Option<&str>, events: &mut Events) {
        let empty = pieces.iter().all(|p| match p {
            Piece::Content(t) | Piece::Reasoning(t) => t.is_empty(),
            Piece::ToolCall(_) => false,
        });
        if empty && finish.is_none() {
            return;
        }
        let body = match self.exchange.kind {
            Kind::Chat => {
                let format = self.exchange.state.tool_format;
                (
                    "delta",
                    message(pieces, format, Some(self.tool_calls), false),
                )
            }
            Kind::Text => ("text", text_of(pieces).into()),
        };
        self.tool_calls += pieces
            .iter()
            .filter(|p| matches!(p, Piece::ToolCall(_)))
            .count();
        let logprobs = self.reply.take_logprobs(self.exchange.kind);
        let choice = self.exchange.choice(body, logprobs, finish);
        let chunk = self.exchange.envelope(true, vec![choice]);
        events.push(data(&chunk));
    }
}

/// A failure after the stream started: an error object as the last data, then `[DONE]`.
fn fail(error: ApiError, events: &mut Events) {
    events.push(data(&error.body()));
    events.push(SseEvent::default().data("[DONE]"));
    events.end();
}

/// An SSE event of `value` as JSON data.
fn data(value: &Value) -> SseEvent {
    SseEvent::default().data(value.to_string())
}

/// `prefix` and a random UUID's hex digits, as OpenAI's and Anthropic's ids look (`resp_…`,
/// `msg_…`, `call_…`).
pub(crate) fn prefixed_id(prefix: &str) -> String {
    format!("{prefix}{}", uuid4().replace('-', ""))
}

/// A random (version 4) UUID, as mlx_lm.server's ids use.
pub(crate) fn uuid4() -> String {
    let mut b: [u8; 16] = rand::rng().random();
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    let hex: String = b.iter().map(|x| format!("{x:02x}")).collect();
    format!(
        "{}-{}-{}-{}-{}",
        &hex[..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..]
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_and_deltas_carry_reasoning_and_tool_calls() {
        let call = ToolCall {
            name: "get_weather".into(),
            arguments: "{\"city\":\"Paris\"}".into(),
        };
        let pieces = [
            Piece::Reasoning("Weather needed.".into()),
            Piece::ToolCall(call.clone()),
            Piece::ToolCall(call),
        ];
        let full = message(&pieces, ToolFormat::Hermes, None, true);
        assert_eq!(full["content"], Value::Null);
        assert_eq!(full["reasoning_content"], "Weather needed.");
        assert_eq!(full["reasoning"], "Weather needed.");
        let calls = full["tool_calls"].as_array().unwrap();
        assert_eq!(calls.len(), 2);
        assert_eq!(calls[0]["type"], "function");
        assert_eq!(
            calls[0]["function"],
            json!({"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"})
        );
        assert!(calls[0]["id"].as_str().unwrap().starts_with("call_"));
        assert_ne!(calls[0]["id"], calls[1]["id"]);
        assert!(calls[0].get("index").is_none());
        // Stream deltas number calls across chunks and leave out empty content.
        let delta = message(&pieces[1..], ToolFormat::Hermes, Some(3), false);
        // Mistral's templates take nine letters and digits, nothing else.
        let mistral = message(&pieces[1..], ToolFormat::MistralArgs, None, true);
        let id = mistral["tool_calls"][0]["id"].as_str().unwrap();
        assert!(
            id.len() == 9 && id.chars().all(|c| c.is_ascii_alphanumeric()),
            "{id}"
        );
        assert!(delta.get("content").is_none());
        assert_eq!(delta["tool_calls"][0]["index"], 3);
        assert_eq!(delta["tool_calls"][1]["index"], 4);
        assert_eq!(finish_reason(FinishReason::Stop, true), "tool_calls");
        assert_eq!(finish_reason(FinishReason::Length, true), "length");
        assert_eq!(finish_reason(FinishReason::Stop, false), "stop");
    }

    #[test]
    fn plain_chat_follows_mlx_convert_chat() {
        let messages = [
            json!({"role": "system", "content": "Be brief."}),
            json!({"role": "user", "content": "Hi"}),
        ];
        assert_eq!(
            plain_chat(&messages, None),
            "ASSISTANT's RULE: Be brief.\nUSER: Hi\nASSISTANT:"
        );
    }

    #[test]
    fn ids_look_like_uuids() {
        let id = uuid4();
        assert_eq!(id.len(), 36);
        assert_eq!(id.as_bytes()[14], b'4');
        assert!(same_secret("abc", "abc") && !same_secret("abc", "abd") && !same_secret("a", "ab"));
    }
}
