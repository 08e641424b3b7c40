//! The generation loop on tiny models against mlx-lm's greedy goldens: plain, resumed from a
//! cached prefix, stopped by a stop string, and cancelled.

use std::ops::ControlFlow;
use std::path::PathBuf;

use oxlm_engine::KvPrecision;
use oxlm_models::cache::LayerCache;
use oxlm_models::ForwardError;
use oxlm_runtime::generate::prefill;
use oxlm_runtime::prompt_cache::PromptCache;
use oxlm_runtime::sampler::SamplerConfig;
use oxlm_runtime::{
    generate, generate_stream, Event, FinishReason, GenerateOptions, LoadedModel, RuntimeError,
    StreamOptions,
};
use serde_json::Value;

struct Case {
    loaded: LoadedModel,
    prompt: Vec<u32>,
    greedy: Vec<u32>,
}

fn case(name: &str) -> Case {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/tiny")
        .join(name);
    let golden: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("golden.json")).unwrap()).unwrap();
    let loaded = LoadedModel::load(&dir).unwrap();
    let prompt = loaded
        .tokenizer
        .encode(golden["prompt_text"].as_str().unwrap(), false)
        .unwrap();
    assert_eq!(prompt.len() as u64, golden["n_prompt"].as_u64().unwrap());
    let greedy = serde_json::from_value(golden["greedy_ids"].clone()).unwrap();
    Case {
        loaded,
        prompt,
        greedy,
    }
}

fn options(max_tokens: usize) -> GenerateOptions {
    GenerateOptions {
        max_tokens,
        sampler: SamplerConfig::default(),
        prefill_step: 16,
        kv_cache: None,
        kv_quantization: None,
        max_kv_size: None,
    }
}

/// Runs `generate_stream` from `cache`; returns the sampled ids and the streamed text.
fn run(
    c: &Case,
    cache: &mut oxlm_models::Cache,
    max_tokens: usize,
    stream: &StreamOptions,
    stop_after: Option<usize>,
) -> (Vec<u32>, String, FinishReason) {
    let (mut ids, mut text) = (Vec::new(), String::new());
    let generation = generate_stream(
        c.loaded.model.as_ref(),
        &c.loaded.tokenizer,
        &c.prompt,
        cache,
        &c.loaded.eos_ids,
        &options(max_tokens),
        stream,
        &mut |event| {
            match event {
                Event::Token {
                    id, text: t, top, ..
                } => {
                    assert_eq!(top.len(), stream.top_logprobs);
                    ids.push(id);
                    text.push_str(t);
                }
                Event::Text(t) => text.push_str(t),
                Event::Prefill { .. } => {}
            }
            match stop_after {
                Some(n) if ids.len() >= n => ControlFlow::Break(()),
                _ => ControlFlow::Continue(()),
            }
        },
    )
    .unwrap();
    assert_eq!(generation.text, text);
    (ids, text, generation.finish_reason)
}

#[test]
fn generate_gives_the_golden_greedy_tokens() {
    let c = case("llama-8bit-g32");
    let mut streamed = String::new();
    let generation = generate(
        c.loaded.model.as_ref(),
        &c.loaded.tokenizer,
        &c.prompt,
        &c.loaded.eos_ids,
        &options(32),
        &mut |t| streamed.push_str(t),
    )
    .unwrap();
    assert_eq!(generation.tokens, c.greedy);
    assert_eq!(generation.text, streamed);
    assert_eq!(generation.finish_reason, FinishReason::Length);
    assert_eq!(generation.prompt_tokens, c.prompt.len());
}

/// `kv_cache` picks the cache's precision: the host's f16 when unset, f32 on request; the
/// golden greedy tokens come out either way on this model.
#[test]
fn the_kv_cache_option_sets_the_cache_precision() {
    let c = case("llama-8bit-g32");
    let model = c.loaded.model.as_ref();
    for (asked, kept) in [
        (None, KvPrecision::F16),
        (Some(KvPrecision::F32), KvPrecision::F32),
    ] {
        let opts = GenerateOptions {
            kv_cache: asked,
            kv_quantization: None,
            ..options(32)
        };
        let mut cache = opts.new_cache(model).unwrap();
        prefill(model, &c.prompt, &mut cache, 16).unwrap();
        let LayerCache::Kv(layer) = &cache.layers[0] else {
            panic!("llama layers keep a KvCache")
        };
        assert_eq!(layer.view().keys.precision(), kept);
        let generation = generate(
            model,
            &c.loaded.tokenizer,
            &c.prompt,
            &c.loaded.eos_ids,
            &opts,
            &mut |_| {},
        )
        .unwrap();
        assert_eq!(generation.tokens, c.greedy, "{asked:?}");
    }
}

#[test]
fn resuming_from_a_cached_prefix_changes_nothing() {
    for name in ["llama-8bit-g32", "qwen3_5-8bit-g32", "gemma3-4bit-g64"] {
        let c = case(name);
        let model = c.loaded.model.as_ref();
        let plain = StreamOptions::default();
        let mut fresh = model.new_cache().unwrap();
        let (ids, text, _) = run(&c, &mut fresh, 32, &plain, None);
        assert_eq!(ids, c.greedy, "{name}");
        // A snapshot of the prompt less its last token, as the server keeps for any model.
        let mut pc = PromptCache::new(4, usize::MAX);
        let mut cache = model.new_cache().unwrap();
        let n = c.prompt.len() - 1;
        prefill(model, &c.prompt[..n], &mut cache, 16).unwrap();
        pc.insert((), c.prompt[..n].to_vec(), cache);
        let hit = pc.fetch(&(), &c.prompt).unwrap();
        assert_eq!(hit.tokens, n);
        let mut cache = hit.cache;
        assert_eq!(run(&c, &mut cache, 32, &plain, None).1, text, "{name}");
        // The cache then holds the prompt and every generated token but the last.
        assert_eq!(cache.offset, c.prompt.len() + 31, "{name}");
    }
}

