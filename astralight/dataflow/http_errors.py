"""How the dataflow's HTTP face answers a failed request: JSON ``{"error", "field"}`` with a 4xx
for a bad request (:class:`~astralight.dataflow.errors.ServiceError` with its own status,
:class:`~astralight.protocol.ProtocolError` and FastAPI's path/query validation as 422, a body
cut off as 400) and a 500 for an unexpected exception, logged with its traceback. None of them
stops the server; each failing field is noted for
:class:`~astralight.dataflow.http_stats.ClientStats`.

A 500 carries ``Connection: close``: Starlette re-raises the exception after the handler's answer
is sent (so that servers see it), and uvicorn then closes the connection. Without the header a
keep-alive client would send its next request on a connection being closed under it, and get a
reset instead of an answer (issue 41, item 6); with it, the client opens a new one."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.requests import ClientDisconnect

from astralight.dataflow.errors import ServiceError
from astralight.dataflow.http_stats import note_request
from astralight.protocol import ProtocolError

log = logging.getLogger("astralight.dataflow")


def error_response(status: int, field_name: str | None, message: str,
                   headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"error": message, "field": field_name}, status_code=status,
                        headers=headers)


def add_error_handlers(app: FastAPI) -> None:
    """Answer every failure of ``app``'s routes as the module says."""

    @app.exception_handler(ServiceError)
    async def _service_error(request: Request, exc: ServiceError):
        if not exc.logged:  # (a storage fault is logged once per episode, not per request)
            log.warning("%s %s -> %d %s", request.method, request.url.path, exc.status, exc)
        note_request(field=exc.field, quiet=exc.logged)
        return error_response(exc.status, exc.field, str(exc))

    @app.exception_handler(ProtocolError)
    async def _protocol_error(request: Request, exc: ProtocolError):
        log.warning("%s %s -> 422 %s", request.method, request.url.path, exc)
        note_request(field=exc.field)
        return error_response(422, exc.field, str(exc))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        errs = exc.errors()
        loc = ".".join(str(p) for p in errs[0]["loc"][1:]) if errs else "request"
        msg = f"{loc}: {errs[0]['msg']}" if errs else "invalid request"
        log.warning("%s %s -> 422 %s", request.method, request.url.path, msg)
        note_request(field=loc)
        return error_response(422, loc, msg)

    @app.exception_handler(ClientDisconnect)
    async def _disconnect(request: Request, exc: ClientDisconnect):
        return error_response(400, "body", "client disconnected before the body was read")

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception):
        log.exception("%s %s -> 500", request.method, request.url.path)
        # the connection is closed after this answer (see the module): say so
        return error_response(500, None, f"internal error: {type(exc).__name__}: {exc}",
                              headers={"Connection": "close"})
