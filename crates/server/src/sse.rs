//! The SSE stream of a generation, which every API sends the same way: the events that an
//! update makes are queued, sent one by one, and the stream ends after the last. Each API says
//! only how its updates become events ([`EventSource`]).

use std::collections::VecDeque;
use std::convert::Infallible;
use std::future::Future;

use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};

/// A stream's events made but not sent yet, and whether the last of them has been made.
#[derive(Default)]
pub(crate) struct Events {
    ready: VecDeque<Event>,
    done: bool,
}

impl Events {
    pub(crate) fn push(&mut self, event: Event) {
        self.ready.push_back(event);
    }

    /// Ends the stream after the events pushed so far.
    pub(crate) fn end(&mut self) {
        self.done = true;
    }
}

/// What an API makes of its generation's updates.
pub(crate) trait EventSource: Send + 'static {
    /// Waits for the next update and pushes the events it makes (maybe none); ends `events`
    /// after the last.
    fn advance(&mut self, events: &mut Events) -> impl Future<Output = ()> + Send;
}

/// The SSE response that sends `events` (those made before the stream starts), then `source`'s,
/// and `keep_alive` while none comes.
pub(crate) fn response(
    source: impl EventSource,
    events: Events,
    keep_alive: KeepAlive,
) -> Response {
    // Dropping the stream (the client went away) drops `source`, whose `Running` cancels the
    // job.
    let stream =
        futures_util::stream::unfold((source, events), |(mut source, mut events)| async move {
            loop {
                if let Some(event) = events.ready.pop_front() {
                    return Some((Ok::<_, Infallible>(event), (source, events)));
                }
                if events.done {
                    return None;
                }
                source.advance(&mut events).await;
            }
        });
    Sse::new(stream).keep_alive(keep_alive).into_response()
}
