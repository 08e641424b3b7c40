//! Throughput of the CPU matmul kernels on random weights, on one thread unless told otherwise.
//!
//! `cargo run --release -p oxlm-engine --example qgemv_bench [seconds per case] [threads]`
//!
//! GEMV figures are GB/s of weight bytes read (packed integers, scales and biases), GEMM figures
//! GFLOP/s (2·m·n·k): the median of repeated runs, then the best one (other work on a shared core
//! drags the median down).

use std::time::{Duration, Instant};

use half::bf16;
use oxlm_engine::cpu::{dense, matmul, pool, qint, Isa};
use oxlm_engine::{Bytes, DType, FloatMatrix, QuantizedMatrix};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// A random `[rows, cols]` matrix with bf16 scales and biases, as mlx-lm checkpoints mostly have.
fn quantized(rng: &mut StdRng, rows: usize, cols: usize, bits: u32, g: usize) -> QuantizedMatrix {
    let words: Vec<u32> = (0..rows * cols * bits as usize / 32)
        .map(|_| rng.random())
        .collect();
    let groups = rows * cols / g;
    let mut floats = |lo: f32, hi: f32| -> Bytes {
        let v: Vec<bf16> = (0..groups)
            .map(|_| bf16::from_f32(rng.random_range(lo..hi)))
            .collect();
        Bytes::from_values(&v)
    };
    let (scales, biases) = (floats(0.001, 0.02), floats(-0.1, 0.1));
    QuantizedMatrix::new(
        rows,
        cols,
        bits,
        g,
        Bytes::from_values(&words),
        DType::BF16,
        scales,
        biases,
    )
    .unwrap()
}

fn random_vec(rng: &mut StdRng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect()
}

/// Median and best seconds per call of `f`, run for about `budget`.
fn time(budget: Duration, mut f: impl FnMut()) -> (f64, f64) {
    f();
    let mut runs = Vec::new();
    let start = Instant::now();
    while runs.len() < 3 || (start.elapsed() < budget && runs.len() < 1000) {
        let t = Instant::now();
        f();
        runs.push(t.elapsed().as_secs_f64());
    }
    runs.sort_by(f64::total_cmp);
    (runs[runs.len() / 2], runs[0])
}

fn main() {
    let secs: f64 = std::env::args()
        .nth(1)
        .map_or(1.0, |s| s.parse().expect("seconds per case"));
    let threads: usize = std::env::args()
        .nth(2)
        .map_or(1, |s| s.parse().expect("threads"));
    pool::set_threads(threads);
    let budget = Duration::from_secs_f64(secs);
    let mut rng = StdRng::seed_from_u64(0);
    let isas = Isa::available();
    println!("kernels available: {isas:?}; {threads} thread(s)");

    println!("\nGEMV, m = 1 (GB/s of weight bytes; ms per call)");
    for (rows, cols, bits, g) in [
        (512, 2048, 4, 64),
        (512, 2048, 8, 64),
        (4096, 4096, 4, 64),
        (11008, 4096, 4, 64),
        (4096, 4096, 8, 64),
        (4096, 4096, 3, 64),
        (4096, 4096, 6, 64),
    ] {
        let w = quantized(&mut rng, rows, cols, bits, g);
        let x = random_vec(&mut rng, cols);
        let mut y = vec![0.0; rows];
        let gbs = |t: f64| w.size_in_bytes() as f64 / t / 1e9;
        for &isa in &isas {
            let (t, best) = time(budget, || matmul::gemv(isa, &w.view(), &x, 1, &mut y));
            println!(
                "  {rows:>5}x{cols} {bits}-bit g{g} {:<18} {:6.2} GB/s (best {:6.2})  {:7.3} ms",
                format!("{isa:?} f32"),
                gbs(t),
                gbs(best),
                t * 1e3
            );
        }
        for &kernel in qint::IntKernel::available() {
            if !kernel.supports(&w.view()) {
                continue;
            }
            let (t, best) = time(budget, || qint::gemv(kernel, &w.view(), &x, 1, &mut y));
            println!(
                "  {rows:>5}x{cols} {bits}-bit g{g} {:<18} {:6.2} GB/s (best {:6.2})  {:7.3} ms",
                format!("{:?} {:?}", kernel.isa, kernel.activations),
                gbs(t),
                gbs(best),
                t * 1e3
            );
        }
    }
    let values = random_vec(&mut rng, 4096 * 4096);
    let v16: Vec<bf16> = values.iter().map(|&v| bf16::from_f32(v)).collect();
    let dense_bf16 = FloatMatrix::new(4096, 4096, DType::BF16, Bytes::from_values(&v16)).unwrap();
    let x = random_vec(&mut rng, 4096);
    let mut y = vec![0.0; 4096];
    for &isa in &isas {
        let (t, best) = time(budget, || {
            dense::gemv(isa, &dense_bf16.view(), &x, 1, &mut y)
        });
        let gbs = |t: f64| (4096 * 4096 * 2) as f64 / t / 1e9;
        println!(
            "   4096x4096 bf16 dense  {isa:<8?} {:6.2} GB/s (best {:6.2})  {:7.3} ms",
            gbs(t),
            gbs(best),
            t * 1e3
        );
    }

    let (m, n, k) = (512, 4096, 4096);
    println!("\nGEMM, {m}x{k} · ({n}x{k})ᵀ (GFLOP/s)");
    let x = random_vec(&mut rng, m * k);
    let mut y = vec![0.0; m * n];
    let flops = 2.0 * (m * n * k) as f64;
    for bits in [4, 8] {
        let w = quantized(&mut rng, n, k, bits, 64);
        for &isa in &isas {
            let (t, best) = time(budget, || matmul::gemm(isa, &w.view(), &x, m, &mut y));
            println!(
                "  {bits}-bit g64      {isa:<8?} {:6.1} GFLOP/s (best {:6.1})",
                flops / t / 1e9,
                flops / best / 1e9
            );
        }
    }
    let dense_f32 = FloatMatrix::from_f32(n, k, &values).unwrap();
    for (name, w) in [("bf16 dense", &dense_bf16), ("f32 dense ", &dense_f32)] {
        for &isa in &isas {
            let (t, best) = time(budget, || dense::gemm(isa, &w.view(), &x, m, &mut y));
            println!(
                "  {name}      {isa:<8?} {:6.1} GFLOP/s (best {:6.1})",
                flops / t / 1e9,
                flops / best / 1e9
            );
        }
    }

    println!("\nGEMV vs GEMM by activation rows, 4096x4096 4-bit g64 (best ms per call)");
    let w = quantized(&mut rng, 4096, 4096, 4, 64);
    let isa = Isa::best();
    for m in 1..=8 {
        let x = random_vec(&mut rng, m * 4096);
        let mut y = vec![0.0; m * 4096];
        let (_, tv) = time(budget / 4, || matmul::gemv(isa, &w.view(), &x, m, &mut y));
        let (_, tm) = time(budget / 4, || matmul::gemm(isa, &w.view(), &x, m, &mut y));
        println!("  m={m}  gemv {:7.3}  gemm {:7.3}", tv * 1e3, tm * 1e3);
    }
}
