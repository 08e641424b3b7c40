//! LoRA adapters in mlx-lm's format (`adapter_config.json` + `adapters.safetensors`), applied
//! unfused: `y = base(x) + scale · (x·A)·B`. The base weights stay shared and untouched; an
//! [`Adapters`] set is a separate object handed to a forward pass, so one loaded model can serve
//! several adapters (or none) side by side.

use std::borrow::Cow;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use oxlm_engine::ops::LowRankUpdate;
use oxlm_engine::{Device, EngineError, FloatMatrix, Tensor};
use serde_json::{json, Value};
use thiserror::Error;

use crate::cache::Cache;
use crate::checkpoint::{open_safetensors, read_json, Residency};
use crate::decoder_grad::{self, Decoder};
use crate::lora_dropout::{BatchDropout, InputDropout};
use crate::lora_grad::{Example, LossAndGrads, SumsAndGrads};
pub use crate::lora_rows::{AdaptedModel, LayerAdapter, PassAdapters, RowAdapters};
use crate::pass::{forward_one, forward_rows, Architecture};
use crate::save::{write_safetensors, SaveError, TensorBytes};
use crate::{ForwardError, LanguageModel, LoadError, Logits};

pub const CONFIG_FILE: &str = "adapter_config.json";
pub const WEIGHTS_FILE: &str = "adapters.safetensors";

/// The largest `lora_parameters.scale` (in magnitude) an adapter may have. mlx-lm trains with
/// 20 and adapters converted from PEFT get alpha / rank, tens to a few hundred; past 1e4 the
/// update outweighs the layer it adapts by orders of magnitude, so such a scale is a broken
/// config rather than a choice (1e39, infinite in f32, turned every logit to NaN).
pub const MAX_SCALE: f64 = 1e4;

/// Why an adapter could not be loaded or used with a model.
#[derive(Debug, Error)]
pub enum AdapterError {
    #[error("the adapter path does not exist: {0}")]
    NotFound(PathBuf),
    #[error(transparent)]
    Load(#[from] LoadError),
    #[error("{path}: {reason}")]
    Config { path: PathBuf, reason: String },
    #[error("fine_tune_type `{0}` is not supported (supported: lora)")]
    UnsupportedType(String),
    #[error("this `{0}` model takes no LoRA adapters (adapters do not stack)")]
    UnsupportedModel(String),
    #[error(
        "LoRA training of `{0}`, which this model keeps split, is not supported (leave it out of \
         lora_parameters.keys)"
    )]
    FusedTraining(String),
    #[error("adapter at {} does not fit the model:\n  {}", .path.display(), .problems.join("\n  "))]
    Mismatch {
        path: PathBuf,
        problems: Vec<String>,
    },
    #[error("cannot copy the adapter to the model's device: {0}")]
    Device(String),
    #[error("{}: NaN or infinite values in {}", .path.display(), .tensors.join(", "))]
    NonFiniteWeights { path: PathBuf, tensors: Vec<String> },
}

/// A linear layer an adapter can attach to: its path within a block and its shape.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LinearShape {
    /// As mlx-lm names the module within a block, e.g. `self_attn.q_proj`.
    pub key: &'static str,
    pub in_features: usize,
    pub out_features: usize,
    /// The experts of a mixture's stacked layer (`switch_mlp.gate_proj`), each `[out, in]`;
    /// 0 for a plain layer.
    pub experts: usize,
    /// A layer the checkpoint keeps fused and the model split (Phi-3's `qkv_proj`): the keys of
    /// the model's layers and their output rows, in order; empty for a layer kept whole.
    pub parts: Vec<(&'static str, usize)>,
}

impl LinearShape {
    /// `shapes` (the layers of one input, in output order) as the one fused layer `key` whose
    /// rows they split.
    pub fn fused(key: &'static str, shapes: &[LinearShape]) -> LinearShape {
        LinearShape {
            key,
            in_features: shapes.first().map_or(0, |s| s.in_features),
            out_features: shapes.iter().map(|s| s.out_features).sum(),
            experts: 0,
            parts: shapes.iter().map(|s| (s.key, s.out_features)).collect(),
        }
    }
}

/// A model whose blocks LoRA adapters attach to.
pub trait Adaptable: Architecture {
    /// The linear layers of each block that mlx-lm's default LoRA keys select.
    fn block_linears(&self) -> Vec<Vec<LinearShape>>;

