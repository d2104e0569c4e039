//! The public op struct and its builder; validation lives in `validate`, the `CustomOp3` that
//! dispatches to a backend in `custom`.

mod custom;
mod validate;

use candle::op::BackpropOp;
use candle::{bail, DType, Result, Tensor};

use crate::problem::Problem;
use crate::semantics::Window;
use custom::FlashAttnOp;
use validate::read_seqlens;

/// Largest supported head dimension (every size from 1 up to it works on every backend).
pub const MAX_HEAD_DIM: usize = 512;

/// Exact attention `softmax(q kᵀ · scale) v`, computed tile by tile with an online softmax.
///
/// The fields are the options of the call; the `flash_attn*` functions of this crate are thin
/// wrappers that fill them in. `forward_with_lse` also returns the log-sum-exp of each row.
///
/// ```
/// use candle::{Device, Tensor};
/// use candle_flash::FlashAttn;
/// let q = Tensor::randn(0f32, 1., (1, 5, 4, 16), &Device::Cpu)?;
/// let kv = Tensor::randn(0f32, 1., (1, 7, 2, 16), &Device::Cpu)?;
/// let (out, lse) = FlashAttn::new(0.25).causal().forward_with_lse(&q, &kv, &kv)?;
/// assert_eq!(out.dims(), &[1, 5, 4, 16]);
/// assert_eq!(lse.dims(), &[1, 4, 5]);
/// # Ok::<(), candle::Error>(())
/// ```
#[derive(Clone, Debug)]
pub struct FlashAttn {
    /// Multiplies `q·k` before the softmax (usually `1/sqrt(head_dim)`).
    pub softmax_scale: f32,
    /// Keys visible left of the (bottom-right aligned) diagonal; `None` = all.
    pub window_size_left: Option<usize>,
    /// Keys visible right of the diagonal; `None` = all, `Some(0)` = causal.
    pub window_size_right: Option<usize>,
    /// `Some(c)` with `c > 0` applies `c * tanh(s / c)` to the scaled scores.
    pub softcap: Option<f32>,
    /// ALiBi slopes, f32 of shape `(heads,)` or `(batch, heads)`.
    pub alibi_slopes: Option<Tensor>,
}

impl FlashAttn {
    /// Full (unmasked) attention with the given scale.
    pub fn new(softmax_scale: f32) -> Self {
        Self {
            softmax_scale,
            window_size_left: None,
            window_size_right: None,
            softcap: None,
            alibi_slopes: None,
        }
    }

    /// Bottom-right aligned causal masking (`window(None, Some(0))`).
    pub fn causal(self) -> Self {
        self.window(None, Some(0))
    }

    /// Sliding window of `left` keys before and `right` keys after the diagonal.
    pub fn window(mut self, left: Option<usize>, right: Option<usize>) -> Self {
        self.window_size_left = left;
        self.window_size_right = right;
        self
    }

    /// Softcapping of the scores with cap `c` (`c > 0`).
    pub fn softcap(mut self, c: f32) -> Self {
        self.softcap = Some(c);
        self
    }

    /// ALiBi with the given f32 slopes, `(heads,)` or `(batch, heads)`.
    pub fn alibi(mut self, slopes: &Tensor) -> Self {
        self.alibi_slopes = Some(slopes.clone());
        self
    }

    /// The masking band of this op.
    pub fn mask(&self) -> Window {
        Window::new(self.window_size_left, self.window_size_right)
    }

    /// q: `(batch, seq_q, heads, head_dim)`; k, v: `(batch, seq_k, kv_heads, head_dim)`.
    /// Returns the output, shaped and typed like q.
    pub fn forward(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
        Ok(self.forward_with_lse(q, k, v)?.0)
    }

    /// Like [`forward`](Self::forward), also returning the log-sum-exp (natural log) of every
    /// row's scores, f32 of shape `(batch, heads, seq_q)`; `-inf` for rows that see no key.
    pub fn forward_with_lse(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
        let problem = self.problem(q, k, v, None)?;
        self.run(problem, q, k, v)
    }

    /// Packed variable-length batch: q `(total_q, heads, head_dim)`, k and v
    /// `(total_k, kv_heads, head_dim)`, cumulative u32 lengths `seqlens_q`/`seqlens_k` of
    /// `batch + 1` entries starting at 0.
    #[allow(clippy::too_many_arguments)]
    pub fn forward_varlen(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        seqlens_q: &Tensor,
        seqlens_k: &Tensor,
        max_seqlen_q: usize,
        max_seqlen_k: usize,
    ) -> Result<Tensor> {
        Ok(self
            .forward_varlen_with_lse(q, k, v, seqlens_q, seqlens_k, max_seqlen_q, max_seqlen_k)?
            .0)
    }

    /// Varlen with log-sum-exp, f32 of shape `(heads, total_q)`.
    #[allow(clippy::too_many_arguments)]
    pub fn forward_varlen_with_lse(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        seqlens_q: &Tensor,
        seqlens_k: &Tensor,
        max_seqlen_q: usize,
        max_seqlen_k: usize,
    ) -> Result<(Tensor, Tensor)> {
        let vl = read_seqlens(q, k, seqlens_q, seqlens_k, max_seqlen_q, max_seqlen_k)?;
        let problem = self.problem(q, k, v, Some(vl))?;
        self.run(problem, q, k, v)
    }

    fn run(
        &self,
        problem: Problem,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
    ) -> Result<(Tensor, Tensor)> {
        let out_shape = problem.out_shape();
        let lse_shape = problem.lse_shape();
        if out_shape.iter().product::<usize>() == 0 {
            // Nothing to compute (empty batch, seq_q = 0 or heads = 0): no launch.
            let out = Tensor::zeros(out_shape, q.dtype(), q.device())?;
            let lse = Tensor::zeros(lse_shape, DType::F32, q.device())?;
            return Ok((out, lse));
        }
        let op = FlashAttnOp::new(problem, self.alibi_slopes.clone());
        let (stash, saved) = (op.lse_stash.clone(), op.lse.clone());
        // Applied with backpropagation recorded: `loss.backward()` reaches `FlashAttnOp::bwd`
        // instead of silently treating the op as a constant.
        let out = q.apply_op3(k, v, op)?;
        let storage = stash
            .lock()
            .map_err(|_| candle::Error::Msg("lse slot poisoned".into()))?
            .take();
        let lse = match storage {
            Some(storage) => Tensor::from_storage(storage, lse_shape, BackpropOp::none(), false),
            None => bail!("flash-attn: backend returned no log-sum-exp"),
        };
        // Kept with the op for its backward pass (f32, one value per row).
        let _ = saved.set(lse.clone());
        Ok((out, lse))
    }
}
