"""Seeded random tiny MLX checkpoints (vocab 512, the tiny BPE tokenizer), saved exactly as mlx-lm saves them.

usage: PY=$(scripts/oracle/venv.sh); $PY scripts/oracle/make_tiny_models.py [OUT_ROOT] [NAME...]
  OUT_ROOT default tests/fixtures/tiny (needs OUT_ROOT/tokenizer from make_tiny_tokenizer.py)
  NAME     default: every model in MODELS

Each OUT_ROOT/<name>/ gets config.json (with `quantization` and `quantization_config`), model.safetensors,
model.safetensors.index.json, tokenizer.json, tokenizer_config.json.
Recipe (like assets.md make_tiny.py): mx.random.seed(seed) -> mlx-lm Model(ModelArgs) default init (then the
spec's `init(path, value)`, if it has one) ->
2-D non-embedding weights and stacked MoE experts * GAIN (embedding * EMBED_GAIN), RMSNorm weights
1 + 0.2*N(0,1) (so that a runtime ignoring them fails) -> every float parameter cast to bf16 (except those the
model's cast_predicate keeps) -> mlx_lm.utils.quantize_model (affine unless the spec names a float `mode`, optional
per-module overrides through quant_predicate returning a dict (which may name another mode), else the model's own
quant_predicate) -> mlx_lm.utils.save_model + save_config (of the config as the spec's `on_disk` rewrites it, if it has
one: a form mlx-lm does not read, which make_goldens.py gives it as it does).
"""
import json
import shutil
import sys
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map_with_path
from mlx_lm.utils import _get_classes, quantize_model, save_config, save_model

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}

# Seeds were picked (out of 0..23) for the largest minimum top1-top2 logit margin over the 32 greedy steps of
# make_goldens.py, so that greedy comparisons are robust to float reordering in other runtimes.
# Tokenizer ids: 0 <|endoftext|>, 1 <|im_start|>, 2 <|im_end|>.
GPT_OSS = {
            "model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"], "hidden_size": 64,
            "intermediate_size": 64, "num_local_experts": 4, "num_experts_per_tok": 2, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-5,
            "vocab_size": 512, "sliding_window": 8, "rope_theta": 150000.0,
            "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                             "original_max_position_embeddings": 4096},
            "layer_types": ["sliding_attention", "full_attention"], "max_position_embeddings": 131072,
            "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 2, "torch_dtype": "bfloat16"}

