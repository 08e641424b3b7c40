//! Storage for cached keys and values. Activations are f32 everywhere, but a long context's
//! cache is what decoding reads most of after the weights, so it is kept in f16 by default:
//! half the bytes per position, as llama.cpp's cache and mlx-lm's (in an f16 model's dtype)
//! keep it; or, asked, in f32, or as 4- or 8-bit affine codes (mlx-lm's `--kv-bits`), an eighth
//! or a quarter of f32's, which attention reads as they are on either device.

use std::borrow::Cow;

use half::f16;

use crate::cpu::attention::{self, KvElem, KvRows, QuantRows};
use crate::cuda::DeviceRing;
use crate::{Device, EngineError};

/// Bits and group size of a quantized cache, as mlx-lm's `kv_bits` and `kv_group_size`: each
/// group of a head's features keeps an f32 scale and bias.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct KvQuant {
    /// 4 or 8.
    pub bits: u8,
    /// 32, 64 or 128 features.
    pub group: usize,
}

impl KvQuant {
    /// mlx-lm's `--kv-bits 8` at its default group size, which the AVX-512 kernels read as
    /// integers.
    pub const Q8: KvQuant = KvQuant { bits: 8, group: 64 };

    /// The bits and group sizes `mx.quantize` takes that a cache is kept in.
    pub fn new(bits: u8, group: usize) -> Result<KvQuant, EngineError> {
        if !matches!(bits, 4 | 8) || !matches!(group, 32 | 64 | 128) {
            return Err(EngineError::UnsupportedQuantization(format!(
                "a KV cache of {bits} bits in groups of {group}: the cache takes 4 or 8 bits in \
                 groups of 32, 64 or 128"
            )));
        }
        Ok(KvQuant { bits, group })
    }

    /// Bytes of codes of `elements` (whole bytes: an even count at 4 bits).
    pub fn row_bytes(&self, elements: usize) -> usize {
        elements * usize::from(self.bits) / 8
    }

    /// The largest code.
    pub fn levels(&self) -> f32 {
        ((1u32 << self.bits) - 1) as f32
    }

    /// Bytes `elements` take: codes, and a scale and bias per group.
    pub fn bytes_for(&self, elements: usize) -> usize {
        self.row_bytes(elements) + elements.div_ceil(self.group) * 8
    }
}

/// The element type of a cache's rings.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KvPrecision {
    /// f32: exactly the keys and values the layer computed.
    F32,
    /// f16: rounded once when written, read at half the bytes. The default, on the host and on
    /// a GPU: attention streams the cache from memory.
    #[default]
    F16,
    /// Affine codes as mlx-lm's quantized cache keeps them (`mx.quantize` of each group of a
    /// head's features; a GPU quantizes as the host does, to the same codes). Head dims must be
    /// multiples of the group size.
    Quantized(KvQuant),
}

impl KvPrecision {
    /// 8-bit codes in groups of 64 (mlx-lm's `--kv-bits 8`).
    pub const Q8: KvPrecision = KvPrecision::Quantized(KvQuant::Q8);
}

pub(crate) enum RingStorage {
    HostF32(Vec<f32>),
    HostF16(Vec<f16>),
    HostQuant(QuantRing),
    Cuda(DeviceRing),
}

/// Codes and the per-group scales and biases of a quantized ring (see [`QuantRows`]).
#[derive(Clone)]
pub struct QuantRing {
    pub(crate) quant: KvQuant,
    pub(crate) codes: Vec<u8>,
    pub(crate) scales: Vec<f32>,
    pub(crate) biases: Vec<f32>,
}

impl QuantRing {
    fn zeros(len: usize, quant: KvQuant) -> QuantRing {
        let groups = len.div_ceil(quant.group);
        QuantRing {
            quant,
            codes: vec![0; quant.row_bytes(len)],
            scales: vec![0.0; groups],
            biases: vec![0.0; groups],
        }
    }

    /// `values` quantized, whole groups of them; `None` if they are not.
    pub fn quantized(values: &[f32], quant: KvQuant) -> Option<QuantRing> {
        if !values.len().is_multiple_of(quant.group) {
            return None;
        }
        let mut ring = QuantRing::zeros(values.len(), quant);
        attention::quantize(
            quant,
            values,
            &mut ring.codes,
            &mut ring.scales,
            &mut ring.biases,
        );
        Some(ring)
    }

