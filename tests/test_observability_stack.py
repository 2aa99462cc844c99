"""The observability stack of the renders (`observability: true`, tessera/deploy/observability.py):
off, it changes nothing; on, compose and Kubernetes hold Tempo, Prometheus and Grafana whose
configs parse and name each other's services and ports, and every Tessera process sends its
traces to Tempo. No Docker engine here, so the images never run; the checks that run something
real use Prometheus from the Debian package (`apt-get install prometheus`; CI machines may lack
it, and those tests then skip): `promtool check config` on the rendered config, and the Prometheus
binary scraping a real `tessera serve` with that config, keeping the exemplar that links a
request's latency to its trace id, which reaches an OTLP receiver standing in for Tempo."""
from __future__ import annotations

import contextlib
import json
import pathlib
import re
import shutil
import subprocess
import time
from dataclasses import replace

import httpx
import openai
import pytest
import yaml

import servers
from otlp_receiver import Receiver
from tessera.config import ConfigError
from tessera.deploy import observability as obs
from tessera.deploy.render import compose, kubernetes, render
from tessera.deploy.topology import LOCAL, PODS, SERVICES, Topology

ROOT = pathlib.Path(__file__).resolve().parent.parent
TOPOLOGIES = sorted((ROOT / "deploy" / "topologies").glob("*.yaml"))
SHIPPED_ON = ROOT / "deploy" / "topologies" / "disagg-dense.yaml"
STACK = {p.name for p in obs.PARTS}
FLAGS = ("--otlp-traces-endpoint", "--trace-replica")


def _without_endpoint(argv: list[str]) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip or a in FLAGS:
            skip = not skip
            continue
        out.append(a)
    return out


def _endpoint(argv: list[str]) -> str | None:
    return argv[argv.index(FLAGS[0]) + 1] if FLAGS[0] in argv else None


def _is_stack(doc: dict) -> bool:
    return doc["metadata"]["labels"].get("app.kubernetes.io/part-of") == "tessera"


@pytest.mark.parametrize("path", TOPOLOGIES, ids=lambda p: p.stem)
def test_the_option_adds_the_stack_and_the_endpoint_and_nothing_else(path):
    """On minus (the stack, the traces flags) == off, for every topology; off holds no stack."""
    topology = Topology.load(path)
    on, off = replace(topology, observability=True), replace(topology, observability=False)
    c_on, c_off = compose(on), compose(off)
    assert not STACK & set(c_off["services"]) and "configs" not in c_off
    assert set(c_on["services"]) - set(c_off["services"]) == STACK
    for name, service in c_off["services"].items():
        mine = dict(c_on["services"][name])
        if mine["command"][0] == "tessera":
            mine["command"] = _without_endpoint(mine["command"])
        assert mine == service, name
    assert {k: v for k, v in c_on["volumes"].items() if not k.startswith(tuple(STACK))} == c_off["volumes"]
    k_on, k_off = kubernetes(on), kubernetes(off)
    assert not any(_is_stack(d) for d in k_off)
    tessera_on = [d for d in k_on if not _is_stack(d)]
    for d in tessera_on:
        for container in d.get("spec", {}).get("template", {}).get("spec", {}).get("containers", []):
            if container.get("command") == ["tessera"]:
                container["args"] = _without_endpoint(container["args"])
    assert tessera_on == k_off
    for target in ("compose", "k8s"):   # the header says what the stack needs only when it is there
        assert "GRAFANA" not in render(off, target, "x.yaml") and "grafana" in render(on, target, "x.yaml")


def test_tessera_up_is_not_pointed_at_the_stack():
    """`tessera up` runs topology.processes(LOCAL): the in-cluster name `tempo` would not resolve
    there, so the option changes no local process; an explicit endpoint wins everywhere."""
    topology = Topology.load(SHIPPED_ON)
    assert topology.observability
    assert topology.processes(LOCAL) == replace(topology, observability=False).processes(LOCAL)
    assert all(_endpoint(list(p.argv)) is None for p in topology.processes(LOCAL))
    explicit = topology.with_overrides(otlp_traces_endpoint="http://collector.internal:4317")
    for place in (LOCAL, SERVICES, PODS):
        assert {_endpoint(list(p.argv)) for p in explicit.processes(place) if p.role != "redis"} == \
            {"http://collector.internal:4317"}
    assert STACK <= set(compose(explicit)["services"])   # the stack is still rendered, only unused


