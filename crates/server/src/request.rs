//! Request bodies: parsing and validation of `/v1/chat/completions` and `/v1/completions`
//! fields, with mlx_lm.server's names, defaults and ranges. Anything invalid is a 400 naming
//! the field, before any work is queued.

use std::collections::BTreeMap;

use oxlm_runtime::sampler::{Sampler, SamplerConfig, MIN_TEMPERATURE};
use serde_json::{Map, Value};

use crate::error::ApiError;

/// What an unset field becomes: the server's flags, then the model's generation_config.json,
/// then mlx-lm's defaults.
#[derive(Debug, Clone)]
pub struct Defaults {
    pub max_tokens: usize,
    pub temperature: f32,
    pub top_p: f32,
    pub top_k: usize,
    pub min_p: f32,
    pub repetition_penalty: Option<f32>,
    /// Ids XTC never removes; mlx-lm passes `encode("\n")` and the end-of-sequence ids.
    pub xtc_special_tokens: Vec<u32>,
}

impl Default for Defaults {
    /// mlx-lm's: mlx_lm.server's 512 tokens, greedy sampling, no top-p, top-k or min-p filter, no
    /// repetition penalty.
    fn default() -> Self {
        Defaults {
            max_tokens: 512,
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            repetition_penalty: None,
            xtc_special_tokens: Vec::new(),
        }
    }
}

/// The most alternatives a token's `top_logprobs` may list (OpenAI's limit).
const MAX_TOP_LOGPROBS: u64 = 20;

/// The most stop strings a request may give (OpenAI allows 4).
const MAX_STOP: usize = 16;

/// OpenAI's bound on `presence_penalty` and `frequency_penalty`, either way.
const MAX_PENALTY: f32 = 2.0;

/// OpenAI's bound on a `logit_bias` value, either way: -100 bans a token, 100 all but forces it.
const MAX_LOGIT_BIAS: f32 = 100.0;

/// How far `repetition_penalty` may scale the logits of repeated tokens, either way: a factor
/// of 100 already bans or forces a token, and factors near f32's limits make logits infinite,
/// and the softmax over them NaN.
const MAX_REPETITION_PENALTY: f32 = 100.0;

/// Generation parameters shared by both endpoints.
#[derive(Debug, Clone)]
pub struct Params {
    pub stream: bool,
    pub include_usage: bool,
    pub max_tokens: usize,
    pub sampler: SamplerConfig,
    pub stop: Vec<String>,
    pub logprobs: bool,
    pub top_logprobs: usize,
    /// mlx_lm.server's `adapters`: the LoRA adapter to run with, by name (`a+b`: stacked;
    /// `none`: the base model, past the server's default).
    pub adapter: Option<String>,
}

#[derive(Debug, Clone)]
pub struct ChatRequest {
    pub params: Params,
    /// Messages ready for the chat template: content joined into strings, tool-call arguments
    /// parsed into objects.
    pub messages: Vec<Value>,
    pub tools: Option<Value>,
    /// Per-request chat template variables (`chat_template_kwargs`).
    pub template_kwargs: Map<String, Value>,
    /// mlx_lm.server's prompt format for models without a chat template.
    pub role_mapping: Option<Map<String, Value>>,
    /// Whether and which tools the reply must call.
    pub tool_choice: ToolChoice,
    /// The shape the reply's content must have.
    pub response_format: ResponseFormat,
    /// The start of the reply, which the model continues (Anthropic's prefill: a last
    /// assistant message); the reply holds only what follows it.
    pub reply_prefix: Option<String>,
    /// Whether the reply may make several tool calls (OpenAI's `parallel_tool_calls`, the
    /// opposite of Anthropic's `disable_parallel_tool_use`); if not, it ends at its first.
    pub parallel_tool_calls: bool,
    /// The most tokens the model may reason for (Anthropic's `thinking.budget_tokens`); the
    /// end of its reasoning is all it may write next.
    pub thinking_budget: Option<usize>,
}

