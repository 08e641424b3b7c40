//! `/metrics`, `/stats` and readiness over real HTTP on a tiny fixture model: vLLM's metric
//! names, types and buckets with exact counts after streamed and plain requests (one of them a
//! prompt-cache hit), readiness through a shutdown, and what answers while the model loads.

mod common;

use std::collections::BTreeMap;
use std::future::IntoFuture;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use oxlm_runtime::LoadedModel;
use oxlm_server::{Loading, LogLevel, Server, Settings};
use serde_json::{json, Value};
use tokio::net::TcpListener;
use tokio::sync::oneshot;

fn model_dir() -> PathBuf {
    common::fixtures().join("tiny/llama-8bit-g32")
}

fn quiet() -> Settings {
    Settings {
        log_level: LogLevel::Warning,
        ..Settings::default()
    }
}

/// The fixture's chat and its greedy reply (no end of sequence within its 32 tokens).
fn golden() -> Value {
    let text = std::fs::read_to_string(model_dir().join("golden.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

async fn get(client: &reqwest::Client, base: &str, path: &str) -> reqwest::Response {
    client.get(format!("{base}{path}")).send().await.unwrap()
}

async fn get_json(client: &reqwest::Client, base: &str, path: &str) -> (u16, Value) {
    let response = get(client, base, path).await;
    let status = response.status().as_u16();
    (
        status,
        serde_json::from_str(&response.text().await.unwrap()).unwrap(),
    )
}

/// One sample of the exposition text: its name, labels and value.
#[derive(Debug)]
struct Sample {
    name: String,
    labels: BTreeMap<String, String>,
    value: f64,
}

/// The samples of Prometheus text (labels without escapes, as these are).
fn samples(text: &str) -> Vec<Sample> {
    text.lines()
        .filter(|line| !line.starts_with('#') && !line.is_empty())
        .map(|line| {
            let (series, value) = line.rsplit_once(' ').unwrap();
            let (name, labels) = match series.split_once('{') {
                Some((name, labels)) => (name, labels.trim_end_matches('}')),
                None => (series, ""),
            };
            let labels = labels
                .split(',')
                .filter(|pair| !pair.is_empty())
                .map(|pair| {
                    let (key, value) = pair.split_once('=').unwrap();
                    (key.to_owned(), value.trim_matches('"').to_owned())
                })
                .collect();
            Sample {
                name: name.to_owned(),
                labels,
                value: value.parse().unwrap(),
            }
        })
        .collect()
}

/// The `/metrics` of a server, checked for its content type and its model label.
struct Metrics(Vec<Sample>);

impl Metrics {
    async fn scrape(client: &reqwest::Client, base: &str, model_id: &str) -> Self {
        let response = get(client, base, "/metrics").await;
        assert_eq!(response.status(), 200);
        assert_eq!(
            response.headers()["content-type"],
            "text/plain; version=0.0.4; charset=utf-8"
        );
        let samples = samples(&response.text().await.unwrap());
        for sample in &samples {
            assert_eq!(sample.labels["model_name"], model_id, "{sample:?}");
        }
        Metrics(samples)
    }

    /// The value of the one sample `name` with `label` (any when `None`).
    fn value(&self, name: &str, label: Option<(&str, &str)>) -> f64 {
        let found: Vec<&Sample> = self
            .0
            .iter()
            .filter(|s| s.name == name)
            .filter(|s| label.is_none_or(|(k, v)| s.labels.get(k).is_some_and(|l| l == v)))
            .collect();
        assert_eq!(found.len(), 1, "{name} {label:?}: {found:?}");
        found[0].value
    }

    fn get(&self, name: &str) -> f64 {
        self.value(name, None)
    }

    /// A histogram's bucket bounds (`+Inf` last) and its count, checked against its buckets.
    fn histogram(&self, name: &str) -> (Vec<f64>, f64) {
        let bucket = format!("{name}_bucket");
        let buckets: Vec<(f64, f64)> = self
            .0
            .iter()
            .filter(|s| s.name == bucket)
            .map(|s| (s.labels["le"].parse().unwrap(), s.value))
            .collect();
        let count = self.get(&format!("{name}_count"));
        assert_eq!(buckets.last().unwrap(), &(f64::INFINITY, count), "{name}");
        assert!(buckets.windows(2).all(|w| w[0].1 <= w[1].1), "{buckets:?}");
        (buckets.iter().map(|&(le, _)| le).collect(), count)
    }
}

/// A histogram's bounds: `buckets`, then `+Inf`.
fn bounds(buckets: &[f64]) -> Vec<f64> {
    buckets.iter().copied().chain([f64::INFINITY]).collect()
}

/// Polls `/stats` until `done` holds of it: the batcher's figures are published between its
/// steps, which may come just after a response has gone out.
async fn stats_when(client: &reqwest::Client, base: &str, done: impl Fn(&Value) -> bool) -> Value {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (status, stats) = get_json(client, base, "/stats").await;
        assert_eq!(status, 200);
        if done(&stats) {
            return stats;
        }
        assert!(Instant::now() < deadline, "{stats}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A chat request's reply, and its usage, from a plain or a streamed (SSE) response.
async fn chat(client: &reqwest::Client, base: &str, body: Value) -> (String, Value) {
    let response = client
        .post(format!("{base}/v1/chat/completions"))
        .body(body.to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let text = response.text().await.unwrap();
    if !body["stream"].as_bool().unwrap_or(false) {
        let reply: Value = serde_json::from_str(&text).unwrap();
        let finish = reply["choices"][0]["finish_reason"].as_str().unwrap();
        return (finish.to_owned(), reply["usage"].clone());
    }
    let chunks: Vec<Value> = text
        .lines()
        .filter_map(|line| line.strip_prefix("data: "))
        .filter(|data| *data != "[DONE]")
        .map(|data| serde_json::from_str(data).unwrap())
        .collect();
    let finish = chunks
        .iter()
        .find_map(|c| c["choices"][0]["finish_reason"].as_str())
        .unwrap();
    (finish.to_owned(), chunks.last().unwrap()["usage"].clone())
}

/// What vLLM's consumers read, after three requests: counters exact, histograms counting one
/// observation per request (time to first token, end to end) or per token after the first
/// (inter-token), on vLLM's buckets; the batcher's gauges back at rest; `/stats` agreeing.
#[tokio::test]
async fn metrics_count_requests_under_vllm_names() {
    let server = Server::load(&model_dir(), quiet()).unwrap();
    let model_id = server.model_id().to_owned();
    let base = common::listen(server).await;
    let client = reqwest::Client::new();

    let at_rest = Metrics::scrape(&client, &base, &model_id).await;
    for name in [
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:gpu_cache_usage_perc",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:time_to_first_token_seconds_count",
    ] {
        assert_eq!(at_rest.get(name), 0.0, "{name}");
    }

    let golden = golden();
    let messages = golden["messages"].clone();
    let greedy = golden["greedy_text"].as_str().unwrap();
    let stop: String = greedy.chars().skip(3).take(4).collect();
    let requests = [
        json!({"messages": messages, "max_tokens": 8}),
        json!({"messages": messages, "max_tokens": 4, "stream": true,
               "stream_options": {"include_usage": true}}),
        json!({"messages": messages, "max_tokens": 32, "stop": [stop]}),
    ];
    let mut replies = Vec::new();
    for body in requests {
        replies.push(chat(&client, &base, body).await);
    }
    let finishes: Vec<&str> = replies.iter().map(|(f, _)| f.as_str()).collect();
    assert_eq!(finishes, ["length", "length", "stop"]);
    let usage = |key: &str| -> Vec<u64> {
        let counts = replies.iter().map(|(_, u)| u[key].as_u64().unwrap());
        counts.collect()
    };
    let prompt = usage("prompt_tokens");
    let completion = usage("completion_tokens");
    let cached: Vec<u64> = replies
        .iter()
        .map(|(_, u)| {
            u["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap()
        })
        .collect();
    let n_prompt = golden["n_prompt"].as_u64().unwrap();
    assert_eq!(prompt, [n_prompt; 3]);
    assert_eq!(&completion[..2], [8, 4]);
    // The later two start from the first one's state: all of the prompt but its last token.
    assert_eq!(cached, [0, n_prompt - 1, n_prompt - 1]);

    let stats = stats_when(&client, &base, |s| s["requests"]["running"] == 0).await;
    let metrics = Metrics::scrape(&client, &base, &model_id).await;
    let sum = |counts: &[u64]| counts.iter().sum::<u64>() as f64;
    assert_eq!(metrics.get("vllm:prompt_tokens_total"), sum(&prompt));
    assert_eq!(
        metrics.get("vllm:generation_tokens_total"),
        sum(&completion)
    );
    assert_eq!(metrics.get("vllm:prefix_cache_queries_total"), sum(&prompt));
    assert_eq!(metrics.get("vllm:prefix_cache_hits_total"), sum(&cached));
    let finished = |reason| {
        let label = Some(("finished_reason", reason));
        metrics.value("vllm:request_success_total", label)
    };
    let by_reason = ["stop", "length", "abort", "error"].map(finished);
    assert_eq!(by_reason, [1.0, 2.0, 0.0, 0.0]);
    for gauge in [
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:gpu_cache_usage_perc",
    ] {
        assert_eq!(metrics.get(gauge), 0.0, "{gauge}");
    }

    let first_token = [
        0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
        20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
    ];
    let between_tokens = [
        0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
        20.0, 40.0, 80.0,
    ];
    let end_to_end = [
        0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
        240.0, 480.0, 960.0, 1920.0, 7680.0,
    ];
    let gaps = sum(&completion) - 3.0;
    for (name, buckets, count) in [
        ("vllm:time_to_first_token_seconds", &first_token[..], 3.0),
        (
            "vllm:inter_token_latency_seconds",
            &between_tokens[..],
            gaps,
        ),
        (
            "vllm:time_per_output_token_seconds",
            &between_tokens[..],
            gaps,
        ),
        ("vllm:e2e_request_latency_seconds", &end_to_end[..], 3.0),
    ] {
        assert_eq!(metrics.histogram(name), (bounds(buckets), count), "{name}");
    }

    // /stats: the same figures, and the server's own.
    assert_eq!(stats["status"], "ready");
    assert_eq!(stats["model"], model_id.as_str());
    assert!(stats["uptime_seconds"].as_f64().unwrap() > 0.0);
    assert_eq!(
        stats["requests"],
        json!({"running": 0, "waiting": 0,
               "finished": {"stop": 1, "length": 2, "abort": 0, "error": 0}})
    );
    assert_eq!(
        stats["tokens"],
        json!({"prompt": sum(&prompt) as u64, "generation": sum(&completion) as u64})
    );
    assert_eq!(stats["prefix_cache"]["queries"], sum(&prompt) as u64);
    assert_eq!(stats["prefix_cache"]["hits"], sum(&cached) as u64);
    assert!(stats["prefix_cache"]["bytes"].as_u64().unwrap() > 0);
    // This model's context is 2048 tokens, and 32 requests decode together.
    assert_eq!(
        stats["kv_cache"],
        json!({"usage": 0.0, "tokens": 0, "capacity_tokens": 32 * 2048})
    );
    let latency = &stats["latency_seconds"];
    for (key, count) in [
        ("time_to_first_token", 3.0),
        ("inter_token", gaps),
        ("e2e_request", 3.0),
    ] {
        assert_eq!(latency[key]["count"].as_f64(), Some(count), "{key}");
        assert!(latency[key]["mean"].as_f64().unwrap() > 0.0, "{key}");
    }
}

/// Readiness is 200 while the server serves and 503 once a shutdown signal has come, while
/// `/health` (liveness) stays 200; neither needs the API key.
#[tokio::test]
async fn readiness_turns_false_at_the_shutdown_signal() {
    let settings = Settings {
        api_key: Some("secret".into()),
        ..quiet()
    };
    let server = Server::load(&model_dir(), settings).unwrap();
    // The same routes on a second listener, which the shutdown leaves open, to ask afterwards.
    let probe = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let probe_base = format!("http://{}", probe.local_addr().unwrap());
    tokio::spawn(axum::serve(probe, server.router()).into_future());
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let (stop, stopped) = oneshot::channel::<()>();
    let serving = tokio::spawn(server.serve_until(listener, async move {
        let _ = stopped.await;
        "test".to_owned()
    }));
    let client = reqwest::Client::new();
    let ready = json!({"status": "ready"});
    assert_eq!(
        get_json(&client, &base, "/ready").await,
        (200, ready.clone())
    );
    assert_eq!(get_json(&client, &probe_base, "/ready").await, (200, ready));
    assert_eq!(get(&client, &base, "/metrics").await.status(), 200);
    assert_eq!(get(&client, &base, "/v1/models").await.status(), 401);

    stop.send(()).unwrap();
    serving.await.unwrap().unwrap();
    let draining = json!({"status": "draining"});
    assert_eq!(
        get_json(&client, &probe_base, "/ready").await,
        (503, draining)
    );
    let (status, health) = get_json(&client, &probe_base, "/health").await;
    assert_eq!((status, health), (200, json!({"status": "ok"})));
    let (_, stats) = get_json(&client, &probe_base, "/stats").await;
    assert_eq!(stats["status"], "draining");
}

/// While the model loads, the socket already answers: alive, not ready, metrics at zero; a
/// request sent meanwhile waits for the model and is served, and counted, once it has loaded.
#[tokio::test]
async fn the_server_answers_while_its_model_loads() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let loading = Loading::start(listener, &model_dir(), &Settings::default()).unwrap();
    // A fresh connection each time: the loading server closes those it served once it stops.
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .build()
        .unwrap();
    let model_id = model_dir().canonicalize().unwrap().display().to_string();
    let (status, health) = get_json(&client, &base, "/health").await;
    assert_eq!((status, health), (200, json!({"status": "ok"})));
    let loading_status = json!({"status": "loading"});
    assert_eq!(
        get_json(&client, &base, "/ready").await,
        (503, loading_status)
    );
    let metrics = Metrics::scrape(&client, &base, &model_id).await;
    assert_eq!(metrics.get("vllm:num_requests_running"), 0.0);
    assert_eq!(metrics.get("vllm:prompt_tokens_total"), 0.0);
    let (_, stats) = get_json(&client, &base, "/stats").await;
    assert_eq!(
        (&stats["status"], &stats["model"]),
        (&json!("loading"), &json!(model_id))
    );

    let golden = golden();
    let body = json!({"messages": golden["messages"], "max_tokens": 4});
    let early = tokio::spawn({
        let (client, base) = (client.clone(), base.clone());
        async move { chat(&client, &base, body).await }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!early.is_finished());

    let model = LoadedModel::load(&model_dir()).unwrap();
    let (server, listener) = loading.finish(model, quiet()).unwrap();
    let (stop, stopped) = oneshot::channel::<()>();
    let serving = tokio::spawn(server.serve_until(listener, async move {
        let _ = stopped.await;
        "test".to_owned()
    }));
    let (finish, usage) = early.await.unwrap();
    assert_eq!(finish, "length");
    assert_eq!(usage["completion_tokens"], 4);
    assert_eq!(
        get_json(&client, &base, "/ready").await,
        (200, json!({"status": "ready"}))
    );
    let (_, models) = get_json(&client, &base, "/v1/models").await;
    assert_eq!(models["data"][0]["id"], model_id.as_str());
    // The metrics of the loading server go on.
    let metrics = Metrics::scrape(&client, &base, &model_id).await;
    assert_eq!(
        metrics.get("vllm:prompt_tokens_total"),
        golden["n_prompt"].as_f64().unwrap()
    );
    assert_eq!(metrics.get("vllm:generation_tokens_total"), 4.0);
    stop.send(()).unwrap();
    serving.await.unwrap().unwrap();
}
