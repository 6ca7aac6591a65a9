"""Test helpers: visibility ranges built straight from DSA-SPEC's causal rule, random ranges, and
the layouts the kernel GPU tests share."""

from __future__ import annotations

import torch

from nemo_dsa.metadata import build_attention_metadata
from nemo_dsa.visibility import causal_ks_ke


def packed_ks_ke(doc_lengths: list[list[int]], seq_len: int, ratio: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ks/ke int32 [B, S] for rows packing documents back to back from position 0 (rest padding).

    A document spanning tokens [a, b) has ks = ceil(a / R) and, for its token at p,
    ke = max(ks, min((p + 1) // R, b // R)); padding tokens get ks = ke = 0.
    """
    ks = torch.zeros(len(doc_lengths), seq_len, dtype=torch.int32)
    ke = torch.zeros_like(ks)
    for row, lengths in enumerate(doc_lengths):
        start = 0
        for length in lengths:
            end = start + length
            first = -(-start // ratio)
            for p in range(start, end):
                ks[row, p] = first
                ke[row, p] = max(first, min((p + 1) // ratio, end // ratio))
            start = end
        assert start <= seq_len
    return ks, ke


def random_ks_ke(batch: int, queries: int, num_keys: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Arbitrary valid ranges 0 <= ks <= ke <= K, including some empty ones."""
    a = torch.randint(0, num_keys + 1, (batch, queries), generator=generator)
    b = torch.randint(0, num_keys + 1, (batch, queries), generator=generator)
    ks, ke = torch.minimum(a, b), torch.maximum(a, b)
    ke[:, ::5] = ks[:, ::5]  # every fifth query sees nothing
    return ks.to(torch.int32), ke.to(torch.int32)


KERNEL_RATIO = 4
# (layout, batch, local queries, keys or None = from the layout) of the scoring kernels' GPU tests.
KERNEL_LAYOUTS = [
    ("causal", 2, 333, None),
    ("causal_more_keys", 1, 190, 301),
    ("packed", 2, 299, None),
    ("cp_local", 2, 152, None),
    ("cp_packed", 1, 200, None),
    ("random_ranges", 3, 257, 517),
]


def kernel_layout_ks_ke(layout: str, batch: int, queries: int, num_keys: int | None, device, gen: torch.Generator):
    """(ks, ke, K) on ``device`` for one of KERNEL_LAYOUTS; packed and CP layouts come from
    build_attention_metadata, random ranges from ``gen``."""
    if layout in ("causal", "causal_more_keys"):
        num_keys = num_keys or queries // KERNEL_RATIO
        return (*causal_ks_ke(batch, queries, num_keys, KERNEL_RATIO, torch.device(device)), num_keys)
    if layout == "packed":  # documents that start off multiples of R, one padded tail
        meta = build_attention_metadata(
            compress_ratio=KERNEL_RATIO,
            seq_lens=torch.tensor([[37, 101, 11, 140], [1, 250, 40, 0]]),
            seq_lens_padded=torch.tensor([[37, 101, 11, 150], [1, 250, 48, 0]]),
        )
    elif layout == "cp_local":  # rank 1 of 2: local queries, global keys
        pos = torch.arange(queries, 2 * queries).unsqueeze(0).expand(batch, queries)
        meta = build_attention_metadata(compress_ratio=KERNEL_RATIO, position_ids=pos, cp_rank=1, cp_size=2)
    elif layout == "cp_packed":  # rank 2 of 3 of a packed row
        lens = torch.tensor([[150, 93, 301, 56]])
        meta = build_attention_metadata(compress_ratio=KERNEL_RATIO, seq_lens=lens, cp_rank=2, cp_size=3)
    elif layout == "random_ranges":  # arbitrary [ks, ke), including empty and full rows
        a = torch.randint(0, num_keys + 1, (batch, queries), generator=gen)
        b = torch.randint(0, num_keys + 1, (batch, queries), generator=gen)
        ks, ke = torch.minimum(a, b), torch.maximum(a, b)
        ks[0, :5], ke[0, :5] = 0, num_keys
        ke[-1, 5:9] = ks[-1, 5:9]
        return ks.int().to(device), ke.int().to(device), num_keys
    else:
        raise AssertionError(layout)
    assert meta.ks.shape == (batch, queries), (layout, meta.ks.shape)
    return meta.ks.to(device), meta.ke.to(device), meta.num_groups
