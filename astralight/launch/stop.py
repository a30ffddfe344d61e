"""When ``astralight run`` stops, and how: the recipe's ``stop:`` keys, ``stop.versions`` derived
from (or checked against) the trainer's ``max_steps``, the stop conditions, and the stop sequence
that every stop goes through.

``stop:`` keys (:data:`STOP_DEFAULTS`):

- ``versions``: policy versions to train (of ``model_id``, default ``policy``). Derived from the
  trainer's ``trainer.max_steps`` when missing, and the other way round
  (``versions = max_steps / every_n_steps`` of its WeightPublisher): state one of them. Both
  stated and disagreeing is an error naming both keys (:func:`resolve_versions`). Neither
  stated makes a *time-only* run, when a time budget is set: ``max_wall_s``, or the trainer's
  own Lightning ``trainer.max_time``; the trainers then have no ``max_steps``.
- ``max_wall_s``: a time budget, seconds since the launch started (prepare included). The
  progress line's ETA is that of whichever budget ends first: the versions left at the
  measured rate, ``max_wall_s``, or the trainer's ``max_time``.
- ``target_accuracy``: stop once a complete evaluation reaches this avg@k.
- ``timeout_s`` (default 3600): the hard limit; reaching it still writes the summary, and the run
  then fails (exit 1).
- ``final_eval_timeout_s`` (default 300): how long the last version's evaluation may take.
- ``progress_every_s`` (default 5): seconds between progress lines.

Every stop -- versions reached, trainers finished on their own (e.g. Lightning ``max_time``),
``max_wall_s``, ``target_accuracy``, ``timeout``, the run guard (``guard.stop``:
:mod:`astralight.launch.guard`), the first Ctrl-C or SIGTERM to the launcher (``interrupted``;
a second one stops every component at once) -- goes through :class:`StopSequence`: trainers
still running get SIGTERM, on which ``astralight fit`` ends its fit as if ``max_steps`` were
reached (:mod:`astralight.trainer.graceful_stop`: the last checkpoint saved, the last version published);
then the last version of each policy is evaluated (``POST /v1/eval``, whatever ``eval.every``
says), for at most ``final_eval_timeout_s``; then the summary is written with ``stop_reason``.
"""

from __future__ import annotations

import copy
import signal
from typing import Any, Callable, Iterable

#: recipe.stop keys and their defaults (None: off / derived)
STOP_DEFAULTS: dict[str, Any] = {"model_id": "policy", "versions": None, "max_wall_s": None,
                                 "target_accuracy": None, "timeout_s": 3600.0,
                                 "final_eval_timeout_s": 300.0, "progress_every_s": 5.0}

#: the ``stop_reason`` values of the summary
VERSIONS = "versions"                    # stop.versions reached (the trainers finished)
TRAINERS_FINISHED = "trainers_finished"  # the trainers ended earlier by themselves (max_time...)
MAX_WALL = "max_wall_s"
TARGET_ACCURACY = "target_accuracy"
TIMEOUT = "timeout"
GUARD = "guard"                          # the run guard saw a collapse (guard.stop: true)
INTERRUPTED = "interrupted"              # Ctrl-C or SIGTERM to the launcher
STOP_REASONS = (VERSIONS, TRAINERS_FINISHED, MAX_WALL, TARGET_ACCURACY, TIMEOUT, GUARD,
                INTERRUPTED)

#: seconds a politely stopped trainer gets on top of ``final_eval_timeout_s`` (its
#: DataflowMonitor may wait for the final evaluation before it exits) before SIGINT
TRAINER_GRACE_S = 60.0


