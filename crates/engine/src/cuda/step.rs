//! Replaying decode steps as CUDA graphs, so that a step costs one launch instead of a few
//! hundred (small models decode at a few hundred microseconds a token, and each launch costs
//! several microseconds of host time).
//!
//! The model code runs as usual every step: its host-side bookkeeping (cache lengths, shapes)
//! must happen anyway. What changes is what the device calls do while a [`StepReplay`] step
//! runs:
//! - temporaries come from an arena reset at every step, so that a step of the same shape sees
//!   the same addresses; uploads go through pinned staging memory at fixed offsets;
//! - the first step is captured as it is issued, into graphs of [`FIRST_SEGMENT_OPS`] calls,
//!   then twice as many, up to [`SEGMENT_OPS`], every one launched as soon as it is complete;
//!   the first download (the step's logits, or a greedy pick) ends the captured part;
//! - later steps check each call against the recording and skip it; a segment is launched as
//!   soon as all its calls have matched, so that the GPU runs the start of the step while the
//!   host is still walking the rest of the model. A call that differs (another shape, a scalar
//!   that moved, a cache that grew) or one that cannot be replayed (a lasting allocation,
//!   cuBLAS, a pageable copy) makes the step issue the rest itself, the skipped calls of the
//!   unlaunched segment first (launched segments matched, so they are this step's own), and
//!   the recording is dropped; it is captured again next step, until captures fail too often.

use std::ffi::c_void;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{result, sys, CudaEvent, CudaSlice, CudaStream, LaunchConfig};

use super::{err, Gpu};
use crate::EngineError;

/// Device memory for one step's temporaries at first. A step that outgrows it issues the rest
/// of its calls itself, and the next doubles it (while the doubling takes at most half the
/// free memory), so that steps of many sequences, whose tensor-core products' partial sums
/// alone take some 20 MiB a layer at 16 sequences of an 8B model, replay whole. Small batches
/// fit 256 MiB, and the doubling gives larger ones the few percent that a step outgrowing its
/// arena costs them on an H200, without reserving gigabytes up front.
const ARENA_BYTES: usize = 256 << 20;
/// Pinned host memory for one step's uploads: token ids, positions, cache tables, and the
/// grammars' masks of constrained sequences (a bit per token: 64 sequences of a
/// 262,144-token vocabulary take 2 MiB).
const STAGING_BYTES: usize = 8 << 20;
/// Uploads up to this size are remembered for [`StepState::staged_before`] (tables that every
/// layer uploads alike); larger ones (masks) are not worth a copy.
const DEDUPLICATED_BYTES: usize = 64 << 10;
/// Calls per graph segment: enough that a launch (a few microseconds of host time) is small
/// beside the calls it stands for, few enough that the GPU starts early in the step.
const SEGMENT_OPS: usize = 32;
/// Calls in a step's first segment; each next one holds twice as many, up to [`SEGMENT_OPS`].
/// The GPU waits for the host to walk the first segment's calls (about a microsecond each)
/// before a step starts: on an H200, 8 then 16 decode a few percent faster than 32 from the
/// start, and 4 no faster than 8.
const FIRST_SEGMENT_OPS: usize = 8;

/// How many calls segment `index` of a step holds.
fn segment_ops(index: usize) -> usize {
    (FIRST_SEGMENT_OPS << index.min(8)).min(SEGMENT_OPS)
}

/// Consecutive captures that did not replay after which a [`StepReplay`] stops trying.
const MAX_FAILED_CAPTURES: u32 = 3;

/// A kernel argument as recorded: scalars by value, device memory by address.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Arg {
    Ptr(u64),
    I32(i32),
    I64(i64),
    F32(f32),
}

impl From<u64> for Arg {
    fn from(v: u64) -> Arg {
        Arg::Ptr(v)
    }
}

impl From<i32> for Arg {
    fn from(v: i32) -> Arg {
        Arg::I32(v)
    }
}

impl From<i64> for Arg {
    fn from(v: i64) -> Arg {
        Arg::I64(v)
    }
}

impl From<f32> for Arg {
    fn from(v: f32) -> Arg {
        Arg::F32(v)
    }
}

/// One device call of a step.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Op {
    Kernel {
        function: sys::CUfunction,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        shared: u32,
        args: Vec<Arg>,
        /// Launched as a programmatic dependent launch (see `await_inputs` in kernels/prelude.cu).
        early_start: bool,
    },
    CopyDtoD {
        dst: u64,
        src: u64,
        bytes: usize,
    },
    /// From the staging memory at `offset`.
    Upload {
        dst: u64,
        offset: usize,
        bytes: usize,
    },
}

