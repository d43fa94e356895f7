"""The dev cluster's PKI: an admin client certificate the apiserver takes as a cluster admin,
and PKI dirs made before it existed are made anew."""

from __future__ import annotations

from pathlib import Path

from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from scheduler_plugins.devtools.cluster.certs import ADMIN_USER, ensure_pki


def test_admin_client_certificate_is_signed_by_the_dev_ca(tmp_path: Path) -> None:
    pki = ensure_pki(tmp_path, dns_names=["localhost"], ips=["127.0.0.1"])
    ca = x509.load_pem_x509_certificate(pki.ca_cert.read_bytes())
    admin = x509.load_pem_x509_certificate(pki.admin_cert.read_bytes())
    admin.verify_directly_issued_by(ca)
    cn = admin.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    org = admin.subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)
    assert [a.value for a in cn] == [ADMIN_USER]
    assert [a.value for a in org] == ["system:masters"]  # the apiserver's group: all rights
    eku = admin.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(eku) == [ExtendedKeyUsageOID.CLIENT_AUTH]
    assert pki.admin_key.stat().st_mode & 0o077 == 0


def test_complete_pki_is_reused(tmp_path: Path) -> None:
    first = ensure_pki(tmp_path, dns_names=["localhost"], ips=["127.0.0.1"])
    ca = first.ca_cert.read_bytes()
    again = ensure_pki(tmp_path, dns_names=["localhost"], ips=["127.0.0.1"])
    assert again == first and again.ca_cert.read_bytes() == ca


def test_pki_without_an_admin_certificate_is_made_anew(tmp_path: Path) -> None:
    first = ensure_pki(tmp_path, dns_names=["localhost"], ips=["127.0.0.1"])
    ca, sa_key = first.ca_cert.read_bytes(), first.sa_key.read_bytes()
    first.admin_cert.unlink()
    first.admin_key.unlink()
    pki = ensure_pki(tmp_path, dns_names=["localhost"], ips=["127.0.0.1"])
    assert pki.admin_cert.is_file() and pki.admin_key.is_file()
    assert pki.ca_cert.read_bytes() != ca
    assert pki.sa_key.read_bytes() == sa_key  # it signs tokens already stored in etcd
