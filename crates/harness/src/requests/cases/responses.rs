//! Cases of the Responses API: `POST /v1/responses`, and `GET` and `DELETE` of stored ones.

use rand::rngs::StdRng;
use rand::seq::IndexedRandom;
use rand::Rng;
use serde_json::{json, Map, Value};

use super::{
    drawn_field, ending_soon, field_value, into_map, model_paths, post, prompt_text, random_text,
    request, short_text, with_raw_fields, Case, Promise, Target,
};

const RESPONSES: &str = "/v1/responses";

/// The fields of a Responses request, and some the server does not know.
const FIELDS: [&str; 20] = [
    "model",
    "input",
    "instructions",
    "max_output_tokens",
    "temperature",
    "top_p",
    "stream",
    "store",
    "previous_response_id",
    "tools",
    "tool_choice",
    "text",
    "reasoning",
    "metadata",
    "parallel_tool_calls",
    "user",
    "chat_template_kwargs",
    "logit_bias",
    "include",
    "truncation",
];

/// A valid request: few tokens, streamed or not, stored or not.
fn body(rng: &mut StdRng, target: &Target) -> Map<String, Value> {
    let mut body = json!({
        "model": target.model_id,
        "input": short_text(rng),
        "max_output_tokens": rng.random_range(1..=8),
    });
    if rng.random_bool(0.4) {
        body["stream"] = true.into();
    }
    if rng.random_bool(0.3) {
        body["store"] = false.into();
    }
    into_map(body)
}

/// `text.format`s, valid and not: schemas that do not compile among them.
fn text_formats() -> [Value; 12] {
    let schema =
        |schema: Value| json!({"format": {"type": "json_schema", "name": "s", "schema": schema}});
    [
        json!({"format": {"type": "text"}}),
        json!({"format": {"type": "json_object"}}),
        schema(
            json!({"type": "object", "properties": {"a": {"type": "integer"}},
                      "required": ["a"]}),
        ),
        schema(json!({"type": 5})),
        schema(json!({"type": "object", "properties": "a"})),
        schema(json!({"$ref": "#/nowhere"})),
        schema(json!({"type": "string", "pattern": "("})),
        schema(json!(false)),
        schema(json!("object")),
        json!({"format": {"type": "json_schema", "name": 5, "schema": {}}}),
        json!({"format": {"type": "xml"}}),
        json!({"format": "json"}),
    ]
}

