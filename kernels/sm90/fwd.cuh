// FlashAttention forward for Hopper (sm_90a): TMA loads into 128-byte-swizzled shared memory,
// an mbarrier ring, one producer warp and NWG consumer warpgroups (setmaxnreg), wgmma for
// S = Q K^T (both operands in shared memory) and for O += P V (P from registers, V read
// MN-major). Softmax, masks, softcap, ALiBi, GQA and varlen follow the sm_80 kernel
// (forward/mma.cuh) and the rules of src/semantics.rs through common/mask.cuh.
//
// Tiles: a block owns BM = 64 NWG query rows of one (batch, head); consumer warpgroup w owns rows
// [64 w, 64 w + 64). Keys stream BN at a time through a STAGES-deep ring of K and V buffers with
// separate full/empty barriers, so S of a tile starts as soon as its K has landed.
// Shared memory tiles hold D / 64 column chunks of [rows][64] elements (128 bytes a row), as the
// tensor copy engine writes them with its 128-byte swizzle; every chunk starts 1024-byte aligned.
// The host builds one 4-D tensor map per operand: (column, head, row, batch), box (64, 1, rows, 1);
// varlen operands use batch 1 and rows = the packed total. Rows and columns outside the tensor
// read as zeros.
//
// Overlap (FlashAttention-3): within a warpgroup, S of tile t and P V of tile t - 1 are issued
// together and the softmax of t runs while P V completes (O is rescaled after it, and in the
// d >= 128 instances only when a row's reference max moves: LAZY; there, without softcap or
// ALiBi, the softmax first takes the exps against the current max, and computes the row max,
// from S issued again, only for the rare tiles where that guess fails: softmax_spec); between
// warpgroups (PINGPONG), named barriers hand the GEMM issue slot round-robin so one
// warpgroup's softmax runs under another's GEMMs. (The d 64 instances keep P's registers
// unpinned, so ptxas places P V's wait before their softmax: measured faster there.) The
// producer issues K one tile ahead of V. PERSIST instances run one block per SM over all tiles
// with a dynamic scheduler: the producer warp takes the next tile from a global counter (atomicAdd;
// the launch zeroes it per call), computes its geometry and passes both to the consumers through
// a three-slot ring in shared memory (TileSlot, mbarriers), and loads its Q into the second of
// two Q buffers, all a whole tile ahead (right after this tile's first K): each consumer
// warpgroup then starts a tile as soon as it is done with the last one, without waiting for the
// other warpgroup, for Q, or for the geometry's divisions and parameter loads. The global order is
// longest first: tiles are grouped by `group` (batch, head) pairs whose K and V fit in L2
// together, and within a group the query tiles go from the last (most keys under a causal mask)
// to the first, across the group's heads. The other instances are one block per tile, and
// one producer thread. The output is staged per warpgroup in shared memory in the 128-byte
// swizzle (d 256 and 176-key tiles: in the warpgroup's own rows of Q); persistent instances
// write it with bulk tensor stores issued by one thread (O_STORE_*), the others with 16-byte
// stores by the warpgroup; lse as in the sm_80 kernel. d 256
// takes FlashAttention-3's shape: 80-key tiles (S = Q K^T as m64n80k16), O += P V as m64n256k16
// into 128 f32 registers a thread.
#pragma once
#include "common/mask.cuh"
#include "common/math.cuh"
#include "common/ptx.cuh"
#include "common/score.cuh"
#include "forward/mma.cuh"
#include "sm90/ptx.cuh"

