"""Seeded tiny Qwen3.5 checkpoints (gated-DeltaNet layers between gated full-attention layers) and their goldens.

usage: PY=$(scripts/oracle/venv.sh); $PY scripts/oracle/make_tiny_qwen3_5.py [OUT_ROOT] [NAME...]
  OUT_ROOT default tests/fixtures/tiny (needs OUT_ROOT/tokenizer with encodings.json: make_tiny_tokenizer.py and
  make_goldens.py); NAME default: every model in MODELS

Same recipe as make_tiny_models.py (its `build`: seeded mlx-lm init, gains, randomized norms, bf16 except the
fp32 A_log that Qwen3.5's cast_predicate keeps, affine quantization, mlx-lm's own save) and the same goldens
(make_goldens.py's `golden`: fp32 activations, prompt logits without a cache, 32 greedy steps through mlx-lm's
cache, here ArraysCache for the linear layers). mlx-lm saves the weights under `language_model.` prefixes.
Each linear layer's conv1d weight stays unquantized ([conv_dim, kernel, 1], 3-D); so do dt_bias and A_log.
DERIVED models are rewritten from a built one (e.g. into the Hugging Face layout that mlx-lm's sanitize converts),
with their own goldens; list their source before them when naming models.
"""
import json
import shutil
import sys
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_goldens import golden  # noqa: E402
from make_tiny_models import build, describe  # noqa: E402

# Seeds picked (out of 0..11) for a large minimum top1-top2 margin over the 32 greedy steps (all above 0.06). For
# the MoE model seed 1 rather than 5: with seed 5 oxlm's greedy-step logits differed from mlx-lm's by 1.2e-3 (seed 1:
# 2.4e-4), as the L2 normalization of q and k amplifies rounding where a head's convolution output is near zero.
MODELS = {
    # Qwen3.5 as mlx-community ships it: a `qwen3_5` wrapper with the text model under `text_config`, tied
    # embeddings, 4-bit g64. 6 layers, full attention every 3rd (layers 2 and 5; layer_types agrees); linear
    # layers with 2 key heads x 32 and 4 value heads x 16 (GQA 2, Dk != Dv); gated attention 4/2 heads x 32
    # with partial rotary 0.25 (8 of 32 dims) and the mrope keys real configs carry.
    "qwen3_5-4bit-g64": dict(
        seed=10, gain=4.0, embed_gain=3.0, group_size=64, bits=4, overrides={},
        config={
            "model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"],
            "tie_word_embeddings": True, "eos_token_id": 2, "torch_dtype": "bfloat16",
            "text_config": {
                "model_type": "qwen3_5_text", "hidden_size": 64, "intermediate_size": 128,
                "num_hidden_layers": 6, "full_attention_interval": 3,
                "layer_types": ["linear_attention", "linear_attention", "full_attention"] * 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "attention_bias": False,
                "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 32,
                "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, "rms_norm_eps": 1e-6,
                "vocab_size": 512, "max_position_embeddings": 4096, "tie_word_embeddings": True,
                "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                                    "mrope_section": [2, 1, 1], "mrope_interleaved": True},
                "hidden_act": "silu", "eos_token_id": 2}}),
    # A flat config (no text_config: mlx-lm reads the top level as the text model), untied 4-bit lm_head
    # through a per-module override on its `language_model.` path, 8-bit g32 elsewhere. 5 layers, full attention
    # every 2nd (layers 1 and 3), ending on a linear layer; linear layers with 1 key head x 16 and 4 value heads
    # x 32 (GQA 4); attention 4 heads / 1 KV head x 16, rotary on 4 of 16 dims.
    "qwen3_5-8bit-g32": dict(
        seed=8, gain=4.0, embed_gain=3.0, group_size=32, bits=8,
        overrides={"language_model.lm_head": {"group_size": 64, "bits": 4}},
        config={
            "model_type": "qwen3_5", "architectures": ["Qwen3_5ForCausalLM"], "hidden_size": 64,
            "intermediate_size": 96, "num_hidden_layers": 5, "full_attention_interval": 2,
            "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 16,
            "linear_num_key_heads": 1, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
            "linear_value_head_dim": 32, "linear_conv_kernel_dim": 4, "rms_norm_eps": 1e-6, "vocab_size": 512,
            "max_position_embeddings": 2048, "tie_word_embeddings": False,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "partial_rotary_factor": 0.25},
            "eos_token_id": 2, "torch_dtype": "bfloat16"}),
    # Qwen3.5-MoE: every layer's MLP is a sparse MoE block (4 experts, top 2, renormalized) plus a
    # sigmoid-gated shared expert; routers are 8-bit g64 through the model's own quant_predicate.
    "qwen3_5_moe-4bit-g64": dict(
        seed=1, gain=4.0, embed_gain=3.0, group_size=64, bits=4, overrides={},
        config={
            "model_type": "qwen3_5_moe", "architectures": ["Qwen3_5MoeForConditionalGeneration"],
            "tie_word_embeddings": False, "eos_token_id": 2, "torch_dtype": "bfloat16",
            "text_config": {
                "model_type": "qwen3_5_moe_text", "hidden_size": 64, "num_hidden_layers": 4,
                "full_attention_interval": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
                "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, "num_experts": 4,
                "num_experts_per_tok": 2, "moe_intermediate_size": 64, "shared_expert_intermediate_size": 64,
                "norm_topk_prob": True, "rms_norm_eps": 1e-6, "vocab_size": 512,
                "max_position_embeddings": 4096, "tie_word_embeddings": False,
                "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0,
                                    "partial_rotary_factor": 0.25},
                "eos_token_id": 2}}),
    # Qwen3-Next: mlx-lm's `qwen3_next` saves fused `in_proj_qkvz` / `in_proj_ba` (each key head's rows together)
    # under `model.`; 4 layers, full attention every 2nd; 4 experts top-2 without renormalization (its default)
    # and a gated shared expert, layer 2 dense through `mlp_only_layers`; linear layers with 2 key heads x 16 and
    # 4 value heads x 8 (2 value heads a key head).
    "qwen3_next-4bit-g32": dict(
        seed=3, gain=4.0, embed_gain=3.0, group_size=32, bits=4, overrides={},
        config={
            "model_type": "qwen3_next", "architectures": ["Qwen3NextForCausalLM"], "hidden_size": 64,
            "intermediate_size": 96, "num_hidden_layers": 4, "full_attention_interval": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "attention_bias": False,
            "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
            "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4, "num_experts": 4, "num_experts_per_tok": 2,
            "decoder_sparse_step": 1, "mlp_only_layers": [2], "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 32, "partial_rotary_factor": 0.25, "rope_theta": 10000000.0,
            "rms_norm_eps": 1e-6, "vocab_size": 512, "max_position_embeddings": 4096,
            "tie_word_embeddings": False, "eos_token_id": 2, "torch_dtype": "bfloat16"}),
}

