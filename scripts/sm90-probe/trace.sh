#!/usr/bin/env bash
# Builds gpu_bench with trace.patch (or, with the argument `tile`, tile-trace.patch) applied, in
# a temporary git worktree of HEAD sharing the cuda target dir, and leaves it stripped and
# xz-compressed in .gpu-trace/ with its reader: cycle stamps of the d 128 persistent forward
# kernel's key loop (trace.py, one phase per column), or of its tile boundaries (tile-trace.py).
#   scripts/sm90-probe/trace.sh [tile]
#   (on the GPU machine)  . scripts/device-env.sh && device_setup .gpu-trace &&
#     CANDLE_FLASH_TRACE=1 .gpu-trace/gpu_bench --shape 128:2048 --no-f32 > trace.txt &&
#     python3 .gpu-trace/trace.py trace.txt     (or: python3 .gpu-trace/tile-trace.py trace.txt 0)
set -euo pipefail
cd "$(dirname "$0")/../.."
root=$PWD
if [ -z "${NVCC:-}" ] && [ -z "${CUDA_HOME:-}" ] && ! command -v nvcc >/dev/null; then
    eval "$(bash scripts/setup-cuda.sh)"
fi
wt=$(mktemp -d)
trap 'git -C "$root" worktree remove --force "$wt"' EXIT
git worktree add --detach "$wt" HEAD >/dev/null
name=trace
if [ "${1:-}" = tile ]; then name=tile-trace; fi
git -C "$wt" apply "$root/scripts/sm90-probe/$name.patch"
(cd "$wt" && CARGO_TARGET_DIR="$root/target-cuda" \
    cargo build --release --features cuda,candle-nn/cuda --example gpu_bench)
mkdir -p .gpu-trace
cp "$root/target-cuda/release/examples/gpu_bench" .gpu-trace/gpu_bench
strip .gpu-trace/gpu_bench
xz -6 -T2 -f .gpu-trace/gpu_bench
cp scripts/sm90-probe/$name.py .gpu-trace/
# The worktree's build left its artifacts in the shared target dir, newer than this tree's
# sources: touch them so that the next build here (scripts/pack-gpu.sh) compiles them again
# instead of taking the probe's build as up to date (pack-gpu.sh also refuses a probe binary).
find src kernels -type f -exec touch {} +
ls -l .gpu-trace
