//! Serving before the model has loaded. `oxlm serve` listens first, so that a large model's load
//! is seen from outside as it is: `/health` answers 200 (the process is alive: a liveness probe
//! must not restart it), `/ready` 503 `{"status": "loading"}` (no traffic yet), `/metrics` and
//! `/stats` report. Any other request waits for the model and is then served as usual, as a
//! client that polled `/health` before sending its first request (mlx_lm.server's way) expects.
//! Its connections are held to the same limits as the loaded server's (a cap of their own:
//! the few opened during the load may briefly add to the loaded server's).

use std::path::Path;
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use oxlm_runtime::LoadedModel;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tower::ServiceExt;

use crate::api::{health_response, Json};
use crate::connections::{self, ConnectionLimits};
use crate::error::ApiError;
use crate::metrics::{Readiness, Telemetry};
use crate::{model_id, ServeError, Server, Settings};

/// A listener answering while its model loads; [`finish`](Self::finish) hands its socket and
/// its metrics to the [`Server`] of the loaded model.
pub struct Loading {
    telemetry: Arc<Telemetry>,
    /// The socket, which a duplicate of accepts on meanwhile: the loading server drops that one
    /// when it stops, and connections that come in between wait in the socket's backlog.
    listener: std::net::TcpListener,
    /// Takes the loaded server's routes; the loading server stops accepting then.
    app: watch::Sender<Option<Router>>,
}

#[derive(Clone)]
struct LoadingState {
    telemetry: Arc<Telemetry>,
    app: watch::Receiver<Option<Router>>,
}

impl Loading {
    /// Starts answering on `listener` for the model in `model_dir`, whose id labels the
    /// metrics, with the connection limits of `settings`. Call it within a Tokio runtime, which
    /// serves meanwhile.
    pub fn start(
        listener: TcpListener,
        model_dir: &Path,
        settings: &Settings,
    ) -> std::io::Result<Self> {
        let listener = listener.into_std()?;
        let accepting = TcpListener::from_std(listener.try_clone()?)?;
        let telemetry = Arc::new(Telemetry::new(model_id(model_dir)));
        let (app, loaded) = watch::channel(None);
        let state = LoadingState {
            telemetry: telemetry.clone(),
            app: loaded.clone(),
        };
        let mut stop = loaded;
        let stopped = async move {
            // Loaded, or the load given up (the sender dropped).
            let _ = stop.wait_for(Option::is_some).await;
        };
        let limits = ConnectionLimits::from(settings);
        let serving = connections::serve(accepting, router(state), limits, stopped);
        // Connections it has accepted are served on (by the loaded server's routes) until
        // their requests end; none is waited for.
        tokio::spawn(serving);
        Ok(Loading {
            telemetry,
            listener,
            app,
        })
    }

    /// The [`Server`] of `model`, loaded meanwhile, and the listener for its
    /// [`serve_until`](Server::serve_until): the same socket, and the same metrics, counted
    /// from the start. Requests that waited for the model go to its routes now. Call it within
    /// the Tokio runtime of [`start`](Self::start).
    pub fn finish(
        self,
        model: LoadedModel,
        settings: Settings,
    ) -> Result<(Server, TcpListener), ServeError> {
        let server = Server::with_telemetry(model, settings, self.telemetry)?;
        let listener = TcpListener::from_std(self.listener)?;
        // Before any request reaches the model, so that this line comes before theirs.
        server.state.settings.info(format_args!(
            "Serving {} at http://{} (OpenAI API: /v1/chat/completions, /v1/completions, /v1/models)",
            server.model_id(),
            listener.local_addr()?
        ));
        self.app.send_replace(Some(server.router()));
        Ok((server, listener))
    }
}

fn router(state: LoadingState) -> Router {
    Router::new()
        .route("/health", get(|| async { health_response(true) }))
        .route("/ready", get(|| async { Readiness::Loading.response() }))
        .route("/metrics", get(metrics))
        .route("/stats", get(stats))
        .fallback(wait_for_model)
        .layer(middleware::from_fn_with_state(state.clone(), once_loaded))
        .with_state(state)
}

async fn metrics(State(state): State<LoadingState>) -> Response {
    state.telemetry.metrics_response()
}

async fn stats(State(state): State<LoadingState>) -> Json {
    Json(state.telemetry.stats(Readiness::Loading))
}

/// Sends every request to the loaded server's routes once there is one: a connection opened
/// while the model loaded is served as any other from then on.
async fn once_loaded(State(state): State<LoadingState>, request: Request, next: Next) -> Response {
    let app = state.app.borrow().clone();
    match app {
        Some(app) => serve_on(app, request).await,
        None => next.run(request).await,
    }
}

/// Holds a request for the model until it has loaded.
async fn wait_for_model(State(state): State<LoadingState>, request: Request) -> Response {
    let mut loaded = state.app;
    let app = match loaded.wait_for(Option::is_some).await {
        Ok(app) => app.clone(),
        Err(_) => None,
    };
    match app {
        Some(app) => serve_on(app, request).await,
        None => ApiError::unavailable("The model could not be loaded").into_response(),
    }
}

async fn serve_on(app: Router, request: Request) -> Response {
    match app.oneshot(request).await {
        Ok(response) => response,
        Err(never) => match never {},
    }
}
