//! The AVX2 decode kernels: head-dim elements in lanes, 8 at a time, K and V rows read as
//! stored (f32, f16 through F16C, bf16 by a widening shift) and converted in registers.
//!
//! Both products work on register blocks of eight accumulators (`RB` query rows × `CB` keys or
//! head-dim chunks, `RB · CB = 8`), enough independent FMA chains to cover the FMA latency on
//! two units while leaving half of the sixteen ymm registers for the operands:
//!
//! * `q·k` ([`scores`]): each K chunk is loaded (and converted) once for the `RB` rows of the
//!   block; after the head dim, one horizontal-add tree turns the eight vectors into their
//!   eight dot products (9 shuffles and adds against 128 FMAs at d = 128).
//! * `P V` ([`pv`]): the output rows of the block stay in registers over the block's keys, each
//!   V chunk loaded and converted once per key for the `RB` rows; no reduction.
//!
//! With eight query rows or more per KV head a block is 8 rows × 1 chunk, so a 16-bit K or V
//! chunk is converted once per eight FMAs; f32 chunks need no conversion and take 4 × 2 (fewer
//! loads per FMA). A head dim that is not a multiple of 8 ends in a partial chunk: f32 through
//! `vmaskmovps`, 16-bit rows through a small copy; neither touches the elements past the row.

use std::arch::x86_64::*;

use super::super::{kind, Kind, Pf, Rows, BK};
use crate::cpu::elem::e4m3x8;

/// f32 lanes of a vector.
const W: usize = 8;

/// The `vmaskmovps` mask of the first `n < 8` lanes.
#[inline(always)]
fn tail_mask(n: usize) -> __m256i {
    const M: [i32; 2 * W] = [-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0];
    debug_assert!(n < W);
    // SAFETY: `W - n + W <= 2 W`, so the eight lanes read lie inside `M`.
    unsafe { _mm256_loadu_si256(M.as_ptr().add(W - n).cast()) }
}

/// Eight 16-bit values widened to f32: bf16 by a shift (a bf16 is the upper half of an f32;
/// NaN stays NaN), f16 through F16C.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn widen<T: 'static>(h: __m128i) -> __m256 {
    if kind::<T>() == Kind::F16 {
        _mm256_cvtph_ps(h)
    } else {
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
    }
}

/// Elements `p .. p + 8` of a row of `T` as f32.
///
/// # Safety
/// avx2, fma and f16c must be available; the eight elements must be readable.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn load<T: 'static>(p: *const T) -> __m256 {
    // SAFETY: eight elements are readable (caller).
    unsafe {
        match kind::<T>() {
            Kind::F32 => _mm256_loadu_ps(p.cast()),
            Kind::F16 | Kind::Bf16 => widen::<T>(_mm_loadu_si128(p.cast())),
            Kind::E4m3 => e4m3x8(_mm_loadl_epi64(p.cast())),
            // `Fused::reads` sends other types through the f32 conversion: never reached.
            Kind::Other => _mm256_setzero_ps(),
        }
    }
}

/// The first `n < 8` elements at `p` as f32, the other lanes 0 (and not read).
///
/// # Safety
/// avx2, fma and f16c must be available; the `n` elements must be readable.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn load_part<T: 'static>(p: *const T, n: usize) -> __m256 {
    // SAFETY (both arms): only the `n` readable elements are accessed (caller).
    unsafe {
        match kind::<T>() {
            Kind::F32 => _mm256_maskload_ps(p.cast(), tail_mask(n)),
            Kind::F16 | Kind::Bf16 => {
                let mut h = [0u16; W];
                std::ptr::copy_nonoverlapping(p.cast::<u16>(), h.as_mut_ptr(), n);
                widen::<T>(_mm_loadu_si128(h.as_ptr().cast()))
            }
            Kind::E4m3 => {
                let mut b = [0u8; W];
                std::ptr::copy_nonoverlapping(p.cast::<u8>(), b.as_mut_ptr(), n);
                e4m3x8(_mm_loadl_epi64(b.as_ptr().cast()))
            }
            Kind::Other => _mm256_setzero_ps(),
        }
    }
}

