//! `load`: many concurrent clients against one `oxlm serve` for a while, over the OpenAI,
//! Anthropic and Responses APIs (a Responses client going on from its last stored answer, or
//! reading it back), streaming and not, some leaving mid-stream or before their answer, with
//! every completed answer checked and the
//! server's resident memory sampled each second. Fails on any malformed answer, any status other
//! than 200, a hang, a dead server, or memory that grows past a bound after the warm-up.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use anyhow::Result;
use rand::rngs::StdRng;
use rand::seq::IndexedRandom;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};

use crate::http::{self, Connection, Event, Events, Head, ReadError};
use crate::openai::{self, Endpoint, StreamCheck, StreamEnd};
use crate::report::Tally;
use crate::server::{self, rss_kib, Served};

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    served: Served,
    /// Concurrent clients.
    #[arg(long, default_value_t = 64)]
    clients: usize,
    /// How long the clients keep sending.
    #[arg(long, default_value_t = 20)]
    seconds: u64,
    /// Seconds before memory counts (default: a quarter of the run, at most 60).
    #[arg(long)]
    warmup_seconds: Option<u64>,
    /// Most the resident memory may grow from the warm-up's end to the run's end, in MiB.
    #[arg(long, default_value_t = 32)]
    max_rss_growth_mib: u64,
    /// Share of streamed requests a client leaves after a few events.
    #[arg(long, default_value_t = 0.2)]
    disconnect_share: f64,
    /// Seed of the clients' requests and of when they leave.
    #[arg(long, default_value_t = 1)]
    seed: u64,
}

/// How long one answer may take, queued behind the other clients' included.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(120);

