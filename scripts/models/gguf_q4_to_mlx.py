"""Lossless GGUF Q4_0/Q4_1/Q8_0 -> MLX affine quantized model (llama arch; used for SmolLM2).

usage: PY=$(scripts/oracle/venv.sh)
       $PY scripts/models/gguf_q4_to_mlx.py MODEL.gguf HF_DIR OUT_DIR
  HF_DIR: from `gguf_to_hf.py MODEL.gguf HF_DIR --no-weights` (config.json, tokenizer files,
          generation_config.json); the weights are taken from the GGUF unchanged.

mx.load(file.gguf) returns Q4_0/Q4_1/Q8_0 tensors as MLX affine triples (weight uint32, scales, biases),
group size 32, bit-exact. We rename them to HF/mlx-lm names, un-permute the q/k rows (weight, scales and
biases alike: rows are output features) and write a 4-bit group-32 model. Tensors of another bit width
(SmolLM2: the Q8_0 token embedding) get a per-layer override in config.json, e.g.
  "quantization": {"group_size": 32, "bits": 4, "mode": "affine",
                   "model.embed_tokens": {"group_size": 32, "bits": 8, "mode": "affine"}}
Only model.safetensors is written (no model.safetensors.index.json), like a single-file HF checkpoint.
"""
import json
import os
import re
import shutil
import sys

import mlx.core as mx

src, hf, out = sys.argv[1:4]
os.makedirs(out, exist_ok=True)
w = mx.load(src)
cfg = json.load(open(f"{hf}/config.json"))
if cfg.get("model_type") != "llama":
    raise SystemExit(f"gguf_q4_to_mlx: only llama arch is supported, got {cfg.get('model_type')}")
nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
names = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
         "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
         "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}


def unpermute(a, heads):  # rows = output features; same row order for weight/scales/biases
    return a.reshape(heads, a.shape[0] // heads // 2, 2, -1).swapaxes(1, 2).reshape(a.shape)


out_w, quant = {}, {"group_size": 32, "bits": 4, "mode": "affine"}
for k, v in w.items():
    base, kind = k.rsplit(".", 1)
    m = re.match(r"blk\.(\d+)\.(\w+)$", base)
    if m:
        name = f"model.layers.{m[1]}.{names[m[2]]}"
    else:
        name = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}[base]
    if m and m[2] in ("attn_q", "attn_k"):
        v = unpermute(v, nh if m[2] == "attn_q" else nkv)
    if v.dtype == mx.float32:  # norms
        v = v.astype(mx.float16)
    out_w[f"{name}.{kind}"] = v
    if kind == "weight" and v.dtype == mx.uint32:
        n_groups = w[f"{base}.scales"].shape[-1]
        bits = 32 * v.shape[-1] // (n_groups * 32)  # packed uint32 words per row -> bits per weight (group 32)
        if bits not in (4, 8):
            raise SystemExit(f"gguf_q4_to_mlx: {k}: unexpected bit width {bits}")
        if bits != 4:
            quant[name] = {"group_size": 32, "bits": bits, "mode": "affine"}
    elif kind == "weight" and not name.endswith("norm"):
        raise SystemExit(f"gguf_q4_to_mlx: {k} is not Q4_0/Q4_1/Q8_0 ({v.dtype}); use gguf_to_hf.py + mlx_lm convert")
cfg["quantization"] = quant
cfg["quantization_config"] = quant
mx.save_safetensors(f"{out}/model.safetensors", out_w, metadata={"format": "mlx"})
json.dump(cfg, open(f"{out}/config.json", "w"), indent=4)
for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
    if os.path.exists(f"{hf}/{f}"):
        shutil.copy(f"{hf}/{f}", out)
print(f"gguf_q4_to_mlx: {len(out_w)} arrays; quantization: {quant} -> {out}", flush=True)
