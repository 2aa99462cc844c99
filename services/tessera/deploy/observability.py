"""The observability stack a topology adds to its compose and Kubernetes renders with
`observability: true`: Grafana Tempo receives every Tessera process's OTLP traces, Prometheus
scrapes the gateways' /metrics (OpenMetrics, so the latency histograms' trace-id exemplars come
along), and Grafana shows both, with the dashboard deploy/grafana/tessera.json and an exemplar
link from a latency point to its trace in Tempo. render.py calls compose_stack() and
kubernetes_stack(); topology.py points the processes at TEMPO_OTLP_ENDPOINT.
"""
from __future__ import annotations

import json
import pathlib
from dataclasses import dataclass, field

import yaml

from tessera.config import ConfigError

TEMPO, PROMETHEUS, GRAFANA = "tempo", "prometheus", "grafana"   # compose services, Kubernetes Deployments and Services
TEMPO_HTTP, OTLP_GRPC, OTLP_HTTP, PROMETHEUS_PORT, GRAFANA_PORT = 3200, 4317, 4318, 9090, 3000
# OTLP over gRPC, the exporters' default protocol; the scheme says plaintext (the stack has no TLS)
TEMPO_OTLP_ENDPOINT = f"http://{TEMPO}:{OTLP_GRPC}"
EXEMPLAR_LABEL = "trace_id"          # the exemplar label tessera/metrics.py writes the trace id under
TEMPO_UID, PROMETHEUS_UID = "tempo", "prometheus"   # Grafana data source uids: the exemplar link names Tempo's
SCRAPE_JOB, SCRAPE_INTERVAL = "tessera-gateway", "15s"
DASHBOARD = pathlib.Path(__file__).resolve().parents[3] / "deploy" / "grafana" / "tessera.json"
DASHBOARD_FROM_COMPOSE = "../grafana/tessera.json"   # relative to deploy/compose/, where compose files live
DASHBOARDS_DIR = "/etc/grafana/dashboards"
# Grafana's admin password is a secret: compose reads it from the environment, Kubernetes from a Secret.
PASSWORD_VAR = "${GRAFANA_ADMIN_PASSWORD:?set GRAFANA_ADMIN_PASSWORD}"
PASSWORD_SECRET, PASSWORD_KEY = "tessera-grafana", "admin-password"
COMPOSE_HELP = ("# The observability stack also needs GRAFANA_ADMIN_PASSWORD; Grafana answers on\n"
                f"#   http://localhost:{GRAFANA_PORT} (user admin).\n")
K8S_HELP = (f"# The observability stack also needs the Secret {PASSWORD_SECRET} (key {PASSWORD_KEY}), e.g.:\n"
            f"#   kubectl create secret generic {PASSWORD_SECRET} \\\n"
            f"#     --from-literal={PASSWORD_KEY}=$(openssl rand -base64 24)\n"
            f"#   kubectl port-forward service/{GRAFANA} {GRAFANA_PORT}   "
            f"(then http://localhost:{GRAFANA_PORT}, user admin)\n")


@dataclass(frozen=True)
class ConfigFile:
    name: str          # compose config and Kubernetes ConfigMap
    directory: str     # where the container reads it (a ConfigMap is mounted as a directory)
    filename: str


@dataclass(frozen=True)
class Part:
    """One service of the stack: the same container in compose and in Kubernetes."""
    name: str
    image: str
    args: tuple[str, ...]
    ports: dict                      # port name (Kubernetes, <= 15 characters) -> port
    files: tuple[ConfigFile, ...]
    data: str                        # the directory it writes (traces, samples, Grafana's database)
    ready: str                       # HTTP readiness path on its first port
    resources: dict = field(default_factory=lambda: {"cpu": "100m", "memory": "256Mi"})


TEMPO_PART = Part(TEMPO, "grafana/tempo:2.6.1", ("-config.file=/etc/tempo/tempo.yaml",),
                  {"http": TEMPO_HTTP, "otlp-grpc": OTLP_GRPC, "otlp-http": OTLP_HTTP},
                  (ConfigFile("tempo-config", "/etc/tempo", "tempo.yaml"),), "/var/tempo", "/ready")
PROMETHEUS_PART = Part(PROMETHEUS, "prom/prometheus:v2.53.0",
                       ("--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus",
                        "--storage.tsdb.retention.time=7d", "--enable-feature=exemplar-storage"),
                       {"web": PROMETHEUS_PORT},
                       (ConfigFile("prometheus-config", "/etc/prometheus", "prometheus.yml"),), "/prometheus", "/-/ready")
