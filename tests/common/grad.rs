//! Golden gradients: the analytic backward pass of attention in f64 on the host, written from
//! the spec (the mask is [`super::visible`], not `candle_flash::semantics`), for the loss
//! `L = Σ out ∘ grad_out`; and the gradient check.
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

use candle::{DType, Device, Result, Tensor, Var};
use candle_flash::FlashAttn;
use rayon::prelude::*;

use super::{
    axpy, dot, first_non_finite_disagreement, host_slopes, input_key, max_abs_err_slice,
    max_err_beyond, memoized, scale_of, sequences, tolerances, values, visible_keys, SCALE_FLOOR,
};

/// f64 gradients of q, k and v, each flattened in the *contiguous* layout of its tensor:
/// dense `(b, sq, h, d)` / `(b, sk, hk, d)`, varlen `(total_q, h, d)` / `(total_k, hk, d)`.
#[derive(Clone, Debug)]
pub struct RefGrads {
    pub dq: Vec<f64>,
    pub dk: Vec<f64>,
    pub dv: Vec<f64>,
    /// `(h,)`: `-Σ_i exp(sink - lse_i) D_i` over the rows of each head (zeros without sinks).
    pub dsinks: Vec<f64>,
    /// `(b, h, sq, sk)`: the gradient of every final score, `dS = P (dP - D)` (0 where hidden),
    /// which is a bias's gradient before the sum over its broadcast dimensions (see
    /// [`dbias_of`]). Empty for varlen calls.
    pub ds: Vec<f64>,
}

/// The gradient of a bias of shape `bias_dims` (broadcastable to `(b, h, sq, sk)`) from the
/// reference's score gradients: summed over the dimensions along which it is broadcast, in the
/// bias's contiguous layout.
pub fn dbias_of(
    r: &RefGrads,
    (b, h, sq, sk): (usize, usize, usize, usize),
    bias_dims: &[usize],
) -> Vec<f64> {
    let mut dims = bias_dims.to_vec();
    while dims.len() < 4 {
        dims.insert(0, 1);
    }
    let full = [b, h, sq, sk];
    let mut out = vec![0f64; dims.iter().product()];
    for (n, &x) in r.ds.iter().enumerate() {
        let mut rest = n;
        let mut at = 0;
        for axis in 0..4 {
            let stride: usize = full[axis + 1..].iter().product();
            let i = rest / stride;
            rest %= stride;
            at = at * dims[axis] + if dims[axis] == 1 { 0 } else { i };
        }
        out[at] += x;
    }
    out
}

/// Analytic f64 gradients of `FlashAttn::forward(q, k, v)` with the options `opts` (scale,
/// window / causal, softcap, ALiBi slopes `(h,)` or `(b, h)`; paged caches and prefix ranges
/// are not covered) for the loss `Σ out ∘ grad_out`.
///
/// * q `(b, sq, h, d)`, k and v `(b, sk, hk, d)`, `grad_out` shaped like q;
/// * any dtype (values are taken exactly as stored, so pass the tensors the fast path saw),
///   any device, any layout (non-contiguous views are fine): everything is pulled to the host
///   as f64;
/// * returns dq, dk, dv flattened in the contiguous layouts of q, k and v. Each (batch, K/V
///   head) group runs in parallel.
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
        sinks: super::host_sinks(opts)?,
        extras: super::reference::HostExtras::of(opts, (b, h, sq, sk))?,
    };
    let (qv, kv, vv, gv) = (values(q)?, values(k)?, values(v)?, values(grad_out)?);
    let slopes = host_slopes(opts, b, h)?;
    let dims = [q.dims(), k.dims(), v.dims()];
    let key = input_key(
        "grads",
        &dims,
        &[&qv, &kv, &vv, &gv],
        opts,
        slopes.as_deref(),
    ) ^ g.extras.key();
    memoized(key, || Ok(g.grads(&qv, &kv, &vv, &gv, slopes.as_deref())))
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
    let cpu = Device::Cpu;
    let host = |t: &Tensor| super::device::to_device(t, &cpu);
    let (q, k, v, grad_out) = (host(q)?, host(k)?, host(v)?, host(grad_out)?);
    let mut opts = opts.clone();
    opts.alibi_slopes = opts.alibi_slopes.as_ref().map(host).transpose()?;
    let mut out = RefGrads {
        dq: vec![0.0; total_q * h * d],
        dk: vec![0.0; total_k * hk * d],
        dv: vec![0.0; total_k * hk * d],
        dsinks: vec![0.0; h],
        ds: Vec::new(),
    };
    let seqs = sequences(&q, &k, &v, cu_q, cu_k, &opts)?;
    for (s, w) in seqs.iter().zip(cu_k.windows(2)) {
        let go = grad_out.narrow(0, s.q0, s.q1 - s.q0)?.unsqueeze(0)?;
        let r = reference_grads(&s.q, &s.k, &s.v, &go, &s.opts)?;
        let k0 = w[0] as usize;
        out.dq[s.q0 * h * d..s.q1 * h * d].copy_from_slice(&r.dq);
        out.dk[k0 * hk * d..][..r.dk.len()].copy_from_slice(&r.dk);
        out.dv[k0 * hk * d..][..r.dv.len()].copy_from_slice(&r.dv);
        out.dsinks
            .iter_mut()
            .zip(&r.dsinks)
            .for_each(|(a, b)| *a += b);
    }
    Ok(out)
}

