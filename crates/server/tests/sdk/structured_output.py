"""Structured output on the real small models: 100 schema-constrained chat requests per model
(five schemas, twenty seeds each, sampled at temperature 1 and never shown the schema, so that
nothing but the constraint holds the model to it), sent through the official `openai` SDK to a
real `oxlm serve`, eight at a time; every reply must parse and validate with `jsonschema`.
usage: structured_output.py OXLM_BINARY   (scripts/test.sh runs it in a venv with both packages)
Models missing from the cache ($OXLM_CACHE/models, scripts/models/fetch_models.sh) are skipped.
Prints one line per model and exits 1 on any invalid reply."""
import json, os, sys, time
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai

import serving

CACHE = os.environ.get("OXLM_CACHE", os.path.expanduser("~/.cache/oxlm"))
MODELS = ["smollm2-135m-instruct-4bit", "qwen2.5-coder-0.5b-instruct-4bit"]
SEEDS = range(20)

SCHEMAS = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "email": {"type": "string", "maxLength": 30},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    "order": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 1},
            "items": {
                "type": "array", "minItems": 1, "maxItems": 3,
                "items": {
                    "type": "object",
                    "properties": {
                        "sku": {"type": "string", "maxLength": 8},
                        "quantity": {"type": "integer", "minimum": 1, "maximum": 10},
                        "price": {"type": "number", "minimum": 0, "maximum": 1000},
                    },
                    "required": ["sku", "quantity", "price"],
                    "additionalProperties": False,
                },
            },
            "status": {"enum": ["pending", "shipped", "delivered"]},
        },
        "required": ["id", "items", "status"],
        "additionalProperties": False,
    },
    "weather": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 20},
            "celsius": {"type": "number", "minimum": -60, "maximum": 60},
            "conditions": {"type": "array", "maxItems": 3,
                           "items": {"enum": ["sun", "rain", "snow", "wind", "fog"]}},
            "alert": {"type": ["string", "null"], "maxLength": 30},
        },
        "required": ["city", "celsius", "conditions", "alert"],
        "additionalProperties": False,
    },
    "tree": {
        "type": "object",
        "properties": {
            "label": {"type": "string", "maxLength": 10},
            "children": {"type": "array", "maxItems": 2, "items": {"$ref": "#/$defs/leaf"}},
        },
        "required": ["label", "children"],
        "additionalProperties": False,
        "$defs": {"leaf": {
            "type": "object",
            "properties": {"label": {"type": "string", "maxLength": 10},
                           "weight": {"type": "integer", "minimum": 0, "maximum": 9}},
            "required": ["label", "weight"],
            "additionalProperties": False,
        }},
    },
    "answer": {
        "type": "object",
        "properties": {
            "answer": {"type": "boolean"},
            "confidence": {"type": "number", "minimum": 0, "maximum": 1},
            "reason": {"type": "string", "maxLength": 40},
        },
        "required": ["answer", "confidence", "reason"],
        "additionalProperties": False,
    },
}

PROMPTS = {
    "person": "Invent a person.",
    "order": "Invent an online order.",
    "weather": "Give the weather in Oslo.",
    "tree": "Draw a small tree.",
    "answer": "Is the sea salty?",
}


def serve(model):
    process, base = serving.serve(model, attempts=600)
    return process, openai.OpenAI(base_url=f"{base}/v1", api_key="unused", timeout=600)


def check(client, name, seed):
    """None if the reply validates, else what is wrong with it."""
    schema = SCHEMAS[name]
    r = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": PROMPTS[name]}], max_tokens=400,
        temperature=1.0, seed=seed,
        response_format={"type": "json_schema",
                         "json_schema": {"name": name, "schema": schema, "strict": True}})
    text = r.choices[0].message.content
    if r.choices[0].finish_reason != "stop":
        return f"{name}/{seed}: ended by {r.choices[0].finish_reason}: {text!r}"
    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError) as e:
        return f"{name}/{seed}: {text!r}: {e}"
    return None


failed = 0
for model in MODELS:
    path = f"{CACHE}/models/{model}"
    if not os.path.isdir(path):
        print(f"skip {model}: not in {CACHE}/models")
        continue
    process, client = serve(path)
    try:
        start = time.time()
        with ThreadPoolExecutor(8) as pool:
            problems = [p for p in pool.map(lambda job: check(client, *job),
                                             [(n, s) for n in SCHEMAS for s in SEEDS]) if p]
        count = len(SCHEMAS) * len(SEEDS)
        print(f"{'ok  ' if not problems else 'FAIL'} {model}: {count - len(problems)}/{count} "
              f"replies valid ({time.time() - start:.0f} s)")
        for problem in problems:
            print(f"     {problem}")
        failed += len(problems)
    finally:
        process.terminate()
        process.wait()
sys.exit(1 if failed else 0)
