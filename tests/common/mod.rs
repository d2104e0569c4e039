//! Test support: an f64 golden reference written from the spec (deliberately *not* using
//! `candle_flash::semantics`, so a bug there cannot hide in both), input builders and the
//! tolerance rule of shared/docs/testing.md.
#![allow(dead_code)]

pub mod gpu;
pub mod grad;

use candle::{DType, Device, IndexOp, Result, Tensor};
use candle_flash::semantics::Window;
use candle_flash::{naive_attention, FlashAttn};

/// Golden attention in f64 on the host. q `(b, sq, h, d)`, k/v `(b, sk, hk, d)` of any dtype
/// (values are taken exactly as stored). Returns the output `(b, sq, h, d)` and the natural-log
/// log-sum-exp `(b, h, sq)` (`-inf` for rows that see no key), both flattened.
pub fn reference(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    opts: &FlashAttn,
) -> Result<(Vec<f64>, Vec<f64>)> {
    let (b, sq, h, d) = q.dims4()?;
    let (_, sk, hk, _) = k.dims4()?;
    let qv = q.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?;
    let kv = k.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?;
    let vv = v.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?;
    let slopes: Option<Vec<f64>> = match &opts.alibi_slopes {
        None => None,
        Some(s) => {
            let s = s.to_dtype(DType::F64)?;
            let s = if s.rank() == 1 {
                s.unsqueeze(0)?.broadcast_as((b, h))?.contiguous()?
            } else {
                s
            };
            Some(s.flatten_all()?.to_vec1::<f64>()?)
        }
    };
    let scale = opts.softmax_scale as f64;
    let cap = opts.softcap.unwrap_or(0.0) as f64;
    let group = h / hk;
    let mut out = vec![0f64; b * sq * h * d];
    let mut lse = vec![f64::NEG_INFINITY; b * h * sq];
    let mut s = vec![0f64; sk];
    for bi in 0..b {
        for hi in 0..h {
            let kh = hi / group;
            for i in 0..sq {
                // Bottom-right alignment: row i lines up with key i + sk - sq.
                let diag = i as i64 + sk as i64 - sq as i64;
                let mut m = f64::NEG_INFINITY;
                let mut any = false;
                for (j, sj) in s.iter_mut().enumerate() {
                    let jj = j as i64;
                    if !visible(i, j, sq, sk, opts.window_size_left, opts.window_size_right) {
                        *sj = f64::NEG_INFINITY;
                        continue;
                    }
                    let mut dot = 0f64;
                    for x in 0..d {
                        dot += qv[((bi * sq + i) * h + hi) * d + x]
                            * kv[((bi * sk + j) * hk + kh) * d + x];
                    }
                    let mut sc = dot * scale;
                    if cap > 0.0 {
                        sc = cap * (sc / cap).tanh();
                    }
                    if let Some(sl) = &slopes {
                        sc -= sl[bi * h + hi] * (diag - jj).abs() as f64;
                    }
                    *sj = sc;
                    any = true;
                    if sc > m || sc.is_nan() {
                        m = sc;
                    }
                }
                if !any {
                    continue; // output stays exactly 0, lse -inf
                }
                let mut l = 0f64;
                let o = &mut out[((bi * sq + i) * h + hi) * d..][..d];
                for (j, &sj) in s.iter().enumerate() {
                    if sj == f64::NEG_INFINITY {
                        continue;
                    }
                    let p = (sj - m).exp();
                    l += p;
                    for (x, ox) in o.iter_mut().enumerate() {
                        *ox += p * vv[((bi * sk + j) * hk + kh) * d + x];
                    }
                }
                o.iter_mut().for_each(|x| *x /= l);
                lse[(bi * h + hi) * sq + i] = m + l.ln();
            }
        }
    }
    Ok((out, lse))
}

/// The mask from the spec (shared/docs/testing.md, bottom-right alignment): key `j` is visible to
/// query row `i` iff `diag - left <= j <= diag + right` with `diag = i + sk - sq` (`None` =
/// unbounded). In i128, so that window sizes up to `usize::MAX` cannot wrap.
pub fn visible(
    i: usize,
    j: usize,
    sq: usize,
    sk: usize,
    left: Option<usize>,
    right: Option<usize>,
) -> bool {
    let (j, diag) = (j as i128, i as i128 + sk as i128 - sq as i128);
    left.is_none_or(|l| j >= diag - l as i128) && right.is_none_or(|r| j <= diag + r as i128)
}

/// One sequence pair of a packed varlen batch as a dense batch of 1, with its options (per-batch
/// ALiBi slopes narrowed to its own row) and the rows `q0..q1` it occupies in the packed q.
pub struct Sequence {
    pub q0: usize,
    pub q1: usize,
    pub q: Tensor,
    pub k: Tensor,
    pub v: Tensor,
    pub opts: FlashAttn,
}

