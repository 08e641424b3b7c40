//! Each output array computed from its origin, a block of rows at a time: cast, quantized as
//! `mx.quantize` quantizes, or dequantized as `mx.dequantize` does.

use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::Arc;

use oxlm_engine::quant::{quantize, quantize_float, QuantMode};
use oxlm_engine::{Bytes, DType, EngineError, QuantizedMatrix};
use oxlm_models::checkpoint::QuantSpec;
use oxlm_models::save::{float_bytes, round_to};

use crate::sanitize::Origin;
use crate::source::{to_f32, SafetensorsDir, SourceTensor};
use crate::write::{PlannedTensor, Shards};
use crate::ConvertError;

/// How far a conversion has come, in bytes of weights written.
#[derive(Debug, Clone, Copy)]
pub struct Progress {
    pub done_bytes: usize,
    pub total_bytes: usize,
}

/// About this many bytes of source rows are converted at a time.
const BLOCK_BYTES: usize = 32 << 20;

/// One output array, or the weight, scales and biases of one quantized module.
#[derive(Debug, Clone)]
pub enum Job {
    /// An array as it is, its floats cast to `dtype` when one is given.
    Dense {
        name: String,
        origin: Origin,
        dtype: Option<DType>,
    },
    /// A weight cast to `dtype` (when given), then quantized; scales and biases in that dtype.
    Quantize {
        prefix: String,
        origin: Origin,
        spec: QuantSpec,
        dtype: Option<DType>,
    },
    /// A quantized module's weight written dense: its weight, scales and biases origins.
    Dequantize {
        prefix: String,
        origins: [Option<Origin>; 3],
        spec: QuantSpec,
        dtype: Option<DType>,
    },
}

/// The source arrays an origin reads, and their common dtype and shape.
fn sources<'a>(
    origin: &Origin,
    source: &'a SafetensorsDir,
) -> Result<Vec<&'a SourceTensor>, ConvertError> {
    let names: Vec<&String> = match origin {
        Origin::Tensor(n) | Origin::SwapLastAxes(n) => vec![n],
        Origin::RowSlice { name, .. } => vec![name],
        Origin::Stack(names) => names.iter().collect(),
    };
    let found: Vec<&SourceTensor> = names
        .iter()
        .map(|n| {
            source.tensors.get(*n).ok_or_else(|| {
                ConvertError::Weights(format!("array `{n}` is missing from the checkpoint"))
            })
        })
        .collect::<Result<_, _>>()?;
    if let Some(first) = found.first() {
        if let Some((i, odd)) = found
            .iter()
            .enumerate()
            .find(|(_, t)| t.shape != first.shape || t.dtype != first.dtype)
        {
            return Err(ConvertError::Weights(format!(
                "`{}` is {:?} {}, but `{}` is {:?} {}: experts must match",
                names[i], odd.shape, odd.dtype, names[0], first.shape, first.dtype
            )));
        }
    }
    Ok(found)
}

/// The shape an origin gives.
pub fn shape_of(origin: &Origin, source: &SafetensorsDir) -> Result<Vec<usize>, ConvertError> {
    let found = sources(origin, source)?;
    let first = &found[0].shape;
    let bad =
        |what: &str| ConvertError::Weights(format!("cannot {what} an array of shape {first:?}"));
    Ok(match origin {
        Origin::Tensor(_) => first.clone(),
        Origin::Stack(_) => [vec![found.len()], first.clone()].concat(),
        Origin::SwapLastAxes(_) => match first.as_slice() {
            [lead @ .., a, b] => [lead, &[*b, *a]].concat(),
            _ => return Err(bad("swap the last axes of")),
        },
        Origin::RowSlice { parts, .. } => match first.as_slice() {
            [lead @ .., rows, cols] if rows % parts == 0 => [lead, &[rows / parts, *cols]].concat(),
            _ => return Err(bad(&format!("split in {parts}"))),
        },
    })
}

/// An origin's rows (over the last axis), in order: spans of source rows, or rows computed in
/// memory.
struct Rows<'a> {
    dtype: DType,
    cols: usize,
    spans: Vec<Span<'a>>,
}

