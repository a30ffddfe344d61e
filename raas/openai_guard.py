"""The OpenAI endpoint's front door: an ASGI middleware that lets through only loopback,
non-browser requests carrying a known key -- the process's bearer token or an open episode's key
(astralight/ARCHITECTURE.md rule 4) -- as ``Authorization: Bearer`` or in ``x-api-key`` (the
anthropic SDK's header).

Keys are compared over SHA-256 digests (:func:`bearer_digest`): the process token in constant
time, episode keys by a lookup of their digest, so neither a key's length nor a matching prefix
shows in the response time (a digest's prefix says nothing about the random key behind it). A request with an ``Origin`` header
or a ``Host`` other than a loopback name is refused even with the right token: a web page the
user visits cannot drive the endpoint through their browser (DNS rebinding included).
"""

from __future__ import annotations

import hashlib
import hmac
import json
from typing import Any, Callable

from astralight.raas.openai_requests import RequestError

__all__ = ["LOOPBACK_HOSTS", "bearer_digest", "request_digest", "LoopbackGuard"]

#: the only host names the endpoint binds to and accepts in a ``Host`` header
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def bearer_digest(token: str) -> bytes:
    """SHA-256 of the ``Authorization`` header value that carries ``token``."""
    return hashlib.sha256(f"Bearer {token}".encode()).digest()


def request_digest(headers: list[tuple[bytes, bytes]]) -> bytes:
    """:func:`bearer_digest` of the key a request carries: its one ``Authorization`` header, or
    its one ``x-api-key`` (the anthropic SDK's header) when it has none; the digest of nothing
    otherwise (which matches no key)."""
    auth = [v for k, v in headers if k == b"authorization"]
    api_keys = [v for k, v in headers if k == b"x-api-key"]
    if not auth and len(api_keys) == 1:
        auth = [b"Bearer " + api_keys[0]]
    return hashlib.sha256(auth[0] if len(auth) == 1 else b"").digest()


class LoopbackGuard:
    """ASGI middleware around the whole app: a known key (constant time), no browser
    requests (Origin header, non-loopback Host), counted; more than one ``Host`` header is a 400
    (which one a proxy and the app would read differs). Lifespan events pass.

    Args:
        app: the ASGI app it guards.
        expected: :func:`bearer_digest` of the token requests must carry, or a function that
            tells whether a digest is one of the keys let in (the process's token, every open
            episode's key).
        count: called with ``"requests"`` for every HTTP request, ``"auth_failures"`` for a
            missing or wrong token and ``"refused"`` for every request it turns away.
    """

    def __init__(self, app: Any, expected: bytes | Callable[[bytes], bool],
                 count: Callable[[str], None]):
        self.app, self.count = app, count
        if isinstance(expected, bytes):
            self.accepts = lambda got: hmac.compare_digest(got, expected)
        else:
            self.accepts = expected

    async def __call__(self, scope, receive, send):
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        self.count("requests")
        got = request_digest(scope["headers"])
        hosts = [v for k, v in scope["headers"] if k == b"host"]
        host = (hosts[0] if hosts else b"").decode("latin-1").rsplit(":", 1)[0].strip("[]")
        refusal = None
        if len(hosts) > 1:  # which one a proxy or the app reads differs: refuse, never pick one
            refusal = RequestError(400, "host", f"host: {len(hosts)} Host headers; send one",
                                   "duplicate_host")
        elif not self.accepts(got):
            self.count("auth_failures")
            refusal = RequestError(401, "authorization", "authorization: missing or wrong "
                                   "bearer token; pass the api_key the agent was given",
                                   "invalid_api_key", "authentication_error")
        elif b"origin" in headers or host not in LOOPBACK_HOSTS:
            refusal = RequestError(403, "origin", "origin: browser or non-loopback requests are "
                                   "refused", "forbidden", "permission_error")
        if refusal is None:
            await self.app(scope, receive, send)
            return
        self.count("refused")
        body = json.dumps(refusal.body()).encode()
        await send({"type": "http.response.start", "status": refusal.status,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
