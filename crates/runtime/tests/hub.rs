//! `--model org/name` against a fake Hugging Face hub on 127.0.0.1: the endpoints and headers
//! the client uses (the model info listing, `resolve` with `x-repo-commit`/`etag`, a redirect
//! of weight files to a CDN path with byte ranges), serving the tiny llama fixture.

use std::collections::{BTreeMap, HashMap};
use std::hash::{DefaultHasher, Hash, Hasher};
use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use oxlm_runtime::hub::{HubConfig, HubError};
use oxlm_runtime::sampler::SamplerConfig;
use oxlm_runtime::{generate, GenerateOptions, LoadedModel};
use serde_json::{json, Value};

const COMMIT: &str = "0123456789abcdef0123456789abcdef01234567";
const TOKEN: &str = "hf_secret";

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny/llama-4bit-g64")
}

/// How the fake hub cuts `model.safetensors` short.
#[derive(Clone, Copy)]
enum Cut {
    /// Declares the whole length, sends half, closes.
    KeepLength,
    /// Declares no length (the body ends at close), sends half.
    NoLength,
}

#[derive(Default, Clone)]
struct Behaviour {
    /// Answer 401 (gated) to file requests without `Authorization: Bearer TOKEN`.
    gated: bool,
    cut: Option<Cut>,
}

type Files = BTreeMap<String, Vec<u8>>;

struct FakeHub {
    url: String,
    requests: Arc<AtomicUsize>,
}

impl FakeHub {
    /// Serves `org/tiny` (the fixture, plus files mlx_lm does not fetch) and `org/gguf` (no MLX
    /// checkpoint) until the test process ends.
    fn start(behaviour: Behaviour) -> FakeHub {
        let mut tiny = Files::new();
        for entry in std::fs::read_dir(fixture()).unwrap() {
            let path = entry.unwrap().path();
            let name = path.file_name().unwrap().to_str().unwrap().to_string();
            tiny.insert(name, std::fs::read(&path).unwrap());
        }
        tiny.insert("README.md".into(), b"# tiny\n".to_vec());
        tiny.insert(
            ".gitattributes".into(),
            b"*.safetensors filter=lfs\n".to_vec(),
        );
        let mut gguf = Files::new();
        gguf.insert("model.gguf".into(), vec![0; 64]);
        gguf.insert("README.md".into(), b"# gguf\n".to_vec());
        let repos = Arc::new(HashMap::from([
            ("org/tiny".to_string(), tiny),
            ("org/gguf".to_string(), gguf),
        ]));

        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let requests = Arc::new(AtomicUsize::new(0));
        let (count, base) = (requests.clone(), url.clone());
        std::thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                let (repos, base, behaviour) = (repos.clone(), base.clone(), behaviour.clone());
                count.fetch_add(1, Ordering::SeqCst);
                std::thread::spawn(move || serve(stream, &repos, &base, &behaviour));
            }
        });
        FakeHub { url, requests }
    }

    fn requests(&self) -> usize {
        self.requests.load(Ordering::SeqCst)
    }

    fn config(&self, cache: &Path) -> HubConfig {
        HubConfig {
            endpoint: self.url.clone(),
            cache_dir: cache.join("hub"),
            token: None,
            offline: false,
            progress: false,
        }
    }

    fn offline_config(&self, cache: &Path) -> HubConfig {
        HubConfig {
            offline: true,
            ..self.config(cache)
        }
    }
}

fn etag(data: &[u8]) -> String {
    let mut hasher = DefaultHasher::new();
    data.hash(&mut hasher);
    format!("{:016x}", hasher.finish())
}

