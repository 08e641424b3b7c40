//! `POST /v1/embeddings` over real HTTP on the tiny Qwen3-Embedding fixture: OpenAI's response
//! shape, vectors against the oracle's (scripts/oracle/make_embedding_fixture.py), `float` and
//! `base64` alike, token-id inputs, `dimensions`, the `query` prompt, and the exact error bodies
//! of what is refused, a model that cannot embed included.

mod common;
#[path = "../../../tests/fixtures/tiny/embedding/golden.rs"]
mod golden;

use std::path::Path;

use base64::Engine;
use golden::{assert_close, assert_within, fixture, GoldenInput, FAST_GPU_TOLERANCE, TOLERANCE};
use oxlm_engine::{cuda, Device};
use oxlm_server::{LogLevel, Server, Settings};
use reqwest::StatusCode;
use serde_json::{json, Value};

struct TestServer {
    base: String,
    model_id: String,
    client: reqwest::Client,
}

impl TestServer {
    async fn start(dir: &Path) -> Self {
        Self::start_on(dir, Device::Cpu).await
    }

    async fn start_on(dir: &Path, device: Device) -> Self {
        let settings = Settings {
            log_level: LogLevel::Warning,
            device,
            ..Settings::default()
        };
        let server = Server::load(dir, settings).unwrap();
        let model_id = server.model_id().to_owned();
        TestServer {
            base: common::listen(server).await,
            model_id,
            client: reqwest::Client::new(),
        }
    }

    async fn embed(&self, body: Value) -> (StatusCode, Value) {
        self.post("/v1/embeddings", body).await
    }

    async fn post(&self, path: &str, body: Value) -> (StatusCode, Value) {
        let response = self
            .client
            .post(format!("{}{path}", self.base))
            .header("content-type", "application/json")
            .body(body.to_string())
            .send()
            .await
            .unwrap();
        let status = response.status();
        (
            status,
            serde_json::from_str(&response.text().await.unwrap()).unwrap(),
        )
    }

    /// The vectors of a request that must succeed.
    async fn vectors(&self, body: Value) -> Vec<Vec<f32>> {
        let (status, response) = self.embed(body).await;
        assert_eq!(status, StatusCode::OK, "{response}");
        let data = response["data"].as_array().unwrap();
        data.iter()
            .map(|item| serde_json::from_value(item["embedding"].clone()).unwrap())
            .collect()
    }
}

/// The golden's inputs without the `query` prompt (the `document` prompt is empty), and the one
/// with it.
fn plain_and_query() -> (Vec<GoldenInput>, GoldenInput) {
    let (query, plain): (Vec<_>, Vec<_>) = golden::inputs()
        .into_iter()
        .partition(|input| input.prompt_name.as_deref() == Some("query"));
    (plain, query.into_iter().next().unwrap())
}

#[tokio::test]
async fn embeddings_match_the_oracle_in_openais_shape() {
    let server = TestServer::start(&fixture()).await;
    let (plain, query) = plain_and_query();
    let texts: Vec<&str> = plain.iter().map(|input| input.text.as_str()).collect();
    let (status, response) = server.embed(json!({"model": "any", "input": texts})).await;
    assert_eq!(status, StatusCode::OK, "{response}");
    assert_eq!(response["object"], "list");
    assert_eq!(response["model"], server.model_id.as_str());
    let tokens: usize = plain.iter().map(|input| input.ids.len()).sum();
    assert_eq!(
        response["usage"],
        json!({"prompt_tokens": tokens, "total_tokens": tokens})
    );
    let data = response["data"].as_array().unwrap();
    assert_eq!(data.len(), plain.len());
    for (index, (item, input)) in data.iter().zip(&plain).enumerate() {
        assert_eq!(item["object"], "embedding");
        assert_eq!(item["index"], index);
        let vector: Vec<f32> = serde_json::from_value(item["embedding"].clone()).unwrap();
        assert_close(&vector, &input.vector("last_token"), &input.text);
    }

    // base64: the same f32s, little-endian.
    let body = json!({"input": texts, "encoding_format": "base64"});
    let (status, encoded) = server.embed(body).await;
    assert_eq!(status, StatusCode::OK, "{encoded}");
    for (item, float) in encoded["data"].as_array().unwrap().iter().zip(data) {
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(item["embedding"].as_str().unwrap())
            .unwrap();
        let decoded: Vec<f32> = bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect();
        let float: Vec<f32> = serde_json::from_value(float["embedding"].clone()).unwrap();
        assert_eq!(decoded, float);
    }

    // Qwen3-Embedding's instruction, by the prompt's name.
    let body = json!({"input": query.text, "prompt_name": "query"});
    let vectors = server.vectors(body).await;
    assert_close(&vectors[0], &query.vector("last_token"), &query.text);

    // Matryoshka dimensions: the first 32 values, normalized again.
    let vectors = server
        .vectors(json!({"input": texts, "dimensions": 32}))
        .await;
    for (vector, input) in vectors.iter().zip(&plain) {
        assert_close(
            vector,
            &input.vector("last_token_dimensions_32"),
            &input.text,
        );
    }
}

