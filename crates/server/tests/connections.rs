//! Connection hygiene, with raw sockets against a real server and timeouts short enough for a
//! test: idle connections, heads and bodies that stop arriving and clients that stop reading are
//! closed; connections past the cap are refused until places free; a declared body over the
//! limit is refused before it is sent; keep-alive clients are served as before.

mod common;

use std::io;
use std::time::Duration;

use common::SlowPrompts;
use oxlm_runtime::LoadedModel;
use oxlm_server::{LogLevel, Server, Settings};
use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpSocket, TcpStream};
use tokio::time::{sleep, timeout, Instant};

/// Long enough not to matter in a test about another limit.
const LONG: Duration = Duration::from_secs(30);
/// The timeout a test is about.
const SHORT: Duration = Duration::from_millis(500);
/// Slack for a loaded machine, past a deadline that should have closed a connection.
const SLACK: Duration = Duration::from_millis(1500);

const HEALTH: &[u8] = b"GET /health HTTP/1.1\r\nHost: test\r\n\r\n";

fn settings() -> Settings {
    Settings {
        idle_timeout: LONG,
        header_timeout: LONG,
        body_timeout: LONG,
        send_timeout: LONG,
        log_level: LogLevel::Warning,
        ..Settings::default()
    }
}

fn model_dir() -> std::path::PathBuf {
    common::fixtures().join("tiny/llama-4bit-g64")
}

/// Serves `server` in the background; the address to connect to.
async fn listen(server: Server) -> String {
    let base = common::listen(server).await;
    base.trim_start_matches("http://").to_owned()
}

async fn serve(settings: Settings) -> String {
    listen(Server::load(&model_dir(), settings).unwrap()).await
}

