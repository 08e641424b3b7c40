//! The real `oxlm lora` binary: learning rates that cannot train are refused before the model
//! loads, a run that diverges ends with an error and no adapters of NaN, a `--config` file
//! drives a run as mlx_lm.lora's does, and bad configs are refused naming the key; preference
//! training (`--train-mode dpo|orpo`, DPO of each `--dpo-cpo-loss-type`) lowers its loss, and its
//! adapters load back and serve.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const OXLM: &str = env!("CARGO_BIN_EXE_oxlm");

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

/// `oxlm lora --train` on the tiny llama for a few steps, saving into `adapters`.
fn lora(learning_rate: &str, adapters: &Path) -> Output {
    Command::new(OXLM)
        .arg("lora")
        .arg("--model")
        .arg(fixtures().join("tiny/llama-4bit-g64"))
        .arg("--data")
        .arg(fixtures().join("lora/data"))
        .arg("--adapter-path")
        .arg(adapters)
        .args([
            "--train",
            "--num-layers",
            "2",
            "--iters",
            "5",
            "--val-batches",
            "1",
        ])
        .arg(format!("--learning-rate={learning_rate}"))
        .output()
        .unwrap()
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

/// NaN, infinities, 0, negatives, and rates that f32 (which training computes in) makes
/// infinite or 0.
#[test]
fn learning_rates_that_cannot_train_are_refused_naming_the_flag() {
    let out = tempfile::tempdir().unwrap();
    let adapters = out.path().join("adapters");
    for rate in ["nan", "inf", "-inf", "0", "-1e-5", "1e39", "1e-50"] {
        let output = lora(rate, &adapters);
        assert_eq!(output.status.code(), Some(2), "{rate}: {}", stderr(&output));
        assert!(
            stderr(&output).contains(&format!(
                "invalid value '{rate}' for '--learning-rate <LEARNING_RATE>': expected a finite \
                 number above 0"
            )),
            "{rate}: {}",
            stderr(&output)
        );
    }
    assert!(!adapters.exists());
}

/// At a rate of 1e30 the second step's loss is NaN: the run ends there with status 1, and no
/// adapter weights are written.
#[test]
fn a_diverging_run_fails_and_saves_no_adapters() {
    let out = tempfile::tempdir().unwrap();
    let adapters = out.path().join("adapters");
    let output = lora("1e30", &adapters);
    assert_eq!(output.status.code(), Some(1), "{}", stderr(&output));
    assert!(
        stderr(&output).contains(
            "error: training diverged at iteration 2: the loss is NaN; the adapters are not \
             updated or saved from this step on"
        ),
        "{}",
        stderr(&output)
    );
    assert!(!stderr(&output).contains("panicked"), "{}", stderr(&output));
    assert!(!adapters.join("adapters.safetensors").exists());
}

/// `oxlm lora --config FILE` with `extra` flags, on the tiny llama and the fixture data.
fn lora_with_config(config: &str, dir: &Path, extra: &[&str]) -> Output {
    let file = dir.join("config.yaml");
    std::fs::write(&file, config).unwrap();
    Command::new(OXLM)
        .arg("lora")
        .arg("-c")
        .arg(&file)
        .arg("--model")
        .arg(fixtures().join("tiny/llama-4bit-g64"))
        .arg("--data")
        .arg(fixtures().join("lora/data"))
        .args(extra)
        .output()
        .unwrap()
}

fn read_lines(path: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// A config file as mlx_lm.lora reads it: its values drive the adapters' shape, dropout and keys,
/// the optimizer and the learning-rate schedule, flags given on the command line win over it, and
/// adapter_config.json records the run as mlx-lm does (unknown keys included). The metrics log
/// has a line per report and validation, with the schedule's rates.
#[test]
fn a_config_file_drives_the_run() {
    let out = tempfile::tempdir().unwrap();
    let adapters = out.path().join("adapters");
    let metrics = out.path().join("metrics.jsonl");
    let config = format!(
        "train: true\n\
         adapter_path: {}\n\
         num_layers: 1\n\
         iters: 50\n\
         batch_size: 2\n\
         val_batches: 1\n\
         steps_per_report: 1\n\
         steps_per_eval: 3\n\
         optimizer: adamw\n\
         optimizer_config:\n  adamw:\n    weight_decay: 0.1\n    betas: [0.8, 0.99]\n\
         lr_schedule:\n  name: linear_schedule\n  arguments: [1e-3, 1e-4, 2]\n  warmup: 2\n\
         lora_parameters:\n  rank: 3\n  scale: 7.5\n  dropout: 0.1\n  keys: [self_attn.q_proj, mlp.down_proj]\n\
         report_to: none\n",
        adapters.display()
    );
    let output = lora_with_config(
        &config,
        out.path(),
        &["--iters", "6", "--metrics-file", metrics.to_str().unwrap()],
    );
    assert!(output.status.success(), "{}", stderr(&output));
    let saved: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(adapters.join("adapter_config.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(saved["lora_parameters"]["rank"], 3);
    assert_eq!(saved["lora_parameters"]["scale"], 7.5);
    assert_eq!(saved["lora_parameters"]["dropout"], 0.1);
    assert_eq!(saved["num_layers"], 1);
    assert_eq!(saved["iters"], 6, "the flag wins over the file");
    assert_eq!(saved["optimizer"], "adamw");
    assert_eq!(saved["optimizer_config"]["adamw"]["weight_decay"], 0.1);
    assert_eq!(saved["report_to"], "none");
    assert_eq!(saved["learning_rate"], 1e-5, "mlx-lm's default, unused");
    // The adapters have the config's shape: one block, two layers of rank 3.
    let bytes = std::fs::read(adapters.join("adapters.safetensors")).unwrap();
    let weights = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut names = weights.names();
    names.sort();
    assert_eq!(
        names,
        [
            "model.layers.1.mlp.down_proj.lora_a",
            "model.layers.1.mlp.down_proj.lora_b",
            "model.layers.1.self_attn.q_proj.lora_a",
            "model.layers.1.self_attn.q_proj.lora_b",
        ]
    );
    assert_eq!(
        weights
            .tensor("model.layers.1.self_attn.q_proj.lora_a")
            .unwrap()
            .shape()[1],
        3
    );

    // A warmup of 2 steps from 0 to 1e-3, then 1e-3 again (the schedule's step 0), then down to
    // 1e-4 over 2 steps: the rate of each iteration's update.
    let lines = read_lines(&metrics);
    let train: Vec<_> = lines.iter().filter(|l| l["event"] == "train").collect();
    let rates: Vec<f64> = train
        .iter()
        .map(|l| l["learning_rate"].as_f64().unwrap())
        .collect();
    let want = [0.0, 5e-4, 1e-3, 1e-3, 5.5e-4, 1e-4];
    assert_eq!(rates.len(), want.len());
    for (got, want) in rates.iter().zip(want) {
        assert!((got - want).abs() <= 1e-6 * want, "{rates:?}");
    }
    assert_eq!(
        train
            .iter()
            .map(|l| l["iteration"].as_u64().unwrap())
            .collect::<Vec<_>>(),
        [1, 2, 3, 4, 5, 6]
    );
    for line in &train {
        for key in [
            "train_loss",
            "iterations_per_second",
            "tokens_per_second",
            "trained_tokens",
            "peak_memory",
        ] {
            assert!(line[key].as_f64().unwrap() > 0.0, "{key}: {line}");
        }
    }
    let val: Vec<u64> = (lines.iter().filter(|l| l["event"] == "val"))
        .map(|l| l["iteration"].as_u64().unwrap())
        .collect();
    assert_eq!(val, [1, 3, 6]);

    // The adapter_config.json written loads back: --test alone reads the adapters through it.
    let data = out.path().join("data");
    std::fs::create_dir(&data).unwrap();
    std::fs::copy(
        fixtures().join("lora/data/valid.jsonl"),
        data.join("test.jsonl"),
    )
    .unwrap();
    let test = Command::new(OXLM)
        .arg("lora")
        .arg("--model")
        .arg(fixtures().join("tiny/llama-4bit-g64"))
        .arg("--data")
        .arg(&data)
        .arg("--adapter-path")
        .arg(&adapters)
        .args(["--test", "--test-batches", "1"])
        .output()
        .unwrap();
    assert!(test.status.success(), "{}", stderr(&test));
    assert!(String::from_utf8_lossy(&test.stdout).contains("Test loss"));
}

/// Configs mlx-lm would refuse, and values oxlm does not support, end the run before the model
/// loads, naming the key, with status 1 and no panic.
#[test]
fn bad_configs_are_refused_naming_the_key() {
    let out = tempfile::tempdir().unwrap();
    for (config, message) in [
        (
            "batch_size: four\n",
            "`batch_size`: invalid type: string \"four\", expected usize",
        ),
        (
            "optimizer: rmsprop\n",
            "`optimizer`: unknown optimizer `rmsprop` (supported: adam, adamw, sgd, adafactor, muon)",
        ),
        (
            "lr_schedule: {name: cosine_warmup, arguments: [1e-3, 10]}\n",
            "`lr_schedule.name`: unknown schedule `cosine_warmup`",
        ),
        (
            "lr_schedule: {name: linear_schedule, arguments: [1e-3, 0, 0]}\n",
            "`lr_schedule.arguments[2]`: steps must be a whole number of steps, at least 1",
        ),
        (
            "optimizer: sgd\noptimizer_config: {sgd: {momentum: high}}\n",
            "`optimizer_config.sgd.momentum`: invalid type: string \"high\", expected f64",
        ),
        (
            "optimizer_config: {adam: {learning_rate: 0.1}}\n",
            "`optimizer_config.adam.learning_rate`: unknown field `learning_rate`",
        ),
        (
            "optimizer: adafactor\noptimizer_config: {adafactor: {clip_threshold: 0}}\n",
            "`optimizer_config.adafactor.clip_threshold`: must be a finite number above 0, not 0",
        ),
        (
            "optimizer: adafactor\noptimizer_config: {adafactor: {eps: [1e-30]}}\n",
            "`optimizer_config.adafactor.eps`: invalid length 1, expected an array of length 2",
        ),
        (
            "optimizer: Muon\noptimizer_config: {muon: {ns_steps: -1}}\n",
            "`optimizer_config.muon.ns_steps`: invalid value: integer `-1`, expected usize",
        ),
        (
            "optimizer: muon\noptimizer_config: {muon: {momentum: 1.0}}\n",
            "`optimizer_config.muon.momentum`: must be in [0, 1), not 1",
        ),
        (
            "lora_parameters: {rank: 8, scale: 10, dropout: 1.0}\n",
            "`lora_parameters.dropout` is 1: expected a probability in [0, 1)",
        ),
        (
            "lora_parameters: {rank: 8, alpha: 16, dropout: 0.0}\n",
            "`lora_parameters.scale` is missing (mlx-lm uses `scale`, not `alpha`)",
        ),
        (
            "lora_parameters: {rank: 0, scale: 10, dropout: 0.0}\n",
            "`lora_parameters.rank` must be at least 1",
        ),
        ("save_every: 0\n", "`save_every` must be at least 1"),
        (
            "train_mode: kto\n",
            "`train_mode` kto is not supported (supported: sft, dpo, orpo)",
        ),
        (
            "train_mode: dpo\nbeta: -1\n",
            "`beta` is -1: expected a finite number above 0",
        ),
        (
            "train_mode: dpo\ndpo_cpo_loss_type: kto\n",
            "`dpo_cpo_loss_type` kto is not supported (supported: sigmoid, hinge, ipo, dpop)",
        ),
        (
            "- a list\n",
            "a config must be a mapping of option names to values",
        ),
    ] {
        let output = lora_with_config(config, out.path(), &["--train"]);
        let err = stderr(&output);
        assert_eq!(output.status.code(), Some(1), "{config}: {err}");
        assert!(err.contains(message), "{config}: {err}");
        assert!(err.contains("config.yaml"), "{config}: {err}");
        assert!(!err.contains("panicked"), "{config}: {err}");
        let said = String::from_utf8_lossy(&output.stdout);
        assert!(
            !said.contains("Loading pretrained model"),
            "{config}: {said}"
        );
    }
}

/// `oxlm lora` on the tiny llama with `args`.
fn oxlm_lora(args: &[&str]) -> Output {
    Command::new(OXLM)
        .arg("lora")
        .arg("--model")
        .arg(fixtures().join("tiny/llama-4bit-g64"))
        .args(args)
        .output()
        .unwrap()
}

/// A preference run of three epochs over the preference fixture's 8 pairs (a report per epoch,
/// a validation before the first step and after the last), saving into `out/name` with the
/// metrics in `out/name.jsonl`, with `extra` flags: the run's output, the epochs' mean losses
/// (checked to fall from the first epoch to the last), its metrics and its adapter_config.json.
fn preference_run(out: &Path, name: &str, extra: &[&str]) -> PreferenceRun {
    let data = fixtures().join("lora/data-preference");
    let adapters = out.join(name);
    let metrics = out.join(format!("{name}.jsonl"));
    let mut args = vec![
        "--train",
        "--data",
        data.to_str().unwrap(),
        "--adapter-path",
        adapters.to_str().unwrap(),
        "--metrics-file",
        metrics.to_str().unwrap(),
        "--num-layers",
        "2",
        "--batch-size",
        "2",
        "--iters",
        "12",
        "--steps-per-report",
        "4",
        "--steps-per-eval",
        "12",
        "--val-batches",
        "-1",
        "--learning-rate",
        "1e-3",
    ];
    args.extend(extra);
    let output = oxlm_lora(&args);
    assert!(output.status.success(), "{name}: {}", stderr(&output));
    let lines = read_lines(&metrics);
    let train: Vec<_> = lines.iter().filter(|l| l["event"] == "train").collect();
    let losses: Vec<f64> = (train.iter())
        .map(|l| l["train_loss"].as_f64().unwrap())
        .collect();
    println!("{name} epoch losses: {losses:?}");
    assert_eq!(losses.len(), 3, "{name}");
    assert!(losses[2] < losses[0], "{name}: {losses:?}");
    for key in ["train_margins", "train_accuracies", "train_chosen_reward"] {
        assert!(train[2][key].is_number(), "{name} {key}: {}", train[2]);
    }
    let val: Vec<_> = lines.iter().filter(|l| l["event"] == "val").collect();
    assert_eq!(val.len(), 2, "{name}");
    assert!(val[1]["val_margins"].is_number(), "{name}: {}", val[1]);
    let saved: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(adapters.join("adapter_config.json")).unwrap(),
    )
    .unwrap();
    PreferenceRun {
        output,
        first_val_loss: val[0]["val_loss"].as_f64().unwrap(),
        saved,
    }
}

struct PreferenceRun {
    output: Output,
    /// The validation before the first step.
    first_val_loss: f64,
    /// adapter_config.json.
    saved: serde_json::Value,
}

/// DPO and ORPO runs of three epochs over the preference fixture's 8 pairs (a report per
/// epoch): the mean loss of the last epoch is below the first's, and the reports carry the
/// rewards. DPO's first validation, before any update from fresh adapters (lora_b = 0: the
/// trained model is the reference), is ln 2. The DPO adapters load back for `--test`, whose
/// loss is the preference loss, and serve through `oxlm generate`.
#[test]
fn preference_training_lowers_its_loss_and_the_adapters_serve() {
    let out = tempfile::tempdir().unwrap();
    let data = fixtures().join("lora/data-preference");
    for mode in ["dpo", "orpo"] {
        let run = preference_run(out.path(), mode, &["--train-mode", mode]);
        assert_eq!(run.saved["train_mode"], mode);
        assert_eq!(run.saved["beta"], 0.1);
        if mode == "dpo" {
            let first = run.first_val_loss;
            assert!((first - std::f64::consts::LN_2).abs() < 1e-4, "{first}");
        }
    }

    let adapters = out.path().join("dpo");
    let test = oxlm_lora(&[
        "--test",
        "--train-mode",
        "dpo",
        "--data",
        data.to_str().unwrap(),
        "--adapter-path",
        adapters.to_str().unwrap(),
        "--batch-size",
        "2",
    ]);
    assert!(test.status.success(), "{}", stderr(&test));
    let said = String::from_utf8_lossy(&test.stdout);
    let loss: f64 = (said.split("Test loss ").nth(1))
        .and_then(|rest| rest.split(',').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no test loss: {said}"));
    assert!(loss.is_finite() && loss > 0.0, "{said}");
    assert!(said.contains("Test margin"), "{said}");

    let generate = Command::new(OXLM)
        .arg("generate")
        .arg("--model")
        .arg(fixtures().join("tiny/llama-4bit-g64"))
        .arg("--adapter-path")
        .arg(&adapters)
        .args(["--prompt", "Why?", "--max-tokens", "4"])
        .output()
        .unwrap();
    assert!(generate.status.success(), "{}", stderr(&generate));
}

/// DPO's other loss types (mlx-lm-lora's --dpo-cpo-loss-type) each lower their loss over the
/// same three epochs; dpop's type and δ come from the config file, and adapter_config.json
/// records them. The first validation, from fresh adapters (z = 0), is each loss at z = 0:
/// hinge 1, ipo (1/(2β))² = 25, dpop ln 2 (its penalty 0).
#[test]
fn dpo_loss_types_lower_their_loss() {
    let out = tempfile::tempdir().unwrap();
    let config = out.path().join("dpop.yaml");
    std::fs::write(&config, "dpo_cpo_loss_type: dpop\ndelta: 20.0\n").unwrap();
    for (name, extra, at_zero) in [
        ("hinge", vec!["--dpo-cpo-loss-type", "hinge"], 1.0),
        ("ipo", vec!["--dpo-cpo-loss-type", "ipo"], 25.0),
        (
            "dpop",
            vec!["-c", config.to_str().unwrap()],
            std::f64::consts::LN_2,
        ),
    ] {
        let mut args = vec!["--train-mode", "dpo"];
        args.extend(extra);
        let run = preference_run(out.path(), name, &args);
        let first = run.first_val_loss;
        assert!((first - at_zero).abs() < 1e-4 * at_zero, "{name}: {first}");
        assert_eq!(run.saved["dpo_cpo_loss_type"], name);
        let delta = if name == "dpop" { 20.0 } else { 50.0 };
        assert_eq!(run.saved["delta"], delta, "{name}");
        let said = String::from_utf8_lossy(&run.output.stdout);
        assert!(said.contains(&format!("dpo ({name}")), "{name}: {said}");
        assert!(!stderr(&run.output).contains("Note:"), "{name}");
    }
}

/// An unknown loss type is refused by the flag's parser, listing the choices, a δ that is not
/// finite (which would make every dpop loss NaN) and a β not above 0; ORPO (as in
/// mlx-lm-lora) and sft leave DPO's loss type and δ unused, and say so when they are given
/// other than their defaults, as does a DPO loss type other than dpop of δ.
#[test]
fn dpo_loss_type_flags_are_checked_and_unused_ones_noted() {
    for (args, message) in [
        (
            ["--dpo-cpo-loss-type", "kto"],
            "invalid value 'kto' for '--dpo-cpo-loss-type <DPO_CPO_LOSS_TYPE>'\n  \
             [possible values: sigmoid, hinge, ipo, dpop]",
        ),
        (
            ["--delta", "nan"],
            "invalid value 'nan' for '--delta <DELTA>': expected a finite number",
        ),
        (
            ["--beta", "inf"],
            "invalid value 'inf' for '--beta <BETA>': expected a finite number",
        ),
        (
            ["--beta", "0"],
            "invalid value '0' for '--beta <BETA>': expected a number above 0",
        ),
    ] {
        let output = oxlm_lora(&[&["--train"], &args[..]].concat());
        assert_eq!(output.status.code(), Some(2), "{}", stderr(&output));
        assert!(stderr(&output).contains(message), "{}", stderr(&output));
    }
    // Without --train or --test the run ends once its settings are gathered: after the notes.
    for (args, notes) in [
        (
            vec!["--train-mode", "orpo", "--dpo-cpo-loss-type", "ipo", "--delta", "5"],
            vec![
                "Note: `dpo_cpo_loss_type` ipo is unused for train_mode orpo: only dpo reads it.",
                "Note: `delta` 5 is unused for train_mode orpo: only dpo's dpop loss type reads it.",
            ],
        ),
        (
            vec!["--train-mode", "dpo", "--delta", "5"],
            vec!["Note: `delta` 5 is unused for the dpo loss type sigmoid: only dpo's dpop loss \
                  type reads it."],
        ),
        (vec!["--train-mode", "orpo", "--dpo-cpo-loss-type", "sigmoid", "--delta", "50"], vec![]),
        (vec!["--train-mode", "dpo", "--dpo-cpo-loss-type", "dpop", "--delta", "5"], vec![]),
    ] {
        let output = oxlm_lora(&args);
        let err = stderr(&output);
        assert_eq!(output.status.code(), Some(1), "{args:?}: {err}");
        assert!(err.contains("Must provide at least one of --train or --test"), "{err}");
        for note in &notes {
            assert!(err.contains(note), "{args:?}: {err}");
        }
        assert_eq!(err.matches("Note:").count(), notes.len(), "{args:?}: {err}");
    }
}

/// Preference data must be preference rows: chat data, or a row without `rejected`, is refused
/// before training, naming the file, the line and the field.
#[test]
fn preference_training_refuses_rows_without_its_fields() {
    let out = tempfile::tempdir().unwrap();
    let rows = "{\"prompt\": \"Why?\", \"chosen\": \"Because.\", \"rejected\": \"No.\"}\n\
                {\"prompt\": \"Why?\", \"chosen\": \"Because.\"}\n";
    let mine = out.path().join("data");
    std::fs::create_dir(&mine).unwrap();
    std::fs::write(mine.join("train.jsonl"), rows).unwrap();
    let chat = fixtures().join("lora/data");
    for (data, message) in [
        (
            &mine,
            "train.jsonl:2: `rejected` is missing or not of the expected type",
        ),
        (
            &chat,
            "train.jsonl:1: `prompt` is missing or not of the expected type",
        ),
    ] {
        let output = oxlm_lora(&[
            "--train",
            "--train-mode",
            "dpo",
            "--data",
            data.to_str().unwrap(),
            "--adapter-path",
            out.path().join("adapters").to_str().unwrap(),
        ]);
        let err = stderr(&output);
        assert_eq!(output.status.code(), Some(1), "{err}");
        assert!(err.contains(message), "{err}");
        assert!(!err.contains("panicked"), "{err}");
    }
}
