//! Model output to OpenAI message fields: reasoning (`<think>…</think>`) to
//! `reasoning_content`, native tool-call markup to `tool_calls`, the rest to `content`.
//!
//! As mlx_lm.server's `TextStateMachine`, markers are matched on decoded text, so they are found
//! whatever tokens spell them, and text that may be the start of a marker is held back until it
//! is known not to be. Tool-call formats, chosen from the chat template as mlx-lm's
//! `_infer_tool_parser` does:
//! - Hermes / Qwen 2.5 / SmolLM3 (`json_tools`): `<tool_call>{"name": …, "arguments": {…}}</tool_call>`,
//!   also a JSON list of calls inside one block (SmolLM2);
//! - Qwen3-Coder / Qwen 3.5 (`qwen3_coder`): `<tool_call><function=NAME><parameter=P>value</parameter>…`;
//! - Gemma 4 (`gemma4`): `<|tool_call>call:NAME{key:value,…}<tool_call|>`, strings between `<|"|>`
//!   marks, keys bare; its reasoning channel `<|channel>thought…<channel|>` is reasoning;
//! - MiniCPM5 (`minicpm5`): `<function name="NAME"><param name="P">value</param>…</function>`,
//!   no block around the calls;
//! - Mistral (`mistral`): `[TOOL_CALLS]` then, to the end of the reply, a JSON list of calls
//!   (Nemo, Small 3.1) or `NAME[ARGS]{…}` per call, each after its own `[TOOL_CALLS]` (Small 3.2,
//!   Magistral, Devstral);
//! - Llama 3.x: the whole reply is `{"name": …, "parameters": {…}}` (or several, `;`-separated),
//!   optionally after `<|python_tag|>`;
//! - pythonic (vLLM's pythonic templates for Llama 3.2, Llama 4 and Gemma 3): the whole reply
//!   is `[NAME(key=value, …), …]`, values Python literals;
//! - harmony (gpt-oss): messages on channels, reasoning, answer and calls alike (see
//!   [`crate::harmony`]); its parser reads every reply, tools or not.
//!
//! The last two have no markers: a reply that starts like their calls is held until it ends,
//! then becomes tool calls if it parses as such, else content.

use rand::Rng;
use serde_json::{Map, Value};

use crate::harmony::HarmonyParser;

/// How a model writes tool calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ToolFormat {
    /// Also what templates that name no format get.
    #[default]
    Hermes,
    Qwen3Coder,
    Llama3Json,
    Gemma4,
    MiniCpm5,
    /// `[TOOL_CALLS][{"name": …, "arguments": {…}}, …]` (Mistral Nemo, Small 3.1).
    MistralJson,
    /// `[TOOL_CALLS]NAME[ARGS]{…}` (Mistral Small 3.2, Magistral, Devstral, Ministral 3).
    MistralArgs,
    Pythonic,
    /// OpenAI's harmony (gpt-oss):
    /// `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{…}`.
    Harmony,
}

const TOOL_START: &str = "<tool_call>";
const TOOL_END: &str = "</tool_call>";
const GEMMA4_TOOL_START: &str = "<|tool_call>";
const GEMMA4_TOOL_END: &str = "<tool_call|>";
/// Gemma 4's string quote.
const GEMMA4_QUOTE: &str = "<|\"|>";
const PYTHON_TAG: &str = "<|python_tag|>";
/// MiniCPM5's calls: mlx-lm's markers, the name and parameters in between.
const MINICPM5_TOOL_START: &str = "<function name=";
const MINICPM5_TOOL_END: &str = "</function>";
const MISTRAL_TOOL_CALLS: &str = "[TOOL_CALLS]";
const MISTRAL_ARGS: &str = "[ARGS]";
/// Mistral Small 3.2 writes the call's id between its name and `[ARGS]`.
const MISTRAL_CALL_ID: &str = "[CALL_ID]";
/// Where the pythonic templates (vLLM's) show the form of the calls they ask for.
const PYTHONIC_INSTRUCTION: &str = "[func_name1(params_name1=params_value1";

impl ToolFormat {
    /// A new id for a call, `prefix` and random hex (`call_…`, Anthropic's `toolu_…`); Mistral's
    /// templates refuse any id but nine letters and digits, which the call's result must carry
    /// back in the next turn.
    pub fn call_id(self, prefix: &str) -> String {
        match self {
            ToolFormat::MistralJson | ToolFormat::MistralArgs => (0..9)
                .map(|_| char::from(rand::rng().sample(rand::distr::Alphanumeric)))
                .collect(),
            _ => crate::api::prefixed_id(prefix),
        }
    }

    /// The format a chat template asks for. Templates that name none get Hermes, the most
    /// common (a `<tool_call>` in the reply of a model that never saw one is still a call).
    pub fn from_template<'a>(sources: impl IntoIterator<Item = &'a str>) -> Self {
        let sources: Vec<&str> = sources.into_iter().collect();
        let any = |needle: &str| sources.iter().any(|s| s.contains(needle));
        if any(crate::harmony::CHANNEL) && any(crate::harmony::MESSAGE) {
            ToolFormat::Harmony
        } else if any(GEMMA4_TOOL_START) && any(GEMMA4_TOOL_END) {
            ToolFormat::Gemma4
        } else if any("<tool_call>\n<function=") || any("<tool_call>\\n<function=") {
            ToolFormat::Qwen3Coder
        } else if any("<function name=\"") && any("<param name=\"") {
            ToolFormat::MiniCpm5
        } else if any(MISTRAL_TOOL_CALLS) {
            if any(MISTRAL_ARGS) {
                ToolFormat::MistralArgs
            } else {
                ToolFormat::MistralJson
            }
        } else if any(TOOL_START) {
            ToolFormat::Hermes
        } else if any(PYTHONIC_INSTRUCTION) {
            ToolFormat::Pythonic
        } else if any(PYTHON_TAG) || any("respond with a JSON for a function call") {
            ToolFormat::Llama3Json
        } else {
            ToolFormat::Hermes
        }
    }

    /// The markers around a call block; an empty end: the block runs to the end of the reply.
    /// The formats whose calls are the whole reply have none.
    fn markers(self) -> Option<(&'static str, &'static str)> {
        match self {
            ToolFormat::Hermes | ToolFormat::Qwen3Coder => Some((TOOL_START, TOOL_END)),
            ToolFormat::Gemma4 => Some((GEMMA4_TOOL_START, GEMMA4_TOOL_END)),
            ToolFormat::MiniCpm5 => Some((MINICPM5_TOOL_START, MINICPM5_TOOL_END)),
            ToolFormat::MistralJson | ToolFormat::MistralArgs => Some((MISTRAL_TOOL_CALLS, "")),
            ToolFormat::Llama3Json | ToolFormat::Pythonic | ToolFormat::Harmony => None,
        }
    }

    /// How a reply that may be calls of a format without markers starts.
    fn bare_openers(self) -> &'static [&'static str] {
        match self {
            ToolFormat::Llama3Json => &["{", "[", PYTHON_TAG],
            ToolFormat::Pythonic => &["["],
            _ => &[],
        }
    }
}

/// A parsed call; `arguments` is JSON text, as the OpenAI API sends it.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCall {
    pub name: String,
    pub arguments: String,
}

/// A piece of a reply, in order.
#[derive(Debug, Clone, PartialEq)]
pub enum Piece {
    Content(String),
    Reasoning(String),
    ToolCall(ToolCall),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Content,
    Reasoning,
    Tool,
    /// A reply that may be calls of a format without markers, held until the end.
    MaybeCalls,
}

