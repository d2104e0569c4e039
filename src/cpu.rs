//! Tiled CPU forward pass (FlashAttention-2 loop order), queries in SIMD lanes.
//!
//! Work items are `(batch, head, block of query rows)`, run in parallel with rayon; a block is up
//! to `QSUB` sub-tiles of `BR` rows that share every K/V tile. Each sub-tile is kept
//! *transposed*: `Qᵀ` (`d × BR`), the scores `Sᵀ = K Qᵀ` (`BC × BR`) and the output accumulator
//! `Oᵀ` (`d × BR`) all have one query per lane. That layout makes
//!
//! * both products register-blocked broadcast-FMAs with no transposed copy of K or V: `Sᵀ` row
//!   `c` is `Σ_x K[c][x] · Qᵀ[x]`, and `Oᵀ` row `x` gains `Σ_c V[c][x] · Pᵀ[c]`;
//! * the online softmax purely element-wise: the running max `m`, sum `l` and correction of every
//!   query are vectors over lanes, updated with no horizontal reduction.
//!
//! The Q tile is transposed once per item, the K and V tiles are only copied (or converted from
//! f16/bf16) into dense f32 scratch, and `Oᵀ` is normalised once and transposed on the way out.
//! Extra memory is a few tiles per thread, independent of the sequence lengths.
//!
//! The micro-kernel is dispatched at run time: AVX-512 intrinsics, else the portable loops
//! compiled with AVX2+FMA enabled, else plain portable loops (any architecture).

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};
use rayon::prelude::*;

use crate::problem::{Problem, Strides};
use crate::semantics::{alibi_bias, kv_head, LOG2_E};

/// Query rows per work item: the lanes of every tile (four AVX-512 vectors).
const BR: usize = 64;
/// Keys per inner tile.
const BC: usize = 64;
/// Most BR-row sub-tiles per work item. Each K/V tile copy serves all sub-tiles of an item: K and V
/// rows of one head lie `heads · d` elements apart and do not stay in L2 for long sequences, so
/// every copy waits on L3 (and the TLB), and sharing it is what keeps that wait small (with one
/// sub-tile the copies took 22% of the time at n = 1024 and 4096, 8 heads, d = 64; with four,
/// 10% at n = 4096). Tried and dropped, as each only moved that time elsewhere: software
/// prefetching the next tile into L2, copying it a few rows at a time between micro-kernel calls
/// (double buffering), and reading f32 K/V in place without a copy.
const QSUB: usize = 4;

/// One value per query of the tile; aligned so the AVX-512 loads never split a cache line.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Lanes([f32; BR]);

impl Lanes {
    const fn splat(x: f32) -> Self {
        Self([x; BR])
    }
}

/// Element types the CPU path reads and writes; all arithmetic is f32.
pub(crate) trait Elem: Copy + Send + Sync + 'static {
    fn to_f32(self) -> f32;
    fn from_f32(x: f32) -> Self;
    /// Converts a contiguous run; overridden where a vectorised conversion exists.
    #[inline(always)]
    fn load_f32(dst: &mut [f32], src: &[Self]) {
        for (o, x) in dst.iter_mut().zip(src) {
            *o = x.to_f32();
        }
    }
}

impl Elem for f32 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        x
    }
    #[inline(always)]
    fn load_f32(dst: &mut [f32], src: &[Self]) {
        // Fixed 16-float chunks inline as vector moves; `copy_from_slice` of a run-time length
        // was a libc call per row, 128 of them per K/V tile.
        let mut o = dst.chunks_exact_mut(16);
        let mut i = src.chunks_exact(16);
        for (o, i) in (&mut o).zip(&mut i) {
            o.copy_from_slice(i);
        }
        o.into_remainder().copy_from_slice(i.remainder());
    }
}

impl Elem for f16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        f16::from_f32(x)
    }
    #[inline(always)]
    fn load_f32(dst: &mut [f32], src: &[Self]) {
        src.convert_to_f32_slice(dst);
    }
}

impl Elem for bf16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        bf16::from_f32(x)
    }
    #[inline(always)]
    fn load_f32(dst: &mut [f32], src: &[Self]) {
        src.convert_to_f32_slice(dst);
    }
}

/// Raw output pointer shared by the work items, which write disjoint rows.
#[derive(Clone, Copy)]
struct SyncPtr<T>(*mut T);
// SAFETY: every work item writes a disjoint set of elements (its own rows of its own head).
unsafe impl<T> Send for SyncPtr<T> {}
// SAFETY: as above.
unsafe impl<T> Sync for SyncPtr<T> {}

