//! Decode: a few query rows per sequence against a long KV cache (split-KV, GQA-packed).
//!
//! With one query row per head the prefill kernel fills one lane of its 64-lane tiles and reads
//! every K/V row once per *query* head. Decode is memory-bound instead, so this kernel is built
//! around streaming the cache once, on every core, at the speed memory delivers it:
//!
//! * **Balanced splits** ([`plan`]): the keys of all sequences are laid end to end and cut into
//!   stretches of equal bytes, a multiple of the thread count, so both cores of a two-core
//!   machine stream the same amount whatever the batch and the lengths. The pieces of one
//!   sequence (its splits) are merged by log-sum-exp afterwards.
//! * **GQA packing**: the query rows of all heads of a KV head, and all `seq_q` rows
//!   (`group · seq_q` rows), are folded into the online softmax together, so each K/V row is
//!   loaded from memory once and then served from L1 to every row that needs it.
//! * **Read as stored**: the AVX-512 and AVX2 kernels read f32, f16, bf16 and FP8 (e4m3) rows
//!   in place and convert 16 (8) elements at a time in registers (bf16 `q·k` runs on
//!   `vdpbf16ps` where the CPU has it, or on the AMX tile unit where the process may use it,
//!   and the probabilities are then rounded to bf16 for `P V`, as the GPU kernels do); the
//!   portable kernels, and other cache types, convert each block of `BK` keys to f32 first, in
//!   address order.
//! * **Head-dim elements in SIMD lanes**: `q·k` is a register-blocked FMA (AVX-512: four rows ×
//!   four keys; AVX2: eight accumulators, up to eight rows × one key, from query rows packed
//!   per register block) over the head dim and one shared reduction tree (bf16 with eight rows
//!   or more on AVX-512: the block transposed to keys in lanes, no reduction); `P V` adds
//!   `p · V[j]` to rows of `O` held in registers, with no reduction at all. The online softmax
//!   runs on several rows at once, their statistics in lanes.
//! * **bf16 `q·k` on AMX** (`x86/amx.rs`): a whole block of 16 keys, one stride apart, against
//!   up to 16 query rows is four `TDPBF16PS` at d = 128, `Sᵀ = K Qᵀ` with K loaded as it lies
//!   and the query rows packed into tiles once per item; the tiles take head dims that are a
//!   multiple of 32 up to 192, and other blocks (an item's last, partial one, a paged block
//!   that crosses pages) run on `vdpbf16ps`. `P V` of such a block, where every row sees all
//!   16 keys, runs there too (`x86::tile_pv`): V loaded as it lies, `P` rounded to bf16 and
//!   entered twice, once per half of the head-dim pairs, so that `O` comes out pair-split
//!   ([`o_elem`]) and is put back in order once per item. Blocks the tiles do not take run on
//!   the FMAs in the same layout. The half of each pair a pass leaves out is multiplied by
//!   zero, so an infinite or NaN V element would turn its neighbour's column NaN: an item
//!   whose `O` holds a NaN runs again with `P V` on the FMAs.
//! * **Blocks of `BK` keys**, one KV head after the other; while the scores of a KV head run,
//!   the rows [`PREFETCH_BYTES`] ahead are prefetched into L2 a row at a time between the
//!   kernel's own loads (the kernels read several rows at once, which the hardware prefetchers
//!   do not follow), in address order where the heads of a key are one run of memory.
//! * **Combine**: the item that finishes a sequence's last split merges the partials of all
//!   its splits through their log-sum-exp, in split order, then normalises once (no second
//!   pass over the pool); a sequence with one split is normalised by its item directly.
//!
//! The plan depends only on the shape and the rayon thread count, and every item and merge runs
//! in a fixed order, so results are bitwise identical from run to run.

pub(super) mod plan;
mod prefetch;
mod run;
mod scratch;

use std::any::TypeId;
use std::ops::Range;

use super::elem::{load_rows, Elem};
use super::exp2::exp2;
use super::extras::Extras;
#[cfg(target_arch = "x86_64")]
use super::kernel::{Avx512, Fused};
use super::kernel::{Isa, Kernel, Portable};
use super::SyncPtr;
use crate::problem::{KeyRows, Problem, Strides};
use crate::semantics::{alibi_bias, group_size, LOG2_E};
use plan::{Item, Plan};
use prefetch::Ahead;
use prefetch::Pf;
use scratch::{with_scratch, Scratch};

/// Decode takes every call with at most this many query rows per sequence (speculative
/// verification and chunked-prefill tails included), whatever the group: it reads K/V once
/// where the prefill kernel reads them once per query head and fills 16 of its 64 lanes.
/// Measured with `tests::threshold_timing` (1 × 8192 keys, d 128, f32, 2 threads, a loaded
/// machine): at seq_q 16 decode took 62 ms against prefill's 252 (32/8 heads) and 17 against 76
/// (8/8).
pub(crate) const MAX_DECODE_SEQ_Q: usize = 16;
/// Beyond [`MAX_DECODE_SEQ_Q`], decode is still chosen while the rows of a KV head
/// (`group · seq_q`, the rows every K/V row serves) are at most this many: at 8/8 heads it took
/// 30 ms against 57 at seq_q 32 and lost at 64 (88 against 80).
pub(crate) const MAX_DECODE_ROWS_PER_KV_HEAD: usize = 32;

/// Keys per block: the scores of one query row against a block are one AVX-512 vector, and the
/// K and V rows of a block stay in L1 while every row of their KV head uses them.
const BK: usize = 16;
/// How far ahead the K and V rows are prefetched, in bytes of the `(block, KV head)` steps
/// between: far enough that a row arrives before its step even at a few hundred nanoseconds of
/// memory latency and a core's full share of the bandwidth (~10 GB/s · 300 ns = 3 KiB), and a
/// small part of the L2 (1 MiB) the rows wait in. 16-256 KiB measured alike (8/1 heads, one
/// thread, 16 MiB caches); 8 KiB was slower, and prefetching nothing half as fast.
const PREFETCH_BYTES: usize = 64 << 10;

/// `true` when `p` goes to the decode kernel: few query rows per sequence
/// ([`MAX_DECODE_SEQ_Q`]) or per KV head ([`MAX_DECODE_ROWS_PER_KV_HEAD`]).
pub(crate) fn is_decode(p: &Problem) -> bool {
    let group = group_size(p.heads, p.kv_heads.max(1));
    p.max_seq_q <= MAX_DECODE_SEQ_Q
        || p.max_seq_q.saturating_mul(group) <= MAX_DECODE_ROWS_PER_KV_HEAD
}

