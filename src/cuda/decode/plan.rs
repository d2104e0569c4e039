//! The split-KV decode plan, derived from the device and the problem: which instance, how many
//! slices of the key range (each its own block, merged by a combine pass), and the grid.
//!
//! Decode streams K and V once and does little arithmetic per byte, so its time is the time to
//! move those bytes. The plan models that directly: a block streams its slice of one K/V head's
//! keys with `stages - 1` tiles in flight, so alone it moves at most (bytes in flight) /
//! [`LATENCY_US`]; an SM moves at most its even share of the DRAM bandwidth, so a wave lasts as
//! long as its busiest SM; the grid runs in waves of (SMs x blocks per SM) blocks, blocks per SM
//! as the device reports them for the compiled kernel (shared memory, registers, threads); each
//! wave pays a round trip to start and drain; splitting the keys adds a combine pass that writes
//! and reads the partial results. Among the instances for
//! the problem's packed rows and every split count, the plan takes the cheapest, the fewest
//! splits among equals. One rule for contiguous and paged caches, every head dim the instances
//! cover, GQA groups and MHA alike; the result depends only on the shape and the device, so
//! results are bitwise reproducible.

use candle::{bail, DType, Result};

use crate::cuda::device::DeviceCaps;
use crate::cuda::instances::{DecodeInstance, DECODE_INSTANCES};
use crate::cuda::launch::{dtype_name, to_u32, Launch, Module};
use crate::cuda::operands::pack_flags;
use crate::problem::Problem;

/// A decode plan: the partial pass, and the combine pass when the keys are split.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Plan {
    pub instance: DecodeInstance,
    pub partial: Launch,
    /// Merges the splits' partial results (only with `splits > 1`).
    pub combine: Option<Launch>,
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
/// (`heads / kv_heads * seq_q`): one block of the widest instance reads the cache once for all
/// of them. Beyond it the prefill kernels' 128-row tiles are as full. (Paged caches and prefix
/// ranges, which only this kernel and the row-wise one read, take it at any row count.)
pub(crate) const DECODE_MAX_ROWS: usize = 128;

/// Most key-range splits of one call (the combine kernel's `COMBINE_MAX_SPLITS`): enough for
/// one sequence of one K/V head to fill two blocks on each SM of a 132-SM GPU.
pub(crate) const MAX_SPLITS: usize = 256;

/// How long a block waits for the tiles it has in flight, in microseconds: one block with two
/// 32 KB tiles in flight streamed 23 GB/s on an H100 (64 KB / 23 GB/s = 2.8 us), which is the
/// memory round trip under load plus the block's own issue and compute time per tile.
const LATENCY_US: f64 = 2.8;

/// What a dependent combine launch costs beyond its bytes, in microseconds: the partial pass
/// drains, the combine grid ramps up and its first loads wait a round trip (a split at one
/// wave's size ran 6-11 us slower than the same grid unsplit on an H100).
const COMBINE_US: f64 = 6.0;

/// How many blocks of a launch one SM holds at once (the device's occupancy of the compiled
/// kernel at that block size and shared memory).
pub(crate) type Residency<'a> = &'a dyn Fn(&Launch) -> Result<usize>;

/// Splits whose partials one combine block loads per round trip: four warps, eight splits each
/// (`COMBINE_UNROLL` in kernels/decode/combine.cuh).
const COMBINE_SPLITS_PER_TRIP: usize = 32;

