//! The continuous batcher on tiny models, with every job queued before it runs, so that what it
//! does is the same on every run: which jobs share a step, how prompts are cut between steps,
//! what the prompt cache gives, and that each job gets what it gets served alone.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use oxlm_engine::{KvPrecision, Tensor};
use oxlm_models::lora::Adaptable;
use oxlm_models::{Cache, ForwardError, LanguageModel, Logits, ModelInfo};
use oxlm_runtime::adapter_store::Adapter;
use oxlm_runtime::batcher::{
    Batcher, BatcherSettings, BatcherSnapshot, BatcherStats, Job, JobError, Requester, Update,
};
use oxlm_runtime::constraint::{Grammar, Grammars, TokenConstraint};
use oxlm_runtime::reasoning_budget::ReasoningBudget;
use oxlm_runtime::sampler::SamplerConfig;
use oxlm_runtime::tokenizer::Tokenizer;
use oxlm_runtime::{FinishReason, GenerateOptions, RuntimeError, StreamOptions};

/// A forward pass as the batcher asked for it.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Call {
    /// `forward` of this many prompt tokens of one sequence.
    Prompt(usize),
    /// `forward` of one greedy sequence's next token.
    Step,
    /// `forward_batch` of this many sequences.
    Batch(usize),
}

/// A model that records the calls made of it, with what the batcher serving it reported at
/// each, and queues `late`'s job during its next forward pass, as a request arrives while a
/// prompt goes through. Prompt tokens take `token_time` each at least, as a larger model's do.
struct Recording {
    inner: Box<dyn LanguageModel>,
    token_time: Duration,
    calls: Mutex<Vec<(Call, BatcherSnapshot)>>,
    late: Mutex<Option<(mpsc::Sender<Job>, Job)>>,
    /// What the batchers serving this model report.
    stats: Arc<BatcherStats>,
}

impl Recording {
    fn calls(&self) -> Vec<Call> {
        self.calls_with_stats()
            .into_iter()
            .map(|(c, _)| c)
            .collect()
    }

    fn calls_with_stats(&self) -> Vec<(Call, BatcherSnapshot)> {
        std::mem::take(&mut self.calls.lock().unwrap())
    }

    fn record(&self, call: Call) {
        let stats = self.stats.snapshot();
        self.calls.lock().unwrap().push((call, stats));
    }
}

impl LanguageModel for Recording {
    fn info(&self) -> &ModelInfo {
        self.inner.info()
    }

    fn new_cache(&self) -> Result<Cache, ForwardError> {
        self.inner.new_cache()
    }

    fn new_cache_in(&self, precision: KvPrecision) -> Result<Cache, ForwardError> {
        self.inner.new_cache_in(precision)
    }

    fn forward(
        &self,
        tokens: &[u32],
        cache: &mut Cache,
        logits: Logits,
    ) -> Result<Tensor, ForwardError> {
        if let Some((jobs, job)) = self.late.lock().unwrap().take() {
            jobs.send(job).unwrap();
        }
        self.record(match logits {
            Logits::LastOnDevice => Call::Step,
            _ => {
                std::thread::sleep(self.token_time * tokens.len() as u32);
                Call::Prompt(tokens.len())
            }
        });
        self.inner.forward(tokens, cache, logits)
    }

    fn forward_batch(
        &self,
        tokens: &[u32],
        caches: &mut [&mut Cache],
    ) -> Result<Tensor, ForwardError> {
        self.record(Call::Batch(tokens.len()));
        self.inner.forward_batch(tokens, caches)
    }

    fn adaptable(&self) -> Option<&dyn Adaptable> {
        self.inner.adaptable()
    }
}

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

/// The tiny model `name`, recording its calls, and its tokenizer.
fn load(name: &str) -> (Tokenizer, Recording) {
    let dir = fixtures().join("tiny").join(name);
    let model = Recording {
        inner: oxlm_models::load(&dir).unwrap(),
        token_time: Duration::ZERO,
        calls: Mutex::new(Vec::new()),
        late: Mutex::new(None),
        stats: Arc::default(),
    };
    (Tokenizer::from_dir(&dir).unwrap(), model)
}

/// What a job was told, in order.
#[derive(Clone, Default)]
struct Log(Arc<Mutex<Vec<Update>>>);

/// A requester that logs every update, and gives the job up after `cancel_after` tokens.
struct Logging {
    log: Log,
    cancel_after: Option<usize>,
    tokens: AtomicUsize,
}

impl Requester for Logging {
    fn deliver(&self, update: Update) -> bool {
        if matches!(update, Update::Token { .. }) {
            self.tokens.fetch_add(1, Ordering::Relaxed);
        }
        self.log.0.lock().unwrap().push(update);
        true
    }

    fn cancelled(&self) -> bool {
        self.cancel_after
            .is_some_and(|n| self.tokens.load(Ordering::Relaxed) >= n)
    }
}

