"""Seeded tiny Gemma 3 / Gemma 3n / Gemma 4 text models and their goldens, with make_tiny_models.build and
make_goldens.golden.

usage: PY=$(scripts/oracle/venv.sh); $PY scripts/oracle/make_tiny_gemma.py [OUT_ROOT] [NAME...]
  OUT_ROOT default tests/fixtures/tiny; NAME default: every model in MODELS

Every model has sliding_window 8 < the 43-token golden prompt, so prefill masks, the ring cache and
decoding past the window are all exercised. Vocabulary 512 (the tiny BPE tokenizer), also for Gemma 4's
per-layer input embeddings.
Seeds were picked (out of 0..11) for a large minimum top1-top2 margin over the greedy steps and varied output.
"""
import sys
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_goldens import encodings, golden  # noqa: E402
from make_tiny_models import build, describe  # noqa: E402


def gemma4_extras(path, v):
    """Gemma 4's non-norm vectors and 3-D experts: away from their all-ones / uniform init so a runtime
    ignoring them fails."""
    if path.endswith("layer_scalar"):
        return 0.5 + mx.random.uniform(shape=v.shape)
    if path.endswith(("router.scale", "router.per_expert_scale")):
        return 0.5 + mx.random.uniform(shape=v.shape)
    if v.ndim == 3:  # experts.switch_glu.{gate,up,down}_proj.weight [experts, out, in]
        return v * 4.0
    return v


def gemma3n_extras(path, v):
    """Gemma 3n's AltUp output scale (zeros at init, which would silence the per-layer inputs) away from zero."""
    if path.endswith("correct_output_scale"):
        return 0.5 + mx.random.uniform(shape=v.shape)
    return v


def gemma3n_always_cached():
    """mlx-lm's gemma3n run without a cache lets its KV-shared layers compute keys and values of their own, from
    projections no generation reads (generate, the server and cache_prompt always pass a cache, and the shared
    layers then read the earlier layers'): a cache-free forward gets a fresh cache, so that every golden is what
    generation computes."""
    from mlx_lm.models import gemma3n
    forward = gemma3n.LanguageModel.__call__

    def cached(self, inputs=None, cache=None, input_embeddings=None):
        cache = self.make_cache() if cache is None else cache
        return forward(self, inputs, cache=cache, input_embeddings=input_embeddings)

    gemma3n.LanguageModel.__call__ = cached


GEMMA3_TEXT = {
    "model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"], "hidden_size": 128,
    "intermediate_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 32, "rms_norm_eps": 1e-6, "vocab_size": 512, "max_position_embeddings": 4096,
    "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "sliding_window": 8,
    "hidden_activation": "gelu_pytorch_tanh", "attention_bias": False, "final_logit_softcapping": None,
    "attn_logit_softcapping": None, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
    "torch_dtype": "bfloat16"}

GEMMA4_TEXT = {
    "model_type": "gemma4_text", "hidden_size": 96, "intermediate_size": 128, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "global_head_dim": 32, "rms_norm_eps": 1e-6, "vocab_size": 512,
    "vocab_size_per_layer_input": 512, "sliding_window": 8, "max_position_embeddings": 4096,
    "final_logit_softcapping": 30.0, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}

GEMMA3N_TEXT = {
    "model_type": "gemma3n_text", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 16, "rms_norm_eps": 1e-6, "vocab_size": 512, "sliding_window": 8, "max_position_embeddings": 4096,
    "rope_local_base_freq": 10000.0, "rope_theta": 1000000.0, "final_logit_softcapping": 30.0,
    "hidden_size_per_layer_input": 16, "altup_num_inputs": 4, "altup_active_idx": 0, "altup_correct_scale": True,
    "query_pre_attn_scalar": 16, "rope_scaling": None, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}

