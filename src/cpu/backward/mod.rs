//! Tiled CPU backward pass (FlashAttention-2): gradients of q, k and v from the saved
//! log-sum-exp, with no N×N buffer.
//!
//! 1. **Preprocess**: `D = rowsum(dO ∘ O)` and `lse · log2 e` per (row, head), O(N).
//! 2. **dK/dV pass**: work items own key tiles of one `(batch, kv head)`, [`Tiles::KSUB`] of
//!    them held at once. For each query head of the group and each query tile that sees them
//!    (loaded once for all of them): recompute `S` and `P` from q, k and the lse, then
//!    `dV += Pᵀ dO`, `dP = dO Vᵀ`, `dS = P ∘ (dP - D)`, `dK += dSᵀ Q` (see [`tile`], and
//!    [`tile16`] for bf16 on a bf16 engine). dK and dV of a key tile have one owner: no atomics.
//! 3. **dQ** (`dQ += dS K`), one of two ways, chosen by [`fused`]:
//!    * *fused*: when there are enough `(batch, kv head)` pairs to keep every thread busy, an
//!      item owns a whole pair, walks its key tiles in order and adds each step's `dS K` to the
//!      rows of dQ it alone writes (5 products per step);
//!    * *split*: otherwise the dK/dV items are single key tiles (parallel even for one kv head)
//!      and a second pass over `(batch, head, QSUB query tiles)` recomputes `S`, `P`, `dP`,
//!      `dS` and adds `dS K` key tile by key tile (7 products per step in all).
//!
//!    Both add the same per-step tiles (or, for the bf16 engines, the same per-group tiles:
//!    one `dS K` over `KSUB` key tiles, added once) in the same key-tile order over the same
//!    tile grid, so they give bitwise identical results, whatever the thread count; every sum
//!    runs in a fixed order, so runs are bitwise reproducible.
//!
//! Extra memory: `D` and the lse (two f32 per row and head), an f32 dQ accumulator when the
//! inputs are f16/bf16 (f32 accumulates in the output itself), and per thread a few tiles
//! (about 0.5 MiB at head dim 64, 3.6 MiB at 512; on the bf16 engines, which hold twice the
//! key tiles and query rows, 1.8 MiB at 128 and 6.4 MiB at 512), independent of the sequence
//! lengths.

mod tile;
#[cfg(target_arch = "x86_64")]
mod tile16;

use std::marker::PhantomData;

use candle::Result;
use rayon::prelude::*;

#[cfg(target_arch = "x86_64")]
use super::bf16::{AmxBf16, Avx512Bf16, Engine};
use super::dispatch::Path;
use super::elem::{same_slice, same_vec, Elem};
use super::extras::Extras;
#[cfg(target_arch = "x86_64")]
use super::kernel::{Avx512, Fused};
use super::kernel::{Isa, Kernel, Portable};
use super::{Lanes, SyncPtr, BC};
use crate::problem::{KeyRows, Problem, Seq};
use crate::semantics::{group_size, LOG2_E};
use tile::{with_scratch, QuerySrc, Scratch, Step, QSUB};

/// The most key tiles any path's [`Tiles::KSUB`] holds at once.
const MAX_KSUB: usize = 8;

/// dq (contiguous like the output: `total_q × heads × d`), dk and dv (contiguous,
/// `k_rows × kv_heads × d`) of one call. `out`, `grad_out` are contiguous like the output,
/// `lse` is the forward's log-sum-exp in its own layout (see [`Problem::lse_head_stride`]).
#[allow(clippy::too_many_arguments, clippy::type_complexity)]
pub(crate) fn backward<T: Elem>(
    p: &Problem,
    slopes: Option<&[f32]>,
    q: &[T],
    k: &[T],
    v: &[T],
    out: &[T],
    grad_out: &[T],
    lse: &[f32],
    k_rows: usize,
) -> Result<(Vec<T>, Vec<T>, Vec<T>)> {
    if p.paged.is_some() || p.prefix.is_some() {
        candle::bail!("flash-attn backward: paged caches and prefix ranges have no CPU backward")
    }
    let d = p.head_dim;
    let n = p.total_q * p.heads * d;
    if out.len() < n || grad_out.len() < n {
        candle::bail!("flash-attn backward: the output or its gradient is smaller than q")
    }
    if lse.len() < p.total_q * p.heads {
        candle::bail!("flash-attn backward: the saved log-sum-exp is smaller than the output")
    }
    let path = super::dispatch::choose::<T>(p, true)?;
    let fused = fused(p, rayon::current_num_threads());
    let extras = Extras::of(p)?;
    let args = Args {
        p,
        slopes,
        extras: &extras,
        q,
        k,
        v,
        out,
        go: grad_out,
        lse,
        k_rows,
    };
    Ok(backward_with(path, fused, &args))
}

