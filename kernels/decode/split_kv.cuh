// Decode attention (few query rows per KV head against a long KV cache), f16/bf16 on tensor
// cores, in two passes as in flash-decoding:
//
// 1. Partial pass (`decode_partial`), grid (num_splits, kv_heads * m_tiles, batch):
//    - GQA packing: the query heads sharing one K/V head and all their seq_q rows form one
//      16-row mma tile (packed row r -> query i = r / group, head kvh * group + r % group), so each
//      K/V row is read from memory once per tile instead of once per query head.
//    - Split-KV: blockIdx.x takes one slice of `split_keys` keys of the sequence, so a batch of
//      few sequences still fills every SM.
//    - The block streams its keys BC = 16 * WARPS at a time through a STAGES-deep cp.async ring;
//      for paged caches the block-table entries of a tile are read one iteration before its
//      copies are issued (into shared memory, shared by K and V), so no copy waits on a table load;
//      warp w computes S = Q K^T for keys [16 w, 16 w + 16) of each tile (mma m16n8k16, Q and K
//      by ldmatrix), runs the online softmax on its 16 x 16 scores and accumulates O += P V in
//      registers (P straight from the S registers, V by ldmatrix.trans), as the prefill kernel.
//    - After the loop the warps' (m, l, O) are merged through shared memory in warp order (a
//      fixed order: bitwise deterministic). With one split the block writes the output and lse
//      directly; otherwise it writes O / l (f32) and its base-2 log-sum-exp to the split scratch.
// 2. Combine (`decode_combine`), one block per (query row, head): lse = log2-sum-exp2 over the
//    splits, O = sum_s 2^(lse_s - lse) O_s, written in the output dtype with the natural-log lse.
//    Thread s reads split s's lse (one load round for all splits); warp w sums splits w, w + 4,
//    ... (four at a time, so their loads are in flight together) and the warps' sums are added
//    in warp order: bitwise deterministic. Splits that saw no key carry lse -inf and weigh 0; a
//    row no split saw outputs 0, lse -inf.
// Masking (causal, windows), softcap and ALiBi follow src/semantics.rs through common/.
#pragma once
#include "common/mask.cuh"
#include "common/math.cuh"
#include "common/ptx.cuh"
#include "forward/mma.cuh"
#include "forward/rowwise.cuh"

