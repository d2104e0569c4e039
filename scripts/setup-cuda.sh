#!/usr/bin/env bash
# Installs the CUDA 13.0 build toolkit this crate's `cuda` feature needs (nvcc, headers, cudart,
# cuBLAS, cuRAND, NVRTC) from NVIDIA's PyPI wheels into one folder, for machines with no system
# CUDA (no GPU is needed to build). It prints the environment to use; evaluate it in your shell:
#
#     eval "$(bash scripts/setup-cuda.sh)"
#     cargo build --release --features cuda
#
# With a system CUDA >= 12.x you do not need this script: put its nvcc on PATH or set CUDA_HOME.
#
# Install root: $CUDA_WHEELS_HOME, default ~/.cache/cuda-13.0-wheels (needs python3 with venv and
# about 1.5 GB). The first run downloads the wheels; later runs only print the environment.
#
# Pinned to CUDA 13.0: its PTX (ISA 9.0) loads on drivers >= 580, while newer nvcc releases emit
# PTX that those drivers refuse (CUDA_ERROR_UNSUPPORTED_PTX_VERSION). The driver library
# (libcuda.so) is not on PyPI: a link-time stub exporting the driver API's symbol names is
# generated from cuda.h into lib/stubs; at run time the GPU machine's real driver is used.
set -euo pipefail
root=${CUDA_WHEELS_HOME:-$HOME/.cache/cuda-13.0-wheels}
pins=(nvidia-cuda-nvcc==13.0.88 nvidia-cuda-crt==13.0.88 nvidia-nvvm==13.0.88
      nvidia-cuda-runtime==13.0.96 nvidia-cuda-cccl==13.0.85 nvidia-cuda-nvrtc==13.0.88
      nvidia-cublas==13.0.2.14 nvidia-curand==10.4.5.25)
if ! command -v python3 >/dev/null; then
  echo "setup-cuda.sh: python3 is required (or use a system CUDA >= 12.x)" >&2
  exit 1
fi
if [ ! -x "$root/venv/bin/python" ]; then
  echo "setup-cuda.sh: creating $root/venv" >&2
  mkdir -p "$root"
  python3 -m venv "$root/venv" >&2 || {
    echo "setup-cuda.sh: python3 -m venv failed (on Debian/Ubuntu: apt-get install python3-venv)" >&2
    exit 1
  }
fi
site=$("$root/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
cu=$site/nvidia/cu13
if [ ! -f "$root/.done" ] || ! "$cu/bin/nvcc" --version >/dev/null 2>&1; then
  echo "setup-cuda.sh: installing ${pins[*]} into $root (about 1.5 GB)" >&2
  "$root/venv/bin/python" -m pip install -q --disable-pip-version-check "${pins[@]}" >&2
  (cd "$cu/lib"
   for l in cublas cublasLt nvrtc cudart; do ln -sf "lib$l.so.13" "lib$l.so"; done
   ln -sf libcurand.so.10 libcurand.so
   mkdir -p stubs
   grep -ohE '\bcu[A-Z][A-Za-z0-9_]*\b' "$cu/include/cuda.h" | sort -u |
     awk '{print "void "$1"(void){}"}' > stubs/cuda_stub.c
   cc -shared -fPIC -o stubs/libcuda.so -Wl,-soname,libcuda.so.1 stubs/cuda_stub.c)
  touch "$root/.done"
  echo "setup-cuda.sh: done, $("$cu/bin/nvcc" --version | tail -1)" >&2
fi
cat <<ENV
export CUDA_HOME='$cu'
export NVCC='$cu/bin/nvcc'
export PATH='$cu/bin':"\$PATH"
export CUDARC_CUDA_VERSION=13000
export CUDA_COMPUTE_CAP=\${CUDA_COMPUTE_CAP:-90}
ENV
