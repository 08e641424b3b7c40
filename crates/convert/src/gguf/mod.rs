//! llama.cpp's GGUF files: a header of typed key/value metadata and tensor descriptions, then
//! the tensors' data, each aligned to `general.alignment` (32 by default) bytes.
//!
//! The file is mapped, not read: [`GgufFile::tensor_data`] borrows a tensor's bytes in place.
//! Every count, length and offset in the header is checked against the file's size before it
//! is used, so that a truncated or corrupt file is an error naming the field, never a panic or
//! a huge allocation.

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use thiserror::Error;

pub mod config;
pub mod dequantize;
pub mod tensors;
pub mod tokenizer;

#[derive(Debug, Error)]
pub enum GgufError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: not a GGUF file: {reason}")]
    Malformed { path: PathBuf, reason: String },
    #[error("{path}: tensor `{name}` has type {ggml_type}, which oxlm cannot read")]
    UnsupportedType {
        path: PathBuf,
        name: String,
        ggml_type: u32,
    },
    #[error("{path}: metadata `{key}`: {reason}")]
    Metadata {
        path: PathBuf,
        key: String,
        reason: String,
    },
    /// Bytes handed to [`dequantize`](dequantize::dequantize) that do not fit the tensor.
    #[error("tensor `{name}`: {reason}")]
    TensorData { name: String, reason: String },
}

/// One metadata value, as the file types it.
#[derive(Debug, Clone, PartialEq)]
pub enum MetadataValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    String(String),
    Array(Vec<MetadataValue>),
}

impl MetadataValue {
    /// Any integer type, widened (negative values included).
    pub fn as_i64(&self) -> Option<i64> {
        Some(match *self {
            MetadataValue::U8(v) => v.into(),
            MetadataValue::I8(v) => v.into(),
            MetadataValue::U16(v) => v.into(),
            MetadataValue::I16(v) => v.into(),
            MetadataValue::U32(v) => v.into(),
            MetadataValue::I32(v) => v.into(),
            MetadataValue::U64(v) => i64::try_from(v).ok()?,
            MetadataValue::I64(v) => v,
            MetadataValue::Bool(v) => v.into(),
            _ => return None,
        })
    }

    /// Any number, as f64.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            MetadataValue::F32(v) => Some(v.into()),
            MetadataValue::F64(v) => Some(v),
            _ => self.as_i64().map(|v| v as f64),
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            MetadataValue::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[MetadataValue]> {
        match self {
            MetadataValue::Array(a) => Some(a),
            _ => None,
        }
    }
}

/// The tensor types of ggml that oxlm reads: plain floats and the block quantizations.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GgmlType {
    F32,
    F16,
    BF16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q2K,
    Q3K,
    Q4K,
    Q5K,
    Q6K,
}

impl GgmlType {
    fn from_id(id: u32) -> Option<Self> {
        Some(match id {
            0 => GgmlType::F32,
            1 => GgmlType::F16,
            2 => GgmlType::Q4_0,
            3 => GgmlType::Q4_1,
            6 => GgmlType::Q5_0,
            7 => GgmlType::Q5_1,
            8 => GgmlType::Q8_0,
            10 => GgmlType::Q2K,
            11 => GgmlType::Q3K,
            12 => GgmlType::Q4K,
            13 => GgmlType::Q5K,
            14 => GgmlType::Q6K,
            30 => GgmlType::BF16,
            _ => return None,
        })
    }

    /// Elements per block and bytes per block.
    pub fn block(self) -> (usize, usize) {
        match self {
            GgmlType::F32 => (1, 4),
            GgmlType::F16 | GgmlType::BF16 => (1, 2),
            GgmlType::Q4_0 => (32, 18),
            GgmlType::Q4_1 => (32, 20),
            GgmlType::Q5_0 => (32, 22),
            GgmlType::Q5_1 => (32, 24),
            GgmlType::Q8_0 => (32, 34),
            GgmlType::Q2K => (256, 84),
            GgmlType::Q3K => (256, 110),
            GgmlType::Q4K => (256, 144),
            GgmlType::Q5K => (256, 176),
            GgmlType::Q6K => (256, 210),
        }
    }

