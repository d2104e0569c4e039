//! Which kernel runs a problem on a given GPU, with which tiles, grid and shared memory.
//!
//! [`plan`] is a pure function of the validated [`Problem`] and the device's [`DeviceCaps`], so
//! every per-GPU limit lives here and is unit-tested on the CPU against the opt-in shared-memory
//! limits of sm_80, sm_86/sm_89 and sm_90; the launch code only executes a plan.

use candle::{bail, DType, Result};

use super::instances::{
    DecodeInstance, F32Instance, MmaInstance, Sm90Instance, DECODE_INSTANCES, DECODE_ROWS,
    F32_INSTANCES, F32_ROWS, F32_THREADS, MMA_INSTANCES, ROWWISE_MAX_D, ROWWISE_WARPS,
    SM90_INSTANCES,
};
use crate::problem::{Problem, Strides};

/// What the planner needs to know about a GPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct DeviceCaps {
    /// Compute capability.
    pub major: u32,
    pub minor: u32,
    /// Streaming multiprocessors.
    pub sms: u32,
    /// Largest dynamic plus static shared memory one block may opt into, in bytes.
    pub smem_optin: usize,
    /// Run the sm_90a (wgmma + TMA) kernels where they cover the problem: compute capability
    /// 9.0, unless `CANDLE_FLASH_PORTABLE=1` forces the portable compute_80 path.
    pub hopper: bool,
}

impl DeviceCaps {
    /// A100 class.
    #[cfg(test)]
    pub const SM80: Self = Self::new(8, 0, 108, 166_912);
    /// RTX 30xx, A10, A40.
    #[cfg(test)]
    pub const SM86: Self = Self::new(8, 6, 84, 101_376);
    /// RTX 40xx, L4, L40S.
    #[cfg(test)]
    pub const SM89: Self = Self::new(8, 9, 142, 101_376);
    /// H100, H200.
    #[cfg(test)]
    pub const SM90: Self = Self::new(9, 0, 132, 232_448);

    pub const fn new(major: u32, minor: u32, sms: u32, smem_optin: usize) -> Self {
        Self {
            major,
            minor,
            sms,
            smem_optin,
            hopper: major == 9 && minor == 0,
        }
    }

    /// The same device with the sm_90a kernels off (the portable path).
    pub const fn portable(self) -> Self {
        Self {
            hopper: false,
            ..self
        }
    }
}

/// Shared memory the plan keeps free for the kernels' static `__shared__` values (a few
/// block-uniform pointers); the launch code checks the compiled kernels stay within it.
pub(crate) const STATIC_SMEM_RESERVE: usize = 1024;

/// The PTX module a kernel lives in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Module {
    Bf16,
    F16,
    F32,
    /// The sm_90a module (kernels/sm90/): f16 and bf16 Hopper forward kernels.
    Sm90,
    /// The sm_90a backward module (kernels/sm90/bwd_sm90.cu).
    Sm90Bwd,
}

impl Module {
    /// The module holding the kernels of `dtype`.
    pub fn of(dtype: DType) -> Result<Self> {
        Ok(match dtype {
            DType::BF16 => Self::Bf16,
            DType::F16 => Self::F16,
            DType::F32 => Self::F32,
            dt => bail!("flash-attn: no CUDA kernel for dtype {dt:?}"),
        })
    }
}

/// The kernel family and instance of a plan.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kernel {
    /// Tensor-core tiles (f16/bf16).
    Mma(MmaInstance),
    /// Exact f32 FFMA tiles.
    F32(F32Instance),
    /// One query row per warp, no shared memory: what no tiled instance fits.
    Rowwise,
    /// Split-KV decode with GQA packing (f16/bf16), then a combine kernel when split.
    Decode(DecodeInstance),
    /// Hopper wgmma + TMA tiles (f16/bf16, compute capability 9.0).
    Sm90(Sm90Instance),
}

/// The split-KV geometry of a decode plan.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct DecodeSplit {
    /// Slices of the key range, each its own block; 1 writes the output directly.
    pub splits: usize,
    /// Keys per slice (a whole number of K/V tiles).
    pub split_keys: usize,
    /// 16-row packed tiles per K/V head.
    pub m_tiles: usize,
    /// The combine kernel's entry point (only with `splits > 1`).
    pub combine: Option<String>,
}

/// The decode path is taken when one K/V head has at most this many packed query rows
/// (`heads / kv_heads * seq_q`): beyond it the prefill kernel's 64-128-row tiles are as full.
pub(crate) const DECODE_MAX_ROWS: usize = 4 * DECODE_ROWS;

/// Most key-range splits of one decode call (the combine kernel's limit).
pub(crate) const MAX_SPLITS: usize = 128;

/// Everything the launch code needs to run one forward call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct LaunchPlan {
    pub kernel: Kernel,
    pub module: Module,
    /// The `extern "C"` entry point.
    pub function: String,
    pub grid: (u32, u32, u32),
    pub threads: u32,
    /// Dynamic shared memory per block, in bytes.
    pub smem: usize,
    /// Columns of q/k/v the kernel reads (the tensor-core kernels need a multiple of 8).
    pub d_load: usize,
    /// Blocks that split the V/O columns of one query tile (heads wider than the instance's dv).
    pub dv_splits: usize,
    /// Operands (q, k, v) that must first be packed into a contiguous copy.
    pub pack: [bool; 3],
    /// Split-KV geometry, for [`Kernel::Decode`] plans.
    pub decode: Option<DecodeSplit>,
}

/// Longest sequence the kernels index with `int` diagonals.
pub(crate) const MAX_SEQ: usize = 1 << 30;