NORM_SUFFIXES = (".input_layernorm.weight", ".post_attention_layernorm.weight", "model.norm.weight", ".q_norm.weight",
                 ".k_norm.weight")


def to_hf_layout(src, out):
    """The checkpoint of `src` as a Hugging Face Qwen3.5 export stores it, for mlx-lm's `sanitize` to undo:
    `model.language_model.*` and `lm_head.*` names, conv1d weights [channels, 1, kernel], RMSNorm weights as offsets
    from 1 (rounded to bf16, so that sanitize's `+ 1` in bf16 need not give back the same bits: the goldens are
    computed from this directory), plus a vision-tower and an MTP array that sanitize drops."""
    out.mkdir(parents=True, exist_ok=True)
    for f in out.iterdir():
        f.unlink()
    weights = {}
    for k, v in mx.load(str(src / "model.safetensors")).items():
        k = k.replace("language_model.model.", "model.language_model.").replace("language_model.lm_head", "lm_head")
        if k.endswith("conv1d.weight"):
            v = v.moveaxis(2, 1)
        elif k.endswith(NORM_SUFFIXES):
            v = v - 1.0
        weights[k] = v
    weights["model.visual.patch_embed.proj.weight"] = mx.zeros((4, 4), dtype=mx.bfloat16)
    weights["mtp.fc.weight"] = mx.zeros((4, 4), dtype=mx.bfloat16)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "pt"})
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / f, out / f)
    return out


# name -> (the model it is made from, how)
DERIVED = {"qwen3_5-hf-layout-8bit-g32": ("qwen3_5-8bit-g32", to_hf_layout)}


def main():
    out_root = Path(sys.argv[1] if len(sys.argv) > 1 else "tests/fixtures/tiny")
    names = sys.argv[2:] or list(MODELS) + list(DERIVED)
    tokdir = out_root / "tokenizer"
    rows = json.loads((tokdir / "encodings.json").read_text(encoding="utf-8"))
    for name in names:
        if name in DERIVED:
            source, make = DERIVED[name]
            out = make(out_root / source, out_root / name)
            info = golden(out, rows)
            print(f"{name} (from {source}):", end="")
        else:
            out = build(name, MODELS[name], out_root, tokdir)
            size, _, dense, bits_groups = describe(out)
            info = golden(out, rows)
            print(f"{name}: model.safetensors {size / 1024:.1f} KiB, (bits, group) used {bits_groups}, dense 2-D: "
                  f"{dense or 'none'}", end="")
        print(f"\n    prompt {info['n_prompt']} tok, greedy {info['greedy_ids']}, distinct "
              f"{len(set(info['greedy_ids']))}/{len(info['greedy_ids'])}, min margin {info['min_margin']:.4f}, "
              f"cache vs cache-free {info['max_abs_diff_step_logits_vs_cache_free_forward']:.2e}", flush=True)


if __name__ == "__main__":
    main()
