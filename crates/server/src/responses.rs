//! OpenAI's Responses API: `POST /v1/responses` (a response object, or an SSE stream of typed
//! events), `GET` and `DELETE /v1/responses/{id}`.
//!
//! A request's input items become chat messages for the model's template and go the way of
//! every chat API ([`start_chat`]); the reply's pieces become output items (`reasoning`,
//! `message`, `function_call`). Responses made with `store` (the default) are kept in the
//! [`ResponseStore`](crate::response_store::ResponseStore), so that a later request's
//! `previous_response_id` continues the conversation they end.

use std::sync::Arc;
use std::time::Instant;

use axum::body::Bytes;
use axum::extract::rejection::{BytesRejection, PathRejection};
use axum::extract::{Extension, Path as UrlPath, State};
use axum::response::sse::{Event as SseEvent, KeepAlive};
use axum::response::{IntoResponse, Response};
use oxlm_runtime::batcher::Update;
use oxlm_runtime::FinishReason;
use serde_json::{json, Map, Value};

use crate::api::{prefixed_id, read_body, start_chat, Json, Reply};
use crate::error::ApiError;
use crate::log::TokenCounts;
use crate::parsers::{Piece, ToolFormat};
use crate::request::{self, ChatRequest, Fields, ResponseFormat, ToolChoice};
use crate::response_store::StoredResponse;
use crate::sse::{self, EventSource, Events};
use crate::worker::Running;
use crate::{unix_time, AppState};

/// `POST /v1/responses`.
pub(crate) async fn create(
    State(state): State<Arc<AppState>>,
    Extension(tokens): Extension<TokenCounts>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let result = async {
        let mut req = responses_request(&read_body(body)?, &state)?;
        let (running, reply) = start_chat(&state, &mut req.chat, &tokens)
            .await
            .map_err(in_responses_terms)?;
        let progress = Progress {
            reply,
            output: Output {
                format: state.tool_format,
                ..Output::default()
            },
        };
        let draft = Draft::new(state, req);
        if draft.stream {
            Ok(stream_response(draft, running, progress))
        } else {
            complete_response(draft, running, progress).await
        }
    };
    result.await.unwrap_or_else(IntoResponse::into_response)
}

/// An error of the shared chat path, naming the field as this API calls it: the chat API's
/// `messages` are `input` here, its `response_format` is `text.format`.
fn in_responses_terms(mut error: ApiError) -> ApiError {
    error.param = error.param.map(|param| match param.as_str() {
        "messages" => "input".to_owned(),
        "response_format" => "text.format".to_owned(),
        _ => param,
    });
    error
}

/// `GET /v1/responses/{id}`: a stored response.
pub(crate) async fn retrieve(
    State(state): State<Arc<AppState>>,
    id: Result<UrlPath<String>, PathRejection>,
) -> Result<Json, ApiError> {
    let id = response_id(id)?;
    let stored = state
        .responses
        .get(&id, Instant::now())
        .ok_or_else(|| response_not_found(&id))?;
    Ok(Json(stored.response.clone()))
}

/// `DELETE /v1/responses/{id}`.
pub(crate) async fn delete(
    State(state): State<Arc<AppState>>,
    id: Result<UrlPath<String>, PathRejection>,
) -> Result<Json, ApiError> {
    let id = response_id(id)?;
    if !state.responses.remove(&id, Instant::now()) {
        return Err(response_not_found(&id));
    }
    Ok(Json(
        json!({"id": id, "object": "response", "deleted": true}),
    ))
}

fn response_id(id: Result<UrlPath<String>, PathRejection>) -> Result<String, ApiError> {
    // A path that is not UTF-8 once decoded (`%ff`) gets the API's error, not axum's text.
    id.map(|UrlPath(id)| id)
        .map_err(|e| ApiError::invalid(e.body_text()))
}

fn response_not_found(id: &str) -> ApiError {
    ApiError::not_found(format!("Response with id '{id}' not found."))
}

fn previous_response_not_found(id: &str) -> ApiError {
    ApiError {
        code: Some("previous_response_not_found"),
        param: Some("previous_response_id".into()),
        ..ApiError::not_found(format!("Previous response with id '{id}' not found."))
    }
}

/// A Responses request, parsed and checked.
struct ResponsesRequest {
    chat: ChatRequest,
    /// The conversation up to the reply, as chat messages, without the instructions (which a
    /// continuation does not inherit).
    conversation: Vec<Value>,
    store: bool,
    /// The request's settings, as response objects repeat them (an object).
    settings: Value,
}

