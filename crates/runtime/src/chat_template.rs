//! Chat-template rendering as transformers 5.24 does it (transformers/utils/chat_template_utils.py
//! `render_jinja_template`, called by `PreTrainedTokenizerBase.apply_chat_template`), on minijinja.
//!
//! Matched behaviour:
//! - Template source (tokenization_utils_base.py `from_pretrained`/`get_chat_template`): `chat_template.jinja`
//!   and `additional_chat_templates/*.jinja` in the model directory replace tokenizer_config.json's
//!   `chat_template` (a string, or a list of `{name, template}`). With several templates, `tool_use` is used when
//!   tools are passed and it exists, otherwise `default`.
//! - Environment: `trim_blocks`, `lstrip_blocks`, no trailing newline kept, loop controls, lenient undefined;
//!   globals `raise_exception(msg)` (a [`ChatTemplateError::Raised`] carrying `msg`), `strftime_now(fmt)`,
//!   `namespace`, `dict`; `tojson` replaced by Python's `json.dumps(x, ensure_ascii=False, indent=None,
//!   separators=None, sort_keys=False)`; Python string/dict methods through minijinja-contrib's pycompat.
//!   transformers' `{% generation %}` block renders its body unchanged.
//! - Context: the tokenizer's `special_tokens_map` (bos_token, eos_token, ...), then the caller's extra kwargs
//!   (which win), then `messages` (keys whose value is null dropped, `reasoning_content`/`thinking`/`reasoning`
//!   aliased as `_alias_reasoning_fields` does), `tools` (null when absent, so `tools is defined` holds),
//!   `documents` (null unless given in the extra kwargs) and `add_generation_prompt`.
//!
//! mlx-lm's `TokenizerWrapper.apply_chat_template` also passes `enable_thinking` (true when the vocabulary has
//! think tokens, see `Tokenizer::think_markers`) unless the caller sets it; that is the caller's job here.
//!
//! `strftime_now` reads the clock in UTC (Python uses local time; both agree on machines running in UTC);
//! [`ChatTemplate::with_fixed_now`] pins it.
//!
//! `{{ }}` and `|string` print values as Python's `str` does (`True`, `None`, `1e-05`, `[1, 'a']`,
//! `{'k': None}`). Known differences from jinja2: `~` joins lists and dicts in minijinja's JSON-like spelling;
//! iterating over `none` renders nothing where Python raises; `Markup` escaping after `|safe` is not
//! reproduced; Python's `repr` escapes of non-printable Unicode other than control characters are not either.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use minijinja::value::{from_args, Kwargs, Rest, ValueKind};
use minijinja::{Environment, Error, ErrorKind, Value as JValue};
use serde_json::{Map, Value};

use crate::tokenizer::{load_tokenizer_config, read_text, special_tokens_for_dir, TokenizerError};

/// Errors from loading or rendering a chat template.
#[derive(Debug, thiserror::Error)]
pub enum ChatTemplateError {
    #[error(transparent)]
    Load(#[from] TokenizerError),
    #[error("{path}: {message}")]
    Invalid { path: PathBuf, message: String },
    #[error("chat template does not compile: {0}")]
    Syntax(String),
    /// The template called `raise_exception(message)`.
    #[error("{0}")]
    Raised(String),
    #[error("chat template rendering failed: {0}")]
    Render(String),
    #[error("invalid chat input: {0}")]
    Input(String),
}

pub type Result<T, E = ChatTemplateError> = std::result::Result<T, E>;

/// A wall-clock time for `strftime_now`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CivilDateTime {
    pub year: i64,
    pub month: u32,
    pub day: u32,
    pub hour: u32,
    pub minute: u32,
    pub second: u32,
}

impl CivilDateTime {
    /// Parses `YYYY-MM-DDTHH:MM:SS` (the form Python's `datetime.isoformat()` writes).
    pub fn parse_iso(text: &str) -> Option<Self> {
        let (date, time) = text.split_once(['T', ' '])?;
        let mut d = date.splitn(3, '-');
        let mut t = time.splitn(3, ':');
        let dt = Self {
            year: d.next()?.parse().ok()?,
            month: d.next()?.parse().ok()?,
            day: d.next()?.parse().ok()?,
            hour: t.next()?.parse().ok()?,
            minute: t.next()?.parse().ok()?,
            second: t.next()?.split('.').next()?.parse().ok()?,
        };
        let valid = (1..=12).contains(&dt.month)
            && (1..=days_in_month(dt.year, dt.month)).contains(&dt.day)
            && dt.hour < 24
            && dt.minute < 60
            && dt.second < 60;
        valid.then_some(dt)
    }

