"""The run guard: the launcher watches the learning curves and says when a run is collapsing.

A run can look alive (versions go up, samples are trained) while its policy falls apart: the
accuracy drops from its best, the train reward with it, responses grow until they hit the length
limit, tool calls stop parsing. The final number alone does not say that it was better earlier.
:class:`RunGuard` checks, at each look:

- ``eval_drop``: the latest complete evaluation (avg@k) is below its best by more than this share
  of the best (and by at least :data:`MIN_EVAL_GAP`, the noise of a small eval);
- ``reward_drop``: the train reward, a mean over the last ``window`` steps, is below the best such
  mean by more than this share of it;
- ``length_factor``: the mean response length over the last ``window`` steps is more than this
  many times the mean of the first ``window`` steps;
- ``malformed_rate``: over the last ``window`` steps, more than this share of the tool calls were
  malformed (tool workflows: ``agent/tool_errors/malformed`` per ``agent/tool_calls``);
- ``entropy_floor``: the policy's mean entropy per token over the last ``window`` steps is below
  this (off by default: on the tasks measured, a healthy policy that has sharpened sits at
  0.005-0.03 nats, as low as a collapsed one, so no one floor fits every task).

The evaluations come from the dataflow (what the launcher already polls); the train curves from
the trainers' TensorBoard event files under the run folder (``train/reward_mean``,
``train/response_tokens_mean``, ``train/entropy``, ``agent/*``), read incrementally. A trainer
that logs elsewhere (another machine, another logger) is watched on its evaluations only.

Each kind of event is reported once per logger (the first time it holds): a warning line, a
``guard`` entry in the progress line and the summary's ``guard_events``. With ``stop: true`` the
first event stops the run through the usual stop sequence (``stop_reason: guard``), like
Lightning's ``EarlyStopping``: the last checkpoint is saved and evaluated; the best evaluation
and its version are in the summary (``eval_accuracy_best``, ``eval_version_best``).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

from astralight.launch.summary import best_complete_version

#: ``recipe.guard`` keys and their defaults (None: that check is off)
GUARD_DEFAULTS: dict[str, Any] = {"enabled": True, "eval_drop": 0.25, "reward_drop": 0.5,
                                  "length_factor": 4.0, "malformed_rate": 0.5,
                                  "entropy_floor": None, "window": 10, "stop": False}
#: an eval drop smaller than this (absolute avg@k) is never reported: the noise of ~200 prompts
MIN_EVAL_GAP = 0.05
#: the TensorBoard tags the train checks read
REWARD_TAG = "train/reward_mean"
LENGTH_TAG = "train/response_tokens_mean"
ENTROPY_TAG = "train/entropy"
MALFORMED_TAG = "agent/tool_errors/malformed"
CALLS_TAG = "agent/tool_calls"
TAGS = (REWARD_TAG, LENGTH_TAG, ENTROPY_TAG, MALFORMED_TAG, CALLS_TAG)


class GuardError(ValueError):
    """A ``guard:`` problem; the message names the recipe key and the fix."""


def guard_settings(spec: Any) -> dict:
    """``recipe.guard`` with defaults filled in and checked (``false`` turns the guard off);
    every problem names its key."""
    if spec is False:
        return {**GUARD_DEFAULTS, "enabled": False}
    if spec is None or spec is True:
        return dict(GUARD_DEFAULTS)
    if not isinstance(spec, dict):
        raise GuardError(f"recipe.guard: expected a mapping such as {{eval_drop: 0.25}} or false, "
                         f"got {spec!r}")
    unknown = sorted(set(spec) - set(GUARD_DEFAULTS))
    if unknown:
        raise GuardError(f"recipe.guard.{unknown[0]}: unknown key; the keys are "
                         f"{', '.join(GUARD_DEFAULTS)}")
    out = {**GUARD_DEFAULTS, **spec}
    for key in ("eval_drop", "reward_drop", "malformed_rate"):
        value = out[key]
        if value is not None and not (_number(value) and 0 < value <= 1):
            raise GuardError(f"recipe.guard.{key}: a share in (0, 1] such as 0.25, or null to "
                             f"turn the check off; got {value!r}")
    if out["length_factor"] is not None and not (_number(out["length_factor"])
                                                 and out["length_factor"] > 1):
        raise GuardError("recipe.guard.length_factor: a factor > 1 such as 4, or null to turn "
                         f"the check off; got {out['length_factor']!r}")
    if out["entropy_floor"] is not None and not (_number(out["entropy_floor"])
                                                 and out["entropy_floor"] > 0):
        raise GuardError("recipe.guard.entropy_floor: nats per token > 0 such as 0.01, or null "
                         f"(the default) to turn the check off; got {out['entropy_floor']!r}")
    if not (isinstance(out["window"], int) and not isinstance(out["window"], bool)
            and out["window"] >= 1):
        raise GuardError(f"recipe.guard.window: train steps, an int >= 1 such as 10; got "
                         f"{out['window']!r}")
    for key in ("enabled", "stop"):
        if not isinstance(out[key], bool):
            raise GuardError(f"recipe.guard.{key}: true or false; got {out[key]!r}")
    return out


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass
class GuardEvent:
    """One thing the guard saw: its ``kind`` (a ``recipe.guard`` key), where (``source``: the
    eval's policy or a trainer logger), the ``version`` (of the eval, or the policy's at the
    look), seconds into the run, the measured ``value`` against the ``threshold``, and a
    sentence."""

    kind: str
    source: str
    version: int
    at_s: float
    value: float
    threshold: float
    message: str

    def as_dict(self) -> dict:
        return asdict(self)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _windows(values: list[float], window: int) -> list[float]:
    """The means of every full run of ``window`` consecutive values (a moving average)."""
    return [sum(values[i:i + window]) / window for i in range(len(values) - window + 1)]


def eval_drop_event(evals: dict[int, dict], share: float, source: str,
                    at_s: float) -> GuardEvent | None:
    """An event when the latest complete evaluation is below the best by more than ``share``
    of the best (and by :data:`MIN_EVAL_GAP` or more)."""
    done = sorted(v for v, r in evals.items() if r.get("complete"))
    if len(done) < 2:
        return None
    best_v = best_complete_version(evals)
    best = float(evals[best_v].get("avg_at_k") or 0.0)
    last_v = done[-1]
    last = float(evals[last_v].get("avg_at_k") or 0.0)
    gap = best - last
    if last_v == best_v or gap < MIN_EVAL_GAP or gap <= share * best:
        return None
    return GuardEvent("eval_drop", source, last_v, at_s, round(last, 4),
                      round(best * (1 - share), 4),
                      f"eval accuracy fell to {last:.3f} at v{last_v} from its best {best:.3f} "
                      f"at v{best_v} (more than guard.eval_drop={share:g} of the best)")


def train_events(series: dict[str, list[float]], settings: dict, source: str, version: int,
                 at_s: float) -> list[GuardEvent]:
    """The train-curve events of one trainer logger, from its per-step ``series`` (tag ->
    values in step order)."""
    window = int(settings["window"])
    out = []

    def event(kind, value, threshold, message):
        out.append(GuardEvent(kind, source, version, at_s, round(value, 4), round(threshold, 4),
                              message))

    share = settings["reward_drop"]
    smooth = _windows(series.get(REWARD_TAG, []), window)
    if share is not None and smooth:
        best, last = max(smooth), smooth[-1]
        if best > 0 and last < best * (1 - share):
            event("reward_drop", last, best * (1 - share),
                  f"train reward fell to {last:.3f} (mean of the last {window} steps) from its "
                  f"best {best:.3f} (more than guard.reward_drop={share:g} of the best)")
    factor = settings["length_factor"]
    lengths = series.get(LENGTH_TAG, [])
    if factor is not None and len(lengths) >= 2 * window:
        first, last = _mean(lengths[:window]), _mean(lengths[-window:])
        if first > 0 and last > factor * first:
            event("length_factor", last, factor * first,
                  f"responses grew to {last:.1f} tokens (mean of the last {window} steps) from "
                  f"{first:.1f} at the start (more than guard.length_factor={factor:g}x)")
    rate = settings["malformed_rate"]
    malformed, calls = series.get(MALFORMED_TAG, []), series.get(CALLS_TAG, [])
    n = min(len(malformed), len(calls))
    if rate is not None and n >= window:
        bad, made = sum(malformed[n - window:n]), sum(calls[n - window:n])
        if made > 0 and bad / made > rate:
            event("malformed_rate", bad / made, rate,
                  f"{100 * bad / made:.0f}% of the tool calls of the last {window} steps were "
                  f"malformed (above guard.malformed_rate={rate:g})")
    floor = settings["entropy_floor"]
    entropy = series.get(ENTROPY_TAG, [])
    if floor is not None and len(entropy) >= window:
        last = _mean(entropy[-window:])
        if last < floor:
            event("entropy_floor", last, floor,
                  f"the policy's entropy fell to {last:.4f} nats per token (mean of the last "
                  f"{window} steps), below guard.entropy_floor={floor:g}")
    return out


class TrainCurves:
    """The train scalars of every trainer logger under a run folder, read incrementally: each
    :meth:`read` loads only the events written since the last (one ``EventAccumulator`` per
    event folder, found again at each read so a resumed trainer's new folder is picked up)."""

    def __init__(self, run_dir: Path, tags: tuple[str, ...] = TAGS):
        self.run_dir = Path(run_dir)
        self.tags = tags
        self._accumulators: dict[Path, Any] = {}

    def read(self) -> dict[str, dict[str, list[float]]]:
        """``{logger name: {tag: values in step order}}`` (a later event of a step wins)."""
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        from astralight.report.rundata import tensorboard_loggers

        out: dict[str, dict[str, list[float]]] = {}
        for name, (_, dirs) in tensorboard_loggers(self.run_dir, legacy=True).items():
            steps: dict[str, dict[int, float]] = {}
            for folder in sorted(dirs):
                acc = self._accumulators.get(folder)
                if acc is None:
                    acc = self._accumulators[folder] = EventAccumulator(
                        str(folder), size_guidance={"scalars": 0})
                try:
                    acc.Reload()
                    present = set(acc.Tags().get("scalars", []))
                    for tag in self.tags:
                        if tag in present:
                            steps.setdefault(tag, {}).update(
                                (ev.step, float(ev.value)) for ev in acc.Scalars(tag))
                except Exception:  # noqa: BLE001 - a file being written: read it next time
                    continue
            if steps:
                out[name] = {tag: [v for _, v in sorted(by_step.items())]
                             for tag, by_step in steps.items()}
        return out


class RunGuard:
    """Watches one run (module docstring): :meth:`look` at each progress tick returns the new
    events; :attr:`events` holds them all, :attr:`stop_requested` says whether one should stop
    the run (``stop: true``)."""

    def __init__(self, settings: dict, curves: Callable[[], dict[str, dict[str, list[float]]]]
                 | None = None):
        self.settings = settings
        self.curves = curves
        self.events: list[GuardEvent] = []
        self._seen: set[tuple[str, str]] = set()

    @property
    def stop_requested(self) -> bool:
        return bool(self.settings["enabled"] and self.settings["stop"] and self.events)

    def look(self, at_s: float, version: int, evals: dict[str, dict[int, dict]]) -> list[GuardEvent]:
        """Check every policy's evaluations (``evals``: ``{model_id: eval table}``) and every
        trainer logger's train curves; return the events not reported before."""
        if not self.settings["enabled"]:
            return []
        found: list[GuardEvent] = []
        share = self.settings["eval_drop"]
        if share is not None:
            for model_id, table in evals.items():
                ev = eval_drop_event(table, share, model_id, at_s)
                if ev is not None:
                    found.append(ev)
        if self.curves is not None:
            for name, series in self.curves().items():
                found += train_events(series, self.settings, name, version, at_s)
        new = [ev for ev in found if (ev.kind, ev.source) not in self._seen]
        self._seen.update((ev.kind, ev.source) for ev in new)
        self.events += new
        return new

    def progress_text(self) -> str:
        """`` | guard: eval_drop (policy), length_factor (policy)`` when any event was seen."""
        if not self.events:
            return ""
        return " | guard: " + ", ".join(f"{ev.kind} ({ev.source})" for ev in self.events)


__all__ = ["GUARD_DEFAULTS", "MIN_EVAL_GAP", "GuardError", "GuardEvent", "guard_settings",
           "eval_drop_event", "train_events", "TrainCurves", "RunGuard"]
