"""The data plugins' durable state: seeded generators, snapshots and the curator journal.

Every plugin gets its own generator, derived from ``seed`` and its place in the config, so adding
a plugin does not change the draws of the others. Snapshots of every plugin's state are written
every ``plugin_state_every_s`` (and at each primary publication and at shutdown); in between,
every curator event (a push's :class:`PromptOutcome`, a publication's version) is journalled in
the transaction that records it, so replaying the journal after the last snapshot brings the
curators back to exactly the state they had at a kill -9.

The methods named "inside the caller's transaction" only write to the store (and register what
follows in memory with the transaction); the in-memory plugins follow in
:meth:`PluginState.apply_outcome` / :meth:`PluginState.apply_version`, which the caller registers
to run after the commit (:meth:`Transaction.after_commit
<astralight.dataflow.transaction.Transaction.after_commit>`).
"""

from __future__ import annotations

import logging
import zlib

import numpy as np

from astralight.dataflow.plugins import DataPlugin, PromptOutcome
from astralight.dataflow.store import Store
from astralight.dataflow.transaction import Transaction

log = logging.getLogger("astralight.dataflow")


def class_path(plugin: DataPlugin) -> str:
    """``module.QualName`` of a plugin: what its saved state must match to be restored."""
    return f"{type(plugin).__module__}.{type(plugin).__qualname__}"


class PluginState:
    """The plugins built from the config (``plugins``: :func:`config.build_plugins`) and what
    makes them durable in ``store``."""

    def __init__(self, store: Store, plugins: dict, seed: int, every_s: float):
        self.store = store
        self.plugins = plugins
        self.curators = plugins["curators"]
        self.seed = seed
        self.every_s = every_s
        #: consecutive prompts the curators rejected (the curator safety valve's count)
        self.skip_run = 0
        #: sequence number of the last journal entry the curators have applied
        self.journal_applied = 0
        self.saved_at = 0.0

    def named(self) -> dict[str, DataPlugin]:
        """Every plugin by its place in the config (``curators[0]``, ``queue_order.policy[0]``)."""
        out: dict[str, DataPlugin] = {}
        for key in ("curators", "sample_filters", "replay.selectors"):
            for i, plugin in enumerate(self.plugins[key]):
                out[f"{key}[{i}]"] = plugin
        for m, orders in self.plugins["queue_order"].items():
            for i, plugin in enumerate(orders):
                out[f"queue_order.{m}[{i}]"] = plugin
        return out

    def load(self) -> None:
        """Seed every plugin's generator, then restore what the last run saved and replay the
        journal after it. Saved state of a different class (the config changed between runs)
        is ignored with a warning: the plugin starts fresh."""
        saved = self.store.get_meta("plugin_run_state", {})
        self.skip_run = int(saved.get("skip_run", 0))
        states = self.store.plugin_states()
        for name, plugin in self.named().items():
            plugin.rng = np.random.default_rng([self.seed, zlib.crc32(name.encode())])
            if name not in states:
                continue
            saved_class, state = states[name]
            if saved_class != class_path(plugin):
                log.warning("%s: saved state is of %s, the config now names %s; starting it fresh",
                            name, saved_class, class_path(plugin))
                continue
            plugin.rng.bit_generator.state = state["rng"]
            plugin.load_state_dict(state["plugin"])
            log.info("%s (%s): state restored", name, type(plugin).__name__)
        self._replay_journal(int(saved.get("journal_seq", 0)))

    def _replay_journal(self, after: int) -> None:
        """Apply the journal entries after ``after`` in order. (Random draws a curator made
        after the snapshot are not replayed: its generator continues from the snapshot.)"""
        self.journal_applied = after
        rows = self.store.journal_after(after)
        for entry in rows:
            if entry.kind == "outcome":
                self._update(PromptOutcome(**entry.data))
            elif entry.kind == "version":
                self._on_version(int(entry.data["version"]))
            self.journal_applied = int(entry.seq)
        if rows:
            log.info("curators: %d journal entries after the last snapshot replayed", len(rows))

    def journal(self, kind: str, data: dict) -> int | None:
        """Inside the caller's transaction: journal a curator event (only when there are
        curators); the caller applies it after the commit with its sequence number."""
        return self.store.journal(kind, data) if self.curators else None

    def apply_outcome(self, outcome: PromptOutcome, seq: int | None) -> None:
        """After the commit: the curators learn a push's outcome journalled as ``seq``."""
        self._update(outcome)
        if seq is not None:
            self.journal_applied = seq

    def apply_version(self, version: int, seq: int | None) -> None:
        """After the commit: the curators learn a publication journalled as ``seq``."""
        self._on_version(version)
        if seq is not None:
            self.journal_applied = seq

    def _update(self, outcome: PromptOutcome) -> None:
        for curator in self.curators:
            curator.update(outcome)

    def _on_version(self, version: int) -> None:
        for curator in self.curators:
            curator.on_version(version)

    def save(self, tx: Transaction, now: float) -> None:
        """Inside the caller's transaction ``tx``: persist every plugin's state and generator,
        and drop the journal entries the snapshot covers."""
        for name, plugin in self.named().items():
            self.store.save_plugin_state(name, class_path(plugin),
                                         {"rng": plugin.rng.bit_generator.state,
                                          "plugin": plugin.state_dict()}, now)
        self.store.set_meta("plugin_run_state", {"skip_run": self.skip_run,
                                                 "journal_seq": self.journal_applied})
        self.store.truncate_journal(self.journal_applied)
        tx.after_commit(setattr, self, "saved_at", now)

    def maybe_save(self, tx: Transaction, now: float) -> None:
        """Inside the caller's transaction ``tx``: :meth:`save` when ``every_s`` passed since
        the last."""
        if now - self.saved_at >= self.every_s:
            self.save(tx, now)

    def reset_skip_run(self) -> None:
        """After the commit of a created train task: the curators' rejection run is over."""
        self.skip_run = 0
