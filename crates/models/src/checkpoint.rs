//! Reading an MLX model directory: `config.json`, the safetensors shards (memory-mapped), and
//! the quantization settings that say how each layer is stored.

use std::collections::{BTreeSet, HashMap};
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use oxlm_engine::quant::QuantMode;
use oxlm_engine::{Bytes, DType, Device, WeightBuffer};
use serde::de::DeserializeOwned;
use serde_json::{Map, Value};

use crate::LoadError;

/// Reads and parses a JSON file, naming the file in any error.
pub fn read_json(path: &Path) -> Result<Value, LoadError> {
    // A FIFO or a device would block the read, or never end it.
    if let Ok(meta) = std::fs::metadata(path) {
        if !meta.is_file() {
            return Err(LoadError::Io {
                path: path.to_path_buf(),
                source: std::io::Error::other("not a regular file"),
            });
        }
    }
    let text = std::fs::read_to_string(path).map_err(|source| match source.kind() {
        std::io::ErrorKind::NotFound => LoadError::MissingFile(path.to_path_buf()),
        _ => LoadError::Io {
            path: path.to_path_buf(),
            source,
        },
    })?;
    serde_json::from_str(&text).map_err(|source| LoadError::Json {
        path: path.to_path_buf(),
        source,
    })
}

/// `config.json`, with the keys of a nested `text_config` (multimodal wrappers) taking
/// precedence over the top level, as mlx-lm's text models read them.
#[derive(Debug, Clone)]
pub struct Config {
    top: Map<String, Value>,
    text: Map<String, Value>,
}

/// `value` with transformers' tags of non-finite floats (`{"__float__": "Infinity"}`, which
/// keep a config valid JSON) undone as mlx-lm's `load_config` undoes them: infinities become the
/// largest finite numbers (infinite again as f32), NaN becomes null.
fn untag_floats(value: Value) -> Value {
    match value {
        Value::Object(map) => {
            let tag = match map.get("__float__").and_then(Value::as_str) {
                Some(tag) if map.len() == 1 => tag,
                _ => {
                    let map = map.into_iter().map(|(k, v)| (k, untag_floats(v)));
                    return Value::Object(map.collect());
                }
            };
            match tag {
                "Infinity" => Value::from(f64::MAX),
                "-Infinity" => Value::from(f64::MIN),
                "NaN" => Value::Null,
                _ => Value::Object(map),
            }
        }
        Value::Array(items) => Value::Array(items.into_iter().map(untag_floats).collect()),
        other => other,
    }
}

impl Config {
    pub fn from_value(value: Value) -> Result<Self, LoadError> {
        let Value::Object(top) = untag_floats(value) else {
            return Err(LoadError::Config(
                "the top level is not a JSON object".into(),
            ));
        };
        let mut text = top.clone();
        if let Some(Value::Object(nested)) = top.get("text_config") {
            text.extend(nested.clone());
        }
        Ok(Config { top, text })
    }

    /// The architecture name mlx-lm dispatches on (the top-level `model_type`).
    pub fn model_type(&self) -> Result<&str, LoadError> {
        self.top
            .get("model_type")
            .and_then(Value::as_str)
            .ok_or_else(|| LoadError::Config("`model_type` is missing".into()))
    }

    /// The raw value of `key` at the top level, not overridden by `text_config` (a multimodal
    /// wrapper's own settings).
    pub fn top_level(&self, key: &str) -> Option<&Value> {
        self.top.get(key).filter(|v| !v.is_null())
    }

    /// Whether the text model's `key` is present and `null`: mlx-lm then passes `None`, which
    /// overrides a non-`None` default (e.g. turns a feature off).
    pub fn is_null(&self, key: &str) -> bool {
        self.text.get(key).is_some_and(Value::is_null)
    }

    /// The text model's settings as an architecture's typed config `T`: keys that are absent or
    /// null take `T`'s defaults, keys `T` does not name are ignored, and a value of the wrong
    /// type is an error naming the key.
    pub fn args<T: DeserializeOwned>(&self) -> Result<T, LoadError> {
        let present: Map<String, Value> = self
            .text
            .iter()
            .filter(|(_, v)| !v.is_null())
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        serde_path_to_error::deserialize(Value::Object(present)).map_err(|e| {
            // A missing key is named by the error itself, at the top.
            match e.path().to_string().as_str() {
                "." => LoadError::Config(e.inner().to_string()),
                key => LoadError::Config(format!("`{key}`: {}", e.inner())),
            }
        })
    }
}

