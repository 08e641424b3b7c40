//! The loss and LoRA gradients of a model of pre-norm decoder blocks (llama's, Gemma 3's with
//! its norms after attention and MLP, GeGLU and sliding windows, and those whose mixer or MLP is
//! another kind: Qwen3.5's gated DeltaNet, a mixture of experts), one example at a time
//! (the examples of a batch do not interact, so their gradients simply add): a forward pass
//! that keeps what the backward pass needs, then the backward pass from the loss down to the
//! lowest adapted block. With `checkpoint`, only each block's input is kept and the block is run
//! again on the way back.

use oxlm_engine::cpu::attention::{KvView, Options};
use oxlm_engine::cpu::elementwise::add_inplace;
use oxlm_engine::grad::{
    attention_backward, cross_entropy, cross_entropy_backward_inplace, gelu_approx_mul_backward,
    rms_norm_backward, rope_backward_inplace, silu_mul_backward, swiglu_oai_mul_backward,
};
use oxlm_engine::ops::Activation;
use oxlm_engine::params::Heads;
use oxlm_engine::{ops, Positions, Tensor};

use crate::layers::{Attention, Linear, Mlp, OpResult, RmsNorm, Rope, Weight};
use crate::lora::{Adapters, ModuleAdapters};
use crate::lora_dropout::BatchDropout;
use crate::lora_grad::{
    base_input_grad, linear_backward, AdapterGrads, Example, LossAndGrads, SumsAndGrads,
};
use crate::pass::Architecture;
use crate::{check_tokens, ForwardError};

/// A decoder block as the backward pass sees it: `h + s · post_mix(mixer(input_norm(h)))`, then
/// `h + s · post_mlp(mlp(mlp_norm(h)))` (`s` the `branch_scale`), then `h + tail(h)` where there
/// is a tail, all scaled by `output_scale`.
pub struct DecoderBlock<'a> {
    /// `None` in post-norm blocks (OLMo 2's), whose mixer reads `h` itself.
    pub input_norm: Option<&'a RmsNorm>,
    /// Attention, or another sequence mixer.
    pub mixer: Box<dyn MixerGrad + 'a>,
    /// Gemma's norm of the mixer's output, before the residual.
    pub mixer_out_norm: Option<&'a RmsNorm>,
    /// `None` where the MLP norms its input itself (Gemma 4's mixture, whose parts each have
    /// their own norm).
    pub mlp_norm: Option<&'a RmsNorm>,
    /// A gated MLP, or a mixture of experts.
    pub mlp: Box<dyn MlpGrad + 'a>,
    /// Gemma's norm of the MLP's output, before the residual.
    pub mlp_out_norm: Option<&'a RmsNorm>,
    /// A last residual branch (Gemma 4's per-layer input gate).
    pub tail: Option<Box<dyn MlpGrad + 'a>>,
    /// Gemma 4's per-layer scalar; 1 elsewhere.
    pub output_scale: f32,
    /// Granite's and MiniCPM's residual multiplier; 1 elsewhere.
    pub branch_scale: f32,
}

/// A block's sequence mixer as the backward pass sees it.
pub trait MixerGrad {
    /// The module its adapters are under (`self_attn`, `linear_attn`).
    fn module(&self) -> &'static str;

    /// Its output for one whole sequence `x` (positions `0..n`, no cache), with the projections
    /// `lora` names adapted, and what its backward pass reads.
    fn forward_saving<'s>(
        &'s self,
        x: &Tensor,
        lora: ModuleAdapters,
    ) -> OpResult<(Tensor, Box<dyn MixerSaved + 's>)>;
}

/// What a mixer's forward pass kept for its backward pass.
pub trait MixerSaved {
    /// Adds the gradients of the mixer's adapters for its input `x` and output gradient `dy`,
    /// and returns `dx` when `need_dx`.
    fn backward(
        &self,
        x: &[f32],
        dy: &[f32],
        g: &mut BlockGrads,
        need_dx: bool,
    ) -> Option<Vec<f32>>;
}

/// A block's feed-forward part as the backward pass sees it.
pub trait MlpGrad {
    /// Its output for the rows `x`, with the layers `lora` names adapted, and what its backward
    /// pass reads.
    fn forward_saving<'s>(
        &'s self,
        x: &Tensor,
        lora: BlockAdapters,
    ) -> OpResult<(Tensor, Box<dyn MlpSaved + 's>)>;
}

/// What a feed-forward part's forward pass kept for its backward pass.
pub trait MlpSaved {
    /// Adds the gradients of its adapters for its input `x` and output gradient `dy`, and
    /// returns `dx`.
    fn backward(&self, x: &[f32], dy: &[f32], g: &mut BlockGrads) -> Vec<f32>;
}

/// The adapters of one block, by module (`mlp`, `mlp.switch_mlp`); none at all for a block that
/// is not adapted.
#[derive(Clone, Copy)]
pub struct BlockAdapters<'a> {
    adapters: Option<&'a Adapters>,
    block: usize,
}