/// The storage types the kernels can read in place.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    F32,
    F16,
    Bf16,
    /// FP8 (e4m3), converted in registers as its rows are read (an FP8 cache streams one
    /// byte per element, not four through an f32 copy).
    E4m3,
    Other,
}

/// The [`Kind`] of `T`; folds to a constant in every instantiation.
#[inline(always)]
fn kind<T: 'static>() -> Kind {
    let t = TypeId::of::<T>();
    if t == TypeId::of::<f32>() {
        Kind::F32
    } else if t == TypeId::of::<half::f16>() {
        Kind::F16
    } else if t == TypeId::of::<half::bf16>() {
        Kind::Bf16
    } else if t == TypeId::of::<float8::F8E4M3>() {
        Kind::E4m3
    } else {
        Kind::Other
    }
}

/// Whether bf16 `q·k` runs on a tile unit: none, the AMX hardware, or (tests) its software
/// model, which runs the same tiling on any machine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum TileUse {
    Off,
    Amx,
    #[cfg(test)]
    Model,
}

/// Everything a work item reads, shared by all of them.
struct Ctx<'a, T, KV = T> {
    p: &'a Problem,
    slopes: Option<&'a [f32]>,
    q: &'a [T],
    k: &'a [KV],
    v: &'a [KV],
    plan: &'a Plan,
    /// bf16 `q·k` with `vdpbf16ps` (AVX-512 BF16 present and bf16 inputs).
    bf16_dot: bool,
    /// bf16 `q·k` on the tile unit, for the blocks it takes (see `x86::tile_scores`).
    tiles: TileUse,
    /// Outputs and log-sum-exp, written by an item when its sequence has one split, else by the
    /// combine.
    out: SyncPtr<T>,
    lse: SyncPtr<f32>,
    /// Partials: unnormalised `O` (`rows × d`), running max `m` (base 2) and sum `l`.
    po: SyncPtr<f32>,
    pm: SyncPtr<f32>,
    pl: SyncPtr<f32>,
    /// Per sequence: its splits finished so far.
    done: Vec<std::sync::atomic::AtomicUsize>,
    /// The call's bias and block mask, if any.
    extras: &'a Extras<'a>,
}

/// Runs the whole problem; returns the contiguous output and the log-sum-exp.
pub(crate) fn forward<T: Elem, KV: Elem>(
    p: &Problem,
    slopes: Option<&[f32]>,
    q: &[T],
    k: &[KV],
    v: &[KV],
    extras: &Extras,
) -> (Vec<T>, Vec<f32>) {
    forward_with(
        Isa::detect(),
        true,
        TileUse::Amx,
        rayon::current_num_threads(),
        plan::MIN_TASK_BYTES,
        p,
        slopes,
        q,
        [k, v],
        extras,
    )
}

/// The AVX-512 kernels need masked 16-bit loads (BW, VL) beside the foundation.
#[cfg(target_arch = "x86_64")]
fn has_avx512_decode() -> bool {
    is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vl")
}

