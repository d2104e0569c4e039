//! Device-resident integer arguments: sequence offsets, block tables, prefix ranges and cache
//! lengths reach the kernels as device addresses, either of the caller's own GPU tensors (no
//! host round trip, graph-safe) or of uploads of host copies.

use std::sync::Arc;

use candle::backend::BackendStorage;
use candle::cuda_backend::cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use candle::cuda_backend::WrapErr;
use candle::{bail, DType, Result, Storage, Tensor};

/// 4-byte integers the kernels read: a caller's tensor on the GPU, or an upload of a host copy.
pub(crate) enum DevInts {
    Tensor(Tensor),
    Host(CudaSlice<u32>),
}

impl DevInts {
    /// Uploads a host copy.
    pub fn upload(stream: &Arc<CudaStream>, host: &[u32]) -> Result<Self> {
        Ok(Self::Host(stream.clone_htod(host).w()?))
    }

    /// The device address of the first element; the storage stays alive with `self`.
    pub fn ptr(&self, stream: &Arc<CudaStream>) -> Result<u64> {
        match self {
            DevInts::Host(s) => Ok(s.device_ptr(stream).0),
            DevInts::Tensor(t) => int_ptr(t, stream),
        }
    }
}

/// The device address of element 0 of a u32 or i32 tensor on the GPU.
pub(crate) fn int_ptr(t: &Tensor, stream: &Arc<CudaStream>) -> Result<u64> {
    let (st, l) = t.storage_and_layout();
    let off = l.start_offset() as u64 * 4;
    match &*st {
        Storage::Cuda(c) => Ok(match c.dtype() {
            DType::U32 => c.as_cuda_slice::<u32>()?.device_ptr(stream).0,
            DType::I32 => c.as_cuda_slice::<i32>()?.device_ptr(stream).0,
            dt => bail!("flash-attn: index tensor of dtype {dt:?} on the GPU"),
        } + off),
        _ => bail!("flash-attn: index tensor is not on the GPU"),
    }
}
