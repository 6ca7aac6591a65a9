"""TileLang exact top-k for Hopper: one radix select per score row, ties to the smaller index.

Semantics (docs/semantics.md "Top-k selection", the same as ``naive.select_topk_reference``): the best
T = min(count, W) *finite* scores of each row, ties to the smaller key index, -1 padding; rows
come out by descending score (``order="score"``, V4) or by ascending index (``order="index"``,
V4.1). Only keys in the row's ``[ks, ke)`` are read: the scoring kernels write -inf outside it.

Every score gets an ``image``: its bits mapped to an unsigned integer of the same order
(negatives bit-flipped, +-0 merged, 0 for NaN/+-inf: never selected). A block of 256 threads
owns one row; warp w owns a contiguous segment of it, lane l every 32nd key from l (coalesced
loads). The block loads the row once, 32 loads in flight per thread, and keeps the images of
the first 8192 keys in registers (32 a thread; longer rows read the rest again in each pass).
It then finds the T-th largest image 8 bits per pass: a 256-bin shared-memory histogram of the
keys that share the digits decided so far, a block scan over the bins, and the bin where the
running count reaches T; it stops early when that bin holds exactly the keys still needed. The
result is a cut: every key with a larger image is taken, and of the keys equal to the T-th image
the first ``need`` in index order (the tie rule, so no pass over index digits). Two walks gather
them: each warp counts its taken and equal keys (ballots), one barrier gives every warp the
counts of the warps before it, and the second walk ranks each key among the taken ones in index
order. Index order writes it there (no sort); score order places (image, reversed index) keys
in shared memory and sorts them with a bitonic network held in registers.

bf16 rows (V4.1) first try a shortcut: a bf16 image has 16 bits, so the WINDOW_BINS images below
the row's largest one (two binades) are WINDOW_BINS histogram bins of one image each. One walk
finds the maximum, one counts the keys within the window per warp (only those touch shared
atomics), and a scan over the bins gives the T-th image exactly, so the cut is decided without
the two generic passes and each warp's counts for the gather come from its histogram (no counting
walk). A row whose T-th key lies further below its maximum (or that has fewer than T finite keys)
falls back to the generic passes. Candidate blocks (V4.1 reindex layers): with ``block_size`` the
row's kept blocks go into a byte map in static shared memory and keys of other blocks get image 0,
so the select applies the mask while it reads the scores (no [rows, W] mask, no rewrite).

bf16 index-order rows (V4.1) go to ``vector_kernels`` instead when the matrix is 16-byte aligned
(its 16-byte loads need that; an unaligned matrix, a slice for instance, stays here): it reads a
row in vectors with packed bf16 instructions, which this kernel's per-key walks cannot.

Cost at S = 32768, K = 8192 causal (4096 visible keys a row on average), T = 512: one read of the
row (256 MiB bf16 / 512 MiB fp32 for the whole matrix, ~0.1 ms of HBM), 2 histogram passes for
bf16 and 3-4 for fp32 and the two gather walks from registers, and for score order the sort (45
compare-exchange steps of 512 slots). The row is read from memory once (32 loads in flight per
thread), and ties at the cut are decided by index order without passes over index digits.
"""

from dataclasses import asdict, dataclass

import torch

from nemo_dsa._checks import check_positive_int, check_tensor
from nemo_dsa.ops._tilelang import KernelBuild, tilelang
from nemo_dsa.ops.topk.rows import ORDERS
from nemo_dsa.ops.topk.vector_kernels import MASK_BLOCKS, vector_select_kernel

# Digit widths of the radix passes, most significant first (default: 8 bits, one histogram bin per
# thread in the scan; wider first digits measured no faster); at most 4096 bins.
DIGIT_BITS = {"float32": (8, 8, 8, 8), "bfloat16": (8, 8)}
MAX_DIGIT_BITS = 12
THREADS = 256
WARP = 32
WARPS = THREADS // WARP
# A step: every lane loads UNROLL keys of its warp's segment (32 apart, so each warp load reads
# 32 consecutive keys) before it uses any of them: UNROLL loads per thread in flight at once.
UNROLL = 8
# The images of a row's first CACHED_STEPS steps stay in registers (32 a thread): rows up to
# CACHED_KEYS keys are read from memory once; keys past it are read again in every pass (L2).
CACHED_STEPS = 4
CACHED_KEYS = THREADS * UNROLL * CACHED_STEPS
# Blocks an SM holds at once (__launch_bounds__): 4 caps a thread at 64 registers (ptxas spills
# at most 8 bytes; measured faster than 3 blocks).
MIN_BLOCKS_PER_SM = 4
SCORE_BITS = {"float32": 32, "bfloat16": 16}
# The sort holds the selected keys in shared memory: 8 bytes per slot.
MAX_COUNT = 8192
# bf16 rows: find the cut in one histogram of the images' distances below the row's largest image
# (one bin per image: WINDOW_BINS images, two binades), per warp, so that only keys near the top
# touch shared atomics and the per-warp counts of the gather come from the histograms, not from a
# counting walk; a row whose T-th key lies further down takes the generic passes. fp32 images
# have 32 bits, too many for one bin each: fp32 rows take the generic passes.
WINDOW_BINS = THREADS
# Every access of the kernel is in bounds by construction (keys below the row's end <= width,
# outputs below count, block maps within MASK_BLOCKS), so TileLang's per-access bound checks are
# off: each is two compares and a branch on every score load.
SELECT_PASS_CONFIGS = {"tl.disable_safe_memory_legalize": True}


