//! An architecture's pass, and the [`LanguageModel`] written once over it (see
//! [`Architecture`]).
//!
//! The sequences of one forward pass: the tokens of one sequence, one token of each of several
//! sequences (a batched decoding step), or a run of equal length of each (several prompts
//! prefilled together, where no layer is recurrent). Each architecture writes its forward pass
//! once, over [`PassCaches`]: row-wise layers (norms, projections, MLPs, experts) run on all the
//! rows alike, and the layers that read a sequence's state take the layer's caches from
//! [`PassCaches::layer`], one or one per sequence, which the cache ops
//! ([`crate::cache::append_kv`], [`crate::cache::attend_kv`], the recurrent ops) take either way.

use oxlm_engine::{EngineError, Positions, Tensor};

use crate::cache::{Cache, KvCache, LayerCache, RecurrentCache, RotatingKvCache};
use crate::layers::{Embedding, OutputHead};
use crate::lora::{Adaptable, PassAdapters};
use crate::{
    check_batch, check_tokens, run_length, ForwardError, LanguageModel, Logits, ModelInfo,
};

/// What one architecture provides: its settings, the cache each layer keeps, its pass and its
/// output head; with its adaptable layers ([`Adaptable`]), [`LanguageModel`] is written once
/// over it: cache creation, one sequence's forward pass and the batched decoding step, with the
/// logits placed as each asks.
pub trait Architecture: Send + Sync {
    fn info(&self) -> &ModelInfo;

    /// A fresh cache for each layer that keeps one, for one sequence on the model's device.
    fn layer_caches(&self) -> Result<Vec<LayerCache>, EngineError>;

    /// The hidden states after the last block: one sequence's `tokens` over the one cache of
    /// `caches`, or one token of each sequence over its own (see [`PassCaches`]), with the
    /// linear layers `adapters` names adapted (only an [`Adaptable`] architecture is given any).
    fn hidden_states(
        &self,
        tokens: &[u32],
        caches: &mut [&mut Cache],
        adapters: Option<PassAdapters>,
    ) -> Result<Tensor, ForwardError>;

    /// The output head, and the embeddings it may be tied to.
    fn output(&self) -> (&OutputHead, &Embedding);
}

impl<A: Adaptable> LanguageModel for A {
    fn info(&self) -> &ModelInfo {
        Architecture::info(self)
    }

    fn new_cache(&self) -> Result<Cache, ForwardError> {
        Ok(Cache::from_layers(
            self.layer_caches()?.into_iter().map(Ok),
        )?)
    }

    fn forward(
        &self,
        tokens: &[u32],
        cache: &mut Cache,
        logits: Logits,
    ) -> Result<Tensor, ForwardError> {
        forward_one(cache, logits, self.output(), |c| {
            self.hidden_states(tokens, c, None)
        })
    }

    fn forward_batch(
        &self,
        tokens: &[u32],
        caches: &mut [&mut Cache],
    ) -> Result<Tensor, ForwardError> {
        forward_rows(tokens, caches, self.output(), |c| {
            self.hidden_states(tokens, c, None)
        })
    }

    fn hidden_runs(
        &self,
        tokens: &[u32],
        caches: &mut [&mut Cache],
    ) -> Result<Tensor, ForwardError> {
        let recurrent = |c: &&mut Cache| {
            c.layers
                .iter()
                .any(|l| matches!(l, LayerCache::Recurrent(_)))
        };
        if caches.len() < 2 || caches.iter().any(recurrent) {
            return hidden_runs_one_by_one(self, tokens, caches);
        }
        let h = self.hidden_states(tokens, caches, None)?;
        let (head, embed) = self.output();
        Ok(head.forward(h, Logits::HiddenAll, embed)?)
    }

    fn adaptable(&self) -> Option<&dyn Adaptable> {
        Some(self)
    }
}

/// [`LanguageModel::hidden_runs`] a run at a time: each run's [`Logits::HiddenAll`], stacked.
pub(crate) fn hidden_runs_one_by_one(
    model: &(impl LanguageModel + ?Sized),
    tokens: &[u32],
    caches: &mut [&mut Cache],
) -> Result<Tensor, ForwardError> {
    let per = run_length(tokens, caches)?;
    let mut rows = Vec::with_capacity(tokens.len() * model.info().hidden_size);
    for (run, cache) in tokens.chunks(per).zip(caches.iter_mut()) {
        let hidden = model.forward(run, cache, Logits::HiddenAll)?;
        rows.extend(hidden.into_vec().map_err(ForwardError::from)?);
    }
    Ok(Tensor::new(
        vec![tokens.len(), model.info().hidden_size],
        rows,
    ))
}

/// [`LanguageModel::forward`] of a pass, `run`, that gives the hidden states after the last
/// block: `logits` of them through `head` (with the embeddings it may be tied to).
pub(crate) fn forward_one(
    cache: &mut Cache,
    logits: Logits,
    (head, embed): (&OutputHead, &Embedding),
    run: impl FnOnce(&mut [&mut Cache]) -> Result<Tensor, ForwardError>,
) -> Result<Tensor, ForwardError> {
    let h = run(&mut [cache])?;
    Ok(head.forward(h, logits, embed)?)
}

