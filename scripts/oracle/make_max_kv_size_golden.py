"""`--max-kv-size` goldens: mlx_lm's `generate_step(prompt, model, max_kv_size=16)` on the tiny
qwen3 (a model type whose cache mlx-lm bounds: every layer a `RotatingKVCache(16, keep=4)`), for a
47-token prompt, greedy, fp32 activations as make_goldens.py's, with the whole prompt in one
prefill chunk and in chunks of 7 (the chunks past the window see the kept positions as
mlx-lm's mask over its array lets them). Writes `max_kv_size.json` beside the model: per run the
prefill step, the greedy tokens and, at a few steps, the whole row of log-probabilities.
`PY=$(scripts/oracle/venv.sh); $PY scripts/oracle/make_max_kv_size_golden.py`"""
import json
import sys
from pathlib import Path

import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import generate_step

MODEL = Path(__file__).resolve().parents[2] / "tests/fixtures/tiny/qwen3-8bit-g128"
MAX_KV_SIZE, STEPS, ROWS = 16, 24, [0, 1, 8, 23]
PROMPT = "The history of the city begins with a small harbour, where fishermen sold what the sea gave them"


def run(model, ids, prefill_step):
    tokens, rows = [], {}
    steps = generate_step(mx.array(ids), model, max_tokens=STEPS, max_kv_size=MAX_KV_SIZE,
                          prefill_step_size=prefill_step)
    for i, (token, logprobs) in enumerate(steps):
        tokens.append(int(token))
        if i in ROWS:
            rows[str(i)] = [float(x) for x in logprobs.astype(mx.float32).tolist()]
    return {"prefill_step": prefill_step, "tokens": tokens, "logprobs": rows}


def main():
    model, tokenizer = load(str(MODEL))
    model.set_dtype(mx.float32)
    ids = tokenizer.encode(PROMPT, add_special_tokens=False)
    assert len(ids) > 2 * MAX_KV_SIZE, len(ids)
    out = {"max_kv_size": MAX_KV_SIZE, "prompt_ids": ids,
           "runs": [run(model, ids, 2048), run(model, ids, 7)]}
    (MODEL / "max_kv_size.json").write_text(json.dumps(out) + "\n")
    print(len(ids), "prompt tokens;", [r["tokens"][:8] for r in out["runs"]], file=sys.stderr)


if __name__ == "__main__":
    main()