    /// Where mlx-lm's model keeps its blocks: adapters name block `i`'s layers under
    /// `{blocks_path}.{i}`.
    fn blocks_path(&self) -> &'static str {
        "model.layers"
    }

    /// [`LanguageModel::forward`] with each layer that `adapters` names adapted.
    fn forward_adapted(
        &self,
        tokens: &[u32],
        cache: &mut Cache,
        logits: Logits,
        adapters: PassAdapters,
    ) -> Result<Tensor, ForwardError> {
        forward_one(cache, logits, self.output(), |c| {
            self.hidden_states(tokens, c, Some(adapters))
        })
    }

    /// [`LanguageModel::forward_batch`] with each layer that `adapters` names adapted (each
    /// sequence's own, as [`RowAdapters::by_row`] gives them).
    fn forward_batch_adapted(
        &self,
        tokens: &[u32],
        caches: &mut [&mut Cache],
        adapters: PassAdapters,
    ) -> Result<Tensor, ForwardError> {
        forward_rows(tokens, caches, self.output(), |c| {
            self.hidden_states(tokens, c, Some(adapters))
        })
    }

    /// The model as the backward pass sees it.
    fn decoder(&self) -> &dyn Decoder;

    /// The cross-entropy of each example's scored positions, summed, by the forward pass that
    /// [`grads_of_sums`](Self::grads_of_sums) takes (so that its sums and these agree to the
    /// last bit where the adapters' updates do), with no gradient.
    fn sums(&self, examples: &[Example], adapters: &Adapters) -> Result<Vec<f64>, ForwardError> {
        decoder_grad::sums(self.decoder(), examples, adapters)
    }

    /// mlx-lm's training loss over `examples` (the mean cross-entropy of their scored positions)
    /// and its gradient with respect to every matrix of `adapters`, without dropout. With
    /// `checkpoint`, blocks keep only their inputs and run again during the backward pass (less
    /// memory, more time).
    fn loss_and_grads(
        &self,
        examples: &[Example],
        adapters: &Adapters,
        checkpoint: bool,
    ) -> Result<LossAndGrads, ForwardError> {
        decoder_grad::loss_and_grads(self.decoder(), examples, adapters, None, checkpoint)
    }

    /// [`Adaptable::loss_and_grads`] with LoRA dropout: each adapted layer's low-rank path reads
    /// its input through the masks `dropout` drew for `examples` (`adapters.config.dropout` > 0).
    fn loss_and_grads_with_dropout(
        &self,
        examples: &[Example],
        adapters: &Adapters,
        dropout: &BatchDropout,
        checkpoint: bool,
    ) -> Result<LossAndGrads, ForwardError> {
        let model = self.decoder();
        decoder_grad::loss_and_grads(model, examples, adapters, Some(dropout), checkpoint)
    }

    /// The summed cross-entropy of each example's scored positions (minus its scored targets'
    /// log-probability), and the gradient with respect to every matrix of `adapters` of a loss
    /// that depends on the examples only through those sums, as a preference loss depends on
    /// the log-probabilities of a chosen and a rejected answer. The examples run group by group
    /// (a group's examples are in memory together); once a group has run forward,
    /// `weigh(group, sums)` gives the loss's derivative with respect to each of its sums, and the
    /// backward pass takes it. With `dropout`, the examples of all the groups, in order, are
    /// its batch's examples.
    fn grads_of_sums(
        &self,
        groups: &[&[Example]],
        adapters: &Adapters,
        dropout: Option<&BatchDropout>,
        checkpoint: bool,
        weigh: &mut dyn FnMut(usize, &[f64]) -> Vec<f32>,
    ) -> Result<SumsAndGrads, ForwardError> {
        let model = self.decoder();
        decoder_grad::grads_of_sums(model, groups, adapters, dropout, checkpoint, weigh)
    }
}

/// `lora_parameters` and the layer selection of `adapter_config.json`.
#[derive(Debug, Clone, PartialEq)]
pub struct LoraConfig {
    /// The last `num_layers` blocks get adapters; 0 or less means all of them (as mlx-lm slices).
    pub num_layers: i64,
    pub rank: usize,
    pub scale: f32,
    /// The probability that training's dropout zeroes an element of an adapted layer's input to
    /// its low-rank path.
    pub dropout: f64,
    /// Block-relative module paths; `None` is every linear layer of a block.
    pub keys: Option<Vec<String>>,
}

impl LoraConfig {
    /// mlx_lm.lora's defaults (rank 8, scale 20, no dropout) for the last `num_layers` blocks.
    pub fn new(num_layers: i64) -> Self {
        LoraConfig {
            num_layers,
            rank: 8,
            scale: 20.0,
            dropout: 0.0,
            keys: None,
        }
    }

