"""
Regenerate the protobuf and gRPC modules under svcd/pb/ from proto/.

    python tools/genproto.py          # rewrite svcd/pb/auth/v1/*
    python tools/genproto.py --check  # exit 1 if the committed ones are stale

Needs grpcio-tools at the version pinned in setup.py's "test" extra, since
the generated code records the version that made it.
"""

from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parents[1]
PROTO_ROOT = ROOT / "proto"
SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def protoFiles() -> list[Path]:
    return sorted(PROTO_ROOT.rglob("*.proto"))


def generate(outputRoot: Path) -> list[Path]:
    """
    Run protoc for every .proto file into C{outputRoot}; return the
    generated files relative to it.
    """
    sources = [str(path.relative_to(PROTO_ROOT)) for path in protoFiles()]
    status = protoc.main(
        [
            "grpc_tools.protoc",
            f"-I{PROTO_ROOT}",
            f"--python_out={outputRoot}",
            f"--pyi_out={outputRoot}",
            f"--grpc_python_out={outputRoot}",
            *sources,
        ]
    )
    if status != 0:
        raise SystemExit(f"protoc failed with status {status}")
    generated: list[Path] = []
    for source in sources:
        stem = source[: -len(".proto")]
        generated.extend(Path(stem + suffix) for suffix in SUFFIXES)
    return generated


def stale() -> list[Path]:
    """
    The generated files whose committed copy differs from what protoc
    makes now.
    """
    with tempfile.TemporaryDirectory() as scratch:
        fresh = Path(scratch)
        return [
            relative
            for relative in generate(fresh)
            if not (ROOT / relative).exists()
            or not filecmp.cmp(fresh / relative, ROOT / relative, shallow=False)
        ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only report stale files")
    arguments = parser.parse_args()
    if arguments.check:
        outdated = stale()
        for path in outdated:
            sys.stderr.write(f"stale: {path} (run python tools/genproto.py)\n")
        return 1 if outdated else 0
    for path in generate(ROOT):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
