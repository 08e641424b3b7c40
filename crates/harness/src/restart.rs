//! `restart`: SIGTERM to `oxlm serve` in each phase of a request's life (queued, in a long
//! prompt's prefill, decoding, streaming), with a grace period long enough to finish and with
//! one too short. Every accepted request must end with a complete answer, or, when cancelled,
//! with an error in the API's shape (a stream: an error event, then `data: [DONE]`); the server
//! must exit 0, and a new one must start on the same port and serve. Then `kill -9` during
//! `oxlm fuse` and during `oxlm convert`, at moments spread over each run: the save path must
//! hold the earlier output intact or the new one complete, and nothing half-written.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};

use crate::http::{self, Connection, Event, Events, ReadError};
use crate::model::ModelInfo;
use crate::openai::{self, Endpoint, StreamCheck, StreamEnd};
use crate::process::{run_with_timeout, send_signal};
use crate::report::Tally;
use crate::safetensors::{self, Safetensors, Tensor};
use crate::server::{self, free_port, ServeCommand};

#[derive(clap::Args)]
pub struct Args {
    /// The `oxlm` binary.
    #[arg(long)]
    oxlm_bin: PathBuf,
    /// The model directory to serve and fuse (a tiny fixture).
    #[arg(long)]
    model: PathBuf,
    /// A LoRA adapter of the model, for `oxlm fuse`.
    #[arg(long)]
    adapter: PathBuf,
    /// How many times `oxlm fuse`, and then `oxlm convert`, is killed at moments spread over
    /// its run, beside the two kills as it starts writing and as it replaces its first file.
    #[arg(long, default_value_t = 8)]
    fuse_kills: u32,
    /// How many times the SIGTERM phases run (each with a restart): more rounds, more chances
    /// to catch a race.
    #[arg(long, default_value_t = 1)]
    rounds: u32,
    /// Seed of the moments `oxlm fuse` and `oxlm convert` are killed at, within their share of
    /// their run.
    #[arg(long, default_value_t = 1)]
    seed: u64,
}

pub fn run(args: Args) -> Result<bool> {
    let model = ModelInfo::read(&args.model)?;
    let mut tally = Tally::default();
    let port = free_port()?;
    let phases = [
        Phase::Queued,
        Phase::Prefill,
        Phase::Decoding,
        Phase::Streaming,
    ];
    for _ in 0..args.rounds {
        for (grace, phase) in [Grace::Long, Grace::Short]
            .into_iter()
            .flat_map(|g| phases.map(|p| (g, p)))
        {
            let row = format!("{} / {}", phase.name(), grace.name());
            // Each phase's server is a restart on the port the last one stopped on.
            let serve = ServeCommand::new(&args.oxlm_bin, &args.model, &phase.flags(grace));
            match serve.start_on(port) {
                Ok(server) => {
                    tally.count(&row, "restarted");
                    signal_in_phase(server, phase, grace, &model, &row, &mut tally);
                }
                Err(e) => tally.fail(
                    &row,
                    "no-restart",
                    format!("{row}: a server on port {port}: {e:#}"),
                ),
            }
        }
    }
    let serve = ServeCommand::new(&args.oxlm_bin, &args.model, &[] as &[&str]);
    match serve.start_on(port) {
        Ok(server) => {
            if let Err(why) = server::probe(server.address, Duration::from_secs(30)) {
                tally.fail(
                    "final restart",
                    "lost",
                    format!("a request after the last restart: {why}"),
                );
            }
            for problem in server.stop(Duration::from_secs(15)) {
                tally.fail("final restart", "exit", problem);
            }
            tally.count("final restart", "restarted");
        }
        Err(e) => tally.fail("final restart", "no-restart", format!("{e:#}")),
    }
    kill_writer(&args, Writer::Fuse, &mut tally)?;
    kill_writer(&args, Writer::Convert, &mut tally)?;

    tally.print();
    let failures = tally.failures();
    println!(
        "restart: SIGTERM in 4 phases × 2 grace periods × {} rounds: {} requests answered in \
         full, {} ended with an error in the API's shape, {} lost; {} restarts on the same port; \
         fuse and convert killed {} times each: {} left the earlier output intact, {} the new one complete, {} \
         torn or mixed, {} with temporary files left; {}",
        args.rounds,
        tally.total("complete"),
        tally.total("api-error"),
        tally.total("lost") + tally.total("cut-short"),
        tally.total("restarted"),
        args.fuse_kills + 2,
        tally.total("earlier-intact"),
        tally.total("new-complete") + tally.total("finished-first"),
        tally.total("torn") + tally.total("mixed"),
        tally.total("partial-left"),
        if failures == 0 { "PASS" } else { "FAIL" },
    );
    Ok(failures == 0)
}

