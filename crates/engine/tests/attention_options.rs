//! Attention's options beside the scale, on the host: Gemma 2's soft-capped scores (`cap ·
//! tanh(s / cap)` of each scaled score, before the mask and the softmax) and gpt-oss's sinks (a
//! logit per query head in each softmax's denominator, unscaled, that weighs no value). Against
//! an f64 reference of the formula over the values the caches hold (f32, f16 and 8-bit rings,
//! wrapped, through windows, grouped-query and one-sequence-per-token batches), against mlx's
//! own outputs (`scripts/oracle/attention_options.py`), and on every instruction set.

mod common;

use common::random_vec;
use half::f16;
use oxlm_engine::cpu::attention::{GroupAttention, KvElem};
use oxlm_engine::cpu::Isa;
use oxlm_engine::ops::{self, AttentionOptions};
use oxlm_engine::{Device, KvPrecision, KvRing, Positions, Tensor};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Which options a case turns on.
#[derive(Clone, Copy, Debug)]
struct Extras {
    softcap: Option<f32>,
    sinks: bool,
}

/// None, each alone and both.
fn every_extras(cap: f32) -> [Extras; 4] {
    let e = |softcap, sinks| Extras { softcap, sinks };
    [
        e(None, false),
        e(Some(cap), false),
        e(None, true),
        e(Some(cap), true),
    ]
}

/// Sinks for `heads` around the scores' size, the first far above any score (most of its
/// heads' probability goes to it) and the second far below (as if none).
fn random_sinks(rng: &mut StdRng, heads: usize) -> Vec<f32> {
    let mut s: Vec<f32> = (0..heads).map(|_| rng.random_range(-1.0f32..2.0)).collect();
    s[0] = 6.0;
    if heads > 1 {
        s[1] = -30.0;
    }
    s
}

/// A cache's rings as attention reads them (`[kv_heads, capacity, d]` each, position `p` in
/// slot `p % capacity`) with the positions `start..end` present.
struct Held<'a> {
    keys: &'a [f32],
    values: &'a [f32],
    kv_heads: usize,
    capacity: usize,
    start: usize,
    end: usize,
    window: Option<usize>,
}

/// The f64 attention of the query token `q` (`[heads, d]`) at `pos` over `kv`:
/// `p_j = exp(c_j - m) / (exp(sink_h - m) + Σ_k exp(c_k - m))`, `c_j = cap · tanh(s_j / cap)`
/// (or `s_j`), `s_j = scale · q·k_j`, `m` the largest of the `c_j` and the sink.
fn reference(
    q: &[f32],
    d: usize,
    pos: usize,
    kv: &Held,
    scale: f32,
    softcap: Option<f32>,
    sinks: Option<&[f32]>,
) -> Vec<f64> {
    let heads = q.len() / d;
    let group = heads / kv.kv_heads;
    let hi = (pos + 1).min(kv.end);
    let lo = kv
        .window
        .map_or(0, |w| (pos + 1).saturating_sub(w))
        .max(kv.start)
        .min(hi);
    let mut out = vec![0.0f64; heads * d];
    for h in 0..heads {
        let row = |ring: &[f32], p: usize| -> Vec<f64> {
            let at = ((h / group) * kv.capacity + p % kv.capacity) * d;
            ring[at..at + d].iter().map(|&x| x as f64).collect()
        };
        let qh = &q[h * d..(h + 1) * d];
        let scores: Vec<f64> = (lo..hi)
            .map(|p| {
                let s = row(kv.keys, p)
                    .iter()
                    .zip(qh)
                    .map(|(k, &q)| k * q as f64)
                    .sum::<f64>()
                    * scale as f64;
                softcap.map_or(s, |c| c as f64 * (s / c as f64).tanh())
            })
            .collect();
        let sink = sinks.map(|s| s[h] as f64);
        let m = scores
            .iter()
            .copied()
            .chain(sink)
            .fold(f64::NEG_INFINITY, f64::max);
        let denominator: f64 = scores
            .iter()
            .chain(sink.as_ref())
            .map(|s| (s - m).exp())
            .sum();
        for (p, s) in (lo..hi).zip(&scores) {
            let w = (s - m).exp() / denominator;
            for (o, v) in out[h * d..(h + 1) * d].iter_mut().zip(row(kv.values, p)) {
                *o += w * v;
            }
        }
    }
    out
}

