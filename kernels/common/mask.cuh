// Where a thread block works and what its rows may see: the sequence pair (dense or varlen),
// the query rows of the tile, the key range of the tile, and per-element visibility. The rules
// are those of src/semantics.rs: bottom-right aligned diagonal diag(i) = i + sk - sq, key j
// visible iff diag - left <= j <= diag + right (-1 = unbounded).
#pragma once
#include "params.cuh"

// Where one thread block works: sequence pair b, query head h, query rows [m0, m0 + rows).
struct BlockGeom {
    int sq, sk;          // lengths of this pair
    int m0, rows;        // first query row of the tile, valid rows in it (<= tile height)
    int64_t q_row0;      // first row of this pair along the seq axis of q (varlen) or 0
    int64_t k_row0;
    int64_t out_row0;    // first row of this pair in the contiguous output
    int64_t lse0;        // lse index of (h, row m0)
    int n_lo, n_hi;      // keys [n_lo, n_hi) seen by any row of the tile
    int slope_idx;       // index into alibi
};

// First row of sequence b in the contiguous output: its first row in the packed q (varlen),
// else b * seq_q.
__device__ __forceinline__ int64_t out_row0(const FlashParams& p, int b) {
    return p.cu_q ? (int64_t)min(p.cu_q[b], (uint32_t)p.total_q) : (int64_t)b * p.seq_q;
}

// Lengths come from the device (cu_q / cu_k / seqused_k are never read on the host), so they
// are clamped here: a sequence's rows stay inside the packed tensors (total_q, total_k) and its
// lengths inside the caller's max_seqlen bounds (seq_q, seq_k; for paged caches also the table's
// capacity). Bad lengths thus never read or write out of bounds; the rows of such a sequence get
// unspecified values. CACHE: the kernel also serves KV caches (per-sequence key counts, paged
// blocks); the prefill kernels never see those and skip their branches.
template <bool CACHE>
__device__ __forceinline__ void seq_lengths(const FlashParams& p, int b, BlockGeom& g) {
    if (p.cu_q) {
        // 32-bit: lengths and totals are below 2^31 (checked on the host).
        const uint32_t q0 = min(p.cu_q[b], (uint32_t)p.total_q);
        const uint32_t q1 = max(q0, min(p.cu_q[b + 1], (uint32_t)p.total_q));
        g.sq = (int)min(q1 - q0, (uint32_t)p.seq_q);
        g.q_row0 = q0;
        g.out_row0 = out_row0(p, b);
    } else {
        g.sq = p.seq_q;
        // Dense q, or varlen q whose sequences all hold seq_q rows (q_uniform: row b * seq_q
        // starts sequence b, no cu_q to read).
        g.q_row0 = p.q_uniform ? (int64_t)b * p.seq_q : 0;
        g.out_row0 = out_row0(p, b);
    }
    if (CACHE && p.seqused_k) {
        // Per-sequence key counts (a KV cache), plus rows appended by this call.
        const int64_t n = (int64_t)p.seqused_k[b] + p.k_add;
        g.sk = (int)max((int64_t)0, min(n, (int64_t)p.seq_k));
        g.k_row0 = 0;
    } else if (p.cu_k) {
        // Paged caches find their rows through the table (only the length counts, bounded by
        // the table's capacity in seq_k); packed keys must stay inside total_k.
        const bool paged = CACHE && p.block_table;
        const uint32_t cap = paged ? 0xffffffffu : (uint32_t)p.total_k;
        const uint32_t k0 = min(p.cu_k[b], cap);
        const uint32_t k1 = max(k0, min(p.cu_k[b + 1], cap));
        g.sk = (int)min(k1 - k0, (uint32_t)p.seq_k);
        g.k_row0 = paged ? 0 : k0;
    } else {
        g.sk = p.seq_k;
        g.k_row0 = 0;
    }
}

// Returns false when the tile lies past the end of its (varlen) sequence.
template <bool CACHE = false>
__device__ __forceinline__ bool block_geom(const FlashParams& p, int m_block, int tile_rows, int h,
                                           int b, BlockGeom& g) {
    seq_lengths<CACHE>(p, b, g);
    g.lse0 = p.cu_q || p.q_uniform ? (int64_t)h * p.lse_head + g.q_row0
                    : ((int64_t)b * p.heads + h) * p.seq_q;
    g.m0 = m_block * tile_rows;
    if (g.m0 >= g.sq) return false;
    g.rows = min(tile_rows, g.sq - g.m0);
    g.lse0 += g.m0;
    // Key range of the whole tile: both window ends grow with the row, so the first row bounds
    // the left end and the last row the right end (Window::key_range_rows).
    const int64_t diag_first = (int64_t)g.m0 + g.sk - g.sq;
    const int64_t diag_last = diag_first + g.rows - 1;
    int64_t lo = 0, hi = g.sk;
    if (p.win_left >= 0) lo = max((int64_t)0, min((int64_t)g.sk, diag_first - p.win_left));
    if (p.win_right >= 0) hi = max((int64_t)0, min((int64_t)g.sk, diag_last + p.win_right + 1));
    g.n_lo = (int)lo;
    g.n_hi = (int)max(hi, lo);
    g.slope_idx = b * p.alibi_batch + h;
    return true;
}

