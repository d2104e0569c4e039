// What a stream of wgmma in one warpgroup does to another warpgroup on the same SM. Block of
// 384 threads (three warpgroups, as the forward kernel's producer and two consumers, so each SM
// sub-partition holds one warp of each); warpgroup 0 takes role A, warpgroup 1 role B, and
// warpgroup 2 idles. Thread 0 of each warpgroup reports its cycles (%clock) for `iters`
// iterations. Roles:
//   1 SS: 8 x wgmma m64n128k16 (A and B from shared memory, 128-byte swizzle descriptors over
//     zeros), commit, wait until one group is pending: the S = Q K^T of one 64-row tile.
//   2 RS: the same with A from registers and B MN-major: the O += P V of one tile.
//   3 softmax mix: 64 x (max, fma, ex2, add) per thread in 8 independent chains.
//   4 shfl: 32 x (shfl.bfly, max).  5 fmnmx: 64 x max.  6 ffma: 64 x fma.
//   7 lds: 32 x ld.shared.  8 vote: 32 x vote.any.  9 mbarrier: 4 x try_wait on a completed
//     phase.  10 ldc: 32 x a uniform constant-bank load and an fma.
#include "sm90/wgmma.cuh"
#include "probe.cuh"

__constant__ float cbuf[64];
__device__ __forceinline__ float ex2(float x) {
    float y;
    asm volatile("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

template <int ROLE>
__device__ void role(unsigned* out, int iters, uint32_t base, unsigned char* sm) {
    if constexpr (ROLE == 1 || ROLE == 2) {
        float acc[64];
        for (int i = 0; i < 64; ++i) acc[i] = 0.f;
        uint32_t pa[8][4];
        for (int k = 0; k < 8; ++k)
            for (int e = 0; e < 4; ++e) pa[k][e] = 0x3f803f80u;
        const uint64_t dq = desc(base, 16, 1024), dk = desc(base + 32768, 16, 1024);
        const uint64_t dv = desc(base + 32768, 128 * 128, 1024);
        for (int it = 0; it < iters; ++it) {
            asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
            for (int kk = 0; kk < 8; ++kk) {
                const uint64_t off = ((kk / 4) * 128 * 128 + (kk % 4) * 32) >> 4;
                if constexpr (ROLE == 1) sm90::wgmma_ss_bf16_n128(acc, dq + off, dk + off, 1);
                else sm90::wgmma_rs_bf16_n128(acc, pa[kk], dv + ((kk * 16 * 128) >> 4), 1);
            }
            asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
            asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
        }
        asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
        float t = 0;
        for (int i = 0; i < 64; ++i) t += acc[i];
        keep(t, out);
    } else if constexpr (ROLE == 3 || ROLE == 5 || ROLE == 6) {
        float x[8], s[8], m[8];
        for (int i = 0; i < 8; ++i) {
            x[i] = 0.01f * (threadIdx.x + i);
            s[i] = 0.f;
            m[i] = -1e30f;
        }
        for (int it = 0; it < iters; ++it)
#pragma unroll
            for (int r = 0; r < 8; ++r)
#pragma unroll
                for (int i = 0; i < 8; ++i) {
                    if constexpr (ROLE == 3) {
                        m[i] = fmaxf(m[i], x[i]);
                        const float p = ex2(fmaf(x[i], 0.5f, -0.25f));
                        s[i] += p;
                        x[i] = p;
                    } else if constexpr (ROLE == 5) {
                        x[i] = fmaxf(x[i], x[(i + 3) % 8]);
                    } else {
                        x[i] = fmaf(x[i], x[(i + 3) % 8], 0.5f);
                    }
                }
        float t = 0;
        for (int i = 0; i < 8; ++i) t += x[i] + s[i] + m[i];
        keep(t, out);
    } else if constexpr (ROLE == 4) {
        float x[8];
        for (int i = 0; i < 8; ++i) x[i] = 0.01f * (threadIdx.x + i);
        for (int it = 0; it < iters; ++it)
#pragma unroll
            for (int r = 0; r < 4; ++r)
#pragma unroll
                for (int i = 0; i < 8; ++i)
                    x[i] = fmaxf(x[i], __shfl_xor_sync(0xffffffff, x[i], 1 + (r & 1)));
        float t = 0;
        for (int i = 0; i < 8; ++i) t += x[i];
        keep(t, out);
    } else if constexpr (ROLE == 7) {
        float a = 0;
        for (int it = 0; it < iters; ++it)
#pragma unroll
            for (int i = 0; i < 32; ++i)
                a += reinterpret_cast<volatile float*>(sm)[(threadIdx.x + i * 129 + it) & 4095];
        keep(a, out);
    } else if constexpr (ROLE == 8) {
        unsigned acc = 0;
        float x = 0.01f * threadIdx.x;
        for (int it = 0; it < iters; ++it)
#pragma unroll
            for (int i = 0; i < 32; ++i) {
                acc += __any_sync(0xffffffff, x > (float)(it + i)) ? 1u : 0u;
                x += 0.5f;
            }
        keep((float)acc, out);
    } else if constexpr (ROLE == 9) {
        const uint32_t bar = base + 65536 - 64;
        if (threadIdx.x % 128 == 0)
            asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(bar));
        asm volatile("bar.sync 1, 128;" ::: "memory");
        unsigned acc = 0;
        for (int it = 0; it < iters * 4; ++it) {
            unsigned done;
            asm volatile(
                "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                "selp.u32 %0, 1, 0, p;\n}\n"
                : "=r"(done)
                : "r"(bar), "r"(1u)
                : "memory");
            acc += done;
        }
        keep((float)acc, out);
    } else if constexpr (ROLE == 10) {
        float a = 0;
        for (int it = 0; it < iters; ++it)
#pragma unroll
            for (int i = 0; i < 32; ++i) a = fmaf(a, 0.5f, cbuf[(it + i) & 63]);
        keep(a, out);
    }
}

