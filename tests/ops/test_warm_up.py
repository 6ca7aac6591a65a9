"""No TileLang build after the first step: every kernel a model chooses, at any sequence length,
is in the set ``ops.warm_up.model_builds`` names (and ``warm_up`` builds on the first step).

Nothing compiles here: the selection's launch is replaced by a recorder of the build
``select_rows_tilelang`` would choose (``topk.kernels.select_build``, for both alignments of
bf16 scores, since which of the vector and radix selects runs depends on it), driven through the
real chunk loop (``fused_selection.window.select_chunks``) over windows of every width a length
can give; the attention's mode is the one ``KernelInputs`` picks for CPU operands of many
lengths, with and without compressed keys and index slots.
"""

from __future__ import annotations

import random

import pytest
import torch

from nemo_dsa.ops.fused_selection import window
from nemo_dsa.ops.fused_selection.plan import QueryChunk
from nemo_dsa.ops.sparse_attention.configs import backward_config, forward_config
from nemo_dsa.ops.sparse_attention.kernels import KernelInputs
from nemo_dsa.ops.topk.kernels import MAX_COUNT, select_build, sort_slots, uses_vector_select
from nemo_dsa.ops.warm_up import model_builds

MAX_LENGTH = 70_000


def _lengths(seed: int) -> list[int]:
    rng = random.Random(seed)
    return sorted({*range(1, 300), *(rng.randint(300, MAX_LENGTH) for _ in range(300)), MAX_LENGTH})


def _record_selections(monkeypatch) -> set:
    chosen = set()

    def recorder(scores, count, order, ks=None, ke=None, *, offset=0, out=None, blocks=None, block_size=0,
                 blocks_in_source_form=False, capacity=None):  # fmt: skip
        vectors = {uses_vector_select(scores, order)}
        if scores.dtype == torch.bfloat16 and order == "index":
            vectors = {True, False}  # a slice of the same scores may be unaligned
        for vector in vectors:
            chosen.add(select_build(scores.dtype, count, order, block_size, capacity=capacity, vector=vector))
        rows = scores.shape[0]
        return (torch.full((rows, count), -1, dtype=torch.int32),
                torch.full((rows, count), float("-inf"), dtype=scores.dtype))  # fmt: skip

    monkeypatch.setattr(window, "select_rows_tilelang", recorder)
    return chosen


def _run_chunks(widths, count, order, dtype, capacity, block_size=0):
    """select_chunks on the GPU path over one-query windows of ``widths`` keys."""
    chunks = [QueryChunk(i, i + 1, 0, w) for i, w in enumerate(widths)]

    def score_chunk(chunk, first_pass):
        scores = torch.randn(1, 1, chunk.width).to(dtype)
        ks, ke = torch.zeros(1, 1, dtype=torch.int32), torch.full((1, 1), chunk.width, dtype=torch.int32)
        blocks = torch.zeros(1, 1, 1, dtype=torch.int32) if block_size else None
        return scores, ks, ke, blocks

    emitted = []
    window.select_chunks(chunks, score_chunk, lambda c, i, v: emitted.append(i), count, order, 1 << 20, True,
                         block_size=block_size, capacity=capacity)  # fmt: skip
    assert len(emitted) == len(chunks) and all(i.shape == (1, count) for i in emitted)


def _widths(num_keys: int, rng: random.Random) -> list[int]:
    """Windows a call over ``num_keys`` compressed keys can stream: the whole axis, the narrow
    windows of the first queries and of packed sequences' starts, ragged ones between."""
    return sorted({num_keys, 1, min(num_keys, 64), *(rng.randint(1, num_keys) for _ in range(3))})


@pytest.mark.parametrize("topk", [512, 1024, 2048])
@pytest.mark.parametrize("ratio", [4, 128])
def test_v4_selection_is_one_build_at_every_length(monkeypatch, topk, ratio):
    chosen = _record_selections(monkeypatch)
    rng = random.Random(topk + ratio)
    for length in _lengths(topk * ratio):
        num_keys = length // ratio
        if num_keys == 0:
            continue  # no compressed keys: no selection
        count = min(topk, num_keys)  # as v4_select_topk_in_ranges sizes its call
        _run_chunks(_widths(num_keys, rng), count, "score", torch.float32, topk)
    warmed = set(model_builds("v4", topk, 512).selections)
    assert chosen and chosen <= warmed, sorted(b.name() for b in chosen - warmed)
    assert len(warmed) == 1 and dict(next(iter(warmed)).config)["slots"] == sort_slots(topk)


