//! q, k and v as a kernel reads them: in place, or through a packed contiguous copy where the
//! plan says the kernel cannot read the caller's layout (`cuda::operands::pack_flags`).

use std::sync::Arc;

use candle::cuda_backend::cudarc::driver::{CudaSlice, CudaStream, DevicePtrMut, DeviceRepr};
use candle::cuda_backend::{CudaDType, CudaDevice};
use candle::Result;

use super::{launch, Arg};
use crate::cuda::launch::{Launch, Module};
use crate::problem::Strides;

/// One operand as the kernel reads it: the device address of element (0, 0, 0, 0) and strides.
pub(crate) struct Operand {
    pub ptr: u64,
    pub s: Strides,
}

/// The extent of one operand: batch entries, rows per entry and heads.
#[derive(Clone, Copy)]
pub(crate) struct Extent {
    pub batch: usize,
    pub rows: usize,
    pub heads: usize,
}

/// `base` (the storage's element 0) with strides `s`, in place, or packed into a new contiguous
/// `(batch, rows, heads, d_load)` buffer (kept alive in `scratch` past the launch) when `pack`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn operand<T: CudaDType + DeviceRepr>(
    dev: &CudaDevice,
    stream: &Arc<CudaStream>,
    base: u64,
    s: Strides,
    e: Extent,
    d: usize,
    d_load: usize,
    pack: bool,
    scratch: &mut Vec<CudaSlice<T>>,
) -> Result<Operand> {
    let esize = std::mem::size_of::<T>();
    if !pack {
        return Ok(Operand {
            ptr: base + (s.offset * esize) as u64,
            s,
        });
    }
    let len = e.batch * e.rows * e.heads * d_load;
    // SAFETY: the pack kernel writes every one of the `len` elements (padding included).
    let mut dst = unsafe { dev.alloc::<T>(len.max(1))? };
    let (dst_ptr, guard) = dst.device_ptr_mut(stream);
    let src = base + (s.offset * esize) as u64;
    let args = [
        e.batch, e.rows, e.heads, d, d_load, s.batch, s.seq, s.head, s.dim,
    ]
    .map(|x| x as i64);
    let threads = 256usize;
    let l = Launch {
        module: Module::Pack,
        function: "pack_b16".into(),
        grid: (len.div_ceil(threads).min(65535 * 8) as u32, 1, 1),
        threads: threads as u32,
        smem: 0,
    };
    let mut a = vec![Arg::Ptr(&src), Arg::Ptr(&dst_ptr)];
    a.extend(args.iter().map(Arg::I64));
    // The kernel reads elements of the source view, all inside its storage (`check_bounds` ran
    // on it), and writes the `len` elements of `dst`.
    launch(dev, &l, &a)?;
    drop(guard);
    // The buffer lives on in `scratch`; its device address does not move with it.
    scratch.push(dst);
    Ok(Operand {
        ptr: dst_ptr,
        s: Strides {
            offset: 0,
            batch: e.rows * e.heads * d_load,
            seq: e.heads * d_load,
            head: d_load,
            dim: 1,
        },
    })
}
