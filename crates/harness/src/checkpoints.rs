//! `checkpoints`: corrupted copies of a fixture model (weights cut short or bit-flipped,
//! safetensors headers made inconsistent, nonsense configs, broken tokenizers), each run through
//! `oxlm generate`. Passes when every run ends with a clean error (non-zero exit, a message,
//! no panic, no signal, no timeout), or succeeds with a well-formed report where the corruption
//! may be harmless (a flipped bit in the weights).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use rand::rngs::StdRng;
use rand::seq::IndexedRandom;
use rand::{Rng, SeedableRng};
use serde_json::{json, Map, Value};

use crate::process::{limit_memory, run_with_timeout, Finished};
use crate::report::Tally;
use crate::safetensors::{self, Safetensors};

#[derive(clap::Args)]
pub struct Args {
    /// The `oxlm` binary.
    #[arg(long)]
    oxlm_bin: PathBuf,
    /// The fixture model to corrupt: a tiny model directory of any architecture, with its
    /// tokenizer.
    #[arg(long)]
    model: PathBuf,
    /// Corrupted checkpoints to make and run.
    #[arg(long, default_value_t = 300)]
    count: u64,
    /// Seed of the corruptions: checkpoint N of a seed is the same on every run.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Make and run only checkpoint N, print its output in full and keep it in --keep.
    #[arg(long)]
    case: Option<u64>,
    /// Where --case leaves its corrupted checkpoint.
    #[arg(long, requires = "case")]
    keep: Option<PathBuf>,
    /// Seconds a run may take before it counts as a hang.
    #[arg(long, default_value_t = 60)]
    timeout: u64,
    /// Address space each run may take, in MiB: an absurd config must be refused, not allowed
    /// to take the machine.
    #[arg(long, default_value_t = 4096)]
    memory_limit_mib: u64,
}

/// What a corrupted checkpoint should do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Expect {
    /// Fail: running it would mean reading past, or misreading, what is there.
    Error,
    /// Fail cleanly or run: the corruption may be harmless.
    Either,
}

/// One corruption applied to a copy of the fixture.
struct Corruption {
    kind: &'static str,
    detail: String,
    expect: Expect,
    /// The prompt to run it with.
    prompt: String,
}

pub fn run(args: Args) -> Result<bool> {
    let fixture = Fixture::read(&args.model)?;
    let scratch = tempfile::tempdir()?;
    if let Some(index) = args.case {
        let dir = match &args.keep {
            Some(dir) => dir.clone(),
            None => scratch.path().join("case"),
        };
        return replay(&args, &fixture, index, &dir);
    }
    let started = Instant::now();
    let mut tally = Tally::default();
    for index in 0..args.count {
        let dir = scratch.path().join(index.to_string());
        let corruption = fixture.corrupt(&dir, &mut case_rng(args.seed, index))?;
        let finished = generate(&args, &dir, &corruption.prompt)?;
        let describe = |why: &str| {
            format!(
                "checkpoint {index} [{}] {}: {why} (reproduce: --seed {} --case {index} --keep DIR)",
                corruption.kind, corruption.detail, args.seed
            )
        };
        match judge(&corruption, &finished) {
            Ok(outcome) => tally.count(corruption.kind, outcome),
            Err((outcome, why)) => tally.fail(corruption.kind, outcome, describe(&why)),
        }
        std::fs::remove_dir_all(&dir).ok();
    }
    tally.print();
    let failures = tally.failures();
    println!(
        "checkpoints: {} corrupted checkpoints (seed {}) in {:.1} s: {} clean errors, {} ran \
         (harmless corruption); {} panics, {} aborts or signals, {} timeouts, {} silent errors, \
         {} accepted when they should fail; {}",
        args.count,
        args.seed,
        started.elapsed().as_secs_f64(),
        tally.total("clean-error"),
        tally.total("ran"),
        tally.total("panic"),
        tally.total("abort") + tally.total("signal"),
        tally.total("timeout"),
        tally.total("silent-error"),
        tally.total("accepted"),
        if failures == 0 { "PASS" } else { "FAIL" },
    );
    Ok(failures == 0)
}

fn case_rng(seed: u64, index: u64) -> StdRng {
    StdRng::seed_from_u64(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15).wrapping_add(index))
}

fn generate(args: &Args, dir: &Path, prompt: &str) -> Result<Finished> {
    let mut command = Command::new(&args.oxlm_bin);
    command
        .arg("generate")
        .arg("--model")
        .arg(dir)
        .args(["--prompt", prompt, "--max-tokens", "4", "--threads", "1"])
        .env("HF_HUB_OFFLINE", "1")
        .env("RUST_BACKTRACE", "0");
    limit_memory(&mut command, args.memory_limit_mib << 20);
    run_with_timeout(&mut command, Duration::from_secs(args.timeout))
}

