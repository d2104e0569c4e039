// The launch parameters of the backward kernels. The forward call's geometry, strides, masks and
// score modifiers are reused as they are (`f`, a whole FlashParams, so mask.cuh serves both
// passes); the backward adds its own operands after it. Its Rust twin is `BwdParams` in
// src/cuda/params.rs; build.rs generates bwd_params_layout.cuh, whose static_asserts
// fail the build if a field's offset or the size differs between the two.
#pragma once
#include "common/params.cuh"

struct BwdParams {
    FlashParams f;         // f.o: the forward output (read), f.lse: its saved natural-log lse
    const void* dout;      // dL/dO, contiguous like the output (f.o_seq, f.o_head)
    float* dsum;           // D = rowsum(dO * O), f32, laid out like the lse
    void* dq;              // contiguous like the output
    void* dk;              // contiguous (k_rows, kv_heads, d)
    void* dv;
    int64_t dkv_seq;       // row stride of dk / dv: kv_heads * d
    int64_t dkv_batch;     // dense: seq_k * kv_heads * d; varlen: 0 (rows from cu_k)
    float scale;           // softmax scale (dS is scaled by it once, at the end)
    int32_t kv_heads;
};

#include "bwd_params_layout.cuh"
