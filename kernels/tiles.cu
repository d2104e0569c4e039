// The key tiles each query tile computes under a block-sparse mask, for a forward kernel whose
// tiles are BR query rows by BC keys (see common/extras.cuh): per (mask batch, mask head, query
// tile), the key tiles of the tile's band (common/mask.cuh: causal and window bounds) that hold
// any key of an open block, in increasing order, each flagged TILE_PARTIAL when a hidden block
// cuts it too. Grid: (query tiles / WARPS, the mask's heads, the mask's batches), one warp per
// query tile; its 32 lanes judge 32 key tiles at a time and compact the open ones by ballot.
#include "common/extras.cuh"
#include "common/mask.cuh"

constexpr int WARPS = 4;  // TILES_WARPS in src/cuda/runtime/extras.rs

extern "C" __global__ void __launch_bounds__(WARPS * 32)
    block_tiles(const FlashParams p, int br, int bc) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int m_block = blockIdx.x * WARPS + warp;
    const int h = blockIdx.y, b = blockIdx.z;
    if (m_block >= p.q_tiles) return;
    const int64_t l = tile_list(p, b, h, m_block);
    int32_t* list = const_cast<int32_t*>(p.tiles) + l * p.k_tiles;
    // The band of batch b (one list per sequence of a packed call; dense calls share one
    // list where the mask has no batch dimension: every batch has the same lengths and band).
    BlockGeom g;
    int n = 0;
    if (block_geom(p, m_block, br, 0, b, g)) {
        const KeyTiles<false> band = band_tiles(g, bc);
        const int64_t mask0 = (int64_t)b * p.bm_b + (int64_t)h * p.bm_h;
        const int qb0 = g.m0 / p.block_q, qb1 = (g.m0 + g.rows - 1) / p.block_q;
        for (int t0 = band.begin; t0 < band.end; t0 += 32) {
            const int t = t0 + lane;
            int e = -1;
            if (t < band.end) {
                const int k0 = t * bc, k1 = min(k0 + bc, g.sk);
                const int kb0 = k0 / p.block_k, kb1 = (k1 - 1) / p.block_k;
                bool any = false, all = true;
                for (int qb = qb0; qb <= qb1; ++qb)
                    for (int kb = kb0; kb <= kb1; ++kb) {
                        const bool open =
                            p.block_mask[mask0 + (int64_t)qb * p.bm_q + (int64_t)kb * p.bm_k] != 0;
                        any |= open;
                        all &= open;
                    }
                if (any) e = t | (all ? 0 : TILE_PARTIAL);
            }
            const unsigned vote = __ballot_sync(0xffffffffu, e >= 0);
            if (e >= 0) list[n + __popc(vote & ((1u << lane) - 1))] = e;
            n += __popc(vote);
        }
    }
    if (lane == 0) const_cast<int32_t*>(p.tile_count)[l] = n;
}
