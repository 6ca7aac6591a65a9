"""``python -m nemo_dsa.evaluate`` / ``nemo-dsa-evaluate``: loss and perplexity of a run's checkpoint.

    python -m nemo_dsa.evaluate run_dir=runs/tiny-v4-default            # the run's validation batches
    python -m nemo_dsa.evaluate run_dir=... split=all data=jsonl 'data.paths=[eval.jsonl]'

The data config defaults to the run's own (``data=<option>`` and ``data.*`` pick another); the
sequence length, split rule and tokenizer are the run's (``nemo_dsa.recipe.commands``).
"""

from nemo_dsa.recipe.commands import evaluate_main as main

__all__ = ["main"]

if __name__ == "__main__":
    raise SystemExit(main())
