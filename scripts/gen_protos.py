"""Regenerate client/_proto from proto/ (the one way generated code is made).

python scripts/gen_protos.py          # rewrite client/_proto
python scripts/gen_protos.py --check  # fail if the committed code differs
"""

from __future__ import annotations

import argparse
import filecmp
import re
import shutil
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
OUT = ROOT / "client" / "_proto"
PROTOS = ["recorder/v1/recorder.proto"]


def generate(dest: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "protoc",
            f"-I{PROTO_ROOT}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            *[str(PROTO_ROOT / p) for p in PROTOS],
        ]
        if protoc.main(args) != 0:
            raise SystemExit("protoc failed")
        dest.mkdir(parents=True, exist_ok=True)
        for src in sorted(Path(tmp).rglob("*.py*")):
            text = src.read_text()
            # Generated code imports its siblings by proto package path; make it
            # relative so the code lives privately inside recorder_client.
            text = re.sub(r"^from recorder\.v1 import", "from . import", text, flags=re.M)
            (dest / src.name).write_text(text)
        (dest / "__init__.py").write_text('"""Generated protobuf code; do not edit."""\n')


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    args = parser.parse_args()
    if not args.check:
        if OUT.exists():
            shutil.rmtree(OUT)
        generate(OUT)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        fresh = Path(tmp) / "_proto"
        generate(fresh)
        cmp = filecmp.dircmp(fresh, OUT, ignore=["__pycache__"])
        stale = cmp.diff_files + cmp.left_only + cmp.right_only
        if stale:
            print(f"generated code is stale: {sorted(stale)}; run scripts/gen_protos.py")
            return 1
    print("generated code is up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
