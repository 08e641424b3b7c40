//! Anthropic's Messages API: `POST /v1/messages` (JSON or SSE stream) and
//! `POST /v1/messages/count_tokens`, over the chat path the OpenAI endpoints share.
//!
//! A request's `system`, `messages` and `tools` become the OpenAI-shaped messages and tools the
//! chat templates take (`tool_use` blocks become `tool_calls`, `tool_result` blocks `tool`
//! messages, `thinking` blocks `reasoning_content`); the reply's reasoning, text and tool calls
//! become `thinking`, `text` and `tool_use` blocks. Errors have Anthropic's shape
//! (`{"type": "error", "error": {"type", "message"}}`), also as a stream's `error` event.

use std::collections::HashMap;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Extension, State};
use axum::response::sse::{Event as SseEvent, KeepAlive};
use axum::response::{IntoResponse, Response};
use oxlm_runtime::batcher::Update;
use oxlm_runtime::sampler::{SamplerConfig, MIN_TEMPERATURE};
use oxlm_runtime::tokenizer::Tokenizer;
use oxlm_runtime::FinishReason;
use serde_json::{json, Map, Value};

use crate::api::{blocking, chat_prompt, prefixed_id, read_body, start_chat, Json, Reply};
use crate::error::ApiError;
use crate::log::TokenCounts;
use crate::parsers::{Piece, ToolCall, ToolFormat};
use crate::request::{check_tool_choice, ChatRequest, Defaults, Fields, Params, ToolChoice};
use crate::sse::{self, EventSource, Events};
use crate::worker::Running;
use crate::AppState;

pub(crate) async fn messages(
    State(state): State<Arc<AppState>>,
    Extension(tokens): Extension<TokenCounts>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let result = async {
        let mut req = chat_request(&read_body(body)?, &state.defaults, Purpose::Generate)?;
        let (running, reply) = start_chat(&state, &mut req, &tokens).await?;
        let blocks = Blocks {
            format: state.tool_format,
            ..Blocks::default()
        };
        let generation = Generation {
            id: prefixed_id("msg_"),
            state,
            running,
            reply,
            blocks,
            ids: Vec::new(),
            stop_sequences: req.params.stop,
        };
        if req.params.stream {
            Ok(stream_response(generation))
        } else {
            complete_response(generation).await
        }
    };
    result
        .await
        .unwrap_or_else(ApiError::into_anthropic_response)
}

/// The prompt's length, as `/v1/messages` would render the same body.
pub(crate) async fn count_tokens(
    State(state): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let result = async {
        let req = chat_request(&read_body(body)?, &state.defaults, Purpose::Count)?;
        let prompt = blocking(move || chat_prompt(&state, &req)).await?;
        Ok::<_, ApiError>(Json(json!({"input_tokens": prompt.ids.len()})).into_response())
    };
    result
        .await
        .unwrap_or_else(ApiError::into_anthropic_response)
}

/// The 401 of the Anthropic routes, in Anthropic's words and shape.
pub(crate) fn unauthorized() -> Response {
    ApiError {
        message: "invalid x-api-key: send `x-api-key: <key>` (or `Authorization: Bearer <key>`) \
                  with the key the server was started with"
            .into(),
        ..ApiError::unauthorized()
    }
    .into_anthropic_response()
}

/// What a request body is read for: `count_tokens` bodies have no `max_tokens`.
#[derive(Clone, Copy)]
enum Purpose {
    Generate,
    Count,
}

/// A 400 for the field at `path`, which its message starts with, as Anthropic's do
/// (`messages.0.content.1.type: ...`).
fn invalid(path: &str, problem: impl std::fmt::Display) -> ApiError {
    ApiError::invalid_param(path, format!("{path}: {problem}"))
}

