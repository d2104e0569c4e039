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

// Returns false when the tile lies past the end of its (varlen) sequence.
__device__ __forceinline__ bool block_geom(const FlashParams& p, int m_block, int tile_rows, int h,
                                           int b, BlockGeom& g) {
    if (p.cu_q) {
        const int64_t q0 = p.cu_q[b], k0 = p.cu_k[b];
        g.sq = (int)(p.cu_q[b + 1] - q0);
        g.sk = (int)(p.cu_k[b + 1] - k0);
        g.q_row0 = q0;
        g.k_row0 = k0;
        g.out_row0 = q0;
        g.lse0 = (int64_t)h * p.lse_head + q0;
    } else {
        g.sq = p.seq_q;
        g.sk = p.seq_k;
        g.q_row0 = 0;
        g.k_row0 = 0;
        g.out_row0 = (int64_t)b * p.seq_q;
        g.lse0 = ((int64_t)b * p.heads + h) * p.seq_q;
    }
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

