#!/usr/bin/env bash
# Builds the forward GPU test binary (tests/gpu.rs) and gpu_bench from this worktree and leaves
# them stripped and xz-compressed in $DEST (default .gpu-fwd/), with scripts/sdpa_bench.py,
# fwd-run.sh and device-env.sh, for a device run of the Hopper forward variants (bash $DEST/fwd-run.sh).
#   scripts/pack-fwd.sh [dest]
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${1:-.gpu-fwd}
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target-cuda}"
features=cuda,candle-nn/cuda
. scripts/test-bin.sh
fresh_kernels
gpu_bin=$(test_bin "--test gpu" gpu)
cargo build --release --features "$features" --example gpu_bench
mkdir -p "$DEST"
rm -rf "${DEST:?}"/*
cp "$gpu_bin" "$DEST/gpu_tests"
cp "$CARGO_TARGET_DIR/release/examples/gpu_bench" "$DEST/gpu_bench"
cp scripts/sdpa_bench.py scripts/fwd-run.sh scripts/device-env.sh "$DEST/"
bins="$DEST/gpu_tests $DEST/gpu_bench"
for b in $bins; do
    grep -q flash_fwd_sm90_bf16_d128_wg2p "$b" || { echo "$b lacks the sm_90a module (stale PTX?)" >&2; exit 1; }
done
strip $bins
xz -6 -T2 $bins
git rev-parse --short HEAD > "$DEST/commit"
git status --short >> "$DEST/commit"
ls -l "$DEST"
