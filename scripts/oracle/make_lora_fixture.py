"""Seeded LoRA adapters for the tiny models, made with mlx-lm's own tuner code, and goldens of the adapted
and the fused models.

usage: PY=$(scripts/oracle/venv.sh); $PY scripts/oracle/make_lora_fixture.py [TINY_ROOT] [OUT_ROOT] [NAME...]
  TINY_ROOT default tests/fixtures/tiny (the base models), OUT_ROOT default tests/fixtures/lora;
  NAMEs: only those ADAPTERS entries (default: all)

For each ADAPTERS entry, OUT_ROOT/<name>/ gets
  adapter_config.json, adapters.safetensors   as `mlx_lm lora` writes them (lora_a [in, r], lora_b [r, out], f32)
  golden.safetensors   prompt_ids int32 [n]; adapted_logits f32 [n, vocab]: mlx_lm.load(base, adapter_path)
                       with fp32 activations, one cache-free forward of the prompt; base_logits (no adapter);
                       fused_logits: the model `mlx_lm fuse` writes, reloaded, same forward;
                       dequantized_logits: the same for `mlx_lm fuse --dequantize`
  fused.safetensors    the weights `mlx_lm fuse` writes (re-quantized), to compare bit for bit
  golden.json          shapes, the prompt, versions
Recipe: mx.random.seed(seed); model = load(base); model.freeze(); linear_to_lora_layers(model, num_layers,
lora_parameters) (lora_a ~ U(+-1/sqrt(in)) as mlx-lm draws it); every lora_b <- B_STD * N(0, 1) so the adapter
changes the output; save trainable_parameters() as the trainer does. Fusing runs fuse.py's own steps
(load with adapter_path, module.fuse(dequantize), dequantize_model, save).
"""
import json
import shutil
import sys
import tempfile
from importlib.metadata import version
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm import load
from mlx_lm.tuner.utils import linear_to_lora_layers
from mlx_lm.utils import dequantize_model, save, save_config

from make_tiny_gemma import gemma3n_always_cached

MESSAGES = [{"role": "user", "content": "Write one sentence about the sea, please. 12345"}]
B_STD = 0.02

