"""Training goldens for `oxlm lora`, computed by mlx-lm's own tuner (datasets, iterate_batches, default_loss,
Adam, train) with fp32 activations on the tiny small-vocabulary models.

usage: PY=$(scripts/oracle/venv.sh); $PY scripts/oracle/make_lora_train_fixture.py [TINY_ROOT] [OUT_ROOT] [RUN...]
  TINY_ROOT default tests/fixtures/tiny, OUT_ROOT default tests/fixtures/lora; RUNs (names in RUNS or OPTION_RUNS)
  default all

Writes
  OUT_ROOT/data/{train,valid}.jsonl            chat data: sentences of GPL-3 as user/assistant turns (some with a
                                               system turn, some with two exchanges), deterministic
  OUT_ROOT/data-completions/{train,valid}.jsonl  prompt/completion pairs; OUT_ROOT/data-text/train.jsonl: text
  OUT_ROOT/datasets.json                       what mlx-lm's datasets make of each file: [tokens, offset] per item
                                               (chat and completions with and without mask_prompt, text)
  OUT_ROOT/train-<name>/init/                  the starting adapter (mlx-lm's lora_a draw, lora_b = B_STD * N(0,1))
  OUT_ROOT/train-<name>/step.safetensors       the first batch of iterate_batches after np.random.seed(SEED)
                                               (batch int32 [B, W], lengths int32 [B, 2]), its loss and ntoks, and
                                               the gradient of every lora_a / lora_b
  OUT_ROOT/train-<name>/curve.json             `train` for ITERS iterations from init (Adam, lr LR, report every
                                               step, validation at 1, every STEPS_PER_EVAL and the end): train and
                                               val losses; final/ holds the adapter mlx-lm saved at the end
  OUT_ROOT/options/<name>.json                 `train` from train-llama-4bit-g64's init with mlx_lm.lora's training
                                               options (OPTION_RUNS: optimizer and optimizer_config, lr_schedule,
                                               grad_accumulation_steps, lora_parameters.dropout with the run's seed),
                                               optimizers and schedules built as mlx_lm.lora builds them: train
                                               losses and learning rates per iteration, val losses
  OUT_ROOT/optimizer-steps.json                OPTIMIZER_STEPS: mlx.optimizers' updates of a plain layer's and an
                                               expert stack's lora_a / lora_b (mlx-lm's layouts) from seeded values
                                               and gradients, step by step
  OUT_ROOT/schedules.json                      lr(step) for steps 0..SCHEDULE_STEPS of each of SCHEDULES, through
                                               mlx-lm's build_schedule
"""
import json
import re
import shutil
import sys
import types
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm import load
from mlx_lm.tuner.datasets import CacheDataset, create_dataset
from mlx_lm.tuner.trainer import TrainingArgs, default_loss, evaluate, iterate_batches, train
from mlx_lm.tuner.callbacks import TrainingCallback
from mlx_lm.tuner.utils import build_schedule, linear_to_lora_layers
from mlx_lm.utils import save_config

SEED = 0
B_STD = 0.01
BATCH = 4
ITERS = 30
LR = 1e-3
STEPS_PER_EVAL = 10
VAL_BATCHES = 2
MAX_SEQ = 2048