/// Picks the kernel and launch geometry of `p` (whose elements have type `dtype`) on `caps`.
pub(crate) fn plan(p: &Problem, dtype: DType, caps: &DeviceCaps) -> Result<LaunchPlan> {
    if caps.major < 8 {
        bail!(
            "flash-attn: the CUDA kernels need compute capability 8.0 or newer (Ampere), this \
             device has {}.{}",
            caps.major,
            caps.minor
        )
    }
    if p.max_seq_q.max(p.max_seq_k) > MAX_SEQ {
        bail!("flash-attn: sequences longer than 2^30 are not supported by the CUDA kernels")
    }
    let d = p.head_dim;
    let fits = |smem: usize| smem + STATIC_SMEM_RESERVE <= caps.smem_optin;
    let (module, prefix) = match dtype {
        DType::BF16 => (Module::Bf16, "flash_fwd_bf16"),
        DType::F16 => (Module::F16, "flash_fwd_f16"),
        DType::F32 => (Module::F32, "flash_fwd_f32"),
        dt => bail!("flash-attn: no CUDA kernel for dtype {dt:?}"),
    };
    let mods = p.score.softcap > 0.0 || p.has_alibi || p.score.scale <= 0.0;
    let group = p.heads / p.kv_heads;
    // Paged caches and prefix ranges are read only by the decode and row-wise kernels.
    let rows_only = p.paged.is_some() || p.prefix.is_some();
    let decode = (dtype != DType::F32 && (rows_only || group * p.max_seq_q <= DECODE_MAX_ROWS))
        .then(|| {
            DECODE_INSTANCES
                .iter()
                .find(|i| i.d >= d.next_multiple_of(8) && fits(i.smem()))
        })
        .flatten();
    let tiled = if let Some(&i) = decode {
        Some(Kernel::Decode(i))
    } else if rows_only {
        None
    } else if dtype == DType::F32 {
        F32_INSTANCES
            .iter()
            .find(|i| i.d >= d && fits(i.smem()))
            .map(|&i| Kernel::F32(i))
    } else {
        let d_load = d.next_multiple_of(8);
        // Hopper: the sm_90a kernels where an instance is wide enough.
        // Measured on an H100 (BENCHMARKS.md, 2026-11-22): d <= 64 causal at seq 512 ran 0.85x
        // the portable kernel through the 192-row tiles (most blocks on the diagonal); the
        // persistent 128-row instance runs it 1.30x the portable kernel (2026-11-23, ~03:20),
        // see sm90_variant_for. Windows (a left bound) were not timed again: such short calls
        // with d <= 64 stay portable.
        let (left, _) = p.window.as_i64();
        let short_banded = d_load <= 64 && left >= 0 && p.max_seq_q <= 512;
        let sm90 = (caps.hopper && !short_banded)
            .then(|| {
                SM90_INSTANCES
                    .iter()
                    .find(|i| i.d >= d_load && i.mods == mods && fits(i.smem()))
            })
            .flatten();
        // The table is ordered by width, each width's default first: the first wide enough
        // instance that fits is the narrowest width with the biggest tiles the device can hold;
        // sm90_variant_for then swaps in the variant measured faster for the problem's shape.
        match sm90 {
            Some(&i) => Some(Kernel::Sm90(sm90_variant_for(p, i, &fits))),
            None => MMA_INSTANCES
                .iter()
                .find(|i| i.d >= d_load && fits(i.smem()))
                .map(|&i| Kernel::Mma(i)),
        }
    };
    let kernel = match tiled {
        Some(k) => k,
        None if d <= ROWWISE_MAX_D => Kernel::Rowwise,
        None => bail!("flash-attn: head_dim {d} is unsupported by the CUDA kernels"),
    };
    let dname = match module {
        Module::Bf16 => "bf16",
        Module::F16 => "f16",
        Module::F32 | Module::Sm90 | Module::Sm90Bwd => "f32",
    };
    let module = match kernel {
        Kernel::Sm90(_) => Module::Sm90,
        _ => module,
    };
    let (rows, threads, smem, d_load, dv_splits, function) = match kernel {
        Kernel::Decode(i) => (
            DECODE_ROWS,
            i.threads(),
            i.smem(),
            d.next_multiple_of(8),
            1,
            format!(
                "flash_decode_{dname}_{}{}",
                i.suffix(),
                if mods { "_mods" } else { "" }
            ),
        ),
        Kernel::Mma(i) => {
            let suffix = if mods { "_mods" } else { "" };
            (
                i.rows(),
                i.threads(),
                i.smem(),
                d.next_multiple_of(8),
                d.div_ceil(i.dv),
                format!("{prefix}_{}{suffix}", i.suffix()),
            )
        }
        Kernel::Sm90(i) => (
            i.rows(),
            i.threads(),
            i.smem(),
            d.next_multiple_of(8),
            1,
            format!("flash_fwd_sm90_{dname}_{}", i.suffix()),
        ),
        Kernel::F32(i) => (
            F32_ROWS,
            F32_THREADS,
            i.smem(),
            d,
            1,
            format!("{prefix}_{}", i.suffix()),
        ),
        Kernel::Rowwise => (
            ROWWISE_WARPS,
            32 * ROWWISE_WARPS,
            0,
            d,
            1,
            format!("flash_rowwise_{dname}"),
        ),
    };
    // Operands the kernel cannot read in place: the tensor-core kernels copy 16-byte chunks of
    // rows; the f32 and row-wise kernels read through any strides.
    // The sm_90a kernels read through tensor maps, which take no zero stride (a broadcast
    // operand): those are packed too.
    let pack = match kernel {
        Kernel::Mma(_) | Kernel::Decode(_) | Kernel::Sm90(_) => {
            let tma = matches!(kernel, Kernel::Sm90(_));
            let (q_rows, k_rows) = p.storage_rows();
            let (q_batch, k_batch) = p.storage_batches();
            let in_place = |s: &Strides, batch: usize, rows: usize, heads: usize| {
                fits_fast_path(p, s, batch, rows, heads)
                    && !(tma && has_zero_stride(s, batch, rows, heads))
            };
            [
                !in_place(&p.q, q_batch, q_rows, p.heads),
                !in_place(&p.k, k_batch, k_rows, p.kv_heads),
                !in_place(&p.v, k_batch, k_rows, p.kv_heads),
            ]
        }
        _ => [false; 3],
    };
    if let Kernel::Decode(i) = kernel {
        return decode_plan(p, caps, i, module, function, smem, d_load, pack, dname);
    }
    let q_tiles = p.max_seq_q.div_ceil(rows) * dv_splits;
    if p.heads > 65535 || p.batch > 65535 || q_tiles > i32::MAX as usize {
        bail!(
            "flash-attn: grid ({q_tiles}, {}, {}) exceeds the CUDA limits (heads and batch <= 65535)",
            p.heads,
            p.batch
        )
    }
    let grid = match kernel {
        Kernel::Sm90(i) if i.persistent => sm90_persistent_grid(p, caps, i)?,
        // Query tiles fastest: the blocks of one (batch, head) run together and share K/V in L2.
        _ => (q_tiles as u32, p.heads as u32, p.batch as u32),
    };
    Ok(LaunchPlan {
        kernel,
        module,
        function,
        grid,
        threads: threads as u32,
        smem,
        d_load,
        dv_splits,
        pack,
        decode: None,
    })
}

