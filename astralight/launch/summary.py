"""The run's summary: the full record in ``RUN/summary.json`` and the one short line printed last.

The full record (:func:`build_summary` plus what the launcher adds: restarts, the last balance
report, pool history, wall time, ``stop_reason``...) holds per-version counters and every eval
table, tens of kilobytes for a toy run; a person reading the terminal wants a handful of numbers
and where the rest is. :func:`short_summary` picks them, :func:`short_line` prints them as one
JSON object (so scripts that read the launcher's last line still can), and :func:`write_summary`
writes the record atomically.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from astralight.agents.stats import FAILURE_KINDS
from astralight.launch.balance import read_jsonl

TIME_TO_ACCURACY = 0.85
"""The accuracy ``wall_s_to_085`` in the summary is measured to."""

#: the keys of the short line, in print order (absent ones are left out)
SHORT_KEYS = ("eval_accuracy_start", "eval_accuracy_end", "eval_version_end",
              "eval_accuracy_best", "eval_version_best", "tool_call_rate_start",
              "tool_call_rate_end", "versions", "samples_trained", "wall_s",
              "trainer_wait_fraction", "wall_s_to_085", "stop_reason", "warnings", "run_dir")


def policy_stats(stats: dict, model_id: str) -> dict:
    """``model_id``'s entry of the dataflow's ``/v1/stats`` (empty when it has none yet)."""
    return (stats.get("models") or {}).get(model_id, {})


def final_eval(evals: dict[int, dict]) -> dict:
    """A policy's first and last complete evaluation (accuracy, and team accuracy if any)."""
    complete = sorted(v for v, r in evals.items() if r.get("complete"))
    if not complete:
        return {"eval_versions": []}
    first, last = evals[complete[0]], evals[complete[-1]]
    out = {"eval_versions": complete, "eval_accuracy_start": first["avg_at_k"],
           "eval_accuracy_end": last["avg_at_k"], "version_end": complete[-1]}
    if "team_accuracy" in last:
        out.update(team_accuracy_start=first.get("team_accuracy"),
                   team_accuracy_end=last["team_accuracy"])
    if "tool_call_rate" in last:
        out.update(tool_call_rate_start=first.get("tool_call_rate"),
                   tool_call_rate_end=last["tool_call_rate"])
    return out


def best_complete_version(evals: dict[int, dict]) -> int | None:
    """The version of the best complete evaluation (highest avg@k, the earliest of equals);
    None when none is complete."""
    complete = [v for v, r in evals.items() if r.get("complete")]
    if not complete:
        return None
    return max(complete, key=lambda v: (float(evals[v].get("avg_at_k") or 0.0), -v))


def rollout_capacity_seconds(instances: list[dict] | None) -> float | None:
    """Sum over the dataflow's instance table of ``alive_s x capacity_units``: what the rollout
    pool cost, in capacity-unit seconds (None when the table does not say how long each lived)."""
    if not instances:
        return None
    total = 0.0
    for row in instances:
        if row.get("alive_s") is None:
            return None
        total += float(row["alive_s"]) * float(row.get("capacity_units") or 1.0)
    return round(total, 1)


def read_pool_history(path: Path) -> list[dict] | None:
    """The autoscaler's decisions (its JSON-lines log), None when there is none."""
    if not Path(path).is_file():
        return None
    return [{k: entry.get(k) for k in ("time", "version", "action", "pool", "target", "launched",
                                       "retire", "reason", "errors")}
            for entry in read_jsonl(path)]


def build_summary(stats: dict, evals: dict[int, dict], per_version: dict | None, model_id: str,
                  final_version: int) -> dict:
    """The run's summary (without ``wall_s`` / ``run_dir``) from the dataflow's last word.

    ``final_version`` is the run's last version: ``eval_accuracy_end`` is its complete
    evaluation's avg@k (None when that evaluation did not complete: an earlier version's
    accuracy would misreport where the run ended); ``eval_version_end`` says which version it is.
    ``eval_accuracy_best`` / ``eval_version_best``: the best complete evaluation (the earliest
    of equals), so a run that ended below its best says so.
    ``samples_trained`` counts fresh and replayed samples in acknowledged batches (what the
    trainer stepped on); ``rollouts_generated`` counts train samples the rollout services
    produced, before any filter (the rollout cost); ``counters`` is the policy's whole stats entry;
    ``per_version`` its counters per version (``{"<v>": {name: int}}``, None when unknown).
    """
    complete = sorted(v for v, r in evals.items() if r.get("complete"))
    pol = policy_stats(stats, model_id)
    final = evals[final_version] if final_version in complete else None
    start = evals[complete[0]] if complete else None
    best_version = best_complete_version(evals)
    tools = {}
    if start is not None and "tool_call_rate" in start:  # a tool-calling workflow
        tools = {"tool_call_rate_start": start["tool_call_rate"],
                 "tool_call_rate_end": final.get("tool_call_rate") if final else None}
    failed = agents_failed(pol)
    if failed is not None:  # an agent workflow: its failed episodes by kind, over the run
        tools["agents_failed"] = failed
    return {
        "eval_accuracy_start": start["avg_at_k"] if start else None,
        "eval_accuracy_end": final["avg_at_k"] if final else None,
        "eval_version_end": final_version if final else None,
        "eval_pass_at_k_end": final.get("pass_at_k") if final else None,
        "eval_accuracy_best": evals[best_version]["avg_at_k"] if complete else None,
        "eval_version_best": best_version,
        **tools,
        "eval_versions": complete,
        "eval": {v: {key: evals[v][key] for key in
                     ("avg_at_k", "pass_at_k", "team_accuracy", "tool_call_rate", "k", "n",
                      "pass_at",
                      "n_prompts", "min_version", "max_version", "benchmark_average",
                      "benchmark_average_pass_at_k", "benchmark_average_pass_at", "benchmarks")
                     if key in evals[v]}
                 for v in complete},
        "versions": pol.get("current_version"),
        "samples_trained": pol.get("samples_trained"),
        "rollouts_generated": pol.get("rollouts_generated"),
        "counters": pol,
        "plugins": stats.get("plugins"),
        "per_version": per_version,
        "rollout_capacity_seconds": rollout_capacity_seconds(stats.get("instances")),
    }


