"""Entry point: ``astralight dataflow serve --config dataflow.yaml`` (or ``python -m
astralight.dataflow.service --config ...``).

Parses the config, opens the state, serves with uvicorn and prints exactly one line
``dataflow serving on http://HOST:PORT`` (``https://`` with ``tls_certfile``) once the socket
accepts connections (launchers and tests wait for it). SIGTERM/SIGINT shut down cleanly: pending
pulls return, the SQLite WAL is checkpointed and closed.

The tokens come from the environment (:meth:`astralight.dataflow.auth.Credentials.from_env`:
``ASTRALIGHT_TOKEN`` for every scope, ``ASTRALIGHT_ROLLOUT_TOKEN`` / ``ASTRALIGHT_TRAINER_TOKEN`` /
``ASTRALIGHT_ADMIN_TOKEN`` per scope, each also as ``..._FILE``); one that is set but empty or
whitespace stops the service (exit status 2). Before binding, :func:`check_bind` refuses a
non-loopback ``host`` without a token (exit status 2, an error naming the host and the variable),
unless the config says ``allow_insecure_public_bind: true``, and refuses tokens shorter than 16
bytes there. The override is a config key rather than an environment
variable on purpose: it is written in the config file the run keeps, where a reviewer sees it,
and cannot leak in from a shell.
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import signal
import socket
import ssl
import sys
from pathlib import Path

import uvicorn

from astralight.dataflow.app import create_app
from astralight.dataflow.auth import MIN_PUBLIC_TOKEN_BYTES, Credentials
from astralight.dataflow.config import DataflowConfig, parse_config
from astralight.dataflow.http_connections import ConnectionGuard, fit_fd_limit, guarded_protocol

log = logging.getLogger("astralight.dataflow")


class _Server(uvicorn.Server):
    """uvicorn server that announces readiness and lets long-polls end on shutdown."""

    def __init__(self, config: uvicorn.Config, app):
        super().__init__(config)
        self._app = app

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets=sockets)
        if self.should_exit:
            return
        host, port = self.config.host, self.config.port
        for server in self.servers:  # the real port when port 0 was asked for
            for sock in server.sockets:
                host, port = sock.getsockname()[:2]
                break
        scheme = "https" if self.config.ssl_certfile else "http"
        print(f"dataflow serving on {scheme}://{host}:{port}", flush=True)

    def handle_exit(self, sig, frame) -> None:
        self._app.state.wakeups.stopping = True
        super().handle_exit(sig, frame)
        if sig == signal.SIGTERM:
            # uvicorn re-raises captured signals after its graceful shutdown; SIGTERM is the normal
            # way to stop this service, so let it end with exit status 0 instead of -15.
            captured = getattr(self, "_captured_signals", [])
            while signal.SIGTERM in captured:
                captured.remove(signal.SIGTERM)


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback IP addresses (127.0.0.0/8, ::1). Any other name is
    treated as public: it may resolve to anything."""
    host = host.strip().strip("[]")
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_bind(host: str, token: str | Credentials | None, allow_insecure_public_bind: bool = False,
               tls: bool = False) -> None:
    """Refuse to serve on a non-loopback address without a bearer token (ValueError naming the
    host, ``ASTRALIGHT_TOKEN`` and the override) or with a token shorter than 16 bytes (naming
    its variable); warn about the weaker setups that remain. ``token``: the single token
    (``ASTRALIGHT_TOKEN``) or every token the service accepts (:class:`Credentials`)."""
    if is_loopback(host):
        return
    tokens = (token.tokens if isinstance(token, Credentials)
              else {"ASTRALIGHT_TOKEN": token} if token else {})
    if not tokens:
        if not allow_insecure_public_bind:
            raise ValueError(
                f"host: refusing to serve on {host!r}, which is not a loopback address, without a "
                "bearer token: anyone who reaches the port could lease tasks, push samples and "
                "publish weights. Set ASTRALIGHT_TOKEN (the same value for the service and every "
                "client; or one token per scope: ASTRALIGHT_ROLLOUT_TOKEN, "
                "ASTRALIGHT_TRAINER_TOKEN, ASTRALIGHT_ADMIN_TOKEN), or bind host: 127.0.0.1, or "
                "-- only on a network you fully trust -- set "
                "allow_insecure_public_bind: true in the dataflow config")
        log.warning("serving on %s WITHOUT a bearer token (allow_insecure_public_bind: true): "
                    "every route is open to anyone who reaches the port", host)
        return
    for name, value in tokens.items():
        if len(value.encode()) < MIN_PUBLIC_TOKEN_BYTES or not value.strip():
            raise ValueError(
                f"{name}: the token is only {len(value.encode())} bytes; a public host ({host!r}) "
                f"needs at least {MIN_PUBLIC_TOKEN_BYTES} random characters (e.g. python -c "
                "'import secrets; print(secrets.token_urlsafe(32))')")
    if not tls:
        log.warning("serving on %s over plain HTTP: the bearer token and all data travel in "
                    "clear text; set tls_certfile/tls_keyfile or put a TLS proxy in front", host)