/// OpenAI's `tool_choice` (Anthropic's `auto`/`any`/`tool`/`none` map onto it): what calls
/// the reply must make, enforced while it is generated.
#[derive(Debug, Clone, PartialEq, Default)]
pub enum ToolChoice {
    /// Text or calls, as the model chooses.
    #[default]
    Auto,
    /// No calls: the tools are not shown to the model.
    None,
    /// At least one call, of any of the tools.
    Required,
    /// A call of this tool.
    Function(String),
}

/// OpenAI's `response_format` (the Responses API's `text.format`): what the reply's content
/// must be, enforced while it is generated.
#[derive(Debug, Clone, PartialEq, Default)]
pub enum ResponseFormat {
    #[default]
    Text,
    /// Any JSON object.
    JsonObject,
    /// JSON valid under `schema`.
    JsonSchema { name: String, schema: Value },
}

#[derive(Debug, Clone)]
pub struct CompletionRequest {
    pub params: Params,
    pub prompt: Prompt,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
}

/// The body as a JSON object.
pub fn parse_body(bytes: &[u8]) -> Result<Map<String, Value>, ApiError> {
    match serde_json::from_slice(bytes) {
        Ok(Value::Object(body)) => Ok(body),
        Ok(_) => Err(ApiError::invalid("Request should be a JSON dictionary")),
        Err(e) => Err(ApiError::invalid(format!(
            "Invalid JSON in request body: {e}"
        ))),
    }
}

pub fn chat_request(
    body: &Map<String, Value>,
    defaults: &Defaults,
) -> Result<ChatRequest, ApiError> {
    let fields = Fields(body);
    let params = params(&fields, defaults, false)?;
    let messages = match fields.get("messages") {
        Some(Value::Array(list)) if !list.is_empty() => list
            .iter()
            .enumerate()
            .map(|(i, m)| normalize_message(i, m))
            .collect::<Result<Vec<_>, _>>()?,
        Some(Value::Array(_)) => {
            return Err(ApiError::invalid_param(
                "messages",
                "`messages` must not be empty",
            ))
        }
        Some(_) => {
            return Err(ApiError::invalid_param(
                "messages",
                "`messages` must be an array",
            ))
        }
        None => {
            return Err(ApiError::invalid_param(
                "messages",
                "Request did not contain messages",
            ))
        }
    };
    let tool_choice = tool_choice(fields.get("tool_choice"))?;
    let tools = match fields.get("tools") {
        Some(Value::Array(list)) if list.is_empty() || tool_choice == ToolChoice::None => None,
        Some(tools @ Value::Array(_)) => Some(tools.clone()),
        Some(_) => return Err(ApiError::invalid_param("tools", "`tools` must be an array")),
        None => None,
    };
    check_tool_choice(&tool_choice, tools.as_ref(), "tool_choice")?;
    let mut template_kwargs = fields.object("chat_template_kwargs")?.unwrap_or_default();
    if let Some(effort) = fields.string("reasoning_effort")? {
        reasoning_effort_kwargs(&mut template_kwargs, effort);
    }
    Ok(ChatRequest {
        params,
        messages,
        tools,
        template_kwargs,
        role_mapping: fields.object("role_mapping")?,
        tool_choice,
        response_format: response_format(fields.get("response_format"))?,
        reply_prefix: None,
        parallel_tool_calls: fields.bool("parallel_tool_calls")?.unwrap_or(true),
        thinking_budget: None,
    })
}

/// OpenAI's reasoning effort (chat completions' `reasoning_effort`, the Responses API's
/// `reasoning.effort`) as chat template variables: `reasoning_effort` (gpt-oss's template reads
/// it), and `enable_thinking: false` for `none`, to the templates that can turn thinking off.
/// The request's own template variables win.
pub(crate) fn reasoning_effort_kwargs(kwargs: &mut Map<String, Value>, effort: String) {
    if effort == "none" {
        kwargs
            .entry("enable_thinking")
            .or_insert(Value::Bool(false));
    }
    kwargs
        .entry("reasoning_effort")
        .or_insert(Value::String(effort));
}

