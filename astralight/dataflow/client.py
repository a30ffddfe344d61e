"""Synchronous client of the dataflow service, used by RaaS, trainers, callbacks and tests.

msgpack bodies through :mod:`astralight.protocol`; the bearer token comes from the argument or
``ASTRALIGHT_TOKEN`` (else the file ``ASTRALIGHT_TOKEN_FILE`` names): in each process, the token
of that process's scope (rollout, trainer, admin: :mod:`astralight.dataflow.auth`). The
``instance_secret`` a registration answers is kept for the process (per dataflow URL and
instance id, so every client the process builds shares it) and sent, as the
``X-Astralight-Instance-Secret`` header, with every call that names the instance. For an ``https://`` dataflow (``tls_certfile`` on the service) the server
certificate is checked against ``ca_file`` (or ``ASTRALIGHT_CA_FILE``, else the system's trust
store), so every component that builds a client -- RaaS, trainers, callbacks, the autoscaler --
reaches a TLS dataflow by setting that one environment variable. Connection failures are retried with backoff for up to ``retry_s`` seconds so
that a restarting service is waited for (every route is safe to repeat: pushes are idempotent by
task id, and a pulled batch whose answer got lost is re-served after the ack timeout). A 4xx/5xx
answer raises :class:`DataflowError` carrying the server's message, which names the bad field.

Waiting is never silent and never deaf: a call that has retried for :data:`WAIT_LOG_AFTER_S`
logs ``waiting for the dataflow at URL (n s ...)`` (a warning, so that a process that configured
no logging -- a trainer -- still prints it), again every :data:`WAIT_LOG_EVERY_S`; and the retry
loop wakes when the process is asked to stop -- :data:`STOP_WAITING`, set by the SIGTERM handler
:func:`wake_on_sigterm` installs, or the client's own ``stop`` event -- raising
:class:`DataflowStopped` at once instead of sleeping out ``retry_s`` (a trainer used to ignore
SIGTERM for a minute while it waited for a dataflow that was not there).
"""

from __future__ import annotations

import hashlib
import logging
import os
import signal
import ssl
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from astralight.protocol import Batch, Sample, Task, WeightManifest, decode, encode, expect

MSGPACK = "application/msgpack"
#: response header of /v1/pull carrying the service's batch_ack_timeout_s
ACK_TIMEOUT_HEADER = "X-Batch-Ack-Timeout-S"
#: request header carrying an instance's secret (see :class:`InstanceSecrets`)
INSTANCE_SECRET_HEADER = "X-Astralight-Instance-Secret"
#: a call that has retried this long logs its first "waiting for the dataflow" line
WAIT_LOG_AFTER_S = 2.0
#: then one line every this many seconds while it keeps retrying
WAIT_LOG_EVERY_S = 5.0
#: the longest a retrying call sleeps before it looks at the stop flags again
STOP_POLL_S = 0.1
log = logging.getLogger(__name__)


class StopWaiting:
    """A process-wide "stop waiting" flag: once set, no :class:`DataflowClient` in the process
    retries an unreachable service any more (each call still makes its first attempt, so a
    reachable dataflow is still told goodbye); a call already retrying raises
    :class:`DataflowStopped` within :data:`STOP_POLL_S`.

    A plain attribute, not a ``threading.Event``: it is set from a signal handler, which runs
    between two bytecodes of the main thread, possibly inside ``Event.wait``'s own lock (setting
    an Event there can deadlock); the retry loop polls it instead."""

    def __init__(self):
        self.reason: str | None = None

    def set(self, reason: str = "stop requested") -> None:
        self.reason = reason

    def clear(self) -> None:
        self.reason = None

    def is_set(self) -> bool:
        return self.reason is not None


#: set by :func:`wake_on_sigterm`'s handler (or by hand); read by every client's retry loop
STOP_WAITING = StopWaiting()
#: what SIGTERM did before :func:`wake_on_sigterm` replaced it
_PREVIOUS_SIGTERM: dict[int, Any] = {}