def test_the_option_is_a_boolean(tmp_path):
    text = SHIPPED_ON.read_text().replace("observability: true", "observability: yes please")
    (tmp_path / "t.yaml").write_text(text)
    with pytest.raises(ConfigError, match="observability is true or false"):
        Topology.load(tmp_path / "t.yaml")


def _compose_configs(spec: dict) -> dict[str, str]:
    """Each inline config's text as the container reads it (compose turns `$$` into `$`)."""
    return {name: c["content"].replace("$$", "$") for name, c in spec["configs"].items() if "content" in c}


def _mounted(spec: dict, service: str, target: str) -> str:
    (source,) = [c["source"] for c in spec["services"][service]["configs"] if c["target"] == target]
    return source


def test_the_shipped_compose_file_wires_the_stack_together():
    spec = yaml.safe_load((ROOT / "deploy" / "compose" / SHIPPED_ON.name).read_text())
    services, texts = spec["services"], _compose_configs(spec)
    for part in obs.PARTS:
        assert re.fullmatch(r"[\w./-]+:v?\d+\.\d+\.\d+", services[part.name]["image"]), "images are pinned"
        for c in services[part.name]["configs"]:
            assert c["source"] in spec["configs"]
    # Tempo receives OTLP on the port every Tessera process sends to
    tempo = yaml.safe_load(texts[_mounted(spec, "tempo", _flag(services["tempo"]["command"], "-config.file"))])
    protocols = tempo["distributor"]["receivers"]["otlp"]["protocols"]
    assert protocols["grpc"]["endpoint"] == "0.0.0.0:4317" and protocols["http"]["endpoint"] == "0.0.0.0:4318"
    assert tempo["storage"]["trace"]["backend"] == "local"
    gateways = []
    for name, s in services.items():
        if s.get("command", [""])[0] == "tessera":
            assert _endpoint(s["command"]) == "http://tempo:4317", name
            if s["command"][1] == "gateway":
                gateways.append(f"{name}:{_flag(s['command'], '--port')}")
    # Prometheus scrapes every gateway by service name and port, keeping exemplars
    command = services["prometheus"]["command"]
    assert "--enable-feature=exemplar-storage" in command
    prometheus = yaml.safe_load(texts[_mounted(spec, "prometheus", _flag(command, "--config.file"))])
    (job,) = prometheus["scrape_configs"]
    assert job["static_configs"] == [{"targets": gateways}] and job["metrics_path"] == "/metrics"
    # Grafana: data sources at the two services, the exemplar link to Tempo, the dashboard, the port
    grafana = services["grafana"]
    _check_datasources(yaml.safe_load(texts[_mounted(spec, "grafana", _datasources_file())]),
                       tempo["server"]["http_listen_port"])
    provider = yaml.safe_load(texts[_mounted(spec, "grafana", _provider_file())])
    dashboards = provider["providers"][0]["options"]["path"]
    dashboard = spec["configs"][_mounted(spec, "grafana", f"{dashboards}/tessera.json")]
    assert (ROOT / "deploy" / "compose" / dashboard["file"]).resolve() == ROOT / "deploy" / "grafana" / "tessera.json"
    assert grafana["ports"] == ["3000:3000"]
    assert grafana["environment"]["GF_SECURITY_ADMIN_PASSWORD"] == \
        "${GRAFANA_ADMIN_PASSWORD:?set GRAFANA_ADMIN_PASSWORD}"   # a secret: from the environment


