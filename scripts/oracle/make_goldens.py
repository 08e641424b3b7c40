"""Golden outputs of the tiny models, computed by mlx-lm itself with fp32 activations.

usage: PY=$(scripts/oracle/venv.sh); $PY scripts/oracle/make_goldens.py [OUT_ROOT] [NAME...]
  OUT_ROOT default tests/fixtures/tiny; NAME default: every model directory under OUT_ROOT (with a config.json)

Writes
  OUT_ROOT/tokenizer/encodings.json   [{"text": str, "ids": [int]}]  ids = mlx-lm TokenizerWrapper.encode(text)
                                       (HF encode, add_special_tokens default True; identical to False here
                                       because the tokenizer has no bos/eos post-processing)
  OUT_ROOT/<name>/golden.safetensors  prompt_ids int32 [n_prompt], greedy_ids int32 [STEPS],
                                       step_logits f32 [STEPS, vocab], prompt_logits f32 [n_prompt, vocab]
  OUT_ROOT/<name>/golden.json         prompt text, rendered prompt, greedy ids/text, per-step top1-top2 margins,
                                       cross-checks, versions
Reference procedure: mlx_lm.load(dir); model.set_dtype(float32) (bf16 weights/scales/biases/norms are upcast
exactly; packed uint32 weights stay); prompt = chat template (add_generation_prompt=True) rendered to text and
encoded with add_special_tokens=False (as `mlx_lm generate` does); cache = make_prompt_cache(model);
logits = model(prompt, cache)[-1]; then STEPS times: record logits, pick argmax (first max on ties), feed that one
token with the cache. EOS never stops the loop. prompt_logits: one forward of the prompt without a cache.
"""
import json
import re
import sys
import unicodedata
from importlib.metadata import version
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load_model, load_tokenizer
from tokenizers import Tokenizer

STEPS = 32
MESSAGES = [{"role": "user", "content": "Write one sentence about the sea, please. 12345"}]
TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "This program is free software: you can redistribute it and/or modify it under the terms of the GNU General Public License",
    "",
    " ",
    "a",
    "Don't you'll I'M we've they'd!!! ??? ... --- ;;",
    "héllo wörld — café, naïve façade; Ünïcödé ñ Ångström",
    "emoji: 🌊🐟 and 👩‍💻 and 🇫🇷 ok",
    "中文字符 日本語の文 한국어 Ελληνικά кириллица",
    "digits 12345 3.14159 007 2024-01-01 1,000,000",
    "  leading spaces,\ttabs\t\tand\n\nnewlines   trailing   ",
    "multi\n\n\n   \n line\r\nwindows",
    "special <|im_start|>user\nhi<|im_end|> and <|endoftext|> inside",
    "<|im_end|><|im_end|>x<|endoftext|>",
    "partial <|im_start and <|im_end| and |>",
    "NFC: cafe\u0301 A\u030angstro\u0308m n\u0303",
    "<|im_start|>user\nWrite one sentence about the sea, please. 12345<|im_end|>\n<|im_start|>assistant\n",
]


def encodings(tokdir):
    tok = load_tokenizer(Path(tokdir))
    raw = Tokenizer.from_file(str(Path(tokdir) / "tokenizer.json"))  # what a tokenizer.json reader sees
    rows = []
    for t in TEXTS:
        ids = tok.encode(t)
        assert ids == tok.encode(t, add_special_tokens=False), t
        assert ids == raw.encode(t, add_special_tokens=True).ids, t
        assert tok.decode(ids) == unicodedata.normalize("NFC", t), (t, tok.decode(ids))
        rows.append({"text": t, "ids": ids})
    dump_json(rows, Path(tokdir) / "encodings.json")
    return rows


def dump_json(obj, path):
    """indent=1, but lists of numbers stay on one line."""
    text = json.dumps(obj, ensure_ascii=False, indent=1)
    text = re.sub(r"\[\s*([-0-9.e,\s]+?)\s*\]", lambda m: "[" + ", ".join(m.group(1).split()).replace(",,", ",") + "]", text)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text + "\n")
    assert json.loads(Path(path).read_text(encoding="utf-8")) == obj


def top2_margin(row):
    s = np.sort(row)
    return float(s[-1] - s[-2])


def flat_rope(cfg):
    """The flat `rope_theta` mlx-lm's llama reads, where transformers 5 keys `rope_parameters` by layer type."""
    full = (cfg.get("rope_parameters") or {}).get("full_attention")
    return {"rope_theta": full["rope_theta"]} if full and "rope_theta" not in cfg else {}


