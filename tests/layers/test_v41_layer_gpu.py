"""The DeepSeek-V4.1 attention layer on CUDA: TileLang kernels against the torch references (bf16).

One V4.1 stack (``scoring="v41"``: ratios 0 / 2 / 2 / 2 / 1 / 1 / 1, source / reuse / reindex on
ratio 2, source (the candidate source) / reindex (masked by its candidate blocks) / reuse on
ratio 1, fp8 window KV, NVFP4 compressed KV, latent index keys, the frozen MXFP4 indexer with 32
heads of 128) is built twice with the same weights: ``backend="tilelang"`` (the V4.1 scorer, the
streamed selection with the radix select, the sparse-attention forward and backward kernels) and
``backend="torch"`` (the references: the torch score formula, the reference top-k and the
reference attention); the TileLang stack runs with the default selectors (the window below the
row maximum, candidate blocks applied inside the select) and with the generic ones. Every layer
runs on a fresh random input with its own backend's shared state, on packed rows of ragged
lengths (B = 1 and B = 2, documents starting anywhere, padding).

Bounds (bf16): the two paths differ by bf16 rounding inside the attention (the kernels' fp32
accumulation order, bf16 probabilities) and by the index scores' fp32 head-sum order (one bf16
ulp at a few scores). Outputs within 2e-2 and the input's and every trained parameter's gradient
within 3e-2 relative (Frobenius norms); selections equal for every real query except exact ties:
where the two sets differ, every key in one and not the other must score, in the reference
scores of that layer (masked by the candidate blocks on the reindex layer), the same as the
T-th best, or within one bf16 ulp of it where the scorers' head-sum order moved it (the kernel's
own scores are checked against the formula in tests/ops/test_v41_kernels_gpu.py); at most 1 % of the
queries may differ. The indexer is frozen in both: no gradient.
"""

from __future__ import annotations

import pytest
import torch

from nemo_dsa.layers import DSASparseAttention
from nemo_dsa.layers.context import LocalContext
from nemo_dsa.layers.shared_state import SharedLayerState
from nemo_dsa.metadata import build_attention_metadata
from nemo_dsa.models.dsa_lm.configuration import DSAModelConfig

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU for the TileLang kernels"),
]

DEVICE = "cuda"
RATIOS = (0, 2, 2, 2, 1, 1, 1)
ROLES = ["window", "source", "reuse", "reindex", "source", "reindex", "reuse"]
TOPK = 64
BLOCK_SIZE, TOPK_BLOCKS = 8, 12  # 96 candidate keys kept per query for the reindex layer after 4
HIDDEN = 256


def v41_config(backend: str, **overrides) -> DSAModelConfig:
    return DSAModelConfig(
        vocab_size=64, hidden_size=HIDDEN, num_hidden_layers=len(RATIOS), num_attention_heads=16, head_dim=128,
        qk_rope_head_dim=64, q_lora_rank=128, o_lora_rank=64, o_groups=2, compress_ratios=RATIOS,
        sliding_window=128, scoring="v41", index_n_heads=32, index_head_dim=128, index_topk=TOPK,
        indexer_ratios=(1, 2), kv_source_layer_ids=(1, 4), index_source_layer_ids=(1, 3, 4, 5),
        candidate_source_layer_id=4, candidate_block_size=BLOCK_SIZE, candidate_topk_blocks=TOPK_BLOCKS,
        q_head_rms=False, compressor_overlap=False, compressor_ape=False, index_keys="latent",
        window_kv_quant="fp8", compressed_kv_quant="nvfp4", backend=backend, **overrides,
    )  # fmt: skip


def stacks():
    """The torch-reference and the TileLang stacks, the same random bf16 weights."""
    reference, fast = [], []
    for layer_idx in range(len(RATIOS)):
        torch.manual_seed(100 + layer_idx)
        layer = DSASparseAttention(v41_config("torch"), layer_idx)
        with torch.no_grad():
            for name, p in layer.named_parameters():
                if name.endswith("norm.weight"):
                    p.copy_(1 + 0.1 * torch.randn_like(p))
                else:
                    p.normal_(0.0, 0.5 if p.ndim == 1 else 0.1)
        twin = DSASparseAttention(v41_config("tilelang"), layer_idx)
        twin.load_state_dict(layer.state_dict())
        reference.append(layer.to(DEVICE, torch.bfloat16))
        fast.append(twin.to(DEVICE, torch.bfloat16))
    return reference, fast


def packed_ids(docs: list[list[int]], seq: int) -> torch.Tensor:
    """1-based document ids per token, 0 = padding after each row's documents."""
    rows = []
    for row in docs:
        ids = [d + 1 for d, n in enumerate(row) for _ in range(n)]
        rows.append(ids + [0] * (seq - len(ids)))
    return torch.tensor(rows, device=DEVICE)


def run_stack(layers, inputs, grads, metas, records):
    """Each layer on its own input, then one backward of ``sum(out_l * grad_l)`` (reindex and reuse
    layers attend to their source's compressed KV, so its gradient collects from all of them).
    Returns outputs, input gradients, parameter gradients, selections."""
    shared, outs, xs, picked = SharedLayerState(), [], [], []
    loss = 0.0
    for layer, x, g in zip(layers, inputs, grads):
        xi = x.clone().requires_grad_(True)
        records.clear()
        out, aux = layer(xi, metas[max(layer.ratio, 1)], LocalContext(), shared)
        assert aux is None
        loss = loss + (out.float() * g.float()).sum()
        outs.append(out.detach().float())
        xs.append(xi)
        source = shared.source if layer.ratio else None
        picked.append(None if source is None else (source.selection.topk_indices, source.candidate_blocks, list(records)))
    loss.backward()
    params = {
        f"{layer.layer_idx}.{n}": p.grad.float() for layer in layers for n, p in layer.named_parameters() if p.grad is not None
    }
    return outs, [xi.grad.float() for xi in xs], params, picked


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def reference_scores(call) -> torch.Tensor:
    """The torch formula's scores [B, S, K] for one recorded selection call, masked to the kept
    candidate blocks on a reindex layer."""
    from nemo_dsa.ops.v41_indexer import blocks_to_mask
    from nemo_dsa.ops.v41_indexer.naive import v41_scores

    q, k, w, ks, ke, kwargs = call
    scores = v41_scores(q, k, w, ks, ke)
    if kwargs.get("candidate_blocks") is not None:
        keep = blocks_to_mask(kwargs["candidate_blocks"], ks, ke, kwargs["candidate_block_size"], k.shape[1])
        scores = scores.masked_fill(~keep, float("-inf"))
    return scores


