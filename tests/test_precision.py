"""Precision control (nemo_dsa.precision): IEEE fp32 matmuls, the caller's TF32 setting restored."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.parametrize("new_api_first", [True, False])
def test_ieee_fp32_matmul_restores_tf32_setting(monkeypatch, new_api_first):
    """The V4 reference turns TF32 off around its matmuls whichever torch API enabled it."""
    from nemo_dsa.precision import ieee_fp32_matmul

    matmul = torch.backends.cuda.matmul
    before = matmul.fp32_precision
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    try:
        if new_api_first:
            matmul.fp32_precision = "tf32"
        else:
            matmul.allow_tf32 = True
        with ieee_fp32_matmul():
            assert matmul.fp32_precision == "ieee"
        assert matmul.fp32_precision == "tf32"
    finally:
        matmul.fp32_precision = before
