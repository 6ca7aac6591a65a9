"""Block-diagonal linear map: DeepSeek-V4's grouped output projection ``wo_a``."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


class GroupedLinear(nn.Linear):
    """``groups`` independent maps, group g taking input slice g to output slice g.

    ``weight`` is ``[out_features, in_features_per_group]``: the rows of group g are
    ``[g * out_features / groups, (g + 1) * out_features / groups)``, the released checkpoint's
    layout of ``wo_a``, so a plain ``nn.Linear`` weight tensor loads unchanged.

    Plain tensors of one dtype outside autocast take :class:`_GroupedLinearFunction`, which
    writes the products straight into their token-major layouts; anything else (autocast, a
    sharded weight) takes :meth:`reference`'s ``einsum``.

    ``forward(x, transform)`` maps ``transform(x)``, an elementwise, shape-keeping function with its
    own autograd (the attention output's inverse RoPE): the Function keeps ``x`` instead of
    ``transform(x)`` and applies ``transform`` again in its backward, for the weight gradient and to
    carry the input gradient back through it. Values and gradients are those of
    ``forward(transform(x))``; what is kept is ``x``, which the attention op keeps anyway (64 KiB
    a token a layer less at V4-Flash shapes).

    Low-rank adapters: nemo-automodel's PEFT adds ``lora_A`` ``[rank, in_features_per_group]``
    and ``lora_B`` ``[out_features, rank]`` to a matched ``nn.Linear`` and swaps its class for a
    subclass whose first base is its LoRA linear, whose ``forward`` is a plain ``x @ weight.T``.
    Such a subclass keeps this class's ``forward`` (``__init_subclass__``), which adds the adapter
    group by group: the map of the effective weight ``weight + scale * lora_B.weight @
    lora_A.weight`` in this block-diagonal layout (the adapter's own ``materialize_effective_weight``),
    with its dropout before or after the adapter as configured. With one group that is the
    plain LoRA linear's output.
    """

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        # A subclass that does not define a forward of its own maps groups, whatever forward
        # another base puts first in its MRO (PEFT's class swap): a plain linear map of
        # [..., groups * in] inputs through an [out, in] weight is a shape error or a wrong map.
        if "forward" not in cls.__dict__:
            cls.forward = GroupedLinear.forward

    def __init__(self, in_features_per_group: int, out_features: int, groups: int) -> None:
        if groups < 1 or out_features % groups:
            raise ValueError(f"groups must be >= 1 and divide out_features={out_features}, got {groups}")
        super().__init__(in_features_per_group, out_features, bias=False)
        self.groups = groups

    def forward(self, x: torch.Tensor, transform: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
        """``x [..., groups * in_features_per_group]`` -> ``[..., out_features]`` (of ``transform(x)``)."""
        plain = all(type(t) in (torch.Tensor, nn.Parameter) for t in (x, self.weight))
        if plain and x.dtype == self.weight.dtype and not torch.is_autocast_enabled(x.device.type):
            out = _GroupedLinearFunction.apply(x, self.weight, self.groups, transform)
        else:
            out = self.reference(x if transform is None else transform(x))
        if getattr(self, "lora_A", None) is None:
            return out
        return out + self._adapter_output(x if transform is None else transform(x))

    def _adapter_output(self, x: torch.Tensor) -> torch.Tensor:
        """The LoRA term of each group: ``scale * (x_g @ lora_A.T) @ lora_B_g.T``, ``[..., out_features]``."""
        if getattr(self, "use_dora", False) or getattr(self, "super_fwd", None) is not None:
            raise ValueError(
                "a grouped linear (wo_a) takes plain LoRA adapters only: DoRA and quantized base weights are not "
                "supported (peft.use_dora must be false)"
            )
        dropout = getattr(self, "dropout_p", 0.0)
        before = getattr(self, "dropout_position", "post") == "pre"
        if before:
            x = nn.functional.dropout(x, p=dropout, training=self.training)
        latent = self.lora_A(x.unflatten(-1, (self.groups, self.in_features))) * self.scale  # [..., groups, rank]
        lora_b = self.lora_B.weight.view(self.groups, self.out_features // self.groups, -1)
        out = torch.einsum("...gr,gor->...go", latent, lora_b).flatten(-2)
        return out if before else nn.functional.dropout(out, p=dropout, training=self.training)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """The same map as one ``einsum`` (its autograd is the reference backward)."""
        grouped = x.unflatten(-1, (self.groups, self.in_features))
        weight = self.weight.view(self.groups, self.out_features // self.groups, self.in_features)
        return torch.einsum("...gi,goi->...go", grouped, weight).flatten(-2)


class _GroupedLinearFunction(torch.autograd.Function):
    """The ``einsum``'s three batched products, each written into the layout its consumer reads.

    The ``einsum`` computes group-major ``[groups, tokens, features]`` products, so its output and
    its input gradient are copied back to token-major ``[tokens, groups, features]`` (the input
    gradient is as large as the attention output: 1 GiB a layer at V4-Flash shapes and S = 16,384).
    Here ``torch.bmm`` writes through the transposed view of a token-major tensor instead."""

    @staticmethod
    def forward(ctx, x, weight, groups, transform):
        ctx.save_for_backward(x, weight)
        ctx.groups, ctx.transform = groups, transform
        if transform is not None:
            with torch.no_grad():
                x = transform(x)
        rows = x.reshape(-1, x.shape[-1])
        per_group = weight.view(groups, -1, weight.shape[1])  # [g, out / g, in / g]
        out = rows.new_empty(rows.shape[0], groups, per_group.shape[1])
        torch.bmm(_group_major(rows, groups), per_group.transpose(1, 2), out=out.transpose(0, 1))
        return out.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad):
        x_kept, weight = ctx.saved_tensors
        groups, transform = ctx.groups, ctx.transform
        x = x_kept
        if transform is not None:  # recomputed, with the graph that carries d_x back through it
            with torch.enable_grad():
                x_kept = x_kept.detach().requires_grad_(ctx.needs_input_grad[0])
                x = transform(x_kept)
        rows = x.reshape(-1, x.shape[-1])
        per_group = weight.view(groups, -1, weight.shape[1])
        grad_groups = _group_major(grad.reshape(rows.shape[0], -1), groups)  # [g, tokens, out / g]
        d_x = d_weight = None
        if ctx.needs_input_grad[0]:
            d_rows = rows.new_empty(rows.shape[0], groups, per_group.shape[2])
            torch.bmm(grad_groups, per_group, out=d_rows.transpose(0, 1))
            d_x = d_rows.view(x.shape)
        if ctx.needs_input_grad[1]:
            d_weight = torch.bmm(grad_groups.transpose(1, 2), _group_major(rows, groups)).view(weight.shape)
        if transform is not None and d_x is not None:
            (d_x,) = torch.autograd.grad(x, x_kept, d_x)
        return d_x, d_weight, None, None


def _group_major(rows: torch.Tensor, groups: int) -> torch.Tensor:
    """``[tokens, groups * f]`` as the view ``[groups, tokens, f]`` (no copy)."""
    return rows.view(rows.shape[0], groups, -1).transpose(0, 1)
