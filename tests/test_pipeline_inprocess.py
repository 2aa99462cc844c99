"""Pipeline stages inside one process (the in-process twin of `tessera pipeline-shard`): greedy
tokens of 1, 2 and 3 stages equal to a single process with the same per-layer precisions
(docs/design/pipeline.md#invariants, rule 3; mixed [16, 8, 4, 3, 8, 16] and 16-bit, float32 and
bfloat16), and micro-batched stages equal to the same micro-batches in one process, over the local
transport and over tcp; stages read only their layers; a stage refuses a pipeline it does not fit;
a memory budget it exceeds stops it before its cache exists; a failed step fails its requests at
once and the ring is relinked for the next one; the twin and the gRPC client are one StageControl
(mypy); the hybrid micro-batch rule, the stage wire format, and pipeline topologies (expansion into
stage processes, bad files refused)."""
from __future__ import annotations

import json
import re
import time
from dataclasses import replace

import pytest
import torch

from tessera.config import CacheConfig, ConfigError, EngineConfig, SamplingParams
from tessera.deploy.topology import Topology
from tessera.engine import Engine
from tessera.pipeline.control import LocalStageControl, StageControl, StageRefused
from tessera.pipeline.first_stage import build_first_stage
from tessera.pipeline.memory import MemoryBudgetExceeded
from tessera.pipeline.micro_batches import logit_rows, split_micro_batches
from tessera.pipeline.shard import SLOTS, load_shard
from tessera.pipeline.stages import StageConfig
from tessera.pipeline.wire import decode_step, encode_step
from tessera.scheduler import ScheduledRequest, StepPlan
from tessera.tokenizer import load_tokenizer
from tessera.transport import make_transport
from tessera.transport.base import TransportError
from tessera.transport.local import Fabric

MODEL = "random:llama:num_hidden_layers=6"
PROMPTS = [[1, 450, 3000, 17, 99, 4093], [2000, 5, 6, 7], [42, 42, 42, 31000, 12, 9, 77, 1000, 20000], [7, 8]]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
CACHE = CacheConfig(block_size=4, num_blocks=128)
MIXED = [16, 8, 4, 3, 8, 16]


