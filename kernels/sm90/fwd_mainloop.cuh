// The sm_90a forward's consumer main loop: for one query tile, a consumer warpgroup's 64 rows
// against the tile's key range, BN keys at a time, with the online softmax.
//
// Per key tile t: S = Q K^T by wgmma with both operands in shared memory (m64nBNk16, f32
// accumulators in registers), score modifiers (softcap, ALiBi) and masks on S, the online
// softmax (row max m and sum l per row, P = 2^(s - m) in place of S), then O += P V by wgmma
// with P from registers (the accumulator layout of S, rounded to T, is the A fragment layout)
// and V read MN-major. Masks, softcap, ALiBi, bias, block masks, GQA and varlen follow the rules
// of src/semantics.rs through common/mask.cuh, common/score.cuh and common/extras.cuh, as the
// sm_80 kernel does; MODS instances walk the block mask's list of key tiles.
//
// Overlap (FlashAttention-3): within a warpgroup, S of tile t and P V of tile t - 1 are issued
// together and the softmax of t runs while P V completes; O is rescaled after it, and in the
// LAZY instances (d >= 128) only when a row's reference max moves. There, without score
// modifiers, the softmax first takes the exps against the current max and computes the row max,
// from S issued again, only for the rare tiles where that guess fails (softmax_spec). Between
// warpgroups (PINGPONG), named barriers hand the GEMM issue slot round-robin so one warpgroup's
// softmax runs under another's GEMMs. d 256 takes FlashAttention-3's shape: 80-key tiles (S as
// m64n80k16), O += P V as m64n256k16 into 128 f32 registers a thread.
#pragma once
#include "common/extras.cuh"
#include "common/mask.cuh"
#include "common/math.cuh"
#include "common/ptx.cuh"
#include "common/score.cuh"
#include "sm90/fwd_traits.cuh"
#include "sm90/ptx.cuh"

namespace sm90 {

// LAZY instances: the online softmax's reference max moves only when a tile's max exceeds it by
// more than this (base 2), so P = 2^(s - m) stays below 2^8.
constexpr float RESCALE_LOG2 = 8.f;

// One consumer warpgroup on one query tile. The state the key loop updates (O, and each row's
// max m and sum l) is passed in explicitly; the rest is fixed for the tile.
// LIST: the instance walks the block mask's list of key tiles and adds the bias (MODS instances,
// and the `_blocks` ones, which keep the plain kernel's arithmetic).
template <class Tr, bool PINGPONG, bool MODS, bool LIST>
struct Mainloop {
    using T = typename Tr::T;
    static constexpr int D = Tr::D, BN = Tr::BN, BM = Tr::BM, NWG = Tr::NWG;
    static constexpr int STAGES = Tr::STAGES;
    static constexpr int NT = BN / 8, DT = D / 8;
    static constexpr bool FP8 = Tr::FP8;
    static constexpr int PK = Tr::PK;  // keys per P V step
    // Lazy rescaling (see softmax) and P kept in its registers until its P V GEMM has been
    // waited for (pin_regs), so that the softmax overlaps that GEMM. On an H100: +2-10% at
    // d 256, 1.00-1.04x at d 128 seq 8192 and within the noise at 2048, and 0-6% slower at d 64,
    // whose instances keep the eager form (there ptxas places P V's wait before the softmax).
    static constexpr bool LAZY = D >= 128;

    const FlashParams& p;
    const FwdSmem<Tr>& sm;
    const BlockGeom& g;   // the tile's geometry
    int lane, wg;         // lane in the warp, consumer warpgroup 0 .. NWG-1
    int diag_t;           // diagonal of this thread's first row (the other is 8 further)
    float slope_log2;     // ALiBi slope of the tile's head (MODS), base 2
    float unit;           // base-2 logit per unit of S (scale log2 e, or 1 under MODS)
    uint32_t q_base;      // this warpgroup's rows of the tile's Q buffer
    int b, h;             // the tile's batch and head (MODS: bias and block mask)

