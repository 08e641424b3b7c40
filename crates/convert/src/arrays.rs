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
    let names = origin.sources();
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

/// The dtype of the values an origin gives.
fn dtype_of(origin: &Origin, source: &SafetensorsDir) -> Result<DType, ConvertError> {
    Ok(match origin {
        Origin::Words { .. } => DType::U32,
        _ => sources(origin, source)?[0].dtype,
    })
}

/// The shape an origin gives.
pub fn shape_of(origin: &Origin, source: &SafetensorsDir) -> Result<Vec<usize>, ConvertError> {
    let found = sources(origin, source)?;
    let first = &found[0].shape;
    let bad =
        |what: &str| ConvertError::Weights(format!("cannot {what} an array of shape {first:?}"));
    Ok(match origin {
        Origin::Tensor(_) | Origin::Shifted { .. } => first.clone(),
        Origin::Stack(_) => [vec![found.len()], first.clone()].concat(),
        Origin::SwapLastAxes { parts, .. } => match first.as_slice() {
            [lead @ .., a, b] if b % parts == 0 => [lead, &[*b / parts, *a]].concat(),
            _ => return Err(bad("swap the last axes of")),
        },
        Origin::RowSlice { parts, .. } => match first.as_slice() {
            [lead @ .., rows, cols] if rows % parts == 0 => [lead, &[rows / parts, *cols]].concat(),
            _ => return Err(bad(&format!("split in {parts}"))),
        },
        Origin::Strided {
            axis, start, step, ..
        } => {
            let mut shape = first.clone();
            let at = shape
                .len()
                .checked_sub(axis + 1)
                .ok_or_else(|| bad("stride"))?;
            shape[at] = shape[at].saturating_sub(*start).div_ceil(*step);
            shape
        }
        Origin::Words { start, step, name } => {
            match (first.as_slice(), sources(origin, source)?[0].dtype) {
                ([lead @ .., rows, groups, bytes], DType::U8) if groups * bytes % 4 == 0 => {
                    let rows = rows.saturating_sub(*start).div_ceil(*step);
                    [lead, &[rows, groups * bytes / 4]].concat()
                }
                _ => {
                    return Err(ConvertError::Weights(format!(
                        "`{name}` is not packed blocks of bytes [.., rows, groups, bytes]"
                    )))
                }
            }
        }
        Origin::HeadRows {
            heads,
            start,
            rows,
            transposed,
            ..
        } => match first.as_slice() {
            [all, cols] if all % heads == 0 && start + rows <= all / heads => match transposed {
                true => vec![*heads, *cols, *rows],
                false => vec![*heads, *rows, *cols],
            },
            _ => return Err(bad(&format!("take {rows} rows per head of {heads} from"))),
        },
    })
}

/// A computation on a block of source rows, giving the same number of output rows.
type RowMap<'a> = Box<dyn Fn(Vec<u8>) -> Vec<u8> + Sync + 'a>;

/// An origin's rows (over the last axis), in order: spans of source rows (each block of them
/// passed through `map` when there is one), or rows computed in memory.
struct Rows<'a> {
    dtype: DType,
    cols: usize,
    spans: Vec<Span<'a>>,
    map: Option<RowMap<'a>>,
}

enum Span<'a> {
    File(&'a SourceTensor, Range<usize>),
    /// Every `step`-th row of the range, in rows of the given bytes.
    Every {
        tensor: &'a SourceTensor,
        rows: Range<usize>,
        step: usize,
        row_bytes: usize,
    },
    Memory(Vec<u8>),
}

/// Columns `start..start + width` of each `[rows, cols]` block of `bytes` (elements of `size`
/// bytes) transposed: element `(j, start + i)` becomes `(i, j)` of a `[width, rows]` block.
fn swap_last_axes(
    bytes: &[u8],
    (rows, cols): (usize, usize),
    (start, width): (usize, usize),
    size: usize,
) -> Vec<u8> {
    let blocks = bytes.len() / (rows * cols * size);
    let mut swapped = vec![0; blocks * width * rows * size];
    for (m, block) in bytes.chunks_exact(rows * cols * size).enumerate() {
        for i in 0..width {
            for j in 0..rows {
                let from = (j * cols + start + i) * size;
                let to = (m * width * rows + i * rows + j) * size;
                swapped[to..to + size].copy_from_slice(&block[from..from + size]);
            }
        }
    }
    swapped
}

