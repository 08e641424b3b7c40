//! Anthropic's Messages API end to end, over a scripted model behind Qwen 3.5's chat template
//! (see `common::scripted`): exact messages and event streams with thinking, text and tool_use
//! blocks, the tool_use → tool_result round trip as the template renders it, count_tokens, stop
//! reasons, and errors in Anthropic's shape, also as the event that ends a stream.

mod common;

use std::time::Duration;

use common::scripted::{serve, Served, QWEN3_5};
use common::SlowPrompts;
use oxlm_runtime::LoadedModel;
use oxlm_server::{LogLevel, Server, Settings};
use reqwest::StatusCode;
use serde_json::{json, Value};

/// The template opens `<think>`; the model reasons, closes it, says a word and calls the tool.
const TOOL_REPLY: &str = "The user wants the weather.\n</think>\n\nLet me check.<tool_call>\n\
    <function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n\
    </parameter>\n</function>\n</tool_call>";

/// A short reasoning, then a plain answer.
const TEXT_REPLY: &str = "Easy.</think>\n\nIt is sunny. Bye.";

async fn start(reply: &str) -> Served {
    serve(&QWEN3_5, reply, Settings::default()).await
}

/// A question with a tool to answer it; `extra` fields added.
fn request(extra: Value) -> Value {
    let mut body = json!({
        "model": "claude-test",
        "max_tokens": 1000,
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tools": [{"name": "get_weather", "description": "The forecast", "input_schema": {
            "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}],
    });
    body.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    body
}

/// Posts `body` as Anthropic's SDK does (its version and beta headers included).
async fn post_raw(base: &str, path: &str, body: String) -> (StatusCode, String) {
    let response = reqwest::Client::new()
        .post(format!("{base}{path}"))
        .header("content-type", "application/json")
        .header("anthropic-version", "2023-06-01")
        .header("anthropic-beta", "token-efficient-tools-2025-02-19")
        .body(body)
        .send()
        .await
        .unwrap();
    (response.status(), response.text().await.unwrap())
}

async fn post(base: &str, path: &str, body: &Value) -> (StatusCode, Value) {
    let (status, text) = post_raw(base, path, body.to_string()).await;
    (status, serde_json::from_str(&text).unwrap())
}

async fn message(base: &str, body: &Value) -> Value {
    let (status, reply) = post(base, "/v1/messages", body).await;
    assert_eq!(status, StatusCode::OK, "{reply}");
    reply
}

async fn count_tokens(base: &str, mut body: Value) -> Value {
    body.as_object_mut().unwrap().remove("max_tokens");
    let (status, count) = post(base, "/v1/messages/count_tokens", &body).await;
    assert_eq!(status, StatusCode::OK, "{count}");
    count["input_tokens"].clone()
}

async fn model_id(base: &str) -> Value {
    let models = reqwest::get(format!("{base}/v1/models")).await.unwrap();
    let models: Value = serde_json::from_str(&models.text().await.unwrap()).unwrap();
    models["data"][0]["id"].clone()
}

/// The events of an SSE stream, as (event name, data).
fn events(text: &str) -> Vec<(String, Value)> {
    text.split("\n\n")
        .filter(|event| !event.trim().is_empty())
        .map(|event| {
            let field = |name: &str| {
                event
                    .lines()
                    .find_map(|line| line.strip_prefix(name))
                    .unwrap_or_else(|| panic!("no {name} in {event:?}"))
            };
            let data: Value = serde_json::from_str(field("data: ")).unwrap();
            (field("event: ").to_owned(), data)
        })
        .collect()
}

