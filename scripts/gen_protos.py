"""Regenerate the committed protobuf/gRPC code from protos/ (the only way it is produced).

    python scripts/gen_protos.py           # write services/common/pb/
    python scripts/gen_protos.py --check   # exit 1 if the committed code is stale

protoc writes absolute imports (`from strata.v1 import engine_pb2`); they are rewritten to
point inside `services.common.pb` so the generated modules need no sys.path tricks.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
OUT = ROOT / "services" / "common" / "pb"
PACKAGE = "services.common.pb"


def generate(out_dir: Path) -> None:
    from grpc_tools import protoc  # test-only dependency

    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in PROTO_ROOT.rglob("*.proto"))
    include = Path(protoc.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *protos,
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    for path in out_dir.rglob("*.py*"):
        text = path.read_text()
        text = re.sub(r"^from strata\.v1 import", f"from {PACKAGE}.strata.v1 import", text, flags=re.M)
        path.write_text(text)
    for pkg in {p.parent for p in out_dir.rglob("*_pb2.py")} | {out_dir / "strata"}:
        (pkg / "__init__.py").touch()


def snapshot(directory: Path) -> dict[str, str]:
    return {
        str(p.relative_to(directory)): p.read_text()
        for p in sorted(directory.rglob("*"))
        if p.is_file() and "__pycache__" not in p.parts and p.name != "__init__.py"
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if committed code is stale")
    args = parser.parse_args()
    if not args.check:
        generate(OUT)
        print(f"generated {len(snapshot(OUT))} files under {OUT.relative_to(ROOT)}")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        fresh, committed = snapshot(Path(tmp)), snapshot(OUT)
    stale = sorted(k for k in fresh.keys() | committed.keys() if fresh.get(k) != committed.get(k))
    if stale:
        print("generated code is stale; run `python scripts/gen_protos.py`:", *stale, sep="\n  ")
        return 1
    print("generated code is up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
