//! The AVX2 kernels: head-dim elements in lanes, 8 at a time, two chunks per pass so that
//! eight independent FMA chains (four rows × two chunks) cover the FMA latency on two units.
//! A head dim that is not a multiple of 8 ends in a masked load (`vmaskmovps`), which never
//! touches the masked-out elements.

use super::super::{Rows, BK, NR};
use std::arch::x86_64::*;

const W: usize = 8;
const _: () = assert!(NR == 4, "the horizontal sums below fold exactly four rows");

/// The `vmaskmovps` mask of the first `n < 8` lanes.
#[inline(always)]
fn tail_mask(n: usize) -> __m256i {
    const M: [i32; 2 * W] = [-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0];
    debug_assert!(n < W);
    // SAFETY: `W - n + W <= 2 W`, so the eight lanes read lie inside `M`.
    unsafe { _mm256_loadu_si256(M.as_ptr().add(W - n).cast()) }
}

/// `q[t] · k` for the four rows: each K chunk is loaded once for all of them, two partial sums
/// per row, then one shared horizontal-add tree.
///
/// # Safety
/// avx2 and fma must be available; every `q[t]` and `k` have the same length.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn dot4(q: [&[f32]; NR], k: &[f32]) -> [f32; NR] {
    let d = k.len();
    let kp = k.as_ptr();
    let qp = q.map(|q| q.as_ptr());
    let mut a = [_mm256_setzero_ps(); NR];
    let mut b = [_mm256_setzero_ps(); NR];
    let mut x = 0;
    // SAFETY (every load below): lanes `x .. x + 2W` (or `x + W`) lie below `d`, inside `k`
    // and every `q[t]`; the tail's masked lanes are not accessed.
    unsafe {
        while x + 2 * W <= d {
            let (k0, k1) = (_mm256_loadu_ps(kp.add(x)), _mm256_loadu_ps(kp.add(x + W)));
            for t in 0..NR {
                a[t] = _mm256_fmadd_ps(_mm256_loadu_ps(qp[t].add(x)), k0, a[t]);
                b[t] = _mm256_fmadd_ps(_mm256_loadu_ps(qp[t].add(x + W)), k1, b[t]);
            }
            x += 2 * W;
        }
        if x + W <= d {
            let k0 = _mm256_loadu_ps(kp.add(x));
            for t in 0..NR {
                a[t] = _mm256_fmadd_ps(_mm256_loadu_ps(qp[t].add(x)), k0, a[t]);
            }
            x += W;
        }
        if x < d {
            let m = tail_mask(d - x);
            let k0 = _mm256_maskload_ps(kp.add(x), m);
            for t in 0..NR {
                b[t] = _mm256_fmadd_ps(_mm256_maskload_ps(qp[t].add(x), m), k0, b[t]);
            }
        }
    }
    let s: [__m256; NR] = std::array::from_fn(|t| _mm256_add_ps(a[t], b[t]));
    // hadd(s0, s1) = [s0 01, s0 23, s1 01, s1 23 | s0 45, s0 67, s1 45, s1 67], and so on: after
    // two levels each 128-bit half holds one partial sum per row; the halves are then added.
    let h = _mm256_hadd_ps(_mm256_hadd_ps(s[0], s[1]), _mm256_hadd_ps(s[2], s[3]));
    let r = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps::<1>(h));
    let mut out = [0f32; NR];
    // SAFETY: `out` holds four floats.
    unsafe { _mm_storeu_ps(out.as_mut_ptr(), r) };
    out
}

/// `o[t] = o[t] · corr[t] + Σ_c s[t][c] V[c]` for the first `nr` rows, two chunks of 8 head
/// dims per pass: each V chunk is loaded once for all rows.
///
/// # Safety
/// avx2 and fma must be available; `o` holds `nr <= NR` rows of `d`, `corr` and `s` at least
/// `nr` entries; every V row of `cols` has `d` elements in bounds.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn pv(
    o: &mut [f32],
    nr: usize,
    d: usize,
    corr: &[f32],
    s: &[[f32; BK]],
    v: &Rows<f32>,
    cols: std::ops::Range<usize>,
) {
    let op = o.as_mut_ptr();
    let vp = v.src.as_ptr();
    let mut x = 0;
    // SAFETY (every access below): rows `t < nr` of `o` and the V rows of `cols` hold `d`
    // elements (caller), and lanes `x .. x + 2W` lie below `d`.
    unsafe {
        while x + 2 * W <= d {
            let mut acc = [[_mm256_setzero_ps(); 2]; NR];
            for (t, acc) in acc.iter_mut().enumerate().take(nr) {
                let c = _mm256_set1_ps(corr[t]);
                acc[0] = _mm256_mul_ps(_mm256_loadu_ps(op.add(t * d + x)), c);
                acc[1] = _mm256_mul_ps(_mm256_loadu_ps(op.add(t * d + x + W)), c);
            }
            for c in cols.clone() {
                let v0 = _mm256_loadu_ps(vp.add(v.row(c) + x));
                let v1 = _mm256_loadu_ps(vp.add(v.row(c) + x + W));
                for (acc, s) in acc.iter_mut().zip(s) {
                    let p = _mm256_set1_ps(s[c]);
                    acc[0] = _mm256_fmadd_ps(p, v0, acc[0]);
                    acc[1] = _mm256_fmadd_ps(p, v1, acc[1]);
                }
            }
            for (t, acc) in acc.iter().enumerate().take(nr) {
                _mm256_storeu_ps(op.add(t * d + x), acc[0]);
                _mm256_storeu_ps(op.add(t * d + x + W), acc[1]);
            }
            x += 2 * W;
        }
        // At most two more chunks, the last one possibly partial.
        while x < d {
            let m = if x + W <= d {
                _mm256_set1_epi32(-1)
            } else {
                tail_mask(d - x)
            };
            let mut acc = [_mm256_setzero_ps(); NR];
            for (t, acc) in acc.iter_mut().enumerate().take(nr) {
                let ot = _mm256_maskload_ps(op.add(t * d + x), m);
                *acc = _mm256_mul_ps(ot, _mm256_set1_ps(corr[t]));
            }
            for c in cols.clone() {
                let vv = _mm256_maskload_ps(vp.add(v.row(c) + x), m);
                for (acc, s) in acc.iter_mut().zip(s) {
                    *acc = _mm256_fmadd_ps(_mm256_set1_ps(s[c]), vv, *acc);
                }
            }
            for (t, acc) in acc.iter().enumerate().take(nr) {
                _mm256_maskstore_ps(op.add(t * d + x), m, *acc);
            }
            x += W;
        }
    }
}