fn chat_request(
    body: &Map<String, Value>,
    defaults: &Defaults,
    purpose: Purpose,
) -> Result<ChatRequest, ApiError> {
    let fields = Fields(body);
    fields.string("model")?;
    // Accepted, as Anthropic's `user_id` is, for nothing here to use.
    fields.object("metadata")?;
    let max_tokens = match (fields.uint("max_tokens", 1)?, purpose) {
        (_, Purpose::Count) => defaults.max_tokens,
        (Some(n), Purpose::Generate) => n.try_into().unwrap_or(usize::MAX),
        (None, Purpose::Generate) => return Err(invalid("max_tokens", "Field required")),
    };
    let sampler = SamplerConfig {
        // Anthropic's range; 0 is greedy, as everywhere in this server.
        temperature: fields
            .number_or_zero("temperature", "greedy", MIN_TEMPERATURE, 1.0)?
            .unwrap_or(defaults.temperature),
        top_p: fields.number("top_p", 0.0, 1.0)?.unwrap_or(defaults.top_p),
        top_k: fields
            .uint("top_k", 0)?
            .map_or(defaults.top_k, |k| k as usize),
        min_p: defaults.min_p,
        repetition_penalty: defaults.repetition_penalty,
        xtc_special_tokens: defaults.xtc_special_tokens.clone(),
        ..SamplerConfig::default()
    };
    let params = Params {
        stream: fields.bool("stream")?.unwrap_or(false),
        include_usage: false,
        max_tokens,
        sampler,
        stop: fields.stop("stop_sequences")?,
        logprobs: false,
        top_logprobs: 0,
        adapter: None,
    };
    let (tool_choice, parallel_tool_calls) = tool_choice(fields.get("tool_choice"))?;
    let tools = tools(fields.get("tools"))?
        .filter(|tools| !tools.is_empty() && tool_choice != ToolChoice::None)
        .map(Value::Array);
    check_tool_choice(&tool_choice, tools.as_ref(), "tool_choice")
        .map_err(|e| invalid("tool_choice", e.message))?;
    let (thinking, thinking_budget) = thinking_settings(fields.get("thinking"))?;
    let mut messages = template_messages(fields.get("system"), fields.get("messages"))?;
    let reply_prefix = reply_prefix(&mut messages, thinking, &tool_choice)?;
    let mut template_kwargs = Map::new();
    // A prefilled reply is the answer itself, not reasoning the template would open.
    if let Some(enabled) = thinking.or(reply_prefix.as_ref().map(|_| false)) {
        template_kwargs.insert("enable_thinking".into(), enabled.into());
    }
    Ok(ChatRequest {
        params,
        messages,
        tools,
        template_kwargs,
        role_mapping: None,
        tool_choice,
        response_format: Default::default(),
        reply_prefix,
        parallel_tool_calls,
        thinking_budget,
    })
}

/// Anthropic's prefill: a last assistant message of text alone is the start of the reply,
/// which the model continues (taken out of `messages`); empty, it is no start at all. As
/// Anthropic, it may not end in whitespace, and it cannot go with thinking or a forced tool
/// call, which would each have to come before it.
fn reply_prefix(
    messages: &mut Vec<Value>,
    thinking: Option<bool>,
    tool_choice: &ToolChoice,
) -> Result<Option<String>, ApiError> {
    let Some(last) = messages.last() else {
        return Ok(None);
    };
    let plain_text = last.get("tool_calls").is_none() && last.get("reasoning_content").is_none();
    if last["role"] != "assistant" || !plain_text {
        return Ok(None);
    }
    let path = format!("messages.{}.content", messages.len() - 1);
    let text = last["content"].as_str().unwrap_or_default().to_owned();
    if text.trim_end() != text {
        return Err(invalid(
            &path,
            "final assistant content cannot end with trailing whitespace",
        ));
    }
    if thinking == Some(true) {
        return Err(invalid(
            &path,
            "a prefilled reply (a final assistant message) cannot be used with thinking",
        ));
    }
    if matches!(tool_choice, ToolChoice::Required | ToolChoice::Function(_)) {
        return Err(invalid(
            &path,
            "a prefilled reply (a final assistant message) cannot be used with a tool_choice \
             that forces a tool call",
        ));
    }
    messages.pop();
    Ok((!text.is_empty()).then_some(text))
}

/// `system` and `messages` as the chat templates take them: OpenAI's messages, content as text.
fn template_messages(
    system: Option<&Value>,
    messages: Option<&Value>,
) -> Result<Vec<Value>, ApiError> {
    let mut out = Vec::new();
    match system {
        None => {}
        Some(Value::String(text)) => out.push(json!({"role": "system", "content": text})),
        Some(Value::Array(blocks)) => {
            let text = text_of_blocks(blocks, "system")?;
            out.push(json!({"role": "system", "content": text}));
        }
        Some(_) => {
            return Err(invalid(
                "system",
                "must be a string or a list of text blocks",
            ))
        }
    }
    let messages = match messages {
        Some(Value::Array(list)) if !list.is_empty() => list,
        Some(Value::Array(_)) => {
            return Err(invalid("messages", "at least one message is required"))
        }
        Some(_) => return Err(invalid("messages", "must be a list of messages")),
        None => return Err(invalid("messages", "Field required")),
    };
    // The names of the tools called so far, by call id: a template may show a result's tool.
    let mut tool_names = HashMap::new();
    for (i, message) in messages.iter().enumerate() {
        let path = format!("messages.{i}");
        let role = required_str(message, "role", &path)?;
        if !matches!(role, "user" | "assistant") {
            return Err(invalid(
                &format!("{path}.role"),
                format!("`{role}` is not a role of the Messages API (\"user\" or \"assistant\")"),
            ));
        }
        let blocks = match message.get("content") {
            Some(Value::String(text)) => {
                out.push(json!({"role": role, "content": text}));
                continue;
            }
            Some(Value::Array(blocks)) if !blocks.is_empty() => blocks,
            Some(Value::Array(_)) => {
                return Err(invalid(
                    &format!("{path}.content"),
                    "at least one content block is required",
                ))
            }
            Some(_) => {
                return Err(invalid(
                    &format!("{path}.content"),
                    "must be a string or a list of content blocks",
                ))
            }
            None => return Err(invalid(&format!("{path}.content"), "Field required")),
        };
        if role == "user" {
            user_turn(blocks, &path, &tool_names, &mut out)?;
        } else {
            out.push(assistant_turn(blocks, &path, &mut tool_names)?);
        }
    }
    Ok(out)
}

