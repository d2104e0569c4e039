// FlashAttention-2 backward for Hopper (sm_90a), deterministic: the sm_80 design of
// backward/mma.cuh (a dK/dV pass, then a dQ pass, no atomics, every run bitwise identical) on
// the Hopper machinery of the forward (the primitives of sm90/ptx.cuh): TMA loads into
// 128-byte-swizzled shared memory, mbarrier rings, one producer warp and two consumer warpgroups
// (setmaxnreg), wgmma with f32 accumulators. The D pass (rowsum(dO * O)) is the portable module's
// bwd_dsum. Masks, windows, GQA and varlen follow backward/mma.cuh through common/mask.cuh,
// softcap and ALiBi through common/score.cuh.
//
// dkdv: one block per (key tile of BN = 128 keys, K/V head, batch); consumer warpgroup w owns
//   keys [64 w, 64 w + 64) of the tile and keeps their dK and dV in registers for the whole
//   block. K and V are loaded once; the block walks every query head of the K/V group and, in
//   it, every BQ-row query tile that sees the key tile, streaming Q, dO (TMA) and the tile's
//   base-2 lse and D (the producer warp's lanes) through a STAGES-deep ring. Per step, in the
//   transposed orientation (rows = keys, columns = queries):
//     S^T = K Q^T, dP^T = V dO^T            wgmma SS (K, V rows; Q, dO K-major)
//     P^T = exp2(S^T log2e scale - lse), dS^T = P^T (dP^T - D) [(1 - tanh^2)]
//     dV += P^T dO, dK += dS^T Q            wgmma RS (P^T, dS^T from registers; dO, Q MN-major)
// dq: one block per (query tile of BM = 128 rows, head, batch), the forward kernel's shape;
//   warpgroup w owns rows [64 w, 64 w + 64). Q and dO are loaded once, K and V stream BN keys at
//   a time: S = Q K^T, dP = dO V^T (SS), dS = P (dP - D), dQ += dS K (RS, K MN-major). Seven
//   products per pair of tiles instead of the fused kernel's five, but no atomics.
// Scheduling within a block, per instance (src/cuda/backward/instances.rs picks them): one step
//   at a time, the two warpgroups interleaving freely; the same with PINGPONG (they take turns
//   issuing products, so one's element-wise work runs under the other's products); or OVERLAP
//   (the next step's first products issued before this step's last ones, FlashAttention-3's
//   intra-warpgroup overlap; more registers). Full tiles run an element-wise loop without mask
//   tests; tiles a mask or a sequence end cuts run a second copy with them.
// Both write their gradients once, from registers, in T (dK and dQ scaled by the softmax scale).
// Grids are (tiles, heads, batch), the tile index fastest: the blocks resident at once are the
// tiles of a few heads, which read the same streamed operand (Q and dO, or K and V) at about the
// same time, so most of those reads hit L2. (With the tile index last, they were as many
// different heads as SMs, whose streams did not fit L2 at short sequences.) Within a head the
// tiles with the most work (causal: the first key tiles, the last query tiles) launch first.
#pragma once
#include "backward/common.cuh"
#include "common/mask.cuh"
#include "common/math.cuh"
#include "common/ptx.cuh"
#include "common/score.cuh"
#include "sm90/ptx.cuh"