    /// Parses `adapter_config.json`; `path` names the file in errors.
    pub fn from_json(value: &Value, path: &Path) -> Result<Self, AdapterError> {
        let bad = |reason: String| AdapterError::Config {
            path: path.to_path_buf(),
            reason,
        };
        let kind = value
            .get("fine_tune_type")
            .and_then(Value::as_str)
            .unwrap_or("lora");
        if kind != "lora" {
            return Err(AdapterError::UnsupportedType(kind.to_string()));
        }
        let num_layers = value
            .get("num_layers")
            .and_then(Value::as_i64)
            .ok_or_else(|| bad("`num_layers` is missing or not an integer".into()))?;
        let params = value
            .get("lora_parameters")
            .and_then(Value::as_object)
            .ok_or_else(|| bad("`lora_parameters` is missing".into()))?;
        let number = |key: &str| params.get(key).and_then(Value::as_f64);
        let rank = params
            .get("rank")
            .and_then(Value::as_u64)
            .filter(|&r| r > 0)
            .ok_or_else(|| bad("`lora_parameters.rank` must be a positive integer".into()))?;
        // mlx-lm's own message: other frameworks call this `alpha` and divide it by the rank.
        let scale = number("scale").ok_or_else(|| {
            bad("`lora_parameters.scale` is missing (mlx-lm uses `scale`, not `alpha`)".into())
        })?;
        if !(-MAX_SCALE..=MAX_SCALE).contains(&scale) {
            return Err(bad(format!(
                "`lora_parameters.scale` is {scale}: expected a number from -{MAX_SCALE} to \
                 {MAX_SCALE}"
            )));
        }
        let keys = match params.get("keys") {
            None | Some(Value::Null) => None,
            Some(Value::Array(keys)) => Some(
                keys.iter()
                    .map(|k| k.as_str().map(str::to_string))
                    .collect::<Option<Vec<_>>>()
                    .ok_or_else(|| bad("`lora_parameters.keys` must hold strings".into()))?,
            ),
            Some(_) => return Err(bad("`lora_parameters.keys` must be a list".into())),
        };
        Ok(LoraConfig {
            num_layers,
            rank: rank as usize,
            scale: scale as f32,
            dropout: number("dropout").unwrap_or(0.0),
            keys,
        })
    }

    /// `adapter_config.json` as mlx-lm reads it back.
    pub fn to_json(&self) -> Value {
        let mut params = json!({"rank": self.rank, "dropout": self.dropout, "scale": self.scale});
        if let Some(keys) = &self.keys {
            params["keys"] = json!(keys);
        }
        json!({"fine_tune_type": "lora", "num_layers": self.num_layers, "lora_parameters": params})
    }

    /// The first block that gets adapters among `blocks`.
    fn first_block(&self, blocks: usize) -> usize {
        match usize::try_from(self.num_layers) {
            Ok(n) if n > 0 => blocks.saturating_sub(n),
            _ => 0,
        }
    }

    /// Full module path → shape of every layer this config adapts in a model with these blocks,
    /// following `linear_to_lora_layers`.
    pub fn targets(&self, blocks: &Blocks) -> BTreeMap<String, LinearShape> {
        let mut out = BTreeMap::new();
        for (i, linears) in blocks
            .linears
            .iter()
            .enumerate()
            .skip(self.first_block(blocks.linears.len()))
        {
            for shape in linears {
                let chosen = self
                    .keys
                    .as_ref()
                    .is_none_or(|keys| keys.iter().any(|k| k == shape.key));
                if chosen {
                    out.insert(format!("{}.{i}.{}", blocks.path, shape.key), shape.clone());
                }
            }
        }
        out
    }
}

/// One adapted layer's low-rank update, in f32.
#[derive(Debug, Clone, PartialEq)]
pub struct LoraLinear {
    pub in_features: usize,
    pub out_features: usize,
    pub rank: usize,
    pub scale: f32,
    /// `[in_features, rank]`, row-major.
    pub a: Vec<f32>,
    /// `[rank, out_features]`, row-major.
    pub b: Vec<f32>,
    /// Training's dropout of the low-rank path's input, for the example being run; `None` at
    /// inference and in evaluation, which never drop.
    pub dropout: Option<InputDropout>,
    /// The matrices in the memory of the GPU the model runs on (see [`Adapters::place`]).
    pub placed: Option<Arc<PlacedLora>>,
}

/// A layer's matrices on a GPU, as products by a transposed weight take them.
#[derive(Debug)]
pub struct PlacedLora {
    /// `Aᵀ`, `[rank, in]`.
    down: FloatMatrix,
    /// `Bᵀ`, `[out, rank]`.
    up: FloatMatrix,
}

/// The same placed copy (the copies hold what the host's matrices hold).
impl PartialEq for PlacedLora {
    fn eq(&self, other: &Self) -> bool {
        std::ptr::eq(self, other)
    }
}

impl LoraLinear {
    /// `u[m, rank] = x[m, in] · A`.
    pub fn down(&self, x: &[f32], m: usize) -> Vec<f32> {
        let r = self.rank;
        let mut u = vec![0.0; m * r];
        for (xr, ur) in x
            .chunks_exact(self.in_features)
            .zip(u.chunks_exact_mut(r))
            .take(m)
        {
            for (&xv, ar) in xr.iter().zip(self.a.chunks_exact(r)) {
                for (uv, &av) in ur.iter_mut().zip(ar) {
                    *uv += xv * av;
                }
            }
        }
        u
    }

    /// `y[m, out] += scale · u · B`.
    pub fn up_into(&self, u: &[f32], y: &mut [f32]) {
        for (ur, yr) in u
            .chunks_exact(self.rank)
            .zip(y.chunks_exact_mut(self.out_features))
        {
            for (&uv, br) in ur.iter().zip(self.b.chunks_exact(self.out_features)) {
                let s = self.scale * uv;
                for (yv, &bv) in yr.iter_mut().zip(br) {
                    *yv += s * bv;
                }
            }
        }
    }

