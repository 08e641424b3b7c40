//! Element-wise ops in place, copies of columns and rows, gathers and scatters, and greedy
//! picks from logits.

use crate::cpu;
use crate::cuda::{self, Buffer};
use crate::tensor::Storage;
use crate::Tensor;

use super::{check, pair, same_len, with_last, Pair, Result};
use crate::params::Pick;

/// `x = f(x, y)` element by element: the host function or the CUDA kernel of that name.
fn binary(
    op: &str,
    x: &mut Tensor,
    y: &Tensor,
    host: fn(&mut [f32], &[f32]),
    kernel: &str,
) -> Result<()> {
    same_len(op, x, y)?;
    match pair(op, x, y)? {
        Pair::Host(a, b) => {
            host(a, b);
            Ok(())
        }
        Pair::Cuda(a, b) => cuda::elementwise::binary(kernel, a, b),
    }
}

/// `x += y`.
pub fn add_inplace(x: &mut Tensor, y: &Tensor) -> Result<()> {
    binary("add", x, y, cpu::elementwise::add_inplace, "add")
}

/// `x *= y`, element by element.
pub fn mul_inplace(x: &mut Tensor, y: &Tensor) -> Result<()> {
    binary("mul", x, y, cpu::elementwise::mul_inplace, "mul")
}

/// `x[r] += row` for every row of `x` (a bias).
pub fn add_row_inplace(x: &mut Tensor, row: &Tensor) -> Result<()> {
    row_op("add_row", x, row, cpu::elementwise::add_inplace)
}

/// `x[r] *= row` for every row of `x` (a per-feature scale).
pub fn mul_row_inplace(x: &mut Tensor, row: &Tensor) -> Result<()> {
    row_op("mul_row", x, row, cpu::elementwise::mul_inplace)
}

/// Every row of `x` combined with `row` by `host`, or on a GPU by the kernel `name`.
fn row_op(name: &str, x: &mut Tensor, row: &Tensor, host: fn(&mut [f32], &[f32])) -> Result<()> {
    check(x.cols() == row.len(), || {
        format!("{name} of {} on rows of {}", row.len(), x.cols())
    })?;
    match pair(name, x, row)? {
        Pair::Host(a, b) => {
            for r in a.chunks_exact_mut(b.len()) {
                host(r, b);
            }
            Ok(())
        }
        Pair::Cuda(a, b) => cuda::elementwise::row_op(name, a, b),
    }
}

/// `x = f(x)` element by element, on the host or by a kernel.
fn unary(
    x: &mut Tensor,
    host: impl FnOnce(&mut [f32]),
    gpu: impl FnOnce(&mut Buffer) -> Result<()>,
) -> Result<()> {
    match &mut x.storage {
        Storage::Host(v) => {
            host(v);
            Ok(())
        }
        Storage::Cuda(b) => gpu(b),
    }
}

/// `x *= s`.
pub fn scale_inplace(x: &mut Tensor, s: f32) -> Result<()> {
    unary(
        x,
        |v| cpu::elementwise::scale_inplace(v, s),
        |b| cuda::elementwise::scale(b, s),
    )
}

/// `x = tanh(x / cap) · cap`.
pub fn softcap_inplace(x: &mut Tensor, cap: f32) -> Result<()> {
    unary(
        x,
        |v| cpu::elementwise::softcap_inplace(v, cap),
        |b| cuda::elementwise::softcap(b, cap),
    )
}

/// `x = silu(x)`.
pub fn silu_inplace(x: &mut Tensor) -> Result<()> {
    unary(x, cpu::elementwise::silu_inplace, |b| {
        cuda::elementwise::unary("silu", b)
    })
}

/// `x = relu(x)²` (Nemotron-H's activation).
pub fn relu_squared_inplace(x: &mut Tensor) -> Result<()> {
    unary(x, cpu::elementwise::relu_squared_inplace, |b| {
        cuda::elementwise::unary("relu_squared", b)
    })
}

