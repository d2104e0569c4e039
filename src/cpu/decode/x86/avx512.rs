//! The AVX-512 decode kernels: head-dim elements in lanes, 16 at a time (32 bf16 pairs for the
//! `vdpbf16ps` dot product), K and V rows read as stored (f32, f16 or bf16) and converted in
//! registers. Head dims that are not a multiple of the chunk end in masked loads, which never
//! touch the masked-out elements.
//!
//! * `q·k` ([`scores`], [`scores_bf16`]): register blocks of four query rows × four keys, 16
//!   accumulators over the head dim, then one reduction tree turns the 16 vectors into the 16
//!   dot products at once (45 shuffles and adds, against 128 FMAs at d = 128); for bf16 and
//!   eight rows or more, [`scores_bf16_t8`] transposes the block instead (keys in lanes).
//! * The online softmax of a block ([`softmax_rows`]): 16 rows at a time, their running
//!   statistics in lanes.
//! * The score kernels prefetch the rows of a later step (a [`Pf`]) a few at a time between
//!   their chunk iterations.
//! * `P V` ([`pv`]): `o[t] = o[t] · corr[t] + Σ_c p[t][c] V[c]` with the output rows held in
//!   up to 16 accumulators (rows × 16-lane chunks of the head dim), each V chunk loaded and
//!   converted once per key for all rows of the register block. bf16 caches with `vdpbf16ps`
//!   round `p` to bf16 and run the same f32 FMAs: the products are exact either way, and
//!   Sapphire Rapids retires one 32-product `vdpbf16ps` per two cycles but two 16-product FMAs
//!   per cycle, so the FMAs do the same sums in half the time.

use std::arch::x86_64::*;

use super::super::{kind, Kind, Pf, Rows, BK};

/// f32 lanes of a vector.
const W: usize = 16;

/// The lanes `x .. x + 16` that exist below `d`.
#[inline(always)]
fn mask16(x: usize, d: usize) -> __mmask16 {
    if x + W <= d {
        !0
    } else if x >= d {
        0
    } else {
        (1u16 << (d - x)) - 1
    }
}

/// The 16-bit lanes `x .. x + 32` that exist below `d`.
#[inline(always)]
fn mask32(x: usize, d: usize) -> __mmask32 {
    if x + 2 * W <= d {
        !0
    } else if x >= d {
        0
    } else {
        (1u32 << (d - x)) - 1
    }
}

/// Elements `p .. p + 16` of a row of `T` as f32; lanes outside `m` are 0 and not read.
///
/// # Safety
/// avx512f/bw/vl must be available; the lanes in `m` must be readable.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn load<T: 'static>(p: *const T, m: __mmask16) -> __m512 {
    // SAFETY: the lanes in `m` are readable (caller); masked lanes are not accessed.
    unsafe {
        match kind::<T>() {
            Kind::F32 => _mm512_maskz_loadu_ps(m, p.cast()),
            Kind::F16 => _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p.cast())),
            // A bf16 is the upper half of an f32 (NaN stays NaN).
            Kind::Bf16 => _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(
                _mm256_maskz_loadu_epi16(m, p.cast()),
            ))),
            Kind::E4m3 => e4m3(_mm_maskz_loadu_epi8(m, p.cast())),
            // `Avx512::reads` sends other types through the f32 conversion: never reached.
            Kind::Other => _mm512_setzero_ps(),
        }
    }
}

/// Sixteen e4m3 bytes as f32, exactly: `elem::e4m3x8`'s conversion (magnitude bits into an
/// f16, widened, times 2^8, NaN codes to NaN) at AVX-512's width, the NaN lanes by a mask.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
fn e4m3(x: __m128i) -> __m512 {
    let w = _mm256_cvtepu8_epi16(x);
    let mag = _mm256_and_si256(w, _mm256_set1_epi16(0x7f));
    let h = _mm256_or_si256(
        _mm256_slli_epi16::<7>(mag),
        _mm256_slli_epi16::<8>(_mm256_and_si256(w, _mm256_set1_epi16(0x80))),
    );
    let f = _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.0));
    let nan = _mm256_cmpeq_epi16_mask(mag, _mm256_set1_epi16(0x7f));
    _mm512_mask_mov_ps(f, nan, _mm512_set1_ps(f32::NAN))
}

