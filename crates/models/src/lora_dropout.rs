//! LoRA dropout as mlx-lm's `LoRALinear` applies it in training: `nn.Dropout(p)` on the input of
//! the low-rank path, each element kept with probability 1 - p and scaled by 1 / (1 - p); the
//! base layer reads its input whole. The masks are MLX's own: its generator (`mx.random.seed`,
//! the global key split at every draw, threefry2x32 over a counter), `bernoulli` as MLX computes
//! it, and one draw per adapted layer and training step, over the whole padded batch, in the
//! order of the blocks and of each block's layers as [`Adaptable::block_linears`] lists them
//! (the order mlx-lm's forward pass calls them in the llama family: q, k, v, o, gate, up, down).
//! An expert stack draws once and splits that key into one per expert; its masks are MLX's
//! numbers but not mlx-lm's, which masks the rows it has gathered for all experts at once.

use std::collections::BTreeMap;

use crate::lora::{Adaptable, Adapters};

/// A key of MLX's generator (`mx.random.key`).
pub type Key = [u32; 2];

/// The Threefry-2x32 hash (20 rounds) of `count` under `key`, as MLX's CPU backend computes it.
fn threefry2x32(key: Key, count: [u32; 2]) -> [u32; 2] {
    const ROTATIONS: [[u32; 4]; 2] = [[13, 15, 26, 6], [17, 29, 16, 24]];
    let ks = [key[0], key[1], key[0] ^ key[1] ^ 0x1BD1_1BDA];
    let [mut x, mut y] = [count[0].wrapping_add(ks[0]), count[1].wrapping_add(ks[1])];
    for i in 0..5 {
        for r in ROTATIONS[i % 2] {
            x = x.wrapping_add(y);
            y = y.rotate_left(r) ^ x;
        }
        x = x.wrapping_add(ks[(i + 1) % 3]);
        y = y.wrapping_add(ks[(i + 2) % 3]).wrapping_add(i as u32 + 1);
    }
    [x, y]
}

/// Word `index` of `mx.random.bits` of `len` 32-bit words under `key`: the first half of the
/// words are the hashes' first outputs, the second half their second ones, the middle word of an
/// odd count a hash of its own.
fn bits_at(key: Key, len: usize, index: usize) -> u32 {
    let (half, odd) = (len / 2, len % 2);
    if index < half {
        threefry2x32(key, [index as u32, (index + half + odd) as u32])[0]
    } else if odd == 1 && index == half {
        threefry2x32(key, [half as u32, 0])[0]
    } else {
        threefry2x32(key, [(index - half - odd) as u32, index as u32])[1]
    }
}

/// `mx.random.split(key, num)`: `num` keys.
fn split(key: Key, num: usize) -> Vec<Key> {
    let word = |i| bits_at(key, 2 * num, i);
    (0..num).map(|k| [word(2 * k), word(2 * k + 1)]).collect()
}

/// MLX's global generator (`KeySequence`): every draw takes the second key of a split of the
/// state, and the first becomes the state.
#[derive(Debug, Clone)]
pub struct KeySequence {
    key: Key,
}

impl KeySequence {
    /// The state after `mx.random.seed(seed)`.
    pub fn new(seed: u64) -> Self {
        KeySequence {
            key: [(seed >> 32) as u32, seed as u32],
        }
    }

    /// The key of the next draw.
    pub fn next_key(&mut self) -> Key {
        let keys = split(self.key, 2);
        self.key = keys[0];
        keys[1]
    }
}

/// Where a training batch's examples sit in the padded batch mlx-lm runs: masks are drawn over
/// its whole input, `[rows, width, features]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatchLayout {
    /// Sequences in the batch, those with nothing to score included.
    pub rows: usize,
    /// The model input's width: the padded width less the last position.
    pub width: usize,
    /// The row of each example, in order.
    pub example_rows: Vec<usize>,
}

/// `nn.Dropout`'s mask and scale on one adapted layer's input, for the rows of one example.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct InputDropout {
    key: Key,
    /// Words drawn for the whole batch's input to the layer.
    len: usize,
    /// The word of the example's first element.
    offset: usize,
    /// An element is kept when its word, as f32, is below this.
    threshold: f32,
    /// `1 / (1 - p)`.
    scale: f32,
}

impl InputDropout {
    /// Drops or scales each element of `x`, the example's rows (or a gradient shaped as them).
    pub fn apply(&self, x: &mut [f32]) {
        for (i, v) in x.iter_mut().enumerate() {
            let word = bits_at(self.key, self.len, self.offset + i);
            // `bernoulli(1 - p)` compares the word, made f32 as MLX promotes it, with
            // (1 - p)·WORDS_ABOVE in f32.
            *v = if (word as f32) < self.threshold {
                *v * self.scale
            } else {
                0.0
            };
        }
    }
}

