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

mod amx;
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
