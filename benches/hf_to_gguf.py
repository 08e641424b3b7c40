"""Writes an fp16 GGUF for llama.cpp from a Hugging Face llama or qwen2 directory, then quantizes it.

usage: $BENCH_PY benches/hf_to_gguf.py HF_DIR OUT_PREFIX [q4_0 q8_0 ...]
  writes OUT_PREFIX-f16.gguf and OUT_PREFIX-<type>.gguf with llama.cpp's own quantizer.

llama.cpp's converter (convert_hf_to_gguf.py) needs torch; this does the same for the two
architectures the benchmark uses with the `gguf` package alone: tensor names, llama's q/k
row permutation (llama.cpp rotates interleaved pairs, HF rotates halves), and the byte-level
BPE vocabulary with its merges.
"""
import ctypes
import json
import struct
import sys
from pathlib import Path

import gguf
import numpy as np


def load_safetensors(hf: Path):
    """All tensors of the directory as numpy arrays (f16/bf16/f32), without the safetensors package."""
    out = {}
    for f in sorted(hf.glob("*.safetensors")):
        raw = f.read_bytes()
        n = struct.unpack("<Q", raw[:8])[0]
        header = json.loads(raw[8:8 + n])
        base = 8 + n
        for name, info in header.items():
            if name == "__metadata__":
                continue
            a, b = info["data_offsets"]
            buf = raw[base + a:base + b]
            dt = info["dtype"]
            if dt == "F16":
                arr = np.frombuffer(buf, np.float16)
            elif dt == "F32":
                arr = np.frombuffer(buf, np.float32)
            elif dt == "BF16":
                arr = (np.frombuffer(buf, np.uint16).astype(np.uint32) << 16).view(np.float32)
            else:
                raise SystemExit(f"{name}: dtype {dt} is not a float")
            out[name] = arr.reshape(info["shape"])
    return out


def permute(w, heads):
    """HF's rotate-half q/k rows to llama.cpp's interleaved pairs (as convert_hf_to_gguf.py)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def vocabulary(hf: Path, size: int):
    """Tokens, types and merges, padded to the embedding's `size` rows as llama.cpp requires."""
    tk = json.loads((hf / "tokenizer.json").read_text())
    vocab = dict(tk["model"]["vocab"])
    special = set()
    for t in tk.get("added_tokens", []):
        vocab[t["content"]] = t["id"]
        if t.get("special"):
            special.add(t["id"])
    size = max(size, max(vocab.values()) + 1)
    tokens = [f"[PAD{i}]" for i in range(size)]
    types = [gguf.TokenType.UNUSED] * size
    for text, i in vocab.items():
        tokens[i] = text
        types[i] = gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL
    merges = [m if isinstance(m, str) else " ".join(m) for m in tk["model"]["merges"]]
    return tokens, types, merges


def write_f16(hf: Path, out: Path):
    cfg = json.loads((hf / "config.json").read_text())
    arch = cfg["model_type"]
    if arch not in ("llama", "qwen2"):
        raise SystemExit(f"model_type {arch}: only llama and qwen2 are written")
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads", heads)
    head_dim = cfg.get("head_dim", hidden // heads)
    w = gguf.GGUFWriter(str(out), arch)
    w.add_context_length(cfg.get("max_position_embeddings", 4096))
    w.add_embedding_length(hidden)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_rope_dimension_count(head_dim)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg.get("rope_theta", 10000.0))
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    tokens, types, merges = vocabulary(hf, cfg["vocab_size"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2" if arch == "qwen2" else "default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    eos = cfg.get("eos_token_id", 2)
    w.add_eos_token_id(eos[0] if isinstance(eos, list) else eos)
    w.add_add_bos_token(False)
    names = {
        "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
        "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    for name, t in load_safetensors(hf).items():
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        elif name == "lm_head.weight":
            gname = "output.weight"
        elif name.startswith("model.layers."):
            _, _, i, rest = name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            if module not in names:
                raise SystemExit(f"unexpected tensor {name}")
            gname = f"blk.{i}.{names[module]}.{kind}"
            if arch == "llama" and module == "self_attn.q_proj":
                t = permute(t, heads)
            elif arch == "llama" and module == "self_attn.k_proj":
                t = permute(t, kv_heads)
        else:
            continue
        # llama.cpp keeps norms and biases in f32, matrices in f16.
        w.add_tensor(gname, t.astype(np.float32 if t.ndim == 1 else np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main():
    hf, prefix, kinds = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
    f16 = Path(f"{prefix}-f16.gguf")
    if not f16.exists():
        write_f16(hf, f16.with_suffix(".partial"))
        f16.with_suffix(".partial").rename(f16)
    import llama_cpp

    ftypes = {"q4_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0, "q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0}
    for kind in kinds:
        out = Path(f"{prefix}-{kind}.gguf")
        if out.exists():
            continue
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = ftypes[kind]
        params.nthread = 2
        tmp = out.with_suffix(".partial")
        rc = llama_cpp.llama_model_quantize(str(f16).encode(), str(tmp).encode(), ctypes.byref(params))
        if rc != 0:
            raise SystemExit(f"llama_model_quantize {kind} failed ({rc})")
        tmp.rename(out)
        print(out)


if __name__ == "__main__":
    main()
