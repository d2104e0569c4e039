// The key tiles each query tile computes under a block-sparse mask or a key bias, for a forward
// kernel whose tiles are BR query rows by BC keys (see common/extras.cuh): per (list batch, list
// head, query tile), the key tiles of the tile's band (common/mask.cuh: causal and window
// bounds) that hold any key of an open block and any key whose bias is not -inf, in increasing
// order. A tile is flagged TILE_PARTIAL when a hidden block cuts it too, and TILE_BIAS when its
// bias must be added: every tile under a bias with a row dimension; under a key bias (no row
// dimension, such as key padding) the tiles whose keys' bias is not 0 everywhere. Grid: (query
// tiles / WARPS, list heads, list batches), one warp per query tile; its 32 lanes judge 32 key
// tiles at a time and compact the open ones by ballot.
#include "common/extras.cuh"
#include "common/mask.cuh"

constexpr int WARPS = 4;  // TILES_WARPS in src/cuda/runtime/extras.rs

// The element type of the bias (`bias_kind`, set by `fill` in src/cuda/runtime/extras.rs).
constexpr int BIAS_F32 = 0, BIAS_F16 = 1, BIAS_BF16 = 2;

// Key c of a key bias row, as f32.
__device__ __forceinline__ float key_bias_at(const FlashParams& p, const char* row, int kind,
                                             int c) {
    const int64_t x = (int64_t)c * p.bias_k;
    switch (kind) {
        case BIAS_F16: return __half2float(reinterpret_cast<const __half*>(row)[x]);
        case BIAS_BF16: return __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(row)[x]);
        default: return reinterpret_cast<const float*>(row)[x];
    }
}

extern "C" __global__ void __launch_bounds__(WARPS * 32)
    block_tiles(const FlashParams p, int br, int bc, int bias_kind) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int m_block = blockIdx.x * WARPS + warp;
    const int h = blockIdx.y, b = blockIdx.z;
    if (m_block >= p.q_tiles) return;
    const int64_t l = tile_list(p, b, h, m_block);
    int32_t* list = const_cast<int32_t*>(p.tiles) + l * p.k_tiles;
    const bool key_bias = p.bias && p.bias_q == 0;
    const int bias_flag = p.bias && !key_bias ? TILE_BIAS : 0;
    const char* bias_row =
        key_bias ? static_cast<const char*>(p.bias) +
                       ((int64_t)b * p.bias_b + (int64_t)h * p.bias_h) *
                           (bias_kind == BIAS_F32 ? 4 : 2)
                 : nullptr;
    // The band of batch b (one list per sequence of a packed call; dense calls share one
    // list where neither the mask nor the bias has a batch dimension: every batch has the same
    // lengths and band).
    BlockGeom g;
    int n = 0;
    if (block_geom(p, m_block, br, 0, b, g)) {
        const KeyTiles<false> band = band_tiles(g, bc);
        const int64_t mask0 = (int64_t)b * p.bm_b + (int64_t)h * p.bm_h;
        for (int t0 = band.begin; t0 < band.end; t0 += 32) {
            const int t = t0 + lane;
            int e = -1;
            if (t < band.end) {
                bool any = true, all = true;
                if (p.block_mask) {
                    const int k0 = t * bc, k1 = min(k0 + bc, g.sk);
                    const int kb0 = k0 / p.block_k, kb1 = (k1 - 1) / p.block_k;
                    const int qb0 = g.m0 / p.block_q, qb1 = (g.m0 + g.rows - 1) / p.block_q;
                    any = false;
                    for (int qb = qb0; qb <= qb1; ++qb)
                        for (int kb = kb0; kb <= kb1; ++kb) {
                            const bool open = p.block_mask[mask0 + (int64_t)qb * p.bm_q +
                                                           (int64_t)kb * p.bm_k] != 0;
                            any |= open;
                            all &= open;
                        }
                }
                if (any) e = t | (all ? 0 : TILE_PARTIAL) | bias_flag;
            }
            if (key_bias) {
                // The key bias of the 32 tiles, one tile at a time, its keys read across the
                // warp: a tile whose every key is -inf is hidden, one whose every key is 0
                // needs no bias (NaN is neither, and reaches the scores).
                for (int x = 0; x < 32 && t0 + x < band.end; ++x) {
                    const int k0 = (t0 + x) * bc, k1 = min(k0 + bc, g.sk);
                    bool open = false, zero = true;
                    for (int c = k0 + lane; c < k1; c += 32) {
                        const float v = key_bias_at(p, bias_row, bias_kind, c);
                        open |= v != -INFINITY;
                        zero &= v == 0.f;
                    }
                    open = __any_sync(0xffffffffu, open);
                    zero = __all_sync(0xffffffffu, zero);
                    if (lane == x && e >= 0) e = !open ? -1 : zero ? e : e | TILE_BIAS;
                }
            }
            const unsigned vote = __ballot_sync(0xffffffffu, e >= 0);
            if (e >= 0) list[n + __popc(vote & ((1u << lane) - 1))] = e;
            n += __popc(vote);
        }
    }
    if (lane == 0) const_cast<int32_t*>(p.tile_count)[l] = n;
}
