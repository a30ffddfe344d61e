"""What a dataflow client presents and checks besides its bearer token: the instance secrets
this process got from registrations, and the TLS verification of the service's certificate."""

from __future__ import annotations

import functools
import logging
import os
import ssl
import threading

#: request header carrying an instance's secret (see :class:`InstanceSecrets`)
INSTANCE_SECRET_HEADER = "X-Astralight-Instance-Secret"
log = logging.getLogger("astralight.dataflow.client")  # one logger for the whole client


class InstanceSecrets:
    """The instance secrets this process got from registrations, per ``(dataflow URL,
    instance_id)``; one table for the whole process (:data:`INSTANCE_SECRETS`), because a RaaS
    talks through several clients (heartbeat, pushes, goodbye: one per thread)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._table: dict[tuple[str, str], str] = {}

    def get(self, url: str, instance_id: str | None) -> str | None:
        if not instance_id:
            return None
        with self._lock:
            return self._table.get((url, instance_id))

    def put(self, url: str, instance_id: str, secret: str) -> None:
        with self._lock:
            self._table[(url, instance_id)] = secret


INSTANCE_SECRETS = InstanceSecrets()


def tls_verify(ca_file: str | None = None, verify: bool | None = None) -> ssl.SSLContext | bool:
    """What httpx should verify server certificates with.

    ``ca_file`` (default: env ``ASTRALIGHT_CA_FILE``): a PEM bundle of the CA(s) that issued the
    dataflow's certificate (a self-signed certificate is its own CA). ``verify=False`` turns
    verification off (logged: only for debugging). Otherwise the system trust store is used
    (what httpx would load: ``SSL_CERT_FILE``, ``SSL_CERT_DIR``, else certifi's bundle).

    Each trust source is loaded once per process and its context shared by every client.
    httpx builds and loads one per client, even for an ``http://`` URL, and loading a trust
    store costs about 50 ms of CPU: the launcher, which reads the dataflow through short-lived
    clients every second, spent a tenth of a core on it.
    """
    if verify is False:
        log.warning("TLS certificate verification is OFF for the dataflow client")
        return False
    ca_file = ca_file if ca_file is not None else (os.environ.get("ASTRALIGHT_CA_FILE") or None)
    if ca_file is None:
        return _system_context(os.environ.get("SSL_CERT_FILE"), os.environ.get("SSL_CERT_DIR"))
    if not os.path.isfile(ca_file):
        raise ValueError(f"ca_file: {ca_file!r} (or ASTRALIGHT_CA_FILE) is not a file; give the "
                         "PEM certificate of the CA that signed the dataflow's certificate")
    stat = os.stat(ca_file)
    try:
        return _ca_file_context(os.path.abspath(ca_file), stat.st_mtime_ns, stat.st_size)
    except (ssl.SSLError, OSError) as exc:
        raise ValueError(f"ca_file: cannot load {ca_file!r} as PEM certificates: {exc}") from None


@functools.lru_cache(maxsize=8)
def _system_context(cert_file: str | None, cert_dir: str | None) -> ssl.SSLContext:
    """httpx's default verifying context; keyed by the environment it reads, so a changed
    ``SSL_CERT_FILE`` / ``SSL_CERT_DIR`` is honoured."""
    import httpx

    return httpx.create_ssl_context()


@functools.lru_cache(maxsize=8)
def _ca_file_context(path: str, mtime_ns: int, size: int) -> ssl.SSLContext:
    """A context trusting the CAs in ``path``; keyed by its modification time and size too, so a
    replaced CA file is read again."""
    return ssl.create_default_context(cafile=path)
