//! Tool calls in the formats of more families (MiniCPM5, Mistral's two, pythonic, gpt-oss's
//! harmony), end to end, behind each family's real chat template: a tiny model with random
//! weights, which would never call a tool of its own accord, sampled at temperature 1 under
//! several seeds with a call required, must call in the template's format, read back as calls;
//! and a scripted model's calls come out as `tool_calls`, whole or streamed, with no markup left
//! in the text.

mod common;

use common::scripted::{serve, start, weather_request, Family, Served};
use common::{chat, chunks, post};
use oxlm_runtime::chat_template::ChatTemplate;
use oxlm_runtime::LoadedModel;
use oxlm_server::{LogLevel, Server, Settings};
use serde_json::{json, Map, Value};

/// A server of the tiny Mistral model (random weights) behind the chat template `template` of
/// tests/fixtures/templates.
async fn random_model_behind(template: &str) -> String {
    let fixtures = common::fixtures();
    let mut loaded = LoadedModel::load(&fixtures.join("tiny/mistral-4bit-g32")).unwrap();
    let source = std::fs::read_to_string(fixtures.join("templates").join(template)).unwrap();
    // The tokenizer's special tokens, which templates name (Nemo ends a turn with eos_token).
    let special: Map<String, Value> = loaded
        .tokenizer
        .special_tokens()
        .iter()
        .map(|(name, token)| (name.to_owned(), Value::from(token)))
        .collect();
    loaded.chat_template = Some(ChatTemplate::new(&source, special).unwrap());
    let settings = Settings {
        log_level: LogLevel::Warning,
        ..Settings::default()
    };
    common::listen(Server::new(loaded, settings).unwrap()).await
}

/// Tools whose arguments a random model ends within `max_tokens`: numbers and booleans, no
/// free text.
fn numeric_tools() -> Value {
    json!([
        {"type": "function", "function": {"name": "get_time", "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 12}},
            "required": ["zone"], "additionalProperties": false}}},
        {"type": "function", "function": {"name": "set_alarm", "parameters": {
            "type": "object",
            "properties": {"hour": {"type": "integer", "minimum": 0, "maximum": 23},
                           "loud": {"type": "boolean"}},
            "required": ["hour"], "additionalProperties": false}}},
    ])
}

/// A call of [`numeric_tools`] with arguments of their types, the required ones given.
fn check_call(call: &Value, reply: &Value) {
    let arguments: Value =
        serde_json::from_str(call["function"]["arguments"].as_str().unwrap()).unwrap();
    let arguments = arguments.as_object().unwrap();
    match call["function"]["name"].as_str().unwrap() {
        "get_time" => {
            assert!(arguments["zone"].is_i64(), "{reply}");
            assert_eq!(arguments.len(), 1, "{reply}");
        }
        "set_alarm" => {
            assert!(arguments["hour"].is_i64(), "{reply}");
            assert!(
                arguments.get("loud").is_none_or(Value::is_boolean),
                "{reply}"
            );
            assert!(
                arguments.keys().all(|k| k == "hour" || k == "loud"),
                "{reply}"
            );
        }
        other => panic!("a call of {other}, which is no tool: {reply}"),
    }
}

