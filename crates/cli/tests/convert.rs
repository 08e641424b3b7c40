//! The real `oxlm convert` binary against `mlx_lm convert`'s output
//! (tests/fixtures/convert, made by scripts/oracle/make_convert_fixtures.py): for every
//! architecture and flag set, each written array is byte for byte mlx-lm's, and config.json,
//! the index and the set of files are the same. Then what goes wrong: an existing destination,
//! a truncated source, an architecture convert does not know, conflicting flags.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::{json, Value};
use sha2::{Digest, Sha256};

const OXLM: &str = env!("CARGO_BIN_EXE_oxlm");

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/convert")
}

fn convert(src: &Path, dst: &Path, args: &[&str]) -> Output {
    Command::new(OXLM)
        .arg("convert")
        .arg("--hf-path")
        .arg(src)
        .arg("--mlx-path")
        .arg(dst)
        .args(args)
        .output()
        .unwrap()
}

fn read_json(path: &Path) -> Value {
    serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
}

/// Every array of a written model: name → {dtype, shape, sha256}, as the goldens record them.
fn arrays(dir: &Path) -> BTreeMap<String, Value> {
    let index = read_json(&dir.join("model.safetensors.index.json"));
    let mut files: Vec<&str> = index["weight_map"]
        .as_object()
        .unwrap()
        .values()
        .map(|f| f.as_str().unwrap())
        .collect();
    files.dedup();
    let mut out = BTreeMap::new();
    for file in files {
        let bytes = std::fs::read(dir.join(file)).unwrap();
        let parsed = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        for (name, view) in parsed.tensors() {
            let sha = format!("{:x}", Sha256::digest(view.data()));
            let dtype = format!("{:?}", view.dtype());
            let entry = json!({"dtype": dtype, "shape": view.shape(), "sha256": sha});
            out.insert(name, entry);
        }
    }
    out
}

fn args_of(expected: &Value) -> Vec<String> {
    expected["args"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap().to_string())
        .collect()
}

/// Differences between what oxlm wrote in `dir` and the golden, one line each.
fn differences(dir: &Path, expected: &Value) -> Vec<String> {
    let mut found = Vec::new();
    let want: BTreeMap<String, Value> =
        serde_json::from_value(expected["tensors"].clone()).unwrap();
    let got = arrays(dir);
    for name in want
        .keys()
        .chain(got.keys())
        .collect::<std::collections::BTreeSet<_>>()
    {
        if want.get(name) != got.get(name) {
            found.push(format!(
                "array {name}: mlx-lm {:?}, oxlm {:?}",
                want.get(name),
                got.get(name)
            ));
        }
    }
    if read_json(&dir.join("config.json")) != expected["config"] {
        found.push(format!(
            "config.json differs: oxlm wrote {}",
            read_json(&dir.join("config.json"))
        ));
    }
    if read_json(&dir.join("model.safetensors.index.json")) != expected["index"] {
        found.push("model.safetensors.index.json differs".into());
    }
    let mut files: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    files.sort();
    if json!(files) != expected["files"] {
        found.push(format!(
            "files: mlx-lm {}, oxlm {files:?}",
            expected["files"]
        ));
    }
    found
}

