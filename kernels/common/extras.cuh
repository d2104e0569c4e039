// The additive bias and the block-sparse mask (FlashAttn::bias, FlashAttn::block_mask), in the
// order of src/semantics.rs: s = softcap(scale q.k) - ALiBi + bias, then the masks. Both are read
// in place through broadcast strides (0 along a broadcast dimension), so a key-padding bias
// (batch, 1, 1, seq_k) costs one vector per batch.
//
// Block masks and key biases (a bias without a row dimension, such as key padding) reach the
// tiled kernels as lists (built by kernels/tiles.cu for the kernel's tile shape): per (batch,
// head, query tile), the key tiles of the band that hold any key of an open block and any key
// whose bias is not -inf, in order. A hidden tile is neither loaded nor computed; a tile that a
// hidden block also cuts is flagged TILE_PARTIAL and masked per element; a tile whose bias is
// not 0 everywhere is flagged TILE_BIAS and gets it added (so padding costs only the tiles it
// cuts). Without a list a kernel walks its band and adds the bias on every tile.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common/mask.cuh"
#include "common/math.cuh"

// A tile-list entry: the key tile's index, the flag of a tile a hidden block cuts, and the flag
// of a tile whose bias must be added.
constexpr int TILE_PARTIAL = 1 << 30;
constexpr int TILE_BIAS = 1 << 29;
constexpr int TILE_INDEX = TILE_BIAS - 1;
__device__ __forceinline__ int tile_of(int e) { return e & TILE_INDEX; }
__device__ __forceinline__ bool tile_partial(int e) { return (e & TILE_PARTIAL) != 0; }

// The key tiles one query tile computes, at positions [begin, end): LIST, the entries of the
// block mask's list (begin 0); otherwise the band's tiles, whose position is the tile index (so
// the plain instances keep the loops they had before lists existed).
template <bool LIST>
struct KeyTiles {
    const int32_t* list;
    int begin, end;
    // The entry at position q, its tile index, whether a hidden block cuts that tile, and
    // whether the call's bias is added on it (every tile without a list).
    __device__ __forceinline__ int entry(int q) const { return LIST && list ? list[q] : q; }
    __device__ __forceinline__ int tile(int e) const { return LIST ? tile_of(e) : e; }
    __device__ __forceinline__ bool partial(int e) const { return LIST && tile_partial(e); }
    __device__ __forceinline__ bool biased(int e) const {
        return !LIST || !list || (e & TILE_BIAS) != 0;
    }
};

// Index of the list of query tile m_block of (b, h).
__device__ __forceinline__ int64_t tile_list(const FlashParams& p, int b, int h, int m_block) {
    return ((int64_t)b * p.tiles_b + (int64_t)h * p.tiles_h) * p.q_tiles + m_block;
}

// The band's key tiles (BC keys each) of the query tile with geometry g.
__device__ __forceinline__ KeyTiles<false> band_tiles(const BlockGeom& g, int bc) {
    const int t_begin = g.n_lo / bc;
    const int t_end = g.n_hi > g.n_lo ? (g.n_hi + bc - 1) / bc : t_begin;
    return {nullptr, t_begin, t_end};
}

// The key tiles of query tile m_block of (b, h): LIST, the block mask's list where the call has
// one; otherwise, or without a list, the band.
template <bool LIST>
__device__ __forceinline__ KeyTiles<LIST> key_tiles(const FlashParams& p, const BlockGeom& g,
                                                    int b, int h, int m_block, int bc) {
    const KeyTiles<false> band = band_tiles(g, bc);
    if (!LIST || !p.tiles) return {nullptr, band.begin, band.end};
    const int64_t l = tile_list(p, b, h, m_block);
    return {p.tiles + l * p.k_tiles, 0, p.tile_count[l]};
}

__device__ __forceinline__ float extra_f32(float x) { return x; }
__device__ __forceinline__ float extra_f32(__half x) { return __half2float(x); }
__device__ __forceinline__ float extra_f32(__nv_bfloat16 x) { return __bfloat162float(x); }

