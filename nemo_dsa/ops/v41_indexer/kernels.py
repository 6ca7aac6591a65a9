"""TileLang V4.1 frozen indexer scorer for Hopper: bf16 scores with the released rounding points.

Math (DSA-SPEC "Scoring", V4.1), per visible (query i, key j):
    s_h = bf16(q_h . k_j)            one rounding of the fp32-accumulated wgmma result
    r_h = bf16(relu(s_h) * w_h)      bf16 x bf16 product is exact in fp32, so the packed
                                     bf16x2 multiply (mul.rn.bf16x2) rounds it exactly once
    score = bf16(sum_h r_h)          fp32 sum in register/quad order
and -inf where j is outside the query's visible set. The per-head values never leave registers.
Only fp32 accumulation orders differ from the torch formula (the tensor cores' dot product and
the head sum), so rare scores sit one rounding step away (tests/test_v41_kernels_gpu.py).

Cost model (S = 32768, K = 8192, H = 64, D = 128, causal, B = 1):
- GEMM: 2*H*D = 16 KFLOP per visible (query, key) pair, S*K/2 pairs -> 2.2e12 FLOP, 2.9 ms at
  the card's measured 766 TFLOP/s.
- Epilogue: S*K/2*H = 8.6e9 per-head values; per pair of heads one cvt.bf16x2, one hmax2, one
  hmul2, two unpacks and two fadds (~3.5 instructions a value) -> ~3e10 lane-instructions,
  ~0.9 ms of issue on 132 SMs. Within a warpgroup it runs after the wgmma, not under it.
- Memory: scores are S*K*2 = 512 MiB written once (~0.15 ms of HBM); keys (2 MiB) are re-read
  from L2 by every query tile: 32 KiB per 8.4 MFLOP with 256 (query, head) columns.
Prediction: GEMM at ~90 % of peak plus the serial epilogue, ~4.3 ms. Measured on the H200
(2026-11-30): 5.1-5.3 ms, 410-430 TFLOP/s on the visible work (54-56 % of 766), 3.3x the
built-in scorer's 17.3 ms; the -inf pattern and all finite scores bitwise equal to it.
Keys sit in the GEMM's M dimension (wgmma m64) and the block_q * heads (query, head) pairs in N,
so one key row of a query's heads lives in one thread quad: the head sum is in-register adds and
two shuffles, where the transposed layout would need a cross-warp reduction.
"""

from dataclasses import asdict, dataclass

import torch

from nemo_dsa._checks import check_tensor
from nemo_dsa.ops._tilelang import HOPPER_SMEM_LIMIT, compile_cached, tilelang

# ----------------------------------------------------------------------------------------------
# Configurations: the one table the wrappers pick from (and the lowering tests enumerate).
# ----------------------------------------------------------------------------------------------

SUPPORTED_HEADS = (1, 2, 4, 8, 16, 32, 64, 128)
# Index dims the kernel is built for; other multiples of 16 up to 256 are zero-padded to the next
# one (zeros add exact zeros to every fp32 dot product, so the scores are unchanged).
KERNEL_DIMS = (64, 128, 256)
MAX_INDEX_DIM = 256
GEMM_COLUMNS = 256  # wgmma's largest N: block_q * heads


@dataclass(frozen=True)
class ScorerConfig:
    """Tile shape of one compiled scorer (all fields are arguments of :func:`v41_scorer_kernel`)."""

    heads: int
    index_dim: int
    block_q: int  # queries per tile; block_q * heads columns of the GEMM
    block_k: int  # keys per pipeline step (GEMM M)
    num_stages: int
    threads: int
    min_blocks_per_sm: int
    warp_specialized: bool

    def kernel_kwargs(self) -> dict:
        kwargs = asdict(self)
        kwargs.pop("warp_specialized")
        return kwargs

    def pass_configs(self) -> dict:
        return {} if self.warp_specialized else {"tl.disable_warp_specialized": True}

    def shared_memory_bytes(self) -> int:
        """Shared memory the tiles need (queries stay resident, keys are multi-buffered)."""
        return 2 * self.index_dim * (self.block_q * self.heads + self.num_stages * self.block_k)


def kernel_index_dim(index_dim: int) -> int:
    """The built index dim that serves ``index_dim`` (the smallest of KERNEL_DIMS >= it)."""
    for dim in KERNEL_DIMS:
        if index_dim <= dim:
            return dim
    raise ValueError(f"index_dim must be <= {MAX_INDEX_DIM}, got {index_dim}")


