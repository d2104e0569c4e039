"""PyTorch SDPA decode baseline: one query per sequence against a KV cache, the shapes of
examples/decode_bench.rs (32 query heads / 8 KV heads, head_dim 128, bf16), flash and cuDNN
backends with native GQA (K/V are not repeated). Prints a table and, with --csv PATH, the CSV
columns of scripts/plot.py's decode plot: impl,dtype,batch,heads,kv_heads,d,kv_len,us,gbps,copy_gbps.
Bytes counted: K and V read once, q read and the output written once. Timing: CUDA events around
batches of 50 back-to-back calls, median of 7 batches after warm-up.
"""
import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def timed(fn, reps=7, inner=50):
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(inner):
            fn()
        b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b) / inner * 1e3)  # us
    return sorted(out)[len(out) // 2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--kv", default="4096,32768")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--csv")
    args = ap.parse_args()
    h, hk, d = args.heads, args.kv_heads, args.head_dim
    dt = torch.bfloat16
    n = 64 << 20
    src = torch.ones(n, dtype=torch.float32, device="cuda")
    dst = torch.empty_like(src)
    copy = 2 * n * 4 / (timed(lambda: dst.copy_(src), inner=10) * 1e-6) / 1e9
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, copy bandwidth {copy:.1f} GB/s")
    rows = []
    print("| backend | batch | kv | us | GB/s | % of copy |")
    print("|---|---:|---:|---:|---:|---:|")
    for b in map(int, args.batch.split(",")):
        for kv in map(int, args.kv.split(",")):
            q = torch.randn(b, h, 1, d, dtype=dt, device="cuda")
            k = torch.randn(b, hk, kv, d, dtype=dt, device="cuda")
            v = torch.randn(b, hk, kv, d, dtype=dt, device="cuda")
            nbytes = (2 * b * hk * kv * d + 2 * b * h * d) * 2
            for name, be in (("torch_flash", SDPBackend.FLASH_ATTENTION),
                             ("torch_cudnn", SDPBackend.CUDNN_ATTENTION)):
                try:
                    with sdpa_kernel(be):
                        us = timed(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))
                except Exception as e:  # a backend that refuses the shape
                    print(f"| {name} | {b} | {kv} | refused: {str(e).splitlines()[0][:60]} | | |")
                    continue
                gbps = nbytes / (us * 1e-6) / 1e9
                print(f"| {name} | {b} | {kv} | {us:.1f} | {gbps:.0f} | {100 * gbps / copy:.0f}% |")
                rows.append(f"{name},bf16,{b},{h},{hk},{d},{kv},{us:.2f},{gbps:.1f},{copy:.1f}")
    if args.csv:
        with open(args.csv, "w") as f:
            f.write("impl,dtype,batch,heads,kv_heads,d,kv_len,us,gbps,copy_gbps\n")
            f.write("\n".join(rows) + "\n")


if __name__ == "__main__":
    main()
