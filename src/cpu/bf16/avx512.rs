//! AVX512-BF16 code of the bf16 paths: the `VDPBF16PS` micro-kernel of the pair product, the
//! rounding of f32 lanes into bf16 pairs, and the lane-wise scaling AMX leaves to the vector unit.

use std::arch::x86_64::*;

use super::super::{Lanes, BR};
use super::{Acc, Pairs};

/// 16-lane vectors per tile row.
const V: usize = BR / 16;

/// `out[i] = init(out[i]) + Σ_{t<n} (a[i · a_is + 2t], a[i · a_is + 2t + 1]) ⊙ b[t]`, for
/// `i < R`, times `scale`, where `x ⊙ y` multiplies a pair of bf16 with the pair in every lane
/// of `y` and adds both products (`VDPBF16PS`), accumulating in f32. Register-blocked like the f32 micro-kernel: `R`
/// rows × 4 vectors of accumulators; per step `t` the 4 vectors of `b[t]` are loaded once and
/// one pair of `a` is broadcast per row.
///
/// # Safety
/// avx512f and avx512bf16 must be available, `out.len() == R`, `b.len() >= n`, and
/// `(R - 1) * a_is + 2 n <= a.len()` when `n > 0`.
#[target_feature(enable = "avx512f,avx512bf16")]
pub(super) unsafe fn block<const R: usize>(
    out: &mut [Lanes],
    init: Acc,
    scale: f32,
    a: &[u16],
    a_is: usize,
    b: &[Pairs],
    n: usize,
) {
    let mut acc = [[_mm512_setzero_ps(); V]; R];
    match init {
        Acc::Zero => {}
        Acc::Keep | Acc::Scale(_) => {
            for (i, acc) in acc.iter_mut().enumerate() {
                for (v, acc) in acc.iter_mut().enumerate() {
                    // SAFETY: `Lanes` holds BR = 16 V floats, aligned to 64 bytes.
                    unsafe {
                        let o = _mm512_load_ps(out[i].0.as_ptr().add(16 * v));
                        *acc = match init {
                            Acc::Scale(c) => {
                                _mm512_mul_ps(o, _mm512_load_ps(c.0.as_ptr().add(16 * v)))
                            }
                            _ => o,
                        };
                    }
                }
            }
        }
    }
    let a = a.as_ptr();
    for (t, bt) in b[..n].iter().enumerate() {
        let bt = bt.0.as_ptr();
        // SAFETY: `Pairs` holds BR = 16 V u32, aligned to 64 bytes; a vector of bf16 pairs is
        // the same 64 bytes as a vector of u32.
        let bv: [__m512bh; V] = std::array::from_fn(|v| unsafe {
            std::mem::transmute::<__m512i, __m512bh>(_mm512_load_si512(bt.add(16 * v).cast()))
        });
        for (i, acc) in acc.iter_mut().enumerate() {
            // SAFETY: `i * a_is + 2t + 1 <= (R - 1) * a_is + 2n - 1 < a.len()`; a pair of u16
            // read as one (unaligned) u32, the first in the low half.
            let s = unsafe { a.add(i * a_is + 2 * t).cast::<u32>().read_unaligned() };
            // SAFETY: as above, a broadcast pair is 64 bytes of bf16 pairs.
            let s: __m512bh = unsafe { std::mem::transmute(_mm512_set1_epi32(s as i32)) };
            for (acc, &bv) in acc.iter_mut().zip(&bv) {
                *acc = _mm512_dpbf16_ps(*acc, s, bv);
            }
        }
    }
    let sc = _mm512_set1_ps(scale);
    for (o, acc) in out.iter_mut().zip(&acc) {
        for (v, &acc) in acc.iter().enumerate() {
            let acc = if scale == 1.0 {
                acc
            } else {
                _mm512_mul_ps(acc, sc)
            };
            // SAFETY: as above, for the output row.
            unsafe { _mm512_store_ps(o.0.as_mut_ptr().add(16 * v), acc) };
        }
    }
}

/// Word indices that interleave two halves of 16 bf16 each: word `2i` from the low half's `i`,
/// word `2i + 1` from the high half's `i`.
const INTERLEAVE: [u16; 32] = {
    let mut w = [0u16; 32];
    let mut i = 0;
    while i < 16 {
        w[2 * i] = i as u16;
        w[2 * i + 1] = 16 + i as u16;
        i += 1;
    }
    w
};

