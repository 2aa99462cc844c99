"""The topology file: which roles run, how many replicas, on which ports, with which model,
dtype and transport. It is the one source of truth: `tessera up` turns it into processes on
this machine, and `tessera render` turns the very same process list into docker-compose and
Kubernetes files (deploy/compose/, deploy/k8s/).

    name: single
    model: smollm2            # or random:ARCH, or a path
    dtype: auto
    transport: auto           # M2N backend for AFD roles
    otlp_traces_endpoint: http://collector:4317   # optional: every process's traces (tessera up --otlp-traces-endpoint)
    observability: true       # optional: renders add Tempo, Prometheus and Grafana (observability.py)
    roles:
      redis:   {port: 6379}               # discovery: workers register, the gateway watches
      worker:  {replicas: 2, port: 50051}
      gateway: {replicas: 1, port: 8000}

A worker role may say which engine it runs: `engine: vllm` (default native) is `tessera worker
--engine vllm`, vLLM's engine from .venv-vllm (`make setup-vllm`); in rendered files, an image
built with vLLM. A worker role may also say where its default sampling parameters come from
(`generation_config: vllm`, auto or a directory; `tessera worker --generation-config`), its chat
template and tool-call parser (`chat_template: chatml_tools`, `tool_call_parser: hermes`). A worker, target_worker or attention_node role may set its engine's limits: max_num_seqs (the
batch B), max_num_batched_tokens, num_kv_blocks, kv_cache_gib or max_queue_delay_ms, and turn on
`batch_invariant: true` (--batch-invariant). Speculative decoding
(SwiftSpec) pairs draft_worker replica i with target_worker replica i (equal replicas): the
draft_worker role names the drafter (`speculative: self:8`) and may set the tree (tree_size,
width, depth), which its target verifies; the target_worker may set disable_batch_size. A
draft worker registers with role "draft", which the gateway never routes to. An expert_node role may say which MoE
experts each replica holds, e.g. `experts: ["0,2,4,6", "1,3,5,7"]` (default: contiguous
ranges). A pipeline_shard role is a pipeline (LLM-PQ): one replica per entry of its `stages`
(`layers: START:END`, and `threads`, `memory_gib` per stage) or of its `plan` file's stages;
`bits: 8` (16, 8, 4, 3) or `plan: FILE` (per-layer bits) sets every stage's precision. Stage 0
is the worker the gateway calls; the later stages register with role "pipeline_shard", which
it never routes to. Replica i of a role listens on port + i (distinct ports, so every role can also run
side by side on one host). With a `redis` role, workers and attention nodes register
themselves and the gateway discovers them; without it the gateway gets a static --worker
list. Roles start in dependency order (ROLE_ORDER). Where processes run (one host, compose
services, Kubernetes pods) is a Placement: it says which address binds and how one reaches
replica i of a role.

`observability: true` (off by default) adds the stack of observability.py to the rendered files,
and every rendered process sends its traces to that stack's Tempo unless otlp_traces_endpoint
names another receiver. `tessera up` cannot reach the stack's in-cluster name: locally the option
changes nothing, and otlp_traces_endpoint alone turns traces on.
"""
from __future__ import annotations

import pathlib
from dataclasses import dataclass, field, replace

import yaml

from tessera.config import ConfigError
from tessera.deploy.observability import TEMPO_OTLP_ENDPOINT
from tessera.tracing import LEVELS

ROLE_ORDER = ("redis", "worker", "draft_worker", "target_worker", "expert_node", "attention_node", "pipeline_shard",
              "gateway")
ENGINE_ROLES = ("worker", "target_worker", "attention_node", "pipeline_shard")   # they run an engine that serves requests
# Engine limits of the roles that run an engine, passed as the flags of the same name: a plan
# (`tessera plan afd`) sets the batch B (max_num_seqs), a step's token budget and a KV cache
# that holds B requests.
ENGINE_OPTIONS = ("max_num_seqs", "max_num_batched_tokens", "num_kv_blocks", "kv_cache_gib", "max_queue_delay_ms",
                  "batch_invariant")
