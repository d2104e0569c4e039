// FlashAttention-2 backward for f16/bf16 on tensor cores (mma.sync m16n8k16, f32 accumulation),
// head dims 64 and 128, operands with unit column stride and 16-byte aligned rows. After the D
// pass (generic.cuh's bwd_dsum), one of two designs:
//
// Deterministic (the default): dkdv, then dq, no atomics, every run bitwise identical.
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
// dq: one block per (query tile of 16 * WARPS rows, head, batch), the forward kernel's shape:
//     S = Q K^T, dP = dO V^T, dS = P (dP - D), dQ += dS K (B = K .trans); dQ scaled and
//   written once in T. Seven products per pair of tiles instead of five.
//
// Atomic (CANDLE_FLASH_BWD_DETERMINISTIC=0): dkdvq, then dq_convert.
// dkdvq: one block of 8 warps per (key tile of BN keys, K/V head, batch). K and V of the tile
//   stay in shared memory; dK and dV stay in registers. The block walks the same steps as dkdv,
//   last query tile first. Per step, five products:
//     A  S^T = K Q^T and dP^T = V dO^T, warps 4 (keys) x 2 (queries), 32 x BM/2 warp tiles;
//        P^T and dS^T as above, rounded to T and stored to shared memory (sPt, sdSt: BN x BM).
//     B  dV += P^T dO and dK += dS^T Q, warps 4 (keys) x 2 (head dim), 32 x D/2 warp tiles.
//     C  dQ_tile = dS K (A = dS^T read transposed, B = K), warps BM/32 (rows) x 8/(BM/32) (dims),
//        32 x 32 warp tiles, staged in shared memory and added to the f32 sums (dq_accum) with
//        atomics, a row of 32 consecutive floats per warp instruction.
//   dq_convert scales and rounds the sums. FlashAttention-2's structure, but on an H100 it runs
//   at the speed of the deterministic pair (0.97-1.10x its time, BENCHMARKS.md 2026-11-22), far
//   from FlashAttention-2's: with the P^T / dS^T round trip through shared memory, three
//   barriers a step and one 8-warp block per SM (255 registers), the tensor pipe stays ~25%
//   busy; in an earlier build, leaving the atomics out saved ~22% of the kernel's time.
#pragma once
#include "backward/generic.cuh"
#include "forward/mma.cuh"
#include "bwd_instances.cuh"

namespace bwd {

using flash::cp_async16;
using flash::cp_async_commit;
using flash::cp_async_wait;
using flash::ldsm_x4;
using flash::ldsm_x4_t;
using flash::load_tile;
using flash::Mma;
using flash::swz;
using flash::SwzRow;

// 4-byte async copy (lse and D of a query tile); src_bytes = 0 zero-fills.
__device__ __forceinline__ void cp_async4(void* dst, const void* src, int src_bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(flash::smem_addr(dst)),
                 "l"(src), "r"(src_bytes));
}

// lse in base 2 with -inf (a row that sees no key) turned into +inf, so exp2(s - lse) = 0.
__device__ __forceinline__ float lse_log2(float lse) {
    return lse == -INFINITY ? INFINITY : lse * LOG2E_F;
}

// Base-2 logit of a raw dot product, and the softcap's chain factor 1 - tanh^2 (1 without).
template <bool MODS>
__device__ __forceinline__ float logit2(const FlashParams& p, float dot, float slope_log2, int diag,
                                        int j, float& chain) {
    if constexpr (!MODS) {
        chain = 1.f;
        return dot * p.scale_log2;
    } else {
        float x;
        if (p.softcap > 0.f) {
            const float t = tanh_fast(dot * p.scale_over_cap);
            chain = 1.f - t * t;
            x = p.cap_log2 * t;
        } else {
            chain = 1.f;
            x = dot * p.scale_log2;
        }
        return x - slope_log2 * (float)abs(diag - j);
    }
}

// A register of two T (low half first) as two floats.
template <typename T>
__device__ __forceinline__ float2 unpack2(uint32_t v) {
    if constexpr (std::is_same_v<T, __half>)
        return __half22float2(*reinterpret_cast<const __half2*>(&v));
    else
        return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&v));
}