impl<'a> BlockAdapters<'a> {
    const NONE: BlockAdapters<'static> = BlockAdapters {
        adapters: None,
        block: 0,
    };

    pub fn module(self, module: &'a str) -> ModuleAdapters<'a> {
        match self.adapters {
            Some(adapters) => adapters.module(self.block, module),
            None => ModuleAdapters::NONE,
        }
    }
}

/// A gated MLP, `down(act(gate(x)) · up(x))`, under `mlp`.
pub struct GatedMlpGrad<'a> {
    pub mlp: &'a Mlp,
    pub activation: Activation,
}

/// What a gated MLP's backward pass reads.
pub(crate) struct GatedSaved {
    gate: Tensor,
    up: Tensor,
    /// `act(gate) · up`, the down projection's input.
    act: Tensor,
}

impl GatedSaved {
    /// The MLP's output for the rows `x`, with the layers `lora` names adapted, and itself.
    pub(crate) fn forward(
        mlp: &Mlp,
        activation: Activation,
        x: &Tensor,
        lora: ModuleAdapters,
    ) -> OpResult<(Tensor, Self)> {
        let gate = mlp.gate_proj.forward_adapted(x, lora.get("gate_proj"))?;
        let up = mlp.up_proj.forward_adapted(x, lora.get("up_proj"))?;
        let mut act = gate.try_clone()?;
        ops::glu_inplace(&mut act, &up, activation)?;
        let out = mlp.down_proj.forward_adapted(&act, lora.get("down_proj"))?;
        Ok((out, GatedSaved { gate, up, act }))
    }

    /// `dx` for the output gradient `dy` of the MLP `at` names; its adapters' gradients are
    /// added.
    pub(crate) fn backward(
        &self,
        mlp: &Mlp,
        activation: Activation,
        at: At,
        x: &[f32],
        dy: &[f32],
        g: &mut BlockGrads,
    ) -> Vec<f32> {
        let d_act = g.through(&mlp.down_proj, at, "down_proj", self.act.data(), dy);
        let (gate, up) = (self.gate.data(), self.up.data());
        let (dgate, dup) = match activation {
            Activation::Silu => silu_mul_backward(gate, up, &d_act),
            Activation::GeluApprox => gelu_approx_mul_backward(gate, up, &d_act),
            Activation::SwigluOai => swiglu_oai_mul_backward(gate, up, &d_act),
        };
        add(
            g.through(&mlp.gate_proj, at, "gate_proj", x, &dgate),
            &g.through(&mlp.up_proj, at, "up_proj", x, &dup),
        )
    }
}

/// Where a layer's adapter is: its module in the block, and for a stack of experts, the expert.
#[derive(Clone, Copy)]
pub struct At<'a> {
    pub module: &'a str,
    pub expert: Option<usize>,
}

impl<'a> From<&'a str> for At<'a> {
    fn from(module: &'a str) -> Self {
        At {
            module,
            expert: None,
        }
    }
}

impl MlpGrad for GatedMlpGrad<'_> {
    fn forward_saving<'s>(
        &'s self,
        x: &Tensor,
        lora: BlockAdapters,
    ) -> OpResult<(Tensor, Box<dyn MlpSaved + 's>)> {
        let (out, saved) = GatedSaved::forward(self.mlp, self.activation, x, lora.module("mlp"))?;
        Ok((out, Box::new((self, saved))))
    }
}

impl MlpSaved for (&GatedMlpGrad<'_>, GatedSaved) {
    fn backward(&self, x: &[f32], dy: &[f32], g: &mut BlockGrads) -> Vec<f32> {
        let (mlp, saved) = self;
        saved.backward(mlp.mlp, mlp.activation, "mlp".into(), x, dy, g)
    }
}

/// Self-attention with RoPE and optional q/k norms (llama's, Gemma's), through a window on a
/// sliding-window layer.
pub struct AttentionGrad<'a> {
    pub attn: &'a Attention,
    pub window: Option<usize>,
}

/// A model the backward pass can train: its blocks over its (scaled) embeddings, and the
/// output head of [`Architecture::output`].
pub trait Decoder: Architecture {
    /// The first block's input for `tokens`.
    fn embed(&self, tokens: &[u32]) -> OpResult<Tensor>;

    /// The blocks as they run over the sequence `tokens` (for the per-token inputs and shared
    /// keys and values some architectures give their blocks beside the hidden state).
    fn blocks(&self, tokens: &[u32]) -> OpResult<Vec<DecoderBlock<'_>>>;
}

/// Rows of logits computed at once, so that `[tokens, vocab]` never exists in full.
const HEAD_ROWS: usize = 64;