    /// The name llama.cpp prints.
    pub fn name(self) -> &'static str {
        match self {
            GgmlType::F32 => "F32",
            GgmlType::F16 => "F16",
            GgmlType::BF16 => "BF16",
            GgmlType::Q4_0 => "Q4_0",
            GgmlType::Q4_1 => "Q4_1",
            GgmlType::Q5_0 => "Q5_0",
            GgmlType::Q5_1 => "Q5_1",
            GgmlType::Q8_0 => "Q8_0",
            GgmlType::Q2K => "Q2_K",
            GgmlType::Q3K => "Q3_K",
            GgmlType::Q4K => "Q4_K",
            GgmlType::Q5K => "Q5_K",
            GgmlType::Q6K => "Q6_K",
        }
    }
}

/// One tensor's description.
#[derive(Debug, Clone)]
pub struct TensorInfo {
    pub name: String,
    /// The shape in row-major order (outermost first), as safetensors and MLX write it: the
    /// reverse of the file's ggml order, whose first dimension is the contiguous one.
    pub shape: Vec<usize>,
    pub ggml_type: GgmlType,
    /// Where its data starts, from the start of the file.
    offset: usize,
    len: usize,
}

impl TensorInfo {
    pub fn elements(&self) -> usize {
        self.shape.iter().product()
    }

    /// The length of a row (the innermost dimension).
    pub fn row_len(&self) -> usize {
        self.shape.last().copied().unwrap_or(1)
    }
}

/// A GGUF file, mapped.
pub struct GgufFile {
    path: PathBuf,
    pub version: u32,
    pub metadata: BTreeMap<String, MetadataValue>,
    pub tensors: Vec<TensorInfo>,
    map: Mmap,
}

const MAGIC: &[u8; 4] = b"GGUF";

