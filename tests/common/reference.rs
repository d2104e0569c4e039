//! The f64 golden attention and the planted inputs whose exact output is known.
//!
//! The spec, as the crate documents it: query row `i` of `sq` sees key `j` of `sk` iff
//! `diag - left <= j <= diag + right` with `diag = i + sk - sq` (bottom-right alignment, `None`
//! unbounded); scores are `scale · q·k`, then `c · tanh(s / c)` with a softcap `c`, minus
//! `slope · |diag - j|` with ALiBi; query head `h` reads K/V head `h / (heads / kv_heads)`
//! (consecutive GQA groups); a row that sees no key outputs exactly 0 with lse `-inf`. Written
//! here from that rule, not from `candle_flash::semantics`, so a bug there cannot hide in both.

use std::any::Any;
use std::cell::RefCell;
use std::collections::HashMap;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::rc::Rc;

use candle::{DType, Device, IndexOp, Result, Tensor};
use candle_flash::semantics::Window;
use candle_flash::{naive_attention, FlashAttn};
use rayon::prelude::*;

use super::{randn, values};

/// The mask from the spec: key `j` is visible to query row `i` iff
/// `diag - left <= j <= diag + right` with `diag = i + sk - sq` (`None` = unbounded). In i128, so
/// that window sizes up to `usize::MAX` cannot wrap.
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

/// The keys row `i` sees, as a range: the solutions `j` in `0..sk` of [`visible`]'s
/// inequality `diag - left <= j <= diag + right` (empty when none).
pub fn visible_keys(
    i: usize,
    sq: usize,
    sk: usize,
    left: Option<usize>,
    right: Option<usize>,
) -> std::ops::Range<usize> {
    let diag = i as i128 + sk as i128 - sq as i128;
    let lo = left.map_or(0, |l| (diag - l as i128).max(0));
    let hi = right.map_or(sk as i128, |r| (diag + r as i128 + 1).min(sk as i128));
    let lo = lo.min(sk as i128) as usize;
    lo..(hi.max(lo as i128) as usize)
}

/// `Σ a_x b_x` in eight interleaved partial sums: independent chains the compiler keeps in
/// vector registers, several additions in flight (the order differs from a plain loop by f64
/// rounding, ~1e-16 relative, far below every tolerance). NaN and infinities propagate. With
/// AVX2 where the CPU has it: the references are most of a CPU test's time.
pub fn dot(a: &[f64], b: &[f64]) -> f64 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2 (checked just above).
        return unsafe { dot_avx2(a, b) };
    }
    dot_any(a, b)
}

/// [`dot`] compiled with AVX2 (four f64 lanes).
///
/// # Safety
///
/// The CPU must have AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn dot_avx2(a: &[f64], b: &[f64]) -> f64 {
    dot_any(a, b)
}

#[inline(always)]
fn dot_any(a: &[f64], b: &[f64]) -> f64 {
    let mut acc = [0f64; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f64 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ca.zip(cb) {
        for n in 0..8 {
            acc[n] += x[n] * y[n];
        }
    }
    let pairs = [
        acc[0] + acc[4],
        acc[1] + acc[5],
        acc[2] + acc[6],
        acc[3] + acc[7],
    ];
    (pairs[0] + pairs[2]) + (pairs[1] + pairs[3]) + tail
}

/// `o += p · v`, element-wise, with AVX2 where the CPU has it (as [`dot`]).
pub fn axpy(o: &mut [f64], p: f64, v: &[f64]) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2 (checked just above).
        return unsafe { axpy_avx2(o, p, v) };
    }
    axpy_any(o, p, v)
}

/// [`axpy`] compiled with AVX2.
///
/// # Safety
///
/// The CPU must have AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn axpy_avx2(o: &mut [f64], p: f64, v: &[f64]) {
    axpy_any(o, p, v)
}

#[inline(always)]
fn axpy_any(o: &mut [f64], p: f64, v: &[f64]) {
    o.iter_mut().zip(v).for_each(|(o, v)| *o += p * v);
}

/// The attention sinks of `opts` as `(h,)` f64 on the host.
pub fn host_sinks(opts: &FlashAttn) -> Result<Option<Vec<f64>>> {
    opts.sinks.as_ref().map(values).transpose()
}

/// `log(exp(a) + exp(b))` in f64; `-inf` when both are.
pub fn log_add_exp(a: f64, b: f64) -> f64 {
    if a.is_nan() || b.is_nan() {
        return f64::NAN;
    }
    let m = a.max(b);
    if m == f64::NEG_INFINITY {
        return m;
    }
    m + ((a - m).exp() + (b - m).exp()).ln()
}