/// The instruction set the micro-kernels run with, detected once per call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Isa {
    #[cfg(target_arch = "x86_64")]
    Avx512,
    #[cfg(target_arch = "x86_64")]
    Avx2Fma,
    Portable,
}

impl Isa {
    fn detect() -> Self {
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx512f") {
                return Isa::Avx512;
            }
            if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
                return Isa::Avx2Fma;
            }
        }
        Isa::Portable
    }
}

/// Everything a work item reads, shared by all of them.
struct Ctx<'a, T> {
    p: &'a Problem,
    slopes: Option<&'a [f32]>,
    q: &'a [T],
    k: &'a [T],
    v: &'a [T],
    out: SyncPtr<T>,
    lse: SyncPtr<f32>,
    /// Sub-tiles per work item (`1..=QSUB`).
    qsub: usize,
}

/// Runs the whole problem; returns the contiguous output and the log-sum-exp.
pub(crate) fn forward<T: Elem>(
    p: &Problem,
    slopes: Option<&[f32]>,
    q: &[T],
    k: &[T],
    v: &[T],
) -> (Vec<T>, Vec<f32>) {
    forward_with(Isa::detect(), p, slopes, q, k, v)
}

/// [`forward`] with a chosen instruction set (the caller checked that the CPU has it).
fn forward_with<T: Elem>(
    isa: Isa,
    p: &Problem,
    slopes: Option<&[f32]>,
    q: &[T],
    k: &[T],
    v: &[T],
) -> (Vec<T>, Vec<f32>) {
    let d = p.head_dim;
    let mut out = vec![T::from_f32(0.0); p.total_q * p.heads * d];
    let mut lse = vec![f32::NEG_INFINITY; p.total_q * p.heads];
    // Fewer sub-tiles per item when there would be too few items to keep every thread busy.
    let rows_total: usize = (0..p.batch).map(|b| p.seq(b).seq_q).sum::<usize>() * p.heads;
    let want = 4 * rayon::current_num_threads();
    let qsub = [QSUB, 2, 1]
        .into_iter()
        .find(|&n| rows_total.div_ceil(BR * n) >= want)
        .unwrap_or(1);
    // Last query tiles first: under a causal mask they see the most keys, and starting the
    // longest items early leaves only short ones for rayon to balance at the end.
    let items: Vec<(usize, usize, usize)> = (0..p.batch)
        .flat_map(|b| {
            let tiles = p.seq(b).seq_q.div_ceil(BR * qsub);
            (0..p.heads).flat_map(move |h| (0..tiles).rev().map(move |t| (b, h, t)))
        })
        .collect();
    let ctx = Ctx {
        p,
        slopes,
        q,
        k,
        v,
        out: SyncPtr(out.as_mut_ptr()),
        lse: SyncPtr(lse.as_mut_ptr()),
        qsub,
    };
    // One item per rayon job, so idle threads can steal any single item.
    items.into_par_iter().with_max_len(1).for_each(|item| {
        with_scratch(d, qsub, |scratch| match isa {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `Isa::detect` saw avx512f on this CPU.
            Isa::Avx512 => unsafe { item_avx512(&ctx, scratch, item) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `Isa::detect` saw avx2 and fma on this CPU.
            Isa::Avx2Fma => unsafe { item_avx2(&ctx, scratch, item) },
            Isa::Portable => run_item::<T, Portable>(&ctx, scratch, item),
        })
    });
    (out, lse)
}

thread_local! {
    /// Each thread's scratch, kept between work items and calls: with one item per rayon job,
    /// `for_each_init` would allocate and zero it for every item.
    static SCRATCH: std::cell::RefCell<Option<Scratch>> = const { std::cell::RefCell::new(None) };
}

/// Runs `f` with this thread's scratch, (re)built when the shape changed.
fn with_scratch(d: usize, qsub: usize, f: impl FnOnce(&mut Scratch)) {
    SCRATCH.with(|cell| match cell.try_borrow_mut() {
        Ok(mut slot) => {
            let fits = matches!(&*slot, Some(s) if s.d == d && s.sub.len() == qsub);
            if !fits {
                *slot = Some(Scratch::new(d, qsub));
            }
            if let Some(s) = slot.as_mut() {
                f(s);
            }
        }
        // Only if an item ever ran inside another on this thread; stay correct regardless.
        Err(_) => f(&mut Scratch::new(d, qsub)),
    })
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
fn item_avx512<T: Elem>(ctx: &Ctx<T>, sc: &mut Scratch, item: (usize, usize, usize)) {
    run_item::<T, Avx512>(ctx, sc, item)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn item_avx2<T: Elem>(ctx: &Ctx<T>, sc: &mut Scratch, item: (usize, usize, usize)) {
    run_item::<T, Fused>(ctx, sc, item)
}

/// The running state of one BR-row query sub-tile.
struct SubTile {
    /// `Qᵀ`, pre-scaled: `d` rows of lanes.
    qt: Vec<Lanes>,
    /// `Oᵀ`, unnormalised: `d` rows of lanes.
    ot: Vec<Lanes>,
    /// Running max (of base-2 scores) and running sum of every query.
    m: Lanes,
    l: Lanes,
}

/// Per-thread buffers, reused across work items.
struct Scratch {
    /// The head dim the buffers are sized for.
    d: usize,
    sub: Vec<SubTile>,
    /// `Sᵀ`, then `Pᵀ` in place: `BC` rows of lanes.
    s: Vec<Lanes>,
    /// K and V tiles, dense `BC × d` f32.
    k: Vec<f32>,
    v: Vec<f32>,
    /// One strided or converted row on its way into `Qᵀ`.
    row: Vec<f32>,
}

impl Scratch {
    fn new(d: usize, qsub: usize) -> Self {
        Self {
            d,
            sub: (0..qsub)
                .map(|_| SubTile {
                    qt: vec![Lanes::splat(0.0); d],
                    ot: vec![Lanes::splat(0.0); d],
                    m: Lanes::splat(f32::NEG_INFINITY),
                    l: Lanes::splat(0.0),
                })
                .collect(),
            s: vec![Lanes::splat(0.0); BC],
            k: vec![0.0; BC * d],
            v: vec![0.0; BC * d],
            row: vec![0.0; d],
        }
    }
}

/// The arithmetic a work item is compiled with.
trait Kernel {
    /// Rows of `out` one call of `block` can take.
    const ROWS: usize;
    /// `a * b + c`, fused where the hardware has it.
    fn fma(a: f32, b: f32, c: f32) -> f32;
    /// For each `i < out.len() <= ROWS`:
    /// `out[i] = out[i] * init + Σ_{t<n} a[i * a_is + t * a_ts] · b[t]` with `init = None`
    /// meaning "start from zero". Callers guarantee `b.len() >= n` and that every index of `a`
    /// named above is in bounds.
    fn block(
        out: &mut [Lanes],
        init: Option<&Lanes>,
        a: &[f32],
        a_is: usize,
        a_ts: usize,
        b: &[Lanes],
        n: usize,
    );
    /// Lane-wise maximum of `rows` (and -inf); a NaN entry is skipped.
    #[inline(always)]
    fn max_rows(rows: &[Lanes]) -> Lanes {
        let mut m = Lanes::splat(f32::NEG_INFINITY);
        for s in rows {
            for (m, &x) in m.0.iter_mut().zip(&s.0) {
                *m = if x > *m { x } else { *m };
            }
        }
        m
    }
}

/// Checks the contract of [`Kernel::block`] once, before the unchecked inner loops.
#[inline(always)]
fn block_in_bounds(rows: usize, a_len: usize, a_is: usize, a_ts: usize, b_len: usize, n: usize) {
    assert!(
        rows == 0 || n == 0 || ((rows - 1) * a_is + (n - 1) * a_ts < a_len && n <= b_len),
        "cpu flash kernel: tile indexing out of bounds"
    );
}

/// Plain loops, one row at a time; correct everywhere, vectorised by the compiler.
struct Portable;

impl Kernel for Portable {
    const ROWS: usize = 1;
    #[inline(always)]
    fn fma(a: f32, b: f32, c: f32) -> f32 {
        // `mul_add` without hardware FMA is a libm call; aarch64 always has the instruction.
        if cfg!(target_arch = "aarch64") {
            a.mul_add(b, c)
        } else {
            a * b + c
        }
    }
    #[inline(always)]
    fn block(
        out: &mut [Lanes],
        init: Option<&Lanes>,
        a: &[f32],
        a_is: usize,
        a_ts: usize,
        b: &[Lanes],
        n: usize,
    ) {
        portable_block::<Self>(out, init, a, a_is, a_ts, b, n)
    }
}

/// The portable loops compiled with FMA available (AVX2 machines).
#[cfg(target_arch = "x86_64")]
struct Fused;

#[cfg(target_arch = "x86_64")]
impl Kernel for Fused {
    const ROWS: usize = 1;
    #[inline(always)]
    fn fma(a: f32, b: f32, c: f32) -> f32 {
        a.mul_add(b, c)
    }
    #[inline(always)]
    fn block(
        out: &mut [Lanes],
        init: Option<&Lanes>,
        a: &[f32],
        a_is: usize,
        a_ts: usize,
        b: &[Lanes],
        n: usize,
    ) {
        portable_block::<Self>(out, init, a, a_is, a_ts, b, n)
    }
}

#[inline(always)]
fn portable_block<K: Kernel>(
    out: &mut [Lanes],
    init: Option<&Lanes>,
    a: &[f32],
    a_is: usize,
    a_ts: usize,
    b: &[Lanes],
    n: usize,
) {
    block_in_bounds(out.len(), a.len(), a_is, a_ts, b.len(), n);
    for (i, o) in out.iter_mut().enumerate() {
        let mut acc = match init {
            Some(c) => {
                let mut acc = *o;
                acc.0.iter_mut().zip(&c.0).for_each(|(x, c)| *x *= c);
                acc
            }
            None => Lanes::splat(0.0),
        };
        for (t, bt) in b[..n].iter().enumerate() {
            let s = a[i * a_is + t * a_ts];
            for (x, &y) in acc.0.iter_mut().zip(&bt.0) {
                *x = K::fma(s, y, *x);
            }
        }
        *o = acc;
    }
}

/// AVX-512: `ROWS` rows × 4 vectors of 16 lanes = 24 accumulators held in zmm registers.
#[cfg(target_arch = "x86_64")]
struct Avx512;

#[cfg(target_arch = "x86_64")]
impl Kernel for Avx512 {
    const ROWS: usize = 6;
    #[inline(always)]
    fn fma(a: f32, b: f32, c: f32) -> f32 {
        a.mul_add(b, c)
    }
    #[inline(always)]
    fn block(
        out: &mut [Lanes],
        init: Option<&Lanes>,
        a: &[f32],
        a_is: usize,
        a_ts: usize,
        b: &[Lanes],
        n: usize,
    ) {
        block_in_bounds(out.len(), a.len(), a_is, a_ts, b.len(), n);
        // SAFETY: only reached through `item_avx512`, i.e. with avx512f detected; indices were
        // checked just above.
        unsafe {
            match out.len() {
                1 => avx512::block::<1>(out, init, a, a_is, a_ts, b, n),
                2 => avx512::block::<2>(out, init, a, a_is, a_ts, b, n),
                3 => avx512::block::<3>(out, init, a, a_is, a_ts, b, n),
                4 => avx512::block::<4>(out, init, a, a_is, a_ts, b, n),
                5 => avx512::block::<5>(out, init, a, a_is, a_ts, b, n),
                6 => avx512::block::<6>(out, init, a, a_is, a_ts, b, n),
                _ => unreachable!("callers pass at most ROWS rows"),
            }
        }
    }
    #[inline(always)]
    fn max_rows(rows: &[Lanes]) -> Lanes {
        // SAFETY: only reached through `item_avx512`, i.e. with avx512f detected.
        unsafe { avx512::max_rows(rows) }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::{Lanes, BR};
    use std::arch::x86_64::*;

    const V: usize = BR / 16;

    /// [`super::Kernel::max_rows`] with the running max in registers (the portable loop keeps it
    /// in memory and pays a masked store per row).
    ///
    /// # Safety
    /// avx512f must be available.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn max_rows(rows: &[Lanes]) -> Lanes {
        let mut m = [_mm512_set1_ps(f32::NEG_INFINITY); V];
        for s in rows {
            for (v, m) in m.iter_mut().enumerate() {
                // SAFETY: `Lanes` holds BR = 16 V floats, aligned to 64 bytes.
                let x = unsafe { _mm512_load_ps(s.0.as_ptr().add(16 * v)) };
                // `max(x, m)` returns m when x is NaN.
                *m = _mm512_max_ps(x, *m);
            }
        }
        let mut out = Lanes::splat(0.0);
        for (v, m) in m.iter().enumerate() {
            // SAFETY: as above.
            unsafe { _mm512_store_ps(out.0.as_mut_ptr().add(16 * v), *m) };
        }
        out
    }

    /// The register-blocked micro-kernel behind [`super::Kernel::block`]: per step `t` it loads
    /// the `V` vectors of `b[t]` once and broadcasts one value of `a` per row.
    ///
    /// # Safety
    /// avx512f must be available, `out.len() == R`, `b.len() >= n`, and
    /// `(R - 1) * a_is + (n - 1) * a_ts < a.len()` when `n > 0`.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn block<const R: usize>(
        out: &mut [Lanes],
        init: Option<&Lanes>,
        a: &[f32],
        a_is: usize,
        a_ts: usize,
        b: &[Lanes],
        n: usize,
    ) {
        let mut acc = [[_mm512_setzero_ps(); V]; R];
        if let Some(c) = init {
            for (i, acc) in acc.iter_mut().enumerate() {
                for (v, acc) in acc.iter_mut().enumerate() {
                    // SAFETY: `Lanes` holds BR = 16 V floats, aligned to 64 bytes.
                    unsafe {
                        let o = _mm512_load_ps(out[i].0.as_ptr().add(16 * v));
                        let c = _mm512_load_ps(c.0.as_ptr().add(16 * v));
                        *acc = _mm512_mul_ps(o, c);
                    }
                }
            }
        }
        let a = a.as_ptr();
        for (t, bt) in b[..n].iter().enumerate() {
            let bt = bt.0.as_ptr();
            // SAFETY: as above, `b[t]` holds V aligned vectors.
            let bv: [__m512; V] =
                std::array::from_fn(|v| unsafe { _mm512_load_ps(bt.add(16 * v)) });
            for (i, acc) in acc.iter_mut().enumerate() {
                // SAFETY: `i * a_is + t * a_ts <= (R - 1) * a_is + (n - 1) * a_ts < a.len()`.
                let s = _mm512_set1_ps(unsafe { *a.add(i * a_is + t * a_ts) });
                for (acc, &bv) in acc.iter_mut().zip(&bv) {
                    *acc = _mm512_fmadd_ps(s, bv, *acc);
                }
            }
        }
        for (o, acc) in out.iter_mut().zip(&acc) {
            for (v, &acc) in acc.iter().enumerate() {
                // SAFETY: as above, for the output row.
                unsafe { _mm512_store_ps(o.0.as_mut_ptr().add(16 * v), acc) };
            }
        }
    }
}

/// `2^x` for whole tiles: branch-free, so the compiler vectorises it. Relative error below 5e-7
/// on `[-126, 127]`; below about -126.5 the result is exactly 0 (so `-inf` maps to 0, which the
/// masking relies on); NaN stays NaN.
#[inline(always)]
fn exp2<K: Kernel>(x: f32) -> f32 {
    // Adding 1.5·2²³ rounds to an integer n and leaves n in the low mantissa bits.
    const SHIFT: f32 = 12_582_912.0;
    const SHIFT_BITS: i32 = 0x4B40_0000;
    // The Taylor series of 2^f = e^(f ln 2); on |f| <= 1/2 its degree-6 truncation is within
    // 1.2e-7 (relative).
    const L: f64 = std::f64::consts::LN_2;
    const C: [f32; 7] = [
        1.0,
        L as f32,
        (L * L / 2.0) as f32,
        (L * L * L / 6.0) as f32,
        (L * L * L * L / 24.0) as f32,
        (L * L * L * L * L / 120.0) as f32,
        (L * L * L * L * L * L / 720.0) as f32,
    ];
    // The comparisons are written so that NaN falls through unchanged.
    let x = if x < -127.0 { -127.0 } else { x };
    let x = if x > 127.0 { 127.0 } else { x };
    let t = x + SHIFT;
    let n = (t.to_bits() as i32).wrapping_sub(SHIFT_BITS);
    let f = x - (t - SHIFT);
    let mut p = C[6];
    for &c in C[..6].iter().rev() {
        p = K::fma(p, f, c);
    }
    // 2^n built from its exponent bits; n = -127 gives the bit pattern of +0.0.
    let scale = f32::from_bits((n.wrapping_add(127) << 23) as u32);
    p * scale
}

/// Copies `rows` rows of one head, starting at `row0`, into a dense f32 `rows × d` block.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn load_rows<T: Elem>(
    dst: &mut [f32],
    src: &[T],
    s: &Strides,
    b: usize,
    row0: usize,
    rows: usize,
    head: usize,
    d: usize,
) {
    for (r, dst) in dst[..rows * d].chunks_exact_mut(d).enumerate() {
        let base = s.at(b, row0 + r, head);
        if s.dim == 1 {
            T::load_f32(dst, &src[base..base + d]);
        } else {
            for (x, o) in dst.iter_mut().enumerate() {
                *o = src[base + x * s.dim].to_f32();
            }
        }
    }
}

/// What every sub-tile update of one work item shares.
struct ItemCtx<'a> {
    p: &'a Problem,
    d: usize,
    sq: usize,
    sk: usize,
    slope: f32,
    softcap: bool,
}

