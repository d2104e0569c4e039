//! The gradient of attention sinks, outside the kernels: `∂loss/∂sink[h] = −Σ_i p_i D_i` over the
//! rows `i` of head `h`, with `p_i = exp(sink[h] − L_i)` the weight the row gives its sink and
//! `D_i = dO_i · O_i`. The gradients of q, k and v need nothing new: the backward kernels take the
//! sink-inclusive lse `L` that the forward returned.

use candle::{DType, Result, Tensor, D};

/// The lse `(batch, heads, seq_q)` (dense) or `(heads, total_q)` (varlen) rearranged to the
/// output's rows, `(batch, seq_q, heads)` or `(total_q, heads)`, f32 and clamped at `f32::MIN`, so
/// that `exp(sink − L)` is 0 (not NaN) for a row that saw nothing and has a `-inf` sink.
fn lse_rows(lse: &Tensor, varlen: bool) -> Result<Tensor> {
    let rows = if varlen {
        lse.t()?
    } else {
        lse.transpose(1, 2)?
    };
    rows.maximum(f32::MIN as f64)
}

/// `p_i = exp(sink[h] − L_i)` in the output's row layout (heads last); tracked when `sinks` is.
fn sink_weights(sinks: &Tensor, lse: &Tensor, varlen: bool) -> Result<Tensor> {
    sinks.broadcast_sub(&lse_rows(lse, varlen)?)?.exp()
}

/// `out` plus a term that is exactly 0 but whose gradient with respect to `sinks` is
/// `∂out/∂sink = −out · p`: `loss.backward()` then gives a tracked `sinks` its gradient, while
/// q, k and v get theirs from the op as before.
pub(super) fn track(out: &Tensor, lse: &Tensor, sinks: &Tensor, varlen: bool) -> Result<Tensor> {
    let p = sink_weights(sinks, lse, varlen)?.unsqueeze(D::Minus1)?;
    let f = out
        .detach()
        .to_dtype(DType::F32)?
        .broadcast_mul(&p)?
        .neg()?;
    let zero = (&f - f.detach())?.to_dtype(out.dtype())?;
    out + zero
}

/// `dsinks` `(heads,)` f32 from the forward's `out` and `lse` and the output gradient.
pub(super) fn grad(
    out: &Tensor,
    grad_out: &Tensor,
    lse: &Tensor,
    sinks: &Tensor,
    varlen: bool,
) -> Result<Tensor> {
    let f32 = |t: &Tensor| t.to_dtype(DType::F32);
    let d = (f32(out)? * f32(grad_out)?)?.sum(D::Minus1)?;
    let p = sink_weights(&sinks.detach(), lse, varlen)?;
    let per_row = (p * d)?.neg()?;
    // Sum every row of each head: (b, sq, h) or (total, h) down to (h,).
    let per_row = per_row.reshape(((), sinks.dim(0)?))?;
    per_row.sum(0)
}