namespace decode {

using flash::cp_async_commit;
using flash::cp_async_wait;
using flash::ldsm_x4;
using flash::ldsm_x4_t;
using flash::Mma;
using flash::swz;
using flash::SwzRow;

constexpr int ROWS = 16;  // packed rows per tile: one mma M tile

template <typename T, int D, int WARPS, int STAGES>
struct Traits {
    static constexpr int THREADS = WARPS * 32;
    static constexpr int BC = 16 * WARPS;  // keys per K/V tile, 16 per warp
    static constexpr int DT = D / 8;       // n8 tiles of O
    // Q tile, then STAGES (K, V) tiles. The f32 merge buffer of the epilogue reuses the ring.
    static constexpr int SMEM = (ROWS * D + STAGES * 2 * BC * D) * (int)sizeof(T);
    static_assert(ROWS * D * 4 <= STAGES * 2 * BC * D * (int)sizeof(T), "merge buffer fits");
};

// Where a packed row of the tile lives: query row i of head h, or nothing (r >= group * sq).
struct PackedRow {
    int i, h;
    bool valid;
};
__device__ __forceinline__ PackedRow packed_row(const FlashParams& p, int m0, int r, int kvh,
                                                int sq) {
    const int pr = m0 + r;
    PackedRow x;
    x.i = pr / p.kv_group;
    x.h = kvh * p.kv_group + pr % p.kv_group;
    x.valid = x.i < sq;
    return x;
}

// Copies ROWS x D of Q (packed rows, per-row addresses) into a swizzled tile, zero-filling rows
// past the packed length and columns past d_load.
template <typename T, int D, int THREADS>
__device__ __forceinline__ void load_q(T* sQ, const FlashParams& p, int b, const BlockGeom& g,
                                       int m0, int kvh) {
    constexpr int C = D / 8;
    for (int idx = threadIdx.x; idx < ROWS * C; idx += THREADS) {
        const int r = idx / C, c = idx % C;
        const PackedRow x = packed_row(p, m0, r, kvh, g.sq);
        const bool ok = x.valid && c * 8 < p.d_load;
        const T* src = static_cast<const T*>(p.q);
        if (ok)
            src += (int64_t)b * p.q_batch + (g.q_row0 + x.i) * p.q_seq + (int64_t)x.h * p.q_head +
                   c * 8;
        flash::cp_async16(sQ + swz<D>(r, c), src, ok ? 16 : 0);
    }
}

// Copies keys [key0, key0 + TILE) of one K/V head into the swizzled K and V tiles. Contiguous
// caches (blk null) read row j at kg / vg (the sequence's first row) plus j rows; paged caches
// read row j % page of block blk[j - key0], the tile's block-table entries fetched beforehand
// (-1 for rows past the sequence). Rows past `rows_valid`, columns past d_load and blocks outside
// the cache are zero-filled.
template <typename T, int D, int TILE, int THREADS>
__device__ __forceinline__ void load_kv(T* sK, T* sV, const FlashParams& p, const T* kg,
                                        const T* vg, int64_t k_head_off, int64_t v_head_off,
                                        int key0, int rows_valid, const int* blk) {
    constexpr int C = D / 8;
    constexpr int RPI = THREADS / C;
    static_assert(RPI >= 1, "a row must fit in one pass of the block");
    const int r0 = threadIdx.x / C, c = threadIdx.x % C;
    if (r0 >= RPI) return;
    const bool col_ok = c * 8 < p.d_load;
    const T* kc = static_cast<const T*>(p.k);
    const T* vc = static_cast<const T*>(p.v);
    constexpr int N = (TILE + RPI - 1) / RPI;
#pragma unroll
    for (int it = 0; it < N; ++it) {
        const int r = r0 + it * RPI;
        if (TILE % RPI != 0 && r >= TILE) break;
        const int j = key0 + r;
        const T* ks = nullptr;
        const T* vs = nullptr;
        if (col_ok && r < rows_valid) {
            if (blk) {
                const int bi = blk[r];
                if (bi >= 0 && bi < p.num_blocks) {
                    // Power-of-two pages (vLLM's 16, most of upstream's) mask instead of divide.
                    const int row = p.page_shift >= 0 ? j & (p.page - 1) : j % p.page;
                    ks = kc + (int64_t)bi * p.k_batch + (int64_t)row * p.k_seq + k_head_off;
                    vs = vc + (int64_t)bi * p.v_batch + (int64_t)row * p.v_seq + v_head_off;
                }
            } else {
                ks = kg + (int64_t)j * p.k_seq;
                vs = vg + (int64_t)j * p.v_seq;
            }
        }
        // A zero-byte copy reads nothing; point it at the cache base, which is always mapped.
        flash::cp_async16(sK + swz<D>(r, c), ks ? ks + c * 8 : kc, ks ? 16 : 0);
        flash::cp_async16(sV + swz<D>(r, c), vs ? vs + c * 8 : vc, vs ? 16 : 0);
    }
}

// The block-table entry of key j of sequence b (paged caches), or -1 past the sequence's sk
// keys. Only the load is issued here: the value is first used when it is stored to shared
// memory, after the tile's compute, so the load's latency hides behind it.
__device__ __forceinline__ int table_entry(const FlashParams& p, int b, int j, int sk) {
    int blk = -1;
    if (j < sk) {
        const int pg = p.page_shift >= 0 ? j >> p.page_shift : j / p.page;
        blk = p.block_table[(int64_t)b * p.max_blocks + pg];
    }
    return blk;
}

template <typename T, int D, int WARPS, int STAGES, bool MODS>
__device__ __forceinline__ void partial(const FlashParams& p) {
    using Tr = Traits<T, D, WARPS, STAGES>;
    constexpr int THREADS = Tr::THREADS, BC = Tr::BC, DT = Tr::DT;
    extern __shared__ __align__(128) unsigned char smem_raw[];
    T* sQ = reinterpret_cast<T*>(smem_raw);
    T* sKV = sQ + ROWS * D;  // stage s: K at sKV + 2 s BC D, V right after

    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int split = blockIdx.x;
    const int kvh = blockIdx.y / p.m_tiles, mt = blockIdx.y % p.m_tiles;
    const int b = blockIdx.z;
    const int m0 = mt * ROWS;

    // Sequence geometry (the row range passed to block_geom is that of the query rows the
    // packed tile touches, so its key range is the union of theirs).
    BlockGeom g;
    const int i_first = m0 / p.kv_group;
    {
        BlockGeom g0;
        if (!block_geom<true>(p, 0, 1, 0, b, g0)) return;  // empty sequence: no rows
        g = g0;
    }
    if (i_first >= g.sq) return;
    const int i_last = min(g.sq - 1, (m0 + ROWS - 1) / p.kv_group);
    {
        // Key range of rows i_first..i_last (both window ends grow with the row).
        const int64_t diag_first = (int64_t)i_first + g.sk - g.sq;
        const int64_t diag_last = (int64_t)i_last + g.sk - g.sq;
        int64_t lo = 0, hi = g.sk;
        // Prefix ranges widen rows' windows: such blocks walk every key (the rows' own ranges
        // mask them below).
        if (p.win_left >= 0 && !p.prefix)
            lo = max((int64_t)0, min((int64_t)g.sk, diag_first - p.win_left));
        if (p.win_right >= 0 && !p.prefix)
            hi = max((int64_t)0, min((int64_t)g.sk, diag_last + p.win_right + 1));
        // This split's slice of the keys.
        const int64_t s_lo = (int64_t)split * p.split_keys, s_hi = s_lo + p.split_keys;
        g.n_lo = (int)max(lo, min(s_lo, (int64_t)g.sk));
        g.n_hi = (int)max((int64_t)g.n_lo, min(hi, s_hi));
        g.m0 = i_first;
        g.rows = i_last - i_first + 1;
    }

    const T* kc = static_cast<const T*>(p.k);
    const T* vc = static_cast<const T*>(p.v);
    const T* kg = kc + (int64_t)b * p.k_batch + g.k_row0 * p.k_seq + (int64_t)kvh * p.k_head;
    const T* vg = vc + (int64_t)b * p.v_batch + g.k_row0 * p.v_seq + (int64_t)kvh * p.v_head;

    // This thread's two packed rows (lane / 4 and lane / 4 + 8): diagonal, visible keys (within
    // this split) and ALiBi slope.
    int diag[2], row_lo[2], row_hi[2];
    float slope_log2[2];
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
        const PackedRow x = packed_row(p, m0, lane / 4 + 8 * hf, kvh, g.sq);
        diag[hf] = x.i + g.sk - g.sq;
        row_keys(p, b, diag[hf], g.sk, row_lo[hf], row_hi[hf]);
        row_lo[hf] = max(row_lo[hf], g.n_lo);
        row_hi[hf] = min(row_hi[hf], g.n_hi);
        slope_log2[hf] =
            (MODS && p.alibi) ? p.alibi[b * p.alibi_batch + x.h] * LOG2E_F : 0.f;
    }

