//! The bf16 prefill: the work items, tile grid and online softmax of the f32 prefill
//! ([`super::super::prefill`]), with K and V kept in bf16 and both products on an [`Engine`].
//!
//! Per query sub-tile of 64 rows: `Qᵀ` in pair rows (`qtp[t]` lane `r` = `Q[r][2t], Q[r][2t+1]`,
//! unscaled, as stored) and `Oᵀ` in f32 lanes. Per key tile of [`BK`] keys: K row-major bf16 and
//! `Vᵀ` (head dims × keys) bf16, both zero-padded to the engine's alignment. Then per sub-tile:
//!
//! 1. `Sᵀ = K Qᵀ · scale` (one `mm`: rows are keys, the reduction runs over head-dim pairs);
//! 2. the masks and score modifiers of the f32 path on `Sᵀ`, then the online softmax in
//!    AVX-512 ([`super::online_pairs`]), which rounds `Pᵀ` to bf16 pairs of keys as it goes and
//!    moves a row's max only when it jumps by more than 2^8, so `Oᵀ` is rarely rescaled;
//! 3. `Oᵀ = Oᵀ · corr + Vᵀ Pᵀ` (one `mm`: rows are head dims, the reduction runs over key
//!    pairs). The row sums of the softmax use the unrounded `P`, as the GPU kernels do.
//!
//! A sub-tile's keys are widened to the engine's alignment (2 keys for `VDPBF16PS`, 32 for AMX)
//! on the tile grid; the extra keys are masked like any key its rows do not see.

use half::bf16;
use rayon::prelude::*;

use super::super::extras::Extras;
use super::super::kernel::Avx512;
use super::super::prefill::{mask_scores, masked_pv, tile_parts, ItemCtx};
use super::super::{Lanes, SyncPtr, BR};
use super::{
    load_keys, load_rows, online_pairs, pad, rows_to_lanes, transpose_rows, Acc, AmxBf16,
    Avx512Bf16, Engine, Pairs,
};
use crate::problem::Problem;
use crate::semantics::{kv_head, LOG2_E};

/// Keys per tile: twice the f32 prefill's, so that each pass of `Oᵀ` through the tile unit
/// (loaded, 4 products per 16 × 16 block, stored) adds 128 keys: with 64 the loads and stores of
/// `Oᵀ` took longer than its products on AMX. A multiple of 32 (AMX's reduction per product).
const BK: usize = 128;

/// Most BR-row sub-tiles per work item: twice the f32 prefill's. Each K/V tile copy waits on
/// memory (rows of one head are `heads · d` values apart) for as long as the products of a
/// sub-tile or two take on a bf16 engine, so the copy is shared by more sub-tiles; the scratch
/// stays within L2 (about 300 KiB at head dim 128).
const QSUB: usize = 8;

/// Everything a work item reads, shared by all of them.
struct Ctx<'a> {
    p: &'a Problem,
    slopes: Option<&'a [f32]>,
    q: &'a [bf16],
    k: &'a [bf16],
    v: &'a [bf16],
    out: SyncPtr<bf16>,
    lse: SyncPtr<f32>,
    /// Sub-tiles per work item (`1..=QSUB`).
    qsub: usize,
    extras: &'a Extras<'a>,
}

/// Runs the whole problem on `engine` (the caller checked that the CPU has it); returns the
/// contiguous output and the log-sum-exp.
pub(in super::super) fn forward(
    engine: super::super::dispatch::Engine,
    p: &Problem,
    slopes: Option<&[f32]>,
    q: &[bf16],
    k: &[bf16],
    v: &[bf16],
    extras: &Extras,
) -> (Vec<bf16>, Vec<f32>) {
    use super::super::dispatch::Engine as E;
    match engine {
        E::Amx => run::<AmxBf16>(p, slopes, q, k, v, extras),
        E::Avx512Bf16 => run::<Avx512Bf16>(p, slopes, q, k, v, extras),
    }
}

