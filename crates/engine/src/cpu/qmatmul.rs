use crate::quant::QuantizedView;

/// `y[m, rows] = x[m, cols] · Wᵀ` on the packed weights.
pub fn matmul(w: &QuantizedView, x: &[f32], m: usize, y: &mut [f32]) {
    let mut row = vec![0.0f32; w.cols];
    for r in 0..w.rows {
        w.dequantize_row(r, &mut row);
        for i in 0..m {
            y[i * w.rows + r] = super::dense::dot(&x[i * w.cols..(i + 1) * w.cols], &row);
        }
    }
}
