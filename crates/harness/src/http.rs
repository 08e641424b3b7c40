//! A small HTTP/1.1 client over `TcpStream`. Requests are raw bytes, since the fuzzer sends what
//! no client library would; responses are read strictly (status line, headers, then the body by
//! `Content-Length`, chunks or the connection's end), so that a framing mistake of the server is
//! seen rather than smoothed over.

use std::io::{self, BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use serde_json::Value;

/// Most bytes of a response head; a longer one is malformed.
const MAX_HEAD_BYTES: usize = 64 << 10;

/// Why a response could not be read.
#[derive(Debug)]
pub enum ReadError {
    /// The deadline passed first.
    Timeout,
    /// The connection ended (closed or reset). `mid_response`: after part of a response came.
    Closed { mid_response: bool },
    /// What came is not HTTP/1.1.
    Malformed(String),
}

impl std::fmt::Display for ReadError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ReadError::Timeout => write!(f, "no complete response before the deadline"),
            ReadError::Closed {
                mid_response: false,
            } => write!(f, "connection closed without a response"),
            ReadError::Closed { mid_response: true } => {
                write!(f, "connection closed in the middle of a response")
            }
            ReadError::Malformed(why) => write!(f, "malformed response: {why}"),
        }
    }
}

/// One connection, with a deadline for everything read or written on it.
pub struct Connection {
    reader: BufReader<TcpStream>,
    deadline: Instant,
}

impl Connection {
    pub fn open(address: SocketAddr, timeout: Duration) -> io::Result<Connection> {
        let stream = TcpStream::connect_timeout(&address, timeout)?;
        stream.set_nodelay(true)?;
        Ok(Connection {
            reader: BufReader::new(stream),
            deadline: Instant::now() + timeout,
        })
    }

    /// Moves the deadline to `timeout` from now.
    pub fn set_timeout(&mut self, timeout: Duration) {
        self.deadline = Instant::now() + timeout;
    }

    /// The socket, for a caller that reads and writes it directly from here on.
    pub fn into_stream(self) -> TcpStream {
        self.reader.into_inner()
    }

    pub fn send(&mut self, bytes: &[u8]) -> io::Result<()> {
        let left = self.left().ok_or(io::ErrorKind::TimedOut)?;
        let stream = self.reader.get_mut();
        stream.set_write_timeout(Some(left))?;
        stream.write_all(bytes)?;
        stream.flush()
    }

    fn left(&self) -> Option<Duration> {
        Some(self.deadline.checked_duration_since(Instant::now())?).filter(|d| !d.is_zero())
    }

