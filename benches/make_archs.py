"""Synthetic benchmark models for the architectures beyond llama, made with the oracle's own recipe.

usage: $(scripts/oracle/venv.sh) benches/make_archs.py OUT_ROOT [NAME...]   (default: every model)
       $(scripts/oracle/venv.sh) benches/make_archs.py --count [NAME...]   (parameters, nothing built)
       $(scripts/oracle/venv.sh) benches/make_archs.py --check-synthetic [NAME...]

Each OUT_ROOT/<name>/ is an MLX 4-bit g64 checkpoint written by mlx-lm itself (scripts/oracle/
make_tiny_models.py's `build`: mlx-lm default init, bf16, quantize_model with the model's own
quant_predicate, save_model), random weights and the tiny test tokenizer (the benchmark feeds token
ids; vocab 32000 in the weights). Every model has the llama's budget (hidden 2048, 16 layers, vocab
32000, untied head unless the architecture always ties), within 1% of its 853M parameters for the
dense ones; the MoE ones (32 routed experts of 192, top-4, unless said) hold 859-919M in all, of which
a token runs (as benches/archs.py counts: the untied embedding left out) the figure given:
- llama-0.85b: as benches/make_synthetic.py shapes it (32/8 heads x 64, MLP 5632).
- qwen3_5-0.85b: 12 gated-DeltaNet and 4 gated-attention layers, its MLP narrowed to 4096.
- phi3-0.85b: the llama with Phi-3's fused qkv_proj and gate_up_proj, 3/4 of each head turning.
- olmo3-0.85b: the llama with OLMo 3's post-norms and q/k norms, three sliding-window layers (window
  256, so that the 512-token prompt overruns it) to each global one.
- lfm2-0.85b: LFM2-1.2B's layer pattern (10 gated short-convolution layers, 6 GQA attention layers
  at 2, 5, 8, 10, 12 and 14), its always-tied head leaving room for a 5632-wide feed-forward.
- qwen3_moe-0.85b: the llama's attention with q/k norms, every MLP a mixture of 32 experts, top-4
  renormalized (8-bit routers through mlx-lm's quant_predicate). 904M, 310M active.
- deepseek_v3-0.85b: MLA (16 heads, q_lora_rank 512, kv_lora_rank 512, rope 64, nope 128, v 128 as
  the real ones), a dense first layer (5632), then 32 routed experts in 4 groups (2 kept) by
  sigmoid scores with a correction bias, top-4, x2.5, beside one shared expert. 912M, 351M active.
- glm4_moe-0.85b: GLM-4.5's block (16/4 heads x 128, half of each head turning, q/k/v biases, q/k
  norms), a dense first layer (5632), then 32 routed experts (sigmoid, one group), top-4, x2.5,
  beside one shared expert. 919M, 358M active.
- qwen3_next-0.85b: Qwen3.5's layers (12 DeltaNet + 4 gated attention) with Qwen3-Next's fused
  in_proj_qkvz / in_proj_ba, every MLP a mixture of 32 experts of 128, top-4, beside a gated
  shared expert of 128 (8-bit routers and shared gates). 859M, 441M active.
- gemma4-moe-top{1,2,4,8}: one Gemma 4 26B-A4B-style model (every layer a dense GeGLU MLP plus 32 routed
  experts) written once with top-1 routing and copied with only `top_k_experts` changed, so the four
  read the same weights but activate 1, 2, 4 or 8 experts per token.

benches/gpu/synthetic_mlx.py writes the same models with numpy alone, in the layout mlx-lm saves
(`--arch-model NAME`), for the GPU machine, which has no mlx; it imports MODELS from here.
"""
import json
import os
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOKENIZER = ROOT / "tests/fixtures/tiny/tokenizer"
COMMON = {"hidden_size": 2048, "num_hidden_layers": 16, "vocab_size": 32000, "rms_norm_eps": 1e-6,
          "max_position_embeddings": 8192, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2}
SPEC = {"seed": 0, "gain": 1.0, "embed_gain": 1.0, "group_size": 64, "bits": 4, "overrides": {}}
LLAMA = dict(COMMON, model_type="llama", intermediate_size=5632, num_attention_heads=32, num_key_value_heads=8,
             head_dim=64, rope_theta=10000.0, hidden_act="silu")