/// What a job asks for.
#[derive(Clone)]
struct Ask {
    prompt: String,
    max_tokens: usize,
    sampler: SamplerConfig,
    top_logprobs: usize,
    adapters: Vec<Arc<Adapter>>,
    prefill_step: usize,
    cancel_after: Option<usize>,
    deadline: Option<Instant>,
    /// Bytes charged against the run's memory budget.
    memory: usize,
    constraint: Option<TokenConstraint>,
    reasoning_budget: Option<ReasoningBudget>,
}

fn ask(prompt: &str, max_tokens: usize) -> Ask {
    Ask {
        prompt: prompt.into(),
        max_tokens,
        sampler: SamplerConfig::default(),
        top_logprobs: 0,
        adapters: Vec::new(),
        prefill_step: 2048,
        cancel_after: None,
        deadline: None,
        memory: 0,
        constraint: None,
        reasoning_budget: None,
    }
}

/// What a job ended with: its tokens, its text, its log-probabilities and how it ended.
#[derive(Debug, PartialEq)]
struct Served {
    cached_tokens: Option<usize>,
    tokens: Vec<u32>,
    text: String,
    logprobs: Vec<(f32, Vec<(u32, f32)>)>,
    end: Result<FinishReason, String>,
}

fn served(log: &Log) -> Served {
    let mut s = Served {
        cached_tokens: None,
        tokens: Vec::new(),
        text: String::new(),
        logprobs: Vec::new(),
        end: Err("no Done".into()),
    };
    for update in log.0.lock().unwrap().iter() {
        match update {
            Update::Started { cached_tokens } => s.cached_tokens = Some(*cached_tokens),
            Update::Prefill { .. } => {}
            Update::Token {
                id,
                logprob,
                top,
                text,
            } => {
                s.tokens.push(*id);
                s.logprobs.push((*logprob, top.clone()));
                s.text.push_str(text);
            }
            Update::Text(text) => s.text.push_str(text),
            Update::Done(end) => s.end = end.as_ref().copied().map_err(|e| e.to_string()),
        }
    }
    s
}

struct Run {
    capacity: usize,
    cache_entries: usize,
    shutdown: bool,
    prefill_pause: Option<Duration>,
    memory_budget: Option<usize>,
}

const TOGETHER: Run = Run {
    capacity: 32,
    cache_entries: 0,
    shutdown: false,
    prefill_pause: None,
    memory_budget: None,
};

const ALONE: Run = Run {
    capacity: 1,
    ..TOGETHER
};

/// The job `a` asks for, and the log of what it is told.
fn job(tokenizer: &Tokenizer, a: &Ask) -> (Job, Log) {
    let log = Log::default();
    let job = Job {
        prompt: tokenizer.encode(&a.prompt, false).unwrap(),
        adapters: a.adapters.clone(),
        options: GenerateOptions {
            max_tokens: a.max_tokens,
            sampler: a.sampler.clone(),
            prefill_step: a.prefill_step,
            kv_cache: None,
            kv_quantization: None,
            max_kv_size: None,
        },
        stream: StreamOptions {
            stop: Vec::new(),
            top_logprobs: a.top_logprobs,
            constraint: a.constraint.clone(),
            continues_text: false,
            reasoning_budget: a.reasoning_budget.clone(),
        },
        requester: Box::new(Logging {
            log: log.clone(),
            cancel_after: a.cancel_after,
            tokens: AtomicUsize::new(0),
        }),
        deadline: a.deadline,
        memory: a.memory,
    };
    (job, log)
}

/// Queues a job for each of `asks`, then runs the batcher over them until all are served.
fn serve(tokenizer: &Tokenizer, model: &Recording, asks: &[Ask], run: Run) -> Vec<Log> {
    serve_counting_steps(tokenizer, model, asks, run).0
}

/// [`serve`], and the number of decoding steps the batcher took.
fn serve_counting_steps(
    tokenizer: &Tokenizer,
    model: &Recording,
    asks: &[Ask],
    run: Run,
) -> (Vec<Log>, u64) {
    let (jobs, queue) = mpsc::channel();
    let mut logs = Vec::new();
    for a in asks {
        let (job, log) = job(tokenizer, a);
        jobs.send(job).unwrap();
        logs.push(log);
    }
    drop(jobs);
    let steps = run_batcher(tokenizer, model, &queue, run);
    (logs, steps)
}

/// Runs a batcher over `queue` until it is closed and empty; returns its decoding steps.
fn run_batcher(
    tokenizer: &Tokenizer,
    model: &Recording,
    queue: &mpsc::Receiver<Job>,
    run: Run,
) -> u64 {
    let settings = BatcherSettings {
        capacity: run.capacity,
        cache_entries: run.cache_entries,
        cache_bytes: usize::MAX,
        shutdown: Arc::new(AtomicBool::new(run.shutdown)),
        stats: model.stats.clone(),
        prefill_pause: run.prefill_pause,
        memory_budget: run.memory_budget,
    };
    // No end-of-sequence ids: every job runs for as many tokens as it asks.
    let eos_ids = HashSet::new();
    let mut batcher = Batcher::new(model, Some(tokenizer), &eos_ids, settings);
    batcher.run(queue);
    batcher.step_totals().steps
}

