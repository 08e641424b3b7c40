//! A cache's state as mlx-lm holds it: per layer, the arrays and numbers of `c.state` under the
//! name of the cache's class (`KVCache`, `RotatingKVCache`, `ArraysCache`), which mlx-lm's
//! `save_prompt_cache` writes and `load_prompt_cache` reads back. The file format itself (the
//! flattened names, the metadata) is the runtime's; this module maps each [`LayerCache`] to the
//! state of the mlx-lm class that plays its part, and back.
//!
//! mlx-lm's arrays are laid out as its caches grow: a `KVCache` reserves blocks of 256 positions,
//! a `RotatingKVCache` keeps a ring whose slots depend on the chunks it was given. A file written
//! here has the layout mlx-lm's own `cache_prompt` gives a prompt of the same length (chunks of
//! 2048 tokens, then the last token alone), so that the two files hold the same arrays.
//!
//! `--max-kv-size` makes every layer a `RotatingKVCache(max_size, keep=4)` in mlx-lm (a
//! [`RotatingKvCache::keeping`] here): its first `keep` slots hold the sequence's first
//! positions once the ring has dropped any, and it wraps past them. Such a state is written with
//! the kept positions in those slots, and read back into a layer that keeps all its positions as
//! a ring of `max_size` keeping the first `keep`.

use std::borrow::Cow;

use half::{bf16, f16};
use oxlm_engine::cpu::attention::{quantize, QuantRows};
use oxlm_engine::{DType, EngineError, KvQuant};
use thiserror::Error;

use crate::cache::{Cache, KvCache, LayerCache, MlxForm, RecurrentCache, RotatingKvCache};

/// mlx-lm's `KVCache.step` and `RotatingKVCache.step`: caches grow by blocks of this many
/// positions.
const MLX_STEP: usize = 256;

/// `generate_step`'s `prefill_step_size`, which `mlx_lm.cache_prompt` leaves at its default.
const MLX_PREFILL_STEP: usize = 2048;

/// One array of a layer's state: its element type, shape and little-endian bytes, as a file
/// holds them (borrowed from a file read whole; converted a layer at a time on restoring).
#[derive(Clone, PartialEq)]
pub struct StateArray<'a> {
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub data: Cow<'a, [u8]>,
}

impl std::fmt::Debug for StateArray<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        write!(f, "{} array of shape {:?}", self.dtype, self.shape)
    }
}

impl StateArray<'_> {
    /// `values` stored as `dtype` (f32 or f16, which hold a cache's elements exactly).
    fn from_f32(dtype: DType, shape: Vec<usize>, values: &[f32]) -> StateArray<'static> {
        let data = match dtype {
            DType::F16 => values
                .iter()
                .flat_map(|&v| f16::from_f32(v).to_le_bytes())
                .collect(),
            _ => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        };
        StateArray {
            dtype,
            shape,
            data: Cow::Owned(data),
        }
    }

    /// The elements as f32 (f16 and bf16 widen exactly); `None` for other element types.
    pub fn to_f32(&self) -> Option<Vec<f32>> {
        let pairs = self.data.chunks_exact(2).map(|b| [b[0], b[1]]);
        Some(match self.dtype {
            DType::F32 => self
                .data
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
            DType::F16 => pairs.map(|b| f16::from_le_bytes(b).to_f32()).collect(),
            DType::BF16 => pairs.map(|b| bf16::from_le_bytes(b).to_f32()).collect(),
            _ => return None,
        })
    }

    /// The elements as f32, each array of the state one whole.
    fn values(&self, layer: usize) -> Result<Vec<f32>, CacheStateError> {
        let values = self
            .to_f32()
            .ok_or_else(|| invalid(layer, format!("a {} array where floats belong", self.dtype)))?;
        if values.len() != self.shape.iter().product::<usize>() {
            return Err(invalid(
                layer,
                format!("{self:?} of {} elements", values.len()),
            ));
        }
        Ok(values)
    }
}

/// One leaf of a layer's state: an array, an integer (an offset, a window), or `None` (an
/// `ArraysCache`'s unused padding fields).
#[derive(Debug, Clone, PartialEq)]
pub enum StateItem<'a> {
    Array(StateArray<'a>),
    Int(i64),
    None,
}

/// The state of one layer: mlx-lm's class name and the leaves of `c.state`, each under its path
/// in the state's tree (`"0"`, `"0.1"`), in the order mlx-lm flattens them.
#[derive(Debug, Clone, PartialEq)]
pub struct LayerState<'a> {
    pub class: String,
    pub items: Vec<(String, StateItem<'a>)>,
}

/// Why a state could not be taken from a cache or put into one.
#[derive(Debug, Error)]
pub enum CacheStateError {
    #[error(
        "the prompt cache has {found} layer caches but this model keeps {expected} (is it from \
         another model?)"
    )]
    LayerCount { found: usize, expected: usize },
    #[error(
        "layer {layer}: the prompt cache holds an mlx-lm {found} where this model keeps \
         {expected} (is it from another model?)"
    )]
    Class {
        layer: usize,
        found: String,
        expected: &'static str,
    },
    #[error("layer {layer}: mlx-lm's {class} is not supported{hint}")]
    Unsupported {
        layer: usize,
        class: String,
        hint: &'static str,
    },
    #[error("layer {layer}: {reason}")]
    Invalid { layer: usize, reason: String },
    #[error("the layers hold different numbers of tokens ({0} and {1})")]
    Offsets(usize, usize),
    #[error("no layer of this model's cache records how many tokens it holds")]
    NoTokenCount,
    #[error(transparent)]
    Engine(#[from] EngineError),
}

impl<'a> LayerState<'a> {
    fn new(class: &str) -> Self {
        LayerState {
            class: class.to_string(),
            items: Vec::new(),
        }
    }

    fn push(&mut self, path: &str, item: StateItem<'a>) {
        self.items.push((path.to_string(), item));
    }