/// Lane `i` of the result is the sum of the lanes of `a[i]`: two levels of `vhaddps` leave, in
/// each 128-bit half, one partial sum per input of each group of four; the halves are added.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn reduce8(a: &[__m256; 8]) -> __m256 {
    let h0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    let h1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    _mm256_add_ps(
        _mm256_permute2f128_ps::<0x20>(h0, h1),
        _mm256_permute2f128_ps::<0x31>(h0, h1),
    )
}

/// Query rows of a register block of [`scores`] for `left` rows still to do.
#[inline(always)]
fn row_block(left: usize) -> usize {
    match left {
        0 | 1 => 1,
        2 | 3 => 2,
        4..=7 => 4,
        _ => 8,
    }
}

/// The query elements of `rows` rows in the layout [`scores`] reads: rows in the register
/// blocks it takes them in (8, then 4, 2, 1 as fewer are left), each block chunk by chunk
/// (chunk `j` of its `RB` rows: `RB × 8` consecutive floats), the head dim padded with zeros to
/// a multiple of 8. So a block's loads all go through one pointer, with the row in the
/// displacement, rather than a pointer per row (more than the free registers).
pub(super) fn packed_len(rows: usize, d: usize) -> usize {
    rows * d.next_multiple_of(W)
}

/// Packs `rows` rows of `d` (`d` apart in `q`) into `out` ([`packed_len`] elements), for K
/// rows of `T`: with bf16 rows, each whole group of 16 elements as its even elements, then its
/// odd ones, which is how [`load2`] widens them (two instructions for 16 elements).
pub(super) fn pack_q<T: 'static>(q: &[f32], rows: usize, d: usize, out: &mut [f32]) {
    let dp = d.next_multiple_of(W);
    let pairs = if kind::<T>() == Kind::Bf16 {
        d - d % (2 * W)
    } else {
        0
    };
    // The element of a row in lane `x` of chunk `j`, if any.
    let at = |j: usize, x: usize| {
        let e = j * W + x;
        if e < pairs {
            e - e % (2 * W) + 2 * x + j % 2
        } else {
            e
        }
    };
    let out = &mut out[..rows * dp];
    let mut t0 = 0;
    while t0 < rows {
        let rb = row_block(rows - t0);
        let blk = &mut out[t0 * dp..(t0 + rb) * dp];
        for (j, chunk) in blk.chunks_exact_mut(rb * W).enumerate() {
            for (t, lanes) in chunk.chunks_exact_mut(W).enumerate() {
                let row = &q[(t0 + t) * d..(t0 + t + 1) * d];
                for (x, o) in lanes.iter_mut().enumerate() {
                    *o = row.get(at(j, x)).copied().unwrap_or(0.0);
                }
            }
        }
        t0 += rb;
    }
}

/// Elements `p .. p + 16` of a row of `T` as two vectors: bf16 as its even elements then its
/// odd ones (a shift and a mask of one 256-bit load), other types in order.
///
/// # Safety
/// avx2, fma and f16c must be available; the sixteen elements must be readable.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn load2<T: 'static>(p: *const T) -> (__m256, __m256) {
    // SAFETY: sixteen elements are readable (caller).
    unsafe {
        if kind::<T>() == Kind::Bf16 {
            let raw = _mm256_loadu_si256(p.cast());
            (
                _mm256_castsi256_ps(_mm256_slli_epi32::<16>(raw)),
                _mm256_castsi256_ps(_mm256_and_si256(raw, _mm256_set1_epi32(-0x1_0000))),
            )
        } else {
            (load(p), load(p.wrapping_add(W)))
        }
    }
}