    float acc_o[DT][4];
#pragma unroll
    for (int j = 0; j < DT; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc_o[j][e] = 0.f;
    float row_m[2] = {-INFINITY, -INFINITY}, row_l[2] = {0.f, 0.f};
    const float unit = MODS ? 1.f : p.scale_log2;

    const SwzRow<D> q_off(lane % 16, lane / 16);
    const SwzRow<D> k_off(16 * warp + (lane / 16) * 8 + lane % 8, (lane / 8) % 2);
    const SwzRow<D> v_off(16 * warp + lane % 16, lane / 16);

    const int t_begin = g.n_lo / BC;
    const int t_end = g.n_hi > g.n_lo ? (g.n_hi + BC - 1) / BC : t_begin;

    // Block-table entries of two consecutive K/V tiles (paged caches, tile t in blk[t % 2])
    // during the key loop; the warps' row maxima and sums in the merge after it.
    __shared__ union {
        int blk[2][BC];
        struct {
            float m[WARPS][ROWS], l[WARPS][ROWS];
        } ml;
    } sh_u;
    const bool paged = p.block_table != nullptr;
    // Thread tid < BC fetches the table entry of key tid of tile t (-1 elsewhere).
    auto fetch = [&](int t) {
        return paged && tid < BC && t < t_end ? table_entry(p, b, t * BC + tid, g.sk) : -1;
    };
    // Only tiles the loop will issue: the buffer of a later one may still be read.
    auto put = [&](int t, int blk) {
        if (paged && tid < BC && t < t_end) sh_u.blk[t % 2][tid] = blk;
    };
    // Issues the copies of tile t into ring stage `stage` (the table entries of a paged tile
    // must be in shared memory, behind a barrier).
    auto issue = [&](int t, int stage) {
        T* sK = sKV + stage * 2 * BC * D;
        load_kv<T, D, BC, THREADS>(sK, sK + BC * D, p, kg, vg, (int64_t)kvh * p.k_head,
                                   (int64_t)kvh * p.v_head, t * BC, min(BC, g.sk - t * BC),
                                   paged ? sh_u.blk[t % 2] : nullptr);
    };

    load_q<T, D, THREADS>(sQ, p, b, g, m0, kvh);
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        const int t = t_begin + s;
        if (t < t_end) {
            if (paged) {
                put(t, fetch(t));
                __syncthreads();
            }
            issue(t, s);
        }
        cp_async_commit();
    }
    // The first tile the loop issues: its table entries are in place before its first barrier.
    put(t_begin + STAGES - 1, fetch(t_begin + STAGES - 1));

