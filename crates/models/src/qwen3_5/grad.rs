//! Qwen3.5's mixers as the backward pass sees them (see [`crate::decoder_grad`]): the gated
//! DeltaNet and the gated full attention, each over one whole sequence from an empty cache.

use oxlm_engine::cpu::attention::Options;
use oxlm_engine::grad::{
    causal_conv1d_backward, delta_gates_backward, gated_delta_rule_backward, silu_mul_backward,
};
use oxlm_engine::ops::{self, recurrent};
use oxlm_engine::params::Heads;
use oxlm_engine::{Device, Tensor};

use super::{GatedAttention, GatedDeltaNet, Mixer, Qwen3_5};
use crate::decoder_grad::{
    join_columns, norm_keeping_input, through_norm, AttentionShape, BlockGrads, Decoder,
    DecoderBlock, MixerGrad, MixerSaved, SequenceAttention,
};
use crate::layers::OpResult;
use crate::lora::ModuleAdapters;

impl Decoder for Qwen3_5 {
    fn embed(&self, tokens: &[u32]) -> OpResult<Tensor> {
        self.embed_tokens.forward(tokens)
    }

    fn blocks(&self, _tokens: &[u32]) -> OpResult<Vec<DecoderBlock<'_>>> {
        let blocks = self.layers.iter();
        Ok(blocks
            .map(|b| DecoderBlock {
                input_norm: Some(&b.input_layernorm),
                mixer: match &b.mixer {
                    Mixer::Linear(m) => Box::new(m) as Box<dyn MixerGrad>,
                    Mixer::Attention(m) => Box::new(m),
                },
                mixer_out_norm: None,
                mlp_norm: Some(&b.post_attention_layernorm),
                mlp: b.mlp.grad(),
                mlp_out_norm: None,
                tail: None,
                output_scale: 1.0,
                branch_scale: 1.0,
            })
            .collect())
    }
}

/// `dy · silu'(x)`.
fn silu_backward(x: &[f32], dy: &[f32]) -> Vec<f32> {
    silu_mul_backward(x, &vec![1.0; x.len()], dy).0
}

/// What the gated DeltaNet's backward pass reads.
struct DeltaNetSaved<'a> {
    net: &'a GatedDeltaNet,
    /// The convolution's output before its SiLU.
    conv_out: Tensor,
    /// Queries and keys before their L2 norms; both after, scaled; values.
    q_pre: Tensor,
    k_pre: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    a: Tensor,
    b: Tensor,
    g: Tensor,
    beta: Tensor,
    /// The rule's output, before and after its norm.
    y: Tensor,
    y_normed: Tensor,
    z: Tensor,
    /// `silu(z) · norm(y)`: `out_proj`'s input.
    gated: Tensor,
}

impl MixerGrad for &GatedDeltaNet {
    fn module(&self) -> &'static str {
        "linear_attn"
    }

    fn forward_saving<'s>(
        &'s self,
        x: &Tensor,
        lora: ModuleAdapters,
    ) -> OpResult<(Tensor, Box<dyn MixerSaved + 's>)> {
        let net: &GatedDeltaNet = self;
        let d = net.dims;
        let key_dim = net.key_dim();
        let qkv = net
            .in_proj_qkv
            .forward_adapted(x, lora.get("in_proj_qkv"))?;
        let z = net.in_proj_z.forward_adapted(x, lora.get("in_proj_z"))?;
        let b = net.in_proj_b.forward_adapted(x, lora.get("in_proj_b"))?;
        let a = net.in_proj_a.forward_adapted(x, lora.get("in_proj_a"))?;
        let mut cache = net.new_cache(&Device::Cpu)?;
        let conv_out =
            recurrent::causal_conv1d(&qkv, &net.conv1d, net.kernel, &mut [&mut cache.conv])?;
        let mut mixed = conv_out.try_clone()?;
        ops::silu_inplace(&mut mixed)?;
        let mut q = ops::columns(&mixed, 0, key_dim)?;
        let mut k = ops::columns(&mixed, key_dim, key_dim)?;
        let v = ops::columns(&mixed, 2 * key_dim, net.conv_dim() - 2 * key_dim)?;
        let inv_scale = (d.k_dim as f64).powf(-0.5);
        let q_pre = norm_keeping_input(Some(&net.unit_norm), &mut q)?.expect("a norm");
        let k_pre = norm_keeping_input(Some(&net.unit_norm), &mut k)?.expect("a norm");
        ops::scale_inplace(&mut q, (inv_scale * inv_scale) as f32)?;
        ops::scale_inplace(&mut k, inv_scale as f32)?;
        let (g, beta) = recurrent::delta_gates(&a, &b, &net.dt_bias, &net.neg_a)?;
        let y = recurrent::gated_delta_rule(&q, &k, &v, &g, &beta, d, &mut [&mut cache.state])?;
        let y_normed = net.norm.forward(&y)?;
        let mut gated = z.try_clone()?;
        ops::silu_mul_inplace(&mut gated, &y_normed)?;
        let out = net.out_proj.forward_adapted(&gated, lora.get("out_proj"))?;
        let saved = DeltaNetSaved {
            net,
            conv_out,
            q_pre,
            k_pre,
            q,
            k,
            v,
            a,
            b,
            g,
            beta,
            y,
            y_normed,
            z,
            gated,
        };
        Ok((out, Box::new(saved)))
    }
}

