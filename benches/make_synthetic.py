"""Writes the synthetic benchmark llama as an fp16 Hugging Face directory (no downloads).

usage: $(scripts/oracle/venv.sh) benches/make_synthetic.py OUT_DIR [--layers 16]

Shape as ../shared/machines-and-peers.md records it: hidden 2048, intermediate 5632, 16 layers,
32 heads / 8 KV heads, vocab 32000, untied embeddings, random weights x0.02 (0.85B parameters).
The tokenizer is a byte-level BPE whose merges are simply the first byte pairs: random weights
make text noise anyway, and the benchmark feeds token ids.
"""
import argparse
import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

HIDDEN, INTER, HEADS, KV_HEADS, VOCAB = 2048, 5632, 32, 8, 32000
SPECIALS = ["<unk>", "<s>", "</s>"]
TEMPLATE = (
    "{% for m in messages %}{{ '<s>' + m['role'] + '\n' + m['content'] + '</s>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<s>assistant\n' }}{% endif %}"
)


def byte_symbols():
    """GPT-2's printable stand-ins for the 256 bytes, in byte order."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return [out[b] for b in range(256)]


def tokenizer(out: Path):
    symbols = byte_symbols()
    vocab = {t: i for i, t in enumerate(SPECIALS)}
    for s in symbols:
        vocab[s] = len(vocab)
    merges = []
    for a in symbols:
        for b in symbols:
            if len(vocab) == VOCAB:
                break
            vocab[a + b] = len(vocab)
            merges.append((a, b))
    tk = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens(SPECIALS)
    tk.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>", "chat_template": TEMPLATE, "model_max_length": 4096,
    }, indent=1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--layers", type=int, default=16)
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    hd = HIDDEN // HEADS

    def rand(*shape):
        return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float16)

    t = {"model.embed_tokens.weight": rand(VOCAB, HIDDEN)}
    for i in range(a.layers):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = np.ones(HIDDEN, np.float16)
        t[p + "post_attention_layernorm.weight"] = np.ones(HIDDEN, np.float16)
        t[p + "self_attn.q_proj.weight"] = rand(HEADS * hd, HIDDEN)
        t[p + "self_attn.k_proj.weight"] = rand(KV_HEADS * hd, HIDDEN)
        t[p + "self_attn.v_proj.weight"] = rand(KV_HEADS * hd, HIDDEN)
        t[p + "self_attn.o_proj.weight"] = rand(HIDDEN, HEADS * hd)
        t[p + "mlp.gate_proj.weight"] = rand(INTER, HIDDEN)
        t[p + "mlp.up_proj.weight"] = rand(INTER, HIDDEN)
        t[p + "mlp.down_proj.weight"] = rand(HIDDEN, INTER)
    t["model.norm.weight"] = np.ones(HIDDEN, np.float16)
    t["lm_head.weight"] = rand(VOCAB, HIDDEN)
    save_file(t, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN,
        "intermediate_size": INTER, "num_hidden_layers": a.layers, "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS, "head_dim": hd, "vocab_size": VOCAB, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "max_position_embeddings": 4096, "tie_word_embeddings": False,
        "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float16",
    }, indent=1))
    tokenizer(out)
    print(out)


if __name__ == "__main__":
    main()
