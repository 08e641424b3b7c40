//! The fuzzer's cases: each is drawn from its own seeded generator, so that case N of a seed is
//! the same request on every run and can be replayed alone. The OpenAI API's are here; the
//! other APIs' are in the modules below, built from the same pieces.

mod anthropic;
mod embeddings;
mod responses;

use rand::rngs::StdRng;
use rand::seq::IndexedRandom;
use rand::{Rng, SeedableRng};
use serde_json::{json, Map, Value};

use crate::http::{self, post_json, request};
use crate::openai::Endpoint;

/// What the fuzzer needs to know of the server and its model.
pub struct Target {
    /// The id `/v1/models` lists.
    pub model_id: String,
    /// A `logit_bias` that ends a generation at once: requests with a huge `max_tokens` get it.
    pub ends_at_once: Value,
    pub vocab_size: u64,
    pub max_context: u64,
    /// Whether the model embeds: else every embeddings request gets a 400.
    pub embeds: bool,
    /// The server's `--max-request-bytes`.
    pub max_request_bytes: usize,
}

/// One fuzzed connection: bytes to send and the responses they should get.
pub struct Case {
    pub kind: &'static str,
    pub bytes: Vec<u8>,
    /// One per request sent (several when pipelined), in order.
    pub answers: Vec<Expected>,
    /// Well-formed HTTP: the API must answer it. Otherwise the HTTP layer may refuse it with a
    /// bare 4xx or by closing the connection.
    pub http_valid: bool,
}

#[derive(Clone, Copy)]
pub struct Expected {
    pub endpoint: Endpoint,
    /// A HEAD request, whose answer has no body.
    pub head: bool,
    pub promise: Promise,
}

/// What an answer must be beyond well-formed in its API's shapes.
#[derive(Clone, Copy, Debug)]
pub enum Promise {
    WellFormed,
    /// This status: a valid request's 200, a 404 for an id the server cannot have.
    Status(u16),
    /// `count` vectors, as base64 or as floats.
    Embeddings {
        count: usize,
        base64: bool,
    },
    /// A 400 naming `model`: the served model does not embed.
    CannotEmbed,
}

impl Case {
    fn api(kind: &'static str, bytes: Vec<u8>) -> Case {
        Case {
            kind,
            answers: vec![Expected::of_request(&bytes)],
            bytes,
            http_valid: true,
        }
    }

    /// A request whose answer must keep `promise`.
    fn promising(kind: &'static str, bytes: Vec<u8>, promise: Promise) -> Case {
        let mut case = Case::api(kind, bytes);
        case.answers[0].promise = promise;
        case
    }

    fn protocol(kind: &'static str, bytes: Vec<u8>) -> Case {
        Case {
            http_valid: false,
            ..Case::api(kind, bytes)
        }
    }
}

impl Expected {
    /// What the request line of `bytes` asks for.
    fn of_request(bytes: &[u8]) -> Expected {
        // Servers skip empty lines before the request line.
        let start = bytes.iter().position(|b| !b"\r\n".contains(b)).unwrap_or(0);
        let line = bytes[start..]
            .split(|&b| b == b'\r')
            .next()
            .unwrap_or_default();
        let mut words = line.split(|&b| b == b' ');
        let method = words.next().unwrap_or_default();
        let path = String::from_utf8_lossy(words.next().unwrap_or_default());
        Expected {
            endpoint: Endpoint::of_path(&path),
            head: method == b"HEAD",
            promise: Promise::WellFormed,
        }
    }
}

/// Draws a case of one kind.
type Generate = fn(&mut StdRng, &Target) -> Case;

/// Case `index` of `seed`.
pub fn case(seed: u64, index: u64, target: &Target) -> Case {
    let mut rng =
        StdRng::seed_from_u64(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15).wrapping_add(index));
    let generators: [(u32, Generate); 21] = [
        (25, chat_field),
        (12, completion_field),
        (5, several_fields),
        (10, messages),
        (5, prompt),
        (8, json_syntax),
        (3, json_nesting),
        (4, body_bytes),
        (4, content_type),
        (5, headers),
        (6, get_endpoints),
        (5, methods),
        (4, paths),
        (4, malformed_http),
        (2, pipelined),
        (4, boundaries),
        (8, anthropic::field),
        (7, anthropic::conversation),
        (8, responses::field),
        (7, responses::input),
        (5, embeddings::request),
    ];
    let total: u32 = generators.iter().map(|(weight, _)| weight).sum();
    let mut draw = rng.random_range(0..total);
    for (weight, generate) in generators {
        if draw < weight {
            return generate(&mut rng, target);
        }
        draw -= weight;
    }
    unreachable!("the draw is below the weights' total")
}

const CHAT: &str = "/v1/chat/completions";
const COMPLETIONS: &str = "/v1/completions";

