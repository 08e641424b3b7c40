//! Launchers of a mixture of experts' kernels (`kernels/experts.cu`): the router's top-k choice
//! and the chosen experts' gated MLPs over the rows routed to them, all on the device, so that
//! a decode step through mixtures needs no download and replays as one graph.
//!
//! Shapes are checked by the callers in [`crate::ops`]; these take buffers of the right lengths.

use std::sync::Arc;

use cudarc::driver::CudaSlice;

use super::launch::{addr, blocks, elements, int, sliced_blocks, Result};
use super::matmul::{row_threads, Glu, QuantShape};
use super::{Arg, Buffer, Gpu, QuantizedWeights};
use crate::params::{ExpertChoice, QuantMode, Scoring};
use crate::EngineError;

/// The most experts a router may have and the most slots (tokens × top_k) a call may route:
/// `ROUTE_MAX_EXPERTS` and `ROUTE_MAX_SLOTS` in the kernels, which hold them in shared memory.
pub const MAX_EXPERTS: usize = 1024;
pub const MAX_SLOTS: usize = 1024;

/// One projection of every expert of a mixture, all of one shape and affine format, as the
/// table of device addresses the kernels index by expert (packed weights, scales, biases).
pub struct ExpertTable {
    table: CudaSlice<u64>,
    shape: QuantShape,
    scale_type: &'static str,
    #[allow(dead_code)] // held so that the table's addresses stay valid
    weights: Vec<Arc<QuantizedWeights>>,
}

impl ExpertTable {
    /// `None` where the kernels do not take the experts: a float mode, or experts of
    /// different scale types.
    pub fn new(weights: Vec<Arc<QuantizedWeights>>, shape: QuantShape) -> Result<Option<Self>> {
        let Some(first) = weights.first() else {
            return Ok(None);
        };
        let scale_type = first.scale_type;
        if shape.mode != QuantMode::Affine || weights.iter().any(|w| w.scale_type != scale_type) {
            return Ok(None);
        }
        let g = first.gpu.clone();
        let addresses: Vec<u64> = weights
            .iter()
            .flat_map(|w| {
                [
                    addr(&g, &w.packed),
                    addr(&g, &w.scales),
                    addr(&g, &w.biases),
                ]
            })
            .collect();
        Ok(Some(ExpertTable {
            table: g.upload_raw(&addresses)?,
            shape,
            scale_type,
            weights,
        }))
    }

    /// The length of the matrices' rows.
    pub fn cols(&self) -> usize {
        self.shape.cols
    }

    /// Whether `other`'s matrices have this table's shape and format, as the gate and up
    /// projections must (the kernels read both as the gate's).
    pub fn same_format(&self, other: &ExpertTable) -> bool {
        self.shape == other.shape && self.scale_type == other.scale_type
    }

    fn kernel(&self, base: &str) -> String {
        format!("{base}_{}_{}", self.shape.bits, self.scale_type)
    }
}

/// A mixture's routed experts: gated MLPs whose gate, up and down projections are each one
/// [`ExpertTable`].
pub struct ExpertMlps<'a> {
    pub gate: &'a ExpertTable,
    pub up: &'a ExpertTable,
    pub down: &'a ExpertTable,
    pub act: Glu,
}

/// A shared expert's output beside the routed ones (`[tokens, dim]`), and the logits of its
/// sigmoid gate (`[tokens]`) where it has one.
pub struct SharedOutput<'a> {
    pub out: &'a Buffer,
    pub gate: Option<&'a Buffer>,
}

/// `y[t] = Σ_j weight[t, j] · mlp_{e[t, j]}(x[t])` (plus the shared expert's output) for the
/// `tokens` rows of `x`, each routed by its router `logits` (`[tokens, experts]`) as `choice`
/// says, with the `correction` bias (`[experts]`) joining the choosing scores where given.
pub fn mixture(
    mlps: &ExpertMlps,
    choice: &ExpertChoice,
    x: &Buffer,
    tokens: usize,
    logits: &Buffer,
    correction: Option<&Buffer>,
    shared: Option<SharedOutput>,
) -> Result<Buffer> {
    let g = x.gpu().clone();
    let (dim, hidden, k) = (mlps.gate.shape.cols, mlps.gate.shape.rows, choice.top_k);
    let slots = tokens * k;
    if choice.experts > MAX_EXPERTS || slots > MAX_SLOTS {
        return Err(EngineError::Unsupported(format!(
            "a mixture's device routing of {slots} slots over {} experts",
            choice.experts
        )));
    }
    let ids = g.scratch(4 * slots)?;
    let weights = g.output(slots)?;
    let (groups, keep) = choice.groups.map_or((1, 1), |gr| (gr.count, gr.keep));
    let threads = choice.experts.next_multiple_of(32).clamp(32, 256) as u32;
    launch!(&g, "route_top_k", blocks(tokens, threads);
        logits.ptr(), correction.map_or(0, Buffer::ptr), int(choice.experts)?, int(k)?,
        (choice.scoring == Scoring::Sigmoid) as i32, choice.renormalizes() as i32,
        int(groups)?, int(keep)?, choice.scale, ids.ptr(), weights.ptr());
    // At most one chosen expert a slot, and never more than the router has.
    let chosen = slots.min(choice.experts);
    let leaders = g.scratch(4 * (chosen + 1))?;
    launch!(&g, "expert_leaders", blocks(1, slots.next_multiple_of(32) as u32);
        ids.ptr(), int(slots)?, leaders.ptr());

    let h = g.output(slots * hidden)?;
    let s = mlps.gate.shape;
    launch!(&g, &mlps.gate.kernel("experts_glu"),
        sliced_blocks(hidden.div_ceil(2), chosen, row_threads(dim));
        addr(&g, &mlps.gate.table), addr(&g, &mlps.up.table), x.ptr(), ids.ptr(), leaders.ptr(),
        h.ptr(), int(hidden)?, int(dim)?, int(s.group_size)?, int(k)?, int(slots)?,
        mlps.act as i32);
    let out = g.output(slots * dim)?;
    let d = mlps.down.shape;
    launch!(&g, &mlps.down.kernel("experts_down"),
        sliced_blocks(dim.div_ceil(4), chosen, row_threads(hidden));
        addr(&g, &mlps.down.table), h.ptr(), ids.ptr(), leaders.ptr(), out.ptr(), int(dim)?,
        int(hidden)?, int(d.group_size)?, int(slots)?);

    let y = g.output(tokens * dim)?;
    let (shared_out, shared_gate) = match shared {
        Some(s) => (s.out.ptr(), s.gate.map_or(0, Buffer::ptr)),
        None => (0, 0),
    };
    launch!(&g, "experts_sum", elements(&g, tokens * dim);
        out.ptr(), weights.ptr(), shared_out, shared_gate, y.ptr(), int(tokens)?, int(dim)?,
        int(k)?);
    Ok(y)
}
