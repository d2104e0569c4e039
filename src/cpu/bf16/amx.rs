//! The AMX tile unit: eight tile registers, each configured as 16 rows of 64 bytes (16 × 16
//! f32, or 16 × 32 bf16), and `TDPBF16PS` (C += A · B: A 16 × 32 bf16, B 16 pair rows × 16
//! columns of bf16 pairs, C 16 × 16 f32), reached through inline assembly since Rust's AMX
//! intrinsics are not stable.
//!
//! [`Tiles`] names the operations; [`Amx`] runs them, and in tests a software model runs the
//! same code on machines without AMX, so that the tiling (addresses, strides, padding) is
//! tested everywhere and the hardware only adds the instructions themselves.

use std::arch::asm;

use super::super::{Lanes, BR};
use super::Acc;
use super::Pairs;

/// The eight tile registers as one configuration (16 rows × 64 bytes each).
pub(in crate::cpu) trait Tiles {
    /// Loads the configuration (which zeroes every tile).
    ///
    /// # Safety
    /// The CPU has AMX and the process was granted the tile data state.
    unsafe fn configure();
    /// Returns the tile state to its initial state.
    ///
    /// # Safety
    /// As [`configure`](Self::configure).
    unsafe fn release();
    /// Tile `T` = 0.
    ///
    /// # Safety
    /// Configured.
    unsafe fn zero<const T: u8>();
    /// Tile `T` = the 16 rows of 64 bytes at `p`, `p + stride`, ...
    ///
    /// # Safety
    /// Configured, and those 16 × 64 bytes are readable.
    unsafe fn load<const T: u8>(p: *const u8, stride: usize);
    /// The 16 rows of 64 bytes at `p`, `p + stride`, ... = tile `T`.
    ///
    /// # Safety
    /// Configured, and those 16 × 64 bytes are writable.
    unsafe fn store<const T: u8>(p: *mut u8, stride: usize);
    /// Tile `C` (f32) += tile `A` (bf16) · tile `B` (bf16 pairs).
    ///
    /// # Safety
    /// Configured.
    unsafe fn dp<const C: u8, const A: u8, const B: u8>();
}

/// The hardware.
pub(in crate::cpu) struct Amx;

/// The 64-byte operand of `LDTILECFG`: palette 1, bytes per row and rows of each tile.
#[repr(C, align(64))]
struct TileConfig {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    colsb: [u16; 16],
    rows: [u8; 16],
}

/// Tiles 0..8 at the largest shape palette 1 allows: 16 rows of 64 bytes.
static CONFIG: TileConfig = TileConfig {
    palette: 1,
    start_row: 0,
    reserved: [0; 14],
    colsb: [64, 64, 64, 64, 64, 64, 64, 64, 0, 0, 0, 0, 0, 0, 0, 0],
    rows: [16, 16, 16, 16, 16, 16, 16, 16, 0, 0, 0, 0, 0, 0, 0, 0],
};

impl Tiles for Amx {
    #[inline(always)]
    unsafe fn configure() {
        // SAFETY: the caller's; the operand is a valid 64-byte configuration.
        unsafe { asm!("ldtilecfg [{}]", in(reg) &CONFIG, options(nostack, readonly)) }
    }
    #[inline(always)]
    unsafe fn release() {
        // SAFETY: the caller's.
        unsafe { asm!("tilerelease", options(nostack, nomem)) }
    }
    #[inline(always)]
    unsafe fn zero<const T: u8>() {
        // SAFETY: the caller's.
        unsafe { asm!("tilezero tmm{t}", t = const T, options(nostack, nomem)) }
    }
    #[inline(always)]
    unsafe fn load<const T: u8>(p: *const u8, stride: usize) {
        // SAFETY: the caller's.
        unsafe {
            asm!(
                "tileloadd tmm{t}, [{p} + {s} * 1]",
                t = const T,
                p = in(reg) p,
                s = in(reg) stride,
                options(nostack, readonly),
            )
        }
    }
    #[inline(always)]
    unsafe fn store<const T: u8>(p: *mut u8, stride: usize) {
        // SAFETY: the caller's.
        unsafe {
            asm!(
                "tilestored [{p} + {s} * 1], tmm{t}",
                t = const T,
                p = in(reg) p,
                s = in(reg) stride,
                options(nostack),
            )
        }
    }
    #[inline(always)]
    unsafe fn dp<const C: u8, const A: u8, const B: u8>() {
        // SAFETY: the caller's.
        unsafe {
            asm!(
                "tdpbf16ps tmm{c}, tmm{a}, tmm{b}",
                c = const C,
                a = const A,
                b = const B,
                options(nostack, nomem),
            )
        }
    }
}

