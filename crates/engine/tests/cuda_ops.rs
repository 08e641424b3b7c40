//! Every CUDA op against its CPU twin on fresh random inputs, at shapes that hit the kernels'
//! remainders (rows not a multiple of the rows per block, several key tiles and splits).
//!
//! On a machine without an NVIDIA driver these tests print that they were skipped; the kernels'
//! compilation is still checked wherever NVRTC can be loaded (`kernels_compile`).
//!
//! Tolerance: the largest difference over the largest magnitude of the CPU result, 1e-5 where
//! both sides compute in f32 (they differ in summation order only: always on an exact handle),
//! and on the default handle 1e-4 where the 4- and 8-bit GEMVs round activations to int16 per
//! run of 32 (1.8e-5 seen in a simulation of these shapes) and 5e-3 where many-row products
//! round operands to TF32 for the tensor cores.

mod common;

use std::sync::{Mutex, MutexGuard};

use common::{random_float_quantized, random_quantized, random_vec};
use oxlm_engine::ops::recurrent::{self, DeltaRuleDims};
use oxlm_engine::params::{ExpertChoice, ExpertGroups, Scoring};
use oxlm_engine::quant::{QuantMode, SUPPORTED_BITS, SUPPORTED_GROUP_SIZES};
use oxlm_engine::{
    cpu, cuda, ops, DType, DecodeSteps, Device, EngineError, FloatMatrix, KvPrecision, KvQuant,
    KvRing, Positions, QuantizedMatrix, Tensor,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const EXACT: f32 = 1e-5;
const INT16: f32 = 1e-4;
const TF32: f32 = 5e-3;

/// The code caches the attention tests take beside f32 and f16 ones: mlx-lm's `--kv-bits 8` and
/// 4 bits in groups of 32. The host's attention over codes in groups of 64 rounds queries and
/// weights to int16 (within 1e-4 of the largest output of the exact sums, `kv.rs`), the GPU's
/// does not: their tolerance.
const CODES: [KvPrecision; 2] = [
    KvPrecision::Q8,
    KvPrecision::Quantized(KvQuant { bits: 4, group: 32 }),
];
const CODES_TOLERANCE: f32 = 2e-4;

/// Whether a cache in `precision` can hold heads of `d` (codes take whole groups).
fn holds(precision: KvPrecision, d: usize) -> bool {
    match precision {
        KvPrecision::Quantized(q) => d.is_multiple_of(q.group),
        _ => true,
    }
}

/// The tolerance of an attention on an exact handle over a cache in `precision`.
fn attention_tolerance(precision: KvPrecision) -> f32 {
    match precision {
        KvPrecision::Quantized(_) => CODES_TOLERANCE,
        _ => EXACT,
    }
}

/// The tolerance of a product of `m` activation rows with `bits`-bit weights.
fn product_tolerance(bits: u32, m: usize, exact: bool) -> f32 {
    match m {
        _ if exact => EXACT,
        9.. => TF32,
        // From 5 rows, 4- and 8-bit weights go to the tensor cores.
        5.. if matches!(bits, 4 | 8) => TF32,
        _ if matches!(bits, 4 | 8) => INT16,
        _ => EXACT,
    }
}

/// GPU 0, and this test's turn on it: the tests take turns, because a GPU handle has one stream
/// for every thread (a step captured into a graph on one thread would take in another's
/// launches; run side by side, these tests crashed the process on the H200).
fn gpu() -> Option<(Device, MutexGuard<'static, ()>)> {
    static TURN: Mutex<()> = Mutex::new(());
    if !cuda::libraries_present() {
        eprintln!("skipped: no CUDA driver on this machine");
        return None;
    }
    // A test that failed while holding the turn leaves nothing behind that the next one reads.
    let turn = TURN.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    Some((Device::open("cuda").expect("opening GPU 0"), turn))
}

fn on(device: &Device, shape: Vec<usize>, v: &[f32]) -> Tensor {
    Tensor::from_slice(shape, v, device).unwrap()
}

/// max |gpu - cpu| / max |cpu|, both read back to the host.
fn error(gpu: &Tensor, cpu: &Tensor) -> f32 {
    assert_eq!(gpu.shape(), cpu.shape());
    let (g, c) = (gpu.to_vec().unwrap(), cpu.to_vec().unwrap());
    assert!(g.iter().all(|v| v.is_finite()), "non-finite GPU output");
    let scale = c.iter().fold(0.0f32, |m, v| m.max(v.abs())).max(1e-30);
    g.iter()
        .zip(&c)
        .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()))
        / scale
}

fn assert_close(what: &str, gpu: &Tensor, cpu: &Tensor, tolerance: f32) {
    let e = error(gpu, cpu);
    assert!(
        e <= tolerance,
        "{what}: relative error {e:e} over {tolerance:e}"
    );
}

#[test]
fn kernels_compile() {
    if !cuda::compiler_present() {
        eprintln!("skipped: NVRTC is not on this machine");
        return;
    }
    // The traced variant (`OXLM_TRACE`) too, for the GPU it is used on.
    for (major, minor, traced) in [(8, 0, false), (9, 0, false), (9, 0, true)] {
        let cubin = cuda::compile_kernels(major, minor, traced).unwrap();
        assert!(
            cubin.len() > 100_000,
            "sm_{major}{minor}, traced {traced}: {} bytes",
            cubin.len()
        );
    }
}

#[test]
fn quantized_matmul_and_rows() {
    let Some((dev, _turn)) = gpu() else { return };
    let Device::Cuda(g) = &dev else {
        unreachable!()
    };
    let mut rng = StdRng::seed_from_u64(1);
    for &bits in &SUPPORTED_BITS {
        for &group in &SUPPORTED_GROUP_SIZES {
            for dtype in [DType::F32, DType::F16, DType::BF16] {
                let (rows, cols) = (4099, 384);
                let mut w = random_quantized(&mut rng, rows, cols, bits, group, dtype);
                let host = w.clone();
                w.place(&dev).unwrap();
                // Up to 8 rows a GEMV (4- and 8-bit weights on the tensor cores from 5), past
                // that the tensor cores (4 and 8 bits, up to 64 rows) or a cuBLAS product.
                for m in [1, 3, 8, 17, 65] {
                    let x = random_vec(&mut rng, m * cols);
                    let cpu = ops::matmul(&host, &Tensor::new(vec![m, cols], x.clone())).unwrap();
                    for exact in [true, false] {
                        let dev = Device::Cuda(g.with_exact_math(exact));
                        let y = ops::matmul(&w, &on(&dev, vec![m, cols], &x)).unwrap();
                        let what = format!("{bits}-bit g{group} {dtype} m={m} exact={exact}");
                        assert_close(&what, &y, &cpu, product_tolerance(bits, m, exact));
                    }
                }
                // Added into an output: by the GEMV (2 rows), by the tensor cores' one-tile
                // block, which adds its slices up (6), and by `mma_reduce` after two tiles (12).
                for m in [2, 6, 12] {
                    let x = random_vec(&mut rng, m * cols);
                    let r0 = random_vec(&mut rng, m * rows);
                    let mut cpu = Tensor::new(vec![m, rows], r0.clone());
                    let host_x = Tensor::new(vec![m, cols], x.clone());
                    ops::matmul_add(&host, &host_x, &mut cpu).unwrap();
                    let mut y = on(&dev, vec![m, rows], &r0);
                    ops::matmul_add(&w, &on(&dev, vec![m, cols], &x), &mut y).unwrap();
                    let tol = product_tolerance(bits, m, false);
                    assert_close(&format!("{bits}-bit matmul_add m={m}"), &y, &cpu, tol);
                }

                let ids = [0, rows - 1, 17, 17, 1234];
                let cpu = ops::matrix_rows(&host, &ids, &Device::Cpu).unwrap();
                let y = ops::matrix_rows(&w, &ids, &dev).unwrap();
                assert_close(&format!("{bits}-bit rows"), &y, &cpu, EXACT);
            }
        }
    }
}

