"""GGUF (llama / qwen2 / gemma3) -> Hugging Face layout: fp16 model.safetensors, config.json,
generation_config.json and tokenizer files. Dequantizes with gguf-py + numpy (no torch).

usage: PY=$(scripts/oracle/venv.sh)
       $PY scripts/models/gguf_to_hf.py MODEL.gguf OUT_DIR [--tokenizer-dir DIR] [--eos-ids 151645,151643]
                                        [--no-weights]

  --tokenizer-dir DIR  a folder with a real tokenizer.json (+ tokenizer_config.json), e.g. built by
                       qwen25_tokenizer.py. Without it, the GGUF's GPT-2-style BPE vocab is rebuilt into
                       tokenizer.json (only the SmolLM2 `smollm` pre-tokenizer is supported and checked).
  --eos-ids            eos ids for generation_config.json (default: the GGUF's eos id).
  --no-weights         write only config + tokenizer + generation_config (used by the lossless
                       gguf_q4_to_mlx.py path, which takes its weights straight from the GGUF).

The GGUF's own chat template (tokenizer.chat_template) always wins over one in --tokenizer-dir.
It undoes llama.cpp's q/k row permutation (llama arch only) and subtracts 1 from Gemma norms.
Then: python -m mlx_lm convert --hf-path OUT_DIR --mlx-path MLX_DIR -q --q-bits 4 --q-group-size 64
"""
import argparse
import json
import os
import re
import shutil

import numpy as np
from gguf import GGUFReader, dequantize

ap = argparse.ArgumentParser()
ap.add_argument("gguf")
ap.add_argument("out")
ap.add_argument("--tokenizer-dir")
ap.add_argument("--eos-ids")
ap.add_argument("--no-weights", action="store_true")
args = ap.parse_args()

os.makedirs(args.out, exist_ok=True)
r = GGUFReader(args.gguf)


def fv(k):
    f = r.get_field(k)
    return f.contents() if f is not None else None


arch = fv("general.architecture")


def g(k):
    return fv(f"{arch}.{k}")


n_head, n_kv, hidden, n_layers = (g("attention.head_count"), g("attention.head_count_kv"),
                                  g("embedding_length"), g("block_count"))
toks = fv("tokenizer.ggml.tokens")
bos_id, eos_id = fv("tokenizer.ggml.bos_token_id"), fv("tokenizer.ggml.eos_token_id")
pad_id, unk_id = fv("tokenizer.ggml.padding_token_id"), fv("tokenizer.ggml.unknown_token_id")
cfg = {
    "hidden_size": hidden, "intermediate_size": g("feed_forward_length"), "num_hidden_layers": n_layers,
    "num_attention_heads": n_head, "num_key_value_heads": n_kv,
    "rms_norm_eps": float(f"{g('attention.layer_norm_rms_epsilon'):.6g}"),
    "rope_theta": float(g("rope.freq_base")), "max_position_embeddings": g("context_length"),
    "vocab_size": len(toks),
    "tie_word_embeddings": not any(t.name == "output.weight" for t in r.tensors), "torch_dtype": "float16",
    "bos_token_id": bos_id, "eos_token_id": eos_id, "pad_token_id": pad_id,
}
names = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
         "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
         "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
         "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
if arch == "llama":
    cfg.update(architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu", attention_bias=False,
               mlp_bias=False, head_dim=hidden // n_head)
elif arch == "qwen2":
    cfg.update(architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_act="silu", use_sliding_window=False)
elif arch == "gemma3":
    hd = g("attention.key_length")
    cfg.update(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", head_dim=hd, query_pre_attn_scalar=hd,
               hidden_activation="gelu_pytorch_tanh", sliding_window=g("attention.sliding_window"),
               sliding_window_pattern=6, rope_local_base_freq=10000.0, rope_scaling=None,
               final_logit_softcapping=None, attn_logit_softcapping=None, attention_bias=False,
               layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(n_layers)])
    names.update(post_attention_norm="post_attention_layernorm", ffn_norm="pre_feedforward_layernorm",
                 post_ffw_norm="post_feedforward_layernorm")
