"""`tessera` command line (`tessera --help` lists the commands; COMMANDS below is the table).

Only argument parsing: each command builds its configs and calls its entrypoint
(entrypoints/<role>.py, deploy/, bench/, disagg/, pipeline/). Config flags are generated from the
frozen config dataclasses (entrypoints/flags.py), so `serve`, `worker` and `gateway` share them.
A command's flags are built only when it is the one run (the gateway's import FastAPI).
"""
from __future__ import annotations

import argparse
import functools
import os
import sys

from tessera.chat_config import ChatConfig
from tessera.config import AfdConfig, ConfigError, EngineConfig, SpeculativeConfig
from tessera.deploy.supervisor import SupervisorConfig
from tessera.entrypoints.flags import add_flags, from_args
from tessera.generation_defaults import GenerationConfigSource
from tessera.pipeline.stages import StageConfig
from tessera.tracing import TracingConfig

DTYPES = ["auto", "float32", "bfloat16"]
ONE_PROCESS_TRACING = ("trace_replica",)    # TracingConfig fields serve and up set per process themselves


def _tracing(a: argparse.Namespace) -> None:
    """Traces of a serving process (tracing.SERVICE_NAMES) when a receiver is named."""
    from tessera import tracing
    if a.command in tracing.SERVICE_NAMES:
        t = from_args(TracingConfig, a)
        tracing.configure(a.command, t.otlp_traces_endpoint, replica=t.trace_replica, stage=getattr(a, "stage", None),
                          level=t.trace_level)


def _registration(a: argparse.Namespace):
    """(registry url, prefix, advertised address) when the worker should register itself."""
    if not a.registry:
        return None
    return a.registry, a.registry_prefix, a.advertise or f"{a.host}:{a.port}"


def _gateway_configs(a: argparse.Namespace, exclude=()):
    from tessera.entrypoints.gateway.admission import AdmissionConfig
    from tessera.entrypoints.gateway.main import ADMISSION_FLAGS, GatewayConfig, with_keys
    gateway = from_args(GatewayConfig, a, exclude=exclude)
    admission = from_args(AdmissionConfig, a, **ADMISSION_FLAGS)
    return gateway, with_keys(admission, a.api_key)


def cmd_serve(a: argparse.Namespace) -> int:
    from tessera.entrypoints.serve import GATEWAY_FIELDS_SET_BY_SERVE, main
    gateway, admission = _gateway_configs(a, exclude=GATEWAY_FIELDS_SET_BY_SERVE)
    return main(from_args(EngineConfig, a), gateway, admission, a.worker_port, from_args(SupervisorConfig, a),
                a.draft_port, a.certs, from_args(GenerationConfigSource, a), from_args(ChatConfig, a),
                from_args(TracingConfig, a, exclude=ONE_PROCESS_TRACING))


def cmd_gateway(a: argparse.Namespace) -> int:
    from tessera.entrypoints.gateway.main import main
    return main(*_gateway_configs(a))


def cmd_worker(a: argparse.Namespace) -> int:
    from tessera.entrypoints import vllm_worker, worker
    choice = from_args(vllm_worker.EngineChoice, a)   # --engine vllm: vLLM's engine, from .venv-vllm
    generation = from_args(GenerationConfigSource, a)
    if choice.engine == "vllm":
        _without_chat_flags(a, "--engine vllm")
        # the tracing flags too: the process vLLM's worker re-executes as configures its own exporter
        run = functools.partial(vllm_worker.main, choice, generation=generation, tracing=from_args(TracingConfig, a))
    else:
        run = functools.partial(worker.main, generation=generation, chat=from_args(ChatConfig, a))
    return run(from_args(EngineConfig, a), a.host, a.port, _registration(a), a.metrics_port, a.shutdown_grace_s)


def cmd_target_worker(a: argparse.Namespace) -> int:
    """A worker that verifies the draft trees of its draft worker (it registers as a worker)."""
    spec = from_args(EngineConfig, a).speculative
    if spec.draft is None or not spec.draft_address:
        raise ConfigError("a target worker needs --speculative and --draft-address (its draft worker)")
    return cmd_worker(a)


def cmd_attention_node(a: argparse.Namespace) -> int:
    from tessera.entrypoints.attention_node import main
    afd = AfdConfig(name=a.name, expert_nodes=tuple(a.expert), transport=a.transport,
                    micro_batches=a.micro_batches, timeout_s=a.ffn_timeout_s,
                    transport_advertise=a.transport_advertise)
    return main(from_args(EngineConfig, a), afd, a.host, a.port, _registration(a), a.metrics_port,
                a.shutdown_grace_s)