/// A user turn: its text as a user message, each `tool_result` as a `tool` message, in order.
fn user_turn(
    blocks: &[Value],
    path: &str,
    tool_names: &HashMap<String, String>,
    out: &mut Vec<Value>,
) -> Result<(), ApiError> {
    let mut text: Option<String> = None;
    for (j, block) in blocks.iter().enumerate() {
        let path = format!("{path}.content.{j}");
        match block_type(block, &path, &["text", "tool_result"])? {
            "text" => text
                .get_or_insert_default()
                .push_str(required_str(block, "text", &path)?),
            _ => {
                if let Some(text) = text.take() {
                    out.push(json!({"role": "user", "content": text}));
                }
                let id = required_str(block, "tool_use_id", &path)?;
                let mut content = match block.get("content") {
                    None | Some(Value::Null) => String::new(),
                    Some(Value::String(text)) => text.clone(),
                    Some(Value::Array(blocks)) => {
                        text_of_blocks(blocks, &format!("{path}.content"))?
                    }
                    Some(_) => {
                        return Err(invalid(
                            &format!("{path}.content"),
                            "must be a string or a list of text blocks",
                        ))
                    }
                };
                // No template has a place for a failed call: its result says so itself.
                let is_error = match block.get("is_error") {
                    None | Some(Value::Null) => false,
                    Some(Value::Bool(is_error)) => *is_error,
                    Some(_) => {
                        return Err(invalid(&format!("{path}.is_error"), "must be a boolean"))
                    }
                };
                if is_error {
                    content = match content.as_str() {
                        "" => "Error".to_owned(),
                        _ => format!("Error: {content}"),
                    };
                }
                let mut message = json!({"role": "tool", "tool_call_id": id, "content": content});
                if let Some(name) = tool_names.get(id) {
                    message["name"] = name.as_str().into();
                }
                out.push(message);
            }
        }
    }
    if let Some(text) = text {
        out.push(json!({"role": "user", "content": text}));
    }
    Ok(())
}

/// An assistant turn: text as content, thinking as `reasoning_content` (for the templates that
/// show it), `tool_use` blocks as `tool_calls` with their input as the arguments object.
fn assistant_turn(
    blocks: &[Value],
    path: &str,
    tool_names: &mut HashMap<String, String>,
) -> Result<Value, ApiError> {
    let mut content = String::new();
    let mut reasoning: Option<String> = None;
    let mut calls = Vec::new();
    for (j, block) in blocks.iter().enumerate() {
        let path = format!("{path}.content.{j}");
        let accepted = ["text", "thinking", "redacted_thinking", "tool_use"];
        match block_type(block, &path, &accepted)? {
            "text" => content.push_str(required_str(block, "text", &path)?),
            "thinking" => reasoning
                .get_or_insert_default()
                .push_str(required_str(block, "thinking", &path)?),
            "tool_use" => {
                let id = required_str(block, "id", &path)?;
                let name = required_str(block, "name", &path)?;
                let input = match block.get("input") {
                    Some(input @ Value::Object(_)) => input.clone(),
                    Some(_) => return Err(invalid(&format!("{path}.input"), "must be an object")),
                    None => return Err(invalid(&format!("{path}.input"), "Field required")),
                };
                tool_names.insert(id.to_owned(), name.to_owned());
                calls.push(json!({"id": id, "type": "function",
                                  "function": {"name": name, "arguments": input}}));
            }
            // Encrypted reasoning: nothing a template could show.
            _ => {}
        }
    }
    let mut message = json!({"role": "assistant", "content": content});
    if let Some(reasoning) = reasoning {
        message["reasoning_content"] = reasoning.into();
    }
    if !calls.is_empty() {
        message["tool_calls"] = calls.into();
    }
    Ok(message)
}

/// The `type` of the block at `path`, one of those it may have there.
fn block_type<'a>(block: &'a Value, path: &str, accepted: &[&str]) -> Result<&'a str, ApiError> {
    let kind = required_str(block, "type", path)?;
    if accepted.contains(&kind) {
        Ok(kind)
    } else {
        Err(invalid(
            &format!("{path}.type"),
            format!(
                "`{kind}` blocks are not accepted here (accepted: {})",
                accepted.join(", ")
            ),
        ))
    }
}

