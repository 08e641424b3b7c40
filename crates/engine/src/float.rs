use std::sync::Arc;

use crate::cuda::{self, DenseWeights, Gpu};
use crate::params::{DenseView, FloatSlice};
use crate::{cpu, Bytes, DType, Device, EngineError};

/// A row-major `[rows, cols]` matrix of f32, f16 or bf16 values, viewed in place.
/// Used for unquantized linear layers and embeddings.
#[derive(Debug, Clone)]
pub struct FloatMatrix {
    pub rows: usize,
    pub cols: usize,
    pub dtype: DType,
    data: Bytes,
    /// The same matrix in a GPU's memory, once [`place`](Self::place)d there.
    gpu: Option<Arc<DenseWeights>>,
}

/// Checks that `data` holds `count` floats of `dtype` and returns it aligned for viewing.
pub(crate) fn checked_float_bytes(
    what: &str,
    dtype: DType,
    count: usize,
    data: Bytes,
) -> Result<Bytes, EngineError> {
    if !dtype.is_float() {
        return Err(EngineError::UnsupportedDType {
            what: what.to_string(),
            dtype: dtype.to_string(),
        });
    }
    let expected = count * dtype.size_in_bytes();
    if data.len() != expected {
        return Err(EngineError::SizeMismatch {
            what: what.to_string(),
            expected,
            found: data.len(),
        });
    }
    Ok(data.aligned(dtype.size_in_bytes()))
}

/// Views float bytes checked by [`checked_float_bytes`].
pub(crate) fn float_slice(dtype: DType, data: &Bytes) -> FloatSlice<'_> {
    match dtype {
        DType::F32 => FloatSlice::F32(data.view()),
        DType::F16 => FloatSlice::F16(data.view()),
        DType::BF16 => FloatSlice::BF16(data.view()),
        other => unreachable!("float bytes were checked at construction, found {other}"),
    }
}

impl FloatMatrix {
    pub fn new(rows: usize, cols: usize, dtype: DType, data: Bytes) -> Result<Self, EngineError> {
        let data = checked_float_bytes("float matrix", dtype, rows * cols, data)?;
        Ok(FloatMatrix {
            rows,
            cols,
            dtype,
            data,
            gpu: None,
        })
    }

    /// Copies the matrix to `device`'s memory as stored (a no-op for the CPU).
    pub fn place(&mut self, device: &Device) -> Result<(), EngineError> {
        let Device::Cuda(gpu) = device else {
            return Ok(());
        };
        self.gpu = Some(Arc::new(DenseWeights {
            data: gpu.upload_raw(self.data.as_slice())?,
            dtype: cuda::type_suffix(self.dtype)?,
            gpu: gpu.clone(),
        }));
        Ok(())
    }

    /// The copy on `gpu` that [`place`](Self::place) made.
    pub(crate) fn on_gpu(&self, gpu: &Gpu) -> Result<&DenseWeights, EngineError> {
        match &self.gpu {
            Some(w) if w.gpu.same(gpu) => Ok(w),
            _ => Err(cuda::not_placed(self.rows, self.cols, gpu)),
        }
    }

    /// An owned f32 matrix, for tests and small derived weights.
    pub fn from_f32(rows: usize, cols: usize, values: &[f32]) -> Result<Self, EngineError> {
        FloatMatrix::new(rows, cols, DType::F32, Bytes::from_values(values))
    }

    pub fn values(&self) -> FloatSlice<'_> {
        float_slice(self.dtype, &self.data)
    }

    /// The matrix as the host kernels read it.
    pub fn view(&self) -> DenseView<'_> {
        DenseView {
            rows: self.rows,
            cols: self.cols,
            values: self.values(),
        }
    }

    /// Row `row` as f32.
    pub fn row_to_f32(&self, row: usize, out: &mut [f32]) {
        self.view().row_to_f32(row, out);
    }

    /// All values as f32.
    pub fn to_f32_vec(&self) -> Vec<f32> {
        let mut out = vec![0.0; self.rows * self.cols];
        self.values().to_f32(0, &mut out);
        out
    }

    /// `y[m, rows] = x[m, cols] · Wᵀ`.
    pub fn matmul(&self, x: &[f32], m: usize, y: &mut [f32]) {
        cpu::dense::matmul(&self.view(), x, m, y);
    }
}
