// The sm_90a forward's epilogue: a consumer warpgroup's 64 rows of O, normalised once by the
// row sums, and their log-sum-exp.
//
// Each thread reduces its rows' l over the 4 threads that share them, writes the natural-log
// lse (-inf and O = 0 for a row that saw no key) and stages O / l, rounded to T, in shared
// memory in the tensor copy engine's 128-byte-swizzled layout: in the O tile, or (d 256 and
// 176-key tiles, O_IN_Q) in the warpgroup's own rows of Q. Then either one thread issues one
// bulk tensor store per 64-column chunk and the warpgroup goes on to its next tile (persistent
// instances, o_mode O_STORE_TMA*), or every thread stores 16-byte chunks (coalesced rows).
#pragma once
#include "common/mask.cuh"
#include "common/math.cuh"
#include "common/ptx.cuh"
#include "sm90/fwd_scheduler.cuh"
#include "sm90/fwd_traits.cuh"
#include "sm90/ptx.cuh"

namespace sm90 {

template <class Tr>
struct Epilogue {
    using T = typename Tr::TO;  // the output's element
    static constexpr int D = Tr::D, BM = Tr::BM, CH = Tr::OCH, DT = D / 8;
    static constexpr bool PERSIST = Tr::PERSIST;

    const FlashParams& p;
    const FwdSmem<Tr>& sm;
    const TileOrder<BM, PERSIST>& order;
    const TmaMap* to;
    int o_store;   // O_STORE_*
    int wg, wt;    // consumer warpgroup, thread in it
    int lane;
    int row_base;  // this thread's first row in the block (the other is 8 further)

    // Chunk c of the staged rows: in sO, or (O_IN_Q) in this warpgroup's rows of Q.
    __device__ __forceinline__ T* o_chunk(int c) const {
        if constexpr (Tr::O_IN_Q) return sm.sQ + c * BM * 64 + 64 * wg * 64;
        else return sm.sO + wg * 64 * D + c * 64 * 64;
    }
    // Element (r, 8 u) of the staged rows.
    __device__ __forceinline__ T* o_at(int r, int u) const {
        return o_chunk(u / 8) + r * 64 + ((u % 8) ^ (r % 8)) * 8;
    }

    // The block's n-th tile (index `tile`, geometry h, b, g as the consumer had it): O from
    // acc_o, row maxima row_m and partial sums row_l, `unit` the base-2 logit per unit of the
    // row maxima and `vscale` a factor of O (FP8's v descale). PERSIST: releases the tile's slot
    // of the ring.
    __device__ __forceinline__ void store(int n_tile, int tile, int& h, int& b, BlockGeom& g,
                                          const float (&acc_o)[D / 2], const float (&row_m)[2],
                                          const float (&row_l)[2], float unit,
                                          float vscale) const {
        // This warpgroup's stores of the previous tile have read its staged rows.
        if (o_store != O_STORE_THREADS && wt == 0) bulk_wait_read();
        named_sync(EPI_BAR + wg, 128);
        // The geometry again rather than carried through the key loop (registers); a persistent
        // instance then releases the tile's slot (the producer fills it with the tile SLOTS
        // later).
        tile_geom(sm.ring, order, p, n_tile, tile, h, b, g);
        if constexpr (PERSIST) sm.ring.release(n_tile);
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
            float l = row_l[hf];
            l += __shfl_xor_sync(0xffffffff, l, 1);
            l += __shfl_xor_sync(0xffffffff, l, 2);
            const RowEnd end = row_end(row_m[hf] * unit, l, p.sinks, h);
            const float inv = end.inv * vscale;
            const int r = row_base + hf * 8;  // row in the block
            if (lane % 4 == 0 && r < g.rows) p.lse[g.lse0 + r] = end.lse2 * LN2_F;
            const int rl = r - 64 * wg;
#pragma unroll
            for (int j = 0; j < DT; ++j) {
                const int c = j * 8 + 2 * (lane % 4);
                *reinterpret_cast<uint32_t*>(o_at(rl, c / 8) + c % 8) = flash::Mma<T>::pack(
                    acc_o[4 * j + 2 * hf] * inv, acc_o[4 * j + 2 * hf + 1] * inv);
            }
        }
        if (o_store != O_STORE_THREADS) proxy_fence();
        named_sync(EPI_BAR + wg, 128);
        const int rows = g.rows - 64 * wg;
        if (o_store == O_STORE_TMA || (o_store == O_STORE_TMA_PACKED && rows >= 64)) {
            if (wt == 0 && rows > 0) {
                const bool dense = o_store == O_STORE_TMA;
                const int row = (int)((dense ? 0 : g.out_row0) + g.m0 + 64 * wg);
#pragma unroll
                for (int c = 0; c < CH; ++c)
                    if (c * 64 < p.d_out)
                        tma_store_4d(to, saddr(o_chunk(c)), c * 64, h, row, dense ? b : 0);
                bulk_commit();
            }
            return;
        }
        T* og =
            static_cast<T*>(p.o) + (g.out_row0 + g.m0 + 64 * wg) * p.o_seq + (int64_t)h * p.o_head;
        constexpr int C = D / 8;
        // The thread index through a volatile read: the store addresses are computed here, not
        // hoisted to the kernel's start and kept (spilled) across the key loop.
        const int wt_e = flash::tid_volatile() % 128;
        if (p.d_out % 8 == 0) {
#pragma unroll
            for (int i0 = 0; i0 < 64 * C; i0 += 128) {
                const int i = i0 + wt_e;
                const int r = i / C, c = i % C;
                if (r < rows && c * 8 < p.d_out)
                    *reinterpret_cast<uint4*>(og + r * p.o_seq + c * 8) =
                        *reinterpret_cast<const uint4*>(o_at(r, c));
            }
        } else {
            for (int i = wt_e; i < 64 * p.d_out; i += 128) {
                const int r = i / p.d_out, c = i % p.d_out;
                if (r < rows) og[r * p.o_seq + c] = o_at(r, c / 8)[c % 8];
            }
        }
    }
    // After the block's last tile: the shared memory of the last bulk stores stays allocated
    // until they have read it.
    __device__ __forceinline__ void drain() const {
        if (o_store != O_STORE_THREADS && wt == 0) bulk_wait_read();
    }
};

}  // namespace sm90
