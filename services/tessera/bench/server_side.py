"""What `tessera bench serve` reads besides the streams, before and after a run: the server's
own per-request timings from its Prometheus /metrics (Tessera's tessera_request_*_time_seconds,
vLLM's vllm:request_*_time_seconds: queue, prefill, decode), and this machine's CPU time and
huge-page splits (/proc/stat, /proc/vmstat), so that a slow run can be told apart from a slow
machine and the client's TTFT split into the engine's share and the rest.
"""
from __future__ import annotations

import asyncio

import httpx

PHASES = ("queue", "prefill", "decode")
# histogram series name -> (phase, 0 for its _sum, 1 for its _count)
_SERIES = {f"{prefix}{phase}_time_seconds{part}": (phase, i) for prefix in ("tessera_request_", "vllm:request_")
           for phase in PHASES for part, i in (("_sum", 0), ("_count", 1))}


async def scrape(client: httpx.AsyncClient, base_url: str) -> dict[str, tuple[float, float]]:
    """{phase: (sum of seconds, count)} over every label set; {} when the server has no
    /metrics or no such histograms (llama.cpp, transformers)."""
    try:
        r = await client.get(base_url + "/metrics")
    except httpx.HTTPError:
        return {}
    if r.status_code != 200:
        return {}
    totals: dict[str, list[float]] = {}
    for line in r.text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        series = _SERIES.get(line.split("{", 1)[0].split(" ", 1)[0])
        if series is not None:
            totals.setdefault(series[0], [0.0, 0.0])[series[1]] += float(line.rsplit(" ", 1)[1])
    return {phase: (s, n) for phase, (s, n) in totals.items()}


def phase_means_ms(before: dict, after: dict) -> dict | None:
    """Mean milliseconds per phase over the requests that finished between the two scrapes."""
    means: dict = {}
    for phase, (s1, n1) in after.items():
        s0, n0 = before.get(phase, (0.0, 0.0))
        if n1 > n0:
            means[phase] = round((s1 - s0) / (n1 - n0) * 1000, 2)
            means["requests"] = min(means.get("requests", int(n1 - n0)), int(n1 - n0))
    return means or None


async def phase_means_after(client: httpx.AsyncClient, base_url: str, before: dict, finished: int) -> dict | None:
    """phase_means_ms once the server counts the `finished` requests (vLLM records its
    histograms after the last token has gone out: up to 2 s of scrapes)."""
    for _ in range(10):
        means = phase_means_ms(before, await scrape(client, base_url))
        if means is None or means["requests"] >= finished:
            return means
        await asyncio.sleep(0.2)
    return means


def machine_counters() -> dict | None:
    """This machine's aggregate CPU times (/proc/stat's first line, in clock ticks: user, nice,
    system, idle, iowait, irq, softirq, steal) and its count of huge pages split back into
    small ones (/proc/vmstat thp_split_pmd); None off Linux."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        with open("/proc/vmstat") as f:
            vmstat = dict(line.split() for line in f)
    except (OSError, ValueError):
        return None
    if not fields or fields[0] != "cpu":
        return None
    return {"cpu": [int(x) for x in fields[1:9]], "thp_split_pmd": int(vmstat.get("thp_split_pmd", 0))}


def machine_delta(before: dict | None, after: dict | None) -> dict | None:
    """Over the run: busy (user + nice + system + irq + softirq), idle (+ iowait) and steal
    (the hypervisor ran something else while this guest wanted to run) as % of CPU time, and
    the huge pages split (a guest's DAMON pageout splits cold 2 MiB pages it cannot swap out:
    the KV cache and weights then cost TLB misses)."""
    if before is None or after is None:
        return None
    d = [b - a for a, b in zip(before["cpu"], after["cpu"])]
    total = sum(d)
    if total <= 0:
        return None
    user, nice, system, idle, iowait, irq, softirq, steal = d
    pct = lambda x: round(100 * x / total, 1)  # noqa: E731
    return {"busy_pct": pct(user + nice + system + irq + softirq), "idle_pct": pct(idle + iowait),
            "steal_pct": pct(steal), "thp_split_pmd": after["thp_split_pmd"] - before["thp_split_pmd"]}
