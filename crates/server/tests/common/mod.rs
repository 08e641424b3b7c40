//! What the server's test files share: the repository's fixtures and a server on a free port.

#![allow(dead_code)] // each test binary uses its own part

use std::path::PathBuf;
use std::time::Duration;

use oxlm_engine::{KvPrecision, Tensor};
use oxlm_models::{Cache, ForwardError, LanguageModel, Logits, ModelInfo};
use oxlm_server::Server;

/// `tests/fixtures` of the repository.
pub fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

/// Serves `server` on a free port of 127.0.0.1 in the background; its base URL.
pub async fn listen(server: Server) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(server.serve(listener));
    base
}

/// A model slow over prompts (`prompt_time` a forward pass of more than one token), as a large
/// model is over a long one.
pub struct SlowPrompts {
    pub inner: Box<dyn LanguageModel>,
    pub prompt_time: Duration,
}

impl LanguageModel for SlowPrompts {
    fn info(&self) -> &ModelInfo {
        self.inner.info()
    }

    fn new_cache(&self) -> Result<Cache, ForwardError> {
        self.inner.new_cache()
    }

    fn new_cache_in(&self, precision: KvPrecision) -> Result<Cache, ForwardError> {
        self.inner.new_cache_in(precision)
    }

    fn forward(
        &self,
        tokens: &[u32],
        cache: &mut Cache,
        logits: Logits,
    ) -> Result<Tensor, ForwardError> {
        if tokens.len() > 1 {
            std::thread::sleep(self.prompt_time);
        }
        self.inner.forward(tokens, cache, logits)
    }
}