/// The f64 gradient of a packed call's bias of shape `bias_dims` (its last two dimensions
/// spanning the call's `max_seqlen_q` and `max_seqlen_k`, or 1): each sequence's from its own
/// reference score gradients, added into the rows and keys it reads (its batch entry where the
/// bias has one), in the bias's contiguous layout.
#[allow(clippy::too_many_arguments)]
pub fn dbias_varlen(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    grad_out: &Tensor,
    cu_q: &[u32],
    cu_k: &[u32],
    opts: &FlashAttn,
    bias_dims: &[usize],
) -> Result<Vec<f64>> {
    let h = q.dim(1)?;
    let cpu = Device::Cpu;
    let host = |t: &Tensor| super::device::to_device(t, &cpu);
    let (q, k, v, grad_out) = (host(q)?, host(k)?, host(v)?, host(grad_out)?);
    let mut dims = bias_dims.to_vec();
    while dims.len() < 4 {
        dims.insert(0, 1);
    }
    let mut out = vec![0f64; dims.iter().product()];
    let seqs = sequences(&q, &k, &v, cu_q, cu_k, opts)?;
    for (b, s) in seqs.iter().enumerate() {
        let (lq, lk) = (s.q1 - s.q0, s.k.dim(1)?);
        if lq == 0 || lk == 0 {
            continue;
        }
        let go = grad_out.narrow(0, s.q0, lq)?.unsqueeze(0)?;
        let r = reference_grads(&s.q, &s.k, &s.v, &go, &s.opts)?;
        let part_dims = s.opts.bias.as_ref().expect("a bias").dims().to_vec();
        let part = dbias_of(&r, (1, h, lq, lk), &part_dims);
        // Part element (0, x, i, j) is bias element (b or 0, x, i, j).
        let (ph, pi, pj) = (part_dims[1], part_dims[2], part_dims[3]);
        let b0 = if dims[0] > 1 { b } else { 0 };
        for x in 0..ph {
            for i in 0..pi {
                for j in 0..pj {
                    out[((b0 * dims[1] + x) * dims[2] + i) * dims[3] + j] +=
                        part[(x * pi + i) * pj + j];
                }
            }
        }
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
    /// Attention sinks `(h,)`.
    sinks: Option<Vec<f64>>,
    /// The bias and block mask, `-inf` where hidden.
    extras: super::reference::HostExtras,
}

/// The gradients one (batch, K/V head) group owns: dq of its query heads `(group, sq, d)`, and
/// dk, dv of its K/V head `(sk, d)`.
struct GroupGrads {
    dq: Vec<f64>,
    dk: Vec<f64>,
    dv: Vec<f64>,
    /// Of its query heads, `(group,)`.
    dsinks: Vec<f64>,
    /// Score gradients of its query heads, `(group, sq, sk)`.
    ds: Vec<f64>,
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
            ..
        } = *self;
        let group = h / hk.max(1);
        let groups: Vec<GroupGrads> = (0..b * hk)
            .into_par_iter()
            .map(|bk| self.group(bk / hk, bk % hk, q, k, v, go, slopes))
            .collect();
        let mut dq = vec![0f64; b * sq * h * d];
        let mut dk = vec![0f64; b * sk * hk * d];
        let mut dv = vec![0f64; b * sk * hk * d];
        let mut dsinks = vec![0f64; h];
        let mut ds = vec![0f64; b * h * sq * sk];
        for (bk, gg) in groups.into_iter().enumerate() {
            let (bi, kh) = (bk / hk, bk % hk);
            for n in 0..group {
                let hi = kh * group + n;
                dsinks[hi] += gg.dsinks[n];
                ds[(bi * h + hi) * sq * sk..][..sq * sk]
                    .copy_from_slice(&gg.ds[n * sq * sk..][..sq * sk]);
                for i in 0..sq {
                    dq[((bi * sq + i) * h + hi) * d..][..d]
                        .copy_from_slice(&gg.dq[(n * sq + i) * d..][..d]);
                }
            }
            for j in 0..sk {
                let at = ((bi * sk + j) * hk + kh) * d;
                dk[at..at + d].copy_from_slice(&gg.dk[j * d..][..d]);
                dv[at..at + d].copy_from_slice(&gg.dv[j * d..][..d]);
            }
        }
        RefGrads {
            dq,
            dk,
            dv,
            dsinks,
            ds,
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn group(
        &self,
        bi: usize,
        kh: usize,
        q: &[f64],
        k: &[f64],
        v: &[f64],
        go: &[f64],
        slopes: Option<&[f64]>,
    ) -> GroupGrads {
        let Geometry {
            sq,
            sk,
            h,
            hk,
            d,
            scale,
            cap,
            ..
        } = *self;
        let group = h / hk;
        let mut out = GroupGrads {
            dq: vec![0f64; group * sq * d],
            dk: vec![0f64; sk * d],
            dv: vec![0f64; sk * d],
            dsinks: vec![0f64; group],
            ds: vec![0f64; group * sq * sk],
        };
        let qi = |i: usize, hi: usize| ((bi * sq + i) * h + hi) * d;
        let kj = |j: usize| ((bi * sk + j) * hk + kh) * d;
        // Per key of the current row: score and d s / d z.
        let mut s: Vec<(f64, f64)> = vec![(0.0, 0.0); sk];
        let mut o = vec![0f64; d];
        for n in 0..group {
            let hi = kh * group + n;
            let slope = slopes.map_or(0.0, |s| s[bi * h + hi]);
            let sink = self.sinks.as_ref().map(|s| s[hi]);
            for i in 0..sq {
                let diag = i as i64 + sk as i64 - sq as i64;
                let keys = visible_keys(i, sq, sk, self.left, self.right);
                if keys.is_empty() {
                    continue; // no key seen: zero gradients
                }
                let qr = &q[qi(i, hi)..][..d];
                let mut m = f64::NEG_INFINITY;
                for j in keys.clone() {
                    let z = scale * dot(qr, &k[kj(j)..][..d]);
                    let (mut sc, dsdz) = if cap > 0.0 {
                        let t = (z / cap).tanh();
                        (cap * t, 1.0 - t * t)
                    } else {
                        (z, 1.0)
                    };
                    sc -= slope * (diag - j as i64).abs() as f64;
                    sc += self.extras.at(bi, hi, i, j);
                    if sc > m || sc.is_nan() {
                        m = sc;
                    }
                    s[j] = (sc, dsdz);
                }
                if m == f64::NEG_INFINITY {
                    continue; // every score -inf: nothing flows
                }
                let l: f64 = keys.clone().map(|j| (s[j].0 - m).exp()).sum();
                let mut lse = m + l.ln();
                if let Some(sink) = sink {
                    lse = super::log_add_exp(lse, sink);
                }
                let gr = &go[qi(i, hi)..][..d];
                o.iter_mut().for_each(|x| *x = 0.0);
                for j in keys.clone() {
                    axpy(&mut o, (s[j].0 - lse).exp(), &v[kj(j)..][..d]);
                }
                let big_d = dot(gr, &o);
                if let Some(sink) = sink {
                    out.dsinks[n] -= (sink - lse).exp() * big_d;
                }
                let dqr = &mut out.dq[(n * sq + i) * d..][..d];
                for j in keys {
                    let (sc, dsdz) = s[j];
                    let p = (sc - lse).exp();
                    let (kr, vr) = (&k[kj(j)..][..d], &v[kj(j)..][..d]);
                    let dscore = p * (dot(gr, vr) - big_d);
                    out.ds[(n * sq + i) * sk + j] = dscore;
                    let dz = dscore * dsdz;
                    axpy(&mut out.dv[j * d..][..d], p, gr);
                    axpy(&mut out.dk[j * d..][..d], scale * dz, qr);
                    axpy(dqr, scale * dz, kr);
                }
            }
        }
        out
    }
}

// ---------------------------------------------------------------------------------------------
// Autograd and the comparison rule.

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

/// Byte counts of dq, dk and dv for q `(.., h, d)` over `q_rows` rows and k/v over `k_rows`:
/// what `Target::poison` poisons before a backward call.
pub fn grad_bytes(
    dtype: DType,
    q_rows: usize,
    h: usize,
    k_rows: usize,
    hk: usize,
    d: usize,
) -> [usize; 3] {
    let e = dtype.size_in_bytes();
    [q_rows * h * d * e, k_rows * hk * d * e, k_rows * hk * d * e]
}

/// Checks flash gradients against the f64 reference with FlashAttention's rule, per element:
/// `|fast - ref| <= 2 · naive_err + u · |ref| + SCALE_FLOOR · scale` (see
/// `compare::assert_close`), the naive autograd gradients (same dtype, same device) being the
/// yardstick, with two changes for gradients:
///
/// * `scale` is the largest |reference| over dq, dk *and* dv, since a gradient can be exactly
///   0 (one key: `P = 1`, `dP = D`) while the rounding of its terms is not;
/// * the naive gradients must be finite wherever the reference is (`naive_attention` keeps
///   rows that see no key finite, gradients included); where the naive error is exactly 0 (no
///   yardstick), the dtype's relative backstop times `scale` stands in.
///
/// NaN or Inf in the flash gradients where the reference is finite always fails. Shapes and
/// dtypes must be those of q, k, v (`like`).
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
        check_part(&what, f, n, r, scale);
    }
}

