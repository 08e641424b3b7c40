//! The connection layer: accepting, HTTP/1.1 through hyper, and the limits that keep slow, idle
//! or too many clients from holding the connections and file descriptors that requests need.
//!
//! - A connection with no request in progress (new, or between keep-alive requests) is closed
//!   after `idle_timeout`.
//! - From a request's first byte, its whole head must arrive within `header_timeout`.
//! - Its body must arrive within `body_timeout` of its head, else it is answered 408.
//! - A response write that makes no progress for `send_timeout` (a client that stopped reading)
//!   closes the connection.
//! - Past `max_connections`, a new connection is answered 503 with `Retry-After` and closed.
//! - A declared `Content-Length` over `max_request_bytes` is answered 413 before any of the body
//!   is read.
//!
//! hyper's own `header_read_timeout` is left off: its one clock runs from the moment a
//! connection waits for a head (accept, or the end of the previous response) to the head's last
//! byte, so it is also an idle timeout of the same length, and idle time eats into a head's.

use std::convert::Infallible;
use std::future::{ready, Future};
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::{header, HeaderValue, Request, Response};
use axum::Router;
use http_body::{Body as HttpBody, Frame, SizeHint};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper_util::rt::TokioIo;
use hyper_util::server::graceful::GracefulShutdown;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::{Instant, Sleep};
use tower::ServiceExt;

use crate::body::Holding;
use crate::error::ApiError;
use crate::Settings;

/// Most connections open at once by default: the `worker_connections` nginx ships with.
const DEFAULT_MAX_CONNECTIONS: usize = 1024;
/// File descriptors kept for all but connections: standard streams, the listener, the async
/// runtime's, adapter files read while serving, a GPU driver's device files.
const RESERVED_DESCRIPTORS: usize = 64;
/// Refused connections read from at once after their 503; more are closed right after it.
const LINGERING_REFUSALS: usize = 16;
/// How long a refused connection is read from after its 503: closed with its request unread, it
/// would be reset, which fails a client still sending.
const REFUSAL_LINGER: Duration = Duration::from_secs(1);
/// The `Retry-After` of a refused connection, in seconds.
const REFUSAL_RETRY_AFTER: u64 = 1;
/// How long accepting pauses after an error that is not one client's, such as the process
/// running out of file descriptors (hyper's and axum's servers pause as long).
const ACCEPT_ERROR_PAUSE: Duration = Duration::from_secs(1);
/// The words of the router's own 413 (`api.rs`), for the same refusal made earlier.
const TOO_LARGE_MESSAGE: &str = "The request body is larger than the server accepts";

/// What [`serve`] holds connections to.
#[derive(Debug, Clone)]
pub(crate) struct ConnectionLimits {
    pub idle_timeout: Duration,
    pub header_timeout: Duration,
    pub body_timeout: Duration,
    pub send_timeout: Duration,
    pub max_connections: usize,
    pub max_request_bytes: usize,
}

impl From<&Settings> for ConnectionLimits {
    fn from(settings: &Settings) -> Self {
        ConnectionLimits {
            idle_timeout: settings.idle_timeout,
            header_timeout: settings.header_timeout,
            body_timeout: settings.body_timeout,
            send_timeout: settings.send_timeout,
            max_connections: settings.max_connections,
            max_request_bytes: settings.max_request_bytes,
        }
    }
}

/// [`DEFAULT_MAX_CONNECTIONS`], or fewer where the open-file limit (`ulimit -n`) leaves less
/// room, so that open connections cannot take the descriptors that the server itself needs.
pub(crate) fn default_max_connections() -> usize {
    let open_files = rustix::process::getrlimit(rustix::process::Resource::Nofile).current;
    DEFAULT_MAX_CONNECTIONS.min(room_for_connections(open_files))
}

/// Connections that fit an open-file limit (`None`: unlimited) beside the reserved descriptors
/// and the lingering refusals; at least one.
fn room_for_connections(open_files: Option<u64>) -> usize {
    open_files.map_or(usize::MAX, |limit| {
        usize::try_from(limit)
            .unwrap_or(usize::MAX)
            .saturating_sub(RESERVED_DESCRIPTORS + LINGERING_REFUSALS)
            .max(1)
    })
}

