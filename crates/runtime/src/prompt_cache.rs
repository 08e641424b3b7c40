//! A prompt cache: model state kept after earlier requests, so that a prompt sharing a prefix
//! with one of them (the next turn of a chat, a retried request) only runs its new tokens through
//! the model. As mlx-lm's `LRUPromptCache`: least recently used entries go first, within a cap on
//! entries and on bytes.
//!
//! A cache of plain key/value layers can be cut back to any shorter prefix, so one entry serves
//! every prompt that shares a prefix with it. Recurrent and sliding-window layers cannot go back,
//! so an entry of such a model serves only prompts that extend its tokens entirely; the caller
//! keeps snapshots (clones) at the points worth resuming from.
//!
//! Each entry also carries a key naming the weights that computed it (the base model, or the base
//! seen through a LoRA adapter): state is only reused under the same key, as mlx-lm keys its
//! cache by model and adapter.

use oxlm_models::cache::LayerCache;
use oxlm_models::Cache;

struct Entry<K> {
    model: K,
    /// The tokens whose state `cache` holds (`cache.offset == tokens.len()`).
    tokens: Vec<u32>,
    cache: Cache,
    bytes: usize,
}

/// Model state by weights and token prefix, least recently used first out.
pub struct PromptCache<K> {
    /// Least recently used first.
    entries: Vec<Entry<K>>,
    max_entries: usize,
    max_bytes: usize,
    bytes: usize,
}

/// A cache to continue from, and how many prompt tokens it already holds.
pub struct Reused {
    pub cache: Cache,
    pub tokens: usize,
}