namespace sm90 {

// How the epilogue writes O (the launch's o_mode): by the warpgroup's threads; by the tensor copy
// engine through the O map (column, head, row, batch) of a dense output, whose rows past seq_q
// it clips; or through a map of packed rows (varlen, batch 1), for whole 64-row boxes only (a
// partial box would run into the next sequence's rows), the rest by the threads. Persistent
// instances only: a block that ends with its tile gains nothing from them (it must wait for the
// copy to read its shared memory before it exits). Measured on an H100 (BENCHMARKS.md,
// 2026-11-22 ~19:05): persistent d 128 1.02-1.07x at seq 512, 0.99-1.03x at 2048; the one-tile
// instances were no faster with them (d 64 at seq 512 0.96-0.98x, 176-key d 128 0.99-1.01x).
// The launch (src/cuda/launch.rs) names the same three values.
constexpr int O_STORE_THREADS = 0;
constexpr int O_STORE_TMA = 1;
constexpr int O_STORE_TMA_PACKED = 2;

// A slot of the persistent scheduler's tile ring: the tile (-1: no more) and its geometry, which
// the producer computes, so the consumers start each tile without the divisions and parameter
// loads of tile_geom.
struct TileSlot {
    BlockGeom g;
    int tile, h, b;
};
static_assert(sizeof(TileSlot) == 80, "plan.rs: Sm90Instance::smem counts 80 bytes a slot");
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

// ---- the kernel -----------------------------------------------------------------------------

// LAZY instances: the online softmax's reference max moves only when a tile's max exceeds it by
// more than this (base 2), so P = 2^(s - m) stays below 2^8.
constexpr float RESCALE_LOG2 = 8.f;

template <typename T, int D, int NWG, int BN, int STAGES, bool PERSIST = false>
struct Traits {
    static constexpr int BM = 64 * NWG;
    static constexpr int THREADS = 128 * (NWG + 1);
    static constexpr int CH = D / 64;  // 64-column chunks
    static constexpr int Q_BYTES = BM * D * 2;  // one Q tile
    // Persistent instances double-buffer Q: the producer loads the next tile's Q while the
    // consumers still run the key loop of this one.
    static constexpr int QB = PERSIST ? 2 : 1;
    static constexpr int KV_BYTES = BN * D * 2;  // one K (or V) tile
    // Output staging. d 256 has no room for a tile of its own (Q 64 KB + two stages of 80-key
    // K and V 160 KB), nor d 128 with 176-key tiles (Q 32 KB + K and V 176 KB): each warpgroup
    // stages its rows of O in its own rows of Q, which only its own S GEMMs read and which are
    // complete by then. The next tile's Q would overwrite them, so such instances are not
    // persistent.
    static constexpr bool O_IN_Q = D > 128 || BN > 128;
    static constexpr int O_BYTES = O_IN_Q ? 0 : BM * D * 2;
    // The persistent scheduler's tile ring: three slots, so that the producer can publish the
    // next tile while the consumers still hold this one's and the previous one's (which they
    // release after its epilogue).
    static constexpr int TILE_SLOTS = PERSIST ? 3 : 0;
    // Barriers: full and empty K[s] and V[s], a varlen tail's V, full and empty Q[i], full and
    // empty tile slots; then the slots.
    static constexpr int BAR_BYTES =
        8 * (4 * STAGES + 1 + 2 * QB + 2 * TILE_SLOTS) + TILE_SLOTS * (int)sizeof(TileSlot);
    // 1024 of slack to align the base to a swizzle atom.
    static constexpr int SMEM =
        1024 + QB * Q_BYTES + 2 * STAGES * KV_BYTES + O_BYTES + BAR_BYTES;
    // setmaxnreg budgets (a multiple of 8; producer + NWG consumers within 512 per thread slot).
    // The persistent producer also computes each tile's geometry for the tile ring (TileSlot),
    // and needs more than the others' 40.
    static constexpr int PRODUCER_REGS = NWG == 2 ? (PERSIST ? 56 : 40) : 32;
    static constexpr int CONSUMER_REGS = NWG == 2 ? (PERSIST ? 224 : 232) : 160;
};

template <typename T, int D, int NWG, int BN, int STAGES, bool PINGPONG, bool PERSIST, bool MODS>
__device__ __forceinline__ void flash_fwd_sm90(const FlashParams& p, const TmaMap* tq,
                                               const TmaMap* tk, const TmaMap* tv,
                                               const TmaMap* to, int o_mode,
                                               int* tile_counter, int group) {
    using Tr = Traits<T, D, NWG, BN, STAGES, PERSIST>;
    constexpr int QB = Tr::QB;
    // Lazy rescaling (see the softmax) and P kept in its registers until its P V GEMM has been
    // waited for (pin_regs), so that the softmax overlaps that GEMM. Measured on an H100
    // (BENCHMARKS.md, 2026-11-22, ~17:00): +2-10% at d 256, 1.00-1.04x at d 128 seq 8192 and
    // within the noise at 2048, and 0-6% slower at d 64, whose instances keep the eager form.
    constexpr bool LAZY = D >= 128;
    // How this instance writes O (O_STORE_*): the launch's o_mode on persistent instances only.
    const int o_store = PERSIST ? o_mode : O_STORE_THREADS;
    constexpr int BM = Tr::BM, CH = Tr::CH;
    constexpr int NT = BN / 8, DT = D / 8;
    // Whole swizzle atoms: 64-column chunks, and 8-row groups so every K/V chunk (BN rows of
    // 128 bytes) starts 1024-byte aligned; P V steps through the keys 16 at a time.
    static_assert(D % 64 == 0 && BN % 16 == 0, "whole swizzle atoms");
    static_assert(!(Tr::O_IN_Q && PERSIST), "O staged in Q: the next tile's Q would overwrite it");

    extern __shared__ __align__(1024) unsigned char smem_raw[];
    // Aligned by an offset from smem_raw (not integer casts), so the compiler still knows every
    // derived pointer is shared memory (32-bit addresses, STS instead of generic stores).
    unsigned char* base = smem_raw + ((1024 - (saddr(smem_raw) & 1023)) & 1023);
    constexpr int QS = QB * Tr::Q_BYTES;
    T* sQ = reinterpret_cast<T*>(base);
    T* sK = reinterpret_cast<T*>(base + QS);
    T* sV = reinterpret_cast<T*>(base + QS + STAGES * Tr::KV_BYTES);
    T* sO = reinterpret_cast<T*>(base + QS + 2 * STAGES * Tr::KV_BYTES);
    uint64_t* bars =
        reinterpret_cast<uint64_t*>(base + QS + 2 * STAGES * Tr::KV_BYTES + Tr::O_BYTES);
    // The mbarriers, in Traits::BAR_BYTES: full and empty K and V stages, a varlen tail's V
    // (see the producer), full and empty Q buffers (tile n uses buffer n % QB), then the full
    // and empty barriers of the tile ring's slots, whose TileSlots follow. A slot is full once
    // the producer has written it (one arrival), empty once every consumer thread has read what
    // it needs from it (after its tile's epilogue).
    constexpr int SLOTS = Tr::TILE_SLOTS;
    auto bar_fk = [&](int s) { return saddr(bars + s); };
    auto bar_fv = [&](int s) { return saddr(bars + STAGES + s); };
    auto bar_ek = [&](int s) { return saddr(bars + 2 * STAGES + s); };
    auto bar_ev = [&](int s) { return saddr(bars + 3 * STAGES + s); };
    const uint32_t bar_tail = saddr(bars + 4 * STAGES);
    auto bar_q = [&](int i) { return saddr(bars + 4 * STAGES + 1 + i); };
    auto bar_qe = [&](int i) { return saddr(bars + 4 * STAGES + 1 + QB + i); };
    auto bar_sf = [&](int s) { return saddr(bars + 4 * STAGES + 1 + 2 * QB + s); };
    auto bar_se = [&](int s) { return saddr(bars + 4 * STAGES + 1 + 2 * QB + SLOTS + s); };
    TileSlot* slots = reinterpret_cast<TileSlot*>(bars + 4 * STAGES + 1 + 2 * QB + 2 * SLOTS);

    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    // PERSIST: tile i of q_tiles x heads x batch, in the scheduler's order: groups of `group`
    // (batch, head) pairs (heads fastest), and within a group the query tiles from the last to
    // the first, the group's pairs fastest; the longest causal tiles run first and the K/V of
    // the tiles in flight stay in L2. Tiles past a (varlen) sequence's end are skipped by the
    // producer and never reach the consumers. Otherwise one block per tile, grid
    // (q_tiles, heads, batch), the last query tile first.
    const int q_tiles = PERSIST ? (p.seq_q + BM - 1) / BM : (int)gridDim.x;
    const int pairs = p.heads * p.batch;
    const int total = PERSIST ? q_tiles * pairs : 1;
    auto tile_geom = [&](int tile, int& h, int& b, BlockGeom& g) {
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
    };
    // The geometry of the block's n-th tile (index t): from its slot of the tile ring
    // (PERSIST), else from the grid.
    auto geom_of = [&](int n, int t, int& h, int& b, BlockGeom& g) {
        if constexpr (PERSIST) read_slot(slots + n % SLOTS, h, b, g);
        else tile_geom(t, h, b, g);
    };

    if (tid == 0) {
        for (int i = 0; i < QB; ++i) {
            mbar_init(bar_q(i), 1);
            mbar_init(bar_qe(i), 4 * NWG);
        }
        for (int i = 0; i < SLOTS; ++i) {
            mbar_init(bar_sf(i), 1);
            mbar_init(bar_se(i), 128 * NWG);
        }
        mbar_init(bar_tail, 1);
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(bar_fk(s), 1);
            mbar_init(bar_fv(s), 1);
            mbar_init(bar_ek(s), 4 * NWG);
            mbar_init(bar_ev(s), 4 * NWG);
        }
        mbar_init_fence();
        proxy_fence();
    }
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
            // The next tile of the scheduler: the first of block c is tile c, the counter (zero
            // at launch) hands out the rest from gridDim.x on. Warp-uniform.
            auto next_tile = [&]() {
                int t = 0;
                if (lane == 0) t = atomicAdd(tile_counter, 1);
                return __shfl_sync(0xffffffff, t, 0) + (int)gridDim.x;
            };
            int kv_it = 0, n_tile = 0;
            uint32_t tail_phase = 0;
            int tile = PERSIST ? (int)blockIdx.x : 0;
            // Q of tile n (its geometry h, b, g) into buffer n % QB, once the consumers are done
            // with the Q it held, that of tile n - QB.
            auto load_q = [&](int n, int h, int b, const BlockGeom& g) {
                const int qi = n % QB;
                if (n >= QB) mbar_wait(bar_qe(qi), (uint32_t)((n / QB - 1) & 1));
                mbar_expect_tx(bar_q(qi), Tr::Q_BYTES);
                const int qb = (p.cu_q || p.q_uniform) ? 0 : b;
                const int q_row = (int)(g.q_row0 + g.m0);
#pragma unroll
                for (int c = 0; c < CH; ++c)
                    tma_load_4d(saddr(sQ + qi * BM * D + c * BM * 64), tq, bar_q(qi), c * 64, h,
                                q_row, qb);
            };
            // PERSIST: the first tile from `tile` on that has query rows (or -1: none is left)
            // and its geometry into slot n % SLOTS, once the consumers are done with the tile it
            // held (n - SLOTS), then its Q. False when none is left.
            auto publish = [&](int n) {
                if constexpr (!PERSIST) {
                    return false;
                } else {
                    int h, b;
                    BlockGeom g;
                    while (tile < total && !tile_geom(tile, h, b, g)) tile = next_tile();
                    const int s = n % SLOTS;
                    if (n >= SLOTS) mbar_wait(bar_se(s), (uint32_t)((n / SLOTS - 1) & 1));
                    if (lane == 0) {
                        slots[s].tile = tile < total ? tile : -1;
                        if (tile < total) {
                            slots[s].h = h;
                            slots[s].b = b;
                            slots[s].g = g;
                        }
                        mbar_arrive(bar_sf(s));  // release: the slot's writes come first
                    }
                    if (tile >= total) return false;
                    if (issuer) {
                        read_slot(slots + s, h, b, g);
                        load_q(n, h, b, g);
                    }
                    return true;
                }
            };
            // The K and V loads of tile n_tile: its first K tile (part 0) or the rest (part 1).
            // The geometry comes back from the tile's slot each time (PERSIST), so none of it
            // stays live across the next tile's publication.
            auto load_kv = [&](int part) {
                if (!issuer) return;
                int h, b;
                BlockGeom g;
                geom_of(n_tile, tile, h, b, g);
                const int kvh = h / p.kv_group;
                const int t_begin = g.n_lo / BN;
                const int t_end = g.n_hi > g.n_lo ? (g.n_hi + BN - 1) / BN : t_begin;
                const int kb = p.cu_k ? 0 : b;
                // K runs one tile ahead of V (K(t + 1) is issued before V(t)): a K stage is
                // released as soon as its S GEMM completes, a V stage only after its P V GEMM,
                // so waiting for V first would hold back the next K.
                auto load_k = [&](int t, int it) {
                    const int s = it % STAGES;
                    const int k_row = (int)(g.k_row0 + (int64_t)t * BN);
                    if (it >= STAGES) mbar_wait(bar_ek(s), ((it / STAGES) & 1) ^ 1);
                    mbar_expect_tx(bar_fk(s), Tr::KV_BYTES);
#pragma unroll
                    for (int c = 0; c < CH; ++c)
                        tma_load_4d(saddr(sK + s * BN * D + c * BN * 64), tk, bar_fk(s), c * 64,
                                    kvh, k_row, kb);
                };
                auto load_v = [&](int t, int it) {
                    const int s = it % STAGES;
                    const int k_row = (int)(g.k_row0 + (int64_t)t * BN);
                    if (it >= STAGES) mbar_wait(bar_ev(s), ((it / STAGES) & 1) ^ 1);
                    // Varlen: a tile past the sequence's end also holds the next sequence's
                    // first rows. P is exactly 0 there, but 0 * NaN is NaN: so such a V tile
                    // lands on bar_tail, the rows of the last 16-row step the P V product reads
                    // (it stops there, see the consumers) are zeroed, and only then is the stage
                    // full. K needs nothing: its scores are masked by a select.
                    const int valid = g.sk - t * BN;
                    const bool tail = p.cu_k && valid < BN;
                    const uint32_t vbar = tail ? bar_tail : bar_fv(s);
                    mbar_expect_tx(vbar, Tr::KV_BYTES);
#pragma unroll
                    for (int c = 0; c < CH; ++c)
                        tma_load_4d(saddr(sV + s * BN * D + c * BN * 64), tv, vbar, c * 64, kvh,
                                    k_row, kb);
                    if (tail) {
                        mbar_wait(bar_tail, tail_phase);
                        tail_phase ^= 1;
                        const int end = min(BN, (valid + 15) / 16 * 16);
                        for (int c = 0; c < CH; ++c)
                            for (int r = valid; r < end; ++r)
#pragma unroll
                                for (int u = 0; u < 8; ++u)
                                    *reinterpret_cast<uint4*>(sV + s * BN * D + c * BN * 64 +
                                                              r * 64 + u * 8) =
                                        make_uint4(0, 0, 0, 0);
                        proxy_fence();
                        mbar_arrive(bar_fv(s));
                    }
                };
                if (part == 0) {
                    if (t_end > t_begin) load_k(t_begin, kv_it);
                    return;
                }
                for (int t = t_begin + 1; t < t_end; ++t) {
                    load_k(t, kv_it + t - t_begin);
                    load_v(t - 1, kv_it + t - 1 - t_begin);
                }
                if (t_end > t_begin) load_v(t_end - 1, kv_it + t_end - 1 - t_begin);
                kv_it += t_end - t_begin;
            };
            [[maybe_unused]] bool have = true;
            if constexpr (PERSIST) have = publish(0);
            for (;;) {
                if constexpr (PERSIST) {
                    if (!have) break;
                } else {
                    int h, b;
                    BlockGeom g;
                    if (n_tile > 0 || !tile_geom(tile, h, b, g)) break;
                    load_q(0, h, b, g);
                }
                load_kv(0);
                if constexpr (PERSIST) {
                    // The next tile, its slot and its Q go out now, a whole tile ahead: the
                    // consumers find that Q in place when they start the tile, and the
                    // scheduler's atomic is off the path from one tile to the next.
                    __syncwarp();
                    tile = next_tile();
                    have = publish(n_tile + 1);
                }
                load_kv(1);
                if constexpr (PERSIST) __syncwarp();
                ++n_tile;
            }
        }
        return;
    }

    // ---- consumer warpgroups ----
    setmaxnreg_inc<Tr::CONSUMER_REGS>();
    const int wg = warp / 4 - 1;   // 0 .. NWG-1
    const int wt = tid % 128;      // thread in the warpgroup
    const int ww = wt / 32;        // warp in the warpgroup
    const int row_base = 64 * wg + 16 * ww + lane / 4;  // this thread's rows: +0 and +8
    const float unit = MODS ? 1.f : p.scale_log2;
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
        // The producer's next tile (-1: none left) and its geometry. Each warpgroup goes on as
        // soon as it is there, without waiting for the other one.
        const int s = n_tile % SLOTS;
        mbar_wait(bar_sf(s), (uint32_t)((n_tile / SLOTS) & 1));
        tile = slots[s].tile;
        if (tile < 0) break;
        read_slot(slots + s, h, b, g);
    } else {
        if (n_tile > 0 || !tile_geom(tile, h, b, g)) break;
    }
    const int t_begin = g.n_lo / BN;
    const int t_end = g.n_hi > g.n_lo ? (g.n_hi + BN - 1) / BN : t_begin;
    const int diag_t = g.m0 + row_base + g.sk - g.sq;
    const float slope_log2 = MODS && p.alibi ? p.alibi[g.slope_idx] * LOG2E_F : 0.f;

    float acc_o[D / 2];
    float row_m[2] = {-INFINITY, -INFINITY}, row_l[2] = {0.f, 0.f};
