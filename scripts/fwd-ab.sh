#!/usr/bin/env bash
# Same-machine A/B of forward builds and variants, interleaved so that the GPU's clock and power
# state drift alike over every run: for each round and shape (gpu_bench --shape D:SEQ, bf16 and
# f16, causal or not), every entry of RUNS in turn, then (first round only) PyTorch SDPA, flash
# and cuDNN, on the same shape. Prints the mean per run, the ratios to cuDNN, and each run's
# ratio to the one named `old` (the last run's to `new`); raw lines go to $OUT/ab.txt.
#   RUNS="new:.gpu/gpu_bench old:DIR/gpu_bench_old newp:.gpu/gpu_bench:wg2p" \
#   SHAPES="128:2048 64:512" ROUNDS=2 bash scripts/fwd-ab.sh
# An entry is name:binary[:variant] (CANDLE_FLASH_SM90_VARIANT for that run). Binaries packed by
# scripts/pack-gpu.sh are unpacked first (.gpu/ and each binary's folder).
set -uo pipefail
cd "$(dirname "$0")/.."
. scripts/device-env.sh
O=${OUT:-/tmp}
SHAPES=${SHAPES:-"128:512 128:2048 128:8192 64:2048 64:512 64:8192"}
ROUNDS=${ROUNDS:-2}
RUNS=${RUNS:-"new:.gpu/gpu_bench"}
device_setup .gpu
for run in $RUNS; do
    IFS=: read -r _ bin _ <<<"$run"
    device_setup "$(dirname "$bin")"
done
t0=$(date +%s)
for r in $(seq "$ROUNDS"); do
    for s in $SHAPES; do
        for run in $RUNS; do
            IFS=: read -r name bin var <<<"$run"
            CANDLE_FLASH_SM90_VARIANT=${var:-} timeout 100 "$bin" --shape "$s" --no-f32 2>&1 \
                | grep '^RESULT' | sed "s/^RESULT candle/R $name $r/" >> "$O/ab.txt"
        done
        if [ "$r" = 1 ]; then
            timeout 100 python3 scripts/sdpa_bench.py --shape "$s" 2>&1 | grep '^RESULT' \
                | sed "s/^RESULT torch_\([a-z]*\)/R torch_\1 $r/" >> "$O/ab.txt"
        fi
    done
    echo "round $r: $(($(date +%s) - t0)) s"
done
python3 - "$O/ab.txt" "$RUNS" <<'PY'
import collections
import sys

ours = [r.split(":")[0] for r in sys.argv[2].split()]
cols = ours + ["torch_flash", "torch_cudnn"]
v = collections.defaultdict(list)
for line in open(sys.argv[1]):
    p = line.split()
    v[(p[1],) + tuple(p[3:7])].append(float(p[7]))
keys = sorted({k[1:] for k in v}, key=lambda k: (k[0], int(k[1]), k[3], int(k[2])))
base = lambda c: "new" if c == ours[-1] and len(ours) > 2 else "old"
rel_cols = [c for c in ours if c != "old" and base(c) in ours and c != base(c)]
print("| dtype | d | seq | causal | " + " | ".join(cols) + " | "
      + " | ".join(f"{c}/cuDNN" for c in ours) + "".join(f" | {c}/{base(c)}" for c in rel_cols)
      + " | spread |")
print("|---|---|---|---|" + "---:|" * (len(cols) + len(ours) + len(rel_cols) + 1))
for k in keys:
    m = {c: sum(v[(c,) + k]) / len(v[(c,) + k]) for c in cols if v[(c,) + k]}
    n = m.get("torch_cudnn")
    f = lambda x: f"{x:.1f}" if x is not None else "-"
    rat = [f"{m[c] / n:.2f}" if c in m and n else "-" for c in ours]
    rel = [f"{m[c] / m[base(c)]:.3f}" if c in m and base(c) in m else "-" for c in rel_cols]
    sp = max(max(v[(c,) + k]) / min(v[(c,) + k]) - 1 for c in ours if v[(c,) + k])
    print(f"| {' | '.join(k)} | " + " | ".join(f(m.get(c)) for c in cols) + " | "
          + " | ".join(rat) + "".join(f" | {x}" for x in rel) + f" | {sp * 100:.0f}% |")
PY
