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
//! - Llama 3.x: the whole reply is `{"name": …, "parameters": {…}}` (or several, `;`-separated),
//!   optionally after `<|python_tag|>`. Without markers, a reply that starts like JSON is held
//!   until it ends, then becomes tool calls if it parses as such, else content.

use serde_json::{Map, Value};

/// How a model writes tool calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolFormat {
    Hermes,
    Qwen3Coder,
    Llama3Json,
    Gemma4,
}

const TOOL_START: &str = "<tool_call>";
const TOOL_END: &str = "</tool_call>";
const GEMMA4_TOOL_START: &str = "<|tool_call>";
const GEMMA4_TOOL_END: &str = "<tool_call|>";
/// Gemma 4's string quote.
const GEMMA4_QUOTE: &str = "<|\"|>";
const PYTHON_TAG: &str = "<|python_tag|>";

impl ToolFormat {
    /// The format a chat template asks for. Templates that name none get Hermes, the most
    /// common (a `<tool_call>` in the reply of a model that never saw one is still a call).
    pub fn from_template<'a>(sources: impl IntoIterator<Item = &'a str>) -> Self {
        let sources: Vec<&str> = sources.into_iter().collect();
        let any = |needle: &str| sources.iter().any(|s| s.contains(needle));
        if any(GEMMA4_TOOL_START) && any(GEMMA4_TOOL_END) {
            ToolFormat::Gemma4
        } else if any("<tool_call>\n<function=") || any("<tool_call>\\n<function=") {
            ToolFormat::Qwen3Coder
        } else if any(TOOL_START) {
            ToolFormat::Hermes
        } else if any(PYTHON_TAG) || any("respond with a JSON for a function call") {
            ToolFormat::Llama3Json
        } else {
            ToolFormat::Hermes
        }
    }

    /// The markers around a call block; Llama 3.x has none.
    fn markers(self) -> Option<(&'static str, &'static str)> {
        match self {
            ToolFormat::Hermes | ToolFormat::Qwen3Coder => Some((TOOL_START, TOOL_END)),
            ToolFormat::Gemma4 => Some((GEMMA4_TOOL_START, GEMMA4_TOOL_END)),
            ToolFormat::Llama3Json => None,
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
    /// Llama 3.x: a reply that may be a JSON tool call, held until the end.
    MaybeJson,
}

/// Splits streamed model output into [`Piece`]s; see the module docs.
#[derive(Debug, Clone)]
pub struct OutputParser {
    think: Option<(String, String)>,
    tools: Option<(ToolFormat, Value)>,
    state: State,
    /// Received text not yet given out: a possible start of a marker.
    pending: String,
    /// The body of the tool call (or the JSON reply) being read.
    call: String,
    /// Whether any content has been given out (Llama calls are only at the start).
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
        OutputParser {
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

    /// Adds decoded text; returns what is known so far.
    pub fn push(&mut self, text: &str) -> Vec<Piece> {
        self.pending.push_str(text);
        let mut out = Vec::new();
        loop {
            if self.state == State::Content && !self.started && !self.check_json_start() {
                return out;
            }
            if self.state == State::MaybeJson {
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
        let mut out = Vec::new();
        let rest = std::mem::take(&mut self.pending);
        match self.state {
            State::Tool => {
                self.call.push_str(&rest);
                self.end_call(&mut out, false);
            }
            State::MaybeJson => {
                let text = std::mem::take(&mut self.call) + &rest;
                let body = text.trim_start().trim_start_matches(PYTHON_TAG);
                match parse_llama_calls(body) {
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
                if let Some((_, end)) = tool_markers {
                    markers.push((end.to_owned(), State::Content));
                }
            }
            State::MaybeJson => {}
        }
        markers
    }

    /// The call block markers of the request's format, when it offers tools.
    fn tool_markers(&self) -> Option<(&'static str, &'static str)> {
        self.tools.as_ref().and_then(|(format, _)| format.markers())
    }

    fn is_llama(&self) -> bool {
        matches!(self.tools, Some((ToolFormat::Llama3Json, _)))
    }

    /// Llama 3.x: a reply that opens with JSON or `<|python_tag|>` may be a call. False while
    /// the start of the reply cannot tell yet.
    fn check_json_start(&mut self) -> bool {
        if !self.is_llama() {
            return true;
        }
        let head = self.pending.trim_start();
        if head.starts_with('{') || head.starts_with('[') || head.starts_with(PYTHON_TAG) {
            self.state = State::MaybeJson;
        } else if head.is_empty() || PYTHON_TAG.starts_with(head) {
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
            State::Tool | State::MaybeJson => self.call.push_str(&text),
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
            Some((ToolFormat::Gemma4, _)) => parse_gemma4_calls(&body),
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
fn partial_suffix<'a>(text: &str, markers: impl Iterator<Item = &'a String>) -> usize {
    markers
        .map(|m| {
            (1..m.len().min(text.len() + 1))
                .rev()
                .filter(|&n| m.is_char_boundary(n))
                .find(|&n| text.ends_with(&m[..n]))
                .unwrap_or(0)
        })
        .max()
        .unwrap_or(0)
}

/// One call from `{"name": …, "arguments"|"parameters": …}`.
fn json_call(value: &Value) -> Option<ToolCall> {
    let name = value.get("name")?.as_str()?.to_owned();
    let arguments = match value.get("arguments").or_else(|| value.get("parameters")) {
        Some(Value::String(text)) => text.clone(),
        Some(args) => args.to_string(),
        None => "{}".to_owned(),
    };
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

/// mlx-lm `qwen3_coder`: `<function=NAME>` then `<parameter=P>value</parameter>` entries, each
/// value typed by the tool's JSON schema (strings stay strings; other types parse as JSON
/// where they can).
pub fn parse_qwen3_coder(body: &str, tools: &Value) -> Option<ToolCall> {
    let start = body.find("<function=")? + "<function=".len();
    let end = body.rfind("</function>")?;
    let function = body.get(start..end)?;
    let name_end = function.find('>')?;
    let name = function[..name_end].trim().to_owned();
    let schema = tools.as_array().and_then(|tools| {
        tools.iter().find_map(|t| {
            let f = t.get("function")?;
            (f.get("name")?.as_str()? == name).then(|| f.pointer("/parameters/properties"))?
        })
    });
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

/// mlx-lm `gemma4`: every `call:NAME{…}` in a block, the braces holding Gemma 4's argument
/// notation (see [`Gemma4Args`]).
pub fn parse_gemma4_calls(body: &str) -> Option<Vec<ToolCall>> {
    let mut calls = Vec::new();
    let mut rest = body;
    while let Some(at) = rest.find("call:") {
        rest = &rest[at + "call:".len()..];
        let name_end = rest
            .find(|c: char| !(c.is_alphanumeric() || c == '_' || c == '-'))
            .unwrap_or(rest.len());
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

/// A reader of Gemma 4's argument notation, as its chat template writes it: objects with bare
/// (or quoted) keys, lists, strings between `<|"|>` marks, and JSON's numbers, `true`, `false`
/// and `null`. Holds the text not read yet.
struct Gemma4Args<'a>(&'a str);

/// How deep Gemma 4 arguments may nest, about as deep as serde_json reads JSON: each level is a
/// frame of [`Gemma4Args::value`], and a reply of 100,000 `[`s would overflow the thread's stack.
const GEMMA4_MAX_DEPTH: usize = 128;

impl Gemma4Args<'_> {
    fn value(&mut self, depth: usize) -> Option<Value> {
        if depth > GEMMA4_MAX_DEPTH {
            return None;
        }
        self.0 = self.0.trim_start();
        if self.0.starts_with(GEMMA4_QUOTE) {
            return self.string().map(Value::String);
        }
        if self.eat('{') {
            let mut object = Map::new();
            if self.eat('}') {
                return Some(Value::Object(object));
            }
            loop {
                let key = self.key()?;
                if !self.eat(':') {
                    return None;
                }
                object.insert(key, self.value(depth + 1)?);
                if self.eat('}') {
                    return Some(Value::Object(object));
                }
                if !self.eat(',') {
                    return None;
                }
            }
        }
        if self.eat('[') {
            let mut list = Vec::new();
            if self.eat(']') {
                return Some(Value::Array(list));
            }
            loop {
                list.push(self.value(depth + 1)?);
                if self.eat(']') {
                    return Some(Value::Array(list));
                }
                if !self.eat(',') {
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
        let end = self
            .0
            .find(|c: char| !(c.is_alphanumeric() || c == '_' || c == '-'))?;
        let (key, rest) = self.0.split_at(end);
        self.0 = rest;
        (!key.is_empty()).then(|| key.to_owned())
    }

    /// Skips blanks, then `c` if it comes next.
    fn eat(&mut self, c: char) -> bool {
        self.0 = self.0.trim_start();
        match self.0.strip_prefix(c) {
            Some(rest) => {
                self.0 = rest;
                true
            }
            None => false,
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
}
