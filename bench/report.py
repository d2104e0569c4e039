#!/usr/bin/env python3
"""Benchmark report: regenerates docs/benchmarks.md, the plots in docs/img/ and the README's
performance block (between `<!-- bench:begin -->` and `<!-- bench:end -->`) from the committed
results in bench/results/*.csv.

    python3 bench/report.py           # rewrite the page, the README block and the plots
    python3 bench/report.py --check   # exit 1 if the page or the README block is out of date

The plots need matplotlib; without it the tables are still written and the plots are skipped
with a message. Output depends only on the CSV files, so a second run changes nothing.

Every results file starts with the columns `date,commit,device,command` (where the numbers come
from: examples/common/results.rs writes them for the Rust benchmarks, bench/torch_*.py for
PyTorch), then the workload's columns (see SCHEMAS). Rows of several commands (candle-flash's
benchmark and PyTorch's) share one file; each table lists the date, commit and command of its rows.

Ratios are "best PyTorch / candle-flash" on times: the time of the faster PyTorch backend
(torch-flash or torch-cudnn) for the same shape divided by candle-flash's. Above 1, candle-flash
is faster; below 1, PyTorch is.
"""
import argparse
import csv
import math
import os
import statistics
import sys
from collections import defaultdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results")
PAGE = os.path.join(ROOT, "docs", "benchmarks.md")
IMG = os.path.join(ROOT, "docs", "img")
README = os.path.join(ROOT, "README.md")
BEGIN, END = "<!-- bench:begin -->", "<!-- bench:end -->"

COMMON = ["date", "commit", "device", "command"]
SCHEMAS = {
    "gpu-prefill": "impl,dtype,mask,batch,seq,heads,kv_heads,head_dim,ms,tflops",
    "gpu-backward": "impl,dtype,mask,batch,seq,heads,kv_heads,head_dim,ms,tflops",
    "gpu-decode": "impl,dtype,layout,heads,kv_heads,head_dim,batch,seq_q,kv,us,gbps,ref_gbps",
    "cpu-prefill": "impl,dtype,pass,mask,batch,seq,heads,head_dim,ms,gflops",
    "cpu-decode": "impl,dtype,layout,heads,kv_heads,head_dim,batch,seq_q,kv,us,gbps,ref_gbps",
    "gpu-ring": "gpus,comm,dtype,heads,kv_heads,head_dim,mask,seq,fwd_ms,fwd_bwd_ms,tokens_per_s,"
                "gib_per_gpu,single_fwd_ms,single_fwd_bwd_ms,diff_out,diff_lse,diff_dq,diff_dk,"
                "diff_dv,rerun_identical",
    "cpu-variants": "variant,dtype,head_dim,heads,kv_heads,batch,seq_q,seq_k,causal,plain_ms,"
                    "variant_ms,ratio",
    "gpu-variants": "variant,dtype,head_dim,heads,kv_heads,batch,seq_q,seq_k,causal,plain_ms,"
                    "variant_ms,ratio",
    "gpu-flex": "variant,batch,seq_q,seq_k,causal,flex_plain_ms,flex_variant_ms,flex_ratio",
    "gpu-fp8-decode": "impl,dtype,layout,heads,kv_heads,head_dim,batch,seq_q,kv,us,gbps,"
                      "ref_gbps",
    "cpu-fp8-decode": "impl,dtype,layout,heads,kv_heads,head_dim,batch,seq_q,kv,us,gbps,"
                      "ref_gbps",
    "gpu-fp8-prefill": "impl,dtype,mask,batch,seq,heads,kv_heads,head_dim,ms,tflops",
    "gpu-decode-splits": "impl,dtype,layout,heads,kv_heads,head_dim,batch,seq_q,kv,us,gbps,"
                         "ref_gbps",
    "fp8-accuracy": "inputs,method,heads,kv_heads,head_dim,batch,seq_q,seq_k,rmse,rel_rmse,"
                    "max_abs",
}
INTEGER = {"batch", "seq", "heads", "kv_heads", "head_dim", "seq_q", "kv", "seq_k", "gpus"}
REAL = {"rmse", "rel_rmse", "max_abs", "ms", "tflops", "gflops", "us", "gbps", "ref_gbps", "plain_ms", "variant_ms", "ratio",
        "fwd_ms", "fwd_bwd_ms", "tokens_per_s", "gib_per_gpu", "single_fwd_ms",
        "single_fwd_bwd_ms", "flex_plain_ms", "flex_variant_ms", "flex_ratio"}
TORCH = ("torch-flash", "torch-cudnn")
# Implementations in the order their columns appear; others follow alphabetically.
IMPL_ORDER = ["candle-flash", "candle-flash-autograd", "candle-flash-portable", "candle-naive",
              "candle-nn-flash", "torch-flash", "torch-cudnn", "torch-cpu"]
DTYPE_ORDER = {"bf16": 0, "f16": 1, "f32": 2}
COLORS = {"candle-flash": "tab:red", "candle-flash-autograd": "tab:orange",
          "candle-flash-portable": "tab:brown", "candle-naive": "tab:gray",
          "candle-nn-flash": "tab:purple", "torch-flash": "tab:blue", "torch-cudnn": "tab:green",
          "torch-cpu": "tab:cyan"}
STYLES = ["-", "--", ":", "-."]  # line styles of successive batch sizes
BIG_KV_BYTES = 256e6  # K+V at least this large: the cache streams from DRAM, not from L2
ELEM_BYTES = {"f32": 4, "f16": 2, "bf16": 2}


# ---------------------------------------------------------------------------------------------
# Reading


def read(name):
    """Rows of bench/results/NAME.csv as dicts with numbers parsed (None where empty), or None
    when the file does not exist."""
    path = os.path.join(RESULTS, name + ".csv")
    if not os.path.exists(path):
        return None
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        want = COMMON + SCHEMAS[name].split(",")
        missing = [c for c in want if c not in (reader.fieldnames or [])]
        if missing:
            sys.exit(f"{os.path.relpath(path, ROOT)}: missing columns {missing}; expected "
                     f"{','.join(want)}")
        rows = []
        for line, r in enumerate(reader, start=2):
            try:
                for k in INTEGER & r.keys():
                    r[k] = int(r[k])
                for k in REAL & r.keys():
                    r[k] = float(r[k]) if r[k] not in ("", None) else None
            except ValueError as e:
                sys.exit(f"{os.path.relpath(path, ROOT)}:{line}: {e}")
            rows.append(r)
    return rows


def by_device(rows):
    groups = defaultdict(list)
    for r in rows:
        groups[r["device"]].append(r)
    return [(d, groups[d]) for d in sorted(groups)]


def impl_key(i):
    return (IMPL_ORDER.index(i) if i in IMPL_ORDER else len(IMPL_ORDER), i)


def dtype_key(d):
    return (DTYPE_ORDER.get(d, 9), d)


