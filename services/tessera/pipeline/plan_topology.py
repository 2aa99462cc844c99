"""A plan as a topology file `tessera up` runs: one pipeline_shard stage per device, in the
plan's order, with the plan's layer ranges, the device's threads and memory budget, the
plan file for per-layer bits, and engine limits sized for the planned workload (B requests of
s + n tokens), so every stage holds exactly the KV cache the planner counted. Stage 0 waits up to
QUEUE_DELAY_MS for the B requests of a batch to arrive before it prefills (they arrive within
~2.5 ms here): LLM-PQ plans one prefill of all B prompts in micro-batches of ξ, and without
the wait the first request to arrive is prefilled alone, the pipeline filling and draining
once for it and again for the rest."""
from __future__ import annotations

import pathlib

from tessera.pipeline.costmodel import PROFILE_DTYPE
from tessera.pipeline.devices import Device
from tessera.pipeline.plan import Plan

BLOCK = 16
QUEUE_DELAY_MS = 10.0


def plan_topology(plan: Plan, devices: dict[str, Device], plan_file: str | pathlib.Path, model: str,
                  port: int = 8000, name: str | None = None) -> dict:
    blocks = plan.batch * (-(-(plan.prompt_len + plan.gen_len + 1) // BLOCK) + 1)
    stages = [{"layers": f"{s.start}:{s.end}", "threads": devices[s.device].threads or 1,
               "memory_gib": devices[s.device].memory_gib} for s in plan.stages]
    slug = "".join(c if c.isalnum() else "-" for c in plan.method).strip("-")
    return {"name": name or f"pq-{slug}", "model": model, "dtype": PROFILE_DTYPE, "transport": "tcp",
            "roles": {"redis": {"port": port + 50},
                      "pipeline_shard": {"port": port + 1, "plan": str(plan_file), "stages": stages,
                                         "num_kv_blocks": blocks, "max_num_seqs": plan.batch,
                                         "max_queue_delay_ms": QUEUE_DELAY_MS,
                                         "prefill_micro_batch": plan.xi},
                      "gateway": {"port": port}}}
