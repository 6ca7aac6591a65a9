"""TileLang kernels of the V4 indexer for Hopper: fp32 logits forward, top-k scores backward.

Math (docs/semantics.md "Index scoring", V4): logit(i, j) = sum_h w[i, h] * relu(q[i, h] . k[j]), fp32 products
and sums, -inf outside [ks[i], ke[i]). The backward sends the gradient of the gathered top-k
scores to q, k and w (relu' = 1 where q.k > 0; nothing for -1 or invisible indices).

Cost model (S = 32768, K = 8192, H = 64, D = 128, causal, B = 1), then H200 measurements:
- forward: 2*H*D = 16 KFLOP per visible (query, key) pair, S*K/2 pairs -> 2.2e12 FLOP (2.9 ms at
  766 TFLOP/s); the fp32 logits are S*K*4 = 1 GiB written once (~0.25 ms of HBM, measured as a
  fill). Every query tile re-reads keys from L2: 256 (query, head) rows per tile make that 16 KiB
  of K per 4.2 MFLOP 64-key tile. Keys sit in the GEMM's M and (query, head) rows in N, so the
  head sum is in-thread plus a quad shuffle. The schedule is the V4.1 scorer's ping-pong
  (``ops/_pingpong.py``); the epilogue (relu, weight, fp32 head sum, stores) is shorter than
  V4.1's register version, so the overlap gained less: 4.62-4.70 ms against 4.77-4.80 ms for
  TileLang's automatic warp specialisation in the same A/B run; in the benchmark 4.69 ms = 469
  TFLOP/s (61 % of 766), built-in batched_indexer_fwd 9.95 ms.
- backward (T = 512): three [T, H] x D products per query, 3*2*H*T*D = 25 MFLOP, 8.2e11 FLOP in
  all; T*D*2 = 128 KiB of gathered keys per query from L2 (K is only 2 MiB); dk receives S*T*D
  = 2.1e9 fp32 additions. Queries select overlapping but unaligned key sets, so there is no
  dense tile to reduce in registers: each query's [T, D] contribution goes to an fp32 [B, K, D]
  buffer with 16-byte red.global.add (one warp per 512-byte row), the alternative (inverting
  the index lists with a sort, then gathering queries per key) costing a 16.7M-entry sort and a
  second gather pass. The block is latency-bound (small GEMMs, dependent gathers): one
  warpgroup per query, the next step's keys prefetched with cp.async. Measured 5.4 ms
  (150 TFLOP/s); fwd + torch.topk(512) + bwd 14.7 ms against the built-in 29.1 ms.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

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
from nemo_dsa.ops._tilelang import compile_cached, tilelang

# ----------------------------------------------------------------------------------------------
# Configurations: the one table the wrappers pick from (and the lowering tests enumerate).
# ----------------------------------------------------------------------------------------------

SUPPORTED_HEADS = (1, 2, 4, 8, 16, 32, 64, 128)
SUPPORTED_DIMS = (64, 128, 256)


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


def _check_kernel_shape(heads: int, index_dim: int) -> None:
    """The table covers these shapes only (the wrappers pad others to them, ``padded_shape``);
    TileLang fails on others with a layout error deep in lowering."""
    if heads not in SUPPORTED_HEADS:
        raise ValueError(f"heads must be one of {SUPPORTED_HEADS} for a kernel, got {heads}")
    if index_dim not in SUPPORTED_DIMS:
        raise ValueError(f"index_dim must be one of {SUPPORTED_DIMS} for a kernel, got {index_dim}")


@dataclass(frozen=True)
class ForwardConfig:
    heads: int
    index_dim: int
    block_q: int  # queries per tile: block_q * heads rows form the GEMM's N
    num_stages: int  # 64-key tiles in flight (shared-memory ring)
    producer_registers: int = PRODUCER_REGISTERS
    consumer_registers: int = CONSUMER_REGISTERS

    def as_kwargs(self) -> dict:
        return dict(self.__dict__)

    def pass_configs(self) -> dict:
        return dict(PASS_CONFIGS)

    def shared_memory_bytes(self) -> int:
        """Queries, the key ring and the tile's fp32 weights."""
        rows = self.block_q * self.heads
        return pingpong_shared_memory_bytes(rows, self.index_dim, self.num_stages) + 4 * rows