/// The float modes (mxfp4, nvfp4, mxfp8) on their own kernels: the GEMV up to 8 rows (exact
/// on either handle), cuBLAS on dequantized weights beyond (TF32 on the default handle), added
/// into an output, embedding rows, the gated MLP's one pass (and, with a norm or more than 8
/// rows, the composed steps); the affine-only kernels (grouped projections, the fused
/// projection-rotation-cache write) decline them, the latter writing nothing.
#[test]
fn float_modes_match_the_host() {
    let Some((dev, _turn)) = gpu() else { return };
    let Device::Cuda(g) = &dev else {
        unreachable!()
    };
    let mut rng = StdRng::seed_from_u64(15);
    let tolerance = |m: usize, exact: bool| if exact || m <= 8 { EXACT } else { TF32 };
    for mode in [QuantMode::Mxfp4, QuantMode::Nvfp4, QuantMode::Mxfp8] {
        let (rows, cols) = (4099, 384);
        let host = random_float_quantized(&mut rng, rows, cols, mode);
        let mut w = host.clone();
        w.place(&dev).unwrap();
        for m in [1, 3, 8, 17, 65] {
            let x = random_vec(&mut rng, m * cols);
            let cpu = ops::matmul(&host, &Tensor::new(vec![m, cols], x.clone())).unwrap();
            for exact in [true, false] {
                let dev = Device::Cuda(g.with_exact_math(exact));
                let y = ops::matmul(&w, &on(&dev, vec![m, cols], &x)).unwrap();
                let what = format!("{mode} m={m} exact={exact}");
                assert_close(&what, &y, &cpu, tolerance(m, exact));
            }
        }
        for m in [2, 12] {
            let x = random_vec(&mut rng, m * cols);
            let r0 = random_vec(&mut rng, m * rows);
            let mut cpu = Tensor::new(vec![m, rows], r0.clone());
            ops::matmul_add(&host, &Tensor::new(vec![m, cols], x.clone()), &mut cpu).unwrap();
            let mut y = on(&dev, vec![m, rows], &r0);
            ops::matmul_add(&w, &on(&dev, vec![m, cols], &x), &mut y).unwrap();
            let what = format!("{mode} matmul_add m={m}");
            assert_close(&what, &y, &cpu, tolerance(m, false));
        }
        let ids = [0, rows - 1, 17, 17, 1234];
        let cpu = ops::matrix_rows(&host, &ids, &Device::Cpu).unwrap();
        let y = ops::matrix_rows(&w, &ids, &dev).unwrap();
        assert_close(&format!("{mode} rows"), &y, &cpu, EXACT);

        let up_host = random_float_quantized(&mut rng, rows, cols, mode);
        let mut up = up_host.clone();
        up.place(&dev).unwrap();
        let norm_weight = random_vec(&mut rng, cols);
        let weight = on(&dev, vec![cols], &norm_weight);
        for m in [1, 5, 8, 12] {
            for with_norm in [false, true] {
                let x = random_vec(&mut rng, m * cols);
                let mut xc = Tensor::new(vec![m, cols], x.clone());
                if with_norm {
                    let w = Tensor::new(vec![cols], norm_weight.clone());
                    ops::rms_norm_inplace(&mut xc, &w, 1e-5).unwrap();
                }
                let norm = with_norm.then_some(ops::InputNorm {
                    weight: &weight,
                    eps: 1e-5,
                });
                let xg = on(&dev, vec![m, cols], &x);
                let act = ops::Activation::GeluApprox;
                let cpu = ops::quantized_glu(&host, &up_host, &xc, None, act).unwrap();
                let y = ops::quantized_glu(&w, &up, &xg, norm, act).unwrap();
                let what = format!("{mode} glu m={m} norm={with_norm}");
                assert_close(&what, &y, &cpu, tolerance(m, false));
                let ys = ops::quantized_matmul_group(&[&w, &up], &xg, norm).unwrap();
                for (y, h) in ys.iter().zip([&host, &up_host]) {
                    let cpu = ops::matmul(h, &xc).unwrap();
                    let what = format!("{mode} group m={m} norm={with_norm}");
                    assert_close(&what, y, &cpu, tolerance(m, false));
                }
            }
        }

        // The fused projections of one token: not for these weights, and nothing written.
        let (heads, kv_heads, d, capacity) = (2, 1, 64, 4);
        let q = random_float_quantized(&mut rng, heads * d, cols, mode);
        let kv = random_float_quantized(&mut rng, kv_heads * d, cols, mode);
        let [mut q, mut kv] = [q, kv];
        q.place(&dev).unwrap();
        kv.place(&dev).unwrap();
        let ring = || KvRing::zeros(kv_heads * capacity * d, KvPrecision::F32, &dev).unwrap();
        let (mut keys, mut values) = (ring(), ring());
        let freqs = on(&dev, vec![d / 2], &random_vec(&mut rng, d / 2));
        let at = Positions::new(vec![1], &dev).unwrap();
        let x = on(&dev, vec![1, cols], &random_vec(&mut rng, cols));
        let fused = ops::qkv_rope_write(
            [(&q, None), (&kv, None), (&kv, None)],
            &x,
            None,
            ops::Heads {
                heads,
                kv_heads,
                head_dim: d,
            },
            ops::Rotation {
                inv_freqs: &freqs,
                traditional: false,
                amplitude: 1.0,
            },
            &at,
            ops::KvTarget {
                keys: &mut keys,
                values: &mut values,
                capacity,
            },
        );
        assert!(fused.unwrap().is_none(), "{mode}: fused qkv_rope_write");
        assert!(keys.to_vec().unwrap().iter().all(|&e| e == 0.0));
    }
}

/// Products of many rows into a new output and added to one: for 3 and 6 bits (whose runs of
/// 4 straddle words) through cuBLAS, at 2048 rows over two dequantized slices of the matrix
/// (the last shorter); for 4 and 8 bits on the tensor cores, in slices of the runs.
#[test]
fn many_row_products_in_row_slices() {
    let Some((dev, _turn)) = gpu() else { return };
    let mut rng = StdRng::seed_from_u64(11);
    let (rows, cols) = (2500, 4096);
    let cases = [
        (4, DType::BF16, 12),
        (8, DType::F16, 40),
        (3, DType::F16, 2048),
        (6, DType::F32, 12),
    ];
    for (bits, dtype, m) in cases {
        let host = random_quantized(&mut rng, rows, cols, bits, 64, dtype);
        let mut w = host.clone();
        w.place(&dev).unwrap();
        let x = random_vec(&mut rng, m * cols);
        let cpu = ops::matmul(&host, &Tensor::new(vec![m, cols], x.clone())).unwrap();
        let y = ops::matmul(&w, &on(&dev, vec![m, cols], &x)).unwrap();
        assert_close(&format!("{bits}-bit {rows}x{cols} m={m}"), &y, &cpu, TF32);
        let r0 = random_vec(&mut rng, m * rows);
        let mut cpu = Tensor::new(vec![m, rows], r0.clone());
        ops::matmul_add(&host, &Tensor::new(vec![m, cols], x.clone()), &mut cpu).unwrap();
        let mut y = on(&dev, vec![m, rows], &r0);
        ops::matmul_add(&w, &on(&dev, vec![m, cols], &x), &mut y).unwrap();
        assert_close(
            &format!("{bits}-bit {rows}x{cols} m={m} add"),
            &y,
            &cpu,
            TF32,
        );
    }
}

/// Steps whose temporaries outgrow the steps' arena (256 MiB at first) double it, so that the
/// next steps are captured and replayed whole, and give the same result throughout: each step
/// makes 320 products of 1 MiB (64 rows by 4,096) and sums them, and the sum matches the host's.
#[test]
fn decode_steps_grow_their_arena() {
    let Some((dev, _turn)) = gpu() else { return };
    let mut rng = StdRng::seed_from_u64(14);
    let (rows, cols, m, products) = (4096, 256, 64, 320);
    let host = random_quantized(&mut rng, rows, cols, 4, 64, DType::BF16);
    let mut w = host.clone();
    w.place(&dev).unwrap();
    let x = random_vec(&mut rng, m * cols);
    let mut cpu = ops::matmul(&host, &Tensor::new(vec![m, cols], x.clone())).unwrap();
    ops::scale_inplace(&mut cpu, products as f32).unwrap();
    let xg = on(&dev, vec![m, cols], &x);
    let mut steps = DecodeSteps::new(&dev);
    let first = steps.arena_bytes().unwrap();
    let mut sums = Vec::new();
    for _ in 0..5 {
        let sum = steps
            .run(|| {
                let mut sum = ops::matmul(&w, &xg)?;
                for _ in 1..products {
                    ops::add_inplace(&mut sum, &ops::matmul(&w, &xg)?)?;
                }
                sum.to_vec()
            })
            .unwrap();
        sums.push(sum);
    }
    assert!(
        steps.arena_bytes().unwrap() > first,
        "the arena did not grow"
    );
    assert!(steps.replayed() > 0, "no step was replayed");
    for sum in &sums {
        assert_eq!(sum, &sums[0], "the steps' sums differ");
    }
    let gpu_sum = Tensor::new(vec![m, rows], sums[0].clone());
    assert_close(
        "the steps' sum",
        &gpu_sum,
        &cpu,
        product_tolerance(4, m, false),
    );
}

/// Greedy picks on the GPU, against the host's, over rows with ties (values on a coarse grid),
/// NaNs and a row of -inf, wider than the kernel's block: the same ids, and log-probabilities
/// within 1e-5 (the GPU sums in f32, in another order).
#[test]
fn greedy_rows_match_the_host() {
    let Some((dev, _turn)) = gpu() else { return };
    let mut rng = StdRng::seed_from_u64(12);
    // Rows read in 16-byte loads, and rows that are not.
    for (rows, cols) in [(37, 32000), (9, 1001)] {
        let mut x: Vec<f32> = random_vec(&mut rng, rows * cols)
            .into_iter()
            .map(|v| (v * 8.0).round())
            .collect();
        x[5 * cols + 17] = f32::NAN;
        x[6 * cols] = f32::NAN;
        x[7 * cols..8 * cols].fill(f32::NEG_INFINITY);
        let host = ops::greedy_rows(&Tensor::new(vec![rows, cols], x.clone())).unwrap();
        let picked = ops::greedy_rows(&on(&dev, vec![rows, cols], &x)).unwrap();
        assert_eq!(host[7].id, 0);
        for (r, (gpu, host)) in picked.iter().zip(&host).enumerate() {
            assert_eq!(gpu.id, host.id, "{rows}x{cols} row {r}");
            let close = (gpu.logprob - host.logprob).abs() < 1e-5;
            // Rows with a NaN, or all -inf, have none.
            let neither = gpu.logprob.is_nan() && host.logprob.is_nan();
            assert!(close || neither, "{rows}x{cols} row {r}: {gpu:?} {host:?}");
        }
        assert!(host[0].logprob < -1.0 && host[0].logprob.is_finite());
    }
}

