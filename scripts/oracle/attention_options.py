"""Prints mlx's attention with sinks (gpt-oss's: mx.fast.scaled_dot_product_attention(...,
sinks=)) and with soft-capped scores (Gemma 2's, as mlx-lm's gemma2.py computes them), on small
inputs that crates/engine/tests/attention_options.rs builds the same way, as the Rust constants
that test compares with: `PY=$(scripts/oracle/venv.sh); $PY scripts/oracle/attention_options.py`."""
import math
import mlx.core as mx
import numpy as np

T, H, KV, D = 3, 4, 2, 8
SCALE, CAP = 0.35, 1.5
SINKS = [0.5, -1.0, 2.0, 1.0]

def wave(n, f, a, b):
    return np.array([f(a * i + b) for i in range(n)], dtype=np.float32)

q = wave(T * H * D, math.sin, 0.7, 0.1).reshape(T, H, D).transpose(1, 0, 2)[None]
k = wave(T * KV * D, math.cos, 0.3, 0.2).reshape(T, KV, D).transpose(1, 0, 2)[None]
v = wave(T * KV * D, math.sin, 1.3, 0.5).reshape(T, KV, D).transpose(1, 0, 2)[None]
q, k, v = mx.array(q), mx.array(k), mx.array(v)

def tokens_first(o):
    return np.array(o)[0].transpose(1, 0, 2).reshape(-1)

sinks = mx.fast.scaled_dot_product_attention(
    q, k, v, scale=SCALE, mask="causal", sinks=mx.array(SINKS, dtype=mx.float32))

# gemma2.py: queries scaled, then scores capped, masked and softmaxed.
rep = H // KV
qs = (q * SCALE).reshape(1, KV, rep, T, D)
scores = qs @ mx.expand_dims(k, 2).swapaxes(-1, -2)
scores = mx.tanh(scores / CAP) * CAP
mask = mx.array(np.tril(np.ones((T, T), dtype=bool)))
scores = mx.where(mask, scores, mx.array(mx.finfo(scores.dtype).min, scores.dtype))
capped = (mx.softmax(scores, precise=True, axis=-1) @ mx.expand_dims(v, 2)).reshape(1, H, T, D)

# Each float as the shortest decimal that reads back as it (as Rust's {:?} writes an f32).
for name, o in [("SINKS", sinks), ("SOFTCAP", capped)]:
    vals = tokens_first(o)
    print("#[rustfmt::skip]")
    print(f"const MLX_{name}: [f32; {len(vals)}] = [")
    for row in vals.reshape(-1, 6):
        print("    " + " ".join(f"{np.format_float_positional(x, unique=True)}," for x in row))
    print("];")
