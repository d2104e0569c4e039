//! The split-KV decode plan, derived from the device and the problem: which instance, how many
//! slices of the key range (each its own block, merged by the last block of a group or by a
//! combine kernel), and the grid.
//!
//! Decode streams K and V once and does little arithmetic per byte, so its time is the time to
//! move those bytes, where enough blocks stream at once. The plan models that directly: the
//! grid runs in waves of (SMs x blocks per SM) blocks, blocks per SM as the device reports them
//! for the compiled kernel (shared memory, registers, threads); in a wave the busiest SM holds
//! ceil(blocks / SMs) of them and streams at most its even share of the DRAM bandwidth, and each
//! block at most its instance's measured rate (`DecodeInstance::rate`: a block's warps wait on
//! their own tile products, which bounds a lone block below an SM's share; a paged block waits
//! on its block table too); each wave pays a fill and drain; splitting the keys adds a merge
//! that writes and reads the partial results. Among every instance of the head's width
//! (one row block of a wide instance, or several of a narrow one) and every split count, the
//! plan takes the cheapest, the fewest splits among equals. One rule for contiguous and paged
//! caches, every head dim the instances cover, GQA groups and MHA alike; the result depends only
//! on the shape and the device, so results are bitwise reproducible. The search runs on the
//! host for each new shape; the last few shapes' results are kept (a model's layers share one).

use candle::{bail, DType, Result};

use crate::cuda::device::DeviceCaps;
use crate::cuda::instances::{DecodeInstance, DECODE_INSTANCES};
use crate::cuda::launch::{dtype_name, to_u32, Launch, Module};
use crate::cuda::operands::pack_flags;
use crate::problem::Problem;

/// A decode plan: the partial pass over the key splits, and how the splits are merged.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Plan {
    pub instance: DecodeInstance,
    pub partial: Launch,
    pub merge: Merge,
    /// Slices of the key range, each its own block; 1 writes the output directly.
    pub splits: usize,
    /// Keys per slice (a whole number of K/V tiles).
    pub split_keys: usize,
    /// Blocks of packed rows per K/V head (`instance.rows()` each).
    pub m_tiles: usize,
    /// Columns of q/k/v the kernel reads (a multiple of 8).
    pub d_load: usize,
    /// Operands (q, k, v) that must first be packed into a contiguous copy.
    pub pack: [bool; 3],
}

/// The decode path takes calls with at most this many packed query rows per K/V head
/// (`heads / kv_heads * seq_q`): one block of the widest instance can read the cache once for
/// all of them. Beyond it the prefill kernels' 128-row tiles are as full. (Paged caches and prefix
/// ranges, which only this kernel and the row-wise one read, take it at any row count.)
pub(crate) const DECODE_MAX_ROWS: usize = 128;

/// Packed rows of one mma.sync row tile (m16) of the decode instances.
const MMA_ROW_TILE: usize = 16;

/// Most key-range splits of one call (the merge's `COMBINE_MAX_SPLITS`): enough for
/// one sequence of one K/V head to fill two blocks on each SM of a 132-SM GPU.
pub(crate) const MAX_SPLITS: usize = 256;

// The costs below marked "fitted", and the instances' rates (`DecodeInstance::rate`), were
// fitted together on an H100: every instance at split counts 1 to 64 over 83 shapes of the
// sweep's configurations (`decode_bench --instances .. --splits ..`), minimising the modelled
// time's error relative to the measured one, weighted towards each shape's fastest plans. The
// fit let a second resident block add less than a whole block's rate; the planner keeps the
// linear form below, which with these values chose plans within 1.05 of the best measured one
// on average over those shapes (the fitted form: 1.08).

/// What one wave of blocks costs beyond its bytes, in microseconds: the first tiles' round trip
/// before a block streams and the tail of its last blocks (fitted).
const WAVE_US: f64 = 6.8;

/// What a dependent combine launch costs beyond its bytes and its round trips, in microseconds:
/// the partial pass drains and the combine grid ramps up (fitted).
const COMBINE_US: f64 = 5.0;

/// One dependent round trip of the combine kernel, in microseconds: the warps of a (query row,
/// head) read the splits' lse, then their partials `COMBINE_UNROLL` splits a warp at a time,
/// and a call with more rows and heads than the GPU holds blocks for pays for its waves in turn
/// (fitted with [`PARTIAL_PASSES`] on an H200 over 76 shapes of the sweep's grid, every
/// instance at 1 to 64 splits: the planner's choices average 1.02 of the best measured one).
const COMBINE_TRIP_US: f64 = 1.5;

/// The partial results' bytes (f32 outputs and lse of every split) count this many times at the
/// DRAM's pace: written by the partial pass, read by the combine kernel, and the partial pass's
/// scattered f32 stores at about half a stream's pace (fitted with [`COMBINE_TRIP_US`]; 2, the
/// bytes alone, split 16 query rows of 8 heads over 64 sequences in three, where two measured
/// as slow as one and four 1.46 times one).
const PARTIAL_PASSES: f64 = 4.0;

/// What a fused merge costs beyond its round trips, in microseconds: zeroing the group counters
/// before the launch and each block's fence and count (fitted).
const FUSED_US: f64 = 3.5;

/// Warps of a combine kernel block (`COMBINE_WARPS` of `kernels/decode/combine.cuh`), shared by
/// its (query row, head) pairs.
const COMBINE_WARPS: usize = 4;

/// Splits whose partials a merging warp loads at once (`COMBINE_UNROLL` of
/// `kernels/decode/combine.cuh`).
const COMBINE_UNROLL: usize = 8;

/// One dependent round trip of a fused merge's loads (the partials, just written, from the L2),
/// with the arithmetic between them, in microseconds: the last block of a group walks its rows'
/// splits in such steps, so the fused merge wins only where its block has a row or two per
/// warp and few splits (fitted).
const TRIP_US: f64 = 1.4;