/// `dst[i]` = the pairs `(bf16(src[2i]), bf16(src[2i + 1]))` lane by lane, rounded to nearest
/// even (`VCVTNE2PS2BF16`, then one word permutation), for `i < dst.len()`; rows of `src` at or
/// past `n` count as 0.
///
/// # Safety
/// avx512f, avx512bw and avx512bf16 must be available.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
pub(super) unsafe fn pack_pairs(dst: &mut [Pairs], src: &[Lanes], n: usize) {
    // SAFETY: 32 u16 are 64 bytes.
    let idx = unsafe { _mm512_loadu_si512(INTERLEAVE.as_ptr().cast()) };
    let zero = Lanes::splat(0.0);
    let n = n.min(src.len());
    for (i, d) in dst.iter_mut().enumerate() {
        let lo = if 2 * i < n { &src[2 * i] } else { &zero };
        let hi = if 2 * i + 1 < n {
            &src[2 * i + 1]
        } else {
            &zero
        };
        for v in 0..V {
            // SAFETY: `Lanes` and `Pairs` hold BR = 16 V elements of 4 bytes, aligned to 64.
            unsafe {
                let l = _mm512_load_ps(lo.0.as_ptr().add(16 * v));
                let h = _mm512_load_ps(hi.0.as_ptr().add(16 * v));
                // Words 0..16: bf16(l), words 16..32: bf16(h).
                let both: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(h, l));
                let pairs = _mm512_permutexvar_epi16(idx, both);
                _mm512_store_si512(d.0.as_mut_ptr().add(16 * v).cast(), pairs);
            }
        }
    }
}

/// `dst[c] = bf16(src[c])` for the first `dst.len() <= BR` lanes (round to nearest even).
///
/// # Safety
/// avx512f, avx512bw and avx512bf16 must be available.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
pub(super) unsafe fn round_row(dst: &mut [u16], src: &Lanes) {
    let n = dst.len().min(BR);
    let mut out = [0u16; BR];
    for v in 0..V {
        // SAFETY: `Lanes` holds BR = 16 V floats aligned to 64; `out` holds BR u16.
        unsafe {
            let x = _mm512_load_ps(src.0.as_ptr().add(16 * v));
            let b: __m256i = std::mem::transmute(_mm512_cvtneps_pbh(x));
            _mm256_storeu_si256(out.as_mut_ptr().add(16 * v).cast(), b);
        }
    }
    dst[..n].copy_from_slice(&out[..n]);
}

/// `rows[i] *= c`, lane-wise.
///
/// # Safety
/// avx512f must be available.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn scale_rows(rows: &mut [Lanes], c: &Lanes) {
    for r in rows {
        for v in 0..V {
            // SAFETY: `Lanes` holds BR = 16 V floats aligned to 64.
            unsafe {
                let p = r.0.as_mut_ptr().add(16 * v);
                let x = _mm512_mul_ps(_mm512_load_ps(p), _mm512_load_ps(c.0.as_ptr().add(16 * v)));
                _mm512_store_ps(p, x);
            }
        }
    }
}

/// `2^x` on 16 lanes for the bf16 paths' softmax: `x = n + f` with `n` the nearest integer and
/// `|f| <= 1/2`, `2^f` by a degree-4 polynomial with constant term 1 (so `2^0` is exactly 1,
/// which the lazy rescaling relies on; the rest a least-squares fit at 400 Chebyshev nodes of
/// `[-1/2, 1/2]`, relative error below 3.2e-6 evaluated in f32: far below the 2^-9 of the bf16
/// rounding every `P` gets, and one FMA fewer than the f32 path's), times `2^n` by
/// `VSCALEFPS`. Below -160 the result is exactly 0 (so `-inf` maps to 0, which masking relies
/// on); NaN stays NaN. Callers pass `x <= 0` (scores minus their running max).
#[inline]
#[target_feature(enable = "avx512f")]
fn exp2(x: __m512) -> __m512 {
    const C: [f32; 5] = [1.0, 0.693_122, 0.240_237_19, 0.055_916_894, 0.009_600_395];
    // `vmaxps` returns its second operand when one is NaN: the NaN.
    let x = _mm512_max_ps(_mm512_set1_ps(-160.0), x);
    let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(x);
    let f = _mm512_sub_ps(x, n);
    let mut p = _mm512_set1_ps(C[4]);
    for &c in C[..4].iter().rev() {
        p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c));
    }
    _mm512_scalef_ps(p, n)
}

