//! Executes a decode [`Plan`]: the partial pass over the key splits, then (split calls only)
//! the combine pass that merges them through their log-sum-exps.

use candle::cuda_backend::cudarc::driver::{DevicePtrMut, DeviceRepr};
use candle::cuda_backend::{CudaDType, CudaDevice};
use candle::{CudaStorage, Result, Tensor};

use super::plan::Plan;
use crate::cuda::launch::to_i32;
use crate::cuda::params::Params;
use crate::cuda::runtime::call::{DevF32, ForwardCall};
use crate::cuda::runtime::extras;
use crate::cuda::runtime::{launch, Arg};
use crate::problem::Problem;

/// Runs `plan` for `p` on q, k, v; returns the output and lse storages.
pub(crate) fn run<T: CudaDType + DeviceRepr + candle::WithDType>(
    p: &Problem,
    plan: &Plan,
    alibi: Option<&Tensor>,
    dev: &CudaDevice,
    qkv: [&CudaStorage; 3],
) -> Result<(CudaStorage, CudaStorage)> {
    let stream = dev.cuda_stream();
    let mut call = ForwardCall::<T>::new(dev, p, qkv, alibi, plan.pack, plan.d_load)?;
    let mut base = call.params(p, &stream, plan.d_load)?;
    // A bias (read per key; the decode kernels take no block mask, so no tile lists).
    extras::fill(&mut base, p, None, dev)?;
    // FP8 K and V: the descales the kernels apply (held until the launches are queued).
    let [qk, vd] = match &p.kv8_descales {
        None => [None, None],
        Some([qk, vd]) => [
            DevF32::new("k_descale", qk.as_ref())?,
            DevF32::new("v_descale", vd.as_ref())?,
        ],
    };
    base.qk_descale = qk.as_ref().map_or(Ok(0), |d| d.ptr(&stream))?;
    base.v_descale = vd.as_ref().map_or(Ok(0), |d| d.ptr(&stream))?;
    // Split calls: f32 partial outputs `(splits, total_q, heads, d)` and base-2 partial
    // log-sum-exps `(splits, heads, total_q)`, one allocation.
    let part_len = plan.splits * p.total_q * p.heads;
    let mut parts = match plan.combine {
        None => None,
        // SAFETY: the partial pass writes every partial of every (split, row, head) before the
        // combine pass reads it (a split with no key writes zeros and -inf).
        Some(_) => Some(unsafe { dev.alloc::<f32>(part_len * (p.head_dim + 1))? }),
    };
    let part_ptr = parts.as_mut().map_or(0, |s| s.device_ptr_mut(&stream).0);
    let params = Params {
        o_part: part_ptr,
        lse_part: part_ptr + (part_len * p.head_dim * 4) as u64 * u64::from(part_ptr != 0),
        num_splits: to_i32(plan.splits, "splits")?,
        split_keys: to_i32(plan.split_keys, "split keys")?,
        m_tiles: to_i32(plan.m_tiles, "query tiles")?,
        ..base
    };
    launch(dev, &plan.partial, &[Arg::Params(&params)])?;
    if let Some(combine) = &plan.combine {
        // The combine kernel reads the partials the partial pass wrote on the same stream and
        // writes each (row, head) of the output and lse once.
        launch(dev, combine, &[Arg::Params(&params)])?;
    }
    drop((parts, qk, vd));
    Ok(call.finish(dev))
}
