//! Batches as mlx-lm's `iterate_batches` makes them: items in a fixed grouping, the groups
//! visited in a fresh random order each epoch (numpy's global generator), each padded with zeros
//! to one more than a multiple of 32 tokens and cut at `max_seq_length`.

use oxlm_models::lora_dropout::BatchLayout;
use oxlm_models::lora_grad::Example;
use thiserror::Error;

use super::data::Dataset;
use super::np_random::NumpyRandom;

/// Padded widths are one more than a multiple of this.
const PAD_TO: usize = 32;

#[derive(Debug, Error, PartialEq, Eq)]
#[error("the dataset must have at least batch_size={batch_size} examples but only has {len}")]
pub struct TooSmall {
    pub batch_size: usize,
    pub len: usize,
}

/// One batch, as the loss reads it.
#[derive(Debug, Clone)]
pub struct Batch {
    /// The scored part of each row (a row with nothing to score is left out).
    pub examples: Vec<Example>,
    /// The longest item before cutting, when it was longer than `max_seq_length`.
    pub truncated_from: Option<usize>,
    /// Where the examples sit in the padded batch (what dropout masks are drawn over).
    pub layout: BatchLayout,
}

impl Batch {
    /// Positions that count towards the loss (mlx-lm's `ntoks`).
    pub fn tokens(&self) -> usize {
        self.examples.iter().map(Example::scored).sum()
    }
}

/// Endless (or one-epoch) batches over a dataset.
pub struct Batches<'a> {
    data: &'a Dataset,
    max_seq_length: usize,
    groups: Vec<Vec<usize>>,
    order: Vec<usize>,
    next: usize,
    epochs: Option<usize>,
}

impl<'a> Batches<'a> {
    /// `loop_forever` as `iterate_batches(loop=True)` (training); otherwise one epoch
    /// (evaluation). The order of the groups is drawn from `rng` when each epoch starts.
    pub fn new(
        data: &'a Dataset,
        batch_size: usize,
        max_seq_length: usize,
        loop_forever: bool,
    ) -> Result<Self, TooSmall> {
        if data.len() < batch_size || batch_size == 0 {
            return Err(TooSmall {
                batch_size,
                len: data.len(),
            });
        }
        // mlx-lm sorts by `CacheDataset.itemlen`, the key count of each item's JSON object
        // (a stable sort, so the file order within equal counts stays).
        let mut idx: Vec<usize> = (0..data.len()).collect();
        idx.sort_by_key(|&i| data.items[i].keys);
        let groups = idx
            .chunks_exact(batch_size)
            .map(<[usize]>::to_vec)
            .collect();
        Ok(Batches {
            data,
            max_seq_length,
            groups,
            order: Vec::new(),
            next: 0,
            epochs: (!loop_forever).then_some(1),
        })
    }

    /// Batches in one epoch.
    pub fn per_epoch(&self) -> usize {
        self.groups.len()
    }

    /// The next batch; `None` after the only epoch of a non-looping iterator.
    pub fn next_batch(&mut self, rng: &mut NumpyRandom) -> Option<Batch> {
        if self.next == self.order.len() {
            match &mut self.epochs {
                Some(0) => return None,
                Some(left) => *left -= 1,
                None => {}
            }
            self.order = rng.permutation(self.groups.len());
            self.next = 0;
        }
        let group = &self.groups[self.order[self.next]];
        self.next += 1;
        Some(self.pad(group))
    }

    fn pad(&self, group: &[usize]) -> Batch {
        let items: Vec<_> = group.iter().map(|&i| &self.data.items[i]).collect();
        let longest = items.iter().map(|it| it.tokens.len()).max().unwrap_or(0);
        let width = (1 + PAD_TO * longest.div_ceil(PAD_TO)).min(self.max_seq_length);
        let (examples, example_rows) = items
            .iter()
            .enumerate()
            .filter_map(|(i, it)| {
                let length = it.tokens.len().min(self.max_seq_length);
                let mut row = vec![0u32; width];
                row[..length].copy_from_slice(&it.tokens[..length]);
                Some((Example::from_padded(&row, it.offset, length)?, i))
            })
            .unzip();
        Batch {
            examples,
            truncated_from: (longest > self.max_seq_length).then_some(longest),
            layout: BatchLayout {
                rows: items.len(),
                // The model reads every position but the last.
                width: width - 1,
                example_rows,
            },
        }
    }
}
