#!/usr/bin/env bash
# Clock and power beside throughput, ours against cuDNN, on the GPU machine (carry .gpu/ from
# scripts/pack-gpu.sh): nvidia-smi samples SM clock and board power every 100 ms while
# gpu_bench --shape D:SEQ runs three times and then PyTorch's cuDNN SDPA loops for a few seconds
# on each of the same rows (bf16 and f16, causal or not); a table of each phase's mean clock and
# power (samples above 550 W: under load). With --ncu, one launch of each kernel (bf16,
# unmasked) under Nsight Compute, clocks left alone: duration, L2 bytes, DRAM bytes,
# instructions, grid and cluster shape. Logs go to $OUT.
#   bash scripts/power-probe.sh [--ncu] [D:SEQ ...]   (default 128:2048 64:2048)
set -uo pipefail
cd "$(dirname "$0")/.."
. scripts/device-env.sh
device_setup .gpu
O=${OUT:-/tmp}
NCU=0; SHAPES=()
for a in "$@"; do
    case "$a" in --ncu) NCU=1 ;; *) SHAPES+=("$a") ;; esac
done
[ ${#SHAPES[@]} = 0 ] && SHAPES=(128:2048 64:2048)
cat > "$O/cudnn_loop.py" <<'PY'
import sys, time, torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
secs, d, s = float(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
b, h = 16384 // s, 2048 // d  # gpu_bench's shapes: 16384 tokens, hidden 2048
for dt, name in ((torch.bfloat16, "bf16"), (torch.float16, "f16")):
    for causal in (False, True):
        q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=dt) for _ in range(3))
        fl = 4 * b * h * s * s * d / (2 if causal else 1)
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            f = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            for _ in range(3):
                f()
            torch.cuda.synchronize()
            t0, n = time.time(), 0
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            while time.time() - t0 < secs:
                for _ in range(20):
                    f()
                n += 20
                torch.cuda.synchronize()
            e1.record()
            e1.synchronize()
            t = e0.elapsed_time(e1) / 1e3 / n
            print(f"{t0:.3f} {time.time():.3f} cudnn {name} {d} {s} {str(causal).lower()} {fl / t / 1e12:.1f}", flush=True)
PY
nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm --format=csv,noheader
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw --format=csv,noheader -lms 100 > "$O/smi.csv" &
SMI=$!
: > "$O/phases.txt"
for s in "${SHAPES[@]}"; do
    t0=$(date +%s.%N)
    for _ in 1 2 3; do ./.gpu/gpu_bench --shape "$s" --no-f32 --budget 2 2>&1 | grep '^RESULT' >> "$O/ours.txt"; done
    echo "$t0 $(date +%s.%N) ours ${s%%:*} ${s##*:}" >> "$O/phases.txt"
    python3 "$O/cudnn_loop.py" 2.5 "${s%%:*}" "${s##*:}" | tee -a "$O/cudnn.txt" \
        | awk -v d="${s%%:*}" -v s="${s##*:}" 'NR == 1 { t0 = $1 } { t1 = $2 } END { print t0, t1, "cudnn", d, s }' >> "$O/phases.txt"
done
kill $SMI
python3 - "$O" <<'PY'
import datetime, sys
o = sys.argv[1]
smi = []
for line in open(o + "/smi.csv"):
    p = [x.strip() for x in line.split(",")]
    try:
        t = datetime.datetime.strptime(p[0], "%Y/%m/%d %H:%M:%S.%f").replace(tzinfo=datetime.timezone.utc)
        smi.append((t.timestamp(), float(p[1].split()[0]), float(p[2].split()[0])))
    except (ValueError, IndexError):
        pass
print("| run | d | seq | samples | SM clock (MHz) | power (W) |")
print("|---|---|---|---:|---:|---:|")
for line in open(o + "/phases.txt"):
    t0, t1, who, d, s = line.split()
    w = [x for x in smi if float(t0) <= x[0] <= float(t1) and x[2] > 550]
    if w:
        print(f"| {who} | {d} | {s} | {len(w)} | {sum(x[1] for x in w) / len(w):.0f} | {sum(x[2] for x in w) / len(w):.0f} |")
PY
echo "throughput (TFLOP/s): ours"
awk '{ print "  " $3, $4, $5, $6, $7 }' "$O/ours.txt"
echo "cuDNN"
awk '{ print "  " $4, $5, $6, $7, $8 }' "$O/cudnn.txt"
if [ $NCU = 1 ]; then
    M=lts__t_bytes.sum,dram__bytes_read.sum,smsp__inst_executed.sum,gpu__time_duration.sum,sm__cycles_elapsed.avg.per_second
    s=${SHAPES[0]}
    ncu --clock-control none -k regex:cudnn -c 1 --section LaunchStats --metrics $M \
        python3 "$O/cudnn_loop.py" 0.01 "${s%%:*}" "${s##*:}" > "$O/ncu-cudnn.txt" 2>&1
    ncu --clock-control none -k regex:flash_fwd -c 1 --section LaunchStats --metrics $M \
        ./.gpu/gpu_bench --shape "$s" --no-f32 --budget 0.01 > "$O/ncu-ours.txt" 2>&1
    for f in "$O/ncu-cudnn.txt" "$O/ncu-ours.txt"; do
        grep -E "^  [a-z_]+.*Context|Cluster Size|Grid Size|lts__|dram__|inst_exec|duration|per_second" "$f"
    done
fi
