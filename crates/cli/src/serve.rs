//! `oxlm serve`: a drop-in for `mlx_lm.server` (the OpenAI API over HTTP).

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result};
use oxlm_runtime::generate::DEFAULT_PREFILL_STEP;
use oxlm_runtime::hub::resolve_model;
use oxlm_server::{LogLevel, Settings};
use serde_json::{Map, Value};

#[derive(clap::Args)]
pub struct Args {
    /// The MLX model (config.json, *.safetensors, tokenizer files): a local directory, or a
    /// Hugging Face repo id (org/name or org/name@revision) fetched into the Hugging Face cache.
    #[arg(long)]
    model: PathBuf,
    /// A LoRA adapter directory for requests that name none.
    #[arg(long)]
    adapter_path: Option<PathBuf>,
    /// A directory of LoRA adapters that requests choose by name (`"adapters": "NAME"`, a
    /// directory inside it); names that lead outside it are refused.
    #[arg(long)]
    adapters_dir: Option<PathBuf>,
    /// Most adapters from --adapters-dir kept loaded (least recently used out).
    #[arg(long, default_value_t = 8)]
    adapter_cache_size: usize,
    /// Most Responses API responses kept for previous_response_id and GET /v1/responses/ID
    /// (least recently used out); 0 keeps none.
    #[arg(long, default_value_t = 1000)]
    response_store_size: usize,
    /// Most bytes of responses (as JSON, with their conversations) kept (e.g. 256M).
    #[arg(long, default_value = "256M", value_parser = parse_size)]
    response_store_bytes: usize,
    /// Seconds a kept response stays after it was last used.
    #[arg(long, default_value_t = 3600.0, value_parser = parse_seconds)]
    response_store_ttl: f64,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// `max_tokens` of requests that do not set it.
    #[arg(long, default_value_t = 512)]
    max_tokens: usize,
    /// Default sampling temperature (else generation_config.json's, else 0: greedy).
    #[arg(long, value_parser = crate::parse_temperature)]
    temp: Option<f32>,
    /// Default nucleus sampling top-p (else generation_config.json's, else 1: off).
    #[arg(long, value_parser = crate::parse_probability)]
    top_p: Option<f32>,
    /// Default top-k (else generation_config.json's, else 0: off).
    #[arg(long)]
    top_k: Option<usize>,
    /// Default min-p (else generation_config.json's, else 0: off).
    #[arg(long, value_parser = crate::parse_probability)]
    min_p: Option<f32>,
    /// Chat template variables for every request, as a JSON object (e.g. '{"enable_thinking": false}').
    #[arg(long)]
    chat_template_args: Option<String>,
    /// Most prompt cache entries kept.
    #[arg(long, default_value_t = 10)]
    prompt_cache_size: usize,
    /// Most bytes of model state the prompt cache keeps (e.g. 512M, 8G).
    #[arg(long, default_value = "8G", value_parser = parse_size)]
    prompt_cache_bytes: usize,
    /// Require `Authorization: Bearer KEY` on /v1 requests.
    #[arg(long, value_parser = parse_api_key)]
    api_key: Option<String>,
    /// Comma-separated CORS origins; * allows any.
    #[arg(long, default_value = "*", value_delimiter = ',')]
    allowed_origins: Vec<String>,
    /// Largest request body accepted (e.g. 32M); larger ones get 413, at once when the request
    /// declares its length.
    #[arg(long, default_value = "32M", value_parser = parse_size)]
    max_request_bytes: usize,
    /// Seconds a connection with no request in progress (new, or between keep-alive requests)
    /// stays open. Longer than clients and load balancers keep idle connections, so that they,
    /// not the server, close them.
    #[arg(long, default_value_t = 75.0, value_parser = parse_timeout)]
    idle_timeout: f64,
    /// Seconds a request's head (request line and headers) may take to arrive from its first
    /// byte; a client that sends it slower is disconnected.
    #[arg(long, default_value_t = 60.0, value_parser = parse_timeout)]
    header_timeout: f64,
    /// Seconds a request's whole body may take to arrive after its head; a client that sends
    /// it slower is answered 408 and disconnected.
    #[arg(long, default_value_t = 60.0, value_parser = parse_timeout)]
    body_timeout: f64,
    /// Seconds a response may wait on a client that reads none of it before the connection is
    /// closed (and its generation cancelled).
    #[arg(long, default_value_t = 60.0, value_parser = parse_timeout)]
    send_timeout: f64,
    /// Most connections open at once; one more is answered 503 with Retry-After and closed.
    /// Default: 1024, or fewer where the open-file limit (ulimit -n) leaves less room beside the
    /// descriptors the server keeps for itself (80). A larger value is taken as given: raise
    /// ulimit -n with it.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    max_connections: Option<u32>,
    /// Prompt tokens processed per forward pass.
    #[arg(long, default_value_t = DEFAULT_PREFILL_STEP)]
    prefill_step_size: usize,
    /// Seconds the prompts going through between two decoding steps may hold up the requests
    /// decoding and those arriving: a long prompt goes through in chunks of fewer tokens than
    /// --prefill-step-size where the measured prompt speed needs it, so that a short request's
    /// first token does not wait for a long prompt. 0: whole --prefill-step-size chunks.
    #[arg(long, default_value_t = 0.5, value_parser = parse_seconds)]
    max_prefill_pause: f64,
    /// Most requests decoded together: concurrent requests (of one adapter) share each decoding
    /// step, which reads the weights once for all of them; 1 serves one at a time. The default
    /// is mlx_lm.server's; a GPU gains from more (an H200 decodes 64 sequences of a 0.85B model
    /// 1.5 times as fast as 32).
    #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u32).range(1..))]
    decode_concurrency: u32,
    /// Most requests waiting for a place beyond those decoding; more are answered 429 with
    /// Retry-After, so that a router sends them elsewhere (default: no limit).
    #[arg(long)]
    max_queued_requests: Option<usize>,
    /// Seconds a request may take from its arrival to its last token, waiting in the queue
    /// included; past it the generation stops and the request ends with a 504 error object
    /// (streams: an error event, then [DONE]). Default: no limit.
    #[arg(long, value_parser = parse_timeout)]
    request_timeout: Option<f64>,
    /// DEBUG, INFO, WARNING, ERROR or CRITICAL; above INFO, no startup, shutdown or request lines.
    #[arg(long, default_value = "INFO")]
    log_level: LogLevel,
    /// Seconds requests in progress get to finish after SIGINT/SIGTERM before being cancelled.
    #[arg(long, default_value_t = 5.0, value_parser = parse_seconds)]
    shutdown_grace: f64,
    /// Where the model runs: cpu, cuda (GPU 0) or cuda:N.
    #[arg(long, default_value = "cpu", value_parser = crate::parse_device)]
    device: oxlm_engine::Device,
    #[command(flatten)]
    kv: crate::kv_cache::KvCacheArgs,
    /// Bytes the server may take on its device (e.g. 6G): weights, the running requests'
    /// caches, the prompt cache and a prompt chunk's activations. A request waits until its
    /// cache at its longest (prompt and max_tokens) fits what the running ones leave; one that
    /// never could is refused with a 400 (`memory_admission`). Default: the weights and 90% of
    /// the memory free once they are loaded (host RAM within any cgroup limit, or the GPU's).
    #[arg(long, value_parser = parse_size)]
    memory_budget: Option<usize>,
}