/// What a block of a paged cache streams, as a share of its instance's rate: its copies wait on
/// the block-table entries (fitted on 16-row pages; the fit's 0.64, lowered to 0.5 where a
/// sweep of long paged caches at one block per SM measured 0.7 of the contiguous pace or less).
const PAGED_RATE: f64 = 0.5;

/// A K/V slice counts as read once by the row blocks that share it while it is at most this
/// fraction of the L2: the blocks launch side by side but drift apart as they stream, and a
/// tile the first fetched must still be in the L2 when the last reads it.
const L2_SHARE_DIVISOR: usize = 8;

/// The part of the idle SMs' share of the DRAM bandwidth that the busy ones draw when the grid
/// has fewer blocks than SMs (fitted: grids of 64 to 96 blocks measured 1.1 to 1.7 times the
/// even share per SM, the more the fewer SMs; over the fit shapes the planner's choices are as
/// good anywhere from 0.5 to 1, and 0.5 keeps long caches on every SM, where 96 SMs drew only
/// 1.1 times their share).
const IDLE_SHARE: f64 = 0.5;

/// The share of the peak DRAM bandwidth a stream reaches: a device-to-device copy moves 3.0 of
/// the H100's 3.35 TB/s.
const STREAM_EFFICIENCY: f64 = 0.9;

/// How many blocks of a launch one SM holds at once (the device's occupancy of the compiled
/// kernel at that block size and shared memory).
pub(crate) type Residency<'a> = &'a dyn Fn(&Launch) -> Result<usize>;

/// The decode plan of `p`, or `None` when `p` is not decode-shaped (f32, too many packed rows
/// per K/V head, or a head wider than every instance): the prefill kernels take it then.
pub(crate) fn plan(
    p: &Problem,
    dtype: DType,
    caps: &DeviceCaps,
    residency: Residency,
) -> Result<Option<Plan>> {
    plan_with(p, dtype, caps, residency, false)
}

/// The decode plan of `p` over FP8 (e4m3) K and V with `dtype` queries and output (the
/// `kernels/decode/decode_fp8.cu` twins of the instances: compute_89 where the GPU has sm_89's
/// e4m3 conversion, else, and on the portable path, compute_80), or `None` where they do not
/// apply: a head dim that is not a multiple of 16 (the kernels copy whole 16-byte chunks of FP8
/// rows), or a call that is not decode-shaped.
pub(crate) fn plan_kv8(
    p: &Problem,
    dtype: DType,
    caps: &DeviceCaps,
    residency: Residency,
) -> Result<Option<Plan>> {
    if !p.head_dim.is_multiple_of(16) {
        return Ok(None);
    }
    plan_with(p, dtype, caps, residency, true)
}

fn plan_with(
    p: &Problem,
    dtype: DType,
    caps: &DeviceCaps,
    residency: Residency,
    kv8: bool,
) -> Result<Option<Plan>> {
    let rows = p.heads / p.kv_heads * p.max_seq_q;
    let rows_only = p.paged.is_some() || p.prefix.is_some();
    // A block mask (dense calls only) is read by the prefill kernels; a bias by the `_mods`
    // instances.
    if dtype == DType::F32 || p.block_mask.is_some() || !(rows_only || rows <= DECODE_MAX_ROWS) {
        return Ok(None);
    }
    let d_load = p.head_dim.next_multiple_of(8);
    // The instance width: the narrowest that holds the head.
    let Some(width) = DECODE_INSTANCES
        .iter()
        .map(|i| i.d)
        .filter(|&d| d >= d_load)
        .min()
    else {
        return Ok(None);
    };
    let dn = dtype_name(dtype)?;
    let mods = p.score.softcap > 0.0 || p.has_alibi || p.score.scale <= 0.0 || p.bias.is_some();
    let mods = if mods { "_mods" } else { "" };
    let module = Module::decode_of(dtype)?;
    let smem = |i: &DecodeInstance| if kv8 { i.smem_kv8() } else { i.smem() };
    let launch = |i: &DecodeInstance| Launch {
        module: match (kv8, caps.fp8, i.wg) {
            (false, _, false) => module,
            (false, _, true) => Module::DecodeSm90,
            (true, true, _) => Module::DecodeFp8,
            (true, false, _) => Module::DecodeFp8Portable,
        },
        function: format!(
            "flash_decode_{dn}_{}{}{mods}",
            if kv8 { "kv8_" } else { "" },
            i.suffix()
        ),
        grid: (1, 1, 1),
        threads: i.threads() as u32,
        smem: smem(i),
    };
    let key = SearchKey {
        caps: *caps,
        dtype,
        mods: !mods.is_empty(),
        paged: p.paged.is_some(),
        batch: p.batch,
        kv_heads: p.kv_heads,
        heads: p.heads,
        total_q: p.total_q,
        rows,
        max_seq_k: p.max_seq_k,
        d_load,
        kv8,
        forced: p.kernels.overrides.decode_instance.clone(),
    };
    let (instance, m_tiles, splits, combine_slots) = remembered(key, || {
        // How many combine blocks the GPU holds at once: asked of the device for a new shape
        // only, and kept with the search's result.
        let combine_slots =
            caps.sms as usize * residency(&combine_launch(p, module, dn, width, 1)?)?.max(1);
        let shape = Shape {
            width,
            rows,
            d_load,
            esize: if kv8 { 1 } else { 2 },
            combine_slots,
        };
        let (i, m_tiles, splits) = search(p, caps, shape, kv8, &smem, &|i| residency(&launch(i)))?;
        Ok((i, m_tiles, splits, combine_slots))
    })?;
    if p.batch > 65535 || p.heads > 65535 {
        bail!(
            "flash-attn: decode grid ({}, {splits}, {}) exceeds the CUDA limits",
            p.kv_heads * m_tiles,
            p.batch
        )
    }
    let (splits, split_keys) = slices(p, instance, splits);
    let esize = if kv8 { 1 } else { 2 };
    let dram = caps.dram_bytes_per_us as f64 * STREAM_EFFICIENCY;
    Ok(Some(Plan {
        instance,
        partial: Launch {
            // The K/V heads (and row blocks) of a key range side by side: see
            // kernels/decode/partial.cuh.
            grid: (
                to_u32(p.kv_heads * m_tiles, "K/V heads x row blocks")?,
                to_u32(splits, "splits")?,
                p.batch as u32,
            ),
            ..launch(&instance)
        },
        merge: match merge_costs(
            p,
            instance,
            rows,
            splits,
            (d_load, esize),
            dram,
            combine_slots,
        ) {
            None => Merge::None,
            Some((fused, kernel)) if fused < kernel => Merge::Fused,
            Some(_) => kernel_merge(p, module, dn, width, combine_slots)?,
        },
        splits,
        split_keys,
        m_tiles,
        d_load,
        // FP8 operands are read in place (the caller checked their layout).
        pack: match kv8 {
            true => [pack_flags(p, false)[0], false, false],
            false => pack_flags(p, false),
        },
    }))
}

