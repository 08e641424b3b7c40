//! Sparse mixtures of experts: the stacked expert weights of mlx-lm's `switch_layers.py`
//! (`SwitchGLU`) and the routed block of `qwen3_next.py` (`Qwen3NextSparseMoeBlock`).

pub(crate) mod grad;

use oxlm_engine::cpu::elementwise::softmax_inplace;
use oxlm_engine::{ops, FloatMatrix, Tensor};

use crate::checkpoint::{RawTensor, Scope};
use crate::layers::{experts_shape, linear_shape, Linear, Mlp, OpResult, QuantizedArrays, Weight};
use crate::lora::{LinearShape, ModuleAdapters};
use crate::LoadError;

fn shape_error(name: &str, t: &RawTensor, expected: String) -> LoadError {
    LoadError::TensorShape {
        name: name.to_string(),
        found: t.shape.clone(),
        dtype: t.dtype.to_string(),
        expected,
    }
}

/// Splits the module's `[experts, rows, cols]` stack `weight` (quantized when `scales` exist)
/// into one `[rows, cols]` matrix per expert, each still viewing the checkpoint's bytes.
pub fn load_stacked(
    vb: &mut Scope,
    experts: usize,
    rows: usize,
    cols: usize,
) -> Result<Vec<Weight>, LoadError> {
    let name = vb.path_of("weight");
    let weight = vb.take("weight")?;
    let engine_err = |source| LoadError::Engine {
        name: name.clone(),
        source,
    };
    let path = vb.path().to_string();
    // One expert's slice of a stack whose arrays hold `per_expert` bytes each.
    let part = |t: &RawTensor, e: usize, what: &str| {
        let per_expert = t.data.len() / experts;
        t.data
            .slice(e * per_expert, per_expert)
            .ok_or_else(|| shape_error(&format!("{path}.{what}"), t, "a stack per expert".into()))
    };
    if !vb.contains("scales") {
        if weight.shape != [experts, rows, cols] || !weight.dtype.is_float() {
            return Err(shape_error(
                &name,
                &weight,
                format!("[{experts}, {rows}, {cols}] floats"),
            ));
        }
        return (0..experts)
            .map(|e| {
                let mut w = FloatMatrix::new(rows, cols, weight.dtype, part(&weight, e, "weight")?)
                    .map(Weight::Dense)
                    .map_err(engine_err)?;
                w.place(vb.device()).map_err(engine_err)?;
                Ok(w)
            })
            .collect();
    }
    let arrays = QuantizedArrays::take(vb, weight, &[experts], rows, cols)?;
    (0..experts)
        .map(|e| {
            let mut w = arrays.matrix(rows, cols, |t, what| part(t, e, what))?;
            w.place(vb.device()).map_err(engine_err)?;
            Ok(Weight::Quantized(w))
        })
        .collect()
}

/// One GLU block per expert from the module's stacked `{gate,up,down}_proj` tensors.
pub fn load_experts(
    vb: &mut Scope,
    experts: usize,
    dim: usize,
    intermediate: usize,
) -> Result<Vec<Mlp>, LoadError> {
    let gates = load_stacked(&mut vb.pp("gate_proj"), experts, intermediate, dim)?;
    let ups = load_stacked(&mut vb.pp("up_proj"), experts, intermediate, dim)?;
    let downs = load_stacked(&mut vb.pp("down_proj"), experts, dim, intermediate)?;
    let linear = |weight| Linear { weight, bias: None };
    Ok(gates
        .into_iter()
        .zip(ups)
        .zip(downs)
        .map(|((g, u), d)| Mlp {
            gate_proj: linear(g),
            up_proj: linear(u),
            down_proj: linear(d),
        })
        .collect())
}

/// Runs expert `e` once on all the rows of `x` (`[n, dim]`) routed to it (`routed[e]` holds
/// `(token, weight)` pairs), so only the chosen experts' weights are read, and sums the
/// weighted outputs per token.
pub fn dispatch(
    x: &Tensor,
    routed: &[Vec<(usize, f32)>],
    run_expert: impl Fn(usize, &Tensor) -> OpResult<Tensor>,
) -> OpResult<Tensor> {
    let mut y = Tensor::zeros(x.shape().to_vec(), &x.device())?;
    for (e, tokens) in routed.iter().enumerate() {
        if tokens.is_empty() {
            continue;
        }
        let (rows, weights): (Vec<usize>, Vec<f32>) = tokens.iter().copied().unzip();
        let out = run_expert(e, &ops::gather_rows(x, &rows)?)?;
        ops::scatter_add_rows(&mut y, &out, &rows, &weights)?;
    }
    Ok(y)
}

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// Top-k routing over SwiGLU experts plus a sigmoid-gated shared expert.
pub struct SparseMoe {
    /// Router: `hidden → experts` logits.
    gate: Linear,
    /// One SwiGLU MLP per expert (`switch_mlp` holds them stacked).
    experts: Vec<Mlp>,
    top_k: usize,
    norm_topk_prob: bool,
    shared_expert: Mlp,
    shared_expert_gate: Linear,
}

