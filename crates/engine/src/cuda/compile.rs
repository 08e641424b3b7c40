//! NVRTC compilation of the kernels to a device binary, kept on disk so that later starts skip
//! it: `$OXLM_CACHE/cuda/` (default `~/.cache/oxlm/cuda/`), named by a hash of the source, the
//! architecture and the NVRTC version.

use std::ffi::{c_char, CString};
use std::path::PathBuf;

use cudarc::nvrtc::{result, sys};

use super::err;
use crate::EngineError;

/// The device binary (cubin) of `source` for compute capability `major.minor`.
pub fn cubin(source: &str, major: i32, minor: i32) -> Result<Vec<u8>, EngineError> {
    let arch = format!("sm_{major}{minor}");
    let (mut nv_major, mut nv_minor) = (0, 0);
    // SAFETY: writes two ints.
    unsafe { sys::nvrtcVersion(&mut nv_major, &mut nv_minor) }
        .result()
        .map_err(err)?;
    let key = fnv1a(&[
        source.as_bytes(),
        arch.as_bytes(),
        &[nv_major as u8, nv_minor as u8],
    ]);
    let cached = cache_dir().map(|d| d.join(format!("kernels-{arch}-{key:016x}.cubin")));
    if let Some(bytes) = cached.as_ref().and_then(|p| std::fs::read(p).ok()) {
        return Ok(bytes);
    }
    let bytes = compile(source, &arch)?;
    if let Some(path) = cached {
        // A cache that cannot be written only costs a compilation next time.
        let tmp = path.with_extension("tmp");
        if std::fs::create_dir_all(path.parent().unwrap()).is_ok()
            && std::fs::write(&tmp, &bytes).is_ok()
        {
            let _ = std::fs::rename(&tmp, &path);
        }
    }
    Ok(bytes)
}

fn compile(source: &str, arch: &str) -> Result<Vec<u8>, EngineError> {
    let src = CString::new(source).expect("kernel source has no NUL");
    let name = CString::new("kernels.cu").unwrap();
    let prog = result::create_program(&src, Some(&name)).map_err(err)?;
    let options = [
        format!("--gpu-architecture={arch}"),
        "--std=c++17".to_string(),
    ];
    // SAFETY: `prog` is a live program; the log and binary are read into buffers of the sizes
    // NVRTC reports.
    let compiled = unsafe { result::compile_program(prog, &options) };
    let outcome = match compiled {
        Err(e) => {
            let log = unsafe { result::get_program_log(prog) }.unwrap_or_default();
            let log: Vec<u8> = log
                .iter()
                .map(|&c| c as u8)
                .take_while(|&c| c != 0)
                .collect();
            Err(EngineError::Cuda(format!(
                "compiling the kernels for {arch}: {e:?}\n{}",
                String::from_utf8_lossy(&log)
            )))
        }
        Ok(()) => unsafe {
            let mut size = 0usize;
            sys::nvrtcGetCUBINSize(prog, &mut size)
                .result()
                .map_err(err)?;
            let mut bytes = vec![0u8; size];
            sys::nvrtcGetCUBIN(prog, bytes.as_mut_ptr() as *mut c_char)
                .result()
                .map_err(err)?;
            Ok(bytes)
        },
    };
    // SAFETY: destroyed once, after its last use.
    unsafe { result::destroy_program(prog) }.map_err(err)?;
    outcome
}

fn cache_dir() -> Option<PathBuf> {
    let root = std::env::var_os("OXLM_CACHE")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/oxlm")))?;
    Some(root.join("cuda"))
}

/// A hash that stays the same across builds and platforms (unlike std's).
fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf29ce484222325;
    for part in parts {
        for &b in *part {
            h ^= b as u64;
            h = h.wrapping_mul(0x100000001b3);
        }
        h ^= 0xff;
        h = h.wrapping_mul(0x100000001b3);
    }
    h
}