/// How far (in base 2) a lane's running max may lag behind its scores before the lane is
/// rescaled: `P` may reach `2^8`, far from f32 overflow in `l` and `O` for any sequence, and
/// bf16 rounds it with the same relative error at any size. Rescaling only on such jumps makes
/// the correction exactly 1 after the first tiles of nearly every row, so the rescaling pass
/// over `Oᵀ` is skipped (it costs as much as a tile product on AMX).
const LAG: f32 = 8.0;

/// The online softmax update of the bf16 forward, on masked scores in base 2 (`s`, one row of
/// lanes per key; multiplied by `scale > 0` first): `m` moves to `rowmax(s)` where that exceeds it by
/// more than [`LAG`] (a NaN score is skipped here and propagates through its `P`),
/// `P = 2^(s - m)` (0 for lanes that have seen only masked keys), `l = l · corr + rowsum(P)` with
/// `corr = 2^(m_old - m)`. `P` goes to `pt` rounded to bf16 pairs of keys
/// (`pt.len() = ⌈s.len() / 2⌉`), and with `keep` also back to `s` in f32. Returns `corr` and
/// whether `O` needs it: not when every lane's `corr` is 1 or its `O` is still 0 (no finite
/// max yet).
///
/// # Safety
/// avx512f, avx512bw and avx512bf16 must be available.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
pub(super) unsafe fn online_pairs(
    m: &mut Lanes,
    l: &mut Lanes,
    s: &mut [Lanes],
    pt: &mut [Pairs],
    keep: bool,
    scale: f32,
) -> (Lanes, bool) {
    let n = s.len();
    let sc = _mm512_set1_ps(scale);
    // SAFETY (every load and store of a row below): `Lanes` and `Pairs` hold BR = 16 V
    // elements of 4 bytes, aligned to 64; rows are indexed below `n` and `pt.len()`.
    let ld = |r: &Lanes, v: usize| unsafe { _mm512_load_ps(r.0.as_ptr().add(16 * v)) };
    let neg_inf = _mm512_set1_ps(f32::NEG_INFINITY);
    let mut mt = [neg_inf; V];
    for r in s.iter() {
        for (v, mt) in mt.iter_mut().enumerate() {
            // `max(x, m)` returns m when x is NaN.
            *mt = _mm512_max_ps(ld(r, v), *mt);
        }
    }
    // Rounding is monotonic, so the max of the scaled scores is the scaled max (scale > 0).
    for mt in mt.iter_mut() {
        *mt = _mm512_mul_ps(*mt, sc);
    }
    let mut corr = Lanes::splat(0.0);
    let mut msub = [_mm512_setzero_ps(); V];
    let mut rescale: __mmask16 = 0;
    for v in 0..V {
        let old = ld(m, v);
        let grow = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(mt[v], _mm512_add_ps(old, _mm512_set1_ps(LAG)));
        let new = _mm512_mask_blend_ps(grow, old, mt[v]);
        let empty = _mm512_cmp_ps_mask::<_CMP_EQ_OQ>(new, neg_inf);
        msub[v] = _mm512_mask_blend_ps(empty, new, _mm512_setzero_ps());
        let c = exp2(_mm512_sub_ps(old, msub[v]));
        let started = _mm512_cmp_ps_mask::<_CMP_NEQ_OQ>(old, neg_inf);
        rescale |= _mm512_mask_cmp_ps_mask::<_CMP_NEQ_UQ>(started, c, _mm512_set1_ps(1.0));
        // SAFETY: as above.
        unsafe {
            _mm512_store_ps(m.0.as_mut_ptr().add(16 * v), new);
            _mm512_store_ps(corr.0.as_mut_ptr().add(16 * v), c);
        }
    }
    // SAFETY: 32 u16 are 64 bytes.
    let idx = unsafe { _mm512_loadu_si512(INTERLEAVE.as_ptr().cast()) };
    let mut sum = [_mm512_setzero_ps(); V];
    for (i, pr) in pt.iter_mut().enumerate() {
        for v in 0..V {
            let x0 = exp2(_mm512_fmsub_ps(ld(&s[2 * i], v), sc, msub[v]));
            let x1 = if 2 * i + 1 < n {
                exp2(_mm512_fmsub_ps(ld(&s[2 * i + 1], v), sc, msub[v]))
            } else {
                _mm512_setzero_ps()
            };
            sum[v] = _mm512_add_ps(_mm512_add_ps(sum[v], x0), x1);
            // SAFETY: as above; the bf16 vector is the same 64 bytes as the u32 one.
            unsafe {
                let both: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(x1, x0));
                let pairs = _mm512_permutexvar_epi16(idx, both);
                _mm512_store_si512(pr.0.as_mut_ptr().add(16 * v).cast(), pairs);
                if keep {
                    _mm512_store_ps(s[2 * i].0.as_mut_ptr().add(16 * v), x0);
                    if 2 * i + 1 < n {
                        _mm512_store_ps(s[2 * i + 1].0.as_mut_ptr().add(16 * v), x1);
                    }
                }
            }
        }
    }
    for (v, &sum) in sum.iter().enumerate() {
        let c = ld(&corr, v);
        let x = _mm512_fmadd_ps(ld(l, v), c, sum);
        // SAFETY: as above.
        unsafe { _mm512_store_ps(l.0.as_mut_ptr().add(16 * v), x) };
    }
    (corr, rescale != 0)
}