/// The combine kernel of a call, of the instance width, `warps` (1, 2 or 4) merging each
/// (query row, head).
fn combine_launch(
    p: &Problem,
    module: Module,
    dn: &str,
    width: usize,
    warps: usize,
) -> Result<Launch> {
    Ok(Launch {
        module,
        function: format!("flash_decode_combine_{dn}_d{width}"),
        grid: (
            to_u32(combine_row_blocks(p, warps), "query rows")?,
            to_u32(p.heads, "heads")?,
            1,
        ),
        threads: (COMBINE_WARPS * 32) as u32,
        smem: 0,
    })
}

/// The combine kernel's merge of a call, with [`combine_warps`] per (query row, head).
fn kernel_merge(
    p: &Problem,
    module: Module,
    dn: &str,
    width: usize,
    combine_slots: usize,
) -> Result<Merge> {
    let warps = combine_warps(p, combine_slots);
    Ok(Merge::Kernel(
        combine_launch(p, module, dn, width, warps)?,
        warps,
    ))
}

/// Warps the combine kernel gives each (query row, head): the most (4, 2 or 1) at which its blocks
/// still fit the GPU at once (`combine_slots` of them), so that few rows read their splits in
/// fewer round trips while many rows are merged a warp each, as many at a time as fit.
fn combine_warps(p: &Problem, combine_slots: usize) -> usize {
    [4, 2]
        .into_iter()
        .find(|&w| combine_row_blocks(p, w) * p.heads <= combine_slots)
        .unwrap_or(1)
}

/// The combine grid's blocks along the query rows with `warps` (1, 2 or 4) per (query row,
/// head): `COMBINE_WARPS / warps` rows a block (its blocks along the heads are `p.heads`).
fn combine_row_blocks(p: &Problem, warps: usize) -> usize {
    p.total_q.div_ceil(COMBINE_WARPS / warps)
}

/// The split count (the search's, or the override's within what the instance allows) and the
/// keys of each slice, in whole tiles; the count re-cut to slices of that length.
fn slices(p: &Problem, instance: DecodeInstance, splits: usize) -> (usize, usize) {
    let splits = p
        .kernels
        .overrides
        .decode_splits
        .map_or(splits, |n| n.clamp(1, max_splits(p, instance)));
    let split_keys = p
        .max_seq_k
        .div_ceil(splits)
        .next_multiple_of(instance.bc)
        .max(instance.bc);
    (p.max_seq_k.div_ceil(split_keys).max(1), split_keys)
}

/// How the splits' partial results are merged (`kernels/decode/combine.cuh`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Merge {
    /// One split: the partial pass writes the output.
    None,
    /// The last block of each group of splits merges them, in the partial pass's launch (the
    /// host zeroes one counter per group first).
    Fused,
    /// A combine kernel launched after the partial pass, and the warps it gives each (query row,
    /// head).
    Kernel(Launch, usize),
}

/// Everything the search reads: the device (its kernels' residency follows from it, the dtype
/// and the `_mods` variant) and the problem's shape.
#[derive(Clone, PartialEq, Eq)]
struct SearchKey {
    caps: DeviceCaps,
    dtype: DType,
    mods: bool,
    paged: bool,
    batch: usize,
    kv_heads: usize,
    heads: usize,
    total_q: usize,
    rows: usize,
    max_seq_k: usize,
    d_load: usize,
    kv8: bool,
    forced: Option<String>,
}

/// Searches kept: the layers of a model decode one shape per step, so the first layer's search
/// serves the others (a search costs the host microseconds on long caches).
const SEARCH_CACHE: usize = 16;

/// A search's (instance, row blocks, splits).
type Choice = (DecodeInstance, usize, usize);

/// What a search keeps: its choice and the combine kernel's blocks resident on the GPU.
type Found = (DecodeInstance, usize, usize, usize);

static SEARCHES: std::sync::Mutex<Vec<(SearchKey, Found)>> = std::sync::Mutex::new(Vec::new());

/// The search result kept for `key`, else `search()`'s, then kept (the oldest of
/// [`SEARCH_CACHE`] dropped).
fn remembered(key: SearchKey, search: impl FnOnce() -> Result<Found>) -> Result<Found> {
    let cached = SEARCHES
        .lock()
        .ok()
        .and_then(|c| c.iter().find(|(k, _)| *k == key).map(|(_, v)| *v));
    if let Some(found) = cached {
        return Ok(found);
    }
    let found = search()?;
    if let Ok(mut c) = SEARCHES.lock() {
        if c.len() == SEARCH_CACHE {
            c.remove(0);
        }
        c.push((key, found));
    }
    Ok(found)
}

/// What the search reads of a call besides the problem: the instance width, the packed rows per
/// K/V head, the columns read, the bytes of one K/V element and the combine kernel's blocks
/// resident on the whole GPU.
#[derive(Clone, Copy)]
struct Shape {
    width: usize,
    rows: usize,
    d_load: usize,
    esize: usize,
    combine_slots: usize,
}

