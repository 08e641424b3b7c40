//! Sparse mixtures of experts: the stacked expert weights of mlx-lm's `switch_layers.py`
//! (`SwitchGLU`) and the routed blocks of `qwen3_moe.py` and `mixtral.py` (top-k over a softmax
//! router) and of `qwen3_next.py` (the same plus a sigmoid-gated shared expert).

pub(crate) mod grad;

use oxlm_engine::cpu::elementwise::sigmoid;
use oxlm_engine::cpu::experts;
use oxlm_engine::ops::experts::ExpertStack;
use oxlm_engine::params::{ExpertChoice, ExpertGroups, Scoring};
use oxlm_engine::{ops, Device, FloatMatrix, Tensor};

use crate::checkpoint::{RawTensor, Scope};
use crate::decoder_grad::{GatedMlpGrad, MlpGrad};
use crate::layers::{
    experts_shape, linear_shape, load_host_array, load_host_vector, place_vector, Linear, Mlp,
    OpResult, QuantizedArrays, Weight,
};
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

/// One GLU block per expert from the module's stacked `{gate,up,down}_proj` tensors, with
/// their stacked `bias` (`[experts, rows]`) where `biased`.
pub fn load_experts(
    vb: &mut Scope,
    experts: usize,
    dim: usize,
    intermediate: usize,
    biased: bool,
) -> Result<Vec<Mlp>, LoadError> {
    let mut stack = |name: &str, rows: usize, cols: usize| -> Result<Vec<Linear>, LoadError> {
        let mut vb = vb.pp(name);
        let weights = load_stacked(&mut vb, experts, rows, cols)?;
        let biases = match biased {
            true => {
                let all = load_host_array(&mut vb, "bias", &[experts, rows])?;
                let device = vb.device().clone();
                let path = vb.path_of("bias");
                all.chunks_exact(rows)
                    .map(|b| place_vector(b, &device, &path).map(Some))
                    .collect::<Result<Vec<_>, _>>()?
            }
            false => vec![None; experts],
        };
        Ok(weights
            .into_iter()
            .zip(biases)
            .map(|(weight, bias)| Linear { weight, bias })
            .collect())
    };
    let gates = stack("gate_proj", intermediate, dim)?;
    let ups = stack("up_proj", intermediate, dim)?;
    let downs = stack("down_proj", dim, intermediate)?;
    Ok(gates
        .into_iter()
        .zip(ups)
        .zip(downs)
        .map(|((gate_proj, up_proj), down_proj)| Mlp {
            gate_proj,
            up_proj,
            down_proj,
        })
        .collect())
}

/// A mixture's experts: the width of each, its activation and whether its projections have
/// biases (gpt-oss's).
#[derive(Debug, Clone, Copy)]
pub struct ExpertMlps {
    pub intermediate: usize,
    pub activation: ops::Activation,
    pub biased: bool,
}

impl ExpertMlps {
    /// SwiGLU experts without biases, as most mixtures have them.
    pub fn swiglu(intermediate: usize) -> Self {
        ExpertMlps {
            intermediate,
            activation: ops::Activation::Silu,
            biased: false,
        }
    }
}

/// Runs expert `e` once on all the rows of `x` (`[n, dim]`) routed to it (`routed[e]` holds
/// `(token, weight)` pairs), so only the chosen experts' weights are read, and sums the
/// weighted outputs per token.
pub fn dispatch(
    x: &Tensor,
    routed: &[Vec<(usize, f32)>],
    run_expert: impl Fn(usize, &Tensor) -> OpResult<Tensor>,
) -> OpResult<Tensor> {
    dispatch_weighing(x, routed, false, run_expert)
}

