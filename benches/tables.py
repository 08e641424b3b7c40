"""Markdown tables from the JSON lines the GPU benchmarks print, in the form BENCHMARKS.md keeps.

usage: python3 benches/tables.py [--build NAME] [MODEL=]FILE...

FILE: what benches/gpu/device.sh's stages wrote into $OUT (bench.jsonl, batch.jsonl, llamacpp.jsonl,
llamacpp-batch.jsonl, mlx.jsonl, torch.jsonl, membw.jsonl), or serve_bench.py --arrivals output;
lines that are not JSON are skipped. Recognised lines:
  `oxlm bench`           prefill_tps, decode_tps (one sequence), depths, batches; the model is the
                         checkpoint directory's name, NAME-BITS as device.sh writes them
  llama-bench            -o jsonl: pp (n_gen 0) and tg (n_prompt 0) lines, avg_ts ± stddev_ts;
                         its tg stands for one sequence where llama-batched-bench did not run,
                         marked "(tgN)" in its cell
  llama-batched-bench    --output-format jsonl: S_TG (speed_tg) per count of sequences (pl); it
                         names no model, so its lines (unless they carry "model") belong to the
                         MODEL of MODEL=FILE (llama-7.2b=out/llamacpp-batch.jsonl), else to the
                         first model whose `oxlm bench` line has batches (device.sh's batch and
                         llamacpp-batch stages both take the first of its models, or ONLY's)
  mlx_lm_bench.py        "engine": "mlx-lm"
  torch_bench.py         "engine": "torch" (the model found from its shape in device.sh's MODELS)
  serve_bench.py         --arrivals: one line a run
  device.sh membw        copy_tbps

Prints, for what the files hold: oxlm against llama.cpp and oxlm against mlx-lm (a row per count
of sequences and per prefill length, a group of columns per model: oxlm, the peer, oxlm ÷ peer),
PyTorch's own figures, and the arrivals runs. Decode is of all sequences together, in tokens/s.
A later line replaces an earlier one for the same cell, so list the files in the order they were
measured. With device.sh's A/B (AB=NAME), its lines carry "build": --build picks which (default:
this tree's, "tree").
"""
import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LABELS = {"llama-0.85b": "0.85B", "llama-7.2b": "7.2B", "qwen2.5-0.5b": "Qwen2.5-0.5B's shape"}


def device_models():
    """device.sh's MODELS: name -> (hidden, layers), in its order."""
    text = (ROOT / "benches/gpu/device.sh").read_text()
    block = text[text.index("MODELS=("):]
    block = block[: block.index(")")]
    out = {}
    for name, hidden, _inter, layers, *_ in (l.split() for l in re.findall(r'"([^"]+)"', block)):
        out[name] = (int(hidden), int(layers))
    return out


def split_name(path):
    """A checkpoint directory or GGUF path -> (model name, bits)."""
    stem = Path(path).name.removesuffix(".gguf")
    m = re.fullmatch(r"(.+)-(?:Q(\d+)_\d|(\d+))", stem)
    if not m:
        return stem, 4
    return m.group(1), int(m.group(2) or m.group(3))


def fmt(x):
    return f"{x:,.0f}" if x >= 1000 else f"{x:.1f}"


def cell(v):
    if v is None:
        return ""
    if isinstance(v, tuple):
        avg, sd, *tg = v
        return f"{fmt(avg)} ± {fmt(sd)}" + (f" (tg{tg[0]})" if tg else "")
    return fmt(v)


def row_order(key):
    """Decode rows first, by sequences then context; then prefill rows, by length."""
    return (key[0] != "decode", key[1:])


def row_label(key):
    if key[0] == "prefill":
        return f"prefill, {key[1]:,} tokens"
    _, n, context = key
    if n == 1 and context != 512:
        return f"1, after {context:,} tokens"
    return str(n)


