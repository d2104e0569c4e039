#!/usr/bin/env bash
# What runs on the GPU machine for the Hopper forward variants (carry the folder made by
# scripts/pack-fwd.sh):
#   1. the GPU tests through the default plan and, in parallel, through each sm_90a variant
#      named (CANDLE_FLASH_SM90_VARIANT; persistent ones with their grid capped at --cap blocks,
#      so every block takes many tiles from the scheduler), less the decode and portable-only
#      tests for the variants;
#   2. compute-sanitizer memcheck, racecheck and synccheck on the small ragged shapes through
#      the default plan and each variant (in parallel);
#   3. gpu_bench --no-f32 for the default plan, DIR/gpu_bench_old (an older build placed there
#      by hand, its own default plan) if present, each of --bench-variants (default: the
#      variants; `v@n` runs v with CANDLE_FLASH_SM90_L2_KV_MIB=n), and (--default-twice) the
#      default again for the spread, one after the other, then scripts/sdpa_bench.py (PyTorch
#      flash and cuDNN); a side-by-side table with ratios to cuDNN.
# --smoke v first runs sanitizer_small_ragged_shapes once through variant v (also the driver's
# one-time JIT of the modules, which later processes reuse) and stops there if it fails.
# Logs go to $OUT (logs.tgz and table.md).
#   bash DIR/fwd-run.sh [--variants "wg2p wg2n176"] [--bench-variants "wg2p wg2p@32"] [--cap 7]
#                       [--default-twice] [--smoke v] [--no-tests] [--no-sanitizer] [--no-bench]
set -uo pipefail
D=$(cd "$(dirname "$0")" && pwd)
VARIANTS=""; BVARIANTS="-"; CAP=7; TWICE=0; TESTS=1; SAN=1; BENCH=1; SMOKE=
while [ $# -gt 0 ]; do
    case "$1" in
        --variants) VARIANTS=$2; shift ;;
        --bench-variants) BVARIANTS=$2; shift ;;
        --cap) CAP=$2; shift ;;
        --default-twice) TWICE=1 ;;
        --smoke) SMOKE=$2; shift ;;
        --no-tests) TESTS=0 ;;
        --no-sanitizer) SAN=0 ;;
        --no-bench) BENCH=0 ;;
    esac
    shift
done
LOG=${OUT:-/tmp}/logs
mkdir -p "$LOG"
. "$D/device-env.sh"
device_setup "$D"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv,noheader
cat "$D/commit" 2>/dev/null | head -3
# The variable value of a variant: persistent ones (a `p` after the warpgroups) get the grid cap.
env_of() { case "$1" in wg*p|wg*p*) echo "$1:$CAP" ;; *) echo "$1" ;; esac; }
status=0
if [ -n "$SMOKE" ]; then
    echo "== smoke: sanitizer_small_ragged_shapes through $SMOKE (with the JIT)"
    t0=$(date +%s)
    CANDLE_FLASH_SM90_VARIANT=$(env_of $SMOKE) timeout 150 "$D/gpu_tests" --test-threads=1 sanitizer_small \
        > "$LOG/smoke.log" 2>&1
    rc=$?
    echo "-- rc $rc ($(( $(date +%s) - t0 )) s): $(grep -E '^test result' "$LOG/smoke.log")"
    if [ $rc != 0 ]; then
        tail -30 "$LOG/smoke.log"
        tar czf "${OUT:-/tmp}/logs.tgz" -C "$LOG/.." logs
        exit 1
    fi
