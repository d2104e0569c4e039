#!/usr/bin/env bash
# What runs on the GPU machine (carry .gpu/, made by scripts/pack-gpu.sh):
#   GPU tests (on a Hopper GPU three times: sm_90a default, CANDLE_FLASH_PORTABLE=1, and the
#   persistent kernels on three blocks), compute-sanitizer (memcheck, racecheck, synccheck,
#   initcheck) on small ragged shapes, the candle-flash benchmark, PyTorch SDPA (flash and
#   cuDNN) on the same shapes (d 64 and 128, then d 256 one sequence length at a time), and a
#   side-by-side table with ratios. Logs, and the benchmarks' CSV (prefill-candle.csv,
#   prefill-torch.csv: plot them with scripts/plot.py), go to $OUT when it is set.
#   The decode benchmark (decode_bench and scripts/sdpa_decode.py, bf16, 32/8 heads, d 128) writes
#   decode-candle.csv and decode-torch.csv.
#   The backward pass (gpu_backward_tests, on Hopper twice like the forward tests, its sanitizer
#   shapes, gpu_bench --backward, on Hopper also with CANDLE_FLASH_PORTABLE=1, elsewhere with
#   CANDLE_FLASH_BWD_DETERMINISTIC=0, and sdpa_bench.py --backward side by side) runs unless
#   --no-backward.
#   examples/train.rs on the GPU (naive and flash in lockstep, f32) runs unless --no-train.
#   --ab-old: the forward benchmark on the portable kernels (CANDLE_FLASH_PORTABLE=1) alternates
#   with .gpu/gpu_bench_old, a gpu_bench built from an older commit (placed there by hand), twice
#   each (AB_ROUNDS=n: n each), for a same-machine A/B.
#   --no-forward skips the forward benchmark (the backward's and decode's still run).
#   scripts/gpu-run.sh [--quick] [--no-tests] [--no-sanitizer] [--no-bench] [--no-forward]
#                      [--no-decode] [--no-backward] [--no-train] [--ab-old]
set -uo pipefail
cd "$(dirname "$0")/.."
QUICK=""; TESTS=1; SAN=1; BENCH=1; FORWARD=1; DECODE=1; BACKWARD=1; TRAIN=1; AB=0
for a in "$@"; do
    case "$a" in
        --quick) QUICK=--quick ;;
        --no-tests) TESTS=0 ;;
        --no-sanitizer) SAN=0 ;;
        --no-bench) BENCH=0 ;;
        --no-forward) FORWARD=0 ;;
        --no-decode) DECODE=0 ;;
        --no-backward) BACKWARD=0 ;;
        --no-train) TRAIN=0 ;;
        --ab-old) AB=1 ;;
    esac
