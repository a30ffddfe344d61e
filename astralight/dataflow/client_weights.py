"""Versions and weights through :class:`~astralight.dataflow.client.DataflowClient`: the current
version, weight file uploads and publication (trainers), manifests and verified downloads
(RaaS), a download resuming a partial file with HTTP Range and logging its progress."""

from __future__ import annotations

import hashlib
import logging
import os
import time
from pathlib import Path

from astralight.dataflow.client_errors import DataflowError
from astralight.protocol import WeightManifest, expect

log = logging.getLogger("astralight.dataflow.client")  # one logger for the whole client


class WeightCalls:
    """Mixed into :class:`~astralight.dataflow.client.DataflowClient`, whose ``_send``, ``_call``
    and ``_http`` carry every request; published manifests are cached in its ``_manifests``
    (a version's manifest never changes)."""

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
