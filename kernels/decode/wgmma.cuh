// The decode kernel's tile products on Hopper's warpgroup MMA (sm_90a modules only,
// kernels/decode/decode_sm90.cu): for instances of 64 or 128 packed rows, whose products, not
// their bytes, bound them on mma.sync (128 packed rows do 128 flops per byte of K and V).
//
// Four warps make a warpgroup and own its 64 rows; warp w of it holds rows 16 w .. 16 w + 15
// of the m64 accumulators in the mma.sync C layout, so the scores, the online softmax and P as
// A fragments (decode/partial.cuh) are the same registers either way. Q, K and V lie in shared
// memory as wgmma reads them with its 128-byte swizzle (canon_off): D / 64 column chunks of
// [rows][64] elements, 16-byte chunks XOR-permuted by the row within each 8-row, 1024-byte
// atom.
//   S = Q K^T:   A = Q, B = K, both K-major (descriptors), D / 16 k16 steps, N = the keys.
//   O += P V:    A = P from registers, B = V as stored, MN-major (64-column chunks `keys`
//                rows apart), one k16 step per 16 keys, N = D.
// The copies land by cp.async (the generic proxy); the key loop fences them to the async proxy
// before its barrier (fence_copies), and each product is waited for before its registers are
// read or its tile is overwritten.
#pragma once
#include "sm90/ptx.cuh"

namespace decode {

// Element offset of 16-byte chunk c of row r in an R-row tile laid out for wgmma.
template <int R>
__device__ __forceinline__ int canon_off(int r, int c) {
    return (c / 8) * R * 64 + r * 64 + ((c % 8) ^ (r % 8)) * 8;
}

// Makes this thread's landed cp.async copies visible to wgmma's reads (before a barrier).
__device__ __forceinline__ void fence_copies() { sm90::proxy_fence(); }

// Issues s = Q K^T for the warpgroup's 64 rows (Q: the block's ROWS-row tile, from row r0) and
// the KW keys of the K tile (KW rows), as one wgmma group; wg_settle before reading s.
template <typename T, int D, int ROWS, int KW>
__device__ __forceinline__ void wg_scores_issue(float (&s)[KW / 8][4], const T* sQ, int r0,
                                                const T* sK) {
    using namespace sm90;
    const uint64_t dq = make_desc(saddr(sQ) + r0 * 128, 16, 1024);
    const uint64_t dk = make_desc(saddr(sK), 16, 1024);
    float* acc = &s[0][0];
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
        // k16 steps of 32 bytes, four to a 128-byte row of a column chunk.
        const uint64_t da = dq + (uint64_t)(((kk / 4) * ROWS * 128 + (kk % 4) * 32) >> 4);
        const uint64_t db = dk + (uint64_t)(((kk / 4) * KW * 128 + (kk % 4) * 32) >> 4);
        mma_ss<T, KW>(acc, da, db, kk > 0);
    }
    wg_commit();
}

// Issues o += P V for the KW keys of the V tile (KW rows), P as A fragments (one k16 step
// each), as one wgmma group; pa and o stay untouched until it is waited for.
template <typename T, int D, int KW>
__device__ __forceinline__ void wg_pv_issue(float (&o)[D / 8][4],
                                            const uint32_t (&pa)[KW / 16][4], const T* sV) {
    using namespace sm90;
    const uint64_t dv = make_desc(saddr(sV), KW * 128, 1024);
    float* acc = &o[0][0];
#pragma unroll
    for (int ks = 0; ks < KW / 16; ++ks)
        mma_rs<T, D>(acc, pa[ks], dv + (uint64_t)((ks * 16 * 128) >> 4), 1);
    wg_commit();
}

// Waits until at most N of the warpgroup's wgmma groups are pending; the compiler keeps the
// accumulators' reads after it.
template <int N, int R>
__device__ __forceinline__ void wg_settle(float (&acc)[R][4]) {
    sm90::wg_wait<N>();
    sm90::reg_fence(reinterpret_cast<float(&)[4 * R]>(acc));
}

}  // namespace decode
