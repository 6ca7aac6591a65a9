"""V4's per-head q RMS norm + RoPE kernels against the reference on the GPU (``pytest -m gpu``).

Fresh random rows of very different scales, ragged sequence lengths, batches, head counts that
take every block size, head dims 128 and 512; outputs poisoned with NaN before the kernels write.
The forward must equal the reference (the same roundings) except where the fp32 sum of squares,
added in another order, moves a normalised value across a bf16 rounding mid-point (few elements).
A rotary channel can then differ by more than one ulp of its own (small) value, so the rest of the
roundings are checked from the kernel's own rstd, ``rope_reference(bf16(x * rstd))``: equal but
for an FMA's rounding, one ulp in very few elements.
The backward is held to two bf16 ulps of the reference's largest gradient in the row."""

import pytest
import torch

from _support.helpers import stable_seed
from nemo_dsa.layers.rope import rope_angles
from nemo_dsa.ops.head_norm_rope import head_rms_rope, head_rms_rope_reference
from nemo_dsa.ops.head_norm_rope.interface import _kernel, _rows_and_tables
from nemo_dsa.ops.head_norm_rope.naive import rope_reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: runs the TileLang kernels"),
]
EPS = 1e-6
CASES = [(1, 1, 64, 512, 64), (3, 37, 3, 512, 64), (2, 300, 128, 512, 64), (1, 203, 6, 128, 64), (2, 17, 16, 256, 0)]


def inputs(batch, seq, heads, dim, rope_dim):
    gen = torch.Generator(device="cuda").manual_seed(stable_seed((batch, seq, heads, dim, rope_dim)))
    scale = torch.exp(2 * torch.randn(batch, seq, heads, 1, device="cuda", generator=gen))
    x = (torch.randn(batch, seq, heads, dim, device="cuda", generator=gen) * scale).to(torch.bfloat16)
    positions = torch.randint(0, 65536, (batch, seq), device="cuda", generator=gen)
    return x, rope_angles(positions, rope_dim, 160000.0)


@pytest.mark.parametrize("case", CASES)
def test_forward_writes_every_element_and_matches_the_reference(case):
    x, angles = inputs(*case)
    rows, cos, sin = _rows_and_tables(x, angles)
    q = torch.full_like(rows, float("nan"))
    rstd = torch.full((rows.shape[0],), float("nan"), device="cuda")
    _kernel("forward", x, 2 * angles.shape[-1])(rows, cos, sin, q, rstd, x.shape[2], EPS)
    ref = head_rms_rope_reference(x, angles, EPS).reshape(rows.shape)
    assert not q.isnan().any() and not rstd.isnan().any()
    xf = x.float().reshape(rows.shape)
    torch.testing.assert_close(rstd, torch.rsqrt(xf.pow(2).mean(-1) + EPS), rtol=1e-6, atol=0)
    differs = q != ref
    assert differs.float().mean() < 1e-3, float(differs.float().mean())
    normalised = (xf * rstd[:, None]).to(x.dtype).reshape(x.shape)
    from_its_rstd = rope_reference(normalised, angles).reshape(rows.shape).float()
    # nvcc may contract a rotation's products into an FMA (one fp32 rounding fewer): after
    # cancellation, a small rotated value can round to another bf16 number, within one ulp of it
    # plus the fp32 rounding of its two products
    assert (q.float() != from_its_rstd).float().mean() < 1e-5
    larger = torch.maximum(q.float().abs(), from_its_rstd.abs())
    ulp = torch.exp2(torch.floor(torch.log2(larger.clamp_min(2.0**-126))) - 7)
    magnitude = normalised.float().reshape(rows.shape).abs()
    half = angles.shape[-1]
    if half:
        pair = magnitude[:, -2 * half :].unflatten(-1, (half, 2)).sum(-1, keepdim=True)
        magnitude[:, -2 * half :] = pair.expand(-1, -1, 2).flatten(-2)
    excess = (q.float() - from_its_rstd).abs() - (ulp * 1.01 + magnitude * 2.0**-22)
    worst = int(excess.argmax())
    assert float(excess.max()) <= 0, (worst, float(q.flatten()[worst]), float(from_its_rstd.flatten()[worst]),
                                      float(magnitude.flatten()[worst]))  # fmt: skip


@pytest.mark.parametrize("case", CASES)
def test_backward_matches_autograd_of_the_reference(case):
    x, angles = inputs(*case)
    grad = torch.randn(x.shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(7)).to(torch.bfloat16)
    mine, ref = x.clone().requires_grad_(), x.clone().requires_grad_()
    head_rms_rope(mine, angles, EPS, backend="tilelang").backward(grad)
    head_rms_rope_reference(ref, angles, EPS).backward(grad)
    assert not mine.grad.isnan().any()
    row_scale = ref.grad.float().abs().amax(-1, keepdim=True)
    assert ((mine.grad.float() - ref.grad.float()).abs() <= row_scale * 2**-7).all()


@pytest.mark.parametrize("layer_idx", [0, 2])  # window-only, ratio 8 (every visible group)
def test_the_layer_with_the_fused_queries_matches_the_eager_ones(monkeypatch, layer_idx):
    """A V4 layer on the GPU with its queries from the fused kernels against the same layer with
    the eager norm + RoPE in their place (both on the attention kernels)."""
    from _support.dsa_layer_runs import make_layer, packed_ids, run
    from _support.helpers import tiny_config
    from nemo_dsa.layers import sparse_attention as layer_module

    cfg = tiny_config(hidden_size=64, num_attention_heads=8, head_dim=128, qk_rope_head_dim=64, q_lora_rank=32,
                      index_head_dim=64, backend="tilelang")  # fmt: skip
    x = torch.randn(2, 96, cfg.hidden_size, generator=torch.Generator().manual_seed(3)).cuda().to(torch.bfloat16)
    ids = packed_ids([[40, 56], [77]], seq=96).cuda()
    calls = []

    def eager(q, angles, eps, backend):
        calls.append(backend)
        return layer_module.apply_rope(layer_module.rms_normalize(q, eps), angles)

    results = {}
    for fused in (False, True):
        with monkeypatch.context() as patch:
            if not fused:
                patch.setattr(layer_module, "head_rms_rope", eager)
            layer = make_layer(cfg, layer_idx, seed=5).cuda().to(torch.bfloat16)
            inputs = x.clone().requires_grad_()
            out, _ = run(layer, inputs, ids)
            out.float().square().sum().backward()
            results[fused] = (out.float(), inputs.grad.float(), layer.wq_b.weight.grad.float())
    assert calls, "the layer did not take the fused path on CUDA"
    for eager, fused in zip(results[False], results[True]):
        assert float((fused - eager).norm() / eager.norm()) < 1e-2
