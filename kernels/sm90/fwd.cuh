// FlashAttention forward for Hopper (sm_90a), composed from its roles:
//   sm90/fwd_scheduler.cuh  which tile a block works on: one per block, or persistent blocks
//                           fed longest first through a tile ring
//   sm90/fwd_producer.cuh   one producer warp: TMA loads of Q, K and V, mbarrier rings
//   sm90/fwd_mainloop.cuh   NWG consumer warpgroups: S = Q K^T and O += P V by wgmma, masks,
//                           score modifiers and the online softmax, overlapped
//   sm90/fwd_epilogue.cuh   O normalised and stored (threads or TMA), lse
//   sm90/fwd_traits.cuh     tile shape, shared-memory layout, register budgets
//
// Tiles: a block owns BM = 64 NWG query rows of one (batch, head); consumer warpgroup w owns
// rows [64 w, 64 w + 64). Keys stream BN at a time through a STAGES-deep ring of K and V buffers
// with separate full/empty barriers, so S of a tile starts as soon as its K has landed. The
// producer warpgroup gives its registers to the consumers (setmaxnreg). Softmax, masks, softcap,
// ALiBi, GQA and varlen follow the sm_80 kernel (forward/mma.cuh) and the rules of
// src/semantics.rs.
#pragma once
#include "common/mask.cuh"
#include "common/math.cuh"
#include "common/params.cuh"
#include "sm90/fwd_epilogue.cuh"
#include "sm90/fwd_mainloop.cuh"
#include "sm90/fwd_producer.cuh"
#include "sm90/fwd_scheduler.cuh"
#include "sm90/fwd_traits.cuh"
#include "sm90/ptx.cuh"

namespace sm90 {

// MODS: softcap / ALiBi (and a bias and block mask with them); BLOCKS: a bias or block mask with
// the plain arithmetic. Both walk the block mask's key-tile lists (LIST).
// FP8 instances (T e4m3, TO bf16) take plain arithmetic only, with V transposed (see Traits).
template <typename T, int D, int NWG, int BN, int STAGES, bool PINGPONG, bool PERSIST, bool MODS,
          bool BLOCKS, typename TO = T>
__device__ __forceinline__ void flash_fwd_sm90(const FlashParams& p, const TmaMap* tq,
                                               const TmaMap* tk, const TmaMap* tv,
                                               const TmaMap* to, int o_mode,
                                               int* tile_counter, int group) {
    constexpr bool LIST = MODS || BLOCKS;
    using Tr = Traits<T, D, NWG, BN, STAGES, PERSIST, LIST, TO>;
    constexpr int QB = Tr::QB, BM = Tr::BM;
    // How this instance writes O (O_STORE_*): the launch's o_mode on persistent instances only.
    const int o_store = PERSIST ? o_mode : O_STORE_THREADS;
    // Whole swizzle atoms: 64-column chunks, and 8-row groups so every K/V chunk (BN rows of
    // 128 bytes) starts 1024-byte aligned; P V steps through the keys 16 at a time.
    static_assert(D % 64 == 0 && BN % 16 == 0, "whole swizzle atoms");
    static_assert(!Tr::FP8 || (D % 128 == 0 && BN % 128 == 0 && !LIST),
                  "FP8: 128-byte rows of Q, K and transposed V; plain arithmetic");
    static_assert(!(Tr::O_IN_Q && PERSIST), "O staged in Q: the next tile's Q would overwrite it");

    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const FwdSmem<Tr> sm(smem_raw);
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const TileOrder<BM, PERSIST> order(p, group);

    if (tid == 0) sm.init_barriers();
    __syncthreads();

    if (warp < 4) {
        // ---- producer warpgroup: one thread issues every copy; persistent instances run the
        // tile loop in all of warp 0 (the tile ring's named barriers count whole warps) ----
        setmaxnreg_dec<Tr::PRODUCER_REGS>();
        const bool issuer = PERSIST ? lane == 0 : true;
        if (PERSIST ? warp == 0 : tid == 0) {
            if (issuer) {
                prefetch_map(tq);
                prefetch_map(tk);
                prefetch_map(tv);
                if (o_store != O_STORE_THREADS) prefetch_map(to);
            }
            int kv_it = 0, n_tile = 0;
            uint32_t tail_phase = 0;
            int tile = PERSIST ? (int)blockIdx.x : 0;
            Producer<Tr, LIST> producer{p,    sm,     order, tq,    tk,         tv,     tile_counter,
                                  lane, issuer, kv_it, tail_phase, n_tile, tile};
            producer.run();
        }
        return;
    }

    // ---- consumer warpgroups ----
    setmaxnreg_inc<Tr::CONSUMER_REGS>();
    const int wg = warp / 4 - 1;   // 0 .. NWG-1
    const int wt = tid % 128;      // thread in the warpgroup
    const int ww = wt / 32;        // warp in the warpgroup
    const int row_base = 64 * wg + 16 * ww + lane / 4;  // this thread's rows: +0 and +8
    const Epilogue<Tr> epilogue{p, sm, order, to, o_store, wg, wt, lane, row_base};
    int kv_it = 0, n_tile = 0;
    // Ping-pong turns alternate strictly across all tiles of the block: warpgroup 0 goes first,
    // and takes the last warpgroup's final arrival after the last tile.
    if constexpr (PINGPONG) {
        if (wg == NWG - 1) named_arrive(PP_BAR, 256);
    }
    for (;;) {
        int tile = 0, h, b;
        BlockGeom g;
        if constexpr (PERSIST) {
            // The producer's next tile (-1: none left) and its geometry.
            const TileSlot* slot = sm.ring.wait(n_tile);
            tile = slot->tile;
            if (tile < 0) break;
            read_slot(slot, h, b, g);
        } else {
            if (n_tile > 0 || !order.geom(p, tile, h, b, g)) break;
        }
        const auto kt = key_tiles<LIST>(p, g, b, h, g.m0 / BM, BN);
        const int diag_t = g.m0 + row_base + g.sk - g.sq;
        const float slope_log2 = MODS && p.alibi ? p.alibi[g.slope_idx] * LOG2E_F : 0.f;
        // The scores' base-2 factor and the output's: FP8 calls fold in the descales of the
        // tile's (sequence, K/V head), q's times k's and v's (FlashParams::qk_descale, v_descale).
        float unit = MODS ? 1.f : p.scale_log2, vscale = 1.f;
        if constexpr (Tr::FP8) {
            const int64_t bk = (int64_t)b * (p.heads / p.kv_group) + h / p.kv_group;
            if (p.qk_descale) unit *= p.qk_descale[bk];
            if (p.v_descale) vscale = p.v_descale[bk];
        }

        float acc_o[D / 2];
        float row_m[2] = {-INFINITY, -INFINITY}, row_l[2] = {0.f, 0.f};
#pragma unroll
        for (int i = 0; i < D / 2; ++i) acc_o[i] = 0.f;

        const int qi = n_tile % QB;
        const uint32_t q_base = saddr(sm.sQ + qi * BM * D) + wg * 64 * 128;
        mbar_wait(sm.full_q(qi), (uint32_t)((n_tile / QB) & 1));

        const Mainloop<Tr, PINGPONG, MODS, LIST> mainloop{p,      sm,         g,    lane,   wg,
                                                    diag_t, slope_log2, unit, q_base, b, h};
        float acc_s[BN / 2];       // S, then P in f32
        uint32_t pa[BN / Tr::PK][4];  // P in T, wgmma A fragments
        float alpha[2];            // O's rescale factors, per row
        mainloop.run(acc_o, row_m, row_l, acc_s, pa, alpha, kt, kv_it, qi);
        epilogue.store(n_tile, tile, h, b, g, acc_o, row_m, row_l, unit, vscale);
        ++n_tile;
    }
    epilogue.drain();
    if constexpr (PINGPONG) {
        if (wg == 0) named_sync(PP_BAR, 256);
    }
}

}  // namespace sm90

