//! `oxlm convert`: checkpoints in other layouts to MLX format, as `mlx_lm.convert` writes it.
//!
//! - [`source`] reads a safetensors checkpoint's headers, then its arrays a block of rows at a
//!   time;
//! - [`sanitize`] renames a Hugging Face checkpoint's arrays as mlx-lm's models do on load;
//! - [`quantize`] decides which arrays `-q` quantizes, and how;
//! - [`write`] writes the shards as the arrays are computed;
//! - [`gguf`] reads llama.cpp's GGUF files, and [`from_gguf`] converts one.
//!
//! The output is staged in a temporary directory beside the destination and renamed into place
//! when complete, so that an interrupted conversion never leaves a directory that loads.

pub mod arrays;
pub mod from_gguf;
pub mod gguf;
pub mod quantize;
pub mod sanitize;
pub mod source;
pub mod write;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use oxlm_engine::DType;
use oxlm_models::checkpoint::{Config, QuantSpec, Quantization};
use oxlm_models::save::{
    copy_file, sorted_keys, write_json, SaveError, StagedDir, COMPANION_FILES, MAX_SHARD_BYTES,
};
use oxlm_models::LoadError;
use serde_json::{json, Value};
use thiserror::Error;

use crate::arrays::{Job, Progress};
use crate::quantize::{QuantPlan, QuantRequest};
use crate::sanitize::Origin;
use crate::source::{read_json, SafetensorsDir};
use crate::write::{PlannedTensor, Shards};

