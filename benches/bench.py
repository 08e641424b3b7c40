"""The CPU benchmark: oxlm against llama.cpp and mistral.rs on the same source weights.

usage: $BENCH_PY benches/bench.py --oxlm target/release/oxlm [--models ...] [--repeats 3]
           [--threads 1,N] [--write BENCHMARKS.md]
Run through benches/run.sh, which builds everything first.

Each engine runs in a subprocess of its own (peak RSS from wait4), loads the model once, runs a
short warm-up, then `--repeats` times a 512-token prefill followed by 128 greedy tokens with no
end-of-sequence stop; the medians are reported. oxlm's decode is also given as a fraction of the
memory-read bandwidth measured by crates/engine/examples/membw.rs in the same run, counting the
bytes one decode step must read (every weight except the embedding table, plus the KV cache).
"""
import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("OXLM_CACHE", Path.home() / ".cache/oxlm"))
MODELS = {
    "llama-0.85b": "synthetic llama 0.85B",
    "qwen2.5-coder-0.5b": "Qwen2.5-Coder-0.5B",
    "smollm2-135m": "SmolLM2-135M",
}


def prompt_ids(n, vocab, seed):
    """The same pseudo-random ids for every engine (random weights make any ids equally good)."""
    s, out = seed * 2654435761 + 1, []
    for _ in range(n):
        s = (s * 6364136223846793005 + 1442695040888963407) % (1 << 64)
        out.append((s >> 33) % vocab)
    return out


# ---- peers, each run as `bench.py --peer ...` in a subprocess -------------------------------


def peer_llamacpp(a):
    import numpy as np
    from llama_cpp import Llama

    # n_batch = n_ctx: llama-cpp-python keeps n_batch rows of logits, indexed by position.
    n_ctx = a.prompt + a.gen + 16
    llm = Llama(a.model, n_threads=a.threads, n_threads_batch=a.threads, n_ctx=n_ctx, n_batch=n_ctx,
                verbose=False)
    vocab = llm.n_vocab()

    def once(n_prompt, n_gen, seed):
        llm.reset()
        ids = prompt_ids(n_prompt, vocab, seed)
        t0 = time.perf_counter()
        llm.eval(ids)
        t1 = time.perf_counter()
        for _ in range(n_gen):
            llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))])
        t2 = time.perf_counter()
        return n_prompt / (t1 - t0), n_gen / (t2 - t1)

    once(16, 4, 0)
    return [once(a.prompt, a.gen, r + 1) for r in range(a.repeats)]


