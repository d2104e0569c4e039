//! FlashAttention for Candle: exact `softmax(q kᵀ · scale) v` computed tile by tile with an
//! online softmax, never materialising the `seq_q × seq_k` score matrix.
//!
//! One `CustomOp3` with two backends: a tiled, multi-threaded CPU path and (with the `cuda`
//! feature) CUDA kernels compiled from `kernels/*.cu` to PTX at build time. The free functions
//! have the signatures of `candle-flash-attn` 0.11.1, so switching is a change of `use`.
//!
//! Layouts: q `(batch, seq_q, heads, head_dim)`, k and v `(batch, seq_k, kv_heads, head_dim)`;
//! the output is shaped and typed like q. See [`semantics`] for masking, ALiBi, softcap and GQA.

mod cpu;
mod cuda;
mod naive;
mod op;
mod problem;
pub mod semantics;

pub use naive::naive_attention;
pub use op::{FlashAttn, MAX_HEAD_DIM};

use candle::{Result, Tensor};

fn causal_window(causal: bool) -> Option<usize> {
    causal.then_some(0)
}

/// Flash attention. q: `(batch, seq_q, heads, head_dim)`, k/v: `(batch, seq_k, kv_heads,
/// head_dim)`; `causal` masks bottom-right aligned (query `i` sees key `j` iff
/// `j <= i + seq_k - seq_q`).
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

/// Flash attention with a sliding window around the diagonal (`None` = unbounded side).
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

/// Flash attention with ALiBi (`alibi_slopes`: f32, `(heads,)` or `(batch, heads)`).
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

/// Flash attention with ALiBi and a sliding window.
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

/// Flash attention with optional ALiBi, a sliding window and a softcap (`0` = off).
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
/// `batch + 1`.
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

/// Variable-length flash attention with a sliding window.
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

/// Variable-length flash attention with ALiBi.
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

/// Variable-length flash attention with ALiBi and a sliding window.
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

/// Variable-length flash attention with optional ALiBi, a sliding window and a softcap.
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
