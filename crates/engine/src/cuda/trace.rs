//! Tracing, for finding where a decode step's time goes: with `OXLM_TRACE` set the kernels are
//! compiled with `kernels/trace.cu`'s recording switched on (another source, so another cached
//! binary), and [`Gpu::take_trace`] reads back each launch's times and stages.

use super::{err, Gpu};
use crate::EngineError;

/// Whether the kernels record their launch times (`OXLM_TRACE` set: [`Gpu::take_trace`]).
pub(super) fn tracing() -> bool {
    std::env::var_os("OXLM_TRACE").is_some()
}

/// Launches whose times a trace keeps (`trace_times`).
const TRACE_LAUNCHES: usize = 65536;
/// The traced stages' slots and shards (`trace_stages`).
const TRACE_SLOTS: usize = 1024;
const TRACE_SHARDS: usize = 8;
/// The stages a traced launch records; the kernels mark stage `name` as `TRACE_<NAME>`.
pub const TRACE_STAGE_NAMES: [&str; TRACE_STAGES] = [
    // The earliest and the latest time a block of the launch found its inputs ready.
    "first_ready",
    "last_ready",
    // The int16 GEMVs' activations rounded; one sequence's attention's query loaded.
    "acts",
    // One sequence's attention's keys and values summed.
    "keys",
    // A warp's end.
    "done",
    // One sequence's attention's first tile of scores.
    "scores",
    // One sequence's attention's split counted.
    "counted",
    // The merge's maxima and sums loaded and reduced.
    "merge_maxima",
    // The merge's outputs summed.
    "merge_summed",
];
pub const TRACE_STAGES: usize = 9;
/// The stages at which a launch's first block found its inputs ready and a warp ended.
pub const TRACE_FIRST_READY: usize = 0;
pub const TRACE_DONE: usize = 4;

fn words(bytes: &[u8]) -> Vec<u64> {
    bytes
        .chunks_exact(8)
        .map(|b| u64::from_ne_bytes(b.try_into().unwrap()))
        .collect()
}

/// One launch of a traced run (see [`Gpu::take_trace`]): when its first block started and when
/// its inputs were ready, in nanoseconds of the GPU's clock; then when it reached each of the
/// [`TRACE_STAGE_NAMES`] (the first of its blocks for the first, the last for the others), where
/// the kernel marks them.
#[derive(Debug, Clone)]
pub struct TracedLaunch {
    pub kernel: String,
    pub started_ns: u64,
    pub ready_ns: u64,
    pub stages_ns: [Option<u64>; TRACE_STAGES],
}

/// The `#define`s of the constants above that the kernels' source takes: its sizes and a number
/// per stage.
pub(super) fn defines() -> String {
    let mut out = String::new();
    for (name, value) in [
        ("TRACE_LAUNCHES", TRACE_LAUNCHES),
        ("TRACE_SLOTS", TRACE_SLOTS),
        ("TRACE_SHARDS", TRACE_SHARDS),
        ("TRACE_STAGES", TRACE_STAGES),
    ] {
        out += &format!("#define {name} {value}\n");
    }
    for (i, name) in TRACE_STAGE_NAMES.iter().enumerate() {
        out += &format!("#define TRACE_{} {i}\n", name.to_uppercase());
    }
    out
}

impl Gpu {
    /// The launches since the last call, once they have run, where the process was started with
    /// `OXLM_TRACE` set (the kernels then record their times: `kernels/trace.cu`); `None`
    /// otherwise. For finding where a decode step's time goes.
    pub fn take_trace(&self) -> Result<Option<Vec<TracedLaunch>>, EngineError> {
        let Some(traced) = &self.inner.traced else {
            return Ok(None);
        };
        self.bind()?;
        let stream = &self.inner.stream;
        stream.synchronize().map_err(err)?;
        let launched = std::mem::take(&mut *traced.lock().unwrap());
        let count = self.take_global("trace_count", 4)?;
        let count = u32::from_ne_bytes(count.try_into().unwrap()) as usize;
        let times = self
            .inner
            .module
            .get_global("trace_times", stream)
            .map_err(err)?;
        let kept = count.min(times.len() / 24);
        let mut bytes = vec![0u8; kept * 24];
        stream
            .memcpy_dtoh(&times.slice(..kept * 24), &mut bytes)
            .map_err(err)?;
        if count != launched.len() || kept != count {
            return Err(EngineError::Cuda(format!(
                "the trace holds {kept} of {count} launches for {} kernels launched",
                launched.len()
            )));
        }
        let stages = words(&self.take_global(
            "trace_stages",
            TRACE_SLOTS * TRACE_STAGES * TRACE_SHARDS * 8,
        )?);
        let times = words(&bytes);
        // Each launch's slot of stages, unless two launches share one.
        let slot = |grid: u64| (grid % TRACE_SLOTS as u64) as usize;
        let mut used = vec![0u32; TRACE_SLOTS];
        for t in times.chunks(3) {
            used[slot(t[2])] += 1;
        }
        // The first stage holds complements, so that its latest is the earliest time.
        let stage = |grid: u64, stage: usize| {
            let shards =
                &stages[(slot(grid) * TRACE_STAGES + stage) * TRACE_SHARDS..][..TRACE_SHARDS];
            let latest = shards.iter().copied().max().filter(|&t| t > 0)?;
            let first = stage == TRACE_FIRST_READY;
            (used[slot(grid)] == 1).then_some(if first { !latest } else { latest })
        };
        Ok(Some(
            launched
                .into_iter()
                .zip(times.chunks(3))
                .map(|(kernel, t)| TracedLaunch {
                    kernel,
                    started_ns: t[0],
                    ready_ns: t[1],
                    stages_ns: std::array::from_fn(|i| stage(t[2], i)),
                })
                .collect(),
        ))
    }

    /// The first `bytes` of the kernels' global `name` (a trace's count, or its stages as
    /// `[slot][stage][shard]`), zeroed for the next launches.
    fn take_global(&self, name: &str, bytes: usize) -> Result<Vec<u8>, EngineError> {
        let stream = &self.inner.stream;
        let mut global = self.inner.module.get_global(name, stream).map_err(err)?;
        let mut global = global.slice_mut(..bytes);
        let mut taken = vec![0u8; bytes];
        stream.memcpy_dtoh(&global, &mut taken).map_err(err)?;
        stream
            .memcpy_htod(&vec![0u8; bytes], &mut global)
            .map_err(err)?;
        Ok(taken)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_stages_named_in_rust_are_the_kernels_numbers() {
        assert_eq!(TRACE_STAGE_NAMES[TRACE_FIRST_READY], "first_ready");
        assert_eq!(TRACE_STAGE_NAMES[TRACE_DONE], "done");
        let defines = defines();
        assert!(
            defines.contains("#define TRACE_FIRST_READY 0\n"),
            "{defines}"
        );
        assert!(defines.contains("#define TRACE_DONE 4\n"), "{defines}");
        assert!(
            defines.contains("#define TRACE_MERGE_SUMMED 8\n"),
            "{defines}"
        );
    }
}