fn responses_request(
    body: &Map<String, Value>,
    state: &AppState,
) -> Result<ResponsesRequest, ApiError> {
    let fields = Fields(body);
    // The chat endpoint's sampling fields (mlx_lm.server's extensions among them), with the
    // Responses API's name for the length limit.
    let mut params = request::params(&fields, &state.defaults, false)?;
    if let Some(max) = fields.uint("max_output_tokens", 1)? {
        params.max_tokens = max.try_into().unwrap_or(usize::MAX);
    }
    // Output text comes with log-probabilities only when `include` asks, which is not served:
    // none are worked out.
    params.logprobs = false;
    params.top_logprobs = 0;
    let instructions = fields.string("instructions")?;
    let previous_id = fields.string("previous_response_id")?;
    let mut conversation = match &previous_id {
        Some(id) => {
            let previous = state
                .responses
                .get(id, Instant::now())
                .ok_or_else(|| previous_response_not_found(id))?;
            Conversation::continuing(previous.conversation.clone())
        }
        None => Conversation::default(),
    };
    match fields.get("input") {
        None => {}
        Some(Value::String(text)) => conversation.message("user", text.clone()),
        Some(Value::Array(items)) => {
            for (i, item) in items.iter().enumerate() {
                add_input_item(&mut conversation, item, &format!("input[{i}]"))?;
            }
        }
        Some(_) => {
            return Err(ApiError::invalid_param(
                "input",
                "`input` must be a string or a list of input items",
            ))
        }
    }
    let conversation = conversation.into_messages();
    let messages = instructions
        .iter()
        .map(|text| json!({"role": "system", "content": text}))
        .chain(conversation.iter().cloned())
        .enumerate()
        .map(|(i, message)| request::normalize_message(i, &message))
        .collect::<Result<Vec<_>, _>>()?;
    if messages.is_empty() {
        return Err(ApiError::invalid_param(
            "input",
            "Request did not contain input",
        ));
    }
    let tool_choice = tool_choice(fields.get("tool_choice"))?;
    let tools = chat_tools(fields.get("tools"))?;
    request::check_tool_choice(&tool_choice, tools.as_ref(), "tool_choice")?;
    let mut text = fields.object("text")?.unwrap_or_default();
    let format = match text.get("format") {
        None | Some(Value::Null) => json!({"type": "text"}),
        Some(format) => format.clone(),
    };
    let response_format = text_format(&format)?;
    text.insert("format".into(), format);
    let mut template_kwargs = fields.object("chat_template_kwargs")?.unwrap_or_default();
    if let Some(effort) = reasoning_effort(fields.object("reasoning")?)? {
        request::reasoning_effort_kwargs(&mut template_kwargs, effort);
    }
    let store = fields.bool("store")?.unwrap_or(true);
    let metadata = fields.object("metadata")?.unwrap_or_default();
    let parallel_tool_calls = fields.bool("parallel_tool_calls")?.unwrap_or(true);
    fields.string("user")?;
    let settings = json!({
        "instructions": instructions,
        "tools": fields.get("tools").cloned().unwrap_or_else(|| json!([])),
        "tool_choice": fields.get("tool_choice").cloned().unwrap_or_else(|| json!("auto")),
        "text": text,
        "temperature": decimal(params.sampler.temperature),
        "top_p": decimal(params.sampler.top_p),
        "max_output_tokens": fields.get("max_output_tokens"),
        "previous_response_id": previous_id,
        "store": store,
        "metadata": metadata,
        "parallel_tool_calls": parallel_tool_calls,
        "reasoning": fields.get("reasoning"),
    });
    let chat = ChatRequest {
        params,
        messages,
        // Tools a reply may not call are not shown to the model.
        tools: tools.filter(|_| tool_choice != ToolChoice::None),
        template_kwargs,
        role_mapping: None,
        tool_choice,
        response_format,
        reply_prefix: None,
        parallel_tool_calls,
        thinking_budget: None,
    };
    Ok(ResponsesRequest {
        chat,
        conversation,
        store,
        settings,
    })
}

/// An f32 as the decimal it prints as (0.7, not 0.699999988079071).
fn decimal(x: f32) -> Value {
    x.to_string()
        .parse::<f64>()
        .map_or(Value::Null, Value::from)
}