/// Grid and key splits of a decode call: enough blocks for about two waves over the SMs, each
/// split at least two K/V tiles long. Fixed for a given shape and device, so results are
/// bitwise reproducible.
#[allow(clippy::too_many_arguments)]
fn decode_plan(
    p: &Problem,
    caps: &DeviceCaps,
    i: DecodeInstance,
    module: Module,
    function: String,
    smem: usize,
    d_load: usize,
    pack: [bool; 3],
    dname: &str,
) -> Result<LaunchPlan> {
    let group = p.heads / p.kv_heads;
    let m_tiles = (group * p.max_seq_q).div_ceil(DECODE_ROWS);
    let (splits, split_keys) = decode_splits(p, caps, i, m_tiles, DECODE_WAVES);
    // A grid the SMs hold at once with a deeper ring too (few sequences: each SM then holds at
    // most two blocks) takes it: two tiles in flight per block instead of one. Measured on the
    // H100 (bf16, d 128, batch 1, kv 32768, 256 blocks): 60 us instead of 61, and a shuffled
    // 16-row paged cache 64 us instead of 68; at batch 8 (320 blocks, more than the 264 the deeper
    // ring leaves room for) it would cost a second wave: 72 us instead of 62 at kv 4096.
    let ctas = splits * p.batch * p.kv_heads * m_tiles;
    let (i, function, smem) = match DECODE_INSTANCES
        .iter()
        .filter(|j| {
            (j.d, j.warps) == (i.d, i.warps)
                && j.stages > i.stages
                && j.smem() + STATIC_SMEM_RESERVE <= caps.smem_optin
                && blocks_per_sm(caps, j.smem()) * caps.sms as usize >= ctas
        })
        .max_by_key(|j| j.stages)
    {
        None => (i, function, smem),
        Some(&j) => {
            let mods = if function.ends_with("_mods") {
                "_mods"
            } else {
                ""
            };
            (
                j,
                format!("flash_decode_{dname}_{}{mods}", j.suffix()),
                j.smem(),
            )
        }
    };
    if p.kv_heads * m_tiles > 65535 || p.batch > 65535 || p.heads > 65535 {
        bail!(
            "flash-attn: decode grid ({splits}, {}, {}) exceeds the CUDA limits",
            p.kv_heads * m_tiles,
            p.batch
        )
    }
    Ok(LaunchPlan {
        kernel: Kernel::Decode(i),
        module,
        function,
        grid: (splits as u32, (p.kv_heads * m_tiles) as u32, p.batch as u32),
        threads: i.threads() as u32,
        smem,
        d_load,
        dv_splits: 1,
        pack,
        decode: Some(DecodeSplit {
            splits,
            split_keys,
            m_tiles,
            combine: (splits > 1).then(|| format!("flash_decode_combine_{dname}")),
        }),
    })
}

/// The grid of a persistent sm_90a instance: one block per SM, at most one per tile.
fn sm90_persistent_grid(
    p: &Problem,
    caps: &DeviceCaps,
    i: Sm90Instance,
) -> Result<(u32, u32, u32)> {
    let tiles = p.max_seq_q.div_ceil(i.rows()) * p.heads * p.batch;
    // The kernel's tile counter runs up to tiles + grid in an `int`.
    if tiles > i32::MAX as usize / 2 {
        bail!("flash-attn: {tiles} query tiles exceed the sm_90a kernels' limit")
    }
    Ok((tiles.clamp(1, caps.sms as usize) as u32, 1, 1))
}

/// The sm_90a variant that runs `p` fastest among the instances of `i`'s width and kind (`i`,
/// the width's default, unless a rule below says otherwise), as measured on an H100 against the
/// one-block-per-tile defaults (BENCHMARKS.md, 2026-11-22 ~10:40 UTC, bf16 and f16, hidden
/// 2048, seq 512 / 2048 / 8192 / 16384):
/// - d 128, causal-shaped masks (keys bounded on the right only: the tiles' key counts fall
///   with the query tile): the persistent longest-first scheduler (`wg2p`), 1.00x to 1.09x;
/// - d 128, no mask: `wg2p` below 8192 keys (1.02x to 1.07x at 512 and 2048), FlashAttention-3's
///   176-key tiles (`wg2n176`) from 8192 on (0.99x to 1.05x; they lose at 512 and 2048);
/// - d 64, causal-shaped, seq_q <= 2048: `wg2p` (128-row tiles, 1.05x at 2048; from 8192 on the
///   192-row default wins; at 512, 1.30x the portable kernel, which ran these calls before:
///   2026-11-23 ~03:20);
/// - d 64, no mask, seq_q <= 512: `wg2p` (1.10x to 1.15x the 192-row default at 512, even at
///   1024, 0.82x to 0.91x from 2048 on: 2026-11-23 ~03:20 and ~03:24).
///
/// Everything else (ALiBi / softcap, windows, longer d 64 calls without a mask) keeps the
/// default. Shorter calls than 512 were not timed; they follow the rules of 512.
fn sm90_variant_for(p: &Problem, i: Sm90Instance, fits: &dyn Fn(usize) -> bool) -> Sm90Instance {
    let (left, right) = p.window.as_i64();
    let causal = left < 0 && right >= 0;
    let unmasked = left < 0 && right < 0;
    let want = match i.d {
        _ if i.mods => return i,
        64 if causal && p.max_seq_q <= 2048 => "wg2p",
        64 if unmasked && p.max_seq_q <= 512 => "wg2p",
        128 if unmasked && p.max_seq_k >= 8192 => "wg2n176",
        128 if causal || unmasked => "wg2p",
        _ => return i,
    };
    SM90_INSTANCES
        .iter()
        .find(|j| (j.d, j.mods) == (i.d, i.mods) && j.variant() == want && fits(j.smem()))
        .copied()
        .unwrap_or(i)
}

/// Bytes of K and V the persistent scheduler lets the tiles in flight share in L2 (H100 and H200
/// hold 50 MB). Measured on an H100 (BENCHMARKS.md, 2026-11-22): with FlashAttention-3's 32 MiB
/// the persistent d 128 kernel ran 0.92x the one-block-per-tile default without a mask at seq
/// 2048 (32 heads' K/V hot); 8 MiB keeps about one wave of tiles' worth, and ran faster than
/// 2 MiB and 32 MiB at d 128 in the same command.
pub(crate) const SM90_L2_KV_BYTES: usize = 8 << 20;

/// The persistent scheduler's group: how many (batch, head) pairs (heads fastest) take their
/// query tiles together, longest first, before the next pairs start. As many as the K and V of
/// their key/value heads fit in `l2_bytes` (normally [`SM90_L2_KV_BYTES`]; consecutive query
/// heads of a GQA group share one), at least one, at most all.
pub(crate) fn sm90_tile_group(p: &Problem, d_load: usize, l2_bytes: usize) -> usize {
    let kv_bytes = 2 * p.max_seq_k.max(1) * d_load.next_multiple_of(64) * 2;
    let group = (l2_bytes / kv_bytes).max(1) * (p.heads / p.kv_heads.max(1)).max(1);
    group.clamp(1, (p.heads * p.batch).max(1))
}

