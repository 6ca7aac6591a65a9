"""TileLang block maxima for the V4.1 candidate blocks: one read of the scores instead of the
torch table's four passes (strided elementwise kernels, about a fifth of the candidate-source
layer's time at S = 32,768).

``Out[r, n]`` is the max of the finite scores of row r at keys ``[ks_r + n*C, ks_r + (n+1)*C)``
that lie before ``ke_r`` (-inf when there are none): the exact block maxima of
``nemo_dsa.ops.v41_indexer.candidates``, which takes them from here for CUDA scores. One thread per block, a grid of
(blocks / THREADS, rows). It lowers for sm_90a on the CPU (tests/ops/test_topk_kernels_lowering.py);
tests/ops/test_topk_kernels_gpu.py compares it with a brute force and, through
``candidate_blocks``, with the reference. Importing this module does not import TileLang."""

from __future__ import annotations

import torch

from nemo_dsa._checks import check_positive_int, check_tensor
from nemo_dsa.ops._tilelang import compile_cached, tilelang

THREADS = 256
SCORE_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}
# Block sizes built ahead (the released V4.1 uses 8); any other size compiles on first use.
BLOCK_SIZES = (8,)


def block_maxima_kernel(score_dtype: str, block_size: int):
    """PrimFunc of the block maxima of ``Scores [rows, width]`` in blocks of ``block_size`` keys
    counted from each row's ``Ks``, keys at or past ``Ke`` excluded, into ``Out [rows, blocks]``."""
    check_positive_int("block_size", block_size)
    T = tilelang().language
    dtype = T.float32 if score_dtype == "float32" else T.bfloat16
    bits, exponent = (T.uint32, 0x7F800000) if score_dtype == "float32" else (T.uint16, 0x7F80)
    rows, width, num_blocks = T.dynamic("rows"), T.dynamic("width"), T.dynamic("num_blocks")

    @T.prim_func
    def block_maxima(
        Scores: T.Tensor((rows, width), dtype),
        Ks: T.Tensor((rows,), T.int32),
        Ke: T.Tensor((rows,), T.int32),
        Out: T.Tensor((rows, num_blocks), dtype),
    ):
        with T.Kernel(T.ceildiv(num_blocks, THREADS), rows, threads=THREADS) as (bx, row):
            block = bx * THREADS + T.get_thread_binding()
            best = T.alloc_var(dtype)
            best = -T.infinity(dtype)
            if block < num_blocks:
                start = Ks[row] + block * block_size
                end = T.min(Ke[row], width)
                for j in T.serial(block_size):
                    if start + j < end:
                        x = T.alloc_var(dtype)
                        x = Scores[row, start + j]
                        # NaN and +-inf have every exponent bit set: they count as -inf.
                        if (T.reinterpret(x, bits) & exponent) != exponent:
                            best = T.max(best, x)
                Out[row, block] = best

    return block_maxima


def block_maxima_tilelang(scores: torch.Tensor, ks: torch.Tensor, ke: torch.Tensor, block_size: int,
                          num_blocks: int) -> torch.Tensor:
    """Block maxima ``[N, num_blocks]`` of CUDA ``scores [N, K]`` (fp32/bf16) from int32 ``ks``/``ke [N]``."""
    check_tensor("scores", scores, ndim=2, dtypes=tuple(SCORE_DTYPES))
    if not scores.is_cuda:
        raise ValueError(f"scores must be a CUDA tensor for the TileLang block maxima, got {scores.device}")
    check_positive_int("block_size", block_size)
    check_positive_int("num_blocks", num_blocks)
    rows = scores.shape[0]
    for name, value in (("ks", ks), ("ke", ke)):
        check_tensor(name, value, ndim=1, dtypes=(torch.int32,), shape=(rows,), device=scores.device)
    out = torch.empty((rows, num_blocks), dtype=scores.dtype, device=scores.device)
    if rows:
        kernel = compile_cached(block_maxima_kernel, score_dtype=SCORE_DTYPES[scores.dtype], block_size=block_size)
        kernel(scores.contiguous(), ks.contiguous(), ke.contiguous(), out)
    return out