/// How one layer's weights are quantized.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QuantSpec {
    pub mode: QuantMode,
    pub bits: u32,
    pub group_size: usize,
}

/// The `quantization` (or `quantization_config`) section: a default and per-module overrides,
/// e.g. `{"group_size": 32, "bits": 4, "model.embed_tokens": {"group_size": 32, "bits": 8}}`,
/// each with an optional `mode` (`affine` when absent), which overrides may mix: `{"group_size":
/// 32, "bits": 4, "mode": "mxfp4", "model.embed_tokens": {..., "mode": "affine"}}`.
#[derive(Debug, Clone, Default)]
pub struct Quantization {
    default: Option<QuantSpec>,
    overrides: HashMap<String, QuantSpec>,
}

fn parse_spec(where_: &str, v: &Map<String, Value>) -> Result<QuantSpec, LoadError> {
    let mode = match v.get("mode").filter(|m| !m.is_null()) {
        None => QuantMode::Affine,
        Some(m) => m.as_str().and_then(QuantMode::from_name).ok_or_else(|| {
            let supported: Vec<&str> = QuantMode::ALL.iter().map(|m| m.name()).collect();
            LoadError::UnsupportedQuantization(format!(
                "mode {m} in {where_} (supported: {})",
                supported.join(", ")
            ))
        })?,
    };
    // An nvfp4 tensor scale (mlx-lm's `global_scale` on switch layers) is a further array that
    // the layers do not read.
    if v.get("global_scale")
        .is_some_and(|g| g != &Value::Bool(false))
    {
        return Err(LoadError::UnsupportedQuantization(format!(
            "`global_scale` in {where_}"
        )));
    }
    // Even a spec no layer reads must be sane: `Checkpoint::parameter_count` divides by its bits.
    // Absent or null, as `mlx_lm convert --quant-predicate` writes it, is the mode's default, as
    // `to_quantized` takes it.
    let (default_bits, default_group_size) = mode.float_format().unwrap_or((4, 64));
    let field = |key: &str, default: u64| match v.get(key) {
        None | Some(Value::Null) => Some(default),
        Some(value) => value.as_u64(),
    };
    let bits = field("bits", default_bits.into()).filter(|b| (1..=32).contains(b));
    let group_size = field("group_size", default_group_size as u64).filter(|&g| g > 0);
    let (bits, group_size) = match (bits, group_size) {
        (Some(bits), Some(group_size)) => (bits as u32, group_size as usize),
        _ => {
            return Err(LoadError::Config(format!(
                "{where_} needs integer `bits` from 1 to 32 and a positive integer `group_size`"
            )))
        }
    };
    match mode.float_format() {
        Some((b, g)) if (bits, group_size) != (b, g) => {
            Err(LoadError::UnsupportedQuantization(format!(
                "{mode} with {bits} bits and group size {group_size} in {where_} ({mode} takes \
                 {b} bits and group size {g})"
            )))
        }
        _ => Ok(QuantSpec {
            mode,
            bits,
            group_size,
        }),
    }
}

impl Quantization {
    pub fn from_config(config: &Config) -> Result<Self, LoadError> {
        let section = config
            .top
            .get("quantization")
            .or_else(|| config.top.get("quantization_config"));
        let Some(section) = section.filter(|v| !v.is_null()) else {
            return Ok(Quantization::default());
        };
        let Value::Object(map) = section else {
            return Err(LoadError::Config("`quantization` is not an object".into()));
        };
        let mut quant = Quantization {
            default: Some(parse_spec("`quantization`", map)?),
            overrides: HashMap::new(),
        };
        for (key, value) in map {
            if let Value::Object(m) = value {
                quant.overrides.insert(
                    key.clone(),
                    parse_spec(&format!("`quantization.{key}`"), m)?,
                );
            }
        }
        Ok(quant)
    }

    /// The settings for the module at `path` (e.g. `model.layers.0.self_attn.q_proj`).
    pub fn for_module(&self, path: &str) -> Option<QuantSpec> {
        self.overrides.get(path).copied().or(self.default)
    }
}