def golden(path, rows):
    try:
        cfg = json.loads((Path(path) / "config.json").read_text())
        model, tok = load(str(path), model_config=flat_rope(cfg))
    except TypeError:
        # transformers' own config class rejects some of mlx-lm's keys (EXAONE 4's string
        # `sliding_window_pattern`): the model alone, with the shared tokenizer's own directory
        model, _ = load_model(Path(path))
        tok = load_tokenizer(Path(path).parent / "tokenizer")
    model.set_dtype(mx.float32)
    # transformers picks the tokenizer class from config.json's model_type (qwen2 -> Qwen2Tokenizer, which
    # rebuilds the pipeline): make sure this model's tokenizer still agrees with tokenizer.json
    for r in rows:
        assert tok.encode(r["text"]) == r["ids"], (path.name, type(tok._tokenizer).__name__, r["text"])
    prompt_text = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    ids = tok.encode(prompt_text, add_special_tokens=False)
    assert ids == list(tok.apply_chat_template(MESSAGES, add_generation_prompt=True)), "template tokenization mismatch"
    x = mx.array([ids])

    # prefill without cache: logits at every prompt position
    prompt_logits = model(x)[0].astype(mx.float32)
    mx.eval(prompt_logits)

    # greedy with the KV cache
    cache = make_prompt_cache(model)
    logits = model(x, cache=cache)[0, -1].astype(mx.float32)
    step_logits, greedy = [], []
    for _ in range(STEPS):
        mx.eval(logits)
        step_logits.append(logits)
        nxt = int(mx.argmax(logits).item())
        greedy.append(nxt)
        logits = model(mx.array([[nxt]]), cache=cache)[0, -1].astype(mx.float32)
    step_logits = mx.stack(step_logits)
    mx.eval(step_logits)

    # cross-check: one cache-free forward over prompt + greedy[:-1] must reproduce the step logits
    full = model(mx.array([ids + greedy[:-1]]))[0, len(ids) - 1:].astype(mx.float32)
    sl, pl, fl = np.array(step_logits), np.array(prompt_logits), np.array(full)
    cache_vs_full = float(np.abs(sl - fl).max())
    step0_vs_prefill = float(np.abs(sl[0] - pl[-1]).max())
    assert cache_vs_full < 1e-3 and [int(i) for i in fl.argmax(-1)] == greedy, cache_vs_full

    margins = [top2_margin(r) for r in sl]
    mx.save_safetensors(str(path / "golden.safetensors"), {
        "prompt_ids": mx.array(ids, dtype=mx.int32),
        "greedy_ids": mx.array(greedy, dtype=mx.int32),
        "step_logits": step_logits,
        "prompt_logits": prompt_logits,
    }, metadata={"format": "mlx"})
    info = {
        "model": path.name,
        "hf_tokenizer_class": type(tok._tokenizer).__name__,
        "eos_token_ids": sorted(tok.eos_token_ids),
        "messages": MESSAGES,
        "prompt_text": prompt_text,
        "n_prompt": len(ids),
        "steps": STEPS,
        "greedy_ids": greedy,
        "greedy_text": tok.decode(greedy),
        "margins": [round(m, 6) for m in margins],
        "min_margin": min(margins),
        "max_abs_diff_step_logits_vs_cache_free_forward": cache_vs_full,
        "max_abs_diff_step0_vs_prompt_logits_last": step0_vs_prefill,
        "activations": "float32 (model.set_dtype(mx.float32) after mlx_lm.load)",
        "tensors": {"prompt_ids": ["int32", [len(ids)]], "greedy_ids": ["int32", [STEPS]],
                    "step_logits": ["float32", list(sl.shape)], "prompt_logits": ["float32", list(pl.shape)]},
        "versions": {p: version(p) for p in ("mlx", "mlx-lm", "transformers", "tokenizers")},
    }
    dump_json(info, path / "golden.json")
    return info


def main():
    root = Path(sys.argv[1] if len(sys.argv) > 1 else "tests/fixtures/tiny")
    rows = encodings(root / "tokenizer")
    print(f"tokenizer: {len(rows)} encodings -> {root / 'tokenizer' / 'encodings.json'}")
    names = sys.argv[2:] or sorted(p.name for p in root.iterdir() if (p / "config.json").exists())
    ok = True
    for name in names:
        info = golden(root / name, rows)
        g = info["greedy_ids"]
        distinct = len(set(g))
        varied = distinct > 1
        ok &= varied
        print(f"{name}: prompt {info['n_prompt']} tok, greedy {g}\n    distinct {distinct}/{len(g)}"
              f"{'' if varied else ' DEGENERATE'}, min margin {info['min_margin']:.4f}, "
              f"cache vs cache-free {info['max_abs_diff_step_logits_vs_cache_free_forward']:.2e}, "
              f"text {info['greedy_text']!r}", flush=True)
    if not ok:
        sys.exit("some model repeats a single token: tune seed/gain in make_tiny_models.py")


if __name__ == "__main__":
    main()