#[tokio::test]
async fn required_calls_come_in_each_templates_format() {
    for template in [
        "minicpm5.jinja",
        "mistral-nemo.jinja",
        "mistral-small-3.2.jinja",
        "llama-3.2-pythonic.jinja",
    ] {
        let base = random_model_behind(template).await;
        for seed in 0..3 {
            for choice in [
                json!("required"),
                json!({"type": "function", "function": {"name": "set_alarm"}}),
            ] {
                let body = json!({
                    "messages": [{"role": "user", "content": "Wake me at seven."}],
                    "tools": numeric_tools(), "tool_choice": choice,
                    // Room for a dozen calls: a random model goes on calling as often as
                    // not, and MiniCPM5's take many tokens of this small vocabulary.
                    "max_tokens": 1000, "temperature": 1.0, "seed": seed,
                });
                let reply: Value = serde_json::from_str(&chat(&base, &body).await).unwrap();
                let choice_made = &reply["choices"][0];
                assert_eq!(
                    choice_made["finish_reason"], "tool_calls",
                    "{template}: {reply}"
                );
                let calls = choice_made["message"]["tool_calls"].as_array().unwrap();
                assert!(!calls.is_empty(), "{template}: {reply}");
                calls.iter().for_each(|call| check_call(call, &reply));
                if body["tool_choice"].is_object() {
                    assert_eq!(calls.len(), 1, "{template}: {reply}");
                    assert_eq!(calls[0]["function"]["name"], "set_alarm");
                }
                // The calls and their results go back as the next turn's history, ids as
                // given: the template takes them (Mistral's refuse any id but nine letters
                // and digits).
                let mut messages =
                    vec![body["messages"][0].clone(), choice_made["message"].clone()];
                messages.extend(calls.iter().map(
                    |call| json!({"role": "tool", "tool_call_id": call["id"], "content": "done"}),
                ));
                let next = json!({"messages": messages, "tools": numeric_tools(), "max_tokens": 2});
                let answer: Value = serde_json::from_str(&chat(&base, &next).await).unwrap();
                assert_eq!(answer["object"], "chat.completion", "{template}: {answer}");
            }
        }
    }
}

/// The calls of a reply, as (name, arguments).
fn calls_of(message: &Value) -> Vec<(String, Value)> {
    message["tool_calls"]
        .as_array()
        .unwrap()
        .iter()
        .map(|call| {
            let arguments = call["function"]["arguments"].as_str().unwrap();
            (
                call["function"]["name"].as_str().unwrap().to_owned(),
                serde_json::from_str(arguments).unwrap(),
            )
        })
        .collect()
}

/// MiniCPM5's template opens `<think>` (the vocabulary has it); the model reasons, then calls
/// in its XML, a value with `<` in CDATA as the template asks.
#[tokio::test]
async fn minicpm5_reasoning_then_a_call() {
    let family = Family {
        template: "minicpm5.jinja",
        tokens: &["<think>", "</think>"],
    };
    let reply = "The user wants the weather.\n</think>\n\n<function name=\"get_weather\">\
                 <param name=\"city\"><![CDATA[Paris <FR>]]></param><param name=\"days\">2</param></function>";
    let base = start(&family, reply).await;
    let r: Value = serde_json::from_str(&chat(&base, &weather_request(false)).await).unwrap();
    let choice = &r["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{r}");
    let message = &choice["message"];
    assert_eq!(
        message["reasoning_content"],
        "The user wants the weather.\n"
    );
    assert_eq!(message["content"], "\n\n");
    assert_eq!(
        calls_of(message),
        [(
            "get_weather".to_owned(),
            json!({"city": "Paris <FR>", "days": 2})
        )]
    );
    // The call goes back as history with its result; the template takes both.
    let mut next = weather_request(false);
    next["messages"].as_array_mut().unwrap().extend([
        json!({"role": "assistant", "content": "", "tool_calls": message["tool_calls"]}),
        json!({"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": "18C"}),
    ]);
    let r: Value = serde_json::from_str(&chat(&base, &next).await).unwrap();
    assert_eq!(r["choices"][0]["finish_reason"], "tool_calls", "{r}");
}