/// The cheapest (instance, row blocks, splits) for `p` by [`cost`]; `smem` is an instance's
/// dynamic shared memory in the variant searched (`kv8`: the FP8-cache twins, which the
/// warpgroup-MMA instances have none of; those run where the sm_90a kernels do).
fn search(
    p: &Problem,
    caps: &DeviceCaps,
    Shape {
        width,
        rows,
        d_load,
        esize,
        combine_slots,
    }: Shape,
    kv8: bool,
    smem: &dyn Fn(&DecodeInstance) -> usize,
    residency: &dyn Fn(&DecodeInstance) -> Result<usize>,
) -> Result<Choice> {
    // Every instance of that width that fits the device, whatever its row tiles: several row
    // blocks of a narrow instance (their K/V reads mostly served by the L2) can beat one block
    // of a wide one, whose warps each compute every key for their own rows. A paged tile's
    // copies wait for its block-table entries, fetched one tile ahead, which a ring with one
    // tile in flight exposes: paged caches take the deep rings where they fit.
    // Warpgroup MMA (sm_90a) multiplies 64 rows at a time: with more packed rows than one
    // mma.sync row tile (16) it takes the call's products in a quarter of the instructions, and
    // one of its blocks reads the cache once for up to 128 rows, where the mma.sync instances
    // either read it again per 16-row block or give each warp a row tile of products that bound
    // it (on an H200, bf16 d 128 at 28 to 128 packed rows: 0.82 to 0.95 of the copy bandwidth
    // at 28 to 32 rows, where the mma.sync plans reached 0.78 to 0.83, and up to twice their
    // pace at 112 to 128). With 16 rows or fewer three quarters of its products would be
    // padding, and the mma.sync instances keep the call. So where the width has warpgroup-MMA
    // instances that fit, calls of more than 16 rows take them, and the others the mma.sync
    // ones.
    let runs = |i: &DecodeInstance| !i.wg || (caps.hopper && !kv8);
    let usable = |i: &DecodeInstance| i.d == width && runs(i) && caps.fits(smem(i));
    let wg_call = rows > MMA_ROW_TILE && DECODE_INSTANCES.iter().any(|i| i.wg && usable(i));
    let fits = |i: &DecodeInstance| usable(i) && i.wg == wg_call;
    let deeper_fits = |i: &DecodeInstance| {
        DECODE_INSTANCES
            .iter()
            .any(|j| fits(j) && (j.rg, j.kg, j.bc) == (i.rg, i.kg, i.bc) && j.stages > i.stages)
    };
    // A forced name applies where an instance of this width has it; a name of other widths
    // leaves the search as it is, and one no instance has is an error (as `PlanOverride` says).
    let named = |i: &DecodeInstance, name: &str| i.name() == name;
    let forced = match &p.kernels.overrides.decode_instance {
        Some(name) if !DECODE_INSTANCES.iter().any(|i| named(i, name)) => {
            bail!("flash-attn: no decode instance is named {name}")
        }
        Some(name) => DECODE_INSTANCES
            .iter()
            .find(|i| i.d == width && named(i, name)),
        None => None,
    };
    let candidates: Vec<DecodeInstance> = match forced {
        Some(i) if !runs(i) => bail!(
            "flash-attn: decode instance {} runs on sm_90a (compute capability 9.0) only, \
             and not over FP8 caches",
            i.suffix()
        ),
        Some(&i) if caps.fits(smem(&i)) => vec![i],
        Some(i) => bail!(
            "flash-attn: decode instance {} needs more shared memory than this device has",
            i.suffix()
        ),
        None => DECODE_INSTANCES
            .iter()
            .filter(|i| fits(i) && !(p.paged.is_some() && i.stages == 2 && deeper_fits(i)))
            .copied()
            .collect(),
    };
    let dram = caps.dram_bytes_per_us as f64 * STREAM_EFFICIENCY;
    let mut best: Option<(f64, Choice)> = None;
    for &i in &candidates {
        let m_tiles = rows.div_ceil(i.rows()).max(1);
        let slots = caps.sms as usize * residency(&i)?.max(1);
        // Only the fewest splits of each distinct slice length (whole tiles) can be launched:
        // a plan's slices are re-cut to that length. About 2 sqrt(tiles) counts, not 256.
        let tiles = p.max_seq_k.div_ceil(i.bc).max(1);
        let most = max_splits(p, i);
        // No plan moves its bytes faster than the DRAM (each K/V row once, whatever the row
        // blocks), and the merge only grows with the splits: past the count where that floor
        // exceeds the best, none can win.
        let all_bytes = (p.batch * p.kv_heads * p.max_seq_k * d_load * 2 * esize) as f64;
        let mut splits = 1;
        while splits <= most {
            let merge = merge_costs(p, i, rows, splits, (d_load, esize), dram, combine_slots)
                .map_or(0.0, |(f, k)| f.min(k));
            let floor = WAVE_US + all_bytes / dram + merge;
            if best.is_some_and(|(b, _)| floor >= b) {
                break;
            }
            let t = cost(
                p,
                caps,
                i,
                (slots, combine_slots),
                (m_tiles, rows),
                splits,
                d_load,
                esize,
            );
            if best.is_none_or(|(b, _)| t < b) {
                best = Some((t, (i, m_tiles, splits)));
            }
            let per = tiles.div_ceil(splits);
            if per == 1 {
                break;
            }
            splits = tiles.div_ceil(per - 1);
        }
    }
    match best {
        Some((_, found)) => Ok(found),
        None => bail!("flash-attn: no decode instance of width {width} fits this device"),
    }
}

/// Most splits worth considering: one K/V tile each at least, at most [`MAX_SPLITS`].
fn max_splits(p: &Problem, i: DecodeInstance) -> usize {
    p.max_seq_k.div_ceil(i.bc).clamp(1, MAX_SPLITS)
}

