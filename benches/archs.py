"""Decode and prefill of the other architectures on the CPU: synthetic Qwen3.5 beside a llama of the
same size, the real Gemma-3-270M, and a synthetic Gemma 4 mixture-of-experts model routed to 1, 2, 4
and 8 of its 32 experts.

usage: $(scripts/oracle/venv.sh) benches/archs.py --oxlm target/release/oxlm [--threads 1,2]
           [--repeats 3] [--write BENCHMARKS.md]
Run through benches/archs.sh, which builds the binary and the models first.

Each row is one `oxlm bench` subprocess (a 512-token prefill, then 128 greedy tokens; medians of
--repeats runs). "Active weights" are the bytes one decode step reads: every tensor except an
untied embedding table (one row of it is read), with each layer's routed experts counted at
top_k / num_experts of their size; KV cache and recurrent state are left out. "Read rate" is decode
tok/s times those bytes, next to the bandwidth benches/bench.py's probe measures with the same
thread count: for the MoE rows it stays level while the active bytes grow eightfold, which is what
"decode cost follows active, not total, parameters" means.
"""
import argparse
import json
import math
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import CACHE, ROOT, child, machine, membw, write_section  # noqa: E402

ARCH_MODELS = CACHE / "bench-models" / "archs"
ROWS = [
    ("synthetic llama 0.85B", ARCH_MODELS / "llama-0.85b"),
    ("synthetic Qwen3.5 0.85B (12 DeltaNet + 4 attention layers)", ARCH_MODELS / "qwen3_5-0.85b"),
    ("Gemma-3-270M (real, base)", CACHE / "models" / "gemma-3-270m-4bit"),
] + [(f"synthetic Gemma 4 MoE, 32 experts, top-{k}", ARCH_MODELS / f"gemma4-moe-top{k}") for k in (1, 2, 4, 8)]


def tensors(model_dir):
    """name -> (shape, bytes) from the safetensors headers."""
    out = {}
    for f in model_dir.glob("*.safetensors"):
        with f.open("rb") as fh:
            header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
        for name, info in header.items():
            if name != "__metadata__":
                out[name] = (info["shape"], info["data_offsets"][1] - info["data_offsets"][0])
    return out


def text_config(model_dir):
    cfg = json.loads((model_dir / "config.json").read_text())
    return cfg, cfg.get("text_config", cfg)


def sizes(model_dir):
    """(total parameters, active parameters, active bytes per decode step)."""
    cfg, text = text_config(model_dir)
    group = cfg.get("quantization", {}).get("group_size", 64)
    t = tensors(model_dir)
    routed = text.get("top_k_experts", 1) / text.get("num_experts", 1)
    untied = any(k.endswith("lm_head.weight") for k in t)
    total = active = active_bytes = 0
    for name, (shape, nbytes) in t.items():
        base = name.rsplit(".", 1)[0]
        share = routed if ".experts." in name else 1.0
        read = not (untied and "embed_tokens." in name)
        if read:
            active_bytes += nbytes * share
        if name.endswith((".scales", ".biases")) and f"{base}.weight" in t and f"{base}.scales" in t:
            continue  # a quantized weight's parameters are counted at its .weight
        if name.endswith(".weight") and f"{base}.scales" in t:
            n = math.prod(t[f"{base}.scales"][0]) * group
        else:
            n = math.prod(shape)
        total += n
        if read:
            active += n * share
    return total, active, active_bytes


def markdown(rows, bw, a):
    lines = [
        f"Machine: {machine()}.",
        f"Command: `benches/archs.sh` (prompt {a.prompt} tokens, {a.gen} decoded, median of {a.repeats} runs; "
        "MLX affine 4-bit g64 except Gemma-3-270M's mlx_lm convert output, 4-bit g64 with its tied 4-bit "
        "embedding). Measured read bandwidth: "
        + ", ".join(f"{b / 1e9:.2f} GB/s with {t} thread{'s' if t > 1 else ''}" for t, b in bw.items()) + ".",
        "",
        "| model | threads | parameters (active) | active weights | decode tok/s | read rate (of bandwidth) | prefill tok/s | peak RSS | load |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        o = r["oxlm"]
        if not o:
            lines.append(f"| {r['label']} | {r['threads']} | — | — | failed | — | — | — | {r['load']:.1f} |")
            continue
        rate = o["decode_tps"] * r["active_bytes"]
        lines.append(
            f"| {r['label']} | {r['threads']} | {r['total'] / 1e6:.0f}M ({r['active'] / 1e6:.0f}M) | "
            f"{r['active_bytes'] / 2**20:.0f} MiB | {o['decode_tps']:.2f} | {rate / 1e9:.2f} GB/s "
            f"({rate / bw[r['threads']]:.0%}) | {o['prefill_tps']:.1f} | {o['peak_rss_bytes'] / 2**20:.0f} MiB | "
            f"{r['load']:.1f} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--oxlm", default=str(ROOT / "target/release/oxlm"))
    ap.add_argument("--threads", default=f"1,{os.cpu_count()}")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--write", help="markdown file whose archs section is replaced")
    a = ap.parse_args()
    thread_counts = sorted({int(t) for t in a.threads.split(",")})
    bw = {t: membw(ROOT, t) for t in thread_counts}
    rows = []
    for threads in thread_counts:
        for label, d in ROWS:
            total, active, active_bytes = sizes(d)
            cmd = [a.oxlm, "bench", "--model", d, "--prompt-tokens", a.prompt, "--gen-tokens", a.gen,
                   "--repeats", a.repeats, "--threads", threads]
            row = {"label": label, "threads": threads, "total": total, "active": active,
                   "active_bytes": active_bytes, "oxlm": child(cmd), "load": os.getloadavg()[0]}
            rows.append(row)
            o = row["oxlm"] or {}
            print(json.dumps({"model": label, "threads": threads, "decode_tps": o.get("decode_tps"),
                              "prefill_tps": o.get("prefill_tps"), "active_mib": round(active_bytes / 2**20)}),
                  flush=True)
            if a.write:  # after every row, so that an interrupted run keeps what it measured
                write_section(Path(a.write), markdown(rows, bw, a), "archs")
    print(markdown(rows, bw, a))


if __name__ == "__main__":
    main()
