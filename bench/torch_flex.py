"""PyTorch FlexAttention on the block-sparse shapes of examples/variants_bench.rs: the same
shapes, the same block masks (the same generator and seed), bf16, timed with CUDA events. Each
row gives FlexAttention's time without a block mask (causal or not, as the row), with it, and
their ratio, so that its ratio sits beside ours.

    python3 bench/torch_flex.py [--quick] [--csv bench/results/gpu-flex.csv]
"""
import argparse
import csv
import datetime
import os
import sys

import torch


def random_blocks(h, nq, nk, density):
    """The mask of variants_bench's `random_blocks`: xorshift64 from the same seed."""
    state = 0x9E3779B97F4A7C15
    mask = (1 << 64) - 1
    out = []
    for _ in range(h * nq * nk):
        state ^= (state << 13) & mask
        state ^= state >> 7
        state ^= (state << 17) & mask
        out.append((state >> 11) / float(1 << 53) < density)
    return torch.tensor(out, dtype=torch.bool).reshape(h, nq, nk)


def document_blocks(nq, nk, docs):
    q = torch.arange(nq)[:, None] * docs // nq
    k = torch.arange(nk)[None, :] * docs // nk
    return (q == k)[None]


def timed(fn, reps=20):
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--csv")
    args = ap.parse_args()
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    # Each shape and mask closure is a new specialisation; the default limit of 8 falls back to
    # the unfused implementation.
    torch._dynamo.config.recompile_limit = 256
    torch._dynamo.config.cache_size_limit = 256
    flex = torch.compile(flex_attention, dynamic=False)
    dev = "cuda"
    name = torch.cuda.get_device_name(0)
    # 32768 is left out: create_block_mask evaluates the mask per element there (128 GiB).
    seqs = [4096, 16384] if args.quick else [4096, 8192, 16384]
    out = open(args.csv, "w", newline="") if args.csv else None
    w = csv.writer(out) if out else None
    if w:
        w.writerow(["date", "commit", "device", "command", "variant", "batch", "seq_q", "seq_k",
                    "causal", "flex_plain_ms", "flex_variant_ms", "flex_ratio"])
    prefix = [datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
              os.environ.get("BENCH_COMMIT", "unknown"), name,
              "torch_flex.py " + " ".join(os.path.basename(a) for a in sys.argv[1:])]
    bs = 128
    h, hk, d = 16, 8, 128
    print(f"device: {name}, torch {torch.__version__}")
    print(f"{'variant':<11} {'seq':>6} {'causal':>6} {'plain ms':>9} {'var. ms':>9} {'ratio':>6}")
    for s in seqs:
        b = max(32768 // s, 1)
        q = torch.randn(b, h, s, d, device=dev, dtype=torch.bfloat16)
        k = torch.randn(b, hk, s, d, device=dev, dtype=torch.bfloat16)
        v = torch.randn(b, hk, s, d, device=dev, dtype=torch.bfloat16)
        nq = nk = (s + bs - 1) // bs
        masks = [(f"sparse-{p}", random_blocks(h, nq, nk, p)) for p in (0.1, 0.25, 0.5)]
        masks.append(("docs-8", document_blocks(nq, nk, 8)))
        for causal in (False, True):
            def mod_of(blocks):
                blocks = blocks.to(dev)
                per_head = blocks.shape[0] > 1

                def mask_mod(bi, hi, qi, ki):
                    open_ = blocks[hi if per_head else 0, qi // bs, ki // bs]
                    return (open_ & (ki <= qi)) if causal else open_
                return mask_mod, (h if per_head else None)

            if causal:
                base = create_block_mask(lambda bi, hi, qi, ki: ki <= qi, None, None, s, s,
                                         device=dev, BLOCK_SIZE=bs)
            else:
                base = None
            plain = timed(lambda: flex(q, k, v, block_mask=base, enable_gqa=True))
            for variant, blocks in masks:
                mod, heads = mod_of(blocks)
                bm = create_block_mask(mod, None, heads, s, s, device=dev, BLOCK_SIZE=bs)
                t = timed(lambda: flex(q, k, v, block_mask=bm, enable_gqa=True))
                print(f"{variant:<11} {s:>6} {str(causal).lower():>6} {plain:>9.3f} {t:>9.3f} "
                      f"{t / plain:>6.3f}", flush=True)
                if w:
                    w.writerow(prefix + [variant, b, s, s, str(causal).lower(), f"{plain:.4f}",
                                         f"{t:.4f}", f"{t / plain:.4f}"])
                    out.flush()


if __name__ == "__main__":
    sys.exit(main())