    for (int t = t_begin; t < t_end; ++t) {
        const int it = t - t_begin;
        cp_async_wait<STAGES - 2>();
        __syncthreads();
        const int tn = t + STAGES - 1;
        if (tn < t_end) issue(tn, (it + STAGES - 1) % STAGES);
        cp_async_commit();
        // The table entries of the tile after: loaded now, stored after this tile's compute
        // (its buffer was last read by the copies of tile tn - 1, before the barrier above).
        const int next_blk = fetch(tn + 1);

        const T* sK = sKV + (it % STAGES) * 2 * BC * D;
        const T* sV = sK + BC * D;
        const int k0 = t * BC + 16 * warp;  // this warp's first key
        if (k0 < g.n_hi && k0 + 16 > g.n_lo) {
            // S = Q K^T: 16 rows x this warp's 16 keys (two n8 tiles).
            float acc_s[2][4];
#pragma unroll
            for (int j = 0; j < 2; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) acc_s[j][e] = 0.f;
#pragma unroll
            for (int kk = 0; kk < D / 16; ++kk) {
                uint32_t qa[4], kb[4];
                ldsm_x4(qa, sQ + q_off.at(0, kk));
                ldsm_x4(kb, sK + k_off.at(0, kk));
                Mma<T>::run(acc_s[0], qa, kb[0], kb[1]);
                Mma<T>::run(acc_s[1], qa, kb[2], kb[3]);
            }

            const int col = k0 + 2 * (lane % 4);
            if constexpr (MODS) {
#pragma unroll
                for (int j = 0; j < 2; ++j)
#pragma unroll
                    for (int e = 0; e < 4; ++e)
                        acc_s[j][e] = modded_score(p, acc_s[j][e], slope_log2[e / 2], diag[e / 2],
                                                   col + j * 8 + e % 2);
            }
            // Keys outside the row's visible range within this split are masked; the split bounds
            // are in that range, so two splits never count one key twice.
#pragma unroll
            for (int j = 0; j < 2; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int key = col + j * 8 + e % 2;
                    if (key < row_lo[e / 2] || key >= row_hi[e / 2]) acc_s[j][e] = -INFINITY;
                }

#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
                float mx = row_m[hf];
#pragma unroll
                for (int j = 0; j < 2; ++j)
                    mx = fmaxf(mx, fmaxf(acc_s[j][2 * hf], acc_s[j][2 * hf + 1]));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 1));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 2));
                const float m_scaled = mx == -INFINITY ? 0.f : mx * unit;
                const float alpha = fast_exp2(fmaf(row_m[hf], unit, -m_scaled));
                row_m[hf] = mx;
                float sum = 0.f;