def check_tls_files(config: DataflowConfig) -> None:
    """Load the certificate and key once before binding, so a wrong path or a key that does not
    match the certificate is an error naming the field, not a traceback from uvicorn."""
    if not config.tls_certfile:
        return
    for name in ("tls_certfile", "tls_keyfile"):
        path = getattr(config, name)
        if not Path(path).is_file():
            raise ValueError(f"{name}: {path!r} is not a readable file (a PEM "
                             f"{'certificate' if name == 'tls_certfile' else 'private key'})")
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(
            config.tls_certfile, config.tls_keyfile)
    except (ssl.SSLError, OSError) as exc:
        raise ValueError(f"tls_certfile, tls_keyfile: cannot load {config.tls_certfile!r} with "
                         f"{config.tls_keyfile!r}: {exc}") from None


def listen_socket(host: str, port: int) -> socket.socket:
    """The service's listening socket, bound before anything else starts: a port in use is a
    ValueError naming ``port`` and the fix (``--port 0``) before the state folder is opened or an
    eval scheduled, and uvicorn serves on this very socket (no window for another process to
    take the port in between)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host.strip("[]"), port))
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise ValueError(f"port: {host}:{port} is already in use (another dataflow service?); "
                             "pick a free port, or --port 0 to take any free one (the ready "
                             "line prints it)") from None
        raise ValueError(f"host, port: cannot bind {host}:{port}: {exc}") from None
    return sock


def uvicorn_config(app, config: DataflowConfig) -> uvicorn.Config:
    """How uvicorn serves ``app``: TLS from the config, no access log, and the connection guard
    of :mod:`astralight.dataflow.http_connections` (``header_timeout_s``, ``max_connections``)
    in place of uvicorn's plain HTTP protocol, which never times out a request head and whose
    ``limit_concurrency`` would refuse valid requests under a flood of stalled connections; the
    limit is fitted to the file-descriptor limit (:func:`fit_fd_limit`).
    ``ws="none"``: the service has no WebSocket route, and an upgraded connection would leave
    the guard."""
    guard = ConnectionGuard(config.header_timeout_s, fit_fd_limit(config.max_connections))
    return uvicorn.Config(app, host=config.host, port=config.port, log_level="warning",
                          access_log=False, timeout_graceful_shutdown=5, lifespan="on",
                          ssl_certfile=config.tls_certfile, ssl_keyfile=config.tls_keyfile,
                          http=guarded_protocol(guard), ws="none")


def serve(config: DataflowConfig) -> None:
    credentials = Credentials.from_env(config.model_ids)
    check_bind(config.host, credentials, config.allow_insecure_public_bind,
               bool(config.tls_certfile))
    check_tls_files(config)
    sock = listen_socket(config.host, config.port)
    try:
        app = create_app(config, credentials=credentials)
        _Server(uvicorn_config(app, config), app).run(sockets=[sock])
    finally:
        sock.close()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["serve"]:  # tolerate `... dataflow serve --config x` passed through whole
        argv = argv[1:]
    config = parse_config(argv)
    logging.basicConfig(level=config.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        serve(config)
    except ValueError as exc:  # config problems found while opening sources/state
        log.error("%s", exc)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
