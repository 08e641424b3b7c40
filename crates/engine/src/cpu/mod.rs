//! CPU kernels: AVX2+FMA where the processor has them (checked at run time), portable code
//! everywhere else.

pub mod dense;
pub mod qmatmul;