    fn from_unix(secs: i64) -> Self {
        // Howard Hinnant's civil_from_days
        let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
        let z = days + 719_468;
        let era = z.div_euclid(146_097);
        let doe = z.rem_euclid(146_097);
        let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
        let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
        let mp = (5 * doy + 2) / 153;
        let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
        let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
        let year = yoe + era * 400 + i64::from(month <= 2);
        Self {
            year,
            month,
            day,
            hour: (rem / 3600) as u32,
            minute: (rem % 3600 / 60) as u32,
            second: (rem % 60) as u32,
        }
    }

    fn now_utc() -> Self {
        let secs = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs() as i64);
        Self::from_unix(secs)
    }

    /// Day of the week, 0 = Monday.
    fn weekday(&self) -> u32 {
        (self.days_from_epoch() + 3).rem_euclid(7) as u32
    }

    fn day_of_year(&self) -> u32 {
        (1..self.month)
            .map(|m| days_in_month(self.year, m))
            .sum::<u32>()
            + self.day
    }

    fn days_from_epoch(&self) -> i64 {
        // Howard Hinnant's days_from_civil
        let y = self.year - i64::from(self.month <= 2);
        let era = y.div_euclid(400);
        let yoe = y.rem_euclid(400);
        let m = i64::from(self.month);
        let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + i64::from(self.day) - 1;
        let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
        era * 146_097 + doe - 719_468
    }

    /// C `strftime` for the directives chat templates use (glibc's `%-d` style unpadded forms included);
    /// other directives are kept as written.
    fn strftime(&self, format: &str) -> String {
        const DAYS: [&str; 7] = [
            "Monday",
            "Tuesday",
            "Wednesday",
            "Thursday",
            "Friday",
            "Saturday",
            "Sunday",
        ];
        const MONTHS: [&str; 12] = [
            "January",
            "February",
            "March",
            "April",
            "May",
            "June",
            "July",
            "August",
            "September",
            "October",
            "November",
            "December",
        ];
        let mut out = String::new();
        let mut chars = format.chars().peekable();
        while let Some(c) = chars.next() {
            if c != '%' {
                out.push(c);
                continue;
            }
            let unpadded = chars.next_if_eq(&'-').is_some();
            let num = |out: &mut String, n: u32, width: usize| {
                let _ = if unpadded {
                    write!(out, "{n}")
                } else {
                    write!(out, "{n:0width$}")
                };
            };
            let hour12 = match self.hour % 12 {
                0 => 12,
                h => h,
            };
            match chars.next() {
                Some('a') => out.push_str(&DAYS[self.weekday() as usize][..3]),
                Some('A') => out.push_str(DAYS[self.weekday() as usize]),
                Some('b') | Some('h') => out.push_str(&MONTHS[self.month as usize - 1][..3]),
                Some('B') => out.push_str(MONTHS[self.month as usize - 1]),
                Some('d') => num(&mut out, self.day, 2),
                Some('e') => {
                    let _ = write!(out, "{:>2}", self.day);
                }
                Some('H') => num(&mut out, self.hour, 2),
                Some('I') => num(&mut out, hour12, 2),
                Some('j') => num(&mut out, self.day_of_year(), 3),
                Some('m') => num(&mut out, self.month, 2),
                Some('M') => num(&mut out, self.minute, 2),
                Some('p') => out.push_str(if self.hour < 12 { "AM" } else { "PM" }),
                Some('S') => num(&mut out, self.second, 2),
                Some('y') => num(&mut out, self.year.rem_euclid(100) as u32, 2),
                Some('Y') => {
                    let _ = write!(out, "{}", self.year);
                }
                Some('F') => {
                    let _ = write!(out, "{}-{:02}-{:02}", self.year, self.month, self.day);
                }
                Some('%') => out.push('%'),
                Some(other) => {
                    out.push('%');
                    if unpadded {
                        out.push('-');
                    }
                    out.push(other);
                }
                None => out.push('%'),
            }
        }
        out
    }
}

fn days_in_month(year: i64, month: u32) -> u32 {
    let leap = (year.rem_euclid(4) == 0 && year.rem_euclid(100) != 0) || year.rem_euclid(400) == 0;
    match month {
        2 if leap => 29,
        2 => 28,
        4 | 6 | 9 | 11 => 30,
        _ => 31,
    }
}

/// The error `raise_exception` raises, found again in the error chain to report its message verbatim.
#[derive(Debug)]
struct TemplateException(String);

impl std::fmt::Display for TemplateException {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for TemplateException {}

fn raise_exception(message: JValue) -> Result<JValue, Error> {
    // Python formats whatever it is given; templates pass strings.
    let message = message.to_string();
    Err(Error::new(ErrorKind::InvalidOperation, message.clone())
        .with_source(TemplateException(message)))
}

/// A model's chat template(s), ready to render.
pub struct ChatTemplate {
    env: Environment<'static>,
    /// Template names loaded into `env` (`default`, `tool_use`, ...).
    names: Vec<String>,
    /// Template sources by name (`continue_final_message` checks the source).
    sources: BTreeMap<String, String>,
    special: Map<String, Value>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("names", &self.names)
            .field("special", &self.special)
            .finish_non_exhaustive()
    }
}