class StopError(ValueError):
    """A ``stop:`` problem; the message names the recipe key and the fix (the launcher turns it
    into its RecipeError)."""


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def stop_settings(spec: Any, max_time_s: float | None = None) -> dict:
    """``recipe.stop`` with defaults filled in, checked: every problem names its key. Run after
    :func:`resolve_versions`, so ``versions`` is known, or None for a time-only run (which
    needs ``max_wall_s`` or ``max_time_s``, the primary trainer's ``max_time``:
    :func:`trainer_max_time_s`). The result adds it as ``trainer_max_time_s``."""
    if not isinstance(spec, dict):
        raise StopError("recipe.stop: must be a mapping, e.g. {versions: 150, max_wall_s: 600}")
    unknown = sorted(set(spec) - set(STOP_DEFAULTS))
    if unknown:
        raise StopError(f"recipe.stop.{unknown[0]}: unknown key; known: {', '.join(STOP_DEFAULTS)}")
    out = {**STOP_DEFAULTS, **{k: v for k, v in spec.items() if v is not None}}
    if not isinstance(out["model_id"], str) or not out["model_id"]:
        raise StopError(f"recipe.stop.model_id: must be a policy's model_id, "
                        f"got {out['model_id']!r}")
    versions = out["versions"]
    if versions is None and out["max_wall_s"] is None and max_time_s is None:
        raise StopError("recipe.stop.versions: not set, and no time budget either; set "
                        "stop.versions, or stop.max_wall_s for a time-only run")
    if versions is not None and (isinstance(versions, bool) or not isinstance(versions, int)
                                 or versions < 1):
        raise StopError(f"recipe.stop.versions: must be a positive int (policy versions to train),"
                        f" got {versions!r}")
    out["trainer_max_time_s"] = max_time_s
    for key in ("max_wall_s", "timeout_s", "progress_every_s"):
        value = out[key]
        if value is not None and (not _number(value) or value <= 0):
            raise StopError(f"recipe.stop.{key}: must be a number of seconds > 0, got {value!r} "
                            "(write 900, not 15m)")
    if not _number(out["final_eval_timeout_s"]) or out["final_eval_timeout_s"] < 0:
        raise StopError(f"recipe.stop.final_eval_timeout_s: must be a number of seconds >= 0, "
                        f"got {out['final_eval_timeout_s']!r}")
    target = out["target_accuracy"]
    if target is not None and (not _number(target) or not 0 < target <= 1):
        raise StopError(f"recipe.stop.target_accuracy: must be an avg@k in (0, 1], got {target!r}")
    return out


# ----------------------------------------------------------------------------- versions


def trainer_model_id(trainer_cfg: dict, index: int) -> str:
    """The policy a trainer config trains: ``model.init_args.model_id``, else
    ``data.init_args.model_id``, else its index (as the launcher names it)."""
    for part in ("model", "data"):
        init_args = ((trainer_cfg or {}).get(part) or {}).get("init_args") or {}
        if isinstance(init_args.get("model_id"), str):
            return init_args["model_id"]
    return str(index)


def publisher_every_n_steps(trainer_cfg: dict) -> int | None:
    """``every_n_steps`` of the trainer config's WeightPublisher (its default 1 when unset), or
    None when it has none (nothing to derive versions from)."""
    for cb in ((trainer_cfg or {}).get("trainer") or {}).get("callbacks") or []:
        if isinstance(cb, dict) and str(cb.get("class_path", "")).endswith("WeightPublisher"):
            every = (cb.get("init_args") or {}).get("every_n_steps", 1)
            if isinstance(every, bool) or not isinstance(every, int) or every < 1:
                raise StopError(f"WeightPublisher.init_args.every_n_steps: must be an int >= 1, "
                                f"got {every!r}")
            return every
    return None


def max_time_seconds(value: Any, key: str) -> float | None:
    """Lightning's ``trainer.max_time`` in seconds: ``"DD:HH:MM:SS"``, a mapping of
    ``days``/``hours``/``minutes``/``seconds``, or a timedelta; None when unset."""
    import datetime

    if value is None:
        return None
    if isinstance(value, datetime.timedelta):
        return value.total_seconds()
    units = {"days": 86400, "hours": 3600, "minutes": 60, "seconds": 1}
    try:
        if isinstance(value, str):
            parts = [float(x) for x in value.split(":")]
            if len(parts) != 4 or min(parts) < 0:
                raise ValueError
            seconds = sum(p * u for p, u in zip(parts, units.values()))
        elif isinstance(value, dict) and value and set(value) <= set(units):
            seconds = sum(float(value[k]) * units[k] for k in value)
        else:
            raise ValueError
    except (TypeError, ValueError):
        raise StopError(f"{key}: Lightning's max_time, as \"DD:HH:MM:SS\" (e.g. "
                        f"\"00:00:30:00\") or {{hours: 0, minutes: 30}}, got {value!r}") from None
    if seconds <= 0:
        raise StopError(f"{key}: must be a time > 0, got {value!r}")
    return seconds