/// ALiBi slopes of `opts` as `(b, h)` f64 on the host (a `(h,)` tensor broadcast over batches).
pub fn host_slopes(opts: &FlashAttn, b: usize, h: usize) -> Result<Option<Vec<f64>>> {
    let Some(s) = &opts.alibi_slopes else {
        return Ok(None);
    };
    let s = values(s)?;
    Ok(Some(if s.len() == h {
        (0..b).flat_map(|_| s.iter().copied()).collect()
    } else {
        s
    }))
}

thread_local! {
    /// While a CUDA test runs its configurations ([`with_memo`]): the references it computed,
    /// by a hash of their inputs, since every configuration asks for the same ones.
    static MEMO: RefCell<Option<HashMap<u64, Rc<dyn Any>>>> = const { RefCell::new(None) };
}

/// Runs `f` with the references of this thread memoized, then forgets them: a CUDA test runs its
/// body once per kernel configuration on identical inputs, and the f64 references on the host
/// are most of its time.
pub fn with_memo<R>(f: impl FnOnce() -> R) -> R {
    MEMO.with(|m| *m.borrow_mut() = Some(HashMap::new()));
    let r = f();
    MEMO.with(|m| *m.borrow_mut() = None);
    r
}

/// A hash of everything a reference depends on: a tag, the shapes, every input value (bits)
/// and the options.
pub fn input_key(
    tag: &str,
    dims: &[&[usize]],
    inputs: &[&[f64]],
    opts: &FlashAttn,
    slopes: Option<&[f64]>,
) -> u64 {
    let mut h = DefaultHasher::new();
    tag.hash(&mut h);
    dims.hash(&mut h);
    for x in inputs.iter().copied().chain(slopes) {
        x.len().hash(&mut h);
        x.iter().for_each(|v| v.to_bits().hash(&mut h));
    }
    opts.softmax_scale.to_bits().hash(&mut h);
    opts.softcap.map(f32::to_bits).hash(&mut h);
    host_sinks(opts)
        .unwrap()
        .map(|s| s.iter().map(|x| x.to_bits()).collect::<Vec<_>>())
        .hash(&mut h);
    (opts.window_size_left, opts.window_size_right).hash(&mut h);
    h.finish()
}

/// `compute()`, or its result from earlier under [`with_memo`] for the same `key`.
pub fn memoized<T: Clone + 'static>(key: u64, compute: impl FnOnce() -> Result<T>) -> Result<T> {
    let hit = MEMO.with(|m| {
        m.borrow()
            .as_ref()
            .and_then(|m| m.get(&key).and_then(|v| v.downcast_ref::<T>().cloned()))
    });
    if let Some(v) = hit {
        return Ok(v);
    }
    let v = compute()?;
    MEMO.with(|m| {
        if let Some(m) = m.borrow_mut().as_mut() {
            m.insert(key, Rc::new(v.clone()));
        }
    });
    Ok(v)
}

/// Golden attention in f64 on the host. q `(b, sq, h, d)`, k/v `(b, sk, hk, d)` of any dtype, on
/// any device, in any layout (values are taken exactly as stored). Returns the output
/// `(b, sq, h, d)` and the natural-log log-sum-exp `(b, h, sq)` (`-inf` for rows that see no
/// key), both flattened. Heads run in parallel.
pub fn reference(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    opts: &FlashAttn,
) -> Result<(Vec<f64>, Vec<f64>)> {
    let (b, sq, h, d) = q.dims4()?;
    let (_, sk, hk, _) = k.dims4()?;
    let (qv, kv, vv) = (values(q)?, values(k)?, values(v)?);
    let slopes = host_slopes(opts, b, h)?;
    let extras = HostExtras::of(opts, (b, h, sq, sk))?;
    let dims = [q.dims(), k.dims(), v.dims()];
    let mut key = input_key("forward", &dims, &[&qv, &kv, &vv], opts, slopes.as_deref());
    key ^= extras.key();
    memoized(key, || {
        Ok(reference_host(
            &qv,
            &kv,
            &vv,
            (b, sq, sk, h, hk, d),
            opts,
            slopes.as_deref(),
            &extras,
        ))
    })
}

