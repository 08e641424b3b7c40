//! The real `oxlm serve` binary: a LoRA adapter chosen per request gives what
//! `oxlm generate --adapter-path` gives, request log lines and `--log-level`, and graceful
//! shutdown on SIGTERM and SIGINT (exit status 0, in-flight requests finished or ended cleanly).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::Duration;

use serde_json::{json, Value};

const OXLM: &str = env!("CARGO_BIN_EXE_oxlm");

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

fn model() -> PathBuf {
    fixtures().join("tiny/llama-4bit-g64")
}

const PROMPT: &str = "Write one sentence about the sea, please. 12345";

/// A running `oxlm serve` on a free port, and its stderr lines as they come.
struct Serve {
    child: Child,
    port: u16,
    stderr: mpsc::Receiver<String>,
    reader: Option<JoinHandle<()>>,
}

impl Serve {
    fn start(extra: &[&str]) -> Serve {
        Serve::start_on(&model(), extra)
    }

    /// `oxlm serve` of the model at `model`.
    fn start_on(model: &Path, extra: &[&str]) -> Serve {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let mut child = Command::new(OXLM)
            .arg("serve")
            .arg("--model")
            .arg(model)
            .args(["--port", &port.to_string()])
            .args(extra)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let (lines, stderr) = mpsc::channel();
        let pipe = BufReader::new(child.stderr.take().unwrap());
        let reader = std::thread::spawn(move || {
            for line in pipe.lines().map_while(Result::ok) {
                let _ = lines.send(line);
            }
        });
        let serve = Serve {
            child,
            port,
            stderr,
            reader: Some(reader),
        };
        serve.wait_until_healthy();
        serve
    }

