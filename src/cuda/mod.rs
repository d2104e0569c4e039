//! The CUDA backend. Each pass has a pure planner (problem + [`DeviceCaps`](device::DeviceCaps)
//! -> kernels, tiles, grid; compiled and unit-tested without the `cuda` feature) and a launch
//! module that only executes the plan on candle's stream:
//!
//! - `forward/`: prefill kernels (Hopper wgmma + TMA, mma.sync tensor cores, exact f32, row-wise);
//! - `decode/`: split-KV decode for few query rows per K/V head, its splits merged in the same launch;
//! - `backward/`: the D, dK/dV and dQ passes;
//! - `append`: writing new keys and values into a KV cache;
//! - `merge`: merging two attention states through their log-sum-exps;
//! - `fp8`: F8E4M3 conversions of FP8 calls.
//!
//! Shared by all: `device` (what a plan knows of the GPU), `launch` (one launch description),
//! `instances` (the kernel tables, from which `build.rs` also generates the entry points),
//! `params` (the kernels' parameter structs, layout-checked against their C twins by
//! `build.rs`), `operands` (which operands a kernel reads in place) and `runtime` (device
//! capabilities, PTX modules, the launch helper, tensor maps, device-resident integers, packed
//! operands).

// Without the `cuda` feature only the planners' unit tests use these.
#![cfg_attr(not(feature = "cuda"), allow(dead_code))]

#[cfg(feature = "cuda")]
mod append;
mod backward;
mod decode;
mod device;
mod forward;
#[cfg(feature = "cuda")]
pub(crate) mod fp8;
mod instances;
mod launch;
#[cfg(feature = "cuda")]
mod merge;
mod operands;
mod params;
#[cfg(feature = "cuda")]
mod runtime;

#[cfg(feature = "cuda")]
pub(crate) use append::append_kv;
#[cfg(feature = "cuda")]
pub(crate) use backward::{backward, Saved as BwdSaved};
#[cfg(feature = "cuda")]
pub(crate) use merge::merge;

/// Whether the FP8 (e4m3) K and V of `p` (bf16 or f16 queries `dtype`, validated) are read as
/// stored, by the decode kernels: on every GPU the crate runs on, for decode-shaped calls
/// whose head dim is a multiple of 16 and whose K and V rows are 16-byte aligned with
/// contiguous head dims. Elsewhere the caller converts K and V first.
#[cfg(feature = "cuda")]
pub(crate) fn kv8_decode(
    p: &crate::problem::Problem,
    dtype: candle::DType,
    dev: &candle::CudaDevice,
) -> candle::Result<bool> {
    let caps = runtime::caps(&dev.cuda_stream(), p.kernels.portable)?;
    if forward::plan::check_device(p, &caps).is_err() || !operands::chunk_aligned_8bit(p) {
        return Ok(false);
    }
    let residency = |l: &launch::Launch| runtime::residency(dev, l);
    Ok(decode::plan::plan_kv8(p, dtype, &caps, &residency)?.is_some())
}

/// Whether the FP8 call `p` (e4m3 q, k and v, validated) runs on the sm_90a FP8 forward, which
/// reads the operands as stored (see `forward::plan::plan_fp8`). Elsewhere the caller
/// dequantizes.
#[cfg(feature = "cuda")]
pub(crate) fn fp8_forward(
    p: &crate::problem::Problem,
    dev: &candle::CudaDevice,
) -> candle::Result<bool> {
    let caps = runtime::caps(&dev.cuda_stream(), p.kernels.portable)?;
    if forward::plan::check_device(p, &caps).is_err() {
        return Ok(false);
    }
    Ok(forward::plan::plan_fp8(p, &caps)?.is_some())
}

/// The forward pass of `p` on the GPU: the decode plan where the problem is decode-shaped,
/// else the prefill plan. Returns (out, lse).
#[cfg(feature = "cuda")]
pub(crate) fn forward(
    p: &crate::problem::Problem,
    alibi: Option<&candle::Tensor>,
    q: &candle::CudaStorage,
    k: &candle::CudaStorage,
    v: &candle::CudaStorage,
) -> candle::Result<(candle::CudaStorage, candle::CudaStorage)> {
    use candle::backend::BackendStorage;
    use candle::DType;
    use half::{bf16, f16};

    let dev = q.device().clone();
    let dtype = q.dtype();
    let caps = runtime::caps(&dev.cuda_stream(), p.kernels.portable)?;
    let qkv = [q, k, v];
    let residency = |l: &launch::Launch| runtime::residency(&dev, l);
    if dtype == DType::F8E4M3 {
        // Only calls that `fp8_forward` accepted come here with FP8 q.
        let Some(plan) = forward::plan::plan_fp8(p, &caps)? else {
            candle::bail!("flash-attn: no CUDA kernel reads FP8 q, k and v for this call")
        };
        return forward::launch::run_fp8(p, &plan, &dev, qkv);
    }
    if k.dtype() == DType::F8E4M3 && v.dtype() == DType::F8E4M3 {
        // Only calls that `kv8_decode` accepted come here with FP8 K and V.
        let Some(plan) = decode::plan::plan_kv8(p, dtype, &caps, &residency)? else {
            candle::bail!("flash-attn: no CUDA kernel reads FP8 K and V for this call")
        };
        return match dtype {
            DType::BF16 => decode::launch::run::<bf16>(p, &plan, alibi, &dev, qkv),
            DType::F16 => decode::launch::run::<f16>(p, &plan, alibi, &dev, qkv),
            dt => candle::bail!("flash-attn: no CUDA FP8 decode kernel for {dt:?} queries"),
        };
    }
    if k.dtype() != dtype || v.dtype() != dtype {
        candle::bail!(
            "flash-attn: q, k, v must share one of f32/f16/bf16, got {dtype:?}/{:?}/{:?}",
            k.dtype(),
            v.dtype()
        )
    }
    forward::plan::check_device(p, &caps)?;
    if let Some(plan) = decode::plan::plan(p, dtype, &caps, &residency)? {
        return match dtype {
            DType::BF16 => decode::launch::run::<bf16>(p, &plan, alibi, &dev, qkv),
            DType::F16 => decode::launch::run::<f16>(p, &plan, alibi, &dev, qkv),
            dt => candle::bail!("flash-attn: no CUDA decode kernel for dtype {dt:?}"),
        };
    }
    let plan = forward::plan::plan(p, dtype, &caps)?;
    match dtype {
        DType::BF16 => forward::launch::run::<bf16>(p, &plan, alibi, &dev, qkv),
        DType::F16 => forward::launch::run::<f16>(p, &plan, alibi, &dev, qkv),
        DType::F32 => forward::launch::run::<f32>(p, &plan, alibi, &dev, qkv),
        dt => candle::bail!("flash-attn: q, k, v must share one of f32/f16/bf16, got {dt:?}"),
    }
}
