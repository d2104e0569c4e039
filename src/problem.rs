//! The validated geometry of one attention call, as every backend consumes it.
//!
//! Inputs may be any strided view; a [`Problem`] records where element `(b, i, h, x)` of q, k and
//! v lives, for the dense layout `(batch, seq, heads, head_dim)` and the packed varlen layout
//! `(total_tokens, heads, head_dim)` alike, so kernels need a single addressing scheme.

use candle::{bail, Layout, Result};

use crate::semantics::{ScoreMod, SeqMask, Window};
use crate::PlanOverride;

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

/// Cumulative sequence lengths of a varlen call: read to the host and checked for the CPU, or
/// left on the GPU (`device`) for the CUDA kernels, which read and clamp them there, so a CUDA
/// call makes no host round trip.
#[derive(Clone, Debug)]
pub(crate) struct VarLen {
    /// Sequences of the call.
    pub batch: usize,
    /// Host copies (empty when `device` is set).
    pub cu_q: Vec<u32>,
    pub cu_k: Vec<u32>,
    /// Longest sequence of each side: the actual maxima on the host, the caller's
    /// `max_seqlen_*` bounds on the GPU (which size the grid; kernels clamp to them).
    pub max_seqlen_q: usize,
    pub max_seqlen_k: usize,
    /// Rows of the packed k and v (unused for paged caches).
    pub total_k: usize,
    pub device: Option<OnDevice>,
    /// The query rows and keys of one sequence that a bias spans (its last two dimensions):
    /// the caller's `max_seqlen_q` and `max_seqlen_k` on every device (a KV-cache call: its new
    /// rows and the cache's capacity), where `max_seqlen_*` above may be the actual maxima.
    pub extent: (usize, usize),
}

impl VarLen {
    /// Every sequence holds `max_seqlen_q` query rows, as the host copies show (every KV-cache
    /// call): sequence `b` is rows `b * max_seqlen_q ..` of q and of the output.
    pub fn uniform_q(&self) -> bool {
        self.device.is_none()
            && self
                .cu_q
                .iter()
                .enumerate()
                .all(|(b, &c)| c as usize == b * self.max_seqlen_q)
    }
}

/// Lengths left on the GPU: u32 cumulative `cu_q` / `cu_k` (batch + 1), read by the CUDA backend.
#[derive(Clone, Debug)]
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) struct OnDevice {
    pub cu_q: candle::Tensor,
    pub cu_k: candle::Tensor,
}

/// A paged K/V cache: k and v are `(num_blocks, page, kv_heads, head_dim)` (their [`Strides`]
/// are dense, with `batch` the block stride and `seq` the row-in-page stride) and key `j` of
/// sequence `b` is row `j % page` of block `table[b * max_blocks + j / page]`.
///
/// A contiguous `(batch, max_len, kv_heads, head_dim)` cache with per-sequence lengths is the
/// same thing with `page = max_len` and block `b` for sequence `b`.
#[derive(Clone, Debug)]
pub(crate) struct Paged {
    pub page: usize,
    pub num_blocks: usize,
    pub max_blocks: usize,
    /// `batch × max_blocks` physical block indices, row-major. The entries a sequence's keys
    /// use (the first `⌈seq_k / page⌉` of its row) are checked to be `< num_blocks`; the rest
    /// are never read.
    pub table: Vec<u32>,
    /// On the GPU instead (then `table` is empty): i32 or u32 `(batch, max_blocks)`, never read
    /// on the host; kernels treat an index outside `[0, num_blocks)` as a block of zeros.
    // Read by the CUDA backend only.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub device_table: Option<candle::Tensor>,
}

/// Multimodal prefix ranges, `batch × max_ranges` `[start, end)` pairs (see
/// [`SeqMask`]); ranges with `start >= end` are kept and ignored.
#[derive(Clone, Debug)]
pub(crate) struct Prefix {
    pub max_ranges: usize,
    /// Host copy (empty when `device` is set).
    pub ranges: Vec<[i64; 2]>,
    /// On the GPU instead: i32 `(batch, max_ranges, 2)`.
    // Read by the CUDA backend only.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub device: Option<candle::Tensor>,
}

