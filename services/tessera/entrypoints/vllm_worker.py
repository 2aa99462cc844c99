"""`tessera worker --engine vllm`: the same gRPC worker (entrypoints/worker.py: Worker service,
grpc.health.v1, Redis registration, drain) around vLLM's async engine (vllm_backend/engine.py).

vLLM lives in its own environment (.venv-vllm, `make setup-vllm`) so its pins never move the
main one. The command re-executes itself (same pid, so a supervisor's signals still reach it) as
`python -m tessera.entrypoints.vllm_main worker ...`, with .venv-vllm's Python when this one has
no vLLM (vllm_main.py: it makes the processes vLLM spawns die with the worker)."""
from __future__ import annotations

import asyncio
import importlib.util
import os
import pathlib
import sys
from dataclasses import dataclass, field

from tessera.config import ConfigError, EngineConfig
from tessera.entrypoints.flags import to_argv
from tessera.generation_defaults import GenerationConfigSource
from tessera.tracing import TracingConfig

VENV = pathlib.Path(__file__).resolve().parents[3] / ".venv-vllm"   # beside .venv in the checkout
MAIN = "tessera.entrypoints.vllm_main"
TCMALLOC = pathlib.Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")


@dataclass(frozen=True)
class EngineChoice:
    engine: str = field(default="native", metadata={
        "choices": ("native", "vllm"),
        "help": "native: Tessera's engine; vllm: vLLM's async engine (`make setup-vllm`; runs from .venv-vllm)"})
    vllm_compile: bool = field(default=False, metadata={
        "help": "vllm: torch.compile the model (start-up ~1.5 min longer on 2 cores); default: eager"})


def main(choice: EngineChoice, config: EngineConfig, host: str, port: int, registration=None,
         metrics_port: int | None = None, shutdown_grace_s: float = 30.0,
         generation: GenerationConfigSource = GenerationConfigSource(),
         tracing: TracingConfig = TracingConfig()) -> int:
    """generation: the defaults the worker reports (the gateway fills unset fields from them;
    vLLM's engine itself applies none, only its HTTP server does). tracing: handed on to the
    re-executed process, which configures its own exporter."""
    if getattr(sys.modules["__main__"].__spec__, "name", None) != MAIN:
        _reexec(choice, config, host, port, registration, metrics_port, shutdown_grace_s, generation, tracing)
    vllm_environment(config.num_threads)
    from tessera.entrypoints.worker import serve
    from tessera.vllm_backend.engine import start

    async def run() -> None:
        engine = start(config, choice.vllm_compile)
        await serve(config, host, port, engine=engine, registration=registration, metrics_port=metrics_port,
                    shutdown_grace_s=shutdown_grace_s, generation=generation)
    asyncio.run(run())
    return 0


def _reexec(choice: EngineChoice, config: EngineConfig, host: str, port: int, registration,
            metrics_port: int | None, grace_s: float, generation: GenerationConfigSource,
            tracing: TracingConfig) -> None:
    """Replace this process with `PYTHON -m tessera.entrypoints.vllm_main worker ...` (the same
    flags), PYTHON being this one when it has vLLM, else .venv-vllm's."""
    python = pathlib.Path(sys.executable) if importlib.util.find_spec("vllm") else VENV / "bin" / "python"
    if not python.exists():
        raise ConfigError(f"--engine vllm needs vLLM's environment {VENV}: run `make setup-vllm`")
    argv = ["worker", *to_argv(config), *to_argv(choice), *to_argv(generation), *to_argv(tracing),
            "--host", host, "--port", str(port),
            "--shutdown-grace-s", f"{grace_s:g}"]
    if registration:
        url, prefix, address = registration
        argv += ["--registry", url, "--registry-prefix", prefix, "--advertise", address]
    if metrics_port:
        argv += ["--metrics-port", str(metrics_port)]
    os.execve(python, [str(python), "-m", MAIN, *argv], dict(os.environ))   # its certificate: $TESSERA_TLS_DIR


def vllm_environment(threads: int | None) -> None:
    """vLLM's settings, before it is imported: offline, its internal traffic on loopback, CPU
    threads (--threads N: N unbound threads, so replicas can share cores; default: bound to every
    core this process may use), and tcmalloc + Intel OpenMP preloaded into the engine processes
    it spawns where they are installed (it runs without them, slower)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    if threads:
        os.environ.update(VLLM_CPU_OMP_THREADS_BIND="nobind", OMP_NUM_THREADS=str(threads))
    elif hasattr(os, "sched_getaffinity"):
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, sorted(os.sched_getaffinity(0)))))
    iomp = pathlib.Path(sys.prefix) / "lib" / "libiomp5.so"     # from the intel-openmp wheel
    preload = [str(p) for p in (TCMALLOC, iomp) if p.exists()]
    if preload and "LD_PRELOAD" not in os.environ:
        os.environ["LD_PRELOAD"] = ":".join(preload)