enum Span<'a> {
    File(&'a SourceTensor, Range<usize>),
    Memory(Vec<u8>),
}

impl<'a> Rows<'a> {
    fn of(origin: &Origin, source: &'a SafetensorsDir) -> Result<Self, ConvertError> {
        let found = sources(origin, source)?;
        let first = found[0];
        let shape = shape_of(origin, source)?;
        let cols = shape.last().copied().unwrap_or(1);
        let spans = match origin {
            Origin::Tensor(_) | Origin::Stack(_) => {
                found.iter().map(|t| Span::File(t, 0..t.rows())).collect()
            }
            Origin::SwapLastAxes(_) => {
                let bytes = first.read()?;
                let size = first.dtype.size_in_bytes();
                let (a, b) = (shape[shape.len() - 1], shape[shape.len() - 2]);
                let mut swapped = vec![0; bytes.len()];
                for (m, block) in bytes.chunks_exact(a * b * size).enumerate() {
                    for i in 0..b {
                        for j in 0..a {
                            // Source [.., a, b] element (j, i) becomes [.., b, a] element (i, j).
                            let from = (j * b + i) * size;
                            let to = m * a * b * size + (i * a + j) * size;
                            swapped[to..to + size].copy_from_slice(&block[from..from + size]);
                        }
                    }
                }
                vec![Span::Memory(swapped)]
            }
            Origin::RowSlice { part, parts, .. } => {
                let rows = first.shape[first.shape.len() - 2];
                let per_part = rows / parts;
                (0..first.rows() / rows)
                    .map(|lead| {
                        let start = lead * rows + part * per_part;
                        Span::File(first, start..start + per_part)
                    })
                    .collect()
            }
        };
        Ok(Rows {
            dtype: first.dtype,
            cols,
            spans,
        })
    }

    /// Calls `f(first_row, bytes, row_count)` for blocks of consecutive rows.
    fn for_each_block(
        &self,
        mut f: impl FnMut(usize, &[u8], usize) -> Result<(), ConvertError>,
    ) -> Result<(), ConvertError> {
        let row_bytes = self.cols * self.dtype.size_in_bytes();
        let block_rows = (BLOCK_BYTES / row_bytes.max(1)).max(1);
        let mut row = 0;
        for span in &self.spans {
            match span {
                Span::Memory(bytes) => {
                    let rows = bytes.len() / row_bytes.max(1);
                    f(row, bytes, rows)?;
                    row += rows;
                }
                Span::File(tensor, range) => {
                    let mut start = range.start;
                    while start < range.end {
                        let end = (start + block_rows).min(range.end);
                        f(row, &tensor.read_rows(start..end)?, end - start)?;
                        row += end - start;
                        start = end;
                    }
                }
            }
        }
        Ok(())
    }
}

fn float(dtype: DType) -> bool {
    matches!(dtype, DType::F32 | DType::F16 | DType::BF16)
}

/// `lead` with `last` as its last axis.
fn with_last(shape: &[usize], last: usize) -> Vec<usize> {
    let mut shape = shape.to_vec();
    *shape.last_mut().expect("a matrix or a stack of them") = last;
    shape
}

