"""Serving throughput: `oxlm serve` against `mlx_lm.server`, with requests sent together.

usage: python3 benches/serve_bench.py --oxlm target/release/oxlm --model DIR
           [--mlx-python PYTHON] [--requests 1,4,8] [--max-tokens 64] [--serve-args="--device cuda"]
       python3 benches/serve_bench.py --oxlm target/release/oxlm --model DIR
           --long-prompt WORDS [--prefill-steps 2048,256] [--stream-tokens 200]
       python3 benches/serve_bench.py --oxlm target/release/oxlm --model DIR
           --arrivals 400 [--rate 100] [--max-tokens 128]

Each server runs in a subprocess of its own on a free port and answers one warm-up request.
Then, for each count n of `--requests`, n text completions (distinct prompts, greedy,
`max_tokens`) are sent at once, each from a thread of its own; the figures are the generated
tokens of all of them (their `usage.completion_tokens`; a reply may stop early at an
end-of-sequence token) over the wall time from the first send to the last reply, and the mean
time a request took. oxlm runs twice: decoding one request at a time (`--decode-concurrency 1`,
as it served before batching) and with its default (32, mlx_lm.server's). mlx_lm.server runs
with its defaults (batch generation, `--decode-concurrency 32`) when `--mlx-python` names a
Python that has mlx-lm (on these machines, MLX's CPU backend). `--serve-args` are added to
both of oxlm's command lines (for example `--device cuda`).

With `--long-prompt`, what a long prompt does to a request that is streaming meanwhile: one
request streams `--stream-tokens` tokens; once ten have come, a second one arrives with a
prompt of WORDS words (and asks for one token), and a second later a third with a short prompt
(one token too). Reported per `--prefill-step-size` of oxlm: the streaming request's longest
pause between two tokens, its median pause, how long the long one took, and how long the short
one took (its time to first token: it waits for the chunk of the long prompt in progress, not
for the whole prompt). The stream must outlast the long prompt: a GPU streams 200 tokens in a tenth
of a second, so give it thousands there.

With `--arrivals N`, requests come as a server's do, one at a time and each at its own moment:
N of them at the moments of a Poisson process of `--rate` a second, each asking for between a
quarter of `--max-tokens` and all of it (both drawn from a fixed seed, so that every run sends
the same), against oxlm with its defaults. Batches then change their make-up every few steps.
Reported: the generated tokens over the wall time from the first send to the last reply, and
the mean and 90th-percentile time a request took.
"""
import argparse
import json
import random
import shlex
import socket
import subprocess
import sys
import threading
import time
import urllib.request

