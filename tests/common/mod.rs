//! Test support: an f64 golden reference written from the spec (deliberately *not* using
//! `candle_flash::semantics`, so a bug there cannot hide in both), input builders and the
//! tolerance rule of shared/docs/testing.md.
#![allow(dead_code)]

use candle::{DType, Device, IndexOp, Result, Tensor};
use candle_flash::FlashAttn;

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
                    // i128: window sizes up to usize::MAX must not wrap.
                    let (jw, dw) = (jj as i128, diag as i128);
                    let visible = opts.window_size_left.is_none_or(|l| jw >= dw - l as i128)
                        && opts.window_size_right.is_none_or(|r| jw <= dw + r as i128);
                    if !visible {
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

/// Largest absolute difference to the reference; `None` when a value is NaN/inf where the
/// reference is finite (that always fails, whatever the tolerance).
pub fn max_abs_err(actual: &Tensor, reference: &[f64]) -> Result<Option<f64>> {
    let a = actual
        .to_dtype(DType::F64)?
        .flatten_all()?
        .to_vec1::<f64>()?;
    assert_eq!(
        a.len(),
        reference.len(),
        "output has the wrong number of elements"
    );
    let mut err = 0f64;
    for (x, r) in a.iter().zip(reference) {
        if r.is_finite() && !x.is_finite() {
            return Ok(None);
        }
        if r.is_finite() {
            err = err.max((x - r).abs());
        }
    }
    Ok(Some(err))
}

/// Floors and absolute backstops of shared/docs/testing.md, per dtype.
pub fn tolerances(dtype: DType) -> (f64, f64) {
    match dtype {
        DType::F32 => (2e-5, 1e-4),
        DType::F16 => (1e-3, 4e-3),
        DType::BF16 => (6e-3, 2.5e-2),
        _ => unreachable!("only float dtypes are tested"),
    }
}

/// FlashAttention's rule: the fast path's error against the f64 reference is at most twice the
/// error of the naive implementation run in the same precision, plus a floor; and (for N(0,1)
/// inputs) under an absolute backstop. Panics with `what` on failure.
pub fn assert_close(what: &str, fast: &Tensor, naive: &Tensor, reference: &[f64], backstop: bool) {
    let dtype = fast.dtype();
    let (floor, cap) = tolerances(dtype);
    let err = max_abs_err(fast, reference).unwrap();
    let naive_err = max_abs_err(naive, reference)
        .unwrap()
        .unwrap_or(f64::INFINITY);
    let err =
        err.unwrap_or_else(|| panic!("{what}: non-finite output where the reference is finite"));
    let tol = 2.0 * naive_err.min(cap) + floor;
    assert!(
        err <= tol && (!backstop || err <= cap),
        "{what}: max abs err {err:.3e} > tolerance {tol:.3e} (naive err {naive_err:.3e}, backstop {cap:.1e})"
    );
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