def slug(text):
    s = "".join(c.lower() if c.isalnum() else "-" for c in text)
    return "-".join(p for p in s.split("-") if p)


# ---------------------------------------------------------------------------------------------
# Formatting


def provenance(rows, device=None):
    """One line naming the device, the dates, commits and commands of `rows`."""
    runs = sorted({(r["date"], r["commit"], r["command"]) for r in rows})
    device = device or rows[0]["device"]
    if len(runs) == 1:
        date, commit, command = runs[0]
        return f"{device}, {date}, commit `{commit}`: `{command}`"
    parts = "; ".join(f"{d}, commit `{c}`: `{cmd}`" for d, c, cmd in runs)
    return f"{device}; {parts}"


def table(header, rows, align=None):
    align = align or ["l"] + ["r"] * (len(header) - 1)
    sep = ["---:" if a == "r" else "---" for a in align]
    out = ["| " + " | ".join(header) + " |", "| " + " | ".join(sep) + " |"]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(out)


def fnum(x, digits=None):
    """A measured value with about four significant digits; '–' when missing."""
    if x is None:
        return "–"
    if digits is not None:
        return f"{x:.{digits}f}"
    a = abs(x)
    if a >= 1000:
        return f"{x:.0f}"
    if a >= 100:
        return f"{x:.1f}"
    if a >= 10:
        return f"{x:.2f}"
    return f"{x:.3f}"


def fratio(x):
    return "–" if x is None else f"{x:.2f}"


def fpct(x):
    return "–" if x is None else f"{100 * x:.0f}%"


def span(values, fmt=fratio):
    values = [v for v in values if v is not None]
    if not values:
        return "–"
    lo, hi = min(values), max(values)
    return fmt(lo) if fmt(lo) == fmt(hi) else f"{fmt(lo)}–{fmt(hi)}"


def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def best_torch(times):
    """(time, impl) of the faster PyTorch backend among `times` {impl: time}, or (None, None)."""
    cands = [(times[i], i) for i in TORCH if times.get(i) is not None]
    return min(cands) if cands else (None, None)


def ratio(num, den):
    return num / den if num is not None and den else None


def img_link(name, alt):
    return f"![{alt}](img/{name})"


# ---------------------------------------------------------------------------------------------
# Plots (matplotlib only here; every function returns without it)


class Plots:
    def __init__(self, enabled):
        self.plt = None
        self.written = []
        if not enabled:
            return
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            print("matplotlib is not installed: the plots in docs/img/ are left as they are "
                  "(pip install matplotlib to redraw them)")
            return
        # Deterministic SVG: no date, fixed ids, text kept as text.
        matplotlib.rcParams.update({"svg.hashsalt": "candle-flash", "svg.fonttype": "none",
                                    "font.size": 9})
        self.plt = plt

    def remove_stale(self):
        """Deletes plots of an earlier run that this run did not draw (a configuration that is
        no longer in the results); other images in docs/img/ are left alone."""
        if not self.plt or not os.path.isdir(IMG):
            return
        for f in sorted(os.listdir(IMG)):
            if f.endswith(".svg") and f.split("-")[0] in ("gpu", "cpu") and f not in self.written:
                os.remove(os.path.join(IMG, f))
                print(f"removed docs/img/{f} (no longer drawn)")

    def save(self, fig, name):
        os.makedirs(IMG, exist_ok=True)
        fig.savefig(os.path.join(IMG, name), format="svg", metadata={"Date": None},
                    bbox_inches="tight")
        self.plt.close(fig)
        self.written.append(name)

    def grid(self, n, ncols, w=4.0, h=3.1):
        ncols = max(1, min(ncols, n))
        nrows = math.ceil(n / ncols)
        fig, axes = self.plt.subplots(nrows, ncols, figsize=(w * ncols, h * nrows),
                                      squeeze=False, layout="constrained")
        for ax in axes.flat[n:]:
            ax.set_visible(False)
        return fig, list(axes.flat[:n])

    def legend(self, fig, impls, styles):
        """One legend for the figure: a colour per implementation, then the line styles."""
        from matplotlib.lines import Line2D

        handles = [Line2D([], [], color=COLORS.get(i, "black"), marker="o", ms=3, label=i)
                   for i in sorted(impls, key=impl_key)]
        handles += [Line2D([], [], color="black", linestyle=ls, label=label)
                    for ls, label in styles]
        fig.legend(handles=handles, loc="outside right upper", fontsize=8)

    def throughput(self, name, title, panels, unit, ncols, xlabel="sequence length"):
        """panels: [(panel title, {(impl, mask): [(x, y)]})]: lines per implementation, solid
        without a mask and dashed with the causal mask."""
        if not self.plt:
            return
        fig, axes = self.grid(len(panels), ncols)
        impls = set()
        for ax, (ptitle, lines) in zip(axes, panels):
            for (impl, mask) in sorted(lines, key=lambda k: (impl_key(k[0]), k[1] != "none")):
                pts = sorted(p for p in lines[(impl, mask)] if p[1] is not None)
                if not pts:
                    continue
                impls.add(impl)
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3,
                        color=COLORS.get(impl), linestyle="-" if mask == "none" else "--")
            ax.set_xscale("log", base=2)
            xs = sorted({p[0] for pts in lines.values() for p in pts})
            ax.set_xticks(xs)
            ax.set_xticklabels([str(x) for x in xs])
            ax.minorticks_off()
            ax.set_ylim(bottom=0)
            ax.set_title(ptitle)
            ax.set_xlabel(xlabel)
            ax.set_ylabel(unit)
            ax.grid(alpha=0.3)
        self.legend(fig, impls, [("-", "no mask"), ("--", "causal")])
        fig.suptitle(title)
        self.save(fig, name)

    def heatmap(self, name, title, panels):
        """panels: [(panel title, kvs, batches, {(kv, batch): ratio})]."""
        if not self.plt:
            return
        from matplotlib.colors import TwoSlopeNorm

        fig, axes = self.grid(len(panels), 3, w=4.4, h=3.4)
        values = [v for _, _, _, cells in panels for v in cells.values() if v is not None]
        lo, hi = min(values + [0.9]), max(values + [1.1])
        norm = TwoSlopeNorm(vcenter=1.0, vmin=min(lo, 0.99), vmax=max(hi, 1.01))
        image = None
        for ax, (ptitle, kvs, batches, cells) in zip(axes, panels):
            grid = [[cells.get((kv, b), float("nan")) for kv in kvs] for b in batches]
            image = ax.imshow(grid, cmap="RdYlGn", norm=norm, aspect="auto", origin="lower")
            for yi, b in enumerate(batches):
                for xi, kv in enumerate(kvs):
                    v = cells.get((kv, b))
                    if v is not None:
                        ax.text(xi, yi, f"{v:.2f}", ha="center", va="center", fontsize=7)
            ax.set_xticks(range(len(kvs)))
            ax.set_xticklabels([str(k) for k in kvs], rotation=45)
            ax.set_yticks(range(len(batches)))
            ax.set_yticklabels([str(b) for b in batches])
            ax.set_xlabel("keys per sequence (kv)")
            ax.set_ylabel("batch")
            ax.set_title(ptitle)
        fig.colorbar(image, ax=axes, label="best PyTorch time / candle-flash time")
        fig.suptitle(title)
        self.save(fig, name)