    /// Polls `/health` until it answers 200. A connection refused or reset while the server
    /// starts is a reason to poll again, not a failure.
    fn wait_until_healthy(&self) {
        for _ in 0..600 {
            if let Ok(mut stream) = TcpStream::connect(("127.0.0.1", self.port)) {
                let request =
                    "GET /health HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n";
                let mut text = String::new();
                if stream.write_all(request.as_bytes()).is_ok()
                    && stream.read_to_string(&mut text).is_ok()
                    && text.starts_with("HTTP/1.1 200 ")
                {
                    return;
                }
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        panic!("oxlm serve did not come up on port {}", self.port);
    }

    /// Sends a request; the connection closes after the response.
    fn send(&self, path: &str, body: &Value) -> TcpStream {
        let mut stream = TcpStream::connect(("127.0.0.1", self.port)).unwrap();
        let body = body.to_string();
        write!(
            stream,
            "POST {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        stream
    }

    fn chat(&self, body: &Value) -> (u16, Value) {
        response(self.send("/v1/chat/completions", body))
    }

    fn signal(&self, name: &str) {
        let status = Command::new("kill")
            .args(["-s", name, &self.child.id().to_string()])
            .status()
            .unwrap();
        assert!(status.success());
    }

    /// Waits for the process to end; its exit status and its stderr lines.
    fn wait(mut self) -> (ExitStatus, Vec<String>) {
        let status = self.child.wait().unwrap();
        if let Some(reader) = self.reader.take() {
            reader.join().unwrap();
        }
        (status, self.stderr.try_iter().collect())
    }
}

/// A test that fails part way does not leave its server running.
impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
    }
}

/// Status and JSON body of a whole (`Content-Length`) response.
fn response(mut stream: TcpStream) -> (u16, Value) {
    let mut text = String::new();
    stream.read_to_string(&mut text).unwrap();
    let (head, body) = text.split_once("\r\n\r\n").unwrap();
    let status = head.split(' ').nth(1).unwrap().parse().unwrap();
    (status, serde_json::from_str(body).unwrap())
}

/// Reads a streamed response until `needle` has come; returns what came.
fn read_until(stream: &mut TcpStream, needle: &str) -> String {
    let mut text = String::new();
    let mut buffer = [0; 4096];
    while !text.contains(needle) {
        let n = stream.read(&mut buffer).unwrap();
        assert!(n > 0, "the stream ended before {needle:?}: {text}");
        text.push_str(&String::from_utf8_lossy(&buffer[..n]));
    }
    text
}

fn chat_request(extra: Value) -> Value {
    let mut body = json!({"messages": [{"role": "user", "content": PROMPT}], "temperature": 0});
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

/// What `oxlm generate` prints between its `==========` lines.
fn generated(extra: &[&str]) -> String {
    generated_by(&model(), extra)
}

/// [`generated`] by the model at `model`.
fn generated_by(model: &Path, extra: &[&str]) -> String {
    let output = Command::new(OXLM)
        .arg("generate")
        .arg("--model")
        .arg(model)
        .args(["--prompt", PROMPT, "--max-tokens", "24"])
        .args(extra)
        .output()
        .unwrap();
    assert!(output.status.success(), "{output:?}");
    let stdout = String::from_utf8(output.stdout).unwrap();
    let text = stdout.strip_prefix("==========\n").unwrap();
    text[..text.find("\n==========").unwrap()].to_owned()
}

/// Every kind of architecture serves: a greedy chat reply is what `generate` writes, for
/// latent attention, grouped experts, sinks with MXFP4 experts, soft caps, short convolutions,
/// fused linear attention, chunked attention and Mamba-2 layers.
#[test]
fn each_kind_of_architecture_serves_what_generate_writes() {
    for name in [
        "llama4-4bit-g32",
        "granitemoehybrid-4bit-g32",
        "nemotron_h-moe-4bit-g32",
        "deepseek_v3-4bit-g32",
        "glm4_moe-4bit-g32",
        "gpt_oss-mxfp4-q8",
        "gemma2-4bit-g32",
        "lfm2-4bit-g64",
        "qwen3_next-4bit-g32",
    ] {
        let model = fixtures().join("tiny").join(name);
        let serve = Serve::start_on(&model, &[]);
        let (status, r) = serve.chat(&chat_request(json!({"max_tokens": 24})));
        assert_eq!(status, 200, "{name}: {r}");
        let expected = generated_by(&model, &[]);
        assert_eq!(r["choices"][0]["message"]["content"], expected, "{name}");
    }
}

#[test]
fn an_adapter_per_request_matches_generate_with_adapter_path() {
    let lora = fixtures().join("lora");
    let serve = Serve::start(&["--adapters-dir", lora.to_str().unwrap()]);
    let adapter = lora.join("llama-4bit-g64-r4");
    let expected = generated(&["--adapter-path", adapter.to_str().unwrap()]);
    let body = chat_request(json!({"max_tokens": 24, "adapters": "llama-4bit-g64-r4"}));
    let (status, r) = serve.chat(&body);
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["choices"][0]["message"]["content"], expected);
    let (_, base) = serve.chat(&chat_request(json!({"max_tokens": 24})));
    let base_text = base["choices"][0]["message"]["content"].as_str().unwrap();
    assert_eq!(base_text, generated(&[]));
    assert_ne!(base_text, expected);
}

/// The stderr of `oxlm generate` with `args` on the tiny model, which must fail.
fn refused(args: &[&str]) -> String {
    let output = Command::new(OXLM)
        .arg("generate")
        .args(args)
        .arg("--model")
        .arg(model())
        .output()
        .unwrap();
    assert!(!output.status.success(), "{output:?}");
    String::from_utf8(output.stderr).unwrap()
}

/// `--kv-cache` reaches the server's caches as it does `generate`'s; a precision it does not
/// know is refused before anything loads, and a quantized cache for heads it cannot group with
/// a clear error, before the prompt goes through.
#[test]
fn the_kv_cache_flag_reaches_generate_and_serve() {
    let serve = Serve::start(&["--kv-cache", "f32"]);
    let (status, r) = serve.chat(&chat_request(json!({"max_tokens": 24})));
    assert_eq!(status, 200, "{r}");
    assert_eq!(
        r["choices"][0]["message"]["content"],
        generated(&["--kv-cache", "f32"])
    );
    let stderr = refused(&["--kv-cache", "f64"]);
    assert!(stderr.contains("`f64`: expected f16 or f32"), "{stderr}");
    let stderr = refused(&["--kv-cache", "q8"]);
    assert!(stderr.contains("`q8`: use --kv-bits 8"), "{stderr}");
    let stderr = refused(&["--kv-bits", "3"]);
    assert!(
        stderr.contains("`3`: the cache takes 4 or 8 bits"),
        "{stderr}"
    );
    // This model's heads of 16 are no whole group of a quantized cache: an error, no panic.
    let stderr = refused(&[
        "--kv-bits",
        "8",
        "--quantized-kv-start",
        "0",
        "--prompt",
        "hi",
    ]);
    assert!(
        stderr.contains(
            "a KV cache of 8 bits in groups of 64 needs head dims that are multiples of 64"
        ) && !stderr.contains("panicked")
            && !stderr.contains("=========="),
        "{stderr}"
    );
}

/// A checkpoint's `kv_config.json` quantizes the layers it lists, in `generate` as in `serve`:
/// listing every layer at 4 bits in groups of 32 (the tiny Gemma 3's heads of 32, sliding-window
/// layers and full ones) gives what `--kv-bits 4 --kv-group-size 32 --quantized-kv-start 0`
/// gives, and not what the unquantized cache gives; `--no-kv-config` leaves it unused; `serve
/// --kv-bits` quantizes as the file does; a file that names a layer the model does not have is
/// refused with what is wrong.
#[test]
fn a_checkpoints_kv_config_quantizes_its_layers() {
    let dir = tempfile::tempdir().unwrap();
    let tiny = fixtures().join("tiny/gemma3-4bit-g64");
    for entry in std::fs::read_dir(&tiny).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, dir.path().join(path.file_name().unwrap())).unwrap();
    }
    let config: Value =
        serde_json::from_str(&std::fs::read_to_string(tiny.join("config.json")).unwrap()).unwrap();
    let layers = config["num_hidden_layers"].as_u64().unwrap();
    let entries: Vec<Value> = (0..layers)
        .map(|l| json!({"layer_idx": l, "bits": 4, "group_size": 32}))
        .collect();
    let kv_config = dir.path().join("kv_config.json");
    std::fs::write(&kv_config, Value::from(entries).to_string()).unwrap();

    let f32_cache = ["--kv-cache", "f32"];
    let plain = generated_by(&tiny, &f32_cache);
    let by_flags = generated_by(
        &tiny,
        &[&f32_cache[..], &["--kv-bits", "4", "--kv-group-size", "32"]].concat(),
    );
    let by_flags_from_0 = generated_by(
        &tiny,
        &[
            &f32_cache[..],
            &[
                "--kv-bits",
                "4",
                "--kv-group-size",
                "32",
                "--quantized-kv-start",
                "0",
            ],
        ]
        .concat(),
    );
    // mlx-lm's default start (5000 tokens) is past this short run.
    assert_eq!(by_flags, plain);
    assert_ne!(by_flags_from_0, plain);
    assert_eq!(generated_by(dir.path(), &f32_cache), by_flags_from_0);
    let unused = [&f32_cache[..], &["--no-kv-config"]].concat();
    assert_eq!(generated_by(dir.path(), &unused), plain);

    let serve = Serve::start_on(dir.path(), &f32_cache);
    let (status, r) = serve.chat(&chat_request(json!({"max_tokens": 24})));
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["choices"][0]["message"]["content"], by_flags_from_0);
    let bits = ["--kv-bits", "4", "--kv-group-size", "32"];
    let serve = Serve::start_on(&tiny, &[&f32_cache[..], &bits].concat());
    let (status, r) = serve.chat(&chat_request(json!({"max_tokens": 24})));
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["choices"][0]["message"]["content"], by_flags_from_0);

    std::fs::write(
        &kv_config,
        r#"[{"layer_idx": 99, "bits": 4, "group_size": 32}]"#,
    )
    .unwrap();
    let output = Command::new(OXLM)
        .arg("generate")
        .arg("--model")
        .arg(dir.path())
        .output()
        .unwrap();
    let stderr = String::from_utf8(output.stderr).unwrap();
    assert!(
        !output.status.success()
            && stderr.contains("kv_config.json: entry 0: layer_idx 99 of a model of")
            && !stderr.contains("panicked"),
        "{stderr}"
    );
}

