//! Structured output, enforced: a chat request's `response_format` and `tool_choice` become the
//! grammar its reply is generated under ([`oxlm_runtime::constraint`]), so that the reply
//! always parses: JSON valid under the schema, or calls of the request's tools in the model's
//! own tool-call format, which the output parser then reads back. Reasoning may come first,
//! unconstrained, as vLLM lets it. A schema the grammar engine cannot enforce is a 400 naming
//! what it cannot, never a reply that ignores it.

use oxlm_runtime::constraint::{compact_json_schema, Grammar, Grammars, TokenConstraint};
use serde_json::{json, Value};

use crate::error::ApiError;
use crate::harmony;
use crate::parsers::ToolFormat;
use crate::request::{tool_name, ChatRequest, ResponseFormat, ToolChoice};

/// What the reply looks like around what is enforced.
pub(crate) struct Markup<'a> {
    pub format: ToolFormat,
    /// The model's reasoning markers.
    pub think: Option<(&'a str, &'a str)>,
    /// The prompt opened a reasoning block that the reply continues.
    pub in_reasoning: bool,
}

/// Whether `req` asks for anything to be enforced.
pub(crate) fn enforces(req: &ChatRequest) -> bool {
    matches!(
        req.tool_choice,
        ToolChoice::Required | ToolChoice::Function(_)
    ) || req.response_format != ResponseFormat::Text
}

/// The field a grammar that cannot be enforced came from.
fn param(req: &ChatRequest) -> &'static str {
    if req.response_format != ResponseFormat::Text {
        "response_format"
    } else {
        "tool_choice"
    }
}

/// The constraint the reply to `req` (one that [`enforces`] something) is generated under, or
/// a 400 naming what cannot be enforced.
pub(crate) fn constraint(
    req: &ChatRequest,
    markup: &Markup,
    grammars: &Grammars,
) -> Result<TokenConstraint, ApiError> {
    let grammar = reply_grammar(req, markup, grammars);
    grammars.constraint(&grammar).map_err(|error| {
        // A schema at fault is named alone, so that the message speaks of it rather than of
        // the grammar around it; only a failing request pays for compiling it twice.
        check_schemas(req, grammars)
            .err()
            .unwrap_or_else(|| ApiError::invalid_param(param(req), error.to_string()))
    })
}

/// Refuses a schema the engine cannot enforce, naming the field it came from.
fn check_schemas(req: &ChatRequest, grammars: &Grammars) -> Result<(), ApiError> {
    let check = |schema: &Value, param: &str| {
        grammars
            .constraint(&Grammar::JsonSchema(schema.clone()))
            .map(drop)
            .map_err(|e| ApiError::invalid_param(param, e.to_string()))
    };
    if let ResponseFormat::JsonSchema { schema, .. } = &req.response_format {
        check(schema, "response_format")?;
    }
    if matches!(
        req.tool_choice,
        ToolChoice::Required | ToolChoice::Function(_)
    ) {
        let tools = req.tools.as_ref().and_then(Value::as_array);
        for (i, tool) in tools.into_iter().flatten().enumerate() {
            if let Some(parameters) = tool.pointer("/function/parameters") {
                check(parameters, &format!("tools[{i}].function.parameters"))?;
            }
        }
    }
    Ok(())
}