/// Adds one of the Responses API's input items (`at` names it in errors) to `conversation`.
fn add_input_item(conversation: &mut Conversation, item: &Value, at: &str) -> Result<(), ApiError> {
    let Value::Object(item) = item else {
        return Err(ApiError::invalid_param(
            at,
            "each input item must be an object",
        ));
    };
    let string = |key: &str| {
        item.get(key).and_then(Value::as_str).ok_or_else(|| {
            ApiError::invalid_param(&format!("{at}.{key}"), format!("`{key}` must be a string"))
        })
    };
    // An item without a `type` is a message (OpenAI's "easy input message").
    let kind = if item.contains_key("type") {
        string("type")?
    } else {
        "message"
    };
    match kind {
        "message" => {
            let role = match string("role")? {
                role @ ("user" | "assistant" | "system") => role,
                // Templates know OpenAI's `developer` messages as system messages.
                "developer" => "system",
                role => {
                    return Err(ApiError::invalid_param(
                        &format!("{at}.role"),
                        format!(
                            "`role` must be \"user\", \"assistant\", \"system\" or \
                             \"developer\", not \"{role}\""
                        ),
                    ))
                }
            };
            let text = text_content(item.get("content"), &format!("{at}.content"))?;
            conversation.message(role, text);
        }
        "function_call" => {
            conversation.call(string("call_id")?, string("name")?, string("arguments")?);
        }
        "function_call_output" => {
            let output = text_content(item.get("output"), &format!("{at}.output"))?;
            conversation.tool_output(string("call_id")?, output);
        }
        "reasoning" => {
            // The text of its `reasoning_text` parts, as this server's reasoning items have it;
            // summaries and encrypted reasoning (other servers') are not for the template.
            let text = item
                .get("content")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
                .filter(|part| part["type"] == "reasoning_text")
                .filter_map(|part| part["text"].as_str())
                .collect();
            conversation.reasoning(text);
        }
        kind => {
            return Err(ApiError::invalid_param(
                &format!("{at}.type"),
                format!("Input items of type `{kind}` are not supported"),
            ))
        }
    }
    Ok(())
}

/// The text of a message's content or a call's output: a string, or text parts joined.
fn text_content(content: Option<&Value>, at: &str) -> Result<String, ApiError> {
    match content {
        Some(Value::String(text)) => Ok(text.clone()),
        Some(Value::Array(parts)) => parts
            .iter()
            .enumerate()
            .map(
                |(j, part)| match (part["type"].as_str(), part["text"].as_str()) {
                    (Some("input_text" | "output_text"), Some(text)) => Ok(text),
                    _ => Err(ApiError::invalid_param(
                        &format!("{at}[{j}]"),
                        "Only text content parts (`input_text`, `output_text`) are supported",
                    )),
                },
            )
            .collect(),
        _ => Err(ApiError::invalid_param(
            at,
            "content must be a string or a list of content parts",
        )),
    }
}

/// The Responses API's `tool_choice`: `"auto"`, `"none"`, `"required"` or
/// `{"type": "function", "name": ...}`.
fn tool_choice(value: Option<&Value>) -> Result<ToolChoice, ApiError> {
    request::openai_tool_choice(value, "/name", "{\"type\": \"function\", \"name\": ...}")
}

/// The request's function tools in the chat format that templates take (`None` when it gives
/// none). Other types of tool are OpenAI's hosted ones, which this server does not have.
fn chat_tools(tools: Option<&Value>) -> Result<Option<Value>, ApiError> {
    let tools = match tools {
        None => return Ok(None),
        Some(Value::Array(tools)) if tools.is_empty() => return Ok(None),
        Some(Value::Array(tools)) => tools,
        Some(_) => return Err(ApiError::invalid_param("tools", "`tools` must be an array")),
    };
    let chat_tool = |(i, tool): (usize, &Value)| {
        let at = format!("tools[{i}]");
        let Some(tool) = tool.as_object() else {
            return Err(ApiError::invalid_param(&at, "each tool must be an object"));
        };
        match tool.get("type").and_then(Value::as_str) {
            Some("function") => {}
            Some(kind) => {
                return Err(ApiError::invalid_param(
                    &format!("{at}.type"),
                    format!("Tools of type `{kind}` are not supported: only `function` tools are"),
                ))
            }
            None => {
                return Err(ApiError::invalid_param(
                    &format!("{at}.type"),
                    "each tool needs a string `type`",
                ))
            }
        }
        if !tool.get("name").is_some_and(Value::is_string) {
            return Err(ApiError::invalid_param(
                &format!("{at}.name"),
                "a function tool needs a string `name`",
            ));
        }
        let mut function = tool.clone();
        function.remove("type");
        Ok(json!({"type": "function", "function": function}))
    };
    let tools = tools
        .iter()
        .enumerate()
        .map(chat_tool)
        .collect::<Result<_, _>>()?;
    Ok(Some(Value::Array(tools)))
}

/// `text.format`: `{"type": "text"}`, `{"type": "json_object"}` or
/// `{"type": "json_schema", "name": ..., "schema": {...}, "strict": ...}`.
fn text_format(format: &Value) -> Result<ResponseFormat, ApiError> {
    match format["type"].as_str() {
        Some("text") => Ok(ResponseFormat::Text),
        Some("json_object") => Ok(ResponseFormat::JsonObject),
        Some("json_schema") => request::json_schema_format(format, "text.format"),
        _ => Err(ApiError::invalid_param(
            "text.format.type",
            "`text.format.type` must be \"text\", \"json_object\" or \"json_schema\"",
        )),
    }
}

