"""nemo-automodel's built-in DeepseekV41ForCausalLM and NemoDsaDeepseekV41ForCausalLM with the same
random weights (the tiny released structure of _support/tiny_released_v41.py in the full model), the
batches they are compared on, the selections each layer makes, and the reconciliation of cache
roundings that flip between two fp32 orders of the same value (tests/integrations/
test_deepseek_v41_plugin.py says when and why)."""

from __future__ import annotations

import torch

from _support.helpers import skip_without_automodel

try:
    import nemo_automodel  # noqa: F401
except ImportError as error:
    skip_without_automodel(error)

from nemo_automodel.components.models.common import BackendConfig
from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41Config
from nemo_automodel.components.models.deepseek_v41.model import DeepseekV41ForCausalLM

from _support.tiny_released_v41 import hf_config
from nemo_dsa.integrations.deepseek_v41 import NemoDsaDeepseekV41ForCausalLM
from nemo_dsa.integrations.deepseek_v41.attention import NemoDsaDeepseekV41Attention

RTOL = 1e-5
VOCAB = 64
ROWS = (2, 96, 80)  # rows, length, the second row's real tokens
PACK = [40, 31, 25]  # THD documents; the built-in aligns their starts to multiples of 2 itself


def config() -> DeepseekV41Config:
    return DeepseekV41Config(text_config=hf_config().to_dict(), vision_config={"num_hidden_layers": 0}, dtype="float32")


def backend() -> BackendConfig:
    return BackendConfig(attn="eager", linear="torch", rms_norm="torch_fp32", rope_fusion=False,
                         enable_hf_state_dict_adapter=True, dispatcher="torch", experts="torch_mm")  # fmt: skip


def build_models():
    """The built-in and the plugin with the same random weights."""
    torch.manual_seed(0)
    builtin = DeepseekV41ForCausalLM(config(), backend=backend())
    builtin.initialize_weights(buffer_device=torch.device("cpu"), dtype=torch.float32)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():  # attention weights large enough that attention decides the logits
        for name, p in builtin.named_parameters():
            if ".attn." in name:
                noise = torch.randn(p.shape, generator=gen)
                p.copy_(1 + 0.1 * noise if name.endswith("norm.weight") else noise * (0.5 if p.ndim == 1 else 0.15))
    plugin = NemoDsaDeepseekV41ForCausalLM(config(), backend=backend())
    plugin.load_state_dict(builtin.state_dict(), strict=True)
    return builtin, plugin


def batch(kind: str) -> dict:
    gen = torch.Generator().manual_seed({"rows": 1, "packed": 2}[kind])
    if kind == "rows":
        rows, length, real = ROWS
        ids = torch.randint(0, VOCAB, (rows, length), generator=gen)
        mask = torch.ones(rows, length, dtype=torch.long)
        mask[1, real:] = 0
        return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
    ids = torch.randint(0, VOCAB, (1, sum(PACK)), generator=gen)
    return {"input_ids": ids, "seq_lens": torch.tensor([PACK]), "labels": ids}


def record_selections(model) -> tuple[list, list]:
    """Forward hooks on every block's attention: the top-k indices each compressed layer attends."""
    picked, hooks = [], []
    for block in model.model.layers.values():
        def hook(module, args, output):
            state = output.state
            if isinstance(module, NemoDsaDeepseekV41Attention):
                picked.append(None if state.shared.source is None else state.shared.source.selection.topk_indices)
            else:
                picked.append(state.topk_indices)
        hooks.append(block.attn.register_forward_hook(hook))
    return picked, hooks


# Inputs of one cache rounding that agree to this (relative) are the same value up to fp32 order;
# at most MAX_FLIPS of a forward's ~27K rounded cache elements may go to a neighbouring code.
SAME_VALUE = 1e-5
MAX_FLIPS = 8


