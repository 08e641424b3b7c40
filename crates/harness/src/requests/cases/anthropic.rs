//! Cases of Anthropic's Messages API: `/v1/messages` and `/v1/messages/count_tokens`.

use rand::rngs::StdRng;
use rand::seq::IndexedRandom;
use rand::Rng;
use serde_json::{json, Map, Value};

use super::{
    drawn_field, hostile_value, into_map, nested, post, prompt_text, random_text, short_text,
    with_raw_fields, Case, Promise, Target,
};

const MESSAGES: &str = "/v1/messages";
const COUNT_TOKENS: &str = "/v1/messages/count_tokens";

/// The fields of a Messages request, and some the server does not know.
const FIELDS: [&str; 15] = [
    "model",
    "max_tokens",
    "messages",
    "system",
    "stream",
    "temperature",
    "top_p",
    "top_k",
    "stop_sequences",
    "tools",
    "tool_choice",
    "thinking",
    "metadata",
    "service_tier",
    "container",
];

/// Single characters most of the tiny vocabulary's tokens hold: as stop sequences, with
/// sampling, they end a reply within a few tokens, as the Messages API has no `logit_bias`.
const COMMON_CHARACTERS: [&str; 16] = [
    " ", "e", "t", "a", "o", "i", "n", "s", "r", "h", "l", "d", "c", "u", "p", "m",
];

/// A valid request: few tokens, streamed or not.
fn body(rng: &mut StdRng, target: &Target) -> Map<String, Value> {
    let mut body = json!({
        "model": target.model_id,
        "max_tokens": rng.random_range(1..=8),
        "messages": [{"role": "user", "content": short_text(rng)}],
    });
    if rng.random_bool(0.4) {
        body["stream"] = true.into();
    }
    if rng.random_bool(0.3) {
        body["temperature"] = json!(0.7);
    }
    into_map(body)
}

/// Values at the edges of what each field accepts.
fn boundary_value(rng: &mut StdRng, field: &str, target: &Target) -> String {
    let values: Vec<Value> = match field {
        "max_tokens" => vec![json!(0), json!(1), json!(-1), json!(u64::MAX), json!(1.5)],
        "temperature" => vec![
            json!(0),
            json!(1),
            json!(1.0001),
            json!(-0.1),
            json!(0.00009),
        ],
        "top_p" => vec![json!(0), json!(1), json!(1.01), json!(-0.01)],
        "top_k" => vec![json!(0), json!(target.vocab_size), json!(-1)],
        "stop_sequences" => vec![
            json!(vec!["a"; 16]),
            json!(vec!["a"; 17]),
            json!([""]),
            json!("x"),
            json!([1]),
        ],
        "system" => vec![
            json!([{"type": "text", "text": "Be brief."}]),
            json!([{"type": "image", "source": {}}]),
            json!([{"type": "text"}]),
            json!(prompt_text(rng, target)),
        ],
        "thinking" => vec![
            json!({"type": "enabled", "budget_tokens": 1024}),
            json!({"type": "disabled"}),
            json!({"type": "adaptive"}),
            json!({"type": "on"}),
            json!({"budget_tokens": -1}),
        ],
        "tool_choice" => vec![
            json!({"type": "auto"}),
            json!({"type": "any"}),
            json!({"type": "tool", "name": "nowhere"}),
            json!({"type": "none", "disable_parallel_tool_use": "yes"}),
            json!({"type": "function"}),
        ],
        "tools" => tools().choose_multiple(rng, 2).cloned().collect(),
        "metadata" => vec![json!({"user_id": "u"}), json!({"user_id": 5}), json!([])],
        _ => return hostile_value(rng),
    };
    values.choose(rng).expect("never empty").to_string()
}