/// Transposes a 16 × 16 block of u32 held as 16 rows: output row `j` is input column `j`.
/// Interleaves 32-bit then 64-bit elements inside 128-bit lanes, then gathers the lanes in two
/// rounds of `VSHUFI32X4`.
#[inline]
#[target_feature(enable = "avx512f")]
fn transpose16(r: [__m512i; 16]) -> [__m512i; 16] {
    let t: [__m512i; 16] = std::array::from_fn(|i| {
        let (a, b) = (r[i & !1], r[i | 1]);
        if i % 2 == 0 {
            _mm512_unpacklo_epi32(a, b)
        } else {
            _mm512_unpackhi_epi32(a, b)
        }
    });
    // u[4i + m], lane L: column 4L + m of rows 4i .. 4i + 4.
    let u: [__m512i; 16] = std::array::from_fn(|k| {
        let (i, m) = (k / 4, k % 4);
        let (a, b) = (t[4 * i + (m / 2)], t[4 * i + 2 + (m / 2)]);
        if m % 2 == 0 {
            _mm512_unpacklo_epi64(a, b)
        } else {
            _mm512_unpackhi_epi64(a, b)
        }
    });
    let mut out = [_mm512_setzero_si512(); 16];
    for m in 0..4 {
        let va = _mm512_shuffle_i32x4::<0x88>(u[m], u[4 + m]);
        let vb = _mm512_shuffle_i32x4::<0xDD>(u[m], u[4 + m]);
        let wa = _mm512_shuffle_i32x4::<0x88>(u[8 + m], u[12 + m]);
        let wb = _mm512_shuffle_i32x4::<0xDD>(u[8 + m], u[12 + m]);
        out[m] = _mm512_shuffle_i32x4::<0x88>(va, wa);
        out[8 + m] = _mm512_shuffle_i32x4::<0xDD>(va, wa);
        out[4 + m] = _mm512_shuffle_i32x4::<0x88>(vb, wb);
        out[12 + m] = _mm512_shuffle_i32x4::<0xDD>(vb, wb);
    }
    out
}

/// `dst[t]` lane `c` = the pair `src[c · stride + 2t], src[c · stride + 2t + 1]` for rows
/// `c < rows` (at most BR), 0 in the lanes past them: rows of bf16 pairs turned into lanes,
/// 16 × 16 pairs per transpose.
///
/// # Safety
/// avx512f must be available; `stride` is even and `rows <= BR`; every row `c < rows` holds
/// `2 · dst.len()` values from `c · stride` inside `src`.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn rows_to_lanes(dst: &mut [Pairs], src: &[u16], stride: usize, rows: usize) {
    let np = dst.len();
    for c0 in (0..BR).step_by(16) {
        for t0 in (0..np).step_by(16) {
            let w = (np - t0).min(16);
            let mask: __mmask16 = if w == 16 { !0 } else { (1 << w) - 1 };
            let r: [__m512i; 16] = std::array::from_fn(|i| {
                let c = c0 + i;
                if c < rows {
                    // SAFETY: the `w` pairs from pair `t0` of row `c` lie inside `src` (the
                    // caller's bounds); the masked load reads no other.
                    unsafe {
                        _mm512_maskz_loadu_epi32(mask, src.as_ptr().add(c * stride + 2 * t0).cast())
                    }
                } else {
                    _mm512_setzero_si512()
                }
            });
            let o = transpose16(r);
            for (j, o) in o.iter().enumerate().take(w) {
                // SAFETY: `dst[t0 + j]` exists (`j < w`); lanes `c0 .. c0 + 16` of it are 64
                // bytes inside its BR lanes.
                unsafe { _mm512_storeu_si512(dst[t0 + j].0.as_mut_ptr().add(c0).cast(), *o) };
            }
        }
    }
}