/// Splits a packed varlen batch into its sequence pairs.
pub fn sequences(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    cu_q: &[u32],
    cu_k: &[u32],
    opts: &FlashAttn,
) -> Result<Vec<Sequence>> {
    (0..cu_q.len() - 1)
        .map(|b| {
            let (q0, q1) = (cu_q[b] as usize, cu_q[b + 1] as usize);
            let (k0, k1) = (cu_k[b] as usize, cu_k[b + 1] as usize);
            let mut o = opts.clone();
            if let Some(s) = &opts.alibi_slopes {
                if s.rank() == 2 {
                    o.alibi_slopes = Some(s.i(b)?);
                }
            }
            Ok(Sequence {
                q0,
                q1,
                q: q.narrow(0, q0, q1 - q0)?.unsqueeze(0)?,
                k: k.narrow(0, k0, k1 - k0)?.unsqueeze(0)?,
                v: v.narrow(0, k0, k1 - k0)?.unsqueeze(0)?,
                opts: o,
            })
        })
        .collect()
}

/// Golden varlen attention: each packed sequence pair through [`reference`]. Returns the output
/// `(total_q, h, d)` and the lse `(h, total_q)`, flattened.
pub fn reference_varlen(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    cu_q: &[u32],
    cu_k: &[u32],
    opts: &FlashAttn,
) -> Result<(Vec<f64>, Vec<f64>)> {
    let (total_q, h, d) = q.dims3()?;
    let mut out = vec![0f64; total_q * h * d];
    let mut lse = vec![f64::NEG_INFINITY; h * total_q];
    for s in sequences(q, k, v, cu_q, cu_k, opts)? {
        let (ob, lb) = reference(&s.q, &s.k, &s.v, &s.opts)?;
        out[s.q0 * h * d..s.q1 * h * d].copy_from_slice(&ob);
        let sq = s.q1 - s.q0;
        for hi in 0..h {
            lse[hi * total_q + s.q0..hi * total_q + s.q1]
                .copy_from_slice(&lb[hi * sq..(hi + 1) * sq]);
        }
    }
    Ok((out, lse))
}

/// The naive implementation (same dtype, same device as the inputs) run per sequence pair of a
/// packed varlen batch: the precision yardstick for varlen outputs.
pub fn naive_varlen(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    cu_q: &[u32],
    cu_k: &[u32],
    opts: &FlashAttn,
) -> Result<Tensor> {
    let outs = sequences(q, k, v, cu_q, cu_k, opts)?
        .iter()
        .map(|s| naive_attention(&s.q, &s.k, &s.v, &s.opts)?.squeeze(0))
        .collect::<Result<Vec<_>>>()?;
    Tensor::cat(&outs, 0)
}

/// One winning key with scores around 1e4 (q = 6.25, the winner's key 100, every other key
/// +-99 alternating, so its score is exactly 0): with scale 1 the output of every row is exactly
/// the winner's value row, in every dtype. Returns f32 `(q, k, v)` `(1, 5, 1, 16)` /
/// `(1, 9, 1, 16)` on the CPU and the winner's index.
pub fn planted_winner() -> Result<(Tensor, Tensor, Tensor, usize)> {
    let dev = Device::Cpu;
    let (sq, sk, d) = (5, 9, 16);
    let winner = 6;
    let mut kd = vec![0f32; sk * d];
    for x in 0..d {
        for j in 0..sk {
            kd[j * d + x] = if j == winner {
                100.0
            } else if (j + x) % 2 == 0 {
                99.0
            } else {
                -99.0
            };
        }
    }
    let q = Tensor::full(6.25f32, (1, sq, 1, d), &dev)?;
    let k = Tensor::from_vec(kd, (1, sk, 1, d), &dev)?;
    let v = randn(&[1, sk, 1, d], DType::F32, 61, &dev)?;
    Ok((q, k, v, winner))
}

/// Window sizes the mask probe enumerates on both sides.
pub const PROBE_WINDOWS: [Option<usize>; 7] = [
    None,
    Some(0),
    Some(1),
    Some(3),
    Some(200),
    Some(1 << 40),
    Some(usize::MAX),
];

/// A mask probe: with q = 0 every score is exactly 0, and V's row `j` is the one-hot `e_j`, so
/// `output[i][j] = 1 / count_i` where key `j` is visible to row `i` (count_i keys visible) and
/// exactly 0 elsewhere; a row that sees no key is all 0 with lse `-inf`, otherwise its lse is
/// `ln(count_i)`. Needs `d >= sk`.
pub struct MaskProbe {
    pub q: Tensor,
    pub k: Tensor,
    pub v: Tensor,
    pub opts: FlashAttn,
    /// Expected output `(1, sq, h, d)`, flattened, already rounded to the dtype.
    pub out: Vec<f64>,
    /// Expected lse `(1, h, sq)`, flattened.
    pub lse: Vec<f64>,
}

