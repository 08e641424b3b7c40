//! Gemma 4's blocks as the backward pass sees them (see [`crate::decoder_grad`]): attention with
//! its value norm and, in the KV-shared layers, over another layer's keys and values; the
//! mixture of experts beside the dense MLP; the per-layer input gate as the block's tail, and the
//! layer scalar.

use oxlm_engine::cpu::attention::Options;
use std::cell::RefCell;
use std::collections::BTreeMap;
use std::rc::Rc;

use oxlm_engine::cpu::elementwise::{add_inplace, softmax_inplace};
use oxlm_engine::grad::gelu_approx_mul_backward;
use oxlm_engine::ops::{self, Activation};
use oxlm_engine::params::Heads;
use oxlm_engine::Tensor;

use super::{Attention, Gemma4, MoeBlock, PerLayerGate};
use crate::decoder_grad::{
    norm_backward, norm_keeping_input, through_norm, At, AttentionShape, BlockAdapters, BlockGrads,
    Decoder, DecoderBlock, GatedMlpGrad, GatedSaved, MixerGrad, MixerSaved, MlpGrad, MlpSaved,
    SequenceAttention,
};
use crate::layers::{Mlp, OpResult, RmsNorm};
use crate::lora::ModuleAdapters;
use crate::switch::grad::RoutedSaved;

/// The keys and values of a layer that later layers read, over one sequence: as attention read
/// them, and the gradients the readers send back for its own backward pass.
#[derive(Default)]
struct SharedKv {
    k: Vec<f32>,
    v: Vec<f32>,
    dk: Vec<f32>,
    dv: Vec<f32>,
}

/// Per layer whose keys and values are read by others. One per sequence: the blocks of
/// [`Decoder::blocks`] share it.
type KvStore = Rc<RefCell<BTreeMap<usize, SharedKv>>>;

impl Decoder for Gemma4 {
    fn embed(&self, tokens: &[u32]) -> OpResult<Tensor> {
        let mut h = self.embed_tokens.forward(tokens)?;
        ops::scale_inplace(&mut h, self.embed_scale)?;
        Ok(h)
    }

    fn blocks(&self, tokens: &[u32]) -> OpResult<Vec<DecoderBlock<'_>>> {
        let per_layer_inputs = match &self.per_layer_inputs {
            Some(p) => {
                let h = self.embed(tokens)?;
                Some((p.forward(tokens, &h, self.info.hidden_size)?, p.dim))
            }
            None => None,
        };
        let store = KvStore::default();
        let mut blocks = Vec::with_capacity(self.layers.len());
        for (i, b) in self.layers.iter().enumerate() {
            let attn = &b.self_attn;
            let tail = match (&b.per_layer, &per_layer_inputs) {
                (Some(gate), Some((inputs, dim))) => Some(Box::new(PerLayerGrad {
                    gate,
                    input: ops::columns(inputs, i * dim, *dim)?,
                }) as Box<dyn MlpGrad>),
                _ => None,
            };
            let (mlp_norm, mlp): (_, Box<dyn MlpGrad>) = match &b.moe {
                Some(moe) => (
                    None,
                    Box::new(MoeGrad {
                        moe,
                        mlp: &b.mlp,
                        mlp_norm: &b.pre_feedforward_layernorm,
                    }),
                ),
                None => (
                    Some(&b.pre_feedforward_layernorm),
                    Box::new(GatedMlpGrad {
                        mlp: &b.mlp,
                        activation: Activation::GeluApprox,
                    }),
                ),
            };
            blocks.push(DecoderBlock {
                input_norm: Some(&b.input_layernorm),
                mixer: Box::new(AttentionGrad {
                    attn,
                    window: attn.sliding.then_some(self.sliding_window),
                    layer: i,
                    source: b.kv_source,
                    store: store.clone(),
                }),
                mixer_out_norm: Some(&b.post_attention_layernorm),
                mlp_norm,
                mlp,
                mlp_out_norm: Some(&b.post_feedforward_layernorm),
                tail,
                output_scale: b.layer_scalar,
                branch_scale: 1.0,
            });
        }
        Ok(blocks)
    }
}

