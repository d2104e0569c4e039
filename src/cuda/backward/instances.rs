// The tensor-core backward instances compiled into the f16/bf16 PTX, in one table.
//
// `build.rs` `include!`s this file to generate `bwd_instances.cuh` (the entry points plus a
// `static_assert` that each kernel's shared memory equals the figure below), and the planner
// (`plan.rs`) picks a row from it and sizes the launches. Plain data and `const fn`s only.

/// One head dim of the f16/bf16 backward: the dK/dV kernel (a key tile of `16 * kv_warps`
/// keys against `kv_bm`-row query tiles, `kv_bm_atomic` rows in the atomic-dQ variant, whose dS
/// tile and dQ product cost registers) and the dQ kernel (a query tile of `16 * q_warps` rows
/// against `q_bn`-key tiles).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BwdMma {
    pub d: usize,
    pub kv_bm: usize,
    pub kv_bm_atomic: usize,
    pub kv_warps: usize,
    pub kv_min_blocks: usize,
    pub q_bn: usize,
    pub q_warps: usize,
    pub q_min_blocks: usize,
}

impl BwdMma {
    /// Keys per dK/dV block.
    pub const fn kv_bn(&self) -> usize {
        16 * self.kv_warps
    }
    /// Query rows per dQ block.
    pub const fn q_bm(&self) -> usize {
        16 * self.q_warps
    }
    /// dK/dV with `bm`-row query steps: K and V of the key tile, two stages of Q + dO (2 bytes
    /// an element), two stages of the step's lse and D (f32).
    const fn kv_smem_for(&self, bm: usize) -> usize {
        (2 * self.kv_bn() * self.d + 2 * 2 * bm * self.d) * 2 + 2 * 2 * bm * 4
    }
    /// The deterministic dK/dV kernel.
    pub const fn kv_smem(&self) -> usize {
        self.kv_smem_for(self.kv_bm)
    }
    /// The atomic-dQ dK/dV kernel also stages dS (`kv_bm_atomic x kv_bn`, 2 bytes an element).
    pub const fn kv_smem_atomic(&self) -> usize {
        self.kv_smem_for(self.kv_bm_atomic) + self.kv_bm_atomic * self.kv_bn() * 2
    }
    /// dQ: Q and dO of the query tile, two stages of K + V.
    pub const fn q_smem(&self) -> usize {
        (2 * self.q_bm() * self.d + 2 * 2 * self.q_bn * self.d) * 2
    }
}

pub const BWD_MMA: &[BwdMma] = &[
    BwdMma {
        d: 64,
        kv_bm: 64,
        kv_bm_atomic: 64,
        kv_warps: 8,
        kv_min_blocks: 1,
        q_bn: 64,
        q_warps: 4,
        q_min_blocks: 1,
    },
    // d 128: 48-row query steps in the deterministic dK/dV kernel (254 registers, no spills on
    // sm_90; the atomic variant keeps 32, 48 spills there) and 4-warp blocks, two per SM.
    // H100, bf16, backward TFLOP/s at seq 2048 / 2048 causal / 8192 / 8192 causal, one run:
    // 32 rows, 8 warps 151 / 115 / 171 / 158; 48 rows, 8 warps 152 / 112-116 / 185-186 /
    // 167-169; 48 rows, 4 warps 155-160 / 119-123 / 189-192 / 175-176. d 64 with 4-warp
    // blocks moved within the run's noise (-14% to +2%), so it keeps 8.
    BwdMma {
        d: 128,
        kv_bm: 48,
        kv_bm_atomic: 32,
        kv_warps: 4,
        kv_min_blocks: 2,
        q_bn: 64,
        q_warps: 4,
        q_min_blocks: 1,
    },
];

/// Warps (one row or key each) per block of the exact kernels (`GENERIC_WARPS` in
/// kernels/backward/generic.cuh), and the per-lane column counts they are instantiated for.
pub const BWD_GENERIC_WARPS: usize = 4;
pub const BWD_GENERIC_NT: &[usize] = &[2, 4, 8, 16];
