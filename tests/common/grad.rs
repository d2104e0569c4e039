//! Golden gradients: the analytic backward pass of attention in f64 on the host, written from
//! the spec (the mask is [`super::visible`], not `candle_flash::semantics`), for the loss
//! `L = Σ out ∘ grad_out`.
//!
//! Per query row `i` of head `h` (K/V head `h / (h / hk)`), with `z_j = scale · q_i·k_j`:
//!
//! * `s_j = c · tanh(z_j / c)` with a softcap `c`, else `s_j = z_j`; ALiBi subtracts
//!   `slope · |i + sk - sq - j|`; masked keys drop out;
//! * `P_j = exp(s_j - lse_i)`, `o_i = Σ_j P_j v_j`, `D_i = dO_i · o_i` (the exact `o`, not the
//!   fast path's rounded output);
//! * `dv_j += P_j dO_i`, `dP_j = dO_i · v_j`, `dS_j = P_j (dP_j - D_i)`;
//! * `dz_j = dS_j · (1 - tanh²(z_j / c))` (`= dS_j` without softcap);
//! * `dq_i += scale · dz_j k_j`, `dk_j += scale · dz_j q_i`.
//!
//! Rows that see no key contribute nothing (their gradients are exactly 0). GQA gradients of
//! k and v are sums over the query heads of their group.
#![allow(dead_code)]

use candle::{DType, Result, Tensor, Var};
use candle_flash::FlashAttn;

use super::{
    max_abs_err_slice, max_err_beyond, scale_of, sequences, tolerances, values, visible,
    SCALE_FLOOR,
};

/// f64 gradients of q, k and v, each flattened in the *contiguous* layout of its tensor:
/// dense `(b, sq, h, d)` / `(b, sk, hk, d)`, varlen `(total_q, h, d)` / `(total_k, hk, d)`.
#[derive(Clone, Debug)]
pub struct RefGrads {
    pub dq: Vec<f64>,
    pub dk: Vec<f64>,
    pub dv: Vec<f64>,
}

/// Analytic f64 gradients of `FlashAttn::forward(q, k, v)` with the options `opts` (scale,
/// window / causal, softcap, ALiBi slopes `(h,)` or `(b, h)`; paged caches and prefix ranges
/// are not covered) for the loss `Σ out ∘ grad_out`.
///
/// * q `(b, sq, h, d)`, k and v `(b, sk, hk, d)`, `grad_out` shaped like q;
/// * any dtype (values are taken exactly as stored, so pass the tensors the fast path saw),
///   any device, any layout (non-contiguous views are fine): everything is pulled to the host
///   as f64;
/// * returns dq, dk, dv flattened in the contiguous layouts of q, k and v.
///
/// Compare with `assert_close`-style rules against [`super::values`] of the fast gradients.
pub fn reference_grads(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    grad_out: &Tensor,
    opts: &FlashAttn,
) -> Result<RefGrads> {
    let (b, sq, h, d) = q.dims4()?;
    let (_, sk, hk, _) = k.dims4()?;
    if grad_out.dims() != q.dims() {
        candle::bail!(
            "reference_grads: grad_out {:?} is not shaped like q",
            grad_out.dims()
        )
    }
    let slopes: Option<Vec<f64>> = match &opts.alibi_slopes {
        None => None,
        Some(s) => {
            let s = s.to_device(&candle::Device::Cpu)?.to_dtype(DType::F64)?;
            let s = if s.rank() == 1 {
                s.unsqueeze(0)?.broadcast_as((b, h))?.contiguous()?
            } else {
                s
            };
            Some(s.flatten_all()?.to_vec1::<f64>()?)
        }
    };
    let host = |t: &Tensor| values(&t.to_device(&candle::Device::Cpu)?);
    let g = Geometry {
        b,
        sq,
        sk,
        h,
        hk,
        d,
        scale: opts.softmax_scale as f64,
        cap: opts.softcap.unwrap_or(0.0) as f64,
        left: opts.window_size_left,
        right: opts.window_size_right,
    };
    Ok(g.grads(
        &host(q)?,
        &host(k)?,
        &host(v)?,
        &host(grad_out)?,
        slopes.as_deref(),
    ))
}