/// Applies [`PlanOverride::sm90_variant`](crate::PlanOverride) and `persistent_blocks` to an
/// sm_90a plan: the instance of the same width and kind whose [`Sm90Instance::variant`] is
/// `variant` (if there is one), and a persistent grid capped at `blocks`. Other plans are left
/// as they are; a variant no instance has is an error.
pub(crate) fn override_sm90(
    plan: &mut LaunchPlan,
    p: &Problem,
    caps: &DeviceCaps,
    variant: Option<&str>,
    blocks: Option<u32>,
) -> Result<()> {
    if let Some(v) = variant {
        if !SM90_INSTANCES.iter().any(|j| j.variant() == v) {
            bail!("flash-attn: plan_override names no sm_90a forward variant {v:?}")
        }
    }
    let Kernel::Sm90(i) = plan.kernel else {
        return Ok(());
    };
    let want = variant.unwrap_or(&i.variant()).to_string();
    let Some(&j) = SM90_INSTANCES
        .iter()
        .find(|j| (j.d, j.mods) == (i.d, i.mods) && j.variant() == want)
    else {
        return Ok(());
    };
    let grid = if j.persistent {
        sm90_persistent_grid(p, caps, j)?
    } else {
        (
            p.max_seq_q.div_ceil(j.rows()) as u32,
            p.heads as u32,
            p.batch as u32,
        )
    };
    let dname = plan
        .function
        .split('_')
        .nth(3)
        .unwrap_or("bf16")
        .to_string();
    plan.kernel = Kernel::Sm90(j);
    plan.threads = j.threads() as u32;
    plan.smem = j.smem();
    plan.function = format!("flash_fwd_sm90_{dname}_{}", j.suffix());
    plan.grid = match (j.persistent, blocks) {
        (true, Some(n)) => (grid.0.min(n.max(1)), 1, 1),
        _ => grid,
    };
    Ok(())
}

/// Applies [`PlanOverride::decode_splits`](crate::PlanOverride) to a decode plan: at most
/// `splits` slices of the key range, each a whole number of key tiles. Other plans are left as they are.
pub(crate) fn override_decode(plan: &mut LaunchPlan, p: &Problem, splits: usize) {
    let Kernel::Decode(i) = plan.kernel else {
        return;
    };
    let dname = match plan.module {
        Module::Bf16 => "bf16",
        Module::F16 => "f16",
        Module::F32 | Module::Sm90 | Module::Sm90Bwd => "f32",
    };
    let Some(d) = plan.decode.as_mut() else {
        return;
    };
    let bc = i.bc();
    let split_keys = p
        .max_seq_k
        .div_ceil(splits.max(1))
        .next_multiple_of(bc)
        .max(bc);
    d.splits = p.max_seq_k.div_ceil(split_keys).max(1);
    d.split_keys = split_keys;
    d.combine = (d.splits > 1).then(|| format!("flash_decode_combine_{dname}"));
    plan.grid.0 = d.splits as u32;
}

/// Blocks of `smem` bytes of dynamic shared memory one SM holds at once. An SM's shared memory is
/// the per-block opt-in limit plus the 1 KB the driver reserves per block (sm_80: 164 KB, sm_86
/// and sm_89: 100 KB, sm_90: 228 KB); each block also takes that 1 KB and its static shared
/// memory (at most [`STATIC_SMEM_RESERVE`]).
pub(crate) fn blocks_per_sm(caps: &DeviceCaps, smem: usize) -> usize {
    (caps.smem_optin + 1024) / (smem + STATIC_SMEM_RESERVE + 1024)
}

/// Blocks per SM a decode call aims for (the split count fills `DECODE_WAVES * sms` blocks).
pub(crate) const DECODE_WAVES: usize = 2;

/// Key splits of a decode call of `m_tiles` packed tiles per K/V head: enough blocks for
/// `waves` blocks per SM, each split at least two K/V tiles long. Returns (splits, keys per
/// split).
pub(crate) fn decode_splits(
    p: &Problem,
    caps: &DeviceCaps,
    i: DecodeInstance,
    m_tiles: usize,
    waves: usize,
) -> (usize, usize) {
    let blocks = p.batch * p.kv_heads * m_tiles;
    let bc = i.bc();
    let want = (waves.max(1) * caps.sms as usize).div_ceil(blocks.max(1));
    let most = p.max_seq_k.div_ceil(2 * bc).clamp(1, MAX_SPLITS);
    let splits = want.clamp(1, most);
    let split_keys = p.max_seq_k.div_ceil(splits).next_multiple_of(bc).max(bc);
    (p.max_seq_k.div_ceil(split_keys).max(1), split_keys)
}

/// Can the tensor-core kernel read this operand in place? It copies 16-byte chunks of rows, so
/// the head dim must be a multiple of 8 with unit stride and every row 16-byte aligned.
fn fits_fast_path(p: &Problem, s: &Strides, batch: usize, rows: usize, heads: usize) -> bool {
    let aligned = |stride: usize, n: usize| n <= 1 || stride.is_multiple_of(8);
    p.head_dim.is_multiple_of(8)
        && (s.dim == 1 || p.head_dim == 1)
        && s.offset.is_multiple_of(8)
        && aligned(s.batch, batch)
        && aligned(s.seq, rows)
        && aligned(s.head, heads)
}

/// Does an axis of more than one element have stride 0 (a broadcast view)?
pub(crate) fn has_zero_stride(s: &Strides, batch: usize, rows: usize, heads: usize) -> bool {
    [(s.batch, batch), (s.seq, rows), (s.head, heads)]
        .iter()
        .any(|&(stride, n)| n > 1 && stride == 0)
}

#[cfg(test)]
mod tests {
    use candle::{Device, Tensor};

    use super::*;
    use crate::op::MAX_HEAD_DIM;
    use crate::FlashAttn;

    const CAPS: [DeviceCaps; 4] = [
        DeviceCaps::SM80,
        DeviceCaps::SM86,
        DeviceCaps::SM89,
        DeviceCaps::SM90,
    ];

    fn problem(d: usize, dtype: DType, opts: &FlashAttn, sq: usize, sk: usize) -> Problem {
        let dev = Device::Cpu;
        let q = Tensor::zeros((2, sq, 4, d), dtype, &dev).unwrap();
        let k = Tensor::zeros((2, sk, 2, d), dtype, &dev).unwrap();
        opts.problem(&q, &k, &k, None).unwrap()
    }