/// The text of a list of text blocks (`system`, a tool result's content), joined.
fn text_of_blocks(blocks: &[Value], path: &str) -> Result<String, ApiError> {
    blocks
        .iter()
        .enumerate()
        .map(|(i, block)| {
            let path = format!("{path}.{i}");
            block_type(block, &path, &["text"])?;
            required_str(block, "text", &path)
        })
        .collect()
}

/// `object[key]`, a string it must have.
fn required_str<'a>(object: &'a Value, key: &str, path: &str) -> Result<&'a str, ApiError> {
    let path = format!("{path}.{key}");
    match object.get(key) {
        Some(Value::String(text)) => Ok(text),
        None | Some(Value::Null) => Err(invalid(&path, "Field required")),
        Some(_) => Err(invalid(&path, "must be a string")),
    }
}

/// Anthropic's tools (`{name, description, input_schema}`) as OpenAI's function tools.
fn tools(value: Option<&Value>) -> Result<Option<Vec<Value>>, ApiError> {
    let Some(value) = value else {
        return Ok(None);
    };
    let Value::Array(list) = value else {
        return Err(invalid("tools", "must be a list of tools"));
    };
    let tool = |(i, tool): (usize, &Value)| {
        let path = format!("tools.{i}");
        match tool.get("type").and_then(Value::as_str) {
            None | Some("custom") => {}
            // Anthropic's server tools (web search, code execution, ...) run on Anthropic's side.
            Some(kind) => {
                return Err(invalid(
                    &format!("{path}.type"),
                    format!("`{kind}` tools are not supported, only custom tools"),
                ))
            }
        }
        let mut function = json!({"name": required_str(tool, "name", &path)?});
        match tool.get("description") {
            None | Some(Value::Null) => {}
            Some(Value::String(description)) => {
                function["description"] = description.as_str().into()
            }
            Some(_) => return Err(invalid(&format!("{path}.description"), "must be a string")),
        }
        function["parameters"] = match tool.get("input_schema") {
            Some(schema @ Value::Object(_)) => schema.clone(),
            Some(_) => {
                return Err(invalid(
                    &format!("{path}.input_schema"),
                    "must be a JSON Schema object",
                ))
            }
            None => return Err(invalid(&format!("{path}.input_schema"), "Field required")),
        };
        Ok(json!({"type": "function", "function": function}))
    };
    list.iter()
        .enumerate()
        .map(tool)
        .collect::<Result<_, _>>()
        .map(Some)
}

/// Anthropic's `tool_choice` (`auto`, `any`, `tool` with a `name`, `none`) as OpenAI's, and
/// whether the reply may make several calls (not with `disable_parallel_tool_use`).
fn tool_choice(value: Option<&Value>) -> Result<(ToolChoice, bool), ApiError> {
    let Some(choice) = value else {
        return Ok((ToolChoice::Auto, true));
    };
    let disable_parallel = match choice {
        Value::Object(fields) => Fields(fields).bool("disable_parallel_tool_use")?,
        _ => None,
    };
    let choice = match choice.get("type").and_then(Value::as_str) {
        Some("auto") => ToolChoice::Auto,
        Some("any") => ToolChoice::Required,
        Some("none") => ToolChoice::None,
        Some("tool") => {
            ToolChoice::Function(required_str(choice, "name", "tool_choice")?.to_owned())
        }
        _ => {
            return Err(invalid(
                "tool_choice.type",
                "must be \"auto\", \"any\", \"tool\" or \"none\"",
            ))
        }
    };
    Ok((choice, !disable_parallel.unwrap_or(false)))
}

/// The chat template's `enable_thinking` that `thinking` asks for, and the most tokens the
/// thinking may take (`budget_tokens`, which `enabled` may give). Anthropic asks for 1,024 at
/// least; a local model's reasoning may be held to less.
fn thinking_settings(value: Option<&Value>) -> Result<(Option<bool>, Option<usize>), ApiError> {
    let Some(thinking) = value else {
        return Ok((None, None));
    };
    match thinking.get("type").and_then(Value::as_str) {
        Some("enabled") => {
            let budget = match thinking.get("budget_tokens") {
                None | Some(Value::Null) => None,
                Some(budget) => match budget.as_u64() {
                    Some(n) if n >= 1 => Some(n as usize),
                    _ => {
                        return Err(invalid(
                            "thinking.budget_tokens",
                            "must be an integer of at least 1",
                        ))
                    }
                },
            };
            Ok((Some(true), budget))
        }
        Some("adaptive") => Ok((Some(true), None)),
        Some("disabled") => Ok((Some(false), None)),
        _ => Err(invalid(
            "thinking.type",
            "must be \"enabled\", \"adaptive\" or \"disabled\"",
        )),
    }
}

/// A reply on its way: the generation's updates made into content blocks.
struct Generation {
    id: String,
    state: Arc<AppState>,
    running: Running,
    reply: Reply,
    blocks: Blocks,
    /// The generated token ids, end of sequence left out: the stop sequence that ended the
    /// reply is found in their text.
    ids: Vec<u32>,
    stop_sequences: Vec<String>,
}