/// Chat completions' `tool_choice`: `"auto"`, `"none"`, `"required"` or
/// `{"type": "function", "function": {"name": ...}}`.
fn tool_choice(value: Option<&Value>) -> Result<ToolChoice, ApiError> {
    openai_tool_choice(
        value,
        "/function/name",
        "{\"type\": \"function\", \"function\": {\"name\": ...}}",
    )
}

/// An OpenAI API's `tool_choice`: `"auto"`, `"none"`, `"required"` or `{"type": "function", ..}`
/// with the function's name at `name_pointer`; `named_form` is that object as errors show it.
pub(crate) fn openai_tool_choice(
    value: Option<&Value>,
    name_pointer: &str,
    named_form: &str,
) -> Result<ToolChoice, ApiError> {
    let bad = || {
        ApiError::invalid_param(
            "tool_choice",
            format!("`tool_choice` must be \"auto\", \"none\", \"required\" or {named_form}"),
        )
    };
    match value {
        None => Ok(ToolChoice::Auto),
        Some(Value::String(choice)) => match choice.as_str() {
            "auto" => Ok(ToolChoice::Auto),
            "none" => Ok(ToolChoice::None),
            "required" => Ok(ToolChoice::Required),
            _ => Err(bad()),
        },
        Some(choice) if choice["type"] == "function" => choice
            .pointer(name_pointer)
            .and_then(Value::as_str)
            .map(|name| ToolChoice::Function(name.to_owned()))
            .ok_or_else(bad),
        Some(_) => Err(bad()),
    }
}

/// The name of an OpenAI-format tool (`{"type": "function", "function": {"name": ...}}`).
pub fn tool_name(tool: &Value) -> Option<&str> {
    tool.pointer("/function/name").and_then(Value::as_str)
}

/// A choice that needs a call needs tools to call, and a named one must be among them.
pub fn check_tool_choice(
    choice: &ToolChoice,
    tools: Option<&Value>,
    param: &str,
) -> Result<(), ApiError> {
    let names: Vec<&str> = tools
        .and_then(Value::as_array)
        .map(|tools| tools.iter().filter_map(tool_name).collect())
        .unwrap_or_default();
    match choice {
        ToolChoice::Required if names.is_empty() => Err(ApiError::invalid_param(
            param,
            "a tool call is required but the request gives no tools",
        )),
        ToolChoice::Function(name) if !names.contains(&name.as_str()) => Err(
            ApiError::invalid_param(param, format!("`{name}` is not one of the request's tools")),
        ),
        _ => Ok(()),
    }
}

/// OpenAI's `response_format`: `{"type": "text"}`, `{"type": "json_object"}` or
/// `{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}`.
fn response_format(value: Option<&Value>) -> Result<ResponseFormat, ApiError> {
    let Some(value) = value else {
        return Ok(ResponseFormat::Text);
    };
    match value.get("type").and_then(Value::as_str) {
        Some("text") => Ok(ResponseFormat::Text),
        Some("json_object") => Ok(ResponseFormat::JsonObject),
        Some("json_schema") => {
            let spec = value.get("json_schema").ok_or_else(|| {
                ApiError::invalid_param(
                    "response_format.json_schema",
                    "a `json_schema` response format needs its `json_schema` object",
                )
            })?;
            json_schema_format(spec, "response_format.json_schema")
        }
        _ => Err(ApiError::invalid_param(
            "response_format.type",
            "`response_format.type` must be \"text\", \"json_object\" or \"json_schema\"",
        )),
    }
}

/// A named schema (`{"name": ..., "schema": {...}}`, as OpenAI's `json_schema` and the
/// Responses API's `text.format` give it). A missing schema allows any JSON.
pub fn json_schema_format(spec: &Value, param: &str) -> Result<ResponseFormat, ApiError> {
    let name = match spec.get("name") {
        None | Some(Value::Null) => "response".to_owned(),
        Some(Value::String(name)) => name.clone(),
        Some(_) => {
            return Err(ApiError::invalid_param(
                &format!("{param}.name"),
                "the schema's `name` must be a string",
            ))
        }
    };
    let schema = match spec.get("schema") {
        None | Some(Value::Null) => Value::Object(Map::new()),
        Some(schema @ (Value::Object(_) | Value::Bool(_))) => schema.clone(),
        Some(_) => {
            return Err(ApiError::invalid_param(
                &format!("{param}.schema"),
                "the `schema` must be a JSON Schema object",
            ))
        }
    };
    Ok(ResponseFormat::JsonSchema { name, schema })
}