/// Mistral Small 3.2 writes each call after its own `[TOOL_CALLS]`, with an id before `[ARGS]`
/// in history; streamed, the calls come whole, in order, and no marker reaches the client.
#[tokio::test]
async fn mistral_small_calls_streamed() {
    let family = Family {
        template: "mistral-small-3.2.jinja",
        tokens: &["[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"],
    };
    let reply = "[TOOL_CALLS]get_weather[ARGS]{\"city\": \"Paris\", \"days\": 2}\
                 [TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]{\"city\": \"Oslo\"}";
    let base = start(&family, reply).await;
    let text = chat(&base, &weather_request(true)).await;
    assert!(
        !text.contains("[TOOL_CALLS]") && !text.contains("[ARGS]"),
        "{text}"
    );
    let chunks = chunks(&text);
    let calls: Vec<(u64, String, Value)> = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["tool_calls"].as_array())
        .flatten()
        .map(|call| {
            let arguments = call["function"]["arguments"].as_str().unwrap();
            (
                call["index"].as_u64().unwrap(),
                call["function"]["name"].as_str().unwrap().to_owned(),
                serde_json::from_str(arguments).unwrap(),
            )
        })
        .collect();
    assert_eq!(
        calls,
        [
            (
                0,
                "get_weather".to_owned(),
                json!({"city": "Paris", "days": 2})
            ),
            (1, "get_weather".to_owned(), json!({"city": "Oslo"})),
        ]
    );
    let content: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(content, "");
    let last = chunks.last().unwrap();
    assert_eq!(last["choices"][0]["finish_reason"], "tool_calls");
}

/// Mistral Nemo's calls: one JSON list after `[TOOL_CALLS]`.
#[tokio::test]
async fn mistral_nemo_json_list() {
    let family = Family {
        template: "mistral-nemo.jinja",
        tokens: &["[TOOL_CALLS]"],
    };
    let reply = "[TOOL_CALLS][{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}, \
                 \"id\": \"a1b2c3d4e\"}]";
    let base = start(&family, reply).await;
    let r: Value = serde_json::from_str(&chat(&base, &weather_request(false)).await).unwrap();
    let choice = &r["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{r}");
    assert_eq!(choice["message"]["content"], Value::Null);
    assert_eq!(
        calls_of(&choice["message"]),
        [("get_weather".to_owned(), json!({"city": "Paris"}))]
    );
}

/// The pythonic template (vLLM's for Llama 3.2): the reply is a Python list of calls, or else
/// plain content.
#[tokio::test]
async fn pythonic_calls_and_plain_answers() {
    let family = Family {
        template: "llama-3.2-pythonic.jinja",
        tokens: &[],
    };
    let base = start(
        &family,
        "[get_weather(city='Paris', days=2), get_weather(city=\"Oslo\")]",
    )
    .await;
    let r: Value = serde_json::from_str(&chat(&base, &weather_request(false)).await).unwrap();
    let choice = &r["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{r}");
    assert_eq!(
        calls_of(&choice["message"]),
        [
            (
                "get_weather".to_owned(),
                json!({"city": "Paris", "days": 2})
            ),
            ("get_weather".to_owned(), json!({"city": "Oslo"})),
        ]
    );

    let base = start(&family, "[Paris] is sunny.").await;
    let r: Value = serde_json::from_str(&chat(&base, &weather_request(false)).await).unwrap();
    let choice = &r["choices"][0];
    assert_eq!(choice["finish_reason"], "stop", "{r}");
    assert_eq!(choice["message"]["content"], "[Paris] is sunny.");
    assert!(choice["message"].get("tool_calls").is_none(), "{r}");
}

/// gpt-oss's template, over a tokenizer with harmony's markers.
const GPT_OSS: Family = Family {
    template: "gpt-oss.jinja",
    tokens: &[
        "<|start|>",
        "<|end|>",
        "<|message|>",
        "<|channel|>",
        "<|constrain|>",
        "<|return|>",
        "<|call|>",
    ],
};

/// gpt-oss reasons on the analysis channel, then calls on the commentary channel (the reply
/// ends there: `<|call|>` is its end of sequence).
const HARMONY_CALL: &str = "<|channel|>analysis<|message|>The user wants the weather.<|end|>\
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>\
    {\"city\":\"Paris\",\"days\":2}";

