//! Executes a decode [`Plan`]: the partial pass over the key splits, and (split calls only) their
//! merge through the log-sum-exps: by the last block of each group in the same launch (its
//! counters zeroed first), or by the combine kernel after it.

use candle::cuda_backend::cudarc::driver::result::memset_d8_async;
use candle::cuda_backend::cudarc::driver::DeviceRepr;
use candle::cuda_backend::{CudaDType, CudaDevice, WrapErr};
use candle::{CudaStorage, Result, Tensor};

use super::plan::{Merge, Plan};
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
    // Split calls: f32 partial outputs `(splits, total_q, heads, d)`, base-2 partial
    // log-sum-exps `(splits, heads, total_q)` and, for a fused merge, one counter per group of
    // blocks that share their rows (`grid.0 x grid.2`), in the lse's allocation after the lse.
    // Every block writes all its partials (a split with no key writes zeros and -inf) before
    // it counts itself done or the combine kernel starts.
    let part_len = plan.splits * p.total_q * p.heads;
    let groups = match plan.merge {
        Merge::Fused => (plan.partial.grid.0 * plan.partial.grid.2) as usize,
        _ => 0,
    };
    let split = plan.merge != Merge::None;
    let scratch = match split {
        false => 0,
        true => part_len * (p.head_dim + 1) + groups,
    };
    let mut call = ForwardCall::<T>::new(dev, p, qkv, alibi, plan.pack, plan.d_load, scratch)?;
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
    let (part_ptr, sem_ptr) = match split {
        false => (0, 0),
        true => {
            let part = call.scratch(p, &stream);
            let sem = match groups {
                0 => 0,
                _ => part + (part_len * (p.head_dim + 1) * 4) as u64,
            };
            if sem != 0 {
                // SAFETY: the counters lie inside the lse's allocation, which `call` holds until
                // the launch is queued; the memset runs on the launch's stream before it.
                unsafe { memset_d8_async(sem, 0, groups * 4, stream.cu_stream()) }.w()?;
            }
            (part, sem)
        }
    };
    let params = Params {
        combine_warps: match &plan.merge {
            Merge::Kernel(_, warps) => to_i32(*warps, "combine warps")?,
            _ => 1,
        },
        o_part: part_ptr,
        lse_part: part_ptr + (part_len * p.head_dim * 4) as u64 * u64::from(split),
        split_sem: sem_ptr,
        num_splits: to_i32(plan.splits, "splits")?,
        split_keys: to_i32(plan.split_keys, "split keys")?,
        m_tiles: to_i32(plan.m_tiles, "query tiles")?,
        ..base
    };
    launch(dev, &plan.partial, &[Arg::Params(&params)])?;
    if let Merge::Kernel(combine, _) = &plan.merge {
        // The combine kernel reads the partials the partial pass wrote on the same stream and
        // writes each (row, head) of the output and lse once.
        launch(dev, combine, &[Arg::Params(&params)])?;
    }
    drop((qk, vd));
    Ok(call.finish(dev))
}