/// What one update of the generation gave.
enum Progress {
    /// The request left the queue: the prompt cache's share of the prompt is known.
    Started,
    /// Part of the prompt went through the model.
    Prefill,
    /// Output: the stream events of the blocks it started, extended or closed.
    Output(Vec<Value>),
    /// The end, the last blocks closed.
    Done {
        events: Vec<Value>,
        stop_reason: &'static str,
        stop_sequence: Option<String>,
    },
}

impl Generation {
    async fn next(&mut self) -> Result<Progress, ApiError> {
        let mut events = Vec::new();
        let pieces = match self.running.next().await {
            Some(Update::Started { cached_tokens }) => {
                self.reply.cached_tokens = cached_tokens;
                return Ok(Progress::Started);
            }
            Some(Update::Prefill { .. }) => return Ok(Progress::Prefill),
            Some(Update::Token {
                id,
                logprob,
                top,
                text,
            }) => {
                if !self.state.model.eos_ids.contains(&id) {
                    self.ids.push(id);
                }
                self.reply.token(id, logprob, &top, &text)
            }
            Some(Update::Text(text)) => self.reply.text(&text),
            Some(Update::Done(result)) => {
                let finish = result?;
                for piece in self.reply.finish() {
                    self.blocks.add(piece, &mut events);
                }
                self.blocks.close(&mut events);
                let stop_sequence = match finish {
                    FinishReason::Stop => {
                        matched_stop(&self.state.model.tokenizer, &self.ids, &self.stop_sequences)
                    }
                    FinishReason::Length | FinishReason::Cancelled => None,
                };
                let stop_reason =
                    stop_reason(finish, stop_sequence.is_some(), self.blocks.has_tool_use());
                return Ok(Progress::Done {
                    events,
                    stop_reason,
                    stop_sequence,
                });
            }
            None => return Err(ApiError::server("the generation thread stopped")),
        };
        for piece in pieces {
            self.blocks.add(piece, &mut events);
        }
        Ok(Progress::Output(events))
    }

    /// The message object with `content`, as the reply stands.
    fn message(&self, content: Vec<Value>, stop_reason: Value, stop_sequence: Value) -> Value {
        json!({
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.state.model_id,
            "content": content,
            "stop_reason": stop_reason,
            "stop_sequence": stop_sequence,
            "usage": self.usage(),
        })
    }

    /// Anthropic's usage: `input_tokens` are the prompt tokens the prompt cache did not have.
    fn usage(&self) -> Value {
        let cached = self.reply.cached_tokens;
        json!({
            "input_tokens": self.reply.tokens.prompt().saturating_sub(cached),
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached,
            "output_tokens": self.reply.tokens.completion(),
        })
    }
}

/// Anthropic's `stop_reason`; a reply that calls tools waits for their results.
fn stop_reason(finish: FinishReason, stop_sequence: bool, tool_use: bool) -> &'static str {
    match finish {
        FinishReason::Length => "max_tokens",
        _ if tool_use => "tool_use",
        _ if stop_sequence => "stop_sequence",
        FinishReason::Stop | FinishReason::Cancelled => "end_turn",
    }
}

/// The stop sequence that ended a generation of `ids`, if one did: generation stops at the
/// first token that completes one, so it is the one that starts first in their text (the
/// shortest, of two that start together). The output leaves it out, so it is looked for in the
/// tokens' text, detokenized as generation did.
fn matched_stop(tokenizer: &Tokenizer, ids: &[u32], stops: &[String]) -> Option<String> {
    if stops.is_empty() {
        return None;
    }
    let mut detokenizer = tokenizer.detokenizer().ok()?;
    let mut text = String::new();
    for &id in ids {
        text.push_str(&detokenizer.push(id).ok()?);
    }
    text.push_str(&detokenizer.finish().ok()?);
    stops
        .iter()
        .filter(|stop| !stop.is_empty())
        .filter_map(|stop| Some((text.find(stop.as_str())?, stop.len(), stop)))
        .min()
        .map(|(_, _, stop)| stop.clone())
}

/// The content blocks of a reply, made from its pieces in order: consecutive text (or
/// reasoning) is one block, each tool call a block of its own. Each change is also told as
/// the stream events that make it.
#[derive(Default)]
struct Blocks {
    content: Vec<Value>,
    /// Whether the last block may still grow.
    open: bool,
    /// The model's tool-call format, which its calls' ids must suit.
    format: ToolFormat,
}