/// One array of a checkpoint, still in the file's bytes.
#[derive(Debug, Clone)]
pub struct RawTensor {
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub data: Bytes,
}

impl RawTensor {
    pub fn describe(&self) -> String {
        format!("{:?} {}", self.shape, self.dtype)
    }
}

struct MappedFile(memmap2::Mmap);

impl AsRef<[u8]> for MappedFile {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

/// The engine's name of a safetensors element type; `None` for types no MLX file holds.
pub fn engine_dtype(dtype: safetensors::Dtype) -> Option<DType> {
    use safetensors::Dtype as S;
    Some(match dtype {
        S::F32 => DType::F32,
        S::F16 => DType::F16,
        S::BF16 => DType::BF16,
        S::U32 => DType::U32,
        S::I32 => DType::I32,
        S::U8 => DType::U8,
        S::I8 => DType::I8,
        S::BOOL => DType::Bool,
        S::I64 => DType::I64,
        S::U64 => DType::U64,
        S::F64 => DType::F64,
        S::U16 => DType::U16,
        S::I16 => DType::I16,
        _ => return None,
    })
}

/// How a checkpoint's files come into memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Residency {
    /// Memory-mapped: read on first use, shared with the page cache. For weights read once
    /// (copied to a GPU, fused, or only looked at).
    Mapped,
    /// Read whole into a [`WeightBuffer`] (huge pages) with the data section 8-byte aligned, so
    /// that every array whose offset is a multiple of its element size is viewed in place: for
    /// the CPU kernels, which stream the weights every token.
    Resident,
}

/// Opens one safetensors file and lists its arrays, which view the file's bytes in memory.
pub fn open_safetensors(
    path: &Path,
    residency: Residency,
) -> Result<HashMap<String, RawTensor>, LoadError> {
    let io = |source: std::io::Error| LoadError::Io {
        path: path.to_path_buf(),
        source,
    };
    let mut file = std::fs::File::open(path).map_err(|source| match source.kind() {
        std::io::ErrorKind::NotFound => LoadError::MissingFile(path.to_path_buf()),
        _ => io(source),
    })?;
    let file_bytes = match residency {
        // SAFETY: the map is read-only; a checkpoint changed under a running model is outside
        // what any engine can defend against, as with every mmap-based loader.
        Residency::Mapped => Bytes::from_owner(Arc::new(MappedFile(
            unsafe { memmap2::Mmap::map(&file) }.map_err(io)?,
        ))),
        Residency::Resident => read_aligned(&mut file).map_err(io)?,
    };
    let bad = |reason: String| LoadError::Safetensors {
        path: path.to_path_buf(),
        reason,
    };
    let parsed = safetensors::SafeTensors::deserialize(file_bytes.as_slice())
        .map_err(|e| bad(format!("{e:?}")))?;
    let base = file_bytes.as_slice().as_ptr() as usize;
    let mut out = HashMap::new();
    for (name, view) in parsed.tensors() {
        let dtype = engine_dtype(view.dtype())
            .ok_or_else(|| bad(format!("`{name}` has unsupported dtype {:?}", view.dtype())))?;
        let start = view.data().as_ptr() as usize - base;
        let data = file_bytes
            .slice(start, view.data().len())
            .ok_or_else(|| bad(format!("`{name}` lies outside the file")))?;
        out.insert(
            name,
            RawTensor {
                dtype,
                shape: view.shape().to_vec(),
                data,
            },
        );
    }
    Ok(out)
}

/// The whole of a safetensors file in a [`WeightBuffer`], placed so that its data section (after
/// the 8-byte length and the JSON header, whose length `mlx_lm convert` leaves at any value)
/// starts on a multiple of 8.
fn read_aligned(file: &mut std::fs::File) -> std::io::Result<Bytes> {
    use std::io::{Read, Seek, SeekFrom};
    let len = usize::try_from(file.metadata()?.len()).map_err(std::io::Error::other)?;
    let mut header_len = [0u8; 8];
    // A file too short for the length is read as it is; parsing it reports the fault.
    let shift = match file.read_exact(&mut header_len) {
        Ok(()) => ((8 - u64::from_le_bytes(header_len) % 8) % 8) as usize,
        Err(_) => 0,
    };
    file.seek(SeekFrom::Start(0))?;
    let mut buffer = WeightBuffer::new(shift + len)?;
    file.read_exact(&mut buffer.as_mut_slice()[shift..])?;
    Ok(buffer
        .freeze()?
        .slice(shift, len)
        .expect("the buffer holds the file"))
}

