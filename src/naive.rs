//! The materialising reference: what a model without flash attention does.

use candle::{DType, Device, Tensor, D};

use crate::FlashAttn;

/// Plain attention with the same options and semantics as [`FlashAttn`]: the full
/// `(batch, heads, seq_q, seq_k)` score matrix is built (matmuls in the input dtype, mask and
/// softmax in f32), so memory grows with `seq_q × seq_k`. It runs on any device and serves as
/// the baseline of the examples, benchmarks and tests. Rows that see no key output 0.
///
/// q is `(batch, seq_q, heads, head_dim)`, k and v `(batch, seq_k, kv_heads, head_dim)`; every
/// option of `opts` (scale, window, softcap, ALiBi, sinks, bias, block mask) applies, and a
/// tracked `sinks` or `bias` gets its gradient through candle's autograd. Returns the output
/// shaped and typed like q.
///
/// # Errors
///
/// The inputs are validated exactly as by [`FlashAttn::forward`], so both refuse the same
/// calls: mismatched shapes, dtypes or devices, an unsupported head dim, a non-finite scale, a
/// bad softcap or bad ALiBi slopes (see [the crate docs](crate#errors)). Any error of the
/// underlying candle ops (for example running out of memory for the score matrix) is passed on.
///
/// # Example
///
/// ```
/// use candle::{Device, Tensor};
/// use candle_flash::{naive_attention, FlashAttn};
///
/// let q = Tensor::randn(0f32, 1., (1, 12, 4, 16), &Device::Cpu)?;
/// let kv = Tensor::randn(0f32, 1., (1, 12, 2, 16), &Device::Cpu)?;
/// let opts = FlashAttn::new(0.25).window(Some(4), Some(0)).softcap(20.0);
/// let reference = naive_attention(&q, &kv, &kv, &opts)?;
/// let flash = opts.forward(&q, &kv, &kv)?;
/// let max_diff = (reference - flash)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
/// assert!(max_diff < 1e-4);
///
/// // The same validation as the flash path: 3 query heads cannot share 2 kv heads.
/// let q3 = Tensor::zeros((1, 12, 3, 16), candle::DType::F32, &Device::Cpu)?;
/// assert!(naive_attention(&q3, &kv, &kv, &opts).is_err());
/// # Ok::<(), candle::Error>(())
/// ```
pub fn naive_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    opts: &FlashAttn,
) -> candle::Result<Tensor> {
    if opts.block_table.is_some() || opts.mm_prefix_ranges.is_some() {
        candle::bail!("naive_attention: paged K/V and mm_prefix_ranges are not supported")
    }
    // Validation is shared with the flash path, so both accept and refuse the same inputs.
    let p = opts.problem(q, k, v, None)?;
    let (b, sq, h, d) = (p.batch, p.max_seq_q, p.heads, p.head_dim);
    let sk = p.max_seq_k;
    let dtype = q.dtype();
    if b * sq * h * d == 0 || sk == 0 {
        return Tensor::zeros((b, sq, h, d), dtype, q.device());
    }
    let s = logits(q, k, opts)?;
    // A row with every key masked has max -inf: clamping the max keeps exp() at 0 instead of
    // NaN, and clamping the sum turns 0/0 into 0. The clamp is 1, which changes no other row
    // (the max key contributes exp(0) = 1 to its sum), because autograd divides by the square
    // of the sum: a tiny clamp squares to 0 and gives every such row 0/0 = NaN gradients.
    // A sink is one more logit per head with no value: it joins the max and the sum only.
    let sink = match &opts.sinks {
        Some(t) => Some(t.reshape((1, h, 1, 1))?),
        None => None,
    };
    let mut m = s.max_keepdim(D::Minus1)?;
    if let Some(sink) = &sink {
        m = m.broadcast_maximum(sink)?;
    }
    let m = m.maximum(f32::MIN as f64)?;
    let e = s.broadcast_sub(&m)?.exp()?;
    let mut l = e.sum_keepdim(D::Minus1)?;
    if let Some(sink) = &sink {
        l = (l + sink.broadcast_sub(&m)?.exp()?)?;
    }
    let l = l.maximum(1.0)?;
    let pr = e.broadcast_div(&l)?.to_dtype(dtype)?;
    pr.matmul(&per_head(v, h)?)?.transpose(1, 2)?.contiguous()
}

/// k or v `(batch, seq_k, kv_heads, d)` as `(batch, heads, seq_k, d)`, each K/V head repeated
/// for the `heads / kv_heads` query heads that share it.
pub(crate) fn per_head(t: &Tensor, heads: usize) -> candle::Result<Tensor> {
    let (b, sk, hk, d) = t.dims4()?;
    let g = heads / hk;
    let t = t.transpose(1, 2)?; // (b, hk, sk, d)
    if g == 1 {
        return t.contiguous();
    }
    t.unsqueeze(2)?
        .expand((b, hk, g, sk, d))?
        .reshape((b, heads, sk, d))
}

