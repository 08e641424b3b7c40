//! Parity with mlx-lm on the seeded tiny models in tests/fixtures/tiny (made by
//! scripts/oracle/make_tiny_all.sh): logits of every prompt position, then 32 greedy steps
//! through the KV cache, fed the oracle's tokens so one early difference cannot hide later ones.
//! The caches keep f32 keys and values, as the oracle's f32 run does; the host's default f16
//! cache is held to the real models' goldens (runtime's `real_parity`), since these random
//! models amplify rounding far beyond what a trained one does.
//!
//! Each model runs on the CPU and, where a CUDA GPU is present, on the GPU twice: with f32
//! operands throughout (held to the same tolerance) and with the default fast paths, TF32
//! tensor-core prefill and int16-activation decoding (held to a looser one). The GPU's f16
//! cache (its default) is held to the host's f16 cache on the same run.

use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};

use oxlm_engine::{cuda, ops, Device, KvPrecision, KvQuant, Tensor};
use oxlm_models::{load_on, LanguageModel, Logits};

/// Largest |Δlogit| allowed: both sides compute in f32, differing only in summation order.
const LOGIT_TOLERANCE: f32 = 2e-3;

/// Largest |Δlogit| allowed in the prompt logits where the GPU prefill rounds operands to TF32
/// (10-bit mantissas). These random models amplify rounding: mlx-lm's own bf16 run of them
/// drifts from its fp32 one by 0.8 (qwen3) to 13 (qwen3_5); TF32 stays under 0.35 on all of
/// them but Qwen3-Next's, whose prompt drifts by 0.40 to 0.52 (H100) depending on which of its
/// products round to TF32 (its mixtures' prompts of up to 64 tokens run in f32, longer ones on
/// the tensor cores). Decode steps are checked on the exact run; here they also round
/// activations to int16 (cuda_ops holds those kernels to 1e-4 relative), and a rounding-sized
/// change of the prefilled cache can flip a mixture-of-experts route later on, which no
/// tolerance bounds.
const TF32_LOGIT_TOLERANCE: f32 = 0.75;

/// This test's turn on the GPU, held while it runs there: the tests take turns, because a GPU
/// handle has one stream for every thread (a step captured into a graph on one thread would
/// take in another's launches; run side by side, these tests crashed the process on the H200).
fn gpu_turn() -> MutexGuard<'static, ()> {
    static TURN: Mutex<()> = Mutex::new(());
    // A test that failed while holding the turn leaves nothing behind that the next one reads.
    TURN.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// A device to check, its label and the tolerance on it.
type Checked = (String, Device, f32);

/// The devices to check: the CPU, then the GPU (if any) exact and fast, with the turn on it.
fn devices() -> (Vec<Checked>, Option<MutexGuard<'static, ()>>) {
    let mut out = vec![("cpu".to_string(), Device::Cpu, LOGIT_TOLERANCE)];
    let mut turn = None;
    if cuda::libraries_present() {
        turn = Some(gpu_turn());
        let Device::Cuda(gpu) = Device::open("cuda").expect("opening GPU 0") else {
            unreachable!()
        };
        let exact = Device::Cuda(gpu.with_exact_math(true));
        out.push(("cuda exact".into(), exact, LOGIT_TOLERANCE));
        out.push(("cuda tf32".into(), Device::Cuda(gpu), TF32_LOGIT_TOLERANCE));
    } else {
        eprintln!("GPU runs skipped: no CUDA driver on this machine");
    }
    (out, turn)
}

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny")
}

struct Golden {
    prompt_ids: Vec<u32>,
    greedy_ids: Vec<u32>,
    step_logits: Vec<f32>,
    prompt_logits: Vec<f32>,
}