/// gpt-oss reasons, then answers on the final channel.
const HARMONY_ANSWER: &str = "<|channel|>analysis<|message|>Easy.<|end|>\
    <|start|>assistant<|channel|>final<|message|>It is sunny in Paris.";

/// The conversation part of a gpt-oss prompt: what follows the system and developer messages.
fn conversation(prompt: &str) -> &str {
    &prompt[prompt.find("<|start|>user").unwrap()..]
}

/// The weather request, its tool described (gpt-oss's template writes the description).
fn described_weather_request(stream: bool) -> Value {
    let mut request = weather_request(stream);
    request["tools"][0]["function"]["description"] = "The forecast.".into();
    request
}

#[tokio::test]
async fn harmony_reasoning_then_a_call() {
    let served = serve(&GPT_OSS, HARMONY_CALL, Settings::default()).await;
    let reply: Value =
        serde_json::from_str(&chat(&served.base, &described_weather_request(false)).await).unwrap();
    let choice = &reply["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{reply}");
    let id = &choice["message"]["tool_calls"][0]["id"];
    assert!(id.as_str().unwrap().starts_with("call_"), "{reply}");
    assert_eq!(
        choice["message"],
        json!({
            "role": "assistant",
            "content": null,
            "reasoning_content": "The user wants the weather.",
            "reasoning": "The user wants the weather.",
            "tool_calls": [{"id": id, "type": "function", "function": {
                "name": "get_weather", "arguments": "{\"city\":\"Paris\",\"days\":2}"}}],
        })
    );
    // The tool, in the template's TypeScript, in the developer message.
    let prompt = served.last_prompt();
    assert!(
        prompt.contains(
            "<|start|>developer<|message|># Tools\n\n## functions\n\nnamespace functions {\n\n\
             // The forecast.\ntype get_weather = (_: {\ncity?: string,\ndays?: number,\n}) => any;\n\n\
             } // namespace functions<|end|>"
        ),
        "{prompt}"
    );
    assert!(
        prompt.contains("Calls to these tools must go to the commentary channel: 'functions'."),
        "{prompt}"
    );
    assert_eq!(
        conversation(&prompt),
        "<|start|>user<|message|>Weather in Paris?<|end|><|start|>assistant"
    );

    // The call and its result go back as history: the reasoning before the call as the
    // analysis the template keeps while the turn goes on, the result from the tool by name.
    let mut next = described_weather_request(false);
    next["messages"].as_array_mut().unwrap().extend([
        choice["message"].clone(),
        json!({"role": "tool", "tool_call_id": id, "content": "18C"}),
    ]);
    let reply: Value = serde_json::from_str(&chat(&served.base, &next).await).unwrap();
    assert_eq!(
        reply["choices"][0]["finish_reason"], "tool_calls",
        "{reply}"
    );
    assert_eq!(
        conversation(&served.last_prompt()),
        "<|start|>user<|message|>Weather in Paris?<|end|>\
         <|start|>assistant<|channel|>analysis<|message|>The user wants the weather.<|end|>\
         <|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>\
         {\"city\": \"Paris\", \"days\": 2}<|call|>\
         <|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>\"18C\"<|end|>\
         <|start|>assistant"
    );
}

/// `<|call|>` ends the reply even where the model's own end-of-sequence ids leave it out (the
/// scripted model's are not harmony's): what the model would go on to make up is never made.
#[tokio::test]
async fn harmony_ends_at_call() {
    let script = format!(
        "{HARMONY_CALL}<|call|><|start|>functions.get_weather to=assistant<|channel|>commentary\
         <|message|>{{\"temp\": 30}}<|end|><|start|>assistant<|channel|>final<|message|>Made up."
    );
    let served = serve(&GPT_OSS, &script, Settings::default()).await;
    let reply: Value =
        serde_json::from_str(&chat(&served.base, &weather_request(false)).await).unwrap();
    let choice = &reply["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{reply}");
    assert_eq!(choice["message"]["content"], Value::Null, "{reply}");
    // The script up to `<|call|>`, and `<|call|>`.
    let tokens = served.tokenizer.encode(HARMONY_CALL, false).unwrap().len() + 1;
    assert_eq!(reply["usage"]["completion_tokens"], tokens, "{reply}");
}