/// [`dispatch`], or with `weigh_inputs` each row weighted on its way into its expert and the
/// outputs summed as they are (Llama 4's routing).
fn dispatch_weighing(
    x: &Tensor,
    routed: &[Vec<(usize, f32)>],
    weigh_inputs: bool,
    run_expert: impl Fn(usize, &Tensor) -> OpResult<Tensor>,
) -> OpResult<Tensor> {
    let device = x.device();
    let mut y = Tensor::zeros(x.shape().to_vec(), &device)?;
    for (e, tokens) in routed.iter().enumerate() {
        if tokens.is_empty() {
            continue;
        }
        let (rows, mut weights): (Vec<usize>, Vec<f32>) = tokens.iter().copied().unzip();
        let mut input = ops::gather_rows(x, &rows)?;
        if weigh_inputs {
            let order: Vec<usize> = (0..rows.len()).collect();
            let mut weighted = Tensor::zeros(input.shape().to_vec(), &device)?;
            ops::scatter_add_rows(&mut weighted, &input, &order, &weights)?;
            input = weighted;
            weights.fill(1.0);
        }
        let out = run_expert(e, &input)?;
        ops::scatter_add_rows(&mut y, &out, &rows, &weights)?;
    }
    Ok(y)
}

/// A block's feed-forward part: a SwiGLU MLP, or a mixture of experts in its place.
// One per layer, held in a Vec: the variants' sizes do not matter.
#[allow(clippy::large_enum_variant)]
pub(crate) enum FeedForward {
    Dense(Mlp),
    Moe(SparseMoe),
}

impl FeedForward {
    /// Its layers, as mlx-lm's default LoRA keys select them (under `mlp`).
    pub(crate) fn linears(&self) -> Vec<LinearShape> {
        match self {
            FeedForward::Dense(mlp) => mlp.linears(),
            FeedForward::Moe(moe) => moe.linears(),
        }
    }

    /// Its output for the rows `x`, with the adapters `lora` gives for each module of the
    /// block (`mlp`, `mlp.switch_mlp`, the shared expert's).
    pub(crate) fn forward<'a>(
        &self,
        x: &Tensor,
        lora: impl Fn(&'static str) -> ModuleAdapters<'a>,
    ) -> OpResult<Tensor> {
        match self {
            FeedForward::Dense(mlp) => mlp.forward_adapted(x, lora("mlp")),
            FeedForward::Moe(moe) => moe.forward(x, lora),
        }
    }

    /// As the backward pass sees it.
    pub(crate) fn grad(&self) -> Box<dyn MlpGrad + '_> {
        match self {
            FeedForward::Dense(mlp) => Box::new(GatedMlpGrad {
                mlp,
                activation: ops::Activation::Silu,
            }),
            FeedForward::Moe(moe) => Box::new(moe),
        }
    }
}