// One entry point per instance (kernels/sm90/flash_sm90.cu lists them, with the `_mods` ones for
// softcap / ALiBi and the `_blocks` ones for a bias or block mask alone). The tensor maps are
// __grid_constant__ so their addresses are those of the kernel parameters.
#define FLASH_SM90_INSTANCE(NAME, T, D, NWG, BN, STAGES, PP, PERSIST, MODS, BLOCKS, SMEM_BYTES) \
    static_assert(sm90::Traits<T, D, NWG, BN, STAGES, PERSIST, MODS || BLOCKS>::SMEM ==         \
                      SMEM_BYTES,                                                              \
                  "src/cuda/instances.rs and the sm_90a forward disagree on shared memory");   \
    extern "C" __global__ void __launch_bounds__(128 * (NWG + 1), 1)                           \
        NAME(const FlashParams p, const __grid_constant__ TmaMap tq,                           \
             const __grid_constant__ TmaMap tk, const __grid_constant__ TmaMap tv,             \
             const __grid_constant__ TmaMap to, int o_mode, int* tile_counter, int group) {    \
        sm90::flash_fwd_sm90<T, D, NWG, BN, STAGES, PP, PERSIST, MODS, BLOCKS>(                \
            p, &tq, &tk, &tv, &to, o_mode, tile_counter, group);                               \
    }

// FP8 entry points: e4m3 Q, K and V (V transposed, see Traits), bf16 output, plain arithmetic.
#define FLASH_SM90_FP8_INSTANCE(NAME, D, NWG, BN, STAGES, PP, PERSIST, SMEM_BYTES)              \
    static_assert(sm90::Traits<__nv_fp8_e4m3, D, NWG, BN, STAGES, PERSIST, false,               \
                               __nv_bfloat16>::SMEM == SMEM_BYTES,                              \
                  "src/cuda/instances.rs and the sm_90a FP8 forward disagree on shared memory"); \
    extern "C" __global__ void __launch_bounds__(128 * (NWG + 1), 1)                           \
        NAME(const FlashParams p, const __grid_constant__ TmaMap tq,                           \
             const __grid_constant__ TmaMap tk, const __grid_constant__ TmaMap tv,             \
             const __grid_constant__ TmaMap to, int o_mode, int* tile_counter, int group) {    \
        sm90::flash_fwd_sm90<__nv_fp8_e4m3, D, NWG, BN, STAGES, PP, PERSIST, false, false,     \
                             __nv_bfloat16>(p, &tq, &tk, &tv, &to, o_mode, tile_counter,      \
                                            group);                                            \
    }