impl Op {
    pub(crate) fn kernel(
        function: sys::CUfunction,
        cfg: LaunchConfig,
        args: &[Arg],
        early_start: bool,
    ) -> Op {
        Op::Kernel {
            function,
            grid: cfg.grid_dim,
            block: cfg.block_dim,
            shared: cfg.shared_mem_bytes,
            args: args.to_vec(),
            early_start,
        }
    }

    /// Issues the call on `stream`.
    fn run(&self, stream: &CudaStream, staging: *mut u8) -> Result<(), EngineError> {
        let s = stream.cu_stream();
        // SAFETY: kernels get exactly the arguments they were compiled for (the launchers build
        // them), copies stay inside buffers their callers sized.
        unsafe {
            match self {
                Op::Kernel {
                    function,
                    grid,
                    block,
                    shared,
                    args,
                    early_start,
                } => {
                    let mut values: Vec<[u8; 8]> = args
                        .iter()
                        .map(|a| match *a {
                            Arg::Ptr(v) => v.to_ne_bytes(),
                            Arg::I64(v) => v.to_ne_bytes(),
                            Arg::I32(v) => widen(v.to_ne_bytes()),
                            Arg::F32(v) => widen(v.to_ne_bytes()),
                        })
                        .collect();
                    let mut pointers: Vec<*mut c_void> =
                        values.iter_mut().map(|v| v.as_mut_ptr().cast()).collect();
                    if !*early_start {
                        return result::launch_kernel(
                            *function,
                            *grid,
                            *block,
                            *shared,
                            s,
                            &mut pointers,
                        )
                        .map_err(err);
                    }
                    let mut attribute = sys::CUlaunchAttribute {
                        id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
                        pad: [0; 4],
                        value: std::mem::zeroed(),
                    };
                    attribute.value.programmaticStreamSerializationAllowed = 1;
                    let config = sys::CUlaunchConfig {
                        gridDimX: grid.0,
                        gridDimY: grid.1,
                        gridDimZ: grid.2,
                        blockDimX: block.0,
                        blockDimY: block.1,
                        blockDimZ: block.2,
                        sharedMemBytes: *shared,
                        hStream: s,
                        attrs: &mut attribute,
                        numAttrs: 1,
                    };
                    sys::cuLaunchKernelEx(
                        &config,
                        *function,
                        pointers.as_mut_ptr(),
                        std::ptr::null_mut(),
                    )
                    .result()
                    .map_err(err)
                }
                Op::CopyDtoD { dst, src, bytes } => {
                    result::memcpy_dtod_async(*dst, *src, *bytes, s).map_err(err)
                }
                Op::Upload { dst, offset, bytes } => {
                    let host = std::slice::from_raw_parts(staging.add(*offset), *bytes);
                    result::memcpy_htod_async(*dst, host, s).map_err(err)
                }
            }
        }
    }
}

fn widen(b: [u8; 4]) -> [u8; 8] {
    [b[0], b[1], b[2], b[3], 0, 0, 0, 0]
}

/// A captured graph and the calls it holds.
struct Segment {
    graph: cudarc::driver::CudaGraph,
    ops: Vec<Op>,
}

/// A captured step: its segments, in order.
struct Recorded {
    segments: Vec<Segment>,
}

enum Mode {
    /// No step is running: calls are issued as they come, memory is allocated per buffer.
    Off,
    /// Inside a step: calls are issued as they come, from the arena.
    Direct,
    /// Capturing into graphs: `open` holds the calls of the segment being captured (the stream
    /// records them, nothing runs until its graph is launched), `done` the launched segments.
    Capture { open: Vec<Op>, done: Vec<Segment> },
    /// Checking calls against a recording: the segments before `segment` matched and were
    /// launched, and `cursor` calls of `segment` matched so far.
    Replay {
        recorded: Recorded,
        segment: usize,
        cursor: usize,
    },
}