/// Splits streamed model output into [`Piece`]s; see the module docs.
#[derive(Debug, Clone)]
pub struct OutputParser {
    /// Harmony replies have a parser of their own.
    harmony: Option<HarmonyParser>,
    think: Option<(String, String)>,
    tools: Option<(ToolFormat, Value)>,
    state: State,
    /// Received text not yet given out: a possible start of a marker.
    pending: String,
    /// The body of the tool call (or the reply that may be calls) being read.
    call: String,
    /// Whether any content has been given out (calls without markers are only at the start).
    started: bool,
}

impl OutputParser {
    /// `think`: the reasoning markers, when the model has them; `in_reasoning`: the prompt left
    /// a reasoning block open (a template that starts the reply with `<think>`). `tools`: the
    /// format and the request's tool list, when the request offers tools.
    pub fn new(
        think: Option<(&str, &str)>,
        in_reasoning: bool,
        tools: Option<(ToolFormat, Value)>,
    ) -> Self {
        let harmony = match &tools {
            Some((ToolFormat::Harmony, tools)) => Some(HarmonyParser::new(Some(tools))),
            _ => None,
        };
        OutputParser {
            harmony,
            state: if in_reasoning && think.is_some() {
                State::Reasoning
            } else {
                State::Content
            },
            think: think.map(|(s, e)| (s.to_owned(), e.to_owned())),
            tools,
            pending: String::new(),
            call: String::new(),
            started: false,
        }
    }

    /// The parser of a model whose tool format is `format`, for a request with `tools` (see
    /// [`new`](Self::new)); a harmony model's replies are read as harmony, tools or not.
    pub fn for_model(
        format: ToolFormat,
        think: Option<(&str, &str)>,
        in_reasoning: bool,
        tools: Option<Value>,
    ) -> Self {
        let harmony = (format == ToolFormat::Harmony).then(|| HarmonyParser::new(tools.as_ref()));
        let mut parser = Self::new(think, in_reasoning, tools.map(|t| (format, t)));
        parser.harmony = harmony;
        parser
    }

    /// Adds decoded text; returns what is known so far.
    pub fn push(&mut self, text: &str) -> Vec<Piece> {
        if let Some(harmony) = &mut self.harmony {
            return harmony.push(text);
        }
        self.pending.push_str(text);
        let mut out = Vec::new();
        loop {
            if self.state == State::Content && !self.started && !self.check_bare_start() {
                return out;
            }
            if self.state == State::MaybeCalls {
                self.call.push_str(&std::mem::take(&mut self.pending));
                return out;
            }
            let markers = self.markers();
            let found = markers
                .iter()
                .filter_map(|(m, next)| Some((self.pending.find(m.as_str())?, m.len(), *next)))
                .min_by_key(|(at, _, _)| *at);
            match found {
                Some((at, len, next)) => {
                    let before = self.pending[..at].to_owned();
                    self.pending.drain(..at + len);
                    self.emit(before, &mut out);
                    if self.state == State::Tool {
                        self.end_call(&mut out, true);
                    }
                    self.state = next;
                }
                None => {
                    let keep = partial_suffix(&self.pending, markers.iter().map(|(m, _)| m));
                    let split = self.pending.len() - keep;
                    let safe: String = self.pending.drain(..split).collect();
                    self.emit(safe, &mut out);
                    return out;
                }
            }
        }
    }

    /// Ends the reply: held-back text is given out, an unfinished call parsed if it can be.
    pub fn finish(&mut self) -> Vec<Piece> {
        if let Some(harmony) = &mut self.harmony {
            return harmony.finish();
        }
        let mut out = Vec::new();
        let rest = std::mem::take(&mut self.pending);
        match self.state {
            State::Tool => {
                self.call.push_str(&rest);
                self.end_call(&mut out, false);
            }
            State::MaybeCalls => {
                let text = std::mem::take(&mut self.call) + &rest;
                let calls = match self.format() {
                    Some(ToolFormat::Pythonic) => parse_pythonic_calls(&text),
                    _ => parse_llama_calls(text.trim_start().trim_start_matches(PYTHON_TAG)),
                };
                match calls {
                    Some(calls) => out.extend(calls.into_iter().map(Piece::ToolCall)),
                    None => out.push(Piece::Content(text)),
                }
            }
            _ => {
                self.started = true;
                self.emit(rest, &mut out);
            }
        }
        self.state = State::Content;
        out
    }

    /// The markers that end the current state, with the state each leads to.
    fn markers(&self) -> Vec<(String, State)> {
        let mut markers = Vec::new();
        let tool_markers = self.tool_markers();
        match self.state {
            State::Content => {
                if let Some((start, _)) = &self.think {
                    markers.push((start.clone(), State::Reasoning));
                }
                if let Some((start, _)) = tool_markers {
                    markers.push((start.to_owned(), State::Tool));
                }
            }
            State::Reasoning => {
                if let Some((_, end)) = &self.think {
                    markers.push((end.clone(), State::Content));
                }
                if let Some((start, _)) = tool_markers {
                    markers.push((start.to_owned(), State::Tool));
                }
            }
            State::Tool => {
                if let Some((_, end)) = tool_markers.filter(|(_, end)| !end.is_empty()) {
                    markers.push((end.to_owned(), State::Content));
                }
            }
            State::MaybeCalls => {}
        }
        markers
    }

    fn format(&self) -> Option<ToolFormat> {
        self.tools.as_ref().map(|(format, _)| *format)
    }

    /// The call block markers of the request's format, when it offers tools.
    fn tool_markers(&self) -> Option<(&'static str, &'static str)> {
        self.format().and_then(ToolFormat::markers)
    }

    /// Formats without markers: a reply that opens like their calls may be calls. False while
    /// the start of the reply cannot tell yet.
    fn check_bare_start(&mut self) -> bool {
        let openers = self.format().map_or(&[][..], ToolFormat::bare_openers);
        if openers.is_empty() {
            return true;
        }
        let head = self.pending.trim_start();
        if openers.iter().any(|o| head.starts_with(o)) {
            self.state = State::MaybeCalls;
        } else if head.is_empty() || openers.iter().any(|o| o.starts_with(head)) {
            return false;
        } else {
            self.started = true;
        }
        true
    }

    fn emit(&mut self, text: String, out: &mut Vec<Piece>) {
        if text.is_empty() {
            return;
        }
        match self.state {
            State::Content => {
                self.started = true;
                match out.last_mut() {
                    Some(Piece::Content(c)) => c.push_str(&text),
                    _ => out.push(Piece::Content(text)),
                }
            }
            State::Reasoning => match out.last_mut() {
                Some(Piece::Reasoning(r)) => r.push_str(&text),
                _ => out.push(Piece::Reasoning(text)),
            },
            State::Tool | State::MaybeCalls => self.call.push_str(&text),
        }
    }

    /// A tool-call block ended (`closed`) or the reply did: parse it, or give it back as
    /// content when it is not a call.
    fn end_call(&mut self, out: &mut Vec<Piece>, closed: bool) {
        let body = std::mem::take(&mut self.call);
        let calls = match &self.tools {
            Some((ToolFormat::Qwen3Coder, tools)) => {
                parse_qwen3_coder(&body, tools).map(|c| vec![c])
            }
            Some((ToolFormat::MiniCpm5, tools)) => parse_minicpm5(&body, tools).map(|c| vec![c]),
            Some((ToolFormat::Gemma4, _)) => parse_gemma4_calls(&body),
            Some((ToolFormat::MistralJson | ToolFormat::MistralArgs, _)) => {
                parse_mistral_calls(&body)
            }
            Some(_) => parse_json_calls(&body),
            None => None,
        };
        match calls {
            Some(calls) => out.extend(calls.into_iter().map(Piece::ToolCall)),
            None => {
                let (start, end) = self.tool_markers().unwrap_or_default();
                let end = if closed { end } else { "" };
                out.push(Piece::Content(format!("{start}{body}{end}")));
            }
        }
        self.started = true;
    }
}