template <int A, int B>
__device__ void body(unsigned* out, int iters) {
    extern __shared__ __align__(1024) unsigned char sm[];
    for (int i = threadIdx.x; i < 65536 / 4; i += blockDim.x) reinterpret_cast<float*>(sm)[i] = 0.f;
    __syncthreads();
    const uint32_t base = (uint32_t)__cvta_generic_to_shared(sm);
    const int wg = threadIdx.x / 128;
    const unsigned t0 = clk();
    if (wg == 0) role<A>(out, iters, base, sm);
    else if (wg == 1) role<B>(out, iters, base, sm);
    const unsigned t1 = clk();
    if (threadIdx.x % 128 == 0) out[wg] = t1 - t0;
}
// probe_NAME: role of warpgroup 0, role of warpgroup 1 (run.py lists the same names).
#define E(NAME, A, B)                                                                 \
    extern "C" __global__ void __launch_bounds__(384, 1) probe_##NAME(unsigned* out, int iters) { \
        body<A, B>(out, iters);                                                       \
    }
E(ss, 1, 0) E(rs, 2, 0) E(ss_ss, 1, 1) E(rs_rs, 2, 2) E(ss_rs, 1, 2)
E(mix, 0, 3) E(ss_mix, 1, 3) E(rs_mix, 2, 3)
E(shfl, 0, 4) E(ss_shfl, 1, 4) E(rs_shfl, 2, 4)
E(fmnmx, 0, 5) E(ss_fmnmx, 1, 5) E(ffma, 0, 6) E(ss_ffma, 1, 6)
E(lds, 0, 7) E(ss_lds, 1, 7) E(vote, 0, 8) E(ss_vote, 1, 8)
E(mbar, 0, 9) E(ss_mbar, 1, 9) E(ldc, 0, 10) E(ss_ldc, 1, 10)
