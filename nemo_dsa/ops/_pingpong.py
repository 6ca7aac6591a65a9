"""The schedule both scoring kernels share: one TMA producer warpgroup, two consumer warpgroups
that take turns on the tensor cores ("ping-pong", as CUTLASS's Hopper kernels call it).

A query tile's [rows, D] queries stay in shared memory; the producer streams its 64-key tiles
through a ring of ``num_stages`` shared buffers (full/empty mbarriers) and then writes -inf
outside the tile's key range. Consumer ``me`` (0 or 1) scores tiles me, me + 2, ...: it waits for
its turn (named barrier TURN_BARRIER + me), issues the tile's wgmma, hands the turn over at once
and only then waits for its result, so its epilogue runs while the other consumer's GEMM keeps
the tensor cores busy. The kernels differ only in their epilogues (the head sum and the output
dtype), which stay in their own modules.
"""

from nemo_dsa.ops._tilelang import tilelang

BLOCK_K = 64  # keys per tile: wgmma's M, one consumer's turn
THREADS = 384  # producer warpgroup + two consumer warpgroups
TURN_BARRIER = 8  # named barriers 8 and 9: consumer 0's and consumer 1's turn (0 is __syncthreads)
# setmaxnreg budgets: 128 * producer + 256 * consumer <= the SM's 64K registers.
PRODUCER_REGISTERS = 40
CONSUMER_REGISTERS = 232
PASS_CONFIGS = {"tl.disable_warp_specialized": True}  # specialised by hand: TileLang must not split it again
FILL = 256  # -inf fill chunk per query row


def pingpong_macros(heads: int, block_q: int, num_stages: int):
    """(producer, first_turn, multiply) macros for query tiles of ``block_q`` x ``heads`` rows.

    ``producer(Q, K, Out, q_shared, k_shared, q_ready, full, empty, by, q0, first, last,
    seq_len, num_keys)`` loads the tile's queries and its key tiles [first, last), then fills
    Out[by, q0 : q0 + block_q] with -inf outside keys [first * BLOCK_K, last * BLOCK_K).
    ``first_turn(me, q_ready)`` waits for the queries and gives consumer 0 the first turn;
    ``multiply(me, t, acc, q_shared, k_shared, full, empty)`` then leaves key tile t's scores
    [BLOCK_K, rows] in ``acc`` and frees its stage.
    """
    T = tilelang().language
    rows = block_q * heads

    @T.macro
    def producer(Q, K, Out, q_shared, k_shared, q_ready, full, empty, by, q0, first, last, seq_len, num_keys):
        # tma_copy only adds the expected bytes: the barriers count the 128 producer threads.
        # Rows past the last query load as zeros (TMA bounds) and are never stored.
        T.tma_copy(Q[by, q0 * heads : q0 * heads + rows, :], q_shared, barrier=q_ready[0])
        T.mbarrier_arrive(q_ready[0])
        for t in T.serial(last - first):
            stage = t % num_stages
            T.mbarrier_wait_parity(empty[stage], (t // num_stages) % 2 ^ 1)
            k0 = (first + t) * BLOCK_K
            T.tma_copy(K[by, k0 : k0 + BLOCK_K, :], k_shared[stage, :, :], barrier=full[stage])
            T.mbarrier_arrive(full[stage])
        # -inf outside [first, last) tiles, written while the consumers multiply.
        head = first * BLOCK_K
        tail = last * BLOCK_K
        for t in T.serial(T.ceildiv(head, FILL)):
            for i, n in T.Parallel(block_q, FILL):
                if q0 + i < seq_len and t * FILL + n < head:
                    Out[by, q0 + i, t * FILL + n] = -T.infinity(Out.dtype)
        for t in T.serial(T.ceildiv(T.max(num_keys - tail, 0), FILL)):
            for i, n in T.Parallel(block_q, FILL):
                if q0 + i < seq_len and tail + t * FILL + n < num_keys:
                    Out[by, q0 + i, tail + t * FILL + n] = -T.infinity(Out.dtype)

    @T.macro
    def first_turn(me, q_ready):
        T.mbarrier_wait_parity(q_ready[0], 0)
        if me == 1:
            T.named_barrier_arrive(TURN_BARRIER, 256)

    @T.macro
    def multiply(me, t, acc, q_shared, k_shared, full, empty):
        stage = t % num_stages
        T.mbarrier_wait_parity(full[stage], (t // num_stages) % 2)
        T.sync_threads(TURN_BARRIER + me, 256)  # wait for my turn on the tensor cores
        T.wgmma_gemm(k_shared[stage, :, :], q_shared, acc, transpose_B=True, clear_accum=True)
        # Issued: the other consumer may queue its wgmma behind mine while I wait for it.
        T.named_barrier_arrive(TURN_BARRIER + 1 - me, 256)
        T.wait_wgmma(0)
        T.mbarrier_arrive(empty[stage])

    return producer, first_turn, multiply


def pingpong_shared_memory_bytes(rows: int, index_dim: int, num_stages: int) -> int:
    """Bytes of the resident queries and the key-tile ring (bf16)."""
    return 2 * index_dim * (rows + num_stages * BLOCK_K)