# ---------------------------------------------------------------------------------------------
# Workloads. Each returns (page section, README section); plots go through `plots`.


def prefill_gpu(name, rows, plots, title, flop_note):
    page, readme = [], []
    devices = by_device(rows)
    for device, drows in devices:
        suffix = "" if len(devices) == 1 else "-" + slug(device)
        shapes = defaultdict(dict)
        for r in drows:
            key = (r["dtype"], r["head_dim"], r["mask"], r["seq"], r["batch"], r["heads"],
                   r["kv_heads"])
            shapes[key][r["impl"]] = r
        page.append(f"### {device}\n")
        page.append(f"{flop_note} Plot: {img_link(name + suffix + '.svg', title)}\n")
        panels = []
        for dtype in sorted({k[0] for k in shapes}, key=dtype_key):
            keys = sorted((k for k in shapes if k[0] == dtype),
                          key=lambda k: (k[1], k[2] != "none", k[3]))
            dtype_rows = [r for k in keys for r in shapes[k].values()]
            others = sorted({r["impl"] for r in dtype_rows} - {"candle-flash"}, key=impl_key)
            body, ratios = [], []
            for k in keys:
                got = shapes[k]
                t = {i: got[i]["ms"] for i in got}
                cf = t.get("candle-flash")
                tb, _ = best_torch(t)
                rt = ratio(tb, cf)
                ratios.append((rt, k))
                tf = got.get("candle-flash", {}).get("tflops")
                heads = f"{k[5]}" if k[5] == k[6] else f"{k[5]}/{k[6]}"
                body.append([k[1], k[2], k[3], k[4], heads, fnum(cf), fnum(tf, 1)]
                            + [fnum(t.get(i)) for i in others] + [fratio(rt)])
            header = (["d", "mask", "seq", "batch", "heads", "candle-flash ms", "TFLOP/s"]
                      + [f"{i} ms" for i in others] + ["best torch / candle-flash"])
            page.append(f"**{dtype}** ({provenance(dtype_rows, device)})\n")
            page.append(table(header, body, ["r", "l"] + ["r"] * (len(header) - 2)) + "\n")
            have = [(r, k) for r, k in ratios if r is not None]
            if have:
                lo = min(have)
                page.append(f"Best PyTorch / candle-flash over {len(have)} shapes: median "
                            f"{fratio(median([r for r, _ in have]))}, lowest {fratio(lo[0])} "
                            f"(d {lo[1][1]}, {lo[1][2]}, seq {lo[1][3]}).\n")
            for d in sorted({k[1] for k in keys}):
                lines = defaultdict(list)
                for k in keys:
                    if k[1] != d:
                        continue
                    for impl, r in shapes[k].items():
                        lines[(impl, k[2])].append((k[3], r["tflops"]))
                panels.append((f"{dtype}, head_dim {d}", lines))
        ncols = max(len({k[1] for k in shapes if k[0] == dt}) for dt in {k[0] for k in shapes})
        plots.throughput(name + suffix + ".svg", f"{title}, {device}", panels, "TFLOP/s", ncols)
        readme.append(prefill_gpu_readme(shapes, device, title, name + suffix))
    return "\n".join(page), "\n".join(x for x in readme if x)


def prefill_gpu_readme(shapes, device, title, img):
    """Ratio per (head_dim, mask) and sequence length, for the first dtype with PyTorch rows."""
    with_torch = [k for k, got in shapes.items()
                  if "candle-flash" in got and best_torch({i: got[i]["ms"] for i in got})[0]]
    if not with_torch:
        return ""
    dtype = min({k[0] for k in with_torch}, key=dtype_key)
    keys = [k for k in with_torch if k[0] == dtype]
    seqs = sorted({k[3] for k in keys})
    rowkeys = sorted({(k[1], k[2]) for k in keys}, key=lambda x: (x[0], x[1] != "none"))
    body = []
    for d, mask in rowkeys:
        cells = []
        for s in seqs:
            ks = [k for k in keys if k[1] == d and k[2] == mask and k[3] == s]
            if not ks:
                cells.append("–")
                continue
            got = shapes[ks[0]]
            t = {i: got[i]["ms"] for i in got}
            cells.append(fratio(ratio(best_torch(t)[0], t["candle-flash"])))
        body.append([d, mask] + cells)
    rows = [r for k in keys for r in shapes[k].values()]
    return (f"**{title}**, {dtype}: best PyTorch time / candle-flash time per sequence length "
            f"({provenance(rows, device)}; [plot](docs/img/{img}.svg))\n\n"
            + table(["d", "mask"] + [str(s) for s in seqs], body, ["r", "l"] + ["r"] * len(seqs))
            + "\n")


