//! Throughput of the CPU decode attention over a long cache, on one thread unless told otherwise.
//!
//! `cargo run --release -p oxlm-engine --example attention_bench [context] [threads]`
//!
//! The shape is the synthetic 0.85B llama's (32 query heads over 8 key/value heads of 64): one
//! query token over `context` cached positions of sixteen layers (so that the reads come from
//! memory, as in decoding), with the cache in f32 and in f16, reported as milliseconds per token
//! and GB/s of keys and values read.

use std::time::Instant;

use half::f16;
use oxlm_engine::cpu::attention::{self, KvElem};
use oxlm_engine::cpu::pool;
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
    report::<f32>("f32", &caches, &q, &shape, threads);
    report::<f16>("f16", &caches, &q, &shape, threads);
}

struct Shape {
    heads: usize,
    kv_heads: usize,
    d: usize,
    context: usize,
}

/// Times attention over `caches` stored as `T`: the best of five tokens.
fn report<T: KvElem>(
    name: &str,
    caches: &[(Vec<f32>, Vec<f32>)],
    q: &[f32],
    s: &Shape,
    threads: usize,
) {
    let stored: Vec<(Vec<T>, Vec<T>)> = caches
        .iter()
        .map(|(k, v)| {
            (
                k.iter().map(|&x| T::from_f32(x)).collect(),
                v.iter().map(|&x| T::from_f32(x)).collect(),
            )
        })
        .collect();
    let mut out = vec![0.0; s.heads * s.d];
    let mut best = f64::INFINITY;
    for _ in 0..50 {
        let t = Instant::now();
        for (keys, values) in &stored {
            let view = attention::KvView::sequence(keys, values, s.kv_heads, s.context);
            attention::attention(q, s.heads, s.d, &[s.context - 1], &view, 0.125, &mut out);
        }
        best = best.min(t.elapsed().as_secs_f64());
    }
    let bytes = (stored.len() * 2 * s.kv_heads * s.context * s.d * std::mem::size_of::<T>()) as f64;
    println!(
        "{name} cache, context {}, {threads} thread(s): {:.2} ms per token, {:.1} GB/s",
        s.context,
        best * 1e3,
        bytes / best / 1e9
    );
}