/// `events` with the deltas that follow each other in a block joined into one (how the text is
/// cut into tokens is the tokenizer's business).
fn joined_deltas(events: Vec<(String, Value)>) -> Vec<(String, Value)> {
    let mut joined: Vec<(String, Value)> = Vec::new();
    for (name, data) in events {
        if let Some((last_name, last)) = joined.last_mut() {
            if name == "content_block_delta" && *last_name == name && last["index"] == data["index"]
            {
                let field = ["text", "thinking", "partial_json"]
                    .into_iter()
                    .find(|f| data["delta"].get(f).is_some())
                    .unwrap();
                let text = last["delta"][field].as_str().unwrap().to_owned();
                last["delta"][field] = (text + data["delta"][field].as_str().unwrap()).into();
                continue;
            }
        }
        joined.push((name, data));
    }
    joined
}

#[tokio::test]
async fn thinking_text_and_tool_use_in_a_message() {
    let served = start(TOOL_REPLY).await;
    let base = &served.base;
    let reply = message(base, &request(json!({}))).await;
    let id = reply["id"].as_str().unwrap();
    assert!(id.starts_with("msg_") && id.len() == 36, "{id}");
    let tool_id = reply["content"][2]["id"].as_str().unwrap();
    assert!(
        tool_id.starts_with("toolu_") && tool_id.len() == 38,
        "{tool_id}"
    );
    // The prompt's tokens are what count_tokens says, and what the model was given.
    let input_tokens = count_tokens(base, request(json!({}))).await;
    assert_eq!(input_tokens, served.last_prompt_ids().len());
    let output_tokens = served.tokenizer.encode(TOOL_REPLY, false).unwrap().len() + 1;
    assert_eq!(
        reply,
        json!({
            "id": id, "type": "message", "role": "assistant", "model": model_id(base).await,
            "content": [
                {"type": "thinking", "thinking": "The user wants the weather.\n", "signature": ""},
                {"type": "text", "text": "\n\nLet me check."},
                {"type": "tool_use", "id": tool_id, "name": "get_weather",
                 "input": {"city": "Paris", "days": 2}},
            ],
            "stop_reason": "tool_use", "stop_sequence": null,
            "usage": {"input_tokens": input_tokens, "cache_creation_input_tokens": 0,
                      "cache_read_input_tokens": 0, "output_tokens": output_tokens},
        })
    );
}