fn assert_within(what: &str, got: &[f32], want: &[f64], tolerance: f64) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g as f64 - w).abs() <= tolerance,
            "{what}: output {i} is {g}, want {w}"
        );
    }
}

/// The tolerance of a cache's precision: the kernels sum f32 in another order, and on 8-bit
/// rings the integer kernels round queries and weights to int16 (as in `kernels.rs`).
fn tolerance(precision: KvPrecision) -> f64 {
    match precision {
        KvPrecision::Q8 => 1e-4,
        _ => 1e-5,
    }
}

/// A host ring pair of `capacity` slots in `precision`, written with `len` random positions
/// (in two writes, the second wrapping round the ring when `len > capacity`), and what they
/// hold, read back.
fn filled_cache(
    rng: &mut StdRng,
    precision: KvPrecision,
    kv_heads: usize,
    d: usize,
    capacity: usize,
    len: usize,
) -> (KvRing, KvRing, Vec<f32>, Vec<f32>) {
    let row = kv_heads * d;
    let k = random_vec(rng, len * row);
    let v = random_vec(rng, len * row);
    let ring = || KvRing::zeros(capacity * row, precision, &Device::Cpu).unwrap();
    let (mut keys, mut values) = (ring(), ring());
    for range in [0..len / 3, len / 3..len] {
        let from = range.end.saturating_sub(capacity).max(range.start);
        let at = Positions::new((from..range.end).collect(), &Device::Cpu).unwrap();
        let kc = Tensor::new(vec![at.len(), row], k[from * row..range.end * row].to_vec());
        let vc = Tensor::new(vec![at.len(), row], v[from * row..range.end * row].to_vec());
        ops::kv_write(
            (&mut keys, &mut values),
            &kc,
            &vc,
            kv_heads,
            d,
            capacity,
            &at,
        )
        .unwrap();
    }
    let (kh, vh) = (keys.to_vec().unwrap(), values.to_vec().unwrap());
    (keys, values, kh, vh)
}

fn options<'a>(scale: f32, extras: Extras, sinks: &'a Tensor) -> AttentionOptions<'a> {
    let mut o = AttentionOptions::scaled(scale);
    if let Some(cap) = extras.softcap {
        o = o.with_softcap(cap);
    }
    if extras.sinks {
        o = o.with_sinks(sinks);
    }
    o
}