/// Where a mixture's layers sit in its block, as its checkpoint names them (and so mlx-lm's
/// adapters): the module, the router and the stacked experts within it, and their keys.
#[derive(Debug, Clone, Copy)]
pub struct MoeNames {
    pub module: &'static str,
    pub router: &'static str,
    pub experts: &'static str,
    /// `module.router`, split where an adapter's module ends.
    pub router_key: (&'static str, &'static str),
    /// `module.experts`, and its three stacked layers.
    pub experts_key: &'static str,
    pub expert_keys: [&'static str; 3],
}

impl MoeNames {
    /// Qwen's and most others': `mlp.gate`, `mlp.switch_mlp`.
    pub const MLP: MoeNames = MoeNames {
        module: "mlp",
        router: "gate",
        experts: "switch_mlp",
        router_key: ("mlp", "gate"),
        experts_key: "mlp.switch_mlp",
        expert_keys: [
            "mlp.switch_mlp.gate_proj",
            "mlp.switch_mlp.up_proj",
            "mlp.switch_mlp.down_proj",
        ],
    };
    /// Mixtral's: `block_sparse_moe.gate`, `block_sparse_moe.switch_mlp`.
    pub const BLOCK_SPARSE: MoeNames = MoeNames {
        module: "block_sparse_moe",
        router: "gate",
        experts: "switch_mlp",
        router_key: ("block_sparse_moe", "gate"),
        experts_key: "block_sparse_moe.switch_mlp",
        expert_keys: [
            "block_sparse_moe.switch_mlp.gate_proj",
            "block_sparse_moe.switch_mlp.up_proj",
            "block_sparse_moe.switch_mlp.down_proj",
        ],
    };
    /// Granite-MoE's: its router at `block_sparse_moe.router.layer`.
    pub const GRANITE: MoeNames = MoeNames {
        router: "router.layer",
        router_key: ("block_sparse_moe.router", "layer"),
        ..MoeNames::BLOCK_SPARSE
    };
    /// Llama 4's: `feed_forward.router`, `feed_forward.experts`.
    pub const FEED_FORWARD: MoeNames = MoeNames {
        module: "feed_forward",
        router: "router",
        experts: "experts",
        router_key: ("feed_forward", "router"),
        experts_key: "feed_forward.experts",
        expert_keys: [
            "feed_forward.experts.gate_proj",
            "feed_forward.experts.up_proj",
            "feed_forward.experts.down_proj",
        ],
    };
    /// gpt-oss's: `mlp.router`, `mlp.experts`.
    pub const GPT_OSS: MoeNames = MoeNames {
        module: "mlp",
        router: "router",
        experts: "experts",
        router_key: ("mlp", "router"),
        experts_key: "mlp.experts",
        expert_keys: [
            "mlp.experts.gate_proj",
            "mlp.experts.up_proj",
            "mlp.experts.down_proj",
        ],
    };
}

/// Top-k routing over SwiGLU experts, with a shared expert beside them where the architecture
/// has one.
pub struct SparseMoe {
    /// Router: `hidden → experts` logits.
    gate: Linear,
    /// Added to the scores when choosing experts, not when weighting them (DeepSeek-V3's and
    /// GLM-4.5's `e_score_correction_bias`).
    correction_bias: Option<Vec<f32>>,
    /// One gated MLP per expert (`switch_mlp` holds them stacked).
    experts: Vec<Mlp>,
    activation: ops::Activation,
    routing: Routing,
    shared: Option<SharedExpert>,
    names: MoeNames,
    /// The experts as the GPU routes and runs them in one op, where it can.
    on_device: Option<DeviceExperts>,
}

/// A mixture on the GPU: its experts' stacked tables and the correction bias there.
struct DeviceExperts {
    stack: ExpertStack,
    correction_bias: Option<Tensor>,
}

impl DeviceExperts {
    /// `None` where the GPU op does not take the mixture (on the host, experts with biases or
    /// gpt-oss's clamped gate, float-mode weights) or its routing (inputs weighed by Llama 4's).
    fn new(
        experts: &[Mlp],
        mlps: ExpertMlps,
        routing: &Routing,
        correction_bias: Option<&[f32]>,
        device: &Device,
    ) -> Result<Option<Self>, LoadError> {
        if mlps.biased || routing.weigh_inputs || !matches!(device, Device::Cuda(_)) {
            return Ok(None);
        }
        let projections: Option<Vec<_>> = experts
            .iter()
            .map(|m| {
                Some([
                    m.gate_proj.weight.quantized()?,
                    m.up_proj.weight.quantized()?,
                    m.down_proj.weight.quantized()?,
                ])
            })
            .collect();
        let engine_err = |source| LoadError::Engine {
            name: "experts".into(),
            source,
        };
        let Some(projections) = projections else {
            return Ok(None);
        };
        let Some(stack) = ExpertStack::new(&projections, mlps.activation).map_err(engine_err)?
        else {
            return Ok(None);
        };
        let correction_bias = correction_bias
            .map(|b| place_vector(b, device, "e_score_correction_bias"))
            .transpose()?;
        Ok(Some(DeviceExperts {
            stack,
            correction_bias,
        }))
    }
}

/// An expert every token goes through: Qwen's `shared_expert`, weighted by a sigmoid gate of its
/// own (`shared_expert_gate`), or DeepSeek's and GLM's `shared_experts` and Llama 4's
/// `shared_expert`, not weighted.
struct SharedExpert {
    mlp: Mlp,
    names: SharedNames,
    gate: Option<Linear>,
}

/// Where a mixture's shared expert is and how wide.
#[derive(Debug, Clone, Copy)]
pub struct Shared {
    pub intermediate: usize,
    /// Weighted by its own sigmoid gate, `shared_expert_gate` beside it (Qwen's).
    pub gated: bool,
    pub names: SharedNames,
}

/// A shared expert's module in its block and its three layers' keys, as its checkpoint and
/// mlx-lm's adapters name them.
#[derive(Debug, Clone, Copy)]
pub struct SharedNames {
    pub path: &'static str,
    pub keys: [&'static str; 3],
}

impl SharedNames {
    /// The length of the mixture's own module, with its dot, at the start of `path`.
    fn module_len(&self) -> usize {
        self.path.find('.').map_or(0, |dot| dot + 1)
    }

