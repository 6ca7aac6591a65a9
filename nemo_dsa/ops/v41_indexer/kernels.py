"""TileLang V4.1 frozen indexer scorer for Hopper: bf16 scores with the released rounding points.

Math (docs/semantics.md "Index scoring", V4.1), per visible (query i, key j):
    s_h = bf16(q_h . k_j)            one rounding of the fp32-accumulated wgmma result
    r_h = bf16(relu(s_h) * w_h)      bf16 x bf16 product is exact in fp32, so the packed
                                     bf16x2 multiply (mul.bf16x2) rounds it exactly once
    score = bf16(sum_h r_h)          fp32 sum: a second wgmma, r [keys, (query, head)] times
                                     the 0/1 matrix E[(query, head), query] (8+ heads), or
                                     register adds and quad shuffles (1 to 4 heads)
and -inf where j is outside the query's visible set. The per-head values never leave registers
(r is the second wgmma's A operand, in the accumulator's own register layout). Only fp32
accumulation differs from the torch formula (the tensor cores' dot products and their sum of
r_h x 1, which are exact products in an fp32 accumulator with its own rounding), so rare
scores sit one rounding step away (tests/ops/test_v41_kernels_gpu.py: 0 of 2.1M at S = 4096).

Cost model (S = 32768, K = 8192, H = 64, D = 128, causal, B = 1):
- GEMM: 2*H*D = 16 KFLOP per visible (query, key) pair, S*K/2 pairs -> 2.2e12 FLOP, 2.9 ms at
  the card's measured 766 TFLOP/s. The head sum adds 1/16 of it (k = 256 against 128 per
  column group of 8 queries), run at wgmma's smallest N = 8.
- Epilogue: 64 x 256 per-head values a tile. In registers, each pair of heads is one
  cvt.bf16x2, hmax2 and hmul2, then two unpacks and two fp32 adds, plus shuffles and eight
  predicated stores a thread: measured at 3.2 ms for the whole problem with 1/8 of the GEMM
  left in, longer than the GEMM itself. On the tensor cores only the three packed ops remain.
- Memory: scores are S*K*2 = 512 MiB written once (~0.15 ms of HBM); keys (2 MiB) are re-read
  from L2 by every query tile: 16 KiB per 4.2 MFLOP tile.

Schedule (hand warp-specialised, 384 threads; "ping-pong" as CUTLASS's Hopper kernels call it):
a producer warpgroup loads the queries and the 64-key tiles with TMA into a ring of shared
buffers (full/empty mbarriers) and writes the -inf outside the tile's key range; two consumer
warpgroups take alternate key tiles, each a whole m64n256 GEMM, and pass a turn to each other
through two named barriers right after issuing their wgmma, so one group's epilogue runs while
the other's GEMM occupies the tensor cores. Measured on the H200 (2026-11-30, S = 32768): 3.66-3.72
ms in an A/B run (590-600 TFLOP/s on the visible work, 77-79 % of 766) and 3.8-4.2 ms in the
benchmarks (525-580 TFLOP/s), against 17.5 ms for the built-in indexer_scores; the same schedule
with the head sum in registers took 4.49-4.61 ms, TileLang's automatic warp specialisation of
that math 5.06 ms.
Keys sit in the GEMM's M dimension and the block_q * heads (query, head) pairs in N, so one key
row of a query's heads lives in one thread quad.
"""

from dataclasses import asdict, dataclass

import torch

from nemo_dsa._checks import check_qkw, check_tensor
from nemo_dsa.ops._pingpong import (
    BLOCK_K,
    CONSUMER_REGISTERS,
    PASS_CONFIGS,
    PRODUCER_REGISTERS,
    THREADS,
    pingpong_macros,
    pingpong_shared_memory_bytes,
)
from nemo_dsa.ops._tilelang import HOPPER_SMEM_LIMIT, compile_cached, tilelang
from nemo_dsa.ops.v41_indexer.heads import MAX_INDEX_DIM, SUPPORTED_HEADS, check_heads

# ----------------------------------------------------------------------------------------------
# Configurations: the one table the wrappers pick from (and the lowering tests enumerate).
# ----------------------------------------------------------------------------------------------

# Index dims the kernel is built for; other multiples of 16 up to 256 are zero-padded to the next
# one (zeros add exact zeros to every fp32 dot product, so the scores are unchanged).
KERNEL_DIMS = (64, 128, 256)
GEMM_COLUMNS = 256  # wgmma's largest N: block_q * heads