/// The `(batch, heads, seq_q, seq_k)` f32 logits of a dense call of already validated inputs:
/// `scale · q kᵀ` (the product in the input dtype), softcap, ALiBi, bias, then the block mask
/// and the window as `-inf`; sinks are not in it.
pub(crate) fn logits(q: &Tensor, k: &Tensor, opts: &FlashAttn) -> candle::Result<Tensor> {
    let (b, sq, h, _) = q.dims4()?;
    let sk = k.dim(1)?;
    let qt = q.transpose(1, 2)?.contiguous()?; // (b, h, sq, d)
    let kt = per_head(k, h)?;
    let scores = qt.matmul(&kt.t()?.contiguous()?)?.to_dtype(DType::F32)?;
    let mut s = (scores * opts.softmax_scale as f64)?;
    if let Some(c) = opts.softcap.filter(|&c| c > 0.0) {
        let c = c as f64;
        s = ((s / c)?.tanh()? * c)?;
    }
    if let Some(slopes) = &opts.alibi_slopes {
        let slopes = if slopes.rank() == 1 {
            slopes.reshape((1, h, 1, 1))?
        } else {
            slopes.reshape((b, h, 1, 1))?
        };
        s = s.broadcast_sub(&distance(sq, sk, q.device())?.broadcast_mul(&slopes)?)?;
    }
    if let Some(bias) = &opts.bias {
        s = s.broadcast_add(&bias.to_dtype(DType::F32)?)?;
    }
    if let Some(m) = &opts.block_mask {
        s = s.broadcast_add(&block_mask(m, sq, sk)?)?;
    }
    if !opts.mask().is_full() {
        s = s.broadcast_add(&mask(opts, sq, sk, q.device())?)?;
    }
    Ok(s)
}

/// `rows(shift)[i] = diag(i) + shift` as an `(sq, 1)` i64 column (diag(i) = i + sk - sq), and
/// the key indices as a `(1, sk)` row: integer ranges only, built on the device, in i64 so that
/// no length or window size wraps.
fn indices(sq: usize, sk: usize, shift: i64, device: &Device) -> candle::Result<(Tensor, Tensor)> {
    let off = sk as i64 - sq as i64 + shift;
    let rows = Tensor::arange(off, off + sq as i64, device)?.reshape((sq, 1))?;
    let keys = Tensor::arange(0i64, sk as i64, device)?.reshape((1, sk))?;
    Ok((rows, keys))
}

/// The additive `(sq, sk)` f32 mask: 0 where a key is visible, -inf elsewhere.
fn mask(opts: &FlashAttn, sq: usize, sk: usize, device: &Device) -> candle::Result<Tensor> {
    let (left, right) = opts.mask().as_i64();
    let mut visible = Tensor::ones((sq, sk), DType::U8, device)?;
    if left >= 0 {
        let (lo, j) = indices(sq, sk, -left, device)?;
        visible = (visible * j.broadcast_ge(&lo)?)?;
    }
    if right >= 0 {
        let (hi, j) = indices(sq, sk, right, device)?;
        visible = (visible * j.broadcast_le(&hi)?)?;
    }
    let zeros = Tensor::zeros((sq, sk), DType::F32, device)?;
    let neg_inf = Tensor::full(f32::NEG_INFINITY, (sq, sk), device)?;
    visible.where_cond(&zeros, &neg_inf)
}

/// The block mask as an additive `(.., sq, sk)` f32 mask: 0 where a key is visible, -inf where
/// its block is 0.
fn block_mask(m: &crate::BlockMask, sq: usize, sk: usize) -> candle::Result<Tensor> {
    let dev = m.mask.device();
    let mut t = m.mask.clone();
    while t.rank() < 4 {
        t = t.unsqueeze(0)?;
    }
    let block = |n: usize, size: usize| -> candle::Result<Tensor> {
        let idx: Vec<u32> = (0..n).map(|i| (i / size) as u32).collect();
        Tensor::new(idx.as_slice(), dev)
    };
    // Rows and columns of a broadcast (size-1) block dimension stay size 1. (index_select reads
    // contiguous tensors only; a mask may be any view.)
    let mut t = t.contiguous()?;
    if t.dim(2)? > 1 {
        t = t.index_select(&block(sq, m.block_q)?, 2)?;
    }
    if t.dim(3)? > 1 {
        t = t.index_select(&block(sk, m.block_k)?, 3)?;
    }
    let shape = t.dims().to_vec();
    let zeros = Tensor::zeros(shape.as_slice(), DType::F32, dev)?;
    let neg_inf = Tensor::full(f32::NEG_INFINITY, shape.as_slice(), dev)?;
    t.ne(0u8)?.where_cond(&zeros, &neg_inf)
}

/// The ALiBi distances `|diag(i) - j|`, `(sq, sk)` f32.
fn distance(sq: usize, sk: usize, device: &Device) -> candle::Result<Tensor> {
    let (diag, j) = indices(sq, sk, 0, device)?;
    diag.broadcast_sub(&j)?.to_dtype(DType::F32)?.abs()
}
