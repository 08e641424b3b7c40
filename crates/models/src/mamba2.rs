//! Mamba-2's mixer (mlx-lm's `Mamba2Mixer` of `granitemoehybrid.py` and `nemotron_h.py`, over
//! `ssm.py`): one projection gives a gate `z`, the convolution's input and a step `dt` per
//! head; a causal depthwise convolution (then SiLU) over the last `conv_kernel` positions
//! gives the inputs `x`, the input mixing `B` and the output mixing `C`; the selective
//! state-space scan runs per head over a `[head_dim, state]` state,
//!
//! ```text
//! Δ = clip(softplus(dt + dt_bias), time_step_limit);   S ← exp(−exp(A_log)·Δ)·S + Δ·x Bᵀ;
//! y = S C + D·x
//! ```
//!
//! (heads share `B` and `C` in `n_groups` groups); then `y · silu(z)` is RMS-normed (as a
//! whole, or group by group) and projected out. Its cache holds the last
//! `conv_kernel - 1` convolution inputs and the states, as mlx-lm's `ArraysCache(size=2)`.

use oxlm_engine::ops::recurrent::{self, DeltaRuleDims};
use oxlm_engine::{ops, Device, EngineError, Tensor};

use crate::cache::{Cache, KvCache, LayerCache, RecurrentCache};
use crate::checkpoint::Scope;
use crate::layers::{
    linear_shape, load_conv1d, load_host_vector, load_vector, place_vector, Attention, Linear,
    OpResult, RmsNorm,
};
use crate::lora::{LinearShape, ModuleAdapters};
use crate::LoadError;

/// The mixer's sizes and settings, as an architecture's config gives them.
#[derive(Debug, Clone, Copy)]
pub struct Mamba2Args {
    pub hidden: usize,
    pub heads: usize,
    pub head_dim: usize,
    pub groups: usize,
    pub state: usize,
    pub conv_kernel: usize,
    pub conv_bias: bool,
    pub proj_bias: bool,
    /// Groups the gated norm works over: 1 (Granite's, over all the features) or `groups`
    /// (Nemotron-H's).
    pub norm_groups: usize,
    pub eps: f32,
    /// The step's bounds.
    pub time_step_limit: (f32, f32),
}

impl Mamba2Args {
    /// The width of the scan's inputs and outputs.
    fn inner(&self) -> usize {
        self.heads * self.head_dim
    }

    /// The convolution's channels: the inputs, then `B` and `C`.
    fn conv_channels(&self) -> usize {
        self.inner() + 2 * self.groups * self.state
    }

    /// The scan's sizes in the delta rule's terms: `B`, `C` as keys and queries, `x` as
    /// values.
    fn dims(&self) -> DeltaRuleDims {
        DeltaRuleDims {
            k_heads: self.groups,
            v_heads: self.heads,
            k_dim: self.state,
            v_dim: self.head_dim,
        }
    }
}

/// Where a block keeps its mixer, as its checkpoint and mlx-lm's adapters name it.
#[derive(Debug, Clone, Copy)]
pub struct Mamba2Names {
    pub module: &'static str,
    /// `module.in_proj`, `module.out_proj`.
    pub keys: [&'static str; 2],
}

/// The norm of `y · silu(z)`: over all the features, or over each group of them with the
/// weight applied after (Nemotron-H's `MambaRMSNormGated`).
enum GatedNorm {
    Whole(RmsNorm),
    Grouped { unit: RmsNorm, weight: Tensor },
}

pub struct Mamba2Mixer {
    in_proj: Linear,
    /// `[channels, kernel]`.
    conv: Tensor,
    conv_bias: Option<Tensor>,
    dt_bias: Tensor,
    /// `-exp(A_log)`.
    neg_a: Tensor,
    /// `D`.
    skip: Tensor,
    norm: GatedNorm,
    out_proj: Linear,
    args: Mamba2Args,
    names: Mamba2Names,
}

impl Mamba2Mixer {
    /// From the block's scope.
    pub fn load(
        block: &mut Scope,
        args: Mamba2Args,
        names: Mamba2Names,
    ) -> Result<Self, LoadError> {
        let vb = &mut block.pp(names.module);
        let (inner, channels, heads) = (args.inner(), args.conv_channels(), args.heads);
        if heads == 0 || args.groups == 0 || !heads.is_multiple_of(args.groups) {
            return Err(LoadError::Config(format!(
                "{heads} Mamba heads cannot be grouped in {} groups",
                args.groups
            )));
        }
        let (lo, hi) = args.time_step_limit;
        if lo.is_nan() || hi.is_nan() || lo > hi {
            return Err(LoadError::Config(format!(
                "`time_step_limit` [{lo}, {hi}] is no range: its low bound must not exceed its high"
            )));
        }
        let groups = args.norm_groups;
        if groups == 0 || !inner.is_multiple_of(groups) {
            return Err(LoadError::Config(format!(
                "a gated norm over {groups} groups of {inner} features"
            )));
        }
        let norm = match groups {
            1 => GatedNorm::Whole(RmsNorm::load(&mut vb.pp("norm"), inner, args.eps)?),
            _ => GatedNorm::Grouped {
                unit: RmsNorm::unscaled(inner / groups, args.eps, vb.device())?,
                weight: load_vector(&mut vb.pp("norm"), "weight", inner)?,
            },
        };
        let a_log = load_host_vector(vb, "A_log", heads)?;
        let neg_a: Vec<f32> = a_log.iter().map(|&a| -a.exp()).collect();
        let device = vb.device().clone();
        let in_width = inner + channels + heads;
        Ok(Mamba2Mixer {
            in_proj: Linear::load(&mut vb.pp("in_proj"), args.hidden, in_width, args.proj_bias)?,
            conv: load_conv1d(vb, "conv1d.weight", channels, args.conv_kernel)?,
            conv_bias: args
                .conv_bias
                .then(|| load_vector(&mut vb.pp("conv1d"), "bias", channels))
                .transpose()?,
            dt_bias: load_vector(vb, "dt_bias", heads)?,
            neg_a: place_vector(&neg_a, &device, &vb.path_of("A_log"))?,
            skip: load_vector(vb, "D", heads)?,
            norm,
            out_proj: Linear::load(&mut vb.pp("out_proj"), inner, args.hidden, args.proj_bias)?,
            args,
            names,
        })
    }

