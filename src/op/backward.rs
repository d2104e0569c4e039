//! The backward pass behind [`FlashAttnOp::bwd`](super::custom::FlashAttnOp): the validated
//! forward [`Problem`], its saved log-sum-exp and the output gradient in; dq, dk and dv out,
//! shaped and typed like q, k and v (contiguous). Backends receive storages, never the op.

use candle::{backend::BackendStorage, bail, CpuStorage, Result, Storage, Tensor};

use candle::op::BackpropOp;

use crate::problem::Problem;

/// Gradients of q, k and v.
pub(crate) type Grads = (Tensor, Tensor, Tensor);

/// Checks that the backward pass covers this call, then runs it on the inputs' device.
#[allow(clippy::too_many_arguments)]
pub(crate) fn backward(
    p: &Problem,
    alibi: Option<&Tensor>,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    out: &Tensor,
    grad_out: &Tensor,
    lse: &Tensor,
) -> Result<Grads> {
    if p.paged.is_some() || p.seqused_k.is_some() {
        bail!(
            "flash-attn backward: paged and KV-cache calls have no backward pass (they are \
             inference-only); detach the cache or use dense/varlen inputs"
        )
    }
    if p.prefix.is_some() {
        bail!("flash-attn backward: mm_prefix_ranges have no backward pass")
    }
    p.check_layouts(q.layout(), k.layout(), v.layout())?;
    let grad_out = grad_out.to_dtype(q.dtype())?.contiguous()?;
    let out = out.contiguous()?;
    let lse = lse.contiguous()?;
    // Storages and layouts of q, k, v, the output, its gradient and the lse, taken once.
    let guards = [q, k, v, &out, &grad_out, &lse].map(|t| t.storage_and_layout());
    let offsets = [3, 4, 5].map(|i| guards[i].1.start_offset());
    let storages = match std::array::from_fn::<_, 6, _>(|i| &*guards[i].0) {
        [Storage::Cpu(q), Storage::Cpu(k), Storage::Cpu(v), Storage::Cpu(o), Storage::Cpu(g), Storage::Cpu(l)] => {
            cpu(p, alibi, [q, k, v, o, g, l], offsets)?
        }
        #[cfg(feature = "cuda")]
        [Storage::Cuda(q), Storage::Cuda(k), Storage::Cuda(v), Storage::Cuda(o), Storage::Cuda(g), Storage::Cuda(l)] =>
        {
            let saved = crate::cuda::BwdSaved {
                out: o,
                grad_out: g,
                lse: l,
                offsets,
            };
            let (dq, dk, dv) = crate::cuda::backward(p, alibi, [q, k, v], saved, k_rows(p))?;
            [Storage::Cuda(dq), Storage::Cuda(dk), Storage::Cuda(dv)]
        }
        _ => bail!(
            "flash-attn backward: q, k, v, the output and its gradient must all be on the CPU or \
             all on one CUDA GPU, got {:?}",
            q.device()
        ),
    };
    drop(guards);
    Ok(wrap(storages, [q, k, v]))
}

/// Contiguous gradient tensors from the backend's buffers, in the shapes of q, k and v.
fn wrap(storages: [Storage; 3], like: [&Tensor; 3]) -> Grads {
    let [dq, dk, dv] = storages;
    let t = |s: Storage, l: &Tensor| Tensor::from_storage(s, l.shape(), BackpropOp::none(), false);
    (t(dq, like[0]), t(dk, like[1]), t(dv, like[2]))
}

/// The CPU arm: q, k, v, out, grad_out and lse storages; `offsets` are the start offsets of the
/// last three, which are contiguous from there.
fn cpu(
    p: &Problem,
    alibi: Option<&Tensor>,
    [qs, ks, vs, os, gs, ls]: [&CpuStorage; 6],
    [o_off, g_off, l_off]: [usize; 3],
) -> Result<[Storage; 3]> {
    let slopes = match alibi {
        None => None,
        Some(s) => Some(s.flatten_all()?.to_vec1::<f32>()?),
    };
    let slopes = slopes.as_deref();
    let CpuStorage::F32(lse) = ls else {
        bail!("flash-attn backward: the saved log-sum-exp is not f32")
    };
    let lse = &lse[l_off..];
    macro_rules! run {
        ($variant:ident) => {{
            let (CpuStorage::$variant(q), CpuStorage::$variant(k), CpuStorage::$variant(v)) =
                (qs, ks, vs)
            else {
                unreachable!()
            };
            let (CpuStorage::$variant(o), CpuStorage::$variant(g)) = (os, gs) else {
                bail!("flash-attn backward: the output gradient's dtype differs from q's")
            };
            p.check_bounds(q.len(), k.len(), v.len())?;
            let (o, g) = (&o[o_off..], &g[g_off..]);
            let (dq, dk, dv) = crate::cpu::backward(p, slopes, q, k, v, o, g, lse, k_rows(p))?;
            [
                Storage::Cpu(CpuStorage::$variant(dq)),
                Storage::Cpu(CpuStorage::$variant(dk)),
                Storage::Cpu(CpuStorage::$variant(dv)),
            ]
        }};
    }
    let storages = match (qs, ks, vs) {
        (CpuStorage::F32(_), CpuStorage::F32(_), CpuStorage::F32(_)) => run!(F32),
        (CpuStorage::F16(_), CpuStorage::F16(_), CpuStorage::F16(_)) => run!(F16),
        (CpuStorage::BF16(_), CpuStorage::BF16(_), CpuStorage::BF16(_)) => run!(BF16),
        _ => bail!(
            "flash-attn backward: q, k, v must share one of f32/f16/bf16, got {:?}/{:?}/{:?}",
            qs.dtype(),
            ks.dtype(),
            vs.dtype()
        ),
    };
    Ok(storages)
}

/// Rows of the contiguous dk/dv: `batch * seq_k` dense, `total_k` varlen.
fn k_rows(p: &Problem) -> usize {
    match &p.varlen {
        None => p.batch * p.max_seq_k,
        Some(vl) => vl.total_k,
    }
}