pub fn run(args: Args) -> Result<bool> {
    // A Responses store small enough to fill during the warm-up: what it keeps is memory the
    // server means to hold, and its evictions are part of the run (a client chaining from an
    // answer it let go of gets a 404).
    let serve = args.served.command(&[
        "--log-level",
        "warning",
        "--response-store-size",
        "200",
        "--response-store-bytes",
        "4M",
    ]);
    let server = serve.start()?;
    let address = server.address;
    let pid = server.pid();
    let monitors: Vec<&'static str> = ["/metrics", "/stats"]
        .into_iter()
        .filter(|path| {
            let request = http::request("GET", path, &[], b"", false);
            http::exchange(address, &request, Duration::from_secs(10))
                .is_ok_and(|r| r.status() == 200)
        })
        .collect();
    let tally = Arc::new(Mutex::new(Tally::default()));
    let run_time = Duration::from_secs(args.seconds);
    let warmup = Duration::from_secs(args.warmup_seconds.unwrap_or((args.seconds / 4).min(60)));
    let started = Instant::now();
    let stop = Arc::new(AtomicBool::new(false));

    let sampler = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut samples: Vec<(Duration, u64)> = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                if let Some(kib) = rss_kib(pid) {
                    samples.push((started.elapsed(), kib));
                }
                std::thread::sleep(Duration::from_secs(1));
            }
            samples
        })
    };
    let clients: Vec<_> = (0..args.clients)
        .map(|index| {
            let tally = tally.clone();
            let rng =
                StdRng::seed_from_u64(args.seed.wrapping_mul(1_000_003).wrapping_add(index as u64));
            let client = Client {
                address,
                rng,
                // Half the clients keep their connection between requests, as SDKs do.
                keep_alive: index % 2 == 0,
                connection: None,
                disconnect_share: args.disconnect_share,
                monitors: monitors.clone(),
                stored: None,
            };
            std::thread::spawn(move || client.run(started + run_time, &tally))
        })
        .collect();
    for client in clients {
        let _ = client.join();
    }
    let elapsed = started.elapsed();
    stop.store(true, Ordering::Relaxed);
    let samples = sampler.join().unwrap_or_default();

    let mut tally = Arc::try_unwrap(tally)
        .map_err(|_| anyhow::anyhow!("a client is still running"))?
        .into_inner()
        .unwrap_or_else(PoisonError::into_inner);
    // Once the clients are gone, nothing they left behind slows a new request.
    if let Err(why) = server::probe(address, Duration::from_secs(30)) {
        tally.fail(
            "final",
            "final-check",
            format!("a request after the load: {why}"),
        );
    }
    for problem in server.stop(Duration::from_secs(15)) {
        tally.fail("final", "final-check", problem);
    }
    let memory = Memory::from_samples(&samples, warmup);
    let growth_bound = args.max_rss_growth_mib as f64;
    if memory.growth_mib() > growth_bound {
        tally.fail(
            "memory",
            "rss-growth",
            format!(
                "RSS grew {:.1} MiB after the warm-up (bound {growth_bound} MiB)",
                memory.growth_mib()
            ),
        );
    }

    tally.print();
    println!("RSS over the run: {}", rss_timeline(&samples));
    let requests: u64 = ["ok", "left-mid-stream", "left-early", "expired"]
        .iter()
        .map(|o| tally.total(o))
        .sum();
    let failures = tally.failures();
    println!(
        "load: {} clients × {} s: {} requests ({:.1}/s; {} streams, {} left mid-stream, {} left \
         before the answer), {} malformed, {} 5xx, {} other statuses, {} hangs, {} dropped; RSS \
         {:.1} MiB at warm-up end ({} s), {:.1} MiB at the end ({:+.1} MiB, bound {} MiB), peak \
         {:.1} MiB; {}",
        args.clients,
        args.seconds,
        requests,
        requests as f64 / elapsed.as_secs_f64(),
        [
            "chat-stream",
            "completion-stream",
            "messages-stream",
            "responses-stream"
        ]
        .iter()
        .map(|kind| tally.kind_total(kind))
        .sum::<u64>(),
        tally.total("left-mid-stream"),
        tally.total("left-early"),
        tally.total("malformed"),
        tally.total("5xx"),
        tally.total("status"),
        tally.total("hang"),
        tally.total("dropped"),
        memory.warm_mib,
        warmup.as_secs(),
        memory.end_mib,
        memory.growth_mib(),
        args.max_rss_growth_mib,
        memory.peak_mib,
        if failures == 0 { "PASS" } else { "FAIL" },
    );
    Ok(failures == 0)
}

/// Resident memory at the warm-up's end, at the end, and at its peak, in MiB.
struct Memory {
    warm_mib: f64,
    end_mib: f64,
    peak_mib: f64,
}

impl Memory {
    fn from_samples(samples: &[(Duration, u64)], warmup: Duration) -> Memory {
        let mib = |kib: u64| kib as f64 / 1024.0;
        let warm = samples
            .iter()
            .take_while(|(at, _)| *at <= warmup)
            .last()
            .or(samples.first());
        Memory {
            warm_mib: warm.map_or(0.0, |s| mib(s.1)),
            end_mib: samples.last().map_or(0.0, |s| mib(s.1)),
            peak_mib: mib(samples.iter().map(|s| s.1).max().unwrap_or(0)),
        }
    }

    fn growth_mib(&self) -> f64 {
        self.end_mib - self.warm_mib
    }
}

/// About ten samples spread over the run, `MiB@seconds`, to show the memory's course.
fn rss_timeline(samples: &[(Duration, u64)]) -> String {
    let step = (samples.len() / 10).max(1);
    let mut shown: Vec<&(Duration, u64)> = samples.iter().step_by(step).collect();
    if let Some(last) = samples
        .last()
        .filter(|_| !(samples.len() - 1).is_multiple_of(step))
    {
        shown.push(last);
    }
    shown
        .iter()
        .map(|(at, kib)| format!("{:.1}@{}s", *kib as f64 / 1024.0, at.as_secs()))
        .collect::<Vec<_>>()
        .join(" ")
}

