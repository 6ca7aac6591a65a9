"""Shared test helpers: input builders, visibility layouts, and (at the end) model configs.

Input builders draw in a fixed order from a seeded generator, so a test's inputs depend only on
its seed. Visibility ranges are built straight from docs/semantics.md's rules (``packed_ks_ke``), drawn at
random (``random_ks_ke``) or taken from the layouts the kernel GPU tests share.
"""

from __future__ import annotations

import os
import zlib

import pytest
import torch

from nemo_dsa.metadata import build_attention_metadata
from nemo_dsa.models.dsa_lm.configuration import DSAModelConfig
from nemo_dsa.visibility import causal_ks_ke

# ----------------------------------------------------------------------------------------------
# Indexer inputs
# ----------------------------------------------------------------------------------------------


def generator(seed: int) -> torch.Generator:
    """A CPU generator seeded with ``seed``."""
    return torch.Generator().manual_seed(seed)


def stable_seed(*parts) -> int:
    """A seed from a test case's parameters that is the same in every process (``hash()`` of a
    string changes from process to process, so a failing case would not reproduce). One part
    is hashed as itself, so ``stable_seed(case)`` is the CRC of ``repr(case)``."""
    return zlib.crc32(repr(parts[0] if len(parts) == 1 else parts).encode())


