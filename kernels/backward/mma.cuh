// FlashAttention-2 backward for f16/bf16 on tensor cores (mma.sync m16n8k16, f32 accumulation),
// head dims 64 and 128, operands with unit column stride and 16-byte aligned rows. After the D
// pass (generic.cuh's bwd_dsum): dkdv, then dq, no atomics, every run bitwise identical.
// (FlashAttention-2's fused kernel, which adds dQ = dS K into f32 sums with atomics, ran no
// faster than this pair on an H100's compute_80 path, and was removed.)
// dkdv: one block per (key tile of BN = 16 * WARPS keys, K/V head, batch). Warp w owns keys
//   16 w .. 16 w + 15 of the tile, so its dK and dV rows stay in its registers for the whole
//   block and need no inter-warp reduction. The block walks every query head of the K/V group
//   and, within it, every BM-row query tile whose rows see the key tile (causal / window tiles
//   outside the band are skipped by the loop bounds); Q, dO, lse and D of the next step stream
//   in through a 2-stage cp.async ring while the current one is computed. Per step, in the
//   transposed orientation (rows = keys, columns = queries):
//     dP^T = V dO^T          A = V (ldmatrix), B = dO rows (ldmatrix)
//     S^T  = K Q^T           A = K, B = Q rows
//     P^T  = exp2(S^T * scale log2 e - lse log2 e), masked; dS^T = P^T (dP^T - D) [(1 - t^2)]
//     dV  += P^T dO          A = P^T from the S registers (C layout = A layout), B = dO (.trans)
//     dK  += dS^T Q          A = dS^T from the dP registers, B = Q (.trans)
//   dK is scaled by the softmax scale once, at the end; both are written in T.
//   The `_extras` instances also take the bias and block mask (common/extras.cuh), per score,
//   besides softcap and ALiBi (dK/dV in shorter query steps, for the registers they need).
// dq: one block per (query tile of 16 * WARPS rows, head, batch), the forward kernel's shape:
//     S = Q K^T, dP = dO V^T, dS = P (dP - D), dQ += dS K (B = K .trans); dQ scaled and
//   written once in T. Seven products per pair of tiles instead of five.
//
#pragma once
#include "backward/common.cuh"
#include "backward/generic.cuh"
#include "common/extras.cuh"
#include "common/ptx.cuh"
#include "common/score.cuh"
#include "common/swizzle.cuh"
#include "bwd_instances.cuh"

