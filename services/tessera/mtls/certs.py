"""A deployment's CA and one certificate per role (the `cryptography` package): `tessera up` and
`tessera serve` make a throwaway set at start in a private directory; `tessera certs` writes
one for compose (files to mount) or Kubernetes (one Secret per role).

A role's directory holds what cert-manager puts in a Certificate's Secret, under the same
names, so either can be mounted where TESSERA_TLS_DIR points: ca.crt (the CA, or several CAs
during a rotation), tls.crt and tls.key (mode 0600). Keys are EC P-256: a handshake costs a
fraction of an RSA one, and links are long-lived anyway.
"""
from __future__ import annotations

import base64
import datetime as dt
import os
import pathlib

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from tessera.mtls.names import ROLES, SERVES, role_name, service_host, spiffe_id

CA_FILE, CERT_FILE, KEY_FILE = "ca.crt", "tls.crt", "tls.key"


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "tessera"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common)])


def _pem_key(key) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _pem_cert(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _builder(subject: x509.Name, issuer: x509.Name, public_key, days: float) -> x509.CertificateBuilder:
    now = dt.datetime.now(dt.timezone.utc)
    return (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer).public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))   # clocks of a cluster differ a little
            .not_valid_after(now + dt.timedelta(days=days)))


def make_ca(deployment: str, days: float = 365) -> tuple[bytes, bytes]:
    """(certificate PEM, key PEM) of a new CA for this deployment."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = _name(f"tessera {deployment} CA")
    cert = (_builder(name, name, key.public_key(), days)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
            .sign(key, hashes.SHA256()))
    return _pem_cert(cert), _pem_key(key)


def make_role_cert(ca_cert_pem: bytes, ca_key_pem: bytes, deployment: str, role: str,
                   days: float = 90) -> tuple[bytes, bytes]:
    """(certificate PEM, key PEM) for one role: its SPIFFE id, and a DNS name per service it
    serves; usable as server and as client (every process is both)."""
    role = role_name(role)
    ca_cert = x509.load_pem_x509_certificate(ca_cert_pem)
    ca_key = serialization.load_pem_private_key(ca_key_pem, password=None)
    key = ec.generate_private_key(ec.SECP256R1())
    sans = [x509.UniformResourceIdentifier(spiffe_id(deployment, role)),
            *(x509.DNSName(service_host(deployment, s)) for s in SERVES[role])]
    cert = (_builder(_name(f"{role}.{deployment}"), ca_cert.subject, key.public_key(), days)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    return _pem_cert(cert), _pem_key(key)


def _write_private(path: pathlib.Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def write_role_dirs(out: str | os.PathLike, deployment: str, roles=ROLES, days: float = 90,
                    ca: tuple[bytes, bytes] | None = None) -> dict[str, pathlib.Path]:
    """out/<role>/{ca.crt,tls.crt,tls.key} for each role (directories 0700), signed by `ca`
    (certificate, key) or by a new CA whose key is not kept: a throwaway deployment needs no
    more certificates later. Returns role -> directory."""
    out = pathlib.Path(out)
    out.mkdir(mode=0o700, parents=True, exist_ok=True)
    ca_cert, ca_key = ca or make_ca(deployment, days)
    dirs = {}
    for role in dict.fromkeys(role_name(r) for r in roles):
        d = out / role
        d.mkdir(mode=0o700, exist_ok=True)
        cert, key = make_role_cert(ca_cert, ca_key, deployment, role, days)
        _write_private(d / CA_FILE, ca_cert)
        _write_private(d / CERT_FILE, cert)
        _write_private(d / KEY_FILE, key)
        dirs[role] = d
    return dirs


def k8s_secret(name: str, role_dir: pathlib.Path) -> dict:
    """A kubernetes.io/tls Secret holding one role's directory, as cert-manager writes one."""
    data = {f: base64.b64encode((role_dir / f).read_bytes()).decode() for f in (CA_FILE, CERT_FILE, KEY_FILE)}
    return {"apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/tls",
            "metadata": {"name": name}, "data": data}
