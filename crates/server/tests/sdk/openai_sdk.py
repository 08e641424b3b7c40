"""Drives a real `oxlm serve` on tiny fixture models with the official `openai` Python SDK.
usage: openai_sdk.py OXLM_BINARY   (scripts/test.sh runs it in a venv that has `openai`)
Prints one line per check and a closing 'N passed, N failed' line; exits 1 on any failure."""
import json

import openai

import serving

MODEL = serving.TINY_MODEL
GOLDEN = json.load(open(f"{MODEL}/golden.json"))
MESSAGES = GOLDEN["messages"]
# The LoRA fixtures mlx-lm made for this tiny model (llama-4bit-g64-r4 among them).
ADAPTER_MODEL = f"{serving.FIXTURES}/tiny/llama-4bit-g64"
ADAPTERS = f"{serving.FIXTURES}/lora"

def start(model, *flags):
    """An `oxlm serve` of `model` on a free port, once healthy, and a client for it."""
    process, base = serving.serve(model, *flags)
    return process, openai.OpenAI(base_url=f"{base}/v1", api_key="unused")

server, client = start(MODEL)
adapter_server, adapter_client = start(ADAPTER_MODEL, "--adapters-dir", ADAPTERS)
# The tiny Qwen3-Embedding and its golden vectors (scripts/oracle/make_embedding_fixture.py).
EMBEDDING_MODEL = f"{serving.FIXTURES}/tiny/embedding/qwen3-embedding-8bit-g128"
EMBEDDINGS = json.load(open(f"{EMBEDDING_MODEL}/embeddings.json"))["inputs"]
embedding_server, embedding_client = start(EMBEDDING_MODEL)

def chat_plain_and_stream():
    r = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=16, temperature=0)
    assert r.object == "chat.completion" and r.choices[0].finish_reason == "length", r
    text = r.choices[0].message.content
    assert GOLDEN["greedy_text"].startswith(text) and len(text) > 0, (text, GOLDEN["greedy_text"])
    assert r.usage.prompt_tokens == GOLDEN["n_prompt"] and r.usage.completion_tokens == 16, r.usage
    chunks = list(client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=16, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text, (streamed, text)
    assert chunks[-1].usage.completion_tokens == 16, chunks[-1]

def completions_and_logprobs():
    r = client.completions.create(model="m", prompt=GOLDEN["prompt_text"], max_tokens=8, temperature=0, logprobs=2)
    assert GOLDEN["greedy_text"].startswith(r.choices[0].text), r.choices[0].text
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 8 and len(lp.token_logprobs) == 8 and all(len(t) == 2 for t in lp.top_logprobs), lp

def stop_string_across_tokens():
    stop = GOLDEN["greedy_text"][3:7]
    r = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=32, temperature=0, stop=[stop])
    assert r.choices[0].message.content == GOLDEN["greedy_text"].split(stop)[0], r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"

def prompt_cache_second_turn():
    first = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=4, temperature=0)
    turn = MESSAGES + [{"role": "assistant", "content": first.choices[0].message.content},
                       {"role": "user", "content": "And again?"}]
    cached = client.chat.completions.create(model="m", messages=turn, max_tokens=4, temperature=0)
    assert cached.usage.prompt_tokens_details.cached_tokens > 0, cached.usage

def errors_are_openai_objects():
    try:
        client.chat.completions.create(model="m", messages=MESSAGES, n=2)
        raise AssertionError("n=2 was accepted")
    except openai.BadRequestError as e:
        assert e.status_code == 400 and e.body["param"] == "n", e.body
    try:
        client.chat.completions.create(model="m", messages=MESSAGES, temperature=-1)
        raise AssertionError("temperature=-1 was accepted")
    except openai.BadRequestError as e:
        assert e.body["type"] == "invalid_request_error", e.body

def models_list():
    ids = [m.id for m in client.models.list()]
    assert len(ids) == 1, ids

def adapters_per_request():
    ask = lambda **extra: adapter_client.chat.completions.create(
        model="m", messages=MESSAGES, max_tokens=12, temperature=0, **extra)
    base = ask().choices[0].message.content
    adapted = ask(extra_body={"adapters": "llama-4bit-g64-r4"}).choices[0].message.content
    assert adapted and adapted != base, (adapted, base)
    again = ask(extra_body={"adapters": "llama-4bit-g64-r4"})
    assert again.choices[0].message.content == adapted, again
    try:
        ask(extra_body={"adapters": "nope"})
        raise AssertionError("an unknown adapter was accepted")
    except openai.NotFoundError as e:
        assert e.status_code == 404 and e.body["code"] == "adapter_not_found", e.body
    try:
        ask(extra_body={"adapters": "../lora/llama-4bit-g64-r4"})
        raise AssertionError("an adapter outside the directory was accepted")
    except openai.BadRequestError as e:
        assert e.body["param"] == "adapters", e.body
    listed = adapter_client.models.list().data[0]
    assert "llama-4bit-g64-r4" in listed.adapters, listed

def close(got, want, what, tolerance=1e-5):
    worst = max(abs(a - b) for a, b in zip(got, want))
    assert len(got) == len(want) and worst <= tolerance, (what, len(got), worst)

def embeddings_as_the_oracle_gives():
    plain = [e for e in EMBEDDINGS if e["prompt_name"] is None]
    texts = [e["text"] for e in plain]
    # The SDK asks for base64 unless told otherwise, and decodes it.
    r = embedding_client.embeddings.create(model="m", input=texts)
    assert r.object == "list" and [d.index for d in r.data] == list(range(len(texts))), r
    for d, e in zip(r.data, plain):
        close(d.embedding, e["last_token"], e["text"])
    assert r.usage.prompt_tokens == sum(len(e["ids"]) for e in plain), r.usage
    # JSON numbers are the f32 values written shortest, which Python reads as doubles.
    as_floats = embedding_client.embeddings.create(model="m", input=texts, encoding_format="float")
    for f, b in zip(as_floats.data, r.data):
        close(f.embedding, b.embedding, "float against base64", 1e-7)
    ids = embedding_client.embeddings.create(model="m", input=[e["ids"] for e in plain])
    for d, e in zip(ids.data, plain):
        close(d.embedding, e["last_token"], e["text"])
    cut = embedding_client.embeddings.create(model="m", input=texts, dimensions=32)
    for d, e in zip(cut.data, plain):
        close(d.embedding, e["last_token_dimensions_32"], e["text"])
    for e in EMBEDDINGS:
        if e["prompt_name"] is not None:
            one = embedding_client.embeddings.create(
                model="m", input=e["text"], extra_body={"prompt_name": e["prompt_name"]})
            close(one.data[0].embedding, e["last_token"], e["text"])
    try:
        client.embeddings.create(model="m", input="a causal model")
        raise AssertionError("a model without embedding files embedded")
    except openai.BadRequestError as e:
        assert e.body["type"] == "invalid_request_error", e.body

with serving.Checks(server, adapter_server, embedding_server) as checks:
    checks.run([("chat, plain and streamed", chat_plain_and_stream),
                ("completions with logprobs", completions_and_logprobs),
                ("stop string across tokens", stop_string_across_tokens),
                ("prompt cache on a second turn", prompt_cache_second_turn),
                ("errors as OpenAI objects", errors_are_openai_objects),
                ("models list", models_list),
                ("adapters chosen per request", adapters_per_request),
                ("embeddings as the oracle gives them", embeddings_as_the_oracle_gives)])