/// What a block's backward pass reads from its forward pass (host tensors: training runs on
/// the CPU).
struct Saved<'a> {
    h_in: Tensor,
    x1: Tensor,
    mixer: Box<dyn MixerSaved + 'a>,
    /// The mixer's output before its norm, where the block has one.
    mixer_out: Option<Tensor>,
    h_mid: Tensor,
    x2: Tensor,
    mlp: Box<dyn MlpSaved + 'a>,
    /// The MLP's output before its norm, where the block has one.
    mlp_out: Option<Tensor>,
    /// The tail's input, and what its backward pass reads, where there is a tail.
    tail: Option<(Tensor, Box<dyn MlpSaved + 'a>)>,
}

/// What an adapted block keeps for the backward pass: everything, or (checkpointing) its input.
enum Kept<'a> {
    All(Box<Saved<'a>>),
    Input(Tensor),
}

/// What attention's backward pass reads.
struct AttentionSaved<'a> {
    attn: &'a Attention,
    core: SequenceAttention<'a>,
    /// The attention's output, `o_proj`'s input.
    out: Tensor,
}

/// The part of attention between its projections and its output projection, over one whole
/// sequence: per-head q/k norms where there are, RoPE, and causal attention through an optional
/// window; with what its backward pass reads.
pub(crate) struct SequenceAttention<'a> {
    heads: Heads,
    options: Options<'a>,
    window: Option<usize>,
    rope: &'a Rope,
    q_norm: Option<&'a RmsNorm>,
    k_norm: Option<&'a RmsNorm>,
    /// Queries and keys before their norms, where there are.
    q_raw: Option<Tensor>,
    k_raw: Option<Tensor>,
    /// Rotated queries `[n, heads, head_dim]`; keys and values `[kv_heads, n, head_dim]`.
    q: Tensor,
    k: Vec<f32>,
    v: Vec<f32>,
}

/// What [`SequenceAttention`] computes with, besides its inputs.
pub(crate) struct AttentionShape<'a> {
    pub heads: Heads,
    /// The scale, and the soft cap and sinks where the layer has them.
    pub options: Options<'a>,
    pub window: Option<usize>,
    pub rope: &'a Rope,
    pub q_norm: Option<&'a RmsNorm>,
    pub k_norm: Option<&'a RmsNorm>,
}

impl<'a> SequenceAttention<'a> {
    /// Attention of the projected queries, keys and values `q`, `k`, `v` (`[n, heads ·
    /// head_dim]`, `[n, kv_heads · head_dim]`): its output `[n, heads · head_dim]`, and itself.
    pub(crate) fn forward(
        shape: AttentionShape<'a>,
        q: Tensor,
        mut k: Tensor,
        v: &Tensor,
    ) -> OpResult<(Tensor, Self)> {
        let h = shape.heads;
        let n = k.rows();
        let k_raw = norm_keeping_input(shape.k_norm, &mut k)?;
        let positions = Positions::following(0, n, &oxlm_engine::Device::Cpu)?;
        shape
            .rope
            .apply(&mut k, h.kv_heads, h.head_dim, &positions)?;
        let k = transpose_heads(k.data(), n, h.kv_heads, h.head_dim);
        let v = transpose_heads(v.data(), n, h.kv_heads, h.head_dim);
        let (out, mut core) = Self::over(shape, q, k, v)?;
        core.k_raw = k_raw;
        Ok((out, core))
    }

    /// Attention of the projected queries `q` over keys and values already normed, rotated and
    /// laid out as attention reads them, `[kv_heads, n, head_dim]` (another layer's, where
    /// layers share them).
    pub(crate) fn over(
        shape: AttentionShape<'a>,
        mut q: Tensor,
        k: Vec<f32>,
        v: Vec<f32>,
    ) -> OpResult<(Tensor, Self)> {
        let AttentionShape {
            heads: h,
            options,
            window,
            rope,
            q_norm,
            k_norm,
        } = shape;
        let n = q.rows();
        let positions = Positions::following(0, n, &oxlm_engine::Device::Cpu)?;
        let q_raw = norm_keeping_input(q_norm, &mut q)?;
        rope.apply(&mut q, h.heads, h.head_dim, &positions)?;
        let kv = KvView::sequence(&k[..], &v[..], h.kv_heads, n).within(window);
        let mut out = vec![0.0; q.len()];
        let p: Vec<usize> = (0..n).collect();
        let attention = oxlm_engine::cpu::attention::attention;
        attention(q.data(), h.heads, h.head_dim, &p, &kv, options, &mut out);
        let core = SequenceAttention {
            heads: h,
            options,
            window,
            rope,
            q_norm,
            k_norm,
            q_raw,
            k_raw: None,
            q,
            k,
            v,
        };
        Ok((host(out, n), core))
    }

    /// The keys and values attention read, laid out as [`SequenceAttention::over`] takes them.
    pub(crate) fn keys_values(&self) -> (&[f32], &[f32]) {
        (&self.k, &self.v)
    }

