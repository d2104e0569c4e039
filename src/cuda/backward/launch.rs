//! Executes a [`BwdPlan`](super::plan::BwdPlan): fills one [`BwdParams`], allocates the
//! gradients and the D scratch, and launches the D pass, the dK/dV pass and the dQ pass on
//! candle's stream.

use candle::backend::BackendStorage;
use candle::cuda_backend::cudarc::driver::{
    CudaSlice, DevicePtr, DevicePtrMut, DeviceRepr, ValidAsZeroBits,
};
use candle::cuda_backend::{CudaDType, CudaDevice, WrapErr};
use candle::{bail, CudaStorage, DType, Result, Storage, Tensor};
use half::{bf16, f16};

use super::instances::Sm90Bwd;
use super::params::BwdParams;
use super::plan::{plan, BwdDevice, Launch};
use crate::cuda::launch::{caps, launch_function, launch_with_maps, problem_params, tma_map};
use crate::cuda::params::Params;
use crate::cuda::plan::Module;
use crate::problem::{Problem, Strides};

// SAFETY: `BwdParams` is `#[repr(C)]`, `Copy`, made of plain integers and floats (the forward
// `Params` included), and its C twin is checked field by field at build time (see params.rs).
unsafe impl DeviceRepr for BwdParams {}

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
    let dev = q.device().clone();
    let s = Storages {
        q,
        k,
        v,
        out,
        grad_out,
        lse,
    };
    match (q.dtype(), k.dtype(), v.dtype()) {
        (DType::BF16, DType::BF16, DType::BF16) => {
            backward_t::<bf16>(p, alibi, &dev, s, offsets, k_rows)
        }
        (DType::F16, DType::F16, DType::F16) => {
            backward_t::<f16>(p, alibi, &dev, s, offsets, k_rows)
        }
        (DType::F32, DType::F32, DType::F32) => {
            backward_t::<f32>(p, alibi, &dev, s, offsets, k_rows)
        }
        (a, b, c) => bail!(
            "flash-attn backward: q, k, v must share one of f32/f16/bf16, got {a:?}/{b:?}/{c:?}"
        ),
    }
}

struct Storages<'a> {
    q: &'a CudaStorage,
    k: &'a CudaStorage,
    v: &'a CudaStorage,
    out: &'a CudaStorage,
    grad_out: &'a CudaStorage,
    lse: &'a CudaStorage,
}

fn to_i32(x: usize, what: &str) -> Result<i32> {
    i32::try_from(x)
        .map_err(|_| candle::Error::Msg(format!("flash-attn backward: {what} = {x} exceeds i32")))
}

