//! Merging partial attentions through their log-sum-exps: the combine half of every split
//! attention (split-KV decode, cascade inference, ring attention), kept apart from the partial
//! passes that produce the states. The scalar math is
//! [`semantics::merge_weights`](crate::semantics::merge_weights); here are the shape checks, the
//! CPU loop and the dispatch to the CUDA kernel (`kernels/merge.cu`).

use candle::{bail, DType, Device, Result, Tensor};
use rayon::prelude::*;

use crate::semantics::merge_weights;

/// Merges two partial attentions of the same queries over disjoint key sets into the attention
/// over their union: `L = log(e^lse_a + e^lse_b)`, `o = e^(lse_a - L) · o_a + e^(lse_b - L) · o_b`
/// (FlashInfer's `merge_state`). The states are what
/// [`FlashAttn::forward_with_lse`](crate::FlashAttn::forward_with_lse) returns for each key set.
///
/// * `o_a`, `o_b`: `(batch, seq_q, heads, head_dim)`, or the varlen form `(total_q, heads,
///   head_dim)`; f32, f16 or bf16, the same dtype and shape; any strides.
/// * `lse_a`, `lse_b`: f32 `(batch, heads, seq_q)`, or `(heads, total_q)` for the varlen form;
///   natural log, any strides.
/// * Returns the merged output (contiguous, in o's dtype, computed in f32) and the merged
///   log-sum-exp (contiguous f32).
///
/// A row with `lse = -inf` on one side (it saw no key there) takes the other side exactly;
/// `-inf` on both sides gives `o = 0` and `lse = -inf`; a NaN log-sum-exp poisons its row. A side
/// whose weight is exactly 0 is not read (see [`merge_weights`]). The outputs carry no autograd
/// history.
///
/// # Cascade (shared-prefix) inference
///
/// When many requests share a long prefix (a system prompt, a few-shot header), attend each
/// request's queries to the shared prefix K/V once, batched, and to its own suffix K/V
/// separately, then merge: the result is attention over prefix + suffix, while the prefix K/V
/// is stored and read once for all requests. The masks of the two calls must together be the
/// mask of the whole: here the suffix is attended causally and the prefix in full.
///
/// ```
/// use candle::{Device, Tensor};
/// use candle_flash::{merge_states, FlashAttn};
///
/// let dev = Device::Cpu;
/// let (prefix, suffix, heads, d) = (24, 5, 4, 16);
/// let q = Tensor::randn(0f32, 1., (1, suffix, heads, d), &dev)?;
/// let k = Tensor::randn(0f32, 1., (1, prefix + suffix, heads, d), &dev)?;
/// let v = Tensor::randn(0f32, 1., (1, prefix + suffix, heads, d), &dev)?;
/// let op = FlashAttn::new(0.25);
///
/// // Every query sees the whole prefix, and the suffix causally.
/// let (o_pre, lse_pre) = op.forward_with_lse(&q, &k.narrow(1, 0, prefix)?, &v.narrow(1, 0, prefix)?)?;
/// let (o_suf, lse_suf) = op
///     .clone()
///     .causal()
///     .forward_with_lse(&q, &k.narrow(1, prefix, suffix)?, &v.narrow(1, prefix, suffix)?)?;
/// let (o, lse) = merge_states(&o_pre, &lse_pre, &o_suf, &lse_suf)?;
///
/// // The same as one causal call over prefix + suffix (bottom-right aligned).
/// let (whole, whole_lse) = op.causal().forward_with_lse(&q, &k, &v)?;
/// let diff = (o - whole)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
/// let lse_diff = (lse - whole_lse)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
/// assert!(diff < 1e-5 && lse_diff < 1e-5);
///
/// // Shapes that disagree are an error naming the argument.
/// let err = merge_states(&o_pre, &lse_pre, &o_suf.narrow(1, 0, 2)?, &lse_suf).unwrap_err();
/// assert!(err.to_string().contains("o_b"));
/// # Ok::<(), candle::Error>(())
/// ```
///
/// # Errors
///
/// When o's rank is not 3 or 4, `o_b`'s shape or dtype differs from `o_a`'s, the dtype is not
/// f32, f16 or bf16, a log-sum-exp is not f32 or not shaped `(batch, heads, seq_q)` (`(heads,
/// total_q)`), the tensors live on different devices, or the device has no implementation.
pub fn merge_states(
    o_a: &Tensor,
    lse_a: &Tensor,
    o_b: &Tensor,
    lse_b: &Tensor,
) -> Result<(Tensor, Tensor)> {
    let rows = Rows::of(o_a, "o_a")?;
    if o_b.dims() != o_a.dims() {
        bail!(
            "merge_states: o_b must have o_a's shape {:?}, got {:?}",
            o_a.dims(),
            o_b.dims()
        )
    }
    if o_b.dtype() != o_a.dtype() {
        bail!(
            "merge_states: o_b must have o_a's dtype {:?}, got {:?}",
            o_a.dtype(),
            o_b.dtype()
        )
    }
    check_device("o_b", o_b, o_a)?;
    rows.check_lse("lse_a", lse_a, o_a)?;
    rows.check_lse("lse_b", lse_b, o_a)?;
    rows.merge(o_a, lse_a, o_b, lse_b)
}

