//! `slow-clients`: connections that send half a head, trickle it a byte at a time, stall in the
//! body, sit idle (new, or after a request), or never read their stream; then hundreds of idle
//! connections at once. A valid request is sent every half second throughout. Passes when every
//! valid request is answered (after the `Retry-After` of a 503, where the server sheds load
//! that way) and the server stays up. For each kind of slow client that `oxlm serve` has a flag
//! to bound (its `--help` is read to find out), the harness sets the flag low and also requires
//! the connection closed in time; without the flag it reports how long the server kept it.

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use serde_json::json;

use crate::http::{self, Connection};
use crate::model::ModelInfo;
use crate::openai::{self, Endpoint};
use crate::server::{self, Served};

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    served: Served,
    /// How long each phase holds its slow connections, in seconds.
    #[arg(long, default_value_t = 10)]
    observe_seconds: u64,
    /// Idle connections opened at once in the second phase.
    #[arg(long, default_value_t = 256)]
    connections: usize,
}

/// Seconds the harness gives each timeout flag `oxlm serve` has.
const TIMEOUT_SECONDS: u64 = 2;
/// How much later than its timeout a connection may be closed.
const SLACK: Duration = Duration::from_secs(2);
/// The cap the harness gives `--max-connections`: well below the idle connections it opens.
const CONNECTION_CAP: usize = 32;

/// A kind of slow client, and the `oxlm serve` flag that should get it closed.
struct Scenario {
    name: &'static str,
    flag: &'static str,
}

const HALF_SENT_HEAD: Scenario = Scenario {
    name: "half-sent head",
    flag: "--header-timeout",
};
const TRICKLED_HEAD: Scenario = Scenario {
    name: "head trickled a byte per 500 ms",
    flag: "--header-timeout",
};
const SILENT: Scenario = Scenario {
    name: "connected, nothing sent",
    flag: "--idle-timeout",
};
const STALLED_BODY: Scenario = Scenario {
    name: "body stalled after 10 of 1000 bytes",
    flag: "--body-timeout",
};
const IDLE_KEEP_ALIVE: Scenario = Scenario {
    name: "keep-alive, idle after one request",
    flag: "--idle-timeout",
};
const UNREAD_STREAM: Scenario = Scenario {
    name: "stream never read",
    flag: "--send-timeout",
};
const MANY_IDLE: Scenario = Scenario {
    name: "idle connections opened at once",
    flag: "--idle-timeout",
};

const TIMEOUT_FLAGS: [&str; 4] = [
    "--header-timeout",
    "--idle-timeout",
    "--body-timeout",
    "--send-timeout",
];