/// The safetensors files of a model directory: those named by `model.safetensors.index.json`
/// when it exists, else every `model*.safetensors`.
fn weight_files(dir: &Path) -> Result<Vec<PathBuf>, LoadError> {
    let index = dir.join("model.safetensors.index.json");
    if index.exists() {
        let value = read_json(&index)?;
        let map = value
            .get("weight_map")
            .and_then(Value::as_object)
            .ok_or_else(|| LoadError::Json {
                path: index.clone(),
                source: serde::de::Error::custom("no `weight_map` object"),
            })?;
        let files: BTreeSet<&str> = map.values().filter_map(Value::as_str).collect();
        return Ok(files.into_iter().map(|f| dir.join(f)).collect());
    }
    let mut files = Vec::new();
    let entries = std::fs::read_dir(dir).map_err(|source| LoadError::Io {
        path: dir.to_path_buf(),
        source,
    })?;
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.starts_with("model") && name.ends_with(".safetensors") {
            files.push(entry.path());
        }
    }
    if files.is_empty() {
        return Err(LoadError::MissingFile(dir.join("model.safetensors")));
    }
    files.sort();
    Ok(files)
}

/// The tensors of one module of a checkpoint: a view under its path (`model.layers.3`), so that
/// a module's `load` names only its own tensors (`weight`) and hands each child module the view
/// under the child's name ([`Scope::pp`]), as the module tree names them. Taking still takes from
/// the checkpoint, so what no module takes is an error at [`Checkpoint::finish`].
pub struct Scope<'a> {
    ckpt: &'a mut Checkpoint,
    path: String,
}

impl Scope<'_> {
    /// The view of child module `name` (`self_attn`, `layers.3`).
    pub fn pp(&mut self, name: impl std::fmt::Display) -> Scope<'_> {
        let path = self.path_of(&name.to_string());
        Scope {
            ckpt: self.ckpt,
            path,
        }
    }

    /// Where this module is (`model.layers.3.self_attn`; empty at the root).
    pub fn path(&self) -> &str {
        &self.path
    }

    /// The full name of this module's tensor or child `name`.
    pub fn path_of(&self, name: &str) -> String {
        match self.path.as_str() {
            "" => name.to_string(),
            path => format!("{path}.{name}"),
        }
    }

    /// Takes this module's tensor `name` out of the checkpoint.
    pub fn take(&mut self, name: &str) -> Result<RawTensor, LoadError> {
        self.ckpt.take(&self.path_of(name))
    }

    pub fn contains(&self, name: &str) -> bool {
        self.ckpt.contains(&self.path_of(name))
    }

    /// This module's tensor `name`, left in the checkpoint.
    pub fn peek(&self, name: &str) -> Option<&RawTensor> {
        self.ckpt.peek(&self.path_of(name))
    }

    /// Drops every tensor of child module `name`: weights the checkpoint has and the model
    /// does not use, as mlx-lm's `sanitize` drops them.
    pub fn discard(&mut self, name: &str) {
        let under = format!("{}.", self.path_of(name));
        self.ckpt.discard_where(|n| n.starts_with(&under));
    }

    /// How this module's weights are quantized, if the config says.
    pub fn quantization(&self) -> Option<QuantSpec> {
        self.ckpt.quantization.for_module(&self.path)
    }

    /// Where the layers place the weights they take.
    pub fn device(&self) -> &Device {
        &self.ckpt.device
    }
}

/// An opened model directory. Layers take their weights out of it by name; what is left at the
/// end is reported by [`Checkpoint::finish`], so a config that does not match the weights fails.
pub struct Checkpoint {
    pub dir: PathBuf,
    pub config: Config,
    pub quantization: Quantization,
    /// Where the layers place the weights they take.
    pub device: Device,
    tensors: HashMap<String, RawTensor>,
}