/// `ran`, `clean-error`, or the failure and why.
fn judge(
    corruption: &Corruption,
    finished: &Finished,
) -> Result<&'static str, (&'static str, String)> {
    if let Some(crash) = finished.crash() {
        return Err(crash);
    }
    let status = finished.status.expect("a run that ended");
    if !status.success() {
        return Ok("clean-error");
    }
    if !is_generate_report(&finished.stdout) {
        return Err((
            "malformed",
            format!("exit 0 with stdout {:?}", finished.stdout),
        ));
    }
    match corruption.expect {
        Expect::Either => Ok("ran"),
        Expect::Error => Err((
            "accepted",
            "ran on a checkpoint it cannot have read correctly".into(),
        )),
    }
}

/// `oxlm generate`'s report: the text between `==========` lines, then its counts (or, as
/// mlx-lm says when the first token ends the sequence, that there is no text).
fn is_generate_report(stdout: &str) -> bool {
    stdout.starts_with("==========\n")
        && stdout.contains("\n==========\n")
        && (stdout.contains("Generation: ") || stdout.contains("No text generated for this prompt"))
}

fn replay(args: &Args, fixture: &Fixture, index: u64, dir: &Path) -> Result<bool> {
    if dir.exists() {
        bail!("{} exists: --keep wants a new directory", dir.display());
    }
    let corruption = fixture.corrupt(dir, &mut case_rng(args.seed, index))?;
    let finished = generate(args, dir, &corruption.prompt)?;
    println!(
        "checkpoint {index} [{}]: {}",
        corruption.kind, corruption.detail
    );
    println!(
        "command: ulimit -v {}; {} generate --model {} --prompt {:?} --max-tokens 4 --threads 1",
        args.memory_limit_mib << 10,
        args.oxlm_bin.display(),
        dir.display(),
        corruption.prompt
    );
    println!("exit: {:?} after {:?}", finished.status, finished.elapsed);
    println!("stdout:\n{}\nstderr:\n{}", finished.stdout, finished.stderr);
    let verdict = judge(&corruption, &finished);
    println!("verdict: {verdict:?}");
    Ok(verdict.is_ok())
}

const WEIGHTS: &str = "model.safetensors";
const INDEX: &str = "model.safetensors.index.json";
const CONFIG: &str = "config.json";
const TOKENIZER: &str = "tokenizer.json";
const TOKENIZER_CONFIG: &str = "tokenizer_config.json";

/// Corrupts the fixture's copy in a directory one way.
type Corrupt = fn(&Fixture, &Path, &mut StdRng) -> Result<Corruption>;

/// The fixture's files, and its weights taken apart.
struct Fixture {
    files: Vec<(String, Vec<u8>)>,
    config: Map<String, Value>,
    weights: Safetensors,
}

impl Fixture {
    fn read(dir: &Path) -> Result<Fixture> {
        let mut files = Vec::new();
        for entry in std::fs::read_dir(dir).with_context(|| dir.display().to_string())? {
            let entry = entry?;
            if entry.file_type()?.is_file() {
                let name = entry.file_name().to_string_lossy().into_owned();
                files.push((name, std::fs::read(entry.path())?));
            }
        }
        let file = |name: &str| -> Result<&[u8]> {
            files
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, bytes)| bytes.as_slice())
                .with_context(|| format!("the fixture has no {name}"))
        };
        let config = match serde_json::from_slice(file(CONFIG)?)? {
            Value::Object(map) => map,
            _ => bail!("the fixture's {CONFIG} is not an object"),
        };
        let weights = Safetensors::parse(file(WEIGHTS)?.to_vec())
            .with_context(|| format!("the fixture's {WEIGHTS}"))?;
        serde_json::from_slice::<Value>(file(TOKENIZER)?)
            .with_context(|| format!("the fixture's {TOKENIZER}"))?;
        Ok(Fixture {
            files,
            config,
            weights,
        })
    }

    /// Copies the fixture into `dir` and corrupts the copy.
    fn corrupt(&self, dir: &Path, rng: &mut StdRng) -> Result<Corruption> {
        std::fs::create_dir_all(dir)?;
        for (name, bytes) in &self.files {
            std::fs::write(dir.join(name), bytes)?;
        }
        let corruptions: [Corrupt; 24] = [
            truncated_data,
            truncated_header,
            weights_replaced,
            header_length,
            header_length_in_padding,
            header_bytes,
            header_not_an_object,
            tensor_dtype,
            tensor_shape,
            tensor_offsets,
            tensor_removed_or_renamed,
            metadata,
            data_bit_flips,
            header_bit_flips,
            appended_garbage,
            index_file,
            config_missing_key,
            config_wrong_type,
            config_absurd_value,
            config_model_type,
            config_file,
            tokenizer_file,
            tokenizer_token_beyond_vocab,
            tokenizer_config_file,
        ];
        let corrupt = corruptions.choose(rng).expect("not empty");
        corrupt(self, dir, rng)
    }

    /// The header's JSON, without padding.
    fn header_text(&self) -> Vec<u8> {
        self.weights.bytes[8..self.weights.data_start()]
            .trim_ascii_end()
            .to_vec()
    }

    /// Writes weights with `header` before the fixture's data.
    fn write_with_header(&self, dir: &Path, header: &Value) -> Result<()> {
        std::fs::write(
            dir.join(WEIGHTS),
            safetensors::with_header(header, self.weights.data()),
        )?;
        Ok(())
    }

    fn config_with(&self, dir: &Path, change: impl FnOnce(&mut Map<String, Value>)) -> Result<()> {
        let mut config = self.config.clone();
        change(&mut config);
        std::fs::write(dir.join(CONFIG), Value::Object(config).to_string())?;
        Ok(())
    }

    /// The language model's settings: `text_config` in a multimodal config, else the whole.
    fn text_config(&self) -> &Map<String, Value> {
        self.config
            .get("text_config")
            .and_then(Value::as_object)
            .unwrap_or(&self.config)
    }

    /// Writes config.json with the language model's settings changed by `change`.
    fn text_config_with(
        &self,
        dir: &Path,
        change: impl FnOnce(&mut Map<String, Value>),
    ) -> Result<()> {
        self.config_with(dir, |config| match config.get_mut("text_config") {
            Some(Value::Object(text)) => change(text),
            _ => change(config),
        })
    }

    fn file(&self, name: &str) -> &[u8] {
        self.files
            .iter()
            .find(|(n, _)| n == name)
            .map_or(&[], |(_, bytes)| bytes.as_slice())
    }
}

