"""Held-out evaluation: scheduling eval tasks for a policy version and scoring what comes back.

When version ``v`` of a policy is published (and for version 0 at start-up) and
``v % eval.every == 0``, every prompt of the eval source becomes one eval task asking for ``n``
samples (``eval.n``, default ``eval.k``). Eval tasks are leased before train tasks; their samples
never enter a training queue. Each pushed eval task leaves one compact report row (samples,
correct samples, reward sum and the policy versions that actually generated the tokens); the
results are aggregated on read: avg@k (mean reward) and the unbiased pass@k for every k of
``eval.pass_k``, overall, per benchmark and averaged over benchmarks. A few sample completions
per evaluated version are kept in memory (:class:`CompletionLog`) for the trainer's table of
completions (``GET /v1/eval/{model_id}/{version}/completions``). :class:`EvalScheduler` is what
the service core holds of all this: when to schedule, and recording a pushed eval task.
"""

from __future__ import annotations

import contextlib
import logging
import math
import weakref

import numpy as np

from astralight.agents.stats import tool_calls_of

from astralight.dataflow.errors import ServiceError
from astralight.dataflow.parts import Part, Shared
from astralight.dataflow.rows import EvalReportRow, EvalRunRow, TaskRow
from astralight.dataflow.store import Store
from astralight.dataflow.transaction import Transaction
from astralight.protocol import Sample, Task, encode
from astralight.tasks.base import PromptSource

log = logging.getLogger("astralight.dataflow")

