"""Preference-training goldens for `oxlm lora --train-mode dpo|orpo`: a small preference data set, what
mlx-lm-lora's DPODataset makes of it, and the DPO (each --dpo-cpo-loss-type) and ORPO losses of a fixed batch
with the gradient of a few adapter entries, computed by the numpy forward of numpy_reference.py in float64.

usage: PY=$(scripts/oracle/venv.sh); $PY scripts/oracle/make_preference_fixture.py [TINY_ROOT] [OUT_ROOT]
  TINY_ROOT default tests/fixtures/tiny, OUT_ROOT default tests/fixtures/lora

Writes
  OUT_ROOT/data-preference/{train,valid,test}.jsonl   rows of prompt / chosen / rejected from GPL-3 sentences (one
                                                     with a system turn, one whose answers are message lists)
  OUT_ROOT/preference.json                           per file, each row as DPODataset tokenizes it: [chosen ids,
                                                     rejected ids, prompt length]; and for train-llama-4bit-g64's
                                                     starting adapter on llama-4bit-g64 and the batch of train
                                                     rows PAIRS: each answer's summed log-probability under the
                                                     adapters (policy) and without them (the reference: adapters at
                                                     scale 0), the mean DPO (sigmoid) and ORPO losses at BETA, and
                                                     their derivatives with respect to the entries GRAD_ENTRIES by
                                                     central differences (step FD_STEP); and the same of DPO's
                                                     other loss types (dpo_hinge, dpo_ipo, dpo_dpop at DELTA), in
                                                     their own keys `{key}_loss` and `dpo_loss_type_grads`

The losses follow mlx-lm-lora 5.10.2 (trainer/dpo_trainer.py `dpo_loss` with loss_type sigmoid, hinge, ipo and
dpop, scores summed over answer tokens, for ipo divided by them (`compute_score`); trainer/orpo_trainer.py
`get_logps` and `orpo_loss`, log-probabilities averaged over answer tokens, preference_score 1); an answer's
tokens are those after the rendered prompt (chat template with the generation prompt) up to the end of its
sequence; they are the tokens mlx-lm-lora's `mask[:, 1:]` counts. A few seconds.
"""
import json
import re
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm import load

from numpy_reference import forward

BETA = 0.1
DELTA = 50.0
LOSS_TYPES = ["hinge", "ipo", "dpop"]  # DPO's but sigmoid
MODEL = "llama-4bit-g64"
ADAPTER = "train-llama-4bit-g64/init"
PAIRS = [0, 1, 2]
FD_STEP = 1e-5
GRAD_ENTRIES = [
    ("model.layers.0.self_attn.q_proj.lora_a", (5, 2)),
    ("model.layers.0.self_attn.k_proj.lora_b", (6, 9)),
    ("model.layers.0.mlp.down_proj.lora_b", (3, 17)),
    ("model.layers.1.self_attn.v_proj.lora_b", (1, 4)),
    ("model.layers.1.self_attn.o_proj.lora_a", (7, 0)),
    ("model.layers.1.mlp.gate_proj.lora_a", (40, 6)),
]


def sentences():
    text = Path("/usr/share/common-licenses/GPL-3").read_text()
    parts = [re.sub(r"\s+", " ", s).strip() for s in re.split(r"(?<=[.;:])\s+", text)]
    return [s for s in parts if 20 <= len(s) <= 120]


def make_rows():
    """Prompt: a sentence; chosen: the one after it; rejected: a sentence from far away."""
    s = sentences()
    rows = []
    for i in range(16):
        row = {"prompt": s[2 * i], "chosen": s[2 * i + 1], "rejected": s[-1 - 3 * i]}
        if i == 1:
            row = {"system": "Continue the text.", **row}
        if i == 2:
            row["chosen"] = [{"role": "assistant", "content": row["chosen"]}]
            row["rejected"] = [{"role": "assistant", "content": row["rejected"]}]
        rows.append(row)
    return {"train": rows[:8], "valid": rows[8:12], "test": rows[12:]}


def template(tok, messages, generation_prompt):
    return list(tok.apply_chat_template(messages, add_generation_prompt=generation_prompt, return_dict=False))


def tokenize(tok, row):
    """DPODataset's item; an answer given as a message list follows the prompt as those messages (ORPODataset's
    system-key branch)."""
    prompt = ([{"role": "system", "content": row["system"]}] if "system" in row else []) + [
        {"role": "user", "content": row["prompt"]}]

    def answer(value):
        turns = value if isinstance(value, list) else [{"role": "assistant", "content": value}]
        return template(tok, prompt + turns, False)

    return [answer(row["chosen"]), answer(row["rejected"]), len(template(tok, prompt, True))]


def log_prob_sum(model_dir, ids, prompt_len, lora):
    """The summed log-probability of ids[max(prompt_len, 1):] given what precedes each token."""
    logits = forward(model_dir, ids[:-1], lora, np.float64)
    logits = logits - logits.max(-1, keepdims=True)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    return sum(logp[t - 1, ids[t]] for t in range(max(prompt_len, 1), len(ids)))


def log_sigmoid(x):
    return -np.logaddexp(0.0, -x)