RUNS = {
    # every block, mlx-lm's default keys (down_proj dense), untied 8-bit head
    "llama-4bit-g64": dict(base="llama-4bit-g64", seed=3, num_layers=2,
                           lora_parameters={"rank": 8, "dropout": 0.0, "scale": 20.0}),
    # last block only; q/k RMSNorm, tied 4-bit head
    "qwen3-8bit-g128": dict(base="qwen3-8bit-g128", seed=4, num_layers=1,
                            lora_parameters={"rank": 4, "dropout": 0.0, "scale": 10.0}),
    # every block: sliding-window (8) and global layers, GeGLU, norms after attention and MLP
    "gemma3-4bit-g64": dict(base="gemma3-4bit-g64", seed=5, num_layers=4,
                            lora_parameters={"rank": 4, "dropout": 0.0, "scale": 10.0}),
    # every block: gated-DeltaNet and gated full-attention layers
    "qwen3_5-4bit-g64": dict(base="qwen3_5-4bit-g64", seed=6, num_layers=6,
                             lora_parameters={"rank": 4, "dropout": 0.0, "scale": 10.0}),
    # every block: a mixture of experts (top-2 of 4, router and stacked experts adapted) with
    # a gated shared expert
    "qwen3_5_moe-4bit-g64": dict(base="qwen3_5_moe-4bit-g64", seed=7, num_layers=4,
                                 lora_parameters={"rank": 4, "dropout": 0.0, "scale": 10.0}),
    # every block: per-layer inputs, KV-shared layers, value norms, proportional RoPE, a
    # soft-capped head
    "gemma4-4bit-g32": dict(base="gemma4-4bit-g32", seed=8, num_layers=6,
                            lora_parameters={"rank": 4, "dropout": 0.0, "scale": 10.0}),
    # every block: routed GeGLU experts beside the dense MLP, values that are keys
    "gemma4-moe-4bit-g64": dict(base="gemma4-moe-4bit-g64", seed=9, num_layers=4,
                                lora_parameters={"rank": 4, "dropout": 0.0, "scale": 10.0}),
    # every block: norms after attention and MLP only, q/k norms over all heads, a window of 8
    "olmo3-8bit-g32": dict(base="olmo3-8bit-g32", seed=10, num_layers=2,
                           lora_parameters={"rank": 4, "dropout": 0.0, "scale": 10.0}),
    # every block: residual, embedding, attention and logit multipliers
    "granite-4bit-g32": dict(base="granite-4bit-g32", seed=11, num_layers=2,
                             lora_parameters={"rank": 4, "dropout": 0.0, "scale": 10.0}),
    # every block: experts without a shared one, and a dense layer
    "qwen3_moe-4bit-g32": dict(base="qwen3_moe-4bit-g32", seed=12, num_layers=2,
                               lora_parameters={"rank": 4, "dropout": 0.0, "scale": 10.0}),
    # every block: experts chosen by sigmoid scores within groups, an ungated shared expert
    "glm4_moe-4bit-g32": dict(base="glm4_moe-4bit-g32", seed=13, num_layers=3,
                              lora_parameters={"rank": 4, "dropout": 0.0, "scale": 10.0}),
    # the last 5 of 6 blocks (the lowest adapted one a short convolution): gated short convolutions between
    # attention layers with q/k norms, feed-forward w1/w3/w2, a dense w2
    "lfm2-4bit-g64": dict(base="lfm2-4bit-g64", seed=13, num_layers=5,
                          lora_parameters={"rank": 4, "dropout": 0.0, "scale": 10.0}),
    # every block: attention first, biases on the convolution and its projections
    "lfm2-8bit-g32": dict(base="lfm2-8bit-g32", seed=14, num_layers=4,
                          lora_parameters={"rank": 4, "dropout": 0.0, "scale": 10.0}),
    # every block: a dense first layer (gate_proj/up_proj/down_proj), then sigmoid-routed experts (router and
    # stacked experts adapted) chosen with an expert bias
    "lfm2_moe-4bit-g64": dict(base="lfm2_moe-4bit-g64", seed=15, num_layers=4,
                              lora_parameters={"rank": 4, "dropout": 0.0, "scale": 10.0}),
    # every block: soft-capped attention scores, Gemma's norms around both branches, GeGLU
    "gemma2-4bit-g32": dict(base="gemma2-4bit-g32", seed=16, num_layers=2,
                            lora_parameters={"rank": 4, "dropout": 0.0, "scale": 10.0}),
    # every block: attention sinks, biased projections, the clamped SwiGLU's biased experts
    "gpt_oss-4bit-g32": dict(base="gpt_oss-4bit-g32", seed=17, num_layers=2,
                             lora_parameters={"rank": 4, "dropout": 0.0, "scale": 10.0}),
}

