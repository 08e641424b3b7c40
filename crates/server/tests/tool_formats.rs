//! Tool calls in the formats of more families (MiniCPM5, Mistral's two, pythonic), end to end,
//! behind each family's real chat template: a tiny model with random weights, which would never
//! call a tool of its own accord, sampled at temperature 1 under several seeds with a call
//! required, must call in the template's format, read back as calls; and a scripted model's
//! calls come out as `tool_calls`, whole or streamed, with no markup left in the text.

mod common;

use common::scripted::{start, weather_request, Family};
use common::{chat, chunks};
use oxlm_runtime::chat_template::ChatTemplate;
use oxlm_runtime::LoadedModel;
use oxlm_server::{LogLevel, Server, Settings};
use serde_json::{json, Map, Value};

/// A server of the tiny Mistral model (random weights) behind the chat template `template` of
/// tests/fixtures/templates.
async fn random_model_behind(template: &str) -> String {
    let fixtures = common::fixtures();
    let mut loaded = LoadedModel::load(&fixtures.join("tiny/mistral-4bit-g32")).unwrap();
    let source = std::fs::read_to_string(fixtures.join("templates").join(template)).unwrap();
    // The tokenizer's special tokens, which templates name (Nemo ends a turn with eos_token).
    let special: Map<String, Value> = loaded
        .tokenizer
        .special_tokens()
        .iter()
        .map(|(name, token)| (name.to_owned(), Value::from(token)))
        .collect();
    loaded.chat_template = Some(ChatTemplate::new(&source, special).unwrap());
    let settings = Settings {
        log_level: LogLevel::Warning,
        ..Settings::default()
    };
    common::listen(Server::new(loaded, settings).unwrap()).await
}

/// Tools whose arguments a random model ends within `max_tokens`: numbers and booleans, no
/// free text.
fn numeric_tools() -> Value {
    json!([
        {"type": "function", "function": {"name": "get_time", "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 12}},
            "required": ["zone"], "additionalProperties": false}}},
        {"type": "function", "function": {"name": "set_alarm", "parameters": {
            "type": "object",
            "properties": {"hour": {"type": "integer", "minimum": 0, "maximum": 23},
                           "loud": {"type": "boolean"}},
            "required": ["hour"], "additionalProperties": false}}},
    ])
}

/// A call of [`numeric_tools`] with arguments of their types, the required ones given.
fn check_call(call: &Value, reply: &Value) {
    let arguments: Value =
        serde_json::from_str(call["function"]["arguments"].as_str().unwrap()).unwrap();
    let arguments = arguments.as_object().unwrap();
    match call["function"]["name"].as_str().unwrap() {
        "get_time" => {
            assert!(arguments["zone"].is_i64(), "{reply}");
            assert_eq!(arguments.len(), 1, "{reply}");
        }
        "set_alarm" => {
            assert!(arguments["hour"].is_i64(), "{reply}");
            assert!(
                arguments.get("loud").is_none_or(Value::is_boolean),
                "{reply}"
            );
            assert!(
                arguments.keys().all(|k| k == "hour" || k == "loud"),
                "{reply}"
            );
        }
        other => panic!("a call of {other}, which is no tool: {reply}"),
    }
}

#[tokio::test]
async fn required_calls_come_in_each_templates_format() {
    for template in [
        "minicpm5.jinja",
        "mistral-nemo.jinja",
        "mistral-small-3.2.jinja",
        "llama-3.2-pythonic.jinja",
    ] {
        let base = random_model_behind(template).await;
        for seed in 0..3 {
            for choice in [
                json!("required"),
                json!({"type": "function", "function": {"name": "set_alarm"}}),
            ] {
                let body = json!({
                    "messages": [{"role": "user", "content": "Wake me at seven."}],
                    "tools": numeric_tools(), "tool_choice": choice,
                    // Room for a dozen calls: a random model goes on calling as often as
                    // not, and MiniCPM5's take many tokens of this small vocabulary.
                    "max_tokens": 1000, "temperature": 1.0, "seed": seed,
                });
                let reply: Value = serde_json::from_str(&chat(&base, &body).await).unwrap();
                let choice_made = &reply["choices"][0];
                assert_eq!(
                    choice_made["finish_reason"], "tool_calls",
                    "{template}: {reply}"
                );
                let calls = choice_made["message"]["tool_calls"].as_array().unwrap();
                assert!(!calls.is_empty(), "{template}: {reply}");
                calls.iter().for_each(|call| check_call(call, &reply));
                if body["tool_choice"].is_object() {
                    assert_eq!(calls.len(), 1, "{template}: {reply}");
                    assert_eq!(calls[0]["function"]["name"], "set_alarm");
                }
                // The calls and their results go back as the next turn's history, ids as
                // given: the template takes them (Mistral's refuse any id but nine letters
                // and digits).
                let mut messages =
                    vec![body["messages"][0].clone(), choice_made["message"].clone()];
                messages.extend(calls.iter().map(
                    |call| json!({"role": "tool", "tool_call_id": call["id"], "content": "done"}),
                ));
                let next = json!({"messages": messages, "tools": numeric_tools(), "max_tokens": 2});
                let answer: Value = serde_json::from_str(&chat(&base, &next).await).unwrap();
                assert_eq!(answer["object"], "chat.completion", "{template}: {answer}");
            }
        }
    }
}

