"""Golden fixtures for `oxlm convert`: tiny Hugging Face-layout checkpoints and what `mlx_lm convert` makes of them.

usage: PY=$(scripts/oracle/venv.sh); $PY scripts/oracle/make_convert_fixtures.py [--keep DIR] [OUT_ROOT] [CASE...]
  OUT_ROOT default tests/fixtures/convert; CASE default: every case in CASES
  --keep DIR  also keep the converted checkpoints, as DIR/<case>/<flagset>/ (for debugging; never committed)

For each case, OUT_ROOT/<case>/source/ gets a seeded random checkpoint as a user downloads it from the hub, i.e.
in transformers' layout, before mlx-lm's `sanitize`: config.json (`torch_dtype`), generation_config.json,
model.safetensors (metadata {"format": "pt"}; `llama`: two shards and model.safetensors.index.json),
tokenizer.json and tokenizer_config.json (the tiny BPE of tests/fixtures/tiny/llama-4bit-g64).
Tensor names are mlx-lm's own parameter names (the same as transformers' for these architectures) run backwards
through each model's sanitize (`hf_shapes`): MoE experts unstacked (`mlp.experts.N.gate_proj`, mixtral's
`block_sparse_moe.experts.N.w1/w2/w3`, LFM2-MoE's `feed_forward.experts.N.w1/w2/w3`) or fused (Qwen3.5-MoE's and
Gemma 4's `experts.gate_up_proj` [E, 2I, H], Granite-MoE's `input_linear`, gpt-oss's MXFP4 `gate_up_proj_blocks`
with gate and up rows interleaved), DeepSeek's `kv_b_proj` rebuilt from `embed_q` / `unembed_out`, rotary
`inv_freq` buffers added (llama, smollm3), an `lm_head.weight` (= the embedding) added to the tied llama, conv
weights as `[channels, 1, kernel]` (LFM2, Qwen3-Next, Qwen3.5), the multimodal wrappers' hub names (Qwen3.5's and
Gemma 4's `model.language_model.*`, mistral3's and Gemma 3's legacy `language_model.model.*`) plus vision / audio /
multi-token-prediction tensors that sanitize drops (`extra`), Gemma 4's KV-shared layers' own K/V. Values: numpy
`default_rng(seed)`, weights and biases 0.02*N(0,1), norm weights 1 + 0.1*N (Gemma's, and `norm_base=0.0` cases'
stored as offsets from 1: 0.1*N), rounded to bfloat16 (float32 for `float32-source` and the `f32` suffixes: A_log,
routing biases), MXFP4 blocks and E8M0 scales as random bytes.

Then, per flag set, the real converter runs in-process exactly as `mlx_lm convert --hf-path SRC --mlx-path TMP ARGS`
does (`configure_parser().parse_args` -> `convert(**vars(args))`) and OUT_ROOT/<case>/expected/<flagset>.json records
  args       the `mlx_lm convert` flags (oxlm convert takes the same)
  source     only where the input was not source/: the flag set whose output was converted (dequantize-q4: "q4")
  config     the written config.json, parsed
  index      the written model.safetensors.index.json, parsed
  files      sorted names of every file written
  text_files sha256 of every written file that is not a safetensors shard (README.md, tokenizer files, ...)
  tensors    per tensor of every written shard: dtype (safetensors spelling), shape, sha256 of the stored bytes
The converted checkpoints are reloaded with mlx_lm.load as a check. Deterministic: rerunning gives identical files.
"""
import hashlib
import json
import shutil
import struct
import sys
import tempfile
from pathlib import Path

import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.convert import configure_parser, convert
from mlx_lm.utils import _get_classes, load
from safetensors import TensorSpec, serialize_file

TOKENIZER_DIR = Path("tests/fixtures/tiny/llama-4bit-g64")
TRANSFORMERS_VERSION = "4.51.3"  # what the source configs claim to come from (copied through by convert)

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}


def llama(**kw):
    cfg = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
           "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 16, "hidden_act": "silu", "rms_norm_eps": 1e-5, "vocab_size": 512,
           "max_position_embeddings": 8192, "rope_theta": 10000.0, "rope_scaling": None, "attention_bias": False,
           "mlp_bias": False, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
           "torch_dtype": "bfloat16"}
    cfg.update(kw)
    return cfg


Q4 = ["-q"]
DEQ = {"args": ["-d"], "source": "q4"}

