"""Greedy-decoding goldens for a real MLX model, from Python mlx-lm (the parity oracle).

usage: PY=$(scripts/oracle/venv.sh)
       $PY scripts/oracle/real_goldens.py MODEL_DIR OUT.safetensors [--steps 32] [--completion]
           [--kv-bits 8 [--kv-group-size 64] [--quantized-kv-start N]]
  e.g. $PY scripts/oracle/real_goldens.py "$(scripts/models/fetch_models.sh smollm2)" \
           tests/fixtures/real/smollm2-135m-instruct-4bit.safetensors
Writes OUT.safetensors and a sidecar OUT.json (same stem).

For each prompt i (one user turn), exactly as `mlx_lm generate` prepares it:
  text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
  ids  = tokenizer.encode(text, add_special_tokens=False)
or, with --completion (base models), plain text as `mlx_lm generate --ignore-chat-template` encodes it:
  ids  = tokenizer.encode(text)
The completion prompts end with the opening of the GPL-3 (Debian's /usr/share/common-licenses/GPL-3,
about 700 tokens), longer than Gemma 3's 512-token sliding window; the sidecar keeps every prompt's text.
then, with fp32 activations (model.set_dtype(mx.float32): quantized weights unchanged, scales/biases/norms
upcast) and the mlx-lm KV cache (make_prompt_cache): one forward over the whole prompt, then one token per
step, greedy (argmax), for --steps steps, without stopping at eos. With --kv-bits, the cache is mlx-lm's
quantized one from the first token (to_quantized(group_size, bits)); with --quantized-kv-start too, it is
quantized where generate_step quantizes it (maybe_quantize_kv_cache): all but the last prompt token go
through first, then the last alone, then one token per step, the cache checked after each. Stored:
  p{i}.prompt_ids   int32 [n_prompt]
  p{i}.greedy_ids   int32 [steps]
  p{i}.first_logits f32   [vocab]    logits at the last prompt position (those that pick greedy_ids[0])
  p{i}.step_top2    f32   [steps, 2] top-1 and top-2 logit values at each step (step 0 = first_logits)
The sidecar holds the messages, rendered prompt text, decoded outputs, eos ids, per-step margins and versions.
Also checks that mlx_lm.generate.generate_step (argmax sampler) yields the same ids (the sidecar records it).
"""
import argparse
import hashlib
import json
import os
import platform
import time

import mlx.core as mx
import mlx_lm
import numpy as np
from mlx_lm import load
from mlx_lm.generate import generate_step, maybe_quantize_kv_cache
from mlx_lm.models.cache import make_prompt_cache

PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that returns the square of a number.",
    "I have two apples and buy three more. Then I eat one of them. How many apples do I have left? "
    "Explain your reasoning step by step.",
]

COMPLETION_PROMPTS = [
    "The capital of France is",
    'def square(x):\n    """Return the square of x."""\n',
    open("/usr/share/common-licenses/GPL-3", encoding="utf-8").read()[:3000],
]

ap = argparse.ArgumentParser()
ap.add_argument("model_dir")
ap.add_argument("out")
ap.add_argument("--steps", type=int, default=32)
ap.add_argument("--completion", action="store_true", help="plain-text prompts (base models), no chat template")
ap.add_argument("--no-check", action="store_true", help="skip the generate_step cross-check")
ap.add_argument("--kv-bits", type=int, default=None, help="quantized KV cache of these bits")
ap.add_argument("--kv-group-size", type=int, default=64)
ap.add_argument("--quantized-kv-start", type=int, default=None,
                help="quantize as generate_step does, from this many tokens (default: from the first token)")
args = ap.parse_args()


def maybe_quantize(cache):
    if args.quantized_kv_start is not None:
        maybe_quantize_kv_cache(cache, args.quantized_kv_start, args.kv_group_size, args.kv_bits)

t_all = time.time()
model, tok = load(args.model_dir)
model.set_dtype(mx.float32)
cfg = json.load(open(os.path.join(args.model_dir, "config.json")))