fn read_golden(dir: &Path) -> Golden {
    let bytes = std::fs::read(dir.join("golden.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let ints = |name: &str| -> Vec<u32> {
        bytemuck_i32(st.tensor(name).unwrap().data())
            .into_iter()
            .map(|v| v as u32)
            .collect()
    };
    let floats = |name: &str| -> Vec<f32> {
        st.tensor(name)
            .unwrap()
            .data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect()
    };
    Golden {
        prompt_ids: ints("prompt_ids"),
        greedy_ids: ints("greedy_ids"),
        step_logits: floats("step_logits"),
        prompt_logits: floats("prompt_logits"),
    }
}

fn bytemuck_i32(data: &[u8]) -> Vec<i32> {
    data.chunks_exact(4)
        .map(|b| i32::from_le_bytes(b.try_into().unwrap()))
        .collect()
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// The gap between the two largest logits.
fn margin(v: &[f32]) -> f32 {
    let top = ops::argmax(v) as usize;
    let second = v
        .iter()
        .enumerate()
        .filter(|&(i, _)| i != top)
        .fold(f32::NEG_INFINITY, |m, (_, &x)| m.max(x));
    v[top] - second
}

/// Largest |Δlogit| between the host's and the exact GPU's runs with f16 caches: each rounds
/// its own keys and values, a few thousandths apart, to f16, and now and then one rounds the
/// other way (one f16 step, a thousandth of the value), which these models amplify.
const F16_CACHE_LOGIT_TOLERANCE: f32 = 2e-2;

/// The prompt's last logits and 32 greedy steps' (fed the golden tokens) with caches in
/// `precision` on `device`.
fn cache_run(name: &str, device: &Device, precision: KvPrecision) -> Vec<Vec<f32>> {
    let dir = fixtures().join(name);
    let golden = read_golden(&dir);
    let model = load_on(&dir, device).unwrap_or_else(|e| panic!("{name}: {e}"));
    let mut cache = model.new_cache_in(precision).unwrap();
    let mut out = vec![model
        .forward(&golden.prompt_ids, &mut cache, Logits::Last)
        .unwrap()
        .into_data()];
    for &id in &golden.greedy_ids {
        out.push(
            model
                .forward(&[id], &mut cache, Logits::Last)
                .unwrap()
                .into_data(),
        );
    }
    out
}

/// The exact GPU's run with caches in `precision` against the host's: the same logits within
/// `tolerance`, and the same greedy picks wherever the margin allows.
fn check_cache(name: &str, gpu: &Device, precision: KvPrecision, tolerance: f32) {
    let host = cache_run(name, &Device::Cpu, precision);
    let ours = cache_run(name, gpu, precision);
    let mut diff = 0.0f32;
    for (step, (h, g)) in host.iter().zip(&ours).enumerate() {
        let d = max_abs_diff(g, h);
        diff = diff.max(d);
        assert!(
            d < tolerance,
            "{name}: {precision:?} cache, step {step} logits differ by {d}"
        );
        if margin(h) > 2.0 * tolerance {
            assert_eq!(
                ops::argmax(g),
                ops::argmax(h),
                "{name}: {precision:?} cache, step {step}"
            );
        }
    }
    println!("{name} on cuda exact, {precision:?} caches: within {diff:.2e} of the host's");
}

/// Caches of codes in groups of 32 (the tiny models' heads of 32 take no larger ones), 8 and 4
/// bits.
const CODE_CACHES: [KvPrecision; 2] = [
    KvPrecision::Quantized(KvQuant { bits: 8, group: 32 }),
    KvPrecision::Quantized(KvQuant { bits: 4, group: 32 }),
];

/// Largest |Δlogit| between the host's and the exact GPU's runs with code caches. Both quantize
/// to the same codes from the same keys (cuda_ops holds the GPU's to the host's bits), but the
/// keys themselves differ in their last bits between the devices, and now and then one rounds
/// to a neighbouring code, a step of 1/15 or 1/255 of its group's range.
const CODE_CACHE_LOGIT_TOLERANCE: f32 = 0.1;

/// Code caches decode on the GPU as on the host, alone and batched (where the host's attention
/// takes codes in groups of 32 as exact sums, and the GPU's the same).
fn check_code_caches(name: &str) {
    let (devices, _turn) = devices();
    let Some((_, gpu, _)) = devices.iter().find(|(label, ..)| label == "cuda exact") else {
        return;
    };
    for precision in CODE_CACHES {
        check_cache(name, gpu, precision, CODE_CACHE_LOGIT_TOLERANCE);
    }
}

/// Every device's run is made (and its figures printed) before the first failure is reported.
fn check_model(name: &str) {
    let (devices, _turn) = devices();
    if let Some((_, gpu, _)) = devices.iter().find(|(label, ..)| label == "cuda exact") {
        check_cache(name, gpu, KvPrecision::F16, F16_CACHE_LOGIT_TOLERANCE);
    }
    let failures: Vec<String> = devices
        .into_iter()
        .filter_map(|(label, device, tolerance)| {
            let run =
                std::panic::AssertUnwindSafe(|| check_model_on(name, &label, &device, tolerance));
            std::panic::catch_unwind(run).err().map(|_| label)
        })
        .collect();
    assert!(failures.is_empty(), "{name}: failed on {failures:?}");
}

fn check_model_on(name: &str, label: &str, device: &Device, tolerance: f32) {
    let dir = fixtures().join(name);
    let golden = read_golden(&dir);
    let model = load_on(&dir, device).unwrap_or_else(|e| panic!("{name}: {e}"));
    let vocab = model.info().vocab_size;
    let name = format!("{name} on {label}");

    let mut cache = model.new_cache_in(KvPrecision::F32).unwrap();
    let all = model
        .forward(&golden.prompt_ids, &mut cache, Logits::All)
        .unwrap();
    let prompt_diff = max_abs_diff(all.data(), &golden.prompt_logits);
    assert!(
        prompt_diff < tolerance,
        "{name}: prompt logits differ by {prompt_diff}"
    );

    if label.ends_with("tf32") {
        println!("{name}: max |Δlogit| prompt {prompt_diff:.2e}");
        return;
    }
    let mut cache = model.new_cache_in(KvPrecision::F32).unwrap();
    let mut logits = model
        .forward(&golden.prompt_ids, &mut cache, Logits::Last)
        .unwrap();
    let mut step_diff = 0.0f32;
    for (step, &expected_id) in golden.greedy_ids.iter().enumerate() {
        let want = &golden.step_logits[step * vocab..(step + 1) * vocab];
        let d = max_abs_diff(logits.data(), want);
        step_diff = step_diff.max(d);
        assert!(d < tolerance, "{name}: step {step} logits differ by {d}");
        if margin(want) > 2.0 * tolerance {
            assert_eq!(
                ops::argmax(logits.data()),
                expected_id,
                "{name}: greedy step {step}"
            );
        }
        logits = model
            .forward(&[expected_id], &mut cache, Logits::Last)
            .unwrap();
    }
    // shown with `--nocapture`
    println!("{name}: max |Δlogit| prompt {prompt_diff:.2e}, greedy steps {step_diff:.2e}");
}

/// What a test that runs on the GPU alone holds: its turn there, a fixture's golden, GPU 0
/// and the fixture's model on it.
struct OnGpu {
    golden: Golden,
    device: Device,
    model: Box<dyn LanguageModel>,
    /// Last, so that it is let go after the model (fields drop in their order).
    turn: MutexGuard<'static, ()>,
}

/// Fixture `name` loaded on GPU 0, with the turn there; `None` (the test skipped) on a machine
/// without a CUDA driver.
fn on_gpu(name: &str) -> Option<OnGpu> {
    if !cuda::libraries_present() {
        eprintln!("skipped: no CUDA driver on this machine");
        return None;
    }
    let dir = fixtures().join(name);
    let golden = read_golden(&dir);
    let turn = gpu_turn();
    let device = Device::open("cuda").unwrap();
    let model = load_on(&dir, &device).unwrap();
    Some(OnGpu {
        golden,
        device,
        model,
        turn,
    })
}

impl OnGpu {
    /// f16 caches (the GPU's default) prefilled with prompts of `lens` tokens, each the golden
    /// prompt repeated from its `skip`th token.
    fn prefilled(&self, lens: &[usize], skip: usize) -> Vec<oxlm_models::Cache> {
        lens.iter()
            .map(|&len| {
                let prompt: Vec<u32> = self
                    .golden
                    .prompt_ids
                    .iter()
                    .copied()
                    .cycle()
                    .skip(skip)
                    .take(len)
                    .collect();
                let mut cache = self.model.new_cache_in(KvPrecision::F16).unwrap();
                self.model
                    .forward(&prompt, &mut cache, Logits::Last)
                    .unwrap();
                cache
            })
            .collect()
    }

    /// The logits of `count` greedy decode steps of the batch `caches` (first tokens 1, 2,
    /// ...), each cache made room for before the step as `decode_step` does; issued one call at
    /// a time, or through `steps`.
    fn decode_batch(
        &self,
        caches: &mut [oxlm_models::Cache],
        count: usize,
        mut steps: Option<&mut oxlm_engine::DecodeSteps>,
    ) -> Vec<Vec<f32>> {
        let mut tokens: Vec<u32> = (1..=caches.len() as u32).collect();
        let mut out = Vec::new();
        for _ in 0..count {
            for cache in caches.iter_mut() {
                cache.make_room_for_next().unwrap();
            }
            let mut refs: Vec<&mut oxlm_models::Cache> = caches.iter_mut().collect();
            let mut step = || {
                let logits = self.model.forward_batch(&tokens, &mut refs)?;
                Ok::<_, oxlm_models::ForwardError>(logits.into_host()?)
            };
            let logits = match steps.as_deref_mut() {
                Some(steps) => steps.run(step),
                None => step(),
            };
            let logits = logits.unwrap();
            let picks = ops::greedy_rows(&logits).unwrap();
            tokens = picks.iter().map(|p| p.id).collect();
            out.push(logits.into_data());
        }
        out
    }
}

/// On a GPU, decode steps replayed from a captured graph give the logits of steps issued one
/// call at a time, bit for bit, and most steps are replayed.
fn check_replay(name: &str) {
    // The turn first, so that it is let go last.
    let Some(OnGpu {
        turn: _turn,
        golden,
        device,
        model,
    }) = on_gpu(name)
    else {
        return;
    };
    let prefilled = || {
        let mut cache = model.new_cache_in(KvPrecision::F32).unwrap();
        model
            .forward(&golden.prompt_ids, &mut cache, Logits::Last)
            .unwrap();
        cache
    };
    let decode = |replay: bool| {
        let mut cache = prefilled();
        let mut steps = oxlm_engine::DecodeSteps::new(&device);
        let mut out = Vec::new();
        for &id in &golden.greedy_ids {
            let mut step = || model.forward(&[id], &mut cache, Logits::Last);
            let logits = if replay { steps.run(step) } else { step() };
            out.push(logits.unwrap().into_data());
        }
        (out, steps.replayed())
    };
    let (plain, _) = decode(false);
    let (replayed, count) = decode(true);
    assert_eq!(plain, replayed, "{name}: replayed steps differ");
    let steps = golden.greedy_ids.len() as u64;
    assert!(
        count >= steps - 3,
        "{name}: {count} of {steps} steps replayed"
    );
    println!("{name}: {count} of {steps} decode steps replayed");
    // Greedy picks taken on the GPU, as `generate` decodes: the host's picks of the same logits,
    // replayed as well; then picks held to masks that change every step (a third of the
    // vocabulary, shifted by one each step), as a grammar holds them: a replayed step carries
    // its own step's mask.
    let vocab = plain[0].len();
    for masked in [false, true] {
        let mask_at = |step: usize| {
            let mut words = vec![0u32; vocab.div_ceil(32)];
            for id in (0..vocab).filter(|id| (id + step).is_multiple_of(3)) {
                words[id / 32] |= 1 << (id % 32);
            }
            words
        };
        let mut cache = prefilled();
        let mut picking = oxlm_engine::DecodeSteps::new(&device);
        for (step, (&id, logits)) in golden.greedy_ids.iter().zip(&plain).enumerate() {
            let mask = mask_at(step);
            let allowed: Vec<Option<&[u32]>> = if masked { vec![Some(&mask)] } else { vec![] };
            let pick = picking
                .run(|| {
                    let logits = model.forward(&[id], &mut cache, Logits::LastOnDevice)?;
                    Ok::<_, oxlm_models::ForwardError>(
                        ops::greedy_rows_allowed(&logits, &allowed)?[0],
                    )
                })
                .unwrap();
            let host = Tensor::new(vec![1, logits.len()], logits.clone());
            let host = ops::greedy_rows_allowed(&host, &allowed).unwrap()[0];
            assert_eq!(
                pick.id, host.id,
                "{name}: a greedy pick differs (masked: {masked})"
            );
            assert!(
                (pick.logprob - host.logprob).abs() < 1e-5,
                "{name}: {pick:?} against the host's {host:?} (masked: {masked})"
            );
            assert!(!masked || (host.id as usize + step).is_multiple_of(3));
        }
        assert!(
            picking.replayed() >= steps - 3,
            "{name}: picks not replayed (masked: {masked})"
        );
    }
}

/// On a GPU, a batch's decode steps go on replaying while its sequences outgrow their caches
/// one after another, each cache made room for before the step
/// (`Cache::make_room_for_next`, as `decode_step` does), and give the logits of steps issued
/// one call at a time. Three sequences of 255, 252 and 249 tokens grow past 256 positions at
/// steps 1, 4 and 7 of 12: only the first step (captured), the one where the longest cache
/// grows (its attention splits change) and the next (captured again) are not replayed. Grown
/// inside the steps, each growth would cost two.
#[test]
fn batched_steps_replay_while_caches_grow() {
    let Some(gpu) = on_gpu("llama-4bit-g64") else {
        return;
    };
    let plain = gpu.decode_batch(&mut gpu.prefilled(&[255, 252, 249], 0), 12, None);
    let mut steps = oxlm_engine::DecodeSteps::new(&gpu.device);
    let replayed = gpu.decode_batch(
        &mut gpu.prefilled(&[255, 252, 249], 0),
        12,
        Some(&mut steps),
    );
    assert_eq!(plain, replayed, "replayed steps differ");
    let count = steps.replayed();
    assert!(count >= 9, "{count} of 12 steps replayed");
}

/// On a GPU, the steps recorded for one batch replay for another batch of as many sequences
/// (other prompts, other lengths), as a server's batch does when one request ends and another
/// takes its place: each step uploads its batch's cache tables, so the calls are the same ones.
/// Its logits equal the steps issued one call at a time, bit for bit, and every step replays.
#[test]
fn a_recording_replays_for_another_batch_of_its_size() {
    let Some(gpu) = on_gpu("llama-4bit-g64") else {
        return;
    };
    let mut steps = oxlm_engine::DecodeSteps::new(&gpu.device);
    gpu.decode_batch(&mut gpu.prefilled(&[40, 31, 22], 0), 4, Some(&mut steps));
    let recorded = steps.replayed();
    let direct = gpu.decode_batch(&mut gpu.prefilled(&[37, 12, 29], 5), 4, None);
    let replayed = gpu.decode_batch(&mut gpu.prefilled(&[37, 12, 29], 5), 4, Some(&mut steps));
    assert_eq!(direct, replayed, "the other batch's replayed steps differ");
    assert_eq!(
        steps.replayed() - recorded,
        4,
        "the other batch's steps were not all replayed"
    );
}

/// A server loads its model on one thread and generates on another: the GPU's context must
/// follow the work.
#[test]
fn a_gpu_model_runs_on_another_thread() {
    // The turn first, so that it is let go last.
    let Some(OnGpu {
        turn: _turn,
        golden,
        model,
        ..
    }) = on_gpu("llama-4bit-g64")
    else {
        return;
    };
    let first = |model: &dyn LanguageModel| {
        let mut cache = model.new_cache_in(KvPrecision::F32).unwrap();
        let logits = model.forward(&golden.prompt_ids, &mut cache, Logits::Last);
        logits.unwrap().into_data()
    };
    let here = first(model.as_ref());
    let there = std::thread::scope(|s| s.spawn(|| first(model.as_ref())).join().unwrap());
    assert_eq!(here, there);
}

/// Decoding several sequences as one batch gives each the logits it gets decoded alone: three
/// sequences of different lengths (so different positions and cache sizes), prefilled apart,
/// then stepped together; with f32 caches and with f16 ones.
fn check_batch(name: &str) {
    check_batch_in(name, &[KvPrecision::F32, KvPrecision::F16]);
}

/// [`check_batch`] with caches in each of `precisions`.
fn check_batch_in(name: &str, precisions: &[KvPrecision]) {
    let dir = fixtures().join(name);
    let golden = read_golden(&dir);
    let (devices, _turn) = devices();
    let runs = devices
        .into_iter()
        .flat_map(|d| precisions.iter().map(move |&p| (d.clone(), p)));
    for ((label, device, tolerance), precision) in runs {
        let label = format!("{label}, {precision:?} caches");
        let model = load_on(&dir, &device).unwrap();
        let lengths = [golden.prompt_ids.len(), 7, 19];
        let mut batch_caches = Vec::new();
        let mut alone_caches = Vec::new();
        let mut tokens = Vec::new();
        for &n in &lengths {
            let mut cache = model.new_cache_in(precision).unwrap();
            let logits = model
                .forward(&golden.prompt_ids[..n], &mut cache, Logits::Last)
                .unwrap();
            tokens.push(ops::argmax(logits.data()));
            alone_caches.push(cache.try_clone().unwrap());
            batch_caches.push(cache);
        }
        let vocab = model.info().vocab_size;
        let mut diff = 0.0f32;
        for step in 0..6 {
            let mut refs: Vec<&mut oxlm_models::Cache> = batch_caches.iter_mut().collect();
            let batch = model.forward_batch(&tokens, &mut refs).unwrap();
            assert_eq!(batch.shape(), &[lengths.len(), vocab]);
            // Greedy picks where the logits are, against the same logits on the host.
            let ids = |picks: Vec<ops::Pick>| picks.iter().map(|p| p.id).collect::<Vec<_>>();
            let picks = ids(ops::greedy_rows(&batch).unwrap());
            let batch = batch.into_host().unwrap();
            let host_picks = ids(ops::greedy_rows(&batch).unwrap());
            assert_eq!(picks, host_picks, "{name} on {label}: step {step}");
            for (i, cache) in alone_caches.iter_mut().enumerate() {
                let alone = model.forward(&[tokens[i]], cache, Logits::Last).unwrap();
                let row = &batch.data()[i * vocab..(i + 1) * vocab];
                let d = max_abs_diff(row, alone.data());
                assert!(
                    d < tolerance,
                    "{name} on {label}: sequence {i} step {step} differs by {d}"
                );
                diff = diff.max(d);
                tokens[i] = ops::argmax(alone.data());
            }
        }
        for (b, a) in batch_caches.iter().zip(&alone_caches) {
            assert_eq!(b.offset, a.offset);
        }
        println!("{name} on {label}: batched decode within {diff:.2e} of one-by-one");
    }
}

#[test]
fn llama_batched_decode_matches_one_by_one() {
    check_batch("llama-4bit-g64");
}

#[test]
fn qwen2_batched_decode_matches_one_by_one() {
    check_batch("qwen2-4bit-g64");
}

/// Gated-DeltaNet layers step each sequence's own convolution and recurrent state.
#[test]
fn qwen3_5_batched_decode_matches_one_by_one() {
    check_batch("qwen3_5-4bit-g64");
}

#[test]
fn qwen3_5_moe_batched_decode_matches_one_by_one() {
    check_batch("qwen3_5_moe-4bit-g64");
    check_batch("qwen3_next-4bit-g32");
}

/// Sliding-window layers (a window of 8: the sequences of 7 and 19 tokens are before and past
/// it) keep each sequence's ring.
#[test]
fn gemma3_batched_decode_matches_one_by_one() {
    check_batch("gemma3-4bit-g64");
}

/// Caches of 8- and 4-bit codes: the GPU's runs against the host's, and batched decoding against
/// one by one on each device, for full attention (the MiniCPM5 llama) and sliding windows
/// (Gemma 3), both with heads of 32.
#[test]
fn code_caches_decode_alike_on_both_devices_and_batched() {
    for name in ["minicpm5-4bit-g64", "gemma3-4bit-g64"] {
        check_code_caches(name);
        check_batch_in(name, &CODE_CACHES);
    }
}

/// With per-layer inputs and layers that attend over an earlier layer's caches.
#[test]
fn gemma4_batched_decode_matches_one_by_one() {
    check_batch("gemma4-4bit-g32");
}

/// With routed experts beside each dense MLP, and values that are the keys' projection.
#[test]
fn gemma4_moe_batched_decode_matches_one_by_one() {
    check_batch("gemma4-moe-4bit-g64");
}

/// With AltUp's streams mixed row by row and a gaussian top-k cut at each row's own statistics.
#[test]
fn gemma3n_batched_decode_matches_one_by_one() {
    check_batch("gemma3n-4bit-g32");
}

/// Layers that differ from llama's: windowed layers with plain RoPE (OLMo 3), windowed and
/// NoPE layers (EXAONE 4), routed experts beside a dense layer (Qwen3-MoE), fused projections
/// with partial rotary (Phi-3), residual multipliers (Granite), grouped sigmoid routing
/// (GLM-4.5), latent attention (DeepSeek-V3), chunked attention (Llama 4).
#[test]
fn more_architectures_batched_decode_matches_one_by_one() {
    for name in [
        "llama4-4bit-g32",
        "olmo3-8bit-g32",
        "exaone4-4bit-g64",
        "qwen3_moe-4bit-g32",
        "phi3-4bit-g32",
        "granite-4bit-g32",
        "glm4_moe-4bit-g32",
        "deepseek_v3-4bit-g32",
        "ministral3-4bit-g32",
        "gemma2-4bit-g32",
        "gpt_oss-mxfp4-q8",
    ] {
        check_batch(name);
    }
}

/// Mamba-2 layers step each sequence's own convolution inputs and states (Granite 4.0-H's, and
/// Nemotron-H's between blocks that keep no cache).
#[test]
fn mamba2_hybrids_batched_decode_matches_one_by_one() {
    check_batch("granitemoehybrid-4bit-g32");
    check_batch("granitemoehybrid-dense-8bit-g64");
    check_batch("nemotron_h-4bit-g32");
    check_batch("nemotron_h-moe-4bit-g32");
}

/// Short-convolution layers step each sequence's own last inputs.
#[test]
fn lfm2_batched_decode_matches_one_by_one() {
    check_batch("lfm2-4bit-g64");
    check_batch("lfm2-8bit-g32");
    check_batch("lfm2_moe-4bit-g64");
}

/// Runs of several sequences in one pass (`hidden_runs`: prompts prefilled together) give each
/// row the hidden state its sequence gives alone: caches that already hold 0, 5 and 10
/// positions, then a run of 9 tokens each.
fn check_runs(name: &str) {
    let dir = fixtures().join(name);
    let golden = read_golden(&dir);
    let (devices, _turn) = devices();
    for (label, device, tolerance) in devices {
        let model = load_on(&dir, &device).unwrap();
        let hidden = model.info().hidden_size;
        let ids = |start: usize, n: usize| -> Vec<u32> {
            (start..start + n)
                .map(|i| golden.prompt_ids[i % golden.prompt_ids.len()])
                .collect()
        };
        let mut batch_caches = Vec::new();
        let mut alone = Vec::new();
        let mut tokens = Vec::new();
        for i in 0..3 {
            let mut cache = model.new_cache_in(KvPrecision::F32).unwrap();
            if i > 0 {
                model
                    .forward(&ids(i, 5 * i), &mut cache, Logits::Last)
                    .unwrap();
            }
            let run = ids(3 * i + 1, 9);
            let mut own = cache.try_clone().unwrap();
            let rows = model.forward(&run, &mut own, Logits::HiddenAll).unwrap();
            alone.extend(rows.into_vec().unwrap());
            tokens.extend(run);
            batch_caches.push(cache);
        }
        let mut refs: Vec<&mut oxlm_models::Cache> = batch_caches.iter_mut().collect();
        let runs = model.hidden_runs(&tokens, &mut refs).unwrap();
        assert_eq!(runs.shape(), &[27, hidden], "{name} on {label}");
        let d = max_abs_diff(runs.data(), &alone);
        assert!(
            d < tolerance,
            "{name} on {label}: runs differ from alone by {d}"
        );
        let offsets: Vec<usize> = batch_caches.iter().map(|c| c.offset).collect();
        assert_eq!(offsets, [9, 14, 19], "{name} on {label}");
        println!("{name} on {label}: runs within {d:.2e} of one by one");
    }
}

/// Plain attention, sliding windows (Gemma 3's window of 8 is passed), layers attending over
/// another's cache (Gemma 4, Gemma 3n), latent attention (DeepSeek-V3), chunked attention
/// (Llama 4: runs that cross a chunk), attention sinks (gpt-oss); and recurrent layers, which
/// take the runs one after another (Qwen3.5, LFM2).
#[test]
fn runs_of_several_sequences_match_one_by_one() {
    for name in [
        "llama-4bit-g64",
        "qwen3-8bit-g128",
        "gemma3-4bit-g64",
        "gemma4-4bit-g32",
        "gemma3n-4bit-g32",
        "deepseek_v3-4bit-g32",
        "llama4-4bit-g32",
        "gpt_oss-mxfp4-q8",
        "qwen3_5-4bit-g64",
        "lfm2-4bit-g64",
    ] {
        check_runs(name);
    }
}

#[test]
fn runs_must_be_of_equal_length() {
    let model = load_on(&fixtures().join("llama-4bit-g64"), &Device::Cpu).unwrap();
    let mut a = model.new_cache_in(KvPrecision::F32).unwrap();
    let mut b = model.new_cache_in(KvPrecision::F32).unwrap();
    let err = model
        .hidden_runs(&[1, 2, 3], &mut [&mut a, &mut b])
        .unwrap_err();
    assert_eq!(
        err,
        oxlm_models::ForwardError::UnevenRuns {
            tokens: 3,
            caches: 2
        }
    );
    assert_eq!((a.offset, b.offset), (0, 0));
}

#[test]
fn a_batch_needs_one_token_per_cache() {
    let model = load_on(&fixtures().join("llama-4bit-g64"), &Device::Cpu).unwrap();
    let mut cache = model.new_cache_in(KvPrecision::F32).unwrap();
    let err = model.forward_batch(&[1, 2], &mut [&mut cache]).unwrap_err();
    assert_eq!(
        err,
        oxlm_models::ForwardError::BatchMismatch {
            tokens: 2,
            caches: 1
        }
    );
}

#[test]
fn llama_decode_steps_replay_as_graphs() {
    check_replay("llama-4bit-g64");
}

/// Qwen2's biased projections take the fused projection kernel in a decode step.
#[test]
fn qwen2_decode_steps_replay_as_graphs() {
    check_replay("qwen2-4bit-g64");
}

#[test]
fn qwen3_5_decode_steps_replay_as_graphs() {
    check_replay("qwen3_5-4bit-g64");
}

/// Short-convolution layers' steps (their state written in place) replay as well.
#[test]
fn lfm2_decode_steps_replay_as_graphs() {
    check_replay("lfm2-4bit-g64");
}

/// Mamba-2 layers' steps (the scan's states written in place) replay as well, beside attention
/// and relu² MLP blocks.
#[test]
fn mamba2_hybrids_decode_steps_replay_as_graphs() {
    check_replay("granitemoehybrid-dense-8bit-g64");
    check_replay("nemotron_h-4bit-g32");
}

/// Mixtures of experts route and run their experts on the device, so their steps replay too:
/// softmax routing (Qwen3-MoE), grouped sigmoid routing with a correction bias and a shared
/// expert (GLM-4.5), a gated shared expert beside DeltaNet layers (Qwen3-Next).
#[test]
fn mixtures_decode_steps_replay_as_graphs() {
    check_replay("qwen3_moe-4bit-g32");
    check_replay("glm4_moe-4bit-g32");
    check_replay("qwen3_next-4bit-g32");
}

macro_rules! parity_tests {
    ($($test:ident => $dir:literal),* $(,)?) => {
        $(#[test] fn $test() { check_model($dir); })*
    };
}

parity_tests! {
    llama_4bit_g64_llama3_rope_8bit_head_dense_down => "llama-4bit-g64",
    llama_8bit_g32_tied => "llama-8bit-g32",
    llama_4bit_g32_embed_8bit => "llama-embed8-g32",
    llama_mxfp4_nvfp4_mxfp8_affine_8bit_tied_embed => "llama-mxfp4-g32",
    mistral_4bit_g32 => "mistral-4bit-g32",
    qwen2_4bit_g64_qkv_bias => "qwen2-4bit-g64",
    qwen3_8bit_g128_qk_norm => "qwen3-8bit-g128",
    gemma3_4bit_g64_sliding_window => "gemma3-4bit-g64",
    gemma3_vlm_8bit_g32_wrapper_linear_rope => "gemma3-vlm-8bit-g32",
    gemma4_4bit_g32_per_layer_inputs_kv_shared => "gemma4-4bit-g32",
    gemma4_vlm_8bit_g64_k_eq_v => "gemma4-vlm-8bit-g64",
    gemma4_moe_4bit_g64_routed_experts => "gemma4-moe-4bit-g64",
    gemma3n_4bit_g32_altup_laurel_sparse_mlps_kv_shared => "gemma3n-4bit-g32",
    qwen3_5_4bit_g64_hybrid_tied_text_config => "qwen3_5-4bit-g64",
    qwen3_5_8bit_g32_hybrid_flat_config_4bit_head => "qwen3_5-8bit-g32",
    qwen3_5_moe_4bit_g64_hybrid_experts => "qwen3_5_moe-4bit-g64",
    qwen3_5_hf_layout_sanitized_on_load => "qwen3_5-hf-layout-8bit-g32",
    qwen3_moe_4bit_g32_experts_and_a_dense_layer => "qwen3_moe-4bit-g32",
    mixtral_4bit_g32_block_sparse_moe => "mixtral-4bit-g32",
    smollm3_4bit_g64_nope_layers => "smollm3-4bit-g64",
    phi3_4bit_g32_fused_projections_partial_rotary => "phi3-4bit-g32",
    olmo2_4bit_g64_post_norm_full_qk_norm => "olmo2-4bit-g64",
    olmo3_8bit_g32_sliding_window => "olmo3-8bit-g32",
    granite_4bit_g32_multipliers => "granite-4bit-g32",
    minicpm_4bit_g64_scaled_depth => "minicpm-4bit-g64",
    minicpm5_4bit_g64_rope_parameters_by_layer_type => "minicpm5-4bit-g64",
    glm4_4bit_g32_sandwich_norms_interleaved_partial_rotary => "glm4-4bit-g32",
    exaone4_4bit_g64_windowed_and_nope_layers => "exaone4-4bit-g64",
    ernie4_5_8bit_g64_biases_everywhere => "ernie4_5-8bit-g64",
    seed_oss_4bit_g32_wide_heads => "seed_oss-4bit-g32",
    mistral3_4bit_g32_text_model_in_a_wrapper => "mistral3-4bit-g32",
    phi3_4bit_g32_longrope_partial_rotary => "phi3-longrope-4bit-g32",
    qwen3_4bit_g64_yarn => "qwen3-yarn-4bit-g64",
    glm4_moe_4bit_g32_grouped_sigmoid_routing_shared_experts => "glm4_moe-4bit-g32",
    qwen3_next_4bit_g32_fused_linear_projections => "qwen3_next-4bit-g32",
    deepseek_v3_4bit_g32_latent_attention_grouped_experts => "deepseek_v3-4bit-g32",
    ministral3_4bit_g32_llama4_query_scale_yarn_window => "ministral3-4bit-g32",
    olmoe_4bit_g32_experts_not_renormalized => "olmoe-4bit-g32",
    granitemoe_4bit_g32_renamed_router_multipliers => "granitemoe-4bit-g32",
    hunyuan_v1_dense_4bit_g32_qk_norm_after_rope_ntk_alpha => "hunyuan_v1_dense-4bit-g32",
    gemma2_4bit_g32_soft_capped_scores_and_logits => "gemma2-4bit-g32",
    gpt_oss_4bit_g32_sinks_biased_clamped_experts => "gpt_oss-4bit-g32",
    gpt_oss_mxfp4_q8_as_mlx_community_ships_it => "gpt_oss-mxfp4-q8",
    ernie4_5_moe_4bit_g32_dense_first_layer_shared_expert => "ernie4_5_moe-4bit-g32",
    lfm2_4bit_g64_short_conv_layer_types => "lfm2-4bit-g64",
    lfm2_8bit_g32_full_attn_idxs_conv_biases => "lfm2-8bit-g32",
    lfm2_moe_4bit_g64_sigmoid_routed_experts => "lfm2_moe-4bit-g64",
    llama4_4bit_g32_chunked_attention_tuned_nope_layers_input_weighted_experts => "llama4-4bit-g32",
    granitemoehybrid_4bit_g32_mamba2_nope_attention_experts_shared_mlp => "granitemoehybrid-4bit-g32",
    granitemoehybrid_dense_8bit_g64_mamba2_rope_clipped_steps => "granitemoehybrid-dense-8bit-g64",
    nemotron_h_4bit_g32_mamba2_grouped_norm_nope_relu2_mlp_blocks => "nemotron_h-4bit-g32",
    nemotron_h_moe_4bit_g32_latent_relu2_experts_grouped_sigmoid_routing => "nemotron_h-moe-4bit-g32",
}