# case -> seed, config (as transformers writes it), flag sets (name -> mlx_lm convert flags, or a dict with the
# flags and the flag set whose output is the input), and optional: shards, generation eos, extra source tensors.
CASES = {
    # Llama 3 style: untied head, llama3 rope scaling, inv_freq buffers to drop, two source shards, intermediate 128
    # (so with group 128 only down_proj can be quantized), generation_config eos [0, 2] (convert copies it into
    # config.json's eos_token_id).
    "llama": dict(
        seed=1, shards=2, generation_eos=[0, 2],
        config=llama(intermediate_size=128, rope_theta=500000.0, rope_scaling=LLAMA3_ROPE, bos_token_id=0,
                     max_position_embeddings=131072),
        flagsets={"bf16": [], "q4": Q4, "q8-g32": ["-q", "--q-bits", "8", "--q-group-size", "32"],
                  "q3-g128": ["-q", "--q-bits", "3", "--q-group-size", "128"],
                  "mixed_3_6": ["-q", "--quant-predicate", "mixed_3_6"],
                  "mixed_2_6-g32": ["-q", "--quant-predicate", "mixed_2_6", "--q-group-size", "32"],
                  "mxfp4": ["-q", "--q-mode", "mxfp4"], "nvfp4": ["-q", "--q-mode", "nvfp4"],
                  "mxfp8": ["-q", "--q-mode", "mxfp8"], "f16": ["--dtype", "float16"],
                  "f32": ["--dtype", "float32"], "dequantize-q4": DEQ}),
    # Tied llama whose checkpoint still holds an lm_head.weight (= the embedding): sanitize drops it.
    "llama-tied": dict(
        seed=2, redundant_head=True, config=llama(tie_word_embeddings=True), flagsets={"bf16": [], "q4": Q4}),
    # Qwen2: q/k/v biases, tied.
    "qwen2": dict(
        seed=3, config={
            "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": 64,
            "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "hidden_act": "silu", "rms_norm_eps": 1e-6, "vocab_size": 512, "max_position_embeddings": 32768,
            "max_window_layers": 2, "rope_theta": 1000000.0, "rope_scaling": None, "sliding_window": 32768,
            "use_sliding_window": False, "tie_word_embeddings": True, "bos_token_id": 0, "eos_token_id": 2,
            "attention_dropout": 0.0, "torch_dtype": "bfloat16", "use_cache": True},
        flagsets={"q4": Q4}),
    # Qwen3: q/k RMSNorms, tied.
    "qwen3": dict(
        seed=4, config={
            "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "hidden_size": 64,
            "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16, "hidden_act": "silu", "rms_norm_eps": 1e-6, "vocab_size": 512,
            "max_position_embeddings": 40960, "rope_theta": 1000000.0, "rope_scaling": None,
            "attention_bias": False, "attention_dropout": 0.0, "sliding_window": None, "use_sliding_window": False,
            "max_window_layers": 2, "tie_word_embeddings": True, "bos_token_id": 0, "eos_token_id": 2,
            "torch_dtype": "bfloat16", "use_cache": True},
        flagsets={"q4": Q4, "mixed_4_6": ["-q", "--quant-predicate", "mixed_4_6"],
                  "mixed_3_4": ["-q", "--quant-predicate", "mixed_3_4"]}),
    # Qwen3-MoE: layer 0 a mixture of 4 unstacked experts (moe_intermediate 64) behind the `mlp.gate` router (the
    # model's quant_predicate: 8 bits), layer 1 dense through `mlp_only_layers`; tied to stay small.
    "qwen3_moe": dict(
        seed=5, config={
            "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 64,
            "intermediate_size": 64, "moe_intermediate_size": 64, "num_experts": 4, "num_experts_per_tok": 2,
            "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [1], "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-6,
            "vocab_size": 512, "max_position_embeddings": 40960, "rope_theta": 1000000.0, "rope_scaling": None,
            "tie_word_embeddings": True, "bos_token_id": 0, "eos_token_id": 2, "torch_dtype": "bfloat16"},
        flagsets={"bf16": [], "q4": Q4}),
    # Mixtral: 4 experts per layer under block_sparse_moe (w1/w2/w3), intermediate 32: with the default group 64
    # the experts' w2 (in 32) stays bf16, with group 32 every expert is quantized; no quant_predicate, so the router
    # gets the default bits. Tied (no head in the checkpoint) to stay small.
    "mixtral": dict(
        seed=6, config={
            "model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "hidden_size": 64,
            "intermediate_size": 32, "num_local_experts": 4, "num_experts_per_tok": 2, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "vocab_size": 512,
            "max_position_embeddings": 32768, "rope_theta": 1000000.0, "tie_word_embeddings": True,
            "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16"},
        flagsets={"q4": Q4, "q4-g32": ["-q", "--q-group-size", "32"]}),
    # Gemma 3 (text): tied, no lm_head in the checkpoint (sanitize then drops mlx-lm's lm_head module).
    "gemma3_text": dict(
        seed=7, config={
            "model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"], "hidden_size": 64,
            "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16, "rms_norm_eps": 1e-6, "vocab_size": 512, "max_position_embeddings": 32768,
            "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "rope_scaling": None,
            "query_pre_attn_scalar": 16, "sliding_window": 512, "sliding_window_pattern": 6,
            "hidden_activation": "gelu_pytorch_tanh", "attention_bias": False, "final_logit_softcapping": None,
            "attn_logit_softcapping": None, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
            "torch_dtype": "bfloat16"},
        flagsets={"q4": Q4}),
    # Phi-3 (Phi-4-mini style, tied): fused qkv_proj and gate_up_proj.
    "phi3": dict(
        seed=8, config={
            "model_type": "phi3", "architectures": ["Phi3ForCausalLM"], "hidden_size": 64,
            "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "partial_rotary_factor": 0.5, "rms_norm_eps": 1e-5, "vocab_size": 512,
            "max_position_embeddings": 4096, "original_max_position_embeddings": 4096, "rope_theta": 10000.0,
            "rope_scaling": None, "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2,
            "pad_token_id": 0, "torch_dtype": "bfloat16"},
        flagsets={"q4": Q4}),
    # Mistral 3 (Mistral Small 3.1 layout): a mistral text model under `language_model.`, a vision tower and a
    # projector (dropped by sanitize, vision_config dropped by save_config), top-level torch_dtype only.
    "mistral3": dict(
        seed=9, config={
            "model_type": "mistral3", "architectures": ["Mistral3ForConditionalGeneration"],
            "text_config": {
                "model_type": "mistral", "hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-5,
                "vocab_size": 512, "max_position_embeddings": 131072, "rope_theta": 1000000000.0,
                "sliding_window": None, "tie_word_embeddings": False},
            "vision_config": {
                "model_type": "pixtral", "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
                "num_attention_heads": 2, "head_dim": 8, "image_size": 16, "patch_size": 4, "num_channels": 3,
                "rope_theta": 10000.0},
            "image_token_index": 10, "multimodal_projector_bias": False, "projector_hidden_act": "gelu",
            "spatial_merge_size": 2, "vision_feature_layer": -1, "bos_token_id": 1, "eos_token_id": 2,
            "torch_dtype": "bfloat16"},
        extra={  # vision tower and projector tensors (a subset of pixtral's), all dropped by sanitize
            "vision_tower.patch_conv.weight": (16, 3, 4, 4),
            "vision_tower.ln_pre.weight": (16,),
            "vision_tower.transformer.layers.0.attention.q_proj.weight": (16, 16),
            "vision_tower.transformer.layers.0.attention_norm.weight": (16,),
            "multi_modal_projector.norm.weight": (16,),
            "multi_modal_projector.patch_merger.merging_layer.weight": (16, 64),
            "multi_modal_projector.linear_1.weight": (64, 16),
            "multi_modal_projector.linear_2.weight": (64, 64)},
        flagsets={"q4": Q4}),
    # LFM2: a short-conv layer then an attention layer (layer_types), auto-adjusted feed-forward width
    # (int(1.0 * int(2 * 96 / 3)) = 64, a multiple of 64), conv weights in HF's [64, 1, 3], always tied.
    "lfm2": dict(
        seed=10, config={
            "model_type": "lfm2", "architectures": ["Lfm2ForCausalLM"], "hidden_size": 64, "vocab_size": 512,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "layer_types": ["conv", "full_attention"], "max_position_embeddings": 128000, "norm_eps": 1e-5,
            "conv_bias": False, "conv_L_cache": 3, "block_dim": 64, "block_ff_dim": 96, "block_multiple_of": 64,
            "block_ffn_dim_multiplier": 1.0, "block_auto_adjust_ff_dim": True, "rope_theta": 1000000.0,
            "tie_embedding": True, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
            "torch_dtype": "bfloat16"},
        flagsets={"bf16": [], "q4": Q4}),
    # A float32 checkpoint (torch_dtype float32; one layer, tied, MQA to stay small): no flags keep float32, -q
    # quantizes with float32 scales and biases.
    "float32-source": dict(
        seed=11, dtype="float32", config=llama(tie_word_embeddings=True, num_key_value_heads=1, num_hidden_layers=1,
                                               torch_dtype="float32"),
        flagsets={"bf16": [], "q4": Q4}),

    # ---- the hybrid and mixture architectures ----
    # Qwen3-Next: a gated-DeltaNet layer (HF conv1d [96, 1, 4], which sanitize turns into [96, 4, 1]) then a
    # gated-attention layer; layer 0 a mixture of 4 unstacked experts behind the `mlp.gate` router and a shared
    # expert with its `shared_expert_gate` (both 8 bits: the model's quant_predicate), layer 1 dense
    # (`mlp_only_layers`). The RMSNorm weights are stored as offsets from 1 and sanitize adds 1.0 (in bf16);
    # `mtp.*` (multi-token prediction) is dropped. Tied to stay small.
    "qwen3_next": dict(
        seed=12, norm_base=0.0, f32=("A_log",), extra={"mtp.fc.weight": (16, 32), "mtp.norm.weight": (16,)},
        config={
            "model_type": "qwen3_next", "architectures": ["Qwen3NextForCausalLM"], "hidden_size": 64,
            "intermediate_size": 64, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
            "num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": True, "decoder_sparse_step": 1,
            "mlp_only_layers": [1], "num_hidden_layers": 2, "full_attention_interval": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "linear_num_key_heads": 2,
            "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 8,
            "linear_conv_kernel_dim": 4, "partial_rotary_factor": 0.25, "rms_norm_eps": 1e-6, "vocab_size": 512,
            "max_position_embeddings": 4096, "rope_theta": 10000000.0, "rope_scaling": None, "attention_bias": False,
            "tie_word_embeddings": True, "bos_token_id": 0, "eos_token_id": 2, "torch_dtype": "bfloat16"},
        flagsets={"bf16": [], "q4": Q4}),
    # Qwen3.5 as the hub has it (Qwen3_5ForConditionalGeneration): the text model under `model.language_model.`,
    # the head as `lm_head`, a vision tower under `model.visual.` and `mtp.*` (both dropped), the dtype only in
    # text_config.dtype; conv1d [C, 1, K] -> [C, K, 1] and the norm offsets + 1.0 as Qwen3-Next; A_log float32
    # (kept so by the model's cast_predicate). Dense: no quant_predicate.
    "qwen3_5": dict(
        seed=13, norm_base=0.0, f32=("A_log",),
        extra={"model.visual.patch_embed.proj.weight": (16, 3, 2, 4, 4),
               "model.visual.blocks.0.attn.qkv.weight": (48, 16), "model.visual.merger.mlp.0.weight": (16, 16),
               "mtp.fc.weight": (16, 32), "mtp.layers.0.input_layernorm.weight": (16,)},
        config={
            "model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"],
            "text_config": {
                "model_type": "qwen3_5_text", "hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 2,
                "full_attention_interval": 2, "layer_types": ["linear_attention", "full_attention"],
                "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "attention_bias": False,
                "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
                "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4, "rms_norm_eps": 1e-6, "vocab_size": 512,
                "max_position_embeddings": 4096, "tie_word_embeddings": False, "dtype": "bfloat16",
                "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                                    "mrope_section": [2, 1, 1], "mrope_interleaved": True},
                "hidden_act": "silu", "bos_token_id": 0, "eos_token_id": 2},
            "vision_config": {"model_type": "qwen3_5", "depth": 1, "hidden_size": 16, "num_heads": 2,
                              "out_hidden_size": 64, "patch_size": 4, "temporal_patch_size": 2},
            "image_token_id": 500, "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 2},
        flagsets={"bf16": [], "q4": Q4}),
    # Qwen3.5-MoE as the hub has it: experts stored fused, `experts.gate_up_proj` [E, 2I, H] (gate rows, then up)
    # and `experts.down_proj` [E, H, I], which sanitize splits into switch_mlp; 8-bit router and shared-expert
    # gate; tied.
    "qwen3_5_moe": dict(
        seed=14, norm_base=0.0, f32=("A_log",),
        extra={"model.visual.blocks.0.attn.qkv.weight": (48, 16), "mtp.fc.weight": (16, 32)},
        config={
            "model_type": "qwen3_5_moe", "architectures": ["Qwen3_5MoeForConditionalGeneration"],
            "text_config": {
                "model_type": "qwen3_5_moe_text", "hidden_size": 64, "num_hidden_layers": 2,
                "full_attention_interval": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
                "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4, "num_experts": 4,
                "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
                "norm_topk_prob": True, "rms_norm_eps": 1e-6, "vocab_size": 512, "max_position_embeddings": 4096,
                "tie_word_embeddings": True,
                "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
                "bos_token_id": 0, "eos_token_id": 2},
            "vision_config": {"model_type": "qwen3_5_moe", "depth": 1, "hidden_size": 16},
            "tie_word_embeddings": True, "bos_token_id": 0, "eos_token_id": 2, "torch_dtype": "bfloat16"},
        flagsets={"bf16": [], "q4": Q4}),
    # LFM2-MoE: a dense first layer, then 4 experts (`feed_forward.experts.N.w1/w2/w3`, renamed and stacked) behind
    # the 8-bit `feed_forward.gate` router, with a float32 `expert_bias` that the cast leaves alone; conv weights
    # [64, 1, 3] -> [64, 3, 1].
    "lfm2_moe": dict(
        seed=15, f32=("expert_bias",),
        config={
            "model_type": "lfm2_moe", "architectures": ["Lfm2MoeForCausalLM"], "hidden_size": 64,
            "vocab_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "layer_types": ["conv", "full_attention"], "max_position_embeddings": 128000, "norm_eps": 1e-5,
            "conv_bias": False, "conv_L_cache": 3, "intermediate_size": 64, "moe_intermediate_size": 32,
            "num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": True, "use_expert_bias": True,
            "num_dense_layers": 1, "routed_scaling_factor": 1.0,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}, "tie_embedding": True,
            "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "torch_dtype": "bfloat16"},
        flagsets={"bf16": [], "q4": Q4}),
    # Gemma 3 (multimodal, transformers' legacy names as google/gemma-3-4b-it has them): the text model under
    # `language_model.model.`, a SigLIP tower under `vision_tower.` and the projector (dropped), vocab_size at the
    # top level, tied (no head in the checkpoint).
    "gemma3": dict(
        seed=16,
        extra={"vision_tower.vision_model.embeddings.patch_embedding.weight": (16, 3, 4, 4),
               "vision_tower.vision_model.post_layernorm.weight": (16,),
               "multi_modal_projector.mm_input_projection_weight": (16, 64),
               "multi_modal_projector.mm_soft_emb_norm.weight": (16,)},
        config={
            "model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"], "vocab_size": 512,
            "text_config": {
                "model_type": "gemma3_text", "hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-6,
                "max_position_embeddings": 32768, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
                "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "query_pre_attn_scalar": 16,
                "sliding_window": 512, "sliding_window_pattern": 2, "hidden_activation": "gelu_pytorch_tanh"},
            "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 16, "image_size": 16,
                              "patch_size": 4, "num_hidden_layers": 1},
            "mm_tokens_per_image": 4, "image_token_index": 500, "bos_token_id": 1, "eos_token_id": 2,
            "torch_dtype": "bfloat16"},
        flagsets={"q4": Q4}),
    # Gemma 4 E-series style text model: per-layer input embeddings, the last layer KV-shared (reading layer 0's
    # cache; its k_proj, v_proj and k_norm, which the checkpoint holds, are dropped), a double-wide MLP there, tied.
    "gemma4_text": dict(
        seed=17,
        config={
            "model_type": "gemma4_text", "architectures": ["Gemma4ForCausalLM"], "hidden_size": 64,
            "intermediate_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16, "global_head_dim": 32, "rms_norm_eps": 1e-6, "vocab_size": 512,
            "vocab_size_per_layer_input": 512, "hidden_size_per_layer_input": 8, "num_kv_shared_layers": 1,
            "sliding_window": 8, "max_position_embeddings": 4096, "final_logit_softcapping": 30.0,
            "layer_types": ["full_attention", "sliding_attention", "full_attention"],
            "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "torch_dtype": "bfloat16"},
        flagsets={"q4": Q4}),
    # Gemma 4 (multimodal, 26B-A4B style): `model.language_model.` -> `language_model.model.`, vision and audio
    # towers and their embedders dropped; a dense MLP beside 4 experts stored fused (`experts.gate_up_proj`
    # [E, 2I, H], `experts.down_proj`), split by sanitize into switch_glu; the 8-bit `router.proj`; K = V on the
    # global layer; tied.
    "gemma4": dict(
        seed=18,
        extra={"model.vision_tower.patch_embedder.input_proj.weight": (16, 48),
               "model.embed_vision.embedding_projection.weight": (64, 16),
               "model.audio_tower.conformer.0.norm.weight": (16,),
               "model.embed_audio.embedding_projection.weight": (64, 16)},
        config={
            "model_type": "gemma4", "architectures": ["Gemma4ForConditionalGeneration"], "vocab_size": 512,
            "text_config": {
                "model_type": "gemma4_text", "hidden_size": 64, "intermediate_size": 32, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "global_head_dim": 32,
                "rms_norm_eps": 1e-6, "vocab_size": 512, "vocab_size_per_layer_input": 512,
                "hidden_size_per_layer_input": 0, "num_kv_shared_layers": 0, "attention_k_eq_v": True,
                "num_global_key_value_heads": 1, "sliding_window": 8, "max_position_embeddings": 4096,
                "final_logit_softcapping": 30.0, "layer_types": ["sliding_attention", "full_attention"],
                "enable_moe_block": True, "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 32,
                "tie_word_embeddings": True, "dtype": "bfloat16"},
            "vision_config": {"model_type": "gemma4_vision", "hidden_size": 16},
            "audio_config": {"model_type": "gemma4_audio", "hidden_size": 16},
            "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "torch_dtype": "bfloat16"},
        flagsets={"q4": Q4}),
    # gpt-oss as OpenAI ships it: each layer's experts stacked and MXFP4-quantized (`quantization_config`
    # {"quant_method": "mxfp4"}): `experts.gate_up_proj_blocks` [E, 2I, H / 32, 16] uint8 (two 4-bit codes a
    # byte), `_scales` [E, 2I, H / 32] uint8 (E8M0), gate and up rows interleaved (even rows gate, odd rows up),
    # `gate_up_proj_bias` [E, 2I] likewise, `down_proj_blocks` / `_scales` / `_bias`; mlx-lm views the blocks as
    # uint32 words and splits the rows. The rest bf16: attention with sinks, the router (8 bits under -q), an
    # untied head. No flags keep the experts MXFP4; -q quantizes the rest (per-module entries, the MXFP4 default
    # kept); -d dequantizes the experts. 2 experts to stay small.
    "gpt_oss": dict(
        seed=19, mxfp4_experts=True,
        config={
            "model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"], "hidden_size": 64,
            "intermediate_size": 32, "num_local_experts": 2, "num_experts_per_tok": 2, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-5,
            "vocab_size": 512, "sliding_window": 8, "rope_theta": 150000.0,
            "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                             "original_max_position_embeddings": 4096},
            "layer_types": ["sliding_attention", "full_attention"], "max_position_embeddings": 131072,
            "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": [
                "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]},
            "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 2, "torch_dtype": "bfloat16"},
        flagsets={"bf16": [], "q4": Q4, "dequantize": ["-d"]}),
    # DeepSeek-V3: multi-head latent attention whose `kv_b_proj` [H * (nope + v), rank] sanitize turns into
    # `embed_q` [H, rank, nope] (transposed) and `unembed_out` [H, v, rank] (quantized as MultiLinear); a dense
    # first layer, then 4 unstacked experts, a shared expert and the `mlp.gate` router (not a Linear: never
    # quantized) with its float32 `e_score_correction_bias` (never cast).
    "deepseek_v3": dict(
        seed=20, f32=("e_score_correction_bias",),
        config={
            "model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 512,
            "hidden_size": 64, "intermediate_size": 32, "moe_intermediate_size": 16, "num_hidden_layers": 2,
            "num_attention_heads": 2, "num_key_value_heads": 2, "n_shared_experts": 1, "n_routed_experts": 4,
            "routed_scaling_factor": 2.5, "kv_lora_rank": 64, "q_lora_rank": 32, "qk_rope_head_dim": 16,
            "v_head_dim": 16, "qk_nope_head_dim": 64, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
            "norm_topk_prob": True, "n_group": 2, "topk_group": 1, "num_experts_per_tok": 2, "moe_layer_freq": 1,
            "first_k_dense_replace": 1, "max_position_embeddings": 16384, "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0, "rope_scaling": None, "attention_bias": False, "tie_word_embeddings": False,
            "bos_token_id": 0, "eos_token_id": 2, "torch_dtype": "bfloat16"},
        flagsets={"bf16": [], "q4": Q4}),
    # ---- mixtures and variants whose sanitize only renames ----
    # Granite-MoE: each layer's experts fused as `input_linear` [E, 2I, H] (gate, then up) and `output_linear`;
    # the model's quant_predicate keeps the router and o_proj at 8 bits. Tied; one layer to stay small.
    "granitemoe": dict(
        seed=21,
        config={
            "model_type": "granitemoe", "architectures": ["GraniteMoeForCausalLM"], "hidden_size": 64,
            "intermediate_size": 32, "num_local_experts": 4, "num_experts_per_tok": 2, "num_hidden_layers": 1,
            "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "vocab_size": 512,
            "max_position_embeddings": 4096, "rope_theta": 10000.0, "embedding_multiplier": 6.0,
            "attention_multiplier": 0.125, "residual_multiplier": 0.5, "logits_scaling": 2.0,
            "attention_bias": False, "tie_word_embeddings": True, "bos_token_id": 0, "eos_token_id": 2,
            "torch_dtype": "bfloat16"},
        flagsets={"q4": Q4}),
    # Llama 4 (text and a vision tower, dropped): a chunked RoPE layer then a MoE layer, the experts fused as the hub has
    # them (gate_up_proj [E, H, 2I], down_proj [E, I, H], transposed by sanitize).
    "llama4": dict(
        seed=33,
        extra={"vision_model.patch_embedding.linear.weight": (16, 48),
               "multi_modal_projector.linear_1.weight": (64, 16)},
        config={
            "model_type": "llama4", "architectures": ["Llama4ForConditionalGeneration"],
            "text_config": {
                "model_type": "llama4_text", "hidden_size": 64, "intermediate_size": 64,
                "intermediate_size_mlp": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-5, "vocab_size": 512,
                "max_position_embeddings": 4096, "rope_theta": 500000.0, "rope_scaling": None,
                "attention_bias": False, "attention_chunk_size": 8, "interleave_moe_layer_step": 2,
                "num_local_experts": 4, "num_experts_per_tok": 1, "use_qk_norm": True,
                "attn_temperature_tuning": True, "floor_scale": 8192, "attn_scale": 0.1,
                "tie_word_embeddings": False},
            "bos_token_id": 0, "eos_token_id": 2, "torch_dtype": "bfloat16"},
        flagsets={"bf16": [], "q4": Q4}),
    # Granite 4.0-H with experts: a Mamba-2 layer then an attention layer, conv weights in HF's [C, 1, K], the experts'
    # fused input_linear [E, 2I, H] beside the shared MLP's, tied.
    "granitemoehybrid": dict(
        seed=30, f32=("A_log",),
        config={
            "model_type": "granitemoehybrid", "architectures": ["GraniteMoeHybridForCausalLM"], "hidden_size": 64,
            "intermediate_size": 32, "shared_intermediate_size": 64, "num_hidden_layers": 2,
            "layer_types": ["mamba", "attention"], "num_attention_heads": 4, "num_key_value_heads": 2,
            "vocab_size": 512, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "attention_bias": False,
            "embedding_multiplier": 12.0, "attention_multiplier": 0.0078125, "logits_scaling": 4.0,
            "residual_multiplier": 0.22, "num_local_experts": 4, "num_experts_per_tok": 2, "mamba_n_heads": 8,
            "mamba_d_head": 16, "mamba_proj_bias": False, "mamba_d_state": 16, "mamba_d_conv": 4,
            "mamba_n_groups": 1, "mamba_conv_bias": True, "position_embedding_type": "nope",
            "tie_word_embeddings": True, "bos_token_id": 0, "eos_token_id": 2, "torch_dtype": "bfloat16"},
        flagsets={"q4": Q4}),
    # Its dense form: the MLP as the hub has it, shared_mlp's fused input_linear [2I, H] (mlx-lm's `mlp` after sanitize).
    "granitemoehybrid-dense": dict(
        seed=31, f32=("A_log",),
        config={
            "model_type": "granitemoehybrid", "architectures": ["GraniteMoeHybridForCausalLM"], "hidden_size": 64,
            "intermediate_size": 64, "num_hidden_layers": 2, "layer_types": ["mamba", "attention"],
            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-5, "attention_bias": False, "embedding_multiplier": 12.0,
            "attention_multiplier": 0.0078125, "logits_scaling": 4.0, "residual_multiplier": 0.22,
            "mamba_n_heads": 8, "mamba_d_head": 16, "mamba_proj_bias": False, "mamba_d_state": 16,
            "mamba_d_conv": 4, "mamba_n_groups": 1, "mamba_conv_bias": True, "position_embedding_type": "rope",
            "rope_theta": 10000.0, "tie_word_embeddings": True, "bos_token_id": 0, "eos_token_id": 2,
            "torch_dtype": "bfloat16"},
        flagsets={"q4": Q4}),
    # Nemotron 3: M E * blocks, 4 unstacked relu^2 experts (up_proj/down_proj) in a latent space of 32, conv weights
    # in HF's [C, 1, K], the multi-token-prediction layer (dropped), an untied head; f32 routing bias and A_log.
    "nemotron_h": dict(
        seed=32, f32=("A_log", "e_score_correction_bias"),
        extra={"mtp.layers.0.norm.weight": (64,), "mtp.layers.0.mixer.up_proj.weight": (32, 64)},
        config={
            "model_type": "nemotron_h", "architectures": ["NemotronHForCausalLM"], "hidden_size": 64,
            "intermediate_size": 64, "hybrid_override_pattern": "ME*", "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512, "max_position_embeddings": 4096,
            "layer_norm_epsilon": 1e-5, "attention_bias": False, "mlp_bias": False, "use_bias": False,
            "mamba_num_heads": 8, "mamba_head_dim": 16, "mamba_proj_bias": False, "ssm_state_size": 16,
            "conv_kernel": 4, "n_groups": 2, "use_conv_bias": True, "n_routed_experts": 4, "num_experts_per_tok": 2,
            "moe_intermediate_size": 32, "moe_shared_expert_intermediate_size": 32, "n_shared_experts": 1,
            "moe_latent_size": 32, "n_group": 1, "topk_group": 1, "norm_topk_prob": True,
            "routed_scaling_factor": 2.5, "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 2,
            "torch_dtype": "bfloat16"},
        flagsets={"q4": Q4}),
    # OLMoE: 4 unstacked experts, tied; one layer to stay small.
    "olmoe": dict(
        seed=22,
        config={
            "model_type": "olmoe", "architectures": ["OlmoeForCausalLM"], "hidden_size": 64,
            "intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2, "num_hidden_layers": 1,
            "num_attention_heads": 4, "num_key_value_heads": 4, "rms_norm_eps": 1e-5, "vocab_size": 512,
            "max_position_embeddings": 4096, "rope_theta": 10000.0, "tie_word_embeddings": True,
            "bos_token_id": 0, "eos_token_id": 2, "torch_dtype": "bfloat16"},
        flagsets={"q4": Q4}),
    # GLM-4.5 (glm4_moe): a dense first layer, then 4 unstacked experts behind the `mlp.gate` router (not a Linear)
    # with its float32 e_score_correction_bias; the multi-token-prediction layer (layer 2 of 2) dropped.
    "glm4_moe": dict(
        seed=23, f32=("e_score_correction_bias",),
        extra={"model.layers.2.eh_proj.weight": (16, 32), "model.layers.2.enorm.weight": (64,),
               "model.layers.2.shared_head.norm.weight": (64,)},
        config={
            "model_type": "glm4_moe", "architectures": ["Glm4MoeForCausalLM"], "hidden_size": 64,
            "intermediate_size": 32, "moe_intermediate_size": 16, "n_routed_experts": 4, "num_experts_per_tok": 2,
            "n_group": 1, "topk_group": 1, "n_shared_experts": 1, "routed_scaling_factor": 2.5,
            "norm_topk_prob": True, "first_k_dense_replace": 1, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "partial_rotary_factor": 0.5,
            "use_qk_norm": True, "attention_bias": True, "rms_norm_eps": 1e-5, "vocab_size": 512,
            "max_position_embeddings": 131072, "rope_theta": 1000000.0, "rope_scaling": None,
            "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 2, "torch_dtype": "bfloat16"},
        flagsets={"bf16": [], "q4": Q4}),
    # ERNIE 4.5-MoE: a dense first layer then 4 unstacked experts; the multi-token-prediction block and the
    # routing-bias statistics (`moe_statics.e_score_correction_bias`) dropped. Tied.
    "ernie4_5_moe": dict(
        seed=24,
        extra={"model.layers.1.mlp.moe_statics.e_score_correction_bias": (1, 4),
               "model.mtp_block.0.input_layernorm.weight": (64,), "model.mtp_linear_proj.0.weight": (16, 32),
               "model.mtp_hidden_norm.0.weight": (64,), "model.mtp_emb_norm.0.weight": (64,)},
        config={
            "model_type": "ernie4_5_moe", "architectures": ["Ernie4_5_MoeForCausalLM"], "hidden_size": 64,
            "intermediate_size": 64, "moe_intermediate_size": 32, "moe_num_experts": 4, "moe_k": 2,
            "moe_num_shared_experts": 1, "moe_layer_start_index": 1, "moe_layer_interval": 1,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "rms_norm_eps": 1e-5, "vocab_size": 512, "max_position_embeddings": 131072, "rope_theta": 500000.0,
            "use_bias": False, "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2,
            "torch_dtype": "bfloat16"},
        flagsets={"q4": Q4}),
    # MiniCPM: no head in the checkpoint and tie_word_embeddings false: sanitize copies the embedding as lm_head
    # (quantized as a Linear of its own).
    "minicpm": dict(
        seed=25, no_head=True,
        config={
            "model_type": "minicpm", "architectures": ["MiniCPMForCausalLM"], "hidden_size": 64,
            "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "rms_norm_eps": 1e-5, "vocab_size": 512, "max_position_embeddings": 4096, "rope_theta": 10000.0,
            "dim_model_base": 16, "scale_depth": 1.4, "scale_emb": 4.0, "tie_word_embeddings": False,
            "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16"},
        flagsets={"q4": Q4}),
    # SmolLM3: llama without RoPE in every 2nd layer, rotary inv_freq buffers to drop, tied.
    "smollm3": dict(
        seed=26, inv_freq=True,
        config={
            "model_type": "smollm3", "architectures": ["SmolLM3ForCausalLM"], "hidden_size": 64,
            "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "rms_norm_eps": 1e-6, "vocab_size": 512, "max_position_embeddings": 65536, "rope_theta": 5000000.0,
            "no_rope_layer_interval": 2, "tie_word_embeddings": True, "bos_token_id": 0, "eos_token_id": 2,
            "torch_dtype": "bfloat16"},
        flagsets={"q4": Q4}),
}


# ---- the source checkpoint ----

def mlx_shapes(cfg):
    """mlx-lm's parameter names and shapes for this config (mlx-lm's names after sanitize)."""
    cfg = json.loads(json.dumps(cfg))
    Model, Args = _get_classes(cfg)
    model = Model(Args.from_dict(cfg))
    return {k: tuple(v.shape) for k, v in tree_flatten(model.parameters())}


# Mixtures whose hub checkpoints hold one array per expert: `PRE.experts.N.PROJ` for mlx-lm's `PRE.switch_mlp.PROJ`.
UNSTACKED = ("qwen3_moe", "qwen3_next", "olmoe", "glm4_moe", "ernie4_5_moe", "deepseek_v3")


def hf_expert_names(mt, k, s):
    """A stacked expert array's name(s) and shape(s) in the hub checkpoint, or None where it is not one."""
    if mt in UNSTACKED + ("lfm2_moe",) and ".switch_mlp." in k:  # [E, out, in] -> E x [out, in]
        pre, proj = k.split(".switch_mlp.")
        if mt == "lfm2_moe":
            proj = {"gate_proj.weight": "w1.weight", "down_proj.weight": "w2.weight",
                    "up_proj.weight": "w3.weight"}[proj]
        return {f"{pre}.experts.{e}.{proj}": s[1:] for e in range(s[0])}
    if mt == "llama4" and ".feed_forward.experts." in k:  # [E, I, H] x2 and [E, H, I] -> fused, transposed
        pre, proj = k.split(".feed_forward.experts.")
        base = f"{pre}.feed_forward.experts."
        if proj == "up_proj.weight":
            return {}
        if proj == "gate_proj.weight":
            return {base + "gate_up_proj": (s[0], s[2], 2 * s[1])}
        return {base + "down_proj": (s[0], s[2], s[1])}
    if mt == "nemotron_h" and ".switch_mlp." in k:  # fc1/fc2 [E, out, in] -> E x up_proj/down_proj [out, in]
        pre, proj = k.split(".switch_mlp.")
        proj = {"fc1.weight": "up_proj.weight", "fc2.weight": "down_proj.weight"}[proj]
        return {f"{pre}.experts.{e}.{proj}": s[1:] for e in range(s[0])}
    if mt == "mixtral" and ".block_sparse_moe.switch_mlp." in k:
        pre, proj = k.split(".block_sparse_moe.switch_mlp.")
        w = {"gate_proj.weight": "w1", "down_proj.weight": "w2", "up_proj.weight": "w3"}[proj]
        return {f"{pre}.block_sparse_moe.experts.{e}.{w}.weight": s[1:] for e in range(s[0])}
    fused = {"qwen3_5_moe": (".switch_mlp.", ".experts.{}"), "gemma4": (".switch_glu.", ".{}"),
             "gemma4_text": (".switch_glu.", ".{}"), "granitemoe": (".switch_mlp.", ".{}.weight"),
             "granitemoehybrid": (".switch_mlp.", ".{}.weight")}
    if mt in fused and fused[mt][0] in k:  # gate and up fused as [E, 2I, H] (gate rows first)
        marker, leaf = fused[mt]
        pre, proj = k.split(marker)
        granite = ("input_linear", "output_linear")
        names = {"granitemoe": granite, "granitemoehybrid": granite}.get(mt, ("gate_up_proj", "down_proj"))
        if proj == "up_proj.weight":
            return {}
        if proj == "gate_proj.weight":
            return {pre + leaf.format(names[0]): (s[0], 2 * s[1], s[2])}
        return {pre + leaf.format(names[1]): s}
    if mt == "gpt_oss" and ".mlp.experts." in k:  # MXFP4 blocks and scales, gate and up rows interleaved
        pre, proj = k.split(".mlp.experts.")
        p, leaf = proj.split(".")
        if p == "up_proj":
            return {}
        name = f"{pre}.mlp.experts.{'gate_up_proj' if p == 'gate_proj' else p}"
        rows = 2 * s[1] if p == "gate_proj" else s[1]
        if leaf == "bias":
            return {f"{name}_bias": (s[0], rows)}
        return {f"{name}_blocks": (s[0], rows, s[2] // 32, 16), f"{name}_scales": (s[0], rows, s[2] // 32)}
    return None


def hf_shapes(case, spec):
    """The transformers-layout names and shapes: mlx-lm's run backwards through the model's sanitize."""
    cfg = spec["config"]
    shapes = mlx_shapes(cfg)
    mt = cfg["model_type"]
    text = cfg.get("text_config", cfg)
    out = {}
    for k, s in shapes.items():
        # the multimodal wrappers' text model under the hub's `model.language_model.` (gemma3, mistral3: legacy
        # `language_model.model.`, mlx-lm's own names)
        if mt in ("qwen3_5", "qwen3_5_moe") and "text_config" in cfg or mt == "gemma4":
            if k.startswith("language_model.model."):
                k = "model.language_model." + k[len("language_model.model."):]
            elif k.startswith("language_model."):
                k = k[len("language_model."):]
        experts = hf_expert_names(mt, k, s)
        if experts is not None:
            out.update(experts)
        elif mt in ("lfm2", "lfm2_moe") and k.endswith("conv.conv.weight"):  # mlx [C, K, 1] -> HF [C, 1, K]
            out[k] = (s[0], s[2], s[1])
        elif mt in ("qwen3_next", "qwen3_5", "qwen3_5_moe", "granitemoehybrid", "nemotron_h") \
                and k.endswith("conv1d.weight"):
            out[k] = (s[0], s[2], s[1])
        elif mt == "granitemoehybrid" and ".mlp." in k:  # the dense MLP as the hub's shared_mlp, gate and up fused
            pre, proj = k.split(".mlp.")
            if proj == "gate_proj.weight":
                out[f"{pre}.shared_mlp.input_linear.weight"] = (2 * s[0], s[1])
            elif proj == "down_proj.weight":
                out[f"{pre}.shared_mlp.output_linear.weight"] = s
        elif mt == "lfm2_moe" and ".feed_forward." in k and k.endswith("_proj.weight"):  # the dense layers' w1/w2/w3
            w = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}[k.split(".")[-2]]
            out[k.rsplit(".", 2)[0] + f".{w}.weight"] = s
        elif mt == "deepseek_v3" and k.endswith(("embed_q.weight", "unembed_out.weight")):
            if k.endswith("unembed_out.weight"):  # [H, v, rank] + embed_q [H, rank, nope] -> [H * (nope + v), rank]
                h, v, rank = s
                out[k.replace("unembed_out", "kv_b_proj")] = (h * (text["qk_nope_head_dim"] + v), rank)
        elif mt in ("gemma3_text", "gemma3") and k.endswith("lm_head.weight"):  # Gemma 3 checkpoints hold no head
            continue
        elif spec.get("no_head") and k == "lm_head.weight":
            continue
        else:
            out[k] = s
    if mt == "gemma4_text" and cfg.get("num_kv_shared_layers"):  # the KV-shared layers' own K/V, unused
        first = cfg["num_hidden_layers"] - cfg["num_kv_shared_layers"]
        full = mlx_shapes(dict(cfg, num_kv_shared_layers=0))
        for k, s in full.items():
            if any(p in k for p in (".self_attn.k_proj", ".self_attn.v_proj", ".self_attn.k_norm")):
                if int(k.split("layers.")[1].split(".")[0]) >= first:
                    out[k] = s
    if mt == "llama" or spec.get("inv_freq"):
        n_layers = cfg["num_hidden_layers"]
        hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        for i in range(n_layers):
            out[f"model.layers.{i}.self_attn.rotary_emb.inv_freq"] = (hd // 2,)
        if spec.get("redundant_head"):  # a tied checkpoint that still holds the head
            out["lm_head.weight"] = out["model.embed_tokens.weight"]
    out.update(spec.get("extra", {}))
    return out


def to_bf16_bits(x):
    """float32 -> bfloat16 bit patterns (round to nearest even), as torch's .to(torch.bfloat16)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def source_values(case, spec):
    cfg = spec["config"]
    rng = np.random.default_rng(spec["seed"])
    gemma = cfg["model_type"].startswith("gemma")
    vals = {}
    for name, shape in sorted(hf_shapes(case, spec).items()):
        if name == "lm_head.weight" and spec.get("redundant_head"):
            continue  # set below
        if name.endswith("_blocks"):  # MXFP4 codes, two a byte
            vals[name] = rng.integers(0, 256, shape, dtype=np.uint8)
        elif name.endswith("_scales"):  # E8M0 exponents around 2^-6
            vals[name] = rng.integers(119, 124, shape, dtype=np.uint8)
        elif name.endswith("rotary_emb.inv_freq"):
            d = 2 * shape[0]
            vals[name] = 1.0 / (cfg["rope_theta"] ** (np.arange(0, d, 2, dtype=np.float32) / d))
        elif len(shape) == 1 and "norm" in name:
            base = 0.0 if gemma else spec.get("norm_base", 1.0)
            vals[name] = base + 0.1 * rng.standard_normal(shape, dtype=np.float32)
        else:
            vals[name] = 0.02 * rng.standard_normal(shape, dtype=np.float32)
    if spec.get("redundant_head"):
        vals["lm_head.weight"] = vals["model.embed_tokens.weight"]  # tied: the same tensor, saved twice
    return vals


def write_safetensors(path, tensors, dtype, f32=()):
    """`f32`: name suffixes stored float32 whatever `dtype` is (A_log, routing biases)."""
    keep, specs = [], {}
    for name, v in tensors.items():
        dt = "float32" if name.endswith(tuple(f32)) else dtype
        if v.dtype == np.uint8:
            dt, a = "uint8", np.ascontiguousarray(v)
        else:
            a = to_bf16_bits(v) if dt == "bfloat16" else np.ascontiguousarray(v, dtype=np.float32)
        keep.append(a)
        specs[name] = TensorSpec(dtype=dt, shape=a.shape, data_ptr=a.ctypes.data, data_len=a.nbytes)
    serialize_file(specs, str(path), metadata={"format": "pt"})
    path.chmod(0o644)  # serialize_file creates 0600
    return sum(a.nbytes for a in keep)


def make_source(case, spec, src):
    if src.exists():
        shutil.rmtree(src)
    src.mkdir(parents=True)
    cfg = dict(spec["config"], transformers_version=TRANSFORMERS_VERSION)
    (src / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    gen = {"_from_model_config": True, "bos_token_id": cfg["bos_token_id"],
           "eos_token_id": spec.get("generation_eos", cfg["eos_token_id"]), "transformers_version": TRANSFORMERS_VERSION}
    (src / "generation_config.json").write_text(json.dumps(gen, indent=2, sort_keys=True) + "\n")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TOKENIZER_DIR / f, src / f)
    vals = source_values(case, spec)
    dtype = spec.get("dtype", "bfloat16")
    if spec.get("shards", 1) == 1:
        write_safetensors(src / "model.safetensors", vals, dtype, spec.get("f32", ()))
        return
    # two shards, transformers style: embedding and layer 0 first, the rest second
    second = lambda k: k.startswith(("model.norm", "lm_head")) or ".layers.1." in k
    parts = [{k: v for k, v in vals.items() if not second(k)}, {k: v for k, v in vals.items() if second(k)}]
    total, weight_map = 0, {}
    for i, part in enumerate(parts):
        fname = f"model-{i + 1:05d}-of-{len(parts):05d}.safetensors"
        total += write_safetensors(src / fname, part, dtype)
        weight_map.update({k: fname for k in part})
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (src / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


# ---- what the converter wrote ----

def safetensors_entries(path):
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    header.pop("__metadata__", None)
    body = data[8 + n:]
    return {k: {"dtype": h["dtype"], "shape": h["shape"],
                "sha256": hashlib.sha256(body[h["data_offsets"][0]:h["data_offsets"][1]]).hexdigest()}
            for k, h in header.items()}


def record(out, args, source=None):
    files = sorted(p.name for p in out.iterdir())
    tensors, text_files = {}, {}
    for f in files:
        if f.endswith(".safetensors"):
            tensors.update(safetensors_entries(out / f))
        else:
            text_files[f] = hashlib.sha256((out / f).read_bytes()).hexdigest()
    rec = {"args": args}
    if source is not None:
        rec["source"] = source
    rec.update(config=json.loads((out / "config.json").read_text()),
               index=json.loads((out / "model.safetensors.index.json").read_text()),
               files=files, text_files=text_files, tensors=dict(sorted(tensors.items())))
    return rec


def dump(obj, indent=0):
    """Indented json, but a short (<= 16) dict or list holding no dict or list on one line (one line per tensor)."""
    flat = lambda v: not isinstance(v, (dict, list)) or len(v) <= 16 and not any(
        isinstance(x, (dict, list)) for x in (v.values() if isinstance(v, dict) else v))
    if flat(obj):
        return json.dumps(obj)
    pad = "  " * (indent + 1)
    if isinstance(obj, dict):
        items = [f"{pad}{json.dumps(k)}: {dump(v, indent + 1)}" for k, v in obj.items()]
        return "{\n" + ",\n".join(items) + "\n" + "  " * indent + "}"
    return "[\n" + ",\n".join(pad + dump(v, indent + 1) for v in obj) + "\n" + "  " * indent + "]"


def run_convert(src, dst, args):
    parsed = configure_parser().parse_args(["--hf-path", str(src), "--mlx-path", str(dst)] + args)
    convert(**vars(parsed))


def describe(rec):
    q = rec["config"].get("quantization")
    dtypes = sorted({t["dtype"] for t in rec["tensors"].values()})
    if q is None:
        return f"{len(rec['tensors'])} tensors {dtypes}"
    top = {k: v for k, v in q.items() if not isinstance(v, dict)}
    per = {k: v for k, v in q.items() if isinstance(v, dict)}
    return f"{len(rec['tensors'])} tensors {dtypes} quantization {top} + {len(per)} per-module entries"


def main():
    argv = sys.argv[1:]
    keep = None
    if "--keep" in argv:
        i = argv.index("--keep")
        keep = Path(argv[i + 1])
        del argv[i:i + 2]
    out_root = Path(argv[0] if argv else "tests/fixtures/convert")
    names = argv[1:] or list(CASES)
    for name in names:
        spec = CASES[name]
        src = out_root / name / "source"
        make_source(name, spec, src)
        load(str(src))  # the source must load as it is (sanitize accepts it, strict)
        exp = out_root / name / "expected"
        if exp.exists():
            shutil.rmtree(exp)
        exp.mkdir(parents=True)
        with tempfile.TemporaryDirectory() as tmp:
            outs = {}
            for fs, entry in spec["flagsets"].items():
                args, source = (entry["args"], entry["source"]) if isinstance(entry, dict) else (entry, None)
                dst = Path(tmp) / fs
                run_convert(outs[source] if source else src, dst, args)
                outs[fs] = dst
                load(str(dst))  # and what mlx-lm wrote loads back
                rec = record(dst, args, source)
                (exp / f"{fs}.json").write_text(dump(rec) + "\n")
                print(f"{name}/{fs}: {describe(rec)}", flush=True)
            if keep is not None:
                for fs, dst in outs.items():
                    k = keep / name / fs
                    if k.exists():
                        shutil.rmtree(k)
                    shutil.copytree(dst, k)
    readme = out_root / "README.md"
    readme.write_text(README)


README = """# `oxlm convert` goldens

Each `<case>/source/` is a tiny seeded random checkpoint in the Hugging Face (transformers) layout, as downloaded
from the hub before mlx-lm's `sanitize` (unstacked or fused MoE experts, rotary `inv_freq` buffers, a redundant tied
`lm_head`, `[C, 1, K]` conv weights, Qwen3-Next's and Qwen3.5's norms as offsets from 1, DeepSeek's `kv_b_proj`,
gpt-oss's MXFP4 expert blocks, the multimodal wrappers' prefixes and vision / audio / multi-token-prediction
tensors, bf16 with `torch_dtype`; `llama` in two shards, `float32-source` in f32). Each
`<case>/expected/<flagset>.json` records what `mlx_lm convert --hf-path <case>/source --mlx-path OUT <args>` (mlx-lm
0.32.2, mlx 0.32.4) wrote: the args, the config.json and model.safetensors.index.json (parsed), the file names, the
sha256 of the non-weight files, and per tensor its dtype, shape and the sha256 of its bytes. `dequantize-q4`
converted the `q4` output with `-d` (`"source": "q4"`). The converted checkpoints themselves are not kept.

What mlx-lm does that is easy to miss: `generation_config.json`'s `eos_token_id` replaces config.json's (`llama`);
`torch_dtype` is left as it was after `--dtype`; `--quant-predicate mixed_*` without `--q-group-size` writes
per-module entries with `"group_size": null` (top level: 64 / 4 bits) and replaces the model's own predicate;
Qwen3-MoE's router entry is `{"group_size": 64, "bits": 8}` (no `mode`); modules whose input width is not a multiple
of the group size stay unquantized (`llama/q3-g128`, `mixtral/q4`); the index's `total_parameters` counts quantized
weights unpacked and leaves out arrays held by modules with submodules (`A_log`, `layer_scalar`); model arguments
edit the saved config (Gemma 3/4's text_config gets `vocab_size`, Qwen3.5's `rope_parameters.rope_type` becomes
`type`); gpt-oss's `quantization_config` becomes an mxfp4 `quantization` section, and `-q` on it adds per-module
entries beside that default; the tokenizer is re-saved (tokenizer.json re-serialized, tokenizer_config.json
rewritten, chat_template.jinja split out); README.md is a bare model card.

Regenerate (a few seconds, deterministic):

    PY=$(scripts/oracle/venv.sh); $PY scripts/oracle/make_convert_fixtures.py [--keep DIR] [tests/fixtures/convert] [CASE...]
"""

if __name__ == "__main__":
    main()
