//! What the server tells about itself: `GET /metrics` in the Prometheus text format (0.0.4)
//! under vLLM's metric names, types, `model_name` label and histogram buckets, which llm-d's
//! inference scheduler (the Gateway API inference extension's endpoint picker), KServe,
//! autoscalers and vLLM's Grafana dashboards read; `GET /stats`, the same figures as JSON; and
//! readiness.
//!
//! The batcher's figures (requests running and waiting, KV cache usage, prompt-cache queries and
//! hits) are read from its [`BatcherStats`] at each scrape. The requests' figures (tokens,
//! latencies, how they ended) are recorded by each request's [`RequestTimer`] on the generation
//! thread, as the batcher hands over each update: a client that reads slowly does not bunch its
//! tokens' times, and a request's figures are in before its client has its last byte.

use std::borrow::Cow;
use std::cell::Cell;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use oxlm_runtime::batcher::{BatcherStats, JobError, Update};
use oxlm_runtime::FinishReason;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{prometheus_text, DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use serde_json::{json, Map, Value};

// vLLM's buckets (vllm/v1/metrics/loggers.py), so that quantiles compare across servers.
const TIME_TO_FIRST_TOKEN_BUCKETS: [f64; 22] = [
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];
const INTER_TOKEN_LATENCY_BUCKETS: [f64; 19] = [
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
];
const REQUEST_LATENCY_BUCKETS: [f64; 21] = [
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
];

/// vLLM's `finished_reason` values, each counted from the start.
const FINISHED_REASONS: [&str; 4] = ["stop", "length", "abort", "error"];

/// The `finished_reason` of a request that ended with `result`.
fn finished_reason(result: &Result<FinishReason, JobError>) -> &'static str {
    match result {
        Ok(FinishReason::Stop) => "stop",
        Ok(FinishReason::Length) => "length",
        Ok(FinishReason::Cancelled)
        | Err(JobError::ShuttingDown)
        | Err(JobError::DeadlineExceeded) => "abort",
        Err(_) => "error",
    }
}

type ReasonLabel = [(&'static str, &'static str); 1];

/// The requests' figures, which every request's timer adds to.
#[derive(Debug)]
struct RequestMetrics {
    prompt_tokens: Counter,
    generation_tokens: Counter,
    finished: Family<ReasonLabel, Counter>,
    time_to_first_token: Histogram,
    inter_token_latency: Histogram,
    /// The same observations under vLLM's older name, which older dashboards read.
    time_per_output_token: Histogram,
    e2e_request_latency: Histogram,
}

impl RequestMetrics {
    fn register(registry: &mut Registry) -> Self {
        let metrics = RequestMetrics {
            prompt_tokens: Counter::default(),
            generation_tokens: Counter::default(),
            finished: Family::default(),
            time_to_first_token: Histogram::new(TIME_TO_FIRST_TOKEN_BUCKETS),
            inter_token_latency: Histogram::new(INTER_TOKEN_LATENCY_BUCKETS),
            time_per_output_token: Histogram::new(INTER_TOKEN_LATENCY_BUCKETS),
            e2e_request_latency: Histogram::new(REQUEST_LATENCY_BUCKETS),
        };
        for reason in FINISHED_REASONS {
            // Each reason is reported, at 0, from the start.
            let _ = metrics
                .finished
                .get_or_create(&[("finished_reason", reason)]);
        }
        // The registry ends each help text with a full stop, and counters' names with `_total`.
        let m = &metrics;
        registry.register(
            "vllm:prompt_tokens",
            "Prompt tokens of the requests that got their first token, cached ones included",
            m.prompt_tokens.clone(),
        );
        registry.register(
            "vllm:generation_tokens",
            "Tokens generated",
            m.generation_tokens.clone(),
        );
        registry.register(
            "vllm:request_success",
            "Requests ended, by finished_reason: stop, length, abort (cancelled by its client or \
             by the shutdown) or error",
            m.finished.clone(),
        );
        registry.register(
            "vllm:time_to_first_token_seconds",
            "Seconds from a request's prompt being queued to its first token",
            m.time_to_first_token.clone(),
        );
        registry.register(
            "vllm:inter_token_latency_seconds",
            "Seconds between a request's successive tokens",
            m.inter_token_latency.clone(),
        );
        registry.register(
            "vllm:time_per_output_token_seconds",
            "Seconds between a request's successive tokens (vllm:inter_token_latency_seconds \
             under vLLM's older name)",
            m.time_per_output_token.clone(),
        );
        registry.register(
            "vllm:e2e_request_latency_seconds",
            "Seconds from a request's prompt being queued to its end",
            m.e2e_request_latency.clone(),
        );
        metrics
    }

