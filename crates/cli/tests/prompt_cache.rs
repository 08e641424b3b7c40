//! Prompt caches on disk against mlx-lm (`tests/fixtures/prompt_cache/`, made by
//! `scripts/oracle/make_prompt_cache_fixture.py` with fp32 activations): `oxlm cache-prompt`
//! writes mlx-lm's arrays and metadata; `oxlm generate --prompt-cache-file` continues mlx-lm's
//! files with mlx-lm's greedy tokens, and its own files as the cache they were saved from; every
//! tiny model's file has mlx-lm's layout; quantized and `--max-kv-size` caches go both ways; and a
//! file of another model, one whose numbers do not add up, or not a prompt cache at all, is
//! refused with an error.

use std::collections::BTreeMap;
use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use oxlm_engine::KvPrecision;
use oxlm_models::cache::LayerCache;
use oxlm_models::cache_state::{LayerState, StateItem};
use oxlm_models::Cache;
use oxlm_runtime::generate::{generate_stream_after_cache, prefill};
use oxlm_runtime::prompt_cache_file::{
    self, cached_prompt_ids, prompt_after_cache, PromptCacheFile, PromptCacheFileError,
};
use oxlm_runtime::sampler::SamplerConfig;
use oxlm_runtime::{GenerateOptions, LoadedModel, StreamOptions};
use safetensors::SafeTensors;
use serde_json::{json, Map, Value};

const OXLM: &str = env!("CARGO_BIN_EXE_oxlm");

/// Models whose mlx-lm file is kept and whose state oxlm writes as mlx-lm does: one of each cache
/// kind beside `KVCache`.
const SAME_LAYOUT: [&str; 3] = ["llama-4bit-g64", "gemma3-4bit-g64", "lfm2-4bit-g64"];

/// Models whose mlx-lm file is kept: those, and Ministral 3 in mlx-lm's `mistral3` wrapper,
/// which makes no caches of its own, so mlx-lm keeps a whole `KVCache` for its sliding-window
/// layer where oxlm keeps a ring (and writes a `RotatingKVCache`, which mlx-lm's Ministral 3
/// attention takes as it makes one itself without the wrapper).
const FILES: [&str; 4] = [
    "llama-4bit-g64",
    "gemma3-4bit-g64",
    "lfm2-4bit-g64",
    "ministral3-4bit-g32",
];

/// `(model, layer)`: a layer whose class oxlm writes otherwise than mlx-lm (see [`FILES`]).
const OTHER_CLASS: [(&str, usize); 1] = [("ministral3-4bit-g32", 0)];

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The model's path as the fixture script gave it to mlx-lm (relative to the repository).
fn model_arg(name: &str) -> String {
    format!("tests/fixtures/tiny/{name}")
}

fn fixture(name: &str) -> PathBuf {
    root().join(format!("tests/fixtures/prompt_cache/{name}.safetensors"))
}