impl Blocks {
    fn add(&mut self, piece: Piece, events: &mut Vec<Value>) {
        // A block's type names its text field and its delta (`text_delta`, `thinking_delta`).
        let (kind, text) = match piece {
            Piece::Content(text) => ("text", text),
            Piece::Reasoning(text) => ("thinking", text),
            Piece::ToolCall(call) => return self.add_tool_use(call, events),
        };
        if text.is_empty() {
            return;
        }
        if !self.open || self.content.last().is_some_and(|last| last["type"] != kind) {
            let block = match kind {
                "text" => json!({"type": "text", "text": ""}),
                // No signature: there is nothing to verify reasoning against.
                _ => json!({"type": "thinking", "thinking": "", "signature": ""}),
            };
            self.start(block, events);
        }
        let index = self.content.len() - 1;
        if let Some(Value::String(so_far)) = self.content[index].get_mut(kind) {
            so_far.push_str(&text);
        }
        let mut delta = json!({"type": format!("{kind}_delta")});
        delta[kind] = text.into();
        events.push(json!({"type": "content_block_delta", "index": index, "delta": delta}));
    }

    /// A `tool_use` block, whole: its input is known once the call is.
    fn add_tool_use(&mut self, call: ToolCall, events: &mut Vec<Value>) {
        let id = self.format.call_id("toolu_");
        self.start(
            json!({"type": "tool_use", "id": id, "name": call.name, "input": {}}),
            events,
        );
        let input = tool_input(&call.arguments);
        let index = self.content.len() - 1;
        events.push(json!({"type": "content_block_delta", "index": index,
            "delta": {"type": "input_json_delta", "partial_json": input.to_string()}}));
        self.content[index]["input"] = input;
        self.close(events);
    }

    fn start(&mut self, block: Value, events: &mut Vec<Value>) {
        self.close(events);
        events.push(
            json!({"type": "content_block_start", "index": self.content.len(), "content_block": block}),
        );
        self.content.push(block);
        self.open = true;
    }

    /// Closes the last block, if it is open.
    fn close(&mut self, events: &mut Vec<Value>) {
        if std::mem::take(&mut self.open) {
            let index = self.content.len() - 1;
            events.push(json!({"type": "content_block_stop", "index": index}));
        }
    }

    fn has_tool_use(&self) -> bool {
        self.content.iter().any(|block| block["type"] == "tool_use")
    }
}

/// A call's arguments (JSON text) as a `tool_use` block's `input`. Text that is not JSON, which
/// a model may still write, is kept as it is rather than lost.
fn tool_input(arguments: &str) -> Value {
    serde_json::from_str(arguments).unwrap_or_else(|_| arguments.into())
}

async fn complete_response(mut generation: Generation) -> Result<Response, ApiError> {
    loop {
        if let Progress::Done {
            stop_reason,
            stop_sequence,
            ..
        } = generation.next().await?
        {
            let content = std::mem::take(&mut generation.blocks.content);
            let message = generation.message(content, stop_reason.into(), stop_sequence.into());
            return Ok(Json(message).into_response());
        }
    }
}

/// Anthropic's stream: `message_start` and a `ping` once the request leaves the queue, the
/// blocks' events as the reply comes, `message_delta` and `message_stop` at the end. `ping`s
/// keep the connection alive while the prompt goes through and while the request waits.
fn stream_response(generation: Generation) -> Response {
    let keep_alive = KeepAlive::new().event(sse_event(&ping()));
    sse::response(generation, Events::default(), keep_alive)
}

fn ping() -> Value {
    json!({"type": "ping"})
}

/// An event named by its `type`, as Anthropic's streams name them.
fn sse_event(event: &Value) -> SseEvent {
    SseEvent::default()
        .event(event["type"].as_str().unwrap_or_default())
        .data(event.to_string())
}

