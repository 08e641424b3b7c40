//! The CUDA backend. cudarc opens libcuda, libnvrtc and libcublas when a GPU is first asked
//! for, so a build needs no CUDA toolkit and runs on machines without one (where
//! [`Gpu::open`] fails with a clear error). The kernels (`kernels/*.cu`) are compiled by NVRTC for
//! the device's architecture on first use and the binary is kept under the cache directory.
//!
//! One stream per GPU runs every op in order; buffers come from the driver's stream-ordered
//! pool, which is told to keep freed memory, so a decode step allocates nothing from the OS.

#[macro_use]
mod launch;

pub(crate) mod attention;
mod compile;
pub(crate) mod elementwise;
pub(crate) mod experts;
pub(crate) mod low_rank;
pub(crate) mod matmul;
pub(crate) mod norm;
pub(crate) mod recurrent;
mod step;
mod trace;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use cudarc::cublas::CudaBlas;
use cudarc::driver::{
    result, sys, CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, DevicePtr,
    DeviceRepr, LaunchConfig, ValidAsZeroBits,
};

pub(crate) use step::Arg;
pub use step::StepReplay;
use step::{Op, StepState};
use trace::tracing;
pub use trace::{TracedLaunch, TRACE_DONE, TRACE_FIRST_READY, TRACE_STAGES, TRACE_STAGE_NAMES};

use crate::cpu::attention::{KvRows, QuantRows};
use crate::kv::{KvPrecision, KvQuant, QuantRing};
use crate::EngineError;

/// The kernels' CUDA C source: one file per op family under `kernels/`, joined in this order
/// (each may use what the files before it define) into the one source NVRTC compiles.
const KERNELS: &str = concat!(
    include_str!("kernels/prelude.cu"),
    include_str!("kernels/trace.cu"),
    include_str!("kernels/kv_codes.cu"),
    include_str!("kernels/affine_rows.cu"),
    include_str!("kernels/matmul.cu"),
    include_str!("kernels/experts.cu"),
    include_str!("kernels/low_rank.cu"),
    include_str!("kernels/elementwise.cu"),
    include_str!("kernels/norm.cu"),
    include_str!("kernels/attention.cu"),
    include_str!("kernels/recurrent.cu"),
);

pub(crate) fn err(e: impl std::fmt::Debug) -> EngineError {
    EngineError::Cuda(format!("{e:?}"))
}

/// Whether the CUDA driver, NVRTC and cuBLAS libraries can be opened on this machine (false on
/// machines without an NVIDIA driver, where opening a GPU is refused instead of crashing).
pub fn libraries_present() -> bool {
    // SAFETY: these only try to open the shared libraries.
    unsafe {
        cudarc::driver::sys::is_culib_present()
            && cudarc::nvrtc::sys::is_culib_present()
            && cudarc::cublas::sys::is_culib_present()
    }
}

