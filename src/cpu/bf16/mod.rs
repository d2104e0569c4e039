//! The bf16 paths: tiles kept in bf16 as stored, both products on a bf16 engine with f32
//! accumulation ([`Avx512Bf16`]: `VDPBF16PS`; [`AmxBf16`]: the AMX tile unit), everything else
//! (online softmax, masks, score modifiers) the f32 code of the other paths on f32 scores.
//!
//! Every product of the forward and backward passes has one shape, [`Engine::mm`]:
//! `out = init(out) + A · B`, with `out` rows of f32 lanes (64 queries or keys, the lanes the
//! rest of the CPU path works in), `A` a row-major bf16 matrix and `B` rows of [`Pairs`]: lane
//! `r` of pair row `t` holds the values `2t` and `2t + 1` of the reduction for lane `r`. That is
//! the operand layout of both `VDPBF16PS` (a broadcast pair of `A` times a vector of pairs) and
//! `TDPBF16PS` (A tile times a B tile in pair rows), so the two engines share every tile
//! layout and differ only in the padding they need ([`Engine::K_ALIGN`], [`Engine::M_ALIGN`]).

pub(super) mod amx;
mod avx512;
pub(super) mod prefill;

use half::bf16;

use super::{Lanes, BR};
use crate::problem::{KeyRows, Strides};

/// One row of bf16 pairs in lanes: lane `r` holds two bf16 values of query (or key) `r`, the
/// first in the low half.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
pub(super) struct Pairs(pub [u32; BR]);

impl Pairs {
    pub const ZERO: Pairs = Pairs([0; BR]);
}

/// What `out` starts from in [`Engine::mm`].
#[derive(Clone, Copy)]
pub(super) enum Acc<'a> {
    /// Zero.
    Zero,
    /// Its current value.
    Keep,
    /// Its current value times these lanes (the online softmax's correction).
    Scale(&'a Lanes),
}

/// A bf16 product engine.
pub(super) trait Engine {
    /// `k` of [`mm`](Self::mm) is a multiple of this (the reduction is padded with zeros).
    const K_ALIGN: usize;
    /// `out.len()` of [`mm`](Self::mm) is a multiple of this (rows past the real ones are
    /// scratch).
    const M_ALIGN: usize;
    /// Before the first [`mm`](Self::mm) of a work item.
    fn begin();
    /// After the last.
    fn end();
    /// `out = init(out) + A · B`, then times `scale`: `A` is the `out.len() × k` bf16 matrix at
    /// `a` with row stride `a_stride` (even), `B` the `k / 2` rows of pairs `b`.
    fn mm(
        out: &mut [Lanes],
        init: Acc,
        scale: f32,
        a: &[u16],
        a_stride: usize,
        b: &[Pairs],
        k: usize,
    );
}

/// Checks the contract of [`Engine::mm`] once, before the unchecked loops.
#[inline(always)]
fn mm_in_bounds<E: Engine>(m: usize, a_len: usize, a_stride: usize, b_len: usize, k: usize) {
    assert!(
        m.is_multiple_of(E::M_ALIGN)
            && k.is_multiple_of(E::K_ALIGN)
            && a_stride.is_multiple_of(2)
            && k / 2 <= b_len
            && (m == 0 || k == 0 || (m - 1) * a_stride + k <= a_len),
        "cpu flash bf16 kernel: tile indexing out of bounds"
    );
}

/// `VDPBF16PS`, 6 rows × 64 lanes per micro-kernel call.
pub(super) struct Avx512Bf16;

/// Rows per [`avx512::block`] call: 24 accumulators, 4 vectors of `B` and a broadcast fill 29
/// of the 32 zmm registers.
const ROWS: usize = 6;

