"""Test helpers: visibility ranges built straight from DSA-SPEC's causal rule, and random ranges."""

from __future__ import annotations

import torch


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
