//! Decode: a few query rows per sequence against a long KV cache (split-KV, GQA-packed).
//!
//! With one query row per head the prefill kernel fills one lane of its 64-lane tiles and reads
//! every K/V row once per *query* head. Decode is memory-bound instead, so this kernel is built
//! around reading the cache once:
//!
//! * **GQA packing**: the query rows of all heads of a KV head (`group · seq_q` rows) are folded
//!   into the online softmax together, so each K/V row is loaded from memory once and then served
//!   from L1 to every row that needs it.
//! * **Head-dim elements in SIMD lanes**: a K row is used as stored (f32, contiguous head dim) or
//!   converted one block of `BK` rows at a time into an L1 tile (f16/bf16, strided head dims);
//!   `q·k` is a lane-wise FMA over 16-element chunks and one horizontal sum, and `P V` adds
//!   `p · V[j]` to a row of `O` with no reduction at all. No transposed copy of anything.
//! * **Split-KV** (the partial pass): work items are `(sequence, split of its keys)`; each walks
//!   its keys in blocks of `BK`, all KV heads of a block in turn (for the usual `(b, s, h, d)`
//!   cache that reads one contiguous stretch of memory), and leaves an unnormalised partial
//!   `(m, l, O)` per query row.
//! * **Combine**: per `(sequence, head)`, the partials of the splits are merged through their
//!   log-sum-exp in split order, then normalised once.
//!
//! The split count depends only on the shape and the rayon thread count, and every item and
//! merge runs in a fixed order, so results are bitwise identical from run to run.

use std::any::TypeId;
use std::cell::RefCell;

use rayon::prelude::*;

use super::elem::{load_keys, load_rows, Elem};
use super::exp2::exp2;
#[cfg(target_arch = "x86_64")]
use super::kernel::{Avx512, Fused};
use super::kernel::{Isa, Kernel, Portable};
use super::SyncPtr;
use crate::problem::{KeyRows, Problem};
use crate::semantics::{alibi_bias, group_size, LOG2_E};

/// Decode is chosen while the row groups of a KV head (`max_seq_q · ⌈group / NR⌉`, the work
/// of the partial pass per K/V row) are at most this many per query head of the group (the
/// prefill kernel reads each K/V row once per query head). Measured with
/// `tests::threshold_timing` (1 × 8192 keys, d 128, f32, 2 threads): with 32/8 heads decode
/// wins up to seq_q 16 (64 rows per KV head: 34 ms vs 49 ms) and loses at 32 (73 vs 44); with
/// 8/8 heads it wins at seq_q 4 (8.4 vs 10.4 ms) and loses at 8 (13.8 vs 11.1).
pub(crate) const MAX_ROW_GROUPS_PER_HEAD: usize = 4;

/// Keys per block: the K and V rows of a block are reused from L1 by every row of a KV head.
/// Small, so that all KV heads of a block (for a `(b, s, h, d)` cache, `BK` consecutive rows of
/// `kv_heads · d` elements) are read within a short time: at 32/8 heads, d 128, f32, batch 8,
/// 4096 keys, BK 64 read 5.2 GB/s, 32 read 8.2, 16 read 9.5-10.1, 8 read 9.9.
const BK: usize = 16;
/// A split is never shorter than this many keys (the combine and per-item setup amortised).
const MIN_SPLIT_KEYS: usize = 256;
/// Work items aimed for per rayon thread, for load balance.
const ITEMS_PER_THREAD: usize = 4;
/// Most splits of one sequence (the combine keeps one weight per split on the stack).
const MAX_SPLITS: usize = 64;

/// `true` when `p` goes to the decode kernel: few query rows per KV head (`max_seq_q · group`),
/// see [`MAX_ROW_GROUPS_PER_HEAD`].
pub(crate) fn is_decode(p: &Problem) -> bool {
    let group = group_size(p.heads, p.kv_heads.max(1));
    p.max_seq_q.saturating_mul(group.div_ceil(NR)) <= MAX_ROW_GROUPS_PER_HEAD * group
}

