#!/usr/bin/env python3
"""PyTorch scaled_dot_product_attention forward TFLOP/s on the shapes of examples/gpu_bench.rs.

bf16 and f16, head dims 64 and 128, seq 512/2048/8192/16384, causal and not, hidden 2048
(heads = 2048 / d), 16k tokens per batch (batch = 16384 / seq), with the flash (FA2) and cuDNN
backends. TFLOP/s counts 4*b*h*s^2*d, halved when causal; each time is the median over batches
of back-to-back calls timed with CUDA events, after warm-up, for as long as gpu_bench times each
shape (--budget, default 0.4 s as there). Lines starting with RESULT are parsed by
scripts/gpu-run.sh.

    python3 scripts/sdpa_bench.py [--quick] [--budget S] [--csv PATH] [--shape D:SEQ] [--layout L]
    python3 scripts/sdpa_bench.py --backward [--quick] [--budget S]

--backward times the backward pass only (--quick: bf16 only) (torch.autograd.grad of one forward graph, kept with
retain_graph, with a random dO) on the same shapes, flash and cuDNN backends, TFLOP/s counting
2.5x the forward's flops (FA's convention); lines start with RESULT_BWD.

--shape D:SEQ restricts the forward to that head dim (dividing 2048) and sequence length.

--layout bhsd (default) gives the forward q, k and v in (b, h, s, d) memory, SDPA's own layout;
--layout bshd gives them in (b, s, h, d) memory, examples/gpu_bench.rs's default, as
transpose(1, 2) views; their CSV rows name the impl torch-flash-bshd or torch-cudnn-bshd.

--csv PATH also writes every timing as CSV, in the prefill schema of scripts/plot.py
(impl,dtype,d,seq,batch,heads,causal,ms,tflops,note; impl torch-flash or torch-cudnn, -bshd
appended under --layout bshd).
"""
import argparse
import csv
import math
import statistics
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

HIDDEN, TOKENS = 2048, 16384


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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--csv", metavar="PATH", help="also write the timings as CSV (scripts/plot.py)")
    ap.add_argument("--backward", action="store_true", help="time the backward pass instead")
    ap.add_argument("--shape", metavar="D:SEQ", help="forward: only this head dim and sequence length")
    ap.add_argument("--layout", choices=("bhsd", "bshd"), default="bhsd",
                    help="forward: q, k, v in (b, h, s, d) memory (SDPA's, default) or in (b, s, h, d) "
                    "memory (gpu_bench's default) passed as transpose(1, 2) views")
    ap.add_argument("--budget", type=float, default=0.4,
                    help="seconds of timed batches per shape (gpu_bench's --budget; --quick: 0.15)")
    args = ap.parse_args()
    if args.backward:
        return backward(args)
    rows = []
    seqs = [2048, 8192] if args.quick else [512, 2048, 8192, 16384]
    dims = (64, 128)
    if args.shape:
        d, s = (int(x) for x in args.shape.split(":"))
        dims, seqs = (d,), [s]
    budget = 0.15 if args.quick else args.budget
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, q/k/v in {args.layout} memory")
    print(f"{'backend':<8} {'dtype':<6} {'d':>4} {'seq':>6} {'causal':>7} {'ms':>9} {'TFLOP/s':>9}")
    backends = [("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)]
    suffix = "-bshd" if args.layout == "bshd" else ""
    for name, backend in backends:
        for dtype in (torch.bfloat16, torch.float16):
            dname = "bf16" if dtype == torch.bfloat16 else "f16"
            for d in dims:
                for s in seqs:
                    for causal in (False, True):
                        b, h = max(1, TOKENS // s), HIDDEN // d
                        # (b, h, s, d) is SDPA's layout; same element count as ours.
                        if args.layout == "bhsd":
                            q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=dtype) for _ in range(3))
                        else:
                            q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=dtype).transpose(1, 2)
                                       for _ in range(3))
                        flops = 4 * b * h * s * s * d / (2 if causal else 1)
                        try:
                            with sdpa_kernel([backend]):
                                t = bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal), budget)
                            tf = flops / t / 1e12
                            print(f"{name:<8} {dname:<6} {d:>4} {s:>6} {str(causal):>7} {t * 1e3:>9.3f} {tf:>9.1f}")
                            print(f"RESULT torch_{name} {dname} {d} {s} {str(causal).lower()} {tf:.2f}")
                            rows.append([f"torch-{name}{suffix}", dname, d, s, b, h, str(causal).lower(),
                                         f"{t * 1e3:.4f}", f"{tf:.3f}", ""])
                        except RuntimeError as e:
                            why = str(e).splitlines()[0]
                            print(f"{name:<8} {dname:<6} {d:>4} {s:>6} {str(causal):>7} unavailable: {why}")
                            rows.append([f"torch-{name}{suffix}", dname, d, s, b, h, str(causal).lower(),
                                         "", "", f"unavailable: {why}"])
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["impl", "dtype", "d", "seq", "batch", "heads", "causal", "ms", "tflops", "note"])
            w.writerows(rows)
        print(f"CSV written to {args.csv}")


def backward(args):
    """Backward-only TFLOP/s (2.5x the forward's flops) of SDPA flash and cuDNN."""
    seqs = [2048, 8192] if args.quick else [512, 2048, 8192, 16384]
    budget = 0.15 if args.quick else args.budget
    dtypes = (torch.bfloat16,) if args.quick else (torch.bfloat16, torch.float16)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, backward")
    print(f"{'backend':<8} {'dtype':<6} {'d':>4} {'seq':>6} {'causal':>7} {'ms':>9} {'TFLOP/s':>9}")
    backends = [("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)]
    for name, backend in backends:
        for dtype in dtypes:
            dname = "bf16" if dtype == torch.bfloat16 else "f16"
            for d in (64, 128):
                for s in seqs:
                    for causal in (False, True):
                        b, h = TOKENS // s, HIDDEN // d
                        q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=dtype, requires_grad=True)
                                   for _ in range(3))
                        do = torch.randn(b, h, s, d, device="cuda", dtype=dtype)
                        flops = 2.5 * 4 * b * h * s * s * d / (2 if causal else 1)
                        try:
                            with sdpa_kernel([backend]):
                                out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                                t = bench(lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True), budget)
                            tf = flops / t / 1e12
                            print(f"{name:<8} {dname:<6} {d:>4} {s:>6} {str(causal):>7} {t * 1e3:>9.3f} {tf:>9.1f}")
                            print(f"RESULT_BWD torch_{name} {dname} {d} {s} {str(causal).lower()} {tf:.2f}")
                        except RuntimeError as e:
                            why = str(e).splitlines()[0]
                            print(f"{name:<8} {dname:<6} {d:>4} {s:>6} {str(causal):>7} unavailable: {why}")
                        del q, k, v, do
                        out = None


if __name__ == "__main__":
    main()
