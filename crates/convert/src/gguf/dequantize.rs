//! ggml's tensor types to f32, and Q4_0/Q4_1/Q8_0 to MLX's affine quantization without loss.
//!
//! [`dequantize`] is bit-exact with gguf-py's `gguf.quants.dequantize`, which follows ggml's
//! reference `dequantize_row_*`: every value is computed with the same f32 operations in the same
//! order (Rust never fuses a multiply and an add on its own), so a converted checkpoint matches
//! one that `scripts/models/gguf_to_hf.py` writes byte for byte.
//!
//! All the block layouts are little-endian; `f16` is an IEEE half. In the layouts below a block
//! of `QK` elements is listed field by field, and "element `e`" is the `e`-th value of the block
//! in row order.

use half::f16;

use super::{GgmlType, GgufError, TensorInfo};

/// Elements per block of the simple quantizations (Q4_0 … Q8_0).
const QK: usize = 32;
/// Elements per super-block of the k-quantizations (Q2_K … Q6_K).
const QK_K: usize = 256;

/// `d: f16, qs: [u8; 16]`: element `e < 16` is the low nibble of `qs[e]`, element `e + 16` its
/// high nibble; value = (q − 8)·d.
const Q4_0_BYTES: usize = 2 + QK / 2;
/// `d: f16, m: f16, qs: [u8; 16]` (nibbles as Q4_0); value = q·d + m.
const Q4_1_BYTES: usize = 4 + QK / 2;
/// `d: f16, qh: u32, qs: [u8; 16]`: the low 4 bits as Q4_0, bit 4 of element `e` is bit `e` of
/// `qh`; value = (q − 16)·d.
const Q5_0_BYTES: usize = 2 + 4 + QK / 2;
/// `d: f16, m: f16, qh: u32, qs: [u8; 16]` (bits as Q5_0); value = q·d + m.
const Q5_1_BYTES: usize = 4 + 4 + QK / 2;
/// `d: f16, qs: [i8; 32]`; value = q·d.
const Q8_0_BYTES: usize = 2 + QK;
/// `scales: [u8; 16], qs: [u8; 64], d: f16, dmin: f16`: 16 sub-blocks of 16, each with a 4-bit
/// scale (low nibble) and min (high nibble); 2-bit quants, see [`q2_k`].
const Q2_K_BYTES: usize = QK_K / 16 + QK_K / 4 + 4;
/// `hmask: [u8; 32], qs: [u8; 64], scales: [u8; 12], d: f16`: 16 sub-blocks of 16 with 6-bit
/// signed scales; 3-bit quants, see [`q3_k`].
const Q3_K_BYTES: usize = QK_K / 8 + QK_K / 4 + 12 + 2;
/// `d: f16, dmin: f16, scales: [u8; 12], qs: [u8; 128]`: 8 sub-blocks of 32 with 6-bit scales
/// and mins ([`k_scale_min`]); 4-bit quants, see [`q4_k`].
const Q4_K_BYTES: usize = 4 + K_SCALE_BYTES + QK_K / 2;
/// `d: f16, dmin: f16, scales: [u8; 12], qh: [u8; 32], qs: [u8; 128]`: Q4_K plus a fifth bit.
const Q5_K_BYTES: usize = 4 + K_SCALE_BYTES + QK_K / 8 + QK_K / 2;
/// `ql: [u8; 128], qh: [u8; 64], scales: [i8; 16], d: f16`: 16 sub-blocks of 16 with 8-bit
/// scales; 6-bit quants, see [`q6_k`].
const Q6_K_BYTES: usize = QK_K / 2 + QK_K / 4 + QK_K / 16 + 2;
/// The packed 6-bit scales and mins of Q4_K and Q5_K.
const K_SCALE_BYTES: usize = 12;

