//! Model specs as mlx_lm takes them: a local directory, or a Hugging Face hub repo id
//! (`org/name`, optionally `org/name@revision`) fetched into the standard hub cache
//! (`models--org--name/{blobs,refs,snapshots}`), so that downloads are shared with Python's
//! mlx_lm and huggingface_hub both ways.
//!
//! The `hf-hub` crate (its blocking ureq client, over rustls) does the cache layout, the
//! download to a `.part` file that is resumed and renamed into place, and the hub's headers and
//! redirects. Around it, this module reads the hub's environment variables as huggingface_hub
//! does (hf-hub reads only HF_HOME and HF_ENDPOINT), keeps to mlx_lm's file patterns, answers
//! from the cache without asking the hub, honours HF_HUB_OFFLINE, checks each file's size
//! against the listing and turns failures into the errors below.

use std::io::IsTerminal;
use std::path::{Component, Path, PathBuf};

use hf_hub::api::sync::{ApiBuilder, ApiError, ApiRepo};
use hf_hub::api::Progress;
use hf_hub::{Cache, Repo, RepoType};
use indicatif::{ProgressBar, ProgressStyle};
use serde::Deserialize;
use thiserror::Error;
use ureq::ErrorKind;

pub const DEFAULT_ENDPOINT: &str = "https://huggingface.co";

/// mlx_lm's `DEFAULT_ALLOW_PATTERNS` (mlx_lm/utils.py): the files of a repo that are fetched.
/// Python files are never run; they are fetched so that the snapshot is the one mlx_lm makes.
pub const ALLOW_PATTERNS: &[&str] = &[
    "*.json",
    "model*.safetensors",
    "*.py",
    "tokenizer.model",
    "*.tiktoken",
    "tiktoken.model",
    "*.txt",
    "*.jsonl",
    "*.jinja",
];

const WEIGHTS_PATTERN: &str = "model*.safetensors";
const WEIGHTS_INDEX: &str = "model.safetensors.index.json";

#[derive(Debug, Error)]
pub enum HubError {
    #[error(
        "`{spec}` is not a directory, nor a Hugging Face repo id (org/name or \
         org/name@revision)"
    )]
    NotAModel { spec: String },
    #[error("{file}: cannot convert the GGUF file: {reason}")]
    Gguf { file: PathBuf, reason: String },
    #[error(
        "`{repo}` is not a local directory, and {endpoint} has no such repository (if it is \
         private, set HF_TOKEN to a token that can read it)"
    )]
    RepoNotFound { repo: String, endpoint: String },
    #[error("{endpoint} has no revision `{revision}` of `{repo}`")]
    RevisionNotFound {
        repo: String,
        revision: String,
        endpoint: String,
    },
    #[error(
        "{endpoint} refused access to `{repo}` (HTTP {status}): the repository is gated or \
         private; accept its terms on the hub and set HF_TOKEN to a token that can read it"
    )]
    AccessDenied {
        repo: String,
        endpoint: String,
        status: u16,
    },
    #[error(
        "the Hugging Face hub at {endpoint} could not be reached ({reason}); pass a local \
         model directory to --model instead"
    )]
    Unreachable { endpoint: String, reason: String },
    #[error(
        "HF_HUB_OFFLINE is set and {cache} holds no complete snapshot of `{repo}` at \
         `{revision}`; unset HF_HUB_OFFLINE to download it, or pass a local model directory"
    )]
    OfflineNotCached {
        repo: String,
        revision: String,
        cache: PathBuf,
    },
    #[error(
        "`{repo}` at `{revision}` has no config.json and model*.safetensors: not an MLX model"
    )]
    NotAnMlxModel { repo: String, revision: String },
    #[error("{url} answered HTTP {status}")]
    Status { url: String, status: u16 },
    #[error("asking {endpoint} for `{repo}` failed: {reason}")]
    Request {
        repo: String,
        endpoint: String,
        reason: String,
    },
    #[error("the file listing of `{repo}` from {endpoint} could not be read: {source}")]
    BadListing {
        repo: String,
        endpoint: String,
        #[source]
        source: std::io::Error,
    },
    #[error("fetching {file} of `{repo}` failed: {source}; run again to resume")]
    Download {
        repo: String,
        file: String,
        #[source]
        source: ApiError,
    },
    #[error(
        "{file} of `{repo}` arrived with {got} bytes of {expected}; run again to fetch it anew"
    )]
    Truncated {
        repo: String,
        file: String,
        expected: u64,
        got: u64,
    },
    #[error(
        "{snapshot} still lacks config.json or a weight file after the download (did `{repo}` \
         change meanwhile?); run again"
    )]
    IncompleteSnapshot { repo: String, snapshot: PathBuf },
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("no home directory to keep the Hugging Face cache in; set HF_HOME or HF_HUB_CACHE")]
    NoCacheDir,
}