/// `ops::attention` of decode steps and prefill chunks over f32, f16 and 8-bit rings (full,
/// wrapped, windowed; grouped, multi-head and multi-query), each option alone and both, against
/// the reference.
#[test]
fn attention_with_softcap_and_sinks_matches_the_reference() {
    let mut rng = StdRng::seed_from_u64(21);
    // (heads, kv_heads, d, capacity, len, window, queries ending at len - 1)
    let cases = [
        (8, 2, 64, 256, 7, None, 7),
        (8, 2, 64, 256, 200, None, 1),
        (4, 4, 128, 64, 150, None, 1),
        (6, 3, 64, 24, 30, Some(8), 10),
        (4, 1, 64, 100, 100, Some(33), 20),
        (4, 2, 36, 48, 70, Some(16), 5),
        (3, 3, 16, 32, 20, None, 20),
    ];
    for (heads, kv_heads, d, capacity, len, window, tokens) in cases {
        for precision in [KvPrecision::F32, KvPrecision::F16, KvPrecision::Q8] {
            if precision == KvPrecision::Q8 && d % 64 != 0 {
                continue;
            }
            let (keys, values, kh, vh) =
                filled_cache(&mut rng, precision, kv_heads, d, capacity, len);
            let start = len.saturating_sub(capacity);
            let kv = ops::KvView {
                keys: &keys,
                values: &values,
                kv_heads,
                capacity,
                start,
                end: len,
                window,
            };
            let held = Held {
                keys: &kh,
                values: &vh,
                kv_heads,
                capacity,
                start,
                end: len,
                window,
            };
            let at: Vec<usize> = (len - tokens..len).collect();
            let positions = Positions::new(at.clone(), &Device::Cpu).unwrap();
            let q = random_vec(&mut rng, tokens * heads * d);
            let qt = Tensor::new(vec![tokens, heads * d], q.clone());
            let sinks = random_sinks(&mut rng, heads);
            let st = Tensor::new(vec![heads], sinks.clone());
            let scale = 0.125;
            for extras in every_extras(0.4) {
                let out =
                    ops::attention(&qt, heads, d, &positions, &kv, options(scale, extras, &st))
                        .unwrap()
                        .into_data();
                let sinks = extras.sinks.then_some(&sinks[..]);
                for (t, &pos) in at.iter().enumerate() {
                    let qh = &q[t * heads * d..(t + 1) * heads * d];
                    let want = reference(qh, d, pos, &held, scale, extras.softcap, sinks);
                    assert_within(
                        &format!(
                            "{heads}/{kv_heads} heads of {d}, {precision:?} ring of {capacity} \
                             holding {len}, window {window:?}, query at {pos}, {extras:?}"
                        ),
                        &out[t * heads * d..(t + 1) * heads * d],
                        &want,
                        tolerance(precision),
                    );
                }
            }
        }
    }
}

/// `ops::attention_batch` (one token for each of several sequences, caches of different
/// capacities and lengths, one of them wrapped) with each option, against the reference.
#[test]
fn batched_attention_with_softcap_and_sinks_matches_the_reference() {
    let mut rng = StdRng::seed_from_u64(22);
    // (heads, kv_heads, d, window, (capacity, len) of each sequence)
    type Case = (usize, usize, usize, Option<usize>, Vec<(usize, usize)>);
    let cases: [Case; 3] = [
        (
            8,
            2,
            64,
            None,
            vec![(256, 10), (64, 100), (128, 128), (32, 1)],
        ),
        (4, 2, 64, Some(16), vec![(16, 40), (16, 5), (32, 17)]),
        (6, 6, 128, None, vec![(40, 39), (8, 9)]),
    ];
    for (heads, kv_heads, d, window, sequences) in cases {
        for precision in [KvPrecision::F32, KvPrecision::F16, KvPrecision::Q8] {
            let caches: Vec<_> = sequences
                .iter()
                .map(|&(cap, len)| filled_cache(&mut rng, precision, kv_heads, d, cap, len))
                .collect();
            let views: Vec<ops::KvView> = caches
                .iter()
                .zip(&sequences)
                .map(|((k, v, _, _), &(capacity, len))| ops::KvView {
                    keys: k,
                    values: v,
                    kv_heads,
                    capacity,
                    start: len.saturating_sub(capacity),
                    end: len,
                    window,
                })
                .collect();
            let n = sequences.len();
            let at: Vec<usize> = sequences.iter().map(|s| s.1 - 1).collect();
            let positions = Positions::new(at.clone(), &Device::Cpu).unwrap();
            let q = random_vec(&mut rng, n * heads * d);
            let qt = Tensor::new(vec![n, heads * d], q.clone());
            let sinks = random_sinks(&mut rng, heads);
            let st = Tensor::new(vec![heads], sinks.clone());
            for extras in every_extras(0.3) {
                let o = options(0.125, extras, &st);
                let out = ops::attention_batch(&qt, heads, d, &positions, &views, o)
                    .unwrap()
                    .into_data();
                for (i, ((_, _, kh, vh), &(capacity, len))) in
                    caches.iter().zip(&sequences).enumerate()
                {
                    let held = Held {
                        keys: kh,
                        values: vh,
                        kv_heads,
                        capacity,
                        start: len.saturating_sub(capacity),
                        end: len,
                        window,
                    };
                    let rows = i * heads * d..(i + 1) * heads * d;
                    let sinks = extras.sinks.then_some(&sinks[..]);
                    let want = reference(
                        &q[rows.clone()],
                        d,
                        at[i],
                        &held,
                        0.125,
                        extras.softcap,
                        sinks,
                    );
                    assert_within(
                        &format!(
                            "batch of {n}, {heads}/{kv_heads} heads of {d}, {precision:?}, \
                             sequence {i}, {extras:?}"
                        ),
                        &out[rows],
                        &want,
                        tolerance(precision),
                    );
                }
            }
        }
    }
}

