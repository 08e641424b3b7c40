"""Writes a random-weight llama (or Qwen2, `--arch qwen2`), or one of benches/make_archs.py's models
(`--arch-model NAME`), in the MLX affine layout (config.json + model.safetensors) with numpy alone,
for timing on machines that have no mlx (the GPU machine).

usage: python3 benches/gpu/synthetic_mlx.py OUT --hidden 2048 --intermediate 5632 --layers 16
           --heads 32 --kv-heads 8 --vocab 32000 [--arch qwen2] [--bits 4] [--group-size 64]
       python3 benches/gpu/synthetic_mlx.py OUT --arch-model deepseek_v3-0.85b [--bits 4] [--group-size 64]

Packed weights are random words (every bit pattern), scales and biases bf16 of the size
mlx_lm.convert gives weights of std 0.02, norms 1: speed is what random weights measure; the
tokens are noise. No tokenizer is written (`oxlm bench` feeds token ids).

`--arch-model` writes the tensors mlx-lm saves for that config (names, shapes, dtypes, and the
per-module quantization of its quant_predicate, such as 8-bit routers; `layout` below), which
`make_archs.py --check-synthetic` compares with mlx-lm's own. The unquantized parameters: norms 1,
biases N(0, 0.02), routers that mlx-lm keeps in bf16 uniform in ±hidden^-0.5 (mlx-lm starts
DeepSeek-V3's and GLM-4.5's at zero, which would route every token alike), score-correction biases
0, convolutions uniform in ±kernel^-0.5, DeltaNet's A_log log U(1, 16) and dt_bias 1, as mlx-lm
initializes them.
"""
import argparse
import json
import struct
import sys
from pathlib import Path

import numpy as np

from shapes import add_shape_args

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from make_archs import MODELS  # noqa: E402  (configs only: no mlx needed)


