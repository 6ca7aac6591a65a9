"""The gradient nemo-automodel's trainer gives an auxiliary loss that rides on a model output.

nemo-automodel's ``train_ft`` normalises the main loss by the step's label tokens (all
micro-batches, all data- and context-parallel ranks), backpropagates it times the DP x CP size
and lets FSDP average the gradients over those ranks. A loss that enters the backward on its own,
with gradient 1 per micro-batch and rank, would come out summed over the micro-batches and divided
by the CP size. For its MoE auxiliary losses the trainer therefore sets, before each optimizer
step, the gradient such a loss must receive (``cp_size / micro-batches``, in
``MoEAuxLossAutoScaler.main_loss_backward_scale``; None outside the trainer).

The plugins' indexer KL loss is a mean over the queries of one forward whose CP ranks' shares add
up to the CP group's mean; with that gradient the step trains it on the average of its
micro-batch means (the mean itself when they hold equal query counts), whatever the accumulation
and CP split, as the MoE losses are.
"""

from __future__ import annotations

import torch

from nemo_dsa.layers.indexer_loss import attach_aux_loss

__all__ = ["attach_indexer_loss", "trainer_aux_loss_scale"]


def trainer_aux_loss_scale():
    """The trainer's current gradient for auxiliary losses (1.0 when no trainer set one)."""
    from nemo_automodel.components.moe.megatron.moe_utils import MoEAuxLossAutoScaler

    scale = MoEAuxLossAutoScaler.main_loss_backward_scale
    return 1.0 if scale is None else scale


def attach_indexer_loss(output: torch.Tensor, aux: torch.Tensor | None) -> torch.Tensor:
    """``output``, through which the backward also trains ``aux`` at the trainer's scale (read
    during the backward); ``output`` itself when there is nothing to train."""
    if aux is None or not torch.is_grad_enabled() or not aux.requires_grad:
        return output
    return attach_aux_loss(output, aux, trainer_aux_loss_scale)
