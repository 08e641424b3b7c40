//! Admission by memory: under a tight `--memory-budget`, concurrent requests wait for room
//! rather than run the server out of memory; every one admitted finishes, one that could never
//! fit is a 400 with the figures, and a budget smaller than the weights is refused at start.

mod common;

use std::time::Duration;

use common::SlowPrompts;
use oxlm_runtime::memory::{weights_bytes, MemoryPlan};
use oxlm_runtime::{GenerateOptions, LoadedModel};
use oxlm_server::{LogLevel, ServeError, Server, Settings};
use serde_json::{json, Value};

const MODEL: &str = "tiny/llama-4bit-g64";

/// The plan the server makes for the model's caches, and its weights' bytes.
fn plan(loaded: &LoadedModel, settings: &Settings) -> (MemoryPlan, usize) {
    let options = GenerateOptions {
        max_tokens: settings.max_tokens,
        sampler: Default::default(),
        prefill_step: settings.prefill_step,
        kv_cache: settings.kv_cache,
        kv_quantization: None,
        max_kv_size: None,
    };
    let plan = MemoryPlan::new(loaded.model.as_ref(), &options).unwrap();
    (plan, weights_bytes(&loaded.dir).unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tight_budget_queues_requests_and_refuses_only_what_never_fits() {
    let dir = common::fixtures().join(MODEL);
    let mut loaded = LoadedModel::load(&dir).unwrap();
    let settings = Settings {
        decode_concurrency: 8,
        log_level: LogLevel::Warning,
        ..Settings::default()
    };
    let (plan, weights) = plan(&loaded, &settings);
    // Room for the caches of two of the short requests at once.
    let short = plan.sequence_bytes(16, 24);
    let caches = 2 * short;
    let settings = Settings {
        memory_budget: Some(weights + plan.prefill_reserve + caches),
        ..settings
    };
    // Prompts slow enough that the requests overlap.
    loaded.model = Box::new(SlowPrompts {
        inner: loaded.model,
        prompt_time: Duration::from_millis(300),
    });
    let base = common::listen(Server::new(loaded, settings).unwrap()).await;

    // Watches the server's figures while the requests run.
    let watch = {
        let base = base.clone();
        tokio::spawn(async move {
            let mut seen = Vec::new();
            for _ in 0..200 {
                let stats = reqwest::get(format!("{base}/stats")).await.unwrap();
                let stats: Value = serde_json::from_str(&stats.text().await.unwrap()).unwrap();
                seen.push((
                    stats["requests"]["running"].as_u64().unwrap(),
                    stats["memory"]["charged_bytes"].as_u64().unwrap() as usize,
                    stats["memory"]["budget_bytes"].as_u64().unwrap() as usize,
                ));
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            seen
        })
    };
    let send = |prompt: &'static str, max_tokens: usize| {
        let base = base.clone();
        tokio::spawn(async move {
            let body = json!({"prompt": prompt, "max_tokens": max_tokens});
            common::post(&base, "/v1/completions", &body).await
        })
    };
    let short_prompts = [
        "Once upon a time",
        "The capital of",
        "Numbers: one, two,",
        "The history of the city begins",
        "A long time ago",
        "In the beginning",
    ];
    let admitted: Vec<_> = short_prompts.iter().map(|p| send(p, 24)).collect();
    // Its cache at its longest (the whole context) could never fit.
    let refused = send("Tell me everything", 1_000_000).await.unwrap();
    for request in admitted {
        let (status, body) = request.await.unwrap();
        assert_eq!(status, 200, "{body}");
        let body: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(body["choices"][0]["finish_reason"], "length");
        assert_eq!(body["usage"]["completion_tokens"], 24);
    }
    let needed = plan.sequence_bytes(4, 1_000_000);
    assert_eq!(refused.0, 400);
    let error: Value = serde_json::from_str(&refused.1).unwrap();
    let message = format!(
        "This request needs {needed} bytes of cache memory (its prompt and max_tokens) but the \
         server's memory budget for caches is {caches} bytes"
    );
    let expected = json!({"error": {"message": message, "type": "invalid_request_error",
                                    "param": null, "code": "memory_admission"}});
    assert_eq!(error, expected);

    let seen = watch.await.unwrap();
    assert!(seen.iter().all(|&(_, _, budget)| budget == caches));
    assert!(seen
        .iter()
        .all(|&(running, charged, _)| running <= 2 && charged <= caches));
    assert!(seen.iter().any(|&(running, _, _)| running == 2));
    // Still serving.
    let (status, _) = common::post(
        &base,
        "/v1/completions",
        &json!({"prompt": "Once upon a time", "max_tokens": 2}),
    )
    .await;
    assert_eq!(status, 200);
}

#[test]
fn a_budget_smaller_than_the_weights_is_refused_at_start() {
    let dir = common::fixtures().join(MODEL);
    let loaded = LoadedModel::load(&dir).unwrap();
    let weights = weights_bytes(&dir).unwrap();
    let settings = Settings {
        memory_budget: Some(weights / 2),
        log_level: LogLevel::Warning,
        ..Settings::default()
    };
    let reserved = plan(&loaded, &settings).0.prefill_reserve;
    let Err(error) = Server::new(loaded, settings) else {
        panic!("a budget of half the weights was taken");
    };
    assert!(matches!(error, ServeError::Budget(_)));
    assert_eq!(
        error.to_string(),
        format!(
            "--memory-budget {} bytes leaves nothing for caches: the weights take {weights} \
             bytes and {reserved} more are set aside for a prompt chunk's activations",
            weights / 2
        )
    );
}
