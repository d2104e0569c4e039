// Shared by every flash kernel: the launch parameters (mirrored by `Params` in src/cuda.rs) and
// the per-block geometry (which sequence pair, which query rows, which keys they may see), so the
// f16/bf16 tensor-core kernel and the f32 FFMA kernel agree on masking, GQA and varlen addressing.
// The semantics are those of src/semantics.rs: bottom-right aligned diagonal diag(i) = i + sk - sq,
// key j visible iff diag - left <= j <= diag + right (-1 = unbounded), softcap then ALiBi.
#pragma once
#include <stdint.h>

// One struct instead of dozens of positional arguments. 8-byte fields first, so the C and Rust
// (`#[repr(C)]`) layouts agree without relying on padding rules.
struct FlashParams {
    const void* q;  // element (0, 0, 0, 0) of each operand (view offset already applied)
    const void* k;
    const void* v;
    void* o;               // contiguous (rows, heads, d_out)
    float* lse;            // natural-log log-sum-exp, f32
    const float* alibi;    // slopes or null
    const uint32_t* cu_q;  // varlen cumulative lengths (batch + 1) or null for dense
    const uint32_t* cu_k;
    // Element strides (64-bit: large tensors overflow 32-bit offsets).
    int64_t q_batch, q_seq, q_head, q_dim;
    int64_t k_batch, k_seq, k_head, k_dim;
    int64_t v_batch, v_seq, v_head, v_dim;
    int64_t o_seq, o_head;  // output strides (o_dim is 1)
    int64_t lse_head;       // distance between heads in lse
    int64_t win_left;       // keys visible left of the diagonal, -1 = unbounded
    int64_t win_right;      // keys visible right of the diagonal, -1 = unbounded
    int32_t seq_q, seq_k;   // dense lengths (varlen reads cu_q / cu_k)
    int32_t heads;
    int32_t kv_group;       // heads / kv_heads: query heads sharing one K/V head
    int32_t d_load;         // columns read from q/k/v (the rest of the tile is zero-filled)
    int32_t d_out;          // columns written to o
    float scale_log2;       // softmax_scale * log2(e): scores live in base 2
    float softcap;          // 0 = off
    float scale_over_cap;   // softmax_scale / softcap
    float cap_log2;         // softcap * log2(e)
    int32_t alibi_batch;    // batch stride of the slopes (0 = per head)
    int32_t pad_;
};

#define LOG2E_F 1.4426950408889634f
#define LN2_F 0.6931471805599453f

__device__ __forceinline__ float fast_exp2(float x) {
    // ex2.approx: ~2 ulp, exp2(-inf) = +0, which is what masked scores need.
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

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

// tanh(x) = 1 - 2 / (exp(2x) + 1). The absolute error stays near f32 epsilon over the whole
// range (what matters for a score), and it is far lighter on registers than tanhf when unrolled
// over a whole score tile. exp(2x) overflowing to inf gives exactly 1, underflowing to 0 gives -1.
__device__ __forceinline__ float tanh_fast(float x) {
    return 1.f - __fdividef(2.f, fast_exp2(x * (2.f * LOG2E_F)) + 1.f);
}

// Softcap and ALiBi on a raw dot product, result in base 2 (multiplied by log2 e).
// `diag` is the row's diagonal, `j` the key.
__device__ __forceinline__ float modded_score(const FlashParams& p, float dot, float slope_log2,
                                              int diag, int j) {
    float x = p.softcap > 0.f ? p.cap_log2 * tanh_fast(dot * p.scale_over_cap) : dot * p.scale_log2;
    x -= slope_log2 * (float)abs(diag - j);
    return x;
}