/// Four jobs of different lengths and samplers: greedy ones, a seeded sampled one and one with
/// top logprobs (whose steps need the logits on the host).
fn four() -> Vec<Ask> {
    let sampled = SamplerConfig {
        temperature: 0.7,
        seed: Some(3),
        ..SamplerConfig::default()
    };
    vec![
        ask("The history of the city begins", 24),
        ask("Once upon a time", 10),
        Ask {
            sampler: sampled,
            ..ask("The capital of", 16)
        },
        Ask {
            top_logprobs: 2,
            ..ask("Numbers: one, two,", 6)
        },
    ]
}

fn batches(calls: &[Call]) -> Vec<usize> {
    calls
        .iter()
        .filter_map(|c| match c {
            Call::Batch(n) => Some(*n),
            _ => None,
        })
        .collect()
}

/// Every architecture's batched steps (attention, recurrent state, sliding-window rings,
/// experts, per-layer inputs) give each job what it gets alone, up to the capacity.
#[test]
fn jobs_queued_together_decode_together_as_they_decode_alone() {
    for name in [
        "llama-4bit-g64",
        "qwen3_5-4bit-g64",
        "qwen3_5_moe-4bit-g64",
        "gemma3-4bit-g64",
        "gemma4-4bit-g32",
    ] {
        let (tokenizer, model) = load(name);
        let alone: Vec<Served> = serve(&tokenizer, &model, &four(), ALONE)
            .iter()
            .map(served)
            .collect();
        assert!(batches(&model.calls()).is_empty(), "{name}: one at a time");
        let lengths: Vec<usize> = alone.iter().map(|s| s.tokens.len()).collect();
        assert_eq!(lengths, [24, 10, 16, 6], "{name}");
        assert!(alone
            .iter()
            .all(|s| s.end == Ok(FinishReason::Length) && !s.text.is_empty()));

        let together: Vec<Served> = serve(&tokenizer, &model, &four(), TOGETHER)
            .iter()
            .map(served)
            .collect();
        assert_eq!(together, alone, "{name}");
        // All four prompts go through before the first step, then the batch shrinks as the
        // shorter jobs end.
        let calls = model.calls();
        assert!(calls[..4].iter().all(|c| matches!(c, Call::Prompt(_))));
        let sizes = batches(&calls);
        assert_eq!(sizes.iter().filter(|&&n| n == 4).count(), 5, "{name}");
        assert_eq!(sizes.iter().filter(|&&n| n == 3).count(), 4, "{name}");
        assert_eq!(sizes.iter().filter(|&&n| n == 2).count(), 6, "{name}");
        assert_eq!(calls.iter().filter(|&&c| c == Call::Step).count(), 8);

        let two = Run {
            capacity: 2,
            ..TOGETHER
        };
        let capped: Vec<Served> = serve(&tokenizer, &model, &four(), two)
            .iter()
            .map(served)
            .collect();
        assert_eq!(capped, alone, "{name}");
        assert_eq!(batches(&model.calls()).iter().max(), Some(&2), "{name}");
    }
}

/// Greedy jobs held to a grammar take their picks where the logits are, masked by the
/// grammar (alone through `Logits::LastOnDevice`, together in the batch's picks, beside a free
/// greedy job and a sampled one held to a grammar), and get what the host's masking gives: the
/// tokens and log-probabilities of the same jobs asking for top logprobs, whose steps bring the
/// logits to the host.
#[test]
fn greedy_jobs_held_to_a_grammar_pick_as_the_host_masks() {
    let (tokenizer, model) = load("llama-4bit-g64");
    let eos = tokenizer.eos_token_id().unwrap();
    let grammars = Grammars::new(&tokenizer, &[eos], model.info().vocab_size).unwrap();
    let held = |grammar: Grammar| Some(grammars.constraint(&grammar).unwrap());
    let schema = serde_json::json!({
        "type": "object",
        "properties": {
            "kind": {"enum": ["town", "city"]},
            "size": {"type": "integer", "minimum": 0, "maximum": 99},
        },
        "required": ["kind", "size"],
        "additionalProperties": false,
    });
    let asks = |top_logprobs: usize| {
        vec![
            Ask {
                constraint: held(Grammar::JsonSchema(schema.clone())),
                top_logprobs,
                ..ask("The history of the city begins", 40)
            },
            Ask {
                constraint: held(Grammar::Regex("(ab|cd|e)+ [0-9]{2,5}".into())),
                top_logprobs,
                ..ask("Once upon a time", 12)
            },
            Ask {
                top_logprobs,
                ..ask("The capital of", 16)
            },
            Ask {
                constraint: held(Grammar::Regex("[a-z]{3,8}".into())),
                sampler: SamplerConfig {
                    temperature: 0.9,
                    seed: Some(5),
                    ..SamplerConfig::default()
                },
                ..ask("Numbers: one, two,", 12)
            },
        ]
    };
    let on_host: Vec<Served> = serve(&tokenizer, &model, &asks(1), ALONE)
        .iter()
        .map(served)
        .collect();
    assert!(!model.calls().contains(&Call::Step));
    let city: serde_json::Value = serde_json::from_str(&on_host[0].text).unwrap();
    assert!(
        ["town", "city"].contains(&city["kind"].as_str().unwrap()),
        "{city}"
    );
    assert_eq!(on_host[0].end, Ok(FinishReason::Stop));
    for run in [ALONE, TOGETHER] {
        let alone = run.capacity == 1;
        let picked: Vec<Served> = serve(&tokenizer, &model, &asks(0), run)
            .iter()
            .map(served)
            .collect();
        let calls = model.calls();
        if alone {
            // The two held greedy jobs and the free one: a step per token after the first.
            let steps = calls.iter().filter(|&&c| c == Call::Step).count();
            let tokens: usize = picked[..3].iter().map(|s| s.tokens.len() - 1).sum();
            assert_eq!(steps, tokens);
        } else {
            assert!(batches(&calls).contains(&4));
        }
        for (i, (picked, host)) in picked.iter().zip(&on_host).enumerate() {
            assert_eq!(picked.tokens, host.tokens, "job {i}");
            assert_eq!(picked.text, host.text, "job {i}");
            assert_eq!(picked.end, host.end, "job {i}");
            for (p, h) in picked.logprobs.iter().zip(&host.logprobs) {
                assert!((p.0 - h.0).abs() < 1e-5, "job {i}: {} against {}", p.0, h.0);
            }
        }
    }
}