/// Splits of a sequence whose rows see `keys` keys, among `batch` sequences on `threads`
/// threads: enough items to keep every thread busy, none shorter than `MIN_SPLIT_KEYS`.
pub(crate) fn split_count(keys: usize, batch: usize, threads: usize) -> usize {
    let want = (ITEMS_PER_THREAD * threads).div_ceil(batch.max(1));
    want.min(keys / MIN_SPLIT_KEYS).clamp(1, MAX_SPLITS)
}

/// Keys `[lo, hi)` of split `s` of `n` over the keys `[k0, k1)`.
#[inline]
fn split_bounds(k0: usize, k1: usize, s: usize, n: usize) -> (usize, usize) {
    let len = k1 - k0;
    (k0 + len * s / n, k0 + len * (s + 1) / n)
}

/// Where each sequence's splits and partial rows live.
struct Plan {
    /// Per sequence: splits, and the key range the rows see (union of their windows).
    splits: Vec<usize>,
    keys: Vec<(usize, usize)>,
    /// Per sequence: first partial row (a split holds `heads · seq_q` rows, head-major).
    part_row: Vec<usize>,
    /// `(sequence, split)` of every work item.
    items: Vec<(usize, usize)>,
    rows: usize,
}

impl Plan {
    fn new(p: &Problem, threads: usize) -> Self {
        let mut plan = Plan {
            splits: Vec::with_capacity(p.batch),
            keys: Vec::with_capacity(p.batch),
            part_row: Vec::with_capacity(p.batch),
            items: Vec::new(),
            rows: 0,
        };
        for b in 0..p.batch {
            let seq = p.seq(b);
            let keys = p.mask(b, &seq).key_range_rows(0..seq.seq_q);
            let n = if seq.seq_q == 0 {
                0
            } else {
                split_count(keys.1 - keys.0, p.batch, threads)
            };
            plan.splits.push(n);
            plan.keys.push(keys);
            plan.part_row.push(plan.rows);
            plan.rows += n * p.heads * seq.seq_q;
            plan.items.extend((0..n).map(|s| (b, s)));
        }
        plan
    }
}

/// Everything a work item reads, shared by all of them.
struct Ctx<'a, T> {
    p: &'a Problem,
    slopes: Option<&'a [f32]>,
    q: &'a [T],
    k: &'a [T],
    v: &'a [T],
    plan: &'a Plan,
    /// Partials: unnormalised `O` (`rows × d`), running max `m` (base 2) and sum `l`.
    po: SyncPtr<f32>,
    pm: SyncPtr<f32>,
    pl: SyncPtr<f32>,
}

/// Runs the whole problem; returns the contiguous output and the log-sum-exp.
pub(crate) fn forward<T: Elem>(
    p: &Problem,
    slopes: Option<&[f32]>,
    q: &[T],
    k: &[T],
    v: &[T],
) -> (Vec<T>, Vec<f32>) {
    forward_with(
        Isa::detect(),
        rayon::current_num_threads(),
        p,
        slopes,
        q,
        k,
        v,
    )
}

