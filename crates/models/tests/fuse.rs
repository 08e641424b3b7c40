//! `fuse` writes what `mlx_lm fuse` writes (tests/fixtures/lora, from
//! scripts/oracle/make_lora_fixture.py): the same re-quantized arrays, and a model directory that
//! loads and gives mlx-lm's logits for the fused model, quantized or dequantized.

mod lora_fixtures;

use std::path::Path;

use lora_fixtures::{all_logits, fixtures, golden, max_abs_diff, prompt, CASES, LOGIT_TOLERANCE};
use oxlm_models::fuse::fuse;
use oxlm_models::load;

/// Every position's logits of the model in `dir` over `ids`.
fn logits(dir: &Path, ids: &[u32]) -> Vec<f32> {
    all_logits(load(dir).unwrap().as_ref(), ids)
}

#[test]
fn fused_checkpoints_match_mlx_lm() {
    for (adapter, base) in CASES {
        let out = tempfile::tempdir().unwrap();
        let adapter_dir = fixtures().join("lora").join(adapter);
        let report = fuse(
            &fixtures().join("tiny").join(base),
            &adapter_dir,
            out.path(),
            false,
        )
        .unwrap();
        assert!(report.fused_layers > 0);

        // Array by array against the file mlx-lm wrote.
        let ours = std::fs::read(out.path().join("model.safetensors")).unwrap();
        let theirs = std::fs::read(adapter_dir.join("fused.safetensors")).unwrap();
        let (ours, theirs) = (
            safetensors::SafeTensors::deserialize(&ours).unwrap(),
            safetensors::SafeTensors::deserialize(&theirs).unwrap(),
        );
        let mut names = ours.names();
        names.sort();
        let mut want = theirs.names();
        want.sort();
        assert_eq!(names, want, "{adapter}: array names");
        let (mut bytes, mut differing) = (0, 0);
        for name in names {
            let (a, b) = (ours.tensor(name).unwrap(), theirs.tensor(name).unwrap());
            assert_eq!(
                (a.dtype(), a.shape()),
                (b.dtype(), b.shape()),
                "{adapter}: {name}"
            );
            bytes += a.data().len();
            differing += a
                .data()
                .iter()
                .zip(b.data())
                .filter(|(x, y)| x != y)
                .count();
        }
        println!("{adapter}: {differing} of {bytes} weight bytes differ from mlx-lm's fused model");
        assert_eq!(differing, 0, "{adapter}: fused arrays differ from mlx-lm's");

        let ids = prompt(adapter);
        let diff = max_abs_diff(&logits(out.path(), &ids), &golden(adapter, "fused_logits"));
        println!("{adapter}: fused logits max |Δ| {diff:.2e}");
        assert!(diff < LOGIT_TOLERANCE);

        let config: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(out.path().join("config.json")).unwrap())
                .unwrap();
        assert_eq!(config["quantization"], config["quantization_config"]);
        assert!(out.path().join("tokenizer.json").exists());
        assert!(out.path().join("model.safetensors.index.json").exists());
    }
}

#[test]
fn dequantized_fuse_matches_mlx_lm() {
    for (adapter, base) in CASES {
        let out = tempfile::tempdir().unwrap();
        let adapter_dir = fixtures().join("lora").join(adapter);
        let report = fuse(
            &fixtures().join("tiny").join(base),
            &adapter_dir,
            out.path(),
            true,
        )
        .unwrap();
        assert!(report.dequantized_layers > 0);
        let config: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(out.path().join("config.json")).unwrap())
                .unwrap();
        assert!(
            config.get("quantization").is_none() && config.get("quantization_config").is_none()
        );
        let ids = prompt(adapter);
        let diff = max_abs_diff(
            &logits(out.path(), &ids),
            &golden(adapter, "dequantized_logits"),
        );
        println!("{adapter}: dequantized fused logits max |Δ| {diff:.2e}");
        assert!(diff < LOGIT_TOLERANCE);
    }
}

#[test]
fn index_counts_like_mlx_lm() {
    // Fusing changes no shape, so the index must say what mlx-lm's index of the base says.
    let (adapter, base) = CASES[0];
    let out = tempfile::tempdir().unwrap();
    let base_dir = fixtures().join("tiny").join(base);
    fuse(
        &base_dir,
        &fixtures().join("lora").join(adapter),
        out.path(),
        false,
    )
    .unwrap();
    let read = |dir: &Path| -> serde_json::Value {
        serde_json::from_str(
            &std::fs::read_to_string(dir.join("model.safetensors.index.json")).unwrap(),
        )
        .unwrap()
    };
    assert_eq!(read(out.path())["metadata"], read(&base_dir)["metadata"]);
    assert_eq!(
        read(out.path())["weight_map"],
        read(&base_dir)["weight_map"]
    );
}

/// A fuse that fails part way (after the weights are written, a tokenizer file of the model
/// cannot be copied) leaves the earlier output as it was, and nothing beside it.
#[test]
fn a_fuse_failing_part_way_leaves_the_earlier_output() {
    let (adapter, base) = CASES[0];
    let model = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(fixtures().join("tiny").join(base)).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), model.path().join(entry.file_name())).unwrap();
    }
    let unreadable = model.path().join("special_tokens_map.json");
    let _ = std::fs::remove_file(&unreadable);
    std::fs::create_dir(&unreadable).unwrap();
    let out = tempfile::tempdir().unwrap();
    let save = out.path().join("fused");
    std::fs::create_dir(&save).unwrap();
    std::fs::write(save.join("config.json"), "earlier").unwrap();
    let err = fuse(
        model.path(),
        &fixtures().join("lora").join(adapter),
        &save,
        false,
    )
    .unwrap_err();
    assert!(err.to_string().contains("special_tokens_map.json"), "{err}");
    let entries = |dir: &Path| -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    };
    assert_eq!(entries(out.path()), ["fused"]);
    assert_eq!(entries(&save), ["config.json"]);
    assert_eq!(
        std::fs::read_to_string(save.join("config.json")).unwrap(),
        "earlier"
    );
}