def scorer_config(heads: int, index_dim: int) -> ScorerConfig:
    """Tile shape for ``heads`` x ``index_dim`` (index_dim one of KERNEL_DIMS).

    256 (query, head) columns split over two consumer warpgroups (wgmma m64n128, 2 x 64 keys
    each per step: 128 accumulator registers a thread) fed by TileLang's TMA producer warpgroup.
    Single-warpgroup m64n256 tiles with two blocks per SM were the other candidate: TileLang
    0.1.15 needs minutes to lower them, so they are not used.
    """
    if heads not in SUPPORTED_HEADS:
        raise ValueError(f"heads must be a power of two <= 128, got {heads}")
    if index_dim not in KERNEL_DIMS:
        raise ValueError(f"index_dim must be one of {KERNEL_DIMS} for a kernel, got {index_dim}")
    block_q = GEMM_COLUMNS // heads
    # Shared memory: 64 KiB of queries and 3 x 32 KiB of keys at D = 128; at D = 256 the
    # queries take 128 KiB, so 64-key steps, double-buffered, keep it under 227 KiB.
    block_k, num_stages = (128, 3) if index_dim <= 128 else (64, 2)
    return ScorerConfig(
        heads, index_dim, block_q, block_k=block_k, num_stages=num_stages, threads=256,
        min_blocks_per_sm=1, warp_specialized=True,
    )


def dispatched_configs() -> list[ScorerConfig]:
    """Every configuration the wrappers can compile, for the supported heads and dims."""
    return [scorer_config(h, d) for h in SUPPORTED_HEADS for d in KERNEL_DIMS]


# ----------------------------------------------------------------------------------------------
# The kernel
# ----------------------------------------------------------------------------------------------


