//! Arbitrary text as the `config.json` of a real tiny checkpoint (the first byte picks which of
//! tests/fixtures/tiny), loaded as `oxlm generate` loads a model: the typed arguments of every
//! architecture, the quantization section, and the checks of the config against the weights.
//! A model that loads must take a token.
#![no_main]

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use oxlm_models::{Checkpoint, ForwardError, Logits};

/// One scratch model directory per fixture, its weights linked from the fixture.
fn model_dirs() -> &'static [PathBuf] {
    static SCRATCH: OnceLock<tempfile::TempDir> = OnceLock::new();
    static DIRS: OnceLock<Vec<PathBuf>> = OnceLock::new();
    DIRS.get_or_init(|| {
        let scratch = SCRATCH.get_or_init(|| tempfile::tempdir().expect("a scratch directory"));
        let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/tiny");
        let mut weights: Vec<PathBuf> = std::fs::read_dir(&fixtures)
            .expect("tests/fixtures/tiny")
            .map(|entry| entry.expect("a fixture").path().join("model.safetensors"))
            .filter(|path| path.exists())
            .collect();
        // The seed corpus (scripts/fuzz.sh) numbers the fixtures in this order.
        weights.sort();
        weights
            .iter()
            .enumerate()
            .map(|(i, file)| {
                let dir = scratch.path().join(i.to_string());
                std::fs::create_dir(&dir).expect("a model directory");
                std::os::unix::fs::symlink(file, dir.join("model.safetensors"))
                    .expect("a link to the weights");
                dir
            })
            .collect()
    })
}

fuzz_target!(|data: &[u8]| {
    let Some((&pick, config)) = data.split_first() else {
        return;
    };
    let dirs = model_dirs();
    let dir = &dirs[usize::from(pick) % dirs.len()];
    std::fs::write(dir.join("config.json"), config).expect("the scratch file is writable");
    let Ok(model) = oxlm_models::load(dir) else {
        return;
    };
    // What `oxlm lora` and `oxlm fuse` ask of a checkpoint whose model loads.
    Checkpoint::open(dir)
        .expect("a checkpoint whose model loads")
        .parameter_count();
    let vocab = model.info().vocab_size;
    let mut cache = model.new_cache().expect("a cache for a loaded model");
    match model.forward(&[0], &mut cache, Logits::Last) {
        Ok(logits) => assert_eq!(logits.shape(), [1, vocab]),
        // A `max_position_embeddings` of 0 holds no token.
        Err(ForwardError::ContextOverflow { .. }) => {}
        Err(e) => panic!("a loaded model refuses a token: {e}"),
    }
});
