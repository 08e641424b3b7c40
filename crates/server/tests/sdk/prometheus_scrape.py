"""Scrapes a real `oxlm serve` on a tiny fixture model with the official Prometheus Python client's
parser (`prometheus_client.parser.text_string_to_metric_families`), as scrapers of vLLM's
/metrics read it, after a few requests whose counts the checks expect exactly.
usage: prometheus_scrape.py OXLM_BINARY   (scripts/test.sh runs it in a venv that has prometheus_client)
Prints one line per check and a closing 'N passed, N failed' line; exits 1 on any failure."""
import json, time, urllib.request

from prometheus_client.parser import text_string_to_metric_families

import serving

MODEL = serving.TINY_MODEL
GOLDEN = json.load(open(f"{MODEL}/golden.json"))
# vLLM's buckets (vllm/v1/metrics/loggers.py).
BUCKETS = {
    "vllm:time_to_first_token_seconds": [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                                         1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0],
    "vllm:inter_token_latency_seconds": [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                                         2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0],
    "vllm:e2e_request_latency_seconds": [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                                         50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0],
}
BUCKETS["vllm:time_per_output_token_seconds"] = BUCKETS["vllm:inter_token_latency_seconds"]
FAMILIES = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:gpu_cache_usage_perc": "gauge",
    # The parser names a counter's family without its samples' `_total`.
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:prefix_cache_queries": "counter",
    "vllm:prefix_cache_hits": "counter",
    "vllm:request_success": "counter",
    **{name: "histogram" for name in BUCKETS},
    # oxlm's own: the memory budget requests are admitted by.
    "oxlm:memory_budget_bytes": "gauge",
    "oxlm:memory_charged_bytes": "gauge",
}

def fetch(path, body=None):
    """(status, content type, text) of a GET, or of a POST of `body` as JSON."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(BASE + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, r.headers["Content-Type"], r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.headers["Content-Type"], e.read().decode()

def chat(**fields):
    """A chat request's finish reason and usage, streamed or not."""
    status, _, text = fetch("/v1/chat/completions", {"messages": GOLDEN["messages"], **fields})
    assert status == 200, text
    if not fields.get("stream"):
        reply = json.loads(text)
        return reply["choices"][0]["finish_reason"], reply["usage"]
    chunks = [json.loads(line[6:]) for line in text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    finish = next(c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"])
    return finish, chunks[-1]["usage"]

server, BASE = serving.serve(MODEL, ready="/ready")

with serving.Checks(server) as checks:
    model_id = json.loads(fetch("/v1/models")[2])["data"][0]["id"]
    stop = GOLDEN["greedy_text"][3:7]
    replies = [chat(max_tokens=8), chat(max_tokens=4, stream=True, stream_options={"include_usage": True}),
               chat(max_tokens=32, stop=[stop])]
    finishes = [finish for finish, _ in replies]
    prompt = sum(usage["prompt_tokens"] for _, usage in replies)
    completion = sum(usage["completion_tokens"] for _, usage in replies)
    cached = sum(usage["prompt_tokens_details"]["cached_tokens"] for _, usage in replies)
    gaps = sum(usage["completion_tokens"] - 1 for _, usage in replies)
    # The batcher publishes its gauges between steps, which may come just after a reply.
    for _ in range(100):
        stats = json.loads(fetch("/stats")[2])
        if stats["requests"]["running"] == 0:
            break
        time.sleep(0.05)
    status, content_type, text = fetch("/metrics")
    families = {f.name: f for f in text_string_to_metric_families(text)}

    def value(name, sample, **labels):
        found = [s.value for s in families[name].samples if s.name == sample and labels.items() <= s.labels.items()]
        assert len(found) == 1, (sample, labels, found)
        return found[0]

    def scraped():
        assert status == 200 and content_type == "text/plain; version=0.0.4; charset=utf-8", (status, content_type)
        assert finishes == ["length", "length", "stop"] and cached == 2 * (GOLDEN["n_prompt"] - 1), (finishes, cached)

    def families_and_types():
        assert {name: f.type for name, f in families.items()} == FAMILIES, {n: f.type for n, f in families.items()}

    def labelled_with_the_model():
        labels = {s.labels.get("model_name") for f in families.values() for s in f.samples}
        assert labels == {model_id}, labels

    def counters():
        got = [value(f"vllm:{name}", f"vllm:{name}_total")
               for name in ("prompt_tokens", "generation_tokens", "prefix_cache_queries", "prefix_cache_hits")]
        assert got == [prompt, completion, prompt, cached], (got, [prompt, completion, prompt, cached])
        by_reason = {reason: value("vllm:request_success", "vllm:request_success_total", finished_reason=reason)
                     for reason in ("stop", "length", "abort", "error")}
        assert by_reason == {"stop": 1, "length": 2, "abort": 0, "error": 0}, by_reason

    def histograms():
        counts = {"vllm:time_to_first_token_seconds": 3, "vllm:inter_token_latency_seconds": gaps,
                  "vllm:time_per_output_token_seconds": gaps, "vllm:e2e_request_latency_seconds": 3}
        for name, bounds in BUCKETS.items():
            buckets = [(float(s.labels["le"]), s.value) for s in families[name].samples if s.name == f"{name}_bucket"]
            assert [le for le, _ in buckets] == bounds + [float("inf")], (name, buckets)
            count = value(name, f"{name}_count")
            assert count == counts[name] and buckets[-1][1] == count, (name, count, buckets[-1])
            assert value(name, f"{name}_sum") > 0, name

    def gauges_at_rest():
        got = [value(name, name) for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                                              "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")]
        assert got == [0, 0, 0, 0], got
        budget = value("oxlm:memory_budget_bytes", "oxlm:memory_budget_bytes")
        assert budget > 0 and value("oxlm:memory_charged_bytes", "oxlm:memory_charged_bytes") == 0, budget

    def stats_agree():
        assert stats["status"] == "ready" and stats["model"] == model_id, stats
        assert stats["tokens"] == {"prompt": prompt, "generation": completion}, stats["tokens"]
        assert stats["prefix_cache"]["hits"] == cached, stats["prefix_cache"]
        assert stats["requests"]["finished"] == {"stop": 1, "length": 2, "abort": 0, "error": 0}, stats["requests"]
        budget = value("oxlm:memory_budget_bytes", "oxlm:memory_budget_bytes")
        assert stats["memory"] == {"budget_bytes": budget, "charged_bytes": 0}, stats["memory"]

    def probes():
        assert fetch("/ready")[::2] == (200, '{"status":"ready"}'), fetch("/ready")
        assert fetch("/health")[::2] == (200, '{"status":"ok"}'), fetch("/health")

    checks.run([("/metrics served as Prometheus text", scraped),
                ("vLLM's families and types", families_and_types),
                ("every sample labelled with the model", labelled_with_the_model),
                ("counters", counters),
                ("histograms on vLLM's buckets", histograms),
                ("gauges at rest", gauges_at_rest),
                ("/stats agrees", stats_agree),
                ("readiness and liveness", probes)])
