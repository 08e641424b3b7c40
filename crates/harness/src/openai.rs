//! What a well-formed answer of the OpenAI API looks like: error objects, completions, model
//! lists, embeddings and event streams; answers of the other APIs the server speaks go to their
//! own checks ([`crate::anthropic`], [`crate::responses_api`]). Each check returns what is
//! wrong, for the report.

use std::time::Duration;

use serde_json::Value;

use crate::http::{self, Connection, Event, Events, Response};
use crate::{anthropic, responses_api};

/// The server's endpoints, by what their answers hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    Chat,
    Completions,
    /// Anthropic's `/v1/messages`.
    Messages,
    /// Anthropic's `/v1/messages/count_tokens`.
    CountTokens,
    /// `POST /v1/responses`.
    Responses,
    /// `GET` or `DELETE /v1/responses/{id}`.
    StoredResponse,
    Embeddings,
    Models,
    Model,
    Health,
    /// Readiness: `{"status": ...}`.
    Ready,
    /// Prometheus text.
    Metrics,
    /// Counters as a JSON object.
    Stats,
    /// Unknown paths: only errors are expected.
    Other,
}

impl Endpoint {
    /// The endpoint a request path reaches (query and fragment ignored).
    pub fn of_path(path: &str) -> Endpoint {
        let path = path.split(['?', '#']).next().unwrap_or("");
        match path {
            "/v1/chat/completions" | "/chat/completions" => Endpoint::Chat,
            "/v1/completions" => Endpoint::Completions,
            "/v1/messages" => Endpoint::Messages,
            "/v1/messages/count_tokens" => Endpoint::CountTokens,
            "/v1/responses" => Endpoint::Responses,
            "/v1/embeddings" => Endpoint::Embeddings,
            "/v1/models" => Endpoint::Models,
            "/health" => Endpoint::Health,
            "/ready" => Endpoint::Ready,
            "/metrics" => Endpoint::Metrics,
            "/stats" => Endpoint::Stats,
            _ if path.starts_with("/v1/models/") => Endpoint::Model,
            _ if path.starts_with("/v1/responses/") => Endpoint::StoredResponse,
            _ => Endpoint::Other,
        }
    }

    /// Whether its answers are the Anthropic Messages API's.
    pub fn is_anthropic(self) -> bool {
        matches!(self, Endpoint::Messages | Endpoint::CountTokens)
    }

    fn streams(self) -> bool {
        matches!(
            self,
            Endpoint::Chat | Endpoint::Completions | Endpoint::Messages | Endpoint::Responses
        )
    }
}

/// `{"error": {"message": string, "type": string, ...}}`.
pub fn check_error(value: &Value) -> Result<(), String> {
    let error = value
        .get("error")
        .filter(|e| e.is_object())
        .ok_or("no `error` object")?;
    for field in ["message", "type"] {
        if !error.get(field).is_some_and(Value::is_string) {
            return Err(format!("`error.{field}` is not a string"));
        }
    }
    Ok(())
}

/// Any response: an error must be an OpenAI error object in JSON; a success must be what its
/// endpoint answers (JSON, or an event stream that ends with `data: [DONE]`).
pub fn check_response(
    endpoint: Endpoint,
    response: &Response,
    to_head: bool,
) -> Result<(), String> {
    let status = response.status();
    if to_head || status == 204 {
        return if response.body.is_empty() {
            Ok(())
        } else {
            Err(format!("{status} with a body"))
        };
    }
    if status >= 400 {
        if endpoint.is_anthropic() {
            return anthropic::check_error(&json_body(response)?, status);
        }
        return check_error_response(response);
    }
    if status != 200 {
        return Err(format!("unexpected status {status}"));
    }
    if response.head.is_event_stream() {
        if !endpoint.streams() {
            return Err("an event stream from an endpoint that does not stream".into());
        }
        return check_stream_body(endpoint, &response.body).map(|_| ());
    }
    if endpoint == Endpoint::Metrics {
        return check_metrics(response);
    }
    let value = json_body(response)?;
    match endpoint {
        Endpoint::Chat | Endpoint::Completions => check_completion(endpoint, &value),
        Endpoint::Messages => anthropic::check_message(&value),
        Endpoint::CountTokens => anthropic::check_token_count(&value),
        Endpoint::Responses => responses_api::check_response_object(&value),
        Endpoint::StoredResponse => responses_api::check_stored_answer(&value),
        Endpoint::Embeddings => check_embeddings(&value).map(|_| ()),
        Endpoint::Models => {
            if value["object"] != "list" {
                return Err("`object` is not \"list\"".into());
            }
            let models = value["data"].as_array().ok_or("`data` is not a list")?;
            models.iter().try_for_each(check_model)
        }
        Endpoint::Model => check_model(&value),
        Endpoint::Health => match value["status"].as_str() {
            Some("ok") => Ok(()),
            _ => Err(format!("health {value}")),
        },
        Endpoint::Ready if value["status"].is_string() => Ok(()),
        Endpoint::Stats if value.is_object() => Ok(()),
        Endpoint::Ready | Endpoint::Stats => Err(format!("{endpoint:?} {value}")),
        Endpoint::Metrics => unreachable!("checked above"),
        Endpoint::Other => Err("200 from a path the API does not have".into()),
    }
}