/// Fields of a chat or completion request, as the server knows them, and ones it does not.
const FIELDS: [&str; 32] = [
    "model",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "stream",
    "stream_options",
    "stop",
    "seed",
    "logit_bias",
    "logprobs",
    "top_logprobs",
    "n",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "repetition_context_size",
    "presence_context_size",
    "frequency_context_size",
    "xtc_probability",
    "xtc_threshold",
    "tools",
    "tool_choice",
    "chat_template_kwargs",
    "role_mapping",
    "adapters",
    "response_format",
    "user",
    "messages",
    "prompt",
];

/// JSON of every type, and numbers at the edges of every integer and float width.
const HOSTILE: [&str; 62] = [
    "null",
    "true",
    "false",
    "0",
    "-1",
    "1",
    "1.5",
    "-1.5",
    "0.0",
    "-0.0",
    "1e-7",
    "1e-45",
    "5e-324",
    "1e308",
    "-1e308",
    "1.7976931348623157e308",
    "3.4028235e38",
    "3.5e38",
    "2147483647",
    "2147483648",
    "4294967295",
    "4294967296",
    "9007199254740993",
    "9223372036854775807",
    "9223372036854775808",
    "18446744073709551615",
    "18446744073709551616",
    "-9223372036854775808",
    "-9223372036854775809",
    "123456789012345678901234567890",
    "1e400",
    "-1e400",
    "1e-400",
    "\"\"",
    "\"x\"",
    "\"1\"",
    "\"-1\"",
    "\"NaN\"",
    "\"Infinity\"",
    "\"true\"",
    "\"\\u0000\"",
    "\"\\ud800\"",
    "\"\\udc00\\ud800\"",
    "\"\\u202e\\u0000\\uffff\"",
    "\"😀\"",
    "\"{{ 7*7 }}{% for x in range(99999999) %}{% endfor %}\"",
    "\"<|im_start|>system\\n<|im_end|>\"",
    "\"../../../../../etc/passwd\"",
    "\"%s%n%x\"",
    "[]",
    "{}",
    "[1]",
    "[\"a\"]",
    "[null]",
    "[[]]",
    "{\"a\": 1}",
    "{\"\": null}",
    "[1, \"a\", null, {}, []]",
    "{\"type\": \"function\"}",
    "{\"include_usage\": true}",
    "[{\"type\": \"function\", \"function\": {\"name\": \"f\", \"parameters\": {}}}]",
    "{\"enable_thinking\": true}",
];

/// Not JSON at all: literals other languages print.
const NOT_JSON: [&str; 14] = [
    "NaN",
    "Infinity",
    "-Infinity",
    "nan",
    "inf",
    "+1",
    "01",
    ".5",
    "1.",
    "0x10",
    "1_000",
    "undefined",
    "None",
    "'x'",
];

/// Values at the edges of what each field accepts, per field.
fn boundary_value(rng: &mut StdRng, field: &str, target: &Target) -> String {
    let vocab = target.vocab_size;
    let values: Vec<String> = match field {
        "max_tokens" | "max_completion_tokens" => vec!["1".into(), "0".into(), "2".into()],
        "temperature" => [
            "0",
            "0.0001",
            "0.000099",
            "2",
            "100",
            "3.4028235e38",
            "1e39",
        ]
        .map(String::from)
        .to_vec(),
        "top_p" | "min_p" | "xtc_probability" | "xtc_threshold" => {
            ["0", "1", "1.0000001", "-0.0000001", "0.5"]
                .map(String::from)
                .to_vec()
        }
        "top_k" => vec![
            "0".into(),
            "1".into(),
            (vocab - 1).to_string(),
            vocab.to_string(),
            (vocab + 1).to_string(),
        ],
        "presence_penalty" | "frequency_penalty" => {
            ["-2", "2", "-2.0001", "2.0001"].map(String::from).to_vec()
        }
        "repetition_penalty" => ["0", "0.01", "0.0099", "100", "100.01", "1"]
            .map(String::from)
            .to_vec(),
        "repetition_context_size" | "presence_context_size" | "frequency_context_size" => {
            ["0", "1", "100000"].map(String::from).to_vec()
        }
        "top_logprobs" => ["0", "1", "20", "21"].map(String::from).to_vec(),
        "logit_bias" => vec![
            json!({"0": 100, (vocab - 1).to_string(): -100}).to_string(),
            json!({vocab.to_string(): 1}).to_string(),
            json!({"1": 100.5}).to_string(),
            json!({"1": -100.5}).to_string(),
            Value::Object((0..vocab).map(|id| (id.to_string(), json!(-1))).collect()).to_string(),
        ],
        "stop" => vec![
            json!(vec!["a"; 16]).to_string(),
            json!(vec!["a"; 17]).to_string(),
            json!([""]).to_string(),
            json!(["x".repeat(10_000)]).to_string(),
        ],
        "seed" => ["0", "18446744073709551615", "18446744073709551616", "-1"]
            .map(String::from)
            .to_vec(),
        "n" => ["1", "2", "0"].map(String::from).to_vec(),
        _ => HOSTILE.map(String::from).to_vec(),
    };
    values.choose(rng).expect("never empty").clone()
}

