"""PyTorch SDPA on the decode shapes of a candle-flash sweep, for a side-by-side in one command.

Reads the shapes (heads, kv_heads, head_dim, batch, seq_q, kv, dtype, layout) of the
`candle-flash` rows of a CSV written by `decode_bench --sweep --csv` and appends PyTorch's flash
and cuDNN backends' rows to it, in the same columns (impl `torch-flash`, `torch-cudnn`):

    python3 bench/torch_decode.py bench/results/gpu-decode.csv

Timing as decode_bench times candle-flash: CUDA events around a batch of back-to-back calls,
median of several batches after a warm-up, rotating over as many input sets as cover twice the
L2 (at most 512), so no call finds its K and V already cached. q, k, v are (batch, heads, seq, head_dim) contiguous
(PyTorch's native layout) with native GQA (`enable_gqa=True`, K/V not repeated). PyTorch has no
paged KV cache: `paged16` rows are timed on the contiguous cache, the alternative a PyTorch user
has. The mask: none (a decode query, the last of its sequence, sees every key; with several query
rows the causal corner is a handful of keys, and `is_causal` would align top-left). Bytes counted
as decode_bench counts them: K and V once, q and the output once.
"""
import argparse
import os
import csv
import statistics

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

SHAPE = ("heads", "kv_heads", "head_dim", "batch", "seq_q", "kv", "dtype", "layout")
# decode_bench's GPU_CACHE_BYTES and MAX_SETS: the input sets of a row cover twice this.
L2_BYTES = 50_000_000
MAX_SETS = 512


def timed(fns, reps=7, inner=20):
    """Median microseconds per call of `inner` back-to-back calls cycling through `fns`."""
    for f in fns:
        f()
    inner = max(inner, len(fns))
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for i in range(inner):
            fns[i % len(fns)]()
        b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b) / inner * 1e3)
    return statistics.median(out)


def ref_gbps():
    """Device-to-device copy of 1 GiB, bytes read plus written, as decode_bench measures it."""
    n = 256 << 20
    src = torch.ones(n, dtype=torch.float32, device="cuda")
    dst = torch.empty_like(src)
    us = timed([lambda: dst.copy_(src)], reps=5, inner=5)
    return 2 * n * 4 / (us * 1e-6) / 1e9


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv", help="decode_bench's CSV; PyTorch's rows are appended to it")
    args = ap.parse_args()
    with open(args.csv, newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows:
        raise SystemExit(f"{args.csv}: no rows")
    head = rows[0]
    shapes = []
    for r in rows:
        if r["impl"] != "candle-flash":
            continue
        s = tuple(r[c] for c in SHAPE)
        if s not in shapes:
            shapes.append(s)
    # The commit of candle-flash's rows: this script runs beside them, from the same tree.
    commit = head["commit"]
    device = torch.cuda.get_device_name()
    command = f"torch_decode.py {os.path.basename(args.csv)} (torch {torch.__version__})"
    bw = ref_gbps()
    dtypes = {"bf16": torch.bfloat16, "f16": torch.float16}
    # PyTorch times a paged row on the contiguous cache: the same shape in another layout reuses
    # its times. Rows are appended as they come, so a run cut short keeps what it measured.
    timed_us = {}
    with open(args.csv, "a", newline="") as f:
        w = csv.writer(f)
        for heads, kvh, d, b, sq, kv, dt, layout in shapes:
            h, hk, d, b, sq, kv = map(int, (heads, kvh, d, b, sq, kv))
            key = (h, hk, d, b, sq, kv, dt)
            if key not in timed_us:
                timed_us[key] = time_backends(h, hk, d, b, sq, kv, dtypes[dt])
            nbytes = step_bytes(h, hk, d, b, sq, kv)
            for name, us in timed_us[key].items():
                gbps = nbytes / (us * 1e-6) / 1e9
                w.writerow([head["date"], commit, device, command, name, dt, layout, h, hk, d, b,
                            sq, kv, f"{us:.2f}", f"{gbps:.1f}", f"{bw:.1f}"])
                print(f"{name} {h}/{hk} d {d} b {b} sq {sq} kv {kv} {dt} {layout}: {us:.1f} us "
                      f"{gbps:.0f} GB/s", flush=True)
            f.flush()


def step_bytes(h, hk, d, b, sq, kv):
    """Bytes one decode step must move (2-byte elements): K and V read once, q read and the
    output written."""
    return 2 * b * hk * kv * d * 2 + 2 * b * h * sq * d * 2


def time_backends(h, hk, d, b, sq, kv, t):
    """Microseconds of one call per backend that takes the shape (flash, cuDNN)."""
    sets = min(MAX_SETS, -(-2 * L2_BYTES // step_bytes(h, hk, d, b, sq, kv)))
    inputs = [(torch.randn(b, h, sq, d, dtype=t, device="cuda"),
               torch.randn(b, hk, kv, d, dtype=t, device="cuda"),
               torch.randn(b, hk, kv, d, dtype=t, device="cuda")) for _ in range(sets)]
    times = {}
    for name, be in (("torch-flash", SDPBackend.FLASH_ATTENTION),
                     ("torch-cudnn", SDPBackend.CUDNN_ATTENTION)):
        try:
            with sdpa_kernel(be):
                fns = [lambda x=x: F.scaled_dot_product_attention(*x, enable_gqa=True)
                       for x in inputs]
                times[name] = timed(fns)
        except RuntimeError as e:  # a backend that refuses the shape
            print(f"{name} {h}/{hk} d {d} b {b} sq {sq} kv {kv}: refused "
                  f"({str(e).splitlines()[0][:80]})")
    del inputs
    torch.cuda.empty_cache()
    return times


if __name__ == "__main__":
    main()