    /// The buffered bytes, reading more when none are; empty at the connection's end.
    fn fill(&mut self, mid_response: bool) -> Result<&[u8], ReadError> {
        let left = self.left().ok_or(ReadError::Timeout)?;
        let _ = self.reader.get_ref().set_read_timeout(Some(left));
        match self.reader.fill_buf() {
            Ok(bytes) => Ok(bytes),
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                Err(ReadError::Timeout)
            }
            Err(_) => Err(ReadError::Closed { mid_response }),
        }
    }

    /// One line through its `\n`, or up to `limit` bytes.
    fn read_line(&mut self, limit: usize, mid_response: bool) -> Result<Vec<u8>, ReadError> {
        let mut line = Vec::new();
        loop {
            let buffer = self.fill(mid_response || !line.is_empty())?;
            if buffer.is_empty() {
                return Err(ReadError::Closed {
                    mid_response: mid_response || !line.is_empty(),
                });
            }
            let (taken, done) = match buffer.iter().position(|&b| b == b'\n') {
                Some(i) => (i + 1, true),
                None => (buffer.len(), false),
            };
            line.extend_from_slice(&buffer[..taken]);
            self.reader.consume(taken);
            if done {
                return Ok(line);
            }
            if line.len() > limit {
                return Err(ReadError::Malformed(format!("a line over {limit} bytes")));
            }
        }
    }

    fn read_exact(&mut self, mut count: usize) -> Result<Vec<u8>, ReadError> {
        let mut bytes = Vec::with_capacity(count);
        while count > 0 {
            let buffer = self.fill(true)?;
            if buffer.is_empty() {
                return Err(ReadError::Closed { mid_response: true });
            }
            let taken = buffer.len().min(count);
            bytes.extend_from_slice(&buffer[..taken]);
            self.reader.consume(taken);
            count -= taken;
        }
        Ok(bytes)
    }

    /// The next final response's head (a `100 Continue` before it is skipped).
    pub fn read_head(&mut self) -> Result<Head, ReadError> {
        loop {
            let head = self.read_one_head()?;
            if head.status != 100 {
                return Ok(head);
            }
        }
    }

    fn read_one_head(&mut self) -> Result<Head, ReadError> {
        let mut bytes = Vec::new();
        loop {
            let line = self.read_line(MAX_HEAD_BYTES, !bytes.is_empty())?;
            bytes.extend_from_slice(&line);
            if line == b"\r\n" || line == b"\n" {
                break;
            }
            if bytes.len() > MAX_HEAD_BYTES {
                return Err(ReadError::Malformed("a head over 64 KiB".into()));
            }
        }
        let mut headers = [httparse::EMPTY_HEADER; 64];
        let mut response = httparse::Response::new(&mut headers);
        match response.parse(&bytes) {
            Ok(httparse::Status::Complete(_)) => {}
            Ok(httparse::Status::Partial) => {
                return Err(ReadError::Malformed("an incomplete head".into()))
            }
            Err(e) => return Err(ReadError::Malformed(format!("head: {e}"))),
        }
        if response.version != Some(1) {
            return Err(ReadError::Malformed("not an HTTP/1.1 response".into()));
        }
        let headers = response
            .headers
            .iter()
            .map(|h| {
                let value = String::from_utf8(h.value.to_vec())
                    .map_err(|_| ReadError::Malformed(format!("header {} is not UTF-8", h.name)))?;
                Ok((h.name.to_ascii_lowercase(), value))
            })
            .collect::<Result<_, ReadError>>()?;
        Ok(Head {
            status: response.code.unwrap_or(0),
            headers,
        })
    }

    /// The body that follows `head`; `to_head_request`: the response to a HEAD, which has none.
    pub fn body(&mut self, head: &Head, to_head_request: bool) -> Result<Body<'_>, ReadError> {
        let framing = if to_head_request || head.status == 204 || head.status == 304 {
            Framing::Length(0)
        } else if let Some(coding) = head.header("transfer-encoding") {
            if !coding.eq_ignore_ascii_case("chunked") {
                return Err(ReadError::Malformed(format!("transfer-encoding {coding}")));
            }
            Framing::Chunked { left: 0 }
        } else if let Some(length) = head.header("content-length") {
            let length = length
                .parse()
                .map_err(|_| ReadError::Malformed(format!("content-length {length}")))?;
            Framing::Length(length)
        } else {
            Framing::UntilClose
        };
        Ok(Body {
            connection: self,
            framing,
            done: false,
        })
    }

    /// Reads a whole response.
    pub fn read_response(&mut self, to_head_request: bool) -> Result<Response, ReadError> {
        let head = self.read_head()?;
        let body = self.body(&head, to_head_request)?.read_to_end()?;
        Ok(Response { head, body })
    }
}

#[derive(Debug, Clone)]
pub struct Head {
    pub status: u16,
    /// Names in lowercase.
    pub headers: Vec<(String, String)>,
}

impl Head {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    pub fn is_event_stream(&self) -> bool {
        self.header("content-type")
            .is_some_and(|t| t.starts_with("text/event-stream"))
    }

    /// Whether the server will close the connection after this response.
    pub fn closes(&self) -> bool {
        self.header("connection")
            .is_some_and(|c| c.eq_ignore_ascii_case("close"))
    }
}

#[derive(Debug, Clone)]
pub struct Response {
    pub head: Head,
    pub body: Vec<u8>,
}

impl Response {
    pub fn status(&self) -> u16 {
        self.head.status
    }

    pub fn json(&self) -> Option<Value> {
        serde_json::from_slice(&self.body).ok()
    }
}

enum Framing {
    Length(u64),
    /// `left`: bytes of the current chunk not yet read.
    Chunked {
        left: u64,
    },
    UntilClose,
}

/// A response body, read piece by piece (a stream) or whole.
pub struct Body<'a> {
    connection: &'a mut Connection,
    framing: Framing,
    done: bool,
}

