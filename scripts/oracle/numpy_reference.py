"""Independent numpy re-implementation of the tiny llama / mistral / qwen2 / qwen3 forward pass, checked against
the mlx-lm goldens. It is a readable statement of the math a runtime has to reproduce (no mlx kernels used
except to read bf16 tensors from safetensors).

usage: PY=$(scripts/oracle/venv.sh); $PY scripts/oracle/numpy_reference.py [OUT_ROOT] [NAME...]
"""
import json
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np


def unpack(w, bits):
    """uint32 [rows, cols*bits/32] -> uint [rows, cols]; element j of a word sits at bits [j*bits, (j+1)*bits)."""
    per = 32 // bits
    shifts = (np.arange(per, dtype=np.uint32) * bits)[None, None, :]
    q = (w[:, :, None] >> shifts) & np.uint32((1 << bits) - 1)
    return q.reshape(w.shape[0], -1)


E2M1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], np.float32)


def e4m3(c):
    """FP8 E4M3 codes (bias 7, no infinities, 0x7F NaN) -> f32."""
    e, m = (c >> 3) & 15, (c & 7).astype(np.float32)
    mag = np.where(e == 0, m / 8 * 2.0 ** -6, (1 + m / 8) * 2.0 ** (e.astype(np.float32) - 7))
    mag = np.where(c & 0x7F == 0x7F, np.nan, mag)
    return np.where(c & 0x80, -mag, mag).astype(np.float32)


def dequant(t, name, qcfg):
    """Dense f32 [out, in] for `name` (a module path). affine: w = scale * q + bias per group along `in`;
    mxfp4/nvfp4/mxfp8: w = scale * value(code), codes E2M1 (4 bits) or E4M3 (8 bits), scales E8M0 (2^(s-127)) or
    E4M3 (nvfp4)."""
    w = t[name + ".weight"]
    if name + ".scales" not in t:
        return w.astype(np.float32)
    p = qcfg.get(name, qcfg)  # per-module override, else the top-level default
    bits, gs, mode = p["bits"], p["group_size"], p.get("mode", "affine")
    q = unpack(w, bits)
    s = t[name + ".scales"]
    if mode == "affine":
        v, s, b = q.astype(np.float32), s, t[name + ".biases"]
    else:
        v = E2M1[q] if bits == 4 else e4m3(q)
        s = e4m3(s) if mode == "nvfp4" else (2.0 ** (s.astype(np.float32) - 127)).astype(np.float32)
        b = np.zeros_like(s)
    return (v.reshape(q.shape[0], -1, gs) * s[:, :, None] + b[:, :, None]).reshape(q.shape[0], -1)


def rms_norm(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rope_periods(cfg, head_dim):
    """Per-pair periods f_i (angle = position / f_i), as mlx-lm builds them (float32)."""
    # transformers 5 keys `rope_parameters` by layer type where layers differ: full attention's here
    nested = (cfg.get("rope_parameters") or {}).get("full_attention") or {}
    base = np.float32(cfg.get("rope_theta", nested.get("rope_theta", 10000.0)))
    f = base ** (np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim))
    sc = cfg.get("rope_scaling") or {}
    if (sc.get("rope_type") or sc.get("type")) == "llama3":
        factor, lo, hi = sc["factor"], sc.get("low_freq_factor", 1.0), sc.get("high_freq_factor", 4.0)
        old = sc.get("original_max_position_embeddings", 8192)
        wavelen = 2 * np.pi * f
        f2 = np.where(wavelen > old / lo, f * factor, f)
        medium = (wavelen > old / hi) & (wavelen < old / lo)
        smooth = (old / wavelen - lo) / (hi - lo)
        f = np.where(medium, f2 / ((1 - smooth) / factor + smooth), f2)
    return f.astype(np.float32)


