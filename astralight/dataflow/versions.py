"""Policy versions and the weight files they point to: publication checks and weight GC.

A version is published once its manifest's files are uploaded and match (:func:`check_manifest`);
versions only move forward, by at most ``max_version_jump`` at a time
(:func:`check_version_jump`). :class:`WeightIndex` mirrors the stored versions per model_id
(version, kind, published_at) and decides what weight GC removes: every version older than the
newest full version published at least ``weights_keep_s`` ago. :class:`Publisher` records a
publication: the version, its evals, what it made stale, and what follows in memory after the
commit.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

from astralight.dataflow import batches
from astralight.dataflow.errors import ServiceError
from astralight.dataflow.evals import EvalScheduler
from astralight.dataflow.parts import Part, Shared
from astralight.dataflow.plugin_state import PluginState
from astralight.dataflow.store import Store
from astralight.dataflow.weightfiles import WeightFiles, check_file_name
from astralight.protocol import WeightManifest, encode

log = logging.getLogger("astralight.dataflow")

#: (version, kind, published_at) of one stored version
Entry = tuple[int, str, float]


def check_version_jump(model_id: str, version: int, current: int, jump: int, field: str) -> None:
    """422 naming ``field`` when ``version`` is more than ``jump`` (``max_version_jump``) above
    ``current``: one such publication would make every queued sample stale and every later
    publication of the trainer 409, for as long as the trainer needs to count up to it."""
    if version > current + jump:
        raise ServiceError(422, field, (
            f"version {version} of {model_id!r} is {version - current} above the current "
            f"version {current}, more than max_version_jump={jump}; publish versions "
            f"{current + 1}..{current + jump} (a WeightPublisher numbers them optimizer_steps "
            "// every_n_steps), or raise max_version_jump in the dataflow config for a "
            "trainer resumed from a checkpoint far ahead of this state folder"))


def check_manifest(manifest: WeightManifest, current: int, jump: int, stored: set[int],
                   weights: WeightFiles) -> None:
    """Refuse a manifest that may not become the next version of its policy (409 when it is
    not newer than ``current``, 422 naming the field otherwise): beyond ``jump``, a delta on a
    version not published or not ``stored``, no files, or files not uploaded as listed."""
    mid = manifest.model_id
    if manifest.version <= current:
        raise ServiceError(409, "manifest.version",
                           f"version {manifest.version} of {mid!r} is not newer than the "
                           f"current version {current}; versions only move forward")
    check_version_jump(mid, manifest.version, current, jump, "manifest.version")
    if manifest.kind == "delta" and manifest.base_version > current:
        raise ServiceError(422, "manifest.base_version",
                           f"base version {manifest.base_version} is not published "
                           f"(current {current})")
    # version 0 is the initial model every RaaS starts from, so a delta on it is appliable while
    # it is current; once later versions are out no receiver holds it any more
    if manifest.kind == "delta" and manifest.base_version not in stored and \
            not (manifest.base_version == 0 and current == 0):
        raise ServiceError(422, "manifest.base_version",
                           f"base version {manifest.base_version} is not stored (never "
                           "published, or garbage-collected; version 0, the initial model, only "
                           "while it is current); publish a full version")
    if not manifest.files:
        raise ServiceError(422, "manifest.files", "must list at least one file")
    for name, info in manifest.files.items():
        field = f"manifest.files[{name[:80]}]"
        check_file_name(name, field)
        got = weights.sha256(mid, manifest.version, name, field)
        if got is None:
            raise ServiceError(422, field, f"was not uploaded; PUT it to /v1/weights/{mid}/"
                                           f"{manifest.version}/{name} first")
        if got[0] != info["sha256"]:
            raise ServiceError(422, f"{field}.sha256",
                               f"uploaded file has sha256 {got[0]}, manifest says {info['sha256']}")
        if info.get("bytes") is not None and info["bytes"] != got[1]:
            raise ServiceError(422, f"{field}.bytes",
                               f"uploaded file has {got[1]} bytes, manifest says {info['bytes']}")


class WeightIndex:
    """The stored versions of every policy (``entries``, oldest first) and weight GC over them;
    ``keep_s`` is ``weights_keep_s``. Call every method with the service's lock held."""

    def __init__(self, entries: dict[str, list[Entry]], keep_s: float):
        self.entries = entries
        self.keep_s = keep_s
        #: when the next collection can remove something (:meth:`collect` sets it)
        self.next_due = 0.0

    def stored(self, model_id: str) -> set[int]:
        return {v for v, _, _ in self.entries[model_id]}

    def keep_from(self, model_id: str, now: float) -> int | None:
        """Oldest version to keep: the newest full version published at least ``keep_s`` ago.
        Every sync that started within the grace period planned a chain at or above it (the
        latest full version at that time, or a delta chain onto a version it held above it)."""
        cutoff = now - self.keep_s
        fulls = [v for v, kind, t in self.entries[model_id] if kind == "full" and t <= cutoff]
        return max(fulls) if fulls else None

    def collect(self, store: Store, weights: WeightFiles, versions: dict[str, int],
                bump: Callable[[str, str, int], None], now: float) -> list[Path]:
        """Forget old versions (one transaction per policy, counted with ``bump``), detach
        their folders and those of uploads that can no longer be published; return the folders
        to purge."""
        trash: list[Path] = []
        for mid, index in list(self.entries.items()):
            keep_from = self.keep_from(mid, now)
            old = [v for v, _, _ in index if keep_from is not None and v < keep_from]
            if old:
                with store.tx() as tx:
                    store.delete_versions(mid, old)
                    bump(mid, "weight_versions_removed", len(old))
                    tx.after_commit(self.entries.__setitem__, mid,
                                    [e for e in index if e[0] >= keep_from])
                log.info("weight GC: removed %s versions %d..%d (keeping %d.. since a full version)",
                         mid, old[0], old[-1], keep_from)
            listed = self.stored(mid)
            # a folder of an unpublished version <= current can never be published (409)
            orphans = [v for v in weights.stored_versions(mid)
                       if v not in listed and v <= versions[mid]]
            for v in old + orphans:
                path = weights.detach(mid, v)
                if path is not None:
                    trash.append(path)
        self.next_due = self._next_collection(now)
        return trash

    def _next_collection(self, now: float) -> float:
        """When a full version's grace period ends with older versions still stored."""
        due = float("inf")
        for index in self.entries.values():
            if not index:
                continue
            oldest = index[0][0]
            for v, kind, t in index:
                if kind == "full" and v > oldest and t + self.keep_s > now:
                    due = min(due, t + self.keep_s)
        return due

    def check_not_collected(self, model_id: str, version: int) -> None:
        """404 naming the kept chain when ``version`` (not found in the store) is older than
        every stored version: it was garbage-collected."""
        index = self.entries[model_id]
        if index and version < index[0][0]:
            fulls = [v for v, kind, _ in index if kind == "full"]
            raise ServiceError(404, "version", (
                f"version {version} of {model_id!r} was garbage-collected; the store keeps "
                f"versions {index[0][0]}..{index[-1][0]} (latest full: "
                f"{fulls[-1] if fulls else 'none'}): start from GET /v1/manifest/{model_id}/latest"))

    def summary(self, model_id: str) -> dict:
        """What the stats report of the stored versions of ``model_id``."""
        index = self.entries[model_id]
        fulls = [v for v, kind, _ in index if kind == "full"]
        return {"weight_versions_stored": len(index),
                "weight_oldest_version": index[0][0] if index else None,
                "weight_latest_full": fulls[-1] if fulls else None}