    /// `y[m, out] += scale · (dropout(x)·A)·B`, the adapter's share of the layer's output.
    pub fn add_to(&self, x: &[f32], m: usize, y: &mut [f32]) {
        self.up_into(&self.down(&self.dropped(x), m), y);
    }

    /// Copies the matrices, transposed, to `device`'s memory for
    /// [`placed_update`](Self::placed_update).
    fn place(&mut self, device: &Device) -> Result<(), EngineError> {
        let (r, inputs, outputs) = (self.rank, self.in_features, self.out_features);
        let mut down = FloatMatrix::from_f32(r, inputs, &transpose(&self.a, inputs, r))?;
        let mut up = FloatMatrix::from_f32(outputs, r, &transpose(&self.b, r, outputs))?;
        down.place(device)?;
        up.place(device)?;
        self.placed = Some(Arc::new(PlacedLora { down, up }));
        Ok(())
    }

    /// Its update of the rows `rows` (`None`: all of them) through the copies
    /// [`place`](Self::place) made, for [`oxlm_engine::ops::add_low_rank`]: `None` where it has
    /// none, or a training dropout (which the host draws).
    pub fn placed_update<'s>(&'s self, rows: Option<&'s [usize]>) -> Option<LowRankUpdate<'s>> {
        let (Some(placed), None) = (&self.placed, &self.dropout) else {
            return None;
        };
        Some(LowRankUpdate {
            down: &placed.down,
            up: &placed.up,
            scale: self.scale,
            rows,
        })
    }

    /// `x` as the low-rank path reads it: through the dropout, where there is one.
    pub fn dropped<'x>(&self, x: &'x [f32]) -> Cow<'x, [f32]> {
        match &self.dropout {
            Some(dropout) => {
                let mut x = x.to_vec();
                dropout.apply(&mut x);
                Cow::Owned(x)
            }
            None => Cow::Borrowed(x),
        }
    }
}

impl<'a> PassAdapters<'a> {
    /// The adapters of module `module` (e.g. `mlp`; `""` for the block's own layers) of block
    /// `block`.
    pub fn module(self, block: usize, module: &'a str) -> ModuleAdapters<'a> {
        ModuleAdapters {
            set: Some(self),
            block,
            module,
            expert: None,
        }
    }
}

impl<'a> From<&'a Adapters> for PassAdapters<'a> {
    fn from(set: &'a Adapters) -> Self {
        PassAdapters::All(set)
    }
}

/// A set of adapted layers, by full module path (`model.layers.3.self_attn.q_proj`).
#[derive(Debug, Clone)]
pub struct Adapters {
    pub config: LoraConfig,
    pub layers: BTreeMap<String, LoraLinear>,
    /// The stacked layers of mixtures' experts, one adapter per expert. mlx-lm keeps each as
    /// `lora_a` `[experts, rank, in]` and `lora_b` `[experts, out, rank]`; training and
    /// `save_weights` take plain layers only.
    pub experts: BTreeMap<String, Vec<LoraLinear>>,
    /// The model's [`Adaptable::blocks_path`].
    pub blocks_path: &'static str,
    /// The layers of `layers` the model keeps split (Phi-3's `qkv_proj`), by the paths of its
    /// own layers: each shares the fused layer's `a` and takes its columns of `b`.
    pub parts: BTreeMap<String, LoraLinear>,
}

/// The adapters of one module's linear layers (e.g. block 3's `self_attn`), by layer name.
#[derive(Clone, Copy)]
pub struct ModuleAdapters<'a> {
    set: Option<PassAdapters<'a>>,
    block: usize,
    module: &'a str,
    /// For a mixture's stacked experts: the expert whose adapters [`ModuleAdapters::get`] gives.
    expert: Option<usize>,
}

