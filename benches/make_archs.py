"""Synthetic benchmark models for the architectures beyond llama, made with the oracle's own recipe.

usage: $(scripts/oracle/venv.sh) benches/make_archs.py OUT_ROOT [NAME...]   (default: every model)

Each OUT_ROOT/<name>/ is an MLX 4-bit g64 checkpoint written by mlx-lm itself (scripts/oracle/
make_tiny_models.py's `build`: mlx-lm default init, bf16, quantize_model, save_model), random weights
and the tiny test tokenizer (the benchmark feeds token ids; vocab 32000 in the weights).
- llama-0.85b, qwen3_5-0.85b: the same budget (hidden 2048, 16 layers, vocab 32000, untied head), llama
  as benches/make_synthetic.py shapes it, Qwen3.5 with 12 gated-DeltaNet and 4 gated-attention layers,
  its MLP narrowed so that the parameter counts agree within 1%.
- gemma4-moe-top{1,2,4,8}: one Gemma 4 26B-A4B-style model (every layer a dense GeGLU MLP plus 32 routed
  experts) written once with top-1 routing and copied with only `top_k_experts` changed, so the four
  read the same weights but activate 1, 2, 4 or 8 experts per token.
"""
import json
import os
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts/oracle"))
from make_tiny_models import build  # noqa: E402

TOKENIZER = ROOT / "tests/fixtures/tiny/tokenizer"
COMMON = {"hidden_size": 2048, "num_hidden_layers": 16, "vocab_size": 32000, "rms_norm_eps": 1e-6,
          "max_position_embeddings": 8192, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2}
SPEC = {"seed": 0, "gain": 1.0, "embed_gain": 1.0, "group_size": 64, "bits": 4, "overrides": {}}

MODELS = {
    "llama-0.85b": dict(SPEC, config=dict(
        COMMON, model_type="llama", intermediate_size=5632, num_attention_heads=32, num_key_value_heads=8,
        head_dim=64, rope_theta=10000.0, hidden_act="silu")),
    "qwen3_5-0.85b": dict(SPEC, config=dict(
        COMMON, model_type="qwen3_5", intermediate_size=4096, full_attention_interval=4,
        num_attention_heads=8, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
        linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
        hidden_act="silu")),
    "gemma4-moe-top1": dict(SPEC, config=dict(
        COMMON, model_type="gemma4_text", hidden_size=1024, num_hidden_layers=8, intermediate_size=1024,
        num_attention_heads=8, num_key_value_heads=2, head_dim=128, global_head_dim=256,
        attention_k_eq_v=True, num_global_key_value_heads=1, sliding_window=1024,
        layer_types=["sliding_attention", "full_attention"] * 4, hidden_size_per_layer_input=0,
        num_kv_shared_layers=0, vocab_size_per_layer_input=32000, final_logit_softcapping=30.0,
        enable_moe_block=True, num_experts=32, top_k_experts=1, moe_intermediate_size=1024)),
}
MOE_TOP_K = (2, 4, 8)


def main():
    out_root = Path(sys.argv[1])
    names = sys.argv[2:] or list(MODELS) + [f"gemma4-moe-top{k}" for k in MOE_TOP_K]
    for name in names:
        out = out_root / name
        if (out / "config.json").exists():
            print(out)
            continue
        if name in MODELS:
            build(name, MODELS[name], out_root, TOKENIZER)
        else:  # a top-k copy of the MoE model: same weights, another router width
            top_k = int(name.rsplit("top", 1)[1])
            src = out_root / "gemma4-moe-top1"
            if not (src / "config.json").exists():
                build("gemma4-moe-top1", MODELS["gemma4-moe-top1"], out_root, TOKENIZER)
            shutil.copytree(src, out, copy_function=os.link)  # hard links: the weights once on disk
            cfg = json.loads((src / "config.json").read_text())
            cfg["top_k_experts"] = top_k
            (out / "config.json").unlink()  # a link to the source's: replaced, not written through
            (out / "config.json").write_text(json.dumps(cfg, indent=4))
        print(out, flush=True)


if __name__ == "__main__":
    main()