def trainer_max_time_s(recipe: dict) -> float | None:
    """The ``trainer.max_time`` of the trainer of ``stop.model_id``, in seconds (None: unset)."""
    model_id = (recipe.get("stop") or {}).get("model_id", STOP_DEFAULTS["model_id"])
    for i, cfg in enumerate(recipe.get("trainers") or []):
        if trainer_model_id(cfg, i) == model_id:
            return max_time_seconds(((cfg or {}).get("trainer") or {}).get("max_time"),
                                    f"recipe.trainers[{i}].trainer.max_time")
    return None


def _max_steps(trainer_cfg: dict, key: str) -> int | None:
    value = ((trainer_cfg or {}).get("trainer") or {}).get("max_steps")
    if value is None or value == -1:  # Lightning's "no limit"
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise StopError(f"{key}: must be a positive int (or -1: no limit), got {value!r}")
    return value


def resolve_versions(recipe: dict) -> dict:
    """The recipe with ``stop.versions`` and each trainer's ``trainer.max_steps`` in step.

    Why: kept equal by hand (``versions = max_steps / every_n_steps``), a mismatch runs a
    trainer past the launcher's stop or stops the launcher before the trainer.
    Of the trainer of ``stop.model_id``: a missing ``stop.versions`` is derived from its
    ``max_steps`` (which must then be a multiple of ``every_n_steps``, else its last steps would
    never be published); a missing ``max_steps`` from ``stop.versions``; both given and
    disagreeing is a :class:`StopError` naming both keys. Other trainers without ``max_steps``
    train as many versions. Neither given, with a time budget (``stop.max_wall_s`` or the
    trainer's ``max_time``), is a time-only run: ``stop.versions`` stays None and no trainer
    gets a ``max_steps``. Returns a new dict; the input is not changed.
    """
    out = copy.deepcopy(recipe)
    stop = out.get("stop")
    if not isinstance(stop, dict):
        raise StopError("recipe.stop: must be a mapping with `versions` (or derive it: set "
                        "trainers[i].trainer.max_steps)")
    model_id = stop.get("model_id", STOP_DEFAULTS["model_id"])
    versions = stop.get("versions")
    if versions is not None and (isinstance(versions, bool) or not isinstance(versions, int)
                                 or versions < 1):
        raise StopError(f"recipe.stop.versions: must be a positive int (policy versions to train),"
                        f" got {versions!r}")
    trainers = out.get("trainers") or []
    primary = [(i, t) for i, t in enumerate(trainers) if trainer_model_id(t, i) == model_id]
    if primary:
        i, cfg = primary[0]
        key = f"recipe.trainers[{i}].trainer.max_steps"
        every = publisher_every_n_steps(cfg)
        max_steps = _max_steps(cfg, key)
        if every is None:
            if versions is None:
                raise StopError(f"recipe.stop.versions: not set, and trainers[{i}] ({model_id}) "
                                "has no WeightPublisher to derive it from; set stop.versions")
        elif versions is None and max_steps is None:
            if stop.get("max_wall_s") is None and trainer_max_time_s(out) is None:
                raise StopError(f"recipe.stop.versions: not set, and {key} neither; set one of "
                                f"them (the other is derived: max_steps = versions x "
                                f"every_n_steps = versions x {every}), or stop.max_wall_s for a "
                                "time-only run")
            stop["versions"] = None  # time-only: the budget ends it
        elif versions is None:
            if max_steps % every:
                raise StopError(
                    f"{key}: {max_steps} is not a multiple of its WeightPublisher every_n_steps "
                    f"({every}), so its last {max_steps % every} step(s) would never be "
                    f"published; make it one, or set recipe.stop.versions instead")
            versions = stop["versions"] = max_steps // every
        elif max_steps is None:
            cfg.setdefault("trainer", {})["max_steps"] = versions * every
        elif max_steps != versions * every:
            raise StopError(
                f"recipe.stop.versions ({versions}) and {key} ({max_steps}) disagree: with "
                f"WeightPublisher every_n_steps={every} the trainer publishes "
                f"{max_steps // every} version(s); set only one of them (the other is derived), "
                f"or make max_steps = {versions * every}")
    elif versions is None:
        raise StopError(f"recipe.stop.versions: not set, and no trainer trains stop.model_id "
                        f"{model_id!r} (model.init_args.model_id) to derive it from; set "
                        "stop.versions or stop.model_id")
    for j, cfg in enumerate(trainers):
        if primary and j == primary[0][0]:
            continue
        every = publisher_every_n_steps(cfg)
        if every is not None and versions is not None \
                and _max_steps(cfg, f"recipe.trainers[{j}].trainer.max_steps") is None:
            cfg.setdefault("trainer", {})["max_steps"] = versions * every
    return out


