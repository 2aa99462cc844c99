"""Structure the style guide promises: no import cycles among tessera modules (function-local
imports count: they are cycles all the same, only deferred), the plain-Python core (request,
kv_cache, scheduler) imports neither torch nor rpc, and the in-process worker twin, the gRPC
client and the pool satisfy one WorkerClient Protocol (mypy) and serve the gateway alike."""
from __future__ import annotations

import ast
import asyncio
import pathlib
import subprocess
import sys
import textwrap

import httpx
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "services" / "tessera"
PLAIN = ("tessera.request", "tessera.kv_cache", "tessera.scheduler")


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        if "rpc/v1" in path.as_posix():     # generated stubs
            continue
        name = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = path
    return out


def _imports(path: pathlib.Path) -> set[str]:
    """Every module name an import statement anywhere in the file names (incl. `from a import b` as a.b)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return names


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {m: {n for n in _imports(p) if n in modules and n != m} for m, p in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a path of module names, or None (iterative DFS with colours)."""
    state: dict[str, int] = {}
    for root in sorted(graph):
        if root in state:
            continue
        stack, path = [(root, iter(sorted(graph[root])))], [root]
        state[root] = 1
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                state[node] = 2
                stack.pop()
                path.pop()
            elif state.get(child) == 1:
                return path[path.index(child):] + [child]
            elif child not in state:
                state[child] = 1
                stack.append((child, iter(sorted(graph[child]))))
                path.append(child)
    return None


def test_no_import_cycles():
    graph = _graph()
    assert len(graph) > 50 and "tessera.cli" in graph
    cycle = _cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_cycles():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_request_kv_cache_scheduler_import_neither_torch_nor_rpc():
    modules, graph = _modules(), _graph()
    reached, todo = set(PLAIN), list(PLAIN)
    while todo:
        for n in graph[todo.pop()] - reached:
            reached.add(n)
            todo.append(n)
    named = set().union(*(_imports(modules[m]) for m in reached))
    assert not {n for n in named if n.split(".")[0] in ("torch", "grpc") or n.startswith("tessera.rpc")}
    out = subprocess.run([sys.executable, "-c", "import sys; import " + ", ".join(PLAIN) +
                          "; print(sorted(m for m in sys.modules if m.startswith(('torch', 'grpc', 'tessera.rpc'))))"],
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_every_module_imports():
    import importlib
    for name in sorted(_modules()):
        importlib.import_module(name)


def test_worker_clients_satisfy_one_protocol(tmp_path, request):
    """mypy on a file that uses each implementation as a WorkerClient the way the gateway does
    (info(timeout_s=...)); a client with the old info() signature must be refused."""
    pytest.importorskip("mypy")
    (tmp_path / "uses.py").write_text(textwrap.dedent("""
        from tessera.local_client import LocalWorkerClient
        from tessera.rpc.client import GrpcWorkerClient
        from tessera.worker_api import WorkerClient, WorkerInfo
        from tessera.worker_pool import WorkerPool

        async def ready(client: WorkerClient) -> WorkerInfo:
            return await client.info(timeout_s=2.0)

        def all_clients(local: LocalWorkerClient, remote: GrpcWorkerClient, pool: WorkerPool) -> list[WorkerClient]:
            return [local, remote, pool]
    """))
    (tmp_path / "old.py").write_text(textwrap.dedent("""
        from tessera.local_client import LocalWorkerClient
        from tessera.worker_api import WorkerClient, WorkerInfo

        class Old(LocalWorkerClient):
            async def info(self) -> WorkerInfo:  # type: ignore[override]
                raise NotImplementedError

        def client(old: Old) -> WorkerClient:
            return old
    """))
    (tmp_path / "mypy.ini").write_text(textwrap.dedent(f"""
        [mypy]
        mypy_path = {PACKAGE.parent}
        follow_imports = skip
        ignore_missing_imports = True
        [mypy-tessera.*]
        follow_imports = silent
    """))
    cache = request.config.cache.mkdir("mypy")   # kept between runs: the second run takes ~1 s
    out = subprocess.run([sys.executable, "-m", "mypy", "--config-file", "mypy.ini", "--cache-dir", str(cache),
                          "uses.py", "old.py"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    errors = [line for line in out.stdout.splitlines() if ": error:" in line]
    assert errors and all(line.startswith("old.py:") for line in errors), out.stdout
    assert 'variable has type "WorkerClient"' in out.stdout or '"WorkerClient"' in out.stdout, out.stdout


def test_health_ready_on_the_in_process_twin(tiny_models):
    from tessera.async_engine import AsyncEngine
    from tessera.config import CacheConfig, EngineConfig
    from tessera.engine import Engine
    from tessera.entrypoints.gateway.app import create_app
    from tessera.local_client import LocalWorkerClient
    engine = AsyncEngine(Engine(EngineConfig(model=tiny_models["llama"], dtype="float32",
                                             cache=CacheConfig(block_size=4, num_blocks=64))))

    async def main():
        app = create_app(LocalWorkerClient(engine), "tiny")
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
            return await c.get("/health/ready")
    try:
        r = asyncio.run(main())
    finally:
        engine.shutdown()
    assert r.status_code == 200 and r.json() == {"status": "ready"}, r.text
