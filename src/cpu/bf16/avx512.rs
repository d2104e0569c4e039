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