def rope(x, periods, traditional):
    """x [heads, L, d]; non-traditional = rotate halves (i, i + d/2); traditional = pairs (2i, 2i+1)."""
    L, d = x.shape[1], x.shape[2]
    ang = np.arange(L, dtype=np.float32)[:, None] / periods[None, :]
    c, s = np.cos(ang), np.sin(ang)
    if traditional:
        a, b = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2], out[..., 1::2] = a * c - b * s, a * s + b * c
        return out
    a, b = x[..., : d // 2], x[..., d // 2:]
    return np.concatenate([a * c - b * s, a * s + b * c], axis=-1)


def forward(path, ids, lora=None, dtype=np.float32):
    """Logits [len(ids), vocab]. `lora`: ({module path: (lora_a [in, r], lora_b [r, out])}, scale), each adapted
    layer adding scale * (x @ lora_a) @ lora_b as mlx-lm's LoRALinear does; `dtype`: the activations' type."""
    cfg = json.loads((path / "config.json").read_text())
    t = {k: np.array(v.astype(mx.float32) if v.dtype == mx.bfloat16 else v) for k, v in mx.load(str(path / "model.safetensors")).items()}
    q = cfg["quantization"]
    mt = cfg["model_type"]
    H, KV, D = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["hidden_size"]
    hd = cfg.get("head_dim") if mt != "qwen2" else None  # qwen2.py ignores head_dim: hidden / heads
    hd = hd or D // H
    eps = cfg["rms_norm_eps"]
    trad = cfg.get("rope_traditional", False) if mt != "qwen3" else False
    periods = rope_periods(cfg, hd)
    E = dequant(t, "model.embed_tokens", q).astype(dtype)
    x = E[np.array(ids)]
    L = len(ids)
    mask = np.triu(np.full((L, L), -np.inf, dtype=np.float32), 1)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        lin = lambda n, h: linear(t, q, p + n, h, lora, dtype)
        h = rms_norm(x, t[p + "input_layernorm.weight"], eps)
        qh = lin("self_attn.q_proj", h).reshape(L, H, hd).transpose(1, 0, 2)
        kh = lin("self_attn.k_proj", h).reshape(L, KV, hd).transpose(1, 0, 2)
        vh = lin("self_attn.v_proj", h).reshape(L, KV, hd).transpose(1, 0, 2)
        if mt == "qwen3":  # per-head RMSNorm over head_dim, before rope
            qh = rms_norm(qh, t[p + "self_attn.q_norm.weight"], eps)
            kh = rms_norm(kh, t[p + "self_attn.k_norm.weight"], eps)
        qh, kh = rope(qh, periods, trad), rope(kh, periods, trad)
        rep = H // KV  # query head j uses kv head j // rep
        kh, vh = np.repeat(kh, rep, axis=0), np.repeat(vh, rep, axis=0)
        sc = qh @ kh.transpose(0, 2, 1) * np.float32(hd ** -0.5) + mask
        sc = np.exp(sc - sc.max(-1, keepdims=True))
        o = (sc / sc.sum(-1, keepdims=True)) @ vh
        x = x + lin("self_attn.o_proj", o.transpose(1, 0, 2).reshape(L, H * hd))
        h = rms_norm(x, t[p + "post_attention_layernorm.weight"], eps)
        g, u = lin("mlp.gate_proj", h), lin("mlp.up_proj", h)
        x = x + lin("mlp.down_proj", g / (1 + np.exp(-g)) * u)
    x = rms_norm(x, t["model.norm.weight"], eps)
    head = E if cfg.get("tie_word_embeddings", True) else dequant(t, "lm_head", q).astype(dtype)
    return x @ head.T


def linear(t, qcfg, name, h, lora, dtype):
    y = h @ dequant(t, name, qcfg).astype(dtype).T + t.get(name + ".bias", 0)
    if lora is not None and name in lora[0]:
        a, b = lora[0][name]
        y = y + lora[1] * ((h @ a) @ b)
    return y


def main():
    root = Path(sys.argv[1] if len(sys.argv) > 1 else "tests/fixtures/tiny")
    # the families this file implements; others (qwen3_5, gemma) are checked against mlx-lm only
    names = sys.argv[2:] or sorted(
        p.name for p in root.iterdir() if (p / "golden.safetensors").exists()
        and json.loads((p / "config.json").read_text())["model_type"] in ("llama", "mistral", "qwen2", "qwen3"))
    worst = 0.0
    for name in names:
        g = {k: np.array(v) for k, v in mx.load(str(root / name / "golden.safetensors")).items()}
        ids, greedy = g["prompt_ids"].tolist(), g["greedy_ids"].tolist()
        full = forward(root / name, ids + greedy[:-1])
        d_prompt = np.abs(full[: len(ids)] - g["prompt_logits"]).max()
        d_steps = np.abs(full[len(ids) - 1:] - g["step_logits"]).max()
        same = full[len(ids) - 1:].argmax(-1).tolist() == greedy
        worst = max(worst, d_prompt, d_steps)
        print(f"{name}: max|numpy - mlx| prompt_logits {d_prompt:.2e}, step_logits {d_steps:.2e}, "
              f"greedy ids {'match' if same else 'DIFFER'}")
    assert worst < 1e-3, worst


if __name__ == "__main__":
    main()
