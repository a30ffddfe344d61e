"""Synchronous client of the dataflow service, used by RaaS, trainers, callbacks and tests.

:class:`DataflowClient` is the transport -- retries, auth headers, TLS, error answers -- with
the calls mixed in by who makes them: :mod:`~astralight.dataflow.client_rollout` (a RaaS),
:mod:`~astralight.dataflow.client_trainer` (a trainer's batches),
:mod:`~astralight.dataflow.client_weights` (versions, manifests, weight files) and
:mod:`~astralight.dataflow.client_reports` (info, stats, evals, balance, counters). Its typed
errors are :mod:`~astralight.dataflow.client_errors`; this module re-exports everything callers
import.

msgpack bodies through :mod:`astralight.protocol`; the bearer token comes from the argument or
``ASTRALIGHT_TOKEN`` (else the file ``ASTRALIGHT_TOKEN_FILE`` names): in each process, the token
of that process's scope (rollout, trainer, admin: :mod:`astralight.dataflow.auth`). The
``instance_secret`` a registration answers is kept for the process (per dataflow URL and
instance id, so every client the process builds shares it) and sent, as the
``X-Astralight-Instance-Secret`` header, with every call that names the instance
(:mod:`~astralight.dataflow.client_credentials`). For an ``https://`` dataflow (``tls_certfile``
on the service) the server certificate is checked against ``ca_file`` (or ``ASTRALIGHT_CA_FILE``,
else the system's trust store), so every component that builds a client -- RaaS, trainers,
callbacks, the autoscaler -- reaches a TLS dataflow by setting that one environment variable.
Connection failures are retried with backoff for up to ``retry_s`` seconds so that a restarting
service is waited for (every route is safe to repeat: pushes are idempotent by task id, and a
pulled batch whose answer got lost is re-served after the ack timeout). A 4xx/5xx answer raises
:class:`DataflowError` carrying the server's message, which names the bad field; except that a
507 naming ``state_dir`` (the service's disk is full: nothing was stored) is retried like an
unreachable service first, logged once per episode (:mod:`~astralight.dataflow.client_storage`).

Waiting is never silent and never deaf: a call that has retried for :data:`WAIT_LOG_AFTER_S`
logs ``waiting for the dataflow at URL (n s ...)`` (a warning, so that a process that configured
no logging -- a trainer -- still prints it), again every :data:`WAIT_LOG_EVERY_S`; and the retry
loop wakes when the process is asked to stop -- :data:`STOP_WAITING`, set by the SIGTERM handler
:func:`wake_on_sigterm` installs (:mod:`~astralight.dataflow.client_stop`), or the client's own
``stop`` event -- raising :class:`DataflowStopped` at once instead of sleeping out ``retry_s``, so
a process asked to stop never sits out a minute waiting for a dataflow that is not there.
"""

from __future__ import annotations

import logging
import ssl
import time
from typing import Any

import httpx

from astralight.dataflow.client_credentials import (INSTANCE_SECRET_HEADER, INSTANCE_SECRETS,
                                                    InstanceSecrets, tls_verify)
from astralight.dataflow.client_errors import DataflowError, DataflowStopped, DataflowUnreachable
from astralight.dataflow.client_reports import ReportCalls
from astralight.dataflow.client_rollout import RolloutCalls
from astralight.dataflow.client_storage import retry_refusal
from astralight.dataflow.client_stop import (STOP_WAITING, StopWaiting, _on_sigterm,
                                             _PREVIOUS_SIGTERM, wake_on_sigterm)
from astralight.dataflow.client_trainer import ACK_TIMEOUT_HEADER, TrainerCalls
from astralight.dataflow.client_weights import WeightCalls, _DownloadProgress
from astralight.dataflow.run_id import RUN_ID_HEADER
from astralight.protocol import WeightManifest, decode, encode

__all__ = ["ACK_TIMEOUT_HEADER", "INSTANCE_SECRET_HEADER", "INSTANCE_SECRETS", "MSGPACK",
           "STOP_POLL_S", "STOP_WAITING", "UPLOAD_CHUNK_BYTES", "WAIT_LOG_AFTER_S",
           "WAIT_LOG_EVERY_S", "DataflowClient", "DataflowError", "DataflowStopped",
           "DataflowUnreachable", "InstanceSecrets", "LazyDataflowClient", "StopWaiting",
           "_DownloadProgress", "_PREVIOUS_SIGTERM", "_chunks", "_on_sigterm", "tls_verify",
           "wake_on_sigterm"]