    // Issue S = Q K^T of the tile in stage s (not waited for).
    // Descriptors are built from one base each per call and offset by constants (the start
    // address is the low field, in 16-byte units, and never carries out of it: shared memory is
    // below 256 KB), so no per-step descriptor stays live across the key loop.
    __device__ __forceinline__ void issue_s(float* acc_s, int s) const {
        const uint64_t dq = make_desc(opaque(q_base), 16, 1024);
        const uint64_t dk = make_desc(saddr(sm.sK) + s * Tr::KV_BYTES, 16, 1024);
        // k steps of 32 bytes (16 elements of 2 bytes, 32 of e4m3), four to a 128-byte chunk.
#pragma unroll
        for (int kk = 0; kk < D * Tr::ES / 32; ++kk) {
            const uint64_t da = dq + (uint64_t)(((kk / 4) * BM * 128 + (kk % 4) * 32) >> 4);
            const uint64_t db = dk + (uint64_t)(((kk / 4) * BN * 128 + (kk % 4) * 32) >> 4);
            mma_ss<T, BN>(acc_s, da, db, kk > 0);
        }
    }
    // Issue O += P V of the tile in stage s, over its first nk PK-key steps (a varlen tail
    // tile's last step ends its keys: the V rows after it are not read, see the producer).
    // f16/bf16: V as stored, MN-major (64-column chunks BN * 128 bytes apart). FP8: V
    // transposed, K-major (D rows of 128-key chunks, D * 128 bytes apart), its keys permuted
    // within each 32 as pack_p places P's.
    __device__ __forceinline__ void issue_pv(float* acc_o, const uint32_t (*pa)[4], int s,
                                             int nk) const {
        if constexpr (FP8) {
            const uint64_t dv = make_desc(saddr(sm.sV) + s * Tr::KV_BYTES, 16, 1024);
#pragma unroll
            for (int kk = 0; kk < BN / PK; ++kk) {
                const uint64_t db = dv + (uint64_t)(((kk / 4) * D * 128 + (kk % 4) * 32) >> 4);
                if (kk < nk) mma_rs<T, D>(acc_o, pa[kk], db, 1);
            }
        } else {
            const uint64_t dv = make_desc(saddr(sm.sV) + s * Tr::KV_BYTES, BN * 128, 1024);
#pragma unroll
            for (int kk = 0; kk < BN / PK; ++kk) {
                const uint64_t db = dv + (uint64_t)((kk * 16 * 128) >> 4);
                if (kk < nk) mma_rs<T, D>(acc_o, pa[kk], db, 1);
            }
        }
    }
    // The masks of the tile at key k0 (this thread's first column `col`): hidden scores become
    // -inf.
    __device__ __forceinline__ void apply_mask(float* acc_s, int k0, int col) const {
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
    }
    // The bias in S's units: base-2 logits under MODS; plain arithmetic keeps S as raw dot
    // products that the softmax scales by `unit`, so the bias is divided by it.
    __device__ __forceinline__ float bias_unit() const { return MODS ? LOG2E_F : LOG2E_F / unit; }
    // LIST, a bias without a row dimension (key padding): staged per key tile in this
    // warpgroup's buffers (Traits::BIAS_BUFS), one key per thread, so that each thread reads its
    // columns from shared memory instead of global memory. The value of tile t for this thread:
    __device__ __forceinline__ bool key_bias() const { return LIST && p.bias && p.bias_q == 0; }
    __device__ __forceinline__ float fetch_key_bias(int t) const {
        const int wt = threadIdx.x % 128, c = t * BN + wt;
        if (wt >= BN || c >= g.sk) return 0.f;
        const int esize = sizeof(T) == 4 || p.bias_f32 ? 4 : 2;
        const char* row = static_cast<const char*>(p.bias) +
                          ((int64_t)b * p.bias_b + (int64_t)h * p.bias_h) * esize;
        return bias_elem<T>(p, row, (int64_t)c * p.bias_k) * bias_unit();
    }
    // Stores this thread's value into buffer `slot` once every thread of the warpgroup is done
    // with what it held (a single buffer waits for that; with two, the previous tile's barrier
    // already did), then waits until every value has landed.
    __device__ __forceinline__ void stage_key_bias(float v, int slot) const {
        constexpr int BUFS = Tr::BIAS_BUFS;
        float* buf = sm.sBias + (wg * BUFS + slot) * BN;
        if (BUFS == 1) named_sync(EPI_BAR + wg, 128);
        const int wt = threadIdx.x % 128;
        if (wt < BN) buf[wt] = v;
        named_sync(EPI_BAR + wg, 128);
    }
    // LIST: the bias where the tile's list entry asks for it (`biased`; from buffer `slot`
    // where it is staged), and the block mask where a hidden block cuts the tile (`partial`), on
    // S at keys k0.. (this thread's first column `col`) before the masks.
    __device__ __forceinline__ void extras(float* acc_s, int k0, int col, bool partial,
                                           bool biased, int slot) const {
        if constexpr (LIST) {
            const bool staged = key_bias() && biased;
            if (staged) {
                // This thread's two keys of each n8 tile are adjacent (col - k0 is even): one
                // 8-byte load each.
                const float* buf = sm.sBias + (wg * Tr::BIAS_BUFS + slot) * BN + (col - k0);
#pragma unroll
                for (int j = 0; j < NT; ++j) {
                    const float2 x = *reinterpret_cast<const float2*>(buf + 8 * j);
                    acc_s[4 * j] += x.x;
                    acc_s[4 * j + 1] += x.y;
                    acc_s[4 * j + 2] += x.x;
                    acc_s[4 * j + 3] += x.y;
                }
            }
            if ((p.bias && biased && !staged) || partial)
                tile_extras<T, 1, NT>(p, acc_s, b, h, diag_t - (g.sk - g.sq), col, k0, g.sq, g.sk,
                                      partial, bias_unit(), biased && !staged);
        }
    }
    // P = 2^(s unit - m_scaled) in place over row half `hf` of this thread's columns; returns
    // their sum.
    __device__ __forceinline__ float exps(float* acc_s, int hf, float m_scaled) const {
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
    }
    // LAZY, no score modifiers, every row's m finite: the exps of tile t against the current m,
    // with no max first. When each of this thread's row sums is below 2^7, no P reached 2^7, so
    // no score passed m by the margin of 2^8 and the exact softmax below would not move m
    // either: P and the sums (returned in `sums`) are what it computes, bit for bit (for scores
    // whose rounding stays far inside the margin, below ~2^22 in base-2 units; past that both
    // keep every P below 2^8 and are equally valid). Otherwise (false) acc_s holds exps that may
    // have overflowed, and S must be computed again.
    __device__ __forceinline__ bool softmax_spec(float* acc_s, int t, bool partial, bool biased,
                                                 int slot, const float* row_m,
                                                 float* sums) const {
        const int k0 = t * BN;
        extras(acc_s, k0, k0 + 2 * (lane % 4), partial, biased, slot);
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
    }
    // Masks, score modifiers, the bias and block mask (LIST, see `extras`) and the online
    // softmax of tile t in place (acc_s becomes P in f32);
    // alpha receives the factors O must be scaled by once the previous P V has completed, and
    // the result says whether any row of this warp needs it. Each row keeps a reference max m.
    // LAZY instances move m only when a tile's max exceeds it by more than 2^RESCALE_LOG2: exps
    // are taken against m, so P stays below 2^8 (f16 and bf16 hold it with the same relative
    // rounding as P <= 1), and l and O are rescaled only when m moves, which after a row's first
    // tiles is rare. The others move m to every new max and always rescale.
    __device__ __forceinline__ bool softmax(float* acc_s, int t, bool partial, bool biased,
                                            int slot, float* row_m, float* row_l,
                                            float* alpha) const {
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
        extras(acc_s, k0, col, partial, biased, slot);
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
    }
    // P (f32, the S accumulator layout) as wgmma A fragments in T, one per PK-key step.
    // f16/bf16: the accumulator layout of 16 keys is the A fragment's. e4m3: a thread's 8-bit A
    // fragment holds k columns 4t..4t+3 and 16+4t..16+4t+3 of its rows, its S accumulators keys
    // 2t, 2t+1, 8+2t, 9+2t (and 16 further): they go in that order, so A column c holds key
    // (c & 16) | 8 ((c >> 1) & 1) | 2 ((c >> 2) & 3) | (c & 1) of the step, which is where the
    // host's transposition puts V's rows (fp8_v_key in kernels/pack.cu).
    __device__ __forceinline__ void pack_p(const float* acc_s, uint32_t (*pa)[4]) const {
        if constexpr (FP8) {
#pragma unroll
            for (int kk = 0; kk < BN / PK; ++kk) {
                const float* x = acc_s + 16 * kk;
                pa[kk][0] = pack_e4m3x4(x[0], x[1], x[4], x[5]);
                pa[kk][1] = pack_e4m3x4(x[2], x[3], x[6], x[7]);
                pa[kk][2] = pack_e4m3x4(x[8], x[9], x[12], x[13]);
                pa[kk][3] = pack_e4m3x4(x[10], x[11], x[14], x[15]);
            }
        } else {
#pragma unroll
            for (int kk = 0; kk < BN / 16; ++kk) {
                pa[kk][0] = flash::Mma<T>::pack(acc_s[8 * kk + 0], acc_s[8 * kk + 1]);
                pa[kk][1] = flash::Mma<T>::pack(acc_s[8 * kk + 2], acc_s[8 * kk + 3]);
                pa[kk][2] = flash::Mma<T>::pack(acc_s[8 * kk + 4], acc_s[8 * kk + 5]);
                pa[kk][3] = flash::Mma<T>::pack(acc_s[8 * kk + 6], acc_s[8 * kk + 7]);
            }
        }
    }
    // Ping-pong: warpgroups take turns issuing their GEMMs (named barrier PP_BAR + w lets
    // warpgroup w go; it then lets w + 1 go), so one warpgroup's softmax runs under another's
    // GEMMs. Every warpgroup issues the same number of times (the tile range is the block's).
    __device__ __forceinline__ void turn_begin() const {
        if constexpr (PINGPONG) named_sync(PP_BAR + wg, 256);
    }
    __device__ __forceinline__ void turn_end() const {
        if constexpr (PINGPONG) named_arrive(PP_BAR + (wg + 1) % NWG, 256);
    }