/// Whether NVRTC alone can be opened: enough to compile the kernels, even with no GPU.
pub fn compiler_present() -> bool {
    // SAFETY: only tries to open the shared library.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// Compiles the kernels for compute capability `major.minor` without a GPU (the binary is
/// cached as at start-up), `traced` as with `OXLM_TRACE` set; for checking that every kernel
/// builds.
pub fn compile_kernels(major: i32, minor: i32, traced: bool) -> Result<Vec<u8>, EngineError> {
    if !compiler_present() {
        return Err(EngineError::Device(
            "NVRTC (libnvrtc) could not be opened".into(),
        ));
    }
    compile::cubin(&kernel_source(traced), major, minor)
}

/// The kernels' source: the constants they share with the launchers, then the files, recording
/// their launches where `traced`.
pub fn kernel_source(traced: bool) -> String {
    let trace = if traced { "#define OXLM_TRACE\n" } else { "" };
    format!("{}{}{trace}{KERNELS}", shared_constants(), trace::defines())
}

/// Constants that launchers and kernels both use, written once on the Rust side and put ahead
/// of the kernels' source as `#define`s.
fn shared_constants() -> String {
    [
        ("INT_RING_STAGES", matmul::INT_RING_STAGES),
        ("MMA_TURN_RUNS", matmul::MMA_TURN_RUNS),
        ("LOW_RANK_THREADS", low_rank::LOW_RANK_THREADS),
        ("LOW_RANK_SLICE", low_rank::LOW_RANK_SLICE),
    ]
    .iter()
    .map(|(name, value)| format!("#define {name} {value}\n"))
    .collect()
}

/// A handle on one GPU: its context, stream, compiled kernels and cuBLAS, and the precision of
/// the many-row matmuls done through it. Cloning is cheap.
#[derive(Clone)]
pub struct Gpu {
    inner: Arc<Inner>,
    exact_math: bool,
}

/// Shared memory a block may take without its kernel being allowed more (`Gpu::allow_shared`).
pub(crate) const UNASKED_SHARED_BYTES: usize = 48 << 10;

/// Key/value heads up to which the fused projection writes code rings itself (`code_arrivals`
/// holds two counts for each); more take the separate write.
pub const CODE_WRITE_KV_HEADS: usize = 256;

/// Blocks a kernel runs at once, by its threads and dynamic shared memory.
type ResidentBlocks = HashMap<(u32, u32), usize>;

struct Inner {
    ordinal: usize,
    name: String,
    multiprocessors: usize,
    /// Where downloads of up to [`PINNED_DOWNLOAD_BYTES`] land (allocated on the first); before
    /// the stream, so that it is freed while the context lives.
    pinned_download: Mutex<Option<PinnedHost>>,
    stream: Arc<CudaStream>,
    module: Arc<CudaModule>,
    /// Each kernel loaded so far, with the most threads a block of it may have.
    functions: Mutex<HashMap<String, (CudaFunction, usize)>>,
    /// [`Gpu::resident_blocks`] by kernel, then threads and dynamic shared memory.
    resident: Mutex<HashMap<String, ResidentBlocks>>,
    /// The dynamic shared memory past 48 KiB each kernel has been allowed (`allow_shared`).
    shared_allowed: Mutex<HashMap<String, u32>>,
    blas: CudaBlas,
    step: Mutex<StepState>,
    /// Whether kernels are launched to start before the previous one ends (compute capability
    /// 9.0 and later, where they wait for their inputs themselves: `await_inputs` in
    /// kernels/prelude.cu).
    early_start: bool,
    /// One count per (token, head) of a split attention launch, of the splits that finished;
    /// the last resets it. Zeroed once, lasting, so captured step graphs can name it.
    split_counters: CudaSlice<u32>,
    /// One count per (keys or values, key/value head) of the fused projection's cache write
    /// into code rings, of the warps that staged their features; the last resets it. Zeroed
    /// once, lasting, as `split_counters`.
    code_arrivals: CudaSlice<u32>,
    /// With `OXLM_TRACE` set: the kernels launched since the last [`Gpu::take_trace`], in order.
    traced: Option<Mutex<Vec<String>>>,
}

/// Downloads up to this size (a vocabulary's logits) go through pinned host memory, and greedy
/// picks are written there by their kernel: a copy into pageable memory costs the driver a
/// staging copy of its own, and each decode step waits for its download while the GPU idles
/// (about a third of that idle time goes, and one sequence decodes a few percent faster).
pub(crate) const PINNED_DOWNLOAD_BYTES: usize = 4 << 20;

/// Page-locked host memory from the driver, mapped into the device's address space (a kernel
/// may write it at `device`).
struct PinnedHost {
    host: *mut u8,
    device: u64,
}

// SAFETY: the memory is only touched under the mutex that holds it.
unsafe impl Send for PinnedHost {}

impl PinnedHost {
    fn new(bytes: usize) -> Result<PinnedHost, EngineError> {
        let mut host = std::ptr::null_mut();
        let mut device = 0;
        // SAFETY: a plain allocation, freed by Drop; the device address is the mapping's.
        unsafe {
            sys::cuMemHostAlloc(&mut host, bytes, sys::CU_MEMHOSTALLOC_DEVICEMAP)
                .result()
                .map_err(err)?;
            sys::cuMemHostGetDevicePointer_v2(&mut device, host, 0)
                .result()
                .map_err(err)?;
        }
        Ok(PinnedHost {
            host: host.cast(),
            device,
        })
    }
}

impl Drop for PinnedHost {
    fn drop(&mut self) {
        // SAFETY: allocated by cuMemHostAlloc and no longer used.
        unsafe {
            let _ = sys::cuMemFreeHost(self.host.cast());
        }
    }
}

impl Gpu {
    /// GPU `ordinal`, opened once per process and shared afterwards.
    pub fn open(ordinal: usize) -> Result<Gpu, EngineError> {
        static OPEN: OnceLock<Mutex<HashMap<usize, Gpu>>> = OnceLock::new();
        let mut open = OPEN.get_or_init(Default::default).lock().unwrap();
        if let Some(gpu) = open.get(&ordinal) {
            return Ok(gpu.clone());
        }
        let gpu = Gpu::create(ordinal)?;
        open.insert(ordinal, gpu.clone());
        Ok(gpu)
    }

    fn create(ordinal: usize) -> Result<Gpu, EngineError> {
        if !libraries_present() {
            return Err(EngineError::Device(
                "CUDA is not available: libcuda, libnvrtc or libcublas could not be opened \
                 (is the NVIDIA driver installed?)"
                    .into(),
            ));
        }
        let count = CudaContext::device_count().map_err(err)?;
        if ordinal >= count.max(0) as usize {
            return Err(EngineError::Device(format!(
                "no GPU cuda:{ordinal}: this machine has {count}"
            )));
        }
        let ctx = CudaContext::new(ordinal).map_err(err)?;
        // One stream runs everything, so cudarc's per-buffer events would only cost time.
        // SAFETY: no buffer is shared between streams.
        unsafe { ctx.disable_event_tracking() };
        keep_freed_memory(&ctx)?;
        let (major, minor) = ctx.compute_capability().map_err(err)?;
        let tracing = tracing();
        let cubin = compile::cubin(&kernel_source(tracing), major, minor)?;
        let module = ctx
            .load_module(cudarc::nvrtc::Ptx::from_binary(cubin))
            .map_err(err)?;
        // A stream of its own: the legacy default stream cannot be captured into graphs.
        let stream = ctx.new_stream().map_err(err)?;
        let blas = CudaBlas::new(stream.clone()).map_err(err)?;
        let multiprocessors = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(err)? as usize;
        let split_counters = stream
            .alloc_zeros(attention::SPLIT_QUERY_HEADS_PER_SM * multiprocessors)
            .map_err(err)?;
        let code_arrivals = stream.alloc_zeros(2 * CODE_WRITE_KV_HEADS).map_err(err)?;
        Ok(Gpu {
            inner: Arc::new(Inner {
                ordinal,
                name: ctx.name().map_err(err)?,
                multiprocessors,
                pinned_download: Mutex::new(None),
                stream,
                module,
                functions: Mutex::new(HashMap::new()),
                resident: Mutex::new(HashMap::new()),
                shared_allowed: Mutex::new(HashMap::new()),
                blas,
                step: Mutex::new(StepState::new()),
                early_start: major >= 9,
                split_counters,
                code_arrivals,
                traced: tracing.then(Mutex::default),
            }),
            exact_math: false,
        })
    }

    pub fn ordinal(&self) -> usize {
        self.inner.ordinal
    }

    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// Whether `self` and `other` are handles on the same GPU.
    pub fn same(&self, other: &Gpu) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }

    /// This GPU with every product in plain f32 (`exact`), rather than the default fast paths:
    /// many-row products (prefill matmuls and attention) on TF32 tensor cores (f32 storage,
    /// operands rounded to 10-bit mantissas, f32 sums; about eight times more precise than the
    /// bf16 mlx computes bf16 models in), and decoding's products of 4- and 8-bit weights on
    /// activations rounded to int16 per run of 32 (relative error under 1e-4). Tensors and
    /// weights made through the handle carry the choice, so a model loaded with it keeps it.
    pub fn with_exact_math(&self, exact: bool) -> Gpu {
        Gpu {
            inner: self.inner.clone(),
            exact_math: exact,
        }
    }

    pub(crate) fn exact_math(&self) -> bool {
        self.exact_math
    }

    pub fn synchronize(&self) -> Result<(), EngineError> {
        self.inner.stream.synchronize().map_err(err)
    }

    /// Bytes of device memory free now, and in all.
    pub fn memory(&self) -> Result<(usize, usize), EngineError> {
        self.inner.stream.context().mem_get_info().map_err(err)
    }

    pub(crate) fn stream(&self) -> &Arc<CudaStream> {
        &self.inner.stream
    }

    pub(crate) fn multiprocessors(&self) -> usize {
        self.inner.multiprocessors
    }

    /// The device address of the fused cache write's counts (see `Inner::code_arrivals`).
    pub(crate) fn code_arrivals(&self) -> u64 {
        self.inner.code_arrivals.device_ptr(&self.inner.stream).0
    }

    /// The device address of the split attention's counters (see `Inner::split_counters`).
    pub(crate) fn split_counters(&self) -> u64 {
        self.inner.split_counters.device_ptr(&self.inner.stream).0
    }

    /// The kernel `name` of the kernels' source.
    pub(crate) fn function(&self, name: &str) -> Result<CudaFunction, EngineError> {
        Ok(self.loaded(name)?.0)
    }

    /// The kernel `name` and the most threads a block of it may have (its registers can bound
    /// it below 1,024), found once, when it is first loaded.
    fn loaded(&self, name: &str) -> Result<(CudaFunction, usize), EngineError> {
        let mut functions = self.inner.functions.lock().unwrap();
        if let Some(loaded) = functions.get(name) {
            return Ok(loaded.clone());
        }
        let f = self
            .inner
            .module
            .load_function(name)
            .map_err(|e| EngineError::Cuda(format!("kernel `{name}`: {e:?}")))?;
        let threads = f.max_threads_per_block().map_err(err)?.max(32) as usize;
        functions.insert(name.to_string(), (f.clone(), threads));
        Ok((f, threads))
    }

    /// Blocks of kernel `name` (`threads` each, with `shared` bytes of dynamic shared memory)
    /// that the GPU runs at once: a grid of that many is one wave. Past the 48 KiB a kernel
    /// may take unasked, it is first allowed `shared`.
    pub(crate) fn resident_blocks(
        &self,
        name: &str,
        threads: u32,
        shared: u32,
    ) -> Result<usize, EngineError> {
        let known = self.inner.resident.lock().unwrap();
        if let Some(&blocks) = known.get(name).and_then(|k| k.get(&(threads, shared))) {
            return Ok(blocks);
        }
        drop(known);
        self.bind()?;
        let function = self.function(name)?;
        self.allow_shared(name, &function, shared)?;
        let per_sm = function
            .occupancy_max_active_blocks_per_multiprocessor(threads, shared as usize, None)
            .map_err(err)?;
        let blocks = per_sm.max(1) as usize * self.inner.multiprocessors;
        let mut known = self.inner.resident.lock().unwrap();
        known
            .entry(name.to_string())
            .or_default()
            .insert((threads, shared), blocks);
        Ok(blocks)
    }

    /// The most threads a block of kernel `name` may have (its registers can bound it below
    /// 1,024).
    pub(crate) fn max_threads_per_block(&self, name: &str) -> Result<usize, EngineError> {
        Ok(self.loaded(name)?.1)
    }

    /// Allows kernel `name` `shared` bytes of dynamic shared memory where that is past the 48 KiB
    /// a kernel may take unasked (once for each larger amount).
    fn allow_shared(
        &self,
        name: &str,
        function: &CudaFunction,
        shared: u32,
    ) -> Result<(), EngineError> {
        if shared as usize <= UNASKED_SHARED_BYTES {
            return Ok(());
        }
        let mut allowed = self.inner.shared_allowed.lock().unwrap();
        if allowed.get(name).is_some_and(|&b| b >= shared) {
            return Ok(());
        }
        function
            .set_attribute(
                sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                shared as i32,
            )
            .map_err(err)?;
        allowed.insert(name.to_string(), shared);
        Ok(())
    }

    /// Makes the GPU's context current on this thread: the raw driver calls below need it, and
    /// a server loads a model on one thread and generates on another.
    fn bind(&self) -> Result<(), EngineError> {
        self.inner.stream.context().bind_to_thread().map_err(err)
    }

    pub(crate) fn step_state(&self) -> MutexGuard<'_, StepState> {
        self.inner.step.lock().unwrap()
    }

    /// Ends the replayable part of a running step before a call that a graph cannot hold.
    fn leave_graph(&self) -> Result<(), EngineError> {
        let mut state = self.step_state();
        if state.in_step() {
            self.bind()?;
            state.boundary(&self.inner.stream)?;
        }
        Ok(())
    }

    /// Launches kernel `name` (see [`StepReplay`] for what happens inside a step).
    pub(crate) fn launch(
        &self,
        name: &str,
        cfg: LaunchConfig,
        args: &[Arg],
    ) -> Result<(), EngineError> {
        self.bind()?;
        let f = self.function(name)?;
        self.allow_shared(name, &f, cfg.shared_mem_bytes)?;
        if let Some(traced) = &self.inner.traced {
            traced.lock().unwrap().push(name.to_string());
        }
        let op = Op::kernel(f.cu_function(), cfg, args, self.inner.early_start);
        self.step_state().submit(&self.inner.stream, op)
    }

    /// Copies `bytes` between device addresses.
    pub(crate) fn copy(&self, dst: u64, src: u64, bytes: usize) -> Result<(), EngineError> {
        if bytes == 0 {
            return Ok(());
        }
        self.bind()?;
        self.step_state()
            .submit(&self.inner.stream, Op::CopyDtoD { dst, src, bytes })
    }

    /// Runs a cuBLAS call, which a step graph does not hold.
    pub(crate) fn blas_call(
        &self,
        call: impl FnOnce(&CudaBlas) -> Result<(), EngineError>,
    ) -> Result<(), EngineError> {
        self.bind()?;
        self.leave_graph()?;
        call(&self.inner.blas)
    }

    /// `values` copied to a new, lasting device allocation (weights, caches).
    pub(crate) fn upload_raw<T: DeviceRepr>(
        &self,
        values: &[T],
    ) -> Result<CudaSlice<T>, EngineError> {
        self.leave_graph()?;
        self.inner.stream.clone_htod(values).map_err(err)
    }

    /// A lasting zeroed allocation.
    pub(crate) fn alloc_raw<T: DeviceRepr + ValidAsZeroBits>(
        &self,
        len: usize,
    ) -> Result<CudaSlice<T>, EngineError> {
        self.leave_graph()?;
        // A zero-length allocation is refused by some drivers; one spare element costs nothing.
        self.inner.stream.alloc_zeros(len.max(1)).map_err(err)
    }

    /// Uninitialised device memory for an op's temporaries or output, which its kernels write
    /// before they read it: from the step's arena inside a step, else an allocation of its own.
    pub(crate) fn scratch(&self, bytes: usize) -> Result<Memory, EngineError> {
        if let Some(ptr) = self.step_state().arena_alloc(bytes) {
            return Ok(Memory { ptr, owner: None });
        }
        self.leave_graph()?;
        // SAFETY: see above.
        let owner = unsafe { self.inner.stream.alloc::<u8>(bytes.max(1)) }.map_err(err)?;
        let ptr = owner.device_ptr(&self.inner.stream).0;
        Ok(Memory {
            ptr,
            owner: Some(owner),
        })
    }

    /// An uninitialised buffer of `len` floats for an op's output (which its kernel writes in
    /// full, so that no memset runs first).
    pub(crate) fn output(&self, len: usize) -> Result<Buffer, EngineError> {
        Ok(Buffer {
            mem: self.scratch(len * 4)?,
            len,
            gpu: self.clone(),
        })
    }

    /// Runs `f` with the pinned host memory small downloads land in ([`PINNED_DOWNLOAD_BYTES`]),
    /// at its host and device addresses, held for `f` alone.
    pub(crate) fn with_pinned<T>(
        &self,
        f: impl FnOnce(*mut u8, u64) -> Result<T, EngineError>,
    ) -> Result<T, EngineError> {
        let mut pinned = self.inner.pinned_download.lock().unwrap();
        if pinned.is_none() {
            self.bind()?;
            *pinned = Some(PinnedHost::new(PINNED_DOWNLOAD_BYTES)?);
        }
        let p = pinned.as_ref().unwrap();
        f(p.host, p.device)
    }

    /// Waits for the work queued so far, ending a step's replayable part first.
    pub(crate) fn finish_queued(&self) -> Result<(), EngineError> {
        self.bind()?;
        self.leave_graph()?;
        self.inner.stream.synchronize().map_err(err)
    }

    /// `values` in a new, lasting buffer.
    pub(crate) fn upload(&self, values: &[f32]) -> Result<Buffer, EngineError> {
        let owner = if values.is_empty() {
            self.alloc_raw::<u8>(4)?
        } else {
            // The bytes, so that every buffer's owner has one type.
            self.upload_raw(bytemuck::cast_slice::<f32, u8>(values))?
        };
        Ok(Buffer::owned(owner, values.len(), self))
    }

    /// A zeroed, lasting buffer of `len` floats.
    pub(crate) fn zeros(&self, len: usize) -> Result<Buffer, EngineError> {
        Ok(Buffer::owned(self.alloc_raw::<u8>(len * 4)?, len, self))
    }

    /// Device-side indices (token ids, positions, rows) for a kernel: step memory and a staged
    /// copy inside a step, so that a replayed step reads this step's values.
    pub(crate) fn indices(
        &self,
        values: impl IntoIterator<Item = usize>,
    ) -> Result<Memory, EngineError> {
        let v: Vec<i32> = values
            .into_iter()
            .map(|i| {
                i32::try_from(i).map_err(|_| EngineError::Shape(format!("index {i} exceeds i32")))
            })
            .collect::<Result<_, _>>()?;
        self.staged(bytemuck::cast_slice(&v))
    }

    /// Words (bit masks, tables) for a kernel, as [`Gpu::indices`] places indices.
    pub(crate) fn words(&self, values: &[u32]) -> Result<Memory, EngineError> {
        self.staged(bytemuck::cast_slice(values))
    }

    /// Device addresses (one buffer per sequence of a batch) for a kernel, as [`Gpu::indices`]
    /// places indices.
    pub(crate) fn addresses(&self, values: &[u64]) -> Result<Memory, EngineError> {
        self.staged(bytemuck::cast_slice(values))
    }

    /// `bytes` on the device. Inside a step, the same bytes staged before in the step are not
    /// uploaded again (a batch's cache tables, the same for every layer): each upload is a copy
    /// between the step's kernels, which wait for it.
    fn staged(&self, bytes: &[u8]) -> Result<Memory, EngineError> {
        self.bind()?;
        if let Some(ptr) = self.step_state().staged_before(bytes) {
            return Ok(Memory { ptr, owner: None });
        }
        let mem = self.scratch(bytes.len().max(4))?;
        if bytes.is_empty() {
            return Ok(mem);
        }
        let staged = self.step_state().stage(mem.ptr, bytes);
        match staged {
            Some(op) => self.step_state().submit(&self.inner.stream, op)?,
            // A pageable copy cannot be in a graph: the step's replayable part ends here.
            None => {
                self.leave_graph()?;
                // SAFETY: `mem` holds `bytes.len()` bytes; a pageable copy is staged by the
                // driver before this returns.
                unsafe {
                    result::memcpy_htod_async(mem.ptr, bytes, self.inner.stream.cu_stream())
                        .map_err(err)?
                }
            }
        }
        Ok(mem)
    }
}

