//! OpenAI's harmony format, which gpt-oss models write: a reply is a series of messages,
//! `<|start|>assistant<|channel|>CHANNEL<|message|>TEXT<|end|>`, the first without its
//! `<|start|>assistant` (the prompt ends with it). The `analysis` channel is reasoning, `final`
//! the answer, and a message with a recipient (`to=functions.NAME`, in the header before or
//! after the channel, often followed by `<|constrain|>json`) a tool call whose text is its JSON
//! arguments. `<|call|>` and `<|return|>` end the reply (they are the models' end-of-sequence
//! tokens, so they seldom reach the text at all).
//!
//! Also here: the history as gpt-oss's chat template takes it ([`prepare_history`]) and the
//! template variables it reads ([`prepare_template_kwargs`]).

use serde_json::{json, Map, Value};

use crate::parsers::{partial_suffix, Piece, ToolCall};

pub(crate) const START: &str = "<|start|>";
pub(crate) const END: &str = "<|end|>";
pub(crate) const MESSAGE: &str = "<|message|>";
pub(crate) const CHANNEL: &str = "<|channel|>";
pub(crate) const CONSTRAIN: &str = "<|constrain|>";
pub(crate) const RETURN: &str = "<|return|>";
pub(crate) const CALL: &str = "<|call|>";
/// What opens and closes the reasoning: a message on the analysis channel.
pub(crate) const ANALYSIS: (&str, &str) = ("<|channel|>analysis<|message|>", END);

/// Every marker of the format.
const MARKERS: [&str; 7] = [START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL];

/// How a header may start: a reply whose text starts otherwise was written without one, and
/// is the answer as it is.
const HEADER_OPENERS: [&str; 4] = [START, CHANNEL, CONSTRAIN, "to="];

/// Where a header's end must start, at the latest: a header is a role, a channel, a recipient
/// and a content type. Text that goes on longer is no header but the answer (and is not read
/// again for each token that comes).
const MAX_HEADER: usize = 1024;

/// Where a message's text goes.
#[derive(Debug, Clone, PartialEq)]
enum Route {
    Reasoning,
    Content,
    /// A call of the tool `name`; its arguments so far.
    Call {
        name: String,
        arguments: String,
    },
    /// What the client never sees: a tool's own message, which a model that was not stopped
    /// at `<|call|>` goes on to make up.
    Hidden,
}

#[derive(Debug, Clone, PartialEq)]
enum State {
    /// Reading a header, up to `<|message|>`: the text so far.
    Header(String),
    Body(Route),
    /// After `<|call|>` or `<|return|>`: the reply is over.
    Done,
}

/// Splits streamed harmony text into [`Piece`]s: reasoning and content as they come, each call
/// once its message ends. No marker reaches the pieces.
#[derive(Debug, Clone)]
pub struct HarmonyParser {
    /// The names of the request's tools; none when it offers none (a call is then content).
    tools: Option<Vec<String>>,
    state: State,
    /// Body text not given out yet: a possible start of a marker.
    pending: String,
}

