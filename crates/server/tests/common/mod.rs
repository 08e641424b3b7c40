//! What the server's test files share: the repository's fixtures, a server on a free port,
//! requests to it, and ([`scripted`]) one over a model that answers a script.

#![allow(dead_code)] // each test binary uses its own part

pub mod scripted;

use std::path::PathBuf;
use std::time::Duration;

use oxlm_engine::{KvPrecision, Tensor};
use oxlm_models::{Cache, ForwardError, LanguageModel, Logits, ModelInfo};
use oxlm_server::Server;
use serde_json::Value;

/// `tests/fixtures` of the repository.
pub fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

/// Serves `server` on a free port of 127.0.0.1 in the background; its base URL.
pub async fn listen(server: Server) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(server.serve(listener));
    base
}

/// POSTs `body` as JSON to `base` + `path`: the response's status and text.
pub async fn post(base: &str, path: &str, body: &Value) -> (u16, String) {
    let response = reqwest::Client::new()
        .post(format!("{base}{path}"))
        .header("content-type", "application/json")
        .body(body.to_string())
        .send()
        .await
        .unwrap();
    let status = response.status().as_u16();
    (status, response.text().await.unwrap())
}

/// The text of `base`'s answer to the chat completion request `body`: a JSON object, or the
/// SSE stream of a streamed request.
pub async fn chat(base: &str, body: &Value) -> String {
    post(base, "/v1/chat/completions", body).await.1
}

/// The JSON chunks of a streamed reply's text, `[DONE]` left out.
pub fn chunks(stream: &str) -> Vec<Value> {
    stream
        .split("\n\n")
        .filter_map(|event| event.strip_prefix("data: "))
        .filter(|data| *data != "[DONE]")
        .map(|data| serde_json::from_str(data).unwrap())
        .collect()
}

/// A model slow over prompts (`prompt_time` a forward pass of more than one token), as a large
/// model is over a long one.
pub struct SlowPrompts {
    pub inner: Box<dyn LanguageModel>,
    pub prompt_time: Duration,
}

impl LanguageModel for SlowPrompts {
    fn info(&self) -> &ModelInfo {
        self.inner.info()
    }

    fn new_cache(&self) -> Result<Cache, ForwardError> {
        self.inner.new_cache()
    }

    fn new_cache_in(&self, precision: KvPrecision) -> Result<Cache, ForwardError> {
        self.inner.new_cache_in(precision)
    }

    fn forward(
        &self,
        tokens: &[u32],
        cache: &mut Cache,
        logits: Logits,
    ) -> Result<Tensor, ForwardError> {
        if tokens.len() > 1 {
            std::thread::sleep(self.prompt_time);
        }
        self.inner.forward(tokens, cache, logits)
    }
}
