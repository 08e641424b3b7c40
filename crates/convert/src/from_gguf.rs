//! A GGUF file to an MLX checkpoint: the config, tokenizer and chat template from its metadata,
//! and each tensor under its Hugging Face name with llama.cpp's changes undone.
//!
//! Q4_0, Q4_1 and Q8_0 weights are already affine codes in groups of 32, so they are kept as
//! they are, without loss (as `mx.load` reads them). Other block types (the K-quants, Q5_0, …)
//! are dequantized and quantized again at the requested bits (4 bits in groups of 64 by
//! default), and the error that adds is reported. Float weights stay dense unless `-q` is given.

use std::collections::BTreeMap;
use std::path::Path;

use half::f16;
use oxlm_engine::quant::QuantMode;
use oxlm_engine::DType;
use oxlm_models::checkpoint::QuantSpec;
use oxlm_models::save::{float_bytes, round_to, sorted_keys, write_json, StagedDir};
use serde_json::{json, Map, Value};

use crate::arrays::{quantize_rows, stored_matrix, Progress};
use crate::gguf::dequantize::{dequantize, to_mlx_affine, MLX_GROUP_SIZE};
use crate::gguf::tensors::{reorder_rows, HfTensor, TensorNames};
use crate::gguf::{config, tokenizer, GgmlType, GgufFile, TensorInfo};
use crate::quantize::QuantRequest;
use crate::write::{PlannedTensor, Shards};
use crate::{run_in_parallel, write_text, ConvertError, ConvertOptions, Report, MODEL_CARD};

/// Tensors llama.cpp adds that a Hugging Face checkpoint does not have: Llama 3's RoPE
/// frequency factors, which the config's `rope_scaling` gives.
const NOT_WEIGHTS: &[&str] = &["rope_freqs.weight"];

/// How much quantizing again cost: the relative RMS error over every weight requantized.
#[derive(Debug, Clone, Default)]
pub struct Requantized {
    pub tensors: usize,
    /// The GGUF block types that were requantized.
    pub types: Vec<&'static str>,
    pub relative_rms_error: f64,
}

enum Kind {
    /// Q4_0/Q4_1/Q8_0 kept as MLX affine codes.
    Lossless {
        bits: u32,
    },
    Quantize(QuantSpec),
    Dense(DType),
}

struct Planned<'a> {
    info: &'a TensorInfo,
    hf: HfTensor,
    kind: Kind,
}

fn lossless_bits(t: GgmlType) -> Option<u32> {
    match t {
        GgmlType::Q4_0 | GgmlType::Q4_1 => Some(4),
        GgmlType::Q8_0 => Some(8),
        _ => None,
    }
}

