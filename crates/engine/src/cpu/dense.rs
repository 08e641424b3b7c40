use crate::FloatMatrix;

/// `y[m, rows] = x[m, cols] · Wᵀ` for float weights, converting one weight row at a time.
pub fn matmul(w: &FloatMatrix, x: &[f32], m: usize, y: &mut [f32]) {
    let (rows, cols) = (w.rows, w.cols);
    let mut row = vec![0.0f32; cols];
    for r in 0..rows {
        w.row_to_f32(r, &mut row);
        for i in 0..m {
            y[i * rows + r] = dot(&x[i * cols..(i + 1) * cols], &row);
        }
    }
}

/// Dot product with several accumulators so the compiler can vectorise it.
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let chunks = a.len() / 8;
    for c in 0..chunks {
        for k in 0..8 {
            acc[k] += a[c * 8 + k] * b[c * 8 + k];
        }
    }
    let mut s: f32 = acc.iter().sum();
    for i in chunks * 8..a.len() {
        s += a[i] * b[i];
    }
    s
}