/// What a client asks for.
#[derive(Clone, Copy)]
enum Action {
    Chat {
        stream: bool,
    },
    Completion {
        stream: bool,
    },
    /// Anthropic's `/v1/messages`.
    Messages {
        stream: bool,
    },
    /// `POST /v1/responses`, going on from the client's last stored answer now and then.
    Responses {
        stream: bool,
    },
    /// `GET /v1/responses/{id}` of the client's last stored answer.
    StoredResponse,
    Models,
    Health,
    /// `/metrics` or `/stats`, as a monitor scrapes them.
    Monitor,
}

impl Action {
    fn name(self) -> &'static str {
        match self {
            Action::Chat { stream: false } => "chat",
            Action::Chat { stream: true } => "chat-stream",
            Action::Completion { stream: false } => "completion",
            Action::Completion { stream: true } => "completion-stream",
            Action::Messages { stream: false } => "messages",
            Action::Messages { stream: true } => "messages-stream",
            Action::Responses { stream: false } => "responses",
            Action::Responses { stream: true } => "responses-stream",
            Action::StoredResponse => "stored-response",
            Action::Models => "models",
            Action::Health => "health",
            Action::Monitor => "metrics-stats",
        }
    }
}

struct Client {
    address: SocketAddr,
    rng: StdRng,
    keep_alive: bool,
    connection: Option<Connection>,
    disconnect_share: f64,
    /// The monitoring endpoints this server has.
    monitors: Vec<&'static str>,
    /// The id of the last answer the Responses API stored for this client.
    stored: Option<String>,
}

/// A request's end that passes, or a failure and why.
type Outcome = Result<&'static str, (&'static str, String)>;

impl Client {
    fn run(mut self, deadline: Instant, tally: &Mutex<Tally>) {
        while Instant::now() < deadline {
            let action = *[
                Action::Chat { stream: false },
                Action::Chat { stream: true },
                Action::Chat { stream: true },
                Action::Completion { stream: false },
                Action::Completion { stream: true },
                Action::Messages { stream: false },
                Action::Messages { stream: true },
                Action::Responses { stream: false },
                Action::Responses { stream: true },
                Action::StoredResponse,
                Action::Models,
                Action::Health,
                Action::Monitor,
            ]
            .choose(&mut self.rng)
            .expect("not empty");
            let outcome = self.send(action);
            let mut tally = tally.lock().unwrap_or_else(PoisonError::into_inner);
            match outcome {
                Ok(outcome) => tally.count(action.name(), outcome),
                Err((outcome, why)) => {
                    tally.fail(action.name(), outcome, format!("{}: {why}", action.name()))
                }
            }
        }
    }

