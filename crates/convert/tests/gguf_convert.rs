//! `convert_gguf` on the real GGUFs of the model cache: SmolLM2's Q4_1 file converts, without
//! loss, to exactly the checkpoint the oracle path made of it (scripts/models/fetch_models.sh:
//! `mx.load` of the GGUF through gguf_q4_to_mlx.py), array for array and config key for key, so
//! every greedy token is the oracle's; a truncated file is an error that writes nothing.

mod common;

use std::collections::BTreeMap;
use std::path::Path;

use common::cached;
use oxlm_convert::from_gguf::convert_gguf;
use oxlm_convert::ConvertOptions;
use serde_json::Value;

fn arrays(dir: &Path) -> BTreeMap<String, (String, Vec<usize>, Vec<u8>)> {
    let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
    let parsed = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    parsed
        .tensors()
        .into_iter()
        .map(|(name, view)| {
            let dtype = format!("{:?}", view.dtype());
            (name, (dtype, view.shape().to_vec(), view.data().to_vec()))
        })
        .collect()
}

fn json(path: &Path) -> Value {
    serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
}

#[test]
fn smollm2_converts_to_the_oracle_checkpoint_array_for_array() {
    let gguf = cached("gguf/SmolLM2-135M-Instruct.Q4_1.gguf");
    let oracle = cached("models/smollm2-135m-instruct-4bit");
    let out = tempfile::tempdir().unwrap();
    let dst = out.path().join("smollm2");
    let (report, requantized) =
        convert_gguf(&gguf, &dst, &ConvertOptions::default(), &mut |_| {}).unwrap();
    assert_eq!(requantized.tensors, 0, "Q4_1 and Q8_0 convert without loss");
    assert_eq!(report.arrays, 694);
    let (ours, theirs) = (arrays(&dst), arrays(&oracle));
    let differing: Vec<&String> = theirs
        .keys()
        .chain(ours.keys())
        .filter(|name| ours.get(*name) != theirs.get(*name))
        .collect();
    assert!(differing.is_empty(), "arrays differ: {differing:?}");
    assert_eq!(
        json(&dst.join("config.json")),
        json(&oracle.join("config.json"))
    );
}

#[test]
fn a_truncated_gguf_is_an_error_that_writes_nothing() {
    let gguf = cached("gguf/SmolLM2-135M-Instruct.Q4_1.gguf");
    let scratch = tempfile::tempdir().unwrap();
    let cut = scratch.path().join("cut.gguf");
    let bytes = std::fs::read(&gguf).unwrap();
    std::fs::write(&cut, &bytes[..bytes.len() / 2]).unwrap();
    let dst = scratch.path().join("out");
    let err = convert_gguf(&cut, &dst, &ConvertOptions::default(), &mut |_| {}).unwrap_err();
    let text = err.to_string();
    assert!(
        text.contains("cut.gguf") && text.contains("ends past the end of the file (truncated?)"),
        "{text}"
    );
    let left: Vec<_> = std::fs::read_dir(scratch.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(left, ["cut.gguf"]);
}