/// The tensor's values as f32, row-major in `tensor.shape`. `data` is its bytes in the file
/// ([`super::GgufFile::tensor_data`]); bytes that are not exactly the tensor's whole blocks are
/// an error rather than a short or padded result.
pub fn dequantize(tensor: &TensorInfo, data: &[u8]) -> Result<Vec<f32>, GgufError> {
    check_len(tensor, data)?;
    let mut out = vec![0f32; tensor.elements()];
    match tensor.ggml_type {
        GgmlType::F32 => {
            for (y, x) in out.iter_mut().zip(data.as_chunks::<4>().0) {
                *y = f32::from_le_bytes(*x);
            }
        }
        GgmlType::F16 => {
            for (y, x) in out.iter_mut().zip(data.as_chunks::<2>().0) {
                *y = half(*x);
            }
        }
        GgmlType::BF16 => {
            // bf16 is the top half of an f32.
            for (y, x) in out.iter_mut().zip(data.as_chunks::<2>().0) {
                *y = f32::from_bits(u32::from(u16::from_le_bytes(*x)) << 16);
            }
        }
        GgmlType::Q4_0 => blocks(data, &mut out, q4_0),
        GgmlType::Q4_1 => blocks(data, &mut out, q4_1),
        GgmlType::Q5_0 => blocks(data, &mut out, q5_0),
        GgmlType::Q5_1 => blocks(data, &mut out, q5_1),
        GgmlType::Q8_0 => blocks(data, &mut out, q8_0),
        GgmlType::Q2K => blocks(data, &mut out, q2_k),
        GgmlType::Q3K => blocks(data, &mut out, q3_k),
        GgmlType::Q4K => blocks(data, &mut out, q4_k),
        GgmlType::Q5K => blocks(data, &mut out, q5_k),
        GgmlType::Q6K => blocks(data, &mut out, q6_k),
    }
    Ok(out)
}

/// Checks that `data` is exactly `tensor`'s whole blocks: a row that ends inside a block, or
/// bytes of another length, would shift every later value.
fn check_len(tensor: &TensorInfo, data: &[u8]) -> Result<(), GgufError> {
    let (per_block, block_bytes) = tensor.ggml_type.block();
    let error = |reason: String| GgufError::TensorData {
        name: tensor.name.clone(),
        reason,
    };
    if !tensor.row_len().is_multiple_of(per_block) {
        return Err(error(format!(
            "its rows of {} elements are not whole {} blocks of {per_block}",
            tensor.row_len(),
            tensor.ggml_type.name()
        )));
    }
    let expected = tensor.elements() / per_block * block_bytes;
    if data.len() != expected {
        return Err(error(format!(
            "{} bytes of {} data for shape {:?}, which needs {expected}",
            data.len(),
            tensor.ggml_type.name(),
            tensor.shape
        )));
    }
    Ok(())
}

/// Runs `block` over each block of `data` and its `N` values in `out`.
fn blocks<const BYTES: usize, const N: usize>(
    data: &[u8],
    out: &mut [f32],
    block: fn(&[u8; BYTES], &mut [f32; N]),
) {
    for (x, y) in data
        .as_chunks::<BYTES>()
        .0
        .iter()
        .zip(out.as_chunks_mut::<N>().0)
    {
        block(x, y);
    }
}

fn half(bytes: [u8; 2]) -> f32 {
    f16::from_bits(u16::from_le_bytes(bytes)).to_f32()
}

/// The f16 at `at`.
fn f16_at(x: &[u8], at: usize) -> f32 {
    half([x[at], x[at + 1]])
}

/// The 4-bit quant of element `e` of a 32-element block whose nibbles start at `qs`.
fn nibble(qs: &[u8], e: usize) -> u8 {
    if e < QK / 2 {
        qs[e] & 0x0F
    } else {
        qs[e - QK / 2] >> 4
    }
}

fn q4_0(x: &[u8; Q4_0_BYTES], y: &mut [f32; QK]) {
    let d = f16_at(x, 0);
    let qs = &x[2..];
    for (e, y) in y.iter_mut().enumerate() {
        *y = d * f32::from(nibble(qs, e) as i8 - 8);
    }
}

fn q4_1(x: &[u8; Q4_1_BYTES], y: &mut [f32; QK]) {
    let (d, m) = (f16_at(x, 0), f16_at(x, 2));
    let qs = &x[4..];
    for (e, y) in y.iter_mut().enumerate() {
        *y = d * f32::from(nibble(qs, e)) + m;
    }
}

/// The 5-bit quant of element `e`: its nibble and bit `e` of `qh`.
fn five_bits(qh: u32, qs: &[u8], e: usize) -> u8 {
    nibble(qs, e) | (((qh >> e) & 1) as u8) << 4
}

fn q5_0(x: &[u8; Q5_0_BYTES], y: &mut [f32; QK]) {
    let d = f16_at(x, 0);
    let qh = u32::from_le_bytes([x[2], x[3], x[4], x[5]]);
    let qs = &x[6..];
    for (e, y) in y.iter_mut().enumerate() {
        *y = d * f32::from(five_bits(qh, qs, e) as i8 - 16);
    }
}

fn q5_1(x: &[u8; Q5_1_BYTES], y: &mut [f32; QK]) {
    let (d, m) = (f16_at(x, 0), f16_at(x, 2));
    let qh = u32::from_le_bytes([x[4], x[5], x[6], x[7]]);
    let qs = &x[8..];
    for (e, y) in y.iter_mut().enumerate() {
        *y = d * f32::from(five_bits(qh, qs, e)) + m;
    }
}