/// The grammar the reply to `req` (one that [`enforces`] something) must follow.
fn reply_grammar(req: &ChatRequest, markup: &Markup, grammars: &Grammars) -> Grammar {
    let tools: Vec<&Value> = req
        .tools
        .as_ref()
        .and_then(Value::as_array)
        .map(|tools| tools.iter().collect())
        .unwrap_or_default();
    let lark = Lark { grammars };
    let calls = match &req.tool_choice {
        ToolChoice::Required => Some(lark.calls(markup.format, &tools, req.parallel_tool_calls)),
        ToolChoice::Function(name) => {
            let tool: Vec<&Value> = tools
                .iter()
                .copied()
                .filter(|t| tool_name(t) == Some(name))
                .collect();
            Some(lark.calls(markup.format, &tool, false))
        }
        ToolChoice::Auto | ToolChoice::None => None,
    };
    let content = match &req.response_format {
        ResponseFormat::Text => None,
        ResponseFormat::JsonObject => Some(json_rule(&any_object())),
        ResponseFormat::JsonSchema { schema, .. } => Some(json_rule(schema)),
    };
    // Harmony's answer is a message of its own, on the final channel.
    let content = content.map(|json| match markup.format {
        ToolFormat::Harmony => format!(
            "{} \"final\" {} {json}",
            lark.literal(harmony::CHANNEL),
            lark.literal(harmony::MESSAGE)
        ),
        _ => json,
    });
    let body = match (calls, content) {
        (Some(calls), _) => calls,
        // Free to call a tool instead of answering (`tool_choice: auto`), as OpenAI allows.
        (None, Some(content)) if !tools.is_empty() && req.tool_choice == ToolChoice::Auto => {
            let calls = lark.calls(markup.format, &tools, req.parallel_tool_calls);
            format!("{content} | {calls}")
        }
        (None, Some(content)) => content,
        (None, None) => unreachable!("reply_grammar is only asked of requests that enforce"),
    };
    let (reasoning, reasoning_rules) = match markup.format {
        ToolFormat::Harmony => lark.harmony_analysis(),
        _ => lark.reasoning(markup),
    };
    Grammar::Lark(format!(
        "start: {reasoning} body\nbody: {body}\n{reasoning_rules}{}",
        lark.call_rules(markup.format)
    ))
}

/// Any JSON object, spelled out so that its numbers get [`compact_json_schema`]'s bounds (the
/// engine's own "any value" has none).
fn any_object() -> Value {
    let value = json!({"$ref": "#/$defs/value"});
    json!({
        "type": "object",
        "additionalProperties": value,
        "$defs": {"value": {"anyOf": [
            {"type": ["null", "boolean", "number", "string"]},
            {"type": "array", "items": value},
            {"type": "object", "additionalProperties": value},
        ]}},
    })
}

/// `%json {schema}`, written compactly (see [`compact_json_schema`]).
fn json_rule(schema: &Value) -> String {
    format!("%json {}", compact_json_schema(schema))
}

/// Builds Lark text for one vocabulary.
struct Lark<'a> {
    grammars: &'a Grammars,
}