#[tokio::test]
async fn thinking_text_and_tool_use_streamed() {
    let served = start(TOOL_REPLY).await;
    let base = &served.base;
    let (status, text) = post_raw(
        base,
        "/v1/messages",
        request(json!({"stream": true})).to_string(),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{text}");
    let events = events(&text);
    for (name, data) in &events {
        assert_eq!(data["type"], *name, "{text}");
    }
    // A ping follows message_start; more come while the prompt goes through.
    assert_eq!(events[1].0, "ping");
    let events: Vec<_> = events
        .into_iter()
        .filter(|(name, _)| name != "ping")
        .collect();
    let start = events[0].1["message"].clone();
    let tool_start = events
        .iter()
        .find(|(_, data)| data["content_block"]["type"] == "tool_use")
        .unwrap()
        .1["content_block"]
        .clone();
    let input_tokens = count_tokens(base, request(json!({}))).await;
    let output_tokens = served.tokenizer.encode(TOOL_REPLY, false).unwrap().len() + 1;
    let expected = [
        json!({"type": "message_start", "message": {
            "id": start["id"], "type": "message", "role": "assistant", "model": model_id(base).await,
            "content": [], "stop_reason": null, "stop_sequence": null,
            "usage": {"input_tokens": input_tokens, "cache_creation_input_tokens": 0,
                      "cache_read_input_tokens": 0, "output_tokens": 0}}}),
        json!({"type": "content_block_start", "index": 0,
               "content_block": {"type": "thinking", "thinking": "", "signature": ""}}),
        json!({"type": "content_block_delta", "index": 0,
               "delta": {"type": "thinking_delta", "thinking": "The user wants the weather.\n"}}),
        json!({"type": "content_block_stop", "index": 0}),
        json!({"type": "content_block_start", "index": 1,
               "content_block": {"type": "text", "text": ""}}),
        json!({"type": "content_block_delta", "index": 1,
               "delta": {"type": "text_delta", "text": "\n\nLet me check."}}),
        json!({"type": "content_block_stop", "index": 1}),
        json!({"type": "content_block_start", "index": 2, "content_block": {
            "type": "tool_use", "id": tool_start["id"], "name": "get_weather", "input": {}}}),
        json!({"type": "content_block_delta", "index": 2, "delta": {
            "type": "input_json_delta", "partial_json": "{\"city\":\"Paris\",\"days\":2}"}}),
        json!({"type": "content_block_stop", "index": 2}),
        json!({"type": "message_delta", "delta": {"stop_reason": "tool_use", "stop_sequence": null},
               "usage": {"output_tokens": output_tokens}}),
        json!({"type": "message_stop"}),
    ];
    let data: Vec<Value> = joined_deltas(events)
        .into_iter()
        .map(|(_, data)| data)
        .collect();
    assert_eq!(data, expected, "{text}");
    assert!(start["id"].as_str().unwrap().starts_with("msg_"));
    assert!(tool_start["id"].as_str().unwrap().starts_with("toolu_"));
}

/// `disable_parallel_tool_use`: the reply ends at its first tool_use, whatever the model writes
/// after it; streamed, no second block starts.
#[tokio::test]
async fn disable_parallel_tool_use_ends_at_the_first_call() {
    let second = "\n<tool_call>\n<function=get_weather>\n<parameter=city>\nLyon\n</parameter>\n\
        </function>\n</tool_call>\nBoth asked.";
    let served = start(&format!("{TOOL_REPLY}{second}")).await;
    let base = &served.base;
    let choice = |disable: bool| json!({"type": "auto", "disable_parallel_tool_use": disable});
    let one = message(base, &request(json!({"tool_choice": choice(true)}))).await;
    let both = message(base, &request(json!({"tool_choice": choice(false)}))).await;
    let types = |reply: &Value| -> Vec<String> {
        let blocks = reply["content"].as_array().unwrap();
        blocks
            .iter()
            .map(|b| b["type"].as_str().unwrap().to_owned())
            .collect()
    };
    assert_eq!(types(&one), ["thinking", "text", "tool_use"], "{one}");
    assert_eq!(
        one["content"][2]["input"],
        json!({"city": "Paris", "days": 2})
    );
    assert_eq!(one["stop_reason"], "tool_use");
    let output_tokens = served.tokenizer.encode(TOOL_REPLY, false).unwrap().len();
    assert!(one["usage"]["output_tokens"].as_u64().unwrap() <= output_tokens as u64);
    assert_eq!(
        types(&both),
        ["thinking", "text", "tool_use", "text", "tool_use", "text"],
        "{both}"
    );
    let body = request(json!({"tool_choice": choice(true), "stream": true}));
    let (status, text) = post_raw(base, "/v1/messages", body.to_string()).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    let events = events(&text);
    let started: Vec<&Value> = events
        .iter()
        .filter(|(name, _)| name == "content_block_start")
        .map(|(_, data)| &data["content_block"]["type"])
        .collect();
    assert_eq!(started, ["thinking", "text", "tool_use"], "{text}");
    let (last, delta) = (&events[events.len() - 1], &events[events.len() - 2]);
    assert_eq!(last.0, "message_stop");
    assert_eq!(delta.1["delta"]["stop_reason"], "tool_use", "{text}");
}

/// The reply goes back as history with the tool's result: the template shows both.
#[tokio::test]
async fn tool_use_and_tool_result_round_trip() {
    let served = start(TOOL_REPLY).await;
    let base = &served.base;
    let first = message(base, &request(json!({}))).await;
    let tool_id = &first["content"][2]["id"];
    let next = request(json!({
        "system": [{"type": "text", "text": "Be brief."}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
            {"role": "assistant", "content": first["content"]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tool_id,
                "content": [{"type": "text", "text": "18C, sunny"}]}]},
        ],
    }));
    let second = message(base, &next).await;
    assert_eq!(second["stop_reason"], "tool_use", "{second}");
    let prompt = served.last_prompt();
    let conversation = &prompt[prompt.find("<|im_start|>user").unwrap()..];
    assert_eq!(
        conversation,
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n\
         <|im_start|>assistant\n<think>\nThe user wants the weather.\n</think>\n\nLet me check.\n\n\
         <tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n\
         <parameter=days>\n2\n</parameter>\n</function>\n</tool_call><|im_end|>\n\
         <|im_start|>user\n<tool_response>\n18C, sunny\n</tool_response><|im_end|>\n\
         <|im_start|>assistant\n<think>\n"
    );
    // The system text follows the template's tool list in its system turn.
    assert!(
        prompt.contains("</IMPORTANT>\n\nBe brief.<|im_end|>"),
        "{prompt}"
    );
    assert_eq!(
        second["usage"]["input_tokens"],
        served.last_prompt_ids().len()
    );
    assert_eq!(
        count_tokens(base, next).await,
        served.last_prompt_ids().len()
    );
}