pub fn run(args: Args) -> Result<bool> {
    let help = serve_help(&args.served.server_bin)?;
    let flags = slow_client_flags(&help);
    let server = args.served.command(&flags).start()?;
    let address = server.address;
    let model = ModelInfo::read(&args.served.model)?;
    let window = Duration::from_secs(args.observe_seconds);
    println!(
        "oxlm serve started with: {}",
        if flags.is_empty() {
            "no slow-client flags (none in its --help)".to_owned()
        } else {
            flags.join(" ")
        }
    );

    let prober = Prober::start(address, window);
    let trickled = format!(
        "GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: {}\r\n\r\n",
        "a".repeat(200)
    );
    // Log-probabilities make each event large, so that the server's writes back up soon.
    let endless = json!({"messages": [{"role": "user", "content": "Go on forever."}],
                         "stream": true, "max_tokens": 1_000_000, "logprobs": true,
                         "top_logprobs": 20, "logit_bias": model.eos_bias(-100)});
    let mut slow = vec![
        Held::open(
            &HALF_SENT_HEAD,
            address,
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Le",
        )?,
        Held::trickling(&TRICKLED_HEAD, address, trickled.into_bytes())?,
        Held::open(&SILENT, address, b"")?,
        Held::open(
            &STALLED_BODY,
            address,
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
              Content-Length: 1000\r\n\r\n{\"message",
        )?,
        Held::after_one_request(&IDLE_KEEP_ALIVE, address)?,
    ];
    let unread = Held::open(
        &UNREAD_STREAM,
        address,
        &http::post_json("/v1/chat/completions", &endless, true),
    )?;
    watch(&mut slow, window);
    let unread_closed = unread.drained_to_end();
    let during_slow = prober.finish();

    let prober = Prober::start(address, window);
    // A connection the listening backlog cannot take is one fewer held, not a failure.
    let mut idle: Vec<Held> = (0..args.connections)
        .filter_map(|_| Held::open(&MANY_IDLE, address, b"").ok())
        .collect();
    watch(&mut idle, window);
    let during_idle = prober.finish();

    let mut failures = Vec::new();
    let mut bounded = 0;
    println!(
        "{:40} {:>24}  verdict",
        "slow client", "closed by the server"
    );
    let limit = Duration::from_secs(TIMEOUT_SECONDS) + SLACK;
    let mut rows: Vec<(&Scenario, String, Verdict)> = slow
        .iter()
        .map(|held| {
            (
                held.scenario,
                held.closed_text(window),
                verdict(&help, held.scenario, held.closed_after, limit),
            )
        })
        .collect();
    let unread_text = match unread_closed {
        true => format!("within {} s", window.as_secs()),
        false => format!("no (streaming after {} s)", window.as_secs()),
    };
    let unread_after = unread_closed.then_some(window);
    rows.push((
        &UNREAD_STREAM,
        unread_text,
        verdict(&help, &UNREAD_STREAM, unread_after, window),
    ));
    let idle_closed = idle.iter().filter(|h| h.closed_after.is_some()).count();
    let last_idle_close = idle.iter().map(|h| h.closed_after).max().flatten();
    let all_idle_closed = (idle_closed == idle.len())
        .then_some(last_idle_close)
        .flatten();
    let idle_text = format!("{idle_closed} of {}", idle.len());
    rows.push((
        &MANY_IDLE,
        idle_text,
        verdict(&help, &MANY_IDLE, all_idle_closed, limit),
    ));
    for (scenario, closed, verdict) in &rows {
        bounded += usize::from(verdict.bounded);
        println!("{:40} {closed:>24}  {}", scenario.name, verdict.text);
        if !verdict.passed {
            failures.push(format!("{}: {}", scenario.name, verdict.text));
        }
    }
    for (phase, probes) in [
        ("slow clients", &during_slow),
        ("idle connections", &during_idle),
    ] {
        println!(
            "valid requests during the {phase}: {} of {} answered ({} after a Retry-After), slowest {:.2} s",
            probes.answered(),
            probes.results.len(),
            probes.retried(),
            probes.slowest().as_secs_f64()
        );
        failures.extend(
            probes
                .failures()
                .map(|why| format!("a valid request during the {phase}: {why}")),
        );
    }
    let opened = idle.len();
    drop(idle);
    drop(slow);
    failures.extend(server.stop(Duration::from_secs(15)));
    for failure in &failures {
        println!("- {failure}");
    }
    println!(
        "slow-clients: 6 slow clients, then {opened} idle connections at once, {} s each: {bounded} \
         of 7 bounded by a flag of oxlm serve, {idle_closed} of {opened} idle connections closed \
         by the server; {} of {} valid requests answered meanwhile (slowest {:.2} s); {} \
         failures; {}",
        args.observe_seconds,
        during_slow.answered() + during_idle.answered(),
        during_slow.results.len() + during_idle.results.len(),
        during_slow.slowest().max(during_idle.slowest()).as_secs_f64(),
        failures.len(),
        if failures.is_empty() { "PASS" } else { "FAIL" },
    );
    Ok(failures.is_empty())
}

/// `oxlm serve --help`.
fn serve_help(binary: &Path) -> Result<String> {
    let output = Command::new(binary)
        .args(["serve", "--help"])
        .output()
        .with_context(|| format!("running {} serve --help", binary.display()))?;
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}

fn has_flag(help: &str, flag: &str) -> bool {
    help.lines()
        .any(|line| line.trim_start().split([' ', '=']).next() == Some(flag))
}

/// The slow-client flags `oxlm serve` has, set low: each timeout to [`TIMEOUT_SECONDS`], the
/// connection cap to [`CONNECTION_CAP`].
fn slow_client_flags(help: &str) -> Vec<String> {
    let mut flags = Vec::new();
    for flag in TIMEOUT_FLAGS.into_iter().filter(|f| has_flag(help, f)) {
        flags.extend([flag.to_owned(), TIMEOUT_SECONDS.to_string()]);
    }
    if has_flag(help, "--max-connections") {
        flags.extend(["--max-connections".to_owned(), CONNECTION_CAP.to_string()]);
    }
    flags
}

struct Verdict {
    passed: bool,
    /// The server has a flag for this kind of slow client.
    bounded: bool,
    text: String,
}

/// Whether the server closed a slow client within `limit`, where it has the flag to do so.
fn verdict(
    help: &str,
    scenario: &Scenario,
    closed_after: Option<Duration>,
    limit: Duration,
) -> Verdict {
    let flag = scenario.flag;
    if !has_flag(help, flag) {
        return Verdict {
            passed: true,
            bounded: false,
            text: format!("not bounded: oxlm serve has no {flag}"),
        };
    }
    let (passed, text) = match closed_after {
        Some(after) if after <= limit => {
            (true, format!("closed in time ({flag} {TIMEOUT_SECONDS})"))
        }
        Some(after) => (
            false,
            format!(
                "closed after {:.1} s, later than {flag} {TIMEOUT_SECONDS} allows",
                after.as_secs_f64()
            ),
        ),
        None => (
            false,
            format!("not closed in time despite {flag} {TIMEOUT_SECONDS}"),
        ),
    };
    Verdict {
        passed,
        bounded: true,
        text,
    }
}

/// A connection held open by a slow client.
struct Held {
    scenario: &'static Scenario,
    stream: TcpStream,
    opened: Instant,
    /// Bytes of the head still to trickle (last first), one per [`TRICKLE_EVERY`].
    trickle: Vec<u8>,
    last_trickle: Instant,
    closed_after: Option<Duration>,
}

const TRICKLE_EVERY: Duration = Duration::from_millis(500);

impl Held {
    /// Connects and sends `bytes`, then nothing more.
    fn open(scenario: &'static Scenario, address: SocketAddr, bytes: &[u8]) -> Result<Held> {
        let mut stream = TcpStream::connect_timeout(&address, Duration::from_secs(5))?;
        stream.write_all(bytes)?;
        Held::watching(scenario, stream)
    }

    fn watching(scenario: &'static Scenario, stream: TcpStream) -> Result<Held> {
        stream.set_nonblocking(true)?;
        Ok(Held {
            scenario,
            stream,
            opened: Instant::now(),
            trickle: Vec::new(),
            last_trickle: Instant::now(),
            closed_after: None,
        })
    }

    /// Connects and sends `head` one byte at a time.
    fn trickling(
        scenario: &'static Scenario,
        address: SocketAddr,
        mut head: Vec<u8>,
    ) -> Result<Held> {
        head.reverse();
        Ok(Held {
            trickle: head,
            ..Held::open(scenario, address, b"")?
        })
    }

    /// Makes one request on a keep-alive connection, reads the answer, then idles.
    fn after_one_request(scenario: &'static Scenario, address: SocketAddr) -> Result<Held> {
        let mut connection = Connection::open(address, Duration::from_secs(10))?;
        connection.send(&http::request("GET", "/health", &[], b"", true))?;
        let response = connection
            .read_response(false)
            .map_err(|e| anyhow::anyhow!("GET /health: {e}"))?;
        anyhow::ensure!(
            response.status() == 200,
            "GET /health answered {}",
            response.status()
        );
        Held::watching(scenario, connection.into_stream())
    }

    /// Trickles the next byte when due, and notes when the server has closed the connection.
    fn poll(&mut self) {
        if self.closed_after.is_some() {
            return;
        }
        if !self.trickle.is_empty() && self.last_trickle.elapsed() >= TRICKLE_EVERY {
            let byte = self.trickle.pop().expect("not empty");
            self.last_trickle = Instant::now();
            if self.stream.write_all(&[byte]).is_err() {
                self.closed_after = Some(self.opened.elapsed());
                return;
            }
        }
        let mut buffer = [0u8; 4096];
        match self.stream.read(&mut buffer) {
            // An answer (a 408, a 503) may come before the close: only the close counts.
            Ok(n) if n > 0 => {}
            Err(e) if e.kind() == ErrorKind::WouldBlock => {}
            Ok(_) | Err(_) => self.closed_after = Some(self.opened.elapsed()),
        }
    }

    fn closed_text(&self, window: Duration) -> String {
        match self.closed_after {
            Some(after) => format!("after {:.1} s", after.as_secs_f64()),
            None => format!("no (open after {} s)", window.as_secs()),
        }
    }

    /// Reads what the server buffered for a client that read nothing: whether the stream has
    /// ended (the server gave up on it) rather than still flowing.
    fn drained_to_end(mut self) -> bool {
        let _ = self.stream.set_nonblocking(false);
        let _ = self.stream.set_read_timeout(Some(Duration::from_secs(1)));
        let deadline = Instant::now() + Duration::from_secs(5);
        let mut buffer = vec![0u8; 1 << 16];
        while Instant::now() < deadline {
            match self.stream.read(&mut buffer) {
                Ok(0) => return true,
                Ok(_) => {}
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                    return false
                }
                Err(_) => return true,
            }
        }
        false
    }
}

