#!/usr/bin/env bash
# Assembles every PTX module the crate emits for sm_90 (ptxas -v) and prints registers, stack
# and spills per kernel. Fails when any kernel spills (flash_sm90.ptx, flash_bwd_sm90.ptx and
# flash_decode_sm90.ptx are assembled for sm_90a, which their wgmma and setmaxnreg need), and
# when ptxas reports that it serialised a kernel's wgmma instructions.
#   scripts/ptxas-check.sh [ptx dir]   (default: the newest cuda build under target*/)
set -euo pipefail
cd "$(dirname "$0")/.."
command -v ptxas >/dev/null || eval "$(bash scripts/setup-cuda.sh)"
dir=${1:-$(dirname "$(ls -t target*/*/build/candle-flash-*/out/flash_bf16.ptx 2>/dev/null | head -1)")}
[ -f "$dir/flash_bf16.ptx" ] || { echo "no PTX found (build with --features cuda first)"; exit 1; }
fail=0
for ptx in "$dir"/*.ptx; do
    arch=sm_90
    case "$(basename "$ptx")" in flash_sm90.ptx|flash_bwd_sm90.ptx|flash_decode_sm90.ptx) arch=sm_90a ;; esac
    report=$(ptxas -arch=$arch -v "$ptx" -o /dev/null 2>&1) || { echo "$report"; exit 1; }
    # ptxas serialises every wgmma of a kernel (each waits for the one before) when it cannot
    # prove the warpgroup converged where it must insert a register handoff: no spill is
    # reported, but the tensor pipe then idles between the GEMMs of a tile.
    if serial=$(grep "wgmma.mma_async instructions are serialized" <<<"$report"); then
        echo "$serial"; echo "  ^ SERIALISED wgmma in $(basename "$ptx")"; fail=1
    fi
    while IFS=$'\t' read -r name regs spill; do
        printf '%-32s %s %s\n' "$name" "$regs" "$spill"
        if ! grep -q "0 bytes spill stores, 0 bytes spill loads" <<<"$spill"; then
            echo "  ^ SPILLS"; fail=1
        fi
    done < <(awk '
        /Compiling entry function/ { match($0, /'"'"'[^'"'"']+'"'"'/); name = substr($0, RSTART + 1, RLENGTH - 2) }
        /spill stores/ { sub(/^.*info    : +/, ""); spill = $0 }
        /Used [0-9]+ registers/ { match($0, /Used [0-9]+ registers/); printf "%s\t%s\t%s\n", name, substr($0, RSTART, RLENGTH), spill }
    ' <<<"$report")
done
exit $fail
