"""GGUF block-dequantization oracle: gguf-py's dequantize and mlx's GGUF loader on one tensor per type.

usage: PY=$(scripts/oracle/venv.sh); $PY scripts/oracle/make_gguf_fixtures.py [OUT_DIR]
  OUT_DIR default tests/fixtures/gguf

Writes (gguf 0.19.0, mlx 0.32.4, CPU)
  blocks.gguf   arch `llama`, one small tensor per ggml type that oxlm reads, named `{type}.weight` (as mx.load
                wants: it names scales and biases after the `.weight` it strips):
                  f32 [3, 7], f16 [3, 8] (with subnormals, -0 and the f16 max), bf16 [2, 8]
                  q4_0 q4_1 q5_0 q5_1 q8_0 [4, 64]: gguf.quants.quantize of seeded normals; row 0 holds an
                                                    all-zero block and a constant block
                  q2_k q3_k q4_k q5_k q6_k [3, 256]: seeded random bytes (gguf-py cannot quantize these) with
                                                     the f16 super-block scales d (and dmin) set to sane values
  blocks.json   "dequantize": {tensor name: {type, shape, values}} with values the f32 bit patterns (u32) of
                gguf.quants.dequantize(data, type), row-major;
                "mlx_load": {tensor name: {bits, weight, scales, biases}} for q4_0/q4_1/q8_0: what mx.load returns for
                the same tensor bytes (weight u32 words, scales/biases f16 bit patterns), read from a
                temporary GGUF of those three tensors only (mx.load refuses the k-quantizations).
Values are stored as bit patterns so that the Rust tests compare exactly.
"""
import json
import sys
import tempfile
from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np
from gguf import GGMLQuantizationType as T

SEED = 20250206
SIMPLE = {"q4_0": T.Q4_0, "q4_1": T.Q4_1, "q5_0": T.Q5_0, "q5_1": T.Q5_1, "q8_0": T.Q8_0}
# k-quant type -> (bytes per 256-element block, byte offsets of its f16 super-block scales)
K_QUANTS = {"q2_k": (T.Q2_K, 84, (80, 82)), "q3_k": (T.Q3_K, 110, (108,)), "q4_k": (T.Q4_K, 144, (0, 2)),
            "q5_k": (T.Q5_K, 176, (0, 2)), "q6_k": (T.Q6_K, 210, (208,))}
MLX = ("q4_0", "q4_1", "q8_0")


def tensors(rng):
    """name -> (numpy data as GGUFWriter takes it, ggml type, row-major shape)"""
    out = {}
    f32 = rng.standard_normal((3, 7)).astype(np.float32)
    out["f32"] = (f32, T.F32, f32.shape)
    f16 = rng.standard_normal((3, 8)).astype(np.float16)
    f16[0, :4] = np.array([6e-8, -3e-5, -0.0, 65504.0], dtype=np.float16)
    out["f16"] = (f16, T.F16, f16.shape)
    bf16 = gguf.quants.quantize(rng.standard_normal((2, 8)).astype(np.float32), T.BF16)
    out["bf16"] = (bf16, T.BF16, (2, 8))
    for name, qtype in SIMPLE.items():
        w = (rng.standard_normal((4, 64)) * 0.1).astype(np.float32)
        w[0, :32] = 0.0
        w[0, 32:] = 0.25
        out[name] = (gguf.quants.quantize(w, qtype), qtype, w.shape)
    for name, (qtype, block_bytes, scale_at) in K_QUANTS.items():
        rows = 3
        raw = rng.integers(0, 256, size=(rows, block_bytes), dtype=np.uint8)
        for at in scale_at:
            scale = rng.uniform(1e-3, 5e-2, size=rows).astype(np.float16)
            raw[:, at:at + 2] = scale.view(np.uint8).reshape(rows, 2)
        # one block per row: [rows, 256] values
        out[name] = (raw, qtype, (rows, 256))
    return out


def write_gguf(path, items):
    w = gguf.GGUFWriter(str(path), arch="llama")
    for name, (data, qtype, _) in items.items():
        w.add_tensor(f"{name}.weight", data, raw_dtype=None if qtype in (T.F32, T.F16) else qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main():
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "tests/fixtures/gguf")
    out.mkdir(parents=True, exist_ok=True)
    mx.set_default_device(mx.cpu)
    items = tensors(np.random.default_rng(SEED))
    write_gguf(out / "blocks.gguf", items)

    # Read back through gguf-py's reader: the bytes the Rust test will read.
    reader = gguf.GGUFReader(str(out / "blocks.gguf"))
    deq = {}
    for t in reader.tensors:
        shape = [int(x) for x in reversed(t.shape)]
        assert tuple(shape) == tuple(items[t.name.removesuffix(".weight")][2]), (t.name, shape)
        values = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False).reshape(-1)
        assert values.size == int(np.prod(shape))
        deq[t.name] = {"type": t.tensor_type.name, "shape": shape,
                       "values": np.ascontiguousarray(values).view(np.uint32).tolist()}

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "mlx.gguf"
        write_gguf(path, {k: items[k] for k in MLX})
        loaded = mx.load(str(path))
        mlx = {}
        for name in MLX:
            weight = np.array(loaded[f"{name}.weight"])
            scales, biases = np.array(loaded[f"{name}.scales"]), np.array(loaded[f"{name}.biases"])
            assert weight.dtype == np.uint32 and scales.dtype == np.float16, (name, weight.dtype)
            bits = 32 * weight.shape[-1] // items[name][2][-1]
            mlx[f"{name}.weight"] = {"bits": bits, "weight": weight.reshape(-1).tolist(),
                         "scales": scales.view(np.uint16).reshape(-1).tolist(),
                         "biases": biases.view(np.uint16).reshape(-1).tolist()}

    golden = {"source": f"gguf-py 0.19.0, mlx {mx.__version__}",
              "dequantize": deq, "mlx_load": mlx}
    (out / "blocks.json").write_text(json.dumps(golden, separators=(",", ":")) + "\n")
    print(f"make_gguf_fixtures: {len(deq)} tensors -> {out}/blocks.gguf, {out}/blocks.json")


if __name__ == "__main__":
    main()
