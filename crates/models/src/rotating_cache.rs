//! The key/value cache of a sliding-window attention layer: a ring that keeps only the positions
//! a query can still see, as mlx-lm's `RotatingKVCache` does; with `keep` (`--max-kv-size`), one
//! that also keeps the sequence's first positions.

use oxlm_engine::ops::{KvTarget, KvView};
use oxlm_engine::{Device, EngineError, KvPrecision, Positions, Tensor};

use crate::cache::{AttentionCache, KvRings, LayerFootprint, MlxForm};

/// Until the window fills, the ring grows in blocks of this many positions (as mlx-lm's
/// `RotatingKVCache.step`), so that a short sequence does not reserve a whole window.
const GROWTH_STEP: usize = 256;

/// Keys and values of one sliding-window layer, `[kv_heads, capacity, head_dim]` each, position
/// `p` in slot `p % capacity`.
///
/// Decoding needs `window` slots. A chunk of `n` tokens needs `window - 1 + n`, so that its first
/// token still sees the `window - 1` positions before it while the last ones are written; the
/// ring widens for such a chunk and narrows again on the next single token, as mlx-lm's cache
/// grows to `max_size + S - 1` for a prefill and is trimmed back when decoding starts. Before the
/// window has filled, positions never wrap and the ring only grows.
#[derive(Debug, Clone)]
pub struct RotatingKvCache {
    kv_heads: usize,
    head_dim: usize,
    window: usize,
    capacity: usize,
    /// Positions `start..end` are held.
    start: usize,
    end: usize,
    rings: KvRings,
    mlx: MlxForm,
    /// Boxed: most rings keep none.
    kept: Option<Box<Kept>>,
}

/// The first positions of a sequence that a ring with `keep` holds beside its window.
///
/// mlx-lm's `RotatingKVCache(max_size, keep)` keeps them in its array's first slots, where the
/// positions that leave the window would go, so that once the sequence is longer than the
/// window a query sees them in place of the oldest `keep` positions of its window: one token
/// sees the first `keep` positions and the last `window - keep` (its own among them); the
/// queries of a chunk that starts past the window see them in place of the oldest `keep`
/// positions of the first query's window, so that query `i` of the chunk sees the kept ones
/// from the `i`-th on (its window slides past the others, as mlx-lm's mask over its array
/// does). Here they are copied, in order, into the ring's slots of those positions before each
/// pass.
#[derive(Debug, Clone)]
struct Kept {
    count: usize,
    /// Positions `0..count`, in slots of their own.
    rings: KvRings,
    /// The first position of the pass whose window they were last copied into.
    placed_for: Option<usize>,
}

impl RotatingKvCache {
    /// A cache for a layer whose queries see `window` positions, their own included.
    pub fn new(
        kv_heads: usize,
        head_dim: usize,
        window: usize,
        device: &Device,
    ) -> Result<Self, EngineError> {
        Ok(RotatingKvCache {
            kv_heads,
            head_dim,
            window: window.max(1),
            capacity: 0,
            start: 0,
            end: 0,
            rings: KvRings::new(device)?,
            mlx: MlxForm::default(),
            kept: None,
        })
    }

    /// A ring of `window` positions that also keeps the sequence's first `keep` (`keep` less
    /// than `window`): mlx-lm's `RotatingKVCache(window, keep)`, which `--max-kv-size` makes
    /// (see [`Kept`]).
    pub fn keeping(
        kv_heads: usize,
        head_dim: usize,
        window: usize,
        keep: usize,
        device: &Device,
    ) -> Result<Self, EngineError> {
        let cache = Self::new(kv_heads, head_dim, window, device)?;
        if keep == 0 {
            return Ok(cache);
        }
        if keep >= cache.window {
            return Err(EngineError::Shape(format!(
                "a ring of {window} positions cannot keep its first {keep}"
            )));
        }
        let mut rings = KvRings::new(device)?;
        rings.resize(0, keep, (kv_heads, head_dim), 0..0)?;
        let kept = Kept {
            count: keep,
            rings,
            placed_for: None,
        };
        Ok(RotatingKvCache {
            kept: Some(Box::new(kept)),
            ..cache
        })
    }

