//! Arbitrary bytes as a checkpoint's `model.safetensors`, opened both ways a model loads one
//! (memory-mapped, and read into an aligned buffer). Whatever opens must list the arrays the
//! safetensors crate reads from the same bytes, each with exactly its bytes.
#![no_main]

use std::path::PathBuf;
use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use oxlm_models::checkpoint::{open_safetensors, Residency};

fn file() -> &'static PathBuf {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    static FILE: OnceLock<PathBuf> = OnceLock::new();
    FILE.get_or_init(|| {
        let dir = DIR.get_or_init(|| tempfile::tempdir().expect("a scratch directory"));
        dir.path().join("model.safetensors")
    })
}

fuzz_target!(|data: &[u8]| {
    let path = file();
    std::fs::write(path, data).expect("the scratch file is writable");
    let expected = safetensors::SafeTensors::deserialize(data);
    for residency in [Residency::Mapped, Residency::Resident] {
        let Ok(tensors) = open_safetensors(path, residency) else {
            continue;
        };
        let expected = expected
            .as_ref()
            .expect("oxlm opened a file the safetensors crate rejects");
        assert_eq!(tensors.len(), expected.len());
        for (name, tensor) in &tensors {
            let view = expected.tensor(name).expect("an array of the file");
            assert_eq!(tensor.shape, view.shape(), "{name}");
            let elements: usize = tensor.shape.iter().product();
            assert_eq!(
                tensor.data.len(),
                elements * tensor.dtype.size_in_bytes(),
                "{name}"
            );
            assert_eq!(
                tensor.data.as_slice(),
                view.data(),
                "{name} ({residency:?})"
            );
        }
    }
});