namespace bwd {

using flash::cp_async16;
using flash::cp_async4;
using flash::cp_async_commit;
using flash::cp_async_wait;
using flash::ldsm_x4;
using flash::ldsm_x4_t;
using flash::load_tile;
using flash::Mma;
using flash::swz;
using flash::SwzRow;

// Base-2 logit of a raw dot product and its chain factor (common/score.cuh); without score
// modifiers (the plain instances) only the scale, chain 1.
template <bool MODS>
__device__ __forceinline__ float logit2(const FlashParams& p, float dot, float slope_log2, int diag,
                                        int j, float& chain) {
    if constexpr (!MODS) {
        chain = 1.f;
        return dot * p.scale_log2;
    } else {
        return modded_score(p, dot, slope_log2, diag, j, chain);
    }
}

// Starts the cp.async copies of the block's K and V tiles (rows past the sequence zero-filled).
template <typename T, int D, int BN, int THREADS>
__device__ __forceinline__ void load_kv_tile(const FlashParams& p, int b, int kvh,
                                             const BlockGeom& g, const KeyTile& t, T* sK, T* sV) {
    const T* kg = static_cast<const T*>(p.k) + (int64_t)b * p.k_batch +
                  (g.k_row0 + t.n0) * p.k_seq + (int64_t)kvh * p.k_head;
    const T* vg = static_cast<const T*>(p.v) + (int64_t)b * p.v_batch +
                  (g.k_row0 + t.n0) * p.v_seq + (int64_t)kvh * p.v_head;
    load_tile<T, D, BN, THREADS>(sK, kg, p.k_seq, t.rows_k, p.d_load);
    load_tile<T, D, BN, THREADS>(sV, vg, p.v_seq, t.rows_k, p.d_load);
}

// Starts the cp.async copies of one query step of a dK/dV kernel into a ring stage: Q and dO
// rows [m0, m0 + BM) of head h at sQ and sQ + BM D (rows past the sequence zero-filled), their
// lse and D at sL and sL + BM (zeros past the sequence).
template <typename T, int D, int BM, int THREADS>
__device__ __forceinline__ void load_q_step(const BwdParams& bp, int b, int h, int m0,
                                            const BlockGeom& g, T* sQ, float* sL, int tid) {
    const FlashParams& p = bp.f;
    const int rows = min(BM, g.sq - m0);
    const T* qg = static_cast<const T*>(p.q) + (int64_t)b * p.q_batch +
                  (g.q_row0 + m0) * p.q_seq + (int64_t)h * p.q_head;
    const T* dog =
        static_cast<const T*>(bp.dout) + (g.out_row0 + m0) * p.o_seq + (int64_t)h * p.o_head;
    load_tile<T, D, BM, THREADS>(sQ, qg, p.q_seq, rows, p.d_load);
    load_tile<T, D, BM, THREADS>(sQ + BM * D, dog, p.o_seq, rows, p.d_load);
    const int64_t l0 = lse_index(p, b, h, g.q_row0, m0);
    for (int r = tid; r < 2 * BM; r += THREADS) {
        const int rr = r % BM;
        const float* src = (r < BM ? p.lse : bp.dsum) + l0 + rr;
        cp_async4(sL + r, rr < rows ? src : p.lse, rr < rows ? 4 : 0);
    }
}

template <typename T, int D, int BM, int WARPS>
struct DkdvTraits {
    static constexpr int BN = 16 * WARPS;  // keys per block
    static constexpr int THREADS = 32 * WARPS;
    static constexpr int STEP = 2 * BM * D;  // elements of one Q + dO stage
    static constexpr int SMEM = (2 * BN * D + 2 * STEP) * (int)sizeof(T) + 2 * 2 * BM * 4;
};

template <typename T, int D, int BM, int WARPS, bool MODS, bool EXTRAS = false>
__device__ __forceinline__ void dkdv_mma(const BwdParams& bp) {
    using Tr = DkdvTraits<T, D, BM, WARPS>;
    constexpr int BN = Tr::BN, THREADS = Tr::THREADS, STEP = Tr::STEP;
    constexpr int NT = BM / 8;  // n8 tiles of S^T per warp
    constexpr int DT = D / 8;   // n8 tiles of dK / dV per warp
    static_assert(BM % 16 == 0 && D % 16 == 0, "tiles are whole mma steps");
    const FlashParams& p = bp.f;

    extern __shared__ __align__(128) unsigned char smem_raw[];
    T* sK = reinterpret_cast<T*>(smem_raw);
    T* sV = sK + BN * D;
    T* sQ0 = sV + BN * D;  // stage s: Q (BM x D) at sQ0 + s STEP, dO right after
    float* sL0 = reinterpret_cast<float*>(sQ0 + 2 * STEP);  // stage s: lse at sL0 + 2 s BM, D after

    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int kvh = blockIdx.y, b = blockIdx.z;
    BlockGeom g;
    KeyTile kt;
    if (!key_tile<BN, BM>(p, b, (int)blockIdx.x, g, kt)) return;
    const int n0 = kt.n0, m_begin = kt.m_begin, m_count = kt.m_count;
    const int64_t off = kt.off;
    const int steps = m_count * p.kv_group;
    load_kv_tile<T, D, BN, THREADS>(p, b, kvh, g, kt, sK, sV);

    // Step s: query head kvh * group + s / m_count, query tile m_begin + s % m_count.
    auto issue = [&](int s) {
        load_q_step<T, D, BM, THREADS>(bp, b, kvh * p.kv_group + s / m_count,
                                       (m_begin + s % m_count) * BM, g, sQ0 + (s % 2) * STEP,
                                       sL0 + (s % 2) * 2 * BM, tid);
    };
    if (steps > 0) issue(0);
    cp_async_commit();

    float acc_dk[DT][4], acc_dv[DT][4];
#pragma unroll
    for (int j = 0; j < DT; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc_dk[j][e] = acc_dv[j][e] = 0.f;

    const SwzRow<D> a_off(warp * 16 + lane % 16, lane / 16);        // K / V rows of this warp
    const SwzRow<D> b_off((lane / 16) * 8 + lane % 8, (lane / 8) % 2);  // Q / dO rows as B
    const SwzRow<D> t_off(lane % 16, lane / 16);                   // Q / dO as B, transposed
    const int key_t = n0 + warp * 16 + lane / 4;                   // key of element e < 2

    for (int s = 0; s < steps; ++s) {
        cp_async_wait<0>();
        __syncthreads();  // step s landed everywhere; everyone is done with step s - 1's stage
        if (s + 1 < steps) issue(s + 1);
        cp_async_commit();
        const T* sQ = sQ0 + (s % 2) * STEP;
        const T* sdO = sQ + BM * D;
        const float* sL = sL0 + (s % 2) * 2 * BM;
        const int h = kvh * p.kv_group + s / m_count;
        const int m0 = (m_begin + s % m_count) * BM;

        // dP^T = V dO^T and S^T = K Q^T for this warp's 16 keys and the BM queries.
        float acc_s[NT][4], acc_dp[NT][4];
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc_s[j][e] = acc_dp[j][e] = 0.f;
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            uint32_t va[4], ka[4];
            ldsm_x4(va, sV + a_off.at(0, kk));
            ldsm_x4(ka, sK + a_off.at(0, kk));
#pragma unroll
            for (int np = 0; np < BM / 16; ++np) {
                uint32_t ob[4], qb[4];
                ldsm_x4(ob, sdO + b_off.at(np, kk));
                Mma<T>::run(acc_dp[2 * np], va, ob[0], ob[1]);
                Mma<T>::run(acc_dp[2 * np + 1], va, ob[2], ob[3]);
                ldsm_x4(qb, sQ + b_off.at(np, kk));
                Mma<T>::run(acc_s[2 * np], ka, qb[0], qb[1]);
                Mma<T>::run(acc_s[2 * np + 1], ka, qb[2], qb[3]);
            }
        }

        // P^T and dS^T in place of S^T and dP^T. Element (j, e): key key_t + 8 (e / 2),
        // query m0 + 8 j + 2 (lane % 4) + e % 2.
        const float slope_log2 = p.alibi ? p.alibi[b * p.alibi_batch + h] * LOG2E_F : 0.f;
        const int q_t = m0 + 2 * (lane % 4);
        // The mask is needed where the band, the key tail or the query tail cuts the tile.
        bool full = n0 + BN <= g.sk && m0 + BM <= g.sq;
        if (p.win_left >= 0 && (int64_t)m0 + BM - 1 + off - p.win_left > n0) full = false;
        if (p.win_right >= 0 && (int64_t)n0 + BN - 1 > m0 + off + p.win_right) full = false;
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int key = key_t + 8 * (e / 2);
                const int cq = 8 * j + 2 * (lane % 4) + e % 2;  // query within the tile
                const int qi = q_t + 8 * j + e % 2;
                const int diag = (int)(qi + off);
                float chain;
                float x = logit2<MODS>(p, acc_s[j][e], slope_log2, diag, key, chain);
                if constexpr (EXTRAS)
                    x = extra_score<T>(p, x, b, h, qi, key, g.sq, g.sk, p.block_mask != nullptr);
                if (!full && (qi >= g.sq || !visible(p, diag, key, g.sk))) x = -INFINITY;
                const float pv = fast_exp2(x - lse_log2(sL[cq]));
                acc_s[j][e] = pv;
                acc_dp[j][e] = pv * (acc_dp[j][e] - sL[BM + cq]) * chain;
            }

        // P^T and dS^T rounded to T right away, as the A operands of the next products (the C
        // layout of n-tiles 2 kk, 2 kk + 1 is the A layout of k-step kk): half the registers.
        uint32_t pa[BM / 16][4], da[BM / 16][4];
#pragma unroll
        for (int kk = 0; kk < BM / 16; ++kk)
#pragma unroll
            for (int x = 0; x < 4; ++x) {
                const int j = 2 * kk + x / 2, e = 2 * (x % 2);
                pa[kk][x] = Mma<T>::pack(acc_s[j][e], acc_s[j][e + 1]);
                da[kk][x] = Mma<T>::pack(acc_dp[j][e], acc_dp[j][e + 1]);
            }

        // dV += P^T dO and dK += dS^T Q; the k dimension is the BM queries.
#pragma unroll
        for (int kk = 0; kk < BM / 16; ++kk) {
#pragma unroll
            for (int dp = 0; dp < D / 16; ++dp) {
                uint32_t ob[4], qb[4];
                ldsm_x4_t(ob, sdO + t_off.at(kk, dp));
                Mma<T>::run(acc_dv[2 * dp], pa[kk], ob[0], ob[1]);
                Mma<T>::run(acc_dv[2 * dp + 1], pa[kk], ob[2], ob[3]);
                ldsm_x4_t(qb, sQ + t_off.at(kk, dp));
                Mma<T>::run(acc_dk[2 * dp], da[kk], qb[0], qb[1]);
                Mma<T>::run(acc_dk[2 * dp + 1], da[kk], qb[2], qb[3]);
            }
        }
    }
    cp_async_wait<0>();

