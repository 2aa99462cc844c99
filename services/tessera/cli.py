"""`tessera` command line: serve | up | render | probe | keys add | worker | attention-node | expert-node | gateway |
model init-random | bench engine | bench serve | bench m2n | bench afd | profile | plan afd."""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import pathlib
import signal
import subprocess
import sys
import time

from tessera.config import CacheConfig, EngineConfig, SchedulerConfig


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2", help="'smollm2' (default), an HF directory or a .gguf file")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="auto: bfloat16 where the CPU has AMX/AVX512-BF16, else float32")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--kv-cache-gib", type=float, default=1.0)
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--max-waiting", type=int, default=1024)
    p.add_argument("--threads", type=int, default=None)


def engine_config(a: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=a.model, dtype=a.dtype, max_model_len=a.max_model_len, num_threads=a.threads,
        cache=CacheConfig(block_size=a.block_size, num_blocks=a.num_kv_blocks, kv_cache_gib=a.kv_cache_gib),
        scheduler=SchedulerConfig(max_num_batched_tokens=a.max_num_batched_tokens,
                                  max_num_seqs=a.max_num_seqs, max_waiting=a.max_waiting))


def cmd_worker(a: argparse.Namespace) -> int:
    from tessera.entrypoints.worker import serve
    asyncio.run(serve(engine_config(a), a.host, a.port, registration=_registration(a), metrics_port=a.metrics_port))
    return 0


def _registration(a: argparse.Namespace):
    """(registry url, prefix, advertised address) when the worker should register itself."""
    if not a.registry:
        return None
    return a.registry, a.registry_prefix, a.advertise or f"{a.host}:{a.port}"


def _registry_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--registry", default=os.environ.get("TESSERA_REGISTRY"),
                   help="Redis URL to register in, with heartbeats (default $TESSERA_REGISTRY)")
    p.add_argument("--registry-prefix", default="tessera")
    p.add_argument("--advertise", default=None, help="address others reach this worker at (default host:port)")
    p.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus /metrics on this HTTP port")


def cmd_attention_node(a: argparse.Namespace) -> int:
    from tessera.config import AfdConfig
    from tessera.disagg.attention_node import build_attention_engine
    from tessera.entrypoints.worker import serve
    from tessera.rpc.expert_client import GrpcExpertControl
    config = engine_config(a)
    afd = AfdConfig(name=a.name, expert_nodes=tuple(a.expert), transport=a.transport,
                    micro_batches=a.micro_batches, timeout_s=a.ffn_timeout_s,
                    transport_advertise=a.transport_advertise)
    controls = [GrpcExpertControl(address) for address in afd.expert_nodes]
    asyncio.run(serve(config, a.host, a.port, build=lambda: build_attention_engine(config, afd, controls),
                      role="attention", registration=_registration(a), metrics_port=a.metrics_port))
    return 0


def _expert_set(spec: str) -> tuple[int, ...]:
    """--experts as a usage error, not a traceback, when it does not parse."""
    from tessera.disagg.expert_shard import parse_experts
    try:
        return parse_experts(spec)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def cmd_expert_node(a: argparse.Namespace) -> int:
    from tessera.entrypoints.expert_node import load_expert_node, serve
    if a.threads:
        import torch
        torch.set_num_threads(a.threads)
    try:
        node = load_expert_node(a.model, a.dtype, a.name, a.shard_index, a.shard_count, a.transport,
                                advertise=a.transport_advertise, experts=a.experts)
    except ValueError as e:   # an expert set this model does not have
        print(f"tessera expert-node: {e}", file=sys.stderr)
        return 2
    serve(node, a.host, a.port)
    return 0