#pragma unroll
    for (int i = 0; i < D / 2; ++i) acc_o[i] = 0.f;

    const int qi = n_tile % QB;
    const uint32_t q_base = saddr(sQ + qi * BM * D) + wg * 64 * 128;
    mbar_wait(bar_q(qi), (uint32_t)((n_tile / QB) & 1));

    // Issue S = Q K^T of the tile in stage s (not waited for).
    // Descriptors are built from one base each per call and offset by constants (the start
    // address is the low field, in 16-byte units, and never carries out of it: shared memory is
    // below 256 KB), so no per-step descriptor stays live across the key loop.
    auto issue_s = [&](float* acc_s, int s) {
        const uint64_t dq = make_desc(opaque(q_base), 16, 1024);
        const uint64_t dk = make_desc(saddr(sK) + s * BN * D * 2, 16, 1024);
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            const uint64_t da = dq + (uint64_t)(((kk / 4) * BM * 128 + (kk % 4) * 32) >> 4);
            const uint64_t db = dk + (uint64_t)(((kk / 4) * BN * 128 + (kk % 4) * 32) >> 4);
            mma_ss<T, BN>(acc_s, da, db, kk > 0);
        }
    };
    // Issue O += P V of the tile in stage s.
    // Issue O += P V of the tile in stage s, over its first nk 16-key steps (a varlen tail
    // tile's last step ends its keys: the V rows after it are not read, see the producer).
    auto issue_pv = [&](const uint32_t (*pa)[4], int s, int nk) {
        const uint64_t dv = make_desc(saddr(sV) + s * BN * D * 2, BN * 128, 1024);
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
            const uint64_t db = dv + (uint64_t)((kk * 16 * 128) >> 4);
            if (kk < nk) mma_rs<T, D>(acc_o, pa[kk], db, 1);
        }
    };
    // Masks, score modifiers and the online softmax of tile t in place (acc_s becomes P in
    // f32); alpha receives the factors O must be scaled by once the previous P V has completed,
    // and the result says whether any row of this warp needs it. Each row keeps a reference max
    // m. LAZY instances move m only when a tile's max exceeds it by more than 2^RESCALE_LOG2:
    // exps are taken against m, so P stays below 2^8 (f16 and bf16 hold it with the same
    // relative rounding as P <= 1), and l and O are rescaled only when m moves, which after a
    // row's first tiles is rare. The others move m to every new max and always rescale.
    // The masks of the tile at key k0 (this thread's first column `col`): hidden scores become
    // -inf.
    auto apply_mask = [&](float* acc_s, int k0, int col) {
        if (!tile_is_full(p, g, k0, BN)) {
            // Each row's visible keys relative to this thread's first column.
            int lo[2], hi[2];
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
                const KeySpan ks = key_span(p, diag_t + hf * 8, g.sk, col);
                lo[hf] = ks.lo;
                hi[hf] = ks.hi;
            }
#pragma unroll
            for (int j = 0; j < NT; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int c = j * 8 + e % 2;
                    if (c < lo[e / 2] || c >= hi[e / 2]) acc_s[4 * j + e] = -INFINITY;
                }
        }
    };
    // P = 2^(s unit - m_scaled) in place over row half `hf` of this thread's columns; returns
    // their sum.
    auto exps = [&](float* acc_s, int hf, float m_scaled) {
        float sum = 0.f;
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const float pv = fast_exp2(fmaf(acc_s[4 * j + 2 * hf + e], unit, -m_scaled));
                acc_s[4 * j + 2 * hf + e] = pv;
                sum += pv;
            }
        return sum;
    };
    // LAZY, no score modifiers, every row's m finite: the exps of tile t against the current m,
    // with no max first. When each of this thread's row sums is below 2^7, no P reached 2^7, so
    // no score passed m by the margin of 2^8 and the exact softmax below would not move m
    // either: P and the sums (returned in `sums`) are what it computes, bit for bit (for scores
    // whose rounding stays far inside the margin, below ~2^22 in base-2 units; past that both
    // keep every P below 2^8 and are equally valid). Otherwise (false) acc_s holds exps that may
    // have overflowed, and S must be computed again.
    auto softmax_spec = [&](float* acc_s, int t, float* sums) {
        const int k0 = t * BN;
        apply_mask(acc_s, k0, k0 + 2 * (lane % 4));
        bool ok = true;
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
            const float m_scaled = row_m[hf] * unit;
            const float sum = exps(acc_s, hf, m_scaled);
            sums[hf] = sum;
            ok = ok && sum < 128.f;  // false for NaN
        }
        return ok;
    };
    auto softmax = [&](float* acc_s, int t, float* alpha) {
        const int k0 = t * BN;
        const int col = k0 + 2 * (lane % 4);
        if constexpr (MODS) {
#pragma unroll
            for (int j = 0; j < NT; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    acc_s[4 * j + e] = modded_score(p, acc_s[4 * j + e], slope_log2,
                                                    diag_t + (e / 2) * 8, col + j * 8 + e % 2);
        }
        apply_mask(acc_s, k0, col);
        bool moved = false;
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
            // The tile's row max as a tree (short dependency chains).
            float mt[NT];
#pragma unroll
            for (int j = 0; j < NT; ++j)
                mt[j] = fmaxf(acc_s[4 * j + 2 * hf], acc_s[4 * j + 2 * hf + 1]);
#pragma unroll
            for (int w = 1; w < NT; w *= 2)
#pragma unroll
                for (int j = 0; j + w < NT; j += 2 * w) mt[j] = fmaxf(mt[j], mt[j + w]);
            float mx = mt[0];
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 2));
            // The first finite max sets m (from -inf); later ones move it only past the margin.
            const bool move = mx * unit > fmaf(row_m[hf], unit, LAZY ? RESCALE_LOG2 : 0.f);
            const float m_old = row_m[hf];
            if (move) row_m[hf] = mx;
            alpha[hf] = move ? fast_exp2(fmaf(m_old, unit, -mx * unit)) : 1.f;
            moved |= move;
            // A row that has seen only masked keys keeps m = -inf; subtracting 0 instead keeps
            // exp2 at 0 rather than NaN (-inf - -inf).
            const float m_scaled = row_m[hf] == -INFINITY ? 0.f : row_m[hf] * unit;
            const float sum = exps(acc_s, hf, m_scaled);
            row_l[hf] = row_l[hf] * alpha[hf] + sum;
        }
        if constexpr (LAZY) return __any_sync(0xffffffff, moved) != 0;
        return true;
    };
    auto pack_p = [&](const float* acc_s, uint32_t (*pa)[4]) {
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
            pa[kk][0] = flash::Mma<T>::pack(acc_s[8 * kk + 0], acc_s[8 * kk + 1]);
            pa[kk][1] = flash::Mma<T>::pack(acc_s[8 * kk + 2], acc_s[8 * kk + 3]);
            pa[kk][2] = flash::Mma<T>::pack(acc_s[8 * kk + 4], acc_s[8 * kk + 5]);
            pa[kk][3] = flash::Mma<T>::pack(acc_s[8 * kk + 6], acc_s[8 * kk + 7]);
        }
    };
    // Ping-pong: warpgroups take turns issuing their GEMMs (named barrier PP_BAR + w lets warpgroup w
    // go; it then lets w + 1 go), so one warpgroup's softmax runs under another's GEMMs. Every
    // warpgroup issues the same number of times (the tile range is the block's).
    auto turn_begin = [&]() {
        if constexpr (PINGPONG) named_sync(PP_BAR + wg, 256);
    };
    auto turn_end = [&]() {
        if constexpr (PINGPONG) named_arrive(PP_BAR + (wg + 1) % NWG, 256);
    };

    if (t_end > t_begin) {
        float acc_s[BN / 2];
        uint32_t pa[BN / 16][4];
        float alpha[2];
        // First tile: S, softmax, P.
        {
            const int s0 = kv_it % STAGES;
            mbar_wait(bar_fk(s0), (uint32_t)((kv_it / STAGES) & 1));
            turn_begin();
            wg_fence();
            issue_s(acc_s, s0);
            wg_commit();
            turn_end();
            wg_wait<0>();
            reg_fence(acc_s);
            if (lane == 0) mbar_arrive(bar_ek(s0));
        }
        softmax(acc_s, t_begin, alpha);
        pack_p(acc_s, pa);
        // Steady state: S of tile t and P V of tile t - 1 in flight together; the softmax of t
        // runs while P V completes.
        for (int t = t_begin + 1; t < t_end; ++t) {
            const int it = kv_it + t - t_begin, s = it % STAGES, sp = (it - 1) % STAGES;
            const uint32_t ph = (uint32_t)((it / STAGES) & 1);
            const uint32_t php = (uint32_t)(((it - 1) / STAGES) & 1);
            mbar_wait(bar_fk(s), ph);
            mbar_wait(bar_fv(sp), php);
            turn_begin();
            wg_fence();
            issue_s(acc_s, s);
            wg_commit();
            issue_pv(pa, sp, BN / 16);
            wg_commit();
            turn_end();
            wg_wait<1>();
            reg_fence(acc_s);
            bool moved;
            if constexpr (LAZY && !MODS) {
                // The row max is needed only when m may move (see softmax_spec): its 64 max
                // instructions (half rate, and half again under the other warpgroup's wgmma,
                // scripts/sm90-probe) and its shuffles stay off the common path, and the exps
                // start as soon as S has landed. When any warp of the warpgroup finds a sum too
                // large, the warpgroup computes S again (its K stage is released only after
                // this) and takes the exact path.
                float sums[2];
                const bool spec =
                    __all_sync(0xffffffff, row_m[0] != -INFINITY && row_m[1] != -INFINITY);
                const bool ok = spec && softmax_spec(acc_s, t, sums);
                const bool again = named_any(EPI_BAR + wg, 128, spec && !ok);
                if (again) {
                    wg_fence();
                    issue_s(acc_s, s);
                    wg_commit();
                    wg_wait<0>();
                    reg_fence(acc_s);
                }
                if (spec && !again) {
                    row_l[0] += sums[0];
                    row_l[1] += sums[1];
                    moved = false;
                } else {
                    moved = softmax(acc_s, t, alpha);
                }
                if (lane == 0) mbar_arrive(bar_ek(s));
            } else {
                if (lane == 0) mbar_arrive(bar_ek(s));
                moved = softmax(acc_s, t, alpha);
            }
            if constexpr (LAZY) pin_regs(pa, g.sk < 0, saddr(sO), row_l[0]);
            wg_wait<0>();
            reg_fence(acc_o);
            if (lane == 0) mbar_arrive(bar_ev(sp));
            if (moved) {
#pragma unroll
                for (int j = 0; j < DT; ++j) {
                    acc_o[4 * j + 0] *= alpha[0];
                    acc_o[4 * j + 1] *= alpha[0];
                    acc_o[4 * j + 2] *= alpha[1];
                    acc_o[4 * j + 3] *= alpha[1];
                }
            }
            pack_p(acc_s, pa);
        }
        // Every S of this tile is complete: the producer may load this Q buffer again.
        if (lane == 0) mbar_arrive(bar_qe(qi));
        // Last tile's P V.
        {
            const int it = kv_it + t_end - 1 - t_begin, sp = it % STAGES;
            const int valid = g.sk - (t_end - 1) * BN;
            const int nk = p.cu_k && valid < BN ? (valid + 15) / 16 : BN / 16;
            mbar_wait(bar_fv(sp), (uint32_t)((it / STAGES) & 1));
            turn_begin();
            wg_fence();
            // Whole tiles (every dense call) take the unguarded issue.
            if (nk == BN / 16) issue_pv(pa, sp, BN / 16);
            else issue_pv(pa, sp, nk);
            wg_commit();
            turn_end();
            wg_wait<0>();
            reg_fence(acc_o);
            if (lane == 0) mbar_arrive(bar_ev(sp));
        }
    } else if (lane == 0) {
        mbar_arrive(bar_qe(qi));  // no key: Q was loaded but is not read
    }
    kv_it += t_end - t_begin;

    // Epilogue: normalise, lse, stage this warpgroup's 64 rows in shared memory in the tensor
    // copy engine's 128-byte-swizzled layout, then one bulk tensor store per 64-column chunk
    // (issued by one thread; the warpgroup goes on to its next tile), or 16-byte coalesced
    // stores by every thread (o_mode, above).
    // Chunk c of the staged rows: in sO, or (O_IN_Q) in this warpgroup's rows of Q.
    auto o_chunk = [&](int c) {
        if constexpr (Tr::O_IN_Q) return sQ + c * BM * 64 + 64 * wg * 64;
        else return sO + wg * 64 * D + c * 64 * 64;
    };
    // Element (r, 8 u) of the staged rows.
    auto o_at = [&](int r, int u) { return o_chunk(u / 8) + r * 64 + ((u % 8) ^ (r % 8)) * 8; };
    // This warpgroup's stores of the previous tile have read its staged rows.
    if (o_store != O_STORE_THREADS && wt == 0) bulk_wait_read();
    named_sync(EPI_BAR + wg, 128);
    // The geometry again rather than carried through the key loop (registers); a persistent
    // instance then releases the tile's slot (the producer fills it with the tile SLOTS later).
    geom_of(n_tile, tile, h, b, g);
    // Every thread arrives: an arrival releases only the arriving thread's own reads.
    if constexpr (PERSIST) mbar_arrive(bar_se(n_tile % SLOTS));
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
        float l = row_l[hf];
        l += __shfl_xor_sync(0xffffffff, l, 1);
        l += __shfl_xor_sync(0xffffffff, l, 2);
        const float inv = l > 0.f ? 1.f / l : 0.f;
        const int r = row_base + hf * 8;  // row in the block
        if (lane % 4 == 0 && r < g.rows)
            p.lse[g.lse0 + r] = l > 0.f ? (row_m[hf] * unit + __log2f(l)) * LN2_F : -INFINITY;
        const int rl = r - 64 * wg;