@pytest.mark.parametrize("block_size", [None, 8])
def test_v41_selection_builds_cover_every_length(monkeypatch, block_size):
    chosen = _record_selections(monkeypatch)
    rng = random.Random(7)
    topk = 512
    for length in _lengths(41)[::7]:
        num_keys = length // 4
        if num_keys == 0:
            continue
        count = min(topk, num_keys)
        # Reindex layers: masked in the select, or (rows too long for its block map) unmasked.
        for masked in (0,) if block_size is None else (0, block_size):
            _run_chunks(_widths(num_keys, rng), count, "index", torch.bfloat16, topk, masked)
    warmed = set(model_builds("v41", topk, 512, block_size).selections)
    assert chosen == warmed, sorted(b.name() for b in chosen ^ warmed)
    assert len(warmed) == (2 if block_size is None else 4)  # vector and radix select, per mask


def test_sizing_by_count_alone_would_build_per_length():
    """The recorder can fail: sized by the keys a call keeps, short sequences choose other sorts."""
    sized_by_count = {select_build(torch.float32, min(512, k), "score") for k in range(1, 1000)}
    assert {dict(b.config)["slots"] for b in sized_by_count} == {128, 256, 512}
    sized_by_topk = {select_build(torch.float32, min(512, k), "score", capacity=512) for k in range(1, 1000)}
    assert len(sized_by_topk) == 1
    # top-k beyond the sort's width: calls of at most MAX_COUNT keys share the widest sort
    assert dict(select_build(torch.float32, 5, "score", capacity=10 * MAX_COUNT).config)["slots"] == MAX_COUNT
    with pytest.raises(ValueError, match="count"):
        select_build(torch.float32, MAX_COUNT + 1, "score", capacity=MAX_COUNT)
    with pytest.raises(ValueError, match="capacity"):
        select_build(torch.float32, 4, "score", capacity=0)


def _attention_mode(length: int, dim: int, compressed: int | None, slots: int | None) -> str:
    q = torch.randn(1, length, 2, dim, dtype=torch.bfloat16)
    raw = torch.randn(1, length, dim, dtype=torch.bfloat16)
    comp = None if compressed is None else torch.randn(1, compressed, dim, dtype=torch.bfloat16)
    indices = None if slots is None else torch.full((1, length, slots), -1, dtype=torch.int32)
    ks = ke = None if slots is not None or comp is None else torch.zeros(1, length, dtype=torch.int32)
    zeros = torch.zeros(1, dtype=torch.int32)
    return KernelInputs(q, raw, zeros, 128, comp, indices, ks, ke, None, dim**-0.5).mode


@pytest.mark.parametrize("dim", [512, 128, 192])
def test_attention_modes_of_every_length_are_warmed(dim):
    chosen = set()
    for length in (1, 2, 3, 4, 5, 127, 128, 129, 1000):
        for ratio in (4, 128):
            num_keys = length // ratio
            cases = [(None, None), (num_keys or None, None)]  # no compressor / an all-groups layer
            cases.append((num_keys or None, min(512, num_keys)))  # an indexer layer: T = min(topk, K)
            for compressed, slots in cases:
                mode = _attention_mode(length, dim, compressed, slots)
                kdim = 512 if dim > 128 else 128
                chosen |= {forward_config(kdim, mode), backward_config(kdim, mode)}
    warmed = set(model_builds("v4", 512, dim).attention)
    assert chosen == warmed  # both modes occur, and both are warmed


def test_model_builds_validate():
    with pytest.raises(ValueError, match="family"):
        model_builds("v5", 512, 512)
    with pytest.raises(ValueError, match="topk"):
        model_builds("v4", 0, 512)
    with pytest.raises(TypeError, match="candidate_block_size"):
        model_builds("v41", 512, 512, 8.0)


def _precompile_script():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "scripts" / "precompile_kernels.py"
    spec = importlib.util.spec_from_file_location("precompile_kernels", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


@pytest.mark.parametrize("family,block_size", [("v4", None), ("v41", None), ("v41", 8)])
def test_precompile_script_builds_what_the_first_step_warms(family, block_size):
    jobs = _precompile_script()._jobs([64], [128], [512], [8])
    selects = {job[1] for job in jobs if job[0] in ("select", "vector")}
    attention = {job[1] for job in jobs if job[0] == "attention"}
    builds = model_builds(family, 512, 512, block_size)
    assert set(builds.selections) <= selects
    assert set(builds.attention) <= attention
    # and the script's kinds split the selects as --kinds names them
    assert {job[1].factory.__name__ for job in jobs if job[0] == "vector"} == {"vector_select_kernel"}
    assert {job[1].factory.__name__ for job in jobs if job[0] == "select"} == {"radix_select_kernel"}
