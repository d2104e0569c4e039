// The sm_90a forward's tile scheduler: which query tile (BM rows of one (batch, head)) a block
// works on, and how a persistent block's producer hands its tiles to the consumer warpgroups.
//
// One-tile instances: one block per tile, grid (q_tiles, heads, batch), the last query tile
// first (under a causal mask it has the most keys, so the longest blocks start first).
// PERSIST instances: one block per SM runs tiles until none is left, longest first. Tile i of
// q_tiles x heads x batch in the global order: groups of `group` (batch, head) pairs (heads
// fastest) whose K and V fit in L2 together, and within a group the query tiles from the last
// (most keys under a causal mask) to the first, the group's pairs fastest. Block c starts with
// tile c; a global counter (zeroed by the launch) hands out the rest. The producer warp skips
// tiles past a (varlen) sequence's end, computes each tile's geometry and publishes both in a
// ring of three slots in shared memory (TileSlot, full and empty mbarriers) a whole tile ahead,
// so each consumer warpgroup starts a tile as soon as it is done with the last one, without the
// scheduler's atomic, divisions or parameter loads on its path.
#pragma once
#include "common/mask.cuh"
#include "sm90/ptx.cuh"

namespace sm90 {

// A slot of the tile ring: the tile (-1: no more) and its geometry.
struct TileSlot {
    BlockGeom g;
    int tile, h, b;
};
static_assert(sizeof(TileSlot) == 80, "src/cuda/instances.rs: Sm90Instance::smem counts 80 bytes a slot");

// A slot's tile geometry, read through volatile loads: the producer reads back what it has just
// written, so the values it computed are not kept live beside its load loop (its few registers
// spilled otherwise).
__device__ __forceinline__ void read_slot(const TileSlot* slot, int& h, int& b, BlockGeom& g) {
    const volatile TileSlot* v = slot;
    h = v->h;
    b = v->b;
    g.sq = v->g.sq;
    g.sk = v->g.sk;
    g.m0 = v->g.m0;
    g.rows = v->g.rows;
    g.q_row0 = v->g.q_row0;
    g.k_row0 = v->g.k_row0;
    g.out_row0 = v->g.out_row0;
    g.lse0 = v->g.lse0;
    g.n_lo = v->g.n_lo;
    g.n_hi = v->g.n_hi;
    g.slope_idx = v->g.slope_idx;
}

// The tile order: tile index -> (head, batch, geometry).
template <int BM, bool PERSIST>
struct TileOrder {
    int q_tiles;  // query tiles per (batch, head)
    int pairs;    // (batch, head) pairs
    int total;    // tiles (PERSIST; 1 otherwise)
    int group;    // (batch, head) pairs per L2 group (PERSIST)
    __device__ __forceinline__ TileOrder(const FlashParams& p, int group_)
        : q_tiles(PERSIST ? (p.seq_q + BM - 1) / BM : (int)gridDim.x),
          pairs(p.heads * p.batch),
          total(PERSIST ? q_tiles * pairs : 1),
          group(group_) {}
    // The geometry of tile `tile` (PERSIST; else of this block's tile, from the grid). False
    // when the tile lies past the end of its (varlen) sequence.
    __device__ __forceinline__ bool geom(const FlashParams& p, int tile, int& h, int& b,
                                         BlockGeom& g) const {
        if constexpr (PERSIST) {
            const int per_group = group * q_tiles;
            const int gi = tile / per_group;
            const int r = tile - gi * per_group;
            const int gsize = min(group, pairs - gi * group);
            const int m_block = q_tiles - 1 - r / gsize;
            const int bh = gi * group + r % gsize;
            h = bh % p.heads;
            b = bh / p.heads;
            return block_geom(p, m_block, BM, h, b, g);
        } else {
            h = blockIdx.y;
            b = blockIdx.z;
            return block_geom(p, q_tiles - 1 - (int)blockIdx.x, BM, h, b, g);
        }
    }
};

// The next tile for a persistent producer warp (warp-uniform): the first of block c is tile c,
// the counter (zero at launch) hands out the rest from gridDim.x on.
__device__ __forceinline__ int next_tile(int* tile_counter, int lane) {
    int t = 0;
    if (lane == 0) t = atomicAdd(tile_counter, 1);
    return __shfl_sync(0xffffffff, t, 0) + (int)gridDim.x;
}

// The tile ring of a persistent block: SLOTS TileSlots and their mbarriers. A slot is full once
// the producer has written it (one arrival), empty once every consumer thread has read what it
// needs from it (after its tile's epilogue). The block's n-th tile uses slot n % SLOTS.
// `bars` is the block's mbarrier array, the ring's are full[SLOTS] then empty[SLOTS] from index
// BAR0 on (addressed from the array's base, not from a pointer of their own: an extra base
// pointer changed the code ptxas generated for the slot reads).
template <int SLOTS, int BAR0>
struct TileRing {
    TileSlot* slots;
    uint64_t* bars;
    __device__ __forceinline__ uint32_t full(int s) const { return saddr(bars + BAR0 + s); }
    __device__ __forceinline__ uint32_t empty(int s) const {
        return saddr(bars + BAR0 + SLOTS + s);
    }

    // Producer: the first tile from `tile` on that has query rows (or -1: none is left) and its
    // geometry (also left in h, b, g) into slot n % SLOTS, once the consumers are done with the
    // tile it held (n - SLOTS). False when none is left. Run by the whole producer warp
    // (next_tile is warp-uniform).
    template <int BM>
    __device__ __forceinline__ bool publish(const TileOrder<BM, true>& order, const FlashParams& p,
                                            int n, int& tile, int* tile_counter, int lane, int& h,
                                            int& b, BlockGeom& g) const {
        while (tile < order.total && !order.geom(p, tile, h, b, g))
            tile = next_tile(tile_counter, lane);
        const int s = n % SLOTS;
        if (n >= SLOTS) mbar_wait(empty(s), (uint32_t)((n / SLOTS - 1) & 1));
        if (lane == 0) {
            slots[s].tile = tile < order.total ? tile : -1;
            if (tile < order.total) {
                slots[s].h = h;
                slots[s].b = b;
                slots[s].g = g;
            }
            mbar_arrive(full(s));  // release: the slot's writes come first
        }
        return tile < order.total;
    }
    // Consumer: waits for the slot of the block's n-th tile (its `tile` is -1 when none is
    // left). Each warpgroup goes on as soon as it is there, without waiting for the other ones.
    __device__ __forceinline__ const TileSlot* wait(int n) const {
        const int s = n % SLOTS;
        mbar_wait(full(s), (uint32_t)((n / SLOTS) & 1));
        return slots + s;
    }
    // Consumer: this thread is done with the block's n-th tile's slot (every thread arrives: an
    // arrival releases only the arriving thread's own reads).
    __device__ __forceinline__ void release(int n) const { mbar_arrive(empty(n % SLOTS)); }
};

// The geometry of the block's n-th tile (index `tile`): from its slot of the ring (PERSIST),
// else from the grid.
template <int BM, bool PERSIST, int SLOTS, int BAR0>
__device__ __forceinline__ void tile_geom(const TileRing<SLOTS, BAR0>& ring,
                                          const TileOrder<BM, PERSIST>& order,
                                          const FlashParams& p, int n, int tile, int& h, int& b,
                                          BlockGeom& g) {
    if constexpr (PERSIST) read_slot(ring.slots + n % SLOTS, h, b, g);
    else order.geom(p, tile, h, b, g);
}

}  // namespace sm90
