"""Drives a real `oxlm serve` on a tiny fixture model with the official `anthropic` Python SDK.
usage: anthropic_sdk.py OXLM_BINARY   (scripts/test.sh runs it in a venv that has `anthropic`)
Prints one line per check and a closing 'N passed, N failed' line; exits 1 on any failure."""
import json

import anthropic

import serving

MODEL = serving.TINY_MODEL
GOLDEN = json.load(open(f"{MODEL}/golden.json"))
MESSAGES = GOLDEN["messages"]
KEY = "sk-oxlm-test"
# The SDK has no `temperature` argument any more; the API still takes the field, as oxlm does.
GREEDY = {"extra_body": {"temperature": 0}}
# A short string, which a random model ends within max_tokens once the call is enforced.
WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                            "required": ["city"], "additionalProperties": False}}

# With a key, as Anthropic's API has: the SDK sends it as `x-api-key`.
server, base = serving.serve(MODEL, "--api-key", KEY)
client = anthropic.Anthropic(base_url=base, api_key=KEY, max_retries=0)

def create_and_stream():
    r = client.messages.create(model="m", messages=MESSAGES, max_tokens=16, **GREEDY)
    assert r.type == "message" and r.role == "assistant" and r.stop_reason == "max_tokens", r
    assert r.id.startswith("msg_") and len(r.content) == 1 and r.content[0].type == "text", r
    text = r.content[0].text
    assert GOLDEN["greedy_text"].startswith(text) and len(text) > 0, (text, GOLDEN["greedy_text"])
    assert r.usage.output_tokens == 16, r.usage
    assert r.usage.input_tokens + r.usage.cache_read_input_tokens == GOLDEN["n_prompt"], r.usage
    with client.messages.stream(model="m", messages=MESSAGES, max_tokens=16, **GREEDY) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == text, (streamed, text)
    assert final.content[0].text == text and final.stop_reason == "max_tokens", final
    assert final.usage.output_tokens == 16, final.usage

def stop_sequence():
    stop = GOLDEN["greedy_text"][3:7]
    r = client.messages.create(model="m", messages=MESSAGES, max_tokens=32, stop_sequences=[stop],
                               **GREEDY)
    assert r.content[0].text == GOLDEN["greedy_text"].split(stop)[0], r.content
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == stop, r

def count_tokens():
    count = client.messages.count_tokens(model="m", messages=MESSAGES)
    assert count.input_tokens == GOLDEN["n_prompt"], count
    with_system = client.messages.count_tokens(model="m", system="Be brief.", messages=MESSAGES)
    assert with_system.input_tokens > count.input_tokens, with_system

def errors_are_anthropic_errors():
    try:
        client.messages.create(model="m", messages=MESSAGES, max_tokens=8,
                               extra_body={"temperature": 2})
        raise AssertionError("temperature=2 was accepted")
    except anthropic.BadRequestError as e:
        assert e.status_code == 400 and e.body["type"] == "error", e.body
        assert e.body["error"]["type"] == "invalid_request_error", e.body
    try:
        client.messages.create(model="m", max_tokens=8, messages=[
            {"role": "user", "content": [{"type": "tool_result", "content": "18C"}]}])
        raise AssertionError("a tool_result without tool_use_id was accepted")
    except anthropic.BadRequestError as e:
        assert "tool_use_id" in e.body["error"]["message"], e.body
    stranger = anthropic.Anthropic(base_url=base, api_key="sk-wrong", max_retries=0)
    try:
        stranger.messages.create(model="m", messages=MESSAGES, max_tokens=8)
        raise AssertionError("a wrong key was accepted")
    except anthropic.AuthenticationError as e:
        assert e.body["error"]["type"] == "authentication_error", e.body

def agent_loop():
    """The model must call the tool (`any`), gets the result, then answers in text."""
    ask = {"role": "user", "content": "What is the weather in Paris?"}
    r = client.messages.create(model="m", messages=[ask], max_tokens=200, tools=[WEATHER],
                               tool_choice={"type": "any"}, **GREEDY)
    assert r.stop_reason == "tool_use", r
    calls = [block for block in r.content if block.type == "tool_use"]
    assert calls and all(c.name == "get_weather" and isinstance(c.input, dict) for c in calls), r.content
    results = [{"type": "tool_result", "tool_use_id": c.id, "content": "18C, sunny"} for c in calls]
    turn = [ask, {"role": "assistant", "content": r.content}, {"role": "user", "content": results}]
    answer = client.messages.create(model="m", messages=turn, max_tokens=16, tools=[WEATHER],
                                    tool_choice={"type": "none"}, **GREEDY)
    assert answer.stop_reason in ("end_turn", "max_tokens"), answer
    assert [block.type for block in answer.content] == ["text"], answer.content

with serving.Checks(server) as checks:
    checks.run([("messages, created and streamed", create_and_stream),
                ("stop sequence", stop_sequence),
                ("count_tokens", count_tokens),
                ("errors as Anthropic errors", errors_are_anthropic_errors),
                ("agent loop: tool_use, tool_result, answer", agent_loop)])