/// `gate = silu(gate) · up`, the SwiGLU activation.
pub fn silu_mul_inplace(gate: &mut Tensor, up: &Tensor) -> Result<()> {
    binary(
        "silu_mul",
        gate,
        up,
        cpu::elementwise::silu_mul_inplace,
        "silu_mul",
    )
}

/// `gate = gelu_approx(gate) · up`, the GeGLU activation.
pub fn gelu_approx_mul_inplace(gate: &mut Tensor, up: &Tensor) -> Result<()> {
    binary(
        "gelu_mul",
        gate,
        up,
        cpu::elementwise::gelu_approx_mul_inplace,
        "gelu_mul",
    )
}

/// `gate = (clip(up, ±7) + 1) · g · sigmoid(1.702 · g)`, `g = min(gate, 7)`: gpt-oss's
/// clamped SwiGLU.
pub fn swiglu_oai_mul_inplace(gate: &mut Tensor, up: &Tensor) -> Result<()> {
    binary(
        "swiglu_oai_mul",
        gate,
        up,
        cpu::elementwise::swiglu_oai_mul_inplace,
        "swiglu_oai_mul",
    )
}

/// `gate = act(gate) · up`: the gated MLP's activation.
pub fn glu_inplace(gate: &mut Tensor, up: &Tensor, act: super::Activation) -> Result<()> {
    match act {
        super::Activation::Silu => silu_mul_inplace(gate, up),
        super::Activation::GeluApprox => gelu_approx_mul_inplace(gate, up),
        super::Activation::SwigluOai => swiglu_oai_mul_inplace(gate, up),
    }
}

/// `x = x · sigmoid(gate)`.
pub fn sigmoid_mul_inplace(x: &mut Tensor, gate: &Tensor) -> Result<()> {
    binary(
        "sigmoid_mul",
        x,
        gate,
        cpu::elementwise::sigmoid_mul_inplace,
        "sigmoid_mul",
    )
}

/// Columns `start..start + width` of every row, as a new `[rows, width]` tensor.
pub fn columns(x: &Tensor, start: usize, width: usize) -> Result<Tensor> {
    let cols = x.cols();
    check(start + width <= cols, || {
        format!("columns {start}..{} of {:?}", start + width, x.shape())
    })?;
    let shape = with_last(x.shape(), width);
    match &x.storage {
        Storage::Host(v) => Ok(Tensor::new(
            shape,
            v.chunks_exact(cols)
                .flat_map(|r| &r[start..start + width])
                .copied()
                .collect(),
        )),
        Storage::Cuda(b) => Ok(Tensor::on_gpu(
            shape,
            cuda::elementwise::columns(b, cols, start, width)?,
        )),
    }
}

/// Writes `src` (`[rows, width]`) into columns `start..start + width` of every row of `dst`
/// (`[rows, cols]`): [`columns`] the other way.
pub fn place_columns(dst: &mut Tensor, src: &Tensor, start: usize) -> Result<()> {
    let (cols, width) = (dst.cols(), src.cols());
    check(start + width <= cols && src.rows() == dst.rows(), || {
        format!(
            "{:?} into columns {start}..{} of {:?}",
            src.shape(),
            start + width,
            dst.shape()
        )
    })?;
    match pair("place_columns", dst, src)? {
        Pair::Host(d, s) => {
            for (row, part) in d.chunks_exact_mut(cols).zip(s.chunks_exact(width)) {
                row[start..start + width].copy_from_slice(part);
            }
            Ok(())
        }
        Pair::Cuda(d, s) => cuda::elementwise::place_columns(d, cols, s, start, width),
    }
}

/// Rows `start..start + count` (of [`Tensor::cols`] elements), as a new tensor.
pub fn rows(x: &Tensor, start: usize, count: usize) -> Result<Tensor> {
    let cols = x.cols();
    check(start + count <= x.rows(), || {
        format!("rows {start}..{} of {:?}", start + count, x.shape())
    })?;
    let shape = vec![count, cols];
    match &x.storage {
        Storage::Host(v) => Ok(Tensor::new(
            shape,
            v[start * cols..(start + count) * cols].to_vec(),
        )),
        Storage::Cuda(b) => Ok(Tensor::on_gpu(
            shape,
            cuda::elementwise::range(b, start * cols, count * cols)?,
        )),
    }
}