impl ChatTemplate {
    /// Loads the chat template(s) of a model directory, with the special tokens its tokenizer passes to them.
    /// `Ok(None)` when the model has no chat template.
    pub fn from_dir(dir: impl AsRef<Path>) -> Result<Option<Self>> {
        let dir = dir.as_ref();
        let mut templates: Vec<(String, String)> = Vec::new();
        let file = dir.join("chat_template.jinja");
        if file.exists() {
            templates.push(("default".into(), read_text(&file)?));
        }
        let extra_dir = dir.join("additional_chat_templates");
        if extra_dir.is_dir() {
            let entries = std::fs::read_dir(&extra_dir).map_err(|source| TokenizerError::Io {
                path: extra_dir.clone(),
                source,
            })?;
            let mut files: Vec<PathBuf> = entries
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|e| e == "jinja"))
                .collect();
            files.sort();
            for path in files {
                let name = path
                    .file_stem()
                    .unwrap_or_default()
                    .to_string_lossy()
                    .into_owned();
                templates.push((name, read_text(&path)?));
            }
        }
        if templates.is_empty() {
            let config_path = dir.join("tokenizer_config.json");
            let config = load_tokenizer_config(dir)?;
            match config.get("chat_template") {
                None | Some(Value::Null) => {}
                Some(Value::String(source)) => templates.push(("default".into(), source.clone())),
                Some(Value::Array(list)) => {
                    for entry in list {
                        let name = entry.get("name").and_then(Value::as_str);
                        let source = entry.get("template").and_then(Value::as_str);
                        let (Some(name), Some(source)) = (name, source) else {
                            return Err(ChatTemplateError::Invalid {
                                path: config_path,
                                message:
                                    "chat_template entries need a string `name` and `template`"
                                        .into(),
                            });
                        };
                        templates.push((name.into(), source.into()));
                    }
                }
                Some(_) => {
                    return Err(ChatTemplateError::Invalid {
                        path: config_path,
                        message: "chat_template must be a string or a list of {name, template}"
                            .into(),
                    })
                }
            }
        }
        if templates.is_empty() {
            return Ok(None);
        }
        let special = special_tokens_for_dir(dir)?
            .iter()
            .map(|(k, v)| (k.to_owned(), Value::from(v)))
            .collect();
        Self::with_templates(templates, special).map(Some)
    }

    /// A single template with the given special-token variables (`{"bos_token": "<s>", ...}`).
    pub fn new(source: &str, special: Map<String, Value>) -> Result<Self> {
        Self::with_templates(vec![("default".into(), source.into())], special)
    }

    fn with_templates(
        templates: Vec<(String, String)>,
        special: Map<String, Value>,
    ) -> Result<Self> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_filter("tojson", tojson);
        env.add_function("raise_exception", raise_exception);
        // jinja2: none is not iterable; undefined, strings and dicts count as sequences.
        env.add_test("iterable", |v: JValue| {
            v.kind() != ValueKind::None && v.try_iter().is_ok()
        });
        env.add_test("sequence", |v: JValue| {
            matches!(
                v.kind(),
                ValueKind::Seq
                    | ValueKind::Map
                    | ValueKind::String
                    | ValueKind::Bytes
                    | ValueKind::Undefined
            )
        });
        env.set_formatter(python_formatter);
        env.add_filter("string", |v: JValue| python_str(&v));
        set_clock(&mut env, None);
        let mut names = Vec::new();
        let mut sources = BTreeMap::new();
        for (name, source) in templates {
            env.add_template_owned(name.clone(), strip_generation_tags(&source))
                .map_err(|e| ChatTemplateError::Syntax(format!("{e:#}")))?;
            sources.insert(name.clone(), source);
            names.push(name);
        }
        Ok(Self {
            env,
            names,
            sources,
            special,
        })
    }

    /// Pins `strftime_now` to a fixed wall-clock time (for reproducible dates, e.g. in tests).
    pub fn with_fixed_now(mut self, now: CivilDateTime) -> Self {
        set_clock(&mut self.env, Some(now));
        self
    }

    /// The source text of every template (a server infers the model's tool-call format from it).
    pub fn sources(&self) -> impl Iterator<Item = &str> {
        self.sources.values().map(String::as_str)
    }

    /// The special-token variables passed to the template.
    pub fn special_tokens(&self) -> &Map<String, Value> {
        &self.special
    }

    /// Renders `messages` (a JSON array of message objects; `content` a string or a list of parts).
    /// `extra` holds further template kwargs such as `enable_thinking`; they override special tokens.
    pub fn render(
        &self,
        messages: &Value,
        tools: Option<&Value>,
        add_generation_prompt: bool,
        extra: &Map<String, Value>,
    ) -> Result<String> {
        let messages = prepare_messages(messages)?;
        let name = self.template_name(tools)?;
        self.render_prepared(name, messages, tools, add_generation_prompt, extra)
    }

    /// Renders a conversation whose last message is to be continued by the model (transformers
    /// `continue_final_message=True`, used by mlx-lm's `--prefill-response`): the output ends with that
    /// message's content, without the template's end-of-turn markup.
    pub fn render_continuing(
        &self,
        messages: &Value,
        tools: Option<&Value>,
        extra: &Map<String, Value>,
    ) -> Result<String> {
        const TAG: &str = "CONTINUE_FINAL_MESSAGE_TAG ";
        let mut messages = prepare_messages(messages)?;
        let name = self.template_name(tools)?;
        if !self.sources[name].contains("content") {
            return Err(ChatTemplateError::Input(
                "continue_final_message is set to \"content\" but this is not an accepted field in the chat_template"
                    .into(),
            ));
        }
        let last = messages.last_mut().and_then(Value::as_object_mut);
        let final_text = match last.and_then(|m| m.get_mut("content")) {
            Some(Value::String(content)) => {
                let text = content.clone();
                content.push_str(TAG);
                text
            }
            Some(Value::Array(parts)) => {
                let block = parts
                    .iter_mut()
                    .rev()
                    .find_map(|p| p.get_mut("text").filter(|t| t.is_string()));
                let Some(Value::String(text)) = block else {
                    return Err(ChatTemplateError::Input(
                        "continue_final_message is set but we could not find any text to continue in the final message!"
                            .into(),
                    ));
                };
                let original = text.clone();
                text.push_str(TAG);
                original
            }
            _ => {
                return Err(ChatTemplateError::Input(
                    "continue_final_message is set but the final message has no \"content\" to continue!".into(),
                ))
            }
        };
        let rendered = self.render_prepared(name, messages, tools, false, extra)?;
        let tag = TAG.trim();
        let tag_loc = rendered
            .rfind(tag)
            .filter(|_| rendered.contains(final_text.trim()));
        let Some(tag_loc) = tag_loc else {
            return Err(ChatTemplateError::Input(
                "continue_final_message is set but the final message does not appear in the chat after applying the chat template!"
                    .into(),
            ));
        };
        Ok(if rendered[tag_loc..].starts_with(TAG) {
            rendered[..tag_loc].to_owned()
        } else {
            // The template trimmed the message's trailing space.
            rendered[..tag_loc].trim_end().to_owned()
        })
    }

    fn template_name(&self, tools: Option<&Value>) -> Result<&str> {
        let has = |n: &str| self.names.iter().any(|x| x == n);
        if tools.is_some() && has("tool_use") {
            Ok("tool_use")
        } else if has("default") {
            Ok("default")
        } else {
            Err(ChatTemplateError::Input(format!(
                "This model has multiple chat templates with no default specified! Available template names are {:?}.",
                self.names
            )))
        }
    }

    fn render_prepared(
        &self,
        name: &str,
        messages: Vec<Value>,
        tools: Option<&Value>,
        add_generation_prompt: bool,
        extra: &Map<String, Value>,
    ) -> Result<String> {
        let mut context = self.special.clone();
        context.extend(extra.iter().map(|(k, v)| (k.clone(), v.clone())));
        let documents = extra.get("documents").cloned().unwrap_or(Value::Null);
        context.insert("messages".into(), Value::Array(messages));
        context.insert("tools".into(), tools.cloned().unwrap_or(Value::Null));
        context.insert("documents".into(), documents);
        context.insert(
            "add_generation_prompt".into(),
            Value::Bool(add_generation_prompt),
        );
        let template = self
            .env
            .get_template(name)
            .map_err(|e| ChatTemplateError::Render(format!("{e:#}")))?;
        template
            .render(JValue::from_serialize(&context))
            .map_err(render_error)
    }
}

