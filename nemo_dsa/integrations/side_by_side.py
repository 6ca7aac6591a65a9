"""Small DeepSeek-V4 / V4.1 models of both kinds from one config: nemo-automodel's built-in and
nemo_dsa's plugin, holding the same weights, and a training step for either.

``benchmarks/model_step.py`` times these two sides against each other on a GPU and
``benchmarks/saved_activations.py`` counts what they keep for the backward; the tests build the
same sides on CPU (fp32, tiny dimensions given as overrides) and check that two steps give the
same losses, so the benchmark compares like with like.

V4 (``v4_config``): V4-Flash attention shapes (64 heads of 512, 64 rotary dims, q rank 1024, 8
output groups of rank 1024, window 128, top-512 of 64 index heads), a small MoE,
hyper-connections hc_mult 4. V4.1 (``v41_config``): the released V4.1-Flash attention (hidden
5120, 64 heads of 512, q rank 1280, 32 index heads of 128, top-512, candidate blocks 2048 of 8,
YaRN x16 over 65,536 positions), hc_mult 4, no vision tower, Engram and MTP off, layer roles
from ``v41_layer_roles``.
"""

from __future__ import annotations

import torch

FAMILIES = ("v4", "v41")
DEFAULT_RATIOS = {"v4": [0, 4, 128], "v41": [0, 2, 2, 1, 1]}
V41_RATIOS = (0, 1, 2)
# The released structure at toy widths (attention: 4 heads of 32, top-6, window 8), for CPU runs of
# both sides (the tests, ``benchmarks/step_profile.py --tiny``), fp32, with their lengths and vocabulary.
TINY_OVERRIDES = {
    "v4": dict(hidden_size=64, moe_intermediate_size=32, num_attention_heads=4, head_dim=32, qk_rope_head_dim=16,
               q_lora_rank=32, o_lora_rank=16, o_groups=2, sliding_window=8, index_n_heads=16, index_head_dim=32,
               index_topk=6),
    "v41": dict(hidden_size=64, moe_intermediate_size=32, num_attention_heads=4, head_dim=32, qk_rope_head_dim=16,
                q_lora_rank=32, o_lora_rank=16, o_groups=2, sliding_window=8, index_n_heads=8, index_head_dim=32,
                index_topk=6, candidate_topk_blocks=3, candidate_block_size=4),
}  # fmt: skip
TINY_SEQ = {"v41": 64, "v4": 256}  # V4: two ratio-128 groups; V4.1: 16 candidate blocks of 4, 3 kept
TINY_VOCAB = 64


def model_config(family: str, ratios: list[int], vocab: int, experts: int, dtype: str = "bfloat16", **overrides):
    """One config both sides are built from; ``overrides`` replace single (text) config fields."""
    if family == "v4":
        return v4_config(ratios, vocab, experts, dtype, **overrides)
    if family == "v41":
        return v41_config(ratios, vocab, experts, dtype, **overrides)
    raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")