impl Engine for Avx512Bf16 {
    const K_ALIGN: usize = 2;
    const M_ALIGN: usize = 1;
    #[inline(always)]
    fn begin() {}
    #[inline(always)]
    fn end() {}
    #[inline(always)]
    fn mm(
        out: &mut [Lanes],
        init: Acc,
        scale: f32,
        a: &[u16],
        a_stride: usize,
        b: &[Pairs],
        k: usize,
    ) {
        mm_in_bounds::<Self>(out.len(), a.len(), a_stride, b.len(), k);
        let n = k / 2;
        let mut i = 0;
        while i < out.len() {
            let r = ROWS.min(out.len() - i);
            let (o, a) = (&mut out[i..i + r], &a[i * a_stride..]);
            // SAFETY: only reached through the bf16 items compiled for (and run after detecting)
            // avx512f and avx512bf16; `mm_in_bounds` checked the indices of all rows.
            unsafe {
                match r {
                    1 => avx512::block::<1>(o, init, scale, a, a_stride, b, n),
                    2 => avx512::block::<2>(o, init, scale, a, a_stride, b, n),
                    3 => avx512::block::<3>(o, init, scale, a, a_stride, b, n),
                    4 => avx512::block::<4>(o, init, scale, a, a_stride, b, n),
                    5 => avx512::block::<5>(o, init, scale, a, a_stride, b, n),
                    _ => avx512::block::<6>(o, init, scale, a, a_stride, b, n),
                }
            }
            i += r;
        }
    }
}

/// The AMX tile unit (or, in tests, its software model).
pub(super) struct AmxBf16<T = amx::Amx>(std::marker::PhantomData<T>);

impl<T: amx::Tiles> Engine for AmxBf16<T> {
    const K_ALIGN: usize = 32;
    const M_ALIGN: usize = 16;
    #[inline(always)]
    fn begin() {
        // SAFETY: only reached through the AMX items, run after `dispatch::amx_usable`.
        unsafe { T::configure() }
    }
    #[inline(always)]
    fn end() {
        // SAFETY: as above.
        unsafe { T::release() }
    }
    #[inline(always)]
    fn mm(
        out: &mut [Lanes],
        init: Acc,
        scale: f32,
        a: &[u16],
        a_stride: usize,
        b: &[Pairs],
        k: usize,
    ) {
        mm_in_bounds::<Self>(out.len(), a.len(), a_stride, b.len(), k);
        // SAFETY: configured by `begin` (the items call it first), on a CPU with AMX and
        // avx512f; bounds checked just above.
        unsafe { amx::mm::<T>(out, init, scale, a, a_stride, b, k) }
    }
}

/// [`avx512::pack_pairs`]: `dst[i]` = lanes `(bf16(src[2i]), bf16(src[2i + 1]))`, rows of `src`
/// at or past `n` counting as 0.
#[inline(always)]
pub(super) fn pack_pairs(dst: &mut [Pairs], src: &[Lanes], n: usize) {
    // SAFETY: only reached from the bf16 items, compiled for and run after detecting avx512f,
    // avx512bw and avx512bf16.
    unsafe { avx512::pack_pairs(dst, src, n) }
}

/// [`avx512::round_row`]: `dst[c] = bf16(src[c])`.
#[inline(always)]
pub(super) fn round_row(dst: &mut [u16], src: &Lanes) {
    // SAFETY: as for `pack_pairs`.
    unsafe { avx512::round_row(dst, src) }
}

/// [`avx512::online_pairs`]: the online softmax update on masked base-2 scores `s` (times
/// `scale > 0`), `P` into `pt` as bf16 pairs of keys (and with `keep` back into `s`); returns
/// the correction of `O` and whether `O` needs it.
#[inline(always)]
pub(super) fn online_pairs(
    m: &mut Lanes,
    l: &mut Lanes,
    s: &mut [Lanes],
    pt: &mut [Pairs],
    keep: bool,
    scale: f32,
) -> (Lanes, bool) {
    debug_assert!(
        scale > 0.0,
        "the max of scaled scores is the scaled max for scale > 0"
    );
    // SAFETY: as for `pack_pairs`.
    unsafe { avx512::online_pairs(m, l, s, pt, keep, scale) }
}