@dataclass(frozen=True)
class ScorerConfig:
    """Tile shape of one compiled scorer (all fields are arguments of :func:`v41_scorer_kernel`)."""

    heads: int
    index_dim: int
    block_q: int  # queries per tile; block_q * heads columns of the GEMM
    num_stages: int  # key tiles in flight (shared-memory ring)
    head_sum_wgmma: bool  # head sum on the tensor cores (else register adds and shuffles)
    producer_registers: int = PRODUCER_REGISTERS
    consumer_registers: int = CONSUMER_REGISTERS

    def kernel_kwargs(self) -> dict:
        return asdict(self)

    def pass_configs(self) -> dict:
        return dict(PASS_CONFIGS)

    def shared_memory_bytes(self) -> int:
        """Shared memory the tiles need (queries stay resident, keys are multi-buffered, the
        head-sum matrix E is [sum columns, block_q * heads] bf16)."""
        rows = self.block_q * self.heads
        head_sum = 2 * head_sum_columns(self.block_q) * rows if self.head_sum_wgmma else 0
        return pingpong_shared_memory_bytes(rows, self.index_dim, self.num_stages) + head_sum


def head_sum_columns(block_q: int) -> int:
    """N of the head-sum wgmma: one column per query of the tile, at least wgmma's minimum 8."""
    return max(8, block_q)


def kernel_index_dim(index_dim: int) -> int:
    """The built index dim that serves ``index_dim`` (the smallest of KERNEL_DIMS >= it)."""
    for dim in KERNEL_DIMS:
        if index_dim <= dim:
            return dim
    raise ValueError(f"index_dim must be <= {MAX_INDEX_DIM}, got {index_dim}")


