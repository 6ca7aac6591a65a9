"""Which layer does what: the one place that derives attention roles from the layer schedule.

Every layer's role comes from ``compress_ratios``, the ratios that carry an indexer
(``indexer_ratios``: DeepSeek-V4's 4, DeepSeek-V4.1's every ratio > 0) and the V4.1 id lists:
``window`` (ratio 0), ``all_groups`` (a ratio without an indexer: every visible group), and on
indexer layers ``source`` (owns compressed KV and index keys, selects), ``reindex`` (reuses the
latest source's keys, selects again) or ``reuse`` (attends at the latest selection). Without
``kv_source_layer_ids`` every indexer layer is a source; without ``index_source_layer_ids`` the
index sources are the kv sources. A reindex or reuse layer reads the latest kv source before it,
which must have its ratio (checked by ``DSAModelConfig``). :func:`derive_v41_layer_roles` turns the scoring node's
``layer_roles`` schedule (every n-th indexer layer) into those id lists.
"""

from __future__ import annotations

from collections.abc import Sequence

from nemo_dsa._checks import is_positive_int

# DeepSeek-V4: ratio-4 layers carry an indexer that selects top-k groups; other ratios attend to
# every visible group. (DeepSeek-V4.1 gives every compressed layer an indexer role.)
INDEXER_RATIO = 4
DEFAULT_INDEXER_RATIOS = (INDEXER_RATIO,)
ROLES = ("window", "all_groups", "source", "reindex", "reuse")


def indexer_layers(compress_ratios: Sequence[int], indexer_ratios: Sequence[int] = DEFAULT_INDEXER_RATIOS) -> list[int]:
    """Indices of the layers that carry an indexer (a ratio in ``indexer_ratios``)."""
    return [i for i, r in enumerate(compress_ratios) if r > 0 and r in indexer_ratios]


def kv_source_layers(
    compress_ratios: Sequence[int],
    kv_source_layer_ids: Sequence[int] | None,
    indexer_ratios: Sequence[int] = DEFAULT_INDEXER_RATIOS,
) -> tuple[int, ...]:
    """Layers owning compressed KV and index keys (default: every indexer layer)."""
    if kv_source_layer_ids is None:
        return tuple(indexer_layers(compress_ratios, indexer_ratios))
    return tuple(kv_source_layer_ids)


def index_source_layers(
    compress_ratios: Sequence[int],
    kv_source_layer_ids: Sequence[int] | None,
    index_source_layer_ids: Sequence[int] | None,
    indexer_ratios: Sequence[int] = DEFAULT_INDEXER_RATIOS,
) -> tuple[int, ...]:
    """Layers that select their own top-k (default: the kv sources)."""
    if index_source_layer_ids is None:
        return kv_source_layers(compress_ratios, kv_source_layer_ids, indexer_ratios)
    return tuple(index_source_layer_ids)


def attention_role(
    compress_ratios: Sequence[int],
    layer_idx: int,
    kv_source_layer_ids: Sequence[int] | None = None,
    index_source_layer_ids: Sequence[int] | None = None,
    indexer_ratios: Sequence[int] = DEFAULT_INDEXER_RATIOS,
) -> str:
    """The role of ``layer_idx``, one of :data:`ROLES` (see the module docstring)."""
    ratio = compress_ratios[layer_idx]
    if ratio == 0:
        return "window"
    if ratio not in indexer_ratios:
        return "all_groups"
    if layer_idx in kv_source_layers(compress_ratios, kv_source_layer_ids, indexer_ratios):
        return "source"
    if layer_idx in index_source_layers(compress_ratios, kv_source_layer_ids, index_source_layer_ids, indexer_ratios):
        return "reindex"
    return "reuse"


def latest_kv_source(kv_sources: Sequence[int], layer_idx: int) -> int | None:
    """The kv source whose state ``layer_idx`` reads: the last one at or before it (None if none)."""
    earlier = [i for i in kv_sources if i <= layer_idx]
    return earlier[-1] if earlier else None


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