/// The longest end of `text` that is a proper start of one of `markers`.
pub(crate) fn partial_suffix<S: AsRef<str>>(text: &str, markers: impl Iterator<Item = S>) -> usize {
    markers
        .map(|m| {
            let m = m.as_ref();
            (1..m.len().min(text.len() + 1))
                .rev()
                .filter(|&n| m.is_char_boundary(n))
                .find(|&n| text.ends_with(&m[..n]))
                .unwrap_or(0)
        })
        .max()
        .unwrap_or(0)
}

/// Call arguments as JSON text: a string as it is (templates that render arguments as JSON
/// text), anything else written out, none an empty object.
fn arguments_text(arguments: Option<&Value>) -> String {
    match arguments {
        Some(Value::String(text)) => text.clone(),
        Some(args) => args.to_string(),
        None => "{}".to_owned(),
    }
}

/// One call from `{"name": …, "arguments"|"parameters": …}`.
fn json_call(value: &Value) -> Option<ToolCall> {
    let name = value.get("name")?.as_str()?.to_owned();
    let arguments = arguments_text(value.get("arguments").or_else(|| value.get("parameters")));
    Some(ToolCall { name, arguments })
}

/// mlx-lm `json_tools`: one call object, or a list of them.
pub fn parse_json_calls(body: &str) -> Option<Vec<ToolCall>> {
    match serde_json::from_str(body.trim()).ok()? {
        Value::Array(list) if !list.is_empty() => list.iter().map(json_call).collect(),
        value => json_call(&value).map(|c| vec![c]),
    }
}

/// Llama 3.x: one call object, a list, or objects separated by `;`.
pub fn parse_llama_calls(body: &str) -> Option<Vec<ToolCall>> {
    parse_json_calls(body).or_else(|| {
        let calls = body
            .split(';')
            .filter(|part| !part.trim().is_empty())
            .map(|part| json_call(&serde_json::from_str(part.trim()).ok()?))
            .collect::<Option<Vec<_>>>()?;
        (!calls.is_empty()).then_some(calls)
    })
}

/// The `properties` of the parameter schema of the tool `name` in `tools`.
fn tool_properties<'a>(tools: &'a Value, name: &str) -> Option<&'a Value> {
    tools.as_array()?.iter().find_map(|t| {
        let f = t.get("function")?;
        (f.get("name")?.as_str()? == name).then(|| f.pointer("/parameters/properties"))?
    })
}

/// mlx-lm `qwen3_coder`: `<function=NAME>` then `<parameter=P>value</parameter>` entries, each
/// value typed by the tool's JSON schema (strings stay strings; other types parse as JSON
/// where they can).
pub fn parse_qwen3_coder(body: &str, tools: &Value) -> Option<ToolCall> {
    let start = body.find("<function=")? + "<function=".len();
    let end = body.rfind("</function>")?;
    let function = body.get(start..end)?;
    let name_end = function.find('>')?;
    let name = function[..name_end].trim().to_owned();
    let schema = tool_properties(tools, &name);
    let mut arguments = Map::new();
    let mut rest = &function[name_end + 1..];
    while let Some(open) = rest.find("<parameter=") {
        rest = &rest[open + "<parameter=".len()..];
        let name_end = rest.find('>')?;
        let param = rest[..name_end].trim().to_owned();
        let value_end = rest.find("</parameter>")?;
        let raw = rest.get(name_end + 1..value_end)?;
        let raw = raw.strip_prefix('\n').unwrap_or(raw);
        let raw = raw.strip_suffix('\n').unwrap_or(raw);
        let kind = schema
            .and_then(|s| s.get(&param)?.get("type")?.as_str())
            .map(str::to_lowercase);
        arguments.insert(param, typed_value(raw, kind.as_deref()));
        rest = &rest[value_end + "</parameter>".len()..];
    }
    Some(ToolCall {
        name,
        arguments: Value::Object(arguments).to_string(),
    })
}

/// mlx-lm `minicpm5`: what follows `<function name=` in a call, `"NAME">` then
/// `<param name="P">value</param>` entries; a value in `<![CDATA[…]]>` is kept as it is, any
/// other trimmed, then typed by the tool's JSON schema (see [`schema_typed_value`]).
pub fn parse_minicpm5(body: &str, tools: &Value) -> Option<ToolCall> {
    let (name, mut rest) = attribute_value(body)?;
    let schema = tool_properties(tools, name);
    let mut arguments = Map::new();
    while let Some(open) = rest.find("<param") {
        let attribute = rest[open + "<param".len()..]
            .strip_prefix(char::is_whitespace)?
            .trim_start()
            .strip_prefix("name")?
            .trim_start()
            .strip_prefix('=')?;
        let (param, value) = attribute_value(attribute)?;
        let (raw, after) = value.split_once("</param>")?;
        let raw = raw
            .trim()
            .strip_prefix("<![CDATA[")
            .and_then(|cdata| cdata.strip_suffix("]]>"))
            .unwrap_or(raw.trim());
        let value = schema_typed_value(raw, schema.and_then(|s| s.get(param)));
        arguments.insert(param.to_owned(), value);
        rest = after;
    }
    Some(ToolCall {
        name: name.to_owned(),
        arguments: Value::Object(arguments).to_string(),
    })
}

/// An XML attribute's value (`"…"`, `'…'` or bare) and the `>` that ends the tag: the value
/// and the text after the tag.
fn attribute_value(text: &str) -> Option<(&str, &str)> {
    let text = text.trim_start();
    let (value, rest) = match text.chars().next()? {
        quote @ ('"' | '\'') => text[1..].split_once(quote)?,
        _ => {
            let end = text
                .find(|c: char| c.is_whitespace() || "\"'<>".contains(c))
                .unwrap_or(text.len());
            text.split_at(end)
        }
    };
    let rest = rest.trim_start().strip_prefix('>')?;
    (!value.is_empty()).then_some((value, rest))
}

/// mlx-lm `mistral`: what follows `[TOOL_CALLS]`, a JSON list of calls, or `NAME[ARGS]{…}` with
/// any further call after its own `[TOOL_CALLS]` (Small 3.2 also writes `[CALL_ID]ID` before
/// `[ARGS]`). A call's arguments are the one JSON value after `[ARGS]`, as mlx-lm reads them;
/// other text after the last call makes the whole no call (mlx-lm would drop that text).
pub fn parse_mistral_calls(body: &str) -> Option<Vec<ToolCall>> {
    let mut rest = body.trim();
    if rest.starts_with('[') {
        return match serde_json::from_str(rest).ok()? {
            Value::Array(list) if !list.is_empty() => list.iter().map(json_call).collect(),
            _ => None,
        };
    }
    let mut calls = Vec::new();
    loop {
        let (header, after) = rest.split_once(MISTRAL_ARGS)?;
        let name = header
            .split_once(MISTRAL_CALL_ID)
            .map_or(header, |(name, _id)| name);
        let name = name.trim();
        if name.is_empty() || !name.chars().all(is_name_char) {
            return None;
        }
        let mut values = serde_json::Deserializer::from_str(after).into_iter::<Value>();
        let arguments = values.next()?.ok()?;
        calls.push(ToolCall {
            name: name.to_owned(),
            arguments: arguments_text(Some(&arguments)),
        });
        rest = after[values.byte_offset()..].trim_start();
        if rest.is_empty() {
            return Some(calls);
        }
        rest = rest.strip_prefix(MISTRAL_TOOL_CALLS)?;
    }
}

