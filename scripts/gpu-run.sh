#!/usr/bin/env bash
# What runs on the GPU machine (carry .gpu/, made by scripts/pack-gpu.sh):
#   GPU tests, compute-sanitizer (memcheck, racecheck, synccheck, initcheck) on small ragged shapes, the
#   candle-flash benchmark, PyTorch SDPA (flash and cuDNN) on the same shapes, and a
#   side-by-side table with ratios. Logs, and the benchmarks' CSV (prefill-candle.csv,
#   prefill-torch.csv: plot them with scripts/plot.py), go to $OUT when it is set.
#   The decode benchmark (decode_bench and scripts/sdpa_decode.py, bf16, 32/8 heads, d 128) writes
#   decode-candle.csv and decode-torch.csv.
#   The backward pass (gpu_backward_tests, its sanitizer shapes, gpu_bench --backward and
#   sdpa_bench.py --backward side by side) runs unless --no-backward.
#   scripts/gpu-run.sh [--quick] [--no-tests] [--no-sanitizer] [--no-bench] [--no-decode] [--no-backward]
set -uo pipefail
cd "$(dirname "$0")/.."
QUICK=""; TESTS=1; SAN=1; BENCH=1; DECODE=1; BACKWARD=1
for a in "$@"; do
    case "$a" in
        --quick) QUICK=--quick ;;
        --no-tests) TESTS=0 ;;
        --no-sanitizer) SAN=0 ;;
        --no-bench) BENCH=0 ;;
        --no-decode) DECODE=0 ;;
        --no-backward) BACKWARD=0 ;;
    esac