/// The index of the first maximum of `x` (`mx.argmax`), NaNs passed over; 0 where every
/// element is NaN or -inf.
pub fn argmax(x: &[f32]) -> u32 {
    let (mut best, mut best_value) = (0, f32::NEG_INFINITY);
    for (i, &v) in x.iter().enumerate() {
        if v > best_value {
            (best, best_value) = (i, v);
        }
    }
    best as u32
}

/// `ln Σ exp(x)`: the exponentials of `x − max` in f32, summed in f64
/// ([`cpu::elementwise::exp_sum`]; NaNs passed over for the maximum), −∞ for a row of −∞.
/// Log-softmax is `x - log_sum_exp(x)`.
pub fn log_sum_exp(x: &[f32]) -> f32 {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if max == f32::NEG_INFINITY {
        return max;
    }
    max + cpu::elementwise::exp_sum(x, 1.0, max).ln() as f32
}

/// The [`Pick`] of every row of `x`. On a GPU only the picks are copied back (a batch's rows,
/// or one row of a large vocabulary, are megabytes).
pub fn greedy_rows(x: &Tensor) -> Result<Vec<Pick>> {
    greedy_rows_allowed(x, &[])
}

/// [`greedy_rows`], row `r` held to the columns `allowed[r]` allows where it is given (a
/// grammar's mask: bit `c % 32` of word `c / 32` allows column `c`), as if the others were −∞:
/// the pick and its log-probability are those of the masked row. An empty `allowed` leaves every
/// row free.
pub fn greedy_rows_allowed(x: &Tensor, allowed: &[Option<&[u32]>]) -> Result<Vec<Pick>> {
    let (rows, cols) = (x.rows(), x.cols());
    check(cols > 0, || {
        format!("greedy picks of rows of {:?}", x.shape())
    })?;
    check(allowed.is_empty() || allowed.len() == rows, || {
        format!("{} masks for {rows} rows", allowed.len())
    })?;
    for mask in allowed.iter().flatten() {
        check(mask.len() >= cols.div_ceil(32), || {
            format!("a mask of {} words for rows of {cols} columns", mask.len())
        })?;
        check(allows_any(mask, cols), || {
            format!("a mask that allows none of the row's {cols} columns")
        })?;
    }
    let pick = |row: &[f32]| {
        let id = argmax(row);
        Pick {
            id,
            logprob: row[id as usize] - log_sum_exp(row),
        }
    };
    match &x.storage {
        Storage::Host(v) => Ok(v
            .chunks_exact(cols)
            .enumerate()
            .map(|(r, row)| match allowed.get(r).copied().flatten() {
                None => pick(row),
                Some(mask) => {
                    let masked: Vec<f32> = (0..cols)
                        .map(|c| {
                            if is_allowed(mask, c) {
                                row[c]
                            } else {
                                f32::NEG_INFINITY
                            }
                        })
                        .collect();
                    pick(&masked)
                }
            })
            .collect()),
        Storage::Cuda(b) => cuda::elementwise::greedy_rows(b, cols, allowed),
    }
}

fn is_allowed(mask: &[u32], column: usize) -> bool {
    mask[column / 32] >> (column % 32) & 1 == 1
}

fn allows_any(mask: &[u32], cols: usize) -> bool {
    let (whole, rest) = (cols / 32, cols % 32);
    mask[..whole].iter().any(|&w| w != 0) || (rest > 0 && mask[whole] & ((1 << rest) - 1) != 0)
}

/// The rows `indices` of `x`, in that order.
pub fn gather_rows(x: &Tensor, indices: &[usize]) -> Result<Tensor> {
    let (n, cols) = (x.rows(), x.cols());
    check(indices.iter().all(|&i| i < n), || {
        format!("row indices past {n} rows")
    })?;
    let shape = vec![indices.len(), cols];
    match &x.storage {
        Storage::Host(v) => Ok(Tensor::new(
            shape,
            indices
                .iter()
                .flat_map(|&i| &v[i * cols..(i + 1) * cols])
                .copied()
                .collect(),
        )),
        Storage::Cuda(b) => Ok(Tensor::on_gpu(
            shape,
            cuda::elementwise::gather_rows(b, cols, indices)?,
        )),
    }
}

