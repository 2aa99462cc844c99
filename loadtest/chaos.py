"""Chaos run: `tessera up FILE` (a topology with two or more worker replicas) under steady
streaming load while a random worker is SIGKILLed 20-40 s after every replica is last ready,
and hostile requests are mixed into the traffic. Talks only to the public API (the official
openai client; raw HTTP for the bodies no client would send).

Every normal request is greedy and float32 (the topology's dtype should be float32), so its
text must equal the text the same prompt got before any fault. Each request ends as one of:
  same       finished with the reference text
  different  finished with other text (a failover that did not continue exactly)
  error      a clear error: an HTTP status with OpenAI error JSON, or an error event in the stream
  lost       no answer: a dropped connection, a timeout, a stream that ended without finishing
Hostile requests must all end as `error` with a 4xx. The workers' RSS is sampled every 10 s.
Exit code 0 when nothing was lost, nothing differed and every hostile request got its 4xx.

    python loadtest/chaos.py deploy/topologies/single.yaml --duration-s 1800 --out chaos.json
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import yaml

PROMPTS = [f"Write a short note about {topic}." for topic in (
    "the harbour at dawn", "a red bicycle", "winter bread", "the last train", "a quiet library",
    "the old lighthouse", "rain on a tin roof", "a paper kite")]
# Bodies an attacker or a broken client sends; each must get a 4xx with OpenAI error JSON.
HOSTILE = [
    ("nan temperature", b'{"model": "M", "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}'),
    ("infinite top_p", b'{"model": "M", "messages": [{"role": "user", "content": "hi"}], "top_p": Infinity}'),
    ("lone surrogate", b'{"model": "M", "messages": [{"role": "user", "content": "\\ud800"}]}'),
    ("superscript logit_bias key", '{"model": "M", "messages": [{"role": "user", "content": "hi"}], '
                                   '"logit_bias": {"\u00b2": 1}}'.encode()),
    ("negative max_tokens", b'{"model": "M", "messages": [{"role": "user", "content": "hi"}], "max_tokens": -5}'),
    ("not json", b'{"model": "M", "messages": ['),
    ("wrong types", b'{"model": "M", "messages": "hello", "n": "two"}'),
    ("huge logit_bias", json.dumps({"model": "M", "messages": [{"role": "user", "content": "hi"}],
                                    "logit_bias": {str(i): 1 for i in range(20000)}}).encode()),
]


class Up:
    """`tessera up FILE` with its output followed: process names -> latest pid, and which workers
    have said they are ready since they were last started (replica i listens on port + i)."""

    def __init__(self, topology: str, worker_port: int) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "tessera.cli", "up", topology, "--shutdown-grace-s", "5"],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=dict(os.environ, TOKENIZERS_PARALLELISM="false"))
        self.pids: dict[str, int] = {}
        self.ready: set[str] = set()
        self.worker_port = worker_port
        self.restarts = 0
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            m = re.search(r": (\S+) pid (\d+)( \(restart)?", line)
            if m:
                self.pids[m[1]] = int(m[2])
                self.ready.discard(m[1])
                self.restarts += bool(m[3])
            m = re.search(r"tessera worker ready on \S+:(\d+)", line)
            if m:
                self.ready.add(f"worker-{int(m[1]) - self.worker_port}")

    def workers(self) -> dict[str, int]:
        return {name: pid for name, pid in self.pids.items() if name.startswith("worker-")}

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


class Tally:
    def __init__(self) -> None:
        self.counts = collections.Counter()
        self.examples: dict[str, list[str]] = collections.defaultdict(list)

    def add(self, kind: str, detail: str = "") -> None:
        self.counts[kind] += 1
        if detail and len(self.examples[kind]) < 5:
            self.examples[kind].append(detail[:300])


async def stream(client: openai.AsyncOpenAI, model: str, prompt: str, max_tokens: int) -> tuple[str, str]:
    """(kind, text or what went wrong) of one streamed greedy request."""
    try:
        text, finished = "", None
        response = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0,
            stream=True)
        async for chunk in response:
            for choice in chunk.choices:
                text += choice.delta.content or ""
                finished = choice.finish_reason or finished
        return ("done", text) if finished else ("lost", f"stream ended without a finish_reason after {text!r}")
    except openai.APIStatusError as e:
        clear = isinstance(e.body, dict) and ("message" in e.body or "error" in e.body)
        return ("error" if clear else "lost"), f"{e.status_code} {e.body}"
    except (openai.APIConnectionError, openai.APITimeoutError, httpx.HTTPError, asyncio.TimeoutError) as e:
        return "lost", repr(e)      # (before APIError: these are APIErrors too)
    except openai.APIError as e:    # an error event inside the stream: a clear error
        return "error", repr(e)


async def hostile(http: httpx.AsyncClient, model: str, name: str, body: bytes) -> tuple[str, str]:
    try:
        r = await http.post("/v1/chat/completions", content=body.replace(b'"M"', json.dumps(model).encode()),
                            headers={"content-type": "application/json"})
    except httpx.HTTPError as e:
        return "lost", f"{name}: {e!r}"
    clear = r.headers.get("content-type", "").startswith("application/json") and "error" in r.json()
    return ("error" if 400 <= r.status_code < 500 and clear else "accepted"), f"{name}: {r.status_code} {r.text[:200]}"


def rss_mib(pid: int) -> float | None:
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


async def _ready(http: httpx.AsyncClient, up: Up, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if (await http.get("/health/ready")).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline or up.proc.poll() is not None:
            raise RuntimeError("the deployment never became ready")
        await asyncio.sleep(1)


async def _reference(client: openai.AsyncOpenAI, model: str, max_tokens: int) -> dict[str, str]:
    """Each prompt's text before any fault."""
    reference = {}
    for p in PROMPTS:
        kind, text = await stream(client, model, p, max_tokens)
        if kind != "done":
            raise RuntimeError(f"the reference request failed: {text}")
        reference[p] = text
    return reference