/// [`avx512::probs_pairs`]: the backward's `P` and `dS` of rows `< rows` (no softcap, no
/// ALiBi), masked to the key bits of `lanes`, into bf16 pairs of rows (`pp`, `dsp`) and, with
/// `ds = (buffer, stride)`, `dS` row-major bf16 (BR values per row).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(super) fn probs_pairs(
    s: &[Lanes],
    dp: &[Lanes],
    lse2: &[f32],
    delta: &[f32],
    qk2: f32,
    lanes: Option<&[u64]>,
    rows: usize,
    pp: &mut [Pairs],
    dsp: &mut [Pairs],
    ds: Option<(&mut [u16], usize)>,
) {
    assert!(
        s.len() >= rows
            && dp.len() >= rows
            && lse2.len() >= rows
            && delta.len() >= rows
            && lanes.is_none_or(|l| l.len() >= rows)
            && ds
                .as_ref()
                .is_none_or(|(ds, stride)| rows == 0 || (rows - 1) * stride + BR <= ds.len())
            && dsp.len() == pp.len(),
        "cpu flash bf16 backward: tile indexing out of bounds"
    );
    // SAFETY: as for `pack_pairs`; bounds checked above.
    unsafe { avx512::probs_pairs(s, dp, lse2, delta, qk2, lanes, rows, pp, dsp, ds) }
}

/// [`avx512::rows_to_lanes`]: `dst[t]` lane `c` = the pair of values `2t, 2t + 1` of row `c`
/// of `src` (row stride `stride`), 0 in lanes `rows ..`.
#[inline(always)]
pub(super) fn rows_to_lanes(dst: &mut [Pairs], src: &[u16], stride: usize, rows: usize) {
    assert!(
        rows <= BR
            && stride.is_multiple_of(2)
            && (rows == 0 || (rows - 1) * stride + 2 * dst.len() <= src.len()),
        "cpu flash bf16 transpose out of bounds"
    );
    // SAFETY: as for `pack_pairs` (avx512f); bounds checked above.
    unsafe { avx512::rows_to_lanes(dst, src, stride, rows) }
}

/// [`avx512::transpose_rows`]: `dst[x][r] = src[r][x]` for `x < d`, `r < rows`, 0 up to the
/// next multiple of 32 rows.
#[inline(always)]
pub(super) fn transpose_rows(
    dst: &mut [u16],
    dst_stride: usize,
    src: &[u16],
    src_stride: usize,
    rows: usize,
    d: usize,
) {
    assert!(
        pad(rows, 32) <= dst_stride
            && d * dst_stride <= dst.len()
            && (rows == 0 || (rows - 1) * src_stride + d <= src.len()),
        "cpu flash bf16 transpose out of bounds"
    );
    // SAFETY: as for `pack_pairs` (avx512f, avx512bw); bounds checked above.
    unsafe { avx512::transpose_rows(dst, dst_stride, src, src_stride, rows, d) }
}

/// [`avx512::interleave_rows`]: `dst[i]` lane `x` = values `x` of rows `2i` and `2i + 1`
/// (`x < d <= BR`; 0 past `d` and for rows `>= rows`).
#[inline(always)]
pub(super) fn interleave_rows(
    dst: &mut [Pairs],
    src: &[u16],
    stride: usize,
    rows: usize,
    d: usize,
) {
    assert!(
        d <= BR && (rows == 0 || d == 0 || (rows - 1) * stride + d <= src.len()),
        "cpu flash bf16 interleave out of bounds"
    );
    // SAFETY: as for `pack_pairs` (avx512f, avx512bw); bounds checked above.
    unsafe { avx512::interleave_rows(dst, src, stride, rows, d) }
}

/// Rounds `x` to a multiple of `a`, upwards.
#[inline(always)]
pub(super) const fn pad(x: usize, a: usize) -> usize {
    x.div_ceil(a) * a
}

/// Copies `rows` rows of one head, starting at `row0`, into `dst` as bf16 bits, row `r` at
/// `r * stride` (`d` values; the rest of each row is left as it is).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(super) fn load_rows(
    dst: &mut [u16],
    stride: usize,
    src: &[bf16],
    s: &Strides,
    b: usize,
    row0: usize,
    rows: usize,
    head: usize,
    d: usize,
) {
    for r in 0..rows {
        let base = s.at(b, row0 + r, head);
        let dst = &mut dst[r * stride..r * stride + d];
        if s.dim == 1 {
            for (o, x) in dst.iter_mut().zip(&src[base..base + d]) {
                *o = x.to_bits();
            }
        } else {
            for (x, o) in dst.iter_mut().enumerate() {
                *o = src[base + x * s.dim].to_bits();
            }
        }
    }
}

