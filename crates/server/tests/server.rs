//! The server over real HTTP on the tiny fixture models: payload shapes, streaming, stop
//! strings, logprobs, errors and limits, the prompt cache, serving while generating, and LoRA
//! adapters chosen per request. Greedy outputs are checked against the goldens that mlx-lm
//! produced for these models.

mod common;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use oxlm_models::lora::{AdaptedModel, Adapters, RowAdapters};
use oxlm_runtime::sampler::SamplerConfig;
use oxlm_runtime::tokenizer::Tokenizer;
use oxlm_runtime::{generate, GenerateOptions, LoadedModel};
use oxlm_server::{LogLevel, Server, Settings};
use reqwest::StatusCode;
use serde_json::{json, Value};

use common::fixtures;

fn fixture(name: &str) -> PathBuf {
    fixtures().join("tiny").join(name)
}

struct Golden {
    messages: Value,
    prompt_text: String,
    n_prompt: usize,
    ids: Vec<u32>,
    tokenizer: Tokenizer,
}

impl Golden {
    fn load(name: &str) -> Self {
        let dir = fixture(name);
        let golden: Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("golden.json")).unwrap())
                .unwrap();
        Golden {
            messages: golden["messages"].clone(),
            prompt_text: golden["prompt_text"].as_str().unwrap().to_owned(),
            n_prompt: golden["n_prompt"].as_u64().unwrap() as usize,
            ids: serde_json::from_value(golden["greedy_ids"].clone()).unwrap(),
            tokenizer: Tokenizer::from_dir(&dir).unwrap(),
        }
    }

    /// What streaming the first `n` greedy tokens prints (mlx-lm's streaming detokenizer).
    fn text(&self, n: usize) -> String {
        let mut detokenizer = self.tokenizer.detokenizer().unwrap();
        let mut text: String = self.ids[..n]
            .iter()
            .map(|&id| detokenizer.push(id).unwrap())
            .collect();
        text.push_str(&detokenizer.finish().unwrap());
        text
    }
}

struct TestServer {
    base: String,
    model_id: String,
    client: reqwest::Client,
}

async fn start(model: &str, settings: Settings) -> TestServer {
    // Request lines would come from the server's threads, past the test harness's capture.
    let settings = Settings {
        log_level: LogLevel::Warning,
        ..settings
    };
    let server = Server::load(&fixture(model), settings).unwrap();
    let model_id = server.model_id().to_owned();
    let base = common::listen(server).await;
    TestServer {
        base,
        model_id,
        client: reqwest::Client::new(),
    }
}

impl TestServer {
    async fn post(&self, path: &str, body: &Value) -> (StatusCode, Value) {
        self.post_raw(path, body.to_string()).await
    }

    async fn post_raw(&self, path: &str, body: String) -> (StatusCode, Value) {
        let response = self
            .client
            .post(format!("{}{path}", self.base))
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await
            .unwrap();
        let status = response.status();
        let text = response.text().await.unwrap();
        (
            status,
            serde_json::from_str(&text).unwrap_or(Value::String(text)),
        )
    }

    async fn get(&self, path: &str) -> (StatusCode, Value) {
        let response = self
            .client
            .get(format!("{}{path}", self.base))
            .send()
            .await
            .unwrap();
        (response.status(), response.json_value().await)
    }

    /// A streamed request's `data:` payloads, in order (`[DONE]` as a string).
    async fn stream(&self, path: &str, body: &Value) -> Vec<Value> {
        let response = self
            .client
            .post(format!("{}{path}", self.base))
            .body(body.to_string())
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200);
        assert_eq!(response.headers()["content-type"], "text/event-stream");
        let text = response.text().await.unwrap();
        text.split("\n\n")
            .filter_map(|event| event.strip_prefix("data: "))
            .map(|data| serde_json::from_str(data).unwrap_or(Value::String(data.into())))
            .collect()
    }
}

trait JsonBody {
    async fn json_value(self) -> Value;
}

impl JsonBody for reqwest::Response {
    async fn json_value(self) -> Value {
        serde_json::from_str(&self.text().await.unwrap()).unwrap()
    }
}

fn keys(value: &Value) -> Vec<&str> {
    let mut keys: Vec<&str> = value
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    keys.sort_unstable();
    keys
}