    fn get(&self, layer: usize, path: &str) -> Result<&StateItem<'a>, CacheStateError> {
        self.items
            .iter()
            .find(|(p, _)| p == path)
            .map(|(_, item)| item)
            .ok_or_else(|| {
                invalid(
                    layer,
                    format!("its {} has no state entry `{path}`", self.class),
                )
            })
    }

    fn array(&self, layer: usize, path: &str) -> Result<&StateArray<'a>, CacheStateError> {
        match self.get(layer, path)? {
            StateItem::Array(a) if a.dtype.is_float() => Ok(a),
            other => Err(invalid(
                layer,
                format!("state entry `{path}` should be a float array, not {other:?}"),
            )),
        }
    }

    fn int(&self, layer: usize, path: &str) -> Result<usize, CacheStateError> {
        match self.get(layer, path)? {
            StateItem::Int(n) => usize::try_from(*n)
                .map_err(|_| invalid(layer, format!("state entry `{path}` is negative ({n})"))),
            other => Err(invalid(
                layer,
                format!("state entry `{path}` should be an integer, not {other:?}"),
            )),
        }
    }

    /// Refuses entries other than `paths`: a state of another shape than the class has.
    fn expect_paths(&self, layer: usize, paths: &[&str]) -> Result<(), CacheStateError> {
        match self
            .items
            .iter()
            .find(|(p, _)| !paths.contains(&p.as_str()))
        {
            Some((p, _)) => Err(invalid(
                layer,
                format!("unexpected state entry `{p}` in an mlx-lm {}", self.class),
            )),
            None => Ok(()),
        }
    }
}

fn invalid(layer: usize, reason: String) -> CacheStateError {
    CacheStateError::Invalid { layer, reason }
}

/// The element type a ring of `precision` is written in: f16 as it is held; f32 and 8-bit
/// codes (dequantized, exact in f32) as f32.
fn ring_dtype(precision: oxlm_engine::KvPrecision) -> DType {
    match precision {
        oxlm_engine::KvPrecision::F16 => DType::F16,
        _ => DType::F32,
    }
}

impl Cache {
    /// Each layer's state as mlx-lm's cache of the same part holds it (for
    /// `save_prompt_cache`), laid out as `mlx_lm.cache_prompt` lays out a prompt of
    /// `self.offset` tokens.
    pub fn mlx_state(&self) -> Result<Vec<LayerState<'static>>, CacheStateError> {
        self.layers
            .iter()
            .enumerate()
            .map(|(i, layer)| match layer {
                LayerCache::Kv(kv) => kv_state(kv),
                LayerCache::Rotating(ring) => rotating_state(i, ring),
                LayerCache::Recurrent(r) => Ok(arrays_state(r)?),
            })
            .collect()
    }

    /// Puts `states` (one per layer, as mlx-lm's `load_prompt_cache` reads them) into this
    /// fresh cache of the model they are for, in its precision and on its device. Refuses a
    /// state of another model (layer count, kinds, shapes) or one that is not whole; the cache
    /// is then left unusable and should be dropped.
    pub fn restore_mlx_state(&mut self, states: &[LayerState<'_>]) -> Result<(), CacheStateError> {
        if states.len() != self.layers.len() {
            return Err(CacheStateError::LayerCount {
                found: states.len(),
                expected: self.layers.len(),
            });
        }
        let mut offset: Option<usize> = None;
        for (i, (layer, state)) in self.layers.iter_mut().zip(states).enumerate() {
            refuse_unknown(i, &state.class)?;
            let tokens = match layer {
                // A `--max-kv-size` ring (mlx-lm's `make_prompt_cache(model, max_kv_size)`) where
                // the model keeps all positions: the layer becomes that ring.
                LayerCache::Kv(kv) if state.class == "RotatingKVCache" => {
                    let (ring, offset) = restore_bounded(i, kv, state)?;
                    *layer = LayerCache::Rotating(ring);
                    Some(offset)
                }
                LayerCache::Kv(kv) => Some(restore_kv(i, kv, state)?),
                LayerCache::Rotating(ring) => Some(restore_rotating(i, ring, state)?),
                LayerCache::Recurrent(r) => {
                    restore_arrays(i, r, state)?;
                    None
                }
            };
            match (offset, tokens) {
                (Some(a), Some(b)) if a != b => return Err(CacheStateError::Offsets(a, b)),
                (None, Some(b)) => offset = Some(b),
                _ => {}
            }
        }
        // Recurrent layers do not count tokens; every model here has an attention layer that
        // does, and one without would have to be told the position some other way.
        self.offset = offset.ok_or(CacheStateError::NoTokenCount)?;
        Ok(())
    }
}

/// mlx-lm classes that name no cache kind here, refused with what they are.
fn refuse_unknown(layer: usize, class: &str) -> Result<(), CacheStateError> {
    let hint = match class {
        // `MambaCache`: earlier mlx-lm's name of a two-array `ArraysCache`.
        "KVCache" | "QuantizedKVCache" | "RotatingKVCache" | "ArraysCache" | "MambaCache" => {
            return Ok(())
        }
        "ChunkedKVCache" | "CacheList" | "ConcatenateKVCache" => {
            " (no model here keeps one; is the prompt cache from another model?)"
        }
        _ => " (unknown class)",
    };
    Err(CacheStateError::Unsupported {
        layer,
        class: class.to_string(),
        hint,
    })
}

/// The updates mlx-lm's `generate_step` gives a cache for a prompt of `tokens` tokens: chunks of
/// [`MLX_PREFILL_STEP`] while more than one token is left, then the last token alone.
fn mlx_prompt_updates(tokens: usize) -> Vec<usize> {
    let mut updates = Vec::new();
    let mut left = tokens;
    while left > 1 {
        let chunk = MLX_PREFILL_STEP.min(left - 1);
        updates.push(chunk);
        left -= chunk;
    }
    if left == 1 {
        updates.push(1);
    }
    updates
}

/// The positions a `KVCache` has room for after a prompt of `tokens` tokens: it grows by whole
/// steps for each update that does not fit, first cutting its unused tail where the positions
/// held are not a whole number of steps (`KVCache.update_and_fetch`).
fn mlx_kv_capacity(tokens: usize) -> usize {
    let (mut capacity, mut held) = (0, 0);
    for n in mlx_prompt_updates(tokens) {
        if capacity == 0 || held + n > capacity {
            let kept = if capacity == 0 {
                0
            } else if !held.is_multiple_of(MLX_STEP) {
                held
            } else {
                capacity
            };
            capacity = kept + n.div_ceil(MLX_STEP) * MLX_STEP;
        }
        held += n;
    }
    capacity
}

/// A `RotatingKVCache` followed slot by slot: the position each slot holds (`None`: never
/// written), the tokens seen, the next slot to write (`_idx`), and the first positions it
/// keeps in its first slots (`keep`: 0 for a sliding window, 4 for `--max-kv-size`).
struct MlxRing {
    slots: Vec<Option<usize>>,
    offset: usize,
    idx: usize,
    max_size: usize,
    keep: usize,
}