/// Modelled time, in microseconds, of instance `i` (`slots` blocks of it resident at once over
/// the GPU; `combine_slots` of the combine kernel's) over `splits` slices of the keys of each of
/// the `m_tiles` row blocks of every (sequence, K/V head) (`rows` packed rows each), of
/// `esize`-byte K/V elements, merge included. A block's rate is its keys' pace: the
/// instance rates are of 2-byte caches, and an FP8 block computes as many keys per
/// microsecond (plus their conversion), so its bytes stream at `esize / 2` of that rate.
#[allow(clippy::too_many_arguments)]
fn cost(
    p: &Problem,
    caps: &DeviceCaps,
    i: DecodeInstance,
    (slots, combine_slots): (usize, usize),
    (m_tiles, rows): (usize, usize),
    splits: usize,
    d_load: usize,
    esize: usize,
) -> f64 {
    let dram = caps.dram_bytes_per_us as f64 * STREAM_EFFICIENCY;
    let blocks = p.batch * p.kv_heads * m_tiles * splits;
    // Keys a block walks: its slice, in whole tiles.
    let keys = p.max_seq_k.div_ceil(splits).next_multiple_of(i.bc);
    let block_bytes = (keys * d_load * 2 * esize) as f64;
    // A wave of n blocks: the block scheduler deals them out over the SMs, so the busiest SM
    // holds ceil(n / SMs) of them; its blocks stream at most their own rate each, and its DRAM
    // bytes arrive at most at its share of the bandwidth (its even share, plus part of the idle
    // SMs' where the whole grid has fewer blocks than SMs: [`IDLE_SHARE`]), where, for short
    // slices ([`L2_SHARE_DIVISOR`]), only one row block in m_tiles fetches a K/V tile from the
    // DRAM (the other row blocks of its sequence and K/V head, launched beside it, find the
    // tile in the L2). The wave lasts as long as its busiest SM.
    let sms = caps.sms as usize;
    let rate =
        i.rate as f64 * if p.paged.is_some() { PAGED_RATE } else { 1.0 } * esize as f64 / 2.0;
    let sharing = match block_bytes as usize * L2_SHARE_DIVISOR <= caps.l2_bytes {
        true => m_tiles as f64,
        false => 1.0,
    };
    let busy = blocks.clamp(1, sms) as f64;
    let sm_share = dram / sms as f64 * (1.0 + IDLE_SHARE * (sms as f64 / busy - 1.0));
    let wave = |n: usize| {
        let load = n.div_ceil(sms) as f64;
        let compute = block_bytes / rate;
        let memory = load * block_bytes / sharing / sm_share;
        WAVE_US + compute.max(memory)
    };
    let full = blocks / slots;
    let rest = blocks % slots;
    let t = full as f64 * wave(slots) + if rest > 0 { wave(rest) } else { 0.0 };
    t + merge_costs(p, i, rows, splits, (d_load, esize), dram, combine_slots)
        .map_or(0.0, |(f, k)| f.min(k))
}

/// The two ways of merging `splits` slices of instance `i`'s row blocks (none for one split):
/// (fused, combine kernel), in microseconds. The combine kernel pays its launch, the round trips
/// of each wave of its blocks (`combine_slots` of them at once; [`combine_warps`] per (query
/// row, head)), and the partial outputs (f32) and base-2 lse of every split, written then read
/// ([`PARTIAL_PASSES`]); a fused merge pays its counters, then the last block of a group walks
/// its packed rows (each warp its share, one after another) in dependent round trips: the rows'
/// lse, then the partials of `COMBINE_UNROLL` (8) splits at a time. Few rows and splits favour
/// the fused one.
/// The FP8-cache kernels (`esize` 1) with more than one row tile have no fused merge (infinite
/// cost).
fn merge_costs(
    p: &Problem,
    i: DecodeInstance,
    rows: usize,
    splits: usize,
    (d_load, esize): (usize, usize),
    dram: f64,
    combine_slots: usize,
) -> Option<(f64, f64)> {
    if splits == 1 {
        return None;
    }
    let part = (splits * p.total_q * p.heads * (d_load + 1) * 4) as f64;
    let warps = combine_warps(p, combine_slots);
    let waves = (combine_row_blocks(p, warps) * p.heads).div_ceil(combine_slots.max(1));
    let round_trips = 1 + splits.div_ceil(COMBINE_UNROLL * warps);
    let kernel =
        COMBINE_US + (waves * round_trips) as f64 * COMBINE_TRIP_US + PARTIAL_PASSES * part / dram;
    let rows_per_warp = rows.min(i.rows()).div_ceil(i.rg * i.kg);
    let trips = rows_per_warp * (1 + splits.div_ceil(COMBINE_UNROLL));
    let fused = match esize == 1 && i.rg > 1 {
        true => f64::INFINITY,
        false => FUSED_US + trips as f64 * TRIP_US,
    };
    Some((fused, kernel))
}

#[cfg(test)]
mod tests {
    use candle::{Device, Tensor};

    use super::*;
    use crate::FlashAttn;

    const CAPS: [DeviceCaps; 4] = [
        DeviceCaps::SM80,
        DeviceCaps::SM86,
        DeviceCaps::SM89,
        DeviceCaps::SM90,
    ];

    #[allow(clippy::too_many_arguments)]
    fn problem(
        b: usize,
        sq: usize,
        sk: usize,
        h: usize,
        hk: usize,
        d: usize,
        dtype: DType,
        opts: &FlashAttn,
    ) -> Problem {
        // Broadcast views: the planner reads shapes, and long caches need no memory.
        let dev = Device::Cpu;
        let q = Tensor::zeros((1, 1, 1, d), dtype, &dev).unwrap();
        let q = q.broadcast_as((b, sq, h, d)).unwrap();
        let k = q.narrow(2, 0, 1).unwrap().narrow(1, 0, 1).unwrap();
        let k = k.broadcast_as((b, sk, hk, d)).unwrap();
        opts.problem(&q, &k, &k, None).unwrap()
    }

