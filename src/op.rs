//! The public op struct, input validation and the `CustomOp3` that dispatches to a backend.

use std::sync::Mutex;

use candle::backend::BackendStorage;
use candle::op::BackpropOp;
use candle::{bail, CpuStorage, DType, Layout, Result, Shape, Storage, Tensor};

use crate::problem::{Problem, Strides, VarLen};
use crate::semantics::{ScoreMod, Window};

/// Largest supported head dimension (every size from 1 up to it works on every backend).
pub const MAX_HEAD_DIM: usize = 256;

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
        let op = FlashAttnOp {
            problem,
            alibi: self.alibi_slopes.clone(),
            lse: Mutex::new(None),
        };
        let out = q.apply_op3_no_bwd(k, v, &op)?;
        let lse = op
            .lse
            .lock()
            .map_err(|_| candle::Error::Msg("lse slot poisoned".into()))?
            .take();
        let lse = match lse {
            Some(storage) => Tensor::from_storage(storage, lse_shape, BackpropOp::none(), false),
            None => bail!("flash-attn: backend returned no log-sum-exp"),
        };
        Ok((out, lse))
    }

    /// Validates the inputs against each other and the options, and describes the call.
    pub(crate) fn problem(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        varlen: Option<VarLen>,
    ) -> Result<Problem> {
        let rank = if varlen.is_some() { 3 } else { 4 };
        let expect = if varlen.is_some() {
            "(total_tokens, heads, head_dim)"
        } else {
            "(batch, seq, heads, head_dim)"
        };
        for (name, t) in [("q", q), ("k", k), ("v", v)] {
            if t.rank() != rank {
                bail!(
                    "flash-attn: {name} must have rank {rank} {expect}, got shape {:?}",
                    t.dims()
                )
            }
        }
        let dtype = q.dtype();
        if !matches!(dtype, DType::F32 | DType::F16 | DType::BF16) {
            bail!("flash-attn: q has dtype {dtype:?}, only f32, f16 and bf16 are supported")
        }
        for (name, t) in [("k", k), ("v", v)] {
            if t.dtype() != dtype {
                bail!(
                    "flash-attn: {name} has dtype {:?} but q has {dtype:?}",
                    t.dtype()
                )
            }
            check_device(name, t, q)?;
        }
        let (qd, kd, vd) = (q.dims(), k.dims(), v.dims());
        let (batch, seq_q, heads, head_dim) = match varlen {
            None => (qd[0], qd[1], qd[2], qd[3]),
            Some(ref vl) => (vl.cu_q.len() - 1, vl.max_seqlen_q, qd[1], qd[2]),
        };
        let (kv_heads, seq_k) = (kd[rank - 2], if varlen.is_some() { 0 } else { kd[1] });
        if kd != vd {
            bail!("flash-attn: k has shape {kd:?} but v has shape {vd:?}")
        }
        if varlen.is_none() && kd[0] != batch {
            bail!(
                "flash-attn: q has batch {batch} but k and v have batch {}",
                kd[0]
            )
        }
        if kd[rank - 1] != head_dim {
            bail!(
                "flash-attn: q has head_dim {head_dim} but k and v have head_dim {}",
                kd[rank - 1]
            )
        }
        if head_dim == 0 || head_dim > MAX_HEAD_DIM {
            bail!("flash-attn: head_dim {head_dim} is unsupported (must be 1..={MAX_HEAD_DIM})")
        }
        if kv_heads == 0 {
            bail!("flash-attn: k and v have 0 kv heads")
        }
        if heads % kv_heads != 0 {
            bail!("flash-attn: q has {heads} heads, not a multiple of the {kv_heads} kv heads of k and v")
        }
        if !self.softmax_scale.is_finite() {
            bail!(
                "flash-attn: softmax_scale must be finite, got {}",
                self.softmax_scale
            )
        }
        let softcap = match self.softcap {
            None => 0.0,
            Some(0.0) => 0.0,
            Some(c) if c > 0.0 && c.is_finite() => c,
            Some(c) => {
                bail!("flash-attn: softcap must be a finite positive number (or 0 = off), got {c}")
            }
        };
        let alibi_batch_stride = match &self.alibi_slopes {
            None => 0,
            Some(s) => check_alibi(s, q, batch, heads)?,
        };
        let (q_s, k_s, v_s, total_q, max_seq_k) = match &varlen {
            None => (
                Strides::dense(q.layout()),
                Strides::dense(k.layout()),
                Strides::dense(v.layout()),
                batch * seq_q,
                seq_k,
            ),
            Some(vl) => (
                Strides::packed(q.layout()),
                Strides::packed(k.layout()),
                Strides::packed(v.layout()),
                qd[0],
                vl.max_seqlen_k,
            ),
        };
        Ok(Problem {
            batch,
            heads,
            kv_heads,
            head_dim,
            max_seq_q: seq_q,
            max_seq_k,
            total_q,
            q: q_s,
            k: k_s,
            v: v_s,
            varlen,
            window: self.mask(),
            score: ScoreMod {
                scale: self.softmax_scale,
                softcap,
            },
            alibi_batch_stride,
        })
    }
}

