"""Brute-force oracles written straight from docs/semantics.md's rules (Python loops; small sizes only).

A row is described by per-token labels over the GLOBAL row: 0 = padding, any other value names
a document (each document one contiguous run). Other test files may import these read-only.
"""

from __future__ import annotations

import torch


def oracle_row(labels: list[int], ratio: int) -> dict:
    """Everything docs/semantics.md derives for one global row, by definition (no closed forms).

    Returns lists: ``doc_ids`` (1 + document start, 0 = padding), ``local_positions``,
    ``group_valid``, ``group_doc_ids`` (length K = len // ratio) and ``visible`` (len x K bools).
    """
    n = len(labels)
    first_index: dict[int, int] = {}
    for i, label in enumerate(labels):
        if label != 0:
            first_index.setdefault(label, i)
    doc_ids = [0 if label == 0 else 1 + first_index[label] for label in labels]
    local_positions = [0 if label == 0 else i - first_index[label] for i, label in enumerate(labels)]

    num_groups = n // ratio
    group_valid, group_doc_ids = [], []
    for j in range(num_groups):
        members = labels[j * ratio : (j + 1) * ratio]
        ok = members[0] != 0 and all(m == members[0] for m in members)
        group_valid.append(ok)
        group_doc_ids.append(doc_ids[j * ratio] if ok else 0)

    visible = []
    for i, label in enumerate(labels):
        row = []
        for j in range(num_groups):
            last_token = (j + 1) * ratio - 1
            row.append(group_valid[j] and label != 0 and labels[j * ratio] == label and last_token <= i)
        visible.append(row)
    return {
        "doc_ids": doc_ids,
        "local_positions": local_positions,
        "group_valid": group_valid,
        "group_doc_ids": group_doc_ids,
        "visible": visible,
    }


def oracle_batch(labels: list[list[int]], ratio: int) -> dict[str, torch.Tensor]:
    """``oracle_row`` over a batch, stacked into tensors ([B, G], [B, K], [B, G, K])."""
    rows = [oracle_row(row, ratio) for row in labels]
    out = {}
    for key, dtype in (
        ("doc_ids", torch.int64),
        ("local_positions", torch.int64),
        ("group_valid", torch.bool),
        ("group_doc_ids", torch.int64),
        ("visible", torch.bool),
    ):
        out[key] = torch.tensor([r[key] for r in rows], dtype=dtype)
    return out
