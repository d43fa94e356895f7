"""Key material of a dev cluster: a CA, the apiserver serving cert, an admin client cert
(for kubeconfigs with inline certificate data), the service-account key and the bearer
tokens (all ECDSA P-256: fast to make, accepted everywhere in Kubernetes).

Made once per state dir and reused, so kubeconfigs stay valid across ``down``/``up``.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import structlog
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from scheduler_plugins.devtools.cluster.errors import ClusterError

log = structlog.get_logger(__name__)

_VALIDITY: Final = dt.timedelta(days=365)
# Regenerate when the serving cert has less than this left.
_RENEW_BEFORE: Final = dt.timedelta(days=7)
ADMIN_USER: Final = "tessera-admin"
KWOK_USER: Final = "kwok-controller"  # bound to kwok's ClusterRole by hack/kwok/rbac.yaml


@dataclass(frozen=True)
class Pki:
    ca_cert: Path
    serving_cert: Path
    serving_key: Path
    sa_key: Path
    admin_cert: Path  # CN ADMIN_USER, O system:masters: a client cert the apiserver trusts
    admin_key: Path


@dataclass(frozen=True)
class Tokens:
    admin: str
    kwok: str


def ensure_pki(pki_dir: Path, *, dns_names: Sequence[str], ips: Sequence[str]) -> Pki:
    """Reuse the PKI in ``pki_dir`` if complete and valid for these names, else make it anew."""
    pki = Pki(
        ca_cert=pki_dir / "ca.crt",
        serving_cert=pki_dir / "apiserver.crt",
        serving_key=pki_dir / "apiserver.key",
        sa_key=pki_dir / "sa.key",
        admin_cert=pki_dir / "admin.crt",
        admin_key=pki_dir / "admin.key",
    )
    if _usable(pki, dns_names, ips):
        return pki
    pki_dir.mkdir(parents=True, exist_ok=True)
    now = dt.datetime.now(dt.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "tessera-dev-ca")])
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + _VALIDITY)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    sans: list[x509.GeneralName] = [x509.DNSName(n) for n in dns_names]
    sans += [x509.IPAddress(ipaddress.ip_address(i)) for i in ips]
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kube-apiserver")]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + _VALIDITY)
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    admin_key = ec.generate_private_key(ec.SECP256R1())
    admin_cert = _client_cert(admin_key, ca_key, ca_name, now)
    _write(pki.ca_cert, ca_cert.public_bytes(serialization.Encoding.PEM), private=False)
    _write(pki.serving_cert, cert.public_bytes(serialization.Encoding.PEM), private=False)
    _write(pki.serving_key, _pem_key(key), private=True)
    _write(pki.admin_cert, admin_cert.public_bytes(serialization.Encoding.PEM), private=False)
    _write(pki.admin_key, _pem_key(admin_key), private=True)
    # The SA key signs tokens stored in etcd: keep it when it exists.
    if not pki.sa_key.is_file():
        _write(pki.sa_key, _pem_key(ec.generate_private_key(ec.SECP256R1())), private=True)
    log.info("pki.created", dir=str(pki_dir), sans=[*dns_names, *ips])
    return pki


def _client_cert(
    key: ec.EllipticCurvePrivateKey,
    ca_key: ec.EllipticCurvePrivateKey,
    ca_name: x509.Name,
    now: dt.datetime,
) -> x509.Certificate:
    """The admin's client cert: the apiserver takes CN as the user, O as its groups."""
    subject = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "system:masters"),
            x509.NameAttribute(NameOID.COMMON_NAME, ADMIN_USER),
        ]
    )
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + _VALIDITY)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )


def ensure_tokens(token_file: Path) -> Tokens:
    """The static token file of the apiserver (``--token-auth-file``), made once."""
    if token_file.is_file():
        rows: dict[str, str] = {}
        for line in token_file.read_text().splitlines():
            parts = line.split(",")
            if len(parts) >= 2:
                rows[parts[1]] = parts[0]
        if ADMIN_USER in rows and KWOK_USER in rows:
            return Tokens(admin=rows[ADMIN_USER], kwok=rows[KWOK_USER])
    tokens = Tokens(admin=secrets.token_hex(24), kwok=secrets.token_hex(24))
    token_file.parent.mkdir(parents=True, exist_ok=True)
    _write(
        token_file,
        (
            f'{tokens.admin},{ADMIN_USER},{ADMIN_USER},"system:masters"\n'
            f"{tokens.kwok},{KWOK_USER},{KWOK_USER}\n"
        ).encode(),
        private=True,
    )
    return tokens


def _usable(pki: Pki, dns_names: Sequence[str], ips: Sequence[str]) -> bool:
    # A dir from before the admin cert existed lacks it: made anew (the SA key is kept).
    paths = (
        pki.ca_cert,
        pki.serving_cert,
        pki.serving_key,
        pki.sa_key,
        pki.admin_cert,
        pki.admin_key,
    )
    if not all(p.is_file() for p in paths):
        return False
    try:
        cert = x509.load_pem_x509_certificate(pki.serving_cert.read_bytes())
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (ValueError, x509.ExtensionNotFound) as e:
        log.warning("pki.unreadable", cert=str(pki.serving_cert), error=str(e))
        return False
    if cert.not_valid_after_utc - dt.datetime.now(dt.UTC) < _RENEW_BEFORE:
        return False
    have_dns = set(san.get_values_for_type(x509.DNSName))
    have_ips = {str(i) for i in san.get_values_for_type(x509.IPAddress)}
    return set(dns_names) <= have_dns and set(ips) <= have_ips


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        # "EC PRIVATE KEY": the apiserver's key-file parser does not take PKCS#8 EC keys.
        serialization.PrivateFormat.TraditionalOpenSSL,
        serialization.NoEncryption(),
    )


def _write(path: Path, data: bytes, *, private: bool) -> None:
    tmp = path.with_name(path.name + ".tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except OSError as e:
        raise ClusterError(f"cannot write {path}: {e.strerror}") from e