    // Epilogue: rows key_t and key_t + 8, columns 8 j + 2 (lane % 4) (+1), packed pairs.
    T* dkg = static_cast<T*>(bp.dk) + (int64_t)b * bp.dkv_batch + (g.k_row0 + key_t) * bp.dkv_seq +
             (int64_t)kvh * p.d_out;
    T* dvg = static_cast<T*>(bp.dv) + (dkg - static_cast<T*>(bp.dk));
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
        if (key_t + 8 * hf >= g.sk) continue;
        const int64_t ro = 8 * hf * bp.dkv_seq;
#pragma unroll
        for (int j = 0; j < DT; ++j) {
            const int c = 8 * j + 2 * (lane % 4);
            *reinterpret_cast<uint32_t*>(dkg + ro + c) = Mma<T>::pack(
                acc_dk[j][2 * hf] * bp.scale, acc_dk[j][2 * hf + 1] * bp.scale);
            *reinterpret_cast<uint32_t*>(dvg + ro + c) =
                Mma<T>::pack(acc_dv[j][2 * hf], acc_dv[j][2 * hf + 1]);
        }
    }
}

template <typename T, int D, int BN, int WARPS>
struct DqTraits {
    static constexpr int BM = 16 * WARPS;  // query rows per block
    static constexpr int THREADS = 32 * WARPS;
    static constexpr int KV = 2 * BN * D;  // elements of one K + V stage
    static constexpr int SMEM = (2 * BM * D + 2 * KV) * (int)sizeof(T);
};

