//! What a well-formed answer of Anthropic's Messages API looks like: error objects, messages,
//! token counts, and its event stream's grammar. Each check returns what is wrong, for the report.

use serde_json::Value;

use crate::openai::StreamEnd;

const STOP_REASONS: [&str; 6] = [
    "end_turn",
    "max_tokens",
    "stop_sequence",
    "tool_use",
    "pause_turn",
    "refusal",
];

/// The error `type` Anthropic gives a status.
fn error_type(status: u16) -> &'static str {
    match status {
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        503 | 529 => "overloaded_error",
        504 => "timeout_error",
        400..=499 => "invalid_request_error",
        _ => "api_error",
    }
}

/// `{"type": "error", "error": {"type": string, "message": string}}`, its type the status's.
pub fn check_error(value: &Value, status: u16) -> Result<(), String> {
    check_error_event(value)?;
    let wanted = error_type(status);
    if value["error"]["type"] != wanted {
        return Err(format!(
            "error type {} for status {status}, not {wanted:?}",
            value["error"]["type"]
        ));
    }
    Ok(())
}

/// An error object, as a response body or a stream's `error` event.
fn check_error_event(value: &Value) -> Result<(), String> {
    if value["type"] != "error" {
        return Err(format!("an error whose `type` is not \"error\": {value}"));
    }
    let error = &value["error"];
    if !error["type"].is_string() || !error["message"].is_string() {
        return Err(format!(
            "`error` without a string type and message: {value}"
        ));
    }
    Ok(())
}

/// Whether a stream's `error` event tells of the server's own failure.
pub fn is_server_failure(error: &Value) -> bool {
    error["error"]["type"] == "api_error"
}

/// `{"input_tokens": n}`.
pub fn check_token_count(value: &Value) -> Result<(), String> {
    if !value["input_tokens"].is_u64() {
        return Err(format!("a token count without `input_tokens`: {value}"));
    }
    Ok(())
}

/// A whole message: an assistant reply with its content blocks and why it stopped.
pub fn check_message(value: &Value) -> Result<(), String> {
    check_envelope(value)?;
    let content = value["content"]
        .as_array()
        .ok_or("`content` is not a list")?;
    for block in content {
        check_block(block, false)?;
    }
    let reason = value["stop_reason"].as_str().unwrap_or_default();
    check_stop(reason, &value["stop_sequence"])
}

/// What a message has from its `message_start` on: ids, role, model and usage.
fn check_envelope(value: &Value) -> Result<(), String> {
    if value["type"] != "message" || value["role"] != "assistant" {
        return Err(format!("`type` or `role` of a message: {value}"));
    }
    if !value["id"].is_string() || !value["model"].is_string() {
        return Err(format!("a message without an `id` or `model`: {value}"));
    }
    for field in ["input_tokens", "output_tokens"] {
        if !value["usage"][field].is_u64() {
            return Err(format!("`usage.{field}` {}", value["usage"][field]));
        }
    }
    Ok(())
}

/// A stop reason Anthropic has, with a `stop_sequence` exactly when it names one.
fn check_stop(reason: &str, sequence: &Value) -> Result<(), String> {
    if !STOP_REASONS.contains(&reason) {
        return Err(format!("stop reason {reason:?}"));
    }
    let named = sequence.is_string();
    if named != (reason == "stop_sequence") || !(named || sequence.is_null()) {
        return Err(format!(
            "stop reason {reason:?} with stop sequence {sequence}"
        ));
    }
    Ok(())
}

/// A content block; `starting`, as `content_block_start` gives it, its text still empty.
fn check_block(block: &Value, starting: bool) -> Result<(), String> {
    let text_field = match block["type"].as_str() {
        Some("text") => "text",
        Some("thinking") => "thinking",
        Some("tool_use") => {
            let named = block["id"].is_string() && block["name"].is_string();
            if !named || block.get("input").is_none() {
                return Err(format!("tool_use block {block}"));
            }
            return Ok(());
        }
        _ => return Err(format!("content block {block}")),
    };
    match block[text_field].as_str() {
        Some(text) if !starting || text.is_empty() => Ok(()),
        _ => Err(format!("content block {block}")),
    }
}