impl<K: PartialEq> PromptCache<K> {
    pub fn new(max_entries: usize, max_bytes: usize) -> Self {
        PromptCache {
            entries: Vec::new(),
            max_entries,
            max_bytes,
            bytes: 0,
        }
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Bytes held by all entries.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// A copy of the state of the longest prefix of `prompt` held for `model`, or `None`. The
    /// last prompt token is never reused: it has to go through the model to give the next
    /// token's logits.
    pub fn fetch(&mut self, model: &K, prompt: &[u32]) -> Option<Reused> {
        let limit = prompt.len().checked_sub(1)?;
        // (entry, reusable tokens); later entries are more recent and win ties.
        let mut best: Option<(usize, usize)> = None;
        for (i, entry) in self.entries.iter().enumerate() {
            if entry.model != *model {
                continue;
            }
            let common = common_prefix(&entry.tokens, prompt).min(limit);
            let usable = common == entry.tokens.len() || can_truncate(&entry.cache, common);
            if usable && common > 0 && best.is_none_or(|(_, n)| common >= n) {
                best = Some((i, common));
            }
        }
        let (index, tokens) = best?;
        let entry = self.entries.remove(index);
        // A copy that does not fit in device memory is a miss: the prompt runs in full.
        let copy = entry.cache.try_clone();
        self.entries.push(entry);
        let mut cache = copy.ok()?;
        // `can_truncate` said yes, so this cannot fail.
        cache.truncate(tokens).ok()?;
        Some(Reused { cache, tokens })
    }

    /// Drops the least recently used entries until they hold `max_bytes` at most.
    pub fn shrink_to(&mut self, max_bytes: usize) {
        while self.bytes > max_bytes && !self.entries.is_empty() {
            self.bytes -= self.entries.remove(0).bytes;
        }
    }

    /// Keeps `cache`, the state `model` computed after `tokens`, as the most recently used entry.
    pub fn insert(&mut self, model: K, tokens: Vec<u32>, cache: Cache) {
        debug_assert_eq!(cache.offset, tokens.len());
        // An entry that this one extends is redundant when this one can be cut back to it.
        let subsumes = is_truncatable(&cache);
        let mut i = 0;
        while i < self.entries.len() {
            let old = &self.entries[i];
            let same_model = old.model == model;
            if same_model && (old.tokens == tokens || (subsumes && tokens.starts_with(&old.tokens)))
            {
                self.bytes -= self.entries.remove(i).bytes;
            } else {
                i += 1;
            }
        }
        let bytes = cache.size_in_bytes();
        self.bytes += bytes;
        self.entries.push(Entry {
            model,
            tokens,
            cache,
            bytes,
        });
        while !self.entries.is_empty()
            && (self.entries.len() > self.max_entries || self.bytes > self.max_bytes)
        {
            self.bytes -= self.entries.remove(0).bytes;
        }
    }
}

fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// Whether every layer can be cut back to any shorter prefix (plain key/value layers only).
pub fn is_truncatable(cache: &Cache) -> bool {
    cache.layers.iter().all(|l| matches!(l, LayerCache::Kv(_)))
}

/// Whether [`Cache::truncate`]`(len)` would succeed.
fn can_truncate(cache: &Cache, len: usize) -> bool {
    len >= cache.offset
        || cache.layers.iter().all(|l| match l {
            LayerCache::Kv(_) => true,
            LayerCache::Rotating(ring) => ring.can_truncate(len),
            LayerCache::Recurrent(_) => false,
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use oxlm_engine::ops::recurrent::DeltaRuleDims;
    use oxlm_engine::{Device, Positions, Tensor};
    use oxlm_models::cache::{KvCache, RecurrentCache};

    /// The key of the base model in these tests; adapters get other names.
    const BASE: &str = "base";

    /// A one-layer key/value cache after `tokens` (one float per position).
    fn kv(tokens: &[u32]) -> Cache {
        let mut layer = KvCache::new(1, 1, &Device::Cpu).unwrap();
        for (p, &t) in tokens.iter().enumerate() {
            let x = Tensor::new(vec![1, 1], vec![t as f32]);
            let at = Positions::following(p, 1, &Device::Cpu).unwrap();
            layer.append(&x, &x, &at).unwrap();
        }
        let mut cache = Cache::new(vec![LayerCache::Kv(layer)]);
        cache.offset = tokens.len();
        cache
    }

    fn recurrent(tokens: &[u32]) -> Cache {
        let dims = DeltaRuleDims {
            k_heads: 1,
            v_heads: 1,
            k_dim: 1,
            v_dim: 1,
        };
        let layer = RecurrentCache::new(1, 2, dims, &Device::Cpu).unwrap();
        let mut cache = Cache::new(vec![LayerCache::Recurrent(layer)]);
        cache.offset = tokens.len();
        cache
    }

    #[test]
    fn longest_common_prefix_is_reused_and_cut_back() {
        let mut pc = PromptCache::new(10, usize::MAX);
        pc.insert(BASE, vec![1, 2, 3, 4], kv(&[1, 2, 3, 4]));
        pc.insert(BASE, vec![1, 9], kv(&[1, 9]));
        let hit = pc.fetch(&BASE, &[1, 2, 3, 7, 8]).unwrap();
        assert_eq!(hit.tokens, 3);
        assert_eq!(hit.cache.offset, 3);
        // The entry itself is kept whole.
        assert_eq!(pc.fetch(&BASE, &[1, 2, 3, 4, 5]).unwrap().tokens, 4);
        // The whole prompt is never reused.
        assert_eq!(pc.fetch(&BASE, &[1, 2, 3, 4]).unwrap().tokens, 3);
        assert!(pc.fetch(&BASE, &[5, 6]).is_none());
        assert!(pc.fetch(&BASE, &[1]).is_none());
    }

    #[test]
    fn recurrent_entries_serve_only_extensions() {
        let mut pc = PromptCache::new(10, usize::MAX);
        pc.insert(BASE, vec![1, 2, 3], recurrent(&[1, 2, 3]));
        assert!(pc.fetch(&BASE, &[1, 2, 4, 5]).is_none());
        assert!(pc.fetch(&BASE, &[1, 2, 3]).is_none());
        assert_eq!(pc.fetch(&BASE, &[1, 2, 3, 4]).unwrap().tokens, 3);
        // A snapshot at a prefix is not made redundant by a longer one.
        pc.insert(BASE, vec![1, 2, 3, 4, 5], recurrent(&[1, 2, 3, 4, 5]));
        assert_eq!(pc.len(), 2);
        assert_eq!(pc.fetch(&BASE, &[1, 2, 3, 9]).unwrap().tokens, 3);
    }

    #[test]
    fn extended_kv_entries_replace_their_prefixes() {
        let mut pc = PromptCache::new(10, usize::MAX);
        pc.insert(BASE, vec![1, 2], kv(&[1, 2]));
        pc.insert(BASE, vec![1, 2, 3], kv(&[1, 2, 3]));
        pc.insert(BASE, vec![1, 2, 3], kv(&[1, 2, 3]));
        assert_eq!(pc.len(), 1);
        assert_eq!(pc.bytes(), kv(&[1, 2, 3]).size_in_bytes());
    }

    #[test]
    fn least_recently_used_goes_first() {
        let one = kv(&[1]).size_in_bytes();
        let mut pc = PromptCache::new(2, usize::MAX);
        pc.insert(BASE, vec![1], kv(&[1]));
        pc.insert(BASE, vec![2], kv(&[2]));
        pc.fetch(&BASE, &[1, 5]).unwrap(); // 1 is now the most recent
        pc.insert(BASE, vec![3], kv(&[3]));
        assert!(pc.fetch(&BASE, &[2, 5]).is_none());
        assert!(pc.fetch(&BASE, &[1, 5]).is_some());
        // The byte cap evicts too, down to nothing if one entry is over it.
        let mut pc = PromptCache::new(10, one);
        pc.insert(BASE, vec![1], kv(&[1]));
        pc.insert(BASE, vec![2], kv(&[2]));
        assert_eq!((pc.len(), pc.bytes()), (1, one));
        let mut pc = PromptCache::new(10, one - 1);
        pc.insert(BASE, vec![1], kv(&[1]));
        assert!(pc.is_empty());
        assert_eq!(pc.bytes(), 0);
    }

    #[test]
    fn state_is_never_shared_across_models() {
        let mut pc = PromptCache::new(10, usize::MAX);
        pc.insert(BASE, vec![1, 2, 3], kv(&[1, 2, 3]));
        assert!(pc.fetch(&"adapter", &[1, 2, 3, 4]).is_none());
        // The same tokens under another key are a separate entry, not a replacement.
        pc.insert("adapter", vec![1, 2, 3], kv(&[1, 2, 3]));
        assert_eq!(pc.len(), 2);
        assert_eq!(pc.fetch(&"adapter", &[1, 2, 3, 4]).unwrap().tokens, 3);
        assert_eq!(pc.fetch(&BASE, &[1, 2, 3, 4]).unwrap().tokens, 3);
    }
}
