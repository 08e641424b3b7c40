//! `oxlm-harness`: proves that the `oxlm` binary stays up and answers cleanly under hostile
//! input. It drives the real binary as a user would, on tiny fixture models: each subcommand
//! prints a table of what it saw, then one summary line, and exits 1 on any failure (2 when the
//! harness itself could not run).

mod anthropic;
mod checkpoints;
mod http;
mod load;
mod model;
mod openai;
mod process;
mod report;
mod requests;
mod responses_api;
mod restart;
mod safetensors;
mod server;
mod slow_clients;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "oxlm-harness",
    about = "Robustness harness for the oxlm binary"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Fuzz every endpoint of `oxlm serve` (its OpenAI, Anthropic and Responses APIs) with
    /// malformed, hostile and boundary requests.
    Requests(requests::Args),
    /// Run `oxlm generate` on corrupted copies of a fixture model.
    Checkpoints(checkpoints::Args),
    /// Many concurrent clients, some leaving mid-stream, with the server's memory sampled.
    Load(load::Args),
    /// Half-sent heads, stalled bodies, idle and unread connections, hundreds held at once.
    SlowClients(slow_clients::Args),
    /// SIGTERM to the server in every phase of a request, restarts, and kill -9 during fuse and
    /// convert.
    Restart(restart::Args),
}

fn main() -> ExitCode {
    let result = match Cli::parse().command {
        Command::Requests(args) => requests::run(args),
        Command::Checkpoints(args) => checkpoints::run(args),
        Command::Load(args) => load::run(args),
        Command::SlowClients(args) => slow_clients::run(args),
        Command::Restart(args) => restart::run(args),
    };
    match result {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(e) => {
            eprintln!("oxlm-harness: {e:#}");
            ExitCode::from(2)
        }
    }
}
