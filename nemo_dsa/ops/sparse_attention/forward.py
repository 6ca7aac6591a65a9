"""The forward kernel: one query and 64 of its heads per block, hand warp-specialised, the two
consumer warpgroups taking turns on whole key tiles.

384 threads in three warpgroups: the producer (warpgroup 0) and two consumers. The producer gathers each 64-key
tile with 16-byte cp.async into two ring stages (one per consumer); rows the query must not see
are zero-filled by the copy itself (a zero source size), never loaded, so a NaN or inf in an
unseen key cannot reach a product.

The schedule is FlashMLA's sparse prefill on Hopper (the facts taken from its sm90 kernel; this
is our own TileLang kernel): a round is two 64-key tiles, A = tile 2r in stage 0 and B = tile
2r + 1 in stage 1. Consumer 0 scores A, consumer 1 scores B, each with one m64n64 S = Q K^T over
all of D (no half-width wgmma, and each warpgroup reads its key tile once for S). Consumer 0 then
owns O[:, :D/2], consumer 1 O[:, D/2:]: each adds its own tile's P from registers (``wgmma`` with
A in registers) and the other's P from shared memory.

One running max is kept by handing it over within a round: consumer 0 publishes A's new max,
consumer 1 folds in B's and publishes the round's max, and consumer 0 rescales its O, its row
sums and its P of A to it before handing that P over. Because the two work on different tiles,
one's softmax runs while the other's GEMMs keep the tensor cores busy.

Each stage's two D halves (the ring's ``k_l`` / ``k_r``) are freed separately, so the producer
refills a half as soon as its last reader is done:

| half | read by | freed by |
|---|---|---|
| stage 0 left | consumer 0: S of A, its P V | consumer 0 after its own P V |
| stage 0 right | consumer 0: S of A; consumer 1: P(A) V | consumer 1 after that P V |
| stage 1 right | consumer 1: S of B, its P V | consumer 1 after its own P V |
| stage 1 left | consumer 1: S of B; consumer 0: P(B) V | consumer 0 after that P V |

(A reader of S finished before the other consumer can start on the half: the hand-over of the
max comes after each consumer's S.) An odd tile count gets one more tile, every key of it
unseen (zero-filled, scored -inf), so every round has two tiles.

Q comes by TMA, issued at the block's start before the index row is read, and O leaves by TMA
from shared memory (FlashMLA's order), so neither waits on the index row's barrier. Outputs:
O [B, S, H, D] bf16 and the natural-log lse [B, S, H] fp32; a query that sees nothing (no key, no
sink) gets zero output and -inf lse.
"""

import re

from nemo_dsa.ops._tilelang import tilelang
from nemo_dsa.ops.sparse_attention.configs import (
    BLOCK_HEADS,
    BLOCK_KEYS,
    CONSUMER_REGISTERS,
    FWD_THREADS,
    LOG2E,
    M_FLOOR,
    MAX_SELECTED,
    PRODUCER_REGISTERS,
)
from nemo_dsa.ops.sparse_attention.tiles import column_seen_macro, query_plan_macro

# The producers do not wait for their own copies: each thread's cp.async arrive on the stage's
# mbarrier when they land (cp.async.mbarrier.arrive.noinc; the barriers count the 128 producer
# threads), so a producer issues the next tile's rows at once. The index row the copies read
# lives in static shared memory: in the dynamic buffer, beside the tiles the cp.async write,
# TileLang put a barrier before every row's copy.
NO_COPY_WAIT = {"parallel_async_without_async_commit_wait": True}

EXCHANGE_BARRIER = 8  # the two consumers' 256-thread barrier (Q shared, row sums exchanged)
# Each consumer's 128-thread barrier before it reads its tile's column flags. Both consumers
# name this id; separate_role_barriers gives each its own.
FLAGS_BARRIER = 10
# A row's reference max moves only when a logit exceeds it by more than this (log2 units):
# P <= 2^8 in bf16 loses nothing (its relative rounding does not depend on scale), and the sums
# stay far from fp32's range.
LAZY_RESCALE_LOG2 = 8.0