#pragma unroll
                for (int j = 0; j < 2; ++j)
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const float pv = fast_exp2(fmaf(acc_s[j][2 * hf + e], unit, -m_scaled));
                        acc_s[j][2 * hf + e] = pv;
                        sum += pv;
                    }
                row_l[hf] = row_l[hf] * alpha + sum;
#pragma unroll
                for (int j = 0; j < DT; ++j) {
                    acc_o[j][2 * hf] *= alpha;
                    acc_o[j][2 * hf + 1] *= alpha;
                }
            }
            // O += P V (one k16 step: this warp's 16 keys).
            uint32_t pa[4];
            pa[0] = Mma<T>::pack(acc_s[0][0], acc_s[0][1]);
            pa[1] = Mma<T>::pack(acc_s[0][2], acc_s[0][3]);
            pa[2] = Mma<T>::pack(acc_s[1][0], acc_s[1][1]);
            pa[3] = Mma<T>::pack(acc_s[1][2], acc_s[1][3]);
#pragma unroll
            for (int dp = 0; dp < D / 16; ++dp) {
                uint32_t vb[4];
                ldsm_x4_t(vb, sV + v_off.at(0, dp));
                Mma<T>::run(acc_o[2 * dp], pa, vb[0], vb[1]);
                Mma<T>::run(acc_o[2 * dp + 1], pa, vb[2], vb[3]);
            }
        }
        put(tn + 1, next_blk);
    }
    cp_async_wait<0>();
    __syncthreads();

    // ---- merge the warps' partial states, in warp order -------------------------------------
    float(*sh_m)[ROWS] = sh_u.ml.m;
    float(*sh_l)[ROWS] = sh_u.ml.l;
    __shared__ float sh_scale[WARPS][ROWS];  // 2^(m_w - M) per warp and row
    __shared__ float sh_inv[ROWS], sh_lse2[ROWS];
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
        float l = row_l[hf];
        l += __shfl_xor_sync(0xffffffff, l, 1);
        l += __shfl_xor_sync(0xffffffff, l, 2);
        if (lane % 4 == 0) {
            sh_m[warp][lane / 4 + 8 * hf] = row_m[hf];
            sh_l[warp][lane / 4 + 8 * hf] = l;
        }
    }
    __syncthreads();
    if (tid < ROWS) {
        float m = -INFINITY;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) m = fmaxf(m, sh_m[w][tid]);
        const float m_scaled = m == -INFINITY ? 0.f : m * unit;
        float l = 0.f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) {
            const float s = fast_exp2(fmaf(sh_m[w][tid], unit, -m_scaled));
            sh_scale[w][tid] = s;
            l += sh_l[w][tid] * s;
        }
        sh_inv[tid] = l > 0.f ? 1.f / l : 0.f;
        // A NaN l (a NaN score) keeps NaN in the lse, as O keeps it.
        sh_lse2[tid] = l > 0.f || l != l ? m_scaled + __log2f(l) : -INFINITY;
    }
    __syncthreads();
    float* sO = reinterpret_cast<float*>(sKV);  // ROWS x D f32, the ring is drained
    for (int w = 0; w < WARPS; ++w) {
        if (warp == w) {
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
                const int r = lane / 4 + 8 * hf;
                const float s = sh_scale[w][r];
#pragma unroll
                for (int j = 0; j < DT; ++j) {
                    float2* dst = reinterpret_cast<float2*>(sO + r * D + j * 8 + 2 * (lane % 4));
                    float2 v = make_float2(acc_o[j][2 * hf] * s, acc_o[j][2 * hf + 1] * s);
                    if (w > 0) {
                        v.x += dst->x;
                        v.y += dst->y;
                    }
                    *dst = v;
                }
            }
        }
        __syncthreads();
    }

    // ---- write: the output (one split) or this split's normalised partial -------------------
    const bool final_out = p.num_splits == 1;
    for (int idx = tid; idx < ROWS * D; idx += THREADS) {
        const int r = idx / D, c = idx % D;
        const PackedRow x = packed_row(p, m0, r, kvh, g.sq);
        if (!x.valid || c >= p.d_out) continue;
        const float val = sO[idx] * sh_inv[r];
        const int64_t row_g = g.out_row0 + x.i;
        if (final_out) {
            static_cast<T*>(p.o)[row_g * p.o_seq + (int64_t)x.h * p.o_head + c] =
                rowwise::from_f32<T>(val);
        } else {
            p.o_part[((int64_t)split * p.total_q + row_g) * p.o_seq + (int64_t)x.h * p.o_head + c] =
                val;
        }
    }
    if (tid < ROWS) {
        const PackedRow x = packed_row(p, m0, tid, kvh, g.sq);
        if (x.valid) {
            const int64_t row_g = g.out_row0 + x.i;
            if (final_out) {
                const int64_t li = p.cu_q || p.q_uniform ? (int64_t)x.h * p.lse_head + row_g
                                          : ((int64_t)b * p.heads + x.h) * p.seq_q + x.i;
                p.lse[li] = sh_lse2[tid] * LN2_F;
            } else {
                p.lse_part[((int64_t)split * p.heads + x.h) * p.total_q + row_g] = sh_lse2[tid];
            }
        }
    }
}

