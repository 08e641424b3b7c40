"""MLX float quantization modes oracle: mx.quantize, mx.dequantize and mx.quantized_matmul in the mxfp4, nvfp4 and
mxfp8 modes on a small matrix.

usage: PY=$(scripts/oracle/venv.sh); $PY scripts/oracle/make_quant_modes_fixture.py [OUT]
  OUT default crates/engine/tests/fixtures/quant_modes_oracle.safetensors

Writes (N=8 rows, K=256 columns, M=9 activation rows; CPU device, mlx 0.32.4)
  x                   f32 [M, K]   activations
  w.{dt}              {dt} [N, K]  source weights, dt in f32/f16/bf16 (f16/bf16 are f32 cast): N(0, 0.05) with rows
                                   scaled by 10^-4..10^2 (E4M3 scales from subnormal to large, E8M0 from 2^-19 up), row 0
                                   holding an all-zero group and a constant one, row 1 a group of one large value among
                                   tiny ones (subnormal E4M3 codes)
  {mode}.{dt}.  weight  u32 [N, K*bits/32]  mx.quantize(w.{dt}, mode=mode) (the mode's default bits and group size)
                scales  u8  [N, K/g]
                dequant f32 [N, K]  mx.dequantize(weight, scales, mode=mode, dtype=float32)
                y1      f32 [1, N]  mx.quantized_matmul(x[:1], weight, scales, transpose=True, mode=mode)  (a decode row)
                y       f32 [M, N]  the same for every row of x (prefill)
  {mode}.codes. weight, scales, dequant: every code (bar E4M3's NaN, 0x7F and 0xFF) under a spread of scale codes
                (E8M0 from 2^-127 to 2^127; E4M3 subnormal, normal, negative), to check the decoding tables whole
for mode in mxfp4 (bits 4, group 32, E8M0 scales), nvfp4 (4, 16, E4M3) and mxfp8 (8, 32, E8M0).
"""
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np

N, K, M = 8, 256, 9
DTYPES = {"f32": mx.float32, "f16": mx.float16, "bf16": mx.bfloat16}
MODES = {"mxfp4": (4, 32), "nvfp4": (4, 16), "mxfp8": (8, 32)}


def code_case(mode):
    """Every code of the mode's elements in each row, under one scale code per group."""
    bits, g = MODES[mode]
    if bits == 4:
        codes = np.tile(np.arange(16, dtype=np.uint32), N * K // 16).reshape(N, K)
    else:
        usable = np.array([c for c in range(256) if c & 0x7F != 0x7F], dtype=np.uint32)
        codes = np.resize(usable, N * K).reshape(N, K)
    per = 32 // bits
    shifts = (np.arange(per, dtype=np.uint32) * bits)[None, None, :]
    packed = (codes.reshape(N, K // per, per) << shifts).sum(-1).astype(np.uint32)
    if mode == "nvfp4":  # E4M3 scales: subnormal, normal, negative, largest finite
        spread = [0x01, 0x05, 0x08, 0x30, 0x38, 0x50, 0x7E, 0xB8, 0x86, 0x00]
    else:  # E8M0: 2^-127 .. 2^127 (255, infinite, left out)
        spread = [0, 1, 2, 60, 100, 127, 128, 200, 253, 254]
    scales = np.resize(np.array(spread, dtype=np.uint8), N * K // g).reshape(N, K // g)
    return mx.array(packed), mx.array(scales)


def main():
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "crates/engine/tests/fixtures/quant_modes_oracle.safetensors")
    mx.set_default_device(mx.cpu)
    rng = np.random.default_rng(20250611)
    w = rng.standard_normal((N, K)).astype(np.float32) * 0.05
    w *= (10.0 ** np.linspace(-4, 2, N)).astype(np.float32)[:, None]
    w[0, :32] = 0.0
    w[0, 64:96] = 0.5
    w[1, 32:64] *= 1e-3
    w[1, 40] = 3.0
    x = rng.standard_normal((M, K)).astype(np.float32)
    xm = mx.array(x)
    tensors = {"x": xm}
    for name, dt in DTYPES.items():
        tensors[f"w.{name}"] = mx.array(w).astype(dt)
    for mode in MODES:
        for name in DTYPES:
            wq, s = mx.quantize(tensors[f"w.{name}"], mode=mode)
            p = f"{mode}.{name}."
            tensors[p + "weight"] = wq
            tensors[p + "scales"] = s
            tensors[p + "dequant"] = mx.dequantize(wq, s, mode=mode, dtype=mx.float32)
            tensors[p + "y1"] = mx.quantized_matmul(xm[:1], wq, s, transpose=True, mode=mode)
            tensors[p + "y"] = mx.quantized_matmul(xm, wq, s, transpose=True, mode=mode)
        wq, s = code_case(mode)
        p = f"{mode}.codes."
        tensors[p + "weight"] = wq
        tensors[p + "scales"] = s
        tensors[p + "dequant"] = mx.dequantize(wq, s, mode=mode, dtype=mx.float32)
    mx.eval(tensors)
    for k, v in tensors.items():
        if k.endswith("dequant") or k.endswith("y") or k.endswith("y1"):
            assert not np.isnan(np.array(v)).any(), k
    out.parent.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out), tensors, metadata={"mlx": mx.__version__})
    print(f"wrote {out} ({out.stat().st_size} bytes, {len(tensors)} tensors)")


if __name__ == "__main__":
    main()