namespace sm90 {

template <int D, int BQ, int STAGES>
struct DkdvTraits {
    static constexpr int NWG = 2;
    static constexpr int BN = 64 * NWG;  // keys per block
    static constexpr int THREADS = 128 * (NWG + 1);
    static constexpr int KV_BYTES = BN * D * 2;  // K or V of the key tile
    static constexpr int Q_BYTES = BQ * D * 2;   // Q or dO of one step
    static constexpr int L_FLOATS = 2 * BQ;      // lse (base 2) and D of one step
    // Barriers: K/V full, full[s], empty[s], and the varlen tail copies' own (see zero_rows).
    static constexpr int BAR_BYTES = 8 * (2 + 2 * STAGES);
    static constexpr int SMEM =
        1024 + 2 * KV_BYTES + STAGES * 2 * Q_BYTES + STAGES * L_FLOATS * 4 + BAR_BYTES;
};

template <int D, int BN, int STAGES>
struct DqTraits {
    static constexpr int NWG = 2;
    static constexpr int BM = 64 * NWG;  // query rows per block
    static constexpr int THREADS = 128 * (NWG + 1);
    static constexpr int Q_BYTES = BM * D * 2;   // Q or dO of the tile
    static constexpr int KV_BYTES = BN * D * 2;  // K or V of one key tile
    // Barriers: Q/dO full, full[s], empty[s], and the varlen tail copies' own (see zero_rows).
    static constexpr int BAR_BYTES = 8 * (2 + 2 * STAGES);
    static constexpr int SMEM = 1024 + 2 * Q_BYTES + 2 * STAGES * KV_BYTES + BAR_BYTES;
};

// Varlen operands are one packed run of rows, so a tile that reaches past its sequence's end
// also holds the next sequence's first rows. The products multiply them by exact zeros, but
// 0 * NaN is NaN: a non-finite value in one sequence would reach its neighbour's gradients. Such
// tail tiles (VARLEN instances: the planner's `_varlen` twins) complete their copies on a barrier
// of their own; the producer warp then zeroes rows [from, ROWS) of each [D/64][ROWS][64] tile (a
// 128-byte row holds its swizzled 16-byte chunks in some order: whole rows are zeroed either
// way), orders the writes before the tensor cores' reads (proxy fence) and only then signals the
// stage full.
template <int D, int ROWS>
__device__ __forceinline__ void zero_rows(unsigned char* tile, int from, int lane) {
    const int n = (ROWS - from) * 8;  // 16-byte units per 64-column chunk
#pragma unroll
    for (int c = 0; c < D / 64; ++c)
        for (int i = lane; i < n; i += 32)
            *reinterpret_cast<uint4*>(tile + c * ROWS * 128 + from * 128 + i * 16) =
                make_uint4(0, 0, 0, 0);
}

// The producer warp's load of one ring stage: two [D/64][ROWS][64] tiles, A at `dst` and B right
// after it, from maps `ma` and `mb` at (column chunk, head, row ra / rb, batch). Lane 0 issues the
// copies; `full` then counts every lane of the warp (lane 0 through the expected bytes), except
// where only lane 0 runs this (a non-VARLEN dQ producer: one arrival). A VARLEN stage with
// `valid` < ROWS rows left in its sequence lands on `tail` first and is zeroed from there on
// (zero_rows) by the whole warp, which must run this then.
template <int D, int ROWS, bool VARLEN>
__device__ __forceinline__ void load_stage(unsigned char* dst, const TmaMap* ma, int ra,
                                           const TmaMap* mb, int rb, int head, int batch,
                                           uint32_t full, uint32_t tail, uint32_t& tail_phase,
                                           int valid, int lane) {
    constexpr int TILE = ROWS * D * 2;
    const bool cut = VARLEN && valid < ROWS;
    if (lane == 0) {
        const uint32_t bar = cut ? tail : full;
        mbar_expect_tx(bar, 2 * TILE);
#pragma unroll
        for (int c = 0; c < D / 64; ++c) {
            tma_load_4d(saddr(dst + c * ROWS * 128), ma, bar, c * 64, head, ra, batch);
            tma_load_4d(saddr(dst + TILE + c * ROWS * 128), mb, bar, c * 64, head, rb, batch);
        }
    }
    if (cut) {
        mbar_wait(tail, tail_phase);
        tail_phase ^= 1;
        zero_rows<D, ROWS>(dst, valid, lane);
        zero_rows<D, ROWS>(dst + TILE, valid, lane);
        proxy_fence();
        mbar_arrive(full);
    } else if (lane != 0) {
        mbar_arrive(full);
    }
}

// Consumer register budget: two warpgroups of 240 and a producer warpgroup of 24 fill the
// register file (FlashAttention-3's backward split).
constexpr int BWD_PRODUCER_REGS = 24;
constexpr int BWD_CONSUMER_REGS = 240;

// acc = A B^T over D columns: A = 64 rows of a [D/64][a_rows][64] tile at a_base (bytes, shared
// space), B = the N rows of a [D/64][N][64] tile at b_base; both K-major, 128-byte swizzle.
template <typename T, int D, int N>
__device__ __forceinline__ void gemm_abt(float* acc, uint32_t a_base, int a_rows, uint32_t b_base) {
    const uint64_t da0 = make_desc(a_base, 16, 1024);
    const uint64_t db0 = make_desc(b_base, 16, 1024);
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
        const uint64_t da = da0 + (uint64_t)(((kk / 4) * a_rows * 128 + (kk % 4) * 32) >> 4);
        const uint64_t db = db0 + (uint64_t)(((kk / 4) * N * 128 + (kk % 4) * 32) >> 4);
        mma_ss<T, N>(acc, da, db, kk > 0);
    }
}

// acc += A B: A = 64 x KR from registers (wgmma A fragments, KR / 16 k-steps), B = KR rows of a
// [D/64][KR][64] tile at b_base read MN-major (N = D).
template <typename T, int D, int KR>
__device__ __forceinline__ void gemm_rs(float* acc, const uint32_t (*a)[4], uint32_t b_base) {
    const uint64_t db0 = make_desc(b_base, KR * 128, 1024);
#pragma unroll
    for (int kk = 0; kk < KR / 16; ++kk)
        mma_rs<T, D>(acc, a[kk], db0 + (uint64_t)((kk * 16 * 128) >> 4), 1);
}