def decode_section(name, rows, plots, cpu):
    page, readme = [], []
    devices = by_device(rows)
    for device, drows in devices:
        suffix = "" if len(devices) == 1 else "-" + slug(device)
        impls = sorted({r["impl"] for r in drows}, key=impl_key)
        # One result per (configuration, layout, shape, impl); PyTorch rows are compared with
        # candle-flash's in the same layout, else with its contiguous ones.
        cells = defaultdict(dict)
        for r in drows:
            cfg = (r["dtype"], r["heads"], r["kv_heads"], r["head_dim"])
            cells[(cfg, r["batch"], r["seq_q"], r["kv"])][(r["impl"], r["layout"])] = r
        configs = sorted({k[0] for k in cells}, key=lambda c: (dtype_key(c[0]), c[1:]))
        layouts = sorted({r["layout"] for r in drows}, key=lambda l: (l != "contiguous", l))
        # The copy bandwidth of a run: the highest any of its commands measured (PyTorch's
        # device copy beside candle's), so every row's share is of the same reference.
        run_ref = defaultdict(float)
        for r in drows:
            if r.get("ref_gbps") not in (None, ""):
                run_ref[r["date"]] = max(run_ref[r["date"]], float(r["ref_gbps"]))
        page.append(f"### {device}\n")
        summary, worst, big = [], [], []
        for cfg in configs:
            dtype, h, hk, d = cfg
            cfg_name = f"{dtype}, {h}/{hk} heads, d {d}"
            cfg_rows = [r for k, v in cells.items() if k[0] == cfg for r in v.values()]
            page.append(f"**{cfg_name}** ({provenance(cfg_rows, device)})\n")
            shape_keys = sorted(k for k in cells if k[0] == cfg)
            body = []
            heat = defaultdict(dict)
            for layout in layouts:
                rs, fr, nr = [], [], []
                for k in shape_keys:
                    got = cells[k]
                    cf = got.get(("candle-flash", layout))
                    if cf is None:
                        continue
                    t = {i: (got.get((i, layout)) or got.get((i, "contiguous")) or {}).get("us")
                         for i in impls}
                    tb, tb_impl = best_torch(t)
                    rt = ratio(tb, cf["us"])
                    frac = ratio(cf["gbps"], run_ref[cf["date"]] or cf["ref_gbps"])
                    naive = ratio(t.get("candle-naive"), cf["us"])
                    _, b, sq, kv = k
                    kv_bytes = 2 * b * kv * hk * d * ELEM_BYTES.get(dtype, 4)
                    row = [layout, b, sq, kv, fnum(cf["us"]), fnum(cf["gbps"], 1), fpct(frac)]
                    if cpu:
                        row += [fnum(t.get("candle-naive")), fratio(naive)]
                        row += [fnum(t.get(i)) for i in impls if i.startswith("torch")]
                        nr.append(naive)
                    else:
                        row += [fnum(t.get(i)) for i in impls
                                if i not in ("candle-flash",)] + [fratio(rt)]
                    body.append(row)
                    if rt is not None:
                        rs.append(rt)
                        worst.append((rt, cfg_name, layout, b, sq, kv, cf["us"], tb, tb_impl))
                        if layout == "contiguous":
                            heat[sq][(kv, b)] = rt
                    # The GPU's share of the reference counts only where the cache cannot sit
                    # in L2; the CPU's on every row.
                    if cpu or kv_bytes >= BIG_KV_BYTES:
                        fr.append(frac)
                    if not cpu and kv_bytes >= BIG_KV_BYTES:
                        big.append((cfg_name, layout, b, sq, kv, kv_bytes, frac))
                if rs or nr:
                    summary.append((cfg_name, layout, len(rs) or len(nr), rs, fr, nr))
            if cpu:
                header = ["layout", "batch", "seq_q", "kv", "candle-flash µs", "GB/s",
                          "of ref GB/s", "candle-naive µs", "naive / flash"]
                header += [f"{i} µs" for i in impls if i.startswith("torch")]
            else:
                header = ["layout", "batch", "seq_q", "kv", "candle-flash µs", "GB/s",
                          "of ref GB/s"] + [f"{i} µs" for i in impls if i != "candle-flash"]
                header += ["best torch / candle-flash"]
            page.append(table(header, body, ["l"] + ["r"] * (len(header) - 1)) + "\n")
            if heat and not cpu:
                img = f"{name}{suffix}-{slug(f'{dtype} h{h} kv{hk} d{d}')}.svg"
                seqs = sorted(heat)
                panels = []
                for sq in seqs:
                    kvs = sorted({kv for kv, _ in heat[sq]})
                    bs = sorted({b for _, b in heat[sq]})
                    panels.append((f"seq_q {sq}", kvs, bs, heat[sq]))
                plots.heatmap(img, f"Decode, {cfg_name}, contiguous cache: best PyTorch / "
                              f"candle-flash, {device}", panels)
                page.append(f"Heatmap of the ratio over (kv × batch), one panel per seq_q: "
                            f"{img_link(img, 'decode ratio heatmap ' + cfg_name)}\n")
        if cpu:
            head = ["configuration", "layout", "shapes", "of ref GB/s", "naive / flash"]
            short = [[c, l, n, span(fr, fpct), span(nr)] for c, l, n, rs, fr, nr in summary]
        else:
            head = ["configuration", "layout", "shapes", "lowest", "median",
                    "of ref GB/s, K+V ≥ 256 MB"]
            short = [[c, l, n, fratio(min(rs) if rs else None), fratio(median(rs)),
                      span(fr, fpct)] for c, l, n, rs, fr, nr in summary]
        page.append("**Summary**" + (" (best PyTorch / candle-flash)" if not cpu else "")
                    + "\n")
        page.append(table(head, short, ["l", "l"] + ["r"] * (len(head) - 2)) + "\n")
        if worst and not cpu:
            worst.sort(key=lambda w: (w[0], w[1:6]))
            body = [[c, l, b, sq, kv, fnum(us), f"{fnum(tb)} ({ti})", fratio(rt)]
                    for rt, c, l, b, sq, kv, us, tb, ti in worst[:10]]
            page.append("**Worst rows** (lowest best PyTorch / candle-flash)\n")
            page.append(table(["configuration", "layout", "batch", "seq_q", "kv",
                               "candle-flash µs", "best torch µs", "ratio"], body,
                              ["l", "l"] + ["r"] * 6) + "\n")
        if big and not cpu:
            body = [[c, l, b, sq, kv, f"{kb / 1e6:.0f}", fpct(f)]
                    for c, l, b, sq, kv, kb, f in sorted(big)]
            page.append("**Bandwidth where K+V ≥ 256 MB** (candle-flash GB/s as a fraction of "
                        "the reference bandwidth measured in the same run)\n")
            page.append(table(["configuration", "layout", "batch", "seq_q", "kv", "K+V MB",
                               "of ref GB/s"], body, ["l", "l"] + ["r"] * 5) + "\n")
        readme.append((device, drows, head, short))
    return "\n".join(page), readme


def cpu_prefill(rows, plots):
    page, readme = [], []
    devices = by_device(rows)
    for device, drows in devices:
        suffix = "" if len(devices) == 1 else "-" + slug(device)
        impls = sorted({r["impl"] for r in drows}, key=impl_key)
        others = [i for i in impls if i != "candle-flash"]
        shapes = defaultdict(dict)
        for r in drows:
            shapes[(r["pass"] != "forward", r["pass"], r["dtype"], r["mask"] != "none", r["mask"],
                    r["seq"], r["batch"], r["heads"], r["head_dim"])][r["impl"]] = r
        page.append(f"### {device}\n")
        img = f"cpu-prefill{suffix}.svg"
        page.append(f"GFLOP/s count `4·batch·heads·seq²·head_dim` for the forward and 2.5 times "
                    f"that for the backward, halved under the causal mask. The ratios are "
                    f"times: another implementation's time / candle-flash's. Plot: "
                    f"{img_link(img, 'CPU prefill GFLOP/s')}\n")
        short, panels = [], []
        for pkey in sorted({k[:3] for k in shapes}):
            _, pss, dtype = pkey
            keys = sorted(k for k in shapes if k[:3] == pkey)
            prow = [r for k in keys for r in shapes[k].values()]
            body = []
            for k in keys:
                got = shapes[k]
                cf = got.get("candle-flash", {})
                cells = [k[4], k[5], k[6], k[7], k[8], fnum(cf.get("ms")), fnum(cf.get("gflops"), 1)]
                for i in others:
                    o = got.get(i, {})
                    cells += [fnum(o.get("ms")), fratio(ratio(o.get("ms"), cf.get("ms")))]
                body.append(cells)
                short.append([pss, dtype, k[4], k[5], fnum(cf.get("gflops"), 1)]
                             + [fratio(ratio(got.get(i, {}).get("ms"), cf.get("ms")))
                                for i in others])
            header = ["mask", "seq", "batch", "heads", "d", "candle-flash ms", "GFLOP/s"]
            for i in others:
                header += [f"{i} ms", f"{i} / flash"]
            page.append(f"**{pss}, {dtype}** ({provenance(prow, device)})\n")
            page.append(table(header, body, ["l"] + ["r"] * (len(header) - 1)) + "\n")
            lines = defaultdict(list)
            for k in keys:
                for impl, r in shapes[k].items():
                    lines[(impl, k[4])].append((k[5], r["gflops"]))
            panels.append((f"{pss}, {dtype}", lines))
        plots.throughput(img, f"CPU prefill, {device}", panels, "GFLOP/s", 2)
        head = ["pass", "dtype", "mask", "seq", "candle-flash GFLOP/s"] + [
            f"{i} / flash" for i in others]
        readme.append((device, drows, head, short, img))
    return "\n".join(page), readme


