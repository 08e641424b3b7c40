"""Decode and prefill of the other architectures beside a llama of the same size, on the CPU (and,
with --annotate and --gpu, the table of device.sh's `archs` stage): synthetic Qwen3.5, Phi-3, OLMo 3,
LFM2, Qwen3-MoE, DeepSeek-V3, GLM-4.5 MoE and Qwen3-Next models at the 0.85B llama's budget
(benches/make_archs.py), the real Gemma-3-270M, and a synthetic Gemma 4 mixture-of-experts model
routed to 1, 2, 4 and 8 of its 32 experts.

usage: $(scripts/oracle/venv.sh) benches/archs.py --oxlm target/release/oxlm [--threads 1,2]
           [--repeats 3] [--gen 128] [--models NAME,...] [--write BENCHMARKS.md]
       python3 benches/archs.py --annotate MODEL_DIR   (stdin: `oxlm bench` output; stdout: its JSON
           lines with the model's name and sizes, or a "failed" line if none came)
       python3 benches/archs.py --gpu FILE...   (device.sh's archs.jsonl, and membw.jsonl for the
           copy bandwidth: prints the GPU table)
Run through benches/archs.sh, which builds the binary and the models first. --models keeps the rows
whose model directory is named in the list (make_archs.py's names: llama-0.85b, deepseek_v3-0.85b,
gemma-3-270m-4bit, gemma4-moe-top2, ...).

Each row is one `oxlm bench` subprocess (a 512-token prefill, then 128 greedy tokens; medians of
--repeats runs). "Active weights" are the bytes one decode step reads: every tensor except an
untied embedding table (one row of it is read), with each layer's routed experts counted at
top_k / experts of their size (shared experts, routers and dense layers in full); KV cache and
recurrent state are left out. "Read rate" is decode tok/s times those bytes, next to the
bandwidth benches/bench.py's probe measures with the same thread count (on the GPU, the
device-to-device copy bandwidth of device.sh's membw): for the Gemma 4 MoE rows it stays level
while the active bytes grow eightfold, which is what "decode cost follows active, not total,
parameters" means.
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
    ("synthetic Phi-3 0.85B (fused qkv and gate_up)", ARCH_MODELS / "phi3-0.85b"),
    ("synthetic OLMo 3 0.85B (12 layers windowed to 256 + 4 global)", ARCH_MODELS / "olmo3-0.85b"),
    ("synthetic LFM2 0.85B (10 short-conv + 6 attention layers)", ARCH_MODELS / "lfm2-0.85b"),
    ("synthetic Qwen3-MoE, 32 experts, top-4", ARCH_MODELS / "qwen3_moe-0.85b"),
    ("synthetic DeepSeek-V3 (MLA), 32 experts + 1 shared, top-4", ARCH_MODELS / "deepseek_v3-0.85b"),
    ("synthetic GLM-4.5 MoE, 32 experts + 1 shared, top-4", ARCH_MODELS / "glm4_moe-0.85b"),
    ("synthetic Qwen3-Next, 32 experts + 1 shared, top-4", ARCH_MODELS / "qwen3_next-0.85b"),
    ("Gemma-3-270M (real, base)", CACHE / "models" / "gemma-3-270m-4bit"),
] + [(f"synthetic Gemma 4 MoE, 32 experts, top-{k}", ARCH_MODELS / f"gemma4-moe-top{k}") for k in (1, 2, 4, 8)]
LABELS = {d.name: label for label, d in ROWS}


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


def routed_share(text):
    """The share of a layer's routed experts that one token runs: top_k / experts, under each
    family's keys (Qwen3-MoE, Qwen3-Next, OLMoE: num_experts; Mixtral: num_local_experts;
    DeepSeek-V3, GLM-4.5: n_routed_experts; Gemma 4: top_k_experts)."""
    experts = text.get("num_experts") or text.get("num_local_experts") or text.get("n_routed_experts")
    top_k = text.get("num_experts_per_tok") or text.get("top_k_experts")
    return top_k / experts if experts and top_k else 1.0


def is_routed(name):
    """A routed expert's tensor: mlx-lm's stacked `switch_mlp` (`experts.switch_glu` in Gemma 4), or
    one expert's of a Hugging Face layout (`experts.{e}.`); shared experts (`shared_expert.`,
    `shared_experts.`) and routers (`gate.`) are not."""
    return ".switch_mlp." in name or ".experts." in name


def sizes(model_dir):
    """(total parameters, active parameters, active bytes per decode step)."""
    cfg, text = text_config(model_dir)
    group = cfg.get("quantization", {}).get("group_size", 64)
    t = tensors(model_dir)
    routed = routed_share(text)
    untied = any(k.endswith("lm_head.weight") for k in t)
    total = active = active_bytes = 0
    for name, (shape, nbytes) in t.items():
        base = name.rsplit(".", 1)[0]
        share = routed if is_routed(name) else 1.0
        read = not (untied and "embed_tokens." in name)
        if read:
            active_bytes += nbytes * share
        if name.endswith((".scales", ".biases")) and f"{base}.weight" in t and f"{base}.scales" in t:
            continue  # a quantized weight's parameters are counted at its .weight
        if name.endswith(".weight") and f"{base}.scales" in t:
            q = cfg.get("quantization", {}).get(base)
            n = math.prod(t[f"{base}.scales"][0]) * (q["group_size"] if isinstance(q, dict) else group)
        else:
            n = math.prod(shape)
        total += n
        if read:
            active += n * share
    return total, active, active_bytes


def params(r):
    return f"{r['total'] / 1e6:.0f}M ({r['active'] / 1e6:.0f}M)"


def markdown(rows, bw, a):
    bandwidth = ", ".join(f"{b / 1e9:.2f} GB/s with {t} thread{'s' if t > 1 else ''}"
                          for t, b in bw.items() if b)
    lines = [
        f"Machine: {machine()}.",
        f"Command: `benches/archs.sh` (prompt {a.prompt} tokens, {a.gen} decoded, median of {a.repeats} runs; "
        "MLX affine 4-bit g64 except Gemma-3-270M's mlx_lm convert output, 4-bit g64 with its tied 4-bit "
        "embedding). Measured read bandwidth: " + (bandwidth or "not measured") + ".",
        "",
        "| model | threads | parameters (active) | active weights | decode tok/s | read rate (of bandwidth) | prefill tok/s | peak RSS | load |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        o = r["oxlm"]
        if not o:
            lines.append(f"| {r['label']} | {r['threads']} | {params(r)} | {r['active_bytes'] / 2**20:.0f} MiB | "
                         f"failed | — | — | — | {r['load']:.1f} |")
            continue
        rate = o["decode_tps"] * r["active_bytes"]
        of = f" ({rate / bw[r['threads']]:.0%})" if bw.get(r["threads"]) else ""
        lines.append(
            f"| {r['label']} | {r['threads']} | {params(r)} | "
            f"{r['active_bytes'] / 2**20:.0f} MiB | {o['decode_tps']:.2f} | {rate / 1e9:.2f} GB/s{of} | "
            f"{o['prefill_tps']:.1f} | {o['peak_rss_bytes'] / 2**20:.0f} MiB | {r['load']:.1f} |")
    return "\n".join(lines)


def annotate(model_dir):
    """`oxlm bench` output on stdin -> its JSON lines with the model's name and sizes (device.sh's
    `archs`), other lines as they are; a "failed" line if no JSON came."""
    model_dir = Path(model_dir)
    total, active, active_bytes = sizes(model_dir)
    extra = {"arch_model": model_dir.name, "total": total, "active": active, "active_bytes": active_bytes}
    seen = False
    for line in sys.stdin:
        line = line.rstrip("\n")
        try:
            report = json.loads(line) if line.startswith("{") else None
        except json.JSONDecodeError:
            report = None
        if report is None:
            print(line, flush=True)
            continue
        seen = True
        print(json.dumps(dict(report, **extra)), flush=True)
    if not seen:
        print(json.dumps(dict(extra, model=str(model_dir), failed=True)), flush=True)


def gpu_table(files, build="tree"):
    """The archs stage's JSON lines (the last for each model and prompt length wins) -> markdown."""
    rows, others, copy = {}, {}, None
    for f in files:
        for raw in Path(f).read_text().splitlines():
            if not raw.startswith("{"):
                continue
            line = json.loads(raw)
            if "copy_tbps" in line:
                copy = line["copy_tbps"] * 1e12
            elif "arch_model" in line:
                mine = line.get("build", "tree") == build
                (rows if mine else others)[(line["arch_model"], line.get("prompt_tokens"))] = line
    for key, line in others.items():  # in an A/B, a model the other build ran and this one did not
        rows.setdefault(key, dict(line, failed=True))
    order = [d.name for _, d in ROWS]
    lines = [("Device-to-device copy: " + (f"{copy / 1e12:.3f} TB/s" if copy else "not measured")
              + ". Read rate: decode tok/s times the active weights (the roofline's share in brackets)."),
             "",
             "| model | parameters (active) | active weights | decode tok/s | read rate | prefill tok/s | load s |",
             "|---|---|---|---|---|---|---|"]
    for (name, prompt), r in sorted(rows.items(), key=lambda kv: (
            order.index(kv[0][0]) if kv[0][0] in order else len(order), kv[0])):
        label = LABELS.get(name, name) + (f", {prompt}-token prompt" if prompt not in (None, 512) else "")
        mib = f"{r['active_bytes'] / 2**20:.0f} MiB"
        if r.get("failed"):
            lines.append(f"| {label} | {params(r)} | {mib} | failed | — | — | — |")
            continue
        rate = r["decode_tps"] * r["active_bytes"]
        of = f" ({rate / copy:.0%})" if copy else ""
        lines.append(f"| {label} | {params(r)} | {mib} | {r['decode_tps']:,.1f} | {rate / 1e9:,.0f} GB/s{of} | "
                     f"{r['prefill_tps']:,.0f} | {r['load_s']:.1f} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--oxlm", default=str(ROOT / "target/release/oxlm"))
    ap.add_argument("--threads", default=f"1,{os.cpu_count()}")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--gen", "--gen-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--models", help="comma-separated model directory names: only their rows")
    ap.add_argument("--write", help="markdown file whose archs section is replaced")
    ap.add_argument("--annotate", metavar="MODEL_DIR", help=argparse.SUPPRESS)
    ap.add_argument("--gpu", nargs="+", metavar="FILE", help=argparse.SUPPRESS)
    ap.add_argument("--build", default="tree", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.annotate:
        return annotate(a.annotate)
    if a.gpu:
        return print(gpu_table(a.gpu, a.build))
    rows_wanted = ROWS
    if a.models:
        names = a.models.split(",")
        rows_wanted = [(label, d) for label, d in ROWS if d.name in names]
        missing = set(names) - {d.name for _, d in rows_wanted}
        if missing:
            sys.exit(f"no rows for {', '.join(sorted(missing))} (names: {', '.join(d.name for _, d in ROWS)})")
    thread_counts = sorted({int(t) for t in a.threads.split(",")})
    probe = ROOT / "target/release/examples/membw"
    if not probe.exists():
        print(f"no {probe} (cargo build --release -p oxlm-engine --example membw): bandwidth not measured",
              file=sys.stderr)
    bw = {t: membw(ROOT, t) if probe.exists() else None for t in thread_counts}
    rows = []
    for threads in thread_counts:
        for label, d in rows_wanted:
            total, active, active_bytes = sizes(d)
            cmd = [a.oxlm, "bench", "--model", d, "--prompt-tokens", a.prompt, "--gen-tokens", a.gen,
                   "--repeats", a.repeats, "--threads", threads]
            row = {"label": label, "threads": threads, "total": total, "active": active,
                   "active_bytes": active_bytes, "oxlm": child(cmd), "load": os.getloadavg()[0]}
            rows.append(row)
            o = row["oxlm"] or {}
            print(json.dumps({"model": label, "threads": threads, "decode_tps": o.get("decode_tps"),
                              "prefill_tps": o.get("prefill_tps"), "total_m": round(total / 1e6),
                              "active_m": round(active / 1e6), "active_mib": round(active_bytes / 2**20)}),
                  flush=True)
            if a.write:  # after every row, so that an interrupted run keeps what it measured
                write_section(Path(a.write), markdown(rows, bw, a), "archs")
    print(markdown(rows, bw, a))


if __name__ == "__main__":
    main()