MODELS = {
    # Gemma-3-270M style: every 3rd layer global (S S G S), query_pre_attn_scalar != head_dim, tied head,
    # hidden 128 so that sqrt(hidden) = 11.3137 rounds to 11.3125 in bf16 as mlx-lm multiplies it.
    "gemma3-4bit-g64": dict(
        seed=9, gain=4.0, embed_gain=1.0, group_size=64, bits=4, overrides={},
        config=dict(GEMMA3_TEXT, sliding_window_pattern=3, query_pre_attn_scalar=24)),
    # The multimodal wrapper (text_config, language_model.* weights, top-level vocab_size), 8-bit g32,
    # pattern 2 (S G S G), linear RoPE scaling on global layers (as Gemma 3 4B+), untied 8-bit head.
    "gemma3-vlm-8bit-g32": dict(
        seed=11, gain=4.0, embed_gain=1.0, group_size=32, bits=8, overrides={},
        config={"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"], "vocab_size": 512,
                "tie_word_embeddings": False,
                "text_config": dict(GEMMA3_TEXT, sliding_window_pattern=2, query_pre_attn_scalar=32,
                                    rope_scaling={"factor": 8.0, "rope_type": "linear"})}),
    # Gemma 4 E-series style: per-layer input embeddings, 2 KV-shared layers (double-wide MLP), S S F S S F
    # (shared layer 4 reads layer 3's cache, layer 5 reads layer 2's), global head_dim 32 with proportional
    # RoPE (a quarter of it rotated), logit softcap 30. 4-bit g32 (per_layer_projection 16 -> 96 stays dense).
    "gemma4-4bit-g32": dict(
        seed=2, gain=4.0, embed_gain=1.0, group_size=32, bits=4, overrides={}, shape_other=gemma4_extras,
        config=dict(GEMMA4_TEXT, num_hidden_layers=6, num_kv_shared_layers=2, hidden_size_per_layer_input=16,
                    layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2)),
    # Gemma 4 31B style inside the `gemma4` wrapper: K = V on global layers with their own KV head count,
    # no per-layer inputs, no KV sharing, own rope_parameters, no softcap (null), untied head; 8-bit g64.
    "gemma4-vlm-8bit-g64": dict(
        seed=4, gain=4.0, embed_gain=1.0, group_size=64, bits=8, overrides={}, shape_other=gemma4_extras,
        config={"model_type": "gemma4", "architectures": ["Gemma4ForConditionalGeneration"], "vocab_size": 512,
                "text_config": dict(
                    GEMMA4_TEXT, hidden_size=64, num_hidden_layers=4, num_kv_shared_layers=0,
                    hidden_size_per_layer_input=0, attention_k_eq_v=True, num_global_key_value_heads=1,
                    final_logit_softcapping=None, tie_word_embeddings=False, sliding_window_pattern=2,
                    rope_parameters={
                        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.5,
                                           "rope_theta": 1000000.0},
                        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})}),
    # Gemma 4 26B-A4B style: every layer runs a dense GeGLU MLP plus 8 routed GeGLU experts (top 2, softmax
    # over the chosen scores times a per-expert scale, router input RMS-normed by its own scale), K = V on
    # global layers. 4-bit g64 stacked experts; the router projection 8-bit g64 (the model's quant_predicate).
    "gemma4-moe-4bit-g64": dict(
        seed=2, gain=2.0, embed_gain=1.0, group_size=64, bits=4, overrides={}, shape_other=gemma4_extras,
        config=dict(GEMMA4_TEXT, hidden_size=64, num_hidden_layers=4, num_kv_shared_layers=0,
                    hidden_size_per_layer_input=0, attention_k_eq_v=True, num_global_key_value_heads=1,
                    layer_types=["sliding_attention", "full_attention"] * 2, enable_moe_block=True,
                    num_experts=8, top_k_experts=2, moe_intermediate_size=64)),
    # Gemma 3n E-series style inside its `gemma3n` wrapper (text_config, model.language_model.* weights): 4 AltUp
    # streams (coefficients clipped to +-1), LAuReL rank 16 (its right projection dense: 16 % 32), per-layer inputs
    # from a per-layer vocabulary of 448 < 512 (higher ids read row 0), S S F S S F with 2 KV-shared layers (layer 4
    # reads layer 3's ring, layer 5 layer 2's cache), gaussian top-k (sparsity 0.95) on the first two MLPs, per-layer
    # MLP widths, logit softcap 30, attention scale 1 (query_pre_attn_scalar is not read). 4-bit g32.
    "gemma3n-4bit-g32": dict(
        seed=0, gain=4.0, embed_gain=1.0, group_size=32, bits=4, overrides={}, shape_other=gemma3n_extras,
        config={"model_type": "gemma3n", "architectures": ["Gemma3nForConditionalGeneration"],
                "text_config": dict(
                    GEMMA3N_TEXT, num_hidden_layers=6, num_kv_shared_layers=2, vocab_size_per_layer_input=448,
                    intermediate_size=[128] * 4 + [192] * 2, laurel_rank=16, altup_coef_clip=1.0,
                    activation_sparsity_pattern=[0.95, 0.95, 0.0, 0.0, 0.0, 0.0],
                    layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2)}),
}


def main():
    out_root = Path(sys.argv[1] if len(sys.argv) > 1 else "tests/fixtures/tiny")
    names = sys.argv[2:] or list(MODELS)
    tokdir = out_root / "tokenizer"
    assert (tokdir / "tokenizer.json").exists(), f"run make_tiny_tokenizer.py first ({tokdir})"
    rows = encodings(tokdir)
    gemma3n_always_cached()
    for name in names:
        out = build(name, MODELS[name], out_root, tokdir)
        size, quantized, dense, bits_groups = describe(out)
        info = golden(out, rows)
        g = info["greedy_ids"]
        print(f"{name}: model.safetensors {size / 1024:.1f} KiB, (bits, group) {bits_groups}, dense 2-D "
              f"{dense or 'none'}\n    prompt {info['n_prompt']} tok, greedy {g}, distinct {len(set(g))}/{len(g)}, "
              f"min margin {info['min_margin']:.4f}, cache vs cache-free "
              f"{info['max_abs_diff_step_logits_vs_cache_free_forward']:.2e}", flush=True)


if __name__ == "__main__":
    main()
