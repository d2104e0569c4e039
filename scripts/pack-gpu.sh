#!/usr/bin/env bash
# Builds the GPU test binary and the GPU benchmark here (no GPU needed) and leaves them stripped
# and xz-compressed in .gpu/ (the PTX text they embed compresses ~10x; gzip left them too big
# to carry together), ready to be carried to the device machine and run by scripts/gpu-run.sh.
# Uses the nvcc already on PATH (or CUDA_HOME/NVCC), else installs one with scripts/setup-cuda.sh.
#   scripts/pack-gpu.sh
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${NVCC:-}" ] && [ -z "${CUDA_HOME:-}" ] && ! command -v nvcc >/dev/null; then
    eval "$(bash scripts/setup-cuda.sh)"
fi
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target-cuda}"
# candle-nn/cuda: gpu_bench's naive f32 baseline runs candle-nn's softmax kernel on the GPU (the
# library's `cuda` feature leaves dev-dependencies alone). One feature set for both builds, so
# they share every compiled crate.
features=cuda,candle-nn/cuda
mkdir -p .gpu
rm -rf .gpu/*
. scripts/test-bin.sh
fresh_kernels
gpu_bin=$(test_bin "--test gpu" gpu)
paged_bin=$(test_bin "--test paged" paged)
bwd_bin=$(test_bin "--test gpu_backward" gpu_backward)
cargo build --release --features "$features" --example gpu_bench --example decode_bench --example train
cp "$gpu_bin" .gpu/gpu_tests
cp "$paged_bin" .gpu/paged_tests
cp "$bwd_bin" .gpu/gpu_backward_tests
cp "$CARGO_TARGET_DIR/release/examples/gpu_bench" .gpu/gpu_bench
cp "$CARGO_TARGET_DIR/release/examples/decode_bench" .gpu/decode_bench
cp "$CARGO_TARGET_DIR/release/examples/train" .gpu/train
cp scripts/sdpa_bench.py scripts/sdpa_decode.py .gpu/
bins=".gpu/gpu_tests .gpu/paged_tests .gpu/gpu_backward_tests .gpu/gpu_bench .gpu/decode_bench .gpu/train"
# A stale build script output once left a binary without the backward kernels: refuse to ship it.
for b in $bins; do
    grep -q flash_bwd "$b" || { echo "$b lacks the backward kernels (stale PTX?)" >&2; exit 1; }
    # A build of scripts/sm90-probe/trace.sh in the same target dir must not be shipped.
    if grep -q flash_sm90_trace_dump "$b"; then echo "$b is a probe build (trace.sh)" >&2; exit 1; fi
done
strip $bins
xz -6 -T2 $bins
ls -l .gpu