/// `true` when dQ is accumulated inside the dK/dV pass, with whole `(batch, kv head)` pairs as
/// work items: when there are at least two per thread, or (dense inputs: items of one size)
/// a multiple of the thread count. Otherwise the split schedule's extra dQ pass (7 products
/// per step instead of 5) buys parallelism.
fn fused(p: &Problem, threads: usize) -> bool {
    let items = p.batch * p.kv_heads;
    let threads = threads.max(1);
    items >= 2 * threads
        || (p.varlen.is_none() && items >= threads && items.is_multiple_of(threads))
}

/// The inputs of one call.
struct Args<'a, T> {
    p: &'a Problem,
    slopes: Option<&'a [f32]>,
    /// The bias and block mask, read on the host.
    extras: &'a Extras<'a>,
    q: &'a [T],
    k: &'a [T],
    v: &'a [T],
    out: &'a [T],
    go: &'a [T],
    lse: &'a [f32],
    k_rows: usize,
}

/// Everything a work item reads and the outputs it writes, shared by all of them.
struct Ctx<'a, T> {
    p: &'a Problem,
    slopes: Option<&'a [f32]>,
    extras: &'a Extras<'a>,
    k: &'a [T],
    v: &'a [T],
    src: QuerySrc<'a, T>,
    /// f32 dQ accumulator (`total_q × heads × d`, unscaled), dK and dV outputs.
    dq: SyncPtr<f32>,
    dk: SyncPtr<T>,
    dv: SyncPtr<T>,
}

/// A unit of parallel work.
#[derive(Clone, Copy, Debug)]
enum Item {
    /// Key tiles `t0 .. t1` of kv head `kvh` in sequence `b` (dK, dV; dQ too with `dq`).
    Keys {
        b: usize,
        kvh: usize,
        t0: usize,
        t1: usize,
        dq: bool,
    },
    /// dQ of query tiles `t · QSUB ..` of head `h` in sequence `b`.
    Queries { b: usize, h: usize, t: usize },
}

/// The gradients on `path` (the caller checked that the CPU has it).
#[allow(clippy::type_complexity)]
fn backward_with<T: Elem>(path: Path, fused: bool, a: &Args<T>) -> (Vec<T>, Vec<T>, Vec<T>) {
    let d = a.p.head_dim;
    match path {
        Path::F32(isa) => schedule(fused, tile::QT, a, |ctx, item| {
            with_scratch(d, |sc| match isa {
                #[cfg(target_arch = "x86_64")]
                // SAFETY: the caller saw avx512f on this CPU.
                Isa::Avx512 => unsafe { item_avx512(ctx, sc, item) },
                #[cfg(target_arch = "x86_64")]
                // SAFETY: the caller saw avx2 and fma on this CPU.
                Isa::Avx2Fma => unsafe { item_avx2(ctx, sc, item) },
                Isa::Portable => run_item(ctx, &mut F32Tiles::<Portable>(sc, PhantomData), item),
            })
        }),
        #[cfg(target_arch = "x86_64")]
        Path::Bf16(engine) => {
            use super::dispatch::Engine as E;
            let Some(a16) = a.as_bf16() else {
                // The dispatcher picks an engine for bf16 inputs only.
                return backward_with(Path::F32(Isa::detect()), fused, a);
            };
            let (dq, dk, dv) = match engine {
                E::Amx => backward_bf16::<AmxBf16>(fused, &a16),
                E::Avx512Bf16 => backward_bf16::<Avx512Bf16>(fused, &a16),
            };
            let cast = |x| same_vec(x).unwrap_or_default();
            (cast(dq), cast(dk), cast(dv))
        }
        #[cfg(not(target_arch = "x86_64"))]
        Path::Bf16(_) => backward_with(Path::F32(Isa::detect()), fused, a),
    }
}

/// The bf16 gradients with both products of every step on engine `E`.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::type_complexity)]
fn backward_bf16<E: Engine>(
    fused: bool,
    a: &Args<half::bf16>,
) -> (Vec<half::bf16>, Vec<half::bf16>, Vec<half::bf16>) {
    let d = a.p.head_dim;
    schedule(fused, tile16::QT, a, |ctx, item| {
        tile16::with_scratch16::<E>(d, |sc| {
            // SAFETY: the dispatcher chose a bf16 engine only after detecting avx512f/bw/vl,
            // avx512bf16, avx2 and fma (and for AMX, the tile unit and its permission).
            unsafe { item_bf16::<E>(ctx, sc, item) }
        })
    })
}

impl<'a, T: Elem> Args<'a, T> {
    /// The same arguments typed as bf16, when `T` is bf16.
    fn as_bf16(&self) -> Option<Args<'a, half::bf16>> {
        Some(Args {
            p: self.p,
            slopes: self.slopes,
            extras: self.extras,
            q: same_slice(self.q)?,
            k: same_slice(self.k)?,
            v: same_slice(self.v)?,
            out: same_slice(self.out)?,
            go: same_slice(self.go)?,
            lse: self.lse,
            k_rows: self.k_rows,
        })
    }
}

