"""LoRA through nemo-automodel's PEFT on NemoDsaDeepseekV41ForCausalLM, against the built-in (CPU, fp32).

Both models start from the weights of tests/integrations/test_deepseek_v41_plugin.py (its config:
ratios 0/2/1 with source / reindex / reuse layers, candidate blocks, 8 index heads, grouped
``wo_a``). ``apply_lora_to_linear_modules`` runs on each, and the adapters get the same random
values (PEFT's zero ``lora_B`` would leave ``lora_A`` without gradient). Targets: the attention's
``wq_a``, ``wq_b``, ``wkv``, ``wo_a``, ``wo_b``, the compressors' ``wkv`` / ``wgate``, the
indexer's ``wq_b`` / ``weights_proj`` / ``wk`` and the routed experts. The V4.1 indexer only
selects (frozen, no gradient in either model), so its adapters move the selections but get no
gradient; every other adapter's gradient is compared.

What can differ, and how it is held (docs/semantics.md, "Ties" and "Rounding mid-points"):
- an exact (or fp32-order) tie at a top-k or candidate-block cut would let the two top-k rules
  keep different sets: every selection and candidate-block choice of the plugin is checked to be
  decided by a clear gap (counted; none may be a tie), then the two models' sets must be equal;
- a value within fp32 order of an fp8 / NVFP4 / MXFP4 mid-point rounds to another code on the
  other side: reconciled and counted as in the parity test (``CacheRoundingFlips``);
- what remains is fp32 order: logits within 1e-5; each adapter gradient within the larger of
  1e-5 and four times the built-in's own movement of that gradient when its attention outputs
  move by 1e-7 relative (two noise draws), a floor measured, not chosen.

The built-in's grouped ``wo_a`` takes an adapter only with PEFT's plain LoRA and one output group
(tests/integrations/test_deepseek_v4_plugin_lora.py says why); the comparison with ``wo_a`` uses
``o_groups=1``, the one with PEFT's defaults keeps the release's two groups without ``wo_a``.
"""

from __future__ import annotations

import dataclasses
import os
import re

import pytest
import torch

from _support.helpers import skip_without_automodel

try:
    import nemo_automodel  # noqa: F401
except ImportError as error:
    skip_without_automodel(error)

from safetensors import safe_open

from nemo_automodel.components._peft.lora import PeftConfig, apply_lora_to_linear_modules
from nemo_automodel.components.checkpoint.checkpointing import Checkpointer
from nemo_automodel.components.checkpoint.config import CheckpointingConfig
from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41Config
from nemo_automodel.components.models.deepseek_v41.model import DeepseekV41ForCausalLM

from _support.lora_adapters import adapter_gradients, adapter_names
from _support.tiny_released_v41 import RATIOS, hf_config, rel
from _support.v41_builtin_and_plugin import (MAX_FLIPS, ROWS, RTOL, SAME_VALUE, VOCAB, CacheRoundingFlips, as_sets, backend,
                                            batch, record_selections)  # fmt: skip

from nemo_dsa.integrations.deepseek_v41 import NemoDsaDeepseekV41ForCausalLM
from nemo_dsa.layers import indexer as indexer_module
from nemo_dsa.ops.v41_indexer import candidates as candidates_module

ATTENTION = ["*.attn.wq_a", "*.attn.wq_b", "*.attn.wkv", "*.attn.wo_b"]
COMPRESSOR = ["*.compressor.wkv", "*.compressor.wgate"]
INDEXER = ["*.indexer.wq_b", "*.indexer.weights_proj", "*.indexer.wk"]
EXPERTS = ["*.ffn.experts"]
EVERY_TARGET = ATTENTION + ["*.attn.wo_a"] + COMPRESSOR + INDEXER + EXPERTS
ADAPTER_STD = 0.05
GRADIENT_NOISE = 1e-7  # relative noise on each attention output for the gradient floor
TIE_GAP = 1e-5  # a cut closer than this (relative to the kept score) could fall either way


def v41_config(**text) -> DeepseekV41Config:
    # Gradients are taken in train mode, where a nonzero attention dropout draws a different mask
    # on each side; the comparison needs it off.
    text = {**hf_config().to_dict(), "attention_dropout": 0.0, **text}
    return DeepseekV41Config(text_config=text, vision_config={"num_hidden_layers": 0}, dtype="float32")