    /// The plan's launches are entry points of their modules.
    fn assert_defined(pl: &Plan, what: &str) {
        use crate::cuda::launch::defined;
        assert!(defined(&pl.partial), "{what}");
        if let Merge::Kernel(l, _) = &pl.merge {
            assert!(defined(l), "{what}");
        }
    }

    fn bf16(b: usize, sq: usize, sk: usize, h: usize, hk: usize, d: usize) -> Option<Plan> {
        let p = problem(
            b,
            sq,
            sk,
            h,
            hk,
            d,
            DType::BF16,
            &FlashAttn::new(0.1).causal(),
        );
        plan(
            &p,
            DType::BF16,
            &DeviceCaps::SM90,
            &by_smem(DeviceCaps::SM90),
        )
        .unwrap()
    }

    /// Residency as the tests assume it of a compiled kernel: shared memory (the SM holds the
    /// per-block opt-in plus the driver's 1 KB per block; each block takes its static shared
    /// memory and that 1 KB), at most 16 blocks of 128 threads' registers (128 each).
    fn by_smem(caps: DeviceCaps) -> impl Fn(&Launch) -> Result<usize> {
        move |l: &Launch| {
            let per_block = l.smem + crate::cuda::device::STATIC_SMEM_RESERVE + 1024;
            let by_regs = 65_536 / (128 * l.threads as usize);
            Ok(((caps.smem_optin + 1024) / per_block).min(by_regs))
        }
    }

    /// FP8 caches take the FP8 twins where the head dim is whole 16-byte chunks, on every GPU:
    /// the compute_89 module where the GPU converts e4m3 (sm_89 on, not the portable path), the
    /// compute_80 one elsewhere; their shared memory is the twin's, and they fit every GPU.
    /// Other head dims have no FP8 plan (the caller converts).
    #[test]
    fn fp8_caches_take_the_fp8_twins() {
        let opts = FlashAttn::new(0.1).causal();
        for (b, sq, sk, h, hk, d) in [
            (8, 1, 32768, 32, 8, 128),
            (1, 4, 3000, 8, 1, 256),
            (3, 1, 77, 6, 6, 64),
        ] {
            let p = problem(b, sq, sk, h, hk, d, DType::BF16, &opts);
            for caps in [
                DeviceCaps::SM80,
                DeviceCaps::SM86,
                DeviceCaps::SM89,
                DeviceCaps::SM90,
                DeviceCaps::SM90.portable(),
            ] {
                let pl = plan_kv8(&p, DType::BF16, &caps, &by_smem(caps))
                    .unwrap()
                    .unwrap();
                let module = match caps.fp8 {
                    true => Module::DecodeFp8,
                    false => Module::DecodeFp8Portable,
                };
                assert_eq!(pl.partial.module, module);
                assert!(pl.partial.function.starts_with("flash_decode_bf16_kv8_"));
                assert_defined(&pl, &format!("{caps:?}: {pl:?}"));
                assert_eq!(pl.partial.smem, pl.instance.smem_kv8());
                assert!(caps.fits(pl.partial.smem) && pl.pack[1..] == [false, false]);
                // Those that convert through shared memory (more than one row tile) have no
                // fused merge (registers full).
                assert!(pl.instance.rg == 1 || pl.merge != Merge::Fused);
                assert!(pl.instance.smem_kv8() <= pl.instance.smem());
            }
        }
        let p = problem(2, 1, 1000, 8, 2, 72, DType::BF16, &opts);
        let caps = DeviceCaps::SM90;
        assert!(plan_kv8(&p, DType::BF16, &caps, &by_smem(caps))
            .unwrap()
            .is_none());
    }

    /// Packed rows per K/V head up to 128 take the decode kernel (f16/bf16, heads up to 256),
    /// in row blocks that hold every packed row of their K/V head.
    #[test]
    fn decode_takes_up_to_128_packed_rows() {
        for (sq, h, hk) in [
            (1, 32, 8),
            (4, 32, 8),
            (5, 32, 8),
            (16, 32, 8),
            (16, 64, 8),
            (16, 28, 4),
            (1, 32, 32),
            (16, 32, 32),
            (8, 16, 1),
        ] {
            let pl = bf16(2, sq, 3000, h, hk, 128).unwrap();
            let rows = sq * h / hk;
            assert!(pl.m_tiles * pl.instance.rows() >= rows, "sq {sq} {h}/{hk}");
            assert!(
                (pl.m_tiles - 1) * pl.instance.rows() < rows,
                "sq {sq} {h}/{hk}"
            );
            assert_eq!(pl.partial.grid.0 as usize, hk * pl.m_tiles);
        }
        // 129 packed rows and more: the prefill kernels; f32 and heads over 256 too.
        assert!(bf16(2, 17, 3000, 64, 8, 128).is_none());
        assert!(bf16(2, 1, 3000, 32, 8, 264).is_none());
        let p = problem(2, 1, 3000, 32, 8, 128, DType::F32, &FlashAttn::new(0.1));
        assert!(plan(
            &p,
            DType::F32,
            &DeviceCaps::SM90,
            &by_smem(DeviceCaps::SM90)
        )
        .unwrap()
        .is_none());
    }

