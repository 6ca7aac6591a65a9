"""The V4.1 selection's shortcuts on the GPU (pytest -m gpu): the scorer's row maxima and the
select's window lists.

- The scorer with ``tops`` writes the same scores as without, and each row's top equals the
  largest image of its written scores (``bf16_images``; 0 for rows that see no finite score):
  every head count's tile shape, ragged S, B in {1, 3}, causal / packed / random ranges.
- The window select given a top (the exact maximum, a larger bound, or 0 = unknown) and with
  per-warp window lists (the default capacity, and one so small that most warps overflow and
  walk their keys) equals the reference: continuous, quantised (ties at the cut) and special
  (NaN/+-inf/-0) rows, rows past the register cache, candidate-block masks.
- The streamed V4.1 selection with both shortcuts on equals it with both off.
Outputs are poisoned before the kernels write them.
"""

import zlib
from dataclasses import asdict, replace

import pytest
import torch
from helpers import KERNEL_LAYOUTS, indexer_inputs, kernel_layout_ks_ke
from test_topk_kernels_gpu import _expected, _mask_outside, _poisoned, _random_blocks, _ranges, _rows

from nemo_dsa.ops._images import bf16_images
from nemo_dsa.ops.topk import blocks_to_mask
from nemo_dsa.ops.topk import kernels as topk_kernels

pytestmark = pytest.mark.gpu


def _row_tops(scores: torch.Tensor) -> torch.Tensor:
    return bf16_images(scores).amax(-1).int()


@pytest.mark.parametrize("heads,dim", [(2, 128), (8, 64), (32, 128), (64, 128)])
@pytest.mark.parametrize("layout,batch,queries,num_keys", KERNEL_LAYOUTS)
def test_scorer_tops_are_the_rows_largest_scores(heads, dim, layout, batch, queries, num_keys):
    from nemo_dsa.ops.v41_indexer.kernels import v41_scores_tilelang

    gen = torch.Generator().manual_seed(zlib.crc32(f"tops/{heads}/{dim}/{layout}".encode()))
    ks, ke, num_keys = kernel_layout_ks_ke(layout, batch, queries, num_keys, "cuda", gen)
    q, k, w = indexer_inputs(batch, queries, heads, dim, num_keys, gen, w_scale="fan_in", w_dtype=torch.bfloat16, device="cuda")
    plain = v41_scores_tilelang(q, k, w, ks, ke)
    out = torch.full_like(plain, float("nan"))
    tops = torch.full((batch, queries), -7, dtype=torch.int32, device="cuda")
    got = v41_scores_tilelang(q, k, w, ks, ke, out=out, tops=tops)
    assert torch.equal(got, plain)
    assert torch.equal(tops, _row_tops(plain))
    assert bool((tops == 0).any()) == bool((ke <= ks).any())  # rows that see nothing: 0


def _select(scores, ks, ke, count, *, tops=None, list_capacity=0, blocks=None, block_size=0):
    """The window select built with the given shortcuts (a capacity off the dispatch table too)."""
    from nemo_dsa.ops._tilelang import compile_cached

    config = topk_kernels.select_config(torch.bfloat16, count, "index", block_size, tops is not None)
    config = replace(config, top_window=True, list_capacity=list_capacity)
    kernel = compile_cached(topk_kernels.radix_select_kernel, pass_configs=topk_kernels.SELECT_PASS_CONFIGS, **asdict(config))
    index, picked = _poisoned(scores.shape[0], count, torch.bfloat16)
    unused = torch.empty((1, 1), dtype=torch.int32, device="cuda")
    unset = torch.empty((1,), dtype=torch.int32, device="cuda")
    kernel(scores, ks, ke, index, picked, 0, unused if blocks is None else blocks, unset if tops is None else tops)
    return index, picked


TOPS = ["none", "exact", "bound", "unknown"]
CAPACITIES = [0, topk_kernels.LIST_CAPACITY[False], 32]


