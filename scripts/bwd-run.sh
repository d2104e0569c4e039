#!/usr/bin/env bash
# What runs on the GPU machine for the backward work (carry the folder made by
# scripts/pack-bwd.sh): the backward GPU tests (default mode, then CANDLE_FLASH_BWD_DETERMINISTIC=0
# for the whole binary; on a Hopper GPU also with CANDLE_FLASH_PORTABLE=1, the sm_80 kernels, and
# with CANDLE_FLASH_BWD_SM90_VARIANT=v for each v of $BWD_VARIANT, space-separated), compute-sanitizer on the
# backward shapes, the library's unit tests, planted-bug binaries (gpu_backward_bug*: each must
# fail), gpu_bench --backward (default, atomic mode, on Hopper also the portable kernels and each
# $BWD_VARIANT) beside scripts/sdpa_bench.py --backward, with a side-by-side table, and
# any gpu_bench variants placed as var_* (both modes, --quick). Logs go to $OUT.
#   [BWD_VARIANT="a,b c"] bash DIR/bwd-run.sh [--quick] [--no-tests] [--no-sanitizer]
#                                         [--all-sanitizers] [--no-bench] [--no-atomic]
# (memcheck and racecheck by default; --all-sanitizers adds synccheck and initcheck)
set -uo pipefail
D=$(cd "$(dirname "$0")" && pwd)
QUICK=""; TESTS=1; SAN=1; BENCH=1; ATOMIC=1; TOOLS="memcheck racecheck"
for a in "$@"; do
    case "$a" in
        --no-atomic) ATOMIC=0 ;;
        --quick) QUICK=--quick ;;
        --no-tests) TESTS=0 ;;
        --no-sanitizer) SAN=0 ;;
        --no-bench) BENCH=0 ;;
        --all-sanitizers) TOOLS="memcheck racecheck synccheck initcheck" ;;
    esac
done
LOG=${OUT:-/tmp}
. "$D/device-env.sh"
device_setup "$D"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv,noheader
HOPPER=0
[ "$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1)" = "9.0" ] && HOPPER=1
VARIANT=${BWD_VARIANT:-}
status=0
if [ $TESTS = 1 ]; then
    echo "== library unit tests"
    timeout 120 "$D/lib_tests" --test-threads=2 2>&1 | tee "$LOG/lib-tests.log" | grep -E "test result|panicked|FAILED" | head
    echo "== backward tests, default (deterministic) mode"
    timeout 300 "$D/gpu_backward_tests" --test-threads=1 2>&1 | tee "$LOG/backward-tests.log" | grep -E "^test |test result|panicked" || true
    [ "${PIPESTATUS[0]}" = 0 ] || status=1
    if [ $ATOMIC = 1 ]; then
        echo "== backward tests, CANDLE_FLASH_BWD_DETERMINISTIC=0 for every test"
        CANDLE_FLASH_BWD_DETERMINISTIC=0 timeout 300 "$D/gpu_backward_tests" --test-threads=1 --skip deterministic_by_default 2>&1 \
            | tee "$LOG/backward-tests-atomic.log" | grep -E "^test |test result|panicked" || true
        [ "${PIPESTATUS[0]}" = 0 ] || status=1
    fi
    if [ $HOPPER = 1 ]; then
        echo "== backward tests with CANDLE_FLASH_PORTABLE=1 (the sm_80 kernels on this Hopper GPU)"
        CANDLE_FLASH_PORTABLE=1 timeout 300 "$D/gpu_backward_tests" --test-threads=1 2>&1 \
            | tee "$LOG/backward-tests-portable.log" | grep -E "^test |test result|panicked" || true
        [ "${PIPESTATUS[0]}" = 0 ] || status=1
        for v in $VARIANT; do
            echo "== backward tests with CANDLE_FLASH_BWD_SM90_VARIANT=$v"
            CANDLE_FLASH_BWD_SM90_VARIANT=$v timeout 300 "$D/gpu_backward_tests" --test-threads=1 2>&1 \
                | tee "$LOG/backward-tests-variant-$v.log" | grep -E "^test |test result|panicked" || true
            [ "${PIPESTATUS[0]}" = 0 ] || status=1
        done
    fi
    for b in "$D"/gpu_backward_bug*; do
        [ -x "$b" ] || continue
        echo "== planted bug $(basename "$b") (must FAIL)"
        timeout 300 "$b" --test-threads=1 --skip deterministic_by_default --skip sanitizer_ 2>&1 \
            | tee "$LOG/$(basename "$b").log" | grep -E "^test |test result" || true
    done