ADAPTERS = {
    # Last block only, mlx-lm's default keys (every linear of the block; down_proj is dense: 96 % 64 != 0).
    "llama-4bit-g64-r4": dict(base="llama-4bit-g64", seed=1, num_layers=1,
                              lora_parameters={"rank": 4, "dropout": 0.0, "scale": 20.0}),
    # Every block (num_layers -1), explicit keys, q/k/v biases in the base layers.
    "qwen2-4bit-g64-keys": dict(base="qwen2-4bit-g64", seed=2, num_layers=-1,
                                lora_parameters={"rank": 8, "dropout": 0.0, "scale": 10.0,
                                                 "keys": ["self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj"]}),
    # Gemma 3's text model: every linear of every block (GeGLU MLP, q/k norms, sliding layers).
    "gemma3-4bit-g64-r4": dict(base="gemma3-4bit-g64", seed=3, num_layers=-1,
                               lora_parameters={"rank": 4, "dropout": 0.0, "scale": 20.0}),
    # Qwen3.5 (dense): the gated-DeltaNet and the gated attention's projections and the MLPs of
    # every block, under language_model.
    "qwen3_5-4bit-g64-r4": dict(base="qwen3_5-4bit-g64", seed=4, num_layers=-1,
                                lora_parameters={"rank": 4, "dropout": 0.0, "scale": 8.0}),
    # Gemma 4's text model (E-series): attention (KV-shared layers have no k/v of their own),
    # GeGLU MLPs and the per-layer input gates of every block.
    "gemma4-4bit-g32-r4": dict(base="gemma4-4bit-g32", seed=5, num_layers=-1,
                               lora_parameters={"rank": 4, "dropout": 0.0, "scale": 8.0}),
    # The multimodal wrappers, which name the text model's layers under language_model.
    "gemma3-vlm-8bit-g32-r4": dict(base="gemma3-vlm-8bit-g32", seed=6, num_layers=2,
                                   lora_parameters={"rank": 4, "dropout": 0.0, "scale": 8.0}),
    "gemma4-vlm-8bit-g64-r4": dict(base="gemma4-vlm-8bit-g64", seed=7, num_layers=2,
                                   lora_parameters={"rank": 4, "dropout": 0.0, "scale": 8.0}),
    # Mixtures of experts: the routers, each expert of the stacked switch layers (lora_a
    # [experts, rank, in], lora_b [experts, out, rank]) and Qwen3.5's shared expert and its gate.
    "qwen3_5_moe-4bit-g64-r4": dict(base="qwen3_5_moe-4bit-g64", seed=8, num_layers=-1,
                                    lora_parameters={"rank": 4, "dropout": 0.0, "scale": 8.0}),
    "gemma4-moe-4bit-g64-r4": dict(base="gemma4-moe-4bit-g64", seed=9, num_layers=-1,
                                   lora_parameters={"rank": 4, "dropout": 0.0, "scale": 8.0}),
    # LFM2: the short convolutions' in_proj / out_proj (biased), the attention's q/k/v/out_proj and the
    # feed-forwards' w1 / w3 / w2 of every block.
    "lfm2-8bit-g32-r4": dict(base="lfm2-8bit-g32", seed=10, num_layers=-1,
                             lora_parameters={"rank": 4, "dropout": 0.0, "scale": 8.0}),
    # LFM2-MoE: a dense feed-forward under gate_proj/up_proj/down_proj, then the routers and stacked experts.
    "lfm2_moe-4bit-g64-r4": dict(base="lfm2_moe-4bit-g64", seed=11, num_layers=-1,
                                 lora_parameters={"rank": 4, "dropout": 0.0, "scale": 8.0}),
    # The float modes: every linear of every block of the mxfp4 llama, whose layer 0 has an nvfp4 o_proj and an
    # mxfp8 down_proj (fusing dequantizes them to bf16 and quantizes the sums again in their own mode).
    "llama-mxfp4-g32-r4": dict(base="llama-mxfp4-g32", seed=10, num_layers=-1,
                               lora_parameters={"rank": 4, "dropout": 0.0, "scale": 8.0}),
    # Fused layers, which oxlm splits on load: Phi-3's qkv_proj and gate_up_proj, GLM-4's gate_up_proj; every
    # linear of every block.
    "phi3-4bit-g32-r4": dict(base="phi3-4bit-g32", seed=13, num_layers=-1,
                             lora_parameters={"rank": 4, "dropout": 0.0, "scale": 8.0}),
    "glm4-4bit-g32-r4": dict(base="glm4-4bit-g32", seed=14, num_layers=-1,
                             lora_parameters={"rank": 4, "dropout": 0.0, "scale": 8.0}),
    # Gemma 3n (the `gemma3n` wrapper: model.language_model.layers), every block: each layer an adapter can run in
    # mlx-lm (its AltUp reads the coefficient layers' `weight`, which a LoRA layer has not, so its default keys
    # fail): attention (the KV-shared layers' k/v projections too, which never run under a cache), the MLPs, AltUp's
    # router, LAuReL and the per-layer input gates.
    "gemma3n-4bit-g32-r4": dict(
        base="gemma3n-4bit-g32", seed=15, num_layers=-1,
        lora_parameters={"rank": 4, "dropout": 0.0, "scale": 8.0, "keys": [
            "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
            "mlp.up_proj", "mlp.down_proj", "altup.modality_router", "laurel.linear_left", "laurel.linear_right",
            "per_layer_input_gate", "per_layer_projection"]}),
}