/// The schedule of the module docs, each work item run by `item`: preprocess, the dK/dV items
/// (with dQ when `fused`), else the dQ items (`QSUB` query tiles of `qt` rows each); then dQ
/// scaled and converted.
#[allow(clippy::type_complexity)]
fn schedule<T: Elem>(
    fused: bool,
    qt: usize,
    a: &Args<T>,
    item: impl Fn(&Ctx<T>, Item) + Sync,
) -> (Vec<T>, Vec<T>, Vec<T>) {
    let p = a.p;
    let (d, heads) = (p.head_dim, p.heads);
    let (lse2, delta) = preprocess(a);
    let mut dq = vec![0f32; p.total_q * heads * d];
    let mut dk = vec![T::from_f32(0.0); a.k_rows * p.kv_heads * d];
    let mut dv = vec![T::from_f32(0.0); a.k_rows * p.kv_heads * d];
    let ctx = Ctx {
        p,
        slopes: a.slopes,
        extras: a.extras,
        k: a.k,
        v: a.v,
        src: QuerySrc {
            q: a.q,
            qs: &p.q,
            go: a.go,
            lse2: &lse2,
            delta: &delta,
            heads,
        },
        dq: SyncPtr(dq.as_mut_ptr()),
        dk: SyncPtr(dk.as_mut_ptr()),
        dv: SyncPtr(dv.as_mut_ptr()),
    };
    let run = |items: Vec<Item>| {
        // One item per rayon job, so idle threads can steal any single item.
        items
            .into_par_iter()
            .with_max_len(1)
            .for_each(|it| item(&ctx, it))
    };
    let key_tiles = |b: usize| {
        let seq = p.seq(b);
        let (lo, hi) = p.mask(b, &seq).key_range_rows(0..seq.seq_q);
        if seq.seq_q == 0 || lo >= hi {
            (0, 0)
        } else {
            (lo / BC, hi.div_ceil(BC))
        }
    };
    if fused {
        let items = (0..p.batch)
            .flat_map(|b| {
                let (t0, t1) = key_tiles(b);
                (0..p.kv_heads).map(move |kvh| Item::Keys {
                    b,
                    kvh,
                    t0,
                    t1,
                    dq: true,
                })
            })
            .filter(|it| matches!(it, Item::Keys { t0, t1, .. } if t0 < t1))
            .collect();
        run(items);
    } else {
        let items = (0..p.batch)
            .flat_map(|b| {
                let (t0, t1) = key_tiles(b);
                (0..p.kv_heads).flat_map(move |kvh| {
                    (t0..t1).map(move |t| Item::Keys {
                        b,
                        kvh,
                        t0: t,
                        t1: t + 1,
                        dq: false,
                    })
                })
            })
            .collect();
        run(items);
        // Last query tiles first: under a causal mask they see the most keys.
        let items = (0..p.batch)
            .flat_map(|b| {
                let tiles = p.seq(b).seq_q.div_ceil(QSUB * qt);
                (0..heads)
                    .flat_map(move |h| (0..tiles).rev().map(move |t| Item::Queries { b, h, t }))
            })
            .collect();
        run(items);
    }
    let scale = p.score.scale;
    dq.par_iter_mut().for_each(|x| *x *= scale);
    (into_elems(dq), dk, dv)
}

/// `D = rowsum(dO ∘ O)` and `lse · log2 e` (`+inf` where the lse is `-inf`, so that every
/// probability of a row that sees no key is `2^-inf = 0`), both indexed `row * heads + h`.
fn preprocess<T: Elem>(a: &Args<T>) -> (Vec<f32>, Vec<f32>) {
    let p = a.p;
    let (d, heads) = (p.head_dim, p.heads);
    let mut delta = vec![0f32; p.total_q * heads];
    delta
        .par_chunks_mut(heads)
        .enumerate()
        .for_each(|(row, dr)| {
            for (h, dr) in dr.iter_mut().enumerate() {
                let base = (row * heads + h) * d;
                let (o, g) = (&a.out[base..base + d], &a.go[base..base + d]);
                *dr = o.iter().zip(g).map(|(o, g)| o.to_f32() * g.to_f32()).sum();
            }
        });
    let mut lse2 = vec![f32::INFINITY; p.total_q * heads];
    let lhs = p.lse_head_stride();
    for b in 0..p.batch {
        let seq = p.seq(b);
        for h in 0..heads {
            for i in 0..seq.seq_q {
                let l = a.lse[seq.lse_base + h * lhs + i];
                lse2[(seq.out_row + i) * heads + h] = if l == f32::NEG_INFINITY {
                    f32::INFINITY
                } else {
                    l * LOG2_E
                };
            }
        }
    }
    (lse2, delta)
}