    pub fn rows(&self) -> QuantRows<'_> {
        QuantRows {
            quant: self.quant,
            codes: &self.codes,
            scales: &self.scales,
            biases: &self.biases,
        }
    }

    fn len(&self) -> usize {
        self.rows().elements()
    }

    pub(crate) fn to_vec(&self) -> Vec<f32> {
        let mut out = vec![0.0; self.len()];
        attention::dequantize(crate::cpu::Isa::best(), self.rows(), &mut out);
        out
    }
}

/// One ring of a layer's cached keys or values (`[kv_heads, capacity, head_dim]` elements),
/// written and read by the cache ops of [`crate::ops`].
pub struct KvRing {
    pub(crate) storage: RingStorage,
}

impl KvRing {
    /// Whether the ring can hold heads of `head_dim` elements: a quantized ring's groups
    /// must not straddle two heads.
    pub fn check_head_dim(&self, head_dim: usize) -> Result<(), EngineError> {
        match self.precision() {
            KvPrecision::Quantized(quant) => check_quantized_head_dim(quant, head_dim),
            _ => Ok(()),
        }
    }

    /// `len` zeros on `device`. A quantized ring holds whole groups (rows of heads of a multiple
    /// of the group size).
    pub fn zeros(
        len: usize,
        precision: KvPrecision,
        device: &Device,
    ) -> Result<KvRing, EngineError> {
        let storage = match (device, precision) {
            (Device::Cpu, KvPrecision::F32) => RingStorage::HostF32(vec![0.0; len]),
            (Device::Cpu, KvPrecision::F16) => RingStorage::HostF16(vec![f16::ZERO; len]),
            (Device::Cpu, KvPrecision::Quantized(quant)) => {
                RingStorage::HostQuant(QuantRing::zeros(len, quant))
            }
            (Device::Cuda(gpu), precision) => {
                RingStorage::Cuda(DeviceRing::zeros(gpu, len, precision)?)
            }
        };
        Ok(KvRing { storage })
    }

