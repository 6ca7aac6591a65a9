"""The training recipe, one concern per module (the layers contract in pyproject.toml orders them):

- ``schema``: the ``recipe``, ``data``, ``tokenizer`` and ``logger`` config schemas (Hydra ConfigStore),
  composition, value rules, what a resume may change
- ``optim``: AdamW and the warmup + cosine schedule
- ``parallel``: the data-parallel (FSDP2) x context-parallel set-up and the stalled-collective message
- ``files``: atomic writes, durable appends, the run-directory lock
- ``state``: train state and checksummed checkpoints (full tensors, whatever the number of ranks)
- ``metrics``: ``metrics.jsonl``, ``summary.json``, ``loss.png``, TensorBoard scalars
- ``data_sources``: the embedded corpus, text / JSONL files, offline ``datasets``; byte or HF tokenizer
- ``loop``: the step, evaluation, resume and the run
- ``cli``: the ``nemo-dsa-train`` entry point
- ``inference``, ``commands``: generation and evaluation from a run (``nemo-dsa-generate``, ``nemo-dsa-evaluate``)
"""

from nemo_dsa.recipe.cli import main
from nemo_dsa.recipe.loop import TrainResult, evaluate, train, train_step
from nemo_dsa.recipe.metrics import plot_losses, read_metrics
from nemo_dsa.recipe.optim import build_optimizer, warmup_cosine
from nemo_dsa.recipe.schema import RecipeConfig, check_recipe, load_config

__all__ = [
    "RecipeConfig", "TrainResult", "build_optimizer", "check_recipe", "evaluate", "load_config", "main",
    "plot_losses", "read_metrics", "train", "train_step", "warmup_cosine",
]