#: a sample counts as correct for pass@k when its reward exceeds this
CORRECT_THRESHOLD = 0.5
#: refuse eval sources larger than this: an eval set must be finite and cheap to re-run
MAX_EVAL_PROMPTS = 100_000
#: sample completions kept per evaluated version (one per prompt, the first prompts reported)
COMPLETIONS_PER_VERSION = 8
#: evaluated versions whose completions are kept, per policy (the oldest are forgotten)
COMPLETION_VERSIONS = 64
#: characters kept of a prompt / of a completion's text; generated token ids kept when the
#: workflow gave no text
COMPLETION_TEXT_CHARS = 2000
COMPLETION_TOKENS = 512


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k estimator (Chen et al., 2021): ``1 - C(n-c, k) / C(n, k)``.

    With ``n == k`` samples (how eval tasks are issued) it is simply "any sample correct". If a
    workflow returned fewer than ``k`` samples, any-correct over those is the best available.
    """
    if n <= 0:
        return 0.0
    if n < k:
        return 1.0 if c > 0 else 0.0
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def eval_task_id(model_id: str, version: int, prompt_index: int) -> str:
    return f"eval:{model_id}:v{version}:{prompt_index}"


def eval_size(source: PromptSource) -> int:
    n = len(source)
    if n > MAX_EVAL_PROMPTS:
        raise ValueError(f"eval.source: {type(source).__name__} has {n} prompts; an eval source must "
                         f"be finite (at most {MAX_EVAL_PROMPTS}), e.g. ArithmeticSource(split=eval)")
    return n


def check_source(source: PromptSource) -> int:
    """The prompts of one eval run of ``source``; ValueError when it is empty or too large."""
    try:
        source.get(0)  # sources may build their list lazily; len() is final after
    except IndexError:
        raise ValueError("eval.source: the eval source is empty") from None
    return eval_size(source)


def schedule(store: Store, source: PromptSource, model_id: str, version: int,
             model_ids: list[str], k: int, workflow: str, now: float,
             n: int | None = None, pass_k: list[int] | None = None) -> int:
    """Insert the eval tasks of ``(model_id, version)`` (once; inside the caller's transaction).

    Each task asks for ``n`` samples (None: ``k``); ``k`` is the k of the headline avg@k /
    pass@k and ``pass_k`` the k values pass@k is reported for (None: ``[k]``), both kept with
    the run so results read later (``astralight report``) need no config.
    The evaluated policy comes first in ``Task.model_ids``; other policies follow so that a
    multi-policy workflow still finds every engine it needs. Returns the number of tasks created.
    """
    if store.eval_run_exists(model_id, version):
        return 0
    samples = n if n is not None else k
    if k > samples or any(j > samples for j in pass_k or []):
        raise ValueError(f"eval.pass_k: every k (k={k}, pass_k={pass_k}) must be <= eval.n="
                         f"{samples} samples per eval prompt")
    order = [model_id] + [m for m in model_ids if m != model_id]
    n_prompts = eval_size(source)
    for i in range(n_prompts):
        prompt = source.get(i)
        task = Task(task_id=eval_task_id(model_id, version, i), prompt=prompt.prompt, n=samples,
                    model_ids=order, workflow=workflow, kind="eval", eval_version=version,
                    metadata=dict(prompt.metadata))
        store.insert_task(task.task_id, "eval", order, encode(task), now, prompt_index=i,
                          target_model=model_id, eval_version=version)
    ks = sorted(set(pass_k or []) | {k})
    store.insert_eval_run(model_id, version, n_prompts, k, now, n=samples, pass_k=ks)
    return n_prompts


def summarize(samples: list[Sample]) -> dict:
    """One prompt's report: counts, reward sum and the versions that generated its tokens.

    A multi-step workflow marks retries (``metadata["attempt"] > 0``): the policy's accuracy is
    that of its first attempts, and when samples carry ``metadata["team_correct"]`` (the team's
    answer after verification and retry) ``n_team_correct`` counts those of the first attempts.
    When samples say how many tools their episode called (``metadata["tool_calls"]``, the tool
    workflows), ``n_tool_calling`` counts the first attempts that called at least one.
    """
    gen = [s.versions[s.loss_mask.astype(bool)] for s in samples]
    gen = np.concatenate(gen) if gen else np.zeros(0, np.int32)
    gen = gen[gen >= 0]
    first = [s for s in samples if int(s.metadata.get("attempt", 0)) == 0] or samples
    team = [s.metadata["team_correct"] for s in first if "team_correct" in s.metadata]
    tools = [t for t in (tool_calls_of(s.metadata) for s in first) if t is not None]
    return {
        "n_samples": len(first),
        "n_correct": sum(1 for s in first if s.reward > CORRECT_THRESHOLD),
        "sum_reward": float(sum(s.reward for s in first)),
        "min_version": int(gen.min()) if gen.size else None,
        "max_version": int(gen.max()) if gen.size else None,
        "n_team_correct": int(sum(bool(t) for t in team)) if len(team) == len(first) else None,
        "n_tool_calling": sum(1 for t in tools if t > 0) if len(tools) == len(first) else None,
    }


def run_settings(run: EvalRunRow) -> tuple[int, int, list[int]]:
    """``(k, n, pass_ks)`` of an ``eval_runs`` row: the headline k, the samples per prompt and
    the k values pass@k is reported for. A state written without the ``n`` / ``pass_k`` columns
    (an older or unmigrated DB) has neither: ``n = k`` and ``pass_ks = [k]``."""
    k = int(run.k)
    n = run.n if run.n is not None else k
    ks = [k]
    if run.pass_k:
        try:
            ks = sorted({int(x) for x in run.pass_k} | {k})
        except (TypeError, ValueError):
            ks = [k]
    return k, int(n), ks


def pass_table(rows: list[EvalReportRow], ks: list[int]) -> dict[str, float]:
    """``{str(k): mean over prompts of the unbiased pass@k}`` (JSON-safe string keys)."""
    return {str(j): (sum(pass_at_k(r.n_samples, r.n_correct, j) for r in rows) / len(rows)
                     if rows else 0.0) for j in ks}


def aggregate(store: Store, model_id: str, benchmarks: dict[int, str] | None = None,
              complete: dict[int, dict] | None = None) -> dict[int, dict]:
    """Results per eval version: ``avg_at_k`` (mean reward of all samples), ``pass_at_k`` (mean
    over reported prompts of the unbiased pass@k at the run's ``k``), ``pass_at`` (``{"1": ..,
    "4": ..}``: pass@k for every k of ``eval.pass_k``), ``k``, ``n`` (samples per prompt),
    ``complete`` once every prompt reported, and the generating versions.

    With ``benchmarks`` (``{prompt_index: benchmark name}``, e.g. from :func:`benchmark_map`)
    each version also gets ``benchmarks: {name: {avg_at_k, pass_at_k, pass_at, n_prompts,
    n_reported, n_samples}}``, ``benchmark_average`` (the unweighted mean of the per-benchmark
    avg@k over the benchmarks with at least one report, so a 30-problem AIME counts as much as
    MATH-500), ``benchmark_average_pass_at_k`` and ``benchmark_average_pass_at`` (the same mean
    of pass@k). Prompts missing from the map are grouped under ``"unknown"``.

    ``complete`` (the caller's, kept across calls) holds the results of complete runs, which no
    report can change any more (reports are insert-once): they are read from it, not
    recomputed, and every run found complete is added to it. The service passes one, so that a
    monitor polling the results costs the newest runs, not every report of the run so far.
    """
    out: dict[int, dict] = {}
    for run in store.eval_runs(model_id):
        if complete is not None and run.version in complete:
            out[run.version] = dict(complete[run.version])
            continue
        reports = store.eval_reports(model_id, run.version)
        k, n, ks = run_settings(run)
        n_samples = sum(r.n_samples for r in reports)
        mins = [r.min_version for r in reports if r.min_version is not None]
        maxs = [r.max_version for r in reports if r.max_version is not None]
        passes = pass_table(reports, ks)
        result = out[run.version] = {
            "avg_at_k": sum(r.sum_reward for r in reports) / n_samples if n_samples else 0.0,
            "pass_at_k": passes[str(k)],
            "pass_at": passes,
            "k": k,
            "n": n,
            "n_prompts": run.n_prompts,
            "n_reported": len(reports),
            "n_samples": n_samples,
            "complete": len(reports) >= run.n_prompts,
            "min_version": min(mins) if mins else None,
            "max_version": max(maxs) if maxs else None,
            "scheduled_at": run.scheduled_at,
        }
        team = [r.n_team_correct for r in reports]
        if reports and all(t is not None for t in team):  # a team workflow (solver + verifier)
            result["team_accuracy"] = sum(team) / n_samples if n_samples else 0.0
        calling = [r.n_tool_calling for r in reports]
        if reports and all(t is not None for t in calling):  # a tool-calling workflow
            result["tool_call_rate"] = sum(calling) / n_samples if n_samples else 0.0
        if benchmarks is not None:
            result.update(per_benchmark(reports, k, run.n_prompts, benchmarks, ks))
        if complete is not None and result["complete"]:
            complete[run.version] = dict(result)
    return out


def per_benchmark(reports: list[EvalReportRow], k: int, n_prompts: int, benchmarks: dict[int, str],
                  pass_ks: list[int] | None = None) -> dict:
    """``{"benchmarks": {name: {...}}, "benchmark_average": float | None,
    "benchmark_average_pass_at_k": float | None, "benchmark_average_pass_at": {k: float}}`` of
    one eval run; the averages are over the benchmarks with at least one report."""
    ks = sorted(set(pass_ks or []) | {k})
    scheduled: dict[str, int] = {}
    for index, name in benchmarks.items():
        if 0 <= index < n_prompts:
            scheduled[name] = scheduled.get(name, 0) + 1
    groups: dict[str, list] = {name: [] for name in scheduled}
    for r in reports:
        groups.setdefault(benchmarks.get(r.prompt_index, "unknown"), []).append(r)
    table = {}
    for name, rows in groups.items():
        n_samples = sum(r.n_samples for r in rows)
        passes = pass_table(rows, ks)
        table[name] = {
            "avg_at_k": sum(r.sum_reward for r in rows) / n_samples if n_samples else 0.0,
            "pass_at_k": passes[str(k)],
            "pass_at": passes,
            "n_prompts": scheduled.get(name, len(rows)),
            "n_reported": len(rows),
            "n_samples": n_samples,
        }
    reported = [v for v in table.values() if v["n_reported"]]

    def mean(values):
        return sum(values) / len(values) if values else None

    return {"benchmarks": table,
            "benchmark_average": mean([v["avg_at_k"] for v in reported]),
            "benchmark_average_pass_at_k": mean([v["pass_at_k"] for v in reported]),
            "benchmark_average_pass_at": ({str(j): mean([v["pass_at"][str(j)] for v in reported])
                                           for j in ks} if reported else {})}


_BENCHMARK_MAPS = weakref.WeakKeyDictionary()


def benchmark_map(source: PromptSource | None) -> dict[int, str] | None:
    """``{prompt_index: benchmark}`` of an eval source, or None when it names no benchmark.

    Uses the source's ``benchmark_names()`` when it has one (:class:`MultiBenchmarkSource`), else
    the ``benchmark`` metadata field of each prompt. Computed once per source object.
    """
    if source is None:
        return None
    try:
        return _BENCHMARK_MAPS[source]
    except (KeyError, TypeError):
        pass
    names = getattr(source, "benchmark_names", None)
    if callable(names):
        found = dict(names())
    else:
        found = {}
        for i in range(eval_size(source)):
            name = source.get(i).metadata.get("benchmark")
            if name is not None:
                found[i] = str(name)
    result = found or None
    try:
        _BENCHMARK_MAPS[source] = result
    except TypeError:  # not weak-referenceable: recomputed next time
        pass
    return result


def _prompt_text(prompt) -> str:
    """A prompt (text, or chat messages) as one readable string."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, (list, tuple)):
        parts = []
        for message in prompt:
            if isinstance(message, dict):
                parts.append(f"{message.get('role', '?')}: {message.get('content', '')}")
            else:
                parts.append(str(message))
        return "\n".join(parts)
    return str(prompt)


def completion_row(prompt_index: int, prompt, sample: Sample) -> dict:
    """One row of the completions table: the prompt, the completion (the workflow's text, else
    its generated token ids for the trainer to decode), reward, finish reason, versions; bounded
    by :data:`COMPLETION_TEXT_CHARS` / :data:`COMPLETION_TOKENS`."""
    meta = sample.metadata or {}
    text = meta.get("completion")
    generated = sample.token_ids[sample.loss_mask.astype(bool)]
    gen = sample.versions[sample.loss_mask.astype(bool)]
    return {
        "prompt_index": int(prompt_index),
        "sample_index": int(sample.sample_index),
        "prompt": _prompt_text(prompt)[:COMPLETION_TEXT_CHARS] if prompt is not None else None,
        "completion": text[:COMPLETION_TEXT_CHARS] if isinstance(text, str) else None,
        "completion_ids": (None if isinstance(text, str)
                           else [int(t) for t in generated[:COMPLETION_TOKENS]]),
        "reward": float(sample.reward),
        "correct": bool(sample.reward > CORRECT_THRESHOLD),
        "finish_reason": meta.get("finish_reason") if isinstance(meta.get("finish_reason"), str)
        else None,
        "min_version": int(gen.min()) if gen.size else None,
        "max_version": int(gen.max()) if gen.size else None,
    }


class CompletionLog:
    """A few sample completions per evaluated ``(model_id, version)``, for the trainer's
    TensorBoard / W&B table (``GET /v1/eval/{model_id}/{version}/completions``).

    Bounded: the first completion (a first attempt) of each of the first ``per_version``
    prompts reported, for the newest ``max_versions`` versions of each policy. In memory only:
    it is a view for people, not state -- a restarted dataflow shows none for the versions
    evaluated before the restart (the eval scores themselves are in SQLite).
    """

    def __init__(self, per_version: int = COMPLETIONS_PER_VERSION,
                 max_versions: int = COMPLETION_VERSIONS):
        self.per_version, self.max_versions = per_version, max_versions
        self._rows: dict[str, dict[int, list[dict]]] = {}

    def add(self, model_id: str, version: int, prompt_index: int, prompt,
            samples: list[Sample]) -> None:
        versions = self._rows.setdefault(model_id, {})
        rows = versions.get(version)
        if rows is None:
            if len(versions) >= self.max_versions:
                del versions[min(versions)]
            rows = versions[version] = []
        if len(rows) >= self.per_version or not samples:
            return
        if any(r["prompt_index"] == prompt_index for r in rows):  # a re-pushed task
            return
        first = [s for s in samples if int(s.metadata.get("attempt", 0)) == 0] or samples
        rows.append(completion_row(prompt_index, prompt, first[0]))

    def get(self, model_id: str, version: int, limit: int | None = None) -> list[dict]:
        rows = self._rows.get(model_id, {}).get(version, [])
        return [dict(r) for r in rows[:limit if limit is not None else len(rows)]]


class EvalScheduler(Part):
    """The evals of one service: ``source`` (None: evals are off) scheduled per ``config.eval``
    for the service's current versions, and pushed eval tasks recorded. Call with the
    service's lock held."""

    def __init__(self, shared: Shared, source: PromptSource | None):
        super().__init__(shared)
        self.source = source
        #: a few sample completions per evaluated version (in memory; for the trainer's table)
        self.completions = CompletionLog()

    def schedule(self, model_id: str, version: int, now: float) -> int:
        """Inside the caller's transaction: :func:`schedule` the eval of ``version`` as the
        config says (``eval.k``, ``eval.n``, ``eval.pass_k``)."""
        e = self.config.eval
        return schedule(self.store, self.source, model_id, version, self.model_ids, e.k,
                        self.config.workflow, now, n=e.samples(), pass_k=e.pass_ks())

    def maybe_schedule(self, model_id: str, version: int, now: float,
                       previous: int | None = None) -> int:
        """Inside the caller's transaction: evaluate ``version`` if it is a multiple of
        ``eval.every``, or if it is the first published version past one: a WeightPublisher that
        falls behind publishes only its newest snapshot, and the skipped multiple must not leave
        a hole in the eval curve."""
        every = self.config.eval.every
        crossed = previous is not None and version // every > previous // every
        if self.source is None or (version % every and not crossed):
            return 0
        n = self.schedule(model_id, version, now)
        if n:
            log.info("scheduled %d eval tasks for %s version %d", n, model_id, version)
        return n

    def request(self, model_id: str, version: int, now: float) -> dict:
        """In its own transaction: evaluate ``version`` of ``model_id`` once, whatever
        ``eval.every`` says (:meth:`Dataflow.request_eval`). Only the current version can be
        newly scheduled (409 otherwise), and only with a source (409)."""
        if self.source is None:
            raise ServiceError(409, "eval", "this service has no eval.source, so nothing can be "
                                            "evaluated; set dataflow.eval.source")
        current = self.versions[model_id]
        if self.store.eval_run_exists(model_id, version):
            return {"model_id": model_id, "version": version, "evals_scheduled": 0}
        if version != current:
            when = "is not published yet" if version > current else "is not the current one"
            raise ServiceError(409, "version", (
                f"version {version} of {model_id!r} {when} (current {current}); only the current "
                f"version can be evaluated on request (its eval tasks are generated with the "
                f"weights the RaaS hold)"))
        with self.store.tx():
            n = self.schedule(model_id, version, now)
        log.info("scheduled %d eval tasks for %s version %d on request", n, model_id, version)
        return {"model_id": model_id, "version": version, "evals_scheduled": n}

    def record(self, tx: Transaction, row: TaskRow, samples: list[Sample], now: float) -> None:
        """Inside the caller's transaction ``tx``: the report of a pushed eval task (the
        evaluated policy's samples only; others are counted as ignored) and, after the commit,
        its completions for the trainer's table."""
        target = row.target_model
        mine = [s for s in samples if s.model_id == target]
        if len(mine) < len(samples):
            self.bump(target, "eval_samples_ignored", len(samples) - len(mine))
        if not mine:
            return
        self.store.insert_eval_report(target, row.eval_version, row.prompt_index, row.task_id,
                                      now=now, **summarize(mine))
        self.bump(target, "eval_samples_accepted", len(mine))
        prompt = None
        if self.source is not None and row.prompt_index is not None:
            with contextlib.suppress(Exception):  # the table is a view: never fail a push for it
                prompt = self.source.get(int(row.prompt_index)).prompt
        tx.after_commit(self.completions.add, target, int(row.eval_version),
                        int(row.prompt_index), prompt, mine)
