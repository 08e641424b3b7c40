//! Prints the CUDA C source that NVRTC compiles (the shared constants, then `cuda/kernels/*.cu`
//! in their order), for tools that compile it themselves, such as `benches/gpu/ptxas_report.py`.
//!
//! usage: cargo run --release -p oxlm-engine --example kernel_source [-- --traced]

fn main() {
    let traced = std::env::args().any(|a| a == "--traced");
    print!("{}", oxlm_engine::cuda::kernel_source(traced));
}