/// `s[t][c] = q[t] · K[c]` for `t < rows`, `c` in `keys`, with `q` the f32 query rows packed by
/// [`pack_q`] and K rows of `T` converted in registers. Prefetches the rows of `pf` a few at a
/// time on the way, between keys.
///
/// # Safety
/// avx2, fma and f16c must be available; `q` holds [`packed_len`]`(rows, d)` elements, `s`
/// `rows` rows; `keys` is not empty and ends at most at `BK`; every K row of `keys` has `d`
/// elements in bounds.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn scores<T: 'static>(
    q: &[f32],
    rows: usize,
    d: usize,
    k: &Rows<T>,
    keys: std::ops::Range<usize>,
    s: &mut [[f32; BK]],
    pf: &mut Pf,
) {
    // The prefetches spread over the keys of the first register block of rows.
    let per = pf.rows().div_ceil(keys.len());
    let dp = d.next_multiple_of(W);
    let mut t0 = 0;
    while t0 < rows {
        let qb = q[t0 * dp..].as_ptr();
        // SAFETY (each call): the block's rows exist, the rest as for this function.
        t0 += unsafe {
            match row_block(rows - t0) {
                1 => scores_rows::<T, 1, 8>(qb, rows - t0, t0, d, k, keys.clone(), s, pf, per),
                2 => scores_rows::<T, 2, 4>(qb, rows - t0, t0, d, k, keys.clone(), s, pf, per),
                4 => scores_rows::<T, 4, 2>(qb, rows - t0, t0, d, k, keys.clone(), s, pf, per),
                _ => scores_rows::<T, 8, 1>(qb, rows - t0, t0, d, k, keys.clone(), s, pf, per),
            }
        };
    }
    pf.fetch_all();
}

/// [`scores`] for the `RB` rows packed at `q` (rows `t0 ..` of `s`), `CB` keys per register
/// block; returns `RB`. Keys past `keys` repeat the last key; their results are dropped.
///
/// # Safety
/// As for [`scores`], with `RB` packed rows at `q` and `RB <= left`.
#[allow(clippy::too_many_arguments)]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn scores_rows<T: 'static, const RB: usize, const CB: usize>(
    q: *const f32,
    left: usize,
    t0: usize,
    d: usize,
    k: &Rows<T>,
    keys: std::ops::Range<usize>,
    s: &mut [[f32; BK]],
    pf: &mut Pf,
    per: usize,
) -> usize {
    const { assert!(RB * CB == 8, "reduce8 folds eight accumulators") };
    debug_assert!(RB <= left);
    let kp = k.src.as_ptr();
    let mut c0 = keys.start;
    while c0 < keys.end {
        pf.fetch(per * CB);
        let kr: [*const T; CB] =
            std::array::from_fn(|c| kp.wrapping_add(k.row((c0 + c).min(keys.end - 1))));
        let mut acc = [_mm256_setzero_ps(); 8];
        let mut qc = q;
        let mut x = 0;
        // Sixteen elements per step (two packed chunks), then at most one whole chunk.
        while x + 2 * W <= d {
            if CB <= 2 {
                // Both keys' halves fit in registers beside the accumulators: each query
                // chunk is loaded once for them.
                let mut kab = [(_mm256_setzero_ps(), _mm256_setzero_ps()); CB];
                for (kab, kr) in kab.iter_mut().zip(&kr) {
                    // SAFETY: elements `x .. x + 16 <= d` of a K row in bounds (caller).
                    *kab = unsafe { load2(kr.wrapping_add(x)) };
                }
                for t in 0..RB {
                    // SAFETY: chunks `x / 8` and `x / 8 + 1` of packed row t (caller).
                    let (qa, qb) = unsafe {
                        (
                            _mm256_loadu_ps(qc.add(t * W)),
                            _mm256_loadu_ps(qc.add((RB + t) * W)),
                        )
                    };
                    for (c, (ka, kb)) in kab.iter().enumerate() {
                        acc[t * CB + c] = _mm256_fmadd_ps(qa, *ka, acc[t * CB + c]);
                        acc[t * CB + c] = _mm256_fmadd_ps(qb, *kb, acc[t * CB + c]);
                    }
                }
                qc = qc.wrapping_add(2 * RB * W);
                x += 2 * W;
                continue;
            }
            for (c, kr) in kr.iter().enumerate() {
                // SAFETY: elements `x .. x + 16 <= d` of a K row in bounds (caller).
                let (ka, kb) = unsafe { load2(kr.wrapping_add(x)) };
                for t in 0..RB {
                    // SAFETY: chunks `x / 8` and `x / 8 + 1` of packed row t (caller).
                    let (qa, qb) = unsafe {
                        (
                            _mm256_loadu_ps(qc.add(t * W)),
                            _mm256_loadu_ps(qc.add((RB + t) * W)),
                        )
                    };
                    acc[t * CB + c] = _mm256_fmadd_ps(qa, ka, acc[t * CB + c]);
                    acc[t * CB + c] = _mm256_fmadd_ps(qb, kb, acc[t * CB + c]);
                }
            }
            qc = qc.wrapping_add(2 * RB * W);
            x += 2 * W;
        }
        if x + W <= d {
            let mut kv = [_mm256_setzero_ps(); CB];
            for (kv, kr) in kv.iter_mut().zip(&kr) {
                // SAFETY: elements `x .. x + 8 <= d` of a K row in bounds (caller).
                *kv = unsafe { load(kr.wrapping_add(x)) };
            }
            for t in 0..RB {
                // SAFETY: chunk `x / 8` of packed row t (caller).
                let qv = unsafe { _mm256_loadu_ps(qc.add(t * W)) };
                for (c, kv) in kv.iter().enumerate() {
                    acc[t * CB + c] = _mm256_fmadd_ps(qv, *kv, acc[t * CB + c]);
                }
            }
            qc = qc.wrapping_add(RB * W);
            x += W;
        }
        if x < d {
            let mut kv = [_mm256_setzero_ps(); CB];
            for (kv, kr) in kv.iter_mut().zip(&kr) {
                // SAFETY: the elements `x .. d` of a K row (caller).
                *kv = unsafe { load_part(kr.wrapping_add(x), d - x) };
            }
            for t in 0..RB {
                // SAFETY: the last (zero-padded) chunk of packed row t (caller).
                let qv = unsafe { _mm256_loadu_ps(qc.add(t * W)) };
                for (c, kv) in kv.iter().enumerate() {
                    acc[t * CB + c] = _mm256_fmadd_ps(qv, *kv, acc[t * CB + c]);
                }
            }
        }
        let mut out = [0f32; 8];
        // SAFETY: `out` holds eight floats.
        unsafe { _mm256_storeu_ps(out.as_mut_ptr(), reduce8(&acc)) };
        for t in 0..RB {
            for c in 0..CB.min(keys.end - c0) {
                s[t0 + t][c0 + c] = out[t * CB + c];
            }
        }
        c0 += CB;
    }
    RB
}