def agents_failed(counters: dict) -> dict[str, int] | None:
    """Train episodes whose agent failed, by kind (``{"error": n, "timeout": n}``), from the
    policy's counters; None when the workflow counts no agent episodes."""
    if "agent_episodes" not in counters:
        return None
    return {k: int(counters.get(f"agent_failed_{k}") or 0) for k in FAILURE_KINDS}


def trainer_wait_fraction(counters: dict) -> float | None:
    """The share of the trainer's step time it spent waiting for a batch, over the whole run
    (the dataflow's ``trainer_wait_ms`` / ``trainer_step_ms``; None before any timed step)."""
    step = float(counters.get("trainer_step_ms") or 0)
    return round(float(counters.get("trainer_wait_ms") or 0) / step, 4) if step > 0 else None


def wall_s_to_accuracy(state_dir: Path, model_id: str, evals: dict, threshold: float) -> float | None:
    """Seconds from the dataflow's start to the publication of the first version whose complete
    evaluation reached ``threshold`` (avg@k); None when none did or the state does not say.

    Publication time, not the eval's end: it measures how fast training got there, not how long
    the asynchronous evaluation took to report. Read from the dataflow's SQLite state (read only).
    """
    import sqlite3

    from astralight.report.rundata import ReadOnlyStore

    reached = sorted(int(v) for v, r in evals.items()
                     if r.get("complete") and float(r.get("avg_at_k") or 0) >= threshold)
    db = Path(state_dir) / "dataflow.db"
    if not reached or not db.exists():
        return None
    if reached[0] == 0:
        return 0.0
    try:
        store = ReadOnlyStore(db)
        try:
            start = store.get_meta("started_at")
            published = store.version_times(model_id).get(reached[0])
        finally:
            store.close()
    except sqlite3.Error:
        return None
    if start is None or published is None:
        return None
    return round(float(published) - float(start), 1)


def short_summary(summary: dict) -> dict:
    """The handful of numbers a person reads at the end of a run (:data:`SHORT_KEYS`), plus
    ``summary`` (where the full record is) and, for a multi-policy run, each policy's end
    accuracy; accuracies and rates rounded to 4 digits."""
    out: dict[str, Any] = {}
    for key in SHORT_KEYS:
        if key in summary:
            value = summary[key]
            rounded = isinstance(value, float) and ("accuracy" in key or "rate" in key)
            out[key] = round(value, 4) if rounded else value
    if summary.get("policies"):
        out["policies"] = {
            m: {k: (round(v, 4) if isinstance(v, float) else v) for k, v in p.items()
                if k in ("eval_accuracy_end", "team_accuracy_end", "version_end")}
            for m, p in summary["policies"].items()}
    if summary.get("run_dir"):
        out["summary"] = str(Path(summary["run_dir"]) / "summary.json")
    return out


def short_line(summary: dict) -> str:
    """:func:`short_summary` as one JSON line (a few hundred bytes, not the full record)."""
    return json.dumps(short_summary(summary))


def write_summary(run_dir: Path, summary: dict) -> Path:
    """``RUN/summary.json``: the full record, written atomically (a reader sees the old file or
    the new one)."""
    from astralight.launch import write_atomic

    return write_atomic(Path(run_dir) / "summary.json", json.dumps(summary, indent=2))


__all__ = ["TIME_TO_ACCURACY", "SHORT_KEYS", "policy_stats", "agents_failed", "final_eval",
           "best_complete_version",
           "rollout_capacity_seconds", "read_pool_history", "build_summary",
           "trainer_wait_fraction", "wall_s_to_accuracy", "short_summary", "short_line",
           "write_summary"]
