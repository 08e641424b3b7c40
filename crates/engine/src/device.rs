//! Where tensors live and kernels run: the host CPU, or a CUDA GPU.

use std::fmt;

use std::time::Duration;

use crate::cuda::{Gpu, StepReplay};
use crate::EngineError;

/// A device that holds tensors and runs the ops on them. Cloning is cheap (a handle).
#[derive(Clone)]
pub enum Device {
    Cpu,
    Cuda(Gpu),
}

impl Device {
    /// Parses `cpu`, `cuda` (GPU 0) or `cuda:N`, opening the GPU.
    pub fn open(spec: &str) -> Result<Device, EngineError> {
        match spec {
            "cpu" => Ok(Device::Cpu),
            "cuda" => Gpu::open(0).map(Device::Cuda),
            _ => match spec.strip_prefix("cuda:").map(str::parse::<usize>) {
                Some(Ok(ordinal)) => Gpu::open(ordinal).map(Device::Cuda),
                _ => Err(EngineError::Device(format!(
                    "unknown device `{spec}` (expected cpu, cuda or cuda:N)"
                ))),
            },
        }
    }

    pub fn is_cpu(&self) -> bool {
        matches!(self, Device::Cpu)
    }

    /// Bytes this process could still take on the device: a GPU's free memory; on the host,
    /// the kernel's estimate of what can be allocated without swapping (`MemAvailable`), or
    /// less where a memory cgroup limits this process.
    pub fn available_memory(&self) -> Result<usize, EngineError> {
        match self {
            Device::Cpu => host_available_memory()
                .ok_or_else(|| EngineError::Device("cannot read /proc/meminfo".into())),
            Device::Cuda(gpu) => Ok(gpu.memory()?.0),
        }
    }

    /// Waits until the device has finished the work queued on it (a no-op on the CPU), so that
    /// a timer read afterwards covers it.
    pub fn synchronize(&self) -> Result<(), EngineError> {
        match self {
            Device::Cpu => Ok(()),
            Device::Cuda(gpu) => gpu.synchronize(),
        }
    }
}

/// `MemAvailable`, less where a cgroup (v2, else v1) caps this process's memory nearer.
fn host_available_memory() -> Option<usize> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = meminfo.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: usize = line.split_whitespace().nth(1)?.parse().ok()?;
    let available = kib * 1024;
    let read =
        |path: &str| -> Option<usize> { std::fs::read_to_string(path).ok()?.trim().parse().ok() };
    let capped = [
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        (
            "/sys/fs/cgroup/memory/memory.limit_in_bytes",
            "/sys/fs/cgroup/memory/memory.usage_in_bytes",
        ),
    ]
    .iter()
    .find_map(|(limit, usage)| Some(read(limit)?.saturating_sub(read(usage)?)));
    // An unlimited cgroup reads "max" (v2) or a huge number (v1).
    Some(capped.map_or(available, |left| left.min(available)))
}

/// Runs one sequence's decode steps (forward passes of one token each) as cheaply as the
/// device allows: on a GPU, replayed as a CUDA graph once the first has been captured (see
/// [`StepReplay`]); on the CPU, plainly.
pub struct DecodeSteps(Option<StepReplay>);

impl DecodeSteps {
    pub fn new(device: &Device) -> DecodeSteps {
        DecodeSteps(match device {
            Device::Cpu => None,
            Device::Cuda(gpu) => Some(StepReplay::new(gpu)),
        })
    }

    /// Runs `step`, one forward pass that ends by copying its logits to the host.
    pub fn run<T, E: From<EngineError>>(
        &mut self,
        step: impl FnOnce() -> Result<T, E>,
    ) -> Result<T, E> {
        match &mut self.0 {
            None => step(),
            Some(replay) => replay.run(step),
        }
    }

    /// Steps that ran from a captured graph (zero on the CPU).
    pub fn replayed(&self) -> u64 {
        self.0.as_ref().map_or(0, |r| r.replayed)
    }

    /// On a GPU, over all steps so far: the host's time up to each step's download (walking
    /// the model, launching).
    pub fn host_time(&self) -> Option<Duration> {
        self.0.as_ref().map(|r| r.walking)
    }

    /// On a GPU, the size of the memory the steps take their temporaries from, which grows
    /// when a step outgrows it.
    pub fn arena_bytes(&self) -> Option<usize> {
        self.0.as_ref().map(|r| r.arena_bytes())
    }

    /// On a GPU, over the replayed steps so far: the GPU's time from each one's first graph
    /// launch to the end of its last replayed call ([`StepReplay::gpu_span`]).
    pub fn gpu_time(&self) -> Option<Duration> {
        self.0.as_ref().map(|r| r.gpu_span)
    }
}

impl PartialEq for Device {
    fn eq(&self, other: &Device) -> bool {
        match (self, other) {
            (Device::Cpu, Device::Cpu) => true,
            (Device::Cuda(a), Device::Cuda(b)) => a.same(b),
            _ => false,
        }
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        match self {
            Device::Cpu => write!(f, "cpu"),
            Device::Cuda(gpu) => write!(f, "cuda:{} ({})", gpu.ordinal(), gpu.name()),
        }
    }
}

impl fmt::Debug for Device {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}