/// One request per connection (`Connection: close`), as far as the client needs HTTP/1.1.
fn serve(mut stream: TcpStream, repos: &HashMap<String, Files>, base: &str, b: &Behaviour) {
    let mut reader = BufReader::new(stream.try_clone().unwrap());
    let mut request_line = String::new();
    reader.read_line(&mut request_line).unwrap();
    let mut headers = HashMap::new();
    loop {
        let mut line = String::new();
        reader.read_line(&mut line).unwrap();
        match line.trim_end().split_once(':') {
            Some((name, value)) => {
                headers.insert(name.to_ascii_lowercase(), value.trim().to_string());
            }
            None => break,
        }
    }
    let target = request_line.split(' ').nth(1).unwrap_or("/");
    let path = target.split('?').next().unwrap();
    let authorized = headers.get("authorization") == Some(&format!("Bearer {TOKEN}"));
    let range = headers.get("range").map(String::as_str);

    if let Some(etag_wanted) = path.strip_prefix("/cdn/") {
        let file = repos
            .values()
            .flatten()
            .find(|(_, d)| etag(d) == etag_wanted);
        if let Some((name, data)) = file {
            let cut = b.cut.filter(|_| name == "model.safetensors");
            return send_bytes(&mut stream, data, range, &[], cut);
        }
        return send(&mut stream, "404 Not Found", &[], b"");
    }
    let (repo_id, rest) = match path.strip_prefix("/api/models/") {
        Some(api) => match api.split_once("/revision/") {
            Some((repo_id, _)) => (repo_id.to_string(), None),
            None => return send(&mut stream, "404 Not Found", &[], b""),
        },
        None => {
            let parts: Vec<&str> = path.trim_start_matches('/').splitn(5, '/').collect();
            match parts[..] {
                [org, name, "resolve", _revision, file] => {
                    (format!("{org}/{name}"), Some(file.to_string()))
                }
                _ => return send(&mut stream, "404 Not Found", &[], b""),
            }
        }
    };
    let Some(files) = repos.get(&repo_id) else {
        let body = br#"{"error":"Repository not found"}"#;
        return send(
            &mut stream,
            "404 Not Found",
            &[("X-Error-Code", "RepoNotFound")],
            body,
        );
    };
    let Some(file) = rest else {
        let siblings: Vec<Value> = files
            .iter()
            .map(|(name, data)| json!({"rfilename": name, "size": data.len()}))
            .collect();
        let listing = json!({"id": repo_id, "sha": COMMIT, "siblings": siblings});
        let body = listing.to_string().into_bytes();
        return send(
            &mut stream,
            "200 OK",
            &[("Content-Type", "application/json")],
            &body,
        );
    };
    if b.gated && !authorized {
        // As the hub does: a gated repo's listing is public, its files are not.
        let body = br#"{"error":"Access to model org/tiny is restricted."}"#;
        return send(
            &mut stream,
            "401 Unauthorized",
            &[("X-Error-Code", "GatedRepo")],
            body,
        );
    }
    let Some(data) = files.get(&file) else {
        return send(
            &mut stream,
            "404 Not Found",
            &[("X-Error-Code", "EntryNotFound")],
            b"",
        );
    };
    let tag = etag(data);
    if file.ends_with(".safetensors") {
        // Large files live in LFS: the hub answers with their hash and a redirect.
        let location = format!("{base}/cdn/{tag}");
        let size = data.len().to_string();
        let linked = format!("\"{tag}\"");
        let headers = [
            ("Location", location.as_str()),
            ("X-Repo-Commit", COMMIT),
            ("X-Linked-Etag", linked.as_str()),
            ("X-Linked-Size", size.as_str()),
        ];
        return send(&mut stream, "302 Found", &headers, b"");
    }
    let quoted = format!("\"{tag}\"");
    let headers = [("ETag", quoted.as_str()), ("X-Repo-Commit", COMMIT)];
    send_bytes(&mut stream, data, range, &headers, None)
}

/// `data`, or the part `Range: bytes=a-[b]` asks for; `cut` applies to whole-body requests,
/// not to the one-byte probe the client starts with.
fn send_bytes(
    stream: &mut TcpStream,
    data: &[u8],
    range: Option<&str>,
    headers: &[(&str, &str)],
    cut: Option<Cut>,
) {
    let bounds = range
        .and_then(|r| r.strip_prefix("bytes="))
        .and_then(|r| r.split_once('-'))
        .map(|(start, end)| {
            let start: usize = start.parse().unwrap();
            let end = end
                .parse()
                .map_or(data.len() - 1, |e: usize| e.min(data.len() - 1));
            (start, end)
        });
    let Some((start, end)) = bounds else {
        return send(stream, "200 OK", headers, data);
    };
    if start >= data.len() {
        return send(stream, "416 Range Not Satisfiable", headers, b"");
    }
    let content_range = format!("bytes {start}-{end}/{}", data.len());
    let mut all: Vec<(&str, &str)> = headers.to_vec();
    all.push(("Content-Range", &content_range));
    let body = &data[start..=end];
    match cut.filter(|_| end > start) {
        None => send(stream, "206 Partial Content", &all, body),
        Some(cut) => {
            let length = body.len().to_string();
            if let Cut::KeepLength = cut {
                all.push(("Content-Length", &length));
            }
            write_head(stream, "206 Partial Content", &all);
            let _ = stream.write_all(&body[..body.len() / 2]);
        }
    }
}

fn send(stream: &mut TcpStream, status: &str, headers: &[(&str, &str)], body: &[u8]) {
    let length = body.len().to_string();
    let mut all = headers.to_vec();
    all.push(("Content-Length", &length));
    write_head(stream, status, &all);
    let _ = stream.write_all(body);
}