#[test]
fn every_architecture_and_flag_set_converts_as_mlx_lm_does() {
    let scratch = tempfile::tempdir().unwrap();
    let mut checked = 0;
    let mut failures = Vec::new();
    let mut cases: Vec<PathBuf> = std::fs::read_dir(fixtures())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.join("source").is_dir())
        .collect();
    cases.sort();
    for case in cases {
        let mut goldens: Vec<PathBuf> = std::fs::read_dir(case.join("expected"))
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        goldens.sort();
        for golden in goldens {
            let expected = read_json(&golden);
            let label = format!(
                "{}/{}",
                case.file_name().unwrap().to_string_lossy(),
                golden.file_stem().unwrap().to_string_lossy()
            );
            let out = scratch.path().join(label.replace('/', "-"));
            // `"source": "q4"`: the input is the q4 conversion's output.
            let src = match expected["source"].as_str() {
                Some(flag_set) => {
                    let first = scratch
                        .path()
                        .join(format!("{}-first", label.replace('/', "-")));
                    let args = args_of(&read_json(
                        &case.join("expected").join(format!("{flag_set}.json")),
                    ));
                    let args: Vec<&str> = args.iter().map(String::as_str).collect();
                    assert!(convert(&case.join("source"), &first, &args)
                        .status
                        .success());
                    first
                }
                None => case.join("source"),
            };
            let args = args_of(&expected);
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            let run = convert(&src, &out, &args);
            if !run.status.success() {
                failures.push(format!(
                    "{label}: oxlm convert {args:?} failed: {}",
                    String::from_utf8_lossy(&run.stderr)
                ));
                continue;
            }
            for d in differences(&out, &expected) {
                failures.push(format!("{label}: {d}"));
            }
            checked += 1;
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    // Every golden the fixture script writes; fewer means some went unread.
    assert_eq!(checked, 57);
}

#[test]
fn a_small_shard_size_splits_the_weights_across_files_that_load_together() {
    let scratch = tempfile::tempdir().unwrap();
    let out = scratch.path().join("sharded");
    let src = fixtures().join("llama/source");
    let run = convert(&src, &out, &["-q", "--max-shard-bytes", "20000"]);
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let index = read_json(&out.join("model.safetensors.index.json"));
    let files: std::collections::BTreeSet<&str> = index["weight_map"]
        .as_object()
        .unwrap()
        .values()
        .map(|f| f.as_str().unwrap())
        .collect();
    assert!(files.len() > 2, "{files:?}");
    let n = files.len();
    let names: Vec<String> = (1..=n)
        .map(|i| format!("model-{i:05}-of-{n:05}.safetensors"))
        .collect();
    assert_eq!(files.into_iter().collect::<Vec<_>>(), names);
    // The same arrays as the one-file conversion, wherever they landed.
    let expected = read_json(&fixtures().join("llama/expected/q4.json"));
    let want: BTreeMap<String, Value> =
        serde_json::from_value(expected["tensors"].clone()).unwrap();
    assert_eq!(arrays(&out), want);
    assert_eq!(index["metadata"], expected["index"]["metadata"]);
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

#[test]
fn an_existing_destination_is_kept_unless_forced() {
    let scratch = tempfile::tempdir().unwrap();
    let out = scratch.path().join("model");
    std::fs::create_dir(&out).unwrap();
    std::fs::write(out.join("notes.txt"), "mine").unwrap();
    let src = fixtures().join("qwen3/source");
    let refused = convert(&src, &out, &["-q"]);
    assert!(!refused.status.success());
    assert!(
        stderr(&refused).contains("already exists"),
        "{}",
        stderr(&refused)
    );
    assert_eq!(std::fs::read_dir(&out).unwrap().count(), 1);

    let forced = convert(&src, &out, &["-q", "--force"]);
    assert!(forced.status.success(), "{}", stderr(&forced));
    let expected = read_json(&fixtures().join("qwen3/expected/q4.json"));
    let want: BTreeMap<String, Value> =
        serde_json::from_value(expected["tensors"].clone()).unwrap();
    assert_eq!(arrays(&out), want);
}

#[test]
fn bad_input_is_a_clear_error_and_writes_nothing() {
    let scratch = tempfile::tempdir().unwrap();
    let src = scratch.path().join("src");
    std::fs::create_dir(&src).unwrap();
    let original = fixtures().join("llama-tied/source");
    for entry in std::fs::read_dir(&original).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), src.join(entry.file_name())).unwrap();
    }
    let out = scratch.path().join("out");
    let expect_error = |args: &[&str], message: &str| {
        let run = convert(&src, &out, args);
        assert!(!run.status.success(), "{args:?} succeeded");
        assert!(stderr(&run).contains(message), "{args:?}: {}", stderr(&run));
        assert!(!out.exists(), "{args:?} left {}", out.display());
        let leftovers: Vec<_> = std::fs::read_dir(scratch.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .filter(|n| n != "src")
            .collect();
        assert!(leftovers.is_empty(), "{args:?} left {leftovers:?}");
    };
    expect_error(&["-q", "-d"], "not both");
    expect_error(&["--q-bits", "4"], "need -q");
    expect_error(&["-q", "--q-bits", "7"], "--q-bits 7");
    expect_error(
        &["-q", "--q-mode", "mxfp4", "--q-group-size", "64"],
        "mxfp4 takes 4 bits and group size 32",
    );

    let weights = src.join("model.safetensors");
    let bytes = std::fs::read(&weights).unwrap();
    std::fs::write(&weights, &bytes[..bytes.len() - 100]).unwrap();
    expect_error(&["-q"], "ends past the end of the file (truncated?)");
    std::fs::write(&weights, &bytes).unwrap();

    let mut config = read_json(&src.join("config.json"));
    config["model_type"] = json!("bert");
    std::fs::write(src.join("config.json"), config.to_string()).unwrap();
    expect_error(&["-q"], "does not know model_type `bert`");
    std::fs::write(src.join("config.json"), "{\"model_type\": ").unwrap();
    expect_error(&["-q"], "malformed JSON");
}

#[test]
fn a_quantized_model_is_not_quantized_twice() {
    let scratch = tempfile::tempdir().unwrap();
    let q4 = scratch.path().join("q4");
    assert!(convert(&fixtures().join("qwen2/source"), &q4, &["-q"])
        .status
        .success());
    let again = convert(&q4, &scratch.path().join("again"), &["-q"]);
    assert!(!again.status.success());
    assert!(
        stderr(&again).contains("already quantized"),
        "{}",
        stderr(&again)
    );
}
