//! Which prefill kernel runs a problem on a given GPU, with which tiles, grid and shared memory:
//! a pure function of the validated [`Problem`] and the [`DeviceCaps`], unit-tested without a
//! GPU against four GPU classes. Decode-shaped calls (few query rows per K/V head) are planned
//! by `decode::plan` first; what it declines comes here.

use candle::{bail, DType, Result};

use crate::cuda::device::DeviceCaps;
use crate::cuda::instances::{
    F32Instance, MmaInstance, Sm90Instance, F32_INSTANCES, F32_ROWS, F32_THREADS, MMA_INSTANCES,
    ROWWISE_MAX_D, ROWWISE_WARPS, SM90_FP8_INSTANCES, SM90_INSTANCES,
};
use crate::cuda::launch::{dtype_name, to_u32, Launch, Module, MAX_SEQ};
use crate::cuda::operands::pack_flags;
use crate::problem::Problem;

/// The kernel family and instance of a plan.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kernel {
    /// Tensor-core tiles (f16/bf16, mma.sync).
    Mma(MmaInstance),
    /// Exact f32 FFMA tiles.
    F32(F32Instance),
    /// One query row per warp, no shared memory: what no tiled instance fits, paged caches and
    /// prefix ranges the decode kernel does not take.
    Rowwise,
    /// Hopper wgmma + TMA tiles (f16/bf16, compute capability 9.0).
    Sm90(Sm90Instance),
}

/// How the Hopper forward's epilogue writes O (`O_STORE_*` in kernels/sm90/fwd.cuh).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum OStore {
    /// 16-byte stores by the threads.
    Threads = 0,
    /// Bulk tensor stores through a dense (column, head, row, batch) map.
    Tma = 1,
    /// Bulk tensor stores through a map of the packed varlen rows.
    TmaPacked = 2,
}

/// A prefill forward plan.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Plan {
    pub kernel: Kernel,
    pub launch: Launch,
    /// Columns of q/k/v the kernel reads (the tensor-core kernels need a multiple of 8).
    pub d_load: usize,
    /// Blocks that split the V/O columns of one query tile (heads wider than the instance's dv).
    pub dv_splits: usize,
    /// Operands (q, k, v) that must first be packed into a contiguous copy.
    pub pack: [bool; 3],
    /// Hopper: the persistent scheduler's group of (batch, head) pairs and how O is stored.
    pub sm90: Option<(usize, OStore)>,
}

impl Plan {
    /// Query rows and keys per tile of a tiled kernel (what a block mask's tile lists are built
    /// for); `None` for the row-wise kernel.
    pub fn tile(&self) -> Option<(usize, usize)> {
        match self.kernel {
            Kernel::Mma(i) => Some((i.rows(), i.bc)),
            Kernel::F32(i) => Some((F32_ROWS, i.bc)),
            Kernel::Sm90(i) => Some((i.rows(), i.bn)),
            Kernel::Rowwise => None,
        }
    }
}

