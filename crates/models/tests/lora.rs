//! LoRA adapters made by mlx-lm's tuner (tests/fixtures/lora, from
//! scripts/oracle/make_lora_fixture.py) give mlx-lm's logits when applied unfused, through a full
//! forward, through the KV cache and in batched steps, on the CPU and the GPU; broken or foreign
//! adapters are refused with a clear error.

mod lora_fixtures;

use std::path::Path;

use lora_fixtures::{
    all_logits, devices, fixtures, golden, max_abs_diff, prompt, CASES, LOGIT_TOLERANCE,
};
use oxlm_engine::KvPrecision;
use oxlm_models::lora::{AdaptedModel, AdapterError, Adapters, LoraConfig, RowAdapters};
use oxlm_models::{load, load_on, LanguageModel, Logits};
use serde_json::Value;

#[test]
fn adapted_logits_match_mlx_lm() {
    let (devices, _turn) = devices();
    for ((adapter, base), device) in CASES
        .iter()
        .flat_map(|c| devices.iter().map(move |d| (c, d)))
    {
        let model = load_on(&fixtures().join("tiny").join(base), device).unwrap();
        let adapters =
            Adapters::load(&fixtures().join("lora").join(adapter), model.as_ref()).unwrap();
        let adapted = AdaptedModel::new(model.as_ref(), &adapters).unwrap();
        let ids = prompt(adapter);
        let base_diff = max_abs_diff(
            &all_logits(model.as_ref(), &ids),
            &golden(adapter, "base_logits"),
        );
        let want = golden(adapter, "adapted_logits");
        let diff = max_abs_diff(&all_logits(&adapted, &ids), &want);
        println!("{adapter} on {device}: max |Δ| base {base_diff:.2e}, adapted {diff:.2e}");
        assert!(base_diff < LOGIT_TOLERANCE && diff < LOGIT_TOLERANCE);

        // Token by token through the KV cache, after a prefill of all but the last 4.
        let vocab = model.info().vocab_size;
        let split = ids.len() - 4;
        let mut cache = adapted.new_cache_in(KvPrecision::F32).unwrap();
        adapted
            .forward(&ids[..split], &mut cache, Logits::Last)
            .unwrap();
        for (t, &id) in ids.iter().enumerate().skip(split) {
            let got = adapted.forward(&[id], &mut cache, Logits::Last).unwrap();
            let got = got.into_host().unwrap();
            let d = max_abs_diff(got.data(), &want[t * vocab..(t + 1) * vocab]);
            assert!(
                d < LOGIT_TOLERANCE,
                "{adapter} on {device} position {t}: {d}"
            );
        }
    }
}

/// Sequences decoded together through an adapter (as a server's batch of one adapter's
/// requests) get mlx-lm's adapted logits: prefixes of the prompt of three lengths, each
/// prefilled apart, then their next tokens in one batched step.
#[test]
fn adapted_batched_decode_matches_mlx_lm() {
    let (devices, _turn) = devices();
    for ((adapter, base), device) in CASES
        .iter()
        .flat_map(|c| devices.iter().map(move |d| (c, d)))
    {
        let model = load_on(&fixtures().join("tiny").join(base), device).unwrap();
        let adapters =
            Adapters::load(&fixtures().join("lora").join(adapter), model.as_ref()).unwrap();
        let adapted = AdaptedModel::new(model.as_ref(), &adapters).unwrap();
        let (ids, want) = (prompt(adapter), golden(adapter, "adapted_logits"));
        let vocab = model.info().vocab_size;
        let lengths = [1, ids.len() / 2, ids.len() - 1];
        let mut caches: Vec<_> = lengths
            .iter()
            .map(|&n| {
                let mut cache = adapted.new_cache_in(KvPrecision::F32).unwrap();
                adapted
                    .forward(&ids[..n], &mut cache, Logits::Last)
                    .unwrap();
                cache
            })
            .collect();
        let next: Vec<u32> = lengths.iter().map(|&n| ids[n]).collect();
        let mut refs: Vec<_> = caches.iter_mut().collect();
        let batch = adapted.forward_batch(&next, &mut refs).unwrap();
        let batch = batch.into_host().unwrap();
        for (i, &n) in lengths.iter().enumerate() {
            let row = &batch.data()[i * vocab..(i + 1) * vocab];
            let d = max_abs_diff(row, &want[n * vocab..(n + 1) * vocab]);
            println!("{adapter} on {device}: batched position {n} within {d:.2e} of mlx-lm");
            assert!(
                d < LOGIT_TOLERANCE,
                "{adapter} on {device} position {n}: {d}"
            );
        }
    }
}

