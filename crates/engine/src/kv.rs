//! Storage for cached keys and values. Activations are f32 everywhere, but a long context's
//! cache is what decoding reads most of after the weights, so on the host it is kept in f16 by
//! default: half the bytes per position, as llama.cpp's cache and mlx-lm's (in an f16 model's
//! dtype) keep it.

use half::f16;

use crate::cpu::attention::KvElem;
use crate::cuda::Buffer;
use crate::{Device, EngineError};

/// The element type of a cache's rings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvPrecision {
    /// f32: exactly the keys and values the layer computed.
    F32,
    /// f16: rounded once when written, read at half the bytes.
    F16,
}

impl KvPrecision {
    /// What a cache on `device` keeps by default: f16 on the host, where attention streams the
    /// cache from memory; f32 on a GPU, whose kernels read f32.
    pub fn default_for(device: &Device) -> KvPrecision {
        match device {
            Device::Cpu => KvPrecision::F16,
            Device::Cuda(_) => KvPrecision::F32,
        }
    }
}

pub(crate) enum KvStorage {
    HostF32(Vec<f32>),
    HostF16(Vec<f16>),
    Cuda(Buffer),
}

/// One ring of a layer's cached keys or values (`[kv_heads, capacity, head_dim]` elements),
/// written and read by the cache ops of [`crate::ops`].
pub struct KvBuffer {
    pub(crate) storage: KvStorage,
}

impl KvBuffer {
    /// `len` zeros on `device`. GPU rings are f32 whatever is asked, since the GPU kernels read
    /// f32.
    pub fn zeros(
        len: usize,
        precision: KvPrecision,
        device: &Device,
    ) -> Result<KvBuffer, EngineError> {
        let storage = match (device, precision) {
            (Device::Cpu, KvPrecision::F32) => KvStorage::HostF32(vec![0.0; len]),
            (Device::Cpu, KvPrecision::F16) => KvStorage::HostF16(vec![f16::ZERO; len]),
            (Device::Cuda(gpu), _) => KvStorage::Cuda(gpu.zeros(len)?),
        };
        Ok(KvBuffer { storage })
    }