impl Job {
    /// The arrays it writes.
    pub fn outputs(
        &self,
        source: &SafetensorsDir,
    ) -> Result<BTreeMap<String, PlannedTensor>, ConvertError> {
        let mut out = BTreeMap::new();
        match self {
            Job::Dense {
                name,
                origin,
                dtype,
            } => {
                let from = sources(origin, source)?[0].dtype;
                let dtype = dtype.filter(|_| float(from)).unwrap_or(from);
                let shape = shape_of(origin, source)?;
                out.insert(name.clone(), PlannedTensor { dtype, shape });
            }
            Job::Quantize {
                prefix,
                origin,
                spec,
                dtype,
            } => {
                let from = sources(origin, source)?[0].dtype;
                if !float(from) {
                    return Err(ConvertError::Weights(format!(
                        "`{prefix}.weight` is {from}, not floats: it cannot be quantized"
                    )));
                }
                let dtype = dtype.unwrap_or(from);
                let shape = shape_of(origin, source)?;
                let cols = *shape.last().expect("a matrix");
                let words = cols * spec.bits as usize / 32;
                let groups = cols / spec.group_size;
                let weight = PlannedTensor {
                    dtype: DType::U32,
                    shape: with_last(&shape, words),
                };
                out.insert(format!("{prefix}.weight"), weight);
                let scales_dtype = match spec.mode {
                    QuantMode::Affine => dtype,
                    _ => DType::U8,
                };
                let scales = PlannedTensor {
                    dtype: scales_dtype,
                    shape: with_last(&shape, groups),
                };
                if spec.mode == QuantMode::Affine {
                    out.insert(format!("{prefix}.biases"), scales.clone());
                }
                out.insert(format!("{prefix}.scales"), scales);
            }
            Job::Dequantize {
                prefix,
                origins,
                spec,
                dtype,
            } => {
                let (weight, scales) = match origins {
                    [Some(w), Some(s), _] => (w, s),
                    _ => unreachable!("a quantized module has a weight and scales"),
                };
                let shape = shape_of(weight, source)?;
                let cols = shape.last().copied().unwrap_or(0) * 32 / spec.bits as usize;
                let dtype = dequantized_dtype(*spec, sources(scales, source)?[0].dtype, *dtype);
                let weight = PlannedTensor {
                    dtype,
                    shape: with_last(&shape, cols),
                };
                out.insert(format!("{prefix}.weight"), weight);
            }
        }
        Ok(out)
    }

    /// Computes and writes its arrays; the bytes written.
    pub fn run(&self, source: &SafetensorsDir, shards: &Shards) -> Result<usize, ConvertError> {
        match self {
            Job::Dense {
                name,
                origin,
                dtype,
            } => {
                let rows = Rows::of(origin, source)?;
                let to = dtype.filter(|_| float(rows.dtype)).unwrap_or(rows.dtype);
                let out_row = rows.cols * to.size_in_bytes();
                let mut written = 0;
                rows.for_each_block(|row, bytes, _| {
                    let out = match to == rows.dtype {
                        true => bytes.to_vec(),
                        false => float_bytes(to, &to_f32(rows.dtype, bytes)),
                    };
                    written += out.len();
                    shards.write(name, row * out_row, &out)
                })?;
                Ok(written)
            }
            Job::Quantize {
                prefix,
                origin,
                spec,
                dtype,
            } => {
                let rows = Rows::of(origin, source)?;
                let dtype = dtype.unwrap_or(rows.dtype);
                let cols = rows.cols;
                let words = cols * spec.bits as usize / 32;
                let mut written = 0;
                let (weight, scales_name, biases_name) = (
                    format!("{prefix}.weight"),
                    format!("{prefix}.scales"),
                    format!("{prefix}.biases"),
                );
                rows.for_each_block(|row, bytes, n| {
                    let mut values = to_f32(rows.dtype, bytes);
                    if dtype != rows.dtype {
                        // mlx-lm casts to the dtype first, then quantizes.
                        values.iter_mut().for_each(|v| *v = round_to(dtype, *v));
                    }
                    let (packed, scales, biases) = quantize_rows(&values, n, cols, *spec, dtype);
                    shards.write(&weight, row * words * 4, &packed)?;
                    let scale_bytes = scales.len() / n;
                    shards.write(&scales_name, row * scale_bytes, &scales)?;
                    if !biases.is_empty() {
                        shards.write(&biases_name, row * scale_bytes, &biases)?;
                    }
                    written += packed.len() + scales.len() + biases.len();
                    Ok(())
                })?;
                Ok(written)
            }
            Job::Dequantize {
                prefix,
                origins,
                spec,
                dtype,
            } => {
                let read = |origin: &Option<Origin>| -> Result<(Vec<u8>, DType), ConvertError> {
                    let origin = origin.as_ref().expect("present for this mode");
                    let rows = Rows::of(origin, source)?;
                    let mut all = Vec::new();
                    rows.for_each_block(|_, bytes, _| {
                        all.extend_from_slice(bytes);
                        Ok(())
                    })?;
                    Ok((all, rows.dtype))
                };
                let (packed, _) = read(&origins[0])?;
                let (scales, scales_dtype) = read(&origins[1])?;
                let shape = shape_of(origins[0].as_ref().expect("a weight"), source)?;
                let cols = shape.last().copied().unwrap_or(0) * 32 / spec.bits as usize;
                let rows = shape.iter().product::<usize>() * 32 / spec.bits as usize / cols.max(1);
                let to = dequantized_dtype(*spec, scales_dtype, *dtype);
                let biases = match spec.mode {
                    QuantMode::Affine => read(&origins[2])?.0,
                    _ => Vec::new(),
                };
                // mlx-lm casts scales and biases to the dtype before dequantizing.
                let cast = |b: Vec<u8>| match spec.mode == QuantMode::Affine && to != scales_dtype {
                    true => float_bytes(to, &to_f32(scales_dtype, &b)),
                    false => b,
                };
                let scales_dtype = match spec.mode {
                    QuantMode::Affine => to,
                    _ => scales_dtype,
                };
                let matrix = stored_matrix(
                    *spec,
                    rows,
                    cols,
                    packed,
                    scales_dtype,
                    cast(scales),
                    cast(biases),
                )
                .map_err(|e| ConvertError::Weights(format!("`{prefix}`: {e}")))?;
                let out = float_bytes(to, &matrix.dequantize_as(to));
                shards.write(&format!("{prefix}.weight"), 0, &out)?;
                Ok(out.len())
            }
        }
    }
}