# mlx_lm.lora's training options, each on the llama run's model and starting adapter for OPTION_ITERS iterations.
OPTION_ITERS = 12
OPTION_RUNS = {
    # decoupled weight decay strong enough to move the curve, other betas and eps, bias correction
    "adamw": dict(optimizer="adamw", learning_rate=1e-3,
                  optimizer_config={"betas": [0.8, 0.99], "eps": 1e-6, "weight_decay": 5.0,
                                    "bias_correction": True}),
    "sgd-nesterov": dict(optimizer="sgd", learning_rate=0.005,
                         optimizer_config={"momentum": 0.9, "weight_decay": 0.01, "nesterov": True}),
    "sgd-dampening": dict(optimizer="sgd", learning_rate=0.005,
                          optimizer_config={"momentum": 0.8, "dampening": 0.5}),
    "cosine-warmup": dict(optimizer="adam", learning_rate=1e-3,
                          lr_schedule={"name": "cosine_decay", "arguments": [2e-3, 6, 1e-4], "warmup": 3,
                                       "warmup_init": 1e-4}),
    # SGD, whose step scales with the gradient (Adam's would not show a missing average)
    "grad-accumulation": dict(optimizer="sgd", learning_rate=0.01, optimizer_config={"momentum": 0.5},
                              grad_accumulation_steps=3),
    # relative steps scaled by each array's RMS: the learning rate is reported but not used
    "adafactor": dict(optimizer="adafactor", learning_rate=1e-3),
    "adafactor-config": dict(optimizer="adafactor", learning_rate=2e-3,
                             optimizer_config={"relative_step": False, "scale_parameter": False, "beta_1": 0.8,
                                               "weight_decay": 0.5, "clip_threshold": 0.5, "decay_rate": -0.6,
                                               "eps": [1e-20, 1e-3]}),
    "muon": dict(optimizer="muon", learning_rate=0.05),
    # dropout on the low-rank path's input: masks from MLX's generator, seeded as mlx_lm.lora seeds it
    "dropout": dict(optimizer="adam", learning_rate=1e-3, seed=7,
                    lora_parameters={"rank": 8, "dropout": 0.3, "scale": 20.0}),
}

# Optimizer configs applied by mlx.optimizers to the arrays of OPTIMIZER_SHAPES for OPTIMIZER_STEP_COUNT updates.
OPTIMIZER_STEP_COUNT = 3
OPTIMIZER_SHAPES = {"layer.lora_a": [8, 3], "layer.lora_b": [3, 5], "stack.lora_a": [2, 3, 8],
                    "stack.lora_b": [2, 5, 3]}
OPTIMIZER_STEPS = [
    {"optimizer": "adafactor", "learning_rate": 0.05, "optimizer_config": {}},
    {"optimizer": "adafactor", "learning_rate": 0.05, "optimizer_config": {"warmup_init": True}},
    {"optimizer": "adafactor", "learning_rate": 0.05,
     "optimizer_config": {"relative_step": False, "scale_parameter": False, "beta_1": 0.8, "weight_decay": 0.5,
                          "clip_threshold": 0.5, "decay_rate": -0.6, "eps": [1e-20, 1e-3]}},
    {"optimizer": "muon", "learning_rate": 0.05, "optimizer_config": {}},
    {"optimizer": "muon", "learning_rate": 0.05,
     "optimizer_config": {"momentum": 0.8, "weight_decay": 0.0, "nesterov": False, "ns_steps": 3}},
]
OPTIMIZERS = {"adam": optim.Adam, "adamw": optim.AdamW, "sgd": optim.SGD, "adafactor": optim.Adafactor,
              "muon": optim.Muon}

