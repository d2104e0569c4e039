//! The CUDA backward pass: gradients of q, k and v from the saved log-sum-exp.

use candle::{bail, CudaStorage, Result, Tensor};

use crate::problem::Problem;

/// dq (contiguous like the output), dk and dv (contiguous, `k_rows × kv_heads × d`).
/// `offsets` are the start offsets (elements) of `out`, `grad_out` and `lse`, which are
/// contiguous from there.
#[allow(clippy::too_many_arguments)]
pub(crate) fn backward(
    p: &Problem,
    alibi: Option<&Tensor>,
    q: &CudaStorage,
    k: &CudaStorage,
    v: &CudaStorage,
    out: &CudaStorage,
    grad_out: &CudaStorage,
    lse: &CudaStorage,
    offsets: [usize; 3],
    k_rows: usize,
) -> Result<(CudaStorage, CudaStorage, CudaStorage)> {
    let _ = (p, alibi, q, k, v, out, grad_out, lse, offsets, k_rows);
    bail!("flash-attn backward: the CUDA backward pass is not implemented yet")
}
