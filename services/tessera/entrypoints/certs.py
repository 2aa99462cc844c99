"""`tessera certs FILE`: a deployment's CA and one certificate per role of the topology, for
compose (--out DIR: DIR/<role>/{ca.crt,tls.crt,tls.key}, mounted at each container's
TESSERA_TLS_DIR; DIR/ca/ keeps the CA's key for renewals) or Kubernetes (--target k8s: the
Secrets tessera-tls-<role> and tessera-secrets as YAML, printed or written to --out).
--ca DIR signs with an existing CA (ca.crt, ca.key) instead of a new one: renew leaves without
touching anyone's trust."""
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


def main(file: str, out: str | None, target: str, days: float, ca_dir: str | None) -> int:
    topology = Topology.load(file)
    deployment = deployment_name(topology)
    roles = [role_name(r) for r in topology.roles if r != "redis"]
    ca = _ca(ca_dir, deployment, days)
    if target == "files":
        if out is None:
            raise ConfigError("--target files writes a directory: give --out DIR")
        dirs = write_role_dirs(out, deployment, roles, days, ca)
        if ca_dir is None:
            (pathlib.Path(out) / "ca").mkdir(mode=0o700, exist_ok=True)
            _private(pathlib.Path(out) / "ca" / "ca.crt", ca[0])
            _private(pathlib.Path(out) / "ca" / "ca.key", ca[1])
        print(f"tessera certs: {deployment}: {', '.join(dirs)} in {out} (CA key in {out}/ca unless --ca)")
        return 0
    with tempfile.TemporaryDirectory() as scratch:
        dirs = write_role_dirs(scratch, deployment, roles, days, ca)
        docs = [k8s_secret(tls_secret(role), d) for role, d in dirs.items()]
    if topology.registry:
        password = base64.b64encode(secrets.token_urlsafe(24).encode()).decode()
        docs.append({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": SECRET}, "type": "Opaque",
                     "data": {"redis-password": password}})
    text = yaml.safe_dump_all(docs, sort_keys=False)
    if out is None:
        sys.stdout.write(text)
    else:
        _private(pathlib.Path(out), text.encode())
    return 0