def _flag(argv: list[str], name: str) -> str:
    """A flag's value, written `NAME VALUE` or `NAME=VALUE`."""
    for i, a in enumerate(argv):
        if a == name:
            return argv[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    raise AssertionError(f"{name} not in {argv}")


def _datasources_file() -> str:
    return "/etc/grafana/provisioning/datasources/tessera.yaml"


def _provider_file() -> str:
    return "/etc/grafana/provisioning/dashboards/tessera.yaml"


def _check_datasources(config: dict, tempo_port: int) -> None:
    by_type = {d["type"]: d for d in config["datasources"]}
    prometheus, tempo = by_type["prometheus"], by_type["tempo"]
    assert prometheus["url"] == "http://prometheus:9090" and prometheus["isDefault"]
    assert tempo["url"] == f"http://tempo:{tempo_port}"
    # the label the gateway writes its exemplars' trace ids under (tessera/metrics.py)
    assert prometheus["jsonData"]["exemplarTraceIdDestinations"] == \
        [{"name": "trace_id", "datasourceUid": tempo["uid"]}]


def test_the_shipped_kubernetes_file_wires_the_stack_together():
    topology = Topology.load(SHIPPED_ON)
    docs = list(yaml.safe_load_all((ROOT / "deploy" / "k8s" / SHIPPED_ON.stem / "tessera.yaml").read_text()))
    by_kind = {k: {d["metadata"]["name"]: d for d in docs if d["kind"] == k}
               for k in ("Deployment", "Service", "ConfigMap")}
    services = by_kind["Service"]
    files = {}   # path in the container -> text, through each Deployment's ConfigMap mounts
    for part in obs.PARTS:
        (container,) = by_kind["Deployment"][part.name]["spec"]["template"]["spec"]["containers"]
        volumes = {v["name"]: v for v in by_kind["Deployment"][part.name]["spec"]["template"]["spec"]["volumes"]}
        for m in container["volumeMounts"]:
            if "configMap" in volumes[m["name"]]:
                for key, text in by_kind["ConfigMap"][volumes[m["name"]]["configMap"]["name"]]["data"].items():
                    files[f"{m['mountPath']}/{key}"] = text
        ports = {p["containerPort"] for p in container["ports"]}
        assert ports == {p["port"] for p in services[part.name]["spec"]["ports"]}
        assert services[part.name]["spec"]["selector"] == \
            by_kind["Deployment"][part.name]["spec"]["template"]["metadata"]["labels"]
        assert container["readinessProbe"]["httpGet"]["port"] in ports
    tempo_args = by_kind["Deployment"]["tempo"]["spec"]["template"]["spec"]["containers"][0]["args"]
    tempo = yaml.safe_load(files[_flag(tempo_args, "-config.file")])
    assert {p["port"] for p in services["tempo"]["spec"]["ports"]} >= {4317, 4318, tempo["server"]["http_listen_port"]}
    for name, d in by_kind["Deployment"].items():
        (container,) = d["spec"]["template"]["spec"]["containers"]
        if container.get("command") == ["tessera"]:
            assert _endpoint(container["args"]) == "http://tempo:4317", name
    prom_args = by_kind["Deployment"]["prometheus"]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--enable-feature=exemplar-storage" in prom_args
    (job,) = yaml.safe_load(files[_flag(prom_args, "--config.file")])["scrape_configs"]
    gateway = topology.roles["gateway"].port
    assert job["static_configs"] == [{"targets": [f"gateway:{gateway}"]}]
    assert gateway in [p["port"] for p in services["gateway"]["spec"]["ports"]]
    _check_datasources(yaml.safe_load(files[_datasources_file()]), tempo["server"]["http_listen_port"])
    provider = yaml.safe_load(files[_provider_file()])
    dashboard = files[provider["providers"][0]["options"]["path"] + "/tessera.json"]
    assert dashboard == (ROOT / "deploy" / "grafana" / "tessera.json").read_text() and json.loads(dashboard)
    (grafana,) = by_kind["Deployment"]["grafana"]["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e for e in grafana["env"]}
    assert env["GF_SECURITY_ADMIN_PASSWORD"]["valueFrom"]["secretKeyRef"] == {"name": "tessera-grafana",
                                                                            "key": "admin-password"}


def _rendered_prometheus_configs() -> dict[str, str]:
    spec = yaml.safe_load((ROOT / "deploy" / "compose" / SHIPPED_ON.name).read_text())
    docs = yaml.safe_load_all((ROOT / "deploy" / "k8s" / SHIPPED_ON.stem / "tessera.yaml").read_text())
    (k8s,) = [d["data"]["prometheus.yml"] for d in docs if d["kind"] == "ConfigMap" and "prometheus.yml" in d["data"]]
    return {"compose": _compose_configs(spec)["prometheus-config"], "k8s": k8s}


@pytest.mark.skipif(shutil.which("promtool") is None,
                    reason="promtool is not installed (Debian: apt-get install prometheus); CI machines may lack it")
@pytest.mark.parametrize("target", ["compose", "k8s"])
def test_promtool_accepts_the_rendered_prometheus_config(target, tmp_path):
    (tmp_path / "prometheus.yml").write_text(_rendered_prometheus_configs()[target])
    r = subprocess.run(["promtool", "check", "config", str(tmp_path / "prometheus.yml")], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.e2e
@pytest.mark.skipif(shutil.which("prometheus") is None,
                    reason="prometheus is not installed (Debian: apt-get install prometheus); CI machines may lack it")
def test_prometheus_keeps_the_exemplar_that_leads_to_the_trace(tmp_path, monkeypatch):
    """The rendered Prometheus config and flags, its scrape target moved to a `tessera serve`
    gateway here; the gateway's traces go where the rendered gateway's go, `tempo` being an OTLP
    receiver here. One chat request: Prometheus stores its latency with an exemplar whose
    trace_id (the label Grafana's exemplar link reads) is the request's, and the trace arrived."""
    spec = yaml.safe_load((ROOT / "deploy" / "compose" / SHIPPED_ON.name).read_text())
    (gateway_cmd,) = [s["command"] for s in spec["services"].values()
                      if s.get("command", [])[:2] == ["tessera", "gateway"]]
    receiver = Receiver()
    endpoint = _endpoint(gateway_cmd).replace(f"{obs.TEMPO}:{obs.OTLP_GRPC}", f"127.0.0.1:{receiver.port}")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "200")
    try:
        with servers.tessera_serve("--max-model-len", "1024", "--graph-warmup-s", "0",
                                   "--otlp-traces-endpoint", endpoint) as url, \
                _prometheus(spec, url.removeprefix("http://"), tmp_path) as prom:
            client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
            raw = client.chat.completions.with_raw_response.create(
                model=client.models.list().data[0].id, messages=[{"role": "user", "content": "Say hello."}],
                max_tokens=4, temperature=0)
            assert raw.parse().choices[0].message.content is not None
            trace_id = raw.headers["x-trace-id"]
            found = []

            def stored() -> bool:
                r = httpx.get(prom + "/api/v1/query_exemplars", params={
                    "query": "tessera_e2e_request_latency_seconds_bucket", "start": time.time() - 600,
                    "end": time.time() + 60}).json()
                found[:] = [e["labels"] for series in r["data"] for e in series["exemplars"]]
                return any(labels.get(obs.EXEMPLAR_LABEL) == trace_id for labels in found)
            servers.wait_until(stored, 60, f"an exemplar with trace_id {trace_id} in Prometheus (had {found})")
            receiver.wait_for(trace_id, {"POST /v1/chat/completions"})
            (target,) = httpx.get(prom + "/api/v1/targets").json()["data"]["activeTargets"]
            assert target["health"] == "up" and target["labels"]["job"] == obs.SCRAPE_JOB
    finally:
        receiver.server.stop(0)


@contextlib.contextmanager
def _prometheus(spec: dict, target: str, tmp: pathlib.Path):
    """The Debian prometheus binary with the rendered config (its target and interval changed)
    and the rendered command's feature flags, on a free port; yields its base URL."""
    config = yaml.safe_load(_compose_configs(spec)["prometheus-config"])
    config["global"]["scrape_interval"] = "1s"
    config["scrape_configs"][0]["static_configs"] = [{"targets": [target]}]
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
    features = [a for a in spec["services"]["prometheus"]["command"] if a.startswith("--enable-feature")]
    url = f"http://127.0.0.1:{servers.free_port()}"
    proc = subprocess.Popen(["prometheus", f"--config.file={tmp / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp / 'data'}", f"--web.listen-address={url[7:]}", *features],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        servers.wait_until(lambda: proc.poll() is not None or servers._http_ok(url + "/-/ready", 2), 30,
                           "prometheus ready")
        assert proc.poll() is None, f"prometheus exited with {proc.returncode}"
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