    /// Elements held.
    pub fn len(&self) -> usize {
        match &self.storage {
            RingStorage::HostF32(v) => v.len(),
            RingStorage::HostF16(v) => v.len(),
            RingStorage::HostQuant(q) => q.len(),
            RingStorage::Cuda(b) => b.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn precision(&self) -> KvPrecision {
        match &self.storage {
            RingStorage::HostF16(_) => KvPrecision::F16,
            RingStorage::HostQuant(q) => KvPrecision::Quantized(q.quant),
            RingStorage::Cuda(r) => r.precision(),
            RingStorage::HostF32(_) => KvPrecision::F32,
        }
    }

    pub fn device(&self) -> Device {
        match &self.storage {
            RingStorage::HostF32(_) | RingStorage::HostF16(_) | RingStorage::HostQuant(_) => {
                Device::Cpu
            }
            RingStorage::Cuda(b) => Device::Cuda(b.gpu().clone()),
        }
    }

    /// A quantized ring's codes, scales and biases on the host (copied from a GPU); `None` for
    /// a ring of elements.
    pub fn host_codes(&self) -> Result<Option<Cow<'_, QuantRing>>, EngineError> {
        Ok(match &self.storage {
            RingStorage::HostQuant(q) => Some(Cow::Borrowed(q)),
            RingStorage::Cuda(r) => r.download_codes()?.map(Cow::Owned),
            _ => None,
        })
    }

    /// This ring on `device`, in its precision: codes go between the host and a GPU as they
    /// are, elements through f32; a ring already there stays as it is.
    pub fn to_device(self, device: &Device) -> Result<KvRing, EngineError> {
        let precision = self.precision();
        let storage = match (self.storage, device) {
            (RingStorage::Cuda(r), Device::Cuda(gpu)) if r.gpu().same(gpu) => RingStorage::Cuda(r),
            (RingStorage::Cuda(r), Device::Cpu) => match r.download_codes()? {
                Some(codes) => RingStorage::HostQuant(codes),
                None => {
                    let values = RingStorage::HostF32(r.download()?);
                    return KvRing { storage: values }.into_precision(precision);
                }
            },
            (host, Device::Cpu) => host,
            (RingStorage::HostQuant(q), Device::Cuda(gpu)) => {
                RingStorage::Cuda(DeviceRing::upload_codes(gpu, q.rows())?)
            }
            (storage, Device::Cuda(gpu)) => {
                let values = KvRing { storage }.to_vec()?;
                RingStorage::Cuda(DeviceRing::upload(gpu, &values, precision)?)
            }
        };
        Ok(KvRing { storage })
    }

    /// A host ring of these codes (`scales` and `biases` one per group of `codes`), as
    /// [`host_codes`](Self::host_codes) gives them.
    pub fn from_codes(
        quant: KvQuant,
        codes: Vec<u8>,
        scales: Vec<f32>,
        biases: Vec<f32>,
    ) -> Result<KvRing, EngineError> {
        let len = scales.len() * quant.group;
        if codes.len() != quant.row_bytes(len) || biases.len() != scales.len() {
            return Err(EngineError::Shape(format!(
                "{} bytes of {}-bit codes with {} scales and {} biases in groups of {}",
                codes.len(),
                quant.bits,
                scales.len(),
                biases.len(),
                quant.group
            )));
        }
        let ring = QuantRing {
            quant,
            codes,
            scales,
            biases,
        };
        Ok(KvRing {
            storage: RingStorage::HostQuant(ring),
        })
    }

    /// Bytes a ring of `len` elements of this one's precision, on its device, holds: what
    /// [`size_in_bytes`](Self::size_in_bytes) will say once it has grown to `len`.
    pub fn bytes_for(&self, len: usize) -> usize {
        match &self.storage {
            RingStorage::HostF32(_) => len * 4,
            RingStorage::HostF16(_) => len * 2,
            RingStorage::HostQuant(q) => q.quant.bytes_for(len),
            RingStorage::Cuda(r) => DeviceRing::bytes_for(len, r.precision()),
        }
    }

    /// Bytes of host or device memory held.
    pub fn size_in_bytes(&self) -> usize {
        match &self.storage {
            RingStorage::HostF32(v) => v.len() * 4,
            RingStorage::HostF16(v) => v.len() * 2,
            RingStorage::HostQuant(q) => q.codes.len() + (q.scales.len() + q.biases.len()) * 4,
            RingStorage::Cuda(r) => r.size_in_bytes(),
        }
    }

    /// The elements as f32, copied from the device if need be.
    pub fn to_vec(&self) -> Result<Vec<f32>, EngineError> {
        match &self.storage {
            RingStorage::HostF32(v) => Ok(v.clone()),
            RingStorage::HostF16(v) => Ok(v.iter().map(|x| x.to_f32()).collect()),
            RingStorage::HostQuant(q) => Ok(q.to_vec()),
            RingStorage::Cuda(b) => b.download(),
        }
    }

    /// These elements in `precision`: rounded to f16, quantized or widened to f32 (through f32
    /// where both ends are narrower). A ring of elements that are not whole groups stays f32
    /// where codes are asked. Fails only when a GPU runs out of memory for the new ring.
    pub fn into_precision(self, precision: KvPrecision) -> Result<KvRing, EngineError> {
        if self.precision() == precision {
            return Ok(self);
        }
        let values = match self.storage {
            RingStorage::HostF32(v) => v,
            RingStorage::HostF16(v) => v.into_iter().map(f16::to_f32).collect(),
            RingStorage::HostQuant(q) => q.to_vec(),
            RingStorage::Cuda(ring) => {
                let values = ring.download()?;
                let precision = match precision {
                    KvPrecision::Quantized(q) if !values.len().is_multiple_of(q.group) => {
                        KvPrecision::F32
                    }
                    precision => precision,
                };
                let converted = DeviceRing::upload(ring.gpu(), &values, precision)?;
                return Ok(KvRing {
                    storage: RingStorage::Cuda(converted),
                });
            }
        };
        let storage = match precision {
            KvPrecision::F16 => {
                RingStorage::HostF16(values.into_iter().map(KvElem::from_f32).collect())
            }
            KvPrecision::Quantized(quant) => match QuantRing::quantized(&values, quant) {
                Some(q) => RingStorage::HostQuant(q),
                None => RingStorage::HostF32(values),
            },
            KvPrecision::F32 => RingStorage::HostF32(values),
        };
        Ok(KvRing { storage })
    }

    /// A copy on the same device; on a GPU it fails if device memory runs out.
    pub fn try_clone(&self) -> Result<KvRing, EngineError> {
        let storage = match &self.storage {
            RingStorage::HostF32(v) => RingStorage::HostF32(v.clone()),
            RingStorage::HostF16(v) => RingStorage::HostF16(v.clone()),
            RingStorage::HostQuant(q) => RingStorage::HostQuant(q.clone()),
            RingStorage::Cuda(b) => RingStorage::Cuda(b.try_clone()?),
        };
        Ok(KvRing { storage })
    }
}

/// Refuses heads of `head_dim` that `quant`'s groups would straddle.
pub fn check_quantized_head_dim(quant: KvQuant, head_dim: usize) -> Result<(), EngineError> {
    if head_dim.is_multiple_of(quant.group) {
        return Ok(());
    }
    Err(EngineError::UnsupportedQuantization(format!(
        "a KV cache of {} bits in groups of {} needs head dims that are multiples of {}; this \
         model's are {head_dim} (use another --kv-group-size, or no --kv-bits)",
        quant.bits, quant.group, quant.group
    )))
}

/// Clones on a GPU copy device memory; use [`KvRing::try_clone`] where running out of it
/// must be an error rather than a panic.
impl Clone for KvRing {
    fn clone(&self) -> Self {
        self.try_clone().expect("copying a cache on its device")
    }
}

impl std::fmt::Debug for KvRing {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        let (n, p, d) = (self.len(), self.precision(), self.device());
        write!(f, "KvRing({n} × {p:?} on {d:?})")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::{self, KvView};
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
            let ring = || KvRing::zeros(capacity * row, precision, &Device::Cpu).unwrap();
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
            let attend = |(k, v): &(KvRing, KvRing)| {
                let kv = KvView {
                    keys: k,
                    values: v,
                    kv_heads,
                    capacity,
                    start: tokens - capacity,
                    end: tokens,
                    window,
                };
                ops::attention(&q, heads, d, &at, &kv, ops::AttentionOptions::scaled(0.25))
                    .unwrap()
                    .into_data()
            };
            assert_eq!(attend(&half), attend(&exact), "window {window:?}");
        }
        let widened = half.0.clone().into_precision(KvPrecision::F32).unwrap();
        assert_eq!(widened.precision(), KvPrecision::F32);
        assert_eq!(widened.to_vec().unwrap(), exact.0.to_vec().unwrap());
        let mut moved = KvRing::zeros(2 * capacity * row, KvPrecision::F16, &Device::Cpu).unwrap();
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
    /// A quantized ring (8 and 4 bits, groups of 32 to 128) reads back as `mx.quantize`'s codes
    /// of what was written, within one and a half steps of each group (half a step of rounding,
    /// and at the far end from the edge up to one more where MLX's nudge of the scale shrinks
    /// the range); attention over it is attention over an f32 ring of those values (within 1e-4
    /// of the largest output, where the integer kernels round queries and weights to int16); it
    /// moves into a larger ring whole, quantizes a ring of whole groups handed to it, and
    /// refuses heads of other than whole groups.
    #[test]
    fn a_quantized_ring_is_an_f32_ring_of_dequantized_values() {
        let quants = [(8, 64), (4, 64), (4, 32), (8, 128), (4, 128)];
        for quant in quants.map(|(bits, group)| KvQuant::new(bits, group).unwrap()) {
            a_ring_of_codes_is_an_f32_ring_of_dequantized_values(quant);
        }
        let (kv_heads, capacity, small) = (2, 8, 16);
        let ring = || KvRing::zeros(capacity * kv_heads * small, KvPrecision::Q8, &Device::Cpu);
        let (mut kr, mut vr) = (ring().unwrap(), ring().unwrap());
        let one = Tensor::new(vec![1, kv_heads * small], vec![0.5; kv_heads * small]);
        let first = Positions::new(vec![0], &Device::Cpu).unwrap();
        let err = ops::kv_write(
            (&mut kr, &mut vr),
            &one,
            &one,
            kv_heads,
            small,
            capacity,
            &first,
        );
        assert!(
            matches!(&err, Err(EngineError::UnsupportedQuantization(m)) if m.contains("multiples of 64")),
            "{err:?}"
        );
        assert!(KvQuant::new(3, 64).is_err() && KvQuant::new(4, 16).is_err());
    }