impl MlxRing {
    /// The ring after a prompt of `tokens` tokens, given as `generate_step` gives them.
    fn after_prompt(tokens: usize, max_size: usize, keep: usize) -> Self {
        let mut ring = MlxRing {
            slots: Vec::new(),
            offset: 0,
            idx: 0,
            max_size,
            keep,
        };
        for n in mlx_prompt_updates(tokens) {
            if n == 1 {
                ring.update_in_place();
            } else {
                ring.update_concat(n);
            }
        }
        ring
    }

    /// `_temporal_order`: the slots oldest first (the kept ones first of all), the unused tail
    /// cut.
    fn temporal_order(&self) -> Vec<usize> {
        let len = self.slots.len();
        if self.idx == len {
            (0..len).collect()
        } else if self.idx < self.offset {
            let keep = self.keep.min(len);
            (0..keep)
                .chain(self.idx..len)
                .chain(keep..self.idx)
                .collect()
        } else {
            (0..self.idx).collect()
        }
    }

    /// `_trim`: the first `trim` slots after the kept ones dropped.
    fn trim(&self, slots: &mut Vec<Option<usize>>, trim: usize) {
        let keep = self.keep.min(slots.len());
        let end = (keep + trim).min(slots.len());
        slots.drain(keep..end);
    }

    /// `_update_concat`: the held positions in order, all but the kept ones and the last
    /// `max_size - 1` dropped, then `n` new ones.
    fn update_concat(&mut self, n: usize) {
        let mut slots: Vec<Option<usize>> = self
            .temporal_order()
            .into_iter()
            .map(|s| self.slots[s])
            .collect();
        if !self.slots.is_empty() {
            let trim = (slots.len() + 1).saturating_sub(self.max_size);
            self.trim(&mut slots, trim);
        }
        slots.extend((self.offset..self.offset + n).map(Some));
        self.slots = slots;
        self.offset += n;
        self.idx = self.slots.len();
    }

    /// `_update_in_place` of one token: grows by up to a step while under `max_size`, cuts
    /// down to `max_size`, wraps (past the kept slots), and writes at `_idx`.
    fn update_in_place(&mut self) {
        let prev = self.offset;
        if self.slots.is_empty() || (prev >= self.slots.len() && self.slots.len() < self.max_size) {
            let grow = MLX_STEP.min(self.max_size.saturating_sub(prev));
            self.slots.extend(std::iter::repeat_n(None, grow));
            self.idx = prev;
        }
        let trim = self.slots.len().saturating_sub(self.max_size);
        if trim > 0 {
            let mut slots = std::mem::take(&mut self.slots);
            self.trim(&mut slots, trim);
            self.slots = slots;
            self.idx = self.max_size;
        }
        if self.idx == self.max_size {
            self.idx = self.keep;
        }
        self.slots[self.idx] = Some(prev);
        self.offset += 1;
        self.idx += 1;
    }
}

/// `[kv_heads, slots, head_dim]` keys and values of `rings` (of `capacity` slots, position `p`
/// in slot `p % capacity`) as f32: each slot's position, zeros where it has none; and the
/// element type they are written in.
fn kv_values(
    rings: &crate::cache::KvRings,
    shape: (usize, usize),
    capacity: usize,
    slots: &[Option<usize>],
) -> Result<(Vec<f32>, Vec<f32>, DType), EngineError> {
    let (keys, values) = rings.gather(shape, capacity, slots)?;
    Ok((keys, values, ring_dtype(rings.precision())))
}

/// `[heads, n, width]` rows as their first `split` columns and the rest.
fn split_columns(rows: &[f32], width: usize, split: usize) -> (Vec<f32>, Vec<f32>) {
    let rows = rows.chunks(width.max(1));
    let first = rows
        .clone()
        .flat_map(|r| r[..split].iter().copied())
        .collect();
    let rest = rows.flat_map(|r| r[split..].iter().copied()).collect();
    (first, rest)
}

/// `[heads, n, dk]` keys and `[heads, n, dv]` values as the `[heads, n, dk + dv]` rows a split
/// layer holds as both its keys and its values.
fn join_columns(keys: &[f32], values: &[f32], dk: usize, dv: usize) -> Vec<f32> {
    keys.chunks(dk.max(1))
        .zip(values.chunks(dv.max(1)))
        .flat_map(|(k, v)| k.iter().chain(v).copied())
        .collect()
}

/// The `"0"` (keys) and `"1"` (values) entries of a `KVCache` or `RotatingKVCache` state:
/// `[1, kv_heads, slots, head_dim]` each, or `dk` and `dv` wide where mlx-lm splits the rows;
/// the keys as mlx-lm holds them (`form`).
fn push_kv(
    state: &mut LayerState<'static>,
    (kv_heads, head_dim): (usize, usize),
    slots: usize,
    (keys, values, dtype): (Vec<f32>, Vec<f32>, DType),
    form: MlxForm,
) {
    let (mut keys, values, dk, dv) = match form.split {
        Some(s) => {
            // Rows of `[latent, rotated key]` held as both keys and values: mlx-lm keeps the
            // latent as its keys and the rotated key as its values.
            let (latent, rotated) = split_columns(&keys, head_dim, s);
            (latent, rotated, s, head_dim - s)
        }
        None => (keys, values, head_dim, head_dim),
    };
    if form.key_scale != 1.0 {
        keys.iter_mut().for_each(|k| *k *= form.key_scale);
    }
    let keys = StateArray::from_f32(dtype, vec![1, kv_heads, slots, dk], &keys);
    let values = StateArray::from_f32(dtype, vec![1, kv_heads, slots, dv], &values);
    state.push("0", StateItem::Array(keys));
    state.push("1", StateItem::Array(values));
}

fn kv_state(kv: &KvCache) -> Result<LayerState<'static>, CacheStateError> {
    if let Some([keys, values]) = kv.rings().codes()? {
        return quantized_kv_state(kv, keys.rows(), values.rows());
    }
    let (len, capacity) = (kv.len(), kv.view().capacity);
    let slots: Vec<Option<usize>> = (0..mlx_kv_capacity(len))
        .map(|s| (s < len).then_some(s))
        .collect();
    let arrays = kv_values(kv.rings(), kv.shape(), capacity, &slots)?;
    let mut state = LayerState::new("KVCache");
    push_kv(&mut state, kv.shape(), slots.len(), arrays, kv.mlx_form());
    state.push("2", StateItem::Int(len as i64));
    Ok(state)
}

