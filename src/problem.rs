//! The validated geometry of one attention call, as every backend consumes it.
//!
//! Inputs may be any strided view; a [`Problem`] records where element `(b, i, h, x)` of q, k and
//! v lives, for the dense layout `(batch, seq, heads, head_dim)` and the packed varlen layout
//! `(total_tokens, heads, head_dim)` alike, so kernels need a single addressing scheme.

use candle::{bail, Layout, Result};

use crate::semantics::{ScoreMod, Window};

/// Element strides of a rank-4 `(batch, seq, head, dim)` view plus its start offset.
/// For varlen inputs `batch` is 0 and sequences start at their cumulative row.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Strides {
    pub offset: usize,
    pub batch: usize,
    pub seq: usize,
    pub head: usize,
    pub dim: usize,
}

impl Strides {
    pub fn dense(layout: &Layout) -> Self {
        let s = layout.stride();
        Self {
            offset: layout.start_offset(),
            batch: s[0],
            seq: s[1],
            head: s[2],
            dim: s[3],
        }
    }

    pub fn packed(layout: &Layout) -> Self {
        let s = layout.stride();
        Self {
            offset: layout.start_offset(),
            batch: 0,
            seq: s[0],
            head: s[1],
            dim: s[2],
        }
    }

    /// Index of element `(b, row, h, 0)`, with `row` counted from the sequence's first row.
    #[inline(always)]
    pub fn at(&self, b: usize, row: usize, h: usize) -> usize {
        self.offset + b * self.batch + row * self.seq + h * self.head
    }
}

/// One sequence pair of the batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Seq {
    /// Queries and keys of this pair.
    pub seq_q: usize,
    pub seq_k: usize,
    /// First row of this pair in the q (and output) / k, v storage along the seq axis.
    pub q_row: usize,
    pub k_row: usize,
    /// Row of this pair's first query in the contiguous output.
    pub out_row: usize,
    /// Index of `lse[h = 0][i = 0]` for this pair; heads are `lse_head_stride` apart.
    pub lse_base: usize,
}

/// Cumulative sequence lengths of a varlen call, read to the host and checked.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct VarLen {
    pub cu_q: Vec<u32>,
    pub cu_k: Vec<u32>,
    /// Longest sequence of each side (at most the caller's `max_seqlen_*`, which is checked).
    pub max_seqlen_q: usize,
    pub max_seqlen_k: usize,
}

/// Everything a backend needs to run one call.
#[derive(Clone, Debug)]
pub(crate) struct Problem {
    pub batch: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// Dense: `seq_q`/`seq_k` of every pair. Varlen: the maxima.
    pub max_seq_q: usize,
    pub max_seq_k: usize,
    /// Rows of the output (`batch * seq_q` dense, `total_q` varlen).
    pub total_q: usize,
    pub q: Strides,
    pub k: Strides,
    pub v: Strides,
    pub varlen: Option<VarLen>,
    pub window: Window,
    pub score: ScoreMod,
    /// Whether ALiBi slopes come with the call.
    pub has_alibi: bool,
    /// ALiBi slopes, `batch * heads` of them with batch stride `alibi_batch_stride` (0 when the
    /// slopes are per head only, or without ALiBi).
    pub alibi_batch_stride: usize,
}

impl Problem {
    /// The `b`-th sequence pair.
    #[inline]
    pub fn seq(&self, b: usize) -> Seq {
        match &self.varlen {
            None => Seq {
                seq_q: self.max_seq_q,
                seq_k: self.max_seq_k,
                q_row: 0,
                k_row: 0,
                out_row: b * self.max_seq_q,
                lse_base: b * self.heads * self.max_seq_q,
            },
            Some(vl) => {
                let (q0, q1) = (vl.cu_q[b] as usize, vl.cu_q[b + 1] as usize);
                let (k0, k1) = (vl.cu_k[b] as usize, vl.cu_k[b + 1] as usize);
                Seq {
                    seq_q: q1 - q0,
                    seq_k: k1 - k0,
                    q_row: q0,
                    k_row: k0,
                    out_row: q0,
                    lse_base: q0,
                }
            }
        }
    }

    /// Distance between heads in the log-sum-exp output: `(batch, heads, seq_q)` dense,
    /// `(heads, total_q)` varlen.
    pub fn lse_head_stride(&self) -> usize {
        match self.varlen {
            None => self.max_seq_q,
            Some(_) => self.total_q,
        }
    }

    /// Shape of the log-sum-exp output.
    pub fn lse_shape(&self) -> Vec<usize> {
        match self.varlen {
            None => vec![self.batch, self.heads, self.max_seq_q],
            Some(_) => vec![self.heads, self.total_q],
        }
    }

    /// Shape of the output (that of q, contiguous).
    pub fn out_shape(&self) -> Vec<usize> {
        match self.varlen {
            None => vec![self.batch, self.max_seq_q, self.heads, self.head_dim],
            Some(_) => vec![self.total_q, self.heads, self.head_dim],
        }
    }

    /// Rows of q and of k/v along their storage's seq axis: per batch entry for dense calls,
    /// all packed tokens for varlen.
    pub fn storage_rows(&self) -> (usize, usize) {
        match &self.varlen {
            None => (self.max_seq_q, self.max_seq_k),
            Some(vl) => (
                *vl.cu_q.last().unwrap_or(&0) as usize,
                *vl.cu_k.last().unwrap_or(&0) as usize,
            ),
        }
    }

    /// The layouts a backend receives must be the ones this problem was built from.
    pub fn check_layouts(&self, q: &Layout, k: &Layout, v: &Layout) -> Result<()> {
        let strides = |l: &Layout| match self.varlen {
            None => Strides::dense(l),
            Some(_) => Strides::packed(l),
        };
        if strides(q) != self.q || strides(k) != self.k || strides(v) != self.v {
            bail!("flash-attn: operand layouts changed after validation")
        }
        Ok(())
    }

    /// Elements of q/k/v addressed by this problem must lie inside their storages; candle's
    /// layouts guarantee it, this double-checks before any unchecked kernel touches memory.
    pub fn check_bounds(&self, q_len: usize, k_len: usize, v_len: usize) -> Result<()> {
        let last = |s: &Strides, rows: usize, heads: usize| -> usize {
            let b = if self.varlen.is_some() {
                0
            } else {
                self.batch.saturating_sub(1)
            };
            s.offset
                + b * s.batch
                + rows.saturating_sub(1) * s.seq
                + heads.saturating_sub(1) * s.head
                + self.head_dim.saturating_sub(1) * s.dim
        };
        let (rows_q, rows_k) = self.storage_rows();
        if self.total_q == 0 || self.batch == 0 {
            return Ok(());
        }
        if rows_q > 0 && last(&self.q, rows_q, self.heads) >= q_len {
            bail!("flash-attn: q storage is smaller than its layout claims")
        }
        if rows_k > 0 && last(&self.k, rows_k, self.kv_heads) >= k_len {
            bail!("flash-attn: k storage is smaller than its layout claims")
        }
        if rows_k > 0 && last(&self.v, rows_k, self.kv_heads) >= v_len {
            bail!("flash-attn: v storage is smaller than its layout claims")
        }
        Ok(())
    }
}