/// Lane `i` of the result is the sum of the lanes of `a[i]`: pairs summed within 128-bit
/// blocks (two levels), then the four blocks of each group of four inputs (two levels).
#[inline]
#[target_feature(enable = "avx512f")]
fn reduce16(a: &[__m512; 16]) -> __m512 {
    // t[k], block j: [a0 + a2, b0 + b2, a1 + a3, b1 + b3] of (a, b) = (a[2k], a[2k+1]) there.
    let mut t = [_mm512_setzero_ps(); 8];
    for (k, t) in t.iter_mut().enumerate() {
        let (x, y) = (a[2 * k], a[2 * k + 1]);
        *t = _mm512_add_ps(_mm512_unpacklo_ps(x, y), _mm512_unpackhi_ps(x, y));
    }
    // u[m], block j: the sums over block j of a[4m], a[4m+1], a[4m+2], a[4m+3].
    let mut u = [_mm512_setzero_ps(); 4];
    for (m, u) in u.iter_mut().enumerate() {
        let (x, y) = (t[2 * m], t[2 * m + 1]);
        *u = _mm512_add_ps(
            _mm512_shuffle_ps::<0x44>(x, y),
            _mm512_shuffle_ps::<0xEE>(x, y),
        );
    }
    // v[0] = [u0 b0+b2, u0 b1+b3, u1 b0+b2, u1 b1+b3], v[1] the same of u2, u3.
    let v0 = _mm512_add_ps(
        _mm512_shuffle_f32x4::<0b01_00_01_00>(u[0], u[1]),
        _mm512_shuffle_f32x4::<0b11_10_11_10>(u[0], u[1]),
    );
    let v1 = _mm512_add_ps(
        _mm512_shuffle_f32x4::<0b01_00_01_00>(u[2], u[3]),
        _mm512_shuffle_f32x4::<0b11_10_11_10>(u[2], u[3]),
    );
    // Block m: all four blocks of u[m] summed.
    _mm512_add_ps(
        _mm512_shuffle_f32x4::<0b10_00_10_00>(v0, v1),
        _mm512_shuffle_f32x4::<0b11_01_11_01>(v0, v1),
    )
}

/// Stores lanes `4t .. 4t + 4` of `r` to `s[t0 + t][c0 .. c0 + 4]` for the rows that exist.
/// Columns past the block's keys receive values the softmax overwrites.
#[inline]
#[target_feature(enable = "avx512f")]
fn store_block(r: __m512, s: &mut [[f32; BK]], t0: usize, rows: usize, c0: usize) {
    let lanes = [
        _mm512_extractf32x4_ps::<0>(r),
        _mm512_extractf32x4_ps::<1>(r),
        _mm512_extractf32x4_ps::<2>(r),
        _mm512_extractf32x4_ps::<3>(r),
    ];
    for (t, lane) in lanes.iter().enumerate().take(rows - t0) {
        if c0 + 4 <= BK {
            let dst = &mut s[t0 + t][c0..c0 + 4];
            // SAFETY: `dst` holds four floats.
            unsafe { _mm_storeu_ps(dst.as_mut_ptr(), *lane) };
        } else {
            let mut x = [0f32; 4];
            // SAFETY: `x` holds four floats.
            unsafe { _mm_storeu_ps(x.as_mut_ptr(), *lane) };
            for (c, x) in (c0..BK).zip(x) {
                s[t0 + t][c] = x;
            }
        }
    }
}

/// `s[t][c] = q[t] · K[c]` for `t < rows`, `c` in `keys`, with `q` f32 rows `d` apart and K
/// rows of `T` converted in registers.
///
/// Prefetches the rows of `pf` a few at a time on the way.
///
/// # Safety
/// avx512f/bw/vl and fma must be available; `q` holds `rows` rows of `d`, `s` `rows` rows;
/// `keys` is not empty, ends at most at `BK`, and every K row of `keys` has `d` elements in
/// bounds.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma")]
pub(super) unsafe fn scores<T: 'static>(
    q: &[f32],
    rows: usize,
    d: usize,
    k: &Rows<T>,
    keys: std::ops::Range<usize>,
    s: &mut [[f32; BK]],
    pf: &mut Pf,
) {
    let kp = k.src.as_ptr();
    // The prefetches, spread evenly over the chunk iterations.
    let iters = rows.div_ceil(4) * keys.len().div_ceil(4) * d.div_ceil(W);
    let per = pf.rows().div_ceil(iters.max(1));
    let mut t0 = 0;
    while t0 < rows {
        // Rows past `rows` repeat the last one, keys past `n` the last key; their results are
        // dropped.
        let qr: [*const f32; 4] =
            [0, 1, 2, 3].map(|t| q.as_ptr().wrapping_add((t0 + t).min(rows - 1) * d));
        let mut c0 = keys.start;
        while c0 < keys.end {
            let kr: [*const T; 4] =
                [0, 1, 2, 3].map(|c| kp.wrapping_add(k.row((c0 + c).min(keys.end - 1))));
            let mut acc = [_mm512_setzero_ps(); 16];
            let mut x = 0;
            while x < d {
                pf.fetch(per);
                let m = mask16(x, d);
                let mut kv = [_mm512_setzero_ps(); 4];
                for (kv, kr) in kv.iter_mut().zip(&kr) {
                    // SAFETY: lanes below `d` of a K row in bounds (caller).
                    *kv = unsafe { load(kr.wrapping_add(x), m) };
                }
                for (t, qr) in qr.iter().enumerate() {
                    // SAFETY: lanes below `d` of a query row in bounds (caller).
                    let qv = unsafe { _mm512_maskz_loadu_ps(m, qr.wrapping_add(x)) };
                    for (c, kv) in kv.iter().enumerate() {
                        acc[4 * t + c] = _mm512_fmadd_ps(qv, *kv, acc[4 * t + c]);
                    }
                }
                x += W;
            }
            store_block(reduce16(&acc), s, t0, rows, c0);
            c0 += 4;
        }
        t0 += 4;
    }
}

