//! The AVX-512 kernels: head-dim elements in lanes, 16 at a time; head dims that are not a
//! multiple of 16 end in a masked load, which never touches the masked-out elements.

use super::super::{Rows, BK, NR};
use std::arch::x86_64::*;

const W: usize = 16;

/// The lanes `x..x + 16` that exist below `d`.
#[inline(always)]
fn mask(x: usize, d: usize) -> __mmask16 {
    if x + W <= d {
        !0
    } else {
        (1u16 << (d - x)) - 1
    }
}

/// `q[t] · k` for the four rows: one load of each K chunk serves all of them, and the four
/// horizontal sums share one shuffle tree.
///
/// # Safety
/// avx512f must be available; every `q[t]` and `k` have the same length.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn dot4(q: [&[f32]; NR], k: &[f32]) -> [f32; NR] {
    let d = k.len();
    let mut acc = [_mm512_setzero_ps(); NR];
    let mut x = 0;
    while x < d {
        let m = mask(x, d);
        // SAFETY: lanes at or past `d` are masked off; the rest are inside every row.
        unsafe {
            let kv = _mm512_maskz_loadu_ps(m, k.as_ptr().add(x));
            for (acc, q) in acc.iter_mut().zip(&q) {
                *acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, q.as_ptr().add(x)), kv, *acc);
            }
        }
        x += W;
    }
    // Pairwise sums within each 128-bit lane: [a0 a1 a2 a3] per lane, then across lanes.
    let a01 = _mm512_add_ps(
        _mm512_unpacklo_ps(acc[0], acc[1]),
        _mm512_unpackhi_ps(acc[0], acc[1]),
    );
    let a23 = _mm512_add_ps(
        _mm512_unpacklo_ps(acc[2], acc[3]),
        _mm512_unpackhi_ps(acc[2], acc[3]),
    );
    let t = _mm512_add_ps(
        _mm512_shuffle_ps::<0x44>(a01, a23),
        _mm512_shuffle_ps::<0xEE>(a01, a23),
    );
    let t = _mm512_add_ps(t, _mm512_shuffle_f32x4::<0b01_00_11_10>(t, t));
    let t = _mm512_add_ps(t, _mm512_shuffle_f32x4::<0b10_11_00_01>(t, t));
    let mut out = [0f32; NR];
    // SAFETY: `out` holds four floats.
    unsafe { _mm_storeu_ps(out.as_mut_ptr(), _mm512_castps512_ps128(t)) };
    out
}

/// `o[t] = o[t] · corr[t] + Σ_c s[t][c] V[c]` for the first `nr` rows, 16 head dims at a
/// time: each V chunk is loaded once for all rows.
///
/// # Safety
/// avx512f must be available; `o` holds `nr <= NR` rows of `d`; every V row of `cols` has
/// `d` elements in bounds.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn pv(
    o: &mut [f32],
    nr: usize,
    d: usize,
    corr: &[f32; NR],
    s: &[[f32; BK]; NR],
    v: &Rows,
    cols: std::ops::Range<usize>,
) {
    let op = o.as_mut_ptr();
    let vp = v.src.as_ptr();
    let mut x = 0;
    while x < d {
        let m = mask(x, d);
        let mut acc = [_mm512_setzero_ps(); NR];
        for (t, acc) in acc.iter_mut().enumerate().take(nr) {
            // SAFETY: row t < nr of `o`, lanes below `d`.
            let ot = unsafe { _mm512_maskz_loadu_ps(m, op.add(t * d + x)) };
            *acc = _mm512_mul_ps(ot, _mm512_set1_ps(corr[t]));
        }
        for c in cols.clone() {
            // SAFETY: the V row of key c is in bounds (caller), lanes below `d`.
            let vv = unsafe { _mm512_maskz_loadu_ps(m, vp.add(v.off[c] + x)) };
            for (acc, s) in acc.iter_mut().zip(s) {
                *acc = _mm512_fmadd_ps(_mm512_set1_ps(s[c]), vv, *acc);
            }
        }
        for (t, acc) in acc.iter().enumerate().take(nr) {
            // SAFETY: as for the load.
            unsafe { _mm512_mask_storeu_ps(op.add(t * d + x), m, *acc) };
        }
        x += W;
    }
}
