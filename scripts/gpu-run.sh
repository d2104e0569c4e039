#!/usr/bin/env bash
# Runs on a GPU machine what scripts/gpu-pack.sh packed into .gpu/ (carry .gpu/ there):
#
#   bash scripts/gpu-run.sh [tests] [sanitizer] [prefill] [backward] [decode] [variants] [train]
#
# (default: every part the packed binaries allow). Every part logs to $OUT (or /tmp/gpu-run) and
# the benchmarks write their CSV there, PyTorch's rows appended to candle-flash's from the same
# command: copy gpu-prefill.csv, gpu-backward.csv, gpu-decode.csv and gpu-variants.csv into
# bench/results/ and run `python3 bench/report.py`.
#   tests      every test target's `::cuda` tests (each property on the GPU, every kernel
#              configuration of its suite)
#   sanitizer  compute-sanitizer memcheck, racecheck, synccheck and initcheck on the small-shape
#              subsets (the `sanitizer_` tests under CANDLE_FLASH_TEST_SMALL=1, and for memcheck
#              the paged / KV-cache tests; initcheck with thread stores, since it does not count
#              the tensor copy engine's writes)
#   prefill    gpu_bench beside bench/torch_prefill.py (PyTorch SDPA, flash and cuDNN)
#   backward   gpu_bench --backward beside bench/torch_prefill.py --backward
#   decode     decode_bench over the shapes of bench/decode-grid.csv (every head configuration,
#              cache length, batch and seq_q axis of the sweep) beside bench/torch_decode.py on
#              the same shapes (DECODE_ARGS replaces the shape arguments, e.g. --quick or --sweep)
#   variants   variants_bench: each attention variant (sinks) beside the plain forward
#   train      examples/train on the GPU (naive and flash in lockstep)
# Exits non-zero when a test, a sanitizer run or a benchmark fails. TEST_TIMEOUT (seconds, default
# 600) bounds each test binary's run.
set -uo pipefail
cd "$(dirname "$0")/.."
G=.gpu
LOG=${OUT:-/tmp/gpu-run}
mkdir -p "$LOG"
# The CUDA libraries of the installed Python wheels (nvidia/cu13/lib), and the packed binaries
# unpacked with Python's lzma (the machine has no xz).
LD_LIBRARY_PATH=$(python3 -c 'import nvidia,os;print(os.path.join(list(nvidia.__path__)[0],"cu13","lib"))'):${LD_LIBRARY_PATH:-}
export LD_LIBRARY_PATH
# The driver's JIT of the PTX modules (about a minute each on a fresh machine) is kept in its
# compute cache, so each module compiles once for all the binaries of a run (and of later runs
# on a machine still held), given room for every module's code.
export CUDA_CACHE_MAXSIZE=${CUDA_CACHE_MAXSIZE:-4294967296}
for f in "$G"/*.xz; do
    [ -e "$f" ] || continue
    python3 -c 'import lzma,shutil,sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' "$f" "${f%.xz}" && rm -f "$f"
    chmod +x "${f%.xz}"
done
export BENCH_COMMIT=$(cat "$G/COMMIT" 2>/dev/null || echo unknown)
parts=("$@")
if [ ${#parts[@]} -eq 0 ]; then
    ls "$G"/test_* >/dev/null 2>&1 && parts+=(tests sanitizer)
    [ -x "$G/gpu_bench" ] && parts+=(prefill backward decode variants train)
fi
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv,noheader
status=0
step() { echo; echo "== $*"; }
# Runs a command, keeps its log, prints the lines that matter, records a failure.
run() {
    local name=$1; shift
    "$@" > "$LOG/$name.log" 2>&1
    local rc=$?
    grep -E "^test result|FAILED|panicked|ERROR SUMMARY|RACECHECK SUMMARY|^error|Error:" "$LOG/$name.log" | head -20
    [ $rc = 0 ] || { echo "   ^ $name exited with $rc"; status=1; }
}
for part in "${parts[@]}"; do
    case "$part" in
        tests)
            for t in "$G"/test_*; do
                step "tests: ${t#$G/test_} (the ::cuda tests)"
                run "tests-${t#$G/test_}" timeout "${TEST_TIMEOUT:-600}" "$t" --test-threads=1 ::cuda
            done ;;
        sanitizer)
            for tool in memcheck racecheck synccheck initcheck; do
                for t in "$G"/test_*; do
                    name=${t#$G/test_}
                    filters=(sanitizer_)
                    [ $tool = memcheck ] && [ "$name" = paged ] && filters=(paged_ kvcache)
                    # Only binaries that hold such tests (a sanitizer start costs seconds).
                    "$t" --list 2>/dev/null | grep -q -e "${filters[0]}.*::cuda" || continue
                    stores=""; [ $tool = initcheck ] && stores=1
                    step "compute-sanitizer --tool $tool: $name ${filters[*]} (small shapes)"
                    run "sanitizer-$tool-$name" env CANDLE_FLASH_TEST_SMALL=1 \
                        CANDLE_FLASH_TEST_THREAD_STORES=$stores timeout 600 \
                        compute-sanitizer --tool $tool --error-exitcode 9 \
                        "$t" --test-threads=1 "${filters[@]}" --skip ::cpu
                done
            done ;;
        prefill)
            step "prefill: candle-flash, then PyTorch SDPA"
            run prefill "$G/gpu_bench" --csv "$LOG/gpu-prefill.csv"
            run prefill-torch python3 "$G/torch_prefill.py" --append --csv "$LOG/gpu-prefill.csv"
            tail -40 "$LOG/prefill.log" ;;
        backward)
            step "backward: candle-flash, then PyTorch SDPA"
            run backward "$G/gpu_bench" --backward --csv "$LOG/gpu-backward.csv"
            run backward-torch python3 "$G/torch_prefill.py" --backward --append --csv "$LOG/gpu-backward.csv"
            tail -20 "$LOG/backward.log" ;;
        decode)
            step "decode: candle-flash sweep, then PyTorch SDPA on the same shapes"
            # shellcheck disable=SC2086  # DECODE_ARGS is a list of words
            run decode "$G/decode_bench" --device cuda ${DECODE_ARGS:---shapes-csv $G/decode-grid.csv} \
                --out "$LOG/gpu-decode.csv"
            run decode-torch python3 "$G/torch_decode.py" "$LOG/gpu-decode.csv"
            tail -5 "$LOG/decode.log" ;;
        variants)
            step "variants: each variant beside the plain forward"
            run variants "$G/variants_bench" --csv "$LOG/gpu-variants.csv"
            tail -20 "$LOG/variants.log" ;;
        train)
            step "train: naive and flash attention in lockstep on the GPU"
            run train "$G/train" --device cuda
            tail -8 "$LOG/train.log" ;;
        *) echo "unknown part $part"; status=1 ;;
    esac
done
echo
[ $status = 0 ] && echo "gpu-run: all parts passed" || echo "gpu-run: FAILURES (logs in $LOG)"
exit $status