/// [`forward`] with a chosen instruction set (the caller checked that the CPU has it), whether
/// bf16 products may use `vdpbf16ps` (where the CPU has it) and a tile unit (where the process
/// may use AMX, or the model), and the thread count and smallest task the plan is made for
/// (tests split small caches many ways with a small one).
#[allow(clippy::too_many_arguments)]
fn forward_with<T: Elem, KV: Elem>(
    isa: Isa,
    bf16_dot: bool,
    tiles: TileUse,
    threads: usize,
    min_task: usize,
    p: &Problem,
    slopes: Option<&[f32]>,
    q: &[T],
    [k, v]: [&[KV]; 2],
    extras: &Extras,
) -> (Vec<T>, Vec<f32>) {
    let d = p.head_dim;
    if p.batch == 0 || p.total_q == 0 || p.heads == 0 || d == 0 {
        let out = vec![T::from_f32(0.0); p.total_q * p.heads * d];
        return (out, vec![f32::NEG_INFINITY; p.total_q * p.heads]);
    }
    // NaN until written, so that an element no pass writes shows up in every test.
    let mut out = vec![T::from_f32(f32::NAN); p.total_q * p.heads * d];
    let mut lse = vec![f32::NAN; p.total_q * p.heads];
    #[cfg(target_arch = "x86_64")]
    let isa = match isa {
        Isa::Avx512 if !has_avx512_decode() => Isa::Avx2Fma,
        // The AVX2 kernels read f16 rows through F16C (every AVX2 CPU has it; stay correct
        // on one that would not).
        Isa::Avx2Fma if !is_x86_feature_detected!("f16c") => Isa::Portable,
        isa => isa,
    };
    #[cfg(target_arch = "x86_64")]
    let bf16_dot = bf16_dot
        && isa == Isa::Avx512
        && kind::<T>() == Kind::Bf16
        && kind::<KV>() == Kind::Bf16
        && is_x86_feature_detected!("avx512bf16");
    // No bf16 dot product outside x86.
    #[cfg(not(target_arch = "x86_64"))]
    let bf16_dot = {
        let _ = bf16_dot;
        false
    };
    // The tiles take the AVX-512 BF16 calls whose head dim is whole tile steps, few enough that
    // the query tiles of a KV head stay loaded (`x86::MAX_Q_TILES`).
    #[cfg(target_arch = "x86_64")]
    let tiles = match tiles {
        _ if !bf16_dot || !d.is_multiple_of(x86::TILE_D) || d / x86::TILE_D > x86::MAX_Q_TILES => {
            TileUse::Off
        }
        TileUse::Amx if !super::dispatch::amx_usable() => TileUse::Off,
        t => t,
    };
    #[cfg(not(target_arch = "x86_64"))]
    let tiles = {
        let _ = tiles;
        TileUse::Off
    };
    let key_bytes = 2 * p.kv_heads * d * std::mem::size_of::<KV>();
    let plan = Plan::new(p, threads, key_bytes, min_task);
    let mut po = vec![0f32; plan.part_rows * d];
    let mut pm = vec![f32::NEG_INFINITY; plan.part_rows];
    let mut pl = vec![0f32; plan.part_rows];
    let ctx = Ctx {
        p,
        slopes,
        q,
        k,
        v,
        plan: &plan,
        bf16_dot,
        tiles,
        out: SyncPtr(out.as_mut_ptr()),
        lse: SyncPtr(lse.as_mut_ptr()),
        po: SyncPtr(po.as_mut_ptr()),
        pm: SyncPtr(pm.as_mut_ptr()),
        pl: SyncPtr(pl.as_mut_ptr()),
        done: (0..p.batch).map(|_| Default::default()).collect(),
        extras,
    };
    // The partial pass: one task per stretch of the key line, claimed by this thread and the
    // pool's as they come (`run`); a single task runs here, without waking the pool.
    let task = |range: &Range<usize>| {
        with_scratch(|sc| {
            #[cfg(target_arch = "x86_64")]
            x86::tiles_on(tiles, true);
            for &item in &plan.items[range.clone()] {
                match isa {
                    #[cfg(target_arch = "x86_64")]
                    // SAFETY: avx512f/bw/vl were detected just above.
                    Isa::Avx512 => unsafe { item_avx512(&ctx, sc, item) },
                    #[cfg(target_arch = "x86_64")]
                    // SAFETY: the caller saw avx2 and fma on this CPU, f16c was detected above.
                    Isa::Avx2Fma => unsafe { item_avx2(&ctx, sc, item) },
                    Isa::Portable => run_item::<T, KV, Portable>(&ctx, sc, item),
                }
            }
            #[cfg(target_arch = "x86_64")]
            x86::tiles_on(tiles, false);
        })
    };
    if plan.tasks.len() == 1 {
        task(&plan.tasks[0]);
    } else {
        run::run(plan.tasks.len(), threads.saturating_sub(1), &|t| {
            task(&plan.tasks[t])
        });
    }
    // Sequences that see no key (or have no query row): exact zeros, lse -inf.
    for b in (0..p.batch).filter(|&b| plan.seqs[b].splits == 0) {
        let seq = p.seq(b);
        let rows = seq.out_row * p.heads * d..(seq.out_row + seq.seq_q) * p.heads * d;
        out[rows].fill(T::from_f32(0.0));
        for h in 0..p.heads {
            let at = seq.lse_base + h * p.lse_head_stride();
            lse[at..at + seq.seq_q].fill(f32::NEG_INFINITY);
        }
    }
    (out, lse)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
fn item_avx512<T: Elem, KV: Elem>(ctx: &Ctx<T, KV>, sc: &mut Scratch, item: Item) {
    run_item::<T, KV, Avx512>(ctx, sc, item)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
fn item_avx2<T: Elem, KV: Elem>(ctx: &Ctx<T, KV>, sc: &mut Scratch, item: Item) {
    run_item::<T, KV, Fused>(ctx, sc, item)
}

/// One block of K or V rows for one KV head: key `c`'s row is `src[row(c)..row(c) + d]`.
pub(super) struct Rows<'a, T> {
    src: &'a [T],
    off: &'a [usize; BK],
    shift: usize,
}

impl<T> Rows<'_, T> {
    /// Where key `c`'s row starts.
    #[inline(always)]
    fn row(&self, c: usize) -> usize {
        self.off[c] + self.shift
    }
}

/// Element offsets of key rows `j0 .. j0 + n` at KV head 0: one address per run of consecutive
/// rows (the block, or its part in one page).
#[inline(always)]
fn row_offsets(strides: &Strides, keys: &KeyRows, j0: usize, n: usize) -> [usize; BK] {
    let mut off = [0usize; BK];
    let mut c = 0;
    while c < n {
        let run = keys.run(j0 + c, n - c);
        let (b, row) = keys.at(j0 + c);
        let base = strides.at(b, row, 0);
        for (r, o) in off[c..c + run].iter_mut().enumerate() {
            *o = base + r * strides.seq;
        }
        c += run;
    }
    off
}

/// How an item reaches the K and V rows of a block.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Access {
    /// Read as stored, where they lie (contiguous head dim).
    InPlace,
    /// Copied as stored into a contiguous block (strided head dim).
    Gather,
    /// Converted to f32 into a contiguous block.
    Convert,
}

/// A block's K or V rows: key `c`, KV head `h` starts at `src[base[c] + h * head]`.
struct BlockRows<'a, U> {
    src: &'a [U],
    base: [usize; BK],
    head: usize,
}

impl<U> BlockRows<'_, U> {
    /// The rows of KV head `h`.
    #[inline(always)]
    fn at(&self, h: usize) -> Rows<'_, U> {
        Rows {
            src: self.src,
            off: &self.base,
            shift: h * self.head,
        }
    }
}

/// Copies keys `j0 .. j0 + n`, every KV head, into `dst` (`(key, head, d)`, dense) through `f`
/// (as stored, or converted to f32), in the order they lie in memory.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn copy_block<T: Elem, U: Copy>(
    dst: &mut [U],
    src: &[T],
    s: &Strides,
    keys: &KeyRows,
    j0: usize,
    n: usize,
    heads: usize,
    d: usize,
    f: impl Fn(&mut [U], &[T]),
    one: impl Fn(T) -> U,
) {
    for (c, rows) in dst[..n * heads * d].chunks_exact_mut(heads * d).enumerate() {
        let (b, r) = keys.at(j0 + c);
        for (h, row) in rows.chunks_exact_mut(d).enumerate() {
            let base = s.at(b, r, h);
            if s.dim == 1 {
                f(row, &src[base..base + d]);
            } else {
                for (x, o) in row.iter_mut().enumerate() {
                    *o = one(src[base + x * s.dim]);
                }
            }
        }
    }
}

/// One work item: keys `lo .. hi` of sequence `b`, every query row of every head.
#[inline(always)]
fn run_item<T: Elem, KV: Elem, K: Ops>(ctx: &Ctx<T, KV>, sc: &mut Scratch, it: Item) {
    run_item_pv::<T, KV, K>(ctx, sc, it, true)
}