/// `budget_tokens` holds the reasoning to that many tokens: the model's next token is then the
/// end of its reasoning, and its answer follows.
#[tokio::test]
async fn thinking_is_held_to_its_budget() {
    let (thought, more) = ("Hmm, let me see.", " Maybe this, maybe that, or the other.");
    let served = start(&format!("{thought}{more}</think>\n\nIt is sunny.")).await;
    let budget = served.tokenizer.encode(thought, false).unwrap().len();
    let base = &served.base;
    // Greedy picks, and sampling (all but certain, from the scripted logits).
    for temperature in [0.0, 0.1] {
        let thinking = |budget: usize| {
            let body = request(json!({"temperature": temperature,
                "thinking": {"type": "enabled", "budget_tokens": budget}}));
            async move {
                let reply = message(base, &body).await;
                (reply["content"].clone(), reply["stop_reason"].clone())
            }
        };
        let blocks = |thought: &str| {
            json!([{"type": "thinking", "thinking": thought, "signature": ""},
                   {"type": "text", "text": "\n\nIt is sunny."}])
        };
        assert_eq!(thinking(budget).await, (blocks(thought), json!("end_turn")));
        let whole = format!("{thought}{more}");
        assert_eq!(
            thinking(budget + 100).await,
            (blocks(&whole), json!("end_turn"))
        );
    }
    // Beside a grammar: a call the reply must make.
    let call = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n\
                </function>\n</tool_call>";
    let served = start(&format!("{thought}{more}</think>\n\n{call}")).await;
    let body = request(json!({"tool_choice": {"type": "any"},
        "thinking": {"type": "enabled", "budget_tokens": budget}}));
    let reply = message(&served.base, &body).await;
    assert_eq!(
        reply["content"][0],
        json!({"type": "thinking", "thinking": thought, "signature": ""})
    );
    assert_eq!(reply["content"][1], json!({"type": "text", "text": "\n\n"}));
    assert_eq!(reply["content"][2]["input"], json!({"city": "Paris"}));
    assert_eq!(reply["stop_reason"], "tool_use");
}

