//! LFM2's layers as the backward pass sees them (see [`crate::decoder_grad`]): the gated short
//! convolution, the attention with its `out_proj`, the dense feed-forward under its own names
//! and LFM2-MoE's sigmoid-routed mixture, each over one whole sequence from an empty cache.

use oxlm_engine::cpu::attention::Options;
use oxlm_engine::cpu::elementwise::add_inplace;
use oxlm_engine::grad::{causal_conv1d_backward, silu_mul_backward};
use oxlm_engine::ops::{self, recurrent, Activation};
use oxlm_engine::params::Heads;
use oxlm_engine::{Device, Tensor};

use super::{Block, DenseNames, FeedForward, Lfm2, Operator, ShortConv, SigmoidMoe, NORM_EPS};
use crate::decoder_grad::{
    join_columns, AttentionShape, BlockAdapters, BlockGrads, Decoder, DecoderBlock, MixerGrad,
    MixerSaved, MlpGrad, MlpSaved, SequenceAttention,
};
use crate::layers::{Attention, Mlp, OpResult};
use crate::lora::ModuleAdapters;
use crate::switch::grad::RoutedSaved;

impl Decoder for Lfm2 {
    fn embed(&self, tokens: &[u32]) -> OpResult<Tensor> {
        self.embed_tokens.forward(tokens)
    }

    fn blocks(&self, _tokens: &[u32]) -> OpResult<Vec<DecoderBlock<'_>>> {
        Ok(self.layers.iter().map(Block::grad).collect())
    }
}

impl Block {
    fn grad(&self) -> DecoderBlock<'_> {
        DecoderBlock {
            input_norm: Some(&self.operator_norm),
            mixer: match &self.operator {
                Operator::Conv(conv) => Box::new(conv) as Box<dyn MixerGrad>,
                Operator::Attention(attn) => Box::new(AttentionGrad(attn)),
            },
            mixer_out_norm: None,
            mlp_norm: Some(&self.ffn_norm),
            mlp: match &self.feed_forward {
                FeedForward::Dense { mlp, names } => Box::new(DenseGrad { mlp, names }),
                FeedForward::Moe(moe) => Box::new(moe),
            },
            mlp_out_norm: None,
            tail: None,
            output_scale: 1.0,
            branch_scale: 1.0,
        }
    }
}

/// `a · b`, element by element.
fn product(a: &[f32], b: &[f32]) -> Vec<f32> {
    a.iter().zip(b).map(|(x, y)| x * y).collect()
}

/// What the short convolution's backward pass reads.
struct ConvSaved<'a> {
    conv: &'a ShortConv,
    /// The thirds of `in_proj`'s output.
    b: Tensor,
    c: Tensor,
    x: Tensor,
    /// The convolution's output, and `out_proj`'s input (it gated by `c`).
    conv_out: Tensor,
    gated: Tensor,
}

impl MixerGrad for &ShortConv {
    fn module(&self) -> &'static str {
        "conv"
    }

    fn forward_saving<'s>(
        &'s self,
        x: &Tensor,
        lora: ModuleAdapters,
    ) -> OpResult<(Tensor, Box<dyn MixerSaved + 's>)> {
        let conv: &ShortConv = self;
        let [b, c, xs] = conv.thirds(x, lora)?;
        let mut bx = b.try_clone()?;
        ops::mul_inplace(&mut bx, &xs)?;
        let mut state = conv.new_cache(&Device::Cpu)?.conv;
        let mut conv_out =
            recurrent::causal_conv1d(&bx, &conv.conv, conv.kernel, &mut [&mut state])?;
        if let Some(bias) = &conv.conv_bias {
            ops::add_row_inplace(&mut conv_out, bias)?;
        }
        let mut gated = conv_out.try_clone()?;
        ops::mul_inplace(&mut gated, &c)?;
        let out = conv
            .out_proj
            .forward_adapted(&gated, lora.get("out_proj"))?;
        let saved = ConvSaved {
            conv,
            b,
            c,
            x: xs,
            conv_out,
            gated,
        };
        Ok((out, Box::new(saved)))
    }
}