/// How long requests in progress get after SIGTERM.
#[derive(Clone, Copy)]
enum Grace {
    /// Long enough for every request to finish: each must answer in full.
    Long,
    /// Too short: requests are cancelled, and each must end with an error in the API's shape.
    Short,
}

impl Grace {
    fn name(self) -> String {
        format!("grace {} s", self.seconds())
    }

    fn seconds(self) -> f64 {
        match self {
            Grace::Long => 60.0,
            Grace::Short => 0.3,
        }
    }

    /// `max_tokens` of the requests: enough to be generating still at the signal, and to
    /// finish within the long grace; the short one cancels requests that would run for minutes.
    fn max_tokens(self) -> u64 {
        match self {
            Grace::Long => 3_000,
            Grace::Short => 1_000_000,
        }
    }
}

/// Where the requests are when the signal comes.
#[derive(Clone, Copy)]
enum Phase {
    /// One decoding, two waiting behind it (one sequence decoded at a time).
    Queued,
    /// A long prompt part way through its prefill, another waiting for its turn.
    Prefill,
    /// Requests generating, not streamed.
    Decoding,
    /// Streams sending tokens.
    Streaming,
}

/// How long the harness waits after sending a phase's last request before the signal.
const SETTLE: Duration = Duration::from_millis(300);

/// Tokens of the prefill phase's long prompts: long enough to be signalled in the middle.
const LONG_PROMPT_TOKENS: usize = 12_000;

impl Phase {
    fn name(self) -> &'static str {
        match self {
            Phase::Queued => "queued",
            Phase::Prefill => "prefill",
            Phase::Decoding => "decoding",
            Phase::Streaming => "streaming",
        }
    }

    fn flags(self, grace: Grace) -> Vec<String> {
        let mut flags = vec!["--shutdown-grace".to_owned(), grace.seconds().to_string()];
        let phase_flags: &[&str] = match self {
            Phase::Queued => &["--decode-concurrency", "1"],
            Phase::Prefill => &["--prefill-step-size", "256"],
            Phase::Decoding | Phase::Streaming => &[],
        };
        flags.extend(phase_flags.iter().map(|f| f.to_string()));
        flags
    }
}

/// What a request's thread waits for before it tells the harness to send the signal.
#[derive(Clone, Copy, PartialEq)]
enum Moment {
    /// The first generated token.
    FirstToken,
    /// A prefill progress comment of the stream.
    Prefill,
}

/// How a request ended.
#[derive(Debug)]
enum Answer {
    /// In full: a finish reason.
    Complete,
    /// With an error in the API's shape (a status with an error object, or an error event).
    ApiError(String),
    /// Without an answer, or with one cut short or malformed.
    Lost(String),
}

/// One request on a thread of its own.
struct Sent {
    name: &'static str,
    thread: JoinHandle<Answer>,
}

fn chat(grace: Grace, model: &ModelInfo, stream: bool) -> (&'static str, Value) {
    let body = json!({"messages": [{"role": "user", "content": "Tell me about the sea."}],
                      "max_tokens": grace.max_tokens(), "stream": stream,
                      "logit_bias": model.eos_bias(-100)});
    ("/v1/chat/completions", body)
}

fn long_completion(
    grace: Grace,
    model: &ModelInfo,
    tokens: usize,
    stream: bool,
) -> (&'static str, Value) {
    let body = json!({"prompt": vec![5; tokens], "max_tokens": grace.max_tokens().min(20),
                      "stream": stream, "logit_bias": model.eos_bias(-100)});
    ("/v1/completions", body)
}