/// Tools as Anthropic lists them, valid and not.
fn tools() -> [Value; 8] {
    [
        json!([{"name": "get_weather", "description": "Weather",
                "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]),
        json!([{"type": "custom", "name": "f", "input_schema": {}}]),
        json!([{"type": "web_search_20250305", "name": "web_search"}]),
        json!([{"name": "f"}]),
        json!([{"name": "f", "input_schema": "object"}]),
        json!([{"name": "f", "input_schema": {"type": 5, "properties": []}}]),
        json!([{"input_schema": {}}]),
        json!({"name": "f", "input_schema": {}}),
    ]
}

/// A request with one field set to a value of any type, or at the edge of what it accepts.
pub fn field(rng: &mut StdRng, target: &Target) -> Case {
    let (field, value) = drawn_field(rng, &FIELDS, |rng, field| {
        boundary_value(rng, field, target)
    });
    let mut fields = vec![(field, value)];
    if field == "max_tokens" {
        fields.push(("temperature", "1".into()));
        fields.push(("stop_sequences", json!(COMMON_CHARACTERS).to_string()));
    }
    let path = if rng.random_bool(0.8) {
        MESSAGES
    } else {
        COUNT_TOKENS
    };
    Case::api(
        "anthropic-field",
        post(path, &with_raw_fields(body(rng, target), &fields)),
    )
}

/// A content block of any type, valid in one turn or another, or not at all.
fn block(rng: &mut StdRng, target: &Target) -> Value {
    match rng.random_range(0..14) {
        0 => json!({"type": "text", "text": short_text(rng)}),
        1 => json!({"type": "text", "text": prompt_text(rng, target)}),
        2 => json!({"type": "text"}),
        3 => json!({"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                               "data": "iVBORw0KGgo="}}),
        4 => json!({"type": "document", "source": {"type": "text", "data": "x"}}),
        5 => json!({"type": "tool_result", "tool_use_id": "toolu_unknown", "content": "18C"}),
        6 => json!({"type": "tool_result", "tool_use_id": "toolu_1",
                    "content": [{"type": "text", "text": "18C"}, {"type": "image"}]}),
        7 => json!({"type": "tool_result", "content": 5}),
        8 => json!({"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                    "input": {"city": "Paris"}}),
        9 => json!({"type": "tool_use", "id": "toolu_2", "name": "f", "input": "{}"}),
        10 => json!({"type": "thinking", "thinking": "Hmm.", "signature": "s"}),
        11 => json!({"type": "redacted_thinking", "data": "xyz"}),
        12 => json!({"type": random_text(rng, 8)}),
        _ => serde_json::from_str(&nested(rng.random_range(1..130), true)).unwrap_or_default(),
    }
}

/// A turn of any role and content.
fn turn(rng: &mut StdRng, target: &Target, role: &str) -> Value {
    let content = match rng.random_range(0..6) {
        0 => json!(short_text(rng)),
        1 => json!([]),
        2 => Value::Null,
        3 => json!(42),
        _ => (0..rng.random_range(1..4))
            .map(|_| block(rng, target))
            .collect(),
    };
    let mut turn = json!({"role": role, "content": content});
    if rng.random_bool(0.1) {
        turn.as_object_mut().expect("an object").remove("content");
    }
    turn
}

/// Conversations of every shape: blocks of each type in each turn, tool results for calls
/// never made, roles the API does not have; and a valid conversation with a tool call and its
/// result, which must get a 200.
pub fn conversation(rng: &mut StdRng, target: &Target) -> Case {
    let path = if rng.random_bool(0.75) {
        MESSAGES
    } else {
        COUNT_TOKENS
    };
    let mut body = body(rng, target);
    if rng.random_bool(0.2) {
        let messages = json!([
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": [
                {"type": "text", "text": "Looking."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                 "input": {"city": "Paris"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "18C"},
                {"type": "tool_result", "tool_use_id": "toolu_9", "content": "no such call"}]},
        ]);
        body.insert("messages".into(), messages);
        body.insert("tools".into(), tools()[0].clone());
        let bytes = post(path, Value::Object(body).to_string().as_bytes());
        return Case::promising("anthropic-conversation", bytes, Promise::Status(200));
    }
    let roles = ["user", "assistant", "user", "system", "tool", ""];
    let turns: Vec<Value> = (0..rng.random_range(1..5))
        .map(|i| {
            let role = if rng.random_bool(0.8) {
                roles[i % 2]
            } else {
                *roles.choose(rng).expect("not empty")
            };
            turn(rng, target, role)
        })
        .collect();
    body.insert("messages".into(), turns.into());
    if rng.random_bool(0.3) {
        let tools = tools();
        body.insert(
            "tools".into(),
            tools.choose(rng).expect("not empty").clone(),
        );
    }
    let bytes = post(path, Value::Object(body).to_string().as_bytes());
    Case::api("anthropic-conversation", bytes)
}