def cmd_expert_node(a: argparse.Namespace) -> int:
    from tessera.entrypoints.expert_node import main
    return main(a.model, a.dtype, a.name, a.shard_index, a.shard_count, a.transport, a.host, a.port,
                a.transport_advertise, a.experts, a.threads, a.shutdown_grace_s)


def cmd_draft_worker(a: argparse.Namespace) -> int:
    from tessera.entrypoints.draft_worker import main
    from tessera.entrypoints.draft_worker import TARGET_ONLY_FIELDS
    spec = from_args(SpeculativeConfig, a, exclude=TARGET_ONLY_FIELDS)
    return main(spec, a.model, a.dtype, a.max_model_len, a.host, a.port, a.threads, a.cpu, _registration(a),
                a.metrics_port, a.shutdown_grace_s)


def _without_chat_flags(a: argparse.Namespace, where: str) -> None:
    """A process that would not apply --chat-template / --tool-call-parser refuses them rather
    than serve without them."""
    if from_args(ChatConfig, a) != ChatConfig():
        raise ConfigError(f"--chat-template, --tool-call-parser: not supported with {where} yet")


def cmd_pipeline_shard(a: argparse.Namespace) -> int:
    from tessera.entrypoints.pipeline_shard import main
    _without_chat_flags(a, "pipeline-shard")
    return main(from_args(EngineConfig, a), from_args(StageConfig, a), a.host, a.port, _registration(a),
                a.metrics_port, a.shutdown_grace_s)


def cmd_up(a: argparse.Namespace) -> int:
    from tessera.deploy.topology import Topology
    from tessera.deploy.up import up
    tracing = from_args(TracingConfig, a, exclude=ONE_PROCESS_TRACING)
    return up(Topology.load(a.file).with_overrides(port=a.port, dtype=a.dtype,
                                                   otlp_traces_endpoint=tracing.otlp_traces_endpoint,
                                                   trace_level=tracing.trace_level),
              from_args(SupervisorConfig, a), certs=a.certs)


def _lazy(module: str, name: str):
    """module.name, imported when called: a command imports only what it runs."""
    def call(arg):
        import importlib
        return getattr(importlib.import_module(module), name)(arg)
    return call


def cmd_render(a: argparse.Namespace) -> int:
    import pathlib

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
    from tessera.entrypoints.probe import main
    return main(a.target, a.timeout_s)


def cmd_keys_add(a: argparse.Namespace) -> int:
    from tessera.entrypoints.gateway.main import keys_add
    return keys_add(a.registry, a.registry_prefix, a.name, a.rpm, a.tpm)


def cmd_init_random(a: argparse.Namespace) -> int:
    from tessera.models.random_init import write_random_model
    print(write_random_model(a.arch, a.out, seed=a.seed))
    return 0


def _address_args(p: argparse.ArgumentParser, port: int) -> None:
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=port)
    p.add_argument("--shutdown-grace-s", type=float, default=30.0,
                   help="on SIGTERM / Ctrl-C: time in-flight requests get to finish (default: 30.0)")
    add_flags(p, TracingConfig)


def _registry_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--registry", default=os.environ.get("TESSERA_REGISTRY"),
                   help="Redis URL to register in, with heartbeats (default $TESSERA_REGISTRY)")
    p.add_argument("--registry-prefix", default="tessera")
    p.add_argument("--advertise", default=None, help="address others reach this worker at (default host:port)")
    p.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus /metrics on this HTTP port")


def _transport_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--transport", default="auto", choices=["auto", "nixl", "tcp"])
    p.add_argument("--transport-advertise", default=None,
                   help="host peers dial for the tcp transport (containers, pods); default loopback")


def _gateway_flags(p: argparse.ArgumentParser, exclude=()) -> None:
    from tessera.entrypoints.gateway.admission import AdmissionConfig
    from tessera.entrypoints.gateway.main import ADMISSION_FLAGS, GatewayConfig
    add_flags(p, GatewayConfig, exclude=exclude)
    add_flags(p, AdmissionConfig, **ADMISSION_FLAGS)
    p.add_argument("--api-key", action="append", default=None,
                   help="accepted API key (repeatable; kept only hashed); also $TESSERA_API_KEYS, comma-separated")