    /// On sm_90a, calls of more than 16 packed rows at a width with warpgroup-MMA instances
    /// take them (their module's entry points); 16 rows or fewer, d 64, the portable path,
    /// other GPUs and FP8 caches take the mma.sync ones.
    #[test]
    fn many_rows_take_the_warpgroup_mma_on_sm90() {
        for caps in CAPS.into_iter().chain([DeviceCaps::SM90.portable()]) {
            for (sq, h, hk, d) in [
                (1, 32, 8, 128),
                (4, 32, 8, 128),
                (5, 32, 8, 128),
                (16, 64, 8, 128),
                (16, 8, 1, 256),
                (4, 8, 1, 256),
                (16, 16, 2, 64),
                (1, 32, 32, 128),
            ] {
                let rows = sq * h / hk;
                for kv8 in [false, true] {
                    let p = problem(2, sq, 3000, h, hk, d, DType::BF16, &FlashAttn::new(0.1));
                    let pl = plan_with(&p, DType::BF16, &caps, &by_smem(caps), kv8)
                        .unwrap()
                        .unwrap();
                    let what = format!("{caps:?} kv8 {kv8} sq {sq} {h}/{hk} d {d}");
                    let wg = caps.hopper && !kv8 && rows > MMA_ROW_TILE && d > 64;
                    assert_eq!(pl.instance.wg, wg, "{what}");
                    assert_eq!(pl.partial.module == Module::DecodeSm90, wg, "{what}");
                    assert_defined(&pl, &what);
                    assert!(pl.m_tiles * pl.instance.rows() >= rows, "{what}");
                }
            }
        }
    }

    /// Every plan fits its device and covers every key exactly once over its splits.
    #[test]
    fn every_plan_fits_and_covers_the_keys() {
        let slopes = Tensor::new(&[0.5f32; 8], &Device::Cpu).unwrap();
        let opts = [
            FlashAttn::new(0.1),
            FlashAttn::new(0.1).causal(),
            FlashAttn::new(0.1).softcap(5.0),
            FlashAttn::new(0.1).alibi(&slopes),
        ];
        for caps in CAPS {
            for d in [1, 8, 40, 64, 72, 96, 128, 200, 256] {
                for (b, sq, sk) in [(1, 1, 1), (3, 2, 777), (1, 16, 4096), (64, 1, 100_000)] {
                    for o in &opts {
                        let p = problem(b, sq, sk, 8, 2, d, DType::F16, o);
                        let Some(pl) = plan(&p, DType::F16, &caps, &by_smem(caps)).unwrap() else {
                            // Only the deep d 256 instance of eight row tiles needs more than
                            // sm_86/sm_89's 100 KB; nothing else is declined.
                            panic!("{caps:?} d {d} b {b} sq {sq} sk {sk}: no plan");
                        };
                        let what = format!("{caps:?} d {d} b {b} sq {sq} sk {sk} {o:?}: {pl:?}");
                        assert!(caps.fits(pl.partial.smem), "{what}");
                        assert!(pl.instance.d >= pl.d_load && pl.d_load >= d, "{what}");
                        assert!(pl.splits * pl.split_keys >= sk, "{what}");
                        assert!((pl.splits - 1) * pl.split_keys < sk.max(1), "{what}");
                        assert!(pl.split_keys.is_multiple_of(pl.instance.bc), "{what}");
                        assert!((1..=MAX_SPLITS).contains(&pl.splits), "{what}");
                        assert_eq!(pl.merge == Merge::None, pl.splits == 1, "{what}");
                        let mods = o.softcap.is_some() || o.alibi_slopes.is_some();
                        assert_eq!(pl.partial.function.ends_with("_mods"), mods, "{what}");
                        assert_defined(&pl, &what);
                    }
                }
            }
        }
    }

    /// Few sequences are split until the SMs stream together; many sequences fill the GPU
    /// alone and pay no merge.
    #[test]
    fn splits_follow_the_device_and_the_problem() {
        let caps = DeviceCaps::SM90;
        // One sequence, 32k keys, 8 K/V heads: enough blocks that each SM streams.
        let pl = bf16(1, 1, 32768, 32, 8, 128).unwrap();
        let blocks = pl.splits * 8;
        assert!(blocks >= caps.sms as usize / 2, "{pl:?}");
        assert!(pl.splits > 1);
        // 64 sequences of 4096 keys: 512 blocks without splitting, more than one wave.
        let pl = bf16(64, 1, 4096, 32, 8, 128).unwrap();
        assert_eq!(pl.splits, 1, "{pl:?}");
        // A short cache is not split into tiles of nothing.
        let pl = bf16(1, 1, 100, 32, 8, 128).unwrap();
        assert!(pl.splits <= 2, "{pl:?}");
        // MHA at one row: 32 K/V heads per sequence.
        let mha = bf16(8, 1, 16384, 32, 32, 128).unwrap();
        assert!(mha.splits * 8 * 32 >= caps.sms as usize, "{mha:?}");
        // On every device the one long sequence is split over (nearly) all of its SMs.
        let p = problem(1, 1, 32768, 32, 8, 128, DType::BF16, &FlashAttn::new(0.1));
        for c in CAPS {
            let pl = plan(&p, DType::BF16, &c, &by_smem(c)).unwrap().unwrap();
            assert!(pl.splits * 8 * 10 >= c.sms as usize * 9, "{c:?} {pl:?}");
        }
        let h100 = plan(&p, DType::BF16, &caps, &by_smem(caps))
            .unwrap()
            .unwrap();
        // Deterministic: the same problem and device give the same plan.
        assert_eq!(
            h100,
            plan(&p, DType::BF16, &caps, &by_smem(caps))
                .unwrap()
                .unwrap()
        );
    }

    /// A grid with fewer blocks than SMs draws more than its even share per SM: where one
    /// block per (sequence, K/V head) keeps most SMs streaming, the plan takes it whole, with no
    /// merge, rather than splitting its keys; a long cache over few sequences is still split
    /// over every SM.
    #[test]
    fn near_full_grids_skip_the_merge() {
        let caps = DeviceCaps::SM90;
        for (b, sk, h, hk, d) in [(3, 2048, 32, 32, 128), (64, 512, 8, 1, 256)] {
            let pl = bf16(b, 1, sk, h, hk, d).unwrap();
            assert!(b * hk < caps.sms as usize, "{pl:?}");
            assert_eq!((pl.splits, &pl.merge), (1, &Merge::None), "{pl:?}");
        }
        let pl = bf16(3, 1, 131072, 8, 1, 256).unwrap();
        assert!(pl.splits * 3 >= caps.sms as usize, "{pl:?}");
    }