def one_ulp(x: torch.Tensor) -> torch.Tensor:
    """The bf16 spacing at |x| (fp32)."""
    x = x.float().abs().clamp_min(2.0**-126)
    return torch.exp2(torch.floor(torch.log2(x)) - 7)


def differing_queries_are_ties(mine, theirs, scores, real) -> tuple[int, int]:
    """``(real queries, queries whose sets differ)``; each difference must be a tie at the cut."""
    differ = 0
    for b, i in real.nonzero().tolist():
        a = {int(j) for j in mine[b, i] if j >= 0}
        c = {int(j) for j in theirs[b, i] if j >= 0}
        if a == c:
            continue
        differ += 1
        row = scores[b, i].float()
        finite = row[torch.isfinite(row)].sort(descending=True).values
        kth = finite[min(TOPK, finite.numel()) - 1]
        for j in a ^ c:
            assert (row[j] - kth).abs() <= one_ulp(kth), (b, i, j, float(row[j]), float(kth))
    return int(real.sum()), differ


@pytest.mark.parametrize(
    "docs,seq",
    [([[300, 211]], 511), ([[97, 5, 400], [512]], 512), ([[61, 640]], 733)],
    ids=["b1-two-docs", "b2-ragged-padded", "b1-odd-padded"],
)
def test_v41_layer_kernels_match_reference(docs, seq, monkeypatch):
    from nemo_dsa.ops.fused_selection import interface as fused_selection

    records = []
    real_select = fused_selection.v41_select_topk_in_ranges

    def recording_select(q, k, w, ranges, topk, backend, **kwargs):
        records.append((q.clone(), k.clone(), w.clone(), ranges.ks.clone(), ranges.ke.clone(), dict(kwargs)))
        return real_select(q, k, w, ranges, topk, backend, **kwargs)

    monkeypatch.setattr(fused_selection, "v41_select_topk_in_ranges", recording_select)
    reference, fast = stacks()
    assert [layer.role for layer in fast] == ROLES
    ids = packed_ids(docs, seq)
    metas = {r: build_attention_metadata(compress_ratio=r, packed_seq_ids=ids) for r in (1, 2)}
    gen = torch.Generator(device=DEVICE).manual_seed(seq)
    inputs = [torch.randn(len(docs), seq, HIDDEN, device=DEVICE, generator=gen).bfloat16() for _ in RATIOS]
    grads = [torch.randn(len(docs), seq, HIDDEN, device=DEVICE, generator=gen).bfloat16() for _ in RATIOS]
    ref_out, ref_dx, ref_params, ref_picked = run_stack(reference, inputs, grads, metas, [])
    out, dx, params, picked = run_stack(fast, inputs, grads, metas, records)

    real = ids > 0
    for layer_idx, role in enumerate(ROLES):
        assert torch.isfinite(out[layer_idx]).all(), layer_idx
        assert not out[layer_idx][~real].any(), f"layer {layer_idx}: padded queries must be zeroed"
        assert rel(out[layer_idx], ref_out[layer_idx]) < 2e-2, (layer_idx, rel(out[layer_idx], ref_out[layer_idx]))
        assert rel(dx[layer_idx], ref_dx[layer_idx]) < 3e-2, (layer_idx, rel(dx[layer_idx], ref_dx[layer_idx]))
    assert params.keys() == ref_params.keys()
    assert not [name for name in params if ".indexer." in name], "the V4.1 indexer is frozen"
    for name, grad in params.items():
        assert rel(grad, ref_params[name]) < 3e-2, (name, rel(grad, ref_params[name]))

    summary = []
    for layer_idx, role in enumerate(ROLES):
        if role not in ("source", "reindex"):
            continue
        (mine, blocks, calls), (theirs, ref_blocks, _) = picked[layer_idx], ref_picked[layer_idx]
        assert len(calls) == 1, f"layer {layer_idx}: the TileLang layer streams its selection"
        if layer_idx == 4:  # the candidate source: its blocks from its own scores
            assert calls[0][5].get("candidate_topk_blocks") == TOPK_BLOCKS
        if layer_idx == 5:  # the reindex layer masks with layer 4's blocks
            assert calls[0][5].get("candidate_blocks") is not None
        scores = reference_scores(calls[0])
        queries, differ = differing_queries_are_ties(mine, theirs, scores, real)
        assert differ <= 0.01 * queries, (layer_idx, differ, queries)
        summary.append((layer_idx, differ))
        if blocks is not None:  # block scores are maxima of the same scores: equal but at the same rare ties
            same = (blocks == ref_blocks).all(-1)[real]
            assert same.float().mean() >= 0.99, (layer_idx, int((~same).sum()))
    print(docs, "differing selections (layer, queries):", summary)
    for layer_idx, role in enumerate(ROLES):  # reuse layers attend at the selection before them
        if role == "reuse":
            assert torch.equal(picked[layer_idx][0], picked[layer_idx - 1][0])