fn chat_body(golden: &Golden, extra: Value) -> Value {
    let mut body = json!({"model": "any-name", "messages": golden.messages});
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

/// The content of a stream's chunks, concatenated.
fn streamed_text(events: &[Value], field: &str) -> String {
    events
        .iter()
        .filter_map(|e| e.get("choices")?.get(0))
        .filter_map(|c| match field {
            "text" => c["text"].as_str(),
            _ => c["delta"]["content"].as_str(),
        })
        .collect()
}

#[tokio::test]
async fn chat_completion_matches_the_golden_greedy_output() {
    let golden = Golden::load("llama-8bit-g32");
    let server = start("llama-8bit-g32", Settings::default()).await;
    let body = chat_body(
        &golden,
        json!({"max_tokens": 32, "logprobs": true, "top_logprobs": 3}),
    );
    let (status, r) = server.post("/v1/chat/completions", &body).await;
    assert_eq!(status, 200, "{r}");
    assert_eq!(
        keys(&r),
        [
            "choices",
            "created",
            "id",
            "model",
            "object",
            "system_fingerprint",
            "usage"
        ]
    );
    assert!(r["id"].as_str().unwrap().starts_with("chatcmpl-"));
    assert_eq!(r["object"], "chat.completion");
    assert!(r["created"].is_u64());
    assert_eq!(r["model"], server.model_id);
    let choice = &r["choices"][0];
    assert_eq!(
        keys(choice),
        ["finish_reason", "index", "logprobs", "message"]
    );
    assert_eq!(choice["index"], 0);
    assert_eq!(choice["finish_reason"], "length");
    assert_eq!(
        choice["message"],
        json!({"role": "assistant", "content": golden.text(32)})
    );
    let entries = choice["logprobs"]["content"].as_array().unwrap();
    let ids: Vec<u32> = entries
        .iter()
        .map(|e| e["id"].as_u64().unwrap() as u32)
        .collect();
    assert_eq!(ids, golden.ids);
    for (entry, &id) in entries.iter().zip(&golden.ids) {
        assert_eq!(
            keys(entry),
            ["bytes", "id", "logprob", "token", "top_logprobs"]
        );
        let token = golden.tokenizer.decode(&[id], false).unwrap();
        assert_eq!(entry["token"], token);
        assert_eq!(entry["bytes"], json!(token.as_bytes()));
        let top = entry["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 3);
        // Greedy: the chosen token is the most likely one.
        assert_eq!(top[0]["id"], id);
        assert_eq!(top[0]["logprob"], entry["logprob"]);
        assert!(entry["logprob"].as_f64().unwrap() <= 0.0);
        assert!(top[1]["logprob"].as_f64() <= top[0]["logprob"].as_f64());
    }
    assert_eq!(
        r["usage"],
        json!({"prompt_tokens": 43, "completion_tokens": 32, "total_tokens": 75,
               "prompt_tokens_details": {"cached_tokens": 0}})
    );
    assert_eq!(golden.n_prompt, 43);
}

#[tokio::test]
async fn chat_stream_chunks_usage_and_done() {
    let golden = Golden::load("llama-8bit-g32");
    let server = start("llama-8bit-g32", Settings::default()).await;
    let body = chat_body(
        &golden,
        json!({"max_completion_tokens": 32, "stream": true, "stream_options": {"include_usage": true}}),
    );
    let events = server.stream("/v1/chat/completions", &body).await;
    assert_eq!(events.last().unwrap(), "[DONE]");
    let chunks = &events[..events.len() - 1];
    let id = chunks[0]["id"].as_str().unwrap();
    for chunk in chunks {
        assert_eq!(
            keys(chunk),
            [
                "choices",
                "created",
                "id",
                "model",
                "object",
                "system_fingerprint"
            ]
            .into_iter()
            .chain(chunk.get("usage").map(|_| "usage"))
            .collect::<Vec<_>>()
        );
        assert_eq!(chunk["id"], id);
        assert_eq!(chunk["object"], "chat.completion.chunk");
        assert_eq!(chunk["model"], server.model_id);
    }
    let (usage, deltas) = chunks.split_last().unwrap();
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(
        usage["usage"],
        json!({"prompt_tokens": 43, "completion_tokens": 32, "total_tokens": 75,
               "prompt_tokens_details": {"cached_tokens": 0}})
    );
    for (i, chunk) in deltas.iter().enumerate() {
        let choice = &chunk["choices"][0];
        assert_eq!(
            keys(choice),
            ["delta", "finish_reason", "index", "logprobs"]
        );
        assert_eq!(choice["delta"]["role"], "assistant");
        let last = i + 1 == deltas.len();
        assert_eq!(
            choice["finish_reason"],
            if last { json!("length") } else { json!(null) }
        );
        if !last {
            assert!(!choice["delta"]["content"].as_str().unwrap().is_empty());
        }
    }
    assert_eq!(streamed_text(deltas, "content"), golden.text(32));
}

#[tokio::test]
async fn text_completions_plain_and_streamed() {
    let golden = Golden::load("llama-8bit-g32");
    let server = start("llama-8bit-g32", Settings::default()).await;
    let body = json!({"prompt": golden.prompt_text, "max_tokens": 32, "logprobs": 2});
    let (status, r) = server.post("/v1/completions", &body).await;
    assert_eq!(status, 200, "{r}");
    assert!(r["id"].as_str().unwrap().starts_with("cmpl-"));
    assert_eq!(r["object"], "text_completion");
    let choice = &r["choices"][0];
    assert_eq!(keys(choice), ["finish_reason", "index", "logprobs", "text"]);
    assert_eq!(choice["text"], golden.text(32));
    assert_eq!(choice["finish_reason"], "length");
    // OpenAI's legacy logprobs, beside mlx_lm.server's `content` list.
    let logprobs = &choice["logprobs"];
    assert_eq!(
        keys(logprobs),
        ["content", "token_logprobs", "tokens", "top_logprobs"]
    );
    assert_eq!(logprobs["tokens"].as_array().unwrap().len(), 32);
    assert_eq!(
        logprobs["token_logprobs"][0],
        logprobs["content"][0]["logprob"]
    );
    assert_eq!(logprobs["top_logprobs"][0].as_object().unwrap().len(), 2);
    assert_eq!(r["usage"]["prompt_tokens"], 43);

    let mut body = json!({"prompt": golden.prompt_text, "max_tokens": 32, "stream": true});
    let events = server.stream("/v1/completions", &body).await;
    assert_eq!(events.last().unwrap(), "[DONE]");
    let chunks = &events[..events.len() - 1];
    assert!(chunks.iter().all(|c| c["object"] == "text_completion"));
    assert_eq!(streamed_text(chunks, "text"), golden.text(32));
    assert_eq!(
        chunks.last().unwrap()["choices"][0]["finish_reason"],
        "length"
    );

    // Token ids are a prompt too.
    let prompt = golden.tokenizer.encode(&golden.prompt_text, false).unwrap();
    body = json!({"prompt": prompt, "max_tokens": 4});
    let (status, r) = server.post("/v1/completions", &body).await;
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["choices"][0]["text"], golden.text(4));
}

#[tokio::test]
async fn stop_strings_end_generation_and_never_leak() {
    let golden = Golden::load("llama-8bit-g32");
    let server = start("llama-8bit-g32", Settings::default()).await;
    let full = golden.text(32);
    // "yve" spans two tokens ("vey" + "vey"), so the stream has to hold back the "y".
    let expected = &full[..full.find("yve").unwrap()];
    let body = chat_body(
        &golden,
        json!({"max_tokens": 32, "stop": ["absent", "yve"]}),
    );
    let (status, r) = server.post("/v1/chat/completions", &body).await;
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["choices"][0]["message"]["content"], expected);
    assert_eq!(r["choices"][0]["finish_reason"], "stop");
    assert_eq!(r["usage"]["completion_tokens"], 7);

    let body = chat_body(
        &golden,
        json!({"max_tokens": 32, "stop": "yve", "stream": true}),
    );
    let events = server.stream("/v1/chat/completions", &body).await;
    let chunks = &events[..events.len() - 1];
    assert_eq!(streamed_text(chunks, "content"), expected);
    assert_eq!(
        chunks.last().unwrap()["choices"][0]["finish_reason"],
        "stop"
    );
}