    fn send(&mut self, action: Action) -> Outcome {
        let stored_path;
        let (path, body, stream) = match action {
            Action::Chat { stream } => {
                ("/v1/chat/completions", Some(self.chat_body(stream)), stream)
            }
            Action::Completion { stream } => (
                "/v1/completions",
                Some(self.completion_body(stream)),
                stream,
            ),
            Action::Messages { stream } => {
                ("/v1/messages", Some(self.messages_body(stream)), stream)
            }
            Action::Responses { stream } => {
                ("/v1/responses", Some(self.responses_body(stream)), stream)
            }
            Action::StoredResponse => match &self.stored {
                Some(id) => {
                    stored_path = format!("/v1/responses/{id}");
                    (stored_path.as_str(), None, false)
                }
                None => ("/v1/models", None, false),
            },
            Action::Models => ("/v1/models", None, false),
            Action::Health => ("/health", None, false),
            Action::Monitor => match self.monitors.choose(&mut self.rng) {
                Some(path) => (*path, None, false),
                None => ("/health", None, false),
            },
        };
        let endpoint = Endpoint::of_path(path);
        let bytes = match &body {
            Some(body) => http::post_json(path, body, self.keep_alive),
            None => http::request("GET", path, &[], b"", self.keep_alive),
        };
        if body.is_some() && !stream && self.rng.random_bool(0.05) {
            return self.leave_early(&bytes);
        }
        // The store is bounded: an answer it has let go of is a 404, in the API's shape.
        let chained = endpoint == Endpoint::StoredResponse
            || body
                .as_ref()
                .is_some_and(|b| b.get("previous_response_id").is_some());
        let (mut connection, head) = self.send_for_head(&bytes)?;
        if head.status >= 500 {
            return Err(("5xx", format!("status {}", head.status)));
        }
        if chained && head.status == 404 {
            let body = connection
                .body(&head, false)
                .and_then(|b| b.read_to_end())
                .map_err(read_failure)?;
            let response = http::Response { head, body };
            openai::check_response(endpoint, &response, false).map_err(|why| ("malformed", why))?;
            self.stored = None;
            return Ok("expired");
        }
        if stream {
            return self.read_stream(connection, head, endpoint);
        }
        let body = connection
            .body(&head, false)
            .and_then(|b| b.read_to_end())
            .map_err(read_failure)?;
        let response = http::Response { head, body };
        if response.status() != 200 {
            return Err((
                "status",
                format!(
                    "{} {}",
                    response.status(),
                    http::escape(&response.body, 300)
                ),
            ));
        }
        openai::check_response(endpoint, &response, false).map_err(|why| ("malformed", why))?;
        if endpoint == Endpoint::Responses {
            let value = openai::json_body(&response).map_err(|why| ("malformed", why))?;
            self.stored = value["id"].as_str().map(str::to_owned);
        }
        self.keep(connection, &response.head);
        Ok("ok")
    }

    /// Sends a request, waits a moment and leaves before the answer.
    fn leave_early(&mut self, bytes: &[u8]) -> Outcome {
        let mut connection = Connection::open(self.address, ANSWER_TIMEOUT)
            .map_err(|e| ("dropped", format!("cannot connect: {e}")))?;
        let _ = connection.send(bytes);
        std::thread::sleep(Duration::from_millis(self.rng.random_range(0..100)));
        Ok("left-early")
    }

    /// Sends on the kept connection, or on a new one, and reads the answer's head. A kept
    /// connection that the server closed while it was idle is replaced once, as HTTP clients do.
    fn send_for_head(
        &mut self,
        bytes: &[u8],
    ) -> Result<(Connection, Head), (&'static str, String)> {
        if let Some(mut kept) = self.connection.take() {
            kept.set_timeout(ANSWER_TIMEOUT);
            if kept.send(bytes).is_ok() {
                match kept.read_head() {
                    Ok(head) => return Ok((kept, head)),
                    Err(ReadError::Closed {
                        mid_response: false,
                    }) => {}
                    Err(e) => return Err(read_failure(e)),
                }
            }
        }
        let mut connection = Connection::open(self.address, ANSWER_TIMEOUT)
            .map_err(|e| ("dropped", format!("cannot connect: {e}")))?;
        connection
            .send(bytes)
            .map_err(|e| ("dropped", format!("cannot send: {e}")))?;
        let head = connection.read_head().map_err(read_failure)?;
        Ok((connection, head))
    }

    fn keep(&mut self, connection: Connection, head: &Head) {
        if self.keep_alive && !head.closes() {
            self.connection = Some(connection);
        }
    }