    /// Qwen's.
    pub const SHARED_EXPERT: SharedNames = SharedNames {
        path: "mlp.shared_expert",
        keys: [
            "mlp.shared_expert.gate_proj",
            "mlp.shared_expert.up_proj",
            "mlp.shared_expert.down_proj",
        ],
    };
    /// DeepSeek's, GLM's and ERNIE's.
    pub const SHARED_EXPERTS: SharedNames = SharedNames {
        path: "mlp.shared_experts",
        keys: [
            "mlp.shared_experts.gate_proj",
            "mlp.shared_experts.up_proj",
            "mlp.shared_experts.down_proj",
        ],
    };
    /// Llama 4's.
    pub const FEED_FORWARD: SharedNames = SharedNames {
        path: "feed_forward.shared_expert",
        keys: [
            "feed_forward.shared_expert.gate_proj",
            "feed_forward.shared_expert.up_proj",
            "feed_forward.shared_expert.down_proj",
        ],
    };
}

impl SharedExpert {
    /// Adds its output `out` for the rows `x` into `y`, each row weighted by its gate where it
    /// has one (the router's adapters in `lora`); returns the gates.
    fn add_gated(
        &self,
        x: &Tensor,
        out: &Tensor,
        lora: ModuleAdapters,
        y: &mut Tensor,
    ) -> OpResult<Option<Vec<f32>>> {
        let Some(gate) = &self.gate else {
            ops::add_inplace(y, out)?;
            return Ok(None);
        };
        let gates: Vec<f32> = gate
            .forward_adapted(x, lora.get("shared_expert_gate"))?
            .into_vec()?
            .into_iter()
            .map(sigmoid)
            .collect();
        let all: Vec<usize> = (0..x.rows()).collect();
        ops::scatter_add_rows(y, out, &all, &gates)?;
        Ok(Some(gates))
    }
}

impl SparseMoe {
    /// Its layers, as mlx-lm's default LoRA keys select them (under `mlp`).
    pub(crate) fn linears(&self) -> Vec<LinearShape> {
        let experts = &self.experts;
        let [gate_proj, up_proj, down_proj] = self.names.expert_keys;
        let router = match self.names.router_key {
            ("mlp", "gate") => "mlp.gate",
            ("mlp", "router") => "mlp.router",
            ("feed_forward", "router") => "feed_forward.router",
            ("block_sparse_moe", "gate") => "block_sparse_moe.gate",
            _ => "block_sparse_moe.router.layer",
        };
        let mut out = vec![
            linear_shape(router, &self.gate),
            experts_shape(gate_proj, experts, |m| &m.gate_proj),
            experts_shape(up_proj, experts, |m| &m.up_proj),
            experts_shape(down_proj, experts, |m| &m.down_proj),
        ];
        if let Some(shared) = &self.shared {
            let [gate, up, down] = shared.names.keys;
            out.extend([
                linear_shape(gate, &shared.mlp.gate_proj),
                linear_shape(up, &shared.mlp.up_proj),
                linear_shape(down, &shared.mlp.down_proj),
            ]);
            if let Some(gate) = &shared.gate {
                out.push(linear_shape("mlp.shared_expert_gate", gate));
            }
        }
        out
    }