#[tokio::test]
async fn max_tokens_ends_with_length() {
    let golden = Golden::load("llama-8bit-g32");
    let server = start("llama-8bit-g32", Settings::default()).await;
    let (status, r) = server
        .post(
            "/v1/chat/completions",
            &chat_body(&golden, json!({"max_tokens": 5})),
        )
        .await;
    assert_eq!(status, 200);
    assert_eq!(r["choices"][0]["finish_reason"], "length");
    assert_eq!(r["choices"][0]["message"]["content"], golden.text(5));
    assert_eq!(r["usage"]["completion_tokens"], 5);
    // Without max_tokens, the server's --max-tokens applies.
    let settings = Settings {
        max_tokens: 3,
        ..Settings::default()
    };
    let server = start("llama-8bit-g32", settings).await;
    let (_, r) = server
        .post("/v1/chat/completions", &chat_body(&golden, json!({})))
        .await;
    assert_eq!(r["usage"]["completion_tokens"], 3);
}

fn assert_error(status: StatusCode, body: &Value, want: u16, param: Option<&str>) {
    assert_eq!(status, want, "{body}");
    assert_eq!(keys(body), ["error"]);
    let error = &body["error"];
    assert_eq!(keys(error), ["code", "message", "param", "type"]);
    assert!(!error["message"].as_str().unwrap().is_empty());
    assert!(error["type"].is_string());
    assert_eq!(error["param"], json!(param));
}

#[tokio::test]
async fn bad_requests_get_openai_errors() {
    let golden = Golden::load("llama-8bit-g32");
    let server = start("llama-8bit-g32", Settings::default()).await;
    let chat = "/v1/chat/completions";

    let (status, r) = server.post_raw(chat, "{\"messages\": [".into()).await;
    assert_error(status, &r, 400, None);
    assert_eq!(r["error"]["type"], "invalid_request_error");
    assert!(r["error"]["message"]
        .as_str()
        .unwrap()
        .starts_with("Invalid JSON"));

    for (field, value) in [
        ("n", json!(2)),
        ("temperature", json!(-0.5)),
        ("temperature", json!("hot")),
        ("top_p", json!(2)),
        ("max_tokens", json!(0)),
        ("stop", json!(7)),
        ("logprobs", json!("yes")),
    ] {
        let (status, r) = server
            .post(chat, &chat_body(&golden, json!({field: value})))
            .await;
        assert_error(status, &r, 400, Some(field));
    }
    let (status, r) = server.post(chat, &json!({"model": "x"})).await;
    assert_error(status, &r, 400, Some("messages"));

    // A prompt longer than the model's context (2048 tokens).
    let long = json!([{"role": "user", "content": "sea ".repeat(1500)}]);
    let (status, r) = server.post(chat, &json!({"messages": long})).await;
    assert_error(status, &r, 400, Some("messages"));
    assert_eq!(r["error"]["code"], "context_length_exceeded");
    let (status, r) = server
        .post("/v1/completions", &json!({"prompt": "sea ".repeat(1500)}))
        .await;
    assert_error(status, &r, 400, Some("prompt"));

    let (status, r) = server.post("/v1/nothing", &json!({})).await;
    assert_error(status, &r, 404, None);
    let (status, r) = server.get("/v2/models").await;
    assert_error(status, &r, 404, None);
    let (status, r) = server.get(chat).await;
    assert_error(status, &r, 405, None);

    // The server is still fine.
    let (status, _) = server
        .post(chat, &chat_body(&golden, json!({"max_tokens": 2})))
        .await;
    assert_eq!(status, 200);
}

/// The OpenAI error object of a 400 for `param`.
fn invalid(param: &str, message: &str) -> Value {
    json!({"error": {"message": message, "type": "invalid_request_error", "param": param,
                     "code": null}})
}