impl<'a> ModuleAdapters<'a> {
    /// No adapters: every layer runs as loaded.
    pub const NONE: ModuleAdapters<'static> = ModuleAdapters {
        set: None,
        block: 0,
        module: "",
        expert: None,
    };

    /// Whether the pass has no adapters at all.
    pub fn is_empty(&self) -> bool {
        self.set.is_none()
    }

    /// The adapters of expert `e` of the stacked layers of this module (`switch_mlp`).
    pub fn expert(self, e: usize) -> Self {
        ModuleAdapters {
            expert: Some(e),
            ..self
        }
    }

    /// The adapters of layer `name` within the module.
    pub fn get(&self, name: &str) -> Option<LayerAdapter<'a>> {
        let parts = match self.set? {
            PassAdapters::All(set) => vec![(self.lookup(set, name)?, None)],
            PassAdapters::Rows(rows) => (rows.groups.iter())
                .filter_map(|(set, rows)| Some((self.lookup(set, name)?, rows.as_deref())))
                .collect(),
        };
        (!parts.is_empty()).then_some(LayerAdapter { parts })
    }

    /// The one adapter of layer `name` within the module, where the pass has one set for every
    /// row (a training pass).
    pub fn get_one(&self, name: &str) -> Option<&'a LoraLinear> {
        match self.set? {
            PassAdapters::All(set) => self.lookup(set, name),
            PassAdapters::Rows(_) => None,
        }
    }

    fn lookup(&self, set: &'a Adapters, name: &str) -> Option<&'a LoraLinear> {
        // One string for each of a decoding step's layers and sets: it runs on every step.
        let (blocks, block) = (set.blocks_path, self.block);
        let path = match self.module {
            // The block's own layers (Gemma 4's per-layer input gate).
            "" => format!("{blocks}.{block}.{name}"),
            module => format!("{blocks}.{block}.{module}.{name}"),
        };
        match self.expert {
            Some(e) => set.experts.get(&path)?.get(e),
            None => set.layers.get(&path).or_else(|| set.parts.get(&path)),
        }
    }
}

/// A model's adaptable linear layers: where its blocks are, and each block's.
pub struct Blocks {
    pub path: &'static str,
    pub linears: Vec<Vec<LinearShape>>,
}

/// `m` (`[rows, cols]`, row-major) transposed.
pub fn transpose(m: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    (0..cols)
        .flat_map(|c| (0..rows).map(move |r| m[r * cols + c]))
        .collect()
}

/// The experts' matrices (each `[rows, cols]`, as a plain layer keeps its `a` or `b`) as one
/// array of mlx-lm's expert stack: each transposed, `[experts, cols, rows]`.
pub fn stack_transposed<'m>(
    matrices: impl IntoIterator<Item = &'m [f32]>,
    rows: usize,
    cols: usize,
) -> Vec<f32> {
    (matrices.into_iter())
        .flat_map(|m| transpose(m, rows, cols))
        .collect()
}

/// Expert `e`'s matrix `[rows, cols]` out of an array of mlx-lm's expert stack,
/// `[experts, cols, rows]`.
pub fn unstack_transposed(stack: &[f32], e: usize, rows: usize, cols: usize) -> Vec<f32> {
    transpose(&stack[e * rows * cols..][..rows * cols], cols, rows)
}

/// A layer's `lora_a` and `lora_b` as far as a file holds them.
type Halves = [Option<Vec<f32>>; 2];

/// The `lora_a` / `lora_b` arrays of the safetensors `file` by layer path, each checked against
/// the layer's `(in, out)` in `shapes` and `rank`, and to hold finite numbers only (one NaN
/// would turn every output of the model to NaN).
fn read_arrays(
    file: &Path,
    shapes: &BTreeMap<String, LinearShape>,
    rank: usize,
) -> Result<BTreeMap<String, Halves>, AdapterError> {
    let weights = open_safetensors(file, Residency::Mapped)?;
    let (mut problems, mut non_finite) = (Vec::new(), Vec::new());
    let mut out: BTreeMap<String, Halves> = BTreeMap::new();
    let names: BTreeSet<&String> = weights.keys().collect();
    for name in names {
        let t = &weights[name];
        let parsed = name
            .rsplit_once('.')
            .and_then(|(layer, leaf)| {
                Some((layer, ["lora_a", "lora_b"].iter().position(|l| *l == leaf)?))
            })
            .and_then(|(layer, half)| Some((layer, half, shapes.get(layer)?)));
        let Some((layer, half, shape)) = parsed else {
            problems.push(format!("{name}: not an adapter parameter in the model"));
            continue;
        };
        let (inputs, outputs, experts) = (shape.in_features, shape.out_features, shape.experts);
        let expected = match (half, experts) {
            (0, 0) => vec![inputs, rank],
            (_, 0) => vec![rank, outputs],
            (0, _) => vec![experts, rank, inputs],
            _ => vec![experts, outputs, rank],
        };
        if t.shape != expected || !t.dtype.is_float() {
            problems.push(format!(
                "{name}: adapter shape {:?} ({}) does not match model parameter shape {expected:?}",
                t.shape, t.dtype
            ));
            continue;
        }
        let count = expected.iter().product();
        let values = FloatMatrix::new(1, count, t.dtype, t.data.clone())
            .map_err(|source| LoadError::Engine {
                name: name.clone(),
                source,
            })?
            .to_f32_vec();
        if !values.iter().all(|v| v.is_finite()) {
            non_finite.push(name.clone());
        }
        out.entry(layer.to_string()).or_default()[half] = Some(values);
    }
    if !problems.is_empty() {
        return Err(AdapterError::Mismatch {
            path: file.to_path_buf(),
            problems,
        });
    }
    if !non_finite.is_empty() {
        return Err(AdapterError::NonFiniteWeights {
            path: file.to_path_buf(),
            tensors: non_finite,
        });
    }
    Ok(out)
}