    /// The gradients of the projected `q`, `k` and `v` for the output gradient `d_out`.
    pub(crate) fn backward(&self, d_out: &[f32]) -> [Vec<f32>; 3] {
        let (dq, dk, dv) = self.backward_over(d_out);
        let (dk, dv) = self.key_value_grads(dk, dv);
        [dq, dk, dv]
    }

    /// The gradient of the projected queries for the output gradient `d_out`, and those of
    /// the keys and values laid out as [`SequenceAttention::over`] takes them.
    pub(crate) fn backward_over(&self, d_out: &[f32]) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
        let h = self.heads;
        let n = self.q.rows();
        let kv = KvView::sequence(&self.k[..], &self.v[..], h.kv_heads, n).within(self.window);
        let options = self.options;
        let grads = attention_backward(self.q.data(), h.heads, h.head_dim, &kv, options, d_out);
        let mut dq = grads.dq;
        rope_backward(self.rope, &mut dq, h.heads, h.head_dim);
        let dq = through_norm(self.q_norm, self.q_raw.as_ref(), &dq);
        (dq, grads.dk, grads.dv)
    }

    /// The gradients of the projected keys and values for those laid out as attention read
    /// them.
    pub(crate) fn key_value_grads(&self, dk: Vec<f32>, dv: Vec<f32>) -> (Vec<f32>, Vec<f32>) {
        let h = self.heads;
        let n = self.q.rows();
        let mut dk = transpose_heads(&dk, h.kv_heads, n, h.head_dim);
        let dv = transpose_heads(&dv, h.kv_heads, n, h.head_dim);
        rope_backward(self.rope, &mut dk, h.kv_heads, h.head_dim);
        let dk = through_norm(self.k_norm, self.k_raw.as_ref(), &dk);
        (dk, dv)
    }
}

/// `[a, b, d]` → `[b, a, d]`: a sequence's keys and values `[n, heads, d]` as attention reads
/// them (`[heads, n, d]`), and back.
fn transpose_heads(x: &[f32], a: usize, b: usize, d: usize) -> Vec<f32> {
    let mut out = vec![0.0; x.len()];
    for i in 0..a {
        for j in 0..b {
            out[(j * a + i) * d..][..d].copy_from_slice(&x[(i * b + j) * d..][..d]);
        }
    }
    out
}

/// `[n, width]` rows of `parts` side by side.
pub(crate) fn join_columns(parts: &[(&[f32], usize)], n: usize) -> Vec<f32> {
    let width: usize = parts.iter().map(|p| p.1).sum();
    let mut out = Vec::with_capacity(n * width);
    for t in 0..n {
        for &(part, w) in parts {
            out.extend_from_slice(&part[t * w..(t + 1) * w]);
        }
    }
    out
}

fn add(mut a: Vec<f32>, b: &[f32]) -> Vec<f32> {
    add_inplace(&mut a, b);
    a
}

/// `[n, dim]` rows as a host tensor.
fn host(values: Vec<f32>, n: usize) -> Tensor {
    let dim = values.len() / n;
    Tensor::new(vec![n, dim], values)
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
        let a = self.attn;
        if a.query_scale.is_some_and(|s| x.rows() > s.period) {
            return Err(oxlm_engine::EngineError::Unsupported(
                "LoRA training past the context where the queries' position scale starts".into(),
            ));
        }
        if a.chunk.is_some_and(|chunk| x.rows() > chunk) {
            return Err(oxlm_engine::EngineError::Unsupported(
                "LoRA training over sequences longer than the attention's chunks".into(),
            ));
        }
        if a.norm_after_rope {
            return Err(oxlm_engine::EngineError::Unsupported(
                "LoRA training with q/k norms after the rotation".into(),
            ));
        }
        let q = a.q_proj.forward_adapted(x, lora.get("q_proj"))?;
        let k = a.k_proj.forward_adapted(x, lora.get("k_proj"))?;
        let v = a.v_proj.forward_adapted(x, lora.get("v_proj"))?;
        let shape = AttentionShape {
            heads: Heads {
                heads: a.heads,
                kv_heads: a.kv_heads,
                head_dim: a.head_dim,
            },
            options: Options {
                scale: a.scale,
                softcap: a.softcap,
                sinks: a.sinks.as_ref().map(Tensor::data),
            },
            window: self.window,
            rope: &a.rope,
            q_norm: a.q_norm.as_ref(),
            k_norm: a.k_norm.as_ref(),
        };
        let (out, core) = SequenceAttention::forward(shape, q, k, &v)?;
        let y = a.o_proj.forward_adapted(&out, lora.get("o_proj"))?;
        let saved = AttentionSaved { attn: a, core, out };
        Ok((y, Box::new(saved)))
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
        let d_out = g.through(&a.o_proj, "self_attn", "o_proj", self.out.data(), dy);
        let [dq, dk, dv] = self.core.backward(&d_out);
        let projections = [
            (&a.q_proj, "q_proj", &dq),
            (&a.k_proj, "k_proj", &dk),
            (&a.v_proj, "v_proj", &dv),
        ];
        g.inputs_of(&projections, "self_attn", x, need_dx)
    }
}

