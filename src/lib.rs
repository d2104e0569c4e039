//! FlashAttention for Candle: exact `softmax(q kᵀ · scale) v` computed tile by tile with an
//! online softmax, never materialising the `seq_q × seq_k` score matrix.
//!
//! One `CustomOp3` with two backends: a tiled, multi-threaded CPU path and (with the `cuda`
//! feature) CUDA kernels compiled from `kernels/*.cu` to PTX at build time. The free functions
//! have the signatures of `candle-flash-attn` 0.11.1, so switching is a change of `use`;
//! [`FlashAttn`] holds every option and also returns the log-sum-exp, and [`naive_attention`] is
//! the materialising reference with the same semantics.
//!
//! The examples name candle-core `candle`, as candle's own crates do:
//! `candle = { package = "candle-core", version = "0.11" }`.
//!
//! ```
//! use candle::{Device, Tensor};
//!
//! let dev = Device::Cpu; // or Device::new_cuda(0)? with the `cuda` feature
//! // q: (batch, seq_q, heads, head_dim); k, v: (batch, seq_k, kv_heads, head_dim)
//! let q = Tensor::randn(0f32, 1., (2, 16, 4, 32), &dev)?;
//! let k = Tensor::randn(0f32, 1., (2, 16, 2, 32), &dev)?; // GQA: 2 query heads per kv head
//! let v = Tensor::randn(0f32, 1., (2, 16, 2, 32), &dev)?;
//! let scale = 1.0 / (32f32).sqrt();
//!
//! let out = candle_flash::flash_attn(&q, &k, &v, scale, /* causal */ true)?;
//! assert_eq!(out.dims(), q.dims());
//!
//! // The same attention through the full score matrix agrees up to f32 rounding.
//! let opts = candle_flash::FlashAttn::new(scale).causal();
//! let reference = candle_flash::naive_attention(&q, &k, &v, &opts)?;
//! let max_diff = (out - reference)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
//! assert!(max_diff < 1e-4);
//! # Ok::<(), candle::Error>(())
//! ```
//!
//! # Shapes and semantics
//!
//! q is `(batch, seq_q, heads, head_dim)`, k and v are `(batch, seq_k, kv_heads, head_dim)`, and
//! the output is shaped and typed like q. The variable-length (`varlen`) functions take packed
//! `(total_tokens, heads, head_dim)` tensors and cumulative u32 sequence offsets instead.
//! `heads` must be a multiple of `kv_heads` (GQA/MQA; K and V are read in place, never repeated).
//! Masks are aligned bottom-right: query `i` sees key `j` iff
//! `i + seq_k - seq_q - left <= j <= i + seq_k - seq_q + right`, with `None` meaning unbounded;
//! causal is `(None, Some(0))`. A query that sees no key outputs zeros. Dtypes f32, f16 and bf16,
//! accumulated in f32; any strides. [`semantics`] defines masking, ALiBi, softcap and GQA once
//! for every backend.
//!
//! Supported head dims: 1 to [`MAX_HEAD_DIM`] (512) on every backend.
//! <!-- head_dim: update this sentence when MAX_HEAD_DIM changes. -->
//!
//! # Errors
//!
//! Every function returns a [`candle::Error`] naming the offending argument, never panics, when:
//!
//! - q, k or v has the wrong rank (4, or 3 for varlen), or k and v differ in shape;
//! - the dtype is not f32, f16 or bf16, or k/v's dtype differs from q's, except for FP8 calls
//!   (F8E4M3 k and v with bf16/f16 q, or F8E4M3 everywhere; see [`FlashAttn::q_descale`]),
//!   whose descales must be f32 `(batch, kv_heads)` on q's device and which refuse tracked
//!   inputs and the backward pass;
//! - k, v, the ALiBi slopes, the sinks or the sequence offsets live on another device than q;
//! - batch sizes or head dims of q and k/v differ, or the head dim is 0 or above
//!   [`MAX_HEAD_DIM`];
//! - `kv_heads` is 0 or does not divide `heads`;
//! - `softmax_scale` is not finite, or `softcap` is negative or not finite;
//! - ALiBi slopes are not f32 of shape `(heads,)` or `(batch, heads)`;
//! - attention sinks are not f32 of shape `(heads,)`;
//! - a bias is not f32 or q's dtype, or does not broadcast to `(batch, heads, seq_q, seq_k)`
//!   (packed and paged calls: `max_seqlen_q`, `max_seqlen_k`; KV-cache calls: the new rows and
//!   the cache's capacity); a block mask is not u8, does not broadcast to its block grid or has
//!   a block size of 0; either comes with `mm_prefix_ranges`, or a tracked bias with a paged
//!   or KV-cache call;
//! - varlen offsets are not u32 of shape `(batch + 1,)`, do not start at 0, decrease, hold a
//!   sequence longer than `max_seqlen_q`/`max_seqlen_k`, do not end at the packed tensor's token
//!   count, or q's and k's offsets differ in length;
//! - a paged call's block table is not an integer `(batch, max_blocks)` tensor, names a block
//!   out of range or too few pages for a sequence, or its page size does not match k; a KV
//!   cache append would outgrow the cache; prefix ranges are not `(batch, max_ranges, 2)`;
//! - the device has no implementation (a CUDA tensor without the `cuda` feature, Metal), or a
//!   CUDA allocation or kernel launch fails.