/// The f32 accumulator as the output element type (no copy for f32).
fn into_elems<T: Elem>(v: Vec<f32>) -> Vec<T> {
    match same_vec::<f32, T>(v) {
        Ok(same) => same,
        Err(v) => v.par_iter().map(|&x| T::from_f32(x)).collect(),
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
fn item_avx512<T: Elem>(ctx: &Ctx<T>, sc: &mut Scratch, item: Item) {
    run_item(ctx, &mut F32Tiles::<Avx512>(sc, PhantomData), item)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn item_avx2<T: Elem>(ctx: &Ctx<T>, sc: &mut Scratch, item: Item) {
    run_item(ctx, &mut F32Tiles::<Fused>(sc, PhantomData), item)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma")]
fn item_bf16<E: Engine>(ctx: &Ctx<half::bf16>, sc: &mut tile16::Scratch16, item: Item) {
    E::begin();
    run_item(ctx, &mut Bf16Tiles::<E>(sc, PhantomData), item);
    E::end();
}

/// The tiles of one path: what the schedule asks of them (see [`tile`] and [`tile16`]).
trait Tiles<T> {
    /// Key tiles held at once (at most [`MAX_KSUB`]): each query tile load (and each pass
    /// over its dQ rows) serves this many.
    const KSUB: usize;
    /// Query rows per step, the grid of query tiles (the split schedule's dQ items are
    /// [`QSUB`] of them).
    const QT: usize;
    /// dQ of a query tile is one product over the key tiles of a group of `KSUB` (on the grid
    /// of groups from the sequence's first key tile), between [`dq_begin`](Self::dq_begin) and
    /// [`dq_end`](Self::dq_end), and added once; otherwise each step's product is added.
    const GROUPED_DQ: bool;
    /// Starts a grouped dQ for the `rows` query rows from row `base` of the loaded ones.
    fn dq_begin(&mut self, _base: usize, _rows: usize) {}
    /// The grouped dQ of the steps since `dq_begin` over key tile slots `0 .. slots`.
    fn dq_end(&mut self, _slots: usize) {}
    /// Keys `j0 .. j0 + cols` of kv head `kvh` into key tile slot `u` (with `chunks`, also
    /// the layout of the dQ product).
    #[allow(clippy::too_many_arguments)]
    fn load_keys(
        &mut self,
        u: usize,
        p: &Problem,
        k: &[T],
        v: &[T],
        keys: &KeyRows,
        j0: usize,
        cols: usize,
        kvh: usize,
        chunks: bool,
    );
    /// Query rows `i0 .. i0 + rows` of head `h`: Q, dO, their lse and `D`.
    #[allow(clippy::too_many_arguments)]
    fn load_queries(
        &mut self,
        src: &QuerySrc<T>,
        b: usize,
        q_row: usize,
        out_row: usize,
        i0: usize,
        rows: usize,
        h: usize,
    );
    /// One step (see [`tile::step`]).
    fn step(&mut self, st: &Step, dkdv: bool, dq: bool);
    /// Adds row `r` of the last step's dQ tile to `dst`.
    fn add_dq_row(&self, r: usize, dst: &mut [f32]);
    fn zero_dkdv(&mut self);
    /// `dKᵀ` (unscaled) and `dVᵀ` of slot `u`: rows of key lanes, the first `d` the head dims.
    fn dkdv(&self, u: usize) -> (&[Lanes], &[Lanes]);
}

/// The f32 tiles with micro-kernels `K`.
struct F32Tiles<'a, K>(&'a mut Scratch, PhantomData<K>);

impl<T: Elem, K: Kernel> Tiles<T> for F32Tiles<'_, K> {
    const KSUB: usize = tile::KSUB;
    const QT: usize = tile::QT;
    const GROUPED_DQ: bool = false;
    #[inline(always)]
    fn load_keys(
        &mut self,
        u: usize,
        p: &Problem,
        k: &[T],
        v: &[T],
        keys: &KeyRows,
        j0: usize,
        cols: usize,
        kvh: usize,
        chunks: bool,
    ) {
        tile::load_keys_tile(self.0, u, p, k, v, keys, j0, cols, kvh, chunks)
    }
    #[inline(always)]
    fn load_queries(
        &mut self,
        src: &QuerySrc<T>,
        b: usize,
        q_row: usize,
        out_row: usize,
        i0: usize,
        rows: usize,
        h: usize,
    ) {
        tile::load_queries(self.0, src, b, q_row, out_row, i0, rows, h)
    }
    #[inline(always)]
    fn step(&mut self, st: &Step, dkdv: bool, dq: bool) {
        tile::step::<K>(st, self.0, dkdv, dq)
    }
    #[inline(always)]
    fn add_dq_row(&self, r: usize, dst: &mut [f32]) {
        self.0.add_dq_row(r, dst)
    }
    #[inline(always)]
    fn zero_dkdv(&mut self) {
        self.0.zero_dkdv()
    }
    #[inline(always)]
    fn dkdv(&self, u: usize) -> (&[Lanes], &[Lanes]) {
        self.0.dkdv(u)
    }
}

/// The bf16 tiles on engine `E`.
#[cfg(target_arch = "x86_64")]
struct Bf16Tiles<'a, E>(&'a mut tile16::Scratch16, PhantomData<E>);

#[cfg(target_arch = "x86_64")]
impl<E: Engine> Tiles<half::bf16> for Bf16Tiles<'_, E> {
    const KSUB: usize = tile16::KSUB;
    const QT: usize = tile16::QT;
    const GROUPED_DQ: bool = true;
    #[inline(always)]
    fn dq_begin(&mut self, base: usize, rows: usize) {
        self.0.dq_begin(base, rows)
    }
    #[inline(always)]
    fn dq_end(&mut self, slots: usize) {
        tile16::dq_end::<E>(self.0, slots)
    }
    #[inline(always)]
    fn load_keys(
        &mut self,
        u: usize,
        p: &Problem,
        k: &[half::bf16],
        v: &[half::bf16],
        keys: &KeyRows,
        j0: usize,
        cols: usize,
        kvh: usize,
        chunks: bool,
    ) {
        tile16::load_keys_tile(self.0, u, p, k, v, keys, j0, cols, kvh, chunks)
    }
    #[inline(always)]
    fn load_queries(
        &mut self,
        src: &QuerySrc<half::bf16>,
        b: usize,
        q_row: usize,
        out_row: usize,
        i0: usize,
        rows: usize,
        h: usize,
    ) {
        tile16::load_queries(self.0, src, b, q_row, out_row, i0, rows, h)
    }
    #[inline(always)]
    fn step(&mut self, st: &Step, dkdv: bool, dq: bool) {
        tile16::step::<E>(st, self.0, dkdv, dq)
    }
    #[inline(always)]
    fn add_dq_row(&self, r: usize, dst: &mut [f32]) {
        self.0.add_dq_row(r, dst)
    }
    #[inline(always)]
    fn zero_dkdv(&mut self) {
        self.0.zero_dkdv()
    }
    #[inline(always)]
    fn dkdv(&self, u: usize) -> (&[Lanes], &[Lanes]) {
        self.0.dkdv(u)
    }
}