/// Greedy picks held to masks on the GPU, against the host's: rows with and without a mask,
/// masks that allow a scattered third of the columns, a single column, or a column beside a
/// NaN, on rows read in 16-byte loads and rows that are not.
#[test]
fn masked_greedy_rows_match_the_host() {
    let Some((dev, _turn)) = gpu() else { return };
    let mut rng = StdRng::seed_from_u64(15);
    for (rows, cols) in [(6, 32000), (5, 1001)] {
        let x = random_vec(&mut rng, rows * cols);
        let words = cols.div_ceil(32);
        let mut third = vec![0u32; words];
        let mut single = vec![0u32; words];
        for c in (0..cols).filter(|c| c % 3 == 1) {
            third[c / 32] |= 1 << (c % 32);
        }
        single[(cols - 1) / 32] |= 1 << ((cols - 1) % 32);
        let mut x_nan = x.clone();
        x_nan[2 * cols] = f32::NAN;
        let first = [1u32];
        let mut beside_nan = vec![0u32; words];
        beside_nan[0] = 0b11;
        let masks: Vec<Option<&[u32]>> = vec![
            Some(&third),
            None,
            Some(&beside_nan),
            Some(&single),
            Some(&third),
        ];
        let masks = &masks[..rows.min(masks.len())];
        let mut allowed: Vec<Option<&[u32]>> = masks.to_vec();
        allowed.resize(rows, None);
        let host =
            ops::greedy_rows_allowed(&Tensor::new(vec![rows, cols], x_nan.clone()), &allowed)
                .unwrap();
        let picked =
            ops::greedy_rows_allowed(&on(&dev, vec![rows, cols], &x_nan), &allowed).unwrap();
        assert_eq!(host[3].id as usize, cols - 1);
        assert_eq!(host[3].logprob, 0.0);
        assert_eq!(host[2].id, 1, "the NaN at column 0 is passed over");
        assert_eq!(host[0].id % 3, 1);
        for (r, (gpu, host)) in picked.iter().zip(&host).enumerate() {
            assert_eq!(gpu.id, host.id, "{rows}x{cols} row {r}");
            let close = (gpu.logprob - host.logprob).abs() < 1e-5;
            let neither = gpu.logprob.is_nan() && host.logprob.is_nan();
            assert!(close || neither, "{rows}x{cols} row {r}: {gpu:?} {host:?}");
        }
        // A mask of one word is short of the row.
        let short: Vec<Option<&[u32]>> = vec![Some(&first); rows];
        assert!(ops::greedy_rows_allowed(&on(&dev, vec![rows, cols], &x), &short).is_err());
    }
}

/// The shapes where the int16-activation GEMVs change their launch: short rows (8 warps a
/// block) and long ones (16 warps), each with a last block partly past the matrix's end, and
/// rows long enough that several activation rows no longer fit a block's shared memory (the
/// tensor-core product takes over, from one tile of 8 rows).
#[test]
fn int16_gemv_launches() {
    let Some((dev, _turn)) = gpu() else { return };
    let mut rng = StdRng::seed_from_u64(9);
    let shapes = [
        (8200, 256, 4, DType::BF16),
        (300, 5632, 8, DType::F16),
        (136, 14336, 4, DType::BF16),
        // Over 2^24 weights: 2-4 rows take the ring kernels (weight runs through shared memory),
        // and rows of 63 groups leave every other row's scales at an odd half of a word.
        (4200, 4032, 4, DType::F16),
    ];
    for (rows, cols, bits, dtype) in shapes {
        let w = random_quantized(&mut rng, rows, cols, bits, 64, dtype);
        let up = random_quantized(&mut rng, rows, cols, bits, 64, dtype);
        let (mut wg, mut ug) = (w.clone(), up.clone());
        wg.place(&dev).unwrap();
        ug.place(&dev).unwrap();
        // Four rows: the most the int16 kernels take before the tensor cores do (from five).
        // Four rows of 14,336 activations are over their shared memory: the tensor cores.
        for m in [1, 2, 3, 4] {
            let x = random_vec(&mut rng, m * cols);
            let host_x = Tensor::new(vec![m, cols], x.clone());
            let cpu = ops::matmul(&w, &host_x).unwrap();
            let y = ops::matmul(&wg, &on(&dev, vec![m, cols], &x)).unwrap();
            let what = format!("{rows}x{cols} {bits}-bit m={m}");
            let tol = if (cols, m) == (14336, 4) { TF32 } else { INT16 };
            assert_close(&what, &y, &cpu, tol);
            let act = ops::Activation::Silu;
            let cpu = ops::quantized_glu(&w, &up, &host_x, None, act).unwrap();
            let y = ops::quantized_glu(&wg, &ug, &on(&dev, vec![m, cols], &x), None, act).unwrap();
            assert_close(&format!("{what} glu"), &y, &cpu, tol);
        }
    }
}

/// Random g64 matrices of `rows[i]` × `cols`, on the host and copies placed on `dev`.
fn projections(
    rng: &mut StdRng,
    dev: &Device,
    rows: &[usize],
    cols: usize,
    bits: u32,
    dtype: DType,
) -> (Vec<QuantizedMatrix>, Vec<QuantizedMatrix>) {
    let hosts: Vec<_> = rows
        .iter()
        .map(|&r| random_quantized(rng, r, cols, bits, 64, dtype))
        .collect();
    let placed = hosts
        .iter()
        .map(|w| {
            let mut w = w.clone();
            w.place(dev).unwrap();
            w
        })
        .collect();
    (hosts, placed)
}

/// One to three projections of one input in one launch (attention's, an output head: one
/// matrix through the one-wave GEMV), against each alone on the CPU; from 5 rows, on the tensor
/// cores from activations made (and normed) once for all of them.
#[test]
fn quantized_matmul_group_in_one_launch() {
    let Some((dev, _turn)) = gpu() else { return };
    let mut rng = StdRng::seed_from_u64(10);
    // 10,240 columns: longer than the tensor-core activations hold in registers (8,192).
    for (bits, dtype, cols) in [
        (4, DType::BF16, 512),
        (8, DType::F32, 512),
        // 18 runs: the tensor cores' last turn of four is partial.
        (4, DType::F32, 576),
        (8, DType::F16, 576),
        (4, DType::F16, 10240),
    ] {
        let (hosts, placed) = projections(&mut rng, &dev, &[520, 130, 130], cols, bits, dtype);
        let norm_weight = random_vec(&mut rng, cols);
        for count in [1, 2, 3] {
            for m in [1, 4, 12] {
                for with_norm in [false, true] {
                    // Rows of 10,240 take the tensor cores from two of them: their int16
                    // activations do not fit a block.
                    let tol = match (cols, m) {
                        (10240, 2..) => TF32,
                        _ => product_tolerance(bits, m, false),
                    };
                    let x = random_vec(&mut rng, m * cols);
                    let refs: Vec<_> = placed[..count].iter().collect();
                    let weight = on(&dev, vec![cols], &norm_weight);
                    let norm = with_norm.then_some(ops::InputNorm {
                        weight: &weight,
                        eps: 1e-5,
                    });
                    let xg = on(&dev, vec![m, cols], &x);
                    let ys = ops::quantized_matmul_group(&refs, &xg, norm).unwrap();
                    assert_eq!(ys.len(), count);
                    let mut xc = Tensor::new(vec![m, cols], x.clone());
                    if with_norm {
                        let w = Tensor::new(vec![cols], norm_weight.clone());
                        ops::rms_norm_inplace(&mut xc, &w, 1e-5).unwrap();
                    }
                    for (y, w) in ys.iter().zip(&hosts) {
                        let cpu = ops::matmul(w, &xc).unwrap();
                        let what = format!(
                            "{bits}-bit group of {count}, {} rows, m={m}, norm {with_norm}",
                            w.rows
                        );
                        assert_close(&what, y, &cpu, tol);
                    }
                    if count == 2 && with_norm {
                        let act = ops::Activation::Silu;
                        // Gate and up projections of one shape: the first matrix twice.
                        let (g, gc) = (&placed[0], &hosts[0]);
                        let y = ops::quantized_glu(g, g, &xg, norm, act).unwrap();
                        let cpu = ops::quantized_glu(gc, gc, &xc, None, act).unwrap();
                        assert_close(&format!("{bits}-bit glu, norm, m={m}"), &y, &cpu, tol);
                    }
                }
            }
        }
    }
}