mod cpu;
mod cuda;
mod merge;
mod naive;
mod op;
mod problem;
pub mod ring;
pub mod semantics;

pub use cpu::CpuMatmul;
pub use merge::merge_states;
pub use naive::naive_attention;
pub use op::{AttnGrads, BlockMask, FlashAttn, PlanOverride, MAX_HEAD_DIM};

use candle::{Result, Tensor};

fn causal_window(causal: bool) -> Option<usize> {
    causal.then_some(0)
}

/// Flash attention. q: `(batch, seq_q, heads, head_dim)`, k/v: `(batch, seq_k, kv_heads,
/// head_dim)`; `causal` masks bottom-right aligned (query `i` sees key `j` iff
/// `j <= i + seq_k - seq_q`). Returns `(batch, seq_q, heads, head_dim)` in q's dtype.
///
/// # Errors
///
/// When the shapes, dtypes or devices of q, k and v do not fit together, the head dim is outside
/// `1..=MAX_HEAD_DIM`, `softmax_scale` is not finite, or the backend fails (see
/// [the crate docs](crate#errors)).
///
/// # Example
///
/// ```
/// use candle::{Device, Tensor};
///
/// // Decoding one token against a KV cache of 9: causal alignment makes it see all 9 keys.
/// let q = Tensor::randn(0f32, 1., (1, 1, 4, 16), &Device::Cpu)?;
/// let k = Tensor::randn(0f32, 1., (1, 9, 4, 16), &Device::Cpu)?;
/// let v = Tensor::randn(0f32, 1., (1, 9, 4, 16), &Device::Cpu)?;
/// let out = candle_flash::flash_attn(&q, &k, &v, 0.25, true)?;
/// assert_eq!(out.dims(), &[1, 1, 4, 16]);
///
/// // A head dim that differs between q and k is an error, not a panic.
/// let k8 = Tensor::zeros((1, 9, 4, 8), candle::DType::F32, &Device::Cpu)?;
/// assert!(candle_flash::flash_attn(&q, &k8, &k8, 0.25, true).is_err());
/// # Ok::<(), candle::Error>(())
/// ```
pub fn flash_attn(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    softmax_scale: f32,
    causal: bool,
) -> Result<Tensor> {
    FlashAttn::new(softmax_scale)
        .window(None, causal_window(causal))
        .forward(q, k, v)
}