GRAFANA_PART = Part(GRAFANA, "grafana/grafana:11.3.0", (), {"web": GRAFANA_PORT},
                    (ConfigFile("grafana-datasources", "/etc/grafana/provisioning/datasources", "tessera.yaml"),
                     ConfigFile("grafana-dashboard-provider", "/etc/grafana/provisioning/dashboards", "tessera.yaml"),
                     ConfigFile("grafana-dashboards", DASHBOARDS_DIR, "tessera.json")),
                    "/var/lib/grafana", "/api/health", {"cpu": "100m", "memory": "128Mi"})
PARTS = (TEMPO_PART, PROMETHEUS_PART, GRAFANA_PART)
GRAFANA_ENV = {"GF_ANALYTICS_REPORTING_ENABLED": "false", "GF_ANALYTICS_CHECK_FOR_UPDATES": "false",
               "GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH": f"{DASHBOARDS_DIR}/tessera.json"}


def tempo_config() -> dict:
    """Tempo as one binary with local storage: OTLP on both standard ports (bound on every
    interface: from Tempo 2.7 on the receivers default to localhost), traces kept 24 h."""
    return {"stream_over_http_enabled": True, "server": {"http_listen_port": TEMPO_HTTP},
            "distributor": {"receivers": {"otlp": {"protocols": {"grpc": {"endpoint": f"0.0.0.0:{OTLP_GRPC}"},
                                                                 "http": {"endpoint": f"0.0.0.0:{OTLP_HTTP}"}}}}},
            "compactor": {"compaction": {"block_retention": "24h"}},
            "storage": {"trace": {"backend": "local", "wal": {"path": f"{TEMPO_PART.data}/wal"},
                                  "local": {"path": f"{TEMPO_PART.data}/blocks"}}},
            "usage_report": {"reporting_enabled": False}}


def prometheus_config(gateways: list[str]) -> dict:
    """One job for the gateways (HOST:PORT each). Prometheus asks for OpenMetrics first in its
    Accept header, which is what makes the gateway write exemplars."""
    return {"global": {"scrape_interval": SCRAPE_INTERVAL, "evaluation_interval": SCRAPE_INTERVAL},
            "scrape_configs": [{"job_name": SCRAPE_JOB, "metrics_path": "/metrics",
                                "static_configs": [{"targets": list(gateways)}]}]}


def grafana_datasources() -> dict:
    """Prometheus, the default, whose exemplars link to the Tempo data source by their trace_id
    label (a point on a latency panel opens its request's trace), and Tempo."""
    prometheus = {"name": "Prometheus", "type": "prometheus", "uid": PROMETHEUS_UID, "access": "proxy",
                  "url": f"http://{PROMETHEUS}:{PROMETHEUS_PORT}", "isDefault": True,
                  "jsonData": {"httpMethod": "POST", "exemplarTraceIdDestinations": [
                      {"name": EXEMPLAR_LABEL, "datasourceUid": TEMPO_UID}]}}
    tempo = {"name": "Tempo", "type": "tempo", "uid": TEMPO_UID, "access": "proxy",
             "url": f"http://{TEMPO}:{TEMPO_HTTP}"}
    return {"apiVersion": 1, "datasources": [prometheus, tempo]}


def grafana_dashboard_provider() -> dict:
    return {"apiVersion": 1, "providers": [{"name": "tessera", "folder": "Tessera", "type": "file",
                                            "disableDeletion": True, "allowUiUpdates": False,
                                            "options": {"path": DASHBOARDS_DIR}}]}


def dashboard_text() -> str:
    if not DASHBOARD.exists():
        raise ConfigError(f"observability: the dashboard {DASHBOARD} is missing (render from a Tessera checkout)")
    text = DASHBOARD.read_text()
    json.loads(text)     # a broken dashboard stops the render, not Grafana's start
    return text


def config_texts(gateways: list[str]) -> dict[str, str]:
    """Each ConfigFile's name -> its text."""
    dump = lambda d: yaml.safe_dump(d, sort_keys=False)   # noqa: E731
    return {"tempo-config": dump(tempo_config()), "prometheus-config": dump(prometheus_config(gateways)),
            "grafana-datasources": dump(grafana_datasources()),
            "grafana-dashboard-provider": dump(grafana_dashboard_provider()), "grafana-dashboards": dashboard_text()}


