//! `oxlm`: the command line. Each verb parses its arguments and calls the runtime.

mod bench;
mod fuse;
mod generate;
mod lora;
mod serve;

use clap::{Parser, Subcommand};
use oxlm_engine::{Device, KvPrecision};

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
    /// Merge LoRA adapters into a new MLX checkpoint, as `mlx_lm.fuse` does.
    Fuse(fuse::Args),
    /// Fine-tune LoRA adapters, as `mlx_lm.lora` does.
    Lora(lora::Args),
    /// Serve the OpenAI API over HTTP, as `mlx_lm.server` does.
    Serve(serve::Args),
    /// Time prefill and decode on fixed token ids (for benches/).
    #[command(hide = true)]
    Bench(bench::Args),
}

/// `--device`: `cpu` (the default), `cuda` (GPU 0) or `cuda:N`, opened as it is parsed so that a
/// missing driver is reported before any weights are read.
fn parse_device(spec: &str) -> Result<Device, String> {
    Device::open(spec).map_err(|e| e.to_string())
}

const KV_CACHE_HELP: &str = "How the cache keeps keys and values: f16 (the default: half the \
    memory, and long contexts decode faster), f32 (exactly what the layers computed, as \
    mlx-lm's f32 run keeps them) or q8 (8-bit codes per group of 64, as mlx-lm's --kv-bits 8 \
    from the first token: under a third of f32's memory; head dims must be multiples of 64; \
    on the CPU only, a GPU keeps f16)";

fn parse_kv_cache(spec: &str) -> Result<KvPrecision, String> {
    match spec {
        "f16" => Ok(KvPrecision::F16),
        "f32" => Ok(KvPrecision::F32),
        "q8" => Ok(KvPrecision::Q8),
        _ => Err(format!("`{spec}`: expected f16, f32 or q8")),
    }
}

fn main() {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Generate(args) => generate::run(args),
        Command::Fuse(args) => fuse::run(args),
        Command::Lora(args) => lora::run(args),
        Command::Serve(args) => serve::run(args),
        Command::Bench(args) => bench::run(args),
    };
    if let Err(err) = result {
        eprintln!("error: {err:#}");
        std::process::exit(1);
    }
}
