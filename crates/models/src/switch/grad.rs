//! Mixtures of experts as the backward pass sees them (see [`crate::decoder_grad`]): the
//! gradient reaches the chosen experts through their outputs and the router through the weights
//! it gave them (the choice itself is not differentiated, as mlx-lm stops its gradient).
//! [`RoutedSaved`] is the part every mixture shares; [`SparseMoe`] adds a shared expert and its
//! sigmoid gate where it has one.

use oxlm_engine::cpu::elementwise::add_inplace;
use oxlm_engine::ops::{self, Activation};
use oxlm_engine::Tensor;

use super::{slots_by_expert, Scoring, SparseMoe};
use crate::decoder_grad::{At, BlockAdapters, BlockGrads, GatedSaved, MlpGrad, MlpSaved};
use crate::layers::{Mlp, OpResult};
use crate::lora::ModuleAdapters;

/// What one expert's backward pass reads.
struct ExpertSaved {
    /// The indices of its choices in `chosen`, in token order.
    slots: Vec<usize>,
    /// Its input rows, and its output rows before weighting.
    x: Tensor,
    out: Tensor,
    mlp: GatedSaved,
}

/// Experts that each ran once on the rows routed to them: what their backward pass reads.
pub(crate) struct RoutedSaved {
    /// Per expert; `None` for one no token chose.
    experts: Vec<Option<ExpertSaved>>,
    activation: Activation,
    top_k: usize,
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(a, b)| a * b).sum()
}

impl RoutedSaved {
    /// For each row of `x`, the sum over its `top_k` choices in `chosen` (`(expert, weight)`,
    /// `top_k` per row) of the weight times that expert's output, with the experts' adapters
    /// from `lora` (their stacked module's); and itself.
    pub(crate) fn forward(
        experts: &[Mlp],
        activation: Activation,
        x: &Tensor,
        chosen: &[(usize, f32)],
        top_k: usize,
        lora: ModuleAdapters,
    ) -> OpResult<(Tensor, Self)> {
        let mut y = Tensor::zeros(x.shape().to_vec(), &x.device())?;
        let mut saved = Vec::with_capacity(experts.len());
        for (e, slots) in slots_by_expert(chosen, experts.len())
            .into_iter()
            .enumerate()
        {
            if slots.is_empty() {
                saved.push(None);
                continue;
            }
            let rows: Vec<usize> = slots.iter().map(|s| s / top_k).collect();
            let weights: Vec<f32> = slots.iter().map(|&s| chosen[s].1).collect();
            let xe = ops::gather_rows(x, &rows)?;
            let (out, mlp) = GatedSaved::forward(&experts[e], activation, &xe, lora.expert(e))?;
            ops::scatter_add_rows(&mut y, &out, &rows, &weights)?;
            saved.push(Some(ExpertSaved {
                slots,
                x: xe,
                out,
                mlp,
            }));
        }
        let routed = RoutedSaved {
            experts: saved,
            activation,
            top_k,
        };
        Ok((y, routed))
    }

    /// The gradient of the input and of each choice's weight for the output gradient `dy`;
    /// the gradients of the experts' adapters (under `module`) are added.
    pub(crate) fn backward(
        &self,
        experts: &[Mlp],
        module: &str,
        chosen: &[(usize, f32)],
        dy: &[f32],
        g: &mut BlockGrads,
    ) -> (Vec<f32>, Vec<f32>) {
        let (top_k, dim) = (self.top_k, dy.len() * self.top_k / chosen.len());
        let mut dx = vec![0.0; dy.len()];
        let mut d_weights = vec![0.0; chosen.len()];
        for (e, saved) in self.experts.iter().enumerate() {
            let Some(s) = saved else { continue };
            let mut dy_e = Vec::with_capacity(s.slots.len() * dim);
            for (r, &slot) in s.slots.iter().enumerate() {
                let dy_t = &dy[slot / top_k * dim..][..dim];
                let weight = chosen[slot].1;
                dy_e.extend(dy_t.iter().map(|d| d * weight));
                d_weights[slot] = dot(dy_t, &s.out.data()[r * dim..][..dim]);
            }
            let at = At {
                module,
                expert: Some(e),
            };
            let dx_e = (s.mlp).backward(&experts[e], self.activation, at, s.x.data(), &dy_e, g);
            for (&slot, d) in s.slots.iter().zip(dx_e.chunks_exact(dim)) {
                add_inplace(&mut dx[slot / top_k * dim..][..dim], d);
            }
        }
        (dx, d_weights)
    }
}

/// What a [`SparseMoe`]'s backward pass reads.
struct MoeSaved<'a> {
    moe: &'a SparseMoe,
    /// The router's scores `[n, experts]` (softmax or sigmoid); each token's chosen experts and
    /// weights.
    probs: Vec<f32>,
    chosen: Vec<(usize, f32)>,
    routed: RoutedSaved,
    shared: Option<SharedSaved>,
}

/// What the shared expert's backward pass reads.
struct SharedSaved {
    mlp: GatedSaved,
    out: Tensor,
    /// Its gate per token, after the sigmoid, where it has one.
    gates: Option<Vec<f32>>,
}

