//! Arbitrary bytes as the body of `POST /v1/chat/completions` and `/v1/completions`. A body the
//! server accepts must carry exactly the limits it asked for, each within the range the API
//! documents, and give a sampler that picks a token.
#![no_main]

use libfuzzer_sys::fuzz_target;
use oxlm_runtime::sampler::{Sampler, MIN_TEMPERATURE};
use serde_json::{Map, Value};

use oxlm_server::request::{self, Defaults, Params, Prompt};

/// What the body asked for comes out as it was asked, and within range.
fn check(body: &Map<String, Value>, p: &Params) {
    let field = |name: &str| body.get(name).filter(|v| !v.is_null());
    let asked = field("max_completion_tokens").or_else(|| field("max_tokens"));
    let max_tokens = asked.map_or(512, |v| v.as_u64().expect("an integer"));
    assert_eq!(p.max_tokens as u64, max_tokens);
    assert!(p.max_tokens >= 1);
    assert!(p.top_logprobs <= 20);
    assert!(p.logprobs || p.top_logprobs == 0);
    assert!(p.stop.len() <= 16);
    if let Some(Value::String(stop)) = field("stop") {
        assert_eq!(p.stop, [stop.as_str()]);
    }
    assert_eq!(p.stream, field("stream") == Some(&Value::Bool(true)));
    let s = &p.sampler;
    assert!(s.temperature == 0.0 || (MIN_TEMPERATURE..=f32::MAX).contains(&s.temperature));
    assert!((0.0..=1.0).contains(&s.top_p) && (0.0..=1.0).contains(&s.min_p));
    for penalty in [s.presence_penalty, s.frequency_penalty]
        .into_iter()
        .flatten()
    {
        assert!((-2.0..=2.0).contains(&penalty));
    }
    if let Some(r) = s.repetition_penalty {
        assert!(r == 0.0 || (0.01..=100.0).contains(&r));
    }
    assert!(s.logit_bias.values().all(|b| (-100.0..=100.0).contains(b)));
    if let Some(Value::Object(bias)) = field("logit_bias") {
        assert!(s.logit_bias.len() <= bias.len());
    }
    let mut sampler = Sampler::new(s.clone()).expect("an accepted request's sampler builds");
    let mut logits: Vec<f32> = (0..64).map(|i| (i as f32 * 0.37).sin() * 5.0).collect();
    // A history with an id past the vocabulary, as a completion's token prompt may hold.
    let token = sampler.sample(&mut logits, &[1, 5, 5, 63, 200]);
    assert!(token < 64);
}

fuzz_target!(|data: &[u8]| {
    let Ok(body) = request::parse_body(data) else {
        return;
    };
    let defaults = Defaults {
        xtc_special_tokens: vec![2],
        ..Defaults::default()
    };
    match request::chat_request(&body, &defaults) {
        Ok(chat) => {
            check(&body, &chat.params);
            let messages = body["messages"].as_array().expect("a list of messages");
            assert_eq!(chat.messages.len(), messages.len());
            assert!(chat.messages.iter().all(|m| m["content"].is_string()));
        }
        Err(e) => assert_eq!(e.status, 400, "{}", e.message),
    }
    match request::completion_request(&body, &defaults) {
        Ok(completion) => {
            check(&body, &completion.params);
            if let Prompt::Text(text) = &completion.prompt {
                assert!(body["prompt"] == *text || body["prompt"][0] == *text);
            }
        }
        Err(e) => assert_eq!(e.status, 400, "{}", e.message),
    }
});