// Widest head the combine kernel merges (the widest decode instance).
constexpr int COMBINE_MAX_D = 256;
constexpr int COMBINE_THREADS = 128;

// One block of COMBINE_THREADS per (output row, head): merges the splits' partials.
template <typename T>
__device__ __forceinline__ void combine(const FlashParams& p) {
    constexpr int WARPS = COMBINE_THREADS / 32;
    constexpr int CPL = COMBINE_MAX_D / 32;  // columns per lane
    const int64_t row_g = blockIdx.x;
    const int h = blockIdx.y;
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int ns = p.num_splits;  // <= COMBINE_THREADS (the planner's MAX_SPLITS)
    __shared__ float sh_w[COMBINE_THREADS];
    __shared__ float sh_red[2][WARPS];
    __shared__ float sh_o[WARPS][COMBINE_MAX_D];

    // Thread s holds split s's base-2 lse: M = max, sum = sum_s 2^(lse_s - M), both reduced in a
    // fixed order (lanes by a butterfly, then warps in order).
    const float l = tid < ns ? p.lse_part[((int64_t)tid * p.heads + h) * p.total_q + row_g]
                             : -INFINITY;
    // A NaN partial (a NaN score) makes the row NaN, as in the unsplit kernel.
    const bool nan = __syncthreads_or(l != l);
    float m = l;
#pragma unroll
    for (int o = 16; o >= 1; o /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffff, m, o));
    if (lane == 0) sh_red[0][warp] = m;
    __syncthreads();
    m = sh_red[0][0];
#pragma unroll
    for (int w = 1; w < WARPS; ++w) m = fmaxf(m, sh_red[0][w]);
    const float e = tid < ns && m != -INFINITY ? exp2f(l - m) : 0.f;
    float sum = e;
#pragma unroll
    for (int o = 16; o >= 1; o /= 2) sum += __shfl_xor_sync(0xffffffff, sum, o);
    if (lane == 0) sh_red[1][warp] = sum;
    __syncthreads();
    sum = sh_red[1][0];