/// Builds a [`MaskProbe`] on the CPU. The visible keys come from
/// `candle_flash::semantics::Window::key_range`, which is first checked against [`visible`]
/// (the spec written here), so neither can be wrong alone.
#[allow(clippy::too_many_arguments)]
pub fn mask_probe(
    sq: usize,
    sk: usize,
    h: usize,
    hk: usize,
    d: usize,
    left: Option<usize>,
    right: Option<usize>,
    dtype: DType,
) -> Result<MaskProbe> {
    assert!(d >= sk, "one-hot values need d >= sk");
    let dev = Device::Cpu;
    let window = Window::new(left, right);
    let mut vd = vec![0f32; sk * hk * d];
    for j in 0..sk {
        for kh in 0..hk {
            vd[(j * hk + kh) * d + j] = 1.0;
        }
    }
    let mut out = vec![0f64; sq * h * d];
    let mut lse = vec![f64::NEG_INFINITY; h * sq];
    for i in 0..sq {
        let (lo, hi) = window.key_range(i, sq, sk);
        for j in 0..sk {
            assert_eq!(
                (lo..hi).contains(&j),
                visible(i, j, sq, sk, left, right),
                "semantics::Window::key_range({i}, {sq}, {sk}) = {lo}..{hi} for {window:?} disagrees with the spec at key {j}"
            );
        }
        let count = hi - lo;
        if count == 0 {
            continue;
        }
        // The kernels compute 1/l in f32 and round the product once to the dtype.
        let w = Tensor::new(&[1f32 / count as f32], &dev)?.to_dtype(dtype)?;
        let w = values(&w)?[0];
        for hi_ in 0..h {
            for j in lo..hi {
                out[(i * h + hi_) * d + j] = w;
            }
            lse[hi_ * sq + i] = (count as f64).ln();
        }
    }
    Ok(MaskProbe {
        q: Tensor::zeros((1, sq, h, d), dtype, &dev)?,
        k: randn(&[1, sk, hk, d], dtype, (sq * 1000 + sk) as u64, &dev)?,
        v: Tensor::from_vec(vd, (1, sk, hk, d), &dev)?.to_dtype(dtype)?,
        opts: FlashAttn::new(1.0 / (d as f32).sqrt()).window(left, right),
        out,
        lse,
    })
}

/// Checks an output of a [`MaskProbe`]: f32 exactly; f16/bf16 within one unit of the dtype
/// (1/c and 1/(c+1) differ by more than that for every c < 64), masked elements and rows that see
/// nothing exactly 0; lse within 1e-5 of ln(count), `-inf` for empty rows.
pub fn check_mask_probe(what: &str, p: &MaskProbe, out: &Tensor, lse: &Tensor) {
    let dtype = out.dtype();
    let rel = match dtype {
        DType::F32 => 0.0,
        DType::F16 => 2f64.powi(-10),
        _ => 2f64.powi(-7),
    };
    let got = values(out).unwrap();
    let (sq, h) = (p.q.dim(1).unwrap(), p.q.dim(2).unwrap());
    let d = p.q.dim(3).unwrap();
    for (n, (&g, &w)) in got.iter().zip(&p.out).enumerate() {
        let ok = if w == 0.0 {
            g == 0.0
        } else {
            (g - w).abs() <= rel * w
        };
        if !ok {
            let (i, hh, j) = (n / (h * d), (n / d) % h, n % d);
            panic!("{what}: out[row {i}, head {hh}, col {j}] = {g}, expected {w} (sq {sq})");
        }
    }
    let l = values(lse).unwrap();
    for (n, (&g, &w)) in l.iter().zip(&p.lse).enumerate() {
        let ok = if w == f64::NEG_INFINITY {
            g == w
        } else {
            (g - w).abs() <= 1e-5
        };
        assert!(
            ok,
            "{what}: lse[head {}, row {}] = {g}, expected {w}",
            n / sq,
            n % sq
        );
    }
}

/// Seeded N(0, 1) data of the given dtype (candle's CPU RNG is not seedable, so use our own).
pub fn randn(shape: &[usize], dtype: DType, seed: u64, device: &Device) -> Result<Tensor> {
    let n: usize = shape.iter().product();
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut next = || {
        // xorshift64*, then Box-Muller.
        state ^= state >> 12;
        state ^= state << 25;
        state ^= state >> 27;
        (state.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 11) as f64 / (1u64 << 53) as f64
    };
    let data: Vec<f32> = (0..n)
        .map(|_| {
            let (u1, u2) = (next().max(1e-300), next());
            ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32
        })
        .collect();
    Tensor::from_vec(data, shape, device)?.to_dtype(dtype)
}

