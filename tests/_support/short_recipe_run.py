"""The recipe's smoke run shortened to 4 steps of 2 x 32 tokens (checkpoints and validation every
2 steps, one thread, no plot), and the repository root its processes run from."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SHORT = ["recipe=smoke", "recipe.seq_len=32", "recipe.batch_size=2", "recipe.max_steps=4", "recipe.ckpt_every=2",
         "recipe.val_every=2", "recipe.num_threads=1", "recipe.plot=false"]
