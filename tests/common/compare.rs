//! The tolerance rule and the comparisons every test goes through. All of them propagate NaN:
//! candle's `max` keeps a value only when `x < y`, so a NaN anywhere but first vanishes from
//! `(a - b).abs().max()`; these folds run on the host instead, and NaN or Inf where the reference
//! is finite always fails, whatever the tolerance.

use candle::{DType, Result, Tensor};

use super::values;

/// NaN-propagating largest `|actual - reference|`. `None` when the two disagree on a non-finite
/// value: NaN or Inf where the reference is finite, or anything but the same NaN/Inf where it is
/// not. That always fails, whatever the tolerance.
pub fn max_abs_err_slice(actual: &[f64], reference: &[f64]) -> Option<f64> {
    max_err_beyond(actual, reference, 0.0)
}

/// Like [`max_abs_err_slice`], for the error beyond a per-element floor:
/// `max_i max(0, |actual_i - reference_i| - rel * |reference_i|)`.
pub fn max_err_beyond(actual: &[f64], reference: &[f64], rel: f64) -> Option<f64> {
    assert_eq!(
        actual.len(),
        reference.len(),
        "output has the wrong number of elements"
    );
    let mut err = 0f64;
    for (&x, &r) in actual.iter().zip(reference) {
        if r.is_finite() {
            let e = (x - r).abs();
            if !e.is_finite() {
                return None;
            }
            err = err.max(e - rel * r.abs());
        } else if !(x == r || (x.is_nan() && r.is_nan())) {
            return None;
        }
    }
    Some(err)
}

/// The first element where `actual` and `reference` disagree on being finite (NaN or Inf on one
/// side only, or different non-finite values), for failure messages: `"element i: actual x,
/// reference r"`.
pub fn first_non_finite_disagreement(actual: &[f64], reference: &[f64]) -> String {
    actual
        .iter()
        .zip(reference)
        .position(|(&x, &r)| {
            if r.is_finite() {
                !x.is_finite()
            } else {
                !(x == r || (x.is_nan() && r.is_nan()))
            }
        })
        .map_or("none".into(), |i| {
            format!(
                "element {i}: actual {}, reference {}",
                actual[i], reference[i]
            )
        })
}

/// [`max_abs_err_slice`] of a tensor (any dtype, any device) against a host reference.
pub fn max_abs_err(actual: &Tensor, reference: &[f64]) -> Result<Option<f64>> {
    Ok(max_abs_err_slice(&values(actual)?, reference))
}

/// Largest `|x|` over the finite reference values: the scale the relative floor is taken of.
pub fn scale_of(reference: &[f64]) -> f64 {
    reference
        .iter()
        .filter(|x| x.is_finite())
        .fold(0f64, |m, x| m.max(x.abs()))
}

/// Per dtype: the per-element relative floor (the unit roundoff: the largest error of rounding
/// the exact result to the dtype, `|x| · 2^-24` in f32, `2^-11` in f16, `2^-8` in bf16; a floor
/// of [`SCALE_FLOOR`] times max |reference| comes on top, see [`assert_close`]), the
/// relative backstop (a fraction of the reference's largest magnitude that the error may never
/// exceed, since a poor naive yardstick, e.g. f16 accumulation over long rows, would otherwise
/// loosen the rule: about 4 unit roundoffs in f16/bf16, 1e-5 in f32 where the error grows with
/// the row length) and the absolute backstop for N(0,1) inputs (FlashAttention's test figures:
/// f32 1e-4, f16 4e-3, bf16 2.5e-2).
pub fn tolerances(dtype: DType) -> (f64, f64, f64) {
    match dtype {
        DType::F32 => (REL_FLOOR_F32, REL_BACKSTOP_F32, 1e-4),
        DType::F16 => (REL_FLOOR_F16, REL_BACKSTOP_F16, 4e-3),
        DType::BF16 => (REL_FLOOR_BF16, REL_BACKSTOP_BF16, 2.5e-2),
        _ => unreachable!("only float dtypes are tested"),
    }
}

/// Per-element relative floors, see [`tolerances`]: 2^-24, 2^-11, 2^-8.
pub const REL_FLOOR_F32: f64 = 5.96e-8;
pub const REL_FLOOR_F16: f64 = 4.88e-4;
pub const REL_FLOOR_BF16: f64 = 3.91e-3;
/// Floor relative to max |reference|, for every dtype: the fast kernels' approximate exp2 / tanh
/// in f32 (relative error up to ~5e-7 per probability) move every output by up to that fraction
/// of V's scale, which a per-element floor cannot cover and the naive path (exact libm) does not
/// share. 2^-19: twice the largest excess seen over 1500 property cases; it matters for f32 only.
pub const SCALE_FLOOR: f64 = 1.91e-6;
/// Relative backstops (of max |reference|), see [`tolerances`].
pub const REL_BACKSTOP_F32: f64 = 1e-5;
pub const REL_BACKSTOP_F16: f64 = 2e-3;
pub const REL_BACKSTOP_BF16: f64 = 1.6e-2;

/// A bound on `max |actual - reference|` implied by the rule (twice the naive error plus the
/// floors at the largest element), for comparisons that are not against the reference itself.
pub fn tolerance(dtype: DType, naive_err: f64, scale: f64) -> f64 {
    2.0 * naive_err + (tolerances(dtype).0 + SCALE_FLOOR) * scale
}