// An m64nN f32 accumulator (N / 2 floats) as N / 16 k-steps of wgmma A fragments in T.
template <typename T, int N>
__device__ __forceinline__ void pack_a(const float* acc, uint32_t (*a)[4]) {
#pragma unroll
    for (int kk = 0; kk < N / 16; ++kk)
#pragma unroll
        for (int x = 0; x < 4; ++x)
            a[kk][x] = flash::Mma<T>::pack(acc[8 * kk + 2 * x], acc[8 * kk + 2 * x + 1]);
}

// Ping-pong between the two consumer warpgroups (as in the forward): each issues its products
// only in its turn (named barrier PP_BAR + w, then hands the turn to the other), so one
// warpgroup's element-wise work runs under the other's products. Both issue the same number of
// times (the step count is the block's); warpgroup 0 goes first and takes warpgroup 1's last
// hand-over at the end.
template <bool PINGPONG>
__device__ __forceinline__ void turn_begin(int wg) {
    if constexpr (PINGPONG) named_sync(PP_BAR + wg, 256);
}
template <bool PINGPONG>
__device__ __forceinline__ void turn_end(int wg) {
    if constexpr (PINGPONG) named_arrive(PP_BAR + (wg + 1) % 2, 256);
}
__device__ __forceinline__ void pingpong_start(int wg) {
    if (wg == 1) named_arrive(PP_BAR, 256);
}
__device__ __forceinline__ void pingpong_end(int wg) {
    if (wg == 0) named_sync(PP_BAR, 256);
}

// The consumer step loop of both kernels, over steps 0 .. n - 1 (query steps of dK/dV, key tiles
// of dQ). Per step: `wait_full(s)`; the first products (S and dP, `first(s)`, committed); their
// accumulators' register fence `fence_first()`; `scores(s)` turns them into the gradient
// fragments' f32 values and `pack()` into A fragments; the second products (dV and dK, or dQ:
// `second(s)`, committed) and `fence_second()`; `release(s)` frees the stage. One step at a time,
// the two warpgroups taking turns with PINGPONG; or OVERLAP: step s's first products issued with
// step s - 1's second ones, its scores computed while those complete (the A fragments of s - 1
// are repacked only after they have).
template <bool OVERLAP, bool PINGPONG, class Wait, class First, class FenceFirst, class Scores,
          class Pack, class Second, class FenceSecond, class Release>
__device__ __forceinline__ void step_loop(int wg, int n, Wait wait_full, First first,
                                          FenceFirst fence_first, Scores scores, Pack pack,
                                          Second second, FenceSecond fence_second,
                                          Release release) {
    if (!OVERLAP) {
        // One product group in this warpgroup's turn, waited for.
        auto in_turn = [&](auto issue, auto fence, int s) {
            turn_begin<PINGPONG>(wg);
            wg_fence();
            issue(s);
            turn_end<PINGPONG>(wg);
            wg_wait<0>();
            fence();
        };
        if (PINGPONG) pingpong_start(wg);
        for (int s = 0; s < n; ++s) {
            wait_full(s);
            in_turn(first, fence_first, s);
            scores(s);
            pack();
            in_turn(second, fence_second, s);
            release(s);
        }
        if (PINGPONG) pingpong_end(wg);
    } else if (n > 0) {
        wait_full(0);
        wg_fence();
        first(0);
        wg_wait<0>();
        fence_first();
        scores(0);
        pack();
        for (int s = 1; s < n; ++s) {
            wait_full(s);
            wg_fence();
            first(s);
            second(s - 1);
            wg_wait<1>();
            fence_first();
            scores(s);
            wg_wait<0>();
            fence_second();
            release(s - 1);
            pack();
        }
        wg_fence();
        second(n - 1);
        wg_wait<0>();
        fence_second();
    }
}

template <typename T, int D, int BQ, int STAGES, bool OVERLAP, bool PINGPONG, bool MODS,
          bool VARLEN>
