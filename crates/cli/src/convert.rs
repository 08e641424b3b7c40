//! `oxlm convert`: a drop-in for `mlx_lm.convert`, writing an MLX checkpoint from a Hugging Face
//! one (optionally quantized) or a llama.cpp GGUF file, or a quantized MLX checkpoint back to
//! dense weights.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use oxlm_convert::arrays::Progress;
use oxlm_convert::from_gguf::convert_gguf;
use oxlm_convert::quantize::{QuantRequest, Recipe};
use oxlm_convert::{convert, ConvertOptions};
use oxlm_engine::quant::QuantMode;
use oxlm_engine::DType;
use oxlm_runtime::hub::resolve_model;

#[derive(clap::Args)]
pub struct Args {
    /// The model to convert: a local directory, or a Hugging Face repo id (org/name or
    /// org/name@revision) fetched into the Hugging Face cache.
    #[arg(
        long,
        visible_alias = "model",
        required_unless_present = "gguf",
        conflicts_with = "gguf"
    )]
    hf_path: Option<PathBuf>,
    /// A llama.cpp GGUF file to convert instead (llama, qwen2, qwen3, gemma3): its config,
    /// tokenizer and chat template come from its metadata. Q4_0, Q4_1 and Q8_0 weights are kept
    /// without loss (affine, groups of 32); other block types are quantized again at --q-bits
    /// and --q-group-size (4 and 64 by default) and the error that adds is reported; with -q or
    /// those flags, float weights are quantized too.
    #[arg(long)]
    gguf: Option<PathBuf>,
    /// Where to write the MLX model. It must not exist, unless --force is given.
    #[arg(long, default_value = "mlx_model")]
    mlx_path: PathBuf,
    /// Quantize the weights (4 bits in groups of 64 unless told otherwise).
    #[arg(short = 'q', long)]
    quantize: bool,
    /// Group size for quantization: 32, 64 (affine's default) or 128.
    #[arg(long)]
    q_group_size: Option<usize>,
    /// Bits per weight for quantization: 2, 3, 4 (affine's default), 5, 6 or 8.
    #[arg(long)]
    q_bits: Option<u32>,
    /// The quantization mode: affine, or the float formats mxfp4, nvfp4, mxfp8.
    #[arg(long, default_value = "affine", value_parser = ["affine", "mxfp4", "nvfp4", "mxfp8"])]
    q_mode: String,
    /// A mixed-bit recipe: the value and down projections of some layers, and the head, get
    /// the higher bits (mixed_3_6: 3 and 6 bits), after llama.cpp's Q4_K_M.
    #[arg(long, value_parser = ["mixed_2_6", "mixed_3_4", "mixed_3_6", "mixed_4_6"])]
    quant_predicate: Option<String>,
    /// The float type of the weights that are not quantized; by default config.json's
    /// `torch_dtype`.
    #[arg(long, value_parser = ["float16", "bfloat16", "float32"])]
    dtype: Option<String>,
    /// Write a quantized model's weights dense.
    #[arg(short = 'd', long)]
    dequantize: bool,
    /// Replace --mlx-path if it exists (the old model stays until the new one is complete).
    #[arg(long)]
    force: bool,
    /// Accepted for mlx-lm's command lines; oxlm never runs a model's own Python code.
    #[arg(long)]
    trust_remote_code: bool,
    /// mlx-lm uploads the result to the Hugging Face hub; oxlm does not.
    #[arg(long, hide = true)]
    upload_repo: Option<String>,
    /// The largest weight file, in bytes (mlx-lm's 5 GiB by default).
    #[arg(long, hide = true)]
    max_shard_bytes: Option<usize>,
}

pub fn run(args: Args) -> Result<()> {
    if args.upload_repo.is_some() {
        bail!("--upload-repo: oxlm does not upload; use `huggingface-cli upload` on the result");
    }
    crate::remove_partial_files_on_signal()?;
    let mode = QuantMode::from_name(&args.q_mode).expect("clap checked the mode");
    let quantize_flags = args.q_bits.is_some()
        || args.q_group_size.is_some()
        || args.quant_predicate.is_some()
        || mode != QuantMode::Affine;
    // A GGUF's K-quant weights are always quantized again, so the flags alone say how.
    if quantize_flags && !args.quantize && args.gguf.is_none() {
        bail!("--q-bits, --q-group-size, --q-mode and --quant-predicate need -q (--quantize)");
    }
    let options = ConvertOptions {
        quantize: (args.quantize || quantize_flags).then(|| QuantRequest {
            bits: args.q_bits,
            group_size: args.q_group_size,
            mode,
            recipe: args.quant_predicate.as_deref().and_then(Recipe::from_name),
        }),
        dtype: args.dtype.as_deref().map(|d| match d {
            "float16" => DType::F16,
            "bfloat16" => DType::BF16,
            _ => DType::F32,
        }),
        dequantize: args.dequantize,
        force: args.force,
        max_shard_bytes: args
            .max_shard_bytes
            .unwrap_or(ConvertOptions::default().max_shard_bytes),
    };
    if args.mlx_path.exists() && !args.force {
        bail!(
            "{} already exists: choose another --mlx-path, or pass --force to replace it",
            args.mlx_path.display()
        );
    }
    say!("[INFO] Loading");
    let bar = ProgressBar::new(0).with_style(
        ProgressStyle::with_template("{bar:40} {bytes}/{total_bytes} ({eta})")
            .expect("a valid template"),
    );
    let mut progress = |p: Progress| {
        bar.set_length(p.total_bytes as u64);
        bar.set_position(p.done_bytes as u64);
    };
    let report = match (&args.gguf, &args.hf_path) {
        (Some(gguf), _) => {
            let (report, requantized) = convert_gguf(gguf, &args.mlx_path, &options, &mut progress)
                .with_context(|| format!("converting {}", gguf.display()))?;
            if requantized.tensors > 0 {
                bar.suspend(|| {
                    say!(
                        "[INFO] Quantized {} {} tensors again: relative RMS error {:.4}",
                        requantized.tensors,
                        requantized.types.join("/"),
                        requantized.relative_rms_error
                    )
                });
            }
            report
        }
        (None, Some(hf_path)) => {
            let src = resolve_model(hf_path)?;
            convert(&src, &args.mlx_path, &options, &mut progress)
                .with_context(|| format!("converting {}", hf_path.display()))?
        }
        (None, None) => unreachable!("clap requires one of them"),
    };
    bar.finish_and_clear();
    if report.quantized > 0 {
        say!(
            "[INFO] Quantized model with {:.3} bits per weight.",
            report.bits_per_weight
        );
    }
    say!(
        "[INFO] Wrote {} ({} arrays, {:.1} MB in {} weight file{})",
        args.mlx_path.display(),
        report.arrays,
        report.bytes as f64 / 1e6,
        report.weight_files.len(),
        if report.weight_files.len() == 1 {
            ""
        } else {
            "s"
        }
    );
    Ok(())
}
