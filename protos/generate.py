"""Generate the Python gRPC stubs for every .proto under protos/ into the repository root.

`protos/arceus/v1/stage.proto` (package arceus.v1) becomes `arceus/v1/stage_pb2.py` and
`arceus/v1/stage_pb2_grpc.py`, importable as `arceus.v1`. The output is git-ignored: run this
script (the Makefile does) instead of editing generated code.
"""

from __future__ import annotations

import sys
from pathlib import Path

from grpc_tools import protoc

PROTO_ROOT = Path(__file__).resolve().parent
REPO_ROOT = PROTO_ROOT.parent


def main() -> int:
    sources = sorted(str(p.relative_to(PROTO_ROOT)) for p in PROTO_ROOT.rglob("*.proto"))
    if not sources:
        print("no .proto files under protos/", file=sys.stderr)
        return 1
    include = str(Path(protoc.__file__).parent / "_proto")
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={REPO_ROOT}",
        f"--pyi_out={REPO_ROOT}",
        f"--grpc_python_out={REPO_ROOT}",
        *sources,
    ]
    code = protoc.main(args)
    if code != 0:
        print(f"protoc failed with exit code {code}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