/// The rows of a merge: o `(batch, seq, heads, d)` (varlen: `batch = 1`, `seq = total_q`).
#[derive(Clone, Copy, Debug)]
struct Rows {
    batch: usize,
    seq: usize,
    heads: usize,
    d: usize,
    varlen: bool,
}

impl Rows {
    fn of(o: &Tensor, name: &str) -> Result<Self> {
        if !matches!(o.dtype(), DType::F32 | DType::F16 | DType::BF16) {
            bail!(
                "merge_states: {name} must be f32, f16 or bf16, got {:?}",
                o.dtype()
            )
        }
        let rows = match *o.dims() {
            [batch, seq, heads, d] => Rows {
                batch,
                seq,
                heads,
                d,
                varlen: false,
            },
            [seq, heads, d] => Rows {
                batch: 1,
                seq,
                heads,
                d,
                varlen: true,
            },
            _ => bail!(
                "merge_states: {name} must be (batch, seq_q, heads, head_dim) or (total_q, heads, \
                 head_dim), got {:?}",
                o.dims()
            ),
        };
        if rows.d == 0 {
            bail!("merge_states: {name} has head_dim 0, the forward never returns one")
        }
        Ok(rows)
    }

    /// The log-sum-exp shape of these rows, as the forward returns it.
    fn lse_shape(&self) -> Vec<usize> {
        match self.varlen {
            true => vec![self.heads, self.seq],
            false => vec![self.batch, self.heads, self.seq],
        }
    }

    fn check_lse(&self, name: &str, lse: &Tensor, o: &Tensor) -> Result<()> {
        let want = self.lse_shape();
        if lse.dims() != want.as_slice() {
            bail!(
                "merge_states: {name} must have shape {want:?} (o is {:?}), got {:?}",
                o.dims(),
                lse.dims()
            )
        }
        if lse.dtype() != DType::F32 {
            bail!("merge_states: {name} must be f32, got {:?}", lse.dtype())
        }
        check_device(name, lse, o)
    }

    fn out_shape(&self) -> Vec<usize> {
        match self.varlen {
            true => vec![self.seq, self.heads, self.d],
            false => vec![self.batch, self.seq, self.heads, self.d],
        }
    }

