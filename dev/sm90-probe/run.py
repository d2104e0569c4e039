"""Runs the probes that build.sh compiled, through the driver API (ctypes, no CUDA toolkit
needed on the GPU machine), and prints cycles per iteration.
    python3 run.py pipes.cubin    # issue rate of single instructions per SM sub-partition
    python3 run.py wgmma.cubin    # one warpgroup's wgmma stream against another's loop
    python3 run.py depth.cubin    # when a warpgroup's wgmma issue starts to wait for the pipe
"""
import ctypes
import sys

cu = ctypes.CDLL("libcuda.so.1")


def ck(r, what):
    if r != 0:
        raise SystemExit(f"{what}: CUresult {r}")


ck(cu.cuInit(0), "cuInit")
dev = ctypes.c_int()
ck(cu.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
ctx = ctypes.c_void_p()
ck(cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
ck(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
mod = ctypes.c_void_p()
ck(cu.cuModuleLoadData(ctypes.byref(mod), open(sys.argv[1], "rb").read()), "cuModuleLoadData")
buf = ctypes.c_uint64()
ck(cu.cuMemAlloc_v2(ctypes.byref(buf), 1 << 20), "cuMemAlloc")


def launch(name, threads, smem, iters):
    f = ctypes.c_void_p()
    ck(cu.cuModuleGetFunction(ctypes.byref(f), mod, name.encode()), name)
    if smem:
        ck(cu.cuFuncSetAttribute(f, 8, smem), "max dynamic shared memory")
    a1, a2 = ctypes.c_uint64(buf.value), ctypes.c_int(iters)
    args = (ctypes.c_void_p * 2)(
        ctypes.cast(ctypes.byref(a1), ctypes.c_void_p),
        ctypes.cast(ctypes.byref(a2), ctypes.c_void_p),
    )
    for _ in range(2):  # the first launch loads the module
        ck(cu.cuLaunchKernel(f, 1, 1, 1, threads, 1, 1, smem, None, args, None), name)
    ck(cu.cuCtxSynchronize(), name)
    out = (ctypes.c_uint32 * 24)()
    ck(cu.cuMemcpyDtoH_v2(out, buf, 96), "copy")
    return list(out)


if "pipes" in sys.argv[1]:
    ops = ["ex2.approx.ftz.f32", "fma.rn.f32", "max.f32", "add.f32", "cvt.rn.bf16x2.f32",
           "ex2.approx.f16x2", "ex2.approx.ftz.bf16x2"]
    iters = 4096
    print("| instruction | warps per SMSP | cycles per warp instruction per SMSP |")
    print("|---|---:|---:|")
    for k, op in enumerate(ops):
        for threads in (128, 256, 512):
            out = launch(f"pipe{k}", threads, 0, iters)
            per_smsp = threads // 128
            cyc = max(out[: threads // 32])
            print(f"| {op} | {per_smsp} | {cyc / (iters * 8 * per_smsp):.2f} |")
elif "depth" in sys.argv[1]:
    print("| probe | issue k returned at (cycles after the first issue began), k = 1.. | gaps |")
    print("|---|---|---|")
    for name in ("depth_ss", "depth_ss_busy"):
        for _ in range(3):
            t = launch(f"probe_{name}", 384, 65536 + 1024, 0)
            gaps = [b - a for a, b in zip([0] + t, t)]
            print(f"| {name} | {' '.join(map(str, t))} | {' '.join(map(str, gaps))} |")
else:
    iters = 2000
    names = ["ss", "rs", "ss_ss", "rs_rs", "ss_rs", "mix", "ss_mix", "rs_mix", "shfl", "ss_shfl",
             "rs_shfl", "fmnmx", "ss_fmnmx", "ffma", "ss_ffma", "lds", "ss_lds", "vote", "ss_vote",
             "mbar", "ss_mbar", "ldc", "ss_ldc"]
    print("| kernel (warpgroup 0 _ warpgroup 1) | wg 0 cycles/iter | wg 1 cycles/iter |")
    print("|---|---:|---:|")
    for name in names:
        out = launch(f"probe_{name}", 384, 65536 + 1024, iters)
        f = lambda c: f"{c / iters:.1f}" if c > iters else "-"
        print(f"| {name} | {f(out[0])} | {f(out[1])} |")
