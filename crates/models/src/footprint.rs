//! What a model's cache will hold as a sequence grows, worked out from a fresh cache without
//! growing one: for predicting memory (`oxlm fit`) and for admitting requests by it (a server's
//! memory budget). Plain numbers, so that any thread can ask, whatever device the cache is on.

/// How one layer's cache grows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerFootprint {
    /// Keys and values of every position, `slot` bytes each, reserved `step` positions at a time.
    Full { slot: usize, step: usize },
    /// Keys and values of the last `window` positions, reserved `step` at a time up to the
    /// window; while a prompt chunk goes through, the ring also holds the chunk.
    Window {
        slot: usize,
        window: usize,
        step: usize,
        /// Llama 4's chunked attention, whose ring holds a chunk of `window` positions.
        chunked: bool,
    },
    /// A recurrent state: the same bytes at any length.
    Fixed { bytes: usize },
}

impl LayerFootprint {
    /// The most bytes the layer holds over a sequence of `tokens` positions whose prompt goes
    /// through in chunks of at most `chunk` tokens.
    pub fn bytes_at(&self, tokens: usize, chunk: usize) -> usize {
        match *self {
            LayerFootprint::Full { slot, step } => tokens.div_ceil(step) * step * slot,
            LayerFootprint::Window {
                slot, window, step, ..
            } => {
                let reserved = tokens.div_ceil(step) * step;
                reserved.min(window - 1 + chunk.max(1)) * slot
            }
            LayerFootprint::Fixed { bytes } => bytes,
        }
    }
}

/// How each layer of a model's cache grows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CacheFootprint {
    pub layers: Vec<LayerFootprint>,
}

impl CacheFootprint {
    /// The most bytes the cache holds over a sequence of `tokens` positions whose prompt goes
    /// through in chunks of at most `chunk` tokens.
    pub fn bytes_at(&self, tokens: usize, chunk: usize) -> usize {
        self.layers.iter().map(|l| l.bytes_at(tokens, chunk)).sum()
    }

    /// The most positions one sequence can reach within `bytes` (`usize::MAX` where its cache
    /// stops growing before that: sliding windows and recurrent states only).
    pub fn max_tokens_within(&self, bytes: usize, chunk: usize) -> usize {
        let grows = self
            .layers
            .iter()
            .any(|l| matches!(l, LayerFootprint::Full { .. }));
        if !grows {
            let most = self.bytes_at(usize::MAX / 2, chunk);
            return if most <= bytes { usize::MAX } else { 0 };
        }
        // `bytes_at` grows with the tokens: the last length that fits, by bisection.
        let (mut lo, mut hi) = (0usize, 1usize);
        while self.bytes_at(hi, chunk) <= bytes {
            lo = hi;
            hi *= 2;
        }
        while hi - lo > 1 {
            let mid = lo + (hi - lo) / 2;
            if self.bytes_at(mid, chunk) <= bytes {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        lo
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layers_grow_as_their_caches_do() {
        let full = LayerFootprint::Full {
            slot: 10,
            step: 256,
        };
        assert_eq!(full.bytes_at(0, 512), 0);
        assert_eq!(full.bytes_at(1, 512), 2560);
        assert_eq!(full.bytes_at(257, 512), 5120);
        let window = LayerFootprint::Window {
            slot: 10,
            window: 300,
            step: 256,
            chunked: false,
        };
        // Below the window, as a full layer; past it, the window and a chunk at most.
        assert_eq!(window.bytes_at(100, 512), 2560);
        assert_eq!(window.bytes_at(10_000, 1), 3000);
        assert_eq!(window.bytes_at(10_000, 512), 8110);
        assert_eq!(LayerFootprint::Fixed { bytes: 7 }.bytes_at(1 << 20, 1), 7);
    }

    #[test]
    fn the_longest_sequence_within_a_budget() {
        let cache = CacheFootprint {
            layers: vec![
                LayerFootprint::Full {
                    slot: 10,
                    step: 256,
                },
                LayerFootprint::Fixed { bytes: 100 },
            ],
        };
        // 2660 bytes: the first block of 256 positions and the fixed state.
        assert_eq!(cache.max_tokens_within(2660, 1), 256);
        assert_eq!(cache.max_tokens_within(2659, 1), 0);
        assert_eq!(cache.max_tokens_within(5219, 1), 256);
        assert_eq!(cache.max_tokens_within(5220, 1), 512);
        let windowed = CacheFootprint {
            layers: vec![LayerFootprint::Window {
                slot: 10,
                window: 4,
                step: 256,
                chunked: false,
            }],
        };
        assert_eq!(windowed.max_tokens_within(40, 1), usize::MAX);
        assert_eq!(windowed.max_tokens_within(39, 1), 0);
    }
}