/// Backward of RoPE over one whole sequence (positions `0..n`) of `heads` heads, in place.
fn rope_backward(rope: &Rope, d: &mut [f32], heads: usize, head_dim: usize) {
    let positions: Vec<usize> = (0..d.len() / (heads * head_dim)).collect();
    let (inv, traditional) = (rope.inv_freqs.data(), rope.traditional);
    rope_backward_inplace(
        d,
        heads,
        head_dim,
        &positions,
        inv,
        traditional,
        rope.amplitude,
    );
}

/// The adapters of a block's mixer and of the rest of it.
type Lora<'a> = (ModuleAdapters<'a>, BlockAdapters<'a>);

/// A block's forward pass over one whole sequence (positions `0..n`), keeping its activations;
/// and its output.
fn forward_block<'a>(
    block: &'a DecoderBlock,
    h_in: Tensor,
    lora: Lora,
) -> OpResult<(Saved<'a>, Tensor)> {
    let x1 = match block.input_norm {
        Some(norm) => norm.forward(&h_in)?,
        None => h_in.try_clone()?,
    };
    let (mut out, mixer) = block.mixer.forward_saving(&x1, lora.0)?;
    let mixer_out = norm_keeping_input(block.mixer_out_norm, &mut out)?;
    if block.branch_scale != 1.0 {
        ops::scale_inplace(&mut out, block.branch_scale)?;
    }
    let mut h_mid = h_in.try_clone()?;
    ops::add_inplace(&mut h_mid, &out)?;
    let x2 = match block.mlp_norm {
        Some(norm) => norm.forward(&h_mid)?,
        None => h_mid.try_clone()?,
    };
    let (mut out, mlp) = block.mlp.forward_saving(&x2, lora.1)?;
    let mlp_out = norm_keeping_input(block.mlp_out_norm, &mut out)?;
    if block.branch_scale != 1.0 {
        ops::scale_inplace(&mut out, block.branch_scale)?;
    }
    let mut h_out = h_mid.try_clone()?;
    ops::add_inplace(&mut h_out, &out)?;
    let tail = match &block.tail {
        Some(tail) => {
            let (out, saved) = tail.forward_saving(&h_out, lora.1)?;
            let input = h_out.try_clone()?;
            ops::add_inplace(&mut h_out, &out)?;
            Some((input, saved))
        }
        None => None,
    };
    if block.output_scale != 1.0 {
        ops::scale_inplace(&mut h_out, block.output_scale)?;
    }
    let saved = Saved {
        h_in,
        x1,
        mixer,
        mixer_out,
        h_mid,
        x2,
        mlp,
        mlp_out,
        tail,
    };
    Ok((saved, h_out))
}

/// Norms `x` in place where there is a norm, and returns what it was (for the backward pass).
pub(crate) fn norm_keeping_input(
    norm: Option<&RmsNorm>,
    x: &mut Tensor,
) -> OpResult<Option<Tensor>> {
    let Some(norm) = norm else { return Ok(None) };
    let input = x.try_clone()?;
    norm.forward_inplace(x)?;
    Ok(Some(input))
}

/// `dy` taken back through `norm` of `x` (as is, when there is no norm).
pub(crate) fn through_norm(norm: Option<&RmsNorm>, x: Option<&Tensor>, dy: &[f32]) -> Vec<f32> {
    match (norm, x) {
        (Some(norm), Some(x)) => norm_backward(norm, x.data(), dy),
        _ => dy.to_vec(),
    }
}

/// `dy` taken back through `norm` of `x`.
pub(crate) fn norm_backward(norm: &RmsNorm, x: &[f32], dy: &[f32]) -> Vec<f32> {
    let mut dx = vec![0.0; dy.len()];
    rms_norm_backward(x, norm.weight.data(), norm.eps, dy, &mut dx);
    dx
}

/// One block's adapters and their gradient slots, for the backward pass through its layers.
pub struct BlockGrads<'a> {
    block: usize,
    /// The sequence's length.
    pub tokens: usize,
    adapters: &'a Adapters,
    grads: &'a mut AdapterGrads,
}