/// Prometheus' text format: comments, and samples `name{labels} value [timestamp]`.
fn check_metrics(response: &Response) -> Result<(), String> {
    let content_type = response.head.header("content-type").unwrap_or("none");
    if !content_type.starts_with("text/plain") {
        return Err(format!("metrics with content-type {content_type}"));
    }
    let text = std::str::from_utf8(&response.body).map_err(|_| "metrics that are not UTF-8")?;
    for line in text
        .lines()
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
    {
        let name_end = line
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':'))
            .unwrap_or(line.len());
        let rest = line[name_end..].trim_start();
        let values = match rest.strip_prefix('{') {
            Some(labelled) => labelled.rsplit_once('}').map(|(_, v)| v),
            None => Some(rest),
        };
        let valid = name_end > 0
            && values.is_some_and(|v| {
                let mut numbers = v.split_whitespace();
                let value = numbers
                    .next()
                    .map(|n| n.parse::<f64>().is_ok() || ["+Inf", "-Inf", "NaN"].contains(&n));
                value == Some(true) && numbers.all(|t| t.parse::<i64>().is_ok())
            });
        if !valid {
            return Err(format!("metrics line {line:?}"));
        }
    }
    Ok(())
}

pub fn check_error_response(response: &Response) -> Result<(), String> {
    check_error(&json_body(response)?)
}

pub fn json_body(response: &Response) -> Result<Value, String> {
    let content_type = response.head.header("content-type").unwrap_or("none");
    if !content_type.starts_with("application/json") {
        return Err(format!(
            "{} with content-type {content_type}: {}",
            response.status(),
            crate::http::escape(&response.body, 200)
        ));
    }
    serde_json::from_slice(&response.body).map_err(|e| {
        format!(
            "a body that is not JSON ({e}): {}",
            crate::http::escape(&response.body, 200)
        )
    })
}

fn check_model(model: &Value) -> Result<(), String> {
    if model["object"] != "model" || !model["id"].is_string() {
        return Err(format!("model object {model}"));
    }
    Ok(())
}

/// A whole (not streamed) chat or text completion.
pub fn check_completion(endpoint: Endpoint, value: &Value) -> Result<(), String> {
    let object = if endpoint == Endpoint::Chat {
        "chat.completion"
    } else {
        "text_completion"
    };
    check_envelope(value, object)?;
    let choice = &value["choices"][0];
    if !choice["finish_reason"].is_string() {
        return Err(format!("`finish_reason` {}", choice["finish_reason"]));
    }
    match endpoint {
        Endpoint::Chat => {
            let message = &choice["message"];
            if message["role"] != "assistant"
                || !(message["content"].is_string() || message["content"].is_null())
            {
                return Err(format!("message {message}"));
            }
        }
        _ if !choice["text"].is_string() => return Err(format!("text {}", choice["text"])),
        _ => {}
    }
    let usage = &value["usage"];
    for field in ["prompt_tokens", "completion_tokens", "total_tokens"] {
        if !usage[field].is_u64() {
            return Err(format!("`usage.{field}` {}", usage[field]));
        }
    }
    Ok(())
}