// ldmatrix / store addressing in a swizzled tile of W-element rows (W % 64 == 0: every chunk
// is XOR-permuted by r & 7) whose column base is known only at run time (a warp's slice of the
// head dim or of the query tile). A thread reads rows r_t + dr (dr a multiple of 8) at chunks
// c_t + k, where the compile-time k shares no bit with the per-thread c_t, so that
// (c_t + k) ^ (r & 7) = ((c_t ^ (r & 7)) ^ k): one register pair per operand and one XOR per
// access, instead of a hoisted offset per (dr, k).
template <int W>
struct Swz {
    static_assert(W % 64 == 0, "full 8-chunk XOR swizzle");
    int row_, y_;
    __device__ __forceinline__ Swz(int r_t, int c_t) : row_(r_t * W), y_((c_t ^ (r_t & 7)) << 3) {}
    __device__ __forceinline__ int at(int dr, int k) const { return row_ + dr * W + (y_ ^ (k << 3)); }
};

// The key tile of a dK/dV block: keys [n0, n0 + rows_k) of sequence b and the BM-row query
// tiles [m_begin, m_begin + m_count) that hold a row seeing one of them (tiles outside a causal
// or window band are skipped). False when the tile starts past the sequence: its dK and dV rows
// stay zero.
struct KeyTile {
    int n0, rows_k, m_begin, m_count;
    int64_t off;  // sk - sq: query i's diagonal is i + off
};