// Bias element `off` (f32, or the inputs' type T).
template <typename T>
__device__ __forceinline__ float bias_value(const FlashParams& p, int64_t off) {
    return p.bias_f32 ? static_cast<const float*>(p.bias)[off]
                      : extra_f32(static_cast<const T*>(p.bias)[off]);
}

// Offsets of (b, h, row i) into the bias and the block mask. Rows and keys past the sequence
// (the tail of a tile, whose scores are masked or never stored) read the last ones, so nothing
// outside the tensors is touched.
__device__ __forceinline__ int64_t bias_row(const FlashParams& p, int b, int h, int i, int sq) {
    return (int64_t)b * p.bias_b + (int64_t)h * p.bias_h + (int64_t)min(i, sq - 1) * p.bias_q;
}
__device__ __forceinline__ int64_t bias_col(const FlashParams& p, int j, int sk) {
    return (int64_t)min(j, sk - 1) * p.bias_k;
}
__device__ __forceinline__ int64_t blocks_row(const FlashParams& p, int b, int h, int i, int sq) {
    return (int64_t)b * p.bm_b + (int64_t)h * p.bm_h + (int64_t)(min(i, sq - 1) / p.block_q) * p.bm_q;
}
__device__ __forceinline__ bool block_open(const FlashParams& p, int64_t row, int j, int sk) {
    return p.block_mask[row + (int64_t)(min(j, sk - 1) / p.block_k) * p.bm_k] != 0;
}

// One score of row i, key j (after softcap and ALiBi; base 2, or natural-log units for `natural`)
// with the bias added (`bias`: the tile's list entry asks for it) and the block mask applied
// (`blocks`: the key's block may be hidden).
template <typename T>
__device__ __forceinline__ float extra_score(const FlashParams& p, float s, int b, int h, int i,
                                             int j, int sq, int sk, bool blocks, bool bias = true,
                                             bool natural = false) {
    if (p.bias && bias) {
        const float x = bias_value<T>(p, bias_row(p, b, h, i, sq) + bias_col(p, j, sk));
        s += natural ? x : x * LOG2E_F;
    }
    if (blocks && !block_open(p, blocks_row(p, b, h, i, sq), j, sk)) s = -INFINITY;
    return s;
}

// Bias element x of a row at `row` (f32, or the inputs' type T).
template <typename T>
__device__ __forceinline__ float bias_elem(const FlashParams& p, const void* row, int64_t x) {
    if (sizeof(T) == 4 || p.bias_f32) return __ldg(static_cast<const float*>(row) + x);
    return extra_f32(static_cast<const T*>(row)[x]);
}

// Bias values go through registers BATCH n8 tiles (2 BATCH values) at a time: their loads are in
// flight together, and a compiler barrier between batches keeps the compiler from hoisting all
// of a tile's loads ahead of their adds, which the score tiles have no registers for (a batch of
// 8 spilled in the d 256 Hopper instance).
constexpr int BIAS_BATCH = 4;

// Adds bias_unit times the bias of keys j0 + 8 j + e (j < NT, e < 2) of one row at `row` to
// the scores s[4 j + e] and, for `both`, to s[4 j + 2 + e] too (the row 8 below, same keys).
template <typename T, int NT>
__device__ __forceinline__ void add_bias_row(const FlashParams& p, float* s, const char* row,
                                             int j0, int sk, float bias_unit, bool both) {
#pragma unroll
    for (int jb = 0; jb < NT; jb += BIAS_BATCH) {
        float x[BIAS_BATCH][2];
#pragma unroll
        for (int jj = 0; jj < BIAS_BATCH; ++jj)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int c = j0 + 8 * (jb + jj) + e;
                x[jj][e] = jb + jj < NT && c < sk ? bias_elem<T>(p, row, c * p.bias_k) : 0.f;
            }
#pragma unroll
        for (int jj = 0; jj < BIAS_BATCH; ++jj)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                if (jb + jj >= NT) continue;
                s[4 * (jb + jj) + e] += x[jj][e] * bias_unit;
                if (both) s[4 * (jb + jj) + 2 + e] += x[jj][e] * bias_unit;
            }
        asm volatile("" ::: "memory");
    }
}