/// Gemma 4's attention in block `layer`, over its own keys and values or, in a KV-shared layer,
/// those of layer `source`.
struct AttentionGrad<'a> {
    attn: &'a Attention,
    window: Option<usize>,
    layer: usize,
    source: usize,
    store: KvStore,
}

/// What its backward pass reads.
struct AttentionSaved<'a> {
    mixer: &'a AttentionGrad<'a>,
    core: SequenceAttention<'a>,
    /// The value norm's input (the value projection's output, or the key projection's where
    /// values are keys), in a layer with keys and values of its own.
    v_in: Option<Tensor>,
    /// `o_proj`'s input.
    out: Tensor,
}

impl<'a> MixerGrad for AttentionGrad<'a> {
    fn module(&self) -> &'static str {
        "self_attn"
    }

    fn forward_saving<'s>(
        &'s self,
        x: &Tensor,
        lora: ModuleAdapters,
    ) -> OpResult<(Tensor, Box<dyn MixerSaved + 's>)> {
        let a = self.attn;
        let q = a.q_proj.forward_adapted(x, lora.get("q_proj"))?;
        let shape = AttentionShape {
            heads: Heads {
                heads: a.heads,
                kv_heads: a.kv_heads,
                head_dim: a.head_dim,
            },
            options: Options::scaled(1.0),
            window: self.window,
            rope: &a.rope,
            q_norm: Some(&a.q_norm),
            k_norm: a.kv.as_ref().map(|kv| &kv.k_norm),
        };
        let (out, core, v_in) = match &a.kv {
            Some(kv) => {
                let k = kv.k_proj.forward_adapted(x, lora.get("k_proj"))?;
                let mut v = match &kv.v_proj {
                    Some(v_proj) => v_proj.forward_adapted(x, lora.get("v_proj"))?,
                    None => k.try_clone()?,
                };
                let v_in = norm_keeping_input(Some(&kv.v_norm), &mut v)?;
                let (out, core) = SequenceAttention::forward(shape, q, k, &v)?;
                let (k, v) = core.keys_values();
                let mut store = self.store.borrow_mut();
                let shared = store.entry(self.layer).or_default();
                (shared.k, shared.v) = (k.to_vec(), v.to_vec());
                (out, core, v_in)
            }
            None => {
                let store = self.store.borrow();
                let shared = &store[&self.source];
                let (k, v) = (shared.k.clone(), shared.v.clone());
                let (out, core) = SequenceAttention::over(shape, q, k, v)?;
                (out, core, None)
            }
        };
        let y = a.o_proj.forward_adapted(&out, lora.get("o_proj"))?;
        let saved = AttentionSaved {
            mixer: self,
            core,
            v_in,
            out,
        };
        Ok((y, Box::new(saved)))
    }
}

/// `sum += add`, where an empty `sum` is zeros.
fn accumulate(sum: &mut Vec<f32>, add: &[f32]) {
    if sum.is_empty() {
        sum.extend_from_slice(add);
    } else {
        add_inplace(sum, add);
    }
}

impl MixerSaved for AttentionSaved<'_> {
    fn backward(
        &self,
        x: &[f32],
        dy: &[f32],
        g: &mut BlockGrads,
        need_dx: bool,
    ) -> Option<Vec<f32>> {
        let (m, a) = (self.mixer, self.mixer.attn);
        let d_out = g.through(&a.o_proj, "self_attn", "o_proj", self.out.data(), dy);
        let (dq, mut dk, mut dv) = self.core.backward_over(&d_out);
        let mut store = m.store.borrow_mut();
        let Some(kv) = &a.kv else {
            // A reader sends its keys' and values' gradients to the layer that made them.
            let shared = store.get_mut(&m.source).expect("the source ran first");
            accumulate(&mut shared.dk, &dk);
            accumulate(&mut shared.dv, &dv);
            return g.inputs_of(&[(&a.q_proj, "q_proj", &dq)], "self_attn", x, need_dx);
        };
        if let Some(shared) = store.get_mut(&m.layer) {
            let (read_k, read_v) = (
                std::mem::take(&mut shared.dk),
                std::mem::take(&mut shared.dv),
            );
            if !read_k.is_empty() {
                add_inplace(&mut dk, &read_k);
                add_inplace(&mut dv, &read_v);
            }
        }
        let (dk, dv) = self.core.key_value_grads(dk, dv);
        let dv_in = through_norm(Some(&kv.v_norm), self.v_in.as_ref(), &dv);
        match &kv.v_proj {
            Some(v_proj) => {
                let projections = [
                    (&a.q_proj, "q_proj", &dq),
                    (&kv.k_proj, "k_proj", &dk),
                    (v_proj, "v_proj", &dv_in),
                ];
                g.inputs_of(&projections, "self_attn", x, need_dx)
            }
            None => {
                let mut dk = dk;
                add_inplace(&mut dk, &dv_in);
                let projections = [(&a.q_proj, "q_proj", &dq), (&kv.k_proj, "k_proj", &dk)];
                g.inputs_of(&projections, "self_attn", x, need_dx)
            }
        }
    }
}