/// `y[indices[i]] += weights[i] · src[i]`, for distinct `indices`.
pub fn scatter_add_rows(
    y: &mut Tensor,
    src: &Tensor,
    indices: &[usize],
    weights: &[f32],
) -> Result<()> {
    let (n, cols) = (y.rows(), y.cols());
    check(
        src.cols() == cols
            && src.rows() == indices.len()
            && weights.len() == indices.len()
            && indices.iter().all(|&i| i < n),
        || format!("scatter of {:?} into {:?}", src.shape(), y.shape()),
    )?;
    match pair("scatter_add_rows", y, src)? {
        Pair::Host(a, s) => {
            for ((&i, &w), row) in indices.iter().zip(weights).zip(s.chunks_exact(cols)) {
                for (o, &v) in a[i * cols..(i + 1) * cols].iter_mut().zip(row) {
                    *o += w * v;
                }
            }
            Ok(())
        }
        Pair::Cuda(a, s) => cuda::elementwise::scatter_add_rows(a, s, cols, indices, weights),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_picks_take_the_first_maximum_and_pass_over_nans() {
        assert_eq!(argmax(&[1.0, 3.0, 2.0, 3.0]), 1);
        assert_eq!(argmax(&[f32::NAN, 0.5, f32::NAN, 2.0]), 3);
        assert_eq!(argmax(&[f32::NEG_INFINITY, f32::NAN]), 0);
        let x = Tensor::new(vec![2, 3], vec![0.0, -1.0, 0.0, -5.0, -4.0, -4.0]);
        let picks = greedy_rows(&x).unwrap();
        assert_eq!(picks.iter().map(|p| p.id).collect::<Vec<_>>(), [0, 1]);
        // Two maxima of 0 beside e^-1: each has probability 1 / (2 + e^-1).
        let expected = -(2.0 + (-1.0f64).exp()).ln() as f32;
        assert!((picks[0].logprob - expected).abs() < 1e-6, "{picks:?}");
        let empty_rows = Tensor::new(vec![2, 0], vec![]);
        assert!(greedy_rows(&empty_rows).is_err());
    }

    /// A masked row picks among the columns its mask allows, with the log-probability of the
    /// row whose other columns are -inf; a row without a mask is free.
    #[test]
    fn masked_picks_keep_to_the_allowed_columns() {
        let x = Tensor::new(vec![2, 34], (0..68).map(|i| (i % 34) as f32).collect());
        // Columns 1, 2 and 33 allowed in the first row.
        let mask = [0b110, 0b10];
        let picks = greedy_rows_allowed(&x, &[Some(&mask), None]).unwrap();
        assert_eq!(picks.iter().map(|p| p.id).collect::<Vec<_>>(), [33, 33]);
        let expected = 33.0 - (1f64.exp() + 2f64.exp() + 33f64.exp()).ln() as f32;
        assert!((picks[0].logprob - expected).abs() < 1e-6, "{picks:?}");
        assert!(picks[1].logprob < picks[0].logprob);
        let only_two = [0b100, 0];
        let picks = greedy_rows_allowed(&x, &[Some(&only_two), Some(&only_two)]).unwrap();
        assert!(
            picks.iter().all(|p| p.id == 2 && p.logprob == 0.0),
            "{picks:?}"
        );
        // A mask of too few words, one that allows only columns past the row (bit 2 of the
        // second word is column 34), and masks that do not match the rows are refused.
        assert!(greedy_rows_allowed(&x, &[Some(&[u32::MAX]), None]).is_err());
        assert!(greedy_rows_allowed(&x, &[Some(&[0, 0b100]), None]).is_err());
        assert!(greedy_rows_allowed(&x, &[None]).is_err());
    }
}
