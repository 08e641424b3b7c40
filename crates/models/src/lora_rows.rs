//! Adapters per row of a forward pass: several sets stacked over every row, or a batch whose
//! sequences run through sets of their own (requests naming different adapters share a
//! decoding step), over one shared base model.

use oxlm_engine::ops::{self, LowRankUpdate};
use oxlm_engine::{EngineError, Tensor};

use crate::cache::Cache;
use crate::lora::{Adaptable, AdapterError, Adapters, LoraLinear};
use crate::{ForwardError, LanguageModel, Logits, ModelInfo};

/// The adapters of one linear layer in a forward pass, when it has any: each for some rows
/// (`None`: every row), their updates added in this order.
#[derive(Clone)]
pub struct LayerAdapter<'a> {
    pub(crate) parts: Vec<(&'a LoraLinear, Option<&'a [usize]>)>,
}

impl LayerAdapter<'_> {
    /// `y += ` the low-rank updates of the rows of `x`: where `x` is, for adapters placed on
    /// its GPU (see [`Adapters::place`]); otherwise on the host (a rank-r product is small), the
    /// input coming down from a GPU and the update going up.
    pub fn add_to_tensor(&self, x: &Tensor, y: &mut Tensor) -> Result<(), EngineError> {
        if let (false, Some(updates)) = (x.is_host(), self.placed()) {
            return ops::add_low_rank(x, &updates, y);
        }
        let m = x.rows();
        let add = |x: &[f32], y: &mut [f32]| {
            for (adapter, rows) in &self.parts {
                match rows {
                    None => adapter.add_to(x, m, y),
                    Some(rows) => add_to_rows(adapter, x, rows, y),
                }
            }
        };
        if x.is_host() && y.is_host() {
            add(x.data(), y.data_mut());
            return Ok(());
        }
        let mut update = vec![0.0; y.shape().iter().product()];
        add(&x.to_vec()?, &mut update);
        let update = Tensor::from_slice(y.shape().to_vec(), &update, &y.device())?;
        oxlm_engine::ops::add_inplace(y, &update)
    }
}

