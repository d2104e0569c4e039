// The tensor-core backward instances compiled into the f16/bf16 PTX, in one table.
//
// `build.rs` `include!`s this file to generate `bwd_instances.cuh` (the entry points plus a
// `static_assert` that each kernel's shared memory equals the figure below), and the planner
// (`plan.rs`) picks a row from it and sizes the launches. Plain data and `const fn`s only.

/// One head dim of the f16/bf16 backward: the deterministic dK/dV kernel (a key tile of
/// `16 * kv_warps` keys against `kv_bm`-row query tiles), the dQ kernel (a query tile of
/// `16 * q_warps` rows against `q_bn`-key tiles).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BwdMma {
    pub d: usize,
    pub kv_bm: usize,
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
    /// dK/dV: K and V of the key tile, two stages of Q + dO (2 bytes an element), two stages of
    /// the step's lse and D (f32).
    pub const fn kv_smem(&self) -> usize {
        (2 * self.kv_bn() * self.d + 2 * 2 * self.kv_bm * self.d) * 2 + 2 * 2 * self.kv_bm * 4
    }
    /// [`kv_smem`](Self::kv_smem) of the `_extras` dK/dV kernel (a bias or block mask), whose
    /// query steps are [`EXTRAS_KV_BM`] rows.
    pub const fn kv_smem_extras(&self) -> usize {
        BwdMma {
            kv_bm: EXTRAS_KV_BM,
            ..*self
        }
        .kv_smem()
    }
    /// dQ: Q and dO of the query tile, two stages of K + V.
    pub const fn q_smem(&self) -> usize {
        (2 * self.q_bm() * self.d + 2 * 2 * self.q_bn * self.d) * 2
    }
    /// The most shared memory either of its kernels needs.
    pub const fn max_smem(&self) -> usize {
        if self.kv_smem() > self.q_smem() {
            self.kv_smem()
        } else {
            self.q_smem()
        }
    }
}

/// Query rows per step of the `_extras` dK/dV kernels (calls with a bias or a block mask): their
/// per-score bias and block reads need registers that 48- and 64-row steps leave only by
/// spilling (the bf16 d 128 one spilled 28 bytes).
pub const EXTRAS_KV_BM: usize = 32;

