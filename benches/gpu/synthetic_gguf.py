"""Writes a random-weight llama (or Qwen2) GGUF (f16) of the shapes synthetic_mlx.py writes, for
llama.cpp, with the gguf-py package that ships inside llama.cpp's source.

usage: python3 benches/gpu/synthetic_gguf.py LLAMA_CPP_DIR OUT.gguf --hidden 2048
           --intermediate 5632 --layers 16 --heads 32 --kv-heads 8 --vocab 32000 [--arch qwen2]
Then `llama-quantize OUT.gguf Q4_0.gguf Q4_0` (or Q8_0).
"""
import argparse
import sys

import numpy as np

from shapes import add_shape_args


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("llama_cpp")
    ap.add_argument("out")
    add_shape_args(ap)
    a = ap.parse_args()
    sys.path.insert(0, f"{a.llama_cpp}/gguf-py")
    import gguf

    h, hd, v = a.hidden, a.hidden // a.heads, a.vocab
    qwen2 = a.arch == "qwen2"
    w = gguf.GGUFWriter(a.out, a.arch)
    w.add_context_length(32768)
    w.add_embedding_length(h)
    w.add_block_count(a.layers)
    w.add_feed_forward_length(a.intermediate)
    w.add_rope_dimension_count(hd)
    w.add_head_count(a.heads)
    w.add_head_count_kv(a.kv_heads)
    w.add_layer_norm_rms_eps(1e-6 if qwen2 else 1e-5)
    w.add_rope_freq_base(1e6 if qwen2 else 10000.0)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    # A byte-fallback vocabulary of the right size: the benchmark feeds token ids.
    tokens = [b"<unk>", b"<s>", b"</s>"] + [f"<0x{i:02X}>".encode() for i in range(256)]
    tokens += [f"t{i}".encode() for i in range(v - len(tokens))]
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * v)
    w.add_token_types([2, 3, 3] + [6] * 256 + [1] * (v - 259))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    rng = np.random.default_rng(0)

    def weight(*shape):
        return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float16)

    ones = np.ones(h, np.float32)
    w.add_tensor("token_embd.weight", weight(v, h))
    for i in range(a.layers):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", ones)
        w.add_tensor(p + "attn_q.weight", weight(a.heads * hd, h))
        w.add_tensor(p + "attn_k.weight", weight(a.kv_heads * hd, h))
        w.add_tensor(p + "attn_v.weight", weight(a.kv_heads * hd, h))
        if qwen2:
            for name, rows in [("q", a.heads * hd), ("k", a.kv_heads * hd), ("v", a.kv_heads * hd)]:
                w.add_tensor(p + f"attn_{name}.bias", rng.normal(0, 0.02, rows).astype(np.float32))
        w.add_tensor(p + "attn_output.weight", weight(h, a.heads * hd))
        w.add_tensor(p + "ffn_norm.weight", ones)
        w.add_tensor(p + "ffn_gate.weight", weight(a.intermediate, h))
        w.add_tensor(p + "ffn_up.weight", weight(a.intermediate, h))
        w.add_tensor(p + "ffn_down.weight", weight(h, a.intermediate))
    w.add_tensor("output_norm.weight", ones)
    if not qwen2:  # Qwen2's head is the embedding, as llama.cpp reads a GGUF without `output`
        w.add_tensor("output.weight", weight(v, h))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print("wrote", a.out)


if __name__ == "__main__":
    main()