/// [`scores`] for bf16 rows with `vdpbf16ps`: 32 products of bf16 pairs per instruction,
/// summed in f32 (each product is exact in f32); `qh` holds the query rows as bf16 bits.
///
/// # Safety
/// avx512f/bw/vl and avx512bf16 must be available; `T` is bf16; `qh` holds `rows` rows of `d`
/// (`d.next_multiple_of(2)` apart), `s` `rows` rows; `keys` as for [`scores`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
pub(super) unsafe fn scores_bf16<T: 'static>(
    qh: &[u16],
    rows: usize,
    d: usize,
    k: &Rows<T>,
    keys: std::ops::Range<usize>,
    s: &mut [[f32; BK]],
    pf: &mut Pf,
) {
    let kp = k.src.as_ptr().cast::<i16>();
    let dq = d.next_multiple_of(2);
    let iters = rows.div_ceil(4) * keys.len().div_ceil(4) * d.div_ceil(2 * W);
    let per = pf.rows().div_ceil(iters.max(1));
    let mut t0 = 0;
    while t0 < rows {
        let qr: [*const i16; 4] = [0, 1, 2, 3].map(|t| {
            qh.as_ptr()
                .cast::<i16>()
                .wrapping_add((t0 + t).min(rows - 1) * dq)
        });
        let mut c0 = keys.start;
        while c0 < keys.end {
            let kr: [*const i16; 4] =
                [0, 1, 2, 3].map(|c| kp.wrapping_add(k.row((c0 + c).min(keys.end - 1))));
            let mut acc = [_mm512_setzero_ps(); 16];
            let mut x = 0;
            while x < d {
                pf.fetch(per);
                let m = mask32(x, d);
                let mut kv = [_mm512_setzero_si512(); 4];
                for (kv, kr) in kv.iter_mut().zip(&kr) {
                    // SAFETY: lanes below `d` of a K row in bounds (caller).
                    *kv = unsafe { _mm512_maskz_loadu_epi16(m, kr.wrapping_add(x)) };
                }
                for (t, qr) in qr.iter().enumerate() {
                    // SAFETY: lanes below `d` of a query row in bounds (caller).
                    let qv = unsafe { _mm512_maskz_loadu_epi16(m, qr.wrapping_add(x)) };
                    for (c, kv) in kv.iter().enumerate() {
                        // SAFETY: both are 512-bit vectors of 32 bf16 lanes.
                        let (a, b) = unsafe {
                            (
                                std::mem::transmute::<__m512i, __m512bh>(qv),
                                std::mem::transmute::<__m512i, __m512bh>(*kv),
                            )
                        };
                        acc[4 * t + c] = _mm512_dpbf16_ps(acc[4 * t + c], a, b);
                    }
                }
                x += 2 * W;
            }
            store_block(reduce16(&acc), s, t0, rows, c0);
            c0 += 4;
        }
        t0 += 4;
    }
}

/// For the `rows` rows `t` of `o` (`d` apart): `o[t] = o[t] · corr[t] + Σ_c p[t][c] V[c]` over
/// `c` in `cols`, in register blocks of 8, 4, 2 or 1 rows; with `R`, each `p` rounded to bf16
/// first (the bf16 products' semantics, see [`pv_rows`]); with `S`, the rows of `o` are
/// pair-split (see [`pv_rows`]). Prefetches the rows of `pf` a few at a time between the keys.
///
/// # Safety
/// avx512f/bw/vl and fma must be available; `o` holds `rows` rows of `d`, `corr` and `p` at
/// least `rows` entries; `cols.end <= BK` and every V row of `cols` has `d` elements in bounds;
/// with `S`, `T` is bf16 and `d` a multiple of 32.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma")]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn pv<T: 'static, const R: bool, const S: bool>(
    o: &mut [f32],
    rows: usize,
    d: usize,
    corr: Option<&[f32]>,
    p: &[[f32; BK]],
    v: &Rows<T>,
    cols: std::ops::Range<usize>,
    pf: &mut Pf,
) {
    // The prefetches, spread over the keys of the first pass over the head dim (one check
    // per key; spread over every pass they cost a tenth of the cache-hot time).
    let per = pf.rows().div_ceil(cols.len());
    let mut t = 0;
    while t < rows {
        let (op, cr, pr) = (
            o.as_mut_ptr().wrapping_add(t * d),
            corr.map(|c| &c[t..]),
            &p[t..],
        );
        // SAFETY (each call): rows t.. of `o`, `corr` and `p` exist for the block's row count
        // (`rows - t` at least that many), the rest as for this function.
        t += unsafe {
            match rows - t {
                1 => pv_rows::<T, 1, 8, R, S>(op, d, cr, pr, v, cols.clone(), pf, per),
                2 | 3 => pv_rows::<T, 2, 8, R, S>(op, d, cr, pr, v, cols.clone(), pf, per),
                4..=7 => pv_rows::<T, 4, 4, R, S>(op, d, cr, pr, v, cols.clone(), pf, per),
                _ => pv_rows::<T, 8, 2, R, S>(op, d, cr, pr, v, cols.clone(), pf, per),
            }
        };
    }
    pf.fetch_all();
}

