"""Lower many kernel configurations in parallel, in clean worker processes.

Each lowering is a few seconds of single-threaded TVM passes, so two workers halve the time on
CI's two cores. The workers come from a fork server, never from forking pytest itself: once a
test has left threads in this process (a gloo process group, OpenMP), a forked child can crash
when it exits.
"""

import multiprocessing
import re
from concurrent.futures import ProcessPoolExecutor


def map_in_workers(fn, items, workers: int = 2) -> list:
    """``list(map(fn, items))`` in ``workers`` processes (``fn`` importable, results picklable)."""
    with ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("forkserver")) as pool:
        return list(pool.map(fn, items))


def pingpong_problems(source: str, rows: int, producer_registers: int, consumer_registers: int) -> list[str]:
    """What generated CUDA lacks of the ping-pong schedule (``nemo_dsa/ops/_pingpong.py``): one
    m64 x ``rows`` wgmma per consumer, the setmaxnreg split, and in each consumer the order turn,
    issue, hand over, wait."""
    from nemo_dsa.ops._pingpong import TURN_BARRIER

    problems = []
    if len(re.findall(rf"wgmma_ss<[^>]*\b64, {rows}, 16\b", source)) != 2:
        problems.append(f"one m64n{rows}k16 wgmma per consumer")
    if f"warpgroup_reg_dealloc<{producer_registers}>" not in source:
        problems.append("producer setmaxnreg.dec")
    if source.count(f"warpgroup_reg_alloc<{consumer_registers}>") != 2:
        problems.append("consumers' setmaxnreg.inc")
    for me in (0, 1):
        steps = [
            f"__sync_thread_partial({TURN_BARRIER + me}, 256)",
            "wgmma_ss<",
            f"__named_barrier_arrive({TURN_BARRIER + 1 - me}, 256)",
            "wait_wgmma<0>",
        ]
        at = source.find(steps[0])
        for step in steps[1:]:
            at = -1 if at < 0 else source.find(step, at)
        if at < 0:
            problems.append(f"consumer {me}: turn, issue, hand over, wait")
    return problems


def ptxas_report(source: str) -> str:
    """What ``nvcc -Xptxas -v`` says while building ``source`` (TileLang's generated CUDA) into
    an sm_90a cubin: registers, spills, and remarks such as C7514 (wgmmas serialised)."""
    import os
    import subprocess
    import tempfile

    import tilelang

    root = os.path.dirname(tilelang.__file__)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cu")
        with open(path, "w") as f:
            f.write(source)
        proc = subprocess.run(
            ["nvcc", "-std=c++20", f"-I{root}/src", f"-I{root}/3rdparty/cutlass/include", "-arch=sm_90a", "-cubin",
             "-Xptxas", "-v", "-diag-suppress", "1444,20012,1046", path, "-o", os.path.join(tmp, "kernel.cubin")],
            capture_output=True, text=True,
        )  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"nvcc failed:\n{proc.stderr[-3000:]}")
    return proc.stderr


_TYPE_BYTES = {"uchar": 1, "char": 1, "bfloat16_t": 2, "half_t": 2, "int": 4, "float": 4, "uint64_t": 8,
               "unsigned long long": 8, "int64_t": 8}
_STATIC_SHARED = re.compile(r"^\s*__shared__ (?:__align__\((\d+)\) )?([\w ]+?) (\w+)\[(\d+)\];", re.MULTILINE)


def static_shared_memory_bytes(source: str) -> int:
    """Static shared memory of generated CUDA (the mbarriers, static buffers such as the forward's
    index row), as the SM allocates it: each declaration at its alignment, and the total rounded
    up to the 1 KiB the dynamic buffer (``extern __shared__ __align__(1024)``) is aligned to.
    Together with the dynamic request it must fit HOPPER_SMEM_LIMIT, or the launch fails."""
    total = 0
    for align, dtype, _, count in _STATIC_SHARED.findall(source):
        align = int(align or _TYPE_BYTES[dtype])
        total = -(-total // align) * align + _TYPE_BYTES[dtype] * int(count)
    if total and "extern __shared__ __align__(1024)" in source:
        total = -(-total // 1024) * 1024
    return total