def scorer_config(heads: int, index_dim: int) -> ScorerConfig:
    """Tile shape for ``heads`` x ``index_dim`` (index_dim one of KERNEL_DIMS).

    Stages: 4 key tiles in flight at D <= 128 (3, 6 and 8 measured the same, within 1 %); at
    D = 256 the queries take 128 KiB, so 2 tiles of 32 KiB keep it under 227 KiB. With 1 to 4
    heads a tile holds 64 to 256 queries: E would take up to 128 KiB and its wgmma as many
    FLOPs as the scores, while there are only 1 to 4 terms to add, so those sum in registers.
    """
    check_heads("heads", heads, of_tensor=False)
    if index_dim not in KERNEL_DIMS:
        raise ValueError(f"index_dim must be one of {KERNEL_DIMS} for a kernel, got {index_dim}")
    return ScorerConfig(
        heads, index_dim, GEMM_COLUMNS // heads, num_stages=4 if index_dim <= 128 else 2, head_sum_wgmma=heads >= 8
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
    num_stages: int,
    head_sum_wgmma: bool,
    producer_registers: int,
    consumer_registers: int,
):
    """PrimFunc of the V4.1 scores for one configuration. Grid: (query tiles, batch).

    A tile of ``block_q`` queries keeps its [block_q * heads, D] queries in shared memory and
    walks only the 64-key tiles in [min ks, max ke) of its queries, heaviest (latest) query tiles
    first. Columns outside that range get -inf from the producer, so every output is written once.
    """
    T = tilelang().language
    rows = block_q * heads
    sum_columns = head_sum_columns(block_q)
    bf16, f32, i32 = T.bfloat16, T.float32, T.int32
    batch, seq_len, num_keys = T.dynamic("batch"), T.dynamic("seq_len"), T.dynamic("num_keys")

    producer, first_turn, multiply = pingpong_macros(heads, block_q, num_stages)

    @T.macro
    def consumer(me, acc, r, e_shared, sums, w_frag, q_shared, k_shared, full, empty, q_ready, ks_s, ke_s, W, Scores, by, q0, first, tiles):
        """Consumer ``me`` (0 or 1) scores key tiles me, me + 2, ... of the query tile."""
        for i, h in T.Parallel(block_q, heads):
            w_frag[i, h] = T.if_then_else(q0 + i < seq_len, W[by, T.min(q0 + i, seq_len - 1), h], 0)
        first_turn(me, q_ready)
        for j in T.serial(T.ceildiv(tiles - me, 2)):
            t = 2 * j + me
            multiply(me, t, acc, q_shared, k_shared, full, empty)
            # bf16 boundaries: round the dot product, relu, bf16 x bf16 weight (packed ops).
            per_head = T.reshape(acc, (BLOCK_K, block_q, heads))
            if head_sum_wgmma:
                terms = T.reshape(r, (BLOCK_K, block_q, heads))
                for n, i, h in T.Parallel(BLOCK_K, block_q, heads):
                    terms[n, i, h] = T.max(T.cast(per_head[n, i, h], bf16), T.cast(0, bf16)) * w_frag[i, h]
                T.gemm(r, e_shared, sums, transpose_B=True, clear_accum=True)
            else:
                for n, i, h in T.Parallel(BLOCK_K, block_q, heads):
                    per_head[n, i, h] = T.cast(
                        T.max(T.cast(per_head[n, i, h], bf16), T.cast(0, bf16)) * w_frag[i, h], f32
                    )
                T.reduce_sum(per_head, sums, dim=2)
            for n, i in T.Parallel(BLOCK_K, block_q):
                col = (first + t) * BLOCK_K + n
                if q0 + i < seq_len and col < num_keys:
                    visible = (col >= ks_s[i]) & (col < ke_s[i])
                    Scores[by, q0 + i, col] = T.if_then_else(visible, T.cast(sums[n, i], bf16), -T.infinity(bf16))

    @T.prim_func
    def v41_scores(
        Q: T.Tensor([batch, seq_len * heads, index_dim], bf16),
        K: T.Tensor([batch, num_keys, index_dim], bf16),
        W: T.Tensor([batch, seq_len, heads], bf16),
        KS: T.Tensor([batch, seq_len], i32),
        KE: T.Tensor([batch, seq_len], i32),
        Scores: T.Tensor([batch, seq_len, num_keys], bf16),
    ):
        with T.Kernel(T.ceildiv(seq_len, block_q), batch, threads=THREADS) as (bx, by):
            tx = T.get_thread_binding()
            q_shared = T.alloc_shared([rows, index_dim], bf16)
            k_shared = T.alloc_shared([num_stages, BLOCK_K, index_dim], bf16)
            q_ready = T.alloc_barrier([128])  # the producer warpgroup arrives
            full = T.alloc_barrier([128] * num_stages)
            empty = T.alloc_barrier([128] * num_stages)  # the consumer warpgroup of the tile arrives
            acc_0 = T.alloc_fragment([BLOCK_K, rows], f32)
            acc_1 = T.alloc_fragment([BLOCK_K, rows], f32)
            # Per-head terms r (bf16, the head-sum wgmma's A operand) and E (its B operand).
            r_0 = T.alloc_fragment([BLOCK_K, rows], bf16) if head_sum_wgmma else None
            r_1 = T.alloc_fragment([BLOCK_K, rows], bf16) if head_sum_wgmma else None
            e_shared = T.alloc_shared([sum_columns, rows], bf16) if head_sum_wgmma else None
            sums_0 = T.alloc_fragment([BLOCK_K, sum_columns if head_sum_wgmma else block_q], f32)
            sums_1 = T.alloc_fragment([BLOCK_K, sum_columns if head_sum_wgmma else block_q], f32)
            w_0 = T.alloc_fragment([block_q, heads], bf16)
            w_1 = T.alloc_fragment([block_q, heads], bf16)
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
            if head_sum_wgmma:
                for i, c in T.Parallel(sum_columns, rows):
                    e_shared[i, c] = T.if_then_else(c // heads == i, T.cast(1, bf16), T.cast(0, bf16))
            for i in T.Parallel(block_q):
                inside = q0 + i < seq_len
                ks_s[i] = T.if_then_else(inside, KS[by, T.min(q0 + i, seq_len - 1)], 0)
                ke_s[i] = T.if_then_else(inside, KE[by, T.min(q0 + i, seq_len - 1)], 0)
            # Key tiles aligned to BLOCK_K: at most one partial tile per query tile.
            first = lo // BLOCK_K
            last = T.if_then_else(hi > lo, T.ceildiv(hi, BLOCK_K), first)
            tiles = last - first
            T.sync_threads()

            if tx < 128:
                T.dec_max_nreg(producer_registers)
                producer(Q, K, Scores, q_shared, k_shared, q_ready, full, empty, by, q0, first, last, seq_len, num_keys)
            elif tx < 256:
                T.inc_max_nreg(consumer_registers)
                consumer(0, acc_0, r_0, e_shared, sums_0, w_0, q_shared, k_shared, full, empty, q_ready, ks_s, ke_s, W, Scores, by, q0, first, tiles)
            else:
                T.inc_max_nreg(consumer_registers)
                consumer(1, acc_1, r_1, e_shared, sums_1, w_1, q_shared, k_shared, full, empty, q_ready, ks_s, ke_s, W, Scores, by, q0, first, tiles)

    return v41_scores


# ----------------------------------------------------------------------------------------------
# Launch wrappers
# ----------------------------------------------------------------------------------------------


def _check_inputs(q, k, w) -> tuple[int, int, int, int, int]:
    check_tensor("q", q, ndim=4, dtypes=(torch.bfloat16,))
    if not q.is_cuda:
        raise ValueError(f"q must be a CUDA tensor for the TileLang scorer, got {q.device}")
    batch, queries, heads, dim, num_keys = check_qkw(q, k, w, dtypes=((torch.bfloat16,),) * 3)
    check_heads("q", heads)
    if dim % 16 or not 16 <= dim <= MAX_INDEX_DIM:
        raise ValueError(f"q's index dim must be a multiple of 16 in [16, {MAX_INDEX_DIM}], got {dim}")
    return batch, queries, heads, dim, num_keys


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


# Word widths (bytes) a bool mask row is read in, widest first, with the integer dtype of each.
_WORDS = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))


