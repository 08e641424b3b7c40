//! Arbitrary text as a model's `tokenizer_config.json`, beside the tiny fixtures' tokenizer.json:
//! the tokenizer class, special and added tokens, and the chat templates it holds, loaded as a
//! model's tokenizer is. Templates are parsed, not rendered: a template is a program, and one
//! that loops for hours is the model's, not a parser's, fault.
#![no_main]

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use oxlm_runtime::chat_template::ChatTemplate;
use oxlm_runtime::tokenizer::Tokenizer;
use oxlm_server::parsers::ToolFormat;

fn model_dir() -> &'static PathBuf {
    static SCRATCH: OnceLock<tempfile::TempDir> = OnceLock::new();
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let scratch = SCRATCH.get_or_init(|| tempfile::tempdir().expect("a scratch directory"));
        let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/tiny");
        for (from, to) in [
            ("tokenizer/tokenizer.json", "tokenizer.json"),
            ("llama-4bit-g64/config.json", "config.json"),
        ] {
            std::os::unix::fs::symlink(fixture.join(from), scratch.path().join(to))
                .expect("a link to the fixture");
        }
        scratch.path().to_path_buf()
    })
}

fuzz_target!(|data: &[u8]| {
    let dir = model_dir();
    std::fs::write(dir.join("tokenizer_config.json"), data).expect("the scratch file is writable");
    if let Ok(tokenizer) = Tokenizer::from_dir(dir) {
        let text = "Hello <|im_start|>user\nwörld<|im_end|>";
        if let Ok(ids) = tokenizer.encode(text, true) {
            let _ = tokenizer.decode(&ids, false);
        }
        tokenizer.eos_token_ids(&[]);
        tokenizer.think_markers();
    }
    if let Ok(Some(template)) = ChatTemplate::from_dir(dir) {
        ToolFormat::from_template(template.sources());
    }
});