def _gateway_args(p: argparse.ArgumentParser) -> None:
    _gateway_flags(p)
    add_flags(p, TracingConfig)


def _serve_args(p: argparse.ArgumentParser) -> None:
    from tessera.entrypoints.serve import GATEWAY_FIELDS_SET_BY_SERVE
    add_flags(p, EngineConfig)
    add_flags(p, GenerationConfigSource)
    add_flags(p, ChatConfig)
    _gateway_flags(p, exclude=GATEWAY_FIELDS_SET_BY_SERVE)
    p.add_argument("--worker-port", type=int, default=int(os.environ.get("TESSERA_WORKER_PORT", 50051)))
    p.add_argument("--draft-port", type=int, default=int(os.environ.get("TESSERA_DRAFT_PORT", 50081)),
                   help="with --speculative (and no --draft-address): the draft worker's port (default: 50081)")
    p.add_argument("--certs", help="role directories (worker, gateway, draft-worker) of deployment 'serve' (default: new)")
    add_flags(p, SupervisorConfig)
    add_flags(p, TracingConfig, exclude=ONE_PROCESS_TRACING)


def _up_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("file")
    p.add_argument("--port", type=int, default=None, help="gateway port (overrides the file)")
    p.add_argument("--dtype", default=None, choices=DTYPES)
    p.add_argument("--certs", default=None,
                   help="certificate directories from `tessera certs FILE --out DIR` (default: a throwaway CA "
                        "made at start)")
    add_flags(p, SupervisorConfig)
    add_flags(p, TracingConfig, exclude=ONE_PROCESS_TRACING)


def _keys_add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("name")
    p.add_argument("--registry", default=os.environ.get("TESSERA_REGISTRY"), required=not os.environ.get("TESSERA_REGISTRY"))
    p.add_argument("--registry-prefix", default="tessera")
    p.add_argument("--rpm", type=int, default=None, help="requests per minute (0: unlimited; default: the gateway's --rpm)")
    p.add_argument("--tpm", type=int, default=None, help="tokens per minute (0: unlimited; default: the gateway's --tpm)")


def _render_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("file")
    p.add_argument("--target", required=True, choices=["compose", "k8s"])
    p.add_argument("--out", default=None, help="file to write (default: stdout)")


def _probe_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("target", help="http(s)://... URL, or a gRPC host:port (grpc.health.v1)")
    p.add_argument("--timeout-s", type=float, default=5.0)


def _worker_args(p: argparse.ArgumentParser) -> None:
    add_flags(p, EngineConfig)
    add_flags(p, GenerationConfigSource)
    add_flags(p, ChatConfig)
    _address_args(p, 50051)
    _registry_args(p)


def _plain_worker_args(p: argparse.ArgumentParser) -> None:
    from tessera.entrypoints.vllm_worker import EngineChoice
    _worker_args(p)
    add_flags(p, EngineChoice)


def _attention_node_args(p: argparse.ArgumentParser) -> None:
    add_flags(p, EngineConfig)
    _address_args(p, 50061)
    p.add_argument("--name", default="attention-0", help="endpoint name on the M2N transport")
    p.add_argument("--expert", action="append", required=True, help="expert node gRPC address, in shard order")
    _transport_args(p)
    p.add_argument("--micro-batches", type=int, default=2, help="ping-pong depth m (1: off)")
    p.add_argument("--ffn-timeout-s", type=float, default=10.0)
    _registry_args(p)


def _expert_set(spec: str) -> tuple[int, ...]:
    """--experts as a usage error, not a traceback, when it does not parse."""
    from tessera.disagg.expert_shard import parse_experts
    try:
        return parse_experts(spec)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _expert_node_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="auto", choices=DTYPES)
    _address_args(p, 50071)
    p.add_argument("--name", default="expert-0", help="endpoint name on the M2N transport")
    p.add_argument("--shard-index", type=int, default=0)
    p.add_argument("--shard-count", type=int, default=1)
    p.add_argument("--experts", default=None, type=_expert_set,
                   help="MoE experts this node holds, e.g. 0,2,4,6 or 0-3 (default: the shard's contiguous range)")
    _transport_args(p)
    p.add_argument("--threads", type=int, default=None)


