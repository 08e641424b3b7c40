//! Writing checkpoint files atomically: each file goes to a temporary name beside its target and
//! is renamed over it once complete, so an interrupted run never leaves a half-written file where
//! the last good one was. A directory of files that belong together (a model) is written whole
//! beside its target and swapped into place ([`StagedDir`]), so that it is never some files of
//! each. Temporary files and directories are removed when the write fails, and by
//! [`remove_partial_files_before_exit`] when a signal ends the process.

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard, PoisonError};

use half::{bf16, f16};
use oxlm_engine::DType;
use safetensors::tensor::{Metadata, TensorInfo, TensorView};
use safetensors::View;
use serde_json::Value;
use thiserror::Error;

#[derive(Debug, Error)]
pub enum SaveError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: cannot write safetensors: {reason}")]
    Safetensors { path: PathBuf, reason: String },
}

/// One array to write: its element type, shape and little-endian bytes.
#[derive(Debug, Clone)]
pub struct TensorBytes<'a> {
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub data: Cow<'a, [u8]>,
}

impl TensorBytes<'_> {
    /// f32 values as an owned array.
    pub fn f32(shape: Vec<usize>, values: &[f32]) -> TensorBytes<'static> {
        TensorBytes {
            dtype: DType::F32,
            shape,
            data: Cow::Owned(values.iter().flat_map(|v| v.to_le_bytes()).collect()),
        }
    }
}

/// mlx-lm's largest weight file (`MAX_FILE_SIZE_GB`): a checkpoint larger is written in shards.
pub const MAX_SHARD_BYTES: usize = 5 << 30;

/// Files besides the weights that a model directory carries over: the tokenizer's, the chat
/// template and the generation defaults.
pub const COMPANION_FILES: &[&str] = &[
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
];

/// Rounds `v` to the nearest value of `dtype` (floats only), as MLX stores it.
pub fn round_to(dtype: DType, v: f32) -> f32 {
    match dtype {
        DType::F16 => f16::from_f32(v).to_f32(),
        DType::BF16 => bf16::from_f32(v).to_f32(),
        _ => v,
    }
}

/// `values` stored as `dtype` (f16, bf16, else f32), each rounded to nearest.
pub fn float_bytes(dtype: DType, values: &[f32]) -> Vec<u8> {
    match dtype {
        DType::F16 => values
            .iter()
            .flat_map(|&v| f16::from_f32(v).to_le_bytes())
            .collect(),
        DType::BF16 => values
            .iter()
            .flat_map(|&v| bf16::from_f32(v).to_le_bytes())
            .collect(),
        _ => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
    }
}

/// The object's keys in sorted order, as mlx-lm's `save_config` and index writer sort them (the
/// workspace's serde_json keeps insertion order).
pub fn sorted_keys(value: Value) -> Value {
    match value {
        Value::Object(map) => {
            let mut entries: Vec<(String, Value)> = map.into_iter().collect();
            entries.sort_by(|a, b| a.0.cmp(&b.0));
            Value::Object(entries.into_iter().collect())
        }
        other => other,
    }
}

/// The safetensors name of an engine element type (the inverse of
/// [`crate::checkpoint::engine_dtype`]).
pub fn safetensors_dtype(dtype: DType) -> safetensors::Dtype {
    use safetensors::Dtype as S;
    match dtype {
        DType::F32 => S::F32,
        DType::F16 => S::F16,
        DType::BF16 => S::BF16,
        DType::U32 => S::U32,
        DType::I32 => S::I32,
        DType::U8 => S::U8,
        DType::I8 => S::I8,
        DType::Bool => S::BOOL,
        DType::I64 => S::I64,
        DType::U64 => S::U64,
        DType::F64 => S::F64,
        DType::U16 => S::U16,
        DType::I16 => S::I16,
    }
}

/// The temporary files this process is writing. A signal's default action ends the process
/// without running destructors, so a handler of SIGINT or SIGTERM removes them through
/// [`remove_partial_files_before_exit`].
static PARTIAL_FILES: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());

fn partial_files() -> MutexGuard<'static, Vec<PathBuf>> {
    // Each change to the list is one push or one removal, so a panic cannot leave it half made.
    PARTIAL_FILES.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Removes every temporary file this process is writing, and keeps new ones from being started
/// or renamed: for a signal handler that ends the process next. Writers that get this far wait
/// until the process ends.
pub fn remove_partial_files_before_exit() {
    let mut files = partial_files();
    for file in files.drain(..) {
        let _ = match file.is_dir() {
            true => std::fs::remove_dir_all(file),
            false => std::fs::remove_file(file),
        };
    }
    // Never unlocked: a writer let in now would make a file that no one removes.
    std::mem::forget(files);
}

