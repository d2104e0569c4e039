// The sm_90a forward's instance constants and shared memory: tile shape, buffers, barriers,
// register budgets, and the layout every role of the kernel addresses.
//
// Shared memory tiles hold D / 64 column chunks of [rows][64] elements (128 bytes a row), as the
// tensor copy engine writes them with its 128-byte swizzle; every chunk starts 1024-byte
// aligned. In order: Q (two buffers for persistent instances), STAGES K tiles, STAGES V tiles,
// the O staging tile (unless O is staged in Q), the consumers' key-bias buffers (LIST instances),
// then the mbarriers and the tile ring's slots.
#pragma once
#include "sm90/fwd_scheduler.cuh"
#include "sm90/ptx.cuh"

namespace sm90 {

// How the epilogue writes O (the launch's o_mode): by the warpgroup's threads; by the tensor copy
// engine through the O map (column, head, row, batch) of a dense output, whose rows past seq_q
// it clips; or through a map of packed rows (varlen, batch 1), for whole 64-row boxes only (a
// partial box would run into the next sequence's rows), the rest by the threads. Persistent
// instances only: a block that ends with its tile gains nothing from them (it must wait for the
// copy to read its shared memory before it exits). On an H100, persistent d 128 ran 1.02-1.07x
// at seq 512 and 0.99-1.03x at 2048 with them; the one-tile instances were no faster (d 64 at
// seq 512 0.96-0.98x, 176-key d 128 0.99-1.01x). The host's o_mode (src/cuda/) names the same
// three values.
constexpr int O_STORE_THREADS = 0;
constexpr int O_STORE_TMA = 1;
constexpr int O_STORE_TMA_PACKED = 2;

// T: the element of Q, K and V (f16, bf16, or e4m3 for FP8 instances); TO: the output's (T,
// or bf16 for e4m3).
template <typename T_, int D_, int NWG_, int BN_, int STAGES_, bool PERSIST_ = false,
          bool LIST_ = false, typename TO_ = T_>
struct Traits {
    using T = T_;
    using TO = TO_;
    static constexpr int D = D_, NWG = NWG_, BN = BN_, STAGES = STAGES_;
    static constexpr bool PERSIST = PERSIST_;
    // FP8 (e4m3) instances: one byte per element, k32 products, and V transposed in global
    // memory (8-bit wgmma reads both operands K-major): its tiles are D rows of BN keys.
    static constexpr bool FP8 = sizeof(T) == 1;
    static constexpr int ES = (int)sizeof(T);
    static constexpr int BM = 64 * NWG;
    static constexpr int THREADS = 128 * (NWG + 1);
    static constexpr int CW = 128 / ES;  // columns of one 128-byte swizzled row
    static constexpr int CH = D / CW;    // chunks of a Q or K row
    static constexpr int OCH = D / 64;   // 64-column chunks of an output row (TO is 2 bytes)
    // Keys per P V step (k16 for 2-byte elements, k32 for e4m3) and the A fragments of P.
    static constexpr int PK = 32 / ES;
    static constexpr int Q_BYTES = BM * D * ES;  // one Q tile
    // Persistent instances double-buffer Q: the producer loads the next tile's Q while the
    // consumers still run the key loop of this one.
    static constexpr int QB = PERSIST ? 2 : 1;
    static constexpr int KV_BYTES = BN * D * ES;  // one K (or V) tile
    // Output staging. d 256 has no room for a tile of its own (Q 64 KB + two stages of 80-key
    // K and V 160 KB), nor d 128 with 176-key tiles (Q 32 KB + K and V 176 KB): each warpgroup
    // stages its rows of O in its own rows of Q, which only its own S GEMMs read and which are
    // complete by then. The next tile's Q would overwrite them, so such instances are not
    // persistent.
    // (FP8 Q tiles are half the size of the output's.)
    static constexpr bool O_IN_Q = !FP8 && (D > 128 || BN > 128);
    static constexpr int O_BYTES = O_IN_Q ? 0 : BM * D * (int)sizeof(TO);
    // LIST instances: a bias without a row dimension (key padding) is staged per key tile in
    // shared memory, BN f32 per buffer and consumer warpgroup; two buffers (one tile's values
    // land while the previous tile's are read), one at d 256, where two do not fit.
    static constexpr int BIAS_BUFS = LIST_ ? (D > 128 ? 1 : 2) : 0;
    static constexpr int BIAS_BYTES = NWG * BIAS_BUFS * BN * 4;
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
        1024 + QB * Q_BYTES + 2 * STAGES * KV_BYTES + O_BYTES + BIAS_BYTES + BAR_BYTES;
    // setmaxnreg budgets (a multiple of 8; producer + NWG consumers within 512 per thread slot).
    // The persistent producer also computes each tile's geometry for the tile ring (TileSlot),
    // and needs more than the others' 40.
    static constexpr int PRODUCER_REGS = NWG == 2 ? (PERSIST ? 56 : 40) : 32;
    static constexpr int CONSUMER_REGS = NWG == 2 ? (PERSIST ? 224 : 232) : 160;
};

// The block's shared memory, carved from the dynamic allocation. The mbarriers, in
// Traits::BAR_BYTES: full and empty K and V stages, a varlen tail's V (see the producer), full
// and empty Q buffers (the block's n-th tile uses buffer n % QB), then the tile ring's.
template <class Tr>
struct FwdSmem {
    using T = typename Tr::T;
    using TO = typename Tr::TO;
    static constexpr int STAGES = Tr::STAGES, QB = Tr::QB;
    T* sQ;
    T* sK;
    T* sV;  // FP8: V transposed, D rows of BN keys per stage
    TO* sO;
    float* sBias;  // the consumers' key-bias buffers (Traits::BIAS_BYTES)
    uint64_t* bars;
    uint32_t bar_tail;  // a varlen tail's V lands here first
    TileRing<Tr::TILE_SLOTS, 4 * STAGES + 1 + 2 * QB> ring;