def bf16(a):
    """float32 array -> bf16 bits (round to nearest even) as uint16."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def write_safetensors(path, tensors):
    """`tensors`: name -> (dtype string, shape, bytes), written in the safetensors layout."""
    header, offset = {}, 0
    for name, (dtype, shape, data) in tensors.items():
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for _, _, data in tensors.values():
            f.write(data)


# ---- the architectures of benches/make_archs.py ------------------------------------------------


class Layout:
    """A checkpoint's tensors, before any data: name -> spec. Quantized modules ("q": [..., rows,
    cols], bits, group) become `.weight`, `.scales` and `.biases`; the others are ("norm", n),
    ("bias", n) or ("float", dtype, shape, init)."""

    def __init__(self, bits, group):
        self.bits, self.group = bits, group
        self.specs = {}
        self.overrides = {}  # module -> its quantization where it is not the default's

    def q(self, name, *shape, bits=None, group=None):
        bits, group = bits or self.bits, group or self.group
        assert shape[-1] % group == 0, (name, shape, group)
        self.specs[name] = ("q", shape, bits, group)
        if (bits, group) != (self.bits, self.group):
            self.overrides[name] = {"group_size": group, "bits": bits}

    def norm(self, name, n):
        self.specs[f"{name}.weight"] = ("norm", n)

    def bias(self, name, n):
        self.specs[f"{name}.bias"] = ("bias", n)

    def other(self, name, dtype, shape, init):
        self.specs[name] = ("float", dtype, tuple(shape), init)

    def headers(self):
        """name -> (safetensors dtype, shape), as the file holds them."""
        out = {}
        for name, spec in self.specs.items():
            if spec[0] == "q":
                _, shape, bits, group = spec
                *lead, rows, cols = shape
                out[f"{name}.weight"] = ("U32", (*lead, rows, cols * bits // 32))
                out[f"{name}.scales"] = ("BF16", (*lead, rows, cols // group))
                out[f"{name}.biases"] = ("BF16", (*lead, rows, cols // group))
            elif spec[0] in ("norm", "bias"):
                out[name] = ("BF16", (spec[1],))
            else:
                out[name] = (spec[1], spec[2])
        return out

    def tensors(self, rng):
        out = {}
        for name, spec in self.specs.items():
            if spec[0] == "q":
                _, shape, bits, group = spec
                *lead, rows, cols = shape
                words = rng.integers(0, 2**32, size=(*lead, rows, cols * bits // 32), dtype=np.uint32)
                groups = (*lead, rows, cols // group)
                # Weights of std 0.02 span about ±0.07: scale = range / levels, bias = the minimum.
                scales = bf16(rng.uniform(0.10, 0.16, groups) / (2**bits - 1))
                biases = bf16(rng.uniform(-0.08, -0.05, groups))
                out[f"{name}.weight"] = ("U32", words.shape, words.tobytes())
                out[f"{name}.scales"] = ("BF16", groups, scales.tobytes())
                out[f"{name}.biases"] = ("BF16", groups, biases.tobytes())
            elif spec[0] == "norm":
                out[name] = ("BF16", (spec[1],), bf16(np.ones(spec[1])).tobytes())
            elif spec[0] == "bias":
                out[name] = ("BF16", (spec[1],), bf16(rng.normal(0, 0.02, spec[1])).tobytes())
            else:
                _, dtype, shape, init = spec
                v = init(rng, shape)
                data = bf16(v) if dtype == "BF16" else np.asarray(v, dtype=np.float32)
                out[name] = (dtype, shape, data.tobytes())
        return out


def uniform(bound):
    return lambda rng, shape: rng.uniform(-bound, bound, shape)


def constant(value):
    return lambda rng, shape: np.full(shape, value, dtype=np.float32)


def layout(cfg, bits, group):
    """The tensors mlx-lm saves for `cfg` (one of make_archs.MODELS' configs), quantized by its
    `quantize_model` with the model's quant_predicate."""
    t = cfg["model_type"]
    lay = Layout(bits, group)
    h, n_layers, vocab = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    hd = cfg.get("head_dim") or h // heads
    if t == "phi3":
        hd = h // heads
    pre = "language_model.model" if t == "qwen3_5" else "model"
    router = uniform(h ** -0.5)

    def mlp(p, width, names=("gate_proj", "up_proj", "down_proj")):
        gate, up, down = names
        lay.q(f"{p}.{gate}", width, h)
        lay.q(f"{p}.{up}", width, h)
        lay.q(f"{p}.{down}", h, width)

    def experts(p, count, width):
        lay.q(f"{p}.switch_mlp.gate_proj", count, width, h)
        lay.q(f"{p}.switch_mlp.up_proj", count, width, h)
        lay.q(f"{p}.switch_mlp.down_proj", count, h, width)

    def attention(p, q_rows=None, bias=False, o_name="o_proj"):
        lay.q(f"{p}.q_proj", q_rows or heads * hd, h)
        lay.q(f"{p}.k_proj", kv_heads * hd, h)
        lay.q(f"{p}.v_proj", kv_heads * hd, h)
        lay.q(f"{p}.{o_name}", h, heads * hd)
        if bias:
            for name, rows in (("q_proj", heads * hd), ("k_proj", kv_heads * hd), ("v_proj", kv_heads * hd)):
                lay.bias(f"{p}.{name}", rows)

    def delta_net(p, fused):
        kh, kd = cfg["linear_num_key_heads"], cfg["linear_key_head_dim"]
        vh, vd = cfg["linear_num_value_heads"], cfg["linear_value_head_dim"]
        kernel = cfg["linear_conv_kernel_dim"]
        conv_dim = 2 * kh * kd + vh * vd
        if fused:
            lay.q(f"{p}.in_proj_qkvz", 2 * kh * kd + 2 * vh * vd, h)
            lay.q(f"{p}.in_proj_ba", 2 * vh, h)
        else:
            lay.q(f"{p}.in_proj_qkv", conv_dim, h)
            lay.q(f"{p}.in_proj_z", vh * vd, h)
            lay.q(f"{p}.in_proj_b", vh, h)
            lay.q(f"{p}.in_proj_a", vh, h)
        lay.other(f"{p}.conv1d.weight", "BF16", (conv_dim, kernel, 1), uniform(kernel ** -0.5))
        lay.other(f"{p}.dt_bias", "BF16", (vh,), constant(1.0))
        # Qwen3.5's cast_predicate keeps A_log in f32; Qwen3-Next has none.
        lay.other(f"{p}.A_log", "BF16" if fused else "F32", (vh,),
                  lambda rng, shape: np.log(rng.uniform(1.0, 16.0, shape)))
        lay.norm(f"{p}.norm", vd)
        lay.q(f"{p}.out_proj", h, vh * vd)

    lay.q(f"{pre}.embed_tokens", vocab, h)
    for i in range(n_layers):
        p = f"{pre}.layers.{i}"
        if t == "lfm2":
            full = cfg.get("full_attn_idxs")
            if full is None:
                full = [j for j, lt in enumerate(cfg["layer_types"]) if lt == "full_attention"]
            if i in full:
                attention(f"{p}.self_attn", o_name="out_proj")
                lay.norm(f"{p}.self_attn.q_layernorm", hd)
                lay.norm(f"{p}.self_attn.k_layernorm", hd)
            else:
                lay.q(f"{p}.conv.in_proj", 3 * h, h)
                lay.other(f"{p}.conv.conv.weight", "BF16", (h, cfg["conv_L_cache"], 1),
                          uniform(cfg["conv_L_cache"] ** -0.5))
                lay.q(f"{p}.conv.out_proj", h, h)
                if cfg["conv_bias"]:
                    lay.bias(f"{p}.conv.in_proj", 3 * h)
                    lay.bias(f"{p}.conv.conv", h)
                    lay.bias(f"{p}.conv.out_proj", h)
            assert not cfg["block_auto_adjust_ff_dim"]
            mlp(f"{p}.feed_forward", cfg["block_ff_dim"], ("w1", "w3", "w2"))
            lay.norm(f"{p}.operator_norm", h)
            lay.norm(f"{p}.ffn_norm", h)
            continue

        # the attention, or the mixer in its place
        if t in ("qwen3_5", "qwen3_next"):
            if (i + 1) % cfg["full_attention_interval"]:
                delta_net(f"{p}.linear_attn", fused=t == "qwen3_next")
            else:  # gated attention: the query projection also makes the gate
                attention(f"{p}.self_attn", q_rows=2 * heads * hd)
                lay.norm(f"{p}.self_attn.q_norm", hd)
                lay.norm(f"{p}.self_attn.k_norm", hd)
        elif t == "deepseek_v3":
            a = f"{p}.self_attn"
            nope, rope, latent, v = (cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["kv_lora_rank"],
                                     cfg["v_head_dim"])
            if cfg.get("q_lora_rank"):
                lay.q(f"{a}.q_a_proj", cfg["q_lora_rank"], h)
                lay.norm(f"{a}.q_a_layernorm", cfg["q_lora_rank"])
                lay.q(f"{a}.q_b_proj", heads * (nope + rope), cfg["q_lora_rank"])
            else:
                lay.q(f"{a}.q_proj", heads * (nope + rope), h)
            lay.q(f"{a}.kv_a_proj_with_mqa", latent + rope, h)
            lay.norm(f"{a}.kv_a_layernorm", latent)
            lay.q(f"{a}.embed_q", heads, latent, nope)
            lay.q(f"{a}.unembed_out", heads, v, latent)
            lay.q(f"{a}.o_proj", h, heads * v)
            assert not cfg.get("attention_bias")
        elif t == "phi3":
            lay.q(f"{p}.self_attn.qkv_proj", (heads + 2 * kv_heads) * hd, h)
            lay.q(f"{p}.self_attn.o_proj", h, heads * hd)
        else:
            attention(f"{p}.self_attn", bias=t == "glm4_moe" and cfg.get("attention_bias", False))
            if t == "qwen3_moe" or (t == "glm4_moe" and cfg.get("use_qk_norm")):
                lay.norm(f"{p}.self_attn.q_norm", hd)
                lay.norm(f"{p}.self_attn.k_norm", hd)
            elif t == "olmo3":
                lay.norm(f"{p}.self_attn.q_norm", heads * hd)
                lay.norm(f"{p}.self_attn.k_norm", kv_heads * hd)
            else:
                assert t in ("llama", "phi3"), t

        # the MLP, or the mixture of experts in its place
        m = f"{p}.mlp"
        if t in ("qwen3_moe", "qwen3_next") and i not in cfg["mlp_only_layers"] \
                and (i + 1) % cfg["decoder_sparse_step"] == 0:
            lay.q(f"{m}.gate", cfg["num_experts"], h, bits=8, group=64)
            experts(m, cfg["num_experts"], cfg["moe_intermediate_size"])
            if t == "qwen3_next":
                mlp(f"{m}.shared_expert", cfg["shared_expert_intermediate_size"])
                lay.q(f"{m}.shared_expert_gate", 1, h, bits=8, group=64)
        elif t in ("deepseek_v3", "glm4_moe") and i >= cfg["first_k_dense_replace"] \
                and i % cfg.get("moe_layer_freq", 1) == 0:
            count = cfg["n_routed_experts"]
            lay.other(f"{m}.gate.weight", "BF16", (count, h), router)
            lay.other(f"{m}.gate.e_score_correction_bias", "F32", (count,), constant(0.0))
            experts(m, count, cfg["moe_intermediate_size"])
            if cfg.get("n_shared_experts"):
                mlp(f"{m}.shared_experts", cfg["moe_intermediate_size"] * cfg["n_shared_experts"])
        elif t == "phi3":
            lay.q(f"{m}.gate_up_proj", 2 * cfg["intermediate_size"], h)
            lay.q(f"{m}.down_proj", h, cfg["intermediate_size"])
        else:
            mlp(m, cfg["intermediate_size"])

        if t == "olmo3":
            lay.norm(f"{p}.post_attention_layernorm", h)
            lay.norm(f"{p}.post_feedforward_layernorm", h)
        else:
            lay.norm(f"{p}.input_layernorm", h)
            lay.norm(f"{p}.post_attention_layernorm", h)

    if t == "lfm2":
        lay.norm(f"{pre}.embedding_norm", h)  # the head is the embedding, always
    else:
        lay.norm(f"{pre}.norm", h)
        if not cfg.get("tie_word_embeddings", True):
            lay.q("language_model.lm_head" if t == "qwen3_5" else "lm_head", vocab, h)
    return lay


def quant_config(lay):
    """config.json's `quantization`, as mlx-lm's quantize_model records it."""
    q = {"group_size": lay.group, "bits": lay.bits, "mode": "affine"}
    q.update(lay.overrides)
    return q


def write_arch_model(out, name, bits, group):
    cfg = json.loads(json.dumps(MODELS[name]["config"]))
    assert "gemma4" not in cfg["model_type"], "Gemma 4's layout is not written here"
    lay = layout(cfg, bits, group)
    tensors = lay.tensors(np.random.default_rng(0))
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    write_safetensors(out / "model.safetensors", tensors)
    cfg["quantization"] = cfg["quantization_config"] = quant_config(lay)
    (out / "config.json").write_text(json.dumps(dict(sorted(cfg.items())), indent=4))
    size = sum(len(d) for _, _, d in tensors.values())
    print(f"wrote {out}: {name}, {size / 2**20:.0f} MiB, {bits}-bit g{group}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    add_shape_args(ap)
    ap.add_argument("--arch-model", choices=[n for n in MODELS if not n.startswith("gemma4")],
                    help="one of benches/make_archs.py's models (the shape arguments are then ignored)")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=64)
    a = ap.parse_args()
    if a.arch_model:
        write_arch_model(a.out, a.arch_model, a.bits, a.group_size)
        return
    rng = np.random.default_rng(0)
    h, hd = a.hidden, a.hidden // a.heads
    tensors = {}

    def linear(name, rows, cols):
        words = rng.integers(0, 2**32, size=(rows, cols * a.bits // 32), dtype=np.uint32)
        groups = (rows, cols // a.group_size)
        # Weights of std 0.02 span about ±0.07: scale = range / levels, bias = the minimum.
        scales = bf16(rng.uniform(0.10, 0.16, groups) / (2**a.bits - 1))
        biases = bf16(rng.uniform(-0.08, -0.05, groups))
        tensors[f"{name}.weight"] = ("U32", words.shape, words.tobytes())
        tensors[f"{name}.scales"] = ("BF16", groups, scales.tobytes())
        tensors[f"{name}.biases"] = ("BF16", groups, biases.tobytes())

    def norm(name):
        tensors[f"{name}.weight"] = ("BF16", (h,), bf16(np.ones(h)).tobytes())

    def bias(name, rows):
        tensors[f"{name}.bias"] = ("BF16", (rows,), bf16(rng.normal(0, 0.02, rows)).tobytes())

    qwen2 = a.arch == "qwen2"
    linear("model.embed_tokens", a.vocab, h)
    for i in range(a.layers):
        p = f"model.layers.{i}"
        norm(f"{p}.input_layernorm")
        norm(f"{p}.post_attention_layernorm")
        linear(f"{p}.self_attn.q_proj", a.heads * hd, h)
        linear(f"{p}.self_attn.k_proj", a.kv_heads * hd, h)
        linear(f"{p}.self_attn.v_proj", a.kv_heads * hd, h)
        if qwen2:
            bias(f"{p}.self_attn.q_proj", a.heads * hd)
            bias(f"{p}.self_attn.k_proj", a.kv_heads * hd)
            bias(f"{p}.self_attn.v_proj", a.kv_heads * hd)
        linear(f"{p}.self_attn.o_proj", h, a.heads * hd)
        linear(f"{p}.mlp.gate_proj", a.intermediate, h)
        linear(f"{p}.mlp.up_proj", a.intermediate, h)
        linear(f"{p}.mlp.down_proj", h, a.intermediate)
    norm("model.norm")
    if not qwen2:
        linear("lm_head", a.vocab, h)

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    write_safetensors(out / "model.safetensors", tensors)
    quant = {"group_size": a.group_size, "bits": a.bits, "mode": "affine"}
    config = {
        "model_type": a.arch,
        "architectures": ["Qwen2ForCausalLM" if qwen2 else "LlamaForCausalLM"],
        "hidden_size": h, "intermediate_size": a.intermediate, "num_hidden_layers": a.layers,
        "num_attention_heads": a.heads, "num_key_value_heads": a.kv_heads, "head_dim": hd,
        "rms_norm_eps": 1e-6 if qwen2 else 1e-5, "vocab_size": a.vocab,
        "rope_theta": 1e6 if qwen2 else 10000.0, "max_position_embeddings": 32768,
        "tie_word_embeddings": qwen2, "quantization": quant, "quantization_config": quant,
    }
    (out / "config.json").write_text(json.dumps(config, indent=1))
    size = sum(len(d) for _, _, d in tensors.values())
    print(f"wrote {out}: {size / 2**20:.0f} MiB, {a.bits}-bit g{a.group_size}")


if __name__ == "__main__":
    main()
