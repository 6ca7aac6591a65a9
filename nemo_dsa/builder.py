"""Build DSA models from Hydra/OmegaConf nodes.

A model node (``configs/model/*.yaml``) names this module's ``build_model`` as its ``_target_``
and carries the ``DSAModelConfig`` fields under ``config``; the scoring node
(``configs/scoring/{v4,v41}.yaml``) is interpolated into it, so one override (``scoring=v41``)
switches every indexer layer. Every mistake is reported at build time with the offending key.

The config directory is ``$NEMO_DSA_CONFIG_DIR`` when set, otherwise ``configs/`` at the root of
the checkout that ``nemo_dsa`` is imported from (``scripts/install.sh`` installs the package in
editable mode, so that directory is always beside the code).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from nemo_dsa._checks import check_device, is_positive_int
from nemo_dsa.models.dsa_lm.configuration import SCORINGS, DSAModelConfig
from nemo_dsa.models.dsa_lm.layer_roles import derive_v41_layer_roles
from nemo_dsa.ops.v41_indexer.heads import largest_supported_heads

CONFIG_DIR_ENV = "NEMO_DSA_CONFIG_DIR"
_SCORING_KEYS = {
    "name", "scoring", "indexer_kl_coef", "index_heads_power_of_two", "layer_roles",
    "candidate_topk_blocks", "candidate_block_size",
}
_ROLE_KEYS = {"kv_source_every", "index_source_every", "candidate_source"}
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def config_dir() -> Path:
    """The Hydra config directory: ``$NEMO_DSA_CONFIG_DIR`` or ``<checkout>/configs``."""
    env = os.environ.get(CONFIG_DIR_ENV)
    path = Path(env) if env else Path(__file__).resolve().parents[1] / "configs"
    if not (path / "train.yaml").is_file():
        how = f"${CONFIG_DIR_ENV}={env}" if env else f"the checkout root ({path})"
        raise FileNotFoundError(
            f"no nemo_dsa config directory with train.yaml at {how}; set {CONFIG_DIR_ENV} to the "
            "repository's configs/ directory (or install nemo_dsa editable with scripts/install.sh)"
        )
    return path


def load_config_node(group: str, option: str) -> dict:
    """One option of a config group as a plain dict, e.g. ``load_config_node("model", "tiny")``
    (interpolations such as ``${scoring}`` are left unresolved)."""
    from omegaconf import OmegaConf

    path = config_dir() / group / f"{option}.yaml"
    if not path.is_file():
        options = sorted(p.stem for p in (config_dir() / group).glob("*.yaml"))
        raise ValueError(f"{group}={option!r} does not exist; options: {options}")
    return OmegaConf.to_container(OmegaConf.load(path), resolve=False)


def _plain(node: Any) -> Any:
    """OmegaConf containers -> plain Python (dicts, lists); other values unchanged."""
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf
    except ImportError:  # pragma: no cover - omegaconf is a dependency
        return node
    if isinstance(node, (DictConfig, ListConfig)):
        return OmegaConf.to_container(node, resolve=True)
    return node


def build_model_config(config: Mapping | DSAModelConfig, scoring: Mapping | str | None = None) -> DSAModelConfig:
    """Merge a model node's ``config`` with a scoring node into a validated ``DSAModelConfig``.

    ``scoring`` is a scoring node (see ``configs/scoring/``), a bare ``"v4"``/``"v41"``, or None
    (keep the model's). Raises ``ValueError`` naming the offending key.
    """
    if isinstance(config, DSAModelConfig):
        fields = config.to_dict()
    else:
        config = _plain(config)
        if not isinstance(config, Mapping):
            raise TypeError(f"model.config must be a mapping of DSAModelConfig fields, got {type(config).__name__}")
        fields = dict(config)
    known = {f.name for f in dataclasses.fields(DSAModelConfig)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ValueError(f"model.config has unknown key(s) {unknown}; DSAModelConfig fields are {sorted(known)}")

    scoring = _plain(scoring)
    if isinstance(scoring, str):
        scoring = {"scoring": scoring}
    if scoring is not None:
        if not isinstance(scoring, Mapping):
            raise TypeError(f"scoring must be a scoring node, 'v4' or 'v41', got {type(scoring).__name__}")
        _apply_scoring(fields, scoring)
    try:
        cfg = DSAModelConfig(**fields)
    except ValueError as err:
        raise ValueError(f"model.config: {err}") from None
    except TypeError as err:
        raise TypeError(f"model.config: {err}") from None
    return cfg


def _apply_scoring(fields: dict, scoring: Mapping) -> None:
    unknown = sorted(set(scoring) - _SCORING_KEYS)
    if unknown:
        raise ValueError(f"scoring has unknown key(s) {unknown}; known keys are {sorted(_SCORING_KEYS)}")
    mode = scoring.get("scoring")
    if mode not in SCORINGS:
        raise ValueError(f"scoring.scoring must be one of {SCORINGS}, got {mode!r}")
    if fields.get("scoring") not in (None, mode):
        # The scoring group chooses the mode; a model.config value that disagrees would be lost.
        raise ValueError(
            f"model.config.scoring={fields['scoring']!r} disagrees with the scoring group ({mode!r}): "
            f"choose it with scoring={fields['scoring']} instead"
        )
    fields["scoring"] = mode
    if scoring.get("indexer_kl_coef") is not None:
        fields["indexer_kl_coef"] = float(scoring["indexer_kl_coef"])
    if mode != "v41":
        return
    if scoring.get("index_heads_power_of_two", False):
        # V4.1's fused scorer and MXFP4 path want power-of-two head counts (<= 128): round down.
        heads = int(fields.get("index_n_heads", DSAModelConfig.index_n_heads))
        if heads < 1:
            raise ValueError(f"model.config.index_n_heads must be >= 1, got {heads}")
        fields["index_n_heads"] = largest_supported_heads(heads)
    for key in ("candidate_topk_blocks", "candidate_block_size"):
        if scoring.get(key) is not None:
            value = scoring[key]
            if not is_positive_int(value):
                raise ValueError(f"scoring.{key} must be an int >= 1, got {value!r}")
            fields[key] = value
    roles = scoring.get("layer_roles")
    explicit = any(fields.get(k) is not None for k in ("kv_source_layer_ids", "index_source_layer_ids"))
    if roles is None or explicit:
        return  # explicit ids in the model config win over the derived schedule
    if not isinstance(roles, Mapping):
        raise TypeError(f"scoring.layer_roles must be a mapping, got {type(roles).__name__}")
    unknown = sorted(set(roles) - _ROLE_KEYS)
    if unknown:
        raise ValueError(f"scoring.layer_roles has unknown key(s) {unknown}; known keys are {sorted(_ROLE_KEYS)}")
    ratios = tuple(int(r) for r in fields.get("compress_ratios", DSAModelConfig.compress_ratios))
    kv, index, candidate = derive_v41_layer_roles(ratios, **roles)
    fields["kv_source_layer_ids"], fields["index_source_layer_ids"] = kv, index
    if fields.get("candidate_source_layer_id", -1) == -1:
        fields["candidate_source_layer_id"] = candidate


def build_model(
    config: Mapping | DSAModelConfig,
    scoring: Mapping | str | None = None,
    *,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype | None = None,
    seed: int | None = None,
    name: str | None = None,
) -> torch.nn.Module:
    """Build a ``DSAForCausalLM`` (the Hydra ``_target_`` of ``configs/model/*.yaml``).

    ``device="meta"`` builds without allocating weights (used for the full-size configs).
    ``seed`` makes the initialisation reproducible without touching the global RNG.
    ``name`` is the preset's name, kept on the model as ``model.preset_name``.
    """
    device = check_device("device", device)
    cfg = build_model_config(config, scoring)
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ValueError(f"model.dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
        dtype = _DTYPES[dtype]
    from nemo_dsa.models.dsa_lm.modeling import DSAForCausalLM

    with torch.random.fork_rng(devices=[]):
        if seed is not None:
            torch.manual_seed(int(seed))
        with torch.device(device):
            model = DSAForCausalLM(cfg)
    if dtype is not None:
        model = model.to(dtype)
    model.preset_name = name
    return model
