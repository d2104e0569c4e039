//! The gradient of an additive bias, outside the kernels. A bias entry is added to the score it
//! meets after scale, softcap and ALiBi, so its gradient is that score's:
//! `∂loss/∂s_ij = p_ij (dP_ij − D_i)` with `p_ij = exp(s_ij − L_i)` (the forward's lse `L`, sinks
//! included), `dP = dO vᵀ` and `D_i = dO_i · O_i = Σ_j p_ij dP_ij`, summed over the bias's
//! broadcast dimensions.
//! The scores are rebuilt one sequence at a time, `(heads, seq_q, seq_k)` in f32: the memory of
//! naive attention for one sequence, paid only by calls that ask for the bias gradient.

use candle::backend::BackendDevice;
use candle::{CpuStorage, CustomOp1, DType, Layout, Result, Shape, Tensor, D};

use super::FlashAttn;
use crate::naive::{logits, per_head};

/// `dbias`, shaped and typed like `bias`, of a dense call (q `(b, sq, h, d)`, k and v
/// `(b, sk, hk, d)`) from its forward `lse` `(b, h, sq)` and the output gradient.
pub(super) fn grad(
    opts: &FlashAttn,
    bias: &Tensor,
    [q, k, v]: [&Tensor; 3],
    grad_out: &Tensor,
    lse: &Tensor,
) -> Result<Tensor> {
    grad_f32(opts, bias, [q, k, v], grad_out, lse)?.to_dtype(bias.dtype())
}

/// [`grad`] in f32 (sums over sequences stay in f32 until the caller's last one).
fn grad_f32(
    opts: &FlashAttn,
    bias: &Tensor,
    [q, k, v]: [&Tensor; 3],
    grad_out: &Tensor,
    lse: &Tensor,
) -> Result<Tensor> {
    let (b, sq, h, _) = q.dims4()?;
    if b * sq * h == 0 || k.dim(1)? == 0 {
        // No score: nothing flows to the bias.
        return super::empty_zeros(bias.dims(), DType::F32, bias.device());
    }
    let f32 = |t: &Tensor| t.to_dtype(DType::F32);
    // The bias's dimensions against (batch, heads, seq_q, seq_k), missing leading ones as 1.
    let mut dims = bias.dims().to_vec();
    while dims.len() < 4 {
        dims.insert(0, 1);
    }
    let mut gathered = Gathered::new(dims[0] > 1);
    for i in 0..b {
        let one = |t: &Tensor| t.narrow(0, i, 1);
        // Scores in f32 from the start, as the kernels' accumulators hold them: scores rounded
        // to a 16-bit dtype would not match the forward's lse.
        let s = logits(&f32(&one(q)?)?, &f32(&one(k)?)?, &sequence_opts(opts, i)?)?;
        // exp(s − L): 0 at masked scores, and at every score of a row that saw nothing (its
        // lse -inf, clamped so that -inf − L is not NaN).
        let l = one(lse)?.maximum(f32::MIN as f64)?.unsqueeze(D::Minus1)?;
        let p = s.broadcast_sub(&l)?.exp()?;
        let go = f32(&one(grad_out)?.transpose(1, 2)?)?.contiguous()?; // (1, h, sq, dv)
        let dp = go.matmul(&per_head(&f32(&one(v)?)?, h)?.t()?.contiguous()?)?;
        // D_i = dO_i · O_i = Σ_j p_ij dP_ij (the sink carries no value), taken from the f32
        // scores: the output in a 16-bit dtype would carry its rounding into every dS.
        let d = (&p * &dp)?.sum_keepdim(D::Minus1)?;
        let mut ds = (p * dp.broadcast_sub(&d)?)?;
        for (axis, &n) in dims.iter().enumerate().skip(1) {
            if n == 1 {
                ds = ds.sum_keepdim(axis)?;
            }
        }
        gathered.add(ds)?;
    }
    match gathered.finish()? {
        Some(ds) => ds.reshape(bias.dims()),
        None => super::empty_zeros(bias.dims(), DType::F32, bias.device()),
    }
}

