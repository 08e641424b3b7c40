//! A running `oxlm serve`: started on a port, waited for, watched (its stderr for panics, its
//! memory), signalled and reaped.

use std::io::{BufRead, BufReader};
use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde_json::json;

use crate::http;
use crate::process::{is_crash_line, send_signal};

/// How long a server may take to load the tiny model and answer `/health`.
const START_TIMEOUT: Duration = Duration::from_secs(60);

/// What the server printed on stderr.
#[derive(Default)]
struct Log {
    crash_lines: Vec<String>,
    /// The last lines, for a report.
    tail: Vec<String>,
}

const TAIL_LINES: usize = 20;

/// The flags of the parts that serve a model: which `oxlm` and which model.
#[derive(clap::Args)]
pub struct Served {
    /// The `oxlm` binary.
    #[arg(long)]
    pub server_bin: PathBuf,
    /// The model directory to serve (a tiny fixture keeps it fast).
    #[arg(long)]
    pub model: PathBuf,
}

impl Served {
    /// How to start its servers, each with `flags`.
    pub fn command(&self, flags: &[impl AsRef<str>]) -> ServeCommand {
        ServeCommand::new(&self.server_bin, &self.model, flags)
    }
}

/// How to start servers: the binary, the model and flags every server of a run gets.
#[derive(Clone)]
pub struct ServeCommand {
    pub binary: PathBuf,
    pub model: PathBuf,
    pub flags: Vec<String>,
}

impl ServeCommand {
    pub fn new(binary: &Path, model: &Path, flags: &[impl AsRef<str>]) -> Self {
        ServeCommand {
            binary: binary.to_owned(),
            model: model.to_owned(),
            flags: flags.iter().map(|f| f.as_ref().to_owned()).collect(),
        }
    }

    /// Starts a server on a free port and waits until it is healthy.
    pub fn start(&self) -> Result<Server> {
        self.start_on(free_port()?)
    }

    pub fn start_on(&self, port: u16) -> Result<Server> {
        let mut child = Command::new(&self.binary)
            .arg("serve")
            .arg("--model")
            .arg(&self.model)
            .args(["--port", &port.to_string()])
            .args(&self.flags)
            // Never the Hugging Face hub: the model is a local directory.
            .env("HF_HUB_OFFLINE", "1")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .with_context(|| format!("starting {}", self.binary.display()))?;
        let log = Arc::new(Mutex::new(Log::default()));
        let pipe = BufReader::new(child.stderr.take().expect("stderr is piped"));
        let reader = {
            let log = log.clone();
            std::thread::spawn(move || {
                for line in pipe.lines().map_while(Result::ok) {
                    let mut log = log.lock().unwrap_or_else(PoisonError::into_inner);
                    if is_crash_line(&line) {
                        log.crash_lines.push(line.clone());
                    }
                    if log.tail.len() == TAIL_LINES {
                        log.tail.remove(0);
                    }
                    log.tail.push(line);
                }
            })
        };
        let mut server = Server {
            child,
            address: SocketAddr::from(([127, 0, 0, 1], port)),
            log,
            reader: Some(reader),
        };
        server.wait_until_healthy()?;
        Ok(server)
    }
}

/// A port no one listens on now.
pub fn free_port() -> Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

pub struct Server {
    child: Child,
    pub address: SocketAddr,
    log: Arc<Mutex<Log>>,
    reader: Option<JoinHandle<()>>,
}

impl Server {
    fn wait_until_healthy(&mut self) -> Result<()> {
        let deadline = Instant::now() + START_TIMEOUT;
        let health = http::request("GET", "/health", &[], b"", false);
        while Instant::now() < deadline {
            if let Some(status) = self.exit_status() {
                bail!(
                    "oxlm serve exited with {status} before answering: {}",
                    self.tail().join("\n")
                );
            }
            let answer = http::exchange(self.address, &health, Duration::from_secs(5));
            if answer.is_ok_and(|r| r.status() == 200) {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        bail!("oxlm serve did not answer /health in {START_TIMEOUT:?}")
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The exit status, if the process has ended.
    pub fn exit_status(&mut self) -> Option<ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    pub fn signal(&self, signal: i32) -> Result<()> {
        send_signal(self.pid(), signal)
    }

    /// Lines of stderr that only a crash prints.
    pub fn crash_lines(&self) -> Vec<String> {
        self.log().crash_lines.clone()
    }

    pub fn tail(&self) -> Vec<String> {
        self.log().tail.clone()
    }

    fn log(&self) -> std::sync::MutexGuard<'_, Log> {
        self.log.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Waits up to `timeout` for the process to end; `None` if it is still running.
    pub fn wait_for_exit(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.exit_status() {
                // Its stderr is complete once the reader has seen the pipe close.
                if let Some(reader) = self.reader.take() {
                    let _ = reader.join();
                }
                return Some(status);
            }
            if Instant::now() > deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGTERM, then waits up to `timeout` for a clean exit (status 0). Problems found, if any.
    pub fn stop(mut self, timeout: Duration) -> Vec<String> {
        let mut problems = Vec::new();
        if let Some(status) = self.exit_status() {
            problems.push(format!("the server had already exited ({status})"));
        } else if let Err(e) = self.signal(libc::SIGTERM) {
            problems.push(format!("SIGTERM: {e}"));
        }
        match self.wait_for_exit(timeout) {
            Some(status) if status.success() => {}
            Some(status) => problems.push(format!("the server exited with {status}")),
            None => problems.push(format!(
                "the server was still running {timeout:?} after SIGTERM"
            )),
        }
        problems.extend(
            self.crash_lines()
                .into_iter()
                .map(|line| format!("server stderr: {line}")),
        );
        problems
    }
}

/// A stuck or failed run leaves no server behind.
impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Resident memory of a running process in KiB (`VmRSS`).
pub fn rss_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

/// A chat request that a healthy server answers at once.
pub fn small_chat(stream: bool) -> serde_json::Value {
    json!({"messages": [{"role": "user", "content": "Say something about the sea."}],
           "max_tokens": 8, "temperature": 0, "stream": stream})
}

/// Sends [`small_chat`] and checks the answer; what is wrong, if anything.
pub fn probe(address: SocketAddr, timeout: Duration) -> Result<(), String> {
    let request = http::post_json("/v1/chat/completions", &small_chat(false), false);
    let response = http::exchange(address, &request, timeout).map_err(|e| e.to_string())?;
    if response.status() != 200 {
        return Err(format!(
            "status {}: {}",
            response.status(),
            http::escape(&response.body, 300)
        ));
    }
    crate::openai::check_response(crate::openai::Endpoint::Chat, &response, false)
}
