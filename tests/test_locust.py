"""A short headless locust run (4 users, 20 s) with loadtest/locustfile.py against
`tessera up deploy/topologies/single.yaml` (its own redis-server, two registered SmolLM2
workers, the gateway): zero failures, and the TTFT/ITL custom metrics are reported."""
from __future__ import annotations

import csv
import os
import pathlib
import shutil
import subprocess
import sys

import pytest
import yaml

from servers import free_port, free_port_range, tessera_up

pytestmark = pytest.mark.e2e
ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_headless_locust_against_single_topology(tmp_path):
    spec = yaml.safe_load((ROOT / "deploy/topologies/single.yaml").read_text())
    spec["roles"]["worker"]["port"] = free_port_range(spec["roles"]["worker"]["replicas"])
    spec["roles"]["gateway"]["port"] = free_port()
    topology = tmp_path / "single.yaml"
    topology.write_text(yaml.safe_dump(spec))
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}   # `tessera up` starts its own Redis
    with tessera_up(str(topology), env=env) as url:
        locust = shutil.which("locust", path=os.path.dirname(sys.executable)) or "locust"
        run = subprocess.run([locust, "-f", str(ROOT / "loadtest/locustfile.py"), "--headless", "--host", url,
                              "-u", "4", "-r", "4", "-t", "20s", "--stop-timeout", "60", "--csv", str(tmp_path / "run"), "--only-summary"],
                             capture_output=True, text=True, timeout=240,
                             env=dict(os.environ, TESSERA_MAX_TOKENS="16"))
    assert run.returncode == 0, run.stderr[-3000:]
    rows = list(csv.DictReader(open(tmp_path / "run_stats.csv")))
    total = next(r for r in rows if r["Name"] == "Aggregated")
    chats = [r for r in rows if r["Type"] == "POST"]
    metrics = {r["Name"].split(" ")[0] for r in rows if r["Type"] == "metric"}
    assert int(total["Failure Count"]) == 0
    # Each user finishes at least the chat it started (--stop-timeout lets it end): a count,
    # not a throughput, so a busy CI machine cannot fail it.
    assert sum(int(r["Request Count"]) for r in chats) >= 4
    assert metrics == {"TTFT", "ITL"}
    ttft = [r for r in rows if r["Name"].startswith("TTFT")]
    print(f"\n[figures] locust 4 users 20 s: {sum(int(r['Request Count']) for r in chats)} chats, "
          f"{total['Failure Count']} failures; TTFT median ms by kind "
          f"{ {r['Name']: r['50%'] for r in ttft} }")