/// [`pv`] for `RB` rows, `CB` chunks of 16 head-dim elements per pass (`RB · CB` accumulators);
/// returns `RB`. With `R` the probabilities are rounded to bf16 (nearest even) before their
/// products, which are then exact in f32: the same sums as `vdpbf16ps` of bf16 `P` and V, on
/// f32 FMAs, which retire twice the multiply-adds per cycle of `vdpbf16ps` on Sapphire Rapids.
///
/// With `S` the rows of `o` are pair-split, as the tile product leaves them
/// (`amx::pv`): each 32 bf16 of a V row are loaded as 16 pairs, whose low halves shifted up are
/// the even elements and whose high halves masked are the odd ones, two instructions per 32
/// elements where widening takes four.
///
/// # Safety
/// As for [`pv`], with `RB` rows at `o`, in `corr` and in `p`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn pv_rows<T: 'static, const RB: usize, const CB: usize, const R: bool, const S: bool>(
    o: *mut f32,
    d: usize,
    corr: Option<&[f32]>,
    p: &[[f32; BK]],
    v: &Rows<T>,
    cols: std::ops::Range<usize>,
    pf: &mut Pf,
    per: usize,
) -> usize {
    let vp = v.src.as_ptr();
    let mut pr = [[0f32; BK]; RB];
    for (t, pr) in pr.iter_mut().enumerate() {
        // SAFETY: `p[t]` and `pr` hold BK = 16 floats.
        unsafe {
            let x = _mm512_loadu_ps(p[t].as_ptr());
            let x = if R { round_bf16(x) } else { x };
            _mm512_storeu_ps(pr.as_mut_ptr(), x);
        }
    }
    let mut x0 = 0;
    while x0 < d {
        let mut m = [0 as __mmask16; CB];
        for (j, m) in m.iter_mut().enumerate() {
            *m = mask16(x0 + j * W, d);
        }
        let mut acc = [[_mm512_setzero_ps(); CB]; RB];
        for (t, acc) in acc.iter_mut().enumerate() {
            for (j, acc) in acc.iter_mut().enumerate() {
                // SAFETY: lanes below `d` of row t of `o` (caller).
                *acc = unsafe { _mm512_maskz_loadu_ps(m[j], o.wrapping_add(t * d + x0 + j * W)) };
            }
            if let Some(corr) = corr {
                let c = _mm512_set1_ps(corr[t]);
                for acc in acc.iter_mut() {
                    *acc = _mm512_mul_ps(*acc, c);
                }
            }
        }
        for c in cols.clone() {
            if x0 == 0 {
                pf.fetch(per);
            }
            let row = vp.wrapping_add(v.row(c) + x0);
            let mut vv = [_mm512_setzero_ps(); CB];
            if S {
                let high = _mm512_set1_epi32(-0x1_0000);
                for j in (0..CB).step_by(2) {
                    let x = x0 + j * W;
                    // SAFETY: lanes below `d` of a V row of bf16 in bounds (caller).
                    let w = unsafe {
                        _mm512_maskz_loadu_epi16(mask32(x, d), row.wrapping_add(j * W).cast())
                    };
                    vv[j] = _mm512_castsi512_ps(_mm512_slli_epi32::<16>(w));
                    vv[j + 1] = _mm512_castsi512_ps(_mm512_and_si512(w, high));
                }
            } else {
                for (j, vv) in vv.iter_mut().enumerate() {
                    // SAFETY: lanes below `d` of a V row in bounds (caller).
                    *vv = unsafe { load(row.wrapping_add(j * W), m[j]) };
                }
            }
            for (t, acc) in acc.iter_mut().enumerate() {
                let pb = _mm512_set1_ps(pr[t][c]);
                for (acc, vv) in acc.iter_mut().zip(&vv) {
                    *acc = _mm512_fmadd_ps(pb, *vv, *acc);
                }
            }
        }
        for (t, acc) in acc.iter().enumerate() {
            for (j, acc) in acc.iter().enumerate() {
                // SAFETY: as for the load.
                unsafe { _mm512_mask_storeu_ps(o.wrapping_add(t * d + x0 + j * W), m[j], *acc) };
            }
        }
        x0 += CB * W;
    }
    RB
}

