//! `oxlm fit`: its cache figures are the cache's own growth, and its predicted peak is within
//! 10% of the peak `oxlm generate` reports for the same context on the real models.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

const OXLM: &str = env!("CARGO_BIN_EXE_oxlm");

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

fn fit(model: &Path, ctx: usize, extra: &[&str]) -> Value {
    let output = Command::new(OXLM)
        .args(["fit", "--json", "--ctx", &ctx.to_string(), "--model"])
        .arg(model)
        .args(extra)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stderr}");
    serde_json::from_slice(&output.stdout).unwrap()
}

#[test]
fn the_cache_grows_as_the_model_keeps_it() {
    let report = fit(&fixtures().join("tiny/llama-4bit-g64"), 1000, &[]);
    // Two layers of 2 KV heads of 16 f16 elements, keys and values, in blocks of 256 positions.
    let per_token = 2 * 2 * 16 * 2;
    let layers = serde_json::json!([{"kind": "full_attention", "count": 2,
        "bytes_per_token": 2 * per_token, "window": null, "fixed_bytes": 0}]);
    assert_eq!(report["layers"], layers);
    assert_eq!(report["cache_bytes_at_ctx"], 2 * per_token * 1024);
    assert_eq!(report["ctx"], 1000);
    assert_eq!(report["prefill_chunk_tokens"], 1000);
    let peak = report["predicted_peak_bytes"].as_u64().unwrap();
    let loaded = report["loaded_bytes"].as_u64().unwrap();
    assert!(peak > loaded + 2 * per_token as u64 * 1024);
    assert!(report["bandwidth_bytes_per_second"].as_f64().unwrap() > 1e8);
    assert!(report["sequences_at_ctx"].as_u64().unwrap() > 1);
}

/// Llama 4's chunked layers (a ring of a chunk, 8 in the fixture) beside its global one, and a
/// Mamba-2 hybrid's recurrent layers, whose state does not grow.
#[test]
fn chunked_and_recurrent_layers_are_named_as_they_keep_their_caches() {
    let per_token = 2 * 2 * 16 * 2;
    let report = fit(&fixtures().join("tiny/llama4-4bit-g32"), 1000, &[]);
    let layers = serde_json::json!([
        {"kind": "chunked_attention", "count": 3, "bytes_per_token": 3 * per_token,
         "window": 8, "fixed_bytes": 0},
        {"kind": "full_attention", "count": 1, "bytes_per_token": per_token, "window": null,
         "fixed_bytes": 0}]);
    assert_eq!(report["layers"], layers);
    let report = fit(
        &fixtures().join("tiny/granitemoehybrid-4bit-g32"),
        1000,
        &[],
    );
    // Conv inputs [3, 256] and states [8, 16, 32], f32.
    let state = 4 * (3 * 256 + 8 * 16 * 32);
    let layers = serde_json::json!([
        {"kind": "recurrent", "count": 3, "bytes_per_token": 0, "window": null,
         "fixed_bytes": 3 * state},
        {"kind": "full_attention", "count": 1, "bytes_per_token": per_token, "window": null,
         "fixed_bytes": 0}]);
    assert_eq!(report["layers"], layers);
}

#[test]
fn a_missing_model_is_a_clear_error() {
    let output = Command::new(OXLM)
        .args(["fit", "--model", "/nonexistent/model"])
        .output()
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("/nonexistent/model") && !stderr.contains("panicked"),
        "{stderr}"
    );
}

fn real_model(name: &str) -> Option<PathBuf> {
    let dir = oxlm_runtime::hub::cache_root()?.join("models").join(name);
    dir.join("config.json").exists().then_some(dir)
}

/// `generate`'s prompt tokens and its peak memory in bytes, for a prompt of `words` words.
fn generate_peak(model: &Path, words: usize, max_tokens: usize, extra: &[&str]) -> (usize, f64) {
    let prompt = vec!["hello world"; words / 2].join(" ");
    let output = Command::new(OXLM)
        .args(["generate", "--ignore-chat-template", "--max-tokens"])
        .arg(max_tokens.to_string())
        .arg("--model")
        .arg(model)
        .args(["--prompt", &prompt])
        .args(extra)
        .output()
        .unwrap();
    assert!(output.status.success());
    let stdout = String::from_utf8_lossy(&output.stdout);
    let field = |name: &str| -> &str {
        let line = stdout.lines().find(|l| l.starts_with(name)).unwrap();
        line[name.len()..].split_whitespace().next().unwrap()
    };
    let prompt_tokens = field("Prompt:").parse().unwrap();
    let peak_gb: f64 = field("Peak memory:").parse().unwrap();
    (prompt_tokens, peak_gb * 1e9)
}

#[test]
fn the_predicted_peak_is_within_a_tenth_of_generates() {
    let names = [
        "smollm2-135m-instruct-4bit",
        "qwen2.5-coder-0.5b-instruct-4bit",
        // Its load passes through more than it keeps, and that is its peak.
        "gemma-3-270m-4bit",
    ];
    // A 4-bit cache too, quantized once the first chunk has gone through, which is held
    // unquantized until then (the larger of the two at 4,000 tokens of SmolLM2).
    let quantized = (
        ["--kv-bits", "4", "--quantized-kv-start", "0"],
        ["--kv-bits", "4"],
    );
    let runs = names.iter().flat_map(|&name| {
        let plain = [(name, 500, &[][..], &[][..]), (name, 4000, &[], &[])];
        let q4 = (name == names[0]).then_some((name, 4000, &quantized.0[..], &quantized.1[..]));
        plain.into_iter().chain(q4)
    });
    for (name, words, generate_flags, fit_flags) in runs {
        let Some(dir) = real_model(name) else {
            continue;
        };
        let (prompt, measured) = generate_peak(&dir, words, 16, generate_flags);
        let report = fit(&dir, prompt + 16, fit_flags);
        let predicted = report["predicted_peak_bytes"].as_f64().unwrap();
        let error = predicted / measured - 1.0;
        println!(
            "{} {fit_flags:?}: {prompt} tokens: predicted {predicted:.3e}, measured \
             {measured:.3e} ({:+.1}%)",
            dir.display(),
            100.0 * error
        );
        assert!(error.abs() < 0.1, "{}: {error}", dir.display());
    }
}
