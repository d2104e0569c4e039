//! One kernel launch, as every plan describes it: which module and entry point, the grid, the
//! block and the dynamic shared memory. Plans are pure data, built and tested without a GPU;
//! `runtime::launch` executes them.

use candle::{bail, DType, Result};

/// The PTX module a kernel lives in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Module {
    /// The portable (compute_80) kernels of one dtype: forward and backward.
    Bf16,
    F16,
    F32,
    /// The split-KV decode kernels of one dtype and their combine kernel (compute_80): a module
    /// of their own, so that a call JIT-compiles only the kernels of its kind on first use.
    DecodeBf16,
    DecodeF16,
    /// The decode instances with warpgroup-MMA products (kernels/decode/decode_sm90.cu, sm_90a),
    /// f16 and bf16.
    DecodeSm90,
    /// The sm_90a forward kernels (kernels/sm90/flash_sm90.cu), f16 and bf16.
    Sm90,
    /// The sm_90a backward kernels (kernels/sm90/bwd_sm90.cu).
    Sm90Bwd,
    /// Decode from FP8 caches (kernels/decode/decode_fp8.cu), f16 and bf16: compute_89, with
    /// sm_89's e4m3 conversion instruction.
    DecodeFp8,
    /// The same kernels in compute_80, converting e4m3 by integer and f16 arithmetic: GPUs
    /// before sm_89, and the portable path.
    DecodeFp8Portable,
    /// Operand packing and KV-cache appends (kernels/pack.cu).
    Pack,
    /// The merge of two attention states (kernels/merge.cu).
    Merge,
    /// The key-tile lists of block-sparse masks (kernels/tiles.cu).
    Tiles,
}

impl Module {
    /// The portable module holding the kernels of `dtype`.
    pub fn of(dtype: DType) -> Result<Self> {
        Ok(match dtype {
            DType::BF16 => Self::Bf16,
            DType::F16 => Self::F16,
            DType::F32 => Self::F32,
            dt => bail!("flash-attn: no CUDA kernel for dtype {dt:?}"),
        })
    }

    /// The decode module of `dtype` (f16 or bf16).
    pub fn decode_of(dtype: DType) -> Result<Self> {
        Ok(match dtype {
            DType::BF16 => Self::DecodeBf16,
            DType::F16 => Self::DecodeF16,
            dt => bail!("flash-attn: no CUDA decode kernel for dtype {dt:?}"),
        })
    }
}

/// The dtype part of kernel names: `bf16`, `f16`, `f32`.
pub(crate) fn dtype_name(dtype: DType) -> Result<&'static str> {
    Ok(match dtype {
        DType::BF16 => "bf16",
        DType::F16 => "f16",
        DType::F32 => "f32",
        dt => bail!("flash-attn: no CUDA kernel for dtype {dt:?}"),
    })
}

/// Whether `l`'s entry point is defined in its module's PTX, for the planners' tests: with the
/// `cuda` feature, which builds the PTX (a CPU-only build has none to check against).
#[cfg(test)]
pub(crate) fn defined(l: &Launch) -> bool {
    #[cfg(feature = "cuda")]
    return crate::cuda::runtime::defines(l.module, &l.function);
    #[cfg(not(feature = "cuda"))]
    return !l.function.is_empty();
}

/// One kernel launch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Launch {
    pub module: Module,
    /// The `extern "C"` entry point.
    pub function: String,
    pub grid: (u32, u32, u32),
    pub threads: u32,
    /// Dynamic shared memory per block, in bytes.
    pub smem: usize,
}

impl Launch {
    /// A launch with nothing to do (an empty grid) is skipped by the runtime.
    pub fn is_empty(&self) -> bool {
        self.grid.0 == 0 || self.grid.1 == 0 || self.grid.2 == 0
    }
}

/// Longest sequence the kernels index with `int` diagonals.
pub(crate) const MAX_SEQ: usize = 1 << 30;

/// `x` as the kernels' `int`, or an error naming `what`.
pub(crate) fn to_i32(x: usize, what: &str) -> Result<i32> {
    i32::try_from(x)
        .map_err(|_| candle::Error::Msg(format!("flash-attn: {what} = {x} exceeds i32")))
}

/// `x` as a grid dimension, or an error naming `what`.
pub(crate) fn to_u32(x: usize, what: &str) -> Result<u32> {
    u32::try_from(x)
        .map_err(|_| candle::Error::Msg(format!("flash-attn: {what} = {x} exceeds the grid")))
}