/// `x` rounded to the nearest bf16 (ties to even), as f32; NaN stays NaN. In integer
/// arithmetic, so that it needs no AVX-512 BF16.
#[inline]
#[target_feature(enable = "avx512f")]
fn round_bf16(x: __m512) -> __m512 {
    let b = _mm512_castps_si512(x);
    let odd = _mm512_and_si512(_mm512_srli_epi32::<16>(b), _mm512_set1_epi32(1));
    let r = _mm512_add_epi32(b, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
    let r = _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32(-0x1_0000)));
    // Rounding up the low half of a NaN's payload could carry into Inf: keep NaN as it is.
    _mm512_mask_blend_ps(_mm512_cmp_ps_mask::<_CMP_UNORD_Q>(x, x), r, x)
}

/// The two `A` tiles of `P` for the tile product (`amx::pv`): rows `t < n` of `pe` and `po` from
/// `p[t]`, each probability rounded to bf16 (NaN made the quiet NaN, whose low half is 0), as
/// the high half of a pair in `po` and the low half in `pe`, the other half 0; rows `n ..` zero.
///
/// # Safety
/// avx512f must be available; `p` holds `n <= 16` rows.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn p_tiles(
    p: &[[f32; BK]],
    n: usize,
    pe: &mut [[u32; BK]; BK],
    po: &mut [[u32; BK]; BK],
) {
    for (t, (pe, po)) in pe.iter_mut().zip(po.iter_mut()).enumerate() {
        let (e, o) = if t < n {
            // SAFETY: row t < n of `p` holds 16 floats (caller).
            let x = unsafe { _mm512_loadu_ps(p[t].as_ptr()) };
            let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(x, x);
            let b = _mm512_castps_si512(round_bf16(x));
            let b = _mm512_mask_mov_epi32(b, nan, _mm512_set1_epi32(0x7fc0_0000));
            (_mm512_srli_epi32::<16>(b), b)
        } else {
            (_mm512_setzero_si512(), _mm512_setzero_si512())
        };
        // SAFETY: a tile row holds 16 words.
        unsafe {
            _mm512_storeu_si512(pe.as_mut_ptr().cast(), e);
            _mm512_storeu_si512(po.as_mut_ptr().cast(), o);
        }
    }
}

/// `o[t] *= corr[t]` for the rows `t < n` (`d` apart) whose correction is not 1.
///
/// # Safety
/// avx512f must be available; `o` holds `n` rows of `d`, `corr` `n` entries.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn scale_rows(o: &mut [f32], d: usize, corr: &[f32], n: usize) {
    for (row, &c) in o[..n * d].chunks_exact_mut(d).zip(&corr[..n]) {
        if c == 1.0 {
            continue;
        }
        let cv = _mm512_set1_ps(c);
        let mut x = 0;
        while x < d {
            let m = mask16(x, d);
            // SAFETY: lanes below `d` of the row (caller).
            unsafe {
                let at = row.as_mut_ptr().add(x);
                let v = _mm512_maskz_loadu_ps(m, at);
                _mm512_mask_storeu_ps(at, m, _mm512_mul_ps(v, cv));
            }
            x += W;
        }
    }
}

/// `2^x` lane-wise, the polynomial of `crate::cpu::exp2` in vector form: relative error below
/// 5e-7 on `[-126, 127]`, exactly 0 below about -126.5 (so `-inf` gives 0), NaN stays NaN.
#[inline]
#[target_feature(enable = "avx512f,fma")]
fn exp2v(x: __m512) -> __m512 {
    use crate::cpu::exp2::{C, SHIFT, SHIFT_BITS};
    // `max`/`min` return their second operand when either is NaN: NaN passes through.
    let x = _mm512_max_ps(_mm512_set1_ps(-127.0), x);
    let x = _mm512_min_ps(_mm512_set1_ps(127.0), x);
    let t = _mm512_add_ps(x, _mm512_set1_ps(SHIFT));
    let n = _mm512_sub_epi32(_mm512_castps_si512(t), _mm512_set1_epi32(SHIFT_BITS));
    let f = _mm512_sub_ps(x, _mm512_sub_ps(t, _mm512_set1_ps(SHIFT)));
    let mut p = _mm512_set1_ps(C[6]);
    for &c in C[..6].iter().rev() {
        p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c));
    }
    // 2^n from its exponent bits; n = -127 gives +0.0.
    let scale = _mm512_castsi512_ps(_mm512_slli_epi32::<23>(_mm512_add_epi32(
        n,
        _mm512_set1_epi32(127),
    )));
    _mm512_mul_ps(p, scale)
}