/// Tools as the Responses API lists them, valid and not.
fn tools() -> [Value; 7] {
    [
        json!([{"type": "function", "name": "get_weather", "description": "Weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]),
        json!([{"type": "function", "name": "f", "parameters": {"type": "nonsense"}}]),
        json!([{"type": "web_search"}]),
        json!([{"type": "function"}]),
        json!([{"name": "f"}]),
        json!(["f"]),
        json!({"type": "function", "name": "f"}),
    ]
}

/// Values at the edges of what the fields this API adds accept; the chat's for the rest.
fn boundary_value(rng: &mut StdRng, field: &str, target: &Target) -> String {
    let values: Vec<Value> = match field {
        "max_output_tokens" => vec![json!(0), json!(1), json!(-1), json!(u64::MAX)],
        "text" => text_formats().to_vec(),
        "tools" => tools().to_vec(),
        "tool_choice" => vec![
            json!("auto"),
            json!("required"),
            json!("none"),
            json!({"type": "function", "name": "nowhere"}),
            json!({"type": "function"}),
            json!("any"),
        ],
        "reasoning" => vec![
            json!({"effort": "low"}),
            json!({"effort": 1}),
            json!("high"),
        ],
        "previous_response_id" => vec![
            json!("resp_unknown"),
            json!(""),
            json!(random_text(rng, 20)),
        ],
        "store" | "parallel_tool_calls" => vec![json!(true), json!(false), json!("true")],
        _ => return field_value(rng, field, target),
    };
    values.choose(rng).expect("never empty").to_string()
}

/// A request with one field set to a value of any type, or at the edge of what it accepts.
pub fn field(rng: &mut StdRng, target: &Target) -> Case {
    let (field, value) = drawn_field(rng, &FIELDS, |rng, field| {
        boundary_value(rng, field, target)
    });
    let mut fields = vec![(field, value)];
    ending_soon(target, &mut fields);
    Case::api(
        "responses-field",
        post(RESPONSES, &with_raw_fields(body(rng, target), &fields)),
    )
}

/// An input item of any type, valid or not.
fn item(rng: &mut StdRng, target: &Target) -> Value {
    match rng.random_range(0..14) {
        0 => json!({"role": "user", "content": short_text(rng)}),
        1 => json!({"type": "message", "role": "user",
                    "content": [{"type": "input_text", "text": prompt_text(rng, target)}]}),
        2 => json!({"role": "developer", "content": "Be brief."}),
        3 => json!({"role": "assistant", "content": [{"type": "output_text", "text": "Hi",
                                                      "annotations": []}]}),
        4 => json!({"role": "user", "content": [{"type": "input_image", "image_url": "data:,"}]}),
        5 => json!({"role": "tool", "content": "x"}),
        6 => json!({"type": "function_call", "call_id": "call_1", "name": "get_weather",
                    "arguments": "{\"city\": \"Paris\"}"}),
        7 => json!({"type": "function_call", "call_id": "call_2", "name": "f"}),
        8 => json!({"type": "function_call_output", "call_id": "call_unknown", "output": "18C"}),
        9 => json!({"type": "function_call_output", "call_id": "call_1", "output": 5}),
        10 => json!({"type": "reasoning", "summary": [],
                     "content": [{"type": "reasoning_text", "text": "Hmm."}]}),
        11 => json!({"type": "item_reference", "id": "msg_1"}),
        12 => json!({"type": random_text(rng, 8), "role": "user"}),
        _ => json!(short_text(rng)),
    }
}

/// Inputs of every shape, text formats and tools valid and not, unknown previous responses
/// (404) and stored responses the server cannot have (404 on `GET` and `DELETE`); and a valid
/// request with a function call and its output, which must get a 200.
pub fn input(rng: &mut StdRng, target: &Target) -> Case {
    let mut body = body(rng, target);
    match rng.random_range(0..10) {
        0 => {
            let id = match rng.random_range(0..3) {
                0 => "resp_00000000000000000000000000000000".to_owned(),
                1 => random_text(rng, 12),
                _ => "x".repeat(10_000),
            };
            body.insert("previous_response_id".into(), id.into());
            let bytes = post(RESPONSES, Value::Object(body).to_string().as_bytes());
            Case::promising("responses-input", bytes, Promise::Status(404))
        }
        1 => {
            let method = if rng.random_bool(0.5) {
                "GET"
            } else {
                "DELETE"
            };
            let path = if rng.random_bool(0.7) {
                "/v1/responses/resp_00000000000000000000000000000000".to_owned()
            } else {
                model_paths(rng, target).replace("/v1/models/", "/v1/responses/")
            };
            Case::api("responses-stored", request(method, &path, &[], b"", false))
        }
        2 => {
            let input = json!([
                {"role": "user", "content": "Weather in Paris?"},
                {"type": "function_call", "call_id": "call_1", "name": "get_weather",
                 "arguments": "{\"city\": \"Paris\"}"},
                {"type": "function_call_output", "call_id": "call_1", "output": "18C"},
            ]);
            body.insert("input".into(), input);
            body.insert("tools".into(), tools()[0].clone());
            let bytes = post(RESPONSES, Value::Object(body).to_string().as_bytes());
            Case::promising("responses-input", bytes, Promise::Status(200))
        }
        draw => {
            if draw < 7 {
                let items: Vec<Value> = (0..rng.random_range(1..5))
                    .map(|_| item(rng, target))
                    .collect();
                body.insert("input".into(), items.into());
            }
            if draw >= 5 {
                let formats = text_formats();
                body.insert(
                    "text".into(),
                    formats.choose(rng).expect("not empty").clone(),
                );
            }
            if rng.random_bool(0.3) {
                let tools = tools();
                body.insert(
                    "tools".into(),
                    tools.choose(rng).expect("not empty").clone(),
                );
            }
            let bytes = post(RESPONSES, Value::Object(body).to_string().as_bytes());
            Case::api("responses-input", bytes)
        }
    }
}
