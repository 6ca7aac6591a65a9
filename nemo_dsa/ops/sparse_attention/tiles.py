"""One query's keys as 64-key tiles, the bookkeeping every sparse-attention kernel shares: first
the window tiles (contiguous raw rows ending at the query's own row), then the compressed tiles
(slots of its index row, or the contiguous range ``[ks, ke)``). Plain TileLang expressions,
evaluated by every thread of the block that owns the query."""

from nemo_dsa.ops.sparse_attention.configs import BLOCK_KEYS, MAX_SELECTED


def tile_plan(T, own, window_start, window, n_sel):
    """(first window row, window tiles, all tiles) of one query; n_sel = compressed slots."""
    lo = T.max(T.max(window_start, own - window + 1), 0)
    n_window = T.max(own - lo + 1, 0)
    window_tiles = T.ceildiv(n_window, BLOCK_KEYS)
    return lo, window_tiles, window_tiles + T.ceildiv(n_sel, BLOCK_KEYS)


def compressed_span(T, by_index: bool, Indices, KE, b, s, n_slots):
    """(ks, n_sel) of query s: where its compressed slots start (range mode) and how many there
    are. In indices mode KE holds 1 + the last valid slot, so the -1 tails of the early queries'
    selections are never loaded nor scored."""
    if by_index:
        return 0, T.max(T.min(KE[b, s], n_slots), 0)
    ks = Indices[b, s]
    return ks, T.max(KE[b, s] - ks, 0)


def column_seen_macro(T, by_index: bool):
    """The forwards' macro for one key's visibility: key ``col`` of tile ``tt`` is seen if it is a
    window row up to the query's own, or a compressed slot below ``n_sel`` (indices mode: holding
    an index in [0, n_comp), read from the index row ``idx_s``)."""

    @T.macro
    def column_seen(tt, col, window_tiles, lo, own, n_sel, n_comp, idx_s):
        slot = T.max((tt - window_tiles) * BLOCK_KEYS + col, 0)
        if by_index:
            key = idx_s[T.min(slot, MAX_SELECTED - 1)]
            comp_seen = (slot < n_sel) & (key >= 0) & (key < n_comp)
        else:
            comp_seen = slot < n_sel
        return T.if_then_else(tt < window_tiles, lo + tt * BLOCK_KEYS + col <= own, comp_seen)

    return column_seen


def query_plan_macro(T, by_index: bool):
    """The forwards' macro for one query's keys: in indices mode the query's index row into
    shared memory ``idx_s`` first (every thread reads it for its mask), then
    (ks, n_sel, lo, window_tiles, tiles): the compressed slots' start (range mode) and count, and
    :func:`tile_plan`."""

    @T.macro
    def query_plan(idx_s, Indices, KE, WindowStart, window, b, s, own, n_slots):
        if by_index:
            for j in T.Parallel(MAX_SELECTED):
                if j < n_slots:
                    idx_s[j] = Indices[b, s, j]
        T.sync_threads()
        ks, n_sel = compressed_span(T, by_index, Indices, KE, b, s, n_slots)
        lo, window_tiles, tiles = tile_plan(T, own, WindowStart[b, s], window, n_sel)
        return ks, n_sel, lo, window_tiles, tiles

    return query_plan