MSGPACK = "application/msgpack"
#: a call that has retried this long logs its first "waiting for the dataflow" line
WAIT_LOG_AFTER_S = 2.0
#: then one line every this many seconds while it keeps retrying
WAIT_LOG_EVERY_S = 5.0
#: the longest a retrying call sleeps before it looks at the stop flags again
STOP_POLL_S = 0.1
log = logging.getLogger(__name__)

#: raw bodies above this go out in slices of this size: httpcore's sync writer re-slices the rest
#: of a single bytes body after every socket send, which copies it again each time (quadratic in
#: the body's size, so multi-GB weight uploads crawl); slices of a memoryview copy nothing
UPLOAD_CHUNK_BYTES = 1 << 20


def _chunks(data: bytes, size: int = UPLOAD_CHUNK_BYTES):
    view = memoryview(data)
    for start in range(0, len(view), size):
        yield view[start:start + size]


class DataflowClient(ReportCalls, RolloutCalls, TrainerCalls, WeightCalls):
    """The one way components talk to the dataflow service (msgpack over HTTP).

    RaaS: register, heartbeat, lease, push / push_many, return_tasks, deregister (and drain, for
    operators and the autoscaler). Trainers: pull_batch, extend_batch (keep-alive), ack,
    upload_weight_file, publish.
    Everyone: info, stats, eval_results, current_version, manifests and weight downloads.
    Connection failures are retried with backoff for ``retry_s`` (a restarting service is waited
    for, with a "waiting for the dataflow" line every few seconds); an HTTP error answer raises
    :class:`DataflowError` with the server's message and field. ``stop``: an object with
    ``is_set()`` (a ``threading.Event``); while it is set -- or :data:`STOP_WAITING` is -- a failed
    connection raises :class:`DataflowStopped` instead of being retried. It is an attribute: a
    component may set it for some calls only (the RaaS, for its registration).
    """

    def __init__(self, url: str, token: str | None = None, timeout: float = 60.0,
                 retry_s: float = 60.0, ca_file: str | None = None, verify: bool | None = None,
                 stop: Any = None):
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.retry_s = retry_s
        self.stop = stop
        from astralight.dataflow.auth import check_token, client_token

        token = client_token() if token is None else token
        if token:
            check_token(token, "token")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout,
                                  verify=tls_verify(ca_file, verify))
        self._manifests: dict[tuple[str, int], WeightManifest] = {}  # immutable within a run
        #: the dataflow's run id as its last answer naming one said (the version and manifest
        #: routes: :mod:`astralight.dataflow.run_id`); None until one did
        self.run_id: str | None = None
        #: the run id every push names (the run the pushed samples were generated for): a
        #: dataflow of another run refuses them (409 ``run_id``). None: pushes name none
        self.push_run_id: str | None = None

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "DataflowClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ transport

    def _send(self, method: str, path: str, *, body: Any = None, raw: bytes | None = None,
              timeout: float | None = None, headers: dict | None = None) -> httpx.Response:
        content, hdrs = None, dict(headers or {})
        if body is not None:
            content, hdrs["Content-Type"] = encode(body), MSGPACK
        elif raw is not None:
            content, hdrs["Content-Type"] = raw, "application/octet-stream"
        sliced = raw is not None and len(raw) > UPLOAD_CHUNK_BYTES
        if sliced:
            hdrs["Content-Length"] = str(len(raw))
        started = time.monotonic()
        deadline = started + self.retry_s
        next_log = started + WAIT_LOG_AFTER_S
        delay = 0.1
        while True:
            try:
                if sliced:
                    content = _chunks(raw)  # a fresh iterator per attempt
                resp = self._http.request(method, path, content=content, headers=hdrs,
                                          timeout=timeout or self.timeout)
                # a full state_dir (507): retried like an unreachable service, logged once
                if not retry_refusal(self, resp, deadline, delay, STOP_POLL_S):
                    break
                delay = min(delay * 2, 2.0)
            except httpx.TransportError as exc:
                if isinstance(exc, httpx.ConnectError) and (
                        isinstance(exc.__context__, ssl.SSLCertVerificationError)
                        or "CERTIFICATE_VERIFY_FAILED" in str(exc)):
                    # retrying cannot fix a certificate the client does not trust
                    raise DataflowError(None, f"TLS: the certificate of {self.url} is not trusted "
                                              f"({exc}); pass ca_file= or set ASTRALIGHT_CA_FILE to "
                                              "the PEM of the CA that signed it",
                                        field="ca_file") from exc
                now = time.monotonic()
                if now + delay > deadline:
                    raise DataflowUnreachable(f"dataflow at {self.url} unreachable for "
                                              f"{self.retry_s:.0f} s: {type(exc).__name__}: {exc}"
                                              ) from exc
                if now >= next_log:
                    log.warning("waiting for the dataflow at %s (%.0f s; %s: %s); retrying for up "
                                "to %.0f s", self.url, now - started, type(exc).__name__, exc,
                                self.retry_s)
                    next_log = now + WAIT_LOG_EVERY_S
                self._pause(delay, exc)
                delay = min(delay * 2, 2.0)
        if resp.status_code >= 400:
            message, field = resp.text, None
            try:
                err = resp.json()
            except ValueError:
                err = None
            if isinstance(err, dict):
                message = err.get("error") or err.get("detail") or message
                field = err.get("field")
            raise DataflowError(resp.status_code, str(message), field,
                                err if isinstance(err, dict) else None)
        self._note_run(resp.headers.get(RUN_ID_HEADER))
        return resp

    def _note_run(self, run_id: str | None) -> None:
        """Keep the run id an answer named; another run than the last one empties the manifest
        cache (version numbers start again at 0 in a new run: v3 of the new run is not the
        cached v3 of the old one)."""
        if not run_id or run_id == self.run_id:
            return
        if self.run_id is not None:
            self._manifests.clear()
        self.run_id = run_id

    def _stop_reason(self) -> str | None:
        """Why this client must not retry now (None: it may)."""
        if STOP_WAITING.is_set():
            return STOP_WAITING.reason
        stop = self.stop
        if stop is not None and stop.is_set():
            return "stop requested"
        return None

    def _pause(self, seconds: float, exc: BaseException) -> None:
        """Sleep ``seconds`` between two attempts, in slices of :data:`STOP_POLL_S`; raise
        :class:`DataflowStopped` as soon as a stop is requested (also before sleeping)."""
        end = time.monotonic() + seconds
        while True:
            reason = self._stop_reason()
            if reason is not None:
                raise DataflowStopped(f"stopped waiting for the dataflow at {self.url} ({reason}); "
                                      f"it was unreachable: {type(exc).__name__}: {exc}") from exc
            left = end - time.monotonic()
            if left <= 0:
                return
            time.sleep(min(left, STOP_POLL_S))

    def _call(self, method: str, path: str, body: Any = None, timeout: float | None = None,
              instance_id: str | None = None) -> Any:
        """One msgpack call; ``instance_id``: the instance it acts as (its secret is sent)."""
        secret = INSTANCE_SECRETS.get(self.url, instance_id)
        headers = {INSTANCE_SECRET_HEADER: secret} if secret else None
        return decode(self._send(method, path, body=body, timeout=timeout, headers=headers).content)

    def instance_secret(self, instance_id: str) -> str | None:
        """The secret this process holds for ``instance_id`` on this dataflow (None: none)."""
        return INSTANCE_SECRETS.get(self.url, instance_id)


class LazyDataflowClient:
    """Mixin for components that talk to the dataflow: one client, built on first use.

    Building it lazily keeps constructors cheap (jsonargparse builds components before any
    process has a network); assigning :attr:`client` substitutes one (tests, custom transports).
    Subclasses set ``dataflow_url`` and ``token`` and may override :meth:`make_client`.
    """

    _client = None
    dataflow_url: str | None = None
    token: str | None = None

    def make_client(self):
        if not self.dataflow_url:
            raise ValueError(f"dataflow_url: not set for {type(self).__name__}; set its "
                             "init_args.dataflow_url (or the datamodule's)")
        return DataflowClient(self.dataflow_url, token=self.token)

    @property
    def client(self):
        if self._client is None:
            self._client = self.make_client()
        return self._client

    @client.setter
    def client(self, value) -> None:
        self._client = value

    def close_client(self) -> None:
        if self._client is not None and hasattr(self._client, "close"):
            self._client.close()
        self._client = None