/// `o[t] = o[t] · corr[t] + Σ_c p[t][c] V[c]` for `t < rows` (no scaling without `corr`), `c`
/// in `cols`, with V rows of `T` converted in registers.
///
/// # Safety
/// avx2, fma and f16c must be available; `o` holds `rows` rows of `d`, `corr` (if any) and `p`
/// at least `rows` entries; `cols` ends at most at `BK`; every V row of `cols` has `d` elements
/// in bounds.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn pv<T: 'static>(
    o: &mut [f32],
    rows: usize,
    d: usize,
    corr: Option<&[f32]>,
    p: &[[f32; BK]],
    v: &Rows<T>,
    cols: std::ops::Range<usize>,
) {
    // f32 chunks need no conversion: 4 rows × 2 chunks load fewer vectors per FMA.
    let eight = kind::<T>() != Kind::F32;
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
                1 => pv_rows::<T, 1, 8>(op, d, cr, pr, v, cols.clone()),
                2 | 3 => pv_rows::<T, 2, 4>(op, d, cr, pr, v, cols.clone()),
                8.. if eight => pv_rows::<T, 8, 1>(op, d, cr, pr, v, cols.clone()),
                _ => pv_rows::<T, 4, 2>(op, d, cr, pr, v, cols.clone()),
            }
        };
    }
}