/// The decode plan of `p`, or `None` when `p` is not decode-shaped (f32, too many packed rows
/// per K/V head, or a head wider than every instance): the prefill kernels take it then.
pub(crate) fn plan(
    p: &Problem,
    dtype: DType,
    caps: &DeviceCaps,
    residency: Residency,
) -> Result<Option<Plan>> {
    let rows = p.heads / p.kv_heads * p.max_seq_q;
    let rows_only = p.paged.is_some() || p.prefix.is_some();
    if dtype == DType::F32 || !(rows_only || rows <= DECODE_MAX_ROWS) {
        return Ok(None);
    }
    let d_load = p.head_dim.next_multiple_of(8);
    // The instance width: the narrowest that holds the head. Row tiles: the fewest that hold
    // the packed rows (the widest otherwise, in several blocks).
    let Some(width) = DECODE_INSTANCES
        .iter()
        .map(|i| i.d)
        .filter(|&d| d >= d_load)
        .min()
    else {
        return Ok(None);
    };
    let fitting = |rg: usize| {
        DECODE_INSTANCES
            .iter()
            .filter(move |i| i.d == width && i.rg == rg && caps.fits(i.smem()))
    };
    let mut rgs: Vec<usize> = DECODE_INSTANCES
        .iter()
        .filter(|i| i.d == width)
        .map(|i| i.rg)
        .collect();
    rgs.sort_unstable();
    rgs.dedup();
    let rg = rgs
        .iter()
        .copied()
        .find(|&rg| 16 * rg >= rows && fitting(rg).next().is_some())
        .or_else(|| {
            rgs.iter()
                .rev()
                .copied()
                .find(|&rg| fitting(rg).next().is_some())
        });
    let Some(rg) = rg else {
        return Ok(None);
    };
    let dn = dtype_name(dtype)?;
    let mods = p.score.softcap > 0.0 || p.has_alibi || p.score.scale <= 0.0;
    let mods = if mods { "_mods" } else { "" };
    let module = Module::of(dtype)?;
    let launch = |i: &DecodeInstance| Launch {
        module,
        function: format!("flash_decode_{dn}_{}{mods}", i.suffix()),
        grid: (1, 1, 1),
        threads: i.threads() as u32,
        smem: i.smem(),
    };
    let mut best: Option<(f64, DecodeInstance, usize, usize)> = None;
    for &i in fitting(rg) {
        let m_tiles = rows.div_ceil(i.rows()).max(1);
        let slots = caps.sms as usize * residency(&launch(&i))?.max(1);
        for splits in 1..=max_splits(p, i) {
            let t = cost(p, caps, i, slots, m_tiles, splits, d_load);
            if best.is_none_or(|(b, ..)| t < b) {
                best = Some((t, i, m_tiles, splits));
            }
        }
    }
    let Some((_, instance, m_tiles, splits)) = best else {
        return Ok(None);
    };
    if p.kv_heads * m_tiles > 65535 || p.batch > 65535 || p.heads > 65535 {
        bail!(
            "flash-attn: decode grid ({splits}, {}, {}) exceeds the CUDA limits",
            p.kv_heads * m_tiles,
            p.batch
        )
    }
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
    let splits = p.max_seq_k.div_ceil(split_keys).max(1);
    Ok(Some(Plan {
        instance,
        partial: Launch {
            grid: (
                to_u32(splits, "splits")?,
                (p.kv_heads * m_tiles) as u32,
                p.batch as u32,
            ),
            ..launch(&instance)
        },
        combine: (splits > 1).then(|| Launch {
            module,
            function: format!("flash_decode_combine_{dn}"),
            grid: (p.total_q as u32, p.heads as u32, 1),
            threads: 128,
            smem: 0,
        }),
        splits,
        split_keys,
        m_tiles,
        d_load,
        pack: pack_flags(p, false),
    }))
}

/// Most splits worth considering: one K/V tile each at least, at most [`MAX_SPLITS`].
fn max_splits(p: &Problem, i: DecodeInstance) -> usize {
    p.max_seq_k.div_ceil(i.bc).clamp(1, MAX_SPLITS)
}

