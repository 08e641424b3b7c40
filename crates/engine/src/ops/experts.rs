//! A mixture of experts' routed MLPs as one op on the GPU: the router's top-k choice, each
//! chosen expert's gated MLP over the rows routed to it, and each token's weighted sum, without
//! a download, so that a decode step through mixtures replays as one graph. The host routes
//! with [`crate::cpu::experts::choose`] and runs each expert as a plain MLP.

use crate::cuda::experts::{self, ExpertTable};
use crate::cuda::matmul::Glu;
use crate::cuda::Buffer;
use crate::params::ExpertChoice;
use crate::tensor::Storage;
use crate::{QuantizedMatrix, Tensor};

use super::{check, mismatch, Activation, Result};

/// A mixture's experts as the GPU's kernels take them: the gate, up and down projections of
/// every expert, each kind one table.
pub struct ExpertStack {
    gate: ExpertTable,
    up: ExpertTable,
    down: ExpertTable,
    act: Glu,
}

impl ExpertStack {
    /// The experts' `[gate, up, down]` projections, where the kernels take them: all placed on
    /// one GPU, affine-quantized, of one shape and format per kind, with a SiLU or GELU gate.
    /// `None` otherwise (and on the host): the caller routes on the host.
    pub fn new(experts: &[[&QuantizedMatrix; 3]], act: Activation) -> Result<Option<Self>> {
        let act = match act {
            Activation::Silu => Glu::Silu,
            Activation::GeluApprox => Glu::GeluApprox,
            Activation::SwigluOai => return Ok(None),
        };
        let table = |kind: usize| -> Result<Option<ExpertTable>> {
            let first = experts[0][kind];
            let Some(home) = first.placed() else {
                return Ok(None);
            };
            let placed: Option<Vec<_>> = experts
                .iter()
                .map(|e| e[kind])
                .map(|w| match w.placed() {
                    Some(p) if w.shape() == first.shape() && p.gpu.same(&home.gpu) => {
                        Some(p.clone())
                    }
                    _ => None,
                })
                .collect();
            match placed {
                Some(weights) => ExpertTable::new(weights, first.shape()),
                None => Ok(None),
            }
        };
        if experts.is_empty() {
            return Ok(None);
        }
        let (Some(gate), Some(up), Some(down)) = (table(0)?, table(1)?, table(2)?) else {
            return Ok(None);
        };
        let (g, d) = (experts[0][0], experts[0][2]);
        let fits = gate.same_format(&up) && (d.rows, d.cols) == (g.cols, g.rows);
        Ok(fits.then_some(ExpertStack {
            gate,
            up,
            down,
            act,
        }))
    }
}

/// Whether [`mixture`] takes `rows` tokens routed as `choice` says: decode steps (up to
/// [`MAX_ROWS`]) within the kernels' bounds. Longer prompts are better served by running each
/// expert once over all its tokens through the tensor cores, after routing on the host.
pub fn mixture_applies(rows: usize, choice: &ExpertChoice) -> bool {
    rows <= MAX_ROWS
        && rows * choice.top_k <= experts::MAX_SLOTS
        && choice.experts <= experts::MAX_EXPERTS
}

/// The most tokens [`mixture`] takes: a batched decode step's. Its kernels read an expert's
/// weights once per 8 of the tokens routed to it.
pub const MAX_ROWS: usize = 64;

fn buffer(t: &Tensor) -> Result<&Buffer> {
    match &t.storage {
        Storage::Cuda(b) => Ok(b),
        Storage::Host(_) => Err(mismatch("mixture")),
    }
}

/// `y[t] = Σ_j weight[t, j] · mlp_{e[t, j]}(x[t])`, each row of `x` (`[n, dim]`) routed by its
/// router `logits` (`[n, experts]`) as `choice` says (the `correction` bias, `[experts]`,
/// joining the choosing scores where given), plus a shared expert's output `[n, dim]` where
/// given, times the sigmoid of its gate's logit (`[n, 1]`) where it has one.
pub fn mixture(
    stack: &ExpertStack,
    choice: &ExpertChoice,
    x: &Tensor,
    logits: &Tensor,
    correction: Option<&Tensor>,
    shared: Option<(&Tensor, Option<&Tensor>)>,
) -> Result<Tensor> {
    let n = x.rows();
    check(x.cols() == stack.gate.cols(), || {
        format!(
            "mixture: rows of {} for experts of {}",
            x.cols(),
            stack.gate.cols()
        )
    })?;
    check(logits.len() == n * choice.experts, || {
        format!(
            "mixture: {:?} logits for {n} rows of {} experts",
            logits.shape(),
            choice.experts
        )
    })?;
    check(correction.is_none_or(|c| c.len() == choice.experts), || {
        "mixture: a correction bias of another length than the experts".into()
    })?;
    check(
        shared.is_none_or(|(out, gate)| out.len() == x.len() && gate.is_none_or(|g| g.len() == n)),
        || "mixture: a shared expert's output of another shape than the input".into(),
    )?;
    let x_buffer = buffer(x)?;
    // The buffer of an operand on x's GPU.
    let beside_x = |t| -> Result<&Buffer> {
        let b = buffer(t)?;
        match b.gpu().same(x_buffer.gpu()) {
            true => Ok(b),
            false => Err(mismatch("mixture")),
        }
    };
    let logits = beside_x(logits)?;
    let correction = correction.map(beside_x).transpose()?;
    let shared = match shared {
        Some((out, gate)) => Some(experts::SharedOutput {
            out: beside_x(out)?,
            gate: gate.map(beside_x).transpose()?,
        }),
        None => None,
    };
    let mlps = experts::ExpertMlps {
        gate: &stack.gate,
        up: &stack.up,
        down: &stack.down,
        act: stack.act,
    };
    let y = experts::mixture(&mlps, choice, x_buffer, n, logits, correction, shared)?;
    Ok(Tensor::on_gpu(x.shape().to_vec(), y))
}
