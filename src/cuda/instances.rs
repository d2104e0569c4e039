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

/// One instance of the split-KV decode kernel (`kernels/decode/partial.cuh`): `16 * rg` packed
/// query rows per block, `rg * kg` warps (warp (r, k) takes row tile r and the k-th `bc / kg`
/// keys of every K/V tile), `bc` keys per tile, a `stages`-deep cp.async ring; `wg`: the tile
/// products by warpgroup MMA (sm_90a, `kernels/decode/decode_sm90.cu`; four warps per 64 rows).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DecodeInstance {
    pub d: usize,
    pub rg: usize,
    pub kg: usize,
    pub bc: usize,
    pub stages: usize,
    pub wg: bool,
    /// Bytes of K and V one block streams per microsecond where the memory is not the limit:
    /// its warps' issue and latency bound (a block's warps wait on their own tile products,
    /// which no formula of the tile shape predicted well). Measured on an H100 with
    /// `decode_bench --instances` at split counts 1 to 64 over 83 shapes, fitted together with
    /// the planner's wave and merge costs (`src/cuda/decode/plan.rs`).
    pub rate: usize,
}

impl DecodeInstance {
    /// Packed query rows per block.
    pub const fn rows(&self) -> usize {
        16 * self.rg
    }
    pub const fn threads(&self) -> usize {
        32 * self.rg * self.kg
    }
    /// The Q tile plus `stages` K and V tiles, 2-byte elements, plus the side arrays (and, for
    /// `wg`, 1024 bytes to start the tiles on a swizzle atom).
    pub const fn smem(&self) -> usize {
        (self.rows() * self.d + self.stages * 2 * self.bc * self.d) * 2
            + self.side()
            + if self.wg { 1024 } else { 0 }
    }
    /// The key loop's block-table entries and staged key bias (two tiles of each, 4 bytes a
    /// key), in dynamic shared memory for tiles wider than 64 keys (`Traits::SIDE` of
    /// `kernels/decode/partial.cuh`): as static arrays they would outgrow the 1 KB the planner
    /// reserves (`STATIC_SMEM_RESERVE`).
    pub const fn side(&self) -> usize {
        if self.bc > 64 {
            2 * 2 * self.bc * 4
        } else {
            0
        }
    }
    /// The FP8-cache twin (`kernels/decode/decode_fp8.cu`): the Q tile, `stages` K and V tiles of
    /// one-byte elements and, with more than one row tile, the f16 pair each tile is converted
    /// into (one row tile converts in registers).
    pub const fn smem_kv8(&self) -> usize {
        let work = if self.rg == 1 {
            0
        } else {
            2 * self.bc * self.d * 2
        };
        self.rows() * self.d * 2 + self.stages * 2 * self.bc * self.d + work + self.side()
    }
    pub fn suffix(&self) -> String {
        format!("d{}_{}", self.d, self.name())
    }
    /// The tile shape without the width, as `PlanOverride::decode_instance` names it.
    pub fn name(&self) -> String {
        let wg = if self.wg { "_wg" } else { "" };
        format!(
            "r{}_k{}_c{}_s{}{wg}",
            self.rg, self.kg, self.bc, self.stages
        )
    }
}

const fn dec(
    d: usize,
    rg: usize,
    kg: usize,
    bc: usize,
    stages: usize,
    rate: usize,
) -> DecodeInstance {
    DecodeInstance {
        d,
        rg,
        kg,
        bc,
        stages,
        wg: false,
        rate,
    }
}

/// A warpgroup-MMA instance (`DecodeInstance::wg`): one K/V tile per step for all its rows.
const fn wg(d: usize, rg: usize, bc: usize, stages: usize, rate: usize) -> DecodeInstance {
    DecodeInstance {
        wg: true,
        ..dec(d, rg, 1, bc, stages, rate)
    }
}