    fn options() -> Vec<FlashAttn> {
        let slopes = Tensor::new(&[0.5f32, 0.25, 0.125, 0.0625], &Device::Cpu).unwrap();
        vec![
            FlashAttn::new(0.1),
            FlashAttn::new(0.1).causal(),
            FlashAttn::new(0.1).window(Some(7), Some(3)),
            FlashAttn::new(0.1).softcap(5.0),
            FlashAttn::new(0.1).alibi(&slopes),
            FlashAttn::new(-0.5),
        ]
    }

    /// Every head dim, dtype and option on every GPU class gets a plan that fits its limit and
    /// covers the head.
    #[test]
    fn every_plan_fits_its_device() {
        for caps in CAPS {
            for dtype in [DType::F32, DType::F16, DType::BF16] {
                for opts in options() {
                    for d in 1..=MAX_HEAD_DIM {
                        let p = problem(d, dtype, &opts, 3, 5);
                        let pl = plan(&p, dtype, &caps).unwrap();
                        let what = format!("{caps:?} {dtype:?} d {d} {opts:?}: {pl:?}");
                        assert!(pl.smem + STATIC_SMEM_RESERVE <= caps.smem_optin, "{what}");
                        assert!(pl.d_load >= d && pl.threads > 0, "{what}");
                        match pl.kernel {
                            Kernel::Mma(i) => {
                                assert_ne!(dtype, DType::F32, "{what}");
                                assert!(i.d >= pl.d_load && pl.d_load.is_multiple_of(8), "{what}");
                                assert!(pl.dv_splits * i.dv >= d, "{what}");
                                assert!((pl.dv_splits - 1) * i.dv < d, "{what}");
                                let mods = opts.softcap.is_some()
                                    || opts.alibi_slopes.is_some()
                                    || opts.softmax_scale <= 0.0;
                                assert_eq!(pl.function.ends_with("_mods"), mods, "{what}");
                            }
                            Kernel::Sm90(i) => {
                                assert!(caps.hopper && dtype != DType::F32, "{what}");
                                assert!(i.d >= pl.d_load && pl.d_load.is_multiple_of(8), "{what}");
                                assert_eq!(pl.module, Module::Sm90, "{what}");
                                assert_eq!(pl.function.ends_with("_mods"), i.mods, "{what}");
                                assert_eq!(pl.threads as usize, i.threads(), "{what}");
                            }
                            Kernel::F32(i) => {
                                assert_eq!(dtype, DType::F32, "{what}");
                                assert!(i.d >= d && pl.dv_splits == 1, "{what}");
                            }
                            Kernel::Rowwise => assert!(d <= ROWWISE_MAX_D, "{what}"),
                            Kernel::Decode(i) => {
                                assert_ne!(dtype, DType::F32, "{what}");
                                assert!(i.d >= pl.d_load && pl.d_load.is_multiple_of(8), "{what}");
                                let s = pl.decode.as_ref().unwrap();
                                assert_eq!(pl.grid, (s.splits as u32, 2, 2), "{what}");
                                assert!(s.splits * s.split_keys >= 5, "{what}");
                                continue;
                            }
                        }
                        if let Kernel::Sm90(_) = pl.kernel {
                            assert_eq!(pl.grid, (8, 1, 1), "{what}");
                            continue;
                        }
                        if matches!(pl.kernel, Kernel::Sm90(i) if i.persistent) {
                            assert_eq!(pl.grid, (8, 1, 1), "{what}");
                            continue;
                        }
                        let rows = pl.grid.0 as usize / pl.dv_splits;
                        assert!(rows * pl_rows(&pl) >= 3, "{what}");
                        assert_eq!((pl.grid.1, pl.grid.2), (4, 2), "{what}");
                    }
                }
            }
        }
    }

    fn pl_rows(pl: &LaunchPlan) -> usize {
        match pl.kernel {
            Kernel::Mma(i) => i.rows(),
            Kernel::Sm90(i) => i.rows(),
            Kernel::F32(_) => F32_ROWS,
            Kernel::Rowwise => ROWWISE_WARPS,
            Kernel::Decode(_) => DECODE_ROWS,
        }
    }