template <int BN, int BM>
__device__ __forceinline__ bool key_tile(const FlashParams& p, int b, int n_block, BlockGeom& g,
                                         KeyTile& t) {
    seq_lengths<false>(p, b, g);
    t.n0 = n_block * BN;
    if (t.n0 >= g.sk) return false;
    t.rows_k = min(BN, g.sk - t.n0);
    t.off = (int64_t)g.sk - g.sq;
    int64_t i_lo = 0, i_hi = g.sq;
    if (p.win_right >= 0) i_lo = max((int64_t)0, t.n0 - t.off - p.win_right);
    if (p.win_left >= 0)
        i_hi = min((int64_t)g.sq, t.n0 + t.rows_k - 1 - t.off + p.win_left + 1);
    t.m_begin = (int)(i_lo / BM);
    t.m_count = i_hi > i_lo ? (int)((i_hi + BM - 1) / BM) - t.m_begin : 0;
    return true;
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

template <typename T, int D, int BM, int WARPS, bool MODS>
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

// acc = A B^T for one warp of the fused kernel: A_MI 16-row slices of A (keys: K or V rows,
// per-thread offsets a_off) against A_NJ n8 tiles of B (queries: Q or dO rows, b_off), over
// all D columns; acc is zeroed first.
template <typename T, int D, int A_MI, int A_NJ>
__device__ __forceinline__ void warp_gemm_abt(float (&acc)[A_MI][A_NJ][4], const T* sA,
                                              const T* sB, const SwzRow<D>& a_off,
                                              const SwzRow<D>& b_off) {
#pragma unroll
    for (int mi = 0; mi < A_MI; ++mi)
#pragma unroll
        for (int j = 0; j < A_NJ; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[mi][j][e] = 0.f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
        uint32_t a[A_MI][4];
#pragma unroll
        for (int mi = 0; mi < A_MI; ++mi) ldsm_x4(a[mi], sA + a_off.at(mi, kk));
#pragma unroll
        for (int np = 0; np < A_NJ / 2; ++np) {
            uint32_t b[4];
            ldsm_x4(b, sB + b_off.at(np, kk));
#pragma unroll
            for (int mi = 0; mi < A_MI; ++mi) {
                Mma<T>::run(acc[mi][2 * np], a[mi], b[0], b[1]);
                Mma<T>::run(acc[mi][2 * np + 1], a[mi], b[2], b[3]);
            }
        }
    }
}

template <typename T, int D, int BM, int BN>
struct DkdvqTraits {
    static constexpr int WARPS = 8, THREADS = 32 * WARPS;
    static constexpr int STEP = 2 * BM * D;  // elements of one Q + dO stage
    static constexpr int SMEM =
        (2 * BN * D + 2 * STEP + 2 * BN * BM) * (int)sizeof(T) + 2 * 2 * BM * 4;
};

template <typename T, int D, int BM, int BN, bool MODS>
__device__ __forceinline__ void dkdvq_mma(const BwdParams& bp) {
    using Tr = DkdvqTraits<T, D, BM, BN>;
    constexpr int THREADS = Tr::THREADS, STEP = Tr::STEP;
    static_assert(BN == 128, "phase A and B tile the keys with 4 warps of 32");
    static_assert(BM % 32 == 0 && 8 % (BM / 32) == 0, "phase C: 32-row warp tiles");
    static_assert(D % 64 == 0, "swizzled rows of whole 8-chunk groups");
    // Phase A: warp (wa_n = warp % 4, wa_m = warp / 4): keys 32 wa_n.., queries (BM/2) wa_m..
    // Two passes over the warp's queries: with both in one, S^T and dP^T of 32 x 32 next to
    // dK and dV (128 registers at d 128) spill on sm_90.
    constexpr int A_MI = 2, A_PASSES = 2, A_NJ = BM / 2 / 8 / A_PASSES;
    // Phase B: warp (warp % 4, warp / 4): keys 32 (warp % 4).., dims (D/2) (warp / 4)..
    constexpr int B_DJ = D / 2 / 8;
    // Phase C: warp (warp % CM, warp / CM): rows 32 (warp % CM).., dims (D / CD) (warp / CM)..
    constexpr int CM = BM / 32, CD = 8 / CM, C_DJ = D / CD / 8;
    static_assert(A_NJ % 2 == 0 && B_DJ % 2 == 0 && C_DJ % 2 == 0, "ldmatrix x4 pairs");
    // Partial unrolling of the phase B / C / atomic loops: fully unrolled, the compiler hoists
    // their operand loads and addresses and spills (ptxas, sm_90).
    constexpr int kBUnroll = 2, kCUnroll = 2, kRedUnroll = 2;
    const FlashParams& p = bp.f;

    extern __shared__ __align__(128) unsigned char smem_raw[];
    T* sK = reinterpret_cast<T*>(smem_raw);
    T* sV = sK + BN * D;
    T* sQ0 = sV + BN * D;           // stage s: Q (BM x D) at sQ0 + s STEP, dO right after
    T* sPt = sQ0 + 2 * STEP;        // P^T, BN x BM, swizzled
    T* sdSt = sPt + BN * BM;        // dS^T, BN x BM, swizzled
    float* sL0 = reinterpret_cast<float*>(sdSt + BN * BM);  // stage s: lse at sL0 + 2 s BM, D after

    const int tid = threadIdx.x;
    const int kvh = blockIdx.y, b = blockIdx.z;
    BlockGeom g;
    KeyTile kt;
    if (!key_tile<BN, BM>(p, b, (int)blockIdx.x, g, kt)) return;
    const int n0 = kt.n0, rows_k = kt.rows_k, m_begin = kt.m_begin, m_count = kt.m_count;
    const int64_t off = kt.off;
    const int steps = m_count * p.kv_group;
    load_kv_tile<T, D, BN, THREADS>(p, b, kvh, g, kt, sK, sV);

    // Step s: query head kvh * group + s / m_count, query tile (last first) m_tile(s).
    auto m_tile = [&](int s) { return m_begin + m_count - 1 - s % m_count; };
    auto issue = [&](int s) {
        load_q_step<T, D, BM, THREADS>(bp, b, kvh * p.kv_group + s / m_count, m_tile(s) * BM, g,
                                       sQ0 + (s % 2) * STEP, sL0 + (s % 2) * 2 * BM, tid);
    };
    if (steps > 0) issue(0);
    cp_async_commit();

    // dK / dV of this warp (phase B tiling): keys 32 (warp % 4) + 16 mi + .., dims (D/2)(warp/4)..
    float acc_dk[2][B_DJ][4], acc_dv[2][B_DJ][4];
#pragma unroll
    for (int mi = 0; mi < 2; ++mi)
#pragma unroll
        for (int j = 0; j < B_DJ; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc_dk[mi][j][e] = acc_dv[mi][j][e] = 0.f;

    for (int s = 0; s < steps; ++s) {
        cp_async_wait<0>();
        __syncthreads();  // step s landed everywhere; everyone is done with step s - 1
        if (s + 1 < steps) issue(s + 1);
        cp_async_commit();
        const T* sQ = sQ0 + (s % 2) * STEP;
        const T* sdO = sQ + BM * D;
        const float* sL = sL0 + (s % 2) * 2 * BM;
        const int h = kvh * p.kv_group + s / m_count;
        const int m_t = m_tile(s);
        const int m0 = m_t * BM;
        // Per-thread tile addresses are rebuilt in every phase from a volatile read of the
        // thread index: left loop-invariant, the compiler hoists one offset per (operand,
        // k step) out of the loop and runs out of registers next to dK and dV.
        int warp = flash::tid_volatile() / 32, lane = flash::tid_volatile() % 32;
        int wk = warp % 4;  // key slice (phases A and B)
        int wq = warp / 4;  // query slice (phase A) / dim slice (phase B)
        // Phase A operands: K / V rows of the warp as A; Q / dO rows of the warp as B.
        const SwzRow<D> a_off(32 * wk + lane % 16, lane / 16);
        const SwzRow<D> b_off((BM / 2) * wq + (lane / 16) * 8 + lane % 8, (lane / 8) % 2);
        const int key_a = n0 + 32 * wk + lane / 4;  // phase A: key of element (mi, e < 2)

        // ---- A: S^T = K Q^T, dP^T = V dO^T (32 keys x BM/2 queries per warp), in A_PASSES
        // slices of 8 A_NJ queries (fewer accumulators live next to dK and dV).
        const float slope_log2 = p.alibi ? p.alibi[b * p.alibi_batch + h] * LOG2E_F : 0.f;
        bool full = n0 + BN <= g.sk && m0 + BM <= g.sq;
        if (p.win_left >= 0 && (int64_t)m0 + BM - 1 + off - p.win_left > n0) full = false;
        if (p.win_right >= 0 && (int64_t)n0 + BN - 1 > m0 + off + p.win_right) full = false;
#pragma unroll 1
        for (int ps = 0; ps < A_PASSES; ++ps) {
            const int qc0 = (BM / 2) * wq + 8 * A_NJ * ps;  // first query column of the slice
            const T* sQp = sQ + 8 * A_NJ * ps * D;
            const T* sdOp = sdO + 8 * A_NJ * ps * D;
            const Swz<BM> st_off(32 * wk + lane / 4, qc0 / 8);  // P^T / dS^T stores
            float acc[A_MI][A_NJ][4];
            // S^T first; P^T goes to shared memory and, times the softcap's chain factor,
            // stays in registers as packed T pairs (half the registers of f32) while the same
            // accumulators then compute dP^T.
            warp_gemm_abt<T, D, A_MI, A_NJ>(acc, sK, sQp, a_off, b_off);

            // Element (mi, j, e): key key_a + 16 mi + 8 (e / 2), query column
            // cq = qc0 + 8 j + 2 (lane % 4) + e % 2 of the tile.
            uint32_t pc[A_MI][A_NJ][2];  // P^T * chain, packed pairs (e = 2 hf, 2 hf + 1)
#pragma unroll
            for (int mi = 0; mi < A_MI; ++mi)
#pragma unroll
                for (int j = 0; j < A_NJ; ++j)
#pragma unroll
                    for (int hf = 0; hf < 2; ++hf) {
                        float pv[2], pcv[2];
#pragma unroll
                        for (int c = 0; c < 2; ++c) {
                            const int key = key_a + 16 * mi + 8 * hf;
                            const int cq = qc0 + 8 * j + 2 * (lane % 4) + c;
                            const int qi = m0 + cq;
                            const int diag = (int)(qi + off);
                            float chain;
                            float x = logit2<MODS>(p, acc[mi][j][2 * hf + c], slope_log2, diag,
                                                   key, chain);
                            if (!full && (qi >= g.sq || !visible(p, diag, key, g.sk)))
                                x = -INFINITY;
                            pv[c] = fast_exp2(x - lse_log2(sL[cq]));
                            pcv[c] = pv[c] * chain;
                        }
                        const int o = st_off.at(16 * mi + 8 * hf, j) + 2 * (lane % 4);
                        *reinterpret_cast<uint32_t*>(sPt + o) = Mma<T>::pack(pv[0], pv[1]);
                        pc[mi][j][hf] = Mma<T>::pack(pcv[0], pcv[1]);
                    }

            warp_gemm_abt<T, D, A_MI, A_NJ>(acc, sV, sdOp, a_off, b_off);
            // dS^T = P^T chain (dP^T - D).
#pragma unroll
            for (int mi = 0; mi < A_MI; ++mi)
#pragma unroll
                for (int j = 0; j < A_NJ; ++j)
#pragma unroll
                    for (int hf = 0; hf < 2; ++hf) {
                        const int cq = qc0 + 8 * j + 2 * (lane % 4);
                        const float2 pcf = unpack2<T>(pc[mi][j][hf]);
                        const float d0 = pcf.x * (acc[mi][j][2 * hf] - sL[BM + cq]);
                        const float d1 = pcf.y * (acc[mi][j][2 * hf + 1] - sL[BM + cq + 1]);
                        const int o = st_off.at(16 * mi + 8 * hf, j) + 2 * (lane % 4);
                        *reinterpret_cast<uint32_t*>(sdSt + o) = Mma<T>::pack(d0, d1);
                    }
        }
        __syncthreads();  // P^T and dS^T of the whole tile are in shared memory

        // ---- B: dV += P^T dO, dK += dS^T Q (32 keys x D/2 dims per warp; k = BM queries).
        // P^T / dS^T rows as A; dO / Q (k = queries) as B, transposed.
        warp = flash::tid_volatile() / 32, lane = flash::tid_volatile() % 32;
        wk = warp % 4, wq = warp / 4;
        const Swz<BM> pa_off(32 * wk + lane % 16, lane / 16);
        const Swz<D> t_off(lane % 16, (D / 2) * wq / 8 + lane / 16);
#pragma unroll kBUnroll
        for (int kk = 0; kk < BM / 16; ++kk) {
            uint32_t pa[2][4], da[2][4];
#pragma unroll
            for (int mi = 0; mi < 2; ++mi) {
                ldsm_x4(pa[mi], sPt + pa_off.at(16 * mi, 2 * kk));
                ldsm_x4(da[mi], sdSt + pa_off.at(16 * mi, 2 * kk));
            }
#pragma unroll
            for (int dp = 0; dp < B_DJ / 2; ++dp) {
                uint32_t ob[4], qb[4];
                ldsm_x4_t(ob, sdO + t_off.at(16 * kk, 2 * dp));
                ldsm_x4_t(qb, sQ + t_off.at(16 * kk, 2 * dp));
#pragma unroll
                for (int mi = 0; mi < 2; ++mi) {
                    Mma<T>::run(acc_dv[mi][2 * dp], pa[mi], ob[0], ob[1]);
                    Mma<T>::run(acc_dv[mi][2 * dp + 1], pa[mi], ob[2], ob[3]);
                    Mma<T>::run(acc_dk[mi][2 * dp], da[mi], qb[0], qb[1]);
                    Mma<T>::run(acc_dk[mi][2 * dp + 1], da[mi], qb[2], qb[3]);
                }
            }
        }

        // ---- C: dQ tile += dS K (32 rows x D/CD dims per warp; k = BN keys).
        // dS read transposed as A (rows = keys of the stored dS^T); K as B, transposed.
        warp = flash::tid_volatile() / 32, lane = flash::tid_volatile() % 32;
        const int cm = warp % CM, cd = warp / CM;
        const Swz<BM> ca_off((lane / 16) * 8 + lane % 8, 4 * cm + (lane / 8) % 2);
        const Swz<D> kc_off(lane % 16, (D / CD) * cd / 8 + lane / 16);
        float acc_dq[2][C_DJ][4];
#pragma unroll
        for (int mi = 0; mi < 2; ++mi)
#pragma unroll
            for (int j = 0; j < C_DJ; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) acc_dq[mi][j][e] = 0.f;
#pragma unroll kCUnroll
        for (int kk = 0; kk < BN / 16; ++kk) {
            uint32_t sa[2][4];
#pragma unroll
            for (int mi = 0; mi < 2; ++mi)
                ldsm_x4_t(sa[mi], sdSt + ca_off.at(16 * kk, 2 * mi));
#pragma unroll
            for (int dp = 0; dp < C_DJ / 2; ++dp) {
                uint32_t kb[4];
                ldsm_x4_t(kb, sK + kc_off.at(16 * kk, 2 * dp));
#pragma unroll
                for (int mi = 0; mi < 2; ++mi) {
                    Mma<T>::run(acc_dq[mi][2 * dp], sa[mi], kb[0], kb[1]);
                    Mma<T>::run(acc_dq[mi][2 * dp + 1], sa[mi], kb[2], kb[3]);
                }
            }
        }
        // The tile goes through shared memory (this stage's Q and dO, free once every warp is
        // past phase B) so that each warp's atomics cover whole 128-byte rows: an add per lane
        // at consecutive addresses instead of 8 rows x 4 scattered pairs per instruction.
        // Rows are XOR-swizzled by 8 (r & 3) columns: conflict-free float2 stores and reads.
        __syncthreads();  // every warp is done with this stage's Q and dO
        float* sdQ = reinterpret_cast<float*>(const_cast<T*>(sQ));
#pragma unroll
        for (int mi = 0; mi < 2; ++mi)
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
                const int r = 32 * cm + 16 * mi + 8 * hf + lane / 4;
#pragma unroll
                for (int j = 0; j < C_DJ; ++j) {
                    const int c = (D / CD) * cd + 8 * j + 2 * (lane % 4);
                    *reinterpret_cast<float2*>(sdQ + r * D + (c ^ ((r & 3) << 3))) =
                        make_float2(acc_dq[mi][j][2 * hf], acc_dq[mi][j][2 * hf + 1]);
                }
            }
        __syncthreads();  // the tile is staged
        {
            // Warp w adds rows w, w + 8, ..; lane l columns l, l + 32, .. (row r & 3 = w & 3).
            const int rows_q = g.sq - m0;
            float* dst = bp.dq_accum + (g.out_row0 + m0 + warp) * p.o_seq +
                         (int64_t)h * p.o_head + lane;
            const float* src = sdQ + warp * D + (lane ^ ((warp & 3) << 3));
            const int64_t step = 8 * p.o_seq;
#pragma unroll kRedUnroll
            for (int i = 0; i < BM / 8; ++i) {
                if (warp + 8 * i < rows_q) {
#pragma unroll
                    for (int q = 0; q < D / 32; ++q) atomicAdd(dst + 32 * q, src[32 * q]);
                }
                dst += step;
                src += 8 * D;
            }
        }
    }
    cp_async_wait<0>();

    // Epilogue: rows key_b + 16 mi (+8), columns (D/2) wq + 8 j + 2 (lane % 4) (+1), pairs.
    const int vt = flash::tid_volatile();
    const int warp_e = vt / 32, lane_e = vt % 32;
    const int wk = warp_e % 4, wq = warp_e / 4;
    const int key_b = 32 * wk + lane_e / 4;
    T* dkg = static_cast<T*>(bp.dk) + (int64_t)b * bp.dkv_batch +
             (g.k_row0 + n0 + key_b) * bp.dkv_seq + (int64_t)kvh * p.d_out + (D / 2) * wq +
             2 * (lane_e % 4);
    T* dvg = static_cast<T*>(bp.dv) + (dkg - static_cast<T*>(bp.dk));
#pragma unroll
    for (int mi = 0; mi < 2; ++mi)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
            const int kr = key_b + 16 * mi + 8 * hf;
            if (kr >= rows_k) continue;
            const int64_t ro = (16 * mi + 8 * hf) * bp.dkv_seq;
#pragma unroll
            for (int j = 0; j < B_DJ; ++j) {
                *reinterpret_cast<uint32_t*>(dkg + ro + 8 * j) = Mma<T>::pack(
                    acc_dk[mi][j][2 * hf] * bp.scale, acc_dk[mi][j][2 * hf + 1] * bp.scale);
                *reinterpret_cast<uint32_t*>(dvg + ro + 8 * j) =
                    Mma<T>::pack(acc_dv[mi][j][2 * hf], acc_dv[mi][j][2 * hf + 1]);
            }
        }
}

