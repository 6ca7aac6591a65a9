"""DeepSeek-V4 / V4.1 HF config -> ``DSAModelConfig`` fields (the attention-relevant ones).

Reads transformers' ``DeepseekV4Config`` (``layer_types`` + ``compress_rates``, nested
``rope_parameters = {"main", "compress"}``), nemo-automodel's ``DeepseekV4Config``
(``compress_ratios``, ``rope_scaling``, ``compress_rope_theta``) or a config.json mapping (either
spelling). Field names are the HF ones wherever ``DSAModelConfig`` has the field:

============================  =====================================================================
DSAModelConfig                HF DeepSeek-V4 config
============================  =====================================================================
vocab_size, hidden_size,      same names
num_attention_heads,
head_dim, q_lora_rank,
o_lora_rank, o_groups,
sliding_window,
index_n_heads,
index_head_dim, index_topk,
rms_norm_eps,
max_position_embeddings,
initializer_range,
tie_word_embeddings
num_hidden_layers             num_hidden_layers (+ num_nextn_predict_layers with include_mtp_layers)
qk_rope_head_dim              qk_rope_head_dim (transformers: head_dim * partial_rotary_factor)
compress_ratios               compress_ratios, else layer_types mapped through compress_rates
                              (sliding_attention -> 0); MTP layers past the list get 0, as the
                              built-in's MTP block does
rope_theta                    rope_theta (transformers: rope_parameters["main"]["rope_theta"])
compress_rope_theta           compress_rope_theta (transformers: rope_parameters["compress"]["rope_theta"])
rope_scaling                  rope_scaling's YaRN keys (transformers: rope_parameters["compress"]);
                              None unless its type / rope_type is "yarn"
intermediate_size             moe_intermediate_size (nemo_dsa's stand-in dense FFN width only)
scoring                       "v4"
============================  =====================================================================

The attention has one shared KV head whatever ``num_key_value_heads`` says: nemo-automodel's V4
built-in accepts any value and never reads it (its V4.1 config refuses values other than 1 itself),
so another value is said once in the log and not read. An empty ``compress_ratios`` makes every
layer window-only, as in nemo-automodel's model. Fields the attention does not read (experts,
hyper-connections, hash layers, Engram, DSpark, vision) are ignored.

DeepSeek-V4.1 (nemo-automodel's ``DeepseekV41TextConfig``, ``model_type`` "deepseek_v41_text", or
the nested ``DeepseekV41Config`` whose ``text_config`` holds it; a mapping is V4.1 when it has
``kv_source_layer_ids``): the fields above, plus

============================  =====================================================================
kv_source_layer_ids,          same names; ids past the layers built are dropped (the release keeps
index_source_layer_ids,       its whole schedule in a config whose num_hidden_layers is cut), a
candidate_source_layer_id,    candidate source past them becomes -1
candidate_topk_blocks,
candidate_block_size
scoring                       "v41" (frozen MXFP4 indexer)
indexer_ratios                every ratio > 0 in compress_ratios (each compressed layer has a role)
q_head_rms                    False (V4.1 has no per-head q RMS)
compressor_overlap,           False, False (ratio-2 compressors pool 2 tokens without overlap or
compressor_ape                position bias; ratio 1 is ``wkv`` + norm)
index_keys                    "latent" (``k_norm(wk(compressed latent))``)
window_kv_quant               "fp8" (blocks of 32)
compressed_kv_quant           "nvfp4" (blocks of 16)
============================  =====================================================================
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from nemo_dsa.layers.rope import yarn_parameters

_LOG = logging.getLogger("nemo_dsa")
_REPORTED_KV_HEADS: set = set()

_SAME_NAME = (
    "vocab_size", "hidden_size", "num_attention_heads", "head_dim", "q_lora_rank", "o_lora_rank", "o_groups",
    "sliding_window", "index_n_heads", "index_head_dim", "index_topk", "rms_norm_eps",
    "max_position_embeddings", "initializer_range", "tie_word_embeddings", "attention_dropout",
)
_MISSING = object()
# transformers' DeepseekV4Config layer type -> ratio when a config gives no compress_rates.
_DEFAULT_RATES = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}


def _reader(hf_config):
    if isinstance(hf_config, Mapping):
        return lambda name, default=_MISSING: hf_config.get(name, default)
    return lambda name, default=_MISSING: getattr(hf_config, name, default)


def _required(get, name: str):
    value = get(name)
    if value is _MISSING or value is None:
        raise ValueError(f"hf_config: the DeepSeek-V4 config has no {name!r}")
    return value


def _compress_ratios(get, layers: int) -> list[int]:
    ratios = get("compress_ratios", None)
    if ratios is not None and (len(ratios) or get("layer_types", None) is None):
        return [int(r) for r in ratios]
    layer_types = get("layer_types", None)
    if not layer_types:
        raise ValueError("hf_config: needs compress_ratios or layer_types (one entry per layer)")
    rates = {**_DEFAULT_RATES, **(get("compress_rates", None) or {})}
    try:
        return [0 if t == "sliding_attention" else int(rates[t]) for t in layer_types]
    except KeyError as err:
        raise ValueError(f"hf_config: layer_types entry {err.args[0]!r} has no compress_rates entry") from None


def _rope(get) -> tuple[float, float, dict | None]:
    """``(rope_theta, compress_rope_theta, yarn rope_scaling or None)``."""
    nested = get("rope_parameters", None)
    if isinstance(nested, Mapping) and isinstance(nested.get("compress"), Mapping):
        main, compress = nested.get("main") or {}, nested["compress"]
        theta = float(main.get("rope_theta", get("rope_theta", 10000.0)))
        compress_theta = float(compress.get("rope_theta", get("compress_rope_theta", 160000.0)))
        scaling = compress
    else:
        theta = float(get("rope_theta", 10000.0))
        compress_theta = float(get("compress_rope_theta", 160000.0) or 160000.0)
        scaling = get("rope_scaling", None)
    yarn = yarn_parameters(scaling)
    return theta, compress_theta, None if yarn is None else {"type": "yarn", **yarn}


V41_MODEL_TYPES = ("deepseek_v41_text", "deepseek_v41")
_V41_ROLE_IDS = ("kv_source_layer_ids", "index_source_layer_ids")
_V41_SAME_NAME = ("candidate_topk_blocks", "candidate_block_size")
# The attention variant of DeepSeek-V4.1 (DSAModelConfig fields; see the module table).
V41_ATTENTION = {
    "scoring": "v41",
    "q_head_rms": False,
    "compressor_overlap": False,
    "compressor_ape": False,
    "index_keys": "latent",
    "window_kv_quant": "fp8",
    "compressed_kv_quant": "nvfp4",
}


def is_v41_config(hf_config) -> bool:
    """Whether ``hf_config`` (or its nested ``text_config``) is a DeepSeek-V4.1 text config."""
    get = _reader(_text_config(hf_config))
    return get("model_type", None) in V41_MODEL_TYPES or get("kv_source_layer_ids", None) is not None


def _text_config(hf_config):
    """The text model's config: V4.1's nested ``text_config`` when there is one, else ``hf_config``."""
    text = _reader(hf_config)("text_config", None)
    return hf_config if text is None or text is _MISSING else text


def _v41_fields(get, ratios: tuple[int, ...]) -> dict[str, Any]:
    layers = len(ratios)
    fields: dict[str, Any] = dict(V41_ATTENTION)
    for name in _V41_ROLE_IDS:
        ids = get(name, None)
        if ids is not None:
            fields[name] = tuple(int(i) for i in ids if int(i) < layers)
    candidate = int(get("candidate_source_layer_id", -1))
    fields["candidate_source_layer_id"] = candidate if candidate < layers else -1
    for name in _V41_SAME_NAME:
        value = get(name, None)
        if value is not None:
            fields[name] = int(value)
    fields["indexer_ratios"] = tuple(sorted({r for r in ratios if r > 0}))
    return fields


def dsa_fields_from_hf(hf_config, *, include_mtp_layers: bool = False) -> dict[str, Any]:
    """``DSAModelConfig`` keyword arguments from a DeepSeek-V4 or V4.1 HF config (the module tables)."""
    v41 = is_v41_config(hf_config)
    hf_config = _text_config(hf_config)
    get = _reader(hf_config)
    kv_heads = get("num_key_value_heads", 1)
    if kv_heads not in (None, 1) and kv_heads not in _REPORTED_KV_HEADS:
        _REPORTED_KV_HEADS.add(kv_heads)
        _LOG.warning("nemo_dsa: num_key_value_heads=%s is not read: the attention has one shared KV head, "
                     "as in nemo-automodel's DeepSeek-V4", kv_heads)  # fmt: skip
    fields: dict[str, Any] = {}
    for name in _SAME_NAME:
        value = get(name)
        if value is not _MISSING and value is not None:
            fields[name] = value
    layers = int(_required(get, "num_hidden_layers"))
    if include_mtp_layers:
        layers += int(get("num_nextn_predict_layers", 0) or 0)
    ratios = _compress_ratios(get, layers)
    fields["num_hidden_layers"] = layers
    fields["compress_ratios"] = tuple(ratios[:layers] + [0] * max(0, layers - len(ratios)))
    rope_dim = get("qk_rope_head_dim", None)
    if rope_dim is None:
        factor = get("partial_rotary_factor", None)
        if factor is None:
            raise ValueError("hf_config: needs qk_rope_head_dim (or partial_rotary_factor)")
        rope_dim = int(int(_required(get, "head_dim")) * float(factor))
    fields["qk_rope_head_dim"] = int(rope_dim)
    fields["rope_theta"], fields["compress_rope_theta"], fields["rope_scaling"] = _rope(get)
    moe_width = get("moe_intermediate_size", None)
    if moe_width:
        fields["intermediate_size"] = int(moe_width)
    fields["scoring"] = "v4"
    if v41:
        fields.update(_v41_fields(get, fields["compress_ratios"]))
    return fields