impl Body<'_> {
    /// The next bytes of the body; `None` at its end.
    pub fn next_piece(&mut self) -> Result<Option<Vec<u8>>, ReadError> {
        if self.done {
            return Ok(None);
        }
        let connection = &mut *self.connection;
        let piece = match &mut self.framing {
            Framing::Length(0) => None,
            Framing::Length(left) => {
                let buffer = connection.fill(true)?;
                if buffer.is_empty() {
                    return Err(ReadError::Closed { mid_response: true });
                }
                let taken = buffer
                    .len()
                    .min(usize::try_from(*left).unwrap_or(usize::MAX));
                let piece = buffer[..taken].to_vec();
                connection.reader.consume(taken);
                *left -= taken as u64;
                Some(piece)
            }
            Framing::Chunked { left } => {
                if *left == 0 {
                    let size = read_chunk_size(connection)?;
                    if size == 0 {
                        // Trailers, then the empty line.
                        while connection.read_line(MAX_HEAD_BYTES, true)? != b"\r\n" {}
                        self.done = true;
                        return Ok(None);
                    }
                    *left = size;
                }
                let count = usize::try_from(*left).unwrap_or(usize::MAX).min(1 << 20);
                let piece = connection.read_exact(count)?;
                *left -= count as u64;
                if *left == 0 && connection.read_exact(2)? != b"\r\n" {
                    return Err(ReadError::Malformed("a chunk not ended by CRLF".into()));
                }
                Some(piece)
            }
            Framing::UntilClose => {
                let buffer = connection.fill(true)?;
                let piece = buffer.to_vec();
                connection.reader.consume(piece.len());
                Some(piece).filter(|p| !p.is_empty())
            }
        };
        if piece.is_none() {
            self.done = true;
        }
        Ok(piece)
    }

    pub fn read_to_end(mut self) -> Result<Vec<u8>, ReadError> {
        let mut body = Vec::new();
        while let Some(piece) = self.next_piece()? {
            body.extend_from_slice(&piece);
        }
        Ok(body)
    }
}

fn read_chunk_size(connection: &mut Connection) -> Result<u64, ReadError> {
    let line = connection.read_line(1024, true)?;
    let text = std::str::from_utf8(&line)
        .ok()
        .and_then(|l| l.strip_suffix("\r\n"))
        .ok_or_else(|| ReadError::Malformed("a chunk size line".into()))?;
    let digits = text.split(';').next().unwrap_or("").trim();
    u64::from_str_radix(digits, 16)
        .map_err(|_| ReadError::Malformed(format!("chunk size {digits:?}")))
}

/// One event of a server-sent event stream.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// The `data:` lines, joined.
    Data(String),
    /// Only comments (`: keepalive`) or fields other than data.
    Comment,
}

/// Reads a body as a server-sent event stream.
pub struct Events<'a> {
    body: Body<'a>,
    buffer: Vec<u8>,
}

impl<'a> Events<'a> {
    pub fn new(body: Body<'a>) -> Self {
        Events {
            body,
            buffer: Vec::new(),
        }
    }