/// Waits for a server that got `signal` (SIGTERM, SIGINT) to end; checks that it exited with 0
/// after announcing `grace` seconds, and returns its stderr lines after that announcement,
/// leaving out the health checks of [`Serve::start`].
fn lines_after_shutdown(serve: Serve, signal: &str, grace: &str) -> Vec<String> {
    let (status, lines) = serve.wait();
    assert!(status.success(), "{status}");
    // The startup lines: the memory budget, then where it serves.
    assert!(lines[0].starts_with("Memory budget: "), "{lines:?}");
    assert!(lines[1].starts_with("Serving "), "{lines:?}");
    let lines: Vec<String> = lines
        .into_iter()
        .skip(2)
        .filter(|line| !line.starts_with("GET /health 200 "))
        .collect();
    let announced =
        format!("Shutting down ({signal}): requests in progress have {grace}s to finish");
    assert_eq!(lines[0], announced);
    lines[1..].to_vec()
}

#[test]
fn sigterm_lets_a_request_in_progress_finish() {
    let serve = Serve::start(&["--shutdown-grace", "60"]);
    // Long enough (end-of-sequence banned) that the signal comes while it runs.
    let body = chat_request(json!({"max_tokens": 3000, "stream": true,
                                   "logit_bias": {"0": -100, "2": -100}}));
    let mut stream = serve.send("/v1/chat/completions", &body);
    read_until(&mut stream, "data: ");
    serve.signal("TERM");
    let text = read_until(&mut stream, "data: [DONE]");
    assert!(text.contains("\"finish_reason\":\"length\""), "{text}");
    let lines = lines_after_shutdown(serve, "SIGTERM", "60.0");
    assert!(
        lines[0].starts_with("POST /v1/chat/completions 200 ")
            && lines[0].ends_with("s prompt_tokens=43 completion_tokens=3000"),
        "{lines:?}"
    );
    assert_eq!(lines[1..], ["Server stopped"]);
}