/// One training step's dropout: a key for each adapted layer (one per expert of a stack), drawn
/// in mlx-lm's order, and where the examples sit in the batch.
#[derive(Debug, Clone)]
pub struct BatchDropout {
    keys: BTreeMap<String, Vec<Key>>,
    layout: BatchLayout,
    threshold: f32,
    scale: f32,
}

/// `std::nextafter((float)UINT32_MAX, FLT_MAX)`, which `bernoulli` scales p by: every word, as
/// f32, is below it.
const WORDS_ABOVE: f32 = 4_294_967_808.0;

impl BatchDropout {
    /// The keys of one step of training `adapters` (whose `config.dropout` is p) on `model`,
    /// drawn from `keys`.
    pub fn draw(
        model: &dyn Adaptable,
        adapters: &Adapters,
        layout: BatchLayout,
        keys: &mut KeySequence,
    ) -> Self {
        let mut drawn = BTreeMap::new();
        for (i, linears) in model.block_linears().iter().enumerate() {
            for shape in linears {
                let path = format!("{}.{}", adapters.block_path(i), shape.key);
                if adapters.layers.contains_key(&path) {
                    drawn.insert(path, vec![keys.next_key()]);
                } else if let Some(each) = adapters.experts.get(&path) {
                    drawn.insert(path, split(keys.next_key(), each.len()));
                }
            }
        }
        // Python's `1 - p` and `1 / (1 - p)` in f64, made f32 where MLX meets them.
        let keep = 1.0 - adapters.config.dropout;
        BatchDropout {
            keys: drawn,
            layout,
            threshold: keep as f32 * WORDS_ABOVE,
            scale: (1.0 / keep) as f32,
        }
    }

    /// `adapters` with the dropout of example `n` set on each layer.
    pub(crate) fn for_example(&self, adapters: &Adapters, n: usize) -> Adapters {
        let mut out = adapters.clone();
        let layout = &self.layout;
        // A row's elements follow the rows before it in the batch's input.
        let row_words = |features: usize| layout.width * features;
        let plain = out.layers.iter_mut().map(|(path, l)| (path, vec![l]));
        let stacked =
            (out.experts.iter_mut()).map(|(path, each)| (path, each.iter_mut().collect()));
        for (path, layers) in plain.chain(stacked) {
            let keys = &self.keys[path.as_str()];
            for (layer, &key) in layers.into_iter().zip(keys) {
                let row = row_words(layer.in_features);
                layer.dropout = Some(InputDropout {
                    key,
                    len: layout.rows * row,
                    offset: layout.example_rows[n] * row,
                    threshold: self.threshold,
                    scale: self.scale,
                });
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// About 1 - p of the elements are kept, each scaled by exactly 1 / (1 - p) in f32; the rest
    /// are zero. The words past an example's offset are its own: two examples' masks differ.
    #[test]
    fn dropout_keeps_one_minus_p_and_scales_what_it_keeps() {
        let p = 0.3f64;
        let x: Vec<f32> = (0..100_000).map(|i| 1.0 + (i % 7) as f32).collect();
        let mask = |offset| {
            let dropout = InputDropout {
                key: KeySequence::new(5).next_key(),
                len: 2 * x.len(),
                offset,
                threshold: (1.0 - p) as f32 * WORDS_ABOVE,
                scale: (1.0 / (1.0 - p)) as f32,
            };
            let mut dropped = x.clone();
            dropout.apply(&mut dropped);
            dropped
        };
        let first = mask(0);
        let kept = first.iter().filter(|v| **v != 0.0).count() as f64 / x.len() as f64;
        assert!((kept - 0.7).abs() < 0.005, "{kept}");
        for (d, v) in first.iter().zip(&x) {
            assert!(*d == 0.0 || *d == v * (1.0 / 0.7f64) as f32, "{d} from {v}");
        }
        assert_ne!(first, mask(x.len()));
    }

    /// Threefry-2x32's known-answer vectors (Random123's kat_vectors, 20 rounds).
    #[test]
    fn threefry_matches_its_reference_vectors() {
        assert_eq!(threefry2x32([0, 0], [0, 0]), [0x6b200159, 0x99ba4efe]);
        assert_eq!(
            threefry2x32([0xffffffff, 0xffffffff], [0xffffffff, 0xffffffff]),
            [0x1cb996fc, 0xbb002be7]
        );
        assert_eq!(
            threefry2x32([0x13198a2e, 0x03707344], [0x243f6a88, 0x85a308d3]),
            [0xc4923a9c, 0x483df7a0]
        );
    }
}