/// Sampling values that would turn the weights of a draw infinite or NaN are refused, naming
/// the accepted range; values at the ends of the ranges are served.
#[tokio::test]
async fn sampling_values_that_break_sampling_are_refused() {
    let golden = Golden::load("llama-8bit-g32");
    let server = start("llama-8bit-g32", Settings::default()).await;
    let temperature = "`temperature` must be 0 (greedy) or a number from 0.0001 to 3.4028235e38";
    let presence = "`presence_penalty` must be a number from -2.0 to 2.0";
    let frequency = "`frequency_penalty` must be a number from -2.0 to 2.0";
    let repetition = "`repetition_penalty` must be 0 (off) or a number from 0.01 to 100.0";
    for (field, value, message) in [
        ("temperature", json!(1e-45), temperature),
        ("temperature", json!(1e-5), temperature),
        ("temperature", json!(1e39), temperature),
        ("presence_penalty", json!(1e39), presence),
        ("presence_penalty", json!(-1e39), presence),
        ("presence_penalty", json!(2.5), presence),
        ("frequency_penalty", json!(1e39), frequency),
        ("frequency_penalty", json!(-1e39), frequency),
        ("repetition_penalty", json!(1e39), repetition),
        ("repetition_penalty", json!(1e-45), repetition),
        ("repetition_penalty", json!(-1), repetition),
    ] {
        for (path, body) in [
            (
                "/v1/chat/completions",
                chat_body(&golden, json!({field: value})),
            ),
            ("/v1/completions", json!({"prompt": "sea", field: value})),
        ] {
            let (status, r) = server.post(path, &body).await;
            assert_eq!(status, 400, "{path} {field} {value}: {r}");
            assert_eq!(r, invalid(field, message), "{path} {field} {value}");
        }
    }
    let (status, r) = server
        .post(
            "/v1/chat/completions",
            &chat_body(&golden, json!({"logit_bias": {"12": 1e39}})),
        )
        .await;
    assert_eq!(status, 400);
    let message = "`logit_bias` values must be numbers from -100.0 to 100.0 (token 12 has 1e39)";
    assert_eq!(r, invalid("logit_bias", message));

    // The ends of the ranges are served; sampling that cold is greedy.
    let coldest = chat_body(
        &golden,
        json!({"max_tokens": 8, "temperature": 1e-4, "seed": 0}),
    );
    let (status, r) = server.post("/v1/chat/completions", &coldest).await;
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["choices"][0]["message"]["content"], golden.text(8));
    let extremes = json!({"max_tokens": 4, "temperature": 3.4028235e38, "presence_penalty": -2,
        "frequency_penalty": 2, "repetition_penalty": 100, "logit_bias": {"12": -100, "13": 100}});
    let (status, r) = server
        .post("/v1/chat/completions", &chat_body(&golden, extremes))
        .await;
    assert_eq!(status, 200, "{r}");
    // A draw as hot as that is uniform: it may pick an end-of-sequence token.
    let finish = &r["choices"][0]["finish_reason"];
    assert!(finish == "length" || finish == "stop", "{r}");
}

/// Every way a prompt can pass the model's context (2048 tokens) is refused before it is
/// queued: a chat prompt that only the template's tokens take past it, and a completion's
/// token ids; a prompt that fills the context exactly gets its one token.
#[tokio::test]
async fn prompts_past_the_context_are_refused_before_prefill() {
    let loaded = LoadedModel::load(&fixture("llama-8bit-g32")).unwrap();
    let template = loaded.chat_template.as_ref().unwrap();
    let tokens = |text: &str| loaded.tokenizer.encode(text, false).unwrap().len();
    let messages = |words: usize| json!([{"role": "user", "content": "sea ".repeat(words)}]);
    let templated = |words: usize| {
        let text = template
            .render(&messages(words), None, true, &serde_json::Map::new())
            .unwrap();
        tokens(&text)
    };
    // The fewest words whose templated prompt passes the context.
    let (mut fits, mut passes) = (0, 4096);
    while passes - fits > 1 {
        let middle = (fits + passes) / 2;
        if templated(middle) > 2048 {
            passes = middle;
        } else {
            fits = middle;
        }
    }
    let content = "sea ".repeat(passes);
    assert!(tokens(&content) <= 2048, "the content alone fits");

    let server = start("llama-8bit-g32", Settings::default()).await;
    let context_error = |param: &str, prompt: usize| {
        json!({"error": {
            "message": format!("This model's maximum context length is 2048 tokens. However, \
                                your prompt has {prompt} tokens."),
            "type": "invalid_request_error", "param": param, "code": "context_length_exceeded"}})
    };
    for stream in [false, true] {
        let body = json!({"messages": messages(passes), "stream": stream});
        let (status, r) = server.post("/v1/chat/completions", &body).await;
        assert_eq!(status, 400, "{r}");
        assert_eq!(r, context_error("messages", templated(passes)));
    }
    let (status, r) = server
        .post("/v1/completions", &json!({"prompt": vec![12; 2049]}))
        .await;
    assert_eq!(status, 400, "{r}");
    assert_eq!(r, context_error("prompt", 2049));

    let (status, r) = server
        .post(
            "/v1/completions",
            &json!({"prompt": vec![12; 2048], "max_tokens": 8}),
        )
        .await;
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["choices"][0]["finish_reason"], "length");
    assert_eq!(r["usage"]["prompt_tokens"], 2048);
    assert_eq!(r["usage"]["completion_tokens"], 1);
}