fn q8_0(x: &[u8; Q8_0_BYTES], y: &mut [f32; QK]) {
    let d = f16_at(x, 0);
    for (y, &q) in y.iter_mut().zip(&x[2..]) {
        *y = f32::from(q as i8) * d;
    }
}

/// Element `e = 128h + 32s + l` (h < 2, s < 4, l < 32) is bits `2s..2s+2` of `qs[32h + l]`, in
/// sub-block `e / 16`, whose byte in `scales` holds a 4-bit scale (low) and min (high);
/// value = (d·scale)·q − dmin·min.
fn q2_k(x: &[u8; Q2_K_BYTES], y: &mut [f32; QK_K]) {
    let (scales, qs) = (&x[..16], &x[16..80]);
    let (d, dmin) = (f16_at(x, 80), f16_at(x, 82));
    for (sub, y) in y.as_chunks_mut::<16>().0.iter_mut().enumerate() {
        let dl = d * f32::from(scales[sub] & 0x0F);
        let ml = dmin * f32::from(scales[sub] >> 4);
        // Sub-block `sub` starts at element 16·sub = 128h + 32s + (16·sub mod 32).
        let (h, s, l0) = (sub / 8, (sub / 2) % 4, (sub % 2) * 16);
        for (l, y) in y.iter_mut().enumerate() {
            let q = (qs[32 * h + l0 + l] >> (2 * s)) & 3;
            *y = dl * f32::from(q) - ml;
        }
    }
}

/// Element `e = 128h + 32s + l` has its low 2 bits at bits `2s..2s+2` of `qs[32h + l]`; bit
/// `e / 32` of `hmask[l]` clear subtracts 4. The 16 sub-blocks' 6-bit scales are packed as a
/// nibble (byte `i` low nibble for `i < 8`, byte `i − 8` high nibble after) and a 2-bit high part
/// (bits `2(i / 4)..` of byte `8 + i % 4`), stored plus 32; value = (d·scale)·q.
fn q3_k(x: &[u8; Q3_K_BYTES], y: &mut [f32; QK_K]) {
    let (hmask, qs, packed) = (&x[..32], &x[32..96], &x[96..108]);
    let d = f16_at(x, 108);
    for (sub, y) in y.as_chunks_mut::<16>().0.iter_mut().enumerate() {
        let low = if sub < 8 {
            packed[sub] & 0x0F
        } else {
            packed[sub - 8] >> 4
        };
        let high = (packed[8 + sub % 4] >> (2 * (sub / 4))) & 3;
        let dl = d * f32::from((low | high << 4) as i8 - 32);
        let (h, s, l0) = (sub / 8, (sub / 2) % 4, (sub % 2) * 16);
        let k = sub / 2;
        for (l, y) in y.iter_mut().enumerate() {
            let low_bits = ((qs[32 * h + l0 + l] >> (2 * s)) & 3) as i8;
            let offset = if (hmask[l0 + l] >> k) & 1 == 1 { 0 } else { 4 };
            *y = dl * f32::from(low_bits - offset);
        }
    }
}

/// The 6-bit scale and min of sub-block `j` of Q4_K/Q5_K: for `j < 4` the low 6 bits of bytes
/// `j` and `j + 4`; after, a nibble of byte `j + 4` (scale low, min high) and the top 2 bits of
/// bytes `j − 4` and `j`.
fn k_scale_min(packed: &[u8], j: usize) -> (u8, u8) {
    if j < 4 {
        (packed[j] & 0x3F, packed[j + 4] & 0x3F)
    } else {
        (
            (packed[j + 4] & 0x0F) | ((packed[j - 4] >> 6) << 4),
            (packed[j + 4] >> 4) | ((packed[j] >> 6) << 4),
        )
    }
}

/// Element `e = 64c + 32s + l` (c < 4, s < 2) is nibble `s` of `qs[32c + l]`, in sub-block
/// `e / 32`; value = (d·scale)·q − dmin·min.
fn q4_k(x: &[u8; Q4_K_BYTES], y: &mut [f32; QK_K]) {
    let (d, dmin) = (f16_at(x, 0), f16_at(x, 2));
    let (packed, qs) = (&x[4..16], &x[16..]);
    for (sub, y) in y.as_chunks_mut::<32>().0.iter_mut().enumerate() {
        let (sc, m) = k_scale_min(packed, sub);
        let (dl, ml) = (d * f32::from(sc), dmin * f32::from(m));
        let (c, s) = (sub / 2, sub % 2);
        for (l, y) in y.iter_mut().enumerate() {
            let q = (qs[32 * c + l] >> (4 * s)) & 0x0F;
            *y = dl * f32::from(q) - ml;
        }
    }
}

