"""The launcher's restart policy: a crashed component is restarted, counted, and given up on.

A run lasts hours to days on machines that lose processes (OOM killer, preemption, a bug hit once).
Every component is built to come back: the dataflow resumes from its SQLite state folder, a RaaS
starts fresh and registers again, a trainer resumes from its last Lightning checkpoint. What is
left to the launcher is *deciding*: this module holds that decision, apart from process handling,
so it can be tested with fake components and a fake clock.

Policy (``recipe.supervise``, see :func:`supervise_settings`):

* A trainer that exits 0 has **finished** (it reached ``max_steps``); any other exit of a trainer,
  and any exit at all of a service (dataflow, RaaS, autoscaler) while the run goes on, is a
  **crash**.
* A component that exits 2 (a usage or config error: a typo'd option, a missing model path)
  is never restarted: the same command would fail the same way, so the run fails at once
  (:class:`GiveUp`, with its last log lines).
* A crashed component is restarted after a backoff of ``backoff_s * backoff_factor**k`` seconds
  (``k`` = restarts it already had, capped at ``max_backoff_s``), so a component that dies at once
  again does not spin.
* Each component may be restarted ``max_restarts`` times; its next crash fails the run
  (:class:`GiveUp`, with the component's last log lines). ``supervise: false`` restarts nothing:
  the first crash fails the run.

Every crash and restart is an :class:`RestartEvent`; the launcher fills in when the component
recovered (made progress again) and writes the events to the summary.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterable, Protocol

#: the exit status of a usage or config error (argparse, jsonargparse, LightningCLI and
#: astralight's own config checks): the component is never restarted
EXIT_USAGE = 2

#: recipe.supervise keys and their defaults
SUPERVISE_DEFAULTS = {"max_restarts": 3, "backoff_s": 2.0, "backoff_factor": 2.0,
                      "max_backoff_s": 30.0}


class SuperviseError(ValueError):
    """``recipe.supervise`` is not usable; the message names the key."""


def supervise_settings(spec: Any) -> dict | None:
    """``recipe.supervise`` checked, defaults filled in; None when supervision is off.

    Missing / ``None`` / ``true``: the defaults. ``false``: off. A mapping: its keys over the
    defaults (``enabled: false`` also turns it off).
    """
    if spec is None or spec is True:
        return dict(SUPERVISE_DEFAULTS)
    if spec is False:
        return None
    if not isinstance(spec, dict):
        raise SuperviseError(f"recipe.supervise: must be a mapping such as {{max_restarts: 3, "
                             f"backoff_s: 2}}, or false to restart nothing; got {spec!r}")
    spec = dict(spec)
    enabled = spec.pop("enabled", True)
    if not isinstance(enabled, bool):
        raise SuperviseError(f"recipe.supervise.enabled: must be true or false, got {enabled!r}")
    unknown = sorted(set(spec) - set(SUPERVISE_DEFAULTS))
    if unknown:
        raise SuperviseError(f"recipe.supervise.{unknown[0]}: unknown key; known: enabled, "
                             f"{', '.join(SUPERVISE_DEFAULTS)}")
    out = {**SUPERVISE_DEFAULTS, **spec}
    m = out["max_restarts"]
    if isinstance(m, bool) or not isinstance(m, int) or m < 0:
        raise SuperviseError(f"recipe.supervise.max_restarts: must be an int >= 0 (restarts per "
                             f"component), got {m!r}")
    for key in ("backoff_s", "max_backoff_s"):
        v = out[key]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
            raise SuperviseError(f"recipe.supervise.{key}: must be a number of seconds >= 0, "
                                 f"got {v!r}")
    f = out["backoff_factor"]
    if isinstance(f, bool) or not isinstance(f, (int, float)) or f < 1:
        raise SuperviseError(f"recipe.supervise.backoff_factor: must be a number >= 1, got {f!r}")
    return out if enabled else None


def exit_reason(rc: int | None) -> str:
    """What an exit status says beyond its number (SIGKILL that nobody sent on purpose is, on
    Linux, almost always the kernel's out-of-memory killer)."""
    if rc == -9:
        return (" (SIGKILL: on Linux usually the kernel's out-of-memory killer; `dmesg | grep -i "
                "'out of memory'` tells; a smaller micro_batch_size or max_model_len needs less)")
    return ""


def backoff(settings: dict, restarts_so_far: int) -> float:
    """Seconds to wait before restarting a component that was restarted ``restarts_so_far`` times."""
    delay = float(settings["backoff_s"]) * float(settings["backoff_factor"]) ** restarts_so_far
    return min(delay, float(settings["max_backoff_s"]))


class Supervised(Protocol):
    """What the supervisor needs of a component (the launcher's ``Component``, or a fake)."""

    name: str

    def alive(self) -> bool: ...

    @property
    def returncode(self) -> int | None: ...

    def tail(self, lines: int = 30) -> str: ...

    # optional: ``exit_reason(rc) -> str``, the component's own account of an exit status (a Ray
    # component whose actor died says so instead of the out-of-memory guess of :func:`exit_reason`)


class GiveUp(RuntimeError):
    """A component crashed once more than ``max_restarts`` allows, supervision is off, or it exited
    with a usage or config error (:data:`EXIT_USAGE`)."""

    def __init__(self, name: str, returncode: int | None, restarts: int, message: str):
        super().__init__(message)
        self.name = name
        self.returncode = returncode
        self.restarts = restarts


@dataclass
class RestartEvent:
    """One crash of a component and what followed (times are the launcher's wall clock)."""

    component: str
    attempt: int  # 1 for the first restart of this component
    returncode: int | None
    exited_at: float  # when the launcher saw the exit
    backoff_s: float
    restarted_at: float | None = None
    recovered_at: float | None = None  # set by the launcher: the component made progress again
    detail: str = ""  # e.g. the checkpoint a trainer resumed from

    @property
    def downtime_s(self) -> float | None:
        return None if self.restarted_at is None else round(self.restarted_at - self.exited_at, 2)

    @property
    def recovery_s(self) -> float | None:
        return None if self.recovered_at is None else round(self.recovered_at - self.exited_at, 2)

    def as_dict(self) -> dict:
        return {**asdict(self), "downtime_s": self.downtime_s, "recovery_s": self.recovery_s}


def is_trainer(name: str) -> bool:
    return name.startswith("trainer-")


class Supervisor:
    """Watch components, restart crashed ones with backoff, give up after ``max_restarts``.

    Args:
        components: the run's components (names unique).
        settings: :func:`supervise_settings` output, or None for no restarts.
        restart: called with a component to start it again (the launcher picks the checkpoint
            of a trainer, rewrites ``pids.json``, ...); may raise, which counts as one more crash.
            It runs on the thread that calls :meth:`poll`: keep that the launcher's long-lived
            loop thread, since a child's parent-death signal (:mod:`astralight.launch.proc`) fires when
            the thread that forked it exits.
        clock: wall-clock seconds (a fake in tests).
        log: one line per decision.
        on_event: called after each crash is recorded and after each restart (to persist them).
    """

    def __init__(self, components: Iterable[Supervised], settings: dict | None,
                 restart: Callable[[Any], None], clock: Callable[[], float] = time.time,
                 log: Callable[[str], None] = print,
                 on_event: Callable[[RestartEvent], None] | None = None):
        self.components = {c.name: c for c in components}
        self.settings = settings
        self._restart = restart
        self.clock = clock
        self.log = log
        self.on_event = on_event
        self.restarts: dict[str, int] = dict.fromkeys(self.components, 0)
        self.finished: set[str] = set()  # trainers that exited 0, and retired components
        self.pending: dict[str, tuple[float, RestartEvent]] = {}  # name -> (due, event)
        self.events: list[RestartEvent] = []

    def finished_trainers(self) -> bool:
        trainers = [n for n in self.components if is_trainer(n)]
        return bool(trainers) and all(n in self.finished for n in trainers)

    def down(self) -> set[str]:
        """Components waiting for their restart."""
        return set(self.pending)

    def retire(self, name: str) -> None:
        """Never restart ``name`` again, whatever it exits with: the launcher is stopping it on
        purpose (a trainer asked to stop early by the run's stop sequence); a pending restart
        is dropped. A trainer retired this way counts as finished."""
        self.pending.pop(name, None)
        self.finished.add(name)

    def poll(self, now: float | None = None) -> list[RestartEvent]:
        """Look at every component once: record crashes, run restarts that are due.

        Returns the events created or restarted by this call. Raises :class:`GiveUp` when a
        component crashed with no restart left.
        """
        now = self.clock() if now is None else now
        touched: list[RestartEvent] = []
        for name, comp in self.components.items():
            if name in self.finished or name in self.pending or comp.alive():
                continue
            rc = comp.returncode
            if is_trainer(name) and rc == 0:
                self.finished.add(name)
                self.log(f"[launch] {name} finished (exit 0)")
                continue
            touched.append(self._crashed(name, comp, rc, now))
        for name, (due, event) in sorted(self.pending.items(), key=lambda kv: kv[1][0]):
            if now < due:
                continue
            del self.pending[name]
            comp = self.components[name]
            try:
                self._restart(comp)
            except Exception as exc:  # e.g. the executable vanished: one more crash
                self.log(f"[launch] restart of {name} failed: {type(exc).__name__}: {exc}")
                self.restarts[name] += 1
                touched.append(self._crashed(name, comp, None, self.clock()))
                continue
            self.restarts[name] += 1
            event.restarted_at = self.clock()
            self.log(f"[launch] restarted {name} (restart {self.restarts[name]} of "
                     f"{self.settings['max_restarts']}){' ' + event.detail if event.detail else ''}")
            if self.on_event:
                self.on_event(event)
            touched.append(event)
        return touched

    def _crashed(self, name: str, comp: Supervised, rc: int | None, now: float) -> RestartEvent:
        used = self.restarts[name]
        if rc == EXIT_USAGE:
            raise GiveUp(name, rc, used, f"{name} exited with {rc}, a usage or config error (a "
                                         "bad option or key, a missing file, a broken workflow "
                                         "or agent): a restart would fail the same way, so "
                                         f"none is made. Its log:\n"
                                         f"{comp.tail()}")
        explain = getattr(comp, "exit_reason", None)
        why = explain(rc) if callable(explain) else exit_reason(rc)
        if self.settings is None:
            raise GiveUp(name, rc, used, f"{name} exited with {rc}{why} (recipe.supervise is off):\n"
                                         f"{comp.tail()}")
        limit = int(self.settings["max_restarts"])
        if used >= limit:
            raise GiveUp(name, rc, used,
                         f"{name} exited with {rc}{why} after {used} restart(s); "
                         f"recipe.supervise.max_restarts={limit} reached:\n{comp.tail()}")
        delay = backoff(self.settings, used)
        event = RestartEvent(name, used + 1, rc, now, delay)
        self.events.append(event)
        self.pending[name] = (now + delay, event)
        self.log(f"[launch] {name} exited with {rc}{why}; restarting in {delay:g}s "
                 f"(restart {used + 1} of {limit})")
        if self.on_event:
            self.on_event(event)
        return event

    def summary(self) -> dict:
        """``restarts`` per component and every event, for the run's summary."""
        return {"restarts": dict(self.restarts),
                "restart_events": [e.as_dict() for e in self.events]}


__all__ = ["SUPERVISE_DEFAULTS", "SuperviseError", "supervise_settings", "backoff", "GiveUp",
           "RestartEvent", "Supervisor", "is_trainer"]
