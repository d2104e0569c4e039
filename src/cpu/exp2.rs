//! A vectorisable `2^x` for the online softmax.

use super::kernel::Kernel;

/// Adding 1.5·2²³ rounds to an integer n and leaves n in the low mantissa bits.
pub(crate) const SHIFT: f32 = 12_582_912.0;
/// The bit pattern of [`SHIFT`]: subtracted from `(x + SHIFT)`'s bits, it leaves n.
pub(crate) const SHIFT_BITS: i32 = 0x4B40_0000;
const L: f64 = std::f64::consts::LN_2;
/// The Taylor series of 2^f = e^(f ln 2); on |f| <= 1/2 its degree-6 truncation is within
/// 1.2e-7 (relative). Shared by the scalar form here and the vector forms of the decode kernels.
pub(crate) const C: [f32; 7] = [
    1.0,
    L as f32,
    (L * L / 2.0) as f32,
    (L * L * L / 6.0) as f32,
    (L * L * L * L / 24.0) as f32,
    (L * L * L * L * L / 120.0) as f32,
    (L * L * L * L * L * L / 720.0) as f32,
];

/// `2^x` for whole tiles: branch-free, so the compiler vectorises it. Relative error below 5e-7
/// on `[-126, 127]`; below about -126.5 the result is exactly 0 (so `-inf` maps to 0, which the
/// masking relies on); NaN stays NaN.
#[inline(always)]
pub(super) fn exp2<K: Kernel>(x: f32) -> f32 {
    // The comparisons are written so that NaN falls through unchanged.
    let x = if x < -127.0 { -127.0 } else { x };
    let x = if x > 127.0 { 127.0 } else { x };
    let t = x + SHIFT;
    let n = (t.to_bits() as i32).wrapping_sub(SHIFT_BITS);
    let f = x - (t - SHIFT);
    let mut p = C[6];
    for &c in C[..6].iter().rev() {
        p = K::fma(p, f, c);
    }
    // 2^n built from its exponent bits; n = -127 gives the bit pattern of +0.0.
    let scale = f32::from_bits((n.wrapping_add(127) << 23) as u32);
    p * scale
}