/// `reasoning.effort`, when given.
fn reasoning_effort(reasoning: Option<Map<String, Value>>) -> Result<Option<String>, ApiError> {
    match reasoning.as_ref().and_then(|r| r.get("effort")) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(effort)) => Ok(Some(effort.clone())),
        Some(_) => Err(ApiError::invalid_param(
            "reasoning.effort",
            "`reasoning.effort` must be a string",
        )),
    }
}

/// Chat messages, built item by item. The reasoning, text and calls of one assistant turn
/// (separate items in the Responses API) join into one message, as templates take a turn.
#[derive(Default)]
struct Conversation {
    messages: Vec<Value>,
    /// The assistant turn being put together, and the last part it has.
    turn: Option<(TurnPart, Map<String, Value>)>,
}

/// The parts of an assistant turn, in the order a turn has them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum TurnPart {
    Reasoning,
    Text,
    Calls,
}

impl Conversation {
    /// Goes on from the messages of a stored conversation.
    fn continuing(messages: Vec<Value>) -> Self {
        Conversation {
            messages,
            turn: None,
        }
    }

    fn message(&mut self, role: &str, text: String) {
        if role == "assistant" {
            self.turn(TurnPart::Text)
                .insert("content".into(), text.into());
        } else {
            self.push(json!({"role": role, "content": text}));
        }
    }

    fn reasoning(&mut self, text: String) {
        if !text.is_empty() {
            self.turn(TurnPart::Reasoning)
                .insert("reasoning_content".into(), text.into());
        }
    }

    /// A call as chat messages have it (`normalize_message` parses its arguments for the
    /// template).
    fn call(&mut self, call_id: &str, name: &str, arguments: &str) {
        let call = json!({"id": call_id, "type": "function",
                          "function": {"name": name, "arguments": arguments}});
        let turn = self.turn(TurnPart::Calls);
        match turn.get_mut("tool_calls") {
            Some(Value::Array(calls)) => calls.push(call),
            _ => {
                turn.insert("tool_calls".into(), json!([call]));
            }
        }
    }

    fn tool_output(&mut self, call_id: &str, output: String) {
        self.push(json!({"role": "tool", "tool_call_id": call_id, "content": output}));
    }

    fn push(&mut self, message: Value) {
        self.end_turn();
        self.messages.push(message);
    }

    /// The assistant message that `part` goes in: the turn being put together while it has
    /// not gone past `part` (its calls may be many), else a new one.
    fn turn(&mut self, part: TurnPart) -> &mut Map<String, Value> {
        let continues =
            matches!(&self.turn, Some((last, _)) if *last < part || part == TurnPart::Calls);
        if !continues {
            self.end_turn();
        }
        let (last, message) = self.turn.get_or_insert_with(|| {
            let mut message = Map::new();
            message.insert("role".into(), "assistant".into());
            message.insert("content".into(), "".into());
            (part, message)
        });
        *last = part;
        message
    }

    fn end_turn(&mut self) {
        if let Some((_, message)) = self.turn.take() {
            self.messages.push(Value::Object(message));
        }
    }

    fn into_messages(mut self) -> Vec<Value> {
        self.end_turn();
        self.messages
    }
}

/// An id of OpenAI's form: `prefix`, `_` and 32 random hex digits.
/// An output item.
#[derive(Debug)]
struct Item {
    id: String,
    kind: ItemKind,
    /// A reasoning or message item's text; a call's arguments.
    text: String,
    /// False for a message that `max_output_tokens` cut short.
    complete: bool,
}

#[derive(Debug, PartialEq)]
enum ItemKind {
    Reasoning,
    Message,
    FunctionCall { call_id: String, name: String },
}

impl Item {
    fn new(kind: ItemKind) -> Self {
        let prefix = match kind {
            ItemKind::Reasoning => "rs_",
            ItemKind::Message => "msg_",
            ItemKind::FunctionCall { .. } => "fc_",
        };
        Item {
            id: prefixed_id(prefix),
            kind,
            text: String::new(),
            complete: true,
        }
    }

    /// Its content part, with `text` (calls have none).
    fn part(&self, text: &str) -> Option<Value> {
        match self.kind {
            ItemKind::Reasoning => Some(json!({"type": "reasoning_text", "text": text})),
            ItemKind::Message => {
                Some(json!({"type": "output_text", "text": text, "annotations": []}))
            }
            ItemKind::FunctionCall { .. } => None,
        }
    }

    /// The item as `output` lists it when `done`; else as it is announced, empty.
    fn json(&self, done: bool) -> Value {
        let text = if done { self.text.as_str() } else { "" };
        let status = match (done, self.complete) {
            (false, _) => "in_progress",
            (true, true) => "completed",
            (true, false) => "incomplete",
        };
        let content: Vec<Value> = self.part(text).filter(|_| done).into_iter().collect();
        match &self.kind {
            ItemKind::Reasoning => {
                json!({"type": "reasoning", "id": self.id, "summary": [], "content": content})
            }
            ItemKind::Message => json!({"type": "message", "id": self.id, "status": status,
                                        "role": "assistant", "content": content}),
            ItemKind::FunctionCall { call_id, name } => json!({"type": "function_call",
                "id": self.id, "call_id": call_id, "name": name, "arguments": text,
                "status": status}),
        }
    }
}