/// Attention's projections (with and without biases), RoPE and the cache write of one token in
/// one launch, against those steps on the CPU: the queries, and both rings whole (the token's
/// slot, wrapped round the ring, and the zeros beside it), of f32, f16 or codes (whose groups
/// the heads' last warps quantize). Where it does not apply (two tokens,
/// an exact handle) it writes nothing and says so.
#[test]
fn fused_projection_rotation_and_cache_write() {
    const CAPACITY: usize = 8;
    fn target<'a>(keys: &'a mut KvRing, values: &'a mut KvRing) -> ops::KvTarget<'a> {
        ops::KvTarget {
            keys,
            values,
            capacity: CAPACITY,
        }
    }
    let Some((dev, _turn)) = gpu() else { return };
    let Device::Cuda(g) = &dev else {
        unreachable!()
    };
    let mut rng = StdRng::seed_from_u64(12);
    let (heads, kv_heads, d, cols, capacity, position) = (6, 2, 64, 512, CAPACITY, 11);
    let shape = ops::Heads {
        heads,
        kv_heads,
        head_dim: d,
    };
    let freqs: Vec<f32> = (0..d / 2)
        .map(|i| 10000f32.powf(-2.0 * i as f32 / d as f32))
        .collect();
    for (bits, dtype) in [(4, DType::BF16), (8, DType::F16)] {
        let rows = [heads * d, kv_heads * d, kv_heads * d];
        let (hosts, placed) = projections(&mut rng, &dev, &rows, cols, bits, dtype);
        let norm_weight = random_vec(&mut rng, cols);
        let biases = rows.map(|r| random_vec(&mut rng, r));
        for (traditional, with_norm, biased, precision) in [
            (false, false, false, KvPrecision::F32),
            (false, true, true, KvPrecision::F16),
            (true, false, true, KvPrecision::F16),
            (true, true, false, KvPrecision::F32),
            (false, true, true, CODES[0]),
            (true, false, false, CODES[1]),
        ] {
            let what = format!(
                "{bits}-bit traditional={traditional} norm={with_norm} biased={biased} \
                 {precision:?} cache"
            );
            let x = random_vec(&mut rng, cols);
            let ring = |device: &Device| {
                KvRing::zeros(kv_heads * capacity * d, precision, device).unwrap()
            };
            // An f16 ring's elements may round the other way from sums a little apart, and a
            // code to the next level: a step is at most 2 / levels of a group's largest value.
            let ring_tolerance = match precision {
                KvPrecision::F16 => INT16 + 1e-3,
                KvPrecision::Quantized(q) => INT16 + 2.0 / ((1 << q.bits) - 1) as f32,
                _ => INT16,
            };

            let mut xc = Tensor::new(vec![1, cols], x.clone());
            if with_norm {
                let w = Tensor::new(vec![cols], norm_weight.clone());
                ops::rms_norm_inplace(&mut xc, &w, 1e-5).unwrap();
            }
            let [mut q, mut k, v] = [0, 1, 2].map(|i| {
                let mut y = ops::matmul(&hosts[i], &xc).unwrap();
                if biased {
                    let b = Tensor::new(vec![rows[i]], biases[i].clone());
                    ops::add_row_inplace(&mut y, &b).unwrap();
                }
                y
            });
            let at = Positions::new(vec![position], &Device::Cpu).unwrap();
            let f = Tensor::new(vec![d / 2], freqs.clone());
            let host_rope = ops::Rotation {
                inv_freqs: &f,
                traditional,
                amplitude: 1.0,
            };
            ops::rope_pair_inplace(&mut q, heads, &mut k, kv_heads, d, &at, host_rope).unwrap();
            let (mut keys, mut values) = (ring(&Device::Cpu), ring(&Device::Cpu));
            ops::kv_write((&mut keys, &mut values), &k, &v, kv_heads, d, capacity, &at).unwrap();

            let weight = on(&dev, vec![cols], &norm_weight);
            let norm = with_norm.then_some(ops::InputNorm {
                weight: &weight,
                eps: 1e-5,
            });
            let f = on(&dev, vec![d / 2], &freqs);
            let rope = ops::Rotation {
                inv_freqs: &f,
                traditional,
                amplitude: 1.0,
            };
            let (mut gk, mut gv) = (ring(&dev), ring(&dev));
            let gpu_biases = [0, 1, 2].map(|i| on(&dev, vec![rows[i]], &biases[i]));
            let ws = [0, 1, 2].map(|i| (&placed[i], biased.then_some(&gpu_biases[i])));
            let at = Positions::new(vec![position], &dev).unwrap();
            let xg = on(&dev, vec![1, cols], &x);
            let qg = ops::qkv_rope_write(ws, &xg, norm, shape, rope, &at, target(&mut gk, &mut gv))
                .unwrap()
                .expect("the fused kernel applies");
            assert_close(&format!("{what} queries"), &qg, &q, INT16);
            for (name, gpu_ring, cpu_ring) in [("keys", &gk, &keys), ("values", &gv, &values)] {
                let rows = vec![kv_heads * capacity, d];
                let gpu_ring = Tensor::new(rows.clone(), gpu_ring.to_vec().unwrap());
                let cpu_ring = Tensor::new(rows, cpu_ring.to_vec().unwrap());
                assert_close(
                    &format!("{what} {name}"),
                    &gpu_ring,
                    &cpu_ring,
                    ring_tolerance,
                );
            }

            // Two tokens, or an exact handle: not for this kernel, and nothing written.
            let (mut ek, mut ev) = (ring(&dev), ring(&dev));
            let two = Positions::new(vec![position, position + 1], &dev).unwrap();
            let x2 = on(&dev, vec![2, cols], &[x.clone(), x.clone()].concat());
            let exact = Device::Cuda(g.with_exact_math(true));
            let xe = on(&exact, vec![1, cols], &x);
            for (xs, p) in [(&x2, &two), (&xe, &at)] {
                let r = ops::qkv_rope_write(ws, xs, norm, shape, rope, p, target(&mut ek, &mut ev));
                assert!(r.unwrap().is_none(), "{what}: fused where it should not be");
            }
            assert!(ek.to_vec().unwrap().iter().all(|&e| e == 0.0));
        }
    }
}

#[test]
fn gated_mlp_in_one_pass() {
    let Some((dev, _turn)) = gpu() else { return };
    let mut rng = StdRng::seed_from_u64(8);
    let (rows, cols) = (1500, 512);
    for (bits, group, dtype) in [
        (4, 64, DType::BF16),
        (8, 32, DType::F16),
        (3, 128, DType::F32),
    ] {
        let gate = random_quantized(&mut rng, rows, cols, bits, group, dtype);
        let up = random_quantized(&mut rng, rows, cols, bits, group, dtype);
        let (mut g, mut u) = (gate.clone(), up.clone());
        g.place(&dev).unwrap();
        u.place(&dev).unwrap();
        for act in [ops::Activation::Silu, ops::Activation::GeluApprox] {
            for m in [1, 5, 12] {
                let x = random_vec(&mut rng, m * cols);
                let cpu = ops::quantized_glu(
                    &gate,
                    &up,
                    &Tensor::new(vec![m, cols], x.clone()),
                    None,
                    act,
                )
                .unwrap();
                let y =
                    ops::quantized_glu(&g, &u, &on(&dev, vec![m, cols], &x), None, act).unwrap();
                let tol = product_tolerance(bits, m, false);
                assert_close(&format!("{bits}-bit {act:?} m={m}"), &y, &cpu, tol);
            }
        }
    }
}

/// A mixture's routing, experts and weighted sums on the device against the host's choice and
/// each chosen expert's MLP: softmax and sigmoid routers, renormalized or not, expert groups and
/// a correction bias, shared experts gated and not, and enough tokens that an expert takes more
/// than 8 rows.
#[test]
fn mixtures_route_and_run_their_experts_on_the_device() {
    let Some((dev, _turn)) = gpu() else { return };
    let mut rng = StdRng::seed_from_u64(11);
    struct Case {
        choice: ExpertChoice,
        correction: bool,
        shared: Option<bool>,
        act: ops::Activation,
        format: (u32, usize, DType),
        dims: (usize, usize),
    }
    let softmax = ExpertChoice::softmax;
    let cases = [
        Case {
            choice: softmax(8, 2, true),
            correction: false,
            shared: None,
            act: ops::Activation::Silu,
            format: (4, 64, DType::BF16),
            dims: (256, 192),
        },
        Case {
            choice: ExpertChoice {
                scoring: Scoring::Sigmoid,
                groups: Some(ExpertGroups { count: 4, keep: 2 }),
                scale: 2.5,
                ..softmax(16, 4, true)
            },
            correction: true,
            shared: Some(false),
            act: ops::Activation::GeluApprox,
            format: (8, 32, DType::F16),
            dims: (224, 160),
        },
        Case {
            choice: softmax(32, 4, false),
            correction: false,
            shared: Some(true),
            act: ops::Activation::Silu,
            format: (3, 128, DType::F32),
            dims: (256, 128),
        },
        Case {
            choice: ExpertChoice {
                scoring: Scoring::Sigmoid,
                ..softmax(4, 1, true)
            },
            correction: false,
            shared: None,
            act: ops::Activation::Silu,
            format: (4, 32, DType::F16),
            dims: (128, 96),
        },
    ];
    for case in cases {
        let (bits, group, dtype) = case.format;
        let (dim, hidden) = case.dims;
        let choice = case.choice;
        let host: Vec<[QuantizedMatrix; 3]> = (0..choice.experts)
            .map(|_| {
                [(hidden, dim), (hidden, dim), (dim, hidden)]
                    .map(|(r, c)| random_quantized(&mut rng, r, c, bits, group, dtype))
            })
            .collect();
        let placed: Vec<[QuantizedMatrix; 3]> = host
            .iter()
            .map(|e| {
                e.clone().map(|mut w| {
                    w.place(&dev).unwrap();
                    w
                })
            })
            .collect();
        let refs: Vec<[&QuantizedMatrix; 3]> = placed.iter().map(|[g, u, d]| [g, u, d]).collect();
        let stack = ops::experts::ExpertStack::new(&refs, case.act)
            .unwrap()
            .expect("affine experts of one format on one GPU");
        let correction = case
            .correction
            .then(|| random_vec(&mut rng, choice.experts));
        for n in [1, 3, 40] {
            let what = format!("{choice:?} {bits}-bit n={n}");
            let x = random_vec(&mut rng, n * dim);
            let logits: Vec<f32> = random_vec(&mut rng, n * choice.experts)
                .iter()
                .map(|v| 4.0 * v)
                .collect();
            let shared_out = random_vec(&mut rng, n * dim);
            let shared_gate = random_vec(&mut rng, n);
            let mut scores = logits.clone();
            let chosen = cpu::experts::choose(&choice, correction.as_deref(), &mut scores);
            let mut expected = vec![0.0f32; n * dim];
            for (slot, &(e, weight)) in chosen.iter().enumerate() {
                let t = slot / choice.top_k;
                let row = Tensor::new(vec![1, dim], x[t * dim..][..dim].to_vec());
                let [gate, up, down] = &host[e];
                let h = ops::quantized_glu(gate, up, &row, None, case.act).unwrap();
                let out = ops::matmul(down, &h).unwrap().to_vec().unwrap();
                for (y, o) in expected[t * dim..][..dim].iter_mut().zip(out) {
                    *y += weight * o;
                }
            }
            if let Some(gated) = case.shared {
                for (i, y) in expected.iter_mut().enumerate() {
                    let g = shared_gate[i / dim];
                    *y += if gated { 1.0 / (1.0 + (-g).exp()) } else { 1.0 } * shared_out[i];
                }
            }
            let correction = correction.as_ref().map(|c| on(&dev, vec![c.len()], c));
            let shared_out = on(&dev, vec![n, dim], &shared_out);
            let shared_gate = on(&dev, vec![n, 1], &shared_gate);
            let shared = case
                .shared
                .map(|gated| (&shared_out, gated.then_some(&shared_gate)));
            assert!(ops::experts::mixture_applies(n, &choice), "{what}");
            let y = ops::experts::mixture(
                &stack,
                &choice,
                &on(&dev, vec![n, dim], &x),
                &on(&dev, vec![n, choice.experts], &logits),
                correction.as_ref(),
                shared,
            )
            .unwrap();
            assert_close(&what, &y, &Tensor::new(vec![n, dim], expected), INT16);
            // Logits for one expert too few, and logits left on the host: refused, not read.
            let x = on(&dev, vec![n, dim], &x);
            let short = on(&dev, vec![n * choice.experts - 1], &logits);
            let err = ops::experts::mixture(&stack, &choice, &x, &short, None, None).unwrap_err();
            assert!(matches!(err, EngineError::Shape(_)), "{what}: {err}");
            let host = Tensor::new(vec![n, choice.experts], logits);
            let err = ops::experts::mixture(&stack, &choice, &x, &host, None, None).unwrap_err();
            assert!(matches!(err, EngineError::Device(_)), "{what}: {err}");
        }
    }
}

