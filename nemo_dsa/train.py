"""The nemo_dsa training recipe's entry point (the recipe itself lives in ``nemo_dsa.recipe``).

    python -m nemo_dsa.train                        # tiny model, V4 scoring, CPU, 200 steps
    nemo-dsa-train scoring=v41 recipe.max_steps=20  # any Hydra override
    nemo-dsa-train device=cuda model=small recipe=h200
    nemo-dsa-train --print-config scoring=v41       # show the composed, resolved config and exit
    nemo-dsa-train -m scoring=v4,v41 recipe=smoke   # one run per option

Configs are composed from ``configs/`` (``$NEMO_DSA_CONFIG_DIR`` or the checkout root, see
``nemo_dsa.builder.config_dir``). A run holds a lock on ``run_dir`` and writes into it:
``metrics.jsonl`` (train loss, lr, grad norm, tokens/s, validation loss, wall-clock time),
``loss.png``, ``config.yaml``, ``summary.json`` and ``checkpoints/step_XXXXXXX/`` (model weights,
optimizer, scheduler, RNG states, data position, step, recipe, sha256 manifest). Restarting with
the same ``run_dir`` continues from the newest intact checkpoint and reproduces the uninterrupted
run's losses exactly.
"""

from nemo_dsa.recipe import (
    TrainResult,
    build_optimizer,
    evaluate,
    load_config,
    main,
    plot_losses,
    read_metrics,
    train,
    train_step,
    warmup_cosine,
)

__all__ = [
    "TrainResult", "build_optimizer", "evaluate", "load_config", "main", "plot_losses", "read_metrics", "train",
    "train_step", "warmup_cosine",
]

if __name__ == "__main__":
    raise SystemExit(main())