/// [`forward`] with a chosen instruction set (the caller checked that the CPU has it) and the
/// thread count the split rule plans for.
fn forward_with<T: Elem>(
    isa: Isa,
    threads: usize,
    p: &Problem,
    slopes: Option<&[f32]>,
    q: &[T],
    k: &[T],
    v: &[T],
) -> (Vec<T>, Vec<f32>) {
    let d = p.head_dim;
    let mut out = vec![T::from_f32(0.0); p.total_q * p.heads * d];
    let mut lse = vec![f32::NEG_INFINITY; p.total_q * p.heads];
    let plan = Plan::new(p, threads);
    let mut po = vec![0f32; plan.rows * d];
    let mut pm = vec![f32::NEG_INFINITY; plan.rows];
    let mut pl = vec![0f32; plan.rows];
    let ctx = Ctx {
        p,
        slopes,
        q,
        k,
        v,
        plan: &plan,
        po: SyncPtr(po.as_mut_ptr()),
        pm: SyncPtr(pm.as_mut_ptr()),
        pl: SyncPtr(pl.as_mut_ptr()),
    };
    // The partial pass.
    plan.items.par_iter().with_max_len(1).for_each(|&item| {
        with_scratch(|sc| match isa {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: the caller saw avx512f on this CPU.
            Isa::Avx512 => unsafe { item_avx512(&ctx, sc, item) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: the caller saw avx2 and fma on this CPU.
            Isa::Avx2Fma => unsafe { item_avx2(&ctx, sc, item) },
            Isa::Portable => run_item::<T, Portable>(&ctx, sc, item),
        })
    });
    // The combine.
    let (outp, lsep) = (SyncPtr(out.as_mut_ptr()), SyncPtr(lse.as_mut_ptr()));
    (0..p.batch * p.heads)
        .into_par_iter()
        .for_each(|bh| combine(&ctx, bh / p.heads, bh % p.heads, outp, lsep));
    (out, lse)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
fn item_avx512<T: Elem>(ctx: &Ctx<T>, sc: &mut Scratch, item: (usize, usize)) {
    run_item::<T, Avx512>(ctx, sc, item)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn item_avx2<T: Elem>(ctx: &Ctx<T>, sc: &mut Scratch, item: (usize, usize)) {
    run_item::<T, Fused>(ctx, sc, item)
}

thread_local! {
    /// Each thread's decode scratch; it only grows, and is separate from the prefill scratch so
    /// alternating prefill and decode calls rebuild neither.
    static SCRATCH: RefCell<Scratch> = const { RefCell::new(Scratch::new()) };
}

fn with_scratch(f: impl FnOnce(&mut Scratch)) {
    SCRATCH.with(|cell| match cell.try_borrow_mut() {
        Ok(mut s) => f(&mut s),
        // Only if an item ever ran inside another on this thread; stay correct regardless.
        Err(_) => f(&mut Scratch::new()),
    })
}

/// Per-thread buffers of the partial pass.
struct Scratch {
    /// Pre-scaled query rows, `O`, `m`, `l` and visible key range of every row of a sequence.
    q: Vec<f32>,
    o: Vec<f32>,
    m: Vec<f32>,
    l: Vec<f32>,
    range: Vec<(usize, usize)>,
    /// K and V blocks converted to f32 (`BK × d`), when they cannot be read in place.
    k: Vec<f32>,
    v: Vec<f32>,
    /// Scores, then probabilities, of `NR` rows against one block.
    s: [[f32; BK]; NR],
}

impl Scratch {
    const fn new() -> Self {
        Self {
            q: Vec::new(),
            o: Vec::new(),
            m: Vec::new(),
            l: Vec::new(),
            range: Vec::new(),
            k: Vec::new(),
            v: Vec::new(),
            s: [[0.0; BK]; NR],
        }
    }

    fn reserve(&mut self, rows: usize, d: usize) {
        let grow = |v: &mut Vec<f32>, n: usize| {
            if v.len() < n {
                v.resize(n, 0.0);
            }
        };
        grow(&mut self.q, rows * d);
        grow(&mut self.o, rows * d);
        grow(&mut self.m, rows);
        grow(&mut self.l, rows);
        grow(&mut self.k, BK * d);
        grow(&mut self.v, BK * d);
        if self.range.len() < rows {
            // One range per query row `i` (the heads of a row share it).
            self.range.resize(rows, (0, 0));
        }
    }
}

/// `src` as f32 when `T` is f32 (a K or V cache read in place).
fn as_f32<T: Elem>(src: &[T]) -> Option<&[f32]> {
    (TypeId::of::<T>() == TypeId::of::<f32>()).then(|| {
        // SAFETY: `T` is `f32`, so the slice is already a valid `&[f32]` of the same length.
        unsafe { std::slice::from_raw_parts(src.as_ptr().cast::<f32>(), src.len()) }
    })
}

/// One block of K or V rows for one KV head: row `c` is `src[off[c]..off[c] + d]`.
struct Rows<'a> {
    src: &'a [f32],
    off: [usize; BK],
}

/// The block's keys `j0 .. j0 + n`, in place when the cache is f32 with a contiguous head dim,
/// else converted into `buf`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn block_rows<'a, T: Elem>(
    p: &Problem,
    src: &'a [T],
    strides: &crate::problem::Strides,
    buf: &'a mut [f32],
    keys: &KeyRows,
    j0: usize,
    n: usize,
    kvh: usize,
) -> Rows<'a> {
    let d = p.head_dim;
    let mut off = [0usize; BK];
    match as_f32(src) {
        Some(f) if strides.dim == 1 => {
            // One address per run of consecutive rows (the block, or its part in one page).
            let mut c = 0;
            while c < n {
                let run = keys.run(j0 + c, n - c);
                let (b, row) = keys.at(j0 + c);
                let base = strides.at(b, row, kvh);
                for (r, o) in off[c..c + run].iter_mut().enumerate() {
                    *o = base + r * strides.seq;
                }
                c += run;
            }
            // Bounds checked here, so the inner loops can slice freely.
            assert!(off[..n].iter().all(|&o| o + d <= f.len()));
            Rows { src: f, off }
        }
        _ => {
            load_keys(buf, src, strides, keys, j0, n, kvh, d);
            for (c, o) in off[..n].iter_mut().enumerate() {
                *o = c * d;
            }
            Rows { src: buf, off }
        }
    }
}

