//! Tiled CPU backward pass (FlashAttention-2): gradients of q, k and v from the saved
//! log-sum-exp, with no N×N buffer.

use candle::{bail, Result};

use super::elem::Elem;
use crate::problem::Problem;

/// dq (contiguous like the output: `total_q × heads × d`), dk and dv (contiguous,
/// `k_rows × kv_heads × d`) of one call. `out`, `grad_out` are contiguous like the output,
/// `lse` is the forward's log-sum-exp in its own layout (see [`Problem::lse_head_stride`]).
#[allow(clippy::too_many_arguments, clippy::type_complexity)]
pub(crate) fn backward<T: Elem>(
    p: &Problem,
    slopes: Option<&[f32]>,
    q: &[T],
    k: &[T],
    v: &[T],
    out: &[T],
    grad_out: &[T],
    lse: &[f32],
    k_rows: usize,
) -> Result<(Vec<T>, Vec<T>, Vec<T>)> {
    let _ = (p, slopes, q, k, v, out, grad_out, lse, k_rows);
    bail!("flash-attn backward: the CPU backward pass is not implemented yet")
}
