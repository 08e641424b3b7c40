"""Goldens for `oxlm convert --gguf`'s tokenizer: what transformers' own GGUF tokenizer makes of a corpus.

usage: PY=$(scripts/oracle/venv.sh); $PY scripts/oracle/make_gguf_tokenizer_goldens.py [--compare-model-dirs]

Reads tests/fixtures/gguf/tokenizer_corpus.json and, for each of the three real GGUFs under
${OXLM_CACHE:-$HOME/.cache/oxlm}/gguf/ (scripts/models/fetch_models.sh puts them there), loads
`AutoTokenizer.from_pretrained(dir, gguf_file=name)` and records per string: `ids` (encode with
add_special_tokens=True), `ids_no_special` (False), `decoded` (decode(ids)) and `decoded_skip_special`
(decode(ids, skip_special_tokens=True)). Writes tests/fixtures/gguf/tokenizer_goldens.json, which
crates/convert/tests/gguf_tokenizer.rs checks the tokenizer.json built in Rust against.

Two deliberate departures from transformers' GGUF tokenizer, each changing one corpus string:
- SmolLM2 (`tokenizer.ggml.pre` = smollm): transformers has no split for this pre-tokenizer and falls back
  to GPT-2's, which keeps a space with a following non-ASCII numeral (` ½`). llama.cpp
  (LLAMA_VOCAB_PRE_TYPE_SMOLLM: `\p{N}` split first) and SmolLM2's own tokenizer.json isolate every numeral;
  the golden uses that pipeline (Digits(individual_digits) then ByteLevel), as oxlm writes it.
- Qwen2.5 (`pre` = qwen2): the text is NFC-normalized before it is encoded. transformers' GGUF path (and
  llama.cpp) skip the NFC normalizer of Qwen2's tokenizer, but the converted directory (model_type qwen2)
  is loaded by transformers, mlx-lm and oxlm as Qwen2Tokenizer, which normalizes with NFC whatever
  tokenizer.json says; so oxlm writes the NFC normalizer, and the golden is what that directory gives.

--compare-model-dirs also prints, not writes, how many strings give the same ids with the tokenizer of the
model directories fetch_models.sh built from these GGUFs (the official tokenizer.json for Qwen2.5 and
Gemma 3, the `gguf_to_hf.py` rebuild for SmolLM2), loaded as mlx-lm loads them.

transformers' GGUF reader imports torch (absent from the oracle venv) for tensor dtypes that loading a
tokenizer never uses, so a stub module stands in for it.
"""
import hashlib
import json
import os
import sys
import types
import unicodedata
from pathlib import Path

import tokenizers
import transformers
from transformers.utils import is_torch_available

ROOT = Path(__file__).resolve().parents[2]
CORPUS = ROOT / "tests/fixtures/gguf/tokenizer_corpus.json"
OUT = ROOT / "tests/fixtures/gguf/tokenizer_goldens.json"
CACHE = Path(os.environ.get("OXLM_CACHE", Path.home() / ".cache/oxlm"))

# file name -> (model dir fetch_models.sh builds from it, departure from transformers' GGUF tokenizer)
MODELS = {
    "SmolLM2-135M-Instruct.Q4_1.gguf": ("smollm2-135m-instruct-4bit", "smollm-digits"),
    "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf": ("qwen2.5-coder-0.5b-instruct-4bit", "nfc"),
    "gemma-3-270m-q4_k_m.gguf": ("gemma-3-270m-4bit", None),
}


def stub_torch():
    """A `torch` whose every attribute is a do-nothing class: enough for transformers' GGUF modules to import."""
    assert not is_torch_available()  # decided before the stub exists, so transformers still runs without torch

    class Anything:
        def __init__(self, *args, **kwargs):
            pass

        def __class_getitem__(cls, item):
            return cls

    def module(name):
        m = types.ModuleType(name)
        m.__getattr__ = lambda attr: Anything
        return m

    torch, nn = module("torch"), module("torch.nn")
    torch.nn = nn
    sys.modules.update(torch=torch, **{"torch.nn": nn})
    # AutoTokenizer reads the model's config from the file through this module, metadata only.
    import transformers.modeling_gguf_pytorch_utils as gguf_utils

    gguf_utils.is_torch_available = lambda: True


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def smollm_digits(tok):
    """llama.cpp's `smollm` pre-tokenizer: every numeral apart, then GPT-2's regex."""
    from tokenizers import pre_tokenizers

    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )


def cases(tok, corpus, nfc):
    out = []
    for text in corpus:
        if nfc:
            text = unicodedata.normalize("NFC", text)
        ids = tok.encode(text, add_special_tokens=True)
        out.append(
            dict(
                ids=ids,
                ids_no_special=tok.encode(text, add_special_tokens=False),
                decoded=tok.decode(ids),
                decoded_skip_special=tok.decode(ids, skip_special_tokens=True),
            )
        )
    return out


def main():
    from transformers import AutoTokenizer

    stub_torch()
    corpus = json.loads(CORPUS.read_text())
    models = {}
    for name, (model_dir, departure) in MODELS.items():
        path = CACHE / "gguf" / name
        if not path.exists():
            sys.exit(f"make_gguf_tokenizer_goldens: {path} is missing: run scripts/models/fetch_models.sh")
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=name)
        if departure == "smollm-digits":
            smollm_digits(tok)
        got = cases(tok, corpus, departure == "nfc")
        models[name] = dict(
            bytes=path.stat().st_size,
            sha256=sha256(path),
            tokenizer_class=type(tok).__name__,
            departure=departure,
            cases=got,
        )
        print(f"{name}: {type(tok).__name__}, {sum(len(c['ids']) for c in got)} ids", flush=True)
        if "--compare-model-dirs" in sys.argv:
            official = AutoTokenizer.from_pretrained(str(CACHE / "models" / model_dir))
            same = [official.encode(t) == c["ids"] for t, c in zip(corpus, got)]
            print(f"  vs {model_dir}: {sum(same)}/{len(same)} identical", flush=True)
            for t, c, s in zip(corpus, got, same):
                if not s:
                    print(f"    {t!r}: gguf {c['ids']}\n    {' ' * len(repr(t))}  dir  {official.encode(t)}")
    goldens = dict(
        generator="scripts/oracle/make_gguf_tokenizer_goldens.py",
        corpus="tests/fixtures/gguf/tokenizer_corpus.json",
        versions=dict(transformers=transformers.__version__, tokenizers=tokenizers.__version__),
        models=models,
    )
    OUT.write_text(json.dumps(goldens, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {OUT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