#[tokio::test]
async fn token_ids_embed_as_their_text_does() {
    let server = TestServer::start(&fixture()).await;
    let (plain, _) = plain_and_query();
    let texts: Vec<&str> = plain.iter().map(|input| input.text.as_str()).collect();
    let from_texts = server.vectors(json!({"input": texts})).await;
    let ids: Vec<&[u32]> = plain.iter().map(|input| input.ids.as_slice()).collect();
    assert_eq!(server.vectors(json!({"input": ids})).await, from_texts);
    // Alone, an input's vector is the one it got in a pass with the others, but for the
    // products' rounding over more rows.
    let one = server.vectors(json!({"input": plain[1].ids})).await;
    assert_within(&one[0], &from_texts[1], 1e-6, &plain[1].text);
}

/// Embeddings asked for while a generation decodes run between its steps, on the generation
/// thread: on a GPU (where there is one) those steps replay graphs recorded on the device's one
/// stream, which launches from another thread would land in. Both come out whole.
#[tokio::test]
async fn embeddings_run_between_the_steps_of_a_generation() {
    let (device, tolerance) = if cuda::libraries_present() {
        (Device::open("cuda").unwrap(), FAST_GPU_TOLERANCE)
    } else {
        (Device::Cpu, TOLERANCE)
    };
    let server = std::sync::Arc::new(TestServer::start_on(&fixture(), device).await);
    let (plain, _) = plain_and_query();
    let texts: Vec<&str> = plain.iter().map(|input| input.text.as_str()).collect();
    let generating = server.clone();
    let generation = tokio::spawn(async move {
        let body = json!({"prompt": "Once upon a time", "max_tokens": 300, "temperature": 0});
        generating.post("/v1/completions", body).await
    });
    let mut rounds = 0;
    while !generation.is_finished() {
        let vectors = server.vectors(json!({"input": texts})).await;
        for (vector, input) in vectors.iter().zip(&plain) {
            assert_within(vector, &input.vector("last_token"), tolerance, &input.text);
        }
        rounds += 1;
    }
    let (status, completion) = generation.await.unwrap();
    assert_eq!(status, StatusCode::OK, "{completion}");
    assert!(completion["usage"]["completion_tokens"].as_u64().unwrap() > 0);
    assert!(rounds > 0);
}

fn error(message: &str, param: &str, code: Option<&str>) -> Value {
    json!({"error": {"message": message, "type": "invalid_request_error", "param": param,
                     "code": code}})
}

