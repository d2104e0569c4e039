//! AVX-512 versions of the micro-kernels (x86_64 only; used after run-time detection).

use super::{Lanes, BR};
use std::arch::x86_64::*;

const V: usize = BR / 16;

/// [`super::kernel::Kernel::max_rows`] with the running max in registers (the portable loop keeps it
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

/// The register-blocked micro-kernel behind [`super::kernel::Kernel::block`]: per step `t` it loads
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
        let bv: [__m512; V] = std::array::from_fn(|v| unsafe { _mm512_load_ps(bt.add(16 * v)) });
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