/// Reasoning budgets in a batch: each job's first tokens are what it picks unheld, then the
/// close marker's tokens in place of its picks, whether it goes alone or with others, greedy or
/// sampled, with a grammar (advanced by the forced tokens, not by the picks, beside other
/// grammars) or without.
#[test]
fn reasoning_budgets_close_the_reasoning_alone_and_together() {
    let (tokenizer, model) = load("llama-4bit-g64");
    let eos = tokenizer.eos_token_id().unwrap();
    let grammars = Grammars::new(&tokenizer, &[eos], model.info().vocab_size).unwrap();
    let any_text = || {
        Some(
            grammars
                .constraint(&Grammar::Regex("(.|\n)*".into()))
                .unwrap(),
        )
    };
    // A marker of several tokens in this vocabulary.
    let close = tokenizer.encode("</think>", false).unwrap();
    assert!(close.len() > 1);
    let budget = |tokens| Some(ReasoningBudget::new(vec![eos], close.clone(), tokens, true));
    let sampled = SamplerConfig {
        temperature: 0.8,
        seed: Some(9),
        ..SamplerConfig::default()
    };
    // With a sampled job, the batch's steps give logits; without, greedy picks, which the
    // grammars advance by side by side.
    for sampling in [false, true] {
        let asks = |held: bool| {
            let budget = |tokens| if held { budget(tokens) } else { None };
            vec![
                Ask {
                    constraint: any_text(),
                    reasoning_budget: budget(3),
                    ..ask("The history of the city begins", 16)
                },
                Ask {
                    constraint: any_text(),
                    reasoning_budget: budget(5),
                    ..ask("Once upon a time", 16)
                },
                Ask {
                    constraint: any_text(),
                    ..ask("The capital of", 16)
                },
                Ask {
                    reasoning_budget: budget(2),
                    sampler: if sampling {
                        sampled.clone()
                    } else {
                        SamplerConfig::default()
                    },
                    ..ask("Numbers: one, two,", 16)
                },
            ]
        };
        let free: Vec<Served> = serve(&tokenizer, &model, &asks(false), ALONE)
            .iter()
            .map(served)
            .collect();
        for run in [ALONE, TOGETHER] {
            let together = run.capacity > 1;
            let held: Vec<Served> = serve(&tokenizer, &model, &asks(true), run)
                .iter()
                .map(served)
                .collect();
            if together {
                assert!(batches(&model.calls()).contains(&4));
            }
            let spent = [3, 5, 16, 2];
            for (i, (held, free)) in held.iter().zip(&free).enumerate() {
                let (at, case) = (spent[i], (i, sampling, together));
                assert_eq!(held.end, Ok(FinishReason::Length), "{case:?}");
                assert_eq!(held.tokens[..at], free.tokens[..at], "{case:?}");
                if at < 16 {
                    assert_eq!(held.tokens[at..at + close.len()], close[..], "{case:?}");
                } else {
                    assert_eq!(held.tokens, free.tokens, "{case:?}");
                }
            }
        }
    }
}

/// A budget whose close marker the grammar refuses ends the job with the grammar's error, picked
/// or sampled, rather than a token outside it.
#[test]
fn a_forced_token_the_grammar_refuses_is_an_error() {
    let (tokenizer, model) = load("llama-4bit-g64");
    let eos = tokenizer.eos_token_id().unwrap();
    let grammars = Grammars::new(&tokenizer, &[eos], model.info().vocab_size).unwrap();
    let close = tokenizer.encode("</think>", false).unwrap();
    for top_logprobs in [0, 1] {
        let asks = [Ask {
            constraint: Some(
                grammars
                    .constraint(&Grammar::Regex("[a-z ]*".into()))
                    .unwrap(),
            ),
            reasoning_budget: Some(ReasoningBudget::new(vec![eos], close.clone(), 2, true)),
            top_logprobs,
            ..ask("The history of the city begins", 8)
        }];
        let held = served(&serve(&tokenizer, &model, &asks, ALONE)[0]);
        assert_eq!(held.tokens.len(), 2, "{held:?}");
        let error = held.end.unwrap_err();
        assert!(error.contains("constrained decoding failed"), "{error}");
    }
}

