#!/usr/bin/env python3
"""Plots the benchmarks' CSV files (needs matplotlib: pip install matplotlib).

    python3 scripts/plot.py prefill CSV [CSV ...] [-o OUT.png] [--dtype bf16 ...] [--title T]
    python3 scripts/plot.py decode  CSV [CSV ...] [-o OUT.png] [--dtype bf16 ...] [--title T]

Several CSV files are concatenated (for example candle-flash's and PyTorch's from one GPU run).
Lines starting with '#' are comments (where the numbers come from). PNG or SVG by the suffix of
-o; without -o the plot goes next to the first CSV, with the suffix .png.

prefill: forward throughput against sequence length, one panel per (dtype, head dim, causal),
one line per implementation. Written by
    cargo run --release --example cpu_bench -- --csv PATH
    cargo run --release --features cuda,candle-nn/cuda --example gpu_bench -- --csv PATH
    python3 scripts/sdpa_bench.py --csv PATH
Columns:
    impl     candle-flash | candle-naive | candle-nn-flash | torch-flash | torch-cudnn | ...
    dtype    f32 | f16 | bf16
    d        head dim
    seq      seq_q = seq_k
    batch, heads
    causal   true | false
    ms       time per call in milliseconds (may be empty)
    tflops   4*batch*heads*seq^2*d / time / 1e12, halved when causal (empty when the run failed)
    note     why there is no result (OOM, an error), else empty
A panel whose best figure is below 1 TFLOP/s is drawn in GFLOP/s.

decode: one query token per sequence against a KV cache (seq_q = 1), a memory-bound call, so the
figure of merit is bandwidth: GB/s against the KV length, one panel per (dtype, head dim), one
line per (impl, batch, heads/kv_heads). Columns:
    impl       implementation name, as above
    dtype      f32 | f16 | bf16
    batch      sequences in the batch (one query token each)
    heads      query heads
    kv_heads   key/value heads (GQA when fewer than heads)
    d          head dim
    kv_len     keys per sequence (the cache length)
    us         time per call in microseconds
    gbps       bytes moved / time / 1e9, bytes = (2*batch*kv_len*kv_heads*d   [K and V read]
                                                 + 2*batch*heads*d)          [q read, out written]
                                                * size of dtype
    copy_gbps  bandwidth of a plain device-to-device copy of the same number of bytes, timed in the
               same run: the attainable ceiling, drawn dashed (may be empty)
"""
import argparse
import csv
import math
import os
import sys
from collections import defaultdict

PREFILL_COLUMNS = ["impl", "dtype", "d", "seq", "batch", "heads", "causal", "ms", "tflops", "note"]
DECODE_COLUMNS = ["impl", "dtype", "batch", "heads", "kv_heads", "d", "kv_len", "us", "gbps",
                  "copy_gbps"]

# Fixed colours, so an implementation looks the same in every figure.
COLORS = {
    "candle-flash": "tab:red",
    "torch-flash": "tab:blue",
    "torch-cudnn": "tab:green",
    "candle-naive": "tab:gray",
    "candle-nn-flash": "tab:purple",
}
DTYPE_ORDER = {"bf16": 0, "f16": 1, "f32": 2}


def read(paths, columns):
    rows = []
    for path in paths:
        with open(path, newline="") as f:
            lines = [l for l in f if l.strip() and not l.lstrip().startswith("#")]
        reader = csv.DictReader(lines)
        missing = [c for c in columns if c not in (reader.fieldnames or [])]
        if missing:
            sys.exit(f"{path}: missing columns {missing} (expected {','.join(columns)})")
        rows.extend(reader)
    return rows


def number(x):
    return float(x) if x not in (None, "") else None


def grid(n_panels, ncols):
    import matplotlib.pyplot as plt

    ncols = min(ncols, n_panels)
    nrows = math.ceil(n_panels / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.2 * ncols, 3.4 * nrows), squeeze=False)
    return fig, axes