#[test]
fn the_base_model_is_shared_and_unchanged() {
    let (adapter, base) = CASES[0];
    let model = load(&fixtures().join("tiny").join(base)).unwrap();
    let adapters = Adapters::load(&fixtures().join("lora").join(adapter), model.as_ref()).unwrap();
    let ids = prompt(adapter);
    let adapted = all_logits(&AdaptedModel::new(model.as_ref(), &adapters).unwrap(), &ids);
    let plain = all_logits(model.as_ref(), &ids);
    assert!(max_abs_diff(&plain, &golden(adapter, "base_logits")) < LOGIT_TOLERANCE);
    assert!(max_abs_diff(&adapted, &plain) > 0.1);
}

/// A stack of adapters adds their updates: the fixture's adapter at scales 7 and 13 stacked
/// gives its logits at scale 20 (the update is linear in the scale). And a batch whose rows run
/// through adapters of their own (one, none, a stack) gives each row what its adapters give
/// that sequence alone.
#[test]
fn stacked_and_per_row_adapters() {
    let (devices, _turn) = devices();
    let (adapter, base) = CASES[0];
    let copies: Vec<_> = [7.0, 13.0, 20.0]
        .into_iter()
        .map(|scale| {
            let dir = adapter_copy(adapter);
            edit_config(dir.path(), |c| c["lora_parameters"]["scale"] = scale.into());
            dir
        })
        .collect();
    for device in &devices {
        let model = load_on(&fixtures().join("tiny").join(base), device).unwrap();
        let [a7, a13, a20] =
            [0, 1, 2].map(|i| Adapters::load(copies[i].path(), model.as_ref()).unwrap());
        let ids = prompt(adapter);
        let stacked = AdaptedModel::by_rows(model.as_ref(), RowAdapters::stack(&[&a7, &a13]));
        let stacked = all_logits(&stacked.unwrap(), &ids);
        let single = all_logits(&AdaptedModel::new(model.as_ref(), &a20).unwrap(), &ids);
        let d = max_abs_diff(&stacked, &single);
        println!("{adapter} on {device}: stacked 7 + 13 within {d:.2e} of 20");
        assert!(d < 1e-3, "{device}: {d}");

        let rows = [vec![&a7], vec![], vec![&a7, &a13]];
        let lengths = [1, ids.len() / 2, ids.len() - 1];
        let alone: Vec<AdaptedModel> = rows
            .iter()
            .map(|stack| AdaptedModel::by_rows(model.as_ref(), RowAdapters::stack(stack)).unwrap())
            .collect();
        let mut caches: Vec<_> = (alone.iter().zip(lengths))
            .map(|(m, n)| {
                let mut cache = m.new_cache_in(KvPrecision::F32).unwrap();
                m.forward(&ids[..n], &mut cache, Logits::Last).unwrap();
                cache
            })
            .collect();
        let want: Vec<Vec<f32>> = (alone.iter().zip(&caches).zip(lengths))
            .map(|((m, cache), n)| {
                let mut cache = cache.try_clone().unwrap();
                let logits = m.forward(&[ids[n]], &mut cache, Logits::Last).unwrap();
                logits.into_host().unwrap().into_data()
            })
            .collect();
        let mixed = RowAdapters::by_row(&rows).unwrap();
        let mixed = AdaptedModel::by_rows(model.as_ref(), mixed).unwrap();
        let next: Vec<u32> = lengths.iter().map(|&n| ids[n]).collect();
        let mut refs: Vec<_> = caches.iter_mut().collect();
        let batch = mixed.forward_batch(&next, &mut refs).unwrap();
        let batch = batch.into_host().unwrap();
        let vocab = model.info().vocab_size;
        for (i, want) in want.iter().enumerate() {
            let d = max_abs_diff(&batch.data()[i * vocab..][..vocab], want);
            println!("{adapter} on {device}: row {i} of the mixed batch within {d:.2e}");
            assert!(d < LOGIT_TOLERANCE, "{device} row {i}: {d}");
        }
    }
}

