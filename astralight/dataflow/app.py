"""HTTP face of the dataflow service (FastAPI): routes under ``/v1``, msgpack bodies.

Request and response bodies are msgpack (``application/msgpack``, via :mod:`astralight.protocol`);
only ``/v1/info``, ``/v1/stats``, ``/v1/eval/{model_id}`` (and its ``/{version}/completions``, a
few sample completions per evaluated version) and ``/v1/counters/{model_id}`` answer JSON, and
weight files travel as raw bytes (with HTTP Range on download). A bad request gets a 4xx JSON
``{"error", "field"}``; an unexpected exception a 500 JSON, logged with its traceback; neither
stops the server (:mod:`~astralight.dataflow.http_errors`).

:func:`create_app` builds the app around one :class:`~astralight.dataflow.core.Dataflow` and
adds the routes by what they serve: :mod:`~astralight.dataflow.routes_observation` (info, stats,
evals, balance, counters), :mod:`~astralight.dataflow.routes_pool` (a RaaS's membership),
:mod:`~astralight.dataflow.routes_tasks` (leases and pushes),
:mod:`~astralight.dataflow.routes_trainer` (pulls and acks of batches) and
:mod:`~astralight.dataflow.routes_weights` (versions, weight files, manifests).

Security, enforced here so that nothing invalid reaches the core:

* **access** -- :class:`~astralight.dataflow.auth.AccessGuard` wraps the whole ASGI app: with a
  token configured every route (and any route added later, and unknown paths) needs
  ``Authorization: Bearer <token>`` (constant-time over SHA-256 digests), and the token's scope
  (rollout, trainer, admin; ``ASTRALIGHT_TOKEN`` grants all) must be one the route's line in
  :data:`astralight.dataflow.auth.ROUTES` names. Handlers then check what needs the body
  (:class:`~astralight.dataflow.http_access.BodyAccess`): a trainer token bound to a model_id
  acts on that model_id only, and a rollout caller acts only as an instance whose
  ``instance_secret`` (answered by register) it sends, pushing only tasks leased to it. Always:
  requests with ``Origin`` are refused (403) and bodies must be msgpack (415); without any
  token, a ``Host`` that is not loopback or the configured host too (403).
* **size** -- every msgpack body is read through
  :func:`~astralight.dataflow.http_bodies.read_body` (``max_body_bytes``, 413 before parsing);
  weight uploads are streamed against ``max_weight_file_bytes``.
* **schema** -- :func:`astralight.protocol.decode` refuses anything but plain msgpack values
  (no extension types, no object arrays, bounded nesting, array dtype/shape/byte-count checked);
  each route then accepts only its own fields (an unknown field is a 422), with types, ranges
  and lengths checked (:mod:`~astralight.dataflow.http_bodies`). The core adds the checks that
  need state: model_id known, task leased, versions newer, sha256 of uploads.
* **observation** -- :class:`~astralight.dataflow.http_stats.ClientStats` counts requests and
  4xx/5xx answers per client address and per ``instance_id`` named in a body, shown under
  ``clients`` / ``client_instances`` in ``/v1/stats``; a client's 1st, 10th, 100th... failure
  is logged.
* **no code from the wire** -- nothing here unpickles or evaluates client data; bodies are msgpack
  decoded by :mod:`astralight.protocol` only.

Route handlers only parse and format: the state machine is
:class:`~astralight.dataflow.core.Dataflow`, whose blocking calls (SQLite commits with fsync) run
in the thread pool so that long-polling pulls keep waiting on the event loop; a sweeper re-queues
expired batches and collects old weights.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI
from starlette.concurrency import run_in_threadpool

from astralight.dataflow.auth import AccessGuard, Credentials, InstanceSecrets
from astralight.dataflow.config import DataflowConfig
from astralight.dataflow.core import Dataflow
from astralight.dataflow.http_access import BodyAccess
from astralight.dataflow.http_bodies import MSGPACK, msgpack_response
from astralight.dataflow.http_errors import add_error_handlers
from astralight.dataflow.http_stats import ClientStats, ClientTracker, note_request
from astralight.dataflow.http_wakeups import Wakeups
from astralight.dataflow.routes_observation import add_observation_routes
from astralight.dataflow.routes_pool import add_pool_routes
from astralight.dataflow.routes_tasks import add_task_routes
from astralight.dataflow.routes_trainer import add_trainer_routes
from astralight.dataflow.routes_weights import add_weight_routes

__all__ = ["MSGPACK", "ClientStats", "ClientTracker", "Wakeups", "create_app", "msgpack_response"]

log = logging.getLogger("astralight.dataflow")


def create_app(config: DataflowConfig, token: str | None = None,
               credentials: Credentials | None = None) -> FastAPI:
    """Build the service app around a fresh :class:`Dataflow` on ``config.state_dir``.

    Who may call what (:mod:`astralight.dataflow.auth`): ``credentials`` if given; else ``token``
    alone (every scope; ``""``: no auth); else the environment (``ASTRALIGHT_TOKEN`` and the
    scoped ``ASTRALIGHT_ROLLOUT_TOKEN`` / ``ASTRALIGHT_TRAINER_TOKEN`` / ``ASTRALIGHT_ADMIN_TOKEN``,
    :meth:`Credentials.from_env`). No auth: bind only to loopback
    (:func:`astralight.dataflow.service.check_bind` enforces it).
    """
    if credentials is None:
        credentials = (Credentials.from_env(config.model_ids) if token is None
                       else Credentials.single(token) if token else Credentials.none())
    core = Dataflow(config)
    wake = Wakeups(core.model_ids)
    tracker = ClientTracker(config.max_clients_tracked)
    instance_secrets = InstanceSecrets(core.store, core.lock)
    sweep_every = min(1.0, max(0.05, config.batch_ack_timeout_s / 4))

    async def sweeper() -> None:
        while True:
            await asyncio.sleep(sweep_every)
            try:
                wake.notify(await run_in_threadpool(core.requeue_expired_batches))
                if core.gc_due():  # a full version's weights_keep_s grace period ended
                    await run_in_threadpool(core.gc_weights)
            except Exception as exc:  # keep sweeping; the error is in the log
                if not getattr(exc, "logged", False):  # (a full state_dir: logged per episode)
                    log.exception("sweep failed")

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        task = asyncio.create_task(sweeper())
        try:
            yield
        finally:
            wake.stopping = True
            task.cancel()
            await run_in_threadpool(core.close)
            log.info("dataflow state closed")

    app = FastAPI(title="astralight dataflow", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.dataflow = core
    app.state.wakeups = wake
    app.state.clients = tracker
    app.state.auth = credentials.enabled
    app.state.credentials = credentials
    app.state.instance_secrets = instance_secrets
    app.add_middleware(AccessGuard, credentials=credentials, host=config.host,
                       on_refuse=lambda name: note_request(field=name))
    app.add_middleware(ClientStats, tracker=tracker)  # added last: outermost, sees the 401s

    add_error_handlers(app)
    access = BodyAccess(core, config, instance_secrets)
    add_observation_routes(app, core, config, access, tracker)
    add_pool_routes(app, core, config, access, wake)
    add_task_routes(app, core, config, access, wake)
    add_trainer_routes(app, core, config, access, wake)
    add_weight_routes(app, core, config, access, wake)
    return app
