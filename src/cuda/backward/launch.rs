//! Executes a [`BwdPlan`]: fills one [`BwdParams`], allocates the gradients and the D scratch,
//! and launches the D pass, the dK/dV pass and the dQ pass on candle's stream.

use std::sync::Arc;

use candle::backend::BackendStorage;
use candle::cuda_backend::cudarc::driver::{
    CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, ValidAsZeroBits,
};
use candle::cuda_backend::{CudaDType, CudaDevice};
use candle::{bail, CudaStorage, DType, Result, Tensor};
use half::{bf16, f16};

use super::instances::Sm90Bwd;
use super::plan::{plan, BwdPlan};
use crate::cuda::launch::to_i32;
use crate::cuda::params::{BwdParams, Params};
use crate::cuda::runtime::call::{problem_params, DevF32};
use crate::cuda::runtime::ints::DevInts;
use crate::cuda::runtime::tma::{tma_map, TmaMap};
use crate::cuda::runtime::{caps, extras, launch, Arg};
use crate::problem::{Problem, Strides};

/// The saved forward results and the output gradient of one backward call.
pub(crate) struct Saved<'a> {
    pub out: &'a CudaStorage,
    pub grad_out: &'a CudaStorage,
    pub lse: &'a CudaStorage,
    /// Start offsets (elements) of `out`, `grad_out` and `lse`, contiguous from there.
    pub offsets: [usize; 3],
}

/// dq (contiguous like the output), dk and dv (contiguous, `k_rows × kv_heads × d`).
pub(crate) fn backward(
    p: &Problem,
    alibi: Option<&Tensor>,
    [q, k, v]: [&CudaStorage; 3],
    saved: Saved,
    k_rows: usize,
) -> Result<(CudaStorage, CudaStorage, CudaStorage)> {
    let dev = q.device().clone();
    let qkv = [q, k, v];
    match (q.dtype(), k.dtype(), v.dtype()) {
        (DType::BF16, DType::BF16, DType::BF16) => {
            backward_t::<bf16>(p, alibi, &dev, qkv, saved, k_rows)
        }
        (DType::F16, DType::F16, DType::F16) => {
            backward_t::<f16>(p, alibi, &dev, qkv, saved, k_rows)
        }
        (DType::F32, DType::F32, DType::F32) => {
            backward_t::<f32>(p, alibi, &dev, qkv, saved, k_rows)
        }
        (a, b, c) => bail!(
            "flash-attn backward: q, k, v must share one of f32/f16/bf16, got {a:?}/{b:?}/{c:?}"
        ),
    }
}

fn backward_t<T: CudaDType + DeviceRepr + ValidAsZeroBits + candle::WithDType>(
    p: &Problem,
    alibi: Option<&Tensor>,
    dev: &CudaDevice,
    [q, k, v]: [&CudaStorage; 3],
    saved: Saved,
    k_rows: usize,
) -> Result<(CudaStorage, CudaStorage, CudaStorage)> {
    let stream = dev.cuda_stream();
    let (q, k, v) = (
        q.as_cuda_slice::<T>()?,
        k.as_cuda_slice::<T>()?,
        v.as_cuda_slice::<T>()?,
    );
    let (out, grad_out) = (
        saved.out.as_cuda_slice::<T>()?,
        saved.grad_out.as_cuda_slice::<T>()?,
    );
    let lse = saved.lse.as_cuda_slice::<f32>()?;
    p.check_bounds(q.len(), k.len(), v.len())?;
    let (d, rows, off) = (p.head_dim, p.total_q * p.heads, saved.offsets);
    if out.len() < off[0] + rows * d
        || grad_out.len() < off[1] + rows * d
        || lse.len() < off[2] + rows
    {
        bail!("flash-attn backward: the output, its gradient or the lse is smaller than the call")
    }
    if p.has_alibi != alibi.is_some() {
        bail!("flash-attn backward: ALiBi slopes do not match the validated problem")
    }
    let pl = plan(
        p,
        T::DTYPE,
        [off[0], off[1]],
        &caps(&stream, p.kernels.portable)?,
    )?;

    // Zero-initialised: the kernels overwrite the rows that belong to a sequence and leave the
    // rest (dk/dv rows past a sequence's keys) at zero.
    let mut dq = dev.alloc_zeros::<T>((rows * d).max(1))?;
    let mut dk = dev.alloc_zeros::<T>((k_rows * p.kv_heads * d).max(1))?;
    let mut dv = dev.alloc_zeros::<T>((k_rows * p.kv_heads * d).max(1))?;
    if rows == 0 || k_rows == 0 || p.batch == 0 {
        return Ok(wrap(dev, dq, dk, dv));
    }
    // SAFETY: the D pass writes every (head, row) of the call before the other passes read it.
    let mut dsum = unsafe { dev.alloc::<f32>(rows)? };
    let cu = lengths(p, &stream)?;
    let slopes = DevF32::new("alibi_slopes", alibi)?;
    let esize = std::mem::size_of::<T>() as u64;
    let at = |s: &CudaSlice<T>, offset: usize| s.device_ptr(&stream).0 + offset as u64 * esize;
    let mut fwd = Params {
        q: at(q, p.q.offset),
        k: at(k, p.k.offset),
        v: at(v, p.v.offset),
        o: at(out, off[0]),
        lse: lse.device_ptr(&stream).0 + off[2] as u64 * 4,
        alibi: slopes.as_ref().map_or(Ok(0), |s| s.ptr(&stream))?,
        cu_q: cu.as_ref().map_or(Ok(0), |c| c[0].ptr(&stream))?,
        cu_k: cu.as_ref().map_or(Ok(0), |c| c[1].ptr(&stream))?,
        ..problem_params(p, [&p.q, &p.k, &p.v], d, p.max_seq_k)?
    };
    // The bias and block mask in place; the kernels check each key's block (no tile lists).
    extras::fill(&mut fwd, p, None, dev)?;
    let params = BwdParams {
        fwd,
        dout: at(grad_out, off[1]),
        dsum: dsum.device_ptr_mut(&stream).0,
        dq: dq.device_ptr_mut(&stream).0,
        dk: dk.device_ptr_mut(&stream).0,
        dv: dv.device_ptr_mut(&stream).0,
        dkv_seq: (p.kv_heads * d) as i64,
        dkv_batch: match p.varlen {
            None => (p.max_seq_k * p.kv_heads * d) as i64,
            Some(_) => 0,
        },
        scale: p.score.scale,
        kv_heads: to_i32(p.kv_heads, "kv_heads")?,
    };
    run(dev, p, &pl, &params, T::DTYPE == DType::BF16)?;
    drop((dsum, cu, slopes));
    Ok(wrap(dev, dq, dk, dv))
}