__device__ __forceinline__ void bwd_dkdv_sm90(const BwdParams& bp, const TmaMap* tq,
                                              const TmaMap* tk, const TmaMap* tv,
                                              const TmaMap* tdo) {
    using Tr = DkdvTraits<D, BQ, STAGES>;
    constexpr int BN = Tr::BN, CH = D / 64, NT = BQ / 8;
    static_assert(D % 64 == 0 && BQ % 64 == 0, "whole swizzle atoms");
    static_assert(!(OVERLAP && PINGPONG), "ping-pong is for the one-step-at-a-time loop");
    const FlashParams& p = bp.f;

    extern __shared__ __align__(1024) unsigned char smem_raw[];
    unsigned char* base = smem_raw + ((1024 - (saddr(smem_raw) & 1023)) & 1023);
    T* sK = reinterpret_cast<T*>(base);
    T* sV = reinterpret_cast<T*>(base + Tr::KV_BYTES);
    // Stage s: Q at sQ0 + s * 2 Q_BYTES, dO right after it.
    unsigned char* sQ0 = base + 2 * Tr::KV_BYTES;
    float* sL0 = reinterpret_cast<float*>(sQ0 + STAGES * 2 * Tr::Q_BYTES);
    uint64_t* bars = reinterpret_cast<uint64_t*>(sL0 + STAGES * Tr::L_FLOATS);
    const uint32_t bar_kv = saddr(bars);
    auto bar_full = [&](int s) { return saddr(bars + 1 + s); };
    auto bar_empty = [&](int s) { return saddr(bars + 1 + STAGES + s); };
    const uint32_t bar_tail = saddr(bars + 1 + 2 * STAGES);

    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    // Grid (key tiles, K/V heads, batch): see the header on the order.
    const int kvh = blockIdx.y, b = blockIdx.z;
    BlockGeom g;
    bwd::KeyTile kt;
    // Uniform over the block: a key tile past its sequence has no gradient to write.
    if (!bwd::key_tile<BN, BQ>(p, b, (int)blockIdx.x, g, kt)) return;
    const int steps = kt.m_count * p.kv_group;

    if (tid == 0) {
        mbar_init(bar_kv, 1);
        mbar_init(bar_tail, 1);
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(bar_full(s), 32);          // the producer warp's lanes (lse and D)
            // Every consumer thread: each releases its own reads of the stage's lse and D
            // (one arrival per warp after __syncwarp left compute-sanitizer's racecheck unsure).
            mbar_init(bar_empty(s), 128 * Tr::NWG);
        }
        mbar_init_fence();
        proxy_fence();
    }
    __syncthreads();

    const int qb = p.cu_q ? 0 : b;  // batch coordinate of the q and dO maps (varlen: packed)
    // Step s: query head kvh * group + s / m_count, query tile m_begin + s % m_count.
    auto step_head = [&](int s) { return kvh * p.kv_group + s / kt.m_count; };
    auto step_m0 = [&](int s) { return (kt.m_begin + s % kt.m_count) * BQ; };

    if (warp < 4) {
        // ---- producer: warp 0 (lane 0 issues the copies, every lane loads lse and D) ----
        setmaxnreg_dec<BWD_PRODUCER_REGS>();
        if (warp != 0) return;
        if (lane == 0) {
            prefetch_map(tq);
            prefetch_map(tk);
            prefetch_map(tv);
            prefetch_map(tdo);
            const int k_row = (int)(g.k_row0 + kt.n0);
            const int kb = p.cu_k ? 0 : b;
            mbar_expect_tx(bar_kv, 2 * Tr::KV_BYTES);
#pragma unroll
            for (int c = 0; c < CH; ++c) {
                tma_load_4d(saddr(sK + c * BN * 64), tk, bar_kv, c * 64, kvh, k_row, kb);
                tma_load_4d(saddr(sV + c * BN * 64), tv, bar_kv, c * 64, kvh, k_row, kb);
            }
        }
        uint32_t tail_phase = 0;
        for (int s = 0; s < steps; ++s) {
            const int st = s % STAGES;
            if (s >= STAGES) mbar_wait(bar_empty(st), (uint32_t)(((s / STAGES) - 1) & 1));
            const int h = step_head(s), m0 = step_m0(s);
            // Rows past the sequence: lse +inf (P = 0), D 0.
            const int64_t l0 = bwd::lse_index(p, b, h, g.q_row0, m0);
            float* sl = sL0 + st * Tr::L_FLOATS;
            for (int r = lane; r < BQ; r += 32) {
                const bool ok = m0 + r < g.sq;
                sl[r] = ok ? bwd::lse_log2(p.lse[l0 + r]) : INFINITY;
                sl[BQ + r] = ok ? bp.dsum[l0 + r] : 0.f;
            }
            // A varlen step past its sequence's end zeroes the next sequence's rows.
            const int q_row = (int)(g.q_row0 + m0);
            const int o_row = p.cu_q ? (int)(g.out_row0 + m0) : m0;
            load_stage<D, BQ, VARLEN>(sQ0 + st * 2 * Tr::Q_BYTES, tq, q_row, tdo, o_row, h, qb,
                                      bar_full(st), bar_tail, tail_phase, g.sq - m0, lane);
        }
        return;
    }

    // ---- consumers ----
    setmaxnreg_inc<BWD_CONSUMER_REGS>();
    const int wg = warp / 4 - 1;
    const int ww = (tid % 128) / 32;
    const int key_l = 64 * wg + 16 * ww + lane / 4;  // this thread's keys: +0 and +8 (in tile)
    const int n0 = kt.n0;
    const int off = (int)kt.off;  // sk - sq: |off| < 2^30, 32 bits (registers)
    const uint32_t k_base = saddr(sK) + wg * 64 * 128;
    const uint32_t v_base = saddr(sV) + wg * 64 * 128;
    auto q_addr = [&](int st) { return saddr(sQ0) + st * 2 * Tr::Q_BYTES; };

    float acc_dk[D / 2], acc_dv[D / 2];