def _on_sigterm(signum, frame) -> None:
    """SIGTERM handler of :func:`wake_on_sigterm`: stop every retry loop, then let the signal do
    what it did before. Called through another handler that chained this one (Lightning's, during
    ``fit``: it stops the fit at the next step), only the flag is set: that handler acts on the
    signal. Installed alone, the previous action follows: the previous handler, or the default
    action (the process ends) when there was none."""
    STOP_WAITING.set(f"{signal.Signals(signum).name} received")
    if signal.getsignal(signum) is not _on_sigterm:
        return  # a handler that chained this one is handling the signal
    previous = _PREVIOUS_SIGTERM.get(signum, signal.SIG_DFL)
    if callable(previous):
        previous(signum, frame)
    elif previous in (signal.SIG_DFL, None):  # (None: a handler not set from Python)
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


def wake_on_sigterm() -> bool:
    """Make SIGTERM wake every retrying dataflow call of this process (:data:`STOP_WAITING`),
    keeping what SIGTERM did before (see :func:`_on_sigterm`). ``astralight fit`` calls it at
    start-up; Lightning's own SIGTERM handler, installed when ``fit`` begins, chains it. Only the
    main thread can install signal handlers: elsewhere this does nothing and returns False."""
    if threading.current_thread() is not threading.main_thread():
        return False
    current = signal.getsignal(signal.SIGTERM)
    if current is _on_sigterm:
        return True
    _PREVIOUS_SIGTERM[signal.SIGTERM] = current
    signal.signal(signal.SIGTERM, _on_sigterm)
    return True


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
    verification off (logged: only for debugging). Otherwise the system trust store is used.
    """
    if verify is False:
        log.warning("TLS certificate verification is OFF for the dataflow client")
        return False
    ca_file = ca_file if ca_file is not None else (os.environ.get("ASTRALIGHT_CA_FILE") or None)
    if ca_file is None:
        return True
    if not os.path.isfile(ca_file):
        raise ValueError(f"ca_file: {ca_file!r} (or ASTRALIGHT_CA_FILE) is not a file; give the "
                         "PEM certificate of the CA that signed the dataflow's certificate")
    try:
        return ssl.create_default_context(cafile=ca_file)
    except (ssl.SSLError, OSError) as exc:
        raise ValueError(f"ca_file: cannot load {ca_file!r} as PEM certificates: {exc}") from None


#: raw bodies above this go out in slices of this size: httpcore's sync writer re-slices the rest
#: of a single bytes body after every socket send, which copies it again each time (quadratic:
#: a 1.2 GB weight upload ran at ~20 MB/s); slices of a memoryview copy nothing
UPLOAD_CHUNK_BYTES = 1 << 20


def _chunks(data: bytes, size: int = UPLOAD_CHUNK_BYTES):
    view = memoryview(data)
    for start in range(0, len(view), size):
        yield view[start:start + size]


class DataflowError(RuntimeError):
    """The service refused a request: ``status`` is the HTTP status (4xx/5xx) and ``field`` the
    request field the server named. ``status`` is None for failures that are not an HTTP answer
    (see :class:`DataflowUnreachable`, and a downloaded file failing its sha256 check)."""

    def __init__(self, status: int | None, message: str, field: str | None = None,
                 payload: dict | None = None):
        super().__init__(f"dataflow HTTP {status}: {message}" if status else message)
        self.status = status
        self.message = message
        self.field = field
        #: the whole JSON error answer (``push_many`` reads its per-item ``results`` from it)
        self.payload = payload


class DataflowUnreachable(DataflowError):
    """No answer from the service within ``retry_s`` seconds of retrying."""

    def __init__(self, message: str):
        super().__init__(None, message)


class DataflowStopped(DataflowUnreachable):
    """The process was asked to stop (:data:`STOP_WAITING`, or the client's ``stop`` event) while
    a call was retrying an unreachable service: it gave up at once instead of after ``retry_s``."""


class DataflowClient:
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
        self._manifests: dict[tuple[str, int], WeightManifest] = {}  # versions are immutable
        #: the service's batch_ack_timeout_s as its last pull answer said (None: not yet known)
        self.batch_ack_timeout_s: float | None = None

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
                break
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
        return resp

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

    # ------------------------------------------------------------------ info

    def info(self) -> dict:
        return self._send("GET", "/v1/info").json()

    def stats(self) -> dict:
        return self._send("GET", "/v1/stats").json()

    def eval_results(self, model_id: str) -> dict[int, dict]:
        data = self._send("GET", f"/v1/eval/{model_id}").json()
        return {int(v): r for v, r in data.items()}

    def eval_completions(self, model_id: str, version: int, limit: int | None = None) -> list[dict]:
        """A few sample completions of the eval of ``version``
        (GET /v1/eval/{model_id}/{version}/completions; see
        :class:`astralight.dataflow.evals.CompletionLog`)."""
        query = f"?limit={int(limit)}" if limit is not None else ""
        path = f"/v1/eval/{model_id}/{int(version)}/completions{query}"
        return self._send("GET", path).json()["completions"]

    # ------------------------------------------------------------------ RaaS side

    def request_eval(self, model_id: str, version: int) -> dict:
        """Evaluate ``version`` (the current one) of ``model_id`` whatever ``eval.every`` says,
        once (POST /v1/eval): ``{model_id, version, evals_scheduled}``; a version not current
        (yet) or a service without an eval source is a :class:`DataflowError` 409."""
        return self._call("POST", "/v1/eval", {"model_id": model_id, "version": int(version)})

    def balance(self, model_id: str, window: int = 10, pool: int | None = None,
                last: int | None = None) -> dict:
        """The balance report over the last ``window`` versions, or the ``window`` versions up
        to ``last`` (GET /v1/balance/{model_id})."""
        query = (f"window={int(window)}" + (f"&pool={int(pool)}" if pool is not None else "")
                 + (f"&last={int(last)}" if last is not None else ""))
        return self._send("GET", f"/v1/balance/{model_id}?{query}").json()

    def counters(self, model_id: str, since: int = 0) -> dict[int, dict[str, int]]:
        """Counters of ``model_id`` per policy version (GET /v1/counters/{model_id})."""
        data = self._send("GET", f"/v1/counters/{model_id}?since={int(since)}").json()
        return {int(v): c for v, c in data["versions"].items()}

    def register(self, model_ids: list[str], capacity: int, instance_id: str | None = None,
                 meta: dict | None = None, capacity_units: float = 1.0,
                 limits: dict | None = None) -> dict:
        """Join the pool (``capacity``: most tasks at once; ``capacity_units``: GPUs or CPU slots).
        Registering a known ``instance_id`` again makes it active, its counters kept (while it
        is live, only with its secret: this process sends the one it holds). The reply's
        ``instance_secret`` is kept and sent with every later call naming the instance.
        ``limits``: ``{model_id: {vocab_size, max_model_len}}`` of this instance's engines; the
        dataflow refuses pushed samples outside them."""
        body = {"model_ids": list(model_ids), "capacity": capacity, "instance_id": instance_id,
                "meta": meta or {}, "capacity_units": float(capacity_units)}
        if limits:
            body["limits"] = limits
        reply = self._call("POST", "/v1/register", body, instance_id=instance_id)
        if isinstance(reply, dict) and reply.get("instance_secret") and reply.get("instance_id"):
            INSTANCE_SECRETS.put(self.url, reply["instance_id"], str(reply["instance_secret"]))
        return reply

    def heartbeat(self, instance_id: str, in_flight: int | None = None,
                  stats: dict | None = None) -> dict:
        """Renew; the reply's ``drain`` says the dataflow wants this instance to drain.
        ``stats``: cumulative figures for the instance table (``weight_pause_s``, ...)."""
        body: dict = {"instance_id": instance_id}
        if in_flight is not None:
            body["in_flight"] = int(in_flight)
        if stats:
            body["stats"] = {k: float(v) for k, v in stats.items()}
        return self._call("POST", "/v1/heartbeat", body, instance_id=instance_id)

    def drain(self, instance_id: str) -> dict:
        """Ask an instance to drain: no new tasks, its heartbeat replies ``drain=True``.
        Returns ``{instance_id, state, in_flight}``."""
        return self._call("POST", f"/v1/instances/{instance_id}/drain", instance_id=instance_id)

    def return_tasks(self, instance_id: str, task_ids: list[str], failed: bool = False) -> dict:
        """Hand back leased tasks not pushed (leasable again at once); ``failed``: they could
        not be run (counts against the instance's health). Returns ``{"returned": n}``."""
        return self._call("POST", "/v1/return", {"instance_id": instance_id,
                                                 "task_ids": list(task_ids), "failed": bool(failed)},
                          instance_id=instance_id)

    def deregister(self, instance_id: str) -> dict:
        """Leave the pool, returning every task still leased. Returns ``{"returned": n}``."""
        return self._call("POST", "/v1/deregister", {"instance_id": instance_id},
                          instance_id=instance_id)

    def lease(self, instance_id: str, max_tasks: int) -> list[Task]:
        out = self._call("POST", "/v1/lease", {"instance_id": instance_id, "max_tasks": max_tasks},
                         instance_id=instance_id)
        return [expect(t, Task, "tasks[]") for t in out["tasks"]]

    def push(self, instance_id: str, task_id: str, samples: list) -> dict:
        """Push one task's samples; returns ``{accepted, filtered, duplicate}`` once they are
        durable. Idempotent: a task already accepted answers ``duplicate=True``."""
        return self._call("POST", "/v1/push", {"instance_id": instance_id, "task_id": task_id,
                                               "samples": list(samples)}, instance_id=instance_id)

    def push_many(self, instance_id: str,
                  items: list[tuple[str, list[Sample]]]) -> list[dict | Exception]:
        """Push several tasks' samples in one request (``POST /v1/push_many``).

        Returns, per item and in order, what :meth:`push` of that item alone would return (its
        reply dict) or raise (the :class:`DataflowError`, with ``status`` and ``field`` as push
        would give them), so one bad item never fails the others; every reply comes once the
        accepted items are durable. A request the service refuses as a whole is handled so that
        this still holds: too big (413) is split in halves and sent again; a body that does not
        decode because of one item (the field names ``items[i]``) is sent again item by item
        (push); any other refusal (auth, a bad ``instance_id``) or an unreachable service is
        every item's exception. Bad arguments (not ``(task_id, samples)`` pairs) raise here.
        """
        items = [self._push_item(i, item) for i, item in enumerate(items)]
        if not items:
            return []
        try:
            out = self._call("POST", "/v1/push_many", {"instance_id": instance_id, "items": [
                {"task_id": task_id, "samples": samples} for task_id, samples in items]},
                instance_id=instance_id)
            return [self._push_result(r) for r in out["results"]]
        except DataflowError as exc:
            return self._push_many_refused(instance_id, items, exc)

    @staticmethod
    def _push_item(i: int, item: Any) -> tuple[str, list]:
        """``(task_id, samples)`` from an argument item, or TypeError naming ``items[i]``."""
        try:
            task_id, samples = item
        except (TypeError, ValueError):
            raise TypeError(f"items[{i}]: expected a (task_id, samples) pair, got "
                            f"{type(item).__name__}") from None
        if not isinstance(task_id, str):
            raise TypeError(f"items[{i}]: task_id must be a str, got {type(task_id).__name__}")
        return task_id, list(samples)

    @staticmethod
    def _push_result(r: dict) -> dict | DataflowError:
        """One item's answer: the push reply, or the error push would have raised."""
        if r.get("status") == 200:
            return r["reply"]
        return DataflowError(r.get("status"), str(r.get("error")), r.get("field"))

    def _push_many_refused(self, instance_id: str, items: list[tuple[str, list]],
                           exc: DataflowError) -> list[dict | Exception]:
        """Per-item outcomes of a ``push_many`` request the service refused as a whole."""
        results = (exc.payload or {}).get("results")
        if isinstance(results, list) and len(results) == len(items):  # every item was refused
            return [self._push_result(r) for r in results]
        if exc.status == 413 and len(items) > 1:  # over max_body_bytes: halves, recursively
            half = len(items) // 2
            return (self.push_many(instance_id, items[:half])
                    + self.push_many(instance_id, items[half:]))
        names_an_item = (exc.field or "").startswith(("items[", "body.items["))
        if exc.status == 413 or (exc.status is not None and exc.status < 500 and names_an_item):
            return [self._push_alone(instance_id, task_id, samples) for task_id, samples in items]
        return [exc] * len(items)

    def _push_alone(self, instance_id: str, task_id: str, samples: list) -> dict | Exception:
        """:meth:`push` of one item, its exception returned rather than raised."""
        try:
            return self.push(instance_id, task_id, samples)
        except DataflowError as exc:
            return exc

    # ------------------------------------------------------------------ trainer side

    def pull_batch(self, model_id: str, size: int, timeout_s: float = 30.0,
                   trainer_id: str | None = None) -> Batch | None:
        """Long-poll for a batch of exactly ``size`` samples (None if none came in time). The
        service's ``batch_ack_timeout_s`` (a response header; None from a service too old to
        send it) is kept in :attr:`batch_ack_timeout_s`: ack or extend a batch within it."""
        timeout_s = max(0.0, float(timeout_s))  # the service refuses negative timeouts
        resp = self._send("POST", "/v1/pull", body={"model_id": model_id, "size": size,
                                                    "timeout_s": timeout_s,
                                                    "trainer_id": trainer_id},
                          timeout=max(self.timeout, timeout_s + 30.0))
        header = resp.headers.get(ACK_TIMEOUT_HEADER)
        if header is not None:
            try:
                self.batch_ack_timeout_s = float(header)
            except ValueError:
                log.warning("ignoring a malformed %s header: %r", ACK_TIMEOUT_HEADER, header[:64])
        out = decode(resp.content)
        return None if out is None else expect(out, Batch, "batch")

    def ack(self, batch_id: str, wait_s: float | None = None, step_s: float | None = None,
            step: int | None = None) -> dict:
        """Acknowledge a trained batch; a trainer also reports how long it waited for the batch
        and its whole step took (the balance report's trainer wait fraction).

        Returns the service's answer: ``{acked, already, samples, ...}``; for a batch the
        service had re-queued (a late ack) also ``late``, ``taken_back``, ``trained_twice`` and,
        when samples were trained twice, a ``warning`` to log. ``step``: the trainer's optimizer
        step count after this batch (see :meth:`trainer_resumed`)."""
        body: dict = {"batch_id": batch_id}
        if wait_s is not None and step_s is not None:
            body.update(wait_s=float(wait_s), step_s=float(step_s))
        if step is not None:
            body["step"] = int(step)
        return self._call("POST", "/v1/ack", body)

    def trainer_resumed(self, model_id: str, step: int) -> dict:
        """Say that a trainer of ``model_id`` restarted from a checkpoint taken after optimizer
        step ``step``: the service marks the batches acked after it as rolled back (their
        training was lost with the crash). Returns ``{model_id, step, batches_rolled_back,
        samples_rolled_back}``."""
        return self._call("POST", "/v1/trainer/resumed", {"model_id": model_id, "step": int(step)})

    def extend_batch(self, batch_id: str) -> dict:
        """Keep a pulled, not yet acknowledged batch from being re-queued: its ack deadline moves
        to now + ``batch_ack_timeout_s``. Returns ``{batch_id, extended, deadline_s,
        batch_ack_timeout_s}``; raises :class:`DataflowError` 404 (unknown batch) or 409 (already
        acked, or already re-queued: stop extending it)."""
        return self._call("POST", "/v1/batches/extend", {"batch_id": batch_id})

    # ------------------------------------------------------------------ versions and weights

    def current_version(self, model_id: str) -> int:
        return int(self._call("GET", f"/v1/version/{model_id}")["version"])

    def upload_weight_file(self, model_id: str, version: int, name: str, data: bytes) -> None:
        self._send("PUT", f"/v1/weights/{model_id}/{version}/{name}", raw=bytes(data))

    def publish(self, manifest: WeightManifest) -> dict:
        return self._call("POST", "/v1/publish", manifest)

    def latest_manifest(self, model_id: str) -> WeightManifest | None:
        out = self._call("GET", f"/v1/manifest/{model_id}/latest")
        return None if out is None else expect(out, WeightManifest, "manifest")

    def manifest(self, model_id: str, version: int) -> WeightManifest:
        key = (model_id, int(version))
        if key not in self._manifests:
            out = self._call("GET", f"/v1/manifest/{model_id}/{version}")
            self._manifests[key] = expect(out, WeightManifest, "manifest")
        return self._manifests[key]

    def download_weight_file(self, model_id: str, version: int, name: str) -> bytes:
        """Download one file of a published version; raises DataflowError on a sha256 mismatch."""
        info = self._file_info(model_id, version, name)
        data = self._send("GET", f"/v1/weights/{model_id}/{version}/{name}").content
        got = hashlib.sha256(data).hexdigest()
        if got != info["sha256"]:
            raise DataflowError(None, f"{name} of {model_id} v{version}: sha256 {got} does not match "
                                   f"the manifest's {info['sha256']}", field="sha256")
        return data

    def download_weight_file_to(self, model_id: str, version: int, name: str,
                                path: str | Path) -> Path:
        """Download to ``path``, resuming a partial file with an HTTP Range request, then verify."""
        info = self._file_info(model_id, version, name)
        path = Path(path)
        part = path.with_name(path.name + ".part")
        have = part.stat().st_size if part.exists() else 0
        headers = {"Range": f"bytes={have}-"} if have else {}
        url = f"/v1/weights/{model_id}/{version}/{name}"
        with self._http.stream("GET", url, headers=headers, timeout=None) as resp:
            if resp.status_code == 416:  # the part file is already whole: just verify it
                pass
            elif resp.status_code >= 400:
                raise DataflowError(resp.status_code, resp.read().decode(errors="replace"))
            else:
                mode = "ab" if resp.status_code == 206 else "wb"
                progress = _DownloadProgress(f"{model_id} v{version} {name}",
                                             int(info.get("bytes") or 0), have)
                with open(part, mode) as f:
                    for chunk in resp.iter_bytes(1 << 20):
                        f.write(chunk)
                        progress.add(len(chunk))
                progress.done()
        digest = hashlib.sha256()
        with open(part, "rb") as f:
            while block := f.read(1 << 20):
                digest.update(block)
        if digest.hexdigest() != info["sha256"]:
            part.unlink(missing_ok=True)
            raise DataflowError(None, f"{name} of {model_id} v{version}: sha256 mismatch after "
                                   "download; the partial file was removed, retry", field="sha256")
        os.replace(part, path)
        return path

    def _file_info(self, model_id: str, version: int, name: str) -> dict:
        manifest = self.manifest(model_id, version)
        if name not in manifest.files:
            raise DataflowError(404, f"{name!r} is not a file of {model_id} version {version}",
                                field="name")
        return manifest.files[name]


class _DownloadProgress:
    """Progress of one streamed weight download, logged at most every ``every_s`` seconds (and
    once at the end): a multi-GB full snapshot over a slow link takes minutes, and a silent RaaS
    looks hung. Files smaller than ``min_bytes`` are not reported."""

    def __init__(self, what: str, total: int, start: int = 0, every_s: float = 5.0,
                 min_bytes: int = 64 << 20):
        self.what, self.total, self.got, self.every_s = what, total, start, every_s
        self.on = total >= min_bytes
        self.t0 = self.last = time.monotonic()
        self.start = start

    def add(self, n: int) -> None:
        self.got += n
        now = time.monotonic()
        if self.on and now - self.last >= self.every_s:
            self.last = now
            self._log(now)

    def done(self) -> None:
        if self.on:
            self._log(time.monotonic())

    def _log(self, now: float) -> None:
        rate = (self.got - self.start) / max(now - self.t0, 1e-9) / 1e6
        pct = 100.0 * self.got / self.total if self.total else 0.0
        log.info("downloading %s: %.0f%% (%.0f of %.0f MB, %.1f MB/s)", self.what, pct,
                 self.got / 1e6, self.total / 1e6, rate)


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