# lr_schedule configs as mlx_lm.lora's YAML gives them, tabulated by build_schedule.
SCHEDULE_STEPS = 40
SCHEDULES = [
    {"name": "cosine_decay", "arguments": [1e-5, 20]},
    {"name": "cosine_decay", "arguments": [3e-4, 25, 1e-6], "warmup": 5},
    {"name": "cosine_decay", "arguments": [2e-3, 6, 1e-4], "warmup": 3, "warmup_init": 1e-4},
    {"name": "linear_schedule", "arguments": [1e-3, 1e-5, 30]},
    {"name": "linear_schedule", "arguments": [0.0, 0.1, 7], "warmup": 2, "warmup_init": 0.05},
    {"name": "exponential_decay", "arguments": [1e-3, 0.9]},
    {"name": "exponential_decay", "arguments": [5e-4, 0.95], "warmup": 10},
    {"name": "step_decay", "arguments": [1e-3, 0.5, 4]},
]


def sentences():
    text = Path("/usr/share/common-licenses/GPL-3").read_text()
    parts = [re.sub(r"\s+", " ", s).strip() for s in re.split(r"(?<=[.;:])\s+", text)]
    return [s for s in parts if 20 <= len(s) <= 160]


def write_jsonl(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def make_data(root):
    s = sentences()
    convs = []
    for i in range(80):
        a, b, c, d = (s[(4 * i + j) % len(s)] for j in range(4))
        msgs = [{"role": "user", "content": a}, {"role": "assistant", "content": b}]
        if i % 5 == 0:
            msgs.insert(0, {"role": "system", "content": "Answer with the next sentence."})
        if i % 7 == 0:
            msgs += [{"role": "user", "content": c}, {"role": "assistant", "content": d}]
        convs.append({"messages": msgs})
    write_jsonl(root / "data" / "train.jsonl", convs[:64])
    write_jsonl(root / "data" / "valid.jsonl", convs[64:])
    pairs = [{"prompt": s[2 * i], "completion": s[2 * i + 1]} for i in range(12)]
    write_jsonl(root / "data-completions" / "train.jsonl", pairs[:8])
    write_jsonl(root / "data-completions" / "valid.jsonl", pairs[8:])
    write_jsonl(root / "data-text" / "train.jsonl", [{"text": s[i]} for i in range(8)])


def processed(path, tokenizer, mask_prompt):
    rows = [json.loads(l) for l in open(path)]
    ds = create_dataset(rows, tokenizer, types.SimpleNamespace(mask_prompt=mask_prompt))
    return [[list(map(int, t)), int(o)] for t, o in (ds.process(ds[i]) for i in range(len(ds)))]


def add_lora(model, spec, weights=None):
    model.freeze()
    linear_to_lora_layers(model, spec["num_layers"], spec["lora_parameters"])
    if weights is not None:
        model.load_weights(list(weights.items()), strict=False)


def make_init(base, out, spec):
    mx.random.seed(spec["seed"])
    model, _ = load(str(base))
    add_lora(model, spec)
    lora = dict(tree_flatten(model.trainable_parameters()))
    lora = {k: (B_STD * mx.random.normal(v.shape) if k.endswith("lora_b") else v) for k, v in lora.items()}
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "adapters.safetensors"), lora)
    save_config({"fine_tune_type": "lora", "num_layers": spec["num_layers"],
                 "lora_parameters": spec["lora_parameters"]}, out / "adapter_config.json")
    return lora


def fp32_model(base, spec, init, seed=None):
    model, tok = load(str(base))
    model.set_dtype(mx.float32)
    if seed is not None:
        # as mlx_lm.lora's train_model seeds MLX's generator, before linear_to_lora_layers draws from it
        mx.random.seed(seed)
    add_lora(model, spec, init)
    return model, tok


def datasets(root, tok):
    train = create_dataset([json.loads(l) for l in open(root / "data" / "train.jsonl")], tok,
                           types.SimpleNamespace(mask_prompt=False))
    valid = create_dataset([json.loads(l) for l in open(root / "data" / "valid.jsonl")], tok,
                           types.SimpleNamespace(mask_prompt=False))
    return CacheDataset(train), CacheDataset(valid)