fi
if [ $SAN = 1 ]; then
    for tool in $TOOLS; do
        echo "== compute-sanitizer --tool $tool on the backward kernels (sanitizer_shapes)"
        timeout 300 compute-sanitizer --tool $tool --error-exitcode 9 \
            "$D/gpu_backward_tests" --test-threads=1 sanitizer_ 2>&1 \
            | tee "$LOG/sanitizer-backward-$tool.log" | grep -E "ERROR SUMMARY|RACECHECK SUMMARY|test result" | head -5
        [ "${PIPESTATUS[0]}" = 0 ] || status=1
    done
fi
if [ $BENCH = 1 ]; then
    echo "== backward: candle-flash (default deterministic, then CANDLE_FLASH_BWD_DETERMINISTIC=0)"
    "$D/gpu_bench" --backward $QUICK 2>&1 | tee "$LOG/bench-backward.log" | grep -v '^RESULT'
    : > "$LOG/bench-backward-atomic.log"
    if [ $ATOMIC = 1 ]; then
        CANDLE_FLASH_BWD_DETERMINISTIC=0 "$D/gpu_bench" --backward --no-autograd $QUICK 2>&1 \
            | sed 's/^RESULT_BWD candle /RESULT_BWD candle_atomic /' | tee "$LOG/bench-backward-atomic.log" | grep -v '^RESULT'
    fi
    if [ $HOPPER = 1 ]; then
        echo "== backward: candle-flash with CANDLE_FLASH_PORTABLE=1 (sm_80 kernels)"
        CANDLE_FLASH_PORTABLE=1 "$D/gpu_bench" --backward --no-autograd $QUICK 2>&1 \
            | sed 's/^RESULT_BWD candle /RESULT_BWD candle_portable /' | tee -a "$LOG/bench-backward-atomic.log" | grep -v '^RESULT'
        for v in $VARIANT; do
            echo "== backward: candle-flash with CANDLE_FLASH_BWD_SM90_VARIANT=$v"
            CANDLE_FLASH_BWD_SM90_VARIANT=$v "$D/gpu_bench" --backward --no-autograd $QUICK 2>&1 \
                | sed "s/^RESULT_BWD candle /RESULT_BWD variant:$v /" | tee -a "$LOG/bench-backward-atomic.log" | grep -v '^RESULT'
        done
    fi
    for v in "$D"/var_*; do
        [ -x "$v" ] || continue
        echo "== variant $(basename "$v") (CANDLE_FLASH_BWD_DETERMINISTIC=0, then default)"
        CANDLE_FLASH_BWD_DETERMINISTIC=0 "$v" --backward --quick 2>&1 | grep -E "^bf16"
        "$v" --backward --quick 2>&1 | grep -E "^bf16"
    done
    echo "== backward: PyTorch SDPA"
    python3 "$D/sdpa_bench.py" --backward $QUICK 2>&1 | tee "$LOG/sdpa-backward.log" | grep -v '^RESULT'
    echo "== backward side by side (TFLOP/s at 2.5x the forward's flops; ratios = candle / torch)"
    cat "$LOG/bench-backward.log" "$LOG/bench-backward-atomic.log" "$LOG/sdpa-backward.log" | python3 "$D/bwd_table.py" | tee "$LOG/table-backward.md"
fi
cd "$LOG" && tar czf logs.tgz *.log 2>/dev/null && rm -f *.log
exit $status