/// [`LanguageModel::forward_batch`] of such a pass: one token per cache, every row's logits
/// left on the model's device.
pub(crate) fn forward_rows(
    tokens: &[u32],
    caches: &mut [&mut Cache],
    (head, embed): (&OutputHead, &Embedding),
    run: impl FnOnce(&mut [&mut Cache]) -> Result<Tensor, ForwardError>,
) -> Result<Tensor, ForwardError> {
    check_batch(tokens, caches)?;
    let h = run(caches)?;
    Ok(head.forward_on_device(h, Logits::All, embed)?)
}

/// The caches of a forward pass.
pub(crate) struct PassCaches<'p, 'c> {
    caches: &'p mut [&'c mut Cache],
    /// Tokens each cache takes: all of them for one cache, else a run of equal length each
    /// (one, in a decoding step).
    per_cache: usize,
}

/// Layer `i` of each of a pass's caches, all of one kind.
pub(crate) enum LayerCaches<'a> {
    Kv(Vec<&'a mut KvCache>),
    Rotating(Vec<&'a mut RotatingKvCache>),
    Recurrent(Vec<&'a mut RecurrentCache>),
}

impl<'p, 'c> PassCaches<'p, 'c> {
    /// Checks `tokens` against `caches` (one cache, or one token per cache) and the model: ids
    /// in its vocabulary, positions within its context, caches of its `layers` layers. Nothing
    /// is changed where a check fails. Returns the caches and where each row sits: consecutive
    /// positions after the one cache's, or each sequence's next position.
    pub fn new(
        info: &ModelInfo,
        tokens: &[u32],
        caches: &'p mut [&'c mut Cache],
        layers: usize,
    ) -> Result<(Self, Positions), ForwardError> {
        Self::fitting(info, tokens, caches, layers, |_| true)
    }

    /// [`new`](Self::new), each cache also passing `fits` (an architecture's check of its
    /// layers' kinds and shapes).
    pub fn fitting(
        info: &ModelInfo,
        tokens: &[u32],
        caches: &'p mut [&'c mut Cache],
        layers: usize,
        fits: impl Fn(&Cache) -> bool,
    ) -> Result<(Self, Positions), ForwardError> {
        if tokens.is_empty() {
            return Err(ForwardError::EmptyInput);
        }
        let per_cache = run_length(tokens, caches)?;
        for (tokens, cache) in tokens.chunks(per_cache).zip(caches.iter()) {
            check_tokens(info, tokens, cache.offset)?;
            if cache.layers.len() != layers || !fits(cache) {
                return Err(ForwardError::CacheMismatch);
            }
        }
        let positions = match &caches[..] {
            [one] => Positions::following(one.offset, per_cache, &info.device)?,
            many => Positions::new(
                many.iter()
                    .flat_map(|c| c.offset..c.offset + per_cache)
                    .collect(),
                &info.device,
            )?,
        };
        Ok((PassCaches { caches, per_cache }, positions))
    }

    /// Layer `i` of each cache; [`ForwardError::CacheMismatch`] where they are not all of one
    /// kind.
    pub fn layer(&mut self, i: usize) -> Result<LayerCaches<'_>, ForwardError> {
        let mut layers = self.caches.iter_mut().map(|c| c.layers.get_mut(i));
        let first = layers.next().flatten().ok_or(ForwardError::CacheMismatch)?;
        Ok(match first {
            LayerCache::Kv(c) => LayerCaches::Kv(with_rest(c, layers, |l| match l {
                LayerCache::Kv(c) => Some(c),
                _ => None,
            })?),
            LayerCache::Rotating(c) => LayerCaches::Rotating(with_rest(c, layers, |l| match l {
                LayerCache::Rotating(c) => Some(c),
                _ => None,
            })?),
            LayerCache::Recurrent(c) => {
                LayerCaches::Recurrent(with_rest(c, layers, |l| match l {
                    LayerCache::Recurrent(c) => Some(c),
                    _ => None,
                })?)
            }
        })
    }

    /// Counts the pass's tokens into its caches' offsets, once every layer has taken them.
    pub fn finish(self) {
        for cache in self.caches.iter_mut() {
            cache.offset += self.per_cache;
        }
    }
}

/// `first` and the `rest` of a layer's caches, each as the kind `pick` takes (that of `first`),
/// or [`ForwardError::CacheMismatch`].
fn with_rest<'a, T>(
    first: &'a mut T,
    rest: impl Iterator<Item = Option<&'a mut LayerCache>>,
    pick: fn(&'a mut LayerCache) -> Option<&'a mut T>,
) -> Result<Vec<&'a mut T>, ForwardError> {
    std::iter::once(Ok(first))
        .chain(rest.map(|l| l.and_then(pick).ok_or(ForwardError::CacheMismatch)))
        .collect()
}