def cmd_gateway(a: argparse.Namespace) -> int:
    import uvicorn

    from tessera.entrypoints.gateway.app import create_app
    from tessera.rpc.client import GrpcWorkerClient
    from tessera.worker_pool import WorkerPool

    background = []
    if a.registry:
        from tessera.registry import RedisRegistry
        registry = RedisRegistry(a.registry, prefix=a.registry_prefix)
        record = asyncio.run(_wait_for_registered(a.registry, a.registry_prefix, a.served_model_name, a.wait_s))
        model, workers = record.model, []
        pool = WorkerPool(GrpcWorkerClient, [record.address])
        background.append(lambda: pool.watch(registry, model))
        client, source = pool, f"registry {a.registry}"
    else:
        workers = a.worker or [os.environ.get("TESSERA_WORKER", "127.0.0.1:50051")]
        model = asyncio.run(_wait_for_worker(workers[0], a.wait_s)).model_id
        client = GrpcWorkerClient(workers[0]) if len(workers) == 1 else WorkerPool(GrpcWorkerClient, workers)
        source = ", ".join(workers)
    app = create_app(client, a.served_model_name or model, background, _admission(a))
    print(f"tessera gateway on http://{a.host}:{a.port} -> {source} ({model})", flush=True)
    uvicorn.run(app, host=a.host, port=a.port, log_level="warning", timeout_graceful_shutdown=5)
    return 0


def _admission(a: argparse.Namespace):
    from tessera.entrypoints.gateway.admission import Admission, AdmissionConfig, digest
    keys = [k for k in (a.api_key or []) + os.environ.get("TESSERA_API_KEYS", "").split(",") if k]
    digests = tuple(digest(k) for k in keys) + tuple(a.api_key_sha256 or ())
    config = AdmissionConfig(max_inflight=a.max_inflight, max_body_bytes=a.max_body_bytes,
                             require_key=bool(digests) or a.api_keys_from_redis, key_digests=digests,
                             rpm=a.rpm, tpm=a.tpm)
    if a.api_keys_from_redis and not a.registry:
        raise SystemExit("--api-keys-from-redis needs --registry (the Redis URL)")
    return Admission(config, a.registry, a.registry_prefix)


def cmd_keys_add(a: argparse.Namespace) -> int:
    """Create an API key: its SHA-256 and limits go to Redis; the key is printed once."""
    from tessera.entrypoints.gateway.admission import Admission, AdmissionConfig

    async def add() -> str:
        admission = Admission(AdmissionConfig(), a.registry, a.registry_prefix)
        try:
            return await admission.add_key(a.name, a.rpm, a.tpm)
        finally:
            await admission.close()
    print(asyncio.run(add()))
    return 0


async def _wait_for_registered(url: str, prefix: str, model: str | None, wait_s: float):
    from tessera.registry import RedisRegistry, RegistryUnavailable
    registry = RedisRegistry(url, prefix=prefix)
    deadline = time.monotonic() + wait_s
    try:
        while True:
            try:
                records = await registry.list(model)
                if records:
                    return records[0]
            except RegistryUnavailable:
                pass
            if time.monotonic() > deadline:
                raise SystemExit(f"no worker registered in {url} within {wait_s:.0f} s")
            await asyncio.sleep(0.5)
    finally:
        await registry.close()


async def _wait_for_worker(address: str, wait_s: float):
    from tessera.rpc.client import GrpcWorkerClient
    from tessera.worker_api import WorkerError
    deadline = time.monotonic() + wait_s
    while True:
        client = GrpcWorkerClient(address)
        try:
            return await client.info(timeout_s=2.0)
        except WorkerError:
            if time.monotonic() > deadline:
                raise SystemExit(f"worker at {address} did not answer within {wait_s:.0f} s")
            await asyncio.sleep(0.5)
        finally:
            await client.close()


def cmd_serve(a: argparse.Namespace) -> int:
    """Worker and gateway as two processes; Ctrl-C stops both."""
    worker_addr = f"127.0.0.1:{a.worker_port}"
    argv = [sys.executable, "-m", "tessera.cli", "worker", "--host", "127.0.0.1", "--port", str(a.worker_port)]
    for flag in ("model", "dtype", "max_model_len", "kv_cache_gib", "num_kv_blocks", "block_size",
                 "max_num_seqs", "max_num_batched_tokens", "max_waiting", "threads"):
        value = getattr(a, flag)
        if value is not None:
            argv += [f"--{flag.replace('_', '-')}", str(value)]
    from tessera.deploy.up import supervise, tessera_argv
    worker = subprocess.Popen(argv)
    gateway = subprocess.Popen(tessera_argv(["gateway", "--worker", worker_addr, "--host", a.host,
                                             "--port", str(a.port)]))
    return supervise([worker, gateway])


def cmd_up(a: argparse.Namespace) -> int:
    from tessera.deploy.topology import Topology
    from tessera.deploy.up import up
    return up(Topology.load(a.file).with_overrides(port=a.port, dtype=a.dtype))


