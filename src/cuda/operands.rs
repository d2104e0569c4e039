//! Which operands a kernel can read in place: the tensor-core kernels copy 16-byte chunks of
//! rows, the tensor maps of the Hopper kernels take no zero stride. The others are packed into
//! a contiguous copy first (`runtime::operands`).

use crate::problem::{Problem, Strides};

/// Operands (q, k, v) of `p` that must be packed for a kernel reading 16-byte row chunks, and
/// through tensor maps when `tma`.
pub(crate) fn pack_flags(p: &Problem, tma: bool) -> [bool; 3] {
    let (q_rows, k_rows) = p.storage_rows();
    let (q_batch, k_batch) = p.storage_batches();
    let in_place = |s: &Strides, batch: usize, rows: usize, heads: usize| {
        chunk_aligned(p, s, batch, rows, heads) && !(tma && has_zero_stride(s, batch, rows, heads))
    };
    [
        !in_place(&p.q, q_batch, q_rows, p.heads),
        !in_place(&p.k, k_batch, k_rows, p.kv_heads),
        !in_place(&p.v, k_batch, k_rows, p.kv_heads),
    ]
}

/// Can a kernel that copies 16-byte chunks of rows read this operand in place? The head dim must
/// be a multiple of 8 with unit stride and every row 16-byte aligned.
fn chunk_aligned(p: &Problem, s: &Strides, batch: usize, rows: usize, heads: usize) -> bool {
    let aligned = |stride: usize, n: usize| n <= 1 || stride.is_multiple_of(8);
    p.head_dim.is_multiple_of(8)
        && (s.dim == 1 || p.head_dim == 1)
        && s.offset.is_multiple_of(8)
        && aligned(s.batch, batch)
        && aligned(s.seq, rows)
        && aligned(s.head, heads)
}

/// Can the FP8 decode kernels read K and V of `p` in place (16-byte chunks of one-byte
/// elements)? The head dim must be a multiple of 16 with unit stride and every row 16-byte
/// aligned. (They never pack.)
pub(crate) fn chunk_aligned_8bit(p: &Problem) -> bool {
    let (_, k_rows) = p.storage_rows();
    let (_, k_batch) = p.storage_batches();
    let aligned = |stride: usize, n: usize| n <= 1 || stride.is_multiple_of(16);
    let ok = |s: &Strides| {
        s.dim == 1
            && s.offset.is_multiple_of(16)
            && aligned(s.batch, k_batch)
            && aligned(s.seq, k_rows)
            && aligned(s.head, p.kv_heads)
    };
    p.head_dim.is_multiple_of(16) && ok(&p.k) && ok(&p.v)
}

/// Does an axis of more than one element have stride 0 (a broadcast view)?
pub(crate) fn has_zero_stride(s: &Strides, batch: usize, rows: usize, heads: usize) -> bool {
    [(s.batch, batch), (s.seq, rows), (s.head, heads)]
        .iter()
        .any(|&(stride, n)| n > 1 && stride == 0)
}