/// Freed buffers go back to the driver's pool, not the OS, so later allocations are cheap.
fn keep_freed_memory(ctx: &CudaContext) -> Result<(), EngineError> {
    if !ctx.has_async_alloc() {
        return Ok(());
    }
    let mut pool = std::ptr::null_mut();
    let mut threshold = u64::MAX;
    // SAFETY: plain driver calls on the context's own device; the attribute takes a u64.
    unsafe {
        sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device())
            .result()
            .map_err(err)?;
        sys::cuMemPoolSetAttribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            (&mut threshold as *mut u64).cast(),
        )
        .result()
        .map_err(err)?;
    }
    Ok(())
}

/// Device memory: an allocation of its own (freed on drop), or a piece of a step's arena.
pub(crate) struct Memory {
    ptr: u64,
    #[allow(dead_code)] // held for its drop
    owner: Option<CudaSlice<u8>>,
}

impl Memory {
    pub(crate) fn ptr(&self) -> u64 {
        self.ptr
    }
}

/// The positions of a pass's tokens in device memory (as i32), and how many there are.
#[derive(Clone, Copy)]
pub(crate) struct GpuPositions<'a> {
    pub memory: &'a Memory,
    pub len: usize,
}

impl GpuPositions<'_> {
    pub(crate) fn ptr(&self) -> u64 {
        self.memory.ptr()
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }
}