/// Flash attention with a sliding window around the (bottom-right aligned) diagonal: query `i`
/// sees keys `diag(i) - window_size_left ..= diag(i) + window_size_right`, where
/// `diag(i) = i + seq_k - seq_q` and `None` leaves that side unbounded. `(None, Some(0))` is
/// causal, `(None, None)` full attention.
///
/// # Errors
///
/// As [`flash_attn`]: mismatched shapes, dtypes or devices, an unsupported head dim, a non-finite
/// scale, or a backend failure (see [the crate docs](crate#errors)).
///
/// # Example
///
/// ```
/// use candle::{Device, Tensor};
///
/// let q = Tensor::randn(0f32, 1., (1, 32, 2, 16), &Device::Cpu)?;
/// let kv = Tensor::randn(0f32, 1., (1, 32, 2, 16), &Device::Cpu)?;
/// // Sliding-window causal attention: each query sees itself and the 7 keys before it.
/// let out = candle_flash::flash_attn_windowed(&q, &kv, &kv, 0.25, Some(7), Some(0))?;
/// assert_eq!(out.dims(), &[1, 32, 2, 16]);
/// # Ok::<(), candle::Error>(())
/// ```
pub fn flash_attn_windowed(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    softmax_scale: f32,
    window_size_left: Option<usize>,
    window_size_right: Option<usize>,
) -> Result<Tensor> {
    FlashAttn::new(softmax_scale)
        .window(window_size_left, window_size_right)
        .forward(q, k, v)
}

/// Flash attention with ALiBi: each score of head `h` is lowered by
/// `alibi_slopes[h] · |diag(i) - j|` before the softmax (`alibi_slopes`: f32, `(heads,)` or
/// `(batch, heads)`, on q's device).
///
/// # Errors
///
/// As [`flash_attn`], and when `alibi_slopes` is not f32, has another shape than `(heads,)` or
/// `(batch, heads)`, or lives on another device than q (see [the crate docs](crate#errors)).
///
/// # Example
///
/// ```
/// use candle::{Device, Tensor};
///
/// let q = Tensor::randn(0f32, 1., (1, 8, 4, 16), &Device::Cpu)?;
/// let kv = Tensor::randn(0f32, 1., (1, 8, 4, 16), &Device::Cpu)?;
/// let slopes = Tensor::new(&[0.5f32, 0.25, 0.125, 0.0625], &Device::Cpu)?;
/// let out = candle_flash::flash_attn_alibi(&q, &kv, &kv, &slopes, 0.25, true)?;
/// assert_eq!(out.dims(), &[1, 8, 4, 16]);
///
/// // One slope per head: 3 slopes for 4 heads are refused.
/// let bad = Tensor::new(&[0.5f32, 0.25, 0.125], &Device::Cpu)?;
/// assert!(candle_flash::flash_attn_alibi(&q, &kv, &kv, &bad, 0.25, true).is_err());
/// # Ok::<(), candle::Error>(())
/// ```
pub fn flash_attn_alibi(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    alibi_slopes: &Tensor,
    softmax_scale: f32,
    causal: bool,
) -> Result<Tensor> {
    FlashAttn::new(softmax_scale)
        .window(None, causal_window(causal))
        .alibi(alibi_slopes)
        .forward(q, k, v)
}

/// Flash attention with ALiBi (as [`flash_attn_alibi`]) and a sliding window (as
/// [`flash_attn_windowed`]).
///
/// # Errors
///
/// As [`flash_attn_alibi`]: mismatched inputs, an unsupported head dim, a non-finite scale, bad
/// ALiBi slopes, or a backend failure (see [the crate docs](crate#errors)).
///
/// # Example
///
/// ```
/// use candle::{Device, Tensor};
///
/// let q = Tensor::randn(0f32, 1., (2, 8, 2, 16), &Device::Cpu)?;
/// let kv = Tensor::randn(0f32, 1., (2, 8, 2, 16), &Device::Cpu)?;
/// // Per-batch slopes, (batch, heads).
/// let slopes = Tensor::new(&[[0.5f32, 0.25], [0.125, 0.0625]], &Device::Cpu)?;
/// let out = candle_flash::flash_attn_alibi_windowed(&q, &kv, &kv, &slopes, 0.25, Some(3), Some(0))?;
/// assert_eq!(out.dims(), &[2, 8, 2, 16]);
/// # Ok::<(), candle::Error>(())
/// ```
pub fn flash_attn_alibi_windowed(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    alibi_slopes: &Tensor,
    softmax_scale: f32,
    window_size_left: Option<usize>,
    window_size_right: Option<usize>,
) -> Result<Tensor> {
    FlashAttn::new(softmax_scale)
        .window(window_size_left, window_size_right)
        .alibi(alibi_slopes)
        .forward(q, k, v)
}

