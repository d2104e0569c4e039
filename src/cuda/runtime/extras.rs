//! The additive bias and the block-sparse mask of a call as its kernels read them
//! (kernels/common/extras.cuh): both in place, through strides that are 0 along broadcast
//! dimensions, and for the tiled forward kernels the key-tile lists of a block mask or a key
//! bias, built on the stream by kernels/tiles.cu for the kernel's tile shape.

use std::sync::Arc;

use candle::cuda_backend::cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use candle::cuda_backend::CudaDevice;
use candle::{bail, DType, Result, Storage, Tensor};

use super::{launch, Arg};
use crate::cuda::launch::{to_i32, to_u32, Launch, Module};
use crate::cuda::params::Params;
use crate::problem::Problem;

/// Query tiles per block of the list builder (`WARPS` in kernels/tiles.cu): one warp each.
const TILES_WARPS: usize = 4;

/// The device address of element 0 of `t` (f32, f16, bf16 or u8 on the GPU) and its strides
/// over `(batch, heads, rows, cols)` (rank at most 4, aligned right), 0 along dimensions of size
/// 1 or stride 0.
fn broadcast(t: &Tensor, stream: &Arc<CudaStream>, name: &str) -> Result<(u64, [i64; 4])> {
    let (st, l) = t.storage_and_layout();
    let Storage::Cuda(c) = &*st else {
        bail!("flash-attn: {name} must be on the same CUDA device as q")
    };
    let size = t.dtype().size_in_bytes() as u64;
    let base = match t.dtype() {
        DType::F32 => c.as_cuda_slice::<f32>()?.device_ptr(stream).0,
        DType::F16 => c.as_cuda_slice::<half::f16>()?.device_ptr(stream).0,
        DType::BF16 => c.as_cuda_slice::<half::bf16>()?.device_ptr(stream).0,
        DType::U8 => c.as_cuda_slice::<u8>()?.device_ptr(stream).0,
        dt => bail!("flash-attn: {name} of dtype {dt:?} on the GPU"),
    };
    let mut strides = [0i64; 4];
    let rank = t.rank();
    for (i, (&n, &s)) in t.dims().iter().zip(l.stride()).enumerate() {
        strides[4 - rank + i] = if n == 1 { 0 } else { s as i64 };
    }
    Ok((base + l.start_offset() as u64 * size, strides))
}

/// The key-tile lists of a call, owned until its launches are queued.
pub(crate) struct TileLists {
    _lists: CudaSlice<i32>,
    _counts: CudaSlice<i32>,
}

/// Fills the bias and block-mask fields of `params` for a kernel of `tile` = (rows, keys) per
/// tile (`None`: a kernel without tiles, which adds the bias and checks every key's block), and
/// for tiled kernels builds the key-tile lists on the stream where the call has a block mask or
/// a key bias (no row dimension: key padding, per-key terms), whose tiles of `-inf` are skipped
/// and whose tiles of 0 take no bias. `params` holds the call's lengths and window already; the
/// validated problem's bias is f32 or the inputs' dtype.
pub(crate) fn fill(
    params: &mut Params,
    p: &Problem,
    tile: Option<(usize, usize)>,
    dev: &CudaDevice,
) -> Result<Option<TileLists>> {
    let stream = dev.cuda_stream();
    // Which of the bias's and the mask's (batch, head) strides the lists follow.
    let mut varies = [false; 2];
    let mut bias_kind = 0;
    if let Some(b) = &p.bias {
        let (ptr, [sb, sh, sq, sk]) = broadcast(b, &stream, "bias")?;
        params.bias = ptr;
        (params.bias_b, params.bias_h, params.bias_q, params.bias_k) = (sb, sh, sq, sk);
        params.bias_f32 = (b.dtype() == DType::F32) as i32;
        // BIAS_F32, BIAS_F16, BIAS_BF16 in kernels/tiles.cu.
        bias_kind = match b.dtype() {
            DType::F16 => 1,
            DType::BF16 => 2,
            _ => 0,
        };
        if sq == 0 {
            varies = [sb != 0, sh != 0];
        }
    }
    if let Some((mask, block_q, block_k)) = &p.block_mask {
        let (ptr, [sb, sh, sq, sk]) = broadcast(mask, &stream, "block_mask")?;
        params.block_mask = ptr;
        (params.bm_b, params.bm_h, params.bm_q, params.bm_k) = (sb, sh, sq, sk);
        params.block_q = to_i32(*block_q, "block_q")?;
        params.block_k = to_i32(*block_k, "block_k")?;
        varies = [varies[0] || sb != 0, varies[1] || sh != 0];
    }
    let key_bias = p.bias.is_some() && params.bias_q == 0;
    let Some((rows, cols)) = tile else {
        return Ok(None);
    };
    if p.block_mask.is_none() && !key_bias {
        return Ok(None);
    }
    // One list per (batch, head) the mask or the key bias distinguishes, and per sequence of a
    // packed call (whose lengths, and so bands, differ).
    let per_batch = varies[0] || p.varlen.is_some();
    let (batches, heads) = (
        if per_batch { p.batch } else { 1 },
        if varies[1] { p.heads } else { 1 },
    );
    let (q_tiles, k_tiles) = (p.max_seq_q.div_ceil(rows), p.max_seq_k.div_ceil(cols));
    let lists = batches * heads * q_tiles;
    params.tiles_b = to_i32(if per_batch { heads } else { 0 }, "heads")?;
    params.tiles_h = varies[1] as i32;
    params.q_tiles = to_i32(q_tiles, "query tiles")?;
    params.k_tiles = to_i32(k_tiles, "key tiles")?;
    // SAFETY: the builder writes every count, and each list's first `count` entries, which are
    // all the kernels read.
    let mut counts = unsafe { dev.alloc::<i32>(lists.max(1))? };
    let mut entries = unsafe { dev.alloc::<i32>((lists * k_tiles).max(1))? };
    params.tiles = entries.device_ptr_mut(&stream).0;
    params.tile_count = counts.device_ptr_mut(&stream).0;
    let build = Launch {
        module: Module::Tiles,
        function: "block_tiles".into(),
        grid: (
            to_u32(q_tiles.div_ceil(TILES_WARPS), "query tiles")?,
            to_u32(heads, "heads")?,
            to_u32(batches, "batch")?,
        ),
        threads: (TILES_WARPS * 32) as u32,
        smem: 0,
    };
    let (br, bc) = (to_i32(rows, "tile rows")?, to_i32(cols, "tile keys")?);
    launch(
        dev,
        &build,
        &[
            Arg::Params(params),
            Arg::I32(&br),
            Arg::I32(&bc),
            Arg::I32(&bias_kind),
        ],
    )?;
    Ok(Some(TileLists {
        _lists: entries,
        _counts: counts,
    }))
}