#pragma unroll
    for (int i = 0; i < D / 2; ++i) acc_dk[i] = acc_dv[i] = 0.f;
    float acc_s[BQ / 2], acc_dp[BQ / 2];
    uint32_t pa[BQ / 16][4], da[BQ / 16][4];

    // The products of step s, issued (after a wgmma fence) and committed, not waited for.
    auto wait_full = [&](int s) { mbar_wait(bar_full(s % STAGES), (uint32_t)((s / STAGES) & 1)); };
    auto issue_sdp = [&](int s) {
        const int st = s % STAGES;
        gemm_abt<T, D, BQ>(acc_s, opaque(k_base), BN, q_addr(st));
        gemm_abt<T, D, BQ>(acc_dp, opaque(v_base), BN, q_addr(st) + Tr::Q_BYTES);
        wg_commit();
    };
    // P^T and dS^T of step s in place of S^T and dP^T. Element (j, e): key n0 + key_l + 8 (e / 2),
    // query m0 + 8 j + 2 (lane % 4) + e % 2.
    auto grads_of_scores = [&](int s) {
        const int st = s % STAGES;
        const int h = step_head(s), m0 = step_m0(s);
        const float* sl = sL0 + st * Tr::L_FLOATS;
        bool full = n0 + BN <= g.sk && m0 + BQ <= g.sq;
        if (p.win_left >= 0 && (int64_t)m0 + BQ - 1 + off - p.win_left > n0) full = false;
        if (p.win_right >= 0 && (int64_t)n0 + BN - 1 > m0 + off + p.win_right) full = false;
        if constexpr (!MODS) {
            // Two copies of the loop: full tiles (most of them) test nothing. Query rows past
            // the sequence need no test either: their lse is +inf, so P = 0.
            auto body = [&](auto masked) {
                // Each row's (key's) visible queries, relative to this thread's first column.
                KeySpan qs[2] = {{0, 0}, {0, 0}};
                if constexpr (decltype(masked)::value) {
#pragma unroll
                    for (int hf = 0; hf < 2; ++hf)
                        qs[hf] = diag_span(p, n0 + key_l + 8 * hf, g.sk, m0 + 2 * (lane % 4) + off);
                }
#pragma unroll
                for (int j = 0; j < NT; ++j) {
                    const int cq = 8 * j + 2 * (lane % 4);
                    const float2 l2 = *reinterpret_cast<const float2*>(sl + cq);
                    const float2 dd = *reinterpret_cast<const float2*>(sl + BQ + cq);
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        float x = fmaf(acc_s[4 * j + e], p.scale_log2, -(e % 2 ? l2.y : l2.x));
                        if constexpr (decltype(masked)::value) {
                            const int c = 8 * j + e % 2;
                            if (c < qs[e / 2].lo || c >= qs[e / 2].hi) x = -INFINITY;
                        }
                        const float pv = fast_exp2(x);
                        acc_s[4 * j + e] = pv;
                        acc_dp[4 * j + e] = pv * (acc_dp[4 * j + e] - (e % 2 ? dd.y : dd.x));
                    }
                }
            };
            if (full)
                body(std::false_type{});
            else
                body(std::true_type{});
        } else {
            const float slope_log2 = p.alibi ? p.alibi[b * p.alibi_batch + h] * LOG2E_F : 0.f;
#pragma unroll
            for (int j = 0; j < NT; ++j) {
                const int cq = 8 * j + 2 * (lane % 4);
                const float2 l2 = *reinterpret_cast<const float2*>(sl + cq);
                const float2 dd = *reinterpret_cast<const float2*>(sl + BQ + cq);
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int key = n0 + key_l + 8 * (e / 2);
                    const int qi = m0 + cq + e % 2;
                    const int diag = qi + off;
                    float chain;
                    float x = modded_score(p, acc_s[4 * j + e], slope_log2, diag, key, chain);
                    if (!full && (qi >= g.sq || !visible(p, diag, key, g.sk))) x = -INFINITY;
                    const float pv = fast_exp2(x - (e % 2 ? l2.y : l2.x));
                    acc_s[4 * j + e] = pv;
                    acc_dp[4 * j + e] = pv * (acc_dp[4 * j + e] - (e % 2 ? dd.y : dd.x)) * chain;
                }
            }
        }
    };
    auto issue_dkdv = [&](int s) {
        const int st = s % STAGES;
        gemm_rs<T, D, BQ>(acc_dv, pa, q_addr(st) + Tr::Q_BYTES);
        gemm_rs<T, D, BQ>(acc_dk, da, q_addr(st));
        wg_commit();
    };

    // K and V of the tile have landed (waited for even with no step: the block must not exit
    // with its copies in flight).
    mbar_wait(bar_kv, 0);
    // One step at a time (the other warpgroup's products fill the gaps): P^T and dS^T of a
    // step and the previous step's fragments are never live together; or OVERLAP.
    step_loop<OVERLAP, PINGPONG>(
        wg, steps, wait_full, issue_sdp,
        [&] {
            reg_fence(acc_s);
            reg_fence(acc_dp);
        },
        grads_of_scores,
        [&] {
            pack_a<T, BQ>(acc_s, pa);
            pack_a<T, BQ>(acc_dp, da);
        },
        issue_dkdv,
        [&] {
            reg_fence(acc_dk);
            reg_fence(acc_dv);
        },
        [&](int s) { mbar_arrive(bar_empty(s % STAGES)); });

    // Epilogue: keys n0 + key_l (+8), columns 8 j + 2 (lane % 4) (+1), packed pairs.
    T* dkg = static_cast<T*>(bp.dk) + (int64_t)b * bp.dkv_batch +
             (g.k_row0 + n0 + key_l) * bp.dkv_seq + (int64_t)kvh * p.d_out;
    T* dvg = static_cast<T*>(bp.dv) + (dkg - static_cast<T*>(bp.dk));
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
        if (n0 + key_l + 8 * hf >= g.sk) continue;
        const int64_t ro = 8 * hf * bp.dkv_seq;