/// A hub model: `org/name`, at a branch, tag or commit (`main` unless `@revision` is given).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RepoSpec {
    pub repo_id: String,
    pub revision: String,
}

impl RepoSpec {
    /// `org/name` or `org/name@revision`; `None` for anything else (paths with more or fewer
    /// parts, characters the hub does not allow in names, a revision that would name a path
    /// outside the cache's `refs/`).
    pub fn parse(spec: &str) -> Option<Self> {
        let (repo_id, revision) = spec.split_once('@').unwrap_or((spec, "main"));
        let (org, name) = repo_id.split_once('/')?;
        let revision_is_a_ref_name = !revision.is_empty()
            && Path::new(revision)
                .components()
                .all(|c| matches!(c, Component::Normal(_)));
        (repo_id.len() <= 96
            && is_repo_name_part(org)
            && is_repo_name_part(name)
            && revision_is_a_ref_name)
            .then(|| RepoSpec {
                repo_id: repo_id.to_string(),
                revision: revision.to_string(),
            })
    }

    fn repo(&self) -> Repo {
        Repo::with_revision(self.repo_id.clone(), RepoType::Model, self.revision.clone())
    }
}

/// The hub's rule for an owner or a repo name: letters, digits, `-`, `_`, `.`, neither
/// starting nor ending with `-` or `.`, and no `--` or `..` (which the cache layout reserves).
fn is_repo_name_part(part: &str) -> bool {
    let allowed = |c: char| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.');
    !part.is_empty()
        && part.chars().all(allowed)
        && !part.starts_with(['-', '.'])
        && !part.ends_with(['-', '.'])
        && !part.contains("--")
        && !part.contains("..")
}

/// Where and how to reach the hub; [`HubConfig::from_env`] reads huggingface_hub's variables.
#[derive(Debug, Clone)]
pub struct HubConfig {
    /// The hub's base URL (HF_ENDPOINT).
    pub endpoint: String,
    /// The hub cache, holding `models--org--name` folders (HF_HUB_CACHE, else HF_HOME/hub).
    pub cache_dir: PathBuf,
    /// Sent as a bearer token (HF_TOKEN, else the token file that `hf auth login` writes).
    pub token: Option<String>,
    /// Use only the cache (HF_HUB_OFFLINE).
    pub offline: bool,
    /// Draw a progress bar per file on stderr.
    pub progress: bool,
}

/// Resolves `--model`: a directory is used as it is; a GGUF file is converted once into the
/// cache ([`gguf_model`]); a repo id is found in the hub cache or downloaded into it, with the
/// settings of the environment.
pub fn resolve_model(spec: impl AsRef<Path>) -> Result<PathBuf, HubError> {
    let spec = spec.as_ref();
    if spec.is_dir() {
        return Ok(spec.to_path_buf());
    }
    if spec.is_file()
        && spec
            .extension()
            .is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
    {
        return gguf_model(spec);
    }
    HubConfig::from_env()?.resolve(spec)
}

