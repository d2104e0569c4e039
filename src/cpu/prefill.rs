//! The prefill driver: work items of `(batch, head, block of query rows)` over rayon, and the
//! per-tile update of one query sub-tile (scores, mask, online softmax, `P V`).

use rayon::prelude::*;

use super::elem::{load_keys, load_rows, Elem};
use super::exp2::exp2;
use super::extras::{Extras, ExtrasAt};
#[cfg(target_arch = "x86_64")]
use super::kernel::{Avx512, Fused};
use super::kernel::{Isa, Kernel, Portable};
use super::scratch::{with_scratch, Scratch, SubTile};
use super::{Lanes, SyncPtr, BC, BR, QSUB};
use crate::problem::Problem;
use crate::semantics::{alibi_bias, kv_head, SeqMask, LOG2_E};

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
    extras: &'a Extras<'a>,
}

/// Runs the whole problem with the f32 micro-kernels of the CPU; returns the contiguous output
/// and the log-sum-exp.
#[cfg_attr(not(test), allow(dead_code))]
pub(crate) fn forward<T: Elem>(
    p: &Problem,
    slopes: Option<&[f32]>,
    q: &[T],
    k: &[T],
    v: &[T],
) -> (Vec<T>, Vec<f32>) {
    forward_with(Isa::detect(), p, slopes, q, k, v, &Extras::default())
}

