//! The real `oxlm fuse` binary stopped by SIGTERM or SIGINT while it writes a weight file of
//! hundreds of megabytes: it removes its temporary file before it ends, and leaves the
//! destination without the file or with it whole.

use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use safetensors::tensor::TensorView;
use safetensors::SafeTensors;
use serde_json::Value;

const OXLM: &str = env!("CARGO_BIN_EXE_oxlm");

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

/// Rows of the large model's vocabulary: its embedding and head then take about 300 MB, which
/// takes a while to write.
const LARGE_VOCAB: usize = 3 << 20;

/// The tiny llama with its embedding and head repeated to [`LARGE_VOCAB`] rows. Its blocks keep
/// their shapes, so the tiny llama's adapter fits it.
fn large_llama(dir: &Path) {
    let tiny = fixtures().join("tiny/llama-4bit-g64");
    let mut config: Value =
        serde_json::from_str(&std::fs::read_to_string(tiny.join("config.json")).unwrap()).unwrap();
    let vocab = config["vocab_size"].as_u64().unwrap() as usize;
    config["vocab_size"] = LARGE_VOCAB.into();
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    std::fs::copy(tiny.join("tokenizer.json"), dir.join("tokenizer.json")).unwrap();

    let bytes = std::fs::read(tiny.join("model.safetensors")).unwrap();
    let weights = SafeTensors::deserialize(&bytes).unwrap();
    let tensors: Vec<_> = weights
        .tensors()
        .into_iter()
        .map(|(name, view)| {
            let mut shape = view.shape().to_vec();
            let per_token = name.starts_with("model.embed_tokens.") || name.starts_with("lm_head.");
            let data = if per_token {
                shape[0] = LARGE_VOCAB;
                view.data().repeat(LARGE_VOCAB / vocab)
            } else {
                view.data().to_vec()
            };
            (name, view.dtype(), shape, data)
        })
        .collect();
    let views = tensors.iter().map(|(name, dtype, shape, data)| {
        let view = TensorView::new(*dtype, shape.clone(), data).unwrap();
        (name.clone(), view)
    });
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
}

fn entries(dir: &Path) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut names: Vec<String> = entries
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

#[test]
fn a_signal_during_fuse_leaves_no_temporary_file() {
    let model = tempfile::tempdir().unwrap();
    large_llama(model.path());
    let tensors = SafeTensors::deserialize(
        &std::fs::read(fixtures().join("tiny/llama-4bit-g64/model.safetensors")).unwrap(),
    )
    .unwrap()
    .len();
    for (signal, number) in [("TERM", 15), ("INT", 2)] {
        let out = tempfile::tempdir().unwrap();
        let save = out.path().join("fused");
        let mut child = Command::new(OXLM)
            .arg("fuse")
            .arg("--model")
            .arg(model.path())
            .arg("--adapter-path")
            .arg(fixtures().join("lora/llama-4bit-g64-r4"))
            .arg("--save-path")
            .arg(&save)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        // The output is written in a directory beside the save path, made just before the
        // weights are written: the signal comes as the weight file's first bytes are.
        let staged = |out: &Path| -> Vec<String> {
            let staging = entries(out)
                .into_iter()
                .find(|n| n.starts_with(".fused.partial-"));
            staging.map_or_else(Vec::new, |dir| entries(&out.join(dir)))
        };
        let deadline = Instant::now() + Duration::from_secs(120);
        while staged(out.path()).is_empty() {
            assert!(child.try_wait().unwrap().is_none(), "fuse ended first");
            assert!(Instant::now() < deadline, "fuse wrote nothing in 120 s");
            std::thread::sleep(Duration::from_millis(1));
        }
        let sent = Command::new("kill")
            .args(["-s", signal, &child.id().to_string()])
            .status()
            .unwrap();
        assert!(sent.success());
        let output = child.wait_with_output().unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(
            output.status.signal(),
            Some(number),
            "SIG{signal}: {stderr}"
        );

        assert!(
            entries(out.path()).iter().all(|n| n == "fused"),
            "SIG{signal} left {:?} beside the save path",
            entries(out.path())
        );
        let left = entries(&save);
        let finished = [
            "config.json",
            "model.safetensors",
            "model.safetensors.index.json",
            "tokenizer.json",
        ];
        assert!(
            left.iter().all(|name| finished.contains(&name.as_str())),
            "SIG{signal} left {left:?}"
        );
        if left.iter().any(|name| name == "model.safetensors") {
            let bytes = std::fs::read(save.join("model.safetensors")).unwrap();
            assert_eq!(SafeTensors::deserialize(&bytes).unwrap().len(), tensors);
        }
    }
}