#[test]
fn dense_matmul_and_rows() {
    let Some((dev, _turn)) = gpu() else { return };
    let Device::Cuda(g) = &dev else {
        unreachable!()
    };
    let mut rng = StdRng::seed_from_u64(2);
    let (rows, cols) = (1001, 200);
    let values = random_vec(&mut rng, rows * cols);
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        let host = FloatMatrix::new(rows, cols, dtype, common::floats_as(dtype, &values)).unwrap();
        let mut w = host.clone();
        w.place(&dev).unwrap();
        for m in [1, 5, 8, 40] {
            let x = random_vec(&mut rng, m * cols);
            let cpu = ops::matmul(&host, &Tensor::new(vec![m, cols], x.clone())).unwrap();
            for exact in [true, false] {
                let dev = Device::Cuda(g.with_exact_math(exact));
                let y = ops::matmul(&w, &on(&dev, vec![m, cols], &x)).unwrap();
                let tol = if m > 8 && !exact { TF32 } else { EXACT };
                assert_close(&format!("{dtype} m={m} exact={exact}"), &y, &cpu, tol);
            }
        }
        let ids = [3, 0, rows - 1];
        let y = ops::matrix_rows(&w, &ids, &dev).unwrap();
        let cpu = ops::matrix_rows(&host, &ids, &Device::Cpu).unwrap();
        assert_close(&format!("{dtype} rows"), &y, &cpu, EXACT);
    }
}

/// Low-rank updates on the GPU against the host's: three updates of ranks 4, 8 and 12 (a rank
/// chunk and a remainder), one for every row and two for some rows each (a row with two
/// updates, one with none of those), beside a second, narrower layer of the same input with an
/// update of its own (one launch pair for both), over inputs three slices wide (the last
/// partial); on a few rows (the kernels) and on many (the products). The steps run as decoding
/// steps do, replayed after the first, each on other rows of the inputs and outputs (looked up
/// by staged ids) and with other rows updated.
#[test]
fn low_rank_updates_by_row() {
    let Some((dev, _turn)) = gpu() else { return };
    let mut rng = StdRng::seed_from_u64(21);
    let (inputs, outputs, narrow, steps) = (2100, 130, 70, 4);
    let placed = |m: &FloatMatrix| {
        let mut m = m.clone();
        m.place(&dev).unwrap();
        m
    };
    let mut pair = |rank: usize, width: usize| {
        let down = random_vec(&mut rng, rank * inputs);
        let up = random_vec(&mut rng, width * rank);
        (
            FloatMatrix::from_f32(rank, inputs, &down).unwrap(),
            FloatMatrix::from_f32(width, rank, &up).unwrap(),
        )
    };
    let matrices = [pair(4, outputs), pair(8, outputs), pair(12, outputs)];
    let narrow_layer = [pair(8, narrow)];
    let on_gpu = |ms: &[(FloatMatrix, FloatMatrix)]| -> Vec<(FloatMatrix, FloatMatrix)> {
        ms.iter().map(|(d, u)| (placed(d), placed(u))).collect()
    };
    let (wide_on_gpu, narrow_on_gpu) = (on_gpu(&matrices), on_gpu(&narrow_layer));
    fn updates<'a>(
        matrices: &'a [(FloatMatrix, FloatMatrix)],
        rows: &[Option<&'a [usize]>],
    ) -> Vec<ops::LowRankUpdate<'a>> {
        (matrices.iter().zip(rows).zip([0.5, -2.0, 1.5]))
            .map(|(((down, up), &rows), scale)| ops::LowRankUpdate {
                down,
                up,
                scale,
                rows,
            })
            .collect()
    }
    for m in [5, 70] {
        let mut table = |cols| {
            let values = random_vec(&mut rng, steps * m * cols);
            FloatMatrix::from_f32(steps * m, cols, &values).unwrap()
        };
        let tables = [table(inputs), table(outputs), table(narrow)];
        let [x_on_gpu, y_on_gpu, z_on_gpu] = tables.each_ref().map(placed);
        let mut decode = DecodeSteps::new(&dev);
        for step in 0..steps {
            let ids: Vec<usize> = (step * m..(step + 1) * m).collect();
            let first = [(4 + step) % m, step % m, (2 + step) % m];
            let second = [m - 1 - step % 2, 2];
            let rows = [None, Some(&first[..]), Some(&second[..])];
            let narrow_rows = [Some(&second[..])];
            let host = |t: &FloatMatrix| ops::matrix_rows(t, &ids, &Device::Cpu).unwrap();
            let (x, mut y, mut z) = (host(&tables[0]), host(&tables[1]), host(&tables[2]));
            ops::add_low_rank(&x, &updates(&matrices, &rows), &mut y).unwrap();
            ops::add_low_rank(&x, &updates(&narrow_layer, &narrow_rows), &mut z).unwrap();
            let wide = updates(&wide_on_gpu, &rows);
            let narrowed = updates(&narrow_on_gpu, &narrow_rows);
            let (gpu_y, gpu_z) = decode
                .run(|| {
                    let x = ops::matrix_rows(&x_on_gpu, &ids, &dev)?;
                    let mut y = ops::matrix_rows(&y_on_gpu, &ids, &dev)?;
                    let mut z = ops::matrix_rows(&z_on_gpu, &ids, &dev)?;
                    ops::add_low_ranks(&x, &mut [(&wide, &mut y), (&narrowed, &mut z)])?;
                    Ok::<_, oxlm_engine::EngineError>((y.to_vec()?, z.to_vec()?))
                })
                .unwrap();
            let tol = if m > 8 { TF32 } else { EXACT };
            let gpu_y = Tensor::new(vec![m, outputs], gpu_y);
            assert_close(&format!("{m} rows, step {step}"), &gpu_y, &y, tol);
            let gpu_z = Tensor::new(vec![m, narrow], gpu_z);
            assert_close(&format!("{m} rows, step {step}, narrow"), &gpu_z, &z, tol);
        }
        if m == 5 {
            assert!(decode.replayed() > 0, "no step was replayed");
        }
    }
}