impl EventSource for Generation {
    async fn advance(&mut self, events: &mut Events) {
        let mut send = |event: &Value| events.push(sse_event(event));
        match self.next().await {
            Ok(Progress::Started) => {
                let start = self.message(Vec::new(), Value::Null, Value::Null);
                send(&json!({"type": "message_start", "message": start}));
                send(&ping());
            }
            Ok(Progress::Prefill) => send(&ping()),
            Ok(Progress::Output(blocks)) => blocks.iter().for_each(send),
            Ok(Progress::Done {
                events: blocks,
                stop_reason,
                stop_sequence,
            }) => {
                blocks.iter().for_each(&mut send);
                let output_tokens = self.reply.tokens.completion();
                send(&json!({"type": "message_delta",
                    "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                    "usage": {"output_tokens": output_tokens}}));
                send(&json!({"type": "message_stop"}));
                events.end();
            }
            // A failure after the stream started: an `error` event ends it.
            Err(error) => {
                send(&error.anthropic_body());
                events.end();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(body: Value, purpose: Purpose) -> Result<ChatRequest, ApiError> {
        chat_request(body.as_object().unwrap(), &Defaults::default(), purpose)
    }

    fn error(body: Value) -> String {
        parse(body, Purpose::Generate).unwrap_err().message
    }

    #[test]
    fn conversations_become_template_messages() {
        let req = parse(
            json!({
                "model": "m", "max_tokens": 9, "stop_sequences": ["END"], "temperature": 1,
                "top_k": 5, "stream": true, "metadata": {"user_id": "u"},
                "system": [{"type": "text", "text": "Be brief."}, {"type": "text", "text": " Be kind."}],
                "messages": [
                    {"role": "user", "content": "Weather in Paris?"},
                    {"role": "assistant", "content": [
                        {"type": "thinking", "thinking": "Needs a tool.", "signature": "s"},
                        {"type": "redacted_thinking", "data": "xyz"},
                        {"type": "text", "text": "Looking."},
                        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
                    {"role": "user", "content": [
                        {"type": "tool_result", "tool_use_id": "toolu_1",
                         "content": [{"type": "text", "text": "18C"}, {"type": "text", "text": ", sunny"}]},
                        {"type": "tool_result", "tool_use_id": "toolu_0", "content": "unknown call",
                         "is_error": true},
                        {"type": "text", "text": "Thanks."}]}],
                "tools": [{"name": "get_weather", "description": "Weather now",
                           "input_schema": {"type": "object"}, "cache_control": {"type": "ephemeral"}}],
                "tool_choice": {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": true},
                "thinking": {"type": "disabled"},
            }),
            Purpose::Generate,
        )
        .unwrap();
        assert_eq!(
            Value::Array(req.messages),
            json!([
                {"role": "system", "content": "Be brief. Be kind."},
                {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "Looking.", "reasoning_content": "Needs a tool.",
                 "tool_calls": [{"id": "toolu_1", "type": "function",
                                 "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
                {"role": "tool", "tool_call_id": "toolu_1", "name": "get_weather", "content": "18C, sunny"},
                {"role": "tool", "tool_call_id": "toolu_0", "content": "Error: unknown call"},
                {"role": "user", "content": "Thanks."},
            ])
        );
        assert_eq!(
            req.tools,
            Some(
                json!([{"type": "function", "function": {"name": "get_weather",
                "description": "Weather now", "parameters": {"type": "object"}}}])
            )
        );
        assert_eq!(req.tool_choice, ToolChoice::Function("get_weather".into()));
        assert_eq!(
            Value::Object(req.template_kwargs),
            json!({"enable_thinking": false})
        );
        let p = &req.params;
        assert_eq!(
            (p.max_tokens, p.stream, p.stop.as_slice()),
            (9, true, &["END".to_owned()][..])
        );
        assert_eq!((p.sampler.temperature, p.sampler.top_k), (1.0, 5));
    }

    #[test]
    fn choices_and_thinking_map_onto_the_chat_path() {
        let with = |extra: Value| {
            let mut body = json!({"max_tokens": 1, "messages": [{"role": "user", "content": "hi"}],
                                  "tools": [{"name": "f", "input_schema": {}}]});
            body.as_object_mut()
                .unwrap()
                .extend(extra.as_object().unwrap().clone());
            parse(body, Purpose::Generate).unwrap()
        };
        assert_eq!(with(json!({})).tool_choice, ToolChoice::Auto);
        assert_eq!(
            with(json!({"tool_choice": {"type": "any"}})).tool_choice,
            ToolChoice::Required
        );
        // `none` hides the tools from the model, as OpenAI's does.
        let none = with(json!({"tool_choice": {"type": "none"}}));
        assert_eq!((none.tool_choice, none.tools), (ToolChoice::None, None));
        let thinking = with(json!({"thinking": {"type": "enabled", "budget_tokens": 2048}}));
        assert_eq!(thinking.template_kwargs["enable_thinking"], true);
        assert_eq!(thinking.thinking_budget, Some(2048));
        let adaptive = with(json!({"thinking": {"type": "adaptive"}}));
        assert_eq!(adaptive.template_kwargs["enable_thinking"], true);
        assert_eq!(adaptive.thinking_budget, None);
        assert!(with(json!({})).template_kwargs.is_empty());
        // count_tokens bodies have no max_tokens.
        let count = parse(
            json!({"messages": [{"role": "user", "content": "hi"}]}),
            Purpose::Count,
        );
        assert_eq!(count.unwrap().params.max_tokens, 512);
    }

    #[test]
    fn invalid_bodies_name_the_field_at_fault() {
        let user = |content: Value| json!({"max_tokens": 1, "messages": [{"role": "user", "content": content}]});
        assert_eq!(
            error(json!({"messages": [{"role": "user", "content": "hi"}]})),
            "max_tokens: Field required"
        );
        assert_eq!(error(json!({"max_tokens": 1})), "messages: Field required");
        assert_eq!(
            error(user(json!([{"type": "image", "source": {}}]))),
            "messages.0.content.0.type: `image` blocks are not accepted here \
             (accepted: text, tool_result)"
        );
        assert_eq!(
            error(user(json!([{"type": "tool_result", "content": "x"}]))),
            "messages.0.content.0.tool_use_id: Field required"
        );
        assert_eq!(
            error(user(json!([{"type": "text", "text": 1}]))),
            "messages.0.content.0.text: must be a string"
        );
        assert_eq!(
            error(user(
                json!([{"type": "tool_result", "tool_use_id": "t", "is_error": "yes"}])
            )),
            "messages.0.content.0.is_error: must be a boolean"
        );
        for budget in [json!(0), json!(-5), json!(1.5), json!("many")] {
            let mut body = user(json!("hi"));
            body["thinking"] = json!({"type": "enabled", "budget_tokens": budget});
            assert_eq!(
                error(body),
                "thinking.budget_tokens: must be an integer of at least 1"
            );
        }
        assert_eq!(
            error(user(json!([]))),
            "messages.0.content: at least one content block is required"
        );
        assert_eq!(
            error(json!({"max_tokens": 1, "messages": [{"role": "system", "content": "x"}]})),
            "messages.0.role: `system` is not a role of the Messages API (\"user\" or \"assistant\")"
        );
        assert_eq!(
            error(
                json!({"max_tokens": 1, "messages": [{"role": "assistant", "content": [
                {"type": "tool_use", "id": "t", "name": "f", "input": "{}"}]}]})
            ),
            "messages.0.content.0.input: must be an object"
        );
        assert_eq!(
            error(json!({"max_tokens": 1, "system": [{"type": "image"}], "messages": []})),
            "system.0.type: `image` blocks are not accepted here (accepted: text)"
        );
        let tools = |tools: Value, choice: Value| {
            error(
                json!({"max_tokens": 1, "messages": [{"role": "user", "content": "hi"}],
                         "tools": tools, "tool_choice": choice}),
            )
        };
        assert_eq!(
            tools(
                json!([{"type": "web_search_20250305", "name": "web_search"}]),
                Value::Null
            ),
            "tools.0.type: `web_search_20250305` tools are not supported, only custom tools"
        );
        assert_eq!(
            tools(json!([{"name": "f"}]), Value::Null),
            "tools.0.input_schema: Field required"
        );
        assert_eq!(
            tools(json!([]), json!({"type": "any"})),
            "tool_choice: a tool call is required but the request gives no tools"
        );
        assert_eq!(
            tools(
                json!([{"name": "f", "input_schema": {}}]),
                json!({"type": "tool", "name": "g"})
            ),
            "tool_choice: `g` is not one of the request's tools"
        );
        assert_eq!(
            tools(json!([]), json!({"type": "function"})),
            "tool_choice.type: must be \"auto\", \"any\", \"tool\" or \"none\""
        );
        let with = |key: &str, value: Value| {
            let mut body = user(json!("hi"));
            body[key] = value;
            error(body)
        };
        assert_eq!(
            with("temperature", json!(1.5)),
            "`temperature` must be 0 (greedy) or a number from 0.0001 to 1.0"
        );
        assert_eq!(
            with("stop_sequences", json!([1])),
            "`stop_sequences` must be a string or a list of strings"
        );
        assert_eq!(
            with("thinking", json!({"type": "on"})),
            "thinking.type: must be \"enabled\", \"adaptive\" or \"disabled\""
        );
        assert_eq!(
            with("max_tokens", json!(0)),
            "`max_tokens` must be at least 1"
        );
    }

    #[test]
    fn stop_reasons() {
        assert_eq!(stop_reason(FinishReason::Length, true, true), "max_tokens");
        assert_eq!(stop_reason(FinishReason::Stop, true, true), "tool_use");
        assert_eq!(
            stop_reason(FinishReason::Stop, true, false),
            "stop_sequence"
        );
        assert_eq!(stop_reason(FinishReason::Stop, false, false), "end_turn");
    }

    #[test]
    fn errors_take_anthropic_types_by_status() {
        let kind = |error: ApiError| error.anthropic_body()["error"]["type"].clone();
        assert_eq!(
            ApiError::invalid("x").anthropic_body(),
            json!({"type": "error", "error": {"type": "invalid_request_error", "message": "x"}})
        );
        assert_eq!(kind(ApiError::unauthorized()), "authentication_error");
        assert_eq!(kind(ApiError::not_found("x")), "not_found_error");
        assert_eq!(kind(ApiError::too_large("x")), "request_too_large");
        assert_eq!(
            kind(ApiError::too_many_requests("x", 1)),
            "rate_limit_error"
        );
        assert_eq!(kind(ApiError::server("x")), "api_error");
        assert_eq!(kind(ApiError::unavailable("x")), "overloaded_error");
        assert_eq!(kind(ApiError::timed_out("x")), "timeout_error");
        let response = ApiError::too_many_requests("x", 1).into_anthropic_response();
        assert_eq!(response.status(), 429);
        assert_eq!(response.headers()["retry-after"], "1");
    }
}
