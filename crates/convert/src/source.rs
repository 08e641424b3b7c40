//! The tensors of a safetensors checkpoint, read on demand: only the headers are read when the
//! directory is opened, and each tensor's rows are read from its file when they are converted,
//! so that a checkpoint larger than memory converts in a bounded footprint.

use std::collections::BTreeMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use half::{bf16, f16};
use oxlm_engine::DType;
use serde_json::Value;

use crate::ConvertError;

/// One tensor of a source file.
#[derive(Debug, Clone)]
pub struct SourceTensor {
    file: Arc<File>,
    path: Arc<PathBuf>,
    pub dtype: DType,
    pub shape: Vec<usize>,
    /// Where the data starts in the file.
    offset: u64,
}

impl SourceTensor {
    pub fn elements(&self) -> usize {
        self.shape.iter().product()
    }

    pub fn len_bytes(&self) -> usize {
        self.elements() * self.dtype.size_in_bytes()
    }

    /// The tensor's rows `rows` (over its last axis), as stored.
    pub fn read_rows(&self, rows: std::ops::Range<usize>) -> Result<Vec<u8>, ConvertError> {
        let row_bytes = self.shape.last().copied().unwrap_or(1) * self.dtype.size_in_bytes();
        self.read_bytes(rows.start * row_bytes..rows.end * row_bytes)
    }

    /// The bytes `bytes` of the tensor's data, as stored.
    pub fn read_bytes(&self, bytes: std::ops::Range<usize>) -> Result<Vec<u8>, ConvertError> {
        let mut out = vec![0; bytes.len()];
        let at = self.offset + bytes.start as u64;
        self.file
            .read_exact_at(&mut out, at)
            .map_err(|source| ConvertError::Io {
                path: self.path.to_path_buf(),
                source,
            })?;
        Ok(out)
    }

    /// The whole tensor, as stored.
    pub fn read(&self) -> Result<Vec<u8>, ConvertError> {
        self.read_rows(0..self.rows())
    }

    /// How many rows of the last axis it has (1 for a scalar).
    pub fn rows(&self) -> usize {
        let cols = self.shape.last().copied().unwrap_or(1).max(1);
        self.elements() / cols
    }
}

/// Floats of `dtype` as f32, exactly.
pub fn to_f32(dtype: DType, bytes: &[u8]) -> Vec<f32> {
    match dtype {
        DType::F32 => bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().expect("4 bytes")))
            .collect(),
        DType::F16 => bytes
            .chunks_exact(2)
            .map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        DType::BF16 => bytes
            .chunks_exact(2)
            .map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        other => unreachable!("{other:?} is not a float type"),
    }
}

/// A checkpoint directory: its config and the tensors of every `*.safetensors` file.
pub struct SafetensorsDir {
    pub dir: PathBuf,
    pub config: Value,
    pub tensors: BTreeMap<String, SourceTensor>,
}

impl SafetensorsDir {
    pub fn open(dir: &Path) -> Result<Self, ConvertError> {
        let config = read_json(&dir.join("config.json"))?;
        let mut tensors = BTreeMap::new();
        for path in weight_files(dir)? {
            for (name, tensor) in read_header(&path)? {
                if tensors.insert(name.clone(), tensor).is_some() {
                    return Err(ConvertError::Source {
                        path: path.clone(),
                        reason: format!("tensor `{name}` is also in another file"),
                    });
                }
            }
        }
        Ok(SafetensorsDir {
            dir: dir.to_path_buf(),
            config,
            tensors,
        })
    }
}

pub fn read_json(path: &Path) -> Result<Value, ConvertError> {
    let text = std::fs::read_to_string(path).map_err(|source| match source.kind() {
        std::io::ErrorKind::NotFound => ConvertError::Source {
            path: path.to_path_buf(),
            reason: "no such file (is this a model directory?)".into(),
        },
        _ => ConvertError::Io {
            path: path.to_path_buf(),
            source,
        },
    })?;
    serde_json::from_str(&text).map_err(|e| ConvertError::Source {
        path: path.to_path_buf(),
        reason: format!("malformed JSON: {e}"),
    })
}