/// Streamed, the reasoning and the answer come as deltas, the call whole; no marker reaches
/// the client.
#[tokio::test]
async fn harmony_streamed() {
    let base = start(&GPT_OSS, HARMONY_ANSWER).await;
    let text = chat(&base, &weather_request(true)).await;
    assert!(!text.contains("<|"), "{text}");
    let chunks = chunks(&text);
    let delta = |chunks: &[Value], key: &str| -> Vec<String> {
        chunks
            .iter()
            .filter_map(|c| c["choices"][0]["delta"][key].as_str())
            .map(str::to_owned)
            .collect()
    };
    assert_eq!(delta(&chunks, "reasoning_content").concat(), "Easy.");
    let content = delta(&chunks, "content");
    assert_eq!(content.concat(), "It is sunny in Paris.");
    // Word by word, as the tokens come.
    assert!(content.len() > 1, "{content:?}");
    assert_eq!(
        chunks.last().unwrap()["choices"][0]["finish_reason"],
        "stop"
    );

    let base = start(&GPT_OSS, HARMONY_CALL).await;
    let text = chat(&base, &weather_request(true)).await;
    assert!(!text.contains("<|"), "{text}");
    let chunks = common::chunks(&text);
    assert_eq!(
        delta(&chunks, "reasoning_content").concat(),
        "The user wants the weather."
    );
    assert_eq!(delta(&chunks, "content"), Vec::<String>::new());
    let calls: Vec<&Value> = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["tool_calls"].as_array())
        .flatten()
        .collect();
    assert_eq!(calls.len(), 1, "{text}");
    assert_eq!(calls[0]["index"], 0);
    assert_eq!(
        calls[0]["function"],
        json!({"name": "get_weather", "arguments": "{\"city\":\"Paris\",\"days\":2}"})
    );
    assert_eq!(
        chunks.last().unwrap()["choices"][0]["finish_reason"],
        "tool_calls"
    );
}

/// A reply cut short by `max_tokens` keeps what it had: reasoning so far, or the text of a
/// call whose arguments never closed, markers left out.
#[tokio::test]
async fn harmony_cut_off() {
    // The script's first `n` tokens, and the text of their last message.
    let cut = |served: &Served, script: &str, n: usize| {
        let ids = served.tokenizer.encode(script, false).unwrap();
        let text = served.tokenizer.decode(&ids[..n], false).unwrap();
        let message = text.rsplit("<|message|>").next().unwrap().to_owned();
        (n, message)
    };
    let served = serve(&GPT_OSS, HARMONY_ANSWER, Settings::default()).await;
    let header = served
        .tokenizer
        .encode("<|channel|>analysis<|message|>", false)
        .unwrap()
        .len();
    let (max_tokens, reasoning) = cut(&served, HARMONY_ANSWER, header + 1);
    assert!(!reasoning.is_empty() && "Easy.".starts_with(&reasoning));
    let mut request = weather_request(false);
    request["max_tokens"] = max_tokens.into();
    let reply: Value = serde_json::from_str(&chat(&served.base, &request).await).unwrap();
    let choice = &reply["choices"][0];
    assert_eq!(choice["finish_reason"], "length", "{reply}");
    assert_eq!(
        choice["message"],
        json!({"role": "assistant", "content": null, "reasoning_content": reasoning,
               "reasoning": reasoning})
    );

    let served = serve(&GPT_OSS, HARMONY_CALL, Settings::default()).await;
    let all = served.tokenizer.encode(HARMONY_CALL, false).unwrap().len();
    let (max_tokens, arguments) = cut(&served, HARMONY_CALL, all - 1);
    assert!(arguments.starts_with("{\"city\":\"Paris\""), "{arguments}");
    request["max_tokens"] = max_tokens.into();
    let reply: Value = serde_json::from_str(&chat(&served.base, &request).await).unwrap();
    let choice = &reply["choices"][0];
    assert_eq!(choice["finish_reason"], "length", "{reply}");
    assert_eq!(choice["message"]["content"], arguments, "{reply}");
    assert!(choice["message"].get("tool_calls").is_none(), "{reply}");
}