/// Picks the prefill kernel and launch geometry of `p` (elements of type `dtype`) on `caps`,
/// then applies the problem's [`PlanOverride`](crate::PlanOverride).
pub(crate) fn plan(p: &Problem, dtype: DType, caps: &DeviceCaps) -> Result<Plan> {
    check_device(p, caps)?;
    let d = p.head_dim;
    // Softcap, ALiBi, a scale that is not positive, a bias and a block mask take the `_mods`
    // instances, which apply them in the score registers and read the block mask's tile lists;
    // on Hopper a bias or block mask alone takes the `_blocks` ones, the plain kernel with both.
    let extras = p.bias.is_some() || p.block_mask.is_some();
    let math = p.score.softcap > 0.0 || p.has_alibi || p.score.scale <= 0.0;
    let mods = math || extras;
    let kernel = pick_kernel(p, dtype, caps, (math, extras && !math))?;
    let dn = dtype_name(dtype)?;
    let suffix = if mods { "_mods" } else { "" };
    let (module, rows, threads, smem, d_load, dv_splits, function) = match kernel {
        Kernel::Mma(i) => (
            Module::of(dtype)?,
            i.rows(),
            i.threads(),
            i.smem(),
            d.next_multiple_of(8),
            d.div_ceil(i.dv),
            format!("flash_fwd_{dn}_{}{suffix}", i.suffix()),
        ),
        Kernel::Sm90(i) => (
            Module::Sm90,
            i.rows(),
            i.threads(),
            i.smem(),
            d.next_multiple_of(8),
            1,
            format!("flash_fwd_sm90_{dn}_{}", i.suffix()),
        ),
        Kernel::F32(i) => (
            Module::F32,
            F32_ROWS,
            F32_THREADS,
            i.smem(),
            d,
            1,
            format!("flash_fwd_f32_{}", i.suffix()),
        ),
        Kernel::Rowwise => (
            Module::of(dtype)?,
            ROWWISE_WARPS,
            32 * ROWWISE_WARPS,
            0,
            d,
            1,
            format!("flash_rowwise_{dn}"),
        ),
    };
    let pack = match kernel {
        // The tensor-core kernels copy 16-byte chunks of rows; the tensor maps take no zero
        // stride. The f32 and row-wise kernels read through any strides.
        Kernel::Mma(_) => pack_flags(p, false),
        Kernel::Sm90(_) => pack_flags(p, true),
        Kernel::F32(_) | Kernel::Rowwise => [false; 3],
    };
    let q_tiles = p.max_seq_q.div_ceil(rows) * dv_splits;
    if p.heads > 65535 || p.batch > 65535 {
        bail!(
            "flash-attn: grid ({q_tiles}, {}, {}) exceeds the CUDA limits (heads and batch <= \
             65535)",
            p.heads,
            p.batch
        )
    }
    let grid = match kernel {
        Kernel::Sm90(i) if i.persistent => sm90_persistent_grid(p, caps, i)?,
        // Query tiles fastest: the blocks of one (batch, head) run together and share K/V in L2.
        _ => (
            to_u32(q_tiles, "query tiles")?,
            p.heads as u32,
            p.batch as u32,
        ),
    };
    let sm90 = match kernel {
        Kernel::Sm90(i) => Some((sm90_tile_group(p, d_load, SM90_L2_KV_BYTES), o_store(p, i))),
        _ => None,
    };
    let mut plan = Plan {
        kernel,
        launch: Launch {
            module,
            function,
            grid,
            threads: threads as u32,
            smem,
        },
        d_load,
        dv_splits,
        pack,
        sm90,
    };
    let o = &p.kernels.overrides;
    override_sm90(
        &mut plan,
        p,
        caps,
        o.sm90_variant.as_deref(),
        o.persistent_blocks,
    )?;
    Ok(plan)
}

/// The plan of an FP8 call (e4m3 q, k and v) on the sm_90a FP8 forward
/// ([`SM90_FP8_INSTANCES`]), or `None` where that kernel does not take it (the caller then
/// dequantizes): Hopper, a dense call (no varlen, paged cache or prefix ranges) with plain
/// arithmetic (no softcap, ALiBi, bias or block mask; masks, windows, GQA and sinks are taken),
/// a head dim that is a multiple of 16 up to an instance's, and rows the tensor copies can read
/// in place (16-byte aligned, no broadcast axis: FP8 operands are never packed).
pub(crate) fn plan_fp8(p: &Problem, caps: &DeviceCaps) -> Result<Option<Plan>> {
    check_device(p, caps)?;
    let d = p.head_dim;
    let plain = p.score.softcap <= 0.0 && !p.has_alibi && p.score.scale > 0.0;
    let dense = p.varlen.is_none() && p.paged.is_none() && p.prefix.is_none();
    let extras = p.bias.is_some() || p.block_mask.is_some();
    if !caps.hopper || !plain || !dense || extras || !d.is_multiple_of(16) {
        return Ok(None);
    }
    // Narrower heads run zero-padded in the d 128 tiles: at d 64 that took 0.34-0.97x the time
    // of converting the inputs to bf16 for the bf16 kernel up to 8192 keys, and at 16384 0.91x
    // causal, 1.08x without a mask (H200).
    let Some(&i) = SM90_FP8_INSTANCES
        .iter()
        .find(|i| i.d >= d && caps.fits(i.smem_fp8()))
    else {
        return Ok(None);
    };
    let i = fp8_variant(p, i, caps);
    let (q_batch, k_batch) = p.storage_batches();
    let (q_rows, k_rows) = p.storage_rows();
    let in_place = |s: &crate::problem::Strides, batch: usize, rows: usize, heads: usize| {
        let aligned = |stride: usize, n: usize| n <= 1 || stride.is_multiple_of(16);
        s.dim == 1
            && s.offset.is_multiple_of(16)
            && aligned(s.batch, batch)
            && aligned(s.seq, rows)
            && aligned(s.head, heads)
            && !crate::cuda::operands::has_zero_stride(s, batch, rows, heads)
    };
    if !in_place(&p.q, q_batch, q_rows, p.heads)
        || !in_place(&p.k, k_batch, k_rows, p.kv_heads)
        || !in_place(&p.v, k_batch, k_rows, p.kv_heads)
    {
        return Ok(None);
    }
    if p.heads > 65535 || p.batch > 65535 {
        return Ok(None);
    }
    let grid = sm90_grid(p, caps, i)?;
    Ok(Some(Plan {
        kernel: Kernel::Sm90(i),
        launch: Launch {
            module: Module::Sm90,
            function: format!("flash_fwd_sm90_e4m3_{}", i.suffix()),
            grid,
            threads: i.threads() as u32,
            smem: i.smem_fp8(),
        },
        d_load: d,
        dv_splits: 1,
        pack: [false; 3],
        // The threads store O (also in the persistent instance: no bf16 output map).
        sm90: Some((sm90_tile_group(p, d, SM90_L2_KV_BYTES), OStore::Threads)),
    }))
}