/// `t` (the argument `name`) must live on q's device.
fn check_device(name: &str, t: &Tensor, q: &Tensor) -> Result<()> {
    if !t.device().same_device(q.device()) {
        bail!(
            "flash-attn: {name} is on {:?} but q is on {:?}",
            t.device().location(),
            q.device().location()
        )
    }
    Ok(())
}

/// Checks ALiBi slopes and returns their batch stride (0 for per-head slopes).
fn check_alibi(s: &Tensor, q: &Tensor, batch: usize, heads: usize) -> Result<usize> {
    if s.dtype() != DType::F32 {
        bail!("flash-attn: alibi_slopes must be f32, got {:?}", s.dtype())
    }
    check_device("alibi_slopes", s, q)?;
    match s.dims() {
        [h] if *h == heads => Ok(0),
        [b, h] if *b == batch && *h == heads => Ok(heads),
        d => bail!(
            "flash-attn: alibi_slopes must have shape ({heads},) or ({batch}, {heads}), got {d:?}"
        ),
    }
}

/// Reads and checks cumulative sequence lengths of a varlen call.
fn read_seqlens(
    q: &Tensor,
    k: &Tensor,
    seqlens_q: &Tensor,
    seqlens_k: &Tensor,
    max_seqlen_q: usize,
    max_seqlen_k: usize,
) -> Result<VarLen> {
    let read = |name: &str, t: &Tensor, total: Option<usize>, max: usize| -> Result<Vec<u32>> {
        if t.dtype() != DType::U32 {
            bail!("flash-attn: {name} must be u32, got {:?}", t.dtype())
        }
        if t.rank() != 1 || t.dims1()? == 0 {
            bail!(
                "flash-attn: {name} must have shape (batch + 1,), got {:?}",
                t.dims()
            )
        }
        check_device(name, t, q)?;
        let cu = t.to_vec1::<u32>()?;
        if cu[0] != 0 {
            bail!("flash-attn: {name} must start at 0, got {}", cu[0])
        }
        for (b, w) in cu.windows(2).enumerate() {
            if w[1] < w[0] {
                bail!(
                    "flash-attn: {name} must be non-decreasing, got {} then {} at {b}",
                    w[0],
                    w[1]
                )
            }
            if (w[1] - w[0]) as usize > max {
                bail!(
                    "flash-attn: sequence {b} of {name} has length {} > max_seqlen {max}",
                    w[1] - w[0]
                )
            }
        }
        if let Some(total) = total {
            if *cu.last().unwrap_or(&0) as usize != total {
                bail!(
                    "flash-attn: {name} ends at {} but the packed tensor has {total} tokens",
                    cu.last().unwrap_or(&0)
                )
            }
        }
        Ok(cu)
    };
    for (name, t) in [("q", q), ("k", k)] {
        if t.rank() != 3 {
            bail!("flash-attn: varlen {name} must have rank 3 (total_tokens, heads, head_dim), got {:?}", t.dims())
        }
    }
    let cu_q = read("seqlens_q", seqlens_q, Some(q.dim(0)?), max_seqlen_q)?;
    let cu_k = read("seqlens_k", seqlens_k, Some(k.dim(0)?), max_seqlen_k)?;
    if cu_q.len() != cu_k.len() {
        bail!(
            "flash-attn: seqlens_q has {} entries but seqlens_k has {}: both must be batch + 1",
            cu_q.len(),
            cu_k.len()
        )
    }
    // The longest actual sequences, not the caller's bounds: kernels size their grids by them.
    let longest = |cu: &[u32]| {
        cu.windows(2)
            .map(|w| (w[1] - w[0]) as usize)
            .max()
            .unwrap_or(0)
    };
    Ok(VarLen {
        max_seqlen_q: longest(&cu_q),
        max_seqlen_k: longest(&cu_k),
        cu_q,
        cu_k,
    })
}