# The MoE models' routed experts: 32 of 192 (6,144 wide in all, the llama's MLP 5,632), 4 a token.
MOE = {"moe_intermediate_size": 192, "num_experts_per_tok": 4, "norm_topk_prob": True}
# DeepSeek-V3-style routing, GLM-4.5's too: sigmoid scores plus a correction bias pick the experts,
# their weights renormalized and scaled; one shared expert; the first layer a dense MLP.
SIGMOID_MOE = dict(MOE, n_routed_experts=32, n_shared_experts=1, first_k_dense_replace=1,
                   routed_scaling_factor=2.5, scoring_func="sigmoid", topk_method="noaux_tc",
                   intermediate_size=5632)



def random_router(path, v):
    """mlx-lm starts DeepSeek-V3's and GLM-4.5's routers (`MoEGate`, not a Linear) at zero, which would
    send every token to the same experts: these start as a Linear does, uniform in ±hidden^-0.5."""
    if path.endswith("mlp.gate.weight"):
        import mlx.core as mx

        return mx.random.uniform(-(v.shape[-1] ** -0.5), v.shape[-1] ** -0.5, v.shape)
    return v


MODELS = {
    "llama-0.85b": dict(SPEC, config=LLAMA),
    "qwen3_5-0.85b": dict(SPEC, config=dict(
        COMMON, model_type="qwen3_5", intermediate_size=4096, full_attention_interval=4,
        num_attention_heads=8, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
        linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
        hidden_act="silu")),
    "phi3-0.85b": dict(SPEC, config=dict(
        LLAMA, model_type="phi3", partial_rotary_factor=0.75, rms_norm_eps=1e-5,
        original_max_position_embeddings=8192, rope_scaling=None)),
    "olmo3-0.85b": dict(SPEC, config=dict(
        LLAMA, model_type="olmo3", sliding_window=256, rope_theta=500000.0,
        layer_types=(["sliding_attention"] * 3 + ["full_attention"]) * 4)),
    "lfm2-0.85b": dict(SPEC, config=dict(
        {k: v for k, v in COMMON.items() if k not in ("rms_norm_eps", "tie_word_embeddings")},
        model_type="lfm2", num_attention_heads=32, num_key_value_heads=8, norm_eps=1e-5, conv_bias=False,
        conv_L_cache=3, block_dim=2048, block_ff_dim=5632, block_multiple_of=256, block_ffn_dim_multiplier=1.0,
        block_auto_adjust_ff_dim=False, full_attn_idxs=[2, 5, 8, 10, 12, 14], rope_theta=1000000.0)),
    "qwen3_moe-0.85b": dict(SPEC, config=dict(
        LLAMA, **MOE, model_type="qwen3_moe", num_experts=32, decoder_sparse_step=1, mlp_only_layers=[],
        rope_theta=1000000.0)),
    "deepseek_v3-0.85b": dict(SPEC, init=random_router, config=dict(
        COMMON, **SIGMOID_MOE, model_type="deepseek_v3", num_attention_heads=16, num_key_value_heads=16,
        q_lora_rank=512, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
        n_group=4, topk_group=2, moe_layer_freq=1, rope_theta=10000.0, rope_scaling=None,
        attention_bias=False)),
    "glm4_moe-0.85b": dict(SPEC, init=random_router, config=dict(
        COMMON, **SIGMOID_MOE, model_type="glm4_moe", num_attention_heads=16, num_key_value_heads=4,
        head_dim=128, partial_rotary_factor=0.5, attention_bias=True, use_qk_norm=True, n_group=1, topk_group=1,
        rope_theta=1000000.0, rope_scaling=None)),
    "qwen3_next-0.85b": dict(SPEC, config=dict(
        COMMON, model_type="qwen3_next", intermediate_size=4096, full_attention_interval=4,
        num_attention_heads=8, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
        linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
        num_experts=32, num_experts_per_tok=4, moe_intermediate_size=128, shared_expert_intermediate_size=128,
        decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True, partial_rotary_factor=0.25,
        rope_theta=10000000.0, attention_bias=False)),
    "gemma4-moe-top1": dict(SPEC, config=dict(
        COMMON, model_type="gemma4_text", hidden_size=1024, num_hidden_layers=8, intermediate_size=1024,
        num_attention_heads=8, num_key_value_heads=2, head_dim=128, global_head_dim=256,
        attention_k_eq_v=True, num_global_key_value_heads=1, sliding_window=1024,
        layer_types=["sliding_attention", "full_attention"] * 4, hidden_size_per_layer_input=0,
        num_kv_shared_layers=0, vocab_size_per_layer_input=32000, final_logit_softcapping=30.0,
        enable_moe_block=True, num_experts=32, top_k_experts=1, moe_intermediate_size=1024)),
}
MOE_TOP_K = (2, 4, 8)


