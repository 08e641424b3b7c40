//! `oxlm convert --gguf` and `--model FILE.gguf` on the real Q4_K_M GGUFs of the model cache
//! (scripts/models/fetch_gguf.sh): their K-quant weights are quantized again, so they are held to
//! answering sensibly rather than to the oracle's bytes (SmolLM2's lossless file is, in
//! crates/convert/tests/gguf_convert.rs); and a GGUF given to `--model` is converted once.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const OXLM: &str = env!("CARGO_BIN_EXE_oxlm");

/// A GGUF of the model cache, which must be there: a missing one fails the test.
fn gguf(name: &str) -> PathBuf {
    let cache = std::env::var_os("OXLM_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(std::env::var_os("HOME").unwrap()).join(".cache/oxlm"));
    let path = cache.join("gguf").join(name);
    assert!(
        path.exists(),
        "{} is missing: run scripts/models/fetch_gguf.sh",
        path.display()
    );
    path
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

/// Greedy text of `model` for `prompt`, between mlx-lm's `==========` lines.
fn answer(model: &Path, prompt: &str, extra: &[&str], cache: &Path) -> (String, Output) {
    let output = Command::new(OXLM)
        .args([
            "generate",
            "--max-tokens",
            "48",
            "--temp",
            "0",
            "--prompt",
            prompt,
            "--model",
        ])
        .arg(model)
        .args(extra)
        .env("OXLM_CACHE", cache)
        .output()
        .unwrap();
    assert!(output.status.success(), "{}", stderr(&output));
    let text = String::from_utf8_lossy(&output.stdout);
    let body = text
        .split("==========")
        .nth(1)
        .unwrap_or_default()
        .trim()
        .to_string();
    (body, output)
}

fn convert(gguf: &Path, dst: &Path) -> Output {
    let output = Command::new(OXLM)
        .arg("convert")
        .arg("--gguf")
        .arg(gguf)
        .arg("--mlx-path")
        .arg(dst)
        .output()
        .unwrap();
    assert!(output.status.success(), "{}", stderr(&output));
    output
}

#[test]
fn qwen_coder_and_gemma_convert_and_answer_sensibly() {
    let scratch = tempfile::tempdir().unwrap();
    let qwen = scratch.path().join("qwen");
    let report = convert(&gguf("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"), &qwen);
    let printed = String::from_utf8_lossy(&report.stdout);
    assert!(printed.contains("relative RMS error"), "{printed}");
    let (code, _) = answer(
        &qwen,
        "Write a Python function add(a, b) that returns the sum of a and b.",
        &[],
        scratch.path(),
    );
    assert!(
        code.contains("def add(a, b):") && code.contains("return a + b"),
        "{code}"
    );

    let gemma = scratch.path().join("gemma");
    convert(&gguf("gemma-3-270m-q4_k_m.gguf"), &gemma);
    // A base model, without a chat template: the prompt is continued as it is.
    let (text, _) = answer(&gemma, "Paris is the capital of", &[], scratch.path());
    assert!(text.starts_with("France"), "{text}");
}

#[test]
fn a_gguf_given_as_the_model_converts_once_into_the_cache() {
    let scratch = tempfile::tempdir().unwrap();
    let file = gguf("SmolLM2-135M-Instruct.Q4_1.gguf");
    let (first, output) = answer(&file, "What is the capital of France?", &[], scratch.path());
    assert!(
        stderr(&output).contains("Converting"),
        "{}",
        stderr(&output)
    );
    let (again, output) = answer(&file, "What is the capital of France?", &[], scratch.path());
    assert!(
        !stderr(&output).contains("Converting"),
        "{}",
        stderr(&output)
    );
    assert_eq!(first, again);
    assert!(first.contains("Paris"), "{first}");
    let converted: Vec<_> = std::fs::read_dir(scratch.path().join("gguf-mlx"))
        .unwrap()
        .collect();
    assert_eq!(converted.len(), 1);
}