impl Checkpoint {
    /// Opens `dir` with its weights memory-mapped, for the CPU.
    pub fn open(dir: &Path) -> Result<Self, LoadError> {
        Self::open_with(dir, Residency::Mapped, Device::Cpu)
    }

    /// Opens `dir` for layers that place their weights on `device`: on the CPU the files are
    /// read into huge pages, which the kernels stream every token; a GPU copies them from a
    /// memory map once.
    pub fn open_on(dir: &Path, device: &Device) -> Result<Self, LoadError> {
        let residency = match device {
            Device::Cpu => Residency::Resident,
            _ => Residency::Mapped,
        };
        Self::open_with(dir, residency, device.clone())
    }

    fn open_with(dir: &Path, residency: Residency, device: Device) -> Result<Self, LoadError> {
        if !dir.is_dir() {
            return Err(LoadError::MissingFile(dir.to_path_buf()));
        }
        let config = Config::from_value(read_json(&dir.join("config.json"))?)?;
        let quantization = Quantization::from_config(&config)?;
        let mut tensors = HashMap::new();
        for file in weight_files(dir)? {
            tensors.extend(open_safetensors(&file, residency)?);
        }
        Ok(Checkpoint {
            dir: dir.to_path_buf(),
            config,
            quantization,
            device,
            tensors,
        })
    }

    /// The names of the arrays not taken yet, sorted.
    pub fn names(&self) -> Vec<String> {
        let mut names: Vec<String> = self.tensors.keys().cloned().collect();
        names.sort();
        names
    }

    /// Parameters of the arrays not taken yet, as mlx-lm's `get_total_parameters` counts them: a
    /// quantized layer its unpacked weights (not its scales and biases), any other array its
    /// elements.
    pub fn parameter_count(&self) -> usize {
        let quantized = |prefix: &str| self.contains(&format!("{prefix}.scales"));
        self.tensors
            .iter()
            .map(|(name, t)| {
                let size: usize = t.shape.iter().product();
                let (prefix, leaf) = name.rsplit_once('.').unwrap_or(("", name));
                match (leaf, self.quantization.for_module(prefix)) {
                    ("scales" | "biases", Some(_)) if quantized(prefix) => 0,
                    ("weight", Some(spec)) if quantized(prefix) => size * 32 / spec.bits as usize,
                    _ => size,
                }
            })
            .sum()
    }

    /// Refuses sizes in the config that no weight could hold, as each sizes what an
    /// architecture allocates before it reads the first weight (2^40 layers, or a RoPE table
    /// for 2^30 dimensions, would abort the process rather than fail): a `num_hidden_layers`
    /// larger than the count of the checkpoint's tensors (every layer has weights), and a head
    /// size larger than any dimension of any weight (a head is a slice of a projection's rows).
    pub fn check_sizes(&self) -> Result<(), LoadError> {
        let text = &self.config.text;
        let layers = text.get("num_hidden_layers").and_then(Value::as_u64);
        if let Some(n) = layers.filter(|&n| n > self.tensors.len() as u64) {
            return Err(LoadError::Config(format!(
                "`num_hidden_layers` is {n}, but the weights hold {} tensors in all",
                self.tensors.len()
            )));
        }
        let largest = self.largest_dimension() as u64;
        for key in ["head_dim", "global_head_dim"] {
            let size = text.get(key).and_then(Value::as_u64);
            if let Some(n) = size.filter(|&n| n > largest) {
                return Err(LoadError::Config(format!(
                    "`{key}` is {n}, but no weight has a dimension that large (the largest is \
                     {largest})"
                )));
            }
        }
        Ok(())
    }

    /// The largest dimension of any weight, counting a quantized layer's unpacked values.
    fn largest_dimension(&self) -> usize {
        let quantized = |prefix: &str| self.contains(&format!("{prefix}.scales"));
        let dims = self.tensors.iter().map(|(name, t)| {
            let (prefix, leaf) = name.rsplit_once('.').unwrap_or(("", name));
            let largest = t.shape.iter().copied().max().unwrap_or(0);
            match (leaf, self.quantization.for_module(prefix)) {
                ("weight", Some(spec)) if quantized(prefix) => {
                    let values = t.shape.last().map_or(0, |w| w * 32 / spec.bits as usize);
                    largest.max(values)
                }
                _ => largest,
            }
        });
        dims.max().unwrap_or(0)
    }

