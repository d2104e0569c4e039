#!/usr/bin/env python3
"""PyTorch's CPU scaled_dot_product_attention on the shapes of `cpu_bench`: batch 1, 8 heads,
head dims 64 and 128, n = 1024 and 4096, causal or not, forward (and with --backward the
backward of sum(out * g)), in bf16 and f32, on a fixed number of threads.

    python3 bench/torch_cpu.py --threads 2
    python3 bench/torch_cpu.py --threads 2 --backward --append --csv bench/results/cpu-prefill.csv

GF/s counts 4 * b * h * n^2 * d flops (halved under the causal mask; 2.5 times that for the
backward pass), as cpu_bench does. Each timing is the median of --reps runs after one warm-up.
Inputs are (b, h, n, d) contiguous, as SDPA takes them.

--csv PATH writes the rows (impl torch-cpu) in the cpu-prefill schema that bench/report.py
reads and `cpu_bench --csv` writes: date,commit,device,command, then
impl,dtype,pass,mask,batch,seq,heads,head_dim,ms,gflops,kv_heads,path,x_f32 (path empty).
--append adds them to such a file (cpu_bench's, of the same run) instead of replacing it. The
commit is $BENCH_COMMIT when set, else `git rev-parse --short HEAD`; the device is the CPU's
model name and thread count, as cpu_bench writes it.
"""

import argparse
import csv
import datetime
import os
import statistics
import subprocess
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


COLUMNS = ["impl", "dtype", "pass", "mask", "batch", "seq", "heads", "head_dim", "ms", "gflops",
           "kv_heads", "path", "x_f32"]


def provenance():
    """date, commit, device and command of the rows, as examples/common/results.rs writes them."""
    commit = os.environ.get("BENCH_COMMIT")
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                    text=True, check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            commit = "unknown"
    model = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    today = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    command = " ".join(["python3", os.path.basename(sys.argv[0]), *sys.argv[1:]])
    return [today, commit, f"{model} ({os.cpu_count()} threads)", command]


def write_csv(path, append, rows):
    header = ["date", "commit", "device", "command", *COLUMNS]
    if append and os.path.exists(path) and os.path.getsize(path) > 0:
        with open(path, newline="") as f:
            found = next(csv.reader(f), None)
        if found != header:
            sys.exit(f"--append: {path} has the columns {found}, not {header}")
        mode = "a"
    else:
        mode = "w"
    with open(path, mode, newline="") as f:
        w = csv.writer(f, lineterminator="\n")
        if mode == "w":
            w.writerow(header)
        prov = provenance()
        for r in rows:
            w.writerow(prov + [r[c] for c in COLUMNS])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--n", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--dtype", nargs="+", default=["f32", "bf16"], choices=["f32", "bf16", "f16"])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--backward", action="store_true")
    ap.add_argument("--csv", help="also write one row per measurement (see the module docs)")
    ap.add_argument("--append", action="store_true", help="add the rows to an existing --csv file")
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
                            "impl": "torch-cpu",
                            "dtype": name,
                            "pass": "backward" if args.backward else "forward",
                            "mask": mask,
                            "batch": 1,
                            "seq": n,
                            "heads": h,
                            "head_dim": d,
                            "ms": f"{t * 1e3:.4f}",
                            "gflops": f"{gfs:.2f}",
                            "kv_heads": h,
                            "path": "",
                            "x_f32": f"{ratio:.3f}",
                        }
                    )
    if args.csv:
        write_csv(args.csv, args.append, rows)
        print(f"CSV written to {args.csv}")


if __name__ == "__main__":
    main()
