//! The Responses API end to end, over a scripted model behind Qwen 3.5's template (its replies
//! reason, answer and call tools): response objects and event streams in full, conversations
//! continued with `previous_response_id`, the store's bounds, and errors in OpenAI's shape.

mod common;

use common::scripted::{serve, Served, QWEN3_5};
use oxlm_server::{LogLevel, Settings};
use serde_json::{json, Value};

/// The template opens `<think>`; the model reasons, closes it and calls the tool.
const CALL: &str = "The user wants the weather.\n</think>\n\n<tool_call>\n\
    <function=get_weather>\n<parameter=city>\nParis\n</parameter>\n\
    <parameter=days>\n2\n</parameter>\n</function>\n</tool_call>";

/// The model reasons, then answers.
const ANSWER: &str = "Easy.</think>\n\nIt is sunny.";

struct Api {
    served: Served,
    http: reqwest::Client,
}

impl Api {
    async fn start(reply: &str, settings: Settings) -> Api {
        let settings = Settings {
            log_level: LogLevel::Warning,
            ..settings
        };
        Api {
            served: serve(&QWEN3_5, reply, settings).await,
            http: reqwest::Client::new(),
        }
    }

    async fn send(&self, request: reqwest::RequestBuilder) -> (u16, String) {
        let response = request.send().await.unwrap();
        (response.status().as_u16(), response.text().await.unwrap())
    }

    async fn post_text(&self, path: &str, body: &str) -> (u16, String) {
        let url = format!("{}{path}", self.served.base);
        self.send(self.http.post(url).body(body.to_owned())).await
    }

    /// POSTs `body` to `path`; the status and the JSON answered.
    async fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        let (status, text) = self.post_text(path, &body.to_string()).await;
        (status, serde_json::from_str(&text).unwrap())
    }

    /// A response that must succeed.
    async fn create(&self, body: Value) -> Value {
        let (status, response) = self.post("/v1/responses", &body).await;
        assert_eq!(status, 200, "{response}");
        response
    }

    async fn get(&self, id: &str) -> (u16, Value) {
        let url = format!("{}/v1/responses/{id}", self.served.base);
        let (status, text) = self.send(self.http.get(url)).await;
        (status, serde_json::from_str(&text).unwrap())
    }

    async fn delete(&self, id: &str) -> (u16, Value) {
        let url = format!("{}/v1/responses/{id}", self.served.base);
        let (status, text) = self.send(self.http.delete(url)).await;
        (status, serde_json::from_str(&text).unwrap())
    }

    /// Asserts that the last prompt, a Responses request's of `input_tokens`, is the one chat
    /// completions make of `messages` and `tools`: the same conversation, rendered alike.
    async fn assert_prompt_is_chat(&self, input_tokens: &Value, messages: Value, tools: Value) {
        let prompt = self.served.last_prompt();
        assert_eq!(*input_tokens, self.served.last_prompt_ids().len());
        let body = json!({"messages": messages, "tools": tools, "max_tokens": 1});
        let (status, r) = self.post("/v1/chat/completions", &body).await;
        assert_eq!(status, 200, "{r}");
        assert_eq!(prompt, self.served.last_prompt());
    }

    /// How many tokens the model's tokenizer makes of `text`.
    fn tokens(&self, text: &str) -> u64 {
        let ids = self.served.tokenizer.encode(text, false).unwrap();
        ids.len() as u64
    }

    async fn model_id(&self) -> Value {
        let url = format!("{}/v1/models", self.served.base);
        let (_, text) = self.send(self.http.get(url)).await;
        serde_json::from_str::<Value>(&text).unwrap()["data"][0]["id"].clone()
    }
}

fn tool() -> Value {
    json!({"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {
               "city": {"type": "string"}, "days": {"type": "integer"}}},
           "strict": false})
}

/// `tool()` as chat completions take it.
fn chat_tool() -> Value {
    let mut function = tool();
    function.as_object_mut().unwrap().remove("type");
    json!({"type": "function", "function": function})
}

fn call_request() -> Value {
    json!({"model": "m", "input": "Weather in Paris?", "instructions": "Be brief.",
           "tools": [tool()], "metadata": {"run": "1"}})
}

/// Asserts `id` is `prefix`, `_` and 32 hex digits.
fn assert_id(id: &Value, prefix: &str) {
    let id = id.as_str().unwrap();
    let hex = id
        .strip_prefix(prefix)
        .and_then(|rest| rest.strip_prefix('_'));
    assert!(
        hex.is_some_and(|hex| hex.len() == 32 && hex.bytes().all(|b| b.is_ascii_hexdigit())),
        "{id}"
    );
}