fn corruption(kind: &'static str, detail: String, expect: Expect) -> Corruption {
    Corruption {
        kind,
        detail,
        expect,
        prompt: "hello".into(),
    }
}

fn truncated_data(f: &Fixture, dir: &Path, rng: &mut StdRng) -> Result<Corruption> {
    let at = rng.random_range(f.weights.data_start()..f.weights.bytes.len());
    std::fs::write(dir.join(WEIGHTS), &f.weights.bytes[..at])?;
    let detail = format!(
        "{WEIGHTS} cut at byte {at} of {}, in the data",
        f.weights.bytes.len()
    );
    Ok(corruption("truncated-data", detail, Expect::Error))
}

fn truncated_header(f: &Fixture, dir: &Path, rng: &mut StdRng) -> Result<Corruption> {
    let at = rng.random_range(0..f.weights.data_start());
    std::fs::write(dir.join(WEIGHTS), &f.weights.bytes[..at])?;
    let detail = format!("{WEIGHTS} cut at byte {at}, in the header");
    Ok(corruption("truncated-header", detail, Expect::Error))
}

fn weights_replaced(_: &Fixture, dir: &Path, rng: &mut StdRng) -> Result<Corruption> {
    let path = dir.join(WEIGHTS);
    let detail = match rng.random_range(0..4) {
        0 => {
            std::fs::write(&path, b"")?;
            "an empty file"
        }
        1 => {
            std::fs::remove_file(&path)?;
            "missing"
        }
        2 => {
            std::fs::remove_file(&path)?;
            std::fs::create_dir(&path)?;
            "a directory"
        }
        _ => {
            std::fs::remove_file(&path)?;
            std::os::unix::fs::symlink(WEIGHTS, &path)?;
            "a symlink to itself"
        }
    };
    let detail = format!("{WEIGHTS} is {detail}");
    Ok(corruption("weights-replaced", detail, Expect::Error))
}

fn header_length(f: &Fixture, dir: &Path, rng: &mut StdRng) -> Result<Corruption> {
    let file_length = f.weights.bytes.len() as u64;
    let length = *[
        0,
        1,
        7,
        u64::MAX,
        1 << 63,
        1 << 32,
        file_length,
        file_length - 7,
        f.weights.header_length as u64 + 8,
        rng.random(),
    ]
    .choose(rng)
    .expect("not empty");
    let mut bytes = f.weights.bytes.clone();
    bytes[..8].copy_from_slice(&length.to_le_bytes());
    std::fs::write(dir.join(WEIGHTS), bytes)?;
    let detail = format!("header length {length} (was {})", f.weights.header_length);
    Ok(corruption("header-length", detail, Expect::Error))
}

/// A header length cut into the padding spaces: the JSON still parses, but the data starts
/// early, so the file holds more data than the header accounts for.
fn header_length_in_padding(f: &Fixture, dir: &Path, rng: &mut StdRng) -> Result<Corruption> {
    let mut header = f.header_text();
    // At least one space to cut into, as `mlx_lm convert` may write none.
    header.push(b' ');
    header.resize(header.len().next_multiple_of(8), b' ');
    let padding = header.iter().rev().take_while(|&&b| b == b' ').count();
    let cut = rng.random_range(1..=padding);
    let length = (header.len() - cut) as u64;
    let bytes = [
        &length.to_le_bytes(),
        header.as_slice(),
        &f.weights.bytes[f.weights.data_start()..],
    ]
    .concat();
    std::fs::write(dir.join(WEIGHTS), bytes)?;
    let detail = format!("header length {length}, {cut} bytes into {padding} of padding");
    Ok(corruption("header-length-padding", detail, Expect::Either))
}