impl BlockGrads<'_> {
    /// Backward of the block's layer `name` in `at` (a module, or one expert of a stack) for
    /// input `x` and output gradient `dy`: adds its adapter's gradients, returns `dx` when
    /// `need_dx`.
    pub fn linear<'m>(
        &mut self,
        linear: &Linear,
        at: impl Into<At<'m>>,
        name: &str,
        x: &[f32],
        dy: &[f32],
        need_dx: bool,
    ) -> Option<Vec<f32>> {
        let at = at.into();
        let mut lora = self.adapters.module(self.block, at.module);
        let block = self.adapters.block_path(self.block);
        let path = match at.module {
            "" => format!("{block}.{name}"),
            module => format!("{block}.{module}.{name}"),
        };
        let slot = match at.expert {
            Some(e) => {
                lora = lora.expert(e);
                self.grads.experts.get_mut(&path).and_then(|g| g.get_mut(e))
            }
            None => self.grads.layers.get_mut(&path),
        };
        let rows = x.len() / linear.weight.cols();
        linear_backward(linear, lora.get_one(name).zip(slot), x, dy, rows, need_dx)
    }

    /// The gradient of the input `x` that the layers of `projections` (under `module`) share,
    /// each with its output gradient, when `need_dx`; their adapters' gradients are added.
    pub fn inputs_of(
        &mut self,
        projections: &[(&Linear, &str, &Vec<f32>)],
        module: &str,
        x: &[f32],
        need_dx: bool,
    ) -> Option<Vec<f32>> {
        let mut dx: Option<Vec<f32>> = None;
        for &(linear, name, dy) in projections {
            let d = self.linear(linear, module, name, x, dy, need_dx);
            dx = match (dx, d) {
                (Some(acc), Some(d)) => Some(add(acc, &d)),
                (acc, d) => acc.or(d),
            };
        }
        dx
    }

    /// [`BlockGrads::linear`] for a layer whose input gradient is needed.
    pub fn through<'m>(
        &mut self,
        linear: &Linear,
        at: impl Into<At<'m>>,
        name: &str,
        x: &[f32],
        dy: &[f32],
    ) -> Vec<f32> {
        self.linear(linear, at, name, x, dy, true)
            .expect("dx was asked for")
    }
}

/// Backward of one block: returns `dh_in` unless `lowest` (nothing below needs it).
fn backward_block(
    block: &DecoderBlock,
    s: &Saved,
    mut dh_out: Vec<f32>,
    mut g: BlockGrads,
    lowest: bool,
) -> Option<Vec<f32>> {
    if block.output_scale != 1.0 {
        dh_out.iter_mut().for_each(|d| *d *= block.output_scale);
    }
    if let Some((input, tail)) = &s.tail {
        let d_input = tail.backward(input.data(), &dh_out, &mut g);
        add_inplace(&mut dh_out, &d_input);
    }
    let branch = |d: &[f32]| -> Vec<f32> {
        let scale = block.branch_scale;
        d.iter().map(|d| d * scale).collect()
    };
    let d_mlp = through_norm(block.mlp_out_norm, s.mlp_out.as_ref(), &branch(&dh_out));
    let dx2 = s.mlp.backward(s.x2.data(), &d_mlp, &mut g);
    let dh_mid = add(through_norm(block.mlp_norm, Some(&s.h_mid), &dx2), &dh_out);
    let d_mixed = through_norm(block.mixer_out_norm, s.mixer_out.as_ref(), &branch(&dh_mid));
    let dx1 = s.mixer.backward(s.x1.data(), &d_mixed, &mut g, !lowest)?;
    let dh_in = through_norm(block.input_norm, Some(&s.h_in), &dx1);
    Some(add(dh_in, &dh_mid))
}

/// Rows `start..start + rows` of `h` (the last block's output), and the logits the final norm
/// and the head (soft-capped, where the model caps them) make of them, with the head's weight.
fn head_logits<'m>(
    model: &'m dyn Decoder,
    h: &Tensor,
    start: usize,
    rows: usize,
) -> OpResult<(Tensor, Vec<f32>, &'m Weight)> {
    let (head, embed) = model.output();
    let hs = ops::rows(h, start, rows)?;
    let normed = head.norm.forward(&hs)?;
    let (mut logits, weight) = match &head.lm_head {
        Some(head) => (head.forward(&normed)?, &head.weight),
        None => (embed.as_linear(&normed)?, &embed.weight),
    };
    if let Some(cap) = head.softcap {
        ops::softcap_inplace(&mut logits, cap)?;
    }
    Ok((hs, logits.into_vec()?, weight))
}

/// The loss over the scored positions of `h` (the last block's output), summed.
fn head_sum(model: &dyn Decoder, h: &Tensor, ex: &Example) -> OpResult<f64> {
    let vocab = model.info().vocab_size;
    let n = ex.inputs.len();
    let mut sum = 0.0f64;
    for start in (ex.loss_from..n).step_by(HEAD_ROWS) {
        let rows = HEAD_ROWS.min(n - start);
        let (_, logits, _) = head_logits(model, h, start, rows)?;
        for (t, row) in logits.chunks_exact(vocab).enumerate() {
            sum += cross_entropy(row, ex.targets[start + t] as usize) as f64;
        }
    }
    Ok(sum)
}

