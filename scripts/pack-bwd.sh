#!/usr/bin/env bash
# Builds the backward GPU test binary, gpu_bench and the library's unit tests from this
# worktree and leaves them stripped and xz-compressed in $DEST (default .gpu-bwd/), with
# scripts/sdpa_bench.py, bwd-run.sh, bwd_table.py and device-env.sh, for a device run
# (bash $DEST/bwd-run.sh).
#   scripts/pack-bwd.sh [dest]
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${1:-.gpu-bwd}
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target-cuda}"
features=cuda,candle-nn/cuda
. scripts/test-bin.sh
fresh_kernels
bwd_bin=$(test_bin "--test gpu_backward" gpu_backward)
lib_bin=$(test_bin "--lib" candle_flash)
cargo build --release --features "$features" --example gpu_bench
mkdir -p "$DEST"
rm -rf "${DEST:?}"/*
cp "$bwd_bin" "$DEST/gpu_backward_tests"
cp "$lib_bin" "$DEST/lib_tests"
cp "$CARGO_TARGET_DIR/release/examples/gpu_bench" "$DEST/gpu_bench"
cp scripts/sdpa_bench.py scripts/bwd-run.sh scripts/bwd_table.py scripts/device-env.sh "$DEST/"
bins="$DEST/gpu_backward_tests $DEST/lib_tests $DEST/gpu_bench"
for b in $bins; do
    grep -q flash_bwd "$b" || { echo "$b lacks the backward kernels (stale PTX?)" >&2; exit 1; }
done
strip $bins
xz -6 -T2 $bins
ls -l "$DEST"