/// [`reference_grads`] of a packed varlen call (`FlashAttn::forward_varlen`): q and `grad_out`
/// `(total_q, h, d)`, k and v `(total_k, hk, d)`, host copies of the cumulative lengths
/// `cu_q`/`cu_k` (`batch + 1` entries from 0); per-batch ALiBi slopes `(batch, h)` apply to
/// their own sequence. Returns dq `(total_q, h, d)`, dk and dv `(total_k, hk, d)` flattened;
/// k/v rows no sequence uses get 0.
pub fn reference_grads_varlen(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    grad_out: &Tensor,
    cu_q: &[u32],
    cu_k: &[u32],
    opts: &FlashAttn,
) -> Result<RefGrads> {
    let (total_q, h, d) = q.dims3()?;
    let (total_k, hk, _) = k.dims3()?;
    let cpu = candle::Device::Cpu;
    let (q, k, v) = (q.to_device(&cpu)?, k.to_device(&cpu)?, v.to_device(&cpu)?);
    let grad_out = grad_out.to_device(&cpu)?;
    let mut opts = opts.clone();
    if let Some(s) = &opts.alibi_slopes {
        opts.alibi_slopes = Some(s.to_device(&cpu)?);
    }
    let mut out = RefGrads {
        dq: vec![0.0; total_q * h * d],
        dk: vec![0.0; total_k * hk * d],
        dv: vec![0.0; total_k * hk * d],
    };
    let seqs = sequences(&q, &k, &v, cu_q, cu_k, &opts)?;
    for (s, w) in seqs.iter().zip(cu_k.windows(2)) {
        let go = grad_out.narrow(0, s.q0, s.q1 - s.q0)?.unsqueeze(0)?;
        let r = reference_grads(&s.q, &s.k, &s.v, &go, &s.opts)?;
        let k0 = w[0] as usize;
        out.dq[s.q0 * h * d..s.q1 * h * d].copy_from_slice(&r.dq);
        out.dk[k0 * hk * d..][..r.dk.len()].copy_from_slice(&r.dk);
        out.dv[k0 * hk * d..][..r.dv.len()].copy_from_slice(&r.dv);
    }
    Ok(out)
}

/// The shape and options of one dense call.
struct Geometry {
    b: usize,
    sq: usize,
    sk: usize,
    h: usize,
    hk: usize,
    d: usize,
    scale: f64,
    cap: f64,
    left: Option<usize>,
    right: Option<usize>,
}