# ----------------------------------------------------------------------------- conditions


def complete_accuracy(evals: dict[int, dict]) -> tuple[int, float] | None:
    """The best complete evaluation as ``(version, avg_at_k)``, or None."""
    done = [(float(r.get("avg_at_k") or 0.0), v) for v, r in evals.items() if r.get("complete")]
    if not done:
        return None
    accuracy, version = max(done)
    return version, accuracy


class StopConditions:
    """Which stop condition the run has met, if any (:meth:`reached`), in this order: the
    trainers finished (``versions`` when ``stop.versions`` is reached, else
    ``trainers_finished``), ``target_accuracy``, ``max_wall_s``, ``timeout``."""

    def __init__(self, settings: dict, t_start: float):
        self.settings = settings
        self.t_start = t_start
        self.target = int(settings["versions"]) if settings["versions"] is not None else None

    def reached(self, now: float, version: int, evals: dict[int, dict],
                trainers_finished: bool) -> str | None:
        s = self.settings
        if trainers_finished:
            reached = self.target is not None and version >= self.target
            return VERSIONS if reached else TRAINERS_FINISHED
        best = complete_accuracy(evals)
        if s["target_accuracy"] is not None and best is not None \
                and best[1] >= float(s["target_accuracy"]):
            return TARGET_ACCURACY
        elapsed = now - self.t_start
        if s["max_wall_s"] is not None and elapsed >= float(s["max_wall_s"]):
            return MAX_WALL
        if elapsed >= float(s["timeout_s"]):
            return TIMEOUT
        return None

    def describe(self, reason: str, version: int, evals: dict[int, dict]) -> str:
        """One line saying why the run stops, with the setting's value."""
        s = self.settings
        if reason == VERSIONS:
            return f"stop.versions={self.target} reached"
        if reason == TRAINERS_FINISHED and self.target is None:
            return f"the trainers finished at version {version} (a trainer limit such as max_time)"
        if reason == TRAINERS_FINISHED:
            return (f"the trainers finished at version {version}, before stop.versions="
                    f"{self.target} (a trainer limit such as max_time)")
        if reason == TARGET_ACCURACY:
            v, acc = complete_accuracy(evals) or (None, 0.0)
            return (f"version {v} evaluated at {acc:.3f} >= "
                    f"stop.target_accuracy={s['target_accuracy']}")
        if reason == MAX_WALL:
            return f"stop.max_wall_s={s['max_wall_s']} reached at version {version}"
        return f"stop.timeout_s={s['timeout_s']} reached at version {version}"


# ----------------------------------------------------------------------------- the sequence