/// Q4_K's nibbles, plus bit `e / 32` of `qh[l]` as bit 4.
fn q5_k(x: &[u8; Q5_K_BYTES], y: &mut [f32; QK_K]) {
    let (d, dmin) = (f16_at(x, 0), f16_at(x, 2));
    let (packed, qh, qs) = (&x[4..16], &x[16..48], &x[48..]);
    for (sub, y) in y.as_chunks_mut::<32>().0.iter_mut().enumerate() {
        let (sc, m) = k_scale_min(packed, sub);
        let (dl, ml) = (d * f32::from(sc), dmin * f32::from(m));
        let (c, s) = (sub / 2, sub % 2);
        for (l, y) in y.iter_mut().enumerate() {
            let q = ((qs[32 * c + l] >> (4 * s)) & 0x0F) | ((qh[l] >> sub) & 1) << 4;
            *y = dl * f32::from(q) - ml;
        }
    }
}

/// Element `e = 128h + 32k + l` (k < 4) has its low nibble in `ql[64h + 32(k % 2) + l]` (nibble
/// `k / 2`) and its top 2 bits at bits `2k..2k+2` of `qh[32h + l]`, stored plus 32, in sub-block
/// `e / 16`; value = (d·scale)·q.
fn q6_k(x: &[u8; Q6_K_BYTES], y: &mut [f32; QK_K]) {
    let (ql, qh, scales) = (&x[..128], &x[128..192], &x[192..208]);
    let d = f16_at(x, 208);
    for (sub, y) in y.as_chunks_mut::<16>().0.iter_mut().enumerate() {
        let dl = d * f32::from(scales[sub] as i8);
        let (h, k, l0) = (sub / 8, (sub / 2) % 4, (sub % 2) * 16);
        for (l, y) in y.iter_mut().enumerate() {
            let l = l0 + l;
            let low = (ql[64 * h + 32 * (k % 2) + l] >> (4 * (k / 2))) & 0x0F;
            let high = (qh[32 * h + l] >> (2 * k)) & 3;
            *y = dl * f32::from((low | high << 4) as i8 - 32);
        }
    }
}

/// A tensor in MLX's affine quantization with group size [`MLX_GROUP_SIZE`], as `mx.load` gives a
/// GGUF's Q4_0, Q4_1 and Q8_0 tensors: element `j` of a row is bits `j·bits..(j+1)·bits` of the
/// row's little-endian u32 stream, and its value is `scale·q + bias` for its group's scale and
/// bias. Those three types are already affine with groups of 32, so this is exact: no value
/// changes, and MLX's kernels run on the file's own quants.
#[derive(Debug, Clone, PartialEq)]
pub struct MlxAffine {
    pub bits: u32,
    /// `rows × row_len·bits/32` words.
    pub packed: Vec<u32>,
    /// `rows × row_len/32`, one per group.
    pub scales: Vec<f16>,
    pub biases: Vec<f16>,
}

/// The elements that share one scale and bias in [`MlxAffine`].
pub const MLX_GROUP_SIZE: usize = QK;