/// Lane `i` of the result is the `op`-reduction of the lanes of `a[i]` (the tree of
/// [`reduce16`] with another operation).
#[inline]
#[target_feature(enable = "avx512f")]
fn reduce16_by(a: &[__m512; 16], op: impl Fn(__m512, __m512) -> __m512) -> __m512 {
    let mut t = [_mm512_setzero_ps(); 8];
    for (k, t) in t.iter_mut().enumerate() {
        let (x, y) = (a[2 * k], a[2 * k + 1]);
        *t = op(_mm512_unpacklo_ps(x, y), _mm512_unpackhi_ps(x, y));
    }
    let mut u = [_mm512_setzero_ps(); 4];
    for (m, u) in u.iter_mut().enumerate() {
        let (x, y) = (t[2 * m], t[2 * m + 1]);
        *u = op(
            _mm512_shuffle_ps::<0x44>(x, y),
            _mm512_shuffle_ps::<0xEE>(x, y),
        );
    }
    let v0 = op(
        _mm512_shuffle_f32x4::<0b01_00_01_00>(u[0], u[1]),
        _mm512_shuffle_f32x4::<0b11_10_11_10>(u[0], u[1]),
    );
    let v1 = op(
        _mm512_shuffle_f32x4::<0b01_00_01_00>(u[2], u[3]),
        _mm512_shuffle_f32x4::<0b11_10_11_10>(u[2], u[3]),
    );
    op(
        _mm512_shuffle_f32x4::<0b10_00_10_00>(v0, v1),
        _mm512_shuffle_f32x4::<0b11_01_11_01>(v0, v1),
    )
}

/// The online softmax of every row of a block, 16 rows at a time with the row statistics in
/// lanes: `s[r]` (raw scores; lanes outside `cols[r]` ignored) becomes `p = 2^(scale·s - m_new)`
/// (0 outside `cols[r]`), with `m_new = max(m[r], max_c scale·s)` (NaN skipped by the max yet
/// kept in `p`), `l[r] = l[r] · corr[r] + Σ p` and `corr[r] = 2^(m[r] - m_new)`; a row that has
/// seen no key subtracts 0, so its `p` and correction are 0, never NaN.
///
/// # Safety
/// avx512f/bw/vl and fma must be available; `cols`, `m`, `l` and `corr` hold at least
/// `s.len()` entries and every `cols[r]` ends at most at `BK`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma")]
pub(super) unsafe fn softmax_rows(
    s: &mut [[f32; BK]],
    cols: &[(usize, usize)],
    scale: f32,
    m: &mut [f32],
    l: &mut [f32],
    corr: &mut [f32],
) {
    let ninf = _mm512_set1_ps(f32::NEG_INFINITY);
    let sc = _mm512_set1_ps(scale);
    let mut r0 = 0;
    while r0 < s.len() {
        let nr = W.min(s.len() - r0);
        let rows = if nr == W { !0 } else { (1u16 << nr) - 1 };
        // Scaled scores, -inf outside the visible columns (stored back), and the same with NaN
        // as -inf for the max.
        let mut xm = [ninf; W];
        for (t, xm) in xm.iter_mut().enumerate().take(nr) {
            let (c0, c1) = cols[r0 + t];
            let vis = ((1u32 << c1) - (1u32 << c0)) as u16;
            let row = s[r0 + t].as_mut_ptr();
            // SAFETY: a score row holds 16 floats.
            let x = unsafe { _mm512_mul_ps(_mm512_loadu_ps(row), sc) };
            let x = _mm512_mask_blend_ps(vis, ninf, x);
            // SAFETY: as above.
            unsafe { _mm512_storeu_ps(row, x) };
            *xm = _mm512_mask_blend_ps(_mm512_cmp_ps_mask::<_CMP_ORD_Q>(x, x), ninf, x);
        }
        let bm = reduce16_by(&xm, |a, b| _mm512_max_ps(a, b));
        // SAFETY: rows r0 .. r0 + nr of `m`, `l` and `corr` exist (caller).
        let mv = unsafe { _mm512_mask_loadu_ps(ninf, rows, m.as_ptr().add(r0)) };
        let m_new = _mm512_max_ps(mv, bm);
        let m_sub = _mm512_mask_blend_ps(
            _mm512_cmp_ps_mask::<_CMP_EQ_OQ>(m_new, ninf),
            m_new,
            _mm512_setzero_ps(),
        );
        let cr = exp2v(_mm512_sub_ps(mv, m_sub));
        let mut subs = [0f32; W];
        // SAFETY: `subs` holds 16 floats; rows as above.
        unsafe {
            _mm512_storeu_ps(subs.as_mut_ptr(), m_sub);
            _mm512_mask_storeu_ps(m.as_mut_ptr().add(r0), rows, m_new);
        }
        let mut ps = [_mm512_setzero_ps(); W];
        for (t, ps) in ps.iter_mut().enumerate().take(nr) {
            let row = s[r0 + t].as_mut_ptr();
            // SAFETY: a score row holds 16 floats.
            let x = unsafe { _mm512_loadu_ps(row) };
            *ps = exp2v(_mm512_sub_ps(x, _mm512_set1_ps(subs[t])));
            // SAFETY: as above.
            unsafe { _mm512_storeu_ps(row, *ps) };
        }
        let sum = reduce16_by(&ps, |a, b| _mm512_add_ps(a, b));
        // SAFETY: rows as above.
        unsafe {
            let lv = _mm512_maskz_loadu_ps(rows, l.as_ptr().add(r0));
            _mm512_mask_storeu_ps(l.as_mut_ptr().add(r0), rows, _mm512_fmadd_ps(lv, cr, sum));
            _mm512_mask_storeu_ps(corr.as_mut_ptr().add(r0), rows, cr);
        }
        r0 += W;
    }
}

