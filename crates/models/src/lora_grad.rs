//! The training loss of mlx-lm's LoRA trainer and the pieces of its gradient that do not depend
//! on the architecture: which positions count, and the backward pass of an adapted linear layer.
//! Only the adapter matrices get gradients; the frozen layers pass gradients through.

use std::collections::BTreeMap;

use oxlm_engine::cpu::elementwise::add_inplace;
use oxlm_engine::grad::{cross_entropy, dense_matmul_backward, quantized_matmul_backward};
use oxlm_engine::KvPrecision;

use crate::layers::{Linear, Weight};
use crate::lora::{Adapters, LoraLinear};
use crate::{ForwardError, LanguageModel, Logits};

/// One sequence of a batch as the loss sees it: the model reads `inputs` and is scored on
/// predicting `targets[t]` at every position `t >= loss_from`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Example {
    pub inputs: Vec<u32>,
    pub targets: Vec<u32>,
    pub loss_from: usize,
}

impl Example {
    /// Row `row` of a padded batch with the `(offset, length)` mlx-lm keeps for it, masked as
    /// `default_loss` masks it: step `s` (target `row[s]`) counts when `offset <= s <= length`
    /// and `s < row.len()`, so the pad token right after the sequence is a target too. Positions
    /// past the last counted step cannot change the loss (attention is causal) and are dropped.
    /// `None` when no step counts.
    pub fn from_padded(row: &[u32], offset: usize, length: usize) -> Option<Example> {
        let first = offset.max(1);
        let last = length.min(row.len().saturating_sub(1));
        (first <= last).then(|| Example {
            inputs: row[..last].to_vec(),
            targets: row[1..=last].to_vec(),
            loss_from: first - 1,
        })
    }

    /// Positions that count towards the loss.
    pub fn scored(&self) -> usize {
        self.inputs.len() - self.loss_from
    }
}

/// Gradients of one adapted layer, shaped as its `a` and `b`.
#[derive(Debug, Clone, PartialEq)]
pub struct LoraGrad {
    pub a: Vec<f32>,
    pub b: Vec<f32>,
}

impl LoraGrad {
    /// Zero gradients for `layer`.
    pub fn zeros(layer: &LoraLinear) -> Self {
        LoraGrad {
            a: vec![0.0; layer.a.len()],
            b: vec![0.0; layer.b.len()],
        }
    }
}

/// The gradients of a set of adapters, shaped as [`Adapters`]: one per adapted layer, and one per
/// expert of each adapted stack of experts.
#[derive(Debug, Clone, PartialEq)]
pub struct AdapterGrads {
    pub layers: BTreeMap<String, LoraGrad>,
    pub experts: BTreeMap<String, Vec<LoraGrad>>,
}

impl AdapterGrads {
    /// Zero gradients for every layer of `adapters`.
    pub fn zeros(adapters: &Adapters) -> Self {
        let layers = (adapters.layers.iter())
            .map(|(path, l)| (path.clone(), LoraGrad::zeros(l)))
            .collect();
        let experts = (adapters.experts.iter())
            .map(|(path, each)| (path.clone(), each.iter().map(LoraGrad::zeros).collect()))
            .collect();
        AdapterGrads { layers, experts }
    }

    /// Adds `other`'s gradients, layer by layer, to these (of the same adapters).
    pub fn add(&mut self, other: &AdapterGrads) {
        for (sum, g) in self.values_mut().zip(other.values()) {
            for (s, v) in sum.a.iter_mut().zip(&g.a).chain(sum.b.iter_mut().zip(&g.b)) {
                *s += v;
            }
        }
    }

    /// Divides every gradient by `n`.
    pub fn divide(&mut self, n: f32) {
        for g in self.values_mut() {
            for v in g.a.iter_mut().chain(g.b.iter_mut()) {
                *v /= n;
            }
        }
    }

    fn values(&self) -> impl Iterator<Item = &LoraGrad> {
        self.layers.values().chain(self.experts.values().flatten())
    }

    fn values_mut(&mut self) -> impl Iterator<Item = &mut LoraGrad> {
        self.layers
            .values_mut()
            .chain(self.experts.values_mut().flatten())
    }

    /// Every gradient with the name of its layer (`path` or, for an expert, `path[e]`).
    pub fn named(&self) -> impl Iterator<Item = (String, &LoraGrad)> {
        let layers = self.layers.iter().map(|(path, g)| (path.clone(), g));
        let experts = self.experts.iter().flat_map(|(path, each)| {
            (each.iter().enumerate()).map(move |(e, g)| (format!("{path}[{e}]"), g))
        });
        layers.chain(experts)
    }
}

/// The mean loss of a batch and its gradient with respect to each adapter matrix.
#[derive(Debug, Clone)]
pub struct LossAndGrads {
    /// Mean cross-entropy over the scored positions of every example.
    pub loss: f32,
    /// Scored positions (mlx-lm's `ntoks`).
    pub tokens: usize,
    pub grads: AdapterGrads,
}

/// What [`crate::lora::Adaptable::grads_of_sums`] gives: the summed cross-entropy of each
/// example's scored positions (minus the log-probability of its scored targets), by group, and
/// the gradient of the loss made of them.
#[derive(Debug, Clone)]
pub struct SumsAndGrads {
    pub sums: Vec<Vec<f64>>,
    pub grads: AdapterGrads,
}

