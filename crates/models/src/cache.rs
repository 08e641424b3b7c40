//! Per-layer state carried between forward passes.

use std::borrow::Cow;
use std::ops::Range;

use oxlm_engine::cpu::attention::{kv_move, QuantRows};
use oxlm_engine::ops::{self, KvView};
use oxlm_engine::{
    Device, EngineError, KvPrecision, KvQuant, KvRing, Positions, QuantRing, Tensor,
};

pub use crate::footprint::{CacheFootprint, LayerFootprint};
use crate::kv_quantization::KvQuantization;
pub use crate::recurrent_cache::RecurrentCache;
pub use crate::rotating_cache::RotatingKvCache;
use crate::TruncateError;

/// The first positions of a sequence that mlx-lm's `--max-kv-size` cache keeps beside its
/// window (`make_prompt_cache`'s `keep=4`).
pub const MAX_KV_SIZE_KEEP: usize = 4;

/// Keys and values grow in blocks of this many positions, as mlx-lm's `KVCache` does, so that
/// decoding does not reallocate per token.
const GROWTH_STEP: usize = 256;

/// A layer's keys and values: two rings of `[kv_heads, capacity, head_dim]`, of one precision
/// on one device. What the plain and the sliding-window caches hold alike; each keeps its own
/// capacity and positions.
#[derive(Debug, Clone)]
pub(crate) struct KvRings {
    keys: KvRing,
    values: KvRing,
}

impl KvRings {
    /// Empty rings on `device`, in the default precision.
    pub(crate) fn new(device: &Device) -> Result<Self, EngineError> {
        let ring = || KvRing::zeros(0, KvPrecision::default(), device);
        Ok(KvRings {
            keys: ring()?,
            values: ring()?,
        })
    }

    /// Bytes of keys and values of one slot: `kv_heads · head_dim` elements in each ring.
    pub(crate) fn slot_bytes(&self, (kv_heads, head_dim): (usize, usize)) -> usize {
        let row = kv_heads * head_dim;
        self.keys.bytes_for(row) + self.values.bytes_for(row)
    }

    /// Moves `positions` from rings of `from` slots into new ones of `capacity`, one ring at a
    /// time (the old one freed before the next is allocated).
    pub(crate) fn resize(
        &mut self,
        from: usize,
        capacity: usize,
        (kv_heads, head_dim): (usize, usize),
        positions: Range<usize>,
    ) -> Result<(), EngineError> {
        let (h, d) = (kv_heads, head_dim);
        let (precision, device) = (self.keys.precision(), self.keys.device());
        for buf in [&mut self.keys, &mut self.values] {
            let mut ring = KvRing::zeros(h * capacity * d, precision, &device)?;
            ops::kv_move(buf, from, &mut ring, capacity, h, d, positions.clone())?;
            *buf = ring;
        }
        Ok(())
    }

    /// Copies positions from `first` on of these rings, of `capacity` slots, into positions
    /// `positions` of `to`'s, of `to_capacity`.
    pub(crate) fn copy_into(
        &self,
        (capacity, first): (usize, usize),
        to: &mut KvRings,
        to_capacity: usize,
        (kv_heads, head_dim): (usize, usize),
        positions: Range<usize>,
    ) -> Result<(), EngineError> {
        let (c, h, d, p) = (capacity, kv_heads, head_dim, positions);
        ops::kv_copy(
            &self.keys,
            c,
            first,
            &mut to.keys,
            to_capacity,
            h,
            d,
            p.clone(),
        )?;
        ops::kv_copy(&self.values, c, first, &mut to.values, to_capacity, h, d, p)
    }

    /// Writes `[tokens, kv_heads · head_dim]` keys and values at `positions` of rings of
    /// `capacity` slots.
    pub(crate) fn write(
        &mut self,
        keys: &Tensor,
        values: &Tensor,
        (kv_heads, head_dim): (usize, usize),
        capacity: usize,
        positions: &Positions,
    ) -> Result<(), EngineError> {
        let rings = (&mut self.keys, &mut self.values);
        ops::kv_write(rings, keys, values, kv_heads, head_dim, capacity, positions)
    }