done
LOG=${OUT:-/tmp}
# scripts/pack-gpu.sh leaves xz files in .gpu/ (a gpu_bench_old placed by hand may be plain).
. scripts/device-env.sh
device_setup .gpu
[ -e .gpu/gpu_bench_old ] && chmod +x .gpu/gpu_bench_old
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv,noheader
HOPPER=0
[ "$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1)" = "9.0" ] && HOPPER=1
status=0
if [ $TESTS = 1 ]; then
    echo "== GPU tests"
    ./.gpu/gpu_tests --test-threads=1 2>&1 | tee "$LOG/tests.log" | grep -E "^test |test result|passed|panicked|error" || true
    [ "${PIPESTATUS[0]}" = 0 ] || status=1
    if [ "$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1)" = "9.0" ]; then
        # Hopper runs the sm_90a kernels by default: the whole suite again on the portable path.
        echo "== GPU tests again with CANDLE_FLASH_PORTABLE=1 (the sm_80 kernels on this Hopper GPU)"
        CANDLE_FLASH_PORTABLE=1 ./.gpu/gpu_tests --test-threads=1 2>&1 | tee "$LOG/tests-portable.log" | grep -E "^test |test result|passed|panicked|error" || true
        [ "${PIPESTATUS[0]}" = 0 ] || status=1
        # Three persistent blocks take every tile of the d 64 / d 128 calls: each block runs many
        # tiles, with and without keys, through its tile ring and double-buffered Q.
        echo "== GPU tests again with CANDLE_FLASH_SM90_VARIANT=wg2p:3 (persistent, three blocks)"
        CANDLE_FLASH_SM90_VARIANT=wg2p:3 ./.gpu/gpu_tests --test-threads=1 2>&1 | tee "$LOG/tests-wg2p3.log" | grep -E "^test |test result|passed|panicked|error" || true
        [ "${PIPESTATUS[0]}" = 0 ] || status=1
    fi
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
        # initcheck does not count bulk tensor stores as writes: it runs the sm_90a forward with
        # thread stores (the other tools check the bulk stores; the poisoned tests check that
        # they write every element).
        threads=""; [ $tool = initcheck ] && threads=1
        CANDLE_FLASH_SM90_THREAD_STORES=$threads CANDLE_FLASH_GPU_SMALL=1 timeout 300 compute-sanitizer --tool $tool --error-exitcode 9 \
            ./.gpu/gpu_tests --test-threads=1 sanitizer_ 2>&1 \
            | tee "$LOG/sanitizer-$tool.log" | grep -E "ERROR SUMMARY|RACECHECK SUMMARY|test result|Error|error" | head -20
        [ "${PIPESTATUS[0]}" = 0 ] || status=1
        if [ "$HOPPER" = 1 ] && [ $tool != initcheck ]; then
            echo "== compute-sanitizer --tool $tool (small ragged shapes, CANDLE_FLASH_SM90_VARIANT=wg2p:3)"
            CANDLE_FLASH_SM90_VARIANT=wg2p:3 CANDLE_FLASH_GPU_SMALL=1 timeout 300 compute-sanitizer --tool $tool --error-exitcode 9 \
                ./.gpu/gpu_tests --test-threads=1 sanitizer_ persistent_tiles 2>&1 \
                | tee "$LOG/sanitizer-$tool-wg2p3.log" | grep -E "ERROR SUMMARY|RACECHECK SUMMARY|test result|Error|error" | head -20
            [ "${PIPESTATUS[0]}" = 0 ] || status=1
        fi
    done
fi
if [ $BENCH = 1 ] && [ $FORWARD = 1 ]; then
    echo "== candle-flash benchmark"
    ./.gpu/gpu_bench $QUICK --csv "$LOG/prefill-candle.csv" 2>&1 | tee "$LOG/bench.log" | grep -v '^RESULT'
    echo "== PyTorch SDPA"
    python3 .gpu/sdpa_bench.py $QUICK --csv "$LOG/prefill-torch.csv" 2>&1 | tee "$LOG/sdpa.log" | grep -v '^RESULT'
    echo "== d 256 rows: gpu_bench --shape 256:SEQ beside sdpa_bench.py --shape 256:SEQ"
    seqs256="512 2048 8192 16384"
    [ -n "$QUICK" ] && seqs256="2048 8192"
    for s in $seqs256; do
        ./.gpu/gpu_bench --shape 256:$s --no-f32 2>&1 | tee -a "$LOG/bench.log" | grep -E '^(bf16|f16) '
        python3 .gpu/sdpa_bench.py --shape 256:$s 2>&1 | tee -a "$LOG/sdpa.log" | grep -E '^(flash|cudnn) '
    done
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
        if [ "$HOPPER" = 1 ]; then
            echo "== backward tests again with CANDLE_FLASH_PORTABLE=1 (the sm_80 kernels on this Hopper GPU)"
            CANDLE_FLASH_PORTABLE=1 ./.gpu/gpu_backward_tests --test-threads=1 2>&1 | tee "$LOG/backward-tests-portable.log" | grep -E "^test |test result|panicked" || true
            [ "${PIPESTATUS[0]}" = 0 ] || status=1
        fi
    fi
    if [ $SAN = 1 ]; then
        for tool in memcheck racecheck synccheck initcheck; do
            echo "== compute-sanitizer --tool $tool on the backward kernels (sanitizer_shapes)"
            threads=""; [ $tool = initcheck ] && threads=1  # as for the forward, above
            CANDLE_FLASH_SM90_THREAD_STORES=$threads timeout 300 compute-sanitizer --tool $tool --error-exitcode 9 \
                ./.gpu/gpu_backward_tests --test-threads=1 sanitizer_ 2>&1 \
                | tee "$LOG/sanitizer-backward-$tool.log" | grep -E "ERROR SUMMARY|RACECHECK SUMMARY|test result" | head -5
            [ "${PIPESTATUS[0]}" = 0 ] || status=1
        done
    fi
    if [ $BENCH = 1 ]; then
        echo "== backward: candle-flash (deterministic default)"
        ./.gpu/gpu_bench --backward $QUICK 2>&1 | tee "$LOG/bench-backward.log" | grep -v '^RESULT'
        if [ "$HOPPER" = 1 ]; then
            # The Hopper kernels serve both modes; the portable ones are the comparison here.
            echo "== backward: candle-flash with CANDLE_FLASH_PORTABLE=1 (the sm_80 kernels)"
            CANDLE_FLASH_PORTABLE=1 ./.gpu/gpu_bench --backward --no-autograd $QUICK 2>&1 \
                | sed 's/^RESULT_BWD candle /RESULT_BWD candle_portable /' | tee "$LOG/bench-backward-atomic.log" | grep -v '^RESULT'
        else
            echo "== backward: candle-flash with CANDLE_FLASH_BWD_DETERMINISTIC=0"
            CANDLE_FLASH_BWD_DETERMINISTIC=0 ./.gpu/gpu_bench --backward --no-autograd $QUICK 2>&1 \
                | sed 's/^RESULT_BWD candle /RESULT_BWD candle_atomic /' | tee "$LOG/bench-backward-atomic.log" | grep -v '^RESULT'
        fi
        echo "== backward: PyTorch SDPA"
        python3 .gpu/sdpa_bench.py --backward $QUICK 2>&1 | tee "$LOG/sdpa-backward.log" | grep -v '^RESULT'
        echo "== backward side by side (TFLOP/s at 2.5x the forward's flops; ratios = candle / torch)"
        cat "$LOG/bench-backward.log" "$LOG/bench-backward-atomic.log" "$LOG/sdpa-backward.log" | python3 scripts/bwd_table.py | tee "$LOG/table-backward.md"
    fi