class CacheRoundingFlips:
    """Reconciles the plugin's window-KV fp8, compressed-KV NVFP4 and index q / k MXFP4 roundings
    with the built-in's where both sides rounded the same value (to fp32 order) to different codes,
    and records each such flip (an MXFP4 flip of an index query moves its scores, and may move a
    selection or a candidate block, by a whole grid step). The built-in's roundings are recorded during its forward; the plugin's forward that
    follows (same inputs) takes the built-in's code wherever its own differs and its input agrees
    to SAME_VALUE, keeping its own gradient path. A value differing beyond that is left alone (the
    comparison then fails on it). Seen on an AVX-512 Xeon (2026-12-01): one window-KV element of
    layer 5, 0.06054674 against 0.06054689 around the e4m3 mid-point 0.060546875 (0.0586 / 0.0625)."""

    # format -> (nemo_dsa module, its rounding function): the caches' and the index q / k's.
    FORMATS = {"fp8": ("sparse_attention", "fp8_quant_dequant"), "nvfp4": ("sparse_attention", "nvfp4_quant_dequant"),
               "mxfp4": ("indexer", "_mxfp4")}  # fmt: skip

    def __init__(self, builtin, plugin, monkeypatch) -> None:
        from nemo_automodel.components.models.deepseek_v41 import attention as builtin_attention

        from nemo_dsa.layers import indexer, sparse_attention

        modules = {"sparse_attention": sparse_attention, "indexer": indexer}

        self.recorded = {f: [] for f in self.FORMATS}
        self.used = {f: 0 for f in self.FORMATS}
        self.flips: list[tuple[str, float, float]] = []  # (format, built-in input, plugin input)
        original = builtin_attention.quantize_cache

        def record(values, *, format, block_size):
            out = original(values, format=format, block_size=block_size)
            if format in self.recorded:
                self.recorded[format].append((values.detach().clone(), out.detach().clone()))
            return out

        monkeypatch.setattr(builtin_attention, "quantize_cache", record)
        for fmt, (module, name) in self.FORMATS.items():
            owner = modules[module]
            monkeypatch.setattr(owner, name, self._reconciling(fmt, getattr(owner, name)))
        self.hooks = [
            builtin.register_forward_pre_hook(lambda *_: [calls.clear() for calls in self.recorded.values()] and None),
            plugin.register_forward_pre_hook(lambda *_: self.used.update(dict.fromkeys(self.used, 0))),
        ]

    def remove(self) -> None:
        for hook in self.hooks:
            hook.remove()

    def same_value(self, fmt: str, values: torch.Tensor, ref_in: torch.Tensor) -> torch.Tensor:
        """Where the plugin's rounding input is the built-in's up to fp32 order: each element
        within SAME_VALUE of itself."""
        same_value = (values - ref_in).abs() <= SAME_VALUE * ref_in.abs()
        if fmt == "mxfp4":  # an MXFP4 code also depends on its vector's block maximum: the whole
            # vector must be the same (a padding query's differs: nemo_dsa rotates it at 0).
            gap = (values - ref_in).abs().amax(-1, keepdim=True)
            same_value &= gap <= SAME_VALUE * ref_in.abs().amax(-1, keepdim=True)
        return same_value

    def _reconciling(self, fmt, quantize):
        def reconciled(values, *block):
            out = quantize(values, *block)
            index = self.used[fmt]
            self.used[fmt] += 1
            ref_in, ref_out = self.recorded[fmt][index]
            if ref_out.shape != out.shape:
                raise AssertionError(f"{fmt} call {index}: the built-in rounded {tuple(ref_out.shape)}, the plugin {tuple(out.shape)}")
            same_value = self.same_value(fmt, values.detach(), ref_in)
            flipped = (out.detach() != ref_out) & same_value
            self.flips += [(fmt, float(a), float(b)) for a, b in zip(ref_in[flipped], values.detach()[flipped])]
            return out + torch.where(flipped, ref_out - out.detach(), 0.0)

        return reconciled


def as_sets(indices: torch.Tensor, real: torch.Tensor) -> list:
    return [[{int(j) for j in row if j >= 0} for row, r in zip(rows, reals) if r] for rows, reals in zip(indices, real)]
