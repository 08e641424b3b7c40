//! The real `oxlm generate` binary with outputs and arguments that used to end it in a panic or
//! an abort: a reader that closes the pipe early, a full disk, and out-of-range numbers; and how
//! an error reads.

use std::io::Read;
use std::path::PathBuf;
use std::process::{Command, Output, Stdio};

const OXLM: &str = env!("CARGO_BIN_EXE_oxlm");

fn model() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny/llama-4bit-g64")
}

fn generate(extra: &[&str]) -> Command {
    let mut command = Command::new(OXLM);
    command
        .arg("generate")
        .arg("--model")
        .arg(model())
        .args(["--prompt", "Write one sentence about the sea."])
        .args(extra);
    command
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

/// `oxlm generate | head -c 10`: the reader leaves, and generation ends quietly.
#[test]
fn a_reader_closing_the_pipe_ends_generation_quietly() {
    let mut child = generate(&["--max-tokens", "200"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut first = [0u8; 10];
    child.stdout.take().unwrap().read_exact(&mut first).unwrap();
    // The pipe's reading end is dropped here, as `head` exits.
    let output = child.wait_with_output().unwrap();
    assert!(
        output.status.success(),
        "{:?}: {}",
        output.status,
        stderr(&output)
    );
    assert!(!stderr(&output).contains("panicked"), "{}", stderr(&output));
}

/// `oxlm generate > /dev/full`: an error naming the cause, not a panic.
#[test]
fn an_output_that_cannot_be_written_is_an_error() {
    let full = std::fs::OpenOptions::new()
        .write(true)
        .open("/dev/full")
        .unwrap();
    let output = generate(&["--max-tokens", "5"])
        .stdout(full)
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(1), "{}", stderr(&output));
    assert!(
        stderr(&output).contains("No space left on device"),
        "{}",
        stderr(&output)
    );
    assert!(!stderr(&output).contains("panicked"), "{}", stderr(&output));
}

/// Numbers the sampler or the thread pool cannot take are refused before the model loads.
#[test]
fn out_of_range_numbers_are_refused_naming_them() {
    for (flag, value) in [
        ("--threads", "100000"),
        ("--threads", "0"),
        ("--top-p", "2"),
        ("--top-p", "nan"),
        ("--min-p", "-0.5"),
        ("--temp", "inf"),
        ("--temp", "-1"),
        ("--temp", "1e-45"),
        ("--temp", "1e39"),
    ] {
        let output = generate(&[&format!("{flag}={value}")]).output().unwrap();
        let message = stderr(&output);
        assert_eq!(output.status.code(), Some(2), "{flag} {value}: {message}");
        assert!(
            message.contains(&format!("`{value}`")),
            "{flag} {value}: {message}"
        );
    }
}

/// An error names each cause once, though the library errors carry their source in their own
/// message too.
#[test]
fn an_error_names_each_cause_once() {
    let dir = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(model()).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), dir.path().join(entry.file_name())).unwrap();
    }
    let config = dir.path().join("config.json");
    std::fs::remove_file(&config).unwrap();
    std::fs::create_dir(&config).unwrap();
    let output = Command::new(OXLM)
        .arg("generate")
        .arg("--model")
        .arg(dir.path())
        .args(["--prompt", "hi"])
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(1));
    let want = format!(
        "error: loading {}: {}: not a regular file\n",
        dir.path().display(),
        config.display()
    );
    assert_eq!(stderr(&output), want);
}

/// The generated text between the report's `==========` lines.
fn generated(output: &Output) -> String {
    let stdout = String::from_utf8_lossy(&output.stdout);
    let mut parts = stdout.split("==========\n");
    parts.nth(1).unwrap().trim_end_matches('\n').to_owned()
}

/// `--json-schema`, `--regex` and `--grammar` hold a model with random weights to their shape;
/// a schema the engine cannot enforce is an error naming what it cannot.
#[test]
fn structured_output_holds_and_what_cannot_be_enforced_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let schema = dir.path().join("schema.json");
    std::fs::write(
        &schema,
        r#"{"type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 3}},
            "required": ["n"], "additionalProperties": false}"#,
    )
    .unwrap();
    let path = schema.to_str().unwrap();
    let output = generate(&["--json-schema", path, "--temp", "1", "--seed", "3"])
        .output()
        .unwrap();
    assert!(output.status.success(), "{}", stderr(&output));
    let text = generated(&output);
    assert!(
        ["{\"n\": 1}", "{\"n\": 2}", "{\"n\": 3}"].contains(&text.as_str()),
        "{text}"
    );

    let output = generate(&["--regex", "(red|green|blue)!", "--temp", "1"])
        .output()
        .unwrap();
    let text = generated(&output);
    assert!(
        ["red!", "green!", "blue!"].contains(&text.as_str()),
        "{text}"
    );

    let lark = dir.path().join("answer.lark");
    std::fs::write(&lark, "start: \"Answer: \" %json {\"type\": \"boolean\"}\n").unwrap();
    let output = generate(&["--grammar", lark.to_str().unwrap()])
        .output()
        .unwrap();
    let text = generated(&output);
    assert!(text == "Answer: true" || text == "Answer: false", "{text}");

    std::fs::write(&schema, r#"{"$ref": "https://example.com/remote.json"}"#).unwrap();
    let output = generate(&["--json-schema", path]).output().unwrap();
    assert_eq!(output.status.code(), Some(1));
    assert!(
        stderr(&output).contains("example.com"),
        "{}",
        stderr(&output)
    );
}

/// `--max-kv-size`: too small to keep its first 4 positions, or beside `--kv-bits` (mlx-lm cannot
/// quantize a rotating cache), is refused before the model loads; on llama, whose mlx-lm model
/// builds its own cache, it is left unused with a note, as mlx-lm leaves it.
#[test]
fn max_kv_size_is_refused_where_mlx_lm_cannot_use_it_and_noted_where_it_does_not() {
    let output = generate(&["--max-kv-size", "4"]).output().unwrap();
    assert_eq!(output.status.code(), Some(2), "{}", stderr(&output));
    assert!(stderr(&output).contains("`4`"), "{}", stderr(&output));
    let output = generate(&["--max-kv-size", "64", "--kv-bits", "4"])
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(2), "{}", stderr(&output));
    assert!(
        stderr(&output).contains("cannot be used with"),
        "{}",
        stderr(&output)
    );
    let output = generate(&["--max-kv-size", "8", "--max-tokens", "4"])
        .output()
        .unwrap();
    assert!(output.status.success(), "{}", stderr(&output));
    assert!(
        stderr(&output).contains("--max-kv-size is left unused for `llama`"),
        "{}",
        stderr(&output)
    );
}
