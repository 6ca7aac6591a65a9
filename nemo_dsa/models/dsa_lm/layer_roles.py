"""Which layer does what: the one place that derives attention roles from the layer schedule.

Every layer's role comes from ``compress_ratios`` and the V4.1 id lists:
``window`` (ratio 0), ``all_groups`` (ratio > 0, != 4), and on ratio-4 (indexer) layers
``source`` (owns compressed KV and index keys, selects), ``reindex`` (reuses the latest source's
keys, selects again) or ``reuse`` (attends at the latest selection). Without
``kv_source_layer_ids`` every ratio-4 layer is a source; without ``index_source_layer_ids`` the
index sources are the kv sources. :func:`derive_v41_layer_roles` turns the scoring node's
``layer_roles`` schedule (every n-th indexer layer) into those id lists.
"""

from __future__ import annotations

from collections.abc import Sequence

from nemo_dsa._checks import is_positive_int

# Layers with this compression ratio carry an indexer (DeepSeek-V4: ratio-4 layers select top-k
# groups; other ratios attend to every visible group).
INDEXER_RATIO = 4
ROLES = ("window", "all_groups", "source", "reindex", "reuse")


def indexer_layers(compress_ratios: Sequence[int]) -> list[int]:
    """Indices of the layers that carry an indexer."""
    return [i for i, r in enumerate(compress_ratios) if r == INDEXER_RATIO]


def kv_source_layers(compress_ratios: Sequence[int], kv_source_layer_ids: Sequence[int] | None) -> tuple[int, ...]:
    """Layers owning compressed KV and index keys (default: every indexer layer)."""
    if kv_source_layer_ids is None:
        return tuple(indexer_layers(compress_ratios))
    return tuple(kv_source_layer_ids)


def index_source_layers(
    compress_ratios: Sequence[int],
    kv_source_layer_ids: Sequence[int] | None,
    index_source_layer_ids: Sequence[int] | None,
) -> tuple[int, ...]:
    """Layers that select their own top-k (default: the kv sources)."""
    if index_source_layer_ids is None:
        return kv_source_layers(compress_ratios, kv_source_layer_ids)
    return tuple(index_source_layer_ids)


def attention_role(
    compress_ratios: Sequence[int],
    layer_idx: int,
    kv_source_layer_ids: Sequence[int] | None = None,
    index_source_layer_ids: Sequence[int] | None = None,
) -> str:
    """The role of ``layer_idx``, one of :data:`ROLES` (see the module docstring)."""
    ratio = compress_ratios[layer_idx]
    if ratio == 0:
        return "window"
    if ratio != INDEXER_RATIO:
        return "all_groups"
    if layer_idx in kv_source_layers(compress_ratios, kv_source_layer_ids):
        return "source"
    if layer_idx in index_source_layers(compress_ratios, kv_source_layer_ids, index_source_layer_ids):
        return "reindex"
    return "reuse"


def derive_v41_layer_roles(
    compress_ratios: Sequence[int],
    *,
    kv_source_every: int = 1,
    index_source_every: int = 1,
    candidate_source: str | int = "none",
) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    """V4.1 layer roles over the indexer layers, as in DeepSeek-V4.1's schedule.

    Counting indexer layers from 0: every ``kv_source_every``-th owns its compressed KV and index
    keys (the others reuse the latest source's), every ``index_source_every``-th selects its own
    top-k (the others reuse the latest selection), and every KV source also selects.
    ``candidate_source`` is ``"first"`` (the first KV source computes candidate blocks),
    ``"none"`` (off), or a layer id. Returns ``(kv_source_layer_ids, index_source_layer_ids,
    candidate_source_layer_id)``.
    """
    for key, value in (("kv_source_every", kv_source_every), ("index_source_every", index_source_every)):
        if not is_positive_int(value):
            raise ValueError(f"scoring.layer_roles.{key} must be an int >= 1, got {value!r}")
    layers = indexer_layers(compress_ratios)
    kv = tuple(layer for n, layer in enumerate(layers) if n % kv_source_every == 0)
    index = tuple(layer for n, layer in enumerate(layers) if n % index_source_every == 0 or layer in kv)
    if candidate_source == "none" or not layers:
        candidate = -1
    elif candidate_source == "first":
        candidate = kv[0]
    elif isinstance(candidate_source, int) and not isinstance(candidate_source, bool):
        candidate = candidate_source
    else:
        raise ValueError(
            f"scoring.layer_roles.candidate_source must be 'first', 'none' or a layer id, got {candidate_source!r}"
        )
    return kv, index, candidate