/// Sends the phase's requests, SIGTERM at the phase's moment, and checks what follows.
fn signal_in_phase(
    mut server: server::Server,
    phase: Phase,
    grace: Grace,
    model: &ModelInfo,
    row: &str,
    tally: &mut Tally,
) {
    let address = server.address;
    let (moment_tx, moment) = mpsc::channel();
    let mut sent = Vec::new();
    let mut send = |name, (path, body): (&'static str, Value), wait: Option<Moment>| {
        sent.push(Sent {
            name,
            thread: spawn_request(address, path, body, wait.map(|m| (m, moment_tx.clone()))),
        });
    };
    match phase {
        Phase::Queued => {
            send(
                "decoding stream",
                chat(grace, model, true),
                Some(Moment::FirstToken),
            );
            let _ = moment.recv_timeout(Duration::from_secs(30));
            send("queued request", chat(grace, model, false), None);
            send("queued stream", chat(grace, model, true), None);
        }
        Phase::Prefill => {
            let stream = long_completion(grace, model, LONG_PROMPT_TOKENS, true);
            send("stream in prefill", stream, Some(Moment::Prefill));
            let waiting = long_completion(grace, model, LONG_PROMPT_TOKENS / 2, false);
            send("long prompt waiting", waiting, None);
            let _ = moment.recv_timeout(Duration::from_secs(30));
        }
        Phase::Decoding => {
            send("decoding request", chat(grace, model, false), None);
            send(
                "decoding stream",
                chat(grace, model, true),
                Some(Moment::FirstToken),
            );
            let _ = moment.recv_timeout(Duration::from_secs(30));
        }
        Phase::Streaming => {
            send(
                "chat stream",
                chat(grace, model, true),
                Some(Moment::FirstToken),
            );
            let (_, mut body) = long_completion(grace, model, 8, true);
            body["prompt"] = json!("The sea");
            send("completion stream", ("/v1/completions", body), None);
            let _ = moment.recv_timeout(Duration::from_secs(30));
        }
    }
    // Time for the server to take in the last request sent.
    std::thread::sleep(SETTLE);
    let signalled = Instant::now();
    if let Err(e) = server.signal(libc::SIGTERM) {
        tally.fail(row, "exit", format!("{row}: SIGTERM: {e:#}"));
    }
    std::thread::sleep(Duration::from_millis(50));
    let late = late_request(address);
    tally.count(row, late);

    // Cancelled responses get 2 s to reach their clients after the grace period.
    let limit = Duration::from_secs_f64(grace.seconds()) + Duration::from_secs(2 + 10);
    match server.wait_for_exit(limit.saturating_sub(signalled.elapsed())) {
        Some(status) if status.success() => tally.count(row, "exit-0"),
        Some(status) => tally.fail(
            row,
            "exit",
            format!("{row}: the server exited with {status}"),
        ),
        None => tally.fail(
            row,
            "exit",
            format!("{row}: the server still ran {limit:?} after SIGTERM"),
        ),
    }
    for line in server.crash_lines() {
        tally.fail(row, "panic", format!("{row}: server stderr: {line}"));
    }
    let log = server.tail().join(" | ");
    drop(server);
    for request in sent {
        let answer = request
            .thread
            .join()
            .unwrap_or_else(|_| Answer::Lost("the request's thread panicked".into()));
        match (answer, grace) {
            (Answer::Complete, _) => tally.count(row, "complete"),
            (Answer::ApiError(_), Grace::Short) => tally.count(row, "api-error"),
            (Answer::ApiError(error), Grace::Long) => tally.fail(
                row,
                "cut-short",
                format!(
                    "{row}: {} ended with {error} within the grace period",
                    request.name
                ),
            ),
            (Answer::Lost(why), _) => tally.fail(
                row,
                "lost",
                format!(
                    "{row}: {}: {why} (the server's last lines: {log})",
                    request.name
                ),
            ),
        }
    }
}

