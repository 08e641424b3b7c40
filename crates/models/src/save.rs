//! Writing checkpoint files atomically: each file goes to a temporary name beside its target and
//! is renamed over it once complete, so an interrupted run never leaves a half-written file where
//! the last good one was.

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use oxlm_engine::DType;
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

fn safetensors_dtype(dtype: DType) -> safetensors::Dtype {
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

/// The temporary name `path` is written under before the rename.
fn partial(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(".partial");
    path.with_file_name(name)
}

fn io_error(path: &Path) -> impl FnOnce(std::io::Error) -> SaveError + '_ {
    move |source| SaveError::Io {
        path: path.to_path_buf(),
        source,
    }
}

fn commit(path: &Path) -> Result<(), SaveError> {
    std::fs::rename(partial(path), path).map_err(io_error(path))
}

/// Writes `tensors` as a safetensors file with MLX's `{"format": "mlx"}` metadata.
pub fn write_safetensors(
    path: &Path,
    tensors: &BTreeMap<String, TensorBytes>,
) -> Result<(), SaveError> {
    let bad = |reason: String| SaveError::Safetensors {
        path: path.to_path_buf(),
        reason,
    };
    let views = tensors
        .iter()
        .map(|(name, t)| {
            safetensors::tensor::TensorView::new(
                safetensors_dtype(t.dtype),
                t.shape.clone(),
                &t.data,
            )
            .map(|view| (name.as_str(), view))
            .map_err(|e| bad(format!("`{name}`: {e}")))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let metadata = HashMap::from([("format".to_string(), "mlx".to_string())]);
    safetensors::tensor::serialize_to_file(views, Some(metadata), &partial(path))
        .map_err(|e| bad(e.to_string()))?;
    commit(path)
}

/// Writes `value` as JSON indented by 4 spaces, as mlx-lm's `json.dump(…, indent=4)`.
pub fn write_json(path: &Path, value: &Value) -> Result<(), SaveError> {
    let mut text = Vec::new();
    let formatter = serde_json::ser::PrettyFormatter::with_indent(b"    ");
    let mut ser = serde_json::Serializer::with_formatter(&mut text, formatter);
    serde::Serialize::serialize(value, &mut ser).expect("a JSON value always serializes");
    std::fs::write(partial(path), text).map_err(io_error(path))?;
    commit(path)
}

/// Copies `from` to `to` by way of a temporary name.
pub fn copy_file(from: &Path, to: &Path) -> Result<(), SaveError> {
    std::fs::copy(from, partial(to)).map_err(io_error(from))?;
    commit(to)
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
}
