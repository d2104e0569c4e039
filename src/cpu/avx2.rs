//! The AVX2 micro-kernel (x86_64 only; used after run-time detection of avx2 and fma).

use super::{Lanes, BR};
use std::arch::x86_64::*;

/// Lanes per pass: a tile's 64 lanes go through in two halves of four ymm vectors, so that
/// `R = 2` rows keep 8 accumulators, the 4 vectors of `b[t]` and a broadcast in the 16 ymm
/// registers.
const H: usize = 32;
const V: usize = H / 8;
const _: () = assert!(BR.is_multiple_of(H));

/// [`super::kernel::Kernel::block`] register-blocked: per step `t` it loads the `V` vectors of
/// one half of `b[t]` once and broadcasts one value of `a` per row. The same operations in the
/// same order per lane as the portable loop (`o · init`, then one FMA per `t`), so the same
/// bits.
///
/// # Safety
/// avx2 and fma must be available, `out.len() == R`, `b.len() >= n`, and
/// `(R - 1) * a_is + (n - 1) * a_ts < a.len()` when `n > 0`.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn block<const R: usize>(
    out: &mut [Lanes],
    init: Option<&Lanes>,
    a: &[f32],
    a_is: usize,
    a_ts: usize,
    b: &[Lanes],
    n: usize,
) {
    let a = a.as_ptr();
    for off in (0..BR).step_by(H) {
        let mut acc = [[_mm256_setzero_ps(); V]; R];
        if let Some(c) = init {
            for (i, acc) in acc.iter_mut().enumerate() {
                for (v, acc) in acc.iter_mut().enumerate() {
                    // SAFETY: `Lanes` holds BR floats; `off + 8 v + 8 <= BR`.
                    unsafe {
                        let o = _mm256_loadu_ps(out[i].0.as_ptr().add(off + 8 * v));
                        let c = _mm256_loadu_ps(c.0.as_ptr().add(off + 8 * v));
                        *acc = _mm256_mul_ps(o, c);
                    }
                }
            }
        }
        for (t, bt) in b[..n].iter().enumerate() {
            let bt = bt.0.as_ptr();
            // SAFETY: as above, for `b[t]`.
            let bv: [__m256; V] =
                std::array::from_fn(|v| unsafe { _mm256_loadu_ps(bt.add(off + 8 * v)) });
            for (i, acc) in acc.iter_mut().enumerate() {
                // SAFETY: `i * a_is + t * a_ts <= (R - 1) * a_is + (n - 1) * a_ts < a.len()`.
                let s = _mm256_set1_ps(unsafe { *a.add(i * a_is + t * a_ts) });
                for (acc, &bv) in acc.iter_mut().zip(&bv) {
                    *acc = _mm256_fmadd_ps(s, bv, *acc);
                }
            }
        }
        for (o, acc) in out.iter_mut().zip(&acc) {
            for (v, &acc) in acc.iter().enumerate() {
                // SAFETY: as above, for the output row.
                unsafe { _mm256_storeu_ps(o.0.as_mut_ptr().add(off + 8 * v), acc) };
            }
        }
    }
}
