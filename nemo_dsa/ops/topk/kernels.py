"""TileLang exact top-k for Hopper: one radix select per score row, ties to the smaller index.

Semantics (DSA-SPEC "Top-k selection", the same as ``naive.select_topk``): the best
T = min(count, W) *finite* scores of each row, ties to the smaller key index, -1 padding; rows
come out by descending score (``order="score"``, V4) or by ascending index (``order="index"``,
V4.1). Only keys in the row's ``[ks, ke)`` are read: the scoring kernels write -inf outside it.

Every selectable score gets the unique key (image, rev): ``image`` the score's bits mapped to an
unsigned integer of the same order (negatives bit-flipped, +-0 merged, 0 for NaN/+-inf: never
selected), ``rev = 2^b - 1 - index`` so that a larger key is a better score, then a smaller
index. A block of 256 threads owns one row and finds the T-th largest key digit by digit, 8 bits
per pass: a 256-bin shared-memory histogram of the keys that share the digits decided so far, a
block scan over the bins, and the bin where the running count reaches T. The select stops as
soon as the chosen bin holds exactly the keys still needed, so the index digits are visited
only when a run of equal scores straddles the cut. The keys >= the cut (exactly T, or every
finite key if fewer) are then gathered from warp ballots: by score into shared memory and
bitonic-sorted, by index written straight out in index order (no sort).

Cost at S = 32768, K = 8192 causal (4096 visible keys a row on average), T = 512: each pass
reads the row once (the first from HBM, the rest mostly from L1/L2: 512 MiB fp32 or 256 MiB bf16
for the whole matrix, ~0.1 ms of HBM), typically 3-4 passes for fp32 and 2-4 for bf16, ~20
instructions per key and pass; the sort is 45 compare-exchange steps of 512 slots. Predicted
~1 ms for fp32 and less for bf16, against 7.4 / 6.6 ms for ``naive.select_topk`` (torch.topk
of T + 64 candidates, then a key sort). Measured on the H200 (2026-11-30): 1.49 ms fp32 (the
sort holds its keys in registers: lane shuffles for strides below a warp; it cost 0.65 ms with
every step in shared memory) and 1.24-1.30 ms bf16; staging the row in shared memory,
aggregating equal digits per warp (__match_any_sync) and wider digits measured no faster
(docs/performance.md v4, v5).
"""

from dataclasses import asdict, dataclass

import torch

from nemo_dsa._checks import check_positive_int, check_tensor
from nemo_dsa.ops._tilelang import compile_cached, tilelang

RADIX_BITS = 8
BINS = 1 << RADIX_BITS
THREADS = BINS  # one histogram bin per thread in the scan
WARP = 32
SCORE_BITS = {"float32": 32, "bfloat16": 16}
ORDERS = ("score", "index")
# Rows up to this many keys use 16-bit index digits (two passes at most), longer ones 32-bit.
MAX_SHORT_ROW = 1 << 16
# The sort holds the selected keys in shared memory: 8 bytes per slot.
MAX_COUNT = 8192


# The sort widths a kernel is built for: T is a runtime size, so one build serves every T up to
# its width (no compile per T: streamed windows narrower than T select fewer keys). Index order
# does not sort, so one build (MIN_SLOTS) serves every T.
MIN_SLOTS = 128


@dataclass(frozen=True)
class SelectConfig:
    """One compiled selector (all fields are arguments of :func:`radix_select_kernel`)."""

    score_dtype: str  # "float32" | "bfloat16"
    slots: int  # sort width, a power of two >= T (score order; MIN_SLOTS for index order)
    order: str  # "score" | "index"
    index_bits: int  # 16 | 32: width of the index part of the key

    def shared_memory_bytes(self) -> int:
        """The histogram, and for score order the sort's 8-byte keys."""
        return 4 * BINS + (8 * max(self.slots, THREADS) if self.order == "score" else 0)


def sort_slots(count: int) -> int:
    """The sort width serving ``count`` selected keys: the next power of two, at least MIN_SLOTS."""
    return max(MIN_SLOTS, 1 << (count - 1).bit_length())


