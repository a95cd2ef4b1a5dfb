"""Generate the Python stubs of protos/logprob/v1/logprob.proto into the client package.

protoc writes absolute imports (``from logprob.v1 import logprob_pb2``); they are rewritten
to relative ones so the stubs live inside the ``logprob_proto`` package without touching sys.path.
Run through ``make proto``; tests/client/test_proto_stubs.py calls ``generate`` into a temporary
folder and fails if the committed stubs differ.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
PROTO_FILE = "logprob/v1/logprob.proto"
STUBS_DIR = ROOT / "client" / "logprob_proto"
GENERATED = ("logprob_pb2.py", "logprob_pb2.pyi", "logprob_pb2_grpc.py")
_ABSOLUTE_IMPORT = "from logprob.v1 import logprob_pb2 as"
_RELATIVE_IMPORT = "from . import logprob_pb2 as"


def generate(out_dir: Path) -> list[Path]:
    """Run protoc on the proto and write the three stub files into ``out_dir``."""
    from grpc_tools import protoc  # dev dependency: only needed to (re)generate

    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "grpc_tools.protoc",
            f"-I{PROTO_ROOT}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            PROTO_FILE,
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {PROTO_ROOT / PROTO_FILE}")
        written = []
        for name in GENERATED:
            text = (Path(tmp) / "logprob" / "v1" / name).read_text()
            target = out_dir / name
            target.write_text(text.replace(_ABSOLUTE_IMPORT, _RELATIVE_IMPORT))
            written.append(target)
    return written


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=STUBS_DIR)
    args = parser.parse_args()
    for path in generate(args.out):
        print(f"wrote {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")
    init = args.out / "__init__.py"
    if not init.exists():
        init.write_text('"""Generated gRPC stubs of protos/logprob/v1/logprob.proto (make proto)."""\n')
    return 0


if __name__ == "__main__":
    sys.exit(main())