/// Runs the whole problem with the micro-kernels of `isa` (the caller checked that the CPU has
/// it); returns the contiguous output and the log-sum-exp.
pub(super) fn forward_with<T: Elem>(
    isa: Isa,
    p: &Problem,
    slopes: Option<&[f32]>,
    q: &[T],
    k: &[T],
    v: &[T],
    extras: &Extras,
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
        extras,
    };
    // One item per rayon job, so idle threads can steal any single item.
    items.into_par_iter().with_max_len(1).for_each(|item| {
        with_scratch(d, |scratch| match isa {
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

/// What every sub-tile update of one work item shares.
pub(super) struct ItemCtx<'a> {
    pub p: &'a Problem,
    pub mask: SeqMask<'a>,
    pub d: usize,
    pub sq: usize,
    pub sk: usize,
    pub slope: f32,
    pub softcap: bool,
    /// The bias and block mask of this `(batch, head)`, if the call has them.
    pub extras: ExtrasAt<'a>,
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
    let mask = p.mask(b, &seq);
    let keys = p.key_rows(b, &seq);
    let it = ItemCtx {
        p,
        mask,
        d,
        sq,
        sk,
        slope: ctx.slopes.map_or(0.0, |s| s[b * p.alibi_batch_stride + h]),
        softcap,
        extras: ctx.extras.at(b, h),
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
        sub_keys[u] = mask.key_range_rows(r0..r0 + n);
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

    // Key tiles outside the union of the rows' ranges are skipped by these bounds. The tiles
    // start on the BC grid, not at `lo`: a sub-tile's keys then split into the same tiles
    // whichever item holds it (the item size follows the thread count), so the online softmax
    // rounds the same way and the output bits do not depend on the thread count.
    let (lo, hi) = mask.key_range_rows(i0..i0 + rows);
    let mut j0 = lo - lo % BC;
    while j0 < hi {
        let cols = BC.min(hi - j0);
        // A tile no sub-tile sees is neither read nor computed.
        let part: [_; QSUB] = tile_parts(&it, &sub_rows[..nsub], &sub_keys[..nsub], j0, cols);
        if part.iter().all(Option::is_none) {
            j0 += cols;
            continue;
        }
        load_keys(&mut sc.k, ctx.k, &p.k, &keys, j0, cols, kvh, d);
        load_keys(&mut sc.v, ctx.v, &p.v, &keys, j0, cols, kvh, d);
        for u in 0..nsub {
            let Some((c0, c1)) = part[u] else {
                continue;
            };
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

/// The part `(c0, c1)` of key tile `j0 .. j0 + cols` that each sub-tile (rows `sub_rows`, keys
/// under the mask `sub_keys`) sees: under a causal mask the first sub-tile sees fewer keys than
/// the last. `None` where it sees no key of the tile or the block mask hides all of them.
pub(super) fn tile_parts<const N: usize>(
    it: &ItemCtx,
    sub_rows: &[(usize, usize)],
    sub_keys: &[(usize, usize)],
    j0: usize,
    cols: usize,
) -> [Option<(usize, usize)>; N] {
    let mut part = [None; N];
    for ((part, &(r0, n)), &(lo, hi)) in part.iter_mut().zip(sub_rows).zip(sub_keys) {
        let (c0, c1) = (lo.max(j0), hi.min(j0 + cols));
        if c0 < c1 && !it.extras.hides(r0..r0 + n, c0..c1) {
            *part = Some((c0, c1));
        }
    }
    part
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
    let d = it.d;
    it.extras.prefetch(r0, rows, j0, cols);
    // Sᵀ = K Qᵀ, ROWS keys per micro-kernel call.
    let mut c = 0;
    while c < cols {
        let n = K::ROWS.min(cols - c);
        K::block(&mut s[c..c + n], None, &kt[c * d..], d, 1, &st.qt, d);
        c += n;
    }
    let s = &mut s[..cols];
    let (corr, bounds) = softmax::<K>(it, &mut st.m, &mut st.l, s, r0, rows, j0, false);

    // Oᵀ = Oᵀ · corr + Vᵀ Pᵀ, ROWS head dims per micro-kernel call. A masked key has P = 0,
    // but 0 · NaN = NaN: a NaN or infinity in the V of a key that some rows do not see would
    // reach those rows, so such tiles take the per-row loop.
    match bounds {
        Some((lo, hi)) if !vt[..cols * d].iter().all(|x| x.is_finite()) => {
            masked_pv::<K>(&mut st.ot, &corr, vt, s, d, rows, j0, (&lo, &hi));
        }
        _ => {
            let mut x = 0;
            while x < d {
                let n = K::ROWS.min(d - x);
                K::block(&mut st.ot[x..x + n], Some(&corr), &vt[x..], 1, d, s, cols);
                x += n;
            }
        }
    }
}

/// Per-lane key bounds of a tile the mask cuts: lane `r` sees keys `lo[r] <= j < hi[r]`.
pub(super) type Bounds = ([usize; BR], [usize; BR]);

/// The scores `s` of keys `j0 ..` for the query rows `r0 .. r0 + rows` (see [`softmax`]) in
/// base 2 with the softcap and ALiBi applied and masked keys at `-inf`. Returns, for a tile that
/// the mask cuts (or with `cut`: keys past the real ones to mask), the per-lane key bounds.
#[inline(always)]
pub(super) fn mask_scores(
    it: &ItemCtx,
    s: &mut [Lanes],
    r0: usize,
    rows: usize,
    j0: usize,
    cut: bool,
) -> Option<Bounds> {
    let (p, sq, sk, slope) = (it.p, it.sq, it.sk, it.slope);
    let cols = s.len();
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
    // The additive bias after softcap and ALiBi, then the hidden blocks (keys past the last,
    // which a padded tile may hold, are masked below).
    let real = cols.min(sk.saturating_sub(j0));
    it.extras.apply(&mut s[..real], r0, rows, j0);
    // Only tiles the band cuts through need a per-element mask.
    (cut || !it.mask.covers(r0..r0 + rows, j0..j0 + cols)).then(|| {
        // Per-lane bounds (each row sees one interval, prefix ranges or not), then one
        // lane-wise compare per key: the loop over lanes vectorises, where a loop over keys per
        // row was a scalar store per score.
        let mut lo = [0usize; BR];
        let mut hi = [usize::MAX; BR];
        for (r, (lo, hi)) in lo.iter_mut().zip(hi.iter_mut()).take(rows).enumerate() {
            (*lo, *hi) = it.mask.row_range(r0 + r);
        }
        for (c, s) in s.iter_mut().enumerate() {
            let j = j0 + c;
            for ((x, &lo), &hi) in s.0.iter_mut().zip(&lo).zip(&hi) {
                if j < lo || j >= hi {
                    *x = f32::NEG_INFINITY;
                }
            }
        }
        (lo, hi)
    })
}

/// The online softmax of one tile: the scores `s` of keys `j0 ..` (one `Lanes` per key) for
/// the query rows `r0 .. r0 + rows` (pre-scaled by `scale · log2 e`, or by `scale` alone under a
/// softcap) become the probabilities `P` in place; the running max `m` and sum `l` are updated.
/// Returns the correction `O` needs, and for a tile that the mask cuts (or with `cut`: keys
/// past the real ones to mask) the per-lane key bounds.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(super) fn softmax<K: Kernel>(
    it: &ItemCtx,
    m: &mut Lanes,
    l: &mut Lanes,
    s: &mut [Lanes],
    r0: usize,
    rows: usize,
    j0: usize,
    cut: bool,
) -> (Lanes, Option<Bounds>) {
    let bounds = mask_scores(it, s, r0, rows, j0, cut);
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
        m.0.iter_mut()
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
    for ((l, &c), &s) in l.0.iter_mut().zip(&corr.0).zip(&row_sum.0) {
        *l = K::fma(*l, c, s);
    }
    (corr, bounds)
}

/// `Oᵀ = Oᵀ · corr + Vᵀ Pᵀ` over the keys `j0 ..` that each of the first `rows` lanes sees
/// (`lo[r] <= j < hi[r]`), one lane at a time: a tile's V rows are `d` apart in `vt`, its
/// probabilities one `Lanes` per key in `p`. Slow, and only for cut tiles whose V holds a
/// non-finite value.
#[allow(clippy::too_many_arguments)]
pub(super) fn masked_pv<K: Kernel>(
    ot: &mut [Lanes],
    corr: &Lanes,
    vt: &[f32],
    p: &[Lanes],
    d: usize,
    rows: usize,
    j0: usize,
    (lo, hi): (&[usize; BR], &[usize; BR]),
) {
    for (x, o) in ot[..d].iter_mut().enumerate() {
        for r in 0..rows {
            let mut acc = o.0[r] * corr.0[r];
            for (c, pc) in p.iter().enumerate() {
                if (lo[r]..hi[r]).contains(&(j0 + c)) {
                    acc = K::fma(pc.0[r], vt[c * d + x], acc);
                }
            }
            o.0[r] = acc;
        }
    }
}

#[cfg(test)]
mod tests {
    use candle::{Device, Tensor};

    use super::*;
    use crate::{naive_attention, FlashAttn};

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
            for isa in Isa::available() {
                let (got, _) = forward_with(
                    isa,
                    &p,
                    slopes.as_deref(),
                    &qv,
                    &kv,
                    &vv,
                    &Extras::default(),
                );
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
