"""Backend dispatch (nemo_dsa.ops.dispatch): the backend seam and the fused_topk default."""

from __future__ import annotations

import pytest
import torch

from _support.helpers import indexer_inputs
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


class _OnCuda:
    """Stands for a CUDA tensor to the dispatch rule, which reads only ``is_cuda``."""

    is_cuda = True


def test_auto_runs_the_reference_for_shapes_the_kernels_refuse(caplog):
    import logging

    from nemo_dsa.ops.dispatch import resolve_backend
    from nemo_dsa.ops.v4_indexer.kernels import kernel_refusal as v4_refusal
    from nemo_dsa.ops.v41_indexer import kernel_refusal as v41_refusal

    assert v41_refusal(64, 128) is None and v4_refusal(12, 24 + 8) is None
    assert "power of two" in v41_refusal(12, 128) and "multiple of 16" in v41_refusal(8, 40)
    assert "multiple of 16" in v4_refusal(8, 24) and "1 to 128" in v4_refusal(129, 64)
    cuda = _OnCuda()
    assert resolve_backend("auto", cuda, kernel_refusal=None) == "tilelang"
    reason = v41_refusal(6, 128)
    with caplog.at_level(logging.WARNING, logger="nemo_dsa"):
        assert resolve_backend("auto", cuda, kernel_refusal=reason) == "torch"
        assert resolve_backend("auto", cuda, kernel_refusal=reason) == "torch"
    assert caplog.text.count(reason) == 1  # said once
    with pytest.raises(ValueError, match="backend='tilelang': the V4.1 indexer kernels take a power of two"):
        resolve_backend("tilelang", cuda, kernel_refusal=reason)
    assert resolve_backend("auto", torch.zeros(1), kernel_refusal=reason) == "torch"  # CPU: no message needed


def test_explicit_tilelang_with_a_refused_index_shape_is_a_config_error():
    from nemo_dsa.models.dsa_lm.configuration import DSAModelConfig

    assert DSAModelConfig(scoring="v41", index_n_heads=6, index_head_dim=48).index_n_heads == 6  # auto: runs
    assert DSAModelConfig(index_head_dim=24).index_head_dim == 24
    with pytest.raises(ValueError, match="backend='tilelang'.*index heads, got 6"):
        DSAModelConfig(scoring="v41", index_n_heads=6, backend="tilelang")
    with pytest.raises(ValueError, match="backend='tilelang'.*multiple of 16.*got 24"):
        DSAModelConfig(index_head_dim=24, backend="tilelang")


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