impl<'a> LayerAdapter<'a> {
    /// Its updates through the copies placed on a GPU, where every part has them.
    fn placed(&self) -> Option<Vec<LowRankUpdate<'a>>> {
        (self.parts.iter())
            .map(|(adapter, rows)| adapter.placed_update(*rows))
            .collect()
    }

    /// [`add_to_tensor`](Self::add_to_tensor) for layers that read the same input `x` (a
    /// block's q, k and v projections), each output with its layer's adapter if it has one: on
    /// a GPU in one pair of launches for them all.
    pub fn add_all(
        x: &Tensor,
        outputs: &mut [(Option<LayerAdapter<'a>>, &mut Tensor)],
    ) -> Result<(), EngineError> {
        if !x.is_host() {
            let placed: Option<Vec<Vec<LowRankUpdate>>> = (outputs.iter())
                .map(|(adapter, _)| adapter.as_ref().map_or(Some(Vec::new()), |a| a.placed()))
                .collect();
            if let Some(placed) = placed {
                let mut each: Vec<(&[LowRankUpdate], &mut Tensor)> = (placed.iter())
                    .zip(outputs.iter_mut())
                    .map(|(updates, (_, y))| (updates.as_slice(), &mut **y))
                    .collect();
                return ops::add_low_ranks(x, &mut each);
            }
        }
        for (adapter, y) in outputs.iter_mut() {
            if let Some(adapter) = adapter {
                adapter.add_to_tensor(x, y)?;
            }
        }
        Ok(())
    }
}

/// Adapter sets and the rows of a pass each applies to (`None`: every row), in the order their
/// updates add up: a stack of sets for every row, or a batch whose sequences (its rows) run
/// through sets of their own.
#[derive(Debug, Default)]
pub struct RowAdapters<'a> {
    pub(crate) groups: Vec<(&'a Adapters, Option<Vec<usize>>)>,
}

impl<'a> RowAdapters<'a> {
    /// `sets` for every row, their updates added in this order.
    pub fn stack(sets: &[&'a Adapters]) -> Self {
        RowAdapters {
            groups: sets.iter().map(|&set| (set, None)).collect(),
        }
    }

    /// The sets of each row of a batch, `rows[i]` those of row `i` in the order their updates
    /// add up (none: the base model). `None` where rows differ and a set adapts a mixture's
    /// experts, whose rows a layer regroups by expert.
    pub fn by_row(rows: &[Vec<&'a Adapters>]) -> Option<Self> {
        let same_stack = |a: &Vec<&Adapters>, b: &Vec<&Adapters>| {
            a.len() == b.len() && a.iter().zip(b).all(|(x, y)| std::ptr::eq(*x, *y))
        };
        if let Some(first) = rows.first() {
            if rows.iter().all(|stack| same_stack(stack, first)) {
                return Some(Self::stack(first));
            }
        }
        let mut groups: Vec<(usize, &'a Adapters, Vec<usize>)> = Vec::new();
        for (row, stack) in rows.iter().enumerate() {
            for (depth, &set) in stack.iter().enumerate() {
                if !set.experts.is_empty() {
                    return None;
                }
                let same = |(d, s, _): &&mut (usize, &Adapters, Vec<usize>)| {
                    *d == depth && std::ptr::eq(*s, set)
                };
                match groups.iter_mut().find(same) {
                    Some((_, _, members)) => members.push(row),
                    None => groups.push((depth, set, vec![row])),
                }
            }
        }
        // Every row's first set before its second: the order each row's updates add up in.
        groups.sort_by_key(|(depth, _, _)| *depth);
        let groups = groups.into_iter().map(|(_, s, r)| (s, Some(r))).collect();
        Some(RowAdapters { groups })
    }

    /// Whether no row is adapted.
    pub fn is_empty(&self) -> bool {
        self.groups.is_empty()
    }

    /// Each set once, in the order first met.
    fn sets(&self) -> Vec<&'a Adapters> {
        let mut sets: Vec<&Adapters> = Vec::new();
        for (set, _) in &self.groups {
            if !sets.iter().any(|s| std::ptr::eq(*s, *set)) {
                sets.push(set);
            }
        }
        sets
    }
}

/// The adapters a forward pass runs with.
#[derive(Clone, Copy)]
pub enum PassAdapters<'a> {
    /// One set for every row.
    All(&'a Adapters),
    /// Several, each for some rows or all of them.
    Rows(&'a RowAdapters<'a>),
}

/// [`LoraLinear::add_to`] on the rows `rows` of `x` and `y` only.
fn add_to_rows(adapter: &LoraLinear, x: &[f32], rows: &[usize], y: &mut [f32]) {
    let (cols_in, cols_out) = (adapter.in_features, adapter.out_features);
    for &r in rows {
        let y_row = &mut y[r * cols_out..][..cols_out];
        adapter.add_to(&x[r * cols_in..][..cols_in], 1, y_row);
    }
}

/// A shared base model seen through adapters: what a request with adapters runs on (one set,
/// or a stack of them), or a batch of requests through adapters of their own.
pub struct AdaptedModel<'a> {
    base: &'a dyn LanguageModel,
    adaptable: Option<&'a dyn Adaptable>,
    adapters: RowAdapters<'a>,
}

impl<'a> AdaptedModel<'a> {
    /// `base` through one adapter set.
    pub fn new(base: &'a dyn LanguageModel, adapters: &'a Adapters) -> Result<Self, AdapterError> {
        Self::by_rows(base, RowAdapters::stack(&[adapters]))
    }

    /// `base` with its rows through `adapters`, each set checked against it; the base model
    /// itself where no row is adapted.
    pub fn by_rows(
        base: &'a dyn LanguageModel,
        adapters: RowAdapters<'a>,
    ) -> Result<Self, AdapterError> {
        for set in adapters.sets() {
            set.check(base)?;
        }
        Self::of_checked(base, adapters)
    }

    /// [`by_rows`](Self::by_rows) for sets already checked against `base` (a batch's, each
    /// checked as its job began): the check lists every layer the model has, too much work for
    /// each decoding step.
    pub fn of_checked(
        base: &'a dyn LanguageModel,
        adapters: RowAdapters<'a>,
    ) -> Result<Self, AdapterError> {
        let adaptable = if adapters.is_empty() {
            None
        } else {
            let unsupported = || AdapterError::UnsupportedModel(base.info().model_type.clone());
            Some(base.adaptable().ok_or_else(unsupported)?)
        };
        Ok(AdaptedModel {
            base,
            adaptable,
            adapters,
        })
    }
}

impl LanguageModel for AdaptedModel<'_> {
    fn info(&self) -> &ModelInfo {
        self.base.info()
    }

    fn new_cache(&self) -> Result<Cache, ForwardError> {
        self.base.new_cache()
    }

    fn forward(
        &self,
        tokens: &[u32],
        cache: &mut Cache,
        logits: Logits,
    ) -> Result<Tensor, ForwardError> {
        match self.adaptable {
            Some(model) => {
                let adapters = PassAdapters::Rows(&self.adapters);
                model.forward_adapted(tokens, cache, logits, adapters)
            }
            None => self.base.forward(tokens, cache, logits),
        }
    }

    fn forward_batch(
        &self,
        tokens: &[u32],
        caches: &mut [&mut Cache],
    ) -> Result<Tensor, ForwardError> {
        match self.adaptable {
            Some(model) => {
                let adapters = PassAdapters::Rows(&self.adapters);
                model.forward_batch_adapted(tokens, caches, adapters)
            }
            None => self.base.forward_batch(tokens, caches),
        }
    }
}