impl Geometry {
    fn grads(
        &self,
        q: &[f64],
        k: &[f64],
        v: &[f64],
        go: &[f64],
        slopes: Option<&[f64]>,
    ) -> RefGrads {
        let Geometry {
            b,
            sq,
            sk,
            h,
            hk,
            d,
            scale,
            cap,
            ..
        } = *self;
        let mut dq = vec![0f64; b * sq * h * d];
        let mut dk = vec![0f64; b * sk * hk * d];
        let mut dv = vec![0f64; b * sk * hk * d];
        let group = h / hk;
        let qi = |bi: usize, i: usize, hi: usize| ((bi * sq + i) * h + hi) * d;
        let kj = |bi: usize, j: usize, kh: usize| ((bi * sk + j) * hk + kh) * d;
        // Per key of the current row: score (None = masked) and d s / d z.
        let mut s: Vec<Option<(f64, f64)>> = vec![None; sk];
        let mut o = vec![0f64; d];
        for bi in 0..b {
            for hi in 0..h {
                let kh = hi / group;
                let slope = slopes.map_or(0.0, |s| s[bi * h + hi]);
                for i in 0..sq {
                    let diag = i as i64 + sk as i64 - sq as i64;
                    let qr = &q[qi(bi, i, hi)..][..d];
                    let mut m = f64::NEG_INFINITY;
                    for (j, sj) in s.iter_mut().enumerate() {
                        *sj = None;
                        if !visible(i, j, sq, sk, self.left, self.right) {
                            continue;
                        }
                        let kr = &k[kj(bi, j, kh)..][..d];
                        let z = scale * qr.iter().zip(kr).map(|(a, b)| a * b).sum::<f64>();
                        let (mut sc, dsdz) = if cap > 0.0 {
                            let t = (z / cap).tanh();
                            (cap * t, 1.0 - t * t)
                        } else {
                            (z, 1.0)
                        };
                        sc -= slope * (diag - j as i64).abs() as f64;
                        if sc > m || sc.is_nan() {
                            m = sc;
                        }
                        *sj = Some((sc, dsdz));
                    }
                    if m == f64::NEG_INFINITY {
                        continue; // no key seen: zero gradients
                    }
                    let l: f64 = s.iter().flatten().map(|&(sc, _)| (sc - m).exp()).sum();
                    let lse = m + l.ln();
                    let gr = &go[qi(bi, i, hi)..][..d];
                    o.iter_mut().for_each(|x| *x = 0.0);
                    for (j, sj) in s.iter().enumerate() {
                        if let Some((sc, _)) = sj {
                            let p = (sc - lse).exp();
                            let vr = &v[kj(bi, j, kh)..][..d];
                            o.iter_mut().zip(vr).for_each(|(o, v)| *o += p * v);
                        }
                    }
                    let big_d: f64 = gr.iter().zip(&o).map(|(a, b)| a * b).sum();
                    for (j, sj) in s.iter().enumerate() {
                        let Some((sc, dsdz)) = *sj else { continue };
                        let p = (sc - lse).exp();
                        let base = kj(bi, j, kh);
                        let vr = &v[base..][..d];
                        let dp: f64 = gr.iter().zip(vr).map(|(a, b)| a * b).sum();
                        let dz = p * (dp - big_d) * dsdz;
                        for x in 0..d {
                            dv[base + x] += p * gr[x];
                            dk[base + x] += scale * dz * qr[x];
                            dq[qi(bi, i, hi) + x] += scale * dz * k[base + x];
                        }
                    }
                }
            }
        }
        RefGrads { dq, dk, dv }
    }
}

// ---------------------------------------------------------------------------------------------
// Autograd and the comparison rule, for the CPU and GPU backward tests.

/// Gradients of q, k and v.
pub type Grads = (Tensor, Tensor, Tensor);

/// Gradients of `loss = Σ f(q, k, v) ∘ g` (in f32) by candle autograd. A gradient that does not
/// reach q, k or v is an error, never a zero.
pub fn autograd(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    g: &Tensor,
    f: impl Fn(&Tensor, &Tensor, &Tensor) -> Result<Tensor>,
) -> Result<Grads> {
    let (qv, kv, vv) = (
        Var::from_tensor(q)?,
        Var::from_tensor(k)?,
        Var::from_tensor(v)?,
    );
    let out = f(qv.as_tensor(), kv.as_tensor(), vv.as_tensor())?;
    let loss = (out.to_dtype(DType::F32)? * g.to_dtype(DType::F32)?)?.sum_all()?;
    let grads = loss.backward()?;
    let get = |x: &Var, name: &str| {
        grads
            .get(x.as_tensor())
            .cloned()
            .ok_or_else(|| candle::Error::Msg(format!("no gradient reached {name}")))
    };
    Ok((get(&qv, "q")?, get(&kv, "k")?, get(&vv, "v")?))
}

