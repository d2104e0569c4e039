#!/usr/bin/env python3
"""The backward side-by-side table (markdown) from RESULT_BWD lines on stdin.

Lines: `RESULT_BWD <impl> <dtype> <d> <seq> <causal> <TFLOP/s>`, where impl is `candle` (the
op's backward from saved results, as `torch.autograd.grad` times SDPA's), `candle_autograd`
(through candle's `loss.backward()`), `candle_atomic`, `candle_portable`, `variant:<name>`,
`torch_flash` or `torch_cudnn` (examples/gpu_bench.rs --backward, scripts/sdpa_bench.py
--backward). Columns without any value are left out; ratios are candle / the other.
Used by scripts/gpu-run.sh and scripts/bwd-run.sh.
"""
import sys

r = {}
for line in sys.stdin:
    p = line.split()
    if len(p) == 7 and p[0] == "RESULT_BWD":
        r[(p[1], p[2], int(p[3]), int(p[4]), p[5])] = float(p[6])
impls = {k[0] for k in r}
keys = sorted({k[1:] for k in r}, key=lambda k: (k[0], k[1], k[3], k[2]))
variants = sorted(i for i in impls if i.startswith("variant:"))
named = [("candle", "candle-flash"), ("candle_autograd", "via loss.backward()"),
         ("candle_atomic", "atomic dQ"), ("candle_portable", "portable (sm_80)")]
cols = [(i, n) for i, n in named if i in impls] + [(v, v) for v in variants]
cols += [(i, n) for i, n in (("torch_flash", "torch flash"), ("torch_cudnn", "torch cuDNN")) if i in impls]
ratios = [(i, "vs " + n) for i, n in (("torch_flash", "flash"), ("torch_cudnn", "cuDNN"),
                                      ("candle_portable", "portable")) if i in impls]
ratios += [(v, f"{v} vs flash") for v in variants if "torch_flash" in impls]
ratios += [("candle_autograd", "via loss.backward() vs flash")] if {"candle_autograd", "torch_flash"} <= impls else []
fmt = lambda x: f"{x:.1f}" if x else "-"
rat = lambda x, y: f"{x / y:.2f}" if x and y else "-"
head = [n for _, n in cols] + [n for _, n in ratios]
print("| dtype | d | seq | causal | " + " | ".join(head) + " |")
print("|---" * (4 + len(head)) + "|")
for k in keys:
    get = lambda i: r.get((i,) + k)
    cells = [fmt(get(i)) for i, _ in cols]
    for i, n in ratios:
        if i.startswith("variant:") or i == "candle_autograd":
            cells.append(rat(get(i), get("torch_flash")))
        else:
            cells.append(rat(get("candle"), get(i)))
    print(f"| {k[0]} | {k[1]} | {k[2]} | {k[3]} | " + " | ".join(cells) + " |")