def compose_stack(gateways: list[str]) -> dict:
    """{"services", "volumes", "configs"} to merge into a compose file. The small configs are
    inline (`content:`; compose interpolates it, hence `$` doubled); the dashboard is the
    repository's own file (compose reads a `file:` config as is)."""
    texts = config_texts(gateways)
    configs = {name: {"content": text.replace("$", "$$")} for name, text in texts.items()
               if name != "grafana-dashboards"}
    configs["grafana-dashboards"] = {"file": DASHBOARD_FROM_COMPOSE}
    services = {}
    for part in PARTS:
        service = {"image": part.image, **({"command": list(part.args)} if part.args else {}),
                   "configs": [{"source": f.name, "target": f"{f.directory}/{f.filename}"} for f in part.files]}
        if part is TEMPO_PART:   # the image runs as user 10001, a fresh volume is root's: a tmpfs (mode 1777)
            service["tmpfs"] = [part.data]
        else:                    # these images own their data directory, which a new volume copies
            service["volumes"] = [f"{part.name}-data:{part.data}"]
        if part is GRAFANA_PART:
            service["environment"] = {**GRAFANA_ENV, "GF_SECURITY_ADMIN_PASSWORD": PASSWORD_VAR}
            service["ports"] = [f"{GRAFANA_PORT}:{GRAFANA_PORT}"]
            service["depends_on"] = [TEMPO, PROMETHEUS]
        services[part.name] = service
    return {"services": services, "volumes": {f"{p.name}-data": {} for p in (PROMETHEUS_PART, GRAFANA_PART)},
            "configs": configs}


def kubernetes_stack(instance: str, gateways: list[str]) -> list[dict]:
    """A ConfigMap per config file, then a Deployment and a Service per part. Data lives in
    emptyDir volumes (lost with the pod): a cluster that keeps traces uses Tempo's object storage."""
    texts = config_texts(gateways)
    docs = []
    for part in PARTS:
        docs += [_config_map(instance, part, f, texts[f.name]) for f in part.files]
        docs += [_deployment(instance, part), _service(instance, part)]
    return docs


def _labels(instance: str, name: str) -> dict:
    return {"app.kubernetes.io/name": name, "app.kubernetes.io/instance": instance,
            "app.kubernetes.io/part-of": "tessera"}


def _config_map(instance: str, part: Part, f: ConfigFile, text: str) -> dict:
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": f.name, "labels": _labels(instance, part.name)}, "data": {f.filename: text}}


def _deployment(instance: str, part: Part) -> dict:
    volumes = [{"name": f.name, "configMap": {"name": f.name}} for f in part.files] + [{"name": "data", "emptyDir": {}}]
    mounts = [{"name": f.name, "mountPath": f.directory, "readOnly": True} for f in part.files] + \
        [{"name": "data", "mountPath": part.data}]
    container = {"name": part.name, "image": part.image, **({"args": list(part.args)} if part.args else {}),
                 "ports": [{"name": n, "containerPort": p} for n, p in part.ports.items()],
                 "resources": {"requests": dict(part.resources)},
                 "readinessProbe": {"httpGet": {"path": part.ready, "port": next(iter(part.ports.values()))},
                                    "periodSeconds": 10},
                 "volumeMounts": mounts}
    if part is GRAFANA_PART:
        container["env"] = [{"name": k, "value": v} for k, v in GRAFANA_ENV.items()] + [
            {"name": "GF_SECURITY_ADMIN_PASSWORD",
             "valueFrom": {"secretKeyRef": {"name": PASSWORD_SECRET, "key": PASSWORD_KEY}}}]
    labels = lambda: _labels(instance, part.name)   # noqa: E731 (fresh dicts: no YAML anchors)
    spec = {"replicas": 1, "strategy": {"type": "Recreate"}, "selector": {"matchLabels": labels()},
            "template": {"metadata": {"labels": labels()}, "spec": {"containers": [container], "volumes": volumes}}}
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": part.name, "labels": labels()},
            "spec": spec}


def _service(instance: str, part: Part) -> dict:
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": {"name": part.name, "labels": _labels(instance, part.name)},
            "spec": {"selector": _labels(instance, part.name),
                     "ports": [{"name": n, "port": p, "targetPort": p} for n, p in part.ports.items()]}}