class Figures:
    def __init__(self):
        # (model, bits) -> engine -> row key -> value: a float, or llama-bench's (mean, sd), with
        # the tokens generated where it timed decoding from an empty context
        self.cells = {}
        self.batched = []  # (llama-batched-bench line, its file's MODEL), placed at the end
        self.first_batched_oxlm = None
        self.arrivals = []
        self.copy_tbps = None

    def put(self, model, engine, key, value):
        self.cells.setdefault(model, {}).setdefault(engine, {})[key] = value

    def add(self, line, shapes, file_model):
        if "copy_tbps" in line:
            self.copy_tbps = line["copy_tbps"]
        elif "arrivals" in line:
            self.arrivals.append(line)
        elif line.get("engine") == "mlx-lm":
            model, n, p = split_name(line["model"]), line["sequences"], line["prompt_tokens"]
            self.put(model, "mlx-lm", ("decode", n, p), line["decode_tps"])
            if n == 1:
                self.put(model, "mlx-lm", ("prefill", p), line["prefill_tps"])
        elif line.get("engine") == "torch":
            name = next((n for n, s in shapes.items() if s == (line["hidden"], line["layers"])),
                        f"hidden {line['hidden']}, {line['layers']} layers")
            p = line["prompt_tokens"]
            self.put((name, "bf16"), "torch", ("prefill", p), line["prefill_tps"])
            self.put((name, "bf16"), "torch", ("decode", 1, p), line["decode_tps"])
        elif "speed_tg" in line:
            self.batched.append((line, file_model))
        elif "avg_ts" in line:
            model = split_name(line.get("model_filename") or line["model"])
            value = (line["avg_ts"], line["stddev_ts"])
            if line["n_gen"] == 0:
                self.put(model, "llama.cpp", ("prefill", line["n_prompt"]), value)
            elif line["n_prompt"] == 0:
                self.put(model, "llama.cpp tg", ("decode", 1, 512), value + (line["n_gen"],))
        elif "prefill_tps" in line and "gen_tokens" in line:
            model, p = split_name(line["model"]), line["prompt_tokens"]
            self.put(model, "oxlm", ("prefill", p), line["prefill_tps"])
            if line["gen_tokens"] >= 32:  # a few tokens after a prefill time no decode
                self.put(model, "oxlm", ("decode", 1, p), line["decode_tps"])
            for d in line.get("depths", []):
                self.put(model, "oxlm", ("decode", 1, d["context"]), d["decode_tps"])
            for b in line.get("batches", []):
                self.put(model, "oxlm", ("decode", b["sequences"], p), b["decode_tps"])
            if line.get("batches") and self.first_batched_oxlm is None:
                self.first_batched_oxlm = model

    def place_batched(self):
        for line, file_model in self.batched:
            if "model" in line:
                model = split_name(line["model"])
            elif file_model:
                model = split_name(file_model)
            else:
                model = self.first_batched_oxlm
            if model is None:
                sys.exit("llama-batched-bench lines, but no model for them: give MODEL=FILE")
            self.put(model, "llama.cpp", ("decode", line["pl"], line["pp"]), line["speed_tg"])
        # llama.cpp's one sequence: llama-batched-bench's if it ran, else llama-bench's tg
        # (marked so in its cell).
        for engines in self.cells.values():
            tg = engines.pop("llama.cpp tg", {})
            mine = engines.setdefault("llama.cpp", {})
            for k, v in tg.items():
                mine.setdefault(k, v)
            if not mine:
                del engines["llama.cpp"]


def ordered(models, shapes):
    names = list(shapes)
    return sorted(models, key=lambda m: (names.index(m[0]) if m[0] in names else len(names), m[0],
                                         str(m[1])))


def model_label(model):
    name, bits = model
    label = LABELS.get(name, name)
    if bits == 4:
        return label
    return f"{label} bf16" if bits == "bf16" else f"{label} {bits}-bit"