impl Lark<'_> {
    /// `text` as the grammar must spell it: a special token by name, else a string literal.
    fn literal(&self, text: &str) -> String {
        if self.grammars.is_special_token(text) {
            text.to_owned()
        } else {
            Value::from(text).to_string()
        }
    }

    /// Free text up to and including `end`. A special token cannot end a lexeme (`suffix=`);
    /// it needs none, as no text matches it.
    fn text_until(&self, name: &str, end: &str) -> String {
        if self.grammars.is_special_token(end) {
            format!("{name}: /(.|\\n)*/ {end}\n")
        } else {
            format!("{name}[suffix={}]: /(.|\\n)*/\n", Value::from(end))
        }
    }

    /// Harmony's reasoning: an analysis message may come first, the reply then going on with
    /// the next message's header, up to its channel.
    fn harmony_analysis(&self) -> (String, String) {
        let rules = format!(
            "harmony_analysis: {} \"analysis\" {} thought {} \"assistant\"\n{}",
            self.literal(harmony::CHANNEL),
            self.literal(harmony::MESSAGE),
            self.literal(harmony::START),
            self.text_until("thought", harmony::END)
        );
        ("harmony_analysis?".to_owned(), rules)
    }

    /// What may come before the body: the rest of a reasoning block the prompt opened, a whole
    /// block if the model may open one, then the blank lines models write after one.
    fn reasoning(&self, markup: &Markup) -> (String, String) {
        let Some((open, close)) = markup.think else {
            return (String::new(), String::new());
        };
        let rules = format!("{}gap: /\\n{{0,2}}/\n", self.text_until("thought", close));
        let start = if markup.in_reasoning {
            "thought gap".to_owned()
        } else {
            format!("({} thought gap)?", self.literal(open))
        };
        (start, rules)
    }

    /// One call of any of `tools` (a tool being its OpenAI-format object) or, with `several`,
    /// any number from one, in the model's own format.
    fn calls(&self, format: ToolFormat, tools: &[&Value], several: bool) -> String {
        let call = match format {
            ToolFormat::Hermes => {
                let schema = call_schema(tools, "arguments");
                format!(
                    "{} \"\\n\" {} \"\\n\" {}",
                    self.literal("<tool_call>"),
                    json_rule(&schema),
                    self.literal("</tool_call>")
                )
            }
            // Its calls are bare JSON, one per reply.
            ToolFormat::Llama3Json => return json_rule(&call_schema(tools, "parameters")),
            ToolFormat::Qwen3Coder => format!(
                "{} \"\\n\" ({}) \"</function>\\n\" {}",
                self.literal("<tool_call>"),
                alternatives(tools, |name, _| format!(
                    "\"<function={name}>\\n\" qwen_parameter*"
                )),
                self.literal("</tool_call>")
            ),
            ToolFormat::Gemma4 => format!(
                "{} ({}) gemma_arguments",
                self.literal("<|tool_call>"),
                alternatives(tools, |name, _| format!("\"call:{name}{{\""))
            ),
            ToolFormat::MiniCpm5 => alternatives(tools, |name, tool| {
                let parameters = keyword_arguments(tool, "", |param, schema| {
                    // Values of other types than strings as its template writes them, Python's
                    // `str`; text runs to `</param>`.
                    let value = match python_typed_rule(schema) {
                        Some(rule) => format!("{rule} \"</param>\""),
                        None => "minicpm_value".to_owned(),
                    };
                    Some(format!("\"<param name=\\\"{param}\\\">\" {value}"))
                });
                format!("\"<function name=\\\"{name}\\\">\" {parameters} \"</function>\"")
            }),
            // Mistral's markers are special tokens that Lark names only by id (`<[id]>`), which
            // `Grammars` does not give: they are spelled out, which the parser reads the same.
            ToolFormat::MistralJson => {
                let mut list = json!({"type": "array", "items": call_schema(tools, "arguments"),
                                      "minItems": 1});
                if !several {
                    list["maxItems"] = json!(1);
                }
                return format!("\"[TOOL_CALLS]\" {}", json_rule(&list));
            }
            ToolFormat::MistralArgs => format!(
                "\"[TOOL_CALLS]\" ({})",
                alternatives(tools, |name, tool| format!(
                    "\"{name}[ARGS]\" {}",
                    json_rule(&parameters(tool))
                ))
            ),
            // One call, ended by `<|call|>`, which ends generation: a call is all there can be.
            // The recipient is where gpt-oss puts it, after the channel, or where its template
            // does, before.
            ToolFormat::Harmony => {
                let (channel, message) = (
                    self.literal(harmony::CHANNEL),
                    self.literal(harmony::MESSAGE),
                );
                return alternatives(tools, |name, tool| {
                    format!(
                        "({channel} \"commentary to=functions.{name}\" | \" to=functions.{name}\" \
                         {channel} \"commentary\") harmony_type? {message} {}",
                        json_rule(&parameters(tool))
                    )
                });
            }
            // One list holds every call.
            ToolFormat::Pythonic => {
                let call = alternatives(tools, |name, tool| {
                    let arguments = keyword_arguments(tool, "\", \"", |param, schema| {
                        let value = match schema.get("type").and_then(Value::as_str) {
                            Some("string") => "py_string",
                            _ => python_typed_rule(schema).unwrap_or("py_value"),
                        };
                        is_python_identifier(param).then(|| format!("\"{param}=\" {value}"))
                    });
                    format!("\"{name}(\" {arguments} \")\"")
                });
                let calls = if several {
                    format!("({call}) (\", \" ({call}))*")
                } else {
                    call
                };
                return format!("\"[\" ({calls}) \"]\"");
            }
        };
        let separator = match format {
            ToolFormat::Gemma4 | ToolFormat::MistralArgs => "",
            _ => "\"\\n\" ",
        };
        if several {
            format!("({call}) ({separator}({call}))*")
        } else {
            call
        }
    }

    /// The rules [`calls`](Self::calls) refers to.
    fn call_rules(&self, format: ToolFormat) -> String {
        match format {
            ToolFormat::Qwen3Coder => format!(
                "qwen_parameter: \"<parameter=\" /[A-Za-z0-9_.-]+/ \">\\n\" qwen_value\n{}",
                self.text_until("qwen_value", "\n</parameter>\n")
            ),
            ToolFormat::Gemma4 => self.text_until("gemma_arguments", "<tool_call|>"),
            ToolFormat::MiniCpm5 => format!(
                "{}{PYTHON_LITERAL_RULES}",
                self.text_until("minicpm_value", "</param>")
            ),
            ToolFormat::Pythonic => PYTHON_LITERAL_RULES.to_owned(),
            ToolFormat::Harmony => format!(
                "harmony_type: (\" \" | \" \" {constrain} | {constrain}) \"json\"\n",
                constrain = self.literal(harmony::CONSTRAIN)
            ),
            ToolFormat::Hermes
            | ToolFormat::Llama3Json
            | ToolFormat::MistralJson
            | ToolFormat::MistralArgs => String::new(),
        }
    }
}