    /// The rings lent to an op that writes into them, of `capacity` slots.
    pub(crate) fn target(&mut self, capacity: usize) -> ops::KvTarget<'_> {
        ops::KvTarget {
            keys: &mut self.keys,
            values: &mut self.values,
            capacity,
        }
    }

    /// The rings as attention reads them: positions `held` of `capacity` slots.
    pub(crate) fn view(
        &self,
        kv_heads: usize,
        capacity: usize,
        held: Range<usize>,
        window: Option<usize>,
    ) -> KvView<'_> {
        KvView {
            keys: &self.keys,
            values: &self.values,
            kv_heads,
            capacity,
            start: held.start,
            end: held.end,
            window,
        }
    }

    pub(crate) fn size_in_bytes(&self) -> usize {
        self.keys.size_in_bytes() + self.values.size_in_bytes()
    }

    pub(crate) fn precision(&self) -> KvPrecision {
        self.keys.precision()
    }

    pub(crate) fn device(&self) -> Device {
        self.keys.device()
    }

    /// `[kv_heads, slots, head_dim]` keys and values read from rings of `capacity` slots: for
    /// each slot the position it names (in ring slot `p % capacity`), zeros where it names none.
    pub(crate) fn gather(
        &self,
        (kv_heads, head_dim): (usize, usize),
        capacity: usize,
        slots: &[Option<usize>],
    ) -> Result<(Vec<f32>, Vec<f32>), EngineError> {
        let (h, d, n) = (kv_heads, head_dim, slots.len());
        let pick = |ring: &KvRing| -> Result<Vec<f32>, EngineError> {
            let ring = ring.to_vec()?;
            let mut out = vec![0.0; h * n * d];
            for head in 0..h {
                for (s, p) in slots.iter().enumerate() {
                    if let Some(p) = p {
                        let from = (head * capacity + p % capacity) * d;
                        let to = (head * n + s) * d;
                        out[to..to + d].copy_from_slice(&ring[from..from + d]);
                    }
                }
            }
            Ok(out)
        };
        Ok((pick(&self.keys)?, pick(&self.values)?))
    }

    /// The codes of quantized rings on the host (copied from a GPU): keys', then values'.
    pub(crate) fn codes(&self) -> Result<Option<[Cow<'_, QuantRing>; 2]>, EngineError> {
        let (Some(keys), Some(values)) = (self.keys.host_codes()?, self.values.host_codes()?)
        else {
            return Ok(None);
        };
        Ok(Some([keys, values]))
    }

    /// New rings of `capacity` slots, on this device, holding `keys` and `values` (codes of
    /// `[kv_heads, n, head_dim]` elements, in `quant`) as positions `0..n`; rows past them are
    /// zeros.
    pub(crate) fn restore_codes(
        &mut self,
        (kv_heads, head_dim): (usize, usize),
        capacity: usize,
        quant: KvQuant,
        keys: QuantRows,
        values: QuantRows,
    ) -> Result<(), EngineError> {
        let (bytes, groups) = (quant.row_bytes(head_dim), head_dim / quant.group);
        let n = keys.scales.len() / (kv_heads * groups).max(1);
        // An array's `[kv_heads, n, width]` rows moved into a ring of `capacity` slots.
        fn slots<T: Copy + Default>(x: &[T], (h, n, capacity): Rows, width: usize) -> Vec<T> {
            let mut out = vec![T::default(); h * capacity * width];
            kv_move(x, n, &mut out, capacity, h, width, 0..n);
            out
        }
        type Rows = (usize, usize, usize);
        let at = (kv_heads, n, capacity);
        let device = self.keys.device();
        let ring = |rows: QuantRows| {
            let (codes, scales) = (slots(rows.codes, at, bytes), slots(rows.scales, at, groups));
            KvRing::from_codes(quant, codes, scales, slots(rows.biases, at, groups))?
                .to_device(&device)
        };
        self.keys = ring(keys)?;
        self.values = ring(values)?;
        Ok(())
    }

    /// New rings of `capacity` slots, in this precision on this device, holding `keys` and
    /// `values` (`[kv_heads, n, head_dim]`) as positions `first..first + n`.
    pub(crate) fn restore(
        &mut self,
        (kv_heads, head_dim): (usize, usize),
        capacity: usize,
        first: usize,
        keys: &[f32],
        values: &[f32],
    ) -> Result<(), EngineError> {
        let (precision, device) = (self.keys.precision(), self.keys.device());
        let (h, d) = (kv_heads, head_dim);
        self.keys = KvRing::zeros(h * capacity * d, precision, &device)?;
        self.values = KvRing::zeros(h * capacity * d, precision, &device)?;
        let n = keys.len() / (h * d).max(1);
        if n == 0 {
            return Ok(());
        }
        // The writes take `[tokens, kv_heads · head_dim]` rows.
        let rows = |x: &[f32]| -> Result<Tensor, EngineError> {
            let mut out = Vec::with_capacity(x.len());
            for t in 0..n {
                for head in 0..h {
                    let at = (head * n + t) * d;
                    out.extend_from_slice(&x[at..at + d]);
                }
            }
            Tensor::new(vec![n, h * d], out).to_device(&device)
        };
        let positions = Positions::following(first, n, &device)?;
        self.write(&rows(keys)?, &rows(values)?, (h, d), capacity, &positions)
    }

    /// The rings in `precision`, for heads of `head_dim` elements (refused where the precision
    /// cannot hold them).
    pub(crate) fn into_precision(
        self,
        precision: KvPrecision,
        head_dim: usize,
    ) -> Result<Self, EngineError> {
        if let KvPrecision::Quantized(quant) = precision {
            oxlm_engine::check_quantized_head_dim(quant, head_dim)?;
        }
        let keys = self.keys.into_precision(precision)?;
        Ok(KvRings {
            keys,
            values: self.values.into_precision(precision)?,
        })
    }

    pub(crate) fn try_clone(&self) -> Result<Self, EngineError> {
        Ok(KvRings {
            keys: self.keys.try_clone()?,
            values: self.values.try_clone()?,
        })
    }
}