fn write_head(stream: &mut TcpStream, status: &str, headers: &[(&str, &str)]) {
    let mut head = format!("HTTP/1.1 {status}\r\nConnection: close\r\n");
    for (name, value) in headers {
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    head.push_str("\r\n");
    let _ = stream.write_all(head.as_bytes());
}

/// A fake hub and an empty cache for it.
fn hub_and_cache(behaviour: Behaviour) -> (FakeHub, tempfile::TempDir) {
    (FakeHub::start(behaviour), tempfile::tempdir().unwrap())
}

fn snapshot_dir(cache: &Path) -> PathBuf {
    cache.join("hub/models--org--tiny/snapshots").join(COMMIT)
}

fn greedy(dir: &Path) -> Vec<u32> {
    let loaded = LoadedModel::load(dir).unwrap();
    let prompt = loaded.tokenizer.encode("The sea is", true).unwrap();
    let options = GenerateOptions {
        max_tokens: 12,
        sampler: SamplerConfig::default(),
        prefill_step: 16,
        kv_cache: None,
        kv_quantization: None,
        max_kv_size: None,
    };
    let model = loaded.model.as_ref();
    let generation = generate(
        model,
        &loaded.tokenizer,
        &prompt,
        &loaded.eos_ids,
        &options,
        &mut |_| {},
    )
    .unwrap();
    assert!(!generation.tokens.is_empty());
    generation.tokens
}

#[test]
fn a_repo_id_lands_in_the_hf_cache_and_generates_as_the_fixture_does() {
    let (hub, cache) = hub_and_cache(Behaviour::default());
    let config = hub.config(cache.path());

    let dir = config.resolve("org/tiny").unwrap();
    let snapshot = snapshot_dir(cache.path());
    assert_eq!(dir, snapshot);
    let refs_main = cache.path().join("hub/models--org--tiny/refs/main");
    assert_eq!(std::fs::read_to_string(refs_main).unwrap(), COMMIT);
    for name in [
        "config.json",
        "model.safetensors",
        "model.safetensors.index.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ] {
        let link = snapshot.join(name);
        let target = std::fs::read_link(&link).unwrap();
        assert!(target.starts_with("../../blobs"), "{name} -> {target:?}");
        assert_eq!(
            std::fs::read(&link).unwrap(),
            std::fs::read(fixture().join(name)).unwrap()
        );
    }
    for not_fetched in ["README.md", ".gitattributes", "golden.safetensors"] {
        assert!(!snapshot.join(not_fetched).exists(), "{not_fetched}");
    }
    assert_eq!(greedy(&dir), greedy(&fixture()));

    let seen = hub.requests();
    assert_eq!(config.resolve("org/tiny").unwrap(), snapshot);
    assert_eq!(
        config.resolve(format!("org/tiny@{COMMIT}")).unwrap(),
        snapshot
    );
    let offline = hub.offline_config(cache.path());
    assert_eq!(offline.resolve("org/tiny").unwrap(), snapshot);
    assert_eq!(
        hub.requests(),
        seen,
        "a cached snapshot is used without the hub"
    );
}

#[test]
fn a_missing_repo_is_a_not_found_error() {
    let (hub, cache) = hub_and_cache(Behaviour::default());
    let error = hub.config(cache.path()).resolve("org/missing").unwrap_err();
    assert!(matches!(error, HubError::RepoNotFound { .. }), "{error:?}");
    let message = error.to_string();
    assert!(
        message.contains("`org/missing` is not a local directory"),
        "{message}"
    );
    assert!(message.contains(&hub.url), "{message}");
}

#[test]
fn a_repo_without_an_mlx_checkpoint_is_refused_before_downloading() {
    let (hub, cache) = hub_and_cache(Behaviour::default());
    let error = hub.config(cache.path()).resolve("org/gguf").unwrap_err();
    assert!(matches!(error, HubError::NotAnMlxModel { .. }), "{error:?}");
    assert_eq!(hub.requests(), 1, "only the listing");
}

#[test]
fn a_gated_repo_asks_for_hf_token_and_opens_with_it() {
    let (hub, cache) = hub_and_cache(Behaviour {
        gated: true,
        ..Behaviour::default()
    });
    let config = hub.config(cache.path());
    let error = config.resolve("org/tiny").unwrap_err();
    assert!(
        matches!(error, HubError::AccessDenied { status: 401, .. }),
        "{error:?}"
    );
    assert!(error.to_string().contains("HF_TOKEN"), "{error}");

    let with_token = HubConfig {
        token: Some(TOKEN.into()),
        ..config
    };
    assert_eq!(
        with_token.resolve("org/tiny").unwrap(),
        snapshot_dir(cache.path())
    );
}

#[test]
fn offline_mode_without_a_cached_snapshot_says_so_and_sends_nothing() {
    let (hub, cache) = hub_and_cache(Behaviour::default());
    let offline = hub.offline_config(cache.path());
    let error = offline.resolve("org/tiny").unwrap_err();
    assert!(
        matches!(error, HubError::OfflineNotCached { .. }),
        "{error:?}"
    );
    assert!(error.to_string().contains("HF_HUB_OFFLINE"), "{error}");
    assert_eq!(hub.requests(), 0);
}

#[test]
fn an_unreachable_hub_points_to_local_directories() {
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let cache = tempfile::tempdir().unwrap();
    let config = HubConfig {
        endpoint: format!("http://127.0.0.1:{port}"),
        cache_dir: cache.path().join("hub"),
        token: None,
        offline: false,
        progress: false,
    };
    let error = config.resolve("org/tiny").unwrap_err();
    assert!(matches!(error, HubError::Unreachable { .. }), "{error:?}");
    let message = error.to_string();
    assert!(message.contains("could not be reached"), "{message}");
    assert!(message.contains("local model directory"), "{message}");
}

#[test]
fn a_local_directory_is_used_as_it_is_and_other_specs_are_refused() {
    let (hub, cache) = hub_and_cache(Behaviour::default());
    let config = hub.config(cache.path());
    assert_eq!(config.resolve(fixture()).unwrap(), fixture());
    let error = config.resolve("no/such/dir").unwrap_err();
    assert!(matches!(error, HubError::NotAModel { .. }), "{error:?}");
    assert_eq!(hub.requests(), 0);
}

#[test]
fn a_download_cut_short_leaves_nothing_that_passes_for_complete_and_resumes() {
    for cut in [Cut::KeepLength, Cut::NoLength] {
        let cache = tempfile::tempdir().unwrap();
        let cutting = FakeHub::start(Behaviour {
            cut: Some(cut),
            ..Behaviour::default()
        });
        let error = cutting
            .config(cache.path())
            .resolve("org/tiny")
            .unwrap_err();
        match cut {
            Cut::KeepLength => assert!(matches!(error, HubError::Download { .. }), "{error:?}"),
            Cut::NoLength => assert!(matches!(error, HubError::Truncated { .. }), "{error:?}"),
        }
        let snapshot = snapshot_dir(cache.path());
        assert!(snapshot.join("config.json").is_file());
        assert!(!snapshot.join("model.safetensors").exists());
        let whole = std::fs::read(fixture().join("model.safetensors")).unwrap();
        let blobs = cache.path().join("hub/models--org--tiny/blobs");
        for blob in std::fs::read_dir(&blobs).unwrap() {
            let blob = blob.unwrap().path();
            let data = std::fs::read(&blob).unwrap();
            let partial = !data.is_empty() && whole.starts_with(&data) && data.len() < whole.len();
            assert!(
                !partial || blob.extension().is_some_and(|e| e == "part"),
                "{blob:?} holds part of the weights under a final name"
            );
        }

        let healthy = FakeHub::start(Behaviour::default());
        let error = healthy.offline_config(cache.path()).resolve("org/tiny");
        let error = error.unwrap_err();
        assert!(
            matches!(error, HubError::OfflineNotCached { .. }),
            "{error:?}"
        );
        let dir = healthy.config(cache.path()).resolve("org/tiny").unwrap();
        assert_eq!(std::fs::read(dir.join("model.safetensors")).unwrap(), whole);
    }
}

#[test]
fn a_snapshot_python_downloaded_is_used_without_the_hub() {
    let (hub, cache) = hub_and_cache(Behaviour::default());
    // huggingface_hub's layout: a ref naming the commit, and the files under its snapshot.
    let repo_dir = cache.path().join("hub/models--mlx-community--tiny");
    std::fs::create_dir_all(repo_dir.join("refs")).unwrap();
    std::fs::write(repo_dir.join("refs/main"), COMMIT).unwrap();
    let snapshot = repo_dir.join("snapshots").join(COMMIT);
    std::fs::create_dir_all(&snapshot).unwrap();
    for entry in std::fs::read_dir(fixture()).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, snapshot.join(path.file_name().unwrap())).unwrap();
    }
    let config = hub.config(cache.path());
    assert_eq!(config.resolve("mlx-community/tiny").unwrap(), snapshot);
    assert_eq!(hub.requests(), 0);
}