// True when every key of [k0, k0 + cols) is visible to every row of the tile and exists:
// such a tile is computed without a per-element mask (Window::covers).
__device__ __forceinline__ bool tile_is_full(const FlashParams& p, const BlockGeom& g, int k0,
                                             int cols) {
    if (k0 + cols > g.sk) return false;
    const int64_t diag_first = (int64_t)g.m0 + g.sk - g.sq;
    const int64_t diag_last = diag_first + g.rows - 1;
    if (p.win_left >= 0 && diag_last - p.win_left > k0) return false;
    if (p.win_right >= 0 && (int64_t)k0 + cols - 1 > diag_first + p.win_right) return false;
    return true;
}

// Key j visible from query row i (both relative to their sequence)?
// Window sides are clamped on the host to [-1, 2^30], so int arithmetic cannot overflow for
// sequences shorter than 2^30.
__device__ __forceinline__ bool visible(const FlashParams& p, int diag, int j, int sk) {
    if (j >= sk) return false;
    if (p.win_left >= 0 && j < diag - (int)p.win_left) return false;
    if (p.win_right >= 0 && j > diag + (int)p.win_right) return false;
    return true;
}

// `visible` as an interval: key j is visible from the row with diagonal `diag` iff
// lo <= j < hi, within [0, sk) (lo == hi when none is). row_keys widens it by prefix ranges.
struct KeySpan {
    int lo, hi;
};
__device__ __forceinline__ KeySpan window_keys(const FlashParams& p, int diag, int sk) {
    int64_t l = 0, h = sk;
    if (p.win_left >= 0) l = max((int64_t)0, min((int64_t)sk, (int64_t)diag - p.win_left));
    if (p.win_right >= 0) h = max((int64_t)0, min((int64_t)sk, (int64_t)diag + p.win_right + 1));
    return {(int)l, (int)max(h, l)};
}
// window_keys relative to `base` (a thread's first column, 0 <= base < 2^30): the key at column
// base + c is visible iff lo <= c < hi. Per-element masks then compare their column offset, a
// constant, against two per-row bounds instead of evaluating the window rules for every key.
__device__ __forceinline__ KeySpan key_span(const FlashParams& p, int diag, int sk, int base) {
    const KeySpan w = window_keys(p, diag, sk);
    return {w.lo - base, w.hi - base};
}
// The transpose of key_span, for masks along a row of queries (the backward's S^T tiles): the
// diagonals that see key `key` are [lo, hi); returned relative to `base`, lo clamped below at 0
// and hi above at 2^30, so a column at diagonal base + c (0 <= c < 2^30) is visible iff
// lo <= c < hi. lo - base < 2^31 fits: key < 2^30 and base > -2^30 (sequences are shorter).
__device__ __forceinline__ KeySpan diag_span(const FlashParams& p, int key, int sk, int base) {
    if (key >= sk) return {0, 0};
    int64_t lo = p.win_right >= 0 ? (int64_t)key - p.win_right : -(int64_t)1 << 40;
    int64_t hi = p.win_left >= 0 ? (int64_t)key + p.win_left + 1 : (int64_t)1 << 40;
    lo = max(lo - base, (int64_t)0);
    hi = max(min(hi - base, (int64_t)1 << 30), lo);
    return {(int)lo, (int)hi};
}

// Keys [lo, hi) the row with diagonal `diag` of sequence b sees: its window, widened by every
// multimodal prefix range that holds the diagonal (SeqMask::row_range: the union is one interval,
// since the window and every such range contain the diagonal, clamped to [0, sk)).
__device__ __forceinline__ void row_keys(const FlashParams& p, int b, int diag, int sk, int& lo,
                                         int& hi) {
    const KeySpan w = window_keys(p, diag, sk);
    int64_t l = w.lo, h = w.hi;
    if (p.prefix) {
        for (int r = 0; r < p.max_ranges; ++r) {
            const int64_t s = p.prefix[((int64_t)b * p.max_ranges + r) * 2];
            const int64_t e = p.prefix[((int64_t)b * p.max_ranges + r) * 2 + 1];
            if (!(s <= diag && diag < e)) continue;
            const int64_t a = max((int64_t)0, min(s, (int64_t)sk));
            const int64_t z = max((int64_t)0, min(e, (int64_t)sk));
            if (a >= z) continue;
            if (l >= h) {
                l = a;
                h = z;
            } else {
                l = min(l, a);
                h = max(h, z);
            }
        }
    }
    lo = (int)l;
    hi = (int)max(h, l);
}

// Address of element (key j, column 0) of K/V head `kvh` for sequence b: through the block
// table for paged caches (an index outside [0, num_blocks) yields null: the row reads as zeros),
// else `base` (the sequence's first row) plus j rows.
template <typename T>
__device__ __forceinline__ const T* key_row(const FlashParams& p, const T* base, const T* cache,
                                            int64_t batch_stride, int64_t seq_stride,
                                            int64_t head_off, int b, int j) {
    if (!p.block_table) return base + (int64_t)j * seq_stride;
    // Power-of-two pages (vLLM's 16, upstream's multiples of 32 mostly) shift instead of divide:
    // this runs once per row of every K/V tile.
    const int pg = p.page_shift >= 0 ? j >> p.page_shift : j / p.page;
    const int row = p.page_shift >= 0 ? j & (p.page - 1) : j % p.page;
    const int blk = p.block_table[(int64_t)b * p.max_blocks + pg];
    if (blk < 0 || blk >= p.num_blocks) return nullptr;
    return cache + (int64_t)blk * batch_stride + (int64_t)row * seq_stride + head_off;
}