/// The directory's weight files: every `*.safetensors` but the ones that are not weights
/// (`adapters.safetensors`, an oxlm golden), sorted so that shards come in order.
fn weight_files(dir: &Path) -> Result<Vec<PathBuf>, ConvertError> {
    let entries = std::fs::read_dir(dir).map_err(|source| ConvertError::Io {
        path: dir.to_path_buf(),
        source,
    })?;
    let mut files: Vec<PathBuf> = entries
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            let name = p.file_name().unwrap_or_default().to_string_lossy();
            name.ends_with(".safetensors")
                && (name.starts_with("model") || name == "weights.safetensors")
        })
        .collect();
    if files.is_empty() {
        return Err(ConvertError::Source {
            path: dir.to_path_buf(),
            reason: "no model*.safetensors files".into(),
        });
    }
    files.sort();
    Ok(files)
}

fn dtype_of(name: &str) -> Option<DType> {
    Some(match name {
        "F32" => DType::F32,
        "F16" => DType::F16,
        "BF16" => DType::BF16,
        "U32" => DType::U32,
        "I32" => DType::I32,
        "U8" => DType::U8,
        "I8" => DType::I8,
        "BOOL" => DType::Bool,
        "I64" => DType::I64,
        "U64" => DType::U64,
        "F64" => DType::F64,
        "U16" => DType::U16,
        "I16" => DType::I16,
        _ => return None,
    })
}

/// A safetensors file's header: each tensor's dtype, shape and place, checked against the
/// file's length.
fn read_header(path: &Path) -> Result<Vec<(String, SourceTensor)>, ConvertError> {
    let io = |source| ConvertError::Io {
        path: path.to_path_buf(),
        source,
    };
    let bad = |reason: String| ConvertError::Source {
        path: path.to_path_buf(),
        reason,
    };
    let file = File::open(path).map_err(io)?;
    let file_len = file.metadata().map_err(io)?.len();
    let mut len = [0u8; 8];
    file.read_exact_at(&mut len, 0)
        .map_err(|_| bad("shorter than a safetensors header (truncated?)".into()))?;
    let header_len = u64::from_le_bytes(len);
    if header_len > 100 << 20 || 8 + header_len > file_len {
        return Err(bad(format!(
            "a header of {header_len} bytes does not fit the file (truncated or not safetensors?)"
        )));
    }
    let mut header = vec![0u8; header_len as usize];
    file.read_exact_at(&mut header, 8).map_err(io)?;
    let header: BTreeMap<String, Value> =
        serde_json::from_slice(&header).map_err(|e| bad(format!("malformed header: {e}")))?;
    let data_start = 8 + header_len;
    let (file, shared_path) = (Arc::new(file), Arc::new(path.to_path_buf()));
    let mut tensors = Vec::new();
    for (name, info) in header {
        if name == "__metadata__" {
            continue;
        }
        let dtype_name = info["dtype"].as_str().unwrap_or_default();
        let dtype = dtype_of(dtype_name)
            .ok_or_else(|| bad(format!("`{name}` has unsupported dtype {dtype_name:?}")))?;
        let shape: Option<Vec<usize>> = info["shape"].as_array().and_then(|dims| {
            dims.iter()
                .map(|d| d.as_u64().map(|d| d as usize))
                .collect()
        });
        let offsets = info["data_offsets"]
            .as_array()
            .filter(|o| o.len() == 2)
            .and_then(|o| Some((o[0].as_u64()?, o[1].as_u64()?)));
        let (Some(shape), Some((start, end))) = (shape, offsets) else {
            return Err(bad(format!(
                "`{name}` has a malformed shape or data_offsets"
            )));
        };
        let expected = shape
            .iter()
            .try_fold(dtype.size_in_bytes() as u64, |n, &d| {
                n.checked_mul(d as u64)
            });
        if expected != Some(end.wrapping_sub(start)) || start > end {
            return Err(bad(format!(
                "`{name}`: shape {shape:?} of {dtype_name} does not match its {} bytes",
                end.wrapping_sub(start)
            )));
        }
        if data_start + end > file_len {
            return Err(bad(format!(
                "`{name}` ends past the end of the file (truncated?)"
            )));
        }
        tensors.push((
            name,
            SourceTensor {
                file: file.clone(),
                path: shared_path.clone(),
                dtype,
                shape,
                offset: data_start + start,
            },
        ));
    }
    Ok(tensors)
}
