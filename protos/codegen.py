"""Generate the Python stubs of protos/*.proto; `--check` fails when the committed stubs drift.

Stubs are made by grpcio-tools 1.84.0 (pinned): the GPU machine runs grpcio 1.84, and stubs from a
newer grpcio-tools refuse to import under an older grpcio.
"""
from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTOS = sorted((ROOT / "protos").glob("*.proto"))


def generate(out_dir: Path) -> list[Path]:
    from grpc_tools import protoc

    files = [str(p.relative_to(ROOT)) for p in PROTOS]
    # -I at the repo root makes the generated modules import each other as `protos.xxx_pb2`.
    rc = protoc.main(["grpc_tools.protoc", f"-I{ROOT}", f"--python_out={out_dir}",
                      f"--pyi_out={out_dir}", f"--grpc_python_out={out_dir}", *files])
    if rc != 0:
        raise SystemExit(f"protoc failed with exit code {rc}")
    return sorted((out_dir / "protos").glob("*_pb2*.py*"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="compare with the committed stubs, write nothing")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        generated = generate(Path(tmp))
        drift = []
        for path in generated:
            committed = ROOT / "protos" / path.name
            if args.check:
                if not committed.exists() or not filecmp.cmp(path, committed, shallow=False):
                    drift.append(path.name)
            else:
                committed.write_bytes(path.read_bytes())
        if drift:
            print(f"stubs out of date: {', '.join(drift)}; run `python -m protos.codegen`", file=sys.stderr)
            return 1
    print("stubs " + ("up to date" if args.check else "written") + f": {', '.join(p.name for p in generated)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