impl GgufFile {
    pub fn open(path: &Path) -> Result<Self, GgufError> {
        let io = |source| GgufError::Io {
            path: path.to_path_buf(),
            source,
        };
        let file = File::open(path).map_err(io)?;
        // SAFETY: the mapping is read-only and private to this process; a file changed under it
        // while it is converted gives wrong tensors, not undefined behaviour in Rust terms that
        // any other reader of a mapped file avoids.
        let map = unsafe { Mmap::map(&file) }.map_err(io)?;
        let mut reader = Reader {
            bytes: &map,
            at: 0,
            path,
        };
        if reader.take(4, "the magic number")? != MAGIC {
            return Err(reader.malformed("it does not start with `GGUF`".into()));
        }
        let version = reader.u32("the version")?;
        if !(2..=3).contains(&version) {
            return Err(reader.malformed(format!("version {version} (oxlm reads 2 and 3)")));
        }
        let tensor_count = reader.count("the tensor count", 8)?;
        let kv_count = reader.count("the metadata count", 12)?;
        let mut metadata = BTreeMap::new();
        for _ in 0..kv_count {
            let key = reader.string("a metadata key")?;
            let kind = reader.u32(&key)?;
            let value = reader.value(kind, &key, 0)?;
            metadata.insert(key, value);
        }
        let alignment = match metadata.get("general.alignment") {
            None => 32,
            Some(v) => match v.as_i64() {
                Some(a) if a > 0 && (a as u64).is_power_of_two() => a as usize,
                _ => {
                    return Err(GgufError::Metadata {
                        path: path.to_path_buf(),
                        key: "general.alignment".into(),
                        reason: format!("{v:?} is not a power of two"),
                    })
                }
            },
        };
        let mut described = Vec::with_capacity(tensor_count);
        for _ in 0..tensor_count {
            let name = reader.string("a tensor name")?;
            let n_dims = reader.u32(&name)? as usize;
            if n_dims > 8 {
                return Err(reader.malformed(format!("tensor `{name}` has {n_dims} dimensions")));
            }
            let mut dims = Vec::with_capacity(n_dims);
            for _ in 0..n_dims {
                dims.push(reader.u64(&name)?);
            }
            let type_id = reader.u32(&name)?;
            let offset = reader.u64(&name)?;
            described.push((name, dims, type_id, offset));
        }
        let data_start = reader.at.next_multiple_of(alignment);
        let mut tensors = Vec::with_capacity(tensor_count);
        for (name, dims, type_id, offset) in described {
            let Some(ggml_type) = GgmlType::from_id(type_id) else {
                return Err(GgufError::UnsupportedType {
                    path: path.to_path_buf(),
                    name,
                    ggml_type: type_id,
                });
            };
            let shape: Vec<usize> = dims.iter().rev().map(|&d| d as usize).collect();
            let elements = dims
                .iter()
                .try_fold(1u64, |n, &d| n.checked_mul(d))
                .filter(|&n| n <= map.len() as u64 * 8);
            let (per_block, block_bytes) = ggml_type.block();
            let len = elements
                .filter(|_| dims.first().is_none_or(|&d| d % per_block as u64 == 0))
                .map(|n| n as usize / per_block * block_bytes);
            let start = (data_start as u64).checked_add(offset);
            let end = start.zip(len).and_then(|(s, l)| s.checked_add(l as u64));
            match (start, len, end) {
                (Some(start), Some(len), Some(end)) if end <= map.len() as u64 => {
                    tensors.push(TensorInfo {
                        name,
                        shape,
                        ggml_type,
                        offset: start as usize,
                        len,
                    })
                }
                (_, None, _) => {
                    return Err(reader.malformed(format!(
                        "tensor `{name}` of shape {shape:?} is not whole blocks of {per_block} {} elements",
                        ggml_type.name()
                    )))
                }
                _ => {
                    return Err(reader.malformed(format!(
                        "tensor `{name}` ends past the end of the file (truncated?)"
                    )))
                }
            }
        }
        Ok(GgufFile {
            path: path.to_path_buf(),
            version,
            metadata,
            tensors,
            map,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// The tensor's bytes in the file, as its type lays them out.
    pub fn tensor_data(&self, tensor: &TensorInfo) -> &[u8] {
        &self.map[tensor.offset..tensor.offset + tensor.len]
    }

    pub fn get(&self, key: &str) -> Option<&MetadataValue> {
        self.metadata.get(key)
    }

    /// `general.architecture` (`llama`, `qwen2`, `gemma3`, …).
    pub fn architecture(&self) -> Result<&str, GgufError> {
        self.get("general.architecture")
            .and_then(MetadataValue::as_str)
            .ok_or_else(|| self.metadata_error("general.architecture", "missing or not a string"))
    }

    /// An error about metadata `key`.
    pub fn metadata_error(&self, key: &str, reason: impl Into<String>) -> GgufError {
        GgufError::Metadata {
            path: self.path.clone(),
            key: key.to_string(),
            reason: reason.into(),
        }
    }
}

/// A cursor over the header, every read bounds-checked.
struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
    path: &'a Path,
}

impl<'a> Reader<'a> {
    fn malformed(&self, reason: String) -> GgufError {
        GgufError::Malformed {
            path: self.path.to_path_buf(),
            reason,
        }
    }

    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], GgufError> {
        match self
            .at
            .checked_add(n)
            .filter(|&end| end <= self.bytes.len())
        {
            Some(end) => {
                let taken = &self.bytes[self.at..end];
                self.at = end;
                Ok(taken)
            }
            None => Err(self.malformed(format!(
                "the file ends inside {what} (at byte {}; truncated?)",
                self.at
            ))),
        }
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N], GgufError> {
        Ok(self.take(N, what)?.try_into().expect("took N bytes"))
    }

    fn u32(&mut self, what: &str) -> Result<u32, GgufError> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &str) -> Result<u64, GgufError> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    /// A count of items of at least `min_item_bytes` each: more than the rest of the file holds
    /// is a corrupt header, caught before anything is allocated for them.
    fn count(&mut self, what: &str, min_item_bytes: usize) -> Result<usize, GgufError> {
        let n = self.u64(what)?;
        let room = (self.bytes.len() - self.at) / min_item_bytes.max(1);
        if n > room as u64 {
            return Err(self.malformed(format!(
                "{what} is {n}, more than the file could hold (corrupt?)"
            )));
        }
        Ok(n as usize)
    }

    fn string(&mut self, what: &str) -> Result<String, GgufError> {
        let len = self.count(what, 1)?;
        let bytes = self.take(len, what)?;
        String::from_utf8(bytes.to_vec())
            .map_err(|_| self.malformed(format!("{what} is not UTF-8")))
    }