/// The sequences' gradients of one bias: concatenated along the batch where the bias has a
/// batch dimension, summed where it has none.
enum Gathered {
    Batched(Vec<Tensor>),
    Summed(Option<Tensor>),
}

impl Gathered {
    fn new(batched: bool) -> Self {
        match batched {
            true => Self::Batched(Vec::new()),
            false => Self::Summed(None),
        }
    }

    fn add(&mut self, ds: Tensor) -> Result<()> {
        match self {
            Self::Batched(v) => v.push(ds),
            Self::Summed(total) => {
                *total = Some(match total.take() {
                    None => ds,
                    Some(t) => (t + ds)?,
                })
            }
        }
        Ok(())
    }

    /// The gathered gradient, or `None` when no sequence was added.
    fn finish(self) -> Result<Option<Tensor>> {
        Ok(match self {
            Self::Batched(v) if v.is_empty() => None,
            Self::Batched(v) => Some(Tensor::cat(&v, 0)?),
            Self::Summed(total) => total,
        })
    }
}

/// `dbias` of a packed variable-length call (q `(total_q, h, d)`, k and v `(total_k, hk, d)`,
/// `lse` `(h, total_q)`) with u32 offsets `[seqlens_q, seqlens_k]` (read to the host here, on
/// any device): each sequence's through [`grad`] on its part of the bias (rows and keys from 0,
/// its batch entry where the bias has one), the rows and keys past the sequence left at 0,
/// summed over the sequences where the bias has no batch dimension.
pub(super) fn grad_varlen(
    opts: &FlashAttn,
    bias: &Tensor,
    [q, k, v]: [&Tensor; 3],
    grad_out: &Tensor,
    lse: &Tensor,
    [cu_q, cu_k]: &[Tensor; 2],
) -> Result<Tensor> {
    let (cu_q, cu_k) = (cu_q.to_vec1::<u32>()?, cu_k.to_vec1::<u32>()?);
    let mut dims = bias.dims().to_vec();
    while dims.len() < 4 {
        dims.insert(0, 1);
    }
    let full = bias.reshape(dims.as_slice())?;
    let (rows, keys) = (dims[2], dims[3]);
    let mut gathered = Gathered::new(dims[0] > 1);
    for s in 0..cu_q.len().saturating_sub(1) {
        let (q0, lq) = (cu_q[s] as usize, (cu_q[s + 1] - cu_q[s]) as usize);
        let (k0, lk) = (cu_k[s] as usize, (cu_k[s + 1] - cu_k[s]) as usize);
        let part = sequence_part(&full, s, lq, lk)?;
        // The sequence's ALiBi slopes and block mask (its blocks only), and its part of the bias.
        let mut one = sequence_opts(opts, s)?;
        one.bias = Some(part.clone());
        if let Some(m) = &mut one.block_mask {
            m.mask = sequence_part(&m.mask, s, lq.div_ceil(m.block_q), lk.div_ceil(m.block_k))?;
        }
        let seq = |t: &Tensor, at: usize, n: usize| t.narrow(0, at, n)?.unsqueeze(0);
        let ds = if lq == 0 || lk == 0 {
            // No score of this sequence: nothing flows to the bias.
            let mut shape = part.dims().to_vec();
            (shape[2], shape[3]) = (rows, keys);
            Tensor::zeros(shape, DType::F32, bias.device())?
        } else {
            let ds = grad_f32(
                &one,
                &part,
                [&seq(q, q0, lq)?, &seq(k, k0, lk)?, &seq(v, k0, lk)?],
                &seq(grad_out, q0, lq)?,
                &lse.narrow(1, q0, lq)?.unsqueeze(0)?,
            )?;
            let ds = if rows > 1 {
                ds.pad_with_zeros(2, 0, rows - lq)?
            } else {
                ds
            };
            if keys > 1 {
                ds.pad_with_zeros(3, 0, keys - lk)?
            } else {
                ds
            }
        };
        gathered.add(ds)?;
    }
    // No sequence: the bias has no batch dimension to fill, and gets zeros.
    let ds = match gathered.finish()? {
        Some(ds) => ds,
        None => Tensor::zeros(dims.as_slice(), DType::F32, bias.device())?,
    };
    ds.reshape(bias.dims())?.to_dtype(bias.dtype())
}

