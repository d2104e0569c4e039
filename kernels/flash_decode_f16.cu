// The f16 decode module (compute_80 PTX, JIT-compiled for any GPU from sm_80 on): the split-KV
// decode (decode/partial.cuh: one pass over a K/V head's keys for all its packed query rows, the
// splits merged by the last block of each group or by the combine kernel, decode/combine.cuh).
// Its own module, apart from the prefill and backward kernels of flash_f16.cu: the driver
// compiles a module's PTX whole on first load, and the decode instances are most of it. The
// instances come from DECODE_INSTANCES in src/cuda/instances.rs through the header build.rs
// generates.
#include "decode/partial.cuh"
#include "instances.cuh"

FLASH_DECODE_INSTANCES(flash_decode_f16, __half)
FLASH_DECODE_COMBINE(flash_decode_combine_f16, __half)