/// A writable copy of an adapter fixture.
fn adapter_copy(name: &str) -> tempfile::TempDir {
    let tmp = tempfile::tempdir().unwrap();
    for file in ["adapter_config.json", "adapters.safetensors"] {
        std::fs::copy(
            fixtures().join("lora").join(name).join(file),
            tmp.path().join(file),
        )
        .unwrap();
    }
    tmp
}

fn edit_config(dir: &Path, edit: impl FnOnce(&mut Value)) {
    let path = dir.join("adapter_config.json");
    let mut config: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    edit(&mut config);
    std::fs::write(path, config.to_string()).unwrap();
}

/// Rewrites the f32 safetensors `file` with the first value of each of `names` set to `value`.
fn set_first_value(file: &Path, names: &[&str], value: f32) {
    let bytes = std::fs::read(file).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let tensors: Vec<(String, Vec<usize>, Vec<u8>)> = st
        .tensors()
        .into_iter()
        .map(|(name, view)| {
            let mut data = view.data().to_vec();
            if names.contains(&name.as_str()) {
                data[..4].copy_from_slice(&value.to_le_bytes());
            }
            (name, view.shape().to_vec(), data)
        })
        .collect();
    let views = tensors.iter().map(|(name, shape, data)| {
        let view =
            safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape.clone(), data);
        (name.clone(), view.unwrap())
    });
    safetensors::serialize_to_file(views, None, file).unwrap();
}

fn load_err(adapter: &Path, base: &str) -> AdapterError {
    let model = load(&fixtures().join("tiny").join(base)).unwrap();
    Adapters::load(adapter, model.as_ref()).expect_err("the adapter should be refused")
}