fn golden() -> Value {
    let path = root().join("tests/fixtures/prompt_cache/golden.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn ids(value: &Value) -> Vec<u32> {
    serde_json::from_value(value.clone()).unwrap()
}

fn load(name: &str) -> LoadedModel {
    LoadedModel::load(&root().join(model_arg(name))).unwrap()
}

fn options(max_tokens: usize) -> GenerateOptions {
    GenerateOptions {
        max_tokens,
        sampler: SamplerConfig::default(),
        prefill_step: 2048,
        kv_cache: Some(KvPrecision::F32),
        kv_quantization: None,
        max_kv_size: None,
    }
}

/// The greedy ids of generation after `cache`, continued with `prompt`.
fn continue_greedy(
    loaded: &LoadedModel,
    cache: &mut Cache,
    prompt: &[u32],
    steps: usize,
) -> Vec<u32> {
    let generation = generate_stream_after_cache(
        loaded.model.as_ref(),
        &loaded.tokenizer,
        prompt,
        cache,
        &loaded.eos_ids,
        &options(steps),
        &StreamOptions::default(),
        &mut |_| ControlFlow::Continue(()),
    )
    .unwrap();
    generation.tokens
}

/// The cache after the golden's first prompt, in f32, as `oxlm cache-prompt --kv-cache f32`
/// leaves it.
fn cache_after_prompt(loaded: &LoadedModel, golden: &Value) -> Cache {
    let prompt = golden["prompt"].as_str().unwrap();
    let ids = cached_prompt_ids(&loaded.tokenizer, loaded.chat_template.as_ref(), prompt).unwrap();
    let mut cache = options(0).new_cache(loaded.model.as_ref()).unwrap();
    prefill(loaded.model.as_ref(), &ids, &mut cache, 2048).unwrap();
    cache
}

/// The second prompt's ids, after the cached one, as `generate --prompt-cache-file` makes them.
fn suffix_ids(loaded: &LoadedModel, golden: &Value) -> Vec<u32> {
    let message = json!({"role": "user", "content": golden["second"]});
    let template = loaded.chat_template.as_ref().unwrap();
    let text = prompt_after_cache(template, &[message], &Map::new()).unwrap();
    loaded.tokenizer.encode(&text, false).unwrap()
}

fn oxlm(args: &[&str]) -> Output {
    Command::new(OXLM)
        .current_dir(root())
        .args(args)
        .output()
        .unwrap()
}

/// `oxlm cache-prompt` of the golden's first prompt through model `name` into `out`.
fn cache_prompt(name: &str, golden: &Value, out: &Path, flags: &[&str]) -> Output {
    let model = model_arg(name);
    let prompt = golden["prompt"].as_str().unwrap();
    let out = out.to_str().unwrap();
    let args = ["cache-prompt", "--model", &model, "--prompt", prompt];
    oxlm(&[&args[..], &["--prompt-cache-file", out], flags].concat())
}

/// `oxlm generate` of the golden's second prompt after the prompt cache `file`, in f32.
fn generate_after(file: &Path, golden: &Value, steps: usize) -> Output {
    generate_after_with(file, golden, steps, &[])
}

/// [`generate_after`] with more flags.
fn generate_after_with(file: &Path, golden: &Value, steps: usize, flags: &[&str]) -> Output {
    let args = [
        "generate",
        "--prompt-cache-file",
        file.to_str().unwrap(),
        "--prompt",
        golden["second"].as_str().unwrap(),
        "--max-tokens",
        &steps.to_string(),
        "--kv-cache",
        "f32",
    ];
    oxlm(&[&args[..], flags].concat())
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

/// The generated text between the report's `==========` lines.
fn generated(output: &Output) -> String {
    let stdout = String::from_utf8_lossy(&output.stdout);
    let mut parts = stdout.split("==========\n");
    parts.nth(1).unwrap().trim_end_matches('\n').to_owned()
}

/// Each array of a safetensors file as (dtype, shape, f32 values or integers), and its metadata.
type Arrays = BTreeMap<String, (String, Vec<usize>, Vec<f64>)>;

fn read_file(path: &Path) -> (Arrays, BTreeMap<String, String>) {
    let bytes = std::fs::read(path).unwrap();
    let (_, header) = SafeTensors::read_metadata(&bytes).unwrap();
    let metadata = header.metadata().clone().unwrap_or_default();
    let tensors = SafeTensors::deserialize(&bytes).unwrap();
    let arrays = tensors
        .tensors()
        .into_iter()
        .map(|(name, view)| {
            let data = view.data();
            let values: Vec<f64> = match view.dtype() {
                safetensors::Dtype::F32 => data
                    .chunks(4)
                    .map(|b| f32::from_le_bytes(b.try_into().unwrap()) as f64)
                    .collect(),
                safetensors::Dtype::F16 => data
                    .chunks(2)
                    .map(|b| half::f16::from_le_bytes(b.try_into().unwrap()).to_f64())
                    .collect(),
                safetensors::Dtype::I32 => data
                    .chunks(4)
                    .map(|b| i32::from_le_bytes(b.try_into().unwrap()) as f64)
                    .collect(),
                other => panic!("{name}: {other:?}"),
            };
            let dtype = format!("{:?}", view.dtype());
            (name, (dtype, view.shape().to_vec(), values))
        })
        .collect();
    (arrays, metadata.into_iter().collect())
}

/// (a) `oxlm cache-prompt --kv-cache f32` writes mlx-lm's file: the same metadata (the model as
/// given, the tokenizer_config, the classes, the scalars), the same arrays of the same types
/// and shapes, each element within 5e-5 of the array's largest (f32 arithmetic in another
/// order: 7.3e-6 seen), the unused positions zero alike. In the default f16, keys and values are
/// f16 arrays within 5e-3 of the largest: the first layer's are mlx-lm's rounded (2.4e-4 seen),
/// and the layers after it attend over rounded keys, which moves theirs further (2.2e-3 seen).
#[test]
fn cache_prompt_writes_mlx_lms_file() {
    let golden = golden();
    let dir = tempfile::tempdir().unwrap();
    for name in SAME_LAYOUT {
        for (precision, dtype, tolerance) in [("f32", "F32", 5e-5), ("f16", "F16", 5e-3)] {
            let out = dir.path().join(format!("{name}-{precision}.safetensors"));
            let output = cache_prompt(name, &golden, &out, &["--kv-cache", precision]);
            assert!(output.status.success(), "{name}: {}", stderr(&output));
            assert!(String::from_utf8_lossy(&output.stdout).contains("Saving..."));
            let case = format!("{name} {precision}");
            assert_same_file(&case, &out, &fixture(name), dtype, tolerance);
        }
    }
}

/// Asserts that the prompt cache `got` holds what mlx-lm's `want` does: the same metadata, the
/// same arrays of the same shapes, numbers exactly, keys and values as `dtype` (recurrent states
/// as f32) each element within `tolerance` of the array's largest, the unused slots zero alike.
fn assert_same_file(case: &str, got: &Path, want: &Path, dtype: &str, tolerance: f64) {
    let ((got, got_meta), (want, want_meta)) = (read_file(got), read_file(want));
    assert_eq!(got_meta, want_meta, "{case}: metadata");
    assert_eq!(
        got.keys().collect::<Vec<_>>(),
        want.keys().collect::<Vec<_>>(),
        "{case}"
    );
    for (key, (want_type, want_shape, want_values)) in &want {
        let (got_type, got_shape, got_values) = &got[key];
        assert_eq!(got_shape, want_shape, "{case} {key}");
        let float = want_type == "F32" && !want_shape.is_empty() && want_shape != &[0];
        if !float {
            // Offsets and the ring's numbers, exactly; `None` as an empty f32 array.
            assert_eq!((got_type, got_values), (want_type, want_values), "{key}");
            continue;
        }
        // Keys and values in the cache's precision; recurrent states stay f32.
        let dtype = if want_shape.len() == 4 { dtype } else { "F32" };
        assert_eq!(got_type, dtype, "{case} {key}");
        let top = want_values.iter().fold(1.0f64, |m, v| m.max(v.abs()));
        for (i, (g, w)) in got_values.iter().zip(want_values).enumerate() {
            let close = (g - w).abs() <= tolerance * top;
            assert!(close, "{case} {key}[{i}]: {g} vs mlx-lm's {w}");
            // The positions past the prompt, zero alike.
            assert!(*w != 0.0 || *g == 0.0, "{case} {key}[{i}]: {g}");
        }
    }
}

/// (b) mlx-lm's files, continued with the second prompt, give mlx-lm's greedy tokens: through
/// the library (ids), and through `oxlm generate --prompt-cache-file` with the model the file
/// names (text).
#[test]
fn mlx_lms_files_continue_with_mlx_lms_tokens() {
    let golden = golden();
    let steps = golden["steps"].as_u64().unwrap() as usize;
    for name in FILES {
        let want = &golden["models"][name];
        let loaded = load(name);
        let suffix = suffix_ids(&loaded, &golden);
        assert_eq!(suffix, ids(&want["suffix_ids"]), "{name}: the suffix");
        let file = PromptCacheFile::load(&fixture(name)).unwrap();
        assert_eq!(file.model(), Some(model_arg(name).as_str()));
        let mut cache = options(0).new_cache(loaded.model.as_ref()).unwrap();
        file.restore(&mut cache).unwrap();
        assert_eq!(cache.offset, want["cached_ids"].as_array().unwrap().len());
        let tokens = continue_greedy(&loaded, &mut cache, &suffix, steps);
        assert_eq!(tokens, ids(&want["greedy_ids"]), "{name}");

        let output = generate_after(&fixture(name), &golden, steps);
        assert!(output.status.success(), "{name}: {}", stderr(&output));
        let text = loaded.tokenizer.decode(&tokens, false).unwrap();
        // mlx-lm's streaming detokenizer drops the first token's leading space; so does oxlm's.
        let text = text.strip_prefix(' ').unwrap_or(&text);
        assert_eq!(generated(&output), text, "{name}");
        let report = String::from_utf8_lossy(&output.stdout);
        // As mlx-lm reports it: only the new prompt's tokens.
        let prompt_tokens = format!("Prompt: {} tokens", suffix.len());
        assert!(report.contains(&prompt_tokens), "{name}: {report}");
    }
}

/// mlx-lm's file of a quantized cache (`cache_prompt --kv-bits 4 --kv-group-size 32
/// --quantized-kv-start 0`: QuantizedKVCache layers) both ways: (a) `oxlm generate` continues
/// it with mlx-lm's greedy tokens, its codes kept as they are; (b) `oxlm cache-prompt` with the
/// same flags writes the same file: metadata, array names, types and shapes, the scales and
/// biases within 1e-5 of the largest, and the codes' words equal but where keys that differ in
/// their last digits round to a neighbouring code (at most 1 in 100); (c) read back, its file
/// continues as the cache it was saved from.
#[test]
fn quantized_caches_go_both_ways() {
    let golden = golden();
    let (name, stem) = ("qwen3-8bit-g128", "qwen3-8bit-g128-kv4-g32");
    let want = &golden["models"][stem];
    let steps = golden["steps"].as_u64().unwrap() as usize;
    let loaded = load(name);
    let suffix = suffix_ids(&loaded, &golden);
    let output = generate_after(&fixture(stem), &golden, steps);
    assert!(output.status.success(), "{}", stderr(&output));
    let text = loaded
        .tokenizer
        .decode(&ids(&want["greedy_ids"]), false)
        .unwrap();
    assert_eq!(generated(&output), text.strip_prefix(' ').unwrap_or(&text));

    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("kv4.safetensors");
    let flags = [
        "--kv-cache",
        "f32",
        "--kv-bits",
        "4",
        "--kv-group-size",
        "32",
    ];
    let flags = [&flags[..], &["--quantized-kv-start", "0"]].concat();
    let output = cache_prompt(name, &golden, &out, &flags);
    assert!(output.status.success(), "{}", stderr(&output));
    let (mine, theirs) = (
        std::fs::read(&out).unwrap(),
        std::fs::read(fixture(stem)).unwrap(),
    );
    let (mine, theirs) = (
        SafeTensors::deserialize(&mine).unwrap(),
        SafeTensors::deserialize(&theirs).unwrap(),
    );
    let metadata = |path: &Path| {
        let bytes = std::fs::read(path).unwrap();
        let (_, header) = SafeTensors::read_metadata(&bytes).unwrap();
        header.metadata().clone().unwrap()
    };
    let meta = metadata(&out);
    assert_eq!(meta, metadata(&fixture(stem)));
    assert!(meta.values().filter(|c| *c == "QuantizedKVCache").count() == 2);
    let mut names = mine.names();
    names.sort();
    let mut their_names = theirs.names();
    their_names.sort();
    assert_eq!(names, their_names);
    let (mut words, mut differing) = (0, 0);
    for name in names {
        let (a, b) = (mine.tensor(name).unwrap(), theirs.tensor(name).unwrap());
        assert_eq!((a.dtype(), a.shape()), (b.dtype(), b.shape()), "{name}");
        match a.dtype() {
            safetensors::Dtype::U32 => {
                let pairs = a.data().chunks(4).zip(b.data().chunks(4));
                words += a.data().len() / 4;
                differing += pairs.filter(|(x, y)| x != y).count();
            }
            safetensors::Dtype::F32 if !a.shape().is_empty() => {
                let floats = |d: &[u8]| -> Vec<f32> {
                    d.chunks(4)
                        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                        .collect()
                };
                let (x, y) = (floats(a.data()), floats(b.data()));
                let top = y.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                for (i, (g, w)) in x.iter().zip(&y).enumerate() {
                    assert!(
                        (g - w).abs() <= 1e-5 * top,
                        "{name}[{i}]: {g} vs mlx-lm's {w}"
                    );
                }
            }
            _ => assert_eq!(a.data(), b.data(), "{name}"),
        }
    }
    assert!(
        words > 0 && differing * 100 <= words,
        "{differing} of {words} code words differ"
    );

    let mut restored = options(0).new_cache(loaded.model.as_ref()).unwrap();
    PromptCacheFile::load(&out)
        .unwrap()
        .restore(&mut restored)
        .unwrap();
    let mut original = options(0).new_cache(loaded.model.as_ref()).unwrap();
    PromptCacheFile::load(&fixture(stem))
        .unwrap()
        .restore(&mut original)
        .unwrap();
    let mine = continue_greedy(&loaded, &mut restored, &suffix, steps);
    let file = dir.path().join("again.safetensors");
    let metadata = BTreeMap::from([("model".to_string(), model_arg(name))]);
    prompt_cache_file::save(&file, &original, &metadata).unwrap();
    let mut again = options(0).new_cache(loaded.model.as_ref()).unwrap();
    PromptCacheFile::load(&file)
        .unwrap()
        .restore(&mut again)
        .unwrap();
    assert_eq!(
        continue_greedy(&loaded, &mut again, &suffix, steps),
        continue_greedy(&loaded, &mut original, &suffix, steps)
    );
    assert_eq!(mine.len(), steps);
}

/// The model of the `--max-kv-size` files: a model type mlx-lm bounds (its model makes no caches
/// of its own), so that every layer is a `RotatingKVCache(N, keep=4)`.
const BOUNDED: &str = "qwen3-8bit-g128";

/// mlx-lm's files of it with `cache_prompt --max-kv-size N`, for the golden's prompt of 44
/// tokens: a window shorter than the prompt (16: the ring holds the prompt's first 4 positions
/// and its last 12, wrapped past the kept slots) and one longer (48: the ring grown to the
/// window, all positions held).
const MAX_KV_SIZES: [(&str, usize); 2] = [
    ("qwen3-8bit-g128-max-kv16", 16),
    ("qwen3-8bit-g128-max-kv48", 48),
];

/// `--max-kv-size` caches both ways: (a) `oxlm cache-prompt --max-kv-size N` writes mlx-lm's
/// file (the classes, the ring's numbers: offset, keep, max_size, _idx; its slots as mlx-lm lays
/// them out, within f32's and f16's tolerances as for the other caches); (b) `oxlm generate
/// --prompt-cache-file` continues mlx-lm's file, and its own, with mlx-lm's greedy tokens, each
/// layer restored as a ring of N keeping the first 4; given `--max-kv-size` too, it uses the
/// file's rings as loaded, as mlx-lm does, and says so.
#[test]
fn max_kv_size_caches_go_both_ways() {
    let golden = golden();
    let steps = golden["steps"].as_u64().unwrap() as usize;
    let loaded = load(BOUNDED);
    let suffix = suffix_ids(&loaded, &golden);
    let dir = tempfile::tempdir().unwrap();
    for (stem, size) in MAX_KV_SIZES {
        let want = &golden["models"][stem];
        assert_eq!(want["max_kv_size"], json!(size), "{stem}");
        assert_eq!(suffix, ids(&want["suffix_ids"]), "{stem}: the suffix");
        let size_arg = size.to_string();
        for (precision, dtype, tolerance) in [("f32", "F32", 5e-5), ("f16", "F16", 5e-3)] {
            let out = dir.path().join(format!("{stem}-{precision}.safetensors"));
            let flags = ["--kv-cache", precision, "--max-kv-size", &size_arg];
            let output = cache_prompt(BOUNDED, &golden, &out, &flags);
            assert!(output.status.success(), "{stem}: {}", stderr(&output));
            let case = format!("{stem} {precision}");
            assert_same_file(&case, &out, &fixture(stem), dtype, tolerance);
        }

        let file = PromptCacheFile::load(&fixture(stem)).unwrap();
        assert_eq!(file.classes, ["RotatingKVCache", "RotatingKVCache"]);
        let mut cache = options(0).new_cache(loaded.model.as_ref()).unwrap();
        file.restore(&mut cache).unwrap();
        assert_eq!(cache.offset, want["cached_ids"].as_array().unwrap().len());
        for layer in &cache.layers {
            let LayerCache::Rotating(ring) = layer else {
                panic!("{stem}: a --max-kv-size file's layers are rings")
            };
            assert_eq!((ring.window(), ring.keep()), (size, 4), "{stem}");
        }
        let tokens = continue_greedy(&loaded, &mut cache, &suffix, steps);
        assert_eq!(tokens, ids(&want["greedy_ids"]), "{stem}");

        let text = loaded.tokenizer.decode(&tokens, false).unwrap();
        let text = text.strip_prefix(' ').unwrap_or(&text);
        let ours = dir.path().join(format!("{stem}-f32.safetensors"));
        let runs: [(&Path, &[&str]); 3] = [
            (&fixture(stem), &[]),
            (&ours, &[]),
            (&fixture(stem), &["--max-kv-size", "64"]),
        ];
        for (file, flags) in runs {
            let output = generate_after_with(file, &golden, steps, flags);
            let case = format!("{} {flags:?}", file.display());
            assert!(output.status.success(), "{case}: {}", stderr(&output));
            assert_eq!(generated(&output), text, "{case}");
            let note = "--max-kv-size is left unused: the prompt cache's layers are used as the \
                        file holds them";
            assert_eq!(stderr(&output).contains(note), !flags.is_empty(), "{case}");
        }
    }
}

/// (c) A `--max-kv-size` file whose ring does not add up is an error naming the layer, from the
/// library and from `oxlm generate` (before the report starts), never a panic: it keeps all its
/// positions or a window of none, an `_idx` past its slots or where no ring wraps, slots more
/// than max_size or too few for it, more positions held than seen, a negative offset, keys and
/// values of different lengths; a plain sliding window (keep 0) where the model keeps all
/// positions. And mlx-lm cannot quantize such a ring: `--kv-bits` with it is refused.
#[test]
fn inconsistent_max_kv_size_files_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let source = fixture(MAX_KV_SIZES[0].0);
    let bytes = std::fs::read(&source).unwrap();
    let tensors = SafeTensors::deserialize(&bytes).unwrap();
    let (_, header) = SafeTensors::read_metadata(&bytes).unwrap();
    // The file with arrays replaced: (name, new int32 scalar), or a layer's keys or values cut to
    // their first `n` slots.
    enum Edit {
        Scalar(&'static str, i32),
        Slots(&'static str, usize),
    }
    let edited = |name: &str, edits: &[Edit]| -> PathBuf {
        let mut owned: BTreeMap<String, (Vec<usize>, Vec<u8>)> = BTreeMap::new();
        for edit in edits {
            match edit {
                Edit::Scalar(entry, value) => {
                    owned.insert(entry.to_string(), (vec![], value.to_le_bytes().to_vec()));
                }
                Edit::Slots(entry, n) => {
                    let view = tensors.tensor(entry).unwrap();
                    let shape = view.shape().to_vec();
                    let (heads, slots, dim) = (shape[1], shape[2], shape[3]);
                    let row = dim * 4;
                    let data: Vec<u8> = (0..heads)
                        .flat_map(|h| view.data()[h * slots * row..(h * slots + n) * row].to_vec())
                        .collect();
                    owned.insert(entry.to_string(), (vec![1, heads, *n, dim], data));
                }
            }
        }
        let views = tensors.tensors().into_iter().map(|(name, view)| {
            let view = match owned.get(&name) {
                Some((shape, data)) => {
                    let dtype = match shape.is_empty() {
                        true => safetensors::Dtype::I32,
                        false => view.dtype(),
                    };
                    safetensors::tensor::TensorView::new(dtype, shape.clone(), data).unwrap()
                }
                None => view,
            };
            (name, view)
        });
        let path = dir.path().join(name);
        let metadata = header.metadata().clone();
        safetensors::serialize_to_file(views, metadata, &path).unwrap();
        path
    };
    let loaded = load(BOUNDED);
    let restore = |path: &Path| -> Result<(), PromptCacheFileError> {
        let mut cache = options(0).new_cache(loaded.model.as_ref()).unwrap();
        PromptCacheFile::load(path)?.restore(&mut cache)
    };
    use Edit::{Scalar, Slots};
    let cases: Vec<(Vec<Edit>, &str)> =
        vec![
        (
            vec![Scalar("0.3", 16)],
            "layer 0: a RotatingKVCache of max_size 16 that keeps its first 16 positions",
        ),
        (
            vec![Scalar("1.3", 40)],
            "layer 1: a RotatingKVCache of max_size 16 that keeps its first 40 positions",
        ),
        (
            vec![Scalar("0.4", 0)],
            "layer 0: a RotatingKVCache of max_size 0 that keeps its first 4 positions",
        ),
        (vec![Scalar("0.5", 17)], "layer 0: _idx 17 past its 16 slots"),
        (
            vec![Scalar("1.5", 2)],
            "layer 1: _idx 2 after 44 tokens in 16 slots, keep 4, max_size 16: no \
             RotatingKVCache wraps there",
        ),
        (
            vec![Scalar("0.4", 32)],
            "layer 0: _idx 5 after 44 tokens in 16 slots, keep 4, max_size 32: no \
             RotatingKVCache wraps there",
        ),
        (
            vec![Scalar("0.4", 8), Scalar("0.2", 5)],
            "layer 0: 16 slots, more than max_size 8, written up to _idx 5",
        ),
        (
            vec![Slots("1.0", 8), Slots("1.1", 8)],
            "layer 1: _idx 5 after 44 tokens in 8 slots, keep 4, max_size 16: no \
             RotatingKVCache wraps there",
        ),
        (
            vec![Slots("0.1", 8)],
            "layer 0: values of shape [1, 2, 8, 32] where this model's layer keeps [1, 2, _, 32]",
        ),
        (
            vec![Scalar("0.2", 3)],
            "layer 0: 5 positions held after 3 tokens in a window of 16",
        ),
        (
            vec![Scalar("0.2", -1)],
            "layer 0: state entry `2` is negative (-1)",
        ),
        (
            vec![Scalar("1.3", 0)],
            "layer 1: the prompt cache holds an mlx-lm RotatingKVCache where this model keeps a \
             KVCache",
        ),
    ];
    let mut first_bad = None;
    for (i, (edits, want)) in cases.into_iter().enumerate() {
        let path = edited(&format!("bad{i}.safetensors"), &edits);
        let err = restore(&path).unwrap_err().to_string();
        assert!(err.contains(want), "case {i}: {err}");
        first_bad.get_or_insert(path);
    }

    let second = golden()["second"].as_str().unwrap().to_owned();
    let generate = |file: &Path, flags: &[&str]| {
        let args = ["generate", "--prompt-cache-file", file.to_str().unwrap()];
        oxlm(&[&args[..], &["--prompt", &second], flags].concat())
    };
    let output = generate(&first_bad.unwrap(), &[]);
    assert_eq!(output.status.code(), Some(1), "{}", stderr(&output));
    assert!(output.stdout.is_empty());
    let err = stderr(&output);
    assert!(
        err.starts_with("error: ")
            && err.contains("layer 0: a RotatingKVCache of max_size 16 that keeps its first 16"),
        "{err}"
    );
    assert!(!err.contains("panicked"), "{err}");
    let output = generate(&source, &["--kv-bits", "8", "--kv-group-size", "32"]);
    assert_eq!(output.status.code(), Some(1), "{}", stderr(&output));
    assert!(output.stdout.is_empty());
    assert!(
        stderr(&output).contains(
            "--kv-bits cannot be used with a prompt cache made with --max-kv-size (mlx-lm cannot \
             quantize its RotatingKVCache layers)"
        ),
        "{}",
        stderr(&output)
    );
}

/// (c) For every tiny model: oxlm's file, read back, continues as the cache it was saved from
/// (the same greedy tokens, in f32 and in f16), and for `qwen3_5` (whose mlx-lm file is not
/// kept) with mlx-lm's tokens.
#[test]
fn own_files_round_trip_on_every_model() {
    let golden = golden();
    let steps = 12;
    let dir = tempfile::tempdir().unwrap();
    let layouts = golden["layouts"].as_object().unwrap();
    assert!(layouts.len() > 40);
    for name in layouts.keys() {
        let loaded = load(name);
        for precision in [KvPrecision::F32, KvPrecision::F16] {
            let original = cache_after_prompt(&loaded, &golden);
            let original = original.with_kv_precision(precision).unwrap();
            let path = dir.path().join(format!("{name}.safetensors"));
            let metadata = BTreeMap::from([("model".to_string(), model_arg(name))]);
            prompt_cache_file::save(&path, &original, &metadata).unwrap();
            let mut restored = loaded.model.new_cache_in(precision).unwrap();
            PromptCacheFile::load(&path)
                .unwrap()
                .restore(&mut restored)
                .unwrap();
            assert_eq!(restored.offset, original.offset, "{name}");
            let suffix = suffix_ids(&loaded, &golden);
            let want = continue_greedy(&loaded, &mut original.clone(), &suffix, steps);
            let got = continue_greedy(&loaded, &mut restored, &suffix, steps);
            assert_eq!(got, want, "{name} {precision:?}");
        }
    }
    let want = &golden["models"]["qwen3_5-4bit-g64"];
    assert_eq!(want["file"], false);
    let loaded = load("qwen3_5-4bit-g64");
    let path = dir.path().join("qwen3_5.safetensors");
    let saved = cache_after_prompt(&loaded, &golden);
    prompt_cache_file::save(&path, &saved, &BTreeMap::new()).unwrap();
    let mut cache = options(0).new_cache(loaded.model.as_ref()).unwrap();
    PromptCacheFile::load(&path)
        .unwrap()
        .restore(&mut cache)
        .unwrap();
    let suffix = suffix_ids(&loaded, &golden);
    assert_eq!(suffix, ids(&want["suffix_ids"]));
    let steps = golden["steps"].as_u64().unwrap() as usize;
    let tokens = continue_greedy(&loaded, &mut cache, &suffix, steps);
    assert_eq!(tokens, ids(&want["greedy_ids"]));
}

/// Every tiny model's state but [`OTHER_CLASS`] has mlx-lm's classes, each array its type,
/// shape and norm (keys at mlx-lm's scale), and each number its value (offsets, a ring's window
/// and next slot), as `save_prompt_cache` writes them.
#[test]
fn every_model_has_mlx_lms_layout() {
    let golden = golden();
    let mut wrong = Vec::new();
    for (name, want) in golden["layouts"].as_object().unwrap() {
        let loaded = load(name);
        let states: Vec<LayerState> = cache_after_prompt(&loaded, &golden).mlx_state().unwrap();
        let want = want.as_array().unwrap();
        assert_eq!(states.len(), want.len(), "{name}: layers");
        for (i, (state, want)) in states.iter().zip(want).enumerate() {
            if OTHER_CLASS.contains(&(name.as_str(), i)) {
                assert_eq!(
                    (state.class.as_str(), &want["class"]),
                    ("RotatingKVCache", &json!("KVCache"))
                );
                continue;
            }
            if state.class != want["class"] {
                wrong.push(format!(
                    "{name} layer {i}: {} vs {}",
                    state.class, want["class"]
                ));
                continue;
            }
            let want = want["state"].as_object().unwrap();
            let got: Map<String, Value> = state
                .items
                .iter()
                .map(|(path, item)| {
                    let value = match item {
                        StateItem::Array(a) => {
                            let dtype = match a.dtype {
                                oxlm_engine::DType::F32 => "float32",
                                other => panic!("{name} layer {i} {path}: {other}"),
                            };
                            let values = a.to_f32().unwrap();
                            let norm = values.iter().map(|&v| (v as f64).powi(2)).sum::<f64>();
                            json!([dtype, a.shape, norm.sqrt()])
                        }
                        StateItem::Int(n) => json!(n.to_string()),
                        StateItem::None => json!("None"),
                    };
                    (path.clone(), value)
                })
                .collect();
            // The norms within 1e-4 (f32 arithmetic in another order), the rest exactly.
            let norm = |v: &Value| v.as_array().and_then(|a| a.get(2)).and_then(Value::as_f64);
            let same = got.len() == want.len()
                && got.iter().all(|(path, g)| {
                    want.get(path).is_some_and(|w| match (norm(g), norm(w)) {
                        (Some(a), Some(b)) => {
                            g.as_array().unwrap()[..2] == w.as_array().unwrap()[..2]
                                && (a - b).abs() <= 1e-4 * b.max(1.0)
                        }
                        _ => g == w,
                    })
                });
            if !same {
                wrong.push(format!("{name} layer {i}: {got:?} vs {want:?}"));
            }
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

/// (d) A file of another model, or not a prompt cache at all, is an error naming what is wrong;
/// nothing panics.
#[test]
fn mismatched_and_corrupt_files_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let restore_into = |model: &str, path: &Path| -> Result<(), PromptCacheFileError> {
        let loaded = load(model);
        let mut cache = loaded.model.new_cache().unwrap();
        PromptCacheFile::load(path)?.restore(&mut cache)
    };
    let message = |r: Result<(), PromptCacheFileError>| r.unwrap_err().to_string();
    // Another model's layers: as many, of other head shapes; fewer; other kinds.
    let llama = fixture("llama-4bit-g64");
    let (gemma, lfm2) = (fixture("gemma3-4bit-g64"), fixture("lfm2-4bit-g64"));
    let quantized = fixture("qwen3-8bit-g128-kv4-g32");
    let cases = [
        ("qwen3-8bit-g128", &llama, "layer 0: keys of shape [1, 2, 256, 16] where this model's layer keeps [1, 2, _, 32]"),
        ("gemma3-4bit-g64", &llama, "the prompt cache has 2 layer caches but this model keeps 4"),
        ("gemma3-vlm-8bit-g32", &gemma, "layer 1: the prompt cache holds an mlx-lm RotatingKVCache where this model keeps a KVCache"),
        ("qwen3_5-4bit-g64", &lfm2, "layer 0: recurrent state `0.0` of shape [1, 2, 64] where this model's layer keeps [1, 3, 192]"),
        ("lfm2-8bit-g32", &gemma, "layer 0: the prompt cache holds an mlx-lm RotatingKVCache where this model keeps a KVCache"),
        ("llama-4bit-g64", &quantized, "layer 0: unsupported quantization: a KV cache of 4 bits in groups of 32 needs head dims that are multiples of 32; this model's are 16"),
    ];
    for (model, file, want) in cases {
        let err = message(restore_into(model, file));
        assert!(err.contains(want), "{model}: {err}");
        assert!(err.contains("another model"), "{model}: {err}");
    }

    // Not a prompt cache: a model's weights (no cache classes), bytes cut short, noise.
    let weights = root().join("tests/fixtures/tiny/llama-4bit-g64/model.safetensors");
    let err = message(restore_into("llama-4bit-g64", &weights));
    assert!(
        err.contains("not an mlx-lm prompt cache: no cache classes"),
        "{err}"
    );
    let bytes = std::fs::read(&llama).unwrap();
    let cut = dir.path().join("cut.safetensors");
    std::fs::write(&cut, &bytes[..bytes.len() / 2]).unwrap();
    let err = message(restore_into("llama-4bit-g64", &cut));
    assert!(err.contains("not an mlx-lm prompt cache"), "{err}");
    let noise = dir.path().join("noise.safetensors");
    std::fs::write(&noise, b"\xff\xff\xff\xff\xff\xff\xff\x7fnot json").unwrap();
    let err = message(restore_into("llama-4bit-g64", &noise));
    assert!(err.contains("not an mlx-lm prompt cache"), "{err}");
    let missing = dir.path().join("missing.safetensors");
    let err = message(restore_into("llama-4bit-g64", &missing));
    assert!(err.contains("No such file"), "{err}");

    // Classes oxlm does not keep, and numbers that do not add up.
    let edited = |name: &str, edit: &dyn Fn(&mut BTreeMap<String, String>)| -> PathBuf {
        let bytes = std::fs::read(&llama).unwrap();
        let tensors = SafeTensors::deserialize(&bytes).unwrap();
        let (_, header) = SafeTensors::read_metadata(&bytes).unwrap();
        let mut metadata: BTreeMap<String, String> =
            header.metadata().clone().unwrap().into_iter().collect();
        edit(&mut metadata);
        let path = dir.path().join(name);
        let views = tensors.tensors();
        let metadata = metadata.into_iter().collect();
        safetensors::serialize_to_file(views, Some(metadata), &path).unwrap();
        path
    };
    let quantized = edited("q.safetensors", &|m| {
        _ = m.insert("1.1".into(), "QuantizedKVCache".into())
    });
    let err = message(restore_into("llama-4bit-g64", &quantized));
    assert!(
        err.contains("layer 1: unexpected state entry `0` in an mlx-lm QuantizedKVCache"),
        "{err}"
    );
    let unscalar = edited("s.safetensors", &|m| _ = m.remove("2.1.1"));
    let err = message(restore_into("llama-4bit-g64", &unscalar));
    assert!(err.contains("scalar entry 1 is incomplete"), "{err}");
    let as_array = edited("a.safetensors", &|m| {
        m.remove("2.1.0");
        m.remove("2.1.1");
    });
    let err = message(restore_into("llama-4bit-g64", &as_array));
    assert!(
        err.contains("layer 0: state entry `2` should be an integer"),
        "{err}"
    );
    // A ring of another window (as `--max-kv-size` makes), and one past its own slots.
    let bytes = std::fs::read(&gemma).unwrap();
    let tensors = SafeTensors::deserialize(&bytes).unwrap();
    let (_, header) = SafeTensors::read_metadata(&bytes).unwrap();
    for (entry, value, want) in [
        (
            "0.4",
            16i32,
            "layer 0: a sliding window of 16 where this model's is 8",
        ),
        ("0.5", 9, "layer 0: _idx 9 past its 8 slots"),
    ] {
        let data = value.to_le_bytes();
        let views = tensors.tensors().into_iter().map(|(name, view)| {
            let view = match name == entry {
                true => safetensors::tensor::TensorView::new(view.dtype(), vec![], &data).unwrap(),
                false => view,
            };
            (name, view)
        });
        let path = dir.path().join("ring.safetensors");
        let metadata = header.metadata().clone();
        safetensors::serialize_to_file(views, metadata, &path).unwrap();
        let err = message(restore_into("gemma3-4bit-g64", &path));
        assert!(err.contains(want), "{err}");
    }

    // Through the command line: the model the file names must be the one given; a file whose
    // layers do not fit the model named is an error, not a panic.
    let golden = golden();
    let second = golden["second"].as_str().unwrap();
    let other = model_arg("qwen2-4bit-g64");
    let output = oxlm(&[
        "generate",
        "--model",
        &other,
        "--prompt-cache-file",
        llama.to_str().unwrap(),
        "--prompt",
        second,
    ]);
    assert_eq!(output.status.code(), Some(1), "{}", stderr(&output));
    assert!(stderr(&output).contains("Providing a different model (tests/fixtures/tiny/qwen2-4bit-g64) than that used to create the prompt cache (tests/fixtures/tiny/llama-4bit-g64) is an error."), "{}", stderr(&output));
    let renamed = edited("renamed.safetensors", &|m| {
        _ = m.insert("0.model".into(), model_arg("qwen3-8bit-g128"))
    });
    let output = oxlm(&[
        "generate",
        "--prompt-cache-file",
        renamed.to_str().unwrap(),
        "--prompt",
        second,
    ]);
    assert_eq!(output.status.code(), Some(1), "{}", stderr(&output));
    // Refused before the report starts.
    assert!(output.stdout.is_empty());
    let err = stderr(&output);
    assert!(
        err.starts_with("error: ") && err.contains("is the prompt cache from another model?"),
        "{err}"
    );
    assert!(!err.contains("panicked"), "{err}");
    let output = oxlm(&[
        "generate",
        "--model",
        &model_arg("llama-4bit-g64"),
        "--prompt-cache-file",
        cut.to_str().unwrap(),
        "--prompt",
        second,
    ]);
    assert_eq!(output.status.code(), Some(1), "{}", stderr(&output));
    assert!(
        stderr(&output).contains("not an mlx-lm prompt cache"),
        "{}",
        stderr(&output)
    );
}

/// What `oxlm cache-prompt` cannot do is refused before anything is written: `--kv-bits` for
/// heads its groups do not divide, `--max-kv-size` of no more than the 4 positions it keeps or
/// with `--kv-bits` (mlx-lm cannot quantize its ring); a prompt short of `--quantized-kv-start`
/// is written as a plain cache, as mlx-lm writes it, and `--max-kv-size` on a model type whose
/// mlx-lm model makes its own caches (llama) is left unused with a note, as mlx-lm leaves it.
#[test]
fn unsupported_options_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("cache.safetensors");
    let run = |extra: &[&str]| {
        let mut args = vec![
            "cache-prompt",
            "--model",
            "tests/fixtures/tiny/llama-4bit-g64",
            "--prompt",
            "Tell me about the sea.",
            "--prompt-cache-file",
            out.to_str().unwrap(),
        ];
        args.extend_from_slice(extra);
        oxlm(&args)
    };
    let output = run(&["--max-kv-size", "4"]);
    assert_eq!(output.status.code(), Some(2), "{}", stderr(&output));
    assert!(stderr(&output).contains("`4`"), "{}", stderr(&output));
    let output = run(&["--max-kv-size", "64", "--kv-bits", "8"]);
    assert_eq!(output.status.code(), Some(2), "{}", stderr(&output));
    assert!(
        stderr(&output).contains("cannot be used with"),
        "{}",
        stderr(&output)
    );
    // This model's heads of 16 take no groups of 64.
    let output = run(&["--kv-bits", "8", "--quantized-kv-start", "4"]);
    assert_eq!(output.status.code(), Some(1));
    assert!(
        stderr(&output).contains("needs head dims that are multiples of 64"),
        "{}",
        stderr(&output)
    );
    assert!(!out.exists());
    let output = run(&["--kv-bits", "8"]);
    assert!(output.status.success(), "{}", stderr(&output));
    let file = PromptCacheFile::load(&out).unwrap();
    assert_eq!(file.classes, ["KVCache", "KVCache"]);
    assert_eq!(
        file.tokenizer_config().unwrap(),
        json!({"trust_remote_code": false})
            .as_object()
            .unwrap()
            .clone()
    );
    std::fs::remove_file(&out).unwrap();
    let output = run(&["--max-kv-size", "8"]);
    assert!(output.status.success(), "{}", stderr(&output));
    assert!(
        stderr(&output).contains("--max-kv-size is left unused for `llama`"),
        "{}",
        stderr(&output)
    );
    let file = PromptCacheFile::load(&out).unwrap();
    assert_eq!(file.classes, ["KVCache", "KVCache"]);
    // Llama 4's chunked caches have no mlx-lm file form.
    let chunked = dir.path().join("llama4.safetensors");
    let output = oxlm(&[
        "cache-prompt",
        "--model",
        "tests/fixtures/tiny/llama4-4bit-g32",
        "--prompt",
        "Tell me about the sea.",
        "--prompt-cache-file",
        chunked.to_str().unwrap(),
    ]);
    assert_eq!(output.status.code(), Some(1));
    assert!(
        stderr(&output).contains("layer 0: mlx-lm's ChunkedKVCache is not supported"),
        "{}",
        stderr(&output)
    );
    assert!(!chunked.exists());
}