/// Flash attention with optional ALiBi, a sliding window and a logit softcap: with `softcap`
/// `c > 0` each scaled score `s` becomes `c · tanh(s / c)` (Gemma 2); `0` turns it off.
///
/// # Errors
///
/// As [`flash_attn_alibi_windowed`], and when `softcap` is negative or not finite (see
/// [the crate docs](crate#errors)).
///
/// # Example
///
/// ```
/// use candle::{Device, Tensor};
///
/// let q = Tensor::randn(0f32, 1., (1, 8, 2, 16), &Device::Cpu)?;
/// let kv = Tensor::randn(0f32, 1., (1, 8, 2, 16), &Device::Cpu)?;
/// let out = candle_flash::flash_attn_alibi_windowed_softcap(
///     &q, &kv, &kv, None, 0.25, None, Some(0), 30.0,
/// )?;
/// assert_eq!(out.dims(), &[1, 8, 2, 16]);
///
/// let negative = candle_flash::flash_attn_alibi_windowed_softcap(
///     &q, &kv, &kv, None, 0.25, None, Some(0), -1.0,
/// );
/// assert!(negative.is_err());
/// # Ok::<(), candle::Error>(())
/// ```
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_alibi_windowed_softcap(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    alibi_slopes: Option<&Tensor>,
    softmax_scale: f32,
    window_size_left: Option<usize>,
    window_size_right: Option<usize>,
    softcap: f32,
) -> Result<Tensor> {
    let mut op = FlashAttn::new(softmax_scale)
        .window(window_size_left, window_size_right)
        .softcap(softcap);
    op.alibi_slopes = alibi_slopes.cloned();
    op.forward(q, k, v)
}

/// Variable-length flash attention over packed sequences: q `(total_q, heads, head_dim)`, k/v
/// `(total_k, kv_heads, head_dim)`, `seqlens_q`/`seqlens_k` cumulative u32 offsets of length
/// `batch + 1` (sequence `b` is rows `seqlens[b]..seqlens[b + 1]`); `max_seqlen_q`/`max_seqlen_k`
/// bound the sequence lengths. No padding and no mask between sequences: each attends only to
/// itself, `causal` aligned bottom-right per sequence. Returns `(total_q, heads, head_dim)`.
///
/// # Errors
///
/// When the shapes, dtypes or devices of q, k and v do not fit together (rank 3 expected), the
/// head dim is outside `1..=MAX_HEAD_DIM`, `softmax_scale` is not finite, the offsets are not u32
/// `(batch + 1,)` tensors starting at 0, non-decreasing, ending at the packed token counts, with
/// no sequence longer than its `max_seqlen`, or the backend fails (see
/// [the crate docs](crate#errors)).
///
/// # Example
///
/// ```
/// use candle::{Device, Tensor};
///
/// let dev = Device::Cpu;
/// // Two sequences of 3 and 5 tokens, packed back to back.
/// let q = Tensor::randn(0f32, 1., (8, 4, 16), &dev)?;
/// let kv = Tensor::randn(0f32, 1., (8, 2, 16), &dev)?;
/// let seqlens = Tensor::new(&[0u32, 3, 8], &dev)?;
/// let out = candle_flash::flash_attn_varlen(&q, &kv, &kv, &seqlens, &seqlens, 5, 5, 0.25, true)?;
/// assert_eq!(out.dims(), &[8, 4, 16]);
///
/// // Offsets must end at the number of packed tokens.
/// let short = Tensor::new(&[0u32, 3, 7], &dev)?;
/// assert!(candle_flash::flash_attn_varlen(&q, &kv, &kv, &short, &short, 5, 5, 0.25, true).is_err());
/// # Ok::<(), candle::Error>(())
/// ```
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_varlen(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    seqlens_q: &Tensor,
    seqlens_k: &Tensor,
    max_seqlen_q: usize,
    max_seqlen_k: usize,
    softmax_scale: f32,
    causal: bool,
) -> Result<Tensor> {
    FlashAttn::new(softmax_scale)
        .window(None, causal_window(causal))
        .forward_varlen(q, k, v, seqlens_q, seqlens_k, max_seqlen_q, max_seqlen_k)
}