/// What happened to the output item at an index; a stream sends each as events.
#[derive(Debug, PartialEq)]
enum Change {
    Added(usize),
    Delta(usize, String),
    Done(usize),
}

/// The output items of a reply, made from its pieces as they come.
#[derive(Debug, Default)]
struct Output {
    items: Vec<Item>,
    /// Whether the last item may still grow.
    open: bool,
    /// Whitespace content in no item yet: alone, it is what separates items (reasoning from a
    /// call), not a message.
    space: String,
    /// Whether the last piece was reasoning.
    in_reasoning: bool,
    reasoning_tokens: usize,
    /// Changes not yet sent.
    changes: Vec<Change>,
    /// The model's tool-call format, which its calls' ids must suit.
    format: ToolFormat,
}

impl Output {
    /// Adds the pieces a generated token completed. The token counts as reasoning when they
    /// are; one that completes none counts as the piece before it.
    fn token(&mut self, pieces: Vec<Piece>) {
        let reasoning = match pieces.as_slice() {
            [] => self.in_reasoning,
            pieces => pieces.iter().any(|p| matches!(p, Piece::Reasoning(_))),
        };
        self.reasoning_tokens += usize::from(reasoning);
        self.add(pieces);
    }

    fn add(&mut self, pieces: Vec<Piece>) {
        for piece in pieces {
            self.in_reasoning = matches!(piece, Piece::Reasoning(_));
            match piece {
                Piece::Content(text) if self.is_open(&ItemKind::Message) => self.grow(&text),
                Piece::Content(text) if text.trim().is_empty() => self.space.push_str(&text),
                Piece::Content(text) => {
                    let text = std::mem::take(&mut self.space) + &text;
                    self.start(ItemKind::Message);
                    self.grow(&text);
                }
                Piece::Reasoning(text) => {
                    self.space.clear();
                    if !self.is_open(&ItemKind::Reasoning) {
                        self.start(ItemKind::Reasoning);
                    }
                    self.grow(&text);
                }
                Piece::ToolCall(call) => {
                    self.space.clear();
                    self.start(ItemKind::FunctionCall {
                        call_id: self.format.call_id("call_"),
                        name: call.name,
                    });
                    self.grow(&call.arguments);
                    self.close();
                }
            }
        }
    }

    /// Ends the output; `truncated` when `max_output_tokens` cut it short.
    fn finish(&mut self, truncated: bool) {
        // A reply of nothing but whitespace is still a message.
        if self.items.is_empty() && !self.space.is_empty() {
            let text = std::mem::take(&mut self.space);
            self.start(ItemKind::Message);
            self.grow(&text);
        }
        if truncated && self.open {
            let last = self.items.last_mut();
            if let Some(message) = last.filter(|item| item.kind == ItemKind::Message) {
                message.complete = false;
            }
        }
        self.close();
    }

    fn is_open(&self, kind: &ItemKind) -> bool {
        self.open && self.items.last().is_some_and(|item| item.kind == *kind)
    }

    fn start(&mut self, kind: ItemKind) {
        self.close();
        self.items.push(Item::new(kind));
        self.open = true;
        self.changes.push(Change::Added(self.items.len() - 1));
    }

    fn grow(&mut self, text: &str) {
        let index = self.items.len() - 1;
        if !text.is_empty() {
            self.items[index].text.push_str(text);
            self.changes.push(Change::Delta(index, text.to_owned()));
        }
    }

    fn close(&mut self) {
        if std::mem::take(&mut self.open) {
            self.changes.push(Change::Done(self.items.len() - 1));
        }
    }

    /// Adds the items to `conversation`, as the assistant turn they are.
    fn add_to(&self, conversation: &mut Conversation) {
        for item in &self.items {
            match &item.kind {
                ItemKind::Reasoning => conversation.reasoning(item.text.clone()),
                ItemKind::Message => conversation.message("assistant", item.text.clone()),
                ItemKind::FunctionCall { call_id, name } => {
                    conversation.call(call_id, name, &item.text)
                }
            }
        }
    }