template <typename T, int D, int BN, int WARPS, bool MODS, bool EXTRAS = false>
__device__ __forceinline__ void dq_mma(const BwdParams& bp) {
    using Tr = DqTraits<T, D, BN, WARPS>;
    constexpr int BM = Tr::BM, THREADS = Tr::THREADS, KV = Tr::KV;
    constexpr int NT = BN / 8, DT = D / 8;
    static_assert(BN % 16 == 0 && D % 16 == 0, "tiles are whole mma steps");
    const FlashParams& p = bp.f;

    extern __shared__ __align__(128) unsigned char smem_raw[];
    T* sQ = reinterpret_cast<T*>(smem_raw);
    T* sdO = sQ + BM * D;
    T* sKV = sdO + BM * D;  // stage s: K (BN x D) at sKV + s KV, V right after

    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int m_block = (int)(gridDim.x - 1 - blockIdx.x);  // longest (causal) tiles first
    const int h = blockIdx.y, b = blockIdx.z;
    BlockGeom g;
    if (!block_geom(p, m_block, BM, h, b, g)) return;
    const int kvh = h / p.kv_group;

    const T* qg = static_cast<const T*>(p.q) + (int64_t)b * p.q_batch +
                  (g.q_row0 + g.m0) * p.q_seq + (int64_t)h * p.q_head;
    const T* dog = static_cast<const T*>(bp.dout) + (g.out_row0 + g.m0) * p.o_seq +
                   (int64_t)h * p.o_head;
    const T* kg = static_cast<const T*>(p.k) + (int64_t)b * p.k_batch + g.k_row0 * p.k_seq +
                  (int64_t)kvh * p.k_head;
    const T* vg = static_cast<const T*>(p.v) + (int64_t)b * p.v_batch + g.k_row0 * p.v_seq +
                  (int64_t)kvh * p.v_head;

    // This thread's rows: r_t and r_t + 8 of the tile.
    const int r_t = warp * 16 + lane / 4;
    float lse2[2], dsum_r[2];
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
        const int r = r_t + 8 * hf;
        lse2[hf] = r < g.rows ? lse_log2(p.lse[g.lse0 + r]) : INFINITY;
        dsum_r[hf] = r < g.rows ? bp.dsum[g.lse0 + r] : 0.f;
    }
    const float slope_log2 = p.alibi ? p.alibi[g.slope_idx] * LOG2E_F : 0.f;
    const int diag_t = g.m0 + r_t + g.sk - g.sq;

    const int t_begin = g.n_lo / BN;
    const int t_end = g.n_hi > g.n_lo ? (g.n_hi + BN - 1) / BN : t_begin;

    load_tile<T, D, BM, THREADS>(sQ, qg, p.q_seq, g.rows, p.d_load);
    load_tile<T, D, BM, THREADS>(sdO, dog, p.o_seq, g.rows, p.d_load);
    auto issue = [&](int t) {
        T* sK = sKV + ((t - t_begin) % 2) * KV;
        const int rows = min(BN, g.sk - t * BN);
        load_tile<T, D, BN, THREADS>(sK, kg + (int64_t)t * BN * p.k_seq, p.k_seq, rows, p.d_load);
        load_tile<T, D, BN, THREADS>(sK + BN * D, vg + (int64_t)t * BN * p.v_seq, p.v_seq, rows,
                                     p.d_load);
    };
    if (t_begin < t_end) issue(t_begin);
    cp_async_commit();

    float acc_dq[DT][4];