/// Error of the naive baseline against the reference; a naive output that is non-finite where
/// the reference is finite is a broken yardstick, never an infinite tolerance.
pub fn naive_err(what: &str, naive: &Tensor, reference: &[f64]) -> f64 {
    max_abs_err(naive, reference).unwrap().unwrap_or_else(|| {
        panic!("{what}: the naive baseline is non-finite where the reference is finite")
    })
}

/// FlashAttention's rule, per element:
/// `|fast_i - ref_i| <= 2 · naive_err + floor · |ref_i| + SCALE_FLOOR · max |ref|`,
/// where `naive_err` is the largest error of the naive implementation run in the same precision
/// (against the same f64 reference) and `floor` the dtype's unit roundoff ([`tolerances`]). NaN
/// or Inf where the reference is finite always fails. `backstop` adds the backstops (for N(0,1)
/// inputs): `max |fast - ref|` at most the smaller of the absolute one and the relative one
/// times max |ref|. `CANDLE_FLASH_TOL_REPORT=1` prints every comparison.
pub fn assert_close(what: &str, fast: &Tensor, naive: &Tensor, reference: &[f64], backstop: bool) {
    let dtype = fast.dtype();
    let (floor, rel_backstop, abs_backstop) = tolerances(dtype);
    let actual = values(fast).unwrap();
    let non_finite = || {
        panic!(
            "{what}: non-finite output where the reference is finite, or back ({})",
            first_non_finite_disagreement(&actual, reference)
        )
    };
    let err = max_abs_err_slice(&actual, reference).unwrap_or_else(non_finite);
    let beyond = max_err_beyond(&actual, reference, floor).unwrap_or_else(non_finite);
    let naive_err = naive_err(what, naive, reference);
    let scale = scale_of(reference);
    let cap = if backstop {
        abs_backstop.min(rel_backstop * scale)
    } else {
        f64::INFINITY
    };
    if std::env::var_os("CANDLE_FLASH_TOL_REPORT").is_some() {
        let s = scale.max(f64::MIN_POSITIVE);
        eprintln!(
            "tol-report {dtype:?} err/scale {:.3e} naive/scale {:.3e} (beyond floor - 2 naive)/scale {:.3e} scale {scale:.3e} | {what}",
            err / s,
            naive_err / s,
            (beyond - 2.0 * naive_err) / s,
        );
    }
    assert!(
        beyond <= 2.0 * naive_err + SCALE_FLOOR * scale && err <= cap,
        "{what}: max abs err {err:.3e} ({beyond:.3e} beyond the floor of {floor:.2e} |ref|) > 2 x naive err {naive_err:.3e} + {SCALE_FLOOR:.2e} x scale {scale:.3e}, or > backstop {cap:.3e}"
    );
}

/// Checks a log-sum-exp (f32, any device) against the reference: `-inf` exactly where the row
/// sees no key, NaN exactly where the reference is NaN, finite values within
/// `1e-4 · max(|ref|, 1)` plus 1e-5 for f32 inputs and 1e-3 for f16/bf16 ones (the scores are
/// f32 either way; the absolute term covers the rounding of the inputs' products, which the
/// reference shares, and the kernels' approximate exp2 and log).
pub fn check_lse(what: &str, lse: &Tensor, reference: &[f64], input_dtype: DType) {
    assert_eq!(lse.dtype(), DType::F32, "{what}: lse dtype");
    let l = values(lse).unwrap();
    assert_eq!(l.len(), reference.len(), "{what}: lse length");
    let abs = if input_dtype == DType::F32 {
        1e-5
    } else {
        1e-3
    };
    for (i, (&a, &r)) in l.iter().zip(reference).enumerate() {
        let ok = if r.is_finite() {
            (a - r).abs() <= 1e-4 * r.abs().max(1.0) + abs
        } else {
            a == r || (a.is_nan() && r.is_nan())
        };
        assert!(ok, "{what}: lse[{i}] = {a}, reference {r}");
    }
}

/// The stored bits of every element (f32, f16 or bf16), widened to u32: for bitwise comparisons
/// that NaN cannot slip through.
pub fn bits(t: &Tensor) -> Result<Vec<u32>> {
    if t.elem_count() == 0 {
        return Ok(Vec::new());
    }
    let t = t.to_device(&candle::Device::Cpu)?.flatten_all()?;
    Ok(match t.dtype() {
        DType::F32 => t.to_vec1::<f32>()?.iter().map(|x| x.to_bits()).collect(),
        DType::F16 => t
            .to_vec1::<half::f16>()?
            .iter()
            .map(|x| x.to_bits() as u32)
            .collect(),
        DType::BF16 => t
            .to_vec1::<half::bf16>()?
            .iter()
            .map(|x| x.to_bits() as u32)
            .collect(),
        other => candle::bail!("bits: unexpected dtype {other:?}"),
    })
}

/// Panics with the first differing element unless `a` and `b` have the same dtype, shape and
/// bits.
pub fn assert_bitwise_eq(what: &str, a: &Tensor, b: &Tensor) {
    assert_eq!(a.dtype(), b.dtype(), "{what}: dtypes differ");
    assert_eq!(a.dims(), b.dims(), "{what}: shapes differ");
    let (x, y) = (bits(a).unwrap(), bits(b).unwrap());
    if let Some(i) = x.iter().zip(&y).position(|(p, q)| p != q) {
        let (va, vb) = (values(a).unwrap(), values(b).unwrap());
        panic!(
            "{what}: element {i} differs ({} vs {}, bits {:#x} vs {:#x})",
            va[i], vb[i], x[i], y[i]
        );
    }
}
