// The tensor-core backward instances compiled into the f16/bf16 PTX, in one table.
//
// `build.rs` `include!`s this file to generate `bwd_instances.cuh` (the entry points plus a
// `static_assert` that each kernel's shared memory equals the figure below), and the planner
// (`plan.rs`) picks a row from it and sizes the launches. Plain data and `const fn`s only.

/// One head dim of the f16/bf16 backward: the fused dK/dV/dQ kernel (8 warps, a key tile of
/// `bn` keys against `bm`-row query tiles).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BwdMma {
    pub d: usize,
    pub bm: usize,
    pub bn: usize,
    pub min_blocks: usize,
}

impl BwdMma {
    /// Threads of the fused kernel (8 warps).
    pub const THREADS: usize = 256;
    /// K and V of the key tile, two stages of Q + dO, P^T and dS^T (2 bytes an element), two
    /// stages of the step's lse and D (f32).
    pub const fn smem(&self) -> usize {
        (2 * self.bn * self.d + 2 * 2 * self.bm * self.d + 2 * self.bn * self.bm) * 2
            + 2 * 2 * self.bm * 4
    }
}

/// FlashAttention-2's tiles for these head dims (`kBlockM` x `kBlockN` of its sm80 backward
/// traits: 128 x 128 at d 64, 64 x 128 at d 128), one 8-warp block per SM.
pub const BWD_MMA: &[BwdMma] = &[
    BwdMma {
        d: 64,
        bm: 128,
        bn: 128,
        min_blocks: 1,
    },
    BwdMma {
        d: 128,
        bm: 64,
        bn: 128,
        min_blocks: 1,
    },
];

/// Warps (one row or key each) per block of the exact kernels (`GENERIC_WARPS` in
/// kernels/backward/generic.cuh), and the per-lane column counts they are instantiated for.
pub const BWD_GENERIC_WARPS: usize = 4;
pub const BWD_GENERIC_NT: &[usize] = &[2, 4, 8, 16];
