"""What an attention layer keeps for its backward: no copy of q beyond the attention op's own.

The layer's attention runs through the kernels' own autograd Function (which keeps q, the kv rows,
out, lse, ...) with the reference computing in place of the kernels, so the layer's bookkeeping is
counted as it is on the GPU. V4's per-head q RMS used to keep the un-normalised q in fp32 (twice
the size of the bf16 q): at V4-Flash shapes 128 KiB a token a layer.
"""

from __future__ import annotations

import pytest
import torch

from _support.dsa_layer_runs import make_layer, packed_ids, run
from _support.helpers import stable_seed, tiny_config
from nemo_dsa.layers import sparse_attention as layer_module
from nemo_dsa.ops.sparse_attention import kernels
from nemo_dsa.ops.sparse_attention.interface import SparseWindowAttentionFunction
from nemo_dsa.ops.sparse_attention.naive import attend_window_and_compressed


class OperandsAsGiven:
    """Stands in for ``kernels.KernelInputs`` (which pads for the kernels): the operands as given."""

    def __init__(self, q, raw_kv, window_start, window, compressed_kv, indices, ks, ke, sink, scale):
        self.q, self.raw_kv, self.window_start, self.window = q, raw_kv, window_start, window
        self.compressed_kv, self.indices, self.ks, self.ke, self.sink, self.scale = compressed_kv, indices, ks, ke, sink, scale

    def attend(self, q, raw_kv, compressed_kv):
        return attend_window_and_compressed(
            q, raw_kv, self.window_start, self.window, compressed_kv, indices=self.indices, ks=self.ks, ke=self.ke,
            sink=self.sink, scale=self.scale,
        )  # fmt: skip


def reference_forward(inputs):
    with torch.no_grad():
        return inputs.attend(inputs.q, inputs.raw_kv, inputs.compressed_kv)


def reference_backward(inputs, out, lse, grad_out, *, need_dq=True, need_d_raw=True, need_d_comp=True):
    leaves = [None if t is None else t.detach().requires_grad_() for t in (inputs.q, inputs.raw_kv, inputs.compressed_kv)]
    with torch.enable_grad():
        recomputed, _ = inputs.attend(*leaves)
        wanted = [t for t in leaves if t is not None]
        grads = iter(torch.autograd.grad(recomputed, wanted, grad_out, allow_unused=True))
    dq, d_raw, d_comp = (None if t is None else next(grads) for t in leaves)
    delta = (grad_out.float() * out.float()).sum(-1)
    return dq, d_raw, d_comp, delta


def route_attention_through_the_kernel_function(monkeypatch) -> None:
    """The layer's attention through the kernels' own autograd Function (what it keeps is what the
    GPU keeps), with the reference computing in place of the kernels (also used by
    benchmarks/saved_activations.py)."""
    monkeypatch.setattr(kernels, "KernelInputs", OperandsAsGiven)
    monkeypatch.setattr(kernels, "sparse_window_forward", reference_forward)
    monkeypatch.setattr(kernels, "sparse_window_backward", reference_backward)

    def attention(q, raw_kv, window_start, window, compressed_kv=None, *, indices=None, ranges=None, sink=None,
                  scale, backend="auto", dropout_p=0.0):  # fmt: skip
        ks, ke = (None, None) if ranges is None else (ranges.ks, ranges.ke)
        return SparseWindowAttentionFunction.apply(q, raw_kv, window_start, window, compressed_kv, indices, ks, ke, sink, scale)

    monkeypatch.setattr(layer_module, "attend", attention)


@pytest.fixture
def kernel_function_on_cpu(monkeypatch):
    route_attention_through_the_kernel_function(monkeypatch)


def kept_storages(fn):
    """{storage pointer: (bytes, numel, dtype)} of what autograd keeps for the backward of ``fn()``."""
    kept = {}

    def pack(t):
        kept[t.untyped_storage().data_ptr()] = (t.untyped_storage().nbytes(), t.numel(), t.dtype)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result = fn()
    return kept, result


# Window-only, a ratio-4 indexer layer and a ratio-8 layer; 8 heads of 64 over a hidden size of 48,
# so q ([S, 8, 64]) is by far the largest activation and each q-sized tensor kept is visible.
# With V4's grouped output projection (o_lora_rank > 0) ``wo_a`` keeps the op's own out and rotates
# it back again in its backward; a dense ``wo`` keeps the rotated copy.
@pytest.mark.parametrize("o_lora_rank", [0, 16])
@pytest.mark.parametrize("layer_idx", [0, 1, 2])
def test_v4_layer_keeps_q_only_for_the_attention_op(kernel_function_on_cpu, layer_idx, o_lora_rank):
    cfg = tiny_config(hidden_size=48, num_attention_heads=8, head_dim=64, q_lora_rank=24, o_lora_rank=o_lora_rank,
                      o_groups=4)  # fmt: skip
    assert cfg.q_head_rms  # V4's per-head q RMS
    layer = make_layer(cfg, layer_idx, seed=stable_seed(("memory", layer_idx))).to(torch.bfloat16)
    seq = 40
    ids = packed_ids([[17, 23], [40]], seq=seq)
    x = torch.randn(2, seq, cfg.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    kept, (out, _) = kept_storages(lambda: run(layer, x, ids))
    q_numel = 2 * seq * cfg.num_attention_heads * cfg.head_dim
    q_sized = sorted((numel, str(dtype)) for _nbytes, numel, dtype in kept.values() if numel >= q_numel)
    # The op's q and out (and a dense wo's rotated input): bf16 tensors of q's size.
    assert q_sized == [(q_numel, "torch.bfloat16")] * (2 if o_lora_rank else 3), q_sized
    out.float().square().sum().backward()  # and the backward runs on what was kept
    assert x.grad is not None and torch.isfinite(x.grad).all()


@pytest.mark.parametrize("layer_idx", [0, 1, 2])
def test_recomputed_queries_give_the_gradients_of_kept_ones(monkeypatch, layer_idx):
    """The recompute of ``wq_b``, the per-head RMS and RoPE changes what is kept, never a gradient bit."""
    cfg = tiny_config(hidden_size=48, num_attention_heads=8, head_dim=64, q_lora_rank=24)
    seq = 40
    ids = packed_ids([[17, 23], [40]], seq=seq)
    x = torch.randn(2, seq, cfg.hidden_size, generator=torch.Generator().manual_seed(layer_idx))

    def gradients():
        layer = make_layer(cfg, layer_idx, seed=stable_seed(("recompute", layer_idx)))
        inputs = x.clone().requires_grad_()
        out, _ = run(layer, inputs, ids)
        out.square().sum().backward()
        return [inputs.grad] + [p.grad for p in layer.parameters() if p.grad is not None]

    recomputed = gradients()
    monkeypatch.setattr(layer_module.DSASparseAttention, "_queries",
                        lambda self, latent, angles: self._normalized_queries(latent, angles))  # fmt: skip
    kept = gradients()
    assert len(recomputed) == len(kept) > 3
    for got, expected in zip(recomputed, kept):
        assert torch.equal(got, expected)
