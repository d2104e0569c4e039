// The sm_90a forward's producer: the TMA loads of Q, K and V into shared memory, with the
// mbarriers that tell the consumers a buffer is full and the producer that it is free again.
//
// Per tile: Q into buffer n % QB (persistent instances double-buffer it and load the next tile's
// Q a whole tile ahead, right after this tile's first K, so the consumers find it in place),
// then the tile's key range BN keys at a time through the STAGES-deep K and V rings, K one tile
// ahead of V: a K stage is released as soon as its S GEMM completes, a V stage only after its
// P V GEMM, so waiting for V first would hold back the next K. One thread issues every copy;
// persistent instances run the tile loop in all of warp 0, which also runs the scheduler
// (sm90/fwd_scheduler.cuh). The host builds one 4-D tensor map per operand: (column, head, row,
// batch), box (64, 1, rows, 1); varlen operands use batch 1 and rows = the packed total. Rows
// and columns outside the tensor read as zeros.
#pragma once
#include "common/extras.cuh"
#include "common/mask.cuh"
#include "sm90/fwd_scheduler.cuh"
#include "sm90/fwd_traits.cuh"
#include "sm90/ptx.cuh"

namespace sm90 {

// LIST: the instance walks the block mask's list of key tiles where the call has one.
template <class Tr, bool LIST>
struct Producer {
    using T = typename Tr::T;
    static constexpr int D = Tr::D, BN = Tr::BN, BM = Tr::BM, CH = Tr::CH, CW = Tr::CW;
    static constexpr int STAGES = Tr::STAGES, QB = Tr::QB, SLOTS = Tr::TILE_SLOTS;
    static constexpr bool PERSIST = Tr::PERSIST;

    const FlashParams& p;
    const FwdSmem<Tr>& sm;
    const TileOrder<BM, PERSIST>& order;
    const TmaMap* tq;
    const TmaMap* tk;
    const TmaMap* tv;
    int* tile_counter;
    int lane;
    bool issuer;  // this thread issues the copies
    // Loop state, owned by the caller: K/V stages used so far, the tail barrier's phase, tiles
    // done, the current tile. The order of these members decides which register ptxas gives
    // each of them; this one gives the producer the registers it was tuned with.
    int& kv_it;
    uint32_t& tail_phase;
    int& n_tile;
    int& tile;