# The sort widths a kernel is built for: T is a runtime size, so one build serves every T up to
# its width. Callers size the build by their top-k (``capacity``), not by the T of a call, so a
# short sequence (fewer keys than top-k) or a streamed window narrower than T reuses the build of
# a long one: no compile at a new length. Index order does not sort, so one build (MIN_SLOTS)
# serves every T.
MIN_SLOTS = 128


@dataclass(frozen=True)
class SelectConfig:
    """One compiled selector (all fields are arguments of :func:`radix_select_kernel`)."""

    score_dtype: str  # "float32" | "bfloat16"
    slots: int  # sort width, a power of two >= T (score order; MIN_SLOTS for index order)
    order: str  # "score" | "index"
    block_size: int = 0  # > 0: keys outside the row's kept candidate blocks are never selected

    def shared_memory_bytes(self) -> int:
        """Dynamic shared memory: the buffers live together during the gather: the per-warp
        counts, the window histograms and, for score order, the sort's 8-byte keys (the histogram
        passes may reuse these bytes earlier). The block map (MASK_BLOCKS bytes with
        ``block_size``) is static shared memory."""
        window = 4 * WARPS * WINDOW_BINS if self.score_dtype == "bfloat16" else 0
        return 4 * 2 * WARPS + window + (8 * max(self.slots, THREADS) if self.order == "score" else 0)


def sort_slots(count: int) -> int:
    """The sort width serving ``count`` selected keys: the next power of two, at least MIN_SLOTS."""
    return max(MIN_SLOTS, 1 << (count - 1).bit_length())


def select_config(score_dtype: torch.dtype, count: int, order: str, block_size: int = 0) -> SelectConfig:
    """The selector for scores of ``score_dtype`` keeping ``count`` per row in ``order``
    (``block_size`` > 0: masked by candidate blocks of that many keys)."""
    name = {torch.float32: "float32", torch.bfloat16: "bfloat16"}.get(score_dtype)
    if name is None:
        raise TypeError(f"scores must be float32 or bfloat16 for the TileLang selector, got {score_dtype}")
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    if not 1 <= count <= MAX_COUNT:
        raise ValueError(f"count must be in [1, {MAX_COUNT}] for the TileLang selector, got {count}")
    check_positive_int("block_size", block_size, minimum=0)
    slots = sort_slots(count) if order == "score" else MIN_SLOTS
    return SelectConfig(name, slots, order, block_size)


