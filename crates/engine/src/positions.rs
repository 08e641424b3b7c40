//! The positions of the tokens of one forward pass, on the device that needs them, so that the
//! ops of every layer share one copy.

use crate::cuda::{GpuPositions, Memory};
use crate::{Device, EngineError};

pub struct Positions {
    values: Vec<usize>,
    gpu: Option<Memory>,
}

impl Positions {
    /// `values` (one per token), copied to `device` if it is a GPU.
    pub fn new(values: Vec<usize>, device: &Device) -> Result<Self, EngineError> {
        let gpu = match device {
            Device::Cpu => None,
            Device::Cuda(gpu) => Some(gpu.indices(values.iter().copied())?),
        };
        Ok(Positions { values, gpu })
    }

    /// The positions of `count` tokens following `offset` earlier ones.
    pub fn following(offset: usize, count: usize, device: &Device) -> Result<Self, EngineError> {
        Positions::new((offset..offset + count).collect(), device)
    }

    pub fn as_slice(&self) -> &[usize] {
        &self.values
    }

    pub fn len(&self) -> usize {
        self.values.len()
    }

    pub fn is_empty(&self) -> bool {
        self.values.is_empty()
    }

    /// The positions' copy on the GPU, for its kernels.
    pub(crate) fn on_gpu(&self) -> Result<GpuPositions<'_>, EngineError> {
        let memory = self
            .gpu
            .as_ref()
            .ok_or_else(|| EngineError::Device("positions were made for the CPU".into()))?;
        Ok(GpuPositions {
            memory,
            len: self.values.len(),
        })
    }
}
