"""Serving certificates of the webhook when none are given: a self-signed CA and a serving
certificate for the webhook's host names and IPs (ECDSA P-256, made with ``cryptography``).

Kept in a cert dir and reused: the CA as long as it is valid (so a MutatingWebhookConfiguration
already carrying its bundle stays valid), the serving certificate as long as it is valid,
signed by that CA and names every requested host. ``ca_bundle`` is what the configuration's
``clientConfig.caBundle`` takes.
"""

from __future__ import annotations

import base64
import datetime as dt
import ipaddress
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import structlog
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from scheduler_plugins.webhook.errors import WebhookSetupError

log = structlog.get_logger("tessera.webhook.certs")

CA_VALIDITY: Final = dt.timedelta(days=3650)
SERVING_VALIDITY: Final = dt.timedelta(days=365)
RENEW_BEFORE: Final = dt.timedelta(days=30)  # reissue when less than this is left
DEFAULT_HOSTS: Final = ("localhost", "127.0.0.1")


@dataclass(frozen=True)
class ServingPki:
    ca_cert: Path
    ca_key: Path
    cert: Path
    key: Path

    @staticmethod
    def in_dir(cert_dir: Path) -> ServingPki:
        return ServingPki(
            ca_cert=cert_dir / "ca.crt",
            ca_key=cert_dir / "ca.key",
            cert=cert_dir / "tls.crt",
            key=cert_dir / "tls.key",
        )


def default_cert_dir() -> Path:
    """``$TESSERA_CACHE/webhook``, else ``~/.cache/tessera/webhook``."""
    cache = os.environ.get("TESSERA_CACHE")
    return (Path(cache) if cache else Path.home() / ".cache" / "tessera") / "webhook"


def split_hosts(hosts: Sequence[str]) -> tuple[list[str], list[str]]:
    """(DNS names, IP addresses) of ``hosts``; a bad name raises WebhookSetupError."""
    dns: list[str] = []
    ips: list[str] = []
    for h in hosts:
        h = h.strip().strip("[]")
        try:
            ips.append(str(ipaddress.ip_address(h)))
            continue
        except ValueError:
            pass
        labels = h.rstrip(".").split(".")
        if not h or not all(
            0 < len(label) <= 63 and label.replace("-", "").replace("*", "").isalnum()
            for label in labels
        ):
            raise WebhookSetupError(f"--host {h!r} is neither an IP address nor a DNS name")
        dns.append(h.lower())
    if not dns and not ips:
        raise WebhookSetupError("give at least one --host the certificate is for")
    return dns, ips


def ensure_serving_pki(
    cert_dir: Path, hosts: Sequence[str], *, now: dt.datetime | None = None
) -> ServingPki:
    """Reuse what ``cert_dir`` holds when still good for ``hosts``, else make it anew."""
    now = now or dt.datetime.now(dt.UTC)
    dns, ips = split_hosts(hosts)
    pki = ServingPki.in_dir(cert_dir)
    try:
        cert_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as e:
        raise WebhookSetupError(f"cannot create cert dir {cert_dir}: {e.strerror}") from e
    ca = _load_ca(pki, now)
    if ca is None:
        ca = _new_ca(now)
        _write(pki.ca_key, _pem_key(ca[1]), private=True)
        _write(pki.ca_cert, ca[0].public_bytes(serialization.Encoding.PEM), private=False)
        log.info("ca.created", cert=str(pki.ca_cert))
    ca_cert, ca_key = ca
    if _serving_ok(pki, ca_cert, dns, ips, now):
        return pki
    key = ec.generate_private_key(ec.SECP256R1())
    sans: list[x509.GeneralName] = [x509.DNSName(n) for n in dns]
    sans += [x509.IPAddress(ipaddress.ip_address(i)) for i in ips]
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, (dns or ips)[0])]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + SERVING_VALIDITY)
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    _write(pki.key, _pem_key(key), private=True)
    _write(pki.cert, cert.public_bytes(serialization.Encoding.PEM), private=False)
    log.info("serving_cert.created", cert=str(pki.cert), sans=[*dns, *ips])
    return pki


def ca_bundle(ca_file: Path) -> str:
    """The base64 PEM a webhook configuration's ``caBundle`` takes."""
    try:
        pem = ca_file.read_bytes()
        x509.load_pem_x509_certificates(pem)
    except OSError as e:
        raise WebhookSetupError(f"cannot read CA file {ca_file}: {e.strerror}") from e
    except ValueError as e:
        raise WebhookSetupError(f"{ca_file} is not a PEM certificate: {e}") from e
    return base64.b64encode(pem).decode()


def _new_ca(now: dt.datetime) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "tessera-webhook-ca")])
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + CA_VALIDITY)
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
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return cert, key


def _load_ca(
    pki: ServingPki, now: dt.datetime
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey] | None:
    if not (pki.ca_cert.is_file() and pki.ca_key.is_file()):
        return None
    try:
        cert = x509.load_pem_x509_certificate(pki.ca_cert.read_bytes())
        key = serialization.load_pem_private_key(pki.ca_key.read_bytes(), password=None)
    except (OSError, ValueError, TypeError) as e:
        log.warning("ca.unreadable", cert=str(pki.ca_cert), error=str(e))
        return None
    if not isinstance(key, ec.EllipticCurvePrivateKey) or key.public_key() != cert.public_key():
        log.warning("ca.key_mismatch", cert=str(pki.ca_cert))
        return None
    if cert.not_valid_after_utc - now < RENEW_BEFORE + SERVING_VALIDITY:
        return None  # it would expire before a serving certificate issued now
    return cert, key


def _serving_ok(
    pki: ServingPki, ca: x509.Certificate, dns: list[str], ips: list[str], now: dt.datetime
) -> bool:
    if not (pki.cert.is_file() and pki.key.is_file()):
        return False
    try:
        cert = x509.load_pem_x509_certificate(pki.cert.read_bytes())
        key = serialization.load_pem_private_key(pki.key.read_bytes(), password=None)
        cert.verify_directly_issued_by(ca)
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (OSError, ValueError, TypeError, InvalidSignature, x509.ExtensionNotFound) as e:
        log.info("serving_cert.reissue", cert=str(pki.cert), why=str(e) or type(e).__name__)
        return False
    if not isinstance(key, ec.EllipticCurvePrivateKey) or key.public_key() != cert.public_key():
        return False
    if cert.not_valid_after_utc - now < RENEW_BEFORE:
        return False
    have_dns = set(san.get_values_for_type(x509.DNSName))
    have_ips = {str(i) for i in san.get_values_for_type(x509.IPAddress)}
    return set(dns) <= have_dns and set(ips) <= have_ips


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
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
        raise WebhookSetupError(f"cannot write {path}: {e.strerror}") from e
