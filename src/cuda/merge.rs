//! The CUDA merge of two attention states (`kernels/merge.cu`), behind
//! [`merge_states`](crate::merge_states).

use candle::backend::{BackendDevice, BackendStorage};
use candle::cuda_backend::cudarc::driver::{DevicePtr, DevicePtrMut, DeviceRepr};
use candle::cuda_backend::{CudaDType, CudaDevice};
use candle::{bail, CudaStorage, DType, Layout, Result};

use super::launch::{dtype_name, Launch, Module};
use super::runtime::{launch, Arg};

/// One operand: its storage and layout.
pub(crate) type Operand<'a> = (&'a CudaStorage, &'a Layout);

/// Merges `o_a` with `o_b` through `lse_a`/`lse_b`; `dims` are
/// `(batch, seq, heads, d)` of the rank-4 o operands (lse operands are rank 3, any strides).
/// Returns the contiguous output and log-sum-exp.
pub(crate) fn merge(
    dims: [usize; 4],
    o_a: Operand,
    lse_a: Operand,
    o_b: Operand,
    lse_b: Operand,
) -> Result<(CudaStorage, CudaStorage)> {
    match o_a.0.dtype() {
        DType::F32 => run::<f32>(dims, o_a, lse_a, o_b, lse_b),
        DType::F16 => run::<half::f16>(dims, o_a, lse_a, o_b, lse_b),
        DType::BF16 => run::<half::bf16>(dims, o_a, lse_a, o_b, lse_b),
        dt => bail!("merge_states: no CUDA merge for dtype {dt:?}"),
    }
}

fn run<T: CudaDType + DeviceRepr + candle::WithDType>(
    [batch, seq, heads, d]: [usize; 4],
    (oa, oal): Operand,
    (la, lal): Operand,
    (ob, obl): Operand,
    (lb, lbl): Operand,
) -> Result<(CudaStorage, CudaStorage)> {
    let dev: CudaDevice = oa.device().clone();
    for (name, s) in [("lse_a", la), ("o_b", ob), ("lse_b", lb)] {
        if !s.device().same_device(&dev) {
            bail!("merge_states: {name} is on another GPU than o_a")
        }
    }
    let stream = dev.cuda_stream();
    let (rows, total) = (batch * seq * heads, batch * seq * heads * d);
    // SAFETY: the kernel writes every element of both buffers (d >= 1, checked by the caller:
    // each row's x = 0 thread writes its lse).
    let mut out = unsafe { dev.alloc::<T>(total)? };
    let mut lse = unsafe { dev.alloc::<f32>(rows)? };
    let elem = std::mem::size_of::<T>() as u64;
    // Byte addresses of each operand's first element, and its strides in elements.
    let (a_ptr, a_guard) = oa.as_cuda_slice::<T>()?.device_ptr(&stream);
    let a_ptr = a_ptr + oal.start_offset() as u64 * elem;
    let (la_ptr, la_guard) = la.as_cuda_slice::<f32>()?.device_ptr(&stream);
    let la_ptr = la_ptr + lal.start_offset() as u64 * 4;
    let (lb_ptr, lb_guard) = lb.as_cuda_slice::<f32>()?.device_ptr(&stream);
    let lb_ptr = lb_ptr + lbl.start_offset() as u64 * 4;
    let (b_ptr, b_guard) = ob.as_cuda_slice::<T>()?.device_ptr(&stream);
    let b_ptr = b_ptr + obl.start_offset() as u64 * elem;
    let (o_ptr, o_guard) = out.device_ptr_mut(&stream);
    let (l_ptr, l_guard) = lse.device_ptr_mut(&stream);
    let ints: Vec<i64> = [batch, seq, heads, d]
        .map(|x| x as i64)
        .into_iter()
        .chain(strides(oal))
        .chain(strides(obl))
        .chain(strides(lal).into_iter().take(3))
        .chain(strides(lbl).into_iter().take(3))
        .collect();
    let threads = 256usize;
    let l = Launch {
        module: Module::Merge,
        function: format!("merge_states_{}", dtype_name(T::DTYPE)?),
        grid: (total.div_ceil(threads).min(65535 * 8) as u32, 1, 1),
        threads: threads as u32,
        smem: 0,
    };
    let mut args = vec![
        Arg::Ptr(&o_ptr),
        Arg::Ptr(&l_ptr),
        Arg::Ptr(&a_ptr),
        Arg::Ptr(&la_ptr),
        Arg::Ptr(&b_ptr),
        Arg::Ptr(&lb_ptr),
    ];
    args.extend(ints.iter().map(Arg::I64));
    // The kernel reads each operand through its own layout's strides over the (batch, seq,
    // heads, d) rows the caller checked all operands share, and writes `total` and `rows`
    // elements of the two fresh buffers.
    launch(&dev, &l, &args)?;
    drop((a_guard, la_guard, lb_guard, b_guard, o_guard, l_guard));
    Ok((
        CudaStorage::wrap_cuda_slice(out, dev.clone()),
        CudaStorage::wrap_cuda_slice(lse, dev),
    ))
}

/// The strides of a rank-3 or rank-4 layout in elements, padded with zeros to four.
fn strides(l: &Layout) -> [i64; 4] {
    let mut s = [0i64; 4];
    for (d, &x) in s.iter_mut().zip(l.stride()) {
        *d = x as i64;
    }
    s
}