pub fn completion_request(
    body: &Map<String, Value>,
    defaults: &Defaults,
) -> Result<CompletionRequest, ApiError> {
    let fields = Fields(body);
    let params = params(&fields, defaults, true)?;
    let bad = || {
        ApiError::invalid_param(
            "prompt",
            "`prompt` must be a string, a list of one string, or a list of token ids",
        )
    };
    let prompt = match fields.get("prompt") {
        Some(Value::String(text)) => Prompt::Text(text.clone()),
        Some(Value::Array(list)) => match list.as_slice() {
            [Value::String(text)] => Prompt::Text(text.clone()),
            ids => Prompt::Tokens(
                ids.iter()
                    .map(|v| v.as_u64().and_then(|id| u32::try_from(id).ok()))
                    .collect::<Option<_>>()
                    .ok_or_else(bad)?,
            ),
        },
        Some(_) => return Err(bad()),
        None => {
            return Err(ApiError::invalid_param(
                "prompt",
                "Request did not contain a prompt",
            ))
        }
    };
    Ok(CompletionRequest { params, prompt })
}

pub(crate) fn params(
    fields: &Fields,
    defaults: &Defaults,
    legacy_logprobs: bool,
) -> Result<Params, ApiError> {
    if let Some(n) = fields.get("n") {
        if n.as_u64() != Some(1) {
            return Err(ApiError::invalid_param("n", "Only n = 1 is supported"));
        }
    }
    fields.string("model")?;
    let max_tokens = match fields.uint("max_completion_tokens", 1)? {
        Some(n) => n,
        None => fields
            .uint("max_tokens", 1)?
            .unwrap_or(defaults.max_tokens as u64),
    };
    // /v1/completions takes OpenAI's legacy `logprobs: N` (N alternatives per token) too.
    let (logprobs, legacy_top) = match fields.get("logprobs") {
        Some(Value::Number(n)) if legacy_logprobs => {
            let top = n
                .as_u64()
                .filter(|&n| n <= MAX_TOP_LOGPROBS)
                .ok_or_else(|| {
                    ApiError::invalid_param(
                        "logprobs",
                        format!(
                            "`logprobs` must be a boolean or an integer in [0, {MAX_TOP_LOGPROBS}]"
                        ),
                    )
                })?;
            (true, Some(top))
        }
        _ => (fields.bool("logprobs")?.unwrap_or(false), None),
    };
    let top_logprobs = match fields.uint("top_logprobs", 0)? {
        Some(n) if n > MAX_TOP_LOGPROBS => {
            return Err(ApiError::invalid_param(
                "top_logprobs",
                format!("`top_logprobs` must be at most {MAX_TOP_LOGPROBS}"),
            ))
        }
        n => n.or(legacy_top).unwrap_or(0),
    };
    let include_usage = match fields.object("stream_options")? {
        Some(options) => Fields(&options).bool("include_usage")?.unwrap_or(false),
        None => false,
    };
    let sampler = SamplerConfig {
        temperature: fields
            .number_or_zero("temperature", "greedy", MIN_TEMPERATURE, f32::MAX)?
            .unwrap_or(defaults.temperature),
        top_p: fields.number("top_p", 0.0, 1.0)?.unwrap_or(defaults.top_p),
        top_k: fields
            .uint("top_k", 0)?
            .map_or(defaults.top_k, |k| k as usize),
        min_p: fields.number("min_p", 0.0, 1.0)?.unwrap_or(defaults.min_p),
        xtc_probability: fields.number("xtc_probability", 0.0, 1.0)?.unwrap_or(0.0),
        xtc_threshold: fields.number("xtc_threshold", 0.0, 1.0)?.unwrap_or(0.1),
        xtc_special_tokens: defaults.xtc_special_tokens.clone(),
        repetition_penalty: fields
            .number_or_zero(
                "repetition_penalty",
                "off",
                1.0 / MAX_REPETITION_PENALTY,
                MAX_REPETITION_PENALTY,
            )?
            .or(defaults.repetition_penalty),
        repetition_context_size: fields.size("repetition_context_size", 20)?,
        presence_penalty: fields.number("presence_penalty", -MAX_PENALTY, MAX_PENALTY)?,
        presence_context_size: fields.size("presence_context_size", 20)?,
        frequency_penalty: fields.number("frequency_penalty", -MAX_PENALTY, MAX_PENALTY)?,
        frequency_context_size: fields.size("frequency_context_size", 20)?,
        logit_bias: fields.logit_bias()?,
        seed: fields.seed()?,
        ..SamplerConfig::default()
    };
    // The sampler's own checks (mlx-lm's ValueErrors), before anything is queued.
    Sampler::new(sampler.clone()).map_err(|e| ApiError::invalid(e.to_string()))?;
    Ok(Params {
        stream: fields.bool("stream")?.unwrap_or(false),
        include_usage,
        max_tokens: max_tokens.try_into().unwrap_or(usize::MAX),
        sampler,
        stop: fields.stop("stop")?,
        logprobs: logprobs || top_logprobs > 0,
        top_logprobs: top_logprobs as usize,
        adapter: fields.string("adapters")?,
    })
}

