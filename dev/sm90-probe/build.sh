#!/usr/bin/env bash
# Compiles the Hopper micro-benchmarks (pipes.cu, wgmma.cu, depth.cu) to sm_90a cubins in
# .gpu-probe/, with run.py beside them, ready to be carried to the GPU machine:
#   bash dev/sm90-probe/build.sh
#   (on the GPU machine)  cd .gpu-probe && python3 run.py pipes.cubin && python3 run.py wgmma.cubin
#                         && python3 run.py depth.cubin
set -euo pipefail
cd "$(dirname "$0")/../.."
if [ -z "${NVCC:-}" ] && ! command -v nvcc >/dev/null; then
    eval "$(bash scripts/setup-cuda.sh)"
fi
nvcc=${NVCC:-nvcc}
mkdir -p .gpu-probe
for f in pipes wgmma depth; do
    "$nvcc" --cubin -gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 -Ikernels \
        -o ".gpu-probe/$f.cubin" "dev/sm90-probe/$f.cu"
done
cp dev/sm90-probe/run.py .gpu-probe/
ls -l .gpu-probe
