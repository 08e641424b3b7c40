//! Reasoning and tool calls end to end: a scripted model (it answers a fixed token sequence)
//! behind a real chat template (Qwen 3.5's, Gemma 4's), with a tokenizer that has that family's
//! markup tokens, so the reply is what a reasoning model that calls a tool writes.

mod common;

use std::path::Path;
use std::sync::Mutex;

use oxlm_engine::{Device, Tensor};
use oxlm_models::{Cache, ForwardError, LanguageModel, Logits, ModelInfo};
use oxlm_runtime::chat_template::ChatTemplate;
use oxlm_runtime::tokenizer::Tokenizer;
use oxlm_runtime::LoadedModel;
use oxlm_server::{Server, Settings};
use serde_json::{json, Map, Value};

/// `<|im_end|>` in the tiny tokenizer.
const EOS: u32 = 2;

/// Answers `script`, then end-of-sequence, whatever the prompt.
struct Scripted {
    info: ModelInfo,
    script: Vec<u32>,
    /// Tokens of the prompt of the sequence being generated.
    prompt_len: Mutex<usize>,
}

impl LanguageModel for Scripted {
    fn info(&self) -> &ModelInfo {
        &self.info
    }

    fn new_cache(&self) -> Result<Cache, ForwardError> {
        Ok(Cache::new(Vec::new()))
    }

    fn forward(
        &self,
        tokens: &[u32],
        cache: &mut Cache,
        _: Logits,
    ) -> Result<Tensor, ForwardError> {
        let mut prompt_len = self.prompt_len.lock().unwrap();
        if cache.offset == 0 {
            *prompt_len = tokens.len();
        }
        cache.offset += tokens.len();
        let next = self
            .script
            .get(cache.offset - *prompt_len)
            .copied()
            .unwrap_or(EOS);
        let mut logits = vec![0.0; self.info.vocab_size];
        logits[next as usize] = 10.0;
        Ok(Tensor::new(vec![1, self.info.vocab_size], logits))
    }
}

/// A chat template of tests/fixtures/templates and the markup tokens of its family.
struct Family {
    template: &'static str,
    tokens: &'static [&'static str],
}

const QWEN3_5: Family = Family {
    template: "qwen3.5.jinja",
    tokens: &["<think>", "</think>"],
};

const GEMMA4: Family = Family {
    template: "gemma4.jinja",
    tokens: &[
        "<|turn>",
        "<turn|>",
        "<|think|>",
        "<|channel>",
        "<channel|>",
        "<|tool_call>",
        "<tool_call|>",
        "<|\"|>",
    ],
};

/// The tiny tokenizer with `tokens` added, in `dir`.
fn tokenizer_with(dir: &Path, tokens: &[&str]) -> Tokenizer {
    let source = common::fixtures().join("tiny/tokenizer");
    std::fs::copy(
        source.join("tokenizer_config.json"),
        dir.join("tokenizer_config.json"),
    )
    .unwrap();
    let mut json: Value =
        serde_json::from_str(&std::fs::read_to_string(source.join("tokenizer.json")).unwrap())
            .unwrap();
    for (id, content) in (512..).zip(tokens) {
        json["added_tokens"].as_array_mut().unwrap().push(json!({"id": id, "content": content,
            "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": false}));
    }
    std::fs::write(dir.join("tokenizer.json"), json.to_string()).unwrap();
    Tokenizer::from_dir(dir).unwrap()
}

async fn start(family: &Family, reply: &str) -> String {
    let dir = tempfile::tempdir().unwrap();
    let tokenizer = tokenizer_with(dir.path(), family.tokens);
    let template_path = common::fixtures().join("templates").join(family.template);
    let template =
        ChatTemplate::new(&std::fs::read_to_string(template_path).unwrap(), Map::new()).unwrap();
    let model = Scripted {
        info: ModelInfo {
            model_type: "scripted".into(),
            vocab_size: tokenizer.vocab_size(),
            hidden_size: 1,
            num_layers: 0,
            max_context: None,
            device: Device::Cpu,
        },
        script: tokenizer.encode(reply, false).unwrap(),
        prompt_len: Mutex::new(0),
    };
    let loaded = LoadedModel {
        dir: dir.path().to_path_buf(),
        model: Box::new(model),
        tokenizer,
        chat_template: Some(template),
        eos_ids: [EOS].into(),
    };
    // Every request starts from an empty cache and goes through in one pass: the script is
    // indexed by position from the end of the first.
    let settings = Settings {
        prompt_cache_size: 0,
        prefill_pause: None,
        ..Settings::default()
    };
    let server = Server::new(loaded, settings).unwrap();
    let base = common::listen(server).await;
    base
}

fn request(stream: bool) -> Value {
    json!({
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}],
        "stream": stream,
    })
}

async fn post(base: &str, body: &Value) -> String {
    reqwest::Client::new()
        .post(format!("{base}/v1/chat/completions"))
        .body(body.to_string())
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}

/// The template opens `<think>`; the model reasons, closes it and calls the tool.
const REPLY: &str = "The user wants the weather.\n</think>\n\n<tool_call>\n<function=get_weather>\n\
    <parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>";

#[tokio::test]
async fn reasoning_and_tool_call_in_a_message() {
    let base = start(&QWEN3_5, REPLY).await;
    let r: Value = serde_json::from_str(&post(&base, &request(false)).await).unwrap();
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
    let mut next = request(false);
    next["messages"].as_array_mut().unwrap().extend([
        json!({"role": "assistant", "content": "", "tool_calls": calls}),
        json!({"role": "tool", "tool_call_id": calls[0]["id"], "content": "18C, sunny"}),
    ]);
    let r: Value = serde_json::from_str(&post(&base, &next).await).unwrap();
    assert_eq!(r["choices"][0]["finish_reason"], "tool_calls", "{r}");
}

#[tokio::test]
async fn reasoning_and_tool_call_streamed() {
    let base = start(&QWEN3_5, REPLY).await;
    let text = post(&base, &request(true)).await;
    let chunks: Vec<Value> = text
        .split("\n\n")
        .filter_map(|e| e.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
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

#[tokio::test]
async fn a_plain_answer_after_reasoning() {
    let base = start(&QWEN3_5, "Easy.</think>\n\nIt is sunny.").await;
    let r: Value = serde_json::from_str(&post(&base, &request(false)).await).unwrap();
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
    let r: Value = serde_json::from_str(&post(&base, &request(false)).await).unwrap();
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
    let mut next = request(false);
    next["messages"].as_array_mut().unwrap().extend([
        json!({"role": "assistant", "content": "", "tool_calls": calls}),
        json!({"role": "tool", "tool_call_id": id, "content": "18C, sunny"}),
    ]);
    let r: Value = serde_json::from_str(&post(&base, &next).await).unwrap();
    assert_eq!(r["choices"][0]["finish_reason"], "tool_calls", "{r}");
}
