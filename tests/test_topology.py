"""Topology files: the ones in deploy/topologies load, expand into the right processes, and
bad files are refused with a clear error."""
from __future__ import annotations

import pathlib

import pytest

from tessera.config import ConfigError
from tessera.deploy.topology import Topology

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("path", sorted((ROOT / "deploy" / "topologies").glob("*.yaml")))
def test_shipped_topologies_load(path):
    assert Topology.load(path).processes()


def test_disagg_moe_expands_to_linked_processes():
    t = Topology.load(ROOT / "deploy/topologies/disagg-moe.yaml").with_overrides(port=9000, dtype="bfloat16")
    procs = {p.name: p for p in t.processes()}
    assert list(procs) == ["expert-node-0", "expert-node-1", "attention-node-0", "attention-node-1", "gateway-0"]
    attention = procs["attention-node-1"].argv
    assert attention[attention.index("--dtype") + 1] == "bfloat16"
    assert [attention[i + 1] for i, a in enumerate(attention) if a == "--expert"] == \
        ["127.0.0.1:50071", "127.0.0.1:50072"]
    assert procs["expert-node-1"].argv[-6:] == ("--shard-index", "1", "--shard-count", "2", "--transport", "auto")
    gateway = procs["gateway-0"]
    assert gateway.port == 9000 and gateway.argv.count("--worker") == 2


def test_expert_sets_go_to_their_replicas(tmp_path):
    spec = tmp_path / "t.yaml"
    spec.write_text("model: random:mixtral\nroles: {gateway: {port: 1}, attention_node: {port: 2},"
                    " expert_node: {port: 3, replicas: 2, experts: ['0,2,4,6', '1,3,5,7']}}")
    argv = {p.name: p.argv for p in Topology.load(spec).processes()}
    assert [argv[f"expert-node-{i}"][argv[f"expert-node-{i}"].index("--experts") + 1] for i in (0, 1)] == \
        ["0,2,4,6", "1,3,5,7"]


@pytest.mark.parametrize("text,error", [
    ("roles: {gateway: {port: 1}, attention_node: {port: 2}, expert_node: {port: 3, replicas: 2, experts: ['0-7']}}",
     "one expert set per expert_node replica"),
    ("roles: {gateway: {port: 1}, worker: {port: 2, colour: red}}", "unknown options"),
    ("roles: {gateway: {port: 1}, mystery: {port: 2}}", "unknown role"),
    ("roles: {gateway: {port: 1}, attention_node: {port: 2}}", "come together"),
    ("roles: {worker: {port: 2}}", "needs a gateway"),
    ("roles: {gateway: {port: 1}, worker: {port: 2, engine: tgi}}", "engine is native or vllm"),
    ("roles: {gateway: {port: 1, engine: vllm}, worker: {port: 2}}", "on a worker role"),
    ("name: x", "roles"),
])
def test_bad_topologies_are_refused(tmp_path, text, error):
    path = tmp_path / "t.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=error):
        Topology.load(path)


def test_engine_limits_reach_workers_and_attention_nodes(tmp_path):
    """A plan's batch B is runnable as planned: the limits become the engine flags."""
    spec = tmp_path / "t.yaml"
    spec.write_text("model: random:mixtral\nroles: {gateway: {port: 1}, expert_node: {port: 3},"
                    " attention_node: {port: 2, max_num_seqs: 256, max_num_batched_tokens: 512,"
                    " num_kv_blocks: 16384}}")
    argv = {p.role: p.argv for p in Topology.load(spec).processes()}
    attention = argv["attention_node"]
    assert [attention[attention.index(f) + 1] for f in ("--max-num-seqs", "--max-num-batched-tokens",
                                                          "--num-kv-blocks")] == ["256", "512", "16384"]
    assert "--max-num-seqs" not in argv["expert_node"] and "--max-num-seqs" not in argv["gateway"]


def test_engine_limits_on_a_role_without_an_engine_are_refused(tmp_path):
    spec = tmp_path / "t.yaml"
    spec.write_text("roles: {gateway: {port: 1, max_num_seqs: 8}, worker: {port: 2}}")
    with pytest.raises(ConfigError, match="workers and attention nodes only"):
        Topology.load(spec)


def test_a_worker_role_names_its_engine(tmp_path):
    """`engine: vllm` is `tessera worker --engine vllm` (which runs from .venv-vllm); native adds nothing."""
    spec = tmp_path / "t.yaml"
    spec.write_text("roles: {gateway: {port: 1}, worker: {port: 2, replicas: 2, engine: vllm}}")
    workers = [p.argv for p in Topology.load(spec).processes() if p.role == "worker"]
    assert len(workers) == 2 and all(a[a.index("--engine") + 1] == "vllm" for a in workers)
    spec.write_text("roles: {gateway: {port: 1}, worker: {port: 2, engine: native}}")
    assert all("--engine" not in p.argv for p in Topology.load(spec).processes())


def test_a_worker_role_sets_how_it_answers(tmp_path):
    """generation_config, chat_template and tool_call_parser reach `tessera worker` as its flags,
    as the worker parses them."""
    from tessera.chat_config import ChatConfig
    from tessera.cli import build_parser
    from tessera.entrypoints.flags import from_args
    from tessera.generation_defaults import GenerationConfigSource
    spec = tmp_path / "t.yaml"
    spec.write_text("roles: {gateway: {port: 1}, worker: {port: 2, generation_config: vllm,"
                    " chat_template: chatml_tools, tool_call_parser: hermes}}")
    (worker,) = [p.argv for p in Topology.load(spec).processes() if p.role == "worker"]
    args = build_parser().parse_args(list(worker))
    assert from_args(GenerationConfigSource, args).generation_config == "vllm"
    chat = from_args(ChatConfig, args)
    assert (chat.chat_template, chat.tool_call_parser) == ("chatml_tools", "hermes")
    spec.write_text("roles: {gateway: {port: 1, generation_config: vllm}, worker: {port: 2}}")
    with pytest.raises(ConfigError, match="apply to worker roles only"):
        Topology.load(spec)