pub fn run(args: Args) -> Result<()> {
    let chat_template_args: Map<String, Value> = match &args.chat_template_args {
        Some(text) => serde_json::from_str(text).context("--chat-template-args")?,
        None => Map::new(),
    };
    let settings = Settings {
        max_tokens: args.max_tokens,
        temperature: args.temp,
        top_p: args.top_p,
        top_k: args.top_k,
        min_p: args.min_p,
        chat_template_args,
        prompt_cache_size: args.prompt_cache_size,
        prompt_cache_bytes: args.prompt_cache_bytes,
        api_key: args.api_key,
        allowed_origins: args.allowed_origins,
        max_request_bytes: args.max_request_bytes,
        idle_timeout: Duration::from_secs_f64(args.idle_timeout),
        header_timeout: Duration::from_secs_f64(args.header_timeout),
        body_timeout: Duration::from_secs_f64(args.body_timeout),
        send_timeout: Duration::from_secs_f64(args.send_timeout),
        max_connections: args
            .max_connections
            .map_or_else(|| Settings::default().max_connections, |cap| cap as usize),
        prefill_step: args.prefill_step_size,
        prefill_pause: (args.max_prefill_pause > 0.0)
            .then(|| Duration::from_secs_f64(args.max_prefill_pause)),
        decode_concurrency: args.decode_concurrency as usize,
        max_queued_requests: args.max_queued_requests,
        request_timeout: args.request_timeout.map(Duration::from_secs_f64),
        kv_cache: args.kv.kv_cache,
        // --kv-bits for every layer; else the server reads the checkpoint's kv_config.json.
        kv_quantization: args
            .kv
            .kv_bits
            .map(|bits| oxlm_engine::KvQuant::new(bits, args.kv.kv_group_size))
            .transpose()?
            .map(oxlm_models::QuantizedLayers::All),
        kv_config: !args.kv.no_kv_config,
        memory_budget: args.memory_budget,
        adapter_path: args.adapter_path,
        adapters_dir: args.adapters_dir,
        adapter_cache_size: args.adapter_cache_size,
        response_store_size: args.response_store_size,
        response_store_bytes: args.response_store_bytes,
        response_store_ttl: Duration::from_secs_f64(args.response_store_ttl),
        log_level: args.log_level,
        shutdown_grace: Duration::from_secs_f64(args.shutdown_grace),
        device: args.device,
    };
    let model_dir = resolve_model(&args.model)?;
    oxlm_server::run(&model_dir, settings, &args.host, args.port)
        .with_context(|| format!("serving {}", args.model.display()))
}

