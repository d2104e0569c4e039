//! Tensor maps for the Hopper kernels' bulk tensor copies.

use candle::{bail, Result};

use crate::problem::Strides;

/// The driver's `CUtensorMap`: 128 opaque bytes (the kernels' `TmaMap`), passed by value as a
/// `__grid_constant__` kernel parameter.
#[repr(C, align(128))]
#[derive(Clone, Copy)]
pub(crate) struct TmaMap(pub [u64; 16]);

impl TmaMap {
    /// The map an instance that stores no tensor takes (never read).
    pub const NONE: Self = Self([0; 16]);
}

// SAFETY: plain bytes, copied as the kernel parameter of the same size.
unsafe impl candle::cuda_backend::cudarc::driver::DeviceRepr for TmaMap {}

/// A 4-D tensor map (column, head, row, batch) over one 16-bit operand at `ptr`: boxes of 64
/// columns x `box_rows` rows of one head, 128-byte swizzle, zero fill outside the tensor.
pub(crate) fn tma_map(
    ptr: u64,
    s: &Strides,
    bf16: bool,
    [cols, heads, rows, batch]: [usize; 4],
    box_rows: usize,
) -> Result<TmaMap> {
    use candle::cuda_backend::cudarc::driver::sys;
    const ESIZE: usize = 2;
    // Strides of axes of extent 1 are never used; the driver still wants multiples of 16.
    let stride = |st: usize, n: usize| -> u64 {
        if n <= 1 {
            (cols * ESIZE).next_multiple_of(16) as u64
        } else {
            (st * ESIZE) as u64
        }
    };
    let dims = [cols, heads, rows, batch].map(|x| x.max(1) as u64);
    let strides = [
        stride(s.head, heads),
        stride(s.seq, rows),
        stride(s.batch, batch),
    ];
    let boxes = [64u32, 1, box_rows as u32, 1];
    let elem_strides = [1u32; 4];
    let mut map = TmaMap::NONE;
    let dtype = match bf16 {
        true => sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
        false => sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
    };
    // SAFETY: every pointer is to a live local array of the lengths the rank (4) implies; `map`
    // is 128 writable bytes, as large and as aligned as a CUtensorMap.
    let r = unsafe {
        sys::cuTensorMapEncodeTiled(
            &mut map as *mut TmaMap as *mut sys::CUtensorMap,
            dtype,
            4,
            ptr as *mut std::ffi::c_void,
            dims.as_ptr(),
            strides.as_ptr(),
            boxes.as_ptr(),
            elem_strides.as_ptr(),
            sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
            sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    };
    if r != sys::CUresult::CUDA_SUCCESS {
        bail!(
            "flash-attn: cuTensorMapEncodeTiled failed ({r:?}) for dims {dims:?}, strides \
             {strides:?}"
        )
    }
    Ok(map)
}
