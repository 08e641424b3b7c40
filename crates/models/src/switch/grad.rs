//! The mixture of experts as the backward pass sees it (see [`crate::decoder_grad`]): the
//! gradient reaches the chosen experts through their outputs, the router through the weights
//! it gave them (the choice itself is not differentiated, as mlx-lm stops its gradient), and
//! the shared expert and its sigmoid gate.

use oxlm_engine::cpu::elementwise::add_inplace;
use oxlm_engine::ops::{self, Activation};
use oxlm_engine::Tensor;

use super::{sigmoid, SparseMoe};
use crate::decoder_grad::{At, BlockAdapters, BlockGrads, GatedSaved, MlpGrad, MlpSaved};
use crate::layers::OpResult;

/// What one expert's backward pass reads.
struct ExpertSaved {
    /// The tokens routed to it, and for each the index of its choice in [`MoeSaved::chosen`].
    rows: Vec<usize>,
    slots: Vec<usize>,
    /// Its input rows and its output rows before weighting.
    x: Tensor,
    out: Tensor,
    mlp: GatedSaved,
}

/// What the mixture's backward pass reads.
struct MoeSaved<'a> {
    moe: &'a SparseMoe,
    /// The router's probabilities `[n, experts]`; each token's chosen experts and weights.
    probs: Vec<f32>,
    chosen: Vec<(usize, f32)>,
    /// Per expert; `None` for one no token chose.
    experts: Vec<Option<ExpertSaved>>,
    shared: GatedSaved,
    shared_out: Tensor,
    /// The shared expert's gate per token, after its sigmoid.
    shared_gates: Vec<f32>,
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(a, b)| a * b).sum()
}

impl MlpGrad for &SparseMoe {
    fn forward_saving<'s>(
        &'s self,
        x: &Tensor,
        lora: BlockAdapters,
    ) -> OpResult<(Tensor, Box<dyn MlpSaved + 's>)> {
        let moe: &SparseMoe = self;
        let n = x.rows();
        let router = lora.module("mlp");
        let mut probs = moe
            .gate
            .forward_adapted(x, router.get("gate"))?
            .into_vec()?;
        let chosen = moe.route(&mut probs);
        let switch = lora.module("mlp.switch_mlp");
        let mut y = Tensor::zeros(x.shape().to_vec(), &x.device())?;
        let mut experts = Vec::with_capacity(moe.experts.len());
        for (e, tokens) in moe.by_expert(&chosen).into_iter().enumerate() {
            if tokens.is_empty() {
                experts.push(None);
                continue;
            }
            let (rows, weights): (Vec<usize>, Vec<f32>) = tokens.into_iter().unzip();
            let slots = rows
                .iter()
                .map(|&t| {
                    let mine = |&s: &usize| chosen[s].0 == e;
                    (t * moe.top_k..(t + 1) * moe.top_k)
                        .find(mine)
                        .expect("routed")
                })
                .collect();
            let xe = ops::gather_rows(x, &rows)?;
            let (out, mlp) =
                GatedSaved::forward(&moe.experts[e], Activation::Silu, &xe, switch.expert(e))?;
            ops::scatter_add_rows(&mut y, &out, &rows, &weights)?;
            experts.push(Some(ExpertSaved {
                rows,
                slots,
                x: xe,
                out,
                mlp,
            }));
        }
        let shared_lora = lora.module("mlp.shared_expert");
        let (shared_out, shared) =
            GatedSaved::forward(&moe.shared_expert, Activation::Silu, x, shared_lora)?;
        let shared_gates: Vec<f32> = (moe.shared_expert_gate)
            .forward_adapted(x, router.get("shared_expert_gate"))?
            .into_vec()?
            .into_iter()
            .map(sigmoid)
            .collect();
        let all: Vec<usize> = (0..n).collect();
        ops::scatter_add_rows(&mut y, &shared_out, &all, &shared_gates)?;
        let saved = MoeSaved {
            moe,
            probs,
            chosen,
            experts,
            shared,
            shared_out,
            shared_gates,
        };
        Ok((y, Box::new(saved)))
    }
}

