//! `oxlm embed`: sentence embeddings from an embedding checkpoint (Qwen3-Embedding), one JSON
//! line per input.

use std::io::Read;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use oxlm_runtime::embed::{EmbedInput, Embedder};
use oxlm_runtime::hub::resolve_model;
use oxlm_runtime::LoadedModel;

#[derive(clap::Args)]
#[command(after_help = "Prints one JSON line per input, in order: \
    {\"index\":0,\"text\":\"...\",\"tokens\":9,\"embedding\":[...]}.\n\n\
    How the model embeds comes from its sentence-transformers files: 1_Pooling/config.json \
    (last-token or mean pooling), modules.json (normalization) and \
    config_sentence_transformers.json (named prompts); a checkpoint without them embeds only if \
    config.json names a bare `*Model` architecture (last token, normalized). Texts get the \
    tokenizer's special tokens (Qwen3-Embedding's appends <|endoftext|>).\n\n\
    Qwen3-Embedding expects queries with an instruction and documents without one: \
    `oxlm embed --model DIR --prompt-name query --text \"What is MLX?\"` puts its `query` \
    prompt (\"Instruct: ...\\nQuery:\") before the text.")]
pub struct Args {
    /// The MLX embedding model: a local directory, or a Hugging Face repo id (org/name or
    /// org/name@revision) fetched into the Hugging Face cache.
    #[arg(long)]
    model: PathBuf,
    /// A text to embed; may be given several times.
    #[arg(long)]
    text: Vec<String>,
    /// A file of texts to embed, one per line (after any --text); `-` reads standard input.
    #[arg(long)]
    file: Option<PathBuf>,
    /// Keep each vector's first N values, normalized again (Matryoshka embeddings).
    #[arg(long)]
    dimensions: Option<usize>,
    /// The model's prompt to put before each text (config_sentence_transformers.json's
    /// `prompts`, e.g. Qwen3-Embedding's `query`); its default prompt, if any, otherwise.
    #[arg(long)]
    prompt_name: Option<String>,
    /// Kernel threads (default: one per physical core).
    #[arg(long, value_parser = crate::parse_threads)]
    threads: Option<usize>,
    /// Where the model runs: cpu, cuda (GPU 0) or cuda:N.
    #[arg(long, default_value = "cpu", value_parser = crate::parse_device)]
    device: oxlm_engine::Device,
}

pub fn run(args: Args) -> Result<()> {
    if let Some(threads) = args.threads {
        oxlm_engine::cpu::pool::set_threads(threads);
    }
    let mut texts = args.text;
    if let Some(file) = &args.file {
        texts.extend(read_lines(file)?);
    }
    if texts.is_empty() {
        bail!("nothing to embed: give --text or --file");
    }
    let dir = resolve_model(&args.model)?;
    let embedder = Embedder::from_dir(&dir)
        .with_context(|| format!("{} cannot embed", args.model.display()))?;
    let loaded = LoadedModel::load_on(&dir, &args.device)
        .with_context(|| format!("loading {}", args.model.display()))?;
    let inputs: Vec<EmbedInput> = texts.iter().cloned().map(EmbedInput::Text).collect();
    let ids = embedder.tokenize(&loaded.tokenizer, &inputs, args.prompt_name.as_deref())?;
    let model = loaded.model.as_ref();
    // Every input is checked before the first runs, so that a bad line fails at once.
    embedder.check(model.info(), &ids, args.dimensions)?;
    for (index, (text, ids)) in texts.iter().zip(&ids).enumerate() {
        let vector = embedder.embed(model, std::slice::from_ref(ids), args.dimensions)?;
        // Serialized as f32s (the shortest decimals that read back the same), not as a `Value`,
        // which would widen them to f64 and print twice the digits.
        let (text, vector) = (
            serde_json::to_string(text)?,
            serde_json::to_string(&vector[0])?,
        );
        let tokens = ids.len();
        say!(r#"{{"index":{index},"text":{text},"tokens":{tokens},"embedding":{vector}}}"#);
    }
    Ok(())
}

fn read_lines(file: &PathBuf) -> Result<Vec<String>> {
    let mut text = String::new();
    if file.as_os_str() == "-" {
        std::io::stdin()
            .read_to_string(&mut text)
            .context("reading standard input")?;
    } else {
        text =
            std::fs::read_to_string(file).with_context(|| format!("reading {}", file.display()))?;
    }
    Ok(text.lines().map(str::to_owned).collect())
}
