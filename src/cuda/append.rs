//! Appending new keys or values to a KV cache in place on the GPU (the write half of
//! `FlashAttn::forward_kvcache`): one copy kernel from `kernels/pack.cu`.

use candle::backend::BackendStorage;
use candle::cuda_backend::cudarc::driver::{DevicePtr, DevicePtrMut};
use candle::cuda_backend::WrapErr;
use candle::{bail, CudaStorage, DType, Layout, Result};

use super::launch::{Launch, Module};
use super::runtime::ints::int_ptr;
use super::runtime::{launch, Arg};
use crate::problem::{Paged, Strides};

/// Writes `new` `(batch, seq_new, kv_heads, d)` into `cache` at positions `start[b] ..` of each
/// sequence through the block table of `paged` (validated by the caller).
pub(crate) fn append_kv(
    cache: &mut CudaStorage,
    cl: &Layout,
    new: &CudaStorage,
    nl: &Layout,
    paged: &Paged,
    start: &candle::Tensor,
) -> Result<()> {
    if cache.dtype() != new.dtype() {
        bail!(
            "flash-attn: the kv cache ({:?}) and the new keys/values ({:?}) must share a dtype",
            cache.dtype(),
            new.dtype()
        )
    }
    let &[batch, seq_new, heads, d] = nl.dims() else {
        bail!(
            "flash-attn: k_new/v_new must have rank 4, got {:?}",
            nl.dims()
        )
    };
    let total = batch * seq_new * heads * d;
    if total == 0 {
        return Ok(());
    }
    let dev = cache.device().clone();
    let stream = dev.cuda_stream();
    let (c, s) = (Strides::dense(cl), Strides::dense(nl));
    let start_ptr = int_ptr(start, &stream)?;
    let host_table;
    // A contiguous cache (one block per sequence, block b for sequence b) needs no table, so a
    // decode step uploads nothing and stays capturable in a CUDA graph.
    let identity = paged.max_blocks == 1
        && paged.table.len() == batch
        && paged
            .table
            .iter()
            .enumerate()
            .all(|(b, &t)| t as usize == b);
    let table_ptr = match &paged.device_table {
        Some(t) => int_ptr(t, &stream)?,
        None if identity => 0,
        None => {
            host_table = stream.clone_htod(&paged.table).w()?;
            host_table.device_ptr(&stream).0
        }
    };
    let (func_name, esize) = match cache.dtype() {
        DType::F16 | DType::BF16 => ("append_kv_u16", 2u64),
        DType::F32 => ("append_kv_u32", 4u64),
        DType::F8E4M3 => ("append_kv_u8", 1u64),
        dt => bail!("flash-attn: no KV cache append for dtype {dt:?}"),
    };
    // Byte addresses of element 0 of each side; the kernel copies raw element bits.
    let (dst, dst_guard) = match cache.dtype() {
        DType::F16 => cache
            .as_cuda_slice_mut::<half::f16>()?
            .device_ptr_mut(&stream),
        DType::BF16 => cache
            .as_cuda_slice_mut::<half::bf16>()?
            .device_ptr_mut(&stream),
        DType::F8E4M3 => cache
            .as_cuda_slice_mut::<float8::F8E4M3>()?
            .device_ptr_mut(&stream),
        _ => cache.as_cuda_slice_mut::<f32>()?.device_ptr_mut(&stream),
    };
    let (src, src_guard) = match new.dtype() {
        DType::F16 => new.as_cuda_slice::<half::f16>()?.device_ptr(&stream),
        DType::BF16 => new.as_cuda_slice::<half::bf16>()?.device_ptr(&stream),
        DType::F8E4M3 => new.as_cuda_slice::<float8::F8E4M3>()?.device_ptr(&stream),
        _ => new.as_cuda_slice::<f32>()?.device_ptr(&stream),
    };
    let (dst, src) = (dst + c.offset as u64 * esize, src + s.offset as u64 * esize);
    let args: [i64; 15] = [
        batch as i64,
        seq_new as i64,
        heads as i64,
        d as i64,
        paged.max_blocks as i64,
        paged.page as i64,
        paged.num_blocks as i64,
        c.batch as i64,
        c.seq as i64,
        c.head as i64,
        c.dim as i64,
        s.batch as i64,
        s.seq as i64,
        s.head as i64,
        s.dim as i64,
    ];
    let threads = 256usize;
    let l = Launch {
        module: Module::Pack,
        function: func_name.into(),
        grid: (total.div_ceil(threads).min(65535 * 8) as u32, 1, 1),
        threads: threads as u32,
        smem: 0,
    };
    let mut a = vec![
        Arg::Ptr(&dst),
        Arg::Ptr(&src),
        Arg::Ptr(&table_ptr),
        Arg::Ptr(&start_ptr),
    ];
    a.extend(args.iter().map(Arg::I64));
    // The kernel reads the `total` elements of `new` through its layout and writes cache rows of
    // blocks `< num_blocks` at positions `< max_blocks * page` only (the caller checked both
    // layouts cover those).
    launch(&dev, &l, &a)?;
    drop((dst_guard, src_guard));
    Ok(())
}
