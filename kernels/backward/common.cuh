// What every backward kernel shares (the exact kernels of generic.cuh, the tensor-core ones of
// mma.cuh and the Hopper ones of sm90/bwd.cuh): where a query row's lse and D live, the lse in
// base 2, and the key tile of a dK/dV block with the query tiles whose rows see it.
#pragma once
#include "backward/params.cuh"
#include "common/mask.cuh"
#include "common/math.cuh"

namespace bwd {

// Index of (head h, row i of a sequence starting at q_row0) in the lse and dsum arrays.
__device__ __forceinline__ int64_t lse_index(const FlashParams& p, int b, int h, int64_t q_row0,
                                             int i) {
    return p.cu_q ? (int64_t)h * p.lse_head + q_row0 + i
                  : ((int64_t)b * p.heads + h) * p.seq_q + i;
}

// lse in base 2 with -inf (a row that sees no key) turned into +inf, so exp2(s - lse) = 0.
__device__ __forceinline__ float lse_log2(float lse) {
    return lse == -INFINITY ? INFINITY : lse * LOG2E_F;
}

// The key tile of a dK/dV block: keys [n0, n0 + rows_k) of sequence b and the BM-row query
// tiles [m_begin, m_begin + m_count) that hold a row seeing one of them (tiles outside a causal
// or window band are skipped). False when the tile starts past the sequence: its dK and dV rows
// stay zero.
struct KeyTile {
    int n0, rows_k, m_begin, m_count;
    int64_t off;  // sk - sq: query i's diagonal is i + off
};

template <int BN, int BM>
__device__ __forceinline__ bool key_tile(const FlashParams& p, int b, int n_block, BlockGeom& g,
                                         KeyTile& t) {
    seq_lengths<false>(p, b, g);
    t.n0 = n_block * BN;
    if (t.n0 >= g.sk) return false;
    t.rows_k = min(BN, g.sk - t.n0);
    t.off = (int64_t)g.sk - g.sq;
    int64_t i_lo = 0, i_hi = g.sq;
    if (p.win_right >= 0) i_lo = max((int64_t)0, t.n0 - t.off - p.win_right);
    if (p.win_left >= 0)
        i_hi = min((int64_t)g.sq, t.n0 + t.rows_k - 1 - t.off + p.win_left + 1);
    t.m_begin = (int)(i_lo / BM);
    t.m_count = i_hi > i_lo ? (int)((i_hi + BM - 1) / BM) - t.m_begin : 0;
    return true;
}

}  // namespace bwd