PROMPTS = [
    "The history of the river valley begins",
    "Write a short story about a lighthouse keeper who",
    "Explain how a bicycle gear system works:",
    "List the planets of the solar system and describe",
    "Once upon a time in a small mountain village,",
    "The recipe for a good bread starts with",
    "In computer science, a hash table is",
    "The main causes of the industrial revolution were",
]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(base, body, timeout=3600):
    request = urllib.request.Request(
        f"{base}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=timeout) as reply:
        return json.loads(reply.read())


def wait_ready(base, process, timeout=600):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if process.poll() is not None:
            sys.exit(f"the server exited with {process.returncode}")
        try:
            urllib.request.urlopen(f"{base}/v1/models", timeout=5).read()
            return
        except OSError:
            time.sleep(0.5)
    sys.exit("the server did not start")


def send(base, schedule):
    """Sends one request per (seconds after the first, max_tokens) of `schedule`, each from a
    thread of its own: (per request, its generated tokens and seconds from its send to its
    reply; wall seconds from the first send to the last reply)."""
    results = [None] * len(schedule)

    def one(i, at, max_tokens):
        time.sleep(max(0.0, start + at - time.time()))
        sent = time.time()
        body = {"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": max_tokens, "temperature": 0}
        reply = post(base, body)
        results[i] = (reply["usage"]["completion_tokens"], time.time() - sent)

    threads = [threading.Thread(target=one, args=(i, *s)) for i, s in enumerate(schedule)]
    start = time.time()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, time.time() - start


def send_together(base, n, max_tokens):
    """(generated tokens, wall seconds, mean seconds a request) of n requests sent at once."""
    results, wall = send(base, [(0.0, max_tokens)] * n)
    return sum(r[0] for r in results), wall, sum(r[1] for r in results) / n


def arrivals(base, n, rate, max_tokens):
    """(generated tokens, wall seconds, mean and 90th-percentile seconds a request) of n requests
    sent at the moments of a seeded Poisson process of `rate` a second."""
    rng = random.Random(0)
    schedule, at = [], 0.0
    for _ in range(n):
        at += rng.expovariate(rate)
        schedule.append((at, rng.randint(max(1, max_tokens // 4), max_tokens)))
    results, wall = send(base, schedule)
    took = sorted(r[1] for r in results)
    return sum(r[0] for r in results), wall, sum(took) / n, took[(9 * n) // 10 - 1]


def stream_gaps(base, body, tenth):
    """The seconds between consecutive events of a streamed completion; `tenth` is set once
    ten have come (or the stream ended sooner)."""
    request = urllib.request.Request(
        f"{base}/v1/completions",
        data=json.dumps(dict(body, stream=True)).encode(),
        headers={"Content-Type": "application/json"},
    )
    times = []
    try:
        with urllib.request.urlopen(request, timeout=3600) as reply:
            for line in reply:
                if line.startswith(b"data: "):
                    times.append(time.time())
                    if len(times) == 10:
                        tenth.set()
    finally:
        tenth.set()
    return [b - a for a, b in zip(times, times[1:])]


def long_prompt(base, words, stream_tokens):
    """(longest pause, median pause, seconds the long prompt took, seconds the short request
    sent a second after it took)."""
    gaps = []
    tenth = threading.Event()
    body = {"prompt": PROMPTS[0], "max_tokens": stream_tokens, "temperature": 0}
    streaming = threading.Thread(target=lambda: gaps.extend(stream_gaps(base, body, tenth)))
    streaming.start()
    tenth.wait()
    start = time.time()
    took = []
    long = {"prompt": " ".join(["word"] * words), "max_tokens": 1, "temperature": 0}
    sending = threading.Thread(target=lambda: (post(base, long), took.append(time.time() - start)))
    sending.start()
    time.sleep(1)
    short_start = time.time()
    post(base, {"prompt": PROMPTS[1], "max_tokens": 1, "temperature": 0})
    short = time.time() - short_start
    sending.join()
    streaming.join()
    gaps.sort()
    return max(gaps), gaps[len(gaps) // 2], took[0], short


def started(command):
    """A server from `command` on a free port, once it answers: (process, base URL)."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    process = subprocess.Popen(
        command + ["--host", "127.0.0.1", "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    wait_ready(base, process)
    post(base, {"prompt": "Hello", "max_tokens": 4, "temperature": 0})
    return process, base


def run_server(label, command, counts, max_tokens):
    process, base = started(command)
    try:
        rows = []
        for n in counts:
            tokens, wall, latency = send_together(base, n, max_tokens)
            row = {
                "server": label,
                "requests": n,
                "tokens": tokens,
                "seconds": round(wall, 3),
                "tok_s": round(tokens / wall, 2),
                "mean_request_s": round(latency, 3),
            }
            print(json.dumps(row), flush=True)
            rows.append(row)
        return rows
    finally:
        process.terminate()
        process.wait()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--oxlm", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--mlx-python")
    parser.add_argument("--requests", default="1,4,8")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--long-prompt", type=int, default=0)
    parser.add_argument("--prefill-steps", default="2048,256")
    parser.add_argument("--stream-tokens", type=int, default=200)
    parser.add_argument("--arrivals", type=int, default=0)
    parser.add_argument("--rate", type=float, default=100.0, help="arrivals a second")
    parser.add_argument("--serve-args", default="", help="more arguments of `oxlm serve`")
    args = parser.parse_args()
    oxlm = [args.oxlm, "serve", "--model", args.model, *shlex.split(args.serve_args)]
    if args.long_prompt:
        for step in args.prefill_steps.split(","):
            process, base = started([*oxlm, "--prefill-step-size", step, "--log-level", "WARNING"])
            try:
                longest, median, took, short = long_prompt(
                    base, args.long_prompt, args.stream_tokens)
            finally:
                process.terminate()
                process.wait()
            print(f"--prefill-step-size {step}: longest pause {longest:.3f} s, median "
                  f"{median:.4f} s; the long prompt took {took:.2f} s, a one-token request "
                  f"sent a second after it {short:.2f} s", flush=True)
        return
    if args.arrivals:
        process, base = started([*oxlm, "--log-level", "WARNING"])
        try:
            tokens, wall, mean, p90 = arrivals(base, args.arrivals, args.rate, args.max_tokens)
        finally:
            process.terminate()
            process.wait()
        print(json.dumps({"arrivals": args.arrivals, "rate": args.rate, "tokens": tokens,
                          "seconds": round(wall, 3), "tok_s": round(tokens / wall, 2),
                          "mean_request_s": round(mean, 3), "p90_request_s": round(p90, 3)}),
              flush=True)
        return
    counts = [int(n) for n in args.requests.split(",")]
    servers = [
        ("oxlm, one at a time", [*oxlm, "--decode-concurrency", "1", "--log-level", "WARNING"]),
        ("oxlm", [*oxlm, "--log-level", "WARNING"]),
    ]
    if args.mlx_python:
        servers.append(("mlx_lm.server", [args.mlx_python, "-m", "mlx_lm.server",
                                          "--model", args.model, "--log-level", "WARNING"]))
    rows = [row for label, command in servers
            for row in run_server(label, command, counts, args.max_tokens)]
    print()
    print("| requests sent together | " + " | ".join(label for label, _ in servers) + " |")
    print("|---|" + "---|" * len(servers))
    for n in counts:
        cells = []
        for label, _ in servers:
            row = next(r for r in rows if r["server"] == label and r["requests"] == n)
            cells.append(f"{row['tok_s']} tok/s ({row['mean_request_s']} s a request)")
        print(f"| {n} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
