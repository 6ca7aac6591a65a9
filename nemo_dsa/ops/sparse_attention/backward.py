"""The backward kernels: the query-major backward (dq, dkv and delta), and the delta kernel for
when no other gradient is wanted.

One block per (query, 64 heads) first computes ``delta = rowsum(dO * O)`` (written out for the
sink's gradient), then recomputes P from the saved lse, accumulates dq in registers and adds
each tile's dkv = scale * dS^T Q + P^T dO into an fp32 [N_raw + K, D] buffer with 16-byte
atomics (non-deterministic summation order: fp32 rounding only), converted to the input dtype
after.
"""

from nemo_dsa.ops._tilelang import tilelang
from nemo_dsa.ops.sparse_attention.configs import BLOCK_HEADS, BLOCK_KEYS, BWD_THREADS, LOG2E
from nemo_dsa.ops.sparse_attention.tiles import compressed_span, tile_plan

DELTA_ROWS = 32
DELTA_CHUNK = 128

# A [64, chunk] fp32 dkv chunk goes from the wgmma accumulator straight to 16-byte atomics,
# without a pass through shared memory (no staging tile, no barrier per chunk). The accumulator of 256 threads (as TileLang
# lays out an m64 fp32 wgmma result over two warpgroups): warpgroup wg holds columns
# [wg chunk / 2, (wg + 1) chunk / 2), warp w rows 16 w + (lane >> 2) and that + 8, and float2
# number 2 j + h (h: the row + 8) columns 8 j + 2 (lane & 3) and + 1 of its half. Two exchanges
# turn that into whole 128-byte lines a request:
# - the two lanes of a pair swap halves of their float2s: the even lane gets 4 consecutive
#   columns of group 2 jp, the odd lane of group 2 jp + 1 (a quad then holds 64 contiguous bytes
#   of its row, which as atomics would reach the L2 as 8 half lines a warp);
# - the quads of rows 2 k and 2 k + 1 (lanes 8 k .. 8 k + 7) swap a float4: of each 32 columns the
#   even quad takes both rows' first 16, the odd quad both rows' last 16, so that 8 lanes add 128
#   contiguous bytes of one row and a warp's request covers 4 whole lines.
TRANSPOSED_ADD_SOURCE = r"""
__device__ __forceinline__ void dkv_add_transposed(const float* acc, float* dkv, const int* rows, int row_stride, int chunk) {
  const int lane = threadIdx.x & 31, quad_lane = lane & 3;
  const bool odd = quad_lane & 1, upper = lane & 4;
  const int first_col = (chunk / 2) * (threadIdx.x >> 7) + (odd ? 8 + 2 * (quad_lane - 1) : 2 * quad_lane) + (upper ? 16 : 0);
  const int pair_row = 16 * ((threadIdx.x & 127) >> 5) + ((lane >> 2) & 6);
  #pragma unroll
  for (int h = 0; h < 2; ++h) {
    #pragma unroll
    for (int seg = 0; seg < chunk / 64; ++seg) {
      float4 own[2];  // this lane's row, columns 32 seg + 16 k + (its 4 of the quad's 16)
      #pragma unroll
      for (int k = 0; k < 2; ++k) {
        const int jp = 2 * seg + k;
        const float2 even_group = reinterpret_cast<const float2*>(acc)[4 * jp + h];
        const float2 odd_group = reinterpret_cast<const float2*>(acc)[4 * jp + 2 + h];
        const float2 keep = odd ? odd_group : even_group;
        const float2 send = odd ? even_group : odd_group;
        const float got_x = __shfl_xor_sync(0xffffffffu, send.x, 1);
        const float got_y = __shfl_xor_sync(0xffffffffu, send.y, 1);
        own[k] = odd ? make_float4(got_x, got_y, keep.x, keep.y) : make_float4(keep.x, keep.y, got_x, got_y);
      }
      const float4 send = upper ? own[0] : own[1];
      const float4 keep = upper ? own[1] : own[0];
      const float4 got = make_float4(__shfl_xor_sync(0xffffffffu, send.x, 4), __shfl_xor_sync(0xffffffffu, send.y, 4),
                                     __shfl_xor_sync(0xffffffffu, send.z, 4), __shfl_xor_sync(0xffffffffu, send.w, 4));
      const int col = first_col + 32 * seg;
      // Read here, not before the loops: held across them, the rows made ptxas spill.
      const int row_a = rows[pair_row + 8 * h], row_b = rows[pair_row + 8 * h + 1];
      if (row_a >= 0) {
        atomicAdd(reinterpret_cast<float4*>(dkv + (long long)row_a * row_stride + col), upper ? got : keep);
      }
      if (row_b >= 0) {
        atomicAdd(reinterpret_cast<float4*>(dkv + (long long)row_b * row_stride + col), upper ? keep : got);
      }
    }
  }
}
"""


