//! The adapter store keeps loaded adapters (least recently used out) and reloads one whose
//! weights changed, over the tiny llama and the LoRA fixtures mlx-lm made for it.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use oxlm_models::lora::{AdaptedModel, Adapters};
use oxlm_runtime::adapter_store::{AdapterStore, AdapterStoreError};

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

fn model(name: &str) -> Box<dyn oxlm_models::LanguageModel> {
    oxlm_models::load(&fixtures().join("tiny").join(name)).unwrap()
}

/// A root holding copies of two adapters for the tiny llama: `a` and `b`.
fn root() -> tempfile::TempDir {
    let root = tempfile::tempdir().unwrap();
    for (name, from) in [
        ("a", "lora/llama-4bit-g64-r4"),
        ("b", "lora/train-llama-4bit-g64/final"),
    ] {
        let to = root.path().join(name);
        std::fs::create_dir(&to).unwrap();
        for file in ["adapter_config.json", "adapters.safetensors"] {
            std::fs::copy(fixtures().join(from).join(file), to.join(file)).unwrap();
        }
    }
    root
}

fn touch(file: &Path, when: SystemTime) {
    let file = std::fs::File::options().write(true).open(file).unwrap();
    file.set_modified(when).unwrap();
}

#[test]
fn loaded_adapters_are_kept_and_the_least_recent_goes() {
    let model = model("llama-4bit-g64");
    let root = root();
    let mut store = AdapterStore::open(root.path(), 2, model.as_ref()).unwrap();
    let a = store.get("a", model.as_ref()).unwrap();
    assert!(!a.adapters.layers.is_empty());
    assert!(Arc::ptr_eq(&a, &store.get("./a", model.as_ref()).unwrap()));
    let b = store.get("b", model.as_ref()).unwrap();
    assert_ne!(a.id, b.id);
    // A link inside the root to the same directory is the same adapter, not a second load.
    std::os::unix::fs::symlink(root.path().join("b"), root.path().join("link")).unwrap();
    assert!(Arc::ptr_eq(&b, &store.get("link", model.as_ref()).unwrap()));
    // A third adapter pushes out the least recently used one, `a`.
    std::fs::create_dir(root.path().join("c")).unwrap();
    for file in ["adapter_config.json", "adapters.safetensors"] {
        std::fs::copy(
            root.path().join("a").join(file),
            root.path().join("c").join(file),
        )
        .unwrap();
    }
    store.get("c", model.as_ref()).unwrap();
    assert!(Arc::ptr_eq(&b, &store.get("b", model.as_ref()).unwrap()));
    let reloaded = store.get("a", model.as_ref()).unwrap();
    assert!(!Arc::ptr_eq(&a, &reloaded));
    assert_eq!(a.id, reloaded.id);
    // An adapter trained again in place is loaded again.
    let weights = root.path().join("a/adapters.safetensors");
    touch(&weights, SystemTime::now() + Duration::from_secs(60));
    let retrained = store.get("a", model.as_ref()).unwrap();
    assert!(!Arc::ptr_eq(&reloaded, &retrained));
    assert_ne!(reloaded.id, retrained.id);
}

#[test]
fn names_resolve_inside_the_root_only() {
    let model = model("llama-4bit-g64");
    let root = root();
    let store = AdapterStore::open(root.path(), 2, model.as_ref()).unwrap();
    assert_eq!(store.names(), ["a", "b"]);
    assert_eq!(
        store.resolve("a").unwrap(),
        root.path().canonicalize().unwrap().join("a")
    );
    let outside = tempfile::tempdir().unwrap();
    std::os::unix::fs::symlink(outside.path(), root.path().join("out")).unwrap();
    for name in ["../a", "/etc", "a/../../x", "out", ""] {
        assert!(
            matches!(store.resolve(name), Err(AdapterStoreError::OutsideRoot(n)) if n == name),
            "{name}"
        );
    }
    assert!(matches!(
        store.resolve("missing"),
        Err(AdapterStoreError::NotFound(_))
    ));
}

/// The adapter's directory is inside the root, but one of its files is a link to a file outside:
/// refused as a directory link out would be. Links between adapters inside the root are fine.
#[test]
fn files_linked_out_of_the_root_are_refused() {
    let model = model("llama-4bit-g64");
    let root = root();
    let outside = tempfile::tempdir().unwrap();
    for file in ["adapter_config.json", "adapters.safetensors"] {
        std::fs::copy(root.path().join("a").join(file), outside.path().join(file)).unwrap();
        let dir = root.path().join(format!("linked-{file}"));
        std::fs::create_dir(&dir).unwrap();
        for other in ["adapter_config.json", "adapters.safetensors"] {
            if other != file {
                std::fs::copy(root.path().join("a").join(other), dir.join(other)).unwrap();
            }
        }
        std::os::unix::fs::symlink(outside.path().join(file), dir.join(file)).unwrap();
    }
    let mut store = AdapterStore::open(root.path(), 2, model.as_ref()).unwrap();
    for name in ["linked-adapter_config.json", "linked-adapters.safetensors"] {
        let refused = |result: Result<(), AdapterStoreError>| match result {
            Err(AdapterStoreError::OutsideRoot(refused)) => refused == name,
            _ => false,
        };
        assert!(refused(store.resolve(name).map(|_| ())), "{name}");
        assert!(
            refused(store.get(name, model.as_ref()).map(|_| ())),
            "{name}"
        );
    }

    let shared = root.path().join("shared");
    std::fs::create_dir(&shared).unwrap();
    std::fs::copy(
        root.path().join("a/adapter_config.json"),
        shared.join("adapter_config.json"),
    )
    .unwrap();
    std::os::unix::fs::symlink(
        "../a/adapters.safetensors",
        shared.join("adapters.safetensors"),
    )
    .unwrap();
    let a = store.get("a", model.as_ref()).unwrap();
    let linked = store.get("shared", model.as_ref()).unwrap();
    assert_eq!(linked.adapters.layers, a.adapters.layers);
}

#[test]
fn models_without_adapter_support_and_missing_roots_are_refused() {
    // A model already seen through adapters takes no more.
    let llama = model("llama-4bit-g64");
    let lora = fixtures().join("lora/llama-4bit-g64-r4");
    let adapters = Adapters::load(&lora, llama.as_ref()).unwrap();
    let adapted = AdaptedModel::new(llama.as_ref(), &adapters).unwrap();
    let root = root();
    let error = AdapterStore::open(root.path(), 2, &adapted).err().unwrap();
    assert!(matches!(error, AdapterStoreError::Model(_)), "{error}");
    let error = AdapterStore::open(&root.path().join("none"), 2, llama.as_ref())
        .err()
        .unwrap();
    assert!(matches!(error, AdapterStoreError::Root { .. }), "{error}");
}