/// Converts `file` into an MLX checkpoint at `dst`.
pub fn convert_gguf(
    file: &Path,
    dst: &Path,
    options: &ConvertOptions,
    progress: &mut dyn FnMut(Progress),
) -> Result<(Report, Requantized), ConvertError> {
    if options.dequantize {
        return Err(ConvertError::Options(
            "-d applies to MLX models; a GGUF converts to a quantized MLX model".into(),
        ));
    }
    if dst.exists() && !options.force {
        return Err(ConvertError::Exists(dst.to_path_buf()));
    }
    let gguf = GgufFile::open(file)?;
    let mut config = config::hf_config(&gguf)?;
    let files = tokenizer::tokenizer_files(&gguf)?;
    let arch = gguf.architecture()?.to_string();
    let count = |key: &str| {
        let key = format!("{arch}.{key}");
        gguf.get(&key)
            .and_then(|v| v.as_i64())
            .map(|v| v as usize)
            .ok_or_else(|| gguf.metadata_error(&key, "missing or not an integer"))
    };
    let names = TensorNames::new(
        &arch,
        count("attention.head_count")?,
        count("attention.head_count_kv")?,
    )
    .map_err(|e| ConvertError::Source {
        path: file.to_path_buf(),
        reason: e.to_string(),
    })?;
    let dtype = options.dtype.unwrap_or(DType::F16);
    let request = options.quantize.unwrap_or(QuantRequest {
        bits: None,
        group_size: None,
        mode: QuantMode::Affine,
        recipe: None,
    });
    if request.recipe.is_some() {
        return Err(ConvertError::Options(
            "--quant-predicate recipes apply to Hugging Face models, not GGUF files".into(),
        ));
    }
    let (default_bits, default_group) = request.mode.float_format().unwrap_or((4, 64));
    let requested = QuantSpec {
        mode: request.mode,
        bits: request.bits.unwrap_or(default_bits),
        group_size: request.group_size.unwrap_or(default_group),
    };

    let mut planned = Vec::new();
    for info in &gguf.tensors {
        if NOT_WEIGHTS.contains(&info.name.as_str()) {
            continue;
        }
        let rows = info.shape.first().copied().unwrap_or(1);
        let hf = names
            .hf_tensor(&info.name, rows)
            .map_err(|e| ConvertError::Source {
                path: file.to_path_buf(),
                reason: e.to_string(),
            })?;
        let matrix = info.shape.len() == 2 && hf.name.ends_with(".weight");
        let cols = info.row_len();
        let is_float = matches!(
            info.ggml_type,
            GgmlType::F32 | GgmlType::F16 | GgmlType::BF16
        );
        let kind = match lossless_bits(info.ggml_type) {
            Some(bits) if matrix => Kind::Lossless { bits },
            _ if matrix
                && cols % requested.group_size == 0
                && (!is_float || options.quantize.is_some()) =>
            {
                Kind::Quantize(requested)
            }
            _ => Kind::Dense(dtype),
        };
        planned.push(Planned { info, hf, kind });
    }

    let mut outputs = BTreeMap::new();
    let mut specs: BTreeMap<String, QuantSpec> = BTreeMap::new();
    for p in &planned {
        let shape = p.info.shape.clone();
        let cols = p.info.row_len();
        let spec = match p.kind {
            Kind::Dense(dtype) => {
                outputs.insert(p.hf.name.clone(), PlannedTensor { dtype, shape });
                continue;
            }
            Kind::Lossless { bits } => QuantSpec {
                mode: QuantMode::Affine,
                bits,
                group_size: MLX_GROUP_SIZE,
            },
            Kind::Quantize(spec) => spec,
        };
        let prefix =
            p.hf.name
                .strip_suffix(".weight")
                .expect("a matrix's weight");
        let rows = shape[0];
        let words = cols * spec.bits as usize / 32;
        let groups = cols / spec.group_size;
        let scales_dtype = match (&p.kind, spec.mode) {
            (Kind::Lossless { .. }, _) => DType::F16,
            (_, QuantMode::Affine) => dtype,
            _ => DType::U8,
        };
        outputs.insert(
            format!("{prefix}.weight"),
            PlannedTensor {
                dtype: DType::U32,
                shape: vec![rows, words],
            },
        );
        let scales = PlannedTensor {
            dtype: scales_dtype,
            shape: vec![rows, groups],
        };
        if spec.mode == QuantMode::Affine {
            outputs.insert(format!("{prefix}.biases"), scales.clone());
        }
        outputs.insert(format!("{prefix}.scales"), scales);
        specs.insert(prefix.to_string(), spec);
    }

    let staged = StagedDir::create(dst)?;
    let shards = Shards::create(staged.path(), &outputs, options.max_shard_bytes)?;
    let total_bytes: usize = outputs.values().map(PlannedTensor::len_bytes).sum();
    let mut done = 0;
    let mut requantized = Requantized::default();
    let (mut error_sq, mut value_sq) = (0.0f64, 0.0f64);
    run_in_parallel(
        &planned,
        |p| write_tensor(&gguf, p, dtype, &shards),
        |written| {
            done += written.bytes;
            if let Some((type_name, errors, values)) = written.requantized {
                requantized.tensors += 1;
                if !requantized.types.contains(&type_name) {
                    requantized.types.push(type_name);
                }
                error_sq += errors;
                value_sq += values;
            }
            progress(Progress {
                done_bytes: done,
                total_bytes,
            });
        },
    )?;
    requantized.relative_rms_error = (error_sq / value_sq.max(f64::MIN_POSITIVE)).sqrt();

    let parameters: usize = outputs
        .iter()
        .map(|(name, t)| {
            let elements: usize = t.shape.iter().product();
            let (prefix, leaf) = name.rsplit_once('.').unwrap_or(("", name));
            match (leaf, specs.get(prefix)) {
                ("scales" | "biases", Some(_)) => 0,
                ("weight", Some(spec)) => elements * 32 / spec.bits as usize,
                _ => elements,
            }
        })
        .sum();
    let index = shards.index(parameters);
    let weight_files = shards.finish()?;
    write_json(&staged.path().join("model.safetensors.index.json"), &index)?;
    if let (Some(section), Some(map)) = (quantization_section(&specs), config.as_object_mut()) {
        map.insert("quantization".into(), section.clone());
        map.insert("quantization_config".into(), section);
    }
    if let Some(map) = config.as_object_mut() {
        map.insert("torch_dtype".into(), json!(dtype_name(dtype)));
    }
    write_json(&staged.path().join("config.json"), &sorted_keys(config))?;
    write_json(&staged.path().join("tokenizer.json"), &files.tokenizer_json)?;
    write_json(
        &staged.path().join("tokenizer_config.json"),
        &files.tokenizer_config,
    )?;
    write_json(
        &staged.path().join("generation_config.json"),
        &config::generation_config(&gguf)?,
    )?;
    write_text(&staged.path().join("README.md"), MODEL_CARD)?;
    staged.commit()?;
    let quantized = specs.len();
    Ok((
        Report {
            weight_files: weight_files
                .iter()
                .filter_map(|f| f.file_name().map(|n| dst.join(n)))
                .collect(),
            arrays: outputs.len(),
            quantized,
            bytes: total_bytes,
            bits_per_weight: total_bytes as f64 * 8.0 / parameters.max(1) as f64,
        },
        requantized,
    ))
}

