//! One line on stderr per request once its response has been sent in full (or its client went
//! away): method, path, status, duration and, for generations, prompt and completion tokens.
//! Readiness probes and metrics scrapes are not logged.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{Method, StatusCode};
use axum::middleware::Next;
use axum::response::Response;

use crate::body::Holding;
use crate::AppState;

/// The token counts of a generation request, shared by its handler and its log line.
#[derive(Debug, Clone, Default)]
pub(crate) struct TokenCounts(Arc<Counts>);

#[derive(Debug, Default)]
struct Counts {
    generation: AtomicBool,
    prompt: AtomicUsize,
    completion: AtomicUsize,
}

impl TokenCounts {
    /// The request became a generation of `prompt` tokens.
    pub(crate) fn start(&self, prompt: usize) {
        self.0.prompt.store(prompt, Ordering::Relaxed);
        self.0.generation.store(true, Ordering::Relaxed);
    }

    pub(crate) fn add_completion_token(&self) {
        self.0.completion.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn prompt(&self) -> usize {
        self.0.prompt.load(Ordering::Relaxed)
    }

    pub(crate) fn completion(&self) -> usize {
        self.0.completion.load(Ordering::Relaxed)
    }
}

/// Paths that orchestrators poll, left out of the log: llm-d's scheduler scrapes `/metrics`
/// every 50 ms by default.
const POLLED: [&str; 2] = ["/metrics", "/ready"];

/// Gives every request its [`TokenCounts`] and, when the log level shows requests, logs it
/// (unless it is a poll).
pub(crate) async fn log_requests(
    State(state): State<Arc<AppState>>,
    mut request: Request,
    next: Next,
) -> Response {
    let tokens = TokenCounts::default();
    request.extensions_mut().insert(tokens.clone());
    if !state.settings.logs_info() || POLLED.contains(&request.uri().path()) {
        return next.run(request).await;
    }
    let mut line = RequestLine {
        method: request.method().clone(),
        path: request.uri().path().to_owned(),
        start: Instant::now(),
        status: StatusCode::OK,
        tokens,
    };
    let response = next.run(request).await;
    line.status = response.status();
    let (parts, body) = response.into_parts();
    Response::from_parts(parts, Body::new(Holding::new(body, line)))
}

/// Printed when dropped: when the response body has been sent, or abandoned.
struct RequestLine {
    method: Method,
    path: String,
    start: Instant,
    status: StatusCode,
    tokens: TokenCounts,
}

impl Drop for RequestLine {
    fn drop(&mut self) {
        let mut line = format!(
            "{} {} {} {:.3}s",
            self.method,
            self.path,
            self.status.as_u16(),
            self.start.elapsed().as_secs_f64()
        );
        if self.tokens.0.generation.load(Ordering::Relaxed) {
            line.push_str(&format!(
                " prompt_tokens={} completion_tokens={}",
                self.tokens.prompt(),
                self.tokens.completion()
            ));
        }
        eprintln!("{line}");
    }
}