    // Key tiles `kt` (common/extras.cuh) of the tile whose Q is in buffer qi: O (acc_o) and each row's
    // m and l (row_m, row_l) accumulate; kv_it counts the K/V stages used by the block so far.
    // Releases the Q buffer once every S of the tile is complete. The caller also owns the
    // scratch of S (acc_s), P (pa) and the rescale factors (alpha), declared in its tile loop:
    // a persistent block's consumers then keep them in the same registers from tile to tile
    // (declared here, they got new ones each tile, and ptxas a different allocation).
    __device__ __forceinline__ void run(float (&acc_o)[D / 2], float (&row_m)[2],
                                        float (&row_l)[2], float (&acc_s)[BN / 2],
                                        uint32_t (&pa)[BN / PK][4], float (&alpha)[2],
                                        const KeyTiles<LIST>& kt, int& kv_it, int qi) const {
        if (kt.end > kt.begin) {
            // A key-padding bias, on the tiles whose entries ask for it: tile 0's values staged,
            // the next tile's fetched into a register, where its load completes under this
            // tile's work. Staged tiles alternate between the buffers (`staged`: how many so
            // far), so a buffer is written only after every thread passed the barrier of the
            // staging after its last read.
            [[maybe_unused]] float kbias = 0.f;
            [[maybe_unused]] int staged = 0;
            auto stages_bias = [&](int q) { return key_bias() && kt.biased(kt.entry(q)); };
            if constexpr (LIST) {
                if (stages_bias(kt.begin)) {
                    stage_key_bias(fetch_key_bias(kt.tile(kt.entry(kt.begin))), 0);
                    staged = 1;
                }
                if (kt.begin + 1 < kt.end && stages_bias(kt.begin + 1))
                    kbias = fetch_key_bias(kt.tile(kt.entry(kt.begin + 1)));
            }
            // First tile: S, softmax, P.
            {
                const int s0 = kv_it % STAGES;
                mbar_wait(sm.full_k(s0), (uint32_t)((kv_it / STAGES) & 1));
                turn_begin();
                wg_fence();
                issue_s(acc_s, s0);
                wg_commit();
                turn_end();
                wg_wait<0>();
                reg_fence(acc_s);
                if (lane == 0) mbar_arrive(sm.empty_k(s0));
            }
            {
                const int e = kt.entry(kt.begin);
                softmax(acc_s, kt.tile(e), kt.partial(e), kt.biased(e), 0, row_m, row_l, alpha);
            }
            pack_p(acc_s, pa);
            // Steady state: S of tile t and P V of tile t - 1 in flight together; the softmax
            // of t runs while P V completes.
            for (int q = kt.begin + 1; q < kt.end; ++q) {
                const int e = kt.entry(q), t = kt.tile(e);
                const int it = kv_it + q - kt.begin, s = it % STAGES, sp = (it - 1) % STAGES;
                const uint32_t ph = (uint32_t)((it / STAGES) & 1);
                const uint32_t php = (uint32_t)(((it - 1) / STAGES) & 1);
                mbar_wait(sm.full_k(s), ph);
                mbar_wait(sm.full_v(sp), php);
                turn_begin();
                wg_fence();
                issue_s(acc_s, s);
                wg_commit();
                issue_pv(acc_o, pa, sp, BN / PK);
                wg_commit();
                turn_end();
                wg_wait<1>();
                reg_fence(acc_s);
                int slot = 0;
                if constexpr (LIST) {
                    if (stages_bias(q)) {
                        slot = Tr::BIAS_BUFS == 2 ? staged & 1 : 0;
                        stage_key_bias(kbias, slot);
                        ++staged;
                    }
                    if (q + 1 < kt.end && stages_bias(q + 1))
                        kbias = fetch_key_bias(kt.tile(kt.entry(q + 1)));
                }
                bool moved;
                if constexpr (LAZY && !MODS) {
                    // The row max is needed only when m may move (see softmax_spec): its 64 max
                    // instructions (half rate, and half again under the other warpgroup's
                    // wgmma) and its shuffles stay off the common path, and the exps start as
                    // soon as S has landed. When any warp of the warpgroup finds a sum too
                    // large, the warpgroup computes S again (its K stage is released only after
                    // this) and takes the exact path.
                    float sums[2];
                    const bool spec =
                        __all_sync(0xffffffff, row_m[0] != -INFINITY && row_m[1] != -INFINITY);
                    const bool ok =
                        spec && softmax_spec(acc_s, t, kt.partial(e), kt.biased(e), slot, row_m,
                                             sums);
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
                        moved = softmax(acc_s, t, kt.partial(e), kt.biased(e), slot, row_m,
                                        row_l, alpha);
                    }
                    if (lane == 0) mbar_arrive(sm.empty_k(s));
                } else {
                    if (lane == 0) mbar_arrive(sm.empty_k(s));
                    moved =
                        softmax(acc_s, t, kt.partial(e), kt.biased(e), slot, row_m, row_l, alpha);
                }
                if constexpr (LAZY) pin_regs(pa, g.sk < 0, saddr(sm.sO), row_l[0]);
                wg_wait<0>();
                reg_fence(acc_o);
                if (lane == 0) mbar_arrive(sm.empty_v(sp));
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
            if (lane == 0) mbar_arrive(sm.empty_q(qi));
            // Last tile's P V.
            {
                const int it = kv_it + kt.end - 1 - kt.begin, sp = it % STAGES;
                const int valid = g.sk - kt.tile(kt.entry(kt.end - 1)) * BN;
                const int nk = p.cu_k && valid < BN ? (valid + PK - 1) / PK : BN / PK;
                mbar_wait(sm.full_v(sp), (uint32_t)((it / STAGES) & 1));
                turn_begin();
                wg_fence();
                // Whole tiles (every dense call) take the unguarded issue.
                if (nk == BN / PK) issue_pv(acc_o, pa, sp, BN / PK);
                else issue_pv(acc_o, pa, sp, nk);
                wg_commit();
                turn_end();
                wg_wait<0>();
                reg_fence(acc_o);
                if (lane == 0) mbar_arrive(sm.empty_v(sp));
            }
        } else if (lane == 0) {
            mbar_arrive(sm.empty_q(qi));  // no key: Q was loaded but is not read
        }
        kv_it += kt.end - kt.begin;
    }
};

}  // namespace sm90
