// PTX wrappers of the Hopper (sm_90a) kernels: mbarriers, TMA bulk tensor copies and their
// fences, setmaxnreg, named barriers, and wgmma (descriptors, fences, waits, and the typed
// m64nNk16 products over the generated instructions of sm90/wgmma.cuh). Also the few compiler
// barriers those kernels need to keep ptxas from moving registers across asynchronous products.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <stdint.h>

#include "sm90/wgmma.cuh"

// The driver's CUtensorMap: 128 opaque bytes, 64-byte aligned.
struct alignas(64) TmaMap {
    unsigned long long opaque[16];
};

namespace sm90 {

__device__ __forceinline__ uint32_t saddr(const void* p) {
    return (uint32_t)__cvta_generic_to_shared(p);
}

// ---- mbarriers ------------------------------------------------------------------------------

__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count));
}
// Makes the barrier inits of this thread visible to the other threads and the copy engine
// (followed by proxy_fence and a __syncthreads in the kernels).
__device__ __forceinline__ void mbar_init_fence() {
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
                 : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
    uint32_t done;
    do {
        asm volatile(
            "{\n.reg .pred p;\n"
            "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
            "selp.u32 %0, 1, 0, p;\n}\n"
            : "=r"(done)
            : "r"(bar), "r"(parity)
            : "memory");
    } while (!done);
}

// ---- TMA: bulk tensor copies ----------------------------------------------------------------

// One box of a 4-D tensor map into shared memory, completing on `bar`.
__device__ __forceinline__ void tma_load_4d(uint32_t dst, const TmaMap* map, uint32_t bar, int c0,
                                            int c1, int c2, int c3) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes "
        "[%0], [%1, {%2, %3, %4, %5}], [%6];\n" ::"r"(dst),
        "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar)
        : "memory");
}
// One box of a 4-D tensor map from shared memory to global memory, in the bulk async group
// (out-of-tensor parts of the box are not written).
__device__ __forceinline__ void tma_store_4d(const TmaMap* map, uint32_t src, int c0, int c1,
                                             int c2, int c3) {
    asm volatile(
        "cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%1, %2, %3, %4}], [%5];\n" ::"l"(
            reinterpret_cast<uint64_t>(map)),
        "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(src)
        : "memory");
}
__device__ __forceinline__ void bulk_commit() {
    asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
}
// This thread's bulk stores have finished reading their shared memory.
__device__ __forceinline__ void bulk_wait_read() {
    asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
}
// This thread's shared-memory writes (and barrier inits) become visible to the tensor copy
// engine.
__device__ __forceinline__ void proxy_fence() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
__device__ __forceinline__ void prefetch_map(const TmaMap* map) {
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

// ---- warp specialisation: register budgets and named barriers -------------------------------

// The producer warpgroup gives registers back, the consumers take them (a multiple of 8).
template <int REGS>
__device__ __forceinline__ void setmaxnreg_dec() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(REGS));
}
template <int REGS>
__device__ __forceinline__ void setmaxnreg_inc() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(REGS));
}

// Named barriers (0 is __syncthreads): EPI_BAR + w, warpgroup w's epilogue and the vote of the
// forward's speculative softmax (named_any; 128 threads); PP_BAR + w, the ping-pong turn of
// warpgroup w (256 threads). The ranges must not overlap: a barrier used with two thread counts
// is an illegal instruction.
constexpr int EPI_BAR = 1;
constexpr int PP_BAR = 4;

__device__ __forceinline__ void named_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// Whether `v` holds for any of the `threads` threads meeting at named barrier `id`.
__device__ __forceinline__ bool named_any(int id, int threads, bool v) {
    uint32_t r;
    asm volatile(
        "{\n.reg .pred p, q;\nsetp.ne.u32 p, %1, 0;\n"
        "bar.red.or.pred q, %2, %3, p;\nselp.u32 %0, 1, 0, q;\n}\n"
        : "=r"(r)
        : "r"((uint32_t)v), "r"(id), "r"(threads)
        : "memory");
    return r != 0;
}
__device__ __forceinline__ void named_arrive(int id, int threads) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// ---- compiler barriers ----------------------------------------------------------------------

template <int N>
__device__ __forceinline__ void reg_fence(float (&r)[N]) {
    // Keeps the compiler from moving accesses of the accumulators across wgmma waits.
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
// Keeps P's registers in use until after the softmax: a store that never executes (`off` is
// false at run time, which ptxas cannot know) reads them at an address that depends on `after`
// (a softmax result). Otherwise ptxas gives the softmax's temporaries the registers of the P
// an in-flight P V wgmma still reads, and must place that GEMM's wait before the softmax.
template <int N>
__device__ __forceinline__ void pin_regs(const uint32_t (&r)[N][4], bool off, uint32_t addr,
                                         float after) {
    const uint32_t a = addr + ((__float_as_uint(after) >> 31) << 4);
#pragma unroll
    for (int i = 0; i < N; ++i)
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %5, 0;\n"
            "@p st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n}\n" ::"r"(a),
            "r"(r[i][0]), "r"(r[i][1]), "r"(r[i][2]), "r"(r[i][3]), "r"((uint32_t)off)
            : "memory");
}
// The value through an opaque move: recomputed where used instead of hoisted into registers.
__device__ __forceinline__ uint32_t opaque(uint32_t x) {
    uint32_t y;
    asm volatile("mov.u32 %0, %1;\n" : "=r"(y) : "r"(x));
    return y;
}