def lora_pair(peft: PeftConfig, seed: int, **text):
    """(built-in, plugin): the parity test's base weights, the same random adapters."""
    torch.manual_seed(0)
    builtin = DeepseekV41ForCausalLM(v41_config(**text), backend=backend())
    builtin.initialize_weights(buffer_device=torch.device("cpu"), dtype=torch.float32)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():  # attention weights large enough that attention decides the logits
        for name, p in builtin.named_parameters():
            if ".attn." in name:
                noise = torch.randn(p.shape, generator=gen)
                p.copy_(1 + 0.1 * noise if name.endswith("norm.weight") else noise * (0.5 if p.ndim == 1 else 0.15))
    plugin = NemoDsaDeepseekV41ForCausalLM(v41_config(**text), backend=backend())
    plugin.load_state_dict(builtin.state_dict(), strict=True)
    counts = [apply_lora_to_linear_modules(model, peft) for model in (builtin, plugin)]
    assert counts[0] == counts[1] > 0, counts
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in builtin.named_parameters():
            if "lora_" in name:
                p.copy_(ADAPTER_STD * torch.randn(p.shape, generator=gen))
    adapters = {k: v for k, v in builtin.state_dict().items() if "lora_" in k}
    missing, unexpected = plugin.load_state_dict(adapters, strict=False)
    assert not unexpected and not [k for k in missing if "lora_" in k]
    assert adapter_names(builtin) == adapter_names(plugin)
    return builtin, plugin


class VectorScaleRoundingFlips(CacheRoundingFlips):
    """The parity test's reconciliation, with "the same value" measured against each rounded
    vector's largest element: fp32 reordering moves a sum by a few ulps of its terms, not of its
    result, so an element near zero by cancellation moves by far more than SAME_VALUE of itself
    (seen here: a window-KV value 0.00057988 / 0.00057959 in a vector reaching ~4, a code apart).
    The adapters' extra products make such cancellations common."""

    def same_value(self, fmt: str, values: torch.Tensor, ref_in: torch.Tensor) -> torch.Tensor:
        same = (values - ref_in).abs() <= SAME_VALUE * ref_in.abs().amax(-1, keepdim=True)
        return same & same.all(-1, keepdim=True) if fmt == "mxfp4" else same  # MXFP4: the block maximum too


class Cuts:
    """Every top-k the plugin's V4.1 indexer takes (key selections and candidate blocks): the gap
    between the last kept and the first dropped score of each query that really chooses."""

    def __init__(self, monkeypatch) -> None:
        self.gaps: list[tuple[str, torch.Tensor, torch.Tensor]] = []  # (what, kept, dropped)
        for owner, name, what in ((indexer_module, "select_topk", "keys"),
                                  (candidates_module, "select_topk_in_ranges", "candidate blocks")):
            monkeypatch.setattr(owner, name, self._recording(what, getattr(owner, name)))

    def _recording(self, what, select):
        def recorded(scores, topk, order, *, ks=None, ke=None, **kwargs):
            row = scores.detach().float()
            if ks is not None:  # only [ks, ke) of each row competes
                column = torch.arange(row.shape[-1])
                inside = (column >= ks.unsqueeze(-1)) & (column < ke.unsqueeze(-1))
                row = row.masked_fill(~inside, float("-inf"))
            if 0 < topk < row.shape[-1]:
                ranked = row.sort(dim=-1, descending=True).values
                self.gaps.append((what, ranked[..., topk - 1], ranked[..., topk]))
            return select(scores, topk, order, ks=ks, ke=ke, **kwargs)

        return recorded

    def clear(self) -> None:
        self.gaps.clear()

    def decided(self) -> tuple[dict, int]:
        """``({what: queries whose cut is contested}, ties)``: a query is contested when a finite
        score falls below the cut, a tie when its gap is within TIE_GAP of the kept score."""
        counts, ties = {}, 0
        for what, kept, dropped in self.gaps:
            contested = torch.isfinite(dropped)
            margin = (kept - dropped)[contested]
            ties += int((margin <= TIE_GAP * kept[contested].abs()).sum())
            counts[what] = counts.get(what, 0) + int(contested.sum())
        return counts, ties


def gradient_floors(model, ids, probe, ref: dict) -> dict:
    """Per adapter: the largest relative movement of its gradient when the built-in's attention
    outputs are each multiplied by ``1 + GRADIENT_NOISE * N(0, 1)`` (two draws)."""
    floors: dict = {}
    for seed in (11, 12):
        gen = torch.Generator().manual_seed(seed)

        def noisy(module, args, output):
            noise = torch.randn(output.hidden_states.shape, generator=gen)
            return dataclasses.replace(output, hidden_states=output.hidden_states * (1 + GRADIENT_NOISE * noise))

        hooks = [block.attn.register_forward_hook(noisy) for block in model.model.layers.values()]
        try:
            moved = adapter_gradients(model, ids, probe)
        finally:
            for hook in hooks:
                hook.remove()
        for name, g in ref.items():
            if g is not None and g.any():
                floors[name] = max(floors.get(name, 0.0), rel(moved[name], g))
    return floors


