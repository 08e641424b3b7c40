//! Embeddings of the tiny Qwen3-Embedding fixture against the oracle's
//! (scripts/oracle/make_embedding_fixture.py: mlx-lm's `model.model(ids)`, the last hidden state
//! after the final norm, pooled and normalized in numpy), with the token ids its tokenizer gave;
//! and what an embedding checkpoint's files decide: pooling, normalization, prompts, which
//! checkpoints embed at all, and the inputs refused.

#[path = "../../../tests/fixtures/tiny/embedding/golden.rs"]
mod golden;

use std::path::{Path, PathBuf};

use golden::{assert_close, assert_within, fixture, FAST_GPU_TOLERANCE, TOLERANCE};
use oxlm_engine::{cuda, Device};
use oxlm_models::LanguageModel;
use oxlm_runtime::embed::{EmbedError, EmbedInput, Embedder, Pooling};
use oxlm_runtime::tokenizer::Tokenizer;
use serde_json::Value;

fn tiny() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny")
}

fn model(dir: &Path) -> Box<dyn LanguageModel> {
    oxlm_models::load(dir).unwrap()
}

/// A copy of the fixture in a temporary directory, `change`d.
fn changed_copy(change: impl FnOnce(&Path)) -> tempfile::TempDir {
    let copy = tempfile::tempdir().unwrap();
    copy_dir(&fixture(), copy.path());
    change(copy.path());
    copy
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), target).unwrap();
        }
    }
}

fn edit_json(path: &Path, edit: impl FnOnce(&mut Value)) {
    let mut value: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    edit(&mut value);
    std::fs::write(path, value.to_string()).unwrap();
}

#[test]
fn qwen3_embedding_matches_the_oracle() {
    let dir = fixture();
    let embedder = Embedder::from_dir(&dir).unwrap();
    assert_eq!(embedder.pooling, Pooling::LastToken);
    assert!(embedder.normalize);
    assert_eq!(
        embedder.prompt_names().collect::<Vec<_>>(),
        ["document", "query"]
    );
    let tokenizer = Tokenizer::from_dir(&dir).unwrap();
    assert_eq!(tokenizer.hf_class().name(), "Qwen2Tokenizer");
    let model = model(&dir);
    let inputs = golden::inputs();
    // The tokenizer puts the prompt first and appends `<|endoftext|>` (id 0), as transformers'.
    let mut ids = Vec::new();
    for input in &inputs {
        let text = EmbedInput::Text(input.text.clone());
        let tokenized = embedder
            .tokenize(&tokenizer, &[text], input.prompt_name.as_deref())
            .unwrap();
        assert_eq!(
            tokenized,
            std::slice::from_ref(&input.ids),
            "{:?}",
            input.text
        );
        ids.push(input.ids.clone());
    }
    // All inputs in one call (one pass, each padded to the longest): each is what the oracle
    // gives, and what it gives alone but for the products' rounding over more rows.
    let batch = embedder.embed(model.as_ref(), &ids, None).unwrap();
    for (input, vector) in inputs.iter().zip(&batch) {
        assert_close(vector, &input.vector("last_token"), &input.text);
        let alone = embedder.embed(model.as_ref(), std::slice::from_ref(&input.ids), None);
        let what = format!("{}: batched", input.text);
        assert_within(vector, &alone.unwrap()[0], 1e-6, &what);
    }
    let cut = embedder.embed(model.as_ref(), &ids, Some(32)).unwrap();
    for (input, vector) in inputs.iter().zip(&cut) {
        assert_close(
            vector,
            &input.vector("last_token_dimensions_32"),
            &input.text,
        );
    }
}