fn check_envelope(value: &Value, object: &str) -> Result<(), String> {
    if value["object"] != object {
        return Err(format!("`object` is {}, not {object:?}", value["object"]));
    }
    if !value["id"].is_string() || !value["created"].is_u64() || !value["model"].is_string() {
        return Err(format!("`id`, `created` or `model` missing: {value}"));
    }
    if !value["choices"].is_array() {
        return Err("`choices` is not a list".into());
    }
    Ok(())
}

/// The vectors of an embeddings list: how many, and whether as base64.
pub struct Embeddings {
    pub count: usize,
    pub base64: bool,
}

/// `{"object": "list", "data": [{"object": "embedding", "index": i, "embedding": ...}], ...}`,
/// every vector of one length, all float lists or all base64 (little-endian f32s).
pub fn check_embeddings(value: &Value) -> Result<Embeddings, String> {
    if value["object"] != "list" || !value["model"].is_string() {
        return Err(format!(
            "`object` or `model` of an embeddings list: {value}"
        ));
    }
    let data = value["data"].as_array().ok_or("`data` is not a list")?;
    let mut lengths = Vec::new();
    let mut base64 = None;
    for (i, item) in data.iter().enumerate() {
        if item["object"] != "embedding" || item["index"] != i {
            return Err(format!("embedding {i}: `object` or `index` {item}"));
        }
        let (length, encoded) = match &item["embedding"] {
            Value::Array(values) if values.iter().all(Value::is_number) => (values.len(), false),
            Value::String(text) => (
                base64_f32s(text).ok_or("a vector that is not base64")?,
                true,
            ),
            other => return Err(format!("embedding {i}: {other}")),
        };
        if *base64.get_or_insert(encoded) != encoded {
            return Err("vectors of both encodings in one list".into());
        }
        lengths.push(length);
    }
    if lengths.windows(2).any(|pair| pair[0] != pair[1]) || lengths.contains(&0) {
        return Err(format!("vectors of lengths {lengths:?}"));
    }
    for field in ["prompt_tokens", "total_tokens"] {
        if !value["usage"][field].is_u64() {
            return Err(format!("`usage.{field}` {}", value["usage"][field]));
        }
    }
    Ok(Embeddings {
        count: data.len(),
        base64: base64.unwrap_or(false),
    })
}

/// The number of f32s that standard base64 `text` holds, if it is that.
fn base64_f32s(text: &str) -> Option<usize> {
    let digits = text.trim_end_matches('=');
    let valid = text.len().is_multiple_of(4)
        && text.len() - digits.len() <= 2
        && digits
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'+' || b == b'/');
    let bytes = digits.len() * 3 / 4;
    (valid && bytes.is_multiple_of(4)).then_some(bytes / 4)
}

/// Whether an error a stream of `endpoint` ended with is the server's own failure, which a
/// 5xx would have been before the stream started.
pub fn is_server_failure(endpoint: Endpoint, error: &Value) -> bool {
    match endpoint {
        Endpoint::Messages => anthropic::is_server_failure(error),
        Endpoint::Responses => responses_api::is_server_failure(error),
        _ => error["error"]["type"] == "server_error",
    }
}

/// How a well-formed stream ended.
#[derive(Debug, Clone, PartialEq)]
pub enum StreamEnd {
    /// With a choice's `finish_reason`.
    Finished(String),
    /// With an error event (then `[DONE]`).
    Error(Value),
}

/// Checks the data events of a stream, in order: chunks, then a finish reason or an error
/// event, then `[DONE]` last.
pub struct StreamCheck {
    endpoint: Endpoint,
    end: Option<StreamEnd>,
    done: bool,
}

impl StreamCheck {
    pub fn new(endpoint: Endpoint) -> Self {
        StreamCheck {
            endpoint,
            end: None,
            done: false,
        }
    }

    pub fn event(&mut self, data: &str) -> Result<(), String> {
        if self.done {
            return Err(format!("an event after [DONE]: {data}"));
        }
        if data == "[DONE]" {
            self.done = true;
            return match self.end {
                Some(_) => Ok(()),
                None => Err("[DONE] before a finish reason or an error".into()),
            };
        }
        let value: Value =
            serde_json::from_str(data).map_err(|e| format!("an event that is not JSON ({e})"))?;
        if value.get("error").is_some() {
            check_error(&value)?;
            self.end = Some(StreamEnd::Error(value));
            return Ok(());
        }
        let object = if self.endpoint == Endpoint::Chat {
            "chat.completion.chunk"
        } else {
            "text_completion"
        };
        check_envelope(&value, object)?;
        if let Some(reason) = value["choices"][0]["finish_reason"].as_str() {
            if self.end.is_some() {
                return Err("a second finish reason".into());
            }
            self.end = Some(StreamEnd::Finished(reason.to_owned()));
        }
        Ok(())
    }

