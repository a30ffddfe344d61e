"""Keep an engine on the latest published weights of its policy, moving only what changed.

Version ``v`` of a policy is a :class:`~astralight.protocol.WeightManifest` in the dataflow's
weight store, either ``full`` (bf16 safetensors) or a ``delta`` onto exactly ``base_version``
(astralight/ARCHITECTURE.md rule 5). A :class:`WeightSync` keeps a bf16 *shadow copy* of the newest
version it has verified in an :class:`astralight.weights.artifacts.WeightState` (which does all
verification: file size and sha256, every tensor's dtype/shape/sha256, delta base version and base
digest) and brings the engine to it.

Choosing what to download. From the latest manifest it walks ``base_version`` links back:

* **delta route** -- the walk reaches the version the shadow copy holds: download only the deltas
  after it (the usual case: one delta per new version);
* **full route** -- a newcomer (nothing held), or the held version is not in the chain, or the
  deltas would weigh more than the last full version plus the deltas after it: download that
  full version and the deltas after it.

Any failure on a delta route (a corrupt or truncated download, a checksum mismatch, a delta onto
another base) is counted in ``full_fallbacks``, logged with its reason, and followed at once by
the full route. If that fails too, ``failures`` is counted, the engine keeps serving the version
it has, and the next try waits with an exponential backoff (a newer version resets it). A corrupt
or partial download never reaches the engine.

Off the generation path. With ``background=True`` a thread downloads (files of at least
``stream_min_bytes`` are streamed to ``download_dir`` with HTTP Range resume instead of being held
in memory), verifies and applies versions to the shadow copy while the engine generates. The
RaaS's refresh loop calls :meth:`WeightSync.refresh` (on an executor thread) every ~0.1 s while
episodes run: it pays only the engine's in-place load, which the engine applies between two of
its steps with requests in flight (the "refresh pause"), and never waits for the thread: if the
thread is applying a version right then, the load is simply left to the next call.

Pushing only what changed. The sync remembers the tensor table (per-tensor sha256) of what the
engine holds. A refresh sends the tensors whose checksum differs, expanded by the engine's
``weight_update_names`` to whole engine modules (fused q/k/v and gate/up travel together, see
:mod:`astralight.raas.weight_groups`), in one call; the engine resets its prefix cache and sets the
version that stamps new tokens. This works across full versions too: a periodic full that changes
5% of the tensors pushes 5%. When what the engine holds is unknown (the initial model, or a failed
load) everything is sent.

Float32 versions. A version published with ``WeightPublisher(precision="fp32")`` holds each
tensor as two bf16-typed halves (:mod:`astralight.weights.exact`); the shadow copy keeps them as
published, and what goes to the engine is the joined float32 tensor under the weight's own name.

A new run. A dataflow restarted on a fresh ``state_dir`` is a new run (another run id,
:mod:`astralight.dataflow.run_id`; the client keeps the run id its answers name in ``run_id``),
whose version numbers start again at 0. When a check sees another run than the one the sync
follows (or :meth:`WeightSync.follow_run` is told of one), the shadow copy is dropped and the
engine's weights count as another run's (``engine_stale``, unless it never loaded a published
version: it still holds the initial model, the new run's v0): the next check pulls the new
run's latest version in full, whatever its number, and loads it whole; a download of the old
run still in progress is discarded. While the new run has published nothing,
``new_run_unpublished`` says so (the RaaS then exits: only a restart gives back the initial
model). ``on_run(run_id, where)`` is told of every change a check sees.

LoRA adapters. A version whose manifest carries ``metadata["adapter"]`` (a policy trained with
``lora: {publish: adapter}``) holds adapter tensors under PEFT names, not base weights: it goes,
whole, to the engine's ``update_adapter(tensors, version, adapter)`` (``VLLMEngine`` with
``enable_lora``), never to ``update_weights``. An engine without that method fails the load with a
message naming the fix, and keeps serving its current version.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any, Callable

from astralight.protocol import WeightManifest
from astralight.weights.artifacts import WeightState
from astralight.weights.exact import join_fp32, weight_names, with_low_halves

log = logging.getLogger(__name__)

#: files at least this large are streamed to disk instead of being held in memory
DEFAULT_STREAM_MIN_BYTES = 64 << 20
#: longest chain of manifests walked back from the latest one
MAX_CHAIN = 10_000


class WeightSyncError(RuntimeError):
    """The weight store's manifests cannot lead to a usable version."""