/// The per-layer input gate, `norm(projection(gelu(gate(h)) · input))`, with this layer's
/// slice of the sequence's per-layer inputs. Its layers sit in the block itself.
struct PerLayerGrad<'a> {
    gate: &'a PerLayerGate,
    input: Tensor,
}

/// What its backward pass reads.
struct PerLayerSaved<'a> {
    grad: &'a PerLayerGrad<'a>,
    gate: Tensor,
    /// `gelu(gate) · input`, the projection's input, and the projection's output.
    gated: Tensor,
    projected: Tensor,
}

impl<'a> MlpGrad for PerLayerGrad<'a> {
    fn forward_saving<'s>(
        &'s self,
        x: &Tensor,
        lora: BlockAdapters,
    ) -> OpResult<(Tensor, Box<dyn MlpSaved + 's>)> {
        let (own, p) = (lora.module(""), self.gate);
        let gate = (p.per_layer_input_gate).forward_adapted(x, own.get("per_layer_input_gate"))?;
        let mut gated = gate.try_clone()?;
        ops::gelu_approx_mul_inplace(&mut gated, &self.input)?;
        let projection = &p.per_layer_projection;
        let mut out = projection.forward_adapted(&gated, own.get("per_layer_projection"))?;
        let projected =
            norm_keeping_input(Some(&p.post_per_layer_input_norm), &mut out)?.expect("a norm");
        let saved = PerLayerSaved {
            grad: self,
            gate,
            gated,
            projected,
        };
        Ok((out, Box::new(saved)))
    }
}

impl MlpSaved for PerLayerSaved<'_> {
    fn backward(&self, x: &[f32], dy: &[f32], g: &mut BlockGrads) -> Vec<f32> {
        let p = self.grad.gate;
        let norm = Some(&p.post_per_layer_input_norm);
        let d_projected = through_norm(norm, Some(&self.projected), dy);
        let d_gated = g.through(
            &p.per_layer_projection,
            "",
            "per_layer_projection",
            self.gated.data(),
            &d_projected,
        );
        let input = self.grad.input.data();
        let (d_gate, _) = gelu_approx_mul_backward(self.gate.data(), input, &d_gated);
        g.through(
            &p.per_layer_input_gate,
            "",
            "per_layer_input_gate",
            x,
            &d_gate,
        )
    }
}

/// A mixture-of-experts layer's feed-forward part: the dense MLP and the routed experts side
/// by side, each with its own input and output norms, over the block's residual.
struct MoeGrad<'a> {
    moe: &'a MoeBlock,
    mlp: &'a Mlp,
    mlp_norm: &'a RmsNorm,
}

/// What its backward pass reads.
struct MoeSaved<'a> {
    grad: &'a MoeGrad<'a>,
    /// The dense MLP's input, what it kept, and its output before its norm.
    dense_in: Tensor,
    dense: GatedSaved,
    dense_out: Tensor,
    /// The router's input and scores `[n, experts]`; each token's choices.
    router_in: Tensor,
    scores: Vec<f32>,
    chosen: Vec<(usize, f32)>,
    /// What the experts kept, and their weighted sum before its norm.
    routed: RoutedSaved,
    sparse_out: Tensor,
}