/// Variable-length flash attention (as [`flash_attn_varlen`]) with a sliding window (as
/// [`flash_attn_windowed`]), aligned bottom-right within each sequence.
///
/// # Errors
///
/// When the shapes, dtypes or devices of q, k and v do not fit together (rank 3 expected), the
/// head dim is outside `1..=MAX_HEAD_DIM`, `softmax_scale` is not finite, the offsets are not u32
/// `(batch + 1,)` tensors starting at 0, non-decreasing, ending at the packed token counts, with
/// no sequence longer than its `max_seqlen`, or the backend fails (see
/// [the crate docs](crate#errors)).
///
/// # Example
///
/// ```
/// use candle::{Device, Tensor};
///
/// let dev = Device::Cpu;
/// let q = Tensor::randn(0f32, 1., (8, 2, 16), &dev)?;
/// let kv = Tensor::randn(0f32, 1., (8, 2, 16), &dev)?;
/// let seqlens = Tensor::new(&[0u32, 3, 8], &dev)?;
/// let out = candle_flash::flash_attn_varlen_windowed(
///     &q, &kv, &kv, &seqlens, &seqlens, 5, 5, 0.25, Some(2), Some(0),
/// )?;
/// assert_eq!(out.dims(), &[8, 2, 16]);
/// # Ok::<(), candle::Error>(())
/// ```
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_varlen_windowed(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    seqlens_q: &Tensor,
    seqlens_k: &Tensor,
    max_seqlen_q: usize,
    max_seqlen_k: usize,
    softmax_scale: f32,
    window_size_left: Option<usize>,
    window_size_right: Option<usize>,
) -> Result<Tensor> {
    FlashAttn::new(softmax_scale)
        .window(window_size_left, window_size_right)
        .forward_varlen(q, k, v, seqlens_q, seqlens_k, max_seqlen_q, max_seqlen_k)
}

/// Variable-length flash attention (as [`flash_attn_varlen`]) with ALiBi (as
/// [`flash_attn_alibi`]; per-batch slopes `(batch, heads)` give each sequence its own).
///
/// # Errors
///
/// When the shapes, dtypes or devices of q, k and v do not fit together (rank 3 expected), the
/// head dim is outside `1..=MAX_HEAD_DIM`, `softmax_scale` is not finite, the offsets are not u32
/// `(batch + 1,)` tensors starting at 0, non-decreasing, ending at the packed token counts, with
/// no sequence longer than its `max_seqlen`, or the backend fails (see
/// [the crate docs](crate#errors)).
/// Also when `alibi_slopes` is not f32 of shape `(heads,)` or `(batch, heads)` on q's device.
///
/// # Example
///
/// ```
/// use candle::{Device, Tensor};
///
/// let dev = Device::Cpu;
/// let q = Tensor::randn(0f32, 1., (8, 2, 16), &dev)?;
/// let kv = Tensor::randn(0f32, 1., (8, 2, 16), &dev)?;
/// let seqlens = Tensor::new(&[0u32, 3, 8], &dev)?;
/// let slopes = Tensor::new(&[0.5f32, 0.25], &dev)?;
/// let out = candle_flash::flash_attn_varlen_alibi(
///     &q, &kv, &kv, &slopes, &seqlens, &seqlens, 5, 5, 0.25, true,
/// )?;
/// assert_eq!(out.dims(), &[8, 2, 16]);
/// # Ok::<(), candle::Error>(())
/// ```
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_varlen_alibi(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    alibi_slopes: &Tensor,
    seqlens_q: &Tensor,
    seqlens_k: &Tensor,
    max_seqlen_q: usize,
    max_seqlen_k: usize,
    softmax_scale: f32,
    causal: bool,
) -> Result<Tensor> {
    FlashAttn::new(softmax_scale)
        .window(None, causal_window(causal))
        .alibi(alibi_slopes)
        .forward_varlen(q, k, v, seqlens_q, seqlens_k, max_seqlen_q, max_seqlen_k)
}