    /// Elements held.
    pub fn len(&self) -> usize {
        match &self.storage {
            KvStorage::HostF32(v) => v.len(),
            KvStorage::HostF16(v) => v.len(),
            KvStorage::Cuda(b) => b.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn precision(&self) -> KvPrecision {
        match &self.storage {
            KvStorage::HostF16(_) => KvPrecision::F16,
            KvStorage::HostF32(_) | KvStorage::Cuda(_) => KvPrecision::F32,
        }
    }

    pub fn device(&self) -> Device {
        match &self.storage {
            KvStorage::HostF32(_) | KvStorage::HostF16(_) => Device::Cpu,
            KvStorage::Cuda(b) => Device::Cuda(b.gpu().clone()),
        }
    }

    /// Bytes of host or device memory held.
    pub fn size_in_bytes(&self) -> usize {
        match self.precision() {
            KvPrecision::F32 => self.len() * 4,
            KvPrecision::F16 => self.len() * 2,
        }
    }

    /// The elements as f32, copied from the device if need be.
    pub fn to_vec(&self) -> Result<Vec<f32>, EngineError> {
        match &self.storage {
            KvStorage::HostF32(v) => Ok(v.clone()),
            KvStorage::HostF16(v) => Ok(v.iter().map(|x| x.to_f32()).collect()),
            KvStorage::Cuda(b) => b.download(),
        }
    }

    /// These elements in `precision`: rounded to f16 or widened to f32 on the host; a GPU ring
    /// stays f32.
    pub fn into_precision(self, precision: KvPrecision) -> KvBuffer {
        let storage = match (self.storage, precision) {
            (KvStorage::HostF32(v), KvPrecision::F16) => {
                KvStorage::HostF16(v.into_iter().map(KvElem::from_f32).collect())
            }
            (KvStorage::HostF16(v), KvPrecision::F32) => {
                KvStorage::HostF32(v.into_iter().map(f16::to_f32).collect())
            }
            (kept, _) => kept,
        };
        KvBuffer { storage }
    }

    /// A copy on the same device; on a GPU it fails if device memory runs out.
    pub fn try_clone(&self) -> Result<KvBuffer, EngineError> {
        let storage = match &self.storage {
            KvStorage::HostF32(v) => KvStorage::HostF32(v.clone()),
            KvStorage::HostF16(v) => KvStorage::HostF16(v.clone()),
            KvStorage::Cuda(b) => KvStorage::Cuda(b.try_clone()?),
        };
        Ok(KvBuffer { storage })
    }
}

/// Clones on a GPU copy device memory; use [`KvBuffer::try_clone`] where running out of it
/// must be an error rather than a panic.
impl Clone for KvBuffer {
    fn clone(&self) -> Self {
        self.try_clone().expect("copying a cache on its device")
    }
}

impl std::fmt::Debug for KvBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        let (n, p, d) = (self.len(), self.precision(), self.device());
        write!(f, "KvBuffer({n} × {p:?} on {d:?})")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::{self, Kv};
    use crate::{Positions, Tensor};

    /// Values that f16 does not hold exactly, and one past its range.
    fn awkward(n: usize, seed: f32) -> Vec<f32> {
        (0..n)
            .map(|i| ((i as f32 * 0.37 + seed).sin() * 3.1).powi(3))
            .chain([1e6])
            .take(n)
            .collect()
    }

    /// An f16 ring reads back as its values rounded once, saturating; attention over it equals
    /// attention over an f32 ring holding those rounded values, bit for bit, in a full cache and
    /// in a wrapped sliding window.
    #[test]
    fn an_f16_ring_is_an_f32_ring_of_rounded_values() {
        let (kv_heads, d, capacity, heads) = (2, 16, 8, 4);
        let row = kv_heads * d;
        let tokens = 11; // wraps the ring of 8
        let (keys, values) = (awkward(tokens * row, 0.5), awkward(tokens * row, 1.5));
        let rounded = |x: &[f32]| -> Vec<f32> {
            x.iter()
                .map(|&v| <f16 as KvElem>::from_f32(v).to_f32())
                .collect()
        };
        assert_eq!(rounded(&[1e6])[0], 65504.0);
        let fill = |precision, k: &[f32], v: &[f32]| {
            let ring = || KvBuffer::zeros(capacity * row, precision, &Device::Cpu).unwrap();
            let (mut kr, mut vr) = (ring(), ring());
            let from = tokens - capacity;
            let at = Positions::new((from..tokens).collect(), &Device::Cpu).unwrap();
            let kt = Tensor::new(vec![capacity, row], k[from * row..].to_vec());
            let vt = Tensor::new(vec![capacity, row], v[from * row..].to_vec());
            ops::kv_write((&mut kr, &mut vr), &kt, &vt, kv_heads, d, capacity, &at).unwrap();
            (kr, vr)
        };
        let half = fill(KvPrecision::F16, &keys, &values);
        let exact = fill(KvPrecision::F32, &rounded(&keys), &rounded(&values));
        assert_eq!(half.0.to_vec().unwrap(), exact.0.to_vec().unwrap());
        assert_eq!(half.0.size_in_bytes() * 2, exact.0.size_in_bytes());
        let q = Tensor::new(vec![1, heads * d], awkward(heads * d, 2.5));
        let at = Positions::new(vec![tokens - 1], &Device::Cpu).unwrap();
        for window in [None, Some(5)] {
            let attend = |(k, v): &(KvBuffer, KvBuffer)| {
                let kv = Kv {
                    keys: k,
                    values: v,
                    kv_heads,
                    capacity,
                    start: tokens - capacity,
                    end: tokens,
                    window,
                };
                ops::attention(&q, heads, d, &at, &kv, 0.25)
                    .unwrap()
                    .into_data()
            };
            assert_eq!(attend(&half), attend(&exact), "window {window:?}");
        }
        let widened = half.0.clone().into_precision(KvPrecision::F32);
        assert_eq!(widened.precision(), KvPrecision::F32);
        assert_eq!(widened.to_vec().unwrap(), exact.0.to_vec().unwrap());
        let mut moved =
            KvBuffer::zeros(2 * capacity * row, KvPrecision::F16, &Device::Cpu).unwrap();
        ops::kv_move(
            &half.0,
            capacity,
            &mut moved,
            2 * capacity,
            kv_heads,
            d,
            3..tokens,
        )
        .unwrap();
        let err = ops::kv_move(
            &exact.0,
            capacity,
            &mut moved,
            2 * capacity,
            kv_heads,
            d,
            3..tokens,
        );
        assert!(err.is_err(), "rings of two precisions");
    }
}