/// Each error in Anthropic's shape, with its status; the server answers on afterwards.
#[tokio::test]
async fn errors_in_anthropic_shape() {
    let served = start(TEXT_REPLY).await;
    let base = &served.base;
    let error = |kind: &str, message: &str| json!({"type": "error", "error": {"type": kind, "message": message}});
    let user =
        |content: Value| request(json!({"messages": [{"role": "user", "content": content}]}));
    let mut no_max_tokens = request(json!({}));
    no_max_tokens.as_object_mut().unwrap().remove("max_tokens");
    let cases = [
        (no_max_tokens, "max_tokens: Field required"),
        (
            user(json!([{"type": "video", "source": {}}])),
            "messages.0.content.0.type: `video` blocks are not accepted here \
             (accepted: text, tool_result)",
        ),
        (
            user(json!([{"type": "tool_result", "content": "18C"}])),
            "messages.0.content.0.tool_use_id: Field required",
        ),
        (
            request(json!({"stream": true, "temperature": 2})),
            "`temperature` must be 0 (greedy) or a number from 0.0001 to 1.0",
        ),
    ];
    for (body, expected) in cases {
        let (status, reply) = post(base, "/v1/messages", &body).await;
        assert_eq!(
            (status, reply),
            (
                StatusCode::BAD_REQUEST,
                error("invalid_request_error", expected)
            )
        );
        message(base, &request(json!({}))).await;
    }
    let (status, text) = post_raw(base, "/v1/messages", "{\"model\":".into()).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(
        serde_json::from_str::<Value>(&text).unwrap(),
        error(
            "invalid_request_error",
            "Invalid JSON in request body: EOF while parsing a value at line 1 column 9"
        )
    );
    let (status, reply) = post(
        base,
        "/v1/messages/count_tokens",
        &user(json!([{"type": "tool_use"}])),
    )
    .await;
    assert_eq!(
        (status, reply),
        (
            StatusCode::BAD_REQUEST,
            error(
                "invalid_request_error",
                "messages.0.content.0.type: `tool_use` blocks are not accepted here \
                 (accepted: text, tool_result)"
            )
        )
    );
    // Refused before the handler: still Anthropic's shape.
    let put = reqwest::Client::new()
        .put(format!("{base}/v1/messages"))
        .send()
        .await
        .unwrap();
    assert_eq!(put.status(), StatusCode::METHOD_NOT_ALLOWED);
    assert_eq!(
        serde_json::from_str::<Value>(&put.text().await.unwrap()).unwrap(),
        error(
            "invalid_request_error",
            "Method PUT is not allowed for /v1/messages"
        )
    );
    message(base, &request(json!({}))).await;
}

/// A last assistant message is the start of the reply (Anthropic's prefill): the prompt ends
/// with it, after the template's generation prompt with thinking off, and the reply holds what
/// follows it. It may not end in whitespace, nor come with thinking or a forced tool call; an
/// empty one starts nothing.
#[tokio::test]
async fn a_last_assistant_message_starts_the_reply() {
    let served = start(" sunny. Bye.").await;
    let base = &served.base;
    let prefilled = |text: &str, extra: Value| {
        let mut body = request(json!({"messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": [{"type": "text", "text": text}]},
        ]}));
        body.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        body
    };
    let reply = message(base, &prefilled("It is", json!({}))).await;
    let prompt = served.last_prompt();
    assert!(
        prompt.ends_with("<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nIt is"),
        "{prompt}"
    );
    assert_eq!(
        reply["content"],
        json!([{"type": "text", "text": " sunny. Bye."}])
    );
    assert_eq!(reply["stop_reason"], "end_turn");
    assert_eq!(
        count_tokens(base, prefilled("It is", json!({}))).await,
        served.last_prompt_ids().len()
    );
    message(base, &prefilled("", json!({}))).await;
    assert!(
        served
            .last_prompt()
            .ends_with("<|im_start|>assistant\n<think>\n"),
        "{}",
        served.last_prompt()
    );
    let error = |message: &str| json!({"type": "error", "error": {"type": "invalid_request_error", "message": message}});
    let cases = [
        (
            prefilled("It is ", json!({})),
            "messages.1.content: final assistant content cannot end with trailing whitespace",
        ),
        (
            prefilled(
                "It is",
                json!({"thinking": {"type": "enabled", "budget_tokens": 1024}}),
            ),
            "messages.1.content: a prefilled reply (a final assistant message) cannot be used \
             with thinking",
        ),
        (
            prefilled("It is", json!({"tool_choice": {"type": "any"}})),
            "messages.1.content: a prefilled reply (a final assistant message) cannot be used \
             with a tool_choice that forces a tool call",
        ),
    ];
    for (body, expected) in cases {
        let (status, reply) = post(base, "/v1/messages", &body).await;
        assert_eq!((status, reply), (StatusCode::BAD_REQUEST, error(expected)));
    }
}