/// `dx[m, in] = dy[m, out] · W` for a layer's base weights.
pub(crate) fn base_input_grad(weight: &Weight, dy: &[f32], m: usize) -> Vec<f32> {
    let mut dx = vec![0.0; m * weight.cols()];
    match weight {
        Weight::Dense(w) => dense_matmul_backward(w, dy, m, &mut dx),
        Weight::Quantized(w) => quantized_matmul_backward(w, dy, m, &mut dx),
    }
    dx
}

/// Backward of `y = x·Wᵀ (+ b) + s·(dropout(x)·A)·B` for `m` rows: adds the adapter's gradients
/// into `grad` and returns `dx` when `need_dx` (the lowest adapted layers need none).
pub(crate) fn linear_backward(
    linear: &Linear,
    adapter: Option<(&LoraLinear, &mut LoraGrad)>,
    x: &[f32],
    dy: &[f32],
    m: usize,
    need_dx: bool,
) -> Option<Vec<f32>> {
    let mut dx = need_dx.then(|| base_input_grad(&linear.weight, dy, m));
    let Some((lora, grad)) = adapter else {
        return dx;
    };
    let (r, din, dout) = (lora.rank, lora.in_features, lora.out_features);
    let x = lora.dropped(x);
    let u = lora.down(&x, m);
    // g = s·dy·Bᵀ is the gradient of u = x·A.
    let mut g = vec![0.0f32; m * r];
    for ((dyr, gr), ur) in dy
        .chunks_exact(dout)
        .zip(g.chunks_exact_mut(r))
        .zip(u.chunks_exact(r))
    {
        for (k, (gv, br)) in gr.iter_mut().zip(lora.b.chunks_exact(dout)).enumerate() {
            *gv = lora.scale * br.iter().zip(dyr).map(|(b, d)| b * d).sum::<f32>();
            // dB[k] += s·u[k]·dy
            let su = lora.scale * ur[k];
            for (db, &d) in grad.b[k * dout..(k + 1) * dout].iter_mut().zip(dyr) {
                *db += su * d;
            }
        }
    }
    // dA += xᵀ·g; dx += g·Aᵀ
    for (xr, gr) in x.chunks_exact(din).zip(g.chunks_exact(r)).take(m) {
        for (&xv, da) in xr.iter().zip(grad.a.chunks_exact_mut(r)) {
            for (d, &gv) in da.iter_mut().zip(gr) {
                *d += xv * gv;
            }
        }
    }
    if let Some(dx) = dx.as_mut() {
        let mut through = vec![0.0f32; m * din];
        for (tr, gr) in through.chunks_exact_mut(din).zip(g.chunks_exact(r)) {
            for (t, ar) in tr.iter_mut().zip(lora.a.chunks_exact(r)) {
                *t = ar.iter().zip(gr).map(|(a, g)| a * g).sum::<f32>();
            }
        }
        // The dropout's mask and scale are its own derivative.
        if let Some(dropout) = &lora.dropout {
            dropout.apply(&mut through);
        }
        add_inplace(dx, &through);
    }
    dx
}

/// The summed cross-entropy of `examples` under `model` (adapters applied by wrapping it in an
/// `AdaptedModel`) and the number of scored positions: mlx-lm's `evaluate` before its division.
pub fn loss_sum(
    model: &dyn LanguageModel,
    examples: &[Example],
) -> Result<(f64, usize), ForwardError> {
    let (mut sum, mut tokens) = (0.0f64, 0);
    for ex in examples {
        sum += scored_cross_entropy(model, ex)?;
        tokens += ex.scored();
    }
    Ok((sum, tokens))
}

/// The cross-entropy of `ex`'s scored positions under `model`, summed: minus the
/// log-probability the model gives its scored targets.
pub fn scored_cross_entropy(model: &dyn LanguageModel, ex: &Example) -> Result<f64, ForwardError> {
    let vocab = model.info().vocab_size;
    // Scoring reads no cache back token by token: f32 keys cost nothing and keep the loss the
    // one training computes.
    let mut cache = model.new_cache_in(KvPrecision::F32)?;
    let logits = model.forward(&ex.inputs, &mut cache, Logits::All)?;
    let rows = logits.data().chunks_exact(vocab).zip(&ex.targets);
    let scored = rows.skip(ex.loss_from);
    Ok(scored
        .map(|(row, &target)| cross_entropy(row, target as usize) as f64)
        .sum())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `default_loss` scores steps `offset..=length` below the padded width: the zero pad right
    /// after a sequence is a target too.
    #[test]
    fn padded_rows_are_masked_as_mlx_lm_masks_them() {
        let row = [5, 6, 7, 0, 0, 0];
        let ex = Example::from_padded(&row, 0, 3).unwrap();
        assert_eq!(
            (ex.inputs, ex.targets, ex.loss_from),
            (vec![5, 6, 7], vec![6, 7, 0], 0)
        );
        let ex = Example::from_padded(&row, 2, 3).unwrap();
        assert_eq!((ex.scored(), ex.loss_from), (2, 1));
        // Cut at max_seq_length: the row is exactly as long as the sequence.
        let ex = Example::from_padded(&[5, 6, 7], 0, 3).unwrap();
        assert_eq!(ex.targets, [6, 7]);
        assert!(Example::from_padded(&row, 4, 3).is_none());
    }
}