    /// The stream's end, once `[DONE]` has come.
    pub fn finish(self) -> Result<StreamEnd, String> {
        match (self.done, self.end) {
            (true, Some(end)) => Ok(end),
            _ => Err("the stream ended without data: [DONE]".into()),
        }
    }
}

/// A whole event stream's body, of any API.
pub fn check_stream_body(endpoint: Endpoint, body: &[u8]) -> Result<StreamEnd, String> {
    let events = http::data_events(body).map_err(|e| e.to_string())?;
    match endpoint {
        Endpoint::Messages => return anthropic::check_stream(&events),
        Endpoint::Responses => return responses_api::check_stream(&events),
        _ => {}
    }
    let mut check = StreamCheck::new(endpoint);
    for (name, data) in &events {
        if let Some(name) = name {
            return Err(format!(
                "an event named {name:?}: OpenAI's streams name none"
            ));
        }
        check.event(data)?;
    }
    check.finish()
}

/// What reading a streamed answer found.
pub enum Streamed {
    /// A well-formed stream, and how it ended.
    Complete(StreamEnd),
    /// A well-formed error response instead of a stream.
    Refused(u16, Value),
}

/// Reads a response that should be an event stream, checking each event as it comes.
pub fn read_stream(
    connection: &mut Connection,
    endpoint: Endpoint,
    timeout: Duration,
) -> Result<Streamed, String> {
    connection.set_timeout(timeout);
    let head = connection.read_head().map_err(|e| e.to_string())?;
    if !head.is_event_stream() {
        let body = connection
            .body(&head, false)
            .and_then(|b| b.read_to_end())
            .map_err(|e| e.to_string())?;
        let response = Response { head, body };
        if response.status() < 400 {
            return Err(format!("{} that is not an event stream", response.status()));
        }
        check_error_response(&response)?;
        let value = response.json().unwrap_or_default();
        return Ok(Streamed::Refused(response.status(), value));
    }
    if head.status != 200 {
        return Err(format!("an event stream with status {}", head.status));
    }
    let mut check = StreamCheck::new(endpoint);
    let mut events = Events::new(connection.body(&head, false).map_err(|e| e.to_string())?);
    loop {
        match events.next_event() {
            Ok(Some(Event::Data(data))) => check.event(&data)?,
            Ok(Some(Event::Comment)) => {}
            Ok(None) => return check.finish().map(Streamed::Complete),
            Err(e) => return Err(e.to_string()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn streams_must_end_with_done_after_a_finish_reason() {
        let chunk = |finish: Value| {
            json!({"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m",
                   "choices": [{"index": 0, "delta": {}, "finish_reason": finish}]})
        };
        let body = format!(
            ": keepalive 1/2\n\ndata: {}\n\ndata: {}\n\ndata: [DONE]\n\n",
            chunk(Value::Null),
            chunk("length".into())
        );
        assert_eq!(
            check_stream_body(Endpoint::Chat, body.as_bytes()),
            Ok(StreamEnd::Finished("length".into()))
        );
        let cut = format!("data: {}\n\n", chunk(Value::Null));
        assert!(check_stream_body(Endpoint::Chat, cut.as_bytes()).is_err());
        let error = json!({"error": {"message": "x", "type": "server_error"}});
        let failed = format!("data: {error}\n\ndata: [DONE]\n\n");
        assert_eq!(
            check_stream_body(Endpoint::Chat, failed.as_bytes()),
            Ok(StreamEnd::Error(error))
        );
    }

    #[test]
    fn errors_need_a_message_and_a_type() {
        assert!(check_error(&json!({"error": {"message": "m", "type": "t"}})).is_ok());
        assert!(check_error(&json!({"error": "m"})).is_err());
        assert!(check_error(&json!({"detail": "m"})).is_err());
    }
}
