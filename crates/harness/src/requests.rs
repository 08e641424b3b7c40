//! `requests`: a seeded fuzzer over every endpoint of `oxlm serve`: the OpenAI API, Anthropic's
//! Messages API, the Responses API and embeddings. Passes when no request gets a 5xx, every
//! error is its API's error object, every 200 is well-formed in its API's shapes (JSON, or an
//! event stream in its API's grammar), requests that promise more get it (a status, vectors),
//! nothing hangs, the server never dies or panics, and valid requests still succeed at the end.

mod cases;

use std::time::{Duration, Instant};

use anyhow::{Context, Result};

use crate::http::{self, Connection, ReadError, Response};
use crate::model::ModelInfo;
use crate::openai::{self, StreamEnd};
use crate::report::Tally;
use crate::server::{self, Served, Server};
use cases::{Case, Expected, Promise, Target};

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    served: Served,
    /// Requests to send.
    #[arg(long, default_value_t = 2000)]
    count: u64,
    /// Seed of the cases: case N of a seed is the same request on every run.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Send only case N and print its request and response in full (to reproduce a failure).
    #[arg(long)]
    case: Option<u64>,
    /// Seconds a response may take before it counts as a hang.
    #[arg(long, default_value_t = 30)]
    timeout: u64,
}

/// The server's body limit: small enough that the fuzzer can cross it cheaply.
const MAX_REQUEST_BYTES: usize = 4_000_000;

pub fn run(args: Args) -> Result<bool> {
    let limit = MAX_REQUEST_BYTES.to_string();
    let flags = ["--max-tokens", "16", "--max-request-bytes", &limit];
    let serve = args.served.command(&flags);
    let mut server = serve.start()?;
    let target = target(&args, &server)?;
    let timeout = Duration::from_secs(args.timeout);
    if let Some(index) = args.case {
        return replay(&server, &cases::case(args.seed, index, &target), timeout);
    }

    let started = Instant::now();
    let mut tally = Tally::default();
    let mut deaths = 0;
    let mut crash_lines_seen = 0;
    let mut slowest = (Duration::ZERO, 0);
    for index in 0..args.count {
        let case = cases::case(args.seed, index, &target);
        let sent = Instant::now();
        let repro = || {
            format!(
                "case {index} [{}] (reproduce: --seed {} --case {index}): {}",
                case.kind,
                args.seed,
                cases::describe(&case)
            )
        };
        for verdict in send(&server, &case, timeout) {
            match verdict {
                Ok(outcome) => tally.count(case.kind, outcome),
                Err((outcome, why)) => {
                    tally.fail(case.kind, outcome, format!("{why}; {}", repro()))
                }
            }
        }
        slowest = slowest.max((sent.elapsed(), index));
        let crash_lines = server.crash_lines();
        if crash_lines.len() > crash_lines_seen {
            let lines = crash_lines[crash_lines_seen..].join(" | ");
            tally.fail(
                case.kind,
                "panic",
                format!("server stderr {lines}; at or before {}", repro()),
            );
            crash_lines_seen = crash_lines.len();
        }
        if let Some(status) = server.exit_status() {
            deaths += 1;
            tally.fail(
                case.kind,
                "server-died",
                format!("the server exited ({status}) after {}", repro()),
            );
            server = serve.start()?;
            crash_lines_seen = 0;
        }
    }
    let elapsed = started.elapsed();

    // A valid request, streamed and not, still gets through.
    let still_serving = server::probe(server.address, timeout)
        .and_then(|()| probe_stream(&server, timeout))
        .map_err(|why| format!("the valid request at the end failed: {why}"));
    let mut problems: Vec<String> = still_serving.err().into_iter().collect();
    problems.extend(server.stop(Duration::from_secs(10)));
    for problem in &problems {
        tally.fail("final", "final-check", problem.clone());
    }

    tally.print();
    println!(
        "slowest: case {} ({:.1} s)",
        slowest.1,
        slowest.0.as_secs_f64()
    );
    let failures = tally.failures();
    println!(
        "requests: {} cases (seed {}) in {:.1} s, answered: {} 2xx, {} 4xx with their API's error, \
         {} refused by the HTTP layer; {} 5xx, {} malformed, {} hangs, {} dropped, {} panics, {} \
         server deaths; valid request at the end: {}; {}",
        args.count,
        args.seed,
        elapsed.as_secs_f64(),
        tally.total("2xx"),
        tally.total("4xx"),
        tally.total("http-refused"),
        tally.total("5xx") + tally.total("stream-error"),
        tally.total("malformed"),
        tally.total("hang"),
        tally.total("dropped"),
        tally.total("panic"),
        deaths,
        if problems.is_empty() { "ok" } else { "FAILED" },
        if failures == 0 { "PASS" } else { "FAIL" },
    );
    Ok(failures == 0)
}

/// The model id the server lists, and what the fuzzer needs from the model's config.json.
fn target(args: &Args, server: &Server) -> Result<Target> {
    let request = http::request("GET", "/v1/models", &[], b"", false);
    let models = http::exchange(server.address, &request, Duration::from_secs(10))
        .map_err(|e| anyhow::anyhow!("GET /v1/models: {e}"))?;
    let model_id = models
        .json()
        .and_then(|v| v["data"][0]["id"].as_str().map(str::to_owned))
        .context("GET /v1/models lists no model")?;
    let info = ModelInfo::read(&args.served.model)?;
    Ok(Target {
        model_id,
        vocab_size: info.vocab_size,
        max_context: info.max_context,
        ends_at_once: info.eos_bias(100),
        embeds: info.embeds,
        max_request_bytes: MAX_REQUEST_BYTES,
    })
}

