"""Build a DSA model from the YAML configs and train it on the offline stdlib-docstring corpus.

    python examples/train.py                                  # tiny model, V4 scoring, CPU
    python examples/train.py scoring=v41 recipe.max_steps=50  # any Hydra override
    python examples/train.py device=cuda model=small recipe=h200

A thin walk through ``nemo_dsa.train``: compose ``configs/train.yaml`` (defaults: model=tiny,
scoring=v4, recipe=default), show what the YAML builds, then run the recipe. Outputs
(metrics.jsonl, loss.png, checkpoints/) land in ``run_dir``; rerunning resumes.
"""

from __future__ import annotations

import sys

from hydra.utils import instantiate
from omegaconf import OmegaConf

from nemo_dsa.train import load_config, train


def main(overrides: list[str]) -> None:
    cfg = load_config(overrides)
    print(OmegaConf.to_yaml(cfg.model, resolve=True))
    model = instantiate(cfg.model)  # nemo_dsa.builder.build_model(config=..., scoring=...)
    roles = [layer.attn.role for layer in model.layers]
    print(f"{cfg.model.name}: {sum(p.numel() for p in model.parameters()):,} parameters, "
          f"scoring {model.config.scoring}, layer roles {roles}")
    del model  # train() builds its own from the same node, seeded identically

    result = train(cfg)
    val = "n/a" if result.val_loss is None else f"{result.val_loss:.4f}"
    print(f"done: step {result.step}, validation loss {val}, outputs in {result.run_dir}")


if __name__ == "__main__":
    main(sys.argv[1:])