# Named barriers per role. TileLang numbers the 128-thread barriers of each warpgroup's
# shared-memory syncs itself, and a 128-thread T.sync_threads in code both consumers run
# (FLAGS_BARRIER) names one id for both: two 128-thread roles arriving at one barrier id race or
# deadlock, and an id TileLang picks may be one the kernel names. TileLang has no per-warpgroup
# barrier id, so the generated CUDA of this kernel is rewritten before nvcc builds it
# (register_barrier_postproc): each role's 128-thread barriers get the role's own id.
ROLE_BARRIER_IDS = (11, 12, 13)  # producer, consumer 0, consumer 1 (0 is __syncthreads)
KERNEL_NAME = "sparse_window_fwd_alternating"  # the prim_func below; its CUDA kernel's name starts so
_ROLE_MARK = re.compile(r"warpgroup_reg_(?:alloc|dealloc)<")
_PARTIAL_SYNC = re.compile(r"__sync_thread_partial\(\d+, 128\)")


def separate_role_barriers(code: str) -> str:
    """The forward's CUDA with each role's 128-thread named barriers renumbered to its own id
    (roles start at their setmaxnreg); any other kernel's code is returned unchanged."""
    if KERNEL_NAME not in code:
        return code
    marks = [m.start() for m in _ROLE_MARK.finditer(code)]
    if len(marks) != 3:
        raise RuntimeError(f"{KERNEL_NAME}: expected 3 warpgroup roles in the CUDA, found {len(marks)}")
    parts = [code[: marks[0]]]
    for role, (a, b) in enumerate(zip(marks, marks[1:] + [len(code)])):
        parts.append(_PARTIAL_SYNC.sub(f"__sync_thread_partial({ROLE_BARRIER_IDS[role]}, 128)", code[a:b]))
    return "".join(parts)


def _cuda_postproc(code, _target):
    return separate_role_barriers(code)


_postproc_registered = False


def register_barrier_postproc() -> None:
    """Install :func:`separate_role_barriers` as TileLang's CUDA post-processing hook (the hook
    is process-wide: it passes every other kernel's code through unchanged), once per process;
    the launch wrapper calls it before compiling the forward."""
    global _postproc_registered
    if not _postproc_registered:
        from tilelang.engine.callback import register_cuda_postproc_callback

        register_cuda_postproc_callback(_cuda_postproc)
        _postproc_registered = True