/// How mlx-lm's cache of a layer holds its keys and values, where that differs from how the
/// layer's cache here holds them: for prompt cache files, which hold mlx-lm's (see
/// [`crate::cache_state`]). A layer that computes the same scores otherwise says so here.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MlxForm {
    /// mlx-lm's keys are these times this: a RoPE amplitude (YaRN's and LongRoPE's mscale) that
    /// mlx-lm leaves on the rotated keys and queries and this layer puts on the softmax scale.
    pub key_scale: f32,
    /// Rows held here as both keys and values (multi-head latent attention's
    /// `[latent, rotated key]`) that mlx-lm keeps as keys (the first `split` columns) and values
    /// (the rest).
    pub split: Option<usize>,
    /// mlx-lm keeps this ring as a `ChunkedKVCache` (Llama 4's chunked attention), which its
    /// prompt-cache files cannot hold.
    pub chunked: bool,
}

impl Default for MlxForm {
    fn default() -> Self {
        MlxForm {
            key_scale: 1.0,
            split: None,
            chunked: false,
        }
    }
}

/// The keys and values of one attention layer, `[kv_heads, capacity, head_dim]` each, on the
/// model's device.
#[derive(Debug, Clone)]
pub struct KvCache {
    kv_heads: usize,
    head_dim: usize,
    capacity: usize,
    len: usize,
    rings: KvRings,
    mlx: MlxForm,
}

impl KvCache {
    pub fn new(kv_heads: usize, head_dim: usize, device: &Device) -> Result<Self, EngineError> {
        Ok(KvCache {
            kv_heads,
            head_dim,
            capacity: 0,
            len: 0,
            rings: KvRings::new(device)?,
            mlx: MlxForm::default(),
        })
    }

    /// This cache, whose keys and values mlx-lm holds in `form`.
    pub fn with_mlx_form(self, form: MlxForm) -> Self {
        KvCache { mlx: form, ..self }
    }

    /// How mlx-lm holds this cache's keys and values.
    pub fn mlx_form(&self) -> MlxForm {
        self.mlx
    }

    pub(crate) fn rings(&self) -> &KvRings {
        &self.rings
    }

    /// Holds `keys` and `values` (`[kv_heads, len, head_dim]`) as positions `0..len`, in place
    /// of what it held (a prompt cache read from a file).
    pub(crate) fn restore(
        &mut self,
        len: usize,
        keys: &[f32],
        values: &[f32],
    ) -> Result<(), EngineError> {
        let capacity = len.div_ceil(GROWTH_STEP) * GROWTH_STEP;
        self.rings
            .restore(self.shape(), capacity, 0, keys, values)?;
        (self.capacity, self.len) = (capacity, len);
        Ok(())
    }

    /// [`restore`](Self::restore) from codes (`[kv_heads, len, head_dim]` elements in
    /// `quant`), kept as they are: the cache's keys and values are then quantized.
    pub(crate) fn restore_codes(
        &mut self,
        len: usize,
        quant: KvQuant,
        keys: QuantRows,
        values: QuantRows,
    ) -> Result<(), EngineError> {
        oxlm_engine::check_quantized_head_dim(quant, self.head_dim)?;
        let capacity = len.div_ceil(GROWTH_STEP) * GROWTH_STEP;
        self.rings
            .restore_codes(self.shape(), capacity, quant, keys, values)?;
        (self.capacity, self.len) = (capacity, len);
        Ok(())
    }

    /// Positions stored so far.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// `(kv_heads, head_dim)`, to check that a cache fits the layer it is handed to.
    pub fn shape(&self) -> (usize, usize) {
        (self.kv_heads, self.head_dim)
    }