/// The FP8 instance of `i`'s width that runs `p`: the variant
/// [`PlanOverride::sm90_variant`](crate::PlanOverride) names where FP8 has it; else, for
/// causal-shaped masks and unmasked calls below [`FP8_PERSISTENT_MAX_KEYS`] keys, the persistent
/// `wg2p`; else `i` (one tile per block).
fn fp8_variant(p: &Problem, i: Sm90Instance, caps: &DeviceCaps) -> Sm90Instance {
    let (left, _) = p.window.as_i64();
    let want = match &p.kernels.overrides.sm90_variant {
        Some(v) => v.clone(),
        None if left < 0 && p.max_seq_k < FP8_PERSISTENT_MAX_KEYS => "wg2p".into(),
        None => return i,
    };
    SM90_FP8_INSTANCES
        .iter()
        .find(|j| j.d == i.d && j.variant() == want && caps.fits(j.smem_fp8()))
        .copied()
        .unwrap_or(i)
}

/// The FP8 forward takes its persistent variant below this many keys: there the tiles are few
/// per (batch, head) and the scheduler's refills win (d 128 on an H200: 1.03-1.16x at 512 and
/// 2048 keys, causal or not); from 8192 on one tile per block ran 1.00-1.08x faster.
const FP8_PERSISTENT_MAX_KEYS: usize = 8192;

/// The compute capability and sequence lengths the kernels take.
pub(crate) fn check_device(p: &Problem, caps: &DeviceCaps) -> Result<()> {
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
    Ok(())
}

/// The tiled kernel for `p`: the sm_90a kernels on Hopper where an instance is wide enough, the
/// tensor-core (f16/bf16) or f32 tiles that fit the device's shared memory, else the row-wise
/// kernel. Paged caches and prefix ranges only the row-wise kernel reads (the decode kernel
/// takes them first where it can).
/// `kind`: the sm_90a instance kind, ([`Sm90Instance::mods`], [`Sm90Instance::blocks`]).
fn pick_kernel(p: &Problem, dtype: DType, caps: &DeviceCaps, kind: (bool, bool)) -> Result<Kernel> {
    let d = p.head_dim;
    let rows_only = p.paged.is_some() || p.prefix.is_some();
    let tiled = if rows_only {
        None
    } else if dtype == DType::F32 {
        F32_INSTANCES
            .iter()
            .find(|i| i.d >= d && caps.fits(i.smem()))
            .map(|&i| Kernel::F32(i))
    } else {
        let d_load = d.next_multiple_of(8);
        // Short d <= 64 calls under a window mostly run diagonal tiles, which the 192-row Hopper
        // tiles handle worse than the portable kernel's 128-row ones (0.85x at seq 512).
        let (left, _) = p.window.as_i64();
        let short_banded = d_load <= 64 && left >= 0 && p.max_seq_q <= 512;
        let sm90 = (caps.hopper && !short_banded)
            .then(|| {
                SM90_INSTANCES
                    .iter()
                    .find(|i| i.d >= d_load && (i.mods, i.blocks) == kind && caps.fits(i.smem()))
            })
            .flatten();
        // The tables are ordered by width, each width's default first: the first wide enough
        // instance that fits is the narrowest width with the biggest tiles the device holds.
        match sm90 {
            Some(&i) => Some(Kernel::Sm90(sm90_variant_for(p, i, caps))),
            None => MMA_INSTANCES
                .iter()
                .find(|i| i.d >= d_load && caps.fits(i.smem()))
                .map(|&i| Kernel::Mma(i)),
        }
    };
    match tiled {
        Some(k) => Ok(k),
        None if d <= ROWWISE_MAX_D => Ok(Kernel::Rowwise),
        None => bail!("flash-attn: head_dim {d} is unsupported by the CUDA kernels"),
    }
}

