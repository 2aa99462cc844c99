"""The command line: init-random writes a loadable checkpoint; bench engine prints its rows."""
from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass, field


def tessera(*args: str) -> str:
    return subprocess.run([sys.executable, "-m", "tessera.cli", *args], capture_output=True, text=True,
                          timeout=600, check=True).stdout


def test_init_random_and_bench_engine(tmp_path):
    out = tmp_path / "moe"
    tessera("model", "init-random", "--arch", "mixtral", "--out", str(out), "--seed", "3")
    assert (out / "config.json").exists() and (out / "model.safetensors").exists()
    rows = json.loads(tessera("bench", "engine", "--model", str(out), "--batch-sizes", "1,3",
                              "--input-len", "8", "--output-len", "4", "--hf-reference", "2",
                              "--hf-dtype", "float32", "--json"))
    assert [(r["impl"], r["batch"]) for r in rows] == [("tessera", 1), ("tessera", 3), ("transformers", 2)]
    assert all(r["output_tok_s"] > 0 for r in rows)


def test_expert_node_refuses_bad_expert_sets_with_a_clear_error():
    for spec, error in (("1,1", "names an expert twice"), ("0-x", "write ids and ranges"),
                        ("3,9", "outside the model's 8 experts")):
        out = subprocess.run([sys.executable, "-m", "tessera.cli", "expert-node", "--model", "random:mixtral",
                              "--experts", spec], capture_output=True, text=True, timeout=300)
        assert out.returncode == 78 and error in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_a_missing_model_and_a_taken_gateway_port_are_configuration_errors(tmp_path):
    """Exit 78 (never restarted by a supervisor), one line, no traceback: a restart would fail
    the same way."""
    import socket
    missing = subprocess.run([sys.executable, "-m", "tessera.cli", "worker", "--model", str(tmp_path / "none"),
                              "--port", "0"], capture_output=True, text=True, timeout=120)
    assert missing.returncode == 78 and "does not exist" in missing.stderr, missing.stderr
    assert "Traceback" not in missing.stderr
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = subprocess.run([sys.executable, "-m", "tessera.cli", "gateway", "--worker", "127.0.0.1:1",
                              "--port", str(port)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 78 and f"cannot listen on 127.0.0.1:{port}" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


def test_serve_refuses_a_malformed_drafter_before_starting_anything():
    for spec, error in (("self@int2", "unknown draft quantization 'int2'"), ("self:x", "self:K needs an integer K")):
        out = subprocess.run([sys.executable, "-m", "tessera.cli", "serve", "--speculative", spec, "--port", "8399"],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 78 and error in out.stderr and "pid" not in out.stdout + out.stderr, out.stderr


def _parse(*argv: str):
    from tessera.cli import build_parser
    return build_parser().parse_args(list(argv))


def _flag_dests(command: str) -> set[str]:
    from tessera.cli import build_parser
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    return {a.dest for a in sub.choices[command]._actions}


def test_every_config_field_has_a_flag_where_the_config_is_used():
    """Generated from the dataclasses: a field added later appears with no edit to the CLI."""
    import dataclasses

    from tessera.config import EngineConfig
    from tessera.deploy.supervisor import SupervisorConfig
    from tessera.entrypoints.gateway.admission import AdmissionConfig
    from tessera.entrypoints.gateway.main import ADMISSION_FLAGS, GatewayConfig
    from tessera.entrypoints.serve import GATEWAY_FIELDS_SET_BY_SERVE

    def fields(cls, exclude=()):
        out = set()
        for f in dataclasses.fields(cls):
            if dataclasses.is_dataclass(f.default_factory if f.default_factory is not dataclasses.MISSING else None):
                out |= fields(f.default_factory)
            elif f.name not in exclude:
                out.add((f.metadata.get("flag") or ADMISSION_FLAGS["names"].get(f.name) or f"--{f.name}")
                        .lstrip("-").replace("-", "_"))
        return out
    engine, admission = fields(EngineConfig), fields(AdmissionConfig, ADMISSION_FLAGS["exclude"])
    assert {"threads", "num_kv_blocks", "block_size", "max_num_seqs"} <= engine
    assert engine <= _flag_dests("worker") and engine <= _flag_dests("attention-node")
    assert fields(GatewayConfig) | admission <= _flag_dests("gateway")
    assert (engine | admission | fields(GatewayConfig, GATEWAY_FIELDS_SET_BY_SERVE) | fields(SupervisorConfig)
            <= _flag_dests("serve"))
    assert fields(SupervisorConfig) <= _flag_dests("up")


def test_serve_hands_its_flags_to_the_worker_and_gateway_it_starts():
    from tessera import cli
    from tessera.config import EngineConfig
    from tessera.entrypoints.flags import from_args
    from tessera.entrypoints.serve import process_args
    a = _parse("serve", "--threads", "2", "--max-num-seqs", "8", "--num-kv-blocks", "64", "--dtype", "float32",
               "--max-inflight", "3", "--rpm", "5", "--tpm", "70", "--served-model-name", "m", "--api-key", "sk-1",
               "--max-body-bytes", "1000", "--port", "8123", "--shutdown-grace-s", "7", "--max-restarts", "2")
    gateway, admission = cli._gateway_configs(a, exclude=("worker", "registry", "registry_prefix", "shutdown_grace_s"))
    worker_args, gateway_args = process_args(from_args(EngineConfig, a), gateway, admission, 50999, 7.0)
    w, g = _parse(*worker_args), _parse(*gateway_args)
    assert from_args(EngineConfig, w) == from_args(EngineConfig, a)
    assert (w.port, w.shutdown_grace_s) == (50999, 7.0)
    g_gateway, g_admission = cli._gateway_configs(g)
    assert g_admission == admission and admission.require_key and len(admission.key_digests) == 1
    assert (admission.max_inflight, admission.rpm, admission.tpm, admission.max_body_bytes) == (3, 5, 70, 1000)
    assert (g_gateway.worker, g_gateway.served_model_name, g_gateway.port, g_gateway.shutdown_grace_s) == \
        (("127.0.0.1:50999",), "m", 8123, 7.0)
    assert "sk-1" not in " ".join(gateway_args)      # only the digest travels on a command line


@dataclass(frozen=True)
class Inner:
    depth: int = 1


@dataclass(frozen=True)
class Outer:
    name: str = "a"
    ratio: float | None = None
    tags: tuple[str, ...] = ()
    on: bool = False
    off: bool = True
    inner: Inner = field(default_factory=Inner)
    count: int = field(default=0, metadata={"flag": "--n", "help": "how many"})


def test_generated_flags_round_trip_types_and_nested_configs():
    import argparse

    from tessera.entrypoints.flags import add_flags, from_args, to_argv
    p = argparse.ArgumentParser()
    add_flags(p, Outer)
    assert from_args(Outer, p.parse_args([])) == Outer()
    value = Outer("b", 0.5, ("x", "y"), True, False, Inner(3), 4)
    argv = to_argv(value)
    assert "--n" in argv and "--no-off" in argv and argv.count("--tags") == 2
    assert from_args(Outer, p.parse_args(argv)) == value


def test_deploy_files_commands_parse():
    """The flag names the compose and Kubernetes files use still exist."""
    import pathlib

    import yaml
    root = pathlib.Path(__file__).resolve().parents[1] / "deploy"
    commands = []
    for path in [*root.glob("compose/*.yaml"), *root.glob("k8s/*/*.yaml")]:
        for doc in yaml.safe_load_all(path.read_text()):
            def walk(node):
                if isinstance(node, dict):
                    if node.get("command") == ["tessera"] and "args" in node:
                        commands.append(node["args"])
                    for v in node.values():
                        walk(v)
                elif isinstance(node, list):
                    if len(node) > 1 and node[0] == "tessera":
                        commands.append(node[1:])
                    elif node[:2] == ["CMD", "tessera"]:
                        commands.append(node[2:])
                    for v in node:
                        walk(v)
            walk(doc)
    assert len(commands) > 10
    for argv in commands:
        _parse(*map(str, argv))


def test_an_invalid_config_is_a_usage_error(capsys):
    from tessera.cli import main
    assert main(["worker", "--block-size", "3"]) == 78    # a configuration error: never restarted
    assert "block_size must be a positive power of two" in capsys.readouterr().err
