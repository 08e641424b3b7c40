//! What the GGUF tests share: the real GGUFs of the model cache, and small synthetic GGUFs
//! written on the spot.

#![allow(dead_code)] // each test binary uses its own part

use std::path::PathBuf;

use oxlm_convert::gguf::GgufFile;

/// `${OXLM_CACHE:-$HOME/.cache/oxlm}`.
pub fn cache_dir() -> PathBuf {
    match std::env::var_os("OXLM_CACHE") {
        Some(dir) => PathBuf::from(dir),
        None => PathBuf::from(std::env::var_os("HOME").expect("HOME is set")).join(".cache/oxlm"),
    }
}

/// A file of the model cache, which must be there: a missing one fails the test, saying how
/// to get it, rather than letting it pass untested.
pub fn cached(relative: &str) -> PathBuf {
    let path = cache_dir().join(relative);
    assert!(
        path.exists(),
        "{} is missing: run scripts/models/fetch_models.sh, which fetches the GGUFs into \
         $OXLM_CACHE/gguf/ and builds the models into $OXLM_CACHE/models/",
        path.display()
    );
    path
}

/// One of the real GGUFs the models are built from, under `$OXLM_CACHE/gguf/`.
pub fn real_gguf(name: &str) -> GgufFile {
    GgufFile::open(&cached(&format!("gguf/{name}"))).expect("the cached GGUF reads")
}

/// A metadata value of a synthetic GGUF.
#[derive(Clone, Copy)]
pub enum Meta<'a> {
    Str(&'a str),
    U32(u32),
    F32(f32),
    Bool(bool),
    Strs(&'a [&'a str]),
    I32s(&'a [i32]),
}

fn string(out: &mut Vec<u8>, s: &str) {
    out.extend((s.len() as u64).to_le_bytes());
    out.extend(s.as_bytes());
}

fn value(out: &mut Vec<u8>, v: &Meta) {
    let kind = |out: &mut Vec<u8>, k: u32| out.extend(k.to_le_bytes());
    match v {
        Meta::Str(s) => {
            kind(out, 8);
            string(out, s);
        }
        Meta::U32(n) => {
            kind(out, 4);
            out.extend(n.to_le_bytes());
        }
        Meta::F32(x) => {
            kind(out, 6);
            out.extend(x.to_le_bytes());
        }
        Meta::Bool(b) => {
            kind(out, 7);
            out.push(*b as u8);
        }
        Meta::Strs(items) => {
            kind(out, 9);
            kind(out, 8);
            out.extend((items.len() as u64).to_le_bytes());
            for s in *items {
                string(out, s);
            }
        }
        Meta::I32s(items) => {
            kind(out, 9);
            kind(out, 5);
            out.extend((items.len() as u64).to_le_bytes());
            for n in *items {
                out.extend(n.to_le_bytes());
            }
        }
    }
}

/// A version-3 GGUF of this metadata and these F32 tensors (name, row-major shape, values).
pub fn write_gguf(meta: &[(&str, Meta)], tensors: &[(&str, &[usize], &[f32])]) -> GgufFile {
    let mut out = b"GGUF".to_vec();
    out.extend(3u32.to_le_bytes());
    out.extend((tensors.len() as u64).to_le_bytes());
    out.extend((meta.len() as u64).to_le_bytes());
    for (key, v) in meta {
        string(&mut out, key);
        value(&mut out, v);
    }
    let mut offset = 0u64;
    for (name, shape, data) in tensors {
        string(&mut out, name);
        out.extend((shape.len() as u32).to_le_bytes());
        for &d in shape.iter().rev() {
            out.extend((d as u64).to_le_bytes());
        }
        out.extend(0u32.to_le_bytes()); // F32
        out.extend(offset.to_le_bytes());
        offset = (offset + 4 * data.len() as u64).next_multiple_of(32);
    }
    for (_, _, data) in tensors {
        out.resize(out.len().next_multiple_of(32), 0);
        out.extend(data.iter().flat_map(|x| x.to_le_bytes()));
    }
    let file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(file.path(), &out).unwrap();
    GgufFile::open(file.path()).unwrap()
}