/// Connects and sends a request, then reads its answer to the end on a thread, telling
/// `moment` when it comes. Sent here, so that every request is on its way before the signal.
fn spawn_request(
    address: SocketAddr,
    path: &'static str,
    body: Value,
    moment: Option<(Moment, mpsc::Sender<()>)>,
) -> JoinHandle<Answer> {
    let stream = body["stream"] == true;
    let endpoint = Endpoint::of_path(path);
    let sent = Connection::open(address, Duration::from_secs(180))
        .map_err(|e| format!("cannot connect: {e}"))
        .and_then(|mut connection| {
            let request = http::post_json(path, &body, false);
            connection
                .send(&request)
                .map_err(|e| format!("cannot send: {e}"))?;
            Ok(connection)
        });
    std::thread::spawn(move || match sent {
        Err(why) => Answer::Lost(why),
        Ok(mut connection) if stream => read_stream(&mut connection, endpoint, moment),
        Ok(mut connection) => read_whole(&mut connection, endpoint),
    })
}

fn read_whole(connection: &mut Connection, endpoint: Endpoint) -> Answer {
    match connection.read_response(false) {
        Ok(response) => match openai::check_response(endpoint, &response, false) {
            Ok(()) if response.status() == 200 => Answer::Complete,
            Ok(()) => Answer::ApiError(format!("status {}", response.status())),
            Err(why) => Answer::Lost(format!("malformed: {why}")),
        },
        Err(e) => Answer::Lost(e.to_string()),
    }
}

fn read_stream(
    connection: &mut Connection,
    endpoint: Endpoint,
    moment: Option<(Moment, mpsc::Sender<()>)>,
) -> Answer {
    let head = match connection.read_head() {
        Ok(head) => head,
        Err(e) => return Answer::Lost(e.to_string()),
    };
    if !head.is_event_stream() {
        let response = connection
            .body(&head, false)
            .and_then(|b| b.read_to_end())
            .map(|body| http::Response { head, body });
        return match response {
            Ok(response) if response.status() >= 400 => {
                match openai::check_error_response(&response) {
                    Ok(()) => Answer::ApiError(format!("status {}", response.status())),
                    Err(why) => Answer::Lost(format!("malformed error: {why}")),
                }
            }
            Ok(response) => Answer::Lost(format!("status {} and no stream", response.status())),
            Err(e) => Answer::Lost(e.to_string()),
        };
    }
    let body = match connection.body(&head, false) {
        Ok(body) => body,
        Err(e) => return Answer::Lost(e.to_string()),
    };
    let mut events = Events::new(body);
    let mut check = StreamCheck::new(endpoint);
    let mut moment = moment;
    loop {
        let event = match events.next_event() {
            Ok(Some(event)) => event,
            Ok(None) => break,
            Err(e) => return Answer::Lost(format!("the stream ended without [DONE]: {e}")),
        };
        let now = match &event {
            Event::Data(_) => Moment::FirstToken,
            Event::Comment => Moment::Prefill,
        };
        if let Some((_, tell)) = moment.take_if(|(wanted, _)| *wanted == now) {
            let _ = tell.send(());
        }
        if let Event::Data(data) = event {
            if let Err(why) = check.event(&data) {
                return Answer::Lost(format!("malformed stream: {why}"));
            }
        }
    }
    match check.finish() {
        Ok(StreamEnd::Finished(_)) => Answer::Complete,
        Ok(StreamEnd::Error(error)) => Answer::ApiError(format!("error event {error}")),
        Err(why) => Answer::Lost(why),
    }
}

/// A request sent just after the signal: refused, closed unanswered, or a 503 in the API's
/// shape all tell a client to go elsewhere; reported, not judged.
fn late_request(address: SocketAddr) -> &'static str {
    let request = http::post_json("/v1/chat/completions", &server::small_chat(false), false);
    match http::exchange(address, &request, Duration::from_secs(20)) {
        Ok(response) if response.status() == 200 => "late:answered",
        Ok(response) if openai::check_error_response(&response).is_ok() => "late:api-error",
        Ok(_) => "late:malformed",
        Err(ReadError::Closed {
            mid_response: false,
        }) => "late:not-accepted",
        Err(_) => "late:cut-short",
    }
}

/// Rows of the embedding and head of the model `oxlm fuse` and `oxlm convert` are killed on:
/// large enough that writing it takes a while.
const LARGE_VOCAB: u64 = 1 << 18;

/// When `oxlm fuse` gets its SIGKILL.
#[derive(Clone, Copy)]
enum KillAt {
    /// As soon as a file neither output has appears in the save path (a temporary file).
    FirstNewFile,
    /// As soon as a file of the earlier output is replaced.
    FirstReplacement,
    /// This long after the start.
    After(Duration),
}