def indexer_inputs(
    batch: int,
    queries: int,
    heads: int,
    dim: int,
    num_keys: int,
    seed: int | torch.Generator,
    *,
    w_dtype: torch.dtype = torch.float32,
    w_scale: float | str | None = None,
    quantised: bool = False,
    seq_first: bool = False,
    device: str | torch.device = "cpu",
    requires_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Index queries, keys and head weights (q, k bf16; w in ``w_dtype``), drawn in that order.

    BSHD shapes q [B, S, H, D], k [B, K, D], w [B, S, H]; ``seq_first`` draws V4's SBHD shapes
    q [S, B, H, D], k [K, B, D], w [S, B, H] instead. Random normal q and k, and w normal times
    ``w_scale`` (default H^-1/2; ``"fan_in"``: (D H)^-1/2, the kernels' tests). ``quantised``: q, k in {-1, 0, 1} and w in quarter steps in
    [-1/2, 1/2], so every product and sum of the scorers is exact in fp32 (any chunking or
    summation order gives bitwise the same scores, with many ties).
    """
    g = generator(seed) if isinstance(seed, int) else seed
    if seq_first:
        q_shape, k_shape, w_shape = (queries, batch, heads, dim), (num_keys, batch, dim), (queries, batch, heads)
    else:
        q_shape, k_shape, w_shape = (batch, queries, heads, dim), (batch, num_keys, dim), (batch, queries, heads)
    if quantised:
        q = torch.randint(-1, 2, q_shape, generator=g).float()
        k = torch.randint(-1, 2, k_shape, generator=g).float()
        w = torch.randint(-2, 3, w_shape, generator=g) / 4
    else:
        q = torch.randn(q_shape, generator=g)
        k = torch.randn(k_shape, generator=g)
        scale = {None: heads**-0.5, "fan_in": (dim * heads) ** -0.5}.get(w_scale, w_scale)
        w = torch.randn(w_shape, generator=g) * scale
    tensors = (q.bfloat16().to(device), k.bfloat16().to(device), w.to(w_dtype).to(device))
    return tuple(t.requires_grad_(requires_grad) for t in tensors)


# The argument-error tests' sizes: small, every one distinct, so a swapped axis shows.
ERROR_SIZES = (12, 2, 4, 16, 3)  # S, B, H, D, K


def error_v4_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """SBHD seed-API inputs (index_q, index_k, weights) of ERROR_SIZES."""
    s, b, h, d, k = ERROR_SIZES
    return indexer_inputs(b, s, h, d, k, 0, seq_first=True, w_scale=1.0)


def error_v41_inputs(heads: int | None = None, dim: int | None = None):
    """BSHD V4.1 inputs (queries, keys, weights, all bf16) of ERROR_SIZES, heads/dim overridable."""
    s, b, h, d, k = ERROR_SIZES
    return indexer_inputs(b, s, heads or h, dim or d, k, 0, w_dtype=torch.bfloat16, w_scale=1.0)


# ----------------------------------------------------------------------------------------------
# Visibility layouts
# ----------------------------------------------------------------------------------------------


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


# ----------------------------------------------------------------------------------------------
# Oracles written from docs/semantics.md (independent of the library's implementations)
# ----------------------------------------------------------------------------------------------


def dense_visibility(ks: torch.Tensor, ke: torch.Tensor, num_keys: int) -> torch.Tensor:
    """bool [..., S, K]: key j visible iff ks <= j < ke (docs/semantics.md "Visibility")."""
    j = torch.arange(num_keys)
    return (j >= ks[..., None]) & (j < ke[..., None])


def full_visibility(batch: int, queries: int, num_keys: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ks = 0, ke = K: every query sees every key."""
    return torch.zeros(batch, queries, dtype=torch.int32), torch.full((batch, queries), num_keys, dtype=torch.int32)


def random_topk_indices(batch: int, queries: int, count: int, num_keys: int, g: torch.Generator) -> torch.Tensor:
    """Distinct random keys per query, some -1 and some possibly invisible (they carry no gradient)."""
    idx = torch.stack([torch.randperm(num_keys, generator=g)[:count] for _ in range(batch * queries)])
    idx = idx.view(batch, queries, count)
    idx[torch.rand(batch, queries, count, generator=g) < 0.2] = -1
    return idx.to(torch.int32)


def v41_formula(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """docs/semantics.md's V4.1 score on bf16 tensors, unmasked: relu(q . k) * w summed over heads."""
    return torch.einsum("bshd,btd->bsht", q, k).relu().mul(w[..., None]).sum(2)


def skip_without_automodel(error: ImportError) -> None:
    """For a test module whose nemo-automodel import failed: re-raise where nemo-automodel is
    required (``NEMO_DSA_REQUIRE_AUTOMODEL=1``, set by ``.ci/run``: CI installs it through
    scripts/install.sh), else skip the module saying what is missing (a plain ``pip install -e
    .[dev]``, or the GPU machine's bundle, which carries nemo-automodel without torchao)."""
    if os.environ.get("NEMO_DSA_REQUIRE_AUTOMODEL") == "1":
        raise error
    pytest.skip(f"needs nemo-automodel 0.7.0 and its CPU dependencies ({error}); scripts/install.sh installs them",
                allow_module_level=True)


@pytest.fixture
def cpu_automodel(monkeypatch):
    """Patch only nemo-automodel's CUDA-only calls so its model building and ``train_ft`` recipe
    run on CPU: ``from_config`` / ``build_model`` ask ``torch.cuda.current_device()`` (a plain
    number is enough without CUDA), the recipe's ``setup()`` resets CUDA peak-memory stats, and
    ``_build_model`` hands that device to ``apply_model_infrastructure`` to materialise on."""
    from nemo_automodel._transformers import auto_model

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a, **k: None)
    original = auto_model.apply_model_infrastructure

    def on_cpu(*args, **kwargs):
        kwargs["device"] = torch.device("cpu")
        return original(*args, **kwargs)

    monkeypatch.setattr(auto_model, "apply_model_infrastructure", on_cpu)


# -- model configs --


TINY_VOCAB = 61


def tiny_config(**overrides) -> DSAModelConfig:
    """The tiny test model's ``DSAModelConfig``: 4 layers (window-only, ratio-4 indexer, ratio-8
    compressed, ratio-4 indexer), 2 heads of 32, CPU reference kernels; ``overrides`` replace fields."""
    base = dict(
        vocab_size=TINY_VOCAB, hidden_size=32, num_hidden_layers=4, num_attention_heads=2, head_dim=32,
        qk_rope_head_dim=16, q_lora_rank=16, intermediate_size=48, compress_ratios=(0, 4, 8, 4),
        sliding_window=4, index_n_heads=4, index_head_dim=32, index_topk=2, backend="torch",
    )  # fmt: skip
    base.update(overrides)
    return DSAModelConfig(**base)
