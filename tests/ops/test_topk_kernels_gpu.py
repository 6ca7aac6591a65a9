"""TileLang radix select against the reference selection on the GPU (pytest -m gpu on the H200).

Bitwise equality of indices and picked scores with ``select_topk_reference`` (which implements the
docs/semantics.md rule with unique keys): fresh random rows of ragged widths, both dtypes and orders, T in
{64, 100, 512, 1024, 2048}, visible ranges, quantised scores with long runs of ties at the cut,
NaN/+-inf, signed zeros, rows with fewer finite scores than T and rows that see nothing, rows
past the kernel's register cache (8192 keys) and past 65536 keys; bf16 rows whose cut the window
below the row's maximum decides and rows it cannot (the generic passes); candidate-block masks applied inside the select (unordered, repeated, -1 and
out-of-row blocks, block sizes 3 / 4 / 8) against masking the scores first; V4.1 candidate blocks
(block maxima + the select over blocks) against their reference. The vector select (bf16, index
order, aligned matrices) runs through every bf16 index-order test above, and on rows of
every alignment, rows holding +inf, rows with fewer finite keys than T, and candidate blocks of 8
read from their list (the candidate source's form; other lists through the map). Outputs are
poisoned before the kernel writes them.
"""

import zlib

import pytest
import torch

from nemo_dsa.ops.topk import candidate_blocks_reference, select_topk_reference
from nemo_dsa.ops.v41_indexer import candidate_blocks, candidates
from nemo_dsa.ops.topk.block_kernels import block_maxima_tilelang
from nemo_dsa.ops.topk.interface import select_topk
from nemo_dsa.ops.topk import kernels as topk_kernels
from nemo_dsa.ops.topk.kernels import select_rows_tilelang

pytestmark = pytest.mark.gpu


