//! What a well-formed answer of OpenAI's Responses API looks like: response objects, their
//! deletion, and the stream of typed, numbered events that builds one. Each check returns what
//! is wrong, for the report.

use serde_json::Value;

use crate::openai::StreamEnd;

/// A response object: its status, output items and usage agree.
pub fn check_response_object(value: &Value) -> Result<(), String> {
    if value["object"] != "response" || !value["id"].is_string() || !value["model"].is_string() {
        return Err(format!("`object`, `id` or `model` of a response: {value}"));
    }
    if !value["created_at"].is_u64() {
        return Err(format!("`created_at` {}", value["created_at"]));
    }
    let status = value["status"].as_str().unwrap_or_default();
    let failed = status == "failed";
    let error_fits = if failed {
        value["error"]["code"].is_string() && value["error"]["message"].is_string()
    } else {
        value["error"].is_null()
    };
    let incomplete = status == "incomplete";
    let details_fit = incomplete == value["incomplete_details"]["reason"].is_string();
    let known = ["completed", "incomplete", "failed", "in_progress"].contains(&status);
    if !known || !error_fits || !details_fit {
        return Err(format!(
            "status {status:?} with error {} and incomplete_details {}",
            value["error"], value["incomplete_details"]
        ));
    }
    let output = value["output"].as_array().ok_or("`output` is not a list")?;
    for item in output {
        check_item(item, true)?;
    }
    let usage = &value["usage"];
    if status == "in_progress" && usage.is_null() {
        return Ok(());
    }
    for field in ["input_tokens", "output_tokens", "total_tokens"] {
        if !usage[field].is_u64() {
            return Err(format!("`usage.{field}` {}", usage[field]));
        }
    }
    Ok(())
}

/// What `GET` (a response object) or `DELETE` (its deletion) answers.
pub fn check_stored_answer(value: &Value) -> Result<(), String> {
    if value.get("deleted").is_none() {
        return check_response_object(value);
    }
    if value["object"] != "response" || !value["id"].is_string() || value["deleted"] != true {
        return Err(format!("a deletion {value}"));
    }
    Ok(())
}

/// Whether the error a stream ended with is the server's own failure.
pub fn is_server_failure(error: &Value) -> bool {
    error["code"] == "server_error"
}

/// An output item; `done`, as `output` and `response.output_item.done` give it.
fn check_item(item: &Value, done: bool) -> Result<(), String> {
    let statuses: &[&str] = if done {
        &["completed", "incomplete"]
    } else {
        &["in_progress"]
    };
    let status_fits = statuses.contains(&item["status"].as_str().unwrap_or_default());
    let fits = item["id"].is_string()
        && match item["type"].as_str() {
            Some("message") => {
                let parts = item["content"].as_array();
                item["role"] == "assistant"
                    && status_fits
                    && parts.is_some_and(|parts| {
                        parts.iter().all(|part| {
                            part["type"] == "output_text"
                                && part["text"].is_string()
                                && part["annotations"].is_array()
                        })
                    })
            }
            Some("reasoning") => item["summary"].is_array(),
            Some("function_call") => {
                status_fits
                    && item["call_id"].is_string()
                    && item["name"].is_string()
                    && item["arguments"].is_string()
            }
            _ => false,
        };
    if !fits {
        return Err(format!("output item {item}"));
    }
    Ok(())
}

/// The text an item's deltas grow, by item type.
fn text_of(item: &Value) -> &str {
    let text = match item["type"].as_str() {
        Some("function_call") => &item["arguments"],
        _ => &item["content"][0]["text"],
    };
    text.as_str().unwrap_or_default()
}

/// The event types that end a stream, each with the response status it gives.
const ENDS: [(&str, &str); 3] = [
    ("response.completed", "completed"),
    ("response.incomplete", "incomplete"),
    ("response.failed", "failed"),
];

/// Where a stream stands.
#[derive(Default)]
struct StreamState {
    events: u64,
    /// Items added so far, and the open one's text as its deltas built it.
    items: u64,
    open: Option<(Value, String)>,
    end: Option<StreamEnd>,
}