/// The additive bias and the block mask of `opts`, expanded to `(b, h, sq, sk)` on the host.
pub struct HostExtras {
    dims: (usize, usize, usize, usize),
    bias: Option<Vec<f64>>,
    /// 0 where the block mask hides the key from the row.
    visible: Option<Vec<f64>>,
}

impl HostExtras {
    pub fn of(opts: &FlashAttn, dims: (usize, usize, usize, usize)) -> Result<Self> {
        let (b, h, sq, sk) = dims;
        let bias = match &opts.bias {
            Some(t) => Some(values(
                &t.to_dtype(DType::F64)?.broadcast_as((b, h, sq, sk))?,
            )?),
            None => None,
        };
        let visible = match &opts.block_mask {
            Some(m) => {
                let (nq, nk) = (sq.div_ceil(m.block_q), sk.div_ceil(m.block_k));
                let blocks = values(&m.mask.to_dtype(DType::F64)?.broadcast_as((b, h, nq, nk))?)?;
                let mut v = vec![0f64; b * h * sq * sk];
                // (A sequence without rows or keys has no score to mask.)
                for (bh, rows) in v.chunks_mut((sq * sk).max(1)).enumerate() {
                    for (i, row) in rows.chunks_mut(sk).enumerate() {
                        for (j, x) in row.iter_mut().enumerate() {
                            *x = blocks[(bh * nq + i / m.block_q) * nk + j / m.block_k];
                        }
                    }
                }
                Some(v)
            }
            None => None,
        };
        Ok(Self {
            dims,
            bias,
            visible,
        })
    }

    pub fn key(&self) -> u64 {
        let mut h = DefaultHasher::new();
        for v in [&self.bias, &self.visible].into_iter().flatten() {
            v.iter().for_each(|x| x.to_bits().hash(&mut h));
        }
        h.finish()
    }

    /// The bias added to score (bi, hi, i, j), or `-inf` where the block mask hides it.
    pub fn at(&self, bi: usize, hi: usize, i: usize, j: usize) -> f64 {
        let (_, h, sq, sk) = self.dims;
        let x = ((bi * h + hi) * sq + i) * sk + j;
        if self.visible.as_ref().is_some_and(|v| v[x] == 0.0) {
            return f64::NEG_INFINITY;
        }
        self.bias.as_ref().map_or(0.0, |b| b[x])
    }
}