/// One work item: query rows `t · BR · qsub ..` of head `h` in sequence `b`, as up to `qsub`
/// sub-tiles of BR rows that share every K/V tile copy.
#[inline(always)]
fn run_item<T: Elem, K: Kernel>(ctx: &Ctx<T>, sc: &mut Scratch, (b, h, t): (usize, usize, usize)) {
    let p = ctx.p;
    let d = p.head_dim;
    let seq = p.seq(b);
    let (sq, sk) = (seq.seq_q, seq.seq_k);
    let i0 = t * BR * ctx.qsub;
    let rows = (BR * ctx.qsub).min(sq - i0);
    let nsub = rows.div_ceil(BR);
    let kvh = kv_head(h, p.heads, p.kv_heads);
    let softcap = p.score.softcap > 0.0;
    let it = ItemCtx {
        p,
        d,
        sq,
        sk,
        slope: ctx.slopes.map_or(0.0, |s| s[b * p.alibi_batch_stride + h]),
        softcap,
    };
    // Without softcap the scale and log2(e) fold into Q once; with it, tanh needs the true score.
    let q_scale = if softcap {
        p.score.scale
    } else {
        p.score.scale * LOG2_E
    };

    // Row range and key range of every sub-tile.
    let mut sub_rows = [(0usize, 0usize); QSUB];
    let mut sub_keys = [(0usize, 0usize); QSUB];
    for u in 0..nsub {
        let r0 = i0 + u * BR;
        let n = BR.min(i0 + rows - r0);
        sub_rows[u] = (r0, n);
        sub_keys[u] = p.window.key_range_rows(r0..r0 + n, sq, sk);
        let st = &mut sc.sub[u];
        // Qᵀ; lanes past the last row stay 0, which keeps their (unused) scores finite.
        if n < BR {
            st.qt.iter_mut().for_each(|x| *x = Lanes::splat(0.0));
        }
        for r in 0..n {
            load_rows(&mut sc.row, ctx.q, &p.q, b, seq.q_row + r0 + r, 1, h, d);
            for (qt, &x) in st.qt.iter_mut().zip(&sc.row) {
                qt.0[r] = x * q_scale;
            }
        }
        st.ot.iter_mut().for_each(|x| *x = Lanes::splat(0.0));
        st.m = Lanes::splat(f32::NEG_INFINITY);
        st.l = Lanes::splat(0.0);
    }

    // Key tiles outside the union of the rows' ranges are skipped by these bounds.
    let (lo, hi) = p.window.key_range_rows(i0..i0 + rows, sq, sk);
    let mut j0 = lo;
    while j0 < hi {
        let cols = BC.min(hi - j0);
        load_rows(&mut sc.k, ctx.k, &p.k, b, seq.k_row + j0, cols, kvh, d);
        load_rows(&mut sc.v, ctx.v, &p.v, b, seq.k_row + j0, cols, kvh, d);
        for u in 0..nsub {
            // The part of this key tile the sub-tile sees (under a causal mask the first
            // sub-tile sees fewer keys than the last).
            let c0 = sub_keys[u].0.max(j0);
            let c1 = sub_keys[u].1.min(j0 + cols);
            if c0 >= c1 {
                continue;
            }
            let (r0, n) = sub_rows[u];
            let (kt, vt) = (&sc.k[(c0 - j0) * d..], &sc.v[(c0 - j0) * d..]);
            update::<K>(&it, &mut sc.sub[u], &mut sc.s, kt, vt, r0, n, c0, c1 - c0);
        }
        j0 += cols;
    }

    // Epilogue: one division per row, Oᵀ transposed back into the output rows.
    let row_stride = p.heads * d;
    let lse_h = p.lse_head_stride();
    for (u, &(r0, n)) in sub_rows[..nsub].iter().enumerate() {
        let st = &sc.sub[u];
        for r in 0..n {
            let l = st.l.0[r];
            let i = r0 + r;
            let base = (seq.out_row + i) * row_stride + h * d;
            // A row that saw no key has l = 0 and outputs exactly 0; NaN stays NaN.
            let (inv, row_lse) = if l == 0.0 {
                (0.0, f32::NEG_INFINITY)
            } else {
                (1.0 / l, (st.m.0[r] + l.log2()) / LOG2_E)
            };
            for (x, ot) in st.ot.iter().enumerate() {
                let o = if l == 0.0 { 0.0 } else { ot.0[r] * inv };
                // SAFETY: element (row, h, x) belongs to this work item alone and is in bounds
                // of the output allocated by `forward` (total_q * heads * d elements).
                unsafe { *ctx.out.0.add(base + x) = T::from_f32(o) };
            }
            // SAFETY: as above, for the row's log-sum-exp.
            unsafe { *ctx.lse.0.add(seq.lse_base + h * lse_h + i) = row_lse };
        }
    }
}