def _rows(kind: str, rows: int, width: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "continuous":
        x = torch.randn(rows, width, generator=g) * 3
    elif kind == "quantised":  # a handful of values: every cut falls inside a long run of ties
        x = torch.randint(-3, 4, (rows, width), generator=g) / 2
    elif kind == "spread":  # many binades a row: the T-th key lies far below the maximum
        x = torch.randn(rows, width, generator=g) * torch.exp(torch.randn(rows, width, generator=g) * 4)
    elif kind == "mostly_inf":  # few finite keys among -inf and some +inf: rows of more than T keys, fewer finite
        x = torch.randn(rows, width, generator=g)
        pick = torch.rand(rows, width, generator=g)
        x[pick < 0.9] = float("-inf")
        x[pick > 0.99] = float("inf")
    elif kind in ("signed", "nonpositive"):  # signed zeros, NaN and -inf, no +inf (the vector select decides)
        x = torch.randint(-2, 3 if kind == "signed" else 1, (rows, width), generator=g).float()
        x[x == 0] = torch.where(torch.rand(int((x == 0).sum()), generator=g) < 0.5, 0.0, -0.0)
        pick = torch.rand(rows, width, generator=g)
        x[pick < 0.05] = float("nan")
        x[(pick >= 0.05) & (pick < 0.15)] = float("-inf")
    else:  # "special": signed zeros, infinities and NaN among a few finite values
        x = torch.randint(-2, 3, (rows, width), generator=g).float()
        x[x == 0] = torch.where(torch.rand(int((x == 0).sum()), generator=g) < 0.5, 0.0, -0.0)
        pick = torch.rand(rows, width, generator=g)
        x[pick < 0.05] = float("nan")
        x[(pick >= 0.05) & (pick < 0.1)] = float("inf")
        x[(pick >= 0.1) & (pick < 0.2)] = float("-inf")
    return x.to(dtype).cuda()


def _ranges(rows: int, width: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random visible ranges incl. empty rows and full rows; scores outside become -inf."""
    g = torch.Generator().manual_seed(seed + 1)
    a = torch.randint(0, width + 1, (rows,), generator=g)
    b = torch.randint(0, width + 1, (rows,), generator=g)
    ks, ke = torch.minimum(a, b), torch.maximum(a, b)
    ks[0], ke[0] = 0, width  # a whole row
    ks[1], ke[1] = 5, 5  # a row that sees nothing
    return ks.int().cuda(), ke.int().cuda()


def _mask_outside(scores, ks, ke):
    cols = torch.arange(scores.shape[-1], device=scores.device)
    inside = (cols >= ks[:, None].long()) & (cols < ke[:, None].long())
    return scores.masked_fill(~inside, float("-inf"))


def _expected(scores, count, order):
    index = select_topk_reference(scores, count, order)
    picked = torch.where(index >= 0, torch.gather(scores, -1, index.clamp_min(0).long()), float("-inf"))
    return index, picked.to(scores.dtype)


def _poisoned(rows, count, dtype):
    return (
        torch.full((rows, count), -7, dtype=torch.int32, device="cuda"),
        torch.full((rows, count), float("nan"), dtype=dtype, device="cuda"),
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("order", ["score", "index"])
@pytest.mark.parametrize("kind", ["continuous", "quantised", "special"])
# Widths past 8192 keys reach the steps that are read again in every pass (not cached in registers).
@pytest.mark.parametrize("count,width", [(64, 300), (100, 1001), (512, 4097), (1024, 3000), (2048, 8191), (512, 20_001)])
def test_kernel_equals_reference_on_ranges(dtype, order, kind, count, width):
    rows = 67
    seed = zlib.crc32(f"{dtype}{order}{kind}{count}".encode()) % 1000
    ks, ke = _ranges(rows, width, seed)
    scores = _mask_outside(_rows(kind, rows, width, dtype, seed), ks, ke)
    index, picked = select_rows_tilelang(scores, count, order, ks, ke, offset=0, out=_poisoned(rows, count, dtype))
    want_index, want_picked = _expected(scores, count, order)
    assert torch.equal(index, want_index)
    assert torch.equal(picked, want_picked)  # no NaN poison left: selected scores are finite


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["continuous", "quantised", "special"])
# A short sequence keeps fewer keys than its top-k: the sort built for the top-k (capacity) holds
# them in its first slots, and a row narrower than T (count == width) too.
@pytest.mark.parametrize("count,width,capacity", [(1, 40, 512), (37, 90, 512), (100, 100, 512), (300, 700, 2048),
                                                  (129, 4000, 8192), (2048, 2048, 4096)])
def test_sort_sized_by_capacity_equals_reference(dtype, kind, count, width, capacity):
    rows = 45
    seed = zlib.crc32(f"{dtype}{kind}{count}{capacity}".encode()) % 1000
    ks, ke = _ranges(rows, width, seed)
    scores = _mask_outside(_rows(kind, rows, width, dtype, seed), ks, ke)
    build = topk_kernels.select_build(dtype, count, "score", capacity=capacity)
    assert dict(build.config)["slots"] == topk_kernels.sort_slots(capacity) > topk_kernels.sort_slots(count)
    index, picked = select_rows_tilelang(scores, count, "score", ks, ke, out=_poisoned(rows, count, dtype),
                                         capacity=capacity)  # fmt: skip
    want_index, want_picked = _expected(scores, count, "score")
    assert torch.equal(index, want_index)
    assert torch.equal(picked, want_picked)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_whole_rows_offset_and_count_equal_to_width(dtype):
    rows, width = 33, 129
    scores = _rows("quantised", rows, width, dtype, 5)
    index, picked = select_rows_tilelang(scores, width, "score", offset=1000, out=_poisoned(rows, width, dtype))
    want_index, want_picked = _expected(scores, width, "score")
    assert torch.equal(index, torch.where(want_index >= 0, want_index + 1000, -1))
    assert torch.equal(picked, want_picked)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_past_65536_keys(dtype):
    rows, width, count = 5, 70_001, 512
    scores = _rows("quantised", rows, width, dtype, 9)  # ties at the cut span the whole row
    index, _ = select_rows_tilelang(scores, count, "index", out=_poisoned(rows, count, dtype))
    assert torch.equal(index, select_topk_reference(scores, count, "index"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dispatcher_uses_ranges_and_matches_reference(dtype):
    scores = _rows("continuous", 2 * 300, 777, dtype, 3).view(2, 300, 777)
    ks, ke = _ranges(600, 777, 3)
    scores = _mask_outside(scores.view(600, 777), ks, ke).view(2, 300, 777)
    got = select_topk(scores, 128, "score", ks=ks.view(2, 300), ke=ke.view(2, 300))
    assert torch.equal(got, select_topk_reference(scores, 128, "score"))
    assert torch.equal(select_topk(scores, 128, "index", backend="tilelang"), select_topk_reference(scores, 128, "index"))
    with pytest.raises(TypeError, match="float32 or bfloat16"):
        select_topk(scores.half(), 8, backend="tilelang")


def _random_blocks(rows: int, width: int, block_size: int, seed: int) -> torch.Tensor:
    """Kept block numbers per row (from ks): unordered, repeated, -1 padded, some past the row."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = -(-width // block_size)
    kept = max(1, num_blocks // 3)
    blocks = torch.randint(-1, num_blocks, (rows, kept), generator=g)
    blocks[:, -1] = -1
    return blocks.int().cuda()


# The masked selector V4.1 uses (bf16, index order: the vector select), the radix select's on a
# misaligned bf16 matrix, and its score-order paths (fp32 and bf16).
@pytest.mark.parametrize("dtype,order,misaligned", [
    pytest.param(torch.bfloat16, "index", False, id="bfloat16-index-vector"),
    pytest.param(torch.bfloat16, "index", True, id="bfloat16-index-radix"),
    pytest.param(torch.bfloat16, "score", False, id="bfloat16-score"),
    pytest.param(torch.float32, "score", False, id="float32-score"),
])
@pytest.mark.parametrize("kind", ["continuous", "quantised", "special"])
@pytest.mark.parametrize("count,width,block_size", [(64, 1001, 4), (512, 20_001, 8), (100, 3000, 3)])
def test_block_masked_kernel_equals_reference(dtype, order, misaligned, kind, count, width, block_size):
    """Candidate-block masks applied inside the select equal masking the scores first."""
    from nemo_dsa.ops.v41_indexer import blocks_to_mask

    rows = 67
    seed = zlib.crc32(f"mask{dtype}{order}{kind}{count}".encode()) % 1000
    ks, ke = _ranges(rows, width, seed)
    scores = _mask_outside(_rows(kind, rows, width, dtype, seed), ks, ke)
    if misaligned:  # 2 bytes off: the radix select serves it
        shifted = torch.empty(rows * width + 1, dtype=dtype, device="cuda")[1:].view(rows, width)
        scores = shifted.copy_(scores)
        assert not topk_kernels.uses_vector_select(scores, order)
    blocks = _random_blocks(rows, width, block_size, seed)
    keep = blocks_to_mask(blocks[None], ks[None], ke[None], block_size, width)[0]
    out = _poisoned(rows, count, dtype)
    index, picked = select_rows_tilelang(scores, count, order, ks, ke, out=out, blocks=blocks, block_size=block_size)
    want_index, want_picked = _expected(scores.masked_fill(~keep, float("-inf")), count, order)
    assert torch.equal(index, want_index)
    assert torch.equal(picked, want_picked)


@pytest.mark.parametrize("spread", [0.01, 1.0, 100.0])
def test_bf16_window_and_generic_passes_agree(spread):
    """bf16 rows whose T-th key lies near the maximum (the window decides), far below it (the
    generic passes do) and between: the dispatched select and the radix select equal the
    reference."""
    from dataclasses import asdict

    from nemo_dsa.ops._tilelang import compile_cached
    from nemo_dsa.ops.topk.kernels import SELECT_PASS_CONFIGS, radix_select_kernel, select_config

    rows, width, count = 129, 9000, 512
    g = torch.Generator().manual_seed(int(spread * 100))
    scale = torch.exp(torch.randn(rows, 1, generator=g) * spread)  # rows of very different ranges
    scores = (torch.randn(rows, width, generator=g) * scale + torch.randn(rows, 1, generator=g)).bfloat16().cuda()
    ks, ke = _ranges(rows, width, int(spread * 10))
    scores = _mask_outside(scores, ks, ke)
    want_index, want_picked = _expected(scores, count, "index")
    index, picked = select_rows_tilelang(scores, count, "index", ks, ke, out=_poisoned(rows, count, torch.bfloat16))
    assert torch.equal(index, want_index) and torch.equal(picked, want_picked)
    config = asdict(select_config(torch.bfloat16, count, "index"))
    kernel = compile_cached(radix_select_kernel, pass_configs=SELECT_PASS_CONFIGS, **config)
    index2, picked2 = _poisoned(rows, count, torch.bfloat16)
    kernel(scores, ks, ke, index2, picked2, 0, torch.empty((1, 1), dtype=torch.int32, device="cuda"))
    assert torch.equal(index2, want_index) and torch.equal(picked2, want_picked)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["quantised", "special"])
@pytest.mark.parametrize("width,block_size,keep", [(4096 + 37, 8, 2048), (1000, 3, 100), (16384, 8, 2048)])
def test_candidate_blocks_on_the_gpu_equal_the_reference(dtype, kind, width, block_size, keep):
    """Candidate blocks on CUDA (block maxima from the TileLang kernel, then the TileLang select
    over blocks) against the scatter-reduce reference on the same scores: ties across blocks,
    NaN/inf, ragged ranges, rows that see nothing, several sequences."""
    assert candidates.uses_maxima_kernel(dtype, torch.device("cuda"), "auto")
    seed = zlib.crc32(f"cand-{dtype}-{kind}-{width}-{block_size}".encode())
    batch, queries = 3, 41
    scores = _rows(kind, batch * queries, width, dtype, seed).view(batch, queries, width)
    ks, ke = (x.view(batch, queries) for x in _ranges(batch * queries, width, seed))
    want = candidate_blocks_reference(scores, ks, ke, block_size, keep)
    assert int((want >= 0).sum(-1).max()) > 1  # rows keep more than their last block
    assert torch.equal(candidate_blocks(scores, ks, ke, block_size, keep, backend="tilelang"), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [8, 3])
def test_block_maxima_kernel_equals_brute_force(dtype, block_size):
    """Every block's maximum of its finite visible scores (-inf for none), element by element:
    rows wider than one grid column of blocks, ragged and empty ranges."""
    rows, width = 37, 5000
    seed = zlib.crc32(f"maxima-{dtype}-{block_size}".encode())
    scores = _rows("special", rows, width, dtype, seed)
    ks, ke = _ranges(rows, width, seed)
    num_blocks = -(-width // block_size)
    got = block_maxima_tilelang(scores, ks, ke, block_size, num_blocks)
    keys = torch.arange(width, device="cuda")
    inside = (keys >= ks[:, None].long()) & (keys < ke[:, None].long())
    values = scores.float().masked_fill(~(inside & torch.isfinite(scores.float())), float("-inf"))
    block = ((keys - ks[:, None].long()) // block_size).clamp(0, num_blocks - 1)
    want = torch.full((rows, num_blocks), float("-inf"), device="cuda").scatter_reduce(1, block, values, "amax")
    assert got.dtype == dtype and torch.equal(got.float(), want)
    assert bool(torch.isfinite(got).any())


# The vector select: bf16 rows in index order, read in 16-byte vectors.
VECTOR_KINDS = ["continuous", "quantised", "signed", "nonpositive", "spread", "special", "mostly_inf"]


@pytest.mark.parametrize("kind", VECTOR_KINDS)
# Odd widths put rows at every alignment; 20,001 and 40,000 keys pass the 8,192 kept in registers.
@pytest.mark.parametrize("count,width", [(64, 304), (100, 1001), (512, 4096), (2048, 8191), (512, 20_001), (512, 40_000)])
def test_vector_select_equals_reference(kind, count, width):
    """The default bf16 index-order path (the vector select) against the reference, with the data
    reaching its special paths: rows holding +inf (read again without it), rows of more than T keys
    but fewer finite ones (every finite key taken), rows whose T-th key lies far below the top (the
    coarse window)."""
    from nemo_dsa.ops.topk.vector_kernels import WINDOW_BINS

    rows = 67
    seed = zlib.crc32(f"vector{kind}{count}{width}".encode()) % 1000
    ks, ke = _ranges(rows, width, seed)
    scores = _mask_outside(_rows(kind, rows, width, torch.bfloat16, seed), ks, ke)
    assert topk_kernels.uses_vector_select(scores, "index")
    want_index, want_picked = _expected(scores, count, "index")
    index, picked = select_rows_tilelang(scores, count, "index", ks, ke, offset=0, out=_poisoned(rows, count, torch.bfloat16))
    assert torch.equal(index, want_index)
    assert torch.equal(picked, want_picked)
    long_rows = (ke - ks).long() > count
    if kind in ("special", "mostly_inf") and width >= 1000:
        assert bool(((scores == float("inf")).any(-1) & long_rows).any())
    if kind == "mostly_inf" and width >= 1000:
        assert bool((long_rows & (torch.isfinite(scores).sum(-1) < count)).any())
    if kind == "spread" and width >= 1000:  # some rows' T-th key lies past the first window: the coarse one
        images = _bf16_images(scores)
        cut = _bf16_images(want_picked).masked_fill(want_index < 0, 1 << 16).amin(-1)
        assert bool(((images.amax(-1) - cut >= WINDOW_BINS) & (want_index >= 0).all(-1)).any())


def _listed_blocks(ks, ke, width: int, kept_width: int, seed: int, disordered: bool) -> torch.Tensor:
    """Candidate blocks of 8 in the candidate source's form: each row's kept blocks ascending, then -1;
    every fifth row's list ends in a block past the row (ignored), every seventh keeps at most 3 blocks,
    every eleventh all it can. ``disordered``: every third row's list is not in that form (two entries
    swapped, or a block after the -1s): the map path."""
    g = torch.Generator().manual_seed(seed)
    rows = ks.shape[0]
    out = torch.full((rows, kept_width), -1, dtype=torch.int32)
    for r in range(rows):
        row_blocks = -(-(int(ke[r]) - int(ks[r])) // 8)
        take = int(torch.randint(0, min(row_blocks, kept_width) + 1, (1,), generator=g))
        take = min(take, 3) if r % 7 == 1 else take  # rows keeping fewer keys than T
        take = min(row_blocks, kept_width) if r % 11 == 4 else take  # rows keeping every block (when they fit)
        out[r, :take] = torch.randperm(row_blocks, generator=g)[:take].sort().values
        if r % 5 == 0 and take < kept_width and row_blocks + r % 3 < -(-width // 8):
            out[r, take] = row_blocks + r % 3
        if disordered and r % 3 == 0 and take >= 2:
            if r % 2:
                out[r, [0, take - 1]] = out[r, [take - 1, 0]]
            elif take + 1 < kept_width:
                out[r, take + 1] = out[r, 0]
    return out.cuda()


@pytest.mark.parametrize("kind", ["continuous", "quantised", "special", "spread", "mostly_inf"])
# kept_width 4,200 passes the list's shared memory (4,096 blocks): the map path.
@pytest.mark.parametrize("count,width,kept_width", [(64, 1001, 100), (100, 3000, 40), (512, 20_001, 2048),
                                                    (512, 40_000, 2048), (512, 40_000, 4200)])  # fmt: skip
@pytest.mark.parametrize("disordered,source_form", [(False, False), (False, True), (True, False)],
                         ids=["listed", "source-form", "disordered"])  # fmt: skip
def test_vector_select_reads_candidate_lists(kind, count, width, kept_width, disordered, source_form):
    """Candidate blocks of 8 through the vector select (V4.1 reindex layers): read from the list when it
    is in the candidate source's form (checked, or vouched for: ``blocks_in_source_form``), through the
    map otherwise, the whole row when it keeps every block; all equal the reference on the scores
    masked to the kept blocks. Half the rows' ks at multiples of 8 (in matrices of even widths: 16-byte
    block loads), the others anywhere; partial last blocks; rows keeping fewer than T keys."""
    from nemo_dsa.ops.v41_indexer import blocks_to_mask

    rows = 67
    seed = zlib.crc32(f"listed{kind}{count}{width}{kept_width}{disordered}".encode()) % 1000
    ks, ke = _ranges(rows, width, seed)
    ks[::2] -= ks[::2] % 8
    scores = _mask_outside(_rows(kind, rows, width, torch.bfloat16, seed), ks, ke)
    blocks = _listed_blocks(ks.cpu(), ke.cpu(), width, kept_width, seed, disordered)
    keep = blocks_to_mask(blocks[None], ks[None], ke[None], 8, width)[0]
    want_index, want_picked = _expected(scores.masked_fill(~keep, float("-inf")), count, "index")
    out = _poisoned(rows, count, torch.bfloat16)
    index, picked = select_rows_tilelang(scores, count, "index", ks, ke, out=out, blocks=blocks, block_size=8,
                                         blocks_in_source_form=source_form)  # fmt: skip
    assert torch.equal(index, want_index)
    assert torch.equal(picked, want_picked)
    assert bool(((ke - ks) > count).any()) and bool(((blocks >= 0).sum(-1) * 8 < count).any())


def _bf16_images(x: torch.Tensor) -> torch.Tensor:
    """The selects' order-preserving images of bf16 scores (int32; 0 for NaN and +-inf)."""
    bits = x.view(torch.int16).int() & 0xFFFF
    image = (bits ^ (((bits >> 15) * 0x7FFF) | 0x8000)) + (bits == 0x8000).int()
    return torch.where((bits & 0x7F80) == 0x7F80, 0, image)


def test_vector_select_offset_and_misaligned_storage():
    """Window-local indices + offset, and a matrix stored 2 bytes off alignment (the radix select alone)."""
    rows, width, count = 40, 3001, 300
    scores = _rows("continuous", rows, width, torch.bfloat16, 11)
    want_index, want_picked = _expected(scores, count, "index")
    index, picked = select_rows_tilelang(scores, count, "index", offset=777, out=_poisoned(rows, count, torch.bfloat16))
    assert torch.equal(index, want_index + 777) and torch.equal(picked, want_picked)
    shifted = torch.empty(rows * width + 1, dtype=torch.bfloat16, device="cuda")[1:].view(rows, width)
    shifted.copy_(scores)
    assert not topk_kernels.uses_vector_select(shifted, "index")
    index, picked = select_rows_tilelang(shifted, count, "index", out=_poisoned(rows, count, torch.bfloat16))
    assert torch.equal(index, want_index) and torch.equal(picked, want_picked)
