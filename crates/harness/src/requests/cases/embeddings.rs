//! Cases of `/v1/embeddings`. A model that does not embed refuses every request with a 400:
//! one naming `model` when the request itself is valid.

use rand::rngs::StdRng;
use rand::seq::IndexedRandom;
use rand::Rng;
use serde_json::{json, Value};

use super::{hostile_value, post, random_text, short_text, with_raw_fields, Case, Promise, Target};

const EMBEDDINGS: &str = "/v1/embeddings";

/// A valid request: its body, and how many vectors it asks for and in which encoding.
fn valid(rng: &mut StdRng, target: &Target) -> (Value, usize, bool) {
    let vocab = target.vocab_size;
    let (input, count) = match rng.random_range(0..4) {
        0 => (json!(short_text(rng)), 1),
        1 => {
            let count = rng.random_range(1..5);
            let texts: Vec<String> = (0..count).map(|_| short_text(rng)).collect();
            (json!(texts), count)
        }
        2 => (json!([1, 2, vocab - 1]), 1),
        _ => (json!([[1, 2], [3], [vocab - 1]]), 3),
    };
    let base64 = rng.random_bool(0.5);
    let mut body = json!({"model": target.model_id, "input": input});
    if base64 {
        body["encoding_format"] = "base64".into();
    } else if rng.random_bool(0.5) {
        body["encoding_format"] = "float".into();
    }
    (body, count, base64)
}

/// A field set to a value of any type, or at the edge of what it accepts.
fn invalid_field(rng: &mut StdRng, target: &Target) -> (&'static str, String) {
    let vocab = target.vocab_size;
    let field = *[
        "input",
        "encoding_format",
        "dimensions",
        "prompt_name",
        "model",
        "user",
    ]
    .choose(rng)
    .expect("not empty");
    let edges: Vec<Value> = match field {
        "input" => vec![
            json!([]),
            json!([""]),
            json!([vocab]),
            json!([-1]),
            json!([[]]),
            json!(["a", 1]),
            json!([1, "a"]),
            json!(random_text(rng, 200)),
        ],
        "encoding_format" => vec![json!("float16"), json!("BASE64"), json!(1)],
        "dimensions" => vec![json!(0), json!(1), json!(-1), json!(u64::MAX), json!("8")],
        "prompt_name" => vec![json!("query"), json!("nowhere"), json!(1)],
        _ => vec![],
    };
    let value = match edges.choose(rng) {
        Some(edge) if rng.random_bool(0.6) => edge.to_string(),
        _ => hostile_value(rng),
    };
    (field, value)
}

pub fn request(rng: &mut StdRng, target: &Target) -> Case {
    let (body, count, base64) = valid(rng, target);
    if rng.random_bool(0.4) {
        let promise = if target.embeds {
            Promise::Embeddings { count, base64 }
        } else {
            Promise::CannotEmbed
        };
        let bytes = post(EMBEDDINGS, body.to_string().as_bytes());
        return Case::promising("embeddings", bytes, promise);
    }
    let Value::Object(body) = body else {
        unreachable!("built as an object")
    };
    let field = invalid_field(rng, target);
    let bytes = post(EMBEDDINGS, &with_raw_fields(body, &[field]));
    // Whatever a model that does not embed is sent, it refuses.
    let promise = if target.embeds {
        Promise::WellFormed
    } else {
        Promise::Status(400)
    };
    Case::promising("embeddings", bytes, promise)
}