/// Folds keys `j0 .. j0 + cols` (rows of `kt` and `vt`) into the sub-tile of query rows
/// `r0 .. r0 + rows`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn update<K: Kernel>(
    it: &ItemCtx,
    st: &mut SubTile,
    s: &mut [Lanes],
    kt: &[f32],
    vt: &[f32],
    r0: usize,
    rows: usize,
    j0: usize,
    cols: usize,
) {
    let (p, d, sq, sk, slope) = (it.p, it.d, it.sq, it.sk, it.slope);
    // Sᵀ = K Qᵀ, ROWS keys per micro-kernel call.
    let mut c = 0;
    while c < cols {
        let n = K::ROWS.min(cols - c);
        K::block(&mut s[c..c + n], None, &kt[c * d..], d, 1, &st.qt, d);
        c += n;
    }
    let s = &mut s[..cols];

    if it.softcap || slope != 0.0 {
        for (c, s) in s.iter_mut().enumerate() {
            for (r, s) in s.0[..rows].iter_mut().enumerate() {
                let raw = if it.softcap {
                    p.score.cap(*s) * LOG2_E
                } else {
                    *s
                };
                let bias = if slope != 0.0 {
                    alibi_bias(slope, r0 + r, j0 + c, sq, sk) * LOG2_E
                } else {
                    0.0
                };
                *s = raw - bias;
            }
        }
    }
    // Only tiles the band cuts through need a per-element mask.
    if !p.window.covers(r0..r0 + rows, j0..j0 + cols, sq, sk) {
        // Per-lane bounds, then one lane-wise compare per key: the loop over lanes vectorises,
        // where a loop over keys per row was a scalar store per score.
        let mut lo = [0usize; BR];
        let mut hi = [usize::MAX; BR];
        for (r, (lo, hi)) in lo.iter_mut().zip(hi.iter_mut()).take(rows).enumerate() {
            (*lo, *hi) = p.window.key_range(r0 + r, sq, sk);
        }
        for (c, s) in s.iter_mut().enumerate() {
            let j = j0 + c;
            for ((x, &lo), &hi) in s.0.iter_mut().zip(&lo).zip(&hi) {
                if j < lo || j >= hi {
                    *x = f32::NEG_INFINITY;
                }
            }
        }
    }

    // Online softmax, per lane: m_new = max(m, rowmax(S)), P = 2^(S - m_new),
    // l = l · 2^(m - m_new) + rowsum(P); O gets the same correction inside the P·V kernel.
    //
    // This max skips NaN scores (it compiles to `vmaxps`), yet NaN still propagates: a NaN score
    // turns its P, hence l and that row of O, into NaN, even when every other key is masked.
    let m_tile = K::max_rows(s);
    let mut corr = Lanes::splat(0.0);
    // The max to subtract: a lane that has seen only masked keys keeps m = -inf and subtracts 0
    // instead, so its P and correction are 0 rather than NaN.
    let mut m_sub = Lanes::splat(0.0);
    for (((m, &mt), ms), corr) in
        st.m.0
            .iter_mut()
            .zip(&m_tile.0)
            .zip(m_sub.0.iter_mut())
            .zip(corr.0.iter_mut())
    {
        let m_new = if mt > *m { mt } else { *m };
        *ms = if m_new == f32::NEG_INFINITY {
            0.0
        } else {
            m_new
        };
        *corr = exp2::<K>(*m - *ms);
        *m = m_new;
    }
    let mut row_sum = Lanes::splat(0.0);
    for s in s.iter_mut() {
        for ((x, &ms), sum) in s.0.iter_mut().zip(&m_sub.0).zip(row_sum.0.iter_mut()) {
            *x = exp2::<K>(*x - ms);
            *sum += *x;
        }
    }
    for ((l, &c), &s) in st.l.0.iter_mut().zip(&corr.0).zip(&row_sum.0) {
        *l = K::fma(*l, c, s);
    }

    // Oᵀ = Oᵀ · corr + Vᵀ Pᵀ, ROWS head dims per micro-kernel call.
    let mut x = 0;
    while x < d {
        let n = K::ROWS.min(d - x);
        K::block(&mut st.ot[x..x + n], Some(&corr), &vt[x..], 1, d, s, cols);
        x += n;
    }
}