/// History the way gpt-oss's template takes it: a turn of two calls becomes two, each with
/// its result; reasoning and a preamble both kept, as the analysis; and OpenAI's reasoning
/// effort becomes the system message's.
#[tokio::test]
async fn harmony_history_through_the_template() {
    let served = serve(&GPT_OSS, HARMONY_ANSWER, Settings::default()).await;
    let call = |id: &str, city: &str| {
        json!({"id": id, "type": "function",
               "function": {"name": "get_weather", "arguments": format!("{{\"city\": \"{city}\"}}")}})
    };
    let mut request = weather_request(false);
    request["messages"].as_array_mut().unwrap().extend([
        json!({"role": "assistant", "content": "Checking both.", "reasoning_content": "Two cities.",
               "tool_calls": [call("call_a", "Paris"), call("call_b", "Oslo")]}),
        json!({"role": "tool", "tool_call_id": "call_b", "content": "5C"}),
        json!({"role": "tool", "tool_call_id": "call_a", "content": "18C"}),
    ]);
    request["reasoning_effort"] = "high".into();
    let reply: Value = serde_json::from_str(&chat(&served.base, &request).await).unwrap();
    assert_eq!(
        reply["choices"][0]["message"]["content"],
        "It is sunny in Paris."
    );
    let prompt = served.last_prompt();
    assert!(prompt.contains("\nReasoning: high\n"), "{prompt}");
    assert_eq!(
        conversation(&prompt),
        "<|start|>user<|message|>Weather in Paris?<|end|>\
         <|start|>assistant<|channel|>analysis<|message|>Two cities.\n\nChecking both.<|end|>\
         <|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>\
         {\"city\": \"Paris\"}<|call|>\
         <|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>\"18C\"<|end|>\
         <|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>\
         {\"city\": \"Oslo\"}<|call|>\
         <|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>\"5C\"<|end|>\
         <|start|>assistant"
    );
    // A finished turn's answer stays, its reasoning goes (the template drops it); gpt-oss has
    // no effort below low.
    let mut request = weather_request(false);
    request["messages"].as_array_mut().unwrap().extend([
        json!({"role": "assistant", "content": "Sunny.", "reasoning_content": "Easy."}),
        json!({"role": "user", "content": "And tomorrow?"}),
    ]);
    request["reasoning_effort"] = "none".into();
    let reply: Value = serde_json::from_str(&chat(&served.base, &request).await).unwrap();
    assert_eq!(reply["object"], "chat.completion", "{reply}");
    let prompt = served.last_prompt();
    assert!(prompt.contains("\nReasoning: low\n"), "{prompt}");
    assert_eq!(
        conversation(&prompt),
        "<|start|>user<|message|>Weather in Paris?<|end|>\
         <|start|>assistant<|channel|>final<|message|>Sunny.<|end|>\
         <|start|>user<|message|>And tomorrow?<|end|><|start|>assistant"
    );
}