#[tokio::test]
async fn api_key_and_body_limit() {
    let golden = Golden::load("llama-8bit-g32");
    let settings = Settings {
        api_key: Some("sekrit".into()),
        max_request_bytes: 4096,
        ..Settings::default()
    };
    let server = start("llama-8bit-g32", settings).await;
    let url = format!("{}/v1/chat/completions", server.base);
    let body = chat_body(&golden, json!({"max_tokens": 2})).to_string();
    for auth in [
        None,
        Some("Bearer nope"),
        Some("sekrit"),
        Some("Bearer sekrit2"),
    ] {
        let mut request = server.client.post(&url).body(body.clone());
        if let Some(auth) = auth {
            request = request.header("authorization", auth);
        }
        let response = request.send().await.unwrap();
        let status = response.status();
        let r = response.json_value().await;
        assert_error(status, &r, 401, None);
        assert_eq!(r["error"]["code"], "invalid_api_key");
    }
    let ok = |path: &str| {
        server
            .client
            .get(format!("{}{path}", server.base))
            .bearer_auth("sekrit")
            .send()
    };
    assert_eq!(ok("/v1/models").await.unwrap().status(), 200);
    let (status, _) = server.get("/v1/models").await;
    assert_eq!(status, 401);
    // Health checks need no key.
    let (status, _) = server.get("/health").await;
    assert_eq!(status, 200);
    let response = server
        .client
        .post(&url)
        .bearer_auth("sekrit")
        .body(body.clone())
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);

    let big = chat_body(&golden, json!({"padding": "x".repeat(10_000)})).to_string();
    let response = server
        .client
        .post(&url)
        .bearer_auth("sekrit")
        .body(big)
        .send()
        .await
        .unwrap();
    let status = response.status();
    assert_error(status, &response.json_value().await, 413, None);
}

#[tokio::test]
async fn models_and_health() {
    let server = start("llama-8bit-g32", Settings::default()).await;
    let (status, r) = server.get("/v1/models").await;
    assert_eq!(status, 200);
    assert_eq!(keys(&r), ["data", "object"]);
    assert_eq!(r["object"], "list");
    let model = &r["data"][0];
    assert_eq!(keys(model), ["created", "id", "object", "owned_by"]);
    assert_eq!(model["id"], server.model_id);
    assert_eq!(model["object"], "model");
    assert!(server.model_id.ends_with("llama-8bit-g32"));
    let (status, one) = server.get(&format!("/v1/models/{}", server.model_id)).await;
    assert_eq!(status, 200);
    assert_eq!(&one, model);
    let (status, r) = server.get("/v1/models/other").await;
    assert_error(status, &r, 404, None);
    // An id that is not UTF-8 once decoded gets the API's error object too.
    let (status, r) = server.get("/v1/models/%ff%fe").await;
    assert_error(status, &r, 400, None);
    let (status, r) = server.get("/health").await;
    assert_eq!((status, r), (StatusCode::OK, json!({"status": "ok"})));
}

/// A request that would run for minutes on the tiny long-context model: its end-of-sequence
/// tokens are banned and the context is 131072 tokens.
fn endless(stream: bool) -> Value {
    json!({"messages": [{"role": "user", "content": "go"}], "max_tokens": 100_000,
           "logit_bias": {"0": -100, "2": -100}, "stream": stream})
}

/// How long a short request takes to be answered: long when the worker is still busy.
async fn short_request_time(server: &TestServer) -> Duration {
    let start = Instant::now();
    let body = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2});
    let (status, _) = server.post("/v1/chat/completions", &body).await;
    assert_eq!(status, 200);
    start.elapsed()
}

#[tokio::test]
async fn serving_continues_during_generation_and_disconnects_cancel_it() {
    let server = start("llama-4bit-g64", Settings::default()).await;
    let mut response = server
        .client
        .post(format!("{}/v1/chat/completions", server.base))
        .body(endless(true).to_string())
        .send()
        .await
        .unwrap();
    let mut received = 0;
    while received < 3 {
        let chunk = response.chunk().await.unwrap().unwrap();
        received += String::from_utf8_lossy(&chunk).matches("data: ").count();
    }
    // The generation thread is busy; the HTTP side still answers at once.
    for path in ["/health", "/v1/models"] {
        let answer = tokio::time::timeout(Duration::from_secs(2), server.get(path)).await;
        assert_eq!(answer.expect(path).0, 200);
    }
    // Going away cancels the generation: the next request is not stuck behind it.
    drop(response);
    let waited = short_request_time(&server).await;
    assert!(waited < Duration::from_secs(10), "{waited:?}");

    // The same for a plain (non-streamed) request whose client gives up.
    let quick = reqwest::Client::builder()
        .timeout(Duration::from_millis(500))
        .build()
        .unwrap();
    let gave_up = quick
        .post(format!("{}/v1/chat/completions", server.base))
        .body(endless(false).to_string())
        .send()
        .await;
    assert!(gave_up.unwrap_err().is_timeout());
    let waited = short_request_time(&server).await;
    assert!(waited < Duration::from_secs(10), "{waited:?}");
}