/// Query rows folded together: they share every K and V load.
const NR: usize = 4;

/// One work item: split `s` of sequence `b`, every query row of every head.
///
/// In the scratch, rows are ordered `(kv head, query i, head within the group)`, so the rows of
/// one KV head that see the same keys (same `i`) are consecutive and go through the kernels
/// `NR` at a time.
#[inline(always)]
fn run_item<T: Elem, K: Ops>(ctx: &Ctx<T>, sc: &mut Scratch, (b, s): (usize, usize)) {
    let p = ctx.p;
    let d = p.head_dim;
    let seq = p.seq(b);
    let (sq, sk) = (seq.seq_q, seq.seq_k);
    let group = group_size(p.heads, p.kv_heads);
    let rows = p.heads * sq;
    sc.reserve(rows, d);
    let softcap = p.score.softcap > 0.0;
    // Without softcap the scale and log2(e) fold into q once; with it, tanh needs the true score.
    let q_scale = if softcap {
        p.score.scale
    } else {
        p.score.scale * LOG2_E
    };
    // Scratch row of (head h, query i).
    let row_of = |h: usize, i: usize| ((h / group) * sq + i) * group + h % group;
    for h in 0..p.heads {
        for i in 0..sq {
            let r = row_of(h, i);
            let qr = &mut sc.q[r * d..(r + 1) * d];
            load_rows(qr, ctx.q, &p.q, b, seq.q_row + i, 1, h, d);
            qr.iter_mut().for_each(|x| *x *= q_scale);
            sc.m[r] = f32::NEG_INFINITY;
            sc.l[r] = 0.0;
        }
    }
    sc.o[..rows * d].fill(0.0);
    // Each row sees one interval of keys, prefix ranges or not (`SeqMask::row_range`).
    let mask = p.mask(b, &seq);
    for i in 0..sq {
        sc.range[i] = mask.row_range(i);
    }
    let keys = p.key_rows(b, &seq);

    let (k0, k1) = ctx.plan.keys[b];
    let (k0, k1) = split_bounds(k0, k1, s, ctx.plan.splits[b]);
    let mut j0 = k0;
    while j0 < k1 {
        let n = BK.min(k1 - j0);
        for kvh in 0..p.kv_heads {
            let kr = block_rows(p, ctx.k, &p.k, &mut sc.k, &keys, j0, n, kvh);
            let vr = block_rows(p, ctx.v, &p.v, &mut sc.v, &keys, j0, n, kvh);
            for i in 0..sq {
                // The part of the block query i sees.
                let (lo, hi) = sc.range[i];
                let (c0, c1) = (lo.max(j0), hi.min(j0 + n));
                if c0 >= c1 {
                    continue;
                }
                let cols = c0 - j0..c1 - j0;
                let mut g = 0;
                while g < group {
                    let nr = NR.min(group - g);
                    let r0 = (kvh * sq + i) * group + g;
                    let h0 = kvh * group + g;
                    // Rows past `nr` repeat the last one; their results are dropped.
                    let qs: [&[f32]; NR] = std::array::from_fn(|t| {
                        let r = r0 + t.min(nr - 1);
                        &sc.q[r * d..(r + 1) * d]
                    });
                    K::scores(qs, &kr, cols.clone(), &mut sc.s);
                    let mut corr = [0f32; NR];
                    for t in 0..nr {
                        let slope = ctx
                            .slopes
                            .map_or(0.0, |sl| sl[b * p.alibi_batch_stride + h0 + t]);
                        let row = Row {
                            p,
                            slope,
                            i,
                            sq,
                            sk,
                            j0,
                            softcap,
                        };
                        corr[t] = softmax::<K>(
                            &row,
                            cols.clone(),
                            &mut sc.s[t],
                            &mut sc.m[r0 + t],
                            &mut sc.l[r0 + t],
                        );
                    }
                    K::pv(
                        &mut sc.o[r0 * d..(r0 + nr) * d],
                        nr,
                        &corr,
                        &sc.s,
                        &vr,
                        cols.clone(),
                    );
                    g += nr;
                }
            }
        }
        j0 += n;
    }

    // Leave the partials, head-major: rows of split s follow those of splits 0..s.
    let base = ctx.plan.part_row[b] + s * rows;
    for h in 0..p.heads {
        for i in 0..sq {
            let (r, pr) = (row_of(h, i), base + h * sq + i);
            // SAFETY: partial rows `base .. base + rows` belong to this item alone and lie
            // inside the buffers `forward_with` allocated (`plan.rows` rows of `d`).
            unsafe {
                let o = ctx.po.0.add(pr * d);
                std::ptr::copy_nonoverlapping(sc.o.as_ptr().add(r * d), o, d);
                *ctx.pm.0.add(pr) = sc.m[r];
                *ctx.pl.0.add(pr) = sc.l[r];
            }
        }
    }
}

