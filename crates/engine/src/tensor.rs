//! Activations: row-major f32 arrays with a shape, held on the device that computes them.

use crate::cuda::Buffer;
use crate::{Device, EngineError};

pub(crate) enum Storage {
    Host(Vec<f32>),
    Cuda(Buffer),
}

/// A row-major f32 array on the host or on a GPU. Its last axis is its row width for the ops
/// that work row by row.
pub struct Tensor {
    shape: Vec<usize>,
    pub(crate) storage: Storage,
}

impl Tensor {
    /// A host tensor holding `data`.
    pub fn new(shape: Vec<usize>, data: Vec<f32>) -> Self {
        assert_eq!(
            shape.iter().product::<usize>(),
            data.len(),
            "shape {shape:?}"
        );
        Tensor {
            shape,
            storage: Storage::Host(data),
        }
    }

    /// `data` placed on `device`.
    pub fn from_slice(
        shape: Vec<usize>,
        data: &[f32],
        device: &Device,
    ) -> Result<Self, EngineError> {
        match device {
            Device::Cpu => Ok(Tensor::new(shape, data.to_vec())),
            Device::Cuda(gpu) => {
                assert_eq!(
                    shape.iter().product::<usize>(),
                    data.len(),
                    "shape {shape:?}"
                );
                Ok(Tensor {
                    shape,
                    storage: Storage::Cuda(gpu.upload(data)?),
                })
            }
        }
    }

    pub fn zeros(shape: Vec<usize>, device: &Device) -> Result<Self, EngineError> {
        let n = shape.iter().product();
        match device {
            Device::Cpu => Ok(Tensor::new(shape, vec![0.0; n])),
            Device::Cuda(gpu) => Ok(Tensor {
                shape,
                storage: Storage::Cuda(gpu.zeros(n)?),
            }),
        }
    }

    pub(crate) fn on_gpu(shape: Vec<usize>, buffer: Buffer) -> Self {
        debug_assert_eq!(shape.iter().product::<usize>(), buffer.len());
        Tensor {
            shape,
            storage: Storage::Cuda(buffer),
        }
    }

    pub fn device(&self) -> Device {
        match &self.storage {
            Storage::Host(_) => Device::Cpu,
            Storage::Cuda(b) => Device::Cuda(b.gpu().clone()),
        }
    }

    pub fn is_host(&self) -> bool {
        matches!(self.storage, Storage::Host(_))
    }

    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// Elements in all.
    pub fn len(&self) -> usize {
        self.shape.iter().product()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The width of a row: the last axis.
    pub fn cols(&self) -> usize {
        *self.shape.last().unwrap_or(&1)
    }

    /// Rows of [`cols`](Self::cols) elements.
    pub fn rows(&self) -> usize {
        self.len().checked_div(self.cols()).unwrap_or(0)
    }

    /// The same elements under another shape of the same size.
    pub fn reshape(mut self, shape: Vec<usize>) -> Self {
        assert_eq!(
            shape.iter().product::<usize>(),
            self.len(),
            "reshape {:?} to {shape:?}",
            self.shape
        );
        self.shape = shape;
        self
    }

    /// The elements of a host tensor. Device tensors are read with [`to_vec`](Self::to_vec).
    ///
    /// # Panics
    /// If the tensor is on a GPU: reading it there needs a copy that can fail.
    pub fn data(&self) -> &[f32] {
        match &self.storage {
            Storage::Host(v) => v,
            Storage::Cuda(_) => panic!("Tensor::data on a GPU tensor: copy it with to_host first"),
        }
    }

    /// As [`data`](Self::data), mutably.
    pub fn data_mut(&mut self) -> &mut [f32] {
        match &mut self.storage {
            Storage::Host(v) => v,
            Storage::Cuda(_) => {
                panic!("Tensor::data_mut on a GPU tensor: copy it with to_host first")
            }
        }
    }

    /// The elements of a host tensor, moved out (see [`data`](Self::data)).
    pub fn into_data(self) -> Vec<f32> {
        match self.storage {
            Storage::Host(v) => v,
            Storage::Cuda(_) => panic!("Tensor::into_data on a GPU tensor: use into_vec"),
        }
    }

    /// Row `i` of a host tensor (see [`data`](Self::data)).
    pub fn row(&self, i: usize) -> &[f32] {
        let cols = self.cols();
        &self.data()[i * cols..(i + 1) * cols]
    }

    /// The elements, copied from the device if need be.
    pub fn to_vec(&self) -> Result<Vec<f32>, EngineError> {
        match &self.storage {
            Storage::Host(v) => Ok(v.clone()),
            Storage::Cuda(b) => b.download(),
        }
    }

    /// The elements, moved out of a host tensor or copied from the device.
    pub fn into_vec(self) -> Result<Vec<f32>, EngineError> {
        match self.storage {
            Storage::Host(v) => Ok(v),
            Storage::Cuda(b) => b.download(),
        }
    }

    /// This tensor on the host (itself if it is there already).
    pub fn into_host(self) -> Result<Tensor, EngineError> {
        let shape = self.shape.clone();
        Ok(Tensor::new(shape, self.into_vec()?))
    }

    /// A copy on `device`.
    pub fn to_device(&self, device: &Device) -> Result<Tensor, EngineError> {
        match (&self.storage, device) {
            (Storage::Host(v), _) => Tensor::from_slice(self.shape.clone(), v, device),
            (Storage::Cuda(_), Device::Cpu) => Ok(Tensor::new(self.shape.clone(), self.to_vec()?)),
            (Storage::Cuda(b), Device::Cuda(gpu)) if b.gpu().same(gpu) => self.try_clone(),
            (Storage::Cuda(_), Device::Cuda(gpu)) => Tensor::from_slice(
                self.shape.clone(),
                &self.to_vec()?,
                &Device::Cuda(gpu.clone()),
            ),
        }
    }

    /// A copy on the same device; on a GPU it fails if device memory runs out.
    pub fn try_clone(&self) -> Result<Tensor, EngineError> {
        Ok(Tensor {
            shape: self.shape.clone(),
            storage: match &self.storage {
                Storage::Host(v) => Storage::Host(v.clone()),
                Storage::Cuda(b) => Storage::Cuda(b.try_clone()?),
            },
        })
    }

    /// Bytes of device or host memory the elements take.
    pub fn size_in_bytes(&self) -> usize {
        self.len() * std::mem::size_of::<f32>()
    }
}

/// Clones on a GPU copy device memory; use [`Tensor::try_clone`] where running out of it must
/// be an error rather than a panic.
impl Clone for Tensor {
    fn clone(&self) -> Self {
        self.try_clone().expect("copying a tensor on its device")
    }
}

impl std::fmt::Debug for Tensor {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        match &self.storage {
            Storage::Host(v) if v.len() <= 16 => write!(f, "Tensor({:?}, {v:?})", self.shape),
            _ => write!(f, "Tensor({:?} on {:?})", self.shape, self.device()),
        }
    }
}

impl PartialEq for Tensor {
    /// Same shape and elements; tensors on a GPU compare equal only to themselves.
    fn eq(&self, other: &Tensor) -> bool {
        match (&self.storage, &other.storage) {
            (Storage::Host(a), Storage::Host(b)) => self.shape == other.shape && a == b,
            _ => std::ptr::eq(self, other),
        }
    }
}