const REASONING: &str = "The user wants the weather.\n";
const ARGUMENTS: &str = "{\"city\":\"Paris\",\"days\":2}";

/// The whole response object of `call_request()` on the `CALL` script, the last request made:
/// its ids and time are `r`'s, checked for their form only.
async fn assert_call_response(api: &Api, r: &Value) {
    for (value, prefix) in [
        (&r["id"], "resp"),
        (&r["output"][0]["id"], "rs"),
        (&r["output"][1]["id"], "fc"),
        (&r["output"][1]["call_id"], "call"),
    ] {
        assert_id(value, prefix);
    }
    let input_tokens = r["usage"]["input_tokens"].as_u64().unwrap();
    let messages = json!([{"role": "system", "content": "Be brief."},
                          {"role": "user", "content": "Weather in Paris?"}]);
    api.assert_prompt_is_chat(&input_tokens.into(), messages, json!([chat_tool()]))
        .await;
    // The script's tokens and the end of sequence; those up to `</think>` are reasoning.
    let output_tokens = api.tokens(CALL) + 1;
    let reasoning_tokens = api.tokens(&format!("{REASONING}</think>"));
    assert_eq!(
        *r,
        json!({
            "id": r["id"],
            "object": "response",
            "created_at": r["created_at"],
            "status": "completed",
            "incomplete_details": null,
            "error": null,
            "model": api.model_id().await,
            "output": [
                {"type": "reasoning", "id": r["output"][0]["id"], "summary": [],
                 "content": [{"type": "reasoning_text", "text": REASONING}]},
                // The blank line between the reasoning and the call is no message.
                {"type": "function_call", "id": r["output"][1]["id"],
                 "call_id": r["output"][1]["call_id"], "name": "get_weather",
                 "arguments": ARGUMENTS, "status": "completed"},
            ],
            "usage": {
                "input_tokens": input_tokens,
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": output_tokens,
                "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
                "total_tokens": input_tokens + output_tokens,
            },
            "instructions": "Be brief.",
            "tools": [tool()],
            "tool_choice": "auto",
            "text": {"format": {"type": "text"}},
            "temperature": 0.0,
            "top_p": 1.0,
            "max_output_tokens": null,
            "previous_response_id": null,
            "store": true,
            "metadata": {"run": "1"},
            "parallel_tool_calls": true,
            "reasoning": null,
        })
    );
}

#[tokio::test]
async fn a_response_with_reasoning_and_a_call() {
    let api = Api::start(CALL, Settings::default()).await;
    let r = api.create(call_request()).await;
    assert_call_response(&api, &r).await;
    // Stored as answered.
    assert_eq!(api.get(r["id"].as_str().unwrap()).await, (200, r));
}

/// The events of an SSE stream, numbered in order (the numbers checked and taken out), each
/// one's `event:` name checked against its `type`. The deltas of an item are joined into one
/// event: how text splits into tokens is the tokenizer's business.
fn events(text: &str) -> Vec<Value> {
    let mut events: Vec<Value> = Vec::new();
    for (number, block) in text
        .split("\n\n")
        .filter(|block| block.contains("data: "))
        .enumerate()
    {
        let field = |name: &str| block.lines().find_map(|line| line.strip_prefix(name));
        let mut event: Value = serde_json::from_str(field("data: ").unwrap()).unwrap();
        assert_eq!(field("event: "), event["type"].as_str(), "{block}");
        assert_eq!(event["sequence_number"], number, "{block}");
        event.as_object_mut().unwrap().remove("sequence_number");
        let kind = event["type"].as_str().unwrap();
        match events.last_mut() {
            Some(last)
                if kind.ends_with(".delta")
                    && last["type"] == kind
                    && last["item_id"] == event["item_id"] =>
            {
                let delta = event["delta"].as_str().unwrap();
                last["delta"] = format!("{}{delta}", last["delta"].as_str().unwrap()).into();
            }
            _ => events.push(event),
        }
    }
    events
}

/// `response` as the stream's first events give it, before any output.
fn in_progress(response: &Value) -> Value {
    let mut start = response.clone();
    start["status"] = "in_progress".into();
    start["output"] = json!([]);
    start["usage"] = Value::Null;
    start
}