/// The tiny llama's fixture adapter, its `lora_parameters.scale` replaced by `scale` where
/// given (another adapter of the same shape), loaded from a copy in `dir`.
fn llama_adapter(model: &Recording, dir: &Path, scale: Option<f64>) -> Arc<Adapter> {
    let fixture = fixtures().join("lora/llama-4bit-g64-r4");
    for file in ["adapter_config.json", "adapters.safetensors"] {
        std::fs::copy(fixture.join(file), dir.join(file)).unwrap();
    }
    if let Some(scale) = scale {
        let path = dir.join("adapter_config.json");
        let mut config: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        config["lora_parameters"]["scale"] = scale.into();
        std::fs::write(&path, config.to_string()).unwrap();
    }
    Arc::new(Adapter::load(dir, model).unwrap())
}

/// Jobs through different adapters, none, and a stack of two decode in one batch, each
/// sequence's row through its own: each is served what it is served alone, in as many steps
/// as the longest of them takes.
#[test]
fn jobs_of_different_adapters_decode_together() {
    let (tokenizer, model) = load("llama-4bit-g64");
    let dirs = [tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap()];
    let sea = llama_adapter(&model, dirs[0].path(), None);
    let other = llama_adapter(&model, dirs[1].path(), Some(-30.0));
    let prompt = "The history of the city begins";
    let through = |adapters: &[&Arc<Adapter>], max_tokens| Ask {
        adapters: adapters.iter().map(|a| Arc::clone(a)).collect(),
        ..ask(prompt, max_tokens)
    };
    let asks = [
        through(&[], 12),
        through(&[&sea], 12),
        through(&[&other], 12),
        through(&[&sea, &other], 12),
        Ask {
            adapters: vec![sea.clone()],
            ..ask("Once upon a time", 8)
        },
    ];
    let (alone, alone_steps) = serve_counting_steps(&tokenizer, &model, &asks, ALONE);
    let alone: Vec<Served> = alone.iter().map(served).collect();
    let (together, together_steps) = serve_counting_steps(&tokenizer, &model, &asks, TOGETHER);
    let together: Vec<Served> = together.iter().map(served).collect();
    // The same tokens; a batch of five multiplies its rows in another order than one row
    // alone, so the log-probabilities differ in their last bits.
    for (i, (together, alone)) in together.iter().zip(&alone).enumerate() {
        assert_eq!(together.tokens, alone.tokens, "job {i}");
        assert_eq!(together.end, alone.end, "job {i}");
        for (t, a) in together.logprobs.iter().zip(&alone.logprobs) {
            assert!((t.0 - a.0).abs() < 1e-4, "job {i}: {} against {}", t.0, a.0);
        }
    }
    // Each adapter, and the stack, changed what the prompt gives.
    for i in 0..4 {
        for j in i + 1..4 {
            assert_ne!(together[i].tokens, together[j].tokens, "jobs {i} and {j}");
        }
    }
    assert_eq!(alone_steps, 4 * 11 + 7);
    assert_eq!(together_steps, 11);
}

/// A job whose adapters adapt a mixture's experts (which a layer regroups by expert) waits
/// until a batch of other adapters has drained, and the batch takes no more meanwhile: the
/// jobs after it wait their turn too.
#[test]
fn adapters_of_experts_wait_for_a_batch_of_others() {
    let (tokenizer, model) = load("qwen3_5_moe-4bit-g64");
    let lora = fixtures().join("lora/qwen3_5_moe-4bit-g64-r4");
    let experts = Arc::new(Adapter::load(&lora, &model).unwrap());
    assert!(!experts.adapters.experts.is_empty());
    let prompt = "The history of the city begins";
    let asks = [
        ask(prompt, 6),
        ask(prompt, 4),
        Ask {
            adapters: vec![experts.clone()],
            ..ask(prompt, 4)
        },
        ask("Once upon a time", 3),
    ];
    let alone: Vec<Served> = serve(&tokenizer, &model, &asks, ALONE)
        .iter()
        .map(served)
        .collect();
    let (together, steps) = serve_counting_steps(&tokenizer, &model, &asks, TOGETHER);
    let together: Vec<Served> = together.iter().map(served).collect();
    assert_eq!(together, alone);
    assert_ne!(together[2].tokens, together[1].tokens);
    // The first two together (5 steps), then the adapted job alone (3), then the last (2).
    assert_eq!(steps, 5 + 3 + 2);
}