/// A second turn reuses the first turn's state; outputs are the same as without a cache.
async fn check_prompt_cache(model: &str) {
    let golden = Golden::load(model);
    let server = start(model, Settings::default()).await;
    let chat = "/v1/chat/completions";
    let first = chat_body(&golden, json!({"max_tokens": 8}));
    let (_, r1) = server.post(chat, &first).await;
    assert_eq!(r1["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let reply = r1["choices"][0]["message"]["content"].clone();
    let mut messages = golden.messages.as_array().unwrap().clone();
    messages.push(json!({"role": "assistant", "content": reply}));
    messages.push(json!({"role": "user", "content": "And one about the sky?"}));
    let second = json!({"messages": messages, "max_tokens": 8});
    let (_, r2) = server.post(chat, &second).await;
    let cached = r2["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    let prompt = r2["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(
        cached >= golden.n_prompt as u64 - 2 && cached < prompt,
        "{model}: {r2}"
    );
    // The same request again: all but the last prompt token come from the cache.
    let (_, r3) = server.post(chat, &second).await;
    assert_eq!(
        r3["usage"]["prompt_tokens_details"]["cached_tokens"],
        prompt - 1
    );
    assert_eq!(r3["choices"], r2["choices"]);

    let uncached = Settings {
        prompt_cache_size: 0,
        ..Settings::default()
    };
    let fresh = start(model, uncached).await;
    let (_, r4) = fresh.post(chat, &second).await;
    assert_eq!(r4["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    assert_eq!(r4["choices"], r2["choices"], "{model}");
}

#[tokio::test]
async fn prompt_cache_reuses_the_previous_turn() {
    check_prompt_cache("llama-8bit-g32").await;
}

#[tokio::test]
async fn prompt_cache_snapshots_recurrent_state() {
    check_prompt_cache("qwen3_5-8bit-g32").await;
}

#[tokio::test]
async fn tools_and_tool_results_are_accepted() {
    let server = start("llama-8bit-g32", Settings::default()).await;
    let body = json!({
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "18C"}],
        "tools": [{"type": "function", "function": {"name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}],
        "max_tokens": 4});
    let (status, r) = server.post("/v1/chat/completions", &body).await;
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["choices"][0]["finish_reason"], "length");
}

/// An adapter directory for the tiny llama-4bit-g64: `sea` and `trained/final` (adapters made for
/// it by mlx-lm), `qwen` (made for another model), `empty` (no adapter_config.json), and
/// `escape`, a link to an adapter outside the directory.
struct AdapterRoot {
    root: tempfile::TempDir,
    _outside: tempfile::TempDir,
}

fn copy_adapter(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for file in ["adapter_config.json", "adapters.safetensors"] {
        std::fs::copy(from.join(file), to.join(file)).unwrap();
    }
}

fn adapter_root() -> AdapterRoot {
    let lora = fixtures().join("lora");
    let root = tempfile::tempdir().unwrap();
    copy_adapter(&lora.join("llama-4bit-g64-r4"), &root.path().join("sea"));
    copy_adapter(
        &lora.join("train-llama-4bit-g64/final"),
        &root.path().join("trained/final"),
    );
    copy_adapter(&lora.join("qwen2-4bit-g64-keys"), &root.path().join("qwen"));
    std::fs::create_dir(root.path().join("empty")).unwrap();
    let outside = tempfile::tempdir().unwrap();
    copy_adapter(&lora.join("llama-4bit-g64-r4"), outside.path());
    std::os::unix::fs::symlink(outside.path(), root.path().join("escape")).unwrap();
    AdapterRoot {
        root,
        _outside: outside,
    }
}

fn with_adapters(root: &AdapterRoot) -> Settings {
    Settings {
        adapters_dir: Some(root.root.path().to_path_buf()),
        ..Settings::default()
    }
}

/// The tiny llama served with [`adapter_root`], and its golden.
async fn adapter_server() -> (Golden, AdapterRoot, TestServer) {
    let root = adapter_root();
    let server = start("llama-4bit-g64", with_adapters(&root)).await;
    (Golden::load("llama-4bit-g64"), root, server)
}

/// Greedy output of the runtime itself for `golden`'s prompt through the adapter in `dir`.
fn adapted_reference(golden: &Golden, dir: &Path, max_tokens: usize) -> String {
    stacked_reference(golden, &[dir], max_tokens)
}

/// Greedy output of the runtime itself for `golden`'s prompt through the adapters in `dirs`,
/// stacked in that order.
fn stacked_reference(golden: &Golden, dirs: &[&Path], max_tokens: usize) -> String {
    let loaded = LoadedModel::load(&fixture("llama-4bit-g64")).unwrap();
    let sets: Vec<Adapters> = (dirs.iter())
        .map(|dir| Adapters::load(dir, loaded.model.as_ref()).unwrap())
        .collect();
    let stack: Vec<&Adapters> = sets.iter().collect();
    let model = AdaptedModel::by_rows(loaded.model.as_ref(), RowAdapters::stack(&stack)).unwrap();
    let prompt = golden.tokenizer.encode(&golden.prompt_text, false).unwrap();
    let options = GenerateOptions {
        max_tokens,
        sampler: SamplerConfig::default(),
        prefill_step: 2048,
        kv_cache: None,
        kv_quantization: None,
        max_kv_size: None,
    };
    let generation = generate(
        &model,
        &loaded.tokenizer,
        &prompt,
        &loaded.eos_ids,
        &options,
        &mut |_| {},
    )
    .unwrap();
    generation.text
}

fn content(r: &Value) -> &str {
    r["choices"][0]["message"]["content"].as_str().unwrap()
}

#[tokio::test]
async fn adapters_are_chosen_per_request() {
    let (golden, _root, server) = adapter_server().await;
    let chat = "/v1/chat/completions";
    let (status, base) = server
        .post(chat, &chat_body(&golden, json!({"max_tokens": 16})))
        .await;
    assert_eq!(status, 200, "{base}");
    assert_eq!(content(&base), golden.text(16));
    for (name, dir) in [
        ("sea", fixtures().join("lora/llama-4bit-g64-r4")),
        (
            "trained/final",
            fixtures().join("lora/train-llama-4bit-g64/final"),
        ),
    ] {
        let body = chat_body(&golden, json!({"max_tokens": 16, "adapters": name}));
        let (status, r) = server.post(chat, &body).await;
        assert_eq!(status, 200, "{r}");
        let expected = adapted_reference(&golden, &dir, 16);
        assert_eq!(content(&r), expected, "{name}");
        assert_ne!(content(&r), content(&base), "{name}");
        assert_eq!(r["model"], server.model_id);
    }
    // Streamed and text completions take the field too.
    let body = chat_body(
        &golden,
        json!({"max_tokens": 16, "adapters": "sea", "stream": true}),
    );
    let events = server.stream(chat, &body).await;
    let expected = adapted_reference(&golden, &fixtures().join("lora/llama-4bit-g64-r4"), 16);
    assert_eq!(
        streamed_text(&events[..events.len() - 1], "content"),
        expected
    );
    let body = json!({"prompt": golden.prompt_text, "max_tokens": 16, "adapters": "sea"});
    let (_, r) = server.post("/v1/completions", &body).await;
    assert_eq!(r["choices"][0]["text"], expected);
    // `null` is no adapter.
    let body = chat_body(&golden, json!({"max_tokens": 16, "adapters": null}));
    let (_, r) = server.post(chat, &body).await;
    assert_eq!(r["choices"], base["choices"]);
}

#[tokio::test]
async fn the_default_adapter_applies_to_requests_that_name_none() {
    let golden = Golden::load("llama-4bit-g64");
    let root = adapter_root();
    let settings = Settings {
        adapter_path: Some(fixtures().join("lora/llama-4bit-g64-r4")),
        ..with_adapters(&root)
    };
    let server = start("llama-4bit-g64", settings).await;
    let chat = "/v1/chat/completions";
    let (_, r) = server
        .post(chat, &chat_body(&golden, json!({"max_tokens": 16})))
        .await;
    let sea = adapted_reference(&golden, &fixtures().join("lora/llama-4bit-g64-r4"), 16);
    assert_eq!(content(&r), sea);
    // A request's own adapter wins.
    let body = chat_body(
        &golden,
        json!({"max_tokens": 16, "adapters": "trained/final"}),
    );
    let (_, r) = server.post(chat, &body).await;
    let trained = adapted_reference(
        &golden,
        &fixtures().join("lora/train-llama-4bit-g64/final"),
        16,
    );
    assert_eq!(content(&r), trained);
    // `none` is the base model.
    let body = chat_body(&golden, json!({"max_tokens": 16, "adapters": "none"}));
    let (status, r) = server.post(chat, &body).await;
    assert_eq!(status, 200, "{r}");
    assert_eq!(content(&r), golden.text(16));
}

/// Requests through different adapters, none, and a stack (`a+b`, the updates added in that
/// order) sent together are each answered as the runtime answers them alone.
#[tokio::test]
async fn requests_through_different_adapters_are_served_together() {
    let (golden, _root, server) = adapter_server().await;
    let sea = fixtures().join("lora/llama-4bit-g64-r4");
    let trained = fixtures().join("lora/train-llama-4bit-g64/final");
    let asks = [
        ("none", golden.text(24)),
        ("sea", stacked_reference(&golden, &[&sea], 24)),
        ("trained/final", stacked_reference(&golden, &[&trained], 24)),
        (
            "sea+trained/final",
            stacked_reference(&golden, &[&sea, &trained], 24),
        ),
        (
            "trained/final+sea",
            stacked_reference(&golden, &[&trained, &sea], 24),
        ),
    ];
    let replies = futures_util::future::join_all(asks.iter().map(|(name, _)| {
        let body = chat_body(&golden, json!({"max_tokens": 24, "adapters": name}));
        let server = &server;
        async move { server.post("/v1/chat/completions", &body).await }
    }))
    .await;
    for ((name, expected), (status, r)) in asks.iter().zip(&replies) {
        assert_eq!(*status, 200, "{name}: {r}");
        assert_eq!(content(r), expected, "{name}");
    }
    // The trained adapter outweighs the fixture's, whose share shows beside the fixture alone.
    assert_ne!(content(&replies[3].1), content(&replies[1].1));
    // `none` stands alone.
    let body = chat_body(&golden, json!({"max_tokens": 4, "adapters": "sea+none"}));
    let (status, r) = server.post("/v1/chat/completions", &body).await;
    assert_eq!(status, 400, "{r}");
    assert_eq!(r["error"]["param"], "adapters");
    assert_eq!(
        r["error"]["message"],
        "`none` stands alone: it cannot be stacked with other adapters"
    );
}

#[tokio::test]
async fn adapter_errors_are_openai_objects() {
    let (golden, root, server) = adapter_server().await;
    let chat = "/v1/chat/completions";
    let ask = |name: &str, stream: bool| {
        chat_body(
            &golden,
            json!({"max_tokens": 4, "adapters": name, "stream": stream}),
        )
    };
    for (name, stream) in [("nope", false), ("empty", false), ("nope", true)] {
        let (status, r) = server.post(chat, &ask(name, stream)).await;
        assert_eq!(status, 404);
        assert_eq!(
            r,
            json!({"error": {
                "message": format!("The adapter `{name}` does not exist: there is no \
                    adapter_config.json at `{name}` in the adapter directory"),
                "type": "invalid_request_error", "param": "adapters", "code": "adapter_not_found"}})
        );
    }
    let outside = root.root.path().join("sea").display().to_string();
    for name in ["../sea", "sea/../../etc", outside.as_str(), "escape", ""] {
        let (status, r) = server.post(chat, &ask(name, false)).await;
        assert_eq!(status, 400, "{name}");
        assert_eq!(
            r,
            json!({"error": {
                "message": format!("The adapter `{name}` is outside the adapter directory: \
                    name a directory inside it (no `..`, absolute paths or links that lead out of it)"),
                "type": "invalid_request_error", "param": "adapters", "code": null}}),
            "{name}"
        );
    }
    let (status, r) = server.post(chat, &ask("qwen", false)).await;
    assert_error(status, &r, 400, Some("adapters"));
    let message = r["error"]["message"].as_str().unwrap();
    assert!(
        message.starts_with("The adapter `qwen` cannot be used with this model: adapter at "),
        "{message}"
    );
    let (status, r) = server
        .post(chat, &chat_body(&golden, json!({"adapters": 3})))
        .await;
    assert_error(status, &r, 400, Some("adapters"));

    // A server without an adapter directory takes no adapter names.
    let plain = start("llama-4bit-g64", Settings::default()).await;
    let (status, r) = plain.post(chat, &ask("sea", false)).await;
    assert_eq!(status, 400);
    assert_eq!(
        r,
        json!({"error": {
            "message": "This server takes no per-request adapters (start it with --adapters-dir)",
            "type": "invalid_request_error", "param": "adapters", "code": null}})
    );
}

/// An adapter that cannot be loaded is reported by the name the client gave and the files
/// within it, never by where the server keeps them.
#[tokio::test]
async fn adapter_errors_name_no_server_paths() {
    let (golden, root, server) = adapter_server().await;
    let broken = root.root.path().join("broken");
    std::fs::create_dir(&broken).unwrap();
    std::fs::write(broken.join("adapter_config.json"), "{").unwrap();
    let unweighted = root.root.path().join("nested/unweighted");
    std::fs::create_dir_all(&unweighted).unwrap();
    std::fs::copy(
        fixtures().join("lora/llama-4bit-g64-r4/adapter_config.json"),
        unweighted.join("adapter_config.json"),
    )
    .unwrap();
    for (name, problem) in [
        (
            "broken",
            "broken/adapter_config.json: malformed JSON: EOF while parsing an object at line 1 \
             column 1",
        ),
        (
            "nested/unweighted",
            "nested/unweighted/adapters.safetensors: no such file (is this an MLX model \
             directory?)",
        ),
    ] {
        let body = chat_body(&golden, json!({"max_tokens": 4, "adapters": name}));
        let (status, r) = server.post("/v1/chat/completions", &body).await;
        assert_eq!(status, 400, "{r}");
        let message = format!("The adapter `{name}` cannot be used with this model: {problem}");
        assert_eq!(r, invalid("adapters", &message));
    }
    let body = chat_body(&golden, json!({"max_tokens": 4, "adapters": "qwen"}));
    let (status, r) = server.post("/v1/chat/completions", &body).await;
    assert_eq!(status, 400, "{r}");
    let message = r["error"]["message"].as_str().unwrap();
    let mismatch = "The adapter `qwen` cannot be used with this model: adapter at \
                    qwen/adapters.safetensors does not fit the model:\n  ";
    assert!(message.starts_with(mismatch), "{message}");
    for dir in [
        root.root.path().to_path_buf(),
        root.root.path().canonicalize().unwrap(),
    ] {
        assert!(!message.contains(dir.to_str().unwrap()), "{message}");
    }
}

#[tokio::test]
async fn models_list_the_adapters() {
    let (_, _root, server) = adapter_server().await;
    let (status, r) = server.get("/v1/models").await;
    assert_eq!(status, 200);
    let model = &r["data"][0];
    assert_eq!(model["id"], server.model_id);
    // Every directory with an adapter_config.json, whatever model it was made for; links are
    // not followed.
    assert_eq!(model["adapters"], json!(["qwen", "sea", "trained/final"]));
}

/// State computed through one adapter is never reused for another, nor for the base model.
#[tokio::test]
async fn the_prompt_cache_keeps_adapters_apart() {
    let (golden, _root, server) = adapter_server().await;
    let chat = "/v1/chat/completions";
    let ask = |adapter: Option<&str>| {
        let mut body = chat_body(&golden, json!({"max_tokens": 8}));
        if let Some(name) = adapter {
            body["adapters"] = name.into();
        }
        body
    };
    let cached = |r: &Value| r["usage"]["prompt_tokens_details"]["cached_tokens"].clone();
    let all_but_last = json!(golden.n_prompt - 1);
    let (_, base) = server.post(chat, &ask(None)).await;
    assert_eq!(cached(&base), 0);
    let (_, sea) = server.post(chat, &ask(Some("sea"))).await;
    assert_eq!(cached(&sea), 0, "the base model's state was reused");
    let sea_text = adapted_reference(&golden, &fixtures().join("lora/llama-4bit-g64-r4"), 8);
    assert_eq!(content(&sea), sea_text);
    let (_, trained) = server.post(chat, &ask(Some("trained/final"))).await;
    assert_eq!(cached(&trained), 0, "another adapter's state was reused");
    for (adapter, first) in [
        (None, &base),
        (Some("sea"), &sea),
        (Some("trained/final"), &trained),
    ] {
        let (_, again) = server.post(chat, &ask(adapter)).await;
        assert_eq!(cached(&again), all_but_last, "{adapter:?}");
        assert_eq!(again["choices"], first["choices"], "{adapter:?}");
    }
}

/// A cache precision the model's heads cannot take is refused when the server starts, not
/// with a 500 to every request.
#[test]
fn a_kv_cache_the_heads_cannot_take_is_refused_at_start() {
    let settings = Settings {
        kv_cache: Some(oxlm_engine::KvPrecision::Q8),
        ..Settings::default()
    };
    // The tiny llama's heads are 16 wide; 8-bit caches need multiples of 64.
    let err = Server::load(&fixture("llama-4bit-g64"), settings)
        .err()
        .unwrap();
    assert!(err.to_string().starts_with("--kv-cache: "), "{err}");
}