def v41_scorer_kernel(
    heads: int,
    index_dim: int,
    block_q: int,
    block_k: int,
    num_stages: int,
    threads: int,
    min_blocks_per_sm: int,
):
    """PrimFunc of the V4.1 scores for one configuration. Grid: (query tiles, batch).

    A tile of ``block_q`` queries keeps its [block_q * heads, D] queries in shared memory and
    walks only the keys in [min ks, max ke) of its queries, heaviest (latest) query tiles first.
    Columns outside that range get -inf from the same block, so every output is written once.
    """
    T = tilelang().language
    rows = block_q * heads
    fill = 256  # -inf fill chunk per query row
    bf16, f32, i32 = T.bfloat16, T.float32, T.int32
    batch, seq_len, num_keys = T.dynamic("batch"), T.dynamic("seq_len"), T.dynamic("num_keys")

    @T.prim_func
    def v41_scores(
        Q: T.Tensor([batch, seq_len * heads, index_dim], bf16),
        K: T.Tensor([batch, num_keys, index_dim], bf16),
        W: T.Tensor([batch, seq_len, heads], bf16),
        KS: T.Tensor([batch, seq_len], i32),
        KE: T.Tensor([batch, seq_len], i32),
        Scores: T.Tensor([batch, seq_len, num_keys], bf16),
    ):
        with T.Kernel(T.ceildiv(seq_len, block_q), batch, threads=threads) as (bx, by):
            T.annotate_min_blocks_per_sm(min_blocks_per_sm)
            q_shared = T.alloc_shared([rows, index_dim], bf16)
            k_shared = T.alloc_shared([block_k, index_dim], bf16)
            w_frag = T.alloc_fragment([block_q, heads], bf16)
            products = T.alloc_fragment([block_k, rows], f32)
            per_head = T.reshape(products, (block_k, block_q, heads))
            sums = T.alloc_fragment([block_k, block_q], f32)
            ks_s = T.alloc_shared([block_q], i32)
            ke_s = T.alloc_shared([block_q], i32)
            lo = T.alloc_var(i32)
            hi = T.alloc_var(i32)

            q0 = (T.ceildiv(seq_len, block_q) - 1 - bx) * block_q
            # Key range of the tile: union of its queries' [ks, ke), clamped to [0, K).
            lo = num_keys
            hi = 0
            for i in T.serial(block_q):
                if q0 + i < seq_len:
                    start = T.max(KS[by, q0 + i], 0)
                    end = T.min(KE[by, q0 + i], num_keys)
                    if start < end:
                        lo = T.min(lo, start)
                        hi = T.max(hi, end)
            for i in T.Parallel(block_q):
                inside = q0 + i < seq_len
                ks_s[i] = T.if_then_else(inside, KS[by, T.min(q0 + i, seq_len - 1)], 0)
                ke_s[i] = T.if_then_else(inside, KE[by, T.min(q0 + i, seq_len - 1)], 0)
            for i, h in T.Parallel(block_q, heads):
                w_frag[i, h] = T.if_then_else(q0 + i < seq_len, W[by, T.min(q0 + i, seq_len - 1), h], 0)
            # Rows past the last query load as zeros and are never stored.
            T.copy(Q[by, q0 * heads : q0 * heads + rows, :], q_shared)

            # Key tiles aligned to block_k: a [first, last) pipelined loop lowers in every TileLang
            # pipeline mode we tried; it costs at most one partial tile per query tile.
            first = lo // block_k
            last = T.if_then_else(hi > lo, T.ceildiv(hi, block_k), first)
            for t in T.Pipelined(first, last, num_stages=num_stages):
                k0 = t * block_k
                T.copy(K[by, k0 : k0 + block_k, :], k_shared)
                T.gemm(k_shared, q_shared, products, transpose_B=True, clear_accum=True)
                # bf16 boundaries: round the dot product, relu, bf16 x bf16 weight (packed ops).
                for n, i, h in T.Parallel(block_k, block_q, heads):
                    per_head[n, i, h] = T.cast(
                        T.max(T.cast(per_head[n, i, h], bf16), T.cast(0, bf16)) * w_frag[i, h], f32
                    )
                T.reduce_sum(per_head, sums, dim=2)
                for n, i in T.Parallel(block_k, block_q):
                    col = k0 + n
                    if q0 + i < seq_len and col < num_keys:
                        visible = (col >= ks_s[i]) & (col < ke_s[i])
                        Scores[by, q0 + i, col] = T.if_then_else(visible, T.cast(sums[n, i], bf16), -T.infinity(bf16))

            head = first * block_k
            tail = last * block_k
            for t in T.serial(T.ceildiv(head, fill)):
                for i, n in T.Parallel(block_q, fill):
                    if q0 + i < seq_len and t * fill + n < head:
                        Scores[by, q0 + i, t * fill + n] = -T.infinity(bf16)
            for t in T.serial(T.ceildiv(T.max(num_keys - tail, 0), fill)):
                for i, n in T.Parallel(block_q, fill):
                    if q0 + i < seq_len and tail + t * fill + n < num_keys:
                        Scores[by, q0 + i, tail + t * fill + n] = -T.infinity(bf16)

    return v41_scores


# ----------------------------------------------------------------------------------------------
# Launch wrappers
# ----------------------------------------------------------------------------------------------


def _check_inputs(q, k, w) -> tuple[int, int, int, int, int]:
    check_tensor("q", q, ndim=4, dtypes=(torch.bfloat16,))
    batch, queries, heads, dim = q.shape
    if not q.is_cuda:
        raise ValueError(f"q must be a CUDA tensor for the TileLang scorer, got {q.device}")
    check_tensor("k", k, ndim=3, dtypes=(torch.bfloat16,), shape=(batch, None, dim), device=q.device)
    check_tensor("w", w, ndim=3, dtypes=(torch.bfloat16,), shape=(batch, queries, heads), device=q.device)
    if heads not in SUPPORTED_HEADS:
        raise ValueError(f"q must have a power-of-two number of heads <= 128, got {heads}")
    if dim % 16 or not 16 <= dim <= MAX_INDEX_DIM:
        raise ValueError(f"q's index dim must be a multiple of 16 in [16, {MAX_INDEX_DIM}], got {dim}")
    return batch, queries, heads, dim, k.shape[1]


def _check_out(out, batch, queries, num_keys, device) -> torch.Tensor:
    if out is None:
        return torch.empty((batch, queries, num_keys), dtype=torch.bfloat16, device=device)
    check_tensor("out", out, dtypes=(torch.bfloat16,), shape=(batch, queries, num_keys), device=device)
    if not out.is_contiguous():
        raise ValueError("out must be contiguous")
    return out