/// `dst[x · dst_stride + r] = src[r · src_stride + x]` for `x < d`, `r < rows`, and 0 for
/// `rows <= r < ⌈rows / 32⌉ · 32`: a bf16 transpose in which every pair of source rows
/// becomes a pair of destination columns, 16 × 16 pairs per transpose.
///
/// # Safety
/// avx512f and avx512bw must be available; every row `r < rows` of `src` holds `d` values from
/// `r · src_stride`; `dst_stride >= ⌈rows / 32⌉ · 32` and `dst` holds `d` such rows.
#[target_feature(enable = "avx512f,avx512bw")]
pub(super) unsafe fn transpose_rows(
    dst: &mut [u16],
    dst_stride: usize,
    src: &[u16],
    src_stride: usize,
    rows: usize,
    d: usize,
) {
    // SAFETY: 32 u16 are 64 bytes.
    let idx = unsafe { _mm512_loadu_si512(INTERLEAVE.as_ptr().cast()) };
    let row = |r: usize, x0: usize, mask: __mmask16| {
        if r < rows {
            // SAFETY: values `x0 .. x0 + 16` of row `r` that the mask keeps (those `< d`) lie
            // inside `src`.
            unsafe { _mm256_maskz_loadu_epi16(mask, src.as_ptr().add(r * src_stride + x0).cast()) }
        } else {
            _mm256_setzero_si256()
        }
    };
    for r0 in (0..rows).step_by(32) {
        for x0 in (0..d).step_by(16) {
            let w = (d - x0).min(16);
            let mask: __mmask16 = if w == 16 { !0 } else { (1 << w) - 1 };
            // Pair row i: values x0 .. x0 + 16 of rows r0 + 2i and r0 + 2i + 1, interleaved.
            let p: [__m512i; 16] = std::array::from_fn(|i| {
                let a = row(r0 + 2 * i, x0, mask);
                let b = row(r0 + 2 * i + 1, x0, mask);
                _mm512_permutexvar_epi16(idx, _mm512_inserti64x4::<1>(_mm512_castsi256_si512(a), b))
            });
            let o = transpose16(p);
            for (j, o) in o.iter().enumerate().take(w) {
                // SAFETY: row `x0 + j < d` of `dst`, columns `r0 .. r0 + 32 <= dst_stride`.
                unsafe {
                    _mm512_storeu_si512(dst.as_mut_ptr().add((x0 + j) * dst_stride + r0).cast(), *o)
                }
            }
        }
    }
}

/// `dst[i]` lane `x` = the pair `(src[2i · stride + x], src[(2i + 1) · stride + x])` for
/// `x < d` (at most BR) and source rows `< rows`, 0 elsewhere: pairs of rows interleaved.
///
/// # Safety
/// avx512f and avx512bw must be available; every row `r < rows` of `src` holds `d <= BR`
/// values from `r · stride`.
#[target_feature(enable = "avx512f,avx512bw")]
pub(super) unsafe fn interleave_rows(
    dst: &mut [Pairs],
    src: &[u16],
    stride: usize,
    rows: usize,
    d: usize,
) {
    // SAFETY: 32 u16 are 64 bytes.
    let idx = unsafe { _mm512_loadu_si512(INTERLEAVE.as_ptr().cast()) };
    for (i, o) in dst.iter_mut().enumerate() {
        for v in 0..V {
            let x0 = 16 * v;
            let w = d.saturating_sub(x0).min(16);
            let mask: __mmask16 = if w == 16 { !0 } else { (1 << w) - 1 };
            let row = |r: usize| {
                if r < rows && w > 0 {
                    // SAFETY: the values of row `r` the mask keeps (`< d`) lie inside `src`.
                    unsafe {
                        _mm256_maskz_loadu_epi16(mask, src.as_ptr().add(r * stride + x0).cast())
                    }
                } else {
                    _mm256_setzero_si256()
                }
            };
            let (a, b) = (row(2 * i), row(2 * i + 1));
            let p = _mm512_permutexvar_epi16(
                idx,
                _mm512_inserti64x4::<1>(_mm512_castsi256_si512(a), b),
            );
            // SAFETY: lanes `x0 .. x0 + 16` of `dst[i]`, aligned to 64 bytes.
            unsafe { _mm512_store_si512(o.0.as_mut_ptr().add(x0).cast(), p) };
        }
    }
}