impl MixerSaved for ConvSaved<'_> {
    fn backward(
        &self,
        x: &[f32],
        dy: &[f32],
        g: &mut BlockGrads,
        need_dx: bool,
    ) -> Option<Vec<f32>> {
        let conv = self.conv;
        let (n, h) = (g.tokens, conv.hidden);
        let d_gated = g.through(&conv.out_proj, "conv", "out_proj", self.gated.data(), dy);
        let dc = product(&d_gated, self.conv_out.data());
        let d_conv = product(&d_gated, self.c.data());
        let d_bx = causal_conv1d_backward(&d_conv, h, conv.conv.data(), conv.kernel);
        let db = product(&d_bx, self.x.data());
        let dx = product(&d_bx, self.b.data());
        let d_in = join_columns(&[(&db, h), (&dc, h), (&dx, h)], n);
        g.inputs_of(&[(&conv.in_proj, "in_proj", &d_in)], "conv", x, need_dx)
    }
}

/// Attention with per-head q/k norms whose output projection is `out_proj`.
struct AttentionGrad<'a>(&'a Attention);

/// What the attention's backward pass reads.
struct AttentionSaved<'a> {
    attn: &'a Attention,
    core: SequenceAttention<'a>,
    /// The heads' outputs, `out_proj`'s input.
    out: Tensor,
}

impl MixerGrad for AttentionGrad<'_> {
    fn module(&self) -> &'static str {
        "self_attn"
    }

    fn forward_saving<'s>(
        &'s self,
        x: &Tensor,
        lora: ModuleAdapters,
    ) -> OpResult<(Tensor, Box<dyn MixerSaved + 's>)> {
        let a = self.0;
        let q = a.q_proj.forward_adapted(x, lora.get("q_proj"))?;
        let k = a.k_proj.forward_adapted(x, lora.get("k_proj"))?;
        let v = a.v_proj.forward_adapted(x, lora.get("v_proj"))?;
        let shape = AttentionShape {
            heads: Heads {
                heads: a.heads,
                kv_heads: a.kv_heads,
                head_dim: a.head_dim,
            },
            options: Options::scaled(a.scale),
            window: None,
            rope: &a.rope,
            q_norm: a.q_norm.as_ref(),
            k_norm: a.k_norm.as_ref(),
        };
        let (out, core) = SequenceAttention::forward(shape, q, k, &v)?;
        let y = a.o_proj.forward_adapted(&out, lora.get("out_proj"))?;
        Ok((y, Box::new(AttentionSaved { attn: a, core, out })))
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
        let a = self.attn;
        let d_out = g.through(&a.o_proj, "self_attn", "out_proj", self.out.data(), dy);
        let [dq, dk, dv] = self.core.backward(&d_out);
        let projections = [
            (&a.q_proj, "q_proj", &dq),
            (&a.k_proj, "k_proj", &dk),
            (&a.v_proj, "v_proj", &dv),
        ];
        g.inputs_of(&projections, "self_attn", x, need_dx)
    }
}

/// A dense SwiGLU feed-forward under `feed_forward`, its layers named as `names` says.
struct DenseGrad<'a> {
    mlp: &'a Mlp,
    names: &'static DenseNames,
}

/// What the dense feed-forward's backward pass reads.
struct DenseSaved<'a> {
    grad: &'a DenseGrad<'a>,
    gate: Tensor,
    up: Tensor,
    /// `silu(gate) · up`, the down layer's input.
    act: Tensor,
}

impl MlpGrad for DenseGrad<'_> {
    fn forward_saving<'s>(
        &'s self,
        x: &Tensor,
        lora: BlockAdapters,
    ) -> OpResult<(Tensor, Box<dyn MlpSaved + 's>)> {
        let (mlp, lora) = (self.mlp, lora.module("feed_forward"));
        let [gate_lora, up_lora, down_lora] = self.names.layers.map(|name| lora.get(name));
        let gate = mlp.gate_proj.forward_adapted(x, gate_lora)?;
        let up = mlp.up_proj.forward_adapted(x, up_lora)?;
        let mut act = gate.try_clone()?;
        ops::silu_mul_inplace(&mut act, &up)?;
        let out = mlp.down_proj.forward_adapted(&act, down_lora)?;
        let saved = DenseSaved {
            grad: self,
            gate,
            up,
            act,
        };
        Ok((out, Box::new(saved)))
    }
}