/// What writing one tensor did: its bytes, and for a requantized one its GGUF type and its
/// squared error and squared values.
struct Written {
    bytes: usize,
    requantized: Option<(&'static str, f64, f64)>,
}

/// Converts and writes one tensor.
fn write_tensor(
    gguf: &GgufFile,
    p: &Planned,
    dtype: DType,
    shards: &Shards,
) -> Result<Written, ConvertError> {
    let mut requantized = None;
    let mut done = 0;
    let data = gguf.tensor_data(p.info);
    let reorder = |values: Vec<f32>| match &p.hf.row_order {
        Some(order) => reorder_rows(&values, order),
        None => values,
    };
    let prefix = p.hf.name.strip_suffix(".weight").unwrap_or(&p.hf.name);
    match p.kind {
        Kind::Dense(dtype) => {
            let mut values = reorder(dequantize(p.info, data)?);
            if p.hf.subtract_one {
                values.iter_mut().for_each(|v| *v -= 1.0);
            }
            let bytes = float_bytes(dtype, &values);
            shards.write(&p.hf.name, 0, &bytes)?;
            done += bytes.len();
        }
        Kind::Lossless { .. } => {
            let affine = to_mlx_affine(p.info, data)?.expect("a lossless type");
            let (packed, scales, biases) = match &p.hf.row_order {
                Some(order) => (
                    reorder_rows(&affine.packed, order),
                    reorder_rows(&affine.scales, order),
                    reorder_rows(&affine.biases, order),
                ),
                None => (affine.packed, affine.scales, affine.biases),
            };
            let half_bytes =
                |v: &[f16]| -> Vec<u8> { v.iter().flat_map(|x| x.to_le_bytes()).collect() };
            let packed: Vec<u8> = packed.iter().flat_map(|w| w.to_le_bytes()).collect();
            shards.write(&format!("{prefix}.weight"), 0, &packed)?;
            shards.write(&format!("{prefix}.scales"), 0, &half_bytes(&scales))?;
            shards.write(&format!("{prefix}.biases"), 0, &half_bytes(&biases))?;
            done += packed.len() + 4 * scales.len();
        }
        Kind::Quantize(spec) => {
            let mut values = reorder(dequantize(p.info, data)?);
            values.iter_mut().for_each(|v| *v = round_to(dtype, *v));
            let (rows, cols) = (p.info.shape[0], p.info.row_len());
            let (packed, scales, biases) = quantize_rows(&values, rows, cols, spec, dtype);
            shards.write(&format!("{prefix}.weight"), 0, &packed)?;
            shards.write(&format!("{prefix}.scales"), 0, &scales)?;
            if !biases.is_empty() {
                shards.write(&format!("{prefix}.biases"), 0, &biases)?;
            }
            done += packed.len() + scales.len() + biases.len();
            let matrix = stored_matrix(spec, rows, cols, packed, dtype, scales, biases)
                .map_err(|e| ConvertError::Weights(format!("`{prefix}`: {e}")))?;
            // The error quantizing added, a row at a time.
            let (mut errors, mut squares) = (0.0f64, 0.0f64);
            let mut row = vec![0.0; cols];
            for (r, original) in values.chunks_exact(cols).enumerate() {
                matrix.dequantize_row(r, &mut row);
                for (a, b) in row.iter().zip(original) {
                    errors += f64::from(a - b).powi(2);
                    squares += f64::from(*b).powi(2);
                }
            }
            requantized = Some((p.info.ggml_type.name(), errors, squares));
        }
    }
    Ok(Written {
        bytes: done,
        requantized,
    })
}

fn dtype_name(dtype: DType) -> &'static str {
    match dtype {
        DType::F16 => "float16",
        DType::BF16 => "bfloat16",
        _ => "float32",
    }
}

/// The `quantization` section: the most common spec as the default, every other module's own.
fn quantization_section(specs: &BTreeMap<String, QuantSpec>) -> Option<Value> {
    let mut counts: Vec<(QuantSpec, usize)> = Vec::new();
    for spec in specs.values() {
        match counts.iter_mut().find(|(s, _)| s == spec) {
            Some((_, n)) => *n += 1,
            None => counts.push((*spec, 1)),
        }
    }
    let default = counts.iter().max_by_key(|(_, n)| *n)?.0;
    let entry =
        |s: QuantSpec| json!({"group_size": s.group_size, "bits": s.bits, "mode": s.mode.name()});
    let mut section: Map<String, Value> = entry(default).as_object().expect("an object").clone();
    for (prefix, spec) in specs {
        if *spec != default {
            section.insert(prefix.clone(), entry(*spec));
        }
    }
    Some(Value::Object(section))
}