#[test]
fn element_wise_norms_and_copies() {
    let Some((dev, _turn)) = gpu() else { return };
    let mut rng = StdRng::seed_from_u64(3);
    let (rows, cols) = (7, 1100);
    let a = random_vec(&mut rng, rows * cols);
    let b = random_vec(&mut rng, rows * cols);
    let row = random_vec(&mut rng, cols);
    let shape = vec![rows, cols];
    type Binary = fn(&mut Tensor, &Tensor) -> Result<(), oxlm_engine::EngineError>;
    let binaries: [(&str, Binary); 6] = [
        ("add", ops::add_inplace),
        ("mul", ops::mul_inplace),
        ("silu_mul", ops::silu_mul_inplace),
        ("gelu_mul", ops::gelu_approx_mul_inplace),
        ("sigmoid_mul", ops::sigmoid_mul_inplace),
        ("swiglu_oai_mul", ops::swiglu_oai_mul_inplace),
    ];
    for (name, op) in binaries {
        let mut cpu = Tensor::new(shape.clone(), a.clone());
        op(&mut cpu, &Tensor::new(shape.clone(), b.clone())).unwrap();
        let mut x = on(&dev, shape.clone(), &a);
        op(&mut x, &on(&dev, shape.clone(), &b)).unwrap();
        assert_close(name, &x, &cpu, EXACT);
    }
    type Unary = Box<dyn Fn(&mut Tensor) -> Result<(), oxlm_engine::EngineError>>;
    let row_cpu = Tensor::new(vec![cols], row.clone());
    let row_gpu = on(&dev, vec![cols], &row);
    let (scale_cpu, scale_gpu) = (row_cpu.try_clone().unwrap(), row_gpu.try_clone().unwrap());
    let unaries: [(&str, Unary, Unary); 7] = [
        (
            "scale",
            Box::new(|x| ops::scale_inplace(x, 0.3)),
            Box::new(|x| ops::scale_inplace(x, 0.3)),
        ),
        (
            "softcap",
            Box::new(|x| ops::softcap_inplace(x, 0.5)),
            Box::new(|x| ops::softcap_inplace(x, 0.5)),
        ),
        (
            "silu",
            Box::new(ops::silu_inplace),
            Box::new(ops::silu_inplace),
        ),
        (
            "add_row",
            Box::new(move |x| ops::add_row_inplace(x, &row_cpu)),
            Box::new(move |x| ops::add_row_inplace(x, &row_gpu)),
        ),
        (
            "mul_row",
            Box::new(move |x| ops::mul_row_inplace(x, &scale_cpu)),
            Box::new(move |x| ops::mul_row_inplace(x, &scale_gpu)),
        ),
        (
            "relu_squared",
            Box::new(ops::relu_squared_inplace),
            Box::new(ops::relu_squared_inplace),
        ),
        (
            "rms_norm",
            Box::new(|x| {
                let w = Tensor::new(
                    vec![100],
                    (0..100).map(|i| 0.5 + i as f32 / 100.0).collect(),
                );
                ops::rms_norm_inplace(x, &w, 1e-5)
            }),
            Box::new(|x| {
                let w: Vec<f32> = (0..100).map(|i| 0.5 + i as f32 / 100.0).collect();
                let w = Tensor::from_slice(vec![100], &w, &x.device()).unwrap();
                ops::rms_norm_inplace(x, &w, 1e-5)
            }),
        ),
    ];
    for (name, host_op, gpu_op) in unaries {
        let mut cpu = Tensor::new(shape.clone(), a.clone());
        host_op(&mut cpu).unwrap();
        let mut x = on(&dev, shape.clone(), &a);
        gpu_op(&mut x).unwrap();
        assert_close(name, &x, &cpu, EXACT);
    }
    let (cpu_x, gpu_x) = (
        Tensor::new(shape.clone(), a.clone()),
        on(&dev, shape.clone(), &a),
    );
    assert_close(
        "columns",
        &ops::columns(&gpu_x, 13, 500).unwrap(),
        &ops::columns(&cpu_x, 13, 500).unwrap(),
        0.0,
    );
    let positions: Vec<usize> = (0..rows).map(|r| r * 9).collect();
    let (mut cpu_scaled, mut gpu_scaled) = (cpu_x.try_clone().unwrap(), gpu_x.try_clone().unwrap());
    let at = Positions::new(positions.clone(), &Device::Cpu).unwrap();
    ops::scale_by_position(&mut cpu_scaled, &at, 0.1, 16, 1).unwrap();
    let at = Positions::new(positions, &dev).unwrap();
    ops::scale_by_position(&mut gpu_scaled, &at, 0.1, 16, 1).unwrap();
    assert_close("scale_by_position", &gpu_scaled, &cpu_scaled, 1e-6);
    let part = ops::columns(&cpu_x, 13, 500).unwrap();
    let (mut cpu_dst, mut gpu_dst) = (cpu_x.try_clone().unwrap(), gpu_x.try_clone().unwrap());
    ops::place_columns(&mut cpu_dst, &part, 400).unwrap();
    let gpu_part = on(&dev, part.shape().to_vec(), part.data());
    ops::place_columns(&mut gpu_dst, &gpu_part, 400).unwrap();
    assert_close("place_columns", &gpu_dst, &cpu_dst, 0.0);
    assert_close(
        "rows",
        &ops::rows(&gpu_x, 2, 4).unwrap(),
        &ops::rows(&cpu_x, 2, 4).unwrap(),
        0.0,
    );
    let idx = [6, 0, 3];
    assert_close(
        "gather_rows",
        &ops::gather_rows(&gpu_x, &idx).unwrap(),
        &ops::gather_rows(&cpu_x, &idx).unwrap(),
        0.0,
    );
    let src = random_vec(&mut rng, 3 * cols);
    let weights = [0.5, -1.0, 2.0];
    let mut cpu = cpu_x.clone();
    ops::scatter_add_rows(
        &mut cpu,
        &Tensor::new(vec![3, cols], src.clone()),
        &idx,
        &weights,
    )
    .unwrap();
    let mut y = gpu_x.clone();
    ops::scatter_add_rows(&mut y, &on(&dev, vec![3, cols], &src), &idx, &weights).unwrap();
    assert_close("scatter_add_rows", &y, &cpu, EXACT);
}

#[test]
fn rope() {
    let Some((dev, _turn)) = gpu() else { return };
    let mut rng = StdRng::seed_from_u64(4);
    let (heads, head_dim, half) = (3, 64, 16);
    let freqs: Vec<f32> = (0..half)
        .map(|i| 10000f32.powf(-(i as f32) / half as f32))
        .collect();
    let positions = vec![0, 5, 4095, 70000];
    let x = random_vec(&mut rng, positions.len() * heads * head_dim);
    let shape = vec![positions.len(), heads * head_dim];
    // Plain RoPE both ways, and the turned features scaled as YaRN's and LongRoPE's are.
    for (traditional, amplitude) in [(false, 1.0), (true, 1.0), (false, 1.3)] {
        let mut cpu = Tensor::new(shape.clone(), x.clone());
        let p = Positions::new(positions.clone(), &Device::Cpu).unwrap();
        let fc = Tensor::new(vec![half], freqs.clone());
        let host_rope = ops::Rotation {
            inv_freqs: &fc,
            traditional,
            amplitude,
        };
        ops::rope_inplace(&mut cpu, heads, head_dim, &p, host_rope).unwrap();
        let mut y = on(&dev, shape.clone(), &x);
        let p = Positions::new(positions.clone(), &dev).unwrap();
        let f = on(&dev, vec![half], &freqs);
        let rope = ops::Rotation {
            inv_freqs: &f,
            traditional,
            amplitude,
        };
        ops::rope_inplace(&mut y, heads, head_dim, &p, rope).unwrap();
        assert_close(
            &format!("rope traditional={traditional} amplitude={amplitude}"),
            &y,
            &cpu,
            1e-4,
        );

        // Queries and keys (another head count) in one launch.
        let kv_heads = 2;
        let kx = random_vec(&mut rng, positions.len() * kv_heads * head_dim);
        let kshape = vec![positions.len(), kv_heads * head_dim];
        let mut kcpu = Tensor::new(kshape.clone(), kx.clone());
        let pc = Positions::new(positions.clone(), &Device::Cpu).unwrap();
        ops::rope_inplace(&mut kcpu, kv_heads, head_dim, &pc, host_rope).unwrap();
        let (mut q, mut k) = (on(&dev, shape.clone(), &x), on(&dev, kshape, &kx));
        ops::rope_pair_inplace(&mut q, heads, &mut k, kv_heads, head_dim, &p, rope).unwrap();
        assert_close(
            &format!("rope pair q traditional={traditional} amplitude={amplitude}"),
            &q,
            &cpu,
            1e-4,
        );
        assert_close(
            &format!("rope pair k traditional={traditional} amplitude={amplitude}"),
            &k,
            &kcpu,
            1e-4,
        );
    }
}

/// A cache of `len` random positions in a ring of `capacity`, on both devices, in `precision`
/// on both, so that the GPU's attention is compared with the same keys.
fn cache(
    rng: &mut StdRng,
    dev: &Device,
    precision: KvPrecision,
    kv_heads: usize,
    d: usize,
    capacity: usize,
    len: usize,
) -> [(KvRing, KvRing); 2] {
    let mut pairs = Vec::new();
    let k = random_vec(rng, len * kv_heads * d);
    let v = random_vec(rng, len * kv_heads * d);
    for device in [&Device::Cpu, dev] {
        let ring = || KvRing::zeros(kv_heads * capacity * d, precision, device).unwrap();
        let (mut keys, mut values) = (ring(), ring());
        // Written in two chunks, the second wrapping round the ring when len > capacity.
        let split = len / 3;
        for range in [0..split, split..len] {
            let row = kv_heads * d;
            // A chunk longer than the ring keeps its last `capacity` positions.
            let from = range.end.saturating_sub(capacity).max(range.start);
            let at = Positions::new((from..range.end).collect(), device).unwrap();
            let kc = on(device, vec![at.len(), row], &k[from * row..range.end * row]);
            let vc = on(device, vec![at.len(), row], &v[from * row..range.end * row]);
            let rings = (&mut keys, &mut values);
            ops::kv_write(rings, &kc, &vc, kv_heads, d, capacity, &at).unwrap();
        }
        pairs.push((keys, values));
    }
    let gpu = pairs.pop().unwrap();
    [pairs.pop().unwrap(), gpu]
}

/// Attention's options beside the scale that the attention tests try on every case: none,
/// Gemma 2's soft cap (at a size the scores of random queries and keys reach), gpt-oss's sinks,
/// and both.
const EXTRAS: [(Option<f32>, bool); 4] = [
    (None, false),
    (Some(0.4), false),
    (None, true),
    (Some(0.4), true),
];

/// Sinks for `heads` around the scores' size, the first far above any score (most of its
/// heads' probability goes to it, and the merge of splits takes it as the largest logit) and the
/// second far below.
fn random_sinks(rng: &mut StdRng, heads: usize) -> Vec<f32> {
    let mut s: Vec<f32> = (0..heads).map(|_| rng.random_range(-1.0f32..2.0)).collect();
    s[0] = 6.0;
    if heads > 1 {
        s[1] = -30.0;
    }
    s
}

/// The options of `EXTRAS`' `(softcap, sinks)` at `scale`, the sinks from `sinks`.
fn extras(
    scale: f32,
    (softcap, with_sinks): (Option<f32>, bool),
    sinks: &Tensor,
) -> ops::AttentionOptions<'_> {
    ops::AttentionOptions {
        scale,
        softcap,
        sinks: with_sinks.then_some(sinks),
    }
}

