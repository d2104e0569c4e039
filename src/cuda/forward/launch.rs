//! Executes a prefill [`Plan`]: the call's inputs, one parameter struct (with the bias and the
//! block mask's tile lists where the call has them), and for the Hopper kernels the tensor maps
//! of q, k, v and the output, the persistent scheduler's counter and the store mode.

use candle::cuda_backend::cudarc::driver::{CudaSlice, DevicePtr, DeviceRepr};
use candle::cuda_backend::{CudaDType, CudaDevice};
use candle::{CudaStorage, DType, Result, Tensor};

use super::plan::{Kernel, OStore, Plan};
use crate::cuda::instances::Sm90Instance;
use crate::cuda::launch::to_i32;
use crate::cuda::runtime::call::ForwardCall;
use crate::cuda::runtime::extras;
use crate::cuda::runtime::tma::{tma_map, TmaMap};
use crate::cuda::runtime::{launch, Arg};
use crate::problem::{Problem, Strides};

/// Runs `plan` for `p` on q, k, v; returns the output and lse storages.
pub(crate) fn run<T: CudaDType + DeviceRepr + candle::WithDType>(
    p: &Problem,
    plan: &Plan,
    alibi: Option<&Tensor>,
    dev: &CudaDevice,
    qkv: [&CudaStorage; 3],
) -> Result<(CudaStorage, CudaStorage)> {
    let stream = dev.cuda_stream();
    let mut call = ForwardCall::<T>::new(dev, p, qkv, alibi, plan.pack, plan.d_load, 0)?;
    let mut params = crate::cuda::params::Params {
        dv_splits: to_i32(plan.dv_splits, "dv splits")?,
        ..call.params(p, &stream, plan.d_load)?
    };
    // The bias and block mask; the tile lists stay alive until the launch is queued.
    let lists = extras::fill(&mut params, p, plan.tile(), dev)?;
    match (plan.kernel, plan.sm90) {
        (Kernel::Sm90(i), Some((group, store))) => {
            let bf16 = T::DTYPE == DType::BF16;
            let (q_rows, k_rows) = p.storage_rows();
            let (q_batches, k_batches) = p.storage_batches();
            // Varlen operands are one packed run of rows (batch 1); the kernel then addresses
            // rows from cu_q / cu_k.
            let maps = [
                tma_map(
                    call.q.ptr,
                    &call.q.s,
                    bf16,
                    [plan.d_load, p.heads, q_rows, q_batches],
                    i.rows(),
                )?,
                tma_map(
                    call.k.ptr,
                    &call.k.s,
                    bf16,
                    [plan.d_load, p.kv_heads, k_rows, k_batches],
                    i.bn,
                )?,
                tma_map(
                    call.v.ptr,
                    &call.v.s,
                    bf16,
                    [plan.d_load, p.kv_heads, k_rows, k_batches],
                    i.bn,
                )?,
            ];
            let o_map = output_map(p, params.o, store, bf16)?;
            let counter = tile_counter(dev, i)?;
            let counter_ptr = counter.as_ref().map_or(0, |c| c.device_ptr(&stream).0);
            let (mode, group) = (store as i32, to_i32(group, "tile group")?);
            let args = [
                Arg::Params(&params),
                Arg::Map(&maps[0]),
                Arg::Map(&maps[1]),
                Arg::Map(&maps[2]),
                Arg::Map(&o_map),
                Arg::I32(&mode),
                Arg::Ptr(&counter_ptr),
                Arg::I32(&group),
            ];
            launch(dev, &plan.launch, &args)?;
            drop(counter);
        }
        _ => launch(dev, &plan.launch, &[Arg::Params(&params)])?,
    }
    drop(lists);
    Ok(call.finish(dev))
}