impl MlpSaved for DenseSaved<'_> {
    fn backward(&self, x: &[f32], dy: &[f32], g: &mut BlockGrads) -> Vec<f32> {
        let (mlp, [gate, up, down]) = (self.grad.mlp, self.grad.names.layers);
        let module = "feed_forward";
        let d_act = g.through(&mlp.down_proj, module, down, self.act.data(), dy);
        let (dgate, dup) = silu_mul_backward(self.gate.data(), self.up.data(), &d_act);
        let mut dx = g.through(&mlp.gate_proj, module, gate, x, &dgate);
        add_inplace(&mut dx, &g.through(&mlp.up_proj, module, up, x, &dup));
        dx
    }
}

/// What LFM2-MoE's mixture's backward pass reads.
struct MoeSaved<'a> {
    moe: &'a SigmoidMoe,
    /// The router's sigmoid scores `[n, experts]`; each token's chosen experts and weights.
    scores: Vec<f32>,
    chosen: Vec<(usize, f32)>,
    routed: RoutedSaved,
}

impl MlpGrad for &SigmoidMoe {
    fn forward_saving<'s>(
        &'s self,
        x: &Tensor,
        lora: BlockAdapters,
    ) -> OpResult<(Tensor, Box<dyn MlpSaved + 's>)> {
        let moe: &SigmoidMoe = self;
        let router = lora.module("feed_forward");
        let mut scores = moe
            .gate
            .forward_adapted(x, router.get("gate"))?
            .into_vec()?;
        let chosen = moe.route(&mut scores);
        let switch = lora.module("feed_forward.switch_mlp");
        let silu = Activation::Silu;
        let (y, routed) = RoutedSaved::forward(&moe.experts, silu, x, &chosen, moe.top_k, switch)?;
        let saved = MoeSaved {
            moe,
            scores,
            chosen,
            routed,
        };
        Ok((y, Box::new(saved)))
    }
}

impl MoeSaved<'_> {
    /// The gradient of the router's logits `[n, experts]` for the gradient of each choice's
    /// weight, through the scaling, the top-k normalization (where there is one) and the
    /// sigmoid; the choice itself (and so the expert bias) is not differentiated.
    fn router_grad(&self, d_weights: &[f32]) -> Vec<f32> {
        let moe = self.moe;
        let (count, k) = (moe.experts.len(), moe.top_k);
        let mut d_logits = vec![0.0; self.scores.len()];
        for (t, s) in self.scores.chunks_exact(count).enumerate() {
            let (chosen, dw) = (&self.chosen[t * k..][..k], &d_weights[t * k..][..k]);
            // weight_i = scaling · s_i / total, with total = Σ s_top + eps (or 1):
            // ds_j = scaling · (dw_j − Σ_i dw_i · s_i / total) / total.
            let (total, mean) = if moe.norm_topk_prob {
                let total = chosen.iter().map(|&(e, _)| s[e]).sum::<f32>() + NORM_EPS;
                let weighted = chosen.iter().zip(dw).map(|(&(e, _), d)| d * s[e]);
                (total, weighted.sum::<f32>() / total)
            } else {
                (1.0, 0.0)
            };
            let d_row = &mut d_logits[t * count..][..count];
            for (&(e, _), d) in chosen.iter().zip(dw) {
                let ds = moe.scaling * (d - mean) / total;
                d_row[e] = ds * s[e] * (1.0 - s[e]);
            }
        }
        d_logits
    }
}

impl MlpSaved for MoeSaved<'_> {
    fn backward(&self, x: &[f32], dy: &[f32], g: &mut BlockGrads) -> Vec<f32> {
        let moe = self.moe;
        let switch = "feed_forward.switch_mlp";
        let (mut dx, d_weights) = (self.routed).backward(&moe.experts, switch, &self.chosen, dy, g);
        let d_logits = self.router_grad(&d_weights);
        add_inplace(
            &mut dx,
            &g.through(&moe.gate, "feed_forward", "gate", x, &d_logits),
        );
        dx
    }
}