#[cfg(test)]
mod tests {
    use candle::{Device, Tensor};

    use super::*;
    use crate::{naive_attention, FlashAttn};

    /// Every instruction set this CPU has, so the fallbacks are tested on an AVX-512 machine too.
    fn isas() -> Vec<Isa> {
        let mut v = vec![Isa::Portable];
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
                v.push(Isa::Avx2Fma);
            }
            if is_x86_feature_detected!("avx512f") {
                v.push(Isa::Avx512);
            }
        }
        v
    }

    #[test]
    fn every_isa_matches_naive() -> candle::Result<()> {
        let dev = Device::Cpu;
        let cases = [
            (1, 1, 8, 2, 2, FlashAttn::new(0.3)),
            (17, 239, 40, 6, 2, FlashAttn::new(0.2).causal()),
            (239, 17, 80, 6, 1, FlashAttn::new(0.2).causal()),
            (
                130,
                200,
                24,
                4,
                2,
                FlashAttn::new(0.2).window(Some(30), Some(5)).softcap(3.0),
            ),
            (
                129,
                129,
                256,
                2,
                1,
                FlashAttn::new(0.06).window(Some(0), None),
            ),
            (
                200,
                131,
                40,
                2,
                2,
                FlashAttn::new(0.2).alibi(&Tensor::new(&[0.25f32, 0.0625], &dev)?),
            ),
        ];
        for (sq, sk, d, h, hk, opts) in cases {
            let q = Tensor::randn(0f32, 1., (1, sq, h, d), &dev)?;
            let k = Tensor::randn(0f32, 1., (1, sk, hk, d), &dev)?;
            let v = Tensor::randn(0f32, 1., (1, sk, hk, d), &dev)?;
            let want = naive_attention(&q, &k, &v, &opts)?
                .flatten_all()?
                .to_vec1::<f32>()?;
            let p = opts.problem(&q, &k, &v, None)?;
            let slopes = match &opts.alibi_slopes {
                Some(s) => Some(s.to_vec1::<f32>()?),
                None => None,
            };
            let flat = |t: &Tensor| t.flatten_all()?.to_vec1::<f32>();
            let (qv, kv, vv) = (flat(&q)?, flat(&k)?, flat(&v)?);
            for isa in isas() {
                let (got, _) = forward_with(isa, &p, slopes.as_deref(), &qv, &kv, &vv);
                let err = got
                    .iter()
                    .zip(&want)
                    .map(|(g, w)| (g - w).abs())
                    .fold(0f32, |a, e| if e > a || e.is_nan() { e } else { a });
                assert!(err <= 1e-4, "{isa:?} ({sq}, {sk}, {d}): max error {err}");
            }
        }
        Ok(())
    }

    #[test]
    fn exp2_is_accurate_and_exact_at_the_ends() {
        assert_eq!(exp2::<Portable>(0.0), 1.0);
        assert_eq!(exp2::<Portable>(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp2::<Portable>(-200.0), 0.0);
        assert!(exp2::<Portable>(f32::NAN).is_nan());
        let mut x = -126.0f32;
        while x <= 20.0 {
            let rel = (exp2::<Portable>(x) as f64 / (x as f64).exp2() - 1.0).abs();
            assert!(rel < 5e-7, "exp2({x}): relative error {rel}");
            x += 0.0137;
        }
    }
}