/// Transposes 16 vectors of 16 dwords: lane `c` of `t[j]` is lane `j` of `r[c]` (32-bit, then
/// 64-bit interleaves within 128-bit blocks, then two rounds of block shuffles: 64 shuffles).
#[inline]
#[target_feature(enable = "avx512f")]
pub(super) fn transpose16(r: &[__m512i; 16]) -> [__m512i; 16] {
    // s1[2k] block L: r[2k][4L], r[2k+1][4L], r[2k][4L+1], r[2k+1][4L+1]; s1[2k+1]: lanes +2, +3.
    let mut s1 = [_mm512_setzero_si512(); 16];
    for k in 0..8 {
        s1[2 * k] = _mm512_unpacklo_epi32(r[2 * k], r[2 * k + 1]);
        s1[2 * k + 1] = _mm512_unpackhi_epi32(r[2 * k], r[2 * k + 1]);
    }
    // s2[4k + m] block L: lane 4L + m of r[4k .. 4k + 4].
    let mut s2 = [_mm512_setzero_si512(); 16];
    for k in 0..4 {
        s2[4 * k] = _mm512_unpacklo_epi64(s1[4 * k], s1[4 * k + 2]);
        s2[4 * k + 1] = _mm512_unpackhi_epi64(s1[4 * k], s1[4 * k + 2]);
        s2[4 * k + 2] = _mm512_unpacklo_epi64(s1[4 * k + 1], s1[4 * k + 3]);
        s2[4 * k + 3] = _mm512_unpackhi_epi64(s1[4 * k + 1], s1[4 * k + 3]);
    }
    // t[4L + m]: block B is block L of s2[4B + m].
    let mut t = [_mm512_setzero_si512(); 16];
    for m in 0..4 {
        let x0 = _mm512_shuffle_i32x4::<0b01_00_01_00>(s2[m], s2[4 + m]);
        let x1 = _mm512_shuffle_i32x4::<0b11_10_11_10>(s2[m], s2[4 + m]);
        let y0 = _mm512_shuffle_i32x4::<0b01_00_01_00>(s2[8 + m], s2[12 + m]);
        let y1 = _mm512_shuffle_i32x4::<0b11_10_11_10>(s2[8 + m], s2[12 + m]);
        t[m] = _mm512_shuffle_i32x4::<0b10_00_10_00>(x0, y0);
        t[4 + m] = _mm512_shuffle_i32x4::<0b11_01_11_01>(x0, y0);
        t[8 + m] = _mm512_shuffle_i32x4::<0b10_00_10_00>(x1, y1);
        t[12 + m] = _mm512_shuffle_i32x4::<0b11_01_11_01>(x1, y1);
    }
    t
}

