"""Compile proto/kvtier/v1/*.proto into client/kvtier/v1/ (committed; tests/test_proto_current.py
checks the committed modules match this output).

Usage: python proto/generate.py [OUTPUT_ROOT]   (default: client/)
"""

from __future__ import annotations

import sys
from pathlib import Path

from grpc_tools import protoc

PROTO_ROOT = Path(__file__).resolve().parent
REPO_ROOT = PROTO_ROOT.parent


def generate(output_root: Path) -> list[Path]:
    sources = sorted(PROTO_ROOT.glob("kvtier/v1/*.proto"))
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"--python_out={output_root}",
        f"--pyi_out={output_root}",
        f"--grpc_python_out={output_root}",
        *[str(s.relative_to(PROTO_ROOT)) for s in sources],
    ]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed")
    package_dir = output_root / "kvtier" / "v1"
    return sorted(p for p in package_dir.iterdir() if p.name.startswith("kvtier_pb2"))


if __name__ == "__main__":
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else REPO_ROOT / "client"
    (out / "kvtier" / "v1").mkdir(parents=True, exist_ok=True)
    for path in generate(out):
        print(path)
