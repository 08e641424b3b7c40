//! `oxlm fuse`: a drop-in for `mlx_lm.fuse`, merging LoRA adapters into a new MLX checkpoint.

use std::path::PathBuf;

use anyhow::{Context, Result};
use oxlm_models::fuse::fuse;
use oxlm_runtime::hub::resolve_model;

#[derive(clap::Args)]
pub struct Args {
    /// The MLX model the adapters were trained on: a local directory, or a Hugging Face repo id
    /// (org/name or org/name@revision) fetched into the Hugging Face cache.
    #[arg(long, default_value = "mlx_model")]
    model: PathBuf,
    /// Where to write the fused model.
    #[arg(long, default_value = "fused_model")]
    save_path: PathBuf,
    /// The adapter directory (adapter_config.json, adapters.safetensors).
    #[arg(long, default_value = "adapters")]
    adapter_path: PathBuf,
    /// Write every weight dense (in the scales' dtype) instead of re-quantizing.
    #[arg(long, alias = "dequantize")]
    de_quantize: bool,
}

pub fn run(args: Args) -> Result<()> {
    crate::remove_partial_files_on_signal()?;
    say!("Loading pretrained model");
    let report = fuse(
        &resolve_model(&args.model)?,
        &args.adapter_path,
        &args.save_path,
        args.de_quantize,
    )
    .with_context(|| {
        format!(
            "fusing {} into {}",
            args.adapter_path.display(),
            args.model.display()
        )
    })?;
    if args.de_quantize {
        say!("Dequantizing model");
    }
    say!(
        "Fused {} adapted layers into {} ({} weight file{})",
        report.fused_layers,
        args.save_path.display(),
        report.weight_files.len(),
        if report.weight_files.len() == 1 {
            ""
        } else {
            "s"
        }
    );
    Ok(())
}