def select_config(score_dtype: torch.dtype, count: int, order: str, width: int) -> SelectConfig:
    """The selector for rows of ``width`` keys of ``score_dtype`` keeping ``count`` per row."""
    name = {torch.float32: "float32", torch.bfloat16: "bfloat16"}.get(score_dtype)
    if name is None:
        raise TypeError(f"scores must be float32 or bfloat16 for the TileLang selector, got {score_dtype}")
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    if not 1 <= count <= MAX_COUNT:
        raise ValueError(f"count must be in [1, {MAX_COUNT}] for the TileLang selector, got {count}")
    slots = sort_slots(count) if order == "score" else MIN_SLOTS
    return SelectConfig(name, slots, order, 16 if width <= MAX_SHORT_ROW else 32)


def dispatched_configs() -> list[SelectConfig]:
    """Every configuration the wrapper can build: dtypes, orders, sort widths and index widths."""
    widths = {"score": [MIN_SLOTS << i for i in range((MAX_COUNT // MIN_SLOTS).bit_length())], "index": [MIN_SLOTS]}
    return [
        SelectConfig(dtype, slots, order, bits)
        for dtype in SCORE_BITS
        for order in ORDERS
        for slots in widths[order]
        for bits in (16, 32)
    ]


# ----------------------------------------------------------------------------------------------
# The kernel
# ----------------------------------------------------------------------------------------------


def radix_select_kernel(score_dtype: str, slots: int, order: str, index_bits: int):
    """PrimFunc selecting ``count`` (<= slots, the outputs' width) keys per row. Grid: one block
    of 256 threads per row.

    Scores [rows, width] (row-major), ks/ke int32 [rows] (clamped to [0, width]), Index int32
    [rows, count] (window-local key numbers + ``offset``, -1 padding), Picked [rows, count] (the
    scores at Index, -inf at -1), offset: added to every selected index (a window's first key).
    """
    T = tilelang().language
    dtype = T.float32 if score_dtype == "float32" else T.bfloat16
    score_bits = SCORE_BITS[score_dtype]
    u32, u64, i32 = T.uint32, T.uint64, T.int32
    rev_max = (1 << index_bits) - 1
    sign, magnitude, exponent = (
        (0x80000000, 0x7FFFFFFF, 0x7F800000) if score_bits == 32 else (0x8000, 0x7FFF, 0x7F80)
    )
    # (digits of image, most significant first), then (digits of rev): (part, shift) per pass.
    passes = [("image", s) for s in range(score_bits - RADIX_BITS, -1, -RADIX_BITS)]
    passes += [("rev", s) for s in range(index_bits - RADIX_BITS, -1, -RADIX_BITS)]
    warps = THREADS // WARP
    log_slots = slots.bit_length() - 1
    # Every thread holds per_thread keys of the sort; below THREADS slots the extra keys are 0s,
    # sorted among themselves.
    held_keys = max(slots, THREADS)
    per_thread = held_keys // THREADS
    rows, width, count = T.dynamic("rows"), T.dynamic("width"), T.dynamic("count")

    def image_of(x):
        """Order-preserving unsigned image of a score; 0 for NaN/+-inf. Branch-free: negatives
        flip every bit, non-negatives set the sign bit, -0 moves up one to +0's image."""
        bits = T.cast(T.reinterpret(x, T.uint32 if score_bits == 32 else T.uint16), u32)
        image = bits ^ (((bits >> (score_bits - 1)) * magnitude) | sign)
        image = image + T.cast(bits == sign, u32)
        return image * T.cast((bits & exponent) != exponent, u32)

    @T.prim_func
    def radix_select(
        Scores: T.Tensor([rows, width], dtype),
        KS: T.Tensor([rows], i32),
        KE: T.Tensor([rows], i32),
        Index: T.Tensor([rows, count], i32),
        Picked: T.Tensor([rows, count], dtype),
        offset: i32,
    ):
        with T.Kernel(rows, threads=THREADS) as row:
            tx = T.get_thread_binding()
            lane = tx % WARP
            lanes_below = T.shift_left(T.uint32(1), T.cast(lane, u32)) - T.uint32(1)
            warp = tx // WARP
            hist = T.alloc_shared([BINS], i32)
            warp_sums = T.alloc_shared([warps], i32)
            # cut = (cut_image, cut_rev): the decided key prefix, finally the T-th best key.
            cut_image = T.alloc_shared([1], u32)
            cut_rev = T.alloc_shared([1], u32)
            need = T.alloc_shared([1], i32)  # keys still to take inside the decided prefix
            done = T.alloc_shared([1], i32)
            filled = T.alloc_shared([1], i32)
            keys = T.alloc_shared([held_keys], u64)
            held = T.alloc_local([per_thread], u64)  # sort: key r * THREADS + tx of the network
            start = T.alloc_var(i32)
            end = T.alloc_var(i32)
            running = T.alloc_var(i32)
            wanted = T.alloc_var(i32)
            count_here = T.alloc_var(i32)
            base = T.alloc_var(i32)
            if order == "index":
                written = T.alloc_var(i32)  # keys written so far
            score = T.alloc_var(dtype)  # one load per key and pass
            # The decided prefix, read into registers once a pass: read inline from shared memory
            # in the key loop, it made TileLang put two barriers around every key of the index
            # passes (the histogram atomics write the same shared buffer).
            prefix_image = T.alloc_var(u32)
            prefix_rev = T.alloc_var(u32)
            image = T.alloc_var(u32)
            first = T.alloc_var(u64)  # the two keys a bitonic step compares
            second = T.alloc_var(u64)

            start = T.min(T.max(KS[row], 0), width)
            end = T.max(T.min(KE[row], width), start)
            if tx == 0:
                cut_image[0] = 0
                cut_rev[0] = 0
                need[0] = count
                done[0] = 0
                filled[0] = 0
            if order == "score":
                for r in T.serial(per_thread):
                    keys[r * THREADS + tx] = T.uint64(0)  # 0 sorts last: the -1 padding
            T.sync_threads()

            for p, (part, shift) in enumerate(passes):
                if done[0] == 0:
                    hist[tx] = 0
                    T.sync_threads()
                    prefix_image = cut_image[0]
                    prefix_rev = cut_rev[0]
                    for it in T.serial(T.ceildiv(end - start, THREADS)):
                        j = start + it * THREADS + tx
                        image = 0
                        if j < end:
                            score = Scores[row, j]
                            image = image_of(score)
                        rev = T.cast(rev_max - j, u32)
                        if part == "image":
                            digit = (image >> shift) & (BINS - 1)
                            match = image != 0
                            if p > 0:
                                match = match & ((image >> (shift + RADIX_BITS)) == (prefix_image >> (shift + RADIX_BITS)))
                        else:
                            digit = (rev >> shift) & (BINS - 1)
                            match = (image != 0) & (image == prefix_image)
                            if shift + RADIX_BITS < index_bits:
                                match = match & ((rev >> (shift + RADIX_BITS)) == (prefix_rev >> (shift + RADIX_BITS)))
                        # Plain shared atomics: measured faster than aggregating equal digits
                        # per warp first (__match_any_sync), 1.70 against 1.91 ms at S = 32768.
                        if match:
                            T.atomic_add(hist[T.cast(digit, i32)], 1)
                    T.sync_threads()
                    # Thread tx holds bin 255 - tx: its inclusive scan is the count of keys in
                    # bins >= that bin (warp shuffles, then the warps' totals).
                    wanted = need[0]
                    count_here = hist[BINS - 1 - tx]
                    running = count_here
                    for d in (1, 2, 4, 8, 16):
                        other = T.shfl_up(running, d)
                        if lane >= d:
                            running = running + other
                    if lane == WARP - 1:
                        warp_sums[warp] = running
                    T.sync_threads()
                    for w in range(warps - 1):
                        if w < warp:
                            running = running + warp_sums[w]
                    bin_ = BINS - 1 - tx
                    if p == 0 and tx == THREADS - 1 and running < wanted:
                        # Fewer finite keys than T: take them all (every key >= (1, 0)).
                        cut_image[0] = 1
                        done[0] = 1
                    if running >= wanted and running - count_here < wanted:
                        left = wanted - (running - count_here)
                        if part == "image":
                            cut_image[0] = prefix_image | T.shift_left(T.cast(bin_, u32), shift)
                        else:
                            cut_rev[0] = prefix_rev | T.shift_left(T.cast(bin_, u32), shift)
                        need[0] = left
                        if count_here == left:
                            done[0] = 1
                    T.sync_threads()

            # Gather the keys >= cut (exactly T, or every finite key if fewer) from warp ballots.
            # Score order reserves sort slots with one shared atomic per warp; index order needs
            # no sort: each key is written where the ballots of the warps before it leave off.
            final_image = cut_image[0]
            final_rev = cut_rev[0]
            if order == "index":
                written = 0
            for it in T.serial(T.ceildiv(end - start, THREADS)):
                j = start + it * THREADS + tx
                image = 0
                if j < end:
                    score = Scores[row, j]
                    image = image_of(score)
                rev = T.cast(rev_max - j, u32)
                take = (image != 0) & ((image > final_image) | ((image == final_image) & (rev >= final_rev)))
                mask = T.cast(T.ballot_sync(take), u32)
                before = T.cast(T.popcount(mask & lanes_below), i32)
                if order == "score":
                    if lane == 0:
                        base = T.atomic_add(filled[0], T.cast(T.popcount(mask), i32), return_prev=True)
                    base = T.shfl_sync(base, 0)
                    if take and base + before < slots:
                        keys[base + before] = T.shift_left(T.cast(image, u64), 32) | T.cast(rev, u64)
                else:
                    if lane == 0:
                        warp_sums[warp] = T.cast(T.popcount(mask), i32)
                    T.sync_threads()
                    earlier = sum(T.if_then_else(w < warp, warp_sums[w], 0) for w in range(warps))
                    position = written + earlier + before
                    if take and position < count:
                        Index[row, position] = j + offset
                        Picked[row, position] = score
                    written = written + sum(warp_sums[w] for w in range(warps))
                    T.sync_threads()

            if order == "index":
                for i in T.serial(T.ceildiv(count, THREADS)):
                    s = i * THREADS + tx
                    if s >= written and s < count:
                        Index[row, s] = -1
                        Picked[row, s] = -T.infinity(dtype)
            else:
                T.sync_threads()
                # Bitonic sort, descending: the best key first, 0s (padding) last. Thread tx holds
                # keys r * THREADS + tx in registers: strides below a warp are lane shuffles and
                # strides of THREADS or more stay inside the thread, both without a barrier; only
                # strides in [WARP, THREADS) go through shared memory (9 of the 45 steps at 512
                # slots, where every step used to take three barriers).
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
                        j = rev_max - T.cast(key & T.uint64(0xFFFFFFFF), i32)
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
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact top-``count`` of every row of ``scores [N, W]`` on the GPU (count <= W).

    Returns (indices int32 [N, count] + ``offset``, -1 padded; the scores at them, -inf padded).
    Only keys in ``[ks, ke)`` (int32 [N], default the whole row) are read; the caller guarantees
    that every finite score of a row lies there. ``out`` may hold the two result tensors.
    """
    check_tensor("scores", scores, ndim=2, dtypes=(torch.float32, torch.bfloat16))
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
    if out is None:
        out = (
            torch.empty((rows, count), dtype=torch.int32, device=scores.device),
            torch.empty((rows, count), dtype=scores.dtype, device=scores.device),
        )
    index, picked = out
    check_tensor("out[0]", index, dtypes=(torch.int32,), shape=(rows, count), device=scores.device)
    check_tensor("out[1]", picked, dtypes=(scores.dtype,), shape=(rows, count), device=scores.device)
    if rows:
        config = select_config(scores.dtype, count, order, width)
        kernel = compile_cached(radix_select_kernel, **asdict(config))
        kernel(scores.contiguous(), ks.contiguous(), ke.contiguous(), index, picked, offset)
    return index, picked