def plot_prefill(rows, out, title):
    import matplotlib.pyplot as plt

    panels = defaultdict(list)
    for r in rows:
        panels[(r["dtype"], int(r["d"]), r["causal"].lower() == "true")].append(r)
    keys = sorted(panels, key=lambda k: (DTYPE_ORDER.get(k[0], 9), k[0], k[1], k[2]))
    cols = len({(k[1], k[2]) for k in keys})
    fig, axes = grid(len(keys), cols)
    for ax in axes.flat[len(keys):]:
        ax.set_visible(False)
    for ax, key in zip(axes.flat, keys):
        dtype, d, causal = key
        prs = panels[key]
        best = max((number(r["tflops"]) or 0.0) for r in prs)
        scale, unit = (1.0, "TFLOP/s") if best >= 1.0 else (1e3, "GFLOP/s")
        lines = defaultdict(list)
        failed = defaultdict(list)
        for r in prs:
            tf = number(r["tflops"])
            if tf is None:
                failed[r["impl"]].append(int(r["seq"]))
            else:
                lines[r["impl"]].append((int(r["seq"]), tf * scale))
        for impl in sorted(lines, key=lambda i: (i != "candle-flash", i)):
            pts = sorted(lines[impl])
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=4, label=impl,
                    color=COLORS.get(impl))
        notes = [f"{impl}: no result at seq {', '.join(map(str, sorted(seqs)))}"
                 for impl, seqs in sorted(failed.items())]
        if notes:
            ax.text(0.02, 0.02, "\n".join(notes), transform=ax.transAxes, fontsize=7,
                    va="bottom", color="dimgray")
        ax.set_xscale("log", base=2)
        seqs = sorted({int(r["seq"]) for r in prs})
        ax.set_xticks(seqs)
        ax.set_xticklabels([str(s) for s in seqs], fontsize=8)
        ax.set_ylim(bottom=0)
        ax.set_title(f"{dtype}, head dim {d}, {'causal' if causal else 'no mask'}", fontsize=10)
        ax.set_xlabel("sequence length")
        ax.set_ylabel(unit)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    finish(fig, out, title)


def plot_decode(rows, out, title):
    panels = defaultdict(list)
    for r in rows:
        panels[(r["dtype"], int(r["d"]))].append(r)
    keys = sorted(panels, key=lambda k: (DTYPE_ORDER.get(k[0], 9), k[0], k[1]))
    fig, axes = grid(len(keys), 3)
    for ax in axes.flat[len(keys):]:
        ax.set_visible(False)
    for ax, key in zip(axes.flat, keys):
        dtype, d = key
        lines = defaultdict(list)
        ceiling = defaultdict(list)
        for r in panels[key]:
            label = f"{r['impl']} b{r['batch']} h{r['heads']}/{r['kv_heads']}"
            kv = int(r["kv_len"])
            if number(r["gbps"]) is not None:
                lines[(r["impl"], label)].append((kv, number(r["gbps"])))
            if number(r["copy_gbps"]) is not None:
                ceiling[kv].append(number(r["copy_gbps"]))
        for (_, label), pts in sorted(lines.items()):
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=4, label=label)
        if ceiling:
            kvs = sorted(ceiling)
            ax.plot(kvs, [max(ceiling[k]) for k in kvs], ls="--", color="black", lw=1,
                    label="device copy")
        ax.set_xscale("log", base=2)
        ax.set_ylim(bottom=0)
        ax.set_title(f"decode, {dtype}, head dim {d}", fontsize=10)
        ax.set_xlabel("KV length")
        ax.set_ylabel("GB/s")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    finish(fig, out, title)


def finish(fig, out, title):
    import matplotlib.pyplot as plt

    if title:
        fig.suptitle(title)
    fig.tight_layout()
    # No timestamp in the metadata, so that an unchanged plot is an unchanged file.
    meta = {"Software": None} if out.endswith(".png") else {"Date": None}
    fig.savefig(out, dpi=110, metadata=meta)
    plt.close(fig)
    print(f"wrote {out}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("kind", choices=["prefill", "decode"])
    ap.add_argument("csv", nargs="+")
    ap.add_argument("-o", "--out", help="output file (.png or .svg)")
    ap.add_argument("--dtype", action="append", help="only these dtypes (repeatable)")
    ap.add_argument("--title")
    args = ap.parse_args()

    import matplotlib

    matplotlib.use("Agg")
    columns = PREFILL_COLUMNS if args.kind == "prefill" else DECODE_COLUMNS
    rows = read(args.csv, columns)
    if args.dtype:
        rows = [r for r in rows if r["dtype"] in args.dtype]
    if not rows:
        sys.exit("no rows to plot")
    out = args.out or os.path.splitext(args.csv[0])[0] + ".png"
    (plot_prefill if args.kind == "prefill" else plot_decode)(rows, out, args.title)


if __name__ == "__main__":
    main()