/// [`head_sum`], and `dloss · ∂loss/∂h` in a new `dh`.
fn head_backward(
    model: &dyn Decoder,
    h: &Tensor,
    ex: &Example,
    dloss: f32,
) -> OpResult<(f64, Vec<f32>)> {
    let info = model.info();
    let (dim, vocab) = (info.hidden_size, info.vocab_size);
    let (head, _) = model.output();
    let (norm, softcap) = (&head.norm, head.softcap);
    let mut dh = vec![0.0; h.len()];
    let mut sum = 0.0f64;
    let n = ex.inputs.len();
    for start in (ex.loss_from..n).step_by(HEAD_ROWS) {
        let rows = HEAD_ROWS.min(n - start);
        let (hs, mut logits, weight) = head_logits(model, h, start, rows)?;
        // cap · tanh(z / cap) has the derivative 1 - tanh², from the capped logits.
        let slopes: Option<Vec<f32>> = softcap.map(|cap| {
            let slope = |l: &f32| 1.0 - (l / cap) * (l / cap);
            logits.iter().map(slope).collect()
        });
        for (t, row) in logits.chunks_exact_mut(vocab).enumerate() {
            let target = ex.targets[start + t] as usize;
            sum += cross_entropy(row, target) as f64;
            cross_entropy_backward_inplace(row, target, dloss);
        }
        if let Some(slopes) = slopes {
            logits.iter_mut().zip(slopes).for_each(|(d, s)| *d *= s);
        }
        let dnormed = base_input_grad(weight, &logits, rows);
        rms_norm_backward(
            hs.data(),
            norm.weight.data(),
            norm.eps,
            &dnormed,
            &mut dh[start * dim..(start + rows) * dim],
        );
    }
    Ok((sum, dh))
}

fn check_example(model: &dyn Decoder, ex: &Example) -> Result<(), ForwardError> {
    check_tokens(model.info(), &ex.inputs, 0)?;
    check_tokens(model.info(), &ex.targets, 0)?;
    assert!(
        ex.targets.len() == ex.inputs.len() && ex.loss_from < ex.inputs.len(),
        "malformed example"
    );
    Ok(())
}

/// LoRA training runs on the host.
fn check_cpu(model: &dyn Decoder) -> Result<(), ForwardError> {
    if model.info().device.is_cpu() {
        return Ok(());
    }
    Err(ForwardError::Engine(oxlm_engine::EngineError::Device(
        "LoRA training runs on the CPU: load the model with the cpu device".into(),
    )))
}

/// The first block with an adapter (the number of blocks when none has): the blocks below it
/// run without keeping anything, and the backward pass stops there.
fn lowest_adapted_block(model: &dyn Decoder, adapters: &Adapters) -> usize {
    let layers = model.info().num_layers;
    (0..layers)
        .find(|&i| {
            let prefix = format!("{}.", adapters.block_path(i));
            let mut paths = adapters.layers.keys().chain(adapters.experts.keys());
            paths.any(|p| p.starts_with(&prefix))
        })
        .unwrap_or(layers)
}

/// The adapters of block `i` of `blocks`.
fn block_lora<'a>(blocks: &'a [DecoderBlock], adapters: &'a Adapters, i: usize) -> Lora<'a> {
    let block = BlockAdapters {
        adapters: Some(adapters),
        block: i,
    };
    (block.module(blocks[i].mixer.module()), block)
}

/// One sequence's forward pass through the blocks: what each adapted block keeps for the
/// backward pass, and the last block's output.
struct SequencePass<'b> {
    kept: Vec<Kept<'b>>,
    h: Tensor,
    tokens: usize,
}

impl<'b> SequencePass<'b> {
    /// `blocks` (as the model runs them over `inputs`) over `inputs`' embeddings, adapted by
    /// `adapters` from the block `lowest` up.
    fn forward(
        model: &dyn Decoder,
        blocks: &'b [DecoderBlock],
        inputs: &[u32],
        adapters: &Adapters,
        lowest: usize,
        checkpoint: bool,
    ) -> Result<Self, ForwardError> {
        let mut h = model.embed(inputs)?;
        for block in &blocks[..lowest] {
            let none = (ModuleAdapters::NONE, BlockAdapters::NONE);
            h = forward_block(block, h, none)?.1;
        }
        let mut kept = Vec::new();
        for (i, block) in blocks.iter().enumerate().skip(lowest) {
            let s;
            (s, h) = forward_block(block, h, block_lora(blocks, adapters, i))?;
            kept.push(if checkpoint {
                Kept::Input(s.h_in)
            } else {
                Kept::All(Box::new(s))
            });
        }
        Ok(SequencePass {
            kept,
            h,
            tokens: inputs.len(),
        })
    }

    /// Adds the adapters' gradients for `dh`, the gradient of the last block's output, into
    /// `grads`; `blocks`, `adapters` and `lowest` as the forward pass had them.
    fn backward(
        self,
        blocks: &'b [DecoderBlock],
        adapters: &Adapters,
        lowest: usize,
        mut dh: Vec<f32>,
        grads: &mut AdapterGrads,
    ) -> Result<(), ForwardError> {
        for (j, k) in self.kept.into_iter().enumerate().rev() {
            let i = lowest + j;
            let block = &blocks[i];
            let s = match k {
                Kept::All(s) => *s,
                Kept::Input(h_in) => forward_block(block, h_in, block_lora(blocks, adapters, i))?.0,
            };
            let g = BlockGrads {
                block: i,
                tokens: self.tokens,
                adapters,
                grads: &mut *grads,
            };
            match backward_block(block, &s, dh, g, i == lowest) {
                Some(d) => dh = d,
                None => break,
            }
        }
        Ok(())
    }
}

