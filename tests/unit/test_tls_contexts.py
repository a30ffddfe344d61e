"""The dataflow client's TLS trust: loaded once per process and trust source, shared by clients.

httpx loads a trust store for every client it builds (about 50 ms of CPU here), even for an
``http://`` URL; the launcher builds a short-lived client for each read every second.
"""

from __future__ import annotations

import os
import ssl

import pytest

from astralight.dataflow.client import DataflowClient
from astralight.dataflow.client_credentials import tls_verify


def _pem() -> bytes:
    """The PEM of one CA certificate from the system trust store (a valid CA file to load)."""
    import certifi

    text = open(certifi.where()).read()
    begin = text.index("-----BEGIN CERTIFICATE-----")
    end = text.index("-----END CERTIFICATE-----", begin) + len("-----END CERTIFICATE-----")
    return (text[begin:end] + "\n").encode()


def test_the_system_trust_store_is_one_verifying_context_for_every_client(monkeypatch):
    monkeypatch.delenv("ASTRALIGHT_CA_FILE", raising=False)
    first, second = tls_verify(), tls_verify()
    assert isinstance(first, ssl.SSLContext) and first is second
    assert first.verify_mode == ssl.CERT_REQUIRED and first.check_hostname
    assert first.cert_store_stats()["x509_ca"] > 0  # a trust store was loaded into it
    a = DataflowClient("http://127.0.0.1:9", token="", retry_s=0)
    b = DataflowClient("http://127.0.0.1:9", token="", retry_s=0)
    try:
        contexts = {id(c._http._transport._pool._ssl_context) for c in (a, b)}
    finally:
        a.close(), b.close()
    assert contexts == {id(first)}


def test_a_changed_ssl_cert_file_is_read_again(monkeypatch, tmp_path):
    monkeypatch.delenv("ASTRALIGHT_CA_FILE", raising=False)
    bundle = tmp_path / "one.pem"
    bundle.write_bytes(_pem())
    default = tls_verify()
    monkeypatch.setenv("SSL_CERT_FILE", str(bundle))
    only_one = tls_verify()
    assert only_one is not default and only_one is tls_verify()
    assert only_one.cert_store_stats()["x509_ca"] == 1


def test_a_ca_file_is_loaded_once_and_again_when_it_is_replaced(tmp_path):
    ca = tmp_path / "ca.pem"
    ca.write_bytes(_pem())
    first = tls_verify(str(ca))
    assert tls_verify(str(ca)) is first and first.cert_store_stats()["x509_ca"] == 1
    ca.write_bytes(_pem() * 2)  # replaced: another size (and modification time)
    os.utime(ca, ns=(1, 1))
    second = tls_verify(str(ca))
    assert second is not first and second.verify_mode == ssl.CERT_REQUIRED


def test_a_missing_or_unreadable_ca_file_names_the_field(tmp_path):
    with pytest.raises(ValueError, match="ca_file: .* is not a file"):
        tls_verify(str(tmp_path / "nope.pem"))
    bad = tmp_path / "bad.pem"
    bad.write_text("not a certificate")
    with pytest.raises(ValueError, match="ca_file: cannot load"):
        tls_verify(str(bad))
