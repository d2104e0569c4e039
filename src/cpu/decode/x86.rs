//! The x86 decode kernels behind [`Ops`]: head-dim elements in SIMD lanes, 16 at a time with
//! AVX-512 and 8 with AVX2, several query rows sharing every K and V load. The bounds the
//! unsafe kernels rely on are checked here, once per block and KV head.

mod avx2;
mod avx512;

use super::{as_f32, kind, portable_pv, portable_scores, Kind, Ops, Pf, Rows, BK, NR};
use crate::cpu::elem::Elem;
use crate::cpu::kernel::{Avx512, Fused};

/// Checks what the unsafe kernels rely on: keys inside the block, whose rows of `d` elements lie
/// inside `r.src`.
#[inline(always)]
fn check_rows<T>(r: &Rows<T>, keys: &std::ops::Range<usize>, d: usize) {
    assert!(keys.end <= BK, "decode: a block holds at most BK keys");
    for c in keys.clone() {
        assert!(
            r.off[c]
                .checked_add(r.shift)
                .and_then(|o| o.checked_add(d))
                .is_some_and(|e| e <= r.src.len()),
            "decode: K/V row out of bounds"
        );
    }
}

/// Checks the query side of [`Ops::scores`]: `rows` rows of `d` in `q` and a score row each.
#[inline(always)]
fn check_scores(q: usize, rows: usize, d: usize, s: usize) {
    assert!(
        rows.checked_mul(d).is_some_and(|n| q >= n) && s >= rows,
        "decode: query rows out of bounds"
    );
}

/// Checks the output side of [`Ops::pv`]: `rows` rows of `d` in `o`, a correction and a
/// probability row each, and columns inside the block.
#[inline(always)]
fn check_pv(
    o: usize,
    rows: usize,
    d: usize,
    corr: Option<usize>,
    p: usize,
    cols: &std::ops::Range<usize>,
) {
    assert!(
        rows.checked_mul(d).is_some_and(|n| o >= n)
            && corr.is_none_or(|c| c >= rows)
            && p >= rows
            && cols.end <= BK,
        "decode: output rows out of bounds"
    );
}

impl Ops for Avx512 {
    #[inline(always)]
    fn reads<T: 'static>() -> bool {
        kind::<T>() != Kind::Other
    }

    #[inline(always)]
    fn softmax_rows(
        s: &mut [[f32; BK]],
        cols: &[(usize, usize)],
        scale: f32,
        m: &mut [f32],
        l: &mut [f32],
        corr: &mut [f32],
    ) {
        let n = s.len();
        assert!(
            cols.len() >= n
                && m.len() >= n
                && l.len() >= n
                && corr.len() >= n
                && cols[..n].iter().all(|&(c0, c1)| c0 <= c1 && c1 <= BK),
            "decode: softmax rows out of bounds"
        );
        // SAFETY: avx512f/bw/vl detected as for the products; the bounds were checked above.
        unsafe { avx512::softmax_rows(s, cols, scale, m, l, corr) }
    }

    #[inline(always)]
    fn scores<T: Elem>(
        dot: bool,
        q: &[f32],
        qh: &[u16],
        rows: usize,
        d: usize,
        k: &Rows<T>,
        keys: std::ops::Range<usize>,
        s: &mut [[f32; BK]],
        pf: &mut Pf,
    ) {
        if rows == 0 || keys.is_empty() {
            return pf.fetch_all();
        }
        check_rows(k, &keys, d);
        if dot && kind::<T>() == Kind::Bf16 {
            check_scores(q.len(), rows, d, s.len());
            let dq = d.next_multiple_of(2);
            assert!(qh.len() >= rows * dq, "decode: query rows out of bounds");
            // Groups of eight rows against the transposed block, the rest (fewer than eight)
            // four at a time.
            let r8 = rows / 8 * 8;
            // SAFETY (both calls): `dot` is only set where avx512bf16 (with avx512f/bw/vl) was
            // detected (`forward_with`); `T` is bf16; the bounds were checked just above.
            unsafe {
                if r8 > 0 {
                    avx512::scores_bf16_t8(qh, r8, d, k, keys.clone(), s, pf);
                }
                if r8 < rows {
                    avx512::scores_bf16(&qh[r8 * dq..], rows - r8, d, k, keys, &mut s[r8..], pf);
                }
            }
        } else {
            check_scores(q.len(), rows, d, s.len());
            // SAFETY: only reached through `item_avx512`, i.e. with avx512f/bw/vl detected; the
            // bounds were checked just above.
            unsafe { avx512::scores(q, rows, d, k, keys, s, pf) }
        }
    }

    #[inline(always)]
    fn pv<T: Elem>(
        dot: bool,
        o: &mut [f32],
        rows: usize,
        d: usize,
        corr: Option<&[f32]>,
        p: &[[f32; BK]],
        v: &Rows<T>,
        cols: std::ops::Range<usize>,
    ) {
        if rows == 0 || cols.is_empty() {
            return;
        }
        check_pv(o.len(), rows, d, corr.map(<[f32]>::len), p.len(), &cols);
        check_rows(v, &cols, d);
        if dot && kind::<T>() == Kind::Bf16 {
            // SAFETY: as in `scores`.
            unsafe { avx512::pv_bf16(o, rows, d, corr, p, v, cols) }
        } else {
            // SAFETY: avx512f/bw/vl detected as above; the bounds were checked just above.
            unsafe { avx512::pv(o, rows, d, corr, p, v, cols) }
        }
    }
}

