//! The `CustomOp3` behind every public function: q, k and v are its three operands; the
//! validated [`Problem`] and the ALiBi slopes are all a backend receives.

use std::sync::{Arc, Mutex, OnceLock};

use candle::backend::BackendStorage;
use candle::{bail, CpuStorage, Layout, Result, Shape, Storage, Tensor};

use crate::problem::Problem;

pub(crate) struct FlashAttnOp {
    pub problem: Problem,
    pub alibi: Option<Tensor>,
    /// The log-sum-exp storage a backend leaves behind, taken by `FlashAttn::run`.
    pub lse_stash: Arc<Mutex<Option<Storage>>>,
    /// The same log-sum-exp as a tensor, kept for the backward pass.
    pub lse: Arc<OnceLock<Tensor>>,
}

impl FlashAttnOp {
    pub fn new(problem: Problem, alibi: Option<Tensor>) -> Self {
        Self {
            problem,
            alibi,
            lse_stash: Arc::default(),
            lse: Arc::default(),
        }
    }

    fn stash_lse(&self, lse: Storage) -> Result<()> {
        *self
            .lse_stash
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
                let (o, l) = crate::cpu::forward(p, slopes, q, k, v)?;
                (CpuStorage::F32(o), l)
            }
            (CpuStorage::F16(q), CpuStorage::F16(k), CpuStorage::F16(v)) => {
                p.check_bounds(q.len(), k.len(), v.len())?;
                let (o, l) = crate::cpu::forward(p, slopes, q, k, v)?;
                (CpuStorage::F16(o), l)
            }
            (CpuStorage::BF16(q), CpuStorage::BF16(k), CpuStorage::BF16(v)) => {
                p.check_bounds(q.len(), k.len(), v.len())?;
                let (o, l) = crate::cpu::forward(p, slopes, q, k, v)?;
                (CpuStorage::BF16(o), l)
            }
            // An FP8 cache read as stored (decode calls; see `op::fp8`).
            (CpuStorage::F32(q), CpuStorage::F8E4M3(k), CpuStorage::F8E4M3(v)) => {
                p.check_bounds(q.len(), k.len(), v.len())?;
                let (o, l) = crate::cpu::forward_kv8(p, slopes, q, k, v)?;
                (CpuStorage::F32(o), l)
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
        let (out, lse) = crate::cuda::forward(&self.problem, self.alibi.as_ref(), q, k, v)?;
        self.stash_lse(Storage::Cuda(lse))?;
        Ok((out, Shape::from(self.problem.out_shape())))
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        out: &Tensor,
        grad_out: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let Some(lse) = self.lse.get() else {
            bail!("flash-attn backward: the forward pass left no log-sum-exp")
        };
        let (dq, dk, dv) = super::backward::backward(
            &self.problem,
            self.alibi.as_ref(),
            q,
            k,
            v,
            out,
            grad_out,
            lse,
        )?;
        Ok((
            super::grad_for(q, dq),
            super::grad_for(k, dk),
            super::grad_for(v, dv),
        ))
    }
}

/// The op of a call with nothing to compute (the output has no element: q has none either):
/// under autograd it still links the empty output to q, k and v, so `backward()` gives each a
/// gradient (all zeros) as for any other call. Candle's own ops would not: they return an empty
/// operand unchanged and drop the others from the graph.
pub(crate) struct EmptyAttnOp {
    pub out_shape: Vec<usize>,
}

impl candle::CustomOp3 for EmptyAttnOp {
    fn name(&self) -> &'static str {
        "flash-attn-empty"
    }

    fn cpu_fwd(
        &self,
        q: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        use candle::backend::BackendDevice;
        let shape = Shape::from(self.out_shape.clone());
        Ok((
            candle::cpu_backend::CpuDevice.zeros_impl(&shape, q.dtype())?,
            shape,
        ))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        q: &candle::CudaStorage,
        _: &Layout,
        _: &candle::CudaStorage,
        _: &Layout,
        _: &candle::CudaStorage,
        _: &Layout,
    ) -> Result<(candle::CudaStorage, Shape)> {
        use candle::backend::BackendDevice;
        // One element backs the empty output: the driver refuses a zero-byte allocation.
        let shape = Shape::from(self.out_shape.clone());
        Ok((q.device().zeros_impl(&Shape::from(1), q.dtype())?, shape))
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        _out: &Tensor,
        _grad_out: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let zeros = |t: &Tensor| -> Result<Option<Tensor>> {
            Ok(super::grad_for(
                t,
                super::empty_zeros(t.dims(), t.dtype(), t.device())?,
            ))
        };
        Ok((zeros(q)?, zeros(k)?, zeros(v)?))
    }
}
