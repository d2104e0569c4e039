//! What every test binary shares.
//!
//! * [`device`]: where a test body runs (the CPU, or the CUDA GPU in each kernel configuration
//!   worth covering there), the test-only environment switches, and the runners behind the two
//!   macros below.
//! * [`case`]: one case type (shape, dtype, options, layout), its inputs, and the forward check
//!   every parity test goes through.
//! * [`reference`]: the f64 golden attention, written from the mask rule (deliberately *not*
//!   from `candle_flash::semantics`, so a bug there cannot hide in both), and planted inputs
//!   whose exact output is known.
//! * [`compare`]: the tolerance rule and NaN-propagating comparisons.
//! * [`grad`]: the f64 golden gradients and the gradient check.
//!
//! A property is written once, as a function taking a [`device::Target`] and returning
//! `candle::Result<()>`, and [`test_device!`] turns it into a test module with a `cpu` test and,
//! with the `cuda` feature, a `cuda` test: `odd_lengths::cpu`, `odd_lengths::cuda`. Filters
//! select by either part (`-- ::cuda`, `-- --skip ::cpu`, `-- sanitizer_`).
#![allow(dead_code, unused_imports, unused_macros)]

/// Runs the property `$name` (a `fn(&Target) -> candle::Result<()>` of the same name in the
/// calling module) as the tests `$name::cpu` and, with the `cuda` feature, `$name::cuda`; the CUDA
/// test runs it once per configuration of [`device::Suite`]`::$suite`.
macro_rules! test_device {
    ($name:ident, $suite:ident) => {
        mod $name {
            #[test]
            fn cpu() {
                $crate::common::device::run_cpu(stringify!($name), super::$name)
            }

            #[cfg(feature = "cuda")]
            #[test]
            fn cuda() {
                $crate::common::device::run_cuda(
                    stringify!($name),
                    $crate::common::device::Suite::$suite,
                    super::$name,
                )
            }
        }
    };
}

/// [`test_device!`] for a property that only a GPU has (agreement with the CPU path, the
/// allocator's pool): the test `$name::cuda`, compiled with the `cuda` feature only.
macro_rules! test_cuda {
    ($name:ident, $suite:ident) => {
        #[cfg(feature = "cuda")]
        mod $name {
            #[test]
            fn cuda() {
                $crate::common::device::run_cuda(
                    stringify!($name),
                    $crate::common::device::Suite::$suite,
                    super::$name,
                )
            }
        }
    };
}

/// [`test_device!`] for a guarantee only the CPU path gives: the test `$name::cpu`. The CUDA
/// kernels take their products over whole key tiles, so a NaN or infinity in K or V of a key a
/// row does not see, in a tile the row partly sees, reaches that row (0 · NaN in P V), as in
/// FlashAttention-2; the CPU path leaves such keys out.
macro_rules! test_cpu {
    ($name:ident) => {
        mod $name {
            #[test]
            fn cpu() {
                $crate::common::device::run_cpu(stringify!($name), super::$name)
            }
        }
    };
}

pub mod case;
pub mod compare;
pub mod device;
pub mod grad;
pub mod reference;

/// The Hopper backward instance table, as `build.rs` and the planner read it: the test matrix
/// derives its backward configurations from it (see [`device::bwd_variant_sets`]).
#[path = "../../src/cuda/backward/instances.rs"]
pub mod bwd_instances;

/// The forward and decode instance tables: the decode tests force every decode instance.
#[path = "../../src/cuda/instances.rs"]
pub mod instances;

pub use case::*;
pub use compare::*;
pub use device::Target;
pub use reference::*;

use candle::{DType, Device, Result, Tensor};

/// Seeded N(0, 1) data of the given dtype (candle's CPU RNG is not seedable, so use our own),
/// generated on the host and moved to `device`.
pub fn randn(shape: &[usize], dtype: DType, seed: u64, device: &Device) -> Result<Tensor> {
    let n: usize = shape.iter().product();
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut next = || {
        // xorshift64*, then Box-Muller.
        state ^= state >> 12;
        state ^= state << 25;
        state ^= state >> 27;
        (state.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 11) as f64 / (1u64 << 53) as f64
    };
    let data: Vec<f32> = (0..n)
        .map(|_| {
            let (u1, u2) = (next().max(1e-300), next());
            ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32
        })
        .collect();
    let t = Tensor::from_vec(data, shape, &Device::Cpu)?.to_dtype(dtype)?;
    device::to_device(&t, device)
}

/// A tensor of `shape` holding no element, on any device: a view of one allocated element, since
/// candle asks the CUDA driver for exactly the bytes a tensor holds and the driver refuses 0.
/// It allocates nothing however large the other dimensions are.
pub fn empty(shape: &[usize], dtype: DType, device: &Device) -> Result<Tensor> {
    assert_eq!(shape.iter().product::<usize>(), 0, "empty() of {shape:?}");
    Tensor::zeros(1, dtype, device)?
        .narrow(0, 0, 0)?
        .reshape(shape)
}

/// Every element of `t` as f64 on the host, flattened; NaN and infinities kept.
pub fn values(t: &Tensor) -> Result<Vec<f64>> {
    if t.elem_count() == 0 {
        return Ok(Vec::new());
    }
    let t = t.to_device(&Device::Cpu)?;
    // candle 0.11's CPU F8E4M3 -> F64 conversion never returns; through f32 it is exact.
    let t = if t.dtype() == DType::F8E4M3 {
        t.to_dtype(DType::F32)?
    } else {
        t
    };
    t.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()
}

/// Cumulative lengths of a packed varlen batch: `lens.len() + 1` entries from 0.
pub fn cumulative(lens: &[usize]) -> Vec<u32> {
    let mut cu = vec![0u32];
    for &l in lens {
        cu.push(cu[cu.len() - 1] + l as u32);
    }
    cu
}

/// `1 / sqrt(d)`, the usual softmax scale.
pub fn scale(d: usize) -> f32 {
    1.0 / (d as f32).sqrt()
}

/// A `(b, s, h, d)` view of `t` whose storage is `(b, h, s, d)`: same values, non-contiguous.
pub fn transposed_view(t: &Tensor) -> Result<Tensor> {
    t.transpose(1, 2)?.contiguous()?.transpose(1, 2)
}

/// A view of `t` whose last dimension is not contiguous (storage `(b, s, d, h)`).
pub fn head_dim_strided(t: &Tensor) -> Result<Tensor> {
    t.transpose(2, 3)?.contiguous()?.transpose(2, 3)
}

/// A view of `t` inside a larger NaN-filled buffer (guard bands on every side of every dim and
/// a non-zero start offset), so that any out-of-bounds read shows up as NaN in the output.
pub fn view_in_nan_buffer(t: &Tensor) -> Result<Tensor> {
    let dims = t.dims().to_vec();
    let padded: Vec<usize> = dims.iter().map(|&n| n + 3).collect();
    let mut buf = Tensor::full(f32::NAN, padded.as_slice(), t.device())?.to_dtype(t.dtype())?;
    let ranges: Vec<std::ops::Range<usize>> = dims.iter().map(|&n| 1..1 + n).collect();
    buf = buf.slice_assign(&ranges, t)?;
    let mut view = buf;
    for (axis, &n) in dims.iter().enumerate() {
        view = view.narrow(axis, 1, n)?;
    }
    Ok(view)
}