    /// The view of the module at `path` (`""` for the whole checkpoint).
    pub fn scope(&mut self, path: &str) -> Scope<'_> {
        Scope {
            ckpt: self,
            path: path.to_string(),
        }
    }

    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    /// The array `name`, left in place (to look at its shape or dtype before loading).
    pub fn peek(&self, name: &str) -> Option<&RawTensor> {
        self.tensors.get(name)
    }

    /// Removes and returns the array `name`.
    pub fn take(&mut self, name: &str) -> Result<RawTensor, LoadError> {
        self.tensors
            .remove(name)
            .ok_or_else(|| LoadError::MissingTensor(name.to_string()))
    }

    /// Renames each array for which `rename` gives a new name (a model's `sanitize`: checkpoints
    /// exported elsewhere name the same weights differently), and each module that a
    /// quantization override names the same way.
    pub fn rename(&mut self, rename: impl Fn(&str) -> Option<String>) {
        let renamed: Vec<(String, String)> = self
            .tensors
            .keys()
            .filter_map(|name| rename(name).map(|new| (name.clone(), new)))
            .collect();
        for (old, new) in renamed {
            if let Some(t) = self.tensors.remove(&old) {
                self.tensors.insert(new, t);
            }
        }
        // A module is renamed as its weight would be.
        let module_rename = |module: &str| {
            let weight = rename(&format!("{module}.weight"))?;
            weight.strip_suffix(".weight").map(str::to_string)
        };
        let overrides = std::mem::take(&mut self.quantization.overrides);
        self.quantization.overrides = overrides
            .into_iter()
            .map(|(module, spec)| (module_rename(&module).unwrap_or(module), spec))
            .collect();
    }

    /// Splits the fused layer `module` (`…self_attn.qkv_proj`) into the layers `parts` name, of
    /// the given output rows each, in order (see [`Checkpoint::regroup_rows`]).
    pub fn split_rows(&mut self, module: &str, parts: &[(String, usize)]) -> Result<(), LoadError> {
        let mut start = 0;
        let parts: Vec<(String, Vec<Range<usize>>)> = parts
            .iter()
            .map(|(name, rows)| {
                start += rows;
                (name.clone(), std::iter::once(start - rows..start).collect())
            })
            .collect();
        self.regroup_rows(module, start, &parts)
    }

    /// Builds the layers `parts` name from the fused layer `module` of `total` output rows, each
    /// from its runs of the fused rows, in order: the `weight`, quantization `scales`/`biases`
    /// and `bias` are cut along their first axis (a quantization group never spans two rows;
    /// a part of one run stays a view of the file), and a per-module quantization override
    /// follows the parts. Nothing happens where the checkpoint has no such layer; rows that do
    /// not add up are an error.
    pub fn regroup_rows(
        &mut self,
        module: &str,
        total: usize,
        parts: &[(String, Vec<Range<usize>>)],
    ) -> Result<(), LoadError> {
        for leaf in ["weight", "scales", "biases", "bias"] {
            let name = format!("{module}.{leaf}");
            let Some(t) = self.tensors.remove(&name) else {
                continue;
            };
            let inside = parts
                .iter()
                .flat_map(|(_, runs)| runs)
                .all(|r| r.end <= total);
            if t.shape.first() != Some(&total) || !inside {
                return Err(LoadError::TensorShape {
                    found: t.shape.clone(),
                    dtype: t.dtype.to_string(),
                    expected: format!("{total} rows, regrouped into {parts:?}"),
                    name,
                });
            }
            let row_bytes = t.data.len() / total.max(1);
            let rows = |r: &Range<usize>| {
                t.data
                    .slice(r.start * row_bytes, r.len() * row_bytes)
                    .ok_or_else(|| LoadError::Config(format!("`{name}` is shorter than its shape")))
            };
            for (part, runs) in parts {
                let data = match runs.as_slice() {
                    [run] => rows(run)?,
                    _ => {
                        let mut joined = Vec::with_capacity(
                            runs.iter().map(|r| r.len()).sum::<usize>() * row_bytes,
                        );
                        for run in runs {
                            joined.extend_from_slice(rows(run)?.as_slice());
                        }
                        Bytes::copy_from(&joined)
                    }
                };
                let mut shape = t.shape.clone();
                shape[0] = runs.iter().map(|r| r.len()).sum();
                let piece = RawTensor {
                    dtype: t.dtype,
                    shape,
                    data,
                };
                self.tensors.insert(format!("{part}.{leaf}"), piece);
            }
        }
        if let Some(spec) = self.quantization.overrides.get(module).copied() {
            for (part, _) in parts {
                self.quantization.overrides.insert(part.clone(), spec);
            }
        }
        Ok(())
    }

    /// Drops arrays the models never read (e.g. precomputed rotary frequencies).
    pub fn discard_where(&mut self, unused: impl Fn(&str) -> bool) {
        self.tensors.retain(|name, _| !unused(name));
    }

    /// Fails if any array was not taken by the model.
    pub fn finish(self) -> Result<(), LoadError> {
        if self.tensors.is_empty() {
            return Ok(());
        }
        let mut names: Vec<String> = self.tensors.into_keys().collect();
        names.sort();
        Err(LoadError::UnusedTensors(names))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, serde::Deserialize)]
    struct Args {
        hidden_size: usize,
        #[serde(default = "default_theta")]
        rope_theta: f32,
    }

    fn default_theta() -> f32 {
        10000.0
    }

    fn args(json: Value) -> Result<Args, LoadError> {
        Config::from_value(json)?.args()
    }

    #[test]
    fn typed_args_take_defaults_ignore_unknown_keys_and_name_a_bad_key() {
        let a = args(serde_json::json!({"hidden_size": 64, "rope_theta": null, "other": [1]}));
        assert_eq!(a.unwrap().rope_theta, 10000.0);
        let nested = serde_json::json!({"hidden_size": 8, "text_config": {"hidden_size": 64}});
        assert_eq!(args(nested).unwrap().hidden_size, 64);
        let err = args(serde_json::json!({"hidden_size": 64, "rope_theta": "high"})).unwrap_err();
        assert_eq!(
            err.to_string(),
            "config.json: `rope_theta`: invalid type: string \"high\", expected f32"
        );
        let err = args(serde_json::json!({"rope_theta": 1.0})).unwrap_err();
        assert_eq!(err.to_string(), "config.json: missing field `hidden_size`");
    }

    #[test]
    fn tagged_non_finite_floats_read_as_mlx_lm_reads_them() {
        #[derive(serde::Deserialize)]
        struct Limits {
            time_step_limit: (f32, f32),
            floor: Option<f32>,
        }
        let tagged = |tag: &str| serde_json::json!({ "__float__": tag });
        let config = serde_json::json!({
            "time_step_limit": [tagged("-Infinity"), tagged("Infinity")],
            "floor": tagged("NaN"),
            "text_config": {"other": {"__float__": "Infinity", "note": 1}},
        });
        let config = Config::from_value(config).unwrap();
        let limits: Limits = config.args().unwrap();
        assert_eq!(limits.time_step_limit, (f32::NEG_INFINITY, f32::INFINITY));
        assert_eq!(limits.floor, None);
        // Only a lone tag is one.
        assert_eq!(config.top_level("text_config").unwrap()["other"]["note"], 1);
    }

    #[test]
    fn quantization_specs_need_positive_bits_and_group_sizes() {
        // An override for weights the model drops (a tied model's `lm_head`) is checked too.
        for spec in [
            serde_json::json!({"bits": 0, "group_size": 64}),
            serde_json::json!({"bits": 4, "group_size": 0}),
            serde_json::json!({"bits": 1u64 << 32, "group_size": 64}),
        ] {
            let config = serde_json::json!({"quantization":
                {"bits": 4, "group_size": 64, "lm_head": spec.clone()}});
            let quantization = Quantization::from_config(&Config::from_value(config).unwrap());
            assert!(quantization.is_err(), "{spec}");
        }
    }

    #[test]
    fn quantization_modes_mix_per_module_as_mlx_lm_writes_them() {
        let config = serde_json::json!({"quantization": {
            "group_size": 32, "bits": 4, "mode": "mxfp4",
            "model.embed_tokens": {"group_size": 32, "bits": 8, "mode": "affine"},
            "model.layers.0.self_attn.o_proj": {"group_size": 16, "bits": 4, "mode": "nvfp4"},
            "model.layers.0.mlp.down_proj": {"group_size": 32, "bits": 8, "mode": "mxfp8"},
            "lm_head": {"group_size": 64, "bits": 6},
        }});
        let q = Quantization::from_config(&Config::from_value(config).unwrap()).unwrap();
        let spec = |mode, bits, group_size| {
            Some(QuantSpec {
                mode,
                bits,
                group_size,
            })
        };
        let mode_of = |path: &str| q.for_module(path);
        assert_eq!(
            mode_of("model.layers.1.mlp.up_proj"),
            spec(QuantMode::Mxfp4, 4, 32)
        );
        assert_eq!(
            mode_of("model.embed_tokens"),
            spec(QuantMode::Affine, 8, 32)
        );
        assert_eq!(
            mode_of("model.layers.0.self_attn.o_proj"),
            spec(QuantMode::Nvfp4, 4, 16)
        );
        assert_eq!(
            mode_of("model.layers.0.mlp.down_proj"),
            spec(QuantMode::Mxfp8, 8, 32)
        );
        // No `mode`: affine, as mlx-lm reads it.
        assert_eq!(mode_of("lm_head"), spec(QuantMode::Affine, 6, 64));
    }

    #[test]
    fn unknown_or_misshapen_quantization_modes_are_refused_clearly() {
        let err = |quantization: Value| {
            let config = serde_json::json!({ "quantization": quantization });
            Quantization::from_config(&Config::from_value(config).unwrap())
                .unwrap_err()
                .to_string()
        };
        let unknown = err(serde_json::json!({"group_size": 32, "bits": 4, "mode": "int4"}));
        assert!(
            unknown.contains("\"int4\"")
                && unknown.contains("supported: affine, mxfp4, nvfp4, mxfp8"),
            "{unknown}"
        );
        let override_ = err(serde_json::json!({"group_size": 64, "bits": 4,
            "lm_head": {"group_size": 32, "bits": 4, "mode": "fp4"}}));
        assert!(override_.contains("`quantization.lm_head`"), "{override_}");
        let misshapen = err(serde_json::json!({"group_size": 32, "bits": 4, "mode": "nvfp4"}));
        assert!(
            misshapen.contains("nvfp4 takes 4 bits and group size 16"),
            "{misshapen}"
        );
        let scaled = err(
            serde_json::json!({"group_size": 16, "bits": 4, "mode": "nvfp4",
            "switch_mlp": {"group_size": 16, "bits": 4, "mode": "nvfp4", "global_scale": true}}),
        );
        assert!(scaled.contains("global_scale"), "{scaled}");
    }

    /// A safetensors file of one u32 array whose data starts at file offset 8 + 18 (2 mod 8),
    /// as `mlx_lm convert` leaves many.
    fn misaligned_file(dir: &Path) -> PathBuf {
        let mut header = br#"{"w":{"dtype":"U32","shape":[4],"data_offsets":[0,16]}}"#.to_vec();
        while header.len() % 8 != 2 {
            header.push(b' ');
        }
        let mut file = (header.len() as u64).to_le_bytes().to_vec();
        file.extend_from_slice(&header);
        for v in [7u32, 1 << 31, 0, 12345] {
            file.extend_from_slice(&v.to_le_bytes());
        }
        let path = dir.join("model.safetensors");
        std::fs::write(&path, file).unwrap();
        path
    }

    #[test]
    fn resident_files_place_the_data_section_on_a_multiple_of_8() {
        let dir = tempfile::tempdir().unwrap();
        let path = misaligned_file(dir.path());
        let mapped = open_safetensors(&path, Residency::Mapped).unwrap();
        let resident = open_safetensors(&path, Residency::Resident).unwrap();
        let address = |t: &HashMap<String, RawTensor>| t["w"].data.as_slice().as_ptr() as usize;
        // The map keeps the file's offsets: a u32 view would need a copy there.
        assert_eq!(address(&mapped) % 4, 2);
        assert_eq!(address(&resident) % 8, 0);
        assert_eq!(resident["w"].data.view::<u32>(), &[7, 1 << 31, 0, 12345]);
        assert_eq!(resident["w"].data.as_slice(), mapped["w"].data.as_slice());
        assert_eq!(resident["w"].shape, vec![4]);
    }
}