/// A quantized layer as mlx-lm's `QuantizedKVCache` holds it: keys and values each as
/// `mx.quantize` gives them (codes packed in uint32 words `[1, kv_heads, slots, head_dim · bits
/// / 32]`, scales and biases `[1, kv_heads, slots, head_dim / group]`, in f32 as held here), laid
/// out as the `KVCache` it was made from (rows past the positions are the codes of zeros, as
/// `to_quantized` gives them); then the offset, the group size and the bits.
fn quantized_kv_state(
    kv: &KvCache,
    keys: QuantRows,
    values: QuantRows,
) -> Result<LayerState<'static>, CacheStateError> {
    let ((kv_heads, d), len, capacity) = (kv.shape(), kv.len(), kv.view().capacity);
    let form = kv.mlx_form();
    if form.split.is_some() {
        return Err(CacheStateError::Engine(EngineError::UnsupportedQuantization(
            "a quantized cache of split rows has no mlx-lm form (make the prompt cache without \
             --kv-bits)"
                .into(),
        )));
    }
    let quant = keys.quant;
    let (bytes, groups, slots) = (quant.row_bytes(d), d / quant.group, mlx_kv_capacity(len));
    let mut zero = (vec![0; bytes], vec![0.0; groups], vec![0.0; groups]);
    quantize(quant, &vec![0.0; d], &mut zero.0, &mut zero.1, &mut zero.2);
    let mut state = LayerState::new("QuantizedKVCache");
    for (path, rows, scale) in [("0", keys, form.key_scale), ("1", values, 1.0)] {
        let (mut codes, mut scales, mut biases) = (Vec::new(), Vec::new(), Vec::new());
        for h in 0..kv_heads {
            for s in 0..slots {
                let row = h * capacity + s;
                if s < len {
                    codes.extend_from_slice(&rows.codes[row * bytes..(row + 1) * bytes]);
                    let g = row * groups..(row + 1) * groups;
                    scales.extend(rows.scales[g.clone()].iter().map(|x| x * scale));
                    biases.extend(rows.biases[g].iter().map(|x| x * scale));
                } else {
                    codes.extend_from_slice(&zero.0);
                    scales.extend_from_slice(&zero.1);
                    biases.extend_from_slice(&zero.2);
                }
            }
        }
        let words = vec![1, kv_heads, slots, bytes / 4];
        let codes = StateArray {
            dtype: DType::U32,
            shape: words,
            data: Cow::Owned(codes),
        };
        let shape = vec![1, kv_heads, slots, groups];
        state.push(&format!("{path}.0"), StateItem::Array(codes));
        for (i, x) in [(1, scales), (2, biases)] {
            let array = StateArray::from_f32(DType::F32, shape.clone(), &x);
            state.push(&format!("{path}.{i}"), StateItem::Array(array));
        }
    }
    state.push("2", StateItem::Int(len as i64));
    state.push("3", StateItem::Int(quant.group as i64));
    state.push("4", StateItem::Int(quant.bits.into()));
    Ok(state)
}

fn rotating_state(
    layer: usize,
    ring: &RotatingKvCache,
) -> Result<LayerState<'static>, CacheStateError> {
    if ring.mlx_form().chunked {
        return Err(CacheStateError::Unsupported {
            layer,
            class: "ChunkedKVCache".into(),
            hint: " (mlx-lm cannot write Llama 4's chunked caches to a prompt-cache file either)",
        });
    }
    let view = ring.view();
    let held = view.start..view.end;
    let mlx = MlxRing::after_prompt(ring.len(), ring.window(), ring.keep());
    if let Some(p) = mlx.slots.iter().flatten().find(|&&p| !ring.holds(p)) {
        return Err(invalid(
            layer,
            format!(
                "position {p} is no longer held (positions {held:?} are): a sliding window cut \
                 back by a prompt cache cannot be saved"
            ),
        ));
    }
    let (keys, values) = ring.gather(&mlx.slots)?;
    let arrays = (keys, values, ring_dtype(ring.precision()));
    let mut state = LayerState::new("RotatingKVCache");
    push_kv(
        &mut state,
        ring.shape(),
        mlx.slots.len(),
        arrays,
        ring.mlx_form(),
    );
    state.push("2", StateItem::Int(mlx.offset as i64));
    state.push("3", StateItem::Int(mlx.keep as i64));
    state.push("4", StateItem::Int(mlx.max_size as i64));
    state.push("5", StateItem::Int(mlx.idx as i64));
    Ok(state)
}

/// An `ArraysCache`: `[conv state, delta-rule state]` (`[conv state]` for a short
/// convolution), each with a leading batch axis, and no padding or lengths.
fn arrays_state(r: &RecurrentCache) -> Result<LayerState<'static>, EngineError> {
    let array = |t: &oxlm_engine::Tensor| -> Result<StateItem<'static>, EngineError> {
        let shape = [1].iter().chain(t.shape()).copied().collect();
        Ok(StateItem::Array(StateArray::from_f32(
            DType::F32,
            shape,
            &t.to_vec()?,
        )))
    };
    let mut state = LayerState::new("ArraysCache");
    state.push("0.0", array(&r.conv)?);
    if !r.state.is_empty() {
        state.push("0.1", array(&r.state)?);
    }
    state.push("1", StateItem::None);
    state.push("2", StateItem::None);
    Ok(state)
}

/// Elements `[1, heads, slots, dim]` (`shape`) of `values` at the slots `order`, as
/// `[heads, order, dim]`.
fn pick_slots(values: &[f32], shape: &[usize], order: &[usize]) -> Vec<f32> {
    let (heads, slots, dim) = (shape[1], shape[2], shape[3]);
    let mut out = Vec::with_capacity(heads * order.len() * dim);
    for h in 0..heads {
        for &s in order {
            let at = (h * slots + s) * dim;
            out.extend_from_slice(&values[at..at + dim]);
        }
    }
    out
}

/// The keys and values of an mlx-lm `KVCache` or `RotatingKVCache` state, checked against a
/// layer of `(kv_heads, head_dim)`: `[1, kv_heads, slots, head_dim]` each, or, for rows that
/// mlx-lm splits (`split`), keys of the first `split` columns and values of the rest.
fn checked_kv<'s, 'a>(
    layer: usize,
    state: &'s LayerState<'a>,
    (kv_heads, head_dim): (usize, usize),
    split: Option<usize>,
) -> Result<(&'s StateArray<'a>, &'s StateArray<'a>), CacheStateError> {
    let (keys, values) = (state.array(layer, "0")?, state.array(layer, "1")?);
    let (kd, vd) = match split {
        Some(s) => (s, head_dim - s),
        None => (head_dim, head_dim),
    };
    for (name, a, d) in [("keys", keys, kd), ("values", values, vd)] {
        let fits = a.shape.len() == 4 && a.shape[0] == 1 && a.shape[1] == kv_heads;
        if !fits || a.shape[3] != d || a.shape[2] != keys.shape[2] {
            return Err(invalid(
                layer,
                format!(
                    "{name} of shape {:?} where this model's layer keeps [1, {kv_heads}, _, {d}] \
                     (is the prompt cache from another model?)",
                    a.shape
                ),
            ));
        }
    }
    Ok((keys, values))
}

