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
    dims: [usize; 4],
    box_rows: usize,
) -> Result<TmaMap> {
    use candle::cuda_backend::cudarc::driver::sys::CUtensorMapDataType as Ty;
    let ty = match bf16 {
        true => Ty::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
        false => Ty::CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
    };
    operand_map(ptr, s, (ty, 2), dims, box_rows)
}

/// [`tma_map`] over an e4m3 (FP8) operand: boxes of 128 one-byte columns (a 128-byte row).
pub(crate) fn tma_map_e4m3(
    ptr: u64,
    s: &Strides,
    dims: [usize; 4],
    box_rows: usize,
) -> Result<TmaMap> {
    use candle::cuda_backend::cudarc::driver::sys::CUtensorMapDataType as Ty;
    operand_map(
        ptr,
        s,
        (Ty::CU_TENSOR_MAP_DATA_TYPE_UINT8, 1),
        dims,
        box_rows,
    )
}

/// The map of a transposed e4m3 V, contiguous `(batch, kv_heads, d, keys)` (kernels/pack.cu's
/// `e4m3_v_transpose`): (key, column, head, batch), boxes of 128 keys x `box_d` columns.
pub(crate) fn tma_map_vt(
    ptr: u64,
    [keys, d, heads, batch]: [usize; 4],
    box_d: usize,
) -> Result<TmaMap> {
    use candle::cuda_backend::cudarc::driver::sys::CUtensorMapDataType as Ty;
    let dims = [keys, d, heads, batch].map(|x| x.max(1) as u64);
    let strides = [keys, keys * d, keys * d * heads].map(|x| x as u64);
    encode(
        ptr,
        Ty::CU_TENSOR_MAP_DATA_TYPE_UINT8,
        dims,
        strides,
        [128, box_d as u32, 1, 1],
    )
}

/// A (column, head, row, batch) map over an operand of `esize`-byte elements: boxes of one
/// 128-byte row of columns x `box_rows` rows of one head.
fn operand_map(
    ptr: u64,
    s: &Strides,
    (ty, esize): (
        candle::cuda_backend::cudarc::driver::sys::CUtensorMapDataType,
        usize,
    ),
    [cols, heads, rows, batch]: [usize; 4],
    box_rows: usize,
) -> Result<TmaMap> {
    // Strides of axes of extent 1 are never used; the driver still wants multiples of 16.
    let stride = |st: usize, n: usize| -> u64 {
        if n <= 1 {
            (cols * esize).next_multiple_of(16) as u64
        } else {
            (st * esize) as u64
        }
    };
    let dims = [cols, heads, rows, batch].map(|x| x.max(1) as u64);
    let strides = [
        stride(s.head, heads),
        stride(s.seq, rows),
        stride(s.batch, batch),
    ];
    encode(
        ptr,
        ty,
        dims,
        strides,
        [(128 / esize) as u32, 1, box_rows as u32, 1],
    )
}

/// `cuTensorMapEncodeTiled` of a rank-4 map: 128-byte swizzle, zero fill outside the tensor.
fn encode(
    ptr: u64,
    ty: candle::cuda_backend::cudarc::driver::sys::CUtensorMapDataType,
    dims: [u64; 4],
    strides: [u64; 3],
    boxes: [u32; 4],
) -> Result<TmaMap> {
    use candle::cuda_backend::cudarc::driver::sys;
    let elem_strides = [1u32; 4];
    let mut map = TmaMap::NONE;
    // SAFETY: every pointer is to a live local array of the lengths the rank (4) implies; `map`
    // is 128 writable bytes, as large and as aligned as a CUtensorMap.
    let r = unsafe {
        sys::cuTensorMapEncodeTiled(
            &mut map as *mut TmaMap as *mut sys::CUtensorMap,
            ty,
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