#[tokio::test]
async fn reasoning_and_a_call_streamed() {
    let api = Api::start(CALL, Settings::default()).await;
    let mut body = call_request();
    body["stream"] = true.into();
    let (status, text) = api.post_text("/v1/responses", &body.to_string()).await;
    assert_eq!(status, 200, "{text}");
    let events = events(&text);
    let r = events.last().unwrap()["response"].clone();
    assert_call_response(&api, &r).await;
    let (rs, fc) = (&r["output"][0]["id"], &r["output"][1]["id"]);
    assert_eq!(
        events,
        [
            json!({"type": "response.created", "response": in_progress(&r)}),
            json!({"type": "response.in_progress", "response": in_progress(&r)}),
            json!({"type": "response.output_item.added", "output_index": 0,
                   "item": {"type": "reasoning", "id": rs, "summary": [], "content": []}}),
            json!({"type": "response.content_part.added", "item_id": rs, "output_index": 0,
                   "content_index": 0, "part": {"type": "reasoning_text", "text": ""}}),
            json!({"type": "response.reasoning_text.delta", "item_id": rs, "output_index": 0,
                   "content_index": 0, "delta": REASONING}),
            json!({"type": "response.reasoning_text.done", "item_id": rs, "output_index": 0,
                   "content_index": 0, "text": REASONING}),
            json!({"type": "response.content_part.done", "item_id": rs, "output_index": 0,
                   "content_index": 0, "part": {"type": "reasoning_text", "text": REASONING}}),
            json!({"type": "response.output_item.done", "output_index": 0,
                   "item": r["output"][0]}),
            json!({"type": "response.output_item.added", "output_index": 1,
                   "item": {"type": "function_call", "id": fc, "call_id": r["output"][1]["call_id"],
                            "name": "get_weather", "arguments": "", "status": "in_progress"}}),
            json!({"type": "response.function_call_arguments.delta", "item_id": fc,
                   "output_index": 1, "delta": ARGUMENTS}),
            json!({"type": "response.function_call_arguments.done", "item_id": fc,
                   "output_index": 1, "arguments": ARGUMENTS}),
            json!({"type": "response.output_item.done", "output_index": 1,
                   "item": r["output"][1]}),
            json!({"type": "response.completed", "response": r}),
        ]
    );
    assert_eq!(api.get(r["id"].as_str().unwrap()).await, (200, r));
}

#[tokio::test]
async fn a_message_streamed_and_cut_short() {
    let api = Api::start(ANSWER, Settings::default()).await;
    let full = api.create(json!({"input": "Weather in Paris?"})).await;
    assert_eq!(full["status"], "completed");
    assert_eq!(full["output"][1]["content"][0]["text"], "\n\nIt is sunny.");
    // Two tokens fewer: the answer stops short.
    let max = full["usage"]["output_tokens"].as_u64().unwrap() - 2;
    let body = json!({"input": "Weather in Paris?", "max_output_tokens": max, "stream": true});
    let (status, text) = api.post_text("/v1/responses", &body.to_string()).await;
    assert_eq!(status, 200, "{text}");
    let events = events(&text);
    let r = events.last().unwrap()["response"].clone();
    let answer = r["output"][1]["content"][0]["text"].as_str().unwrap();
    assert!(
        answer.starts_with("\n\nIt") && "\n\nIt is sunny.".strip_prefix(answer).unwrap() != "",
        "{answer:?}"
    );
    let (rs, msg) = (&r["output"][0]["id"], &r["output"][1]["id"]);
    assert_id(msg, "msg");
    let part = json!({"type": "output_text", "text": answer, "annotations": []});
    let message = json!({"type": "message", "id": msg, "status": "incomplete",
                         "role": "assistant", "content": [part]});
    assert_eq!(r["status"], "incomplete");
    assert_eq!(
        r["incomplete_details"],
        json!({"reason": "max_output_tokens"})
    );
    assert_eq!(r["max_output_tokens"], max);
    assert_eq!(r["output"][1], message);
    assert_eq!(r["usage"]["output_tokens"], max);
    assert_eq!(
        events[7..],
        [
            json!({"type": "response.output_item.done", "output_index": 0,
                   "item": {"type": "reasoning", "id": rs, "summary": [],
                            "content": [{"type": "reasoning_text", "text": "Easy."}]}}),
            json!({"type": "response.output_item.added", "output_index": 1,
                   "item": {"type": "message", "id": msg, "status": "in_progress",
                            "role": "assistant", "content": []}}),
            json!({"type": "response.content_part.added", "item_id": msg, "output_index": 1,
                   "content_index": 0,
                   "part": {"type": "output_text", "text": "", "annotations": []}}),
            json!({"type": "response.output_text.delta", "item_id": msg, "output_index": 1,
                   "content_index": 0, "delta": answer, "logprobs": []}),
            json!({"type": "response.output_text.done", "item_id": msg, "output_index": 1,
                   "content_index": 0, "text": answer, "logprobs": []}),
            json!({"type": "response.content_part.done", "item_id": msg, "output_index": 1,
                   "content_index": 0, "part": part}),
            json!({"type": "response.output_item.done", "output_index": 1, "item": message}),
            json!({"type": "response.incomplete", "response": r}),
        ]
    );
}