/// [`pv`] for `RB` rows, `CB` chunks of 8 head-dim elements per pass; returns `RB`.
///
/// # Safety
/// As for [`pv`], with `RB` rows at `o`, in `corr` and in `p`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn pv_rows<T: 'static, const RB: usize, const CB: usize>(
    o: *mut f32,
    d: usize,
    corr: Option<&[f32]>,
    p: &[[f32; BK]],
    v: &Rows<T>,
    cols: std::ops::Range<usize>,
) -> usize {
    // Raw addresses in the key loop: no bounds checks there (the caller checked them), which
    // also leaves the accumulators in place across iterations.
    let vp = v.src.as_ptr();
    let rows: [*const T; BK] = std::array::from_fn(|c| vp.wrapping_add(v.row(c)));
    let pp = p.as_ptr().cast::<f32>();
    let cr: [f32; RB] = std::array::from_fn(|t| corr.map_or(1.0, |c| c[t]));
    let scale = corr.is_some();
    let mut x0 = 0;
    // Whole passes: every chunk full, no masks in the key loop.
    while x0 + CB * W <= d {
        let mut acc = [[_mm256_setzero_ps(); CB]; RB];
        for (t, acc) in acc.iter_mut().enumerate() {
            for (j, acc) in acc.iter_mut().enumerate() {
                // SAFETY: elements `x0 + 8j .. + 8 <= d` of row t of `o` (caller).
                let x = unsafe { _mm256_loadu_ps(o.wrapping_add(t * d + x0 + j * W)) };
                *acc = if scale {
                    _mm256_mul_ps(x, _mm256_set1_ps(cr[t]))
                } else {
                    x
                };
            }
        }
        for c in cols.clone() {
            let row = rows[c].wrapping_add(x0);
            let mut vv = [_mm256_setzero_ps(); CB];
            for (j, vv) in vv.iter_mut().enumerate() {
                // SAFETY: elements `x0 + 8j .. + 8 <= d` of a V row in bounds (caller).
                *vv = unsafe { load(row.wrapping_add(j * W)) };
            }
            for (t, acc) in acc.iter_mut().enumerate() {
                // SAFETY: `p[t][c]`, t < RB rows and c < BK (caller).
                let pb = unsafe { _mm256_broadcast_ss(&*pp.add(t * BK + c)) };
                for (acc, vv) in acc.iter_mut().zip(&vv) {
                    *acc = _mm256_fmadd_ps(pb, *vv, *acc);
                }
            }
        }
        for (t, acc) in acc.iter().enumerate() {
            for (j, acc) in acc.iter().enumerate() {
                // SAFETY: as for the load.
                unsafe { _mm256_storeu_ps(o.wrapping_add(t * d + x0 + j * W), *acc) };
            }
        }
        x0 += CB * W;
    }
    // The rest, one chunk at a time, the last one possibly partial.
    while x0 < d {
        let n = W.min(d - x0);
        let m = if n == W {
            _mm256_set1_epi32(-1)
        } else {
            tail_mask(n)
        };
        let mut acc = [_mm256_setzero_ps(); RB];
        for (t, acc) in acc.iter_mut().enumerate() {
            // SAFETY: the elements `x0 .. x0 + n <= d` of row t of `o` (caller).
            let x = unsafe { _mm256_maskload_ps(o.wrapping_add(t * d + x0), m) };
            *acc = _mm256_mul_ps(x, _mm256_set1_ps(cr[t]));
        }
        for c in cols.clone() {
            let row = rows[c].wrapping_add(x0);
            // SAFETY: the elements `x0 .. x0 + n <= d` of a V row in bounds (caller).
            let vv = unsafe {
                if n == W {
                    load(row)
                } else {
                    load_part(row, n)
                }
            };
            for (t, acc) in acc.iter_mut().enumerate() {
                // SAFETY: as in the whole passes.
                let pb = unsafe { _mm256_broadcast_ss(&*pp.add(t * BK + c)) };
                *acc = _mm256_fmadd_ps(pb, vv, *acc);
            }
        }
        for (t, acc) in acc.iter().enumerate() {
            // SAFETY: as for the load.
            unsafe { _mm256_maskstore_ps(o.wrapping_add(t * d + x0), m, *acc) };
        }
        x0 += W;
    }
    RB
}