/// The commands that write a model directory, killed by [`kill_writer`].
#[derive(Clone, Copy)]
enum Writer {
    /// `oxlm fuse`: the earlier output quantized, the new one `--de-quantize`d.
    Fuse,
    /// `oxlm convert -d`: the earlier output in f32, the new one in the model's dtype.
    Convert,
}

impl Writer {
    fn name(self) -> &'static str {
        match self {
            Writer::Fuse => "fuse",
            Writer::Convert => "convert",
        }
    }

    /// The command writing into `save`: the earlier output's, or the new one's.
    fn command(self, args: &Args, model: &Path, save: &Path, new: bool) -> Command {
        let mut command = Command::new(&args.oxlm_bin);
        command.env("HF_HUB_OFFLINE", "1");
        match self {
            Writer::Fuse => {
                command
                    .args(["fuse", "--model"])
                    .arg(model)
                    .arg("--adapter-path")
                    .arg(&args.adapter)
                    .arg("--save-path")
                    .arg(save);
                if new {
                    command.arg("--de-quantize");
                }
            }
            Writer::Convert => {
                command
                    .args(["convert", "-d", "--force", "--hf-path"])
                    .arg(model)
                    .arg("--mlx-path")
                    .arg(save);
                if !new {
                    command.args(["--dtype", "float32"]);
                }
            }
        }
        command
    }
}

/// Kills `writer` with SIGKILL over a save path that holds an earlier output: as it starts
/// writing, as it replaces the first file, and at moments spread over its run. Each time, the
/// save path must hold the earlier output intact or the new one complete, with no other file
/// beside it.
fn kill_writer(args: &Args, writer: Writer, tally: &mut Tally) -> Result<()> {
    let work = tempfile::tempdir()?;
    let model = work.path().join("model");
    large_model(&args.model, &model)?;
    let earlier = work.path().join("earlier");
    let complete = work.path().join("complete");
    let run = |save: &Path, new: bool| writer.command(args, &model, save, new);
    for (save, new) in [(&earlier, false), (&complete, true)] {
        let finished = run_with_timeout(&mut run(save, new), Duration::from_secs(300))?;
        if !finished.status.is_some_and(|s| s.success()) {
            bail!(
                "oxlm {} into {} failed: {}",
                writer.name(),
                save.display(),
                finished.stderr
            );
        }
    }
    let earlier_files = files(&earlier)?;
    let complete_files = files(&complete)?;
    let save = work.path().join("save");
    // How long a whole run takes, to spread the kills over it.
    copy_dir(&earlier, &save)?;
    let run_time = run_with_timeout(&mut run(&save, true), Duration::from_secs(300))?.elapsed;

    let mut rng = StdRng::seed_from_u64(args.seed);
    let mut moments = vec![KillAt::FirstNewFile, KillAt::FirstReplacement];
    moments.extend((0..args.fuse_kills).map(|kill| {
        let share = (f64::from(kill) + rng.random::<f64>()) / f64::from(args.fuse_kills);
        KillAt::After(run_time.mul_f64(share))
    }));
    let row = &format!("{}, kill -9", writer.name());
    for moment in moments {
        std::fs::remove_dir_all(&save)?;
        copy_dir(&earlier, &save)?;
        let earlier_inodes = inodes(&save)?;
        let mut child = run(&save, true)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .with_context(|| format!("starting oxlm {}", writer.name()))?;
        let started = Instant::now();
        let deadline = started + run_time * 10;
        let finished_first = loop {
            let due = match moment {
                KillAt::After(at) => started.elapsed() >= at,
                KillAt::FirstNewFile => inodes(&save)?
                    .keys()
                    .any(|n| !earlier_inodes.contains_key(n)),
                KillAt::FirstReplacement => {
                    let now = inodes(&save)?;
                    earlier_inodes
                        .iter()
                        .any(|(name, inode)| now.get(name).is_some_and(|i| i != inode))
                }
            };
            if child.try_wait()?.is_some() {
                break true;
            }
            if due || Instant::now() > deadline {
                send_signal(child.id(), libc::SIGKILL)?;
                break false;
            }
            std::thread::sleep(Duration::from_micros(200));
        };
        child.wait()?;
        let at = format!(
            "killed {:.3} s into a {:.2} s run ({})",
            started.elapsed().as_secs_f64(),
            run_time.as_secs_f64(),
            match moment {
                KillAt::FirstNewFile => "as its first new file appeared",
                KillAt::FirstReplacement => "as it replaced its first file",
                KillAt::After(_) => "at a set moment",
            }
        );
        let (known, unknown): (BTreeMap<String, Vec<u8>>, BTreeMap<String, Vec<u8>>) =
            files(&save)?.into_iter().partition(|(name, _)| {
                earlier_files.contains_key(name) || complete_files.contains_key(name)
            });
        if !unknown.is_empty() {
            let names: Vec<&String> = unknown.keys().collect();
            tally.fail(
                row,
                "partial-left",
                format!("{at}: {names:?} left in the save path"),
            );
        }
        let torn: Vec<&String> = known
            .iter()
            .filter(|(name, bytes)| {
                earlier_files.get(*name) != Some(bytes) && complete_files.get(*name) != Some(bytes)
            })
            .map(|(name, _)| name)
            .collect();
        if !torn.is_empty() {
            tally.fail(
                row,
                "torn",
                format!("{at}: {torn:?} match neither the earlier output nor the new one"),
            );
        } else if known == earlier_files {
            tally.count(row, "earlier-intact");
        } else if known == complete_files {
            tally.count(
                row,
                if finished_first {
                    "finished-first"
                } else {
                    "new-complete"
                },
            );
        } else {
            let new: Vec<&String> = known
                .keys()
                .filter(|n| earlier_files.get(*n) != known.get(*n))
                .collect();
            tally.fail(
                row,
                "mixed",
                format!("{at}: the new {new:?} beside the earlier output's other files"),
            );
        }
    }
    Ok(())
}

