//! CPU kernels: AVX2+FMA where the processor has them (checked at run time), AVX-512 and AMX
//! tiles for the GEMM and AVX-VNNI / AVX512-VNNI for the integer GEMVs where present, portable
//! code everywhere else.
//!
//! Kernels take f32 activations (the integer GEMVs of [`qint`] quantize them themselves); matmuls
//! and attention split their outputs over [`pool`]. Each public entry point has an `Isa`-taking
//! variant so that tests can run the AVX2 and the portable code side by side.
//!
//! By op family, as in [`crate::ops`]: [`matmul`] (affine-quantized weights; float-quantized
//! ones in [`fp`], float weights in [`dense`], the integer GEMVs in [`qint`], the blocked GEMM in
//! `gemm` and `amx`, backward products in [`transposed`]), [`attention`] (with the caches'
//! rings), [`norm`], [`elementwise`], [`recurrent`] and [`experts`] (a mixture's routing).
//! `avx2`, `avx512` and `x86_int` hold each instruction set's primitives that the families
//! share.

#[cfg(target_arch = "x86_64")]
/// `$f::<$g.., H>(args)` with `H = $heads` (1 to 4; more take 4): the attention kernels hold a
/// set of sums per head in registers, so each head count is a function of its own.
macro_rules! by_heads {
    ($heads:expr, $f:ident $(::<$($g:ty),*>)? ($($arg:expr),* $(,)?)) => {
        match $heads {
            1 => $f::<$($($g,)*)? 1>($($arg),*),
            2 => $f::<$($($g,)*)? 2>($($arg),*),
            3 => $f::<$($($g,)*)? 3>($($arg),*),
            _ => $f::<$($($g,)*)? 4>($($arg),*),
        }
    };
}

mod amx;
pub mod attention;
#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
pub mod dense;
pub mod elementwise;
pub mod experts;
pub mod fp;
mod gemm;
pub mod matmul;
pub mod norm;
pub mod pool;
pub mod qint;
pub mod recurrent;
pub mod transposed;
#[cfg(target_arch = "x86_64")]
mod x86_int;

use std::cell::RefCell;
use std::sync::OnceLock;

/// The instruction set a kernel is written for; each includes the ones before it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Isa {
    /// Plain Rust, for any processor.
    Portable,
    /// x86-64 AVX2 with FMA and F16C (every AVX2 processor has F16C).
    Avx2,
    /// AVX2 plus AVX-512 F, BW, DQ and VL (x86-64-v4): the GEMM runs 16 lanes wide, every other
    /// kernel as on AVX2.
    Avx512,
    /// AVX-512 plus AMX-BF16 tiles that Linux lets this process use: the GEMM on 4- and 8-bit
    /// weights runs on tiles (`amx`), everything else as on AVX-512.
    Amx,
}

impl Isa {
    /// The fastest kernels this processor runs, detected once (kernels ask per call).
    pub fn best() -> Isa {
        static BEST: OnceLock<Isa> = OnceLock::new();
        *BEST.get_or_init(|| match (avx2_detected(), avx512_detected()) {
            (true, true) if amx_detected() => Isa::Amx,
            (true, true) => Isa::Avx512,
            (true, false) => Isa::Avx2,
            (false, _) => Isa::Portable,
        })
    }

    /// Whether this processor runs these kernels.
    pub fn is_available(self) -> bool {
        self <= Isa::best()
    }

    /// Every kernel set this processor runs, slowest first.
    pub fn available() -> Vec<Isa> {
        [Isa::Portable, Isa::Avx2, Isa::Avx512, Isa::Amx]
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
    is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c")
}

#[cfg(target_arch = "x86_64")]
fn avx512_detected() -> bool {
    is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512dq")
        && is_x86_feature_detected!("avx512vl")
}

#[cfg(target_arch = "x86_64")]
fn amx_detected() -> bool {
    amx::detected()
}

#[cfg(not(target_arch = "x86_64"))]
fn avx2_detected() -> bool {
    false
}

#[cfg(not(target_arch = "x86_64"))]
fn amx_detected() -> bool {
    false
}

#[cfg(not(target_arch = "x86_64"))]
fn avx512_detected() -> bool {
    false
}

thread_local! {
    static SCRATCH: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    static TASK_SCRATCH: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Runs `f` on `len` floats of this thread's scratch space (contents unspecified, starting on a
/// 64-byte line so that vector loads never straddle two), which grows to the largest size asked
/// for and is then reused, so kernels do not allocate per call.
fn with_scratch<R>(len: usize, f: impl FnOnce(&mut [f32]) -> R) -> R {
    SCRATCH.with(|s| aligned_prefix(&mut s.borrow_mut(), len, f))
}

/// As [`with_scratch`], for a pool task: a second buffer, since the thread that starts a job
/// also runs its tasks while it still holds its own scratch.
fn with_task_scratch<R>(len: usize, f: impl FnOnce(&mut [f32]) -> R) -> R {
    TASK_SCRATCH.with(|s| aligned_prefix(&mut s.borrow_mut(), len, f))
}

/// Floats of a line-aligned slice.
const LINE_FLOATS: usize = 16;

fn aligned_prefix<R>(v: &mut Vec<f32>, len: usize, f: impl FnOnce(&mut [f32]) -> R) -> R {
    if v.len() < len + LINE_FLOATS {
        v.resize(len + LINE_FLOATS, 0.0);
    }
    let start = v.as_ptr().align_offset(4 * LINE_FLOATS);
    f(&mut v[start..start + len])
}
