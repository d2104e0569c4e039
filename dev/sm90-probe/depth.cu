// How many wgmma a warpgroup can issue before the issue itself waits for the tensor pipe. Block
// of 384 threads, as the forward kernel's. Warpgroup 0 issues N wgmma m64n128k16 (A and B from
// shared memory) back to back into one commit group and reads %clock after each issue returns;
// thread 0 writes those times, relative to the read before the first, to out[0..N). (With A
// from registers ptxas serialised this probe's wgmma for lack of registers, so only the
// shared-memory form is measured.) At full rate one such wgmma occupies the SM's tensor pipe for
// 64 cycles (m64n128k16 is 2 * 64 * 128 * 16 flops, at the H100's 4096 dense bf16 flops per SM
// and cycle): issues that return a few cycles apart were queued, issues 64 cycles apart waited
// for the pipe. Probes:
//   depth_ss: warpgroup 0 alone (the second of two rounds is reported).
//   depth_ss_busy: warpgroup 1 first issues 16 of its own (the other consumer's S and P V of a
//     step), then signals warpgroup 0 through shared memory, which issues its N at once.
// run.py prints the times and the gaps between consecutive issues.
#include "sm90/wgmma.cuh"
#include "probe.cuh"

constexpr int N = 24;

// N wgmma into `acc`, the clock after each issue into t; then waits for them.
__device__ __forceinline__ void issue(float (&acc)[64], unsigned (&t)[N + 1], uint32_t base) {
    const uint64_t dq = desc(base, 16, 1024), dk = desc(base + 32768, 16, 1024);
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
    t[0] = clk();
#pragma unroll
    for (int k = 0; k < N; ++k) {
        const int kk = k % 8;
        const uint64_t off = ((kk / 4) * 128 * 128 + (kk % 4) * 32) >> 4;
        sm90::wgmma_ss_bf16_n128(acc, dq + off, dk + off, 1);
        t[k + 1] = clk();
    }
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
}

template <bool BUSY>
__device__ void body(unsigned* out) {
    extern __shared__ __align__(1024) unsigned char sm[];
    for (int i = threadIdx.x; i < 65536 / 4; i += blockDim.x) reinterpret_cast<float*>(sm)[i] = 0.f;
    volatile unsigned* flag = reinterpret_cast<volatile unsigned*>(sm + 65536);
    if (threadIdx.x == 0) *flag = 0;
    __syncthreads();
    const uint32_t base = (uint32_t)__cvta_generic_to_shared(sm);
    const int wg = threadIdx.x / 128;
    float acc[64];
    for (int i = 0; i < 64; ++i) acc[i] = 0.f;
    unsigned t[N + 1];
    if (wg == 0) {
        if constexpr (BUSY) {
            while (*flag == 0) {
            }
            issue(acc, t, base);
        } else {
            for (int round = 0; round < 2; ++round) issue(acc, t, base);
        }
        if (threadIdx.x == 0)
            for (int k = 0; k < N; ++k) out[k] = t[k + 1] - t[0];
    } else if (wg == 1 && BUSY) {
        asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
        const uint64_t dq = desc(base, 16, 1024), dk = desc(base + 32768, 16, 1024);
#pragma unroll
        for (int k = 0; k < 16; ++k) {
            const int kk = k % 8;
            const uint64_t off = ((kk / 4) * 128 * 128 + (kk % 4) * 32) >> 4;
            sm90::wgmma_ss_bf16_n128(acc, dq + off, dk + off, 1);
        }
        asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
        if (threadIdx.x == 128) *flag = 1;
        asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
    }
    float s = 0;
    for (int i = 0; i < 64; ++i) s += acc[i];
    keep(s, out);
}

#define E(NAME, BUSY)                                                                        \
    extern "C" __global__ void __launch_bounds__(384, 1) probe_##NAME(unsigned* out, int) { \
        body<BUSY>(out);                                                                     \
    }
E(depth_ss, false) E(depth_ss_busy, true)