ENGINE_SWITCHES = ("batch_invariant",)    # of those, the ones that are a flag alone when true
# The drafter and its tree (draft_worker role), as the flags of SpeculativeConfig.
SPEC_OPTIONS = {"speculative": "--speculative", "tree_size": "--spec-tree-size", "width": "--spec-width",
                "depth": "--spec-depth"}
# A pipeline's stages and precision (pipeline_shard role); stage 0's micro-batching, as the flags of StageConfig.
PIPELINE_OPTIONS = {"stages", "plan", "bits", "prefill_micro_batch", "stage_timeout_s"}
ENGINES = ("native", "vllm")    # what a worker role runs (`engine:`; tessera worker --engine)
# How a worker role answers requests, as the flags of the same name (`tessera worker --help`).
WORKER_OPTIONS = ("generation_config", "chat_template", "tool_call_parser")
ROLE_OPTIONS = {"replicas", "port", "threads", "micro_batches", "ffn_timeout_s", "experts", "disable_batch_size", "engine",
                *PIPELINE_OPTIONS, *WORKER_OPTIONS,
                *ENGINE_OPTIONS, *SPEC_OPTIONS}
HOST = "127.0.0.1"


@dataclass(frozen=True)
class Role:
    name: str
    replicas: int
    port: int
    options: dict = field(default_factory=dict)

    def service(self, i: int) -> str:
        """The process (and compose service, Kubernetes Deployment) name of replica i."""
        return f"{self.name.replace('_', '-')}-{i}"


@dataclass(frozen=True)
class Placement:
    """Where the processes run. Local: every replica on this machine at 127.0.0.1:port+i.
    Services (compose, Kubernetes): replica i is reachable by its service name."""
    bind: str = HOST
    by_service_name: bool = False
    redis_url: str | None = None      # None: redis://<redis address>/0 (the password: $REDIS_PASSWORD)

    def address(self, role: Role, i: int) -> str:
        return f"{role.service(i) if self.by_service_name else HOST}:{role.port + i}"

    def advertise(self, role: Role, i: int) -> str:
        """The address a registering worker announces (Kubernetes: its pod IP)."""
        return self.address(role, i)

    def transport_host(self, role: Role, i: int) -> list[str]:
        """Arguments telling an AFD node which host its M2N peers dial (none: loopback)."""
        return ["--transport-advertise", role.service(i)] if self.by_service_name else []


@dataclass(frozen=True)
class PodPlacement(Placement):
    """Kubernetes: replicas of a registering role are one Deployment; each pod announces its IP."""
    def advertise(self, role: Role, i: int) -> str:
        return f"$(POD_IP):{role.port + i}"

    def transport_host(self, role: Role, i: int) -> list[str]:
        return ["--transport-advertise", "$(POD_IP)"]   # transport ports are not behind Services


LOCAL = Placement()
SERVICES = Placement(bind="0.0.0.0", by_service_name=True)
PODS = PodPlacement(bind="0.0.0.0", by_service_name=True)


@dataclass(frozen=True)
class Process:
    name: str          # e.g. expert-node-1
    role: str
    port: int
    argv: tuple[str, ...]   # the `tessera` command's arguments; for redis, redis-server's