/// Serves `router` on `listener` until `shutdown` resolves; then closes the listener, lets each
/// connection finish the request it is serving, and returns once all have closed.
pub(crate) async fn serve(
    listener: TcpListener,
    router: Router,
    limits: ConnectionLimits,
    shutdown: impl Future<Output = ()>,
) {
    let limits = Arc::new(limits);
    let connection_slots = Arc::new(Semaphore::new(limits.max_connections));
    let lingering_refusals = Arc::new(Semaphore::new(LINGERING_REFUSALS));
    let refusal = Bytes::from(refusal_response());
    let graceful = GracefulShutdown::new();
    tokio::pin!(shutdown);
    loop {
        let stream = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(error) => {
                    pause_after(error).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        match connection_slots.clone().try_acquire_owned() {
            Ok(slot) => {
                let connection = connection(stream, slot, &router, &limits);
                // Its errors are its client's (gone, timed out, malformed): nothing to report.
                tokio::spawn(graceful.watch(connection));
            }
            Err(_) => refuse(stream, &refusal, &lingering_refusals),
        }
    }
    drop(listener);
    graceful.shutdown().await;
}

/// A client that left before it was accepted is skipped; other errors pause accepting.
async fn pause_after(error: io::Error) {
    let clients_own = matches!(
        error.kind(),
        io::ErrorKind::ConnectionRefused
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::ConnectionReset
    );
    if !clients_own {
        tokio::time::sleep(ACCEPT_ERROR_PAUSE).await;
    }
}

type Connection = http1::Connection<TokioIo<TimedStream>, LimitedService>;

fn connection(
    stream: TcpStream,
    slot: OwnedSemaphorePermit,
    router: &Router,
    limits: &Arc<ConnectionLimits>,
) -> Connection {
    let clock = Arc::new(ConnectionClock {
        state: Mutex::new(ClockState {
            phase: Phase::Idle(Instant::now()),
            waiting_read: None,
        }),
        idle_timeout: limits.idle_timeout,
        header_timeout: limits.header_timeout,
    });
    let stream = TimedStream {
        stream,
        clock: clock.clone(),
        read_timer: None,
        send_timeout: limits.send_timeout,
        write_stalled_since: None,
        write_timer: None,
        _slot: slot,
    };
    let service = LimitedService {
        router: router.clone(),
        limits: limits.clone(),
        clock,
    };
    http1::Builder::new()
        // Off (see the module's documentation): `TimedStream` keeps the idle and head clocks.
        .header_read_timeout(None)
        .serve_connection(TokioIo::new(stream), service)
}

/// The 503 a connection past the cap gets, whole: status line, headers and error object.
fn refusal_response() -> Vec<u8> {
    let error = ApiError::unavailable("Too many connections are open: try again shortly");
    let body = error.body().to_string();
    format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n\
         content-length: {}\r\nretry-after: {REFUSAL_RETRY_AFTER}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// Answers a connection past the cap at once, without waiting for its request; then, while
/// there are places among the lingering refusals, closes it as [`linger`] does.
fn refuse(stream: TcpStream, answer: &Bytes, lingering_refusals: &Arc<Semaphore>) {
    // A new socket's empty send buffer takes the whole answer; a client gone is no matter.
    let Ok(written) = stream.try_write(answer) else {
        return;
    };
    if let Ok(slot) = lingering_refusals.clone().try_acquire_owned() {
        tokio::spawn(linger(stream, answer.slice(written..), slot));
    }
}

/// Sends the `rest` of a refusal, then discards what the client sends until it closes or
/// [`REFUSAL_LINGER`] passes. `_slot` is a place among the lingering refusals, held until then.
async fn linger(mut stream: TcpStream, rest: Bytes, _slot: OwnedSemaphorePermit) {
    let answered = async {
        stream.write_all(&rest).await?;
        stream.shutdown().await?;
        let mut discarded = [0; 4096];
        while stream.read(&mut discarded).await? > 0 {}
        io::Result::Ok(())
    };
    // A client that is gone or slow to close changes nothing: the socket closes either way.
    let _ = tokio::time::timeout(REFUSAL_LINGER, answered).await;
}

/// Where a connection stands between requests, which sets the deadline of its next read.
struct ConnectionClock {
    state: Mutex<ClockState>,
    idle_timeout: Duration,
    header_timeout: Duration,
}

struct ClockState {
    phase: Phase,
    /// A read that waited with no deadline while a request was handled, woken when the
    /// connection goes idle so that the idle clock starts: hyper reads again after a response
    /// only when data comes (or when its own header timeout is set).
    waiting_read: Option<Waker>,
}

#[derive(Debug, Clone, Copy)]
enum Phase {
    /// No request in progress, and no byte of the next one, since then.
    Idle(Instant),
    /// The next request's head has been arriving since then.
    ReadingHead(Instant),
    /// This many requests are being handled: a body has a deadline of its own, and a response
    /// takes as long as its generation does.
    Handling(usize),
}

impl ConnectionClock {
    fn state(&self) -> MutexGuard<'_, ClockState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// When a read waiting now gives up; `None` while a request is handled, until which the
    /// read's `waker` is kept.
    fn read_deadline(&self, waker: &Waker) -> Option<Instant> {
        let mut state = self.state();
        match state.phase {
            Phase::Idle(since) => Some(since + self.idle_timeout),
            Phase::ReadingHead(since) => Some(since + self.header_timeout),
            Phase::Handling(_) => {
                state.waiting_read = Some(waker.clone());
                None
            }
        }
    }

    fn bytes_arrived(&self) {
        let mut state = self.state();
        if let Phase::Idle(_) = state.phase {
            state.phase = Phase::ReadingHead(Instant::now());
        }
    }

    fn request_started(self: &Arc<Self>) -> RequestInProgress {
        let mut state = self.state();
        state.phase = match state.phase {
            Phase::Handling(requests) => Phase::Handling(requests + 1),
            Phase::Idle(_) | Phase::ReadingHead(_) => Phase::Handling(1),
        };
        RequestInProgress(self.clone())
    }
}

/// Keeps its connection handling a request until dropped, with the request's response body:
/// once sent, or abandoned.
struct RequestInProgress(Arc<ConnectionClock>);

impl Drop for RequestInProgress {
    fn drop(&mut self) {
        let mut state = self.0.state();
        if let Phase::Handling(requests @ 2..) = state.phase {
            state.phase = Phase::Handling(requests - 1);
            return;
        }
        state.phase = Phase::Idle(Instant::now());
        let waiting_read = state.waiting_read.take();
        drop(state);
        if let Some(read) = waiting_read {
            read.wake();
        }
    }
}

/// A connection's socket: a read still waiting at its clock's deadline fails, and so does a
/// write that has made no progress for `send_timeout`. It holds the connection's place under
/// the cap, given back once the socket is closed.
struct TimedStream {
    stream: TcpStream,
    clock: Arc<ConnectionClock>,
    read_timer: Option<Pin<Box<Sleep>>>,
    send_timeout: Duration,
    write_stalled_since: Option<Instant>,
    write_timer: Option<Pin<Box<Sleep>>>,
    /// Dropped after `stream`, which closes the socket.
    _slot: OwnedSemaphorePermit,
}

impl TimedStream {
    /// `attempt` at writing, failed if writes have been waiting for `send_timeout`.
    fn unless_stalled<T>(
        &mut self,
        attempt: Poll<io::Result<T>>,
        cx: &mut Context<'_>,
    ) -> Poll<io::Result<T>> {
        if attempt.is_ready() {
            self.write_stalled_since = None;
            return attempt;
        }
        let since = *self.write_stalled_since.get_or_insert_with(Instant::now);
        if passed(&mut self.write_timer, since + self.send_timeout, cx) {
            return Poll::Ready(Err(io::ErrorKind::TimedOut.into()));
        }
        Poll::Pending
    }
}

/// Whether `deadline` has passed; if not, `timer`, set to it, wakes the task when it does.
fn passed(timer: &mut Option<Pin<Box<Sleep>>>, deadline: Instant, cx: &mut Context<'_>) -> bool {
    let sleep = timer.get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
    if sleep.deadline() != deadline {
        sleep.as_mut().reset(deadline);
    }
    sleep.as_mut().poll(cx).is_ready()
}

impl AsyncRead for TimedStream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        let filled = buf.filled().len();
        match Pin::new(&mut this.stream).poll_read(cx, buf) {
            Poll::Ready(Ok(())) if buf.filled().len() > filled => {
                this.clock.bytes_arrived();
                Poll::Ready(Ok(()))
            }
            Poll::Pending => match this.clock.read_deadline(cx.waker()) {
                Some(deadline) if passed(&mut this.read_timer, deadline, cx) => {
                    Poll::Ready(Err(io::ErrorKind::TimedOut.into()))
                }
                _ => Poll::Pending,
            },
            end_or_error => end_or_error,
        }
    }
}

