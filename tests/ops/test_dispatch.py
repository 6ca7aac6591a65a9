"""Backend dispatch (nemo_dsa.ops.dispatch): the backend seam and the fused_topk default."""

from __future__ import annotations

import pytest
import torch

from helpers import indexer_inputs
from nemo_dsa.ops.v41_indexer import indexer_scores
from nemo_dsa.ops.v4_indexer import v4_lighting_indexer

def test_backend_seam_on_cpu():
    q, key, w = indexer_inputs(1, 8, 2, 16, 2, 9, seq_first=True)
    with pytest.raises(ValueError, match="backend"):
        v4_lighting_indexer(q, key, w, 4, 2, backend="tilelang")
    with pytest.raises(ValueError, match="backend"):
        v4_lighting_indexer(q, key, w, 4, 2, backend="cuda")
    q1, k1, w1 = indexer_inputs(1, 8, 2, 16, 2, 9, w_scale=0.1, w_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="backend"):
        indexer_scores(q1, k1, w1, torch.ones(1, 8, 2, dtype=torch.bool), backend="tilelang")


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