/// Where the keys of one sequence live: the one key-row addressing scheme of the CPU kernels.
/// [`at`](Self::at) gives the `(batch, row)` to pass to [`Strides::at`] for key `j`;
/// [`run`](Self::run) how many keys from `j` on follow each other along the seq axis, so dense
/// caches are addressed once per tile and paged ones once per page.
#[derive(Clone, Copy, Debug)]
pub(crate) struct KeyRows<'a> {
    b: usize,
    row0: usize,
    /// The sequence's block-table row and the page size, for paged caches.
    paged: Option<(&'a [u32], usize)>,
}

impl KeyRows<'_> {
    /// `(batch, row)` of key `j` for [`Strides::at`].
    #[inline(always)]
    pub fn at(&self, j: usize) -> (usize, usize) {
        match self.paged {
            None => (self.b, self.row0 + j),
            Some((table, page)) => (table[j / page] as usize, j % page),
        }
    }

    /// Keys `j .. j + run(j, n)` (at most `n`) are consecutive rows of one block.
    #[inline(always)]
    pub fn run(&self, j: usize, n: usize) -> usize {
        match self.paged {
            None => n,
            Some((_, page)) => n.min(page - j % page),
        }
    }
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
    /// K and V read through a block table (varlen calls only); `None`: packed or dense.
    pub paged: Option<Paged>,
    /// Multimodal prefix ranges; `None` when the call has none.
    pub prefix: Option<Prefix>,
    pub window: Window,
    pub score: ScoreMod,
    /// A KV-cache call on the GPU: each sequence's key count before this call (u32 or i32
    /// `(batch,)`, left on the device) and the keys the call appends; the kernels take the
    /// sequence lengths from it instead of `varlen.cu_k`.
    pub seqused_k: Option<(candle::Tensor, usize)>,
    /// Whether ALiBi slopes come with the call.
    pub has_alibi: bool,
    /// Attention sinks, f32 `(heads,)` on the inputs' device (see `FlashAttn::sinks`).
    pub sinks: Option<candle::Tensor>,
    /// Additive score bias, broadcastable to `(batch, heads, seq_q, seq_k)` (dense calls).
    pub bias: Option<candle::Tensor>,
    /// Block-sparse mask, u8 broadcastable to `(batch, heads, q blocks, k blocks)`, with its
    /// block sizes (dense calls).
    pub block_mask: Option<(candle::Tensor, usize, usize)>,
    /// FP8 K and V read as stored by the CUDA decode kernels: the f32 `(batch, kv_heads)`
    /// factors those kernels apply, q·k's (`q_descale · k_descale`) to the scores and
    /// `v_descale` to the output (absent: 1). Set by the FP8 lowering (`op::fp8`), `None`
    /// elsewhere.
    pub kv8_descales: Option<[Option<candle::Tensor>; 2]>,
    /// ALiBi slopes, `batch * heads` of them with batch stride `alibi_batch_stride` (0 when the
    /// slopes are per head only, or without ALiBi).
    pub alibi_batch_stride: usize,
    /// How the call may run: choices of speed, never of result.
    pub kernels: Kernels,
}