/// A long prompt goes through a prefill step at a time between decoding steps, so that the
/// jobs decoding meanwhile go on.
#[test]
fn a_long_prompt_goes_through_between_steps() {
    const STEP: usize = 16;
    let (tokenizer, model) = load("llama-4bit-g64");
    let long = "one two three four five six seven eight nine ten ".repeat(6);
    let asks = [
        Ask {
            prefill_step: STEP,
            ..ask("Once upon a time", 40)
        },
        Ask {
            prefill_step: STEP,
            ..ask(&long, 4)
        },
    ];
    let together: Vec<Served> = serve(&tokenizer, &model, &asks, TOGETHER)
        .iter()
        .map(served)
        .collect();
    let calls = model.calls();
    let alone: Vec<Served> = serve(&tokenizer, &model, &asks, ALONE)
        .iter()
        .map(served)
        .collect();
    // The same tokens: the prompt is cut elsewhere, so its log-probabilities differ in their
    // last bits.
    let tokens = |s: &[Served]| s.iter().map(|s| s.tokens.clone()).collect::<Vec<_>>();
    assert_eq!(tokens(&together), tokens(&alone));
    let first = tokenizer.encode(&asks[0].prompt, false).unwrap().len();
    let second = tokenizer.encode(&long, false).unwrap().len();
    assert!(first < STEP && second > 40, "{first} {second}");
    // The first prompt and the first chunk of the second share the first prefill step; then
    // each chunk of a step is followed by a step of the first alone, until both decode together.
    let mut expected = vec![Call::Prompt(first), Call::Prompt(STEP - first), Call::Step];
    let mut left = second - (STEP - first);
    while left > 0 {
        expected.push(Call::Prompt(left.min(STEP)));
        left -= left.min(STEP);
        expected.push(if left > 0 { Call::Step } else { Call::Batch(2) });
    }
    assert_eq!(calls[..expected.len()], expected[..], "{calls:?}");
}

/// A prompt seen before starts from the state kept for it: after the whole prompt for
/// attention caches, and for recurrent and sliding-window caches, which cannot be cut back,
/// from the snapshot kept of the prompt without its last token.
#[test]
fn a_prompt_seen_before_starts_from_the_prompt_cache() {
    for name in ["llama-4bit-g64", "qwen3_5-4bit-g64", "gemma3-4bit-g64"] {
        let (tokenizer, model) = load(name);
        let prompt = "The history of the city begins";
        let n = tokenizer.encode(prompt, false).unwrap().len();
        let asks = [ask(prompt, 6), ask(prompt, 6)];
        let cached = Run {
            cache_entries: 4,
            ..ALONE
        };
        let logs: Vec<Served> = serve(&tokenizer, &model, &asks, cached)
            .iter()
            .map(served)
            .collect();
        assert_eq!(logs[0].cached_tokens, Some(0), "{name}");
        assert_eq!(logs[1].cached_tokens, Some(n - 1), "{name}");
        assert_eq!(logs[1].tokens, logs[0].tokens, "{name}");
        let calls = model.calls();
        let prompts: Vec<&Call> = calls
            .iter()
            .filter(|c| matches!(c, Call::Prompt(_)))
            .collect();
        let first: &[Call] = if name == "llama-4bit-g64" {
            &[Call::Prompt(n)]
        } else {
            &[Call::Prompt(n - 1), Call::Prompt(1)]
        };
        let expected: Vec<&Call> = first.iter().chain(&[Call::Prompt(1)]).collect();
        assert_eq!(prompts, expected, "{name}");
    }
}

/// A job its requester gives up ends as cancelled while the others go on; an empty prompt ends
/// with an error of its own; at shutdown every job ends with the shutdown's error.
#[test]
fn jobs_end_alone_when_given_up_or_wrong() {
    let (tokenizer, model) = load("llama-4bit-g64");
    let asks = [
        ask("Once upon a time", 12),
        Ask {
            cancel_after: Some(3),
            ..ask("The capital of", 12)
        },
        ask("", 4),
    ];
    let logs: Vec<Served> = serve(&tokenizer, &model, &asks, TOGETHER)
        .iter()
        .map(served)
        .collect();
    assert_eq!(logs[0].end, Ok(FinishReason::Length));
    assert_eq!(logs[0].tokens.len(), 12);
    assert_eq!(logs[1].end, Ok(FinishReason::Cancelled));
    assert_eq!(logs[1].tokens.len(), 3);
    let empty = RuntimeError::from(ForwardError::EmptyInput).to_string();
    assert_eq!(logs[2].end, Err(empty));
    assert_eq!(logs[2].cached_tokens, None);

    // Past its deadline, a job ends before its prompt goes through the model; one with time
    // left is served.
    model.calls();
    let late = Ask {
        deadline: Some(Instant::now()),
        ..ask("Once upon a time", 12)
    };
    let on_time = Ask {
        deadline: Some(Instant::now() + Duration::from_secs(600)),
        ..ask("The capital of", 4)
    };
    let logs = serve(&tokenizer, &model, &[late, on_time.clone()], TOGETHER);
    let (late, on_time) = (served(&logs[0]), served(&logs[1]));
    assert_eq!(late.end, Err(JobError::DeadlineExceeded.to_string()));
    assert_eq!((late.cached_tokens, late.tokens.len()), (None, 0));
    assert_eq!(
        (on_time.end, on_time.tokens.len()),
        (Ok(FinishReason::Length), 4)
    );
    let n = tokenizer.encode("The capital of", false).unwrap().len();
    assert_eq!(model.calls()[0], Call::Prompt(n));

    model.calls();
    let shutdown = Run {
        shutdown: true,
        ..TOGETHER
    };
    let logs = serve(&tokenizer, &model, &asks[..2], shutdown);
    for log in &logs {
        let served = served(log);
        assert_eq!(served.end, Err(JobError::ShuttingDown.to_string()));
        assert!(served.tokens.is_empty());
    }
    assert!(model.calls().is_empty());
}