arrays, records = {}, []
for i, prompt in enumerate(COMPLETION_PROMPTS if args.completion else PROMPTS):
    t0 = time.time()
    if args.completion:
        messages, text = None, prompt
        ids = tok.encode(text)
    else:
        messages = [{"role": "user", "content": prompt}]
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = tok.encode(text, add_special_tokens=False)
    cache = make_prompt_cache(model)
    if args.kv_bits and args.quantized_kv_start is None:
        cache = [c.to_quantized(group_size=args.kv_group_size, bits=args.kv_bits) for c in cache]
        logits = model(mx.array([ids]), cache=cache)[0, -1].astype(mx.float32)
    elif args.kv_bits:
        model(mx.array([ids[:-1]]), cache=cache)
        maybe_quantize(cache)
        logits = model(mx.array([ids[-1:]]), cache=cache)[0, -1].astype(mx.float32)
        maybe_quantize(cache)
    else:
        logits = model(mx.array([ids]), cache=cache)[0, -1].astype(mx.float32)
    first_logits, out_ids, top2 = None, [], []
    for step in range(args.steps):
        mx.eval(logits)
        if first_logits is None:
            first_logits = np.array(logits)
        nxt = int(mx.argmax(logits))
        srt = mx.sort(logits)
        top2.append([float(srt[-1]), float(srt[-2])])
        out_ids.append(nxt)
        if step + 1 < args.steps:
            logits = model(mx.array([[nxt]]), cache=cache)[0, -1].astype(mx.float32)
            maybe_quantize(cache)
    t_ref = time.time() - t0
    check = None
    if not args.no_check:
        gen = []
        quantized = dict(kv_bits=args.kv_bits, kv_group_size=args.kv_group_size,
                         quantized_kv_start=args.quantized_kv_start or 0) if args.kv_bits else {}
        for (tok_id, _), _n in zip(generate_step(mx.array(ids), model, max_tokens=args.steps,
                                                 sampler=lambda x: mx.argmax(x, axis=-1), **quantized),
                                   range(args.steps)):
            gen.append(int(tok_id))
        check = {"generate_step_ids_equal": gen == out_ids,
                 "first_mismatch": next((k for k, (a, b) in enumerate(zip(gen, out_ids)) if a != b), None)}
    eos = sorted(tok.eos_token_ids)
    cut = next((k for k, t in enumerate(out_ids) if t in eos), len(out_ids))
    margins = [a - b for a, b in top2]
    rec = {
        "index": i, "messages": messages, "prompt_text": text, "n_prompt": len(ids),
        "greedy_ids": out_ids, "decoded": tok.decode(out_ids),
        "decoded_until_eos": tok.decode(out_ids[:cut]), "eos_step": cut if cut < len(out_ids) else None,
        "top1_top2_margins": [round(m, 4) for m in margins],
        "min_top1_top2_margin": min(margins), "argmin_margin_step": int(np.argmin(margins)),
        "seconds": round(t_ref, 1), "generate_step_check": check,
    }
    records.append(rec)
    print(f"[{i}] {len(ids)} prompt tokens, {t_ref:.1f}s, min margin {rec['min_top1_top2_margin']:.4f}, "
          f"check {check}: {rec['decoded']!r}", flush=True)
    arrays[f"p{i}.prompt_ids"] = mx.array(ids, dtype=mx.int32)
    arrays[f"p{i}.greedy_ids"] = mx.array(out_ids, dtype=mx.int32)
    arrays[f"p{i}.first_logits"] = mx.array(first_logits, dtype=mx.float32)
    arrays[f"p{i}.step_top2"] = mx.array(top2, dtype=mx.float32)

os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
mx.save_safetensors(args.out, arrays, metadata={"format": "mlx", "generator": "scripts/oracle/real_goldens.py"})


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for b in iter(lambda: f.read(1 << 20), b""):
            h.update(b)
    return h.hexdigest()


import tokenizers, transformers  # noqa: E402

weights = sorted(f for f in os.listdir(args.model_dir) if f.startswith("model") and f.endswith(".safetensors"))
side = {
    "model": os.path.basename(os.path.normpath(args.model_dir)),
    "model_files_sha256": {f: sha256(os.path.join(args.model_dir, f)) for f in weights},
    "quantization": cfg.get("quantization"),
    "activations": "float32 (model.set_dtype(mx.float32) after mlx_lm.load)",
    "kv_cache": (f"quantized, {args.kv_bits} bits, group size {args.kv_group_size}, "
                 + (f"from {args.quantized_kv_start} tokens as generate_step quantizes it"
                    if args.quantized_kv_start is not None else "from the first token"))
                if args.kv_bits else "mlx-lm's default",
    "kv_bits": args.kv_bits, "kv_group_size": args.kv_group_size, "quantized_kv_start": args.quantized_kv_start,
    "procedure": ("encode(text) (plain completion)" if args.completion else
                  "apply_chat_template(tokenize=False, add_generation_prompt=True) -> encode(add_special_tokens=False)")
                 + ("; all but the last prompt token, then the last, with make_prompt_cache"
                    if args.kv_bits and args.quantized_kv_start is not None
                    else "; one forward over the whole prompt with make_prompt_cache")
                 + ", then 1 token/step; greedy argmax;"
                 f" {args.steps} steps, no eos stop",
    "steps": args.steps, "eos_token_ids": sorted(tok.eos_token_ids), "vocab_logits": int(first_logits.shape[0]),
    "arrays": {"p{i}.prompt_ids": "int32 [n]", "p{i}.greedy_ids": f"int32 [{args.steps}]",
               "p{i}.first_logits": "f32 [vocab]", "p{i}.step_top2": f"f32 [{args.steps}, 2] (top1, top2)"},
    "versions": {"mlx": mx.__version__, "mlx_lm": mlx_lm.__version__, "transformers": transformers.__version__,
                 "tokenizers": tokenizers.__version__, "numpy": np.__version__, "python": platform.python_version(),
                 "machine": platform.machine()},
    "prompts": records,
    "total_seconds": round(time.time() - t_all, 1),
}
stem = args.out[: -len(".safetensors")] if args.out.endswith(".safetensors") else args.out
json.dump(side, open(stem + ".json", "w"), indent=2, ensure_ascii=False)
print(f"wrote {args.out} ({os.path.getsize(args.out) / 1e6:.2f} MB) and {stem}.json in {side['total_seconds']}s")