/// The `CustomOp3` behind every public function: q, k and v are its three operands.
pub(crate) struct FlashAttnOp {
    pub problem: Problem,
    pub alibi: Option<Tensor>,
    /// The log-sum-exp storage a backend leaves behind, taken by [`FlashAttn::run`].
    pub lse: Mutex<Option<Storage>>,
}

impl FlashAttnOp {
    fn stash_lse(&self, lse: Storage) -> Result<()> {
        *self
            .lse
            .lock()
            .map_err(|_| candle::Error::Msg("lse slot poisoned".into()))? = Some(lse);
        Ok(())
    }
}

impl candle::CustomOp3 for FlashAttnOp {
    fn name(&self) -> &'static str {
        "flash-attn"
    }

    fn cpu_fwd(
        &self,
        q: &CpuStorage,
        ql: &Layout,
        k: &CpuStorage,
        kl: &Layout,
        v: &CpuStorage,
        vl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        self.problem.check_layouts(ql, kl, vl)?;
        let slopes = match &self.alibi {
            None => None,
            Some(s) => Some(s.flatten_all()?.to_vec1::<f32>()?),
        };
        let p = &self.problem;
        let slopes = slopes.as_deref();
        let (out, lse) = match (q, k, v) {
            (CpuStorage::F32(q), CpuStorage::F32(k), CpuStorage::F32(v)) => {
                p.check_bounds(q.len(), k.len(), v.len())?;
                let (o, l) = crate::cpu::forward(p, slopes, q, k, v);
                (CpuStorage::F32(o), l)
            }
            (CpuStorage::F16(q), CpuStorage::F16(k), CpuStorage::F16(v)) => {
                p.check_bounds(q.len(), k.len(), v.len())?;
                let (o, l) = crate::cpu::forward(p, slopes, q, k, v);
                (CpuStorage::F16(o), l)
            }
            (CpuStorage::BF16(q), CpuStorage::BF16(k), CpuStorage::BF16(v)) => {
                p.check_bounds(q.len(), k.len(), v.len())?;
                let (o, l) = crate::cpu::forward(p, slopes, q, k, v);
                (CpuStorage::BF16(o), l)
            }
            _ => bail!(
                "flash-attn: q, k, v must share one of f32/f16/bf16, got {:?}/{:?}/{:?}",
                q.dtype(),
                k.dtype(),
                v.dtype()
            ),
        };
        self.stash_lse(Storage::Cpu(CpuStorage::F32(lse)))?;
        Ok((out, Shape::from(p.out_shape())))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        q: &candle::CudaStorage,
        ql: &Layout,
        k: &candle::CudaStorage,
        kl: &Layout,
        v: &candle::CudaStorage,
        vl: &Layout,
    ) -> Result<(candle::CudaStorage, Shape)> {
        self.problem.check_layouts(ql, kl, vl)?;
        let (out, lse) = crate::cuda::forward(self, q, k, v)?;
        self.stash_lse(Storage::Cuda(lse))?;
        Ok((out, Shape::from(self.problem.out_shape())))
    }
}