def _draft_worker_args(p: argparse.ArgumentParser) -> None:
    from tessera.entrypoints.draft_worker import TARGET_ONLY_FIELDS
    p.add_argument("--model", default="smollm2", help="the target model (a self:K draft runs its first K layers)")
    p.add_argument("--dtype", default="auto", choices=DTYPES)
    p.add_argument("--max-model-len", type=int, default=None, help="longest sequence (default: the draft model's)")
    add_flags(p, SpeculativeConfig, exclude=TARGET_ONLY_FIELDS)
    _address_args(p, 50081)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default: 1)")
    p.add_argument("--cpu", type=int, default=None, help="pin this process to this CPU core (Linux)")
    _registry_args(p)


def _pipeline_shard_args(p: argparse.ArgumentParser) -> None:
    _worker_args(p)   # engine flags (stage 0's; a later stage reads model, dtype, quantization, cache, threads)
    add_flags(p, StageConfig)


def _init_random_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--arch", required=True, choices=["llama", "mixtral", "qwen2_moe", "qwen3_moe"])
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)


def _bench_engine_args(p: argparse.ArgumentParser) -> None:
    from tessera.bench.args import add_engine_bench_args
    add_flags(p, EngineConfig)
    add_engine_bench_args(p)


def _bench_serve_args(p: argparse.ArgumentParser) -> None:
    from tessera.bench.args import add_serve_bench_args
    add_serve_bench_args(p)


def _module_command(module: str):
    """(add_args, run) of a module that defines both (the bench, profile and plan tools)."""
    import importlib

    def add_args(p: argparse.ArgumentParser) -> None:
        mod = importlib.import_module(module)
        mod.add_args(p)
        p.set_defaults(fn=mod.main)
    return add_args, None


