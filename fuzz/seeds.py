"""Writes the fuzz targets' seed corpora into fuzz/corpus/<target>/ from tests/fixtures, so that
no binary seed is committed. Safetensors seeds keep each fixture's header (names, dtypes, shapes,
metadata) with its large arrays cut to a few elements, which keeps them small enough to mutate."""

import hashlib
import json
import struct
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"
DTYPE_SIZES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2,
               "BF16": 2, "I16": 2, "U16": 2, "U8": 1, "I8": 1, "BOOL": 1}


def write(corpus: Path, data: bytes) -> None:
    corpus.mkdir(parents=True, exist_ok=True)
    (corpus / hashlib.sha1(data).hexdigest()).write_bytes(data)


def small_safetensors(path: Path) -> bytes:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    body = raw[8 + n:]
    arrays = sorted((k, v) for k, v in header.items() if k != "__metadata__")
    arrays.sort(key=lambda kv: kv[1]["data_offsets"][0])
    out = {k: v for k, v in header.items() if k == "__metadata__"}
    data = b""
    for name, info in arrays[:24]:
        begin, end = info["data_offsets"]
        size = DTYPE_SIZES[info["dtype"]]
        shape = info["shape"]
        if end - begin > 256:
            shape = [max(1, 16 // size)]
            end = begin + shape[0] * size
        out[name] = {"dtype": info["dtype"], "shape": shape,
                     "data_offsets": [len(data), len(data) + end - begin]}
        data += body[begin:end]
    text = json.dumps(out, separators=(",", ":")).encode()
    return struct.pack("<Q", len(text)) + text + data


def main(corpus_root: Path) -> None:
    for path in sorted(FIXTURES.rglob("*.safetensors")):
        write(corpus_root / "safetensors", small_safetensors(path))

    # The target numbers the fixtures with weights in this order (fuzz_targets/model_config.rs).
    tiny = sorted(p.parent for p in (FIXTURES / "tiny").glob("*/model.safetensors"))
    for i, model in enumerate(tiny):
        config = (model / "config.json").read_bytes()
        write(corpus_root / "model_config", bytes([i]) + config)
        # Tying the embeddings drops the lm_head's weights: settings for them go unchecked.
        tied = json.loads(config)
        tied["tie_word_embeddings"] = not tied.get("tie_word_embeddings", False)
        write(corpus_root / "model_config", bytes([i]) + json.dumps(tied).encode())

    tokenizer = corpus_root / "tokenizer_config"
    base = json.loads((FIXTURES / "tiny" / "tokenizer" / "tokenizer_config.json").read_text())
    write(tokenizer, json.dumps(base, indent=2).encode())
    templates = sorted((FIXTURES / "templates").glob("*.jinja"))
    for template in templates:
        write(tokenizer, json.dumps({**base, "chat_template": template.read_text()}).encode())
    named = [{"name": t.stem, "template": t.read_text()} for t in templates[:2]]
    write(tokenizer, json.dumps({
        "tokenizer_class": "LlamaTokenizerFast", "bos_token": "<|im_start|>",
        "added_tokens_decoder": {"5": {"content": "<x>", "special": True}},
        "additional_special_tokens": ["<|im_start|>", {"content": "<|im_end|>"}],
        "split_special_tokens": True, "chat_template": named}).encode())

    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "1", "type": "function", "function": {
                        "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
                {"role": "tool", "tool_call_id": "1", "content": "sunny"}]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    for body in [
        {"messages": messages, "tools": tools, "tool_choice": "auto", "stream": True,
         "stream_options": {"include_usage": True}, "max_completion_tokens": 64},
        {"model": "m", "messages": messages[:2], "temperature": 0.7, "top_p": 0.9, "top_k": 40,
         "min_p": 0.05, "seed": -3, "stop": ["\n\n", "END"], "logprobs": True,
         "top_logprobs": 5, "logit_bias": {"12": -100, "7": 2.5}, "n": 1},
        {"messages": messages[:2], "repetition_penalty": 1.1, "repetition_context_size": 64,
         "presence_penalty": 0.5, "frequency_penalty": -0.5, "xtc_probability": 0.5,
         "xtc_threshold": 0.1, "chat_template_kwargs": {"enable_thinking": False},
         "adapters": "a", "role_mapping": {"user": "U: "}},
        {"prompt": "Once upon a time", "max_tokens": 16, "logprobs": 3, "stop": "."},
        {"prompt": [1, 2, 3, 4294967295], "temperature": 0, "echo": False},
        {"prompt": ["one string"], "stream": False, "temperature": None},
    ]:
        write(corpus_root / "request", json.dumps(body).encode())

    # Mode byte: format (none, Hermes, Qwen3-Coder, Llama 3, Gemma 4) + 5 × reasoning markers
    # (none, <think>, Gemma 4's channel, <|open|>) + 20 × starts inside reasoning.
    for mode, text in [
        (0, "Plain text with <tool_call> but no tools."),
        (5, "<think>Let me see.</think>The answer is 4."),
        (25, "still thinking</think>done"),
        (1, "Checking.\n<tool_call>\n{\"name\": \"f\", \"arguments\": {\"s\": \"Paris\"}}\n"
            "</tool_call>"),
        (6, "<think>hm</think><tool_call>[{\"name\": \"a\", \"arguments\": {}}, "
            "{\"name\": \"b\", \"arguments\": \"{\\\"x\\\":1}\"}]</tool_call> <tool_call>{\"na"),
        (2, "<tool_call>\n<function=f>\n<parameter=s>\nParis\n</parameter>\n<parameter=n>\n3\n"
            "</parameter>\n<parameter=b>\nTrue\n</parameter>\n<parameter=o>\n{\"k\": [1]}\n"
            "</parameter>\n</function>\n</tool_call>"),
        (3, "<|python_tag|>{\"name\": \"f\", \"parameters\": {\"s\": \"x\"}}; "
            "{\"name\": \"g\", \"parameters\": {}}"),
        (3, "  [{\"name\": \"f\", \"arguments\": {\"n\": 1}}]"),
        (3, "Not a call {\"name\": \"f\"}"),
        (14, "<|channel>thought I should call.<channel|><|tool_call>call:f{s:<|\"|>a, b<|\"|>,"
             "n:3,o:{k:[1,true,null,{x:-2.5e3}]}}<tool_call|>call:g{}"),
        (19, "<|open|>think<|sep|>why<|close|>think<|sep|>because"),
    ]:
        for seed in (0, 7):
            write(corpus_root / "tool_calls", bytes([mode, seed]) + text.encode())


if __name__ == "__main__":
    main(Path(sys.argv[1]))