fn render_error(err: Error) -> ChatTemplateError {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(&err);
    while let Some(e) = source {
        if let Some(TemplateException(message)) = e.downcast_ref::<TemplateException>() {
            return ChatTemplateError::Raised(message.clone());
        }
        source = e.source();
    }
    ChatTemplateError::Render(format!("{err:#}"))
}

fn set_clock(env: &mut Environment<'static>, fixed: Option<CivilDateTime>) {
    let fixed = Arc::new(fixed);
    env.add_function("strftime_now", move |format: String| {
        fixed
            .unwrap_or_else(CivilDateTime::now_utc)
            .strftime(&format)
    });
}

/// `{{ value }}` as jinja2 prints it: Python's `str` for lists, dicts and floats.
fn python_formatter(
    out: &mut minijinja::Output,
    state: &minijinja::State,
    value: &JValue,
) -> Result<(), Error> {
    match value.kind() {
        ValueKind::Seq | ValueKind::Map | ValueKind::Number => {
            out.write_str(&python_str(value)?).map_err(Error::from)
        }
        _ => minijinja::escape_formatter(out, state, value),
    }
}

/// Python's `str(value)` (the `string` filter).
fn python_str(value: &JValue) -> Result<String, Error> {
    let mut out = String::new();
    match value.kind() {
        ValueKind::String => out.push_str(value.as_str().unwrap_or_default()),
        _ => python_repr(value, &mut out)?,
    }
    Ok(out)
}