def _byte_of_bit(bit: torch.Tensor, width: int) -> torch.Tensor:
    """Index of the byte holding the (single, or highest) set bit of ``bit`` (> 0, a bool byte's
    bit 0 of each byte): the number of byte boundaries 2^(8j), j >= 1, at or below it."""
    byte = torch.zeros_like(bit)
    for j in range(1, width):
        byte += bit >= (1 << (8 * j))
    return byte


def mask_ranges(allowed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Tightest ``[ks, ke)`` int32 [B, S] around each query's allowed keys (ks = ke = 0 if none).

    One read of the mask: each row is viewed as 8-byte words (4, 2 or 1 where K or the storage
    offset is not a multiple), and ``words != 0`` is the only pass over the [B, S, K] bytes; the
    first and last nonzero word of a row come from that 1/8-size map, and the byte inside each
    from integer compares on [B, S]. No value is read on the host.
    """
    batch, queries, num_keys = allowed.shape
    ks = torch.zeros((batch, queries), dtype=torch.int32, device=allowed.device)
    ke = torch.zeros_like(ks)
    if allowed.numel() == 0:
        return ks, ke
    allowed = allowed.contiguous()
    width, dtype = next((w, d) for w, d in _WORDS if num_keys % w == 0 and allowed.storage_offset() % w == 0)
    words = allowed.view(torch.uint8).view(dtype)  # [B, S, K / width]
    nonzero = (words != 0).view(torch.uint8)
    # argmax gives the first maximum: the first nonzero word, and from the right the last.
    first_word = nonzero.argmax(-1, keepdim=True)
    last_word = nonzero.shape[-1] - 1 - nonzero.flip(-1).argmax(-1, keepdim=True)
    seen = nonzero.gather(-1, first_word).squeeze(-1).bool()
    first, last = first_word.squeeze(-1) * width, last_word.squeeze(-1) * width
    if width > 1:
        # A bool byte is 0 or 1, so no word has its sign bit set: the signed values are the bits.
        low, high = words.gather(-1, first_word).squeeze(-1).long(), words.gather(-1, last_word).squeeze(-1).long()
        first = first + _byte_of_bit(low & -low, width)  # the lowest set byte (little-endian: lowest key)
        last = last + _byte_of_bit(high, width)  # the highest set byte
    ks.copy_(torch.where(seen, first, 0))
    ke.copy_(torch.where(seen, last + 1, 0))
    return ks, ke


@torch.no_grad()
def v41_scores_masked_tilelang(q, k, w, allowed, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """V4.1 scores bf16 ``[B, S, K]`` on the GPU with a dense bool ``allowed [B, S, K]``.

    The mask is honoured elementwise (it need not be a range): the range kernel scores each
    query's [first allowed, last allowed] span (``mask_ranges``: one read of the mask), then the
    keys the mask drops inside it become -inf (one more read of the mask beside the scores, in
    place, no negated copy). Reading the mask byte by byte in the kernel's store loop measured
    10.4 ms at S = 32K, K = 8K, where the range kernel alone takes 4 ms.
    """
    batch, queries, heads, dim, num_keys = _check_inputs(q, k, w)
    check_tensor("allowed", allowed, ndim=3, dtypes=(torch.bool,), shape=(batch, queries, num_keys), device=q.device)
    out = _check_out(out, batch, queries, num_keys, q.device)
    if out.numel() == 0:
        return out
    ks, ke = mask_ranges(allowed)
    v41_scores_tilelang(q, k, w, ks, ke, out=out)
    return torch.where(allowed, out, out.new_full((), float("-inf")), out=out)


def indexer_scores_tilelang(queries, keys, weights, allowed=None, ks=None, ke=None) -> torch.Tensor:
    """Dispatch seam of ``interface.indexer_scores``: the dense mask or the (ks, ke) form."""
    if allowed is not None:
        return v41_scores_masked_tilelang(queries, keys, weights, allowed)
    return v41_scores_tilelang(queries, keys, weights, ks, ke)