/// Anthropic's Messages: the analysis is a thinking block, the call a tool_use block, whole
/// or streamed; the tool_use → tool_result round trip renders as harmony.
#[tokio::test]
async fn harmony_in_anthropic_messages() {
    let served = serve(&GPT_OSS, HARMONY_CALL, Settings::default()).await;
    let request = |stream: bool| {
        json!({"model": "m", "max_tokens": 100, "stream": stream,
               "messages": [{"role": "user", "content": "Weather in Paris?"}],
               "tools": [{"name": "get_weather", "description": "The forecast.", "input_schema": {
                   "type": "object", "properties": {"city": {"type": "string"},
                                                    "days": {"type": "integer"}}}}]})
    };
    let (status, text) = post(&served.base, "/v1/messages", &request(false)).await;
    assert_eq!(status, 200, "{text}");
    let reply: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(reply["stop_reason"], "tool_use", "{reply}");
    let tool_id = reply["content"][1]["id"].clone();
    assert!(tool_id.as_str().unwrap().starts_with("toolu_"), "{reply}");
    assert_eq!(
        reply["content"],
        json!([
            {"type": "thinking", "thinking": "The user wants the weather.", "signature": ""},
            {"type": "tool_use", "id": tool_id, "name": "get_weather",
             "input": {"city": "Paris", "days": 2}},
        ])
    );

    let (status, text) = post(&served.base, "/v1/messages", &request(true)).await;
    assert_eq!(status, 200, "{text}");
    assert!(!text.contains("<|"), "{text}");
    let events: Vec<Value> = text
        .split("\n\n")
        .filter_map(|e| e.lines().find_map(|l| l.strip_prefix("data: ")))
        .map(|data| serde_json::from_str(data).unwrap())
        .collect();
    let thinking: String = events
        .iter()
        .filter_map(|e| e["delta"]["thinking"].as_str())
        .collect();
    assert_eq!(thinking, "The user wants the weather.");
    let starts: Vec<&Value> = events
        .iter()
        .filter(|e| e["type"] == "content_block_start")
        .map(|e| &e["content_block"]["type"])
        .collect();
    assert_eq!(starts, ["thinking", "tool_use"]);
    let input: String = events
        .iter()
        .filter_map(|e| e["delta"]["partial_json"].as_str())
        .collect();
    assert_eq!(
        serde_json::from_str::<Value>(&input).unwrap(),
        json!({"city": "Paris", "days": 2})
    );

    let mut next = request(false);
    next["messages"].as_array_mut().unwrap().extend([
        json!({"role": "assistant", "content": reply["content"]}),
        json!({"role": "user", "content": [{"type": "tool_result", "tool_use_id": tool_id,
                                            "content": "18C"}]}),
    ]);
    let (status, text) = post(&served.base, "/v1/messages", &next).await;
    assert_eq!(status, 200, "{text}");
    assert_eq!(
        conversation(&served.last_prompt()),
        "<|start|>user<|message|>Weather in Paris?<|end|>\
         <|start|>assistant<|channel|>analysis<|message|>The user wants the weather.<|end|>\
         <|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>\
         {\"city\": \"Paris\", \"days\": 2}<|call|>\
         <|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>\"18C\"<|end|>\
         <|start|>assistant"
    );
}

