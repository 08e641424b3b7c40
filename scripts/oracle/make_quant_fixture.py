"""MLX affine quantization oracle: mx.quantize, mx.dequantize and mx.quantized_matmul on a small matrix.

usage: PY=$(scripts/oracle/venv.sh); $PY scripts/oracle/make_quant_fixture.py [OUT]
  OUT default crates/engine/tests/fixtures/quant_oracle.safetensors

Writes (N=3 rows, K=256 columns, M=3 activation rows; CPU device, mlx 0.32.4)
  x                  f32 [M, K]   activations
  w.{dt}             {dt} [N, K]  source weights, dt in f32/f16/bf16 (f16/bf16 are f32 cast); row 0 holds an
                                  all-zero group and a constant group so the degenerate-scale branch is covered
  {dt}.b{bits}.g{g}. weight  u32 [N, K*bits/32]   mx.quantize(w.{dt}, group_size=g, bits=bits) (affine)
                     scales  {dt} [N, K/g]
                     biases  {dt} [N, K/g]
                     dequant f32 [N, K]  mx.dequantize(weight, scales.astype(f32), biases.astype(f32))
                     y       f32 [M, N]  mx.quantized_matmul(x, weight, scales.astype(f32), biases.astype(f32),
                                         transpose=True)
for bits 2,3,4,5,6,8 and g 32,64,128. Scales/biases are upcast before dequantize/matmul because the Rust
kernels compute in f32 (an exact conversion), whereas mlx with f16/bf16 operands would round in that dtype.
"""
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np

N, K, M = 3, 256, 3
DTYPES = {"f32": mx.float32, "f16": mx.float16, "bf16": mx.bfloat16}


def main():
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "crates/engine/tests/fixtures/quant_oracle.safetensors")
    mx.set_default_device(mx.cpu)
    rng = np.random.default_rng(20240607)
    w = rng.standard_normal((N, K)).astype(np.float32) * 0.05
    w[0, :32] = 0.0
    w[0, 128:160] = 0.5
    x = rng.standard_normal((M, K)).astype(np.float32)
    xm = mx.array(x)
    tensors = {"x": xm}
    for name, dt in DTYPES.items():
        wd = mx.array(w).astype(dt)
        tensors[f"w.{name}"] = wd
        for bits in (2, 3, 4, 5, 6, 8):
            for g in (32, 64, 128):
                wq, s, b = mx.quantize(wd, group_size=g, bits=bits, mode="affine")
                s32, b32 = s.astype(mx.float32), b.astype(mx.float32)
                p = f"{name}.b{bits}.g{g}."
                tensors[p + "weight"] = wq
                tensors[p + "scales"] = s
                tensors[p + "biases"] = b
                tensors[p + "dequant"] = mx.dequantize(wq, s32, b32, group_size=g, bits=bits, mode="affine")
                tensors[p + "y"] = mx.quantized_matmul(
                    xm, wq, s32, b32, transpose=True, group_size=g, bits=bits, mode="affine"
                )
    mx.eval(tensors)
    out.parent.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out), tensors, metadata={"mlx": mx.__version__})
    print(f"wrote {out} ({out.stat().st_size} bytes, {len(tensors)} tensors)")


if __name__ == "__main__":
    main()