def log1mexp(x):
    x = min(x, -1e-7)
    return np.log(-np.expm1(x)) if x > -np.log(2) else np.log1p(-np.exp(x))


def dpo_loss(policy, reference):
    return np.mean([-log_sigmoid(BETA * ((pc - pr) - (rc - rr))) for (pc, pr), (rc, rr) in zip(policy, reference)])


def dpo_type_loss(loss_type, policy, reference, tokens):
    """`dpo_loss` of `loss_type` over the scores `compute_score` makes: ipo's per scored token."""
    losses = []
    for (pc, pr), (rc, rr), (nc, nr) in zip(policy, reference, tokens):
        if loss_type == "ipo":
            pc, rc, pr, rr = pc / max(nc, 1), rc / max(nc, 1), pr / max(nr, 1), rr / max(nr, 1)
        z = (pc - pr) - (rc - rr)
        if loss_type == "hinge":
            losses.append(max(1 - BETA * z, 0.0))
        elif loss_type == "ipo":
            losses.append((z - 1 / (2 * BETA)) ** 2)
        elif loss_type == "dpop":
            losses.append(-(log_sigmoid(BETA * z) - DELTA * max(0.0, rc - pc)))
    return np.mean(losses)


def orpo_loss(policy, tokens):
    losses = []
    for (pc, pr), (nc, nr) in zip(policy, tokens):
        c, r = pc / nc, pr / nr
        log_odds = (c - r) - (log1mexp(c) - log1mexp(r))
        losses.append(-c - BETA * log_sigmoid(log_odds))
    return np.mean(losses)


def main():
    tiny = Path(sys.argv[1] if len(sys.argv) > 1 else "tests/fixtures/tiny")
    out = Path(sys.argv[2] if len(sys.argv) > 2 else "tests/fixtures/lora")
    model_dir = tiny / MODEL
    _, tok = load(str(model_dir))
    golden = {"data": {}}
    for split, rows in make_rows().items():
        path = out / "data-preference" / f"{split}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        golden["data"][f"data-preference/{split}.jsonl"] = [tokenize(tok, r) for r in rows]
    items = [golden["data"]["data-preference/train.jsonl"][i] for i in PAIRS]

    config = json.loads((out / ADAPTER / "adapter_config.json").read_text())
    weights = {k: np.array(v, np.float64) for k, v in mx.load(str(out / ADAPTER / "adapters.safetensors")).items()}
    scale = config["lora_parameters"]["scale"]

    def lora_of(w):
        layers = {k[: -len(".lora_a")] for k in w if k.endswith(".lora_a")}
        return {n: (w[n + ".lora_a"], w[n + ".lora_b"]) for n in layers}, scale

    def policy_sums(w):
        return [[log_prob_sum(model_dir, ids, p, lora_of(w)) for ids in (c, r)] for c, r, p in items]

    reference = [[log_prob_sum(model_dir, ids, p, None) for ids in (c, r)] for c, r, p in items]
    tokens = [[len(ids) - max(p, 1) for ids in (c, r)] for c, r, p in items]
    policy = policy_sums(weights)
    grads, type_grads = [], []
    for name, index in GRAD_ENTRIES:
        slopes = []
        for sign in (1, -1):
            w = dict(weights)
            w[name] = weights[name].copy()
            w[name][index] += sign * FD_STEP
            p = policy_sums(w)
            slopes.append((dpo_loss(p, reference), orpo_loss(p, tokens),
                           *(dpo_type_loss(t, p, reference, tokens) for t in LOSS_TYPES)))
        d = [(plus - minus) / (2 * FD_STEP) for plus, minus in zip(*slopes)]
        grads.append({"array": name, "index": list(index), "dpo": d[0], "orpo": d[1]})
        type_grads.append({"array": name, "index": list(index),
                           **{f"dpo_{t}": v for t, v in zip(LOSS_TYPES, d[2:])}})
        print(f"{name}{list(index)}: d dpo {d[0]:.6e}, d orpo {d[1]:.6e}, "
              + ", ".join(f"d {t} {v:.6e}" for t, v in zip(LOSS_TYPES, d[2:])))
    golden.update({
        "model": MODEL, "adapter": ADAPTER, "pairs": PAIRS, "beta": BETA, "fd_step": FD_STEP,
        "policy_log_prob_sums": policy, "reference_log_prob_sums": reference, "answer_tokens": tokens,
        "dpo_loss": dpo_loss(policy, reference), "orpo_loss": orpo_loss(policy, tokens),
        # The other loss types come before `grads`, so that the keys above stay as they were.
        "delta": DELTA, **{f"dpo_{t}_loss": dpo_type_loss(t, policy, reference, tokens) for t in LOSS_TYPES},
        "dpo_loss_type_grads": type_grads, "grads": grads,
    })
    print(f"dpo {golden['dpo_loss']:.8f}, orpo {golden['orpo_loss']:.8f}, "
          + ", ".join(f"{t} {golden[f'dpo_{t}_loss']:.8f}" for t in LOSS_TYPES))
    lines = (f" {json.dumps(key)}: {json.dumps(value)}" for key, value in golden.items())
    (out / "preference.json").write_text("{\n" + ",\n".join(lines) + "\n}\n")


if __name__ == "__main__":
    main()