/// [`reference`] on host values.
fn reference_host(
    qv: &[f64],
    kv: &[f64],
    vv: &[f64],
    (b, sq, sk, h, hk, d): (usize, usize, usize, usize, usize, usize),
    opts: &FlashAttn,
    slopes: Option<&[f64]>,
    extras: &HostExtras,
) -> (Vec<f64>, Vec<f64>) {
    let scale = opts.softmax_scale as f64;
    let cap = opts.softcap.unwrap_or(0.0) as f64;
    let group = h / hk.max(1);
    let sinks = host_sinks(opts).unwrap();
    // One task per (batch, head): its rows' outputs `(sq, d)` and lse `(sq,)`.
    let heads: Vec<(Vec<f64>, Vec<f64>)> = (0..b * h)
        .into_par_iter()
        .map(|bh| {
            let (bi, hi) = (bh / h, bh % h);
            let kh = hi / group.max(1);
            let slope = slopes.map_or(0.0, |s| s[bi * h + hi]);
            // A sink: one more logit of the row's softmax, with no value.
            let sink = sinks.as_ref().map_or(f64::NEG_INFINITY, |s| s[hi]);
            let mut out = vec![0f64; sq * d];
            let mut lse = vec![sink; sq];
            let mut s = vec![0f64; sk];
            for i in 0..sq {
                // Bottom-right alignment: row i lines up with key i + sk - sq.
                let diag = i as i64 + sk as i64 - sq as i64;
                let keys = visible_keys(i, sq, sk, opts.window_size_left, opts.window_size_right);
                if keys.is_empty() {
                    continue; // output stays exactly 0, lse -inf
                }
                let qr = &qv[((bi * sq + i) * h + hi) * d..][..d];
                let mut m = f64::NEG_INFINITY;
                for j in keys.clone() {
                    let mut sc = dot(qr, &kv[((bi * sk + j) * hk + kh) * d..][..d]) * scale;
                    if cap > 0.0 {
                        sc = cap * (sc / cap).tanh();
                    }
                    sc -= slope * (diag - j as i64).abs() as f64;
                    sc += extras.at(bi, hi, i, j);
                    s[j] = sc;
                    if sc > m || sc.is_nan() {
                        m = sc;
                    }
                }
                if m == f64::NEG_INFINITY {
                    continue; // every visible key masked (bias -inf, hidden blocks): as no key
                }
                let mut l = 0f64;
                let o = &mut out[i * d..][..d];
                for j in keys {
                    if s[j] == f64::NEG_INFINITY {
                        continue; // a key that cannot win adds nothing, not even 0 · V
                    }
                    let p = (s[j] - m).exp();
                    l += p;
                    axpy(o, p, &vv[((bi * sk + j) * hk + kh) * d..][..d]);
                }
                if sinks.is_some() {
                    // o holds Σ exp(s - m) v: the sink-inclusive lse L normalises it.
                    let row_lse = log_add_exp(m + l.ln(), sink);
                    o.iter_mut().for_each(|x| *x *= (m - row_lse).exp());
                    lse[i] = row_lse;
                } else {
                    o.iter_mut().for_each(|x| *x /= l);
                    lse[i] = m + l.ln();
                }
            }
            (out, lse)
        })
        .collect();
    let mut out = vec![0f64; b * sq * h * d];
    let mut lse = vec![f64::NEG_INFINITY; b * h * sq];
    for (bh, (o, l)) in heads.into_iter().enumerate() {
        let (bi, hi) = (bh / h, bh % h);
        for i in 0..sq {
            out[((bi * sq + i) * h + hi) * d..][..d].copy_from_slice(&o[i * d..][..d]);
        }
        lse[bh * sq..][..sq].copy_from_slice(&l);
    }
    (out, lse)
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

/// Splits a packed varlen batch into its sequence pairs (views of the inputs, on their device).
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
            if let Some(bias) = &opts.bias {
                o.bias = Some(sequence_bias(bias, b, q1 - q0, k1 - k0)?);
            }
            if let Some(m) = &mut o.block_mask {
                let (nq, nk) = ((q1 - q0).div_ceil(m.block_q), (k1 - k0).div_ceil(m.block_k));
                m.mask = sequence_bias(&m.mask, b, nq, nk)?;
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

/// The part of a packed or paged call's bias that sequence `b` (`sq` rows, `sk` keys) reads,
/// as a dense call's bias: its batch entry where the bias has a batch dimension, and its first
/// `sq` rows and `sk` keys where it has those dimensions. (A block mask's part: with its
/// sequence's row and key blocks.)
pub fn sequence_bias(bias: &Tensor, b: usize, sq: usize, sk: usize) -> Result<Tensor> {
    let mut t = bias.clone();
    while t.rank() < 4 {
        t = t.unsqueeze(0)?;
    }
    for (dim, at, n) in [(0, b, 1), (2, 0, sq), (3, 0, sk)] {
        if t.dim(dim)? > 1 {
            t = t.narrow(dim, at, n)?;
        }
    }
    Ok(t)
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
    let cpu = Device::Cpu;
    let host = |t: &Tensor| super::device::to_device(t, &cpu);
    let (q, k, v) = (host(q)?, host(k)?, host(v)?);
    let mut opts = opts.clone();
    opts.alibi_slopes = opts.alibi_slopes.as_ref().map(host).transpose()?;
    let mut out = vec![0f64; total_q * h * d];
    let mut lse = vec![f64::NEG_INFINITY; h * total_q];
    for s in sequences(&q, &k, &v, cu_q, cu_k, &opts)? {
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

/// Golden attention with multimodal prefix ranges, from the spec: as [`reference`] for a batch
/// of 1, except that key `j` is also visible to row `i` when one range `[s, e)` with `s < e`
/// holds both `j` and the row's absolute position `i + sk - sq` (scale and window only: no
/// softcap, no ALiBi). Returns the output `(1, sq, h, d)` and the lse `(1, h, sq)`, flattened.
pub fn reference_prefix(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    opts: &FlashAttn,
    ranges: &[[i64; 2]],
) -> Result<(Vec<f64>, Vec<f64>)> {
    let (_, sq, h, d) = q.dims4()?;
    let (_, sk, hk, _) = k.dims4()?;
    let (qv, kv, vv) = (values(q)?, values(k)?, values(v)?);
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
                        let qr = &qv[(i * h + hi) * d..][..d];
                        dot(qr, &kv[(j * hk + kh) * d..][..d]) * opts.softmax_scale as f64
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
/// `ln(count_i)`. Needs `d >= sk`. Tensors on the CPU.
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

/// Builds a [`MaskProbe`]. The visible keys come from
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
