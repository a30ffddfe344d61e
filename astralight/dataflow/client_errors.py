"""What a :class:`~astralight.dataflow.client.DataflowClient` call raises when it gets no good
answer: the service's refusal (:class:`DataflowError`, naming the bad field), no answer within
``retry_s`` (:class:`DataflowUnreachable`), or a stop asked for while it waited
(:class:`DataflowStopped`)."""

from __future__ import annotations


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
    """The process was asked to stop (:data:`~astralight.dataflow.client_stop.STOP_WAITING`, or
    the client's ``stop`` event) while a call was retrying an unreachable service: it gave up at
    once instead of after ``retry_s``."""