fi
if [ $DECODE = 1 ]; then
    echo "== decode: candle-flash (flash_attn) vs candle naive, bf16, 32/8 heads, d 128"
    ./.gpu/decode_bench --device cuda --dtype bf16 --batch 1,8 --kv 4096,32768 --page 16 --csv "$LOG/decode-candle.csv" 2>&1 | tee "$LOG/decode.log"
    echo "== decode: PyTorch SDPA (flash, cuDNN), same shapes"
    python3 .gpu/sdpa_decode.py --csv "$LOG/decode-torch.csv" 2>&1 | tee "$LOG/decode-torch.log"
fi
if [ $TRAIN = 1 ]; then
    echo "== examples/train.rs on the GPU (f32, naive and flash in lockstep)"
    ./.gpu/train --device cuda --plot "$LOG/train-loss-cuda.svg" 2>&1 | tee "$LOG/train.log" | tail -8
    [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi
if [ $AB = 1 ] && [ -e .gpu/gpu_bench_old ]; then
    # The new side runs the portable (sm_80) kernels: the A/B is about them, and an older build
    # may predate the Hopper module (it ignores the variable).
    echo "== forward A/B: this build (new, CANDLE_FLASH_PORTABLE=1) against .gpu/gpu_bench_old (old), alternating"
    for r in $(seq "${AB_ROUNDS:-2}"); do
        CANDLE_FLASH_PORTABLE=1 ./.gpu/gpu_bench --no-f32 > "$LOG/ab-new$r.log" 2>&1
        ./.gpu/gpu_bench_old --no-f32 > "$LOG/ab-old$r.log" 2>&1
    done
    python3 - "$LOG" <<'PY' | tee "$LOG/table-ab.md"
import glob, os, statistics as st, sys
runs = {}
for f in sorted(glob.glob(os.path.join(sys.argv[1], "ab-*.log"))):
    side = "new" if "ab-new" in f else "old"
    for l in open(f):
        p = l.split()
        if len(p) == 7 and p[:2] == ["RESULT", "candle"]:
            runs.setdefault(tuple(p[2:6]), {}).setdefault(side, []).append(float(p[6]))
print("| dtype | d | seq | causal | new runs | old runs | new / old |")
print("|---|---|---|---|---|---|---:|")
for k, r in runs.items():
    if "new" in r and "old" in r:
        fmt = lambda xs: " / ".join(f"{x:.1f}" for x in xs)
        print(f"| {' | '.join(k)} | {fmt(r['new'])} | {fmt(r['old'])} | {st.mean(r['new']) / st.mean(r['old']):.3f} |")
PY
fi
exit $status