@dataclass(frozen=True)
class BackwardConfig:
    heads: int
    index_dim: int
    block_t: int  # gathered keys per step
    threads: int
    dk_reduce: str  # "registers": 8-byte atomics from the GEMM fragment; "shared_x4": staged, 16-byte
    # (both measured within 2 % of each other at the benchmark shape)
    num_stages: int  # 1: prefetch the next step's gathered keys (cp.async) during the dk GEMM

    def as_kwargs(self) -> dict:
        return dict(self.__dict__)


def forward_config(heads: int, index_dim: int) -> ForwardConfig:
    """Tile shape for ``heads`` x ``index_dim``: ~256 (query, head) rows, 64-key tiles, 4 in flight.

    256 rows is wgmma's widest N: each 16 KiB key tile read from L2 feeds 4.2 MFLOP (128 rows
    measured 3.5 % slower on the H200 at the benchmark shape). D = 256 uses 128 rows.
    """
    _check_kernel_shape(heads, index_dim)
    # wgmma N must be a multiple of 8: grow the query tile until block_q * heads is.
    # D = 256 halves the rows so queries + two key stages fit in 227 KiB of shared memory.
    rows = 256 if index_dim <= 128 else 128
    step = 8 // math.gcd(heads, 8)
    block_q = _round_up(max(1, -(-rows // heads)), step)
    if block_q * heads > 256:  # heads that do not divide 256: stay within one wgmma N
        block_q = max(step, (256 // heads) // step * step)
    return ForwardConfig(heads, index_dim, block_q, num_stages=4)


def backward_config(heads: int, index_dim: int) -> BackwardConfig:
    """One query per block; enough warpgroups that the four fp32 fragments fit in registers."""
    _check_kernel_shape(heads, index_dim)
    block_t = 64
    hp = _round_up(heads, 16)
    fragment_floats = index_dim * hp + block_t * index_dim + 2 * block_t * hp
    threads = 128
    # Few threads per block leave room for several blocks per SM, which hides the gather latency:
    # at H=64, D=128 one warpgroup (254 registers, 2 blocks/SM) ran 5.4 ms against 7.7 ms for two.
    # With 16 (padded) heads TileLang cannot split P over two warpgroups (conflicting shared
    # layouts for p_shared), and one warpgroup holds those fragments in <= 176 registers anyway.
    while hp > 16 and fragment_floats // threads > 192 and threads < 512:
        threads *= 2
    return BackwardConfig(heads, index_dim, block_t, threads, dk_reduce="shared_x4", num_stages=1)


def dispatched_configs() -> list[tuple[ForwardConfig, BackwardConfig]]:
    """Every (forward, backward) configuration the wrappers can pick for the supported shapes."""
    return [(forward_config(h, d), backward_config(h, d)) for h in SUPPORTED_HEADS for d in SUPPORTED_DIMS]


# ----------------------------------------------------------------------------------------------
# Forward: logits [B, S, K] fp32
# ----------------------------------------------------------------------------------------------


def v4_logits_kernel(
    heads: int, index_dim: int, block_q: int, num_stages: int, producer_registers: int, consumer_registers: int
):
    """PrimFunc of the V4 logits for one (heads, index_dim, tile) configuration.

    Grid: (query tiles, batch). A tile of ``block_q`` queries keeps its [block_q * heads, D]
    queries in shared memory and walks only the 64-key tiles of [min ks, max ke) of its queries,
    heaviest tiles first (causal rows grow with the query index), in the ping-pong schedule of
    ``ops/_pingpong.py``. Columns outside that range get -inf from the producer warpgroup, so
    every output element is written exactly once.
    """
    T = tilelang().language
    rows = block_q * heads
    bf16, f32, i32 = T.bfloat16, T.float32, T.int32
    batch, seq_len, num_keys = T.dynamic("batch"), T.dynamic("seq_len"), T.dynamic("num_keys")
    producer, first_turn, multiply = pingpong_macros(heads, block_q, num_stages)

    @T.macro
    def consumer(me, acc, logits, w_shared, q_shared, k_shared, full, empty, q_ready, ks_s, ke_s, Logits, by, q0, first, tiles):
        """Consumer ``me`` (0 or 1) scores key tiles me, me + 2, ... of the query tile."""
        first_turn(me, q_ready)
        for j in T.serial(T.ceildiv(tiles - me, 2)):
            t = 2 * j + me
            multiply(me, t, acc, q_shared, k_shared, full, empty)
            per_head = T.reshape(acc, (BLOCK_K, block_q, heads))
            for n, i, h in T.Parallel(BLOCK_K, block_q, heads):
                per_head[n, i, h] = T.max(per_head[n, i, h], 0) * w_shared[i, h]
            # A key row of a query's heads lives in one thread quad: in-thread adds, two shuffles.
            T.reduce_sum(per_head, logits, dim=2)
            for n, i in T.Parallel(BLOCK_K, block_q):
                col = (first + t) * BLOCK_K + n
                if q0 + i < seq_len and col < num_keys:
                    Logits[by, q0 + i, col] = T.if_then_else(
                        (col >= ks_s[i]) & (col < ke_s[i]), logits[n, i], -T.infinity(f32)
                    )

    @T.prim_func
    def v4_logits_fwd(
        Q: T.Tensor([batch, seq_len * heads, index_dim], bf16),
        K: T.Tensor([batch, num_keys, index_dim], bf16),
        W: T.Tensor([batch, seq_len, heads], f32),
        KS: T.Tensor([batch, seq_len], i32),
        KE: T.Tensor([batch, seq_len], i32),
        Logits: T.Tensor([batch, seq_len, num_keys], f32),
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
            logits_0 = T.alloc_fragment([BLOCK_K, block_q], f32)
            logits_1 = T.alloc_fragment([BLOCK_K, block_q], f32)
            # fp32 weights in registers would take 64 a thread next to the 128 accumulators and
            # spill (ptxas): both consumers read them from shared memory instead.
            w_shared = T.alloc_shared([block_q, heads], f32)
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
                w_shared[i, h] = T.if_then_else(q0 + i < seq_len, W[by, T.min(q0 + i, seq_len - 1), h], 0)
            # Key tiles aligned to BLOCK_K: at most one partial tile per query tile.
            first = lo // BLOCK_K
            last = T.if_then_else(hi > lo, T.ceildiv(hi, BLOCK_K), first)
            tiles = last - first
            T.sync_threads()

            if tx < 128:
                T.dec_max_nreg(producer_registers)
                producer(Q, K, Logits, q_shared, k_shared, q_ready, full, empty, by, q0, first, last, seq_len, num_keys)
            elif tx < 256:
                T.inc_max_nreg(consumer_registers)
                consumer(0, acc_0, logits_0, w_shared, q_shared, k_shared, full, empty, q_ready, ks_s, ke_s, Logits, by, q0, first, tiles)
            else:
                T.inc_max_nreg(consumer_registers)
                consumer(1, acc_1, logits_1, w_shared, q_shared, k_shared, full, empty, q_ready, ks_s, ke_s, Logits, by, q0, first, tiles)

    return v4_logits_fwd


# ----------------------------------------------------------------------------------------------
# Backward through the gathered top-k scores
# ----------------------------------------------------------------------------------------------


def v4_topk_backward_kernel(heads: int, index_dim: int, block_t: int, threads: int, dk_reduce: str = "registers", num_stages: int = 0
):
    """PrimFunc of the V4 top-k backward for one configuration. Grid: (queries, batch).

    Per query, ``block_t`` gathered keys at a time: s = Kg q^T [block_t, H]; dw += g relu(s);
    P = g w [s > 0] (bf16, in shared memory); dq^T += Kg^T P; dKg = P q, added to dk with
    fp32 atomics. Heads are zero-padded to a multiple of 16 (the wgmma K step of dKg = P q).
    Indices of -1, outside [0, K) or outside the query's [ks, ke) are skipped (g = 0).
    """
    if dk_reduce not in ("registers", "shared_x4"):
        raise ValueError(f"dk_reduce must be 'registers' or 'shared_x4', got {dk_reduce!r}")
    T = tilelang().language
    hp = _round_up(heads, 16)
    D = index_dim
    bf16, f32, i32 = T.bfloat16, T.float32, T.int32
    batch, seq_len, num_keys = T.dynamic("batch"), T.dynamic("seq_len"), T.dynamic("num_keys")
    topk = T.dynamic("topk")

    @T.prim_func
    def v4_topk_bwd(
        Q: T.Tensor([batch, seq_len, heads, D], bf16),
        K: T.Tensor([batch, num_keys, D], bf16),
        W: T.Tensor([batch, seq_len, heads], f32),
        KS: T.Tensor([batch, seq_len], i32),
        KE: T.Tensor([batch, seq_len], i32),
        Idx: T.Tensor([batch, seq_len, topk], i32),
        G: T.Tensor([batch, seq_len, topk], f32),
        DQ: T.Tensor([batch, seq_len, heads, D], bf16),
        DW: T.Tensor([batch, seq_len, heads], f32),
        DK: T.Tensor([batch, num_keys, D], f32),
    ):
        with T.Kernel(seq_len, batch, threads=threads) as (bx, by):
            q_shared = T.alloc_shared([hp, D], bf16)
            kg_shared = T.alloc_shared([block_t, D], bf16)
            p_shared = T.alloc_shared([block_t, hp], bf16)
            idx_s = T.alloc_shared([block_t], i32)
            g_s = T.alloc_shared([block_t], f32)
            w_s = T.alloc_shared([hp], f32)
            s_frag = T.alloc_fragment([block_t, hp], f32)
            dw_acc = T.alloc_fragment([block_t, hp], f32)
            dw_frag = T.alloc_fragment([hp], f32)
            dqt_frag = T.alloc_fragment([D, hp], f32)
            dkg_frag = T.alloc_fragment([block_t, D], f32)
            dkg_shared = T.alloc_shared([block_t, D], f32) if dk_reduce != "registers" else None

            start = T.max(KS[by, bx], 0)
            end = T.min(KE[by, bx], num_keys)
            for h, d in T.Parallel(hp, D):
                q_shared[h, d] = T.if_then_else(h < heads, Q[by, bx, T.min(h, heads - 1), d], T.cast(0, bf16))
            for h in T.Parallel(hp):
                w_s[h] = T.if_then_else(h < heads, W[by, bx, T.min(h, heads - 1)], 0)
            T.clear(dw_acc)
            T.clear(dqt_frag)
            for c in T.Pipelined(T.ceildiv(topk, block_t), num_stages=num_stages):
                for t in T.Parallel(block_t):
                    j = c * block_t + t
                    raw = T.if_then_else(j < topk, Idx[by, bx, T.min(j, topk - 1)], -1)
                    live = (raw >= start) & (raw < end)
                    idx_s[t] = T.if_then_else(live, raw, -1)
                    g_s[t] = T.if_then_else(live, G[by, bx, T.min(j, topk - 1)], 0)
                # Gather straight from the index tensor (not idx_s) so the pipeline can prefetch it;
                # masked slots read a clamped real row and get g = 0.
                for t, d in T.Parallel(block_t, D):
                    kg_shared[t, d] = K[by, T.min(T.max(Idx[by, bx, T.min(c * block_t + t, topk - 1)], 0), num_keys - 1), d]
                T.gemm(kg_shared, q_shared, s_frag, transpose_B=True, clear_accum=True)
                for t, h in T.Parallel(block_t, hp):
                    dw_acc[t, h] += g_s[t] * T.max(s_frag[t, h], 0)
                    p_shared[t, h] = T.if_then_else(s_frag[t, h] > 0, g_s[t] * w_s[h], 0)
                T.gemm(kg_shared, p_shared, dqt_frag, transpose_A=True)
                T.gemm(p_shared, q_shared, dkg_frag, clear_accum=True)
                if dk_reduce == "registers":
                    for t, d in T.Parallel(block_t, D):
                        if idx_s[t] >= 0:
                            T.atomic_add(DK[by, idx_s[t], d], dkg_frag[t, d])
                else:  # staged through shared memory: one warp adds a whole 4*D-byte row, 16 B a lane
                    T.copy(dkg_frag, dkg_shared)
                    for t, d in T.Parallel(block_t, D):
                        if idx_s[t] >= 0:
                            T.atomic_add(DK[by, idx_s[t], d], dkg_shared[t, d])
            T.reduce_sum(dw_acc, dw_frag, dim=0)
            for h in T.Parallel(hp):
                if h < heads:
                    DW[by, bx, h] = dw_frag[h]
            for d, h in T.Parallel(D, hp):
                if h < heads:
                    DQ[by, bx, h, d] = T.cast(dqt_frag[d, h], bf16)

    return v4_topk_bwd


# ----------------------------------------------------------------------------------------------
# Launch wrappers
# ----------------------------------------------------------------------------------------------


def _check_qkw(q, k, w):
    check_tensor("q", q, ndim=4, dtypes=(torch.bfloat16,))
    if not q.is_cuda:
        raise ValueError(f"q must be a CUDA tensor for the TileLang kernels, got {q.device}")
    batch, queries, heads, dim, num_keys = check_qkw(
        q, k, w, dtypes=((torch.bfloat16,), (torch.bfloat16,), (torch.float32,))
    )
    if not 1 <= heads <= 128:
        raise ValueError(f"q must have 1 to 128 heads, got {heads}")
    if dim % 16 or not 16 <= dim <= 256:
        raise ValueError(f"q must have a head dim that is a multiple of 16 in [16, 256], got {dim}")
    return batch, queries, heads, dim, num_keys


def kernel_refusal(heads: int, dim: int) -> str | None:
    """Why the V4 indexer kernels cannot take ``heads`` x ``dim`` queries (the limits
    :func:`_check_qkw` enforces), or None when they can."""
    if not 1 <= heads <= 128:
        return f"the V4 indexer kernels take 1 to 128 index heads, got {heads}"
    if dim % 16 or not 16 <= dim <= 256:
        return f"the V4 indexer kernels take an index head dim that is a multiple of 16 in [16, 256], got {dim}"
    return None


def padded_shape(heads: int, dim: int) -> tuple[int, int]:
    """The smallest table entry holding ``heads`` x ``dim``: other shapes run zero-padded."""
    return (next(h for h in SUPPORTED_HEADS if h >= heads), next(d for d in SUPPORTED_DIMS if d >= dim))


def pad_inputs(q, k, w, heads_to: int, dim_to: int):
    """Zero-pad heads (with zero weights) and the head dim: every added term is an exact +0."""
    heads, dim = q.shape[2], q.shape[3]
    if (heads, dim) == (heads_to, dim_to):
        return q, k, w
    pad_d, pad_h = dim_to - dim, heads_to - heads
    q = torch.nn.functional.pad(q, (0, pad_d, 0, pad_h))
    return q, torch.nn.functional.pad(k, (0, pad_d)), torch.nn.functional.pad(w, (0, pad_h))


def _check_ks_ke_shapes(ks, ke, batch, queries, device):
    for name, value in (("ks", ks), ("ke", ke)):
        check_tensor(name, value, ndim=2, dtypes=(torch.int32,), shape=(batch, queries), device=device)


def v4_logits_tilelang(q, k, w, ks, ke, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """V4 logits fp32 ``[B, S, K]`` on the GPU, -inf outside ``[ks, ke)``.

    Heads 1..128 and head dims that are multiples of 16 up to 256; shapes outside the kernel
    table (heads not a power of two, D not 64/128/256) run zero-padded, which is exact.

    Args: q [B, S, H, D] bf16, k [B, K, D] bf16, w [B, S, H] fp32, ks/ke int32 [B, S] (values
    are clamped to [0, K] inside the kernel for memory safety; the public API validates them).
    ``out`` (optional, fp32 [B, S, K] contiguous) receives the result; every element is written.
    """
    batch, queries, heads, dim, num_keys = _check_qkw(q, k, w)
    _check_ks_ke_shapes(ks, ke, batch, queries, q.device)
    if out is None:
        out = torch.empty((batch, queries, num_keys), dtype=torch.float32, device=q.device)
    else:
        check_tensor("out", out, dtypes=(torch.float32,), shape=(batch, queries, num_keys), device=q.device)
        if not out.is_contiguous():
            raise ValueError("out must be contiguous")
    if out.numel() == 0:
        return out
    heads_to, dim_to = padded_shape(heads, dim)
    q, k, w = pad_inputs(q, k, w, heads_to, dim_to)
    config = forward_config(heads_to, dim_to)
    kernel = compile_cached(v4_logits_kernel, pass_configs=config.pass_configs(), **config.as_kwargs())
    q_rows = q.contiguous().view(batch, queries * heads_to, dim_to)
    kernel(q_rows, k.contiguous(), w.contiguous(), ks.contiguous(), ke.contiguous(), out)
    return out


def v4_topk_backward_tilelang(
    q,
    k,
    w,
    topk_indices,
    grad_scores,
    ks: torch.Tensor | None = None,
    ke: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of ``sum(grad_scores * logits.gather(-1, topk_indices))`` w.r.t. q, k, w.

    Args: q [B, S, H, D] bf16, k [B, K, D] bf16, w [B, S, H] fp32, topk_indices int32 [B, S, T],
    grad_scores fp32 [B, S, T]; ks/ke int32 [B, S] (optional, default: every key visible). An
    index outside the query's visible range or outside [0, K) carries no gradient and is never
    read (:func:`dead_slots_to_zero_row`), so the launch is memory-safe for any index; the public
    API validates them. Returns dq bf16 [B, S, H, D], dk bf16 [B, K, D] (fp32 accumulation), dw
    fp32 [B, S, H].
    """
    batch, queries, heads, dim, num_keys = _check_qkw(q, k, w)
    check_tensor("topk_indices", topk_indices, ndim=3, dtypes=(torch.int32,), device=q.device)
    count = topk_indices.shape[-1]
    check_tensor("topk_indices", topk_indices, shape=(batch, queries, count))
    check_tensor("grad_scores", grad_scores, dtypes=(torch.float32,), shape=(batch, queries, count), device=q.device)
    if (ks is None) != (ke is None):
        raise ValueError("ks and ke must be given together")
    if ks is None:
        ks = torch.zeros((batch, queries), dtype=torch.int32, device=q.device)
        ke = torch.full((batch, queries), num_keys, dtype=torch.int32, device=q.device)
    _check_ks_ke_shapes(ks, ke, batch, queries, q.device)

    if queries == 0 or count == 0 or num_keys == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(w)
    heads_to, dim_to = padded_shape(heads, dim)
    q, k, w = pad_inputs(q, k, w, heads_to, dim_to)
    k_rows, indices_rows, ks_rows, ke_rows = dead_slots_to_zero_row(k, topk_indices, ks, ke)
    dk_acc = torch.zeros((batch, num_keys + 1, dim_to), dtype=torch.float32, device=q.device)
    dq = torch.empty((batch, queries, heads_to, dim_to), dtype=torch.bfloat16, device=q.device)
    dw = torch.empty((batch, queries, heads_to), dtype=torch.float32, device=q.device)
    kernel = compile_cached(v4_topk_backward_kernel, **backward_config(heads_to, dim_to).as_kwargs())
    kernel(
        q.contiguous(), k_rows, w.contiguous(), ks_rows, ke_rows, indices_rows, grad_scores.contiguous(), dq, dw, dk_acc,
    )
    dk_acc = dk_acc[:, 1:]  # row 0 is the zero row: it never receives gradient
    if (heads_to, dim_to) != (heads, dim):
        return dq[:, :, :heads, :dim].contiguous(), dk_acc[..., :dim].to(torch.bfloat16), dw[..., :heads].contiguous()
    return dq, dk_acc.to(torch.bfloat16), dw


def dead_slots_to_zero_row(k, topk_indices, ks, ke):
    """Point every dead slot (-1, outside [0, K) or outside the query's [ks, ke)) at a zero key row.

    The backward kernel gathers a real row for a dead slot and relies on g = 0 there, but
    0 * NaN = NaN: a non-finite key the query never selected (or key 0, read for -1) would turn
    its dq NaN. With a zero row in front (row 0; key j moves to row j + 1) and dead slots
    pointing at it, the kernel skips them (the ranges become [1, K + 1)) and their products are
    exact zeros. Returns (k with the zero row, contiguous; indices; ks; ke), all contiguous.
    """
    batch, num_keys = k.shape[0], k.shape[1]
    k_rows = torch.nn.functional.pad(k, (0, 0, 1, 0)).contiguous()
    live = (topk_indices >= ks.unsqueeze(-1)) & (topk_indices < ke.unsqueeze(-1))
    live &= (topk_indices >= 0) & (topk_indices < num_keys)
    indices_rows = torch.where(live, topk_indices + 1, 0).to(torch.int32).contiguous()
    ks_rows = torch.ones((batch, ks.shape[1]), dtype=torch.int32, device=k.device)
    ke_rows = torch.full_like(ks_rows, num_keys + 1)
    return k_rows, indices_rows, ks_rows, ke_rows
