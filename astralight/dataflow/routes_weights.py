"""Routes of versions and weights: the current version, weight file upload (streamed against
``max_weight_file_bytes``) and download (raw bytes, HTTP Range), publication of a manifest, and
the published manifests (the version and manifest answers name the dataflow's run in the
``X-Astralight-Run-Id`` header: :mod:`astralight.dataflow.run_id`). A trainer token bound to a
model_id uploads and publishes for that model_id only; the core checks the uploads' sha256 and
that versions only grow."""

from __future__ import annotations

from stat import S_ISREG

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse
from starlette.concurrency import run_in_threadpool

from astralight.dataflow.config import DataflowConfig
from astralight.dataflow.core import Dataflow
from astralight.dataflow.errors import ServiceError
from astralight.dataflow.http_access import BodyAccess
from astralight.dataflow.http_bodies import check_version, msgpack_post, msgpack_response
from astralight.dataflow.http_wakeups import Wakeups
from astralight.dataflow.run_id import RUN_ID_HEADER
from astralight.dataflow.weightfiles import fs_error
from astralight.protocol import WeightManifest, decode, expect


def add_weight_routes(app: FastAPI, core: Dataflow, config: DataflowConfig,
                      access: BodyAccess, wake: Wakeups) -> None:
    limit = config.max_body_bytes

    def with_run(response):
        """``response`` naming this dataflow's run (:data:`RUN_ID_HEADER`): a RaaS polling
        versions sees a restart on a fresh state_dir even before it registers again."""
        response.headers[RUN_ID_HEADER] = core.run_id
        return response

    @app.get("/v1/version/{model_id}")
    async def version(model_id: str):
        return with_run(msgpack_response({"model_id": model_id, "run_id": core.run_id,
                                          "version": core.current_version(model_id)}))

    @app.put("/v1/weights/{model_id}/{version}/{name}")
    async def upload(model_id: str, version: int, name: str, request: Request):
        check_version(version)
        access.own_model(model_id)
        await run_in_threadpool(core.check_upload, model_id, version, name)
        max_bytes = config.max_weight_file_bytes
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > max_bytes:
            raise ServiceError(413, "body", f"weight file exceeds max_weight_file_bytes={max_bytes}")
        tmp, sha, size = await core.weights.receive(model_id, version, name, request.stream(),
                                                    max_bytes)
        await run_in_threadpool(core.commit_upload, tmp, model_id, version, name, sha)
        return msgpack_response({"model_id": model_id, "version": version, "name": name,
                                 "sha256": sha, "bytes": size})

    def _weight_file(model_id: str, version: int, name: str):
        """``(path, manifest entry, stat)`` of a published file to send, checked before the
        answer starts (FileResponse opens the file only after its 200 went out): a missing
        file (or something else in its place) is a 410; any other file system error is
        :func:`~astralight.dataflow.weightfiles.fs_error`'s answer, as on upload and publish
        (507 naming the weight store; 422 naming ``name`` for a name it refuses), never a 500."""
        path, info = core.weight_file(model_id, version, name)
        try:
            st = path.stat()
            if S_ISREG(st.st_mode):
                with open(path, "rb"):  # readable (permissions, I/O errors)
                    pass
        except (FileNotFoundError, NotADirectoryError):
            st = None
        except OSError as exc:
            raise fs_error(core.weights.root, exc, "name", name) from exc
        if st is None or not S_ISREG(st.st_mode):
            raise ServiceError(410, "name", f"{name} of {model_id} v{version} is listed in the "
                                            "manifest but missing from the weight store")
        return path, info, st

    @app.get("/v1/weights/{model_id}/{version}/{name}")
    async def download(model_id: str, version: int, name: str):
        check_version(version)
        path, info, st = await run_in_threadpool(_weight_file, model_id, version, name)
        return FileResponse(path, media_type="application/octet-stream", stat_result=st,
                            headers={"X-Sha256": str(info["sha256"])})

    def publish(data: bytes) -> dict:
        manifest = expect(decode(data, max_bytes=limit), WeightManifest, "manifest")
        access.own_model(manifest.model_id)
        return core.publish(manifest)

    # a new version schedules its eval tasks and drops stale samples: room for leases
    msgpack_post(app, "/v1/publish", limit, publish, then=wake.notify_room)

    @app.get("/v1/manifest/{model_id}/latest")
    async def latest_manifest(model_id: str):
        return with_run(msgpack_response(await run_in_threadpool(core.manifest, model_id, None)))

    @app.get("/v1/manifest/{model_id}/{version}")
    async def manifest(model_id: str, version: int):
        check_version(version)
        found = await run_in_threadpool(core.manifest, model_id, version)
        if found is None:
            raise ServiceError(404, "version", f"version {version} of {model_id!r} is not published")
        return with_run(msgpack_response(found))