/// On a GPU, where there is one: the hidden states computed there and copied back. With exact
/// math (f32 operands) they are held to the CPU's tolerance; with the default fast paths (TF32
/// products for prompts over 64 tokens, int16 activations in the short ones' products) to
/// FAST_GPU_TOLERANCE.
#[test]
fn qwen3_embedding_matches_the_oracle_on_a_gpu() {
    if !cuda::libraries_present() {
        eprintln!("GPU run skipped: no CUDA driver on this machine");
        return;
    }
    let Device::Cuda(gpu) = Device::open("cuda").expect("opening GPU 0") else {
        unreachable!()
    };
    let exact = Device::Cuda(gpu.with_exact_math(true));
    let embedder = Embedder::from_dir(&fixture()).unwrap();
    let inputs = golden::inputs();
    let ids: Vec<Vec<u32>> = inputs.iter().map(|input| input.ids.clone()).collect();
    for (label, device, tolerance) in [
        ("exact", exact, TOLERANCE),
        ("fast", Device::Cuda(gpu), FAST_GPU_TOLERANCE),
    ] {
        let model = oxlm_models::load_on(&fixture(), &device).unwrap();
        let vectors = embedder.embed(model.as_ref(), &ids, None).unwrap();
        for (input, vector) in inputs.iter().zip(&vectors) {
            let what = format!("{label}: {}", input.text);
            assert_within(vector, &input.vector("last_token"), tolerance, &what);
        }
    }
}

/// Inputs of different lengths go through one pass padded to the longest (and one longer than
/// a pass holds goes alone): each vector is the one it gets alone, by either pooling.
#[test]
fn inputs_of_different_lengths_embed_together_as_alone() {
    let copy = changed_copy(|dir| {
        edit_json(&dir.join("1_Pooling/config.json"), |config| {
            config["pooling_mode_lasttoken"] = false.into();
            config["pooling_mode_mean_tokens"] = true.into();
        })
    });
    let ids: Vec<Vec<u32>> = [17, 1, 40, 3, 2100, 40]
        .iter()
        .enumerate()
        .map(|(i, &n)| {
            (0..n)
                .map(|t| ((t * 7 + i * 13) % 150) as u32 + 1)
                .collect()
        })
        .collect();
    for dir in [fixture(), copy.path().to_path_buf()] {
        let embedder = Embedder::from_dir(&dir).unwrap();
        let model = model(&dir);
        let together = embedder.embed(model.as_ref(), &ids, None).unwrap();
        for (input, vector) in ids.iter().zip(&together) {
            let alone = embedder.embed(model.as_ref(), std::slice::from_ref(input), None);
            let what = format!("{:?} pooling, {} tokens", embedder.pooling, input.len());
            assert_within(vector, &alone.unwrap()[0], 1e-6, &what);
        }
    }
}

#[test]
fn mean_pooling_where_the_pooling_config_asks() {
    let copy = changed_copy(|dir| {
        edit_json(&dir.join("1_Pooling/config.json"), |config| {
            config["pooling_mode_lasttoken"] = false.into();
            config["pooling_mode_mean_tokens"] = true.into();
        })
    });
    let embedder = Embedder::from_dir(copy.path()).unwrap();
    assert_eq!(embedder.pooling, Pooling::Mean);
    let model = model(copy.path());
    let inputs = golden::inputs();
    let ids: Vec<Vec<u32>> = inputs.iter().map(|input| input.ids.clone()).collect();
    let vectors = embedder.embed(model.as_ref(), &ids, None).unwrap();
    for (input, vector) in inputs.iter().zip(&vectors) {
        assert_close(vector, &input.vector("mean"), &input.text);
    }
}

