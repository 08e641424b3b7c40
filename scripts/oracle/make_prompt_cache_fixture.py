"""Prompt-cache goldens: what `mlx_lm.cache_prompt` writes and what `mlx_lm generate --prompt-cache-file` makes
of it, on tiny models with fp32 activations (as make_goldens.py runs them).

usage: PY=$(scripts/oracle/venv.sh); $PY scripts/oracle/make_prompt_cache_fixture.py   (from the repository root)

Writes tests/fixtures/prompt_cache/
  <name>.safetensors  for each model of GOLDEN but those of NO_FILE, each of QUANTIZED (with mlx_lm.cache_prompt's
                      --kv-bits) and each of MAX_KV_SIZE (with its --max-kv-size): mlx_lm.cache_prompt's file for
                      PROMPT (the procedure of cache_prompt.main: chat template with continue_final_message=True,
                      make_prompt_cache(model, max_kv_size), generate_step(max_tokens=0), save_prompt_cache with its
                      metadata), the model loaded by its repository-relative path, which the file's `model`
                      metadata names
  golden.json         per model: the cached prompt's ids, then generate.main's procedure with that file and
                      SECOND: the suffix text (the template's rendering from the `<query>` position on), its
                      ids, the greedy ids until an eos token (or STEPS) with each step's top1-top2 margin,
                      and their text; plus, for every tiny model, mlx-lm's cache classes and the dtype and
                      shape and L2 norm of each array of its state after PROMPT (the layout and, roughly, the values oxlm's files
                      must have).
Everything in fp32: model.set_dtype(float32) after mlx_lm.load, so the cache holds f32 keys and values (oxlm's
`--kv-cache f32`). Deterministic: rerunning gives identical bytes.
"""
import json
import re
import tempfile
from importlib.metadata import version
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm import load
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import load_prompt_cache, make_prompt_cache, save_prompt_cache
from mlx_lm.utils import load_model, load_tokenizer

ROOT = Path("tests/fixtures/tiny")
OUT = Path("tests/fixtures/prompt_cache")
# One model per cache kind: KVCache; RotatingKVCache (window 8 < the prompt) with KVCache; ArraysCache
# (short convolution) with KVCache; ArraysCache (gated DeltaNet) with KVCache; and Ministral 3 in the
# mistral3 wrapper, a sliding-window layer that mlx-lm keeps in a whole KVCache (the wrapper makes no caches
# of its own) where oxlm keeps a ring.
GOLDEN = ["llama-4bit-g64", "gemma3-4bit-g64", "lfm2-4bit-g64", "qwen3_5-4bit-g64", "ministral3-4bit-g32"]
# Files over 200 KB (two f32 KVCache layers of 32-wide heads, 256 positions each) are not kept: their
# tokens are, for oxlm's own files to reproduce.
NO_FILE = ["qwen3_5-4bit-g64"]
# mlx-lm's QuantizedKVCache: cache_prompt.main with --kv-bits, --kv-group-size and --quantized-kv-start (0: the
# cache is quantized after all but the last prompt token), on a model whose heads (32) take groups of 32; the
# file is named <model>-kv<bits>-g<group>.
QUANTIZED = [("qwen3-8bit-g128", 4, 32, 0)]
# mlx-lm's RotatingKVCache(max_kv_size, keep=4) on every layer: cache_prompt.main with --max-kv-size, on a model type
# whose mlx-lm model makes no caches of its own, for a window shorter than the cached prompt (44 tokens: the ring cut
# to its first 4 positions and its last 12, wrapped past the kept slots) and one longer (the ring grown to the
# window); the file is named <model>-max-kv<size>.
MAX_KV_SIZE = [("qwen3-8bit-g128", 16), ("qwen3-8bit-g128", 48)]
PROMPT = "Tell me about the sea. It is big and blue, and its waves are loud at night."
SECOND = "Now write one sentence about it, please."
STEPS = 24


def dump_json(obj, path):
    """indent=1, but lists of numbers stay on one line (as make_goldens.py writes)."""
    text = json.dumps(obj, ensure_ascii=False, indent=1)
    text = re.sub(r"\[\s*([-0-9.e,\s]+?)\s*\]", lambda m: "[" + ", ".join(m.group(1).split()).replace(",,", ",") + "]", text)
    path.write_text(text + "\n", encoding="utf-8")
    assert json.loads(path.read_text(encoding="utf-8")) == obj


def load_fp32(path):
    try:
        model, tok = load(str(path))
    except TypeError:
        # as make_goldens.py: transformers' config class rejects some of mlx-lm's keys (EXAONE 4)
        model, _ = load_model(Path(path))
        tok = load_tokenizer(Path(path).parent / "tokenizer")
    model.set_dtype(mx.float32)
    return model, tok