impl SparseMoe {
    /// Its layers, as mlx-lm's default LoRA keys select them (under `mlp`).
    pub(crate) fn linears(&self) -> Vec<LinearShape> {
        let experts = &self.experts;
        let mut out = vec![
            linear_shape("mlp.gate", &self.gate),
            experts_shape("mlp.switch_mlp.gate_proj", experts, |m| &m.gate_proj),
            experts_shape("mlp.switch_mlp.up_proj", experts, |m| &m.up_proj),
            experts_shape("mlp.switch_mlp.down_proj", experts, |m| &m.down_proj),
        ];
        let shared = &self.shared_expert;
        out.extend([
            linear_shape("mlp.shared_expert.gate_proj", &shared.gate_proj),
            linear_shape("mlp.shared_expert.up_proj", &shared.up_proj),
            linear_shape("mlp.shared_expert.down_proj", &shared.down_proj),
        ]);
        out.push(linear_shape(
            "mlp.shared_expert_gate",
            &self.shared_expert_gate,
        ));
        out
    }

    #[allow(clippy::too_many_arguments)]
    pub fn load(
        vb: &mut Scope,
        dim: usize,
        experts: usize,
        top_k: usize,
        intermediate: usize,
        shared_intermediate: usize,
        norm_topk_prob: bool,
    ) -> Result<Self, LoadError> {
        let mlps = load_experts(&mut vb.pp("switch_mlp"), experts, dim, intermediate)?;
        Ok(SparseMoe {
            gate: Linear::load(&mut vb.pp("gate"), dim, experts, false)?,
            experts: mlps,
            top_k,
            norm_topk_prob,
            shared_expert: Mlp::load(&mut vb.pp("shared_expert"), dim, shared_intermediate, false)?,
            shared_expert_gate: Linear::load(&mut vb.pp("shared_expert_gate"), dim, 1, false)?,
        })
    }

    /// `x` is `[n, dim]`. Each expert runs once on all the tokens routed to it; routing is
    /// decided on the host from the router's logits. `lora` holds the adapters of the block's
    /// `mlp` (the router `gate` and `shared_expert_gate`), and `experts` and `shared` those of its
    /// `switch_mlp` and `shared_expert`.
    pub fn forward(
        &self,
        x: &Tensor,
        lora: ModuleAdapters,
        experts: ModuleAdapters,
        shared: ModuleAdapters,
    ) -> OpResult<Tensor> {
        let n = x.rows();
        let mut probs = self.gate.forward_adapted(x, lora.get("gate"))?.into_vec()?;
        let chosen = self.route(&mut probs);
        let routed = by_expert(&chosen, self.top_k, self.experts.len());
        let mut y = dispatch(x, &routed, |e, rows| {
            self.experts[e].forward_adapted(rows, experts.expert(e))
        })?;
        let shared = self.shared_expert.forward_adapted(x, shared)?;
        let gates: Vec<f32> = self
            .shared_expert_gate
            .forward_adapted(x, lora.get("shared_expert_gate"))?
            .into_vec()?
            .into_iter()
            .map(sigmoid)
            .collect();
        let all: Vec<usize> = (0..n).collect();
        ops::scatter_add_rows(&mut y, &shared, &all, &gates)?;
        Ok(y)
    }

    /// Turns each token's router logits (`[n, experts]`) into probabilities, in place, and
    /// returns its `top_k` experts, best first, with their weights: `[n, top_k]`.
    fn route(&self, probs: &mut [f32]) -> Vec<(usize, f32)> {
        let count = self.experts.len();
        let mut chosen = Vec::with_capacity(probs.len() / count * self.top_k);
        let mut order: Vec<usize> = Vec::with_capacity(count);
        for p in probs.chunks_exact_mut(count) {
            softmax_inplace(p);
            order.clear();
            order.extend(0..count);
            order.sort_by(|&a, &b| p[b].total_cmp(&p[a]).then(a.cmp(&b)));
            let top = &order[..self.top_k];
            let total: f32 = top.iter().map(|&e| p[e]).sum();
            chosen.extend(top.iter().map(|&e| {
                let weight = if self.norm_topk_prob {
                    p[e] / total
                } else {
                    p[e]
                };
                (e, weight)
            }));
        }
        chosen
    }
}

/// Each token's `top_k` choices of `(expert, weight)` as the slots (indices into `chosen`) of
/// each of `count` experts, in token order.
pub(crate) fn slots_by_expert(chosen: &[(usize, f32)], count: usize) -> Vec<Vec<usize>> {
    let mut slots = vec![Vec::new(); count];
    for (slot, &(e, _)) in chosen.iter().enumerate() {
        slots[e].push(slot);
    }
    slots
}

/// Each token's `top_k` choices of `(expert, weight)` as the `(token, weight)` pairs of each of
/// `count` experts, as [`dispatch`] takes them.
pub(crate) fn by_expert(
    chosen: &[(usize, f32)],
    top_k: usize,
    count: usize,
) -> Vec<Vec<(usize, f32)>> {
    let slots = slots_by_expert(chosen, count);
    let pairs = |slots: Vec<usize>| slots.into_iter().map(|s| (s / top_k, chosen[s].1));
    slots.into_iter().map(|s| pairs(s).collect()).collect()
}