/// `len` f32s in device memory.
pub struct Buffer {
    mem: Memory,
    len: usize,
    gpu: Gpu,
}

impl Buffer {
    fn owned(owner: CudaSlice<u8>, len: usize, gpu: &Gpu) -> Buffer {
        let ptr = owner.device_ptr(gpu.stream()).0;
        Buffer {
            mem: Memory {
                ptr,
                owner: Some(owner),
            },
            len,
            gpu: gpu.clone(),
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    /// The elements, copied to the host (which waits for the work queued before).
    pub(crate) fn download(&self) -> Result<Vec<f32>, EngineError> {
        self.gpu.bind()?;
        self.gpu.leave_graph()?;
        let mut out = vec![0.0f32; self.len];
        if self.len == 0 {
            return Ok(out);
        }
        let stream = self.gpu.stream();
        if self.len * 4 > PINNED_DOWNLOAD_BYTES {
            // SAFETY: the buffer holds `len` floats; the stream is waited for before `out` is read.
            unsafe {
                result::memcpy_dtoh_async(&mut out[..], self.ptr(), stream.cu_stream())
                    .map_err(err)?
            };
            stream.synchronize().map_err(err)?;
            return Ok(out);
        }
        self.gpu.with_pinned(|pinned, _| {
            // SAFETY: the pinned memory holds PINNED_DOWNLOAD_BYTES, and only this download, under
            // the lock, uses it; the stream is waited for before it is read.
            unsafe {
                let landed = std::slice::from_raw_parts_mut(pinned.cast::<f32>(), self.len);
                result::memcpy_dtoh_async(landed, self.ptr(), stream.cu_stream()).map_err(err)?;
                stream.synchronize().map_err(err)?;
                out.copy_from_slice(landed);
            }
            Ok(())
        })?;
        Ok(out)
    }

    /// A copy in a new, lasting allocation.
    pub(crate) fn try_clone(&self) -> Result<Buffer, EngineError> {
        let copy = self.gpu.zeros(self.len)?;
        self.gpu.copy(copy.ptr(), self.ptr(), self.len * 4)?;
        Ok(copy)
    }

    /// The device address.
    pub(crate) fn ptr(&self) -> u64 {
        self.mem.ptr
    }
}

/// One ring of a key/value cache in device memory, `len` elements in a lasting allocation of
/// whole f32 words: f32 or f16 elements, or codes (`kernels/attention.cu` lays them out: the
/// codes, then from the next 16-byte boundary a (scale, bias) pair of f32 per group).
pub struct DeviceRing {
    words: Buffer,
    len: usize,
    precision: KvPrecision,
}

impl DeviceRing {
    /// `len` zeros.
    pub(crate) fn zeros(
        gpu: &Gpu,
        len: usize,
        precision: KvPrecision,
    ) -> Result<DeviceRing, EngineError> {
        Ok(DeviceRing {
            words: gpu.zeros(Self::bytes_for(len, precision).div_ceil(4))?,
            len,
            precision,
        })
    }

    /// Bytes of device memory a ring of `len` elements in `precision` takes.
    pub(crate) fn bytes_for(len: usize, precision: KvPrecision) -> usize {
        match precision {
            KvPrecision::F32 => len * 4,
            // f16 elements are packed two to a 32-bit word.
            KvPrecision::F16 => len.div_ceil(2) * 4,
            KvPrecision::Quantized(q) => Self::pairs_at(len, q) + len.div_ceil(q.group) * 8,
        }
    }

    /// Where a ring of `len` codes keeps its groups' pairs (`code_pairs_at` in the kernels).
    fn pairs_at(len: usize, quant: KvQuant) -> usize {
        quant.row_bytes(len).next_multiple_of(16)
    }

    /// `values` in a new ring, rounded to f16 (as `kv_store` in the kernels rounds) or quantized
    /// (as `quantize_group` does) as `precision` asks. Codes take whole groups: other lengths
    /// are refused.
    pub(crate) fn upload(
        gpu: &Gpu,
        values: &[f32],
        precision: KvPrecision,
    ) -> Result<DeviceRing, EngineError> {
        use crate::cpu::attention::KvElem;
        let words = match precision {
            KvPrecision::F32 => gpu.upload(values)?,
            KvPrecision::F16 => {
                let bits = |v: Option<&f32>| {
                    v.map_or(0, |&v| <half::f16 as KvElem>::from_f32(v).to_bits())
                };
                // Two elements a word, the first in its low half (little-endian, as the kernels
                // read).
                let words: Vec<f32> = values
                    .chunks(2)
                    .map(|p| f32::from_bits(bits(p.first()) as u32 | (bits(p.get(1)) as u32) << 16))
                    .collect();
                gpu.upload(&words)?
            }
            KvPrecision::Quantized(quant) => {
                let ring = QuantRing::quantized(values, quant).ok_or_else(|| {
                    EngineError::Shape(format!(
                        "{} elements are not whole groups of {}",
                        values.len(),
                        quant.group
                    ))
                })?;
                return Self::upload_codes(gpu, ring.rows());
            }
        };
        Ok(DeviceRing {
            words,
            len: values.len(),
            precision,
        })
    }

    /// A new ring holding these codes as they are.
    pub(crate) fn upload_codes(gpu: &Gpu, rows: QuantRows) -> Result<DeviceRing, EngineError> {
        let (quant, len) = (rows.quant, rows.elements());
        let mut bytes = vec![0u8; Self::bytes_for(len, KvPrecision::Quantized(quant))];
        bytes[..rows.codes.len()].copy_from_slice(rows.codes);
        let pairs = bytes[Self::pairs_at(len, quant)..].chunks_exact_mut(8);
        for (pair, (scale, bias)) in pairs.zip(rows.scales.iter().zip(rows.biases)) {
            pair[..4].copy_from_slice(&scale.to_le_bytes());
            pair[4..].copy_from_slice(&bias.to_le_bytes());
        }
        bytes.resize(bytes.len().next_multiple_of(4), 0);
        let words: Vec<f32> = bytes
            .chunks_exact(4)
            .map(|w| f32::from_le_bytes(w.try_into().unwrap()))
            .collect();
        Ok(DeviceRing {
            words: gpu.upload(&words)?,
            len,
            precision: KvPrecision::Quantized(quant),
        })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn precision(&self) -> KvPrecision {
        self.precision
    }

    /// Bytes of one row of `d` elements as the batched attention stages it: the elements, or
    /// the codes and their groups' pairs.
    pub(crate) fn staged_row_bytes(&self, d: usize) -> usize {
        match self.precision {
            KvPrecision::F32 => 4 * d,
            KvPrecision::F16 => 2 * d,
            KvPrecision::Quantized(q) => q.row_bytes(d) + d / q.group * 8,
        }
    }

    /// log2 of a code ring's group size, as the kernels take it; 0 for other rings.
    pub(crate) fn group_shift(&self) -> i32 {
        group_shift(self.precision)
    }

    /// Bytes of device memory the elements take.
    pub fn size_in_bytes(&self) -> usize {
        self.words.len() * 4
    }

    pub fn gpu(&self) -> &Gpu {
        self.words.gpu()
    }

    /// The elements as f32, copied to the host (codes dequantized).
    pub(crate) fn download(&self) -> Result<Vec<f32>, EngineError> {
        if let Some(codes) = self.download_codes()? {
            return Ok(codes.to_vec());
        }
        let words = self.words.download()?;
        if self.precision == KvPrecision::F32 {
            return Ok(words);
        }
        let halves: &[u16] = bytemuck::cast_slice(&words);
        Ok(halves[..self.len]
            .iter()
            .map(|&h| half::f16::from_bits(h).to_f32())
            .collect())
    }

    /// A code ring's codes, scales and biases, copied to the host; `None` for other rings.
    pub(crate) fn download_codes(&self) -> Result<Option<QuantRing>, EngineError> {
        let KvPrecision::Quantized(quant) = self.precision else {
            return Ok(None);
        };
        let words = self.words.download()?;
        let bytes: &[u8] = bytemuck::cast_slice(&words);
        let groups = self.len.div_ceil(quant.group);
        let pairs = &bytes[Self::pairs_at(self.len, quant)..][..groups * 8];
        let float = |b: &[u8]| f32::from_le_bytes(b.try_into().unwrap());
        Ok(Some(QuantRing {
            quant,
            codes: bytes[..quant.row_bytes(self.len)].to_vec(),
            scales: pairs.chunks_exact(8).map(|p| float(&p[..4])).collect(),
            biases: pairs.chunks_exact(8).map(|p| float(&p[4..])).collect(),
        }))
    }

    /// A copy in a new, lasting allocation.
    pub(crate) fn try_clone(&self) -> Result<DeviceRing, EngineError> {
        Ok(DeviceRing {
            words: self.words.try_clone()?,
            len: self.len,
            precision: self.precision,
        })
    }

    /// The device address.
    pub(crate) fn ptr(&self) -> u64 {
        self.words.ptr()
    }

    /// The parts a row of `d` elements has in this ring, which moves copy as they are, each as
    /// (address, units a row, bytes a unit): the elements, or the codes and the pairs.
    pub(crate) fn row_parts(&self, d: usize) -> Vec<(u64, usize, usize)> {
        match self.precision {
            KvPrecision::F32 => vec![(self.ptr(), d, 4)],
            KvPrecision::F16 => vec![(self.ptr(), d, 2)],
            KvPrecision::Quantized(q) => vec![
                (self.ptr(), q.row_bytes(d) / 4, 4),
                (
                    self.ptr() + Self::pairs_at(self.len, q) as u64,
                    2 * d / q.group,
                    4,
                ),
            ],
        }
    }

    /// The ring's element type as the attention kernels' names spell it.
    pub(crate) fn suffix(&self) -> &'static str {
        ring_suffix(self.precision)
    }
}

/// A ring precision's element type as the cache and attention kernels' names spell it.
pub(crate) fn ring_suffix(precision: KvPrecision) -> &'static str {
    match precision {
        KvPrecision::F32 => "f32",
        KvPrecision::F16 => "f16",
        KvPrecision::Quantized(KvQuant { bits: 8, .. }) => "q8",
        KvPrecision::Quantized(_) => "q4",
    }
}

/// log2 of a code ring's group size, as the kernels take it; 0 for other precisions.
pub(crate) fn group_shift(precision: KvPrecision) -> i32 {
    match precision {
        KvPrecision::Quantized(q) => q.group.trailing_zeros() as i32,
        _ => 0,
    }
}

/// Scale/bias (or weight) element type as the kernel names spell it.
pub(crate) fn type_suffix(dtype: crate::DType) -> Result<&'static str, EngineError> {
    match dtype {
        crate::DType::F32 => Ok("f32"),
        crate::DType::F16 => Ok("f16"),
        crate::DType::BF16 => Ok("bf16"),
        other => Err(EngineError::UnsupportedDType {
            what: "GPU weights".into(),
            dtype: other.to_string(),
        }),
    }
}