/// Every element of `t` as f64, flattened; NaN and infinities kept.
pub fn values(t: &Tensor) -> Result<Vec<f64>> {
    t.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()
}

/// NaN-propagating largest `|actual - reference|`, the one fold every comparison goes through
/// (candle's `max` drops a NaN that is not the first element, so `(a - b).abs().max()` cannot
/// be trusted). `None` when the two disagree on a non-finite value: NaN or Inf where the
/// reference is finite, or anything but the same NaN/Inf where it is not. That always fails,
/// whatever the tolerance.
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
/// the row length) and the absolute backstop of shared/docs/testing.md (for N(0,1) inputs).
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
    let non_finite = || panic!("{what}: non-finite output where the reference is finite");
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

/// The stored bits of every element (f32, f16 or bf16), widened to u32: for bitwise comparisons
/// that NaN cannot slip through.
pub fn bits(t: &Tensor) -> Result<Vec<u32>> {
    let t = t.flatten_all()?;
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

/// A `(b, s, h, d)` view of `t` whose storage is `(b, h, s, d)`: same values, non-contiguous.
pub fn transposed_view(t: &Tensor) -> Result<Tensor> {
    t.transpose(1, 2)?.contiguous()?.transpose(1, 2)
}

/// A view of `t` inside a larger NaN-filled buffer (guard bands on every side of every dim and
/// a non-zero start offset), so that any out-of-bounds read shows up as NaN in the output.
pub fn view_in_nan_buffer(t: &Tensor) -> Result<Tensor> {
    let dims = t.dims().to_vec();
    let padded: Vec<usize> = dims.iter().map(|&n| n + 3).collect();
    let mut buf = Tensor::full(f32::NAN, padded.as_slice(), t.device())?.to_dtype(t.dtype())?;
    let ranges: Vec<std::ops::Range<usize>> = dims.iter().map(|&n| 1..1 + n).collect();
    buf = buf.slice_assign(&ranges, t)?;
    let mut view = buf;
    for (axis, &n) in dims.iter().enumerate() {
        view = view.narrow(axis, 1, n)?;
    }
    Ok(view)
}

/// Golden attention with multimodal prefix ranges, from the spec: as [`reference`] for a batch
/// of 1, except that key `j` is also visible to row `i` when one range `[s, e)` with `s < e`
/// holds both `j` and the row's absolute position `i + sk - sq` (scale and window only: no
/// softcap, no ALiBi). Returns the output
/// `(1, sq, h, d)` and the lse `(1, h, sq)`, flattened.
pub fn reference_prefix(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    opts: &FlashAttn,
    ranges: &[[i64; 2]],
) -> Result<(Vec<f64>, Vec<f64>)> {
    let (_, sq, h, d) = q.dims4()?;
    let (_, sk, hk, _) = k.dims4()?;
    let f = |t: &Tensor| t.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>();
    let (qv, kv, vv) = (f(q)?, f(k)?, f(v)?);
    let mut out = vec![0f64; sq * h * d];
    let mut lse = vec![f64::NEG_INFINITY; h * sq];
    for hi in 0..h {
        let kh = hi / (h / hk);
        for i in 0..sq {
            let pos = i as i64 + sk as i64 - sq as i64;
            let sees = |j: usize| {
                visible(i, j, sq, sk, opts.window_size_left, opts.window_size_right)
                    || ranges.iter().any(|&[s, e]| {
                        s < e && s <= j as i64 && (j as i64) < e && s <= pos && pos < e
                    })
            };
            let scores: Vec<Option<f64>> = (0..sk)
                .map(|j| {
                    sees(j).then(|| {
                        let dot: f64 = (0..d)
                            .map(|x| qv[(i * h + hi) * d + x] * kv[(j * hk + kh) * d + x])
                            .sum();
                        dot * opts.softmax_scale as f64
                    })
                })
                .collect();
            let m = scores
                .iter()
                .flatten()
                .fold(f64::NEG_INFINITY, |a, &b| a.max(b));
            if m == f64::NEG_INFINITY {
                continue;
            }
            let mut l = 0f64;
            let o = &mut out[(i * h + hi) * d..][..d];
            for (j, s) in scores.iter().enumerate() {
                if let Some(s) = s {
                    let p = (s - m).exp();
                    l += p;
                    for (x, ox) in o.iter_mut().enumerate() {
                        *ox += p * vv[(j * hk + kh) * d + x];
                    }
                }
            }
            o.iter_mut().for_each(|x| *x /= l);
            lse[hi * sq + i] = m + l.ln();
        }
    }
    Ok((out, lse))
}