/// What the GPU's calls do, behind the GPU's lock.
pub(crate) struct StepState {
    mode: Mode,
    /// The arena's allocation and its device address.
    arena: Option<(CudaSlice<u8>, u64)>,
    arena_bytes: usize,
    arena_used: usize,
    /// Whether a step asked the arena for more than it holds.
    arena_short: bool,
    staging: *mut u8,
    staging_used: usize,
    /// What this step staged, and where on the device ([`StepState::staged_before`]).
    staged: Vec<(Vec<u8>, u64)>,
    /// A recording the step finished (captured, or replayed): handed back to its [`StepReplay`].
    finished: Option<Recorded>,
    /// Recordings this step gave up, some of whose graphs may still be running: kept until
    /// the step's work is done.
    retired: Vec<Mode>,
    /// When the step's replayable part ended (its first download began).
    walked: Option<Instant>,
    /// Recorded on the stream as a replayed step launches its first graph and as it ends its
    /// replayable part: the GPU's span of the step ([`StepReplay::gpu_span`]).
    span_events: Option<(CudaEvent, CudaEvent)>,
    /// Whether this step recorded the second (then it recorded the first too: a replay ends its
    /// replayable part with every segment launched, the first among them).
    spanned: bool,
}

// SAFETY: the staging pointer is pinned host memory owned by this state for the GPU's life,
// only touched under the GPU's lock.
unsafe impl Send for StepState {}

fn begin_capture(stream: &CudaStream) -> Result<(), EngineError> {
    stream
        .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
        .map_err(err)
}

/// The graph of what `stream` captured since its capture began; `None` when the capture
/// failed (nothing it recorded has run).
fn end_capture(stream: &Arc<CudaStream>) -> Option<cudarc::driver::CudaGraph> {
    stream
        .end_capture(sys::CUgraphInstantiate_flags(0))
        .ok()
        .flatten()
}

impl StepState {
    pub(crate) fn new() -> StepState {
        StepState {
            mode: Mode::Off,
            arena: None,
            arena_bytes: ARENA_BYTES,
            arena_used: 0,
            arena_short: false,
            staging: std::ptr::null_mut(),
            staging_used: 0,
            staged: Vec::new(),
            finished: None,
            retired: Vec::new(),
            walked: None,
            span_events: None,
            spanned: false,
        }
    }

    pub(crate) fn in_step(&self) -> bool {
        !matches!(self.mode, Mode::Off)
    }

    /// `bytes` of the step's arena, 256-aligned; `None` outside a step or when it is full.
    pub(crate) fn arena_alloc(&mut self, bytes: usize) -> Option<u64> {
        let base = self.arena.as_ref().filter(|_| self.in_step())?.1;
        let start = self.arena_used.div_ceil(256) * 256;
        if start + bytes > self.arena_bytes {
            self.arena_short = true;
            return None;
        }
        self.arena_used = start + bytes;
        Some(base + start as u64)
    }

    /// Allocates the arena and the staging memory on first use, and a doubled arena after a
    /// step outgrew it (see [`ARENA_BYTES`]); true when the arena moved, so that recordings
    /// naming the old one no longer apply.
    pub(crate) fn prepare(&mut self, stream: &Arc<CudaStream>) -> Result<bool, EngineError> {
        let mut moved = false;
        if std::mem::take(&mut self.arena_short) && self.arena.is_some() {
            let (free, _) = result::mem_get_info().map_err(err)?;
            if self.arena_bytes <= free / 2 {
                // Graphs that name the old arena have run before it goes.
                stream.synchronize().map_err(err)?;
                self.arena = None;
                self.arena_bytes *= 2;
                moved = true;
            }
        }
        if self.arena.is_none() {
            // SAFETY: step temporaries are written by their kernels before they are read.
            let slab = unsafe { stream.alloc::<u8>(self.arena_bytes) }.map_err(err)?;
            let base = cudarc::driver::DevicePtr::device_ptr(&slab, stream).0;
            self.arena = Some((slab, base));
        }
        if self.staging.is_null() {
            let mut host = std::ptr::null_mut();
            // SAFETY: pinned host memory, kept for the GPU's life.
            unsafe { sys::cuMemAllocHost_v2(&mut host, STAGING_BYTES) }
                .result()
                .map_err(err)?;
            self.staging = host.cast();
        }
        if self.span_events.is_none() {
            let timed = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
            let ctx = stream.context();
            self.span_events = Some((
                ctx.new_event(timed).map_err(err)?,
                ctx.new_event(timed).map_err(err)?,
            ));
        }
        Ok(moved)
    }

