//! [`PlanOverride`]: forcing a choice the planners make on their own.

use crate::CpuMatmul;

/// Choices the planners make on their own from the device and the problem, forced instead: for
/// benchmarks that compare kernel variants in one process, and for tests that must reach every
/// kernel on one machine. Results agree with the planner's own choice within rounding; only the
/// speed differs. A field naming a variant that does not apply to a call (another head dim,
/// another backend) leaves that call's plan as it is; a name that no kernel has is an error.
///
/// ```
/// use candle_flash::{FlashAttn, PlanOverride};
/// // The persistent Hopper forward on three blocks, so each block takes many tiles.
/// let opts = FlashAttn::new(0.125).causal().plan_override(PlanOverride {
///     sm90_variant: Some("wg2p".into()),
///     persistent_blocks: Some(3),
///     ..PlanOverride::default()
/// });
/// assert!(opts.plan_override.is_some());
/// ```
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PlanOverride {
    /// Hopper forward: the instance of this variant for the call's head dim (`wg3`: three
    /// consumer warpgroups; `wg2`: two; `wg2p`: two, persistent; `wg2n176`: 176-key tiles).
    pub sm90_variant: Option<String>,
    /// Hopper forward, persistent instances: at most this many blocks, each taking many tiles.
    pub persistent_blocks: Option<u32>,
    /// Hopper forward: the output written by the threads instead of bulk tensor stores
    /// (compute-sanitizer's initcheck does not count the copy engine's writes).
    pub thread_stores: bool,
    /// Hopper backward: the instances of these names where they apply (dK/dV and dQ).
    pub bwd_sm90_variants: Vec<String>,
    /// Split-KV decode: at most this many key splits (whole key tiles each) instead of the
    /// planner's count.
    pub decode_splits: Option<usize>,
    /// Split-KV decode: the instance of this shape for the call's head dim instead of the
    /// planner's pick, named `r<row tiles>_k<key warps>_c<key tile>_s<stages>` (`r1_k2_c32_s2`:
    /// one 16-row tile, two warps sharing each 32-key tile, two stages; a `_wg` suffix names
    /// the warpgroup-MMA ones of sm_90a; all are listed in `src/cuda/instances.rs`).
    pub decode_instance: Option<String>,
    /// CPU prefill and backward: the arithmetic of the tile products (see [`CpuMatmul`]); one
    /// the CPU does not have makes the call fail.
    pub cpu_matmul: Option<CpuMatmul>,
}