/// oxlm's cache directory: `$OXLM_CACHE`, or `~/.cache/oxlm` (`None` without a home).
pub fn cache_root() -> Option<PathBuf> {
    match std::env::var_os("OXLM_CACHE").filter(|v| !v.is_empty()) {
        Some(dir) => Some(PathBuf::from(dir)),
        None => Some(std::env::home_dir()?.join(".cache/oxlm")),
    }
}

/// The MLX model of a GGUF file, converted on first use into
/// `${OXLM_CACHE:-~/.cache/oxlm}/gguf-mlx/NAME-KEY` (KEY from the file's path, size and
/// modification time, so that a changed file converts again) as `oxlm convert --gguf` converts it.
pub fn gguf_model(file: &Path) -> Result<PathBuf, HubError> {
    use std::hash::{Hash, Hasher};
    let fail = |reason: String| HubError::Gguf {
        file: file.to_path_buf(),
        reason,
    };
    let meta = std::fs::metadata(file).map_err(|e| fail(e.to_string()))?;
    let mut key = std::collections::hash_map::DefaultHasher::new();
    std::fs::canonicalize(file)
        .map_err(|e| fail(e.to_string()))?
        .hash(&mut key);
    meta.len().hash(&mut key);
    meta.modified().ok().hash(&mut key);
    let cache = cache_root()
        .ok_or_else(|| fail("no home directory for the cache; set OXLM_CACHE".into()))?;
    let stem = file.file_stem().unwrap_or_default().to_string_lossy();
    let dir = cache
        .join("gguf-mlx")
        .join(format!("{stem}-{:016x}", key.finish()));
    if !dir.join("config.json").is_file() {
        eprintln!(
            "Converting {} into {} (once)",
            file.display(),
            dir.display()
        );
        let options = oxlm_convert::ConvertOptions {
            force: true,
            ..Default::default()
        };
        oxlm_convert::from_gguf::convert_gguf(file, &dir, &options, &mut |_| {})
            .map_err(|e| fail(e.to_string()))?;
    }
    Ok(dir)
}

impl HubConfig {
    /// The settings huggingface_hub would use in this process; progress bars when stderr is a
    /// terminal.
    pub fn from_env() -> Result<Self, HubError> {
        let var = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
        let mut config = Self::from_vars(var, std::env::home_dir())?;
        config.progress = std::io::stderr().is_terminal();
        Ok(config)
    }

    /// huggingface_hub's `constants.py`: each setting from its variable, else from the one it
    /// falls back to; `~` is expanded as Python's `expanduser` does.
    fn from_vars(
        var: impl Fn(&str) -> Option<String>,
        home: Option<PathBuf>,
    ) -> Result<Self, HubError> {
        let expand = |value: String| -> Option<PathBuf> {
            match value.strip_prefix('~') {
                Some(rest) if rest.is_empty() || rest.starts_with('/') => {
                    Some(home.as_ref()?.join(rest.trim_start_matches('/')))
                }
                _ => Some(PathBuf::from(value)),
            }
        };
        let hf_home = match var("HF_HOME") {
            Some(dir) => expand(dir),
            None => var("XDG_CACHE_HOME")
                .map_or_else(|| expand("~/.cache".into()), &expand)
                .map(|cache| cache.join("huggingface")),
        };
        let cache_dir = var("HF_HUB_CACHE")
            .or_else(|| var("HUGGINGFACE_HUB_CACHE"))
            .map_or_else(|| hf_home.as_ref().map(|h| h.join("hub")), &expand)
            .ok_or(HubError::NoCacheDir)?;
        let token_file =
            var("HF_TOKEN_PATH").map_or_else(|| hf_home.as_ref().map(|h| h.join("token")), expand);
        let token = var("HF_TOKEN")
            .or_else(|| var("HUGGING_FACE_HUB_TOKEN"))
            .or_else(|| std::fs::read_to_string(token_file?).ok())
            .map(|token| token.trim().to_string())
            .filter(|token| !token.is_empty());
        let offline = var("HF_HUB_OFFLINE").is_some_and(|v| {
            matches!(v.to_ascii_uppercase().as_str(), "1" | "ON" | "YES" | "TRUE")
        });
        Ok(HubConfig {
            endpoint: var("HF_ENDPOINT")
                .unwrap_or_else(|| DEFAULT_ENDPOINT.into())
                .trim_end_matches('/')
                .to_string(),
            // hf-hub links snapshot files to blobs by relative paths worked out from these.
            cache_dir: std::path::absolute(&cache_dir).unwrap_or(cache_dir),
            token,
            offline,
            progress: false,
        })
    }