    fn value(&mut self, kind: u32, key: &str, depth: usize) -> Result<MetadataValue, GgufError> {
        use MetadataValue as V;
        Ok(match kind {
            0 => V::U8(self.array::<1>(key)?[0]),
            1 => V::I8(self.array::<1>(key)?[0] as i8),
            2 => V::U16(u16::from_le_bytes(self.array(key)?)),
            3 => V::I16(i16::from_le_bytes(self.array(key)?)),
            4 => V::U32(self.u32(key)?),
            5 => V::I32(i32::from_le_bytes(self.array(key)?)),
            6 => V::F32(f32::from_le_bytes(self.array(key)?)),
            7 => V::Bool(self.array::<1>(key)?[0] != 0),
            8 => V::String(self.string(key)?),
            9 if depth < 4 => {
                let item_kind = self.u32(key)?;
                let n = self.count(key, 1)?;
                let mut items = Vec::with_capacity(n);
                for _ in 0..n {
                    items.push(self.value(item_kind, key, depth + 1)?);
                }
                V::Array(items)
            }
            10 => V::U64(self.u64(key)?),
            11 => V::I64(i64::from_le_bytes(self.array(key)?)),
            12 => V::F64(f64::from_le_bytes(self.array(key)?)),
            _ => {
                return Err(self.malformed(format!(
                    "metadata `{key}` has value type {kind}, which GGUF does not define"
                )))
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn string(out: &mut Vec<u8>, s: &str) {
        out.extend((s.len() as u64).to_le_bytes());
        out.extend(s.as_bytes());
    }

    /// A version-3 file with two metadata entries and one 2×32 Q8_0 tensor.
    fn tiny_file() -> Vec<u8> {
        let mut out = b"GGUF".to_vec();
        out.extend(3u32.to_le_bytes());
        out.extend(1u64.to_le_bytes());
        out.extend(2u64.to_le_bytes());
        string(&mut out, "general.architecture");
        out.extend(8u32.to_le_bytes());
        string(&mut out, "llama");
        string(&mut out, "llama.context_length");
        out.extend(9u32.to_le_bytes());
        out.extend(4u32.to_le_bytes());
        out.extend(2u64.to_le_bytes());
        out.extend(7u32.to_le_bytes());
        out.extend(9u32.to_le_bytes());
        string(&mut out, "w");
        out.extend(2u32.to_le_bytes());
        out.extend(32u64.to_le_bytes());
        out.extend(2u64.to_le_bytes());
        out.extend(8u32.to_le_bytes());
        out.extend(0u64.to_le_bytes());
        out.resize(out.len().next_multiple_of(32), 0);
        out.extend((0..68).map(|i| i as u8));
        out
    }

    fn open(bytes: &[u8]) -> Result<GgufFile, GgufError> {
        let file = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(file.path(), bytes).unwrap();
        GgufFile::open(file.path())
    }

    #[test]
    fn reads_metadata_and_tensor_descriptions() {
        let gguf = open(&tiny_file()).unwrap();
        assert_eq!(gguf.version, 3);
        assert_eq!(gguf.architecture().unwrap(), "llama");
        let lengths = gguf
            .get("llama.context_length")
            .unwrap()
            .as_array()
            .unwrap();
        assert_eq!(lengths, [MetadataValue::U32(7), MetadataValue::U32(9)]);
        let t = gguf.tensor("w").unwrap();
        assert_eq!(
            (t.shape.clone(), t.ggml_type),
            (vec![2, 32], GgmlType::Q8_0)
        );
        let data = gguf.tensor_data(t);
        assert_eq!((data.len(), data[0], data[67]), (68, 0, 67));
    }

    #[test]
    fn a_truncated_file_is_an_error_naming_what_is_missing() {
        let whole = tiny_file();
        let err = open(&whole[..whole.len() - 1]).err().unwrap().to_string();
        assert!(
            err.contains("tensor `w` ends past the end of the file"),
            "{err}"
        );
        let err = open(&whole[..60]).err().unwrap().to_string();
        assert!(err.contains("the file ends inside"), "{err}");
        let err = open(b"GGML").err().unwrap().to_string();
        assert!(err.contains("does not start with `GGUF`"), "{err}");
    }

    #[test]
    fn an_impossible_count_is_refused_before_allocating() {
        let mut bytes = tiny_file();
        bytes[16..24].copy_from_slice(&u64::MAX.to_le_bytes());
        let err = open(&bytes).err().unwrap().to_string();
        assert!(err.contains("more than the file could hold"), "{err}");
    }
}
