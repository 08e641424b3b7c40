//! `oxlm`: the command line. Each verb parses its arguments and calls the runtime.

mod generate;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "oxlm",
    version,
    about = "Run MLX-format LLMs (mlx-community 4/8-bit checkpoints) on CPUs, mlx-lm compatible."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate text from a prompt, as `mlx_lm.generate` does.
    Generate(generate::Args),
}

fn main() {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Generate(args) => generate::run(args),
    };
    if let Err(err) = result {
        eprintln!("error: {err:#}");
        std::process::exit(1);
    }
}
