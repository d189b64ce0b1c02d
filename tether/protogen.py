"""Generate the Python modules in ``tether/v1`` from ``protos/tether/v1/*.proto``.

The generated files are committed so that an install needs no protoc, but they are never edited by
hand: run ``python -m tether.protogen`` after changing a ``.proto`` file. ``--check`` regenerates into
a temporary folder and fails when the committed files differ (the unit test does the same), so stale
code cannot land.
"""

from __future__ import annotations

import argparse
import filecmp
import os
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO_ROOT / "protos"
PACKAGE_DIR = Path("tether") / "v1"
INIT_TEXT = '"""Generated protobuf and gRPC modules for package tether.v1 (see protos/; do not edit)."""\n'


def proto_files() -> list[Path]:
    return sorted((PROTO_ROOT / PACKAGE_DIR).glob("*.proto"))


def generate(out_root: Path) -> list[Path]:
    """Write ``*_pb2.py``, ``*_pb2.pyi`` and ``*_pb2_grpc.py`` under ``out_root/tether/v1``."""
    try:
        import grpc_tools
        from grpc_tools import protoc
    except ImportError as e:  # pragma: no cover - dev dependency
        raise SystemExit("grpcio-tools is missing: pip install -e '.[dev]'") from e
    well_known = Path(grpc_tools.__file__).parent / "_proto"
    out_root.mkdir(parents=True, exist_ok=True)
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{well_known}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *[str(p.relative_to(PROTO_ROOT)) for p in proto_files()],
    ]
    # protoc resolves the file names against -I roots; run it from the proto root.
    cwd = os.getcwd()
    try:
        os.chdir(PROTO_ROOT)
        rc = protoc.main(args)
    finally:
        os.chdir(cwd)
    if rc != 0:
        raise SystemExit(f"protoc failed with exit code {rc}")
    (out_root / PACKAGE_DIR / "__init__.py").write_text(INIT_TEXT)
    return sorted((out_root / PACKAGE_DIR).iterdir())


def stale_files() -> list[str]:
    """Names of generated files that differ from (or are missing in) the committed ``tether/v1``."""
    committed = REPO_ROOT / PACKAGE_DIR
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
        stale = [
            p.name
            for p in fresh
            if not (committed / p.name).exists() or not filecmp.cmp(p, committed / p.name, shallow=False)
        ]
        expected = {p.name for p in fresh}
    extra = [p.name for p in committed.glob("*_pb2*.py*") if p.name not in expected]
    return sorted(stale + extra)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the committed code is stale")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_files()
        if stale:
            print(f"stale generated protobuf code: {', '.join(stale)} — run: python -m tether.protogen")
            return 1
        print("generated protobuf code is up to date")
        return 0
    for stale in (REPO_ROOT / PACKAGE_DIR).glob("*_pb2*.py*"):
        stale.unlink()
    for path in generate(REPO_ROOT):
        print(f"wrote {path.relative_to(REPO_ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
