// GQA packing of the decode kernels (decode/partial.cuh, decode/combine.cuh): the query heads
// sharing a K/V head and all their seq_q rows form the packed rows of a block, packed row r being
// query row i = r / group of head kvh * group + r % group.
#pragma once
#include "common/params.cuh"

namespace decode {

// Where a packed row lives: query row i of head h, or nothing (r >= group * sq).
struct PackedRow {
    int i, h;
    bool valid;
};
__device__ __forceinline__ PackedRow packed_row(const FlashParams& p, int m0, int r, int kvh,
                                                int sq) {
    const int pr = m0 + r;
    PackedRow x;
    x.i = pr / p.kv_group;
    x.h = kvh * p.kv_group + pr % p.kv_group;
    x.valid = x.i < sq;
    return x;
}

}  // namespace decode
