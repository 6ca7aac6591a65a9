"""``python -m nemo_dsa.export`` / ``nemo-dsa-export``: a run's checkpoint as an HF-format folder.

    python -m nemo_dsa.export run_dir=runs/tiny-v4-default out=exports/tiny-v4
    python -m nemo_dsa.export run_dir=... out=... checkpoint=runs/.../checkpoints/step_0000100

The folder (``config.json`` + ``model.safetensors``) is what ``init_from=``, transformers
(``AutoConfig`` with ``nemo_dsa.integrations.automodel`` imported) and nemo-automodel
(``NeMoAutoModelForCausalLM.from_pretrained``) read (``nemo_dsa.recipe.weights``).
"""

from nemo_dsa.recipe.commands import export_main as main

__all__ = ["main"]

if __name__ == "__main__":
    raise SystemExit(main())