/// Variable-length flash attention (as [`flash_attn_varlen`]) with ALiBi and a sliding window.
///
/// # Errors
///
/// When the shapes, dtypes or devices of q, k and v do not fit together (rank 3 expected), the
/// head dim is outside `1..=MAX_HEAD_DIM`, `softmax_scale` is not finite, the offsets are not u32
/// `(batch + 1,)` tensors starting at 0, non-decreasing, ending at the packed token counts, with
/// no sequence longer than its `max_seqlen`, or the backend fails (see
/// [the crate docs](crate#errors)).
/// Also when `alibi_slopes` is not f32 of shape `(heads,)` or `(batch, heads)` on q's device.
///
/// # Example
///
/// ```
/// use candle::{Device, Tensor};
///
/// let dev = Device::Cpu;
/// let q = Tensor::randn(0f32, 1., (8, 2, 16), &dev)?;
/// let kv = Tensor::randn(0f32, 1., (8, 2, 16), &dev)?;
/// let seqlens = Tensor::new(&[0u32, 3, 8], &dev)?;
/// let slopes = Tensor::new(&[[0.5f32, 0.25], [0.125, 0.0625]], &dev)?;
/// let out = candle_flash::flash_attn_varlen_alibi_windowed(
///     &q, &kv, &kv, &slopes, &seqlens, &seqlens, 5, 5, 0.25, Some(2), Some(0),
/// )?;
/// assert_eq!(out.dims(), &[8, 2, 16]);
/// # Ok::<(), candle::Error>(())
/// ```
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_varlen_alibi_windowed(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    alibi_slopes: &Tensor,
    seqlens_q: &Tensor,
    seqlens_k: &Tensor,
    max_seqlen_q: usize,
    max_seqlen_k: usize,
    softmax_scale: f32,
    window_size_left: Option<usize>,
    window_size_right: Option<usize>,
) -> Result<Tensor> {
    FlashAttn::new(softmax_scale)
        .window(window_size_left, window_size_right)
        .alibi(alibi_slopes)
        .forward_varlen(q, k, v, seqlens_q, seqlens_k, max_seqlen_q, max_seqlen_k)
}

/// Variable-length flash attention (as [`flash_attn_varlen`]) with optional ALiBi, a sliding
/// window and a logit softcap (as [`flash_attn_alibi_windowed_softcap`]; `0` = off).
///
/// # Errors
///
/// When the shapes, dtypes or devices of q, k and v do not fit together (rank 3 expected), the
/// head dim is outside `1..=MAX_HEAD_DIM`, `softmax_scale` is not finite, the offsets are not u32
/// `(batch + 1,)` tensors starting at 0, non-decreasing, ending at the packed token counts, with
/// no sequence longer than its `max_seqlen`, or the backend fails (see
/// [the crate docs](crate#errors)).
/// Also when `alibi_slopes` is not f32 of shape `(heads,)` or `(batch, heads)` on q's device, or
/// `softcap` is negative or not finite.
///
/// # Example
///
/// ```
/// use candle::{Device, Tensor};
///
/// let dev = Device::Cpu;
/// let q = Tensor::randn(0f32, 1., (8, 2, 16), &dev)?;
/// let kv = Tensor::randn(0f32, 1., (8, 2, 16), &dev)?;
/// let seqlens = Tensor::new(&[0u32, 3, 8], &dev)?;
/// let out = candle_flash::flash_attn_varlen_alibi_windowed_softcap(
///     &q, &kv, &kv, None, &seqlens, &seqlens, 5, 5, 0.25, None, Some(0), 50.0,
/// )?;
/// assert_eq!(out.dims(), &[8, 2, 16]);
/// # Ok::<(), candle::Error>(())
/// ```
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_varlen_alibi_windowed_softcap(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    alibi_slopes: Option<&Tensor>,
    seqlens_q: &Tensor,
    seqlens_k: &Tensor,
    max_seqlen_q: usize,
    max_seqlen_k: usize,
    softmax_scale: f32,
    window_size_left: Option<usize>,
    window_size_right: Option<usize>,
    softcap: f32,
) -> Result<Tensor> {
    let mut op = FlashAttn::new(softmax_scale)
        .window(window_size_left, window_size_right)
        .softcap(softcap);
    op.alibi_slopes = alibi_slopes.cloned();
    op.forward_varlen(q, k, v, seqlens_q, seqlens_k, max_seqlen_q, max_seqlen_k)
}