/// Python's `repr` of a JSON-like value.
fn python_repr(value: &JValue, out: &mut String) -> Result<(), Error> {
    match value.kind() {
        ValueKind::String => {
            let s = value.as_str().unwrap_or_default();
            let quote = if s.contains('\'') && !s.contains('"') {
                '"'
            } else {
                '\''
            };
            out.push(quote);
            for c in s.chars() {
                match c {
                    '\\' => out.push_str("\\\\"),
                    '\n' => out.push_str("\\n"),
                    '\r' => out.push_str("\\r"),
                    '\t' => out.push_str("\\t"),
                    c if c == quote => {
                        out.push('\\');
                        out.push(c);
                    }
                    c if c.is_control() => {
                        let _ = write!(out, "\\x{:02x}", c as u32);
                    }
                    c => out.push(c),
                }
            }
            out.push(quote);
        }
        ValueKind::Number if !value.is_integer() => {
            out.push_str(&py_float_str(f64::try_from(value.clone())?))
        }
        ValueKind::Seq | ValueKind::Iterable => {
            out.push('[');
            for (i, item) in value.try_iter()?.enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                python_repr(&item, out)?;
            }
            out.push(']');
        }
        ValueKind::Map => {
            out.push('{');
            for (i, key) in value.try_iter()?.enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                python_repr(&key, out)?;
                out.push_str(": ");
                python_repr(&value.get_item(&key)?, out)?;
            }
            out.push('}');
        }
        // None, booleans and integers already print as Python spells them.
        _ => {
            let _ = write!(out, "{value}");
        }
    }
    Ok(())
}

/// Python's `str(float)`: like [`py_float_repr`] but `inf`/`nan` for the non-finite values.
fn py_float_str(x: f64) -> String {
    match x {
        x if x.is_nan() => "nan".into(),
        x if x.is_infinite() => (if x > 0.0 { "inf" } else { "-inf" }).into(),
        x => py_float_repr(x),
    }
}

/// transformers `_normalize_chat_messages` (drop null-valued keys) and `_alias_reasoning_fields`.
fn prepare_messages(messages: &Value) -> Result<Vec<Value>> {
    let Value::Array(list) = messages else {
        return Err(ChatTemplateError::Input(
            "messages must be a JSON array".into(),
        ));
    };
    if list.is_empty() {
        return Err(ChatTemplateError::Input(
            "Cannot apply chat template to an empty conversation. Provide at least one message."
                .into(),
        ));
    }
    list.iter()
        .map(|message| {
            let Value::Object(message) = message else {
                return Err(ChatTemplateError::Input(format!(
                    "Chat messages should be objects, but got {message}"
                )));
            };
            let mut message: Map<String, Value> = message
                .iter()
                .filter(|(_, v)| !v.is_null())
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect();
            let reasoning = ["reasoning_content", "thinking", "reasoning"]
                .iter()
                .find_map(|k| message.get(*k))
                .cloned();
            if let Some(reasoning) = reasoning {
                // {"thinking": r, **message, "reasoning_content": r}: `thinking` first unless already present
                let mut aliased = Map::new();
                aliased.insert("thinking".into(), reasoning.clone());
                aliased.extend(message);
                aliased.insert("reasoning_content".into(), reasoning);
                message = aliased;
            }
            Ok(Value::Object(message))
        })
        .collect()
}

/// Rewrites transformers' `{% generation %}...{% endgeneration %}` (an assistant-mask marker that renders its
/// body unchanged) into an always-true `if`, keeping the tags' whitespace control.
fn strip_generation_tags(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(start) = rest.find("{%") {
        out.push_str(&rest[..start]);
        let tag = &rest[start..];
        // The tag's end comes after its start: `{%}` is no tag (it may sit in a comment).
        let Some(end) = tag[2..].find("%}").map(|at| at + 2) else {
            out.push_str(tag);
            return out;
        };
        let inner = &tag[2..end];
        let body = inner
            .trim_start_matches(['-', '+'])
            .trim_end_matches(['-', '+'])
            .trim();
        let replacement = match body {
            "generation" => Some("if true"),
            "endgeneration" => Some("endif"),
            _ => None,
        };
        match replacement {
            Some(word) => {
                let open = &inner[..inner.len() - inner.trim_start_matches(['-', '+']).len()];
                let close = &inner[inner.trim_end_matches(['-', '+']).len()..];
                let _ = write!(out, "{{%{open} {word} {close}%}}");
            }
            None => out.push_str(&tag[..end + 2]),
        }
        rest = &tag[end + 2..];
    }
    out.push_str(rest);
    out
}