/// The inode of each entry of a directory, by name: a file replaced by a rename has a new one.
fn inodes(dir: &Path) -> Result<BTreeMap<String, u64>> {
    use std::os::unix::fs::MetadataExt;
    let mut inodes = BTreeMap::new();
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        inodes.insert(
            entry.file_name().to_string_lossy().into_owned(),
            entry.metadata()?.ino(),
        );
    }
    Ok(inodes)
}

/// The fixture with its embedding and head repeated to [`LARGE_VOCAB`] rows (its blocks, and so
/// its adapters, unchanged).
fn large_model(fixture: &Path, dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir)?;
    let mut config: Value = serde_json::from_slice(&std::fs::read(fixture.join("config.json"))?)?;
    let vocab = config["vocab_size"].as_u64().context("vocab_size")?;
    config["vocab_size"] = LARGE_VOCAB.into();
    std::fs::write(dir.join("config.json"), config.to_string())?;
    for name in ["tokenizer.json", "tokenizer_config.json"] {
        if fixture.join(name).exists() {
            std::fs::copy(fixture.join(name), dir.join(name))?;
        }
    }
    let weights = Safetensors::parse(std::fs::read(fixture.join("model.safetensors"))?)?;
    let mut tensors = Vec::new();
    for name in weights.tensor_names() {
        let mut tensor: Tensor = weights.tensor(&name)?;
        if name.starts_with("model.embed_tokens.") || name.starts_with("lm_head.") {
            tensor.shape[0] = LARGE_VOCAB;
            tensor.data = tensor.data.repeat((LARGE_VOCAB / vocab) as usize);
        }
        tensors.push((name, tensor));
    }
    std::fs::write(
        dir.join("model.safetensors"),
        safetensors::serialize(&tensors),
    )?;
    Ok(())
}

/// Every file of a directory, by name.
fn files(dir: &Path) -> Result<BTreeMap<String, Vec<u8>>> {
    let mut files = BTreeMap::new();
    if !dir.exists() {
        return Ok(files);
    }
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        files.insert(
            entry.file_name().to_string_lossy().into_owned(),
            std::fs::read(entry.path())?,
        );
    }
    Ok(files)
}

fn copy_dir(from: &Path, to: &Path) -> Result<()> {
    std::fs::create_dir_all(to)?;
    for entry in std::fs::read_dir(from)? {
        let entry = entry?;
        std::fs::copy(entry.path(), to.join(entry.file_name()))?;
    }
    Ok(())
}