fn completion_request(prompt: &str) -> Vec<u8> {
    let body = json!({"prompt": prompt, "max_tokens": 2}).to_string();
    format!(
        "POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// A response as read off the socket.
#[derive(Debug)]
struct RawResponse {
    status: u16,
    /// Names in lower case.
    headers: Vec<(String, String)>,
    body: String,
}

impl RawResponse {
    fn header(&self, name: &str) -> Option<&str> {
        let mut values = self.headers.iter().filter(|(n, _)| n == name);
        values.next().map(|(_, value)| value.as_str())
    }

    fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap()
    }
}

/// Reads one response (a body of declared length), failing past [`SLACK`].
async fn read_response(stream: &mut BufReader<TcpStream>) -> RawResponse {
    timeout(SLACK, async {
        let mut status_line = String::new();
        stream.read_line(&mut status_line).await.unwrap();
        let status = status_line
            .split(' ')
            .nth(1)
            .unwrap_or_else(|| panic!("no status line: {status_line:?}"));
        let mut headers = Vec::new();
        loop {
            let mut line = String::new();
            stream.read_line(&mut line).await.unwrap();
            let line = line.trim_end();
            if line.is_empty() {
                break;
            }
            let (name, value) = line.split_once(':').unwrap();
            headers.push((name.to_ascii_lowercase(), value.trim().to_owned()));
        }
        let mut response = RawResponse {
            status: status.parse().unwrap(),
            headers,
            body: String::new(),
        };
        let length: usize = response.header("content-length").unwrap().parse().unwrap();
        let mut body = vec![0; length];
        stream.read_exact(&mut body).await.unwrap();
        response.body = String::from_utf8(body).unwrap();
        response
    })
    .await
    .expect("no response")
}

async fn connect(address: &str) -> BufReader<TcpStream> {
    BufReader::new(TcpStream::connect(address).await.unwrap())
}

/// Reads until the server closes the connection, failing if it has not within `limit`: what
/// arrived, and when it closed.
async fn wait_for_close(
    stream: &mut (impl AsyncRead + Unpin),
    limit: Duration,
) -> (String, Instant) {
    let mut received = Vec::new();
    let closed = timeout(limit, async {
        let mut chunk = [0; 4096];
        // A reset closes it too: the server may close with bytes of ours unread.
        while let Ok(read @ 1..) = stream.read(&mut chunk).await {
            received.extend_from_slice(&chunk[..read]);
        }
    })
    .await;
    let received = String::from_utf8_lossy(&received).into_owned();
    assert!(
        closed.is_ok(),
        "still open after {limit:?}; received {received:?}"
    );
    (received, Instant::now())
}

/// Asserts that a connection closed `timeout` after `since`, give or take a loaded machine.
fn assert_closed_after(timeout: Duration, since: Instant, closed: Instant) {
    let open = closed - since;
    assert!(
        open >= timeout - Duration::from_millis(50) && open < timeout + SLACK,
        "closed after {open:?}, not {timeout:?}"
    );
}

#[tokio::test]
async fn a_head_that_stops_arriving_is_closed_after_the_header_timeout() {
    let address = serve(Settings {
        header_timeout: SHORT,
        ..settings()
    })
    .await;
    let stream = TcpStream::connect(&address).await.unwrap();
    // Waiting before the first byte is not the head's time.
    sleep(Duration::from_millis(300)).await;
    let (mut reader, mut writer) = stream.into_split();
    writer
        .write_all(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nX-Slow: ")
        .await
        .unwrap();
    let first_byte = Instant::now();
    // More of the head keeps coming, too slowly to finish.
    let trickle = tokio::spawn(async move {
        while writer.write_all(b"a").await.is_ok() {
            sleep(Duration::from_millis(100)).await;
        }
    });
    let (answer, closed) = wait_for_close(&mut reader, SHORT + SLACK).await;
    assert_eq!(answer, "");
    assert_closed_after(SHORT, first_byte, closed);
    trickle.abort();
}

#[tokio::test]
async fn connections_with_no_request_in_progress_are_closed_after_the_idle_timeout() {
    // Prompts take longer than the idle timeout: a connection waiting for its response is not
    // idle.
    let prompt_time = Duration::from_millis(800);
    let mut loaded = LoadedModel::load(&model_dir()).unwrap();
    loaded.model = Box::new(SlowPrompts {
        inner: loaded.model,
        prompt_time,
    });
    let settings = Settings {
        idle_timeout: SHORT,
        ..settings()
    };
    let address = listen(Server::new(loaded, settings).unwrap()).await;

    // A new connection that sends nothing.
    let mut silent = TcpStream::connect(&address).await.unwrap();
    let connected = Instant::now();
    let silent_closed =
        tokio::spawn(async move { wait_for_close(&mut silent, SHORT + SLACK).await });

    let mut client = connect(&address).await;
    let sent = Instant::now();
    client
        .get_mut()
        .write_all(&completion_request("Once upon a time"))
        .await
        .unwrap();
    let response = read_response(&mut client).await;
    assert_eq!(response.status, 200, "{}", response.body);
    let answered = Instant::now();
    assert!(answered - sent >= prompt_time, "{:?}", answered - sent);
    let (after_response, closed) = wait_for_close(&mut client, SHORT + SLACK).await;
    assert_eq!(after_response, "");
    assert_closed_after(SHORT, answered, closed);

    let (unasked, closed) = silent_closed.await.unwrap();
    assert_eq!(unasked, "");
    assert_closed_after(SHORT, connected, closed);
}

#[tokio::test]
async fn a_body_that_stops_arriving_is_answered_408_after_the_body_timeout() {
    let address = serve(Settings {
        body_timeout: SHORT,
        ..settings()
    })
    .await;
    let mut stream = connect(&address).await;
    stream
        .get_mut()
        .write_all(
            b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n\
              Content-Length: 100\r\n\r\n{\"prompt\": \"Once",
        )
        .await
        .unwrap();
    let head_sent = Instant::now();
    let response = read_response(&mut stream).await;
    assert_closed_after(SHORT, head_sent, Instant::now());
    assert_eq!(response.status, 408);
    assert_eq!(response.header("connection"), Some("close"));
    let error = json!({"error": {"message": "The request body did not arrive within 0.5 seconds",
                                 "type": "invalid_request_error", "param": null, "code": null}});
    assert_eq!(response.json(), error);
    let (rest, _) = wait_for_close(&mut stream, SLACK).await;
    assert_eq!(rest, "");
}

#[tokio::test]
async fn a_client_that_stops_reading_is_closed_after_the_send_timeout() {
    let address = serve(Settings {
        send_timeout: SHORT,
        ..settings()
    })
    .await;
    let socket = TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    let mut stream = socket.connect(address.parse().unwrap()).await.unwrap();
    // Requests sent on and on, their responses never read: once those fill the socket's
    // buffers, the server's writes wait, then it stops reading, then these writes wait too.
    let requests = HEALTH.repeat(1000);
    let start = Instant::now();
    let writing = async {
        loop {
            if let Err(error) = stream.write_all(&requests).await {
                return error;
            }
        }
    };
    let error: io::Error = timeout(SHORT + SLACK, writing)
        .await
        .expect("the server still holds a client that reads nothing");
    assert_closed_after(SHORT, start, Instant::now());
    assert!(
        matches!(
            error.kind(),
            io::ErrorKind::ConnectionReset | io::ErrorKind::BrokenPipe
        ),
        "{error}"
    );
}

#[tokio::test]
async fn connections_past_the_cap_are_refused_until_idle_ones_close() {
    let address = serve(Settings {
        max_connections: 3,
        idle_timeout: Duration::from_secs(1),
        ..settings()
    })
    .await;
    let mut idle = Vec::new();
    for _ in 0..3 {
        idle.push(TcpStream::connect(&address).await.unwrap());
    }
    let opened = Instant::now();

    let mut extra = connect(&address).await;
    extra.get_mut().write_all(HEALTH).await.unwrap();
    let response = read_response(&mut extra).await;
    assert_eq!(response.status, 503);
    assert_eq!(response.header("retry-after"), Some("1"));
    assert_eq!(response.header("connection"), Some("close"));
    let error = json!({"error": {"message": "Too many connections are open: try again shortly",
                                 "type": "server_error", "param": null, "code": null}});
    assert_eq!(response.json(), error);
    let (rest, _) = wait_for_close(&mut extra, SLACK).await;
    assert_eq!(rest, "");
    // Refused while the others were open, not once they had closed.
    assert!(opened.elapsed() < Duration::from_secs(1));

    for stream in &mut idle {
        wait_for_close(stream, Duration::from_secs(1) + SLACK).await;
    }
    let mut client = connect(&address).await;
    client.get_mut().write_all(HEALTH).await.unwrap();
    let response = read_response(&mut client).await;
    assert_eq!(response.status, 200, "{}", response.body);
}

#[tokio::test]
async fn a_declared_body_over_the_limit_is_refused_before_it_is_sent() {
    let limit = 1000;
    // The body timeout is long: a 413 that waited for the body would not come in time.
    let address = serve(Settings {
        max_request_bytes: limit,
        ..settings()
    })
    .await;
    let head = |length: &str| {
        format!(
            "POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n\
             {length}\r\n\r\n"
        )
    };

    let mut stream = connect(&address).await;
    let over = head(&format!("Content-Length: {}", limit + 1));
    stream.get_mut().write_all(over.as_bytes()).await.unwrap();
    let early = read_response(&mut stream).await;
    assert_eq!(early.status, 413);
    assert_eq!(early.header("connection"), Some("close"));
    let error = json!({"error": {"message": "The request body is larger than the server accepts",
                                 "type": "invalid_request_error", "param": null, "code": null}});
    assert_eq!(early.json(), error);
    wait_for_close(&mut stream, SLACK).await;

    // The same answer as the router's own to a body over the limit that declares no length,
    // which it reads up to the limit.
    let mut stream = connect(&address).await;
    let chunked = head("Transfer-Encoding: chunked");
    let chunk = "x".repeat(limit + 1);
    let request = format!("{chunked}{:x}\r\n{chunk}\r\n0\r\n\r\n", chunk.len());
    stream
        .get_mut()
        .write_all(request.as_bytes())
        .await
        .unwrap();
    let late = read_response(&mut stream).await;
    assert_eq!(late.status, 413);
    assert_eq!(late.body, early.body);

    // A declared length at the limit is read and served.
    let mut stream = connect(&address).await;
    let body = json!({"prompt": "Once upon a time", "max_tokens": 1}).to_string();
    let body = format!("{body:<limit$}");
    let request = format!("{}{body}", head(&format!("Content-Length: {limit}")));
    stream
        .get_mut()
        .write_all(request.as_bytes())
        .await
        .unwrap();
    let served = read_response(&mut stream).await;
    assert_eq!(served.status, 200, "{}", served.body);
}

#[tokio::test]
async fn a_keep_alive_client_is_served_request_after_request() {
    let idle_timeout = Duration::from_secs(1);
    let address = serve(Settings {
        idle_timeout,
        ..settings()
    })
    .await;
    let mut stream = connect(&address).await;
    let requests = [
        HEALTH.to_vec(),
        b"GET /v1/models HTTP/1.1\r\nHost: test\r\n\r\n".to_vec(),
        completion_request("Once upon a time"),
    ];
    let start = Instant::now();
    for (i, request) in requests.iter().enumerate() {
        // Pauses within the idle timeout, longer than it together: each request restarts it.
        if i > 0 {
            sleep(Duration::from_millis(700)).await;
        }
        stream.get_mut().write_all(request).await.unwrap();
        let response = read_response(&mut stream).await;
        assert_eq!(response.status, 200, "{}", response.body);
        assert_eq!(response.header("connection"), None);
    }
    assert!(start.elapsed() > idle_timeout);
    // Pipelined: two requests in one write, two responses in order.
    stream.get_mut().write_all(&HEALTH.repeat(2)).await.unwrap();
    for _ in 0..2 {
        let response = read_response(&mut stream).await;
        assert_eq!(response.status, 200, "{}", response.body);
    }
}