    fn finished(&self, reason: &'static str) -> u64 {
        self.finished
            .get_or_create(&[("finished_reason", reason)])
            .get()
    }
}

/// The batcher's figures, read from its stats at each scrape.
#[derive(Debug)]
struct BatcherMetrics(Arc<BatcherStats>);

impl Collector for BatcherMetrics {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let now = self.0.snapshot();
        let usage = now.kv_usage();
        let kv_usage_help = "Share of the batch's context in use, from 0 to 1: context tokens \
                             held by the running requests over --decode-concurrency times the \
                             model's context length.";
        let mut put = |name: &str, help: &str, metric: &dyn EncodeMetric| {
            metric.encode(encoder.encode_descriptor(name, help, None, metric.metric_type())?)
        };
        put(
            "vllm:num_requests_running",
            "Requests in the batch: their prompts going through the model, or decoding.",
            &ConstGauge::new(now.running as i64),
        )?;
        put(
            "vllm:num_requests_waiting",
            "Requests waiting for a place in the batch.",
            &ConstGauge::new(now.waiting as i64),
        )?;
        put(
            "vllm:kv_cache_usage_perc",
            kv_usage_help,
            &ConstGauge::new(usage),
        )?;
        put(
            "vllm:gpu_cache_usage_perc",
            "vllm:kv_cache_usage_perc under vLLM's older name.",
            &ConstGauge::new(usage),
        )?;
        put(
            "vllm:prefix_cache_queries",
            "Prompt tokens looked up in the prompt cache.",
            &ConstCounter::new(now.prefix_cache_queries),
        )?;
        put(
            "vllm:prefix_cache_hits",
            "Prompt tokens whose model state came from the prompt cache.",
            &ConstCounter::new(now.prefix_cache_hits),
        )?;
        put(
            "oxlm:memory_budget_bytes",
            "Bytes the running requests' caches and the prompt cache may take together.",
            &ConstGauge::new(now.memory_budget as i64),
        )?;
        put(
            "oxlm:memory_charged_bytes",
            "Bytes of the memory budget the running requests hold: each its cache at its \
             longest (prompt and max_tokens).",
            &ConstGauge::new(now.memory_charged as i64),
        )
    }
}

/// Where the server stands, as readiness tells it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Readiness {
    Loading,
    Ready,
    /// A shutdown signal came: requests in progress finish, no new ones should come.
    Draining,
    /// The generation thread has stopped.
    Unavailable,
}

impl Readiness {
    fn as_str(self) -> &'static str {
        match self {
            Readiness::Loading => "loading",
            Readiness::Ready => "ready",
            Readiness::Draining => "draining",
            Readiness::Unavailable => "unavailable",
        }
    }

    /// `GET /ready`: 200 `{"status": "ready"}` while requests are taken, else 503 saying why.
    pub(crate) fn response(self) -> Response {
        let status = match self {
            Readiness::Ready => StatusCode::OK,
            _ => StatusCode::SERVICE_UNAVAILABLE,
        };
        let body = json!({"status": self.as_str()}).to_string();
        (status, [(header::CONTENT_TYPE, "application/json")], body).into_response()
    }
}

/// The server's metrics and shutdown state, from before its model loads until it stops.
pub(crate) struct Telemetry {
    model_id: String,
    started: Instant,
    draining: AtomicBool,
    batcher: Arc<BatcherStats>,
    requests: Arc<RequestMetrics>,
    /// Everything above, labelled with `model_name` as vLLM labels it.
    registry: Registry,
}

impl Telemetry {
    pub(crate) fn new(model_id: String) -> Self {
        let model_name = (Cow::Borrowed("model_name"), Cow::Owned(model_id.clone()));
        let mut registry = Registry::with_labels(std::iter::once(model_name));
        let requests = Arc::new(RequestMetrics::register(&mut registry));
        let batcher = Arc::new(BatcherStats::default());
        registry.register_collector(Box::new(BatcherMetrics(batcher.clone())));
        Telemetry {
            model_id,
            started: Instant::now(),
            draining: AtomicBool::new(false),
            batcher,
            requests,
            registry,
        }
    }

    pub(crate) fn model_id(&self) -> &str {
        &self.model_id
    }

    /// Where the batcher reports what it is doing.
    pub(crate) fn batcher_stats(&self) -> Arc<BatcherStats> {
        self.batcher.clone()
    }

    /// The timer of a request of `prompt_tokens` queued now.
    pub(crate) fn timer(&self, prompt_tokens: usize) -> RequestTimer {
        RequestTimer {
            metrics: self.requests.clone(),
            prompt_tokens: prompt_tokens as u64,
            queued: Instant::now(),
            last_token: Cell::new(None),
            ended: Cell::new(false),
        }
    }