def count(name):
    """(total, routed-expert) parameters of the model mlx-lm makes of MODELS[name], unquantized; lazily,
    so that nothing is built."""
    import mlx.core as mx  # noqa: F401  (the oracle's venv)
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    cfg = json.loads(json.dumps(MODELS[name]["config"]))
    Model, Args = _get_classes(cfg)
    total = routed = 0
    for path, v in tree_flatten(Model(Args.from_dict(cfg)).parameters()):
        total += v.size
        if ".switch_mlp." in path or ".experts." in path:
            routed += v.size
    return total, routed


def mlx_layout(name):
    """name -> (safetensors dtype, shape) and the `quantization` config of the checkpoint `build` saves
    for MODELS[name], all lazily: nothing is computed."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_map_with_path
    from mlx_lm.utils import _get_classes, quantize_model

    spec = MODELS[name]
    cfg = json.loads(json.dumps(spec["config"]))
    Model, Args = _get_classes(cfg)
    model = Model(Args.from_dict(cfg))
    cast = getattr(model, "cast_predicate", lambda k: True)
    model.update(tree_map_with_path(
        lambda k, v: v.astype(mx.bfloat16) if cast(k) and mx.issubdtype(v.dtype, mx.floating) else v,
        model.parameters()))
    model_predicate = getattr(model, "quant_predicate", None)
    model, qcfg = quantize_model(model, cfg, group_size=spec["group_size"], bits=spec["bits"],
                                 quant_predicate=lambda p, m: model_predicate(p, m) if model_predicate else True)
    names = {mx.uint32: "U32", mx.bfloat16: "BF16", mx.float32: "F32"}
    return ({k: (names[v.dtype], tuple(v.shape)) for k, v in tree_flatten(model.parameters())},
            qcfg["quantization"])


def check_synthetic(names):
    """Whether benches/gpu/synthetic_mlx.py writes what mlx-lm saves: the same tensors (names, dtypes,
    shapes) and the same per-module quantization in config.json."""
    sys.path.insert(0, str(ROOT / "benches/gpu"))
    from synthetic_mlx import layout, quant_config

    bad = 0
    for name in names:
        want, want_q = mlx_layout(name)
        lay = layout(MODELS[name]["config"], MODELS[name]["bits"], MODELS[name]["group_size"])
        got, got_q = lay.headers(), quant_config(lay)
        diff = [f"  mlx-lm only: {k} {want[k]}" for k in sorted(set(want) - set(got))]
        diff += [f"  synthetic only: {k} {got[k]}" for k in sorted(set(got) - set(want))]
        diff += [f"  {k}: mlx-lm {want[k]}, synthetic {got[k]}" for k in sorted(set(want) & set(got))
                 if want[k] != got[k]]
        if want_q != got_q:
            diff.append(f"  quantization: mlx-lm {want_q}, synthetic {got_q}")
        print(f"{name}: {len(want)} tensors, " + ("the same" if not diff else "DIFFERENT"))
        print("\n".join(diff[:20]))
        bad += bool(diff)
    return bad


def main():
    if sys.argv[1:2] == ["--count"]:
        for name in sys.argv[2:] or MODELS:
            total, routed = count(name)
            print(f"{name}: {total / 1e6:.1f}M parameters, {routed / 1e6:.1f}M of them routed experts")
        return
    if sys.argv[1:2] == ["--check-synthetic"]:
        sys.exit(check_synthetic(sys.argv[2:] or [n for n in MODELS if not n.startswith("gemma4")]))
    sys.path.insert(0, str(ROOT / "scripts/oracle"))
    from make_tiny_models import build  # the oracle's venv: mlx and mlx-lm

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
