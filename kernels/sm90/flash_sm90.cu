// The sm_90a module (Hopper): wgmma + TMA forward instances for f16, bf16 and e4m3 (sm90/fwd.cuh).
// Compiled by build.rs for compute_90a only and loaded on compute capability 9.0; every other
// case runs the portable compute_80 modules. The instances (head dim, warpgroups, key tile,
// stages, ping-pong, persistence, kind) come from `SM90_INSTANCES` in
// src/cuda/instances.rs through the generated instances.cuh, whose entries also check the
// shared memory the planner assumes.
#include "sm90/fwd.cuh"
#include "instances.cuh"

FLASH_SM90_INSTANCES(__nv_bfloat16, bf16)
FLASH_SM90_INSTANCES(__half, f16)

// FP8: e4m3 Q, K and V (V transposed by the launch), bf16 output (SM90_FP8_INSTANCES).
FLASH_SM90_FP8_INSTANCES