def first_step(root, base, spec, init, out):
    model, tok = fp32_model(base, spec, init)
    train_set, _ = datasets(root, tok)
    np.random.seed(SEED)
    batch, lengths = next(iterate_batches(train_set, BATCH, MAX_SEQ, loop=True))
    (loss, ntoks), grads = nn.value_and_grad(model, default_loss)(model, batch, lengths)
    res = {"batch": batch.astype(mx.int32), "lengths": lengths.astype(mx.int32), "loss": loss,
           "ntoks": ntoks.astype(mx.int32)}
    res.update({f"grad.{k}": v for k, v in tree_flatten(grads)})
    mx.save_safetensors(str(out / "step.safetensors"), res)
    return float(loss), int(ntoks)


class Record(TrainingCallback):
    def __init__(self):
        self.train, self.val = [], []

    def on_train_loss_report(self, info):
        self.train.append([info["iteration"], info["train_loss"], info["trained_tokens"], info["learning_rate"]])

    def on_val_loss_report(self, info):
        self.val.append([info["iteration"] + 1, info["val_loss"]])


def curve(root, base, spec, init, out):
    model, tok = fp32_model(base, spec, init)
    train_set, valid_set = datasets(root, tok)
    final = out / "final"
    final.mkdir(parents=True, exist_ok=True)
    save_config({"fine_tune_type": "lora", "num_layers": spec["num_layers"],
                 "lora_parameters": spec["lora_parameters"]}, final / "adapter_config.json")
    args = TrainingArgs(batch_size=BATCH, iters=ITERS, val_batches=VAL_BATCHES, steps_per_report=1,
                        steps_per_eval=STEPS_PER_EVAL, steps_per_save=10 ** 9, max_seq_length=MAX_SEQ,
                        adapter_file=str(final / "adapters.safetensors"))
    rec = Record()
    np.random.seed(SEED)
    train(model=model, optimizer=optim.Adam(learning_rate=LR), train_dataset=train_set, val_dataset=valid_set,
          args=args, training_callback=rec)
    # the final adapter's loss on the whole validation set, for cross-evaluation
    model.eval()
    full_val = evaluate(model, valid_set, BATCH, -1, MAX_SEQ)
    info = {"seed": SEED, "batch_size": BATCH, "iters": ITERS, "learning_rate": LR, "steps_per_eval": STEPS_PER_EVAL,
            "val_batches": VAL_BATCHES, "max_seq_length": MAX_SEQ, "train": rec.train, "val": rec.val,
            "final_full_val_loss": full_val,
            "activations": "float32 (model.set_dtype(mx.float32) before linear_to_lora_layers)"}
    (out / "curve.json").write_text(json.dumps(info, indent=1) + "\n")
    return info


def option_run(root, tiny, name, spec):
    base_spec = RUNS["llama-4bit-g64"]
    base = tiny / base_spec["base"]
    init = dict(mx.load(str(root / "train-llama-4bit-g64" / "init" / "adapters.safetensors")))
    lora_spec = dict(base_spec, lora_parameters=spec.get("lora_parameters", base_spec["lora_parameters"]))
    model, tok = fp32_model(base, lora_spec, init, spec.get("seed"))
    train_set, valid_set = datasets(root, tok)
    scratch = root / "options" / f"{name}.scratch"
    scratch.mkdir(parents=True, exist_ok=True)
    accumulation = spec.get("grad_accumulation_steps", 1)
    args = TrainingArgs(batch_size=BATCH, iters=OPTION_ITERS, val_batches=VAL_BATCHES, steps_per_report=1,
                        steps_per_eval=5, steps_per_save=10 ** 9, max_seq_length=MAX_SEQ,
                        adapter_file=str(scratch / "adapters.safetensors"), grad_accumulation_steps=accumulation)
    # as mlx_lm.lora's train_model builds them
    lr = build_schedule(spec["lr_schedule"]) if spec.get("lr_schedule") else spec["learning_rate"]
    optimizer = OPTIMIZERS[spec["optimizer"]](learning_rate=lr, **spec.get("optimizer_config", {}))
    rec = Record()
    np.random.seed(SEED)
    train(model=model, optimizer=optimizer, train_dataset=train_set, val_dataset=valid_set, args=args,
          training_callback=rec)
    shutil.rmtree(scratch)
    info = {"options": spec, "base_run": "train-llama-4bit-g64", "iters": OPTION_ITERS, "steps_per_eval": 5,
            "val_batches": VAL_BATCHES, "train": rec.train, "val": rec.val}
    out = root / "options" / f"{name}.json"
    out.write_text(json.dumps(info, indent=1) + "\n")
    return info


