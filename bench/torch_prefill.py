#!/usr/bin/env python3
"""PyTorch scaled_dot_product_attention on the shapes of examples/gpu_bench.rs, forward or backward.

bf16 and f16, head dims 64 and 128, seq 512 / 2048 / 8192 / 16384, no mask and causal, hidden
2048 (heads = 2048 / d), 16k tokens per batch (batch = 16384 / seq), with SDPA's flash (FA2) and
cuDNN backends. Each time is the median over batches of back-to-back calls timed with CUDA
events, after warm-up, for as long as gpu_bench times each shape (--budget, 0.4 s as there).

    python3 bench/torch_prefill.py [--quick] [--budget S] [--csv PATH] [--shape D:SEQ] [--layout L]
    python3 bench/torch_prefill.py --backward [--quick] [--budget S] [--csv PATH] [--shape D:SEQ]

--backward times the backward pass only: torch.autograd.grad of one forward graph (kept with
retain_graph) with a random dO, what gpu_bench --backward times with FlashAttn::backward.
--quick: seq 2048 and 8192 only (and bf16 only with --backward), a 0.15 s budget.
--shape D:SEQ: only that head dim (dividing 2048) and sequence length.
--layout bhsd (default) gives q, k and v in (b, h, s, d) memory, SDPA's own layout; bshd gives
them in (b, s, h, d) memory, gpu_bench's default, as transpose(1, 2) views (impl names then end
in -bshd).

--csv PATH writes the timings in the gpu-prefill schema (gpu-backward with --backward) that
bench/report.py reads: date,commit,device,command, then
impl,dtype,mask,batch,seq,heads,kv_heads,head_dim,ms,tflops (impl torch-flash or torch-cudnn;
mask none or causal; ms and tflops empty where the backend refused the shape). TFLOP/s counts
4*b*h*s^2*d for the forward and 2.5 times that for the backward (FlashAttention's convention),
halved under the causal mask. The commit is $BENCH_COMMIT when set (a packed run away from the
checkout), else `git rev-parse --short HEAD`. --append adds the rows to an existing file of
the same columns (the one gpu_bench --csv wrote) instead of replacing it.
"""
import argparse
import csv
import datetime
import math
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