#pragma unroll
        for (int j = 0; j < D / 8; ++j) {
            const int c = 8 * j + 2 * (lane % 4);
            *reinterpret_cast<uint32_t*>(dkg + ro + c) = flash::Mma<T>::pack(
                acc_dk[4 * j + 2 * hf] * bp.scale, acc_dk[4 * j + 2 * hf + 1] * bp.scale);
            *reinterpret_cast<uint32_t*>(dvg + ro + c) =
                flash::Mma<T>::pack(acc_dv[4 * j + 2 * hf], acc_dv[4 * j + 2 * hf + 1]);
        }
    }
}

template <typename T, int D, int BN, int STAGES, bool OVERLAP, bool PINGPONG, bool MODS,
          bool VARLEN>
__device__ __forceinline__ void bwd_dq_sm90(const BwdParams& bp, const TmaMap* tq,
                                            const TmaMap* tk, const TmaMap* tv,
                                            const TmaMap* tdo) {
    using Tr = DqTraits<D, BN, STAGES>;
    constexpr int BM = Tr::BM, CH = D / 64, NT = BN / 8;
    static_assert(D % 64 == 0 && BN % 64 == 0, "whole swizzle atoms");
    static_assert(!(OVERLAP && PINGPONG), "ping-pong is for the one-step-at-a-time loop");
    const FlashParams& p = bp.f;

    extern __shared__ __align__(1024) unsigned char smem_raw[];
    unsigned char* base = smem_raw + ((1024 - (saddr(smem_raw) & 1023)) & 1023);
    T* sQ = reinterpret_cast<T*>(base);
    T* sdO = reinterpret_cast<T*>(base + Tr::Q_BYTES);
    // Stage s: K at sK0 + s * 2 KV_BYTES, V right after it.
    unsigned char* sK0 = base + 2 * Tr::Q_BYTES;
    uint64_t* bars = reinterpret_cast<uint64_t*>(sK0 + STAGES * 2 * Tr::KV_BYTES);
    const uint32_t bar_q = saddr(bars);
    auto bar_full = [&](int s) { return saddr(bars + 1 + s); };
    auto bar_empty = [&](int s) { return saddr(bars + 1 + STAGES + s); };
    const uint32_t bar_tail = saddr(bars + 1 + 2 * STAGES);

    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    // Grid (query tiles, heads, batch), the last (longest causal) query tile of a head first.
    const int h = blockIdx.y, b = blockIdx.z;
    BlockGeom g;
    // Uniform over the block.
    if (!block_geom(p, (int)gridDim.x - 1 - (int)blockIdx.x, BM, h, b, g)) return;
    const int t_begin = g.n_lo / BN;
    const int t_end = g.n_hi > g.n_lo ? (g.n_hi + BN - 1) / BN : t_begin;

    if (tid == 0) {
        mbar_init(bar_q, 1);
        mbar_init(bar_tail, 1);
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(bar_full(s), VARLEN ? 32 : 1);  // the producer's threads (see below)
            mbar_init(bar_empty(s), 4 * Tr::NWG);
        }
        mbar_init_fence();
        proxy_fence();
    }
    __syncthreads();

    if (warp < 4) {
        setmaxnreg_dec<BWD_PRODUCER_REGS>();
        // Lane 0 issues the copies; VARLEN instances run the loop in the whole warp, which zeroes
        // the tails (zero_rows).
        if (VARLEN ? warp == 0 : tid == 0) {
            const int kvh = h / p.kv_group;
            const int kb = p.cu_k ? 0 : b;
            if (lane == 0) {
                prefetch_map(tq);
                prefetch_map(tk);
                prefetch_map(tv);
                prefetch_map(tdo);
                const int qb = p.cu_q ? 0 : b;
                const int q_row = (int)(g.q_row0 + g.m0);
                const int o_row = p.cu_q ? (int)(g.out_row0 + g.m0) : g.m0;
                mbar_expect_tx(bar_q, 2 * Tr::Q_BYTES);
#pragma unroll
                for (int c = 0; c < CH; ++c) {
                    tma_load_4d(saddr(sQ + c * BM * 64), tq, bar_q, c * 64, h, q_row, qb);
                    tma_load_4d(saddr(sdO + c * BM * 64), tdo, bar_q, c * 64, h, o_row, qb);
                }
            }
            uint32_t tail_phase = 0;
            for (int t = t_begin; t < t_end; ++t) {
                const int it = t - t_begin, st = it % STAGES;
                if (it >= STAGES) mbar_wait(bar_empty(st), (uint32_t)(((it / STAGES) - 1) & 1));
                const int k_row = (int)(g.k_row0 + (int64_t)t * BN);
                load_stage<D, BN, VARLEN>(sK0 + st * 2 * Tr::KV_BYTES, tk, k_row, tv, k_row, kvh,
                                          kb, bar_full(st), bar_tail, tail_phase, g.sk - t * BN,
                                          lane);
            }
        }
        return;
    }

    // ---- consumers ----
    setmaxnreg_inc<BWD_CONSUMER_REGS>();
    const int wg = warp / 4 - 1;
    const int ww = (tid % 128) / 32;
    const int row_l = 64 * wg + 16 * ww + lane / 4;  // this thread's rows: +0 and +8 (in tile)
    const int diag_t = g.m0 + row_l + g.sk - g.sq;
    const float slope_log2 = MODS && p.alibi ? p.alibi[g.slope_idx] * LOG2E_F : 0.f;
    float lse2[2], dsum[2];
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
        const int r = row_l + 8 * hf;
        const bool ok = r < g.rows;
        lse2[hf] = ok ? bwd::lse_log2(p.lse[g.lse0 + r]) : INFINITY;
        dsum[hf] = ok ? bp.dsum[g.lse0 + r] : 0.f;
    }
    const uint32_t q_base = saddr(sQ) + wg * 64 * 128;
    const uint32_t do_base = saddr(sdO) + wg * 64 * 128;
    auto k_addr = [&](int st) { return saddr(sK0) + st * 2 * Tr::KV_BYTES; };

    float acc_dq[D / 2];
