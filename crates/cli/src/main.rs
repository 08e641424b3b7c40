//! `oxlm`: the command line. Each verb parses its arguments and calls the runtime.

/// `println!` for the verbs' reports: ends the process where `println!` would panic, quietly
/// when the output was closed (`| head`), with an error when it cannot be written (a full disk).
macro_rules! say {
    ($($arg:tt)*) => { crate::say(format_args!($($arg)*)) };
}

mod bench;
mod cache_prompt;
mod convert;
mod embed;
mod fit;
mod fuse;
mod generate;
mod kv_cache;
mod lora;
mod serve;

use clap::{Parser, Subcommand};
use oxlm_engine::Device;
use oxlm_runtime::sampler::MIN_TEMPERATURE;

#[derive(Parser)]
#[command(
    name = "oxlm",
    version,
    about = "Run MLX-format LLMs (mlx-community 4/8-bit checkpoints) on CPUs and NVIDIA GPUs, mlx-lm compatible."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate text from a prompt, as `mlx_lm.generate` does.
    Generate(generate::Args),
    /// Save the model's state after a prompt to a file, as `mlx_lm.cache_prompt` does, for
    /// `generate --prompt-cache-file` to continue from.
    CachePrompt(cache_prompt::Args),
    /// Convert a Hugging Face model to MLX format (optionally quantized), as `mlx_lm.convert`
    /// does.
    Convert(convert::Args),
    /// What a model needs in memory on a device, and the context, sequences and decode speed
    /// that fit there.
    Fit(fit::Args),
    /// Merge LoRA adapters into a new MLX checkpoint, as `mlx_lm.fuse` does.
    Fuse(fuse::Args),
    /// Fine-tune LoRA adapters, as `mlx_lm.lora` does.
    Lora(lora::Args),
    /// Serve the OpenAI API over HTTP, as `mlx_lm.server` does.
    Serve(serve::Args),
    /// Embed texts with an embedding model (Qwen3-Embedding), as sentence-transformers does.
    Embed(embed::Args),
    /// Time prefill and decode on fixed token ids (for benches/).
    #[command(hide = true)]
    Bench(bench::Args),
}

/// `--device`: `cpu` (the default), `cuda` (GPU 0) or `cuda:N`, opened as it is parsed so that a
/// missing driver is reported before any weights are read.
fn parse_device(spec: &str) -> Result<Device, String> {
    Device::open(spec).map_err(|e| e.to_string())
}

/// The most `--threads` a kernel pool takes: more is a typo, which would exhaust the process's
/// threads rather than speed anything up.
const MAX_THREADS: usize = 1024;

fn parse_threads(spec: &str) -> Result<usize, String> {
    match spec.parse::<usize>() {
        Ok(n @ 1..=MAX_THREADS) => Ok(n),
        _ => Err(format!(
            "`{spec}`: expected a thread count from 1 to {MAX_THREADS}"
        )),
    }
}

/// A sampling temperature: 0 (greedy), or one whose sampling stays finite (the server's range).
fn parse_temperature(spec: &str) -> Result<f32, String> {
    match spec.parse::<f32>() {
        Ok(t) if t == 0.0 || (MIN_TEMPERATURE..=f32::MAX).contains(&t) => Ok(t),
        _ => Err(format!(
            "`{spec}`: expected 0 (greedy) or a number from {MIN_TEMPERATURE:?} to {:?}",
            f32::MAX
        )),
    }
}

/// `--top-p` and `--min-p`: a number from 0 to 1.
fn parse_probability(spec: &str) -> Result<f32, String> {
    match spec.parse::<f32>() {
        Ok(p) if (0.0..=1.0).contains(&p) => Ok(p),
        _ => Err(format!("`{spec}`: expected a number from 0 to 1")),
    }
}

/// The LoRA adapters of `dir` for `model`, when given.
fn load_adapters(
    dir: Option<&std::path::Path>,
    model: &dyn oxlm_models::LanguageModel,
) -> anyhow::Result<Option<oxlm_models::lora::Adapters>> {
    use anyhow::Context;
    dir.map(|dir| {
        oxlm_models::lora::Adapters::load(dir, model)
            .with_context(|| format!("loading adapters from {}", dir.display()))
    })
    .transpose()
}

/// On SIGINT or SIGTERM, removes the weight files still being written, then ends the process as
/// the signal would have. Left to the signal alone, the process would end at once and leave a
/// temporary file as large as the model behind.
fn remove_partial_files_on_signal() -> anyhow::Result<()> {
    use anyhow::Context;
    use signal_hook::consts::{SIGINT, SIGTERM};
    use signal_hook::iterator::Signals;
    use signal_hook::low_level::{emulate_default_handler, exit};
    let mut signals =
        Signals::new([SIGINT, SIGTERM]).context("installing the SIGINT/SIGTERM handler")?;
    std::thread::spawn(move || {
        if let Some(signal) = signals.forever().next() {
            oxlm_models::save::remove_partial_files_before_exit();
            let _ = emulate_default_handler(signal);
            // Reached only where the signal's default action could not be restored.
            exit(128 + signal);
        }
    });
    Ok(())
}

fn say(line: std::fmt::Arguments) {
    use std::io::Write;
    if let Err(err) = writeln!(std::io::stdout().lock(), "{line}") {
        fail(anyhow::Error::new(err).context("writing the output"));
    }
}

/// Ends the process for `err`: quietly where the output was closed (`oxlm generate | head`),
/// as whoever closed it has what they wanted; else with the error and status 1.
fn fail(err: anyhow::Error) -> ! {
    let closed = err.chain().any(|cause| {
        cause
            .downcast_ref::<std::io::Error>()
            .is_some_and(|e| e.kind() == std::io::ErrorKind::BrokenPipe)
    });
    if closed {
        std::process::exit(0);
    }
    eprintln!("error: {}", message(&err));
    std::process::exit(1);
}

/// The error and its causes, `: `-separated, each cause left out where the message before it
/// already ends with it (the library errors name their source in their own message).
fn message(err: &anyhow::Error) -> String {
    let mut text = String::new();
    for cause in err.chain() {
        let cause = cause.to_string();
        if !text.ends_with(&cause) {
            if !text.is_empty() {
                text.push_str(": ");
            }
            text.push_str(&cause);
        }
    }
    text
}

fn main() {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Generate(args) => generate::run(args),
        Command::CachePrompt(args) => cache_prompt::run(args),
        Command::Convert(args) => convert::run(args),
        Command::Fuse(args) => fuse::run(args),
        Command::Lora(args) => lora::run(args),
        Command::Serve(args) => serve::run(args),
        Command::Embed(args) => embed::run(args),
        Command::Fit(args) => fit::run(args),
        Command::Bench(args) => bench::run(args),
    };
    if let Err(err) = result {
        fail(err);
    }
}