HIDDEN, TOKENS = 2048, 16384
COLUMNS = ["impl", "dtype", "mask", "batch", "seq", "heads", "kv_heads", "head_dim", "ms", "tflops"]
BACKENDS = [("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)]


def bench(fn, budget):
    """Seconds per call, by examples/gpu_bench.rs's method and time budget: two warm-up calls,
    then batches of back-to-back calls (~20 ms each) between CUDA events, the median batch (at
    least 5, until `budget` seconds or 30). The same budget as gpu_bench matters: under the
    board's power cap, the clock a kernel runs at depends on how long it has been running."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    per_batch = max(1, min(200, math.ceil(20.0 / start.elapsed_time(end))))
    times = []
    t0 = time.perf_counter()
    while len(times) < 5 or (time.perf_counter() - t0 < budget and len(times) < 30):
        start.record()
        for _ in range(per_batch):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / per_batch)
    return statistics.median(times)


def commit():
    """$BENCH_COMMIT, else the checkout's short hash (with -dirty for uncommitted changes)."""
    if os.environ.get("BENCH_COMMIT"):
        return os.environ["BENCH_COMMIT"]

    def git(*args):
        try:
            r = subprocess.run(["git", *args], capture_output=True, text=True, check=True)
            return r.stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return None

    c = git("rev-parse", "--short", "HEAD")
    if c is None:
        return "unknown"
    return c + "-dirty" if git("status", "--porcelain", "--untracked-files=no") else c


class Results:
    """The CSV file of --csv (or nothing): the four provenance columns, then COLUMNS."""

    def __init__(self, path, append):
        header = ["date", "commit", "device", "command", *COLUMNS]
        if path and append and os.path.exists(path) and os.path.getsize(path) > 0:
            with open(path, newline="") as f:
                found = next(csv.reader(f), None)
            if found != header:
                sys.exit(f"--append: {path} has the columns {found}, not {header}")
            self.file = open(path, "a", newline="")
        else:
            self.file = open(path, "w", newline="") if path else None
            if self.file:
                csv.writer(self.file, lineterminator="\n").writerow(header)
        if self.file:
            self.writer = csv.writer(self.file, lineterminator="\n")
            # Absolute paths name the machine that ran it: file names only.
            local = [os.path.basename(a) if os.path.isabs(a) else a for a in sys.argv[1:]]
            command = " ".join(["python3", os.path.basename(sys.argv[0]), *local])
            today = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
            self.prefix = [today, commit(), torch.cuda.get_device_name(), command]

    def row(self, values):
        if self.file:
            self.writer.writerow(self.prefix + [str(v) for v in values])
            self.file.flush()  # a run stopped at a time limit keeps what it measured


def shapes(args, seqs):
    """(head dim, seq) pairs of the run."""
    if args.shape:
        d, s = (int(x) for x in args.shape.split(":"))
        if HIDDEN % d or s <= 0:
            sys.exit(f"--shape {args.shape}: the head dim must divide {HIDDEN}")
        return [(d, s)]
    return [(d, s) for d in (64, 128) for s in seqs]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer shapes, shorter timing")
    ap.add_argument("--csv", metavar="PATH", help="write the timings as CSV (bench/report.py)")
    ap.add_argument("--append", action="store_true",
                    help="with --csv: add to the file (gpu_bench's rows) instead of replacing it")
    ap.add_argument("--backward", action="store_true", help="time the backward pass instead")
    ap.add_argument("--shape", metavar="D:SEQ", help="only this head dim and sequence length")
    ap.add_argument("--layout", choices=("bhsd", "bshd"), default="bhsd",
                    help="forward: q, k, v in (b, h, s, d) memory (SDPA's, default) or in (b, s, h, d) "
                    "memory (gpu_bench's default) passed as transpose(1, 2) views")
    ap.add_argument("--budget", type=float, default=0.4,
                    help="seconds of timed batches per shape (gpu_bench's --budget; --quick: 0.15)")
    args = ap.parse_args()
    seqs = [2048, 8192] if args.quick else [512, 2048, 8192, 16384]
    budget = 0.15 if args.quick else args.budget
    pass_name = "backward" if args.backward else "forward"
    dtypes = (torch.bfloat16,) if args.quick and args.backward else (torch.bfloat16, torch.float16)
    layout = "bhsd" if args.backward else args.layout
    suffix = "-bshd" if layout == "bshd" else ""
    out = Results(args.csv, args.append)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, {pass_name}, "
          f"q/k/v in {layout} memory")
    print(f"{'backend':<8} {'dtype':<6} {'d':>4} {'seq':>6} {'mask':>7} {'ms':>9} {'TFLOP/s':>9}")
    for name, backend in BACKENDS:
        for dtype in dtypes:
            dname = "bf16" if dtype == torch.bfloat16 else "f16"
            for d, s in shapes(args, seqs):
                for causal in (False, True):
                    b, h = max(1, TOKENS // s), HIDDEN // d
                    mask = "causal" if causal else "none"
                    flops = 4 * b * h * s * s * d / (2 if causal else 1)
                    if args.backward:
                        flops *= 2.5
                    # The same element count as gpu_bench's (b, s, h, d) tensors.
                    if layout == "bhsd":
                        make = lambda: torch.randn(b, h, s, d, device="cuda", dtype=dtype)
                    else:
                        make = lambda: torch.randn(b, s, h, d, device="cuda", dtype=dtype).transpose(1, 2)
                    q, k, v = make(), make(), make()
                    try:
                        with sdpa_kernel([backend]):
                            if args.backward:
                                q, k, v = (x.requires_grad_() for x in (q, k, v))
                                o = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                                do = torch.randn_like(o)
                                t = bench(lambda: torch.autograd.grad(o, (q, k, v), do, retain_graph=True),
                                          budget)
                            else:
                                t = bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
                                          budget)
                        tf = flops / t / 1e12
                        print(f"{name:<8} {dname:<6} {d:>4} {s:>6} {mask:>7} {t * 1e3:>9.3f} {tf:>9.1f}")
                        ms, tflops = f"{t * 1e3:.4f}", f"{tf:.3f}"
                    except RuntimeError as e:
                        why = str(e).splitlines()[0]
                        print(f"{name:<8} {dname:<6} {d:>4} {s:>6} {mask:>7} unavailable: {why}")
                        ms, tflops = "", ""
                    out.row([f"torch-{name}{suffix}", dname, mask, b, s, h, h, d, ms, tflops])
                    q = k = v = o = do = None
    if args.csv:
        print(f"CSV written to {args.csv}")


if __name__ == "__main__":
    main()