/// Bytes between two rows of lanes (`Lanes` or `Pairs`).
const LANE_ROW: usize = BR * 4;

/// The pair product of [`super::Engine::mm`] on tiles: `out` (`M` rows of lanes) becomes
/// `init(out) + A · B`, times `scale`, with `A` the `M × k` bf16 matrix at `a` (row stride
/// `a_stride`) and `B` the `k / 2` rows of pairs `b`.
///
/// Tiled 2 × 2: tiles 0..4 accumulate a 32 × 32 block of `out` (two 16-row blocks times two
/// 16-lane blocks), tiles 4 and 5 hold the two 16 × 32 blocks of `A`, tiles 6 and 7 the two
/// 16 pair-row blocks of `B`; each step over 32 values of `k` is four `TDPBF16PS`. An odd last
/// row block uses tiles 0, 1, 4, 6 and 7.
///
/// # Safety
/// Configured; avx512f (for `Acc::Scale` and `scale`); `out.len()` is a multiple of 16, `k` of
/// 32; `b.len() >= k / 2`; `(out.len() - 1) * a_stride + k <= a.len()`.
#[inline(always)]
pub(super) unsafe fn mm<T: Tiles>(
    out: &mut [Lanes],
    init: Acc,
    scale: f32,
    a: &[u16],
    a_stride: usize,
    b: &[Pairs],
    k: usize,
) {
    let m = out.len();
    if let Acc::Scale(c) = init {
        // SAFETY: the caller's (avx512f).
        unsafe { super::avx512::scale_rows(out, c) };
    }
    let keep = !matches!(init, Acc::Zero);
    let o = out.as_mut_ptr().cast::<u8>();
    let ap = a.as_ptr().cast::<u8>();
    let bp = b.as_ptr().cast::<u8>();
    let sa = a_stride * 2;
    let mb = m / 16;
    let mut m0 = 0;
    while m0 < mb {
        let two = m0 + 1 < mb;
        for n0 in [0, 2] {
            // SAFETY (every pointer below): row blocks `m0, m0 + 1 < mb` of `out` (16 rows of
            // LANE_ROW bytes each) and lane blocks `n0, n0 + 1 < 4` (64 bytes each) lie inside
            // `out`; rows `16 m0 .. 16 (m0 + 2)` of `A` and its values `32 s .. 32 s + 32`
            // (`s < k / 32`) inside `a`; pair rows `16 s .. 16 s + 16` of `B` inside `b`: all
            // by the caller's bounds.
            unsafe {
                let c = |mi: usize, ni: usize| o.add((m0 + mi) * 16 * LANE_ROW + (n0 + ni) * 64);
                if keep {
                    T::load::<0>(c(0, 0), LANE_ROW);
                    T::load::<1>(c(0, 1), LANE_ROW);
                    if two {
                        T::load::<2>(c(1, 0), LANE_ROW);
                        T::load::<3>(c(1, 1), LANE_ROW);
                    }
                } else {
                    T::zero::<0>();
                    T::zero::<1>();
                    T::zero::<2>();
                    T::zero::<3>();
                }
                for s in 0..k / 32 {
                    T::load::<4>(ap.add(m0 * 16 * sa + s * 64), sa);
                    T::load::<6>(bp.add(s * 16 * LANE_ROW + n0 * 64), LANE_ROW);
                    T::load::<7>(bp.add(s * 16 * LANE_ROW + (n0 + 1) * 64), LANE_ROW);
                    T::dp::<0, 4, 6>();
                    T::dp::<1, 4, 7>();
                    if two {
                        T::load::<5>(ap.add((m0 + 1) * 16 * sa + s * 64), sa);
                        T::dp::<2, 5, 6>();
                        T::dp::<3, 5, 7>();
                    }
                }
                T::store::<0>(c(0, 0), LANE_ROW);
                T::store::<1>(c(0, 1), LANE_ROW);
                if two {
                    T::store::<2>(c(1, 0), LANE_ROW);
                    T::store::<3>(c(1, 1), LANE_ROW);
                }
            }
        }
        m0 += 2;
    }
    if scale != 1.0 {
        // SAFETY: the caller's (avx512f).
        unsafe { super::avx512::scale_rows(out, &Lanes::splat(scale)) };
    }
}

