"""Train the tiny byte-level BPE tokenizer used by every synthetic test model.

usage: PY=$(scripts/oracle/venv.sh); $PY scripts/oracle/make_tiny_tokenizer.py [OUT_DIR] [CORPUS]
  OUT_DIR  default tests/fixtures/tiny/tokenizer
  CORPUS   default /usr/share/common-licenses/GPL-3 (Debian base-files; sha256 checked below)

Pipeline = Qwen2.5's: NFC normalizer, Split(Qwen2 regex, isolated) + ByteLevel(use_regex=false), ByteLevel
post-processor and decoder (see QWEN2_REGEX for why it has to be exactly this).
Writes OUT_DIR/tokenizer.json and OUT_DIR/tokenizer_config.json (ChatML template, eos <|im_end|>, no bos).
Vocab 512: ids 0..2 are the specials <|endoftext|>, <|im_start|>, <|im_end|>, then the 256 byte-level
symbols, then merges. Training is deterministic; the script trains twice and asserts identical output.
"""
import hashlib
import json
import os
import sys
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

VOCAB = 512
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
GPL3_SHA256 = "3972dc9744f6499f0f9b2dbf76696f2ae7ad8af9b23dde66d6af86c9dfb36986"
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


# The Qwen2 / Qwen2.5 pipeline (NFC, this split regex with single digits, then ByteLevel without its own regex).
# It must be exactly this: transformers 5 loads any model_type "qwen2" checkpoint with Qwen2Tokenizer, which
# ignores tokenizer.json's normalizer/pre-tokenizer and rebuilds this pipeline from vocab + merges
# (tokenization_auto.MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS). With any other pipeline the qwen2 fixture
# would tokenize differently from tokenizer.json.
QWEN2_REGEX = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""


def train(corpus_lines):
    tk = Tokenizer(models.BPE())
    tk.normalizer = normalizers.NFC()
    tk.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tk.decoder = decoders.ByteLevel()
    tk.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tk.train_from_iterator(corpus_lines, trainer)
    return tk.to_str(pretty=True)


def main():
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "tests/fixtures/tiny/tokenizer")
    corpus = Path(sys.argv[2] if len(sys.argv) > 2 else "/usr/share/common-licenses/GPL-3")
    raw = corpus.read_bytes()
    digest = hashlib.sha256(raw).hexdigest()
    if corpus.name == "GPL-3" and digest != GPL3_SHA256:
        print(f"WARNING: {corpus} sha256 {digest} != expected {GPL3_SHA256}; fixtures will differ", file=sys.stderr)
    lines = raw.decode("utf-8").splitlines(keepends=True)

    first = train(lines)
    second = train(lines)
    assert first == second, "BPE training is not deterministic"

    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text(first + "\n", encoding="utf-8")
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "model_max_length": 4096,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n", encoding="utf-8")

    tk = Tokenizer.from_str(first)
    assert tk.get_vocab_size() == VOCAB, tk.get_vocab_size()
    for i, s in enumerate(SPECIALS):
        assert tk.token_to_id(s) == i, (s, tk.token_to_id(s))
    print(f"tokenizer: vocab {tk.get_vocab_size()}, corpus {corpus} ({len(raw)} B, sha256 {digest[:12]}…), "
          f"deterministic (2 runs identical), sha256(tokenizer.json) "
          f"{hashlib.sha256((first + chr(10)).encode()).hexdigest()[:12]}… -> {out}")


if __name__ == "__main__":
    main()
