//! The CUDA backward pass: gradients of q, k and v from the saved log-sum-exp.
//!
//! [`plan`](plan::plan) picks the kernels (on Hopper the sm_90a wgmma + TMA pair, elsewhere
//! `mma.sync` tensor cores, for f16/bf16 at head dims 64 and 128; exact f32-arithmetic kernels for
//! everything else) and sizes their launches; `launch` runs the D pass (rowsum(dO ∘ O)), the dK/dV
//! pass and the dQ pass. Every pass writes each element once in a fixed order: the backward is
//! deterministic (bitwise identical runs).

pub(crate) mod instances;
#[cfg(feature = "cuda")]
mod launch;
pub(crate) mod plan;

#[cfg(feature = "cuda")]
pub(crate) use launch::{backward, Saved};
