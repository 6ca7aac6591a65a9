"""The forward kernel: one query and 64 of its heads per block, hand warp-specialised.

384 threads in three warpgroups (the producer is warpgroup 0 so that the barrier TileLang puts
after its cp.async wait is the producer's own named barrier):
- the producer gathers each 64-key tile with 16-byte cp.async into a ring of ``num_stages``
  shared buffers (full / empty mbarriers); rows the query must not see are zero-filled by the
  copy itself (a zero source size), never loaded, so a NaN or inf in an unseen key cannot reach
  a product;
- consumer ``me`` (0, 1) scores keys [32 me, 32 me + 32) of each tile over all of D, the two
  exchange their row maxima, each writes its half of P, and each adds P V for its half of D
  over all 64 keys ("balanced", FlashMLA's split of the work; each consumer holds a [64, D/2]
  fp32 accumulator, 128 registers a thread at D = 512). Unseen logits are selected to -inf.

``forward_alternating.py`` holds the schedules (the default among them) in which the consumers take turns on whole
tiles. Outputs: O [B, S, H, D] bf16 and the natural-log lse [B, S, H] fp32; a query that sees
nothing (no key, no sink) gets zero output and -inf lse.
"""

import re

from nemo_dsa.ops._tilelang import tilelang
from nemo_dsa.ops.sparse_attention.configs import (
    BLOCK_HEADS,
    BLOCK_KEYS,
    FWD_THREADS,
    LOG2E,
    M_FLOOR,
    MAX_SELECTED,
)
from nemo_dsa.ops.sparse_attention.tiles import column_seen_macro, query_plan_macro

# TileLang 0.1.15 numbers the named barriers of each warpgroup's shared-memory syncs itself, and
# the barrier it puts after the producer's cp.async wait can take the id of a consumer's barrier
# (seen in the range-mode forward): two roles on one 128-thread barrier deadlock or race. The
# generated CUDA is therefore post-processed: every role gets its own ids.
ROLE_BARRIER_IDS = (11, 12, 13)  # producer, consumer 0, consumer 1 (0 is __syncthreads)
_ROLE_MARK = re.compile(r"warpgroup_reg_(?:alloc|dealloc)<")
_PARTIAL_SYNC = re.compile(r"__sync_thread_partial\(\d+, 128\)")


def separate_role_barriers(code: str) -> str:
    """The forward's CUDA with each role's 128-thread named barriers renumbered to its own id
    (roles start at their setmaxnreg); any other kernel's code is returned unchanged."""
    if "sparse_window_fwd" not in code:
        return code
    marks = [m.start() for m in _ROLE_MARK.finditer(code)]
    if len(marks) != 3:
        raise RuntimeError(f"sparse_window_fwd: expected 3 warpgroup roles in the CUDA, found {len(marks)}")
    parts = [code[: marks[0]]]
    for role, (a, b) in enumerate(zip(marks, marks[1:] + [len(code)])):
        parts.append(_PARTIAL_SYNC.sub(f"__sync_thread_partial({ROLE_BARRIER_IDS[role]}, 128)", code[a:b]))
    return "".join(parts)


def _cuda_postproc(code, _target):
    return separate_role_barriers(code)


_postproc_registered = False


def register_barrier_postproc() -> None:
    """Install :func:`separate_role_barriers` as TileLang's CUDA post-processing hook, once per
    process (it passes every other kernel's code through unchanged)."""
    global _postproc_registered
    if not _postproc_registered:
        from tilelang.engine.callback import register_cuda_postproc_callback

        register_cuda_postproc_callback(_cuda_postproc)
        _postproc_registered = True


# The forwards' producers do not wait for their own copies: each thread's cp.async arrive on the
# stage's mbarrier when they land (cp.async.mbarrier.arrive.noinc; the barriers count the 128
# producer threads), so a producer issues the next tile's rows at once. The index row the copies
# read lives in static shared memory: in the dynamic buffer, beside the tiles the cp.async write,
# TileLang put a barrier before every row's copy.
NO_COPY_WAIT = {"parallel_async_without_async_commit_wait": True}