def sparse_window_fwd_kernel(dim: int, mode: str):
    """PrimFunc of the forward for head dim ``dim`` (KERNEL_DIMS) and ``mode`` ("indices": a
    per-query index row; "range": ``[ks, ke)``). Grid: (S, H / 64, B), 384 threads; H a multiple
    of 64 (the wrapper zero-pads q's heads: padded heads compute rows nobody reads).

    Arguments: Q [B, S, H, D], Raw [B, N_raw, D], Comp [B, K, D] (bf16), WindowStart [B, S],
    Indices [B, S, T] with KE [B, S] = 1 + its last valid slot, or KS/KE [B, S] (int32), Sink [H]
    fp32, Params [2] fp32 (scale, has_sink), Window [1] int32; out: Out [B, S, H, D] bf16, Lse
    [B, S, H] fp32 (natural log).

    Two savings ride on the hand-over: each consumer's mask comes from 64 column flags it writes
    for its next tile at the end of a round (one 128-thread barrier a round before reading them),
    so a logit's mask is one shared load and a select; and the reference max moves only when a
    logit exceeds it by more than 2^LAZY_RESCALE_LOG2 (a warp's vote). Consumer 1 repeats
    consumer 0's vote on A from the published maximum (same rows, same floats), so the round's
    reference equals consumer 0's guess unless B moves it, and the correction of O, the row sums
    and P(A) after the hand-over is skipped by a vote when it would multiply by 1."""
    T = tilelang().language
    bf16, f32, i32 = T.bfloat16, T.float32, T.int32
    HB, BK, D, half = BLOCK_HEADS, BLOCK_KEYS, dim, dim // 2
    batch, seq_len, heads = T.dynamic("batch"), T.dynamic("seq_len"), T.dynamic("heads")
    n_raw, n_comp, n_slots = T.dynamic("n_raw"), T.dynamic("n_comp"), T.dynamic("n_slots")
    by_index = mode == "indices"
    idx_shape = [batch, seq_len, n_slots] if by_index else [batch, seq_len]
    query_plan = query_plan_macro(T, by_index)
    column_seen = column_seen_macro(T, by_index)

    @T.macro
    def load_half(Raw, Comp, idx_s, dst, stage, col0, t, b, window_tiles, lo, own, n_sel, ks):
        """Key rows of tile ``t``, columns [col0, col0 + D/2), into dst[stage] by zero-filling
        16-byte cp.async: raw rows by position for window tiles, else compressed rows."""
        if t < window_tiles:
            for r, d in T.Parallel(BK, half, prefer_async=True, annotations=NO_COPY_WAIT):
                dst[stage, r, d] = T.if_then_else(
                    lo + t * BK + r <= own, Raw[b, T.min(lo + t * BK + r, n_raw - 1), col0 + d], T.cast(0, bf16)
                )
        else:
            base = (t - window_tiles) * BK
            if by_index:
                for r, d in T.Parallel(BK, half, prefer_async=True, annotations=NO_COPY_WAIT):
                    dst[stage, r, d] = T.if_then_else(
                        (base + r < n_sel)
                        & (idx_s[T.min(base + r, MAX_SELECTED - 1)] >= 0)
                        & (idx_s[T.min(base + r, MAX_SELECTED - 1)] < n_comp),
                        Comp[b, T.max(idx_s[T.min(base + r, MAX_SELECTED - 1)], 0), col0 + d],
                        T.cast(0, bf16),
                    )
            else:
                for r, d in T.Parallel(BK, half, prefer_async=True, annotations=NO_COPY_WAIT):
                    dst[stage, r, d] = T.if_then_else(
                        base + r < n_sel, Comp[b, T.min(ks + base + r, n_comp - 1), col0 + d], T.cast(0, bf16)
                    )

    @T.macro
    def tile_flags(seen_s, me, parity, t, window_tiles, lo, own, n_sel, idx_s):
        """seen_s[me, parity, c] = 1 where key c of tile ``t`` is seen, else 0 (written once per
        column by the consumer that scores the tile)."""
        for c in T.Parallel(BK):
            seen = column_seen(t, c, window_tiles, lo, own, n_sel, n_comp, idx_s)
            seen_s[me, parity, c] = T.if_then_else(seen, T.float32(1), T.float32(0))

    @T.macro
    def flagged_logits(acc_s, seen_s, me, parity, scale_log2):
        """The mask: acc_s = S * scale * log2(e) where the tile's flag is set, -inf elsewhere."""
        for h, c in T.Parallel(HB, BK):
            acc_s[h, c] = T.if_then_else(seen_s[me, parity, c] > 0.5, acc_s[h, c] * scale_log2, -T.infinity(f32))

    @T.macro
    def warp_any(flag):
        """Non-zero in every lane if ``flag`` is non-zero in any lane of the warp."""
        return T.call_extern(i32, "__any_sync", T.uint32(0xFFFFFFFF), flag)

    @T.macro
    def move_reference(m_new, m_i, alpha, row_sum):
        """The rows' reference max to ``m_new``, their sums rescaled (``alpha`` for O and P)."""
        for h in T.Parallel(HB):
            alpha[h] = T.exp2(m_i[h] - m_new[h])
            m_i[h] = m_new[h]
            row_sum[h] = row_sum[h] * alpha[h]

    @T.macro
    def move_reference_if(vote, m_new, m_i, alpha, row_sum, acc_o):
        """Where the warp's ``vote`` is set: the reference to ``m_new`` and O rescaled with it."""
        if vote != 0:
            move_reference(m_new, m_i, alpha, row_sum)
            for h, d in T.Parallel(HB, half):
                acc_o[h, d] *= alpha[h]

    @T.macro
    def exp_and_sum(acc_s, m_i, tile_sum, row_sum):
        """The tile's logits into P = 2^(logit - m_i) in place, their row sums added."""
        for h, c in T.Parallel(HB, BK):
            acc_s[h, c] = T.exp2(acc_s[h, c] - m_i[h])
        T.reduce_sum(acc_s, tile_sum, dim=1)
        for h in T.Parallel(HB):
            row_sum[h] = row_sum[h] + tile_sum[h]

    @T.macro
    def score(q_first, q_second, k_first, k_second, stage, acc_s, ready_first, ready_second, phase):
        """acc_s = Q K^T of the stage's tile, one D half as soon as it has landed (its barrier in
        ``ready_first``), then the other."""
        T.mbarrier_wait_parity(ready_first[stage], phase)
        T.fence_proxy_async()  # the rows came by cp.async (generic proxy); wgmma reads them (async proxy)
        T.gemm(q_first, k_first[stage, :, :], acc_s, transpose_B=True, clear_accum=True)
        T.mbarrier_wait_parity(ready_second[stage], phase)
        T.fence_proxy_async()
        T.gemm(q_second, k_second[stage, :, :], acc_s, transpose_B=True)

    @T.macro
    def finish(me, acc_o, m_i, row_sum, alpha, sink_f, sum_x, q_half, has_sink, Out, Lse, b, s, h0):
        """Both consumers end on the same max: add the two row sums and the sink, write lse
        (consumer 0) and this consumer's half of O (staged in its half of Q, dead by now)."""
        for h in T.Parallel(HB):
            sum_x[me, h] = row_sum[h]
        T.sync_threads(EXCHANGE_BARRIER, 256)
        for h in T.Parallel(HB):
            final_max = T.max(m_i[h], sink_f[h])
            row_sum[h] = (sum_x[0, h] + sum_x[1, h]) * T.exp2(m_i[h] - final_max) + T.if_then_else(
                has_sink, T.exp2(sink_f[h] - final_max), T.cast(0, f32)
            )
            alpha[h] = T.if_then_else(row_sum[h] > 0, T.exp2(m_i[h] - final_max) / row_sum[h], T.cast(0, f32))
            if me == 0:
                Lse[b, s, h0 + h] = T.if_then_else(
                    row_sum[h] > 0, (final_max + T.log2(row_sum[h])) / LOG2E, -T.infinity(f32)
                )
        for h, d in T.Parallel(HB, half):
            acc_o[h, d] *= alpha[h]
        T.copy(acc_o, q_half)
        T.copy(q_half, Out[b, s, h0 : h0 + HB, me * half : me * half + half])  # by TMA (one thread issues)

    @T.prim_func
    def sparse_window_fwd_alternating(
        Q: T.Tensor([batch, seq_len, heads, D], bf16),
        Raw: T.Tensor([batch, n_raw, D], bf16),
        Comp: T.Tensor([batch, n_comp, D], bf16),
        WindowStart: T.Tensor([batch, seq_len], i32),
        Indices: T.Tensor(idx_shape, i32),
        KE: T.Tensor([batch, seq_len], i32),
        Sink: T.Tensor([heads], f32),
        Params: T.Tensor([2], f32),
        Window: T.Tensor([1], i32),
        Out: T.Tensor([batch, seq_len, heads, D], bf16),
        Lse: T.Tensor([batch, seq_len, heads], f32),
    ):
        with T.Kernel(seq_len, heads // HB, batch, threads=FWD_THREADS) as (s, g, b):
            tx = T.get_thread_binding()
            q_l = T.alloc_shared([HB, half], bf16)
            q_r = T.alloc_shared([HB, half], bf16)
            k_l = T.alloc_shared([2, BK, half], bf16)
            k_r = T.alloc_shared([2, BK, half], bf16)
            p_shared = T.alloc_shared([2, HB, BK], bf16)  # P of A (consumer 0), of B (consumer 1)
            max_s = T.alloc_shared([HB], f32)  # the running max handed over within a round
            sum_x = T.alloc_shared([2, HB], f32)
            idx_s = T.alloc_shared([MAX_SELECTED if by_index else 1], i32, scope="shared")  # static: see NO_COPY_WAIT
            seen_s = T.alloc_shared([2, 2, BK], f32)  # column flags: [consumer, round % 2, key]
            full_l = T.alloc_barrier([128, 128])  # producer threads, per stage
            full_r = T.alloc_barrier([128, 128])
            free_l = T.alloc_barrier([128, 128])  # the half's last reader (table above)
            free_r = T.alloc_barrier([128, 128])
            max_a = T.alloc_barrier([128])  # consumer 0: A's max in max_s
            max_ab = T.alloc_barrier([128])  # consumer 1: the round's max in max_s
            p_a = T.alloc_barrier([128])  # consumer 0: P(A) in p_shared[0]
            p_b = T.alloc_barrier([128])  # consumer 1: P(B) in p_shared[1]
            q_bar = T.alloc_barrier([FWD_THREADS])  # Q landed (every thread arrives; one also expects its bytes)

            acc_s0 = T.alloc_fragment([HB, BK], f32)
            acc_s1 = T.alloc_fragment([HB, BK], f32)
            p_reg0 = T.alloc_fragment([HB, BK], bf16)
            p_reg1 = T.alloc_fragment([HB, BK], bf16)
            acc_o0 = T.alloc_fragment([HB, half], f32)
            acc_o1 = T.alloc_fragment([HB, half], f32)
            m_i0 = T.alloc_fragment([HB], f32)
            m_i1 = T.alloc_fragment([HB], f32)
            m_new0 = T.alloc_fragment([HB], f32)
            m_new1 = T.alloc_fragment([HB], f32)
            row_sum0 = T.alloc_fragment([HB], f32)
            row_sum1 = T.alloc_fragment([HB], f32)
            tile_sum0 = T.alloc_fragment([HB], f32)
            tile_sum1 = T.alloc_fragment([HB], f32)
            alpha0 = T.alloc_fragment([HB], f32)
            alpha1 = T.alloc_fragment([HB], f32)
            sink_f0 = T.alloc_fragment([HB], f32)
            sink_f1 = T.alloc_fragment([HB], f32)
            m_ref1 = T.alloc_fragment([HB], f32)  # consumer 0's reference for A
            vote0 = T.alloc_var(i32)
            vote1 = T.alloc_var(i32)

            h0 = g * HB
            own = s + n_raw - seq_len
            scale_log2 = Params[0] * LOG2E
            has_sink = Params[1] > 0.5
            window = Window[0]
            # Q by TMA before anything else (Q is read once: evict first); the consumers wait for it.
            T.tma_copy(Q[b, s, h0 : h0 + HB, 0:half], q_l, barrier=q_bar[0], eviction_policy="evict_first")
            T.tma_copy(Q[b, s, h0 : h0 + HB, half:D], q_r, barrier=q_bar[0], eviction_policy="evict_first")
            T.mbarrier_arrive(q_bar[0])
            ks, n_sel, lo, window_tiles, tiles = query_plan(idx_s, Indices, KE, WindowStart, window, b, s, own, n_slots)
            rounds = T.ceildiv(tiles, 2)

            if tx < 128:
                T.set_max_nreg(PRODUCER_REGISTERS, 0)
                for r in T.serial(rounds):
                    phase = (r % 2) ^ 1
                    # In the order the consumers need them: A's left half first (consumer 0
                    # starts S on it), then B's right half (consumer 1 starts there).
                    T.mbarrier_wait_parity(free_l[0], phase)
                    load_half(Raw, Comp, idx_s, k_l, 0, 0, 2 * r, b, window_tiles, lo, own, n_sel, ks)
                    T.cp_async_barrier_noinc(full_l[0])
                    T.mbarrier_wait_parity(free_r[1], phase)
                    load_half(Raw, Comp, idx_s, k_r, 1, half, 2 * r + 1, b, window_tiles, lo, own, n_sel, ks)
                    T.cp_async_barrier_noinc(full_r[1])
                    T.mbarrier_wait_parity(free_r[0], phase)
                    load_half(Raw, Comp, idx_s, k_r, 0, half, 2 * r, b, window_tiles, lo, own, n_sel, ks)
                    T.cp_async_barrier_noinc(full_r[0])
                    T.mbarrier_wait_parity(free_l[1], phase)
                    load_half(Raw, Comp, idx_s, k_l, 1, 0, 2 * r + 1, b, window_tiles, lo, own, n_sel, ks)
                    T.cp_async_barrier_noinc(full_l[1])
            elif tx < 256:
                T.set_max_nreg(CONSUMER_REGISTERS, 1)
                T.mbarrier_wait_parity(q_bar[0], 0)
                T.fill(m_i0, M_FLOOR)
                T.fill(row_sum0, 0)
                T.fill(acc_o0, 0)
                for h in T.Parallel(HB):  # the sinks read now: the epilogue then starts without a global load
                    sink_f0[h] = T.if_then_else(has_sink, Sink[h0 + h] * LOG2E, M_FLOOR)
                tile_flags(seen_s, 0, 0, 0, window_tiles, lo, own, n_sel, idx_s)
                for r in T.serial(rounds):
                    phase = r % 2
                    T.sync_threads(FLAGS_BARRIER, 128)  # this round's flags written
                    score(q_l, q_r, k_l, k_r, 0, acc_s0, full_l, full_r, phase)
                    flagged_logits(acc_s0, seen_s, 0, r % 2, scale_log2)
                    T.copy(m_i0, m_new0)
                    T.reduce_max(acc_s0, m_new0, dim=1, clear=False)
                    T.copy(m_new0, max_s)
                    T.mbarrier_arrive(max_a[0])
                    # A's reference: max(m, A's max) only if some row of the warp needs it.
                    vote0 = 0
                    for h in T.Parallel(HB):
                        vote0 = vote0 | T.if_then_else(m_new0[h] > m_i0[h] + LAZY_RESCALE_LOG2, 1, 0)
                    vote0 = warp_any(vote0)
                    move_reference_if(vote0, m_new0, m_i0, alpha0, row_sum0, acc_o0)
                    exp_and_sum(acc_s0, m_i0, tile_sum0, row_sum0)
                    T.copy(acc_s0, p_reg0)
                    T.gemm(p_reg0, k_l[0, :, :], acc_o0)  # O[:, :D/2] += P(A) V(A)[:, :D/2]
                    T.mbarrier_arrive(free_l[0])
                    # The round's max from consumer 1: bring O, the sums and P(A) to it (it equals
                    # A's reference unless B moved it, and a vote skips the multiplications).
                    T.mbarrier_wait_parity(max_ab[0], phase)
                    vote0 = 0
                    for h in T.Parallel(HB):
                        m_new0[h] = max_s[h]
                        vote0 = vote0 | T.if_then_else(m_new0[h] != m_i0[h], 1, 0)
                    vote0 = warp_any(vote0)
                    if vote0 != 0:
                        move_reference(m_new0, m_i0, alpha0, row_sum0)
                        for h, c in T.Parallel(HB, BK):
                            acc_s0[h, c] *= alpha0[h]
                    T.copy(acc_s0, p_shared[0, :, :])
                    T.fence_proxy_async()
                    T.mbarrier_arrive(p_a[0])
                    if vote0 != 0:
                        for h, d in T.Parallel(HB, half):
                            acc_o0[h, d] *= alpha0[h]
                    T.mbarrier_wait_parity(p_b[0], phase)
                    T.gemm(p_shared[1, :, :], k_l[1, :, :], acc_o0)  # O[:, :D/2] += P(B) V(B)[:, :D/2]
                    T.mbarrier_arrive(free_l[1])
                    if r + 1 < rounds:  # the next round's flags, the logits dead
                        tile_flags(seen_s, 0, (r + 1) % 2, 2 * r + 2, window_tiles, lo, own, n_sel, idx_s)
                finish(0, acc_o0, m_i0, row_sum0, alpha0, sink_f0, sum_x, q_l, has_sink, Out, Lse, b, s, h0)
            else:
                T.set_max_nreg(CONSUMER_REGISTERS, 1)
                T.mbarrier_wait_parity(q_bar[0], 0)
                T.fill(m_i1, M_FLOOR)
                T.fill(row_sum1, 0)
                T.fill(acc_o1, 0)
                for h in T.Parallel(HB):  # the sinks read now: the epilogue then starts without a global load
                    sink_f1[h] = T.if_then_else(has_sink, Sink[h0 + h] * LOG2E, M_FLOOR)
                tile_flags(seen_s, 1, 0, 1, window_tiles, lo, own, n_sel, idx_s)
                for r in T.serial(rounds):
                    phase = r % 2
                    T.sync_threads(FLAGS_BARRIER, 128)  # this round's flags written
                    score(q_r, q_l, k_r, k_l, 1, acc_s1, full_r, full_l, phase)
                    flagged_logits(acc_s1, seen_s, 1, r % 2, scale_log2)
                    T.mbarrier_wait_parity(max_a[0], phase)
                    # Consumer 0's reference for A, by its vote on the same rows and floats.
                    vote1 = 0
                    for h in T.Parallel(HB):
                        vote1 = vote1 | T.if_then_else(max_s[h] > m_i1[h] + LAZY_RESCALE_LOG2, 1, 0)
                    vote1 = warp_any(vote1)
                    for h in T.Parallel(HB):
                        m_ref1[h] = T.if_then_else(vote1 != 0, max_s[h], m_i1[h])
                        m_new1[h] = m_ref1[h]
                    T.reduce_max(acc_s1, m_new1, dim=1, clear=False)
                    # The round's reference: A's, unless some row of the warp needs B's max.
                    vote1 = 0
                    for h in T.Parallel(HB):
                        vote1 = vote1 | T.if_then_else(m_new1[h] > m_ref1[h] + LAZY_RESCALE_LOG2, 1, 0)
                    vote1 = warp_any(vote1)
                    if vote1 == 0:
                        T.copy(m_ref1, m_new1)
                    T.copy(m_new1, max_s)
                    T.mbarrier_arrive(max_ab[0])
                    vote1 = 0
                    for h in T.Parallel(HB):
                        vote1 = vote1 | T.if_then_else(m_new1[h] != m_i1[h], 1, 0)
                    vote1 = warp_any(vote1)
                    move_reference_if(vote1, m_new1, m_i1, alpha1, row_sum1, acc_o1)
                    exp_and_sum(acc_s1, m_i1, tile_sum1, row_sum1)
                    T.copy(acc_s1, p_reg1)
                    T.gemm(p_reg1, k_r[1, :, :], acc_o1)  # O[:, D/2:] += P(B) V(B)[:, D/2:]
                    T.mbarrier_arrive(free_r[1])
                    T.copy(acc_s1, p_shared[1, :, :])
                    T.fence_proxy_async()
                    T.mbarrier_arrive(p_b[0])
                    T.mbarrier_wait_parity(p_a[0], phase)
                    T.gemm(p_shared[0, :, :], k_r[0, :, :], acc_o1)  # O[:, D/2:] += P(A) V(A)[:, D/2:]
                    T.mbarrier_arrive(free_r[0])
                    if r + 1 < rounds:
                        tile_flags(seen_s, 1, (r + 1) % 2, 2 * r + 3, window_tiles, lo, own, n_sel, idx_s)
                finish(1, acc_o1, m_i1, row_sum1, alpha1, sink_f1, sum_x, q_r, has_sink, Out, Lse, b, s, h0)

    return sparse_window_fwd_alternating