/// mlx_lm.server's `process_message_content`: text parts joined, a null content made empty,
/// and tool-call arguments given as JSON text parsed for the template.
pub fn normalize_message(index: usize, message: &Value) -> Result<Value, ApiError> {
    let param = format!("messages[{index}]");
    let Value::Object(message) = message else {
        return Err(ApiError::invalid_param(
            &param,
            "each message must be an object",
        ));
    };
    if !message.get("role").is_some_and(Value::is_string) {
        return Err(ApiError::invalid_param(
            &param,
            "each message needs a string `role`",
        ));
    }
    let mut message = message.clone();
    match message.get("content") {
        None | Some(Value::Null) => {
            message.insert("content".into(), Value::from(""));
        }
        Some(Value::String(_)) => {}
        Some(Value::Array(parts)) => {
            let text = parts
                .iter()
                .map(
                    |p| match (p.get("type").and_then(Value::as_str), p.get("text")) {
                        (Some("text"), Some(Value::String(t))) => Some(t.as_str()),
                        _ => None,
                    },
                )
                .collect::<Option<String>>()
                .ok_or_else(|| {
                    ApiError::invalid_param(
                        &format!("{param}.content"),
                        "Only 'text' content type is supported.",
                    )
                })?;
            message.insert("content".into(), Value::from(text));
        }
        Some(_) => {
            return Err(ApiError::invalid_param(
                &format!("{param}.content"),
                "`content` must be a string or a list of content parts",
            ))
        }
    }
    if let Some(Value::Array(calls)) = message.get_mut("tool_calls") {
        for call in calls {
            let args = call.pointer_mut("/function/arguments");
            if let Some(args @ Value::String(_)) = args {
                if let Ok(parsed) = serde_json::from_str(args.as_str().unwrap_or_default()) {
                    *args = parsed;
                }
            }
        }
    }
    Ok(Value::Object(message))
}

/// Typed access to the fields of a request body; `null` counts as unset.
pub(crate) struct Fields<'a>(pub(crate) &'a Map<String, Value>);

