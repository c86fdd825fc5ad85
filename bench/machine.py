"""The machine a benchmark ran on and its own limits, measured in the same run: every figure is printed next to
the CPU's name and flags, the load, and a share of the matmul peak or the memory bandwidth measured here."""
import datetime
import os
import platform as py_platform
import time

import torch

# The flags that decide which of our CPU kernels run (and how fast torch's bf16 matmul is).
CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "avx_vnni", "amx_tile",
             "amx_bf16", "amx_int8")


def cpu() -> str:
    """'<model name>, <cores> cores, flags: <the CPU_FLAGS it has>'."""
    name, flags = py_platform.processor() or py_platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    name = value.strip()
                elif key.strip() == "flags":
                    flags = set(value.split())
                    break
    except OSError:
        pass
    have = " ".join(f for f in CPU_FLAGS if f in flags) or "none of " + " ".join(CPU_FLAGS)
    return f"{name}, {os.cpu_count()} cores, flags: {have}"


def load() -> str:
    """The load average: other processes on a small machine skew every engine's timings."""
    return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg()) + " (1/5/15 min)"


def machine() -> str:
    """The CPU, torch and its threads, the time and the load: printed with every figure, since the figures only
    mean something next to them."""
    return (f"{cpu()}; torch {torch.__version__}, {torch.get_num_threads()} threads; "
            f"{datetime.datetime.now().isoformat(timespec='seconds')}; {load()}")


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def matmul_peak_gflops(dtype, device: str = "cpu") -> float:
    """This machine's matmul rate now: the best of a few 2048 x 2048 x 8192 oneDNN matmuls on prepacked weights
    (what our linear layers run) on CPU; the best of a few 8192^3 torch.matmul on a GPU."""
    if device.startswith("cuda"):
        a = torch.randn(8192, 8192, device=device).to(dtype)
        flops = 2 * 8192 ** 3

        def matmul():
            torch.matmul(a, a)
    else:
        x = torch.randn(2048, 2048).to(dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(torch.randn(8192, 2048).to(dtype), None)
        flops = 2 * 2048 * 2048 * 8192

        def matmul():
            torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    best = float("inf")
    for _ in range(5):
        synchronize(device)
        start = time.perf_counter()
        matmul()
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return flops / best / 1e9


def bandwidth_gbs() -> tuple[float, float]:
    """(read, copy) GB/s now: best of 5 sums of a 1 GiB float32 tensor (reads it once) and copies of a 512 MiB one
    (reads and writes it once), far beyond any cache."""
    big = torch.ones(2 ** 28)
    src, dst = torch.ones(2 ** 27), torch.empty(2 ** 27)
    read = copy = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        big.sum()
        read = min(read, time.perf_counter() - start)
        start = time.perf_counter()
        dst.copy_(src)
        copy = min(copy, time.perf_counter() - start)
    return big.nbytes / read / 1e9, 2 * src.nbytes / copy / 1e9
