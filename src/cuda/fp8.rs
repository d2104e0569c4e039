//! FP8 (e4m3) conversions on the GPU for FP8 calls (`kernels/pack.cu`): F8E4M3 to the compute
//! dtype, and f16/bf16 rows to F8E4M3 with a per-(sequence, head) descale. candle 0.11's own
//! CUDA casts and strided copies of F8E4M3 look up kernels under names its kernel library does
//! not define, so FP8 tensors are converted here, from any strided view.

use candle::backend::BackendStorage;
use candle::cuda_backend::cudarc::driver::{DevicePtr, DevicePtrMut};
use candle::op::BackpropOp;
use candle::{bail, CudaStorage, DType, Layout, Result, Storage, Tensor};

use super::launch::{Launch, Module};
use super::runtime::{launch, Arg};

/// Threads per block of the conversion kernels (one element each, grid-stride).
const THREADS: usize = 256;

/// `t`'s dims and strides as a rank-4 view, leading dims of size 1 added.
fn view4(l: &Layout) -> Result<[i64; 8]> {
    let (dims, strides) = (l.dims(), l.stride());
    if dims.len() > 4 {
        bail!("flash-attn: FP8 conversion of a rank-{} tensor", dims.len())
    }
    let pad = 4 - dims.len();
    let mut v = [1i64, 1, 1, 1, 0, 0, 0, 0];
    for (i, (&n, &s)) in dims.iter().zip(strides).enumerate() {
        v[pad + i] = n as i64;
        v[4 + pad + i] = s as i64;
    }
    Ok(v)
}

fn grid(n: usize) -> (u32, u32, u32) {
    (n.div_ceil(THREADS).clamp(1, 65535 * 8) as u32, 1, 1)
}

/// An F8E4M3 tensor (any strides, on the GPU) converted to f32, f16 or bf16, contiguous.
pub(crate) fn from_e4m3(t: &Tensor, to: DType) -> Result<Tensor> {
    let (st, l) = t.storage_and_layout();
    let Storage::Cuda(s) = &*st else {
        bail!("flash-attn: FP8 conversion of a tensor that is not on the GPU")
    };
    let dev = s.device().clone();
    let stream = dev.cuda_stream();
    let n = l.shape().elem_count();
    let v = view4(l)?;
    let src = s.as_cuda_slice::<float8::F8E4M3>()?;
    let (src_ptr, src_guard) = src.device_ptr(&stream);
    let src_ptr = src_ptr + l.start_offset() as u64;
    let f = match to {
        DType::F32 => "e4m3_to_f32",
        DType::F16 => "e4m3_to_f16",
        DType::BF16 => "e4m3_to_bf16",
        d => bail!("flash-attn: no FP8 conversion to {d:?}"),
    };
    // A contiguous source at an 8-byte aligned start: the kernel of eight elements a thread.
    let flat = l.is_contiguous() && src_ptr.is_multiple_of(8);
    let l4 = Launch {
        module: Module::Pack,
        function: if flat { format!("{f}_flat") } else { f.into() },
        grid: grid(if flat { n.div_ceil(8) } else { n }),
        threads: THREADS as u32,
        smem: 0,
    };
    let n64 = [n as i64];
    let args: &[i64] = if flat { &n64 } else { &v };
    macro_rules! run {
        ($ty:ty) => {{
            // SAFETY: the kernel writes every one of the `n` elements.
            let mut out = unsafe { dev.alloc::<$ty>(n.max(1))? };
            let (dst, g) = out.device_ptr_mut(&stream);
            let mut a = vec![Arg::Ptr(&src_ptr), Arg::Ptr(&dst)];
            a.extend(args.iter().map(Arg::I64));
            // Reads the view's elements (inside the storage: candle checked the layout) and
            // writes the `n` contiguous outputs.
            launch(&dev, &l4, &a)?;
            drop(g);
            CudaStorage::wrap_cuda_slice(out, dev.clone())
        }};
    }
    let out = match to {
        DType::F32 => run!(f32),
        DType::F16 => run!(half::f16),
        _ => run!(half::bf16),
    };
    drop(src_guard);
    Ok(Tensor::from_storage(
        Storage::Cuda(out),
        t.shape().clone(),
        BackpropOp::none(),
        false,
    ))
}