/// A character of a tool name, as mlx-lm's parsers read names (`[\w-]`).
fn is_name_char(c: char) -> bool {
    c.is_alphanumeric() || c == '_' || c == '-'
}

/// mlx-lm `gemma4`: every `call:NAME{…}` in a block, the braces holding Gemma 4's argument
/// notation (see [`Gemma4Args`]).
pub fn parse_gemma4_calls(body: &str) -> Option<Vec<ToolCall>> {
    let mut calls = Vec::new();
    let mut rest = body;
    while let Some(at) = rest.find("call:") {
        rest = &rest[at + "call:".len()..];
        let name_end = rest.find(|c: char| !is_name_char(c)).unwrap_or(rest.len());
        let (name, args) = rest.split_at(name_end);
        if name.is_empty() || !args.starts_with('{') {
            return None;
        }
        let mut reader = Gemma4Args(args);
        let arguments = reader.value(0)?;
        calls.push(ToolCall {
            name: name.to_owned(),
            arguments: arguments.to_string(),
        });
        rest = reader.0;
    }
    (!calls.is_empty()).then_some(calls)
}

/// How deep call arguments may nest, about as deep as serde_json reads JSON: each level is a
/// frame of a reader's `value`, and a reply of 100,000 `[`s would overflow the thread's stack.
const MAX_ARGUMENT_DEPTH: usize = 128;

/// Skips blanks at the start of `text`, then `c` if it comes next.
fn eat(text: &mut &str, c: char) -> bool {
    *text = text.trim_start();
    match text.strip_prefix(c) {
        Some(rest) => {
            *text = rest;
            true
        }
        None => false,
    }
}

/// A reader of Gemma 4's argument notation, as its chat template writes it: objects with bare
/// (or quoted) keys, lists, strings between `<|"|>` marks, and JSON's numbers, `true`, `false`
/// and `null`. Holds the text not read yet.
struct Gemma4Args<'a>(&'a str);

impl Gemma4Args<'_> {
    fn value(&mut self, depth: usize) -> Option<Value> {
        if depth > MAX_ARGUMENT_DEPTH {
            return None;
        }
        self.0 = self.0.trim_start();
        if self.0.starts_with(GEMMA4_QUOTE) {
            return self.string().map(Value::String);
        }
        if eat(&mut self.0, '{') {
            let mut object = Map::new();
            if eat(&mut self.0, '}') {
                return Some(Value::Object(object));
            }
            loop {
                let key = self.key()?;
                if !eat(&mut self.0, ':') {
                    return None;
                }
                object.insert(key, self.value(depth + 1)?);
                if eat(&mut self.0, '}') {
                    return Some(Value::Object(object));
                }
                if !eat(&mut self.0, ',') {
                    return None;
                }
            }
        }
        if eat(&mut self.0, '[') {
            let mut list = Vec::new();
            if eat(&mut self.0, ']') {
                return Some(Value::Array(list));
            }
            loop {
                list.push(self.value(depth + 1)?);
                if eat(&mut self.0, ']') {
                    return Some(Value::Array(list));
                }
                if !eat(&mut self.0, ',') {
                    return None;
                }
            }
        }
        let end = self.0.find([',', '}', ']']).unwrap_or(self.0.len());
        let (scalar, rest) = self.0.split_at(end);
        self.0 = rest;
        match serde_json::from_str(scalar.trim()).ok()? {
            scalar @ (Value::Number(_) | Value::Bool(_) | Value::Null) => Some(scalar),
            _ => None,
        }
    }

    /// `<|"|>text<|"|>`, the text kept as it is.
    fn string(&mut self) -> Option<String> {
        let rest = self.0.strip_prefix(GEMMA4_QUOTE)?;
        let end = rest.find(GEMMA4_QUOTE)?;
        self.0 = &rest[end + GEMMA4_QUOTE.len()..];
        Some(rest[..end].to_owned())
    }

    fn key(&mut self) -> Option<String> {
        self.0 = self.0.trim_start();
        if self.0.starts_with(GEMMA4_QUOTE) {
            return self.string();
        }
        let end = self.0.find(|c: char| !is_name_char(c))?;
        let (key, rest) = self.0.split_at(end);
        self.0 = rest;
        (!key.is_empty()).then(|| key.to_owned())
    }
}

/// Pythonic calls: `[NAME(key=value, …), …]` and nothing after, as mlx-lm's `pythonic` reads
/// them (through Python's `ast`): names may be dotted, arguments are keywords, values Python
/// literals (see [`PythonLiteral`]).
pub fn parse_pythonic_calls(text: &str) -> Option<Vec<ToolCall>> {
    let mut reader = PythonLiteral(text);
    let mut calls = Vec::new();
    if !eat(&mut reader.0, '[') {
        return None;
    }
    loop {
        calls.push(reader.call()?);
        if eat(&mut reader.0, ']') {
            break;
        }
        if !eat(&mut reader.0, ',') {
            return None;
        }
        // A trailing comma.
        if eat(&mut reader.0, ']') {
            break;
        }
    }
    reader.0.trim().is_empty().then_some(calls)
}

/// A reader of Python literals, as `ast.literal_eval` takes them and `json.dumps` writes them:
/// strings (either quote, tripled or not, with Python's escapes), numbers, `True`/`False`/`None`
/// (and JSON's `true`/`false`/`null`, which templates write inside containers), lists, tuples
/// (as lists) and dicts (keys written as JSON writes them). Holds the text not read yet.
struct PythonLiteral<'a>(&'a str);

impl<'a> PythonLiteral<'a> {
    /// `NAME(key=value, …)`; a repeated key keeps its last value.
    fn call(&mut self) -> Option<ToolCall> {
        let mut name = self.identifier()?.to_owned();
        while eat(&mut self.0, '.') {
            name.push('.');
            name.push_str(self.identifier()?);
        }
        if !eat(&mut self.0, '(') {
            return None;
        }
        let mut arguments = Map::new();
        while !eat(&mut self.0, ')') {
            let key = self.identifier()?;
            if !eat(&mut self.0, '=') {
                return None;
            }
            arguments.insert(key.to_owned(), self.value(0)?);
            if !eat(&mut self.0, ',') && !self.0.starts_with(')') {
                return None;
            }
        }
        Some(ToolCall {
            name,
            arguments: Value::Object(arguments).to_string(),
        })
    }