/// A value for any field: any type, numbers at every edge, huge strings, deep nesting.
fn hostile_value(rng: &mut StdRng) -> String {
    match rng.random_range(0..20) {
        0..=11 => HOSTILE.choose(rng).expect("not empty").to_string(),
        12 => NOT_JSON.choose(rng).expect("not empty").to_string(),
        13 => Value::from(huge_text(rng)).to_string(),
        14 => nested(rng.random_range(1..200), rng.random_bool(0.5)),
        15 => json!(vec![huge_text(rng); rng.random_range(1..20)]).to_string(),
        16 => format!("{}", rng.random::<i64>()),
        17 => format!(
            "{:e}",
            rng.random::<f64>() * 10f64.powi(rng.random_range(-300..300))
        ),
        _ => Value::from(random_text(rng, 40)).to_string(),
    }
}

/// Text of up to a megabyte: one repeated character, or random characters of every plane.
fn huge_text(rng: &mut StdRng) -> String {
    let length = 1usize << rng.random_range(4..20);
    if rng.random_bool(0.5) {
        "A".repeat(length)
    } else {
        random_text(rng, length / 4)
    }
}

/// A prompt's text: a moderate one, or one past the model's context. A long prompt within the
/// context would be accepted, and its prefill take minutes on a CPU.
fn prompt_text(rng: &mut StdRng, target: &Target) -> String {
    match rng.random_range(0..3) {
        0 => {
            let length = rng.random_range(1..2000);
            random_text(rng, length)
        }
        1 => "A".repeat(rng.random_range(1..8192)),
        _ => "a ".repeat(target.max_context as usize + 1000),
    }
}

/// Random characters from ASCII, controls, combining marks, other scripts and emoji.
fn random_text(rng: &mut StdRng, length: usize) -> String {
    (0..length)
        .map(|_| match rng.random_range(0..6) {
            0 => char::from(rng.random_range(0u8..0x20)),
            1 => char::from_u32(rng.random_range(0x300..0x370)).unwrap_or('?'),
            2 => char::from_u32(rng.random_range(0x4e00..0x9fff)).unwrap_or('?'),
            3 => char::from_u32(rng.random_range(0x1f600..0x1f650)).unwrap_or('?'),
            _ => char::from(rng.random_range(0x20u8..0x7f)),
        })
        .collect()
}

/// `depth` arrays (or objects) inside each other.
fn nested(depth: usize, objects: bool) -> String {
    if objects {
        format!("{}1{}", "{\"a\":".repeat(depth), "}".repeat(depth))
    } else {
        format!("{}1{}", "[".repeat(depth), "]".repeat(depth))
    }
}