/// `x` (f16/bf16 `(batch, seq, heads, d)`, any strides, on the GPU) as contiguous F8E4M3
/// `saturate(x / descale[b][h])`; `descale` f32 `(batch, heads)` (absent: 1).
pub(crate) fn to_e4m3(x: &Tensor, descale: Option<&Tensor>) -> Result<Tensor> {
    let descale = descale.map(|d| d.contiguous()).transpose()?;
    let (st, l) = x.storage_and_layout();
    let Storage::Cuda(s) = &*st else {
        bail!("flash-attn: FP8 quantization of a tensor that is not on the GPU")
    };
    let dev = s.device().clone();
    let stream = dev.cuda_stream();
    let n = l.shape().elem_count();
    let v = view4(l)?;
    let esize = 2u64;
    let (src_ptr, src_guard) = match s.dtype() {
        DType::F16 => s.as_cuda_slice::<half::f16>()?.device_ptr(&stream),
        DType::BF16 => s.as_cuda_slice::<half::bf16>()?.device_ptr(&stream),
        d => bail!("flash-attn: no FP8 quantization from {d:?}"),
    };
    let src_ptr = src_ptr + l.start_offset() as u64 * esize;
    let f = if s.dtype() == DType::F16 {
        "f16_to_e4m3"
    } else {
        "bf16_to_e4m3"
    };
    let dguard = descale.as_ref().map(|d| d.storage_and_layout());
    let (d_ptr, _dg) = match &dguard {
        None => (0u64, None),
        Some((ds, dl)) => match &**ds {
            Storage::Cuda(c) => {
                let (p, g) = c.as_cuda_slice::<f32>()?.device_ptr(&stream);
                (p + dl.start_offset() as u64 * 4, Some(g))
            }
            _ => bail!("flash-attn: a descale is on another device than the rows it quantizes"),
        },
    };
    // SAFETY: the kernel writes every one of the `n` elements.
    let mut out = unsafe { dev.alloc::<float8::F8E4M3>(n.max(1))? };
    let (dst, g) = out.device_ptr_mut(&stream);
    let mut a = vec![Arg::Ptr(&src_ptr), Arg::Ptr(&dst), Arg::Ptr(&d_ptr)];
    a.extend(v.iter().map(Arg::I64));
    let l4 = Launch {
        module: Module::Pack,
        function: f.into(),
        grid: grid(n),
        threads: THREADS as u32,
        smem: 0,
    };
    // Reads the view's elements and the (n0, n2) descales (checked shape, contiguous), writes
    // the `n` outputs.
    launch(&dev, &l4, &a)?;
    drop(g);
    drop(src_guard);
    Ok(Tensor::from_storage(
        Storage::Cuda(CudaStorage::wrap_cuda_slice(out, dev)),
        x.shape().clone(),
        BackpropOp::none(),
        false,
    ))
}

/// Keys per tile of the transposed V (the FP8 forward's key tile and its 128-byte rows).
pub(crate) const VT_KEYS: usize = 128;

/// The e4m3 V of `p` at `ptr` (element (0, 0, 0, 0); strides `s`, rows 16-byte aligned, head
/// dim a multiple of 16) as
/// the sm_90a FP8 forward reads it: contiguous `(batch, kv_heads, head_dim, keys)`, each head's
/// keys padded with zeros to a multiple of [`VT_KEYS`] and permuted within each 32
/// (`e4m3_v_transpose` in kernels/pack.cu). Returns the buffer and its key count.
pub(crate) fn v_transposed(
    dev: &candle::cuda_backend::CudaDevice,
    ptr: u64,
    s: &crate::problem::Strides,
    p: &crate::problem::Problem,
) -> Result<(candle::cuda_backend::cudarc::driver::CudaSlice<u8>, usize)> {
    let d = p.head_dim;
    if !d.is_multiple_of(16) || d > 256 || s.dim != 1 {
        bail!("flash-attn: the FP8 forward transposes V of head dims up to 256 in 16-byte rows")
    }
    let keys = p.max_seq_k.max(1).next_multiple_of(VT_KEYS);
    let stream = dev.cuda_stream();
    // SAFETY: the kernel writes every element: each (batch, head, 128 keys) block all d rows
    // of its 128 bytes.
    let mut out = unsafe { dev.alloc::<u8>(p.batch * p.kv_heads * d * keys)? };
    let (dst, g) = out.device_ptr_mut(&stream);
    let src = ptr;
    let l = Launch {
        module: Module::Pack,
        function: "e4m3_v_transpose".into(),
        grid: ((keys / VT_KEYS) as u32, p.kv_heads as u32, p.batch as u32),
        threads: THREADS as u32,
        smem: 0,
    };
    let dims = [p.max_seq_k, p.kv_heads, d, keys].map(|x| x as i64);
    let strides = [s.batch, s.seq, s.head].map(|x| x as i64);
    // Reads the p.max_seq_k rows of every (batch, head) through the strides (inside the
    // storage: the caller checked the bounds), writes every element of `out`.
    launch(
        dev,
        &l,
        &[
            Arg::Ptr(&src),
            Arg::Ptr(&dst),
            Arg::I64(&dims[0]),
            Arg::I64(&dims[1]),
            Arg::I64(&dims[2]),
            Arg::I64(&dims[3]),
            Arg::I64(&strides[0]),
            Arg::I64(&strides[1]),
            Arg::I64(&strides[2]),
        ],
    )?;
    drop(g);
    Ok((out, keys))
}

#[cfg(test)]
mod tests {
    use crate::cuda::launch::{defined, Launch, Module};

    /// Both conversion kernels of each target dtype are in the pack module's PTX.
    #[test]
    fn conversion_kernels_are_defined() {
        for to in ["f32", "f16", "bf16"] {
            for kind in ["", "_flat"] {
                let l = Launch {
                    module: Module::Pack,
                    function: format!("e4m3_to_{to}{kind}"),
                    grid: (1, 1, 1),
                    threads: 256,
                    smem: 0,
                };
                assert!(defined(&l), "{}", l.function);
            }
        }
    }
}
