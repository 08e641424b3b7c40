//! Requests served together: concurrent requests share decoding steps (`forward_batch`) up to
//! `decode_concurrency`, and each gets what it gets served alone. How the batcher schedules
//! (adapters, prompts cut between steps, the prompt cache) is tested in the runtime.

mod common;

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use oxlm_engine::{KvPrecision, Tensor};
use oxlm_models::lora::Adaptable;
use oxlm_models::{Cache, ForwardError, LanguageModel, Logits, ModelInfo};
use oxlm_runtime::LoadedModel;
use oxlm_server::{LogLevel, Server, Settings};
use serde_json::{json, Value};

/// A forward pass as the server asked for it.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Call {
    /// `forward` of this many prompt tokens of one sequence.
    Prompt(usize),
    /// `forward` of one sequence's next token, for its greedy pick.
    Step,
    /// `forward_batch` of this many sequences.
    Batch(usize),
}

/// The model's calls, in order.
type Calls = Arc<Mutex<Vec<Call>>>;

/// The sizes of the batched steps among `calls`.
fn batches(calls: &Calls) -> Vec<usize> {
    let calls = calls.lock().unwrap();
    calls
        .iter()
        .filter_map(|c| match c {
            Call::Batch(n) => Some(*n),
            _ => None,
        })
        .collect()
}

/// The tiny llama fixture, recording its calls. Its first forward pass is slow, so that
/// requests sent together are all queued before the first of them decodes.
struct Recording {
    inner: Box<dyn LanguageModel>,
    calls: Calls,
    first: AtomicBool,
}

impl LanguageModel for Recording {
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
        if self.first.swap(false, Ordering::Relaxed) {
            std::thread::sleep(Duration::from_millis(300));
        }
        let call = match logits {
            Logits::LastOnDevice => Call::Step,
            _ => Call::Prompt(tokens.len()),
        };
        self.calls.lock().unwrap().push(call);
        self.inner.forward(tokens, cache, logits)
    }

    fn forward_batch(
        &self,
        tokens: &[u32],
        caches: &mut [&mut Cache],
    ) -> Result<Tensor, ForwardError> {
        self.calls.lock().unwrap().push(Call::Batch(tokens.len()));
        self.inner.forward_batch(tokens, caches)
    }

    fn adaptable(&self) -> Option<&dyn Adaptable> {
        self.inner.adaptable()
    }
}

fn fixture(name: &str) -> PathBuf {
    common::fixtures().join("tiny").join(name)
}

/// A server of the recording llama with `settings`: its address and the model's calls.
async fn start_with(settings: Settings) -> (String, Calls) {
    start_model("llama-4bit-g64", settings).await
}

/// A server of the tiny model `name`, recording, with `settings`.
async fn start_model(name: &str, settings: Settings) -> (String, Calls) {
    let mut loaded = LoadedModel::load(&fixture(name)).unwrap();
    let calls = Arc::new(Mutex::new(Vec::new()));
    loaded.model = Box::new(Recording {
        inner: loaded.model,
        calls: calls.clone(),
        first: AtomicBool::new(true),
    });
    let settings = Settings {
        log_level: LogLevel::Warning,
        ..settings
    };
    let server = Server::new(loaded, settings).unwrap();
    let base = common::listen(server).await;
    (base, calls)
}

/// [`start_with`] decoding up to `decode_concurrency` sequences together, with the adapters
/// in `adapters_dir`.
async fn start(decode_concurrency: usize, adapters_dir: Option<PathBuf>) -> (String, Calls) {
    // Without a prompt cache, which would give a request the prefix of one that ended before
    // it when served one at a time, and not when served together.
    start_with(Settings {
        decode_concurrency,
        prompt_cache_size: 0,
        adapters_dir,
        // Each prompt in one pass, together as alone (the slow prompts would otherwise shrink
        // the chunks, and another chunking moves the logits in their last digits).
        prefill_pause: None,
        ..Settings::default()
    })
    .await
}

/// Four requests of different lengths and samplers: greedy ones, a seeded sampled one and one
/// with top logprobs (whose steps need the logits on the host).
fn requests() -> Vec<Value> {
    vec![
        json!({"prompt": "The history of the city begins", "max_tokens": 24}),
        json!({"prompt": "Once upon a time", "max_tokens": 10}),
        json!({"prompt": "The capital of", "max_tokens": 16, "temperature": 0.7, "seed": 3}),
        json!({"prompt": "Numbers: one, two,", "max_tokens": 6, "logprobs": 2}),
    ]
}

/// Sends the requests of `bodies`, each `apart` after the one before (well within the first
/// one's slow prompt); returns each one's text, finish reason, usage and logprobs.
async fn send_together(base: &str, bodies: Vec<Value>, apart: Duration) -> Vec<Value> {
    let client = reqwest::Client::new();
    let sends = bodies.into_iter().enumerate().map(|(i, body)| {
        let client = client.clone();
        let url = format!("{base}/v1/completions");
        tokio::spawn(async move {
            tokio::time::sleep(apart * i as u32).await;
            let response = client.post(url).body(body.to_string()).send().await;
            let text = response.unwrap().text().await.unwrap();
            let r: Value = serde_json::from_str(&text).unwrap();
            let choice = &r["choices"][0];
            json!([
                choice["text"],
                choice["finish_reason"],
                r["usage"],
                choice["logprobs"]
            ])
        })
    });
    let mut replies = Vec::new();
    for send in sends.collect::<Vec<_>>() {
        replies.push(send.await.unwrap());
    }
    replies
}

#[tokio::test]
async fn requests_sent_together_decode_together_as_they_decode_alone() {
    let (together, calls) = start(32, None).await;
    let replies = send_together(&together, requests(), Duration::ZERO).await;
    // The first request's slow prompt lets the others queue.
    assert_eq!(batches(&calls).iter().max(), Some(&4));

    let (alone, calls) = start(1, None).await;
    let expected = send_together(&alone, requests(), Duration::ZERO).await;
    assert!(batches(&calls).is_empty(), "one at a time");
    assert_eq!(replies, expected);
    let finish: Vec<&Value> = replies.iter().map(|r| &r[1]).collect();
    assert_eq!(finish, ["length"; 4]);
    let completion_tokens: Vec<&Value> =
        replies.iter().map(|r| &r[2]["completion_tokens"]).collect();
    assert_eq!(completion_tokens, [24, 10, 16, 6]);
}