/// With `--api-key`, Anthropic's `x-api-key` is accepted as `Authorization: Bearer` is, and
/// the Anthropic routes refuse others in Anthropic's shape.
#[tokio::test]
async fn api_key_as_x_api_key() {
    let settings = Settings {
        api_key: Some("sk-test".into()),
        ..Settings::default()
    };
    let served = serve(&QWEN3_5, TEXT_REPLY, settings).await;
    let client = reqwest::Client::new();
    let send = |path: &str, header: Option<(&str, &str)>| {
        let mut request = client
            .post(format!("{}{path}", served.base))
            .header("anthropic-version", "2023-06-01")
            .body(request(json!({})).to_string());
        if let Some((name, value)) = header {
            request = request.header(name, value);
        }
        async move {
            let response = request.send().await.unwrap();
            let status = response.status();
            let text = response.text().await.unwrap();
            (status, serde_json::from_str::<Value>(&text).unwrap())
        }
    };
    let refused = json!({"type": "error", "error": {"type": "authentication_error",
        "message": "invalid x-api-key: send `x-api-key: <key>` (or `Authorization: Bearer <key>`) \
                    with the key the server was started with"}});
    for header in [None, Some(("x-api-key", "sk-wrong"))] {
        for path in ["/v1/messages", "/v1/messages/count_tokens"] {
            let (status, body) = send(path, header).await;
            assert_eq!((status, body), (StatusCode::UNAUTHORIZED, refused.clone()));
        }
    }
    for header in [
        ("x-api-key", "sk-test"),
        ("authorization", "Bearer sk-test"),
    ] {
        let (status, body) = send("/v1/messages", Some(header)).await;
        assert_eq!(status, StatusCode::OK, "{body}");
        assert_eq!(body["stop_reason"], "end_turn");
    }
    // The OpenAI routes take either header too, and keep their own error shape.
    let chat = r#"{"messages": [{"role": "user", "content": "hi"}]}"#;
    let (status, body) = send("/v1/chat/completions", Some(("x-api-key", "sk-wrong"))).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    assert_eq!(body["error"]["type"], "authentication_error");
    let response = client
        .post(format!("{}/v1/chat/completions", served.base))
        .header("x-api-key", "sk-test")
        .body(chat)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
}

/// A failure once the stream has started (`--request-timeout` passing while the prompt goes
/// through) ends it with an `error` event; unstreamed, it is the response.
#[tokio::test]
async fn errors_after_the_stream_started_are_error_events() {
    let mut loaded = LoadedModel::load(&common::fixtures().join("tiny/llama-4bit-g64")).unwrap();
    loaded.model = Box::new(SlowPrompts {
        inner: loaded.model,
        prompt_time: Duration::from_millis(2000),
    });
    let settings = Settings {
        request_timeout: Some(Duration::from_millis(400)),
        log_level: LogLevel::Warning,
        ..Settings::default()
    };
    let base = common::listen(Server::new(loaded, settings).unwrap()).await;
    let timeout = json!({"type": "error", "error": {"type": "timeout_error",
        "message": "The request did not finish within the server's time limit"}});
    let mut body = json!({"max_tokens": 4, "stream": true,
                          "messages": [{"role": "user", "content": "Once upon a time"}]});
    // Streamed first: the next request waits for the slow forward pass to end.
    let (status, text) = post_raw(&base, "/v1/messages", body.to_string()).await;
    assert_eq!(status, StatusCode::OK);
    let events = events(&text);
    let names: Vec<&str> = events.iter().map(|(name, _)| name.as_str()).collect();
    assert_eq!(names, ["message_start", "ping", "error"], "{text}");
    assert_eq!(events[2].1, timeout);
    body["stream"] = false.into();
    let (status, reply) = post(&base, "/v1/messages", &body).await;
    assert_eq!((status, reply), (StatusCode::GATEWAY_TIMEOUT, timeout));
}