#pragma unroll
    for (int i = 0; i < D / 2; ++i) acc_dq[i] = 0.f;
    float acc_s[BN / 2], acc_dp[BN / 2];
    uint32_t da[BN / 16][4];

    auto wait_full = [&](int it) {
        mbar_wait(bar_full(it % STAGES), (uint32_t)((it / STAGES) & 1));
    };
    auto issue_sdp = [&](int it) {
        const int st = it % STAGES;
        gemm_abt<T, D, BN>(acc_s, opaque(q_base), BM, k_addr(st));
        gemm_abt<T, D, BN>(acc_dp, opaque(do_base), BM, k_addr(st) + Tr::KV_BYTES);
        wg_commit();
    };
    // dS of key tile t = t_begin + it in place of dP. Element (j, e): row row_l + 8 (e / 2), key
    // t BN + 8 j + 2 (lane % 4) + e % 2.
    auto grads_of_scores = [&](int it) {
        const int k0 = (t_begin + it) * BN;
        const bool full = tile_is_full(p, g, k0, BN);
        if constexpr (!MODS) {
            // As in the dK/dV kernel: full tiles test nothing (rows past the sequence: lse +inf).
            auto body = [&](auto masked) {
                // Each row's visible keys, relative to this thread's first column.
                int lo[2] = {0, 0}, hi[2] = {0, 0};
                if constexpr (decltype(masked)::value) {
#pragma unroll
                    for (int hf = 0; hf < 2; ++hf) {
                        const KeySpan ks = key_span(p, diag_t + 8 * hf, g.sk, k0 + 2 * (lane % 4));
                        lo[hf] = ks.lo;
                        hi[hf] = ks.hi;
                    }
                }
#pragma unroll
                for (int j = 0; j < NT; ++j)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int hf = e / 2;
                        float x = fmaf(acc_s[4 * j + e], p.scale_log2, -lse2[hf]);
                        if constexpr (decltype(masked)::value) {
                            const int c = 8 * j + e % 2;
                            if (c < lo[hf] || c >= hi[hf]) x = -INFINITY;
                        }
                        acc_dp[4 * j + e] = fast_exp2(x) * (acc_dp[4 * j + e] - dsum[hf]);
                    }
            };
            if (full)
                body(std::false_type{});
            else
                body(std::true_type{});
        } else {
#pragma unroll
            for (int j = 0; j < NT; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int hf = e / 2;
                    const int key = k0 + 8 * j + 2 * (lane % 4) + e % 2;
                    const int diag = diag_t + 8 * hf;
                    float chain;
                    float x = modded_score(p, acc_s[4 * j + e], slope_log2, diag, key, chain);
                    if (!full && !visible(p, diag, key, g.sk)) x = -INFINITY;
                    const float pv = fast_exp2(x - lse2[hf]);
                    acc_dp[4 * j + e] = pv * (acc_dp[4 * j + e] - dsum[hf]) * chain;
                }
        }
    };
    auto issue_dq = [&](int it) {
        gemm_rs<T, D, BN>(acc_dq, da, k_addr(it % STAGES));
        wg_commit();
    };

    mbar_wait(bar_q, 0);
    step_loop<OVERLAP, PINGPONG>(
        wg, t_end - t_begin, wait_full, issue_sdp,
        [&] {
            reg_fence(acc_s);
            reg_fence(acc_dp);
        },
        grads_of_scores, [&] { pack_a<T, BN>(acc_dp, da); },
        issue_dq, [&] { reg_fence(acc_dq); },
        [&](int it) {
            if (lane == 0) mbar_arrive(bar_empty(it % STAGES));
        });

    // Epilogue: rows row_l (+8), columns 8 j + 2 (lane % 4) (+1), scaled, packed pairs.
    T* dqg = static_cast<T*>(bp.dq) + (g.out_row0 + g.m0 + row_l) * p.o_seq + (int64_t)h * p.o_head;
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
        if (row_l + 8 * hf >= g.rows) continue;
        const int64_t ro = 8 * hf * p.o_seq;