fn header_bytes(f: &Fixture, dir: &Path, rng: &mut StdRng) -> Result<Corruption> {
    let mut bytes = f.weights.bytes.clone();
    let count = rng.random_range(1..8);
    let mut changed = Vec::new();
    for _ in 0..count {
        let at = rng.random_range(8..f.weights.data_start());
        let byte = *b"{}[]\",:0-9e \x00\xffZ".choose(rng).expect("not empty");
        bytes[at] = byte;
        changed.push(format!("{at}={byte:#04x}"));
    }
    std::fs::write(dir.join(WEIGHTS), bytes)?;
    let detail = format!("header bytes changed: {}", changed.join(" "));
    Ok(corruption("header-bytes", detail, Expect::Either))
}

fn header_not_an_object(f: &Fixture, dir: &Path, rng: &mut StdRng) -> Result<Corruption> {
    let header = *["[]", "null", "\"x\"", "1", "{}", "{\"__metadata__\": {}}"]
        .choose(rng)
        .expect("not empty");
    f.write_with_header(dir, &serde_json::from_str(header)?)?;
    Ok(corruption(
        "header-not-tensors",
        format!("header {header}"),
        Expect::Error,
    ))
}

fn element_bytes(dtype: &str) -> Option<usize> {
    match dtype {
        "F64" | "I64" | "U64" => Some(8),
        "F32" | "I32" | "U32" => Some(4),
        "F16" | "BF16" | "I16" | "U16" => Some(2),
        "U8" | "I8" | "BOOL" | "F8_E4M3" | "F8_E5M2" => Some(1),
        _ => None,
    }
}

/// A random tensor's entry in the header, changed by `change`.
fn change_tensor(
    f: &Fixture,
    dir: &Path,
    rng: &mut StdRng,
    change: impl FnOnce(&mut Map<String, Value>, &mut StdRng) -> (String, Expect),
) -> Result<(String, Expect)> {
    let names = f.weights.tensor_names();
    let name = names.choose(rng).expect("the fixture has tensors").clone();
    let mut header = f.weights.header.clone();
    let entry = header[&name].as_object_mut().context("a tensor entry")?;
    let (what, expect) = change(entry, rng);
    f.write_with_header(dir, &Value::Object(header))?;
    Ok((format!("{name}: {what}"), expect))
}

fn tensor_dtype(f: &Fixture, dir: &Path, rng: &mut StdRng) -> Result<Corruption> {
    let (detail, expect) = change_tensor(f, dir, rng, |entry, rng| {
        let old = entry["dtype"].as_str().unwrap_or("").to_owned();
        let new = *[
            "F32", "F16", "BF16", "U32", "I32", "U8", "I8", "BOOL", "F64", "I64", "F8_E4M3", "Q4",
            "xyz", "7",
        ]
        .iter()
        .filter(|d| **d != old)
        .collect::<Vec<_>>()
        .choose(rng)
        .expect("not empty");
        entry["dtype"] = if *new == "7" { json!(7) } else { json!(new) };
        // The same width reinterprets the bytes; any other no longer fits the offsets.
        let same_width = element_bytes(new).is_some() && element_bytes(new) == element_bytes(&old);
        let expect = if same_width {
            Expect::Either
        } else {
            Expect::Error
        };
        (format!("dtype {old} → {new}"), expect)
    })?;
    Ok(corruption("tensor-dtype", detail, expect))
}

fn tensor_shape(f: &Fixture, dir: &Path, rng: &mut StdRng) -> Result<Corruption> {
    let (detail, expect) = change_tensor(f, dir, rng, |entry, rng| {
        let old: Vec<u64> = entry["shape"]
            .as_array()
            .map(|dims| dims.iter().filter_map(Value::as_u64).collect())
            .unwrap_or_default();
        let product: u64 = old.iter().product();
        let (new, expect) = match rng.random_range(0..9) {
            0 => (json!([product]), Expect::Either),
            1 => (json!(old.iter().rev().collect::<Vec<_>>()), Expect::Either),
            2 => (json!([old.as_slice(), &[1]].concat()), Expect::Either),
            3 => (
                json!(old.iter().map(|d| d * 2).collect::<Vec<_>>()),
                Expect::Error,
            ),
            4 => (json!([0]), Expect::Error),
            5 => (json!([1u64 << 40, 1u64 << 40]), Expect::Error),
            6 => (json!([u64::MAX, 2]), Expect::Error),
            7 => (json!([-1]), Expect::Error),
            _ => (json!("x"), Expect::Error),
        };
        let what = format!("shape {old:?} → {new}");
        entry["shape"] = new;
        (what, expect)
    })?;
    Ok(corruption("tensor-shape", detail, expect))
}

