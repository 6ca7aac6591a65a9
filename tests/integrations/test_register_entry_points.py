"""scripts/register_entry_points.py: a source checkout's architectures become discoverable."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_written_dist_info_exposes_every_architecture(tmp_path):
    spec = importlib.util.spec_from_file_location("register_entry_points", REPO / "scripts" / "register_entry_points.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.write_dist_info(tmp_path)
    # A fresh interpreter that sees only tmp_path's metadata (not the venv's installed copy).
    code = (
        "import sys; from importlib.metadata import MetadataPathFinder, DistributionFinder\n"
        f"ctx = DistributionFinder.Context(path=[{str(tmp_path)!r}])\n"
        "dists = list(MetadataPathFinder.find_distributions(ctx))\n"
        "eps = [e for d in dists for e in d.entry_points if e.group == 'nemo_automodel.architectures']\n"
        "print(sorted((e.name, e.value) for e in eps))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    for name in ("NemoDsaDeepseekV4ForCausalLM", "NemoDsaDeepseekV41ForCausalLM"):
        assert name in out, out
    assert "nemo_dsa.integrations.deepseek_v4:NemoDsaDeepseekV4ForCausalLM" in out