done
LOG=${OUT:-/tmp}
export LD_LIBRARY_PATH=$(python3 -c 'import nvidia,os;print(os.path.join(list(nvidia.__path__)[0],"cu13","lib"))'):${LD_LIBRARY_PATH:-}
for f in .gpu/*.gz; do [ -e "$f" ] && gunzip -f "$f"; done
chmod +x .gpu/gpu_tests .gpu/paged_tests .gpu/gpu_bench .gpu/decode_bench
[ -e .gpu/gpu_backward_tests ] && chmod +x .gpu/gpu_backward_tests
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv,noheader
status=0
if [ $TESTS = 1 ]; then
    echo "== GPU tests"
    ./.gpu/gpu_tests --test-threads=1 2>&1 | tee "$LOG/tests.log" | grep -E "^test |test result|passed|panicked|error" || true
    [ "${PIPESTATUS[0]}" = 0 ] || status=1
    echo "== paged KV cache, prefix ranges and KV-cache append tests (tests/paged.rs on the GPU)"
    CANDLE_FLASH_TEST_DEVICE=cuda ./.gpu/paged_tests --test-threads=1 2>&1 | tee "$LOG/paged.log" | grep -E "^test |test result|panicked" || true
    [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi
if [ $SAN = 1 ]; then
    echo "== compute-sanitizer --tool memcheck on the paged / append tests"
    CANDLE_FLASH_TEST_DEVICE=cuda timeout 300 compute-sanitizer --tool memcheck --error-exitcode 9 \
        ./.gpu/paged_tests --test-threads=1 paged_matches kvcache 2>&1 \
        | tee "$LOG/sanitizer-paged.log" | grep -E "ERROR SUMMARY|test result" | head -5
    [ "${PIPESTATUS[0]}" = 0 ] || status=1
    for tool in memcheck racecheck synccheck initcheck; do
        echo "== compute-sanitizer --tool $tool (small ragged shapes)"
        CANDLE_FLASH_GPU_SMALL=1 timeout 300 compute-sanitizer --tool $tool --error-exitcode 9 \
            ./.gpu/gpu_tests --test-threads=1 sanitizer_ 2>&1 \
            | tee "$LOG/sanitizer-$tool.log" | grep -E "ERROR SUMMARY|RACECHECK SUMMARY|test result|Error|error" | head -20
        [ "${PIPESTATUS[0]}" = 0 ] || status=1
    done
fi
if [ $BENCH = 1 ]; then
    echo "== candle-flash benchmark"
    ./.gpu/gpu_bench $QUICK --csv "$LOG/prefill-candle.csv" 2>&1 | tee "$LOG/bench.log" | grep -v '^RESULT'
    echo "== PyTorch SDPA"
    python3 .gpu/sdpa_bench.py $QUICK --csv "$LOG/prefill-torch.csv" 2>&1 | tee "$LOG/sdpa.log" | grep -v '^RESULT'
    echo "== side by side (TFLOP/s; ratio = candle / torch flash)"
    cat "$LOG/bench.log" "$LOG/sdpa.log" | python3 -c '
import sys
r = {}
for l in sys.stdin:
    p = l.split()
    if len(p) == 7 and p[0] == "RESULT":
        r[(p[1], p[2], int(p[3]), int(p[4]), p[5])] = float(p[6])
keys = sorted({k[1:] for k in r}, key=lambda k: (k[0], k[1], k[3], k[2]))
print(f"| dtype | d | seq | causal | candle-flash | torch flash | torch cuDNN | vs flash | vs cuDNN |")
print("|---|---|---|---|---|---|---|---|---|")
for k in keys:
    c, f, n = (r.get((s,) + k) for s in ("candle", "torch_flash", "torch_cudnn"))
    fmt = lambda x: f"{x:.1f}" if x else "-"
    rat = lambda a, b: f"{a / b:.2f}" if a and b else "-"
    print(f"| {k[0]} | {k[1]} | {k[2]} | {k[3]} | {fmt(c)} | {fmt(f)} | {fmt(n)} | {rat(c, f)} | {rat(c, n)} |")
' | tee "$LOG/table.md"
fi
if [ $BACKWARD = 1 ]; then
    if [ $TESTS = 1 ]; then
        echo "== backward tests (tests/gpu_backward.rs)"
        ./.gpu/gpu_backward_tests --test-threads=1 2>&1 | tee "$LOG/backward-tests.log" | grep -E "^test |test result|panicked" || true
        [ "${PIPESTATUS[0]}" = 0 ] || status=1
    fi
    if [ $SAN = 1 ]; then
        for tool in memcheck racecheck synccheck initcheck; do
            echo "== compute-sanitizer --tool $tool on the backward kernels (sanitizer_shapes)"
            timeout 300 compute-sanitizer --tool $tool --error-exitcode 9 \
                ./.gpu/gpu_backward_tests --test-threads=1 sanitizer_ 2>&1 \
                | tee "$LOG/sanitizer-backward-$tool.log" | grep -E "ERROR SUMMARY|RACECHECK SUMMARY|test result" | head -5
            [ "${PIPESTATUS[0]}" = 0 ] || status=1
        done
    fi
    if [ $BENCH = 1 ]; then
        echo "== backward: candle-flash (deterministic default, then CANDLE_FLASH_BWD_DETERMINISTIC=0)"
        ./.gpu/gpu_bench --backward $QUICK 2>&1 | tee "$LOG/bench-backward.log" | grep -v '^RESULT'
        CANDLE_FLASH_BWD_DETERMINISTIC=0 ./.gpu/gpu_bench --backward $QUICK 2>&1 \
            | sed 's/^RESULT_BWD candle /RESULT_BWD candle_atomic /' | tee "$LOG/bench-backward-atomic.log" | grep -v '^RESULT'
        echo "== backward: PyTorch SDPA"
        python3 .gpu/sdpa_bench.py --backward $QUICK 2>&1 | tee "$LOG/sdpa-backward.log" | grep -v '^RESULT'
        echo "== backward side by side (TFLOP/s at 2.5x the forward's flops; ratios = candle / torch)"
        cat "$LOG/bench-backward.log" "$LOG/bench-backward-atomic.log" "$LOG/sdpa-backward.log" | python3 -c '
import sys
r = {}
for l in sys.stdin:
    p = l.split()
    if len(p) == 7 and p[0] == "RESULT_BWD":
        r[(p[1], p[2], int(p[3]), int(p[4]), p[5])] = float(p[6])
keys = sorted({k[1:] for k in r}, key=lambda k: (k[0], k[1], k[3], k[2]))
print("| dtype | d | seq | causal | candle-flash | candle atomic dQ | torch flash | torch cuDNN | vs flash | vs cuDNN |")
print("|---|---|---|---|---|---|---|---|---|---|")
for k in keys:
    c, a, f, n = (r.get((s,) + k) for s in ("candle", "candle_atomic", "torch_flash", "torch_cudnn"))
    fmt = lambda x: f"{x:.1f}" if x else "-"
    rat = lambda x, y: f"{x / y:.2f}" if x and y else "-"
    print(f"| {k[0]} | {k[1]} | {k[2]} | {k[3]} | {fmt(c)} | {fmt(a)} | {fmt(f)} | {fmt(n)} | {rat(c, f)} | {rat(c, n)} |")
' | tee "$LOG/table-backward.md"
    fi
fi
if [ $DECODE = 1 ]; then
    echo "== decode: candle-flash (flash_attn) vs candle naive, bf16, 32/8 heads, d 128"
    ./.gpu/decode_bench --device cuda --dtype bf16 --batch 1,8 --kv 4096,32768 --page 16 --csv "$LOG/decode-candle.csv" 2>&1 | tee "$LOG/decode.log"
    echo "== decode: PyTorch SDPA (flash, cuDNN), same shapes"
    python3 .gpu/sdpa_decode.py --csv "$LOG/decode-torch.csv" 2>&1 | tee "$LOG/decode-torch.log"
fi
exit $status
