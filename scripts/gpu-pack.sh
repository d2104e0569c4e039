#!/usr/bin/env bash
# Builds what scripts/gpu-run.sh runs on a GPU machine, here (no GPU needed), into .gpu/:
# stripped, xz-compressed binaries (the PTX text they embed compresses about tenfold), the
# PyTorch comparison scripts and the commit they come from. Carry .gpu/ to the GPU machine and run
# `bash scripts/gpu-run.sh` there.
#
#   scripts/gpu-pack.sh [tests] [bench]      (default: both)
#
# `tests`: the test targets with GPU tests (every property on the device, see
# tests/common/device.rs); `bench`: gpu_bench, decode_bench, variants_bench and train. The two sets
# together can exceed what one call to a GPU machine carries: pack and run them separately then.
# Uses the nvcc on PATH (or CUDA_HOME / NVCC), else installs one with scripts/setup-cuda.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(tests bench)
if [ -z "${NVCC:-}" ] && [ -z "${CUDA_HOME:-}" ] && ! command -v nvcc >/dev/null; then
    eval "$(bash scripts/setup-cuda.sh)"
fi
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target-cuda}"
# candle-nn/cuda: the benchmarks' naive baselines run candle-nn's softmax on the GPU. One feature
# set for every build, so they share every compiled crate.
features=cuda,candle-nn/cuda
mkdir -p .gpu
rm -rf .gpu/*
git rev-parse --short HEAD > .gpu/COMMIT
[ -n "$(git status --porcelain --untracked-files=no)" ] && sed -i 's/$/-dirty/' .gpu/COMMIT

# The executables cargo built for a command, from its JSON messages: "name path" lines.
built() {
    # Cargo's own messages go to the terminal; a failed build fails the pack (pipefail).
    cargo "$@" --release --features "$features" --message-format=json-diagnostic-rendered-ansi \
        | python3 -c '
import json, sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-message":
        print(m["message"]["rendered"], end="", file=sys.stderr)
    elif m.get("reason") == "compiler-artifact" and m.get("executable"):
        print(m["target"]["name"], m["executable"])'
}

bins=()
for part in "${parts[@]}"; do
    case "$part" in
        tests)
            # The test targets with GPU tests (tests/common/device.rs).
            targets=()
            for t in $(grep -l -E 'test_(device|cuda)!' tests/*.rs | xargs -n1 basename -s .rs); do
                targets+=(--test "$t")
            done
            list=$(built test "${targets[@]}" --no-run)
            while read -r name exe; do
                cp "$exe" ".gpu/test_$name"
                bins+=(".gpu/test_$name")
            done <<< "$list"
            ;;
        bench)
            list=$(built build --example gpu_bench --example decode_bench --example variants_bench \
                --example train)
            while read -r name exe; do
                cp "$exe" ".gpu/$name"
                bins+=(".gpu/$name")
            done <<< "$list"
            cp bench/torch_prefill.py bench/torch_decode.py bench/decode-grid.csv .gpu/
            ;;
        *) echo "unknown part $part (tests, bench)" >&2; exit 1 ;;
    esac
done
[ ${#bins[@]} -gt 0 ] || { echo "nothing was built" >&2; exit 1; }
# A binary without the decode kernels was built from stale PTX: refuse to ship it.
for b in "${bins[@]}"; do
    grep -q flash_decode_combine "$b" || { echo "$b lacks the CUDA kernels" >&2; exit 1; }
done
strip "${bins[@]}"
xz -6 -T2 "${bins[@]}"
ls -l .gpu
du -sh .gpu