/// A job whose prompt is past the model's context (2048 tokens) ends with the overflow before
/// any of it goes through the model, not once prefill reaches the limit.
#[test]
fn a_prompt_past_the_context_ends_before_prefill() {
    let (tokenizer, model) = load("llama-8bit-g32");
    let long = ask(&"sea ".repeat(3000), 4);
    let needed = tokenizer.encode(&long.prompt, false).unwrap().len();
    assert!(needed > 2048);
    let logs = serve(&tokenizer, &model, &[long], TOGETHER);
    let served = served(&logs[0]);
    let overflow = ForwardError::ContextOverflow {
        needed,
        limit: 2048,
    };
    assert_eq!(served.end, Err(RuntimeError::from(overflow).to_string()));
    assert_eq!(served.cached_tokens, None);
    assert!(model.calls().is_empty());
}

/// A short prompt that arrives while a long one goes through a chunk at a time goes through
/// before the long one's next chunk, and starts decoding: it waits for one chunk, not for the
/// whole prompt.
#[test]
fn a_short_prompt_does_not_wait_for_a_long_one() {
    const STEP: usize = 16;
    let (tokenizer, model) = load("llama-4bit-g64");
    let long = Ask {
        prefill_step: STEP,
        ..ask(
            &"one two three four five six seven eight nine ten ".repeat(6),
            4,
        )
    };
    let short = Ask {
        prefill_step: STEP,
        ..ask("Once upon a time", 6)
    };
    let (jobs, queue) = mpsc::channel();
    let (first, _) = job(&tokenizer, &long);
    let (late, log) = job(&tokenizer, &short);
    jobs.send(first).unwrap();
    *model.late.lock().unwrap() = Some((jobs, late));
    run_batcher(&tokenizer, &model, &queue, TOGETHER);
    let n = tokenizer.encode(&short.prompt, false).unwrap().len();
    let calls = model.calls();
    // The long prompt's first chunk, the short prompt whole, the rest of that prefill step from
    // the long one, and the short one's first step.
    assert_eq!(
        calls[..4],
        [
            Call::Prompt(STEP),
            Call::Prompt(n),
            Call::Prompt(STEP - n),
            Call::Step
        ],
        "{calls:?}"
    );
    let got = served(&log);
    assert_eq!(got.tokens.len(), 6);
    let alone = serve(&tokenizer, &model, &[short], ALONE);
    assert_eq!(got.tokens, served(&alone[0]).tokens);
}

/// With a prefill pause, a long prompt goes through in chunks that take about that long at the
/// speed measured on the chunk before (here at most 0.5 ms a token, so at most 120 tokens in
/// 60 ms, and at least the batcher's 16 however slow a loaded machine makes them), from a first
/// chunk of 256 tokens, whatever the prefill step.
#[test]
fn a_prefill_pause_sizes_the_chunks_by_the_measured_speed() {
    let (tokenizer, mut model) = load("llama-8bit-g32");
    model.token_time = Duration::from_micros(500);
    let long = ask(
        &"one two three four five six seven eight nine ten ".repeat(60),
        2,
    );
    let n = tokenizer.encode(&long.prompt, false).unwrap().len();
    assert!(n > 400, "{n}");
    let run = Run {
        prefill_pause: Some(Duration::from_millis(60)),
        ..TOGETHER
    };
    let logs = serve(&tokenizer, &model, &[long], run);
    assert_eq!(served(&logs[0]).end, Ok(FinishReason::Length));
    let chunks: Vec<usize> = (model.calls().into_iter())
        .filter_map(|c| match c {
            Call::Prompt(n) => Some(n),
            _ => None,
        })
        .collect();
    assert_eq!(chunks[0], 256);
    assert!(chunks.len() > 2, "{chunks:?}");
    // The last chunk is what the others left, however little.
    let (last, middle) = chunks[1..].split_last().unwrap();
    assert!(
        middle.iter().all(|c| (16..=120).contains(c)) && *last <= 120,
        "{chunks:?}"
    );
    assert_eq!(chunks.iter().sum::<usize>(), n);
}