#[tokio::test]
async fn previous_response_id_continues_the_conversation() {
    let api = Api::start(ANSWER, Settings::default()).await;
    let first = api
        .create(json!({"input": "Weather in Paris?", "instructions": "Be brief."}))
        .await;
    let second = api
        .create(json!({"input": "And tomorrow?", "previous_response_id": first["id"]}))
        .await;
    assert_eq!(second["previous_response_id"], first["id"]);
    // The first turn, its reasoning and answer, then the new question; the first request's
    // instructions are not inherited.
    let turns = json!([
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "\n\nIt is sunny.", "reasoning_content": "Easy."},
        {"role": "user", "content": "And tomorrow?"},
    ]);
    let input_tokens = &second["usage"]["input_tokens"];
    api.assert_prompt_is_chat(input_tokens, turns.clone(), Value::Null)
        .await;
    // A third turn goes on from the second, which holds the first.
    let third = api
        .create(json!({"input": [{"role": "user", "content": "And after?"}],
                       "previous_response_id": second["id"]}))
        .await;
    let mut turns = turns.as_array().unwrap().clone();
    turns.extend([
        json!({"role": "assistant", "content": "\n\nIt is sunny.", "reasoning_content": "Easy."}),
        json!({"role": "user", "content": "And after?"}),
    ]);
    let input_tokens = &third["usage"]["input_tokens"];
    api.assert_prompt_is_chat(input_tokens, turns.into(), Value::Null)
        .await;
}

#[tokio::test]
async fn a_call_and_its_output_go_back() {
    let api = Api::start(CALL, Settings::default()).await;
    let first = api.create(call_request()).await;
    let call = &first["output"][1];
    let call_output = json!({"type": "function_call_output", "call_id": call["call_id"],
                             "output": "18C, sunny"});
    // The call goes back as the assistant's, with its reasoning, and its output as the tool's.
    let history = json!([
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "reasoning_content": REASONING,
         "tool_calls": [{"id": call["call_id"], "type": "function",
                         "function": {"name": "get_weather", "arguments": ARGUMENTS}}]},
        {"role": "tool", "tool_call_id": call["call_id"], "content": "18C, sunny"},
    ]);
    let tools = json!([chat_tool()]);
    // Continued from the stored response...
    let continued = api
        .create(
            json!({"input": [call_output], "previous_response_id": first["id"],
                       "instructions": "Be brief.", "tools": [tool()]}),
        )
        .await;
    let input_tokens = &continued["usage"]["input_tokens"];
    api.assert_prompt_is_chat(input_tokens, history.clone(), tools.clone())
        .await;
    assert_eq!(continued["output"][1]["type"], "function_call");
    // ...or with the whole conversation sent back, as a client that stores nothing does.
    let mut input = vec![json!({"role": "user", "content": "Weather in Paris?"})];
    input.extend(first["output"].as_array().unwrap().iter().cloned());
    input.push(call_output);
    let resent = api
        .create(
            json!({"input": input, "instructions": "Be brief.", "tools": [tool()],
                       "store": false}),
        )
        .await;
    api.assert_prompt_is_chat(&resent["usage"]["input_tokens"], history, tools)
        .await;
}

