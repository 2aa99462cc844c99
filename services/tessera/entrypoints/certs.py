"""`tessera certs FILE`: a deployment's CA and one certificate per role of the topology, for
compose (--out DIR: DIR/<role>/{ca.crt,tls.crt,tls.key}, mounted at each container's
TESSERA_TLS_DIR; DIR/ca/ keeps the CA's key for renewals) or Kubernetes (--target k8s: the
Secrets tessera-tls-<role> and tessera-secrets as YAML, printed or written to --out).
--ca DIR signs with an existing CA (ca.crt, ca.key) instead of a new one: renew leaves without
touching anyone's trust (for k8s, a renewal prints the TLS Secrets only: tessera-secrets keeps
its Redis password). --ca-out DIR keeps a new CA's certificate and key for those renewals."""
from __future__ import annotations

import base64
import os
import pathlib
import secrets
import sys
import tempfile

import yaml

from tessera.config import ConfigError
from tessera.deploy.render import SECRET, tls_secret
from tessera.deploy.topology import Topology
from tessera.deploy.up import deployment_name
from tessera.mtls.certs import k8s_secret, make_ca, write_role_dirs
from tessera.mtls.names import role_name


def add_args(p) -> None:
    """`tessera certs`'s flags."""
    p.add_argument("file", help="topology file: its name and roles")
    p.add_argument("--target", default="files", choices=["files", "k8s"],
                   help="files: DIR/<role>/{ca.crt,tls.crt,tls.key} to mount (compose); k8s: Secrets as YAML")
    p.add_argument("--out", default=None, help="directory (files) or YAML file (k8s; default stdout)")
    p.add_argument("--days", type=float, default=90.0, help="validity of the role certificates")
    p.add_argument("--ca", default=None, help="sign with this CA directory (ca.crt, ca.key) instead of a new CA")
    p.add_argument("--ca-out", default=None, help="keep a new CA's ca.crt and ca.key here (files: DIR/ca)")


def _ca(ca_dir: str | None, deployment: str, days: float) -> tuple[bytes, bytes]:
    if ca_dir is None:
        return make_ca(deployment, days=max(days, 365))
    d = pathlib.Path(ca_dir)
    try:
        return (d / "ca.crt").read_bytes(), (d / "ca.key").read_bytes()
    except OSError as e:
        raise ConfigError(f"--ca {ca_dir}: {e.strerror}: {e.filename}") from None


def _private(path: pathlib.Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def run(a) -> int:
    """`tessera certs` with its parsed flags."""
    return main(a.file, a.out, a.target, a.days, a.ca, a.ca_out)


def main(file: str, out: str | None, target: str, days: float, ca_dir: str | None, ca_out: str | None = None) -> int:
    topology = Topology.load(file)
    deployment = deployment_name(topology)
    roles = [role_name(r) for r in topology.roles if r != "redis"]
    ca = _ca(ca_dir, deployment, days)
    if target == "files":
        if out is None:
            raise ConfigError("--target files writes a directory: give --out DIR")
        dirs = write_role_dirs(out, deployment, roles, days, ca)
        ca_out = ca_out or (None if ca_dir else str(pathlib.Path(out) / "ca"))
        print(f"tessera certs: {deployment}: {', '.join(dirs)} in {out}")
    if ca_out and ca_dir is None:
        pathlib.Path(ca_out).mkdir(mode=0o700, parents=True, exist_ok=True)
        _private(pathlib.Path(ca_out) / "ca.crt", ca[0])
        _private(pathlib.Path(ca_out) / "ca.key", ca[1])
    if target == "files":
        return 0
    with tempfile.TemporaryDirectory() as scratch:
        dirs = write_role_dirs(scratch, deployment, roles, days, ca)
        docs = [k8s_secret(tls_secret(role), d) for role, d in dirs.items()]
    if topology.registry and ca_dir is None:     # a new deployment; a renewal keeps its password
        password = base64.b64encode(secrets.token_urlsafe(24).encode()).decode()
        docs.append({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": SECRET}, "type": "Opaque",
                     "data": {"redis-password": password}})
    text = yaml.safe_dump_all(docs, sort_keys=False)
    if out is None:
        sys.stdout.write(text)
    else:
        _private(pathlib.Path(out), text.encode())
    return 0