    /// Runs the merge on the (checked) operands' device.
    fn merge(
        &self,
        o_a: &Tensor,
        lse_a: &Tensor,
        o_b: &Tensor,
        lse_b: &Tensor,
    ) -> Result<(Tensor, Tensor)> {
        let (out_shape, lse_shape) = (self.out_shape(), self.lse_shape());
        if self.batch * self.seq * self.heads == 0 {
            let dev = o_a.device();
            return Ok((
                crate::op::empty_zeros(&out_shape, o_a.dtype(), dev)?,
                crate::op::empty_zeros(&lse_shape, DType::F32, dev)?,
            ));
        }
        // Both forms as rank 4 / rank 3 (varlen: one sequence of total_q rows).
        let four = |t: &Tensor| match self.varlen {
            true => t.unsqueeze(0),
            false => Ok(t.clone()),
        };
        let (o_a4, lse_a3, o_b4, lse_b3) = (four(o_a)?, four(lse_a)?, four(o_b)?, four(lse_b)?);
        let (o, lse) = match o_a.device() {
            Device::Cpu => self.cpu(&o_a4, &lse_a3, &o_b4, &lse_b3)?,
            #[cfg(feature = "cuda")]
            Device::Cuda(_) => self.cuda(&o_a4, &lse_a3, &o_b4, &lse_b3)?,
            dev => bail!("merge_states: no implementation for device {dev:?}"),
        };
        Ok((o.reshape(out_shape)?, lse.reshape(lse_shape)?))
    }

    /// The CPU loop: every operand as contiguous f32, one parallel pass over the output rows and
    /// one over the log-sum-exps.
    fn cpu(
        &self,
        o_a: &Tensor,
        lse_a: &Tensor,
        o_b: &Tensor,
        lse_b: &Tensor,
    ) -> Result<(Tensor, Tensor)> {
        let Rows {
            batch,
            seq,
            heads,
            d,
            ..
        } = *self;
        let f32s =
            |t: &Tensor| -> Result<Vec<f32>> { t.to_dtype(DType::F32)?.flatten_all()?.to_vec1() };
        let (la, lb) = (f32s(lse_a)?, f32s(lse_b)?);
        let (a, b) = (f32s(o_a)?, f32s(o_b)?);
        let mut out = vec![0f32; batch * seq * heads * d];
        // (d >= 1: checked in `Rows::of`.)
        out.par_chunks_mut(d).enumerate().for_each(|(row, o)| {
            // row = (bi * seq + s) * heads + h; the lse of (bi, h, s).
            let (h, bs) = (row % heads, row / heads);
            let (s, bi) = (bs % seq, bs / seq);
            let l = (bi * heads + h) * seq + s;
            let w = merge_weights(la[l], lb[l]);
            let oa = &a[row * d..(row + 1) * d];
            let ob = &b[row * d..(row + 1) * d];
            for (x, o) in o.iter_mut().enumerate() {
                *o = w.value(oa[x], ob[x]);
            }
        });
        let lse: Vec<f32> = la
            .par_iter()
            .zip(lb.par_iter())
            .map(|(&x, &y)| merge_weights(x, y).lse)
            .collect();
        let out =
            Tensor::from_vec(out, (batch, seq, heads, d), &Device::Cpu)?.to_dtype(o_a.dtype())?;
        Ok((
            out,
            Tensor::from_vec(lse, (batch, heads, seq), &Device::Cpu)?,
        ))
    }

    #[cfg(feature = "cuda")]
    fn cuda(
        &self,
        o_a: &Tensor,
        lse_a: &Tensor,
        o_b: &Tensor,
        lse_b: &Tensor,
    ) -> Result<(Tensor, Tensor)> {
        use candle::{op::BackpropOp, Storage};
        let guards = [o_a, lse_a, o_b, lse_b].map(|t| t.storage_and_layout());
        let operand = |i: usize| -> Result<(&candle::CudaStorage, &candle::Layout)> {
            let (s, l) = &guards[i];
            match &**s {
                Storage::Cuda(s) => Ok((s, l)),
                _ => bail!("merge_states: every operand must be on o_a's CUDA device"),
            }
        };
        let (oa, la, ob, lb) = (operand(0)?, operand(1)?, operand(2)?, operand(3)?);
        let (o, lse) =
            crate::cuda::merge([self.batch, self.seq, self.heads, self.d], oa, la, ob, lb)?;
        drop(guards);
        let t = |s, shape: Vec<usize>| {
            Tensor::from_storage(Storage::Cuda(s), shape, BackpropOp::none(), false)
        };
        Ok((
            t(o, vec![self.batch, self.seq, self.heads, self.d]),
            t(lse, vec![self.batch, self.heads, self.seq]),
        ))
    }
}