    /// Compute capability 9.0 runs f16/bf16 prefill with head dims up to 256 on the sm_90a
    /// kernels (the `_mods` instances for softcap / ALiBi), everything else, and every call
    /// under `CANDLE_FLASH_PORTABLE`, on the portable path.
    #[test]
    fn hopper_takes_the_sm90_kernels_where_they_cover_the_problem() {
        let dname = |dt| if dt == DType::BF16 { "bf16" } else { "f16" };
        let pick = |d, dtype, opts: &FlashAttn, caps: &DeviceCaps| {
            plan(&problem(d, dtype, opts, 300, 300), dtype, caps).unwrap()
        };
        let plain = FlashAttn::new(0.1);
        for dtype in [DType::BF16, DType::F16] {
            for (d, tile) in [(40, 64), (64, 64), (80, 128), (128, 128)] {
                let pl = pick(d, dtype, &plain, &DeviceCaps::SM90);
                assert!(
                    matches!(pl.kernel, Kernel::Sm90(i) if i.d == tile && !i.mods),
                    "{pl:?}"
                );
                assert_eq!(pl.module, Module::Sm90);
                // Persistent at this length (up to 512 query rows at d 64): one block per tile
                // at this size (3 tiles x 4 heads x 2 batches, fewer than the SMs).
                let q_tiles = 300usize.div_ceil(pl_rows(&pl)) as u32;
                assert!(
                    matches!(pl.kernel, Kernel::Sm90(i) if i.persistent),
                    "{pl:?}"
                );
                assert_eq!(pl.grid, (q_tiles * 8, 1, 1));
                let pl = pick(d, dtype, &plain.clone().softcap(5.0), &DeviceCaps::SM90);
                assert!(matches!(pl.kernel, Kernel::Sm90(i) if i.mods), "{pl:?}");
                assert!(pl.function.ends_with("_mods"), "{pl:?}");
                let mut o = pick(d, dtype, &plain, &DeviceCaps::SM90);
                let caps = DeviceCaps::SM90;
                override_sm90(
                    &mut o,
                    &problem(d, dtype, &plain, 300, 300),
                    &caps,
                    Some("wg2p"),
                    None,
                )
                .unwrap();
                assert!(matches!(o.kernel, Kernel::Sm90(i) if i.persistent), "{o:?}");
                // 3 tiles of 128 rows x 4 heads x 2 batches, fewer than the SMs.
                assert_eq!(o.grid, (24, 1, 1));
                let name = format!("flash_fwd_sm90_{}_d{tile}_wg2p", dname(dtype));
                assert_eq!(o.function, name);
                let pl = pick(d, dtype, &plain, &DeviceCaps::SM90.portable());
                assert!(matches!(pl.kernel, Kernel::Mma(_)), "{pl:?}");
                let pl = pick(d, dtype, &plain, &DeviceCaps::SM80);
                assert!(matches!(pl.kernel, Kernel::Mma(_)), "{pl:?}");
            }
            // 128 < d <= 256: the d 256 tiles (one block per tile; there is no persistent
            // variant, so the override leaves the plan alone).
            for d in [136, 200, 256] {
                let pl = pick(d, dtype, &plain, &DeviceCaps::SM90);
                assert!(
                    matches!(pl.kernel, Kernel::Sm90(i) if i.d == 256 && !i.mods && i.bn == 80),
                    "{pl:?}"
                );
                assert_eq!(
                    pl.function,
                    format!("flash_fwd_sm90_{}_d256_wg2", dname(dtype))
                );
                assert_eq!((pl.grid, pl.smem), ((3, 4, 2), 230_488));
                let pl = pick(d, dtype, &plain.clone().softcap(5.0), &DeviceCaps::SM90);
                assert!(
                    matches!(pl.kernel, Kernel::Sm90(i) if i.d == 256 && i.mods),
                    "{pl:?}"
                );
                let mut o = pick(d, dtype, &plain, &DeviceCaps::SM90);
                let before = o.clone();
                let caps = DeviceCaps::SM90;
                override_sm90(
                    &mut o,
                    &problem(d, dtype, &plain, 300, 300),
                    &caps,
                    Some("wg2p"),
                    None,
                )
                .unwrap();
                assert_eq!(o, before);
                let pl = pick(d, dtype, &plain, &DeviceCaps::SM90.portable());
                assert!(matches!(pl.kernel, Kernel::Mma(_)), "{pl:?}");
            }
            let pl = pick(264, dtype, &plain, &DeviceCaps::SM90);
            assert!(matches!(pl.kernel, Kernel::Mma(_)), "{pl:?}");
        }
        // Short windowed d 64 calls stay portable; short causal ones and longer windowed ones
        // do not. bf16 on sm_90 at other lengths than pick's 300 x 300.
        let bf16_at = |d, opts: &FlashAttn, sq, sk| {
            plan(
                &problem(d, DType::BF16, opts, sq, sk),
                DType::BF16,
                &DeviceCaps::SM90,
            )
            .unwrap()
        };
        let causal = FlashAttn::new(0.1).causal();
        let window = FlashAttn::new(0.1).window(Some(64), Some(0));
        let pl = pick(64, DType::BF16, &window, &DeviceCaps::SM90);
        assert!(matches!(pl.kernel, Kernel::Mma(_)), "{pl:?}");
        let pl = bf16_at(64, &window, 600, 600);
        assert!(matches!(pl.kernel, Kernel::Sm90(_)), "{pl:?}");
        let pl = pick(64, DType::BF16, &causal, &DeviceCaps::SM90);
        assert!(
            matches!(pl.kernel, Kernel::Sm90(i) if i.persistent),
            "{pl:?}"
        );
        assert!(matches!(
            pick(128, DType::BF16, &causal, &DeviceCaps::SM90).kernel,
            Kernel::Sm90(_)
        ));
        let pl = pick(128, DType::F32, &plain, &DeviceCaps::SM90);
        assert!(matches!(pl.kernel, Kernel::F32(_)), "{pl:?}");
        // Decode-sized calls keep the split-KV kernel.
        let pl = bf16_at(128, &plain, 1, 300);
        assert!(matches!(pl.kernel, Kernel::Decode(_)), "{pl:?}");
        // A broadcast K (stride 0 over kv heads) is packed for the tensor maps, which take no
        // zero stride; the portable kernels read it in place.
        let dev = Device::Cpu;
        let q = Tensor::zeros((2, 300, 4, 128), DType::BF16, &dev).unwrap();
        let k = Tensor::zeros((2, 300, 1, 128), DType::BF16, &dev).unwrap();
        let k = k.broadcast_as((2, 300, 2, 128)).unwrap();
        let v = Tensor::zeros((2, 300, 2, 128), DType::BF16, &dev).unwrap();
        let p = plain.problem(&q, &k, &v, None).unwrap();
        let pl = plan(&p, DType::BF16, &DeviceCaps::SM90).unwrap();
        assert!(matches!(pl.kernel, Kernel::Sm90(_)), "{pl:?}");
        assert_eq!(pl.pack, [false, true, false]);
        let pl = plan(&p, DType::BF16, &DeviceCaps::SM80).unwrap();
        assert_eq!(pl.pack, [false, false, false]);
    }

    /// The sm_90a defaults follow the H100 measurements (see `sm90_variant_for`): the persistent
    /// scheduler for d 128 causal calls and unmasked ones below 8192 keys, 176-key tiles for
    /// longer unmasked d 128 calls, the persistent scheduler for d 64 causal calls up to 2048,
    /// the one-block-per-tile defaults elsewhere.
    #[test]
    fn sm90_defaults_follow_the_measurements() {
        let dev = Device::Cpu;
        // The benchmark's shapes: hidden 2048, 16k tokens per batch.
        let pick = |dtype, d: usize, s: usize, opts: &FlashAttn, caps: &DeviceCaps| {
            let q = Tensor::zeros((16384 / s, s, 2048 / d, d), dtype, &dev).unwrap();
            plan(&opts.problem(&q, &q, &q, None).unwrap(), dtype, caps).unwrap()
        };
        let plain = FlashAttn::new(0.1);
        let causal = FlashAttn::new(0.1).causal();
        for dtype in [DType::BF16, DType::F16] {
            let dn = if dtype == DType::BF16 { "bf16" } else { "f16" };
            let f = |d, s, opts: &FlashAttn| pick(dtype, d, s, opts, &DeviceCaps::SM90).function;
            let name = |v: &str| format!("flash_fwd_sm90_{dn}_{v}");
            for (d, s, opts, v) in [
                (128, 512, &causal, "d128_wg2p"),
                (128, 2048, &causal, "d128_wg2p"),
                (128, 16384, &causal, "d128_wg2p"),
                (128, 512, &plain, "d128_wg2p"),
                (128, 2048, &plain, "d128_wg2p"),
                (128, 8192, &plain, "d128_wg2n176"),
                (128, 16384, &plain, "d128_wg2n176"),
                (64, 512, &causal, "d64_wg2p"),
                (64, 2048, &causal, "d64_wg2p"),
                (64, 512, &plain, "d64_wg2p"),
                (64, 1024, &plain, "d64_wg3"),
                (64, 8192, &causal, "d64_wg3"),
                (64, 2048, &plain, "d64_wg3"),
                (64, 16384, &plain, "d64_wg3"),
            ] {
                assert_eq!(f(d, s, opts), name(v), "d {d} seq {s} {opts:?}");
            }
            // The persistent default: one block per SM, two Q buffers; 176-key tiles: one block
            // per tile.
            let pl = pick(dtype, 128, 2048, &causal, &DeviceCaps::SM90);
            assert_eq!((pl.grid, pl.smem), ((132, 1, 1), 230_792));
            let pl = pick(dtype, 128, 8192, &plain, &DeviceCaps::SM90);
            assert_eq!((pl.grid, pl.smem), ((64, 16, 2), 214_104));
            // d 64 windows at seq 512 stay portable; softcap, windows keep the defaults.
            let short_window = FlashAttn::new(0.1).window(Some(64), Some(0));
            assert!(matches!(
                pick(dtype, 64, 512, &short_window, &DeviceCaps::SM90).kernel,
                Kernel::Mma(_)
            ));
            let capped = FlashAttn::new(0.1).causal().softcap(5.0);
            assert_eq!(f(128, 2048, &capped), name("d128_wg2_mods"));
            let window = FlashAttn::new(0.1).window(Some(256), Some(0));
            assert_eq!(f(128, 2048, &window), name("d128_wg2"));
            assert_eq!(f(128, 8192, &window), name("d128_wg2"));
            assert_eq!(f(64, 2048, &window), name("d64_wg3"));
            // The portable path is untouched.
            let pl = pick(dtype, 128, 2048, &causal, &DeviceCaps::SM90.portable());
            assert!(matches!(pl.kernel, Kernel::Mma(_)), "{pl:?}");
        }
    }