#[inline(always)]
fn run_item<T: Elem, S: Tiles<T>>(ctx: &Ctx<T>, sc: &mut S, item: Item) {
    match item {
        Item::Keys { b, kvh, t0, t1, dq } => {
            let mut t = t0;
            while t < t1 {
                let end = (t + S::KSUB).min(t1);
                key_tiles(ctx, sc, b, kvh, t, end, dq);
                t = end;
            }
        }
        Item::Queries { b, h, t } => query_tiles(ctx, sc, b, h, t),
    }
}

/// The ALiBi slope of head `h` in sequence `b` (0 without ALiBi).
fn slope<T>(ctx: &Ctx<T>, b: usize, h: usize) -> f32 {
    ctx.slopes
        .map_or(0.0, |s| s[b * ctx.p.alibi_batch_stride + h])
}

/// Adds the dQ tile of the last step (rows `i0 .. i0 + rows` of head `h`) to the accumulator.
fn add_dq<T: Elem>(ctx: &Ctx<T>, sc: &impl Tiles<T>, seq: &Seq, h: usize, i0: usize, rows: usize) {
    let (d, heads) = (ctx.p.head_dim, ctx.p.heads);
    for r in 0..rows {
        let base = ((seq.out_row + i0 + r) * heads + h) * d;
        // SAFETY: rows of head `h` in this sequence are written by one work item only (the
        // item owning the pair's kv head when fused, else the query tile's item), and the
        // range lies inside the `total_q * heads * d` accumulator.
        let dst = unsafe { std::slice::from_raw_parts_mut(ctx.dq.0.add(base), d) };
        sc.add_dq_row(r, dst);
    }
}