/// [`run_item`], `P V` on the tiles where `pv_tiles` and the rows fill them (see below).
fn run_item_pv<T: Elem, KV: Elem, K: Ops>(
    ctx: &Ctx<T, KV>,
    sc: &mut Scratch,
    it: Item,
    pv_tiles: bool,
) {
    let p = ctx.p;
    let d = p.head_dim;
    let b = it.b;
    let seq = p.seq(b);
    let sq = seq.seq_q;
    let group = group_size(p.heads, p.kv_heads);
    let rows = p.heads * sq;
    let gr = group * sq;
    let q_len = K::q_len(gr, d);
    let packed = if K::PACKS_Q { p.kv_heads * q_len } else { 0 };
    // With `q·k` on the tiles, `O` is pair-split, and `P V` runs there too where the rows of a
    // KV head fill at least half of their tiles: a tile product costs about the same for any
    // rows up to 16 and its `O` is padded to them, where the FMAs' cost follows the rows (at
    // 32/8 heads, 4 rows per KV head, the tiles were 3-8% slower; at 8/1, 8 rows, 1.1-2.3x
    // faster).
    let split = ctx.tiles != TileUse::Off;
    #[cfg(target_arch = "x86_64")]
    let (tile_pv, orows) = {
        let padded = gr.next_multiple_of(x86::TILE_ROWS);
        if split && pv_tiles && padded <= 2 * gr {
            (true, padded)
        } else {
            (false, gr)
        }
    };
    #[cfg(not(target_arch = "x86_64"))]
    let (tile_pv, orows) = (false, gr);
    sc.reserve(rows, p.kv_heads * orows, packed, sq, BK * p.kv_heads * d, d);
    // Row of `O` of scratch row r.
    let o_row = |r: usize| r / gr * orows + r % gr;
    // Scratch row of (head h, query i).
    let row_of = |h: usize, i: usize| ((h / group) * sq + i) * group + h % group;
    for h in 0..p.heads {
        for i in 0..sq {
            let r = row_of(h, i);
            load_rows(
                &mut sc.q[r * d..(r + 1) * d],
                ctx.q,
                &p.q,
                b,
                seq.q_row + i,
                1,
                h,
                d,
            );
            sc.m[r] = f32::NEG_INFINITY;
            sc.l[r] = 0.0;
        }
    }
    if ctx.bf16_dot {
        // The query is bf16, so its f32 copy holds bf16 values exactly: the upper halves.
        // Rows an even number of elements apart, padded with zeros, so the kernels read whole
        // pairs of the last one.
        let dq = d.next_multiple_of(2);
        for (h, x) in sc.qh[..rows * dq]
            .chunks_exact_mut(dq)
            .zip(sc.q[..rows * d].chunks_exact(d))
        {
            for (h, x) in h.iter_mut().zip(x) {
                *h = (x.to_bits() >> 16) as u16;
            }
            h[d..].fill(0);
        }
    }
    #[cfg(target_arch = "x86_64")]
    if ctx.tiles != TileUse::Off {
        let (dq, tq) = (d.next_multiple_of(2), &mut sc.tq);
        tq.row_chunks = gr.div_ceil(x86::TILE_ROWS);
        // Few rows per KV head share a set of tiles: fewer tile loads per block.
        tq.heads = (x86::TILE_ROWS / gr).max(1);
        tq.tiles = d / x86::TILE_D;
        let per = tq.tiles * x86::TILE_WORDS;
        let sets = p.kv_heads.div_ceil(tq.heads) * tq.row_chunks;
        tq.q.resize(sets * per, 0);
        tq.q[..sets * per].fill(0);
        for kvh in 0..p.kv_heads {
            for rc in 0..tq.row_chunks {
                let (set, col, n) = tq.slot(kvh, rc, gr);
                let r = kvh * gr + rc * x86::TILE_ROWS;
                let out = &mut tq.q[set * per..(set + 1) * per];
                x86::pack_q(&sc.qh[r * dq..], dq, n, d, col, out);
            }
        }
        // New rows: none of them is in the tile registers yet.
        tq.loaded = None;
    }
    sc.o[..p.kv_heads * orows * d].fill(0.0);
    // Each row sees one interval of keys, prefix ranges or not (`SeqMask::row_range`).
    let mask = p.mask(b, &seq);
    for i in 0..sq {
        sc.range[i] = mask.row_range(i);
    }
    let keys = p.key_rows(b, &seq);
    // Without softcap the scale and log2(e) fold into one factor; with it, tanh needs the true
    // score.
    let softcap = p.score.softcap > 0.0;
    let scale = if softcap {
        p.score.scale
    } else {
        p.score.scale * LOG2_E
    };
    let access = |s: &Strides| {
        if !K::reads::<KV>() {
            Access::Convert
        } else if s.dim == 1 {
            Access::InPlace
        } else {
            Access::Gather
        }
    };
    let convert = access(&p.k) == Access::Convert;
    if K::PACKS_Q {
        // For the rows the kernels read: converted blocks are f32.
        for kvh in 0..p.kv_heads {
            let (q, out) = (
                &sc.q[kvh * gr * d..(kvh + 1) * gr * d],
                &mut sc.qp[kvh * q_len..(kvh + 1) * q_len],
            );
            if convert {
                K::pack_q::<f32>(q, gr, d, out);
            } else {
                K::pack_q::<KV>(q, gr, d, out);
            }
        }
    }
    let block_len = BK * p.kv_heads * d;
    let mut gk: Vec<KV> = Vec::new();
    let mut gv: Vec<KV> = Vec::new();
    if access(&p.k) == Access::Gather {
        gk = vec![KV::from_f32(0.0); block_len];
    }
    if access(&p.v) == Access::Gather {
        gv = vec![KV::from_f32(0.0); block_len];
    }
    let dense: [usize; BK] = std::array::from_fn(|c| c * p.kv_heads * d);
    let step_bytes = 2 * BK * d * std::mem::size_of::<KV>();
    let ahead = Ahead {
        k: ctx.k,
        v: ctx.v,
        keys,
        hi: it.hi,
        steps: PREFETCH_BYTES.div_ceil(step_bytes),
    };
    // The steps the blocks below prefetch start `steps` ahead: ask for the ones before that
    // now, so that a short item (a small cache split many ways) does not wait on memory for
    // them one demand miss at a time.
    let mut step = (it.lo, 0);
    for _ in 0..ahead.steps {
        if step.0 >= it.hi {
            break;
        }
        ahead.rows(p, &mut step).fetch_all();
    }

    let mut j0 = it.lo;
    while j0 < it.hi {
        let n = BK.min(it.hi - j0);
        // The part of the block each query index sees.
        for i in 0..sq {
            let (lo, hi) = sc.range[i];
            let (c0, c1) = (lo.max(j0), hi.min(j0 + n));
            sc.cols[i] = if c0 < c1 { (c0 - j0, c1 - j0) } else { (0, 0) };
        }
        let blk = Block {
            j0,
            n,
            group,
            sq,
            sk: seq.seq_k,
            b,
            scale,
            softcap,
            split,
            tile_pv,
            orows,
        };
        if convert {
            let (mut kb, mut vb) = (std::mem::take(&mut sc.k), std::mem::take(&mut sc.v));
            let cv = |o: &mut [f32], i: &[KV]| KV::load_f32(o, i);
            copy_block(
                &mut kb,
                ctx.k,
                &p.k,
                &keys,
                j0,
                n,
                p.kv_heads,
                d,
                cv,
                KV::to_f32,
            );
            copy_block(
                &mut vb,
                ctx.v,
                &p.v,
                &keys,
                j0,
                n,
                p.kv_heads,
                d,
                cv,
                KV::to_f32,
            );
            let kr = BlockRows {
                src: &kb[..],
                base: dense,
                head: d,
            };
            let vr = BlockRows {
                src: &vb[..],
                base: dense,
                head: d,
            };
            block::<T, KV, f32, K>(ctx, sc, &blk, &kr, &vr, &ahead);
            (sc.k, sc.v) = (kb, vb);
        } else {
            let rows_of = |g: &'_ mut Vec<KV>, src: &'_ [KV], s: &Strides| {
                if g.is_empty() {
                    (None, row_offsets(s, &keys, j0, n), s.head)
                } else {
                    let cp = |o: &mut [KV], i: &[KV]| o.copy_from_slice(i);
                    copy_block(g, src, s, &keys, j0, n, p.kv_heads, d, cp, |x| x);
                    (Some(()), dense, d)
                }
            };
            let (kg, kbase, khead) = rows_of(&mut gk, ctx.k, &p.k);
            let (vg, vbase, vhead) = rows_of(&mut gv, ctx.v, &p.v);
            let kr = BlockRows {
                src: if kg.is_some() { &gk[..] } else { ctx.k },
                base: kbase,
                head: khead,
            };
            let vr = BlockRows {
                src: if vg.is_some() { &gv[..] } else { ctx.v },
                base: vbase,
                head: vhead,
            };
            block::<T, KV, KV, K>(ctx, sc, &blk, &kr, &vr, &ahead);
        }
        j0 += n;
    }

    // The tiles multiply the other half of each V pair by zero (`x86::tile_pv`), so an
    // infinite or NaN V element would make its pair neighbour's column NaN as well. Only then
    // is an element of `O` NaN where the FMAs would not make it one: the item runs again with
    // `P V` on the FMAs, which keep the columns apart (a check of `O`, not of every V row).
    if tile_pv && sc.o[..p.kv_heads * orows * d].iter().any(|x| x.is_nan()) {
        return run_item_pv::<T, KV, K>(ctx, sc, it, false);
    }
    let sp = ctx.plan.seqs[b];
    if sp.splits == 1 {
        // The only split: normalise and write the output rows here.
        for h in 0..p.heads {
            for i in 0..sq {
                let r = row_of(h, i);
                let (m, l) = (sc.m[r], sc.l[r]);
                let inv = if l == 0.0 { 0.0 } else { 1.0 / l };
                let base = (seq.out_row + i) * p.heads * d + h * d;
                let o = &sc.o[o_row(r) * d..(o_row(r) + 1) * d];
                for x in 0..d {
                    let o = if l == 0.0 {
                        0.0
                    } else {
                        o[o_elem(split, x)] * inv
                    };
                    // SAFETY: element (row, h, x) belongs to this sequence, written by its only
                    // item, and lies inside the output `forward_with` allocated
                    // (total_q · heads · d elements).
                    unsafe { *ctx.out.0.add(base + x) = T::from_f32(o) };
                }
                let at = seq.lse_base + h * p.lse_head_stride() + i;
                // SAFETY: as above, for the row's log-sum-exp.
                unsafe { *ctx.lse.0.add(at) = row_lse(m, l) };
            }
        }
        return;
    }
    // Leave the partials, head-major: rows of split s follow those of splits 0..s.
    let base = sp.part_row + it.split * rows;
    for h in 0..p.heads {
        for i in 0..sq {
            let (r, pr) = (row_of(h, i), base + h * sq + i);
            let o = &sc.o[o_row(r) * d..(o_row(r) + 1) * d];
            // SAFETY: partial rows `base .. base + rows` belong to this item alone and lie
            // inside the buffers `forward_with` allocated (`plan.part_rows` rows of `d`).
            unsafe {
                let po = ctx.po.0.add(pr * d);
                for x in 0..d {
                    *po.add(x) = o[o_elem(split, x)];
                }
                *ctx.pm.0.add(pr) = sc.m[r];
                *ctx.pl.0.add(pr) = sc.l[r];
            }
        }
    }
    // The item that finishes its sequence's last split merges them all (in split order, so
    // which item that is changes no bit). AcqRel: the partials written above are published to
    // the merging item, and it sees every other item's.
    let done = ctx.done[b].fetch_add(1, std::sync::atomic::Ordering::AcqRel) + 1;
    if done == sp.splits {
        for h in 0..p.heads {
            combine(ctx, b, h);
        }
    }
}