/// The backward pass's probabilities and their packing in one pass, for steps without a softcap
/// or ALiBi: for rows `r < rows` (`s`, `dp`: `S = Q Kᵀ` unscaled and `dP = dO Vᵀ`, keys in
/// lanes) `P = 2^(S · qk2 - lse2[r])` and `dS = P ∘ (dP - delta[r])`, both 0 in the lanes
/// outside `lanes[r]` (a bit per key; `None`: every lane). Writes `P` and `dS` rounded to bf16
/// pairs of rows (`pp`, `dsp`: `pp.len()` pairs, rows `>= rows` counting as 0) and, with `ds`,
/// `dS` rounded to bf16 row-major (BR values per row, rows `stride` apart).
///
/// # Safety
/// avx512f, avx512bw and avx512bf16 must be available; `ds` holds `rows` rows of BR at its
/// stride, `s`, `dp`, `lse2`, `delta` (and `lanes`) at least `rows` entries, and
/// `dsp.len() == pp.len()`.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn probs_pairs(
    s: &[Lanes],
    dp: &[Lanes],
    lse2: &[f32],
    delta: &[f32],
    qk2: f32,
    lanes: Option<&[u64]>,
    rows: usize,
    pp: &mut [Pairs],
    dsp: &mut [Pairs],
    mut ds: Option<(&mut [u16], usize)>,
) {
    // SAFETY: 32 u16 are 64 bytes.
    let idx = unsafe { _mm512_loadu_si512(INTERLEAVE.as_ptr().cast()) };
    let q = _mm512_set1_ps(qk2);
    // P and dS of row r, vector v (0 past `rows`).
    let row = |r: usize, v: usize| -> (__m512, __m512) {
        if r >= rows {
            return (_mm512_setzero_ps(), _mm512_setzero_ps());
        }
        // SAFETY: rows `r < rows` exist in `s` and `dp`; `Lanes` holds BR = 16 V floats
        // aligned to 64.
        let (x, g) = unsafe {
            (
                _mm512_load_ps(s[r].0.as_ptr().add(16 * v)),
                _mm512_load_ps(dp[r].0.as_ptr().add(16 * v)),
            )
        };
        let p = exp2(_mm512_fmsub_ps(x, q, _mm512_set1_ps(lse2[r])));
        let d = _mm512_mul_ps(p, _mm512_sub_ps(g, _mm512_set1_ps(delta[r])));
        match lanes {
            None => (p, d),
            Some(l) => {
                let k = (l[r] >> (16 * v)) as __mmask16;
                (_mm512_maskz_mov_ps(k, p), _mm512_maskz_mov_ps(k, d))
            }
        }
    };
    for (i, (pr, dr)) in pp.iter_mut().zip(dsp.iter_mut()).enumerate() {
        let (r0, r1) = (2 * i, 2 * i + 1);
        for v in 0..V {
            let (p0, d0) = row(r0, v);
            let (p1, d1) = row(r1, v);
            // SAFETY: as above for `pp[i]`, `dsp[i]`, rows `< rows` of `dp` and of `ds`
            // (BR u16 each, 16 of them from 16 v); the bf16 vectors are the bytes of the u32
            // ones.
            unsafe {
                let pb: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(p1, p0));
                let db: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(d1, d0));
                _mm512_store_si512(
                    pr.0.as_mut_ptr().add(16 * v).cast(),
                    _mm512_permutexvar_epi16(idx, pb),
                );
                _mm512_store_si512(
                    dr.0.as_mut_ptr().add(16 * v).cast(),
                    _mm512_permutexvar_epi16(idx, db),
                );
                if let Some((ds, stride)) = ds.as_mut() {
                    for (r, d) in [(r0, d0), (r1, d1)] {
                        if r < rows {
                            let h: __m256i = std::mem::transmute(_mm512_cvtneps_pbh(d));
                            let at = ds.as_mut_ptr().add(r * *stride + 16 * v);
                            _mm256_storeu_si256(at.cast(), h);
                        }
                    }
                }
            }
        }
    }
}