/// `2^x` lane-wise, the polynomial of `crate::cpu::exp2` in vector form: relative error below
/// 5e-7 on `[-126, 127]`, exactly 0 below about -126.5 (so `-inf` gives 0), NaN stays NaN.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn exp2v(x: __m256) -> __m256 {
    use crate::cpu::exp2::{C, SHIFT, SHIFT_BITS};
    // `max`/`min` return their second operand when either is NaN: NaN passes through.
    let x = _mm256_max_ps(_mm256_set1_ps(-127.0), x);
    let x = _mm256_min_ps(_mm256_set1_ps(127.0), x);
    let t = _mm256_add_ps(x, _mm256_set1_ps(SHIFT));
    let n = _mm256_sub_epi32(_mm256_castps_si256(t), _mm256_set1_epi32(SHIFT_BITS));
    let f = _mm256_sub_ps(x, _mm256_sub_ps(t, _mm256_set1_ps(SHIFT)));
    let mut p = _mm256_set1_ps(C[6]);
    for &c in C[..6].iter().rev() {
        p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(c));
    }
    // 2^n from its exponent bits; n = -127 gives +0.0.
    let scale = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(
        n,
        _mm256_set1_epi32(127),
    )));
    _mm256_mul_ps(p, scale)
}

/// Lane `i` of the result is the `op`-reduction of the lanes of `a[i]`: pairs within 128-bit
/// halves (two levels of interleaves), then the two halves.
#[inline]
#[target_feature(enable = "avx2")]
fn reduce8_by(a: &[__m256; 8], op: impl Fn(__m256, __m256) -> __m256) -> __m256 {
    // t[k], each half: [x0 op x2, y0 op y2, x1 op x3, y1 op y3] of (x, y) = (a[2k], a[2k+1]).
    let t: [__m256; 4] = std::array::from_fn(|k| {
        let (x, y) = (a[2 * k], a[2 * k + 1]);
        op(_mm256_unpacklo_ps(x, y), _mm256_unpackhi_ps(x, y))
    });
    // u[m], each half: that half of a[4m], a[4m+1], a[4m+2], a[4m+3] reduced.
    let u: [__m256; 2] = std::array::from_fn(|m| {
        let (x, y) = (t[2 * m], t[2 * m + 1]);
        op(
            _mm256_shuffle_ps::<0x44>(x, y),
            _mm256_shuffle_ps::<0xEE>(x, y),
        )
    });
    op(
        _mm256_permute2f128_ps::<0x20>(u[0], u[1]),
        _mm256_permute2f128_ps::<0x31>(u[0], u[1]),
    )
}

