"""Writes a random-weight llama (or Qwen2, `--arch qwen2`) in the MLX affine layout (config.json
+ model.safetensors) with numpy alone, for timing on machines that have no mlx (the GPU machine).

usage: python3 benches/gpu/synthetic_mlx.py OUT --hidden 2048 --intermediate 5632 --layers 16
           --heads 32 --kv-heads 8 --vocab 32000 [--arch qwen2] [--bits 4] [--group-size 64]

Packed weights are random words (every bit pattern), scales and biases bf16 of the size
mlx_lm.convert gives weights of std 0.02, norms 1: speed is what random weights measure; the
tokens are noise. No tokenizer is written (`oxlm bench` feeds token ids).
"""
import argparse
import json
import struct
from pathlib import Path

import numpy as np

from shapes import add_shape_args


def bf16(a):
    """float32 array -> bf16 bits (round to nearest even) as uint16."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def write_safetensors(path, tensors):
    """`tensors`: name -> (dtype string, shape, bytes), written in the safetensors layout."""
    header, offset = {}, 0
    for name, (dtype, shape, data) in tensors.items():
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for _, _, data in tensors.values():
            f.write(data)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    add_shape_args(ap)
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=64)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    h, hd = a.hidden, a.hidden // a.heads
    tensors = {}

    def linear(name, rows, cols):
        words = rng.integers(0, 2**32, size=(rows, cols * a.bits // 32), dtype=np.uint32)
        groups = (rows, cols // a.group_size)
        # Weights of std 0.02 span about ±0.07: scale = range / levels, bias = the minimum.
        scales = bf16(rng.uniform(0.10, 0.16, groups) / (2**a.bits - 1))
        biases = bf16(rng.uniform(-0.08, -0.05, groups))
        tensors[f"{name}.weight"] = ("U32", words.shape, words.tobytes())
        tensors[f"{name}.scales"] = ("BF16", groups, scales.tobytes())
        tensors[f"{name}.biases"] = ("BF16", groups, biases.tobytes())

    def norm(name):
        tensors[f"{name}.weight"] = ("BF16", (h,), bf16(np.ones(h)).tobytes())

    def bias(name, rows):
        tensors[f"{name}.bias"] = ("BF16", (rows,), bf16(rng.normal(0, 0.02, rows)).tobytes())

    qwen2 = a.arch == "qwen2"
    linear("model.embed_tokens", a.vocab, h)
    for i in range(a.layers):
        p = f"model.layers.{i}"
        norm(f"{p}.input_layernorm")
        norm(f"{p}.post_attention_layernorm")
        linear(f"{p}.self_attn.q_proj", a.heads * hd, h)
        linear(f"{p}.self_attn.k_proj", a.kv_heads * hd, h)
        linear(f"{p}.self_attn.v_proj", a.kv_heads * hd, h)
        if qwen2:
            bias(f"{p}.self_attn.q_proj", a.heads * hd)
            bias(f"{p}.self_attn.k_proj", a.kv_heads * hd)
            bias(f"{p}.self_attn.v_proj", a.kv_heads * hd)
        linear(f"{p}.self_attn.o_proj", h, a.heads * hd)
        linear(f"{p}.mlp.gate_proj", a.intermediate, h)
        linear(f"{p}.mlp.up_proj", a.intermediate, h)
        linear(f"{p}.mlp.down_proj", h, a.intermediate)
    norm("model.norm")
    if not qwen2:
        linear("lm_head", a.vocab, h)

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    write_safetensors(out / "model.safetensors", tensors)
    quant = {"group_size": a.group_size, "bits": a.bits, "mode": "affine"}
    config = {
        "model_type": a.arch,
        "architectures": ["Qwen2ForCausalLM" if qwen2 else "LlamaForCausalLM"],
        "hidden_size": h, "intermediate_size": a.intermediate, "num_hidden_layers": a.layers,
        "num_attention_heads": a.heads, "num_key_value_heads": a.kv_heads, "head_dim": hd,
        "rms_norm_eps": 1e-6 if qwen2 else 1e-5, "vocab_size": a.vocab,
        "rope_theta": 1e6 if qwen2 else 10000.0, "max_position_embeddings": 32768,
        "tie_word_embeddings": qwen2, "quantization": quant, "quantization_config": quant,
    }
    (out / "config.json").write_text(json.dumps(config, indent=1))
    size = sum(len(d) for _, _, d in tensors.values())
    print(f"wrote {out}: {size / 2**20:.0f} MiB, {a.bits}-bit g{a.group_size}")


if __name__ == "__main__":
    main()