#[tokio::test]
async fn refused_requests_get_openais_errors() {
    let server = TestServer::start(&fixture()).await;
    let shape = "`input` must be a string, a list of strings, a list of token ids or a list of \
                 lists of token ids";
    let cases = [
        (
            json!({}),
            error("Request did not contain an input", "input", None),
        ),
        (json!({"input": 7}), error(shape, "input", None)),
        (json!({"input": [1, "a"]}), error(shape, "input", None)),
        (json!({"input": [[1, -2]]}), error(shape, "input", None)),
        (
            json!({"input": []}),
            error(
                "no input: at least one text or list of token ids is needed",
                "input",
                None,
            ),
        ),
        (
            json!({"input": ""}),
            error("input 0 is empty", "input", None),
        ),
        (
            json!({"input": ["a", ""]}),
            error("input 1 is empty", "input", None),
        ),
        (
            json!({"input": [[1], []]}),
            error("input 1 is empty", "input", None),
        ),
        (
            json!({"input": [[1, 512]]}),
            error(
                "input 0: token id 512 is outside the vocabulary of 512 tokens",
                "input",
                None,
            ),
        ),
        (
            json!({"input": ["a", vec![1; 40961]]}),
            error(
                "input 1 has 40961 tokens, more than the model's context of 40960",
                "input",
                Some("context_length_exceeded"),
            ),
        ),
        (
            json!({"input": "a", "dimensions": 0}),
            error(
                "dimensions must be from 1 to 128 (the model's embedding size), not 0",
                "dimensions",
                None,
            ),
        ),
        (
            json!({"input": "a", "dimensions": 129}),
            error(
                "dimensions must be from 1 to 128 (the model's embedding size), not 129",
                "dimensions",
                None,
            ),
        ),
        (
            json!({"input": "a", "dimensions": -1}),
            error(
                "`dimensions` must be a positive integer",
                "dimensions",
                None,
            ),
        ),
        (
            json!({"input": "a", "encoding_format": "int8"}),
            error(
                "`encoding_format` must be `float` or `base64`, not `int8`",
                "encoding_format",
                None,
            ),
        ),
        (
            json!({"input": "a", "prompt_name": "passage"}),
            error(
                "the model has no prompt named `passage` (it has: document, query)",
                "prompt_name",
                None,
            ),
        ),
    ];
    for (body, expected) in cases {
        let (status, response) = server.embed(body.clone()).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
        assert_eq!(response, expected, "{body}");
    }
}

#[tokio::test]
async fn a_model_that_cannot_embed_says_so() {
    let server = TestServer::start(&common::fixtures().join("tiny/qwen3-8bit-g128")).await;
    let (status, response) = server.embed(json!({"input": "Hello"})).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    let message = "This model cannot embed: it has no sentence-transformers modules.json, and \
                   config.json's `architectures` names no bare `*Model` (a model without a \
                   language-model head)";
    assert_eq!(response, error(message, "model", None));
}

/// Embeddings count against `--max-queued-requests` and have `--request-timeout`, as
/// generations do: past the queue a request is answered 429 at once, and one whose forward pass
/// outlasts the timeout is answered 504 when it passes.
#[tokio::test]
async fn embeddings_keep_to_the_queue_and_the_timeout() {
    let serve = |settings: Settings| async move {
        let mut loaded = oxlm_runtime::LoadedModel::load(&fixture()).unwrap();
        loaded.model = Box::new(common::SlowPrompts {
            inner: loaded.model,
            prompt_time: std::time::Duration::from_millis(1500),
        });
        common::listen(Server::new(loaded, settings).unwrap()).await
    };
    let client = reqwest::Client::new();
    let embed = |base: String| {
        let body = json!({"input": "A city by the sea", "model": "m"});
        client
            .post(format!("{base}/v1/embeddings"))
            .body(body.to_string())
            .send()
    };
    let queued = Settings {
        decode_concurrency: 1,
        max_queued_requests: Some(0),
        log_level: LogLevel::Warning,
        ..Settings::default()
    };
    let base = serve(queued).await;
    let running = tokio::spawn(embed(base.clone()));
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    let refused = embed(base.clone()).await.unwrap();
    assert_eq!(refused.status(), 429);
    let body: Value = serde_json::from_str(&refused.text().await.unwrap()).unwrap();
    assert_eq!(body["error"]["code"], "too_many_requests", "{body}");
    assert_eq!(running.await.unwrap().unwrap().status(), 200);
    assert_eq!(embed(base).await.unwrap().status(), 200);

    let timed = Settings {
        request_timeout: Some(std::time::Duration::from_millis(400)),
        log_level: LogLevel::Warning,
        ..Settings::default()
    };
    let base = serve(timed).await;
    let start = std::time::Instant::now();
    let late = embed(base).await.unwrap();
    assert!(start.elapsed() < std::time::Duration::from_millis(1400));
    assert_eq!(late.status(), 504);
    let body: Value = serde_json::from_str(&late.text().await.unwrap()).unwrap();
    assert_eq!(body["error"]["code"], "timeout", "{body}");
}