impl MlpGrad for &SparseMoe {
    fn forward_saving<'s>(
        &'s self,
        x: &Tensor,
        lora: BlockAdapters,
    ) -> OpResult<(Tensor, Box<dyn MlpSaved + 's>)> {
        let moe: &SparseMoe = self;
        if moe.routing.weigh_inputs {
            return Err(oxlm_engine::EngineError::Unsupported(
                "LoRA training through a mixture that weighs its experts' inputs".into(),
            ));
        }
        let (router_module, router_name) = moe.names.router_key;
        let mut probs = moe
            .gate
            .forward_adapted(x, lora.module(router_module).get(router_name))?
            .into_vec()?;
        let chosen = moe.route(&mut probs);
        let switch = lora.module(moe.names.experts_key);
        let silu = Activation::Silu;
        let (mut y, routed) = RoutedSaved::forward(
            &moe.experts,
            moe.activation,
            x,
            &chosen,
            moe.routing.top_k(),
            switch,
        )?;
        let shared = match &moe.shared {
            Some(expert) => {
                let shared_lora = lora.module(expert.names.path);
                let (out, mlp) = GatedSaved::forward(&expert.mlp, silu, x, shared_lora)?;
                let gates = expert.add_gated(x, &out, lora.module(moe.names.module), &mut y)?;
                Some(SharedSaved { mlp, out, gates })
            }
            None => None,
        };
        let saved = MoeSaved {
            moe,
            probs,
            chosen,
            routed,
            shared,
        };
        Ok((y, Box::new(saved)))
    }
}

impl MoeSaved<'_> {
    /// The gradient of the router's logits `[n, experts]` for the gradient of each choice's
    /// weight, through the scale, the top-k normalization (where there is one) and the softmax
    /// or sigmoid (the correction bias and the groups only choose).
    fn router_grad(&self, d_weights: &[f32]) -> Vec<f32> {
        let routing = &self.moe.routing.choice;
        let (count, k, scale) = (routing.experts, routing.top_k, routing.scale);
        let renorm = routing.renormalizes();
        let mut d_logits = vec![0.0; self.probs.len()];
        let mut dp = vec![0.0; count];
        for (t, p) in self.probs.chunks_exact(count).enumerate() {
            let (chosen, dw) = (&self.chosen[t * k..][..k], &d_weights[t * k..][..k]);
            dp.fill(0.0);
            if renorm {
                // weight_i = c · p_i / Σ p_top:
                // dp_j = c · (dw_j - Σ_i dw_i · weight_i / c) / Σ p_top
                let total: f32 = chosen.iter().map(|&(e, _)| p[e]).sum();
                let mean: f32 = chosen
                    .iter()
                    .zip(dw)
                    .map(|(&(_, w), d)| w / scale * d)
                    .sum();
                for (&(e, _), d) in chosen.iter().zip(dw) {
                    dp[e] = scale * (d - mean) / total;
                }
            } else {
                for (&(e, _), &d) in chosen.iter().zip(dw) {
                    dp[e] = scale * d;
                }
            }
            let d_logits = &mut d_logits[t * count..][..count];
            match routing.scoring {
                Scoring::Softmax => {
                    let through = dot(p, &dp);
                    for ((dl, &pj), &dpj) in d_logits.iter_mut().zip(p).zip(&dp) {
                        *dl = pj * (dpj - through);
                    }
                }
                Scoring::Sigmoid => {
                    for ((dl, &pj), &dpj) in d_logits.iter_mut().zip(p).zip(&dp) {
                        *dl = pj * (1.0 - pj) * dpj;
                    }
                }
            }
        }
        d_logits
    }
}

impl MlpSaved for MoeSaved<'_> {
    fn backward(&self, x: &[f32], dy: &[f32], g: &mut BlockGrads) -> Vec<f32> {
        let moe = self.moe;
        let switch = moe.names.experts_key;
        let (mut dx, d_weights) = (self.routed).backward(&moe.experts, switch, &self.chosen, dy, g);
        let d_logits = self.router_grad(&d_weights);
        let (router_module, router_name) = moe.names.router_key;
        let d_x_router = g.through(&moe.gate, router_module, router_name, x, &d_logits);
        add_inplace(&mut dx, &d_x_router);
        let (Some(saved), Some(expert)) = (&self.shared, &moe.shared) else {
            return dx;
        };
        let (at, silu) = (At::from(expert.names.path), Activation::Silu);
        let (Some(gates), Some(gate)) = (&saved.gates, &expert.gate) else {
            let dx_shared = (saved.mlp).backward(&expert.mlp, silu, at, x, dy, g);
            add_inplace(&mut dx, &dx_shared);
            return dx;
        };
        let n = gates.len();
        let dim = dy.len() / n;
        let shared_out = saved.out.data();
        let mut d_shared = Vec::with_capacity(dy.len());
        let mut d_gate = Vec::with_capacity(n);
        for (t, &gate) in gates.iter().enumerate() {
            let dy_t = &dy[t * dim..][..dim];
            d_shared.extend(dy_t.iter().map(|d| d * gate));
            d_gate.push(gate * (1.0 - gate) * dot(dy_t, &shared_out[t * dim..][..dim]));
        }
        let dx_shared = (saved.mlp).backward(&expert.mlp, silu, at, x, &d_shared, g);
        add_inplace(&mut dx, &dx_shared);
        let d_x_gate = g.through(gate, "mlp", "shared_expert_gate", x, &d_gate);
        add_inplace(&mut dx, &d_x_gate);
        dx
    }
}
