//! The micro-kernels behind both products of a tile, chosen at run time by instruction set.

use super::Lanes;
#[cfg(target_arch = "x86_64")]
use super::{avx2, avx512};

/// The instruction set the micro-kernels run with, detected once per call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Isa {
    #[cfg(target_arch = "x86_64")]
    Avx512,
    #[cfg(target_arch = "x86_64")]
    Avx2Fma,
    Portable,
}

impl Isa {
    /// Every instruction set this CPU has, so tests run the fallbacks on an AVX-512 machine too.
    #[cfg(test)]
    pub(super) fn available() -> Vec<Isa> {
        let mut v = vec![Isa::Portable];
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
                v.push(Isa::Avx2Fma);
            }
            if is_x86_feature_detected!("avx512f") {
                v.push(Isa::Avx512);
            }
        }
        v
    }

    pub(super) fn detect() -> Self {
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx512f") {
                return Isa::Avx512;
            }
            if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
                return Isa::Avx2Fma;
            }
        }
        Isa::Portable
    }
}

/// The arithmetic a work item is compiled with.
pub(super) trait Kernel {
    /// Rows of `out` one call of `block` can take.
    const ROWS: usize;
    /// `a * b + c`, fused where the hardware has it.
    fn fma(a: f32, b: f32, c: f32) -> f32;
    /// For each `i < out.len() <= ROWS`:
    /// `out[i] = out[i] * init + Σ_{t<n} a[i * a_is + t * a_ts] · b[t]` with `init = None`
    /// meaning "start from zero". Callers guarantee `b.len() >= n` and that every index of `a`
    /// named above is in bounds. The portable loops unless an instruction set overrides it.
    #[inline(always)]
    fn block(
        out: &mut [Lanes],
        init: Option<&Lanes>,
        a: &[f32],
        a_is: usize,
        a_ts: usize,
        b: &[Lanes],
        n: usize,
    ) where
        Self: Sized,
    {
        portable_block::<Self>(out, init, a, a_is, a_ts, b, n)
    }
    /// Lane-wise maximum of `rows` (and -inf); a NaN entry is skipped.
    #[inline(always)]
    fn max_rows(rows: &[Lanes]) -> Lanes {
        let mut m = Lanes::splat(f32::NEG_INFINITY);
        for s in rows {
            for (m, &x) in m.0.iter_mut().zip(&s.0) {
                *m = if x > *m { x } else { *m };
            }
        }
        m
    }
}

/// Checks the contract of [`Kernel::block`] once, before the unchecked inner loops.
#[inline(always)]
fn block_in_bounds(rows: usize, a_len: usize, a_is: usize, a_ts: usize, b_len: usize, n: usize) {
    assert!(
        rows == 0 || n == 0 || ((rows - 1) * a_is + (n - 1) * a_ts < a_len && n <= b_len),
        "cpu flash kernel: tile indexing out of bounds"
    );
}

/// Plain loops, one row at a time; correct everywhere, vectorised by the compiler.
pub(super) struct Portable;

impl Kernel for Portable {
    const ROWS: usize = 1;
    #[inline(always)]
    fn fma(a: f32, b: f32, c: f32) -> f32 {
        // `mul_add` without hardware FMA is a libm call; aarch64 always has the instruction.
        if cfg!(target_arch = "aarch64") {
            a.mul_add(b, c)
        } else {
            a * b + c
        }
    }
}

/// AVX2 + FMA: `ROWS` rows × 4 vectors of 8 lanes = 8 accumulators in ymm registers, a tile's
/// lanes in two halves; the other loops are the portable ones compiled with FMA.
#[cfg(target_arch = "x86_64")]
pub(super) struct Fused;

#[cfg(target_arch = "x86_64")]
impl Kernel for Fused {
    const ROWS: usize = 2;
    #[inline(always)]
    fn fma(a: f32, b: f32, c: f32) -> f32 {
        a.mul_add(b, c)
    }
    #[inline(always)]
    fn block(
        out: &mut [Lanes],
        init: Option<&Lanes>,
        a: &[f32],
        a_is: usize,
        a_ts: usize,
        b: &[Lanes],
        n: usize,
    ) {
        block_in_bounds(out.len(), a.len(), a_is, a_ts, b.len(), n);
        // SAFETY: only reached through the `item_avx2` functions, i.e. with avx2 and fma
        // detected; indices were checked just above.
        unsafe {
            match out.len() {
                1 => avx2::block::<1>(out, init, a, a_is, a_ts, b, n),
                2 => avx2::block::<2>(out, init, a, a_is, a_ts, b, n),
                _ => unreachable!("callers pass at most ROWS rows"),
            }
        }
    }
}

#[inline(always)]
fn portable_block<K: Kernel>(
    out: &mut [Lanes],
    init: Option<&Lanes>,
    a: &[f32],
    a_is: usize,
    a_ts: usize,
    b: &[Lanes],
    n: usize,
) {
    block_in_bounds(out.len(), a.len(), a_is, a_ts, b.len(), n);
    for (i, o) in out.iter_mut().enumerate() {
        let mut acc = match init {
            Some(c) => {
                let mut acc = *o;
                acc.0.iter_mut().zip(&c.0).for_each(|(x, c)| *x *= c);
                acc
            }
            None => Lanes::splat(0.0),
        };
        for (t, bt) in b[..n].iter().enumerate() {
            let s = a[i * a_is + t * a_ts];
            for (x, &y) in acc.0.iter_mut().zip(&bt.0) {
                *x = K::fma(s, y, *x);
            }
        }
        *o = acc;
    }
}

/// AVX-512: `ROWS` rows × 4 vectors of 16 lanes = 24 accumulators held in zmm registers.
#[cfg(target_arch = "x86_64")]
pub(super) struct Avx512;

#[cfg(target_arch = "x86_64")]
impl Kernel for Avx512 {
    const ROWS: usize = 6;
    #[inline(always)]
    fn fma(a: f32, b: f32, c: f32) -> f32 {
        a.mul_add(b, c)
    }
    #[inline(always)]
    fn block(
        out: &mut [Lanes],
        init: Option<&Lanes>,
        a: &[f32],
        a_is: usize,
        a_ts: usize,
        b: &[Lanes],
        n: usize,
    ) {
        block_in_bounds(out.len(), a.len(), a_is, a_ts, b.len(), n);
        // SAFETY: only reached through `item_avx512`, i.e. with avx512f detected; indices were
        // checked just above.
        unsafe {
            match out.len() {
                1 => avx512::block::<1>(out, init, a, a_is, a_ts, b, n),
                2 => avx512::block::<2>(out, init, a, a_is, a_ts, b, n),
                3 => avx512::block::<3>(out, init, a, a_is, a_ts, b, n),
                4 => avx512::block::<4>(out, init, a, a_is, a_ts, b, n),
                5 => avx512::block::<5>(out, init, a, a_is, a_ts, b, n),
                6 => avx512::block::<6>(out, init, a, a_is, a_ts, b, n),
                _ => unreachable!("callers pass at most ROWS rows"),
            }
        }
    }
    #[inline(always)]
    fn max_rows(rows: &[Lanes]) -> Lanes {
        // SAFETY: only reached through `item_avx512`, i.e. with avx512f detected.
        unsafe { avx512::max_rows(rows) }
    }
}