    __device__ __forceinline__ explicit FwdSmem(unsigned char* smem_raw) {
        // Aligned by an offset from smem_raw (not integer casts), so the compiler still knows
        // every derived pointer is shared memory (32-bit addresses, STS instead of generic
        // stores).
        unsigned char* base = smem_raw + ((1024 - (saddr(smem_raw) & 1023)) & 1023);
        constexpr int QS = QB * Tr::Q_BYTES;
        sQ = reinterpret_cast<T*>(base);
        sK = reinterpret_cast<T*>(base + QS);
        sV = reinterpret_cast<T*>(base + QS + STAGES * Tr::KV_BYTES);
        sO = reinterpret_cast<TO*>(base + QS + 2 * STAGES * Tr::KV_BYTES);
        sBias = reinterpret_cast<float*>(base + QS + 2 * STAGES * Tr::KV_BYTES + Tr::O_BYTES);
        bars = reinterpret_cast<uint64_t*>(base + QS + 2 * STAGES * Tr::KV_BYTES + Tr::O_BYTES +
                                           Tr::BIAS_BYTES);
        bar_tail = saddr(bars + 4 * STAGES);
        ring.bars = bars;
        ring.slots = reinterpret_cast<TileSlot*>(bars + 4 * STAGES + 1 + 2 * QB +
                                                 2 * Tr::TILE_SLOTS);
    }
    __device__ __forceinline__ uint32_t full_k(int s) const { return saddr(bars + s); }
    __device__ __forceinline__ uint32_t full_v(int s) const { return saddr(bars + STAGES + s); }
    __device__ __forceinline__ uint32_t empty_k(int s) const {
        return saddr(bars + 2 * STAGES + s);
    }
    __device__ __forceinline__ uint32_t empty_v(int s) const {
        return saddr(bars + 3 * STAGES + s);
    }
    __device__ __forceinline__ uint32_t full_q(int i) const {
        return saddr(bars + 4 * STAGES + 1 + i);
    }
    __device__ __forceinline__ uint32_t empty_q(int i) const {
        return saddr(bars + 4 * STAGES + 1 + QB + i);
    }

    // Thread 0, before the block's first __syncthreads: every mbarrier with its arrival count.
    // Q and the K/V stages are full on the copy's bytes plus one arrival, empty once every
    // consumer warp has arrived; a slot is empty once every consumer thread has.
    __device__ __forceinline__ void init_barriers() const {
        constexpr int NWG = Tr::NWG;
        for (int i = 0; i < QB; ++i) {
            mbar_init(full_q(i), 1);
            mbar_init(empty_q(i), 4 * NWG);
        }
        for (int i = 0; i < Tr::TILE_SLOTS; ++i) {
            mbar_init(ring.full(i), 1);
            mbar_init(ring.empty(i), 128 * NWG);
        }
        mbar_init(bar_tail, 1);
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(full_k(s), 1);
            mbar_init(full_v(s), 1);
            mbar_init(empty_k(s), 4 * NWG);
            mbar_init(empty_v(s), 4 * NWG);
        }
        mbar_init_fence();
        proxy_fence();
    }
};

}  // namespace sm90
