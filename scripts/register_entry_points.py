"""Make a source checkout's entry points visible without installing it.

nemo-automodel finds the nemo_dsa architectures through the ``nemo_automodel.architectures``
entry point, which exists only for an installed package. On a machine that puts the checkout on
PYTHONPATH instead (no package index to install from), this writes a minimal
``nemo_dsa-<version>.dist-info`` with pyproject.toml's entry points into a directory on the path:

    python3 scripts/register_entry_points.py /tmp/dsa-site
"""

from __future__ import annotations

import argparse
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def write_dist_info(site: Path) -> Path:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    groups = dict(project.get("entry-points", {}))
    if "scripts" in project:
        groups["console_scripts"] = project["scripts"]
    dist_info = site / f"nemo_dsa-{project['version']}.dist-info"
    dist_info.mkdir(parents=True, exist_ok=True)
    (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n")
    lines = []
    for group, entries in groups.items():
        lines.append(f"[{group}]")
        lines += [f"{name} = {target}" for name, target in entries.items()]
        lines.append("")
    (dist_info / "entry_points.txt").write_text("\n".join(lines))
    return dist_info


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("site", type=Path, help="a directory on PYTHONPATH")
    args = parser.parse_args()
    if not args.site.is_dir():
        sys.exit(f"site must be an existing directory on PYTHONPATH, got {args.site}")
    print(write_dist_info(args.site))


if __name__ == "__main__":
    main()
