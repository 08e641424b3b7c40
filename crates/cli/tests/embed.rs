//! The real `oxlm embed` binary on the tiny Qwen3-Embedding fixture: its JSON lines hold the
//! oracle's vectors (scripts/oracle/make_embedding_fixture.py), texts come from `--text` and
//! `--file -`, prompts by name; and a model that cannot embed is an error saying so.

use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Output, Stdio};

use serde_json::Value;

const OXLM: &str = env!("CARGO_BIN_EXE_oxlm");

/// As the runtime's parity test (`crates/runtime/tests/embed.rs`); the shortest decimals printed
/// read back as the same f32s.
const TOLERANCE: f32 = 1e-5;

fn tiny() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny")
}

fn fixture() -> PathBuf {
    tiny().join("embedding/qwen3-embedding-8bit-g128")
}

fn embed(model: PathBuf, args: &[&str], stdin: &str) -> Output {
    let mut child = Command::new(OXLM)
        .arg("embed")
        .arg("--model")
        .arg(model)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut input = child.stdin.take().unwrap();
    input.write_all(stdin.as_bytes()).unwrap();
    drop(input);
    child.wait_with_output().unwrap()
}

fn golden_inputs() -> Vec<Value> {
    let text = std::fs::read_to_string(fixture().join("embeddings.json")).unwrap();
    let golden: Value = serde_json::from_str(&text).unwrap();
    golden["inputs"].as_array().unwrap().clone()
}

fn assert_close(got: &Value, want: &Value, what: &str) {
    let got: Vec<f32> = serde_json::from_value(got.clone()).unwrap();
    let want: Vec<f32> = serde_json::from_value(want.clone()).unwrap();
    assert_eq!(got.len(), want.len(), "{what}: length");
    let worst = got
        .iter()
        .zip(&want)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert!(worst <= TOLERANCE, "{what}: max |Δ| {worst} > {TOLERANCE}");
}

#[test]
fn json_lines_hold_the_oracles_embeddings() {
    let golden = golden_inputs();
    let plain: Vec<&Value> = golden
        .iter()
        .filter(|input| input["prompt_name"] != "query")
        .collect();
    let (first, rest) = plain.split_first().unwrap();
    // The first text from --text, the others from standard input, one per line.
    let lines: Vec<&str> = rest.iter().map(|i| i["text"].as_str().unwrap()).collect();
    let text = first["text"].as_str().unwrap();
    let output = embed(
        fixture(),
        &["--text", text, "--file", "-"],
        &lines.join("\n"),
    );
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let stdout = String::from_utf8(output.stdout).unwrap();
    let printed: Vec<Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(printed.len(), plain.len());
    for (index, (line, input)) in printed.iter().zip(&plain).enumerate() {
        assert_eq!(line["index"], index);
        assert_eq!(line["text"], input["text"]);
        assert_eq!(line["tokens"], input["ids"].as_array().unwrap().len());
        assert_close(
            &line["embedding"],
            &input["last_token"],
            &line["text"].to_string(),
        );
    }

    let query = golden.iter().find(|i| i["prompt_name"] == "query").unwrap();
    let text = query["text"].as_str().unwrap();
    let args = [
        "--prompt-name",
        "query",
        "--dimensions",
        "32",
        "--text",
        text,
    ];
    let output = embed(fixture(), &args, "");
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let line: Value = serde_json::from_slice(&output.stdout).unwrap();
    assert_close(&line["embedding"], &query["last_token_dimensions_32"], text);
}

#[test]
fn a_model_that_cannot_embed_is_an_error() {
    let output = embed(tiny().join("qwen3-8bit-g128"), &["--text", "hi"], "");
    assert_eq!(output.status.code(), Some(1));
    let stderr = String::from_utf8(output.stderr).unwrap();
    assert!(
        stderr.ends_with(
            "qwen3-8bit-g128 cannot embed: it has no sentence-transformers modules.json, and \
             config.json's `architectures` names no bare `*Model` (a model without a \
             language-model head)\n"
        ),
        "{stderr}"
    );
    assert!(output.stdout.is_empty());
}
