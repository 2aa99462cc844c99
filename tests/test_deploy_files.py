"""Compose and Kubernetes files, without a Docker engine or a cluster: they are exactly what
`tessera render` makes of the topology files (one source of truth); the Kubernetes objects agree
with the topology (image, commands, ports, probes, replicas); and every compose file's services
run here as local processes (service names -> 127.0.0.1, each port moved to a free one), their
own healthcheck commands pass (with each container's certificate, as `tessera certs` writes
them), and a chat request through the gateway gets an answer; where the file has the
observability stack, its Tempo is an OTLP receiver here and the request's trace must reach it.
No secret is in any rendered file. (tests/test_observability_stack.py checks the stack itself.)"""
from __future__ import annotations

import contextlib
import os
import pathlib
import re
import subprocess
import sys
import time

import httpx
import pytest
import yaml

from otlp_receiver import Receiver
from servers import free_port, wait_until
from tessera.deploy import observability
from tessera.deploy.render import IMAGE, VLLM_IMAGE, render
from tessera.deploy.topology import Topology
from tessera.deploy.up import stop

ROOT = pathlib.Path(__file__).resolve().parent.parent
TOPOLOGIES = sorted((ROOT / "deploy" / "topologies").glob("*.yaml"))
SECRETS = {"REDIS_PASSWORD": "compose-test-pw"}
STACK = {p.name for p in observability.PARTS}    # the observability stack's services: not run here


def tessera_services(spec: dict) -> dict:
    """A compose file's services, less the observability stack's."""
    return {name: s for name, s in spec["services"].items() if name not in STACK}


def tessera_objects(docs: list[dict], kind: str) -> dict:
    """The Kubernetes objects of one kind that Tessera's roles make (the stack's are labelled apart)."""
    return {d["metadata"]["name"]: d for d in docs
            if d["kind"] == kind and d["metadata"]["labels"]["app.kubernetes.io/name"] == "tessera"}


def _rel(path: pathlib.Path) -> str:
    return str(path.relative_to(ROOT))


@pytest.mark.parametrize("path", TOPOLOGIES, ids=lambda p: p.stem)
def test_rendered_files_match_the_topology(path):
    topology = Topology.load(path)
    for target, out in (("compose", ROOT / "deploy/compose" / path.name),
                        ("k8s", ROOT / "deploy/k8s" / path.stem / "tessera.yaml")):
        assert out.exists(), f"{_rel(out)} missing: run `make render`"
        assert out.read_text() == render(topology, target, _rel(path)), f"{_rel(out)} is stale: run `make render`"


@pytest.mark.parametrize("path", TOPOLOGIES, ids=lambda p: p.stem)
def test_kubernetes_objects_agree_with_the_topology(path):
    topology = Topology.load(path)
    docs = list(yaml.safe_load_all((ROOT / "deploy/k8s" / path.stem / "tessera.yaml").read_text()))
    deployments, services = tessera_objects(docs, "Deployment"), tessera_objects(docs, "Service")
    replicas = {}
    for name, d in deployments.items():
        spec = d["spec"]["template"]["spec"]
        (container,) = spec["containers"]
        args, port = container["args"], container["ports"][0]["containerPort"]
        assert d["spec"]["selector"]["matchLabels"] == d["spec"]["template"]["metadata"]["labels"]
        assert re.search(rf"--port {port}\b", " ".join(args))      # redis: inside its bash -c
        assert container["resources"]["requests"]["cpu"] and container["resources"]["requests"]["memory"]
        role = "redis" if container["image"].startswith("redis") else args[0].replace("-", "_")
        replicas[role] = replicas.get(role, 0) + d["spec"]["replicas"]
        if role == "redis":
            continue
        vllm = "--engine" in args and args[args.index("--engine") + 1] == "vllm"
        assert container["image"] == (VLLM_IMAGE if vllm else IMAGE) and container["command"] == ["tessera"]
        probes = [container[k] for k in ("livenessProbe", "readinessProbe", "startupProbe")]
        if role == "gateway":
            assert [p["httpGet"]["path"] for p in probes] == ["/health/live", "/health/ready", "/health/live"]
            assert {p["httpGet"]["port"] for p in probes} == {port}
        else:   # gRPC health with the pod's own certificate (its port demands one)
            assert [p["exec"]["command"] for p in probes] == [["tessera", "probe", f"127.0.0.1:{port}"]] * 3
        if any("$(POD_IP)" in a for a in args):
            assert container["env"][0]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        for a in args:   # every address it dials is a Service of this file, on that Service's port
            for host, p in re.findall(r"([a-z][a-z0-9-]*-\d+):(\d+)", a):
                assert int(p) in [x["port"] for x in services[host]["spec"]["ports"]], (name, a)
    assert replicas == {role: r.replicas for role, r in topology.roles.items()}
    _secrets_come_from_the_operators_secret(deployments.values(), topology.registry)
    for name, s in services.items():
        assert s["spec"]["selector"] == deployments[name]["spec"]["selector"]["matchLabels"]