/// Decode instances by width and row tiles. One row tile (up to 16 packed rows) splits each key
/// tile over four warps; more rows give each warp its own row tile and whole key tiles (4 row
/// tiles, or 8 with 8 warps; 16-key tiles at d 256, whose 128 O registers a thread leave no room
/// for more scores on sm_80). Each comes deep (two or three tiles in flight while one is
/// computed) and shallow (one in flight), for GPUs whose shared memory holds only the shallow
/// one (sm_86/sm_89 hold 100 KB a block; there d 256 takes two warps of 32-key tiles). The
/// planner picks among those that fit by its cost model, whatever their row tiles: several
/// row blocks of a narrow instance may beat one block of a wide one.
/// With one row tile, 128-key tiles (32 keys a warp) halve the per-key share of each tile's
/// barrier, waits and softmax bookkeeping, on which a lone block per SM spends most of its
/// issue slots (its warps wait on no memory); their rates were fitted on an H200 (100 shapes of
/// the sweep's bf16 rows, every instance at 1 to 32 splits) so that the planner's choices come
/// closest to the fastest measured.
/// The warpgroup-MMA instances (`wg`, sm_90a; the planner gives them the calls of more than 16
/// packed rows): 128 rows at d 128 in 128-key tiles, the widest whose two stages fit beside Q,
/// and 64 or 128 rows at d 256 in 64-key tiles; their rates are one block's pace measured on an
/// H200 (bf16; 128 packed rows, or 32 for the 64-row one).
pub const DECODE_INSTANCES: &[DecodeInstance] = &[
    dec(64, 1, 4, 128, 4, 40_000),
    dec(64, 1, 4, 64, 4, 30_800),
    dec(64, 1, 4, 64, 2, 25_100),
    dec(64, 4, 1, 64, 4, 16_100),
    dec(64, 4, 1, 64, 2, 16_700),
    dec(64, 8, 1, 64, 4, 13_000),
    dec(64, 8, 1, 64, 2, 14_900),
    dec(128, 1, 4, 128, 3, 55_000),
    dec(128, 1, 4, 64, 3, 40_200),
    dec(128, 1, 4, 64, 2, 33_000),
    dec(128, 4, 1, 64, 3, 23_100),
    dec(128, 4, 1, 64, 2, 22_500),
    dec(128, 8, 1, 32, 4, 20_300),
    dec(128, 8, 1, 32, 2, 17_200),
    dec(256, 1, 4, 64, 3, 46_600),
    dec(256, 1, 4, 64, 2, 41_500),
    dec(256, 1, 2, 32, 2, 34_400),
    dec(256, 4, 1, 16, 4, 15_700),
    dec(256, 4, 1, 16, 2, 15_700),
    dec(256, 8, 1, 16, 3, 13_200),
    dec(256, 8, 1, 16, 2, 12_700),
    wg(128, 8, 128, 2, 22_000),
    wg(256, 4, 64, 2, 32_000),
    wg(256, 8, 64, 2, 25_000),
];

/// One instance of the Hopper forward kernel (`kernels/sm90/fwd.cuh`, sm_90a): a producer
/// warpgroup that streams Q, K and V through the tensor copy engine, and `nwg` consumer
/// warpgroups of 64 query rows each running wgmma.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sm90Instance {
    /// Head dim of the tiles (inputs up to it are zero-padded by the tensor copies).
    pub d: usize,
    /// Consumer warpgroups, 64 query rows each.
    pub nwg: usize,
    /// Keys per K/V tile.
    pub bn: usize,
    /// Depth of the K/V ring.
    pub stages: usize,
    /// Consumer warpgroups take turns issuing their GEMMs, so one's softmax runs under
    /// another's matrix products.
    pub pingpong: bool,
    /// Persistent: one block per SM (at most one per tile) takes tiles from the dynamic,
    /// longest-first scheduler (a per-call tile counter).
    pub persistent: bool,
    /// The `_mods` entry (softcap / ALiBi / non-positive scale; also a bias and block mask).
    pub mods: bool,
    /// The `_blocks` entry: the plain kernel that also walks a block mask's key-tile lists and
    /// adds a bias (calls with those and no `mods`).
    pub blocks: bool,
}

impl Sm90Instance {
    /// The entry point's suffix, after `flash_fwd_sm90_{dtype}_`.
    pub fn suffix(&self) -> String {
        let kind = match (self.mods, self.blocks) {
            (true, _) => "_mods",
            (false, true) => "_blocks",
            (false, false) => "",
        };
        format!("d{}_{}{kind}", self.d, self.variant())
    }
    /// Warpgroups, persistence and (above 128) the key tile, as
    /// [`PlanOverride::sm90_variant`](crate::PlanOverride) names them: `wg2`, `wg2p`, `wg2n176`.
    pub fn variant(&self) -> String {
        let p = if self.persistent { "p" } else { "" };
        match self.bn > 128 {
            true => format!("wg{}{p}n{}", self.nwg, self.bn),
            false => format!("wg{}{p}", self.nwg),
        }
    }
    pub const fn rows(&self) -> usize {
        64 * self.nwg
    }
    /// One producer warpgroup plus the consumers.
    pub const fn threads(&self) -> usize {
        128 * (self.nwg + 1)
    }
    /// Heads wider than 128, and key tiles wider than 128, stage the output in Q's buffer
    /// (`Traits::O_IN_Q`): a separate tile does not fit beside their K and V rings. Such
    /// instances cannot be persistent (the next tile's Q would overwrite the output).
    pub const fn o_in_q(&self) -> bool {
        self.d > 128 || self.bn > 128
    }
    /// Q tiles in shared memory: persistent instances load the next tile's Q into a second
    /// buffer while the key loop of this one runs.
    pub const fn q_buffers(&self) -> usize {
        if self.persistent {
            2
        } else {
            1
        }
    }
    /// Dynamic shared memory: alignment slack, the Q buffers, the K and V rings, the output
    /// staging tile (unless it is Q's), the key-bias buffers (`mods` and `blocks` instances: two
    /// of `bn` f32 per consumer warpgroup, one above d 128), the mbarriers and, persistent, the
    /// scheduler's three tile slots of 80 bytes (`Traits::SMEM` in kernels/sm90/fwd_traits.cuh,
    /// which the generated entry points check against this).
    pub const fn smem(&self) -> usize {
        let tile = self.rows() * self.d * 2;
        let qb = self.q_buffers();
        let slots = if self.persistent { 3 } else { 0 };
        let bias_bufs = match (self.mods || self.blocks, self.d > 128) {
            (false, _) => 0,
            (true, false) => 2,
            (true, true) => 1,
        };
        1024 + qb * tile
            + if self.o_in_q() { 0 } else { tile }
            + self.nwg * bias_bufs * self.bn * 4
            + 2 * self.stages * self.bn * self.d * 2
            + 8 * (4 * self.stages + 1 + 2 * qb + 2 * slots)
            + 80 * slots
    }
}