    /// From the block's scope: the router (with its `e_score_correction_bias` where the
    /// routing corrects its choices), the stacked experts and the shared expert `shared`
    /// describes, where `names` say.
    pub fn load(
        block: &mut Scope,
        names: MoeNames,
        dim: usize,
        routing: Routing,
        mlps: ExpertMlps,
        shared: Option<Shared>,
    ) -> Result<Self, LoadError> {
        let vb = &mut block.pp(names.module);
        let device = vb.device().clone();
        let experts = routing.choice.experts;
        let experts_mlps = load_experts(
            &mut vb.pp(names.experts),
            experts,
            dim,
            mlps.intermediate,
            mlps.biased,
        )?;
        let shared = shared
            .map(
                |Shared {
                     intermediate,
                     gated,
                     names,
                 }| {
                    let module = &names.path[names.module_len()..];
                    Ok::<_, LoadError>(SharedExpert {
                        mlp: Mlp::load(&mut vb.pp(module), dim, intermediate, false)?,
                        names,
                        gate: gated
                            .then(|| Linear::load(&mut vb.pp("shared_expert_gate"), dim, 1, false))
                            .transpose()?,
                    })
                },
            )
            .transpose()?;
        let mut gate_scope = vb.pp(names.router);
        let correction_bias = routing
            .corrected
            .then(|| load_host_vector(&mut gate_scope, "e_score_correction_bias", experts))
            .transpose()?;
        let on_device = DeviceExperts::new(
            &experts_mlps,
            mlps,
            &routing,
            correction_bias.as_deref(),
            &device,
        )?;
        Ok(SparseMoe {
            gate: Linear::load(&mut gate_scope, dim, experts, routing.router_bias)?,
            correction_bias,
            experts: experts_mlps,
            activation: mlps.activation,
            routing,
            shared,
            names,
            on_device,
        })
    }

    /// `x` is `[n, dim]`. Each expert runs once on all the tokens routed to it; routing is
    /// decided on the host from the router's logits. `lora` gives the adapters of each module
    /// of the block.
    pub fn forward<'a>(
        &self,
        x: &Tensor,
        lora: impl Fn(&'static str) -> ModuleAdapters<'a>,
    ) -> OpResult<Tensor> {
        if let Some(device) = &self.on_device {
            if ops::experts::mixture_applies(x.rows(), &self.routing.choice)
                && lora(self.names.module).is_empty()
            {
                return self.forward_on_device(device, x);
            }
        }
        let (router_module, router) = self.names.router_key;
        let router = lora(router_module).get(router);
        let experts = lora(self.names.experts_key);
        let mut scores = self.gate.forward_adapted(x, router)?.into_vec()?;
        let chosen = self.route(&mut scores);
        let routed = by_expert(&chosen, self.routing.top_k(), self.experts.len());
        let run_expert = |e: usize, rows: &Tensor| {
            self.experts[e].forward_with(rows, experts.expert(e), self.activation)
        };
        let mut y = dispatch_weighing(x, &routed, self.routing.weigh_inputs, run_expert)?;
        let Some(expert) = &self.shared else {
            return Ok(y);
        };
        let out = expert.mlp.forward_adapted(x, lora(expert.names.path))?;
        expert.add_gated(x, &out, lora(self.names.module), &mut y)?;
        Ok(y)
    }