/// transformers' `tojson`: `json.dumps(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)`.
fn tojson(value: JValue, args: Rest<JValue>) -> Result<String, Error> {
    let (positional, kwargs): (&[JValue], Kwargs) = from_args(&args)?;
    let arg = |i: usize, name: &str| -> Result<Option<JValue>, Error> {
        match (positional.get(i), kwargs.get::<Option<JValue>>(name)?) {
            (Some(_), Some(_)) => Err(Error::new(
                ErrorKind::TooManyArguments,
                format!("tojson got multiple values for argument '{name}'"),
            )),
            (p, k) => Ok(p.cloned().or(k)),
        }
    };
    if positional.len() > 4 {
        return Err(Error::from(ErrorKind::TooManyArguments));
    }
    let ensure_ascii = arg(0, "ensure_ascii")?.is_some_and(|v| v.is_true());
    let indent = match arg(1, "indent")? {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => match (v.as_i64(), v.as_str()) {
            (Some(n), _) => Some(" ".repeat(n.max(0) as usize)),
            (_, Some(s)) => Some(s.to_owned()),
            _ => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    "tojson indent must be an int or a string",
                ))
            }
        },
    };
    let (item_sep, key_sep) = match arg(2, "separators")? {
        Some(v) if !v.is_none() => {
            let parts: Vec<JValue> = v.try_iter()?.collect();
            match parts.as_slice() {
                [a, b] if a.as_str().is_some() && b.as_str().is_some() => (
                    a.as_str().unwrap_or_default().to_owned(),
                    b.as_str().unwrap_or_default().to_owned(),
                ),
                _ => {
                    return Err(Error::new(
                        ErrorKind::InvalidOperation,
                        "tojson separators must be two strings",
                    ))
                }
            }
        }
        // Python's defaults: ", " without indent, "," with it.
        _ => (
            (if indent.is_some() { "," } else { ", " }).to_owned(),
            ": ".to_owned(),
        ),
    };
    let sort_keys = arg(3, "sort_keys")?.is_some_and(|v| v.is_true());
    kwargs.assert_all_used()?;
    let dumper = JsonDumper {
        ensure_ascii,
        indent,
        item_sep,
        key_sep,
        sort_keys,
    };
    let mut out = String::new();
    dumper.dump(&value, 0, &mut out)?;
    Ok(out)
}

struct JsonDumper {
    ensure_ascii: bool,
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
}

impl JsonDumper {
    fn dump(&self, value: &JValue, level: usize, out: &mut String) -> Result<(), Error> {
        match value.kind() {
            ValueKind::None => out.push_str("null"),
            ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
            ValueKind::Number if value.is_integer() => {
                let _ = write!(out, "{value}");
            }
            ValueKind::Number => out.push_str(&py_float_repr(f64::try_from(value.clone())?)),
            ValueKind::String => self.dump_str(value.as_str().unwrap_or_default(), out),
            ValueKind::Seq | ValueKind::Iterable => {
                let items: Vec<JValue> = value.try_iter()?.collect();
                self.dump_container(out, level, '[', ']', &items, |item, out| {
                    self.dump(item, level + 1, out)
                })?;
            }
            ValueKind::Map => {
                let mut pairs: Vec<(String, JValue)> = Vec::new();
                for key in value.try_iter()? {
                    let item = value.get_item(&key)?;
                    pairs.push((json_key(&key)?, item));
                }
                if self.sort_keys {
                    pairs.sort_by(|a, b| a.0.cmp(&b.0));
                }
                self.dump_container(out, level, '{', '}', &pairs, |(key, item), out| {
                    self.dump_str(key, out);
                    out.push_str(&self.key_sep);
                    self.dump(item, level + 1, out)
                })?;
            }
            kind => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    format!("Object of type {kind} is not JSON serializable"),
                ))
            }
        }
        Ok(())
    }

    fn dump_container<T>(
        &self,
        out: &mut String,
        level: usize,
        open: char,
        close: char,
        items: &[T],
        mut each: impl FnMut(&T, &mut String) -> Result<(), Error>,
    ) -> Result<(), Error> {
        out.push(open);
        if items.is_empty() {
            out.push(close);
            return Ok(());
        }
        let newline = |out: &mut String, level: usize| {
            if let Some(indent) = &self.indent {
                out.push('\n');
                out.push_str(&indent.repeat(level));
            }
        };
        for (i, item) in items.iter().enumerate() {
            if i > 0 {
                out.push_str(&self.item_sep);
            }
            newline(out, level + 1);
            each(item, out)?;
        }
        newline(out, level);
        out.push(close);
        Ok(())
    }

    /// Python's `json` string escaping (`ensure_ascii` escapes everything outside printable ASCII).
    fn dump_str(&self, s: &str, out: &mut String) {
        write_json_string(s, self.ensure_ascii, out);
    }
}

