"""Lower many kernel configurations in parallel, in clean worker processes.

Each lowering is a few seconds of single-threaded TVM passes, so two workers halve the time on
CI's two cores. The workers come from a fork server, never from forking pytest itself: once a
test has left threads in this process (a gloo process group, OpenMP), a forked child can crash
when it exits.
"""

import multiprocessing
from concurrent.futures import ProcessPoolExecutor


def map_in_workers(fn, items, workers: int = 2) -> list:
    """``list(map(fn, items))`` in ``workers`` processes (``fn`` importable, results picklable)."""
    with ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("forkserver")) as pool:
        return list(pool.map(fn, items))