pub const BWD_MMA: &[BwdMma] = &[
    BwdMma {
        d: 64,
        kv_bm: 64,
        kv_warps: 8,
        kv_min_blocks: 1,
        q_bn: 64,
        q_warps: 4,
        q_min_blocks: 1,
    },
    // d 128: 48-row query steps in the deterministic dK/dV kernel (254 registers, no spills on
    // sm_90) and 4-warp blocks, two per SM.
    // H100, bf16, backward TFLOP/s at seq 2048 / 2048 causal / 8192 / 8192 causal, one run:
    // 32 rows, 8 warps 151 / 115 / 171 / 158; 48 rows, 8 warps 152 / 112-116 / 185-186 /
    // 167-169; 48 rows, 4 warps 155-160 / 119-123 / 189-192 / 175-176. d 64 with 4-warp
    // blocks moved within the run's noise (-14% to +2%), so it keeps 8.
    BwdMma {
        d: 128,
        kv_bm: 48,
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

/// One kernel of the Hopper (sm_90a) backward module (kernels/sm90/bwd_sm90.cu, whose
/// `static_assert`s pin the shared memory below): the deterministic dK/dV kernel (128 keys a
/// block against `rows`-row query steps) or the dQ kernel (128 query rows a block against
/// `rows`-key tiles), `stages` deep. Both run 3 warpgroups: a producer and two consumers.
/// Instances are those with no spills (`ptxas -arch=sm_90a -v`): the d 64 dK/dV kernel's `_mods`
/// twin is the one without ping-pong, and the d 128 dK/dV kernel has none (softcap / ALiBi left
/// it 12-16 bytes of spills), so such calls keep the portable kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sm90Bwd {
    /// Entry point after `flash_bwd_sm90_{dtype}_`.
    pub name: &'static str,
    pub d: usize,
    /// Query rows a step (dK/dV) or keys a tile (dQ).
    pub rows: usize,
    pub stages: usize,
    /// The next step's first products are issued before this step's last ones (more registers).
    pub overlap: bool,
    /// The two consumer warpgroups take turns issuing their products (not with `overlap`).
    pub pingpong: bool,
    /// Has a `_mods` twin (softcap, ALiBi). Calls with softcap or ALiBi take the first such
    /// instance when the default has none.
    pub mods: bool,
    /// `CANDLE_FLASH_BWD_SM90_VARIANT` names it (the default is the unnamed one).
    pub variant: &'static str,
}

impl Sm90Bwd {
    pub const THREADS: usize = 384;
    /// The fixed side of a block: keys of a dK/dV block, query rows of a dQ block.
    pub const BLOCK: usize = 128;

    pub const fn dkdv(&self) -> bool {
        self.name.as_bytes()[1] == b'k'
    }

    /// Dynamic shared memory: 1 KB of alignment slack, the block's two fixed tiles (K and V, or
    /// Q and dO), `stages` of the two streamed tiles (plus the step's lse and D for dK/dV),
    /// then the mbarriers (fixed tiles, full and empty per stage, varlen tails).
    pub const fn smem(&self) -> usize {
        let fixed = 2 * Self::BLOCK * self.d * 2;
        let stage = 2 * self.rows * self.d * 2 + if self.dkdv() { 2 * self.rows * 4 } else { 0 };
        1024 + fixed + self.stages * stage + 8 * (2 + 2 * self.stages)
    }
}

// Defaults measured on an H100 (bf16, seq 2048 and 8192, causal or not, three runs): the d 64
// dK/dV kernel with 128-row steps (no overlap) ran 1.09-1.24x the 64-row one with
// overlap; the d 128 pair with three stages and 128-key dQ tiles 1.05-1.16x two stages and
// 64-key tiles; ping-pong ran d 64 1.05-1.12x faster (d 128: 0.96-1.13x over two runs, within
// the noise of seq 2048, where identical kernels differed by up to 15% between runs), and three
// stages d 64 1.01-1.03x.
pub const BWD_SM90: &[Sm90Bwd] = &[
    Sm90Bwd {
        name: "dkdv_d64",
        d: 64,
        rows: 128,
        stages: 3,
        overlap: false,
        pingpong: true,
        mods: false,
        variant: "",
    },
    Sm90Bwd {
        name: "dkdv_d64_nopp",
        d: 64,
        rows: 128,
        stages: 2,
        overlap: false,
        pingpong: false,
        mods: true,
        variant: "nopp",
    },
    Sm90Bwd {
        name: "dkdv_d64_q64",
        d: 64,
        rows: 64,
        stages: 2,
        overlap: true,
        pingpong: false,
        mods: false,
        variant: "q64",
    },
    Sm90Bwd {
        name: "dkdv_d64_s2",
        d: 64,
        rows: 128,
        stages: 2,
        overlap: false,
        pingpong: true,
        mods: false,
        variant: "s2",
    },
    Sm90Bwd {
        name: "dkdv_d128",
        d: 128,
        rows: 64,
        stages: 3,
        overlap: false,
        pingpong: false,
        mods: false,
        variant: "",
    },
    Sm90Bwd {
        name: "dkdv_d128_pp",
        d: 128,
        rows: 64,
        stages: 3,
        overlap: false,
        pingpong: true,
        mods: false,
        variant: "pp",
    },
    Sm90Bwd {
        name: "dkdv_d128_s2",
        d: 128,
        rows: 64,
        stages: 2,
        overlap: false,
        pingpong: false,
        mods: false,
        variant: "s2",
    },
    Sm90Bwd {
        name: "dq_d64",
        d: 64,
        rows: 128,
        stages: 2,
        overlap: false,
        pingpong: true,
        mods: true,
        variant: "",
    },
    Sm90Bwd {
        name: "dq_d64_overlap",
        d: 64,
        rows: 128,
        stages: 2,
        overlap: true,
        pingpong: false,
        mods: false,
        variant: "nopp",
    },
    Sm90Bwd {
        name: "dq_d128",
        d: 128,
        rows: 128,
        stages: 2,
        overlap: false,
        pingpong: false,
        mods: false,
        variant: "",
    },
    Sm90Bwd {
        name: "dq_d128_pp",
        d: 128,
        rows: 128,
        stages: 2,
        overlap: false,
        pingpong: true,
        mods: false,
        variant: "pp",
    },
    Sm90Bwd {
        name: "dq_d128_k64",
        d: 128,
        rows: 64,
        stages: 2,
        overlap: true,
        pingpong: false,
        mods: false,
        variant: "k64",
    },
];