@dataclass(frozen=True)
class Topology:
    name: str
    model: str
    dtype: str
    transport: str
    roles: dict
    otlp_traces_endpoint: str | None = None   # every process sends its traces here (--otlp-traces-endpoint)
    observability: bool = False   # renders add Tempo, Prometheus and Grafana (observability.py)
    trace_level: str | None = None   # every process's --trace-level, with tracing on

    @classmethod
    def load(cls, path: str | pathlib.Path) -> "Topology":
        data = yaml.safe_load(pathlib.Path(path).read_text())
        if not isinstance(data, dict) or not isinstance(data.get("roles"), dict):
            raise ConfigError(f"{path}: a topology needs a 'roles' mapping")
        roles = {}
        for name, spec in data["roles"].items():
            if name not in ROLE_ORDER:
                raise ConfigError(f"{path}: unknown role {name!r} (known: {', '.join(ROLE_ORDER)})")
            spec = dict(spec or {})
            unknown = set(spec) - ROLE_OPTIONS
            if unknown:
                raise ConfigError(f"{path}: role {name} has unknown options {sorted(unknown)}")
            replicas, port = int(spec.pop("replicas", 1)), spec.pop("port", None)
            if replicas < 1 or port is None:
                raise ConfigError(f"{path}: role {name} needs replicas >= 1 and a port")
            if name == "redis" and replicas != 1:
                raise ConfigError(f"{path}: the redis role has one replica")
            if "experts" in spec and (name != "expert_node" or not isinstance(spec["experts"], list)
                                      or len(spec["experts"]) != replicas):
                raise ConfigError(f"{path}: 'experts' is a list with one expert set per expert_node replica")
            if name not in ENGINE_ROLES and set(spec) & set(ENGINE_OPTIONS):
                raise ConfigError(f"{path}: {sorted(set(spec) & set(ENGINE_OPTIONS))} apply to workers, target "
                                  "workers and attention nodes only")
            if (name == "draft_worker") != bool(set(spec) & set(SPEC_OPTIONS)) or \
                    (name == "draft_worker" and "speculative" not in spec):
                raise ConfigError(f"{path}: a draft_worker role names its drafter (speculative: self:K) and "
                                  "only it takes the tree options")
            if spec.get("engine", "native") not in ENGINES or ("engine" in spec and name != "worker"):
                raise ConfigError(f"{path}: engine is {' or '.join(ENGINES)}, on a worker role")
            if name != "worker" and set(spec) & set(WORKER_OPTIONS):
                raise ConfigError(f"{path}: {sorted(set(spec) & set(WORKER_OPTIONS))} apply to worker roles only")
            if "disable_batch_size" in spec and name != "target_worker":
                raise ConfigError(f"{path}: disable_batch_size applies to target workers only")
            if (name == "pipeline_shard") != bool(set(spec) & {"stages", "plan"}) or \
                    (name != "pipeline_shard" and set(spec) & PIPELINE_OPTIONS):
                raise ConfigError(f"{path}: a pipeline_shard role lists its stages (or a plan); only it takes "
                                  f"{sorted(PIPELINE_OPTIONS)}")
            if name == "pipeline_shard":
                spec["stages"] = _pipeline_stages(path, spec)
                if replicas != len(spec["stages"]) and "replicas" in data["roles"][name]:
                    raise ConfigError(f"{path}: pipeline_shard has one replica per stage")
                replicas = len(spec["stages"])
            roles[name] = Role(name, replicas, int(port), spec)
        _check_pairs(path, roles)
        if not isinstance(data.get("observability", False), bool):
            raise ConfigError(f"{path}: observability is true or false")
        if data.get("trace_level", "request") not in LEVELS:
            raise ConfigError(f"{path}: trace_level is one of {', '.join(LEVELS)}")
        return cls(data.get("name", pathlib.Path(path).stem), str(data.get("model", "smollm2")),
                   str(data.get("dtype", "auto")), str(data.get("transport", "auto")), roles,
                   data.get("otlp_traces_endpoint"), data.get("observability", False), data.get("trace_level"))

    def _spec_flags(self, i: int, place: Placement, target: bool) -> list[str]:
        """The drafter and tree flags, the same for a draft worker and its target; the target
        also dials its draft worker (replica i)."""
        draft = self.roles["draft_worker"]
        argv = [a for k, flag in SPEC_OPTIONS.items() if k in draft.options for a in (flag, str(draft.options[k]))]
        if target:
            argv += ["--draft-address", place.address(draft, i)]
            if "disable_batch_size" in self.roles["target_worker"].options:
                argv += ["--spec-disable-batch-size", str(self.roles["target_worker"].options["disable_batch_size"])]
        return argv

    def with_overrides(self, port: int | None = None, dtype: str | None = None,
                       otlp_traces_endpoint: str | None = None, trace_level: str | None = None) -> "Topology":
        roles = dict(self.roles)
        if port is not None:
            roles["gateway"] = replace(roles["gateway"], port=port)
        return replace(self, roles=roles, dtype=dtype or self.dtype,
                       otlp_traces_endpoint=otlp_traces_endpoint or self.otlp_traces_endpoint,
                       trace_level=trace_level or self.trace_level)

    @property
    def registry(self) -> bool:
        return "redis" in self.roles

    @property
    def registry_prefix(self) -> str:
        """Keys of this deployment in Redis: several topologies may share one Redis."""
        return f"tessera:{self.name}"

    def redis_url(self, place: Placement) -> str:
        return place.redis_url or f"redis://{place.address(self.roles['redis'], 0)}/0"

    def processes(self, place: Placement = LOCAL) -> list[Process]:
        out = []
        for role_name in ROLE_ORDER:
            role = self.roles.get(role_name)
            for i in range(role.replicas if role else 0):
                out.append(Process(role.service(i), role_name, role.port + i,
                                   tuple(self._argv(role, i, place) + self._tracing_argv(role, i, place))))
        return out

    def traces_endpoint(self, place: Placement) -> str | None:
        """Where the processes send traces: otlp_traces_endpoint if set, else (observability on)
        the stack's Tempo, which only services placed by name (compose, Kubernetes) can reach."""
        if self.otlp_traces_endpoint or not (self.observability and place.by_service_name):
            return self.otlp_traces_endpoint
        return TEMPO_OTLP_ENDPOINT

    def _tracing_argv(self, role: Role, i: int, place: Placement) -> list[str]:
        """Where every tessera process sends its traces, at which level, and its replica index
        (not in a Kubernetes Deployment, whose pods share one command line)."""
        endpoint = self.traces_endpoint(place)
        if not endpoint or role.name == "redis":
            return []
        replica = [] if isinstance(place, PodPlacement) else ["--trace-replica", str(i)]
        level = ["--trace-level", self.trace_level] if self.trace_level else []
        return ["--otlp-traces-endpoint", endpoint, *level, *replica]

    def _argv(self, role: Role, i: int, place: Placement) -> list[str]:
        port = str(role.port + i)
        if role.name == "redis":
            return ["redis-server", "--port", port, "--save", "", "--appendonly", "no"]
        model = ["--model", self.model, "--dtype", self.dtype]
        common = ["--host", place.bind, "--port", port]
        threads = ["--threads", str(role.options["threads"])] if "threads" in role.options else []
        limits = [a for k in ENGINE_OPTIONS if k in role.options and k not in ENGINE_SWITCHES
                  for a in (f"--{k.replace('_', '-')}", str(role.options[k]))]
        limits += [f"--{k.replace('_', '-')}" for k in ENGINE_SWITCHES if role.options.get(k)]
        register = (["--registry", self.redis_url(place), "--registry-prefix", self.registry_prefix,
                     "--advertise", place.advertise(role, i)] if self.registry else [])
        if role.name == "worker":
            engine = ["--engine", role.options["engine"]] if role.options.get("engine", "native") != "native" else []
            serving = [a for k in WORKER_OPTIONS if k in role.options for a in (f"--{k.replace('_', '-')}",
                                                                                 str(role.options[k]))]
            return ["worker", *model, *common, *threads, *limits, *engine, *serving, *register]
        if role.name in ("draft_worker", "target_worker"):
            return [role.name.replace("_", "-"), *model, *common, *threads,
                    *(limits if role.name == "target_worker" else []),
                    *self._spec_flags(i, place, target=role.name == "target_worker"), *register]
        if role.name == "expert_node":
            experts = ["--experts", str(role.options["experts"][i])] if "experts" in role.options else []
            return ["expert-node", *model, *common, *threads, "--name", f"expert-{i}", "--shard-index", str(i),
                    "--shard-count", str(role.replicas), *experts, "--transport", self.transport,
                    *place.transport_host(role, i)]
        if role.name == "pipeline_shard":
            return self._pipeline_argv(role, i, place, [*model, *common, *limits], register)
        if role.name == "attention_node":
            experts = self.roles["expert_node"]
            argv = ["attention-node", *model, *common, *threads, *limits, "--name", f"attention-{i}",
                    "--transport", self.transport,
                    "--micro-batches", str(role.options.get("micro_batches", 2)), *register,
                    *place.transport_host(role, i)]
            if "ffn_timeout_s" in role.options:
                argv += ["--ffn-timeout-s", str(role.options["ffn_timeout_s"])]
            return argv + [a for j in range(experts.replicas) for a in ("--expert", place.address(experts, j))]
        argv = ["gateway", *common]
        if self.registry:
            return argv + ["--registry", self.redis_url(place), "--registry-prefix", self.registry_prefix]
        if "pipeline_shard" in self.roles:   # only stage 0 serves requests
            return argv + ["--worker", place.address(self.roles["pipeline_shard"], 0)]
        backends = self.roles.get("attention_node") or self.roles.get("target_worker") or self.roles["worker"]
        return argv + [a for j in range(backends.replicas) for a in ("--worker", place.address(backends, j))]

    def _pipeline_argv(self, role: Role, i: int, place: Placement, head: list[str], register: list[str]) -> list[str]:
        """Stage i: its layers, precision, threads and memory budget; stage 0 (the worker) also
        its micro-batching and the later stages' addresses, in pipeline order."""
        o, stage = role.options, role.options["stages"][i]
        argv = ["pipeline-shard", *head, "--stage", str(i), "--layers", stage["layers"], "--transport", self.transport,
                *place.transport_host(role, i)]   # endpoint name: pipeline-shard-i, the stage's default
        if "plan" in o or o.get("bits", 16) != 16:
            argv += ["--quantization", str(o["plan"]) if "plan" in o else f"int{o['bits']}"]
        for key, flag in (("threads", "--threads"), ("memory_gib", "--memory-gib")):
            if key in stage or key in o:
                argv += [flag, str(stage.get(key, o.get(key)))]
        if i == 0:
            for key in ("micro_batches", "prefill_micro_batch", "stage_timeout_s"):
                if key in o:
                    argv += [f"--{key.replace('_', '-')}", str(o[key])]
            argv += [a for j in range(1, role.replicas) for a in ("--shard", place.address(role, j))]
        return argv + register


