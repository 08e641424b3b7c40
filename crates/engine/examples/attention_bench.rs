//! Throughput of the CPU decode attention over a long cache, on one thread unless told otherwise.
//!
//! `cargo run --release -p oxlm-engine --example attention_bench [context] [threads]`
//!
//! The shape is the synthetic 0.85B llama's (32 query heads over 8 key/value heads of 64): one
//! query token over `context` cached positions of sixteen layers (so that the reads come from
//! memory, as in decoding), with the cache in f32, in f16 and in 8- and 4-bit codes, reported as
//! milliseconds per token and GB/s of keys and values read (codes, scales and biases).

use std::time::Instant;

use half::f16;
use oxlm_engine::cpu::attention::{self, KvRows, QuantRows};
use oxlm_engine::cpu::pool;
use oxlm_engine::{KvQuant, QuantRing};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

fn main() {
    let mut args = std::env::args().skip(1);
    let context: usize = args.next().map_or(4096, |a| a.parse().expect("context"));
    let threads: usize = args.next().map_or(1, |a| a.parse().expect("threads"));
    pool::set_threads(threads);
    let (heads, kv_heads, d) = (32, 8, 64);
    let layers: usize = std::env::var("LAYERS").map_or(16, |v| v.parse().unwrap());
    let mut rng = StdRng::seed_from_u64(7);
    let mut random =
        |n: usize| -> Vec<f32> { (0..n).map(|_| rng.random_range(-1.0..1.0)).collect() };
    let caches: Vec<(Vec<f32>, Vec<f32>)> = (0..layers)
        .map(|_| {
            (
                random(kv_heads * context * d),
                random(kv_heads * context * d),
            )
        })
        .collect();
    let q = random(heads * d);
    let shape = Shape {
        heads,
        kv_heads,
        d,
        context,
    };
    let as_elems = |stored: &[(Vec<f32>, Vec<f32>)]| -> Vec<(Vec<f16>, Vec<f16>)> {
        let half = |x: &[f32]| x.iter().map(|&v| f16::from_f32(v)).collect();
        stored.iter().map(|(k, v)| (half(k), half(v))).collect()
    };
    let f32_rows: Vec<(&[f32], &[f32])> = caches.iter().map(|(k, v)| (&k[..], &v[..])).collect();
    report("f32", 4.0, &f32_rows, &q, &shape, threads);
    let halves = as_elems(&caches);
    let f16_rows: Vec<(&[f16], &[f16])> = halves.iter().map(|(k, v)| (&k[..], &v[..])).collect();
    report("f16", 2.0, &f16_rows, &q, &shape, threads);
    for quant in [KvQuant::Q8, KvQuant::new(4, 64).unwrap()] {
        let codes = |x: &[f32]| QuantRing::quantized(x, quant).expect("whole groups");
        let codes: Vec<(QuantRing, QuantRing)> =
            caches.iter().map(|(k, v)| (codes(k), codes(v))).collect();
        let rows: Vec<(QuantRows, QuantRows)> =
            codes.iter().map(|(k, v)| (k.rows(), v.rows())).collect();
        let bytes = quant.bytes_for(quant.group) as f64 / quant.group as f64;
        report(
            &format!("{}-bit", quant.bits),
            bytes,
            &rows,
            &q,
            &shape,
            threads,
        );
    }
}

struct Shape {
    heads: usize,
    kv_heads: usize,
    d: usize,
    context: usize,
}

/// Times attention over the layers' `caches`, which keep an element in `bytes`: the best of fifty
/// tokens.
fn report<R: KvRows>(
    name: &str,
    bytes: f64,
    caches: &[(R, R)],
    q: &[f32],
    s: &Shape,
    threads: usize,
) {
    let mut out = vec![0.0; s.heads * s.d];
    let mut best = f64::INFINITY;
    for _ in 0..50 {
        let t = Instant::now();
        for &(keys, values) in caches {
            let view = attention::KvView::sequence(keys, values, s.kv_heads, s.context);
            let options = attention::Options::scaled(0.125);
            attention::attention(q, s.heads, s.d, &[s.context - 1], &view, options, &mut out);
        }
        best = best.min(t.elapsed().as_secs_f64());
    }
    let bytes = (caches.len() * 2 * s.kv_heads * s.context * s.d) as f64 * bytes;
    println!(
        "{name} cache, context {}, {threads} thread(s): {:.2} ms per token, {:.1} GB/s",
        s.context,
        best * 1e3,
        bytes / best / 1e9
    );
}
