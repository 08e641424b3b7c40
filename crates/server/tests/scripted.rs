//! Reasoning and tool calls end to end: a scripted model (it answers a fixed token sequence)
//! behind a real chat template (Qwen 3.5's, Gemma 4's), with a tokenizer that has that family's
//! markup tokens, so the reply is what a reasoning model that calls a tool writes.

mod common;

use common::scripted::{start, weather_request, GEMMA4, QWEN3_5};
use common::{chat, chunks};
use serde_json::{json, Value};

/// The template opens `<think>`; the model reasons, closes it and calls the tool.
const REPLY: &str = "The user wants the weather.\n</think>\n\n<tool_call>\n<function=get_weather>\n\
    <parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>";

#[tokio::test]
async fn reasoning_and_tool_call_in_a_message() {
    let base = start(&QWEN3_5, REPLY).await;
    let r: Value = serde_json::from_str(&chat(&base, &weather_request(false)).await).unwrap();
    let choice = &r["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{r}");
    let message = &choice["message"];
    assert_eq!(message["role"], "assistant");
    assert_eq!(
        message["reasoning_content"],
        "The user wants the weather.\n"
    );
    assert_eq!(message["content"], "\n\n");
    let calls = message["tool_calls"].as_array().unwrap();
    assert_eq!(calls.len(), 1);
    assert_eq!(calls[0]["type"], "function");
    assert!(calls[0]["id"].as_str().unwrap().starts_with("call_"));
    assert_eq!(calls[0]["function"]["name"], "get_weather");
    let arguments: Value =
        serde_json::from_str(calls[0]["function"]["arguments"].as_str().unwrap()).unwrap();
    assert_eq!(arguments, json!({"city": "Paris", "days": 2}));

    // The call goes back as history with its result; the template takes both.
    let mut next = weather_request(false);
    next["messages"].as_array_mut().unwrap().extend([
        json!({"role": "assistant", "content": "", "tool_calls": calls}),
        json!({"role": "tool", "tool_call_id": calls[0]["id"], "content": "18C, sunny"}),
    ]);
    let r: Value = serde_json::from_str(&chat(&base, &next).await).unwrap();
    assert_eq!(r["choices"][0]["finish_reason"], "tool_calls", "{r}");
}

#[tokio::test]
async fn reasoning_and_tool_call_streamed() {
    let base = start(&QWEN3_5, REPLY).await;
    let text = chat(&base, &weather_request(true)).await;
    let chunks = chunks(&text);
    let delta = |key: &str| -> String {
        chunks
            .iter()
            .filter_map(|c| c["choices"][0]["delta"][key].as_str())
            .collect()
    };
    assert_eq!(delta("reasoning_content"), "The user wants the weather.\n");
    assert_eq!(delta("content"), "\n\n");
    let calls: Vec<&Value> = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["tool_calls"].as_array())
        .flatten()
        .collect();
    assert_eq!(calls.len(), 1);
    assert_eq!(calls[0]["index"], 0);
    assert_eq!(calls[0]["function"]["name"], "get_weather");
    // No markup leaks into any chunk.
    assert!(
        !text.contains("tool_call>") && !text.contains("think>"),
        "{text}"
    );
    let last = chunks.last().unwrap();
    assert_eq!(last["choices"][0]["finish_reason"], "tool_calls");
}

/// [`REPLY`] with a second call after the first, and text after that.
const TWO_CALLS: &str =
    "The user wants the weather.\n</think>\n\n<tool_call>\n<function=get_weather>\n\
    <parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n\
    <function=get_weather>\n<parameter=city>\nLyon\n</parameter>\n</function>\n</tool_call>\n\
    Both asked.";

/// The cities of a message's (or its stream's) calls.
fn cities(calls: &[&Value]) -> Vec<String> {
    calls
        .iter()
        .map(|call| {
            let arguments: Value =
                serde_json::from_str(call["function"]["arguments"].as_str().unwrap()).unwrap();
            arguments["city"].as_str().unwrap().to_owned()
        })
        .collect()
}

