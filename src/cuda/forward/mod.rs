//! The prefill forward pass: the tiled kernels (Hopper wgmma + TMA, tensor-core mma.sync, exact
//! f32, row-wise), planned by [`plan`] and run by `launch`.

#[cfg(feature = "cuda")]
pub(crate) mod launch;
pub(crate) mod plan;