    /// The stream events of `change`: their types and fields.
    fn events(&self, change: Change) -> Vec<(&'static str, Value)> {
        let index = match change {
            Change::Added(index) | Change::Delta(index, _) | Change::Done(index) => index,
        };
        let item = &self.items[index];
        let at = json!({"item_id": item.id, "output_index": index});
        // Each item has one content part at most.
        let in_part = |mut fields: Value| {
            fields["content_index"] = 0.into();
            fields
        };
        let with = |key: &str, value: Value| {
            let mut fields = at.clone();
            fields[key] = value;
            fields
        };
        // No log-probabilities are worked out (see `responses_request`).
        let no_logprobs = json!([]);
        let mut events = Vec::new();
        match change {
            Change::Added(_) => {
                events.push((
                    "response.output_item.added",
                    json!({"output_index": index, "item": item.json(false)}),
                ));
                if let Some(part) = item.part("") {
                    events.push(("response.content_part.added", in_part(with("part", part))));
                }
            }
            Change::Delta(_, delta) => events.push(match item.kind {
                ItemKind::Message => {
                    let mut fields = in_part(with("delta", delta.into()));
                    fields["logprobs"] = no_logprobs;
                    ("response.output_text.delta", fields)
                }
                ItemKind::Reasoning => (
                    "response.reasoning_text.delta",
                    in_part(with("delta", delta.into())),
                ),
                ItemKind::FunctionCall { .. } => (
                    "response.function_call_arguments.delta",
                    with("delta", delta.into()),
                ),
            }),
            Change::Done(_) => {
                let text = Value::from(item.text.as_str());
                events.push(match item.kind {
                    ItemKind::Message => {
                        let mut fields = in_part(with("text", text));
                        fields["logprobs"] = no_logprobs;
                        ("response.output_text.done", fields)
                    }
                    ItemKind::Reasoning => {
                        ("response.reasoning_text.done", in_part(with("text", text)))
                    }
                    ItemKind::FunctionCall { .. } => (
                        "response.function_call_arguments.done",
                        with("arguments", text),
                    ),
                });
                if let Some(part) = item.part(&item.text) {
                    events.push(("response.content_part.done", in_part(with("part", part))));
                }
                events.push((
                    "response.output_item.done",
                    json!({"output_index": index, "item": item.json(true)}),
                ));
            }
        }
        events
    }
}

/// A reply on its way into output items.
struct Progress {
    reply: Reply,
    output: Output,
}

/// Where a reply stands after an update.
enum Step {
    Going,
    Prefill { done: usize, total: usize },
    Finished(FinishReason),
    Failed(ApiError),
}

impl Progress {
    fn update(&mut self, update: Option<Update>) -> Step {
        match update {
            Some(Update::Started { cached_tokens }) => self.reply.cached_tokens = cached_tokens,
            Some(Update::Prefill { done, total }) => return Step::Prefill { done, total },
            Some(Update::Token {
                id,
                logprob,
                top,
                text,
            }) => {
                let pieces = self.reply.token(id, logprob, &top, &text);
                self.output.token(pieces);
            }
            Some(Update::Text(text)) => {
                let pieces = self.reply.text(&text);
                self.output.add(pieces);
            }
            Some(Update::Done(Ok(reason))) => {
                let pieces = self.reply.finish();
                self.output.add(pieces);
                self.output.finish(reason == FinishReason::Length);
                return Step::Finished(reason);
            }
            Some(Update::Done(Err(error))) => return Step::Failed(error.into()),
            None => return Step::Failed(ApiError::server("the generation thread stopped")),
        }
        Step::Going
    }

    fn usage(&self) -> Value {
        let tokens = &self.reply.tokens;
        let (input, output) = (tokens.prompt(), tokens.completion());
        json!({
            "input_tokens": input,
            "input_tokens_details": {"cached_tokens": self.reply.cached_tokens},
            "output_tokens": output,
            "output_tokens_details": {"reasoning_tokens": self.output.reasoning_tokens},
            "total_tokens": input + output,
        })
    }
}

/// A response's status.
enum Status {
    InProgress,
    Completed,
    Incomplete,
    Failed(ApiError),
}

impl Status {
    fn finished(reason: FinishReason) -> Self {
        match reason {
            FinishReason::Length => Status::Incomplete,
            FinishReason::Stop | FinishReason::Cancelled => Status::Completed,
        }
    }

    /// The event that gives the response with this status.
    fn event(&self) -> &'static str {
        match self {
            Status::InProgress => "response.in_progress",
            Status::Completed => "response.completed",
            Status::Incomplete => "response.incomplete",
            Status::Failed(_) => "response.failed",
        }
    }
}

/// The response being made: what its objects carry.
struct Draft {
    state: Arc<AppState>,
    id: String,
    created_at: u64,
    settings: Value,
    stream: bool,
    store: bool,
    conversation: Vec<Value>,
}

impl Draft {
    fn new(state: Arc<AppState>, req: ResponsesRequest) -> Self {
        Draft {
            state,
            id: prefixed_id("resp_"),
            created_at: unix_time(),
            settings: req.settings,
            stream: req.chat.params.stream,
            store: req.store,
            conversation: req.conversation,
        }
    }