    /// A sequence's zero state, on `device`.
    pub fn new_cache(&self, device: &Device) -> Result<RecurrentCache, EngineError> {
        let a = &self.args;
        RecurrentCache::new(a.conv_channels(), a.conv_kernel, a.dims(), device)
    }

    /// Whether `cache` is a state of this mixer's shape.
    pub fn fits(&self, cache: &RecurrentCache) -> bool {
        let a = &self.args;
        cache.conv.len() == (a.conv_kernel - 1) * a.conv_channels()
            && cache.state.len() == a.dims().state_len()
    }

    /// The mixer's output for `x`: one sequence's tokens continuing the one state of
    /// `caches`, or the next token of each sequence continuing its own.
    pub fn forward(
        &self,
        x: &Tensor,
        caches: &mut [&mut RecurrentCache],
        lora: ModuleAdapters,
    ) -> OpResult<Tensor> {
        let a = &self.args;
        let (inner, channels, heads) = (a.inner(), a.conv_channels(), a.heads);
        let bc = a.groups * a.state;
        let projected = self.in_proj.forward_adapted(x, lora.get("in_proj"))?;
        let gate = ops::columns(&projected, 0, inner)?;
        let conv_in = ops::columns(&projected, inner, channels)?;
        let dt = ops::columns(&projected, inner + channels, heads)?;
        let mut convs: Vec<&mut Tensor> = caches.iter_mut().map(|c| &mut c.conv).collect();
        let mut conv = recurrent::causal_conv1d(&conv_in, &self.conv, a.conv_kernel, &mut convs)?;
        if let Some(bias) = &self.conv_bias {
            ops::add_row_inplace(&mut conv, bias)?;
        }
        ops::silu_inplace(&mut conv)?;
        let xs = ops::columns(&conv, 0, inner)?;
        let b = ops::columns(&conv, inner, bc)?;
        let c = ops::columns(&conv, inner + bc, bc)?;
        let (decay, step) =
            recurrent::ssm_gates(&dt, &self.dt_bias, &self.neg_a, a.time_step_limit)?;
        let mut states: Vec<&mut Tensor> = caches.iter_mut().map(|c| &mut c.state).collect();
        let y = recurrent::ssm_scan(
            &c,
            &b,
            &xs,
            &decay,
            &step,
            &self.skip,
            a.dims(),
            &mut states,
        )?;
        // `swiglu(z, y)`: the gate's SiLU times the scan's output, then normed.
        let mut gated = gate;
        ops::silu_mul_inplace(&mut gated, &y)?;
        match &self.norm {
            GatedNorm::Whole(norm) => norm.forward_inplace(&mut gated)?,
            GatedNorm::Grouped { unit, weight } => {
                let (rows, groups) = (gated.rows(), a.norm_groups);
                let mut by_group = gated.reshape(vec![rows * groups, inner / groups]);
                unit.forward_inplace(&mut by_group)?;
                gated = by_group.reshape(vec![rows, inner]);
                ops::mul_row_inplace(&mut gated, weight)?;
            }
        }
        self.out_proj.forward_adapted(&gated, lora.get("out_proj"))
    }

    /// Its projections, as mlx-lm's default LoRA keys select them.
    pub fn linears(&self) -> Vec<LinearShape> {
        let [in_proj, out_proj] = self.names.keys;
        vec![
            linear_shape(in_proj, &self.in_proj),
            linear_shape(out_proj, &self.out_proj),
        ]
    }
}

/// A Mamba-2 hybrid's block that keeps a cache: a Mamba-2 mixer's state, or attention's keys
/// and values (the hybrids' other blocks keep none).
#[derive(Clone, Copy)]
pub enum CachedMixer<'a> {
    Mamba(&'a Mamba2Mixer),
    Attention(&'a Attention),
}

impl CachedMixer<'_> {
    /// A sequence's empty cache of this block, on `device`.
    pub fn new_cache(self, device: &Device) -> Result<LayerCache, EngineError> {
        Ok(match self {
            CachedMixer::Mamba(m) => LayerCache::Recurrent(m.new_cache(device)?),
            CachedMixer::Attention(a) => {
                LayerCache::Kv(KvCache::new(a.kv_heads, a.head_dim, device)?)
            }
        })
    }

    /// Whether `cache` is of this block's kind and shape.
    fn fits(self, cache: &LayerCache) -> bool {
        match (self, cache) {
            (CachedMixer::Mamba(m), LayerCache::Recurrent(r)) => m.fits(r),
            (CachedMixer::Attention(a), LayerCache::Kv(kv)) => {
                kv.shape() == (a.kv_heads, a.head_dim)
            }
            _ => false,
        }
    }
}

/// Whether `cache` holds, for each of `mixers` in order, a cache of its kind and shape.
pub fn caches_fit<'a>(
    mixers: impl Iterator<Item = CachedMixer<'a>> + Clone,
    cache: &Cache,
) -> bool {
    mixers.clone().count() == cache.layers.len()
        && mixers.zip(&cache.layers).all(|(m, c)| m.fits(c))
}