def cpu_decode_plot(rows, plots):
    """GB/s against the cache length, lines per (impl, batch), the reference dashed."""
    if not plots.plt:
        return
    for device, drows in by_device(rows):
        devices = {r["device"] for r in rows}
        suffix = "" if len(devices) == 1 else "-" + slug(device)
        configs = sorted({(r["dtype"], r["heads"], r["kv_heads"], r["head_dim"], r["layout"],
                           r["seq_q"]) for r in drows}, key=lambda c: (dtype_key(c[0]), c[1:]))
        fig, axes = plots.grid(len(configs), 3)
        for ax, cfg in zip(axes, configs):
            sel = [r for r in drows if (r["dtype"], r["heads"], r["kv_heads"], r["head_dim"],
                                        r["layout"], r["seq_q"]) == cfg]
            lines = defaultdict(list)
            for r in sel:
                lines[(r["impl"], r["batch"])].append((r["kv"], r["gbps"]))
            for (impl, b) in sorted(lines, key=lambda k: (impl_key(k[0]), k[1])):
                pts = sorted(p for p in lines[(impl, b)] if p[1] is not None)
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3,
                        color=COLORS.get(impl), label=f"{impl}, batch {b}",
                        linestyle=STYLES[sorted({x[1] for x in lines}).index(b) % len(STYLES)])
            ref = median([r["ref_gbps"] for r in sel])
            if ref:
                ax.axhline(ref, color="black", linestyle="--", linewidth=0.8,
                           label="reference (copy)")
            ax.set_xscale("log", base=2)
            xs = sorted({r["kv"] for r in sel})
            ax.set_xticks(xs)
            ax.set_xticklabels([str(x) for x in xs])
            ax.minorticks_off()
            ax.set_ylim(bottom=0)
            ax.set_title(f"{cfg[0]}, {cfg[1]}/{cfg[2]} heads, d {cfg[3]}, {cfg[4]}, seq_q {cfg[5]}")
            ax.set_xlabel("keys per sequence (kv)")
            ax.set_ylabel("GB/s (K and V read once)")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        fig.suptitle(f"CPU decode, {device}")
        plots.save(fig, f"cpu-decode{suffix}.svg")


# ---------------------------------------------------------------------------------------------
# The page and the README block


INTRO = """# Benchmarks

Generated by `python3 bench/report.py` from the CSV files in
[bench/results/](../bench/results/); do not edit by hand. Each table names the device, date,
commit and command of its rows. History lives in git.

**Ratios** are "best PyTorch / candle-flash" on times: the time of the faster of PyTorch SDPA's
flash (FlashAttention-2) and cuDNN backends for the same shape, divided by candle-flash's. Above
1 candle-flash is faster. Absolute times move between runs and machines; ratios from one run
move less.

## Producing results

```bash
# CPU
cargo run --release --example cpu_bench -- --csv bench/results/cpu-prefill.csv
cargo run --release --example decode_bench -- --sweep
# GPU: build here, run there (PyTorch's rows appended to candle-flash's CSV in the same command)
scripts/gpu-pack.sh bench            # then, on the GPU machine:
bash scripts/gpu-run.sh prefill backward decode variants
# copy gpu-prefill.csv, gpu-backward.csv, gpu-decode.csv and gpu-variants.csv into
# bench/results/, then
python3 bench/report.py
```
"""

PREFILL_NOTE = ("Shapes of `examples/gpu_bench.rs`: hidden 2048 (heads = 2048 / head_dim), "
                "16384 tokens per batch (batch = 16384 / seq), q, k, v in `(batch, seq, heads, "
                "head_dim)` memory for candle-flash and `(batch, heads, seq, head_dim)` for "
                "PyTorch. TFLOP/s count `4·batch·heads·seq²·head_dim`, halved under the causal "
                "mask.")
BACKWARD_NOTE = ("The backward pass alone from a saved forward (`FlashAttn::backward`; PyTorch: "
                 "`torch.autograd.grad` of SDPA's output), on the forward's shapes. TFLOP/s "
                 "count 2.5 times the forward's flops (FlashAttention's convention). "
                 "`candle-flash-autograd` is the same pass through `loss.backward()`, "
                 "`candle-flash-portable` the kernels every non-Hopper GPU runs "
                 "(`FlashAttn::portable(true)`).")
DECODE_NOTE = ("Decode: `seq_q` query rows per sequence against a KV cache of `kv` keys, "
               "causal. GB/s count K and V read once in their dtype; \"of ref GB/s\" divides "
               "that by the copy bandwidth measured in the same run (`ref_gbps`). `paged16`: the "
               "cache in 16-row pages behind a shuffled block table.")

GPU_DECODE_SPREAD = ("On the H200 the same kernel at the same split count, timed in two runs "
                     "of one session, differed by up to 9% where K and V hold a gigabyte or more "
                     "(32/32 heads, batch 32, one split: kv 6000 775.8 and 714.9 µs, kv 16384 "
                     "2094.6 and 1922.1 µs): a single row's ratio to PyTorch moves by about as "
                     "much from run to run.")

RING_NOTE = ("`examples/long_context.rs`: one causal attention layer (bf16, 32/8 heads, d 128) "
             "sharded zigzag over N GPUs, K/V rotating over NCCL; the slowest rank's median "
             "time. Efficiency = single-GPU time / N / ring time.")