    fn read_stream(
        &mut self,
        mut connection: Connection,
        head: Head,
        endpoint: Endpoint,
    ) -> Outcome {
        let leave_after = self
            .rng
            .random_bool(self.disconnect_share)
            .then(|| self.rng.random_range(0..4));
        if head.status != 200 || !head.is_event_stream() {
            return Err(("status", format!("status {} for a stream", head.status)));
        }
        if matches!(endpoint, Endpoint::Messages | Endpoint::Responses) {
            // Their events are named: the whole stream is read, then checked.
            let body = connection
                .body(&head, false)
                .and_then(|b| b.read_to_end())
                .map_err(read_failure)?;
            return match openai::check_stream_body(endpoint, &body) {
                Ok(StreamEnd::Finished(_)) => {
                    self.keep(connection, &head);
                    Ok("ok")
                }
                Ok(StreamEnd::Error(error)) => Err(("stream-error", error.to_string())),
                Err(why) => Err(("malformed", why)),
            };
        }
        let mut check = StreamCheck::new(endpoint);
        let mut events = Events::new(connection.body(&head, false).map_err(read_failure)?);
        let mut data_events = 0;
        loop {
            if leave_after == Some(data_events) {
                return Ok("left-mid-stream");
            }
            match events.next_event().map_err(read_failure)? {
                Some(Event::Data(data)) => {
                    check.event(&data).map_err(|why| ("malformed", why))?;
                    data_events += 1;
                }
                Some(Event::Comment) => {}
                None => break,
            }
        }
        match check.finish().map_err(|why| ("malformed", why))? {
            StreamEnd::Finished(_) => {}
            StreamEnd::Error(error) => return Err(("stream-error", error.to_string())),
        }
        self.keep(connection, &head);
        Ok("ok")
    }

    fn chat_body(&mut self, stream: bool) -> Value {
        let mut messages = vec![json!({"role": "user", "content": self.prompt()})];
        if self.rng.random_bool(0.2) {
            // A second turn, as a chat client sends it: the prompt cache's case.
            messages.push(json!({"role": "assistant", "content": "The sea is calm."}));
            messages.push(json!({"role": "user", "content": self.prompt()}));
        }
        let mut body = json!({"messages": messages, "stream": stream});
        self.sampling(&mut body);
        body
    }

    fn messages_body(&mut self, stream: bool) -> Value {
        let mut body = json!({
            "model": "oxlm",
            "max_tokens": self.rng.random_range(1..=32),
            "messages": [{"role": "user", "content": self.prompt()}],
            "stream": stream,
        });
        if self.rng.random_bool(0.3) {
            body["system"] = json!("Answer briefly.");
        }
        if self.rng.random_bool(0.5) {
            body["temperature"] = json!(0.8);
        }
        body
    }

    /// Going on from the last stored answer half the time there is one.
    fn responses_body(&mut self, stream: bool) -> Value {
        let mut body = json!({
            "input": self.prompt(),
            "max_output_tokens": self.rng.random_range(16..=32),
            "stream": stream,
        });
        if let Some(id) = self.stored.clone().filter(|_| self.rng.random_bool(0.5)) {
            body["previous_response_id"] = id.into();
        }
        body
    }

    fn completion_body(&mut self, stream: bool) -> Value {
        let mut body = json!({"prompt": self.prompt(), "stream": stream});
        self.sampling(&mut body);
        body
    }

    fn sampling(&mut self, body: &mut Value) {
        body["max_tokens"] = self.rng.random_range(1..=32).into();
        if self.rng.random_bool(0.5) {
            body["temperature"] = json!(0.8);
            body["seed"] = self.rng.random_range(0..1000).into();
        }
        if body["stream"] == true && self.rng.random_bool(0.3) {
            body["stream_options"] = json!({"include_usage": true});
        }
    }

    /// A short prompt, or now and then a long one whose prefill overlaps others' decoding.
    fn prompt(&mut self) -> String {
        let words = [
            "the", "sea", "is", "calm", "tonight", "tell", "me", "a", "story",
        ];
        let count = if self.rng.random_bool(0.1) {
            600
        } else {
            self.rng.random_range(3..30)
        };
        (0..count)
            .map(|_| *words.choose(&mut self.rng).expect("not empty"))
            .collect::<Vec<_>>()
            .join(" ")
    }
}

fn read_failure(error: ReadError) -> (&'static str, String) {
    let outcome = match error {
        ReadError::Timeout => "hang",
        ReadError::Closed { .. } => "dropped",
        ReadError::Malformed(_) => "malformed",
    };
    (outcome, error.to_string())
}