/// Key tiles `t0 .. t1` (at most [`Tiles::KSUB`]) of kv head `kvh` in sequence `b`, held at
/// once: dK and dV of their keys (written out), and with `dq` the dQ of their steps added
/// (per step, or per query tile for a grouped dQ; the groups are those of `run_item`).
///
/// Every step covers one query tile of the grid of multiples of [`QT`] and one key tile,
/// clipped to the rows that see that key tile, so the arithmetic of each key tile (and each
/// step's dQ tile) does not depend on how tiles are grouped.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn key_tiles<T: Elem, S: Tiles<T>>(
    ctx: &Ctx<T>,
    sc: &mut S,
    b: usize,
    kvh: usize,
    t0: usize,
    t1: usize,
    dq: bool,
) {
    let p = ctx.p;
    let d = p.head_dim;
    let seq = p.seq(b);
    let (sq, sk) = (seq.seq_q, seq.seq_k);
    let mask = p.mask(b, &seq);
    let keys = p.key_rows(b, &seq);
    // Per slot: first key, keys, and the query rows `[ia, ib)` that see some key of the tile
    // (both ends of a row's key range grow with the row, so they form one interval).
    let mut span = [(0usize, 0usize, 0usize, 0usize); MAX_KSUB];
    let (mut ia, mut ib) = (sq, 0);
    for (u, t) in (t0..t1).enumerate() {
        let j0 = t * BC;
        let cols = BC.min(sk - j0);
        sc.load_keys(u, p, ctx.k, ctx.v, &keys, j0, cols, kvh, dq);
        let a = partition_point(sq, |i| mask.row_range(i).1 <= j0);
        let z = partition_point(sq, |i| mask.row_range(i).0 < j0 + cols);
        span[u] = (j0, cols, a, z);
        (ia, ib) = (ia.min(a), ib.max(z));
    }
    let span = &span[..t1 - t0];
    sc.zero_dkdv();
    let group = group_size(p.heads, p.kv_heads);
    for h in kvh * group..(kvh + 1) * group {
        let slope = slope(ctx, b, h);
        let mut i0 = ia;
        while i0 < ib {
            // One query tile of the grid, loaded once for all key tiles.
            let i1 = ((i0 / S::QT + 1) * S::QT).min(ib);
            sc.load_queries(&ctx.src, b, seq.q_row, seq.out_row, i0, i1 - i0, h);
            let grouped = dq && S::GROUPED_DQ;
            if grouped {
                sc.dq_begin(0, i1 - i0);
            }
            for (u, &(j0, cols, a, z)) in span.iter().enumerate() {
                let (r0, r1) = (i0.max(a), i1.min(z));
                if r0 >= r1 {
                    continue;
                }
                let st = Step {
                    p,
                    mask,
                    slope,
                    extras: ctx.extras.at(b, h),
                    i0: r0,
                    rows: r1 - r0,
                    ro: r0 - i0,
                    j0,
                    cols,
                    u,
                };
                sc.step(&st, true, dq);
                if dq && !grouped {
                    add_dq(ctx, sc, &seq, h, r0, r1 - r0);
                }
            }
            if grouped {
                // Rows of the tile that see none of these keys add 0.
                sc.dq_end(span.len());
                add_dq(ctx, sc, &seq, h, i0, i1 - i0);
            }
            i0 = i1;
        }
    }
    // dK = scale · dSᵀ Q and dV, transposed back into rows.
    let scale = p.score.scale;
    let row0 = match p.varlen {
        None => b * p.max_seq_k,
        Some(_) => seq.k_row,
    };
    for (u, &(j0, cols, _, _)) in span.iter().enumerate() {
        let (dkt, dvt) = sc.dkdv(u);
        for c in 0..cols {
            let base = ((row0 + j0 + c) * p.kv_heads + kvh) * d;
            for x in 0..d {
                // SAFETY: key rows of kv head `kvh` in this tile belong to this work item alone
                // and lie inside the `k_rows * kv_heads * d` outputs (`row0 + j0 + c < k_rows`).
                unsafe {
                    *ctx.dk.0.add(base + x) = T::from_f32(dkt[x].0[c] * scale);
                    *ctx.dv.0.add(base + x) = T::from_f32(dvt[x].0[c]);
                }
            }
        }
    }
}

