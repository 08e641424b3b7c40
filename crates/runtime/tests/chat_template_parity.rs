//! Renders every case of tests/fixtures/templates/*.json (goldens from transformers 5.24's renderer, see the
//! README there) and requires byte-for-byte equality.

use std::path::{Path, PathBuf};

use oxlm_runtime::chat_template::{ChatTemplate, ChatTemplateError, CivilDateTime};
use serde_json::{Map, Value};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/templates")
}

/// Where two strings first differ, with some context on each side, escaped so whitespace shows.
fn describe_diff(want: &str, got: &str) -> String {
    let at = want
        .char_indices()
        .zip(got.chars())
        .find(|((_, a), b)| a != b)
        .map(|((i, _), _)| i)
        .unwrap_or(want.len().min(got.len()));
    let around = |s: &str| {
        let mut start = at.saturating_sub(60).min(s.len());
        while !s.is_char_boundary(start) {
            start -= 1;
        }
        let mut end = (at + 60).min(s.len());
        while !s.is_char_boundary(end) {
            end += 1;
        }
        format!("{:?}", &s[start..end])
    };
    format!(
        "first difference at byte {at} (expected {} bytes, got {})\n  expected: …{}…\n  got:      …{}…",
        want.len(),
        got.len(),
        around(want),
        around(got)
    )
}

fn object(value: &Value) -> Map<String, Value> {
    value.as_object().cloned().unwrap_or_default()
}

#[test]
fn templates_render_like_transformers() {
    let mut files: Vec<PathBuf> = std::fs::read_dir(fixtures())
        .expect("tests/fixtures/templates")
        .map(|e| e.unwrap().path())
        .filter(|p| {
            p.extension().is_some_and(|e| e == "json") && p.file_name().unwrap() != "features.json"
        })
        .collect();
    files.sort();
    assert!(!files.is_empty(), "no template fixtures");

    let (mut checked, mut failures) = (0, Vec::new());
    for path in files {
        let fixture: Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        let source =
            std::fs::read_to_string(fixtures().join(fixture["template_file"].as_str().unwrap()))
                .unwrap();
        let file = path.file_name().unwrap().to_string_lossy().into_owned();
        for case in fixture["cases"].as_array().unwrap() {
            let name = format!("{file}:{}", case["name"].as_str().unwrap());
            let mut template = ChatTemplate::new(&source, object(&case["special"])).unwrap();
            if let Some(now) = case.get("strftime_now_fixed").and_then(Value::as_str) {
                template = template.with_fixed_now(CivilDateTime::parse_iso(now).unwrap());
            }
            let tools = case.get("tools").filter(|t| !t.is_null());
            let add_generation_prompt = case["add_generation_prompt"].as_bool().unwrap();
            let result = template.render(
                &case["messages"],
                tools,
                add_generation_prompt,
                &object(&case["extra"]),
            );
            checked += 1;
            match (case.get("expected").and_then(Value::as_str), result) {
                (Some(want), Ok(got)) if want == got => {}
                (Some(want), Ok(got)) => {
                    failures.push(format!("{name}: {}", describe_diff(want, &got)))
                }
                (Some(_), Err(e)) => failures.push(format!("{name}: unexpected error: {e}")),
                (None, Err(ChatTemplateError::Raised(message))) => {
                    let want = case["expected_error"].as_str().unwrap();
                    if message != want {
                        failures.push(format!("{name}: raised {message:?}, expected {want:?}"));
                    }
                }
                (None, other) => failures.push(format!(
                    "{name}: expected raise_exception({:?}), got {other:?}",
                    case["expected_error"]
                )),
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {checked} template cases differ from transformers:\n\n{}",
        failures.len(),
        failures.join("\n\n")
    );
}