    /// A shutdown signal came: readiness turns false for good.
    pub(crate) fn start_draining(&self) {
        self.draining.store(true, Ordering::Relaxed);
    }

    /// Readiness once the model has loaded, with the generation thread `alive` or not.
    pub(crate) fn readiness(&self, alive: bool) -> Readiness {
        if self.draining.load(Ordering::Relaxed) {
            Readiness::Draining
        } else if alive {
            Readiness::Ready
        } else {
            Readiness::Unavailable
        }
    }

    /// `GET /metrics`.
    pub(crate) fn metrics_response(&self) -> Response {
        let mut text = String::new();
        match prometheus_text::encode(&mut text, &self.registry) {
            Ok(()) => (
                [(header::CONTENT_TYPE, prometheus_text::CONTENT_TYPE)],
                text,
            )
                .into_response(),
            // Only a formatter's error, which writing to a String never returns.
            Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
        }
    }

    /// `GET /stats`: the figures of `/metrics` as JSON, and what an operator looks for first.
    pub(crate) fn stats(&self, readiness: Readiness) -> Value {
        let batcher = self.batcher.snapshot();
        let requests = &self.requests;
        let finished: Map<String, Value> = FINISHED_REASONS
            .iter()
            .map(|&reason| (reason.to_owned(), requests.finished(reason).into()))
            .collect();
        json!({
            "status": readiness.as_str(),
            "model": self.model_id,
            "version": env!("CARGO_PKG_VERSION"),
            "uptime_seconds": self.started.elapsed().as_secs_f64(),
            "requests": {
                "running": batcher.running,
                "waiting": batcher.waiting,
                "finished": finished,
            },
            "tokens": {
                "prompt": requests.prompt_tokens.get(),
                "generation": requests.generation_tokens.get(),
            },
            "kv_cache": {
                "usage": batcher.kv_usage(),
                "tokens": batcher.kv_tokens,
                "capacity_tokens": batcher.kv_capacity_tokens,
            },
            "memory": {
                "budget_bytes": batcher.memory_budget,
                "charged_bytes": batcher.memory_charged,
            },
            "prefix_cache": {
                "queries": batcher.prefix_cache_queries,
                "hits": batcher.prefix_cache_hits,
                "entries": batcher.prompt_cache_entries,
                "bytes": batcher.prompt_cache_bytes,
            },
            "latency_seconds": {
                "time_to_first_token": summary(&requests.time_to_first_token),
                "inter_token": summary(&requests.inter_token_latency),
                "e2e_request": summary(&requests.e2e_request_latency),
            },
        })
    }
}

/// A histogram's count and mean (null before its first observation).
fn summary(histogram: &Histogram) -> Value {
    let count = histogram.count();
    let mean = (count > 0).then(|| histogram.sum() / count as f64);
    json!({"count": count, "mean": mean})
}

/// One request's part of the metrics, recorded on the generation thread as the batcher hands
/// over its updates: its time to first token, the gaps between its tokens, and how and when it
/// ended.
pub(crate) struct RequestTimer {
    metrics: Arc<RequestMetrics>,
    prompt_tokens: u64,
    queued: Instant,
    last_token: Cell<Option<Instant>>,
    ended: Cell<bool>,
}

impl RequestTimer {
    pub(crate) fn record(&self, update: &Update) {
        let now = Instant::now();
        let metrics = &self.metrics;
        match update {
            Update::Token { .. } => {
                match self.last_token.replace(Some(now)) {
                    None => {
                        let waited = now - self.queued;
                        metrics.time_to_first_token.observe(waited.as_secs_f64());
                        metrics.prompt_tokens.inc_by(self.prompt_tokens);
                    }
                    Some(last) => {
                        let gap = (now - last).as_secs_f64();
                        metrics.inter_token_latency.observe(gap);
                        metrics.time_per_output_token.observe(gap);
                    }
                }
                metrics.generation_tokens.inc();
            }
            Update::Done(result) => self.end(finished_reason(result), now),
            Update::Started { .. } | Update::Prefill { .. } | Update::Text(_) => {}
        }
    }

    fn end(&self, reason: &'static str, now: Instant) {
        if self.ended.replace(true) {
            return;
        }
        let metrics = &self.metrics;
        metrics
            .finished
            .get_or_create(&[("finished_reason", reason)])
            .inc();
        let latency = now - self.queued;
        metrics.e2e_request_latency.observe(latency.as_secs_f64());
    }
}

impl Drop for RequestTimer {
    /// A job dropped without an end: its generation thread stopped.
    fn drop(&mut self) {
        self.end("error", Instant::now());
    }
}