def peer_table(fig, peer, shapes):
    models = ordered([m for m, e in fig.cells.items() if "oxlm" in e and peer in e], shapes)
    if not models:
        return None
    keys = sorted({k for m in models for e in ("oxlm", peer) for k in fig.cells[m][e]},
                  key=row_order)
    head = "| sequences |" + "".join(f" {model_label(m)} oxlm | {peer} | ÷ |" for m in models)
    lines = [head, "|---|" + "---|---|---|" * len(models)]
    for k in keys:
        cells = []
        for m in models:
            o, p = fig.cells[m]["oxlm"].get(k), fig.cells[m][peer].get(k)
            pv = p[0] if isinstance(p, tuple) else p
            cells += [cell(o), cell(p), f"{o / pv:.2f}×" if o and pv else ""]
        lines.append(f"| {row_label(k)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def oxlm_table(fig, shapes, peers):
    """oxlm's figures for the models no peer was measured on."""
    models = ordered([m for m, e in fig.cells.items()
                      if "oxlm" in e and not any(p in e for p in peers)], shapes)
    if not models:
        return None
    keys = sorted({k for m in models for k in fig.cells[m]["oxlm"]}, key=row_order)
    lines = ["| sequences |" + "".join(f" {model_label(m)} |" for m in models),
             "|---|" + "---|" * len(models)]
    for k in keys:
        cells = [cell(fig.cells[m]["oxlm"].get(k)) for m in models]
        lines.append(f"| {row_label(k)} | " + " | ".join(cells) + " |")
    return "oxlm alone, tok/s:\n\n" + "\n".join(lines)


def torch_table(fig, shapes):
    models = ordered([m for m, e in fig.cells.items() if "torch" in e], shapes)
    if not models:
        return None
    lines = ["| PyTorch + transformers, bf16 | prefill 512 | prefill 2,048 | decode after 512 "
             "| decode after 2,048 |", "|---|---|---|---|---|"]
    for m in models:
        t = fig.cells[m]["torch"]
        keys = [("prefill", 512), ("prefill", 2048), ("decode", 1, 512), ("decode", 1, 2048)]
        lines.append(f"| {model_label(m)} | " + " | ".join(cell(t.get(k)) for k in keys) + " |")
    return "\n".join(lines)


def arrivals_table(fig):
    if not fig.arrivals:
        return None
    lines = ["| requests | a second | tokens | tok/s | mean s a request | p90 s |",
             "|---|---|---|---|---|---|"]
    for a in fig.arrivals:
        lines.append(f"| {a['arrivals']} | {a['rate']:g} | {a['tokens']:,} | {fmt(a['tok_s'])} | "
                     f"{a['mean_request_s']:.3f} | {a['p90_request_s']:.3f} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("files", nargs="+", metavar="[MODEL=]FILE")
    ap.add_argument("--build", default="tree", help="with device.sh's AB: the build whose lines to take")
    a = ap.parse_args()
    shapes = device_models()
    fig = Figures()
    for f in a.files:
        file_model = None
        if "=" in f and not Path(f).exists():
            file_model, f = f.split("=", 1)
        for raw in Path(f).read_text().splitlines():
            raw = raw.strip()
            if not raw.startswith("{"):
                continue
            try:
                line = json.loads(raw)
            except json.JSONDecodeError:
                continue
            if line.get("build", "tree") == a.build:
                fig.add(line, shapes, file_model)
    fig.place_batched()
    out = []
    if fig.copy_tbps:
        out.append(f"Device-to-device copy: {fig.copy_tbps:.3f} TB/s.")
    peers = [("llama.cpp", "oxlm against llama.cpp"), ("mlx-lm", "oxlm against mlx-lm")]
    for peer, what in peers:
        t = peer_table(fig, peer, shapes)
        if t:
            out.append(f"{what}, tok/s:\n\n{t}")
    alone = oxlm_table(fig, shapes, [p for p, _ in peers])
    for t in (alone, torch_table(fig, shapes), arrivals_table(fig)):
        if t:
            out.append(t)
    if not out:
        sys.exit("no figures found")
    print("\n\n".join(out))


if __name__ == "__main__":
    main()