    /// What this cache will hold as it grows.
    pub fn footprint(&self) -> LayerFootprint {
        LayerFootprint::Full {
            slot: self.rings.slot_bytes(self.shape()),
            step: GROWTH_STEP,
        }
    }

    fn grow_to(&mut self, needed: usize) -> Result<(), EngineError> {
        if needed <= self.capacity {
            return Ok(());
        }
        let capacity = needed.div_ceil(GROWTH_STEP) * GROWTH_STEP;
        self.rings
            .resize(self.capacity, capacity, self.shape(), 0..self.len)?;
        self.capacity = capacity;
        Ok(())
    }

    /// Appends `[tokens, kv_heads · head_dim]` keys and values of the tokens at `positions`,
    /// which follow the ones held.
    pub fn append(
        &mut self,
        keys: &Tensor,
        values: &Tensor,
        positions: &Positions,
    ) -> Result<(), EngineError> {
        let n = positions.len();
        check_follows(positions, self.len)?;
        self.grow_to(self.len + n)?;
        let shape = self.shape();
        self.rings
            .write(keys, values, shape, self.capacity, positions)?;
        self.len += n;
        Ok(())
    }

    /// Forgets all but the first `len` positions (a prompt cache reusing a shared prefix).
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }

    pub fn view(&self) -> KvView<'_> {
        self.rings
            .view(self.kv_heads, self.capacity, 0..self.len, None)
    }

    /// Bytes of device memory held.
    pub fn size_in_bytes(&self) -> usize {
        self.rings.size_in_bytes()
    }

    /// How the keys and values are kept.
    pub fn precision(&self) -> KvPrecision {
        self.rings.precision()
    }

    /// The same positions with their keys and values kept in `precision` (see
    /// [`KvRing::into_precision`]).
    pub fn with_precision(self, precision: KvPrecision) -> Result<Self, EngineError> {
        Ok(KvCache {
            rings: self.rings.into_precision(precision, self.head_dim)?,
            ..self
        })
    }

    pub fn try_clone(&self) -> Result<Self, EngineError> {
        Ok(KvCache {
            rings: self.rings.try_clone()?,
            ..*self
        })
    }
}

impl AttentionCache for KvCache {
    fn next_position(&self) -> usize {
        self.len
    }

    fn shape(&self) -> (usize, usize) {
        KvCache::shape(self)
    }

    fn append(
        &mut self,
        keys: &Tensor,
        values: &Tensor,
        positions: &Positions,
    ) -> Result<(), EngineError> {
        KvCache::append(self, keys, values, positions)
    }

    fn view(&self) -> KvView<'_> {
        KvCache::view(self)
    }

    fn reserve_next(&mut self) -> Result<ops::KvTarget<'_>, EngineError> {
        self.grow_to(self.len + 1)?;
        Ok(self.rings.target(self.capacity))
    }

    fn advance(&mut self) -> Result<(), EngineError> {
        self.len += 1;
        Ok(())
    }
}

/// What an attention layer keeps its keys and values in: a [`KvCache`], or a
/// [`RotatingKvCache`] for a sliding window. A forward pass appends one sequence's tokens to
/// one cache, or one token of each of several sequences to their caches together
/// ([`append_kv`]), and attends over them ([`attend_kv`]).
pub trait AttentionCache {
    /// The position of the next token: the number seen so far.
    fn next_position(&self) -> usize;

    /// `(kv_heads, head_dim)`, to check that a cache fits the layer it is handed to.
    fn shape(&self) -> (usize, usize);

    /// Appends `[tokens, kv_heads · head_dim]` keys and values of the tokens at `positions`,
    /// which follow the ones seen.
    fn append(
        &mut self,
        keys: &Tensor,
        values: &Tensor,
        positions: &Positions,
    ) -> Result<(), EngineError>;

    /// The positions a query can attend over.
    fn view(&self) -> KvView<'_>;

    /// Makes room for the one position after those seen and lends the rings to write it into;
    /// [`advance`](Self::advance) once it is written.
    fn reserve_next(&mut self) -> Result<ops::KvTarget<'_>, EngineError>;

    /// Counts the position written into the rings [`reserve_next`](Self::reserve_next) lent.
    fn advance(&mut self) -> Result<(), EngineError>;

    /// Appends the keys and values of the token at `positions` (one position, following the
    /// ones seen) that `write` puts into the rings it is lent, as one fused op does while
    /// computing them. `write` returns `None`, having written nothing, where it cannot; the
    /// cache then holds what it held.
    fn append_with<T>(
        &mut self,
        positions: &Positions,
        write: impl FnOnce(ops::KvTarget) -> Result<Option<T>, EngineError>,
    ) -> Result<Option<T>, EngineError>
    where
        Self: Sized,
    {
        check_follows(positions, self.next_position())?;
        if positions.len() != 1 {
            return Ok(None);
        }
        let written = write(self.reserve_next()?)?;
        if written.is_some() {
            self.advance()?;
        }
        Ok(written)
    }
}