# (group, command): (help, add_args, run)
COMMANDS = {
    ("serve",): ("worker + gateway on the default model (+ a draft worker with --speculative), restarted if "
                 "they die", _serve_args, cmd_serve),
    ("up",): ("run a topology file's processes here, restarted if they die (Ctrl-C drains them)",
              _up_args, cmd_up),
    ("keys", "add"): ("create a key (printed once; Redis keeps its SHA-256 and limits)", _keys_add_args,
                      cmd_keys_add),
    ("render",): ("docker-compose or Kubernetes files from a topology file", _render_args, cmd_render),
    ("certs",): ("a deployment's CA and one certificate per role (internal mutual TLS), for compose or "
                 "Kubernetes", _lazy("tessera.entrypoints.certs", "add_args"),
                 _lazy("tessera.entrypoints.certs", "run")),
    ("probe",): ("health check for containers: exit 0 when TARGET is healthy", _probe_args, cmd_probe),
    ("worker",): ("the gRPC worker process (--engine vllm: vLLM's engine)", _plain_worker_args, cmd_worker),
    ("attention-node",): ("AFD: attention, KV cache, router and sampler (a worker)", _attention_node_args,
                          cmd_attention_node),
    ("expert-node",): ("AFD: a share of every layer's FFN / experts", _expert_node_args, cmd_expert_node),
    ("target-worker",): ("speculative decoding: a worker verifying the trees of its --draft-address",
                         _worker_args, cmd_target_worker),
    ("draft-worker",): ("speculative decoding: drafts trees for a target worker's --draft-address",
                        _draft_worker_args, cmd_draft_worker),
    ("draft", "distill"): ("speculative decoding: distil a small draft model from the target (an HF "
                           "checkpoint for --speculative DIR)", *_module_command("tessera.entrypoints.draft_distill")),
    ("pipeline-shard",): ("LLM-PQ pipeline: a stage holding layers START:END (stage 0: the worker, linking the "
                          "others)", _pipeline_shard_args, cmd_pipeline_shard),
    ("gateway",): ("the OpenAI-compatible HTTP gateway", _gateway_args, cmd_gateway),
    ("run-batch",): ("an OpenAI batch file offline: in this process, or against a deployment's --url",
                     *_module_command("tessera.entrypoints.run_batch")),
    ("model", "init-random"): ("write a tiny random checkpoint (HF format)", _init_random_args, cmd_init_random),
    ("bench", "engine"): ("offline engine throughput (no HTTP)", _bench_engine_args,
                          _lazy("tessera.bench.engine_bench", "main")),
    ("bench", "serve"): ("load generator for any OpenAI-compatible server", _bench_serve_args,
                         _lazy("tessera.bench.serve_bench", "main")),
    ("bench", "m2n"): ("M2N transport round trips vs torch.distributed all_to_all (gloo)",
                       *_module_command("tessera.bench.m2n_bench")),
    ("bench", "afd"): ("AFD decode throughput for m = 1, 2, 3 vs the monolithic engine",
                       *_module_command("tessera.bench.afd_bench")),
    ("bench", "make-llama1b"): ("write the 1B-class benchmark checkpoint: Llama 3.2 1B's architecture, SmolLM2's "
                                "vocabulary, random bf16 weights", *_module_command("tessera.bench.llama1b")),
    ("bench", "roofline"): ("a model's weight bytes per decode token over this machine's streaming-read bandwidth: "
                            "the one-stream TPOT floor (--tpot-ms: a measured TPOT as a fraction of it)",
                            *_module_command("tessera.bench.memory_roofline")),
    ("bench", "spec"): ("batch-1 decode speed: plain vs serial vs disaggregated tree speculation, with "
                        "the simulator's predictions", *_module_command("tessera.bench.spec_bench")),
    ("bench", "timeline"): ("a split request's steps from its spans (tessera up FILE at the detailed trace level): "
                            "per process, attention, M2N and expert work, drafting beside verification, or each "
                            "stage, with the measured overlap fraction", *_module_command("tessera.bench.timeline")),
    ("profile",): ("measure T_a(b), T_e(b), T_c(b), T_o(b) here; write a JSON profile",
                   *_module_command("tessera.disagg.profile")),
    ("quantize",): ("write a weight-only quantized checkpoint (packed codes + scales) that serve loads "
                    "directly", *_module_command("tessera.entrypoints.quantize")),
    ("bench", "quant"): ("decode speed and held-out perplexity at 16/8/4 bits (per-linear kernel times "
                         "with --kernels)", *_module_command("tessera.bench.quant_bench")),
    ("indicator",): ("LLM-PQ: calibrate the quantization-sensitivity indicator ω[layer, bits] (--validate: "
                     "against one-layer perplexity increases)", *_module_command("tessera.pipeline.indicator_cli")),
    ("plan", "afd"): ("MegaScale-Infer plan search (Algorithm 1); writes a topology file",
                      *_module_command("tessera.disagg.plan_cli")),
    ("profile-pq",): ("LLM-PQ: time decoder layers per bit-width here as a stage runs them (prefill and decode "
                      "regressions, held-out error); the JSON devices.yaml names as `profile:`", *_module_command("tessera.pipeline.profile")),
    ("bench", "pq"): ("LLM-PQ's plan vs uniform, PipeEdge and adabits, each run end to end here (tessera up + "
                      "run-batch) with predicted and measured tok/s and perplexity", *_module_command("tessera.bench.pq_bench")),
    ("plan", "pq"): ("LLM-PQ: device order, micro-batches, layer split and bits per layer (ILP), beside "
                     "PipeEdge, uniform and adabits; writes a plan file", *_module_command("tessera.pipeline.plan_cli")),
}
GROUP_HELP = {"keys": "API keys kept in Redis", "draft": "draft models", "model": "model files", "bench": "benchmarks", "plan": "planners"}


def build_parser(wanted: set[str] | None = None) -> argparse.ArgumentParser:
    """The whole command line; with `wanted`, only commands named there get their flags."""
    parser = argparse.ArgumentParser(prog="tessera", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    groups: dict[str, argparse._SubParsersAction] = {}
    for path, (text, add_args, run) in COMMANDS.items():
        where = sub
        if len(path) == 2:
            if path[0] not in groups:
                group = sub.add_parser(path[0], help=GROUP_HELP[path[0]])
                groups[path[0]] = group.add_subparsers(dest=f"{path[0]}_command", required=True)
            where = groups[path[0]]
        p = where.add_parser(path[-1], help=text, description=text)
        if run is not None:
            p.set_defaults(fn=run)
        if wanted is None or set(path) <= wanted:
            add_args(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    from tessera import exit_codes, logs, mtls
    from tessera.deploy import parent_watch
    parent_watch.watch_from_env()   # first: a supervised process never outlives its supervisor
    logs.setup()
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser({arg for arg in argv if not arg.startswith("-")})
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:   # argparse has said what is wrong with the flags
        return exit_codes.CONFIG_ERROR if e.code == 2 else e.code
    try:
        mtls.identity()     # a certificate that could never complete a handshake stops us here
        _tracing(args)
        return args.fn(args)
    except ConfigError as e:   # one line, and an exit code a supervisor does not restart
        return exit_codes.config_error(args.command, str(e))


if __name__ == "__main__":
    sys.exit(main())