class Publisher(Part):
    """Publishes versions of the service's policies with their files in ``weights``, indexed
    in ``index`` (the service's own; it, the versions, queues and pools change only through
    each transaction); ``serving`` records the samples a version made stale. Call every
    method with the service's lock held."""

    def __init__(self, shared: Shared, weights: WeightFiles, index: WeightIndex,
                 evals: EvalScheduler, plugin_state: PluginState,
                 serving: batches.BatchServing):
        super().__init__(shared)
        self.weights = weights
        self.index = index
        self.evals = evals
        self.plugin_state = plugin_state
        self.serving = serving

    def check_upload(self, model_id: str, version: int, name: str) -> None:
        """An upload of ``name`` for ``version`` may go ahead: a plain file name
        (:func:`check_file_name`), a version newer than the current one (published versions are
        immutable: 409) and within ``max_version_jump`` of it (422)."""
        check_file_name(name)
        current = self.versions[model_id]
        if version <= current:
            raise ServiceError(409, "version", f"version {version} of {model_id!r} is not newer than "
                                               f"the current version {current}; "
                                               "published versions are immutable")
        check_version_jump(model_id, version, current, self.config.max_version_jump, "version")

    def publish(self, manifest: WeightManifest) -> tuple[int, list[Path]]:
        """Record version N of a policy after checking its files (:func:`check_manifest`), in
        one transaction with its evals; then, in a second one at the new version, drop what it
        made stale, and collect old weights. Returns the eval tasks scheduled and the folders
        to purge (outside the lock)."""
        mid = manifest.model_id
        current = self.versions[mid]
        check_manifest(manifest, current, self.config.max_version_jump, self.index.stored(mid),
                       self.weights)
        now = time.time()
        manifest.created = manifest.created or now
        with self.store.tx() as tx:
            self.store.insert_version(mid, manifest.version, encode(manifest), now)
            n_evals = self.evals.maybe_schedule(mid, manifest.version, now, previous=current)
            journal_seq = (self.plugin_state.journal("version", {"version": manifest.version})
                           if mid == self.primary else None)
            tx.after_commit(self._published, manifest, now, journal_seq)
        with self.store.tx() as tx:  # at the new version: what it made stale
            dropped = self.queues[mid].drop_stale(manifest.version)
            tx.on_rollback(batches.push_all, self.queues[mid], dropped)
            replay_stale = self.replay_pools[mid].drop_stale(manifest.version)
            tx.on_rollback(batches.add_all, self.replay_pools[mid], replay_stale)
            self.serving.record_stale(mid, dropped)
            self.bump(mid, "replay_stale_dropped", len(replay_stale))
            if mid == self.primary:
                self.plugin_state.save(tx, now)
        log.info("published %s version %d (%s, %d files)", mid, manifest.version, manifest.kind,
                 len(manifest.files))
        try:
            trash = self.collect(now)
        except Exception:  # the version is published; GC retries at the next publication
            log.exception("weight GC failed")
            trash = []
        return n_evals, trash

    def _published(self, manifest: WeightManifest, now: float, journal_seq: int | None) -> None:
        """After the commit of a publication: the version is current, indexed for weight GC
        and, for the primary policy, told to the curators."""
        mid = manifest.model_id
        self.versions[mid] = manifest.version
        self.index.entries[mid].append((manifest.version, manifest.kind, now))
        if mid == self.primary:
            self.plugin_state.apply_version(manifest.version, journal_seq)

    def collect(self, now: float) -> list[Path]:
        """:meth:`WeightIndex.collect` when ``weights_gc`` is on; returns the folders to purge."""
        if not self.config.weights_gc:
            return []
        return self.index.collect(self.store, self.weights, self.versions, self.bump, now)