    /// Whether it keeps the sequence's first positions beside its window.
    pub fn keeps_first_positions(&self) -> bool {
        self.kept.is_some()
    }

    /// How many of the sequence's first positions it keeps beside its window (mlx-lm's
    /// `keep`): 0 for a plain sliding window.
    pub fn keep(&self) -> usize {
        self.kept.as_ref().map_or(0, |k| k.count)
    }

    /// Before a pass from position `first`: the kept positions go into the slots of the oldest
    /// of its first query's window, once the sequence is longer than the window (see [`Kept`]).
    fn place_kept(&mut self, first: usize) -> Result<(), EngineError> {
        let shape = self.shape();
        let Some(kept) = &mut self.kept else {
            return Ok(());
        };
        if first < self.window || kept.placed_for == Some(first) {
            return Ok(());
        }
        // In order: a chunk's later queries see the last kept ones only.
        let oldest = first + 1 - self.window;
        let slots = oldest..oldest + kept.count;
        let from = (kept.count, 0);
        (kept.rings).copy_into(from, &mut self.rings, self.capacity, shape, slots)?;
        kept.placed_for = Some(first);
        Ok(())
    }

    /// After positions `written` went into the ring: those among the first to keep are copied
    /// aside.
    fn keep_first(&mut self, written: std::ops::Range<usize>) -> Result<(), EngineError> {
        let shape = self.shape();
        let Some(kept) = &mut self.kept else {
            return Ok(());
        };
        let first = written.start..written.end.min(kept.count);
        if first.is_empty() {
            return Ok(());
        }
        let from = (self.capacity, first.start);
        (self.rings).copy_into(from, &mut kept.rings, kept.count, shape, first)
    }

    /// This cache, whose keys and values mlx-lm holds in `form`.
    pub fn with_mlx_form(self, form: MlxForm) -> Self {
        RotatingKvCache { mlx: form, ..self }
    }

    /// How mlx-lm holds this cache's keys and values.
    pub fn mlx_form(&self) -> MlxForm {
        self.mlx
    }

    /// Positions seen so far (not all of them are still held).
    pub fn len(&self) -> usize {
        self.end
    }

    pub fn is_empty(&self) -> bool {
        self.end == 0
    }

    pub fn window(&self) -> usize {
        self.window
    }

    /// `(kv_heads, head_dim)`, to check that a cache fits the layer it is handed to.
    pub fn shape(&self) -> (usize, usize) {
        (self.kv_heads, self.head_dim)
    }

    /// What this cache will hold as it grows.
    pub fn footprint(&self) -> LayerFootprint {
        LayerFootprint::Window {
            slot: self.rings.slot_bytes(self.shape()),
            window: self.window,
            step: GROWTH_STEP,
            chunked: self.mlx.chunked,
        }
    }

    /// Moves the positions still needed into a ring of `capacity` slots.
    fn resize(&mut self, capacity: usize) -> Result<(), EngineError> {
        let keep_from = self.start.max(self.end.saturating_sub(self.window - 1));
        let shape = self.shape();
        self.rings
            .resize(self.capacity, capacity, shape, keep_from..self.end)?;
        self.capacity = capacity;
        self.start = keep_from;
        Ok(())
    }

    /// Sizes the ring for `n` more positions: one window for a single token, wider for a chunk.
    fn make_room(&mut self, n: usize) -> Result<(), EngineError> {
        let full = self.window - 1 + n.max(1);
        let capacity = full.min((self.end + n).div_ceil(GROWTH_STEP) * GROWTH_STEP);
        if capacity != self.capacity {
            self.resize(capacity)?;
        }
        Ok(())
    }

    /// Counts `n` positions written; those that left the ring are no longer held.
    fn advance_by(&mut self, n: usize) {
        self.end += n;
        self.start = self.start.max(self.end.saturating_sub(self.capacity));
    }

    /// Appends `[tokens, kv_heads · head_dim]` keys and values of the tokens at `positions`,
    /// which follow the ones seen.
    pub fn append(
        &mut self,
        keys: &Tensor,
        values: &Tensor,
        positions: &Positions,
    ) -> Result<(), EngineError> {
        let n = positions.len();
        crate::cache::check_follows(positions, self.end)?;
        self.make_room(n)?;
        let first = self.end;
        self.place_kept(first)?;
        let shape = self.shape();
        self.rings
            .write(keys, values, shape, self.capacity, positions)?;
        self.advance_by(n);
        self.keep_first(first..first + n)
    }

