//! The real `oxlm lora` binary with learning rates that cannot train: refused before the model
//! loads when they are not finite numbers above 0, and a run that diverges ends with an error
//! and no adapters of NaN.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const OXLM: &str = env!("CARGO_BIN_EXE_oxlm");

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

/// `oxlm lora --train` on the tiny llama for a few steps, saving into `adapters`.
fn lora(learning_rate: &str, adapters: &Path) -> Output {
    Command::new(OXLM)
        .arg("lora")
        .arg("--model")
        .arg(fixtures().join("tiny/llama-4bit-g64"))
        .arg("--data")
        .arg(fixtures().join("lora/data"))
        .arg("--adapter-path")
        .arg(adapters)
        .args([
            "--train",
            "--num-layers",
            "2",
            "--iters",
            "5",
            "--val-batches",
            "1",
        ])
        .arg(format!("--learning-rate={learning_rate}"))
        .output()
        .unwrap()
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

/// NaN, infinities, 0, negatives, and rates that f32 (which training computes in) makes
/// infinite or 0.
#[test]
fn learning_rates_that_cannot_train_are_refused_naming_the_flag() {
    let out = tempfile::tempdir().unwrap();
    let adapters = out.path().join("adapters");
    for rate in ["nan", "inf", "-inf", "0", "-1e-5", "1e39", "1e-50"] {
        let output = lora(rate, &adapters);
        assert_eq!(output.status.code(), Some(2), "{rate}: {}", stderr(&output));
        assert!(
            stderr(&output).contains(&format!(
                "invalid value '{rate}' for '--learning-rate <LEARNING_RATE>': expected a finite \
                 number above 0"
            )),
            "{rate}: {}",
            stderr(&output)
        );
    }
    assert!(!adapters.exists());
}

/// At a rate of 1e30 the second step's loss is NaN: the run ends there with status 1, and no
/// adapter weights are written.
#[test]
fn a_diverging_run_fails_and_saves_no_adapters() {
    let out = tempfile::tempdir().unwrap();
    let adapters = out.path().join("adapters");
    let output = lora("1e30", &adapters);
    assert_eq!(output.status.code(), Some(1), "{}", stderr(&output));
    assert!(
        stderr(&output).contains(
            "error: training diverged at iteration 2: the loss is NaN; the adapters are not \
             updated or saved from this step on"
        ),
        "{}",
        stderr(&output)
    );
    assert!(!stderr(&output).contains("panicked"), "{}", stderr(&output));
    assert!(!adapters.join("adapters.safetensors").exists());
}