/// The `(keys, values)` a layer holds, `[kv_heads, order, head_dim]`, for mlx-lm's keys and
/// values (held in `form`) at slots `order`.
fn layer_rows(
    layer: usize,
    keys: &StateArray,
    values: &StateArray,
    order: &[usize],
    form: MlxForm,
) -> Result<(Vec<f32>, Vec<f32>), CacheStateError> {
    let mut k = pick_slots(&keys.values(layer)?, &keys.shape, order);
    let v = pick_slots(&values.values(layer)?, &values.shape, order);
    if form.key_scale != 1.0 {
        k.iter_mut().for_each(|x| *x /= form.key_scale);
    }
    Ok(match form.split {
        Some(_) => {
            let rows = join_columns(&k, &v, keys.shape[3], values.shape[3]);
            (rows.clone(), rows)
        }
        None => (k, v),
    })
}

fn restore_kv(
    layer: usize,
    kv: &mut KvCache,
    state: &LayerState,
) -> Result<usize, CacheStateError> {
    if state.class == "QuantizedKVCache" {
        return restore_quantized_kv(layer, kv, state);
    }
    if state.class != "KVCache" {
        return Err(CacheStateError::Class {
            layer,
            found: state.class.clone(),
            expected: "a KVCache",
        });
    }
    state.expect_paths(layer, &["0", "1", "2"])?;
    let (keys, values) = checked_kv(layer, state, kv.shape(), kv.mlx_form().split)?;
    let offset = state.int(layer, "2")?;
    if offset > keys.shape[2] {
        return Err(invalid(
            layer,
            format!("offset {offset} past the {} positions held", keys.shape[2]),
        ));
    }
    let order: Vec<usize> = (0..offset).collect();
    let (k, v) = layer_rows(layer, keys, values, &order, kv.mlx_form())?;
    kv.restore(offset, &k, &v)?;
    Ok(offset)
}

/// A `QuantizedKVCache` state (see [`quantized_kv_state`]) into `kv`, its codes kept.
fn restore_quantized_kv(
    layer: usize,
    kv: &mut KvCache,
    state: &LayerState,
) -> Result<usize, CacheStateError> {
    let paths = ["0.0", "0.1", "0.2", "1.0", "1.1", "1.2", "2", "3", "4"];
    state.expect_paths(layer, &paths)?;
    let (offset, group, bits) = (
        state.int(layer, "2")?,
        state.int(layer, "3")?,
        state.int(layer, "4")?,
    );
    let quant = KvQuant::new(u8::try_from(bits).unwrap_or(u8::MAX), group)
        .map_err(|e| invalid(layer, e.to_string()))?;
    let form = kv.mlx_form();
    if form.split.is_some() {
        return Err(invalid(
            layer,
            "a QuantizedKVCache where this model's layer keeps split rows".into(),
        ));
    }
    let (kv_heads, d) = kv.shape();
    if let Err(e) = oxlm_engine::check_quantized_head_dim(quant, d) {
        return Err(invalid(
            layer,
            format!("{e} (is the prompt cache from another model?)"),
        ));
    }
    let (bytes, groups) = (quant.row_bytes(d), d / quant.group);
    // Each of keys and values: its codes' bytes and its scales and biases as f32, rows
    // `0..offset` of each head.
    let mut parts = Vec::new();
    for (path, scale) in [("0", form.key_scale), ("1", 1.0)] {
        let codes = match state.get(layer, &format!("{path}.0"))? {
            StateItem::Array(a) if a.dtype == DType::U32 => a,
            other => {
                let why = format!("state entry `{path}.0` should be uint32 codes, not {other:?}");
                return Err(invalid(layer, why));
            }
        };
        let (scales, biases) = (
            state.array(layer, &format!("{path}.1"))?,
            state.array(layer, &format!("{path}.2"))?,
        );
        let slots = codes.shape.get(2).copied().unwrap_or(0);
        let fits = |a: &StateArray, width: usize| a.shape == [1, kv_heads, slots, width];
        if !fits(codes, bytes / 4) || !fits(scales, groups) || !fits(biases, groups) {
            return Err(invalid(
                layer,
                format!(
                    "{bits}-bit codes of shapes {:?}, {:?} and {:?} where this model's layer \
                     keeps [1, {kv_heads}, _, {}] and [1, {kv_heads}, _, {groups}] (is the \
                     prompt cache from another model?)",
                    codes.shape,
                    scales.shape,
                    biases.shape,
                    bytes / 4
                ),
            ));
        }
        if offset > slots {
            let why = format!("offset {offset} past the {slots} positions held");
            return Err(invalid(layer, why));
        }
        let order: Vec<usize> = (0..offset).collect();
        let pick = |a: &StateArray| -> Result<Vec<f32>, CacheStateError> {
            let mut x = pick_slots(&a.values(layer)?, &a.shape, &order);
            x.iter_mut().for_each(|v| *v /= scale);
            Ok(x)
        };
        let mut rows = Vec::with_capacity(kv_heads * offset * bytes);
        for h in 0..kv_heads {
            let from = h * slots * bytes;
            rows.extend_from_slice(&codes.data[from..from + offset * bytes]);
        }
        parts.push((rows, pick(scales)?, pick(biases)?));
    }
    let [keys, values] = [&parts[0], &parts[1]].map(|(codes, scales, biases)| QuantRows {
        quant,
        codes,
        scales,
        biases,
    });
    kv.restore_codes(offset, quant, keys, values)?;
    Ok(offset)
}

/// A `RotatingKVCache` state read and checked: its keys and values (`[1, kv_heads, slots,
/// head_dim]`), its numbers, and the slots that hold positions, oldest first (`_temporal_order`,
/// the kept ones first).
struct RingState<'s, 'a> {
    keys: &'s StateArray<'a>,
    values: &'s StateArray<'a>,
    offset: usize,
    keep: usize,
    max_size: usize,
    order: Vec<usize>,
}