impl Sm90Instance {
    /// The FP8 (e4m3) instance's dynamic shared memory: one-byte Q, K and V tiles (V
    /// transposed), a bf16 output staging tile of its own (a Q tile is half its size), the
    /// mbarriers (`Traits` with `FP8` in kernels/sm90/fwd_traits.cuh, which the generated entry
    /// points check against this).
    pub const fn smem_fp8(&self) -> usize {
        let qb = self.q_buffers();
        let slots = if self.persistent { 3 } else { 0 };
        1024 + qb * self.rows() * self.d
            + self.rows() * self.d * 2
            + 2 * self.stages * self.bn * self.d
            + 8 * (4 * self.stages + 1 + 2 * qb + 2 * slots)
            + 80 * slots
    }
}

/// Instance kinds: the plain kernel, `_mods` and `_blocks`.
const PLAIN: (bool, bool) = (false, false);
const MODS: (bool, bool) = (true, false);
const BLOCKS: (bool, bool) = (false, true);

const fn sm90(
    d: usize,
    nwg: usize,
    bn: usize,
    persistent: bool,
    kind: (bool, bool),
) -> Sm90Instance {
    Sm90Instance {
        d,
        nwg,
        bn,
        stages: 2,
        // The persistent d 64 instance's two warpgroups issue their GEMMs as they are ready:
        // with its short tiles, ping-pong ran no faster.
        pingpong: !(persistent && d == 64),
        persistent,
        mods: kind.0,
        blocks: kind.1,
    }
}

/// The sm_90a instances, narrowest first; the first of a width and kind is the default, the
/// others are variants the planner swaps in by shape (`sm90_variant_for` in the forward plan).
/// d 64: three consumer warpgroups (192 rows), or two, persistent; d 128: two warpgroups (128
/// rows), as FlashAttention-3 starts from, persistent, or with FlashAttention-3's 176-key tiles
/// for long unmasked calls; d 256: 80-key tiles in two stages (FlashAttention-3's shape; O
/// staged in Q). Softcap / ALiBi (`mods`) and block masks or a bias without them (`blocks`)
/// take two warpgroups, not persistent: more live registers, which spilled in the persistent and
/// three-warpgroup forms.
pub const SM90_INSTANCES: [Sm90Instance; 12] = [
    sm90(64, 3, 128, false, PLAIN),
    sm90(64, 2, 128, true, PLAIN),
    sm90(64, 2, 128, false, MODS),
    sm90(64, 2, 128, false, BLOCKS),
    sm90(128, 2, 128, false, PLAIN),
    sm90(128, 2, 128, true, PLAIN),
    sm90(128, 2, 176, false, PLAIN),
    sm90(128, 2, 128, false, MODS),
    sm90(128, 2, 128, false, BLOCKS),
    sm90(256, 2, 80, false, PLAIN),
    sm90(256, 2, 80, false, MODS),
    sm90(256, 2, 80, false, BLOCKS),
];

/// The sm_90a FP8 forward instances (e4m3 Q, K and V, bf16 output; `flash_fwd_sm90_e4m3_*`):
/// plain arithmetic over dense calls, whose V the launch transposes first (8-bit wgmma reads
/// both operands K-major). d 128: two warpgroups of 64 rows and 128-key tiles, as the bf16
/// default, one tile per block and persistent (`wg2p`). (d 256 at 128-key tiles needs more
/// registers than a consumer warpgroup has: ptxas spilled and serialised its wgmma.)
pub const SM90_FP8_INSTANCES: [Sm90Instance; 2] = [
    sm90(128, 2, 128, false, PLAIN),
    sm90(128, 2, 128, true, PLAIN),
];
