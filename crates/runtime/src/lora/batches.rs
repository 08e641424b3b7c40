//! Batches as mlx-lm's `iterate_batches` makes them: items in a fixed grouping, the groups
//! visited in a fresh random order each epoch (numpy's global generator), each padded with zeros
//! to one more than a multiple of 32 tokens and cut at `max_seq_length`. Preference batches
//! group pairs by the length of their chosen sequence, as mlx-lm-lora's do, in the same order.

use oxlm_models::lora_dropout::BatchLayout;
use oxlm_models::lora_grad::Example;
use thiserror::Error;

use super::data::{Dataset, PreferenceSet};
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

/// Items in a fixed grouping, the groups visited in a fresh random order each epoch.
struct BatchOrder {
    groups: Vec<Vec<usize>>,
    order: Vec<usize>,
    next: usize,
    epochs: Option<usize>,
}

impl BatchOrder {
    /// The items `0..len`, stably sorted by `key`, in groups of `batch_size` (a last, smaller
    /// group is left out); endless with `loop_forever`, otherwise one epoch.
    fn new<K: Ord>(
        len: usize,
        batch_size: usize,
        key: impl Fn(usize) -> K,
        loop_forever: bool,
    ) -> Result<Self, TooSmall> {
        if len < batch_size || batch_size == 0 {
            return Err(TooSmall { batch_size, len });
        }
        let mut idx: Vec<usize> = (0..len).collect();
        idx.sort_by_key(|&i| key(i));
        let groups = idx
            .chunks_exact(batch_size)
            .map(<[usize]>::to_vec)
            .collect();
        Ok(BatchOrder {
            groups,
            order: Vec::new(),
            next: 0,
            epochs: (!loop_forever).then_some(1),
        })
    }

    /// The next group; `None` after the only epoch of a non-looping order. The order of the
    /// groups is drawn from `rng` when each epoch starts.
    fn next_group(&mut self, rng: &mut NumpyRandom) -> Option<Vec<usize>> {
        if self.next == self.order.len() {
            match &mut self.epochs {
                Some(0) => return None,
                Some(left) => *left -= 1,
                None => {}
            }
            self.order = rng.permutation(self.groups.len());
            self.next = 0;
        }
        self.next += 1;
        Some(self.groups[self.order[self.next - 1]].clone())
    }
}

/// Endless (or one-epoch) batches over a dataset.
pub struct Batches<'a> {
    data: &'a Dataset,
    max_seq_length: usize,
    order: BatchOrder,
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
        // mlx-lm sorts by `CacheDataset.itemlen`, the key count of each item's JSON object
        // (a stable sort, so the file order within equal counts stays).
        let keys = |i: usize| data.items[i].keys;
        Ok(Batches {
            data,
            max_seq_length,
            order: BatchOrder::new(data.len(), batch_size, keys, loop_forever)?,
        })
    }

    /// Batches in one epoch.
    pub fn per_epoch(&self) -> usize {
        self.order.groups.len()
    }

    /// The next batch; `None` after the only epoch of a non-looping iterator.
    pub fn next_batch(&mut self, rng: &mut NumpyRandom) -> Option<Batch> {
        let group = self.order.next_group(rng)?;
        Some(self.pad(&group))
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

/// One batch of preference pairs.
#[derive(Debug, Clone)]
pub struct PreferenceBatch {
    /// The scored part (the answer) of each pair's chosen and rejected sequence, in that order;
    /// a pair either of whose answers has nothing left to score once cut is left out.
    pub pairs: Vec<[Example; 2]>,
    /// The item of each pair in its set.
    pub items: Vec<usize>,
    /// The longest sequence before cutting, when it was longer than `max_seq_length`.
    pub truncated_from: Option<usize>,
}

impl PreferenceBatch {
    /// Positions that count towards the loss, in both answers of every pair.
    pub fn tokens(&self) -> usize {
        self.pairs.iter().flatten().map(Example::scored).sum()
    }

    /// The pairs' sequences as the batch that dropout masks are drawn over: a row each, the
    /// chosen and the rejected of each pair in turn.
    pub fn layout(&self) -> BatchLayout {
        let rows = 2 * self.pairs.len();
        let longest = self.pairs.iter().flatten().map(|ex| ex.inputs.len());
        BatchLayout {
            rows,
            width: longest.max().unwrap_or(0),
            example_rows: (0..rows).collect(),
        }
    }
}

/// Endless (or one-epoch) batches over a preference set.
pub struct PreferenceBatches<'a> {
    data: &'a PreferenceSet,
    max_seq_length: usize,
    order: BatchOrder,
}

impl<'a> PreferenceBatches<'a> {
    /// As [`Batches::new`], the pairs sorted by the length of their chosen sequence.
    pub fn new(
        data: &'a PreferenceSet,
        batch_size: usize,
        max_seq_length: usize,
        loop_forever: bool,
    ) -> Result<Self, TooSmall> {
        let chosen_len = |i: usize| data.items[i].chosen.len();
        Ok(PreferenceBatches {
            data,
            max_seq_length,
            order: BatchOrder::new(data.len(), batch_size, chosen_len, loop_forever)?,
        })
    }

    /// The next batch; `None` after the only epoch of a non-looping iterator.
    pub fn next_batch(&mut self, rng: &mut NumpyRandom) -> Option<PreferenceBatch> {
        let group = self.order.next_group(rng)?;
        let mut batch = PreferenceBatch {
            pairs: Vec::with_capacity(group.len()),
            items: Vec::with_capacity(group.len()),
            truncated_from: None,
        };
        for i in group {
            let item = &self.data.items[i];
            let longest = item.chosen.len().max(item.rejected.len());
            if longest > self.max_seq_length {
                batch.truncated_from = batch.truncated_from.max(Some(longest));
            }
            if let Some(pair) = item.examples(self.max_seq_length) {
                batch.pairs.push(pair);
                batch.items.push(i);
            }
        }
        Some(batch)
    }
}