    /// The next event; `None` at the body's end.
    pub fn next_event(&mut self) -> Result<Option<Event>, ReadError> {
        loop {
            if let Some(end) = find(&self.buffer, b"\n\n") {
                let raw: Vec<u8> = self.buffer.drain(..end + 2).collect();
                return parse_event(&raw[..end]).map(Some);
            }
            match self.body.next_piece()? {
                Some(piece) => self.buffer.extend_from_slice(&piece),
                None if self.buffer.is_empty() => return Ok(None),
                None => {
                    return Err(ReadError::Malformed(
                        "the stream ended in the middle of an event".into(),
                    ))
                }
            }
        }
    }
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

fn parse_event(raw: &[u8]) -> Result<Event, ReadError> {
    let event = parse_named_event(raw)?;
    Ok(event.data.map_or(Event::Comment, Event::Data))
}

/// An event's `event:` name and its `data:` lines, joined.
struct NamedEvent {
    name: Option<String>,
    data: Option<String>,
}

fn parse_named_event(raw: &[u8]) -> Result<NamedEvent, ReadError> {
    let text = std::str::from_utf8(raw)
        .map_err(|_| ReadError::Malformed("an event that is not UTF-8".into()))?;
    let mut name: Option<String> = None;
    let mut data: Option<String> = None;
    for line in text.split('\n') {
        if line.starts_with(':') {
            continue;
        }
        let (field, value) = line.split_once(':').unwrap_or((line, ""));
        let value = value.strip_prefix(' ').unwrap_or(value);
        match field {
            "data" => match &mut data {
                Some(data) => {
                    data.push('\n');
                    data.push_str(value);
                }
                None => data = Some(value.to_owned()),
            },
            "event" => name = Some(value.to_owned()),
            "id" | "retry" => {}
            _ => return Err(ReadError::Malformed(format!("event line {line:?}"))),
        }
    }
    Ok(NamedEvent { name, data })
}

/// The data events of a whole event-stream body, each with its `event:` name when it has one;
/// comments are left out.
pub fn data_events(body: &[u8]) -> Result<Vec<(Option<String>, String)>, ReadError> {
    if !body.is_empty() && !body.ends_with(b"\n\n") {
        return Err(ReadError::Malformed(
            "the stream ended in the middle of an event".into(),
        ));
    }
    let mut events = Vec::new();
    let mut rest = body;
    while let Some(end) = find(rest, b"\n\n") {
        let event = parse_named_event(&rest[..end])?;
        if let Some(data) = event.data {
            events.push((event.name, data));
        }
        rest = &rest[end + 2..];
    }
    Ok(events)
}

/// A request's bytes: the request line, `Host`, the given headers, `Content-Length` when there
/// is a body, and `Connection: close` unless `keep_alive`.
pub fn request(
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
    keep_alive: bool,
) -> Vec<u8> {
    let mut bytes = format!("{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n").into_bytes();
    for (name, value) in headers {
        bytes.extend_from_slice(format!("{name}: {value}\r\n").as_bytes());
    }
    if !body.is_empty() || method == "POST" {
        bytes.extend_from_slice(format!("Content-Length: {}\r\n", body.len()).as_bytes());
    }
    if !keep_alive {
        bytes.extend_from_slice(b"Connection: close\r\n");
    }
    bytes.extend_from_slice(b"\r\n");
    bytes.extend_from_slice(body);
    bytes
}

/// A JSON `POST`.
pub fn post_json(path: &str, body: &Value, keep_alive: bool) -> Vec<u8> {
    let headers = [("Content-Type", "application/json")];
    request(
        "POST",
        path,
        &headers,
        body.to_string().as_bytes(),
        keep_alive,
    )
}

/// Sends `bytes` on a new connection and reads one response, all within `timeout`.
pub fn exchange(
    address: SocketAddr,
    bytes: &[u8],
    timeout: Duration,
) -> Result<Response, ReadError> {
    let mut connection = Connection::open(address, timeout).map_err(|_| ReadError::Closed {
        mid_response: false,
    })?;
    // The server may answer (413, 400) and close before it has read everything: its answer
    // still counts, so a failed write is not yet a failure.
    let _ = connection.send(bytes);
    connection.read_response(bytes.starts_with(b"HEAD "))
}

/// Printable bytes: ASCII as is (newlines escaped), the rest as `\xNN`, cut to `limit`.
pub fn escape(bytes: &[u8], limit: usize) -> String {
    let mut text: String = bytes
        .iter()
        .take(limit)
        .flat_map(|&b| std::ascii::escape_default(b))
        .map(char::from)
        .collect();
    if bytes.len() > limit {
        text.push_str(&format!("… ({} bytes)", bytes.len()));
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    /// A one-shot server that writes `reply` to its first connection.
    fn serve(reply: &'static [u8]) -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let address = listener.local_addr().unwrap();
        std::thread::spawn(move || {
            let (mut stream, _) = listener.accept().unwrap();
            stream.write_all(reply).unwrap();
        });
        address
    }

    #[test]
    fn chunked_event_streams_are_decoded() {
        let address = serve(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\
              transfer-encoding: chunked\r\n\r\n\
              d\r\n: keepalive\n\n\r\n\
              a\r\ndata: {}\n\n\r\n\
              e\r\ndata: [DONE]\n\n\r\n\
              0\r\n\r\n",
        );
        let mut connection = Connection::open(address, Duration::from_secs(5)).unwrap();
        connection.send(b"GET / HTTP/1.1\r\n\r\n").unwrap();
        let head = connection.read_head().unwrap();
        assert!(head.is_event_stream());
        let mut events = Events::new(connection.body(&head, false).unwrap());
        assert_eq!(events.next_event().unwrap(), Some(Event::Comment));
        assert_eq!(events.next_event().unwrap(), Some(Event::Data("{}".into())));
        assert_eq!(
            events.next_event().unwrap(),
            Some(Event::Data("[DONE]".into()))
        );
        assert_eq!(events.next_event().unwrap(), None);
    }

    #[test]
    fn a_body_cut_short_is_a_closed_connection() {
        let address = serve(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\n12345");
        let result = exchange(address, b"GET / HTTP/1.1\r\n\r\n", Duration::from_secs(5));
        assert!(matches!(
            result,
            Err(ReadError::Closed { mid_response: true })
        ));
    }

    #[test]
    fn requests_carry_their_length() {
        let bytes = request("POST", "/x", &[("A", "b")], b"{}", false);
        assert_eq!(
            bytes,
            b"POST /x HTTP/1.1\r\nHost: 127.0.0.1\r\nA: b\r\nContent-Length: 2\r\n\
              Connection: close\r\n\r\n{}"
        );
    }
}