/// See [`crate::lora::Adaptable::loss_and_grads`].
pub(crate) fn loss_and_grads(
    model: &dyn Decoder,
    examples: &[Example],
    adapters: &Adapters,
    dropout: Option<&BatchDropout>,
    checkpoint: bool,
) -> Result<LossAndGrads, ForwardError> {
    check_cpu(model)?;
    for ex in examples {
        check_example(model, ex)?;
    }
    let tokens: usize = examples.iter().map(Example::scored).sum();
    let mut grads = AdapterGrads::zeros(adapters);
    let lowest = lowest_adapted_block(model, adapters);
    let dloss = 1.0 / tokens.max(1) as f32;
    let mut sum = 0.0f64;
    for (n, ex) in examples.iter().enumerate() {
        let dropped = dropout.map(|d| d.for_example(adapters, n));
        let adapters = dropped.as_ref().unwrap_or(adapters);
        let blocks = model.blocks(&ex.inputs)?;
        let pass = SequencePass::forward(model, &blocks, &ex.inputs, adapters, lowest, checkpoint)?;
        let (loss, dh) = head_backward(model, &pass.h, ex, dloss)?;
        sum += loss;
        pass.backward(&blocks, adapters, lowest, dh, &mut grads)?;
    }
    Ok(LossAndGrads {
        loss: (sum / tokens.max(1) as f64) as f32,
        tokens,
        grads,
    })
}

/// See [`crate::lora::Adaptable::sums`].
pub(crate) fn sums(
    model: &dyn Decoder,
    examples: &[Example],
    adapters: &Adapters,
) -> Result<Vec<f64>, ForwardError> {
    check_cpu(model)?;
    let lowest = lowest_adapted_block(model, adapters);
    let mut sums = Vec::with_capacity(examples.len());
    for ex in examples {
        check_example(model, ex)?;
        let blocks = model.blocks(&ex.inputs)?;
        // No backward pass follows: the blocks need keep only their inputs.
        let pass = SequencePass::forward(model, &blocks, &ex.inputs, adapters, lowest, true)?;
        sums.push(head_sum(model, &pass.h, ex)?);
    }
    Ok(sums)
}

/// See [`crate::lora::Adaptable::grads_of_sums`].
pub(crate) fn grads_of_sums(
    model: &dyn Decoder,
    groups: &[&[Example]],
    adapters: &Adapters,
    dropout: Option<&BatchDropout>,
    checkpoint: bool,
    weigh: &mut dyn FnMut(usize, &[f64]) -> Vec<f32>,
) -> Result<SumsAndGrads, ForwardError> {
    check_cpu(model)?;
    for ex in groups.iter().copied().flatten() {
        check_example(model, ex)?;
    }
    let mut grads = AdapterGrads::zeros(adapters);
    let lowest = lowest_adapted_block(model, adapters);
    let mut sums = Vec::with_capacity(groups.len());
    // The place of each example among all the groups' examples, which its dropout masks follow.
    let mut first = 0;
    for (g, group) in groups.iter().enumerate() {
        let places = first..first + group.len();
        first = places.end;
        let dropped: Vec<_> = places
            .map(|n| dropout.map(|d| d.for_example(adapters, n)))
            .collect();
        let used: Vec<&Adapters> = (dropped.iter())
            .map(|d| d.as_ref().unwrap_or(adapters))
            .collect();
        let blocks = (group.iter())
            .map(|ex| model.blocks(&ex.inputs))
            .collect::<Result<Vec<_>, _>>()?;
        let (mut passes, mut group_sums) = (Vec::new(), Vec::new());
        for ((ex, blocks), &adapters) in group.iter().zip(&blocks).zip(&used) {
            let pass =
                SequencePass::forward(model, blocks, &ex.inputs, adapters, lowest, checkpoint)?;
            // The gradient is linear in the weight, not known yet: take it at 1 and scale it.
            let (sum, dh) = head_backward(model, &pass.h, ex, 1.0)?;
            group_sums.push(sum);
            passes.push((pass, dh));
        }
        let weights = weigh(g, &group_sums);
        assert_eq!(weights.len(), group.len(), "a weight for each example");
        for (((pass, mut dh), weight), (blocks, &adapters)) in passes
            .into_iter()
            .zip(weights)
            .zip(blocks.iter().zip(&used))
        {
            dh.iter_mut().for_each(|d| *d *= weight);
            pass.backward(blocks, adapters, lowest, dh, &mut grads)?;
        }
        sums.push(group_sums);
    }
    Ok(SumsAndGrads { sums, grads })
}
