//! Shutdown that loses nothing: a request whose prompt is still going through the model when
//! the grace period ends gets the shutdown's error in its API's shape at once, whatever the
//! generation thread is doing.

mod common;

/// Longer than the server waits for its responses to close once it has cancelled them.
const PROMPT_TIME: Duration = Duration::from_secs(5);

use std::time::{Duration, Instant};

use common::SlowPrompts;
use oxlm_runtime::LoadedModel;
use oxlm_server::{LogLevel, Server, Settings};
use serde_json::{json, Value};

#[tokio::test]
async fn requests_in_their_prompt_at_shutdown_end_with_its_error() {
    let dir = common::fixtures().join("tiny/llama-4bit-g64");
    let mut loaded = LoadedModel::load(&dir).unwrap();
    loaded.model = Box::new(SlowPrompts {
        inner: loaded.model,
        prompt_time: PROMPT_TIME,
    });
    let settings = Settings {
        shutdown_grace: Duration::ZERO,
        log_level: LogLevel::Warning,
        ..Settings::default()
    };
    let server = Server::new(loaded, settings).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let serving = tokio::spawn(server.serve_until(listener, async move {
        let _ = stopped.await;
        "test".to_owned()
    }));

    let client = reqwest::Client::new();
    let send = |stream: bool| {
        let body = json!({"prompt": "Once upon a time", "max_tokens": 8, "stream": stream});
        client
            .post(format!("{base}/v1/completions"))
            .body(body.to_string())
            .send()
    };
    let streamed = send(true).await.unwrap();
    // Queued behind the first, whose prompt holds the generation thread.
    let queued = tokio::spawn(send(false));
    tokio::time::sleep(Duration::from_millis(300)).await;
    let start = Instant::now();
    stop.send(()).unwrap();

    let error = json!({"error": {"message": "The server is shutting down",
                                 "type": "server_error", "param": null, "code": null}});
    let text = streamed.text().await.unwrap();
    assert!(
        text.ends_with(&format!("data: {error}\n\ndata: [DONE]\n\n")),
        "{text}"
    );
    let queued = queued.await.unwrap().unwrap();
    assert_eq!(queued.status(), 503);
    let body: Value = serde_json::from_str(&queued.text().await.unwrap()).unwrap();
    assert_eq!(body, error);
    // Neither waited for the prompt to go through: both ended well within the time the server
    // gives cancelled responses to close before it returns (and `oxlm serve` exits).
    assert!(
        start.elapsed() < Duration::from_secs(1),
        "{:?}",
        start.elapsed()
    );
    serving.await.unwrap().unwrap();
}