impl AsyncWrite for TimedStream {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let attempt = Pin::new(&mut self.stream).poll_write(cx, buf);
        self.unless_stalled(attempt, cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let attempt = Pin::new(&mut self.stream).poll_write_vectored(cx, bufs);
        self.unless_stalled(attempt, cx)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}

/// The router behind the limits on one connection's requests.
struct LimitedService {
    router: Router,
    limits: Arc<ConnectionLimits>,
    clock: Arc<ConnectionClock>,
}

impl hyper::service::Service<Request<Incoming>> for LimitedService {
    type Response = Response<TrackedBody>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Infallible>> + Send>>;

    fn call(&self, request: Request<Incoming>) -> Self::Future {
        let in_progress = self.clock.request_started();
        // hyper gives a body of declared length that length as its exact size.
        let declared = request.body().size_hint().exact();
        let path = request.uri().path().to_owned();
        if declared.is_some_and(|length| length > self.limits.max_request_bytes as u64) {
            let response = closing(ApiError::too_large(TOO_LARGE_MESSAGE), &path);
            return Box::pin(ready(Ok(tracked(response, in_progress))));
        }
        let timeout = self.limits.body_timeout;
        let timed_out = Arc::new(AtomicBool::new(false));
        let request = request.map(|body| {
            Body::new(DeadlineBody {
                body,
                deadline: Box::pin(tokio::time::sleep(timeout)),
                timeout,
                timed_out: timed_out.clone(),
            })
        });
        let router = self.router.clone();
        Box::pin(async move {
            let mut response = router.oneshot(request).await?;
            if timed_out.load(Ordering::Relaxed) {
                let error = ApiError::request_timeout(format!(
                    "The request body did not arrive within {} seconds",
                    timeout.as_secs_f64()
                ));
                response = closing(error, &path);
            }
            Ok(tracked(response, in_progress))
        })
    }
}

/// `error`'s response to a request for `path`, telling the client that the connection closes
/// after it (the request's body is left unread).
fn closing(error: ApiError, path: &str) -> Response<Body> {
    let mut response = error.into_response_for(path);
    let close = HeaderValue::from_static("close");
    response.headers_mut().insert(header::CONNECTION, close);
    response
}

/// The response, keeping its connection handling a request until its body is dropped.
fn tracked(response: Response<Body>, in_progress: RequestInProgress) -> Response<TrackedBody> {
    response.map(|body| Holding::new(body, in_progress))
}

type TrackedBody = Holding<RequestInProgress>;

/// A request body that must arrive by a deadline; past it, reading fails and `timed_out` tells
/// the service to answer 408 whatever the handler made of the failure.
struct DeadlineBody {
    body: Incoming,
    deadline: Pin<Box<Sleep>>,
    timeout: Duration,
    timed_out: Arc<AtomicBool>,
}

#[derive(Debug, thiserror::Error)]
enum RequestBodyError {
    #[error(transparent)]
    Read(#[from] hyper::Error),
    #[error("the request body did not arrive within {0:?}")]
    TimedOut(Duration),
}

impl HttpBody for DeadlineBody {
    type Data = Bytes;
    type Error = RequestBodyError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, RequestBodyError>>> {
        let this = &mut *self;
        match Pin::new(&mut this.body).poll_frame(cx) {
            Poll::Pending if this.deadline.as_mut().poll(cx).is_ready() => {
                this.timed_out.store(true, Ordering::Relaxed);
                Poll::Ready(Some(Err(RequestBodyError::TimedOut(this.timeout))))
            }
            Poll::Pending => Poll::Pending,
            Poll::Ready(frame) => Poll::Ready(frame.map(|frame| frame.map_err(Into::into))),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::room_for_connections;

    #[test]
    fn connections_leave_room_for_the_servers_own_descriptors() {
        assert_eq!(room_for_connections(Some(128)), 128 - 64 - 16);
        assert_eq!(room_for_connections(Some(1024)), 1024 - 64 - 16);
        assert_eq!(room_for_connections(Some(40)), 1);
        assert_eq!(room_for_connections(None), usize::MAX);
    }
}