/// The cumulative lengths of a varlen call: the caller's device tensors, or uploads of the host
/// copies.
fn lengths(p: &Problem, stream: &Arc<CudaStream>) -> Result<Option<[DevInts; 2]>> {
    Ok(match &p.varlen {
        None => None,
        Some(vl) => Some(match &vl.device {
            Some(od) => [
                DevInts::Tensor(od.cu_q.clone()),
                DevInts::Tensor(od.cu_k.clone()),
            ],
            None => [
                DevInts::upload(stream, &vl.cu_q)?,
                DevInts::upload(stream, &vl.cu_k)?,
            ],
        }),
    })
}

/// Launches the three passes of `pl` (the Hopper ones with their tensor maps of 16-bit
/// operands, bf16 or f16).
fn run(dev: &CudaDevice, p: &Problem, pl: &BwdPlan, params: &BwdParams, bf16: bool) -> Result<()> {
    launch(dev, &pl.dsum, &[Arg::Bwd(params)])?;
    let Some([kv, qi]) = pl.sm90 else {
        launch(dev, &pl.dkdv, &[Arg::Bwd(params)])?;
        return launch(dev, &pl.dq, &[Arg::Bwd(params)]);
    };
    // The dK/dV kernel streams `kv.rows` query rows against a key block, the dQ kernel
    // `qi.rows` keys against a query block.
    let block = Sm90Bwd::BLOCK;
    for (l, maps) in [
        (&pl.dkdv, maps(p, params, bf16, kv.rows, block)?),
        (&pl.dq, maps(p, params, bf16, block, qi.rows)?),
    ] {
        let args = [
            Arg::Bwd(params),
            Arg::Map(&maps[0]),
            Arg::Map(&maps[1]),
            Arg::Map(&maps[2]),
            Arg::Map(&maps[3]),
        ];
        launch(dev, l, &args)?;
    }
    Ok(())
}

/// Tensor maps of q, k, v (as the forward reads them) and dO (contiguous like the output), with
/// boxes of `q_box` query rows and `k_box` keys; varlen operands are one packed run of rows.
fn maps(
    p: &Problem,
    params: &BwdParams,
    bf16: bool,
    q_box: usize,
    k_box: usize,
) -> Result<[TmaMap; 4]> {
    let d = p.head_dim;
    let (q_rows, k_rows) = p.storage_rows();
    let (q_batches, k_batches) = p.storage_batches();
    let o = Strides {
        offset: 0,
        batch: p.max_seq_q * p.heads * d,
        seq: p.heads * d,
        head: d,
        dim: 1,
    };
    let (qe, ke) = (
        [d, p.heads, q_rows, q_batches],
        [d, p.kv_heads, k_rows, k_batches],
    );
    Ok([
        tma_map(params.fwd.q, &p.q, bf16, qe, q_box)?,
        tma_map(params.fwd.k, &p.k, bf16, ke, k_box)?,
        tma_map(params.fwd.v, &p.v, bf16, ke, k_box)?,
        tma_map(params.dout, &o, bf16, qe, q_box)?,
    ])
}

fn wrap<T: CudaDType>(
    dev: &CudaDevice,
    dq: CudaSlice<T>,
    dk: CudaSlice<T>,
    dv: CudaSlice<T>,
) -> (CudaStorage, CudaStorage, CudaStorage) {
    (
        CudaStorage::wrap_cuda_slice(dq, dev.clone()),
        CudaStorage::wrap_cuda_slice(dk, dev.clone()),
        CudaStorage::wrap_cuda_slice(dv, dev.clone()),
    )
}
