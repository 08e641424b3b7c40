//! The real `oxlm serve` binary: a LoRA adapter chosen per request gives what
//! `oxlm generate --adapter-path` gives.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
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

/// A running `oxlm serve` on a free port.
struct Serve {
    child: Child,
    port: u16,
}

impl Serve {
    fn start(extra: &[&str]) -> Serve {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let child = Command::new(OXLM)
            .arg("serve")
            .arg("--model")
            .arg(model())
            .args(["--port", &port.to_string()])
            .args(extra)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let serve = Serve { child, port };
        serve.wait_until_healthy();
        serve
    }

    fn wait_until_healthy(&self) {
        for _ in 0..600 {
            if let Ok(mut stream) = TcpStream::connect(("127.0.0.1", self.port)) {
                let request =
                    "GET /health HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n";
                if stream.write_all(request.as_bytes()).is_ok() && response(stream).0 == 200 {
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

fn chat_request(extra: Value) -> Value {
    let mut body = json!({"messages": [{"role": "user", "content": PROMPT}], "temperature": 0});
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

/// What `oxlm generate` prints between its `==========` lines.
fn generated(extra: &[&str]) -> String {
    let output = Command::new(OXLM)
        .arg("generate")
        .arg("--model")
        .arg(model())
        .args(["--prompt", PROMPT, "--max-tokens", "24"])
        .args(extra)
        .output()
        .unwrap();
    assert!(output.status.success(), "{output:?}");
    let stdout = String::from_utf8(output.stdout).unwrap();
    let text = stdout.strip_prefix("==========\n").unwrap();
    text[..text.find("\n==========").unwrap()].to_owned()
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