    /// The persistent scheduler: its group of (batch, head) pairs keeps the K and V of the tiles
    /// in flight within the L2 budget; `variant:n` caps the persistent grid (tests), and the
    /// 176-key d 128 variant stages O in Q (so it is one block per tile).
    #[test]
    fn sm90_persistent_scheduler_and_variants() {
        let dev = Device::Cpu;
        let mk = |b: usize, s: usize, h: usize, hk: usize, d: usize| {
            let q = Tensor::zeros((b, s, h, d), DType::BF16, &dev).unwrap();
            let k = Tensor::zeros((b, s, hk, d), DType::BF16, &dev).unwrap();
            FlashAttn::new(0.1).problem(&q, &k, &k, None).unwrap()
        };
        let group = |p: &Problem, d| sm90_tile_group(p, d, SM90_L2_KV_BYTES);
        // d 128, seq 2048: 1 MiB of K and V per head, 8 heads in 8 MiB (of 8 x 16 pairs): 128
        // query tiles, about one wave of the H100's 132 SMs. 32 MiB: 32 heads.
        assert_eq!(group(&mk(8, 2048, 16, 16, 128), 128), 8);
        assert_eq!(
            sm90_tile_group(&mk(8, 2048, 16, 16, 128), 128, 32 << 20),
            32
        );
        // seq 8192: 4 MiB per head, 2 pairs; GQA 4:1 shares each K/V head among 4 query heads.
        assert_eq!(group(&mk(2, 8192, 16, 16, 128), 128), 2);
        assert_eq!(group(&mk(2, 8192, 16, 4, 128), 128), 8);
        // Never more than all pairs, never fewer than one (d 40 pads to one 64-column chunk).
        assert_eq!(group(&mk(2, 300, 4, 2, 40), 40), 8);
        assert_eq!(group(&mk(1, 16384, 16, 16, 128), 128), 1);
        assert_eq!(group(&mk(1, 1 << 20, 2, 2, 128), 128), 1);

        let caps = DeviceCaps::SM90;
        let p = mk(8, 2048, 16, 16, 128);
        let base = plan(&p, DType::BF16, &caps).unwrap();
        assert_eq!(base.function, "flash_fwd_sm90_bf16_d128_wg2p");
        let mut o = base.clone();
        override_sm90(&mut o, &p, &caps, Some("wg2"), None).unwrap();
        assert_eq!((o.grid, o.smem), ((16, 16, 8), 197_720));
        let mut o = base.clone();
        override_sm90(&mut o, &p, &caps, Some("wg2p"), None).unwrap();
        assert_eq!(
            (o.grid, o.function.as_str()),
            ((132, 1, 1), "flash_fwd_sm90_bf16_d128_wg2p")
        );
        let mut o = base.clone();
        override_sm90(&mut o, &p, &caps, Some("wg2p"), Some(3)).unwrap();
        assert_eq!(o.grid, (3, 1, 1));
        // A cap on a non-persistent variant leaves its grid alone.
        let mut o = base.clone();
        override_sm90(&mut o, &p, &caps, Some("wg2n176"), Some(3)).unwrap();
        assert_eq!(o.function, "flash_fwd_sm90_bf16_d128_wg2n176");
        assert_eq!((o.grid, o.smem), ((16, 16, 8), 214_104));
        assert!(matches!(o.kernel, Kernel::Sm90(i) if i.o_in_q() && i.variant() == "wg2n176"));
        // No 176-key d 64 instance: the plan stays.
        let p64 = mk(8, 2048, 32, 32, 64);
        let base = plan(&p64, DType::BF16, &caps).unwrap();
        let mut o = base.clone();
        override_sm90(&mut o, &p64, &caps, Some("wg2n176"), None).unwrap();
        assert!(override_sm90(&mut o, &p64, &caps, Some("wg9"), None).is_err());
        assert_eq!(o, base);
        // Persistent instances never stage O in Q (the next tile's Q would overwrite it).
        for i in SM90_INSTANCES {
            assert!(!(i.persistent && i.o_in_q()), "{i:?}");
        }
    }