#[derive(Debug, Error)]
pub enum ConvertError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: {reason}")]
    Source { path: PathBuf, reason: String },
    #[error("oxlm convert does not know model_type `{found}`; it converts: {}", .supported.join(", "))]
    UnsupportedModelType {
        found: String,
        supported: &'static [&'static str],
    },
    #[error("{0}")]
    Weights(String),
    #[error("{0}")]
    Options(String),
    #[error("{0} already exists: choose another --mlx-path, or pass --force to replace it")]
    Exists(PathBuf),
    #[error(transparent)]
    Gguf(#[from] gguf::GgufError),
    #[error(transparent)]
    Load(#[from] LoadError),
    #[error(transparent)]
    Save(#[from] SaveError),
}

/// `mlx_lm.convert`'s options.
#[derive(Debug, Clone)]
pub struct ConvertOptions {
    /// `-q`: quantize as asked.
    pub quantize: Option<QuantRequest>,
    /// `--dtype`: the float type of what is not quantized; by default the config's
    /// `torch_dtype`, else each array's own.
    pub dtype: Option<DType>,
    /// `-d`: write a quantized checkpoint's weights dense.
    pub dequantize: bool,
    /// Replace an existing destination.
    pub force: bool,
    /// The largest weight file (mlx-lm's 5 GiB unless a test asks for less).
    pub max_shard_bytes: usize,
}

impl Default for ConvertOptions {
    fn default() -> Self {
        ConvertOptions {
            quantize: None,
            dtype: None,
            dequantize: false,
            force: false,
            max_shard_bytes: MAX_SHARD_BYTES,
        }
    }
}

/// What a conversion wrote.
#[derive(Debug)]
pub struct Report {
    pub weight_files: Vec<PathBuf>,
    pub arrays: usize,
    pub quantized: usize,
    pub bytes: usize,
    /// Bits per weight over the quantized and dense weights, as mlx-lm prints it.
    pub bits_per_weight: f64,
}

/// The model card mlx-lm writes beside a converted model.
pub(crate) const MODEL_CARD: &str =
    "---\nlanguage: en\nlibrary_name: mlx\npipeline_tag: text-generation\ntags:\n- mlx\n---\n";

/// Converts the safetensors checkpoint in `src` (Hugging Face or MLX layout) into an MLX
/// checkpoint at `dst`, reporting progress in bytes of weights written.
pub fn convert(
    src: &Path,
    dst: &Path,
    options: &ConvertOptions,
    progress: &mut dyn FnMut(Progress),
) -> Result<Report, ConvertError> {
    if options.quantize.is_some() && options.dequantize {
        return Err(ConvertError::Options(
            "choose either quantize (-q) or dequantize (-d), not both".into(),
        ));
    }
    if dst.exists() && !options.force {
        return Err(ConvertError::Exists(dst.to_path_buf()));
    }
    let source = SafetensorsDir::open(src)?;
    let mut config = source.config.clone();
    merge_generation_eos(src, &mut config)?;
    model_args_edits(&mut config);
    legacy_quantization(&mut config);
    let source_quantization = Quantization::from_config(&Config::from_value(config.clone())?)?;
    let shapes = source
        .tensors
        .iter()
        .map(|(name, t)| (name.clone(), t.shape.clone()))
        .collect();
    let origins = sanitize::sanitize(&config, &shapes)?;
    let quantized_source = |prefix: &str| origins.contains_key(&format!("{prefix}.scales"));
    let dtype = options.dtype.or_else(|| config_dtype(&config));
    let model_type = config["model_type"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let text_config = config.get("text_config").unwrap_or(&config);
    let layers = text_config["num_hidden_layers"].as_u64().unwrap_or(0) as usize;
    let module_paths: Vec<&str> = origins
        .keys()
        .filter_map(|n| n.strip_suffix(".weight"))
        .collect();
    // Qwen3.5's quant_predicate is its MoE variant's when it has experts, else none.
    let predicate_type = match model_type.as_str() {
        "qwen3_5" if text_config["num_experts"].as_u64().unwrap_or(0) > 0 => "qwen3_5_moe",
        other => other,
    };
    let plan = options
        .quantize
        .map(|request| QuantPlan::new(request, predicate_type, &module_paths, layers))
        .transpose()?;

    // Every output array, planned before any is computed.
    let mut jobs = Vec::new();
    // A model quantized already keeps its section; each module -q quantizes now gets its own
    // entry (mlx-lm's "fine-grained" config).
    let already_quantized = config.get("quantization").and_then(Value::as_object);
    let fine_grained = already_quantized.is_some();
    let mut section = plan.as_ref().map(|plan| match already_quantized {
        Some(section) => section.clone(),
        None => plan.default_section(),
    });
    for (name, origin) in &origins {
        let shape = arrays::shape_of(origin, &source)?;
        let prefix = name.strip_suffix(".weight");
        if let Some(prefix) = prefix.filter(|p| quantized_source(p)) {
            let spec = source_quantization.for_module(prefix).ok_or_else(|| {
                ConvertError::Weights(format!(
                    "`{prefix}` is quantized but the config has no quantization for it"
                ))
            })?;
            if options.dequantize {
                jobs.push(Job::Dequantize {
                    prefix: prefix.to_string(),
                    origins: quantized_origins(&origins, prefix),
                    spec,
                    dtype,
                });
                continue;
            }
        }
        let dequantized_part = name
            .rsplit_once('.')
            .is_some_and(|(p, leaf)| matches!(leaf, "scales" | "biases") && quantized_source(p));
        if dequantized_part && options.dequantize {
            continue;
        }
        let float_weight = !prefix.is_some_and(quantized_source);
        let choice = plan
            .as_ref()
            .filter(|_| float_weight)
            .and_then(|p| p.choose(name, &shape));
        match choice {
            Some(choice) => {
                let prefix = prefix.expect("only weights are quantized");
                let entry = match (choice.config_entry, fine_grained) {
                    (Some(entry), _) => Some(entry),
                    (None, true) => Some(json!({
                        "group_size": choice.spec.group_size,
                        "bits": choice.spec.bits,
                        "mode": choice.spec.mode.name(),
                    })),
                    (None, false) => None,
                };
                if let (Some(section), Some(entry)) = (section.as_mut(), entry) {
                    section.insert(prefix.to_string(), entry);
                }
                jobs.push(Job::Quantize {
                    prefix: prefix.to_string(),
                    origin: origin.clone(),
                    spec: choice.spec,
                    dtype,
                });
            }
            None => jobs.push(Job::Dense {
                name: name.clone(),
                origin: origin.clone(),
                dtype: dtype.filter(|_| casts(&model_type, name)),
            }),
        }
    }

    let quantizes = jobs.iter().any(|j| matches!(j, Job::Quantize { .. }));
    if options.quantize.is_some() && fine_grained && !quantizes {
        return Err(ConvertError::Options(format!(
            "{} is already quantized: convert it with -d first, or start from the unquantized model",
            src.display()
        )));
    }
    let mut planned = BTreeMap::new();
    for job in &jobs {
        planned.extend(job.outputs(&source)?);
    }
    let total_parameters = parameter_count(&planned, &jobs, &source_quantization);
    let staged = StagedDir::create(dst)?;
    let shards = Shards::create(staged.path(), &planned, options.max_shard_bytes)?;
    let total_bytes: usize = planned.values().map(PlannedTensor::len_bytes).sum();
    let mut done = 0;
    run_in_parallel(
        &jobs,
        |job| job.run(&source, &shards),
        |bytes| {
            done += bytes;
            progress(Progress {
                done_bytes: done,
                total_bytes,
            })
        },
    )?;
    let index = shards.index(total_parameters);
    let weight_files = shards.finish()?;
    write_json(&staged.path().join("model.safetensors.index.json"), &index)?;

    if let Some(map) = config.as_object_mut() {
        map.remove("_name_or_path");
        map.remove("vision_config");
        if options.dequantize {
            map.remove("quantization");
            map.remove("quantization_config");
        }
        if let Some(section) = section {
            map.insert("quantization".into(), Value::Object(section.clone()));
            map.insert("quantization_config".into(), Value::Object(section));
        }
    }
    write_json(&staged.path().join("config.json"), &sorted_keys(config))?;
    copy_companion_files(src, staged.path())?;
    staged.commit()?;

    let quantized = jobs
        .iter()
        .filter(|j| matches!(j, Job::Quantize { .. }))
        .count();
    Ok(Report {
        weight_files: weight_files
            .iter()
            .filter_map(|f| f.file_name().map(|n| dst.join(n)))
            .collect(),
        arrays: planned.len(),
        quantized,
        bytes: total_bytes,
        bits_per_weight: bits_per_weight(&planned, total_parameters),
    })
}

/// Runs `work` on every item on one thread per core (each item writes its own arrays), calling
/// `progress` on this thread with the sum of what they returned so far; the first error stops
/// the items not yet started and is returned.
pub(crate) fn run_in_parallel<T: Sync, R: Send>(
    items: &[T],
    work: impl Fn(&T) -> Result<R, ConvertError> + Sync,
    mut progress: impl FnMut(&R),
) -> Result<(), ConvertError> {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let (next, failed) = (AtomicUsize::new(0), AtomicBool::new(false));
    let (sender, results) = std::sync::mpsc::channel();
    std::thread::scope(|scope| {
        for _ in 0..threads.min(items.len()) {
            let sender = sender.clone();
            let (next, failed, work) = (&next, &failed, &work);
            scope.spawn(move || {
                while !failed.load(Ordering::Relaxed) {
                    let Some(item) = items.get(next.fetch_add(1, Ordering::Relaxed)) else {
                        break;
                    };
                    let result = work(item);
                    failed.fetch_or(result.is_err(), Ordering::Relaxed);
                    if sender.send(result).is_err() {
                        break;
                    }
                }
            });
        }
        drop(sender);
        let mut first_error = None;
        for result in results {
            match result {
                Ok(r) => progress(&r),
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        }
        first_error.map_or(Ok(()), Err)
    })
}

/// mlx-lm reads `eos_token_id` from `generation_config.json` over config.json's.
fn merge_generation_eos(src: &Path, config: &mut Value) -> Result<(), ConvertError> {
    let path = src.join("generation_config.json");
    if !path.exists() {
        return Ok(());
    }
    // A malformed generation_config.json is skipped, as mlx-lm skips it.
    let Ok(generation) = read_json(&path) else {
        return Ok(());
    };
    let eos = generation.get("eos_token_id").cloned();
    // Python's truthiness: no id, 0 and an empty list leave config.json's.
    let set = eos.filter(|e| match e {
        Value::Array(ids) => !ids.is_empty(),
        Value::Number(n) => n.as_f64() != Some(0.0),
        Value::Null | Value::Bool(false) => false,
        _ => true,
    });
    if let (Some(eos), Some(map)) = (set, config.as_object_mut()) {
        map.insert("eos_token_id".into(), eos);
    }
    Ok(())
}

/// What mlx-lm's model arguments change in the config dict they are built from (and that
/// convert then saves): the multimodal Gemmas' text_config gets the top-level vocabulary size
/// and head-count defaults, Qwen3.5's `rope_parameters.rope_type` becomes `type`.
fn model_args_edits(config: &mut Value) {
    let model_type = config["model_type"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    match model_type.as_str() {
        "gemma3" | "gemma4" => {
            let (vocab, kv_heads) = match model_type.as_str() {
                "gemma3" => (262208, 4),
                _ => (262144, 1),
            };
            let vocab = config.get("vocab_size").cloned().unwrap_or(vocab.into());
            let Some(text) = config.get_mut("text_config").and_then(Value::as_object_mut) else {
                return;
            };
            text.insert("vocab_size".into(), vocab);
            text.entry("num_attention_heads").or_insert(8.into());
            text.entry("num_key_value_heads").or_insert(kv_heads.into());
        }
        "qwen3_5" | "qwen3_5_moe" => {
            let text = match config.get("text_config").is_some() {
                true => &mut config["text_config"],
                false => config,
            };
            let Some(rope) = text
                .get_mut("rope_parameters")
                .and_then(Value::as_object_mut)
            else {
                return;
            };
            if !rope.is_empty() && !rope.contains_key("type") {
                if let Some(kind) = rope.remove("rope_type") {
                    rope.insert("type".into(), kind);
                }
            }
        }
        _ => {}
    }
}

/// mlx-lm's reading of a Hugging Face `quantization_config` it knows: OpenAI's MXFP4 (gpt-oss's
/// experts) becomes a `quantization` section, which replaces `quantization_config` too.
fn legacy_quantization(config: &mut Value) {
    if config.get("quantization").is_some() {
        return;
    }
    if config["quantization_config"]["quant_method"].as_str() == Some("mxfp4") {
        let section = json!({"group_size": 32, "bits": 4, "mode": "mxfp4"});
        if let Some(map) = config.as_object_mut() {
            map.insert("quantization".into(), section.clone());
            map.insert("quantization_config".into(), section);
        }
    }
}

/// The dtype mlx-lm casts to when `--dtype` is not given: the config's `torch_dtype`, else its
/// `text_config.dtype`, when it is one of the three float types.
fn config_dtype(config: &Value) -> Option<DType> {
    let named = config["torch_dtype"]
        .as_str()
        .or_else(|| config["text_config"]["dtype"].as_str());
    match named? {
        "float16" => Some(DType::F16),
        "bfloat16" => Some(DType::BF16),
        "float32" => Some(DType::F32),
        _ => None,
    }
}

/// Whether the cast to `--dtype` applies to `name` (the models' `cast_predicate`): a mixture's
/// routing bias and Qwen3.5's and Nemotron-H's `A_log` stay as the checkpoint has them.
fn casts(model_type: &str, name: &str) -> bool {
    match model_type {
        "deepseek_v3" | "kimi_k2" | "glm4_moe" => !name.contains("e_score_correction_bias"),
        "lfm2_moe" => !name.contains("expert_bias"),
        "qwen3_5" | "qwen3_5_moe" => !name.ends_with("A_log"),
        "nemotron_h" => !name.ends_with("A_log") && !name.contains("e_score_correction_bias"),
        _ => true,
    }
}

fn quantized_origins(origins: &BTreeMap<String, Origin>, prefix: &str) -> [Option<Origin>; 3] {
    ["weight", "scales", "biases"].map(|leaf| origins.get(&format!("{prefix}.{leaf}")).cloned())
}

/// mlx-lm's `get_total_parameters`: the arrays of leaf modules only (not those a module with
/// submodules holds itself, such as Qwen3-Next's `A_log` or Gemma 4's `layer_scalar`); a
/// quantized weight counts as its unpacked elements, its scales and biases not at all.
fn parameter_count(
    planned: &BTreeMap<String, PlannedTensor>,
    jobs: &[Job],
    source_quantization: &Quantization,
) -> usize {
    let mut specs: BTreeMap<&str, QuantSpec> = BTreeMap::new();
    for job in jobs {
        if let Job::Quantize { prefix, spec, .. } = job {
            specs.insert(prefix, *spec);
        }
    }
    // Every module that has a submodule holding arrays.
    let mut parents = std::collections::BTreeSet::new();
    for name in planned.keys() {
        let module = name.rsplit_once('.').map_or("", |(m, _)| m);
        let mut ancestor = module;
        while let Some((up, _)) = ancestor.rsplit_once('.') {
            parents.insert(up);
            ancestor = up;
        }
    }
    planned
        .iter()
        .filter(|(name, _)| !parents.contains(name.rsplit_once('.').map_or("", |(m, _)| m)))
        .map(|(name, t)| {
            let elements: usize = t.shape.iter().product();
            let (prefix, leaf) = name.rsplit_once('.').unwrap_or(("", name));
            let quantized = planned.contains_key(&format!("{prefix}.scales"));
            let spec = specs
                .get(prefix)
                .copied()
                .or_else(|| source_quantization.for_module(prefix));
            match (leaf, spec) {
                ("scales" | "biases", Some(_)) if quantized => 0,
                ("weight", Some(spec)) if quantized => elements * 32 / spec.bits as usize,
                _ => elements,
            }
        })
        .sum()
}

fn bits_per_weight(planned: &BTreeMap<String, PlannedTensor>, parameters: usize) -> f64 {
    let bytes: usize = planned.values().map(PlannedTensor::len_bytes).sum();
    bytes as f64 * 8.0 / parameters.max(1) as f64
}

/// The tokenizer, generation and code files, and a model card; the chat template also as
/// `chat_template.jinja`, where transformers' `save_pretrained` puts it.
fn copy_companion_files(src: &Path, dst: &Path) -> Result<(), ConvertError> {
    for name in COMPANION_FILES {
        let from = src.join(name);
        if from.is_file() {
            copy_file(&from, &dst.join(name))?;
        }
    }
    let entries = std::fs::read_dir(src).map_err(|source| ConvertError::Io {
        path: src.to_path_buf(),
        source,
    })?;
    for entry in entries.flatten() {
        let path = entry.path();
        if path.extension().is_some_and(|e| e == "py") {
            copy_file(&path, &dst.join(entry.file_name()))?;
        }
    }
    let template_file = dst.join("chat_template.jinja");
    if !template_file.exists() {
        let tokenizer_config = src.join("tokenizer_config.json");
        let template = tokenizer_config
            .is_file()
            .then(|| read_json(&tokenizer_config).ok())
            .flatten()
            .and_then(|c| {
                c.get("chat_template")
                    .and_then(Value::as_str)
                    .map(str::to_owned)
            });
        if let Some(template) = template {
            write_text(&template_file, &template)?;
        }
    }
    write_text(&dst.join("README.md"), MODEL_CARD)
}

pub(crate) fn write_text(path: &Path, text: &str) -> Result<(), ConvertError> {
    std::fs::write(path, text).map_err(|source| ConvertError::Io {
        path: path.to_path_buf(),
        source,
    })
}
