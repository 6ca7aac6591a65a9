"""Every bad argument raises a clear error that names it."""

from __future__ import annotations

import pytest
import torch

from nemo_dsa.ops.mxfp4 import mxfp4_quant_dequant
from nemo_dsa.ops.topk import candidate_blocks, pytorch_extract_topk_scores, select_topk_reference
from nemo_dsa.ops.v4_indexer import v4_backward, v4_lighting_indexer, v4_logits
from nemo_dsa.ops.v41_indexer import indexer_scores, v41_scores

S, B, H, D, K = 12, 2, 4, 16, 3


def _v4():
    return torch.randn(S, B, H, D).bfloat16(), torch.randn(K, B, D).bfloat16(), torch.randn(S, B, H)


def _ks_ke():
    return torch.zeros(B, S, dtype=torch.int32), torch.full((B, S), K, dtype=torch.int32)


def _replace(args, **changes):
    out = dict(zip(("index_q", "index_k", "weights"), args))
    out.update(changes)
    return out


V4_CASES = [
    (TypeError, "index_q", dict(index_q=[1.0])),
    (ValueError, "index_q", dict(index_q=torch.randn(S, B, H * D).bfloat16())),
    (TypeError, "index_q", dict(index_q=torch.randn(S, B, H, D))),
    (ValueError, "index_q", dict(index_q=torch.randn(S, B, H, 24).bfloat16(), index_k=torch.randn(K, B, 24).bfloat16())),
    (TypeError, "index_k", dict(index_k=torch.randn(K, B, D))),
    (ValueError, "index_k", dict(index_k=torch.randn(K, B + 1, D).bfloat16())),
    (ValueError, "index_k", dict(index_k=torch.randn(K, B, D + 16).bfloat16())),
    (ValueError, "index_k", dict(index_k=torch.empty(K, B, D, dtype=torch.bfloat16, device="meta"))),
    (TypeError, "weights", dict(weights=torch.randn(S, B, H).bfloat16())),
    (ValueError, "weights", dict(weights=torch.randn(S, B, H + 1))),
]


@pytest.mark.parametrize("error,name,change", V4_CASES)
def test_v4_tensor_arguments(error, name, change):
    with pytest.raises(error, match=name):
        v4_lighting_indexer(**_replace(_v4(), **change), compress_ratio=4, topk=2)


@pytest.mark.parametrize(
    "error,name,kwargs",
    [
        (ValueError, "compress_ratio", dict(compress_ratio=0)),
        (TypeError, "compress_ratio", dict(compress_ratio=4.0)),
        (ValueError, "topk", dict(topk=0)),
        (TypeError, "topk", dict(topk=True)),
        (TypeError, "fused_topk", dict(fused_topk="yes")),
    ],
)
def test_v4_scalar_arguments(error, name, kwargs):
    with pytest.raises(error, match=name):
        v4_lighting_indexer(*_v4(), **{"compress_ratio": 4, "topk": 2, **kwargs})


def _bad_ks_ke():
    ks, ke = _ks_ke()
    neg = ks.clone()
    neg[1, 3] = -1
    big = ke.clone()
    big[0, 0] = K + 1
    inverted_ks = ks.clone()
    inverted_ks[0, 5] = 2
    inverted_ke = ke.clone()
    inverted_ke[0, 5] = 1
    return [
        (ValueError, "ke is missing", dict(ks=ks)),
        (ValueError, "ks is missing", dict(ke=ke)),
        (TypeError, "ks", dict(ks=ks.long(), ke=ke)),
        (TypeError, "ke", dict(ks=ks, ke=ke.float())),
        (ValueError, "ks", dict(ks=ks[:, :-1], ke=ke)),
        (ValueError, "ke", dict(ks=ks, ke=ke.T.contiguous())),
        (ValueError, "ks must be >= 0", dict(ks=neg, ke=ke)),
        (ValueError, "ke must be <=", dict(ks=ks, ke=big)),
        (ValueError, "ke must be >= ks", dict(ks=inverted_ks, ke=inverted_ke)),
    ]


@pytest.mark.parametrize("error,match,kwargs", _bad_ks_ke())
def test_ks_ke_everywhere(error, match, kwargs):
    with pytest.raises(error, match=match):
        v4_lighting_indexer(*_v4(), 4, 2, **kwargs)
    q, k, w = (x.transpose(0, 1) for x in _v4())
    w_bf16 = w.bfloat16()
    full = {"ks": None, "ke": None, **kwargs}
    with pytest.raises(error, match=match):
        indexer_scores(q.contiguous(), k.contiguous(), w_bf16, **full)
    if full["ks"] is not None and full["ke"] is not None:
        for fn in (v4_logits, v41_scores):
            with pytest.raises(error, match=match):
                fn(q, k, w if fn is v4_logits else w_bf16, full["ks"], full["ke"])
        with pytest.raises(error, match=match):
            candidate_blocks(torch.randn(B, S, K), full["ks"], full["ke"], 2, 2)


@pytest.mark.parametrize(
    "error,match,indices",
    [
        (TypeError, "topk_indices", torch.zeros(B, S, 2, dtype=torch.int64)),
        (ValueError, "topk_indices", torch.zeros(B, S, 3, dtype=torch.int32)),
        (ValueError, "topk_indices", torch.zeros(B, S, dtype=torch.int32)),
        (ValueError, "topk_indices must lie", torch.full((B, S, 2), K, dtype=torch.int32)),
        (ValueError, "topk_indices must lie", torch.full((B, S, 2), -2, dtype=torch.int32)),
    ],
)
def test_v4_given_topk_indices(error, match, indices):
    with pytest.raises(error, match=match):
        v4_lighting_indexer(*_v4(), 4, 2, indices)