/// A file being written under a temporary name beside its target: [`Partial::commit`] renames
/// it over the target; dropped before that (an error, a panic), it removes the file.
struct Partial {
    target: PathBuf,
    temp: PathBuf,
}

impl Partial {
    /// Creates (or truncates) the temporary file of `target`.
    fn create(target: &Path) -> Result<(Self, File), SaveError> {
        let mut name = target.file_name().unwrap_or_default().to_os_string();
        name.push(".partial");
        let temp = target.with_file_name(name);
        // Under the lock, so that a signal handler's removal either sees the file or keeps it
        // from being made.
        let mut files = partial_files();
        let file = File::create(&temp).map_err(io_error(target))?;
        files.push(temp.clone());
        let partial = Partial {
            target: target.to_path_buf(),
            temp,
        };
        Ok((partial, file))
    }

    fn commit(self) -> Result<(), SaveError> {
        let renamed = {
            let mut files = partial_files();
            let renamed = std::fs::rename(&self.temp, &self.target);
            if renamed.is_ok() {
                forget_file(&mut files, &self.temp);
            }
            renamed
        };
        // On failure the drop that follows removes the temporary file.
        renamed.map_err(io_error(&self.target))
    }
}

impl Drop for Partial {
    fn drop(&mut self) {
        let mut files = partial_files();
        if forget_file(&mut files, &self.temp) {
            let _ = std::fs::remove_file(&self.temp);
        }
    }
}

/// A directory written under a temporary name beside its target (`.NAME.partial-PID`), then
/// swapped into place whole by [`StagedDir::commit`]: killed at any moment (SIGKILL included),
/// the target holds either its earlier files or all the new ones. Dropped before the commit,
/// it is removed; one left by a process that was killed is removed by the next `create`.
pub struct StagedDir {
    target: PathBuf,
    dir: PathBuf,
}

impl StagedDir {
    pub fn create(target: &Path) -> Result<Self, SaveError> {
        let parent = match target.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        };
        std::fs::create_dir_all(&parent).map_err(io_error(&parent))?;
        let name = target.file_name().unwrap_or_default().to_string_lossy();
        let prefix = format!(".{name}.partial-");
        remove_abandoned(&parent, &prefix);
        let dir = parent.join(format!("{prefix}{}", std::process::id()));
        let mut files = partial_files();
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir(&dir).map_err(io_error(&dir))?;
        files.push(dir.clone());
        Ok(StagedDir {
            target: target.to_path_buf(),
            dir,
        })
    }

    /// Where the files go until the commit.
    pub fn path(&self) -> &Path {
        &self.dir
    }

    /// Puts the directory in place of its target. An existing target is exchanged with it in
    /// one step; of the earlier files, those the new output does not replace and that are not
    /// weights (a README, say) are moved into the new one, and the rest is removed.
    pub fn commit(self) -> Result<(), SaveError> {
        let mut files = partial_files();
        if !self.target.exists() {
            std::fs::rename(&self.dir, &self.target).map_err(io_error(&self.target))?;
            forget_file(&mut files, &self.dir);
            return Ok(());
        }
        use rustix::fs::{renameat_with, RenameFlags, CWD};
        let exchanged = renameat_with(CWD, &self.dir, CWD, &self.target, RenameFlags::EXCHANGE);
        if exchanged.is_err() {
            // A file system without the exchange: the earlier directory steps aside first, which
            // leaves a moment with no target.
            let aside = self.dir.with_extension("earlier");
            std::fs::rename(&self.target, &aside).map_err(io_error(&self.target))?;
            std::fs::rename(&self.dir, &self.target).map_err(io_error(&self.target))?;
            std::fs::rename(&aside, &self.dir).map_err(io_error(&self.dir))?;
        }
        // The staged path now holds the earlier files; the list still names it, so a signal
        // from here on removes them.
        drop(files);
        let earlier = std::fs::read_dir(&self.dir).map_err(io_error(&self.dir))?;
        for entry in earlier.flatten() {
            let name = entry.file_name();
            let weights = name.to_string_lossy().contains(".safetensors");
            if !weights && !self.target.join(&name).exists() {
                let _ = std::fs::rename(entry.path(), self.target.join(&name));
            }
        }
        Ok(())
    }
}

