"""loadtest/chaos.py as CI runs it: `tessera up` with two float32 workers of a tiny random
model under streaming load, a worker SIGKILLed 10-20 s after both are ready, hostile requests
mixed in, for $TESSERA_CHAOS_S seconds (default 60: at least two kills): nothing lost, every
finished stream's text equal to the fault-free reference, clear errors rare, every hostile
request a 4xx with OpenAI error JSON."""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
import yaml

from servers import free_port, free_port_range

pytestmark = pytest.mark.e2e
ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_chaos_run_loses_nothing(tiny_models, tmp_path):
    duration = float(os.environ.get("TESSERA_CHAOS_S", "60"))
    kill_max_s, restart_s = 20.0, 10.0    # restart_s: a generous bound on a tiny worker's restart
    topology = tmp_path / "chaos.yaml"
    topology.write_text(yaml.safe_dump({"name": "chaos", "model": tiny_models["llama"], "dtype": "float32", "roles": {
        "redis": {"port": 6379}, "worker": {"replicas": 2, "port": free_port_range(2), "num_kv_blocks": 256},
        "gateway": {"port": free_port()}}}))
    out = tmp_path / "chaos.json"
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}    # `tessera up` starts its own Redis
    run = subprocess.run([sys.executable, str(ROOT / "loadtest/chaos.py"), str(topology), "--duration-s",
                          str(duration), "--kill-min-s", "10", "--kill-max-s", str(kill_max_s), "--out", str(out)],
                         env=env, capture_output=True, text=True, timeout=duration + 420)
    report = json.loads(out.read_text())
    assert run.returncode == 0, (run.stdout[-2000:], report.get("examples"))
    assert report["lost"] == 0 and report["normal"]["same"] > 0 and "different" not in report["normal"]
    # with one replica always up, a kill costs at most a rare clear error, never a run of them
    assert report["normal"].get("error", 0) <= 0.02 * report["normal"]["same"], report["examples"]
    assert report["hostile"].get("error", 0) > 0 and "accepted" not in report["hostile"]
    assert len(report["kills"]) >= int(duration // (kill_max_s + restart_s))
    assert report["restarts"] >= len(report["kills"]) - 1
    assert report["up_exit_code"] == 0