impl MoeSaved<'_> {
    /// The gradient of the router's logits `[n, experts]` for the gradient of each choice's
    /// weight, through the top-k normalization (where there is one) and the softmax.
    fn router_grad(&self, d_weights: &[f32]) -> Vec<f32> {
        let (count, k) = (self.moe.experts.len(), self.moe.top_k);
        let mut d_logits = vec![0.0; self.probs.len()];
        let mut dp = vec![0.0; count];
        for (t, p) in self.probs.chunks_exact(count).enumerate() {
            let (chosen, dw) = (&self.chosen[t * k..][..k], &d_weights[t * k..][..k]);
            dp.fill(0.0);
            if self.moe.norm_topk_prob {
                // weight_i = p_i / Σ p_top: dp_j = (dw_j - Σ_i dw_i · weight_i) / Σ p_top
                let total: f32 = chosen.iter().map(|&(e, _)| p[e]).sum();
                let mean: f32 = chosen.iter().zip(dw).map(|(&(_, w), d)| w * d).sum();
                for (&(e, _), d) in chosen.iter().zip(dw) {
                    dp[e] = (d - mean) / total;
                }
            } else {
                for (&(e, _), &d) in chosen.iter().zip(dw) {
                    dp[e] = d;
                }
            }
            let through = dot(p, &dp);
            for ((dl, &pj), &dpj) in d_logits[t * count..][..count].iter_mut().zip(p).zip(&dp) {
                *dl = pj * (dpj - through);
            }
        }
        d_logits
    }
}

impl MlpSaved for MoeSaved<'_> {
    fn backward(&self, x: &[f32], dy: &[f32], g: &mut BlockGrads) -> Vec<f32> {
        let moe = self.moe;
        let n = self.shared_gates.len();
        let dim = dy.len() / n;
        let mut dx = vec![0.0; x.len()];
        let mut d_weights = vec![0.0; self.chosen.len()];
        for (e, saved) in self.experts.iter().enumerate() {
            let Some(s) = saved else { continue };
            let mut dy_e = Vec::with_capacity(s.rows.len() * dim);
            for (r, (&t, &slot)) in s.rows.iter().zip(&s.slots).enumerate() {
                let dy_t = &dy[t * dim..][..dim];
                let weight = self.chosen[slot].1;
                dy_e.extend(dy_t.iter().map(|d| d * weight));
                d_weights[slot] = dot(dy_t, &s.out.data()[r * dim..][..dim]);
            }
            let at = At {
                module: "mlp.switch_mlp",
                expert: Some(e),
            };
            let mlp = &moe.experts[e];
            let dx_e = (s.mlp).backward(mlp, Activation::Silu, at, s.x.data(), &dy_e, g);
            for (&t, d) in s.rows.iter().zip(dx_e.chunks_exact(dim)) {
                add_inplace(&mut dx[t * dim..][..dim], d);
            }
        }
        let d_logits = self.router_grad(&d_weights);
        let router = At::from("mlp");
        add_inplace(&mut dx, &g.through(&moe.gate, router, "gate", x, &d_logits));
        let shared_out = self.shared_out.data();
        let mut d_shared = Vec::with_capacity(dy.len());
        let mut d_gate = Vec::with_capacity(n);
        for (t, &gate) in self.shared_gates.iter().enumerate() {
            let dy_t = &dy[t * dim..][..dim];
            d_shared.extend(dy_t.iter().map(|d| d * gate));
            d_gate.push(gate * (1.0 - gate) * dot(dy_t, &shared_out[t * dim..][..dim]));
        }
        let at = At::from("mlp.shared_expert");
        let shared = &moe.shared_expert;
        let dx_shared = (self.shared).backward(shared, Activation::Silu, at, x, &d_shared, g);
        add_inplace(&mut dx, &dx_shared);
        let gate = &moe.shared_expert_gate;
        add_inplace(
            &mut dx,
            &g.through(gate, router, "shared_expert_gate", x, &d_gate),
        );
        dx
    }
}
