"""nemo-automodel's ``train_ft`` recipe on a CPU-only machine: the same recipe and config.

    .venv/bin/python examples/automodel/write_tiny_v4_checkpoint.py --output /tmp/nemo_dsa_tiny_v4
    .venv/bin/python examples/automodel/train_ft_cpu.py --config examples/automodel/deepseek_v4_plugin_tiny_ft.yaml
    .venv/bin/python -m torch.distributed.run --standalone --nproc-per-node 2 examples/automodel/train_ft_cpu.py \
        --config examples/automodel/deepseek_v41_plugin_tiny_pp.yaml      # 2 pipeline stages

nemo-automodel 0.7.0's recipe assumes CUDA in three calls, which fail on a CPU build of torch
(``AttributeError: module 'torch._C' has no attribute '_cuda_resetPeakMemoryStats'``): model
building asks ``torch.cuda.current_device()``, ``setup()`` resets CUDA peak-memory statistics and
``_build_model`` materialises the model on that CUDA device; with pipeline stages
(``distributed.pp_size`` > 1) in two more: the stages are placed on ``cuda:<current device>`` and
their neighbours' warm-up ends in ``torch.cuda.synchronize``. Without a GPU this script stands in
for those (device 0 as a plain number, no statistics to reset, materialise and place the stages on
the CPU, nothing to synchronize) and selects the gloo backend (``--dist_env.backend gloo`` unless
given); everything else is nemo-automodel's own ``train_ft.main``. With a GPU it changes nothing.
Extra arguments are the recipe's own overrides, e.g. ``--step_scheduler.max_steps 4``.

nemo-automodel appends every run's ``training.jsonl`` / ``validation.jsonl`` to its
``checkpoint.checkpoint_dir``: unless ``--checkpoint.checkpoint_dir`` is given, each run here gets its
own new folder under the config's (``<checkpoint_dir>/<UTC time>-<random>``, printed at the start), so
records of unrelated runs never mix.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

import torch


def patch_cuda_only_calls() -> None:
    from nemo_automodel._transformers import auto_model

    torch.cuda.current_device = lambda: 0
    torch.cuda.reset_peak_memory_stats = lambda *args, **kwargs: None
    build = auto_model.apply_model_infrastructure

    def on_cpu(*args, **kwargs):
        kwargs["device"] = torch.device("cpu")
        return build(*args, **kwargs)

    auto_model.apply_model_infrastructure = on_cpu
    torch.cuda.synchronize = lambda *args, **kwargs: None
    infrastructure = auto_model.instantiate_infrastructure

    def stages_on_cpu(*args, **kwargs):
        kwargs["device"] = torch.device("cpu")
        return infrastructure(*args, **kwargs)

    auto_model.instantiate_infrastructure = stages_on_cpu


def own_checkpoint_dir(argv: list[str]) -> list[str]:
    """``argv`` with ``--checkpoint.checkpoint_dir`` set to a new folder under the config's, unless given."""
    import yaml

    if any(arg.startswith("--checkpoint.checkpoint_dir") for arg in argv):
        return argv
    config = next((argv[i + 1] for i, arg in enumerate(argv[:-1]) if arg == "--config"), None)
    if config is None:
        return argv  # train_ft names the missing --config itself
    with open(config) as f:
        base = ((yaml.safe_load(f) or {}).get("checkpoint") or {}).get("checkpoint_dir") or "checkpoints"
    os.makedirs(base, exist_ok=True)
    folder = tempfile.mkdtemp(prefix=time.strftime("%Y%m%d-%H%M%S-", time.gmtime()), dir=base)
    print(f"train_ft_cpu: this run's checkpoints and training.jsonl: {folder}", file=sys.stderr, flush=True)
    return [*argv, "--checkpoint.checkpoint_dir", folder]


def main() -> None:
    from nemo_automodel.recipes.llm import train_ft

    sys.argv[1:] = own_checkpoint_dir(sys.argv[1:])
    if not torch.cuda.is_available():
        patch_cuda_only_calls()
        if not any(arg.startswith("--dist_env.backend") for arg in sys.argv[1:]):
            sys.argv += ["--dist_env.backend", "gloo"]
    train_ft.main()


if __name__ == "__main__":
    main()
