//! A bounded queue: past `--max-queued-requests` waiting beyond those decoding, a request is
//! answered 429 with `Retry-After` at once, and the queue takes requests again as it drains.

mod common;

use std::time::Duration;

use common::SlowPrompts;
use oxlm_runtime::LoadedModel;
use oxlm_server::{LogLevel, Server, Settings};
use serde_json::{json, Value};

#[tokio::test]
async fn a_request_past_the_queue_is_told_to_come_back() {
    let dir = common::fixtures().join("tiny/llama-4bit-g64");
    let mut loaded = LoadedModel::load(&dir).unwrap();
    loaded.model = Box::new(SlowPrompts {
        inner: loaded.model,
        prompt_time: Duration::from_millis(1500),
    });
    let settings = Settings {
        decode_concurrency: 1,
        max_queued_requests: Some(1),
        log_level: LogLevel::Warning,
        ..Settings::default()
    };
    let base = common::listen(Server::new(loaded, settings).unwrap()).await;
    let client = reqwest::Client::new();
    let send = |prompt: &str| {
        let body = json!({"prompt": prompt, "max_tokens": 2});
        client
            .post(format!("{base}/v1/completions"))
            .body(body.to_string())
            .send()
    };
    // One decoding, one queued: the third is one too many.
    let decoding = tokio::spawn(send("Once upon a time"));
    tokio::time::sleep(Duration::from_millis(200)).await;
    let queued = tokio::spawn(send("The capital of"));
    tokio::time::sleep(Duration::from_millis(200)).await;
    let refused = send("Numbers: one, two,").await.unwrap();
    assert_eq!(refused.status(), 429);
    assert_eq!(refused.headers()["retry-after"], "1");
    let body: Value = serde_json::from_str(&refused.text().await.unwrap()).unwrap();
    let error = json!({"error": {"message": "Too many requests are waiting: try again shortly",
                                 "type": "rate_limit_error", "param": null,
                                 "code": "too_many_requests"}});
    assert_eq!(body, error);
    for request in [decoding, queued] {
        assert_eq!(request.await.unwrap().unwrap().status(), 200);
    }
    // Drained: taken again.
    assert_eq!(send("Once upon a time").await.unwrap().status(), 200);
}