fn backward_t<T: CudaDType + DeviceRepr + ValidAsZeroBits + candle::WithDType>(
    p: &Problem,
    alibi: Option<&Tensor>,
    dev: &CudaDevice,
    s: Storages,
    offsets: [usize; 3],
    k_rows: usize,
) -> Result<(CudaStorage, CudaStorage, CudaStorage)> {
    let stream = dev.cuda_stream();
    let (q, k, v) = (
        s.q.as_cuda_slice::<T>()?,
        s.k.as_cuda_slice::<T>()?,
        s.v.as_cuda_slice::<T>()?,
    );
    let (out, grad_out) = (
        s.out.as_cuda_slice::<T>()?,
        s.grad_out.as_cuda_slice::<T>()?,
    );
    let lse = s.lse.as_cuda_slice::<f32>()?;
    p.check_bounds(q.len(), k.len(), v.len())?;
    let d = p.head_dim;
    let rows = p.total_q * p.heads;
    if out.len() < offsets[0] + rows * d
        || grad_out.len() < offsets[1] + rows * d
        || lse.len() < offsets[2] + rows
    {
        bail!("flash-attn backward: the output, its gradient or the lse is smaller than the call")
    }
    if p.has_alibi != alibi.is_some() {
        bail!("flash-attn backward: ALiBi slopes do not match the validated problem")
    }
    let caps = caps(&stream, p.kernels.portable)?;
    let device = BwdDevice {
        max_smem: caps.smem_optin,
        hopper: caps.hopper,
    };
    let pl = plan(
        p,
        T::DTYPE,
        [offsets[0], offsets[1]],
        &device,
        &p.kernels.overrides.bwd_sm90_variants,
    )?;

    // SAFETY (all three): zero-initialised; the kernels overwrite the rows that belong to a
    // sequence and leave the rest (dk/dv rows past a sequence's keys) at zero.
    let mut dq = dev.alloc_zeros::<T>((rows * d).max(1))?;
    let mut dk = dev.alloc_zeros::<T>((k_rows * p.kv_heads * d).max(1))?;
    let mut dv = dev.alloc_zeros::<T>((k_rows * p.kv_heads * d).max(1))?;
    if rows == 0 || k_rows == 0 || p.batch == 0 {
        return Ok(wrap(dev, dq, dk, dv));
    }
    // SAFETY: the D pass writes every (head, row) of the call before the other passes read it.
    let mut dsum = unsafe { dev.alloc::<f32>(rows)? };
    // Cumulative lengths: the caller's device tensors, or uploads of the host copies.
    let host_cu = match &p.varlen {
        Some(vl) if vl.device.is_none() => Some((
            stream.clone_htod(&vl.cu_q).w()?,
            stream.clone_htod(&vl.cu_k).w()?,
        )),
        _ => None,
    };
    let cu_ptrs = match (&p.varlen, &host_cu) {
        (None, _) => (0, 0),
        (Some(_), Some((a, b))) => (a.device_ptr(&stream).0, b.device_ptr(&stream).0),
        (Some(vl), None) => {
            let od = vl.device.as_ref().expect("device lengths");
            (
                crate::cuda::append::int_ptr(&od.cu_q, &stream)?,
                crate::cuda::append::int_ptr(&od.cu_k, &stream)?,
            )
        }
    };
    let alibi = match alibi {
        None => None,
        Some(a) => Some(a.to_dtype(DType::F32)?.contiguous()?),
    };
    let alibi_storage = alibi.as_ref().map(|a| a.storage_and_layout());
    let alibi_ptr = match &alibi_storage {
        None => 0,
        Some((st, l)) => match &**st {
            Storage::Cuda(c) => {
                c.as_cuda_slice::<f32>()?.device_ptr(&stream).0 + (l.start_offset() * 4) as u64
            }
            _ => bail!("flash-attn backward: alibi_slopes must be on the same CUDA device as q"),
        },
    };

    let esize = std::mem::size_of::<T>() as u64;
    let (q_g, k_g, v_g) = (
        q.device_ptr(&stream),
        k.device_ptr(&stream),
        v.device_ptr(&stream),
    );
    let (o_g, go_g, lse_g) = (
        out.device_ptr(&stream),
        grad_out.device_ptr(&stream),
        lse.device_ptr(&stream),
    );
    let (dq_g, dk_g, dv_g, ds_g) = (
        dq.device_ptr_mut(&stream),
        dk.device_ptr_mut(&stream),
        dv.device_ptr_mut(&stream),
        dsum.device_ptr_mut(&stream),
    );
    let fwd = Params {
        q: q_g.0 + p.q.offset as u64 * esize,
        k: k_g.0 + p.k.offset as u64 * esize,
        v: v_g.0 + p.v.offset as u64 * esize,
        o: o_g.0 + offsets[0] as u64 * esize,
        lse: lse_g.0 + offsets[2] as u64 * 4,
        alibi: alibi_ptr,
        cu_q: cu_ptrs.0,
        cu_k: cu_ptrs.1,
        ..problem_params(p, [&p.q, &p.k, &p.v], d, p.max_seq_k)?
    };
    let params = BwdParams {
        fwd,
        dout: go_g.0 + offsets[1] as u64 * esize,
        dsum: ds_g.0,
        dq: dq_g.0,
        dk: dk_g.0,
        dv: dv_g.0,
        dkv_seq: (p.kv_heads * d) as i64,
        dkv_batch: match p.varlen {
            None => (p.max_seq_k * p.kv_heads * d) as i64,
            Some(_) => 0,
        },
        scale: p.score.scale,
        kv_heads: to_i32(p.kv_heads, "kv_heads")?,
    };
    match pl.sm90 {
        None => {
            for l in [&pl.dsum, &pl.dkdv, &pl.dq] {
                launch(dev, T::DTYPE, l, &params)?;
            }
        }
        Some([kv, qi]) => {
            // Tensor maps of q, k, v (as the forward reads them) and dO (contiguous like the
            // output); varlen operands are one packed run of rows. Boxes: the dK/dV kernel
            // streams `kv.rows` query rows against 128 keys, the dQ kernel `qi.rows` keys
            // against 128 query rows.
            let bf16 = T::DTYPE == DType::BF16;
            let (q_rows, k_rows) = p.storage_rows();
            let (q_batches, k_batches) = p.storage_batches();
            let o = Strides {
                offset: 0,
                batch: p.max_seq_q * p.heads * d,
                seq: p.heads * d,
                head: d,
                dim: 1,
            };
            let maps = |q_box: usize, k_box: usize| -> Result<[_; 4]> {
                Ok([
                    tma_map(
                        params.fwd.q,
                        &p.q,
                        2,
                        bf16,
                        [d, p.heads, q_rows, q_batches],
                        q_box,
                    )?,
                    tma_map(
                        params.fwd.k,
                        &p.k,
                        2,
                        bf16,
                        [d, p.kv_heads, k_rows, k_batches],
                        k_box,
                    )?,
                    tma_map(
                        params.fwd.v,
                        &p.v,
                        2,
                        bf16,
                        [d, p.kv_heads, k_rows, k_batches],
                        k_box,
                    )?,
                    tma_map(
                        params.dout,
                        &o,
                        2,
                        bf16,
                        [d, p.heads, q_rows, q_batches],
                        q_box,
                    )?,
                ])
            };
            launch(dev, T::DTYPE, &pl.dsum, &params)?;
            let block = Sm90Bwd::BLOCK;
            for (l, m) in [
                (&pl.dkdv, maps(kv.rows, block)?),
                (&pl.dq, maps(block, qi.rows)?),
            ] {
                if l.grid.0 > 0 {
                    launch_with_maps(
                        dev,
                        Module::Sm90Bwd,
                        &l.function,
                        l.grid,
                        l.threads,
                        l.smem,
                        &params,
                        &m,
                    )?;
                }
            }
        }
    }
    drop((q_g, k_g, v_g, o_g, go_g, lse_g, dq_g, dk_g, dv_g, ds_g));
    drop((dsum, host_cu, alibi_storage));
    drop(alibi);
    Ok(wrap(dev, dq, dk, dv))
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

/// Launches one planned function (an empty grid launches nothing).
fn launch(dev: &CudaDevice, dtype: DType, l: &Launch, params: &BwdParams) -> Result<()> {
    if l.grid.0 == 0 {
        return Ok(());
    }
    let module = Module::of(dtype)?;
    launch_function(dev, module, &l.function, l.grid, l.threads, l.smem, params)
}