/// The error for a weight matrix that was never copied to `gpu`.
pub(crate) fn not_placed(rows: usize, cols: usize, gpu: &Gpu) -> EngineError {
    EngineError::Device(format!(
        "a [{rows}, {cols}] weight is not on cuda:{} (the model was loaded for another device)",
        gpu.ordinal()
    ))
}

/// An MLX-quantized matrix in device memory, in its packed form.
pub struct QuantizedWeights {
    pub(crate) packed: CudaSlice<u32>,
    pub(crate) scales: CudaSlice<u8>,
    /// One zero byte, never read, in the float modes, which have no biases.
    pub(crate) biases: CudaSlice<u8>,
    /// The scales' type as kernel names spell it: `f32`, `f16` or `bf16`; `u8` (codes) in the
    /// float modes.
    pub(crate) scale_type: &'static str,
    pub(crate) gpu: Gpu,
}

/// A float (f32, f16 or bf16) matrix in device memory, as stored.
pub struct DenseWeights {
    pub(crate) data: CudaSlice<u8>,
    pub(crate) dtype: &'static str,
    pub(crate) gpu: Gpu,
}

impl std::fmt::Debug for QuantizedWeights {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        write!(f, "QuantizedWeights(cuda:{})", self.gpu.ordinal())
    }
}

