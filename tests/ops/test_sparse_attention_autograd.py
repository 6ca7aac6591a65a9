"""The bookkeeping of SparseWindowAttentionFunction (the TileLang path's autograd), on CPU.

The GPU tests check the kernels' numbers; these check what the Function itself does around them:
every tensor backward needs is saved through ``save_for_backward`` (so activation checkpointing
and saved-tensor hooks see it, and nothing stays alive on ``ctx``), backward rebuilds the padded
operands, and the gradients are routed to the right inputs. The two kernel launchers are replaced
by the reference on the unpadded operands, which is all they promise to compute.
"""

import pytest
import torch

from _support.helpers import generator
from nemo_dsa.ops.sparse_attention import SparseWindowAttentionFunction, kernels, window_compressed_attention_reference


def _reference_on(inputs, leaves):
    heads, dim = inputs.heads, inputs.dim
    q, raw, comp, sink = leaves
    kw = {"indices": inputs.selector} if inputs.mode == "indices" else {"ks": inputs.selector, "ke": inputs.end}
    return window_compressed_attention_reference(
        q, raw, inputs.window_start, int(inputs.window), comp, sink=sink, scale=float(inputs.params[0]), **kw
    )


def _leaves(inputs, grad):
    heads, dim = inputs.heads, inputs.dim
    tensors = (
        inputs.q[:, :, :heads, :dim], inputs.raw[..., :dim], inputs.comp[..., :dim],
        inputs.sink[:heads] if inputs.has_sink else None,
    )  # fmt: skip
    return [None if t is None else t.detach().clone().requires_grad_(grad) for t in tensors]


def fake_forward(inputs, *, out=None, lse=None):
    with torch.no_grad():
        return _reference_on(inputs, _leaves(inputs, False))


BACKWARD_CALLS = []


def fake_backward(inputs, out, lse, grad_out, *, dq=None, need_dq=True, need_d_raw=True, need_d_comp=True):
    BACKWARD_CALLS.append((need_dq, need_d_raw, need_d_comp))
    leaves = _leaves(inputs, True)
    with torch.enable_grad():
        ref_out, _ = _reference_on(inputs, leaves)
        dq, d_raw, d_comp = torch.autograd.grad(ref_out, leaves[:3], grad_out, allow_unused=True)
    delta = (grad_out.float() * out.float()).sum(-1)
    d_comp = torch.zeros_like(leaves[2]) if d_comp is None else d_comp
    return dq if need_dq else None, d_raw if need_d_raw else None, d_comp if need_d_comp else None, delta


def test_function_saves_through_save_for_backward_and_routes_gradients(monkeypatch):
    monkeypatch.setattr(kernels, "sparse_window_forward", fake_forward)
    monkeypatch.setattr(kernels, "sparse_window_backward", fake_backward)
    gen = generator(7)
    batch, seq, history, heads, dim, num_comp = 2, 21, 5, 3, 32, 9
    q = torch.randn(batch, seq, heads, dim, generator=gen)
    raw = torch.randn(batch, seq + history, dim, generator=gen)
    comp = torch.randn(batch, num_comp, dim, generator=gen)
    sink = torch.randn(heads, generator=gen)
    window_start = torch.randint(0, seq + history, (batch, seq), generator=gen, dtype=torch.int32)
    indices = torch.randint(-1, num_comp, (batch, seq, 4), generator=gen, dtype=torch.int32)
    grad = torch.randn(batch, seq, heads, dim, generator=gen)

    leaves = [t.clone().requires_grad_(True) for t in (q, raw, comp, sink)]
    packed = []

    def pack(t):
        packed.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out, lse = SparseWindowAttentionFunction.apply(
            leaves[0], leaves[1], window_start, 4, leaves[2], indices, None, None, leaves[3], 0.3
        )
    assert any(t is leaves[0] for t in packed) and any(t is indices for t in packed)
    out.backward(grad)

    expected = [t.clone().requires_grad_(True) for t in (q, raw, comp, sink)]
    ref_out, ref_lse = window_compressed_attention_reference(
        expected[0], expected[1], window_start, 4, expected[2], indices=indices, sink=expected[3], scale=0.3
    )
    ref_out.backward(grad)
    assert torch.equal(out, ref_out.detach()) and torch.equal(lse, ref_lse.detach())
    for got, want, name in zip(leaves, expected, ("q", "raw_kv", "compressed_kv", "sink")):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize(
    "wanted",
    [("q",), ("raw_kv",), ("q", "raw_kv"), ("q", "raw_kv", "sink"), ("compressed_kv",), ("sink",), ("q", "compressed_kv", "sink")],
)
def test_backward_computes_only_the_gradients_inputs_need(monkeypatch, wanted):
    """ctx.needs_input_grad decides what the kernel is asked for (frozen compressed kv, frozen q,
    sink only: no kernel gradient at all); the wanted gradients still match the reference."""
    monkeypatch.setattr(kernels, "sparse_window_forward", fake_forward)
    monkeypatch.setattr(kernels, "sparse_window_backward", fake_backward)
    BACKWARD_CALLS.clear()
    gen = generator(11)
    batch, seq, history, heads, dim, num_comp = 1, 13, 3, 2, 16, 7
    names = ("q", "raw_kv", "compressed_kv", "sink")
    values = (
        torch.randn(batch, seq, heads, dim, generator=gen), torch.randn(batch, seq + history, dim, generator=gen),
        torch.randn(batch, num_comp, dim, generator=gen), torch.randn(heads, generator=gen),
    )  # fmt: skip
    window_start = torch.zeros(batch, seq, dtype=torch.int32)
    indices = torch.randint(-1, num_comp, (batch, seq, 3), generator=gen, dtype=torch.int32)
    grad = torch.randn(batch, seq, heads, dim, generator=gen)

    leaves = [v.clone().requires_grad_(n in wanted) for n, v in zip(names, values)]
    out, _ = SparseWindowAttentionFunction.apply(
        leaves[0], leaves[1], window_start, 5, leaves[2], indices, None, None, leaves[3], 0.25
    )
    out.backward(grad)
    assert BACKWARD_CALLS == [("q" in wanted, "raw_kv" in wanted, "compressed_kv" in wanted)]

    expected = [v.clone().requires_grad_(True) for v in values]
    ref_out, _ = window_compressed_attention_reference(
        expected[0], expected[1], window_start, 5, expected[2], indices=indices, sink=expected[3], scale=0.25
    )
    ref_out.backward(grad)
    for got, want, name in zip(leaves, expected, names):
        if name in wanted:
            torch.testing.assert_close(got.grad, want.grad, rtol=1e-5, atol=1e-6, msg=name)
        else:
            assert got.grad is None, name