VARIANTS_NOTE = ("`examples/variants_bench.rs`: each variant's forward beside the plain forward on "
                 "the same inputs in one process, timed plain, variant, plain; the ratio divides "
                 "the variant's time by the mean of the two plain ones. Prefill: d 128, 16/8 "
                 "heads, 32k tokens per batch on the GPU, 1k on the CPU; decode: one query row, "
                 "32/8 heads, d 128. `pad-bias`: a `(batch, 1, 1, seq_k)` key-padding bias (its "
                 "last quarter of keys at -inf: the tiled kernels skip key tiles a key bias "
                 "hides, so it computes less than the plain call); `key-bias`: a `(batch, 1, 1, "
                 "seq_k)` bias of N(0, 1) values (the cost of adding a vector to every score); "
                 "`bias`: a full `(1, heads, seq_q, seq_k)` bias in the inputs' dtype (the note "
                 "gives the bandwidth at which it is read); `blocks`: a block mask of ones (the "
                 "same visible work; 64 x 64 blocks on the CPU, 128 x 128 on the GPU); "
                 "`sparse-p`: 128 x 128 blocks open at random with probability p, per head; "
                 "`docs-8`: 8 equal documents (1/8 of the blocks). The sparse rows' target is "
                 "a ratio of at most the visible fraction + 0.1.")


FLEX_NOTE = ("`bench/torch_flex.py`: PyTorch's FlexAttention (`torch.compile`d, bf16) on the "
             "same shapes and the same block masks (the same generator and seed), its time with "
             "the mask and its ratio to its own unmasked call (causal or not, as the row); "
             "empty where it was not run (it runs out of memory building 16k and 32k masks). "
             "Its rows come from their own run on the same GPU model (date and commit in "
             "bench/results/gpu-flex.csv).")


FP8_DECODE_NOTE = {
    "GPU": ("One decode step (causal) from an FP8 (e4m3) K/V cache with bf16 queries, "
            "beside the same step from a bf16 cache, timed in one command "
            "(`decode_bench --dtype bf16,f8e4m3`). GB/s counts the bytes the step must "
            "move (K and V at one byte each for FP8); % of copy is that over the 1 GiB "
            "device copy measured in the same run (read plus written)."),
    "CPU": ("One decode step (causal) from an FP8 (e4m3) K/V cache with bf16 queries beside the "
            "same step from a bf16 cache, in one command (`decode_bench --dtype bf16,f8e4m3`). "
            "The CPU reads FP8 K and V as stored and converts a block of 16 keys at a time to "
            "f32; the bf16 cache is read in place with bf16 dot products. GB/s counts the bytes "
            "the step must move (K and V at one byte each for FP8); % of reference is that over "
            "the multi-threaded sum measured in the same run."),
}


FP8_ACCURACY_NOTE = ("What FP8 loses (`examples/fp8_accuracy.rs`): the error of candle-flash's "
                     "output against f32 attention over the original f32 data (32/8 heads, d 128, "
                     "batch 2, causal), for inputs rounded to bf16 and for inputs quantized to "
                     "e4m3 with one scale per (sequence, K/V head) from their absolute maximum: "
                     "K and V only (`fp8-kv`, an FP8 cache) or q, k and v (`fp8`). `normal` is "
                     "N(0, 1); `outliers` multiplies one element in a thousand by 30.")


def variant_note(r):
    """The bias's read bandwidth, or a block-sparse row's target ratio."""
    v = r["variant"]
    if v == "bias":
        size = 4 if r["dtype"] == "f32" else 2
        gb = r["heads"] * r["seq_q"] * r["seq_k"] * size / 1e9
        return f"bias read at {gb / (r['variant_ms'] / 1e3):.0f} GB/s"
    if v.startswith("sparse-"):
        return f"target <= {float(v.split('-')[1]) + 0.1:.2f}"
    if v == "docs-8":
        return "target <= 0.23"
    return ""


def fp8_decode_section(where, page, readme):
    """The page's section (and the README's line) of decode from FP8 caches on `where` (GPU or
    CPU): each FP8 row beside the bf16 row of its shape."""
    name = f"{where.lower()}-fp8-decode"
    rows = read(name)
    page.append(f"## {where} decode from FP8 caches\n")
    if not rows:
        page.append(no_results(name))
        return
    page.append(FP8_DECODE_NOTE[where] + "\n")
    reference = "% of copy" if where == "GPU" else "% of reference"
    for device, drows in by_device(rows):
        shape = lambda r: (r["layout"], r["heads"], r["kv_heads"], r["head_dim"], r["batch"],
                           r["seq_q"], r["kv"])
        bf16 = {shape(r): r for r in drows if r["dtype"] == "bf16"}
        head = ["heads", "d", "batch", "seq_q", "kv", "bf16 µs", "FP8 µs", "bf16 / FP8",
                "FP8 GB/s", reference]
        body, speedups = [], []
        for r in sorted((r for r in drows if r["dtype"] == "f8e4m3"), key=shape):
            b = bf16.get(shape(r))
            up = b["us"] / r["us"] if b else None
            if up and r["kv"] >= 32768:
                speedups.append(up)
            body.append([f"{r['heads']}/{r['kv_heads']}", str(r["head_dim"]),
                         str(r["batch"]), str(r["seq_q"]), str(r["kv"]),
                         fnum(b["us"]) if b else "", fnum(r["us"]), fratio(up) if up else "",
                         fnum(r["gbps"]), fpct(r["gbps"] / r["ref_gbps"])])
        page.append(f"{provenance(drows, device)}\n\n" + table(head, body, ["r"] * 10) + "\n")
        if speedups:
            readme.append(f"**{where} decode from FP8 caches**: bf16-cache time / FP8-cache time "
                          f"at kv ≥ 32768, {span(speedups)} "
                          f"({provenance(drows, device)})\n")


FP8_PREFILL_NOTE = ("The forward with q, k and v all FP8 (e4m3, descales 1, bf16 output) beside "
                    "bf16 inputs, same shapes, same run (`examples/gpu_bench.rs --dtype "
                    "bf16,f8e4m3`). On Hopper, head dims that are multiples of 16 up to 128 run an "
                    "e4m3 wgmma kernel (`SM90_FP8_INSTANCES` in src/cuda/instances.rs; d 64 "
                    "zero-padded in its d 128 tiles); other head dims and GPUs convert to bf16 "
                    "per call.")


def fp8_prefill_section(page, readme):
    """The page's section (and the README's line) of the all-FP8 forward beside bf16."""
    rows = read("gpu-fp8-prefill")
    page.append("## GPU forward from FP8 inputs\n")
    if not rows:
        page.append(no_results("gpu-fp8-prefill"))
        return
    page.append(FP8_PREFILL_NOTE + "\n")
    for device, drows in by_device(rows):
        shape = lambda r: (r["head_dim"], r["seq"], r["batch"], r["heads"], r["mask"])
        bf16 = {shape(r): r for r in drows if r["dtype"] == "bf16"}
        head = ["d", "seq", "batch", "heads", "mask", "bf16 ms", "FP8 ms", "bf16 / FP8",
                "FP8 TFLOP/s"]
        body, ups = [], {}
        for r in sorted((r for r in drows if r["dtype"] == "f8e4m3"), key=shape):
            b = bf16.get(shape(r))
            up = b["ms"] / r["ms"] if b else None
            if up:
                ups.setdefault(r["head_dim"], []).append(up)
            body.append([str(r["head_dim"]), str(r["seq"]), str(r["batch"]), str(r["heads"]),
                         r["mask"], fnum(b["ms"]) if b else "", fnum(r["ms"]),
                         fratio(up) if up else "", fnum(r["tflops"])])
        page.append(f"{provenance(drows, device)}\n\n" + table(head, body, ["r"] * 9) + "\n")
        if ups:
            spans = ", ".join(f"d {d}: {span(v)}" for d, v in sorted(ups.items()))
            readme.append(f"**GPU forward from FP8 inputs**: bf16 time / FP8 time, {spans} "
                          f"({provenance(drows, device)})\n")