// ---- wgmma ----------------------------------------------------------------------------------

__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() {
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void wg_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

// Shared-memory matrix descriptor, 128-byte swizzle. K-major operands (Q, K): rows of 128 bytes,
// 8-row groups 1024 bytes apart (SBO), LBO unused. MN-major operands (V): LBO = distance between
// 64-column chunks, SBO = 1024 (8 rows).
__device__ __forceinline__ uint64_t make_desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
    return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)((lbo >> 4) & 0x3FFF) << 16) |
           ((uint64_t)((sbo >> 4) & 0x3FFF) << 32) | (1ull << 62);
}

template <typename T>
struct IsBf16 {
    static constexpr bool value = false;
};
template <>
struct IsBf16<__nv_bfloat16> {
    static constexpr bool value = true;
};

// e4m3 operands (FP8): one byte per element, k32 steps, both operands K-major.
template <typename T>
struct IsE4m3 {
    static constexpr bool value = false;
};
template <>
struct IsE4m3<__nv_fp8_e4m3> {
    static constexpr bool value = true;
};

// Four f32 values as e4m3 bytes (saturating, round to nearest even), `a` in the lowest byte:
// the k order of an 8-bit wgmma A fragment register.
__device__ __forceinline__ uint32_t pack_e4m3x4(float a, float b, float c, float d) {
    uint32_t r;
    // cvt's first source lands in the upper byte of the pair.
    asm("{\n.reg .b16 l, h;\n"
        "cvt.rn.satfinite.e4m3x2.f32 l, %2, %1;\n"
        "cvt.rn.satfinite.e4m3x2.f32 h, %4, %3;\n"
        "mov.b32 %0, {l, h};\n"
        "}\n"
        : "=r"(r)
        : "f"(a), "f"(b), "f"(c), "f"(d));
    return r;
}

// d (m64nN f32) += or = A B, A and B from shared-memory descriptors (both K-major).
template <typename T, int N>
__device__ __forceinline__ void mma_ss(float* d, uint64_t a, uint64_t b, int scale_d) {
    if constexpr (IsE4m3<T>::value) {
        static_assert(N == 128, "e4m3 S tiles of 128 keys");
        wgmma_ss_e4m3_n128(d, a, b, scale_d);
    } else if constexpr (IsBf16<T>::value) {
        if constexpr (N == 64) wgmma_ss_bf16_n64(d, a, b, scale_d);
        else if constexpr (N == 80) wgmma_ss_bf16_n80(d, a, b, scale_d);
        else if constexpr (N == 176) wgmma_ss_bf16_n176(d, a, b, scale_d);
        else wgmma_ss_bf16_n128(d, a, b, scale_d);
    } else {
        if constexpr (N == 64) wgmma_ss_f16_n64(d, a, b, scale_d);
        else if constexpr (N == 80) wgmma_ss_f16_n80(d, a, b, scale_d);
        else if constexpr (N == 176) wgmma_ss_f16_n176(d, a, b, scale_d);
        else wgmma_ss_f16_n128(d, a, b, scale_d);
    }
}
// d (m64nN f32) += or = A B, A from registers (wgmma A fragments), B in shared memory:
// MN-major for f16/bf16, K-major for e4m3.
template <typename T, int N>
__device__ __forceinline__ void mma_rs(float* d, const uint32_t* a, uint64_t b, int scale_d) {
    if constexpr (IsE4m3<T>::value) {
        static_assert(N == 128 || N == 256, "e4m3 heads of 128 or 256");
        if constexpr (N == 128) wgmma_rs_e4m3_n128(d, a, b, scale_d);
        else wgmma_rs_e4m3_n256(d, a, b, scale_d);
    } else if constexpr (IsBf16<T>::value) {
        if constexpr (N == 64) wgmma_rs_bf16_n64(d, a, b, scale_d);
        else if constexpr (N == 128) wgmma_rs_bf16_n128(d, a, b, scale_d);
        else wgmma_rs_bf16_n256(d, a, b, scale_d);
    } else {
        if constexpr (N == 64) wgmma_rs_f16_n64(d, a, b, scale_d);
        else if constexpr (N == 128) wgmma_rs_f16_n128(d, a, b, scale_d);
        else wgmma_rs_f16_n256(d, a, b, scale_d);
    }
}

}  // namespace sm90