def attention_delta_kernel(dim: int):
    """PrimFunc of delta[r] = sum_d O[r, d] * dO[r, d] in fp32 over rows r of [R, D] bf16."""
    T = tilelang().language
    rows = T.dynamic("rows")

    @T.prim_func
    def attention_delta(
        O: T.Tensor([rows, dim], T.bfloat16),
        dO: T.Tensor([rows, dim], T.bfloat16),
        Delta: T.Tensor([rows], T.float32),
    ):
        with T.Kernel(T.ceildiv(rows, DELTA_ROWS), threads=128) as bx:
            acc = T.alloc_fragment([DELTA_ROWS, DELTA_CHUNK], T.float32)
            total = T.alloc_fragment([DELTA_ROWS], T.float32)
            T.clear(acc)
            for c in T.serial(dim // DELTA_CHUNK):
                for r, d in T.Parallel(DELTA_ROWS, DELTA_CHUNK):
                    row = T.min(bx * DELTA_ROWS + r, rows - 1)
                    acc[r, d] += T.cast(O[row, c * DELTA_CHUNK + d], T.float32) * T.cast(
                        dO[row, c * DELTA_CHUNK + d], T.float32
                    )
            T.reduce_sum(acc, total, dim=1)
            for r in T.Parallel(DELTA_ROWS):
                if bx * DELTA_ROWS + r < rows:
                    Delta[bx * DELTA_ROWS + r] = total[r]

    return attention_delta


def sparse_window_bwd_kernel(dim: int, mode: str, dkv_chunk: int):
    """PrimFunc of the backward for one configuration. Grid: (S, H / 64, B), 256 threads; H a
    multiple of 64 (zero q and dO rows in padded heads contribute exact zeros).

    Arguments as the forward's inputs plus Needs [3] int32 (nonzero: dq, d raw rows, d compressed
    rows wanted), dO [B, S, H, D] bf16, Lse [B, S, H] fp32, the forward's O [B, S, H, D] bf16; out:
    Delta [B, S, H] fp32 (rowsum(dO * O), every element written), dQ [B, S, H, D] bf16
    (written only if wanted) and dKV [B, N_raw + K, D] fp32 (raw rows first, then compressed),
    which must hold zeros on entry in the wanted rows (the tiles' contributions are added
    atomically; unwanted rows are never touched).

    The schedule: S and dP are issued together, and each dkv chunk's GEMMs before the previous
    chunk's atomics (two accumulators), so that the atomics overlap the tensor cores. Each chunk
    is added from the accumulator by 16-byte atomics over whole lines after two lane exchanges
    (TRANSPOSED_ADD_SOURCE). Q and dO are loaded by TMA while delta is computed, and each tile's
    dKV rows are read one tile ahead into a second row buffer, so that no tile starts with a
    global read and a barrier.
    """
    T = tilelang().language
    bf16, f32, i32 = T.bfloat16, T.float32, T.int32
    HB, BK, D = BLOCK_HEADS, BLOCK_KEYS, dim
    batch, seq_len, heads = T.dynamic("batch"), T.dynamic("seq_len"), T.dynamic("heads")
    n_raw, n_comp, n_slots = T.dynamic("n_raw"), T.dynamic("n_comp"), T.dynamic("n_slots")
    by_index = mode == "indices"
    idx_shape = [batch, seq_len, n_slots] if by_index else [batch, seq_len]

    # The key rows of tile ``tt`` into k_s by zero-filling cp.async, one source per tile (a
    # uniform branch), rows computed, not read from rows_s: a select between the two sources went
    # through registers (LDG, then an STS waiting on it), and a read of rows_s put a barrier
    # before every row. No wait here: the copy
    # overlaps the previous tile's dkv GEMMs and atomics, which do not read k_s.
    no_wait = {"parallel_async_without_async_commit_wait": True}

    @T.macro
    def load_keys(k_s, Raw, Comp, Indices, b, s, tt, lo, own, window_tiles, n_sel, ks, n_raw, n_comp, n_slots):
        base = (tt - window_tiles) * BK
        if tt < window_tiles:
            for r, d in T.Parallel(BK, D, prefer_async=True, annotations=no_wait):
                k_s[r, d] = T.if_then_else(
                    lo + tt * BK + r <= own, Raw[b, T.min(lo + tt * BK + r, n_raw - 1), d], T.cast(0, bf16)
                )
        elif by_index:
            for r, d in T.Parallel(BK, D, prefer_async=True, annotations=no_wait):
                k_s[r, d] = T.if_then_else(
                    (base + r < n_sel) & (Indices[b, s, T.min(base + r, n_slots - 1)] >= 0)
                    & (Indices[b, s, T.min(base + r, n_slots - 1)] < n_comp),
                    Comp[b, T.max(Indices[b, s, T.min(base + r, n_slots - 1)], 0), d], T.cast(0, bf16),
                )  # fmt: skip
        else:
            for r, d in T.Parallel(BK, D, prefer_async=True, annotations=no_wait):
                k_s[r, d] = T.if_then_else(
                    base + r < n_sel, Comp[b, T.min(ks + base + r, n_comp - 1), d], T.cast(0, bf16)
                )
        T.ptx_commit_group()

    if (BK, BWD_THREADS, dkv_chunk % 64) != (64, 256, 0):
        raise ValueError("the transposed dkv add needs 64-key tiles, 256 threads and chunks of a multiple of 64 columns")
    n_chunks = D // dkv_chunk
    if n_chunks % 2:
        raise ValueError(f"the backward needs an even number of dkv chunks, got {n_chunks}")
    # Accumulator registers per thread, for the fences that keep nvcc from reading an accumulator
    # before its wgmma's wait.
    pair_regs, dq_regs, kv_regs = HB * BK // BWD_THREADS, HB * D // BWD_THREADS, BK * dkv_chunk // BWD_THREADS

    @T.macro
    def next_keys(k_s, Raw, Comp, Indices, b, s, t, tiles, lo, own, window_tiles, n_sel, ks, n_raw, n_comp, n_slots):
        if t + 1 < tiles:
            load_keys(k_s, Raw, Comp, Indices, b, s, t + 1, lo, own, window_tiles, n_sel, ks, n_raw, n_comp, n_slots)

    @T.macro
    def issue_dkv(ds_s, p_s, q_s, do_s, acc, c):
        """acc = dS^T Q + P^T dO for columns of chunk ``c``, issued and not waited for."""
        T.wgmma_gemm(ds_s, q_s[:, c * dkv_chunk : (c + 1) * dkv_chunk], acc, transpose_A=True, clear_accum=True)
        T.wgmma_gemm(p_s, do_s[:, c * dkv_chunk : (c + 1) * dkv_chunk], acc, transpose_A=True)

    @T.macro
    def add_dkv(dKV, acc, rows_s, slot, b, c):
        # acc.data: the accumulator's registers as the local array TileLang declares (an element
        # access here would make layout inference replicate the fragment).
        T.call_extern("handle", "dkv_add_transposed", acc.data, T.address_of(dKV[b, 0, c * dkv_chunk]),
                      T.address_of(rows_s[slot, 0]), D, dkv_chunk)

    @T.macro
    def row_of(key, tt, r, lo, own, window_tiles, n_sel, ks, n_raw, n_comp):
        """The dKV row of key ``r`` of tile ``tt`` (-1: unseen); ``key`` is its index-row entry
        (indices mode; -1 past the selection)."""
        if by_index:
            comp_row = T.if_then_else((key >= 0) & (key < n_comp), n_raw + key, -1)
        else:
            comp_row = T.if_then_else((tt - window_tiles) * BK + r < n_sel, n_raw + ks + (tt - window_tiles) * BK + r, -1)
        return T.if_then_else(
            tt < window_tiles, T.if_then_else(lo + tt * BK + r <= own, lo + tt * BK + r, -1), comp_row
        )

    @T.macro
    def index_entry(Indices, b, s, tt, r, window_tiles, n_sel, n_slots):
        """Tile ``tt``'s index-row entry for key ``r`` (-1 for window tiles and past the selection)."""
        if not by_index:
            return -1
        slot = (tt - window_tiles) * BK + r
        return T.if_then_else(
            (tt >= window_tiles) & (slot < n_sel), Indices[b, s, T.max(T.min(slot, n_slots - 1), 0)], -1
        )

    @T.prim_func
    def sparse_window_bwd(
        Q: T.Tensor([batch, seq_len, heads, D], bf16),
        Raw: T.Tensor([batch, n_raw, D], bf16),
        Comp: T.Tensor([batch, n_comp, D], bf16),
        WindowStart: T.Tensor([batch, seq_len], i32),
        Indices: T.Tensor(idx_shape, i32),
        KE: T.Tensor([batch, seq_len], i32),
        Params: T.Tensor([2], f32),
        Window: T.Tensor([1], i32),
        Needs: T.Tensor([3], i32),
        dO: T.Tensor([batch, seq_len, heads, D], bf16),
        Lse: T.Tensor([batch, seq_len, heads], f32),
        O: T.Tensor([batch, seq_len, heads, D], bf16),
        Delta: T.Tensor([batch, seq_len, heads], f32),
        dQ: T.Tensor([batch, seq_len, heads, D], bf16),
        dKV: T.Tensor([batch, n_raw + n_comp, D], f32),
    ):
        with T.Kernel(seq_len, heads // HB, batch, threads=BWD_THREADS) as (s, g, b):
            T.import_source(TRANSPOSED_ADD_SOURCE)
            q_s = T.alloc_shared([HB, D], bf16)
            do_s = T.alloc_shared([HB, D], bf16)
            k_s = T.alloc_shared([BK, D], bf16)
            p_s = T.alloc_shared([HB, BK], bf16)
            ds_s = T.alloc_shared([HB, BK], bf16)
            rows_s = T.alloc_shared([2, BK], i32)  # dKV row of each key of tile t in [t % 2], -1 = unseen
            acc_s = T.alloc_fragment([HB, BK], f32)
            acc_dp = T.alloc_fragment([HB, BK], f32)
            acc_dq = T.alloc_fragment([HB, D], f32)
            acc_kv = T.alloc_fragment([BK, dkv_chunk], f32)
            acc_kv1 = T.alloc_fragment([BK, dkv_chunk], f32)  # the odd chunks
            lse2 = T.alloc_fragment([HB], f32)
            delta = T.alloc_fragment([HB], f32)
            o_do = T.alloc_fragment([HB, DELTA_CHUNK], f32)
            o_do_sum = T.alloc_fragment([HB], f32)
            delta_s = T.alloc_shared([HB], f32)
            q_do_bar = T.alloc_barrier([BWD_THREADS])  # Q and dO landed (every thread arrives)
            tx = T.get_thread_binding()
            next_key = T.alloc_var(i32)  # threads < 64: an entry of the next tile's index row

            h0 = g * HB
            own = s + n_raw - seq_len
            scale = Params[0]
            scale_log2 = Params[0] * LOG2E
            window = Window[0]
            need_dq, need_d_raw, need_d_comp = Needs[0] > 0, Needs[1] > 0, Needs[2] > 0
            ks, n_sel = compressed_span(T, by_index, Indices, KE, b, s, n_slots)  # as in the forward
            lo, window_tiles, tiles = tile_plan(T, own, WindowStart[b, s], window, n_sel)

            # The first key tile's cp.async go out before Q, dO and O are loaded, so that the
            # loads overlap (Q and dO by TMA, landing while delta is computed).
            if tiles > 0:
                load_keys(k_s, Raw, Comp, Indices, b, s, 0, lo, own, window_tiles, n_sel, ks, n_raw, n_comp, n_slots)
            T.tma_copy(Q[b, s, h0 : h0 + HB, :], q_s, barrier=q_do_bar[0])
            T.tma_copy(dO[b, s, h0 : h0 + HB, :], do_s, barrier=q_do_bar[0])
            T.mbarrier_arrive(q_do_bar[0])
            # delta = rowsum(dO * O) here, with dO read from global memory (L2) rather than from
            # its TMA copy, so as not to wait for the TMA; written out for the sink's gradient.
            T.clear(delta_s)
            for c in T.unroll(D // DELTA_CHUNK):  # unrolled: all of O's loads in flight at once
                for h, d in T.Parallel(HB, DELTA_CHUNK):
                    o_do[h, d] = T.cast(O[b, s, h0 + h, c * DELTA_CHUNK + d], f32) * T.cast(
                        dO[b, s, h0 + h, c * DELTA_CHUNK + d], f32
                    )
                T.reduce_sum(o_do, o_do_sum, dim=1)
                for h in T.Parallel(HB):
                    delta_s[h] += o_do_sum[h]
            for h in T.Parallel(HB):
                lse2[h] = Lse[b, s, h0 + h] * LOG2E
                delta[h] = delta_s[h]
            for h in T.Parallel(HB):
                Delta[b, s, h0 + h] = delta_s[h]
            T.clear(acc_dq)
            T.mbarrier_wait_parity(q_do_bar[0], 0)
            for r in T.Parallel(BK):  # tile 0's rows; each later tile's are written one tile ahead
                rows_s[0, r] = row_of(index_entry(Indices, b, s, 0, r, window_tiles, n_sel, n_slots), 0, r,
                                      lo, own, window_tiles, n_sel, ks, n_raw, n_comp)  # fmt: skip
            for t in T.serial(tiles):
                slot = t % 2
                # The tile's key rows were prefetched (before the loop, or during the previous
                # tile's dkv GEMMs): wait for them here.
                T.ptx_wait_group(0)
                T.sync_threads()
                T.wgmma_gemm(q_s, k_s, acc_s, transpose_B=True, clear_accum=True)
                T.wgmma_gemm(do_s, k_s, acc_dp, transpose_B=True, clear_accum=True)
                T.wait_wgmma(0)
                T.warpgroup_fence_operand(acc_s, num_regs=pair_regs)
                T.warpgroup_fence_operand(acc_dp, num_regs=pair_regs)
                for h, c in T.Parallel(HB, BK):
                    acc_s[h, c] = T.if_then_else(
                        rows_s[slot, c] >= 0, T.exp2(acc_s[h, c] * scale_log2 - lse2[h]), T.cast(0, f32)
                    )
                    acc_dp[h, c] = acc_s[h, c] * (acc_dp[h, c] - delta[h]) * scale
                T.copy(acc_s, p_s)
                T.copy(acc_dp, ds_s)
                T.fence_proxy_async()  # P and dS are written by st.shared and read by wgmma
                T.sync_threads()
                # Uniform branches: gradients nobody asked for are neither computed nor added.
                want_dkv = ((t < window_tiles) & need_d_raw) | ((t >= window_tiles) & need_d_comp)
                if need_dq:
                    T.wgmma_gemm(ds_s, k_s, acc_dq)
                # One branch holds every wgmma of the dkv chunks, so ptxas sees each wait
                # on every path (it serialises all wgmmas when it cannot).
                if want_dkv:
                    issue_dkv(ds_s, p_s, q_s, do_s, acc_kv, 0)
                    T.wait_wgmma(2)  # dq's GEMM (the only reader of k_s) is done; chunk 0 runs on
                    T.warpgroup_fence_operand(acc_dq, num_regs=dq_regs)
                    T.sync_threads()  # every warp is done with k_s
                    next_keys(k_s, Raw, Comp, Indices, b, s, t, tiles, lo, own, window_tiles, n_sel, ks, n_raw, n_comp, n_slots)
                    if tx < BK:  # the next tile's index entries now, stored at the tile's end
                        next_key = index_entry(Indices, b, s, t + 1, tx, window_tiles, n_sel, n_slots)
                    # Chunks in pairs (n_chunks is even): acc_kv holds the even ones, acc_kv1
                    # the odd ones; chunk c + 1's GEMMs run while chunk c is added.
                    for j in T.unroll(n_chunks // 2):
                        issue_dkv(ds_s, p_s, q_s, do_s, acc_kv1, 2 * j + 1)
                        T.wait_wgmma(2)
                        T.warpgroup_fence_operand(acc_kv, num_regs=kv_regs)
                        add_dkv(dKV, acc_kv, rows_s, slot, b, 2 * j)
                        if 2 * j + 2 < n_chunks:
                            issue_dkv(ds_s, p_s, q_s, do_s, acc_kv, 2 * j + 2)
                            T.wait_wgmma(2)
                        else:
                            T.wait_wgmma(0)
                        T.warpgroup_fence_operand(acc_kv1, num_regs=kv_regs)
                        add_dkv(dKV, acc_kv1, rows_s, slot, b, 2 * j + 1)
                else:
                    T.wait_wgmma(0)
                    T.warpgroup_fence_operand(acc_dq, num_regs=dq_regs)
                    T.sync_threads()
                    next_keys(k_s, Raw, Comp, Indices, b, s, t, tiles, lo, own, window_tiles, n_sel, ks, n_raw, n_comp, n_slots)
                    if tx < BK:  # the next tile's index entries now, stored at the tile's end
                        next_key = index_entry(Indices, b, s, t + 1, tx, window_tiles, n_sel, n_slots)
                if (tx < BK) & (t + 1 < tiles):
                    rows_s[1 - slot, tx] = row_of(next_key, t + 1, tx, lo, own, window_tiles, n_sel, ks, n_raw, n_comp)
                T.sync_threads()
            if need_dq:
                T.copy(acc_dq, q_s)
                T.copy(q_s, dQ[b, s, h0 : h0 + HB, :], disable_tma=True)

    return sparse_window_bwd