/// The natural-log log-sum-exp of a row from its base-2 running max and sum; `-inf` for a row
/// that saw no key.
#[inline]
fn row_lse(m: f32, l: f32) -> f32 {
    if l == 0.0 {
        f32::NEG_INFINITY
    } else {
        (m + l.log2()) / LOG2_E
    }
}

/// Where element `x` of a row of `O` lies: at `x`, or, pair-split (the layout the tile `P V`
/// leaves, `x86::tile_pv`), the even elements of each 32 first, then the odd ones.
#[inline(always)]
fn o_elem(split: bool, x: usize) -> usize {
    if split {
        x & !31 | (x & 1) << 4 | (x & 31) >> 1
    } else {
        x
    }
}

/// Where one block of an item stands.
struct Block {
    /// First key of the block, and its keys.
    j0: usize,
    n: usize,
    group: usize,
    sq: usize,
    sk: usize,
    b: usize,
    /// Multiplies `q·k` (with log2(e) folded in unless there is a softcap).
    scale: f32,
    softcap: bool,
    /// The rows of `O` pair-split ([`o_elem`]), and `P V` of whole blocks on the tile unit.
    split: bool,
    tile_pv: bool,
    /// Rows of `O` per KV head: its `group · seq_q` rows, padded to whole tiles for the tile
    /// `P V`.
    orows: usize,
}