/// Checks flash gradients against the f64 reference with the rule of `common::assert_close`
/// (`|fast - ref| <= 2 · naive_err + u · |ref| + SCALE_FLOOR · scale` per element), the naive
/// autograd gradients (same dtype) being the yardstick, with two changes for gradients:
///
/// * `scale` is the largest |reference| over dq, dk *and* dv, since a gradient can be exactly
///   0 (one key: `P = 1`, `dP = D`) while the rounding of its terms is not;
/// * candle autograd through `naive_attention` gives NaN in rows that see no key (its
///   backward goes through the `-inf` mask), so `naive_err` is taken over its finite
///   elements; the flash gradients must be finite everywhere the reference is.
///
/// Shapes and dtypes must be those of q, k, v.
pub fn check_grads(what: &str, fast: &Grads, naive: &Grads, r: &RefGrads, like: [&Tensor; 3]) {
    let parts = [
        ("dq", &fast.0, &naive.0, &r.dq),
        ("dk", &fast.1, &naive.1, &r.dk),
        ("dv", &fast.2, &naive.2, &r.dv),
    ];
    let scale = [&r.dq, &r.dk, &r.dv]
        .iter()
        .map(|x| scale_of(x))
        .fold(0f64, f64::max);
    for ((name, f, n, r), t) in parts.into_iter().zip(like) {
        let what = format!("{what} {name}");
        assert_eq!(f.dims(), t.dims(), "{what}: shape");
        assert_eq!(f.dtype(), t.dtype(), "{what}: dtype");
        let (floor, _, _) = tolerances(f.dtype());
        let actual = values(f).unwrap();
        let err = max_abs_err_slice(&actual, r)
            .unwrap_or_else(|| panic!("{what}: non-finite gradient where the reference is finite"));
        let beyond = max_err_beyond(&actual, r, floor).unwrap();
        let naive = values(n).unwrap();
        let naive_err = naive
            .iter()
            .zip(r.iter())
            .filter(|(n, _)| n.is_finite())
            .fold(0f64, |m, (n, r)| m.max((n - r).abs()));
        if std::env::var_os("CANDLE_FLASH_TOL_REPORT").is_some() {
            let s = scale.max(f64::MIN_POSITIVE);
            eprintln!(
                "tol-report {:?} err/scale {:.3e} naive/scale {:.3e} scale {scale:.3e} | {what}",
                f.dtype(),
                err / s,
                naive_err / s
            );
        }
        assert!(
            beyond <= 2.0 * naive_err + SCALE_FLOOR * scale,
            "{what}: max abs err {err:.3e} ({beyond:.3e} beyond the floor of {floor:.2e} |ref|) > 2 x naive err {naive_err:.3e} + {SCALE_FLOOR:.2e} x scale {scale:.3e}"
        );
    }
}

/// Whether every gradient is finite where the reference is.
pub fn finite_where(g: &Grads, r: &RefGrads) -> bool {
    [(&g.0, &r.dq), (&g.1, &r.dk), (&g.2, &r.dv)]
        .iter()
        .all(|(t, r)| max_abs_err_slice(&values(t).unwrap(), r).is_some())
}

// ---------------------------------------------------------------------------------------------
// The explicit backward (`FlashAttn::backward`), for the CPU and GPU backward tests.

