//! The materialising reference: what a model without flash attention does.

use candle::{DType, Device, Tensor, D};

use crate::semantics::diagonal;
use crate::FlashAttn;

/// Plain attention with the same options and semantics as [`FlashAttn`]: the full
/// `(batch, heads, seq_q, seq_k)` score matrix is built (matmuls in the input dtype, mask and
/// softmax in f32), so memory grows with `seq_q × seq_k`. It runs on any device and serves as
/// the baseline of the examples, benchmarks and tests. Rows that see no key output 0.
pub fn naive_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    opts: &FlashAttn,
) -> candle::Result<Tensor> {
    // Validation is shared with the flash path, so both accept and refuse the same inputs.
    let p = opts.problem(q, k, v, None)?;
    let (b, sq, h, d) = (p.batch, p.max_seq_q, p.heads, p.head_dim);
    let (hk, sk) = (p.kv_heads, p.max_seq_k);
    let dtype = q.dtype();
    if b * sq * h * d == 0 || sk == 0 {
        return Tensor::zeros((b, sq, h, d), dtype, q.device());
    }
    let g = h / hk;
    let repeat = |t: &Tensor| -> candle::Result<Tensor> {
        let t = t.transpose(1, 2)?; // (b, hk, sk, d)
        if g == 1 {
            return t.contiguous();
        }
        t.unsqueeze(2)?
            .expand((b, hk, g, sk, d))?
            .reshape((b, h, sk, d))
    };
    let qt = q.transpose(1, 2)?.contiguous()?; // (b, h, sq, d)
    let kt = repeat(k)?;
    let vt = repeat(v)?;
    let scores = qt.matmul(&kt.t()?.contiguous()?)?.to_dtype(DType::F32)?;
    let mut s = (scores * p.score.scale as f64)?;
    if p.score.softcap > 0.0 {
        let c = p.score.softcap as f64;
        s = ((s / c)?.tanh()? * c)?;
    }
    let (mask, dist) = mask_and_distance(opts, sq, sk, q.device())?;
    if let Some(slopes) = &opts.alibi_slopes {
        let slopes = if slopes.rank() == 1 {
            slopes.reshape((1, h, 1, 1))?
        } else {
            slopes.reshape((b, h, 1, 1))?
        };
        s = s.broadcast_sub(&dist.broadcast_mul(&slopes)?)?;
    }
    let s = s.broadcast_add(&mask)?;
    // A row with every key masked has max -inf: clamping the max keeps exp() at 0 instead of
    // NaN, and clamping the sum turns 0/0 into 0.
    let m = s.max_keepdim(D::Minus1)?.maximum(f32::MIN as f64)?;
    let e = s.broadcast_sub(&m)?.exp()?;
    let l = e
        .sum_keepdim(D::Minus1)?
        .maximum(f32::MIN_POSITIVE as f64)?;
    let pr = e.broadcast_div(&l)?.to_dtype(dtype)?;
    pr.matmul(&vt)?.transpose(1, 2)?.contiguous()
}

/// The additive mask (0 or -inf) and the ALiBi distances `|diag(i) - j|`, both `(sq, sk)` f32.
fn mask_and_distance(
    opts: &FlashAttn,
    sq: usize,
    sk: usize,
    device: &Device,
) -> candle::Result<(Tensor, Tensor)> {
    let w = opts.mask();
    let mut mask = vec![f32::NEG_INFINITY; sq * sk];
    let mut dist = vec![0f32; sq * sk];
    for i in 0..sq {
        let (lo, hi) = w.key_range(i, sq, sk);
        mask[i * sk + lo..i * sk + hi].fill(0.0);
        for j in 0..sk {
            dist[i * sk + j] = (diagonal(i, sq, sk) - j as i64).unsigned_abs() as f32;
        }
    }
    Ok((
        Tensor::from_vec(mask, (sq, sk), device)?,
        Tensor::from_vec(dist, (sq, sk), device)?,
    ))
}
