//! GPU matmul throughput on random MLX-quantized weights, at the shapes of the benchmark
//! llamas and of larger models (a 70B's MLP, an 8B's head of 128,256 rows): for one activation
//! row (decoding), the time per call inside replayed step graphs, as decoding runs them, over
//! copies of the matrix that together outgrow the L2 cache many times (so that a step's launch
//! and download weigh little beside its calls), and the GB/s of weight bytes that makes; for a
//! 2048-row prefill, TFLOP/s.
//!
//! `cargo run --release -p oxlm-engine --example cuda_gemv [ROWSxCOLS...]` on a machine with a
//! CUDA GPU: every shape, or the ones named (to profile one, for example).

use std::time::Instant;

use oxlm_engine::{cuda, ops, Bytes, DType, DecodeSteps, Device, QuantizedMatrix, Tensor};

/// Bytes of weights each decode step reads: many times the H200's 60 MB of L2.
const STEP_BYTES: usize = 1 << 30;

fn random_matrix(rows: usize, cols: usize, bits: u32, seed: u64) -> QuantizedMatrix {
    let mut s = seed.wrapping_mul(6364136223846793005) | 1;
    let mut next = || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s
    };
    let words: Vec<u32> = (0..rows * cols * bits as usize / 32)
        .map(|_| next() as u32)
        .collect();
    let groups = rows * cols / 64;
    let scale: Vec<half::bf16> = (0..groups)
        .map(|_| half::bf16::from_f32(0.01 + (next() % 100) as f32 * 1e-4))
        .collect();
    let bias: Vec<half::bf16> = (0..groups).map(|_| half::bf16::from_f32(-0.05)).collect();
    QuantizedMatrix::new(
        rows,
        cols,
        bits,
        64,
        Bytes::from_values(&words),
        DType::BF16,
        Bytes::from_values(&scale),
        Bytes::from_values(&bias),
    )
    .unwrap()
}

/// Seconds per call of `f`, the median of timed batches after a warm-up.
fn time(device: &Device, mut f: impl FnMut()) -> f64 {
    for _ in 0..5 {
        f();
    }
    device.synchronize().unwrap();
    let mut runs = Vec::new();
    for _ in 0..7 {
        let t = Instant::now();
        for _ in 0..20 {
            f();
        }
        device.synchronize().unwrap();
        runs.push(t.elapsed().as_secs_f64() / 20.0);
    }
    runs.sort_by(f64::total_cmp);
    runs[runs.len() / 2]
}

fn main() {
    if !cuda::libraries_present() {
        eprintln!("no CUDA driver on this machine");
        return;
    }
    let device = Device::open("cuda").unwrap();
    println!("{device}");
    let named: Vec<String> = std::env::args().skip(1).collect();
    let shapes = [
        (2048, 2048),
        (5632, 2048),
        (2048, 5632),
        (32000, 2048),
        (14336, 4096),
        (4096, 14336),
        (28672, 8192),
        (8192, 28672),
        (128256, 4096),
    ];
    let chosen = shapes
        .into_iter()
        .filter(|(r, c)| named.is_empty() || named.contains(&format!("{r}x{c}")));
    for (rows, cols) in chosen {
        for bits in [4, 8] {
            let mut w = random_matrix(rows, cols, bits, (rows * cols) as u64);
            w.place(&device).unwrap();
            let bytes = w.size_in_bytes() as f64;
            let copies: Vec<QuantizedMatrix> = (0..STEP_BYTES.div_ceil(w.size_in_bytes()))
                .map(|i| {
                    let mut c = random_matrix(rows, cols, bits, i as u64);
                    c.place(&device).unwrap();
                    c
                })
                .collect();
            let x1 = Tensor::from_slice(vec![1, cols], &vec![0.5; cols], &device).unwrap();
            let mut steps = DecodeSteps::new(&device);
            let t1 = time(&device, || {
                steps
                    .run(|| {
                        let mut last = None;
                        for c in &copies {
                            last = Some(ops::matmul(c, &x1)?);
                        }
                        last.unwrap().to_vec()
                    })
                    .unwrap();
            }) / copies.len() as f64;
            let m = 2048;
            let xm = Tensor::from_slice(vec![m, cols], &vec![0.5; m * cols], &device).unwrap();
            let tm = time(&device, || {
                ops::matmul(&w, &xm).unwrap();
            });
            println!(
                "{rows:>6}x{cols:<6} {bits}-bit  m=1 {:8.1} us {:6.0} GB/s   m={m} {:8.1} us {:6.1} TFLOP/s",
                t1 * 1e6,
                bytes / t1 / 1e9,
                tm * 1e6,
                2.0 * (m * rows * cols) as f64 / tm / 1e12
            );
        }
    }
}