/// The delta type each block type grows by.
fn delta_type(block_type: &str) -> &'static [&'static str] {
    match block_type {
        "text" => &["text_delta"],
        "thinking" => &["thinking_delta", "signature_delta"],
        _ => &["input_json_delta"],
    }
}

/// Where a stream stands in its grammar.
#[derive(Debug)]
enum Stage {
    Start,
    /// After `message_start`: blocks, one at a time, then `message_delta`.
    Blocks {
        next: u64,
        open: Option<String>,
    },
    /// After `message_delta`, which gave the stop reason.
    Delta(String),
    Stopped(String),
    Failed(Value),
}

/// Checks an event stream, as `(event name, data)` pairs: `message_start`, then each content
/// block's `content_block_start`, deltas of its type and `content_block_stop`, one after
/// another, then `message_delta` and `message_stop`; `ping`s anywhere, and an `error` event
/// may end it at any point.
pub fn check_stream(events: &[(Option<String>, String)]) -> Result<StreamEnd, String> {
    let mut stage = Stage::Start;
    for (name, data) in events {
        let value: Value =
            serde_json::from_str(data).map_err(|e| format!("an event that is not JSON ({e})"))?;
        let kind = value["type"].as_str().unwrap_or_default().to_owned();
        if name.as_deref() != Some(kind.as_str()) {
            return Err(format!("event named {name:?} with data of type {kind:?}"));
        }
        stage = next_stage(stage, &kind, value)?;
    }
    match stage {
        Stage::Stopped(reason) => Ok(StreamEnd::Finished(reason)),
        Stage::Failed(error) => Ok(StreamEnd::Error(error)),
        stage => Err(format!(
            "the stream ended at {stage:?}, before message_stop"
        )),
    }
}