/// An API key: an empty one would refuse every request, whatever it sends.
fn parse_api_key(key: &str) -> Result<String, String> {
    if key.is_empty() {
        return Err("an empty key would lock every client out".into());
    }
    Ok(key.to_string())
}

fn parse_seconds(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(seconds) if seconds.is_finite() && seconds >= 0.0 => Ok(seconds),
        _ => Err(format!("`{text}` is not a number of seconds")),
    }
}

/// A timeout: a number of seconds above zero (a zero timeout would close every connection).
fn parse_timeout(text: &str) -> Result<f64, String> {
    let seconds = parse_seconds(text)?;
    if seconds == 0.0 {
        return Err("a timeout of 0 would close every connection at once".into());
    }
    Ok(seconds)
}

/// A byte count with an optional decimal suffix (K, M, G, KB, MB, GB), as mlx-lm's `_parse_size`.
fn parse_size(text: &str) -> Result<usize, String> {
    let split = text
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(text.len());
    let (digits, unit) = text.split_at(split);
    let scale = match unit.trim().to_ascii_uppercase().as_str() {
        "" => 1.0,
        "K" | "KB" => 1e3,
        "M" | "MB" => 1e6,
        "G" | "GB" => 1e9,
        other => return Err(format!("unknown size unit `{other}` (use K, M or G)")),
    };
    let value: f64 = digits
        .parse()
        .map_err(|_| format!("`{text}` is not a size"))?;
    Ok((value * scale) as usize)
}

#[cfg(test)]
mod tests {
    use super::parse_size;

    #[test]
    fn sizes_take_decimal_suffixes() {
        assert_eq!(parse_size("512"), Ok(512));
        assert_eq!(parse_size("1.5G"), Ok(1_500_000_000));
        assert_eq!(parse_size("32MB"), Ok(32_000_000));
        assert!(parse_size("3X").is_err());
        assert!(parse_size("G").is_err());
    }
}
