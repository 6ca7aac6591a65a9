"""What an attention layer keeps for its backward: no copy of q beyond the attention op's own.

The stand-in op below keeps exactly what the kernels' autograd Function keeps (q, the kv rows,
out, lse, ...) and differentiates the reference, so the layer's bookkeeping is counted as it is on
the GPU. V4's per-head q RMS used to keep the un-normalised q in fp32 (twice the size of the bf16
q): at V4-Flash shapes 128 KiB a token a layer.
"""

from __future__ import annotations

import pytest
import torch

from helpers import stable_seed, tiny_config
from nemo_dsa.layers import sparse_attention as layer_module
from nemo_dsa.ops.sparse_attention.naive import window_compressed_attention_reference
from test_layers import make_layer, packed_ids, run


class KeepsWhatTheKernelsKeep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, raw_kv, window_start, window, compressed_kv, indices, ks, ke, sink, scale):
        with torch.no_grad():
            out, lse = window_compressed_attention_reference(
                q, raw_kv, window_start, window, compressed_kv, indices=indices, ks=ks, ke=ke, sink=sink,
                scale=scale, check_indices=False,
            )  # fmt: skip
        ctx.save_for_backward(q, raw_kv, window_start, compressed_kv, indices, ks, ke, sink, out, lse)
        ctx.window, ctx.scale = window, scale
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, _grad_lse):
        q, raw_kv, window_start, compressed_kv, indices, ks, ke, sink, _out, _lse = ctx.saved_tensors
        leaves = [t.detach().requires_grad_(t.is_floating_point()) if t is not None else None
                  for t in (q, raw_kv, compressed_kv, sink)]  # fmt: skip
        with torch.enable_grad():
            out, _ = window_compressed_attention_reference(
                leaves[0], leaves[1], window_start, ctx.window, leaves[2], indices=indices, ks=ks, ke=ke,
                sink=leaves[3], scale=ctx.scale, check_indices=False,
            )  # fmt: skip
            wanted = [t for t in leaves if t is not None]
            grads = iter(torch.autograd.grad(out, wanted, grad_out, allow_unused=True))
        dq, d_raw, d_comp, d_sink = (next(grads) if t is not None else None for t in leaves)
        return dq, d_raw, None, None, d_comp, None, None, None, d_sink, None


def kernel_like_attention(q, raw_kv, window_start, window, compressed_kv=None, *, indices=None, ks=None,
                          ke=None, sink=None, scale, backend="auto", check_indices=True):  # fmt: skip
    return KeepsWhatTheKernelsKeep.apply(q, raw_kv, window_start, window, compressed_kv, indices, ks, ke, sink, scale)


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
@pytest.mark.parametrize("layer_idx", [0, 1, 2])
def test_v4_layer_keeps_q_only_for_the_attention_op(monkeypatch, layer_idx):
    monkeypatch.setattr(layer_module, "sparse_window_attention", kernel_like_attention)
    cfg = tiny_config(hidden_size=48, num_attention_heads=8, head_dim=64, q_lora_rank=24)
    assert cfg.q_head_rms  # V4's per-head q RMS
    layer = make_layer(cfg, layer_idx, seed=stable_seed(("memory", layer_idx))).to(torch.bfloat16)
    seq = 40
    ids = packed_ids([[17, 23], [40]], seq=seq)
    x = torch.randn(2, seq, cfg.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    kept, (out, _) = kept_storages(lambda: run(layer, x, ids))
    q_numel = 2 * seq * cfg.num_attention_heads * cfg.head_dim
    q_sized = sorted((numel, str(dtype)) for _nbytes, numel, dtype in kept.values() if numel >= q_numel)
    # The op's q and out, and the output projection's input: three bf16 tensors of q's size.
    assert q_sized == [(q_numel, "torch.bfloat16")] * 3, q_sized
    out.float().square().sum().backward()  # and the backward runs on what was kept
    assert x.grad is not None and torch.isfinite(x.grad).all()


@pytest.mark.parametrize("layer_idx", [0, 1, 2])
def test_recomputed_queries_give_the_gradients_of_kept_ones(monkeypatch, layer_idx):
    """The recompute of ``wq_b`` and the per-head RMS changes what is kept, never a gradient bit."""
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
                        lambda self, latent: self._normalized_queries(latent))  # fmt: skip
    kept = gradients()
    assert len(recomputed) == len(kept) > 3
    for got, expected in zip(recomputed, kept):
        assert torch.equal(got, expected)