    /// [`SparseMoe::forward`] without adapters as one op on the GPU, routing there too.
    fn forward_on_device(&self, device: &DeviceExperts, x: &Tensor) -> OpResult<Tensor> {
        let logits = self.gate.forward(x)?;
        let shared = match &self.shared {
            Some(expert) => {
                let out = expert.mlp.forward_adapted(x, ModuleAdapters::NONE)?;
                let gate = expert.gate.as_ref().map(|g| g.forward(x)).transpose()?;
                Some((out, gate))
            }
            None => None,
        };
        ops::experts::mixture(
            &device.stack,
            &self.routing.choice,
            x,
            &logits,
            device.correction_bias.as_ref(),
            shared.as_ref().map(|(out, gate)| (out, gate.as_ref())),
        )
    }

    /// [`route`] with this mixture's routing and correction bias.
    fn route(&self, scores: &mut [f32]) -> Vec<(usize, f32)> {
        route(&self.routing, self.correction_bias.as_deref(), scores)
    }
}

/// Each token's `top_k` experts, best first, with their weights, from its router logits
/// (`[n, experts]`, turned into scores in place), as `routing` chooses them with the
/// `correction_bias`.
pub(crate) fn route(
    routing: &Routing,
    correction_bias: Option<&[f32]>,
    scores: &mut [f32],
) -> Vec<(usize, f32)> {
    experts::choose(&routing.choice, correction_bias, scores)
}

/// How a mixture picks experts (the engine's [`ExpertChoice`]), and where its router's inputs
/// and outputs differ from the plain top-k.
#[derive(Debug, Clone, Copy)]
pub struct Routing {
    pub(crate) choice: ExpertChoice,
    /// The router has a bias (gpt-oss's).
    router_bias: bool,
    /// The router's `e_score_correction_bias` joins the scores that choose.
    corrected: bool,
    /// The weights scale each token's input to its experts, not their outputs (Llama 4's).
    weigh_inputs: bool,
}

impl Routing {
    /// Softmax routing.
    pub fn new(experts: usize, top_k: usize, norm_topk_prob: bool) -> Result<Self, LoadError> {
        if top_k == 0 || top_k > experts {
            return Err(LoadError::Config(format!(
                "{top_k} experts per token of {experts}"
            )));
        }
        Ok(Routing {
            choice: ExpertChoice::softmax(experts, top_k, norm_topk_prob),
            router_bias: false,
            corrected: false,
            weigh_inputs: false,
        })
    }

    /// Llama 4's: the sigmoid of each chosen expert's logit weighs the token's input to it.
    pub fn weighing_inputs(self) -> Self {
        Routing {
            choice: ExpertChoice {
                scoring: Scoring::Sigmoid,
                norm_topk_prob: false,
                ..self.choice
            },
            weigh_inputs: true,
            ..self
        }
    }

    /// The experts each token goes to.
    pub fn top_k(&self) -> usize {
        self.choice.top_k
    }

    /// A router with a bias.
    pub fn with_router_bias(self) -> Self {
        Routing {
            router_bias: true,
            ..self
        }
    }

    /// DeepSeek-V3's: sigmoid scores with a correction bias, `keep` of `groups` expert groups,
    /// weights times `scale` (`routed_scaling_factor`).
    pub fn sigmoid_grouped(
        self,
        groups: usize,
        keep: usize,
        scale: f32,
    ) -> Result<Self, LoadError> {
        let ExpertChoice { experts, top_k, .. } = self.choice;
        let fits = groups >= 1 && keep >= 1 && keep <= groups && experts.is_multiple_of(groups);
        if !fits || keep * (experts / groups) < top_k {
            return Err(LoadError::Config(format!(
                "{keep} of {groups} expert groups for {top_k} of {experts} experts"
            )));
        }
        Ok(Routing {
            choice: ExpertChoice {
                scoring: Scoring::Sigmoid,
                groups: (groups > 1).then_some(ExpertGroups {
                    count: groups,
                    keep,
                }),
                scale,
                ..self.choice
            },
            corrected: true,
            ..self
        })
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