/// Every row of an item against one block: the scores, the online softmax, `P V`, one KV head
/// after the other (the rows of a KV head, `group · seq_q` of them, consecutive in the
/// scratch, share each K and V row). While the scores of a KV head run, the rows
/// [`PREFETCH_BYTES`] ahead are prefetched (see [`Ahead`]).
#[inline(always)]
fn block<T: Elem, KV: Elem, U: Elem, K: Ops>(
    ctx: &Ctx<T, KV>,
    sc: &mut Scratch,
    blk: &Block,
    k: &BlockRows<U>,
    v: &BlockRows<U>,
    ahead: &Ahead<KV>,
) {
    let p = ctx.p;
    let d = p.head_dim;
    let (group, sq, n) = (blk.group, blk.sq, blk.n);
    let gr = group * sq;
    let mut step = ahead.first(blk.j0, p.kv_heads);
    sc.pf.clear();
    for kvh in 0..p.kv_heads {
        let r0 = kvh * gr;
        let mut pf = ahead.rows(p, &mut step);
        // With `q·k` on the tiles, a fifth of the block's time, half of the step's prefetches
        // wait for `P V`; the vector `q·k` lasts long enough to spread them all (f32 8/1
        // heads, one thread: 8% slower with the split).
        sc.pf.push(if ctx.tiles != TileUse::Off {
            pf.split()
        } else {
            Pf::NONE
        });
        #[cfg(target_arch = "x86_64")]
        if x86::tile_scores(
            ctx.tiles,
            &mut sc.tq,
            kvh,
            gr,
            d,
            &k.at(kvh),
            0..n,
            &mut sc.s[r0..r0 + gr],
            &mut pf,
        ) {
            continue;
        }
        let q = if K::PACKS_Q {
            let n = K::q_len(gr, d);
            &sc.qp[kvh * n..(kvh + 1) * n]
        } else {
            &sc.q[r0 * d..(r0 + gr) * d]
        };
        K::scores(
            ctx.bf16_dot,
            q,
            &sc.qh[r0 * d.next_multiple_of(2)..(r0 + gr) * d.next_multiple_of(2)],
            gr,
            d,
            &k.at(kvh),
            0..n,
            &mut sc.s[r0..r0 + gr],
            &mut pf,
        );
    }
    // The online softmax of every row, after the score modifiers (scale included) where there
    // are any.
    let rows = p.kv_heads * gr;
    // Row r is (KV head, query i, head within the group): r = (kvh · sq + i) · group + g.
    for rows in sc.rcols[..rows].chunks_exact_mut(gr) {
        for (c, &cols) in rows.chunks_exact_mut(group).zip(&sc.cols[..sq]) {
            c.fill(cols);
        }
    }
    // Softcap and ALiBi need the scaled scores (then the softmax scales by 1); so does a bias
    // when the scale is not positive. Otherwise the bias is added to the raw products divided
    // by the scale the softmax then applies, which keeps its fused scaling.
    let mut scale = blk.scale;
    let extras = ctx.extras.is_some();
    if blk.softcap || ctx.slopes.is_some() || (extras && blk.scale <= 0.0) {
        for r in 0..rows {
            let (c0, c1) = sc.rcols[r];
            let (i, h) = (r / group % sq, r / gr * group + r % group);
            let slope = ctx
                .slopes
                .map_or(0.0, |sl| sl[blk.b * p.alibi_batch_stride + h]);
            for c in c0..c1 {
                let x = sc.s[r][c] * blk.scale;
                let raw = if blk.softcap {
                    p.score.cap(x) * LOG2_E
                } else {
                    x
                };
                let bias = if slope != 0.0 {
                    alibi_bias(slope, i, blk.j0 + c, sq, blk.sk) * LOG2_E
                } else {
                    0.0
                };
                sc.s[r][c] = raw - bias;
            }
        }
        scale = 1.0;
    }
    if extras {
        // The additive bias after softcap and ALiBi; a hidden block masks its keys.
        for r in 0..rows {
            let (c0, c1) = sc.rcols[r];
            let (i, h) = (r / group % sq, r / gr * group + r % group);
            let ex = ctx.extras.at(blk.b, h);
            ex.apply_row(&mut sc.s[r], i, blk.j0, c0..c1, LOG2_E / scale);
        }
    }
    K::softmax_rows(
        &mut sc.s[..rows],
        &sc.rcols[..rows],
        scale,
        &mut sc.m[..rows],
        &mut sc.l[..rows],
        &mut sc.corr[..rows],
    );
    // P V over runs of query indices that see the same columns (all of them, except in the
    // blocks where a causal diagonal or a window edge passes).
    for kvh in 0..p.kv_heads {
        let r0 = kvh * gr;
        let o0 = kvh * blk.orows;
        let vr = v.at(kvh);
        #[cfg(target_arch = "x86_64")]
        if blk.tile_pv
            && n == BK
            && sc.cols[..sq].iter().all(|&c| c == (0, BK))
            && x86::tile_pv(
                ctx.tiles,
                &mut sc.tq,
                &mut sc.o[o0 * d..(o0 + blk.orows) * d],
                gr,
                d,
                &sc.corr[r0..r0 + gr],
                &sc.s[r0..r0 + gr],
                &vr,
                &mut sc.pf[kvh],
            )
        {
            continue;
        }
        let mut i = 0;
        while i < sq {
            let c = sc.cols[i];
            let mut e = i + 1;
            while e < sq && sc.cols[e] == c {
                e += 1;
            }
            if c.0 < c.1 {
                let (t0, t1) = (r0 + i * group, r0 + e * group);
                let o = o0 + i * group;
                K::pv(
                    ctx.bf16_dot,
                    blk.split,
                    &mut sc.o[o * d..(o + t1 - t0) * d],
                    t1 - t0,
                    d,
                    Some(&sc.corr[t0..t1]),
                    &sc.s[t0..t1],
                    &vr,
                    c.0..c.1,
                    &mut sc.pf[kvh],
                );
            }
            i = e;
        }
        sc.pf[kvh].fetch_all();
    }
}