impl Ops for Fused {
    #[inline(always)]
    fn scores<T: Elem>(
        _dot: bool,
        q: &[f32],
        _qh: &[u16],
        rows: usize,
        d: usize,
        k: &Rows<T>,
        keys: std::ops::Range<usize>,
        s: &mut [[f32; BK]],
        pf: &mut Pf,
    ) {
        pf.fetch_all();
        let Some(src) = as_f32(k.src) else {
            return portable_scores::<T, Self>(q, rows, d, k, keys, s);
        };
        check_scores(q.len(), rows, d, s.len());
        for t0 in (0..rows).step_by(NR) {
            // Rows past `rows` repeat the last one; their results are dropped.
            let qs: [&[f32]; NR] = std::array::from_fn(|t| {
                let r = (t0 + t).min(rows - 1);
                &q[r * d..(r + 1) * d]
            });
            for c in keys.clone() {
                // SAFETY: only reached through `item_avx2`, i.e. with avx2 and fma detected;
                // every row has `d` elements (the slices check it).
                let dots = unsafe { avx2::dot4(qs, &src[k.row(c)..k.row(c) + d]) };
                for (t, x) in dots.iter().enumerate().take(rows - t0) {
                    s[t0 + t][c] = *x;
                }
            }
        }
    }

    #[inline(always)]
    fn pv<T: Elem>(
        _dot: bool,
        o: &mut [f32],
        rows: usize,
        d: usize,
        corr: Option<&[f32]>,
        p: &[[f32; BK]],
        v: &Rows<T>,
        cols: std::ops::Range<usize>,
    ) {
        let Some(src) = as_f32(v.src) else {
            return portable_pv::<T, Self>(o, rows, d, corr, p, v, cols);
        };
        if rows == 0 || cols.is_empty() {
            return;
        }
        check_pv(o.len(), rows, d, corr.map(<[f32]>::len), p.len(), &cols);
        let vr = Rows {
            src,
            off: v.off,
            shift: v.shift,
        };
        check_rows(&vr, &cols, d);
        // Without a correction the rows are scaled by 1, which is exact.
        let ones = [1f32; NR];
        for t0 in (0..rows).step_by(NR) {
            let nr = NR.min(rows - t0);
            let corr = corr.map_or(&ones[..nr], |c| &c[t0..t0 + nr]);
            // SAFETY: avx2 and fma detected as above; the bounds were checked just above.
            unsafe {
                avx2::pv(
                    &mut o[t0 * d..(t0 + nr) * d],
                    nr,
                    d,
                    corr,
                    &p[t0..t0 + nr],
                    &vr,
                    cols.clone(),
                )
            }
        }
    }
}
