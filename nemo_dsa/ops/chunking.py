"""Query chunking for the torch references: bound the per-chunk intermediates by a byte budget.

The references loop over query chunks so that a CPU run at S=16384, K=4096, H=64 never holds the
[S, H, K] per-head products at once; only [chunk, H, K] lives at a time.
"""

from __future__ import annotations

from collections.abc import Iterator

# 256 MiB of intermediates per chunk: large enough for good BLAS efficiency, small next to 24 GiB.
DEFAULT_BUDGET_BYTES = 256 * 2**20


def query_chunk_size(num_queries: int, bytes_per_query: int, budget_bytes: int = DEFAULT_BUDGET_BYTES) -> int:
    """Largest number of queries whose intermediates (``bytes_per_query`` each) fit the budget.

    Never below one query (a single query's work is the irreducible unit) and never above
    ``num_queries``.
    """
    if budget_bytes < 1:
        raise ValueError(f"budget_bytes must be >= 1, got {budget_bytes}")
    fitting = budget_bytes // max(int(bytes_per_query), 1)
    return max(1, min(max(num_queries, 1), fitting))


def query_chunks(num_queries: int, chunk: int) -> Iterator[slice]:
    """Consecutive slices of ``chunk`` queries covering ``range(num_queries)``."""
    for start in range(0, num_queries, chunk):
        yield slice(start, min(start + chunk, num_queries))