#[test]
fn stop_strings_and_cancellation() {
    let c = case("llama-8bit-g32");
    let model = c.loaded.model.as_ref();
    let full = run(
        &c,
        &mut model.new_cache().unwrap(),
        32,
        &StreamOptions::default(),
        None,
    )
    .1;
    let stop = StreamOptions {
        stop: vec!["yve".into()],
        top_logprobs: 2,
        ..StreamOptions::default()
    };
    let (ids, text, reason) = run(&c, &mut model.new_cache().unwrap(), 32, &stop, None);
    assert_eq!(text, full[..full.find("yve").unwrap()]);
    assert_eq!(reason, FinishReason::Stop);
    assert_eq!(ids, c.greedy[..7]);

    let mut cache = model.new_cache().unwrap();
    let plain = StreamOptions::default();
    let (ids, _, reason) = run(&c, &mut cache, 32, &plain, Some(3));
    assert_eq!(reason, FinishReason::Cancelled);
    assert_eq!(ids, c.greedy[..3]);
    assert_eq!(cache.offset, c.prompt.len() + 2);
}

/// A prompt past the model's context (2048 tokens) is refused before any of it goes through the
/// model, not once prefill reaches the limit.
#[test]
fn a_prompt_past_the_context_is_refused_before_prefill() {
    let c = case("llama-8bit-g32");
    let model = c.loaded.model.as_ref();
    let prompt = vec![c.prompt[0]; 2049];
    let mut cache = model.new_cache().unwrap();
    let mut events = 0;
    let result = generate_stream(
        model,
        &c.loaded.tokenizer,
        &prompt,
        &mut cache,
        &c.loaded.eos_ids,
        &options(4),
        &StreamOptions::default(),
        &mut |_| {
            events += 1;
            ControlFlow::Continue(())
        },
    );
    let Err(RuntimeError::Forward(overflow)) = result else {
        panic!("a prompt of 2049 tokens was not refused");
    };
    assert_eq!(
        overflow,
        ForwardError::ContextOverflow {
            needed: 2049,
            limit: 2048
        }
    );
    assert_eq!((events, cache.offset), (0, 0));
}

/// `max_kv_size` bounds the cache of a model type mlx-lm bounds (qwen3) as mlx-lm's
/// `generate_step(..., max_kv_size=16)` does, for a prompt three windows long: the greedy tokens
/// and the top log-probabilities of mlx-lm's (`max_kv_size.json`, from
/// scripts/oracle/make_max_kv_size_golden.py), with the prompt in one chunk and in chunks of 7.
/// Every layer's cache stays at the window, keeping the first 4 positions.
#[test]
fn max_kv_size_bounds_the_cache_as_mlx_lm_does() {
    let dir =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny/qwen3-8bit-g128");
    let golden: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("max_kv_size.json")).unwrap())
            .unwrap();
    let loaded = LoadedModel::load(&dir).unwrap();
    let model = loaded.model.as_ref();
    let prompt: Vec<u32> = serde_json::from_value(golden["prompt_ids"].clone()).unwrap();
    let max_kv_size = golden["max_kv_size"].as_u64().unwrap() as usize;
    for run in golden["runs"].as_array().unwrap() {
        let want: Vec<u32> = serde_json::from_value(run["tokens"].clone()).unwrap();
        let opts = GenerateOptions {
            max_tokens: want.len(),
            prefill_step: run["prefill_step"].as_u64().unwrap() as usize,
            kv_cache: Some(KvPrecision::F32),
            max_kv_size: Some(max_kv_size),
            ..options(0)
        };
        let mut cache = opts.new_cache(model).unwrap();
        let stream = StreamOptions {
            top_logprobs: 4,
            ..StreamOptions::default()
        };
        let mut steps = Vec::new();
        // No end-of-sequence stop: mlx-lm's generate_step has none.
        let eos = Default::default();
        let generation = generate_stream(
            model,
            &loaded.tokenizer,
            &prompt,
            &mut cache,
            &eos,
            &opts,
            &stream,
            &mut |event| {
                if let Event::Token { id, top, .. } = event {
                    steps.push((id, top.to_vec()));
                }
                ControlFlow::Continue(())
            },
        )
        .unwrap();
        let step = run["prefill_step"].clone();
        assert_eq!(generation.tokens, want, "prefill step {step}");
        for (i, row) in run["logprobs"].as_object().unwrap() {
            let row: Vec<f32> = serde_json::from_value(row.clone()).unwrap();
            let (_, top) = &steps[i.parse::<usize>().unwrap()];
            for &(id, logprob) in top {
                let d = (row[id as usize] - logprob).abs();
                assert!(d < 1e-3, "prefill step {step}, step {i}, token {id}: {d}");
            }
        }
        for layer in &cache.layers {
            let LayerCache::Rotating(ring) = layer else {
                panic!("a bounded cache's layers are rings")
            };
            assert!(
                ring.keeps_first_positions() && ring.view().end - ring.view().start <= max_kv_size
            );
        }
    }
}

/// Model types whose mlx-lm model builds its own cache (llama) leave `max_kv_size` unused, as
/// mlx-lm does.
#[test]
fn max_kv_size_leaves_other_model_types_unbounded() {
    let c = case("llama-8bit-g32");
    let opts = GenerateOptions {
        max_kv_size: Some(8),
        ..options(4)
    };
    let cache = opts.new_cache(c.loaded.model.as_ref()).unwrap();
    assert!(cache.layers.iter().all(|l| matches!(l, LayerCache::Kv(_))));
}