impl<'s, 'a> RingState<'s, 'a> {
    /// Reads `state` for a layer of `shape` (`(kv_heads, head_dim)`, rows split as `split`),
    /// refusing numbers that no `RotatingKVCache` arrives at: a window of no positions, one that
    /// keeps all of them, an `_idx` past its slots, a ring that wrapped before it filled or
    /// wrapped into its kept slots, more positions held than seen, or too few for the next
    /// token. `keep_ok` checks `keep` and `max_size` against the layer first.
    fn read(
        layer: usize,
        state: &'s LayerState<'a>,
        shape: (usize, usize),
        split: Option<usize>,
        keep_ok: impl FnOnce(usize, usize) -> Result<(), CacheStateError>,
    ) -> Result<Self, CacheStateError> {
        state.expect_paths(layer, &["0", "1", "2", "3", "4", "5"])?;
        let (keys, values) = checked_kv(layer, state, shape, split)?;
        let (offset, keep) = (state.int(layer, "2")?, state.int(layer, "3")?);
        let (max_size, idx) = (state.int(layer, "4")?, state.int(layer, "5")?);
        keep_ok(keep, max_size)?;
        let slots = keys.shape[2];
        let fail = |reason: String| Err(invalid(layer, reason));
        if max_size == 0 || keep >= max_size {
            return fail(format!(
                "a RotatingKVCache of max_size {max_size} that keeps its first {keep} positions"
            ));
        }
        if idx > slots {
            return fail(format!("_idx {idx} past its {slots} slots"));
        }
        if keep > slots {
            return fail(format!(
                "keep {keep} past its {slots} slots (max_size {max_size})"
            ));
        }
        // Only a full ring wraps, and past its kept slots; only a prompt chunk makes it wider,
        // written to its end.
        let wrapped = idx < offset && idx < slots;
        if wrapped && (slots != max_size || idx < keep) {
            return fail(format!(
                "_idx {idx} after {offset} tokens in {slots} slots, keep {keep}, max_size \
                 {max_size}: no RotatingKVCache wraps there"
            ));
        }
        if slots > max_size && idx != slots {
            return fail(format!(
                "{slots} slots, more than max_size {max_size}, written up to _idx {idx}"
            ));
        }
        let mlx = MlxRing {
            slots: vec![None; slots],
            offset,
            idx,
            max_size,
            keep,
        };
        let order = mlx.temporal_order();
        // The positions held end at the offset; the next token attends to `max_size - 1` of them.
        let needed = offset.min(max_size - 1);
        if order.len() > offset || order.len() < needed {
            return fail(format!(
                "{} positions held after {offset} tokens in a window of {max_size}",
                order.len()
            ));
        }
        Ok(RingState {
            keys,
            values,
            offset,
            keep,
            max_size,
            order,
        })
    }

    /// Puts the positions into `ring` (of this state's window and keep). A ring that has
    /// dropped none holds positions `0..offset` in order. One that has dropped some holds, in
    /// order, positions `0..keep` and then the last ones seen: here, as the ring looks after a
    /// pass past its window, the first `keep` of them lie in the slots of the positions before
    /// the last ones (those the pass's first query no longer sees).
    fn restore_into(
        &self,
        layer: usize,
        ring: &mut RotatingKvCache,
    ) -> Result<(), CacheStateError> {
        let form = ring.mlx_form();
        let rows = |order: &[usize]| layer_rows(layer, self.keys, self.values, order, form);
        let held = self.order.len();
        let (k, v) = rows(&self.order)?;
        ring.restore(self.offset - held, &k, &v)?;
        if self.keep > 0 {
            let (k, v) = rows(&self.order[..self.keep.min(held)])?;
            ring.restore_kept(&k, &v, held < self.offset)?;
        }
        Ok(())
    }
}

fn restore_rotating(
    layer: usize,
    ring: &mut RotatingKvCache,
    state: &LayerState,
) -> Result<usize, CacheStateError> {
    if state.class == "KVCache" {
        return restore_rotating_from_kv(layer, ring, state);
    }
    if state.class != "RotatingKVCache" {
        return Err(CacheStateError::Class {
            layer,
            found: state.class.clone(),
            expected: "a RotatingKVCache",
        });
    }
    let window = ring.window();
    let mlx = RingState::read(layer, state, ring.shape(), None, |keep, max_size| {
        if keep != 0 {
            return Err(CacheStateError::Unsupported {
                layer,
                class: format!("RotatingKVCache with keep={keep}"),
                hint: " (a --max-kv-size cache) where this model's layer is a sliding window \
                       (is the prompt cache from another model?)",
            });
        }
        if max_size != window {
            return Err(invalid(
                layer,
                format!(
                    "a sliding window of {max_size} where this model's is {window} (is the \
                     prompt cache from another model?)"
                ),
            ));
        }
        Ok(())
    })?;
    mlx.restore_into(layer, ring)?;
    Ok(mlx.offset)
}

/// A layer that keeps all its positions, from the `RotatingKVCache(max_size, keep)` that
/// mlx-lm's `make_prompt_cache(model, max_kv_size)` makes of it (`--max-kv-size`): a ring of
/// `max_size` positions keeping the first `keep`, in the layer's precision and on its device,
/// and the tokens seen.
fn restore_bounded(
    layer: usize,
    kv: &KvCache,
    state: &LayerState,
) -> Result<(RotatingKvCache, usize), CacheStateError> {
    // A plain sliding window (`keep` 0): no model here keeps one for a layer that sees all
    // positions.
    if !matches!(state.get(layer, "3"), Ok(StateItem::Int(keep)) if *keep > 0) {
        return Err(CacheStateError::Class {
            layer,
            found: state.class.clone(),
            expected: "a KVCache",
        });
    }
    let form = kv.mlx_form();
    let mlx = RingState::read(layer, state, kv.shape(), None, |_, _| {
        if form.split.is_some() {
            return Err(invalid(
                layer,
                "a --max-kv-size RotatingKVCache where this model's layer keeps split rows \
                 (is the prompt cache from another model?)"
                    .into(),
            ));
        }
        Ok(())
    })?;
    let (kv_heads, head_dim) = kv.shape();
    let device = kv.rings().device();
    let ring = RotatingKvCache::keeping(kv_heads, head_dim, mlx.max_size, mlx.keep, &device)?;
    let mut ring = ring.with_precision(kv.precision())?.with_mlx_form(form);
    mlx.restore_into(layer, &mut ring)?;
    Ok((ring, mlx.offset))
}