/// `s` as Python's `json.dumps` writes a string: quoted, with its short escapes, and other
/// control characters (and, with `ensure_ascii`, all but printable ASCII) as `\uXXXX` UTF-16
/// units.
pub(crate) fn write_json_string(s: &str, ensure_ascii: bool, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0C}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 || (ensure_ascii && !(' '..='~').contains(&c)) => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// A map key as Python's json writes it (str keys as is; numbers, booleans and None converted).
fn json_key(key: &JValue) -> Result<String, Error> {
    Ok(match key.kind() {
        ValueKind::String => key.as_str().unwrap_or_default().to_owned(),
        ValueKind::None => "null".into(),
        ValueKind::Bool => (if key.is_true() { "true" } else { "false" }).into(),
        ValueKind::Number if key.is_integer() => key.to_string(),
        ValueKind::Number => py_float_repr(f64::try_from(key.clone())?),
        kind => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("keys must be str, int, float, bool or None, not {kind}"),
            ))
        }
    })
}

/// Python's `repr(float)` (as `json.dumps` writes floats): shortest round-trip digits, exponent form outside
/// 1e-4 <= |x| < 1e16.
fn py_float_repr(x: f64) -> String {
    if x.is_nan() {
        return "NaN".into();
    }
    if x.is_infinite() {
        return (if x > 0.0 { "Infinity" } else { "-Infinity" }).into();
    }
    if x == 0.0 {
        return (if x.is_sign_negative() { "-0.0" } else { "0.0" }).into();
    }
    // "{:e}" gives the shortest round-trip digits as d.ddde[-]N
    let sci = format!("{x:e}");
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let (sign, mantissa) = mantissa
        .strip_prefix('-')
        .map_or(("", mantissa), |m| ("-", m));
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    if (-4..16).contains(&exp) {
        let point = exp + 1;
        let body = if point <= 0 {
            format!("0.{}{digits}", "0".repeat((-point) as usize))
        } else if point as usize >= digits.len() {
            format!("{digits}{}.0", "0".repeat(point as usize - digits.len()))
        } else {
            format!(
                "{}.{}",
                &digits[..point as usize],
                &digits[point as usize..]
            )
        };
        format!("{sign}{body}")
    } else {
        let frac = if digits.len() > 1 {
            format!(".{}", &digits[1..])
        } else {
            String::new()
        };
        let exp_sign = if exp < 0 { '-' } else { '+' };
        format!("{sign}{}{frac}e{exp_sign}{:02}", &digits[..1], exp.abs())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn render(source: &str, messages: Value) -> Result<String> {
        ChatTemplate::new(source, Map::new())?.render(&messages, None, false, &Map::new())
    }

    #[test]
    fn python_float_repr() {
        for (x, want) in [
            (1.0, "1.0"),
            (0.1, "0.1"),
            (1e-5, "1e-05"),
            (0.0001, "0.0001"),
            (1e16, "1e+16"),
            (1234.5, "1234.5"),
            (-2.5e-7, "-2.5e-07"),
            (123456789012345.0, "123456789012345.0"),
            (f64::INFINITY, "Infinity"),
        ] {
            assert_eq!(py_float_repr(x), want);
        }
    }

    #[test]
    fn tojson_matches_json_dumps() {
        let msgs = json!([{"role": "user", "content": "x", "z": {"b": [1, 2.5, null, true], "a": "é\"\n<>"}}]);
        let out = render("{{ messages[0].z | tojson }}", msgs.clone()).unwrap();
        assert_eq!(out, r#"{"b": [1, 2.5, null, true], "a": "é\"\n<>"}"#);
        let out = render(
            "{{ messages[0].z | tojson(indent=2, ensure_ascii=True) }}",
            msgs.clone(),
        )
        .unwrap();
        assert_eq!(out, "{\n  \"b\": [\n    1,\n    2.5,\n    null,\n    true\n  ],\n  \"a\": \"\\u00e9\\\"\\n<>\"\n}");
        let out = render(
            "{{ messages[0].z | tojson(sort_keys=true, separators=(',', ':')) }}",
            msgs,
        )
        .unwrap();
        assert_eq!(out, r#"{"a":"é\"\n<>","b":[1,2.5,null,true]}"#);
        let out = render(
            "{{ '😀' | tojson(ensure_ascii=true) }}{{ [] | tojson(indent=2) }}",
            json!([{}]),
        )
        .unwrap();
        assert_eq!(out, r#""\ud83d\ude00"[]"#);
    }

    #[test]
    fn values_print_like_python() {
        let msgs = json!([{"x": [1, null, true, "it's", {"a": 1.5e-7, "b": "q\n"}], "f": 1e-5, "g": 1e16}]);
        let out = render(
            "{{ messages[0].x }} {{ messages[0].f }} {{ messages[0].g }} {{ true }} {{ none }}",
            msgs.clone(),
        )
        .unwrap();
        assert_eq!(
            out,
            r#"[1, None, True, "it's", {'a': 1.5e-07, 'b': 'q\n'}] 1e-05 1e+16 True None"#
        );
        let out = render(
            "{{ messages[0].x[4] | string }}|{{ 'a' ~ true ~ none }}|{{ 3 | string }}",
            msgs,
        )
        .unwrap();
        assert_eq!(out, "{'a': 1.5e-07, 'b': 'q\\n'}|aTrueNone|3");
    }

    #[test]
    fn tests_follow_jinja2() {
        let src = "{{ none is iterable }} {{ u is iterable }} {{ 's' is iterable }} {{ 3 is iterable }} | \
                   {{ none is sequence }} {{ u is sequence }} {{ 's' is sequence }} {{ {} is sequence }} {{ 3 is sequence }}";
        assert_eq!(
            render(src, json!([{}])).unwrap(),
            "False True True False | False True True True False"
        );
    }

    #[test]
    fn raise_exception_reports_its_message() {
        let err = render(
            "{% if true %}{{ raise_exception('Roles must alternate!') }}{% endif %}",
            json!([{}]),
        );
        assert!(matches!(err, Err(ChatTemplateError::Raised(m)) if m == "Roles must alternate!"));
    }

    #[test]
    fn strftime_now_can_be_pinned() {
        let now = CivilDateTime::parse_iso("2025-01-15T10:30:00").unwrap();
        let template = ChatTemplate::new(
            "{{ strftime_now('%d %b %Y|%A %B %-d %H:%M:%S %j %y %I%p %%') }}",
            Map::new(),
        )
        .unwrap()
        .with_fixed_now(now);
        let out = template
            .render(&json!([{}]), None, false, &Map::new())
            .unwrap();
        assert_eq!(
            out,
            "15 Jan 2025|Wednesday January 15 10:30:00 015 25 10AM %"
        );
        assert_eq!(CivilDateTime::from_unix(1_736_937_000), now);
        assert_eq!(CivilDateTime::parse_iso("2025-02-30T00:00:00"), None);
    }

    #[test]
    fn messages_are_normalised_like_transformers() {
        let msgs = json!([{"role": "assistant", "content": null, "reasoning": "hmm"}]);
        let out = render(
            "{% for k, v in messages[0].items() %}{{ k }}={{ v }};{% endfor %}",
            msgs,
        )
        .unwrap();
        assert_eq!(
            out,
            "thinking=hmm;role=assistant;reasoning=hmm;reasoning_content=hmm;"
        );
        assert!(matches!(
            render("x", json!([])),
            Err(ChatTemplateError::Input(_))
        ));
    }

    #[test]
    fn context_has_tools_none_and_extra_overrides_special() {
        let special: Map<String, Value> =
            serde_json::from_value(json!({"bos_token": "<s>"})).unwrap();
        let extra: Map<String, Value> =
            serde_json::from_value(json!({"bos_token": "<B>", "flag": true})).unwrap();
        let t = ChatTemplate::new(
            "{{ bos_token }}{{ tools is defined }}{{ tools is none }}{{ documents is none }}{{ flag }}{{ add_generation_prompt }}",
            special,
        )
        .unwrap();
        assert_eq!(
            t.render(&json!([{}]), None, true, &extra).unwrap(),
            "<B>TrueTrueTrueTrueTrue"
        );
    }

    #[test]
    fn generation_tags_render_their_body() {
        let src = "{%- for m in messages %}{% generation -%}\n  [{{ m.content }}]\n{%- endgeneration %}{% endfor %}";
        let msgs = json!([{"content": "a"}, {"content": "b"}]);
        assert_eq!(render(src, msgs).unwrap(), "[a][b]");
        assert_eq!(
            strip_generation_tags("{%- generation +%}"),
            "{%- if true +%}"
        );
        // Found by fuzz/fuzz_targets/tokenizer_config.rs: `{%}` was read as a whole tag.
        let commented = "{# {%} #}{{ messages[0].content }}";
        assert_eq!(render(commented, json!([{"content": "a"}])).unwrap(), "a");
        assert_eq!(strip_generation_tags("a {%}"), "a {%}");
    }

    #[test]
    fn continue_final_message_cuts_the_end_of_turn() {
        let t = ChatTemplate::new(
            "{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endfor %}",
            Map::new(),
        )
        .unwrap();
        let msgs =
            json!([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure, "}]);
        assert_eq!(
            t.render_continuing(&msgs, None, &Map::new()).unwrap(),
            "<user>hi</user><assistant>Sure, "
        );
    }
}
