// The sm_90a module (Hopper): wgmma + TMA forward instances for f16 and bf16
// (sm90/fwd.cuh). Compiled by build.rs for compute_90a only and loaded on compute capability 9.0;
// every other case runs the portable compute_80 modules. The table must match SM90_INSTANCES in
// src/cuda/plan.rs (names, warpgroups, tiles; the static_asserts below pin shared memory).
#include "sm90/fwd.cuh"

// (name, T, D, consumer warpgroups, BN, stages, ping-pong, persistent, softcap/ALiBi). The `p`
// instances are persistent (one block per SM taking tiles from the dynamic, longest-first
// scheduler of sm90/fwd.cuh); the three-warpgroup d 64 and the `_mods` instances are not
// (persistent, their registers spilled), nor is d 256 (its output is staged in Q's buffer,
// Traits::O_IN_Q), whose 80-key tiles in two stages follow FlashAttention-3's d 256 shape.
// `wg2n176`: FlashAttention-3's unmasked d 128 tile, 128 x 176 keys (O staged in Q's buffer
// too, so one block per tile). The persistent d 64 instance runs without ping-pong: its two
// warpgroups issue their GEMMs as they are ready (measured 0.99x to 1.05x the ping-pong version
// on an H100, within the noise: BENCHMARKS.md, 2026-11-23 ~04:04).
#define SM90_TABLE(T, TN)                                                                      \
    FLASH_SM90_INSTANCE(flash_fwd_sm90_##TN##_d64_wg3, T, 64, 3, 128, 2, true, false, false)   \
    FLASH_SM90_INSTANCE(flash_fwd_sm90_##TN##_d64_wg2p, T, 64, 2, 128, 2, false, true, false)  \
    FLASH_SM90_INSTANCE(flash_fwd_sm90_##TN##_d64_wg2_mods, T, 64, 2, 128, 2, true, false, true) \
    FLASH_SM90_INSTANCE(flash_fwd_sm90_##TN##_d128_wg2, T, 128, 2, 128, 2, true, false, false) \
    FLASH_SM90_INSTANCE(flash_fwd_sm90_##TN##_d128_wg2p, T, 128, 2, 128, 2, true, true, false) \
    FLASH_SM90_INSTANCE(flash_fwd_sm90_##TN##_d128_wg2n176, T, 128, 2, 176, 2, true, false, false) \
    FLASH_SM90_INSTANCE(flash_fwd_sm90_##TN##_d128_wg2_mods, T, 128, 2, 128, 2, true, false, true) \
    FLASH_SM90_INSTANCE(flash_fwd_sm90_##TN##_d256_wg2, T, 256, 2, 80, 2, true, false, false)  \
    FLASH_SM90_INSTANCE(flash_fwd_sm90_##TN##_d256_wg2_mods, T, 256, 2, 80, 2, true, false, true)

SM90_TABLE(__nv_bfloat16, bf16)
SM90_TABLE(__half, f16)

// Shared-memory bytes the Rust planner assumes (`Sm90Instance::smem` in src/cuda/plan.rs).
static_assert(sm90::Traits<__half, 64, 3, 128, 2>::SMEM == 115800, "plan.rs: d 64 instance");
static_assert(sm90::Traits<__half, 64, 2, 128, 2>::SMEM == 99416, "plan.rs: d 64 mods instance");
static_assert(sm90::Traits<__half, 64, 2, 128, 2, true>::SMEM == 116104, "plan.rs: d 64 persistent");
static_assert(sm90::Traits<__half, 128, 2, 128, 2>::SMEM == 197720, "plan.rs: d 128 instance");
static_assert(sm90::Traits<__half, 128, 2, 128, 2, true>::SMEM == 230792, "plan.rs: d 128 persistent");
static_assert(sm90::Traits<__half, 128, 2, 176, 2>::SMEM == 214104, "plan.rs: d 128 176-key instance");
static_assert(sm90::Traits<__half, 256, 2, 80, 2>::SMEM == 230488, "plan.rs: d 256 instance");
