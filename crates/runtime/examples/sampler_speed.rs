//! Microseconds a token the sampler spends on one row of logits as large as Qwen's vocabulary
//! (151,936), for greedy picks and the usual filters: what a sampled token costs on the host
//! beside the forward pass. Two rows: a flat one (normal logits, σ = 3, whose top-p nucleus is
//! thousands of tokens) and a peaky one (a few tokens well above the rest, as trained models
//! give). `cargo run --release -p oxlm-runtime --example sampler_speed`
use std::time::Instant;

use oxlm_runtime::sampler::{Sampler, SamplerConfig};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const VOCAB: usize = 151_936;
const TOKENS: usize = 50;

fn main() {
    let mut rng = StdRng::seed_from_u64(7);
    // Box-Muller normals.
    let mut normal = move || {
        let (u, v): (f32, f32) = (rng.random(), rng.random());
        (-2.0 * (1.0 - u).ln()).sqrt() * (std::f32::consts::TAU * v).cos()
    };
    let flat: Vec<f32> = (0..VOCAB).map(|_| 3.0 * normal()).collect();
    let peaky: Vec<f32> = (0..VOCAB)
        .map(|i| 2.0 * normal() + if i % 5000 == 7 { 12.0 } else { 0.0 })
        .collect();
    let sampled = |temperature, more: fn(&mut SamplerConfig)| {
        let mut c = SamplerConfig {
            temperature,
            seed: Some(1),
            ..Default::default()
        };
        more(&mut c);
        c
    };
    let configs = [
        ("greedy", sampled(0.0, |_| {})),
        ("temperature 0.7", sampled(0.7, |_| {})),
        ("+ top_p 0.9", sampled(0.7, |c| c.top_p = 0.9)),
        ("+ top_k 40", sampled(0.7, |c| c.top_k = 40)),
        ("+ min_p 0.05", sampled(0.7, |c| c.min_p = 0.05)),
    ];
    for (row, logits) in [("flat", &flat), ("peaky", &peaky)] {
        for (name, config) in &configs {
            let mut sampler = Sampler::new(config.clone()).expect("valid parameters");
            let mut buf = logits.clone();
            let start = Instant::now();
            for _ in 0..TOKENS {
                buf.copy_from_slice(logits);
                sampler.sample(&mut buf, &[]);
            }
            let us = start.elapsed().as_secs_f64() * 1e6 / TOKENS as f64;
            println!("{row:5} {name:16} {us:8.0} us/token");
        }
    }
}