def make_adapter(base, out, spec):
    mx.random.seed(spec["seed"])
    model, _ = load(str(base))
    model.freeze()
    linear_to_lora_layers(model, spec["num_layers"], spec["lora_parameters"])
    lora = [(k, v) for k, v in tree_flatten(model.trainable_parameters())]
    model.update(tree_unflatten([(k, B_STD * mx.random.normal(v.shape) if k.endswith("lora_b") else v)
                                 for k, v in lora]))
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "adapters.safetensors"), dict(tree_flatten(model.trainable_parameters())))
    config = {"fine_tune_type": "lora", "num_layers": spec["num_layers"],
              "lora_parameters": spec["lora_parameters"], "model": str(base)}
    save_config(config, out / "adapter_config.json")


def fuse(base, adapter, dst, dequantize):
    """fuse.py's main, minus argument parsing and the model card."""
    model, tokenizer, config = load(str(base), adapter_path=str(adapter), return_config=True)
    fused = [(n, m.fuse(dequantize=dequantize)) for n, m in model.named_modules() if hasattr(m, "fuse")]
    model.update_modules(tree_unflatten(fused))
    if dequantize:
        model = dequantize_model(model)
        config.pop("quantization", None)
        config.pop("quantization_config", None)
    save_model_dir = Path(dst)
    try:
        save(save_model_dir, str(base), model, tokenizer, config, donate_model=False)
    except ImportError:  # the model card needs huggingface_hub; the weights are written before it
        pass
    return save_model_dir


def logits(path, prompt, adapter=None):
    model, _ = load(str(path), adapter_path=None if adapter is None else str(adapter))
    model.set_dtype(mx.float32)
    out = model(mx.array([prompt]))[0].astype(mx.float32)
    mx.eval(out)
    return out


def main():
    tiny = Path(sys.argv[1] if len(sys.argv) > 1 else "tests/fixtures/tiny")
    root = Path(sys.argv[2] if len(sys.argv) > 2 else "tests/fixtures/lora")
    names = sys.argv[3:] or list(ADAPTERS)
    gemma3n_always_cached()
    for name in names:
        spec = ADAPTERS[name]
        base, out = tiny / spec["base"], root / name
        make_adapter(base, out, spec)
        _, tok = load(str(base))
        prompt = list(tok.apply_chat_template(MESSAGES, add_generation_prompt=True))
        res = {"prompt_ids": mx.array(prompt, dtype=mx.int32),
               "base_logits": logits(base, prompt), "adapted_logits": logits(base, prompt, out)}
        with tempfile.TemporaryDirectory() as tmp:
            fused = fuse(base, out, Path(tmp) / "fused", dequantize=False)
            res["fused_logits"] = logits(fused, prompt)
            shutil.copy(fused / "model.safetensors", out / "fused.safetensors")
            res["dequantized_logits"] = logits(fuse(base, out, Path(tmp) / "deq", dequantize=True), prompt)
        mx.save_safetensors(str(out / "golden.safetensors"), res, metadata={"format": "mlx"})
        diff = lambda a, b: float(np.abs(np.array(res[a]) - np.array(res[b])).max())
        info = {
            "base": spec["base"], "messages": MESSAGES, "n_prompt": len(prompt), "lora_b_std": B_STD,
            "max_abs_adapted_minus_base": diff("adapted_logits", "base_logits"),
            "max_abs_fused_minus_adapted": diff("fused_logits", "adapted_logits"),
            "max_abs_dequantized_minus_adapted": diff("dequantized_logits", "adapted_logits"),
            "activations": "float32 (model.set_dtype(mx.float32) after mlx_lm.load)",
            "tensors": {k: [str(v.dtype), list(v.shape)] for k, v in res.items()},
            "versions": {p: version(p) for p in ("mlx", "mlx-lm")},
        }
        (out / "golden.json").write_text(json.dumps(info, indent=1) + "\n")
        print(name, {k: info[k] for k in info if k.startswith("max_abs")}, flush=True)


if __name__ == "__main__":
    main()