/// Checks an event stream, as `(event name, data)` pairs: every event typed as it is named and
/// numbered from 0 on; `response.created` and `response.in_progress` first; each output item
/// added, its deltas (which add up to its final text) and done, one item at a time; and last
/// `response.completed`, `response.incomplete` or `response.failed` with the whole response
/// (or an `error` event).
pub fn check_stream(events: &[(Option<String>, String)]) -> Result<StreamEnd, String> {
    let mut state = StreamState::default();
    for (name, data) in events {
        let value: Value =
            serde_json::from_str(data).map_err(|e| format!("an event that is not JSON ({e})"))?;
        let kind = value["type"].as_str().unwrap_or_default();
        if name.as_deref() != Some(kind) {
            return Err(format!("event named {name:?} with data of type {kind:?}"));
        }
        if state.end.is_some() {
            return Err(format!("an event after the end: {kind}"));
        }
        if value["sequence_number"] != state.events {
            return Err(format!(
                "{kind} numbered {} as event {}",
                value["sequence_number"], state.events
            ));
        }
        state.event(kind, &value)?;
        state.events += 1;
    }
    state
        .end
        .ok_or_else(|| "the stream ended before its last event".into())
}

impl StreamState {
    fn event(&mut self, kind: &str, value: &Value) -> Result<(), String> {
        let opening = ["response.created", "response.in_progress"];
        if let Some(position) = opening.iter().position(|&o| o == kind) {
            if self.events != position as u64 {
                return Err(format!("{kind} as event {}", self.events));
            }
            check_response_object(&value["response"])?;
            return match value["response"]["status"].as_str() {
                Some("in_progress") => Ok(()),
                status => Err(format!("{kind} with status {status:?}")),
            };
        }
        if self.events < 2 && kind != "error" {
            return Err(format!("{kind} before response.created and in_progress"));
        }
        if let Some((_, status)) = ENDS.iter().find(|(end, _)| *end == kind) {
            return self.last(status, &value["response"]);
        }
        match kind {
            "error" => {
                if !value["message"].is_string() {
                    return Err(format!("error event {value}"));
                }
                self.end = Some(StreamEnd::Error(value.clone()));
                Ok(())
            }
            "response.output_item.added" => {
                let item = &value["item"];
                if self.open.is_some() || value["output_index"] != self.items {
                    return Err(format!("{value} with {} items added", self.items));
                }
                check_item(item, false)?;
                self.items += 1;
                self.open = Some((item.clone(), String::new()));
                Ok(())
            }
            "response.output_item.done" => {
                let (added, text) = self.open.take().ok_or("output_item.done with none open")?;
                let item = &value["item"];
                check_item(item, true)?;
                if item["id"] != added["id"] || text_of(item) != text {
                    return Err(format!(
                        "item {item}, added as {added}, its deltas {text:?}"
                    ));
                }
                Ok(())
            }
            _ => self.in_item(kind, value),
        }
    }

    /// An event about the open item's content: its parts, deltas and done text.
    fn in_item(&mut self, kind: &str, value: &Value) -> Result<(), String> {
        let (item, text) = self
            .open
            .as_mut()
            .ok_or(format!("{kind} with no open item"))?;
        if value["item_id"] != item["id"] || value["output_index"] != self.items - 1 {
            return Err(format!("{value} for item {item}"));
        }
        let item_type = item["type"].as_str().unwrap_or_default();
        let (text_kind, part_type) = match item_type {
            "message" => ("output_text", "output_text"),
            "reasoning" => ("reasoning_text", "reasoning_text"),
            _ => ("function_call_arguments", ""),
        };
        let done_field = if part_type.is_empty() {
            "arguments"
        } else {
            "text"
        };
        let in_part = part_type.is_empty() || value["content_index"] == 0;
        let fits = match kind.strip_prefix("response.") {
            Some(rest) if rest == format!("{text_kind}.delta") => match value["delta"].as_str() {
                Some(delta) => {
                    text.push_str(delta);
                    in_part
                }
                None => false,
            },
            Some(rest) if rest == format!("{text_kind}.done") => {
                in_part && value[done_field].as_str() == Some(text.as_str())
            }
            Some("content_part.added" | "content_part.done") => {
                let part = &value["part"];
                let text_fits = kind.ends_with("added") || part["text"] == text.as_str();
                !part_type.is_empty() && in_part && part["type"] == part_type && text_fits
            }
            _ => false,
        };
        if !fits {
            return Err(format!(
                "{value} in a {item_type} item whose deltas are {text:?}"
            ));
        }
        Ok(())
    }