def dispatched_configs() -> list[SelectConfig]:
    """Every configuration the wrapper can build: dtypes, orders and sort widths."""
    widths = {"score": [MIN_SLOTS << i for i in range((MAX_COUNT // MIN_SLOTS).bit_length())], "index": [MIN_SLOTS]}
    return [
        SelectConfig(dtype, slots, order) for dtype in SCORE_BITS for order in ORDERS for slots in widths[order]
    ]  # fmt: skip


def select_build(
    score_dtype: torch.dtype, count: int, order: str, block_size: int = 0, *, capacity: int | None = None,
    vector: bool = False,
) -> KernelBuild:
    """The kernel :func:`select_rows_tilelang` runs to keep ``count`` keys per row.

    ``capacity``: the most keys this caller's rows ever keep (its top-k; default ``count``). A
    score-order sort is built for it rather than for ``count``: the sort keeps the selected keys
    in its first ``count`` slots whatever its width (the rest hold empty keys, which sort last),
    so the indices are the same and a call with fewer keys than top-k needs no build of its own.
    ``vector``: the vector select (:func:`uses_vector_select`) instead of the radix select.
    """
    if vector:
        return KernelBuild.of(vector_select_kernel, block_size=block_size)
    if capacity is not None:
        check_positive_int("capacity", capacity)
    sized = count if capacity is None else max(count, min(capacity, MAX_COUNT))
    config = select_config(score_dtype, sized, order, block_size)
    return KernelBuild.of(radix_select_kernel, pass_configs=SELECT_PASS_CONFIGS, **asdict(config))


def selection_builds(score_dtype: torch.dtype, topk: int, order: str, block_sizes=(0,)) -> list[KernelBuild]:
    """Every build :func:`select_rows_tilelang` can choose for a caller of top-``topk`` (its
    ``capacity``) at any sequence length: the radix select sized by ``topk`` and, for bf16 index
    order, the vector select too (which of the two runs depends on the scores' alignment, so on
    the length), for each candidate-block size in ``block_sizes`` (0: unmasked)."""
    check_positive_int("topk", topk)
    vectors = (False, True) if score_dtype == torch.bfloat16 and order == "index" else (False,)
    return [
        select_build(score_dtype, 1, order, block_size, capacity=topk, vector=vector)
        for block_size in block_sizes for vector in vectors
    ]  # fmt: skip


def uses_vector_select(scores: torch.Tensor, order: str) -> bool:
    """Whether ``select_rows_tilelang`` hands these rows to the vector select instead of the radix
    select: bf16 scores in index order, the matrix 16-byte aligned (its vectors are, whatever the width)."""
    return scores.dtype == torch.bfloat16 and order == "index" and scores.data_ptr() % 16 == 0


# ----------------------------------------------------------------------------------------------
# The kernel
# ----------------------------------------------------------------------------------------------


def radix_select_kernel(
    score_dtype: str,
    slots: int,
    order: str,
    block_size: int = 0,
    *,
    cached_steps: int = CACHED_STEPS,
    min_blocks: int | None = None,
    digit_bits: tuple[int, ...] | None = None,
):
    """PrimFunc selecting ``count`` (<= slots in score order, the outputs' width) keys per row.
    Grid: one block of 256 threads per row.

    Scores [rows, width] (row-major), ks/ke int32 [rows] (clamped to [0, width]), Index int32
    [rows, count] (window-local key numbers + ``offset``, -1 padding), Picked [rows, count] (the
    scores at Index, -inf at -1), offset: added to every selected index (a window's first key),
    Blocks int32 [rows, NBk] (read only with ``block_size`` > 0): the row's kept candidate blocks,
    numbered from ks in blocks of ``block_size`` keys, -1 padded; keys of other blocks are never
    selected (as if -inf). bf16 rows find the cut from one per-warp histogram of the images'
    distances below the row's largest image when the T-th key lies within WINDOW_BINS images of
    it, else (and fp32 rows always) by the generic passes.
    ``cached_steps``, ``min_blocks`` (blocks an SM must hold: caps the registers) and
    ``digit_bits`` (the passes' digit widths) are tuning knobs for measurements; the defaults are
    the measured best and the only configuration the wrapper builds.
    """
    T = tilelang().language
    dtype = T.float32 if score_dtype == "float32" else T.bfloat16
    score_bits = SCORE_BITS[score_dtype]
    u32, u64, i32 = T.uint32, T.uint64, T.int32
    sign, magnitude, exponent = (
        (0x80000000, 0x7FFFFFFF, 0x7F800000) if score_bits == 32 else (0x8000, 0x7FFF, 0x7F80)
    )
    digit_bits = DIGIT_BITS[score_dtype] if digit_bits is None else tuple(digit_bits)
    if sum(digit_bits) != score_bits or not all(1 <= bits <= MAX_DIGIT_BITS for bits in digit_bits):
        raise ValueError(f"digit_bits must add up to {score_bits} bits, each in [1, {MAX_DIGIT_BITS}], got {digit_bits}")
    if cached_steps < 1:
        raise ValueError(f"cached_steps must be >= 1, got {cached_steps}")
    top_window = score_dtype == "bfloat16"  # one histogram bin per image
    check_positive_int("block_size", block_size, minimum=0)
    masked = block_size > 0
    # (shift, bits) of each pass's digit of the image, most significant first
    passes = [(score_bits - sum(digit_bits[: i + 1]), bits) for i, bits in enumerate(digit_bits)]
    log_slots = slots.bit_length() - 1
    # Every thread holds per_thread keys of the sort; below THREADS slots the extra keys are 0s,
    # sorted among themselves.
    held_keys = max(slots, THREADS)
    per_thread = held_keys // THREADS
    if min_blocks is None:  # sorts of more than 2048 keys hold 32+ registers of keys a thread
        min_blocks = MIN_BLOCKS_PER_SM if per_thread <= 8 else 1
    rows, width, count = T.dynamic("rows"), T.dynamic("width"), T.dynamic("count")
    block_rows, kept_width = T.dynamic("block_rows"), T.dynamic("kept_width")

    def image_of(x):
        """Order-preserving unsigned image of a score; 0 for NaN/+-inf. Branch-free: negatives
        flip every bit, non-negatives set the sign bit, -0 moves up one to +0's image."""
        bits = T.cast(T.reinterpret(x, T.uint32 if score_bits == 32 else T.uint16), u32)
        image = bits ^ (((bits >> (score_bits - 1)) * magnitude) | sign)
        image = image + T.cast(bits == sign, u32)
        return image * T.cast((bits & exponent) != exponent, u32)

    @T.macro
    def load_step(Scores, row, first_key, segment_end, step, raw, base):
        """raw[base + u] = this lane's key of slot step * UNROLL + u (-inf past ``segment_end``)."""
        for u in T.unroll(UNROLL):
            j = first_key + (step * UNROLL + u) * WARP
            # No clamp of j: the load runs only below segment_end <= width (a clamp made the
            # index arithmetic 64-bit compares and selects, measured with ncu).
            raw[base + u] = T.if_then_else(j < segment_end, Scores[row, j], -T.infinity(dtype))

    def kept_image(x, j, start, kept):
        """The image of score ``x`` of key ``j``, 0 when its candidate block is not kept (the
        block map holds 0/1; keys past the row's end are -inf, image 0, whatever the map says)."""
        if not masked:
            return image_of(x)
        block = T.min(T.cast((j - start) // block_size, i32), MASK_BLOCKS - 1)
        return image_of(x) * T.cast(kept[block], u32)

    @T.macro
    def fetch_step(Scores, row, first_key, segment_end, step, raw, cached, images, start, kept):
        """images[u] for the keys of ``step``: from the registers for the first ``cached_steps``
        steps, loaded again for later ones (all loads issued before the first image)."""
        if step < cached_steps:
            for c in T.unroll(cached_steps):
                if step == c:
                    for u in T.unroll(UNROLL):
                        images[u] = cached[c * UNROLL + u]
        else:
            load_step(Scores, row, first_key, segment_end, step, raw, 0)
            for u in T.unroll(UNROLL):
                images[u] = kept_image(raw[u], first_key + (step * UNROLL + u) * WARP, start, kept)

    @T.prim_func
    def radix_select(
        Scores: T.Tensor([rows, width], dtype),
        KS: T.Tensor([rows], i32),
        KE: T.Tensor([rows], i32),
        Index: T.Tensor([rows, count], i32),
        Picked: T.Tensor([rows, count], dtype),
        offset: i32,
        Blocks: T.Tensor([block_rows, kept_width], i32),
    ):
        with T.Kernel(rows, threads=THREADS) as row:
            T.annotate_min_blocks_per_sm(min_blocks)
            tx = T.get_thread_binding()
            lane = tx % WARP
            lanes_below = T.shift_left(T.uint32(1), T.cast(lane, u32)) - T.uint32(1)
            warp = tx // WARP
            hist = T.alloc_shared([1 << max(digit_bits)], i32)
            warp_sums = T.alloc_shared([WARPS], i32)
            warp_taken = T.alloc_shared([2 * WARPS], i32)  # the gather's (taken-above, equal) keys per warp
            written = T.alloc_shared([1], i32)  # index order: selected keys of the row
            # The cut: keys with image >= above are taken, and of those with image == equal the
            # first ``need`` in index order. While digits remain, ``decided`` holds those fixed so
            # far and ``need`` the keys still to take among the keys that share them.
            decided = T.alloc_shared([1], u32)
            above = T.alloc_shared([1], u32)
            equal = T.alloc_shared([1], u32)
            need = T.alloc_shared([1], i32)
            done = T.alloc_shared([1], i32)
            keys = T.alloc_shared([held_keys], u64)
            # Static shared memory, apart from the merged dynamic allocation: read next to the
            # histogram atomics, a block map inside that allocation made TileLang put barriers in
            # every key loop.
            kept = T.alloc_shared([MASK_BLOCKS if masked else 1], T.uint8, scope="shared")  # the row's kept blocks (0/1)
            whist = T.alloc_shared([WARPS * WINDOW_BINS if top_window else 1], i32)  # per-warp window counts
            warp_best = T.alloc_shared([WARPS], u32)
            window_hit = T.alloc_shared([1], i32)  # the window decided the cut
            cached = T.alloc_local([cached_steps * UNROLL], u32)
            images = T.alloc_local([UNROLL], u32)
            raw = T.alloc_local([cached_steps * UNROLL], dtype)  # scores as loaded, before their images
            held = T.alloc_local([per_thread], u64)  # sort: key r * THREADS + tx of the network
            start = T.alloc_var(i32)
            end = T.alloc_var(i32)
            segment = T.alloc_var(i32)
            first_key = T.alloc_var(i32)
            segment_end = T.alloc_var(i32)
            steps = T.alloc_var(i32)
            running = T.alloc_var(i32)
            wanted = T.alloc_var(i32)
            count_here = T.alloc_var(i32)
            before = T.alloc_var(i32)  # the bin walk: keys in the bins above, the cut bin's count
            cut_bin = T.alloc_var(i32)
            cut_count = T.alloc_var(i32)
            cut_left = T.alloc_var(i32)
            # Read into registers once a pass / once for the gather: read inline from shared
            # memory next to the histogram atomics, TileLang put barriers around every key.
            prefix = T.alloc_var(u32)
            above_cut = T.alloc_var(u32)
            equal_cut = T.alloc_var(u32)
            take_equal = T.alloc_var(i32)
            taken_above = T.alloc_var(i32)  # keys before this slot taken for image >= above_cut
            seen_equal = T.alloc_var(i32)  # keys before this slot with image == equal_cut
            first = T.alloc_var(u64)  # the two keys a bitonic step compares
            second = T.alloc_var(u64)
            top = T.alloc_var(u32)  # the row's largest image (window)

            start = T.min(T.max(KS[row], 0), width)
            end = T.max(T.min(KE[row], width), start)
            # Warp w owns the ``segment`` keys from start + w * segment (a multiple of 32, so
            # every load of a warp reads 32 consecutive keys); lane l its keys l, l + 32, ...
            segment = T.ceildiv(end - start, WARPS * WARP) * WARP
            first_key = start + warp * segment + lane
            segment_end = T.min(end, start + (warp + 1) * segment)
            steps = T.ceildiv(segment, UNROLL * WARP)
            if tx == 0:
                decided[0] = 0
                above[0] = 0
                equal[0] = 0
                need[0] = count
                done[0] = 0
                window_hit[0] = 0
            if masked:
                # The map of the row's blocks from ks: cleared, then the kept ones set (-1 and
                # blocks past the row skipped); the wrapper keeps a row within MASK_BLOCKS blocks.
                for i in T.serial(T.ceildiv(T.ceildiv(end - start, block_size), THREADS)):
                    if i * THREADS + tx < T.ceildiv(end - start, block_size):
                        kept[i * THREADS + tx] = T.uint8(0)
                T.sync_threads()
                for i in T.serial(T.ceildiv(kept_width, THREADS)):
                    if i * THREADS + tx < kept_width:
                        block = Blocks[row, i * THREADS + tx]
                        if block >= 0 and block < T.ceildiv(end - start, block_size):
                            kept[block] = T.uint8(1)
            if order == "score":
                for r in T.serial(per_thread):
                    keys[r * THREADS + tx] = T.uint64(0)  # 0 sorts last: the -1 padding
            # The row's first CACHED_KEYS keys, read once: 32 loads in flight per thread.
            for s in T.unroll(cached_steps):
                load_step(Scores, row, first_key, segment_end, s, raw, s * UNROLL)
            for i in T.unroll(cached_steps * UNROLL):
                cached[i] = kept_image(raw[i], first_key + i * WARP, start, kept)
            T.sync_threads()

            if top_window:
                # The row's largest image (the cached images, then the steps past them; warp
                # shuffles, the warps' maxima), then one histogram per warp of the distances below
                # it, for the keys within WINDOW_BINS.
                top = T.uint32(0)
                for i in T.unroll(cached_steps * UNROLL):
                    top = T.max(top, cached[i])
                for s in T.serial(cached_steps, T.max(steps, cached_steps)):
                    fetch_step(Scores, row, first_key, segment_end, s, raw, cached, images, start, kept)
                    for u in T.unroll(UNROLL):
                        top = T.max(top, images[u])
                for d in (16, 8, 4, 2, 1):
                    top = T.max(top, T.shfl_xor(top, d))
                if lane == 0:
                    warp_best[warp] = top
                for w in range(WARPS):
                    whist[w * WINDOW_BINS + tx] = 0
                T.sync_threads()
                for w in range(WARPS):
                    top = T.max(top, warp_best[w])
                for s in T.serial(steps):
                    fetch_step(Scores, row, first_key, segment_end, s, raw, cached, images, start, kept)
                    for u in T.unroll(UNROLL):
                        if (images[u] != 0) & (top - images[u] < WINDOW_BINS):
                            T.atomic_add(whist[warp * WINDOW_BINS + T.cast(top - images[u], i32)], 1)
                T.sync_threads()
                # Thread tx owns distance tx (image top - tx); its inclusive scan counts the keys
                # with images >= top - tx. The thread where it reaches T holds the cut.
                wanted = need[0]
                count_here = sum(whist[w * WINDOW_BINS + tx] for w in range(WARPS))
                running = count_here
                for d in (1, 2, 4, 8, 16):
                    other = T.shfl_up(running, d)
                    if lane >= d:
                        running = running + other
                if lane == WARP - 1:
                    warp_sums[warp] = running
                T.sync_threads()
                for w in range(WARPS - 1):
                    if w < warp:
                        running = running + warp_sums[w]
                if running >= wanted and running - count_here < wanted:
                    cut_left = wanted - (running - count_here)
                    if count_here == cut_left:  # the whole bin: every key from its image up
                        above[0] = top - T.cast(tx, u32)
                        need[0] = 0
                    else:  # the T-th image: ``cut_left`` of its keys, the first in index order
                        above[0] = top - T.cast(tx, u32) + 1
                        equal[0] = top - T.cast(tx, u32)
                        need[0] = cut_left
                    done[0] = 1
                    window_hit[0] = 1
                T.sync_threads()

            for p, (shift, bits) in enumerate(passes):
                bins = 1 << bits
                per = max(1, bins // THREADS)  # bins a thread clears and scans
                owners = bins // per  # threads that own bins
                last_digit = shift == 0
                if done[0] == 0:
                    for i in tuple(range(per)):
                        if tx < owners:
                            hist[i * owners + tx] = 0
                    T.sync_threads()
                    prefix = decided[0]
                    for s in T.serial(steps):
                        fetch_step(Scores, row, first_key, segment_end, s, raw, cached, images, start, kept)
                        for u in T.unroll(UNROLL):
                            hit = images[u] != 0
                            if p > 0:
                                hit = hit & ((images[u] >> (shift + bits)) == (prefix >> (shift + bits)))
                            # Plain shared atomics: measured faster than aggregating equal digits
                            # per warp (__match_any_sync) and than wider digits.
                            if hit:
                                T.atomic_add(hist[T.cast((images[u] >> shift) & (bins - 1), i32)], 1)
                    T.sync_threads()
                    # Thread tx owns bins top, top - 1, ... (per of them, from the highest): its
                    # inclusive scan is the count of keys in bins >= its lowest (warp shuffles,
                    # then the warps' totals).
                    top = T.max(bins - 1 - tx * per, 0)
                    wanted = need[0]
                    count_here = T.if_then_else(tx < owners, sum(hist[top - i] for i in range(per)), 0)
                    running = count_here
                    for d in (1, 2, 4, 8, 16):
                        other = T.shfl_up(running, d)
                        if lane >= d:
                            running = running + other
                    if lane == WARP - 1:
                        warp_sums[warp] = running
                    T.sync_threads()
                    for w in range(WARPS - 1):
                        if w < warp:
                            running = running + warp_sums[w]
                    if p == 0 and tx == THREADS - 1 and running < wanted:
                        # Fewer finite keys than T: take them all (every image >= 1).
                        above[0] = 1
                        need[0] = 0
                        done[0] = 1
                    if running >= wanted and running - count_here < wanted:
                        # This thread's bin where the count reaches ``wanted``.
                        before = running - count_here
                        for i in tuple(range(per)):
                            if before < wanted and before + hist[top - i] >= wanted:
                                cut_bin = top - i
                                cut_count = hist[top - i]
                                cut_left = wanted - before
                            before = before + hist[top - i]
                        digits = prefix | T.shift_left(T.cast(cut_bin, u32), shift)
                        if cut_count == cut_left:  # the whole bin: every key from ``digits`` up
                            above[0] = digits
                            need[0] = 0
                            done[0] = 1
                        elif last_digit:  # ``digits`` is the T-th image: ``cut_left`` of its keys
                            above[0] = digits + 1
                            equal[0] = digits
                            need[0] = cut_left
                            done[0] = 1
                        else:
                            decided[0] = digits
                            need[0] = cut_left
                    T.sync_threads()

            # Gather the cut's keys in index order: each warp counts its segment's keys taken for
            # image >= above and those equal to the cut's image (ballots), one barrier, then
            # walks its segment again: a key's rank among the taken ones is the taken-above keys
            # before it + min(equal keys before it, need), and an equal key is taken while fewer
            # than ``need`` equal keys precede it (the tie rule).
            above_cut = above[0]
            equal_cut = equal[0]
            take_equal = need[0]
            taken_above = 0
            seen_equal = 0
            if top_window and window_hit[0] == 1:
                # The warp's counts from its window histogram (every taken key lies in the window):
                # each lane sums WINDOW_BINS / WARP distances, then the warp adds them up.
                for i in T.unroll(WINDOW_BINS // WARP):
                    count_here = whist[warp * WINDOW_BINS + lane * (WINDOW_BINS // WARP) + i]
                    prefix = top - T.cast(lane * (WINDOW_BINS // WARP) + i, u32)
                    taken_above = taken_above + T.if_then_else(prefix >= above_cut, count_here, 0)
                    seen_equal = seen_equal + T.if_then_else(prefix == equal_cut, count_here, 0)
                for d in (16, 8, 4, 2, 1):
                    taken_above = taken_above + T.shfl_xor(taken_above, d)
                    seen_equal = seen_equal + T.shfl_xor(seen_equal, d)
            else:
                for s in T.serial(steps):
                    fetch_step(Scores, row, first_key, segment_end, s, raw, cached, images, start, kept)
                    for u in T.unroll(UNROLL):
                        above_mask = T.cast(T.ballot_sync((images[u] >= above_cut) & (images[u] != 0)), u32)
                        equal_mask = T.cast(T.ballot_sync((images[u] == equal_cut) & (images[u] != 0)), u32)
                        taken_above = taken_above + T.cast(T.popcount(above_mask), i32)
                        seen_equal = seen_equal + T.cast(T.popcount(equal_mask), i32)
            if lane == 0:
                warp_taken[warp] = taken_above
                warp_taken[WARPS + warp] = seen_equal
            T.sync_threads()
            taken_above = sum(T.if_then_else(w < warp, warp_taken[w], 0) for w in range(WARPS))
            seen_equal = sum(T.if_then_else(w < warp, warp_taken[WARPS + w], 0) for w in range(WARPS))
            for s in T.serial(steps):
                fetch_step(Scores, row, first_key, segment_end, s, raw, cached, images, start, kept)
                for u in T.unroll(UNROLL):
                    j = first_key + (s * UNROLL + u) * WARP
                    above_mask = T.cast(T.ballot_sync((images[u] >= above_cut) & (images[u] != 0)), u32)
                    equal_mask = T.cast(T.ballot_sync((images[u] == equal_cut) & (images[u] != 0)), u32)
                    above_before = taken_above + T.cast(T.popcount(above_mask & lanes_below), i32)
                    equal_before = seen_equal + T.cast(T.popcount(equal_mask & lanes_below), i32)
                    is_above = (images[u] >= above_cut) & (images[u] != 0)
                    take = is_above | ((images[u] == equal_cut) & (images[u] != 0) & (equal_before < take_equal))
                    rank = above_before + T.min(equal_before, take_equal)
                    if take and rank < count:
                        if order == "score":
                            keys[rank] = T.shift_left(T.cast(images[u], u64), 32) | T.cast(
                                T.uint32(0xFFFFFFFF) - T.cast(j, u32), u64
                            )
                        else:
                            Index[row, rank] = j + offset
                            Picked[row, rank] = Scores[row, j]
                    taken_above = taken_above + T.cast(T.popcount(above_mask), i32)
                    seen_equal = seen_equal + T.cast(T.popcount(equal_mask), i32)

            if order == "index":
                # After the walk, the last warp's counters hold the row's totals.
                if tx == THREADS - 1:
                    written[0] = taken_above + T.min(seen_equal, take_equal)
                T.sync_threads()
                for i in T.serial(T.ceildiv(count, THREADS)):
                    slot = i * THREADS + tx
                    if slot >= written[0] and slot < count:
                        Index[row, slot] = -1
                        Picked[row, slot] = -T.infinity(dtype)
            else:
                T.sync_threads()
                # Bitonic sort, descending: the best key first, 0s (padding) last. Thread tx holds
                # keys r * THREADS + tx in registers: strides below a warp are lane shuffles and
                # strides of THREADS or more stay inside the thread, both without a barrier; only
                # strides in [WARP, THREADS) go through shared memory (9 of the 45 steps at 512
                # slots; a shared-memory step takes three barriers).
                for r in T.unroll(per_thread):
                    held[r] = keys[r * THREADS + tx]
                # Tuples, not range(): TileLang unrolls them in Python, so every stride is a
                # constant and the register indices below stay static (no local memory).
                for level in tuple(range(log_slots)):
                    size = 2 << level
                    for step in tuple(range(level + 1)):
                        stride = 1 << (level - step)
                        if stride >= THREADS:
                            for r in T.unroll(per_thread):
                                if r & (stride // THREADS) == 0:
                                    partner = r | (stride // THREADS)
                                    first = held[r]
                                    second = held[partner]
                                    descending = ((r * THREADS + tx) & size) == 0
                                    larger, smaller = T.max(first, second), T.min(first, second)
                                    held[r] = T.if_then_else(descending, larger, smaller)
                                    held[partner] = T.if_then_else(descending, smaller, larger)
                            continue
                        if stride >= WARP:
                            for r in T.unroll(per_thread):
                                keys[r * THREADS + tx] = held[r]
                            T.sync_threads()
                        for r in T.unroll(per_thread):
                            e = r * THREADS + tx
                            if stride >= WARP:
                                second = keys[e ^ stride]
                            else:
                                second = T.shfl_xor(held[r], stride)
                            # The lower key of a pair keeps the larger one in descending blocks.
                            keep_max = ((e & stride) == 0) == ((e & size) == 0)
                            held[r] = T.if_then_else(keep_max, T.max(held[r], second), T.min(held[r], second))
                        if stride >= WARP:
                            T.sync_threads()

                for r in T.unroll(per_thread):
                    s = r * THREADS + tx
                    key = held[r]
                    if s < count:
                        j = T.cast(T.uint32(0xFFFFFFFF) - T.cast(key & T.uint64(0xFFFFFFFF), u32), i32)
                        Index[row, s] = T.if_then_else(key != 0, j + offset, -1)
                        Picked[row, s] = T.if_then_else(key != 0, Scores[row, T.max(T.min(j, width - 1), 0)], -T.infinity(dtype))

    return radix_select


# ----------------------------------------------------------------------------------------------
# Launch wrapper
# ----------------------------------------------------------------------------------------------


@torch.no_grad()
def select_rows_tilelang(
    scores: torch.Tensor,
    count: int,
    order: str,
    ks: torch.Tensor | None = None,
    ke: torch.Tensor | None = None,
    *,
    offset: int = 0,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    blocks: torch.Tensor | None = None,
    block_size: int = 0,
    blocks_in_source_form: bool = False,
    capacity: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact top-``count`` of every row of ``scores [N, W]`` on the GPU (count <= W).

    Returns (indices int32 [N, count] + ``offset``, -1 padded; the scores at them, -inf padded).
    Only keys in ``[ks, ke)`` (int32 [N], default the whole row) are read; the caller guarantees
    that every finite score of a row lies there. ``out`` may hold the two result tensors.
    ``blocks`` int32 [N, NBk] with ``block_size`` C: the row's kept candidate blocks (numbered
    from ks, -1 padded; blocks past the row are ignored); keys of other blocks are treated as -inf
    (docs/semantics.md, candidate blocks). Needs ``ceil(W / C) <= MASK_BLOCKS``
    (:func:`fits_block_mask`). ``blocks_in_source_form``: the caller vouches that every list is as a
    candidate-source call returns it (ascending, then -1), which the vector select then reads without
    checking. bf16 rows in index order go to the vector select (:func:`uses_vector_select`).
    ``capacity``: the caller's top-k, which sizes the build (:func:`select_build`; default ``count``).
    """
    check_tensor("scores", scores, ndim=2, dtypes=(torch.float32, torch.bfloat16))
    if (blocks is None) != (block_size == 0):
        raise ValueError("blocks and block_size > 0 go together (candidate-block masking)")
    if not scores.is_cuda:
        raise ValueError(f"scores must be a CUDA tensor for the TileLang selector, got {scores.device}")
    rows, width = scores.shape
    check_positive_int("count", count)
    if count > width:
        raise ValueError(f"count must be <= the row width {width}, got {count}")
    if ks is None:
        ks = torch.zeros(rows, dtype=torch.int32, device=scores.device)
        ke = torch.full((rows,), width, dtype=torch.int32, device=scores.device)
    for name, value in (("ks", ks), ("ke", ke)):
        check_tensor(name, value, ndim=1, dtypes=(torch.int32,), shape=(rows,), device=scores.device)
    if blocks is not None:
        check_positive_int("block_size", block_size)
        check_tensor("blocks", blocks, ndim=2, dtypes=(torch.int32,), shape=(rows, None), device=scores.device)
        if not fits_block_mask(width, block_size):
            raise ValueError(f"blocks: rows of {width} keys have more than {MASK_BLOCKS} blocks of {block_size}")
    else:
        blocks = torch.empty((1, 1), dtype=torch.int32, device=scores.device)  # not read
    if out is None:
        out = (
            torch.empty((rows, count), dtype=torch.int32, device=scores.device),
            torch.empty((rows, count), dtype=scores.dtype, device=scores.device),
        )
    index, picked = out
    check_tensor("out[0]", index, dtypes=(torch.int32,), shape=(rows, count), device=scores.device)
    check_tensor("out[1]", picked, dtypes=(scores.dtype,), shape=(rows, count), device=scores.device)
    if rows:
        scores, ks, ke, blocks = scores.contiguous(), ks.contiguous(), ke.contiguous(), blocks.contiguous()
        vector = uses_vector_select(scores, order)
        kernel = select_build(scores.dtype, count, order, block_size, capacity=capacity, vector=vector).compile()
        if vector:
            kernel(scores, ks, ke, index, picked, offset, blocks, int(blocks_in_source_form))
        else:
            kernel(scores, ks, ke, index, picked, offset, blocks)
    return index, picked


def fits_block_mask(width: int, block_size: int) -> bool:
    """Whether rows of ``width`` keys fit the selector's candidate-block map."""
    return -(-width // block_size) <= MASK_BLOCKS
