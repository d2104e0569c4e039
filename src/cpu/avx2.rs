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

/// A stored bias element that [`add_rows_to_lanes`] widens to f32 eight at a time.
pub(super) trait Widen: Copy {
    /// Elements `p .. p + 8` as f32.
    ///
    /// # Safety
    /// avx2 and f16c must be available; the eight elements must be readable.
    unsafe fn load8(p: *const Self) -> __m256;
}

impl Widen for f32 {
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn load8(p: *const Self) -> __m256 {
        // SAFETY: eight elements are readable (caller).
        unsafe { _mm256_loadu_ps(p) }
    }
}

impl Widen for half::bf16 {
    /// A bf16 is the upper half of an f32: a widening shift (NaN stays NaN).
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn load8(p: *const Self) -> __m256 {
        // SAFETY: eight 2-byte elements are readable (caller).
        let h = unsafe { _mm_loadu_si128(p.cast()) };
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
    }
}

impl Widen for half::f16 {
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn load8(p: *const Self) -> __m256 {
        // SAFETY: eight 2-byte elements are readable (caller).
        _mm256_cvtph_ps(unsafe { _mm_loadu_si128(p.cast()) })
    }
}

/// `s[c].0[r] += unit · d[r · si + c]` for `r < rows`, `c < cols` (both multiples of 8): a
/// bias block stored row by row added to scores that hold rows in lanes, an 8 × 8 block at a
/// time transposed in registers (24 shuffles per 64 values, where a transposed copy took a
/// scalar load and store per value). The sum is rounded as the scalar `x + b · unit` is, so the
/// bits do not depend on the path. Each group of 8 rows asks for the next group's values into
/// L1 before it starts; the whole block was asked for into L2 before the tile's `Q Kᵀ` (see
/// `ExtrasAt::prefetch`).
///
/// # Safety
/// avx2 and f16c must be available, `s.len() >= cols`, `rows <= BR`, and when `rows > 0` and
/// `cols > 0`, `(rows - 1) · si + cols <= d.len()`.
#[target_feature(enable = "avx2,f16c")]
pub(super) unsafe fn add_rows_to_lanes<T: Widen>(
    d: &[T],
    si: usize,
    s: &mut [Lanes],
    rows: usize,
    cols: usize,
    unit: f32,
) {
    debug_assert!(rows.is_multiple_of(8) && cols.is_multiple_of(8) && rows <= BR);
    let unit = _mm256_set1_ps(unit);
    let line = (64 / std::mem::size_of::<T>()).max(1);
    let p = d.as_ptr();
    for r in (0..rows).step_by(8) {
        for i in r + 8..(r + 16).min(rows) {
            for x in (i * si..i * si + cols).step_by(line) {
                // SAFETY: row `i < rows` holds elements `0 .. cols` inside `d` (caller); a
                // prefetch reads nothing.
                unsafe { _mm_prefetch::<_MM_HINT_T0>(p.add(x).cast()) };
            }
        }
        for c in (0..cols).step_by(8) {
            let mut v = [_mm256_setzero_ps(); 8];
            for (i, v) in v.iter_mut().enumerate() {
                // SAFETY: row `r + i < rows` holds elements `c .. c + 8 <= cols` inside `d`
                // (caller).
                *v = unsafe { T::load8(p.add((r + i) * si + c)) };
            }
            // Rows (i, i + 1) interleaved, then groups of four, then the 128-bit halves:
            // vector `k` of `t` is column `c + k`.
            let t0 = _mm256_unpacklo_ps(v[0], v[1]);
            let t1 = _mm256_unpackhi_ps(v[0], v[1]);
            let t2 = _mm256_unpacklo_ps(v[2], v[3]);
            let t3 = _mm256_unpackhi_ps(v[2], v[3]);
            let t4 = _mm256_unpacklo_ps(v[4], v[5]);
            let t5 = _mm256_unpackhi_ps(v[4], v[5]);
            let t6 = _mm256_unpacklo_ps(v[6], v[7]);
            let t7 = _mm256_unpackhi_ps(v[6], v[7]);
            let u0 = _mm256_shuffle_ps::<0x44>(t0, t2);
            let u1 = _mm256_shuffle_ps::<0xEE>(t0, t2);
            let u2 = _mm256_shuffle_ps::<0x44>(t1, t3);
            let u3 = _mm256_shuffle_ps::<0xEE>(t1, t3);
            let u4 = _mm256_shuffle_ps::<0x44>(t4, t6);
            let u5 = _mm256_shuffle_ps::<0xEE>(t4, t6);
            let u6 = _mm256_shuffle_ps::<0x44>(t5, t7);
            let u7 = _mm256_shuffle_ps::<0xEE>(t5, t7);
            let t = [
                _mm256_permute2f128_ps::<0x20>(u0, u4),
                _mm256_permute2f128_ps::<0x20>(u1, u5),
                _mm256_permute2f128_ps::<0x20>(u2, u6),
                _mm256_permute2f128_ps::<0x20>(u3, u7),
                _mm256_permute2f128_ps::<0x31>(u0, u4),
                _mm256_permute2f128_ps::<0x31>(u1, u5),
                _mm256_permute2f128_ps::<0x31>(u2, u6),
                _mm256_permute2f128_ps::<0x31>(u3, u7),
            ];
            for (s, b) in s[c..c + 8].iter_mut().zip(t) {
                // SAFETY: `Lanes` holds BR floats and `r + 8 <= rows <= BR`.
                unsafe {
                    let x = s.0.as_mut_ptr().add(r);
                    _mm256_storeu_ps(x, _mm256_add_ps(_mm256_loadu_ps(x), _mm256_mul_ps(b, unit)));
                }
            }
        }
    }
}