    /// One packed row per K/V head over a few splits merges in the partial launch; a group
    /// whose last block would walk many rows' splits one after another takes the combine
    /// kernel, launched over every (row, head).
    #[test]
    fn merges_follow_rows_and_splits() {
        for (b, sk, h, hk, d, fused) in [
            (1, 16384, 32, 32, 128, true),
            (1, 16384, 8, 1, 256, false),
            (1, 131072, 16, 2, 64, false),
        ] {
            let pl = bf16(b, 1, sk, h, hk, d).unwrap();
            assert!(pl.splits > 1, "{pl:?}");
            match &pl.merge {
                Merge::Fused => assert!(fused, "{pl:?}"),
                Merge::Kernel(k, warps) => {
                    assert!(!fused, "{pl:?}");
                    // Few rows and heads: four warps a (row, head), a block each.
                    assert_eq!(*warps, 4, "{pl:?}");
                    assert_eq!(k.grid, (b as u32, h as u32, 1));
                    assert_eq!(k.function, format!("flash_decode_combine_bf16_d{d}"));
                }
                Merge::None => panic!("{pl:?}"),
            }
        }
    }

    /// The combine kernel gives a (query row, head) as many warps as leave its blocks within
    /// one wave of the GPU (here 660 blocks), one warp where even that does not fit.
    #[test]
    fn combine_warps_fill_one_wave() {
        for (b, sq, h, warps) in [(1, 1, 32, 4), (8, 4, 32, 2), (64, 16, 64, 1)] {
            let p = problem(b, sq, 1024, h, 8, 128, DType::BF16, &FlashAttn::new(0.1));
            assert_eq!(
                combine_warps(&p, 660),
                warps,
                "{b} x {sq} rows of {h} heads"
            );
        }
    }

    /// Where a call has many (query row, head) pairs (16 query rows of many heads over many
    /// sequences), splitting the keys costs more in merging than it saves, and the plan keeps
    /// one split (the three shapes took two splits or more, and 1.4-1.5 times as long on an
    /// H200, before the planner counted the combine's waves); with few (one sequence, one query
    /// row) a long cache is still split over the SMs.
    #[test]
    fn many_rows_and_heads_keep_one_split() {
        for (b, sq, sk, h, hk, d) in [
            (8, 16, 2048, 64, 8, 128),
            (64, 16, 6000, 16, 2, 64),
            (64, 16, 1000, 8, 1, 256),
        ] {
            let pl = bf16(b, sq, sk, h, hk, d).unwrap();
            assert_eq!(pl.splits, 1, "{b} x {sq} rows of {h}/{hk}: {pl:?}");
            assert_eq!(pl.merge, Merge::None);
        }
        let pl = bf16(1, 1, 32768, 32, 8, 128).unwrap();
        assert!(pl.splits >= 8, "{pl:?}");
    }

    /// The split override changes only the split count of a decode plan.
    #[test]
    fn decode_override_resplits() {
        let dev = Device::Cpu;
        let q = Tensor::zeros((1, 1, 32, 128), DType::BF16, &dev).unwrap();
        let k = Tensor::zeros((1, 32768, 8, 128), DType::BF16, &dev).unwrap();
        let opts = |n| {
            FlashAttn::new(0.1).plan_override(crate::PlanOverride {
                decode_splits: Some(n),
                ..Default::default()
            })
        };
        let caps = DeviceCaps::SM90;
        let at = |o: &FlashAttn| {
            let p = o.problem(&q, &k, &k, None).unwrap();
            plan(&p, DType::BF16, &caps, &by_smem(caps))
                .unwrap()
                .unwrap()
        };
        let base = at(&FlashAttn::new(0.1));
        let pl = at(&opts(100));
        // Whole key tiles per split: 100 splits of 384 keys cover 32768 in 86.
        assert_eq!((pl.splits, pl.split_keys), (86, 384));
        assert_eq!(
            pl.partial.grid,
            (base.partial.grid.0, 86, base.partial.grid.2)
        );
        assert_eq!(pl.partial.function, base.partial.function);
        let one = at(&opts(1));
        assert_eq!((one.partial.grid.1, one.splits), (1, 1));
    }

    /// The instance override forces that instance (any row tiles) at its best split count; a
    /// name of another width changes nothing; a name no instance has is an error.
    #[test]
    fn decode_override_forces_the_instance() {
        let dev = Device::Cpu;
        let q = Tensor::zeros((2, 1, 32, 128), DType::BF16, &dev).unwrap();
        let k = Tensor::zeros((2, 5000, 8, 128), DType::BF16, &dev).unwrap();
        let caps = DeviceCaps::SM90;
        let at = |name: &str| {
            let o = FlashAttn::new(0.1).plan_override(crate::PlanOverride {
                decode_instance: Some(name.into()),
                ..Default::default()
            });
            let p = o.problem(&q, &k, &k, None).unwrap();
            plan(&p, DType::BF16, &caps, &by_smem(caps))
        };
        for name in ["r1_k4_c64_s2", "r4_k1_c64_s3", "r8_k1_c32_s4"] {
            let pl = at(name).unwrap().unwrap();
            assert!(pl.partial.function.ends_with(name), "{pl:?}");
            assert_eq!(pl.m_tiles, 1);
        }
        // A name of another width leaves the plan as the search makes it.
        let free = FlashAttn::new(0.1).problem(&q, &k, &k, None).unwrap();
        let free = plan(&free, DType::BF16, &caps, &by_smem(caps)).unwrap();
        assert_eq!(at("r4_k1_c16_s4").unwrap(), free);
        for name in ["r3_k1_c64_s3", "nonsense"] {
            assert!(at(name).is_err(), "{name}");
        }
    }
}