impl<'a> Rows<'a> {
    fn of(origin: &Origin, source: &'a SafetensorsDir) -> Result<Self, ConvertError> {
        let found = sources(origin, source)?;
        let first = found[0];
        let shape = shape_of(origin, source)?;
        let cols = shape.last().copied().unwrap_or(1);
        let size = first.dtype.size_in_bytes();
        let mut map: Option<RowMap> = None;
        let spans = match origin {
            Origin::Tensor(_) | Origin::Stack(_) => {
                found.iter().map(|t| Span::File(t, 0..t.rows())).collect()
            }
            Origin::SwapLastAxes { part, parts, .. } => {
                let [.., rows, cols] = first.shape[..] else {
                    unreachable!("shape_of took two axes")
                };
                let width = cols / parts;
                let columns = (part * width, width);
                let bytes = swap_last_axes(&first.read()?, (rows, cols), columns, size);
                vec![Span::Memory(bytes)]
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
            Origin::Strided {
                axis: 1,
                start,
                step,
                ..
            } => {
                let rows = first.shape[first.shape.len() - 2];
                let row_bytes = first.shape[first.shape.len() - 1] * size;
                (0..first.rows() / rows)
                    .map(|lead| Span::Every {
                        tensor: first,
                        rows: lead * rows + start..(lead + 1) * rows,
                        step: *step,
                        row_bytes,
                    })
                    .collect()
            }
            Origin::Words { start, step, .. } => {
                let n = first.shape.len();
                let (rows, row_bytes) =
                    (first.shape[n - 3], first.shape[n - 2] * first.shape[n - 1]);
                (0..first.elements() / (rows * row_bytes))
                    .map(|lead| Span::Every {
                        tensor: first,
                        rows: lead * rows + start..(lead + 1) * rows,
                        step: *step,
                        row_bytes,
                    })
                    .collect()
            }
            Origin::Strided {
                axis: 0,
                start,
                step,
                ..
            } => {
                let (start, step, from_cols) =
                    (*start, *step, first.shape.last().copied().unwrap_or(1));
                map = Some(Box::new(move |bytes: Vec<u8>| {
                    let mut out = Vec::with_capacity(bytes.len() / step);
                    for row in bytes.chunks_exact(from_cols * size) {
                        for c in (start..from_cols).step_by(step) {
                            out.extend_from_slice(&row[c * size..(c + 1) * size]);
                        }
                    }
                    out
                }));
                vec![Span::File(first, 0..first.rows())]
            }
            Origin::Strided { axis, .. } => {
                return Err(ConvertError::Weights(format!(
                    "striding axis {axis} from the end is not implemented"
                )))
            }
            Origin::Shifted { name, by } => {
                let (dtype, by) = (first.dtype, *by);
                if !float(dtype) {
                    return Err(ConvertError::Weights(format!(
                        "`{name}` is {dtype}, not floats: it cannot be shifted"
                    )));
                }
                // mlx-lm adds in the array's own dtype: each sum rounded to it.
                map = Some(Box::new(move |bytes: Vec<u8>| {
                    let values: Vec<f32> = to_f32(dtype, &bytes)
                        .into_iter()
                        .map(|v| round_to(dtype, v + by))
                        .collect();
                    float_bytes(dtype, &values)
                }));
                vec![Span::File(first, 0..first.rows())]
            }
            Origin::HeadRows {
                heads,
                start,
                rows,
                transposed,
                ..
            } => {
                let per_head = first.shape[0] / heads;
                let head_rows = |h: usize| h * per_head + start..h * per_head + start + rows;
                match transposed {
                    false => (0..*heads)
                        .map(|h| Span::File(first, head_rows(h)))
                        .collect(),
                    true => (0..*heads)
                        .map(|h| {
                            let bytes = first.read_rows(head_rows(h))?;
                            Ok(Span::Memory(swap_last_axes(
                                &bytes,
                                (cols, *rows),
                                (0, *rows),
                                size,
                            )))
                        })
                        .collect::<Result<_, ConvertError>>()?,
                }
            }
        };
        Ok(Rows {
            dtype: dtype_of(origin, source)?,
            cols,
            spans,
            map,
        })
    }

    /// Calls `f(first_row, bytes, row_count)` for blocks of consecutive rows.
    fn for_each_block(
        &self,
        mut f: impl FnMut(usize, &[u8], usize) -> Result<(), ConvertError>,
    ) -> Result<(), ConvertError> {
        let row_bytes = self.cols * self.dtype.size_in_bytes();
        let block_rows = (BLOCK_BYTES / row_bytes.max(1)).max(1);
        let mapped = |bytes: Vec<u8>| match &self.map {
            Some(map) => map(bytes),
            None => bytes,
        };
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
                        f(row, &mapped(tensor.read_rows(start..end)?), end - start)?;
                        row += end - start;
                        start = end;
                    }
                }
                Span::Every {
                    tensor,
                    rows,
                    step,
                    row_bytes: source_row,
                } => {
                    let source_row = *source_row;
                    let picked: Vec<usize> = rows.clone().step_by(*step).collect();
                    for block in picked.chunks(block_rows) {
                        let (first, last) = (block[0], block[block.len() - 1]);
                        let read =
                            tensor.read_bytes(first * source_row..(last + 1) * source_row)?;
                        let mut bytes = Vec::with_capacity(block.len() * source_row);
                        for r in block {
                            let at = (r - first) * source_row;
                            bytes.extend_from_slice(&read[at..at + source_row]);
                        }
                        f(row, &mapped(bytes), block.len())?;
                        row += block.len();
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
                let from = dtype_of(origin, source)?;
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
                let from = dtype_of(origin, source)?;
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
