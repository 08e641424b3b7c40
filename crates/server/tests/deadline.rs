//! `--request-timeout`: a request that runs past it ends with a 504 error object (a stream with
//! its error event and `[DONE]`) when the deadline passes, even in the middle of a prompt's
//! forward pass, and its generation stops.

mod common;

use std::time::{Duration, Instant};

use common::SlowPrompts;
use oxlm_runtime::LoadedModel;
use oxlm_server::{LogLevel, Server, Settings};
use serde_json::{json, Value};

const TIMEOUT: Duration = Duration::from_millis(400);
const PROMPT_TIME: Duration = Duration::from_millis(2000);

#[tokio::test]
async fn a_request_past_its_deadline_ends_with_a_timeout() {
    let dir = common::fixtures().join("tiny/llama-4bit-g64");
    let mut loaded = LoadedModel::load(&dir).unwrap();
    loaded.model = Box::new(SlowPrompts {
        inner: loaded.model,
        prompt_time: PROMPT_TIME,
    });
    let settings = Settings {
        request_timeout: Some(TIMEOUT),
        log_level: LogLevel::Warning,
        ..Settings::default()
    };
    let base = common::listen(Server::new(loaded, settings).unwrap()).await;
    let client = reqwest::Client::new();
    let error = json!({"error": {
        "message": "The request did not finish within the server's time limit",
        "type": "server_error", "param": null, "code": "timeout"}});
    for stream in [false, true] {
        let body = json!({"prompt": "Once upon a time", "max_tokens": 4, "stream": stream});
        let start = Instant::now();
        let response = client
            .post(format!("{base}/v1/completions"))
            .body(body.to_string())
            .send()
            .await
            .unwrap();
        let status = response.status();
        let text = response.text().await.unwrap();
        // Answered when the deadline passed, not when the prompt's forward pass ended.
        let waited = start.elapsed();
        assert!(waited >= TIMEOUT && waited < PROMPT_TIME, "{waited:?}");
        if stream {
            assert_eq!(status, 200);
            assert!(
                text.ends_with(&format!("data: {error}\n\ndata: [DONE]\n\n")),
                "{text}"
            );
        } else {
            assert_eq!(status, 504);
            assert_eq!(serde_json::from_str::<Value>(&text).unwrap(), error);
        }
    }
}