    fn a_ring_of_codes_is_an_f32_ring_of_dequantized_values(quant: KvQuant) {
        let precision = KvPrecision::Quantized(quant);
        let (kv_heads, d, capacity, heads) = (2, 128, 8, 4);
        let row = kv_heads * d;
        let tokens = 11; // wraps the ring of 8
        let (keys, values) = (awkward(tokens * row, 0.5), awkward(tokens * row, 1.5));
        let from = tokens - capacity;
        let at = Positions::new((from..tokens).collect(), &Device::Cpu).unwrap();
        let fill = |precision, k: &[f32], v: &[f32]| {
            let ring = || KvRing::zeros(capacity * row, precision, &Device::Cpu).unwrap();
            let (mut kr, mut vr) = (ring(), ring());
            let kt = Tensor::new(vec![capacity, row], k[k.len() - capacity * row..].to_vec());
            let vt = Tensor::new(vec![capacity, row], v[v.len() - capacity * row..].to_vec());
            ops::kv_write((&mut kr, &mut vr), &kt, &vt, kv_heads, d, capacity, &at).unwrap();
            (kr, vr)
        };
        let (kq, vq) = fill(precision, &keys, &values);
        let held = (kq.to_vec().unwrap(), vq.to_vec().unwrap());
        let written = fill(KvPrecision::F32, &keys, &values);
        let written = (written.0.to_vec().unwrap(), written.1.to_vec().unwrap());
        // Within `steps` of each group's step of what was written.
        let near = |q: &[f32], x: &[f32], steps: f32| {
            for (group, (a, b)) in q.chunks(quant.group).zip(x.chunks(quant.group)).enumerate() {
                let (lo, hi) = b
                    .iter()
                    .fold((f32::MAX, f32::MIN), |(l, h), &v| (l.min(v), h.max(v)));
                let step = (hi - lo) / quant.levels();
                let worst = a
                    .iter()
                    .zip(b)
                    .fold(0.0f32, |m, (p, q)| m.max((p - q).abs()));
                assert!(
                    worst <= steps * step,
                    "{quant:?} group {group}: {worst} of a step of {step}"
                );
            }
        };
        near(&held.0, &written.0, 1.5);
        near(&held.1, &written.1, 1.5);
        let exact = (
            KvRing {
                storage: RingStorage::HostF32(held.0.clone()),
            },
            KvRing {
                storage: RingStorage::HostF32(held.1.clone()),
            },
        );
        assert_eq!(
            kq.size_in_bytes(),
            capacity * row * usize::from(quant.bits) / 8 + 2 * 4 * capacity * row / quant.group
        );
        assert_eq!(kq.size_in_bytes(), kq.bytes_for(capacity * row));
        // Every held position's query, as a prompt attends.
        let q = Tensor::new(
            vec![capacity, heads * d],
            awkward(capacity * heads * d, 2.5),
        );
        let last = Positions::new((from..tokens).collect(), &Device::Cpu).unwrap();
        for window in [None, Some(5)] {
            let attend = |(k, v): (&KvRing, &KvRing)| {
                let kv = KvView {
                    keys: k,
                    values: v,
                    kv_heads,
                    capacity,
                    start: from,
                    end: tokens,
                    window,
                };
                ops::attention(
                    &q,
                    heads,
                    d,
                    &last,
                    &kv,
                    ops::AttentionOptions::scaled(0.25),
                )
                .unwrap()
                .into_data()
            };
            let (got, want) = (attend((&kq, &vq)), attend((&exact.0, &exact.1)));
            let top = want.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert!(
                    (g - w).abs() <= 1e-4 * top,
                    "{quant:?} window {window:?} output {i}: {g} vs {w}"
                );
            }
        }
        let mut moved = KvRing::zeros(2 * capacity * row, precision, &Device::Cpu).unwrap();
        ops::kv_move(
            &kq,
            capacity,
            &mut moved,
            2 * capacity,
            kv_heads,
            d,
            from..tokens,
        )
        .unwrap();
        let mut expected =
            KvRing::zeros(2 * capacity * row, KvPrecision::F32, &Device::Cpu).unwrap();
        ops::kv_move(
            &exact.0,
            capacity,
            &mut expected,
            2 * capacity,
            kv_heads,
            d,
            from..tokens,
        )
        .unwrap();
        assert_eq!(moved.to_vec().unwrap(), expected.to_vec().unwrap());
        let requantized = exact.0.clone().into_precision(precision).unwrap();
        assert_eq!(requantized.precision(), precision);
        near(&requantized.to_vec().unwrap(), &held.0, 1.5);
    }

    /// A batch's attention (one query token for each sequence, over its own ring) gives each
    /// sequence what it gets alone, bit for bit, over rings of each precision: sequences of
    /// other lengths and ring sizes, one ring wrapped, with full attention and a sliding window.
    #[test]
    fn a_batch_attends_as_each_sequence_alone_in_every_precision() {
        let (kv_heads, d, heads) = (2, 64, 8);
        let row = kv_heads * d;
        let batches = [
            (None, [(256, 200), (64, 1), (512, 300)]),
            (Some(16), [(16, 40), (32, 5), (16, 16)]),
        ];
        let quantized =
            [(8, 64), (4, 32)].map(|(b, g)| KvPrecision::Quantized(KvQuant::new(b, g).unwrap()));
        for precision in [KvPrecision::F32, KvPrecision::F16]
            .into_iter()
            .chain(quantized)
        {
            for (b, (window, sequences)) in batches.iter().enumerate() {
                let rings: Vec<(KvRing, KvRing)> = sequences
                    .iter()
                    .enumerate()
                    .map(|(i, &(capacity, len))| {
                        let ring = || KvRing::zeros(capacity * row, precision, &Device::Cpu);
                        let (mut kr, mut vr) = (ring().unwrap(), ring().unwrap());
                        // The ring keeps the last `capacity` positions.
                        let held = len.min(capacity);
                        let at = Positions::new((len - held..len).collect(), &Device::Cpu);
                        let seed = (10 * b + i) as f32;
                        let kt = Tensor::new(vec![held, row], awkward(held * row, seed));
                        let vt = Tensor::new(vec![held, row], awkward(held * row, seed + 0.5));
                        let rings = (&mut kr, &mut vr);
                        ops::kv_write(rings, &kt, &vt, kv_heads, d, capacity, &at.unwrap())
                            .unwrap();
                        (kr, vr)
                    })
                    .collect();
                let views: Vec<KvView> = rings
                    .iter()
                    .zip(sequences)
                    .map(|((k, v), &(capacity, len))| KvView {
                        keys: k,
                        values: v,
                        kv_heads,
                        capacity,
                        start: len - len.min(capacity),
                        end: len,
                        window: *window,
                    })
                    .collect();
                let n = sequences.len();
                let q = Tensor::new(vec![n, heads * d], awkward(n * heads * d, 7.5));
                let last: Vec<usize> = sequences.iter().map(|&(_, len)| len - 1).collect();
                let at = Positions::new(last.clone(), &Device::Cpu).unwrap();
                let batch = ops::attention_batch(
                    &q,
                    heads,
                    d,
                    &at,
                    &views,
                    ops::AttentionOptions::scaled(0.125),
                )
                .unwrap();
                for (i, kv) in views.iter().enumerate() {
                    let one = Positions::new(vec![last[i]], &Device::Cpu).unwrap();
                    let q = ops::rows(&q, i, 1).unwrap();
                    let alone = ops::attention(
                        &q,
                        heads,
                        d,
                        &one,
                        kv,
                        ops::AttentionOptions::scaled(0.125),
                    )
                    .unwrap();
                    assert_eq!(
                        ops::rows(&batch, i, 1).unwrap().data(),
                        alone.data(),
                        "{precision:?}, window {window:?}: sequence {i}"
                    );
                }
            }
        }
    }
}