/// What the batcher reports between steps: the jobs in its batch and those waiting for a place,
/// the context their caches hold against what the batch can hold, and its prompt cache's
/// lookups and hits, in tokens.
#[test]
fn the_batcher_reports_its_queue_and_prompt_cache() {
    // A context of 2048 tokens.
    let (tokenizer, model) = load("llama-8bit-g32");
    let city = "The history of the city begins";
    let asks = [
        ask(city, 6),
        ask(city, 6),
        ask(city, 4),
        ask("Once upon a time", 4),
    ];
    let n = tokenizer.encode(city, false).unwrap().len();
    let m = tokenizer.encode(&asks[3].prompt, false).unwrap().len();
    let two = Run {
        capacity: 2,
        cache_entries: 4,
        ..TOGETHER
    };
    let logs: Vec<Served> = serve(&tokenizer, &model, &asks, two)
        .iter()
        .map(served)
        .collect();
    // The first two go through together, so neither finds the other's state; the third starts
    // from theirs.
    let cached: Vec<Option<usize>> = logs.iter().map(|s| s.cached_tokens).collect();
    assert_eq!(cached, [Some(0), Some(0), Some(n - 1), Some(0)]);
    let seen: Vec<(Call, usize, usize, usize)> = model
        .calls_with_stats()
        .into_iter()
        .map(|(call, s)| (call, s.running, s.waiting, s.kv_tokens))
        .collect();
    let mut expected = vec![(Call::Prompt(n), 2, 2, 0), (Call::Prompt(n), 2, 2, 0)];
    // Each step of the first two holds two more tokens of context than the one before.
    expected.extend((0..5).map(|k| (Call::Batch(2), 2, 2, 2 * (n + k))));
    // The third holds its cached prefix before its last prompt token goes through.
    expected.extend([
        (Call::Prompt(1), 2, 0, n - 1),
        (Call::Prompt(m), 2, 0, n - 1),
    ]);
    expected.extend((0..3).map(|k| (Call::Batch(2), 2, 0, n + m + 2 * k)));
    assert_eq!(seen, expected);
    let end = model.stats.snapshot();
    let kept = end.prompt_cache_bytes;
    assert!(kept > 0);
    let expected_end = BatcherSnapshot {
        running: 0,
        waiting: 0,
        kv_tokens: 0,
        kv_capacity_tokens: 2 * 2048,
        // The first two's state (one entry, as their tokens are the same), the third's (a
        // prefix of theirs, kept on its own) and the last one's.
        prompt_cache_entries: 3,
        prompt_cache_bytes: kept,
        prefix_cache_queries: (3 * n + m) as u64,
        prefix_cache_hits: (n - 1) as u64,
        memory_charged: 0,
        memory_budget: 0,
    };
    assert_eq!(end, expected_end);
    assert_eq!(end.kv_usage(), 0.0);
    let half = BatcherSnapshot {
        kv_tokens: 2048,
        ..expected_end
    };
    assert_eq!(half.kv_usage(), 0.5);
}

/// Under a memory budget, a job waits until the jobs running leave it room, in its turn (those
/// behind it wait too), and one that needs more than the whole budget ends at once with the
/// figures; the budget is never passed, and every job admitted gets what it gets alone.
#[test]
fn jobs_wait_for_memory_and_one_that_never_fits_is_refused() {
    let (tokenizer, model) = load("llama-4bit-g64");
    let alone: Vec<Served> = serve(&tokenizer, &model, &four(), ALONE)
        .iter()
        .map(served)
        .collect();
    model.calls();
    let charges = [40, 30, 50, 20];
    let mut asks: Vec<Ask> = four()
        .into_iter()
        .zip(charges)
        .map(|(a, memory)| Ask { memory, ..a })
        .collect();
    asks.insert(
        2,
        Ask {
            memory: 101,
            ..ask("Far too long", 8)
        },
    );
    let budget = Run {
        memory_budget: Some(100),
        cache_entries: 4,
        ..TOGETHER
    };
    let mut logs: Vec<Served> = serve(&tokenizer, &model, &asks, budget)
        .iter()
        .map(served)
        .collect();
    let refused = logs.remove(2);
    assert_eq!(refused.cached_tokens, None);
    assert_eq!(
        refused.end,
        Err(
            "This request needs 101 bytes of cache memory (its prompt and max_tokens) but the \
             server's memory budget for caches is 100 bytes"
                .into()
        )
    );
    // The prompt cache's entries differ (jobs that ran apart reuse each other's state).
    let tokens = |s: &[Served]| -> Vec<(Vec<u32>, String)> {
        s.iter()
            .map(|s| (s.tokens.clone(), s.text.clone()))
            .collect()
    };
    assert_eq!(tokens(&logs), tokens(&alone));
    let seen = model.calls_with_stats();
    assert!(seen.iter().all(|(_, s)| s.memory_charged <= 100));
    // 40 + 30 run together; 50 waits for the second to end (90), and 20 behind it, though it
    // fits, until the first ends too.
    let most = seen.iter().map(|(_, s)| s.memory_charged).max();
    assert_eq!(most, Some(90));
    assert!(seen.iter().all(|(_, s)| s.running <= 2));
    assert_eq!(model.stats.snapshot().memory_charged, 0);
}