fn tensor_offsets(f: &Fixture, dir: &Path, rng: &mut StdRng) -> Result<Corruption> {
    let data_length = (f.weights.bytes.len() - f.weights.data_start()) as u64;
    let (detail, expect) = change_tensor(f, dir, rng, |entry, rng| {
        let range: Vec<u64> = entry["data_offsets"]
            .as_array()
            .map(|o| o.iter().filter_map(Value::as_u64).collect())
            .unwrap_or_default();
        let (start, end) = (range[0], range[1]);
        let (new, expect) = match rng.random_range(0..8) {
            0 => (json!([start, end + 1]), Expect::Error),
            1 => (json!([start + 1, end]), Expect::Error),
            2 => (json!([end, start]), Expect::Error),
            3 => (
                json!([data_length, data_length + end - start]),
                Expect::Error,
            ),
            4 => (json!([u64::MAX - 1, u64::MAX]), Expect::Error),
            5 => (json!([0, end - start]), Expect::Either),
            6 => (json!([start]), Expect::Error),
            _ => (json!([-1, end]), Expect::Error),
        };
        let what = format!("data_offsets [{start}, {end}] → {new}");
        entry["data_offsets"] = new;
        (what, expect)
    })?;
    Ok(corruption("tensor-offsets", detail, expect))
}

fn tensor_removed_or_renamed(f: &Fixture, dir: &Path, rng: &mut StdRng) -> Result<Corruption> {
    let names = f.weights.tensor_names();
    let name = names.choose(rng).expect("the fixture has tensors").clone();
    let mut header = f.weights.header.clone();
    let entry = header.remove(&name).context("a tensor entry")?;
    let (detail, expect) = match rng.random_range(0..3) {
        0 => (format!("{name} removed from the header"), Expect::Error),
        1 => {
            header.insert(format!("{name}.renamed"), entry);
            (format!("{name} renamed"), Expect::Error)
        }
        _ => {
            header.insert(name.clone(), entry.clone());
            header.insert(format!("{name}.extra"), entry);
            (
                format!("{name} also listed as {name}.extra"),
                Expect::Either,
            )
        }
    };
    f.write_with_header(dir, &Value::Object(header))?;
    Ok(corruption("tensor-entries", detail, expect))
}

fn metadata(f: &Fixture, dir: &Path, rng: &mut StdRng) -> Result<Corruption> {
    let value = [
        json!({"format": 1}),
        json!([]),
        json!("x"),
        json!({"format": "pt"}),
        json!(null),
    ]
    .choose(rng)
    .expect("not empty")
    .clone();
    let mut header = f.weights.header.clone();
    header.insert("__metadata__".into(), value.clone());
    f.write_with_header(dir, &Value::Object(header))?;
    Ok(corruption(
        "metadata",
        format!("__metadata__ {value}"),
        Expect::Either,
    ))
}

fn flip_bits(
    bytes: &mut [u8],
    range: std::ops::Range<usize>,
    count: usize,
    rng: &mut StdRng,
) -> String {
    let flips: Vec<String> = (0..count)
        .map(|_| {
            let at = rng.random_range(range.clone());
            let bit = rng.random_range(0..8);
            bytes[at] ^= 1 << bit;
            format!("{at}.{bit}")
        })
        .collect();
    flips.join(" ")
}

fn data_bit_flips(f: &Fixture, dir: &Path, rng: &mut StdRng) -> Result<Corruption> {
    let mut bytes = f.weights.bytes.clone();
    let count = rng.random_range(1..16);
    let flips = flip_bits(
        &mut bytes,
        f.weights.data_start()..f.weights.bytes.len(),
        count,
        rng,
    );
    std::fs::write(dir.join(WEIGHTS), bytes)?;
    Ok(corruption(
        "data-bit-flips",
        format!("bits flipped at {flips}"),
        Expect::Either,
    ))
}

fn header_bit_flips(f: &Fixture, dir: &Path, rng: &mut StdRng) -> Result<Corruption> {
    let mut bytes = f.weights.bytes.clone();
    let count = rng.random_range(1..4);
    let flips = flip_bits(&mut bytes, 0..f.weights.data_start(), count, rng);
    std::fs::write(dir.join(WEIGHTS), bytes)?;
    Ok(corruption(
        "header-bit-flips",
        format!("bits flipped at {flips}"),
        Expect::Either,
    ))
}

fn appended_garbage(f: &Fixture, dir: &Path, rng: &mut StdRng) -> Result<Corruption> {
    let mut extra = vec![0u8; rng.random_range(1..4096)];
    rng.fill(&mut extra[..]);
    let detail = format!("{} random bytes appended", extra.len());
    std::fs::write(
        dir.join(WEIGHTS),
        [f.weights.bytes.as_slice(), &extra].concat(),
    )?;
    Ok(corruption("appended-bytes", detail, Expect::Either))
}

