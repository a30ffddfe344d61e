"""Entry point: ``astralight dataflow serve --config dataflow.yaml`` (or ``python -m
astralight.dataflow.service --config ...``).

Parses the config, opens the state, serves with uvicorn and prints exactly one line
``dataflow serving on http://HOST:PORT`` once the socket accepts connections (launchers and tests
wait for it). SIGTERM/SIGINT shut down cleanly: pending pulls return, the SQLite WAL is
checkpointed and closed.
"""

from __future__ import annotations

import logging
import signal
import sys

import uvicorn

from astralight.dataflow.app import create_app
from astralight.dataflow.config import DataflowConfig, parse_config

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
        print(f"dataflow serving on http://{host}:{port}", flush=True)

    def handle_exit(self, sig, frame) -> None:
        self._app.state.wakeups.stopping = True
        super().handle_exit(sig, frame)
        if sig == signal.SIGTERM:
            # uvicorn re-raises captured signals after its graceful shutdown; SIGTERM is the normal
            # way to stop this service, so let it end with exit status 0 instead of -15.
            captured = getattr(self, "_captured_signals", [])
            while signal.SIGTERM in captured:
                captured.remove(signal.SIGTERM)


def serve(config: DataflowConfig) -> None:
    app = create_app(config)
    uv_config = uvicorn.Config(app, host=config.host, port=config.port, log_level="warning",
                               access_log=False, timeout_graceful_shutdown=5, lifespan="on")
    _Server(uv_config, app).run()


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