async def run(a: argparse.Namespace) -> dict:
    spec = yaml.safe_load(open(a.topology))
    base = f"http://127.0.0.1:{spec['roles']['gateway']['port']}"
    replicas = int(spec["roles"]["worker"].get("replicas", 1))
    up = Up(a.topology, int(spec["roles"]["worker"]["port"]))
    rng = random.Random(a.seed)
    normal, bad, kills, rss = Tally(), Tally(), [], []
    try:
        async with httpx.AsyncClient(base_url=base, timeout=a.timeout_s) as http:
            await _ready(http, up, a.startup_timeout_s)
            client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=a.timeout_s)
            model = (await client.models.list()).data[0].id
            reference = await _reference(client, model, a.max_tokens)
            stop_at = time.monotonic() + a.duration_s

            async def user(i: int) -> None:
                while time.monotonic() < stop_at:
                    p = PROMPTS[(i + normal.counts.total()) % len(PROMPTS)]
                    kind, text = await stream(client, model, p, a.max_tokens)
                    if kind == "done":
                        kind = "same" if text == reference[p] else "different"
                        text = f"{p!r}: {text!r} != {reference[p]!r}" if kind == "different" else ""
                    normal.add(kind, text)

            async def attacker() -> None:
                while time.monotonic() < stop_at:
                    name, body = rng.choice(HOSTILE)
                    bad.add(*await hostile(http, model, name, body))
                    await asyncio.sleep(rng.uniform(0.5, 2.0))

            async def killer() -> None:
                while True:
                    # the interval starts once every replica is back: one is always up when the next dies
                    while len(up.ready) < replicas and time.monotonic() < stop_at:
                        await asyncio.sleep(0.2)
                    await asyncio.sleep(rng.uniform(a.kill_min_s, a.kill_max_s))
                    if time.monotonic() >= stop_at:
                        return
                    name, pid = rng.choice(sorted(up.workers().items()))
                    try:
                        os.kill(pid, signal.SIGKILL)
                        kills.append({"t_s": round(a.duration_s - (stop_at - time.monotonic()), 1), "worker": name})
                    except ProcessLookupError:
                        pass

            async def sampler() -> None:
                t0 = time.monotonic()
                while time.monotonic() < stop_at:
                    rss.append({"t_s": round(time.monotonic() - t0), **{n: rss_mib(p) for n, p in up.workers().items()}})
                    await asyncio.sleep(10)

            await asyncio.gather(*(user(i) for i in range(a.concurrency)), attacker(), killer(), sampler())
            await client.close()
    finally:
        code = up.stop()
    return {"duration_s": a.duration_s, "concurrency": a.concurrency, "max_tokens": a.max_tokens,
            "sent": normal.counts.total() + bad.counts.total(), "normal": dict(normal.counts),
            "hostile": dict(bad.counts), "lost": normal.counts["lost"] + bad.counts["lost"],
            "kills": kills, "restarts": up.restarts, "up_exit_code": code, "rss_mib": rss,
            "examples": {**{f"normal {k}": v for k, v in normal.examples.items()},
                         **{f"hostile {k}": v for k, v in bad.examples.items()}}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("topology", help="a topology file with two or more worker replicas (dtype float32)")
    p.add_argument("--duration-s", type=float, default=180.0)
    p.add_argument("--concurrency", type=int, default=4, help="streaming users at once")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--kill-min-s", type=float, default=20.0)
    p.add_argument("--kill-max-s", type=float, default=40.0)
    p.add_argument("--timeout-s", type=float, default=120.0, help="longest a request may take before it counts as lost")
    p.add_argument("--startup-timeout-s", type=float, default=300.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the report (JSON) here")
    a = p.parse_args(argv)
    report = asyncio.run(run(a))
    text = json.dumps(report, indent=1)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    print(json.dumps({k: v for k, v in report.items() if k not in ("rss_mib", "examples")}))
    ok = report["lost"] == 0 and not report["normal"].get("different") and not report["hostile"].get("accepted")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