    /// Whether [`truncate`](Self::truncate)`(len)` leaves every position the next token would
    /// see: false once the ring has overwritten part of that window, or has put kept positions
    /// in slots of its own.
    pub fn can_truncate(&self, len: usize) -> bool {
        let placed = self.kept.as_ref().is_some_and(|k| k.placed_for.is_some());
        len >= self.end || (!placed && self.start <= (len + 1).saturating_sub(self.window))
    }

    /// Forgets positions from `len` on (a prompt cache reusing a shared prefix). Positions that
    /// had already left the ring do not come back; see [`can_truncate`](Self::can_truncate).
    pub fn truncate(&mut self, len: usize) {
        self.end = self.end.min(len);
        self.start = self.start.min(self.end);
    }

    pub fn view(&self) -> KvView<'_> {
        let held = self.start..self.end;
        self.rings
            .view(self.kv_heads, self.capacity, held, Some(self.window))
    }

    /// Whether the keys and values of position `p` are still held: one of the first positions
    /// it keeps, or one in the ring that neither left it nor lies where the kept ones were
    /// last put (see [`Kept`]).
    pub(crate) fn holds(&self, p: usize) -> bool {
        if p >= self.end {
            return false;
        }
        let Some(kept) = &self.kept else {
            return p >= self.start;
        };
        if p < kept.count {
            return true;
        }
        // Positions before the oldest of the last placement's window (and the ones it covered)
        // may lie under kept positions.
        let clear_from = kept
            .placed_for
            .map_or(0, |first| first + 1 - self.window + kept.count);
        p >= self.start && p >= clear_from
    }

    /// `[kv_heads, slots, head_dim]` keys and values as f32: for each slot the position it
    /// names, read from the ring or (one of the first positions it keeps) from where those are
    /// kept; zeros where it names none. Every position named must be
    /// [held](Self::holds).
    pub(crate) fn gather(
        &self,
        slots: &[Option<usize>],
    ) -> Result<(Vec<f32>, Vec<f32>), EngineError> {
        if let Some(p) = slots.iter().flatten().find(|&&p| !self.holds(p)) {
            return Err(EngineError::Shape(format!(
                "position {p} is no longer held by the ring"
            )));
        }
        let shape = self.shape();
        let Some(kept) = &self.kept else {
            return self.rings.gather(shape, self.capacity, slots);
        };
        let count = kept.count;
        let from_ring: Vec<_> = slots.iter().map(|s| s.filter(|&p| p >= count)).collect();
        let from_kept: Vec<_> = slots.iter().map(|s| s.filter(|&p| p < count)).collect();
        let (mut keys, mut values) = self.rings.gather(shape, self.capacity, &from_ring)?;
        let (kept_keys, kept_values) = kept.rings.gather(shape, count, &from_kept)?;
        let d = self.head_dim;
        for head in 0..self.kv_heads {
            for (s, p) in from_kept.iter().enumerate() {
                if p.is_some() {
                    let at = (head * slots.len() + s) * d;
                    keys[at..at + d].copy_from_slice(&kept_keys[at..at + d]);
                    values[at..at + d].copy_from_slice(&kept_values[at..at + d]);
                }
            }
        }
        Ok((keys, values))
    }

    /// Holds `keys` and `values` (`[kv_heads, n, head_dim]`) as positions `first..first + n`,
    /// the last ones seen, in place of what it held (a prompt cache read from a file). The ring
    /// is as wide as what it holds; the next append sizes it as usual. A ring that keeps the
    /// first positions is then given them with [`restore_kept`](Self::restore_kept).
    pub(crate) fn restore(
        &mut self,
        first: usize,
        keys: &[f32],
        values: &[f32],
    ) -> Result<(), EngineError> {
        let n = keys.len() / (self.kv_heads * self.head_dim).max(1);
        let shape = self.shape();
        self.rings.restore(shape, n, first, keys, values)?;
        (self.capacity, self.start, self.end) = (n, first, first + n);
        if let Some(kept) = &mut self.kept {
            // Not yet put into the ring's slots: the next pass past the window puts them.
            kept.placed_for = None;
        }
        Ok(())
    }

    /// Holds `keys` and `values` (`[kv_heads, m, head_dim]`) as the first `m` positions it
    /// keeps (all of them, or fewer where the sequence is shorter), after
    /// [`restore`](Self::restore). `placed`: the ring's oldest slots already hold them, as a
    /// pass past the window leaves them (see [`Kept`]).
    pub(crate) fn restore_kept(
        &mut self,
        keys: &[f32],
        values: &[f32],
        placed: bool,
    ) -> Result<(), EngineError> {
        let (shape, placed_for) = (self.shape(), self.start + self.window - 1);
        let Some(kept) = &mut self.kept else {
            return Err(EngineError::Shape(
                "first positions restored into a ring that keeps none".into(),
            ));
        };
        let m = keys.len() / (shape.0 * shape.1).max(1);
        if m > kept.count || m > self.end {
            return Err(EngineError::Shape(format!(
                "{m} first positions restored into a ring that keeps {} of {}",
                kept.count, self.end
            )));
        }
        kept.rings.restore(shape, kept.count, 0, keys, values)?;
        kept.placed_for = placed.then_some(placed_for);
        Ok(())
    }

    /// Bytes of device memory held.
    pub fn size_in_bytes(&self) -> usize {
        let kept = self.kept.as_ref().map_or(0, |k| k.rings.size_in_bytes());
        self.rings.size_in_bytes() + kept
    }

    /// How the keys and values are kept.
    pub fn precision(&self) -> KvPrecision {
        self.rings.precision()
    }

    /// The same positions with their keys and values kept in `precision` (see
    /// [`oxlm_engine::KvRing::into_precision`]).
    pub fn with_precision(self, precision: KvPrecision) -> Result<Self, EngineError> {
        let kept = match self.kept {
            Some(kept) => Some(Box::new(Kept {
                rings: kept.rings.into_precision(precision, self.head_dim)?,
                ..*kept
            })),
            None => None,
        };
        Ok(RotatingKvCache {
            rings: self.rings.into_precision(precision, self.head_dim)?,
            kept,
            ..self
        })
    }

    pub fn try_clone(&self) -> Result<Self, EngineError> {
        let kept = match &self.kept {
            Some(kept) => Some(Box::new(Kept {
                rings: kept.rings.try_clone()?,
                ..**kept
            })),
            None => None,
        };
        Ok(RotatingKvCache {
            rings: self.rings.try_clone()?,
            kept,
            ..*self
        })
    }
}

