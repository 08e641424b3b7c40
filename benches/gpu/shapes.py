"""The benchmark models' shape arguments, shared by the GPU scripts (run from the repo root).

`--arch qwen2` gives Qwen2's differences from a llama: biases on the query, key and value
projections, the output head tied to the embedding, RoPE base 1e6 and norm epsilon 1e-6."""


def add_shape_args(ap):
    ap.add_argument("--arch", choices=["llama", "qwen2"], default="llama")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=5632)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