    /// A directory as it is; else a repo id's snapshot directory, from the cache when a
    /// complete one is there (the hub is not asked), else downloaded (unless offline).
    pub fn resolve(&self, spec: impl AsRef<Path>) -> Result<PathBuf, HubError> {
        let spec = spec.as_ref();
        if spec.is_dir() {
            return Ok(spec.to_path_buf());
        }
        let repo = spec
            .to_str()
            .and_then(RepoSpec::parse)
            .ok_or_else(|| HubError::NotAModel {
                spec: spec.display().to_string(),
            })?;
        if let Some(snapshot) = self.cached_snapshot(&repo) {
            return Ok(snapshot);
        }
        if self.offline {
            return Err(HubError::OfflineNotCached {
                repo: repo.repo_id,
                revision: repo.revision,
                cache: self.cache_dir.clone(),
            });
        }
        self.download(&repo)
    }

    fn repo_dir(&self, repo: &RepoSpec) -> PathBuf {
        self.cache_dir.join(repo.repo().folder_name())
    }

    /// The snapshot a branch or tag points at (by its `refs/` file) or a commit names, if it
    /// holds a whole checkpoint.
    fn cached_snapshot(&self, repo: &RepoSpec) -> Option<PathBuf> {
        let repo_dir = self.repo_dir(repo);
        let commit = if is_commit_hash(&repo.revision) {
            repo.revision.clone()
        } else {
            let ref_file = repo_dir.join("refs").join(&repo.revision);
            std::fs::read_to_string(ref_file).ok()?.trim().to_string()
        };
        let snapshot = repo_dir.join("snapshots").join(commit);
        is_complete_checkpoint(&snapshot).then_some(snapshot)
    }

    fn download(&self, repo: &RepoSpec) -> Result<PathBuf, HubError> {
        let api = ApiBuilder::from_cache(Cache::new(self.cache_dir.clone()))
            .with_endpoint(self.endpoint.clone())
            .with_token(self.token.clone())
            .with_progress(false)
            .build()
            .map_err(|source| self.api_error(repo, "the file listing", source))?;
        let api_repo = api.repo(repo.repo());
        let listing = self.listing(repo, &api_repo)?;
        let mut files: Vec<&ListedFile> = listing
            .siblings
            .iter()
            .filter(|f| is_wanted(&f.rfilename))
            .collect();
        let has = |pattern: &str| files.iter().any(|f| glob_match(pattern, &f.rfilename));
        if !has("config.json") || !has(WEIGHTS_PATTERN) {
            return Err(HubError::NotAnMlxModel {
                repo: repo.repo_id.clone(),
                revision: repo.revision.clone(),
            });
        }
        // Weights last: a snapshot whose weights are all there then has everything else too,
        // which is how `cached_snapshot` tells a finished download without asking the hub.
        files.sort_by_key(|f| (glob_match(WEIGHTS_PATTERN, &f.rfilename), &f.rfilename));
        let snapshot = self.repo_dir(repo).join("snapshots").join(&listing.sha);
        for file in files {
            let local = snapshot.join(&file.rfilename);
            if file.size.is_none_or(|size| file_size(&local) == Some(size)) && local.is_file() {
                continue;
            }
            self.fetch_file(repo, &api_repo, file)?;
        }
        if !is_commit_hash(&repo.revision) {
            Cache::new(self.cache_dir.clone())
                .repo(repo.repo())
                .create_ref(&listing.sha)
                .map_err(|source| HubError::Io {
                    path: self.repo_dir(repo).join("refs").join(&repo.revision),
                    source,
                })?;
        }
        if !is_complete_checkpoint(&snapshot) {
            return Err(HubError::IncompleteSnapshot {
                repo: repo.repo_id.clone(),
                snapshot,
            });
        }
        Ok(snapshot)
    }