#[test]
fn broken_or_foreign_adapters_are_refused() {
    let err = load_err(Path::new("/nonexistent/adapter"), "llama-4bit-g64");
    assert!(matches!(err, AdapterError::NotFound(_)), "{err}");
    assert!(err.to_string().contains("does not exist"), "{err}");

    // An adapter trained for another model: shapes and layers disagree.
    let err = load_err(
        &fixtures().join("lora/qwen2-4bit-g64-keys"),
        "llama-4bit-g64",
    );
    assert!(matches!(err, AdapterError::Mismatch { .. }), "{err}");

    // The config says fewer layers than the weights hold.
    let dir = adapter_copy("qwen2-4bit-g64-keys");
    edit_config(dir.path(), |c| c["num_layers"] = 1.into());
    let err = load_err(dir.path(), "qwen2-4bit-g64");
    assert!(
        err.to_string()
            .contains("model.layers.0.self_attn.q_proj.lora_a: not an adapter parameter"),
        "{err}"
    );

    // Another rank than the weights have.
    let dir = adapter_copy("llama-4bit-g64-r4");
    edit_config(dir.path(), |c| c["lora_parameters"]["rank"] = 8.into());
    let err = load_err(dir.path(), "llama-4bit-g64");
    assert!(
        err.to_string()
            .contains("does not match model parameter shape"),
        "{err}"
    );

    let dir = adapter_copy("llama-4bit-g64-r4");
    edit_config(dir.path(), |c| {
        let p = c["lora_parameters"].as_object_mut().unwrap();
        let scale = p.remove("scale").unwrap();
        p.insert("alpha".into(), scale);
    });
    let err = load_err(dir.path(), "llama-4bit-g64");
    assert!(err.to_string().contains("not `alpha`"), "{err}");

    // A scale that is infinite in f32, or past any adapter's, answered with empty text.
    for scale in [1e39, -1e39, 1e5] {
        let dir = adapter_copy("llama-4bit-g64-r4");
        edit_config(dir.path(), |c| c["lora_parameters"]["scale"] = scale.into());
        let err = load_err(dir.path(), "llama-4bit-g64");
        let config = dir.path().join("adapter_config.json");
        assert!(
            matches!(&err, AdapterError::Config { path, .. } if *path == config),
            "{err}"
        );
        assert_eq!(
            err.to_string(),
            format!(
                "{}: `lora_parameters.scale` is {scale}: expected a number from -10000 to 10000",
                config.display()
            )
        );
    }

    // Weights holding NaN or infinity, named with their file.
    for bad in [f32::NAN, f32::INFINITY] {
        let dir = adapter_copy("llama-4bit-g64-r4");
        let weights = dir.path().join("adapters.safetensors");
        let poisoned = [
            "model.layers.1.mlp.up_proj.lora_b",
            "model.layers.1.self_attn.q_proj.lora_a",
        ];
        set_first_value(&weights, &poisoned, bad);
        let err = load_err(dir.path(), "llama-4bit-g64");
        assert!(
            matches!(&err, AdapterError::NonFiniteWeights { path, tensors }
                if *path == weights && tensors == &poisoned),
            "{err}"
        );
        assert_eq!(
            err.to_string(),
            format!(
                "{}: NaN or infinite values in {}",
                weights.display(),
                poisoned.join(", ")
            )
        );
    }

    let dir = adapter_copy("llama-4bit-g64-r4");
    edit_config(dir.path(), |c| c["fine_tune_type"] = "dora".into());
    let err = load_err(dir.path(), "llama-4bit-g64");
    assert!(
        matches!(err, AdapterError::UnsupportedType(ref t) if t == "dora"),
        "{err}"
    );

    let dir = adapter_copy("llama-4bit-g64-r4");
    std::fs::remove_file(dir.path().join("adapters.safetensors")).unwrap();
    let err = load_err(dir.path(), "llama-4bit-g64");
    assert!(
        err.to_string()
            .contains("adapters.safetensors: no such file"),
        "{err}"
    );

    let err = load_err(
        &fixtures().join("lora/llama-4bit-g64-r4"),
        "gemma4-moe-4bit-g64",
    );
    assert!(matches!(err, AdapterError::Mismatch { .. }), "{err}");

    // Adapters do not stack on a model already seen through adapters.
    let llama = load(&fixtures().join("tiny/llama-4bit-g64")).unwrap();
    let lora = fixtures().join("lora/llama-4bit-g64-r4");
    let adapters = Adapters::load(&lora, llama.as_ref()).unwrap();
    let adapted = AdaptedModel::new(llama.as_ref(), &adapters).unwrap();
    let err = Adapters::load(&lora, &adapted).unwrap_err();
    assert!(matches!(err, AdapterError::UnsupportedModel(_)), "{err}");
}

#[test]
fn adapters_loaded_for_one_model_are_checked_against_another() {
    let llama = load(&fixtures().join("tiny/llama-4bit-g64")).unwrap();
    let qwen = load(&fixtures().join("tiny/qwen2-4bit-g64")).unwrap();
    let adapters =
        Adapters::load(&fixtures().join("lora/qwen2-4bit-g64-keys"), qwen.as_ref()).unwrap();
    assert!(AdaptedModel::new(qwen.as_ref(), &adapters).is_ok());
    let err = AdaptedModel::new(llama.as_ref(), &adapters).err().unwrap();
    assert!(matches!(err, AdapterError::Mismatch { .. }), "{err}");
}

/// Adapters of a layer the checkpoint keeps fused (Phi-3's `qkv_proj`) serve as the split
/// layers' (above), but training one is refused by name; leaving it out of the keys trains the
/// rest.
#[test]
fn fused_layers_are_served_but_not_trained() {
    let model = load(&fixtures().join("tiny/phi3-4bit-g32")).unwrap();
    let err = Adapters::zeros(LoraConfig::new(1), model.as_ref()).unwrap_err();
    assert_eq!(
        err.to_string(),
        "LoRA training of `mlp.gate_up_proj`, which this model keeps split, is not supported \
         (leave it out of lora_parameters.keys)"
    );
    let config = LoraConfig {
        keys: Some(vec!["self_attn.o_proj".into(), "mlp.down_proj".into()]),
        ..LoraConfig::new(1)
    };
    let zeros = Adapters::zeros(config, model.as_ref()).unwrap();
    assert_eq!(zeros.layers.len(), 2);
}