/// A software model of the tile unit, for tests on machines without AMX: per thread, eight
/// 1 KiB tiles, `TDPBF16PS` as f32 fused multiply-adds.
#[cfg(test)]
pub(in crate::cpu) struct Soft;

#[cfg(test)]
thread_local! {
    static SOFT: std::cell::RefCell<[[u8; 1024]; 8]> = const { std::cell::RefCell::new([[0; 1024]; 8]) };
}

#[cfg(test)]
impl Tiles for Soft {
    unsafe fn configure() {
        SOFT.with(|t| *t.borrow_mut() = [[0; 1024]; 8]);
    }
    unsafe fn release() {}
    unsafe fn zero<const T: u8>() {
        SOFT.with(|t| t.borrow_mut()[T as usize] = [0; 1024]);
    }
    unsafe fn load<const T: u8>(p: *const u8, stride: usize) {
        SOFT.with(|t| {
            let tile = &mut t.borrow_mut()[T as usize];
            for r in 0..16 {
                // SAFETY: the caller's: 16 rows of 64 readable bytes.
                let row = unsafe { std::slice::from_raw_parts(p.add(r * stride), 64) };
                tile[r * 64..(r + 1) * 64].copy_from_slice(row);
            }
        })
    }
    unsafe fn store<const T: u8>(p: *mut u8, stride: usize) {
        SOFT.with(|t| {
            let tile = &t.borrow()[T as usize];
            for r in 0..16 {
                // SAFETY: the caller's: 16 rows of 64 writable bytes.
                let row = unsafe { std::slice::from_raw_parts_mut(p.add(r * stride), 64) };
                row.copy_from_slice(&tile[r * 64..(r + 1) * 64]);
            }
        })
    }
    unsafe fn dp<const C: u8, const A: u8, const B: u8>() {
        SOFT.with(|t| {
            let mut t = t.borrow_mut();
            let word =
                |tile: &[u8; 1024], i: usize| u16::from_le_bytes([tile[2 * i], tile[2 * i + 1]]);
            let bf = |w: u16| f32::from_bits((w as u32) << 16);
            let (a, b) = (t[A as usize], t[B as usize]);
            let c = &mut t[C as usize];
            for m in 0..16 {
                for n in 0..16 {
                    let at = 4 * (m * 16 + n);
                    let mut acc = f32::from_le_bytes([c[at], c[at + 1], c[at + 2], c[at + 3]]);
                    for k in 0..16 {
                        for h in 0..2 {
                            let x = bf(word(&a, m * 32 + 2 * k + h));
                            let y = bf(word(&b, k * 32 + 2 * n + h));
                            acc = x.mul_add(y, acc);
                        }
                    }
                    c[at..at + 4].copy_from_slice(&acc.to_le_bytes());
                }
            }
        })
    }
}
