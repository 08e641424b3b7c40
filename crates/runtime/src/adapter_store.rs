//! LoRA adapters chosen per request over one shared base model: adapter names resolve inside one
//! root directory only, and loaded adapters are kept (least recently used out, bounded by count)
//! so that a second request for one does not read its files again.

use std::path::{Component, Path, PathBuf};
use std::sync::Arc;
use std::time::SystemTime;

use oxlm_models::lora::{AdapterError, Adapters, CONFIG_FILE, WEIGHTS_FILE};
use oxlm_models::LanguageModel;
use thiserror::Error;

/// How deep [`AdapterStore::names`] looks for adapter directories below the root.
const LIST_DEPTH: usize = 3;

#[derive(Debug, Error)]
pub enum AdapterStoreError {
    #[error(
        "The adapter `{0}` is outside the adapter directory: name a directory inside it \
         (no `..`, absolute paths or links that lead out of it)"
    )]
    OutsideRoot(String),
    #[error("The adapter `{0}` does not exist: there is no {CONFIG_FILE} at `{0}` in the adapter directory")]
    NotFound(String),
    #[error("The adapter `{name}` cannot be used with this model: {error}")]
    Unusable { name: String, error: AdapterError },
    #[error("cannot use {} as the adapter directory: {source}", root.display())]
    Root {
        root: PathBuf,
        source: std::io::Error,
    },
    #[error(transparent)]
    Model(#[from] AdapterError),
}

/// What identifies an adapter's weights: its directory, and when its weights file last changed
/// (an adapter trained again in place is a different adapter).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct AdapterId {
    dir: PathBuf,
    modified: Option<SystemTime>,
}

impl AdapterId {
    fn of(dir: PathBuf) -> Self {
        let modified = std::fs::metadata(dir.join(WEIGHTS_FILE))
            .and_then(|m| m.modified())
            .ok();
        AdapterId { dir, modified }
    }
}

/// A loaded adapter.
#[derive(Debug)]
pub struct Adapter {
    pub id: AdapterId,
    pub adapters: Adapters,
}

impl Adapter {
    /// `adapters`, made in memory rather than read from a directory, known as `name`.
    pub fn unsaved(name: &str, adapters: Adapters) -> Self {
        Adapter {
            id: AdapterId {
                dir: PathBuf::from(name),
                modified: None,
            },
            adapters,
        }
    }

    /// Loads the adapter directory `dir` for `model`.
    pub fn load(dir: &Path, model: &dyn LanguageModel) -> Result<Self, AdapterError> {
        let dir = dir.canonicalize().unwrap_or_else(|_| dir.to_path_buf());
        let adapters = Adapters::load(&dir, model)?;
        Ok(Adapter {
            id: AdapterId::of(dir),
            adapters,
        })
    }
}

/// The adapters under one root directory, loaded on demand.
pub struct AdapterStore {
    /// Canonical, so that a resolved name can be checked to stay inside it.
    root: PathBuf,
    capacity: usize,
    /// Least recently used first.
    loaded: Vec<Arc<Adapter>>,
}

impl AdapterStore {
    /// Adapters under `root` for `model`, keeping at most `capacity` loaded.
    pub fn open(
        root: &Path,
        capacity: usize,
        model: &dyn LanguageModel,
    ) -> Result<Self, AdapterStoreError> {
        if model.adaptable().is_none() {
            return Err(AdapterError::UnsupportedModel(model.info().model_type.clone()).into());
        }
        let root_error = |source| AdapterStoreError::Root {
            root: root.to_path_buf(),
            source,
        };
        let canonical = root.canonicalize().map_err(root_error)?;
        if !canonical.is_dir() {
            return Err(root_error(std::io::ErrorKind::NotADirectory.into()));
        }
        Ok(AdapterStore {
            root: canonical,
            capacity,
            loaded: Vec::new(),
        })
    }

    /// The directory `name` denotes, when it is an adapter inside the root.
    pub fn resolve(&self, name: &str) -> Result<PathBuf, AdapterStoreError> {
        let path = Path::new(name);
        let plain = path
            .components()
            .all(|c| matches!(c, Component::Normal(_) | Component::CurDir));
        if name.is_empty() || !plain {
            return Err(AdapterStoreError::OutsideRoot(name.to_owned()));
        }
        let not_found = || AdapterStoreError::NotFound(name.to_owned());
        // Canonical paths have every link followed, so one that leads out is caught here.
        let dir = self
            .root
            .join(path)
            .canonicalize()
            .map_err(|_| not_found())?;
        if !dir.starts_with(&self.root) {
            return Err(AdapterStoreError::OutsideRoot(name.to_owned()));
        }
        if !dir.join(CONFIG_FILE).is_file() {
            return Err(not_found());
        }
        // The files are read through links too: a file that is one must also lead inside.
        for file in [CONFIG_FILE, WEIGHTS_FILE] {
            let target = dir.join(file).canonicalize();
            if target.is_ok_and(|target| !target.starts_with(&self.root)) {
                return Err(AdapterStoreError::OutsideRoot(name.to_owned()));
            }
        }
        Ok(dir)
    }

    /// The adapter `name`, loaded for `model` unless it already is.
    pub fn get(
        &mut self,
        name: &str,
        model: &dyn LanguageModel,
    ) -> Result<Arc<Adapter>, AdapterStoreError> {
        let id = AdapterId::of(self.resolve(name)?);
        if let Some(i) = self.loaded.iter().position(|a| a.id == id) {
            let adapter = self.loaded.remove(i);
            self.loaded.push(adapter.clone());
            return Ok(adapter);
        }
        let adapters =
            Adapters::load(&id.dir, model).map_err(|error| AdapterStoreError::Unusable {
                name: name.to_owned(),
                error,
            })?;
        let adapter = Arc::new(Adapter { id, adapters });
        if self.capacity > 0 {
            if self.loaded.len() == self.capacity {
                self.loaded.remove(0);
            }
            self.loaded.push(adapter.clone());
        }
        Ok(adapter)
    }

    /// The names of the adapter directories below the root (those holding an
    /// adapter_config.json, links not followed), sorted.
    pub fn names(&self) -> Vec<String> {
        let mut names = Vec::new();
        let mut pending = vec![(self.root.clone(), 0)];
        while let Some((dir, depth)) = pending.pop() {
            let Ok(entries) = std::fs::read_dir(&dir) else {
                continue;
            };
            for entry in entries.flatten() {
                if !entry.file_type().is_ok_and(|t| t.is_dir()) {
                    continue;
                }
                let path = entry.path();
                if path.join(CONFIG_FILE).is_file() {
                    let relative = path.strip_prefix(&self.root).unwrap_or(&path);
                    let parts: Vec<_> = relative.iter().map(|p| p.to_string_lossy()).collect();
                    names.push(parts.join("/"));
                } else if depth + 1 < LIST_DEPTH {
                    pending.push((path, depth + 1));
                }
            }
        }
        names.sort();
        names
    }
}