// The open keys of one row among a thread's columns of a key tile under the block mask: bit
// j + 32 e for the column c0 + 8 j + e (j < 32), from one read per key block the tile touches.
// Keys past the sequence are left open (the window mask hides them).
__device__ __forceinline__ uint64_t open_columns(const FlashParams& p, int64_t row, int k0,
                                                 int k1, int c0, int sk) {
    uint64_t bits = ~0ull;
    const int kend = min(k1, sk);
    for (int kb = k0 / p.block_k; kb * p.block_k < kend; ++kb) {
        if (p.block_mask[row + (int64_t)kb * p.bm_k] != 0) continue;
        // Hidden keys [lo, hi): for each e, the j with lo <= c0 + 8 j + e < hi.
        const int lo = max(kb * p.block_k, k0), hi = min((kb + 1) * p.block_k, kend);
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const int ja = max(0, (lo - c0 - e + 7) >> 3);
            const int jb = min(32, max(0, (hi - c0 - e + 7) >> 3));
            if (ja < jb) {
                const uint64_t range = (jb == 32 ? 0xffffffffull : ((1ull << jb) - 1)) &
                                       ~((1ull << ja) - 1);
                bits &= ~(range << (32 * e));
            }
        }
    }
    return bits;
}

// The bias and block mask on a score tile in the mma accumulator layout: MT slices of NT n8
// tiles, element (mt, j, e) at s[(mt NT + j) 4 + e] holding row i0 + 16 mt + 8 (e / 2), key
// j0 + 8 j + e % 2, of a tile of keys [k0, k0 + BC), in units where a bias value b adds
// b * bias_unit (log2 e for base-2 logits; log2 e / scale_log2 for raw dot products that the
// softmax scales later). Rows and keys past the sequence read nothing (their scores are masked
// or never stored). A bias that does not vary along the rows (stride 0: key padding, per-key
// terms) is read once per key for all of the thread's rows. `bias`: add the bias here (false
// where the caller has added it already).
template <typename T, int MT, int NT>
__device__ __forceinline__ void tile_extras(const FlashParams& p, float* s, int b, int h, int i0,
                                            int j0, int k0, int sq, int sk, bool partial,
                                            float bias_unit, bool bias = true) {
    static_assert(NT <= 32, "open_columns holds 32 n8 tiles");
    if (bias && p.bias) {
        const int esize = sizeof(T) == 4 || p.bias_f32 ? 4 : 2;
        const char* base = static_cast<const char*>(p.bias) +
                           ((int64_t)b * p.bias_b + (int64_t)h * p.bias_h) * esize;
        if (p.bias_q == 0) {
            // One value per key for both rows of each slice.
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
                add_bias_row<T, NT>(p, s + mt * NT * 4, base, j0, sk, bias_unit, true);
        } else {
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int hf = 0; hf < 2; ++hf) {
                    const int i = i0 + 16 * mt + 8 * hf;
                    if (i < sq)
                        add_bias_row<T, NT>(p, s + mt * NT * 4 + 2 * hf,
                                            base + (int64_t)i * p.bias_q * esize, j0, sk,
                                            bias_unit, false);
                }
        }
    }
    if (partial) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
                const uint64_t open = open_columns(
                    p, blocks_row(p, b, h, i0 + 16 * mt + 8 * hf, sq), k0, k0 + 8 * NT, j0, sk);
#pragma unroll
                for (int j = 0; j < NT; ++j)
#pragma unroll
                    for (int e = 0; e < 2; ++e)
                        if (!((open >> (j + 32 * e)) & 1))
                            s[(mt * NT + j) * 4 + 2 * hf + e] = -INFINITY;
            }
    }
}