/// One key/value head's group of queries on every instruction set the processor has (the
/// softmax's vector `exp` among them), over f32 and f16 rows stored whole and as a wrapped
/// ring's two runs, with both options, against the reference.
#[test]
fn group_attention_with_softcap_and_sinks_on_every_isa() {
    fn check<T: KvElem>(rng: &mut StdRng, group: usize, d: usize, len: usize) {
        let keys = random_vec(rng, len * d);
        let values = random_vec(rng, len * d);
        let queries = random_vec(rng, group * d);
        let sinks = random_sinks(rng, group);
        let stored: Vec<T> = keys.iter().map(|&x| T::from_f32(x)).collect();
        let stored_v: Vec<T> = values.iter().map(|&x| T::from_f32(x)).collect();
        let mut held = vec![0.0; len * d];
        let mut held_v = vec![0.0; len * d];
        T::floats(&stored).to_f32(0, &mut held);
        T::floats(&stored_v).to_f32(0, &mut held_v);
        let kv = Held {
            keys: &held,
            values: &held_v,
            kv_heads: 1,
            capacity: len,
            start: 0,
            end: len,
            window: None,
        };
        let scale = 1.0 / (d as f32).sqrt();
        // The ring as if written from slot `cut`: positions 0.. at cut.., then at 0..cut.
        let cut = len / 3;
        let wrapped =
            |x: &[T]| -> Vec<T> { [&x[(len - cut) * d..], &x[..(len - cut) * d]].concat() };
        let (kw, vw) = (wrapped(&stored), wrapped(&stored_v));
        for extras in every_extras(0.5) {
            let s = extras.sinks.then_some(&sinks[..]);
            let want = reference(&queries, d, len - 1, &kv, scale, extras.softcap, s);
            for (keys, values, runs) in [
                (&stored[..], &stored_v[..], [0..len, 0..0]),
                (&kw[..], &vw[..], [cut..len, 0..cut]),
            ] {
                let job = GroupAttention {
                    queries: &queries,
                    keys,
                    values,
                    head_dim: d,
                    runs: runs.clone(),
                    scale,
                    softcap: extras.softcap,
                    sinks: s,
                    visible: None,
                };
                for isa in Isa::available() {
                    let mut out = vec![f32::NAN; group * d];
                    job.run(isa, &mut out);
                    assert_within(
                        &format!(
                            "{isa:?} {} group {group} of {d}, {len} keys, runs {runs:?}, \
                             {extras:?}",
                            std::any::type_name::<T>()
                        ),
                        &out,
                        &want,
                        1e-5,
                    );
                }
            }
        }
    }
    let mut rng = StdRng::seed_from_u64(23);
    for (group, d) in [(4, 64), (3, 80), (1, 128), (5, 16)] {
        for len in [1, 9, 64, 65, 300] {
            check::<f32>(&mut rng, group, d, len);
            check::<f16>(&mut rng, group, d, len);
        }
    }
}