/// What the score modifiers of one query row read.
struct Row<'a> {
    p: &'a Problem,
    slope: f32,
    i: usize,
    sq: usize,
    sk: usize,
    /// First key of the block.
    j0: usize,
    softcap: bool,
}

/// Turns one row's raw scores `s[cols]` into probabilities and updates its running max and sum;
/// returns the correction `2^(m_old - m_new)` its `O` must be scaled by.
#[inline(always)]
fn softmax<K: Kernel>(
    row: &Row,
    cols: std::ops::Range<usize>,
    s: &mut [f32; BK],
    m: &mut f32,
    l: &mut f32,
) -> f32 {
    if row.softcap || row.slope != 0.0 {
        for c in cols.clone() {
            let raw = if row.softcap {
                row.p.score.cap(s[c]) * LOG2_E
            } else {
                s[c]
            };
            let bias = if row.slope != 0.0 {
                alibi_bias(row.slope, row.i, row.j0 + c, row.sq, row.sk) * LOG2_E
            } else {
                0.0
            };
            s[c] = raw - bias;
        }
    }
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

/// The two products, per instruction set, for `NR` query rows that see the same keys.
/// The portable loops unless an instruction set overrides them.
trait Ops: Kernel + Sized {
    /// `s[t][c] = q[t] · K[c]` for `c` in `cols`.
    #[inline(always)]
    fn scores(q: [&[f32]; NR], k: &Rows, cols: std::ops::Range<usize>, s: &mut [[f32; BK]; NR]) {
        portable_scores::<Self>(q, k, cols, s)
    }
    /// For the first `nr` rows `t` of `o` (`d` apart): `o[t] = o[t] · corr[t] + Σ_c s[t][c] V[c]`.
    #[inline(always)]
    fn pv(
        o: &mut [f32],
        nr: usize,
        corr: &[f32; NR],
        s: &[[f32; BK]; NR],
        v: &Rows,
        cols: std::ops::Range<usize>,
    ) {
        portable_pv::<Self>(o, nr, corr, s, v, cols)
    }
}

impl Ops for Portable {}

/// `q[t] · K[c]` one row at a time, `PW` partial sums in lanes (one AVX2 vector), then one
/// fixed-order horizontal sum.
#[inline(always)]
fn portable_scores<K: Kernel>(
    q: [&[f32]; NR],
    k: &Rows,
    cols: std::ops::Range<usize>,
    s: &mut [[f32; BK]; NR],
) {
    const PW: usize = 8;
    let d = q[0].len();
    let full = d - d % PW;
    for c in cols {
        let kc = &k.src[k.off[c]..k.off[c] + d];
        for (q, s) in q.iter().zip(s.iter_mut()) {
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

/// `O += P V` one row at a time, four keys per pass over the row.
#[inline(always)]
fn portable_pv<K: Kernel>(
    o: &mut [f32],
    nr: usize,
    corr: &[f32; NR],
    s: &[[f32; BK]; NR],
    vr: &Rows,
    cols: std::ops::Range<usize>,
) {
    let d = o.len() / nr.max(1);
    for ((o, &corr), s) in o.chunks_exact_mut(d).zip(corr).zip(s) {
        if corr != 1.0 {
            o.iter_mut().for_each(|x| *x *= corr);
        }
        let v = |c: usize| &vr.src[vr.off[c]..vr.off[c] + d];
        let mut c = cols.start;
        while c + 4 <= cols.end {
            let (v0, v1, v2, v3) = (v(c), v(c + 1), v(c + 2), v(c + 3));
            for x in 0..d {
                let acc = K::fma(s[c], v0[x], o[x]);
                let acc = K::fma(s[c + 1], v1[x], acc);
                let acc = K::fma(s[c + 2], v2[x], acc);
                o[x] = K::fma(s[c + 3], v3[x], acc);
            }
            c += 4;
        }
        while c < cols.end {
            for (o, &vx) in o.iter_mut().zip(v(c)) {
                *o = K::fma(s[c], vx, *o);
            }
            c += 1;
        }
    }
}

/// Merges the partials of every split of sequence `b`, head `h`, in split order, and writes the
/// normalised output rows and their log-sum-exp.
fn combine<T: Elem>(ctx: &Ctx<T>, b: usize, h: usize, out: SyncPtr<T>, lse: SyncPtr<f32>) {
    let p = ctx.p;
    let d = p.head_dim;
    let seq = p.seq(b);
    let sq = seq.seq_q;
    let n = ctx.plan.splits[b];
    let rows = p.heads * sq;
    let lse_h = p.lse_head_stride();
    let row_stride = p.heads * d;
    let mut w = [0f32; MAX_SPLITS];
    for i in 0..sq {
        let part = |s: usize| ctx.plan.part_row[b] + s * rows + h * sq + i;
        // SAFETY (all reads below): partial rows of this sequence lie inside the buffers, and the
        // partial pass that wrote them has finished.
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
        for (s, w) in w[..n].iter_mut().enumerate() {
            *w = (m(s) - m_sub).exp2();
            total += l(s) * *w;
        }
        let base = (seq.out_row + i) * row_stride + h * d;
        // A row that saw no key has l = 0 and outputs exactly 0; NaN stays NaN.
        let (inv, row_lse) = if total == 0.0 {
            (0.0, f32::NEG_INFINITY)
        } else {
            (1.0 / total, (m_sub + total.log2()) / LOG2_E)
        };
        for x in 0..d {
            let mut acc = 0f32;
            for (s, &w) in w[..n].iter().enumerate() {
                // SAFETY: as above.
                acc += unsafe { *ctx.po.0.add(part(s) * d + x) } * w;
            }
            let o = if total == 0.0 { 0.0 } else { acc * inv };
            // SAFETY: element (row, h, x) belongs to this (sequence, head) alone and is in bounds
            // of the output allocated by `forward_with` (total_q * heads * d elements).
            unsafe { *out.0.add(base + x) = T::from_f32(o) };
        }
        // SAFETY: as above, for the row's log-sum-exp.
        unsafe { *lse.0.add(seq.lse_base + h * lse_h + i) = row_lse };
    }
}

#[cfg(target_arch = "x86_64")]
mod x86;

#[cfg(test)]
mod tests;