#pragma unroll
        for (int j = 0; j < DT; ++j) {
            const int c = j * 8 + 2 * (lane % 4);
            *reinterpret_cast<uint32_t*>(o_at(rl, c / 8) + c % 8) =
                flash::Mma<T>::pack(acc_o[4 * j + 2 * hf] * inv, acc_o[4 * j + 2 * hf + 1] * inv);
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
        ++n_tile;
        continue;
    }
    T* og = static_cast<T*>(p.o) + (g.out_row0 + g.m0 + 64 * wg) * p.o_seq + (int64_t)h * p.o_head;
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
    ++n_tile;
    }
    // The shared memory of the last bulk stores stays allocated until they have read it.
    if (o_store != O_STORE_THREADS && wt == 0) bulk_wait_read();
    if constexpr (PINGPONG) {
        if (wg == 0) named_sync(PP_BAR, 256);
    }
}

}  // namespace sm90

// One entry point per instance (kernels/sm90/flash_sm90.cu lists them, with the `_mods` ones for
// softcap / ALiBi). The tensor maps are __grid_constant__ so their addresses are those of the
// kernel parameters.
#define FLASH_SM90_INSTANCE(NAME, T, D, NWG, BN, STAGES, PP, PERSIST, MODS, SMEM_BYTES)         \
    static_assert(sm90::Traits<T, D, NWG, BN, STAGES, PERSIST>::SMEM == SMEM_BYTES,            \
                  "src/cuda/instances.rs and the sm_90a forward disagree on shared memory");    \
    extern "C" __global__ void __launch_bounds__(128 * (NWG + 1), 1)                           \
        NAME(const FlashParams p, const __grid_constant__ TmaMap tq,                           \
             const __grid_constant__ TmaMap tk, const __grid_constant__ TmaMap tv,             \
             const __grid_constant__ TmaMap to, int o_mode, int* tile_counter, int group) {    \
        sm90::flash_fwd_sm90<T, D, NWG, BN, STAGES, PP, PERSIST, MODS>(p, &tq, &tk, &tv, &to,  \
                                                                       o_mode, tile_counter,   \
                                                                       group);                 \
    }