def cmd_render(a: argparse.Namespace) -> int:
    from tessera.deploy.render import render
    from tessera.deploy.topology import Topology
    text = render(Topology.load(a.file), a.target, a.file)
    if a.out:
        pathlib.Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(a.out).write_text(text)
    else:
        sys.stdout.write(text)
    return 0


def cmd_probe(a: argparse.Namespace) -> int:
    """Exit 0 when TARGET is healthy: an http(s) URL answering 200, or a gRPC host:port whose
    grpc.health.v1 says SERVING. For container healthchecks."""
    if a.target.startswith(("http://", "https://")):
        import httpx
        try:
            return 0 if httpx.get(a.target, timeout=a.timeout_s).status_code == 200 else 1
        except httpx.HTTPError:
            return 1
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    with grpc.insecure_channel(a.target) as channel:
        try:
            status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                                 timeout=a.timeout_s).status
        except grpc.RpcError:
            return 1
    return 0 if status == health_pb2.HealthCheckResponse.SERVING else 1


def cmd_init_random(a: argparse.Namespace) -> int:
    from tessera.models.random_init import write_random_model
    print(write_random_model(a.arch, a.out, seed=a.seed))
    return 0


def cmd_bench_engine(a: argparse.Namespace) -> int:
    from tessera.bench.engine_bench import main
    return main(a)


