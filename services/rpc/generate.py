"""Regenerate the gRPC stubs of ``proto/*.proto`` into ``services/rpc/``.

``python -m services.rpc.generate [OUT_ROOT]``: OUT_ROOT defaults to the repository root; the
drift test generates into a temporary root and compares byte for byte with the committed files.
The protos are mapped to the virtual path ``services/rpc/`` so that generated imports read
``from services.rpc import x_pb2`` and work from an installed package.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PROTO_DIR = REPO / "proto"


def generate(out_root: Path) -> list[Path]:
    from grpc_tools import protoc  # test/dev dependency only
    import grpc_tools

    protos = sorted(PROTO_DIR.glob("*.proto"))
    if not protos:
        raise FileNotFoundError(f"no .proto files under {PROTO_DIR}")
    (out_root / "services" / "rpc").mkdir(parents=True, exist_ok=True)
    include = Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-Iservices/rpc={PROTO_DIR}",
        f"-I{include}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *[f"services/rpc/{p.name}" for p in protos],
    ]
    rc = protoc.main(args)
    if rc != 0:
        raise RuntimeError(f"protoc failed with exit code {rc}")
    return sorted((out_root / "services" / "rpc").glob("*_pb2*.py*"))


if __name__ == "__main__":
    root = Path(sys.argv[1]) if len(sys.argv) > 1 else REPO
    for path in generate(root):
        print(path)