    /// The response object; `progress`, the reply so far (none before it starts).
    fn object(&self, status: &Status, progress: Option<&Progress>) -> Value {
        let (status_name, incomplete_details, error) = match status {
            Status::InProgress => ("in_progress", Value::Null, Value::Null),
            Status::Completed => ("completed", Value::Null, Value::Null),
            Status::Incomplete => (
                "incomplete",
                json!({"reason": "max_output_tokens"}),
                Value::Null,
            ),
            Status::Failed(error) => (
                "failed",
                Value::Null,
                json!({"code": error.code.unwrap_or("server_error"), "message": error.message}),
            ),
        };
        let output: Vec<Value> = progress
            .map(|p| p.output.items.iter().map(|item| item.json(true)).collect())
            .unwrap_or_default();
        let mut object = json!({
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status_name,
            "incomplete_details": incomplete_details,
            "error": error,
            "model": self.state.model_id,
            "output": output,
            "usage": progress.map_or(Value::Null, Progress::usage),
        });
        if let (Value::Object(fields), Value::Object(settings)) = (&mut object, &self.settings) {
            fields.extend(settings.clone());
        }
        object
    }

    /// The response that `progress` ends with; kept in the store when the request asked and
    /// the response did not fail.
    fn finish(&mut self, progress: &Progress, status: &Status) -> Value {
        let response = self.object(status, Some(progress));
        if self.store && !matches!(status, Status::Failed(_)) {
            let mut conversation = Conversation::continuing(std::mem::take(&mut self.conversation));
            progress.output.add_to(&mut conversation);
            let stored = StoredResponse {
                response: response.clone(),
                conversation: conversation.into_messages(),
            };
            let id = self.id.clone();
            self.state.responses.insert(id, stored, Instant::now());
        }
        response
    }
}

async fn complete_response(
    mut draft: Draft,
    mut running: Running,
    mut progress: Progress,
) -> Result<Response, ApiError> {
    let reason = loop {
        match progress.update(running.next().await) {
            // Only streams send the changes.
            Step::Going | Step::Prefill { .. } => progress.output.changes.clear(),
            Step::Finished(reason) => break reason,
            Step::Failed(error) => return Err(error),
        }
    };
    let response = draft.finish(&progress, &Status::finished(reason));
    Ok(Json(response).into_response())
}

/// Turns generation updates into the Responses API's typed SSE events, each numbered; SSE
/// comments while the prompt is processed.
struct EventStream {
    draft: Draft,
    running: Running,
    progress: Progress,
    sequence_number: u64,
}

fn stream_response(draft: Draft, running: Running, progress: Progress) -> Response {
    let mut stream = EventStream {
        draft,
        running,
        progress,
        sequence_number: 0,
    };
    let mut events = Events::default();
    let response = stream.draft.object(&Status::InProgress, None);
    events.push(stream.event("response.created", json!({"response": response})));
    events.push(stream.event(Status::InProgress.event(), json!({"response": response})));
    sse::response(stream, events, KeepAlive::default())
}

impl EventSource for EventStream {
    async fn advance(&mut self, events: &mut Events) {
        let step = self.progress.update(self.running.next().await);
        for change in std::mem::take(&mut self.progress.output.changes) {
            for (kind, fields) in self.progress.output.events(change) {
                events.push(self.event(kind, fields));
            }
        }
        let status = match step {
            Step::Going => return,
            Step::Prefill { done, total } => {
                events.push(SseEvent::default().comment(format!("keepalive {done}/{total}")));
                return;
            }
            Step::Finished(reason) => Status::finished(reason),
            Step::Failed(error) => Status::Failed(error),
        };
        let response = self.draft.finish(&self.progress, &status);
        events.push(self.event(status.event(), json!({"response": response})));
        events.end();
    }
}

