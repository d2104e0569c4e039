// The sm_90a backward module (Hopper): the deterministic dK/dV and dQ kernels of sm90/bwd.cuh
// in f16 and bf16. The instances (head dims 64 and 128, tiles, stages, `_mods` twins for softcap
// / ALiBi) come from `BWD_SM90` in src/cuda/backward/instances.rs through the header build.rs
// generates, so the planner and the module cannot disagree. Compiled for compute_90a only and
// used on compute capability 9.0.
#include "sm90/bwd.cuh"
#include "bwd_instances.cuh"

FLASH_BWD_SM90_INSTANCES(bf16, __nv_bfloat16)
FLASH_BWD_SM90_INSTANCES(f16, __half)