    /// `/api/models/{repo}/revision/{revision}?blobs=true`: the commit and the files, with sizes.
    fn listing(&self, repo: &RepoSpec, api_repo: &ApiRepo) -> Result<Listing, HubError> {
        let response = api_repo
            .info_request()
            .query("blobs", "true")
            .call()
            .map_err(|e| self.request_error(repo, Box::new(e)))?;
        response.into_json().map_err(|source| HubError::BadListing {
            repo: repo.repo_id.clone(),
            endpoint: self.endpoint.clone(),
            source,
        })
    }

    /// Downloads one file into its snapshot and checks its size against the listing.
    fn fetch_file(
        &self,
        repo: &RepoSpec,
        api_repo: &ApiRepo,
        file: &ListedFile,
    ) -> Result<(), HubError> {
        let name = file.rfilename.as_str();
        let downloaded = if self.progress {
            api_repo.download_with_progress(name, FileBar(ProgressBar::no_length()))
        } else {
            api_repo.download_with_progress(name, ())
        }
        .map_err(|source| self.api_error(repo, name, source))?;
        let got = file_size(&downloaded).unwrap_or(0);
        match file.size {
            Some(expected) if expected != got => {
                // The blob is what is wrong; the link to it must not pass for a whole file.
                let blob = std::fs::canonicalize(&downloaded).ok();
                for path in [Some(downloaded), blob].into_iter().flatten() {
                    let _ = std::fs::remove_file(path);
                }
                Err(HubError::Truncated {
                    repo: repo.repo_id.clone(),
                    file: name.to_string(),
                    expected,
                    got,
                })
            }
            _ => Ok(()),
        }
    }

    fn api_error(&self, repo: &RepoSpec, file: &str, source: ApiError) -> HubError {
        match source {
            ApiError::RequestError(request) => self.request_error(repo, request),
            source => HubError::Download {
                repo: repo.repo_id.clone(),
                file: file.to_string(),
                source,
            },
        }
    }

    /// The hub's answers as huggingface_hub reads them: its `X-Error-Code` header first (the
    /// hub answers 401, not 404, for a missing repo when no token is sent), then the status.
    fn request_error(&self, repo: &RepoSpec, error: Box<ureq::Error>) -> HubError {
        let endpoint = self.endpoint.clone();
        let repo_id = repo.repo_id.clone();
        match *error {
            ureq::Error::Status(status, response) => {
                match (response.header("x-error-code"), status) {
                    (Some("RepoNotFound"), _) | (None, 404) => HubError::RepoNotFound {
                        repo: repo_id,
                        endpoint,
                    },
                    (Some("RevisionNotFound"), _) => HubError::RevisionNotFound {
                        repo: repo_id,
                        revision: repo.revision.clone(),
                        endpoint,
                    },
                    (_, 401 | 403) => HubError::AccessDenied {
                        repo: repo_id,
                        endpoint,
                        status,
                    },
                    _ => HubError::Status {
                        url: response.get_url().to_string(),
                        status,
                    },
                }
            }
            ureq::Error::Transport(transport) => {
                let reason = transport.to_string();
                match transport.kind() {
                    ErrorKind::Dns
                    | ErrorKind::ConnectionFailed
                    | ErrorKind::ProxyConnect
                    | ErrorKind::Io => HubError::Unreachable { endpoint, reason },
                    _ => HubError::Request {
                        repo: repo_id,
                        endpoint,
                        reason,
                    },
                }
            }
        }
    }
}

