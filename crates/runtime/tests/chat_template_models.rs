//! Loading chat templates from model directories the way transformers 5.24 finds them.

use std::path::{Path, PathBuf};

use oxlm_runtime::chat_template::{ChatTemplate, ChatTemplateError};
use serde_json::{json, Map, Value};

fn read_json(path: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn scratch(name: &str, tokenizer_config: &Value) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        dir.join("tokenizer_config.json"),
        tokenizer_config.to_string(),
    )
    .unwrap();
    dir
}

fn render(template: &ChatTemplate, tools: Option<&Value>) -> String {
    let messages = json!([{"role": "user", "content": "hi"}]);
    template
        .render(&messages, tools, true, &Map::new())
        .unwrap()
}

#[test]
fn tiny_models_render_their_golden_prompts() {
    let tiny = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny");
    let mut checked = 0;
    for entry in std::fs::read_dir(tiny).unwrap() {
        let dir = entry.unwrap().path();
        if !dir.join("golden.json").exists() {
            continue;
        }
        let golden = read_json(&dir.join("golden.json"));
        let template = ChatTemplate::from_dir(&dir)
            .unwrap()
            .expect("a chat template");
        let rendered = template
            .render(&golden["messages"], None, true, &Map::new())
            .unwrap();
        assert_eq!(
            rendered,
            golden["prompt_text"].as_str().unwrap(),
            "{}",
            dir.display()
        );
        checked += 1;
    }
    assert!(checked > 0);
}

#[test]
fn template_sources_follow_transformers_precedence() {
    let config = json!({"eos_token": "</s>", "chat_template": "config:{{ eos_token }}"});
    let dir = scratch("tmpl_config_string", &config);
    assert_eq!(
        render(&ChatTemplate::from_dir(&dir).unwrap().unwrap(), None),
        "config:</s>"
    );

    // chat_template.jinja replaces the config's template.
    std::fs::write(
        dir.join("chat_template.jinja"),
        "file:{{ messages[0].content }}\n",
    )
    .unwrap();
    assert_eq!(
        render(&ChatTemplate::from_dir(&dir).unwrap().unwrap(), None),
        "file:hi"
    );

    // A list of named templates: tool_use when tools are given, default otherwise.
    let config = json!({"chat_template": [
        {"name": "default", "template": "default"},
        {"name": "tool_use", "template": "tools:{{ tools | length }}"},
    ]});
    let template = ChatTemplate::from_dir(scratch("tmpl_config_list", &config))
        .unwrap()
        .unwrap();
    assert_eq!(render(&template, None), "default");
    assert_eq!(
        render(&template, Some(&json!([{"type": "function"}]))),
        "tools:1"
    );

    let config = json!({"chat_template": [{"name": "tool_use", "template": "t"}]});
    let template = ChatTemplate::from_dir(scratch("tmpl_no_default", &config))
        .unwrap()
        .unwrap();
    let messages = json!([{"role": "user", "content": "hi"}]);
    assert!(matches!(
        template.render(&messages, None, true, &Map::new()),
        Err(ChatTemplateError::Input(_))
    ));

    assert!(ChatTemplate::from_dir(scratch("tmpl_none", &json!({})))
        .unwrap()
        .is_none());
    let err =
        ChatTemplate::from_dir(scratch("tmpl_bad", &json!({"chat_template": 3}))).unwrap_err();
    assert!(err.to_string().contains("tokenizer_config.json"), "{err}");
}

#[test]
fn syntax_errors_are_reported_at_load() {
    let err = ChatTemplate::new("{% for x in %}", Map::new()).unwrap_err();
    assert!(matches!(err, ChatTemplateError::Syntax(_)), "{err}");
}