impl HarmonyParser {
    /// `tools`: the request's tool list (OpenAI's shape), when it offers tools.
    pub fn new(tools: Option<&Value>) -> Self {
        let tools = tools.map(|tools| {
            tools
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|t| crate::request::tool_name(t).map(str::to_owned))
                .collect()
        });
        HarmonyParser {
            tools,
            state: State::Header(String::new()),
            pending: String::new(),
        }
    }

    /// Adds decoded text; returns what is known so far.
    pub fn push(&mut self, text: &str) -> Vec<Piece> {
        self.pending.push_str(text);
        let mut out = Vec::new();
        loop {
            match &mut self.state {
                State::Done => {
                    self.pending.clear();
                    return out;
                }
                State::Header(header) => {
                    header.push_str(&std::mem::take(&mut self.pending));
                    if is_bare(header) {
                        // No header: the text is the answer (markers in it still count).
                        self.pending = std::mem::take(header);
                        self.state = State::Body(Route::Content);
                        continue;
                    }
                    let found = [MESSAGE, END, RETURN, CALL]
                        .into_iter()
                        .filter_map(|m| Some((header.find(m)?, m)))
                        .min()
                        .filter(|(at, _)| *at < MAX_HEADER);
                    let Some((at, marker)) = found else {
                        // Past the longest marker, one that starts in time would be whole.
                        if header.len() >= MAX_HEADER + CONSTRAIN.len() {
                            // Read as content, but for the marker that opened it (which
                            // would open it again).
                            let mut text = std::mem::take(header);
                            let blank = text.len() - text.trim_start().len();
                            if let Some(opener) = [START, CHANNEL, CONSTRAIN]
                                .into_iter()
                                .find(|m| text[blank..].starts_with(m))
                            {
                                text.replace_range(blank..blank + opener.len(), "");
                            }
                            self.pending = text;
                            self.state = State::Body(Route::Content);
                            continue;
                        }
                        return out;
                    };
                    let mut header = std::mem::take(header);
                    self.pending = header.split_off(at + marker.len());
                    header.truncate(at);
                    self.state = match marker {
                        MESSAGE => State::Body(self.route(&header)),
                        // A header without a message: nothing to say.
                        END => State::Header(String::new()),
                        _ => State::Done,
                    };
                }
                State::Body(_) => {
                    let found = MARKERS
                        .into_iter()
                        .filter_map(|m| Some((self.pending.find(m)?, m)))
                        .min();
                    let Some((at, marker)) = found else {
                        let keep = partial_suffix(&self.pending, MARKERS.iter());
                        let safe: String =
                            self.pending.drain(..self.pending.len() - keep).collect();
                        self.emit(safe, &mut out);
                        return out;
                    };
                    let before: String = self.pending.drain(..at).collect();
                    self.pending.drain(..marker.len());
                    self.emit(before, &mut out);
                    match marker {
                        // Stray in a message's text; dropped.
                        MESSAGE | CONSTRAIN => {}
                        END => self.end_message(State::Header(String::new()), &mut out),
                        RETURN | CALL => self.end_message(State::Done, &mut out),
                        // A new message, its predecessor left without an end.
                        _ => self.end_message(State::Header(marker.to_owned()), &mut out),
                    }
                }
            }
        }
    }

    /// Ends the reply: held-back text is given out, a call cut short read if it can be.
    pub fn finish(&mut self) -> Vec<Piece> {
        let mut out = Vec::new();
        if let State::Body(_) = self.state {
            let rest = std::mem::take(&mut self.pending);
            self.emit(rest, &mut out);
            self.end_message(State::Done, &mut out);
        }
        self.state = State::Done;
        out
    }

    /// Where the text of the message with `header` goes.
    fn route(&self, header: &str) -> Route {
        let words = || {
            header
                .split(|c: char| c.is_whitespace() || c == '<')
                .filter(|w| !w.is_empty())
        };
        // `<|start|>functions.NAME to=assistant…`: a tool's message, not the assistant's.
        if let Some(role) = header.trim_start().strip_prefix(START) {
            let role = role.split(|c: char| c.is_whitespace() || c == '<').next();
            if role != Some("assistant") {
                return Route::Hidden;
            }
        }
        let channel = header
            .split_once(CHANNEL)
            .and_then(|(_, rest)| rest.split(|c: char| c.is_whitespace() || c == '<').next());
        match words().find_map(|w| w.strip_prefix("to=")) {
            None if channel == Some("analysis") => Route::Reasoning,
            None => Route::Content,
            Some("assistant") => Route::Hidden,
            Some(recipient) => {
                let function = recipient.strip_prefix("functions.");
                let name = function.unwrap_or(recipient);
                match &self.tools {
                    Some(tools)
                        if !name.is_empty()
                            && (function.is_some() || tools.iter().any(|t| t == name)) =>
                    {
                        Route::Call {
                            name: name.to_owned(),
                            arguments: String::new(),
                        }
                    }
                    // A call when no tool is offered: its text, as other formats keep theirs.
                    None if function.is_some() => Route::Content,
                    // A built-in tool's (`python`, `browser.search`): part of the reasoning.
                    _ => Route::Reasoning,
                }
            }
        }
    }

    fn emit(&mut self, text: String, out: &mut Vec<Piece>) {
        if text.is_empty() {
            return;
        }
        match &mut self.state {
            State::Body(Route::Reasoning) => match out.last_mut() {
                Some(Piece::Reasoning(r)) => r.push_str(&text),
                _ => out.push(Piece::Reasoning(text)),
            },
            State::Body(Route::Content) => match out.last_mut() {
                Some(Piece::Content(c)) => c.push_str(&text),
                _ => out.push(Piece::Content(text)),
            },
            State::Body(Route::Call { arguments, .. }) => arguments.push_str(&text),
            _ => {}
        }
    }

    /// The message being read ended; `next` is what comes after it. A call's arguments must be
    /// a JSON object; anything else is given as content.
    fn end_message(&mut self, next: State, out: &mut Vec<Piece>) {
        let State::Body(Route::Call { name, arguments }) = std::mem::replace(&mut self.state, next)
        else {
            return;
        };
        match serde_json::from_str::<Value>(arguments.trim()) {
            Ok(object @ Value::Object(_)) => out.push(Piece::ToolCall(ToolCall {
                name,
                arguments: object.to_string(),
            })),
            _ if arguments.is_empty() => {}
            _ => match out.last_mut() {
                Some(Piece::Content(c)) => c.push_str(&arguments),
                _ => out.push(Piece::Content(arguments)),
            },
        }
    }
}

