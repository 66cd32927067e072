"""make's set-up check: the test environment holds torch's CPU build and no CUDA libraries.

torch's CUDA build brings gigabytes of nvidia-* wheels that no test here uses; pip takes the
CPU build only while the dev extra's version range matches a +cpu wheel it can find. This
fails loudly the day that stops being so.
"""

from __future__ import annotations

import importlib.metadata
import sys


def main() -> int:
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