/// Modelled time, in microseconds, of instance `i` (`slots` blocks of it resident at once over
/// the GPU) over `splits` slices of the keys of each of the `m_tiles` row blocks of every
/// (sequence, K/V head).
fn cost(
    p: &Problem,
    caps: &DeviceCaps,
    i: DecodeInstance,
    slots: usize,
    m_tiles: usize,
    splits: usize,
    d_load: usize,
) -> f64 {
    let dram = caps.dram_bytes_per_us as f64;
    let units = p.batch * p.kv_heads * m_tiles;
    let blocks = units * splits;
    // Keys a block walks: its slice, in whole tiles.
    let keys = p.max_seq_k.div_ceil(splits).next_multiple_of(i.bc);
    let block_bytes = (keys * d_load * 2 * 2) as f64;
    // A block needs about four warps to issue its copies and run its tile products within the
    // wait for the next tile: the two-warp d 256 blocks streamed 8.7 GB/s, not the 23 GB/s of
    // four-warp d 128 blocks with as many bytes in flight.
    let issue = (i.threads() as f64 / 128.0).min(1.0);
    let block_bw = ((i.stages - 1) * i.tile_bytes(d_load)) as f64 * issue / LATENCY_US;
    // A wave of n blocks: the block scheduler deals them out over the SMs, so the busiest SM
    // holds ceil(n / SMs) of them, and an SM streams at most its even share of the DRAM
    // bandwidth (one H100 SM pulled 23 GB/s of its 25: spreading the bytes evenly over every SM
    // is what saturates the memory). The wave lasts as long as its busiest SM.
    let sms = caps.sms as usize;
    let sm_share = dram / sms as f64;
    let wave = |n: usize| {
        let load = n.div_ceil(sms);
        LATENCY_US + load as f64 * block_bytes / sm_share.min(load as f64 * block_bw)
    };
    let full = blocks / slots;
    let rest = blocks % slots;
    let mut t = full as f64 * wave(slots) + if rest > 0 { wave(rest) } else { 0.0 };
    if splits > 1 {
        // Partial outputs (f32) and base-2 lse of every split, written then read; a combine
        // block reads the partials of COMBINE_SPLITS_PER_TRIP splits per round trip.
        let rows = p.total_q * p.heads;
        let part = (splits * rows * (d_load + 1) * 4) as f64;
        let trips = splits.div_ceil(COMBINE_SPLITS_PER_TRIP) as f64;
        t += COMBINE_US + trips * LATENCY_US + 2.0 * part / dram;
    }
    t
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

    /// Packed rows per K/V head up to 128 take the decode kernel (f16/bf16, heads up to 256),
    /// in one block per (sequence, K/V head, split): the cache is read once for all of them.
    #[test]
    fn decode_takes_up_to_128_packed_rows_in_one_pass() {
        for (sq, h, hk, rg) in [
            (1, 32, 8, 1),
            (4, 32, 8, 1),
            (5, 32, 8, 4),
            (16, 32, 8, 4),
            (16, 64, 8, 8),
            (16, 28, 4, 8),
            (1, 32, 32, 1),
            (16, 32, 32, 1),
            (8, 16, 1, 8),
        ] {
            let pl = bf16(2, sq, 3000, h, hk, 128).unwrap();
            assert_eq!((pl.instance.rg, pl.m_tiles), (rg, 1), "sq {sq} {h}/{hk}");
            assert_eq!(pl.partial.grid.1 as usize, hk);
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
                        assert_eq!(pl.combine.is_some(), pl.splits > 1, "{what}");
                        let mods = o.softcap.is_some() || o.alibi_slopes.is_some();
                        assert_eq!(pl.partial.function.ends_with("_mods"), mods, "{what}");
                    }
                }
            }
        }
    }

    /// Few sequences are split until the SMs stream together; many sequences fill the GPU
    /// alone and pay no combine pass. Derived from the device: the same shape splits less on
    /// a GPU with fewer SMs or less bandwidth per SM.
    #[test]
    fn splits_follow_the_device_and_the_problem() {
        let caps = DeviceCaps::SM90;
        // One sequence, 32k keys, 8 K/V heads: enough blocks that each SM streams.
        let pl = bf16(1, 1, 32768, 32, 8, 128).unwrap();
        let blocks = pl.splits * 8;
        assert!(blocks >= caps.sms as usize / 2, "{pl:?}");
        assert!(pl.combine.is_some());
        // 64 sequences of 4096 keys: 512 blocks without splitting, more than one wave.
        let pl = bf16(64, 1, 4096, 32, 8, 128).unwrap();
        assert_eq!((pl.splits, pl.combine.is_none()), (1, true), "{pl:?}");
        // A short cache is not split into tiles of nothing.
        let pl = bf16(1, 1, 100, 32, 8, 128).unwrap();
        assert!(pl.splits <= 2, "{pl:?}");
        // MHA at one row: 32 K/V heads per sequence.
        let mha = bf16(8, 1, 16384, 32, 32, 128).unwrap();
        assert!(mha.splits * 8 * 32 >= caps.sms as usize, "{mha:?}");
        // The same shape on an A100 (fewer SMs, less bandwidth) splits no more than on an H100.
        let p = problem(1, 1, 32768, 32, 8, 128, DType::BF16, &FlashAttn::new(0.1));
        let a100 = plan(
            &p,
            DType::BF16,
            &DeviceCaps::SM80,
            &by_smem(DeviceCaps::SM80),
        )
        .unwrap()
        .unwrap();
        let h100 = plan(&p, DType::BF16, &caps, &by_smem(caps))
            .unwrap()
            .unwrap();
        assert!(a100.splits <= h100.splits, "{a100:?} {h100:?}");
        // Deterministic: the same problem and device give the same plan.
        assert_eq!(
            h100,
            plan(&p, DType::BF16, &caps, &by_smem(caps))
                .unwrap()
                .unwrap()
        );
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
            (86, base.partial.grid.1, base.partial.grid.2)
        );
        assert_eq!(pl.partial.function, base.partial.function);
        let one = at(&opts(1));
        assert_eq!((one.partial.grid.0, one.combine), (1, None));
    }
}