/// `parallel_tool_calls: false`: the reply ends at its first call, whatever the model writes
/// after it (the generation stops there: fewer tokens are counted); by default both come.
#[tokio::test]
async fn without_parallel_calls_the_reply_ends_at_the_first() {
    let base = start(&QWEN3_5, TWO_CALLS).await;
    for stream in [false, true] {
        let mut one = weather_request(stream);
        one["parallel_tool_calls"] = json!(false);
        one["stream_options"] = json!({"include_usage": true});
        let mut both = weather_request(stream);
        both["stream_options"] = json!({"include_usage": true});
        let mut replies = Vec::new();
        for body in [&one, &both] {
            let text = chat(&base, body).await;
            let (calls, finish, usage, content) = if stream {
                let chunks = chunks(&text);
                let deltas: Vec<Value> = chunks
                    .iter()
                    .map(|c| c["choices"][0]["delta"].clone())
                    .collect();
                let calls: Vec<Value> = deltas
                    .iter()
                    .filter_map(|d| d["tool_calls"].as_array())
                    .flatten()
                    .cloned()
                    .collect();
                let content: String = deltas
                    .iter()
                    .filter_map(|d| d["content"].as_str())
                    .collect();
                let finish = chunks
                    .iter()
                    .find_map(|c| c["choices"][0]["finish_reason"].as_str().map(str::to_owned));
                (
                    calls,
                    finish.unwrap(),
                    chunks.last().unwrap()["usage"].clone(),
                    content,
                )
            } else {
                let r: Value = serde_json::from_str(&text).unwrap();
                let message = &r["choices"][0]["message"];
                let calls = message["tool_calls"].as_array().unwrap().clone();
                let finish = r["choices"][0]["finish_reason"]
                    .as_str()
                    .unwrap()
                    .to_owned();
                let content = message["content"].as_str().unwrap_or("").to_owned();
                (calls, finish, r["usage"].clone(), content)
            };
            assert_eq!(finish, "tool_calls", "{text}");
            let calls: Vec<&Value> = calls.iter().collect();
            replies.push((cities(&calls), usage["completion_tokens"].clone(), content));
        }
        let (one, both) = (&replies[0], &replies[1]);
        assert_eq!(one.0, ["Paris"], "stream: {stream}");
        assert_eq!(both.0, ["Paris", "Lyon"], "stream: {stream}");
        assert_eq!(
            (one.2.as_str(), both.2.as_str()),
            ("\n\n", "\n\n\n\nBoth asked.")
        );
        assert!(
            one.1.as_u64().unwrap() < both.1.as_u64().unwrap(),
            "{one:?} {both:?}"
        );
    }
}

#[tokio::test]
async fn a_plain_answer_after_reasoning() {
    let base = start(&QWEN3_5, "Easy.</think>\n\nIt is sunny.").await;
    let r: Value = serde_json::from_str(&chat(&base, &weather_request(false)).await).unwrap();
    let choice = &r["choices"][0];
    assert_eq!(choice["finish_reason"], "stop");
    assert_eq!(choice["message"]["reasoning_content"], "Easy.");
    assert_eq!(choice["message"]["content"], "\n\nIt is sunny.");
    assert!(choice["message"].get("tool_calls").is_none());
}

/// Gemma 4 reasons in its thought channel, then calls the tool in its own notation.
#[tokio::test]
async fn gemma4_thought_channel_and_tool_call() {
    let reply = "<|channel>thought\nThe user wants the weather.<channel|>\
        <|tool_call>call:get_weather{city:<|\"|>Paris<|\"|>,days:2}<tool_call|>";
    let base = start(&GEMMA4, reply).await;
    let r: Value = serde_json::from_str(&chat(&base, &weather_request(false)).await).unwrap();
    let choice = &r["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{r}");
    let message = &choice["message"];
    let calls = message["tool_calls"].as_array().unwrap();
    let id = calls[0]["id"].clone();
    assert_eq!(
        *message,
        json!({"role": "assistant", "content": null,
               "reasoning_content": "\nThe user wants the weather.",
               "reasoning": "\nThe user wants the weather.",
               "tool_calls": [{"id": id, "type": "function", "function": {
                   "name": "get_weather", "arguments": "{\"city\":\"Paris\",\"days\":2}"}}]})
    );
    // The call and its result go back through the Gemma 4 template.
    let mut next = weather_request(false);
    next["messages"].as_array_mut().unwrap().extend([
        json!({"role": "assistant", "content": "", "tool_calls": calls}),
        json!({"role": "tool", "tool_call_id": id, "content": "18C, sunny"}),
    ]);
    let r: Value = serde_json::from_str(&chat(&base, &next).await).unwrap();
    assert_eq!(r["choices"][0]["finish_reason"], "tool_calls", "{r}");
}
