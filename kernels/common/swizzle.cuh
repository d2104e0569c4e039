// The shared-memory tiles of the sm_80 tensor-core kernels (forward, backward, decode): rows of
// 16-byte chunks permuted by an XOR swizzle so that the 8 rows one ldmatrix reads, and the
// cp.async stores of consecutive chunks, hit distinct bank groups; per-thread ldmatrix
// addressing into such tiles; and the cp.async copy of a tile from global memory.
#pragma once
#include <stdint.h>

#include "common/ptx.cuh"

namespace flash {

// Element offset of 16-byte chunk `c` of row `r` in a tile whose rows hold D elements
// (C = D / 8 chunks, C % 8 is 0 or 4 for every instantiated D). The first C8 = C & ~7 chunks
// are XOR-permuted by r & 7; a remaining half line of 4 chunks by (r >> 1) & 3. Either way, the 8
// rows of one ldmatrix (same logical chunk) land on 8 distinct 16-byte bank groups, and so do
// the cp.async stores of consecutive chunks.
template <int D>
__device__ __forceinline__ int swz(int r, int c) {
    constexpr int C = D / 8;
    constexpr int C8 = C & ~7;
    const int pc = c < C8 ? (c ^ (r & 7)) : (C8 + ((c - C8) ^ ((r >> 1) & 3)));
    return r * D + pc * 8;
}

// Per-thread ldmatrix addressing. A thread always reads row r_t + 16 i (i compile-time) at
// chunk 2 kk + hi; adding multiples of 8 to the row changes neither r & 7 nor (r >> 1) & 3. In the
// XOR-swizzled part, chunk (2 kk + hi) ^ (r & 7) = 8 (kk / 4) + (2 (kk % 4) ^ y) with the
// per-thread y = hi ^ (r & 7), so an offset is `row + (y8 ^ constant) + constant`: one XOR and
// one add per ldmatrix, and only two registers per operand (one when D % 64 == 0, where the row
// offset has no bits under 64 and y8 can be merged into it). The tail half line (C % 8 == 4)
// has two per-thread offsets of its own.
template <int D>
struct SwzRow {
    static constexpr int C = D / 8, C8 = C & ~7;
    static constexpr bool MERGED = D % 64 == 0;
    int row_;  // r_t * D (+ y8 when MERGED)
    int y8_;   // 8 * (hi ^ (r_t & 7)), in elements
    int tail_[C % 8 == 4 ? 2 : 1];
    __device__ __forceinline__ SwzRow(int r_t, int hi) {
        y8_ = 8 * (hi ^ (r_t & 7));
        row_ = r_t * D + (MERGED ? y8_ : 0);
        if constexpr (C % 8 == 4) {
#pragma unroll
            for (int i = 0; i < 2; ++i)
                tail_[i] = r_t * D + (C8 + ((2 * i + hi) ^ ((r_t >> 1) & 3))) * 8;
        }
    }
    // Element offset of chunk 2 kk + hi in row r_t + 16 i (kk, i compile-time after unrolling).
    __device__ __forceinline__ int at(int i, int kk) const {
        if (2 * kk < C8) {
            const int x = 16 * (kk % 4);  // (2 (kk % 4)) chunks, in elements
            const int c = (kk / 4) * 64 + i * 16 * D;
            return MERGED ? (row_ ^ x) + c : row_ + (y8_ ^ x) + c;
        }
        return tail_[(kk - C8 / 2) % 2] + i * 16 * D;
    }
};

// Copies ROWS x D elements (rows `row_stride` apart, columns contiguous) into a swizzled tile.
// Rows >= rows_valid and columns >= d_load are zero-filled, so tails need no special casing later.
template <typename T, int D, int ROWS, int THREADS>
__device__ __forceinline__ void load_tile(T* smem, const T* g, int64_t row_stride, int rows_valid,
                                          int d_load) {
    constexpr int C = D / 8;
    const int tid = tid_volatile();
    // Each thread keeps one column chunk and steps down the rows, RPI rows at a time: one
    // pointer increment per step, nothing hoisted per iteration.
    constexpr int RPI = THREADS / C;
    static_assert(RPI >= 1, "a row must fit in one pass of the block");
    const int r0 = tid / C, c = tid % C;
    const bool col_ok = c * 8 < d_load && r0 < RPI;
    const T* src = g + r0 * row_stride + c * 8;
#pragma unroll
    for (int it = 0; it < (ROWS + RPI - 1) / RPI; ++it) {
        const int r = r0 + it * RPI;
        if ((ROWS % RPI == 0 || r < ROWS) && (THREADS % C == 0 || r0 < RPI)) {
            const bool ok = col_ok && r < rows_valid;
            // A zero-byte copy reads nothing; point it at the tile base, which is always mapped.
            cp_async16(smem + swz<D>(r, c), ok ? src : g, ok ? 16 : 0);
        }
        src += RPI * row_stride;
    }
}

}  // namespace flash