/// The model's own layers of each adapted layer of `layers` that its `shapes` say the model keeps
/// split, by path (under the block's path, the part's key for the fused layer's): `a` shared,
/// `b`'s columns of each part's rows.
fn split_parts(
    layers: &BTreeMap<String, LoraLinear>,
    shapes: &BTreeMap<String, LinearShape>,
    blocks_path: &str,
) -> BTreeMap<String, LoraLinear> {
    let mut out = BTreeMap::new();
    for (path, layer) in layers {
        let Some(shape) = shapes.get(path).filter(|s| !s.parts.is_empty()) else {
            continue;
        };
        let block = path.strip_suffix(shape.key).unwrap_or(blocks_path);
        let mut first = 0;
        for &(key, rows) in &shape.parts {
            let b = layer
                .b
                .chunks_exact(layer.out_features)
                .flat_map(|row| &row[first..first + rows])
                .copied()
                .collect();
            let part = LoraLinear {
                out_features: rows,
                b,
                ..layer.clone()
            };
            out.insert(format!("{block}{key}"), part);
            first += rows;
        }
    }
    out
}

fn model_blocks(model: &dyn LanguageModel) -> Result<Blocks, AdapterError> {
    model
        .adaptable()
        .map(|a| Blocks {
            path: a.blocks_path(),
            linears: a.block_linears(),
        })
        .ok_or_else(|| AdapterError::UnsupportedModel(model.info().model_type.clone()))
}

impl Adapters {
    /// Reads the adapter directory `dir` (as `mlx_lm.tuner.utils.load_adapters`) and checks it
    /// against `model`: every array must be the `lora_a`/`lora_b` of a layer the config adapts,
    /// with that layer's shape. A layer without arrays keeps mlx-lm's zero `lora_b` and is left out.
    pub fn load(dir: &Path, model: &dyn LanguageModel) -> Result<Self, AdapterError> {
        if !dir.exists() {
            return Err(AdapterError::NotFound(dir.to_path_buf()));
        }
        let config_path = dir.join(CONFIG_FILE);
        let config = LoraConfig::from_json(&read_json(&config_path)?, &config_path)?;
        let blocks = model_blocks(model)?;
        let shapes = config.targets(&blocks);
        let arrays = read_arrays(&dir.join(WEIGHTS_FILE), &shapes, config.rank)?;
        let (mut layers, mut experts) = (BTreeMap::new(), BTreeMap::new());
        for (path, [a, b]) in arrays {
            // mlx-lm keeps a missing `lora_b` at zero; a missing `lora_a` then does not matter.
            let (Some(a), Some(b)) = (a, b) else { continue };
            let shape = &shapes[&path];
            let layer = |a, b| LoraLinear {
                in_features: shape.in_features,
                out_features: shape.out_features,
                rank: config.rank,
                scale: config.scale,
                a,
                b,
                dropout: None,
                placed: None,
            };
            if shape.experts == 0 {
                layers.insert(path, layer(a, b));
                continue;
            }
            // Expert e's `lora_a[e]` is `[rank, in]` and `lora_b[e]` `[out, rank]`: transposed,
            // they are a plain layer's `[in, rank]` and `[rank, out]`.
            let (r, inputs, outputs) = (config.rank, shape.in_features, shape.out_features);
            let each = (0..shape.experts).map(|e| {
                let a_e = unstack_transposed(&a, e, inputs, r);
                let b_e = unstack_transposed(&b, e, r, outputs);
                layer(a_e, b_e)
            });
            experts.insert(path, each.collect());
        }
        let parts = split_parts(&layers, &shapes, blocks.path);
        let mut adapters = Adapters {
            config,
            layers,
            experts,
            blocks_path: blocks.path,
            parts,
        };
        adapters.place(&model.info().device)?;
        Ok(adapters)
    }

    /// Copies every layer's matrices to `device`'s memory (nothing for the CPU), so that a
    /// model there applies them without taking its activations to the host. Training changes
    /// the host's matrices only: an adapter being trained is not placed.
    pub fn place(&mut self, device: &Device) -> Result<(), AdapterError> {
        if device.is_cpu() {
            return Ok(());
        }
        let experts = self.experts.values_mut().flatten();
        for layer in (self.layers.values_mut())
            .chain(experts)
            .chain(self.parts.values_mut())
        {
            layer
                .place(device)
                .map_err(|e| AdapterError::Device(e.to_string()))?;
        }
        Ok(())
    }

    /// The same layers, each update scaled by `scale` in place of its own: at 0, the base
    /// model's outputs through the adapted layers' path (the reference preference training
    /// compares against).
    pub fn at_scale(&self, scale: f32) -> Adapters {
        let mut scaled = self.clone();
        let experts = scaled.experts.values_mut().flatten();
        for layer in (scaled.layers.values_mut())
            .chain(experts)
            .chain(scaled.parts.values_mut())
        {
            layer.scale = scale;
        }
        scaled
    }