def assert_same_lora_run(builtin, plugin, monkeypatch, request, seed: int) -> dict:
    flips = VectorScaleRoundingFlips(builtin, plugin, monkeypatch)
    request.addfinalizer(flips.remove)
    cuts = Cuts(monkeypatch)
    inputs = batch("rows")
    ids, mask = inputs["input_ids"], inputs["attention_mask"]
    real = mask.bool()
    picked_ref, hooks_ref = record_selections(builtin)
    picked, hooks = record_selections(plugin)
    try:
        with torch.no_grad():
            ref = builtin.eval()(input_ids=ids, attention_mask=mask).logits
            cuts.clear()
            out = plugin.eval()(input_ids=ids, attention_mask=mask).logits
    finally:
        for hook in hooks_ref + hooks:
            hook.remove()
    decided, ties = cuts.decided()
    assert ties == 0, f"{ties} selections decided by a tie: choose other weights or index heads"
    assert decided.get("keys", 0) > 100 and decided.get("candidate blocks", 0) > 10, decided
    compared = 0
    for layer_idx, (mine, theirs) in enumerate(zip(picked, picked_ref)):
        if RATIOS[layer_idx]:
            assert as_sets(mine, real) == as_sets(theirs, real), layer_idx
            compared += int(real.sum())
    logits_rel = rel(out[real], ref[real])
    assert logits_rel <= RTOL, (logits_rel, flips.flips)

    probe = torch.randn(ref.shape, generator=torch.Generator().manual_seed(seed))
    theirs, mine = adapter_gradients(builtin, ids, probe), adapter_gradients(plugin, ids, probe)
    assert theirs.keys() == mine.keys() == set(adapter_names(builtin))  # nothing else trains
    floors = gradient_floors(builtin, ids, probe, theirs)
    worst, worst_ratio, graded = 0.0, 0.0, 0
    for name, g in theirs.items():
        if g is None or not g.any():  # the indexer's adapters: they only select
            assert ".indexer." in name and (mine[name] is None or not mine[name].any()), name
            continue
        assert ".indexer." not in name, name
        graded += 1
        moved = rel(mine[name], g)
        bound = max(RTOL, 4 * floors[name])
        worst, worst_ratio = max(worst, moved), max(worst_ratio, moved / bound)
        assert moved <= bound, (name, moved, floors[name])
    assert len(flips.flips) <= 2 * MAX_FLIPS, flips.flips  # forward and gradient passes
    return {"logits_rel": logits_rel, "selections_decided": decided, "ties": ties, "selection_rows_compared": compared,
            "adapter_grads_compared": graded, "adapter_grad_worst_rel": worst, "worst_share_of_bound": worst_ratio,
            "rounding_flips": flips.flips}  # fmt: skip