def key_tile_producer(T, by_index: bool, num_stages: int, half: int):
    """The producer warpgroup of the balanced forwards: once a ring stage is free again
    (``empty``), each tile's 64 key rows go into its two D halves (k_l, k_r) by 16-byte cp.async
    with a zero source size for rows the query must not see; the copies themselves signal the
    consumers (``full``) as they land (NO_COPY_WAIT). Window tiles read raw rows by position, the
    others compressed rows by index (``idx_s``) or from the range's start ``ks``."""
    bf16, BK = T.bfloat16, BLOCK_KEYS

    @T.macro
    def produce(Raw, Comp, idx_s, k_l, k_r, full, empty, b, tiles, window_tiles, lo, own, n_sel, ks, n_raw, n_comp):
        for t in T.serial(tiles):
            stage = t % num_stages
            T.mbarrier_wait_parity(empty[stage], ((t // num_stages) % 2) ^ 1)
            if t < window_tiles:
                for r, d in T.Parallel(BK, half, prefer_async=True, annotations=NO_COPY_WAIT):
                    k_l[stage, r, d] = T.if_then_else(
                        lo + t * BK + r <= own, Raw[b, T.min(lo + t * BK + r, n_raw - 1), d], T.cast(0, bf16)
                    )
                    k_r[stage, r, d] = T.if_then_else(
                        lo + t * BK + r <= own, Raw[b, T.min(lo + t * BK + r, n_raw - 1), half + d], T.cast(0, bf16)
                    )
            else:
                base = (t - window_tiles) * BK
                if by_index:
                    for r, d in T.Parallel(BK, half, prefer_async=True, annotations=NO_COPY_WAIT):
                        k_l[stage, r, d] = T.if_then_else(
                            (base + r < n_sel) & (idx_s[T.min(base + r, MAX_SELECTED - 1)] >= 0) & (idx_s[T.min(base + r, MAX_SELECTED - 1)] < n_comp),
                            Comp[b, T.max(idx_s[T.min(base + r, MAX_SELECTED - 1)], 0), d], T.cast(0, bf16),
                        )
                        k_r[stage, r, d] = T.if_then_else(
                            (base + r < n_sel) & (idx_s[T.min(base + r, MAX_SELECTED - 1)] >= 0) & (idx_s[T.min(base + r, MAX_SELECTED - 1)] < n_comp),
                            Comp[b, T.max(idx_s[T.min(base + r, MAX_SELECTED - 1)], 0), half + d], T.cast(0, bf16),
                        )
                else:
                    for r, d in T.Parallel(BK, half, prefer_async=True, annotations=NO_COPY_WAIT):
                        k_l[stage, r, d] = T.if_then_else(
                            base + r < n_sel, Comp[b, T.min(ks + base + r, n_comp - 1), d], T.cast(0, bf16)
                        )
                        k_r[stage, r, d] = T.if_then_else(
                            base + r < n_sel, Comp[b, T.min(ks + base + r, n_comp - 1), half + d], T.cast(0, bf16)
                        )
            T.cp_async_barrier_noinc(full[stage])

    return produce


EXCHANGE_BARRIER = 8  # named barriers of the two consumers of the balanced forward (256 threads)
P_READY_BARRIER = 9
# "balanced-lean": a row's reference max moves only when a logit exceeds it by more than this
# (log2 units): P <= 2^8 in bf16 loses nothing (its relative rounding does not depend on scale),
# and the sums stay far from fp32's range.
LAZY_RESCALE_LOG2 = 8.0


def sparse_window_fwd_balanced_kernel(
    dim: int,
    mode: str,
    num_stages: int,
    consumer0_registers: int,
    consumer1_registers: int,
    producer_registers: int,
    lean_softmax: bool = False,
):
    """The forward with FlashMLA's balance: consumer ``me`` (0, 1) scores keys [32 me, 32 me + 32)
    of each tile (S = Q K^T over all of D), the two exchange their row maxima through shared
    memory (named barrier 8), each writes its P half, and after named barrier 9 each adds
    P V[:, its D half] over all 64 keys. Both keep the same running max and their own partial
    row sums (added at the end), so each warpgroup does half of every GEMM. Same arguments,
    grid and producer as :func:`kernels.sparse_window_fwd_kernel`.

    ``lean_softmax`` ("balanced-lean") shortens the per-tile section between S and P V,
    which a clock64 trace measured at 58 % of a tile (docs/performance.md v21): consumer 0 writes
    each tile's 64 column flags once (``seen_s``), so the mask is a load and a select per logit,
    and a row's reference max (and O, the sums with it) moves only when a logit exceeds it by
    more than 2^LAZY_RESCALE_LOG2 (a warp's vote: both consumers' warp w hold the same rows)."""
    T = tilelang().language
    bf16, f32, i32 = T.bfloat16, T.float32, T.int32
    HB, BK, D, half = BLOCK_HEADS, BLOCK_KEYS, dim, dim // 2
    KH = BK // 2  # keys scored per consumer
    batch, seq_len, heads = T.dynamic("batch"), T.dynamic("seq_len"), T.dynamic("heads")
    n_raw, n_comp, n_slots = T.dynamic("n_raw"), T.dynamic("n_comp"), T.dynamic("n_slots")
    by_index = mode == "indices"
    idx_shape = [batch, seq_len, n_slots] if by_index else [batch, seq_len]
    produce_key_tiles = key_tile_producer(T, by_index, num_stages, half)
    query_plan = query_plan_macro(T, by_index)
    column_seen = column_seen_macro(T, by_index)

    @T.macro
    def tile_columns_seen(seen_s, tt, window_tiles, lo, own, n_sel, n_comp_, idx_s):
        """seen_s[tt % 2, c] = 1 where key c of tile ``tt`` is visible, else 0: computed once per
        column (by consumer 0), so that the consumers' mask is one shared load and a select per
        logit instead of each thread's own per-logit index arithmetic and branches."""
        for c in T.Parallel(BK):
            seen = column_seen(tt, c, window_tiles, lo, own, n_sel, n_comp_, idx_s)
            seen_s[tt % 2, c] = T.if_then_else(seen, T.float32(1), T.float32(0))

    @T.macro
    def consumer(me, q_l, q_r, k_l, k_r, k_mine, p_shared, max_x, sum_x, seen_s, full, empty, acc_s, acc_o, m_i,
                 m_prev, row_sum, tile_max, tile_sum, alpha, sink_f, tiles, window_tiles, lo, own, n_sel, n_comp_,
                 idx_s, scale_log2, has_sink, Sink, Out, Lse, b, s, h0):
        c0 = me * KH
        T.fill(m_i, M_FLOOR)
        T.fill(row_sum, 0)
        T.fill(acc_o, 0)
        for t in T.serial(tiles):
            stage = t % num_stages
            T.mbarrier_wait_parity(full[stage], (t // num_stages) % 2)
            T.fence_proxy_async()  # rows written by cp.async (generic proxy), read by wgmma
            T.gemm(q_l, k_l[stage, c0 : c0 + KH, :], acc_s, transpose_B=True, clear_accum=True)
            T.gemm(q_r, k_r[stage, c0 : c0 + KH, :], acc_s, transpose_B=True)
            if lean_softmax:
                for h, c in T.Parallel(HB, KH):
                    acc_s[h, c] = T.if_then_else(seen_s[t % 2, c0 + c] > 0.5, acc_s[h, c] * scale_log2, -T.infinity(f32))
            else:
                for h, c in T.Parallel(HB, KH):
                    col = c0 + c
                    seen = column_seen(t, col, window_tiles, lo, own, n_sel, n_comp_, idx_s)
                    acc_s[h, c] = T.if_then_else(seen, acc_s[h, c] * scale_log2, -T.infinity(f32))
            T.reduce_max(acc_s, tile_max, dim=1, clear=True)
            for h in T.Parallel(HB):
                max_x[me, h] = tile_max[h]
            T.sync_threads(EXCHANGE_BARRIER, 256)  # both halves' maxima written
            if lean_softmax:
                # m_i only moves (and O, the sums with it) when some row of this warp's 16 would
                # otherwise see a logit above 2^LAZY_RESCALE_LOG2 times its reference; both
                # consumers' warp w hold the same rows and maxima, so they decide alike.
                need = T.alloc_var(i32)
                need = 0
                for h in T.Parallel(HB):
                    m_prev[h] = T.max(m_i[h], T.max(max_x[0, h], max_x[1, h]))
                    need = need | T.if_then_else(m_prev[h] > m_i[h] + LAZY_RESCALE_LOG2, 1, 0)
                if T.call_extern(i32, "__any_sync", T.uint32(0xFFFFFFFF), need) != 0:
                    for h in T.Parallel(HB):
                        alpha[h] = T.exp2(m_i[h] - m_prev[h])
                        m_i[h] = m_prev[h]
                        row_sum[h] = row_sum[h] * alpha[h]
                    for h, d in T.Parallel(HB, half):
                        acc_o[h, d] *= alpha[h]
                for h, c in T.Parallel(HB, KH):
                    acc_s[h, c] = T.exp2(acc_s[h, c] - m_i[h])
                T.reduce_sum(acc_s, tile_sum, dim=1)
                for h in T.Parallel(HB):
                    row_sum[h] = row_sum[h] + tile_sum[h]
            else:
                T.copy(m_i, m_prev)
                for h in T.Parallel(HB):
                    m_i[h] = T.max(m_prev[h], T.max(max_x[0, h], max_x[1, h]))
                    alpha[h] = T.exp2(m_prev[h] - m_i[h])
                for h, c in T.Parallel(HB, KH):
                    acc_s[h, c] = T.exp2(acc_s[h, c] - m_i[h])
                T.reduce_sum(acc_s, tile_sum, dim=1)
                for h in T.Parallel(HB):
                    row_sum[h] = row_sum[h] * alpha[h] + tile_sum[h]
                for h, d in T.Parallel(HB, half):
                    acc_o[h, d] *= alpha[h]
            T.copy(acc_s, p_shared[:, c0 : c0 + KH])
            # The next tile's columns, into the other seen_s row: both consumers read this tile's
            # row before the exchange barrier, and read the next one after P_READY below. (Here,
            # with the logits dead, it takes no registers the consumer lacks: before, it spilled.)
            if lean_softmax and me == 0:
                if t + 1 < tiles:
                    tile_columns_seen(seen_s, t + 1, window_tiles, lo, own, n_sel, n_comp_, idx_s)
            T.fence_proxy_async()
            T.sync_threads(P_READY_BARRIER, 256)  # both P halves written (and both maxima read)
            T.gemm(p_shared, k_mine[stage, :, :], acc_o)
            T.mbarrier_arrive(empty[stage])
        # Row sums: each consumer summed its own keys; the maxima are the same in both.
        for h in T.Parallel(HB):
            sum_x[me, h] = row_sum[h]
        T.sync_threads(EXCHANGE_BARRIER, 256)
        for h in T.Parallel(HB):
            sink_f[h] = T.if_then_else(has_sink, Sink[h0 + h] * LOG2E, M_FLOOR)
        for h in T.Parallel(HB):
            m_prev[h] = T.max(m_i[h], sink_f[h])  # final max
            row_sum[h] = (sum_x[0, h] + sum_x[1, h]) * T.exp2(m_i[h] - m_prev[h]) + T.if_then_else(
                has_sink, T.exp2(sink_f[h] - m_prev[h]), T.cast(0, f32)
            )
            alpha[h] = T.if_then_else(row_sum[h] > 0, T.exp2(m_i[h] - m_prev[h]) / row_sum[h], T.cast(0, f32))
        if me == 0:
            for h in T.Parallel(HB):
                Lse[b, s, h0 + h] = T.if_then_else(
                    row_sum[h] > 0, (m_prev[h] + T.log2(row_sum[h])) / LOG2E, -T.infinity(f32)
                )
        for h, d in T.Parallel(HB, half):
            acc_o[h, d] *= alpha[h]
        # Q is dead once both consumers passed the last tile: each stages its half of O there.
        T.sync_threads(P_READY_BARRIER, 256)
        if me == 0:
            T.copy(acc_o, q_l)
            T.copy(q_l, Out[b, s, h0 : h0 + HB, 0:half], disable_tma=True)
        else:
            T.copy(acc_o, q_r)
            T.copy(q_r, Out[b, s, h0 : h0 + HB, half:D], disable_tma=True)

    @T.prim_func
    def sparse_window_fwd_balanced(
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
            k_l = T.alloc_shared([num_stages, BK, half], bf16)
            k_r = T.alloc_shared([num_stages, BK, half], bf16)
            p_shared = T.alloc_shared([HB, BK], bf16)
            max_x = T.alloc_shared([2, HB], f32)
            sum_x = T.alloc_shared([2, HB], f32)
            seen_s = T.alloc_shared([2, BK] if lean_softmax else [1, 1], f32)  # lean: key c of tile t seen (row t % 2)
            idx_s = T.alloc_shared([MAX_SELECTED if by_index else 1], i32, scope="shared")  # static: see NO_COPY_WAIT
            full = T.alloc_barrier([128] * num_stages)  # producer threads (cp.async noinc)
            empty = T.alloc_barrier([256] * num_stages)  # both consumers

            acc_s0 = T.alloc_fragment([HB, KH], f32)
            acc_s1 = T.alloc_fragment([HB, KH], f32)
            acc_o0 = T.alloc_fragment([HB, half], f32)
            acc_o1 = T.alloc_fragment([HB, half], f32)
            m_i0 = T.alloc_fragment([HB], f32)
            m_i1 = T.alloc_fragment([HB], f32)
            m_prev0 = T.alloc_fragment([HB], f32)
            m_prev1 = T.alloc_fragment([HB], f32)
            row_sum0 = T.alloc_fragment([HB], f32)
            row_sum1 = T.alloc_fragment([HB], f32)
            tile_max0 = T.alloc_fragment([HB], f32)
            tile_max1 = T.alloc_fragment([HB], f32)
            tile_sum0 = T.alloc_fragment([HB], f32)
            tile_sum1 = T.alloc_fragment([HB], f32)
            alpha0 = T.alloc_fragment([HB], f32)
            alpha1 = T.alloc_fragment([HB], f32)
            sink_f0 = T.alloc_fragment([HB], f32)
            sink_f1 = T.alloc_fragment([HB], f32)

            h0 = g * HB
            own = s + n_raw - seq_len
            scale_log2 = Params[0] * LOG2E
            has_sink = Params[1] > 0.5
            window = Window[0]
            ks, n_sel, lo, window_tiles, tiles = query_plan(idx_s, Indices, KE, WindowStart, window, b, s, own, n_slots)

            if tx < 128:
                T.set_max_nreg(producer_registers, 0)
                produce_key_tiles(Raw, Comp, idx_s, k_l, k_r, full, empty, b, tiles, window_tiles, lo, own, n_sel, ks,
                                  n_raw, n_comp)  # fmt: skip
            elif tx < 256:
                T.set_max_nreg(consumer0_registers, 1)
                T.copy(Q[b, s, h0 : h0 + HB, 0:half], q_l, disable_tma=True)  # each consumer loads half of Q
                if lean_softmax:
                    if tiles > 0:
                        tile_columns_seen(seen_s, 0, window_tiles, lo, own, n_sel, n_comp, idx_s)
                T.fence_proxy_async()
                T.sync_threads(EXCHANGE_BARRIER, 256)
                consumer(0, q_l, q_r, k_l, k_r, k_l, p_shared, max_x, sum_x, seen_s, full, empty, acc_s0, acc_o0, m_i0,
                         m_prev0, row_sum0, tile_max0, tile_sum0, alpha0, sink_f0, tiles, window_tiles, lo,
                         own, n_sel, n_comp, idx_s, scale_log2, has_sink, Sink, Out, Lse, b, s, h0)
            else:
                T.set_max_nreg(consumer1_registers, 1)
                T.copy(Q[b, s, h0 : h0 + HB, half:D], q_r, disable_tma=True)
                T.fence_proxy_async()
                T.sync_threads(EXCHANGE_BARRIER, 256)
                consumer(1, q_l, q_r, k_l, k_r, k_r, p_shared, max_x, sum_x, seen_s, full, empty, acc_s1, acc_o1, m_i1,
                         m_prev1, row_sum1, tile_max1, tile_sum1, alpha1, sink_f1, tiles, window_tiles, lo,
                         own, n_sel, n_comp, idx_s, scale_log2, has_sink, Sink, Out, Lse, b, s, h0)

    return sparse_window_fwd_balanced