/// Every attention path of one sequence against the CPU: decode's one warp per (token, head)
/// with and without splits of the keys and their merge, over long spans a block of warps per
/// (token, key/value head) splitting each split's tiles, and from 16 queries the products with
/// the masked softmax between them, in slices of queries where their scores would pass
/// `SCORE_BYTES` (the last case: 600 queries of 32 heads over 4096 slots); each with every
/// option of `EXTRAS`.
#[test]
fn attention_full_sliding_and_split() {
    let Some((dev, _turn)) = gpu() else { return };
    let mut rng = StdRng::seed_from_u64(5);
    struct Case {
        heads: usize,
        kv_heads: usize,
        d: usize,
        capacity: usize,
        end: usize,
        window: Option<usize>,
        positions: Vec<usize>,
    }
    let case = |heads, kv_heads, d, capacity, end, window, positions| Case {
        heads,
        kv_heads,
        d,
        capacity,
        end,
        window,
        positions,
    };
    let cases = [
        case(8, 2, 64, 256, 7, None, (0..7).collect()),
        case(4, 4, 128, 4096, 3000, None, vec![2999]),
        case(2, 1, 256, 512, 512, None, vec![100, 511]),
        // Gemma 4's global heads, and multi-head latent attention's rows of 576.
        case(4, 2, 512, 256, 200, None, vec![150, 199]),
        case(8, 1, 576, 512, 300, None, vec![299]),
        case(4, 2, 80, 16, 40, Some(10), vec![39]),
        case(6, 3, 16, 24, 30, Some(8), (20..30).collect()),
        // Splits of 5 tiles and more: a block of warps for a key/value head's query heads,
        // four to a warp (the 0.85B's 32 over 8; 8 tiles, two a warp), a chunk of 3 (14 over
        // 2: 4 and 3; 6 tiles, two or one a warp), ten tokens (f32 rows of 128: one warp a
        // block), a wrapped sliding window, and latent rows of 576 (one head a warp).
        case(32, 8, 64, 16384, 12000, None, vec![11999]),
        case(14, 2, 64, 12288, 9000, None, vec![8999]),
        case(12, 4, 128, 16384, 5000, None, (4990..5000).collect()),
        case(8, 2, 64, 16384, 20000, Some(12000), vec![19999]),
        case(8, 1, 576, 12288, 9000, None, vec![8999]),
        // From 16 queries on attention runs as matrix products.
        case(8, 2, 64, 256, 100, None, (60..100).collect()),
        case(4, 2, 32, 48, 70, Some(16), (50..70).collect()),
        case(2, 2, 128, 512, 300, None, (0..300).collect()),
        case(32, 8, 64, 4096, 4096, None, (3496..4096).collect()),
    ];
    let precisions = [KvPrecision::F32, KvPrecision::F16]
        .into_iter()
        .chain(CODES);
    for (precision, case) in precisions
        .flat_map(|p| cases.iter().map(move |c| (p, c)))
        .filter(|(p, c)| holds(*p, c.d))
    {
        let &Case {
            heads,
            kv_heads,
            d,
            capacity,
            end,
            window,
            ref positions,
        } = case;
        let [(kc, vc), (kg, vg)] = cache(&mut rng, &dev, precision, kv_heads, d, capacity, end);
        let start = end.saturating_sub(capacity);
        let q = random_vec(&mut rng, positions.len() * heads * d);
        let sinks = random_sinks(&mut rng, heads);
        let shape = vec![positions.len(), heads * d];
        for options in EXTRAS {
            let run = |device: &Device, keys: &KvRing, values: &KvRing| {
                let kv = ops::KvView {
                    keys,
                    values,
                    kv_heads,
                    capacity,
                    start,
                    end,
                    window,
                };
                let p = Positions::new(positions.clone(), device).unwrap();
                let q = on(device, shape.clone(), &q);
                let sinks = on(device, vec![heads], &sinks);
                ops::attention(&q, heads, d, &p, &kv, extras(0.125, options, &sinks)).unwrap()
            };
            let cpu = run(&Device::Cpu, &kc, &vc);
            let what = format!(
                "attention {heads}/{kv_heads} heads of {d}, {} queries, {end} positions, window \
                 {window:?}, {precision:?} cache, (softcap, sinks) {options:?}",
                positions.len()
            );
            // From 16 queries the products run on TF32 tensor cores unless the handle is exact.
            let Device::Cuda(g) = &dev else {
                unreachable!()
            };
            let exact_tolerance = attention_tolerance(precision);
            for (exact, tolerance) in [(true, exact_tolerance), (false, TF32)] {
                let gpu = run(&Device::Cuda(g.with_exact_math(exact)), &kg, &vg);
                assert_close(&format!("{what} exact={exact}"), &gpu, &cpu, tolerance);
            }
        }
    }
}

/// One token for each of several sequences, whose caches differ in capacity and length (one
/// a sliding-window ring that has wrapped): the batched write and attention against the CPU,
/// and against the one-sequence attention on the GPU. The cases take every number of query
/// heads a warp of the batched kernel handles, which the count of (sequence, key/value head)
/// pairs picks against the GPU's multiprocessors (on the H200's 132: 1 of groups of 4 and 7 for
/// a few sequences, 2 of groups of 2 and 4 for some more, 4, and 4 then 3 of a group of 7, for
/// many), head dims of 64 to 576 and 36 (whose f16 rows are not whole 16-byte units, staged
/// through registers), and enough sequences (70 × 8 warps) that the keys are not split; f32
/// and f16 caches; each with every option of `EXTRAS` (the writes once, with the first).
#[test]
fn batched_kv_write_and_attention() {
    let Some((dev, _turn)) = gpu() else { return };
    let mut rng = StdRng::seed_from_u64(8);
    let many: Vec<(usize, usize)> = (0..70).map(|i| (64, 1 + i % 64)).collect();
    let some = |n: usize| -> Vec<(usize, usize)> { (0..n).map(|i| (128, 5 + 11 * i)).collect() };
    let cases = [
        (
            8,
            2,
            64,
            None,
            vec![(256, 10), (512, 300), (256, 255), (1024, 700)],
        ),
        (8, 2, 64, Some(16), vec![(16, 40), (16, 5), (16, 16)]),
        (8, 2, 64, None, some(10)),
        (14, 2, 64, None, vec![(128, 100), (512, 511)]),
        (14, 2, 64, None, many.clone()),
        (4, 4, 128, None, vec![(256, 200), (64, 90)]),
        (4, 2, 256, None, vec![(128, 127), (96, 50)]),
        (8, 2, 512, None, some(3)),
        (16, 1, 576, None, some(4)),
        (4, 2, 36, None, some(12)),
        (32, 8, 64, None, many),
    ];
    let precisions = [KvPrecision::F32, KvPrecision::F16]
        .into_iter()
        .chain(CODES);
    for (precision, case) in precisions
        .flat_map(|p| cases.iter().map(move |c| (p, c)))
        .filter(|(p, c)| holds(*p, c.2))
    {
        let (heads, kv_heads, d, window, ref sequences) = *case;
        let row = kv_heads * d;
        let n = sequences.len();
        let mut caches: Vec<[(KvRing, KvRing); 2]> = sequences
            .iter()
            .map(|&(capacity, len)| cache(&mut rng, &dev, precision, kv_heads, d, capacity, len))
            .collect();
        let capacities: Vec<usize> = sequences.iter().map(|s| s.0).collect();
        let at: Vec<usize> = sequences.iter().map(|s| s.1).collect();
        let new_k = random_vec(&mut rng, n * row);
        let new_v = random_vec(&mut rng, n * row);
        let q = random_vec(&mut rng, n * heads * d);
        let sinks = random_sinks(&mut rng, heads);
        for (written, options) in EXTRAS.into_iter().enumerate() {
            let mut outs = Vec::new();
            for side in 0..2 {
                let device = if side == 0 { &Device::Cpu } else { &dev };
                let p = Positions::new(at.clone(), device).unwrap();
                if written == 0 {
                    let (k, v) = (
                        on(device, vec![n, row], &new_k),
                        on(device, vec![n, row], &new_v),
                    );
                    let (mut keys, mut values): (Vec<&mut KvRing>, Vec<&mut KvRing>) = caches
                        .iter_mut()
                        .map(|c| (&mut c[side].0, &mut c[side].1))
                        .unzip();
                    ops::kv_write_batch(
                        &mut keys,
                        &mut values,
                        &capacities,
                        &k,
                        &v,
                        kv_heads,
                        d,
                        &p,
                    )
                    .unwrap();
                }
                let views: Vec<ops::KvView> = caches
                    .iter()
                    .zip(sequences)
                    .map(|(c, &(capacity, len))| ops::KvView {
                        keys: &c[side].0,
                        values: &c[side].1,
                        kv_heads,
                        capacity,
                        start: (len + 1).saturating_sub(capacity),
                        end: len + 1,
                        window,
                    })
                    .collect();
                let q = on(device, vec![n, heads * d], &q);
                let sinks = on(device, vec![heads], &sinks);
                let options = extras(0.125, options, &sinks);
                outs.push(ops::attention_batch(&q, heads, d, &p, &views, options).unwrap());
                if side == 1 {
                    for (i, kv) in views.iter().enumerate() {
                        let one = Positions::new(vec![at[i]], device).unwrap();
                        let alone = ops::attention(
                            &ops::rows(&q, i, 1).unwrap(),
                            heads,
                            d,
                            &one,
                            kv,
                            options,
                        );
                        let batched = ops::rows(&outs[1], i, 1).unwrap();
                        assert_close("batched vs one sequence", &batched, &alone.unwrap(), EXACT);
                    }
                }
            }
            for (i, c) in caches.iter().enumerate() {
                let (gpu, cpu) = (&c[1], &c[0]);
                assert_eq!(gpu.0.to_vec().unwrap(), cpu.0.to_vec().unwrap(), "keys {i}");
                assert_eq!(
                    gpu.1.to_vec().unwrap(),
                    cpu.1.to_vec().unwrap(),
                    "values {i}"
                );
            }
            assert_close(
                &format!(
                    "attention_batch {heads}/{kv_heads} heads of {d}, window {window:?}, \
                 {precision:?} cache, (softcap, sinks) {options:?}"
                ),
                &outs[1],
                &outs[0],
                attention_tolerance(precision),
            );
        }
    }
}

/// A GPU code ring refuses heads that are not whole groups, one sequence's write and a
/// batch's alike, with the host's error.
#[test]
fn code_rings_refuse_heads_of_part_groups() {
    let Some((dev, _turn)) = gpu() else { return };
    let (kv_heads, d, capacity) = (2, 16, 8);
    let ring = || KvRing::zeros(kv_heads * capacity * d, KvPrecision::Q8, &dev).unwrap();
    let (mut keys, mut values) = (ring(), ring());
    let row = on(&dev, vec![1, kv_heads * d], &vec![0.5; kv_heads * d]);
    let at = Positions::new(vec![0], &dev).unwrap();
    let one = ops::kv_write(
        (&mut keys, &mut values),
        &row,
        &row,
        kv_heads,
        d,
        capacity,
        &at,
    );
    let batch = ops::kv_write_batch(
        &mut [&mut keys],
        &mut [&mut values],
        &[capacity],
        &row,
        &row,
        kv_heads,
        d,
        &at,
    );
    for err in [one, batch] {
        let err = err.unwrap_err().to_string();
        assert!(err.contains("multiples of 64"), "{err}");
    }
}

