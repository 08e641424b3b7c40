//! The key/value cache of a sliding-window attention layer: a ring that keeps only the positions
//! a query can still see, as mlx-lm's `RotatingKVCache` (with `keep = 0`) does.

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
        })
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
        let shape = self.shape();
        self.rings
            .write(keys, values, shape, self.capacity, positions)?;
        self.advance_by(n);
        Ok(())
    }

    /// Whether [`truncate`](Self::truncate)`(len)` leaves every position the next token would
    /// see: false once the ring has overwritten part of that window.
    pub fn can_truncate(&self, len: usize) -> bool {
        len >= self.end || self.start <= (len + 1).saturating_sub(self.window)
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

    pub(crate) fn rings(&self) -> &KvRings {
        &self.rings
    }

    /// Holds `keys` and `values` (`[kv_heads, n, head_dim]`) as positions `first..first + n`,
    /// the last ones seen, in place of what it held (a prompt cache read from a file). The ring
    /// is as wide as what it holds; the next append sizes it as usual.
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
        Ok(())
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
    /// [`oxlm_engine::KvRing::into_precision`]).
    pub fn with_precision(self, precision: KvPrecision) -> Result<Self, EngineError> {
        Ok(RotatingKvCache {
            rings: self.rings.into_precision(precision, self.head_dim)?,
            ..self
        })
    }

    pub fn try_clone(&self) -> Result<Self, EngineError> {
        Ok(RotatingKvCache {
            rings: self.rings.try_clone()?,
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
        Ok(self.rings.target(self.capacity))
    }

    fn advance(&mut self) {
        self.advance_by(1);
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
