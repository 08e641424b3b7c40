//! Structured output, enforced: `response_format` and `tool_choice` on a tiny model with random
//! weights, which would never write JSON or a tool call of its own accord, sampled at
//! temperature 1 under several seeds. Every reply must parse and meet its schema.

mod common;

use oxlm_server::{LogLevel, Server, Settings};
use serde_json::{json, Value};

const MODEL: &str = "tiny/llama-8bit-g32";

async fn server() -> String {
    let settings = Settings {
        log_level: LogLevel::Warning,
        ..Settings::default()
    };
    let server = Server::load(&common::fixtures().join(MODEL), settings).unwrap();
    common::listen(server).await
}

/// The status and JSON body of `base`'s answer to the chat completion request `body`.
async fn chat_json(base: &str, body: Value) -> (u16, Value) {
    let (status, text) = common::post(base, "/v1/chat/completions", &body).await;
    (status, serde_json::from_str(&text).unwrap())
}

fn request(seed: u64, extra: Value) -> Value {
    let mut body = json!({
        "messages": [{"role": "user", "content": "Describe a city."}],
        "max_tokens": 300,
        "temperature": 1.0,
        "seed": seed,
    });
    body.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    body
}

/// Nested objects, an array with bounds, an enum, bounded numbers, required and optional
/// fields, strings short enough that a random model ends them within `max_tokens`.
fn city_schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "kind": {"enum": ["town", "city", "capital"]},
            "population": {"type": "integer", "minimum": 0, "maximum": 100000},
            "rating": {"type": "number", "minimum": 0, "maximum": 5},
            "districts": {
                "type": "array",
                "minItems": 1,
                "maxItems": 3,
                "items": {
                    "type": "object",
                    "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 9}},
                    "required": ["id"],
                    "additionalProperties": false,
                },
            },
            "coastal": {"type": "boolean"},
        },
        "required": ["name", "kind", "population", "districts"],
        "additionalProperties": false,
    })
}

/// Checks `city_schema` by hand: every constraint it states.
fn check_city(text: &str) {
    let city: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{e}: {text}"));
    let fields = city.as_object().unwrap();
    let allowed = [
        "name",
        "kind",
        "population",
        "rating",
        "districts",
        "coastal",
    ];
    assert!(
        fields.keys().all(|k| allowed.contains(&k.as_str())),
        "{text}"
    );
    assert!(
        city["name"].as_str().unwrap().chars().count() <= 12,
        "{text}"
    );
    assert!(
        ["town", "city", "capital"].contains(&city["kind"].as_str().unwrap()),
        "{text}"
    );
    let population = city["population"].as_i64().unwrap();
    assert!((0..=100000).contains(&population), "{text}");
    if let Some(rating) = city.get("rating") {
        assert!((0.0..=5.0).contains(&rating.as_f64().unwrap()), "{text}");
    }
    let districts = city["districts"].as_array().unwrap();
    assert!((1..=3).contains(&districts.len()), "{text}");
    for district in districts {
        assert_eq!(district.as_object().unwrap().len(), 1, "{text}");
        assert!(
            (1..=9).contains(&district["id"].as_i64().unwrap()),
            "{text}"
        );
    }
    if let Some(coastal) = city.get("coastal") {
        assert!(coastal.is_boolean(), "{text}");
    }
}

#[tokio::test]
async fn json_schema_replies_always_validate() {
    let base = server().await;
    let format = json!({"response_format": {
        "type": "json_schema",
        "json_schema": {"name": "city", "schema": city_schema(), "strict": true},
    }});
    for seed in 0..8 {
        let (status, body) = chat_json(&base, request(seed, format.clone())).await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(body["choices"][0]["finish_reason"], "stop", "{body}");
        check_city(body["choices"][0]["message"]["content"].as_str().unwrap());
    }
    // The same requests unconstrained: the model writes no JSON of its own.
    let (_, free) = chat_json(&base, request(0, json!({"max_tokens": 40}))).await;
    let text = free["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(serde_json::from_str::<Value>(text).is_err(), "{text}");
}

#[tokio::test]
async fn json_object_and_streamed_replies_parse() {
    let base = server().await;
    let object = json!({"response_format": {"type": "json_object"}, "max_tokens": 400});
    for seed in 0..4 {
        let (status, body) = chat_json(&base, request(seed, object.clone())).await;
        assert_eq!(status, 200, "{body}");
        let text = body["choices"][0]["message"]["content"].as_str().unwrap();
        if body["choices"][0]["finish_reason"] == "stop" {
            let value: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{e}: {text}"));
            assert!(value.is_object(), "{text}");
        } else {
            // Any object may run past max_tokens; what came is still its beginning.
            assert!(text.starts_with('{'), "{text}");
        }
    }
    let mut streamed = request(
        3,
        json!({"stream": true, "response_format": {
            "type": "json_schema", "json_schema": {"name": "city", "schema": city_schema()},
        }}),
    );
    streamed["stream"] = true.into();
    let text = common::chat(&base, &streamed).await;
    let content: String = common::chunks(&text)
        .iter()
        .filter_map(|chunk| chunk["choices"][0]["delta"]["content"].as_str())
        .collect();
    check_city(&content);
}

fn tools() -> Value {
    json!([
        {"type": "function", "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 10},
                    "unit": {"enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city", "unit"],
                "additionalProperties": false,
            },
        }},
        {"type": "function", "function": {
            "name": "get_time",
            "parameters": {
                "type": "object",
                "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 12}},
                "required": ["zone"],
                "additionalProperties": false,
            },
        }},
    ])
}

