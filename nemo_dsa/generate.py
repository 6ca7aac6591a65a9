"""``python -m nemo_dsa.generate`` / ``nemo-dsa-generate``: text from a training run's checkpoint.

    python -m nemo_dsa.generate run_dir=runs/tiny-v4-default prompt="json.dumps(" max_new_tokens=80
    python -m nemo_dsa.generate run_dir=... prompt=... temperature=0.8 top_k=40 top_p=0.95 seed=3

Greedy by default (``temperature=0``); sampling is seeded. The model, its weights and the
tokenizer come from ``run_dir`` (``nemo_dsa.recipe.commands`` lists every key).
"""

from nemo_dsa.recipe.commands import generate_main as main

__all__ = ["main"]

if __name__ == "__main__":
    raise SystemExit(main())
