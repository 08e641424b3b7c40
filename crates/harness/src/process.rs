//! Running `oxlm` commands: with a deadline, a memory limit, and a verdict on how they ended.

use std::io::Read;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};

/// Lines of stderr that only a crash prints.
const CRASH_MARKERS: [&str; 5] = [
    "panicked at",
    "stack backtrace",
    "fatal runtime error",
    "memory allocation of",
    "Aborted",
];

pub fn is_crash_line(line: &str) -> bool {
    CRASH_MARKERS.iter().any(|marker| line.contains(marker))
}

pub fn send_signal(pid: u32, signal: i32) -> Result<()> {
    let pid = libc::pid_t::try_from(pid).context("process id")?;
    // SAFETY: kill(2) takes plain integers and touches no memory of ours.
    if unsafe { libc::kill(pid, signal) } != 0 {
        return Err(std::io::Error::last_os_error()).context("kill");
    }
    Ok(())
}

/// Caps the address space of the command's process (an absurd config must be refused, not
/// allowed to take the machine's memory) and turns off core dumps.
pub fn limit_memory(command: &mut Command, bytes: u64) {
    let memory = libc::rlimit {
        rlim_cur: bytes,
        rlim_max: bytes,
    };
    let no_core = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: between fork and exec the closure only calls setrlimit(2), which is
    // async-signal-safe, and allocates nothing.
    unsafe {
        command.pre_exec(move || {
            if libc::setrlimit(libc::RLIMIT_AS, &memory) != 0
                || libc::setrlimit(libc::RLIMIT_CORE, &no_core) != 0
            {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

/// How a finished (or stopped) command ended, and what it printed.
pub struct Finished {
    /// `None`: killed at the deadline.
    pub status: Option<ExitStatus>,
    pub stdout: String,
    pub stderr: String,
    pub elapsed: Duration,
}

impl Finished {
    /// What is wrong with how it ended, whether it succeeded or not: a timeout, a signal, a
    /// panic, or an error with no message.
    pub fn crash(&self) -> Option<(&'static str, String)> {
        let Some(status) = self.status else {
            return Some(("timeout", format!("still running after {:?}", self.elapsed)));
        };
        let crash_line = self.stderr.lines().find(|l| is_crash_line(l)).unwrap_or("");
        if let Some(signal) = status.signal() {
            let name = if signal == libc::SIGABRT {
                "abort"
            } else {
                "signal"
            };
            return Some((name, format!("killed by signal {signal}: {crash_line}")));
        }
        if !crash_line.is_empty() {
            return Some(("panic", crash_line.to_owned()));
        }
        if status.code() == Some(101) {
            return Some(("panic", "exit status 101".into()));
        }
        if !status.success() && self.stderr.trim().is_empty() {
            return Some(("silent-error", format!("{status} with nothing on stderr")));
        }
        None
    }
}

/// Runs `command` to its end or to `timeout`, whichever comes first (then kills it).
pub fn run_with_timeout(command: &mut Command, timeout: Duration) -> Result<Finished> {
    let started = Instant::now();
    let mut child = command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("starting {:?}", command.get_program()))?;
    let stdout = read_in_background(child.stdout.take());
    let stderr = read_in_background(child.stderr.take());
    let status = wait_until(&mut child, started + timeout);
    if status.is_none() {
        let _ = child.kill();
        let _ = child.wait();
    }
    Ok(Finished {
        status,
        stdout: stdout.join().unwrap_or_default(),
        stderr: stderr.join().unwrap_or_default(),
        elapsed: started.elapsed(),
    })
}

/// The exit status, or `None` if the process still runs at `deadline`.
pub fn wait_until(child: &mut Child, deadline: Instant) -> Option<ExitStatus> {
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            return Some(status);
        }
        if Instant::now() >= deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn read_in_background(pipe: Option<impl Read + Send + 'static>) -> std::thread::JoinHandle<String> {
    std::thread::spawn(move || {
        let mut bytes = Vec::new();
        if let Some(mut pipe) = pipe {
            let _ = pipe.read_to_end(&mut bytes);
        }
        String::from_utf8_lossy(&bytes).into_owned()
    })
}
