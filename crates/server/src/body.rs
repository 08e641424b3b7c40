//! A response body that holds something until it is dropped (sent whole, or abandoned), keeping
//! the body's own size (and so its `Content-Length`): a request's log line, or a connection's
//! mark of a request in progress.

use std::pin::Pin;
use std::task::{Context, Poll};

use axum::body::{Body, Bytes};
use http_body::{Body as HttpBody, Frame, SizeHint};

pub(crate) struct Holding<T> {
    body: Body,
    _held: T,
}

impl<T> Holding<T> {
    pub(crate) fn new(body: Body, held: T) -> Self {
        Holding { body, _held: held }
    }
}

impl<T: Unpin> HttpBody for Holding<T> {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}