fn check_device(name: &str, t: &Tensor, like: &Tensor) -> Result<()> {
    if !t.device().same_device(like.device()) {
        bail!(
            "merge_states: {name} must be on the device of the output it merges ({:?}), got {:?}",
            like.device(),
            t.device()
        )
    }
    Ok(())
}

#[cfg(all(test, feature = "cuda"))]
mod tests {
    use super::*;

    /// The CUDA kernel against the CPU loop, on strided views, every dtype, edge rows included. Fails (never skips) when the feature is on and no GPU answers.
    #[cfg(feature = "cuda")]
    #[test]
    fn cuda_matches_cpu() -> Result<()> {
        let gpu = Device::new_cuda(0)?;
        let (b, s, h, d) = (2, 37, 3, 40);
        let inf = f32::INFINITY;
        let lse = |seed: f32| -> Result<Tensor> {
            let mut v: Vec<f32> = (0..b * h * s)
                .map(|i| (i as f32 * seed).sin() * 4.0)
                .collect();
            // Edge rows: one side -inf, both -inf (with the other seed), NaN.
            v[0] = -inf;
            v[1] = if seed > 1.0 { -inf } else { 0.5 };
            v[2] = if seed > 1.0 { f32::NAN } else { 1.0 };
            // Stored as (b, s, h), seen as (b, h, s): a strided view.
            Tensor::from_vec(v, (b, s, h), &Device::Cpu)?.transpose(1, 2)
        };
        let (la, lb) = (lse(0.7)?, lse(1.3)?);
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            let o = |seed: u64| -> Result<Tensor> {
                let t = Tensor::rand(-1f32, 1., (b, h, s, d + 3), &Device::Cpu)?
                    .affine(1.0, seed as f64)?
                    .to_dtype(dtype)?;
                t.narrow(3, 1, d)?.transpose(1, 2) // (b, s, h, d), strided, offset
            };
            let (oa, ob) = (o(0)?, o(1)?);
            let g = |t: &Tensor| t.to_device(&gpu);
            let cpu = merge_states(&oa, &la, &ob, &lb)?;
            let cuda = merge_states(&g(&oa)?, &g(&la)?, &g(&ob)?, &g(&lb)?)?;
            for (what, (c_o, c_l), (g_o, g_l)) in [("merge", cpu, cuda)] {
                assert!(g_o.device().is_cuda() && g_o.is_contiguous() && g_o.dtype() == dtype);
                let v = |t: &Tensor| -> Result<Vec<f32>> {
                    t.to_device(&Device::Cpu)?
                        .to_dtype(DType::F32)?
                        .flatten_all()?
                        .to_vec1()
                };
                let tol = if dtype == DType::F32 { 1e-6 } else { 1e-2 };
                for (name, x, y) in [("o", v(&c_o)?, v(&g_o)?), ("lse", v(&c_l)?, v(&g_l)?)] {
                    for (i, (p, q)) in x.iter().zip(&y).enumerate() {
                        let same = p.to_bits() == q.to_bits() || (p.is_nan() && q.is_nan());
                        assert!(
                            same || (p - q).abs() <= tol * p.abs().max(1.0),
                            "{what} {dtype:?} {name}[{i}]: cpu {p} cuda {q}"
                        );
                    }
                }
            }
        }
        Ok(())
    }
}
