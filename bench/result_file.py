"""`--out FILE` for the scripts in bench/: take it off the command line before a script reads its
positional arguments, and write the script's rows as a result file (tessera.bench.results, the
schema bench/render.py reads).
"""
from __future__ import annotations

import sys

from tessera.bench import results


def pop_out(argv: list[str] | None = None) -> str | None:
    """Remove `--out FILE` (or `--out=FILE`) from sys.argv (or argv) and return FILE."""
    argv = sys.argv if argv is None else argv
    for i, arg in enumerate(argv):
        if arg == "--out":
            if i + 1 >= len(argv):
                raise SystemExit("--out needs a file name")
            path = argv[i + 1]
            del argv[i:i + 2]
            return path
        if arg.startswith("--out="):
            del argv[i]
            return arg.split("=", 1)[1]
    return None


def save(path: str | None, benchmark: str, title: str, rows: list[dict], **kw) -> None:
    """Write the rows to `path` as a result file (nothing when path is None)."""
    if path:
        written = results.write(path, results.document(benchmark, title, rows, **kw))
        print(f"wrote {written}", file=sys.stderr)