/// Whether text where a header should be is none: text that does not start (past blanks) as
/// a header may, nor may still.
fn is_bare(text: &str) -> bool {
    let head = text.trim_start();
    !head.is_empty()
        && !HEADER_OPENERS
            .iter()
            .any(|o| head.starts_with(o) || o.starts_with(head))
}

/// The reasoning of a message, under any of the names clients give it.
const REASONING_FIELDS: [&str; 3] = ["reasoning_content", "thinking", "reasoning"];

/// Chat messages as gpt-oss's template renders them right. It shows one call per assistant
/// message, and gives each `tool` message the name of the last call before it; so a turn of
/// several calls becomes one message per call, each followed by its result (found by
/// `tool_call_id`, else the next one that answers none of the turn's calls). It refuses a call turn that has both reasoning and
/// content (a preamble, in harmony's commentary channel): the content joins the reasoning,
/// which the template shows as the turn's analysis. An empty `tool_calls` is dropped.
pub(crate) fn prepare_history(messages: &[Value]) -> Vec<Value> {
    let mut out = Vec::with_capacity(messages.len());
    let mut rest = messages;
    while let Some((message, after)) = rest.split_first() {
        rest = after;
        let Some(Value::Array(calls)) = message.get("tool_calls") else {
            out.push(message.clone());
            continue;
        };
        let mut turn = message.as_object().cloned().unwrap_or_default();
        turn.remove("tool_calls");
        if calls.is_empty() || message["role"] != "assistant" {
            if !calls.is_empty() {
                turn.insert("tool_calls".into(), Value::Array(calls.clone()));
            }
            out.push(Value::Object(turn));
            continue;
        }
        join_preamble(&mut turn);
        let results = rest.iter().take_while(|m| m["role"] == "tool").count();
        let (results, after) = rest.split_at(results);
        rest = after;
        let mut results: Vec<Option<&Value>> = results.iter().map(Some).collect();
        let call_id = |call: &Value| call.get("id").and_then(Value::as_str).map(str::to_owned);
        let ids: Vec<String> = calls.iter().filter_map(call_id).collect();
        let result_id = |r: &Value| {
            r.get("tool_call_id")
                .and_then(Value::as_str)
                .map(str::to_owned)
        };
        for (i, call) in calls.iter().enumerate() {
            let mut message = if i == 0 {
                std::mem::take(&mut turn)
            } else {
                let mut next = Map::new();
                next.insert("role".into(), "assistant".into());
                next.insert("content".into(), "".into());
                next
            };
            message.insert("tool_calls".into(), json!([call]));
            out.push(Value::Object(message));
            // Its result, else the first that answers no call of the turn.
            let id = call_id(call);
            let answers =
                |r: &Option<&Value>| r.is_some_and(|r| id.is_some() && result_id(r) == id);
            let unclaimed = |r: &Option<&Value>| {
                r.is_some_and(|r| result_id(r).is_none_or(|id| !ids.contains(&id)))
            };
            let result = results
                .iter()
                .position(answers)
                .or_else(|| results.iter().position(unclaimed));
            if let Some(result) = result.and_then(|at| results[at].take()) {
                out.push(result.clone());
            }
        }
        // Results no call claimed stay after the last call.
        out.extend(results.into_iter().flatten().cloned());
    }
    out
}