/// The online softmax of every row of a block, 8 rows at a time with the row statistics in
/// lanes: `s[r]` (raw scores; lanes outside `cols[r]` ignored) becomes `p = 2^(scale·s - m_new)`
/// (0 outside `cols[r]`), with `m_new = max(m[r], max_c scale·s)` (NaN skipped by the max yet
/// kept in `p`), `l[r] = l[r] · corr[r] + Σ p` and `corr[r] = 2^(m[r] - m_new)`; a row that has
/// seen no key subtracts 0, so its `p` and correction are 0, never NaN.
///
/// # Safety
/// avx2 and fma must be available; `cols`, `m`, `l` and `corr` hold at least `s.len()`
/// entries and every `cols[r]` ends at most at `BK`.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn softmax_rows(
    s: &mut [[f32; BK]],
    cols: &[(usize, usize)],
    scale: f32,
    m: &mut [f32],
    l: &mut [f32],
    corr: &mut [f32],
) {
    const { assert!(BK == 2 * W, "a score row is two vectors") };
    let ninf = _mm256_set1_ps(f32::NEG_INFINITY);
    let sc = _mm256_set1_ps(scale);
    let lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    let mut r0 = 0;
    while r0 < s.len() {
        let nr = W.min(s.len() - r0);
        let mut stat = [[f32::NEG_INFINITY; W], [0f32; W]];
        stat[0][..nr].copy_from_slice(&m[r0..r0 + nr]);
        stat[1][..nr].copy_from_slice(&l[r0..r0 + nr]);
        // Scaled scores, -inf outside the visible columns (stored back), and the same with NaN
        // as -inf for the max; rows past `nr` are -inf.
        let mut xm = [ninf; W];
        for (t, xm) in xm.iter_mut().enumerate().take(nr) {
            let (c0, c1) = cols[r0 + t];
            let (c0, c1) = (_mm256_set1_epi32(c0 as i32), _mm256_set1_epi32(c1 as i32));
            let row = s[r0 + t].as_mut_ptr();
            let mut h = [ninf; 2];
            for (j, h) in h.iter_mut().enumerate() {
                let c = _mm256_add_epi32(lane, _mm256_set1_epi32((j * W) as i32));
                // c0 <= c < c1.
                let vis = _mm256_andnot_si256(_mm256_cmpgt_epi32(c0, c), _mm256_cmpgt_epi32(c1, c));
                // SAFETY: a score row holds 16 floats.
                let x = unsafe { _mm256_mul_ps(_mm256_loadu_ps(row.add(j * W)), sc) };
                let x = _mm256_blendv_ps(ninf, x, _mm256_castsi256_ps(vis));
                // SAFETY: as above.
                unsafe { _mm256_storeu_ps(row.add(j * W), x) };
                *h = _mm256_blendv_ps(ninf, x, _mm256_cmp_ps::<_CMP_ORD_Q>(x, x));
            }
            *xm = _mm256_max_ps(h[0], h[1]);
        }
        let bm = reduce8_by(&xm, |a, b| _mm256_max_ps(a, b));
        // SAFETY: `stat` holds two rows of eight floats.
        let (mv, lv) = unsafe {
            (
                _mm256_loadu_ps(stat[0].as_ptr()),
                _mm256_loadu_ps(stat[1].as_ptr()),
            )
        };
        let m_new = _mm256_max_ps(mv, bm);
        let m_sub = _mm256_blendv_ps(
            m_new,
            _mm256_setzero_ps(),
            _mm256_cmp_ps::<_CMP_EQ_OQ>(m_new, ninf),
        );
        let cr = exp2v(_mm256_sub_ps(mv, m_sub));
        let mut subs = [0f32; W];
        // SAFETY: `subs` holds eight floats.
        unsafe { _mm256_storeu_ps(subs.as_mut_ptr(), m_sub) };
        let mut ps = [_mm256_setzero_ps(); W];
        for (t, ps) in ps.iter_mut().enumerate().take(nr) {
            let row = s[r0 + t].as_mut_ptr();
            let sub = _mm256_set1_ps(subs[t]);
            let mut h = [_mm256_setzero_ps(); 2];
            for (j, h) in h.iter_mut().enumerate() {
                // SAFETY: a score row holds 16 floats.
                *h = exp2v(_mm256_sub_ps(
                    unsafe { _mm256_loadu_ps(row.add(j * W)) },
                    sub,
                ));
                // SAFETY: as above.
                unsafe { _mm256_storeu_ps(row.add(j * W), *h) };
            }
            *ps = _mm256_add_ps(h[0], h[1]);
        }
        let sum = reduce8_by(&ps, |a, b| _mm256_add_ps(a, b));
        let mut out = [[0f32; W]; 3];
        // SAFETY: `out` holds three rows of eight floats.
        unsafe {
            _mm256_storeu_ps(out[0].as_mut_ptr(), m_new);
            _mm256_storeu_ps(out[1].as_mut_ptr(), _mm256_fmadd_ps(lv, cr, sum));
            _mm256_storeu_ps(out[2].as_mut_ptr(), cr);
        }
        m[r0..r0 + nr].copy_from_slice(&out[0][..nr]);
        l[r0..r0 + nr].copy_from_slice(&out[1][..nr]);
        corr[r0..r0 + nr].copy_from_slice(&out[2][..nr]);
        r0 += W;
    }
}