def v4_config(ratios: list[int], vocab: int, experts: int, dtype: str = "bfloat16", **overrides):
    from nemo_automodel.components.models.deepseek_v4.config import DeepseekV4Config

    fields = dict(
        vocab_size=vocab, hidden_size=4096, moe_intermediate_size=2048, num_hidden_layers=len(ratios),
        num_attention_heads=64, head_dim=512, qk_rope_head_dim=64, q_lora_rank=1024, o_lora_rank=1024,
        o_groups=8, n_routed_experts=experts, n_shared_experts=1, num_experts_per_tok=2,
        compress_ratios=list(ratios), sliding_window=128, num_hash_layers=0, hc_mult=4,
        index_n_heads=64, index_head_dim=128, index_topk=512, num_nextn_predict_layers=0,
        rope_scaling={"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                      "beta_fast": 32, "beta_slow": 1},
        max_position_embeddings=1 << 20, torch_dtype=dtype,
    )  # fmt: skip
    fields.update(overrides)
    return DeepseekV4Config(**fields)


def v41_layer_roles(ratios: list[int]) -> dict:
    """The V4.1 schedule of ``ratios``: the first layer of each run of one compressed ratio is its
    kv + index source; the ratio-1 layer right after its source re-indexes (an index source
    without KV); every other compressed layer reuses its source's KV and selection; the first
    ratio-1 source is the candidate source (the release: layer 20, its only ratio-1 source).
    Ratio-2 layers come before ratio-1 layers, as in the release: the candidate blocks mask every
    later indexer, which must therefore index ratio-1 keys."""
    if not ratios or any(r not in V41_RATIOS for r in ratios):
        raise ValueError(f"ratios of a V4.1 model must each be one of {V41_RATIOS}, got {ratios}")
    if 1 in ratios and 2 in ratios[ratios.index(1) :]:
        raise ValueError(f"ratios of a V4.1 model: every 2 must precede every 1 (as released), got {ratios}")
    kv_sources, index_sources, owner, source = [], [], None, None
    for layer, ratio in enumerate(ratios):
        if ratio == 0:
            continue
        if ratio != owner:
            owner, source = ratio, layer
            kv_sources.append(layer)
            index_sources.append(layer)
        elif ratio == 1 and layer == source + 1:
            index_sources.append(layer)
    candidate = next((layer for layer in kv_sources if ratios[layer] == 1), -1)
    return {"kv_source_layer_ids": kv_sources, "index_source_layer_ids": index_sources,
            "candidate_source_layer_id": candidate}  # fmt: skip


def v41_config(ratios: list[int], vocab: int, experts: int, dtype: str = "bfloat16", **overrides):
    """The released V4.1-Flash attention (the config's defaults, spelled out) in a small model."""
    from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41Config

    text = dict(
        vocab_size=vocab, hidden_size=5120, moe_intermediate_size=2304, num_hidden_layers=len(ratios),
        num_attention_heads=64, head_dim=512, qk_rope_head_dim=64, q_lora_rank=1280, o_lora_rank=1024,
        o_groups=8, n_routed_experts=experts, n_shared_experts=1, num_experts_per_tok=2,
        compress_ratios=list(ratios), **v41_layer_roles(ratios), sliding_window=128, index_n_heads=32,
        index_head_dim=128, index_topk=512, candidate_topk_blocks=2048, candidate_block_size=8, hc_mult=4,
        rope_scaling={"rope_type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                      "beta_fast": 32, "beta_slow": 1},
        max_position_embeddings=1 << 20, engram_layer_ids=[], num_nextn_predict_layers=0, dtype=dtype,
        dspark_noise_token_id=vocab - 1,  # (DSpark is not built) a token id inside the small vocabulary
    )  # fmt: skip
    text.update(overrides)
    return DeepseekV41Config(text_config=text, vision_config={"num_hidden_layers": 0}, dtype=text["dtype"])


def family_of(config) -> str:
    return {"deepseek_v4": "v4", "deepseek_v41": "v41"}[config.model_type]


def build(kind: str, config, state_dict=None, *, device="cuda", dtype=torch.bfloat16, attn="tilelang"):
    """``kind`` ("builtin" | "plugin") of ``config``'s family on ``device``, in train mode, holding
    ``state_dict`` if given (every key: a mismatch is a ValueError), else the built-in's init."""
    from nemo_automodel.components.models.common.utils import BackendConfig

    family = family_of(config)
    # V4.1's attention takes torch_fp32 (or te) norms only.
    backend = BackendConfig(
        attn=attn, linear="torch", rms_norm="torch" if family == "v4" else "torch_fp32", rope_fusion=False,
        enable_hf_state_dict_adapter=False, dispatcher="torch", experts="torch_mm",
    )  # fmt: skip
    if (family, kind) == ("v4", "builtin"):
        from nemo_automodel.components.models.deepseek_v4.model import DeepseekV4ForCausalLM as cls
    elif (family, kind) == ("v4", "plugin"):
        from nemo_dsa.integrations.deepseek_v4 import NemoDsaDeepseekV4ForCausalLM as cls
    elif (family, kind) == ("v41", "builtin"):
        from nemo_automodel.components.models.deepseek_v41.model import DeepseekV41ForCausalLM as cls
    elif (family, kind) == ("v41", "plugin"):
        from nemo_dsa.integrations.deepseek_v41 import NemoDsaDeepseekV41ForCausalLM as cls
    else:
        raise ValueError(f"kind must be 'builtin' or 'plugin', got {kind!r}")
    device = torch.device(device)
    with device:
        model = cls(config, backend=backend)
    model.initialize_weights(buffer_device=device, dtype=dtype)
    if family == "v41":
        hc_sinkhorn_on_torch_without_tile_kernels(model)
    if state_dict is not None:
        missing, unexpected = model.load_state_dict(state_dict, strict=False)
        if missing or unexpected:
            raise ValueError(f"{kind}: state dict mismatch, missing {missing[:5]}, unexpected {unexpected[:5]}")
    return model.train()


def hc_sinkhorn_on_torch_without_tile_kernels(model) -> None:
    """V4.1 asks for DeepSeek's TileKernels Sinkhorn in its hyper-connections whenever
    ``backend.attn`` is tilelang, and stops if the ``tile_kernels`` package is missing (seen on the
    H200). The hyper-connections are the built-in's on both sides, so without that package both
    sides run their Sinkhorn in torch: the comparison stays like for like."""
    from nemo_automodel.components.models.deepseek_v4.optimized_kernels import is_dsv4_kernel_available
    from nemo_automodel.components.models.deepseek_v41.layers import DeepseekV41HyperConnection

    if is_dsv4_kernel_available("sinkhorn"):
        return
    for module in model.modules():
        if isinstance(module, DeepseekV41HyperConnection):
            module.sinkhorn_backend = "torch"


def copy_weights(model) -> dict:
    """A detached copy of ``model``'s state dict, for the other side."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def training_step(model, seq: int, vocab: int, seed: int, device="cuda"):
    """One unpacked row of ``seq`` random tokens and a fused AdamW: (step() -> loss, optimizer)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    tokens = torch.randint(0, vocab, (1, seq + 1), device=device, generator=gen)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    position_ids = torch.arange(seq, device=device).unsqueeze(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)

    def step():
        logits = model(inputs, position_ids=position_ids).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return step, optimizer