// dQ = T(scale * f32 sums), elementwise over the contiguous output, 4 at a time (rows of
// heads * d, d a multiple of 64, so the total is a multiple of 4).
template <typename T>
__device__ __forceinline__ void dq_convert(const BwdParams& bp) {
    const int64_t n4 = (int64_t)bp.f.total_q * bp.f.o_seq / 4;
    const float4* src = reinterpret_cast<const float4*>(bp.dq_accum);
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n4;
         i += (int64_t)gridDim.x * blockDim.x) {
        const float4 v = src[i];
        uint2 o;
        o.x = Mma<T>::pack(v.x * bp.scale, v.y * bp.scale);
        o.y = Mma<T>::pack(v.z * bp.scale, v.w * bp.scale);
        reinterpret_cast<uint2*>(bp.dq)[i] = o;
    }
}

template <typename T, int D, int BN, int WARPS>
struct DqTraits {
    static constexpr int BM = 16 * WARPS;  // query rows per block
    static constexpr int THREADS = 32 * WARPS;
    static constexpr int KV = 2 * BN * D;  // elements of one K + V stage
    static constexpr int SMEM = (2 * BM * D + 2 * KV) * (int)sizeof(T);
};

template <typename T, int D, int BN, int WARPS, bool MODS>
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

// Entry points of one (dtype, head dim): dK/dV, dQ and the fused atomic kernel, each plain and
// `_mods` (softcap / ALiBi). Tiles come from the table in src/cuda/backward/instances.rs through
// the generated bwd_instances.cuh, with the shared memory the planner assumes (checked here).
#define FLASH_BWD_MMA_INSTANCE(PREFIX, T, D, KV_BM, KV_WARPS, KV_MINB, KV_SMEM, Q_BN, Q_WARPS,   \
                               Q_MINB, Q_SMEM, F_BM, F_BN, F_SMEM)                             \
    static_assert(bwd::DkdvTraits<T, D, KV_BM, KV_WARPS>::SMEM == KV_SMEM,                    \
                  "src/cuda/backward/plan.rs and the dkdv kernel disagree on shared memory"); \
    static_assert(bwd::DqTraits<T, D, Q_BN, Q_WARPS>::SMEM == Q_SMEM,                         \
                  "src/cuda/backward/plan.rs and the dq kernel disagree on shared memory");   \
    static_assert(bwd::DkdvqTraits<T, D, F_BM, F_BN>::SMEM == F_SMEM,                         \
                  "src/cuda/backward/plan.rs and the dkdvq kernel disagree on shared memory"); \
    extern "C" __global__ void __launch_bounds__(KV_WARPS * 32, KV_MINB)                      \
        PREFIX##_dkdv_d##D(const BwdParams p) {                                               \
        bwd::dkdv_mma<T, D, KV_BM, KV_WARPS, false>(p);                                       \
    }                                                                                         \
    extern "C" __global__ void __launch_bounds__(KV_WARPS * 32, KV_MINB)                      \
        PREFIX##_dkdv_d##D##_mods(const BwdParams p) {                                        \
        bwd::dkdv_mma<T, D, KV_BM, KV_WARPS, true>(p);                                        \
    }                                                                                         \
    extern "C" __global__ void __launch_bounds__(Q_WARPS * 32, Q_MINB)                        \
        PREFIX##_dq_d##D(const BwdParams p) {                                                 \
        bwd::dq_mma<T, D, Q_BN, Q_WARPS, false>(p);                                           \
    }                                                                                         \
    extern "C" __global__ void __launch_bounds__(Q_WARPS * 32, Q_MINB)                        \
        PREFIX##_dq_d##D##_mods(const BwdParams p) {                                          \
        bwd::dq_mma<T, D, Q_BN, Q_WARPS, true>(p);                                            \
    }                                                                                         \
    extern "C" __global__ void __launch_bounds__(256, 1) PREFIX##_dkdvq_d##D(const BwdParams p) { \
        bwd::dkdvq_mma<T, D, F_BM, F_BN, false>(p);                                           \
    }                                                                                         \
    extern "C" __global__ void __launch_bounds__(256, 1)                                      \
        PREFIX##_dkdvq_d##D##_mods(const BwdParams p) {                                       \
        bwd::dkdvq_mma<T, D, F_BM, F_BN, true>(p);                                            \
    }

// Every backward entry point of one 16-bit dtype: the D pass, the exact kernels (other head dims
// and strided operands) and the tensor-core instances.
#define FLASH_BWD_INSTANCES(PREFIX, T)                                                        \
    FLASH_BWD_GENERIC_INSTANCES(PREFIX, T)                                                    \
    FLASH_BWD_MMA_INSTANCES(PREFIX, T)                                                        \
    extern "C" __global__ void __launch_bounds__(256) PREFIX##_dq_convert(const BwdParams p) { \
        bwd::dq_convert<T>(p);                                                                \
    }