impl std::fmt::Debug for DenseWeights {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        write!(f, "DenseWeights(cuda:{})", self.gpu.ordinal())
    }
}

#[cfg(test)]
mod tests {
    use std::collections::{HashMap, HashSet};

    /// `source` without its `//` comments (which hold unbalanced text such as `[0, 2)`).
    fn strip_comments(source: &str) -> String {
        source
            .lines()
            .map(|l| l.split("//").next().unwrap())
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// The body, braces included, of the definition whose parameter list opens at `open`.
    fn body_after(source: &str, open: usize) -> &str {
        let bytes = source.as_bytes();
        let mut at = open;
        let mut depth = 0;
        loop {
            match bytes[at] {
                b'(' => depth += 1,
                b')' => depth -= 1,
                b';' if depth == 0 => return "",
                b'{' if depth == 0 => break,
                _ => {}
            }
            at += 1;
        }
        let start = at;
        let mut depth = 0;
        loop {
            match bytes[at] {
                b'{' => depth += 1,
                b'}' => {
                    depth -= 1;
                    if depth == 0 {
                        return &source[start..=at];
                    }
                }
                _ => {}
            }
            at += 1;
        }
    }

    /// Whether `body` calls function `name` (plainly or as a template instance).
    fn calls(body: &str, name: &str) -> bool {
        body.contains(&format!("{name}(")) || body.contains(&format!("{name}<"))
    }

    /// Every kernel may start before the previous one ends (see `await_inputs`), so each must
    /// wait for its inputs, itself or through a device function it calls.
    #[test]
    fn every_kernel_awaits_its_inputs() {
        let source = strip_comments(super::KERNELS);
        let name_before = |open: usize| -> String {
            source[..open]
                .chars()
                .rev()
                .take_while(|c| c.is_alphanumeric() || *c == '_' || *c == '#')
                .collect::<Vec<_>>()
                .into_iter()
                .rev()
                .collect()
        };
        let mut devices: HashMap<String, &str> = HashMap::new();
        let mut kernels: Vec<(String, &str)> = Vec::new();
        for (at, _) in source.match_indices("__global__") {
            let open = at + source[at..].find('(').unwrap();
            kernels.push((name_before(open), body_after(&source, open)));
        }
        for (at, _) in source.match_indices("__device__") {
            let open = at + source[at..].find('(').unwrap();
            let body = body_after(&source, open);
            if !body.is_empty() {
                devices.insert(name_before(open), body);
            }
        }
        let mut waiting: HashSet<String> = HashSet::from(["await_inputs".to_string()]);
        loop {
            let more: Vec<String> = devices
                .iter()
                .filter(|(name, body)| {
                    !waiting.contains(*name) && waiting.iter().any(|w| calls(body, w))
                })
                .map(|(name, _)| name.clone())
                .collect();
            if more.is_empty() {
                break;
            }
            waiting.extend(more);
        }
        assert!(kernels.len() > 30, "found {} kernels", kernels.len());
        for (name, body) in &kernels {
            assert!(
                waiting.iter().any(|w| calls(body, w)),
                "kernel {name} never waits for its inputs"
            );
        }
    }
}