/// The map the persistent Hopper instances store O through (contiguous `(total_q, heads, d)`)
/// in 64-row boxes: per batch where every sequence holds seq_q rows (rows past it are
/// clipped), else as one packed run (whole boxes only; see `O_STORE_*` in
/// kernels/sm90/fwd.cuh).
fn output_map(p: &Problem, o: u64, store: OStore, bf16: bool) -> Result<TmaMap> {
    let d = p.head_dim;
    let (rows, batches) = match store {
        OStore::Threads => return Ok(TmaMap::NONE),
        OStore::TmaPacked => (p.total_q, 1),
        OStore::Tma => (p.max_seq_q, p.batch),
    };
    let s = Strides {
        offset: 0,
        batch: rows * p.heads * d,
        seq: p.heads * d,
        head: d,
        dim: 1,
    };
    tma_map(o, &s, bf16, [d, p.heads, rows, batches], 64)
}

/// Runs the sm_90a FP8 forward `plan` (from `plan_fp8`) for `p` on e4m3 q, k and v: V
/// transposed first (kernels/pack.cu), the descales of [`Problem::kv8_descales`] applied by the
/// kernel; returns the bf16 output and the lse storages.
pub(crate) fn run_fp8(
    p: &Problem,
    plan: &Plan,
    dev: &CudaDevice,
    qkv: [&CudaStorage; 3],
) -> Result<(CudaStorage, CudaStorage)> {
    use crate::cuda::runtime::call::DevF32;
    use crate::cuda::runtime::tma::{tma_map_e4m3, tma_map_vt};
    let (Kernel::Sm90(i), Some((group, _))) = (plan.kernel, plan.sm90) else {
        candle::bail!("flash-attn: an FP8 forward plan without its sm_90a instance")
    };
    let stream = dev.cuda_stream();
    let mut call = ForwardCall::<half::bf16>::new(dev, p, qkv, None, [false; 3], plan.d_load, 0)?;
    let mut params = call.params(p, &stream, plan.d_load)?;
    let [qk, vd] = match &p.kv8_descales {
        None => [None, None],
        Some([qk, vd]) => [
            DevF32::new("k_descale", qk.as_ref())?,
            DevF32::new("v_descale", vd.as_ref())?,
        ],
    };
    params.qk_descale = qk.as_ref().map_or(Ok(0), |d| d.ptr(&stream))?;
    params.v_descale = vd.as_ref().map_or(Ok(0), |d| d.ptr(&stream))?;
    let (vt, keys) = crate::cuda::fp8::v_transposed(dev, call.v.ptr, &call.v.s, p)?;
    let vt_ptr = vt.device_ptr(&stream).0;
    let (q_rows, k_rows) = p.storage_rows();
    let (q_batches, k_batches) = p.storage_batches();
    let d = plan.d_load;
    let maps = [
        tma_map_e4m3(
            call.q.ptr,
            &call.q.s,
            [d, p.heads, q_rows, q_batches],
            i.rows(),
        )?,
        tma_map_e4m3(
            call.k.ptr,
            &call.k.s,
            [d, p.kv_heads, k_rows, k_batches],
            i.bn,
        )?,
        tma_map_vt(vt_ptr, [keys, d, p.kv_heads, p.batch], i.d)?,
    ];
    let counter = tile_counter(dev, i)?;
    let counter_ptr = counter.as_ref().map_or(0, |c| c.device_ptr(&stream).0);
    let (mode, group) = (OStore::Threads as i32, to_i32(group, "tile group")?);
    let args = [
        Arg::Params(&params),
        Arg::Map(&maps[0]),
        Arg::Map(&maps[1]),
        Arg::Map(&maps[2]),
        Arg::Map(&TmaMap::NONE),
        Arg::I32(&mode),
        Arg::Ptr(&counter_ptr),
        Arg::I32(&group),
    ];
    launch(dev, &plan.launch, &args)?;
    // The transposed V, the descales and the counter stay alive until the launch is queued.
    drop((vt, qk, vd, counter));
    Ok(call.finish(dev))
}

/// The persistent scheduler's tile counter of instance `i` (none for one tile per block), zeroed
/// on the stream for this call.
fn tile_counter(dev: &CudaDevice, i: Sm90Instance) -> Result<Option<CudaSlice<i32>>> {
    Ok(match i.persistent {
        true => Some(dev.alloc_zeros::<i32>(1)?),
        false => None,
    })
}
