#!/usr/bin/env python3
"""PyTorch's CPU scaled_dot_product_attention on the shapes of `cpu_bench`: batch 1, 8 heads,
head dims 64 and 128, n = 1024 and 4096, causal or not, forward (and with --backward the
backward of sum(out * g)), in bf16 and f32, on a fixed number of threads.

    python3 bench/torch_cpu.py --threads 2
    python3 bench/torch_cpu.py --threads 2 --backward --csv torch-cpu.csv

GF/s counts 4 * b * h * n^2 * d flops (halved under the causal mask; 2.5 times that for the
backward pass), as cpu_bench does. Each timing is the median of --reps runs after one warm-up.
Inputs are (b, h, n, d) contiguous, as SDPA takes them.
"""

import argparse
import csv
import statistics
import sys
import time

import torch
import torch.nn.functional as F


def timed(fn, reps):
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--n", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--dtype", nargs="+", default=["f32", "bf16"], choices=["f32", "bf16", "f16"])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--backward", action="store_true")
    ap.add_argument("--csv", help="also write one row per measurement")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    dtypes = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
    h = args.heads
    rows = []
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"{'backward' if args.backward else 'forward'}, batch 1, {h} heads; "
        f"CPU capability {torch.backends.cpu.get_cpu_capability()}"
    )
    print("| d | n | mask | dtype | ms | GF/s | x f32 |")
    print("|---|---|---|---|---:|---:|---:|")
    for d in args.head_dim:
        for n in args.n:
            gen = torch.Generator().manual_seed(n * 1000 + d)
            base = [torch.randn(1, h, n, d, generator=gen) for _ in range(4)]
            for causal in (False, True):
                flops = 4.0 * h * n * n * d * (0.5 if causal else 1.0)
                if args.backward:
                    flops *= 2.5
                f32_gfs = None
                for name in ["f32"] + [x for x in args.dtype if x != "f32"]:
                    dt = dtypes[name]
                    q, k, v, g = (t.to(dt) for t in base)
                    if args.backward:
                        q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
                        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)

                        def run():
                            torch.autograd.grad(out, (q, k, v), g, retain_graph=True)

                    else:

                        def run():
                            with torch.no_grad():
                                F.scaled_dot_product_attention(q, k, v, is_causal=causal)

                    t = timed(run, args.reps)
                    gfs = flops / t / 1e9
                    if name == "f32":
                        f32_gfs = gfs
                    ratio = gfs / f32_gfs
                    mask = "causal" if causal else "none"
                    print(f"| {d} | {n} | {mask} | {name} | {t * 1e3:.1f} | {gfs:.1f} | {ratio:.2f}x |")
                    sys.stdout.flush()
                    rows.append(
                        {
                            "impl": "torch-sdpa-cpu",
                            "dtype": name,
                            "d": d,
                            "seq": n,
                            "batch": 1,
                            "heads": h,
                            "causal": str(causal).lower(),
                            "ms": f"{t * 1e3:.4f}",
                            "tflops": f"{gfs / 1e3:.6f}",
                            "note": f"{args.threads} threads",
                            "pass": "backward" if args.backward else "forward",
                            "gflops": f"{gfs:.2f}",
                            "x_f32": f"{ratio:.3f}",
                        }
                    )
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0].keys()))
            w.writeheader()
            w.writerows(rows)
        print(f"CSV written to {args.csv}")


if __name__ == "__main__":
    main()
