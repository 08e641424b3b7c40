//! Weight files written as the arrays are computed: every array's dtype and shape is known
//! before the first is converted, so each shard's header is written first and each array's
//! bytes go straight to their place in the file, a block of rows at a time. Nothing holds more
//! than one block of one array in memory, whatever the size of the model.

use std::collections::BTreeMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use oxlm_engine::DType;
use oxlm_models::save::safetensors_dtype;
use safetensors::tensor::{Metadata, TensorInfo};
use serde_json::{json, Map, Value};

use crate::ConvertError;

/// One array to be written.
#[derive(Debug, Clone)]
pub struct PlannedTensor {
    pub dtype: DType,
    pub shape: Vec<usize>,
}

impl PlannedTensor {
    pub fn len_bytes(&self) -> usize {
        self.shape.iter().product::<usize>() * self.dtype.size_in_bytes()
    }
}

struct Shard {
    path: PathBuf,
    file: File,
}

/// The weight files of a model being written, each already its full length.
pub struct Shards {
    shards: Vec<Shard>,
    /// Each array's shard and the file offset of its first byte.
    places: BTreeMap<String, (usize, u64)>,
    weight_map: Map<String, Value>,
    total_size: usize,
}

impl Shards {
    /// Lays `tensors` out in files of at most `max_shard_bytes` (an array larger than that gets
    /// a file of its own), in name order as mlx-lm fills them, named as mlx-lm names them.
    pub fn create(
        dir: &Path,
        tensors: &BTreeMap<String, PlannedTensor>,
        max_shard_bytes: usize,
    ) -> Result<Self, ConvertError> {
        let mut groups: Vec<Vec<&String>> = Vec::new();
        let mut group_bytes = 0;
        for (name, t) in tensors {
            if groups.is_empty() || group_bytes + t.len_bytes() > max_shard_bytes {
                groups.push(Vec::new());
                group_bytes = 0;
            }
            group_bytes += t.len_bytes();
            groups.last_mut().expect("pushed above").push(name);
        }
        let count = groups.len().max(1);
        let mut shards = Vec::new();
        let mut places = BTreeMap::new();
        let mut weight_map = Map::new();
        for (i, mut names) in groups.into_iter().enumerate() {
            let file_name = match count {
                1 => "model.safetensors".to_string(),
                _ => format!("model-{:05}-of-{count:05}.safetensors", i + 1),
            };
            let path = dir.join(&file_name);
            // safetensors' own order: by descending alignment of the dtype, then by name.
            names.sort_by(|a, b| {
                let (x, y) = (&tensors[*a], &tensors[*b]);
                safetensors_dtype(y.dtype)
                    .cmp(&safetensors_dtype(x.dtype))
                    .then(a.cmp(b))
            });
            let mut end = 0;
            let mut offsets = Vec::new();
            let infos = names
                .iter()
                .map(|&name| {
                    let t = &tensors[name];
                    let start = end;
                    end += t.len_bytes();
                    offsets.push((name.clone(), start));
                    let info = TensorInfo {
                        dtype: safetensors_dtype(t.dtype),
                        shape: t.shape.clone(),
                        data_offsets: (start, end),
                    };
                    (name.clone(), info)
                })
                .collect();
            let format = [("format".to_string(), "mlx".to_string())].into();
            let metadata = Metadata::new(Some(format), infos).map_err(|e| {
                ConvertError::Weights(format!("{}: cannot lay out: {e}", path.display()))
            })?;
            let mut header = serde_json::to_vec(&metadata).expect("a header serializes");
            // The data starts on a multiple of 8 bytes, padded with spaces.
            header.resize(header.len().next_multiple_of(8), b' ');
            let data_start = 8 + header.len() as u64;
            let io = |source| ConvertError::Io {
                path: path.clone(),
                source,
            };
            let file = File::create(&path).map_err(io)?;
            file.write_all_at(&(header.len() as u64).to_le_bytes(), 0)
                .map_err(io)?;
            file.write_all_at(&header, 8).map_err(io)?;
            file.set_len(data_start + end as u64).map_err(io)?;
            for (name, start) in offsets {
                places.insert(name.clone(), (i, data_start + start as u64));
                weight_map.insert(name, json!(file_name));
            }
            shards.push(Shard { path, file });
        }
        Ok(Shards {
            shards,
            places,
            weight_map,
            total_size: tensors.values().map(PlannedTensor::len_bytes).sum(),
        })
    }

    /// Writes `bytes` into array `name`, from byte `at` of the array.
    pub fn write(&self, name: &str, at: usize, bytes: &[u8]) -> Result<(), ConvertError> {
        let &(shard, start) = self
            .places
            .get(name)
            .unwrap_or_else(|| panic!("`{name}` was not planned"));
        let shard = &self.shards[shard];
        shard
            .file
            .write_all_at(bytes, start + at as u64)
            .map_err(|source| ConvertError::Io {
                path: shard.path.clone(),
                source,
            })
    }

    /// `model.safetensors.index.json`, as mlx-lm writes it.
    pub fn index(&self, total_parameters: usize) -> Value {
        let mut weight_map: Vec<(&String, &Value)> = self.weight_map.iter().collect();
        weight_map.sort_by(|a, b| a.0.cmp(b.0));
        let weight_map: Map<String, Value> = weight_map
            .into_iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        json!({
            "metadata": {"total_size": self.total_size, "total_parameters": total_parameters},
            "weight_map": weight_map,
        })
    }

    /// Flushes every file to the disk, so that the rename that publishes them follows their
    /// data; the files written.
    pub fn finish(self) -> Result<Vec<PathBuf>, ConvertError> {
        let mut paths = Vec::new();
        for shard in self.shards {
            shard.file.sync_all().map_err(|source| ConvertError::Io {
                path: shard.path.clone(),
                source,
            })?;
            paths.push(shard.path);
        }
        Ok(paths)
    }
}