/// Moves between rings of f32, f16 and codes (to the same positions and to others), and a ring
/// turned into another precision (an f16 ring on the GPU rounds as the host's does, a code ring
/// quantizes to the host's codes), equal to the host's; a code ring's codes, scales and biases
/// are the host's to the bit, and go to the GPU and back as they are.
#[test]
fn kv_move_between_rings() {
    let Some((dev, _turn)) = gpu() else { return };
    let mut rng = StdRng::seed_from_u64(6);
    let h = 2;
    for precision in [KvPrecision::F32, KvPrecision::F16]
        .into_iter()
        .chain(CODES)
    {
        let d = if holds(precision, 8) { 8 } else { 64 };
        let [(kc, _), (kg, _)] = cache(&mut rng, &dev, precision, h, d, 16, 40);
        let ring = |device: &Device| KvRing::zeros(h * 24 * d, precision, device).unwrap();
        let mut cpu = ring(&Device::Cpu);
        ops::kv_move(&kc, 16, &mut cpu, 24, h, d, 27..40).unwrap();
        let mut y = ring(&dev);
        ops::kv_move(&kg, 16, &mut y, 24, h, d, 27..40).unwrap();
        assert_eq!(y.to_vec().unwrap(), cpu.to_vec().unwrap(), "{precision:?}");
        // From other positions: 30..34 of the source into 50..54.
        ops::kv_copy(&kc, 16, 30, &mut cpu, 24, h, d, 50..54).unwrap();
        ops::kv_copy(&kg, 16, 30, &mut y, 24, h, d, 50..54).unwrap();
        assert_eq!(
            y.to_vec().unwrap(),
            cpu.to_vec().unwrap(),
            "{precision:?} copied"
        );
        if let KvPrecision::Quantized(_) = precision {
            let (host, gpu) = (
                kc.host_codes().unwrap().unwrap(),
                kg.host_codes().unwrap().unwrap(),
            );
            let (host, gpu) = (host.rows(), gpu.rows());
            assert_eq!(gpu.codes, host.codes, "{precision:?} codes");
            assert_eq!(gpu.scales, host.scales, "{precision:?} scales");
            assert_eq!(gpu.biases, host.biases, "{precision:?} biases");
            let there = kc.clone().to_device(&dev).unwrap();
            assert_eq!(there.precision(), precision);
            let back = there.to_device(&Device::Cpu).unwrap();
            assert_eq!(
                back.host_codes().unwrap().unwrap().rows().codes,
                host.codes,
                "{precision:?} round trip"
            );
        }
        let others = [KvPrecision::F32, KvPrecision::F16]
            .into_iter()
            .chain(CODES);
        for other in others.filter(|&o| o != precision && holds(o, d)) {
            let (kc, kg) = (
                kc.clone().into_precision(other),
                kg.clone().into_precision(other),
            );
            let (kc, kg) = (kc.unwrap(), kg.unwrap());
            assert_eq!(kg.precision(), other);
            assert_eq!(
                kg.to_vec().unwrap(),
                kc.to_vec().unwrap(),
                "{precision:?} to {other:?}"
            );
        }
    }
}

#[test]
fn recurrent_ops() {
    let Some((dev, _turn)) = gpu() else { return };
    let mut rng = StdRng::seed_from_u64(7);
    let (tokens, channels, kernel) = (9, 300, 4);
    let x = random_vec(&mut rng, tokens * channels);
    let w = random_vec(&mut rng, channels * kernel);
    let s0 = random_vec(&mut rng, (kernel - 1) * channels);
    let conv = |device: &Device| {
        let mut state = on(device, vec![kernel - 1, channels], &s0);
        let out = recurrent::causal_conv1d(
            &on(device, vec![tokens, channels], &x),
            &on(device, vec![channels, kernel], &w),
            kernel,
            &mut [&mut state],
        )
        .unwrap();
        (out, state)
    };
    let ((oc, sc), (og, sg)) = (conv(&Device::Cpu), conv(&dev));
    assert_close("conv1d", &og, &oc, EXACT);
    assert_close("conv1d state", &sg, &sc, 0.0);

    for (k_heads, v_heads, k_dim, v_dim) in [(2, 6, 16, 8), (1, 2, 128, 128), (2, 4, 200, 32)] {
        let dims = DeltaRuleDims {
            k_heads,
            v_heads,
            k_dim,
            v_dim,
        };
        let q = random_vec(&mut rng, tokens * k_heads * k_dim);
        let k: Vec<f32> = random_vec(&mut rng, tokens * k_heads * k_dim)
            .iter()
            .map(|v| v * 0.2)
            .collect();
        let v = random_vec(&mut rng, tokens * v_heads * v_dim);
        let a = random_vec(&mut rng, tokens * v_heads);
        let b = random_vec(&mut rng, tokens * v_heads);
        let dt: Vec<f32> = (0..v_heads).map(|_| rng.random_range(-1.0..1.0)).collect();
        let neg_a: Vec<f32> = (0..v_heads).map(|_| -rng.random_range(0.1..2.0)).collect();
        let skip: Vec<f32> = (0..v_heads).map(|_| rng.random_range(-1.0..1.0)).collect();
        let state0 = random_vec(&mut rng, dims.state_len());
        let states0: Vec<Vec<f32>> = (0..tokens)
            .map(|_| random_vec(&mut rng, dims.state_len()))
            .collect();
        // The delta rule's gates and scan, or (`ssm`) Mamba-2's.
        let gates = |device: &Device, ssm: bool| {
            let (a, dt, neg_a) = (
                &on(device, vec![tokens, v_heads], &a),
                &on(device, vec![v_heads], &dt),
                &on(device, vec![v_heads], &neg_a),
            );
            match ssm {
                true => recurrent::ssm_gates(a, dt, neg_a, (0.001, 1.5)),
                false => {
                    recurrent::delta_gates(a, &on(device, vec![tokens, v_heads], &b), dt, neg_a)
                }
            }
            .unwrap()
        };
        let scan =
            |device: &Device, ssm: bool, g: &Tensor, w: &Tensor, states: &mut [&mut Tensor]| {
                let (q, k, v) = (
                    &on(device, vec![tokens, k_heads * k_dim], &q),
                    &on(device, vec![tokens, k_heads * k_dim], &k),
                    &on(device, vec![tokens, v_heads * v_dim], &v),
                );
                match ssm {
                    true => {
                        let d = on(device, vec![v_heads], &skip);
                        recurrent::ssm_scan(q, k, v, g, w, &d, dims, states)
                    }
                    false => recurrent::gated_delta_rule(q, k, v, g, w, dims, states),
                }
                .unwrap()
            };
        for ssm in [false, true] {
            let run = |device: &Device| {
                let (g, w) = gates(device, ssm);
                let mut state = on(device, vec![v_heads, v_dim, k_dim], &state0);
                let y = scan(device, ssm, &g, &w, &mut [&mut state]);
                (g, w, y, state)
            };
            let (gc, wc, yc, sc) = run(&Device::Cpu);
            let (gg, wg, yg, sg) = run(&dev);
            let what = format!("{} {dims:?}", if ssm { "ssm scan" } else { "delta rule" });
            assert_close(&format!("{what} g"), &gg, &gc, 1e-5);
            assert_close(&format!("{what} beta or dt"), &wg, &wc, 1e-6);
            assert_close(&format!("{what} y"), &yg, &yc, 1e-4);
            assert_close(&format!("{what} state"), &sg, &sc, 1e-4);

            // A batched decoding step: token `s` of the chunk is the next of sequence `s`,
            // each with its own state (the same tensors' rows, read as one sequence each).
            let step = |device: &Device| {
                let (g, w) = gates(device, ssm);
                let mut states: Vec<Tensor> = states0
                    .iter()
                    .map(|s| on(device, vec![v_heads, v_dim, k_dim], s))
                    .collect();
                let mut refs: Vec<&mut Tensor> = states.iter_mut().collect();
                let y = scan(device, ssm, &g, &w, &mut refs);
                (y, states)
            };
            let ((yc, sc), (yg, sg)) = (step(&Device::Cpu), step(&dev));
            assert_close(&format!("{what} batched y"), &yg, &yc, 1e-4);
            for (s, (g, c)) in sg.iter().zip(&sc).enumerate() {
                assert_close(&format!("{what} batched state {s}"), g, c, 1e-4);
            }
        }
    }

    // The convolution's batched step: row `s` continues sequence `s`'s own state.
    let states0: Vec<Vec<f32>> = (0..tokens)
        .map(|_| random_vec(&mut rng, (kernel - 1) * channels))
        .collect();
    let conv_step = |device: &Device| {
        let mut states: Vec<Tensor> = states0
            .iter()
            .map(|s| on(device, vec![kernel - 1, channels], s))
            .collect();
        let mut refs: Vec<&mut Tensor> = states.iter_mut().collect();
        let out = recurrent::causal_conv1d(
            &on(device, vec![tokens, channels], &x),
            &on(device, vec![channels, kernel], &w),
            kernel,
            &mut refs,
        )
        .unwrap();
        (out, states)
    };
    let ((oc, sc), (og, sg)) = (conv_step(&Device::Cpu), conv_step(&dev));
    assert_close("batched conv1d", &og, &oc, EXACT);
    for (s, (g, c)) in sg.iter().zip(&sc).enumerate() {
        assert_close(&format!("batched conv1d state {s}"), g, c, 0.0);
    }
}
