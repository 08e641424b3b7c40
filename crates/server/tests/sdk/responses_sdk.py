"""Drives the Responses API of a real `oxlm serve` on a tiny fixture model with the official
`openai` Python SDK: plain and streamed responses, previous_response_id, retrieve and delete,
errors, a JSON schema reply, and an agent loop that calls a tool (tool_choice="required") and
answers with its result.
usage: responses_sdk.py OXLM_BINARY   (scripts/test.sh runs it in a venv that has `openai`)
Prints one line per check and a closing 'N passed, N failed' line; exits 1 on any failure."""
import json

import openai

import serving

MODEL = serving.TINY_MODEL
GOLDEN = json.load(open(f"{MODEL}/golden.json"))
# The golden prompt is one user message: the same as a string `input`.
QUESTION = GOLDEN["messages"][0]["content"]
WEATHER_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                   "required": ["city"], "additionalProperties": False},
    "strict": True,
}

server, base = serving.serve(MODEL)
client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused")

def create(**kwargs):
    return client.responses.create(model="m", temperature=0, **kwargs)

def plain_and_streamed():
    r = create(input=QUESTION, max_output_tokens=16)
    assert r.object == "response" and r.status == "incomplete", r
    assert r.incomplete_details.reason == "max_output_tokens", r.incomplete_details
    text = r.output_text
    assert text and GOLDEN["greedy_text"].startswith(text), (text, GOLDEN["greedy_text"])
    assert [item.type for item in r.output] == ["message"], r.output
    assert r.usage.input_tokens == GOLDEN["n_prompt"] and r.usage.output_tokens == 16, r.usage
    assert r.usage.total_tokens == GOLDEN["n_prompt"] + 16, r.usage
    events = list(create(input=QUESTION, max_output_tokens=16, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events))), events
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"], types
    assert types[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"], types
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert streamed == text, (streamed, text)
    assert events[-1].response.output_text == text, events[-1].response

def previous_response_continues():
    first = create(input=QUESTION, instructions="Answer briefly.", max_output_tokens=4)
    second = create(input="And again?", previous_response_id=first.id, max_output_tokens=4)
    assert second.previous_response_id == first.id and second.instructions is None, second
    # The same conversation through chat completions: the first turn, without its instructions
    # (a continuation does not inherit them), and the new question.
    turns = [{"role": "user", "content": QUESTION},
             {"role": "assistant", "content": first.output_text},
             {"role": "user", "content": "And again?"}]
    chat = client.chat.completions.create(model="m", messages=turns, max_tokens=1)
    assert second.usage.input_tokens == chat.usage.prompt_tokens, (second.usage, chat.usage)
    # The first turn's tokens came from the prompt cache.
    assert second.usage.input_tokens_details.cached_tokens > 0, second.usage

def retrieve_and_delete():
    r = create(input=QUESTION, max_output_tokens=4, metadata={"check": "retrieve"})
    got = client.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text and got.metadata == {"check": "retrieve"}, got
    assert client.responses.delete(r.id) is None
    try:
        client.responses.retrieve(r.id)
        raise AssertionError("a deleted response was found")
    except openai.NotFoundError as e:
        assert e.status_code == 404 and e.body["message"] == f"Response with id '{r.id}' not found.", e.body
    unstored = create(input=QUESTION, max_output_tokens=2, store=False)
    try:
        client.responses.retrieve(unstored.id)
        raise AssertionError("a response made with store=False was kept")
    except openai.NotFoundError:
        pass

def errors_are_openai_objects():
    try:
        create(input="Hi", previous_response_id="resp_missing")
        raise AssertionError("an unknown previous_response_id was accepted")
    except openai.NotFoundError as e:
        assert e.body == {"message": "Previous response with id 'resp_missing' not found.",
                          "type": "invalid_request_error", "param": "previous_response_id",
                          "code": "previous_response_not_found"}, e.body
    try:
        create(input="Hi", tools=[{"type": "web_search"}])
        raise AssertionError("a web_search tool was accepted")
    except openai.BadRequestError as e:
        assert e.body["param"] == "tools[0].type", e.body
    assert create(input="Hi", max_output_tokens=2).status == "incomplete"

def text_format_json_schema():
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                               "sunny": {"type": "boolean"}},
              "required": ["city", "sunny"], "additionalProperties": False}
    text = {"format": {"type": "json_schema", "name": "weather", "schema": schema, "strict": True}}
    r = create(input="The weather in Paris, as JSON.", text=text, max_output_tokens=200)
    assert r.text.format.type == "json_schema" and r.text.format.name == "weather", r.text
    reply = json.loads(r.output_text)
    assert set(reply) == {"city", "sunny"} and isinstance(reply["sunny"], bool), reply

def agent_loop_with_a_required_call():
    # The tiny model calls the tool only because the call is enforced.
    r = create(input="What is the weather in Paris?", tools=[WEATHER_TOOL], tool_choice="required",
               max_output_tokens=200)
    calls = [item for item in r.output if item.type == "function_call"]
    assert calls, r.output
    call = calls[0]
    assert call.name == "get_weather" and call.call_id.startswith("call_"), call
    assert isinstance(json.loads(call.arguments)["city"], str), call.arguments
    outputs = [{"type": "function_call_output", "call_id": c.call_id, "output": "18C, sunny"} for c in calls]
    answer = create(input=outputs, previous_response_id=r.id, tools=[WEATHER_TOOL], tool_choice="none",
                    max_output_tokens=8)
    assert [item.type for item in answer.output] == ["message"] and answer.output_text, answer.output
    # The answer's prompt is the conversation with the calls and their results, as chat
    # completions render it.
    turns = [{"role": "user", "content": "What is the weather in Paris?"},
             {"role": "assistant", "content": "", "tool_calls": [
                 {"id": c.call_id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                 for c in calls]}]
    turns += [{"role": "tool", "tool_call_id": c.call_id, "content": "18C, sunny"} for c in calls]
    chat = client.chat.completions.create(model="m", messages=turns, max_tokens=1)
    assert answer.usage.input_tokens == chat.usage.prompt_tokens, (answer.usage, chat.usage)

with serving.Checks(server) as checks:
    checks.run([("responses, plain and streamed", plain_and_streamed),
                ("previous_response_id continues a conversation", previous_response_continues),
                ("retrieve and delete", retrieve_and_delete),
                ("errors as OpenAI objects", errors_are_openai_objects),
                ("text.format json_schema", text_format_json_schema),
                ("agent loop with a required tool call", agent_loop_with_a_required_call)])