fn check_call(call: &Value) {
    let name = call["function"]["name"].as_str().unwrap();
    let arguments = call["function"]["arguments"].as_str().unwrap();
    let arguments: Value = serde_json::from_str(arguments).unwrap();
    match name {
        "get_weather" => {
            assert!(arguments["city"].as_str().unwrap().chars().count() <= 10);
            assert!(["celsius", "fahrenheit"].contains(&arguments["unit"].as_str().unwrap()));
        }
        "get_time" => assert!((-12..=12).contains(&arguments["zone"].as_i64().unwrap())),
        _ => panic!("a call of {name}, which is no tool"),
    }
}

#[tokio::test]
async fn required_and_named_tool_choices_always_call() {
    let base = server().await;
    for seed in 0..6 {
        let required = json!({"tools": tools(), "tool_choice": "required"});
        let (status, body) = chat_json(&base, request(seed, required)).await;
        assert_eq!(status, 200, "{body}");
        let choice = &body["choices"][0];
        assert_eq!(choice["finish_reason"], "tool_calls", "{body}");
        let calls = choice["message"]["tool_calls"].as_array().unwrap();
        assert!(!calls.is_empty(), "{body}");
        calls.iter().for_each(check_call);

        let named = json!({"tools": tools(), "tool_choice":
            {"type": "function", "function": {"name": "get_time"}}});
        let (status, body) = chat_json(&base, request(seed, named)).await;
        assert_eq!(status, 200, "{body}");
        let calls = body["choices"][0]["message"]["tool_calls"]
            .as_array()
            .unwrap();
        assert_eq!(calls.len(), 1, "{body}");
        assert_eq!(calls[0]["function"]["name"], "get_time", "{body}");
        check_call(&calls[0]);
    }
}

#[tokio::test]
async fn what_cannot_be_enforced_is_refused() {
    let base = server().await;
    let cases = [
        (
            json!({"response_format": {"type": "json_schema", "json_schema": {
                "name": "remote", "schema": {"$ref": "https://example.com/s.json"}}}}),
            "response_format",
        ),
        (
            json!({"response_format": {"type": "yaml"}}),
            "response_format.type",
        ),
        (json!({"tool_choice": "required"}), "tool_choice"),
        (
            json!({"tools": tools(), "tool_choice":
                {"type": "function", "function": {"name": "get_news"}}}),
            "tool_choice",
        ),
    ];
    for (extra, param) in cases {
        let (status, body) = chat_json(&base, request(0, extra.clone())).await;
        assert_eq!(status, 400, "{extra}: {body}");
        assert_eq!(body["error"]["param"], param, "{body}");
        assert_eq!(body["error"]["type"], "invalid_request_error", "{body}");
    }
    // What the engine cannot enforce is named.
    let unique = json!({"response_format": {"type": "json_schema", "json_schema": {
        "name": "set", "schema": {"type": "array", "uniqueItems": true}}}});
    let (status, body) = chat_json(&base, request(0, unique)).await;
    assert_eq!(status, 400, "{body}");
    assert_eq!(
        body["error"]["message"], "Unimplemented keys: [\"uniqueItems\"]",
        "{body}"
    );
    // Still serving.
    let (status, _) = chat_json(&base, request(0, json!({"max_tokens": 2}))).await;
    assert_eq!(status, 200);
}
