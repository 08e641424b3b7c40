"""mlx-lm on the GPU (MLX's CUDA backend), on the same MLX checkpoints oxlm reads: prefill of a
512- and a 2048-token prompt, then greedy tokens through mlx-lm's own generation loops, for one
sequence (`generate_step`, as `mlx_lm.generate` decodes) and for several (`batch_generate`, as
`mlx_lm.server` batches), with random prompts.

The synthetic checkpoints carry no tokenizer, and these loops need none: the model is loaded
with `mlx_lm.utils.load_model`, and `batch_generate` gets a stand-in that has no end-of-sequence
ids, so every sequence decodes all its tokens.

usage: python3 benches/gpu/mlx_lm_bench.py MODEL_DIR [--gen 128] [--batch 1 8 32 64] [--repeats 2]
Prints one JSON line per prompt length (one sequence) and per batch, in the fields `oxlm bench`
prints.
"""
import argparse
import json
import statistics
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.generate import batch_generate, generate_step
from mlx_lm.utils import load_model


class NoTokenizer:
    """What `batch_generate` asks of a tokenizer: no ids end a sequence, and no text is made."""

    eos_token_ids = []

    @staticmethod
    def decode(_ids):
        return ""


def one_sequence(model, prompts, gen):
    """(prefill tok/s, decode tok/s) of prompts[0]: the first token comes from the prefill."""
    prompt = prompts[0]
    t0 = time.perf_counter()
    steps = generate_step(mx.array(prompt), model, max_tokens=gen)
    next(steps)
    t1 = time.perf_counter()
    for _ in steps:
        pass
    t2 = time.perf_counter()
    return len(prompt) / (t1 - t0), (gen - 1) / (t2 - t1)


def batched(model, prompts, gen):
    """(prefill tok/s, decode tok/s) of all the prompts decoded together."""
    n = len(prompts)
    stats = batch_generate(model, NoTokenizer(), prompts, max_tokens=gen,
                           completion_batch_size=n, prefill_batch_size=n).stats
    return stats.prompt_tps, stats.generation_tps


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--batch", type=int, nargs="*", default=[8, 32, 64])
    ap.add_argument("--repeats", type=int, default=2)
    a = ap.parse_args()
    model, config = load_model(Path(a.model))
    vocab = config["vocab_size"]
    mx.random.seed(0)
    device = str(mx.default_device())
    cases = [(1, p, one_sequence) for p in (512, 2048)] + [(b, 512, batched) for b in a.batch]
    for sequences, prompt_tokens, measure in cases:
        runs = []
        for rep in range(a.repeats + 1):
            prompts = mx.random.randint(0, vocab, (sequences, prompt_tokens)).tolist()
            result = measure(model, prompts, a.gen)
            if rep:  # the first is a warm-up
                runs.append(result)
        print(json.dumps({"engine": "mlx-lm", "device": device, "model": a.model,
                          "sequences": sequences, "prompt_tokens": prompt_tokens,
                          "prefill_tps": statistics.median(r[0] for r in runs),
                          "decode_tps": statistics.median(r[1] for r in runs)}), flush=True)


if __name__ == "__main__":
    main()
