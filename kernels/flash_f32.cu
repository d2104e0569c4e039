// The f32 module: exact FFMA forward instances (forward/f32.cuh; tiles from
// src/cuda/instances.rs via the generated instances.cuh) and the row-wise fallback.
#include "backward/generic.cuh"
#include "forward/f32.cuh"
#include "forward/rowwise.cuh"
#include "instances.cuh"

FLASH_F32_INSTANCES
FLASH_ROWWISE_INSTANCE(flash_rowwise_f32, float)
FLASH_BWD_GENERIC_INSTANCES(flash_bwd_f32, float)
