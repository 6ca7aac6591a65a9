"""Block-diagonal linear map: DeepSeek-V4's grouped output projection ``wo_a``."""

from __future__ import annotations

import torch
from torch import nn


class GroupedLinear(nn.Linear):
    """``groups`` independent maps, group g taking input slice g to output slice g.

    ``weight`` is ``[out_features, in_features_per_group]``: the rows of group g are
    ``[g * out_features / groups, (g + 1) * out_features / groups)``, the released checkpoint's
    layout of ``wo_a``, so a plain ``nn.Linear`` weight tensor loads unchanged.
    """

    def __init__(self, in_features_per_group: int, out_features: int, groups: int) -> None:
        if groups < 1 or out_features % groups:
            raise ValueError(f"groups must be >= 1 and divide out_features={out_features}, got {groups}")
        super().__init__(in_features_per_group, out_features, bias=False)
        self.groups = groups

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., groups * in_features_per_group]`` -> ``[..., out_features]``."""
        grouped = x.unflatten(-1, (self.groups, self.in_features))
        weight = self.weight.view(self.groups, self.out_features // self.groups, self.in_features)
        return torch.einsum("...gi,goi->...go", grouped, weight).flatten(-2)