fn index_file(f: &Fixture, dir: &Path, rng: &mut StdRng) -> Result<Corruption> {
    let path = dir.join(INDEX);
    let index: Value = serde_json::from_slice(f.file(INDEX)).unwrap_or(json!({}));
    let detail = match rng.random_range(0..5) {
        0 => {
            std::fs::write(&path, b"{\"weight_map\": ")?;
            "cut short"
        }
        1 => {
            std::fs::remove_file(&path).ok();
            "missing"
        }
        2 => {
            let mut index = index;
            if let Some(map) = index["weight_map"].as_object_mut() {
                for file in map.values_mut() {
                    *file = json!("model-00002-of-00002.safetensors");
                }
            }
            std::fs::write(&path, index.to_string())?;
            "naming a weight file that does not exist"
        }
        3 => {
            std::fs::write(
                &path,
                json!({"weight_map": ["../../etc/passwd"]}).to_string(),
            )?;
            "with a weight map that is a list"
        }
        _ => {
            std::fs::write(&path, b"")?;
            "empty"
        }
    };
    Ok(corruption(
        "index",
        format!("{INDEX} {detail}"),
        Expect::Either,
    ))
}

fn config_missing_key(f: &Fixture, dir: &Path, rng: &mut StdRng) -> Result<Corruption> {
    let keys: Vec<&String> = f.text_config().keys().collect();
    let key = (*keys.choose(rng).context("an empty config")?).clone();
    f.text_config_with(dir, |config| {
        config.remove(&key);
    })?;
    // Architectures have defaults for most keys (a default may even be the fixture's value);
    // without a model_type, though, there is no architecture.
    let expect = if key == "model_type" && !f.config.contains_key("text_config") {
        Expect::Error
    } else {
        Expect::Either
    };
    Ok(corruption(
        "config-missing-key",
        format!("{key} removed"),
        expect,
    ))
}

fn config_wrong_type(f: &Fixture, dir: &Path, rng: &mut StdRng) -> Result<Corruption> {
    let keys: Vec<&String> = f.text_config().keys().collect();
    let key = (*keys.choose(rng).context("an empty config")?).clone();
    let values = [
        json!(null),
        json!(true),
        json!("12"),
        json!(-1),
        json!(1.5),
        json!([]),
        json!({}),
        json!(1e300),
        json!("x"),
    ];
    let old = f.text_config()[&key].clone();
    let value = values
        .iter()
        .filter(|v| std::mem::discriminant(*v) != std::mem::discriminant(&old))
        .collect::<Vec<_>>()
        .choose(rng)
        .map(|v| (*v).clone())
        .unwrap_or_default();
    let detail = format!("{key}: {old} → {value}");
    f.text_config_with(dir, |config| {
        config.insert(key, value);
    })?;
    Ok(corruption("config-wrong-type", detail, Expect::Either))
}

/// Keys that set the shapes of the weights: any other value must be refused.
const SHAPE_KEYS: [&str; 7] = [
    "num_hidden_layers",
    "hidden_size",
    "head_dim",
    "num_attention_heads",
    "num_key_value_heads",
    "vocab_size",
    "intermediate_size",
];

fn config_absurd_value(f: &Fixture, dir: &Path, rng: &mut StdRng) -> Result<Corruption> {
    use Expect::{Either, Error};
    let huge = 1u64 << 40;
    if rng.random_bool(0.15) {
        return quantization_absurd_value(f, dir, rng);
    }
    let (key, value, expect) = if rng.random_bool(0.6) {
        let key = *SHAPE_KEYS.choose(rng).expect("not empty");
        // A key the config leaves out may not be read at all, and one a multimodal config
        // also gives outside `text_config` may be read there instead.
        let read = !(f.config.contains_key("text_config") && f.config.contains_key(key));
        match f.text_config().get(key).and_then(Value::as_u64) {
            Some(actual) if read => {
                let values = [huge, 1 << 30, 1 << 31, 0, actual + 1, actual.max(2) - 1];
                (key, json!(*values.choose(rng).expect("not empty")), Error)
            }
            _ => (key, json!(huge), Either),
        }
    } else {
        let choices: Vec<(&str, Value)> = vec![
            ("max_position_embeddings", json!(0)),
            ("max_position_embeddings", json!(1)),
            ("max_position_embeddings", json!(u64::MAX)),
            ("rms_norm_eps", json!(0)),
            ("rms_norm_eps", json!(-1)),
            ("rms_norm_eps", json!(1e308)),
            ("rope_theta", json!(0)),
            ("rope_theta", json!(-1)),
            ("rope_theta", json!(1e-300)),
            ("rope_theta", json!(1e308)),
            ("rope_scaling", json!({"rope_type": "llama3", "factor": 0})),
            (
                "rope_scaling",
                json!({"rope_type": "llama3", "factor": -1, "low_freq_factor": 4,
                       "high_freq_factor": 1, "original_max_position_embeddings": 0}),
            ),
            ("rope_scaling", json!({"rope_type": "no-such-scaling"})),
            ("rope_scaling", json!({"type": "yarn"})),
            ("eos_token_id", json!(huge)),
            ("eos_token_id", json!(-1)),
            ("eos_token_id", json!([huge, -1])),
            ("bos_token_id", json!(huge)),
            ("tie_word_embeddings", json!(true)),
            ("sliding_window", json!(0)),
        ];
        let (key, value) = choices.choose(rng).expect("not empty").clone();
        (key, value, Either)
    };
    let detail = format!("{key}: {value}");
    f.text_config_with(dir, |config| {
        config.insert(key.into(), value);
    })?;
    Ok(corruption("config-absurd-value", detail, expect))
}

