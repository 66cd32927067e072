"""make's set-up check: the test environment holds torch's CPU build and no CUDA libraries.

torch's CUDA build brings gigabytes of nvidia-* wheels that no test here uses; pip takes the
CPU build only while the dev extra's version range matches a +cpu wheel it can find. This
fails loudly the day that stops being so.

``--requirement`` prints the dev extra's torch requirement (from pyproject.toml), which make
installs alone before the rest: resolved with everything else at once, pip took the index's
CUDA build of the same version instead of the local +cpu wheel.
"""

from __future__ import annotations

import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def torch_requirement() -> str:
    dev = tomllib.loads(PYPROJECT.read_text())["project"]["optional-dependencies"]["dev"]
    found = [r for r in dev if re.match(r"torch\b(?![-_.])", r)]
    if len(found) != 1:
        raise SystemExit(f"pyproject.toml: expected one torch requirement in dev, got {found}")
    return found[0]


def main() -> int:
    if sys.argv[1:] == ["--requirement"]:
        print(torch_requirement())
        return 0
    nvidia = sorted(
        {
            dist.metadata["Name"]
            for dist in importlib.metadata.distributions()
            if (dist.metadata["Name"] or "").lower().startswith("nvidia")
        }
    )
    try:
        import torch
    except ImportError:
        print("check_cpu_torch: expected torch (the dev extra installs it), got none")
        return 1
    problems = []
    if torch.version.cuda is not None:
        problems.append(f"torch {torch.__version__} is a CUDA {torch.version.cuda} build")
    if nvidia:
        problems.append(f"CUDA libraries are installed: {', '.join(nvidia)}")
    if problems:
        print(
            "check_cpu_torch: expected torch's CPU build and no nvidia-* packages, got: "
            + "; ".join(problems)
            + ". Install the +cpu wheel (pip install 'torch==<version>+cpu' from a CPU index "
            "or a local wheel) and remove the nvidia-* packages, or recreate the venv.",
            file=sys.stderr,
        )
        return 1
    print(f"check_cpu_torch: torch {torch.__version__}, CPU build, no nvidia-* packages")
    return 0


if __name__ == "__main__":
    sys.exit(main())