    /// Every layer `config` adapts in `model`, with both matrices zero (training fills `a`).
    pub fn zeros(config: LoraConfig, model: &dyn LanguageModel) -> Result<Self, AdapterError> {
        let blocks = model_blocks(model)?;
        let (mut layers, mut experts) = (BTreeMap::new(), BTreeMap::new());
        for (path, s) in config.targets(&blocks) {
            if !s.parts.is_empty() {
                return Err(AdapterError::FusedTraining(s.key.to_string()));
            }
            let zero = LoraLinear {
                in_features: s.in_features,
                out_features: s.out_features,
                rank: config.rank,
                scale: config.scale,
                a: vec![0.0; s.in_features * config.rank],
                b: vec![0.0; config.rank * s.out_features],
                dropout: None,
                placed: None,
            };
            if s.experts == 0 {
                layers.insert(path, zero);
            } else {
                experts.insert(path, vec![zero; s.experts]);
            }
        }
        Ok(Adapters {
            config,
            layers,
            experts,
            blocks_path: blocks.path,
            parts: BTreeMap::new(),
        })
    }

    /// Replaces matrices with those in the safetensors `file` (`--resume-adapter-file`); every
    /// array must belong to a layer of this set, with its shape.
    pub fn load_weights(&mut self, file: &Path) -> Result<(), AdapterError> {
        if !file.exists() {
            return Err(AdapterError::NotFound(file.to_path_buf()));
        }
        let shape = |l: &LoraLinear, experts| LinearShape {
            key: "",
            in_features: l.in_features,
            out_features: l.out_features,
            experts,
            parts: Vec::new(),
        };
        let plain = (self.layers.iter()).map(|(path, l)| (path.clone(), shape(l, 0)));
        let stacked = (self.experts.iter())
            .filter_map(|(path, each)| Some((path.clone(), shape(each.first()?, each.len()))));
        let shapes = plain.chain(stacked).collect();
        let r = self.config.rank;
        for (path, [a, b]) in read_arrays(file, &shapes, r)? {
            if let Some(layer) = self.layers.get_mut(&path) {
                if let Some(a) = a {
                    layer.a = a;
                }
                if let Some(b) = b {
                    layer.b = b;
                }
                continue;
            }
            let each = (self.experts.get_mut(&path)).expect("read_arrays keeps known layers");
            for (e, layer) in each.iter_mut().enumerate() {
                let (inputs, outputs) = (layer.in_features, layer.out_features);
                if let Some(a) = &a {
                    layer.a = unstack_transposed(a, e, inputs, r);
                }
                if let Some(b) = &b {
                    layer.b = unstack_transposed(b, e, r, outputs);
                }
            }
        }
        Ok(())
    }

    /// Writes every matrix to the safetensors `file` (atomically), named and shaped as mlx-lm
    /// keeps them: an expert stack's as `[experts, rank, in]` and `[experts, out, rank]`.
    pub fn save_weights(&self, file: &Path) -> Result<(), SaveError> {
        let mut tensors = BTreeMap::new();
        for (path, l) in &self.layers {
            let a = TensorBytes::f32(vec![l.in_features, l.rank], &l.a);
            let b = TensorBytes::f32(vec![l.rank, l.out_features], &l.b);
            tensors.insert(format!("{path}.lora_a"), a);
            tensors.insert(format!("{path}.lora_b"), b);
        }
        for (path, each) in &self.experts {
            let Some(first) = each.first() else { continue };
            let (r, inputs, outputs) = (first.rank, first.in_features, first.out_features);
            let a = stack_transposed(each.iter().map(|l| &l.a[..]), inputs, r);
            let b = stack_transposed(each.iter().map(|l| &l.b[..]), r, outputs);
            let experts = each.len();
            let a = TensorBytes::f32(vec![experts, r, inputs], &a);
            let b = TensorBytes::f32(vec![experts, outputs, r], &b);
            tensors.insert(format!("{path}.lora_a"), a);
            tensors.insert(format!("{path}.lora_b"), b);
        }
        write_safetensors(file, &tensors)
    }

    /// Checks that every adapted layer exists in `model` with the adapter's shape.
    pub fn check(&self, model: &dyn LanguageModel) -> Result<(), AdapterError> {
        let targets = self.config.targets(&model_blocks(model)?);
        let fits = |path: &String, experts: usize, l: &LoraLinear| {
            targets.get(path).is_some_and(|s| {
                (s.in_features, s.out_features, s.experts)
                    == (l.in_features, l.out_features, experts)
            })
        };
        let plain = self.layers.iter().filter(|(path, l)| !fits(path, 0, l));
        let stacked = (self.experts.iter())
            .filter(|(path, each)| !each.iter().all(|l| fits(path, each.len(), l)));
        let problems: Vec<String> = plain
            .map(|(path, _)| path)
            .chain(stacked.map(|(path, _)| path))
            .map(|path| format!("{path}: no layer of this shape in the model"))
            .collect();
        if problems.is_empty() {
            Ok(())
        } else {
            Err(AdapterError::Mismatch {
                path: PathBuf::from("<adapters in memory>"),
                problems,
            })
        }
    }

