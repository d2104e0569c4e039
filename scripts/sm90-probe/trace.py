"""Reads the TRACE lines of a gpu_bench run built by trace.sh (CANDLE_FLASH_TRACE=1) and prints,
for the first configuration (bf16, unmasked), the cycles each consumer warp spent per key step
in each phase of the loop, averaged over steps 3..14 of block 0's second tile.
    python3 trace.py trace.txt
"""
import statistics
import sys

lines = open(sys.argv[1]).read().splitlines()
last, dumps = [], []
for line in lines:
    if line.startswith("TRACE"):
        last.append(line)
    elif line.startswith("RESULT"):
        dumps.append((line, last[-128:]))
        last = []
names = ["K/V wait", "turn", "S (issue + wait)", "softmax", "P V wait", "pack P", "to next step"]
for result, dump in dumps[:1]:
    print(result)
    rows = {}
    for line in dump:
        p = line.split()
        rows[(int(p[1]), int(p[2]), int(p[3]))] = [int(x) for x in p[5:]]
    print("| warpgroup | warp | " + " | ".join(names) + " | step |")
    print("|---|---|" + "---:|" * (len(names) + 1))
    for wg in (0, 1):
        for w in range(4):
            steps = range(3, 15)
            ph = [[rows[(wg, w, s)][i + 1] - rows[(wg, w, s)][i] for i in range(6)]
                  + [rows[(wg, w, s + 1)][0] - rows[(wg, w, s)][6]] for s in steps]
            step = [rows[(wg, w, s + 1)][0] - rows[(wg, w, s)][0] for s in steps]
            cols = [f"{statistics.mean(x[i] for x in ph):.0f}" for i in range(len(names))]
            print(f"| {wg} | {w} | " + " | ".join(cols) + f" | {statistics.mean(step):.0f} |")