/// Copies keys `j0 .. j0 + n` of one head, addressed through `keys`, as [`load_rows`] does.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(super) fn load_keys(
    dst: &mut [u16],
    stride: usize,
    src: &[bf16],
    s: &Strides,
    keys: &KeyRows,
    j0: usize,
    n: usize,
    head: usize,
    d: usize,
) {
    let mut c = 0;
    while c < n {
        let run = keys.run(j0 + c, n - c);
        let (b, row) = keys.at(j0 + c);
        load_rows(&mut dst[c * stride..], stride, src, s, b, row, run, head, d);
        c += run;
    }
}

/// Whether every bf16 of `x` is finite (its exponent bits are not all ones).
#[inline(always)]
pub(super) fn all_finite(x: &[u16]) -> bool {
    x.iter().fold(true, |ok, &w| ok & (w & 0x7F80 != 0x7F80))
}

/// bf16 bits as f32.
#[inline(always)]
pub(super) fn to_f32(w: u16) -> f32 {
    f32::from_bits((w as u32) << 16)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Pseudo-random bf16 bits with every exponent, NaN and infinities included.
    fn bits(n: usize, seed: u64) -> Vec<u16> {
        let mut s = seed | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                (s >> 24) as u16
            })
            .collect()
    }

    /// The vector transposes and the interleave against plain loops, at ragged sizes.
    #[test]
    fn layouts_match_plain_loops() {
        if !crate::cpu::dispatch::avx512bf16() {
            eprintln!("NOT TESTED: this CPU has no AVX512-BF16; the bf16 layouts need it");
            return;
        }
        for (rows, d) in [(1, 1), (7, 3), (16, 16), (37, 40), (64, 80), (64, 129)] {
            let stride = pad(d, 2) + 4;
            let src = bits(BR * stride, (rows * 1000 + d) as u64);
            let at = |r: usize, x: usize| {
                if r < rows && x < d {
                    src[r * stride + x]
                } else {
                    0
                }
            };
            let pair = |lo: u16, hi: u16| lo as u32 | (hi as u32) << 16;

            let mut lanes = vec![Pairs([7; BR]); d.div_ceil(2)];
            rows_to_lanes(&mut lanes, &src, stride, rows.min(BR));
            for (t, l) in lanes.iter().enumerate() {
                for c in 0..BR {
                    let want = if c < rows {
                        pair(at(c, 2 * t), src[c * stride + 2 * t + 1])
                    } else {
                        0
                    };
                    assert_eq!(l.0[c], want, "rows_to_lanes ({rows}, {d}) [{t}][{c}]");
                }
            }

            let dst_stride = pad(rows, 32) + 8;
            let mut t = vec![7u16; d * dst_stride];
            transpose_rows(&mut t, dst_stride, &src, stride, rows, d);
            for x in 0..d {
                for r in 0..pad(rows, 32) {
                    assert_eq!(
                        t[x * dst_stride + r],
                        at(r, x),
                        "transpose_rows ({rows}, {d}) [{x}][{r}]"
                    );
                }
            }

            let dd = d.min(BR);
            let mut il = vec![Pairs([7; BR]); rows.div_ceil(2) + 1];
            interleave_rows(&mut il, &src, stride, rows, dd);
            for (i, l) in il.iter().enumerate() {
                for x in 0..BR {
                    let at = |r: usize| if x < dd { at(r, x) } else { 0 };
                    assert_eq!(
                        l.0[x],
                        pair(at(2 * i), at(2 * i + 1)),
                        "interleave ({rows}, {d}) [{i}][{x}]"
                    );
                }
            }
        }
    }

    /// The softmax's exp2: accurate, exactly 0 at -inf and far below, NaN kept.
    #[test]
    fn online_pairs_exp2() {
        if !crate::cpu::dispatch::avx512bf16() {
            eprintln!("NOT TESTED: this CPU has no AVX512-BF16; the bf16 softmax needs it");
            return;
        }
        // One key per lane value: P = 2^(s - max) with max 0 (the first key), sum in l.
        let xs: Vec<f32> = (0..BR).map(|i| -(i as f32) * 2.3).collect();
        let mut s = vec![Lanes::splat(0.0), Lanes(std::array::from_fn(|i| xs[i]))];
        s.push(Lanes(std::array::from_fn(|i| match i {
            0 => f32::NEG_INFINITY,
            1 => -200.0,
            2 => f32::NAN,
            _ => -0.5,
        })));
        let (mut m, mut l) = (Lanes::splat(f32::NEG_INFINITY), Lanes::splat(0.0));
        let mut pt = vec![Pairs::ZERO; 2];
        let (corr, rescale) = online_pairs(&mut m, &mut l, &mut s, &mut pt, true, 1.0);
        assert!(corr.0.iter().all(|&c| c == 0.0), "first tile: corr 0");
        assert!(!rescale, "first tile: O is 0, nothing to rescale");
        assert!(m.0.iter().all(|&m| m == 0.0));
        assert_eq!(s[0].0[0], 1.0, "2^0 is exactly 1");
        for (i, &x) in xs.iter().enumerate() {
            let rel = (s[1].0[i] as f64 / (x as f64).exp2() - 1.0).abs();
            assert!(
                rel < 3.2e-6 || (x < -126.0 && s[1].0[i] < 1e-37),
                "exp2({x}): {rel}"
            );
        }
        assert_eq!(s[2].0[0], 0.0);
        assert_eq!(s[2].0[1], 0.0);
        assert!(s[2].0[2].is_nan() && l.0[2].is_nan());
        // bf16(P) of key 1 in the high half of pair 0.
        let hi = (pt[0].0[5] >> 16) as u16;
        assert_eq!(hi, half::bf16::from_f32(s[1].0[5]).to_bits());
        // A second tile whose max stays within the lag: the correction is exactly 1 and O
        // needs no rescaling (lane 2 is NaN and stays so).
        let mut s2 = vec![Lanes::splat(3.0)];
        let (corr, rescale) = online_pairs(&mut m, &mut l, &mut s2, &mut pt[..1], false, 1.0);
        assert!(!rescale && corr.0.iter().all(|&c| c == 1.0));
        assert_eq!(m.0[0], 0.0, "the max lags behind by up to 8");
    }

    /// The AMX instructions (inline assembly) against the software tile model on the same
    /// tiling: every `mm` shape the passes use, within f32 rounding of each other.
    #[test]
    fn amx_tiles_match_the_model() {
        use std::io::Write;
        if !crate::cpu::dispatch::amx_usable() {
            let _ = writeln!(std::io::stderr(), "NOT TESTED on this machine: AMX tiles");
            return;
        }
        type Hw = AmxBf16;
        type Model = AmxBf16<amx::Soft>;
        // (rows of out, k, a_stride): the forward's scores and PV, the backward's products.
        for (m, k, stride) in [
            (64, 64, 64),
            (32, 128, 160),
            (80, 64, 64),
            (48, 96, 288),
            (16, 32, 32),
        ] {
            let a: Vec<u16> = bits(m * stride, (m * k) as u64)
                .into_iter()
                .map(|w| half::bf16::from_f32(to_f32(w & 0xBFFF).clamp(-4.0, 4.0)).to_bits())
                .collect();
            let b: Vec<Pairs> = (0..k / 2)
                .map(|t| {
                    Pairs(std::array::from_fn(|i| {
                        ((t * 131 + i * 7) % 251) as u32 * 0x0001_0001 + 0x3F00_3F00
                    }))
                })
                .collect();
            let init = Lanes(std::array::from_fn(|i| i as f32 * 0.25 - 3.0));
            let corr = Lanes(std::array::from_fn(|i| 1.0 - i as f32 / 128.0));
            for acc in [Acc::Zero, Acc::Keep, Acc::Scale(&corr)] {
                let mut hw = vec![init; m];
                let mut model = vec![init; m];
                Hw::begin();
                Hw::mm(&mut hw, acc, 0.5, &a, stride, &b, k);
                Hw::end();
                Model::begin();
                Model::mm(&mut model, acc, 0.5, &a, stride, &b, k);
                Model::end();
                for (r, (x, y)) in hw.iter().zip(&model).enumerate() {
                    for (c, (x, y)) in x.0.iter().zip(&y.0).enumerate() {
                        assert!(
                            (x - y).abs() <= 1e-5 * y.abs().max(1.0) * k as f32,
                            "({m}, {k}) row {r} lane {c}: hardware {x}, model {y}"
                        );
                    }
                }
            }
        }
    }
}