    // Q of tile n (its geometry h, b, g) into buffer n % QB, once the consumers are done with the
    // Q it held, that of tile n - QB.
    __device__ __forceinline__ void load_q(int n, int h, int b, const BlockGeom& g) {
        const int qi = n % QB;
        if (n >= QB) mbar_wait(sm.empty_q(qi), (uint32_t)((n / QB - 1) & 1));
        mbar_expect_tx(sm.full_q(qi), Tr::Q_BYTES);
        const int qb = (p.cu_q || p.q_uniform) ? 0 : b;
        const int q_row = (int)(g.q_row0 + g.m0);
#pragma unroll
        for (int c = 0; c < CH; ++c)
            tma_load_4d(saddr(sm.sQ + qi * BM * D + c * BM * CW), tq, sm.full_q(qi), c * CW, h,
                        q_row, qb);
    }
    // PERSIST: the next tile with query rows and its geometry into slot n of the tile ring, then
    // its Q. False when none is left.
    __device__ __forceinline__ bool publish(int n) {
        if constexpr (!PERSIST) {
            return false;
        } else {
            int h, b;
            BlockGeom g;
            if (!sm.ring.publish(order, p, n, tile, tile_counter, lane, h, b, g)) return false;
            if (issuer) {
                // The geometry back from the slot (see read_slot).
                read_slot(sm.ring.slots + n % SLOTS, h, b, g);
                load_q(n, h, b, g);
            }
            return true;
        }
    }
    // K tile t (the it-th K/V stage use) of kv head kvh, batch coordinate kb.
    __device__ __forceinline__ void load_k(const BlockGeom& g, int kvh, int kb, int t, int it) {
        const int s = it % STAGES;
        const int k_row = (int)(g.k_row0 + (int64_t)t * BN);
        if (it >= STAGES) mbar_wait(sm.empty_k(s), ((it / STAGES) & 1) ^ 1);
        mbar_expect_tx(sm.full_k(s), Tr::KV_BYTES);
#pragma unroll
        for (int c = 0; c < CH; ++c)
            tma_load_4d(saddr(sm.sK + s * BN * D + c * BN * CW), tk, sm.full_k(s), c * CW, kvh,
                        k_row, kb);
    }
    __device__ __forceinline__ void load_v(const BlockGeom& g, int kvh, int kb, int t, int it) {
        const int s = it % STAGES;
        const int k_row = (int)(g.k_row0 + (int64_t)t * BN);
        if (it >= STAGES) mbar_wait(sm.empty_v(s), ((it / STAGES) & 1) ^ 1);
        if constexpr (Tr::FP8) {
            // V transposed (dense calls only): the map is (key, column, K/V head, batch) over
            // keys padded with zeros to whole tiles, box (128 keys, D, 1, 1); chunk c holds keys
            // c * 128 of the tile, D rows of 128 bytes.
            mbar_expect_tx(sm.full_v(s), Tr::KV_BYTES);
#pragma unroll
            for (int c = 0; c < BN / 128; ++c)
                tma_load_4d(saddr(sm.sV + s * BN * D + c * D * 128), tv, sm.full_v(s),
                            t * BN + c * 128, 0, kvh, kb);
            return;
        }
        // Varlen: a tile past the sequence's end also holds the next sequence's first rows. P is
        // exactly 0 there, but 0 * NaN is NaN: so such a V tile lands on bar_tail, the rows of
        // the last 16-row step the P V product reads (it stops there, see the consumers) are
        // zeroed, and only then is the stage full. K needs nothing: its scores are masked by a
        // select.
        const int valid = g.sk - t * BN;
        const bool tail = p.cu_k && valid < BN;
        const uint32_t vbar = tail ? sm.bar_tail : sm.full_v(s);
        mbar_expect_tx(vbar, Tr::KV_BYTES);
#pragma unroll
        for (int c = 0; c < CH; ++c)
            tma_load_4d(saddr(sm.sV + s * BN * D + c * BN * 64), tv, vbar, c * 64, kvh, k_row,
                        kb);
        if (tail) {
            mbar_wait(sm.bar_tail, tail_phase);
            tail_phase ^= 1;
            const int end = min(BN, (valid + 15) / 16 * 16);
            for (int c = 0; c < CH; ++c)
                for (int r = valid; r < end; ++r)
#pragma unroll
                    for (int u = 0; u < 8; ++u)
                        *reinterpret_cast<uint4*>(sm.sV + s * BN * D + c * BN * 64 + r * 64 +
                                                  u * 8) = make_uint4(0, 0, 0, 0);
            proxy_fence();
            mbar_arrive(sm.full_v(s));
        }
    }
    // The K and V loads of tile n_tile (its key tiles as the consumers walk them, see
    // common/extras.cuh): its first K tile (part 0) or the rest (part 1). The
    // geometry comes back from the tile's slot each time (PERSIST), so none of it stays live
    // across the next tile's publication.
    __device__ __forceinline__ void load_kv(int part) {
        if (!issuer) return;
        int h, b;
        BlockGeom g;
        tile_geom(sm.ring, order, p, n_tile, tile, h, b, g);
        const int kvh = h / p.kv_group;
        const auto kt = key_tiles<LIST>(p, g, b, h, g.m0 / BM, BN);
        const int kb = p.cu_k ? 0 : b;
        auto tile_at = [&](int q) { return kt.tile(kt.entry(q)); };
        if (part == 0) {
            if (kt.end > kt.begin) load_k(g, kvh, kb, tile_at(kt.begin), kv_it);
            return;
        }
        for (int q = kt.begin + 1; q < kt.end; ++q) {
            load_k(g, kvh, kb, tile_at(q), kv_it + q - kt.begin);
            load_v(g, kvh, kb, tile_at(q - 1), kv_it + q - 1 - kt.begin);
        }
        if (kt.end > kt.begin) load_v(g, kvh, kb, tile_at(kt.end - 1), kv_it + kt.end - 1 - kt.begin);
        kv_it += kt.end - kt.begin;
    }

    // Every tile of the block (one, or the scheduler's for PERSIST).
    __device__ __forceinline__ void run() {
        [[maybe_unused]] bool have = true;
        if constexpr (PERSIST) have = publish(0);
        for (;;) {
            if constexpr (PERSIST) {
                if (!have) break;
            } else {
                int h, b;
                BlockGeom g;
                if (n_tile > 0 || !order.geom(p, tile, h, b, g)) break;
                load_q(0, h, b, g);
            }
            load_kv(0);
            if constexpr (PERSIST) {
                // The next tile, its slot and its Q go out now, a whole tile ahead: the consumers
                // find that Q in place when they start the tile, and the scheduler's atomic is
                // off the path from one tile to the next.
                __syncwarp();
                tile = next_tile(tile_counter, lane);
                have = publish(n_tile + 1);
            }
            load_kv(1);
            if constexpr (PERSIST) __syncwarp();
            ++n_tile;
        }
    }
};

}  // namespace sm90
