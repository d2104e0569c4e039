//! The x86 decode kernels behind [`Ops`]: head-dim elements in SIMD lanes, 16 at a time with
//! AVX-512 and 8 with AVX2, four query rows sharing every K and V load. The bounds the unsafe
//! kernels rely on are checked here, once per block.

mod avx2;
mod avx512;

use super::{Ops, Rows, BK, NR};
use crate::cpu::kernel::{Avx512, Fused};

/// `q[t] · K[c]` for `c` in `cols`, one `dot4` per key.
#[inline(always)]
fn scores(
    q: [&[f32]; NR],
    k: &Rows,
    cols: std::ops::Range<usize>,
    s: &mut [[f32; BK]; NR],
    dot4: impl Fn([&[f32]; NR], &[f32]) -> [f32; NR],
) {
    let d = q[0].len();
    assert!(q.iter().all(|q| q.len() == d) && cols.end <= BK);
    for c in cols {
        let dots = dot4(q, &k.src[k.off[c]..k.off[c] + d]);
        for (s, x) in s.iter_mut().zip(dots) {
            s[c] = x;
        }
    }
}

/// The checks of [`Ops::pv`]'s kernels: returns the head dim after asserting that `o` holds
/// `nr <= NR` rows of it and that every V row of `cols` is in bounds.
#[inline(always)]
fn pv_head_dim(o: &[f32], nr: usize, v: &Rows, cols: &std::ops::Range<usize>) -> usize {
    let d = o.len() / nr.max(1);
    assert!(nr <= NR && o.len() == nr * d && cols.end <= BK);
    for c in cols.clone() {
        assert!(v.off[c] + d <= v.src.len());
    }
    d
}

impl Ops for Avx512 {
    #[inline(always)]
    fn scores(q: [&[f32]; NR], k: &Rows, cols: std::ops::Range<usize>, s: &mut [[f32; BK]; NR]) {
        // SAFETY: only reached through `item_avx512`, i.e. with avx512f detected; every row
        // has `d` elements (checked by `scores` and by the slice).
        scores(q, k, cols, s, |q, k| unsafe { avx512::dot4(q, k) })
    }
    #[inline(always)]
    fn pv(
        o: &mut [f32],
        nr: usize,
        corr: &[f32; NR],
        s: &[[f32; BK]; NR],
        v: &Rows,
        cols: std::ops::Range<usize>,
    ) {
        let d = pv_head_dim(o, nr, v, &cols);
        // SAFETY: avx512f detected as above; the bounds were checked by `pv_head_dim`.
        unsafe { avx512::pv(o, nr, d, corr, s, v, cols) }
    }
}

impl Ops for Fused {
    #[inline(always)]
    fn scores(q: [&[f32]; NR], k: &Rows, cols: std::ops::Range<usize>, s: &mut [[f32; BK]; NR]) {
        // SAFETY: only reached through `item_avx2`, i.e. with avx2 and fma detected; every row
        // has `d` elements (checked by `scores` and by the slice).
        scores(q, k, cols, s, |q, k| unsafe { avx2::dot4(q, k) })
    }
    #[inline(always)]
    fn pv(
        o: &mut [f32],
        nr: usize,
        corr: &[f32; NR],
        s: &[[f32; BK]; NR],
        v: &Rows,
        cols: std::ops::Range<usize>,
    ) {
        let d = pv_head_dim(o, nr, v, &cols);
        // SAFETY: avx2 and fma detected as above; the bounds were checked by `pv_head_dim`.
        unsafe { avx2::pv(o, nr, d, corr, s, v, cols) }
    }
}