    /// Few packed rows per K/V head take the split-KV decode kernel, split so that a small batch
    /// still fills the GPU; many rows (or f32) take the prefill kernels.
    #[test]
    fn decode_is_split_to_fill_the_gpu() {
        let dev = Device::Cpu;
        let mk = |b: usize, sq: usize, sk: usize| {
            let q = Tensor::zeros((b, sq, 32, 128), DType::BF16, &dev).unwrap();
            let k = Tensor::zeros((b, sk, 8, 128), DType::BF16, &dev).unwrap();
            FlashAttn::new(0.1)
                .causal()
                .problem(&q, &k, &k, None)
                .unwrap()
        };
        let caps = DeviceCaps::SM90;
        let split = |p: &Problem| plan(p, DType::BF16, &caps).unwrap().decode;
        // batch 1, 32k keys: 8 blocks of one tile of rows, split about 33 ways.
        let s = split(&mk(1, 1, 32768)).unwrap();
        assert_eq!(s.m_tiles, 1);
        assert!((30..=40).contains(&s.splits), "{s:?}");
        assert!(s.splits * s.split_keys >= 32768 && (s.splits - 1) * s.split_keys < 32768);
        assert!(s.combine.is_some());
        // Many sequences fill the GPU alone: no split, no combine pass.
        let s = split(&mk(64, 1, 4096)).unwrap();
        assert_eq!((s.splits, s.combine), (1, None));
        // 16 query rows of 4 heads: 64 packed rows, 4 tiles; 17 rows: the prefill kernel.
        assert_eq!(split(&mk(2, 16, 1000)).unwrap().m_tiles, 4);
        assert!(split(&mk(2, 17, 1000)).is_none());
        // Short caches are not split below two tiles per split.
        let s = split(&mk(1, 1, 100)).unwrap();
        assert_eq!(s.splits, 1);
        // The deeper ring where the SMs hold the whole grid with it: batch 1 on the H100, not
        // batch 8 (320 blocks, 2 x 132 fit), nor the A100 (one such block per SM).
        let stages = |p: &Problem, caps: &DeviceCaps| match plan(p, DType::BF16, caps).unwrap() {
            LaunchPlan {
                kernel: Kernel::Decode(i),
                function,
                smem,
                ..
            } => {
                assert_eq!(function, format!("flash_decode_bf16_{}", i.suffix()));
                assert_eq!(smem, i.smem());
                i.stages
            }
            pl => panic!("{pl:?}"),
        };
        assert_eq!(stages(&mk(1, 1, 32768), &caps), 3);
        assert_eq!(stages(&mk(8, 1, 4096), &caps), 2);
        assert_eq!(stages(&mk(8, 1, 32768), &caps), 2);
        assert_eq!(stages(&mk(1, 1, 32768), &DeviceCaps::SM80), 2);
        assert_eq!(stages(&mk(1, 1, 32768), &DeviceCaps::SM86), 2);
        assert_eq!(blocks_per_sm(&caps, DECODE_INSTANCES[1].smem()), 3);
    }

    /// The split override changes only the split count of a decode plan.
    #[test]
    fn decode_override_resplits() {
        let dev = Device::Cpu;
        let q = Tensor::zeros((1, 1, 32, 128), DType::BF16, &dev).unwrap();
        let k = Tensor::zeros((1, 32768, 8, 128), DType::BF16, &dev).unwrap();
        let p = FlashAttn::new(0.1).problem(&q, &k, &k, None).unwrap();
        let caps = DeviceCaps::SM90;
        let base = plan(&p, DType::BF16, &caps).unwrap();
        let mut pl = base.clone();
        override_decode(&mut pl, &p, 100);
        let s1 = pl.decode.clone().unwrap();
        // Whole key tiles per split: 86 splits of 384 keys.
        assert_eq!((s1.splits, s1.split_keys), (86, 384));
        assert_eq!(pl.grid, (86, base.grid.1, base.grid.2));
        assert_eq!((pl.function, pl.kernel), (base.function, base.kernel));
        let mut one = plan(&p, DType::BF16, &caps).unwrap();
        override_decode(&mut one, &p, 1);
        assert_eq!((one.grid.0, one.decode.unwrap().combine), (1, None));
    }

    /// The big tiles where they fit, smaller ones (not the row-wise fallback) where they do not.
    #[test]
    fn tiles_shrink_on_small_shared_memory() {
        let opts = FlashAttn::new(0.1);
        let pick =
            |d, dtype, caps: &DeviceCaps| plan(&problem(d, dtype, &opts, 64, 64), dtype, caps);
        let k = |d, dtype, caps| pick(d, dtype, caps).unwrap().kernel;
        // d 160 (102,400 bytes with 64-key tiles) takes 32-key tiles on sm_86/sm_89.
        assert!(matches!(k(160, DType::BF16, &DeviceCaps::SM80), Kernel::Mma(i) if i.bc == 64));
        assert!(matches!(k(160, DType::BF16, &DeviceCaps::SM86), Kernel::Mma(i) if i.bc == 32));
        // d 512: 4 warps on sm_80/sm_90, 2 warps of 16-key tiles on sm_89.
        assert!(matches!(k(512, DType::F16, &DeviceCaps::SM80), Kernel::Mma(i) if i.warps == 4));
        assert!(matches!(k(512, DType::F16, &DeviceCaps::SM89), Kernel::Mma(i) if i.warps == 2));
        // f32 d 256 (147,968 bytes): tiled on sm_80/90, row-wise on sm_86.
        assert!(matches!(
            k(256, DType::F32, &DeviceCaps::SM90),
            Kernel::F32(_)
        ));
        assert_eq!(k(256, DType::F32, &DeviceCaps::SM86), Kernel::Rowwise);
        assert!(matches!(
            k(128, DType::F32, &DeviceCaps::SM86),
            Kernel::F32(_)
        ));
        assert_eq!(k(320, DType::F32, &DeviceCaps::SM90), Kernel::Rowwise);
        // Splits of V for wide heads: 320 columns in two blocks of 256.
        assert_eq!(
            pick(320, DType::BF16, &DeviceCaps::SM90).unwrap().dv_splits,
            2
        );
        assert_eq!(
            pick(256, DType::BF16, &DeviceCaps::SM90).unwrap().dv_splits,
            1
        );
    }

    #[test]
    fn old_gpus_get_an_error_naming_their_capability() {
        let p = problem(64, DType::F16, &FlashAttn::new(0.1), 4, 4);
        let err = plan(&p, DType::F16, &DeviceCaps::new(7, 5, 40, 65_536)).unwrap_err();
        assert!(err.to_string().contains("7.5"), "{err}");
    }

    #[test]
    fn strided_operands_are_packed_for_the_tensor_cores() {
        let dev = Device::Cpu;
        let q = Tensor::zeros((1, 8, 2, 64), DType::BF16, &dev).unwrap();
        let k = Tensor::zeros((1, 2, 8, 64), DType::BF16, &dev)
            .unwrap()
            .transpose(1, 2)
            .unwrap();
        let p = FlashAttn::new(0.1).problem(&q, &k, &k, None).unwrap();
        let pl = plan(&p, DType::BF16, &DeviceCaps::SM90).unwrap();
        assert_eq!(pl.pack, [false, false, false]);
        let q33 = Tensor::zeros((1, 8, 2, 33), DType::BF16, &dev).unwrap();
        let p = FlashAttn::new(0.1).problem(&q33, &q33, &q33, None).unwrap();
        let pl = plan(&p, DType::BF16, &DeviceCaps::SM90).unwrap();
        assert_eq!(pl.pack, [true, true, true]);
        assert_eq!(pl.d_load, 40);
    }
}