/// Appends a forward pass's keys and values (`[tokens, kv_heads · head_dim]`): every row to the
/// one cache of `caches`; or (several caches, one token each) row `i`, at `positions[i]`, to
/// `caches[i]`, which it follows, in one write for all of them; or (several caches, runs of
/// equal length: [`PassCaches`](crate::pass::PassCaches)) run `i` to `caches[i]`.
pub fn append_kv<C: AttentionCache>(
    caches: &mut [&mut C],
    keys: &Tensor,
    values: &Tensor,
    positions: &Positions,
) -> Result<(), EngineError> {
    let (h, d) = match caches {
        [] => return Ok(()),
        [one] => return one.append(keys, values, positions),
        many if positions.len() != many.len() => {
            let per = run_length(positions.len(), many.len())?;
            let device = keys.device();
            let runs = positions.as_slice().chunks(per);
            for (i, (cache, run)) in many.iter_mut().zip(runs).enumerate() {
                let run_keys = ops::rows(keys, i * per, per)?;
                let run_values = ops::rows(values, i * per, per)?;
                cache.append(
                    &run_keys,
                    &run_values,
                    &Positions::new(run.to_vec(), &device)?,
                )?;
            }
            return Ok(());
        }
        [first, ..] => first.shape(),
    };
    for (i, cache) in caches.iter().enumerate() {
        if cache.shape() != (h, d) {
            return Err(EngineError::Shape(
                "a batch's caches differ in shape".into(),
            ));
        }
        check_next(positions.as_slice().get(i).copied(), cache.next_position())?;
    }
    let mut targets = caches
        .iter_mut()
        .map(|c| c.reserve_next())
        .collect::<Result<Vec<_>, _>>()?;
    let capacities: Vec<usize> = targets.iter().map(|t| t.capacity).collect();
    let (mut key_rings, mut value_rings): (Vec<_>, Vec<_>) = targets
        .iter_mut()
        .map(|t| (&mut *t.keys, &mut *t.values))
        .unzip();
    ops::kv_write_batch(
        &mut key_rings,
        &mut value_rings,
        &capacities,
        keys,
        values,
        h,
        d,
        positions,
    )?;
    for cache in caches.iter_mut() {
        cache.advance()?;
    }
    Ok(())
}

/// Attention of a forward pass's queries (`[tokens, heads · head_dim]`) at `positions` over
/// `caches`: all of them over the one cache; or (several caches, one token each) query `i`
/// over `caches[i]`; or (several caches, runs of equal length) run `i` over `caches[i]`.
/// With a `chunk` (Llama 4's chunked attention) a query at `p` sees only the positions from
/// `p - p % chunk` to its own: a view that starts there needs no mask of the engine's, and a
/// prompt that spans chunks attends one chunk's queries at a time.
pub fn attend_kv<C: AttentionCache>(
    q: &Tensor,
    heads: usize,
    head_dim: usize,
    positions: &Positions,
    caches: &[&mut C],
    options: ops::AttentionOptions,
    chunk: Option<usize>,
) -> Result<Tensor, EngineError> {
    let chunk = chunk.unwrap_or(usize::MAX);
    let at = positions.as_slice();
    if caches.len() > 1 && at.len() == caches.len() {
        let views: Vec<_> = caches
            .iter()
            .zip(at)
            .map(|(c, &p)| within(c.view(), p, chunk))
            .collect();
        return ops::attention_batch(q, heads, head_dim, positions, &views, options);
    }
    let per = run_length(at.len(), caches.len())?;
    // Each sequence's queries, split where a chunk of chunked attention starts, attend apart
    // into their rows of the output: (cache, first row, positions) of each part.
    let mut parts = Vec::new();
    for (i, cache) in caches.iter().enumerate() {
        let mut first = i * per;
        for span in at[first..first + per].chunk_by(|a, b| a / chunk == b / chunk) {
            parts.push((&**cache, first, span));
            first += span.len();
        }
    }
    if let [(cache, _, span)] = parts[..] {
        let view = within(cache.view(), span[0], chunk);
        return ops::attention(q, heads, head_dim, positions, &view, options);
    }
    let device = q.device();
    let mut out = Tensor::zeros(q.shape().to_vec(), &device)?;
    for (cache, first, span) in parts {
        let queries = ops::rows(q, first, span.len())?;
        let span_positions = Positions::new(span.to_vec(), &device)?;
        let view = within(cache.view(), span[0], chunk);
        let part = ops::attention(&queries, heads, head_dim, &span_positions, &view, options)?;
        let rows: Vec<usize> = (first..first + span.len()).collect();
        ops::scatter_add_rows(&mut out, &part, &rows, &vec![1.0; rows.len()])?;
    }
    Ok(out)
}