/// `rows` rows of `cols` values (exactly `dtype` values) quantized as `mx.quantize` quantizes
/// weights of `dtype`: the packed words, the scales and (affine only) the biases, as stored.
pub(crate) fn quantize_rows(
    values: &[f32],
    rows: usize,
    cols: usize,
    spec: QuantSpec,
    dtype: DType,
) -> (Vec<u8>, Vec<u8>, Vec<u8>) {
    let (packed, scales, biases) = match spec.mode {
        QuantMode::Affine => {
            let (packed, scales, biases) = quantize(values, rows, cols, spec.bits, spec.group_size);
            (
                packed,
                float_bytes(dtype, &scales),
                float_bytes(dtype, &biases),
            )
        }
        mode => {
            let (packed, scales) = quantize_float(mode, values, rows, cols, dtype);
            (packed, scales, Vec::new())
        }
    };
    let packed = packed.iter().flat_map(|w| w.to_le_bytes()).collect();
    (packed, scales, biases)
}

/// A quantized matrix from its stored parts (`biases` empty in the float modes).
pub(crate) fn stored_matrix(
    spec: QuantSpec,
    rows: usize,
    cols: usize,
    packed: Vec<u8>,
    scales_dtype: DType,
    scales: Vec<u8>,
    biases: Vec<u8>,
) -> Result<QuantizedMatrix, EngineError> {
    let bytes = |b: Vec<u8>| Bytes::from_owner(Arc::new(b));
    match spec.mode {
        QuantMode::Affine => QuantizedMatrix::new(
            rows,
            cols,
            spec.bits,
            spec.group_size,
            bytes(packed),
            scales_dtype,
            bytes(scales),
            bytes(biases),
        ),
        mode => QuantizedMatrix::new_float(
            mode,
            rows,
            cols,
            spec.bits,
            spec.group_size,
            bytes(packed),
            bytes(scales),
        ),
    }
}

/// What `mx.dequantize` gives after mlx-lm's cast: affine weights in the (cast) scales' dtype;
/// the float modes, whose scales are codes, in bf16.
fn dequantized_dtype(spec: QuantSpec, scales: DType, cast: Option<DType>) -> DType {
    match spec.mode {
        QuantMode::Affine => cast.unwrap_or(scales),
        _ => DType::BF16,
    }
}