fn next_stage(stage: Stage, kind: &str, value: Value) -> Result<Stage, String> {
    let out_of_order = |stage: &Stage| format!("{kind} at {stage:?}");
    if matches!(stage, Stage::Stopped(_) | Stage::Failed(_)) {
        return Err(format!("an event after the end: {kind}"));
    }
    match (kind, stage) {
        ("ping", stage) => Ok(stage),
        ("error", _) => {
            check_error_event(&value)?;
            Ok(Stage::Failed(value))
        }
        ("message_start", Stage::Start) => {
            let message = &value["message"];
            check_envelope(message)?;
            let empty = message["content"].as_array().is_some_and(Vec::is_empty);
            if !empty || !message["stop_reason"].is_null() {
                return Err(format!(
                    "message_start with content or a stop reason: {message}"
                ));
            }
            Ok(Stage::Blocks {
                next: 0,
                open: None,
            })
        }
        ("content_block_start", Stage::Blocks { next, open: None }) => {
            if value["index"] != next {
                return Err(format!(
                    "content_block_start {} after {next} blocks",
                    value["index"]
                ));
            }
            let block = &value["content_block"];
            check_block(block, true)?;
            let open = block["type"].as_str().map(str::to_owned);
            Ok(Stage::Blocks { next, open })
        }
        (
            "content_block_delta",
            Stage::Blocks {
                next,
                open: Some(open),
            },
        ) => {
            let delta = &value["delta"];
            let delta_kind = delta["type"].as_str().unwrap_or_default();
            let field = delta_kind.strip_suffix("_delta").unwrap_or_default();
            let field = if field == "input_json" {
                "partial_json"
            } else {
                field
            };
            let fits = delta_type(&open).contains(&delta_kind) && delta[field].is_string();
            if value["index"] != next || !fits {
                return Err(format!("{value} in an open {open} block {next}"));
            }
            Ok(Stage::Blocks {
                next,
                open: Some(open),
            })
        }
        (
            "content_block_stop",
            Stage::Blocks {
                next,
                open: Some(_),
            },
        ) => {
            if value["index"] != next {
                return Err(format!(
                    "content_block_stop {} for block {next}",
                    value["index"]
                ));
            }
            Ok(Stage::Blocks {
                next: next + 1,
                open: None,
            })
        }
        ("message_delta", Stage::Blocks { open: None, .. }) => {
            let delta = &value["delta"];
            let reason = delta["stop_reason"].as_str().unwrap_or_default();
            check_stop(reason, &delta["stop_sequence"])?;
            if !value["usage"]["output_tokens"].is_u64() {
                return Err(format!(
                    "message_delta without `usage.output_tokens`: {value}"
                ));
            }
            Ok(Stage::Delta(reason.to_owned()))
        }
        ("message_stop", Stage::Delta(reason)) => Ok(Stage::Stopped(reason)),
        (_, stage) => Err(out_of_order(&stage)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn events(values: &[Value]) -> Vec<(Option<String>, String)> {
        values
            .iter()
            .map(|v| (v["type"].as_str().map(str::to_owned), v.to_string()))
            .collect()
    }

    fn start() -> Value {
        json!({"type": "message_start", "message": {"id": "msg_1", "type": "message",
            "role": "assistant", "model": "m", "content": [], "stop_reason": null,
            "stop_sequence": null, "usage": {"input_tokens": 3, "output_tokens": 0}}})
    }

    #[test]
    fn streams_follow_the_event_grammar() {
        let block_start = json!({"type": "content_block_start", "index": 0,
                                 "content_block": {"type": "text", "text": ""}});
        let delta = json!({"type": "content_block_delta", "index": 0,
                           "delta": {"type": "text_delta", "text": "Hi"}});
        let block_stop = json!({"type": "content_block_stop", "index": 0});
        let message_delta = json!({"type": "message_delta",
            "delta": {"stop_reason": "max_tokens", "stop_sequence": null},
            "usage": {"output_tokens": 1}});
        let stop = json!({"type": "message_stop"});
        let ping = json!({"type": "ping"});
        let whole = [
            start(),
            ping.clone(),
            block_start.clone(),
            delta.clone(),
            block_stop.clone(),
            message_delta.clone(),
            stop.clone(),
        ];
        assert_eq!(
            check_stream(&events(&whole)),
            Ok(StreamEnd::Finished("max_tokens".into()))
        );
        // A delta outside its block, a block left open, and no message_stop all fail.
        let early = [start(), delta.clone(), block_stop.clone()];
        assert!(check_stream(&events(&early)).is_err());
        let open = [start(), block_start.clone(), message_delta.clone(), stop];
        assert!(check_stream(&events(&open)).is_err());
        assert!(check_stream(&events(&whole[..6])).is_err());
        let thinking = json!({"type": "content_block_delta", "index": 0,
                              "delta": {"type": "thinking_delta", "thinking": "x"}});
        assert!(check_stream(&events(&[start(), block_start, thinking])).is_err());
        let error = json!({"type": "error", "error": {"type": "api_error", "message": "m"}});
        assert_eq!(
            check_stream(&events(&[start(), error.clone()])),
            Ok(StreamEnd::Error(error))
        );
        let mut misnamed = events(&[start()]);
        misnamed[0].0 = Some("ping".into());
        assert!(check_stream(&misnamed).is_err());
    }

    #[test]
    fn error_types_follow_the_status() {
        let error = |kind: &str| json!({"type": "error", "error": {"type": kind, "message": "m"}});
        assert!(check_error(&error("invalid_request_error"), 400).is_ok());
        assert!(check_error(&error("not_found_error"), 404).is_ok());
        assert!(check_error(&error("invalid_request_error"), 413).is_err());
        assert!(check_error(&json!({"error": {"type": "x", "message": "m"}}), 400).is_err());
    }

    #[test]
    fn stop_sequences_come_with_their_reason() {
        assert!(check_stop("stop_sequence", &json!("END")).is_ok());
        assert!(check_stop("end_turn", &Value::Null).is_ok());
        assert!(check_stop("end_turn", &json!("END")).is_err());
        assert!(check_stop("stop_sequence", &Value::Null).is_err());
        assert!(check_stop("length", &Value::Null).is_err());
    }
}