class EngineConfigError(WeightSyncError):
    """A version the engine, as it was started, can never load (a LoRA adapter for an engine
    without adapter support). Retrying cannot help, and serving on would leave every rollout of
    an ever older version to be dropped as stale: the RaaS stops with exit 2, a config error
    the launcher shows and does not restart."""


class RunChanged(WeightSyncError):
    """The dataflow's run changed while a version of the old run was being downloaded: it is
    discarded (never installed), and the next check follows the new run."""


def _route_bytes(route: list[WeightManifest]) -> int:
    return sum(int(info.get("bytes", 0)) for m in route for info in m.files.values())


class WeightSync:
    """Moves one engine to newer published versions of ``model_id``.

    Args:
        client_factory: returns a DataflowClient; the background thread gets its own client.
        model_id: the policy whose weights this engine serves.
        engine: an :class:`astralight.engine.Engine`.
        check_interval_s: how often to look for a newer version.
        background: verify new versions in a thread while generation continues.
        download_dir: where large files are streamed to (default: a temporary folder removed by
            :meth:`close`).
        stream_min_bytes: files at least this large go to disk, smaller ones stay in memory.
        min_backoff_s, max_backoff_s: after a failed version, wait ``min_backoff_s`` before
            retrying it, doubling per further failure up to ``max_backoff_s``.
        on_run: called ``(run_id, where)`` when a check sees the dataflow's run change (the
            RaaS drops what it holds of the old run); the sync has followed it already.

    Counters (cumulative): ``refreshes`` (engine loads), ``full_pulls`` / ``delta_pulls``
    (artifacts applied to the shadow copy), ``full_fallbacks`` (delta routes abandoned for a full
    pull), ``failures`` (checks that left the engine on an older version), ``fetched_bytes``,
    ``fetch_s_total``, ``pause_s_total``, ``tensors_pushed``, ``partial_pushes``; ``events``
    keeps the last checks (version, route, bytes, seconds) for benchmarks.
    """

    def __init__(self, client_factory: Callable[[], Any], model_id: str, engine: Any,
                 check_interval_s: float = 2.0, background: bool = True,
                 download_dir: str | Path | None = None,
                 stream_min_bytes: int = DEFAULT_STREAM_MIN_BYTES, min_backoff_s: float = 1.0,
                 max_backoff_s: float = 60.0,
                 on_run: Callable[[str, str], Any] | None = None):
        self.client_factory = client_factory
        self.on_run = on_run
        #: the dataflow run the shadow copy and the engine's weights belong to (None: not known)
        self.run_id: str | None = None
        #: the engine holds weights of another run than :attr:`run_id` (until a load of this one)
        self.engine_stale = False
        #: the engine is stale and this run has published no version yet (its v0: the initial
        #: model, which the engine no longer holds)
        self.new_run_unpublished = False
        self.run_changes = 0
        self.model_id = model_id
        self.engine = engine
        self.check_interval_s = check_interval_s
        self.background = background
        self.stream_min_bytes = int(stream_min_bytes)
        self.min_backoff_s = min_backoff_s
        self.max_backoff_s = max_backoff_s
        self.state = WeightState()
        self.refreshes = 0
        self.pause_s_total = 0.0
        self.last_pause_s = 0.0
        self.fetch_s_total = 0.0
        self.fetched_bytes = 0
        self.failures = 0
        self.full_fallbacks = 0
        self.full_pulls = 0
        self.delta_pulls = 0
        self.tensors_pushed = 0
        self.last_pushed = 0
        self.partial_pushes = 0
        self.last_error: str | None = None
        self.events: deque[dict] = deque(maxlen=1000)
        self._engine_tensors: dict[str, dict] | None = None  # tensor table of what the engine holds
        self._download_dir = Path(download_dir) if download_dir is not None else None
        self._own_dir = False
        self._lock = threading.Lock()  # guards self.state: the thread writes, apply_ready reads
        self._check_lock = threading.Lock()  # one check at a time (thread vs forced refresh)
        self._stop = threading.Event()
        self._last_check = float("-inf")
        self._fail_version: int | None = None
        self._fail_count = 0
        self._retry_at = float("-inf")
        self._load_fail_version: int | None = None  # a version the engine failed to load
        self._load_fails = 0
        self._load_retry_at = float("-inf")
        self._client = None
        self._client_lock = threading.Lock()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ planning

    def _held_version(self) -> int:
        """The newest version of this run held (shadow copy or engine); -1: none."""
        held = self.state.version
        engine = -1 if self.engine_stale else int(self.engine.version)
        return max(engine, -1 if held is None else held)

    # ------------------------------------------------------------------ runs

    def follow_run(self, run_id: str | None) -> bool:
        """Follow dataflow run ``run_id``; True when that is a change from a known run.

        A change drops the shadow copy (the old run's versions), forgets what the engine holds
        (the next load sends every tensor) and its failure backoffs, and marks the engine's
        weights as another run's (:attr:`engine_stale`) unless it never loaded a published
        version. The first run seen is just adopted; None (a dataflow that names no run) is
        ignored."""
        if not run_id:
            return False
        with self._lock:
            old = self.run_id
            if run_id == old:
                return False
            self.run_id = run_id
            if old is None:
                return False
            self.state = WeightState()
            self._engine_tensors = None
            loaded = self.refreshes > 0 or int(self.engine.version) > 0  # (not the initial model)
            self.engine_stale = self.engine_stale or loaded
            self.new_run_unpublished = False
            self._fail_version, self._fail_count, self._retry_at = None, 0, float("-inf")
            self._load_fail_version, self._load_fails = None, 0
            self.run_changes += 1
        self._drop_partial_downloads()  # (a .part of the old run's vN must not resume the new's)
        if self.on_run is None:  # (with a callback, the RaaS says it, once for all its engines)
            log.warning("%s: the dataflow's run changed (%s -> %s): dropped the old run's "
                        "weights (engine on v%s); pulling the new run's latest version in full",
                        self.model_id, old, run_id, self.engine.version)
        return True

    def retry_in(self) -> float:
        """Seconds until a failed version may be pulled again (0: no backoff now)."""
        return max(0.0, self._retry_at - time.monotonic()) if self._fail_version is not None else 0.0

    def _see_run(self, client: Any) -> str | None:
        """The run the client's last answer named (None: it names none); a change is
        followed and told to :attr:`on_run`."""
        run_id = getattr(client, "run_id", None)
        run_id = run_id if isinstance(run_id, str) and run_id else None
        if self.follow_run(run_id) and self.on_run is not None:
            self.on_run(run_id, f"weight check of {self.model_id}")
        return run_id

    def _same_run(self, run_id: str | None) -> None:
        """Raise :class:`RunChanged` when the sync follows another run than ``run_id`` (the
        run a download started in); call with :attr:`_lock` held."""
        if run_id is not None and self.run_id != run_id:
            raise RunChanged(f"{self.model_id}: the dataflow's run changed to {self.run_id} "
                             f"while a version of run {run_id} was downloading; discarded")

    def plan(self, client: Any, latest: WeightManifest, from_full: bool = False) -> list[WeightManifest]:
        """Manifests to apply, oldest first, to go from the held state to ``latest``.

        A delta route (starting with a delta onto the held version) is returned unless it
        downloads more bytes than the full route; ``from_full=True`` forces the full route.
        """
        held = None if from_full else self.state.version
        chain, m = [latest], latest
        while m.kind == "delta" and m.base_version != held:
            if len(chain) > MAX_CHAIN:
                raise WeightSyncError(f"{self.model_id}: no full version within {MAX_CHAIN} "
                                      f"versions below v{latest.version}")
            m = client.manifest(self.model_id, m.base_version)
            chain.append(m)
        route = chain[::-1]
        if route[0].kind == "delta" and len(route) > 1:
            # several deltas behind: compare with the full route (manifests are cached)
            try:
                full_route = self.plan(client, latest, from_full=True)
            except Exception:  # e.g. older manifests collected: the delta route still works
                full_route = None
            if full_route is not None and _route_bytes(full_route) < _route_bytes(route):
                route = full_route
        wrong = [m.version for m in route if m.model_id != self.model_id]
        if wrong:
            raise WeightSyncError(f"manifest.model_id: versions {wrong} are not of {self.model_id!r}")
        return route

    # ------------------------------------------------------------------ fetching

    def _dir(self) -> Path:
        if self._download_dir is None:
            self._download_dir = Path(tempfile.mkdtemp(prefix=f"astralight-weights-{self.model_id}-"))
            self._own_dir = True
        self._download_dir.mkdir(parents=True, exist_ok=True)
        return self._download_dir

    def _fetch(self, client: Any, manifest: WeightManifest) -> dict[str, Any]:
        """Download one version's files: small ones to memory, large ones streamed to disk."""
        files: dict[str, Any] = {}
        for name, info in manifest.files.items():
            size = int(info.get("bytes", 0))
            if size >= self.stream_min_bytes:
                path = self._dir() / f"{self.model_id}-{manifest.version}-{name}"
                files[name] = client.download_weight_file_to(self.model_id, manifest.version,
                                                             name, path)
            else:
                files[name] = client.download_weight_file(self.model_id, manifest.version, name)
            self.fetched_bytes += size
        return files

    def _discard(self, files: dict[str, Any]) -> None:
        for src in files.values():
            if isinstance(src, Path):
                src.unlink(missing_ok=True)

    def _follow(self, client: Any, route: list[WeightManifest], run_id: str | None = None) -> None:
        """Apply ``route`` (of dataflow run ``run_id``) to the shadow copy (a full route builds a
        new one, then swaps it in); :class:`RunChanged` if the sync follows another run by the
        time a version would be installed."""
        if route[0].kind == "full":
            with self._lock:
                self._same_run(run_id)
                self.state = WeightState()  # free the old copy first: one model's worth of memory
            target = WeightState()
            for manifest in route:
                files = self._fetch(client, manifest)
                try:
                    target.apply(manifest, files)
                finally:
                    self._discard(files)
                self._count_pull(manifest)
            with self._lock:
                self._same_run(run_id)
                self.state = target
            return
        for manifest in route:
            files = self._fetch(client, manifest)
            try:
                with self._lock:
                    self._same_run(run_id)
                    self.state.apply(manifest, files)
            finally:
                self._discard(files)
            self._count_pull(manifest)

    def _count_pull(self, manifest: WeightManifest) -> None:
        if manifest.kind == "full":
            self.full_pulls += 1
        else:
            self.delta_pulls += 1

    def check(self, client: Any, force: bool = False) -> int | None:
        """Bring the shadow copy to the latest version if it is newer; return that version."""
        with self._check_lock:
            return self._check(client, force)

    def _check(self, client: Any, force: bool) -> int | None:
        latest = client.latest_manifest(self.model_id)
        run_id = self._see_run(client)
        self.new_run_unpublished = latest is None and self.engine_stale
        if latest is None or latest.version <= self._held_version():
            return None
        try:
            return self._pull(client, latest, force, run_id)
        except RunChanged as exc:  # not a failure of this version: the next check follows
            log.info("%s", exc)
            return None

    def _pull(self, client: Any, latest: WeightManifest, force: bool,
              run_id: str | None) -> int | None:
        """Bring the shadow copy to ``latest`` (of run ``run_id``): the delta route if it can,
        else (or when it fails) the full route; back off after a failure of this version."""
        if (not force and latest.version == self._fail_version
                and time.monotonic() < self._retry_at):
            return None  # backing off after a failure of this very version
        start = time.perf_counter()
        bytes_before = self.fetched_bytes
        try:
            route = self.plan(client, latest)
            kind = route[0].kind
            try:
                self._follow(client, route, run_id)
            except Exception as exc:
                if kind != "delta" or isinstance(exc, RunChanged):
                    raise
                self.full_fallbacks += 1
                reason = f"{type(exc).__name__}: {exc}"
                log.warning("%s: delta route to v%d failed (%s); falling back to a full pull",
                            self.model_id, latest.version, reason)
                kind = "fallback"
                route = self.plan(client, latest, from_full=True)
                self._follow(client, route, run_id)
        except RunChanged:
            raise
        except Exception:
            if run_id is None or run_id == self.run_id:  # (an old run's failure sets no backoff)
                self._fail_version = latest.version
                self._fail_count += 1
                self._retry_at = time.monotonic() + min(
                    self.max_backoff_s, self.min_backoff_s * 2 ** (self._fail_count - 1))
            raise
        finally:
            self._cleanup_downloads()
        self._fail_version, self._fail_count = None, 0
        seconds = time.perf_counter() - start
        self.fetch_s_total += seconds
        self.events.append({"version": latest.version, "route": kind, "manifests": len(route),
                            "bytes": self.fetched_bytes - bytes_before, "seconds": seconds,
                            "ready_at": time.time()})
        return latest.version

    def _drop_partial_downloads(self) -> None:
        """Remove every download file, ``.part`` ones included (another run's bytes)."""
        if self._download_dir is None or not self._download_dir.exists():
            return
        for path in self._download_dir.iterdir():
            if path.is_file():
                path.unlink(missing_ok=True)

    def _cleanup_downloads(self) -> None:
        """Remove finished files; keep ``.part`` files so a retry resumes them."""
        if self._download_dir is None or not self._download_dir.exists():
            return
        for path in self._download_dir.iterdir():
            if path.is_file() and not path.name.endswith(".part"):
                path.unlink(missing_ok=True)

    def _check_logged(self, client: Any, force: bool = False) -> None:
        try:
            self.check(client, force)
        except Exception as exc:  # keep serving on the weights the engine has
            if self._stop.is_set():  # closing: the check was cut short on purpose
                return
            self.failures += 1
            self.last_error = f"{type(exc).__name__}: {exc}"
            log.error("weight sync for %s failed; the engine stays on v%s and retries later: %s",
                      self.model_id, self.engine.version, self.last_error)

    # ------------------------------------------------------------------ applying

    def apply_ready(self, wait: bool = False, force: bool = False) -> float | None:
        """Load the shadow copy into the engine if it is newer; return the pause in seconds.

        Sends only the tensors whose checksum differs from what the engine holds (whole engine
        modules). Returns None at once, without waiting, while the background thread is applying
        a version (unless ``wait``); the next call loads it. A version the engine failed to load
        is tried again only after a backoff (unless ``force``).
        """
        if not self._lock.acquire(blocking=wait):
            return None
        try:
            state = self.state
            version = state.version
            if version is None or (version <= self.engine.version and not self.engine_stale):
                return None  # (an engine on another run's weights loads this run's, any number)
            if (not force and version == self._load_fail_version
                    and time.monotonic() < self._load_retry_at):
                return None  # this version failed to load: back off before the next try
            table = state.manifest.tensors
            # the engine's names: a float32 publication's lower halves travel with their weight
            all_names = weight_names(state.state)
            adapter = (state.manifest.metadata or {}).get("adapter")  # a LoRA policy's version
            names, partial = all_names, False
            update_names = getattr(self.engine, "weight_update_names", None)
            if adapter is not None:  # adapters load whole (a few MiB): all tensors or none
                if self._engine_tensors == table:
                    names = []
            elif self._engine_tensors is not None and update_names is not None:
                changed = [n for n in all_names
                           if any(self._engine_tensors.get(h) != table[h]
                                  for h in with_low_halves([n], table))]
                names = list(update_names(changed, all_names))
                partial = len(names) < len(all_names)
            start = time.perf_counter()
            if not names:  # bit-identical to what the engine holds: only the version moves
                self.engine.version = int(version)
            else:
                self._engine_tensors = None  # unknown until the load has succeeded
                try:
                    tensors = join_fp32(state.tensors(with_low_halves(names, state.state)))
                    if adapter is not None:
                        self._load_adapter(tensors, version, adapter)
                    elif partial:
                        self.engine.update_weights(tensors, version, partial=True)
                    else:
                        self.engine.update_weights(tensors, version)
                except Exception as exc:
                    self._load_failed(version, exc)
                    raise
                self._load_fail_version, self._load_fails = None, 0
            self._engine_tensors = dict(table)
            self.engine_stale = self.new_run_unpublished = False  # on this run's weights now
            pause = time.perf_counter() - start
        finally:
            self._lock.release()
        self.refreshes += 1
        self.partial_pushes += partial
        self.last_pushed = len(names)
        self.tensors_pushed += len(names)
        self.pause_s_total += pause
        self.last_pause_s = pause
        log.info("%s: now on v%d (pushed %d of %d tensors, pause %.3f s)", self.model_id, version,
                 len(names), len(all_names), pause)
        return pause

    def _load_failed(self, version: int, exc: BaseException) -> None:
        """Count a failed engine load and back off before loading ``version`` again (the
        refresh loop calls every ~0.1 s: without it a broken version would be re-sent whole, and
        generation paused for it, ten times a second)."""
        self.failures += 1
        self.last_error = f"{type(exc).__name__}: {exc}"
        self._load_fails = self._load_fails + 1 if version == self._load_fail_version else 1
        self._load_fail_version = version
        self._load_retry_at = time.monotonic() + min(
            self.max_backoff_s, self.min_backoff_s * 2 ** (self._load_fails - 1))
        log.error("%s: loading v%d into the engine failed (%s); the engine stays on v%s, retry "
                  "in %.0f s", self.model_id, version, self.last_error, self.engine.version,
                  self._load_retry_at - time.monotonic())

    def _load_adapter(self, tensors: dict[str, Any], version: int, adapter: Any) -> None:
        """Hand a LoRA adapter version to the engine's adapter path (never to update_weights:
        adapter tensors are not parameters of the base model)."""
        load = getattr(self.engine, "update_adapter", None)
        if load is None:
            raise EngineConfigError(
                f"{self.model_id}: v{version} is a LoRA adapter (manifest metadata.adapter) but "
                f"the engine {type(self.engine).__name__} cannot serve adapters; start it with "
                "enable_lora: true (VLLMEngine) or have the trainer publish merged weights "
                "(model.init_args.lora.publish: merged)")
        load(tensors, version, adapter)

    def refresh(self, force: bool = False) -> float | None:
        """The refresh loop's call. Foreground mode: check (at most every check_interval_s) then load;
        background mode: just load what the thread has verified. ``force`` checks now in either
        mode, ignoring any backoff, and waits for the load (e.g. an eval task for a version the
        engine does not have yet)."""
        now = time.monotonic()
        if force or (not self.background and now - self._last_check >= self.check_interval_s):
            self._last_check = now
            with self._client_lock:  # the refresh loop and an eval's catch-up may race here
                if self._client is None:
                    self._client = self.client_factory()
            self._check_logged(self._client, force)
        return self.apply_ready(wait=force or not self.background, force=force)

    def stats(self) -> dict:
        """Counters for progress lines and reports."""
        return {"version": int(self.engine.version), "refreshes": self.refreshes,
                "full_pulls": self.full_pulls, "delta_pulls": self.delta_pulls,
                "full_fallbacks": self.full_fallbacks, "failures": self.failures,
                "fetched_bytes": self.fetched_bytes, "fetch_s_total": round(self.fetch_s_total, 4),
                "pause_s_total": round(self.pause_s_total, 4), "tensors_pushed": self.tensors_pushed,
                "partial_pushes": self.partial_pushes, "last_error": self.last_error,
                "run_id": self.run_id, "run_changes": self.run_changes}

    # ------------------------------------------------------------------ background thread

    def start(self) -> "WeightSync":
        if self.background and self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=f"weight-sync-{self.model_id}",
                                            daemon=True)
            self._thread.start()
        return self

    def _loop(self) -> None:
        client = self.client_factory()
        if hasattr(client, "stop"):  # close() ends a retry for a gone dataflow at once (not 60 s)
            client.stop = self._stop
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
        if self._own_dir and self._download_dir is not None:
            shutil.rmtree(self._download_dir, ignore_errors=True)