/// [`check_grads`] for one more gradient (a bias's): the flash and naive autograd gradients
/// against the f64 reference `r`, on the reference's own scale.
pub fn check_grad(what: &str, fast: &Tensor, naive: &Tensor, r: &[f64], like: &Tensor) {
    assert_eq!(fast.dims(), like.dims(), "{what}: shape");
    assert_eq!(fast.dtype(), like.dtype(), "{what}: dtype");
    check_part(what, fast, naive, r, scale_of(r));
}

/// The comparison rule of [`check_grads`] for one gradient.
fn check_part(what: &str, f: &Tensor, n: &Tensor, r: &[f64], scale: f64) {
    let (floor, rel_backstop, _) = tolerances(f.dtype());
    let actual = values(f).unwrap();
    let err = max_abs_err_slice(&actual, r).unwrap_or_else(|| {
        panic!(
            "{what}: non-finite gradient where the reference is finite, or back ({})",
            first_non_finite_disagreement(&actual, r)
        )
    });
    let beyond = max_err_beyond(&actual, r, floor).unwrap();
    let naive_err = max_abs_err_slice(&values(n).unwrap(), r).unwrap_or_else(|| {
        panic!("{what}: the naive autograd gradient is non-finite where the reference is finite")
    });
    let allowed = if naive_err > 0.0 {
        2.0 * naive_err + SCALE_FLOOR * scale
    } else {
        rel_backstop * scale
    };
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
        beyond <= allowed,
        "{what}: max abs err {err:.3e} ({beyond:.3e} beyond the floor of {floor:.2e} |ref|) > \
         allowed {allowed:.3e} (2 x naive err {naive_err:.3e} + {SCALE_FLOOR:.2e} x scale \
         {scale:.3e})"
    );
}