/// Quantization no weights can have been written with (both copies of it, so that neither
/// masks the other).
fn quantization_absurd_value(f: &Fixture, dir: &Path, rng: &mut StdRng) -> Result<Corruption> {
    let value = [
        json!({"group_size": 0, "bits": 4}),
        json!({"group_size": 7, "bits": 4}),
        json!({"group_size": 1u64 << 40, "bits": 4}),
        json!({"group_size": 64, "bits": 0}),
        json!({"group_size": 64, "bits": 7}),
        json!({"group_size": 64, "bits": 64}),
    ]
    .choose(rng)
    .expect("not empty")
    .clone();
    let expect = if f.config.contains_key("quantization") {
        Expect::Error
    } else {
        Expect::Either
    };
    f.config_with(dir, |config| {
        config.insert("quantization".into(), value.clone());
        config.insert("quantization_config".into(), value.clone());
    })?;
    Ok(corruption(
        "config-absurd-value",
        format!("quantization: {value}"),
        expect,
    ))
}

fn config_model_type(f: &Fixture, dir: &Path, rng: &mut StdRng) -> Result<Corruption> {
    let model_type = *[
        "qwen3",
        "qwen3_5",
        "gemma3_text",
        "gemma4_text",
        "no_such_model",
        "",
        "LLAMA",
    ]
    .choose(rng)
    .expect("not empty");
    f.config_with(dir, |config| {
        config.insert("model_type".into(), json!(model_type));
    })?;
    Ok(corruption(
        "config-model-type",
        format!("model_type {model_type:?}"),
        Expect::Either,
    ))
}

fn config_file(f: &Fixture, dir: &Path, rng: &mut StdRng) -> Result<Corruption> {
    let path = dir.join(CONFIG);
    let original = f.file(CONFIG);
    let (detail, expect): (String, Expect) = match rng.random_range(0..10) {
        0 => {
            let at = rng.random_range(0..original.len());
            std::fs::write(&path, &original[..at])?;
            (format!("cut at byte {at}"), Expect::Error)
        }
        1 => {
            std::fs::write(&path, b"")?;
            ("empty".into(), Expect::Error)
        }
        2 => {
            std::fs::remove_file(&path)?;
            std::fs::create_dir(&path)?;
            ("a directory".into(), Expect::Error)
        }
        3 => {
            std::fs::remove_file(&path)?;
            ("missing".into(), Expect::Error)
        }
        4 => {
            let text = *["null", "[]", "42", "\"llama\""]
                .choose(rng)
                .expect("not empty");
            std::fs::write(&path, text)?;
            (text.to_string(), Expect::Error)
        }
        5 => {
            let mut bytes = vec![0u8; rng.random_range(1..512)];
            rng.fill(&mut bytes[..]);
            std::fs::write(&path, bytes)?;
            ("random bytes".into(), Expect::Error)
        }
        6 => {
            std::fs::write(&path, [b"\xEF\xBB\xBF".as_slice(), original].concat())?;
            ("with a byte order mark".into(), Expect::Either)
        }
        7 => {
            let mut bytes = original.to_vec();
            let flips = flip_bits(&mut bytes, 0..original.len(), rng.random_range(1..4), rng);
            std::fs::write(&path, bytes)?;
            (format!("bits flipped at {flips}"), Expect::Either)
        }
        8 => {
            f.config_with(dir, |config| {
                config.insert("padding".into(), json!("x".repeat(10 << 20)));
            })?;
            ("with a 10 MB string".into(), Expect::Either)
        }
        _ => {
            let depth = *[127, 129, 100_000].choose(rng).expect("not empty");
            let nested = format!("{}1{}", "[".repeat(depth), "]".repeat(depth));
            let mut text = Value::Object(f.config.clone()).to_string();
            text.pop();
            text.push_str(&format!(",\"nested\":{nested}}}"));
            std::fs::write(&path, text)?;
            (format!("with arrays nested {depth} deep"), Expect::Either)
        }
    };
    Ok(corruption(
        "config-file",
        format!("{CONFIG} {detail}"),
        expect,
    ))
}