def cmd_bench_serve(a: argparse.Namespace) -> int:
    from tessera.bench.serve_bench import main
    return main(a)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tessera", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("serve", help="worker + gateway on the default model")
    _engine_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--worker-port", type=int, default=int(os.environ.get("TESSERA_WORKER_PORT", 50051)))
    p.set_defaults(fn=cmd_serve)
    p = sub.add_parser("up", help="run a topology file's processes here (Ctrl-C stops them all)")
    p.add_argument("file")
    p.add_argument("--port", type=int, default=None, help="gateway port (overrides the file)")
    p.add_argument("--dtype", default=None, choices=["auto", "float32", "bfloat16"])
    p.set_defaults(fn=cmd_up)
    keys = sub.add_parser("keys", help="API keys kept in Redis").add_subparsers(dest="keys_command", required=True)
    p = keys.add_parser("add", help="create a key (printed once; Redis keeps its SHA-256 and limits)")
    p.add_argument("name")
    p.add_argument("--registry", default=os.environ.get("TESSERA_REGISTRY"), required=not os.environ.get("TESSERA_REGISTRY"))
    p.add_argument("--registry-prefix", default="tessera")
    p.add_argument("--rpm", type=int, default=0)
    p.add_argument("--tpm", type=int, default=0)
    p.set_defaults(fn=cmd_keys_add)
    p = sub.add_parser("render", help="docker-compose or Kubernetes files from a topology file")
    p.add_argument("file")
    p.add_argument("--target", required=True, choices=["compose", "k8s"])
    p.add_argument("--out", default=None, help="file to write (default: stdout)")
    p.set_defaults(fn=cmd_render)
    p = sub.add_parser("probe", help="health check for containers: exit 0 when TARGET is healthy")
    p.add_argument("target", help="http(s)://... URL, or a gRPC host:port (grpc.health.v1)")
    p.add_argument("--timeout-s", type=float, default=5.0)
    p.set_defaults(fn=cmd_probe)
    p = sub.add_parser("worker", help="the gRPC worker process")
    _engine_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50051)
    _registry_args(p)
    p.set_defaults(fn=cmd_worker)
    p = sub.add_parser("attention-node", help="AFD: attention, KV cache, router and sampler (a worker)")
    _engine_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50061)
    p.add_argument("--name", default="attention-0", help="endpoint name on the M2N transport")
    p.add_argument("--expert", action="append", required=True, help="expert node gRPC address, in shard order")
    p.add_argument("--transport", default="auto", choices=["auto", "nixl", "tcp"])
    p.add_argument("--transport-advertise", default=None,
                   help="host peers dial for the tcp transport (containers, pods); default loopback")
    p.add_argument("--micro-batches", type=int, default=2, help="ping-pong depth m (1: off)")
    p.add_argument("--ffn-timeout-s", type=float, default=10.0)
    _registry_args(p)
    p.set_defaults(fn=cmd_attention_node)
    p = sub.add_parser("expert-node", help="AFD: a share of every layer's FFN / experts")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50071)
    p.add_argument("--name", default="expert-0", help="endpoint name on the M2N transport")
    p.add_argument("--shard-index", type=int, default=0)
    p.add_argument("--shard-count", type=int, default=1)
    p.add_argument("--experts", default=None, type=_expert_set,
                   help="MoE experts this node holds, e.g. 0,2,4,6 or 0-3 (default: the shard's contiguous range)")
    p.add_argument("--transport", default="auto", choices=["auto", "nixl", "tcp"])
    p.add_argument("--transport-advertise", default=None,
                   help="host peers dial for the tcp transport (containers, pods); default loopback")
    p.add_argument("--threads", type=int, default=None)
    p.set_defaults(fn=cmd_expert_node)
    p = sub.add_parser("gateway", help="the OpenAI-compatible HTTP gateway")
    p.add_argument("--worker", action="append", default=None,
                   help="worker gRPC address (repeat for several; default $TESSERA_WORKER or 127.0.0.1:50051)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--registry", default=os.environ.get("TESSERA_REGISTRY"),
                   help="Redis URL: route to the workers registered there (default $TESSERA_REGISTRY)")
    p.add_argument("--registry-prefix", default="tessera")
    p.add_argument("--wait-s", type=float, default=300.0)
    p.add_argument("--max-inflight", type=int, default=256, help="requests in flight before 503 + Retry-After")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20, help="larger request bodies get 413")
    p.add_argument("--api-key", action="append", default=None,
                   help="accepted API key (repeatable; kept only hashed); also $TESSERA_API_KEYS, comma-separated")
    p.add_argument("--api-key-sha256", action="append", default=None, help="accepted key, as its SHA-256 hex")
    p.add_argument("--api-keys-from-redis", action="store_true",
                   help="also accept keys created by `tessera keys add` (in the registry's Redis)")
    p.add_argument("--rpm", type=int, default=0, help="default requests per minute per key (0: none)")
    p.add_argument("--tpm", type=int, default=0, help="default tokens per minute per key (0: none)")
    p.set_defaults(fn=cmd_gateway)
    model = sub.add_parser("model").add_subparsers(dest="model_command", required=True)
    p = model.add_parser("init-random", help="write a tiny random checkpoint (HF format)")
    p.add_argument("--arch", required=True, choices=["llama", "mixtral", "qwen2_moe", "qwen3_moe"])
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(fn=cmd_init_random)
    bench = sub.add_parser("bench").add_subparsers(dest="bench_command", required=True)
    from tessera.bench.args import add_engine_bench_args, add_serve_bench_args
    p = bench.add_parser("engine", help="offline engine throughput (no HTTP)")
    _engine_args(p)
    add_engine_bench_args(p)
    p.set_defaults(fn=cmd_bench_engine)
    p = bench.add_parser("serve", help="load generator for any OpenAI-compatible server")
    add_serve_bench_args(p)
    p.set_defaults(fn=cmd_bench_serve)
    p = bench.add_parser("m2n", help="M2N transport round trips vs torch.distributed all_to_all (gloo)")
    from tessera.bench import m2n_bench
    m2n_bench.add_args(p)
    p.set_defaults(fn=m2n_bench.main)
    p = bench.add_parser("afd", help="AFD decode throughput for m = 1, 2, 3 vs the monolithic engine")
    from tessera.bench import afd_bench
    afd_bench.add_args(p)
    p.set_defaults(fn=afd_bench.main)
    p = sub.add_parser("profile", help="measure T_a(b), T_e(b), T_c(b), T_o(b) here; write a JSON profile")
    from tessera.disagg import profile
    profile.add_args(p)
    p.set_defaults(fn=profile.main)
    plan = sub.add_parser("plan").add_subparsers(dest="plan_command", required=True)
    p = plan.add_parser("afd", help="MegaScale-Infer plan search (Algorithm 1); writes a topology file")
    from tessera.disagg import plan_cli
    plan_cli.add_args(p)
    p.set_defaults(fn=plan_cli.main)
    return parser


def main(argv: list[str] | None = None) -> int:
    from tessera import logs
    logs.setup()
    args = build_parser().parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