#pragma unroll
    for (int j = 0; j < DT; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc_dq[j][e] = 0.f;

    const SwzRow<D> a_off(warp * 16 + lane % 16, lane / 16);
    const SwzRow<D> b_off((lane / 16) * 8 + lane % 8, (lane / 8) % 2);
    const SwzRow<D> t_off(lane % 16, lane / 16);

    for (int t = t_begin; t < t_end; ++t) {
        cp_async_wait<0>();
        __syncthreads();
        if (t + 1 < t_end) issue(t + 1);
        cp_async_commit();
        const T* sK = sKV + ((t - t_begin) % 2) * KV;
        const T* sV = sK + BN * D;

        float acc_s[NT][4], acc_dp[NT][4];
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc_s[j][e] = acc_dp[j][e] = 0.f;
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            uint32_t qa[4], oa[4];
            ldsm_x4(qa, sQ + a_off.at(0, kk));
            ldsm_x4(oa, sdO + a_off.at(0, kk));
#pragma unroll
            for (int np = 0; np < BN / 16; ++np) {
                uint32_t kb[4], vb[4];
                ldsm_x4(kb, sK + b_off.at(np, kk));
                Mma<T>::run(acc_s[2 * np], qa, kb[0], kb[1]);
                Mma<T>::run(acc_s[2 * np + 1], qa, kb[2], kb[3]);
                ldsm_x4(vb, sV + b_off.at(np, kk));
                Mma<T>::run(acc_dp[2 * np], oa, vb[0], vb[1]);
                Mma<T>::run(acc_dp[2 * np + 1], oa, vb[2], vb[3]);
            }
        }

        const int k0 = t * BN;
        const int col = k0 + 2 * (lane % 4);
        const bool full = tile_is_full(p, g, k0, BN);
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int hf = e / 2;
                const int diag = diag_t + 8 * hf;
                const int key = col + 8 * j + e % 2;
                float chain;
                float x = logit2<MODS>(p, acc_s[j][e], slope_log2, diag, key, chain);
                if constexpr (EXTRAS)
                    x = extra_score<T>(p, x, b, h, g.m0 + r_t + 8 * hf, key, g.sq, g.sk,
                                       p.block_mask != nullptr);
                if (!full && !visible(p, diag, key, g.sk)) x = -INFINITY;
                const float pv = fast_exp2(x - lse2[hf]);
                acc_dp[j][e] = pv * (acc_dp[j][e] - dsum_r[hf]) * chain;
            }

        // dQ += dS K, k dimension = the BN keys.
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
            uint32_t da[4];
            da[0] = Mma<T>::pack(acc_dp[2 * kk][0], acc_dp[2 * kk][1]);
            da[1] = Mma<T>::pack(acc_dp[2 * kk][2], acc_dp[2 * kk][3]);
            da[2] = Mma<T>::pack(acc_dp[2 * kk + 1][0], acc_dp[2 * kk + 1][1]);
            da[3] = Mma<T>::pack(acc_dp[2 * kk + 1][2], acc_dp[2 * kk + 1][3]);