    /// The last event: the whole response, with the status it names and every item added.
    fn last(&mut self, status: &str, response: &Value) -> Result<(), String> {
        check_response_object(response)?;
        let items = response["output"].as_array().map_or(0, Vec::len) as u64;
        if response["status"] != status || self.open.is_some() || items != self.items {
            return Err(format!(
                "a {status} response with {items} items after {} added: {response}",
                self.items
            ));
        }
        self.end = Some(match status {
            "failed" => StreamEnd::Error(response["error"].clone()),
            _ => StreamEnd::Finished(status.to_owned()),
        });
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn response(status: &str, output: Value) -> Value {
        let usage = json!({"input_tokens": 2, "output_tokens": 1, "total_tokens": 3});
        let details = match status {
            "incomplete" => json!({"reason": "max_output_tokens"}),
            _ => Value::Null,
        };
        json!({"id": "resp_1", "object": "response", "created_at": 1, "status": status,
               "model": "m", "error": null, "incomplete_details": details, "output": output,
               "usage": if status == "in_progress" { Value::Null } else { usage }})
    }

    fn numbered(values: &[Value]) -> Vec<(Option<String>, String)> {
        values
            .iter()
            .enumerate()
            .map(|(i, v)| {
                let mut v = v.clone();
                v["sequence_number"] = i.into();
                (v["type"].as_str().map(str::to_owned), v.to_string())
            })
            .collect()
    }

    #[test]
    fn streams_build_their_response_in_order() {
        let message = |text: &str, status: &str| {
            let content = if status == "in_progress" {
                json!([])
            } else {
                json!([{"type": "output_text", "text": text, "annotations": []}])
            };
            json!({"type": "message", "id": "msg_1", "status": status, "role": "assistant",
                   "content": content})
        };
        let at = |kind: &str, extra: Value| {
            let mut event = json!({"type": kind, "item_id": "msg_1", "output_index": 0,
                                   "content_index": 0});
            event
                .as_object_mut()
                .unwrap()
                .extend(extra.as_object().unwrap().clone());
            event
        };
        let part = |text: &str| json!({"type": "output_text", "text": text, "annotations": []});
        let events = [
            json!({"type": "response.created", "response": response("in_progress", json!([]))}),
            json!({"type": "response.in_progress", "response": response("in_progress", json!([]))}),
            json!({"type": "response.output_item.added", "output_index": 0,
                   "item": message("", "in_progress")}),
            at("response.content_part.added", json!({"part": part("")})),
            at("response.output_text.delta", json!({"delta": "Hi"})),
            at("response.output_text.delta", json!({"delta": " there"})),
            at("response.output_text.done", json!({"text": "Hi there"})),
            at(
                "response.content_part.done",
                json!({"part": part("Hi there")}),
            ),
            json!({"type": "response.output_item.done", "output_index": 0,
                   "item": message("Hi there", "incomplete")}),
            json!({"type": "response.incomplete",
                   "response": response("incomplete", json!([message("Hi there", "incomplete")]))}),
        ];
        assert_eq!(
            check_stream(&numbered(&events)),
            Ok(StreamEnd::Finished("incomplete".into()))
        );
        // Deltas that do not add up, a gap in the numbers, and no last event all fail.
        let mut wrong = events.clone();
        wrong[5] = at("response.output_text.delta", json!({"delta": " you"}));
        assert!(check_stream(&numbered(&wrong)).is_err());
        let mut gap = numbered(&events);
        gap.remove(4);
        assert!(check_stream(&gap).is_err());
        assert!(check_stream(&numbered(&events[..9])).is_err());
    }

    #[test]
    fn response_objects_agree_with_their_status() {
        assert!(check_response_object(&response("completed", json!([]))).is_ok());
        let mut failed = response("failed", json!([]));
        assert!(check_response_object(&failed).is_err());
        failed["error"] = json!({"code": "server_error", "message": "m"});
        assert!(check_response_object(&failed).is_ok());
        let mut cut = response("incomplete", json!([]));
        cut["incomplete_details"] = Value::Null;
        assert!(check_response_object(&cut).is_err());
        let deleted = json!({"id": "resp_1", "object": "response", "deleted": true});
        assert!(check_stored_answer(&deleted).is_ok());
        assert!(check_stored_answer(&json!({"id": "resp_1", "deleted": true})).is_err());
    }
}