/// Variable-length flash attention over a paged K/V cache, with the signature of
/// `candle-flash-attn` 0.11's function of the same name. q: `(total_q, heads, head_dim)`;
/// k, v: `(num_blocks, page_block_size, kv_heads, head_dim)`; `seqlens_q`/`seqlens_k`:
/// cumulative u32 offsets of `batch + 1` entries (`seqlens_k` gives the logical key lengths);
/// `block_table`: integer `(batch, max_blocks)` (u32, i32 or i64), row `b` naming the blocks
/// that hold sequence `b`'s keys in order (key `j` is row `j % page_block_size` of block
/// `block_table[b][j / page_block_size]`); `mm_prefix_ranges`: optional integer
/// `(batch, max_ranges, 2)` `[start, end)` ranges of absolute positions inside which queries
/// and keys see each other whatever the window says (see [`FlashAttn::mm_prefix_ranges`]).
/// The window is aligned bottom-right per sequence; `softcap` `Some(c)`, `c > 0`, caps the
/// scores. Keys are read in place: cache rows past each sequence's length and blocks the table
/// does not name are never read (they may hold NaN). Returns `(total_q, heads, head_dim)`.
///
/// # Errors
///
/// As [`flash_attn_varlen`] (except that k and v are rank 4 and `seqlens_k` need not end at a
/// packed token count), and when `block_table` is not an integer `(batch, max_blocks)` tensor,
/// names a block out of range, holds fewer pages than a sequence needs, `page_block_size` is 0
/// or differs from k's second dimension, or `mm_prefix_ranges` is not `(batch, max_ranges, 2)`.
/// On CUDA the table, the lengths and the ranges stay on the GPU unchecked: the kernels clamp
/// them, so a bad entry never reads or writes out of bounds (a block index outside the cache
/// reads as zero keys), but the rows it touches get unspecified values.
///
/// # Example
///
/// ```
/// use candle::{Device, Tensor};
///
/// let dev = Device::Cpu;
/// // 8 blocks of 4 rows; sequence 0 has 6 keys in blocks 5, 2; sequence 1 has 3 keys in block 7.
/// let k = Tensor::randn(0f32, 1., (8, 4, 2, 16), &dev)?;
/// let v = Tensor::randn(0f32, 1., (8, 4, 2, 16), &dev)?;
/// let table = Tensor::new(&[[5i32, 2], [7, 0]], &dev)?;
/// let q = Tensor::randn(0f32, 1., (3, 4, 16), &dev)?; // 2 + 1 queries
/// let cu_q = Tensor::new(&[0u32, 2, 3], &dev)?;
/// let cu_k = Tensor::new(&[0u32, 6, 9], &dev)?;
/// let out = candle_flash::flash_attn_varlen_paged_windowed(
///     &q, &k, &v, &cu_q, &cu_k, &table, None, 2, 6, 0.25, None, Some(0), 4, None,
/// )?;
/// assert_eq!(out.dims(), &[3, 4, 16]);
/// # Ok::<(), candle::Error>(())
/// ```
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_varlen_paged_windowed(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    seqlens_q: &Tensor,
    seqlens_k: &Tensor,
    block_table: &Tensor,
    mm_prefix_ranges: Option<&Tensor>,
    max_seqlen_q: usize,
    max_seqlen_k: usize,
    softmax_scale: f32,
    window_size_left: Option<usize>,
    window_size_right: Option<usize>,
    page_block_size: usize,
    softcap: Option<f32>,
) -> Result<Tensor> {
    let mut op = FlashAttn::new(softmax_scale)
        .window(window_size_left, window_size_right)
        .paged(block_table, page_block_size);
    op.softcap = softcap;
    op.mm_prefix_ranges = mm_prefix_ranges.cloned();
    op.forward_varlen(q, k, v, seqlens_q, seqlens_k, max_seqlen_q, max_seqlen_k)
}