    /// Copies `data` into the staging memory and returns the upload of it to `dst`; `None`
    /// outside a step or when staging is full.
    pub(crate) fn stage(&mut self, dst: u64, data: &[u8]) -> Option<Op> {
        if !self.in_step() || self.staging.is_null() {
            return None;
        }
        let offset = self.staging_used.div_ceil(64) * 64;
        if offset + data.len() > STAGING_BYTES {
            return None;
        }
        // SAFETY: inside the pinned allocation; the previous step's copies have completed (each
        // step ends with a download, which waits for the stream).
        unsafe {
            std::ptr::copy_nonoverlapping(data.as_ptr(), self.staging.add(offset), data.len())
        };
        self.staging_used = offset + data.len();
        if data.len() <= DEDUPLICATED_BYTES {
            self.staged.push((data.to_vec(), dst));
        }
        Some(Op::Upload {
            dst,
            offset,
            bytes: data.len(),
        })
    }

    /// Where this step already staged `data`, if it did: kernels only read staged memory, and
    /// it lasts the step.
    pub(crate) fn staged_before(&self, data: &[u8]) -> Option<u64> {
        let found = self.staged.iter().find(|(bytes, _)| bytes == data);
        found.map(|&(_, dst)| dst).filter(|_| self.in_step())
    }

    /// Issues, records or checks `op` as the step's mode says.
    pub(crate) fn submit(&mut self, stream: &Arc<CudaStream>, op: Op) -> Result<(), EngineError> {
        match &mut self.mode {
            Mode::Off | Mode::Direct => op.run(stream, self.staging),
            Mode::Capture { open, done } => {
                if op.run(stream, self.staging).is_err() {
                    // The capture broke: issue what it held, and the rest of the step, directly.
                    self.go_direct(stream)?;
                    return op.run(stream, self.staging);
                }
                open.push(op);
                if open.len() == segment_ops(done.len()) {
                    match end_capture(stream) {
                        Some(graph) => {
                            graph.launch().map_err(err)?;
                            let ops = std::mem::take(open);
                            done.push(Segment { graph, ops });
                            begin_capture(stream)?;
                        }
                        None => self.go_direct(stream)?,
                    }
                }
                Ok(())
            }
            Mode::Replay {
                recorded,
                segment,
                cursor,
            } => {
                let matched = recorded
                    .segments
                    .get(*segment)
                    .is_some_and(|s| s.ops[*cursor] == op);
                if !matched {
                    self.go_direct(stream)?;
                    return op.run(stream, self.staging);
                }
                *cursor += 1;
                let current = &recorded.segments[*segment];
                if *cursor == current.ops.len() {
                    if *segment == 0 {
                        if let Some((first, _)) = &self.span_events {
                            first.record(stream).map_err(err)?;
                        }
                    }
                    current.graph.launch().map_err(err)?;
                    *segment += 1;
                    *cursor = 0;
                }
                Ok(())
            }
        }
    }

    /// Ends the replayable part of the step before a call that cannot be in a graph (a
    /// download, a lasting allocation, cuBLAS): launches the segment being captured, or keeps
    /// a replay whose every segment matched; the rest of the step is issued directly.
    pub(crate) fn boundary(&mut self, stream: &Arc<CudaStream>) -> Result<(), EngineError> {
        if self.in_step() && self.walked.is_none() {
            self.walked = Some(Instant::now());
        }
        match &mut self.mode {
            Mode::Off | Mode::Direct => Ok(()),
            Mode::Capture { open, done } => {
                let graph = end_capture(stream);
                if !open.is_empty() {
                    let Some(graph) = graph else {
                        return self.go_direct(stream);
                    };
                    graph.launch().map_err(err)?;
                    let ops = std::mem::take(open);
                    done.push(Segment { graph, ops });
                }
                let segments = std::mem::take(done);
                self.mode = Mode::Direct;
                if !segments.is_empty() {
                    self.finished = Some(Recorded { segments });
                }
                Ok(())
            }
            Mode::Replay {
                recorded, segment, ..
            } => {
                if *segment < recorded.segments.len() {
                    return self.go_direct(stream);
                }
                if let Some((_, last)) = &self.span_events {
                    last.record(stream).map_err(err)?;
                    self.spanned = true;
                }
                if let Mode::Replay { recorded, .. } =
                    std::mem::replace(&mut self.mode, Mode::Direct)
                {
                    self.finished = Some(recorded);
                }
                Ok(())
            }
        }
    }