def test_tie_check_sees_the_ties_of_two_index_heads(monkeypatch):
    """The tie check can fail: with 2 index heads MXFP4 scores tie at the cut (docs/semantics.md)."""
    peft = PeftConfig(target_modules=EVERY_TARGET, dim=4, alpha=8, use_memory_efficient_lora=False)
    _, plugin = lora_pair(peft, seed=20, o_groups=1, index_n_heads=2)
    cuts = Cuts(monkeypatch)
    inputs = batch("rows")
    with torch.no_grad():
        plugin.eval()(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"])
    decided, ties = cuts.decided()
    print("2 index heads: contested cuts", decided, "ties", ties)
    assert ties > 0


def test_lora_on_every_projection_matches_the_builtin(monkeypatch, request):
    peft = PeftConfig(target_modules=EVERY_TARGET, dim=4, alpha=8, use_memory_efficient_lora=False)
    builtin, plugin = lora_pair(peft, seed=20, o_groups=1)
    names = adapter_names(plugin)
    for target in ("attn.wq_a.", "attn.wo_a.", "compressor.wkv.", "compressor.wgate.", "indexer.wq_b.",
                   "indexer.weights_proj.", "indexer.wk.", "ffn.experts.lora_"):  # fmt: skip
        assert any(target in n for n in names), target
    result = assert_same_lora_run(builtin, plugin, monkeypatch, request, seed=21)
    print("every projection", result)
    assert result["adapter_grads_compared"] > 30


def test_lora_with_peft_defaults_matches_the_builtin_on_the_release_layout(monkeypatch, request):
    peft = PeftConfig(target_modules=ATTENTION + COMPRESSOR + INDEXER + EXPERTS, dim=4, alpha=8)
    builtin, plugin = lora_pair(peft, seed=30)
    result = assert_same_lora_run(builtin, plugin, monkeypatch, request, seed=31)
    print("release layout", result)


def adapted_module(key: str) -> str:
    """``layers.4.attn.wq_a`` of an adapter's native or saved key; a routed expert's saved
    per-expert projections (``experts.0.w1``) name their module ``experts``."""
    module = "layers." + key.split(".layers.", 1)[1].split(".lora_")[0]
    return re.sub(r"\.experts\.\d+\.w[123]$", ".experts", module)


def test_only_adapters_train_and_the_run_saves_and_reloads_adapters_only(tmp_path):
    peft = PeftConfig(target_modules=EVERY_TARGET, dim=4, alpha=8)
    torch.manual_seed(50)
    plugin = NemoDsaDeepseekV41ForCausalLM(v41_config(), backend=backend())
    plugin.initialize_weights(buffer_device=torch.device("cpu"), dtype=torch.float32)
    apply_lora_to_linear_modules(plugin, peft)
    trainable = sorted(n for n, p in plugin.named_parameters() if p.requires_grad)
    assert trainable == adapter_names(plugin) and trainable
    before = {k: v.clone() for k, v in plugin.state_dict().items()}
    optimizer = torch.optim.AdamW([p for p in plugin.parameters() if p.requires_grad], lr=1e-2)
    gen = torch.Generator().manual_seed(52)
    plugin.train()
    for _ in range(2):
        ids = torch.randint(0, VOCAB, (2, ROWS[1]), generator=gen)
        logits = plugin(input_ids=ids).logits
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    after = plugin.state_dict()
    changed = sorted(k for k in after if not torch.equal(after[k], before[k]))
    assert changed and all("lora_" in k for k in changed), [k for k in changed if "lora_" not in k]
    for target in ("attn.wq_a.lora_B", "attn.wo_a.lora_B", "compressor.wgate.lora_B", "ffn.experts.lora_"):
        assert any(target in k for k in changed), target
    assert not [k for k in changed if ".indexer." in k]  # the frozen indexer's adapters get no gradient

    checkpointer = Checkpointer(
        CheckpointingConfig(checkpoint_dir=str(tmp_path), is_peft=True, model_repo_id="tiny-v41"),
        dp_rank=0, tp_rank=0, pp_rank=0,
    )  # fmt: skip
    checkpointer.save_model(plugin, str(tmp_path / "step_2"), peft_config=peft)
    saved = tmp_path / "step_2" / "model" / "adapter_model.safetensors"
    # Adapters only, in the layout the built-in saves (its state-dict adapter writes the routed
    # experts' adapters per expert, HF PEFT names): the same keys and shapes as the built-in's file.
    builtin = DeepseekV41ForCausalLM(v41_config(), backend=backend())
    apply_lora_to_linear_modules(builtin, peft)
    checkpointer.save_model(builtin, str(tmp_path / "builtin"), peft_config=peft)
    files = {}
    for name, path in (("plugin", saved), ("builtin", tmp_path / "builtin" / "model" / saved.name)):
        with safe_open(str(path), framework="pt") as f:
            files[name] = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    assert files["plugin"] == files["builtin"]
    assert all(".lora_" in k for k in files["plugin"]) and len(files["plugin"]) >= len(trainable)
    assert {adapted_module(k) for k in files["plugin"]} == {adapted_module(n) for n in trainable}  # each, no other
    assert not [f for f in os.listdir(saved.parent) if f.endswith(".safetensors") and f != saved.name]

    torch.manual_seed(53)
    fresh = NemoDsaDeepseekV41ForCausalLM(v41_config(), backend=backend())
    fresh.initialize_weights(buffer_device=torch.device("cpu"), dtype=torch.float32)
    fresh.load_state_dict({k: v for k, v in before.items() if "lora_" not in k}, strict=False)
    apply_lora_to_linear_modules(fresh, peft)
    checkpointer.load_model(fresh, str(saved.parent))
    reloaded = fresh.state_dict()
    assert reloaded.keys() == after.keys()
    for key in after:
        assert torch.equal(reloaded[key], after[key]), key
    ids = torch.randint(0, VOCAB, (2, ROWS[1]), generator=gen)
    with torch.no_grad():
        assert torch.equal(fresh.eval()(input_ids=ids).logits, plugin.eval()(input_ids=ids).logits)