/// One decode step (or chunk of a chunked prefill) against a KV cache, as FlashAttention-2's
/// `flash_attn_with_kvcache`: appends `k_new`/`v_new` `(batch, seq_new, kv_heads, head_dim)`
/// in place at each sequence's current length `cache_seqlens[b]` (u32 `(batch,)`, the lengths
/// *before* the call), then attends q `(batch, seq_q, heads, head_dim)` over each sequence's
/// `cache_seqlens[b] + seq_new` keys. The caches are `(batch, max_len, kv_heads, head_dim)`,
/// or paged `(num_blocks, page_block_size, kv_heads, head_dim)` with a `block_table`
/// `(batch, max_blocks)` (the page size is the caches' second dimension). `causal` aligns the
/// mask bottom-right. Windows, softcap and ALiBi: [`FlashAttn::forward_kvcache`]. Returns
/// `(batch, seq_q, heads, head_dim)`.
///
/// # Errors
///
/// As [`FlashAttn::forward_kvcache`]: bad shapes, dtypes or devices, a sequence outgrowing
/// the cache, a bad block table; the caches are left untouched then (on CUDA, where the lengths
/// stay on the GPU, as [`FlashAttn::forward_kvcache`] says).
///
/// # Example
///
/// ```
/// use candle::{DType, Device, Tensor};
///
/// let dev = Device::Cpu;
/// let (k_cache, v_cache) = (
///     Tensor::zeros((1, 32, 2, 16), DType::F32, &dev)?,
///     Tensor::zeros((1, 32, 2, 16), DType::F32, &dev)?,
/// );
/// // Prefill 5 tokens, then decode one.
/// let mut len = 0u32;
/// for n in [5, 1] {
///     let q = Tensor::randn(0f32, 1., (1, n, 4, 16), &dev)?;
///     let k = Tensor::randn(0f32, 1., (1, n, 2, 16), &dev)?;
///     let v = Tensor::randn(0f32, 1., (1, n, 2, 16), &dev)?;
///     let lens = Tensor::new(&[len], &dev)?;
///     let out = candle_flash::flash_attn_with_kvcache(
///         &q, &k_cache, &v_cache, Some(&k), Some(&v), &lens, None, 0.25, true,
///     )?;
///     assert_eq!(out.dims(), &[1, n, 4, 16]);
///     len += n as u32;
/// }
/// # Ok::<(), candle::Error>(())
/// ```
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_with_kvcache(
    q: &Tensor,
    k_cache: &Tensor,
    v_cache: &Tensor,
    k_new: Option<&Tensor>,
    v_new: Option<&Tensor>,
    cache_seqlens: &Tensor,
    block_table: Option<&Tensor>,
    softmax_scale: f32,
    causal: bool,
) -> Result<Tensor> {
    let mut op = FlashAttn::new(softmax_scale).window(None, causal_window(causal));
    if let Some(table) = block_table {
        op = op.paged(table, k_cache.dim(1)?);
    }
    let new_kv = match (k_new, v_new) {
        (Some(k), Some(v)) => Some((k, v)),
        (None, None) => None,
        _ => candle::bail!("flash-attn: k_new and v_new must be given together"),
    };
    op.forward_kvcache(q, k_cache, v_cache, cache_seqlens, new_kv)
}
