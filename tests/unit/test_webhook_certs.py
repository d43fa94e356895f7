"""Self-signed serving certificates of the webhook: chain, SANs, reuse and renewal."""

from __future__ import annotations

import base64
import datetime as dt
import ipaddress
import stat
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from scheduler_plugins.webhook.certs import (
    RENEW_BEFORE,
    SERVING_VALIDITY,
    ServingPki,
    ca_bundle,
    ensure_serving_pki,
    split_hosts,
)
from scheduler_plugins.webhook.errors import WebhookSetupError


def _load(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def test_chain_verifies_and_names_every_host(tmp_path: Path) -> None:
    pki = ensure_serving_pki(tmp_path, ["tessera-webhook.tessera.svc", "127.0.0.1", "::1"])
    ca, cert = _load(pki.ca_cert), _load(pki.cert)
    cert.verify_directly_issued_by(ca)
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert not cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert ExtendedKeyUsageOID.SERVER_AUTH in eku
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["tessera-webhook.tessera.svc"]
    assert set(san.get_values_for_type(x509.IPAddress)) == {
        ipaddress.ip_address("127.0.0.1"),
        ipaddress.ip_address("::1"),
    }
    for key in (pki.key, pki.ca_key):
        assert stat.S_IMODE(key.stat().st_mode) == 0o600


def test_reused_while_good(tmp_path: Path) -> None:
    first = ensure_serving_pki(tmp_path, ["localhost"])
    before = {p: p.read_bytes() for p in (first.ca_cert, first.cert, first.key)}
    again = ensure_serving_pki(tmp_path, ["localhost"])
    assert {p: p.read_bytes() for p in (again.ca_cert, again.cert, again.key)} == before


def test_new_host_reissues_the_serving_cert_but_keeps_the_ca(tmp_path: Path) -> None:
    pki = ensure_serving_pki(tmp_path, ["localhost"])
    ca_before, cert_before = pki.ca_cert.read_bytes(), pki.cert.read_bytes()
    ensure_serving_pki(tmp_path, ["localhost", "10.0.0.7"])
    assert pki.ca_cert.read_bytes() == ca_before
    assert pki.cert.read_bytes() != cert_before
    _load(pki.cert).verify_directly_issued_by(_load(pki.ca_cert))


def test_expiring_serving_cert_is_renewed(tmp_path: Path) -> None:
    pki = ensure_serving_pki(tmp_path, ["localhost"])
    old = pki.cert.read_bytes()
    later = dt.datetime.now(dt.UTC) + SERVING_VALIDITY - RENEW_BEFORE + dt.timedelta(days=1)
    ensure_serving_pki(tmp_path, ["localhost"], now=later)
    assert pki.cert.read_bytes() != old
    assert _load(pki.cert).not_valid_after_utc > later + RENEW_BEFORE


@pytest.mark.parametrize("broken", ["cert", "key", "ca_cert", "ca_key"])
def test_damaged_files_are_replaced(tmp_path: Path, broken: str) -> None:
    pki = ensure_serving_pki(tmp_path, ["localhost"])
    getattr(pki, broken).write_text("garbage")
    ensure_serving_pki(tmp_path, ["localhost"])
    _load(pki.cert).verify_directly_issued_by(_load(pki.ca_cert))


def test_ca_bundle_is_base64_pem(tmp_path: Path) -> None:
    pki = ensure_serving_pki(tmp_path, ["localhost"])
    assert base64.b64decode(ca_bundle(pki.ca_cert)) == pki.ca_cert.read_bytes()
    with pytest.raises(WebhookSetupError, match="not a PEM certificate"):
        ca_bundle(pki.key)
    with pytest.raises(WebhookSetupError, match="cannot read CA file"):
        ca_bundle(tmp_path / "missing.crt")


@pytest.mark.parametrize(
    ("hosts", "message"),
    [([], "at least one --host"), (["bad host"], "'bad host'"), (["a..b"], "'a..b'")],
)
def test_bad_hosts_are_refused(hosts: list[str], message: str) -> None:
    with pytest.raises(WebhookSetupError, match=message):
        split_hosts(hosts)


def test_hosts_split_into_names_and_ips() -> None:
    assert split_hosts(["Svc.NS.svc", "[::1]", "10.1.2.3"]) == (["svc.ns.svc"], ["::1", "10.1.2.3"])


def test_unwritable_cert_dir_is_a_clear_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(WebhookSetupError, match="cannot create cert dir"):
        ensure_serving_pki(blocker / "certs", ["localhost"])
    assert ServingPki.in_dir(tmp_path).cert == tmp_path / "tls.crt"