/// The part of the hub's model info this needs.
#[derive(Debug, Deserialize)]
struct Listing {
    /// The commit the revision points at, which names the snapshot.
    sha: String,
    siblings: Vec<ListedFile>,
}

#[derive(Debug, Deserialize)]
struct ListedFile {
    rfilename: String,
    /// Present with `?blobs=true`.
    size: Option<u64>,
}

/// An indicatif bar for one file, for hf-hub's progress callbacks.
struct FileBar(ProgressBar);

impl Progress for FileBar {
    fn init(&mut self, size: usize, filename: &str) {
        self.0.set_length(size as u64);
        self.0.set_message(filename.to_string());
        if let Ok(style) = ProgressStyle::with_template(
            "{msg:30!} [{bar:40}] {bytes:>10}/{total_bytes:<10} {bytes_per_sec:>12} {eta}",
        ) {
            self.0.set_style(style.progress_chars("=> "));
        }
    }

    fn update(&mut self, size: usize) {
        self.0.inc(size as u64);
    }

    fn finish(&mut self) {
        self.0.finish();
    }
}

fn is_commit_hash(revision: &str) -> bool {
    revision.len() == 40
        && revision
            .bytes()
            .all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

/// A file mlx_lm would fetch, whose name cannot step out of the snapshot directory.
fn is_wanted(name: &str) -> bool {
    Path::new(name)
        .components()
        .all(|c| matches!(c, Component::Normal(_)))
        && ALLOW_PATTERNS.iter().any(|p| glob_match(p, name))
}

/// Python's `fnmatch` for patterns of `*` and literals, as huggingface_hub filters repo files:
/// `*` matches any run of characters, `/` included.
fn glob_match(pattern: &str, name: &str) -> bool {
    match pattern.split_once('*') {
        None => pattern == name,
        Some((prefix, rest)) => {
            let Some(tail) = name.strip_prefix(prefix) else {
                return false;
            };
            (0..=tail.len())
                .filter(|&i| tail.is_char_boundary(i))
                .any(|i| glob_match(rest, &tail[i..]))
        }
    }
}

fn file_size(path: &Path) -> Option<u64> {
    std::fs::metadata(path).ok().map(|m| m.len())
}

/// config.json and every weight file (all shards the index names, else some
/// `model*.safetensors`). Files reach a snapshot only once whole, and weights come last.
fn is_complete_checkpoint(dir: &Path) -> bool {
    if !dir.join("config.json").is_file() {
        return false;
    }
    match std::fs::read(dir.join(WEIGHTS_INDEX)) {
        Ok(index) => {
            let Ok(index) = serde_json::from_slice::<serde_json::Value>(&index) else {
                return false;
            };
            let shards = index.get("weight_map").and_then(|m| m.as_object());
            shards.is_some_and(|shards| {
                !shards.is_empty()
                    && shards
                        .values()
                        .all(|shard| shard.as_str().is_some_and(|s| dir.join(s).is_file()))
            })
        }
        Err(_) => std::fs::read_dir(dir).is_ok_and(|entries| {
            entries.flatten().any(|entry| {
                glob_match(WEIGHTS_PATTERN, &entry.file_name().to_string_lossy())
                    && entry.path().is_file()
            })
        }),
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    #[test]
    fn specs_are_org_slash_name_with_an_optional_revision() {
        let spec = |repo_id: &str, revision: &str| {
            Some(RepoSpec {
                repo_id: repo_id.into(),
                revision: revision.into(),
            })
        };
        assert_eq!(
            RepoSpec::parse("mlx-community/Qwen3-0.6B-4bit"),
            spec("mlx-community/Qwen3-0.6B-4bit", "main")
        );
        assert_eq!(RepoSpec::parse("org/name@v1.0"), spec("org/name", "v1.0"));
        assert_eq!(
            RepoSpec::parse("org/name@refs/pr/1"),
            spec("org/name", "refs/pr/1")
        );
        for not_a_repo in [
            "name",
            "org/name@",
            "org/name@../../x",
            "org/name@/etc",
            "a/b/c",
            "/abs/path",
            "./dir",
            "~/models/x",
            "org/na--me",
            "org/.name",
            "org/name.",
            "org/na me",
            "../x",
        ] {
            assert_eq!(RepoSpec::parse(not_a_repo), None, "{not_a_repo}");
        }
    }

    #[test]
    fn patterns_match_as_fnmatch_does() {
        assert!(glob_match("*.json", "config.json"));
        assert!(glob_match("*.json", "sub/dir/x.json"));
        assert!(glob_match("model*.safetensors", "model.safetensors"));
        assert!(glob_match(
            "model*.safetensors",
            "model-00001-of-00002.safetensors"
        ));
        assert!(!glob_match("model*.safetensors", "golden.safetensors"));
        assert!(glob_match("tokenizer.model", "tokenizer.model"));
        assert!(!glob_match("tokenizer.model", "sub/tokenizer.model"));
        assert!(is_wanted("chat_template.jinja"));
        assert!(!is_wanted("README.md"));
        assert!(!is_wanted("model.gguf"));
        assert!(!is_wanted("../escape.json"));
        assert!(!is_wanted("/etc/x.json"));
    }

    fn config(vars: &[(&str, &str)], home: Option<&str>) -> Result<HubConfig, HubError> {
        let vars: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        HubConfig::from_vars(|name| vars.get(name).cloned(), home.map(PathBuf::from))
    }

    #[test]
    fn settings_follow_huggingface_hub_variables() {
        let defaults = config(&[], Some("/home/u")).unwrap();
        assert_eq!(
            defaults.cache_dir,
            PathBuf::from("/home/u/.cache/huggingface/hub")
        );
        assert_eq!(defaults.endpoint, DEFAULT_ENDPOINT);
        assert!(!defaults.offline);
        assert_eq!(defaults.token, None);

        let xdg = config(&[("XDG_CACHE_HOME", "/xdg")], Some("/home/u")).unwrap();
        assert_eq!(xdg.cache_dir, PathBuf::from("/xdg/huggingface/hub"));
        let hf_home = config(&[("HF_HOME", "~/hf")], Some("/home/u")).unwrap();
        assert_eq!(hf_home.cache_dir, PathBuf::from("/home/u/hf/hub"));
        let hub_cache = config(
            &[("HF_HOME", "/hf"), ("HF_HUB_CACHE", "/elsewhere")],
            Some("/home/u"),
        )
        .unwrap();
        assert_eq!(hub_cache.cache_dir, PathBuf::from("/elsewhere"));

        let set = config(
            &[
                ("HF_HUB_CACHE", "/c"),
                ("HF_ENDPOINT", "http://127.0.0.1:9/"),
                ("HF_TOKEN", " hf_abc\n"),
                ("HF_HUB_OFFLINE", "true"),
            ],
            None,
        )
        .unwrap();
        assert_eq!(set.endpoint, "http://127.0.0.1:9");
        assert_eq!(set.token.as_deref(), Some("hf_abc"));
        assert!(set.offline);
        assert!(
            !config(&[("HF_HUB_CACHE", "/c"), ("HF_HUB_OFFLINE", "0")], None)
                .unwrap()
                .offline
        );
        assert!(matches!(config(&[], None), Err(HubError::NoCacheDir)));
    }

    #[test]
    fn the_token_file_is_read_when_hf_token_is_unset() {
        let home = tempfile::tempdir().unwrap();
        std::fs::write(home.path().join("token"), "hf_from_file\n").unwrap();
        let hf_home = home.path().to_str().unwrap();
        let config = config(&[("HF_HOME", hf_home)], None).unwrap();
        assert_eq!(config.token.as_deref(), Some("hf_from_file"));
    }
}
