#!/usr/bin/env bash
# Installs nemo_dsa with its test and nemo-automodel extras into ./.venv (the README's commands
# run .venv/bin/python, so an activated environment does not redirect it), keeping CPU machines
# on the CPU build of torch.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
py=.venv/bin/python
pip=("$py" -m pip install -q --disable-pip-version-check -c requirements/cpu-constraints.txt)
if ! command -v nvidia-smi >/dev/null 2>&1; then
  # Triton without a GPU runs its interpreter: the tests check the Triton kernels' arithmetic with it.
  "${pip[@]}" torch==2.13.0 triton==3.6.0
fi
"${pip[@]}" -e ".[dev]"
"${pip[@]}" -r requirements/automodel-lean.txt
# pip may list nemo-automodel's GPU-only dependencies as missing here: that is intended.
"$py" -m pip install -q --disable-pip-version-check --no-deps nemo-automodel==0.7.0
echo "nemo_dsa installed into $("$py" -c 'import sys; print(sys.prefix)')"
