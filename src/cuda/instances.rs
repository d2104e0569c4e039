// The kernel instances compiled into the PTX, in one table.
//
// This file is the single source of truth for tile shapes: `build.rs` `include!`s it to generate
// `instances.cuh` (the `extern "C"` entry points plus a `static_assert` that each instance's
// shared-memory size, as the kernel computes it, equals `smem()` below), and the planner
// (`src/cuda/plan.rs`) uses the same rows to pick an instance and size its launch. Plain data and
// `const fn`s only, so that it compiles in both places.

/// One instance of the f16/bf16 tensor-core forward kernel (`kernels/forward/flash_mma.cuh`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MmaInstance {
    /// Head dim of Q and K as stored in shared memory (inputs are zero-padded up to it).
    pub d: usize,
    /// Columns of V and O one block computes; `d / dv` blocks split wider heads by columns.
    pub dv: usize,
    /// 16-row mma slices per warp.
    pub mt: usize,
    /// Keys per K/V tile (Bc).
    pub bc: usize,
    pub warps: usize,
    /// Depth of the cp.async K/V ring.
    pub stages: usize,
    /// `__launch_bounds__` minimum blocks per SM.
    pub min_blocks: usize,
}

impl MmaInstance {
    /// Query rows per block (Br).
    pub const fn rows(&self) -> usize {
        16 * self.mt * self.warps
    }
    pub const fn threads(&self) -> usize {
        32 * self.warps
    }
    /// Dynamic shared memory: the Q tile plus `stages` K (d wide) and V (dv wide) tiles, 2 bytes
    /// per element.
    pub const fn smem(&self) -> usize {
        (self.rows() * self.d + self.stages * self.bc * (self.d + self.dv)) * 2
    }
    /// The entry point's name, without the dtype prefix.
    pub fn suffix(&self) -> String {
        format!(
            "d{}_v{}_m{}_c{}_w{}_s{}",
            self.d, self.dv, self.mt, self.bc, self.warps, self.stages
        )
    }
}

const fn mma(d: usize, dv: usize, mt: usize, bc: usize, warps: usize) -> MmaInstance {
    MmaInstance {
        d,
        dv,
        mt,
        bc,
        warps,
        stages: 2,
        min_blocks: 2,
    }
}

/// Tensor-core instances, in the order the planner tries them: for each head dim the fastest
/// tiles first, then smaller ones for GPUs with less shared memory per block (sm_86/sm_89 allow
/// 101,376 bytes). Up to d 128 warps take 32 rows, so each K/V fragment read from shared memory
/// feeds two mmas; from d 160 the O accumulator of 32 rows would not fit in registers, so warps
/// take 16. Heads wider than 256 keep Q and K whole (the scores need every column) and split V
/// and O into 256-column halves computed by separate blocks. Measured on the H100 at d 128 (bf16,
/// seq 8192 / 16384, non-causal): 32-key tiles 318 / 327 TFLOP/s, 64-key tiles 325 / 339 but with
/// ~70 bytes of register spills, 8 warps of 16 rows 264 at 8192: 32-key tiles were kept.
pub const MMA_INSTANCES: &[MmaInstance] = &[
    mma(32, 32, 2, 64, 4),
    mma(64, 64, 2, 64, 4),
    mma(96, 96, 2, 32, 4),
    mma(128, 128, 2, 32, 4),
    mma(160, 160, 1, 64, 4),
    mma(160, 160, 1, 32, 4),
    mma(192, 192, 1, 32, 4),
    mma(224, 224, 1, 32, 4),
    mma(256, 256, 1, 32, 4),
    mma(512, 256, 1, 32, 4),
    mma(512, 256, 1, 16, 2),
];

/// One instance of the exact f32 forward kernel (`kernels/forward/flash_f32.cuh`): 64 query rows
/// of 256 threads, `bc` keys per tile.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct F32Instance {
    pub d: usize,
    pub bc: usize,
}

/// Query rows per block of the f32 kernel.
pub const F32_ROWS: usize = 64;
pub const F32_THREADS: usize = 256;

impl F32Instance {
    /// Qᵀ `[d][rows + 4]`, Kᵀ `[d][bc + 4]`, V `[bc][d]`, Pᵀ `[bc][rows + 4]`, 4-byte elements.
    pub const fn smem(&self) -> usize {
        let (lq, lk) = (F32_ROWS + 4, self.bc + 4);
        (self.d * lq + self.d * lk + self.bc * self.d + self.bc * lq) * 4
    }
    pub fn suffix(&self) -> String {
        format!("d{}_c{}", self.d, self.bc)
    }
}

pub const F32_INSTANCES: &[F32Instance] = &[
    F32Instance { d: 64, bc: 64 },
    F32Instance { d: 128, bc: 32 },
    F32Instance { d: 256, bc: 32 },
];

/// The row-per-warp kernel (`kernels/forward/flash_rowwise.cuh`): every head dim up to this, any
/// dtype, no shared memory. It serves what the tiled kernels cannot fit on a device.
pub const ROWWISE_MAX_D: usize = 512;
/// Query rows (one per warp) per block of the row-wise kernel.
pub const ROWWISE_WARPS: usize = 4;

/// One instance of the split-KV decode kernel (`kernels/decode/split_kv.cuh`): 16 packed query
/// rows per block, `16 * warps` keys per K/V tile, a `stages`-deep cp.async ring.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DecodeInstance {
    pub d: usize,
    pub warps: usize,
    pub stages: usize,
}

/// Packed query rows (query heads of one K/V head times their query rows) per decode block.
pub const DECODE_ROWS: usize = 16;

impl DecodeInstance {
    /// Keys per K/V tile (Bc): 16 per warp.
    pub const fn bc(&self) -> usize {
        16 * self.warps
    }
    pub const fn threads(&self) -> usize {
        32 * self.warps
    }
    /// The Q tile plus `stages` K and V tiles, 2-byte elements.
    pub const fn smem(&self) -> usize {
        (DECODE_ROWS * self.d + self.stages * 2 * self.bc() * self.d) * 2
    }
    pub fn suffix(&self) -> String {
        format!("d{}_w{}_s{}", self.d, self.warps, self.stages)
    }
}

/// Decode instances, ordered by width, the fastest tiles of a width first (the planner takes the
/// first that is wide enough and fits the device).
pub const DECODE_INSTANCES: &[DecodeInstance] = &[
    DecodeInstance {
        d: 64,
        warps: 4,
        stages: 3,
    },
    DecodeInstance {
        d: 128,
        warps: 4,
        stages: 2,
    },
    // Two tiles in flight per block, but two blocks per H100 SM instead of three: the planner
    // switches to it when the SMs hold the whole grid with it (few sequences; plan.rs).
    DecodeInstance {
        d: 128,
        warps: 4,
        stages: 3,
    },
    DecodeInstance {
        d: 256,
        warps: 4,
        stages: 2,
    },
    DecodeInstance {
        d: 256,
        warps: 2,
        stages: 2,
    },
];