#pragma unroll
            for (int dp = 0; dp < D / 16; ++dp) {
                uint32_t kb[4];
                ldsm_x4_t(kb, sK + t_off.at(kk, dp));
                Mma<T>::run(acc_dq[2 * dp], da, kb[0], kb[1]);
                Mma<T>::run(acc_dq[2 * dp + 1], da, kb[2], kb[3]);
            }
        }
    }
    cp_async_wait<0>();

    T* dqg = static_cast<T*>(bp.dq) + (g.out_row0 + g.m0) * p.o_seq + (int64_t)h * p.o_head;
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
        const int r = r_t + 8 * hf;
        if (r >= g.rows) continue;
#pragma unroll
        for (int j = 0; j < DT; ++j) {
            const int c = 8 * j + 2 * (lane % 4);
            *reinterpret_cast<uint32_t*>(dqg + (int64_t)r * p.o_seq + c) = Mma<T>::pack(
                acc_dq[j][2 * hf] * bp.scale, acc_dq[j][2 * hf + 1] * bp.scale);
        }
    }
}

}  // namespace bwd

// Entry points of one (dtype, head dim): dK/dV and dQ, each plain, `_mods` (softcap / ALiBi)
// and `_extras` (a bias or block mask, with softcap / ALiBi; dK/dV in KX_BM-row query steps).
// Tiles come from the table in src/cuda/backward/instances.rs through the generated
// bwd_instances.cuh, with the shared memory the planner assumes (checked here).
#define FLASH_BWD_MMA_INSTANCE(PREFIX, T, D, KV_BM, KV_WARPS, KV_MINB, KV_SMEM, KX_BM, KX_SMEM,    \
                               Q_BN, Q_WARPS, Q_MINB, Q_SMEM)                                      \
    static_assert(bwd::DkdvTraits<T, D, KV_BM, KV_WARPS>::SMEM == KV_SMEM,                         \
                  "src/cuda/backward/instances.rs and the dkdv kernel disagree on shared memory"); \
    static_assert(bwd::DkdvTraits<T, D, KX_BM, KV_WARPS>::SMEM == KX_SMEM,                         \
                  "src/cuda/backward/instances.rs and the dkdv kernel disagree on shared memory"); \
    static_assert(bwd::DqTraits<T, D, Q_BN, Q_WARPS>::SMEM == Q_SMEM,                              \
                  "src/cuda/backward/instances.rs and the dq kernel disagree on shared memory");   \
    extern "C" __global__ void __launch_bounds__(KV_WARPS * 32, KV_MINB)                           \
        PREFIX##_dkdv_d##D(const BwdParams p) {                                                    \
        bwd::dkdv_mma<T, D, KV_BM, KV_WARPS, false>(p);                                            \
    }                                                                                              \
    extern "C" __global__ void __launch_bounds__(KV_WARPS * 32, KV_MINB)                           \
        PREFIX##_dkdv_d##D##_mods(const BwdParams p) {                                             \
        bwd::dkdv_mma<T, D, KV_BM, KV_WARPS, true>(p);                                             \
    }                                                                                              \
    extern "C" __global__ void __launch_bounds__(KV_WARPS * 32, KV_MINB)                           \
        PREFIX##_dkdv_d##D##_extras(const BwdParams p) {                                           \
        bwd::dkdv_mma<T, D, KX_BM, KV_WARPS, true, true>(p);                                       \
    }                                                                                              \
    extern "C" __global__ void __launch_bounds__(Q_WARPS * 32, Q_MINB)                             \
        PREFIX##_dq_d##D(const BwdParams p) {                                                      \
        bwd::dq_mma<T, D, Q_BN, Q_WARPS, false>(p);                                                \
    }                                                                                              \
    extern "C" __global__ void __launch_bounds__(Q_WARPS * 32, Q_MINB)                             \
        PREFIX##_dq_d##D##_mods(const BwdParams p) {                                               \
        bwd::dq_mma<T, D, Q_BN, Q_WARPS, true>(p);                                                 \
    }                                                                                              \
    extern "C" __global__ void __launch_bounds__(Q_WARPS * 32, Q_MINB)                             \
        PREFIX##_dq_d##D##_extras(const BwdParams p) {                                             \
        bwd::dq_mma<T, D, Q_BN, Q_WARPS, true, true>(p);                                           \
    }

// Every backward entry point of one 16-bit dtype: the D pass, the exact kernels (other head dims
// and strided operands) and the tensor-core instances.
#define FLASH_BWD_INSTANCES(PREFIX, T)                                                        \
    FLASH_BWD_GENERIC_INSTANCES(PREFIX, T)                                                    \
    FLASH_BWD_MMA_INSTANCES(PREFIX, T)
