"""A seeded tiny Qwen3-Embedding checkpoint and the embeddings mlx-lm's forward pass gives it.

usage: PY=$(scripts/oracle/venv.sh); $PY scripts/oracle/make_embedding_fixture.py [OUT_ROOT]
  OUT_ROOT default tests/fixtures/tiny (needs OUT_ROOT/tokenizer from make_tiny_tokenizer.py)

Writes OUT_ROOT/embedding/qwen3-embedding-8bit-g128/ (a level down, so that make_goldens.py, which visits every
model directory of OUT_ROOT, leaves it alone: its tokenizer appends a token the generation goldens do not expect):
- the model: make_tiny_models.py's `build` (seeded mlx-lm init, gains, randomized norms, bf16, affine quantization,
  mlx-lm's own save) of Qwen3-Embedding-0.6B's layout: `qwen3`, `Qwen3ForCausalLM`, tied embeddings (no lm_head
  saved), the shape of qwen3-8bit-g128 (8-bit g128, the embedding 4-bit g64);
- the tiny tokenizer as Qwen3-Embedding's: `Qwen2Tokenizer`, and a post-processor that appends `<|endoftext|>`
  to every text (its tokenizer.json's TemplateProcessing);
- the sentence-transformers files: modules.json (Transformer, Pooling, Normalize), 1_Pooling/config.json
  (last-token pooling) and config_sentence_transformers.json (Qwen3-Embedding's `query` instruction prompt);
- embeddings.json: for each input (a prompt name, its text, and the ids transformers' tokenizer gives
  prompt + text with special tokens), the embeddings pooled from `model.model(ids)` (the last hidden state, after
  the final norm) with fp32 activations: last-token and mean pooling, L2-normalized in float64, and the
  last-token vector truncated to DIMENSIONS values, then normalized again (Matryoshka `dimensions`).
"""
import json
import sys
from importlib.metadata import version
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm import load

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_goldens import dump_json  # noqa: E402
from make_tiny_models import MODELS, build, describe  # noqa: E402

NAME = "qwen3-embedding-8bit-g128"
SPEC = dict(MODELS["qwen3-8bit-g128"], seed=9)
SPEC["config"] = dict(SPEC["config"], eos_token_id=0)

QUERY = "Instruct: Given a web search query, retrieve relevant passages that answer the query\nQuery:"
PROMPTS = {"query": QUERY, "document": ""}
# Inputs of different lengths (one token to over a hundred), with and without the query instruction.
INPUTS = [
    (None, "Hello world"),
    (None, "a"),
    ("query", "What is free software?"),
    ("document", "The quick brown fox jumps over the lazy dog."),
    (None, "This program is free software: you can redistribute it and/or modify it under the terms of the GNU "
           "General Public License as published by the Free Software Foundation, either version 3 of the License, "
           "or (at your option) any later version."),
]
DIMENSIONS = 32

APPEND_EOS = {
    "type": "TemplateProcessing",
    "single": [{"Sequence": {"id": "A", "type_id": 0}}, {"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}}],
    "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}},
             {"Sequence": {"id": "B", "type_id": 1}}, {"SpecialToken": {"id": "<|endoftext|>", "type_id": 1}}],
    "special_tokens": {"<|endoftext|>": {"id": "<|endoftext|>", "ids": [0], "tokens": ["<|endoftext|>"]}},
}


def write_json(obj, path):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def as_embedding_checkpoint(out):
    tokenizer = json.loads((out / "tokenizer.json").read_text(encoding="utf-8"))
    tokenizer["post_processor"] = APPEND_EOS
    write_json(tokenizer, out / "tokenizer.json")
    config = json.loads((out / "tokenizer_config.json").read_text(encoding="utf-8"))
    config.update(tokenizer_class="Qwen2Tokenizer", padding_side="left")
    write_json(config, out / "tokenizer_config.json")
    write_json([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ], out / "modules.json")
    hidden = SPEC["config"]["hidden_size"]
    write_json({"word_embedding_dimension": hidden, "pooling_mode_cls_token": False,
                "pooling_mode_mean_tokens": False, "pooling_mode_max_tokens": False,
                "pooling_mode_mean_sqrt_len_tokens": False, "pooling_mode_weightedmean_tokens": False,
                "pooling_mode_lasttoken": True, "include_prompt": True}, out / "1_Pooling" / "config.json")
    write_json({"prompts": PROMPTS, "default_prompt_name": None, "similarity_fn_name": "cosine"},
               out / "config_sentence_transformers.json")


def normalized(v):
    v = np.asarray(v, dtype=np.float64)
    return v / np.linalg.norm(v)


def f32_list(v):
    return [float(x) for x in np.asarray(v, dtype=np.float32)]


def goldens(out):
    model, tok = load(str(out))
    model.set_dtype(mx.float32)
    rows = []
    for prompt_name, text in INPUTS:
        ids = tok.encode(PROMPTS.get(prompt_name, "") + text)
        assert ids[-1] == 0, ("the post-processor appends <|endoftext|>", ids)
        hidden = model.model(mx.array([ids]))[0].astype(mx.float32)
        mx.eval(hidden)
        hidden = np.array(hidden)
        last = hidden[-1]
        rows.append({
            "prompt_name": prompt_name, "text": text, "ids": ids,
            "last_token": f32_list(normalized(last)),
            "mean": f32_list(normalized(hidden.mean(axis=0, dtype=np.float64))),
            f"last_token_dimensions_{DIMENSIONS}": f32_list(normalized(last[:DIMENSIONS])),
        })
    dump_json({
        "model": out.name,
        "hf_tokenizer_class": type(tok._tokenizer).__name__,
        "prompts": PROMPTS,
        "dimensions": DIMENSIONS,
        "procedure": "mlx_lm.load; model.set_dtype(float32); ids = tokenizer.encode(prompt + text) (special tokens "
                     "added: the post-processor appends <|endoftext|>); h = model.model(mx.array([ids]))[0] (after "
                     "the final norm); last_token = h[-1], mean = h.mean(0), each L2-normalized in float64; "
                     f"last_token_dimensions_{DIMENSIONS} = h[-1][:{DIMENSIONS}] L2-normalized",
        "inputs": rows,
        "versions": {p: version(p) for p in ("mlx", "mlx-lm", "transformers", "tokenizers")},
    }, out / "embeddings.json")
    return rows


def main():
    out_root = Path(sys.argv[1] if len(sys.argv) > 1 else "tests/fixtures/tiny")
    tokdir = out_root / "tokenizer"
    assert (tokdir / "tokenizer.json").exists(), f"run make_tiny_tokenizer.py first ({tokdir})"
    out = build(NAME, SPEC, out_root / "embedding", tokdir)
    as_embedding_checkpoint(out)
    size, _, dense, bits_groups = describe(out)
    rows = goldens(out)
    print(f"{NAME}: model.safetensors {size / 1024:.1f} KiB, (bits, group) {bits_groups}, dense 2-D: "
          f"{dense or 'none'}; {len(rows)} inputs of {[len(r['ids']) for r in rows]} tokens -> {out / 'embeddings.json'}")


if __name__ == "__main__":
    main()