impl<'a> MlpGrad for MoeGrad<'a> {
    fn forward_saving<'s>(
        &'s self,
        h: &Tensor,
        lora: BlockAdapters,
    ) -> OpResult<(Tensor, Box<dyn MlpSaved + 's>)> {
        let (moe, gelu) = (self.moe, Activation::GeluApprox);
        let dense_in = self.mlp_norm.forward(h)?;
        let (mut out, dense) = GatedSaved::forward(self.mlp, gelu, &dense_in, lora.module("mlp"))?;
        let dense_out =
            norm_keeping_input(Some(&moe.post_feedforward_layernorm_1), &mut out)?.expect("a norm");
        let router_in = moe.router_norm.forward(h)?;
        let scores = (moe.router_proj)
            .forward_adapted(&router_in, lora.module("router").get("proj"))?
            .into_vec()?;
        let chosen = moe.choose(&scores);
        let experts_in = moe.pre_feedforward_layernorm_2.forward(h)?;
        let switch = lora.module("experts.switch_glu");
        let (mut sparse, routed) =
            RoutedSaved::forward(&moe.experts, gelu, &experts_in, &chosen, moe.top_k, switch)?;
        let sparse_out = norm_keeping_input(Some(&moe.post_feedforward_layernorm_2), &mut sparse)?
            .expect("a norm");
        ops::add_inplace(&mut out, &sparse)?;
        let saved = MoeSaved {
            grad: self,
            dense_in,
            dense,
            dense_out,
            router_in,
            scores,
            chosen,
            routed,
            sparse_out,
        };
        Ok((out, Box::new(saved)))
    }
}

impl MoeSaved<'_> {
    /// The gradient of the router's scores `[n, experts]` for the gradient of each choice's
    /// weight `softmax(top scores)_i · scale[e_i]`.
    fn router_grad(&self, d_weights: &[f32]) -> Vec<f32> {
        let moe = self.grad.moe;
        let (count, k) = (moe.experts.len(), moe.top_k);
        let mut d_scores = vec![0.0; self.scores.len()];
        for (t, scores) in self.scores.chunks_exact(count).enumerate() {
            let chosen = &self.chosen[t * k..][..k];
            let mut probs: Vec<f32> = chosen.iter().map(|&(e, _)| scores[e]).collect();
            softmax_inplace(&mut probs);
            let d_probs: Vec<f32> = (chosen.iter().zip(&d_weights[t * k..][..k]))
                .map(|(&(e, _), d)| d * moe.per_expert_scale[e])
                .collect();
            let through: f32 = probs.iter().zip(&d_probs).map(|(p, d)| p * d).sum();
            for ((&(e, _), p), d) in chosen.iter().zip(&probs).zip(&d_probs) {
                d_scores[t * count + e] = p * (d - through);
            }
        }
        d_scores
    }
}

impl MlpSaved for MoeSaved<'_> {
    fn backward(&self, h: &[f32], dy: &[f32], g: &mut BlockGrads) -> Vec<f32> {
        let (moe, gelu) = (self.grad.moe, Activation::GeluApprox);
        let d_dense = through_norm(
            Some(&moe.post_feedforward_layernorm_1),
            Some(&self.dense_out),
            dy,
        );
        let dense_in = self.dense_in.data();
        let dx = (self.dense).backward(self.grad.mlp, gelu, At::from("mlp"), dense_in, &d_dense, g);
        let mut dh = norm_backward(self.grad.mlp_norm, h, &dx);

        let d_sparse = through_norm(
            Some(&moe.post_feedforward_layernorm_2),
            Some(&self.sparse_out),
            dy,
        );
        let switch = "experts.switch_glu";
        let (dx, d_weights) =
            (self.routed).backward(&moe.experts, switch, &self.chosen, &d_sparse, g);
        add_inplace(
            &mut dh,
            &norm_backward(&moe.pre_feedforward_layernorm_2, h, &dx),
        );

        let d_scores = self.router_grad(&d_weights);
        let router_in = self.router_in.data();
        let dx = g.through(&moe.router_proj, "router", "proj", router_in, &d_scores);
        add_inplace(&mut dh, &norm_backward(&moe.router_norm, h, &dx));
        dh
    }
}