impl Fields<'_> {
    pub(crate) fn get(&self, name: &str) -> Option<&Value> {
        self.0.get(name).filter(|v| !v.is_null())
    }

    pub(crate) fn bool(&self, name: &str) -> Result<Option<bool>, ApiError> {
        self.get(name)
            .map(|v| {
                v.as_bool().ok_or_else(|| {
                    ApiError::invalid_param(name, format!("`{name}` must be a boolean"))
                })
            })
            .transpose()
    }

    pub(crate) fn string(&self, name: &str) -> Result<Option<String>, ApiError> {
        self.get(name)
            .map(|v| {
                v.as_str().map(str::to_owned).ok_or_else(|| {
                    ApiError::invalid_param(name, format!("`{name}` must be a string"))
                })
            })
            .transpose()
    }

    pub(crate) fn uint(&self, name: &str, min: u64) -> Result<Option<u64>, ApiError> {
        let Some(v) = self.get(name) else {
            return Ok(None);
        };
        if !(v.is_i64() || v.is_u64()) {
            return Err(ApiError::invalid_param(
                name,
                format!("`{name}` must be an integer"),
            ));
        }
        match v.as_u64() {
            Some(n) if n >= min => Ok(Some(n)),
            _ => Err(ApiError::invalid_param(
                name,
                format!("`{name}` must be at least {min}"),
            )),
        }
    }

    /// A context size: an integer, at least 0.
    fn size(&self, name: &str, default: usize) -> Result<usize, ApiError> {
        Ok(self.uint(name, 0)?.map_or(default, |n| n as usize))
    }

    /// A number from `min` to `max`.
    pub(crate) fn number(&self, name: &str, min: f32, max: f32) -> Result<Option<f32>, ApiError> {
        self.bounded(name, None, min, max)
    }

    /// 0, which has a meaning of its own (`zero_means`), or a number from `min` to `max`.
    pub(crate) fn number_or_zero(
        &self,
        name: &str,
        zero_means: &str,
        min: f32,
        max: f32,
    ) -> Result<Option<f32>, ApiError> {
        self.bounded(name, Some(zero_means), min, max)
    }

    /// A number from `min` to `max`, or 0 where `zero_means` says what 0 means. The range is
    /// checked on the f32 the sampler takes, where a number past f32's range is infinite and
    /// one too small for it is 0.
    fn bounded(
        &self,
        name: &str,
        zero_means: Option<&str>,
        min: f32,
        max: f32,
    ) -> Result<Option<f32>, ApiError> {
        let Some(v) = self.get(name) else {
            return Ok(None);
        };
        let x = v
            .as_f64()
            .ok_or_else(|| ApiError::invalid_param(name, format!("`{name}` must be a number")))?;
        let narrowed = x as f32;
        if (zero_means.is_some() && x == 0.0) || (min..=max).contains(&narrowed) {
            return Ok(Some(narrowed));
        }
        let zero = zero_means.map_or_else(String::new, |meaning| format!("0 ({meaning}) or "));
        Err(ApiError::invalid_param(
            name,
            format!("`{name}` must be {zero}a number from {min:?} to {max:?}"),
        ))
    }

    pub(crate) fn object(&self, name: &str) -> Result<Option<Map<String, Value>>, ApiError> {
        match self.get(name) {
            Some(Value::Object(map)) => Ok(Some(map.clone())),
            Some(_) => Err(ApiError::invalid_param(
                name,
                format!("`{name}` must be an object"),
            )),
            None => Ok(None),
        }
    }

    /// Stop strings (OpenAI's `stop`, Anthropic's `stop_sequences`).
    pub(crate) fn stop(&self, name: &str) -> Result<Vec<String>, ApiError> {
        let bad = || {
            ApiError::invalid_param(
                name,
                format!("`{name}` must be a string or a list of strings"),
            )
        };
        match self.get(name) {
            None => Ok(Vec::new()),
            Some(Value::String(s)) => Ok(vec![s.clone()]),
            // Every stop string is searched for at every token, so their number is bounded.
            Some(Value::Array(list)) if list.len() > MAX_STOP => Err(ApiError::invalid_param(
                name,
                format!("At most {MAX_STOP} stop strings are supported"),
            )),
            Some(Value::Array(list)) => list
                .iter()
                .map(|s| s.as_str().map(str::to_owned).ok_or_else(bad))
                .collect(),
            Some(_) => Err(bad()),
        }
    }

    fn seed(&self) -> Result<Option<u64>, ApiError> {
        match self.get("seed") {
            None => Ok(None),
            // Any integer, as mlx-lm takes; negative seeds wrap.
            Some(v) => v
                .as_u64()
                .or_else(|| v.as_i64().map(|s| s as u64))
                .map(Some)
                .ok_or_else(|| ApiError::invalid_param("seed", "`seed` must be an integer")),
        }
    }

    fn logit_bias(&self) -> Result<BTreeMap<u32, f32>, ApiError> {
        let Some(map) = self.object("logit_bias")? else {
            return Ok(BTreeMap::new());
        };
        map.iter()
            .map(|(id, bias)| {
                let (Ok(id), Some(bias)) = (id.parse::<u32>(), bias.as_f64()) else {
                    return Err(ApiError::invalid_param(
                        "logit_bias",
                        "logit_bias must be a dict of int to float",
                    ));
                };
                if !(-f64::from(MAX_LOGIT_BIAS)..=f64::from(MAX_LOGIT_BIAS)).contains(&bias) {
                    return Err(ApiError::invalid_param(
                        "logit_bias",
                        format!(
                            "`logit_bias` values must be numbers from {:?} to \
                             {MAX_LOGIT_BIAS:?} (token {id} has {bias:?})",
                            -MAX_LOGIT_BIAS
                        ),
                    ));
                }
                Ok((id, bias as f32))
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn chat(body: Value) -> Result<ChatRequest, ApiError> {
        chat_request(body.as_object().unwrap(), &Defaults::default())
    }

    #[test]
    fn fields_take_mlx_names_and_defaults() {
        let r = chat(json!({"messages": [{"role": "user", "content": "hi"}],
            "max_completion_tokens": 7, "max_tokens": 9, "temperature": 0.5, "top_k": 3,
            "stop": "x", "logit_bias": {"12": -100}, "seed": 4, "top_logprobs": 2}))
        .unwrap();
        let p = &r.params;
        assert_eq!(p.max_tokens, 7);
        assert_eq!((p.sampler.temperature, p.sampler.top_k), (0.5, 3));
        assert_eq!(p.stop, ["x"]);
        assert_eq!(p.sampler.logit_bias, BTreeMap::from([(12, -100.0)]));
        assert_eq!(p.sampler.seed, Some(4));
        assert!(p.logprobs && p.top_logprobs == 2);
        assert!(!p.stream && !p.include_usage);
        assert_eq!(p.adapter, None);
        let r = chat(json!({"messages": [{"role": "user", "content": "hi"}], "temperature": null}))
            .unwrap();
        assert_eq!(r.params.max_tokens, 512);
        assert_eq!(r.params.sampler.temperature, 0.0);
    }

    #[test]
    fn invalid_values_name_their_field() {
        let msg = json!([{"role": "user", "content": "hi"}]);
        let param = |body: Value| chat(body).unwrap_err().param;
        let with = |key: &str, value: Value| {
            let mut body = json!({"messages": msg});
            body[key] = value;
            param(body)
        };
        assert_eq!(with("temperature", json!(-1)), Some("temperature".into()));
        assert_eq!(
            with("temperature", json!("hot")),
            Some("temperature".into())
        );
        assert_eq!(with("top_p", json!(1.5)), Some("top_p".into()));
        assert_eq!(with("max_tokens", json!(0)), Some("max_tokens".into()));
        assert_eq!(with("max_tokens", json!(1.5)), Some("max_tokens".into()));
        assert_eq!(with("n", json!(2)), Some("n".into()));
        assert_eq!(with("stop", json!(3)), Some("stop".into()));
        assert_eq!(with("stop", json!(vec!["x"; 17])), Some("stop".into()));
        assert_eq!(with("stream", json!("yes")), Some("stream".into()));
        assert_eq!(with("adapters", json!(["a"])), Some("adapters".into()));
        assert_eq!(with("model", json!(1)), Some("model".into()));
        assert_eq!(with("top_logprobs", json!(21)), Some("top_logprobs".into()));
        assert_eq!(
            with("logit_bias", json!({"a": 1})),
            Some("logit_bias".into())
        );
        assert_eq!(param(json!({})), Some("messages".into()));
        assert_eq!(
            param(json!({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]})),
            Some("messages[0].content".into())
        );
        // The sampler's own checks are 400s too.
        let err = chat(json!({"messages": msg, "xtc_probability": 0.5, "xtc_threshold": 0.9}))
            .unwrap_err();
        assert_eq!(err.status, 400);
    }

    #[test]
    fn sampling_values_must_keep_sampling_finite() {
        let with = |key: &str, value: Value| {
            let mut body = json!({"messages": [{"role": "user", "content": "hi"}]});
            body[key] = value;
            chat(body)
        };
        for (key, value) in [
            ("temperature", json!(1e-45)),
            ("temperature", json!(9e-5)),
            ("temperature", json!(1e39)),
            ("presence_penalty", json!(-2.5)),
            ("frequency_penalty", json!(1e39)),
            ("repetition_penalty", json!(1e-45)),
            ("repetition_penalty", json!(101)),
            ("logit_bias", json!({"12": -100.5})),
        ] {
            let err = with(key, value.clone()).unwrap_err();
            assert_eq!(err.status, 400, "{key} {value}");
            assert_eq!(err.param.as_deref(), Some(key), "{key} {value}");
        }
        // The ends of each range, and the 0s that mean greedy and no penalty.
        let sampler = |key: &str, value: Value| with(key, value).unwrap().params.sampler;
        assert_eq!(sampler("temperature", json!(1e-4)).temperature, 1e-4);
        assert_eq!(sampler("temperature", json!(0)).temperature, 0.0);
        assert_eq!(
            sampler("presence_penalty", json!(-2)).presence_penalty,
            Some(-2.0)
        );
        assert_eq!(
            sampler("frequency_penalty", json!(2)).frequency_penalty,
            Some(2.0)
        );
        let repetition = |value| sampler("repetition_penalty", value).repetition_penalty;
        assert_eq!(repetition(json!(0.01)), Some(0.01));
        assert_eq!(repetition(json!(100)), Some(100.0));
        assert_eq!(repetition(json!(0)), Some(0.0));
        assert_eq!(
            sampler("logit_bias", json!({"1": -100, "2": 100})).logit_bias,
            BTreeMap::from([(1, -100.0), (2, 100.0)])
        );
    }

    #[test]
    fn messages_are_made_ready_for_templates() {
        let r = chat(json!({"messages": [
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": null, "tool_calls": [
                {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}}]},
            {"role": "tool", "tool_call_id": "1", "content": "2"}],
            "tools": [{"type": "function", "function": {"name": "f"}}]}))
        .unwrap();
        assert_eq!(r.messages[0]["content"], "ab");
        assert_eq!(r.messages[1]["content"], "");
        assert_eq!(
            r.messages[1]["tool_calls"][0]["function"]["arguments"],
            json!({"x": 1})
        );
        assert!(r.tools.is_some());
    }

    #[test]
    fn completion_prompts_and_legacy_logprobs() {
        let parse =
            |body: Value| completion_request(body.as_object().unwrap(), &Defaults::default());
        let r = parse(json!({"prompt": "hi", "logprobs": 3})).unwrap();
        assert_eq!(r.prompt, Prompt::Text("hi".into()));
        assert!(r.params.logprobs && r.params.top_logprobs == 3);
        let r = parse(json!({"prompt": [1, 2]})).unwrap();
        assert_eq!(r.prompt, Prompt::Tokens(vec![1, 2]));
        assert!(parse(json!({"prompt": {}})).is_err());
        assert!(parse(json!({})).is_err());
    }

    #[test]
    fn bodies_must_be_json_objects() {
        assert!(parse_body(b"{")
            .unwrap_err()
            .message
            .starts_with("Invalid JSON"));
        assert_eq!(
            parse_body(b"[1]").unwrap_err().message,
            "Request should be a JSON dictionary"
        );
        assert!(parse_body(b"{}").is_ok());
    }
}