impl EventStream {
    /// The next event, numbered: of type `kind`, with `fields`.
    fn event(&mut self, kind: &str, mut fields: Value) -> SseEvent {
        fields["type"] = kind.into();
        fields["sequence_number"] = self.sequence_number.into();
        self.sequence_number += 1;
        SseEvent::default().event(kind).data(fields.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::parsers::ToolCall;

    fn conversation(items: Value) -> Result<Vec<Value>, ApiError> {
        let mut conversation = Conversation::default();
        for (i, item) in items.as_array().unwrap().iter().enumerate() {
            add_input_item(&mut conversation, item, &format!("input[{i}]"))?;
        }
        Ok(conversation.into_messages())
    }

    #[test]
    fn an_assistant_turn_joins_its_items() {
        let messages = conversation(json!([
            {"role": "developer", "content": "Be brief."},
            {"type": "message", "role": "user",
             "content": [{"type": "input_text", "text": "Weather?"}]},
            {"type": "reasoning", "id": "rs_1", "summary": [],
             "content": [{"type": "reasoning_text", "text": "Look it up."}]},
            {"type": "function_call", "call_id": "call_1", "name": "weather", "arguments": "{}"},
            {"type": "function_call", "call_id": "call_2", "name": "time", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "Sunny"},
            {"type": "function_call_output", "call_id": "call_2",
             "output": [{"type": "input_text", "text": "Noon"}]},
            {"type": "message", "role": "assistant",
             "content": [{"type": "output_text", "text": "Sunny at noon.", "annotations": []}]},
            {"role": "assistant", "content": "Anything else?"},
        ]))
        .unwrap();
        let call = |id: &str, name: &str| {
            json!({"id": id, "type": "function",
                   "function": {"name": name, "arguments": "{}"}})
        };
        assert_eq!(
            messages,
            [
                json!({"role": "system", "content": "Be brief."}),
                json!({"role": "user", "content": "Weather?"}),
                json!({"role": "assistant", "content": "", "reasoning_content": "Look it up.",
                       "tool_calls": [call("call_1", "weather"), call("call_2", "time")]}),
                json!({"role": "tool", "tool_call_id": "call_1", "content": "Sunny"}),
                json!({"role": "tool", "tool_call_id": "call_2", "content": "Noon"}),
                json!({"role": "assistant", "content": "Sunny at noon."}),
                // Text after text is another turn.
                json!({"role": "assistant", "content": "Anything else?"}),
            ]
        );
    }

    #[test]
    fn bad_items_name_their_field() {
        let param = |item: Value| conversation(json!([item])).unwrap_err().param.unwrap();
        assert_eq!(param(json!("hi")), "input[0]");
        assert_eq!(
            param(json!({"role": "tool", "content": "x"})),
            "input[0].role"
        );
        assert_eq!(
            param(json!({"type": "item_reference", "id": "x"})),
            "input[0].type"
        );
        assert_eq!(
            param(json!({"role": "user", "content": [{"type": "input_image"}]})),
            "input[0].content[0]"
        );
        assert_eq!(
            param(json!({"type": "function_call", "call_id": "c", "name": "f"})),
            "input[0].arguments"
        );
        assert_eq!(
            param(json!({"type": "function_call_output", "call_id": "c", "output": 1})),
            "input[0].output"
        );
    }

    #[test]
    fn whitespace_between_items_is_no_message() {
        let call = ToolCall {
            name: "weather".into(),
            arguments: "{}".into(),
        };
        let mut output = Output::default();
        output.token(vec![Piece::Reasoning("Hmm.".into())]);
        output.token(vec![]);
        output.token(vec![Piece::Content("\n\n".into())]);
        output.token(vec![Piece::ToolCall(call)]);
        output.finish(false);
        let kinds: Vec<&ItemKind> = output.items.iter().map(|item| &item.kind).collect();
        assert!(matches!(
            kinds.as_slice(),
            [ItemKind::Reasoning, ItemKind::FunctionCall { .. }]
        ));
        assert_eq!(output.reasoning_tokens, 2);
        assert_eq!(
            output.changes,
            [
                Change::Added(0),
                Change::Delta(0, "Hmm.".into()),
                Change::Done(0),
                Change::Added(1),
                Change::Delta(1, "{}".into()),
                Change::Done(1),
            ]
        );
        // Whitespace before text is the text's; a reply of only whitespace is a message.
        let mut output = Output::default();
        output.add(vec![
            Piece::Content("\n".into()),
            Piece::Content("Hi".into()),
        ]);
        output.finish(true);
        assert_eq!(output.items[0].text, "\nHi");
        assert_eq!(output.items[0].json(true)["status"], "incomplete");
        let mut output = Output::default();
        output.add(vec![Piece::Content(" ".into())]);
        output.finish(false);
        assert_eq!(output.items[0].text, " ");
    }

    #[test]
    fn tools_and_settings_take_the_responses_shapes() {
        let tools = json!([{"type": "function", "name": "f", "description": "d",
                            "parameters": {"type": "object"}, "strict": true}]);
        assert_eq!(
            chat_tools(Some(&tools)).unwrap(),
            Some(
                json!([{"type": "function", "function": {"name": "f", "description": "d",
                         "parameters": {"type": "object"}, "strict": true}}])
            )
        );
        let err = chat_tools(Some(&json!([{"type": "web_search"}]))).unwrap_err();
        assert_eq!(err.param.as_deref(), Some("tools[0].type"));
        assert_eq!(
            tool_choice(Some(&json!({"type": "function", "name": "f"}))),
            Ok(ToolChoice::Function("f".into()))
        );
        assert!(tool_choice(Some(
            &json!({"type": "function", "function": {"name": "f"}})
        ))
        .is_err());
        let schema = json!({"type": "json_schema", "name": "r", "schema": {"type": "object"}});
        assert_eq!(
            text_format(&schema),
            Ok(ResponseFormat::JsonSchema {
                name: "r".into(),
                schema: json!({"type": "object"})
            })
        );
        assert_eq!(decimal(0.7), json!(0.7));
    }
}