    /// Where the model keeps block `i` (`model.layers.3`), as the adapted layers are named.
    pub fn block_path(&self, i: usize) -> String {
        format!("{}.{i}", self.blocks_path)
    }

    /// The adapters of module `module` (e.g. `mlp`; `""` for the block's own layers) of block
    /// `block`.
    pub fn module<'a>(&'a self, block: usize, module: &'a str) -> ModuleAdapters<'a> {
        PassAdapters::All(self).module(block, module)
    }
}

#[cfg(test)]
mod tests {
    use oxlm_engine::ops;

    use super::*;

    /// The update through the placed matrices (as a GPU computes it, by products with the
    /// transposed matrices) is the host's, here on host tensors.
    #[test]
    fn the_update_through_placed_matrices_is_the_hosts() {
        let values = |n: usize, k: f32| (0..n).map(|i| (i as f32 * k).sin()).collect();
        let mut layer = LoraLinear {
            in_features: 6,
            out_features: 5,
            rank: 3,
            scale: 1.5,
            a: values(18, 0.7),
            b: values(15, 1.3),
            dropout: None,
            placed: None,
        };
        layer.place(&Device::Cpu).unwrap();
        let x = Tensor::new(vec![4, 6], values(24, 0.3));
        let base = Tensor::new(vec![4, 5], values(20, 2.1));
        let near = |got: &Tensor, want: &[f32]| {
            let d = (got.data().iter().zip(want)).map(|(g, w)| (g - w).abs());
            assert!(
                d.fold(0.0, f32::max) < 1e-5,
                "{:?} against {want:?}",
                got.data()
            );
        };
        let mut want = base.data().to_vec();
        layer.add_to(x.data(), 4, &mut want);
        let mut y = base.clone();
        let all = [layer.placed_update(None).unwrap()];
        ops::add_low_rank(&x, &all, &mut y).unwrap();
        near(&y, &want);
        // Rows 3 and 1 only.
        let mut want = base.data().to_vec();
        for r in [3, 1] {
            layer.add_to(&x.data()[r * 6..][..6], 1, &mut want[r * 5..][..5]);
        }
        let mut y = base.clone();
        let some = [layer.placed_update(Some(&[3, 1])).unwrap()];
        ops::add_low_rank(&x, &some, &mut y).unwrap();
        near(&y, &want);
        assert_ne!(y.data(), base.data());
    }

    fn blocks(n: usize) -> Blocks {
        let shape = |key| LinearShape {
            key,
            in_features: 8,
            out_features: 4,
            experts: 0,
            parts: Vec::new(),
        };
        Blocks {
            path: "model.layers",
            linears: vec![vec![shape("self_attn.q_proj"), shape("mlp.down_proj")]; n],
        }
    }

    fn adapted_blocks(config: &LoraConfig, n: usize) -> Vec<String> {
        let mut out: Vec<String> = config
            .targets(&blocks(n))
            .keys()
            .map(|p| p.split('.').nth(2).unwrap().to_string())
            .collect();
        out.dedup();
        out
    }

    /// `model.layers[-max(num_layers, 0):]`: 0 and negative counts select every block.
    #[test]
    fn num_layers_counts_from_the_last_block_as_mlx_lm_slices() {
        for (num_layers, want) in [
            (1, vec!["3"]),
            (2, vec!["2", "3"]),
            (0, vec!["0", "1", "2", "3"]),
        ] {
            assert_eq!(adapted_blocks(&LoraConfig::new(num_layers), 4), want);
        }
        assert_eq!(adapted_blocks(&LoraConfig::new(-1), 4).len(), 4);
        assert_eq!(adapted_blocks(&LoraConfig::new(9), 4).len(), 4);
    }

    #[test]
    fn keys_select_layers_within_each_block() {
        let mut config = LoraConfig::new(1);
        config.keys = Some(vec!["mlp.down_proj".into(), "lm_head".into()]);
        let targets = config.targets(&blocks(2));
        assert_eq!(
            targets.keys().collect::<Vec<_>>(),
            ["model.layers.1.mlp.down_proj"]
        );
    }

    #[test]
    fn the_update_is_scale_times_x_a_b() {
        let l = LoraLinear {
            in_features: 2,
            out_features: 3,
            rank: 1,
            scale: 2.0,
            a: vec![1.0, -1.0],
            b: vec![1.0, 2.0, 3.0],
            dropout: None,
            placed: None,
        };
        let mut y = vec![1.0; 3];
        l.add_to(&[3.0, 1.0], 1, &mut y);
        assert_eq!(y, [5.0, 9.0, 13.0]);
    }

    #[test]
    fn config_round_trips_through_json() {
        let mut config = LoraConfig::new(-1);
        config.keys = Some(vec!["self_attn.q_proj".into()]);
        let back = LoraConfig::from_json(&config.to_json(), Path::new("x")).unwrap();
        assert_eq!(back, config);
    }
}
