"""What `tessera bench serve` reads besides the streams, before and after a run: the server's
own per-request timings from its Prometheus /metrics (Tessera's tessera_request_*_time_seconds,
vLLM's vllm:request_*_time_seconds: queue, prefill, decode), and how this machine's CPU time
was spent (/proc/stat), so that a slow run can be told apart from a slow machine (a
hypervisor's steal time) and the client's TTFT split into the engine's share and the rest.
"""
from __future__ import annotations

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
            means["requests"] = int(n1 - n0)
    return means or None


def cpu_times() -> list[int] | None:
    """The machine's aggregate CPU times (/proc/stat's first line, in clock ticks): user,
    nice, system, idle, iowait, irq, softirq, steal; None off Linux."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    return [int(x) for x in fields[1:9]] if fields and fields[0] == "cpu" else None


def cpu_split_pct(before: list[int] | None, after: list[int] | None) -> dict | None:
    """Busy (user + nice + system + irq + softirq), idle (+ iowait) and steal (the time the
    hypervisor ran something else while this guest wanted to run) as % of the interval."""
    if before is None or after is None:
        return None
    d = [b - a for a, b in zip(before, after)]
    total = sum(d)
    if total <= 0:
        return None
    user, nice, system, idle, iowait, irq, softirq, steal = d
    pct = lambda x: round(100 * x / total, 1)  # noqa: E731
    return {"busy": pct(user + nice + system + irq + softirq), "idle": pct(idle + iowait), "steal": pct(steal)}