DECODE_SPLITS_NOTE = ("The decode planner's choice (`candle-flash`) beside every decode instance "
                      "of the head's width at 1 to 32 splits of the keys (`candle-flash-<instance>-"
                      "s<splits>`), bf16, contiguous caches, same run (`examples/decode_bench.rs "
                      "--instances .. --splits 1,2,3,4,6,8,12,16,32`): how far the plan of the rows' "
                      "commit is from the fastest alternative measured, and the data the "
                      "planner's costs are fitted on (src/cuda/decode/plan.rs). The best of some "
                      "60 timings per shape is biased low by their noise (about 2% per timing).")


def decode_splits_section(page):
    """The page's section on the decode planner against its measured alternatives."""
    name = "gpu-decode-splits"
    rows = read(name)
    page.append("## GPU decode planner against its alternatives\n")
    if not rows:
        page.append(no_results(name))
        return
    page.append(DECODE_SPLITS_NOTE + "\n")
    for device, drows in by_device(rows):
        shapes = defaultdict(dict)
        for r in drows:
            key = (r["heads"], r["kv_heads"], r["head_dim"], r["batch"], r["seq_q"], r["kv"])
            shapes[key][r["impl"]] = r["us"]
        configs = defaultdict(list)
        for key, t in shapes.items():
            alts = {k: v for k, v in t.items() if k != "candle-flash"}
            if "candle-flash" not in t or not alts:
                continue
            best = min(alts, key=alts.get)
            configs[key[:3]].append((t["candle-flash"] / alts[best], key, best, alts[best],
                                     t["candle-flash"]))
        head = ["heads", "d", "shapes", "plan / best (geomean)", "within 1.1", "worst",
                "worst shape (batch, seq_q, kv)", "plan µs", "best µs", "best alternative"]
        body = []
        for cfg in sorted(configs):
            v = sorted(configs[cfg], reverse=True)
            geo = math.exp(statistics.mean(math.log(x[0]) for x in v))
            w = v[0]
            body.append([f"{cfg[0]}/{cfg[1]}", str(cfg[2]), str(len(v)), f"{geo:.3f}",
                         str(sum(x[0] <= 1.1 for x in v)), f"{w[0]:.2f}",
                         f"{w[1][3]}, {w[1][4]}, {w[1][5]}", fnum(w[4]), fnum(w[3]),
                         w[2].removeprefix("candle-flash-")])
        align = ["l", "r", "r", "r", "r", "r", "l", "r", "r", "l"]
        page.append(f"{provenance(drows, device)}\n\n" + table(head, body, align) + "\n")


def no_results(name):
    return f"No results yet (bench/results/{name}.csv).\n"


