//! A scripted model (it answers a fixed token sequence, whatever the prompt) behind a real chat
//! template (Qwen 3.5's, Gemma 4's), with a tokenizer that has that family's markup tokens, so
//! that the reply is what a reasoning model that calls a tool writes.

use std::path::Path;
use std::sync::{Arc, Mutex};

use oxlm_engine::{Device, Tensor};
use oxlm_models::{Cache, ForwardError, LanguageModel, Logits, ModelInfo};
use oxlm_runtime::chat_template::ChatTemplate;
use oxlm_runtime::tokenizer::Tokenizer;
use oxlm_runtime::LoadedModel;
use oxlm_server::{Server, Settings};
use serde_json::{json, Map, Value};

use super::{fixtures, listen};

/// A question with a `get_weather` tool (`city`, `days`), which scripted replies call.
pub fn weather_request(stream: bool) -> Value {
    json!({
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}],
        "stream": stream,
    })
}

/// `<|im_end|>` in the tiny tokenizer.
pub const EOS: u32 = 2;

/// Answers `script`, then end-of-sequence, whatever the prompt. Made to take another token than
/// the script's (a reasoning budget closing the reasoning), it goes on after that token's next
/// place in the script.
struct Scripted {
    info: ModelInfo,
    script: Vec<u32>,
    /// The prompt of the sequence being generated.
    prompt: Arc<Mutex<Vec<u32>>>,
    /// Script tokens passed over, for tokens it was made to take.
    skipped: Mutex<usize>,
}

impl LanguageModel for Scripted {
    fn info(&self) -> &ModelInfo {
        &self.info
    }

    fn new_cache(&self) -> Result<Cache, ForwardError> {
        Ok(Cache::new(Vec::new()))
    }

    fn forward(
        &self,
        tokens: &[u32],
        cache: &mut Cache,
        _: Logits,
    ) -> Result<Tensor, ForwardError> {
        let mut prompt = self.prompt.lock().unwrap();
        let mut skipped = self.skipped.lock().unwrap();
        if cache.offset == 0 {
            *prompt = tokens.to_vec();
            *skipped = 0;
        } else {
            // A decoding step: its token is the one taken after what the script said.
            let said = cache.offset - prompt.len() + *skipped;
            let rest = self.script.get(said..).unwrap_or_default();
            if let Some(further) = rest.iter().position(|&t| t == tokens[0]) {
                *skipped += further;
            }
        }
        cache.offset += tokens.len();
        let next = self
            .script
            .get(cache.offset - prompt.len() + *skipped)
            .copied()
            .unwrap_or(EOS);
        let mut logits = vec![0.0; self.info.vocab_size];
        logits[next as usize] = 10.0;
        Ok(Tensor::new(vec![1, self.info.vocab_size], logits))
    }
}

/// A chat template of tests/fixtures/templates and the markup tokens of its family.
pub struct Family {
    pub template: &'static str,
    pub tokens: &'static [&'static str],
}

pub const QWEN3_5: Family = Family {
    template: "qwen3.5.jinja",
    tokens: &["<think>", "</think>"],
};

pub const GEMMA4: Family = Family {
    template: "gemma4.jinja",
    tokens: &[
        "<|turn>",
        "<turn|>",
        "<|think|>",
        "<|channel>",
        "<channel|>",
        "<|tool_call>",
        "<tool_call|>",
        "<|\"|>",
    ],
};

/// The tiny tokenizer with `tokens` added, in `dir`.
fn tokenizer_with(dir: &Path, tokens: &[&str]) -> Tokenizer {
    let source = fixtures().join("tiny/tokenizer");
    std::fs::copy(
        source.join("tokenizer_config.json"),
        dir.join("tokenizer_config.json"),
    )
    .unwrap();
    let mut json: Value =
        serde_json::from_str(&std::fs::read_to_string(source.join("tokenizer.json")).unwrap())
            .unwrap();
    for (id, content) in (512..).zip(tokens) {
        json["added_tokens"].as_array_mut().unwrap().push(json!({"id": id, "content": content,
            "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": false}));
    }
    std::fs::write(dir.join("tokenizer.json"), json.to_string()).unwrap();
    Tokenizer::from_dir(dir).unwrap()
}

/// A server of `family`'s template over a model that answers `reply`; its base URL.
pub async fn start(family: &Family, reply: &str) -> String {
    start_with(family, reply, Settings::default()).await
}

/// [`start`] with `settings`, but for the prompt cache and prefill pause that the script needs.
pub async fn start_with(family: &Family, reply: &str, settings: Settings) -> String {
    serve(family, reply, settings).await.base
}

/// A scripted server, and what its model was prompted with last.
pub struct Served {
    pub base: String,
    pub tokenizer: Tokenizer,
    prompt: Arc<Mutex<Vec<u32>>>,
}

impl Served {
    pub fn last_prompt_ids(&self) -> Vec<u32> {
        self.prompt.lock().unwrap().clone()
    }

    /// The last prompt's text, as the chat template rendered it.
    pub fn last_prompt(&self) -> String {
        self.tokenizer
            .decode(&self.last_prompt_ids(), false)
            .unwrap()
    }
}

/// [`start_with`], telling the model's prompts.
pub async fn serve(family: &Family, reply: &str, settings: Settings) -> Served {
    let dir = tempfile::tempdir().unwrap();
    let tokenizer = tokenizer_with(dir.path(), family.tokens);
    let template_path = fixtures().join("templates").join(family.template);
    let template =
        ChatTemplate::new(&std::fs::read_to_string(template_path).unwrap(), Map::new()).unwrap();
    let model = Scripted {
        info: ModelInfo {
            model_type: "scripted".into(),
            vocab_size: tokenizer.vocab_size(),
            hidden_size: 1,
            num_layers: 0,
            max_context: None,
            device: Device::Cpu,
        },
        script: tokenizer.encode(reply, false).unwrap(),
        prompt: Arc::default(),
        skipped: Mutex::default(),
    };
    let prompt = model.prompt.clone();
    let loaded = LoadedModel {
        dir: dir.path().to_path_buf(),
        model: Box::new(model),
        tokenizer: tokenizer.clone(),
        chat_template: Some(template),
        eos_ids: [EOS].into(),
    };
    // Every request starts from an empty cache and goes through in one pass: the script is
    // indexed by position from the end of the first.
    let settings = Settings {
        prompt_cache_size: 0,
        prefill_pause: None,
        ..settings
    };
    Served {
        base: listen(Server::new(loaded, settings).unwrap()).await,
        tokenizer,
        prompt,
    }
}