impl Drop for StagedDir {
    fn drop(&mut self) {
        let mut files = partial_files();
        if forget_file(&mut files, &self.dir) {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// Removes the staged directories (`{prefix}PID`) in `parent` of processes that are gone.
fn remove_abandoned(parent: &Path, prefix: &str) {
    let Ok(entries) = std::fs::read_dir(parent) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let pid = name
            .to_string_lossy()
            .strip_prefix(prefix)
            .map(str::to_owned);
        let gone = pid.is_some_and(|pid| !Path::new("/proc").join(pid).exists());
        if gone {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

/// Takes `file` off the list; whether it was there (not yet committed or removed).
fn forget_file(files: &mut Vec<PathBuf>, file: &Path) -> bool {
    let found = files.iter().position(|f| f == file);
    if let Some(i) = found {
        files.swap_remove(i);
    }
    found.is_some()
}

fn io_error(path: &Path) -> impl FnOnce(std::io::Error) -> SaveError + '_ {
    move |source| SaveError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Writes `tensors` as a safetensors file with MLX's `{"format": "mlx"}` metadata, laid out as
/// `safetensors::serialize` lays it out. Written here rather than by `serialize_to_file`, whose
/// own temporary file (a random name) a signal handler could not know to remove.
pub fn write_safetensors(
    path: &Path,
    tensors: &BTreeMap<String, TensorBytes>,
) -> Result<(), SaveError> {
    let format = HashMap::from([("format".to_string(), "mlx".to_string())]);
    write_safetensors_with_metadata(path, tensors, format)
}

/// [`write_safetensors`] with `metadata` in place of MLX's `{"format": "mlx"}`: mlx-lm's prompt
/// caches keep their own there, and nothing else.
pub fn write_safetensors_with_metadata(
    path: &Path,
    tensors: &BTreeMap<String, TensorBytes>,
    metadata: HashMap<String, String>,
) -> Result<(), SaveError> {
    let bad = |reason: String| SaveError::Safetensors {
        path: path.to_path_buf(),
        reason,
    };
    // A view checks that its shape fits its bytes.
    let mut views = tensors
        .iter()
        .map(|(name, t)| {
            TensorView::new(safetensors_dtype(t.dtype), t.shape.clone(), &t.data)
                .map(|view| (name.as_str(), view))
                .map_err(|e| bad(format!("`{name}`: {e}")))
        })
        .collect::<Result<Vec<_>, _>>()?;
    // safetensors' order: by descending alignment of the dtype, then by name.
    views.sort_by(|(a, x), (b, y)| y.dtype().cmp(&x.dtype()).then(a.cmp(b)));
    let mut end = 0;
    let infos = views
        .iter()
        .map(|(name, view)| {
            let start = end;
            end += view.data_len();
            let info = TensorInfo {
                dtype: view.dtype(),
                shape: view.shape().to_vec(),
                data_offsets: (start, end),
            };
            (name.to_string(), info)
        })
        .collect();
    let metadata = Metadata::new(Some(metadata), infos).map_err(|e| bad(e.to_string()))?;
    let mut header = serde_json::to_vec(&metadata).map_err(|e| bad(e.to_string()))?;
    // The data starts on a multiple of 8 bytes, padded with spaces.
    header.resize(header.len().next_multiple_of(8), b' ');

    let (partial, file) = Partial::create(path)?;
    write_parts(file, &header, &views).map_err(io_error(path))?;
    partial.commit()
}

/// A safetensors file's length-prefixed header, then each view's bytes in order.
fn write_parts(file: File, header: &[u8], views: &[(&str, TensorView)]) -> std::io::Result<()> {
    let mut out = BufWriter::with_capacity(1 << 20, file);
    out.write_all(&(header.len() as u64).to_le_bytes())?;
    out.write_all(header)?;
    for (_, view) in views {
        out.write_all(view.data())?;
    }
    out.flush()
}

/// Writes `value` as JSON indented by 4 spaces, as mlx-lm's `json.dump(…, indent=4)`.
pub fn write_json(path: &Path, value: &Value) -> Result<(), SaveError> {
    let mut text = Vec::new();
    let formatter = serde_json::ser::PrettyFormatter::with_indent(b"    ");
    let mut ser = serde_json::Serializer::with_formatter(&mut text, formatter);
    serde::Serialize::serialize(value, &mut ser).expect("a JSON value always serializes");
    let (partial, mut file) = Partial::create(path)?;
    file.write_all(&text).map_err(io_error(path))?;
    drop(file);
    partial.commit()
}

/// Copies `from` to `to` by way of a temporary name.
pub fn copy_file(from: &Path, to: &Path) -> Result<(), SaveError> {
    let mut source = File::open(from).map_err(io_error(from))?;
    let (partial, mut file) = Partial::create(to)?;
    std::io::copy(&mut source, &mut file).map_err(io_error(to))?;
    drop(file);
    partial.commit()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn one(values: &[f32]) -> BTreeMap<String, TensorBytes<'static>> {
        BTreeMap::from([(
            "x".to_string(),
            TensorBytes::f32(vec![values.len()], values),
        )])
    }

    #[test]
    fn a_failed_write_leaves_the_last_good_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("adapters.safetensors");
        write_safetensors(&path, &one(&[1.0, 2.0])).unwrap();
        let good = std::fs::read(&path).unwrap();
        // A shape that does not fit its bytes fails before anything is renamed.
        let mut bad = one(&[3.0, 4.0]);
        bad.get_mut("x").unwrap().shape = vec![3];
        assert!(write_safetensors(&path, &bad).is_err());
        assert_eq!(std::fs::read(&path).unwrap(), good);
        write_safetensors(&path, &one(&[3.0, 4.0])).unwrap();
        assert_ne!(std::fs::read(&path).unwrap(), good);
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, ["adapters.safetensors"]);
    }

    fn entries(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }

    /// The file is what `safetensors::serialize` makes of the same arrays, byte for byte.
    #[test]
    fn the_layout_is_safetensors_own() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("model.safetensors");
        let mut tensors = one(&[1.0, 2.0, 3.0]);
        tensors.insert(
            "a.scales".into(),
            TensorBytes {
                dtype: DType::BF16,
                shape: vec![1, 3],
                data: Cow::Owned(vec![1, 2, 3, 4, 5, 6]),
            },
        );
        tensors.insert(
            "a.weight".into(),
            TensorBytes {
                dtype: DType::U32,
                shape: vec![1],
                data: Cow::Owned(vec![7, 8, 9, 10]),
            },
        );
        write_safetensors(&path, &tensors).unwrap();
        let views = tensors.iter().map(|(name, t)| {
            let view = TensorView::new(safetensors_dtype(t.dtype), t.shape.clone(), &t.data);
            (name.clone(), view.unwrap())
        });
        let format = HashMap::from([("format".to_string(), "mlx".to_string())]);
        let want = safetensors::serialize(views, Some(format)).unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), want);
    }

    /// A write that fails after its temporary file was made (here the rename, onto a directory)
    /// removes that file.
    #[test]
    fn a_failed_write_leaves_no_temporary_file() {
        let dir = tempfile::tempdir().unwrap();
        let source = dir.path().join("tokenizer.json");
        std::fs::write(&source, "{}").unwrap();
        let target = dir.path().join("taken");
        std::fs::create_dir(&target).unwrap();
        std::fs::write(target.join("inside"), "").unwrap();
        let failures = [
            write_safetensors(&target, &one(&[1.0])),
            write_json(&target, &Value::Null),
            copy_file(&source, &target),
        ];
        for failure in failures {
            let err = failure.unwrap_err();
            assert!(
                matches!(&err, SaveError::Io { path, .. } if *path == target),
                "{err}"
            );
        }
        assert_eq!(entries(dir.path()), ["taken", "tokenizer.json"]);
    }

    /// A staged directory replaces its target whole: the earlier weights go, a file the new
    /// output does not write stays, and nothing is left beside the target; dropped before the
    /// commit, it leaves the target as it was; one a killed process left is removed by the next.
    #[test]
    fn a_staged_directory_replaces_its_target_whole() {
        let root = tempfile::tempdir().unwrap();
        let target = root.path().join("model");
        std::fs::create_dir(&target).unwrap();
        for name in [
            "model-00001-of-00002.safetensors",
            "config.json",
            "README.md",
        ] {
            std::fs::write(target.join(name), "earlier").unwrap();
        }
        let abandoned = root.path().join(".model.partial-4000000");
        std::fs::create_dir(&abandoned).unwrap();

        let staged = StagedDir::create(&target).unwrap();
        assert!(!abandoned.exists());
        std::fs::write(staged.path().join("config.json"), "new").unwrap();
        drop(staged);
        assert_eq!(entries(root.path()), ["model"]);
        assert_eq!(
            std::fs::read_to_string(target.join("config.json")).unwrap(),
            "earlier"
        );

        let staged = StagedDir::create(&target).unwrap();
        for name in ["model.safetensors", "config.json"] {
            std::fs::write(staged.path().join(name), "new").unwrap();
        }
        staged.commit().unwrap();
        assert_eq!(entries(root.path()), ["model"]);
        assert_eq!(
            entries(&target),
            ["README.md", "config.json", "model.safetensors"]
        );
        assert_eq!(
            std::fs::read_to_string(target.join("config.json")).unwrap(),
            "new"
        );
        assert_eq!(
            std::fs::read_to_string(target.join("README.md")).unwrap(),
            "earlier"
        );

        let fresh = root.path().join("fresh");
        let staged = StagedDir::create(&fresh).unwrap();
        std::fs::write(staged.path().join("config.json"), "new").unwrap();
        staged.commit().unwrap();
        assert_eq!(entries(&fresh), ["config.json"]);
        assert_eq!(entries(root.path()), ["fresh", "model"]);
    }
}
