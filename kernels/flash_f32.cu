// The f32 module (compute_80 PTX): the exact FFMA forward (forward/f32.cuh: 64-row tiles, 4 x
// (BC / 16) score micro-tiles per thread; tiles from src/cuda/instances.rs via the generated
// instances.cuh), the row-wise fallback (forward/rowwise.cuh) and the exact backward
// (backward/generic.cuh: one warp per key for dK/dV, one per query row for dQ).
#include "backward/generic.cuh"
#include "forward/f32.cuh"
#include "forward/rowwise.cuh"
#include "instances.cuh"

FLASH_F32_INSTANCES
FLASH_ROWWISE_INSTANCE(flash_rowwise_f32, float)
FLASH_BWD_GENERIC_INSTANCES(flash_bwd_f32, float)