impl AttentionCache for RotatingKvCache {
    fn next_position(&self) -> usize {
        self.end
    }

    fn shape(&self) -> (usize, usize) {
        RotatingKvCache::shape(self)
    }

    fn append(
        &mut self,
        keys: &Tensor,
        values: &Tensor,
        positions: &Positions,
    ) -> Result<(), EngineError> {
        RotatingKvCache::append(self, keys, values, positions)
    }

    fn view(&self) -> KvView<'_> {
        RotatingKvCache::view(self)
    }

    fn reserve_next(&mut self) -> Result<KvTarget<'_>, EngineError> {
        self.make_room(1)?;
        self.place_kept(self.end)?;
        Ok(self.rings.target(self.capacity))
    }

    fn advance(&mut self) -> Result<(), EngineError> {
        self.advance_by(1);
        self.keep_first(self.end - 1..self.end)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The positions a ring holds, read back through its slots (one head, head_dim 1, key = position).
    fn held(cache: &RotatingKvCache) -> Vec<f32> {
        let v = cache.view();
        let keys = v.keys.to_vec().unwrap();
        (v.start..v.end).map(|p| keys[p % v.capacity]).collect()
    }

    fn push(cache: &mut RotatingKvCache, positions: std::ops::Range<usize>) {
        let at = Positions::new(positions.clone().collect(), &Device::Cpu).unwrap();
        let k: Vec<f32> = positions.map(|p| p as f32).collect();
        let k = Tensor::new(vec![k.len(), 1], k);
        cache.append(&k, &k, &at).unwrap();
    }

    fn ring(window: usize) -> RotatingKvCache {
        RotatingKvCache::new(1, 1, window, &Device::Cpu).unwrap()
    }

    #[test]
    fn long_prefill_keeps_every_window_then_narrows_for_decoding() {
        let mut cache = ring(4);
        push(&mut cache, 0..10);
        // 10 tokens at once: the first of them needs 3 earlier positions, none exist yet.
        assert_eq!(held(&cache), (0..10).map(|p| p as f32).collect::<Vec<_>>());
        push(&mut cache, 10..11);
        assert_eq!(cache.view().capacity, 4);
        assert_eq!(held(&cache), vec![7.0, 8.0, 9.0, 10.0]);
        for p in 11..15 {
            push(&mut cache, p..p + 1);
        }
        assert_eq!(held(&cache), vec![11.0, 12.0, 13.0, 14.0]);
        // A second chunk sees the 3 positions before it.
        push(&mut cache, 15..18);
        assert_eq!(held(&cache), vec![12.0, 13.0, 14.0, 15.0, 16.0, 17.0]);
        assert_eq!(cache.len(), 18);
    }

    #[test]
    fn a_wide_window_grows_in_steps_until_full() {
        let mut cache = ring(600);
        for p in 0..300 {
            push(&mut cache, p..p + 1);
        }
        assert_eq!(cache.view().capacity, 512);
        assert_eq!(held(&cache), (0..300).map(|p| p as f32).collect::<Vec<_>>());
        push(&mut cache, 300..650);
        for p in 650..700 {
            push(&mut cache, p..p + 1);
        }
        assert_eq!(cache.view().capacity, 600);
        assert_eq!(
            held(&cache),
            (100..700).map(|p| p as f32).collect::<Vec<_>>()
        );
    }

    /// What a query at `q` reads through the view: each position it sees, the key in that
    /// position's slot (sorted).
    fn seen(cache: &RotatingKvCache, q: usize) -> Vec<f32> {
        let v = cache.view();
        let keys = v.keys.to_vec().unwrap();
        let from = v.start.max((q + 1).saturating_sub(v.window.unwrap()));
        let mut seen: Vec<f32> = (from..=q.min(v.end - 1))
            .map(|p| keys[p % v.capacity])
            .collect();
        seen.sort_by(f32::total_cmp);
        seen
    }

    fn floats(r: std::ops::Range<usize>) -> Vec<f32> {
        r.map(|p| p as f32).collect()
    }

    /// A ring of 16 keeping 4, fed in chunks of 7 then a token at a time: a token sees the
    /// first 4 positions and the last 12; a chunk's query `i` sees the kept ones from the
    /// `i`-th on in place of its window's oldest, as mlx-lm's `RotatingKVCache(16, keep=4)`.
    #[test]
    fn a_ring_that_keeps_the_first_positions() {
        let mut cache = RotatingKvCache::keeping(1, 1, 16, 4, &Device::Cpu).unwrap();
        for first in (0..42).step_by(7) {
            push(&mut cache, first..first + 7);
            if first == 21 {
                // The chunk 21..28: query 21 sees kept 0..3 and 10..21, query 23 kept 2..3.
                let mut want = floats(0..4);
                want.extend(floats(10..22));
                assert_eq!(seen(&cache, 21), want);
                let mut want = floats(2..4);
                want.extend(floats(10..24));
                assert_eq!(seen(&cache, 23), want);
                assert_eq!(seen(&cache, 27), floats(12..28));
            }
        }
        push(&mut cache, 42..47);
        for q in 47..60 {
            push(&mut cache, q..q + 1);
            let mut want = floats(0..4);
            want.extend(floats(q - 11..q + 1));
            assert_eq!(seen(&cache, q), want, "token {q}");
        }
    }

    #[test]
    fn truncation_inside_the_ring() {
        let mut cache = ring(4);
        push(&mut cache, 0..3);
        assert!(cache.can_truncate(2));
        cache.truncate(2);
        push(&mut cache, 2..3);
        assert_eq!(held(&cache), vec![0.0, 1.0, 2.0]);
        for p in 3..9 {
            push(&mut cache, p..p + 1);
        }
        assert!(cache.can_truncate(8) && !cache.can_truncate(6));
    }
}