def build(plots):
    page = [INTRO]
    readme = []

    rows = read("gpu-prefill")
    page.append("## GPU forward (prefill)\n")
    if rows:
        p, r = prefill_gpu("gpu-prefill", rows, plots, "GPU forward", PREFILL_NOTE)
        page.append(p)
        readme.append(r)
    else:
        page.append(no_results("gpu-prefill"))

    rows = read("gpu-backward")
    page.append("## GPU backward\n")
    if rows:
        p, r = prefill_gpu("gpu-backward", rows, plots, "GPU backward", BACKWARD_NOTE)
        page.append(p)
        readme.append(r)
    else:
        page.append(no_results("gpu-backward"))

    rows = read("gpu-decode")
    page.append("## GPU decode\n")
    if rows:
        page.append(DECODE_NOTE + " " + GPU_DECODE_SPREAD + "\n")
        p, r = decode_section("gpu-decode", rows, plots, cpu=False)
        page.append(p)
        for device, drows, head, body in r:
            readme.append(f"**GPU decode**: best PyTorch time / candle-flash time, lowest and "
                          f"median over the shapes, and candle-flash's share of the copy "
                          f"bandwidth where K+V ≥ 256 MB ({provenance(drows, device)})\n\n"
                          + table(head, body, ["l", "l"] + ["r"] * (len(head) - 2)) + "\n")
    else:
        page.append(no_results("gpu-decode"))
    decode_splits_section(page)

    rows = read("cpu-prefill")
    page.append("## CPU prefill (forward and backward)\n")
    if rows:
        p, r = cpu_prefill(rows, plots)
        page.append(p)
        for device, drows, head, body, img in r:
            readme.append(f"**CPU prefill**: candle-flash GFLOP/s, and other implementations' "
                          f"time / candle-flash's ({provenance(drows, device)}; "
                          f"[plot](docs/img/{img}))\n\n"
                          + table(head, body, ["l", "l", "l"] + ["r"] * (len(head) - 3)) + "\n")
    else:
        page.append(no_results("cpu-prefill"))

    rows = read("cpu-decode")
    page.append("## CPU decode\n")
    if rows:
        page.append(DECODE_NOTE + " On the CPU `candle-naive` is candle's matmul-softmax-matmul "
                    "with K and V repeated to the query heads outside the clock.\n")
        p, r = decode_section("cpu-decode", rows, plots, cpu=True)
        page.append(p)
        cpu_decode_plot(rows, plots)
        page.append(f"Plot: {img_link('cpu-decode.svg', 'CPU decode GB/s')}\n"
                    if len({x['device'] for x in rows}) == 1 else "")
        for device, drows, head, body in r:
            readme.append(f"**CPU decode**: candle-flash's share of the copy bandwidth and "
                          f"candle-naive's time / candle-flash's ({provenance(drows, device)})"
                          f"\n\n" + table(head, body, ["l", "l"] + ["r"] * (len(head) - 2))
                          + "\n")
    else:
        page.append(no_results("cpu-decode"))

    for name, where in (("gpu-variants", "GPU"), ("cpu-variants", "CPU")):
        rows = read(name)
        page.append(f"## Attention variants on the {where}\n")
        if not rows:
            page.append(no_results(name))
            continue
        page.append(VARIANTS_NOTE + "\n")
        # PyTorch FlexAttention on the same block masks, where it was run on the same GPU.
        flex = {}
        if where == "GPU":
            page.append(FLEX_NOTE + "\n")
            for f in read("gpu-flex") or []:
                flex[(f["device"], f["variant"], f["seq_q"], f["causal"])] = f
        for device, drows in by_device(rows):
            head = ["variant", "dtype", "heads", "batch", "seq_q", "seq_k", "causal", "plain ms",
                    "variant ms", "variant / plain", "note"]
            if flex:
                head += ["Flex variant ms", "Flex variant / plain"]
            body = []
            for r in drows:
                row = [r["variant"], r["dtype"], f"{r['heads']}/{r['kv_heads']}",
                       str(r["batch"]), str(r["seq_q"]), str(r["seq_k"]), r["causal"],
                       fnum(r["plain_ms"]), fnum(r["variant_ms"]), fratio(r["ratio"]),
                       variant_note(r)]
                if flex:
                    f = flex.get((device, r["variant"], r["seq_q"], r["causal"]))
                    row += [fnum(f["flex_variant_ms"]), fratio(f["flex_ratio"])] if f else ["", ""]
                body.append(row)
            page.append(f"{provenance(drows, device)}\n\n"
                        + table(head, body, ["l"] * 7 + ["r"] * 3 + ["l"] + ["r"] * (len(head) - 11))
                        + "\n")
            worst = ", ".join(
                f"{v} {fratio(max(r['ratio'] for r in drows if r['variant'] == v))}"
                for v in sorted({r["variant"] for r in drows}))
            readme.append(f"**Attention variants ({where})**: time with the variant / time "
                          f"without, the largest over the shapes: {worst} "
                          f"({provenance(drows, device)})\n")

    fp8_prefill_section(page, readme)
    for where in ("GPU", "CPU"):
        fp8_decode_section(where, page, readme)

    rows = read("fp8-accuracy")
    page.append("## FP8 accuracy\n")
    if rows:
        page.append(FP8_ACCURACY_NOTE + "\n")
        for device, drows in by_device(rows):
            head = ["inputs", "seq_q", "method", "RMSE", "RMSE / RMS(output)", "max abs error"]
            body = [[r["inputs"], str(r["seq_q"]), r["method"], f"{r['rmse']:.2e}",
                     f"{r['rel_rmse']:.2e}", f"{r['max_abs']:.2e}"] for r in drows]
            page.append(f"{provenance(drows, device)}\n\n"
                        + table(head, body, ["l", "r", "l", "r", "r", "r"]) + "\n")
    else:
        page.append(no_results("fp8-accuracy"))

    rows = read("gpu-ring")
    page.append("## Ring attention across GPUs\n")
    if rows:
        page.append(RING_NOTE + "\n")
        for device, drows in by_device(rows):
            head = ["GPUs", "seq", "fwd ms", "fwd+bwd ms", "tokens/s", "GiB/GPU", "1 GPU fwd ms",
                    "1 GPU fwd+bwd ms", "efficiency fwd", "efficiency fwd+bwd"]
            eff = lambda one, n, t: fpct(one / n / t) if one else ""
            # Lengths one GPU was not run at: its time derived from the longest length it was
            # run at (same layer), scaled by seq² (the attention's flops), marked *.
            def single(r, col):
                if r[col]:
                    return r[col], ""
                same = [x for x in drows if x[col] and all(
                    x[c] == r[c] for c in ("dtype", "heads", "kv_heads", "head_dim", "mask"))]
                if not same:
                    return None, ""
                base = max(same, key=lambda x: x["seq"])
                return base[col] * (r["seq"] / base["seq"]) ** 2, "*"
            body = []
            for r in sorted(drows, key=lambda r: (r["gpus"], r["seq"])):
                (f1, mf), (fb1, mfb) = single(r, "single_fwd_ms"), single(r, "single_fwd_bwd_ms")
                body.append([str(r["gpus"]), str(r["seq"]), fnum(r["fwd_ms"]),
                             fnum(r["fwd_bwd_ms"]), f"{r['tokens_per_s']:.0f}",
                             fnum(r["gib_per_gpu"]), fnum(f1) + mf if f1 else "",
                             fnum(fb1) + mfb if fb1 else "", eff(f1, r["gpus"], r["fwd_ms"]),
                             eff(fb1, r["gpus"], r["fwd_bwd_ms"])])
            page.append(f"{provenance(drows, device)}\n\n" + table(head, body, ["r"] * 10)
                        + "\n")
            if any("*" in x for row in body for x in row):
                page.append("\\* not run on one GPU: derived from the single-GPU time at the "
                            "longest length it was run at, scaled by seq² (the attention's "
                            "flops); the longest length run on the ring is that table's last "
                            "row.\n")
            checks = [r for r in drows if r["diff_out"]]
            if checks:
                page.append("Largest difference to the single-GPU op (out / lse / dq / dk / dv) "
                            "and rerun: " + "; ".join(
                                f"{r['gpus']} GPUs, seq {r['seq']}: {r['diff_out']} / "
                                f"{r['diff_lse']} / {r['diff_dq']} / {r['diff_dk']} / "
                                f"{r['diff_dv']}, bitwise identical {r['rerun_identical']}"
                                for r in checks) + "\n")
    else:
        page.append(no_results("gpu-ring"))

    page_text = "\n".join(x.rstrip("\n") + "\n" for x in page if x)
    block = "\n".join(x.rstrip("\n") + "\n" for x in readme if x)
    block += ("\nEvery table, with the times: [docs/benchmarks.md](docs/benchmarks.md) "
              "(`python3 bench/report.py` regenerates it and this block from "
              "[bench/results/](bench/results/)).\n")
    return page_text, block


def splice(readme, block):
    start, end = readme.find(BEGIN), readme.find(END)
    if start < 0 or end < start:
        sys.exit(f"README.md has no {BEGIN} ... {END} block")
    return readme[: start + len(BEGIN)] + "\n" + block + readme[end:]


def main():
    ap = argparse.ArgumentParser(description="Regenerate docs/benchmarks.md, docs/img/ and the "
                                 "README's performance block from bench/results/*.csv.")
    ap.add_argument("--check", action="store_true",
                    help="write nothing; exit 1 if the page or the README block is out of date")
    args = ap.parse_args()
    plots = Plots(enabled=not args.check)
    page, block = build(plots)
    with open(README) as f:
        old_readme = f.read()
    new_readme = splice(old_readme, block)
    old_page = open(PAGE).read() if os.path.exists(PAGE) else None
    if args.check:
        stale = [n for n, o, w in (("docs/benchmarks.md", old_page, page),
                                   ("README.md", old_readme, new_readme)) if o != w]
        if stale:
            print(f"out of date: {', '.join(stale)}; run python3 bench/report.py")
            return 1
        print("docs/benchmarks.md and the README block are up to date")
        return 0
    plots.remove_stale()
    os.makedirs(os.path.dirname(PAGE), exist_ok=True)
    with open(PAGE, "w") as f:
        f.write(page)
    with open(README, "w") as f:
        f.write(new_readme)
    print(f"wrote docs/benchmarks.md, README.md's performance block"
          + (f" and {len(plots.written)} plots in docs/img/" if plots.written else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