#[tokio::test]
async fn the_store_is_bounded_and_can_be_emptied() {
    let settings = Settings {
        response_store_size: 2,
        ..Settings::default()
    };
    let api = Api::start(ANSWER, settings).await;
    let mut ids = Vec::new();
    for _ in 0..3 {
        let r = api.create(json!({"input": "Hi"})).await;
        ids.push(r["id"].as_str().unwrap().to_owned());
    }
    let not_found = |id: &str| {
        json!({"error": {"message": format!("Response with id '{id}' not found."),
                         "type": "invalid_request_error", "param": null, "code": "not_found"}})
    };
    // The least recently used went.
    assert_eq!(api.get(&ids[0]).await, (404, not_found(&ids[0])));
    assert_eq!(api.get(&ids[1]).await.0, 200);
    assert_eq!(api.get(&ids[2]).await.0, 200);
    // `store: false` keeps nothing, and evicts nothing.
    let unstored = api.create(json!({"input": "Hi", "store": false})).await;
    assert_eq!(unstored["store"], false);
    let unstored_id = unstored["id"].as_str().unwrap();
    assert_eq!(api.get(unstored_id).await, (404, not_found(unstored_id)));
    let (status, error) = api
        .post(
            "/v1/responses",
            &json!({"input": "Hi", "previous_response_id": unstored_id}),
        )
        .await;
    assert_eq!(status, 404);
    assert_eq!(error["error"]["code"], "previous_response_not_found");
    assert_eq!(api.get(&ids[1]).await.0, 200);
    // Deleted, it is gone.
    assert_eq!(
        api.delete(&ids[2]).await,
        (
            200,
            json!({"id": ids[2], "object": "response", "deleted": true})
        )
    );
    assert_eq!(api.get(&ids[2]).await, (404, not_found(&ids[2])));
    assert_eq!(api.delete(&ids[2]).await, (404, not_found(&ids[2])));
}

#[tokio::test]
async fn errors_are_openai_objects_and_the_server_serves_on() {
    let api = Api::start(ANSWER, Settings::default()).await;
    let error = |message: &str, param: Option<&str>, code: Option<&str>| {
        json!({"error": {"message": message, "type": "invalid_request_error",
                         "param": param, "code": code}})
    };
    let cases = [
        (
            json!({"input": "Hi", "previous_response_id": "resp_nope"}),
            404,
            error(
                "Previous response with id 'resp_nope' not found.",
                Some("previous_response_id"),
                Some("previous_response_not_found"),
            ),
        ),
        (
            json!({"input": [{"type": "image_generation_call", "id": "ig_1"}]}),
            400,
            error(
                "Input items of type `image_generation_call` are not supported",
                Some("input[0].type"),
                None,
            ),
        ),
        (
            json!({"input": [{"role": "user", "content": [
                {"type": "input_text", "text": "What is this?"},
                {"type": "input_image", "image_url": "https://example.com/a.png"}]}]}),
            400,
            error(
                "Only text content parts (`input_text`, `output_text`) are supported",
                Some("input[0].content[1]"),
                None,
            ),
        ),
        (
            json!({"input": [{"type": "function_call_output", "output": "18C"}]}),
            400,
            error("`call_id` must be a string", Some("input[0].call_id"), None),
        ),
        (
            json!({"input": "Hi", "tools": [tool(), {"type": "web_search"}]}),
            400,
            error(
                "Tools of type `web_search` are not supported: only `function` tools are",
                Some("tools[1].type"),
                None,
            ),
        ),
        (
            json!({"input": "Hi", "tool_choice": "required"}),
            400,
            error(
                "a tool call is required but the request gives no tools",
                Some("tool_choice"),
                None,
            ),
        ),
        (
            json!({"input": "Hi", "text": {"format": {"type": "yaml"}}}),
            400,
            error(
                "`text.format.type` must be \"text\", \"json_object\" or \"json_schema\"",
                Some("text.format.type"),
                None,
            ),
        ),
        (
            // A schema the grammar engine cannot enforce, named as this API names the field.
            json!({"input": "Hi", "text": {"format": {"type": "json_schema", "name": "set",
                   "schema": {"type": "array", "uniqueItems": true}}}}),
            400,
            error(
                "Unimplemented keys: [\"uniqueItems\"]",
                Some("text.format"),
                None,
            ),
        ),
        (
            json!({"input": "Hi", "max_output_tokens": 0}),
            400,
            error(
                "`max_output_tokens` must be at least 1",
                Some("max_output_tokens"),
                None,
            ),
        ),
        (
            json!({}),
            400,
            error("Request did not contain input", Some("input"), None),
        ),
    ];
    for (body, status, expected) in cases {
        assert_eq!(
            api.post("/v1/responses", &body).await,
            (status, expected),
            "{body}"
        );
    }
    let (status, text) = api.post_text("/v1/responses", "{\"input\": ").await;
    assert_eq!(status, 400);
    assert_eq!(
        serde_json::from_str::<Value>(&text).unwrap(),
        error(
            "Invalid JSON in request body: EOF while parsing a value at line 1 column 10",
            None,
            None
        )
    );
    let r = api.create(json!({"input": "Hi"})).await;
    assert_eq!(r["status"], "completed");
}
