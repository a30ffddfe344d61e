"""Keep an engine on the latest published weights of its policy.

Version ``v`` of a policy is a :class:`~astralight.protocol.WeightManifest` in the dataflow's
weight store, either ``full`` (bf16 safetensors) or a ``delta`` onto exactly ``base_version``.
A :class:`WeightSync` holds the bf16 state of the newest version it has verified in an
:class:`astralight.weights.artifacts.WeightState` (which does all verification: file size and
sha256, every tensor's dtype/shape/sha256, delta base version and base digest). To reach the
latest version it walks the ``base_version`` chain back from the latest manifest until a delta
applies onto what it holds or a full version is reached, downloads those files and applies them
oldest first. Any failure drops the held state, so the next attempt starts from a full version
(ARCHITECTURE.md rule 5); a corrupt or partial download never reaches the engine.

Fetching and verifying are split from loading so that the slow part runs off the generation path:
with ``background=True`` a thread keeps the held state current while the engine generates, and
the service calls :meth:`WeightSync.apply_ready` between lease cycles, which only pays the engine's
in-place load (the "refresh pause"). With ``background=False`` :meth:`refresh` does both, between
cycles. The engine always receives the complete state: fused parameters (q/k/v, gate/up) need all
their shards in one load.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

from astralight.protocol import WeightManifest
from astralight.weights.artifacts import WeightState

log = logging.getLogger(__name__)


class WeightSyncError(RuntimeError):
    """The weight store's manifests cannot lead to a usable version."""


class WeightSync:
    """Moves one engine to newer published versions of ``model_id``.

    Args:
        client_factory: returns a DataflowClient; the background thread gets its own client.
        model_id: the policy whose weights this engine serves.
        engine: an :class:`astralight.raas.engine.Engine`.
        check_interval_s: how often to look for a newer version.
        background: verify new versions in a thread while generation continues.
    """

    def __init__(self, client_factory: Callable[[], Any], model_id: str, engine: Any,
                 check_interval_s: float = 2.0, background: bool = True):
        self.client_factory = client_factory
        self.model_id = model_id
        self.engine = engine
        self.check_interval_s = check_interval_s
        self.background = background
        self.state = WeightState()
        self.refreshes = 0
        self.pause_s_total = 0.0
        self.last_pause_s = 0.0
        self.fetch_s_total = 0.0
        self.fetched_bytes = 0
        self.failures = 0
        self._lock = threading.Lock()  # guards self.state: the thread writes, apply_ready reads
        self._check_lock = threading.Lock()  # one check at a time (thread vs forced refresh)
        self._stop = threading.Event()
        self._last_check = float("-inf")
        self._client = None
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ fetching

    def _held_version(self) -> int:
        held = self.state.version
        return max(int(self.engine.version), -1 if held is None else held)

    def plan(self, client: Any, latest: WeightManifest) -> list[WeightManifest]:
        """Manifests to apply, oldest first, to go from the held state to ``latest``."""
        chain, m = [latest], latest
        while m.kind == "delta" and m.base_version != self.state.version:
            if len(chain) > 10_000:
                raise WeightSyncError(f"{self.model_id}: no full version below v{latest.version}")
            m = client.manifest(self.model_id, m.base_version)
            chain.append(m)
        wrong = [m.version for m in chain if m.model_id != self.model_id]
        if wrong:
            raise WeightSyncError(f"manifest.model_id: versions {wrong} are not of {self.model_id!r}")
        return chain[::-1]

    def check(self, client: Any) -> int | None:
        """Bring the held state to the latest version if it is newer; return that version."""
        with self._check_lock:
            return self._check(client)

    def _check(self, client: Any) -> int | None:
        latest = client.latest_manifest(self.model_id)
        if latest is None or latest.version <= self._held_version():
            return None
        start = time.perf_counter()
        try:
            for manifest in self.plan(client, latest):
                files = {name: client.download_weight_file(self.model_id, manifest.version, name)
                         for name in manifest.files}
                self.fetched_bytes += sum(len(d) for d in files.values())
                with self._lock:
                    self.state.apply(manifest, files)
        except Exception:
            with self._lock:
                self.state = WeightState()  # start over from a full version next time
            raise
        self.fetch_s_total += time.perf_counter() - start
        return latest.version

    def _check_logged(self, client: Any) -> None:
        try:
            self.check(client)
        except Exception as exc:  # keep serving on the weights the engine has
            self.failures += 1
            log.error("weight sync for %s failed (next try pulls a full version): %s",
                      self.model_id, exc)

    # ------------------------------------------------------------------ applying

    def apply_ready(self) -> float | None:
        """Load the held state into the engine if it is newer; return the pause in seconds."""
        with self._lock:
            version = self.state.version
            if version is None or version <= self.engine.version:
                return None
            start = time.perf_counter()
            self.engine.update_weights(self.state.tensors(), version)
            pause = time.perf_counter() - start
        self.refreshes += 1
        self.pause_s_total += pause
        self.last_pause_s = pause
        log.info("%s: now on v%d (pause %.3f s)", self.model_id, version, pause)
        return pause

    def refresh(self, force: bool = False) -> float | None:
        """Between cycles. Foreground mode: check (at most every check_interval_s) then load;
        background mode: just load what the thread has verified. ``force`` checks now in either
        mode (e.g. an eval task for a version the engine does not have yet)."""
        now = time.monotonic()
        if force or (not self.background and now - self._last_check >= self.check_interval_s):
            self._last_check = now
            if self._client is None:
                self._client = self.client_factory()
            self._check_logged(self._client)
        return self.apply_ready()

    # ------------------------------------------------------------------ background thread

    def start(self) -> "WeightSync":
        if self.background and self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=f"weight-sync-{self.model_id}",
                                            daemon=True)
            self._thread.start()
        return self

    def _loop(self) -> None:
        client = self.client_factory()
        try:
            while not self._stop.is_set():
                self._check_logged(client)
                self._stop.wait(self.check_interval_s)
        finally:
            client.close()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None
        if self._client is not None:
            self._client.close()
            self._client = None