/// Python literals, as the pythonic format's arguments and MiniCPM5's values other than
/// strings, written as `repr` writes them (double quotes, `", "` and `": "`), numbers held as
/// [`compact_json_schema`] holds JSON's.
const PYTHON_LITERAL_RULES: &str = r#"py_value: py_string | py_number | py_bool | "None" | py_list | py_dict
py_list: "[" (py_value (", " py_value)*)? "]"
py_dict: "{" (py_string ": " py_value (", " py_string ": " py_value)*)? "}"
py_bool: "True" | "False"
py_string: /"([^"\\\n]|\\["\\nt])*"/
py_int: /-?(0|[1-9][0-9]{0,15})/
py_number: /-?(0|[1-9][0-9]{0,15})(\.[0-9]{1,8})?/
"#;

/// The rule of [`PYTHON_LITERAL_RULES`] for a value of `schema`'s type, but for strings and
/// types it does not name.
fn python_typed_rule(schema: &Value) -> Option<&'static str> {
    match schema.get("type").and_then(Value::as_str)? {
        "integer" => Some("py_int"),
        "number" => Some("py_number"),
        "boolean" => Some("py_bool"),
        "array" => Some("py_list"),
        "object" => Some("py_dict"),
        "null" => Some("\"None\""),
        _ => None,
    }
}

fn is_python_identifier(name: &str) -> bool {
    name.starts_with(|c: char| c.is_alphabetic() || c == '_')
        && name.chars().all(|c| c.is_alphanumeric() || c == '_')
}

/// `a | b | ...` over the tools, each as `rule(name, tool)` (the name escaped for Lark strings).
fn alternatives(tools: &[&Value], rule: impl Fn(&str, &Value) -> String) -> String {
    tools
        .iter()
        .filter_map(|tool| Some(rule(&lark_escaped(tool_name(tool)?), tool)))
        .collect::<Vec<_>>()
        .join(" | ")
}

/// `text` escaped for a Lark string literal, without the quotes.
fn lark_escaped(text: &str) -> String {
    let quoted = Value::from(text).to_string();
    quoted[1..quoted.len() - 1].to_owned()
}