fn tokenizer_file(f: &Fixture, dir: &Path, rng: &mut StdRng) -> Result<Corruption> {
    let path = dir.join(TOKENIZER);
    let original = f.file(TOKENIZER);
    let (detail, expect): (String, Expect) = match rng.random_range(0..7) {
        0 => {
            let at = rng.random_range(0..original.len());
            std::fs::write(&path, &original[..at])?;
            (format!("cut at byte {at}"), Expect::Error)
        }
        1 => {
            std::fs::write(&path, b"")?;
            ("empty".into(), Expect::Error)
        }
        2 => {
            std::fs::remove_file(&path)?;
            ("missing".into(), Expect::Error)
        }
        3 => {
            let mut bytes = original.to_vec();
            let flips = flip_bits(&mut bytes, 0..original.len(), rng.random_range(1..8), rng);
            std::fs::write(&path, bytes)?;
            (format!("bits flipped at {flips}"), Expect::Either)
        }
        4 => {
            let mut tokenizer: Value = serde_json::from_slice(original)?;
            tokenizer["model"]["type"] = json!("NoSuchModel");
            std::fs::write(&path, tokenizer.to_string())?;
            ("with model type NoSuchModel".into(), Expect::Error)
        }
        5 => {
            let mut tokenizer: Value = serde_json::from_slice(original)?;
            tokenizer["model"]["vocab"] = json!({});
            std::fs::write(&path, tokenizer.to_string())?;
            ("with an empty vocabulary".into(), Expect::Either)
        }
        _ => {
            std::fs::write(&path, b"[]")?;
            ("a list".into(), Expect::Error)
        }
    };
    Ok(corruption(
        "tokenizer-file",
        format!("{TOKENIZER} {detail}"),
        expect,
    ))
}

/// A token the tokenizer knows but the model's embedding has no row for, in the prompt.
fn tokenizer_token_beyond_vocab(f: &Fixture, dir: &Path, rng: &mut StdRng) -> Result<Corruption> {
    let mut tokenizer: Value = serde_json::from_slice(f.file(TOKENIZER))?;
    let vocab = f
        .text_config()
        .get("vocab_size")
        .and_then(Value::as_u64)
        .unwrap_or(0);
    let id = *[vocab, vocab + 1, 1 << 20, u64::from(u32::MAX)]
        .choose(rng)
        .expect("not empty");
    let token = json!({"id": id, "content": "<|beyond|>", "single_word": false, "lstrip": false,
                       "rstrip": false, "normalized": false, "special": rng.random_bool(0.5)});
    match tokenizer["added_tokens"].as_array_mut() {
        Some(tokens) => tokens.push(token),
        None => tokenizer["added_tokens"] = json!([token]),
    }
    std::fs::write(dir.join(TOKENIZER), tokenizer.to_string())?;
    Ok(Corruption {
        prompt: "<|beyond|> hello <|beyond|>".into(),
        ..corruption(
            "token-beyond-vocab",
            format!("added token id {id} (vocab {vocab}) in the prompt"),
            Expect::Either,
        )
    })
}

fn tokenizer_config_file(f: &Fixture, dir: &Path, rng: &mut StdRng) -> Result<Corruption> {
    let path = dir.join(TOKENIZER_CONFIG);
    let mut config: Value = serde_json::from_slice(f.file(TOKENIZER_CONFIG)).unwrap_or(json!({}));
    let detail = match rng.random_range(0..8) {
        0 => {
            config["chat_template"] = json!("{% for message in messages %}{{ message['content'] }");
            "chat_template that does not parse"
        }
        1 => {
            config["chat_template"] = json!("{{ raise_exception('a template error') }}");
            "chat_template that raises"
        }
        2 => {
            config["chat_template"] =
                json!("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}");
            "chat_template that recurses forever"
        }
        3 => {
            config["chat_template"] = json!(7);
            "chat_template 7"
        }
        4 => {
            config["eos_token"] = json!({"content": 5});
            "eos_token {\"content\": 5}"
        }
        5 => {
            config["chat_template"] =
                json!([{"name": "default", "template": "{{ messages }}"}, null]);
            "chat_template as a list with a null"
        }
        6 => {
            std::fs::write(&path, b"{\"chat_template\": ")?;
            return Ok(corruption(
                "tokenizer-config",
                format!("{TOKENIZER_CONFIG} cut short"),
                Expect::Either,
            ));
        }
        _ => {
            std::fs::write(
                dir.join("generation_config.json"),
                json!({"temperature": -1, "top_p": 7, "top_k": -3, "eos_token_id": "x"})
                    .to_string(),
            )?;
            return Ok(corruption(
                "tokenizer-config",
                "generation_config.json with nonsense values".into(),
                Expect::Either,
            ));
        }
    };
    std::fs::write(&path, config.to_string())?;
    Ok(corruption(
        "tokenizer-config",
        format!("{TOKENIZER_CONFIG} with a {detail}"),
        Expect::Either,
    ))
}
