//! The CUDA backend: [`plan`](plan::plan) picks a kernel and its launch geometry (a pure
//! function, compiled and unit-tested without the `cuda` feature), `launch` executes the plan on
//! candle's stream. Kernel tile shapes live in one table, `instances.rs`, which `build.rs` also
//! reads to generate the kernels' entry points; the parameter struct is `params.rs`, whose C
//! layout `build.rs` checks against `kernels/common/params.cuh`.

// Without the `cuda` feature only the planner's unit tests use these.
#![cfg_attr(not(feature = "cuda"), allow(dead_code))]

#[cfg(feature = "cuda")]
mod append;
mod instances;
#[cfg(feature = "cuda")]
mod launch;
#[cfg(feature = "cuda")]
mod params;
pub(crate) mod plan;

#[cfg(feature = "cuda")]
pub(crate) use append::append_kv;
#[cfg(feature = "cuda")]
pub(crate) use launch::forward;
mod backward;
#[cfg(feature = "cuda")]
pub(crate) use backward::backward;
