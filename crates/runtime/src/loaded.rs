//! A model directory opened for generation: weights, tokenizer, chat template and stop tokens.

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use oxlm_engine::Device;
use oxlm_models::checkpoint::read_json;
use oxlm_models::{LanguageModel, LoadError};

use crate::chat_template::ChatTemplate;
use crate::constraint::{ConstraintError, Grammars};
use crate::tokenizer::{token_ids_from_json, Tokenizer};
use crate::RuntimeError;

pub struct LoadedModel {
    pub dir: PathBuf,
    pub model: Box<dyn LanguageModel>,
    pub tokenizer: Tokenizer,
    pub chat_template: Option<ChatTemplate>,
    /// Ids that end generation: `eos_token_id` of generation_config.json (else config.json),
    /// plus the tokenizer's eos token, as mlx-lm collects them.
    pub eos_ids: HashSet<u32>,
}

impl LoadedModel {
    /// The model in `dir`, run on the CPU.
    pub fn load(dir: &Path) -> Result<Self, RuntimeError> {
        LoadedModel::load_on(dir, &Device::Cpu)
    }

    /// The model in `dir` with its weights on `device`.
    pub fn load_on(dir: &Path, device: &Device) -> Result<Self, RuntimeError> {
        let model = oxlm_models::load_on(dir, device)?;
        let tokenizer = Tokenizer::from_dir(dir)?;
        let chat_template = ChatTemplate::from_dir(dir)?;
        let config = read_json(&dir.join("config.json"))?;
        let generation_config = match read_json(&dir.join("generation_config.json")) {
            Ok(v) => Some(v),
            Err(LoadError::MissingFile(_)) => None,
            Err(e) => return Err(e.into()),
        };
        let model_eos = generation_config
            .as_ref()
            .and_then(|g| token_ids_from_json(g.get("eos_token_id")))
            .or_else(|| token_ids_from_json(config.get("eos_token_id")))
            .unwrap_or_default();
        let eos_ids = tokenizer.eos_token_ids(&model_eos).into_iter().collect();
        Ok(LoadedModel {
            dir: dir.to_path_buf(),
            model,
            tokenizer,
            chat_template,
            eos_ids,
        })
    }

    /// A grammar compiler over this model's vocabulary, for constrained generation.
    pub fn grammars(&self) -> Result<Grammars, ConstraintError> {
        let mut eos_ids: Vec<u32> = self.eos_ids.iter().copied().collect();
        eos_ids.sort_unstable();
        Grammars::new(&self.tokenizer, &eos_ids, self.model.info().vocab_size)
    }
}