/// OpenAI's Responses: the analysis is a reasoning item, the answer a message, the call a
/// function_call item, whole or streamed.
#[tokio::test]
async fn harmony_in_responses() {
    let tool = json!({"type": "function", "name": "get_weather", "description": "The forecast.",
                      "parameters": {"type": "object", "properties": {
                          "city": {"type": "string"}, "days": {"type": "integer"}}}});
    let request = |stream: bool| json!({"model": "m", "input": "Weather in Paris?", "tools": [tool], "stream": stream});
    let served = serve(&GPT_OSS, HARMONY_CALL, Settings::default()).await;
    let (status, text) = post(&served.base, "/v1/responses", &request(false)).await;
    assert_eq!(status, 200, "{text}");
    let reply: Value = serde_json::from_str(&text).unwrap();
    let output = &reply["output"];
    assert_eq!(
        *output,
        json!([
            {"type": "reasoning", "id": output[0]["id"], "summary": [],
             "content": [{"type": "reasoning_text", "text": "The user wants the weather."}]},
            {"type": "function_call", "id": output[1]["id"], "call_id": output[1]["call_id"],
             "name": "get_weather", "arguments": "{\"city\":\"Paris\",\"days\":2}",
             "status": "completed"},
        ])
    );
    let (status, text) = post(&served.base, "/v1/responses", &request(true)).await;
    assert_eq!(status, 200, "{text}");
    assert!(!text.contains("<|"), "{text}");
    assert!(
        text.contains("\"arguments\":\"{\\\"city\\\":\\\"Paris\\\",\\\"days\\\":2}\""),
        "{text}"
    );

    let served = serve(&GPT_OSS, HARMONY_ANSWER, Settings::default()).await;
    let (status, text) = post(&served.base, "/v1/responses", &request(false)).await;
    assert_eq!(status, 200, "{text}");
    let reply: Value = serde_json::from_str(&text).unwrap();
    let output = &reply["output"];
    assert_eq!(output[0]["content"][0]["text"], "Easy.", "{reply}");
    assert_eq!(output[1]["type"], "message", "{reply}");
    assert_eq!(
        output[1]["content"][0]["text"], "It is sunny in Paris.",
        "{reply}"
    );
    assert_eq!(output.as_array().unwrap().len(), 2, "{reply}");
}

/// A model with random weights behind gpt-oss's template, a call required: it may reason
/// first (on the analysis channel, which it may not end before `max_tokens`), and then must
/// call in harmony's format, read back as a call; a JSON answer comes on the final channel.
#[tokio::test]
async fn harmony_required_calls_and_json_answers() {
    let base = random_model_behind("gpt-oss.jinja").await;
    let mut calls_made = 0;
    for seed in 0..6 {
        for choice in [
            json!("required"),
            json!({"type": "function", "function": {"name": "set_alarm"}}),
        ] {
            let body = json!({
                "messages": [{"role": "user", "content": "Wake me at seven."}],
                "tools": numeric_tools(), "tool_choice": choice,
                "max_tokens": 300, "temperature": 1.0, "seed": seed,
            });
            let reply: Value = serde_json::from_str(&chat(&base, &body).await).unwrap();
            let choice_made = &reply["choices"][0];
            let message = &choice_made["message"];
            if choice_made["finish_reason"] == "length" {
                // Still reasoning.
                assert_eq!(message["content"], Value::Null, "{reply}");
                assert!(message.get("tool_calls").is_none(), "{reply}");
                continue;
            }
            assert_eq!(choice_made["finish_reason"], "tool_calls", "{reply}");
            let calls = message["tool_calls"].as_array().unwrap();
            assert_eq!(calls.len(), 1, "{reply}");
            check_call(&calls[0], &reply);
            if body["tool_choice"].is_object() {
                assert_eq!(calls[0]["function"]["name"], "set_alarm");
            }
            assert_eq!(message["content"], Value::Null, "{reply}");
            calls_made += 1;
        }
    }
    assert!(calls_made > 0);
    let schema = json!({"type": "object", "properties": {"hour": {"type": "integer",
        "minimum": 0, "maximum": 23}}, "required": ["hour"], "additionalProperties": false});
    let mut answers = 0;
    for seed in 0..6 {
        let body = json!({
            "messages": [{"role": "user", "content": "When?"}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": schema}},
            "max_tokens": 300, "temperature": 1.0, "seed": seed,
        });
        let reply: Value = serde_json::from_str(&chat(&base, &body).await).unwrap();
        let message = &reply["choices"][0]["message"];
        if reply["choices"][0]["finish_reason"] == "length" {
            assert_eq!(message["content"], Value::Null, "{reply}");
            continue;
        }
        assert_eq!(reply["choices"][0]["finish_reason"], "stop", "{reply}");
        let answer: Value = serde_json::from_str(message["content"].as_str().unwrap()).unwrap();
        assert!(answer["hour"].is_i64(), "{reply}");
        answers += 1;
    }
    assert!(answers > 0);
}