/// An outcome that passes, or one that fails and why.
type Verdict = Result<&'static str, (&'static str, String)>;

/// Sends a case on one connection and judges each answer it expects.
fn send(server: &Server, case: &Case, timeout: Duration) -> Vec<Verdict> {
    let mut connection = match Connection::open(server.address, timeout) {
        Ok(connection) => connection,
        Err(e) => return vec![Err(("dropped", format!("cannot connect: {e}")))],
    };
    // The server may answer (413, 400) and close before reading all of it: the answer counts.
    let _ = connection.send(&case.bytes);
    let mut verdicts = Vec::new();
    for expected in &case.answers {
        let answer = connection.read_response(expected.head);
        let verdict = judge(case, expected, answer);
        let stop = verdict.is_err() || verdict == Ok("http-refused");
        verdicts.push(verdict);
        if stop {
            break;
        }
    }
    verdicts
}

fn judge(case: &Case, expected: &Expected, answer: Result<Response, ReadError>) -> Verdict {
    let response = match answer {
        Ok(response) => response,
        Err(ReadError::Timeout) => return Err(("hang", "no answer in time".into())),
        Err(ReadError::Closed {
            mid_response: false,
        }) if !case.http_valid => return Ok("http-refused"),
        Err(e @ ReadError::Closed { .. }) => return Err(("dropped", e.to_string())),
        Err(e @ ReadError::Malformed(_)) => return Err(("malformed", e.to_string())),
    };
    let status = response.status();
    let shown = || format!("{status} {}", http::escape(&response.body, 300));
    if status >= 500 {
        return Err(("5xx", shown()));
    }
    // The HTTP layer refuses what is not HTTP before the API sees it, with no body.
    if !case.http_valid && status >= 400 && response.body.is_empty() {
        return Ok("http-refused");
    }
    if let Err(why) = openai::check_response(expected.endpoint, &response, expected.head) {
        return Err(("malformed", format!("{why} (status {status})")));
    }
    if status == 200 && response.head.is_event_stream() {
        if let Ok(StreamEnd::Error(error)) =
            openai::check_stream_body(expected.endpoint, &response.body)
        {
            if openai::is_server_failure(expected.endpoint, &error) {
                return Err(("stream-error", error.to_string()));
            }
        }
    }
    if let Err(why) = keeps(expected.promise, &response) {
        return Err(("broken-promise", format!("{why}: {}", shown())));
    }
    Ok(if status < 300 { "2xx" } else { "4xx" })
}

/// Whether a well-formed answer is also what the request promised.
fn keeps(promise: Promise, response: &Response) -> Result<(), String> {
    let status = response.status();
    match promise {
        Promise::WellFormed => Ok(()),
        Promise::Status(wanted) if status == wanted => Ok(()),
        Promise::Status(wanted) => Err(format!("status {status}, not {wanted}")),
        Promise::Embeddings { count, base64 } => {
            let value = openai::json_body(response)?;
            let vectors = openai::check_embeddings(&value)?;
            if (vectors.count, vectors.base64) != (count, base64) {
                return Err(format!(
                    "{} vectors (base64: {}), not {count} (base64: {base64})",
                    vectors.count, vectors.base64
                ));
            }
            Ok(())
        }
        Promise::CannotEmbed => {
            let param = response.json().map(|v| v["error"]["param"].clone());
            if status != 400 || param != Some("model".into()) {
                return Err("not a 400 naming `model` from a model that does not embed".into());
            }
            Ok(())
        }
    }
}

fn probe_stream(server: &Server, timeout: Duration) -> Result<(), String> {
    let mut connection = Connection::open(server.address, timeout).map_err(|e| e.to_string())?;
    let request = http::post_json("/v1/chat/completions", &server::small_chat(true), false);
    connection.send(&request).map_err(|e| e.to_string())?;
    match openai::read_stream(&mut connection, openai::Endpoint::Chat, timeout)? {
        openai::Streamed::Complete(StreamEnd::Finished(_)) => Ok(()),
        openai::Streamed::Complete(StreamEnd::Error(error)) => Err(error.to_string()),
        openai::Streamed::Refused(status, error) => Err(format!("{status} {error}")),
    }
}

/// Sends one case and prints everything about it.
fn replay(server: &Server, case: &Case, timeout: Duration) -> Result<bool> {
    println!(
        "kind: {}\nrequest ({} bytes):\n{}\n",
        case.kind,
        case.bytes.len(),
        http::escape(&case.bytes, 4000)
    );
    let mut connection = Connection::open(server.address, timeout)?;
    let _ = connection.send(&case.bytes);
    let mut passed = true;
    for expected in &case.answers {
        let answer = connection.read_response(expected.head);
        match &answer {
            Ok(response) => println!(
                "response: {}\n{:?}\n{}\n",
                response.status(),
                response.head.headers,
                http::escape(&response.body, 4000)
            ),
            Err(e) => println!("response: {e}"),
        }
        let verdict = judge(case, expected, answer);
        println!("verdict: {verdict:?}");
        passed &= verdict.is_ok();
    }
    std::thread::sleep(Duration::from_millis(200));
    for line in server.crash_lines() {
        println!("server stderr: {line}");
        passed = false;
    }
    Ok(passed)
}