@pytest.fixture(scope="module", autouse=True)
def one_thread_per_stage():
    """Stages here are threads of one process: one torch thread each, as a stage process with
    --threads 1 has (several stages' thread pools would fight over the cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("smollm2")


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    path.write_text(json.dumps({"bits": MIXED, "stages": [{"layers": [0, 2]}, {"layers": [2, 6]}]}))
    return str(path)


def endpoints(kind: str, names: list[str]):
    if kind == "local":
        fabric = Fabric(SLOTS)
        return [fabric.endpoint(n) for n in names]
    return [make_transport("tcp", n, slots=SLOTS) for n in names]


def pipeline(config: EngineConfig, splits: list[str], tokenizer, kind: str = "local", micro_batches=None,
             prefill: int = 1):
    """Stage 0 (an Engine) and the later stages (PipelineShards) over `kind` endpoints."""
    names = [f"stage-{k}" for k in range(len(splits))]
    transports = endpoints(kind, names)
    shards = [load_shard(config, StageConfig(stage=k, layers=splits[k]), transports[k])
              for k in range(1, len(splits))]
    engine = build_first_stage(config, StageConfig(stage=0, layers=splits[0], name=names[0],
                                                   micro_batches=micro_batches, prefill_micro_batch=prefill,
                                                   timeout_s=5.0),
                               [LocalStageControl(s) for s in shards], transports[0], tokenizer)
    return engine, shards


def close(shards):
    for s in shards:
        s.close()


SPLITS = {1: ["0:6"], 2: ["0:2", "2:6"], 3: ["0:1", "1:4", "4:6"]}
WHOLE_STEP = 1000   # a prefill micro-batch that holds every chunk of a step


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("quantization", [None, "mixed"])
def test_pipeline_greedy_equals_single_process(tokenizer, plan_file, dtype, quantization):
    """One micro-batch per step: every GEMM has the single process's shape, so 1, 2 and 3
    stages reproduce its tokens exactly, 16-bit and mixed-precision layers alike."""
    config = EngineConfig(model=MODEL, dtype=dtype, quantization=plan_file if quantization else None, cache=CACHE)
    expected = Engine(config, tokenizer=tokenizer).generate(PROMPTS, GREEDY)
    for stages in (1, 2, 3):
        engine, shards = pipeline(config, SPLITS[stages], tokenizer, micro_batches=1, prefill=WHOLE_STEP)
        try:
            assert engine.generate(PROMPTS, GREEDY) == expected, stages
            assert engine.runner.failed_steps == 0
        finally:
            close(shards)


def test_a_pipeline_serves_a_quantized_checkpoint_at_its_own_bits(tokenizer, tmp_path):
    """A `tessera quantize` directory (e.g. GPTQ's codes) split into stages: each stage loads
    its layers' codes, reports the checkpoint's bits, and the tokens are the single process's."""
    from tessera.models import quantized_checkpoint
    from tessera.models.loader import load_model
    quantized_checkpoint.save(load_model(MODEL, torch.float32)[0], tmp_path / "q", MIXED, 32, MODEL)
    config = EngineConfig(model=str(tmp_path / "q"), dtype="float32", cache=CACHE)
    expected = Engine(config, tokenizer=tokenizer).generate(PROMPTS, GREEDY)
    engine, shards = pipeline(config, SPLITS[2], tokenizer, micro_batches=1, prefill=WHOLE_STEP)
    try:
        assert engine.generate(PROMPTS, GREEDY) == expected
        assert shards[0].info().bits == tuple(MIXED[2:6])
    finally:
        close(shards)


@pytest.mark.parametrize("kind,dtype,m,prefill", [("local", "float32", None, 1), ("local", "bfloat16", 2, 2),
                                                   ("tcp", "bfloat16", None, 1)])
def test_micro_batched_stages_equal_the_same_micro_batches_in_one_process(tokenizer, plan_file, kind, dtype, m,
                                                                          prefill):
    """Micro-batches change GEMM shapes, and a float GEMM's rounding depends on its shape (the
    packed int4 / int8 kernels then round to bfloat16), so a micro-batched pipeline is compared
    with the same micro-batches run by one process; both use every stage's precision. m=None:
    one decode micro-batch per stage, LLM-PQ's ceil(B / N)."""
    config = EngineConfig(model=MODEL, dtype=dtype, quantization=plan_file, cache=CACHE)
    alone, _ = pipeline(config, SPLITS[1], tokenizer, micro_batches=m or 3, prefill=prefill)
    expected = alone.generate(PROMPTS, GREEDY)
    engine, shards = pipeline(config, SPLITS[3], tokenizer, kind, micro_batches=m, prefill=prefill)
    try:
        assert engine.generate(PROMPTS, GREEDY) == expected
        assert engine.runner.micro_batches == (m or 3) and all(s.micro_batches > 0 for s in shards)
    finally:
        close(shards)


def test_micro_batched_logits_are_close_to_the_whole_step(tokenizer):
    config = EngineConfig(model=MODEL, dtype="float32", cache=CACHE)
    engine, shards = pipeline(config, SPLITS[2], tokenizer)
    plan = StepPlan(tuple(ScheduledRequest(f"r{i}", tuple(p), 0, tuple(range(i * 4, i * 4 + 4)), True)
                          for i, p in enumerate(PROMPTS)))
    try:
        ours = engine.runner.execute(plan)
        whole, _ = pipeline(config, SPLITS[1], tokenizer, micro_batches=1, prefill=WHOLE_STEP)
        assert (ours - whole.runner.execute(plan)).abs().max() < 1e-4
    finally:
        close(shards)


def test_stages_read_only_their_layers(monkeypatch):
    from tessera.models import loader
    read, real = [], loader.iter_checkpoint

    def spy(p):
        for name, get in real(p):
            yield name, lambda name=name, get=get: (read.append(name), get())[1]
    monkeypatch.setattr(loader, "iter_checkpoint", spy)
    config = EngineConfig(model=MODEL, dtype="float32", cache=CACHE)
    layers = lambda: {int(m[1]) for m in map(re.compile(r"layers\.(\d+)\.").search, read) if m}  # noqa: E731
    shard = load_shard(config, StageConfig(stage=1, layers="1:4"), Fabric().endpoint("s1"))
    assert layers() == {1, 2, 3} and not any("embed" in n or "lm_head" in n or n == "model.norm.weight" for n in read)
    read.clear()
    last = load_shard(config, StageConfig(stage=2, layers="4:6"), Fabric().endpoint("s2"))
    assert layers() == {4, 5} and "lm_head.weight" in read and "model.embed_tokens.weight" not in read
    assert shard.weight_bytes < last.weight_bytes
    for s in (shard, last):
        s.close()


def test_a_stage_refuses_a_pipeline_it_does_not_fit(tokenizer, plan_file):
    config = EngineConfig(model=MODEL, dtype="float32", quantization=plan_file, cache=CACHE)
    fabric = Fabric(SLOTS)
    cases = [(replace(config, quantization="int8"), "2:6", "bits"),
             (replace(config, dtype="bfloat16"), "2:6", "dtype"),
             (replace(config, cache=replace(CACHE, num_blocks=64)), "2:6", "KV blocks"),
             (config, "3:6", "stages must cover the layers in order")]
    for i, (shard_config, layers, error) in enumerate(cases):
        shard = load_shard(shard_config, StageConfig(stage=1, layers=layers), fabric.endpoint(f"s{i}"))
        try:
            with pytest.raises(StageRefused, match=error):
                build_first_stage(config, StageConfig(stage=0, layers="0:2", name=f"first-{i}"),
                                  [LocalStageControl(shard)], fabric.endpoint(f"first-{i}"), tokenizer)
        finally:
            shard.close()


def test_a_memory_budget_too_small_stops_the_stage_before_its_cache(plan_file):
    config = EngineConfig(model=MODEL, dtype="float32", quantization=plan_file, cache=CACHE)
    with pytest.raises(MemoryBudgetExceeded, match=r"stage 1 needs 0\.0\d+ GiB .* more than its --memory-gib 0\.001"):
        load_shard(config, StageConfig(stage=1, layers="2:6", memory_gib=0.001), Fabric().endpoint("s1"))
    shard = load_shard(config, StageConfig(stage=1, layers="2:6", memory_gib=0.1), Fabric().endpoint("s1"))
    info = shard.info()
    assert info.weight_bytes + info.kv_bytes <= info.memory_budget_bytes and info.bits == tuple(MIXED[2:])
    shard.close()


def test_a_failed_step_fails_its_requests_and_the_next_step_relinks(tokenizer, monkeypatch):
    """A stage that fails a micro-batch answers downstream with an error at once (no waiting
    for a timeout); the step raises (the engine fails its requests), and the next step relinks
    the ring and serves."""
    config = EngineConfig(model=MODEL, dtype="float32", cache=CACHE)
    engine, shards = pipeline(config, SPLITS[3], tokenizer)
    expected = engine.generate(PROMPTS, GREEDY)
    real = shards[0]._compute

    def fail_once(*args):
        monkeypatch.setattr(shards[0], "_compute", real)
        raise RuntimeError("injected fault")
    monkeypatch.setattr(shards[0], "_compute", fail_once)
    try:
        engine.add_request(PROMPTS[0], GREEDY)
        t0 = time.monotonic()
        with pytest.raises(TransportError, match="stage 1: injected fault"):
            engine.step()
        assert time.monotonic() - t0 < 2   # well within the 5 s timeout: the error came down the ring
        assert engine.fail_running() and engine.runner.failed_steps == 1
        deadline = time.monotonic() + 5   # the stage counts the step it dropped after passing the error on
        while shards[0].rejected != 1:
            assert time.monotonic() < deadline, "the stage never counted the failed step"
            time.sleep(0.01)
        assert engine.generate(PROMPTS, GREEDY) == expected
        assert all(s.info().pipeline == "stage-0" for s in shards)
    finally:
        close(shards)


def test_stage_controls_satisfy_one_protocol(tmp_path, request):
    """mypy: the in-process twin and the gRPC client are both a StageControl; a control with
    another info() is refused."""
    pytest.importorskip("mypy")
    import pathlib
    import subprocess
    import sys
    import textwrap
    services = pathlib.Path(__file__).resolve().parents[1] / "services"
    (tmp_path / "uses.py").write_text(textwrap.dedent("""
        from tessera.pipeline.control import LocalStageControl, StageControl
        from tessera.rpc.pipeline_client import GrpcStageControl

        def controls(local: LocalStageControl, remote: GrpcStageControl) -> list[StageControl]:
            return [local, remote]

        class Old(LocalStageControl):
            def info(self, timeout_s: float) -> int:  # type: ignore[override]
                return 0

        def old(control: Old) -> StageControl:
            return control
    """))
    (tmp_path / "mypy.ini").write_text(f"[mypy]\nmypy_path = {services}\nfollow_imports = skip\n"
                                       "ignore_missing_imports = True\n[mypy-tessera.*]\nfollow_imports = silent\n")
    out = subprocess.run([sys.executable, "-m", "mypy", "--config-file", "mypy.ini", "--cache-dir",
                          str(request.config.cache.mkdir("mypy-pipeline")), "uses.py"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    errors = [line for line in out.stdout.splitlines() if ": error:" in line]
    assert len(errors) == 1 and "uses.py:13:" in errors[0] and '"StageControl"' in errors[0], out.stdout


def test_hybrid_micro_batches():
    """Prefill chunks in groups of xi, then decode in m groups of ceil(B / m); the logits of
    the groups land back in plan order."""
    decode = lambda i: ScheduledRequest(f"d{i}", (5,), 9, (0, 1, 2), True)  # noqa: E731
    prefill = lambda i, sample: ScheduledRequest(f"p{i}", (1, 2, 3), 0, (3,), sample)  # noqa: E731
    plan = StepPlan((decode(0), prefill(0, True), decode(1), decode(2), prefill(1, False), decode(3), decode(4)))
    groups = split_micro_batches(plan, 2, 1)
    assert groups == [[1], [4], [0, 2, 3], [5, 6]]
    # sampled rows in plan order: d0 p0 d1 d2 d3 d4 (p1 is a chunk before the prompt's end)
    assert logit_rows(plan, groups) == [1, 0, 2, 3, 4, 5]
    assert split_micro_batches(plan, 3, 2) == [[1, 4], [0, 2], [3, 5], [6]]
    assert split_micro_batches(StepPlan(()), 2, 1) == []


def test_stage_messages_round_trip_and_bad_ones_are_refused():
    plan = StepPlan((ScheduledRequest("", (5,), 9, (0, 1, 2), True),
                     ScheduledRequest("", (1, 2, 3), 0, (3,), False, (0, 1))))
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    message = encode_step(plan, x, 3)
    m, got, y = decode_step(message, 8, torch.bfloat16, 4)
    assert m == 3 and got == plan and torch.equal(x, y)
    for bad, error in ((message[:-2], "do not match"), (message[:40], "framed"),
                       (torch.zeros(100, dtype=torch.uint8), "bad header")):
        with pytest.raises(TransportError, match=error):
            decode_step(bad, 8, torch.bfloat16, 4)
    with pytest.raises(TransportError, match="hidden states"):
        decode_step(message, 8, torch.float32, 4)
    with pytest.raises(TransportError, match="block id"):
        decode_step(message, 8, torch.bfloat16, 3)


def _flag(argv, name: str) -> str:
    return argv[argv.index(name) + 1]


def test_pipeline_topology_expands_to_its_stages(tmp_path, plan_file):
    import pathlib
    root = pathlib.Path(__file__).resolve().parents[1]
    procs = {p.name: p.argv for p in Topology.load(root / "deploy/topologies/pipeline-pq.yaml").processes()}
    assert list(procs) == ["redis-0", "pipeline-shard-0", "pipeline-shard-1", "gateway-0"]
    first, second = procs["pipeline-shard-0"], procs["pipeline-shard-1"]
    assert [_flag(first, "--layers"), _flag(second, "--layers")] == ["0:15", "15:30"]
    assert _flag(first, "--shard") == "127.0.0.1:50092" and "--shard" not in second
    assert _flag(first, "--quantization") == _flag(second, "--quantization") == "int8"
    assert _flag(second, "--memory-gib") == "1.0" and _flag(second, "--stage") == "1" and "--registry" in second
    # stage ranges from a plan file; without a registry the gateway is given stage 0 only
    spec = tmp_path / "t.yaml"
    spec.write_text(f"model: {MODEL}\nroles: {{gateway: {{port: 1}}, pipeline_shard: {{port: 10, plan: {plan_file}, "
                    "micro_batches: 3, stages: [{memory_gib: 2}, {threads: 2}]}}")
    argv = {p.name: p.argv for p in Topology.load(spec).processes()}
    assert [_flag(argv[f"pipeline-shard-{i}"], "--layers") for i in (0, 1)] == ["0:2", "2:6"]
    assert _flag(argv["pipeline-shard-0"], "--micro-batches") == "3" and "--micro-batches" not in argv["pipeline-shard-1"]
    assert _flag(argv["pipeline-shard-1"], "--quantization") == plan_file and _flag(argv["pipeline-shard-1"],
                                                                                    "--threads") == "2"
    assert argv["gateway-0"].count("--worker") == 1 and _flag(argv["gateway-0"], "--worker") == "127.0.0.1:10"


@pytest.mark.parametrize("roles,error", [
    ("pipeline_shard: {port: 2, stages: [{layers: '0:2'}, {layers: '3:6'}]}", "cover the layers in order"),
    ("pipeline_shard: {port: 2, bits: 5, stages: [{layers: '0:6'}]}", "bits is 16, 8, 4 or 3"),
    ("pipeline_shard: {port: 2, replicas: 3, stages: [{layers: '0:6'}]}", "one replica per stage"),
    ("pipeline_shard: {port: 2, stages: [{layers: '0:6', colour: red}]}", "a stage has layers"),
    ("pipeline_shard: {port: 2, stages: [{layers: '6:0'}]}", "START < END"),
    ("pipeline_shard: {port: 2}", "lists its stages"),
    ("worker: {port: 3, stages: []}", "only it takes"),
    ("worker: {port: 3}, pipeline_shard: {port: 2, stages: [{layers: '0:6'}]}", "only engine"),
])
def test_bad_pipeline_topologies_are_refused(tmp_path, roles, error):
    spec = tmp_path / "t.yaml"
    spec.write_text(f"roles: {{gateway: {{port: 1}}, {roles}}}")
    with pytest.raises(ConfigError, match=error):
        Topology.load(spec)
