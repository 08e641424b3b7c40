"""Drives a real `oxlm serve` on a tiny fixture model with the official `openai` Python SDK.
usage: openai_sdk.py OXLM_BINARY   (scripts/test.sh runs it in a venv that has `openai`)
Prints one line per check and a closing 'N passed, N failed' line; exits 1 on any failure."""
import json, os, socket, subprocess, sys, time, urllib.request

import openai

ROOT = os.path.dirname(os.path.abspath(__file__)) + "/../../../.."
MODEL = f"{ROOT}/tests/fixtures/tiny/llama-8bit-g32"
GOLDEN = json.load(open(f"{MODEL}/golden.json"))
MESSAGES = GOLDEN["messages"]

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

port = free_port()
server = subprocess.Popen([sys.argv[1], "serve", "--model", MODEL, "--port", str(port)],
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
base = f"http://127.0.0.1:{port}"
for _ in range(300):
    try:
        urllib.request.urlopen(f"{base}/health", timeout=1)
        break
    except OSError:
        time.sleep(0.1)
client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused")
passed, failed = 0, 0

def check(name, fn):
    global passed, failed
    try:
        fn()
        passed += 1
        print(f"ok   {name}")
    except Exception as e:  # a failed check is reported, the others still run
        failed += 1
        print(f"FAIL {name}: {e!r}")

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

try:
    for name, fn in [("chat, plain and streamed", chat_plain_and_stream),
                     ("completions with logprobs", completions_and_logprobs),
                     ("stop string across tokens", stop_string_across_tokens),
                     ("prompt cache on a second turn", prompt_cache_second_turn),
                     ("errors as OpenAI objects", errors_are_openai_objects),
                     ("models list", models_list)]:
        check(name, fn)
finally:
    server.terminate()
    server.wait(timeout=10)
print(f"{passed} passed, {failed} failed")
sys.exit(1 if failed else 0)