def _tops(kind: str, scores: torch.Tensor):
    exact = _row_tops(scores)
    return {"none": None, "exact": exact, "bound": (exact + 3).clamp_max(0xFFFF), "unknown": torch.zeros_like(exact)}[kind]


@pytest.mark.parametrize("tops", TOPS)
@pytest.mark.parametrize("capacity", CAPACITIES)
@pytest.mark.parametrize("kind", ["continuous", "quantised", "special", "near-top"])
@pytest.mark.parametrize("count,width", [(100, 1001), (512, 4097), (512, 20_001), (2048, 9000)])
def test_window_select_with_tops_and_lists_equals_reference(tops, capacity, kind, count, width):
    rows = 67
    seed = zlib.crc32(f"lists/{kind}/{count}/{width}".encode()) % 1000
    ks, ke = _ranges(rows, width, seed)
    if kind == "near-top":  # the window decides nearly every row: one binade of a few values
        g = torch.Generator().manual_seed(seed)
        scores = (1 + torch.randint(0, 40, (rows, width), generator=g) / 64).bfloat16().cuda()
    else:
        scores = _rows(kind, rows, width, torch.bfloat16, seed)
    scores = _mask_outside(scores, ks, ke)
    index, picked = _select(scores, ks, ke, count, tops=_tops(tops, scores), list_capacity=capacity)
    want_index, want_picked = _expected(scores, count, "index")
    assert torch.equal(index, want_index)
    assert torch.equal(picked, want_picked)


@pytest.mark.parametrize("capacity", [topk_kernels.LIST_CAPACITY[True], 32])
@pytest.mark.parametrize("count,width,block_size", [(64, 1001, 4), (512, 20_001, 8)])
def test_masked_window_select_with_tops_and_lists(capacity, count, width, block_size):
    """Candidate-block masks: the scorer's top is a bound over every key, kept or not."""
    rows = 67
    seed = zlib.crc32(f"masked-lists/{count}/{block_size}".encode()) % 1000
    ks, ke = _ranges(rows, width, seed)
    scores = _mask_outside(_rows("continuous", rows, width, torch.bfloat16, seed), ks, ke)
    blocks = _random_blocks(rows, width, block_size, seed)
    keep = blocks_to_mask(blocks[None], ks[None], ke[None], block_size, width)[0]
    index, picked = _select(scores, ks, ke, count, tops=_row_tops(scores), list_capacity=capacity, blocks=blocks,
                            block_size=block_size)  # fmt: skip
    want_index, want_picked = _expected(scores.masked_fill(~keep, float("-inf")), count, "index")
    assert torch.equal(index, want_index)
    assert torch.equal(picked, want_picked)


@pytest.mark.parametrize("layout,batch,queries,heads", [("causal", 1, 4133, 32), ("packed", 2, 5000, 64), ("cp", 1, 1531, 16)])
def test_streamed_v41_selection_with_both_shortcuts(layout, batch, queries, heads, monkeypatch):
    from test_fused_selection_gpu import _layout

    from nemo_dsa.ops.fused_selection import interface as fused_interface
    from nemo_dsa.ops.fused_selection import v41_select_topk

    ks, ke, num_keys = _layout(layout, batch, queries, 2, seed=queries)
    q, k, w = indexer_inputs(batch, queries, heads, 128, num_keys, queries, w_dtype=torch.bfloat16, w_scale="fan_in", device="cuda")
    plain = v41_select_topk(q, k, w, ks, ke, 512, backend="tilelang", chunk_bytes=8 * 2**20)
    monkeypatch.setattr(fused_interface, "SCORER_TOPS", True)
    monkeypatch.setattr(topk_kernels, "WINDOW_LISTS", True)
    assert torch.equal(v41_select_topk(q, k, w, ks, ke, 512, backend="tilelang", chunk_bytes=8 * 2**20), plain)