/// [`forward`] on engine `E`.
pub(super) fn run<E: Engine>(
    p: &Problem,
    slopes: Option<&[f32]>,
    q: &[bf16],
    k: &[bf16],
    v: &[bf16],
    extras: &Extras,
) -> (Vec<bf16>, Vec<f32>) {
    let d = p.head_dim;
    let mut out = vec![bf16::ZERO; p.total_q * p.heads * d];
    let mut lse = vec![f32::NEG_INFINITY; p.total_q * p.heads];
    // The item sizes and order of the f32 prefill (see there).
    let rows_total: usize = (0..p.batch).map(|b| p.seq(b).seq_q).sum::<usize>() * p.heads;
    let want = 4 * rayon::current_num_threads();
    let qsub = [QSUB, 4, 2, 1]
        .into_iter()
        .find(|&n| rows_total.div_ceil(BR * n) >= want)
        .unwrap_or(1);
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
    items.into_par_iter().with_max_len(1).for_each(|item| {
        with_scratch::<E>(d, |sc| {
            // SAFETY: the dispatcher chose a bf16 engine only after detecting avx512f/bw/vl,
            // avx512bf16, avx2 and fma (and for AMX, the tile unit and its permission).
            unsafe { item_bf16::<E>(&ctx, sc, item) }
        })
    });
    (out, lse)
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma")]
fn item_bf16<E: Engine>(ctx: &Ctx, sc: &mut Scratch, item: (usize, usize, usize)) {
    E::begin();
    run_item::<E>(ctx, sc, item);
    E::end();
}

/// The running state of one BR-row query sub-tile.
struct Sub {
    /// `Qᵀ` in pair rows (`dk / 2` of them), unscaled.
    qtp: Vec<Pairs>,
    /// `Oᵀ`, unnormalised: `dm` rows of lanes (rows past `d` stay 0).
    ot: Vec<Lanes>,
    m: Lanes,
    l: Lanes,
}

/// Per-thread buffers of the bf16 prefill, reused across work items.
struct Scratch {
    /// Head dim, its padding for the reduction of `Q Kᵀ` (`dk`) and for the rows of `Oᵀ`
    /// (`dm`), and the engine's key alignment.
    d: usize,
    dk: usize,
    dm: usize,
    align: usize,
    sub: Vec<Sub>,
    /// `Sᵀ`, then `Pᵀ` in place: `BK` rows of lanes.
    s: Vec<Lanes>,
    /// `Pᵀ` in bf16 pairs of keys: `BK / 2` rows.
    pt: Vec<Pairs>,
    /// The K tile, row-major `BK × dk` (padding 0).
    k: Vec<u16>,
    /// The V tile row-major (`BK × d`) on its way into `vt`.
    vrow: Vec<u16>,
    /// `Vᵀ`: `dm` rows of `BK` keys (padding 0).
    vt: Vec<u16>,
    /// The V tile in f32 for the rare masked product with a non-finite V.
    v32: Vec<f32>,
    /// The query rows of one sub-tile, row-major `BR × dk` (padding 0).
    qrows: Vec<u16>,
}

impl Scratch {
    fn new<E: Engine>(d: usize) -> Self {
        let dk = pad(d, E::K_ALIGN);
        let dm = pad(d, E::M_ALIGN);
        Self {
            d,
            dk,
            dm,
            align: E::K_ALIGN,
            sub: (0..QSUB)
                .map(|_| Sub {
                    qtp: vec![Pairs::ZERO; dk / 2],
                    ot: vec![Lanes::splat(0.0); dm],
                    m: Lanes::splat(f32::NEG_INFINITY),
                    l: Lanes::splat(0.0),
                })
                .collect(),
            s: vec![Lanes::splat(0.0); BK],
            pt: vec![Pairs::ZERO; BK / 2],
            k: vec![0; BK * dk],
            vrow: vec![0; BK * d],
            vt: vec![0; dm * BK],
            v32: vec![0.0; BK * d],
            qrows: vec![0; BR * dk],
        }
    }
}

thread_local! {
    /// Each thread's scratch, kept between work items and calls.
    static SCRATCH: std::cell::RefCell<Option<Scratch>> = const { std::cell::RefCell::new(None) };
}

/// Runs `f` with this thread's scratch, (re)built when the head dim or the engine's padding
/// changed.
fn with_scratch<E: Engine>(d: usize, f: impl FnOnce(&mut Scratch)) {
    let fits = |s: &Scratch| s.d == d && s.align == E::K_ALIGN && s.dm == pad(d, E::M_ALIGN);
    SCRATCH.with(|cell| match cell.try_borrow_mut() {
        Ok(mut slot) => {
            if !matches!(&*slot, Some(s) if fits(s)) {
                *slot = Some(Scratch::new::<E>(d));
            }
            if let Some(s) = slot.as_mut() {
                f(s);
            }
        }
        Err(_) => f(&mut Scratch::new::<E>(d)),
    })
}

/// One work item: query rows `t · BR · qsub ..` of head `h` in sequence `b`.
#[inline(always)]
fn run_item<E: Engine>(ctx: &Ctx, sc: &mut Scratch, (b, h, t): (usize, usize, usize)) {
    let p = ctx.p;
    let (d, dk, dm) = (sc.d, sc.dk, sc.dm);
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
    let q_scale = if softcap {
        p.score.scale
    } else {
        p.score.scale * LOG2_E
    };
    // The scale goes into the softmax's first read of the scores where masking (to -inf)
    // commutes with it; the softcap, ALiBi and an additive bias need the scaled scores.
    let fold = q_scale > 0.0 && !softcap && it.slope == 0.0 && !ctx.extras.is_some();
    let (mm_scale, sm_scale) = if fold { (1.0, q_scale) } else { (q_scale, 1.0) };

    let mut sub_rows = [(0usize, 0usize); QSUB];
    let mut sub_keys = [(0usize, 0usize); QSUB];
    for u in 0..nsub {
        let r0 = i0 + u * BR;
        let n = BR.min(i0 + rows - r0);
        sub_rows[u] = (r0, n);
        sub_keys[u] = mask.key_range_rows(r0..r0 + n);
        let st = &mut sc.sub[u];
        // Lanes past the last row are 0, which keeps their (unused) scores finite.
        load_rows(&mut sc.qrows, dk, ctx.q, &p.q, b, seq.q_row + r0, n, h, d);
        rows_to_lanes(&mut st.qtp, &sc.qrows, dk, n);
        st.ot.iter_mut().for_each(|x| *x = Lanes::splat(0.0));
        st.m = Lanes::splat(f32::NEG_INFINITY);
        st.l = Lanes::splat(0.0);
    }

    // Key tiles on the BK grid, as in the f32 prefill, so the bits do not depend on how the
    // sub-tiles are grouped into items.
    let (lo, hi) = mask.key_range_rows(i0..i0 + rows);
    let mut j0 = lo - lo % BK;
    while j0 < hi {
        let cols = BK.min(hi - j0);
        // As in the f32 prefill: a tile no sub-tile sees is neither read nor computed.
        let part: [_; QSUB] = tile_parts(&it, &sub_rows[..nsub], &sub_keys[..nsub], j0, cols);
        if part.iter().all(Option::is_none) {
            j0 += cols;
            continue;
        }
        let colsp = pad(cols, E::K_ALIGN);
        load_keys(&mut sc.k, dk, ctx.k, &p.k, &keys, j0, cols, kvh, d);
        sc.k[cols * dk..colsp * dk].fill(0);
        load_keys(&mut sc.vrow, d, ctx.v, &p.v, &keys, j0, cols, kvh, d);
        let v_finite = super::all_finite(&sc.vrow[..cols * d]);
        // Vᵀ; keys past `cols` are 0 up to the next multiple of 32 (>= colsp).
        transpose_rows(&mut sc.vt, BK, &sc.vrow, d, cols, d);
        for u in 0..nsub {
            // The sub-tile's part of this key tile, widened to the engine's alignment.
            let Some((c0, c1)) = part[u] else {
                continue;
            };
            let a0 = c0 - (c0 - j0) % E::K_ALIGN;
            let a1 = j0 + pad(c1 - j0, E::K_ALIGN);
            let n = a1 - a0;
            let (r0, nrows) = sub_rows[u];
            let st = &mut sc.sub[u];
            let s = &mut sc.s[..n];
            it.extras
                .prefetch(r0, nrows, a0, n.min(sk.saturating_sub(a0)));
            E::mm(
                s,
                Acc::Zero,
                mm_scale,
                &sc.k[(a0 - j0) * dk..],
                dk,
                &st.qtp,
                dk,
            );
            let bounds = mask_scores(&it, s, r0, nrows, a0, a1 > j0 + cols);
            // A masked key has P = 0, but 0 · NaN = NaN: with a non-finite V in a cut tile, the
            // per-row product of the f32 path (on the unrounded P, kept for it).
            let per_row = bounds.is_some() && !v_finite;
            let pt = &mut sc.pt[..n / 2];
            let (corr, rescale) = online_pairs(&mut st.m, &mut st.l, s, pt, per_row, sm_scale);
            let vt = &sc.vt[a0 - j0..];
            match bounds {
                Some((lo, hi)) if per_row => {
                    for c in 0..n {
                        for x in 0..d {
                            sc.v32[c * d + x] = super::to_f32(vt[x * BK + c]);
                        }
                    }
                    let v32 = &sc.v32[..n * d];
                    masked_pv::<Avx512>(&mut st.ot, &corr, v32, s, d, nrows, a0, (&lo, &hi));
                }
                _ => {
                    let init = if rescale {
                        Acc::Scale(&corr)
                    } else {
                        Acc::Keep
                    };
                    E::mm(&mut st.ot[..dm], init, 1.0, vt, BK, &sc.pt, n)
                }
            }
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
            for (x, ot) in st.ot[..d].iter().enumerate() {
                let o = if l == 0.0 { 0.0 } else { ot.0[r] * inv };
                // SAFETY: element (row, h, x) belongs to this work item alone and is in bounds
                // of the output allocated by `run` (total_q * heads * d elements).
                unsafe { *ctx.out.0.add(base + x) = bf16::from_f32(o) };
            }
            // SAFETY: as above, for the row's log-sum-exp.
            unsafe { *ctx.lse.0.add(seq.lse_base + h * lse_h + i) = row_lse };
        }
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use candle::{DType, Device, Tensor};

    use super::super::amx::Soft;
    use super::*;
    use crate::{naive_attention, FlashAttn};

    /// The AVX512-BF16 engine (where the CPU has it) and the AMX tiling on the software tile
    /// model agree with the naive attention on the same bf16 inputs within bf16 rounding.
    #[test]
    fn engines_match_naive() -> candle::Result<()> {
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
                37,
                2,
                2,
                FlashAttn::new(0.2).alibi(&Tensor::new(&[0.25f32, 0.0625], &dev)?),
            ),
        ];
        for (sq, sk, d, h, hk, opts) in cases {
            let mk = |s, hh| Tensor::randn(0f32, 1., (1, s, hh, d), &dev)?.to_dtype(DType::BF16);
            let (q, k, v) = (mk(sq, h)?, mk(sk, hk)?, mk(sk, hk)?);
            let f32s = |t: &Tensor| t.to_dtype(DType::F32);
            let want = naive_attention(&f32s(&q)?, &f32s(&k)?, &f32s(&v)?, &opts)?
                .flatten_all()?
                .to_vec1::<f32>()?;
            let p = opts.problem(&q, &k, &v, None)?;
            let slopes = match &opts.alibi_slopes {
                Some(s) => Some(s.to_vec1::<f32>()?),
                None => None,
            };
            let flat = |t: &Tensor| t.flatten_all()?.to_vec1::<bf16>();
            let none = crate::cpu::extras::Extras::default();
            let (qv, kv, vv) = (flat(&q)?, flat(&k)?, flat(&v)?);
            let mut runs: Vec<(&str, Vec<bf16>)> = vec![];
            if super::super::super::dispatch::avx512bf16() {
                let (o, _) = run::<Avx512Bf16>(&p, slopes.as_deref(), &qv, &kv, &vv, &none);
                runs.push(("avx512bf16", o));
                let (o, _) = run::<AmxBf16<Soft>>(&p, slopes.as_deref(), &qv, &kv, &vv, &none);
                runs.push(("amx (software tiles)", o));
                if super::super::super::dispatch::amx_usable() {
                    let (o, _) = run::<AmxBf16>(&p, slopes.as_deref(), &qv, &kv, &vv, &none);
                    runs.push(("amx", o));
                } else {
                    let _ = writeln!(std::io::stderr(), "NOT TESTED on this machine: AMX tiles");
                }
            } else {
                eprintln!("NOT TESTED: this CPU has no AVX512-BF16; the bf16 engines need it");
            }
            for (name, got) in runs {
                let err = got
                    .iter()
                    .zip(&want)
                    .map(|(g, w)| (g.to_f32() - w).abs())
                    .fold(0f32, |a, e| if e > a || e.is_nan() { e } else { a });
                assert!(err <= 2e-2, "{name} ({sq}, {sk}, {d}): max error {err}");
            }
        }
        Ok(())
    }
}