/// Turns one row's raw dot products `s[cols]` into probabilities (`2^(scale · s - m_new)`, 0
/// outside `cols`) and updates its running max and sum; returns the correction
/// `2^(m_old - m_new)` its `O` must be scaled by.
#[inline(always)]
fn softmax<K: Kernel>(
    scale: f32,
    cols: Range<usize>,
    s: &mut [f32; BK],
    m: &mut f32,
    l: &mut f32,
) -> f32 {
    s.iter_mut().for_each(|x| *x *= scale);
    // From here on whole rows of BK, so that every loop has a fixed length and vectorises (a
    // scalar exp2 per score cost as much as either product): the columns outside `cols` get
    // -inf, whose p is exactly 0.
    s[..cols.start].fill(f32::NEG_INFINITY);
    s[cols.end..].fill(f32::NEG_INFINITY);
    // m_new = max(m, max_c s), p = 2^(s - m_new), l = l · 2^(m - m_new) + Σ p, the max and
    // the sum in W lanes. The max skips NaN, yet a NaN score still turns p, l and this row of O
    // into NaN.
    const W: usize = 8;
    const _: () = assert!(
        BK.is_multiple_of(W),
        "the lane loops below cover whole rows"
    );
    let mut lanes = [*m; W];
    for chunk in s.chunks_exact(W) {
        for (a, &x) in lanes.iter_mut().zip(chunk) {
            *a = if x > *a { x } else { *a };
        }
    }
    let m_new = lanes.iter().fold(*m, |a, &x| if x > a { x } else { a });
    // A row that has only seen masked keys subtracts 0, so its p and correction are 0, not NaN.
    let m_sub = if m_new == f32::NEG_INFINITY {
        0.0
    } else {
        m_new
    };
    let corr = exp2::<K>(*m - m_sub);
    *m = m_new;
    s.iter_mut().for_each(|x| *x = exp2::<K>(*x - m_sub));
    let mut lanes = [0f32; W];
    for chunk in s.chunks_exact(W) {
        for (a, &x) in lanes.iter_mut().zip(chunk) {
            *a += x;
        }
    }
    let sum = lanes.iter().sum::<f32>();
    *l = K::fma(*l, corr, sum);
    corr
}

/// The block kernels, per instruction set; the portable loops unless one overrides them.
trait Ops: Kernel + Sized {
    /// Whether [`scores`](Self::scores) and [`pv`](Self::pv) read rows of `T` as stored;
    /// otherwise each block is converted to f32 first.
    #[inline(always)]
    fn reads<T: 'static>() -> bool {
        kind::<T>() == Kind::F32
    }
    /// Whether [`scores`](Self::scores) reads the query rows of a KV head in a layout of its
    /// own ([`pack_q`](Self::pack_q), [`q_len`](Self::q_len) elements for `rows` rows), rather
    /// than `d` apart.
    const PACKS_Q: bool = false;
    /// Elements of `rows` packed query rows.
    #[inline(always)]
    fn q_len(rows: usize, d: usize) -> usize {
        rows * d
    }
    /// Packs `rows` query rows (`d` apart in `q`) into `out` (`q_len(rows, d)` elements), for
    /// K rows of `U`.
    #[inline(always)]
    fn pack_q<U: 'static>(q: &[f32], rows: usize, d: usize, out: &mut [f32]) {
        out[..rows * d].copy_from_slice(&q[..rows * d]);
    }
    /// `s[t][c] = q[t] · K[c]` for the `rows` query rows (`d` apart in `q`, or packed where
    /// [`PACKS_Q`](Self::PACKS_Q), and as bf16 bits in
    /// `qh`, an even number `d.next_multiple_of(2)` apart and zero-padded, when `dot`) and the
    /// keys `c` in `keys` (within the block); prefetches `pf` on the way.
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    fn scores<T: Elem>(
        dot: bool,
        q: &[f32],
        qh: &[u16],
        rows: usize,
        d: usize,
        k: &Rows<T>,
        keys: Range<usize>,
        s: &mut [[f32; BK]],
        pf: &mut Pf,
    ) {
        let _ = (dot, qh);
        pf.fetch_all();
        portable_scores::<T, Self>(q, rows, d, k, keys, s)
    }
    /// The online softmax of every row `r` of a block (see [`softmax`]): scores `s[r]` scaled
    /// by `scale`, visible columns `cols[r]`, running max `m[r]` and sum `l[r]`, correction
    /// into `corr[r]`.
    #[inline(always)]
    fn softmax_rows(
        s: &mut [[f32; BK]],
        cols: &[(usize, usize)],
        scale: f32,
        m: &mut [f32],
        l: &mut [f32],
        corr: &mut [f32],
    ) {
        for (r, s) in s.iter_mut().enumerate() {
            let (c0, c1) = cols[r];
            corr[r] = softmax::<Self>(scale, c0..c1, s, &mut m[r], &mut l[r]);
        }
    }
    /// For the `rows` rows `t` of `o` (`d` apart): `o[t] = o[t] · corr[t] + Σ_c p[t][c] V[c]`
    /// over `c` in `cols` (no scaling without `corr`; `p` rounded to bf16 when `dot`; the rows
    /// of `o` pair-split when `split`, see [`o_elem`]); prefetches `pf` on the way.
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    fn pv<T: Elem>(
        dot: bool,
        split: bool,
        o: &mut [f32],
        rows: usize,
        d: usize,
        corr: Option<&[f32]>,
        p: &[[f32; BK]],
        v: &Rows<T>,
        cols: Range<usize>,
        pf: &mut Pf,
    ) {
        let _ = dot;
        assert!(!split, "decode: pair-split rows of O only on AVX-512");
        pf.fetch_all();
        portable_pv::<T, Self>(o, rows, d, corr, p, v, cols)
    }
}

impl Ops for Portable {}