MODELS = {
    # Llama-3.x style: GQA 4/2, untied 8-bit lm_head, llama3 rope scaling (theta 5e5, head_dim 16: of the 8
    # frequency pairs, pair 4 is smoothed and pairs 5..7 are divided by 32), intermediate 96 -> down_proj dense.
    "llama-4bit-g64": dict(
        seed=17, gain=4.0, embed_gain=1.0, group_size=64, bits=4,
        overrides={"lm_head": {"group_size": 64, "bits": 8}},
        config={
            "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
            "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16, "hidden_act": "silu", "rms_norm_eps": 1e-5, "vocab_size": 512,
            "max_position_embeddings": 131072, "rope_theta": 500000.0, "rope_scaling": LLAMA3_ROPE,
            "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False, "tie_word_embeddings": False,
            "bos_token_id": 0, "eos_token_id": [0, 2], "initializer_range": 0.02, "pretraining_tp": 1,
            "torch_dtype": "bfloat16", "use_cache": True}),
    # Plain llama, tied embeddings, 8-bit g32, plain rope (non-traditional), no biases.
    "llama-8bit-g32": dict(
        seed=2, gain=4.0, embed_gain=3.0, group_size=32, bits=8, overrides={},
        config={
            "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16, "hidden_act": "silu", "rms_norm_eps": 1e-6, "vocab_size": 512,
            "max_position_embeddings": 2048, "rope_theta": 10000.0, "rope_scaling": None, "rope_traditional": False,
            "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": True,
            "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16"}),
    # Mistral (mlx-lm maps model_type mistral -> llama), MQA 4/1, untied head, 4-bit g32.
    "mistral-4bit-g32": dict(
        seed=12, gain=4.0, embed_gain=1.0, group_size=32, bits=4, overrides={},
        config={
            "model_type": "mistral", "architectures": ["MistralForCausalLM"], "hidden_size": 64,
            "intermediate_size": 160, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 1,
            "head_dim": 16, "hidden_act": "silu", "rms_norm_eps": 1e-5, "vocab_size": 512,
            "max_position_embeddings": 32768, "rope_theta": 1000000.0, "sliding_window": None,
            "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16"}),
    # Qwen2: q/k/v biases, tied, 4-bit g64 (head_dim = hidden/heads = 16).
    "qwen2-4bit-g64": dict(
        seed=20, gain=4.0, embed_gain=3.0, group_size=64, bits=4, overrides={},
        config={
            "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "hidden_act": "silu", "rms_norm_eps": 1e-6, "vocab_size": 512, "max_position_embeddings": 32768,
            "max_window_layers": 2, "rope_theta": 1000000.0, "rope_scaling": None, "sliding_window": 32768,
            "use_sliding_window": False, "tie_word_embeddings": True, "bos_token_id": 0, "eos_token_id": 2,
            "attention_dropout": 0.0, "torch_dtype": "bfloat16", "use_cache": True}),
    # Qwen3: q/k RMSNorm, 8 heads x head_dim 32 = 256 != hidden 128, tied, 8-bit g128,
    # embedding (and therefore the tied head) 4-bit g64 through a per-module override.
    "qwen3-8bit-g128": dict(
        seed=8, gain=4.0, embed_gain=3.0, group_size=128, bits=8,
        overrides={"model.embed_tokens": {"group_size": 64, "bits": 4, "mode": "affine"}},
        config={
            "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "hidden_size": 128,
            "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2,
            "head_dim": 32, "hidden_act": "silu", "rms_norm_eps": 1e-6, "vocab_size": 512,
            "max_position_embeddings": 40960, "rope_theta": 1000000.0, "rope_scaling": None,
            "attention_bias": False, "attention_dropout": 0.0, "sliding_window": None, "use_sliding_window": False,
            "max_window_layers": 2, "tie_word_embeddings": True, "bos_token_id": 0, "eos_token_id": 2,
            "torch_dtype": "bfloat16", "use_cache": True}),
    # SmolLM2-style lossless GGUF conversion: 4-bit g32 with an 8-bit g32 embedding (= tied head), MHA 4/4.
    "llama-embed8-g32": dict(
        seed=3, gain=4.0, embed_gain=3.0, group_size=32, bits=4,
        overrides={"model.embed_tokens": {"group_size": 32, "bits": 8, "mode": "affine"}},
        config={
            "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
            "head_dim": 16, "hidden_act": "silu", "rms_norm_eps": 1e-5, "vocab_size": 512,
            "max_position_embeddings": 8192, "rope_theta": 100000.0, "rope_scaling": None,
            "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": True,
            "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2, "torch_dtype": "bfloat16"}),
    # mlx-lm's float modes mixed with affine: mxfp4 by default (E2M1 codes, E8M0 scales per 32), an nvfp4 o_proj
    # (E4M3 scales per 16) and an mxfp8 down_proj in layer 0, and an 8-bit g32 affine embedding (= the tied head,
    # run as a linear); per-module overrides carry their `mode`, as mlx-lm writes them.
    "llama-mxfp4-g32": dict(
        seed=8, gain=4.0, embed_gain=3.0, group_size=32, bits=4, mode="mxfp4",
        overrides={"model.embed_tokens": {"group_size": 32, "bits": 8, "mode": "affine"},
                   "model.layers.0.self_attn.o_proj": {"group_size": 16, "bits": 4, "mode": "nvfp4"},
                   "model.layers.0.mlp.down_proj": {"group_size": 32, "bits": 8, "mode": "mxfp8"}},
        config={
            "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16, "hidden_act": "silu", "rms_norm_eps": 1e-5, "vocab_size": 512,
            "max_position_embeddings": 8192, "rope_theta": 10000.0, "rope_scaling": None,
            "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": True,
            "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16"}),
    # --- the llama-like family's other members (crates/models/src/llama.rs `MEMBERS`) ---
    # Qwen3-MoE: q/k norms, 8 experts top-2 renormalized, layer 1 dense through `mlp_only_layers`, 8-bit router.
    "qwen3_moe-4bit-g32": dict(
        seed=5, gain=4.0, embed_gain=3.0, group_size=32, bits=4, overrides={},
        config={
            "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 64,
            "intermediate_size": 128, "moe_intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2,
            "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [1], "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-6,
            "vocab_size": 512, "max_position_embeddings": 40960, "rope_theta": 1000000.0, "rope_scaling": None,
            "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 2, "torch_dtype": "bfloat16"}),
    # Mixtral: 4 experts top-2 under `block_sparse_moe`, GQA 4/2, untied.
    "mixtral-4bit-g32": dict(
        seed=6, gain=4.0, embed_gain=1.0, group_size=32, bits=4, overrides={},
        config={
            "model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "hidden_size": 64,
            "intermediate_size": 64, "num_local_experts": 4, "num_experts_per_tok": 2, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "vocab_size": 512,
            "max_position_embeddings": 32768, "rope_theta": 1000000.0, "tie_word_embeddings": False,
            "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16"}),
    # SmolLM3: llama with no RoPE in every 2nd layer (`no_rope_layer_interval`), tied.
    "smollm3-4bit-g64": dict(
        seed=7, gain=4.0, embed_gain=3.0, group_size=64, bits=4, overrides={},
        config={
            "model_type": "smollm3", "architectures": ["SmolLM3ForCausalLM"], "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "rms_norm_eps": 1e-6, "vocab_size": 512, "max_position_embeddings": 65536, "rope_theta": 5000000.0,
            "no_rope_layer_interval": 2, "tie_word_embeddings": True, "bos_token_id": 0, "eos_token_id": 2,
            "torch_dtype": "bfloat16"}),
    # Phi-3: fused qkv_proj and gate_up_proj, partial rotary (half of each head), untied.
    "phi3-4bit-g32": dict(
        seed=9, gain=4.0, embed_gain=1.0, group_size=32, bits=4, overrides={},
        config={
            "model_type": "phi3", "architectures": ["Phi3ForCausalLM"], "hidden_size": 64,
            "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "partial_rotary_factor": 0.5, "rms_norm_eps": 1e-5, "vocab_size": 512,
            "max_position_embeddings": 4096, "original_max_position_embeddings": 4096, "rope_theta": 10000.0,
            "rope_scaling": None, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
            "torch_dtype": "bfloat16"}),
    # Phi-4-mini's RoPE: LongRoPE (long factors, amplitude from 131072 / 4096) over 3/4 of each head.
    "phi3-longrope-4bit-g32": dict(
        seed=22, gain=4.0, embed_gain=1.0, group_size=32, bits=4, overrides={},
        config={
            "model_type": "phi3", "architectures": ["Phi3ForCausalLM"], "hidden_size": 64,
            "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "partial_rotary_factor": 0.75, "rms_norm_eps": 1e-5, "vocab_size": 512,
            "max_position_embeddings": 131072, "original_max_position_embeddings": 4096, "rope_theta": 10000.0,
            "rope_scaling": {"type": "longrope", "long_factor": [1.0, 1.5, 3.0, 7.5, 16.0, 40.0],
                             "short_factor": [1.0, 1.0, 1.1, 1.2, 1.5, 2.0]},
            "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16"}),
    # Qwen3 with YaRN (factor 4 over 32768): interpolated periods and an mscale the attention scale takes.
    "qwen3-yarn-4bit-g64": dict(
        seed=23, gain=4.0, embed_gain=3.0, group_size=64, bits=4, overrides={},
        config={
            "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16, "rms_norm_eps": 1e-6, "vocab_size": 512, "max_position_embeddings": 131072,
            "rope_theta": 10000.0, "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                                     "original_max_position_embeddings": 32768},
            "tie_word_embeddings": True, "bos_token_id": 0, "eos_token_id": 2, "torch_dtype": "bfloat16"}),
    # OLMo 2: norms after attention and MLP only, q/k norms over all heads, untied.
    "olmo2-4bit-g64": dict(
        seed=10, gain=4.0, embed_gain=1.0, group_size=64, bits=4, overrides={},
        config={
            "model_type": "olmo2", "architectures": ["Olmo2ForCausalLM"], "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
            "rms_norm_eps": 1e-6, "vocab_size": 512, "max_position_embeddings": 4096, "rope_theta": 500000.0,
            "attention_bias": False, "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 2,
            "torch_dtype": "bfloat16"}),
    # OLMo 3: OLMo 2 with a sliding-window layer (window 8, shorter than the prompt) before a global one.
    "olmo3-8bit-g32": dict(
        seed=11, gain=4.0, embed_gain=1.0, group_size=32, bits=8, overrides={},
        config={
            "model_type": "olmo3", "architectures": ["Olmo3ForCausalLM"], "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "rms_norm_eps": 1e-6, "vocab_size": 512, "max_position_embeddings": 65536, "rope_theta": 500000.0,
            "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"],
            "attention_bias": False, "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 2,
            "torch_dtype": "bfloat16"}),
    # Granite: embedding, attention, residual and logit multipliers, tied.
    "granite-4bit-g32": dict(
        seed=13, gain=4.0, embed_gain=1.0, group_size=32, bits=4, overrides={},
        config={
            "model_type": "granite", "architectures": ["GraniteForCausalLM"], "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "rms_norm_eps": 1e-5, "vocab_size": 512, "max_position_embeddings": 4096, "rope_theta": 10000.0,
            "embedding_multiplier": 6.0, "attention_multiplier": 0.125, "residual_multiplier": 0.5,
            "logits_scaling": 2.0, "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": True,
            "bos_token_id": 0, "eos_token_id": 2, "torch_dtype": "bfloat16"}),
    # MiniCPM: scale_emb, scale_depth / sqrt(layers), untied head over hidden / dim_model_base.
    "minicpm-4bit-g64": dict(
        seed=14, gain=4.0, embed_gain=1.0, group_size=64, bits=4, overrides={},
        config={
            "model_type": "minicpm", "architectures": ["MiniCPMForCausalLM"], "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "rms_norm_eps": 1e-5, "vocab_size": 512, "max_position_embeddings": 4096, "rope_theta": 10000.0,
            "dim_model_base": 16, "scale_depth": 1.4, "scale_emb": 4.0, "tie_word_embeddings": False,
            "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16"}),
    # MiniCPM5 as it ships, under model_type llama: transformers-5 `rope_parameters` keyed by layer type (the
    # theta only in `full_attention`'s, no flat `rope_theta`: written so by `on_disk`; mlx-lm's llama reads a flat
    # theta only, so make_goldens.py hands it that one), `layer_types`, head_dim 32 wider than hidden / heads,
    # MQA 4/1, untied head, 4-bit g64.
    "minicpm5-4bit-g64": dict(
        seed=8, gain=4.0, embed_gain=1.0, group_size=64, bits=4, overrides={},
        on_disk=lambda c: {**{k: v for k, v in c.items() if k != "rope_theta"},
                           "rope_parameters": {"full_attention": {"rope_type": "default",
                                                                  "rope_theta": c["rope_theta"]}}},
        config={
            "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 1,
            "head_dim": 32, "hidden_act": "silu", "rms_norm_eps": 1e-6, "vocab_size": 512,
            "max_position_embeddings": 32768, "rope_theta": 5000000.0,
            "layer_types": ["full_attention", "full_attention"], "attention_bias": False, "mlp_bias": False,
            "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16"}),
    # GLM-4: norms before and after each branch, fused gate_up_proj, q/k/v biases, partial interleaved rotary.
    "glm4-4bit-g32": dict(
        seed=15, gain=4.0, embed_gain=1.0, group_size=32, bits=4, overrides={},
        config={
            "model_type": "glm4", "architectures": ["Glm4ForCausalLM"], "hidden_size": 64,
            "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16, "partial_rotary_factor": 0.5, "attention_bias": True, "rms_norm_eps": 1e-5,
            "vocab_size": 512, "max_position_embeddings": 32768, "rope_theta": 10000.0,
            "bos_token_id": 0, "eos_token_id": 2, "torch_dtype": "bfloat16"}),
    # EXAONE 4: post-norm with per-head q/k norms; a windowed RoPE layer ("L") and a global NoPE one ("G").
    "exaone4-4bit-g64": dict(
        seed=16, gain=4.0, embed_gain=1.0, group_size=64, bits=4, overrides={},
        config={
            "model_type": "exaone4", "architectures": ["Exaone4ForCausalLM"], "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16, "rms_norm_eps": 1e-5, "vocab_size": 512, "max_position_embeddings": 65536,
            "rope_theta": 1000000.0, "rope_scaling": None, "sliding_window": 8, "sliding_window_pattern": "LG",
            "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 2, "torch_dtype": "bfloat16"}),
    # ERNIE 4.5: biases on every projection (use_bias), interleaved RoPE pairs, tied.
    "ernie4_5-8bit-g64": dict(
        seed=18, gain=4.0, embed_gain=3.0, group_size=64, bits=8, overrides={},
        config={
            "model_type": "ernie4_5", "architectures": ["Ernie4_5ForCausalLM"], "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16, "rms_norm_eps": 1e-5, "vocab_size": 512, "max_position_embeddings": 131072,
            "rope_theta": 500000.0, "use_bias": True, "tie_word_embeddings": True,
            "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16"}),
    # Seed-OSS: q/k/v biases without an output bias, head_dim 32 != hidden/heads, untied.
    "seed_oss-4bit-g32": dict(
        seed=19, gain=4.0, embed_gain=1.0, group_size=32, bits=4, overrides={},
        config={
            "model_type": "seed_oss", "architectures": ["SeedOssForCausalLM"], "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 32, "rms_norm_eps": 1e-6, "vocab_size": 512, "max_position_embeddings": 65536,
            "rope_theta": 10000000.0, "attention_bias": True, "attention_out_bias": False, "mlp_bias": False,
            "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 2, "torch_dtype": "bfloat16"}),
    # GLM-4.5: a dense first layer, then 8 experts in 2 groups (1 kept) by sigmoid scores with a correction
    # bias, x2.5, beside a shared expert; q/k norms, q/k/v biases, half of each head turning.
    "glm4_moe-4bit-g32": dict(
        seed=24, gain=4.0, embed_gain=1.0, group_size=32, bits=4, overrides={},
        shape_other=lambda path, v: 0.1 * mx.random.normal(v.shape) if "e_score_correction_bias" in path else v,
        config={
            "model_type": "glm4_moe", "architectures": ["Glm4MoeForCausalLM"], "hidden_size": 64,
            "intermediate_size": 96, "moe_intermediate_size": 32, "n_routed_experts": 8, "num_experts_per_tok": 2,
            "n_group": 2, "topk_group": 1, "n_shared_experts": 1, "routed_scaling_factor": 2.5,
            "norm_topk_prob": True, "first_k_dense_replace": 1, "num_hidden_layers": 3,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "partial_rotary_factor": 0.5,
            "use_qk_norm": True, "attention_bias": True, "rms_norm_eps": 1e-5, "vocab_size": 512,
            "max_position_embeddings": 131072, "rope_theta": 1000000.0, "rope_scaling": None,
            "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 2, "torch_dtype": "bfloat16"}),
    # OLMoE: q/k norms over all heads, 8 experts top-2 without renormalization (its default).
    "olmoe-4bit-g32": dict(
        seed=27, gain=4.0, embed_gain=1.0, group_size=32, bits=4, overrides={},
        config={
            "model_type": "olmoe", "architectures": ["OlmoeForCausalLM"], "hidden_size": 64,
            "intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 4, "rms_norm_eps": 1e-5, "vocab_size": 512,
            "max_position_embeddings": 4096, "rope_theta": 10000.0, "tie_word_embeddings": False,
            "bos_token_id": 0, "eos_token_id": 2, "torch_dtype": "bfloat16"}),
    # Granite-MoE: Granite's multipliers, 4 experts top-2 under block_sparse_moe with a `router.layer`.
    "granitemoe-4bit-g32": dict(
        seed=28, gain=4.0, embed_gain=1.0, group_size=32, bits=4, overrides={},
        config={
            "model_type": "granitemoe", "architectures": ["GraniteMoeForCausalLM"], "hidden_size": 64,
            "intermediate_size": 64, "num_local_experts": 4, "num_experts_per_tok": 2, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "vocab_size": 512,
            "max_position_embeddings": 4096, "rope_theta": 10000.0, "embedding_multiplier": 6.0,
            "attention_multiplier": 0.125, "residual_multiplier": 0.5, "logits_scaling": 2.0,
            "attention_bias": False, "tie_word_embeddings": True, "bos_token_id": 0, "eos_token_id": 2,
            "torch_dtype": "bfloat16"}),
    # Hunyuan (dense): q/k norms after the rotation, q/k/v/o biases, NTK-alpha RoPE (alpha 4).
    "hunyuan_v1_dense-4bit-g32": dict(
        seed=29, gain=4.0, embed_gain=1.0, group_size=32, bits=4, overrides={},
        config={
            "model_type": "hunyuan_v1_dense", "architectures": ["HunYuanDenseV1ForCausalLM"], "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16, "rms_norm_eps": 1e-5, "vocab_size": 512, "max_position_embeddings": 32768,
            "rope_theta": 10000.0, "rope_scaling": {"type": "dynamic", "alpha": 4.0, "factor": 1.0},
            "attention_bias": True, "use_qk_norm": True, "tie_word_embeddings": False,
            "bos_token_id": 0, "eos_token_id": 2, "torch_dtype": "bfloat16"}),
    # Gemma 2: Gemma's norms around both branches, GeGLU, soft caps on the attention scores (20, low enough to
    # bite) and on the logits, query_pre_attn_scalar, tied.
    "gemma2-4bit-g32": dict(
        seed=30, gain=2.0, embed_gain=1.0, group_size=32, bits=4, overrides={},
        config={
            "model_type": "gemma2", "architectures": ["Gemma2ForCausalLM"], "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16, "rms_norm_eps": 1e-6, "vocab_size": 512, "rope_theta": 10000.0,
            "attn_logit_softcapping": 20.0, "final_logit_softcapping": 30.0, "query_pre_attn_scalar": 32,
            "max_position_embeddings": 8192, "bos_token_id": 0, "eos_token_id": 2, "torch_dtype": "bfloat16"}),
    # gpt-oss: attention sinks, q/k/v/o biases, a windowed layer (8) then a global one, YaRN x32, 4 biased experts
    # top-2 with the clamped SwiGLU behind an 8-bit biased router; sinks and biases drawn so they matter.
    "gpt_oss-4bit-g32": dict(
        seed=31, gain=4.0, embed_gain=1.0, group_size=32, bits=4, overrides={},
        shape_other=lambda path, v: (mx.random.normal(v.shape) if "sinks" in path
                                     else 0.5 * mx.random.normal(v.shape) if path.endswith("bias") else v),
        config=GPT_OSS),
    # gpt-oss as mlx-community ships it: MXFP4 experts, 8-bit affine elsewhere.
    "gpt_oss-mxfp4-q8": dict(
        seed=31, gain=4.0, embed_gain=1.0, group_size=64, bits=8,
        overrides={f"model.layers.{i}.mlp.experts.{p}": {"group_size": 32, "bits": 4, "mode": "mxfp4"}
                   for i in range(2) for p in ("gate_proj", "up_proj", "down_proj")},
        shape_other=lambda path, v: (mx.random.normal(v.shape) if "sinks" in path
                                     else 0.5 * mx.random.normal(v.shape) if path.endswith("bias") else v),
        config=GPT_OSS),
    # ERNIE 4.5-MoE: the first layer dense (moe_layer_start_index 1), then 4 experts top-2 by a softmax beside a
    # shared expert; interleaved RoPE pairs.
    "ernie4_5_moe-4bit-g32": dict(
        seed=36, gain=4.0, embed_gain=1.0, group_size=32, bits=4, overrides={},
        config={
            "model_type": "ernie4_5_moe", "architectures": ["Ernie4_5_MoeForCausalLM"], "hidden_size": 64,
            "intermediate_size": 96, "moe_intermediate_size": 32, "moe_num_experts": 4, "moe_k": 2,
            "moe_num_shared_experts": 1, "moe_layer_start_index": 1, "moe_layer_interval": 1,
            "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "rms_norm_eps": 1e-5, "vocab_size": 512, "max_position_embeddings": 131072, "rope_theta": 500000.0,
            "use_bias": False, "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2,
            "torch_dtype": "bfloat16"}),
    # Ministral 3 in Mistral 3's wrapper: YaRN in rope_parameters, Llama 4's query scale past an original context
    # of 16 positions (the prompt and the greedy steps cross 16, 32 and 64), a windowed layer (8) and a global one.
    "ministral3-4bit-g32": dict(
        seed=26, gain=4.0, embed_gain=1.0, group_size=32, bits=4, overrides={},
        config={
            "model_type": "mistral3", "architectures": ["Mistral3ForConditionalGeneration"],
            "text_config": {
                "model_type": "ministral3", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-5,
                "vocab_size": 512, "max_position_embeddings": 262144, "sliding_window": 8,
                "layer_types": ["sliding_attention", "full_attention"],
                "rope_parameters": {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 16.0,
                                    "original_max_position_embeddings": 16, "llama_4_scaling_beta": 0.1,
                                    "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.0}},
            "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16"}),
    # DeepSeek-V3: multi-head latent attention (queries through a rank-32 bottleneck, a 64-wide latent and a
    # 16-wide rotated key part shared by the heads, YaRN with DeepSeek's mscale_all_dim), a dense first layer,
    # then 8 experts in 2 groups (1 kept) by corrected sigmoid scores x2.5 beside a shared expert.
    "deepseek_v3-4bit-g32": dict(
        seed=25, gain=4.0, embed_gain=1.0, group_size=32, bits=4, overrides={},
        shape_other=lambda path, v: 0.1 * mx.random.normal(v.shape) if "e_score_correction_bias" in path else v,
        config={
            "model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 512,
            "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 4, "n_shared_experts": 1, "n_routed_experts": 8,
            "routed_scaling_factor": 2.5, "kv_lora_rank": 64, "q_lora_rank": 32, "qk_rope_head_dim": 16,
            "v_head_dim": 32, "qk_nope_head_dim": 32, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
            "norm_topk_prob": True, "n_group": 2, "topk_group": 1, "num_experts_per_tok": 2, "moe_layer_freq": 1,
            "first_k_dense_replace": 1, "max_position_embeddings": 16384, "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0, "rope_scaling": {"type": "yarn", "factor": 4.0, "mscale": 1.0,
                                                   "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                                                   "beta_fast": 32, "beta_slow": 1},
            "attention_bias": False, "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 2,
            "torch_dtype": "bfloat16"}),
    # Llama 4 (text): RoPE layers (interleaved, llama3 scaling) with weightless q/k norms after the rotation and
    # chunked attention over chunks of 8 (the prompt and the greedy steps cross several), every 4th layer global
    # without RoPE and with its queries temperature-tuned past multiples of floor_scale 8; a top-1 sigmoid-routed
    # mixture (each token's input weighted) beside a shared expert in every 2nd layer, dense MLPs of
    # intermediate_size_mlp between, under `language_model.` with `feed_forward` names.
    "llama4-4bit-g32": dict(
        seed=4, gain=4.0, embed_gain=1.0, group_size=32, bits=4, overrides={},
        shape_other=lambda path, v: v * 4.0 if v.ndim == 3 else v,
        config={
            "model_type": "llama4", "architectures": ["Llama4ForConditionalGeneration"],
            "text_config": {
                "model_type": "llama4_text", "hidden_size": 64, "intermediate_size": 64,
                "intermediate_size_mlp": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
                "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-5, "vocab_size": 512,
                "max_position_embeddings": 10485760, "rope_theta": 500000.0,
                "rope_scaling": {"rope_type": "llama3", "factor": 16.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 1.0, "original_max_position_embeddings": 8192},
                "attention_bias": False, "attention_chunk_size": 8, "interleave_moe_layer_step": 2,
                "num_local_experts": 4, "num_experts_per_tok": 1, "use_qk_norm": True,
                "attn_temperature_tuning": True, "floor_scale": 8, "attn_scale": 0.1,
                "tie_word_embeddings": False},
            "bos_token_id": 0, "eos_token_id": 2, "torch_dtype": "bfloat16"}),
    # Granite 4.0-H (granitemoehybrid): Mamba-2 layers (8 heads of 16 in 2 groups, state 32, conv 4 with a bias)
    # around a NoPE attention layer, each followed by top-2 of 4 experts (8-bit router) beside a shared MLP; Granite's
    # multipliers; tied. The heads' A_log, dt_bias and D drawn at random.
    "granitemoehybrid-4bit-g32": dict(
        seed=1, gain=4.0, embed_gain=1.0, group_size=32, bits=4, overrides={},
        shape_other=lambda path, v: (v * 4.0 if v.ndim == 3 and "switch_mlp" in path
                                     else mx.random.uniform(-2.0, 1.5, v.shape) if path.endswith("A_log")
                                     else mx.random.normal(v.shape) if path.endswith(("dt_bias", ".D"))
                                     else v),
        config={
            "model_type": "granitemoehybrid", "architectures": ["GraniteMoeHybridForCausalLM"], "hidden_size": 64,
            "intermediate_size": 32, "shared_intermediate_size": 64, "num_hidden_layers": 4,
            "layer_types": ["mamba", "attention", "mamba", "mamba"], "num_attention_heads": 4,
            "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
            "attention_bias": False, "embedding_multiplier": 3.0, "attention_multiplier": 0.2,
            "logits_scaling": 2.0, "residual_multiplier": 0.5, "num_local_experts": 4, "num_experts_per_tok": 2,
            "mamba_n_heads": 8, "mamba_d_head": 16, "mamba_proj_bias": False, "mamba_d_state": 32,
            "mamba_d_conv": 4, "mamba_n_groups": 2, "mamba_conv_bias": True, "position_embedding_type": "nope",
            "tie_word_embeddings": True, "bos_token_id": 0, "eos_token_id": 2, "torch_dtype": "bfloat16"}),
    # Its dense form (Granite 4.0-H Micro's shape): SwiGLU MLPs, RoPE on the attention layers, biased projections,
    # an untied head, the step clipped to [0.5, 2].
    "granitemoehybrid-dense-8bit-g64": dict(
        seed=9, gain=4.0, embed_gain=1.0, group_size=64, bits=8, overrides={},
        shape_other=lambda path, v: (mx.random.uniform(-2.0, 1.5, v.shape) if path.endswith("A_log")
                                     else mx.random.normal(v.shape) if path.endswith(("dt_bias", ".D"))
                                     else 0.5 * mx.random.normal(v.shape) if path.endswith("bias") else v),
        config={
            "model_type": "granitemoehybrid", "architectures": ["GraniteMoeHybridForCausalLM"], "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 3, "layer_types": ["mamba", "mamba", "attention"],
            "num_attention_heads": 4, "num_key_value_heads": 1, "vocab_size": 512, "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-5, "attention_bias": False, "embedding_multiplier": 2.0, "attention_multiplier": 0.25,
            "logits_scaling": 1.5, "residual_multiplier": 0.7, "mamba_n_heads": 4, "mamba_d_head": 32,
            "mamba_proj_bias": True, "mamba_d_state": 64, "mamba_d_conv": 3, "mamba_n_groups": 1,
            "mamba_conv_bias": False, "position_embedding_type": "rope", "rope_theta": 10000.0,
            "time_step_limit": [0.5, 2.0], "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 2,
            "torch_dtype": "bfloat16"}),
    # Nemotron-H (nemotron_h, dense: Nemotron Nano 9B v2's kind): Mamba-2 layers (8 heads of 16 in 2 groups, so the
    # gated norm works per group of 64; state 32, conv 4 with a bias), a NoPE attention layer and relu^2 MLPs, one
    # block each as hybrid_override_pattern spells it; the step unclipped (time_step_limit [0, Infinity], as
    # transformers writes it).
    "nemotron_h-4bit-g32": dict(
        seed=2, gain=4.0, embed_gain=1.0, group_size=32, bits=4, overrides={},
        shape_other=lambda path, v: (mx.random.uniform(-2.0, 1.5, v.shape) if path.endswith("A_log")
                                     else mx.random.normal(v.shape) if path.endswith(("dt_bias", ".D"))
                                     else v),
        config={
            "model_type": "nemotron_h", "architectures": ["NemotronHForCausalLM"], "hidden_size": 64,
            "intermediate_size": 128, "hybrid_override_pattern": "M-M*-M", "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512, "max_position_embeddings": 4096,
            "layer_norm_epsilon": 1e-5, "attention_bias": False, "mlp_bias": False, "use_bias": False,
            "mamba_num_heads": 8, "mamba_head_dim": 16, "mamba_proj_bias": False, "ssm_state_size": 32,
            "conv_kernel": 4, "n_groups": 2, "use_conv_bias": True, "time_step_limit": [0.0, float("inf")],
            "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 2, "torch_dtype": "bfloat16"}),
    # Nemotron 3 (nemotron_h with mixtures): M E * E blocks; each E routes to 2 of 8 relu^2 experts (2 groups, 1 kept,
    # sigmoid scores with a correction bias, renormalized, x2.5) in a latent space of 32, beside a shared expert.
    "nemotron_h-moe-4bit-g32": dict(
        seed=4, gain=4.0, embed_gain=1.0, group_size=32, bits=4, overrides={},
        shape_other=lambda path, v: (mx.random.uniform(-2.0, 1.5, v.shape) if path.endswith("A_log")
                                     else mx.random.normal(v.shape) if path.endswith(("dt_bias", ".D"))
                                     else 0.1 * mx.random.normal(v.shape) if "e_score_correction_bias" in path
                                     else v),
        config={
            "model_type": "nemotron_h", "architectures": ["NemotronHForCausalLM"], "hidden_size": 64,
            "intermediate_size": 128, "hybrid_override_pattern": "ME*E", "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512, "max_position_embeddings": 4096,
            "layer_norm_epsilon": 1e-5, "attention_bias": False, "mlp_bias": False, "use_bias": False,
            "mamba_num_heads": 8, "mamba_head_dim": 16, "mamba_proj_bias": False, "ssm_state_size": 32,
            "conv_kernel": 4, "n_groups": 1, "use_conv_bias": True, "n_routed_experts": 8, "num_experts_per_tok": 2,
            "moe_intermediate_size": 32, "moe_shared_expert_intermediate_size": 64, "n_shared_experts": 1,
            "moe_latent_size": 32, "n_group": 2, "topk_group": 1, "norm_topk_prob": True,
            "routed_scaling_factor": 2.5, "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 2,
            "torch_dtype": "bfloat16"}),
    # Mistral Small 3.x's wrapper: a mistral text model under `language_model.`, settings under text_config.
    "mistral3-4bit-g32": dict(
        seed=21, gain=4.0, embed_gain=1.0, group_size=32, bits=4, overrides={},
        config={
            "model_type": "mistral3", "architectures": ["Mistral3ForConditionalGeneration"],
            "text_config": {
                "model_type": "mistral", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-5,
                "vocab_size": 512, "max_position_embeddings": 131072, "rope_theta": 1000000000.0,
                "sliding_window": None, "tie_word_embeddings": False},
            "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16"}),
    # --- LFM2 (crates/models/src/lfm2.rs): gated short-convolution layers between GQA attention layers ---
    # (seeds out of 0..11 for the largest minimum greedy margin)
    # LFM2 as Liquid ships it: `layer_types` (conv conv attn conv attn conv), GQA 4/2 x 16 with q/k norms,
    # conv_L_cache 3, no biases, feed-forward width auto-adjusted
    # (int(1.5 * int(2 * 160 / 3)) = 159 -> a multiple of 32: 160, so w2 stays dense), always-tied head, 4-bit g64.
    "lfm2-4bit-g64": dict(
        seed=2, gain=4.0, embed_gain=3.0, group_size=64, bits=4, overrides={},
        config={
            "model_type": "lfm2", "architectures": ["Lfm2ForCausalLM"], "hidden_size": 64, "vocab_size": 512,
            "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2,
            "layer_types": ["conv", "conv", "full_attention", "conv", "full_attention", "conv"],
            "max_position_embeddings": 128000, "norm_eps": 1e-5, "conv_bias": False, "conv_L_cache": 3,
            "block_dim": 64, "block_ff_dim": 160, "block_multiple_of": 32, "block_ffn_dim_multiplier": 1.5,
            "block_auto_adjust_ff_dim": True, "rope_theta": 1000000.0, "tie_embedding": True,
            "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "torch_dtype": "bfloat16"}),
    # `full_attn_idxs` starting on an attention layer (attn conv attn conv), MQA 4/1, biases on the convolution
    # and its projections (randomized conv bias: mlx inits it to zeros), `intermediate_size` used as is
    # (no auto-adjust), transformers-5 `rope_parameters`, 8-bit g32.
    "lfm2-8bit-g32": dict(
        seed=3, gain=4.0, embed_gain=3.0, group_size=32, bits=8, overrides={},
        shape_other=lambda path, v: 0.5 * mx.random.normal(v.shape) if path.endswith("conv.conv.bias") else v,
        config={
            "model_type": "lfm2", "architectures": ["Lfm2ForCausalLM"], "hidden_size": 64, "vocab_size": 512,
            "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 1, "full_attn_idxs": [0, 2],
            "max_position_embeddings": 32768, "norm_eps": 1e-5, "conv_bias": True, "conv_L_cache": 3,
            "block_dim": 64, "intermediate_size": 96, "block_multiple_of": 256, "block_ffn_dim_multiplier": 1.0,
            "block_auto_adjust_ff_dim": False,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
            "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16"}),
    # LFM2-MoE: a dense first layer (`num_dense_layers`), then mixtures of 4 experts (top 2) routed by a sigmoid,
    # chosen with a (randomized: mlx inits it to zeros) f32 `expert_bias`, weights renormalized and scaled by
    # `routed_scaling_factor` 1.5; 8-bit router through the model's quant_predicate. conv conv attn conv. Seed
    # out of 0..11 as for LFM2.
    "lfm2_moe-4bit-g64": dict(
        seed=9, gain=4.0, embed_gain=3.0, group_size=64, bits=4, overrides={},
        shape_other=lambda path, v: 0.5 * mx.random.normal(v.shape) if path.endswith("expert_bias") else v,
        config={
            "model_type": "lfm2_moe", "architectures": ["Lfm2MoeForCausalLM"], "hidden_size": 64,
            "vocab_size": 512, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
            "layer_types": ["conv", "conv", "full_attention", "conv"], "max_position_embeddings": 128000,
            "norm_eps": 1e-5, "conv_bias": False, "conv_L_cache": 3, "intermediate_size": 128,
            "moe_intermediate_size": 64, "num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": True,
            "use_expert_bias": True, "num_dense_layers": 1, "routed_scaling_factor": 1.5,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
            "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "torch_dtype": "bfloat16"}),
}


def build(name, spec, out_root, tokdir):
    cfg = json.loads(json.dumps(spec["config"]))
    mx.random.seed(spec["seed"])
    Model, Args = _get_classes(cfg)
    model = Model(Args.from_dict(cfg))
    if "init" in spec:  # the spec's own start for parameters, e.g. what mlx-lm initializes to zeros
        model.update(tree_map_with_path(spec["init"], model.parameters()))
    gain, egain = spec["gain"], spec["embed_gain"]

    def shape_weights(path, v):
        if v.ndim == 2 or (v.ndim == 3 and "switch_mlp" in path):  # 3-D: stacked MoE experts
            return v * (egain if "embed_tokens" in path else gain)
        if v.ndim == 1 and "norm" in path:
            return 1.0 + 0.2 * mx.random.normal(v.shape)
        # other parameters (scalars, 3-D expert weights) as the spec says, if it says
        return spec["shape_other"](path, v) if "shape_other" in spec else v

    # tree_map visits parameters in a fixed (sorted) order, so the normal draws are reproducible
    model.update(tree_map_with_path(shape_weights, model.parameters()))
    # as mlx_lm.convert does, leave out what the model's cast_predicate keeps (Qwen3.5's A_log stays fp32)
    cast = getattr(model, "cast_predicate", lambda k: True)
    model.update(tree_map_with_path(
        lambda k, v: v.astype(mx.bfloat16) if cast(k) and mx.issubdtype(v.dtype, mx.floating) else v,
        model.parameters()))
    mx.eval(model.parameters())

    overrides = spec["overrides"]

    model_predicate = getattr(model, "quant_predicate", None)  # e.g. 8-bit MoE routers, as mlx_lm.convert

    def predicate(path, module):
        if path in overrides:
            return dict(overrides[path])
        return model_predicate(path, module) if model_predicate else True

    model, qcfg = quantize_model(model, cfg, group_size=spec["group_size"], bits=spec["bits"],
                                 mode=spec.get("mode", "affine"), quant_predicate=predicate)
    out = Path(out_root) / name
    if out.exists():
        for f in out.iterdir():
            if f.name.startswith("model") or f.name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
                f.unlink()
    save_model(out, model)
    save_config(spec.get("on_disk", lambda c: c)(qcfg), out / "config.json")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(tokdir) / f, out / f)
    return out


def describe(out):
    w = mx.load(str(out / "model.safetensors"))
    cfg = json.loads((out / "config.json").read_text())
    q = cfg["quantization"]
    quantized, dense = {}, []
    for k in sorted(w):
        if k.endswith(".scales"):
            base = k[: -len(".scales")]
            wt, sc = w[base + ".weight"], w[k]
            # infer like mlx_lm.utils.infer_quant_config: in_dims from the override/default group size
            g = q.get(base, q)["group_size"]
            in_dims = sc.shape[-1] * g
            bits = wt.shape[-1] * 32 // in_dims
            quantized[base] = (bits, g)
        elif k.endswith(".weight") and w[k].ndim == 2 and k[: -len(".weight")] + ".scales" not in w:
            dense.append(f"{k} {tuple(w[k].shape)} {w[k].dtype}")
    size = (out / "model.safetensors").stat().st_size
    bits_groups = sorted({v for v in quantized.values()})
    return size, quantized, dense, bits_groups


def main():
    out_root = Path(sys.argv[1] if len(sys.argv) > 1 else "tests/fixtures/tiny")
    names = sys.argv[2:] or list(MODELS)
    tokdir = out_root / "tokenizer"
    assert (tokdir / "tokenizer.json").exists(), f"run make_tiny_tokenizer.py first ({tokdir})"
    for name in names:
        out = build(name, MODELS[name], out_root, tokdir)
        size, quantized, dense, bg = describe(out)
        cfg = json.loads((out / "config.json").read_text())
        per_module = {k: v for k, v in cfg["quantization"].items() if isinstance(v, dict)}
        print(f"{name}: {cfg['model_type']} model.safetensors {size/1024:.1f} KiB; quantization "
              f"{ {k: v for k, v in cfg['quantization'].items() if not isinstance(v, dict)} } overrides {per_module}; "
              f"(bits, group) used {bg}; dense 2-D: {dense or 'none'}", flush=True)
        for base, (b, g) in quantized.items():
            exp = cfg["quantization"].get(base, cfg["quantization"])
            assert (b, g) == (exp["bits"], exp["group_size"]), (base, b, g, exp)


if __name__ == "__main__":
    main()