    /// Leaves a capture or a replay for direct issue: what the capture recorded has not run,
    /// and the matched calls of the replay's unlaunched segment are this step's own, so both
    /// are issued now. The recording is dropped.
    fn go_direct(&mut self, stream: &Arc<CudaStream>) -> Result<(), EngineError> {
        let old = std::mem::replace(&mut self.mode, Mode::Direct);
        match &old {
            Mode::Capture { open, .. } => {
                let _ = end_capture(stream);
                for op in open {
                    op.run(stream, self.staging)?;
                }
            }
            Mode::Replay {
                recorded,
                segment,
                cursor,
            } => {
                if let Some(current) = recorded.segments.get(*segment) {
                    for op in &current.ops[..*cursor] {
                        op.run(stream, self.staging)?;
                    }
                }
            }
            Mode::Off | Mode::Direct => {}
        }
        self.retired.push(old);
        Ok(())
    }
}

/// Replays one sequence's decode steps on `gpu` (see the module notes). Every step must be
/// one forward pass of the same shape ending in a download of its logits (or of their greedy
/// pick).
pub struct StepReplay {
    gpu: Gpu,
    recorded: Option<Recorded>,
    failed_captures: u32,
    /// Steps run from a recording, and recordings captured: for tests and benchmarks.
    pub replayed: u64,
    pub captured: u64,
    /// The host's time up to each step's download (walking the model, launching), over all
    /// steps.
    pub walking: Duration,
    /// The GPU's time from each replayed step's first graph launch to the end of its last
    /// replayed call, over all replayed steps: beside the steps' wall time, what the GPU
    /// spends idle between steps (the download, the host's turn, the first graph's launch).
    pub gpu_span: Duration,
}

impl StepReplay {
    pub fn new(gpu: &Gpu) -> StepReplay {
        StepReplay {
            gpu: gpu.clone(),
            recorded: None,
            failed_captures: 0,
            replayed: 0,
            captured: 0,
            walking: Duration::ZERO,
            gpu_span: Duration::ZERO,
        }
    }

    /// The size of the steps' arena (which grows when a step outgrows it).
    pub fn arena_bytes(&self) -> usize {
        self.gpu.step_state().arena_bytes
    }

    /// Runs `step` (one forward pass) as a replay of the last captured step, a capture of this
    /// one, or plainly once captures have kept failing.
    pub fn run<T, E: From<EngineError>>(
        &mut self,
        step: impl FnOnce() -> Result<T, E>,
    ) -> Result<T, E> {
        let start = Instant::now();
        let gpu = self.gpu.clone();
        let stream = gpu.stream().clone();
        gpu.bind()?;
        let (was_replay, was_capture) = {
            let mut state = gpu.step_state();
            if state.prepare(&stream)? {
                self.recorded = None;
            }
            state.arena_used = 0;
            state.staging_used = 0;
            state.staged.clear();
            state.finished = None;
            state.walked = None;
            state.spanned = false;
            state.mode = match self.recorded.take() {
                Some(recorded) => Mode::Replay {
                    recorded,
                    segment: 0,
                    cursor: 0,
                },
                None if self.failed_captures < MAX_FAILED_CAPTURES => {
                    begin_capture(&stream)?;
                    Mode::Capture {
                        open: Vec::new(),
                        done: Vec::new(),
                    }
                }
                None => Mode::Direct,
            };
            (
                matches!(state.mode, Mode::Replay { .. }),
                matches!(state.mode, Mode::Capture { .. }),
            )
        };
        let out = step();
        let mut state = gpu.step_state();
        // A step that never reached a download still owes its captured or skipped calls.
        let ended = state.boundary(&stream);
        state.mode = Mode::Off;
        let finished = state.finished.take();
        let walked = state.walked.take();
        let retired = !state.retired.is_empty();
        let span = match &state.span_events {
            Some((first, last)) if state.spanned => first.elapsed_ms(last).ok(),
            _ => None,
        };
        drop(state);
        if let Some(ms) = span {
            self.gpu_span += Duration::from_secs_f64(f64::from(ms) / 1e3);
        }
        if retired {
            // Graphs given up this step are released once they have run.
            stream.synchronize().map_err(err)?;
            gpu.step_state().retired.clear();
        }
        ended?;
        self.walking += walked.unwrap_or_else(Instant::now) - start;
        match (finished, was_replay, was_capture) {
            (Some(recorded), true, _) => {
                self.replayed += 1;
                self.failed_captures = 0;
                self.recorded = Some(recorded);
            }
            (Some(recorded), false, true) => {
                self.captured += 1;
                self.recorded = Some(recorded);
            }
            (None, _, true) => self.failed_captures += 1,
            (None, true, false) => self.failed_captures += 1,
            _ => {}
        }
        out
    }
}