def _check_pairs(path, roles: dict) -> None:
    """Roles that only work together are there together."""
    if "gateway" not in roles or not (set(ENGINE_ROLES) & set(roles)):
        raise ConfigError(f"{path}: a topology needs a gateway and workers, target workers, attention nodes or a "
                          "pipeline")
    if "pipeline_shard" in roles and set(roles) & {"worker", "target_worker", "attention_node"}:
        raise ConfigError(f"{path}: a pipeline is the topology's only engine (the gateway calls its stage 0)")
    if ("attention_node" in roles) != ("expert_node" in roles):
        raise ConfigError(f"{path}: attention nodes and expert nodes come together")
    drafts, targets = roles.get("draft_worker"), roles.get("target_worker")
    if (drafts is None) != (targets is None) or (drafts and drafts.replicas != targets.replicas):
        raise ConfigError(f"{path}: draft workers and target workers come together, one draft per target "
                          "(equal replicas)")


def _pipeline_stages(path, spec: dict) -> list[dict]:
    """The stages of a pipeline_shard role: each {layers, threads?, memory_gib?}, layers from the
    stage itself or from the plan file; contiguous from layer 0 (the last layer is checked by
    stage 0 against the model when it links the stages)."""
    from tessera.pipeline.stages import check_contiguous, layer_range, plan_stages
    stages = spec.get("stages")
    if stages is not None and (not isinstance(stages, list) or not all(isinstance(s, dict) for s in stages)):
        raise ConfigError(f"{path}: stages is a list with one mapping per stage")
    if "plan" in spec and "bits" in spec:
        raise ConfigError(f"{path}: a pipeline takes its bits from the plan or from 'bits', not both")
    if spec.get("bits", 16) not in (16, 8, 4, 3):
        raise ConfigError(f"{path}: bits is 16, 8, 4 or 3 (per-layer bits come from a plan file)")
    ranges = plan_stages(spec["plan"]) if "plan" in spec and not any("layers" in s for s in stages or []) else None
    stages = [dict(s) for s in stages] if stages is not None else [{} for _ in ranges]
    if ranges is not None:
        if len(ranges) != len(stages):
            raise ConfigError(f"{path}: {len(stages)} stages, but the plan has {len(ranges)}")
        for s, r in zip(stages, ranges):
            s["layers"] = r
    for s in stages:
        if set(s) - {"layers", "threads", "memory_gib"} or "layers" not in s:
            raise ConfigError(f"{path}: a stage has layers (START:END) and may have threads and memory_gib")
    check_contiguous([layer_range(s["layers"]) for s in stages])
    return stages