impl MixerSaved for DeltaNetSaved<'_> {
    fn backward(
        &self,
        x: &[f32],
        dy: &[f32],
        g: &mut BlockGrads,
        need_dx: bool,
    ) -> Option<Vec<f32>> {
        let net = self.net;
        let d = net.dims;
        let (n, key_dim) = (g.tokens, net.key_dim());
        let module = "linear_attn";
        let d_gated = g.through(&net.out_proj, module, "out_proj", self.gated.data(), dy);
        let (dz, dy_normed) = silu_mul_backward(self.z.data(), self.y_normed.data(), &d_gated);
        let dy_rule = through_norm(Some(&net.norm), Some(&self.y), &dy_normed);
        let rule = gated_delta_rule_backward(
            self.q.data(),
            self.k.data(),
            self.v.data(),
            self.g.data(),
            self.beta.data(),
            d,
            &dy_rule,
        );
        let (da, db) = delta_gates_backward(
            self.a.data(),
            self.b.data(),
            net.dt_bias.data(),
            net.neg_a.data(),
            &rule.dg,
            &rule.dbeta,
        );
        let inv_scale = (d.k_dim as f64).powf(-0.5);
        let scaled =
            |grad: &[f32], s: f64| -> Vec<f32> { grad.iter().map(|v| v * s as f32).collect() };
        let dq = scaled(&rule.dq, inv_scale * inv_scale);
        let dk = scaled(&rule.dk, inv_scale);
        let dq_pre = through_norm(Some(&net.unit_norm), Some(&self.q_pre), &dq);
        let dk_pre = through_norm(Some(&net.unit_norm), Some(&self.k_pre), &dk);
        let value_dim = net.conv_dim() - 2 * key_dim;
        let d_mixed = join_columns(
            &[
                (&dq_pre, key_dim),
                (&dk_pre, key_dim),
                (&rule.dv, value_dim),
            ],
            n,
        );
        let d_conv = silu_backward(self.conv_out.data(), &d_mixed);
        let dqkv = causal_conv1d_backward(&d_conv, net.conv_dim(), net.conv1d.data(), net.kernel);
        let projections = [
            (&net.in_proj_qkv, "in_proj_qkv", &dqkv),
            (&net.in_proj_z, "in_proj_z", &dz),
            (&net.in_proj_b, "in_proj_b", &db),
            (&net.in_proj_a, "in_proj_a", &da),
        ];
        g.inputs_of(&projections, module, x, need_dx)
    }
}

/// What the gated attention's backward pass reads.
struct GatedAttentionSaved<'a> {
    attn: &'a GatedAttention,
    core: SequenceAttention<'a>,
    /// The attention's output before and after its gate.
    out: Tensor,
    gate: Tensor,
    gated: Tensor,
}

impl GatedAttention {
    fn heads(&self) -> Heads {
        Heads {
            heads: self.heads,
            kv_heads: self.kv_heads,
            head_dim: self.head_dim,
        }
    }
}

impl MixerGrad for &GatedAttention {
    fn module(&self) -> &'static str {
        "self_attn"
    }

    fn forward_saving<'s>(
        &'s self,
        x: &Tensor,
        lora: ModuleAdapters,
    ) -> OpResult<(Tensor, Box<dyn MixerSaved + 's>)> {
        let a: &GatedAttention = self;
        let (n, hd) = (x.rows(), a.head_dim);
        let projected = a
            .q_proj
            .forward_adapted(x, lora.get("q_proj"))?
            .reshape(vec![n * a.heads, 2 * hd]);
        let q = ops::columns(&projected, 0, hd)?.reshape(vec![n, a.heads * hd]);
        let gate = ops::columns(&projected, hd, hd)?.reshape(vec![n, a.heads * hd]);
        let k = a.k_proj.forward_adapted(x, lora.get("k_proj"))?;
        let v = a.v_proj.forward_adapted(x, lora.get("v_proj"))?;
        let shape = AttentionShape {
            heads: a.heads(),
            options: Options::scaled(a.scale),
            window: None,
            rope: &a.rope,
            q_norm: Some(&a.q_norm),
            k_norm: Some(&a.k_norm),
        };
        let (out, core) = SequenceAttention::forward(shape, q, k, &v)?;
        let mut gated = out.try_clone()?;
        ops::sigmoid_mul_inplace(&mut gated, &gate)?;
        let y = a.o_proj.forward_adapted(&gated, lora.get("o_proj"))?;
        let saved = GatedAttentionSaved {
            attn: a,
            core,
            out,
            gate,
            gated,
        };
        Ok((y, Box::new(saved)))
    }
}

impl MixerSaved for GatedAttentionSaved<'_> {
    fn backward(
        &self,
        x: &[f32],
        dy: &[f32],
        g: &mut BlockGrads,
        need_dx: bool,
    ) -> Option<Vec<f32>> {
        let a = self.attn;
        let (n, hd) = (g.tokens, a.head_dim);
        let d_gated = g.through(&a.o_proj, "self_attn", "o_proj", self.gated.data(), dy);
        // gated = out · sigmoid(gate).
        let (mut d_out, mut d_gate) = (vec![0.0; d_gated.len()], vec![0.0; d_gated.len()]);
        for (i, &d) in d_gated.iter().enumerate() {
            let s = 1.0 / (1.0 + (-self.gate.data()[i]).exp());
            d_out[i] = d * s;
            d_gate[i] = d * self.out.data()[i] * s * (1.0 - s);
        }
        let [dq, dk, dv] = self.core.backward(&d_out);
        // Per head, `head_dim` queries then `head_dim` gates, as `q_proj` gives them.
        let d_projected = join_columns(&[(&dq, hd), (&d_gate, hd)], n * a.heads);
        let projections = [
            (&a.q_proj, "q_proj", &d_projected),
            (&a.k_proj, "k_proj", &dk),
            (&a.v_proj, "v_proj", &dv),
        ];
        g.inputs_of(&projections, "self_attn", x, need_dx)
    }
}