def _secrets_come_from_the_operators_secret(deployments, registry: bool) -> None:
    """Every tessera container mounts its role's certificate Secret (tessera-tls-<role>) at
    TESSERA_TLS_DIR, and (with a registry) Redis's password comes from the Secret
    tessera-secrets by environment: no command line holds it."""
    for d in deployments:
        pod = d["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        env = {e["name"]: e for e in container.get("env", [])}
        assert " ".join(container["args"]).count("REDIS_PASSWORD") == \
            (1 if container["image"].startswith("redis") else 0)      # redis: a variable read from stdin
        if registry:
            assert env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {"name": "tessera-secrets",
                                                                          "key": "redis-password"}
        if container["image"].startswith("redis"):
            continue
        role = container["args"][0]
        (tls,) = [v for v in pod["volumes"] if v["name"] == "tls"]
        assert tls["secret"]["secretName"] == f"tessera-tls-{role}"
        (mount,) = [m for m in container["volumeMounts"] if m["name"] == "tls"]
        assert mount["mountPath"] == env["TESSERA_TLS_DIR"]["value"] and mount["readOnly"]


@pytest.mark.parametrize("path", TOPOLOGIES, ids=lambda p: p.stem)
def test_compose_files_take_secrets_from_the_environment(path):
    services = tessera_services(yaml.safe_load((ROOT / "deploy/compose" / path.name).read_text()))
    registry = Topology.load(path).registry
    for service in services.values():
        if registry:
            assert service["environment"]["REDIS_PASSWORD"] == "${REDIS_PASSWORD:?set REDIS_PASSWORD}"
        if service["image"].startswith("redis"):
            assert "--requirepass" not in service["command"]
            continue
        role = service["command"][1]
        assert service["environment"]["TESSERA_TLS_DIR"] == "/etc/tessera/tls"
        assert f"${{TESSERA_CERTS:?set TESSERA_CERTS}}/{role}:/etc/tessera/tls:ro" in service["volumes"]
        for a in service["command"]:
            assert "REDIS_PASSWORD" not in a and not re.match(r"redis://[^/]*@", a)


class LocalCompose:
    """A compose file's services as processes here: names -> 127.0.0.1, ports -> free ports.
    The observability stack's services do not run; `tempo` is the receiver at `traces_port`."""

    def __init__(self, path: pathlib.Path, tmp: pathlib.Path, certs: pathlib.Path,
                 traces_port: int | None = None) -> None:
        self.spec = yaml.safe_load(path.read_text())
        self.services = tessera_services(self.spec)
        self.ports = {}
        for s in self.services.values():
            cmd = " ".join(s["command"])
            self.ports[re.search(r"--port (\d+)", cmd)[1]] = str(free_port())
        if traces_port is not None:
            self.ports[str(observability.OTLP_GRPC)] = str(traces_port)
        self.tmp, self.vars = tmp, {**SECRETS, "TESSERA_CERTS": str(certs)}

    def interpolate(self, a: str) -> str:
        """What compose does to ${VAR}, ${VAR:?message} and $$: here with self.vars (and only them)."""
        return re.sub(r"\$\{(\w+)(:\?[^}]*)?\}", lambda m: self.vars[m[1]], a).replace("$$", "$")

    def env(self, service: dict) -> dict:
        """The service's environment, a mounted directory's path in it replaced by its source here."""
        mounts = dict(reversed(self.interpolate(v).split(":")[:2]) for v in service.get("volumes", [])
                      if v.startswith("${"))
        env = {k: self.interpolate(v) for k, v in service.get("environment", {}).items()}
        return dict(os.environ, **{k: mounts.get(v, v) for k, v in env.items()})

    def rewrite(self, args: list[str]) -> list[str]:
        out = []
        for i, a in enumerate(map(self.interpolate, args)):
            if i and args[i - 1] in ("--port", "-p"):
                a = self.ports[a]
            elif a in self.services or a in STACK:
                a = "127.0.0.1"
            a = re.sub(r"([\w.-]+):(\d+)", lambda m: (f"127.0.0.1:{self.ports[m[2]]}" if m[2] in self.ports
                                                      else m[0]), a)
            a = re.sub(r"(--port|-p) (\d+)", lambda m: f"{m[1]} {self.ports.get(m[2], m[2])}", a)   # inside sh -c
            out.append("127.0.0.1" if a == "0.0.0.0" else a)
        return out

    def argv(self, command: list[str]) -> list[str]:
        command = self.rewrite(command)
        return [sys.executable, "-m", "tessera.cli", *command[1:]] if command[0] == "tessera" else command

    def healthy(self, service: dict) -> bool:
        test = service["healthcheck"]["test"]
        assert test[0] == "CMD"
        return subprocess.run(self.argv(test[1:]), capture_output=True, timeout=30, env=self.env(service)).returncode == 0

    @contextlib.contextmanager
    def up(self, timeout_s: float = 240):
        procs = []
        try:
            for name, service in self.services.items():   # file order is dependency order
                assert set(service.get("depends_on", {})) <= set(self.services)
                procs.append(subprocess.Popen(self.argv(service["command"]), cwd=self.tmp,
                                              env=self.env(service), stdout=subprocess.DEVNULL))
            deadline = time.monotonic() + timeout_s
            for (name, service), proc in zip(self.services.items(), procs):
                while not self.healthy(service):
                    assert proc.poll() is None, f"{name} exited with {proc.returncode}"
                    assert time.monotonic() < deadline, f"{name} never passed its healthcheck"
                    time.sleep(1)
            (published,) = [s["ports"] for s in self.services.values() if "ports" in s]
            yield f"http://127.0.0.1:{self.ports[published[0].split(':')[1]]}"
        finally:
            stop(procs, timeout_s=20)


@pytest.mark.e2e
@pytest.mark.parametrize("path", sorted((ROOT / "deploy" / "compose").glob("*.yaml")), ids=lambda p: p.stem)
def test_compose_services_run_as_local_processes(path, tmp_path, monkeypatch):
    topology = ROOT / "deploy" / "topologies" / path.name
    subprocess.run([sys.executable, "-m", "tessera.cli", "certs", str(topology), "--out", str(tmp_path / "certs")],
                   check=True)   # what the compose file's header tells the operator to run
    receiver = Receiver() if observability.TEMPO in yaml.safe_load(path.read_text())["services"] else None
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "200")     # spans leave within 0.2 s, not 5 s
    compose = LocalCompose(path, tmp_path, tmp_path / "certs", receiver and receiver.port)
    commands = [s["command"] for s in compose.services.values()]
    if any(c[c.index("--engine") + 1] == "vllm" for c in commands if "--engine" in c) and \
            not (ROOT / ".venv-vllm" / "bin" / "python").exists():
        pytest.skip("its vLLM workers need `make setup-vllm` (.venv-vllm)")
    published = [s for s in compose.services.values() if "ports" in s]
    assert len(published) == 1 and published[0]["command"][1] == "gateway"   # only the gateway's port
    try:
        with compose.up() as url:
            model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
            r = httpx.post(url + "/v1/chat/completions", timeout=120, json={
                "model": model, "max_tokens": 8, "temperature": 0,
                "messages": [{"role": "user", "content": "What is the capital of France?"}]})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["message"]["content"]
            if receiver:   # the request's trace at the stack's Tempo: the gateway's spans and its worker's
                trace_id = r.headers["x-trace-id"]
                names = lambda: {res["service.name"] for res, _ in receiver.trace(trace_id)}   # noqa: E731
                wait_until(lambda: len(names()) >= 2, 30, f"spans of trace {trace_id} from two processes")
                assert "tessera-gateway" in names()
    finally:
        if receiver:
            receiver.server.stop(0)