/// The caller's choices among kernels that compute the same result.
#[derive(Clone, Debug, Default)]
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) struct Kernels {
    /// The portable CUDA kernels even where the Hopper ones apply.
    pub portable: bool,
    /// Planner choices forced by a benchmark or test.
    pub overrides: PlanOverride,
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

    /// Where the keys of the `b`-th sequence pair (`seq = self.seq(b)`) live.
    #[inline]
    pub fn key_rows(&self, b: usize, seq: &Seq) -> KeyRows<'_> {
        match &self.paged {
            Some(pg) => KeyRows {
                b: 0,
                row0: 0,
                paged: Some((
                    &pg.table[b * pg.max_blocks..(b + 1) * pg.max_blocks],
                    pg.page,
                )),
            },
            None => KeyRows {
                b,
                row0: seq.k_row,
                paged: None,
            },
        }
    }

    /// The mask of the `b`-th sequence pair: the window plus its prefix ranges.
    #[inline]
    pub fn mask(&self, b: usize, seq: &Seq) -> SeqMask<'_> {
        let prefix = match &self.prefix {
            Some(pr) => &pr.ranges[b * pr.max_ranges..(b + 1) * pr.max_ranges],
            None => &[],
        };
        SeqMask {
            window: self.window,
            prefix,
            seq_q: seq.seq_q,
            seq_k: seq.seq_k,
        }
    }

    /// Strides of a k or v layout: dense for dense and paged calls, packed for varlen.
    pub fn kv_strides(&self, l: &Layout) -> Strides {
        if self.varlen.is_none() || self.paged.is_some() {
            Strides::dense(l)
        } else {
            Strides::packed(l)
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
        match (&self.varlen, &self.paged) {
            (_, Some(pg)) => (self.total_q, pg.page),
            (None, None) => (self.max_seq_q, self.max_seq_k),
            (Some(vl), None) => (self.total_q, vl.total_k),
        }
    }

    /// Batch entries along the storage's batch axis of q and of k/v (blocks for paged caches,
    /// one packed run for varlen).
    pub fn storage_batches(&self) -> (usize, usize) {
        let q = if self.varlen.is_some() { 1 } else { self.batch };
        (q, self.paged.as_ref().map_or(q, |pg| pg.num_blocks))
    }

    /// The layouts a backend receives must be the ones this problem was built from.
    pub fn check_layouts(&self, q: &Layout, k: &Layout, v: &Layout) -> Result<()> {
        let q_strides = match self.varlen {
            None => Strides::dense(q),
            Some(_) => Strides::packed(q),
        };
        if q_strides != self.q || self.kv_strides(k) != self.k || self.kv_strides(v) != self.v {
            bail!("flash-attn: operand layouts changed after validation")
        }
        Ok(())
    }

    /// Elements of q/k/v addressed by this problem must lie inside their storages; candle's
    /// layouts guarantee it, this double-checks before any unchecked kernel touches memory.
    pub fn check_bounds(&self, q_len: usize, k_len: usize, v_len: usize) -> Result<()> {
        let last_at = |s: &Strides, b: usize, rows: usize, heads: usize| -> usize {
            s.offset
                + b * s.batch
                + rows.saturating_sub(1) * s.seq
                + heads.saturating_sub(1) * s.head
                + self.head_dim.saturating_sub(1) * s.dim
        };
        let b_last = if self.varlen.is_some() {
            0
        } else {
            self.batch.saturating_sub(1)
        };
        let last = |s: &Strides, rows: usize, heads: usize| last_at(s, b_last, rows, heads);
        let (rows_q, rows_k) = self.storage_rows();
        if self.total_q == 0 || self.batch == 0 {
            return Ok(());
        }
        if let Some(pg) = &self.paged {
            // Every block the table may name (all were checked `< num_blocks`), every row.
            if rows_q > 0 && last(&self.q, rows_q, self.heads) >= q_len {
                bail!("flash-attn: q storage is smaller than its layout claims")
            }
            if pg.num_blocks > 0 && pg.page > 0 {
                let (nb, page) = (pg.num_blocks - 1, pg.page);
                if last_at(&self.k, nb, page, self.kv_heads) >= k_len {
                    bail!("flash-attn: k storage is smaller than its layout claims")
                }
                if last_at(&self.v, nb, page, self.kv_heads) >= v_len {
                    bail!("flash-attn: v storage is smaller than its layout claims")
                }
            }
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
