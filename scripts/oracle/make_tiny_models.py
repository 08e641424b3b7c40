"""Seeded random tiny MLX checkpoints (vocab 512, the tiny BPE tokenizer), saved exactly as mlx-lm saves them.

usage: PY=$(scripts/oracle/venv.sh); $PY scripts/oracle/make_tiny_models.py [OUT_ROOT] [NAME...]
  OUT_ROOT default tests/fixtures/tiny (needs OUT_ROOT/tokenizer from make_tiny_tokenizer.py)
  NAME     default: every model in MODELS

Each OUT_ROOT/<name>/ gets config.json (with `quantization` and `quantization_config`), model.safetensors,
model.safetensors.index.json, tokenizer.json, tokenizer_config.json.
Recipe (like assets.md make_tiny.py): mx.random.seed(seed) -> mlx-lm Model(ModelArgs) default init ->
2-D non-embedding weights and stacked MoE experts * GAIN (embedding * EMBED_GAIN), RMSNorm weights
1 + 0.2*N(0,1) (so that a runtime ignoring them fails) -> every float parameter cast to bf16 (except those the
model's cast_predicate keeps) -> mlx_lm.utils.quantize_model (affine unless the spec names a float `mode`, optional
per-module overrides through quant_predicate returning a dict (which may name another mode), else the model's own
quant_predicate) -> mlx_lm.utils.save_model + save_config.
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
}


def build(name, spec, out_root, tokdir):
    cfg = json.loads(json.dumps(spec["config"]))
    mx.random.seed(spec["seed"])
    Model, Args = _get_classes(cfg)
    model = Model(Args.from_dict(cfg))
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
    save_config(qcfg, out / "config.json")
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