/// `view` as a query at `p` sees it under chunked attention: from the start of `p`'s chunk.
fn within(view: KvView<'_>, p: usize, chunk: usize) -> KvView<'_> {
    KvView {
        start: view.start.max(p - p % chunk),
        ..view
    }
}

/// The length of each run when `tokens` split into runs of equal length for `caches`.
fn run_length(tokens: usize, caches: usize) -> Result<usize, EngineError> {
    if tokens == 0 || caches == 0 || !tokens.is_multiple_of(caches) {
        return Err(EngineError::Shape(format!(
            "{tokens} positions do not split into runs for {caches} caches"
        )));
    }
    Ok(tokens / caches)
}

/// Refuses keys for `positions` that do not start at `next`, the position a cache expects.
pub(crate) fn check_follows(positions: &Positions, next: usize) -> Result<(), EngineError> {
    check_next(positions.as_slice().first().copied(), next)
}

/// Refuses keys whose first position is not `next`.
fn check_next(first: Option<usize>, next: usize) -> Result<(), EngineError> {
    match first {
        Some(p) if p == next => Ok(()),
        first => Err(EngineError::Shape(format!(
            "keys at {first:?} appended to a cache that holds positions up to {next}"
        ))),
    }
}

/// The state of one layer; each architecture picks the kind its layers need.
#[derive(Debug, Clone)]
pub enum LayerCache {
    Kv(KvCache),
    /// A sliding-window layer's ring of its last `window` positions.
    Rotating(RotatingKvCache),
    /// A recurrent layer's fixed-size state (no per-token history).
    Recurrent(RecurrentCache),
}

/// The state of a whole model for one sequence.
#[derive(Debug, Clone)]
pub struct Cache {
    pub layers: Vec<LayerCache>,
    /// Tokens processed so far; the position of the next token.
    pub offset: usize,
}

impl LayerCache {
    /// Bytes of device memory held.
    pub fn size_in_bytes(&self) -> usize {
        match self {
            LayerCache::Kv(kv) => kv.size_in_bytes(),
            LayerCache::Rotating(ring) => ring.size_in_bytes(),
            LayerCache::Recurrent(r) => r.size_in_bytes(),
        }
    }
}

impl Cache {
    pub fn new(layers: Vec<LayerCache>) -> Self {
        Cache { layers, offset: 0 }
    }

    /// A fresh cache from per-layer results, failing on the first layer that failed (device
    /// memory, for one).
    pub fn from_layers(
        layers: impl IntoIterator<Item = Result<LayerCache, EngineError>>,
    ) -> Result<Self, EngineError> {
        Ok(Cache::new(layers.into_iter().collect::<Result<_, _>>()?))
    }

    /// A copy, which fails rather than panics when device memory runs out (a prompt cache
    /// keeping a snapshot).
    pub fn try_clone(&self) -> Result<Cache, EngineError> {
        let layers = self
            .layers
            .iter()
            .map(|l| {
                Ok(match l {
                    LayerCache::Kv(kv) => LayerCache::Kv(kv.try_clone()?),
                    LayerCache::Rotating(ring) => LayerCache::Rotating(ring.try_clone()?),
                    LayerCache::Recurrent(r) => LayerCache::Recurrent(r.try_clone()?),
                })
            })
            .collect::<Result<_, EngineError>>()?;
        Ok(Cache {
            layers,
            offset: self.offset,
        })
    }

    /// mlx-lm's `make_prompt_cache(model, max_kv_size)` for a fresh cache of plain attention
    /// layers: each a ring of `max_kv_size` positions that also keeps the sequence's first
    /// [`MAX_KV_SIZE_KEEP`] (`RotatingKVCache(max_kv_size, keep=4)`). Refused for a cache that
    /// holds anything or has other kinds of layers (a sliding window, a recurrent state),
    /// which mlx-lm's models that build their own caches never give this.
    pub fn with_max_kv_size(self, max_kv_size: usize) -> Result<Cache, EngineError> {
        if self.offset > 0 || max_kv_size <= MAX_KV_SIZE_KEEP {
            return Err(EngineError::Unsupported(format!(
                "a bounded cache of {max_kv_size} positions from one that holds {}: it must \
                 be fresh and hold more than the {MAX_KV_SIZE_KEEP} it keeps",
                self.offset
            )));
        }
        let layers = (self.layers.into_iter())
            .map(|l| match l {
                LayerCache::Kv(kv) => {
                    let (h, d) = kv.shape();
                    let ring = RotatingKvCache::keeping(
                        h,
                        d,
                        max_kv_size,
                        MAX_KV_SIZE_KEEP,
                        &kv.rings.device(),
                    )?;
                    let ring = ring.with_precision(kv.precision())?;
                    Ok(LayerCache::Rotating(ring.with_mlx_form(kv.mlx_form())))
                }
                _ => Err(EngineError::Unsupported(
                    "a bounded cache (--max-kv-size) for a model with sliding-window or \
                     recurrent layers"
                        .into(),
                )),
            })
            .collect::<Result<_, _>>()?;
        Ok(Cache { layers, offset: 0 })
    }

    /// Whether a layer keeps the sequence's first positions beside its window
    /// ([`with_max_kv_size`](Self::with_max_kv_size)): its last prompt token then goes through
    /// alone, as mlx-lm's `generate_step` puts it, since it sees them where a chunk's last
    /// query would not.
    pub fn keeps_first_positions(&self) -> bool {
        (self.layers.iter())
            .any(|l| matches!(l, LayerCache::Rotating(r) if r.keeps_first_positions()))
    }

    /// This cache with its attention layers' keys and values kept in `precision`: f32 for the
    /// numbers of an f32 oracle, f16 (the default) for half the memory and bandwidth.
    /// Recurrent layers' states stay f32. Fails only when a GPU runs out of memory.
    pub fn with_kv_precision(self, precision: KvPrecision) -> Result<Cache, EngineError> {
        self.with_layer_precisions(|_| Some(precision))
    }

    /// This cache with the attention layers `quantization` names kept in their codes (see
    /// [`KvQuantization`]; layers already in them, and recurrent ones, as they are). Fails
    /// where a layer's heads are no whole number of groups, or a GPU runs out of memory.
    pub fn with_quantization(self, quantization: &KvQuantization) -> Result<Cache, EngineError> {
        self.with_layer_precisions(|i| quantization.layer(i).map(KvPrecision::Quantized))
    }

    /// This cache with attention layer `i`'s keys and values kept in `precision_of(i)`, where
    /// that says one.
    fn with_layer_precisions(
        self,
        precision_of: impl Fn(usize) -> Option<KvPrecision>,
    ) -> Result<Cache, EngineError> {
        let layers = self
            .layers
            .into_iter()
            .enumerate()
            .map(|(i, l)| {
                let Some(precision) = precision_of(i) else {
                    return Ok(l);
                };
                Ok(match l {
                    LayerCache::Kv(kv) => LayerCache::Kv(kv.with_precision(precision)?),
                    LayerCache::Rotating(ring) => {
                        LayerCache::Rotating(ring.with_precision(precision)?)
                    }
                    recurrent => recurrent,
                })
            })
            .collect::<Result<_, EngineError>>()?;
        Ok(Cache { layers, ..self })
    }

    /// mlx-lm's `maybe_quantize_kv_cache`, called after each forward pass: once this cache
    /// holds `quantization.start` tokens, the layers it names go to their codes (see
    /// [`with_quantization`](Self::with_quantization)); until then, and once they are there,
    /// nothing changes.
    pub fn quantize_when_due(&mut self, quantization: &KvQuantization) -> Result<(), EngineError> {
        let due = |(i, l): (usize, &LayerCache)| {
            let precision = match l {
                LayerCache::Kv(kv) => kv.precision(),
                LayerCache::Rotating(ring) => ring.precision(),
                LayerCache::Recurrent(_) => return false,
            };
            quantization
                .layer(i)
                .is_some_and(|quant| precision != KvPrecision::Quantized(quant))
        };
        if self.offset < quantization.start || !self.layers.iter().enumerate().any(due) {
            return Ok(());
        }
        let cache = std::mem::replace(self, Cache::new(Vec::new()));
        *self = cache.with_quantization(quantization)?;
        Ok(())
    }

    /// What each layer will hold as the sequence grows.
    pub fn footprint(&self) -> CacheFootprint {
        let layers = self.layers.iter().map(|layer| match layer {
            LayerCache::Kv(kv) => kv.footprint(),
            LayerCache::Rotating(ring) => ring.footprint(),
            LayerCache::Recurrent(r) => LayerFootprint::Fixed {
                bytes: r.size_in_bytes(),
            },
        });
        CacheFootprint {
            layers: layers.collect(),
        }
    }

    /// Bytes of device memory held by all layers.
    pub fn size_in_bytes(&self) -> usize {
        self.layers.iter().map(LayerCache::size_in_bytes).sum()
    }

    /// Keeps the first `len` tokens (a prompt cache reusing a shared prefix).
    ///
    /// Recurrent layers keep no per-token history, and sliding-window layers only their last
    /// positions, so going back past what they hold is refused and the cache is left as it was. A prompt cache over such a model keeps
    /// snapshots instead: `Cache` is `Clone`, so clone it at the prefix to resume from.
    pub fn truncate(&mut self, len: usize) -> Result<(), TruncateError> {
        if len >= self.offset {
            return Ok(());
        }
        // A sliding window holds only its last positions; going back inside it is fine.
        let lost = |l: &LayerCache| match l {
            LayerCache::Kv(_) => false,
            LayerCache::Rotating(ring) => !ring.can_truncate(len),
            LayerCache::Recurrent(_) => true,
        };
        if let Some(layer) = self.layers.iter().position(lost) {
            return Err(TruncateError {
                layer,
                offset: self.offset,
                len,
            });
        }
        for layer in &mut self.layers {
            match layer {
                LayerCache::Kv(kv) => kv.truncate(len),
                LayerCache::Rotating(ring) => ring.truncate(len),
                LayerCache::Recurrent(_) => {} // refused above
            }
        }
        self.offset = len;
        Ok(())
    }

    /// Sizes every attention layer's rings for the next token now, so that the decoding step
    /// that writes it allocates and moves nothing. On a GPU, a step that grew a cache could not
    /// be replayed from its recording (nor the next, captured again); made room for beforehand,
    /// a batch's step still replays, since it reads the rings' addresses from a table uploaded
    /// each step. Sequences of a batch outgrow their caches at different steps: 64 of them
    /// would otherwise break a replay every four steps.
    pub fn make_room_for_next(&mut self) -> Result<(), EngineError> {
        for layer in &mut self.layers {
            match layer {
                LayerCache::Kv(kv) => _ = kv.reserve_next()?,
                LayerCache::Rotating(ring) => _ = ring.reserve_next()?,
                LayerCache::Recurrent(_) => {}
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn growth_keeps_earlier_positions_per_head() {
        let mut cache = KvCache::new(2, 1, &Device::Cpu).unwrap();
        for p in 0..300 {
            let t = p as f32;
            let k = Tensor::new(vec![1, 2], vec![t, -t]);
            let v = Tensor::new(vec![1, 2], vec![t + 0.5, -t - 0.5]);
            let at = Positions::following(p, 1, &Device::Cpu).unwrap();
            cache.append(&k, &v, &at).unwrap();
        }
        let v = cache.view();
        assert_eq!((v.end, v.capacity), (300, 512));
        let (keys, values) = (v.keys.to_vec().unwrap(), v.values.to_vec().unwrap());
        assert_eq!(keys[299], 299.0);
        assert_eq!(keys[512 + 299], -299.0);
        assert_eq!(values[512 + 7], -7.5);
    }

    /// Room made for the next token beforehand leaves its append nothing to resize, in a
    /// plain cache about to pass its capacity and in a sliding window after a prompt wider
    /// than it.
    #[test]
    fn room_for_the_next_token_is_made_before_its_append() {
        let device = Device::Cpu;
        let rows = |n: usize| Tensor::new(vec![n, 2], (0..2 * n).map(|x| x as f32).collect());
        let mut cache = Cache::new(vec![
            LayerCache::Kv(KvCache::new(2, 1, &device).unwrap()),
            LayerCache::Rotating(RotatingKvCache::new(2, 1, 8, &device).unwrap()),
        ]);
        let capacities = |cache: &Cache| -> Vec<usize> {
            cache
                .layers
                .iter()
                .map(|l| match l {
                    LayerCache::Kv(kv) => kv.view().capacity,
                    LayerCache::Rotating(ring) => ring.view().capacity,
                    LayerCache::Recurrent(_) => unreachable!(),
                })
                .collect()
        };
        let append = |cache: &mut Cache, n: usize| {
            let at = Positions::following(cache.offset, n, &device).unwrap();
            for layer in &mut cache.layers {
                match layer {
                    LayerCache::Kv(kv) => kv.append(&rows(n), &rows(n), &at).unwrap(),
                    LayerCache::Rotating(ring) => ring.append(&rows(n), &rows(n), &at).unwrap(),
                    LayerCache::Recurrent(_) => unreachable!(),
                }
            }
            cache.offset += n;
        };
        append(&mut cache, 256);
        assert_eq!(capacities(&cache), [256, 256]);
        cache.make_room_for_next().unwrap();
        assert_eq!(capacities(&cache), [512, 8]);
        append(&mut cache, 1);
        assert_eq!(capacities(&cache), [512, 8]);
    }
}