def optimizer_steps(root):
    rng = np.random.default_rng(SEED)
    draw = lambda shape: rng.standard_normal(shape).astype(np.float32)
    start = {k: draw(shape) * 0.1 for k, shape in OPTIMIZER_SHAPES.items()}
    grads = [{k: draw(shape) for k, shape in OPTIMIZER_SHAPES.items()} for _ in range(OPTIMIZER_STEP_COUNT)]
    runs = []
    for config in OPTIMIZER_STEPS:
        optimizer = OPTIMIZERS[config["optimizer"]](learning_rate=config["learning_rate"],
                                                    **config["optimizer_config"])
        params = tree_unflatten([(k, mx.array(v)) for k, v in start.items()])
        after = []
        for g in grads:
            params = optimizer.apply_gradients(tree_unflatten([(k, mx.array(v)) for k, v in g.items()]), params)
            after.append({k: np.array(v).reshape(-1).tolist() for k, v in tree_flatten(params)})
        runs.append({**config, "after": after})
    table = {"shapes": OPTIMIZER_SHAPES, "start": {k: v.reshape(-1).tolist() for k, v in start.items()},
             "grads": [{k: v.reshape(-1).tolist() for k, v in g.items()} for g in grads], "runs": runs}
    (root / "optimizer-steps.json").write_text(json.dumps(table) + "\n")


def schedule_tables(root):
    steps = mx.arange(SCHEDULE_STEPS + 1, dtype=mx.uint64)
    tables = []
    for config in SCHEDULES:
        schedule = build_schedule(config)
        tables.append({"lr_schedule": config, "values": [schedule(s).item() for s in steps]})
    (root / "schedules.json").write_text(json.dumps(tables) + "\n")


def main():
    tiny = Path(sys.argv[1] if len(sys.argv) > 1 else "tests/fixtures/tiny")
    root = Path(sys.argv[2] if len(sys.argv) > 2 else "tests/fixtures/lora")
    make_data(root)
    _, tok = load(str(tiny / "llama-4bit-g64"))
    sets = {}
    for name, mask in (("data/train", False), ("data/train", True), ("data-completions/train", False),
                       ("data-completions/train", True), ("data-text/train", False)):
        sets[f"{name}.jsonl mask_prompt={mask}"] = processed(root / f"{name}.jsonl", tok, mask)
    (root / "datasets.json").write_text(json.dumps(sets) + "\n")
    schedule_tables(root)
    optimizer_steps(root)
    for name in sys.argv[3:] or [*RUNS, *OPTION_RUNS]:
        if name in OPTION_RUNS:
            info = option_run(root, tiny, name, OPTION_RUNS[name])
            print(f"{name}: train {[round(l, 4) for _, l, *_ in info['train']]}; "
                  f"lr {[f'{r[3]:.3g}' for r in info['train']]}; val {[round(v, 4) for _, v in info['val']]}",
                  flush=True)
            continue
        spec = RUNS[name]
        base, out = tiny / spec["base"], root / f"train-{name}"
        if out.exists():
            shutil.rmtree(out)
        init = make_init(base, out / "init", spec)
        loss, ntoks = first_step(root, base, spec, init, out)
        info = curve(root, base, spec, init, out)
        print(f"{name}: first-step loss {loss:.6f} over {ntoks} tokens; train {info['train'][0][1]:.4f} -> "
              f"{info['train'][-1][1]:.4f}; val {[round(v, 4) for _, v in info['val']]}; "
              f"full val of final {info['final_full_val_loss']:.4f}", flush=True)


if __name__ == "__main__":
    main()
