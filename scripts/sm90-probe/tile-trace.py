"""Reads the TT lines of a gpu_bench run built with tile-trace.patch (CANDLE_FLASH_TRACE=1) and
prints, for block 0's tiles 1..6 of one configuration (argument 2: the index of its RESULT line,
0 = bf16 unmasked), the cycles warp 0 of each consumer warpgroup spent in each phase from one
tile's start to the next, and when the producer issued the tile's loads.
    python3 tile-trace.py trace.txt 0
"""
import sys

lines = open(sys.argv[1]).read().splitlines()
which = int(sys.argv[2]) if len(sys.argv) > 2 else 0
last, dumps = [], []
for line in lines:
    if line.startswith("TT"):
        last.append(line)
    elif line.startswith("RESULT"):
        dumps.append((line, last[-72:]))
        last = []
names = ["ring", "Q wait", "K0 wait", "turn", "S0", "softmax0", "loop", "PV turn", "PV", "epilogue",
         "to next"]
for result, dump in dumps[which:which + 1]:
    print(result)
    r = {}
    for line in dump:
        p = line.split()
        r[(int(p[1]), int(p[2]))] = [int(x) for x in p[4:]]
    d = lambda a, b: (b - a) % (1 << 32)
    print("| tile | warpgroup | " + " | ".join(names) + " | tile | producer: Q wait | Q issued"
          + " | K/V issued |")
    print("|---|---|" + "---:|" * (len(names) + 4))
    for t in range(1, 7):
        pr = r[(t, 8)]
        base = r[(t, 0)][0]
        rel = lambda x: (x - base + (1 << 31)) % (1 << 32) - (1 << 31)
        for slot in (0, 4):
            a, nx = r[(t, slot)], r[(t + 1, slot)]
            ph = [d(a[i], a[i + 1]) for i in range(10)] + [d(a[10], nx[0])]
            print(f"| {t} | {slot // 4} | " + " | ".join(str(x) for x in ph)
                  + f" | {d(a[0], nx[0])} | {d(pr[1], pr[2])} | {rel(pr[2])} | {rel(pr[3])} |")