    fn identifier(&mut self) -> Option<&'a str> {
        self.0 = self.0.trim_start();
        let end = self
            .0
            .find(|c: char| !(c.is_alphanumeric() || c == '_'))
            .unwrap_or(self.0.len());
        let (name, rest) = self.0.split_at(end);
        if name.is_empty() || name.starts_with(|c: char| c.is_ascii_digit()) {
            return None;
        }
        self.0 = rest;
        Some(name)
    }

    fn value(&mut self, depth: usize) -> Option<Value> {
        if depth > MAX_ARGUMENT_DEPTH {
            return None;
        }
        self.0 = self.0.trim_start();
        if self.0.starts_with(['"', '\'']) {
            return self.string().map(Value::String);
        }
        if eat(&mut self.0, '[') {
            return self.items(']', depth).map(|(items, _)| Value::Array(items));
        }
        if eat(&mut self.0, '(') {
            // `(x)` is x; `(x,)` and `()` are tuples.
            return match self.items(')', depth)? {
                (mut items, false) if items.len() == 1 => items.pop(),
                (items, _) => Some(Value::Array(items)),
            };
        }
        if eat(&mut self.0, '{') {
            return self.dict(depth);
        }
        self.scalar()
    }

    /// Values up to `close`, comma-separated; whether a comma (or nothing) came before it.
    fn items(&mut self, close: char, depth: usize) -> Option<(Vec<Value>, bool)> {
        let mut items = Vec::new();
        loop {
            if eat(&mut self.0, close) {
                return Some((items, true));
            }
            items.push(self.value(depth + 1)?);
            if eat(&mut self.0, close) {
                return Some((items, false));
            }
            if !eat(&mut self.0, ',') {
                return None;
            }
        }
    }

    /// The rest of `{key: value, …}`.
    fn dict(&mut self, depth: usize) -> Option<Value> {
        let mut object = Map::new();
        loop {
            if eat(&mut self.0, '}') {
                return Some(Value::Object(object));
            }
            let key = match self.value(depth + 1)? {
                Value::String(key) => key,
                key @ (Value::Number(_) | Value::Bool(_) | Value::Null) => key.to_string(),
                _ => return None,
            };
            if !eat(&mut self.0, ':') {
                return None;
            }
            object.insert(key, self.value(depth + 1)?);
            if !eat(&mut self.0, ',') && !self.0.starts_with('}') {
                return None;
            }
        }
    }

    /// A number or one of the constants.
    fn scalar(&mut self) -> Option<Value> {
        let end = self
            .0
            .find(|c: char| !(c.is_alphanumeric() || "_.+-".contains(c)))
            .unwrap_or(self.0.len());
        let (token, rest) = self.0.split_at(end);
        self.0 = rest;
        match token {
            "True" | "true" => return Some(Value::Bool(true)),
            "False" | "false" => return Some(Value::Bool(false)),
            "None" | "null" => return Some(Value::Null),
            _ => {}
        }
        // Python's `1_000`, `+1`, `1.` and `.5` in JSON's spelling.
        let number = token.replace('_', "");
        let number = number.strip_prefix('+').unwrap_or(&number);
        let (sign, unsigned) = match number.strip_prefix('-') {
            Some(unsigned) => ("-", unsigned),
            None => ("", number),
        };
        let (mantissa, exponent) = match unsigned.find(['e', 'E']) {
            Some(at) => unsigned.split_at(at),
            None => (unsigned, ""),
        };
        let mantissa = match (mantissa.starts_with('.'), mantissa.ends_with('.')) {
            (true, _) => format!("0{mantissa}"),
            (_, true) => format!("{mantissa}0"),
            _ => mantissa.to_owned(),
        };
        match serde_json::from_str(&format!("{sign}{mantissa}{exponent}")).ok()? {
            number @ Value::Number(_) => Some(number),
            _ => None,
        }
    }

    /// A string literal, its escapes read as Python reads them.
    fn string(&mut self) -> Option<String> {
        let quote = ["\"\"\"", "'''", "\"", "'"]
            .into_iter()
            .find(|q| self.0.starts_with(q))?;
        let mut rest = &self.0[quote.len()..];
        let mut text = String::new();
        loop {
            if let Some(after) = rest.strip_prefix(quote) {
                self.0 = after;
                return Some(text);
            }
            let mut chars = rest.chars();
            match chars.next()? {
                '\\' => {
                    rest = python_escape(chars.as_str(), &mut text)?;
                    continue;
                }
                '\n' if quote.len() == 1 => return None,
                c => text.push(c),
            }
            rest = chars.as_str();
        }
    }
}

/// Reads the escape after a backslash in a Python string into `out`; the text after it. An
/// unknown escape keeps its backslash, as Python does; named ones (`\N{…}`) are not read.
fn python_escape<'t>(text: &'t str, out: &mut String) -> Option<&'t str> {
    let mut chars = text.chars();
    let escaped = chars.next()?;
    let rest = chars.as_str();
    match escaped {
        // A line continuation.
        '\n' => {}
        '\\' | '\'' | '"' => out.push(escaped),
        'a' => out.push('\x07'),
        'b' => out.push('\x08'),
        'f' => out.push('\x0c'),
        'n' => out.push('\n'),
        'r' => out.push('\r'),
        't' => out.push('\t'),
        'v' => out.push('\x0b'),
        'x' | 'u' | 'U' => {
            let digits = match escaped {
                'x' => 2,
                'u' => 4,
                _ => 8,
            };
            let hex = rest
                .get(..digits)
                .filter(|hex| hex.chars().all(|c| c.is_ascii_hexdigit()))?;
            out.push(char::from_u32(u32::from_str_radix(hex, 16).ok()?)?);
            return Some(&rest[digits..]);
        }
        '0'..='7' => {
            let more = rest.chars().take(2).take_while(|c| c.is_digit(8)).count();
            let octal = &text[..1 + more];
            out.push(char::from_u32(u32::from_str_radix(octal, 8).ok()?)?);
            return Some(&text[1 + more..]);
        }
        'N' => return None,
        _ => {
            out.push('\\');
            out.push(escaped);
        }
    }
    Some(rest)
}

/// `text` as one Python literal, nothing after it.
fn python_literal(text: &str) -> Option<Value> {
    let mut reader = PythonLiteral(text);
    let value = reader.value(0)?;
    reader.0.trim().is_empty().then_some(value)
}

/// A parameter value as mlx-lm's `minimax_m2` types it (`minicpm5` uses it): by the types the
/// parameter's JSON schema allows (see [`schema_types`]; a string where it names none), the
/// first of them in order of specificity that the text reads as, objects and lists as JSON or
/// else as Python literals (MiniCPM5's template writes values with Python's `str`: `True`,
/// `{'a': 1}`).
fn schema_typed_value(raw: &str, schema: Option<&Value>) -> Value {
    let lower = raw.to_lowercase();
    if lower == "null" {
        return Value::Null;
    }
    let mut types = Vec::new();
    if let Some(schema) = schema {
        schema_types(schema, &mut types);
    }
    if types.is_empty() {
        types.push("string".to_owned());
    }
    if types.iter().any(|t| t == "null") && (lower == "none" || lower == "nil") {
        return Value::Null;
    }
    const SPECIFIC_FIRST: [&str; 11] = [
        "integer", "int", "number", "float", "boolean", "bool", "object", "array", "string", "str",
        "text",
    ];
    for kind in SPECIFIC_FIRST
        .into_iter()
        .filter(|k| types.iter().any(|t| t == k))
    {
        let value = match kind {
            "string" | "str" | "text" => Some(Value::from(raw)),
            "integer" | "int" => raw.trim().parse::<i64>().ok().map(Value::from),
            "number" | "float" => raw
                .trim()
                .parse::<f64>()
                .ok()
                .filter(|n| n.is_finite())
                .map(|n| match n as i64 {
                    whole if whole as f64 == n => Value::from(whole),
                    _ => Value::from(n),
                }),
            "boolean" | "bool" => match lower.trim() {
                "true" | "1" | "yes" | "on" => Some(Value::Bool(true)),
                "false" | "0" | "no" | "off" => Some(Value::Bool(false)),
                _ => None,
            },
            _ => serde_json::from_str(raw)
                .ok()
                .or_else(|| python_literal(raw)),
        };
        if let Some(value) = value {
            return value;
        }
    }
    serde_json::from_str(raw).unwrap_or_else(|_| Value::from(raw))
}