/// `q[t] · K[c]` one pair at a time, `PW` partial sums in lanes (one AVX2 vector), then one
/// fixed-order horizontal sum. Rows of another type than f32 are converted first (not reached:
/// the portable kernels read f32 blocks only, see [`Ops::reads`]).
#[inline(always)]
fn portable_scores<T: Elem, K: Kernel>(
    q: &[f32],
    rows: usize,
    d: usize,
    k: &Rows<T>,
    keys: Range<usize>,
    s: &mut [[f32; BK]],
) {
    const PW: usize = 8;
    let full = d - d % PW;
    let as_f = as_f32(k.src);
    let mut conv = vec![0f32; if as_f.is_some() { 0 } else { d }];
    for c in keys {
        let kc: &[f32] = match as_f {
            Some(f) => &f[k.row(c)..k.row(c) + d],
            None => {
                T::load_f32(&mut conv, &k.src[k.row(c)..k.row(c) + d]);
                &conv
            }
        };
        for (t, s) in s[..rows].iter_mut().enumerate() {
            let q = &q[t * d..(t + 1) * d];
            let mut acc = [0f32; PW];
            for (qc, kc) in q[..full].chunks_exact(PW).zip(kc[..full].chunks_exact(PW)) {
                for t in 0..PW {
                    acc[t] = K::fma(qc[t], kc[t], acc[t]);
                }
            }
            let mut w = PW / 2;
            while w > 0 {
                for t in 0..w {
                    acc[t] += acc[t + w];
                }
                w /= 2;
            }
            let mut sum = acc[0];
            for x in full..d {
                sum = K::fma(q[x], kc[x], sum);
            }
            s[c] = sum;
        }
    }
}

/// `O += P V` one row at a time, four keys per pass over the row. Rows of another type than
/// f32 are converted first (not reached, as for [`portable_scores`]).
#[inline(always)]
fn portable_pv<T: Elem, K: Kernel>(
    o: &mut [f32],
    rows: usize,
    d: usize,
    corr: Option<&[f32]>,
    p: &[[f32; BK]],
    vr: &Rows<T>,
    cols: Range<usize>,
) {
    let as_f = as_f32(vr.src);
    let mut conv = vec![0f32; if as_f.is_some() { 0 } else { BK * d }];
    if as_f.is_none() {
        for c in cols.clone() {
            T::load_f32(
                &mut conv[c * d..(c + 1) * d],
                &vr.src[vr.row(c)..vr.row(c) + d],
            );
        }
    }
    let vs: [&[f32]; BK] = std::array::from_fn(|c| {
        if !cols.contains(&c) {
            &[][..]
        } else {
            match as_f {
                Some(f) => &f[vr.row(c)..vr.row(c) + d],
                None => &conv[c * d..(c + 1) * d],
            }
        }
    });
    for (t, (o, s)) in o[..rows * d].chunks_exact_mut(d).zip(p).enumerate() {
        let corr = corr.map_or(1.0, |c| c[t]);
        if corr != 1.0 {
            o.iter_mut().for_each(|x| *x *= corr);
        }
        let mut c = cols.start;
        while c + 4 <= cols.end {
            let (v0, v1, v2, v3) = (vs[c], vs[c + 1], vs[c + 2], vs[c + 3]);
            for x in 0..d {
                let acc = K::fma(s[c], v0[x], o[x]);
                let acc = K::fma(s[c + 1], v1[x], acc);
                let acc = K::fma(s[c + 2], v2[x], acc);
                o[x] = K::fma(s[c + 3], v3[x], acc);
            }
            c += 4;
        }
        while c < cols.end {
            for (o, &vx) in o.iter_mut().zip(vs[c]) {
                *o = K::fma(s[c], vx, *o);
            }
            c += 1;
        }
    }
}

/// `src` as f32 when `T` is f32 (rows read in place).
fn as_f32<T: 'static>(src: &[T]) -> Option<&[f32]> {
    (kind::<T>() == Kind::F32).then(|| {
        // SAFETY: `T` is `f32`, so the slice is already a valid `&[f32]` of the same length.
        unsafe { std::slice::from_raw_parts(src.as_ptr().cast::<f32>(), src.len()) }
    })
}

/// Merges the partials of every split of sequence `b`, head `h`, in split order, and writes the
/// normalised output rows and their log-sum-exp. Called once every split has left its partials.
fn combine<T: Elem, KV>(ctx: &Ctx<T, KV>, b: usize, h: usize) {
    let p = ctx.p;
    let d = p.head_dim;
    let seq = p.seq(b);
    let sq = seq.seq_q;
    let sp = ctx.plan.seqs[b];
    let n = sp.splits;
    let rows = p.heads * sq;
    let lse_h = p.lse_head_stride();
    let row_stride = p.heads * d;
    let mut w = vec![0f32; n];
    for i in 0..sq {
        let part = |s: usize| sp.part_row + s * rows + h * sq + i;
        // SAFETY (all reads below): partial rows of this sequence lie inside the buffers, and
        // every item that wrote them has finished (the caller saw the sequence's `done` count
        // reach its splits, with acquire ordering).
        let m = |s: usize| unsafe { *ctx.pm.0.add(part(s)) };
        // SAFETY: as above.
        let l = |s: usize| unsafe { *ctx.pl.0.add(part(s)) };
        let mut mx = f32::NEG_INFINITY;
        for s in 0..n {
            let ms = m(s);
            mx = if ms > mx { ms } else { mx };
        }
        let m_sub = if mx == f32::NEG_INFINITY { 0.0 } else { mx };
        let mut total = 0f32;
        for (s, w) in w.iter_mut().enumerate() {
            *w = (m(s) - m_sub).exp2();
            total += l(s) * *w;
        }
        let base = (seq.out_row + i) * row_stride + h * d;
        // A row that saw no key has l = 0 and outputs exactly 0; NaN stays NaN.
        let inv = if total == 0.0 { 0.0 } else { 1.0 / total };
        for x in 0..d {
            let mut acc = 0f32;
            for (s, &w) in w.iter().enumerate() {
                // SAFETY: as above.
                acc += unsafe { *ctx.po.0.add(part(s) * d + x) } * w;
            }
            let o = if total == 0.0 { 0.0 } else { acc * inv };
            // SAFETY: element (row, h, x) belongs to this (sequence, head) alone and is in bounds
            // of the output allocated by `forward_with` (total_q * heads * d elements).
            unsafe { *ctx.out.0.add(base + x) = T::from_f32(o) };
        }
        // SAFETY: as above, for the row's log-sum-exp.
        unsafe { *ctx.lse.0.add(seq.lse_base + h * lse_h + i) = row_lse(m_sub, total) };
    }
}

#[cfg(target_arch = "x86_64")]
mod x86;

#[cfg(test)]
mod tests;