/// `FlashAttn::backward` and `backward_varlen` on `dev` give bitwise the gradients that
/// `loss.backward()` gives through the op (dense with GQA, a causal window, softcap and ALiBi,
/// q transposed in storage; varlen with an empty sequence), in each of `dtypes`; and refuse
/// saved results that do not belong to the call, naming the argument.
pub fn explicit_backward_matches_autograd(dev: &candle::Device, dtypes: &[DType]) {
    use super::{assert_bitwise_eq, randn, transposed_view};
    let slopes = Tensor::new(&[0.3f32, 0.1, 0.5, 0.05, 0.2, 0.0], dev).unwrap();
    let cases = [
        FlashAttn::new(0.125),
        FlashAttn::new(0.125)
            .window(Some(30), Some(0))
            .softcap(4.0)
            .alibi(&slopes),
    ];
    for &dtype in dtypes {
        for (n, opts) in cases.iter().enumerate() {
            let what = format!("{dtype:?} case {n}");
            let (b, sq, sk, h, hk, d) = (2, 77, 91, 6, 2, 64);
            let q = randn(&[b, sq, h, d], dtype, 10 + n as u64, dev).unwrap();
            let k = randn(&[b, sk, hk, d], dtype, 20, dev).unwrap();
            let v = randn(&[b, sk, hk, d], dtype, 30, dev).unwrap();
            let g = randn(&[b, sq, h, d], dtype, 40, dev).unwrap();
            let q = transposed_view(&q).unwrap();
            let want = autograd(&q, &k, &v, &g, |q, k, v| opts.forward(q, k, v)).unwrap();
            let (out, lse) = opts.forward_with_lse(&q, &k, &v).unwrap();
            let got = opts.backward(&q, &k, &v, &out, &g, &lse).unwrap();
            assert_bitwise_eq(&format!("{what} dq"), &got.0, &want.0);
            assert_bitwise_eq(&format!("{what} dk"), &got.1, &want.1);
            assert_bitwise_eq(&format!("{what} dv"), &got.2, &want.2);

            // Saved results of another call, or of the wrong kind: errors naming them.
            let expect_err = |r: Result<(Tensor, Tensor, Tensor)>, name: &str| {
                let e = r.expect_err(name).to_string();
                assert!(e.contains(name), "{what}: {e:?} does not name {name}");
            };
            let short = out.narrow(1, 0, sq - 1).unwrap();
            expect_err(opts.backward(&q, &k, &v, &short, &g, &lse), "out");
            expect_err(opts.backward(&q, &k, &v, &out, &short, &lse), "grad_out");
            let lse16 = lse.to_dtype(DType::F16).unwrap();
            expect_err(opts.backward(&q, &k, &v, &out, &g, &lse16), "lse");
            let lse_t = lse.narrow(2, 1, sq - 1).unwrap();
            expect_err(opts.backward(&q, &k, &v, &out, &g, &lse_t), "lse");
            let other = if dtype == DType::F32 {
                DType::BF16
            } else {
                DType::F32
            };
            let out_x = out.to_dtype(other).unwrap();
            expect_err(opts.backward(&q, &k, &v, &out_x, &g, &lse), "out");
            let g_int = g.to_dtype(DType::U32).unwrap();
            expect_err(opts.backward(&q, &k, &v, &out, &g_int, &lse), "grad_out");
        }
        // Varlen: three sequences, the middle one without queries.
        let cu_q = [0u32, 37, 37, 120];
        let cu_k = [0u32, 50, 61, 140];
        let (h, hk, d) = (4, 2, 64);
        let opts = FlashAttn::new(0.125).causal();
        let q = randn(&[120, h, d], dtype, 50, dev).unwrap();
        let k = randn(&[140, hk, d], dtype, 51, dev).unwrap();
        let v = randn(&[140, hk, d], dtype, 52, dev).unwrap();
        let g = randn(&[120, h, d], dtype, 53, dev).unwrap();
        let cq = Tensor::new(&cu_q, dev).unwrap();
        let ck = Tensor::new(&cu_k, dev).unwrap();
        let want = autograd(&q, &k, &v, &g, |q, k, v| {
            opts.forward_varlen(q, k, v, &cq, &ck, 83, 79)
        })
        .unwrap();
        let (out, lse) = opts
            .forward_varlen_with_lse(&q, &k, &v, &cq, &ck, 83, 79)
            .unwrap();
        let got = opts
            .backward_varlen(&q, &k, &v, &out, &g, &lse, &cq, &ck, 83, 79)
            .unwrap();
        assert_bitwise_eq(&format!("{dtype:?} varlen dq"), &got.0, &want.0);
        assert_bitwise_eq(&format!("{dtype:?} varlen dk"), &got.1, &want.1);
        assert_bitwise_eq(&format!("{dtype:?} varlen dv"), &got.2, &want.2);
    }
}
