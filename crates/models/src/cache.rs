//! Per-layer state carried between forward passes.

use oxlm_engine::ops::KvView;

pub use crate::recurrent_cache::RecurrentCache;
pub use crate::rotating_cache::RotatingKvCache;
use crate::TruncateError;

/// Keys and values grow in blocks of this many positions, as mlx-lm's `KVCache` does, so that
/// decoding does not reallocate per token.
const GROWTH_STEP: usize = 256;

/// The keys and values of one attention layer, `[kv_heads, capacity, head_dim]` each.
#[derive(Debug, Clone)]
pub struct KvCache {
    kv_heads: usize,
    head_dim: usize,
    capacity: usize,
    len: usize,
    keys: Vec<f32>,
    values: Vec<f32>,
}

impl KvCache {
    pub fn new(kv_heads: usize, head_dim: usize) -> Self {
        KvCache {
            kv_heads,
            head_dim,
            capacity: 0,
            len: 0,
            keys: Vec::new(),
            values: Vec::new(),
        }
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

    fn grow_to(&mut self, needed: usize) {
        if needed <= self.capacity {
            return;
        }
        let capacity = needed.div_ceil(GROWTH_STEP) * GROWTH_STEP;
        let d = self.head_dim;
        for buf in [&mut self.keys, &mut self.values] {
            let mut grown = vec![0.0; self.kv_heads * capacity * d];
            for h in 0..self.kv_heads {
                let old = &buf[h * self.capacity * d..][..self.len * d];
                grown[h * capacity * d..][..self.len * d].copy_from_slice(old);
            }
            *buf = grown;
        }
        self.capacity = capacity;
    }

    /// Appends `[tokens, kv_heads, head_dim]` keys and values.
    pub fn append(&mut self, keys: &[f32], values: &[f32]) {
        let d = self.head_dim;
        let n = keys.len() / (self.kv_heads * d);
        self.grow_to(self.len + n);
        for t in 0..n {
            for h in 0..self.kv_heads {
                let src = (t * self.kv_heads + h) * d;
                let dst = (h * self.capacity + self.len + t) * d;
                self.keys[dst..dst + d].copy_from_slice(&keys[src..src + d]);
                self.values[dst..dst + d].copy_from_slice(&values[src..src + d]);
            }
        }
        self.len += n;
    }

    /// Forgets all but the first `len` positions (a prompt cache reusing a shared prefix).
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }

    pub fn view(&self) -> KvView<'_> {
        KvView {
            keys: &self.keys,
            values: &self.values,
            kv_heads: self.kv_heads,
            capacity: self.capacity,
            len: self.len,
        }
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

impl Cache {
    pub fn new(layers: Vec<LayerCache>) -> Self {
        Cache { layers, offset: 0 }
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
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn growth_keeps_earlier_positions_per_head() {
        let mut cache = KvCache::new(2, 1);
        for t in 0..300 {
            let t = t as f32;
            cache.append(&[t, -t], &[t + 0.5, -t - 0.5]);
        }
        let v = cache.view();
        assert_eq!((v.len, v.capacity), (300, 512));
        assert_eq!(v.keys[299], 299.0);
        assert_eq!(v.keys[512 + 299], -299.0);
        assert_eq!(v.values[512 + 7], -7.5);
    }
}