/// Polls every held connection for `window`.
fn watch(held: &mut [Held], window: Duration) {
    let end = Instant::now() + window;
    while Instant::now() < end {
        held.iter_mut().for_each(Held::poll);
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Sends a valid request every half second, on a thread of its own.
struct Prober {
    stop: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<Probes>,
}

/// One valid request: how long it took, how many `Retry-After`s it waited out, what failed.
struct Probe {
    took: Duration,
    retries: u32,
    failure: Option<String>,
}

struct Probes {
    results: Vec<Probe>,
}

impl Prober {
    fn start(address: SocketAddr, timeout: Duration) -> Prober {
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let stop = stop.clone();
            std::thread::spawn(move || {
                let mut results = Vec::new();
                while !stop.load(Ordering::Relaxed) {
                    results.push(probe(address, timeout));
                    std::thread::sleep(Duration::from_millis(500));
                }
                Probes { results }
            })
        };
        Prober { stop, thread }
    }

    fn finish(self) -> Probes {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.join().unwrap_or(Probes {
            results: Vec::new(),
        })
    }
}

/// A valid request, sent again after the `Retry-After` of each 503 or 429 in the API's shape,
/// as a client that heeds it would, until `timeout`.
fn probe(address: SocketAddr, timeout: Duration) -> Probe {
    let started = Instant::now();
    let request = http::post_json("/v1/chat/completions", &server::small_chat(false), false);
    let mut retries = 0;
    let failure = loop {
        let left = timeout.saturating_sub(started.elapsed());
        let response = match http::exchange(address, &request, left) {
            Ok(response) => response,
            Err(e) => break Some(e.to_string()),
        };
        let retry_after = response
            .head
            .header("retry-after")
            .and_then(|s| s.parse::<u64>().ok())
            .filter(|_| matches!(response.status(), 429 | 503));
        match retry_after {
            Some(seconds) if openai::check_error_response(&response).is_ok() => {
                let wait = Duration::from_secs(seconds);
                if started.elapsed() + wait >= timeout {
                    break Some(format!(
                        "{} with Retry-After {seconds} until the end",
                        response.status()
                    ));
                }
                retries += 1;
                std::thread::sleep(wait);
            }
            _ if response.status() == 200 => {
                break openai::check_response(Endpoint::Chat, &response, false).err()
            }
            _ => {
                break Some(format!(
                    "status {}: {}",
                    response.status(),
                    http::escape(&response.body, 200)
                ))
            }
        }
    };
    Probe {
        took: started.elapsed(),
        retries,
        failure,
    }
}

impl Probes {
    fn answered(&self) -> usize {
        self.results.iter().filter(|p| p.failure.is_none()).count()
    }

    fn retried(&self) -> usize {
        self.results.iter().filter(|p| p.retries > 0).count()
    }

    fn slowest(&self) -> Duration {
        self.results
            .iter()
            .map(|p| p.took)
            .max()
            .unwrap_or_default()
    }

    fn failures(&self) -> impl Iterator<Item = String> + '_ {
        self.results.iter().filter_map(|p| {
            let why = p.failure.as_ref()?;
            Some(format!("{why} (after {:.1} s)", p.took.as_secs_f64()))
        })
    }
}