#pragma unroll
    for (int w = 1; w < WARPS; ++w) sum += sh_red[1][w];
    const float inv = sum > 0.f ? 1.f / sum : 0.f;
    sh_w[tid] = e * inv;
    if (tid == 0) {
        const float lse2 = nan ? NAN : (m == -INFINITY ? -INFINITY : m + log2f(sum));
        // lse output index: dense (b, h, i) or varlen (h, row).
        int64_t li;
        if (p.cu_q || p.q_uniform) {
            li = (int64_t)h * p.lse_head + row_g;
        } else {
            const int64_t bb = row_g / p.seq_q, i = row_g % p.seq_q;
            li = (bb * p.heads + h) * p.seq_q + i;
        }
        p.lse[li] = lse2 * LN2_F;
    }
    __syncthreads();

    // Warp w sums splits w, w + WARPS, ... for columns lane + 32 c; four splits per step, so
    // their loads are in flight together. A split that saw no key has weight 0 and O = 0: it is
    // not read (unless the row is NaN, which every split then carries into the sum).
    float acc[CPL];
#pragma unroll
    for (int c = 0; c < CPL; ++c) acc[c] = 0.f;
    const float* part = p.o_part + row_g * p.o_seq + (int64_t)h * p.o_head;
    const int64_t split_stride = (int64_t)p.total_q * p.o_seq;
    for (int s0 = warp; s0 < ns; s0 += 4 * WARPS) {
        float x[4][CPL];
        float w[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            const int s = s0 + u * WARPS;
            w[u] = s < ns ? sh_w[s] : 0.f;
            const bool read = s < ns && (w[u] != 0.f || nan);
#pragma unroll
            for (int c = 0; c < CPL; ++c) {
                const int col = lane + 32 * c;
                x[u][c] = read && col < p.d_out ? part[s * split_stride + col] : 0.f;
            }
        }
#pragma unroll
        for (int u = 0; u < 4; ++u)
#pragma unroll
            for (int c = 0; c < CPL; ++c) acc[c] += w[u] * x[u][c];
    }
#pragma unroll
    for (int c = 0; c < CPL; ++c) sh_o[warp][lane + 32 * c] = acc[c];
    __syncthreads();
    for (int col = tid; col < p.d_out; col += COMBINE_THREADS) {
        float o = sh_o[0][col];
#pragma unroll
        for (int w = 1; w < WARPS; ++w) o += sh_o[w][col];
        static_cast<T*>(p.o)[row_g * p.o_seq + (int64_t)h * p.o_head + col] =
            rowwise::from_f32<T>(o);
    }
}

}  // namespace decode

// Entry points of the table in src/cuda/instances.rs (DECODE_INSTANCES), expanded by build.rs
// into FLASH_DECODE_INSTANCES with the shared-memory size the planner assumes.
#define FLASH_DECODE_INSTANCE(NAME, T, D, WARPS, STAGES, SMEM_BYTES)                           \
    static_assert(decode::Traits<T, D, WARPS, STAGES>::SMEM == SMEM_BYTES,                      \
                  "src/cuda/instances.rs and the kernel disagree on shared memory");           \
    static_assert(D <= decode::COMBINE_MAX_D, "the combine kernel merges heads up to 256");     \
    extern "C" __global__ void __launch_bounds__(WARPS * 32) NAME(const FlashParams p) {        \
        decode::partial<T, D, WARPS, STAGES, false>(p);                                         \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(WARPS * 32) NAME##_mods(const FlashParams p) { \
        decode::partial<T, D, WARPS, STAGES, true>(p);                                          \
    }

#define FLASH_DECODE_COMBINE(NAME, T) \
    extern "C" __global__ void __launch_bounds__(decode::COMBINE_THREADS) NAME(                 \
        const FlashParams p) {                                                                  \
        decode::combine<T>(p);                                                                  \
    }