else:
    raise SystemExit(f"gguf_to_hf: unsupported arch {arch}")


def unpermute(w, heads):  # undo llama.cpp's rotary q/k row permutation (llama arch only)
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


if not args.no_weights:
    from safetensors.numpy import save_file
    tensors = {}
    for t in r.tensors:
        w = dequantize(t.data, t.tensor_type).astype(np.float32).reshape([int(x) for x in reversed(t.shape)])
        m = re.match(r"blk\.(\d+)\.(\w+)\.(weight|bias)$", t.name)
        if m:
            name = f"model.layers.{m[1]}.{names[m[2]]}.{m[3]}"
            if arch == "llama" and m[2] in ("attn_q", "attn_k"):
                w = unpermute(w, n_head if m[2] == "attn_q" else n_kv)
        else:
            name = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                    "output.weight": "lm_head.weight"}[t.name]
        if arch == "gemma3" and name.endswith("norm.weight"):
            w = w - 1.0  # llama.cpp stores gemma's (1 + w) RMSNorm scales
        tensors[name] = np.ascontiguousarray(w.astype(np.float16))
    save_file(tensors, f"{args.out}/model.safetensors", metadata={"format": "pt"})
    print(f"gguf_to_hf: {arch}, {len(tensors)} tensors -> {args.out}", flush=True)
json.dump(cfg, open(f"{args.out}/config.json", "w"), indent=2)

# generation_config.json: token ids only (no sampling defaults: the GGUF does not carry them)
eos_ids = [int(x) for x in args.eos_ids.split(",")] if args.eos_ids else eos_id
gen = {"bos_token_id": bos_id, "eos_token_id": eos_ids, "pad_token_id": pad_id}
json.dump({k: v for k, v in gen.items() if v is not None}, open(f"{args.out}/generation_config.json", "w"), indent=2)

# tokenizer files
if args.tokenizer_dir:
    shutil.copy(f"{args.tokenizer_dir}/tokenizer.json", args.out)
    tc = json.load(open(f"{args.tokenizer_dir}/tokenizer_config.json"))
    # the tokenizer dir is authoritative for bos/eos/pad names (it was checked against this GGUF)
else:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    pre = fv("tokenizer.ggml.pre")
    if fv("tokenizer.ggml.model") != "gpt2" or pre != "smollm":
        raise SystemExit(f"gguf_to_hf: vocab {fv('tokenizer.ggml.model')}/{pre}: pass --tokenizer-dir")
    merges = [tuple(m.split(" ", 1)) for m in fv("tokenizer.ggml.merges")]
    tk = Tokenizer(models.BPE(vocab={s: i for i, s in enumerate(toks)}, merges=merges, fuse_unk=False,
                              byte_fallback=False))
    # SmolLM2's official pipeline: split digits, then GPT-2 byte-level BPE
    tk.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tk.decoder = decoders.ByteLevel()
    tk.post_processor = processors.ByteLevel(trim_offsets=False)
    types = fv("tokenizer.ggml.token_type")
    tk.add_special_tokens([AddedToken(s, special=True, normalized=False) for s, ty in zip(toks, types) if ty == 3])
    tk.save(f"{args.out}/tokenizer.json")
    tc = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
          "add_prefix_space": False, "model_max_length": g("context_length")}
    for key, tid in (("bos_token", bos_id), ("eos_token", eos_id), ("pad_token", pad_id), ("unk_token", unk_id)):
        if tid is not None:
            tc[key] = toks[tid]
if fv("tokenizer.chat_template"):
    tc["chat_template"] = fv("tokenizer.chat_template")  # the GGUF's own template wins
json.dump(tc, open(f"{args.out}/tokenizer_config.json", "w"), indent=2, ensure_ascii=False)
print(f"gguf_to_hf: config + tokenizer -> {args.out}", flush=True)