def peer_mistralrs(a):
    from mistralrs import CompletionRequest, Runner, Which
    from tokenizers import Tokenizer

    tk = Tokenizer.from_file(str(Path(a.model) / "tokenizer.json"))
    vocab = tk.get_vocab_size()
    eos = json.loads((Path(a.model) / "config.json").read_text()).get("eos_token_id", 2)
    eos = eos if isinstance(eos, list) else [eos]
    runner = Runner(which=Which.Plain(model_id=a.model), in_situ_quant=a.isq, max_seqs=1,
                    no_paged_attn=True, prefix_cache_n=0)

    def text(n, seed):
        # Decoded ids rarely re-encode to the same count: trim until the prompt has n tokens.
        ids = prompt_ids(n + n // 4, vocab, seed)
        t = tk.decode(ids, skip_special_tokens=True)
        while len(tk.encode(t, add_special_tokens=False).ids) > n:
            t = t[: max(1, len(t) * 95 // 100)]
        return t

    def once(n_prompt, n_gen, seed):
        req = CompletionRequest(prompt=text(n_prompt, seed), model="m", max_tokens=n_gen, temperature=0.0,
                                logit_bias={int(e): -100.0 for e in eos})
        u = runner.send_completion_request(req).usage
        return u.avg_prompt_tok_per_sec, u.avg_compl_tok_per_sec, u.prompt_tokens, u.completion_tokens

    once(16, 4, 0)
    return [once(a.prompt, a.gen, r + 1) for r in range(a.repeats)]


# llama.cpp's KV cache types by the name --kv-cache gives them (ggml_type ids).
GGML_KV_TYPES = {"f16": 1, "q4_0": 2, "q8_0": 8}


def peer_llamacpp_depths(a):
    """Decode tok/s of `a.gen` tokens ending at each of `a.depths` tokens of context, the cache
    in `a.kv_cache` (quantized values need flash attention, as llama-bench's -ctk/-ctv do)."""
    from llama_cpp import Llama

    depths = [int(d) for d in a.depths.split(",")]
    kv = GGML_KV_TYPES[a.kv_cache]
    out = []
    for depth in depths:
        n_ctx = depth + 16
        # n_batch = n_ctx: llama-cpp-python keeps n_batch rows of logits, indexed by position.
        llm = Llama(a.model, n_threads=a.threads, n_threads_batch=a.threads, n_ctx=n_ctx, n_batch=n_ctx,
                    n_ubatch=512, type_k=kv, type_v=kv, flash_attn=True, verbose=False)
        ids = prompt_ids(depth, llm.n_vocab(), 99)
        llm.eval(ids[: depth - a.gen])
        t = time.perf_counter()
        for i in ids[depth - a.gen:]:
            llm.eval([i])
        out.append({"context": depth, "decode_tps": a.gen / (time.perf_counter() - t)})
        del llm
    return out


def peer_main(a):
    if a.depths:
        print(json.dumps({"depths": peer_llamacpp_depths(a), "prefill_tps_runs": [0], "decode_tps_runs": [0]}))
        return
    runs = peer_llamacpp(a) if a.peer == "llamacpp" else peer_mistralrs(a)
    print(json.dumps({"prefill_tps_runs": [r[0] for r in runs], "decode_tps_runs": [r[1] for r in runs],
                      "extra": [r[2:] for r in runs]}))


# ---- the driver ------------------------------------------------------------------------------


def child(cmd, env=None):
    t = time.time()
    out_r, out_w = os.pipe()
    err_path = CACHE / "bench-last-stderr.txt"
    with open(err_path, "w") as err:
        pid = os.fork()
        if pid == 0:
            os.dup2(out_w, 1)
            os.dup2(err.fileno(), 2)
            os.close(out_r)
            os.execvpe(cmd[0], [str(c) for c in cmd], env or os.environ)
        os.close(out_w)
        with os.fdopen(out_r) as f:
            out = f.read()
        _, status, ru = os.wait4(pid, 0)
    secs = time.time() - t
    if os.waitstatus_to_exitcode(status) != 0:
        print(f"  FAILED: {' '.join(map(str, cmd))}\n{err_path.read_text()[-2000:]}", file=sys.stderr)
        return None
    rep = json.loads([l for l in out.splitlines() if l.startswith("{")][-1])
    rep["peak_rss_bytes"] = ru.ru_maxrss * 1024
    rep["wall_s"] = secs
    rep["prefill_tps"] = statistics.median(rep["prefill_tps_runs"])
    rep["decode_tps"] = statistics.median(rep["decode_tps_runs"])
    return rep


def membw(oxlm_root, threads):
    exe = oxlm_root / "target/release/examples/membw"
    out = subprocess.run([exe, "1024", str(threads)], capture_output=True, text=True, check=True).stdout
    return float(out.split("read_gbps=")[1].split()[0]) * 1e9


def decode_bytes(mlx_dir, context):
    """Bytes one decode step reads: every tensor except an untied embedding table (of which one
    row is read), plus an f32 KV cache of `context` positions."""
    cfg = json.loads((mlx_dir / "config.json").read_text())
    sizes = {}
    for f in mlx_dir.glob("*.safetensors"):
        with f.open("rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(n))
        for name, info in header.items():
            if name != "__metadata__":
                sizes[name] = info["data_offsets"][1] - info["data_offsets"][0]
    untied = any(k.startswith("lm_head.") for k in sizes)
    total = sum(v for k, v in sizes.items() if not (untied and k.startswith("model.embed_tokens.")))
    heads = cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads", heads)
    hd = cfg.get("head_dim", cfg["hidden_size"] // heads)
    return total + 2 * cfg["num_hidden_layers"] * kv * hd * 4 * context


def fmt_rss(b):
    return f"{b / 2**20:.0f} MiB" if b else "—"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--peer", choices=["llamacpp", "mistralrs"])
    ap.add_argument("--model")
    ap.add_argument("--isq")
    ap.add_argument("--threads", default=None)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--repeats-multi", type=int, default=1, help="repeats with more than one thread")
    ap.add_argument("--oxlm", default=str(ROOT / "target/release/oxlm"))
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--engines", default="oxlm,llamacpp,mistralrs")
    ap.add_argument("--depth", type=int, default=4096, help="context for the long-context decode (0 skips)")
    ap.add_argument("--write", help="markdown file whose benchmark section is replaced")
    ap.add_argument("--json-out", default=str(CACHE / "bench-results.json"))
    ap.add_argument("--merge", action="store_true", help="update the rows of an earlier --json-out")
    ap.add_argument("--bits", default="4,8")
    ap.add_argument("--long-context", metavar="DEPTHS",
                    help="instead: decode speed at these contexts (e.g. 1024,4096,16384) of the 4-bit "
                         "synthetic llama, each KV cache type of oxlm and llama.cpp")
    ap.add_argument("--long-caches", default="f16,q8,q4",
                    help="with --long-context: oxlm's caches to run (each beside llama.cpp's of its bits)")
    ap.add_argument("--depths", help=argparse.SUPPRESS)
    ap.add_argument("--kv-cache", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.peer:
        a.threads = int(a.threads)
        return peer_main(a)
    if a.long_context:
        return long_context(a)

    ncpu = os.cpu_count()
    thread_counts = [int(t) for t in (a.threads or f"1,{ncpu}").split(",")]
    thread_counts = sorted(set(thread_counts))
    engines = a.engines.split(",")
    # The roofline of each row is the read bandwidth measured with the row's thread count.
    bw = {t: membw(ROOT, t) for t in thread_counts}
    print("memory read bandwidth: " + ", ".join(f"{t} thread(s) {b / 1e9:.2f} GB/s" for t, b in bw.items()),
          flush=True)
    results = []
    if a.merge and Path(a.json_out).exists():
        results = json.loads(Path(a.json_out).read_text())["results"]
    me = [sys.executable, __file__]
    # One thread first for every model (the table that matters on small machines), then more.
    for threads in thread_counts:
        repeats = a.repeats if threads == 1 else a.repeats_multi
        for name in a.models.split(","):
            d = CACHE / "bench-models" / name
            for bits, gg in [(b, {4: "q4_0", 8: "q8_0"}[b]) for b in map(int, a.bits.split(","))]:
                row = {"model": name, "threads": threads, "bits": bits, "repeats": repeats}
                common = ["--prompt", a.prompt, "--gen", a.gen, "--repeats", repeats, "--threads", threads]
                if "oxlm" in engines:
                    cmd = [a.oxlm, "bench", "--model", d / f"mlx-{bits}bit", "--prompt-tokens", a.prompt,
                           "--gen-tokens", a.gen, "--repeats", repeats, "--threads", threads]
                    if a.depth and name == "llama-0.85b" and bits == 4 and threads == 1:
                        cmd += ["--depth", 128, "--depth", a.depth]
                    row["oxlm"] = child(cmd)
                    row["decode_bytes"] = decode_bytes(d / f"mlx-{bits}bit", a.prompt + a.gen // 2)
                if "llamacpp" in engines:
                    row["llamacpp"] = child(me + ["--peer", "llamacpp", "--model", d / f"gguf-{gg}.gguf"] + common)
                if "mistralrs" in engines:
                    env = dict(os.environ, RAYON_NUM_THREADS=str(threads))
                    row["mistralrs"] = child(me + ["--peer", "mistralrs", "--model", d / "hf",
                                                   "--isq", gg.upper()] + common, env)
                row["load"] = os.getloadavg()[0]
                key = (name, threads, bits)
                old = next((r for r in results if (r["model"], r["threads"], r["bits"]) == key), None)
                if old:
                    # --merge: the engines run now replace their figures in the earlier row.
                    old.update({k: v for k, v in row.items() if v is not None})
                    row = old
                else:
                    results.append(row)
                print(json.dumps(summary(row, bw)), flush=True)
                # Written after every row, so that an interrupted run keeps what it measured.
                Path(a.json_out).write_text(json.dumps({"bandwidth": {str(t): b for t, b in bw.items()},
                                                        "results": results}, indent=1))
                if a.write:
                    write_section(Path(a.write), markdown(results, bw, a, thread_counts))
    print(markdown(results, bw, a, thread_counts))


# The KV caches compared at long contexts: oxlm's (--kv-cache) beside llama.cpp's of the same
# bits (-ctk/-ctv): f16; 8-bit (mlx-lm's groups of 64, llama.cpp's q8_0 blocks of 32); 4-bit.
LONG_CACHES = [("f16", "f16"), ("q8", "q8_0"), ("q4", "q4_0")]


def long_context(a):
    """Decode tok/s at each context of `a.long_context` (the last `--gen` tokens before it timed;
    each context prefilled afresh), the synthetic llama 0.85B at 4 bits, one thread count; the
    share of the first context's speed each keeps. Written as the `long` section."""
    depths = [int(d) for d in a.long_context.split(",")]
    threads = int(a.threads or 1)
    d = CACHE / "bench-models" / "llama-0.85b"
    # The synthetic llama says 4,096 positions; its random weights learned no limit: a copy whose
    # config says the longest context (llama.cpp only warns past the GGUF's).
    mlx = CACHE / "bench-models" / "llama-0.85b-long"
    mlx.mkdir(exist_ok=True)
    for f in (d / "mlx-4bit").iterdir():
        if f.name != "config.json" and not (mlx / f.name).exists():
            (mlx / f.name).symlink_to(f)
    config = json.loads((d / "mlx-4bit" / "config.json").read_text())
    config["max_position_embeddings"] = max(depths)
    (mlx / "config.json").write_text(json.dumps(config))
    rows = []
    for ours, theirs in [c for name in a.long_caches.split(",") for c in LONG_CACHES if c[0] == name]:
        cmd = [a.oxlm, "bench", "--model", mlx, "--prompt-tokens", 16, "--gen-tokens", 4,
               "--repeats", 1, "--threads", threads, "--depth-tokens", a.gen, "--kv-cache", ours]
        for depth in depths:
            cmd += ["--depth", depth]
        o = child(cmd)
        peer = child([sys.executable, __file__, "--peer", "llamacpp", "--model", d / "gguf-q4_0.gguf",
                      "--threads", threads, "--gen", a.gen, "--depths", a.long_context,
                      "--kv-cache", theirs])
        row = {"oxlm": (o or {}).get("depths", []), "llamacpp": (peer or {}).get("depths", []),
               "caches": (ours, theirs), "load": os.getloadavg()[0]}
        print(json.dumps(row), flush=True)
        rows.append(row)
    table = long_markdown(rows, depths, threads, a)
    if a.write:
        write_section(Path(a.write), table, "long")
    print(table)


def long_markdown(rows, depths, threads, a):
    speed = lambda runs, depth: next((r["decode_tps"] for r in runs if r["context"] == depth), None)
    f = lambda v: f"{v:.2f}" if v else "—"
    head = " | ".join(f"{d:,}" for d in depths)
    lines = [
        f"Machine: {machine()}. Command: `benches/run.sh --long-context {a.long_context} --threads {threads} "
        f"--gen {a.gen}`: the synthetic llama 0.85B, 4-bit (oxlm MLX g64, llama.cpp Q4_0), {threads} "
        f"thread{'s' if threads > 1 else ''}; decode tok/s of the {a.gen} tokens that end at each context "
        "(prefilled afresh); in brackets the share of the first context's speed kept; ×: oxlm ÷ llama.cpp "
        "with the cache of the same bits (llama.cpp's with flash attention, which its quantized values need).",
        "",
        f"| cache (oxlm / llama.cpp) | engine | {head} | load |",
        "|---|---|" + "---|" * len(depths) + "---|",
    ]
    for r in rows:
        for engine, runs, name in [("oxlm", r["oxlm"], r["caches"][0]), ("llama.cpp", r["llamacpp"], r["caches"][1])]:
            first = speed(runs, depths[0])
            cells = []
            for depth in depths:
                v = speed(runs, depth)
                kept = f" ({v / first:.0%})" if v and first and depth != depths[0] else ""
                ratio_cell = ""
                if engine == "oxlm":
                    ratio_cell = f", {ratio(v, speed(r['llamacpp'], depth))}"
                cells.append(f"{f(v)}{kept}{ratio_cell}")
            lines.append(f"| {name} | {engine} | " + " | ".join(cells) + f" | {r['load']:.1f} |")
    return "\n".join(lines)


def summary(row, bw):
    out = {k: row[k] for k in ("model", "threads", "bits", "load")}
    for e in ("oxlm", "llamacpp", "mistralrs"):
        if row.get(e):
            out[e] = (round(row[e]["decode_tps"], 2), round(row[e]["prefill_tps"], 1))
    if row.get("oxlm"):
        out["roofline"] = round(row["oxlm"]["decode_tps"] * row["decode_bytes"] / bw[row["threads"]], 3)
    return out


def ratio(a, b):
    return f"{a / b:.2f}×" if a and b else "—"


def machine():
    """The CPU, its count and the vector extensions the kernels choose between, and the kernel."""
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    flags = next((l for l in open("/proc/cpuinfo") if l.startswith("flags")), "")
    isa = ", ".join(f for f in ("avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512_vnni", "amx_int8")
                    if f" {f} " in flags + " ")
    return f"{cpu}, {os.cpu_count()} CPUs ({isa}), Linux {platform.release()}"


def markdown(results, bw, a, thread_counts):
    lines = [
        f"Machine: {machine()}. "
        "Measured memory read bandwidth (1 GiB, `membw`): "
        + ", ".join(f"**{b / 1e9:.2f} GB/s** with {t} thread{'s' if t > 1 else ''}" for t, b in bw.items()) + ".",
        f"Command: `benches/run.sh` (prompt {a.prompt} tokens, {a.gen} decoded, median of {a.repeats} runs with "
        f"1 thread, {a.repeats_multi} with more; "
        f"threads {', '.join(map(str, thread_counts))}). Load average at each row in the last column: other "
        "work shared these CPUs, so figures are noisy.",
        "",
        "Decode and prefill in tokens/s; oxlm runs MLX affine g64 (4-bit or 8-bit), llama.cpp the GGUF "
        "Q4_0 / Q8_0 its quantizer makes from the same fp16 weights, mistral.rs the same fp16 weights with "
        "in-situ Q4_0 / Q8_0. ×: oxlm ÷ peer. Roofline: oxlm decode × bytes read per step ÷ the "
        "bandwidth measured with the same thread count.",
        "",
        "| model | bits | threads | oxlm decode | oxlm prefill | roofline | llama.cpp decode | ×  | llama.cpp prefill | × | "
        "mistral.rs decode | × | mistral.rs prefill | × | peak RSS oxlm / llama.cpp / mistral.rs | load |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        o, l, m = r.get("oxlm") or {}, r.get("llamacpp") or {}, r.get("mistralrs") or {}
        g = lambda d, k: d.get(k)
        f = lambda v, p=1: f"{v:.{p}f}" if v else "—"
        roof = f"{o['decode_tps'] * r['decode_bytes'] / bw[r['threads']]:.0%}" if o and r["threads"] in bw else "—"
        lines.append(
            f"| {MODELS[r['model']]} | {r['bits']} | {r['threads']} | {f(g(o, 'decode_tps'), 2)} | {f(g(o, 'prefill_tps'))} | "
            f"{roof} | {f(g(l, 'decode_tps'), 2)} | {ratio(g(o, 'decode_tps'), g(l, 'decode_tps'))} | "
            f"{f(g(l, 'prefill_tps'))} | {ratio(g(o, 'prefill_tps'), g(l, 'prefill_tps'))} | "
            f"{f(g(m, 'decode_tps'), 2)} | {ratio(g(o, 'decode_tps'), g(m, 'decode_tps'))} | "
            f"{f(g(m, 'prefill_tps'))} | {ratio(g(o, 'prefill_tps'), g(m, 'prefill_tps'))} | "
            f"{fmt_rss(g(o, 'peak_rss_bytes'))} / {fmt_rss(g(l, 'peak_rss_bytes'))} / {fmt_rss(g(m, 'peak_rss_bytes'))} | "
            f"{r['load']:.1f} |")
    for r in results:
        o = r.get("oxlm") or {}
        for d in o.get("depths", []):
            lines.append("")
            lines.append(f"Long context ({MODELS[r['model']]}, {r['bits']}-bit, {r['threads']} thread, "
                         f"{o.get('kv_cache', 'F32').lower()} KV cache): decode "
                         f"{d['decode_tps']:.2f} tok/s after {d['context']} tokens of context.")
    return "\n".join(lines)


def write_section(path, table, name="bench"):
    """Replaces the text between `<!-- name:begin -->` and `<!-- name:end -->` (appended if absent)."""
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    block = f"{begin}\n{table}\n{end}"
    if begin in text:
        text = text[: text.index(begin)] + block + text[text.index(end) + len(end):]
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    path.write_text(text)


if __name__ == "__main__":
    main()
