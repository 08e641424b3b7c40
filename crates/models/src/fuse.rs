//! `mlx_lm.fuse`: merges LoRA adapters into a copy of the base checkpoint. Each adapted layer is
//! dequantized, `scale · Bᵀ·Aᵀ` is added, and the sum is quantized again with the layer's own
//! mode, bits and group size; with `dequantize`, every quantized array of the model is written
//! dense instead. Arithmetic follows MLX step by step (in the weights' dtype, rounding where MLX
//! rounds) so that the written arrays match what mlx-lm writes.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use oxlm_engine::quant::{quantize, quantize_float, QuantMode};
use oxlm_engine::{DType, EngineError, FloatMatrix, QuantizedMatrix};
use serde_json::{json, Map, Value};
use thiserror::Error;

use crate::checkpoint::{read_json, Checkpoint, QuantSpec, RawTensor};
use crate::lora::{AdapterError, Adapters, LoraLinear};
use crate::save::{
    copy_file, float_bytes, round_to, sorted_keys, write_json, write_safetensors, SaveError,
    StagedDir, TensorBytes, COMPANION_FILES, MAX_SHARD_BYTES,
};
use crate::LoadError;

#[derive(Debug, Error)]
pub enum FuseError {
    #[error(transparent)]
    Adapter(#[from] AdapterError),
    #[error(transparent)]
    Load(#[from] LoadError),
    #[error(transparent)]
    Save(#[from] SaveError),
    #[error("weight `{name}`: {reason}")]
    Weight { name: String, reason: String },
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// What [`fuse`] wrote.
#[derive(Debug, Clone)]
pub struct FuseReport {
    pub fused_layers: usize,
    pub dequantized_layers: usize,
    pub weight_files: Vec<PathBuf>,
}

/// A quantized layer as read from the checkpoint: a matrix, or a mixture's stack of one per
/// expert, seen as one matrix of all their rows (quantization groups never cross a row).
struct Quantized {
    matrix: QuantizedMatrix,
    /// What `mx.dequantize` gives: the scales' dtype (affine), else bf16 (its default where no
    /// biases tell it).
    dtype: DType,
    /// The stored shape but its last axis: `[rows]`, or `[experts, rows]`.
    lead: Vec<usize>,
}

impl Quantized {
    fn take(ckpt: &mut Checkpoint, prefix: &str, spec: QuantSpec) -> Result<Self, FuseError> {
        let weight = ckpt.take(&format!("{prefix}.weight"))?;
        let scales = ckpt.take(&format!("{prefix}.scales"))?;
        let biases = match spec.mode {
            QuantMode::Affine => Some(ckpt.take(&format!("{prefix}.biases"))?),
            _ => None,
        };
        let bad = |e: EngineError| FuseError::Weight {
            name: format!("{prefix}.weight"),
            reason: e.to_string(),
        };
        let Some((&words, lead)) = weight.shape.split_last().filter(|(_, l)| !l.is_empty()) else {
            return Err(bad(EngineError::Shape(format!(
                "{:?} is not a matrix",
                weight.shape
            ))));
        };
        let (rows, cols) = (lead.iter().product(), words * 32 / spec.bits as usize);
        let (matrix, dtype) = match biases {
            Some(biases) => (
                QuantizedMatrix::new(
                    rows,
                    cols,
                    spec.bits,
                    spec.group_size,
                    weight.data,
                    scales.dtype,
                    scales.data,
                    biases.data,
                ),
                scales.dtype,
            ),
            None => (
                QuantizedMatrix::new_float(
                    spec.mode,
                    rows,
                    cols,
                    spec.bits,
                    spec.group_size,
                    weight.data,
                    scales.data,
                ),
                DType::BF16,
            ),
        };
        Ok(Quantized {
            matrix: matrix.map_err(bad)?,
            dtype,
            lead: lead.to_vec(),
        })
    }

    fn dequantize(&self) -> Vec<f32> {
        self.matrix.dequantize_as(self.dtype)
    }
}

/// `weight += scale · Bᵀ·Aᵀ` as `LoRALinear.fuse` does: the product in f32 (fused multiply-adds
/// over the rank, as a BLAS kernel runs it), rounded to `dtype`, then added in `dtype`.
fn merge(weight: &mut [f32], lora: &LoraLinear, dtype: DType) {
    let (cols, r) = (lora.in_features, lora.rank);
    for (o, row) in weight.chunks_exact_mut(cols).enumerate() {
        let b: Vec<f32> = (0..r)
            .map(|k| lora.scale * lora.b[k * lora.out_features + o])
            .collect();
        for (w, a) in row.iter_mut().zip(lora.a.chunks_exact(r)) {
            let delta = b
                .iter()
                .zip(a)
                .fold(0.0f32, |acc, (&bk, &ak)| bk.mul_add(ak, acc));
            *w = round_to(dtype, *w + round_to(dtype, delta));
        }
    }
}

fn owned(dtype: DType, shape: Vec<usize>, data: Vec<u8>) -> TensorBytes<'static> {
    TensorBytes {
        dtype,
        shape,
        data: Cow::Owned(data),
    }
}

fn raw(t: &RawTensor) -> TensorBytes<'_> {
    TensorBytes {
        dtype: t.dtype,
        shape: t.shape.clone(),
        data: Cow::Borrowed(t.data.as_slice()),
    }
}

/// `lead` (the shape but its last axis) with `last` appended.
fn shape_with(lead: &[usize], last: usize) -> Vec<usize> {
    let mut shape = lead.to_vec();
    shape.push(last);
    shape
}

/// Quantizes `values` (`lead` rows of `cols`) as `mx.quantize` does for weights of `dtype`: the
/// weight, scales and (affine only) biases.
fn requantize(
    prefix: &str,
    values: &[f32],
    lead: &[usize],
    cols: usize,
    spec: QuantSpec,
    dtype: DType,
) -> Vec<(String, TensorBytes<'static>)> {
    let rows = lead.iter().product();
    let words = cols * spec.bits as usize / 32;
    let groups = cols / spec.group_size;
    let weight = |packed: Vec<u32>| {
        let bytes = packed.iter().flat_map(|w| w.to_le_bytes()).collect();
        let t = owned(DType::U32, shape_with(lead, words), bytes);
        (format!("{prefix}.weight"), t)
    };
    let floats = |what: &str, v: &[f32]| {
        let t = owned(dtype, shape_with(lead, groups), float_bytes(dtype, v));
        (format!("{prefix}.{what}"), t)
    };
    if spec.mode == QuantMode::Affine {
        let (packed, scales, biases) = quantize(values, rows, cols, spec.bits, spec.group_size);
        return vec![
            weight(packed),
            floats("scales", &scales),
            floats("biases", &biases),
        ];
    }
    let (packed, scales) = quantize_float(spec.mode, values, rows, cols, dtype);
    let scales = owned(DType::U8, shape_with(lead, groups), scales);
    vec![weight(packed), (format!("{prefix}.scales"), scales)]
}

/// Each adapted layer's path and the adapters to merge into it: one, or one per expert of a
/// stack, in the order of the stack's rows.
fn layer_adapters(adapters: &Adapters) -> impl Iterator<Item = (&String, Vec<&LoraLinear>)> {
    let plain = adapters.layers.iter().map(|(p, l)| (p, vec![l]));
    plain.chain(
        adapters
            .experts
            .iter()
            .map(|(p, each)| (p, each.iter().collect())),
    )
}

/// Merges `loras` into `weight`, each into its block of rows (the experts of a stack in turn).
fn merge_all(weight: &mut [f32], loras: &[&LoraLinear], dtype: DType) {
    let per = weight.len() / loras.len().max(1);
    for (block, lora) in weight.chunks_exact_mut(per).zip(loras) {
        merge(block, lora, dtype);
    }
}

/// Merges the adapters in `adapter_dir` into the model in `model_dir` and writes the result to
/// `save_path` as an MLX model directory (weights, index, config, tokenizer files).
pub fn fuse(
    model_dir: &Path,
    adapter_dir: &Path,
    save_path: &Path,
    dequantize: bool,
) -> Result<FuseReport, FuseError> {
    let adapters = {
        let model = crate::load(model_dir)?;
        Adapters::load(adapter_dir, model.as_ref())?
    };
    let mut ckpt = Checkpoint::open(model_dir)?;
    // Fusing and dequantizing change no layer's shape, so the count is the base model's.
    let total_parameters = ckpt.parameter_count();
    let mut out: BTreeMap<String, TensorBytes> = BTreeMap::new();
    for (prefix, loras) in layer_adapters(&adapters) {
        let weight_name = format!("{prefix}.weight");
        match ckpt
            .quantization
            .for_module(prefix)
            .filter(|_| ckpt.contains(&format!("{prefix}.scales")))
        {
            Some(spec) => {
                let q = Quantized::take(&mut ckpt, prefix, spec)?;
                let (cols, dtype) = (q.matrix.cols, q.dtype);
                let mut w = q.dequantize();
                merge_all(&mut w, &loras, dtype);
                if dequantize {
                    let shape = shape_with(&q.lead, cols);
                    out.insert(weight_name, owned(dtype, shape, float_bytes(dtype, &w)));
                } else {
                    out.extend(requantize(prefix, &w, &q.lead, cols, spec, dtype));
                }
            }
            None => {
                let t = ckpt.take(&weight_name)?;
                let (rows, cols) = (loras.len() * loras[0].out_features, loras[0].in_features);
                let mut w = FloatMatrix::new(rows, cols, t.dtype, t.data)
                    .map_err(|e| FuseError::Weight {
                        name: weight_name.clone(),
                        reason: e.to_string(),
                    })?
                    .to_f32_vec();
                merge_all(&mut w, &loras, t.dtype);
                out.insert(
                    weight_name,
                    owned(t.dtype, t.shape, float_bytes(t.dtype, &w)),
                );
            }
        }
    }
    let mut dequantized_layers = 0;
    if dequantize {
        let quantized: Vec<String> = ckpt
            .names()
            .iter()
            .filter_map(|n| n.strip_suffix(".scales").map(str::to_string))
            .collect();
        for prefix in quantized {
            let spec = ckpt
                .quantization
                .for_module(&prefix)
                .ok_or_else(|| FuseError::Weight {
                    name: prefix.clone(),
                    reason: "quantized in the weights but config.json has no `quantization`".into(),
                })?;
            let q = Quantized::take(&mut ckpt, &prefix, spec)?;
            let w = q.dequantize();
            out.insert(
                format!("{prefix}.weight"),
                owned(
                    q.dtype,
                    shape_with(&q.lead, q.matrix.cols),
                    float_bytes(q.dtype, &w),
                ),
            );
            dequantized_layers += 1;
        }
    }
    let rest: Vec<(String, RawTensor)> = ckpt
        .names()
        .into_iter()
        .map(|n| ckpt.take(&n).map(|t| (n, t)))
        .collect::<Result<_, _>>()?;
    for (name, t) in &rest {
        out.insert(name.clone(), raw(t));
    }
    // Written whole beside `save_path`, then swapped in: an earlier output there stays whole
    // until the new one is.
    let staged = StagedDir::create(save_path)?;
    let dir = staged.path();
    let written = write_weights(dir, out, total_parameters)?;
    write_config(model_dir, dir, dequantize)?;
    for file in COMPANION_FILES {
        let from = model_dir.join(file);
        if from.exists() {
            copy_file(&from, &dir.join(file))?;
        }
    }
    staged.commit()?;
    let weight_files = (written.iter())
        .filter_map(|file| Some(save_path.join(file.file_name()?)))
        .collect();
    Ok(FuseReport {
        fused_layers: adapters.layers.len() + adapters.experts.len(),
        dequantized_layers,
        weight_files,
    })
}

/// Writes the arrays in shards of at most [`MAX_SHARD_BYTES`] and the index mlx-lm writes beside them.
fn write_weights(
    dir: &Path,
    tensors: BTreeMap<String, TensorBytes>,
    total_parameters: usize,
) -> Result<Vec<PathBuf>, FuseError> {
    let total_size: usize = tensors.values().map(|t| t.data.len()).sum();
    let mut shards: Vec<BTreeMap<String, TensorBytes>> = Vec::new();
    let mut shard_bytes = 0;
    for (name, t) in tensors {
        if shards.is_empty() || shard_bytes + t.data.len() > MAX_SHARD_BYTES {
            shards.push(BTreeMap::new());
            shard_bytes = 0;
        }
        shard_bytes += t.data.len();
        shards.last_mut().expect("pushed above").insert(name, t);
    }
    let count = shards.len();
    let mut weight_map = Map::new();
    let mut files = Vec::new();
    for (i, shard) in shards.iter().enumerate() {
        let file = if count > 1 {
            format!("model-{:05}-of-{count:05}.safetensors", i + 1)
        } else {
            "model.safetensors".to_string()
        };
        write_safetensors(&dir.join(&file), shard)?;
        for name in shard.keys() {
            weight_map.insert(name.clone(), json!(file));
        }
        files.push(dir.join(file));
    }
    let index = json!({
        "metadata": {"total_size": total_size, "total_parameters": total_parameters},
        "weight_map": sorted_keys(Value::Object(weight_map)),
    });
    write_json(&dir.join("model.safetensors.index.json"), &index)?;
    Ok(files)
}

/// config.json as `save_config` writes it: keys sorted, `quantization_config` mirroring
/// `quantization`, both dropped for a dequantized model.
fn write_config(model_dir: &Path, save_path: &Path, dequantize: bool) -> Result<(), FuseError> {
    let mut config = read_json(&model_dir.join("config.json"))?;
    if let Some(map) = config.as_object_mut() {
        map.remove("_name_or_path");
        map.remove("vision_config");
        if dequantize {
            map.remove("quantization");
            map.remove("quantization_config");
        } else if let Some(q) = map.get("quantization").cloned() {
            map.insert("quantization_config".into(), q);
        }
    }
    write_json(&save_path.join("config.json"), &sorted_keys(config))?;
    Ok(())
}
