#!/usr/bin/env bash
# Does the memory layout of q, k and v change the forward's speed? On the GPU machine (carry
# .gpu/ from scripts/pack-gpu.sh): for each round and shape, gpu_bench --shape D:SEQ with q/k/v
# in (batch, seq, heads, d) memory and with transpose(1, 2) views of (batch, heads, seq, d)
# tensors (--layout bshd / bhsd), then PyTorch SDPA (flash and cuDNN) on the same two layouts
# (scripts/sdpa_bench.py --layout). Prints the mean TFLOP/s of each and the ratios; raw lines go
# to $OUT/lay.txt.
#   SHAPES="128:2048 64:2048 128:8192" ROUNDS=2 bash scripts/layout-ab.sh
set -uo pipefail
cd "$(dirname "$0")/.."
. scripts/device-env.sh
BIN=${BIN:-.gpu/gpu_bench}
device_setup "$(dirname "$BIN")"
O=${OUT:-/tmp}
SHAPES=${SHAPES:-"128:2048 64:2048 128:8192"}
ROUNDS=${ROUNDS:-2}
: > "$O/lay.txt"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
t0=$(date +%s)
for r in $(seq "$ROUNDS"); do
    for s in $SHAPES; do
        for lay in bshd bhsd; do
            timeout 100 "$BIN" --shape "$s" --no-f32 --layout $lay 2>&1 | grep '^RESULT' \
                | sed "s/^RESULT candle/R ours_$lay $r/" >> "$O/lay.txt"
        done
        for lay in bhsd bshd; do
            timeout 100 python3 scripts/sdpa_bench.py --shape "$s" --layout $lay 2>&1 | grep '^RESULT' \
                | sed "s/^RESULT torch_\([a-z]*\)/R \1_$lay $r/" >> "$O/lay.txt"
        done
    done
    echo "round $r: $(($(date +%s) - t0)) s"
done
python3 - "$O/lay.txt" <<'PY'
import collections
import sys
v = collections.defaultdict(list)
for line in open(sys.argv[1]):
    _, impl, _, dt, d, s, c, tf = line.split()
    v[(dt, d, s, c, impl)].append(float(tf))
rows = sorted({k[:4] for k in v}, key=lambda k: (k[0], int(k[1]), int(k[2]), k[3]))
impls = ["ours_bshd", "ours_bhsd", "cudnn_bhsd", "cudnn_bshd", "flash_bhsd", "flash_bshd"]
ratios = [("ours_bshd", "cudnn_bhsd"), ("ours_bhsd", "cudnn_bhsd"), ("ours_bshd", "cudnn_bshd"),
          ("ours_bhsd", "ours_bshd"), ("cudnn_bshd", "cudnn_bhsd")]
print("| dtype | d | seq | causal | " + " | ".join(impls) + " | "
      + " | ".join(f"{a}/{b}" for a, b in ratios) + " |")
print("|---" * (4 + len(impls) + len(ratios)) + "|")
for k in rows:
    m = {i: sum(v[k + (i,)]) / len(v[k + (i,)]) for i in impls if v.get(k + (i,))}
    cell = lambda a, b: f"{m[a] / m[b]:.3f}" if a in m and b in m else "-"
    print(f"| {' | '.join(k)} | " + " | ".join(f"{m[i]:.1f}" if i in m else "-" for i in impls)
          + " | " + " | ".join(cell(a, b) for a, b in ratios) + " |")
print()
print("min-max over rounds:")
for k in rows:
    print(" ".join(k), " ".join(f"{i} {min(v[k + (i,)]):.1f}-{max(v[k + (i,)]):.1f}"
                              for i in impls if v.get(k + (i,))))
PY
