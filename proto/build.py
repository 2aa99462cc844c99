"""Generate the gRPC stubs from proto/ into services/tessera/rpc/v1/ (gitignored).

Run by the set-up (`make setup`, deploy/setup_vllm.sh) and by CI; the stubs are never committed.
"""
from __future__ import annotations

import pathlib
import sys

from grpc_tools import protoc
import grpc_tools

ROOT = pathlib.Path(__file__).resolve().parent
OUT = ROOT.parent / "services"


def main() -> int:
    protos = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tessera").rglob("*.proto"))
    include = pathlib.Path(grpc_tools.__file__).parent / "_proto"
    args = ["protoc", f"-I{ROOT}", f"-I{include}", f"--python_out={OUT}", f"--pyi_out={OUT}",
            f"--grpc_python_out={OUT}", *protos]
    rc = protoc.main(args)
    if rc != 0:
        print("protoc failed", file=sys.stderr)
        return rc
    pkg = OUT / "tessera" / "rpc" / "v1"
    (pkg / "__init__.py").touch()
    print(f"generated {len(protos)} protos into {pkg}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