/// A call turn's content joined to its reasoning, where it has both.
fn join_preamble(turn: &mut Map<String, Value>) {
    let content = turn.get("content").and_then(Value::as_str).unwrap_or("");
    let reasoning = REASONING_FIELDS
        .iter()
        .find_map(|k| turn.get(*k).and_then(Value::as_str))
        .unwrap_or("");
    if content.is_empty() || reasoning.is_empty() {
        return;
    }
    let joined = format!("{reasoning}\n\n{content}");
    for field in REASONING_FIELDS {
        turn.remove(field);
    }
    turn.insert("reasoning_content".into(), joined.into());
    turn.insert("content".into(), "".into());
}

/// Tools as gpt-oss's template takes them: it writes each one's description as a comment,
/// and fails on a tool without one (as jinja2 does, adding text to an undefined value); those
/// get an empty description, as llama.cpp's renderer gives them.
pub(crate) fn prepare_tools(tools: &Value) -> Value {
    let mut tools = tools.clone();
    for tool in tools.as_array_mut().into_iter().flatten() {
        if let Some(Value::Object(function)) = tool.get_mut("function") {
            if !function.get("description").is_some_and(Value::is_string) {
                function.insert("description".into(), "".into());
            }
        }
    }
    tools
}

/// The template's `reasoning_effort` among the levels gpt-oss knows (`low`, `medium`, `high`):
/// OpenAI's other levels go to the nearest.
pub(crate) fn prepare_template_kwargs(kwargs: &mut Map<String, Value>) {
    let Some(Value::String(effort)) = kwargs.get_mut("reasoning_effort") else {
        return;
    };
    let nearest = match effort.as_str() {
        "none" | "minimal" => "low",
        "xhigh" => "high",
        _ => return,
    };
    *effort = nearest.to_owned();
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tools() -> Value {
        json!([{"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}}}}}])
    }

    /// Feeds `pieces` one by one and merges adjacent pieces of one kind.
    fn run(parser: &mut HarmonyParser, pieces: &[&str]) -> Vec<Piece> {
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

    /// `text` one character at a time.
    fn chars(text: &str) -> Vec<&str> {
        text.char_indices()
            .map(|(at, c)| &text[at..at + c.len_utf8()])
            .collect()
    }

    fn reasoning(text: &str) -> Piece {
        Piece::Reasoning(text.into())
    }

    fn content(text: &str) -> Piece {
        Piece::Content(text.into())
    }

    fn call(name: &str, arguments: Value) -> Piece {
        Piece::ToolCall(ToolCall {
            name: name.into(),
            arguments: arguments.to_string(),
        })
    }

    /// `text` whole and one character at a time gives `expected`.
    fn check(tools: Option<&Value>, text: &str, expected: &[Piece]) {
        assert_eq!(
            run(&mut HarmonyParser::new(tools), &[text]),
            expected,
            "{text}"
        );
        let one_by_one = run(&mut HarmonyParser::new(tools), &chars(text));
        assert_eq!(one_by_one, expected, "{text}, one character at a time");
    }

    #[test]
    fn analysis_then_final() {
        check(
            None,
            "<|channel|>analysis<|message|>User asks: \"What is 2 + 2?\" Simple.<|end|>\
             <|start|>assistant<|channel|>final<|message|>2 + 2 = 4.<|return|>",
            &[
                reasoning("User asks: \"What is 2 + 2?\" Simple."),
                content("2 + 2 = 4."),
            ],
        );
        // The end-of-sequence `<|return|>` is not in the text, usually.
        check(
            None,
            "<|channel|>final<|message|>Hi <there>",
            &[content("Hi <there>")],
        );
    }

    #[test]
    fn text_goes_out_as_it_comes_markers_held() {
        let mut p = HarmonyParser::new(None);
        assert_eq!(p.push("<|channel|>anal"), []);
        assert_eq!(p.push("ysis<|message|>Let me"), [reasoning("Let me")]);
        assert_eq!(p.push(" see.<|e"), [reasoning(" see.")]);
        assert_eq!(p.push("nd|><|start|>assistant"), []);
        assert_eq!(p.push("<|channel|>final<|message|>Four"), [content("Four")]);
        assert_eq!(p.push(" <|"), [content(" ")]);
        // Cut off where a marker might have started: the text was the model's.
        assert_eq!(p.finish(), [content("<|")]);
    }

    #[test]
    fn calls_with_the_recipient_in_either_place() {
        let tools = tools();
        let expected = [
            reasoning("Need the weather."),
            call("get_weather", json!({"city": "Paris"})),
        ];
        for reply in [
            // As gpt-oss writes them.
            "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant\
             <|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>\
             {\"city\":\"Paris\"}<|call|>",
            // As its template writes them in history.
            "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant \
             to=functions.get_weather<|channel|>commentary json<|message|>{\"city\": \"Paris\"}<|call|>",
            // `<|call|>` is end-of-sequence: the text ends without it.
            "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant\
             <|channel|>commentary to=functions.get_weather<|constrain|>json<|message|>\
             {\"city\": \"Paris\"} ",
        ] {
            check(Some(&tools), reply, &expected);
        }
        // The first message may be the call itself, the recipient first.
        check(
            Some(&tools),
            " to=functions.get_weather<|channel|>commentary json<|message|>{\"city\": \"Oslo\"}",
            &[call("get_weather", json!({"city": "Oslo"}))],
        );
    }

    #[test]
    fn a_preamble_is_content() {
        let tools = tools();
        check(
            Some(&tools),
            "<|channel|>analysis<|message|>Plan.<|end|><|start|>assistant<|channel|>commentary\
             <|message|>Checking the forecast.<|end|><|start|>assistant<|channel|>commentary \
             to=functions.get_weather <|constrain|>json<|message|>{}<|call|>",
            &[
                reasoning("Plan."),
                content("Checking the forecast."),
                call("get_weather", json!({})),
            ],
        );
    }

    #[test]
    fn nothing_after_call_or_return_counts() {
        // A model whose end-of-sequence tokens were not set goes on to write the tool's answer.
        let tools = tools();
        check(
            Some(&tools),
            "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\":\"Paris\"}\
             <|call|><|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>\
             {\"temp\": 20}<|end|><|start|>assistant<|channel|>final<|message|>It is 20.<|return|>",
            &[call("get_weather", json!({"city": "Paris"}))],
        );
        // A tool's message is never the assistant's.
        check(
            Some(&tools),
            "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>{}<|end|>\
             <|start|>assistant<|channel|>final<|message|>Done.",
            &[content("Done.")],
        );
    }

    #[test]
    fn cut_off_messages() {
        let tools = tools();
        // By max_tokens, in each part of a message.
        check(Some(&tools), "<|channel|>analy", &[]);
        check(
            Some(&tools),
            "<|channel|>analysis<|message|>Hmm, the",
            &[reasoning("Hmm, the")],
        );
        check(
            Some(&tools),
            "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Pa",
            &[content("{\"city\": \"Pa")],
        );
        // A call whose arguments are no JSON object is its text.
        check(
            Some(&tools),
            "<|channel|>commentary to=functions.get_weather json<|message|>[1]<|call|>",
            &[content("[1]")],
        );
    }

    #[test]
    fn replies_without_headers_and_stray_markers() {
        check(None, "Just words.", &[content("Just words.")]);
        check(
            None,
            "Words<|message|> and<|constrain|> more",
            &[content("Words and more")],
        );
        // A message that starts without ending the one before.
        check(
            None,
            "<|channel|>analysis<|message|>Think.<|start|>assistant<|channel|>final<|message|>Say.",
            &[reasoning("Think."), content("Say.")],
        );
        // A header that ends without a message says nothing.
        check(
            None,
            "<|channel|>analysis<|end|><|start|>assistant<|channel|>final<|message|>Ok",
            &[content("Ok")],
        );
        // Text longer than any header is none.
        let long = format!("<|channel|>{}<|message|>b", "a".repeat(MAX_HEADER));
        let text = format!("{}b", "a".repeat(MAX_HEADER));
        check(None, &long, &[content(&text)]);
        let header = format!(
            "<|channel|>final {}<|message|>b",
            "a".repeat(MAX_HEADER - 30)
        );
        check(None, &header, &[content("b")]);
    }

    #[test]
    fn recipients_other_than_functions() {
        let tools = tools();
        // Built-in tools are part of the reasoning; without tools, a call is content; a
        // recipient that names a tool without its namespace still calls it.
        check(
            Some(&tools),
            "<|channel|>analysis to=python code<|message|>print(1)<|call|>",
            &[reasoning("print(1)")],
        );
        check(
            None,
            "<|channel|>commentary to=functions.get_weather json<|message|>{\"city\": \"Paris\"}",
            &[content("{\"city\": \"Paris\"}")],
        );
        check(
            Some(&tools),
            "<|channel|>commentary to=get_weather json<|message|>{\"city\": \"Paris\"}",
            &[call("get_weather", json!({"city": "Paris"}))],
        );
    }

    /// Replies made of harmony's pieces in any order come out the same however they are cut,
    /// and calls have JSON objects as arguments (as the fuzz target checks at length).
    #[test]
    fn any_reply_reads_the_same_however_cut() {
        const PARTS: [&str; 22] = [
            START,
            END,
            MESSAGE,
            CHANNEL,
            CONSTRAIN,
            RETURN,
            CALL,
            "assistant",
            "analysis",
            "final",
            "commentary",
            " to=functions.get_weather",
            " to=python",
            " json",
            "{}",
            "{\"city\": \"é\"}",
            "x",
            " ",
            "\n",
            "<|",
            "|>",
            "to=",
        ];
        let tools = tools();
        let mut seed: u64 = 7;
        let mut next = |n: usize| {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (seed >> 33) as usize % n
        };
        for _ in 0..3000 {
            let len = next(16);
            let text: String = (0..len).map(|_| PARTS[next(PARTS.len())]).collect();
            let mut cuts = Vec::new();
            let mut at = 0;
            while at < text.len() {
                let mut end = (at + 1 + next(6)).min(text.len());
                while !text.is_char_boundary(end) {
                    end += 1;
                }
                cuts.push(&text[at..end]);
                at = end;
            }
            let whole = run(&mut HarmonyParser::new(Some(&tools)), &[&text]);
            assert_eq!(
                run(&mut HarmonyParser::new(Some(&tools)), &cuts),
                whole,
                "{text:?}"
            );
            for piece in whole {
                if let Piece::ToolCall(call) = piece {
                    let arguments: Value = serde_json::from_str(&call.arguments).unwrap();
                    assert!(arguments.is_object(), "{text:?}");
                }
            }
        }
    }

    #[test]
    fn history_is_one_call_a_message_each_with_its_result() {
        let call = |id: &str, city: &str| {
            json!({"id": id, "type": "function",
                   "function": {"name": "get_weather", "arguments": {"city": city}}})
        };
        let result =
            |id: &str, text: &str| json!({"role": "tool", "tool_call_id": id, "content": text});
        let user = json!({"role": "user", "content": "Weather?"});
        let messages = [
            user.clone(),
            json!({"role": "assistant", "content": "Checking both.", "reasoning_content": "Two cities.",
                   "tool_calls": [call("a", "Paris"), call("b", "Oslo")]}),
            // Results in another order than the calls.
            result("b", "5C"),
            result("a", "18C"),
            json!({"role": "assistant", "content": "Mild.", "tool_calls": []}),
        ];
        assert_eq!(
            prepare_history(&messages),
            [
                user,
                json!({"role": "assistant", "content": "",
                       "reasoning_content": "Two cities.\n\nChecking both.",
                       "tool_calls": [call("a", "Paris")]}),
                result("a", "18C"),
                json!({"role": "assistant", "content": "", "tool_calls": [call("b", "Oslo")]}),
                result("b", "5C"),
                json!({"role": "assistant", "content": "Mild."}),
            ]
        );
        // Without ids, results go in order.
        let no_id = |city: &str| json!({"type": "function", "function": {"name": "get_weather", "arguments": {"city": city}}});
        let messages = [
            json!({"role": "assistant", "content": "", "tool_calls": [no_id("Paris"), no_id("Oslo")]}),
            json!({"role": "tool", "content": "18C"}),
            json!({"role": "tool", "content": "5C"}),
        ];
        assert_eq!(
            prepare_history(&messages),
            [
                json!({"role": "assistant", "content": "", "tool_calls": [no_id("Paris")]}),
                messages[1].clone(),
                json!({"role": "assistant", "content": "", "tool_calls": [no_id("Oslo")]}),
                messages[2].clone(),
            ]
        );
    }

    #[test]
    fn reasoning_effort_levels() {
        for (given, expected) in [
            ("none", "low"),
            ("minimal", "low"),
            ("low", "low"),
            ("high", "high"),
            ("xhigh", "high"),
        ] {
            let mut kwargs = Map::new();
            kwargs.insert("reasoning_effort".into(), given.into());
            prepare_template_kwargs(&mut kwargs);
            assert_eq!(kwargs["reasoning_effort"], expected);
        }
    }
}