/// The types `schema` allows, lowercased: its `type`s, its `enum` values' types, and those of
/// its `anyOf`/`oneOf`/`allOf` choices.
fn schema_types(schema: &Value, types: &mut Vec<String>) {
    match schema.get("type") {
        Some(Value::String(kind)) => types.push(kind.to_lowercase()),
        Some(Value::Array(kinds)) => types.extend(
            kinds
                .iter()
                .filter_map(Value::as_str)
                .map(str::to_lowercase),
        ),
        _ => {}
    }
    let values = schema.get("enum").and_then(Value::as_array);
    for value in values.into_iter().flatten() {
        let kind = match value {
            Value::Null => "null",
            Value::Bool(_) => "boolean",
            Value::Number(n) if n.is_f64() => "number",
            Value::Number(_) => "integer",
            Value::String(_) => "string",
            Value::Array(_) => "array",
            Value::Object(_) => "object",
        };
        types.push(kind.to_owned());
    }
    for key in ["anyOf", "oneOf", "allOf"] {
        let choices = schema.get(key).and_then(Value::as_array);
        for choice in choices.into_iter().flatten() {
            schema_types(choice, types);
        }
    }
}

fn typed_value(raw: &str, kind: Option<&str>) -> Value {
    if raw.eq_ignore_ascii_case("null") {
        return Value::Null;
    }
    match kind {
        Some("string" | "str" | "text" | "varchar" | "char" | "enum") => Value::from(raw),
        Some("boolean" | "bool" | "binary") => Value::from(raw.eq_ignore_ascii_case("true")),
        _ => serde_json::from_str(raw).unwrap_or_else(|_| Value::from(raw)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn tools() -> Value {
        json!([{"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}])
    }

    /// Feeds `pieces` one by one and merges adjacent pieces of one kind.
    fn run(parser: &mut OutputParser, pieces: &[&str]) -> Vec<Piece> {
        let mut out: Vec<Piece> = Vec::new();
        let mut all: Vec<Piece> = pieces.iter().flat_map(|p| parser.push(p)).collect();
        all.extend(parser.finish());
        for piece in all {
            match (out.last_mut(), piece) {
                (Some(Piece::Content(a)), Piece::Content(b)) => a.push_str(&b),
                (Some(Piece::Reasoning(a)), Piece::Reasoning(b)) => a.push_str(&b),
                (_, p) => out.push(p),
            }
        }
        out
    }

    fn call(name: &str, arguments: Value) -> Piece {
        Piece::ToolCall(ToolCall {
            name: name.into(),
            arguments: arguments.to_string(),
        })
    }

    #[test]
    fn formats_come_from_the_template() {
        let qwen25 = "{%- for tool in tools %}…<tool_call>\\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\\n</tool_call>{{ tool_call.name }}";
        assert_eq!(ToolFormat::from_template([qwen25]), ToolFormat::Hermes);
        let qwen35 =
            "<tool_call>\\n<function=example_function_name>\\n<parameter=example_parameter_1>";
        assert_eq!(ToolFormat::from_template([qwen35]), ToolFormat::Qwen3Coder);
        let llama = "{{- \"<|python_tag|>\" + tool_call.name }} Given the following functions, please respond with a JSON for a function call with its proper arguments";
        assert_eq!(ToolFormat::from_template([llama]), ToolFormat::Llama3Json);
        assert_eq!(
            ToolFormat::from_template(["<|im_start|>"]),
            ToolFormat::Hermes
        );
    }

    #[test]
    fn real_templates_choose_their_formats() {
        let cases = [
            (
                include_str!("../../../tests/fixtures/templates/minicpm5.jinja"),
                ToolFormat::MiniCpm5,
            ),
            (
                include_str!("../../../tests/fixtures/templates/mistral-nemo.jinja"),
                ToolFormat::MistralJson,
            ),
            (
                include_str!("../../../tests/fixtures/templates/mistral-small-3.2.jinja"),
                ToolFormat::MistralArgs,
            ),
            // Meta's own Llama 3.2 template asks for JSON; vLLM's pythonic one for a list of calls.
            (
                include_str!("../../../tests/fixtures/templates/llama-3.2.jinja"),
                ToolFormat::Llama3Json,
            ),
            (
                include_str!("../../../tests/fixtures/templates/llama-3.2-pythonic.jinja"),
                ToolFormat::Pythonic,
            ),
            (
                include_str!("../../../tests/fixtures/templates/gpt-oss.jinja"),
                ToolFormat::Harmony,
            ),
            // Gemma 4's channel markers are not harmony's.
            (
                include_str!("../../../tests/fixtures/templates/gemma4.jinja"),
                ToolFormat::Gemma4,
            ),
        ];
        for (template, format) in cases {
            assert_eq!(ToolFormat::from_template([template]), format);
        }
    }

    /// A harmony model's replies are harmony, tools or not; other models' are not.
    #[test]
    fn harmony_replies_with_and_without_tools() {
        let reply = "<|channel|>analysis<|message|>Hm.<|end|><|start|>assistant\
                     <|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>\
                     {\"city\":\"Paris\"}";
        let mut p = OutputParser::for_model(ToolFormat::Harmony, None, false, Some(tools()));
        assert_eq!(
            run(&mut p, &[reply]),
            [
                Piece::Reasoning("Hm.".into()),
                call("get_weather", json!({"city": "Paris"}))
            ]
        );
        let mut p = OutputParser::for_model(ToolFormat::Harmony, None, false, None);
        let answer = "<|channel|>analysis<|message|>Hm.<|end|><|start|>assistant<|channel|>final<|message|>Hi.";
        assert_eq!(
            run(&mut p, &[answer]),
            [Piece::Reasoning("Hm.".into()), Piece::Content("Hi.".into())]
        );
        let mut p = OutputParser::for_model(ToolFormat::Hermes, None, false, None);
        assert_eq!(run(&mut p, &[answer]), [Piece::Content(answer.into())]);
    }

    #[test]
    fn hermes_calls_split_across_tokens() {
        let mut p = OutputParser::new(None, false, Some((ToolFormat::Hermes, tools())));
        let out = run(
            &mut p,
            &[
                "Let me check.\n<tool",
                "_call>\n{\"name\": \"get_weather\", ",
                "\"arguments\": {\"city\": \"Paris\", \"days\": 2}}\n</tool_",
                "call>",
            ],
        );
        assert_eq!(
            out,
            [
                Piece::Content("Let me check.\n".into()),
                call("get_weather", json!({"city": "Paris", "days": 2}))
            ]
        );
    }

    #[test]
    fn hermes_lists_and_several_blocks() {
        let mut p = OutputParser::new(None, false, Some((ToolFormat::Hermes, tools())));
        let text = "<tool_call>[{\"name\": \"a\", \"arguments\": {}}, {\"name\": \"b\", \"arguments\": \"{\\\"x\\\":1}\"}]</tool_call>\n<tool_call>{\"name\": \"c\"}</tool_call>";
        let out = run(&mut p, &[text]);
        assert_eq!(
            out,
            [
                call("a", json!({})),
                call("b", json!({"x": 1})),
                Piece::Content("\n".into()),
                call("c", json!({})),
            ]
        );
    }

    #[test]
    fn broken_calls_stay_content() {
        let mut p = OutputParser::new(None, false, Some((ToolFormat::Hermes, tools())));
        let out = run(
            &mut p,
            &[
                "<tool_call>{\"name\": oops}</tool_call>",
                " and <tool_call>{\"na",
            ],
        );
        assert_eq!(
            out,
            [Piece::Content(
                "<tool_call>{\"name\": oops}</tool_call> and <tool_call>{\"na".into()
            )]
        );
    }

    #[test]
    fn without_tools_markup_is_content() {
        let mut p = OutputParser::new(None, false, None);
        let out = run(&mut p, &["<tool_call>{\"name\": \"a\"}</tool_call>"]);
        assert_eq!(
            out,
            [Piece::Content(
                "<tool_call>{\"name\": \"a\"}</tool_call>".into()
            )]
        );
    }

    #[test]
    fn qwen3_coder_xml_calls_are_typed_by_schema() {
        let mut p = OutputParser::new(None, false, Some((ToolFormat::Qwen3Coder, tools())));
        let out = run(
            &mut p,
            &["<tool_call>\n<function=get_weather>\n<parameter=city>\n", "12 Rue\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"],
        );
        assert_eq!(
            out,
            [call("get_weather", json!({"city": "12 Rue", "days": 3}))]
        );
    }

    #[test]
    fn llama3_json_calls() {
        let llama = || OutputParser::new(None, false, Some((ToolFormat::Llama3Json, tools())));
        let out = run(
            &mut llama(),
            &[
                "{\"name\": \"get_weather\", ",
                "\"parameters\": {\"city\": \"Paris\"}}",
            ],
        );
        assert_eq!(out, [call("get_weather", json!({"city": "Paris"}))]);
        let out = run(
            &mut llama(),
            &["<|python_tag|>{\"name\": \"a\", \"parameters\": {}}; {\"name\": \"b\", \"parameters\": {\"k\": 1}}"],
        );
        assert_eq!(out, [call("a", json!({})), call("b", json!({"k": 1}))]);
        // JSON that is not a call, and plain replies, are content.
        let out = run(&mut llama(), &["{\"answer\": 4}"]);
        assert_eq!(out, [Piece::Content("{\"answer\": 4}".into())]);
        let mut p = llama();
        assert_eq!(p.push("The answer"), [Piece::Content("The answer".into())]);
        assert_eq!(p.push(" is {4}"), [Piece::Content(" is {4}".into())]);
    }

    #[test]
    fn think_goes_to_reasoning() {
        let think = Some(("<think>", "</think>"));
        let mut p = OutputParser::new(think, false, None);
        let out = run(
            &mut p,
            &["<th", "ink>\nLet me", " think.</thi", "nk>\n\nParis."],
        );
        assert_eq!(
            out,
            [
                Piece::Reasoning("\nLet me think.".into()),
                Piece::Content("\n\nParis.".into())
            ]
        );
        // A template that opened the block leaves the reply inside it.
        let mut p = OutputParser::new(think, true, None);
        let out = run(&mut p, &["hmm</think>ok"]);
        assert_eq!(
            out,
            [Piece::Reasoning("hmm".into()), Piece::Content("ok".into())]
        );
    }

    #[test]
    fn reasoning_then_a_call() {
        let think = Some(("<think>", "</think>"));
        let mut p = OutputParser::new(think, true, Some((ToolFormat::Hermes, tools())));
        let out = run(
            &mut p,
            &["I need the weather.</think>\n\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}\n</tool_call>"],
        );
        assert_eq!(
            out,
            [
                Piece::Reasoning("I need the weather.".into()),
                Piece::Content("\n\n".into()),
                call("get_weather", json!({"city": "Oslo"}))
            ]
        );
    }

    fn gemma4() -> OutputParser {
        let think = Some(("<|channel>thought", "<channel|>"));
        OutputParser::new(think, false, Some((ToolFormat::Gemma4, tools())))
    }

    #[test]
    fn gemma4_is_chosen_by_its_template() {
        let template = include_str!("../../../tests/fixtures/templates/gemma4.jinja");
        assert_eq!(ToolFormat::from_template([template]), ToolFormat::Gemma4);
    }

    /// Calls as the Gemma 4 template writes them in history: keys sorted, strings quoted by
    /// `<|"|>`, one `<|tool_call>` block per call.
    #[test]
    fn gemma4_calls_from_the_template_notation() {
        let out = run(
            &mut gemma4(),
            &["<|tool_call>call:get_weather{city:<|\"|>Paris<|\"|>,days:2}<tool_call|>"],
        );
        assert_eq!(
            out,
            [call("get_weather", json!({"city": "Paris", "days": 2}))]
        );
        let out = run(
            &mut gemma4(),
            &["<|tool_call>call:book{guests:[<|\"|>Ann<|\"|>,<|\"|>Bo<|\"|>],note:<|\"|>a {b}, c: \"d\"<|\"|>,options:{late:true,rooms:null},price:-12.5}<tool_call|><|tool_call>call:ping{}<tool_call|>"],
        );
        assert_eq!(
            out,
            [
                call(
                    "book",
                    json!({"guests": ["Ann", "Bo"], "note": "a {b}, c: \"d\"",
                           "options": {"late": true, "rooms": null}, "price": -12.5})
                ),
                call("ping", json!({})),
            ]
        );
        // Several calls in one block, as mlx-lm's parser also takes them.
        let calls = parse_gemma4_calls("call:a{x:1}call:b-2{y:<|\"|>z<|\"|>}").unwrap();
        assert_eq!(
            calls
                .iter()
                .map(|c| (c.name.as_str(), c.arguments.as_str()))
                .collect::<Vec<_>>(),
            [("a", "{\"x\":1}"), ("b-2", "{\"y\":\"z\"}")]
        );
    }

    #[test]
    fn gemma4_thought_channel_then_a_streamed_call() {
        let out = run(
            &mut gemma4(),
            &[
                "<|channel>",
                "thought\nThe user wants the weather.<chan",
                "nel|>Checking.<|tool",
                "_call>call:get_weather{city:<|\"",
                "|>São Paulo<|\"|>}<tool_",
                "call|>",
            ],
        );
        assert_eq!(
            out,
            [
                Piece::Reasoning("\nThe user wants the weather.".into()),
                Piece::Content("Checking.".into()),
                call("get_weather", json!({"city": "São Paulo"})),
            ]
        );
    }

    #[test]
    fn gemma4_arguments_nest_about_as_deep_as_json() {
        let nested = |depth| format!("call:f{{x:{}1{}}}", "[".repeat(depth), "]".repeat(depth));
        assert!(parse_gemma4_calls(&nested(100)).is_some());
        // Each level takes a stack frame: a reply of `[`s must not overflow the stack, which
        // takes the whole server down.
        assert_eq!(parse_gemma4_calls(&nested(100_000)), None);
    }

    #[test]
    fn gemma4_broken_calls_stay_content() {
        for text in [
            "<|tool_call>call:f{x:<|\"|>unterminated}<tool_call|>",
            "<|tool_call>call:f{x:None}<tool_call|>",
            "<|tool_call>no call here<tool_call|>",
        ] {
            assert_eq!(run(&mut gemma4(), &[text]), [Piece::Content(text.into())]);
        }
        // Cut off by max_tokens: what there is stays content, markers and all.
        let out = run(&mut gemma4(), &["<|tool_call>call:get_weather{city:"]);
        assert_eq!(
            out,
            [Piece::Content("<|tool_call>call:get_weather{city:".into())]
        );
    }

    /// `text` one character at a time, as a model whose every token is one character.
    fn chars(text: &str) -> Vec<&str> {
        text.char_indices()
            .map(|(at, c)| &text[at..at + c.len_utf8()])
            .collect()
    }

    fn with_tools(format: ToolFormat) -> OutputParser {
        OutputParser::new(None, false, Some((format, tools())))
    }

    /// `text`, one character at a time, comes out as it went in.
    fn assert_stays_content(format: ToolFormat, text: &str) {
        let out = run(&mut with_tools(format), &chars(text));
        assert_eq!(out, [Piece::Content(text.into())], "{text}");
    }

    #[test]
    fn mistral_calls_after_args_markers_one_char_at_a_time() {
        let reply = "Let me check.[TOOL_CALLS]get_weather[ARGS]{\"city\": \"Paris\", \"days\": 2}\
                     [TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]{\"city\": \"[TOOL_CALLS]\"}";
        let out = run(&mut with_tools(ToolFormat::MistralArgs), &chars(reply));
        assert_eq!(
            out,
            [
                Piece::Content("Let me check.".into()),
                call("get_weather", json!({"city": "Paris", "days": 2})),
                call("get_weather", json!({"city": "[TOOL_CALLS]"})),
            ]
        );
        // Content goes out as it comes; only what may be the marker is held.
        let mut p = with_tools(ToolFormat::MistralArgs);
        assert_eq!(
            p.push("Let me check.[TOOL_"),
            [Piece::Content("Let me check.".into())]
        );
        assert_eq!(p.push("CALLS]get_weather[ARGS]{}"), []);
        assert_eq!(p.finish(), [call("get_weather", json!({}))]);
    }

    #[test]
    fn mistral_json_lists_of_calls() {
        let reply = "[TOOL_CALLS] [{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}, \
                     \"id\": \"a1b2c3d4e\"}, {\"name\": \"get_weather\", \"arguments\": \"{\\\"days\\\": 1}\"}]";
        let out = run(&mut with_tools(ToolFormat::MistralJson), &chars(reply));
        // Arguments given as JSON text are passed on as they are.
        let as_text = Piece::ToolCall(ToolCall {
            name: "get_weather".into(),
            arguments: "{\"days\": 1}".into(),
        });
        assert_eq!(
            out,
            [call("get_weather", json!({"city": "Paris"})), as_text]
        );
    }

    #[test]
    fn mistral_broken_calls_stay_content() {
        for text in [
            // Cut off by max_tokens.
            "[TOOL_CALLS]get_weather[ARGS]{\"city\": ",
            "[TOOL_CALLS]get weather[ARGS]{}",
            "[TOOL_CALLS]get_weather{}",
            "[TOOL_CALLS]get_weather[ARGS]{} and some words",
            "[TOOL_CALLS][{\"city\": \"Paris\"}]",
            "[TOOL_CALLS][]",
        ] {
            assert_stays_content(ToolFormat::MistralArgs, text);
        }
        let out = run(
            &mut with_tools(ToolFormat::MistralJson),
            &["See [1] and [TOOL"],
        );
        assert_eq!(out, [Piece::Content("See [1] and [TOOL".into())]);
    }

    #[test]
    fn pythonic_calls_one_char_at_a_time() {
        let reply = "[get_weather(city=\"Paris\", days=2), book.hotel(guests=['Ann', \"Bo\"], \
                     options={'late': True, \"rooms\": None, 3: false}, note='it\\'s \\u00e9\\x21\\n', \
                     doc='''a\n\"b\"''', price=-12.5, big=1_000, ids=(1,), one=(2), empty=()), ]";
        let out = run(&mut with_tools(ToolFormat::Pythonic), &chars(reply));
        assert_eq!(
            out,
            [
                call("get_weather", json!({"city": "Paris", "days": 2})),
                call(
                    "book.hotel",
                    json!({"guests": ["Ann", "Bo"],
                           "options": {"late": true, "rooms": null, "3": false},
                           "note": "it's é!\n", "doc": "a\n\"b\"", "price": -12.5, "big": 1000,
                           "ids": [1], "one": 2, "empty": []})
                ),
            ]
        );
    }

    #[test]
    fn pythonic_replies_that_are_no_calls_stay_content() {
        for text in [
            "[1, 2] are numbers",
            "[get_weather(\"Paris\")]",
            "[get_weather(city=Paris)]",
            "[get_weather(city=\"Paris\") get_weather(city=\"Oslo\")]",
            "[get_weather(city='Par\nis')]",
            "[get_weather(city=\"\\N{BULLET}\")]",
            "[get_weather(days=0x10)]",
            "[]",
            // Cut off by max_tokens.
            "[get_weather(city=\"Par",
        ] {
            assert_stays_content(ToolFormat::Pythonic, text);
        }
        // Calls are the whole reply: one after words is words, and they go out as they come.
        let mut p = with_tools(ToolFormat::Pythonic);
        assert_eq!(p.push("Sure: "), [Piece::Content("Sure: ".into())]);
        assert_eq!(
            p.push("[get_weather(city=\"Paris\")]"),
            [Piece::Content("[get_weather(city=\"Paris\")]".into())]
        );
        // A reply of `[`s must not overflow the stack.
        let deep = format!("[f(x={})]", "[".repeat(100_000));
        assert_eq!(parse_pythonic_calls(&deep), None);
    }

    #[test]
    fn minicpm5_calls_one_char_at_a_time() {
        let reply = "Checking.\n<function name=\"get_weather\"><param name=\"city\"><![CDATA[São <Paulo>\n& co]]>\
                     </param><param name=\"days\"> 2 </param></function>\n<function name='get_weather'>\
                     <param name=days>3</param></function>";
        let out = run(&mut with_tools(ToolFormat::MiniCpm5), &chars(reply));
        assert_eq!(
            out,
            [
                Piece::Content("Checking.\n".into()),
                call(
                    "get_weather",
                    json!({"city": "São <Paulo>\n& co", "days": 2})
                ),
                Piece::Content("\n".into()),
                call("get_weather", json!({"days": 3})),
            ]
        );
    }

    /// As mlx-lm's `minimax_m2` types values, which MiniCPM5's template writes with Python's
    /// `str`.
    #[test]
    fn minicpm5_values_are_typed_by_the_schema() {
        let tools = json!([{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {
                "count": {"type": "integer"}, "ratio": {"type": "number"},
                "flag": {"type": "boolean"}, "tags": {"type": "array"}, "meta": {"type": "object"},
                "maybe": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
                "unit": {"enum": ["C", "F"]}, "size": {"type": ["integer", "string"]}}}}}]);
        let body = "\"f\"><param name=\"count\">7</param><param name=\"ratio\">2.0</param>\
                    <param name=\"flag\">True</param><param name=\"tags\">['a', 'b']</param>\
                    <param name=\"meta\">{'k': [1, None]}</param><param name=\"maybe\">None</param>\
                    <param name=\"unit\">1</param><param name=\"size\">big</param>\
                    <param name=\"extra\">42</param><param name=\"gone\">null</param>";
        assert_eq!(
            parse_minicpm5(body, &tools),
            Some(ToolCall {
                name: "f".into(),
                arguments: json!({"count": 7, "ratio": 2, "flag": true, "tags": ["a", "b"],
                                  "meta": {"k": [1, null]}, "maybe": null, "unit": "1",
                                  "size": "big", "extra": "42", "gone": null})
                .to_string(),
            })
        );
    }

    #[test]
    fn minicpm5_broken_calls_stay_content() {
        for text in [
            "<function name=\"get_weather\"><param name=\"city\">Paris</function>",
            "<function name=>Paris</function>",
            "<function name=\"get_weather\"<param name=\"city\">Paris</param></function>",
            "<function name=\"get_weather\"><param name=\"city\">Par",
        ] {
            assert_stays_content(ToolFormat::MiniCpm5, text);
        }
        // Cut off before `</function>` but after its last parameter: the call is whole, as
        // mlx-lm reads it.
        let out = run(
            &mut with_tools(ToolFormat::MiniCpm5),
            &["<function name=\"get_weather\"><param name=\"city\">Paris</param>"],
        );
        assert_eq!(out, [call("get_weather", json!({"city": "Paris"}))]);
    }
}