/// [`scores_bf16`] with the keys in lanes, for groups of eight query rows: the block's K rows,
/// 32 head-dim elements (16 bf16 pairs) at a time, are transposed into 16 vectors of one pair
/// of every key, and each row's dot products then accumulate straight into its 16 scores
/// (`vdpbf16ps` of the row's pair, broadcast, with each vector): no reduction tree, and the
/// transpose is shared by the eight rows.
///
/// # Safety
/// avx512f/bw/vl and avx512bf16 must be available; `T` is bf16; `rows` is a multiple of 8;
/// `qh` holds `rows` rows of `d` (`d.next_multiple_of(2)` apart, zero-padded); `s` `rows`
/// rows; `keys` as for [`scores`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
pub(super) unsafe fn scores_bf16_t8<T: 'static>(
    qh: &[u16],
    rows: usize,
    d: usize,
    k: &Rows<T>,
    keys: std::ops::Range<usize>,
    s: &mut [[f32; BK]],
    pf: &mut Pf,
) {
    const RB: usize = 8;
    let kp = k.src.as_ptr().cast::<i16>();
    let dq = d.next_multiple_of(2);
    let qp = qh.as_ptr().cast::<u32>();
    let per = pf.rows().div_ceil((rows / RB * d.div_ceil(2 * W)).max(1));
    let mut t0 = 0;
    while t0 < rows {
        let mut acc = [_mm512_setzero_ps(); RB];
        let mut x = 0;
        while x < d {
            let m = mask32(x, d);
            // Key c's 32 elements from x (zero past the block's keys and past d).
            let mut r = [_mm512_setzero_si512(); 16];
            for (c, r) in r.iter_mut().enumerate() {
                if keys.contains(&c) {
                    // SAFETY: lanes below `d` of a K row of `keys`, in bounds (caller).
                    *r = unsafe { _mm512_maskz_loadu_epi16(m, kp.wrapping_add(k.row(c) + x)) };
                }
            }
            let kt = transpose16(&r);
            // The pairs of this chunk that exist (the zero padding completes the last one).
            let pairs = (dq - x).min(2 * W) / 2;
            if pairs == W {
                // A whole chunk: pair j of every row against vector j, the rows' pairs
                // broadcast inside the instruction (a separate broadcast cost as much as the
                // product) at fixed offsets, eight independent sums.
                pf.fetch(per);
                let q: [*const u32; RB] =
                    std::array::from_fn(|t| qp.wrapping_add(((t0 + t) * dq + x) / 2));
                let [mut a0, mut a1, mut a2, mut a3, mut a4, mut a5, mut a6, mut a7] = acc;
                macro_rules! dp {
                    ($($j:literal),*) => {$(
                        // SAFETY: pair j of the chunk lies inside each row (x + 2j < dq), which
                        // `qh` holds (caller); avx512bf16 is available (caller); each
                        // instruction reads those four bytes and writes its sum only.
                        unsafe {
                            std::arch::asm!(
                                "vdpbf16ps {a0}, {k}, dword ptr [{q0} + {o}]{{1to16}}",
                                "vdpbf16ps {a1}, {k}, dword ptr [{q1} + {o}]{{1to16}}",
                                "vdpbf16ps {a2}, {k}, dword ptr [{q2} + {o}]{{1to16}}",
                                "vdpbf16ps {a3}, {k}, dword ptr [{q3} + {o}]{{1to16}}",
                                "vdpbf16ps {a4}, {k}, dword ptr [{q4} + {o}]{{1to16}}",
                                "vdpbf16ps {a5}, {k}, dword ptr [{q5} + {o}]{{1to16}}",
                                "vdpbf16ps {a6}, {k}, dword ptr [{q6} + {o}]{{1to16}}",
                                "vdpbf16ps {a7}, {k}, dword ptr [{q7} + {o}]{{1to16}}",
                                a0 = inout(zmm_reg) a0,
                                a1 = inout(zmm_reg) a1,
                                a2 = inout(zmm_reg) a2,
                                a3 = inout(zmm_reg) a3,
                                a4 = inout(zmm_reg) a4,
                                a5 = inout(zmm_reg) a5,
                                a6 = inout(zmm_reg) a6,
                                a7 = inout(zmm_reg) a7,
                                k = in(zmm_reg) kt[$j],
                                q0 = in(reg) q[0],
                                q1 = in(reg) q[1],
                                q2 = in(reg) q[2],
                                q3 = in(reg) q[3],
                                q4 = in(reg) q[4],
                                q5 = in(reg) q[5],
                                q6 = in(reg) q[6],
                                q7 = in(reg) q[7],
                                o = const 4 * $j,
                                options(pure, readonly, nostack, preserves_flags),
                            );
                        }
                    )*};
                }
                dp!(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
                acc = [a0, a1, a2, a3, a4, a5, a6, a7];
            } else {
                // The last, partial chunk.
                pf.fetch(per);
                for (j, kt) in kt.iter().enumerate().take(pairs) {
                    // SAFETY: 512-bit vector of 32 bf16 lanes.
                    let kt: __m512bh = unsafe { std::mem::transmute::<__m512i, __m512bh>(*kt) };
                    for (t, acc) in acc.iter_mut().enumerate() {
                        // SAFETY: pair (x + 2j, x + 2j + 1) of row t0 + t lies inside its
                        // padded row (x + 2j < dq), which `qh` holds (caller).
                        let pair = unsafe { qp.add(((t0 + t) * dq + x) / 2 + j).read_unaligned() };
                        let qb = _mm512_set1_epi32(pair as i32);
                        // SAFETY: as above.
                        let qb: __m512bh = unsafe { std::mem::transmute::<__m512i, __m512bh>(qb) };
                        *acc = _mm512_dpbf16_ps(*acc, qb, kt);
                    }
                }
            }
            x += 2 * W;
        }
        for (t, acc) in acc.iter().enumerate() {
            // SAFETY: a score row holds 16 floats.
            unsafe { _mm512_storeu_ps(s[t0 + t].as_mut_ptr(), *acc) };
        }
        t0 += RB;
    }
}
