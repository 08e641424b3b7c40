//! Arbitrary model output through the server's reply parser (reasoning markers and every
//! tool-call format). The first byte picks the format, the reasoning markers and whether the
//! reply starts inside reasoning; the second how the text is cut into streamed pieces. However
//! the text is cut, the reply must come out the same as when it arrives whole, and the formats
//! that build their arguments must give JSON objects.
#![no_main]

use libfuzzer_sys::fuzz_target;
use oxlm_server::parsers::{OutputParser, Piece, ToolFormat};
use serde_json::{json, Value};

const FORMATS: [Option<ToolFormat>; 6] = [
    None,
    Some(ToolFormat::Hermes),
    Some(ToolFormat::Qwen3Coder),
    Some(ToolFormat::Llama3Json),
    Some(ToolFormat::Gemma4),
    Some(ToolFormat::Harmony),
];

/// The reasoning markers `Tokenizer::think_markers` can give.
const THINK: [Option<(&str, &str)>; 4] = [
    None,
    Some(("<think>", "</think>")),
    Some(("<|channel>thought", "<channel|>")),
    Some(("<|open|>think<|sep|>", "<|close|>think<|sep|>")),
];

fn tools() -> Value {
    let property = |kind: &str| json!({"type": kind});
    json!([{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
        "properties": {"s": property("string"), "n": property("integer"),
            "b": property("boolean"), "o": property("object")}}}}])
}

/// The reply's pieces with adjacent content, and adjacent reasoning, joined.
fn parse(parser: &mut OutputParser, chunks: &[&str]) -> Vec<Piece> {
    let mut out: Vec<Piece> = Vec::new();
    let pieces = chunks
        .iter()
        .flat_map(|c| parser.push(c))
        .collect::<Vec<_>>();
    for piece in pieces.into_iter().chain(parser.finish()) {
        match (out.last_mut(), piece) {
            (Some(Piece::Content(a)), Piece::Content(b)) => a.push_str(&b),
            (Some(Piece::Reasoning(a)), Piece::Reasoning(b)) => a.push_str(&b),
            (_, piece) => out.push(piece),
        }
    }
    out
}

/// `text` cut at character boundaries into pieces of 1 to 8 bytes or so, as `seed` says.
fn cut(text: &str, mut seed: u8) -> Vec<&str> {
    let mut chunks = Vec::new();
    let mut start = 0;
    while start < text.len() {
        seed = seed.wrapping_mul(37).wrapping_add(11);
        let mut end = (start + 1 + usize::from(seed % 8)).min(text.len());
        while !text.is_char_boundary(end) {
            end += 1;
        }
        chunks.push(&text[start..end]);
        start = end;
    }
    chunks
}

fuzz_target!(|data: &[u8]| {
    let [mode, seed, text @ ..] = data else {
        return;
    };
    let text = String::from_utf8_lossy(text);
    let mode = usize::from(*mode);
    let format = FORMATS[mode % FORMATS.len()];
    let think = THINK[mode / FORMATS.len() % THINK.len()];
    let in_reasoning = mode / (FORMATS.len() * THINK.len()) % 2 == 1;
    let parser = OutputParser::new(think, in_reasoning, format.map(|f| (f, tools())));

    let whole = parse(&mut parser.clone(), &[&text]);
    let streamed = parse(&mut parser.clone(), &cut(&text, *seed));
    assert_eq!(whole, streamed, "the reply depends on how it was cut");
    if matches!(
        format,
        Some(ToolFormat::Qwen3Coder | ToolFormat::Gemma4 | ToolFormat::Harmony)
    ) {
        for piece in &whole {
            if let Piece::ToolCall(call) = piece {
                let arguments: Value = serde_json::from_str(&call.arguments).expect("JSON");
                assert!(arguments.is_object(), "{}", call.arguments);
            }
        }
    }
});
