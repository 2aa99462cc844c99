"""`tessera serve`: a worker and a gateway in front of it, as two processes under a Supervisor
(deploy/supervisor.py): a worker that dies is restarted while the gateway keeps running, and
SIGTERM / Ctrl-C drains both. Each process gets its settings as the flags that rebuild the
same config dataclasses (flags.to_argv), so `serve`, `worker` and `gateway` cannot drift apart.
With --speculative (and no --draft-address) a draft worker runs beside them and the worker
drafts through it (disaggregated speculative decoding); each gets one thread, and the draft
its own core where there are two. The processes talk over mutual TLS on loopback too: a
throwaway CA and a certificate per process are made at start in a private directory, so no
other local user's process can call the worker or pose as it."""
from __future__ import annotations

import os
import pathlib
import tempfile
from dataclasses import replace

from tessera.chat_config import ChatConfig
from tessera.config import ConfigError, EngineConfig
from tessera.deploy.supervisor import Child, Supervisor, SupervisorConfig, tessera_argv
from tessera.entrypoints.draft_worker import TARGET_ONLY_FIELDS
from tessera.entrypoints.flags import to_argv
from tessera.entrypoints.gateway.admission import AdmissionConfig
from tessera.entrypoints.gateway.main import ADMISSION_FLAGS, GatewayConfig
from tessera.generation_defaults import GenerationConfigSource
from tessera.mtls import ENV as TLS_ENV
from tessera.mtls.certs import write_role_dirs
from tessera.tracing import TracingConfig

# GatewayConfig fields `serve` sets itself rather than taking as flags.
GATEWAY_FIELDS_SET_BY_SERVE = ("worker", "registry", "registry_prefix", "shutdown_grace_s")


def process_args(engine: EngineConfig, gateway: GatewayConfig, admission: AdmissionConfig, worker_port: int,
                 grace_s: float, draft_port: int | None = None,
                 generation: GenerationConfigSource = GenerationConfigSource(),
                 chat: ChatConfig = ChatConfig(), tracing: TracingConfig = TracingConfig()) -> tuple[list[str], list[str]]:
    """The `tessera worker ...` and `tessera gateway ...` arguments; with draft_port the
    worker drafts through the draft worker there, on one thread unless --threads says otherwise;
    each sends its traces where `tracing` says."""
    if admission.keys_from_redis:
        raise ConfigError("serve runs no Redis: keys from Redis need `tessera up` with a redis role")
    if draft_port is not None:
        engine = replace(engine, num_threads=engine.num_threads or 1, speculative=replace(
            engine.speculative, draft_address=f"127.0.0.1:{draft_port}"))
    worker = ["worker", "--host", "127.0.0.1", "--port", str(worker_port), *to_argv(engine), *to_argv(generation),
              *to_argv(chat),
              "--shutdown-grace-s", f"{grace_s:g}", *to_argv(tracing)]
    gateway = replace(gateway, worker=(f"127.0.0.1:{worker_port}",), shutdown_grace_s=grace_s)
    return worker, ["gateway", *to_argv(gateway), *to_argv(admission, **ADMISSION_FLAGS), *to_argv(tracing)]


def draft_worker_args(engine: EngineConfig, draft_port: int, grace_s: float,
                      tracing: TracingConfig = TracingConfig()) -> list[str]:
    """The `tessera draft-worker ...` arguments: one thread, pinned to the last core this
    process may use when it may use two or more (the target takes the other)."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    pin = ["--cpu", str(cores[-1])] if len(cores) >= 2 else []
    length = ["--max-model-len", str(engine.max_model_len)] if engine.max_model_len else []
    return ["draft-worker", "--host", "127.0.0.1", "--port", str(draft_port), "--model", engine.model,
            "--dtype", engine.dtype, *length, *to_argv(engine.speculative, exclude=TARGET_ONLY_FIELDS),
            "--threads", "1", *pin, "--shutdown-grace-s", f"{grace_s:g}", *to_argv(tracing)]


def main(engine: EngineConfig, gateway: GatewayConfig, admission: AdmissionConfig, worker_port: int,
         supervisor: SupervisorConfig = SupervisorConfig(), draft_port: int = 50081, certs: str | None = None,
         generation: GenerationConfigSource = GenerationConfigSource(), chat: ChatConfig = ChatConfig(),
         tracing: TracingConfig = TracingConfig()) -> int:
    grace = supervisor.shutdown_grace_s
    # A draft worker of our own unless --draft-address names one (or the drafter is prompt
    # lookup, which needs no model and stays in the target); the target decodes plainly while
    # it is down, so it is not essential.
    spec = engine.speculative
    if spec.draft_address:
        raise ConfigError("--draft-address: serve's processes hold certificates of a CA made at start, which no "
                          "draft worker elsewhere holds; run both under `tessera up` (a draft_worker role)")
    own_draft = spec.draft not in (None, "ngram")
    worker_args, gateway_args = process_args(engine, gateway, admission, worker_port, grace,
                                             draft_port if own_draft else None, generation, chat, tracing)
    with tempfile.TemporaryDirectory(prefix="tessera-serve-") as scratch:
        roles = ("worker", "gateway", "draft-worker")    # certs: a tool (a test) that calls them too
        tls = {r: pathlib.Path(certs) / r for r in roles} if certs else write_role_dirs(scratch, "serve", roles)
        children = [Child("draft-worker-0", "draft_worker",
                          tessera_argv(draft_worker_args(engine, draft_port, grace, tracing)), essential=False,
                          env={TLS_ENV: str(tls["draft-worker"])})] if own_draft else []
        children += [Child("worker-0", "worker", tessera_argv(worker_args), env={TLS_ENV: str(tls["worker"])}),
                     Child("gateway-0", "gateway", tessera_argv(gateway_args), env={TLS_ENV: str(tls["gateway"])})]
        return Supervisor(children, supervisor, "tessera serve").run()