/// A request that would run for minutes: end-of-sequence tokens banned.
fn endless(stream: bool) -> Value {
    let banned = json!({"0": -100, "2": -100});
    chat_request(json!({"max_tokens": 100_000, "logit_bias": banned, "stream": stream}))
}

#[test]
fn sigint_cancels_what_outlasts_the_grace_period() {
    let serve = Serve::start(&["--shutdown-grace", "0.5"]);
    let mut streamed = serve.send("/v1/chat/completions", &endless(true));
    read_until(&mut streamed, "data: ");
    // Queued behind the first.
    let queued = serve.send("/v1/chat/completions", &endless(false));
    std::thread::sleep(Duration::from_millis(200));
    serve.signal("INT");
    let text = read_until(&mut streamed, "data: [DONE]");
    let error = json!({"error": {"message": "The server is shutting down",
                                 "type": "server_error", "param": null, "code": null}});
    assert!(
        text.contains(&format!("data: {error}\n")),
        "{}",
        &text[text.len().saturating_sub(400)..]
    );
    assert_eq!(response(queued), (503, error));
    let lines = lines_after_shutdown(serve, "SIGINT", "0.5");
    assert_eq!(lines[0], "Cancelling the generations still in progress");
    assert_eq!(lines.last().unwrap(), "Server stopped");
}

#[test]
fn log_level_warning_prints_no_request_lines() {
    let serve = Serve::start(&["--log-level", "warning"]);
    let (status, _) = serve.chat(&chat_request(json!({"max_tokens": 2})));
    assert_eq!(status, 200);
    serve.signal("TERM");
    let (status, lines) = serve.wait();
    assert!(status.success());
    assert_eq!(lines, Vec::<String>::new());
}

/// An empty `--api-key` would refuse every request whatever it sends: refused at start.
#[test]
fn an_empty_api_key_is_refused() {
    let output = Command::new(OXLM)
        .arg("serve")
        .arg("--model")
        .arg(model())
        .arg("--api-key=")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("an empty key would lock every client out"),
        "{stderr}"
    );
}
