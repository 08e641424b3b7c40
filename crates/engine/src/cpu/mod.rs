//! CPU kernels: AVX2+FMA where the processor has them (checked at run time), AVX-VNNI and
//! AVX512-VNNI for the integer GEMVs where present, portable code everywhere else.
//!
//! Kernels take f32 activations (the integer GEMVs of [`qint`] quantize them themselves); matmuls
//! and attention split their outputs over [`pool`]. Each public entry point has an `Isa`-taking
//! variant so that tests can run the AVX2 and the portable code side by side.

pub mod attention;
#[cfg(target_arch = "x86_64")]
mod avx2;
pub mod dense;
mod gemm;
pub mod pool;
pub mod qint;
pub mod qmatmul;
pub mod transposed;
#[cfg(target_arch = "x86_64")]
mod x86_int;

use std::cell::RefCell;

/// The instruction set a kernel is written for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isa {
    /// Plain Rust, for any processor.
    Portable,
    /// x86-64 AVX2 with FMA and F16C (every AVX2 processor has F16C).
    Avx2,
}

impl Isa {
    /// The fastest kernels this processor runs.
    pub fn best() -> Isa {
        if Isa::Avx2.is_available() {
            Isa::Avx2
        } else {
            Isa::Portable
        }
    }

    /// Whether this processor runs these kernels.
    pub fn is_available(self) -> bool {
        match self {
            Isa::Portable => true,
            Isa::Avx2 => avx2_detected(),
        }
    }

    /// Every kernel set this processor runs.
    pub fn available() -> Vec<Isa> {
        [Isa::Portable, Isa::Avx2]
            .into_iter()
            .filter(|isa| isa.is_available())
            .collect()
    }

    /// Panics unless this processor runs `self`: the AVX2 kernels would fault otherwise.
    fn check(self) {
        assert!(
            self.is_available(),
            "{self:?} kernels need a processor that has them"
        );
    }
}

#[cfg(target_arch = "x86_64")]
fn avx2_detected() -> bool {
    // std caches the CPUID result, so this is a few loads.
    is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c")
}

#[cfg(not(target_arch = "x86_64"))]
fn avx2_detected() -> bool {
    false
}

thread_local! {
    static SCRATCH: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    static TASK_SCRATCH: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Runs `f` on `len` floats of this thread's scratch space (contents unspecified), which grows
/// to the largest size asked for and is then reused, so kernels do not allocate per call.
fn with_scratch<R>(len: usize, f: impl FnOnce(&mut [f32]) -> R) -> R {
    SCRATCH.with(|s| {
        let mut s = s.borrow_mut();
        if s.len() < len {
            s.resize(len, 0.0);
        }
        f(&mut s[..len])
    })
}

/// As [`with_scratch`], for a pool task: a second buffer, since the thread that starts a job
/// also runs its tasks while it still holds its own scratch.
fn with_task_scratch<R>(len: usize, f: impl FnOnce(&mut [f32]) -> R) -> R {
    TASK_SCRATCH.with(|s| {
        let mut s = s.borrow_mut();
        if s.len() < len {
            s.resize(len, 0.0);
        }
        f(&mut s[..len])
    })
}