/// The arguments of a call of `tool`, each `argument(name, schema)` (the name escaped for Lark
/// strings; none leaves it out), between `separator`s: in the order of the tool's schema, each
/// at most once, the required ones always.
fn keyword_arguments(
    tool: &Value,
    separator: &str,
    argument: impl Fn(&str, &Value) -> Option<String>,
) -> String {
    let parameters = parameters(tool);
    let required: Vec<&str> = parameters["required"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .collect();
    let arguments: Vec<(String, bool)> = parameters["properties"]
        .as_object()
        .into_iter()
        .flatten()
        .filter_map(|(name, schema)| {
            let rule = argument(&lark_escaped(name), schema)?;
            Some((rule, required.contains(&name.as_str())))
        })
        .collect();
    // Each alternative starts at one argument, those before it left out: up to the first
    // required one, which cannot be.
    let rest = |from: usize| -> String {
        arguments[from..]
            .iter()
            .map(|(rule, required)| {
                if *required {
                    format!(" {separator} {rule}")
                } else {
                    format!(" ({separator} {rule})?")
                }
            })
            .collect()
    };
    let mut firsts = Vec::new();
    for (at, (rule, required)) in arguments.iter().enumerate() {
        firsts.push(format!("{rule}{}", rest(at + 1)));
        if *required {
            break;
        }
    }
    match (
        firsts.is_empty(),
        arguments.iter().any(|(_, required)| *required),
    ) {
        (true, _) => String::new(),
        (false, true) => format!("({})", firsts.join(" | ")),
        (false, false) => format!("({})?", firsts.join(" | ")),
    }
}

/// A tool's parameter schema; an object's where it gives none.
fn parameters(tool: &Value) -> Value {
    tool.pointer("/function/parameters")
        .cloned()
        .unwrap_or_else(|| json!({"type": "object"}))
}

/// A JSON call of one of `tools`: `{"name": ..., "<arguments>": {...}}`, the arguments under
/// the tool's parameter schema.
fn call_schema(tools: &[&Value], arguments: &str) -> Value {
    let calls: Vec<Value> = tools
        .iter()
        .filter_map(|tool| {
            let name = tool_name(tool)?;
            Some(json!({
                "type": "object",
                "properties": {"name": {"const": name}, arguments: parameters(tool)},
                "required": ["name", arguments],
                "additionalProperties": false,
            }))
        })
        .collect();
    match <[Value; 1]>::try_from(calls) {
        Ok([call]) => call,
        Err(calls) => json!({"anyOf": calls}),
    }
}

#[cfg(test)]
mod tests {
    use oxlm_runtime::tokenizer::Tokenizer;

    use super::*;
    use crate::request::{chat_request, Defaults};

    fn tokenizer() -> Tokenizer {
        let dir = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../tests/fixtures/tiny/tokenizer"
        );
        Tokenizer::from_dir(dir).unwrap()
    }

    fn request(extra: Value) -> ChatRequest {
        let mut body = json!({
            "messages": [{"role": "user", "content": "Time in Paris?"}],
            "tools": [{"type": "function", "function": {
                "name": "get_time",
                "parameters": {
                    "type": "object",
                    "properties": {"zone": {"type": "integer"}},
                    "required": ["zone"],
                },
            }}],
        });
        body.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        let defaults = Defaults {
            max_tokens: 100,
            ..Defaults::default()
        };
        chat_request(body.as_object().unwrap(), &defaults).unwrap()
    }

    /// Whether the grammar for `req` takes `reply` token by token and may end after it.
    fn takes(req: &ChatRequest, markup: &Markup, reply: &str) -> Result<(), String> {
        takes_with(&tokenizer(), req, markup, reply)
    }

    /// [`takes`], over the vocabulary of `tokenizer`.
    fn takes_with(
        tokenizer: &Tokenizer,
        req: &ChatRequest,
        markup: &Markup,
        reply: &str,
    ) -> Result<(), String> {
        let eos = tokenizer.eos_token_id().unwrap();
        let vocab = tokenizer.vocab_size();
        let grammars = Grammars::new(tokenizer, &[eos], vocab).unwrap();
        let grammar = reply_grammar(req, markup, &grammars);
        let mut constraint = grammars
            .constraint(&grammar)
            .map_err(|e| format!("{e}\n{grammar:?}"))?;
        for id in tokenizer.encode(reply, false).unwrap() {
            let mut logits = vec![0.0; vocab];
            constraint.mask(&mut logits).unwrap();
            if logits[id as usize].is_infinite() {
                let token = tokenizer.decode(&[id], false).unwrap();
                return Err(format!("{token:?} refused in {reply:?}\n{grammar:?}"));
            }
            constraint.accept(id).unwrap();
        }
        let mut logits = vec![0.0; vocab];
        constraint.mask(&mut logits).unwrap();
        if logits[eos as usize].is_infinite() {
            return Err(format!("no end allowed after {reply:?}"));
        }
        Ok(())
    }

    /// The calls the output parser reads from `reply`, as (name, arguments); the blanks
    /// between them aside, there must be nothing else.
    fn calls_read(req: &ChatRequest, format: ToolFormat, reply: &str) -> Vec<(String, Value)> {
        let tools = req.tools.clone().map(|t| (format, t));
        let mut parser = crate::parsers::OutputParser::new(None, false, tools);
        let mut pieces = parser.push(reply);
        pieces.extend(parser.finish());
        pieces
            .into_iter()
            .filter_map(|piece| match piece {
                crate::parsers::Piece::ToolCall(call) => {
                    Some((call.name, serde_json::from_str(&call.arguments).unwrap()))
                }
                crate::parsers::Piece::Content(blank) if blank.trim().is_empty() => None,
                other => panic!("{format:?}: {other:?} in {reply:?}"),
            })
            .collect()
    }

    /// Several calls in the layout of each format that has no JSON schema to hold them, their
    /// arguments typed and in the order of their tool's schema, the required ones given.
    #[test]
    fn several_calls_and_their_arguments_in_the_new_formats() {
        let tools = json!({"tools": [
            {"type": "function", "function": {"name": "get_time", "parameters": {
                "type": "object", "properties": {"zone": {"type": "integer"}}, "required": ["zone"]}}},
            {"type": "function", "function": {"name": "search", "parameters": {
                "type": "object", "properties": {"query": {"type": "string"},
                    "limit": {"type": "integer"}, "exact": {"type": "boolean"}},
                "required": ["query"]}}},
        ]});
        let mut required = tools.clone();
        required["tool_choice"] = json!("required");
        let required = request(required);
        let mut named = tools.clone();
        named["tool_choice"] = json!({"type": "function", "function": {"name": "get_time"}});
        let named = request(named);
        let mut one_call = tools;
        one_call["tool_choice"] = json!("required");
        one_call["parallel_tool_calls"] = json!(false);
        let one_call = request(one_call);
        let expected = [
            ("get_time".to_owned(), json!({"zone": 3})),
            (
                "search".to_owned(),
                json!({"query": "a < \"b\"", "exact": true}),
            ),
        ];
        let cases = [
            (
                ToolFormat::Pythonic,
                "[get_time(zone=3), search(query=\"a < \\\"b\\\"\", exact=True)]",
                vec![
                    "[search(limit=2, query=\"x\")]",
                    "[search(limit=2)]",
                    "[get_time(zone=\"3\")]",
                ],
            ),
            (
                ToolFormat::MiniCpm5,
                "<function name=\"get_time\"><param name=\"zone\">3</param></function>\n\
                 <function name=\"search\"><param name=\"query\">a < \"b\"</param>\
                 <param name=\"exact\">True</param></function>",
                vec![
                    "<function name=\"search\"><param name=\"limit\">2</param></function>",
                    "<function name=\"get_time\"><param name=\"zone\">three</param></function>",
                ],
            ),
            (
                ToolFormat::MistralArgs,
                "[TOOL_CALLS]get_time[ARGS]{\"zone\": 3}\
                 [TOOL_CALLS]search[ARGS]{\"query\": \"a < \\\"b\\\"\", \"exact\": true}",
                vec!["[TOOL_CALLS]search[ARGS]{\"limit\": 2}"],
            ),
            (
                ToolFormat::MistralJson,
                "[TOOL_CALLS][{\"name\": \"get_time\", \"arguments\": {\"zone\": 3}}, \
                 {\"name\": \"search\", \"arguments\": {\"query\": \"a < \\\"b\\\"\", \"exact\": true}}]",
                vec!["[TOOL_CALLS][]"],
            ),
        ];
        for (format, reply, refused) in cases {
            let markup = Markup {
                format,
                think: None,
                in_reasoning: false,
            };
            takes(&required, &markup, reply).unwrap();
            assert_eq!(calls_read(&required, format, reply), expected, "{format:?}");
            for reply in refused {
                assert!(takes(&required, &markup, reply).is_err(), "{reply}");
            }
            // A named function is called once, and so is any without parallel calls.
            assert!(takes(&named, &markup, reply).is_err(), "{format:?}");
            assert!(takes(&one_call, &markup, reply).is_err(), "{format:?}");
        }
    }

    #[test]
    fn each_tool_format_is_enforced_as_its_parser_reads_it() {
        let required = request(json!({"tool_choice": "required"}));
        let named =
            request(json!({"tool_choice": {"type": "function", "function": {"name": "get_time"}}}));
        let one_call = request(json!({"tool_choice": "required", "parallel_tool_calls": false}));
        let cases = [
            (
                ToolFormat::Hermes,
                "<tool_call>\n{\"name\": \"get_time\", \"arguments\": {\"zone\": 3}}\n</tool_call>",
            ),
            (
                ToolFormat::Llama3Json,
                "{\"name\": \"get_time\", \"parameters\": {\"zone\": 3}}",
            ),
            (
                ToolFormat::Qwen3Coder,
                "<tool_call>\n<function=get_time>\n<parameter=zone>\n3\n</parameter>\n\
                 </function>\n</tool_call>",
            ),
            (
                ToolFormat::Gemma4,
                "<|tool_call>call:get_time{zone:3}<tool_call|>",
            ),
            (
                ToolFormat::MiniCpm5,
                "<function name=\"get_time\"><param name=\"zone\">3</param></function>",
            ),
            (
                ToolFormat::MistralJson,
                "[TOOL_CALLS][{\"name\": \"get_time\", \"arguments\": {\"zone\": 3}}]",
            ),
            (
                ToolFormat::MistralArgs,
                "[TOOL_CALLS]get_time[ARGS]{\"zone\": 3}",
            ),
            (ToolFormat::Pythonic, "[get_time(zone=3)]"),
            (
                ToolFormat::Harmony,
                "<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>{\"zone\": 3}",
            ),
        ];
        for (format, reply) in cases {
            let markup = Markup {
                format,
                think: None,
                in_reasoning: false,
            };
            takes(&required, &markup, reply).unwrap();
            takes(&named, &markup, reply).unwrap();
            takes(&one_call, &markup, reply).unwrap();
            assert_eq!(
                calls_read(&required, format, reply),
                [("get_time".to_owned(), json!({"zone": 3}))],
                "{format:?}"
            );
            // A call of a tool the request does not give is refused.
            let other = reply.replace("get_time", "get_date");
            assert!(takes(&required, &markup, &other).is_err(), "{format:?}");
        }
    }

    #[test]
    fn reasoning_comes_first_unconstrained() {
        let schema = request(json!({"response_format": {"type": "json_object"}}));
        let open = Markup {
            format: ToolFormat::Hermes,
            think: Some(("<think>", "</think>")),
            in_reasoning: true,
        };
        takes(&schema, &open, "Any {thought}.\n</think>\n\n{\"a\": 1}").unwrap();
        assert!(takes(&schema, &open, "{\"a\": 1}").is_err());
        let closed = Markup {
            in_reasoning: false,
            ..open
        };
        takes(&schema, &closed, "<think>Hm.</think>\n{\"a\": 1}").unwrap();
        takes(&schema, &closed, "{\"a\": 1}").unwrap();
        // With tools offered and none required, a call is an answer too.
        takes(
            &schema,
            &closed,
            "<tool_call>\n{\"name\": \"get_time\", \"arguments\": {\"zone\": 1}}\n</tool_call>",
        )
        .unwrap();
    }

    /// The tiny tokenizer with harmony's markers as special tokens, as gpt-oss's vocabulary
    /// has them (a grammar names them rather than spelling them out).
    fn harmony_tokenizer(dir: &std::path::Path) -> Tokenizer {
        let source = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures/tiny/tokenizer");
        std::fs::copy(
            source.join("tokenizer_config.json"),
            dir.join("tokenizer_config.json"),
        )
        .unwrap();
        let text = std::fs::read_to_string(source.join("tokenizer.json")).unwrap();
        let mut json: Value = serde_json::from_str(&text).unwrap();
        let markers = [
            harmony::START,
            harmony::END,
            harmony::MESSAGE,
            harmony::CHANNEL,
            harmony::CONSTRAIN,
            harmony::RETURN,
            harmony::CALL,
        ];
        let added = json["added_tokens"].as_array_mut().unwrap();
        for (id, content) in (512..).zip(markers) {
            added.push(json!({"id": id, "content": content, "single_word": false,
                "lstrip": false, "rstrip": false, "normalized": false, "special": true}));
        }
        std::fs::write(dir.join("tokenizer.json"), json.to_string()).unwrap();
        Tokenizer::from_dir(dir).unwrap()
    }

    /// The pieces the harmony parser reads from `reply`.
    fn harmony_pieces(req: &ChatRequest, reply: &str) -> Vec<crate::parsers::Piece> {
        let mut parser = crate::parsers::OutputParser::for_model(
            ToolFormat::Harmony,
            None,
            false,
            req.tools.clone(),
        );
        let mut pieces = parser.push(reply);
        pieces.extend(parser.finish());
        pieces
    }

    /// Harmony: an analysis message may come first, then the call (on the commentary channel,
    /// the recipient after the channel or before it) or the answer (on the final channel),
    /// whether the vocabulary has the markers as special tokens (as gpt-oss's) or not.
    #[test]
    fn harmony_calls_and_answers_after_an_analysis() {
        use crate::parsers::{Piece, ToolCall};
        let dir = tempfile::tempdir().unwrap();
        let special = harmony_tokenizer(dir.path());
        let plain = tokenizer();
        let markup = Markup {
            format: ToolFormat::Harmony,
            think: None,
            in_reasoning: false,
        };
        let required = request(json!({"tool_choice": "required"}));
        let named =
            request(json!({"tool_choice": {"type": "function", "function": {"name": "get_time"}}}));
        let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}},
                            "required": ["a"], "additionalProperties": false});
        let answer = request(json!({"tool_choice": "none", "response_format": {
            "type": "json_schema", "json_schema": {"name": "a", "schema": schema}}}));
        let answer_or_call = request(json!({"response_format": {"type": "json_object"}}));
        let analysis = "<|channel|>analysis<|message|>The user wants the time.\nZone 3.<|end|>\
                        <|start|>assistant";
        let call = Piece::ToolCall(ToolCall {
            name: "get_time".into(),
            arguments: "{\"zone\":3}".into(),
        });
        let thought = Piece::Reasoning("The user wants the time.\nZone 3.".into());
        let eos = plain.eos_token_id().unwrap();
        let grammars = Grammars::new(&special, &[eos], special.vocab_size()).unwrap();
        assert!(grammars.is_special_token(harmony::CHANNEL));
        let grammar = reply_grammar(&required, &markup, &grammars);
        let Grammar::Lark(lark) = &grammar else {
            panic!("{grammar:?}")
        };
        assert!(lark.contains("thought: /(.|\\n)*/ <|end|>\n"), "{lark}");
        for tokenizer in [&special, &plain] {
            for reply in [
                "<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>{\"zone\": 3}",
                "<|channel|>commentary to=functions.get_time<|constrain|>json<|message|>{\"zone\": 3}",
                " to=functions.get_time<|channel|>commentary json<|message|>{\"zone\": 3}",
                "<|channel|>commentary to=functions.get_time<|message|>{\"zone\": 3}",
            ] {
                for req in [&required, &named, &answer_or_call] {
                    takes_with(tokenizer, req, &markup, reply).unwrap();
                    let reasoned = format!("{analysis}{reply}");
                    takes_with(tokenizer, req, &markup, &reasoned).unwrap();
                    assert_eq!(harmony_pieces(req, reply), std::slice::from_ref(&call));
                    assert_eq!(
                        harmony_pieces(req, &reasoned),
                        [thought.clone(), call.clone()]
                    );
                }
                assert!(takes_with(tokenizer, &answer, &markup, reply).is_err());
            }
            let json_answer = "<|channel|>final<|message|>{\"a\": 1}";
            for reply in [json_answer.to_owned(), format!("{analysis}{json_answer}")] {
                takes_with(tokenizer, &answer, &markup, &reply).unwrap();
                takes_with(tokenizer, &answer_or_call, &markup, &reply).unwrap();
                assert!(takes_with(tokenizer, &required, &markup, &reply).is_err());
                assert_eq!(
                    harmony_pieces(&answer, &reply).last(),
                    Some(&Piece::Content("{\"a\": 1}".into()))
                );
            }
            for refused in [
                // No header, another channel, a tool the request does not give, another
                // schema, arguments that are not the tool's.
                "{\"a\": 1}",
                "<|channel|>commentary<|message|>{\"a\": 1}",
                "<|channel|>analysis<|message|>{\"a\": 1}",
                "<|channel|>final<|message|>{\"a\": \"1\"}",
            ] {
                assert!(
                    takes_with(tokenizer, &answer, &markup, refused).is_err(),
                    "{refused}"
                );
            }
            for refused in [
                "<|channel|>commentary to=functions.get_date <|constrain|>json<|message|>{\"zone\": 3}",
                "<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>{\"zone\": \"3\"}",
                "<|channel|>final<|message|>It is noon.",
                "<|channel|>analysis<|message|>Hm.<|end|><|start|>assistant<|channel|>final<|message|>Noon.",
            ] {
                assert!(takes_with(tokenizer, &required, &markup, refused).is_err(), "{refused}");
            }
        }
    }
}