def _v41(heads=H, dim=D):
    return torch.randn(B, S, heads, dim).bfloat16(), torch.randn(B, K, dim).bfloat16(), torch.randn(B, S, heads).bfloat16()


@pytest.mark.parametrize(
    "error,match,args",
    [
        (TypeError, "queries", (torch.randn(B, S, H, D), *_v41()[1:])),
        (ValueError, "queries", (torch.randn(B, S, D).bfloat16(), *_v41()[1:])),
        (ValueError, "keys", (_v41()[0], torch.randn(B + 1, K, D).bfloat16(), _v41()[2])),
        (TypeError, "keys", (_v41()[0], torch.randn(B, K, D), _v41()[2])),
        (ValueError, "keys must be on", (_v41()[0], torch.empty(B, K, D, dtype=torch.bfloat16, device="meta"), _v41()[2])),
        (TypeError, "weights", (*_v41()[:2], torch.randn(B, S, H))),
        (ValueError, "weights", (*_v41()[:2], torch.randn(B, S, H * 2).bfloat16())),
        (ValueError, "queries must have a power-of-two number of heads", _v41(heads=3)),
        (ValueError, "queries must have a power-of-two number of heads", _v41(heads=256)),
        (ValueError, "queries must have an index dim divisible by 16", _v41(dim=40)),
    ],
)
def test_v41_tensor_arguments(error, match, args):
    ks, ke = _ks_ke()
    with pytest.raises(error, match=match):
        indexer_scores(*args, ks=ks, ke=ke)


def test_v41_visibility_forms():
    args = _v41()
    ks, ke = _ks_ke()
    allowed = torch.ones(B, S, K, dtype=torch.bool)
    with pytest.raises(ValueError, match="allowed"):
        indexer_scores(*args)
    with pytest.raises(ValueError, match="allowed"):
        indexer_scores(*args, allowed, ks=ks, ke=ke)
    with pytest.raises(TypeError, match="allowed"):
        indexer_scores(*args, allowed.to(torch.uint8))
    with pytest.raises(ValueError, match="allowed"):
        indexer_scores(*args, allowed[..., :-1])


def test_extract_topk_scores_arguments():
    logits = torch.randn(2, 3, 5)
    with pytest.raises(ValueError, match="topk_indices must lie"):
        pytorch_extract_topk_scores(logits, torch.full((2, 3, 1), 5))
    with pytest.raises(ValueError, match="topk_indices must lie"):
        pytorch_extract_topk_scores(logits, torch.full((2, 3, 1), -2))
    with pytest.raises(TypeError, match="topk_indices"):
        pytorch_extract_topk_scores(logits, torch.zeros(2, 3, 1))
    with pytest.raises(ValueError, match="topk_indices"):
        pytorch_extract_topk_scores(logits, torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="topk_indices"):
        pytorch_extract_topk_scores(logits, torch.zeros(2, 4, 1, dtype=torch.long))
    with pytest.raises(TypeError, match="logits"):
        pytorch_extract_topk_scores(logits.tolist(), torch.zeros(2, 3, 1, dtype=torch.long))


def test_selection_and_block_arguments():
    scores = torch.randn(B, S, K)
    ks, ke = _ks_ke()
    with pytest.raises(ValueError, match="topk"):
        select_topk_reference(scores, 0)
    with pytest.raises(ValueError, match="order"):
        select_topk_reference(scores, 2, order="random")
    with pytest.raises(TypeError, match="scores"):
        select_topk_reference(scores.long(), 2)
    with pytest.raises(TypeError, match="scores"):
        select_topk_reference(scores.double(), 2)
    with pytest.raises(ValueError, match="block_size"):
        candidate_blocks(scores, ks, ke, 0, 2)
    with pytest.raises(ValueError, match="topk_blocks"):
        candidate_blocks(scores, ks, ke, 2, 0)
    with pytest.raises(ValueError, match="scores"):
        candidate_blocks(scores[0], ks, ke, 2, 2)


def test_reference_arguments():
    q, k, w = (x.transpose(0, 1) for x in _v4())
    ks, ke = _ks_ke()
    with pytest.raises(ValueError, match="k must"):
        v4_logits(q, k[..., :8], w, ks, ke)
    with pytest.raises(ValueError, match="w must"):
        v4_logits(q, k, w[..., :2], ks, ke)
    with pytest.raises(TypeError, match="w must"):
        v41_scores(q, k, w, ks, ke)
    idx = torch.zeros(B, S, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="grad_scores"):
        v4_backward(q, k, w, ks, ke, idx, torch.zeros(B, S, 3))
    with pytest.raises(ValueError, match="topk_indices must lie"):
        v4_backward(q, k, w, ks, ke, idx + K, torch.zeros(B, S, 2))


def test_mxfp4_arguments():
    with pytest.raises(ValueError, match="x must have a last dimension"):
        mxfp4_quant_dequant(torch.randn(4, 48))
    with pytest.raises(TypeError, match="x must"):
        mxfp4_quant_dequant(torch.ones(4, 32, dtype=torch.int32))


def test_fused_topk_defaults_to_streaming_only_with_the_kernels():
    from nemo_dsa.models.dsa_lm.configuration import DSAModelConfig
    from nemo_dsa.ops.dispatch import resolve_fused_topk

    assert resolve_fused_topk(None, "tilelang") and not resolve_fused_topk(None, "torch")
    assert resolve_fused_topk(True, "torch") and not resolve_fused_topk(False, "tilelang")
    with pytest.raises(TypeError, match="fused_topk"):
        resolve_fused_topk(1, "torch")
    assert DSAModelConfig().fused_topk is None
    with pytest.raises(TypeError, match="fused_topk"):
        DSAModelConfig(fused_topk="true")