/// The first `i < n` for which `pred` is false, `pred` being true on a prefix of `0 .. n`.
fn partition_point(n: usize, pred: impl Fn(usize) -> bool) -> usize {
    let (mut lo, mut hi) = (0, n);
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        if pred(mid) {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    lo
}

/// dQ of query tiles `t · QSUB ..` (up to [`QSUB`] of them) of head `h` in sequence `b` (the
/// split schedule): every key tile each of them sees, in order; each key tile is loaded once
/// for all of them. A grouped dQ is made of the same groups of key tiles as in the fused
/// schedule (`run_item`), so the two add the same tiles.
#[inline(always)]
fn query_tiles<T: Elem, S: Tiles<T>>(ctx: &Ctx<T>, sc: &mut S, b: usize, h: usize, t: usize) {
    let p = ctx.p;
    let seq = p.seq(b);
    let sk = seq.seq_k;
    let qt = S::QT;
    let i0 = t * QSUB * qt;
    let rows = (QSUB * qt).min(seq.seq_q - i0);
    let mask = p.mask(b, &seq);
    // Per query tile of the grid: its rows and the key tiles `[k0, k1)` its rows see.
    let mut tiles = [(0usize, 0usize, 0usize, 0usize); QSUB];
    let (mut k0, mut k1) = (usize::MAX, 0);
    let n = rows.div_ceil(qt);
    for (s, tile) in tiles[..n].iter_mut().enumerate() {
        let r0 = i0 + s * qt;
        let r = qt.min(i0 + rows - r0);
        let (lo, hi) = mask.key_range_rows(r0..r0 + r);
        *tile = if lo < hi {
            (r0, r, lo / BC, hi.div_ceil(BC))
        } else {
            (r0, r, 0, 0)
        };
        if lo < hi {
            (k0, k1) = (k0.min(tile.2), k1.max(tile.3));
        }
    }
    if k0 >= k1 {
        return;
    }
    let keys = p.key_rows(b, &seq);
    let kvh = crate::semantics::kv_head(h, p.heads, p.kv_heads);
    let slope = slope(ctx, b, h);
    sc.load_queries(&ctx.src, b, seq.q_row, seq.out_row, i0, rows, h);
    if S::GROUPED_DQ {
        // The sequence's key tiles `[g0, g1)`, as `schedule` gives them to the fused items.
        let (lo, hi) = mask.key_range_rows(0..seq.seq_q);
        let (g0, g1) = (lo / BC, hi.div_ceil(BC));
        let mut gs = g0 + (k0 - g0) / S::KSUB * S::KSUB;
        while gs < k1 {
            let ge = (gs + S::KSUB).min(g1);
            for (u, kt) in (gs..ge).enumerate() {
                let cols = BC.min(sk - kt * BC);
                sc.load_keys(u, p, ctx.k, ctx.v, &keys, kt * BC, cols, kvh, true);
            }
            for &(r0, r, lo, hi) in &tiles[..n] {
                if hi <= gs || lo >= ge {
                    continue;
                }
                sc.dq_begin(r0 - i0, r);
                for (u, kt) in (gs..ge).enumerate() {
                    if kt < lo || kt >= hi {
                        continue;
                    }
                    let st = Step {
                        p,
                        mask,
                        slope,
                        extras: ctx.extras.at(b, h),
                        i0: r0,
                        rows: r,
                        ro: r0 - i0,
                        j0: kt * BC,
                        cols: BC.min(sk - kt * BC),
                        u,
                    };
                    sc.step(&st, false, true);
                }
                sc.dq_end(ge - gs);
                add_dq(ctx, sc, &seq, h, r0, r);
            }
            gs = ge;
        }
        return;
    }
    for kt in k0..k1 {
        let j0 = kt * BC;
        let cols = BC.min(sk - j0);
        sc.load_keys(0, p, ctx.k, ctx.v, &keys, j0, cols, kvh, true);
        for &(r0, r, lo, hi) in &tiles[..n] {
            if kt < lo || kt >= hi {
                continue;
            }
            let st = Step {
                p,
                mask,
                slope,
                extras: ctx.extras.at(b, h),
                i0: r0,
                rows: r,
                ro: r0 - i0,
                j0,
                cols,
                u: 0,
            };
            sc.step(&st, false, true);
            add_dq(ctx, sc, &seq, h, r0, r);
        }
    }
}

#[cfg(test)]
mod tests {
    use candle::{Device, Tensor};

    use super::*;
    use crate::FlashAttn;

    /// Shapes `(sq, sk, d, heads, kv_heads)` and options both agreement tests run: masks,
    /// softcap, ALiBi, and a bias with a block mask.
    #[allow(clippy::type_complexity)]
    fn cases(dev: &Device) -> candle::Result<Vec<(usize, usize, usize, usize, usize, FlashAttn)>> {
        Ok(vec![
            (70, 150, 40, 6, 2, FlashAttn::new(0.2).causal()),
            // More key tiles than KSUB and query rows than QSUB tiles.
            (300, 600, 64, 4, 2, FlashAttn::new(0.125).causal()),
            (
                150,
                70,
                24,
                4,
                1,
                FlashAttn::new(0.3).window(Some(20), Some(3)).softcap(2.0),
            ),
            (
                65,
                130,
                80,
                2,
                2,
                FlashAttn::new(0.2).alibi(&Tensor::new(&[0.25f32, 0.0625], dev)?),
            ),
            (
                90,
                200,
                64,
                2,
                1,
                FlashAttn::new(0.125)
                    .causal()
                    .bias(&Tensor::randn(0f32, 1., (1, 2, 90, 200), dev)?)
                    .block_mask(&extras_blocks(dev)?, 32, 48),
            ),
        ])
    }

    /// A block mask of `(1, 1, 3, 5)` blocks with two hidden (for 32 x 48 blocks of 90 x 200).
    fn extras_blocks(dev: &Device) -> candle::Result<Tensor> {
        Tensor::from_vec(
            vec![1u8, 0, 1, 1, 1, 1, 1, 0, 1, 1, 1, 1, 1, 1, 1],
            (1, 1, 3, 5),
            dev,
        )
    }

    /// Every instruction set, fused and split schedules, give the same gradients (bitwise
    /// across schedules).
    #[test]
    fn schedules_and_isas_agree() -> candle::Result<()> {
        let dev = Device::Cpu;
        let cases = cases(&dev)?;
        for (sq, sk, d, h, hk, opts) in cases {
            let q = Tensor::randn(0f32, 1., (1, sq, h, d), &dev)?;
            let k = Tensor::randn(0f32, 1., (1, sk, hk, d), &dev)?;
            let v = Tensor::randn(0f32, 1., (1, sk, hk, d), &dev)?;
            let g = Tensor::randn(0f32, 1., (1, sq, h, d), &dev)?;
            let (o, lse) = opts.forward_with_lse(&q, &k, &v)?;
            let p = opts.problem(&q, &k, &v, None)?;
            let slopes = match &opts.alibi_slopes {
                Some(s) => Some(s.to_vec1::<f32>()?),
                None => None,
            };
            let flat = |t: &Tensor| t.flatten_all()?.to_vec1::<f32>();
            let (qv, kv, vv, ov, gv, lv) = (
                flat(&q)?,
                flat(&k)?,
                flat(&v)?,
                flat(&o)?,
                flat(&g)?,
                flat(&lse)?,
            );
            let extras = Extras::of(&p)?;
            let args = Args {
                p: &p,
                slopes: slopes.as_deref(),
                extras: &extras,
                q: &qv,
                k: &kv,
                v: &vv,
                out: &ov,
                go: &gv,
                lse: &lv,
                k_rows: sk,
            };
            let want = backward_with(Path::F32(Isa::Portable), false, &args);
            for isa in Isa::available() {
                for fused in [false, true] {
                    let got = backward_with(Path::F32(isa), fused, &args);
                    if isa == Isa::Portable {
                        assert!(got == want, "{isa:?} fused {fused}: not bitwise equal");
                    }
                    for (name, g, w) in [
                        ("dq", &got.0, &want.0),
                        ("dk", &got.1, &want.1),
                        ("dv", &got.2, &want.2),
                    ] {
                        let err = g
                            .iter()
                            .zip(w)
                            .map(|(a, b)| (a - b).abs())
                            .fold(0f32, |a, e| if e > a || e.is_nan() { e } else { a });
                        assert!(err <= 1e-4, "{isa:?} fused {fused} {name}: {err}");
                    }
                }
                let split = backward_with(Path::F32(isa), false, &args);
                let fused = backward_with(Path::F32(isa), true, &args);
                assert!(split == fused, "{isa:?}: split and fused schedules differ");
            }
        }
        Ok(())
    }

    /// The bf16 engines (AVX512-BF16 where the CPU has it, and the AMX tiling on the software
    /// tile model) agree with the f32 path on the same bf16 inputs within bf16 rounding, and
    /// their fused and split schedules bitwise.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn bf16_engines_agree_with_f32() -> candle::Result<()> {
        use super::super::bf16::amx::Soft;
        use candle::DType;
        use half::bf16;
        if !super::super::dispatch::avx512bf16() {
            eprintln!("NOT TESTED: this CPU has no AVX512-BF16; the bf16 engines need it");
            return Ok(());
        }
        let dev = Device::Cpu;
        let mut cases = cases(&dev)?;
        cases.push((37, 37, 129, 2, 1, FlashAttn::new(0.1)));
        for (sq, sk, d, h, hk, opts) in cases {
            let mk = |s, hh| Tensor::randn(0f32, 1., (1, s, hh, d), &dev)?.to_dtype(DType::BF16);
            let (q, k, v, g) = (mk(sq, h)?, mk(sk, hk)?, mk(sk, hk)?, mk(sq, h)?);
            let (o, lse) = opts.forward_with_lse(&q, &k, &v)?;
            let p = opts.problem(&q, &k, &v, None)?;
            let slopes = match &opts.alibi_slopes {
                Some(s) => Some(s.to_vec1::<f32>()?),
                None => None,
            };
            let b16 = |t: &Tensor| t.flatten_all()?.to_vec1::<bf16>();
            let f32s = |t: &Tensor| t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>();
            let lv = lse.flatten_all()?.to_vec1::<f32>()?;
            let (qb, kb, vb, ob, gb) = (b16(&q)?, b16(&k)?, b16(&v)?, b16(&o)?, b16(&g)?);
            let (qf, kf, vf, of, gf) = (f32s(&q)?, f32s(&k)?, f32s(&v)?, f32s(&o)?, f32s(&g)?);
            let extras = Extras::of(&p)?;
            macro_rules! args {
                ($q:expr, $k:expr, $v:expr, $o:expr, $g:expr) => {
                    Args {
                        p: &p,
                        slopes: slopes.as_deref(),
                        extras: &extras,
                        q: $q,
                        k: $k,
                        v: $v,
                        out: $o,
                        go: $g,
                        lse: &lv,
                        k_rows: sk,
                    }
                };
            }
            let a32 = args!(&qf, &kf, &vf, &of, &gf);
            let a16 = args!(&qb, &kb, &vb, &ob, &gb);
            let want = backward_with(Path::F32(Isa::detect()), false, &a32);
            let scale = [&want.0, &want.1, &want.2]
                .iter()
                .flat_map(|x| x.iter())
                .fold(0f32, |m, x| m.max(x.abs()));
            type Run = fn(bool, &Args<bf16>) -> (Vec<bf16>, Vec<bf16>, Vec<bf16>);
            let mut engines: Vec<(&str, Run)> = vec![
                ("avx512bf16", backward_bf16::<Avx512Bf16>),
                ("amx (software tiles)", backward_bf16::<AmxBf16<Soft>>),
            ];
            if super::super::dispatch::amx_usable() {
                engines.push(("amx", backward_bf16::<AmxBf16>));
            } else {
                use std::io::Write;
                let _ = writeln!(std::io::stderr(), "NOT TESTED on this machine: AMX tiles");
            }
            for (name, run) in engines {
                let split = run(false, &a16);
                let fused = run(true, &a16);
                assert!(split == fused, "{name}: split and fused schedules differ");
                for (part, g, w) in [
                    ("dq", &split.0, &want.0),
                    ("dk", &split.1, &want.1),
                    ("dv", &split.2, &want.2),
                ] {
                    let err = g
                        .iter()
                        .zip(w)
                        .map(|(a, b)| (a.to_f32() - b).abs())
                        .fold(0f32, |a, e| if e > a || e.is_nan() { e } else { a });
                    assert!(
                        err <= 1.6e-2 * scale,
                        "{name} ({sq}, {sk}, {d}) {part}: {err} (scale {scale})"
                    );
                }
            }
        }
        Ok(())
    }
}