def _kernel_operands(q, k, w, heads: int, dim: int):
    """q as [B, S*H, D'] rows and k as [B, K, D'], zero-padded to the kernel's dim D'."""
    kernel_dim = kernel_index_dim(dim)
    if kernel_dim != dim:
        q = torch.nn.functional.pad(q, (0, kernel_dim - dim))
        k = torch.nn.functional.pad(k, (0, kernel_dim - dim))
    batch, queries = q.shape[:2]
    return q.contiguous().view(batch, queries * heads, kernel_dim), k.contiguous(), w.contiguous(), kernel_dim


def _launch(config: ScorerConfig, *operands) -> None:
    kernel = compile_cached(v41_scorer_kernel, pass_configs=config.pass_configs(), **config.kernel_kwargs())
    kernel(*operands)


@torch.no_grad()
def v41_scores_tilelang(q, k, w, ks, ke, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """V4.1 scores bf16 ``[B, S, K]`` on the GPU, -inf outside ``[ks, ke)``.

    Args: q [B, S, H, D] bf16, k [B, K, D] bf16, w [B, S, H] bf16, ks/ke int32 [B, S] (clamped to
    [0, K] inside the kernel for memory safety; the public API validates them). ``out`` (optional,
    bf16 [B, S, K] contiguous) receives the result; every element is written.
    """
    batch, queries, heads, dim, num_keys = _check_inputs(q, k, w)
    for name, value in (("ks", ks), ("ke", ke)):
        check_tensor(name, value, ndim=2, dtypes=(torch.int32,), shape=(batch, queries), device=q.device)
    out = _check_out(out, batch, queries, num_keys, q.device)
    if out.numel() == 0:
        return out
    q_rows, k, w, kernel_dim = _kernel_operands(q, k, w, heads, dim)
    _launch(scorer_config(heads, kernel_dim), q_rows, k, w, ks.contiguous(), ke.contiguous(), out)
    return out


def mask_ranges(allowed: torch.Tensor, chunk: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """Tightest ``[ks, ke)`` int32 [B, S] around each query's allowed keys (ks = ke = 0 if none)."""
    batch, queries, num_keys = allowed.shape
    ks = torch.zeros((batch, queries), dtype=torch.int32, device=allowed.device)
    ke = torch.zeros_like(ks)
    bytes_ = allowed.view(torch.uint8)
    for start in range(0, queries, chunk):
        part = bytes_[:, start : start + chunk]
        # argmax returns the first maximum: the first allowed key, and from the right the last.
        first = part.argmax(-1)
        last = num_keys - 1 - part.flip(-1).argmax(-1)
        seen = part.amax(-1).bool()
        ks[:, start : start + chunk] = torch.where(seen, first, 0).to(torch.int32)
        ke[:, start : start + chunk] = torch.where(seen, last + 1, 0).to(torch.int32)
    return ks, ke


@torch.no_grad()
def v41_scores_masked_tilelang(q, k, w, allowed, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """V4.1 scores bf16 ``[B, S, K]`` on the GPU with a dense bool ``allowed [B, S, K]``.

    The mask is honoured elementwise (it need not be a range): the range kernel scores each
    query's [first allowed, last allowed] span, then the keys the mask drops inside it become
    -inf. At S = 32K, K = 8K the two mask passes cost 2.1 ms (ranges) + 0.5 ms (fill): 7.7 ms
    in all, where reading the mask byte by byte in the kernel's store loop measured 10.4 ms.
    """
    batch, queries, heads, dim, num_keys = _check_inputs(q, k, w)
    check_tensor("allowed", allowed, ndim=3, dtypes=(torch.bool,), shape=(batch, queries, num_keys), device=q.device)
    out = _check_out(out, batch, queries, num_keys, q.device)
    if out.numel() == 0:
        return out
    ks, ke = mask_ranges(allowed)
    v41_scores_tilelang(q, k, w, ks, ke, out=out)
    return out.masked_fill_(~allowed, float("-inf"))


def indexer_scores_tilelang(queries, keys, weights, allowed=None, ks=None, ke=None) -> torch.Tensor:
    """Dispatch seam of ``interface.indexer_scores``: the dense mask or the (ks, ke) form."""
    if allowed is not None:
        return v41_scores_masked_tilelang(queries, keys, weights, allowed)
    return v41_scores_tilelang(queries, keys, weights, ks, ke)