fi
if [ $TESTS = 1 ]; then
    echo "== GPU tests: default plan and each variant, in parallel"
    t0=$(date +%s)
    timeout 300 "$D/gpu_tests" --test-threads=1 > "$LOG/tests-default.log" 2>&1 &
    pids="$!:default"
    for v in $VARIANTS; do
        CANDLE_FLASH_SM90_VARIANT=$(env_of $v) timeout 300 "$D/gpu_tests" --test-threads=1 \
            --skip decode --skip wide_heads --skip heads_129 > "$LOG/tests-$v.log" 2>&1 &
        pids="$pids $!:$v"
    done
    for pv in $pids; do
        wait "${pv%%:*}"; rc=$?
        echo "-- ${pv#*:} (rc $rc): $(grep -E '^test result' "$LOG/tests-${pv#*:}.log" | tail -1)"
        grep -E "panicked|FAILED|failed" "$LOG/tests-${pv#*:}.log" | head -5
        [ $rc = 0 ] || status=1
    done
    echo "   ($(( $(date +%s) - t0 )) s)"
fi
if [ $SAN = 1 ]; then
    echo "== compute-sanitizer on sanitizer_small_ragged_shapes, in parallel"
    t0=$(date +%s)
    pids=""
    for v in default $VARIANTS; do
        for tool in memcheck racecheck synccheck; do
            if [ $v = default ]; then val=""; else val=$(env_of $v); fi
            CANDLE_FLASH_SM90_VARIANT=$val CANDLE_FLASH_GPU_SMALL=1 timeout 240 compute-sanitizer --tool $tool \
                --error-exitcode 9 "$D/gpu_tests" --test-threads=1 sanitizer_small > "$LOG/san-$v-$tool.log" 2>&1 &
            pids="$pids $!:$v-$tool"
        done
    done
    for pv in $pids; do
        wait "${pv%%:*}"; rc=$?
        echo "-- ${pv#*:} (rc $rc): $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$LOG/san-${pv#*:}.log" | tail -1) $(grep -E '^test result' "$LOG/san-${pv#*:}.log" | cut -c1-40)"
        [ $rc = 0 ] || status=1
    done
    echo "   ($(( $(date +%s) - t0 )) s)"
fi
if [ $BENCH = 1 ]; then
    echo "== gpu_bench --no-f32: default, old, then each variant"
    [ "$BVARIANTS" = "-" ] && BVARIANTS=$VARIANTS
    runs="default"
    [ -x "$D/gpu_bench_old" ] && runs="$runs old"
    runs="$runs $BVARIANTS"
    [ $TWICE = 1 ] && runs="$runs default2"
    for v in $runs; do
        t0=$(date +%s)
        bin="$D/gpu_bench"; val=""; mib=""
        case $v in
            default|default2) ;;
            old) bin="$D/gpu_bench_old" ;;
            *@*) val=${v%@*}; mib=${v#*@} ;;
            *) val=$v ;;
        esac
        CANDLE_FLASH_SM90_VARIANT=$val CANDLE_FLASH_SM90_L2_KV_MIB=$mib timeout 120 "$bin" --no-f32 2>&1 \
            | sed "s/^RESULT candle /RESULT $v /" > "$LOG/bench-$v.log"
        echo "-- $v ($(( $(date +%s) - t0 )) s)"
    done
    echo "== PyTorch SDPA"
    PYTHONUNBUFFERED=1 timeout 200 python3 "$D/sdpa_bench.py" > "$LOG/sdpa.log" 2>&1
    head -1 "$LOG/sdpa.log"
    cat "$LOG"/bench-*.log "$LOG/sdpa.log" | python3 -c '
import sys
runs = sys.argv[1].split()
r = {}
for l in sys.stdin:
    p = l.split()
    if len(p) == 7 and p[0] == "RESULT":
        r[(p[1], p[2], int(p[3]), int(p[4]), p[5])] = float(p[6])
keys = sorted({k[1:] for k in r}, key=lambda k: (k[0], k[1], k[3], k[2]))
cols = runs + ["torch_flash", "torch_cudnn"]
print("| dtype | d | seq | causal | " + " | ".join(cols) + " | " + " | ".join(f"{c} / cuDNN" for c in runs) + " |")
print("|---|---|---|---|" + "---:|" * (2 * len(runs) + 2))
fmt = lambda x: f"{x:.1f}" if x else "-"
for k in keys:
    v = [r.get((c,) + k) for c in cols]
    n = r.get(("torch_cudnn",) + k)
    rat = [f"{x / n:.2f}" if x and n else "-" for x in v[: len(runs)]]
    print(f"| {k[0]} | {k[1]} | {k[2]} | {k[3]} | " + " | ".join(map(fmt, v)) + " | " + " | ".join(rat) + " |")
' "$runs" | tee "${OUT:-/tmp}/table.md"
fi
tar czf "${OUT:-/tmp}/logs.tgz" -C "$LOG/.." logs && rm -rf "$LOG"
echo "status $status"
exit $status