/// What sequence `s` of a packed call reads of a per-position tensor broadcastable to
/// `(batch, heads, rows, cols)`: its batch entry where there is a batch dimension, and its
/// first `rows` and `cols` where those dimensions are not broadcast. Returned with rank 4.
fn sequence_part(t: &Tensor, s: usize, rows: usize, cols: usize) -> Result<Tensor> {
    let mut t = t.clone();
    while t.rank() < 4 {
        t = t.unsqueeze(0)?;
    }
    for (dim, at, n) in [(0, s, 1), (2, 0, rows), (3, 0, cols)] {
        if t.dim(dim)? > 1 {
            t = t.narrow(dim, at, n)?;
        }
    }
    Ok(t)
}

/// The options of sequence `i` alone: the bias, ALiBi slopes and block mask narrowed to it
/// where they have a batch dimension.
fn sequence_opts(opts: &FlashAttn, i: usize) -> Result<FlashAttn> {
    let mut o = opts.clone();
    let narrow = |t: &Tensor, rank: usize| -> Result<Tensor> {
        if t.rank() == rank && t.dim(0)? > 1 {
            t.narrow(0, i, 1)
        } else {
            Ok(t.clone())
        }
    };
    o.bias = o.bias.as_ref().map(|t| narrow(t, 4)).transpose()?;
    o.alibi_slopes = o.alibi_slopes.as_ref().map(|t| narrow(t, 2)).transpose()?;
    if let Some(m) = &mut o.block_mask {
        m.mask = narrow(&m.mask, 4)?;
    }
    Ok(o)
}

/// `out` plus a term that is exactly 0 and whose backward gives a tracked `bias` its gradient
/// ([`grad`] from the output gradient), while q, k and v get theirs from the op as before.
#[allow(clippy::too_many_arguments)]
pub(super) fn track(
    opts: &FlashAttn,
    bias: &Tensor,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    out: &Tensor,
    lse: &Tensor,
    offsets: Option<[Tensor; 2]>,
) -> Result<Tensor> {
    let mut opts = opts.clone();
    opts.bias = Some(bias.detach());
    let zero = bias.apply_op1(BiasGrad {
        opts,
        saved: [q, k, v, out, lse].map(Tensor::detach),
        offsets,
    })?;
    out + zero
}

/// Zeros shaped and typed like the output (never empty: empty calls return before any op),
/// whose argument is the bias: its backward is the bias gradient.
struct BiasGrad {
    opts: FlashAttn,
    /// q, k, v, out and lse of the call, detached.
    saved: [Tensor; 5],
    /// A packed call's u32 offsets `seqlens_q` and `seqlens_k` (read to the host by the
    /// backward pass only).
    offsets: Option<[Tensor; 2]>,
}

impl BiasGrad {
    fn out(&self) -> &Tensor {
        &self.saved[3]
    }
}

impl CustomOp1 for BiasGrad {
    fn name(&self) -> &'static str {
        "flash-attn-bias-grad"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        let out = self.out();
        let zeros = candle::cpu_backend::CpuDevice.zeros_impl(out.shape(), out.dtype())?;
        Ok((zeros, out.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        storage: &candle::CudaStorage,
        _: &Layout,
    ) -> Result<(candle::CudaStorage, Shape)> {
        use candle::backend::BackendStorage;
        let out = self.out();
        let zeros = storage.device().zeros_impl(out.shape(), out.dtype())?;
        Ok((zeros, out.shape().clone()))
    }

    fn bwd(&self, bias: &Tensor, _: &Tensor, grad_res: &Tensor) -> Result<Option<Tensor>> {
        let [q, k, v, _, lse] = &self.saved;
        match &self.offsets {
            None => grad(&self.opts, bias, [q, k, v], grad_res, lse),
            Some(offsets) => grad_varlen(&self.opts, bias, [q, k, v], grad_res, lse, offsets),
        }
        .map(Some)
    }
}