/// Sinks of -inf take nothing from any softmax: the output is plain attention's, bit for bit.
#[test]
fn sinks_of_minus_infinity_change_nothing() {
    let mut rng = StdRng::seed_from_u64(24);
    let (heads, kv_heads, d, capacity, len) = (8, 2, 64, 64, 90);
    let (keys, values, _, _) = filled_cache(&mut rng, KvPrecision::F16, kv_heads, d, capacity, len);
    let kv = ops::KvView {
        keys: &keys,
        values: &values,
        kv_heads,
        capacity,
        start: len - capacity,
        end: len,
        window: None,
    };
    let positions = Positions::new((len - 3..len).collect(), &Device::Cpu).unwrap();
    let q = Tensor::new(vec![3, heads * d], random_vec(&mut rng, 3 * heads * d));
    let none = Tensor::new(vec![heads], vec![f32::NEG_INFINITY; heads]);
    let plain = AttentionOptions::scaled(0.125);
    let run = |o| {
        ops::attention(&q, heads, d, &positions, &kv, o)
            .unwrap()
            .into_data()
    };
    assert_eq!(run(plain.with_sinks(&none)), run(plain));
}

/// Options the ops refuse: a cap that is not positive, sinks not one per query head.
#[test]
fn bad_options_are_refused() {
    let (heads, kv_heads, d, capacity) = (4, 2, 16, 8);
    let mut rng = StdRng::seed_from_u64(25);
    let (keys, values, _, _) = filled_cache(&mut rng, KvPrecision::F32, kv_heads, d, capacity, 4);
    let kv = ops::KvView {
        keys: &keys,
        values: &values,
        kv_heads,
        capacity,
        start: 0,
        end: 4,
        window: None,
    };
    let positions = Positions::new(vec![3], &Device::Cpu).unwrap();
    let q = Tensor::new(vec![1, heads * d], random_vec(&mut rng, heads * d));
    let three = Tensor::new(vec![3], vec![0.0; 3]);
    let plain = AttentionOptions::scaled(0.25);
    for bad in [
        plain.with_softcap(0.0),
        plain.with_softcap(-1.0),
        plain.with_softcap(f32::NAN),
        plain.with_sinks(&three),
    ] {
        assert!(ops::attention(&q, heads, d, &positions, &kv, bad).is_err());
        let views = [ops::KvView { ..kv }];
        assert!(ops::attention_batch(&q, heads, d, &positions, &views, bad).is_err());
    }
}

/// mlx's outputs (`scripts/oracle/attention_options.py`, mlx 0.32.4 on the CPU): 3 tokens, 4
/// query heads over 2 key/value heads of 8, causal, scale 0.35; with the sinks below through
/// `mx.fast.scaled_dot_product_attention(..., sinks=)`, and with scores capped at 1.5 as mlx-lm's
/// `gemma2.py` computes them. `[tokens, heads, d]`.
#[rustfmt::skip]
const MLX_SINKS: [f32; 96] = [
    0.3003817, 0.6101594, 0.026052156, -0.59622157, -0.34502926, 0.41163167,
    0.5652513, -0.109223574, 0.39214212, 0.7965505, 0.034010552, -0.77835494,
    -0.4504286, 0.53737664, 0.7379239, -0.14258912, -0.09269303, -0.033357594,
    0.0748468, 0.07340045, -0.035577726, -0.09243445, -0.013874491, 0.08501164,
    -0.31736028, -0.11420896, 0.25625876, 0.25130677, -0.1218102, -0.31647497,
    -0.047503162, 0.2910609, 0.286861, -0.110895135, -0.34618965, -0.0743155,
    0.30643106, 0.23825538, -0.17896493, -0.3340012, 0.44315243, -0.013528496,
    -0.4503901, -0.22742918, 0.3287161, 0.4032915, -0.11295605, -0.4637227,
    -0.12621216, 0.07252835, 0.16501467, 0.015754119, -0.15658624, -0.09952739,
    0.10333932, 0.15481369, -0.06652364, 0.32035476, 0.23791268, -0.19307202,
    -0.34120578, 0.010527745, 0.3468381, 0.17502983, 0.2662332, 0.39432722,
    -0.055269018, -0.42389607, -0.17151436, 0.33213627, 0.3492065, -0.1453116,
    0.36999243, 0.44434178, -0.1322706, -0.5151062, -0.14330998, 0.43843573,
    0.37787208, -0.23627502, 0.13171586, 0.011326253, -0.12565634, -0.078552105,
    0.08363114, 0.12329456, -0.017668843, -0.13274735, 0.09539527, -0.034548167,
    -0.113878444, -0.026376545, 0.09976706, 0.079751685, -0.057100102, -0.110300094,
];
#[rustfmt::skip]
const MLX_SOFTCAP: [f32; 96] = [
    0.47942555, 0.9738476, 0.041580662, -0.9516021, -0.5506855, 0.6569866,
    0.90217185, -0.17432678, 0.47942555, 0.9738476, 0.041580662, -0.9516021,
    -0.5506855, 0.6569866, 0.90217185, -0.17432678, -0.99543625, -0.35822928,
    0.80378443, 0.78825206, -0.3820714, -0.9926594, -0.14899902, 0.9129453,
    -0.99543625, -0.35822928, 0.80378443, 0.78825206, -0.3820714, -0.9926594,
    -0.14899902, 0.9129453, 0.59801245, -0.1863541, -0.69771147, -0.18691988,
    0.5977098, 0.5066932, -0.32663006, -0.6814395, 0.57786435, 0.010766476,
    -0.5721043, -0.31684095, 0.40259516, 0.5322284, -0.11785415, -0.5952801,
    -0.42244363, 0.25179043, 0.5571509, 0.04628396, -0.5323891, -0.3311109,
    0.35524553, 0.52116644, -0.1421695, 0.550176, 0.43651235, -0.31664294,
    -0.6059156, -0.0075205266, 0.6018921, 0.3295314, 0.35015073, 0.5038202,
    -0.080608085, -0.5469454, -0.21200636, 0.43352246, 0.4439399, -0.19601563,
    0.37464735, 0.4170324, -0.15153597, -0.49810383, -0.11494838, 0.4366067,
    0.34853196, -0.2501429, 0.37622383, 0.043862432, -0.3527575, -0.23258689,
    0.22832409, 0.35473973, -0.03853917, -0.37535805, 0.19361068, -0.0651159,
    -0.22844756, -0.057103, 0.19789755, 0.16297773, -0.11070487, -0.22220454,
];