#pragma unroll
        for (int j = 0; j < D / 8; ++j) {
            const int c = 8 * j + 2 * (lane % 4);
            *reinterpret_cast<uint32_t*>(dqg + ro + c) = flash::Mma<T>::pack(
                acc_dq[4 * j + 2 * hf] * bp.scale, acc_dq[4 * j + 2 * hf + 1] * bp.scale);
        }
    }
}

}  // namespace sm90

// Entry points: (BwdParams, then the tensor maps of q, k, v and dO). SMEM_BYTES is the planner's
// figure (src/cuda/backward/instances.rs, `Sm90Bwd::smem`), pinned against the traits here.
#define FLASH_BWD_SM90_DKDV(NAME, T, D, BQ, STAGES, OVERLAP, PINGPONG, MODS, VARLEN, SMEM_BYTES)                       \
    static_assert(sm90::DkdvTraits<D, BQ, STAGES>::SMEM == SMEM_BYTES, "instances.rs: " #NAME);     \
    extern "C" __global__ void __launch_bounds__(384, 1)                                       \
        NAME(const BwdParams p, const __grid_constant__ TmaMap tq,                             \
             const __grid_constant__ TmaMap tk, const __grid_constant__ TmaMap tv,             \
             const __grid_constant__ TmaMap tdo) {                                             \
        sm90::bwd_dkdv_sm90<T, D, BQ, STAGES, OVERLAP, PINGPONG, MODS, VARLEN>(p, &tq, &tk, &tv, &tdo);          \
    }
#define FLASH_BWD_SM90_DQ(NAME, T, D, BN, STAGES, OVERLAP, PINGPONG, MODS, VARLEN, SMEM_BYTES)                         \
    static_assert(sm90::DqTraits<D, BN, STAGES>::SMEM == SMEM_BYTES, "instances.rs: " #NAME);       \
    extern "C" __global__ void __launch_bounds__(384, 1)                                       \
        NAME(const BwdParams p, const __grid_constant__ TmaMap tq,                             \
             const __grid_constant__ TmaMap tk, const __grid_constant__ TmaMap tv,             \
             const __grid_constant__ TmaMap tdo) {                                             \
        sm90::bwd_dq_sm90<T, D, BN, STAGES, OVERLAP, PINGPONG, MODS, VARLEN>(p, &tq, &tk, &tv, &tdo);            \
    }
