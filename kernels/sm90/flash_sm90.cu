// The sm_90a module (Hopper): wgmma + TMA forward instances for f16 and bf16
// (sm90/fwd.cuh). Compiled by build.rs for compute_90a only and loaded on compute capability 9.0;
// every other case runs the portable compute_80 modules.
#include "sm90/fwd.cuh"

FLASH_SM90_INSTANCE(flash_fwd_sm90_bf16_d64, __nv_bfloat16, 64, 3, 128, 2)
FLASH_SM90_INSTANCE(flash_fwd_sm90_bf16_d128, __nv_bfloat16, 128, 2, 128, 2)
FLASH_SM90_INSTANCE(flash_fwd_sm90_f16_d64, __half, 64, 3, 128, 2)
FLASH_SM90_INSTANCE(flash_fwd_sm90_f16_d128, __half, 128, 2, 128, 2)

// Shared-memory bytes the Rust planner assumes (`Sm90Instance::smem` in src/cuda/plan.rs).
static_assert(sm90::Traits<__half, 64, 3, 128, 2>::SMEM == 115784, "plan.rs: d 64 instance");
static_assert(sm90::Traits<__half, 128, 2, 128, 2>::SMEM == 197704, "plan.rs: d 128 instance");