class StopSequence:
    """The steps every stop goes through, advanced by :meth:`step` from the launcher's loop.

    1. Trainers still running get SIGTERM (``astralight fit`` then ends its fit as at
       ``max_steps``: last checkpoint, last version published; :mod:`astralight.trainer.graceful_stop`)
       and are ``retire``-d, so the supervisor never restarts them. One still running after
       ``final_eval_timeout_s`` + :data:`TRAINER_GRACE_S` is stopped hard (``force_stop``).
    2. The last version of each policy in ``model_ids`` is evaluated: ``request_eval(model_id,
       version)`` (True once the dataflow accepted it) is retried at each step until accepted,
       whatever ``eval.every`` says; the sequence is done when each of those evaluations is
       complete or ``final_eval_timeout_s`` has passed since this step began.

    ``model_ids`` empty (no eval source): done once the trainers are down.
    """

    def __init__(self, reason: str, now: float, trainers: Iterable[Any], model_ids: list[str],
                 final_eval_timeout_s: float, request_eval: Callable[[str, int], bool],
                 retire: Callable[[Any], None], force_stop: Callable[[Any], None],
                 log: Callable[[str], None] = print):
        self.reason = reason
        self.trainers = list(trainers)
        self.model_ids = list(model_ids)
        self.final_eval_timeout_s = float(final_eval_timeout_s)
        self.request_eval = request_eval
        self.force_stop = force_stop
        self.log = log
        self.started_at = now
        self.trainer_deadline = now + self.final_eval_timeout_s + TRAINER_GRACE_S
        self.eval_deadline: float | None = None
        self.requested: dict[str, int] = {}
        self.final_versions: dict[str, int] = {}
        self.done = False
        self.eval_complete = False
        for comp in self.trainers:
            retire(comp)
        asked = [c for c in self.trainers if c.alive()]
        for comp in asked:
            comp.send(signal.SIGTERM)
        if asked:
            self.log(f"[launch] stopping {', '.join(c.name for c in asked)}: SIGTERM (the fit "
                     "ends as at max_steps: last checkpoint, last version)")

    @property
    def phase(self) -> str:
        if self.done:
            return "done"
        return "final_eval" if self.eval_deadline is not None else "trainers"

    def step(self, now: float, versions: dict[str, int], evals: dict[str, dict[int, dict]]) -> bool:
        """Advance with the dataflow's current ``versions`` and eval tables per model_id;
        True when the sequence is done."""
        if self.done:
            return True
        if self.eval_deadline is None:
            alive = [c for c in self.trainers if c.alive()]
            if alive and now < self.trainer_deadline:
                return False
            for comp in alive:
                self.log(f"[launch] {comp.name} still running "
                         f"{now - self.started_at:.0f}s after SIGTERM; stopping it")
                self.force_stop(comp)
            self.eval_deadline = now + self.final_eval_timeout_s
            if self.model_ids:
                self.log("[launch] evaluating the last version: "
                         + ", ".join(f"{m} v{versions.get(m, 0)}" for m in self.model_ids))
        pending = False
        for m in self.model_ids:
            v = int(versions.get(m, self.final_versions.get(m, 0)))
            self.final_versions[m] = v
            table = evals.get(m) or {}
            if v not in table and self.requested.get(m) != v:
                if self.request_eval(m, v):
                    self.requested[m] = v
            if not (table.get(v) or {}).get("complete"):
                pending = True
        self.eval_complete = not pending
        if not pending or now >= self.eval_deadline:
            if pending:
                self.log(f"[launch] the last version's evaluation did not complete within "
                         f"stop.final_eval_timeout_s={self.final_eval_timeout_s:g}")
            self.done = True
        return self.done


__all__ = ["STOP_DEFAULTS", "STOP_REASONS", "VERSIONS", "TRAINERS_FINISHED", "MAX_WALL",
           "TARGET_ACCURACY", "TIMEOUT", "GUARD", "INTERRUPTED", "TRAINER_GRACE_S", "StopError",
           "stop_settings", "max_time_seconds", "trainer_max_time_s", "trainer_model_id",
           "publisher_every_n_steps", "resolve_versions", "complete_accuracy", "StopConditions",
           "StopSequence"]