/// The calls of a reply, as (name, arguments).
fn calls_of(message: &Value) -> Vec<(String, Value)> {
    message["tool_calls"]
        .as_array()
        .unwrap()
        .iter()
        .map(|call| {
            let arguments = call["function"]["arguments"].as_str().unwrap();
            (
                call["function"]["name"].as_str().unwrap().to_owned(),
                serde_json::from_str(arguments).unwrap(),
            )
        })
        .collect()
}

/// MiniCPM5's template opens `<think>` (the vocabulary has it); the model reasons, then calls
/// in its XML, a value with `<` in CDATA as the template asks.
#[tokio::test]
async fn minicpm5_reasoning_then_a_call() {
    let family = Family {
        template: "minicpm5.jinja",
        tokens: &["<think>", "</think>"],
    };
    let reply = "The user wants the weather.\n</think>\n\n<function name=\"get_weather\">\
                 <param name=\"city\"><![CDATA[Paris <FR>]]></param><param name=\"days\">2</param></function>";
    let base = start(&family, reply).await;
    let r: Value = serde_json::from_str(&chat(&base, &weather_request(false)).await).unwrap();
    let choice = &r["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{r}");
    let message = &choice["message"];
    assert_eq!(
        message["reasoning_content"],
        "The user wants the weather.\n"
    );
    assert_eq!(message["content"], "\n\n");
    assert_eq!(
        calls_of(message),
        [(
            "get_weather".to_owned(),
            json!({"city": "Paris <FR>", "days": 2})
        )]
    );
    // The call goes back as history with its result; the template takes both.
    let mut next = weather_request(false);
    next["messages"].as_array_mut().unwrap().extend([
        json!({"role": "assistant", "content": "", "tool_calls": message["tool_calls"]}),
        json!({"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": "18C"}),
    ]);
    let r: Value = serde_json::from_str(&chat(&base, &next).await).unwrap();
    assert_eq!(r["choices"][0]["finish_reason"], "tool_calls", "{r}");
}

/// Mistral Small 3.2 writes each call after its own `[TOOL_CALLS]`, with an id before `[ARGS]`
/// in history; streamed, the calls come whole, in order, and no marker reaches the client.
#[tokio::test]
async fn mistral_small_calls_streamed() {
    let family = Family {
        template: "mistral-small-3.2.jinja",
        tokens: &["[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"],
    };
    let reply = "[TOOL_CALLS]get_weather[ARGS]{\"city\": \"Paris\", \"days\": 2}\
                 [TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]{\"city\": \"Oslo\"}";
    let base = start(&family, reply).await;
    let text = chat(&base, &weather_request(true)).await;
    assert!(
        !text.contains("[TOOL_CALLS]") && !text.contains("[ARGS]"),
        "{text}"
    );
    let chunks = chunks(&text);
    let calls: Vec<(u64, String, Value)> = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["tool_calls"].as_array())
        .flatten()
        .map(|call| {
            let arguments = call["function"]["arguments"].as_str().unwrap();
            (
                call["index"].as_u64().unwrap(),
                call["function"]["name"].as_str().unwrap().to_owned(),
                serde_json::from_str(arguments).unwrap(),
            )
        })
        .collect();
    assert_eq!(
        calls,
        [
            (
                0,
                "get_weather".to_owned(),
                json!({"city": "Paris", "days": 2})
            ),
            (1, "get_weather".to_owned(), json!({"city": "Oslo"})),
        ]
    );
    let content: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(content, "");
    let last = chunks.last().unwrap();
    assert_eq!(last["choices"][0]["finish_reason"], "tool_calls");
}

/// Mistral Nemo's calls: one JSON list after `[TOOL_CALLS]`.
#[tokio::test]
async fn mistral_nemo_json_list() {
    let family = Family {
        template: "mistral-nemo.jinja",
        tokens: &["[TOOL_CALLS]"],
    };
    let reply = "[TOOL_CALLS][{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}, \
                 \"id\": \"a1b2c3d4e\"}]";
    let base = start(&family, reply).await;
    let r: Value = serde_json::from_str(&chat(&base, &weather_request(false)).await).unwrap();
    let choice = &r["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{r}");
    assert_eq!(choice["message"]["content"], Value::Null);
    assert_eq!(
        calls_of(&choice["message"]),
        [("get_weather".to_owned(), json!({"city": "Paris"}))]
    );
}

/// The pythonic template (vLLM's for Llama 3.2): the reply is a Python list of calls, or else
/// plain content.
#[tokio::test]
async fn pythonic_calls_and_plain_answers() {
    let family = Family {
        template: "llama-3.2-pythonic.jinja",
        tokens: &[],
    };
    let base = start(
        &family,
        "[get_weather(city='Paris', days=2), get_weather(city=\"Oslo\")]",
    )
    .await;
    let r: Value = serde_json::from_str(&chat(&base, &weather_request(false)).await).unwrap();
    let choice = &r["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{r}");
    assert_eq!(
        calls_of(&choice["message"]),
        [
            (
                "get_weather".to_owned(),
                json!({"city": "Paris", "days": 2})
            ),
            ("get_weather".to_owned(), json!({"city": "Oslo"})),
        ]
    );

    let base = start(&family, "[Paris] is sunny.").await;
    let r: Value = serde_json::from_str(&chat(&base, &weather_request(false)).await).unwrap();
    let choice = &r["choices"][0];
    assert_eq!(choice["finish_reason"], "stop", "{r}");
    assert_eq!(choice["message"]["content"], "[Paris] is sunny.");
    assert!(choice["message"].get("tool_calls").is_none(), "{r}");
}
