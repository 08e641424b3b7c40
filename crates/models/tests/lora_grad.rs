//! The training loss and LoRA gradients against mlx-lm's `value_and_grad` of `default_loss` on
//! the same batch from the same adapter (tests/fixtures/lora/train-*, from
//! scripts/oracle/make_lora_train_fixture.py), and against finite differences of the loss.
//!
//! Tolerances: the loss within 1e-4 relative (both sides in f32, summed in another order); each
//! gradient array within 1e-3 of its largest element (see `grad_tolerance` for the one exception).

use std::path::{Path, PathBuf};

use oxlm_models::lora::{AdaptedModel, Adapters};
use oxlm_models::lora_grad::{loss_sum, AdapterGrads, Example};
use oxlm_models::{load, LanguageModel};

const LOSS_TOLERANCE: f32 = 1e-4;
const GRAD_TOLERANCE: f32 = 1e-3;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

struct Step {
    examples: Vec<Example>,
    loss: f32,
    ntoks: usize,
    grads: Vec<(String, Vec<f32>)>,
}

fn read_step(run: &str) -> Step {
    let bytes = std::fs::read(fixtures().join("lora").join(run).join("step.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let words = |name: &str| -> Vec<u32> {
        st.tensor(name)
            .unwrap()
            .data()
            .chunks_exact(4)
            .map(|b| u32::from_le_bytes(b.try_into().unwrap()))
            .collect()
    };
    let floats = |name: &str| -> Vec<f32> { words(name).into_iter().map(f32::from_bits).collect() };
    let batch = st.tensor("batch").unwrap();
    let width = batch.shape()[1];
    let (tokens, lengths) = (words("batch"), words("lengths"));
    let examples = tokens
        .chunks_exact(width)
        .zip(lengths.chunks_exact(2))
        .filter_map(|(row, ol)| Example::from_padded(row, ol[0] as usize, ol[1] as usize))
        .collect();
    let mut grads: Vec<(String, Vec<f32>)> = st
        .names()
        .into_iter()
        .filter_map(|n| n.strip_prefix("grad.").map(|p| (p.to_string(), floats(n))))
        .collect();
    grads.sort_by(|a, b| a.0.cmp(&b.0));
    Step {
        examples,
        loss: floats("loss")[0],
        ntoks: words("ntoks")[0] as usize,
        grads,
    }
}

const RUNS: [(&str, &str); 16] = [
    ("train-llama-4bit-g64", "llama-4bit-g64"),
    ("train-qwen3-8bit-g128", "qwen3-8bit-g128"),
    ("train-gemma3-4bit-g64", "gemma3-4bit-g64"),
    ("train-qwen3_5-4bit-g64", "qwen3_5-4bit-g64"),
    ("train-qwen3_5_moe-4bit-g64", "qwen3_5_moe-4bit-g64"),
    ("train-gemma4-4bit-g32", "gemma4-4bit-g32"),
    ("train-gemma4-moe-4bit-g64", "gemma4-moe-4bit-g64"),
    ("train-olmo3-8bit-g32", "olmo3-8bit-g32"),
    ("train-granite-4bit-g32", "granite-4bit-g32"),
    ("train-qwen3_moe-4bit-g32", "qwen3_moe-4bit-g32"),
    ("train-glm4_moe-4bit-g32", "glm4_moe-4bit-g32"),
    ("train-lfm2-4bit-g64", "lfm2-4bit-g64"),
    ("train-lfm2-8bit-g32", "lfm2-8bit-g32"),
    ("train-lfm2_moe-4bit-g64", "lfm2_moe-4bit-g64"),
    ("train-gemma2-4bit-g32", "gemma2-4bit-g32"),
    ("train-gpt_oss-4bit-g32", "gpt_oss-4bit-g32"),
];

/// The gradient tolerance of one array of `run`. In the mixture-of-experts run, the first
/// DeltaNet layer's `in_proj_qkv` differs by 1.8e-3 to 3.3e-3 (with the kernels of CPUs with
/// and without AVX-512), in the columns of one query/key head only, where the loss is so curved
/// that central differences down to ±1e-4 do not settle: the backward pass through that head's
/// L2 norm magnifies f32 rounding on both sides.
fn grad_tolerance(run: &str, name: &str) -> f32 {
    let ill_conditioned = run.contains("moe") && name.contains("layers.0.linear_attn.in_proj_qkv");
    if ill_conditioned {
        5e-3
    } else {
        GRAD_TOLERANCE
    }
}

/// `m` (`[rows, cols]`) transposed.
fn transpose(m: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    (0..cols)
        .flat_map(|c| (0..rows).map(move |r| m[r * cols + c]))
        .collect()
}

/// The gradient of `layer`'s `lora_a` or `lora_b` as mlx-lm lays it out: a stack of experts'
/// as `[experts, rank, in]` and `[experts, out, rank]`.
fn mlx_layout(grads: &AdapterGrads, adapters: &Adapters, layer: &str, half: &str) -> Vec<f32> {
    if let Some(g) = grads.layers.get(layer) {
        return if half == "lora_a" {
            g.a.clone()
        } else {
            g.b.clone()
        };
    }
    let shapes = &adapters.experts[layer][0];
    let (r, inputs, outputs) = (shapes.rank, shapes.in_features, shapes.out_features);
    let each = grads.experts[layer].iter();
    match half {
        "lora_a" => each.flat_map(|g| transpose(&g.a, inputs, r)).collect(),
        _ => each.flat_map(|g| transpose(&g.b, r, outputs)).collect(),
    }
}

fn setup(run: &str, base: &str) -> (Box<dyn LanguageModel>, Adapters) {
    let model = load(&fixtures().join("tiny").join(base)).unwrap();
    let adapters = Adapters::load(
        &fixtures().join("lora").join(run).join("init"),
        model.as_ref(),
    )
    .unwrap();
    (model, adapters)
}

#[test]
fn first_step_matches_mlx_lm() {
    for (run, base) in RUNS {
        let (model, adapters) = setup(run, base);
        let step = read_step(run);
        for checkpoint in [false, true] {
            let got = model
                .adaptable()
                .unwrap()
                .loss_and_grads(&step.examples, &adapters, checkpoint)
                .unwrap();
            assert_eq!(got.tokens, step.ntoks, "{run}: scored tokens");
            let rel = (got.loss - step.loss).abs() / step.loss;
            println!(
                "{run} checkpoint={checkpoint}: loss {} vs mlx-lm {} (rel {rel:.1e})",
                got.loss, step.loss
            );
            assert!(rel < LOSS_TOLERANCE);
            assert_eq!(
                (got.grads.layers.len() + got.grads.experts.len()) * 2,
                step.grads.len(),
                "{run}: gradient arrays"
            );
            let mut worst = 0.0f32;
            for (name, want) in &step.grads {
                let (layer, half) = name.rsplit_once('.').unwrap();
                let ours = mlx_layout(&got.grads, &adapters, layer, half);
                assert_eq!(ours.len(), want.len(), "{run}: {name}");
                let scale = want.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                let diff = ours
                    .iter()
                    .zip(want)
                    .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
                assert!(scale > 0.0, "{run}: {name} is all zero");
                worst = worst.max(diff / scale);
                assert!(
                    diff <= grad_tolerance(run, name) * scale,
                    "{run}: {name}: {diff} vs largest {scale}"
                );
            }
            println!("{run} checkpoint={checkpoint}: worst gradient error {worst:.1e} of the largest element");
        }
    }
}

#[test]
fn the_loss_is_the_forward_pass_loss() {
    let (run, base) = RUNS[0];
    let (model, adapters) = setup(run, base);
    let step = read_step(run);
    let adapted = AdaptedModel::new(model.as_ref(), &adapters).unwrap();
    let (sum, tokens) = loss_sum(&adapted, &step.examples).unwrap();
    let got = model
        .adaptable()
        .unwrap()
        .loss_and_grads(&step.examples, &adapters, false)
        .unwrap();
    assert_eq!(tokens, got.tokens);
    assert!(((sum / tokens as f64) as f32 - got.loss).abs() < 1e-5);
}

/// `adapters` with one element of one matrix moved by `delta`.
fn nudged(adapters: &Adapters, path: &str, half: &str, index: usize, delta: f32) -> Adapters {
    let mut out = adapters.clone();
    let layer = out.layers.get_mut(path).unwrap();
    let m = if half == "a" {
        &mut layer.a
    } else {
        &mut layer.b
    };
    m[index] += delta;
    out
}

#[test]
fn gradients_match_finite_differences() {
    let (run, base) = RUNS[1];
    let (model, adapters) = setup(run, base);
    let examples: Vec<Example> = read_step(run).examples.into_iter().take(2).collect();
    let grads = model
        .adaptable()
        .unwrap()
        .loss_and_grads(&examples, &adapters, false)
        .unwrap()
        .grads;
    let loss = |a: &Adapters| -> f64 {
        let (sum, n) = loss_sum(&AdaptedModel::new(model.as_ref(), a).unwrap(), &examples).unwrap();
        sum / n as f64
    };
    let step = 1e-2f32;
    for path in adapters.layers.keys() {
        for (half, index) in [("a", 3), ("b", 5), ("b", 17)] {
            let up = loss(&nudged(&adapters, path, half, index, step));
            let down = loss(&nudged(&adapters, path, half, index, -step));
            let numeric = ((up - down) / (2.0 * step as f64)) as f32;
            let g = &grads.layers[path];
            let analytic = if half == "a" { g.a[index] } else { g.b[index] };
            println!("{path}.lora_{half}[{index}]: analytic {analytic:.6} numeric {numeric:.6}");
            // The losses are f32 forward passes, so the central difference over ±1e-2 carries
            // an absolute error of its own: up to 2.4e-5 on a VM whose prefill GEMM runs on AMX
            // tiles (the backward pass does not), under 2e-5 elsewhere.
            assert!(
                (analytic - numeric).abs() <= 2e-3 * analytic.abs() + 3e-5,
                "{path}.lora_{half}[{index}]: analytic {analytic} vs numeric {numeric}"
            );
        }
    }
}
