"""The fused hyper-connection kernels against their references, forward and backward.

On CPU the kernels run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1), so
these tests check the kernels' own arithmetic; the GPU runs them compiled (``-m gpu`` below).
Inputs are fresh random bf16 streams of ragged token counts and widths, several batches, 2 or 4
streams; gradients are compared with autograd through the references.
"""

from __future__ import annotations

import pytest
import torch

from nemo_dsa.ops.hyper_connections import collapse_streams, expand_streams, resolve_hc_backend, stream_mix
from nemo_dsa.ops.hyper_connections.interface import _kernels
from nemo_dsa.ops.hyper_connections.naive import sinkhorn_reference

pytestmark = pytest.mark.skipif(_kernels() is None, reason="Triton is not installed (scripts/install.sh installs it)")

SHAPES = [(1, 5, 4, 64), (2, 37, 4, 96), (3, 9, 2, 320)]  # batch, tokens, streams, width


def _device():
    return "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(batch, tokens, m, d, seed):
    g = torch.Generator().manual_seed(seed)
    streams = torch.randn(batch, tokens, m, d, generator=g).bfloat16()
    pre = torch.rand(batch, tokens, m, generator=g) + 0.1
    post = 2 * torch.rand(batch, tokens, m, generator=g)
    comb = sinkhorn_reference(torch.randn(batch, tokens, m, m, generator=g), 20, 1e-6)
    out = torch.randn(batch, tokens, d, generator=g).bfloat16()
    fn = torch.randn(m * (m + 2), m * d, generator=g) * 0.02
    dev = _device()
    return [t.to(dev) for t in (streams, pre, post, comb, out, fn)]


def _grads(fn, inputs, seed):
    inputs = [t.detach().clone().requires_grad_(True) for t in inputs]
    out = fn(*inputs)
    g = torch.Generator().manual_seed(seed)
    cotangent = torch.randn(out.shape, generator=g).to(out)
    out.backward(cotangent)
    return out.detach(), [t.grad for t in inputs]


def _fp32_close(actual, expected, rel=2e-6):
    """fp32 sums in another order: every element within ``rel`` of the reference's largest."""
    scale = expected.abs().max().clamp_min(1e-30)
    assert ((actual - expected).abs() <= rel * scale).all(), ((actual - expected).abs().max() / scale).item()


def _bf16_close(actual, expected, ulps=1):
    """Each element within ``ulps`` bf16 steps of the reference (at the reference's magnitude)."""
    step = torch.finfo(torch.bfloat16).eps * expected.float().abs().clamp_min(1e-3)
    assert ((actual.float() - expected.float()).abs() <= ulps * step + 1e-30).all(), (
        (actual.float() - expected.float()).abs().max()
    )


@pytest.mark.parametrize("shape", SHAPES)
def test_mix_matches_reference(shape):
    streams, _, _, _, _, fn = _inputs(*shape, seed=sum(shape))
    ref_out, (ref_ds, ref_dfn) = _grads(lambda s, f: stream_mix(s, f, 1e-6, order="project_first", backend="torch"),
                                        [streams, fn], seed=1)  # fmt: skip
    out, (ds, dfn) = _grads(lambda s, f: stream_mix(s, f, 1e-6, order="project_first", backend="triton"),
                            [streams, fn], seed=1)  # fmt: skip
    _fp32_close(out, ref_out)
    _fp32_close(dfn, ref_dfn)
    _bf16_close(ds, ref_ds, ulps=2)


@pytest.mark.parametrize("shape", SHAPES)
def test_mix_orders_agree(shape):
    streams, *_, fn = _inputs(*shape, seed=3)
    first = stream_mix(streams, fn, 1e-6, order="norm_first", backend="torch")
    second = stream_mix(streams, fn, 1e-6, order="project_first", backend="torch")
    torch.testing.assert_close(first, second, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shape", SHAPES)
def test_collapse_matches_reference(shape):
    streams, pre, *_ = _inputs(*shape, seed=5 + shape[1])
    ref_out, (ref_ds, ref_dpre) = _grads(lambda s, p: collapse_streams(s, p, backend="torch"), [streams, pre], 2)
    out, (ds, dpre) = _grads(lambda s, p: collapse_streams(s, p, backend="triton"), [streams, pre], 2)
    _bf16_close(out, ref_out)
    assert torch.equal(ds, ref_ds)  # one product, one rounding
    _fp32_close(dpre, ref_dpre)


@pytest.mark.parametrize("rounding", ["terms", "once"])
@pytest.mark.parametrize("shape", SHAPES)
def test_expand_matches_reference(shape, rounding):
    streams, _, post, comb, out, _ = _inputs(*shape, seed=7 + shape[2])

    def run(backend):
        return _grads(lambda o, s, p, c: expand_streams(o, s, p, c, rounding=rounding, backend=backend),
                      [out, streams, post, comb], 3)  # fmt: skip

    ref, ref_grads = run("torch")
    new, grads = run("triton")
    _bf16_close(new, ref, ulps=1)
    d_out, d_streams, d_post, d_comb = grads
    r_out, r_streams, r_post, r_comb = ref_grads
    _bf16_close(d_out, r_out, ulps=1)
    _bf16_close(d_streams, r_streams, ulps=1)
    if rounding == "terms":  # summed in fp32, rounded to bf16 (autograd rounds each product too)
        _bf16_close(d_post, r_post, ulps=2)
        _bf16_close(d_comb, r_comb, ulps=2)
    else:
        _fp32_close(d_post, r_post)
        _fp32_close(d_comb, r_comb)


def test_poisoned_outputs_are_overwritten():
    """Every output element is written: the kernels' outputs start as NaN-filled memory."""
    streams, pre, post, comb, out, fn = _inputs(2, 11, 4, 96, seed=11)
    torch.manual_seed(0)
    real_empty = torch.empty

    def poisoned(*args, **kwargs):
        return real_empty(*args, **kwargs).fill_(float("nan"))

    torch.empty, saved = poisoned, torch.empty
    try:
        results = [
            stream_mix(streams, fn, 1e-6, order="project_first", backend="triton"),
            collapse_streams(streams, pre, backend="triton"),
            expand_streams(out, streams, post, comb, rounding="once", backend="triton"),
        ]
    finally:
        torch.empty = saved
    assert all(torch.isfinite(r).all() for r in results)


def test_bad_inputs_are_named():
    streams, pre, post, comb, out, fn = _inputs(1, 4, 4, 64, seed=13)
    with pytest.raises(ValueError, match="pre"):
        collapse_streams(streams, pre[..., :3])
    with pytest.raises(TypeError, match="pre"):
        collapse_streams(streams, pre.double())
    with pytest.raises(ValueError, match="comb"):
        expand_streams(out, streams, post, comb[..., :2], rounding="once")
    with pytest.raises(ValueError, match="rounding"):
        expand_streams(out, streams, post, comb, rounding="bf16")
    with pytest.raises(ValueError, match="fn"):
        stream_mix(streams, fn[:, :-1], 1e-6, order="project_first")
    with pytest.raises(ValueError, match="backend"):
        resolve_hc_backend("cuda", streams)


def test_auto_runs_the_reference_on_cpu():
    streams = torch.zeros(1, 2, 4, 8, dtype=torch.bfloat16)
    assert resolve_hc_backend("auto", streams) == "torch"