/// A sliding-window layer from a whole `KVCache`, which mlx-lm keeps where a model does not make
/// its own caches (Ministral 3 in the `mistral3` wrapper attends through a window over one): the
/// last `window` positions of it, all the ring needs.
fn restore_rotating_from_kv(
    layer: usize,
    ring: &mut RotatingKvCache,
    state: &LayerState,
) -> Result<usize, CacheStateError> {
    state.expect_paths(layer, &["0", "1", "2"])?;
    let (keys, values) = checked_kv(layer, state, ring.shape(), None)?;
    let offset = state.int(layer, "2")?;
    if offset > keys.shape[2] {
        return Err(invalid(
            layer,
            format!("offset {offset} past the {} positions held", keys.shape[2]),
        ));
    }
    let first = offset.saturating_sub(ring.window());
    let order: Vec<usize> = (first..offset).collect();
    let (k, v) = layer_rows(layer, keys, values, &order, ring.mlx_form())?;
    ring.restore(first, &k, &v)?;
    Ok(offset)
}

fn restore_arrays(
    layer: usize,
    r: &mut RecurrentCache,
    state: &LayerState,
) -> Result<(), CacheStateError> {
    if state.class != "ArraysCache" && state.class != "MambaCache" {
        return Err(CacheStateError::Class {
            layer,
            found: state.class.clone(),
            expected: "an ArraysCache",
        });
    }
    let delta = !r.state.is_empty();
    let paths: &[&str] = if delta {
        &["0.0", "0.1", "1", "2"]
    } else {
        &["0.0", "1", "2"]
    };
    state.expect_paths(layer, paths)?;
    for padding in ["1", "2"] {
        if !matches!(state.get(layer, padding)?, StateItem::None) {
            return Err(invalid(
                layer,
                "an ArraysCache of a batch (left_padding or lengths set)".into(),
            ));
        }
    }
    let restore = |path: &str, tensor: &mut oxlm_engine::Tensor| {
        let array = match state.get(layer, path)? {
            // Never written: mlx-lm starts it from zeros, as the fresh cache holds.
            StateItem::None => return Ok(()),
            _ => state.array(layer, path)?,
        };
        let want: Vec<usize> = [1].iter().chain(tensor.shape()).copied().collect();
        if array.shape != want {
            return Err(invalid(
                layer,
                format!(
                    "recurrent state `{path}` of shape {:?} where this model's layer keeps \
                     {want:?} (is the prompt cache from another model?)",
                    array.shape
                ),
            ));
        }
        let host = oxlm_engine::Tensor::new(tensor.shape().to_vec(), array.values(layer)?);
        *tensor = host.to_device(&tensor.device())?;
        Ok::<(), CacheStateError>(())
    };
    restore("0.0", &mut r.conv)?;
    if delta {
        restore("0.1", &mut r.state)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Slots of a ring after a prompt, as mlx-lm's `RotatingKVCache` leaves them (worked out by
    /// hand from `_update_concat` and `_update_in_place`).
    #[test]
    fn rings_are_laid_out_as_mlx_lm_lays_them_out() {
        // 27 tokens, window 8: 26 at once (all kept), then the last cuts to 8 and wraps.
        let ring = MlxRing::after_prompt(27, 8, 0);
        let want: Vec<Option<usize>> = [26, 19, 20, 21, 22, 23, 24, 25].map(Some).to_vec();
        assert_eq!((ring.slots, ring.offset, ring.idx), (want, 27, 1));
        // 5 tokens, window 8: 4 at once, then the last grows the ring to the window.
        let ring = MlxRing::after_prompt(5, 8, 0);
        let want = [0, 1, 2, 3, 4]
            .map(Some)
            .into_iter()
            .chain([None; 3])
            .collect::<Vec<_>>();
        assert_eq!((ring.slots, ring.idx), (want, 5));
        assert_eq!(
            MlxRing::after_prompt(5, 8, 0).temporal_order(),
            [0, 1, 2, 3, 4]
        );
        // One token: a step of slots (the window here), the first written.
        let ring = MlxRing::after_prompt(1, 600, 0);
        assert_eq!((ring.slots.len(), ring.idx), (256, 1));
        // Past one prefill step: the second chunk keeps the window - 1 positions before it.
        let ring = MlxRing::after_prompt(3000, 8, 0);
        assert_eq!(ring.slots.len(), 8);
        assert_eq!(ring.temporal_order().len(), 8);
        let order: Vec<_> = ring
            .temporal_order()
            .iter()
            .map(|&s| ring.slots[s])
            .collect();
        assert_eq!(order, (2992..3000).map(Some).collect::<Vec<_>>());
    }

    /// Rings that keep their first 4 positions (`--max-kv-size`), as mlx-lm's
    /// `RotatingKVCache(max_size, keep=4)` leaves them after a prompt (read from mlx-lm's own
    /// cache fed positions as keys).
    #[test]
    fn kept_rings_are_laid_out_as_mlx_lm_lays_them_out() {
        let slots = |ring: &MlxRing| -> Vec<Option<usize>> { ring.slots.clone() };
        // 44 tokens, window 16: 43 at once, then the last cuts to the kept 4 and the last 12
        // and wraps past the kept slots.
        let ring = MlxRing::after_prompt(44, 16, 4);
        let mut want: Vec<Option<usize>> = [0, 1, 2, 3, 43].map(Some).to_vec();
        want.extend((32..43).map(Some));
        assert_eq!((slots(&ring), ring.offset, ring.idx), (want, 44, 5));
        let order: Vec<_> = (ring.temporal_order().iter())
            .map(|&s| ring.slots[s].unwrap())
            .collect();
        assert_eq!(
            order,
            [0, 1, 2, 3].into_iter().chain(32..44).collect::<Vec<_>>()
        );
        // 17 tokens: 16 at once fill the window, the last overwrites position 4.
        let ring = MlxRing::after_prompt(17, 16, 4);
        let mut want: Vec<Option<usize>> = [0, 1, 2, 3, 16].map(Some).to_vec();
        want.extend((5..16).map(Some));
        assert_eq!((slots(&ring), ring.idx), (want, 5));
        // 44 tokens, window 48: all held, the ring grown to the window.
        let ring = MlxRing::after_prompt(44, 48, 4);
        let want: Vec<_> = (0..44).map(Some).chain([None; 4]).collect();
        assert_eq!((slots(&ring), ring.idx), (want, 44));
        // Past one prefill step: the second chunk keeps the first 4 and the window - 5 before
        // it; the last token wraps.
        let ring = MlxRing::after_prompt(2300, 8, 4);
        let want: Vec<_> = [0, 1, 2, 3, 2299, 2296, 2297, 2298].map(Some).to_vec();
        assert_eq!((slots(&ring), ring.idx), (want, 5));
    }

    /// The state a ring fed a prompt of `tokens` tokens saves, mlx-lm's `RotatingKVCache`'s
    /// layout (one head of one element).
    fn saved_state(ring: &RotatingKvCache, tokens: usize) -> LayerState<'static> {
        let mlx = MlxRing::after_prompt(tokens, ring.window(), ring.keep());
        let (keys, values) = ring.gather(&mlx.slots).unwrap();
        let array = |x: Vec<f32>| {
            let array = StateArray::from_f32(DType::F32, vec![1, 1, mlx.slots.len(), 1], &x);
            StateItem::Array(array)
        };
        let mut state = LayerState::new("RotatingKVCache");
        state.push("0", array(keys));
        state.push("1", array(values));
        for (path, n) in [("2", mlx.offset), ("3", mlx.keep), ("4", mlx.max_size)] {
            state.push(path, StateItem::Int(n as i64));
        }
        state.push("5", StateItem::Int(mlx.idx as i64));
        state
    }

    /// The keys a query at `q` sees through a ring's view (sorted).
    fn seen(ring: &RotatingKvCache, q: usize) -> Vec<f32> {
        let v = ring.view();
        let keys = v.keys.to_vec().unwrap();
        let from = v.start.max((q + 1).saturating_sub(v.window.unwrap()));
        let mut seen: Vec<f32> = (from..=q).map(|p| keys[p % v.capacity]).collect();
        seen.sort_by(f32::total_cmp);
        seen
    }

    /// A ring saved after a prompt and restored (a `--max-kv-size` ring into a layer that keeps
    /// all positions, a sliding window into its own) goes on as the ring saved: through chunks
    /// and single tokens, every query sees the same keys. (Checked against mlx-lm's own
    /// `RotatingKVCache` for windows of 5 to 300 and prompts of 1 to 4200 tokens.)
    #[test]
    fn restored_rings_go_on_as_the_rings_saved() {
        let device = oxlm_engine::Device::Cpu;
        let f32_kv = || {
            let kv = KvCache::new(1, 1, &device).unwrap();
            kv.with_precision(oxlm_engine::KvPrecision::F32).unwrap()
        };
        let cases = [
            (44, 16, 4),
            (17, 16, 4),
            (6, 5, 4),
            (10, 16, 4),
            (2300, 8, 4),
        ];
        let cases = cases
            .into_iter()
            .chain([(27, 8, 0), (3000, 8, 0), (5, 8, 0)]);
        for (tokens, window, keep) in cases {
            let mut saved = fed_ring(tokens, window, keep);
            let state = saved_state(&saved, tokens);
            let mut restored = if keep == 0 {
                let ring = RotatingKvCache::new(1, 1, window, &device).unwrap();
                let mut ring = ring.with_precision(oxlm_engine::KvPrecision::F32).unwrap();
                assert_eq!(restore_rotating(0, &mut ring, &state).unwrap(), tokens);
                ring
            } else {
                let (ring, offset) = restore_bounded(0, &f32_kv(), &state).unwrap();
                assert_eq!((offset, ring.keep(), ring.window()), (tokens, keep, window));
                ring
            };
            let mut first = tokens;
            for n in [1, 7, 1, 1, 3, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 20, 1, 1] {
                let x: Vec<f32> = (first..first + n).map(|p| p as f32 + 1.0).collect();
                let x = oxlm_engine::Tensor::new(vec![n, 1], x);
                let at = oxlm_engine::Positions::following(first, n, &device).unwrap();
                saved.append(&x, &x, &at).unwrap();
                restored.append(&x, &x, &at).unwrap();
                for q in first..first + n {
                    let case = format!("{tokens} tokens, window {window}, keep {keep}: {q}");
                    assert_eq!(seen(&restored, q), seen(&saved, q), "{case}");
                }
                first += n;
            }
        }
    }

    /// A ring of one head of one element, fed a prompt of `tokens` tokens as `generate_step`
    /// feeds it (chunks of 2048, the last token alone), each key and value its position + 1.
    fn fed_ring(tokens: usize, window: usize, keep: usize) -> RotatingKvCache {
        use oxlm_engine::{Device, Positions, Tensor};
        let device = Device::Cpu;
        let mut ring = RotatingKvCache::keeping(1, 1, window, keep, &device).unwrap();
        ring = ring.with_precision(oxlm_engine::KvPrecision::F32).unwrap();
        let mut first = 0;
        for n in mlx_prompt_updates(tokens) {
            let x: Vec<f32> = (first..first + n).map(|p| p as f32 + 1.0).collect();
            let x = Tensor::new(vec![n, 1], x);
            let at = Positions::following(first, n, &device).unwrap();
            ring.append(&x, &x, &at).unwrap();
            first += n;
        }
        ring
    }

    /// The ring here, fed as mlx-lm's is, holds every position mlx-lm's slots hold, the kept
    /// ones among them.
    #[test]
    fn kept_rings_hold_what_mlx_lm_saves() {
        for (tokens, window) in [(44, 16), (17, 16), (10, 16), (44, 48), (2300, 8)] {
            let mlx = MlxRing::after_prompt(tokens, window, 4);
            let ring = fed_ring(tokens, window, 4);
            let (keys, values) = ring.gather(&mlx.slots).unwrap();
            let held: Vec<Option<usize>> = keys
                .iter()
                .map(|&k| (k > 0.0).then(|| k as usize - 1))
                .collect();
            assert_eq!(
                (held, keys),
                (mlx.slots, values),
                "{tokens} tokens, window {window}"
            );
        }
    }

    #[test]
    fn kv_capacities_follow_mlx_lm_growth() {
        assert_eq!(mlx_kv_capacity(1), 256);
        assert_eq!(mlx_kv_capacity(44), 256);
        assert_eq!(mlx_kv_capacity(257), 512);
        // 2048 at once, then 951 (past 2048: 4 more steps), then 1.
        assert_eq!(mlx_kv_capacity(3000), 3072);
        // 2048, then 1 (2049 > 2048: one more step).
        assert_eq!(mlx_kv_capacity(2049), 2304);
        // 2048, 2048, then 1: 4096 + 256.
        assert_eq!(mlx_kv_capacity(4097), 4352);
    }
}
