"""Generate the Python protobuf and gRPC modules (and .pyi type stubs for the messages) from
proto/flywheel/v1 into an output folder.

Usage: python tools/gen_proto.py [OUT_DIR]   (default: services/flywheel/_proto)

Generated modules import each other as `flywheel._proto.<name>_pb2`.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parents[1]
PROTO_DIR = ROOT / "proto" / "flywheel" / "v1"
DEFAULT_OUT = ROOT / "services" / "flywheel" / "_proto"
_IMPORT = re.compile(r"^import (\w+_pb2) as (\w+)$", re.MULTILINE)


def generate(out_dir: Path) -> list[Path]:
    """Run protoc on every .proto and rewrite sibling imports; returns the written files."""
    out_dir.mkdir(parents=True, exist_ok=True)
    protos = sorted(PROTO_DIR.glob("*.proto"))
    include = Path(protoc.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{PROTO_DIR}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *[str(p) for p in protos],
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {PROTO_DIR}")
    written = []
    for path in sorted([*out_dir.glob("*_pb2*.py"), *out_dir.glob("*_pb2*.pyi")]):
        text = _IMPORT.sub(r"from flywheel._proto import \1 as \2", path.read_text())
        path.write_text(text)
        written.append(path)
    init = out_dir / "__init__.py"
    init.write_text('"""Generated from proto/flywheel/v1 by tools/gen_proto.py; do not edit."""\n')
    written.append(init)
    return written


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_OUT
    for f in generate(target):
        print(f.relative_to(target.parent) if f.is_relative_to(target.parent) else f)