/// The tensor as MLX's affine quantization, exactly as `mx.load("file.gguf")` returns it
/// (mlx/io/gguf_quants.cpp), for Q4_0, Q4_1 and Q8_0; `None` for the other types, which are not
/// affine with groups of 32 (the k-quantizations scale sub-blocks by a second f16, which an f16
/// scale per group cannot hold exactly).
pub fn to_mlx_affine(tensor: &TensorInfo, data: &[u8]) -> Result<Option<MlxAffine>, GgufError> {
    let (bits, bytes) = match tensor.ggml_type {
        GgmlType::Q4_0 => (4, Q4_0_BYTES),
        GgmlType::Q4_1 => (4, Q4_1_BYTES),
        GgmlType::Q8_0 => (8, Q8_0_BYTES),
        _ => return Ok(None),
    };
    check_len(tensor, data)?;
    let groups = data.len() / bytes;
    let mut out = MlxAffine {
        bits,
        packed: Vec::with_capacity(groups * QK * bits as usize / 32),
        scales: Vec::with_capacity(groups),
        biases: Vec::with_capacity(groups),
    };
    let scale_bits = |x: &[u8], at: usize| f16::from_bits(u16::from_le_bytes([x[at], x[at + 1]]));
    // ggml's offsets become the bias: −8·d for Q4_0, −128·d for Q8_0 (exact in f16 unless it
    // overflows, as in MLX, which also computes it in f16).
    let offset_bias = |d: f16, offset: f32| f16::from_f32(offset * d.to_f32());
    for x in data.chunks_exact(bytes) {
        let d = scale_bits(x, 0);
        out.scales.push(d);
        match tensor.ggml_type {
            GgmlType::Q8_0 => {
                out.biases.push(offset_bias(d, -128.0));
                // q + 128 as a u8: the sign bit flipped.
                let q: [u8; QK] = std::array::from_fn(|e| x[2 + e] ^ 0x80);
                out.packed.extend(words(&q));
            }
            ty => {
                let (bias, qs) = if ty == GgmlType::Q4_0 {
                    (offset_bias(d, -8.0), &x[2..])
                } else {
                    (scale_bits(x, 2), &x[4..])
                };
                out.biases.push(bias);
                let q: [u8; QK / 2] =
                    std::array::from_fn(|k| nibble(qs, 2 * k) | nibble(qs, 2 * k + 1) << 4);
                out.packed.extend(words(&q));
            }
        }
    }
    Ok(Some(out))
}

/// Bytes as little-endian u32 words.
fn words(bytes: &[u8]) -> impl Iterator<Item = u32> + '_ {
    bytes
        .as_chunks::<4>()
        .0
        .iter()
        .map(|w| u32::from_le_bytes(*w))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tensor(shape: &[usize], ggml_type: GgmlType) -> TensorInfo {
        TensorInfo {
            name: "t".into(),
            shape: shape.to_vec(),
            ggml_type,
            offset: 0,
            len: 0,
        }
    }

    #[test]
    fn the_block_layouts_add_up_to_the_readers_sizes() {
        for (ty, bytes) in [
            (GgmlType::Q4_0, Q4_0_BYTES),
            (GgmlType::Q4_1, Q4_1_BYTES),
            (GgmlType::Q5_0, Q5_0_BYTES),
            (GgmlType::Q5_1, Q5_1_BYTES),
            (GgmlType::Q8_0, Q8_0_BYTES),
        ] {
            assert_eq!(ty.block(), (QK, bytes), "{}", ty.name());
        }
        for (ty, bytes) in [
            (GgmlType::Q2K, Q2_K_BYTES),
            (GgmlType::Q3K, Q3_K_BYTES),
            (GgmlType::Q4K, Q4_K_BYTES),
            (GgmlType::Q5K, Q5_K_BYTES),
            (GgmlType::Q6K, Q6_K_BYTES),
        ] {
            assert_eq!(ty.block(), (QK_K, bytes), "{}", ty.name());
        }
    }

    #[test]
    fn a_q8_0_block_by_hand() {
        let mut block = vec![0u8; Q8_0_BYTES];
        block[..2].copy_from_slice(&f16::from_f32(0.5).to_bits().to_le_bytes());
        block[2] = 4;
        block[3] = (-6i8) as u8;
        block[33] = 127;
        let t = tensor(&[32], GgmlType::Q8_0);
        let y = dequantize(&t, &block).unwrap();
        assert_eq!((y[0], y[1], y[2], y[31]), (2.0, -3.0, 0.0, 63.5));
        let affine = to_mlx_affine(&t, &block).unwrap().unwrap();
        assert_eq!(affine.bits, 8);
        assert_eq!(affine.packed[0], u32::from_le_bytes([132, 122, 128, 128]));
        assert_eq!(affine.scales, [f16::from_f32(0.5)]);
        assert_eq!(affine.biases, [f16::from_f32(-64.0)]);
    }

    #[test]
    fn data_that_is_not_the_tensors_whole_blocks_is_an_error() {
        let err = dequantize(&tensor(&[2, 48], GgmlType::Q4_0), &[0; 108])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("rows of 48 elements are not whole Q4_0 blocks of 32"),
            "{err}"
        );
        let err = dequantize(&tensor(&[2, 32], GgmlType::Q4_0), &[0; 35])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("35 bytes of Q4_0 data for shape [2, 32], which needs 36"),
            "{err}"
        );
        let err = to_mlx_affine(&tensor(&[256], GgmlType::Q8_0), &[0; 34])
            .unwrap_err()
            .to_string();
        assert!(err.contains("which needs 272"), "{err}");
        assert_eq!(
            to_mlx_affine(&tensor(&[256], GgmlType::Q4K), &[0; 144]).unwrap(),
            None
        );
    }
}