/// Qwen3-Embedding-8B is untied, and exports of it as a bare `Qwen3Model` carry no `lm_head`:
/// such a checkpoint loads, embeds (from config.json alone: last token, normalized), and gives
/// the hidden states its weights give.
#[test]
fn a_bare_model_without_a_head_embeds() {
    let copy = changed_copy(|dir| {
        for file in ["modules.json", "config_sentence_transformers.json"] {
            std::fs::remove_file(dir.join(file)).unwrap();
        }
        std::fs::remove_dir_all(dir.join("1_Pooling")).unwrap();
        edit_json(&dir.join("config.json"), |config| {
            config["architectures"] = serde_json::json!(["Qwen3Model"]);
            config["tie_word_embeddings"] = false.into();
        });
    });
    let embedder = Embedder::from_dir(copy.path()).unwrap();
    assert_eq!(
        (embedder.pooling, embedder.normalize),
        (Pooling::LastToken, true)
    );
    let model = model(copy.path());
    let input = &golden::inputs()[0];
    let vector = embedder.embed(model.as_ref(), std::slice::from_ref(&input.ids), None);
    assert_close(
        &vector.unwrap()[0],
        &input.vector("last_token"),
        &input.text,
    );
}

#[test]
fn a_causal_model_without_embedding_files_cannot_embed() {
    let err = Embedder::from_dir(&tiny().join("qwen3-8bit-g128")).unwrap_err();
    assert!(matches!(err, EmbedError::NotAnEmbeddingModel));
    assert_eq!(
        err.to_string(),
        "it has no sentence-transformers modules.json, and config.json's `architectures` names \
         no bare `*Model` (a model without a language-model head)"
    );
}

#[test]
fn pipelines_beyond_pooling_and_normalization_are_refused() {
    let copy = changed_copy(|dir| {
        edit_json(&dir.join("modules.json"), |modules| {
            modules.as_array_mut().unwrap().push(serde_json::json!(
                {"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"}
            ));
        })
    });
    let err = Embedder::from_dir(copy.path()).unwrap_err().to_string();
    assert!(
        err.ends_with(
            "modules.json: module `sentence_transformers.models.Dense` is not supported (only \
             sentence_transformers.models.Transformer, sentence_transformers.models.Pooling and \
             sentence_transformers.models.Normalize)"
        ),
        "{err}"
    );
    let copy = changed_copy(|dir| {
        edit_json(&dir.join("1_Pooling/config.json"), |config| {
            config["pooling_mode_cls_token"] = true.into();
        })
    });
    let err = Embedder::from_dir(copy.path()).unwrap_err().to_string();
    assert!(
        err.ends_with(
            "config.json: pooling by pooling_mode_cls_token and pooling_mode_lasttoken is not \
             supported (pooling_mode_lasttoken or pooling_mode_mean_tokens alone is)"
        ),
        "{err}"
    );
}

#[test]
fn inputs_the_model_cannot_take_are_refused_before_any_runs() {
    let dir = fixture();
    let embedder = Embedder::from_dir(&dir).unwrap();
    let tokenizer = Tokenizer::from_dir(&dir).unwrap();
    let model = model(&dir);
    let info = model.info();
    let refused = |inputs: &[Vec<u32>], dimensions| {
        embedder
            .check(info, inputs, dimensions)
            .unwrap_err()
            .to_string()
    };
    assert_eq!(
        refused(&[], None),
        "no input: at least one text or list of token ids is needed"
    );
    assert_eq!(refused(&[vec![1], vec![]], None), "input 1 is empty");
    assert_eq!(
        refused(&[vec![1, 512]], None),
        "input 0: token id 512 is outside the vocabulary of 512 tokens"
    );
    assert_eq!(
        refused(&[vec![1], vec![1; 40961]], None),
        "input 1 has 40961 tokens, more than the model's context of 40960"
    );
    for asked in [0, 129] {
        assert_eq!(
            refused(&[vec![1]], Some(asked)),
            format!("dimensions must be from 1 to 128 (the model's embedding size), not {asked}")
        );
    }
    let empty = [EmbedInput::Text(String::new())];
    let err = embedder.tokenize(&tokenizer, &empty, None).unwrap_err();
    assert_eq!(err.to_string(), "input 0 is empty");
    let text = [EmbedInput::Text("hi".into())];
    let err = embedder.tokenize(&tokenizer, &text, Some("passage"));
    assert_eq!(
        err.unwrap_err().to_string(),
        "the model has no prompt named `passage` (it has: document, query)"
    );
}