/// The grid of sm_90a instance `i`: persistent, one block per SM (at most one per tile), else
/// one block per query tile (query tiles fastest).
fn sm90_grid(p: &Problem, caps: &DeviceCaps, i: Sm90Instance) -> Result<(u32, u32, u32)> {
    match i.persistent {
        true => sm90_persistent_grid(p, caps, i),
        false => Ok((
            to_u32(p.max_seq_q.div_ceil(i.rows()), "query tiles")?,
            p.heads as u32,
            p.batch as u32,
        )),
    }
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
/// the width's default, unless a rule below says otherwise):
/// - d 128, causal-shaped masks (keys bounded on the right only, so the tiles' work falls with
///   the query tile): the persistent longest-first scheduler (`wg2p`), which refills an SM as
///   soon as a short tile ends (1.00x to 1.09x the default on an H100);
/// - d 128, no mask: `wg2p` below 8192 keys (1.02x to 1.07x at 512 and 2048, where one tile per
///   block leaves the last wave short), FlashAttention-3's 176-key tiles (`wg2n176`) from 8192
///   on (fewer barrier rounds per key; 0.99x to 1.05x there, slower on short rows);
/// - d 64, causal-shaped, seq_q <= 2048: `wg2p` (its 128-row tiles balance better than the
///   192-row default until the sequences are long: 1.05x at 2048, slower from 8192 on);
/// - d 64, no mask, seq_q <= 512: `wg2p` (1.10x to 1.15x at 512, 0.82x to 0.91x from 2048 on,
///   where the 192-row tiles' fewer K/V passes win).
///
/// Everything else (ALiBi / softcap, windows, longer d 64 calls without a mask) keeps the
/// default.
fn sm90_variant_for(p: &Problem, i: Sm90Instance, caps: &DeviceCaps) -> Sm90Instance {
    let (left, right) = p.window.as_i64();
    let causal = left < 0 && right >= 0;
    let unmasked = left < 0 && right < 0;
    let want = match i.d {
        _ if i.mods || i.blocks => return i,
        64 if causal && p.max_seq_q <= 2048 => "wg2p",
        64 if unmasked && p.max_seq_q <= 512 => "wg2p",
        128 if unmasked && p.max_seq_k >= 8192 => "wg2n176",
        128 if causal || unmasked => "wg2p",
        _ => return i,
    };
    SM90_INSTANCES
        .iter()
        .find(|j| {
            (j.d, j.mods, j.blocks) == (i.d, i.mods, i.blocks)
                && j.variant() == want
                && caps.fits(j.smem())
        })
        .copied()
        .unwrap_or(i)
}

/// Bytes of K and V the persistent scheduler lets the tiles in flight share in L2: about one
/// wave of d 128 tiles' worth. FlashAttention-3's 32 MiB ran 0.92x at seq 2048 without a mask
/// (the tiles of 32 heads evicting each other), 2 MiB also lost to 8 MiB.
pub(crate) const SM90_L2_KV_BYTES: usize = 8 << 20;

/// The persistent scheduler's group: how many (batch, head) pairs (heads fastest) take their
/// query tiles together, longest first, before the next pairs start. As many as the K and V of
/// their key/value heads fit in `l2_bytes` (consecutive query heads of a GQA group share one),
/// at least one, at most all.
pub(crate) fn sm90_tile_group(p: &Problem, d_load: usize, l2_bytes: usize) -> usize {
    let kv_bytes = 2 * p.max_seq_k.max(1) * d_load.next_multiple_of(64) * 2;
    let group = (l2_bytes / kv_bytes).max(1) * (p.heads / p.kv_heads.max(1)).max(1);
    group.clamp(1, (p.heads * p.batch).max(1))
}

/// How an sm_90a instance writes O: persistent instances by bulk tensor stores of 64-row boxes
/// (per batch where every sequence holds seq_q rows, else as one packed run), whose rows need
/// 16-byte strides; the others, and other widths, by the threads.
fn o_store(p: &Problem, i: Sm90Instance) -> OStore {
    let uniform_q = p.varlen.as_ref().is_none_or(|vl| vl.uniform_q());
    let bulk = i.persistent
        && p.head_dim.is_multiple_of(8)
        && p.total_q > 0
        && !p.kernels.overrides.thread_stores;
    match (bulk, uniform_q) {
        (false, _) => OStore::Threads,
        (true, true) => OStore::Tma,
        (true, false) => OStore::TmaPacked,
    }
}

/// Applies [`PlanOverride::sm90_variant`](crate::PlanOverride) and `persistent_blocks` to an
/// sm_90a plan: the instance of the same width and kind whose [`Sm90Instance::variant`] is
/// `variant` (if there is one), and a persistent grid capped at `blocks`. Other plans are left
/// as they are; a variant no instance has is an error.
fn override_sm90(
    plan: &mut Plan,
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
    let want = variant.map_or_else(|| i.variant(), str::to_string);
    let Some(&j) = SM90_INSTANCES
        .iter()
        .find(|j| (j.d, j.mods, j.blocks) == (i.d, i.mods, i.blocks) && j.variant() == want)
    else {
        return Ok(());
    };
    let grid = sm90_grid(p, caps, j)?;
    let dn = plan.launch.function.split('_').nth(3).unwrap_or("bf16");
    plan.launch.function = format!("flash_fwd_sm90_{dn}_{}", j.suffix());
    plan.kernel = Kernel::Sm90(j);
    plan.launch.threads = j.threads() as u32;
    plan.launch.smem = j.smem();
    plan.launch.grid = match (j.persistent, blocks) {
        (true, Some(n)) => (grid.0.min(n.max(1)), 1, 1),
        _ => grid,
    };
    plan.sm90 = Some((
        sm90_tile_group(p, plan.d_load, SM90_L2_KV_BYTES),
        o_store(p, j),
    ));
    Ok(())
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

    /// FP8 calls take the sm_90a FP8 forward on Hopper where it covers them (dense, plain
    /// arithmetic, head dims that are multiples of 16 up to 128, any mask), nowhere else; the
    /// persistent variant below 8192 keys without a window.
    #[test]
    fn fp8_calls_take_the_fp8_forward_where_it_covers_them() {
        for caps in CAPS {
            for d in [16, 40, 64, 80, 96, 112, 120, 128, 136, 256] {
                for (n, opts) in options().iter().enumerate() {
                    let p = problem(d, DType::F32, opts, 300, 517);
                    let pl = plan_fp8(&p, &caps).unwrap();
                    let plain = n < 3;
                    let want = caps.hopper && plain && d % 16 == 0 && d <= 128;
                    assert_eq!(pl.is_some(), want, "d {d} option {n} on {caps:?}");
                    if let Some(pl) = pl {
                        // No mask and causal (517 keys): the persistent variant, one block per
                        // tile up to the SMs; a window: one block per tile.
                        let (name, grid) = match n {
                            0 | 1 => ("wg2p", (3 * 4 * 2, 1, 1)),
                            _ => ("wg2", (3, 4, 2)),
                        };
                        let f = format!("flash_fwd_sm90_e4m3_d128_{name}");
                        assert_eq!(pl.launch.function, f, "option {n}");
                        assert!(crate::cuda::launch::defined(&pl.launch));
                        assert!(caps.fits(pl.launch.smem), "{pl:?}");
                        assert_eq!(pl.launch.grid, grid, "{pl:?}");
                        assert_eq!(pl.pack, [false; 3]);
                        // From 8192 keys: one tile per block.
                        let long = plan_fp8(&problem(d, DType::F32, opts, 300, 8192), &caps);
                        let f = long.unwrap().unwrap().launch.function;
                        assert_eq!(f, "flash_fwd_sm90_e4m3_d128_wg2", "option {n}");
                        // An override names either variant.
                        for v in ["wg2", "wg2p"] {
                            let o = opts.clone().plan_override(crate::PlanOverride {
                                sm90_variant: Some(v.into()),
                                ..Default::default()
                            });
                            let p = problem(d, DType::F32, &o, 300, 517);
                            let pl = plan_fp8(&p, &caps).unwrap().unwrap();
                            let f = format!("flash_fwd_sm90_e4m3_d128_{v}");
                            assert_eq!(pl.launch.function, f);
                            assert!(crate::cuda::launch::defined(&pl.launch));
                        }
                    }
                }
            }
        }
        // A bias takes the dequantized path.
        let bias = Tensor::zeros((2, 1, 1, 517), DType::F32, &Device::Cpu).unwrap();
        let p = problem(128, DType::F32, &FlashAttn::new(0.1).bias(&bias), 300, 517);
        assert!(plan_fp8(&p, &DeviceCaps::SM90).unwrap().is_none());
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
                        assert!(
                            pl.launch.smem + crate::cuda::device::STATIC_SMEM_RESERVE
                                <= caps.smem_optin,
                            "{what}"
                        );
                        assert!(pl.d_load >= d && pl.launch.threads > 0, "{what}");
                        assert!(crate::cuda::launch::defined(&pl.launch), "{what}");
                        match pl.kernel {
                            Kernel::Mma(i) => {
                                assert_ne!(dtype, DType::F32, "{what}");
                                assert!(i.d >= pl.d_load && pl.d_load.is_multiple_of(8), "{what}");
                                assert!(pl.dv_splits * i.dv >= d, "{what}");
                                assert!((pl.dv_splits - 1) * i.dv < d, "{what}");
                                let mods = opts.softcap.is_some()
                                    || opts.alibi_slopes.is_some()
                                    || opts.softmax_scale <= 0.0;
                                assert_eq!(pl.launch.function.ends_with("_mods"), mods, "{what}");
                            }
                            Kernel::Sm90(i) => {
                                assert!(caps.hopper && dtype != DType::F32, "{what}");
                                assert!(i.d >= pl.d_load && pl.d_load.is_multiple_of(8), "{what}");
                                assert_eq!(pl.launch.module, Module::Sm90, "{what}");
                                assert_eq!(pl.launch.function.ends_with("_mods"), i.mods, "{what}");
                                assert_eq!(pl.launch.threads as usize, i.threads(), "{what}");
                            }
                            Kernel::F32(i) => {
                                assert_eq!(dtype, DType::F32, "{what}");
                                assert!(i.d >= d && pl.dv_splits == 1, "{what}");
                            }
                            Kernel::Rowwise => assert!(d <= ROWWISE_MAX_D, "{what}"),
                        }
                        if matches!(pl.kernel, Kernel::Sm90(i) if i.persistent) {
                            assert_eq!(pl.launch.grid, (8, 1, 1), "{what}");
                            continue;
                        }
                        let rows = pl.launch.grid.0 as usize / pl.dv_splits;
                        assert!(rows * pl_rows(&pl) >= 3, "{what}");
                        assert_eq!((pl.launch.grid.1, pl.launch.grid.2), (4, 2), "{what}");
                    }
                }
            }
        }
    }

    fn pl_rows(pl: &Plan) -> usize {
        match pl.kernel {
            Kernel::Mma(i) => i.rows(),
            Kernel::Sm90(i) => i.rows(),
            Kernel::F32(_) => F32_ROWS,
            Kernel::Rowwise => ROWWISE_WARPS,
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
                assert_eq!(pl.launch.module, Module::Sm90);
                // Persistent at this length (up to 512 query rows at d 64): one block per tile
                // at this size (3 tiles x 4 heads x 2 batches, fewer than the SMs).
                let q_tiles = 300usize.div_ceil(pl_rows(&pl)) as u32;
                assert!(
                    matches!(pl.kernel, Kernel::Sm90(i) if i.persistent),
                    "{pl:?}"
                );
                assert_eq!(pl.launch.grid, (q_tiles * 8, 1, 1));
                let pl = pick(d, dtype, &plain.clone().softcap(5.0), &DeviceCaps::SM90);
                assert!(matches!(pl.kernel, Kernel::Sm90(i) if i.mods), "{pl:?}");
                assert!(pl.launch.function.ends_with("_mods"), "{pl:?}");
                // A bias or block mask alone: the `_blocks` twin; with softcap, `_mods`; on the
                // portable kernels, `_mods` (and every plan tiles the block mask's lists).
                let pad = Tensor::zeros((2, 1, 1, 300), DType::F32, &Device::Cpu).unwrap();
                let blocks = Tensor::ones((1, 1, 3, 3), DType::U8, &Device::Cpu).unwrap();
                for opts in [
                    plain.clone().bias(&pad),
                    plain.clone().block_mask(&blocks, 128, 128),
                ] {
                    let pl = pick(d, dtype, &opts, &DeviceCaps::SM90);
                    assert!(
                        matches!(pl.kernel, Kernel::Sm90(i) if i.blocks && !i.mods),
                        "{pl:?}"
                    );
                    assert!(pl.launch.function.ends_with("_blocks"), "{pl:?}");
                    assert_eq!(pl.tile(), Some((128, 128)), "{pl:?}");
                    let pl = pick(d, dtype, &opts.clone().softcap(5.0), &DeviceCaps::SM90);
                    assert!(pl.launch.function.ends_with("_mods"), "{pl:?}");
                    let pl = pick(d, dtype, &opts, &DeviceCaps::SM80);
                    assert!(
                        matches!(pl.kernel, Kernel::Mma(_))
                            && pl.launch.function.ends_with("_mods"),
                        "{pl:?}"
                    );
                }
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
                assert_eq!(o.launch.grid, (24, 1, 1));
                let name = format!("flash_fwd_sm90_{}_d{tile}_wg2p", dname(dtype));
                assert_eq!(o.launch.function, name);
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
                    pl.launch.function,
                    format!("flash_fwd_sm90_{}_d256_wg2", dname(dtype))
                );
                assert_eq!((pl.launch.grid, pl.launch.smem), ((3, 4, 2), 230_488));
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
    }

    /// Short windowed d 64 calls stay portable, short causal ones and longer windowed ones do
    /// not; f32 keeps its kernel; a broadcast K is packed for the tensor maps.
    #[test]
    fn hopper_windows_f32_and_broadcast_k() {
        let pick = |d, dtype, opts: &FlashAttn, caps: &DeviceCaps| {
            plan(&problem(d, dtype, opts, 300, 300), dtype, caps).unwrap()
        };
        let plain = FlashAttn::new(0.1);
        // bf16 on sm_90 at other lengths than pick's 300 x 300.
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
            let f =
                |d, s, opts: &FlashAttn| pick(dtype, d, s, opts, &DeviceCaps::SM90).launch.function;
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
            assert_eq!((pl.launch.grid, pl.launch.smem), ((132, 1, 1), 230_792));
            let pl = pick(dtype, 128, 8192, &plain, &DeviceCaps::SM90);
            assert_eq!((pl.launch.grid, pl.launch.smem), ((64, 16, 2), 214_104));
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
        assert_eq!(base.launch.function, "flash_fwd_sm90_bf16_d128_wg2p");
        let mut o = base.clone();
        override_sm90(&mut o, &p, &caps, Some("wg2"), None).unwrap();
        assert_eq!((o.launch.grid, o.launch.smem), ((16, 16, 8), 197_720));
        let mut o = base.clone();
        override_sm90(&mut o, &p, &caps, Some("wg2p"), None).unwrap();
        assert_eq!(
            (o.launch.grid, o.launch.function.as_str()),
            ((132, 1, 1), "flash_fwd_sm90_bf16_d128_wg2p")
        );
        let mut o = base.clone();
        override_sm90(&mut o, &p, &caps, Some("wg2p"), Some(3)).unwrap();
        assert_eq!(o.launch.grid, (3, 1, 1));
        // A cap on a non-persistent variant leaves its grid alone.
        let mut o = base.clone();
        override_sm90(&mut o, &p, &caps, Some("wg2n176"), Some(3)).unwrap();
        assert_eq!(o.launch.function, "flash_fwd_sm90_bf16_d128_wg2n176");
        assert_eq!((o.launch.grid, o.launch.smem), ((16, 16, 8), 214_104));
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
        let err = plan(
            &p,
            DType::F16,
            &DeviceCaps::with(7, 5, 40, 65_536, 320_000, 4 << 20),
        )
        .unwrap_err();
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