fn short_text(rng: &mut StdRng) -> String {
    let words = [
        "the", "sea", "is", "calm", "tonight", "tell", "me", "a", "story", "about",
    ];
    (0..rng.random_range(1..12))
        .map(|_| *words.choose(rng).expect("not empty"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// A valid chat request: few tokens, streamed or not.
fn chat_body(rng: &mut StdRng, target: &Target) -> Map<String, Value> {
    let mut body = json!({
        "model": target.model_id,
        "messages": [{"role": "user", "content": short_text(rng)}],
        "max_tokens": rng.random_range(1..=8),
    });
    add_common(rng, &mut body);
    into_map(body)
}

fn completion_body(rng: &mut StdRng, target: &Target) -> Map<String, Value> {
    let mut body = json!({
        "model": target.model_id,
        "prompt": short_text(rng),
        "max_tokens": rng.random_range(1..=8),
    });
    add_common(rng, &mut body);
    into_map(body)
}

fn add_common(rng: &mut StdRng, body: &mut Value) {
    if rng.random_bool(0.4) {
        body["stream"] = true.into();
        if rng.random_bool(0.3) {
            body["stream_options"] = json!({"include_usage": true});
        }
    }
    if rng.random_bool(0.3) {
        body["temperature"] = json!(0.7);
        body["seed"] = json!(rng.random_range(0..1000));
    }
}

fn into_map(value: Value) -> Map<String, Value> {
    match value {
        Value::Object(map) => map,
        _ => unreachable!("built as an object"),
    }
}

/// The body's JSON with `fields` set to raw JSON text (which need not be valid JSON).
fn with_raw_fields(mut body: Map<String, Value>, fields: &[(&str, String)]) -> Vec<u8> {
    for (name, _) in fields {
        body.remove(*name);
    }
    let mut text = Value::Object(body).to_string();
    text.pop();
    for (name, raw) in fields {
        text.push_str(&format!(",{}:{raw}", Value::from(*name)));
    }
    text.push('}');
    text.into_bytes()
}

fn post(path: &str, body: &[u8]) -> Vec<u8> {
    request(
        "POST",
        path,
        &[("Content-Type", "application/json")],
        body,
        false,
    )
}

/// A huge `max_tokens` that the server accepts would decode for minutes: such requests favour
/// the end of sequence, so that they end at once.
fn ending_soon(target: &Target, fields: &mut Vec<(&str, String)>) {
    let limits_tokens = fields.iter().any(|(name, _)| {
        matches!(
            *name,
            "max_tokens" | "max_completion_tokens" | "max_output_tokens"
        )
    });
    if limits_tokens && !fields.iter().any(|(name, _)| *name == "logit_bias") {
        fields.push(("logit_bias", target.ends_at_once.to_string()));
    }
}

/// One of `fields`, half the time at the edge of what it accepts (`boundary`), otherwise of
/// any type.
fn drawn_field(
    rng: &mut StdRng,
    fields: &[&'static str],
    boundary: impl FnOnce(&mut StdRng, &str) -> String,
) -> (&'static str, String) {
    let field = *fields.choose(rng).expect("not empty");
    let value = if rng.random_bool(0.5) {
        boundary(rng, field)
    } else {
        hostile_value(rng)
    };
    (field, value)
}

fn field_value(rng: &mut StdRng, field: &str, target: &Target) -> String {
    if field == "prompt" {
        return prompt_value(rng, target);
    }
    if rng.random_bool(0.3) {
        boundary_value(rng, field, target)
    } else {
        hostile_value(rng)
    }
}

fn chat_field(rng: &mut StdRng, target: &Target) -> Case {
    let field = *FIELDS.choose(rng).expect("not empty");
    let mut fields = vec![(field, field_value(rng, field, target))];
    ending_soon(target, &mut fields);
    Case::api(
        "chat-field",
        post(CHAT, &with_raw_fields(chat_body(rng, target), &fields)),
    )
}

fn completion_field(rng: &mut StdRng, target: &Target) -> Case {
    let field = *FIELDS.choose(rng).expect("not empty");
    let mut fields = vec![(field, field_value(rng, field, target))];
    ending_soon(target, &mut fields);
    let body = with_raw_fields(completion_body(rng, target), &fields);
    Case::api("completion-field", post(COMPLETIONS, &body))
}

fn several_fields(rng: &mut StdRng, target: &Target) -> Case {
    let count = rng.random_range(2..6);
    let chosen: Vec<&str> = FIELDS.choose_multiple(rng, count).copied().collect();
    let mut fields: Vec<(&str, String)> = chosen
        .into_iter()
        .map(|field| (field, field_value(rng, field, target)))
        .collect();
    ending_soon(target, &mut fields);
    let (path, body) = if rng.random_bool(0.5) {
        (CHAT, chat_body(rng, target))
    } else {
        (COMPLETIONS, completion_body(rng, target))
    };
    Case::api(
        "several-fields",
        post(path, &with_raw_fields(body, &fields)),
    )
}

/// A chat message of any shape: roles, content types, tool calls.
fn hostile_message(rng: &mut StdRng, target: &Target) -> Value {
    let role = *[
        "user",
        "system",
        "assistant",
        "tool",
        "developer",
        "robot",
        "",
    ]
    .choose(rng)
    .expect("not empty");
    let content: Value = match rng.random_range(0..10) {
        0 => Value::Null,
        1 => json!(42),
        2 => json!({"text": "x"}),
        3 => json!([{"type": "text", "text": "part one"}, {"type": "text", "text": "two"}]),
        4 => json!([{"type": "image_url", "image_url": {"url": "data:,"}}]),
        5 => json!([{"type": "text"}, {"type": "text", "text": 5}, "bare", null]),
        6 => prompt_text(rng, target).into(),
        7 => serde_json::from_str(&nested(rng.random_range(1..130), false)).unwrap_or_default(),
        _ => random_text(rng, 30).into(),
    };
    let mut message = json!({"role": role, "content": content});
    match rng.random_range(0..8) {
        0 => {
            message.as_object_mut().expect("an object").remove("role");
        }
        1 => message["role"] = json!(7),
        2 => {
            message["tool_calls"] = json!([{"id": "1", "type": "function",
                "function": {"name": "f", "arguments": {"a": [1, 2]}}}]);
        }
        3 => message["tool_calls"] = json!("not a list"),
        4 => message["tool_calls"] = json!([{}, null, {"function": null}]),
        5 => message["name"] = json!(random_text(rng, 10)),
        6 => message["tool_call_id"] = json!(12),
        _ => {}
    }
    message
}

fn messages(rng: &mut StdRng, target: &Target) -> Case {
    let messages: String = match rng.random_range(0..6) {
        0 => hostile_value(rng),
        1 => "[]".into(),
        2 => json!(["hi", 1, null, []]).to_string(),
        3 => {
            let many: Vec<Value> = (0..rng.random_range(50..300))
                .map(|i| {
                    let role = if i % 2 == 0 { "user" } else { "assistant" };
                    json!({"role": role, "content": short_text(rng)})
                })
                .collect();
            Value::from(many).to_string()
        }
        _ => {
            let list: Vec<Value> = (0..rng.random_range(1..5))
                .map(|_| hostile_message(rng, target))
                .collect();
            Value::from(list).to_string()
        }
    };
    let mut fields = vec![("messages", messages)];
    if rng.random_bool(0.2) {
        let tools = json!([{"type": "function", "function": {"name": "get_weather",
            "description": "Weather", "parameters": {"type": "object",
            "properties": {"city": {"type": "string"}}}}}]);
        fields.push(("tools", tools.to_string()));
    }
    let body = with_raw_fields(chat_body(rng, target), &fields);
    Case::api("messages", post(CHAT, &body))
}

fn prompt(rng: &mut StdRng, target: &Target) -> Case {
    let body = with_raw_fields(
        completion_body(rng, target),
        &[("prompt", prompt_value(rng, target))],
    );
    Case::api("prompt", post(COMPLETIONS, &body))
}

/// A completion's `prompt`: text, token ids in and out of the vocabulary, other types.
fn prompt_value(rng: &mut StdRng, target: &Target) -> String {
    let vocab = target.vocab_size;
    match rng.random_range(0..12) {
        0 => "\"\"".into(),
        1 => "\"   \\n\\t  \"".into(),
        2 => Value::from(prompt_text(rng, target)).to_string(),
        3 => "\"<|im_start|><|im_end|><|endoftext|>\"".into(),
        4 => json!([]).to_string(),
        5 => json!([0, 1, vocab - 1]).to_string(),
        6 => json!([vocab]).to_string(),
        7 => format!("[-1, 1.5, {}]", u64::MAX),
        8 => json!(["a", "b"]).to_string(),
        9 => json!([[1, 2], [3]]).to_string(),
        10 => Value::from(random_text(rng, 200)).to_string(),
        _ => HOSTILE.choose(rng).expect("not empty").to_string(),
    }
}

/// A valid body made invalid JSON: cut, spliced, or replaced by near-JSON.
fn json_syntax(rng: &mut StdRng, target: &Target) -> Case {
    let valid = Value::Object(chat_body(rng, target))
        .to_string()
        .into_bytes();
    let body: Vec<u8> = match rng.random_range(0..8) {
        0 => valid[..rng.random_range(0..valid.len())].to_vec(),
        1 => {
            let mut body = valid.clone();
            let at = rng.random_range(0..body.len());
            body.insert(at, *b"{}[]\",:\\ ".choose(rng).expect("not empty"));
            body
        }
        2 => {
            let mut body = valid.clone();
            body.remove(rng.random_range(0..body.len()));
            body
        }
        3 => [valid.as_slice(), b" {} trailing"].concat(),
        4 => [b"\xEF\xBB\xBF".as_slice(), valid.as_slice()].concat(),
        5 => String::from_utf8_lossy(&valid)
            .replace('"', "'")
            .into_bytes(),
        6 => String::from_utf8_lossy(&valid)
            .replacen('}', ", // comment\n}", 1)
            .into_bytes(),
        _ => [
            "",
            "{",
            "}",
            "null",
            "[]",
            "\"text\"",
            "123",
            "{\"messages\": }",
            "{,}",
        ]
        .choose(rng)
        .expect("not empty")
        .as_bytes()
        .to_vec(),
    };
    let path = *[
        CHAT,
        CHAT,
        COMPLETIONS,
        "/v1/messages",
        "/v1/messages/count_tokens",
        "/v1/responses",
        "/v1/embeddings",
    ]
    .choose(rng)
    .expect("not empty");
    Case::api("json-syntax", post(path, &body))
}

/// Arrays and objects nested around and beyond the parser's recursion limit (128).
fn json_nesting(rng: &mut StdRng, target: &Target) -> Case {
    let depth = *[100, 126, 127, 128, 129, 1000, 100_000]
        .choose(rng)
        .expect("not empty");
    let deep = nested(depth, rng.random_bool(0.5));
    let field = *[
        "content",
        "chat_template_kwargs",
        "tools",
        "stop",
        "logit_bias",
        "whole",
    ]
    .choose(rng)
    .expect("not empty");
    let body = match field {
        "whole" => deep.into_bytes(),
        "content" => {
            format!("{{\"messages\":[{{\"role\":\"user\",\"content\":{deep}}}],\"max_tokens\":2}}")
                .into_bytes()
        }
        other => with_raw_fields(chat_body(rng, target), &[(other, deep)]),
    };
    Case::api("json-nesting", post(CHAT, &body))
}

/// Bodies that are not UTF-8 JSON, or too large to accept.
fn body_bytes(rng: &mut StdRng, target: &Target) -> Case {
    let body: Vec<u8> = match rng.random_range(0..8) {
        0 => {
            let mut bytes = vec![0u8; rng.random_range(1..4096)];
            rng.fill(&mut bytes[..]);
            bytes
        }
        1 => b"{\"messages\":[{\"role\":\"user\",\"content\":\"\xff\xfe\xc0\xaf\"}]}".to_vec(),
        2 => b"{\"prompt\":\"\xed\xa0\x80\",\"max_tokens\":2}".to_vec(),
        3 => b"{\"messages\":[{\"role\":\"user\",\"content\":\"a\x00b\"}]}".to_vec(),
        4 => "{\"prompt\": \"hi\"}"
            .encode_utf16()
            .flat_map(u16::to_le_bytes)
            .collect(),
        5 => Vec::new(),
        6 => {
            // Over the server's limit, in a valid prompt.
            let text = "a".repeat(target.max_request_bytes);
            json!({"prompt": text, "max_tokens": 1})
                .to_string()
                .into_bytes()
        }
        _ => {
            let text = "a ".repeat(rng.random_range(1..2000));
            json!({"messages": [{"role": "user", "content": text}], "max_tokens": 1})
                .to_string()
                .into_bytes()
        }
    };
    let path = if rng.random_bool(0.5) {
        CHAT
    } else {
        COMPLETIONS
    };
    Case::api("body-bytes", post(path, &body))
}

fn content_type(rng: &mut StdRng, target: &Target) -> Case {
    let kind = *[
        "",
        "text/plain",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
        "application/json; charset=utf-16",
        "application/json; charset=",
        "APPLICATION/JSON",
        "*/*",
        "application/json, text/plain",
        "application/json\u{0}",
    ]
    .choose(rng)
    .expect("not empty");
    let body = Value::Object(chat_body(rng, target)).to_string();
    let headers: Vec<(&str, &str)> = if kind.is_empty() {
        Vec::new()
    } else {
        vec![("Content-Type", kind)]
    };
    let valid = !kind.contains('\0');
    let case = Case::api(
        "content-type",
        request("POST", CHAT, &headers, body.as_bytes(), false),
    );
    Case {
        http_valid: valid,
        ..case
    }
}

/// Well-formed but unusual headers, and headers past the HTTP layer's limits.
fn headers(rng: &mut StdRng, target: &Target) -> Case {
    let body = Value::Object(chat_body(rng, target)).to_string();
    let long = "x".repeat(1 << rng.random_range(10..20));
    let many: Vec<(String, String)> = (0..rng.random_range(20..500))
        .map(|i| (format!("X-Header-{i}"), "v".into()))
        .collect();
    let (extra, valid): (Vec<(String, String)>, bool) = match rng.random_range(0..12) {
        0 => (vec![("X-Long".into(), long.clone())], long.len() < 16 << 10),
        1 => {
            let valid = many.len() < 80;
            (many, valid)
        }
        2 => (vec![("Expect".into(), "100-continue".into())], true),
        3 => (vec![("Origin".into(), "https://evil.example".into())], true),
        4 => (
            vec![("Authorization".into(), "Bearer \u{1F600}".into())],
            true,
        ),
        5 => (vec![("Accept".into(), "text/event-stream".into())], true),
        6 => (vec![("Content-Encoding".into(), "gzip".into())], true),
        7 => (
            vec![
                ("Connection".into(), "keep-alive, Upgrade".into()),
                ("Upgrade".into(), "websocket".into()),
            ],
            true,
        ),
        8 => (vec![("Cookie".into(), long.clone())], long.len() < 16 << 10),
        9 => (
            vec![
                ("X-Forwarded-For".into(), "::1, 10.0.0.1".into()),
                ("Range".into(), "bytes=0-1".into()),
            ],
            true,
        ),
        10 => (
            vec![("Accept-Encoding".into(), "gzip, br, zstd".into())],
            true,
        ),
        _ => {
            let chunked = chunked_body(body.as_bytes());
            let bytes = [
                format!("POST {CHAT} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n").as_bytes(),
                &chunked,
            ]
            .concat();
            return Case::api("headers", bytes);
        }
    };
    let mut headers: Vec<(&str, &str)> = vec![("Content-Type", "application/json")];
    headers.extend(extra.iter().map(|(n, v)| (n.as_str(), v.as_str())));
    let case = Case::api(
        "headers",
        request("POST", CHAT, &headers, body.as_bytes(), false),
    );
    Case {
        http_valid: valid,
        ..case
    }
}

/// `body` in chunks of random sizes, with the last chunk and an empty trailer.
fn chunked_body(body: &[u8]) -> Vec<u8> {
    let mut bytes = Vec::new();
    for piece in body.chunks(7) {
        bytes.extend_from_slice(format!("{:x}\r\n", piece.len()).as_bytes());
        bytes.extend_from_slice(piece);
        bytes.extend_from_slice(b"\r\n");
    }
    bytes.extend_from_slice(b"0\r\n\r\n");
    bytes
}

fn model_paths(rng: &mut StdRng, target: &Target) -> String {
    let encoded: String = target
        .model_id
        .bytes()
        .map(|b| match b {
            b'/' => "/".to_string(),
            b if b.is_ascii_alphanumeric() || b"-._~".contains(&b) => char::from(b).to_string(),
            b => format!("%{b:02X}"),
        })
        .collect();
    let id = match rng.random_range(0..12) {
        0 => encoded.trim_start_matches('/').to_owned(),
        1 => encoded,
        2 => "gpt-4".into(),
        3 => "%00".into(),
        4 => "%ff%fe".into(),
        5 => "..%2F..%2Fetc%2Fpasswd".into(),
        6 => "a".repeat(1 << rng.random_range(4..14)),
        7 => "%F0%9F%98%80".into(),
        8 => "".into(),
        9 => "x/y/z".into(),
        10 => "%".into(),
        _ => "model?x=1".into(),
    };
    format!("/v1/models/{id}")
}

fn get_endpoints(rng: &mut StdRng, target: &Target) -> Case {
    let path = match rng.random_range(0..12) {
        0 => "/v1/models".into(),
        1 => "/health".into(),
        2 => "/health?verbose=1&&=".into(),
        3 => "/v1/models?limit=-1&after=%ff".into(),
        4 => "/ready".into(),
        5 => "/metrics".into(),
        6 => "/stats?x=%00".into(),
        7 => "/metrics?name[]=x".into(),
        _ => model_paths(rng, target),
    };
    let method = if rng.random_bool(0.15) { "HEAD" } else { "GET" };
    Case::api("get", request(method, &path, &[], b"", false))
}

fn methods(rng: &mut StdRng, target: &Target) -> Case {
    let method = *[
        "GET", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD", "TRACE", "PROPFIND", "FOO", "get",
        "POST",
    ]
    .choose(rng)
    .expect("not empty");
    let model = model_paths(rng, target);
    let path = *[
        CHAT,
        COMPLETIONS,
        "/v1/models",
        model.as_str(),
        "/health",
        "/chat/completions",
        "/ready",
        "/metrics",
        "/stats",
        "/v1/messages",
        "/v1/responses",
        "/v1/responses/resp_1",
        "/v1/embeddings",
    ]
    .choose(rng)
    .expect("not empty");
    let body = if rng.random_bool(0.5) {
        Value::Object(chat_body(rng, target)).to_string()
    } else {
        String::new()
    };
    let headers = [("Content-Type", "application/json")];
    Case::api(
        "method",
        request(method, path, &headers, body.as_bytes(), false),
    )
}

fn paths(rng: &mut StdRng, _target: &Target) -> Case {
    let path: String = match rng.random_range(0..16) {
        0 => "/".into(),
        1 => "/v1".into(),
        2 => "/v1/".into(),
        3 => "/v2/chat/completions".into(),
        4 => "/v1/chat/completions/".into(),
        5 => "/V1/CHAT/COMPLETIONS".into(),
        6 => "/v1//chat/completions".into(),
        7 => "/v1/chat/completions?stream=true".into(),
        8 => "/%76%31/models".into(),
        9 => "/../../etc/passwd".into(),
        10 => "/v1/chat/completions;x=1".into(),
        11 => format!("/{}", "a/".repeat(1 << rng.random_range(2..13))),
        12 => "/v1/embeddings".into(),
        13 => "/metrics/".into(),
        14 => "/v1/chat/completions%00".into(),
        _ => {
            // Characters a path segment may hold (RFC 3986's pchar).
            let allowed = b"abcXYZ019-._~!$&'()*+,;=:@/";
            let segment: Vec<u8> = (0..rng.random_range(1..40))
                .map(|_| *allowed.choose(rng).expect("not empty"))
                .collect();
            format!("/{}", String::from_utf8_lossy(&segment))
        }
    };
    let method = if rng.random_bool(0.5) { "GET" } else { "POST" };
    let body = if method == "POST" { "{}" } else { "" };
    let headers = [("Content-Type", "application/json")];
    Case::api(
        "path",
        request(method, &path, &headers, body.as_bytes(), false),
    )
}

/// Requests that are not HTTP/1.1, or break its framing rules. Each ends its head, so that a
/// server waiting for more has nothing to wait for.
fn malformed_http(rng: &mut StdRng, target: &Target) -> Case {
    let body = Value::Object(chat_body(rng, target)).to_string();
    let length = body.len();
    let bytes: Vec<u8> = match rng.random_range(0..18) {
        0 => {
            let mut bytes = vec![0u8; rng.random_range(1..2048)];
            rng.fill(&mut bytes[..]);
            bytes.extend_from_slice(b"\r\n\r\n");
            bytes
        }
        1 => b"GET /health\r\n\r\n".to_vec(),
        2 => b"GET /health HTTP/9.9\r\nHost: x\r\n\r\n".to_vec(),
        3 => b"GET /health http/1.1\r\nHost: x\r\n\r\n".to_vec(),
        4 => b"GET /health HTTP/1.1\r\nNo-Colon-Here\r\n\r\n".to_vec(),
        5 => b"GET /health HTTP/1.1\r\nHost : x\r\n\r\n".to_vec(),
        6 => b"GET /health HTTP/1.1\r\nX-A: a\r\n folded\r\n\r\n".to_vec(),
        7 => b"GET /health HTTP/1.1\r\nX\x01Bad: a\r\n\r\n".to_vec(),
        8 => format!("POST {CHAT} HTTP/1.1\r\nContent-Length: {length}\r\nContent-Length: {}\r\n\r\n{body}", length + 1).into_bytes(),
        9 => format!("POST {CHAT} HTTP/1.1\r\nContent-Length: -{length}\r\n\r\n{body}").into_bytes(),
        10 => format!("POST {CHAT} HTTP/1.1\r\nContent-Length: 99999999999999999999999\r\n\r\n{body}").into_bytes(),
        11 => format!("POST {CHAT} HTTP/1.1\r\nTransfer-Encoding: chunked\r\nContent-Length: {length}\r\n\r\nzz\r\n{body}\r\n0\r\n\r\n").into_bytes(),
        12 => format!("POST {CHAT} HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nffffffffffffffffffffff\r\n{body}\r\n0\r\n\r\n").into_bytes(),
        13 => format!("POST {CHAT} HTTP/1.1\r\nTransfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n").into_bytes(),
        14 => b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec(),
        15 => b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n".to_vec(),
        16 => format!("GET /{} HTTP/1.1\r\nHost: x\r\n\r\n", "a".repeat(70_000)).into_bytes(),
        // Empty lines before the request line, which servers may skip.
        _ => b"\r\n\r\nGET /health HTTP/1.1\r\nConnection: close\r\n\r\n".to_vec(),
    };
    Case::protocol("malformed-http", bytes)
}

/// Several requests on one connection, sent at once.
fn pipelined(rng: &mut StdRng, _target: &Target) -> Case {
    let count = rng.random_range(2..5);
    let mut bytes = Vec::new();
    let mut answers = Vec::new();
    for i in 0..count {
        let last = i + 1 == count;
        let (path, request) = match rng.random_range(0..3) {
            0 => ("/health", request("GET", "/health", &[], b"", !last)),
            1 => ("/v1/models", request("GET", "/v1/models", &[], b"", !last)),
            _ => {
                let body = json!({"prompt": short_text(rng), "max_tokens": 2});
                (COMPLETIONS, post_json(COMPLETIONS, &body, !last))
            }
        };
        bytes.extend_from_slice(&request);
        answers.push(Expected {
            endpoint: Endpoint::of_path(path),
            head: false,
            promise: Promise::WellFormed,
        });
    }
    Case {
        kind: "pipelined",
        bytes,
        answers,
        http_valid: true,
    }
}

/// Requests at the edges of what the server accepts: the context's length, the vocabulary's
/// ends, the most stop strings, log-probabilities, seeds.
fn boundaries(rng: &mut StdRng, target: &Target) -> Case {
    let over_context = target.max_context + 1 + rng.random_range(0..1000);
    let (path, body) = match rng.random_range(0..6) {
        0 => {
            let ids = vec![1; over_context as usize];
            (COMPLETIONS, json!({"prompt": ids, "max_tokens": 1}))
        }
        1 => (
            COMPLETIONS,
            json!({"prompt": [0, target.vocab_size - 1], "max_tokens": 2, "logprobs": 5}),
        ),
        2 => (
            CHAT,
            json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                   "logprobs": true, "top_logprobs": 20, "stream": rng.random_bool(0.5)}),
        ),
        3 => (
            CHAT,
            json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                   "stop": (0..16).map(|i| format!("s{i}")).collect::<Vec<_>>(),
                   "seed": u64::MAX, "temperature": 0.0001, "top_k": 1}),
        ),
        4 => (
            CHAT,
            json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                   "n": 1, "stream": true, "stream_options": {"include_usage": true}}),
        ),
        _ => (
            COMPLETIONS,
            json!({"prompt": "hi", "max_tokens": 2, "echo": true, "best_of": 1,
                   "suffix": "x", "logprobs": 0}),
        ),
    };
    Case::api("boundary", post_json(path, &body, false))
}

/// The request bytes shown in a report.
pub fn describe(case: &Case) -> String {
    http::escape(&case.bytes, 400)
}