#[test]
fn options_match_mlx() {
    let (tokens, heads, kv_heads, d) = (3, 4, 2, 8);
    let wave = |n: usize, f: fn(f64) -> f64, a: f64, b: f64| -> Vec<f32> {
        (0..n).map(|i| f(a * i as f64 + b) as f32).collect()
    };
    let q = wave(tokens * heads * d, f64::sin, 0.7, 0.1);
    let k = wave(tokens * kv_heads * d, f64::cos, 0.3, 0.2);
    let v = wave(tokens * kv_heads * d, f64::sin, 1.3, 0.5);
    let row = kv_heads * d;
    let ring = || KvRing::zeros(tokens * row, KvPrecision::F32, &Device::Cpu).unwrap();
    let (mut keys, mut values) = (ring(), ring());
    let positions = Positions::new((0..tokens).collect(), &Device::Cpu).unwrap();
    let kt = Tensor::new(vec![tokens, row], k);
    let vt = Tensor::new(vec![tokens, row], v);
    let rings = (&mut keys, &mut values);
    ops::kv_write(rings, &kt, &vt, kv_heads, d, tokens, &positions).unwrap();
    let kv = ops::KvView {
        keys: &keys,
        values: &values,
        kv_heads,
        capacity: tokens,
        start: 0,
        end: tokens,
        window: None,
    };
    let q = Tensor::new(vec![tokens, heads * d], q);
    let sinks = Tensor::new(vec![heads], vec![0.5, -1.0, 2.0, 1.0]);
    let plain = AttentionOptions::scaled(0.35);
    for (what, options, want) in [
        ("sinks", plain.with_sinks(&sinks), &MLX_SINKS),
        ("soft cap", plain.with_softcap(1.5), &MLX_SOFTCAP),
    ] {
        let out = ops::attention(&q, heads, d, &positions, &kv, options)
            .unwrap()
            .into_data();
        let want: Vec<f64> = want.iter().map(|&x| x as f64).collect();
        assert_within(what, &out, &want, 1e-5);
    }
}