def cached_prompt(tok, prompt):
    """The ids cache_prompt.main runs through the model."""
    if tok.has_chat_template:
        messages = [{"role": "user", "content": prompt}]
        return tok.apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True)
    return tok.encode(prompt)


def run_prompt(model, ids, max_kv_size=None, **quantized):
    cache = make_prompt_cache(model, max_kv_size)
    for _ in generate_step(mx.array(ids), model, max_tokens=0, prompt_cache=cache, **quantized):
        pass
    return cache


def layout(cache):
    layers = []
    for c in cache:
        # each array's type, shape and L2 norm (which catches keys held at another scale)
        arrays = {k: [str(v.dtype).removeprefix("mlx.core."), list(v.shape),
                      round(float(np.linalg.norm(np.array(v, dtype=np.float64))), 6)]
                  if isinstance(v, mx.array) else repr(v)
                  for k, v in tree_flatten(c.state)}
        layers.append({"class": type(c).__name__, "state": arrays})
    return layers


def suffix(tok, prompt):
    """generate.main's prompt with a prompt cache: the template's rendering of the new message, from where the
    message starts (the cached prompt is its prefix), encoded without special tokens."""
    if not tok.has_chat_template:
        return prompt, tok.encode(prompt, add_special_tokens=True)
    messages = [{"role": "user", "content": prompt}]
    text = tok.apply_chat_template(messages, tokenize=False, continue_final_message=False, add_generation_prompt=True)
    messages[-1]["content"] = "<query>"
    test = tok.apply_chat_template(messages, tokenize=False, continue_final_message=False, add_generation_prompt=True)
    text = text[test.index("<query>"):]
    return text, tok.encode(text, add_special_tokens=False)


def greedy_after(model, tok, file, ids):
    cache = load_prompt_cache(str(file))
    out, margins = [], []
    for token, logprobs in generate_step(mx.array(ids), model, max_tokens=STEPS, prompt_cache=cache):
        s = np.sort(np.array(logprobs.astype(mx.float32)))
        margins.append(round(float(s[-1] - s[-2]), 6))
        if token in tok.eos_token_ids:
            break
        out.append(token)
    return out, margins


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    scratch = tempfile.TemporaryDirectory()
    golden = {"prompt": PROMPT, "second": SECOND, "steps": STEPS, "models": {}, "layouts": {},
              "versions": {p: version(p) for p in ("mlx", "mlx-lm", "transformers", "tokenizers")}}
    runs = [(name, name, {}) for name in GOLDEN] + [
        (f"{name}-kv{bits}-g{group}", name, dict(kv_bits=bits, kv_group_size=group, quantized_kv_start=start))
        for name, bits, group, start in QUANTIZED] + [
        (f"{name}-max-kv{size}", name, dict(max_kv_size=size)) for name, size in MAX_KV_SIZE]
    for stem, name, flags in runs:
        path = ROOT / name
        model, tok = load_fp32(path)
        ids = cached_prompt(tok, PROMPT)
        cache = run_prompt(model, ids, **flags)
        file = OUT / f"{stem}.safetensors"
        if name in NO_FILE:
            file = Path(scratch.name) / file.name
        # cache_prompt.main's metadata: the --model argument as given, and its tokenizer_config
        save_prompt_cache(str(file), cache, {"model": str(path), "tokenizer_config": json.dumps({"trust_remote_code": False})})
        text, second = suffix(tok, SECOND)
        out, margins = greedy_after(model, tok, file, second)
        golden["models"][stem] = {
            "file": name not in NO_FILE, "cached_ids": list(ids), "suffix_text": text, "suffix_ids": second,
            "greedy_ids": out, "greedy_text": tok.decode(out), "margins": margins, "min_margin": min(margins),
            **flags,
        }
        print(f"{stem}: {len(ids)} cached + {len(second)} tokens -> {out} {tok.decode(out)!r}"
              f" (min margin {min(margins):.4f}, {file.stat().st_size} bytes)", flush=True)
    for path in sorted(p for p in ROOT.iterdir() if (p / "config.json").exists()):
        model, tok = load_fp32(path)
        cache = run_prompt(model, cached_prompt(tok, PROMPT))
        # Llama 4's chunked caches have no file form: save_prompt_cache fails on them (oxlm refuses them too).
        if not any(type(c).__name__ == "ChunkedKVCache" for c in cache):
            golden["layouts"][path.name] = layout(cache)
    dump_json(golden, OUT / "golden.json")
    scratch.cleanup()


if __name__ == "__main__":
    main()
