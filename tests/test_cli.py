"""The command line: init-random writes a loadable checkpoint; bench engine prints its rows."""
from __future__ import annotations

import json
import subprocess
import sys


def tessera(*args: str) -> str:
    return subprocess.run([sys.executable, "-m", "tessera.cli", *args], capture_output=True, text=True,
                          timeout=600, check=True).stdout


def test_init_random_and_bench_engine(tmp_path):
    out = tmp_path / "moe"
    tessera("model", "init-random", "--arch", "mixtral", "--out", str(out), "--seed", "3")
    assert (out / "config.json").exists() and (out / "model.safetensors").exists()
    rows = json.loads(tessera("bench", "engine", "--model", str(out), "--batch-sizes", "1,3",
                              "--input-len", "8", "--output-len", "4", "--hf-reference", "2",
                              "--hf-dtype", "float32", "--json"))
    assert [(r["impl"], r["batch"]) for r in rows] == [("tessera", 1), ("tessera", 3), ("transformers", 2)]
    assert all(r["output_tok_s"] > 0 for r in rows)


def test_expert_node_refuses_bad_expert_sets_with_a_clear_error():
    for spec, error in (("1,1", "names an expert twice"), ("0-x", "write ids and ranges"),
                        ("3,9", "outside the model's 8 experts")):
        out = subprocess.run([sys.executable, "-m", "tessera.cli", "expert-node", "--model", "random:mixtral",
                              "--experts", spec], capture_output=True, text=True, timeout=300)
        assert out.returncode == 2 and error in out.stderr and "Traceback" not in out.stderr, out.stderr
