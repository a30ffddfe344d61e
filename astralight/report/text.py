"""The report's short text summary (``summary.txt``, also printed).

Totals come from the dataflow DB's per-version counters (every policy) and fall back to
``summary.json`` (the primary policy) when the DB is missing, so the numbers agree with what the
launcher printed at the end of the run.
"""

from __future__ import annotations

from astralight.report.rundata import RunData, recipe_name


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def counter_total(data: RunData, model_id: str, name: str) -> int | None:
    """A counter of ``model_id`` summed over versions; the summary's value when the DB has none."""
    per = data.per_version.get(model_id)
    if per and any(name in c for c in per.values()):
        return sum(int(c.get(name, 0)) for c in per.values())
    summary = data.summary or {}
    if model_id == primary_model(data):
        if summary.get(name) is not None:
            return int(summary[name])
        counters = summary.get("counters") or {}
        if counters.get(name) is not None:
            return int(counters[name])
    return None


def primary_model(data: RunData) -> str | None:
    """The launcher's ``stop.model_id``: the policy the summary's totals are about."""
    summary = data.summary or {}
    balance = summary.get("balance") or (data.balance[-1] if data.balance else {})
    if balance.get("model_id"):
        return balance["model_id"]
    policies = summary.get("policies")
    if isinstance(policies, dict) and policies:
        return next(iter(policies))
    return data.model_ids[0] if data.model_ids else None


def mean_wait_fraction(data: RunData, model_id: str) -> tuple[float, float, float] | None:
    """``(fraction, wait_s, step_s)``: the trainer's waiting time over its step time, whole run."""
    wait = counter_total(data, model_id, "trainer_wait_ms")
    step = counter_total(data, model_id, "trainer_step_ms")
    if wait is None or not step:
        return None
    return wait / step, wait / 1000.0, step / 1000.0


def wait_fraction_after_start(data: RunData, model_id: str) -> float | None:
    """The wait fraction without version 0, whose first step waits for the rollout services to
    start and warm up (None without per-version counters past version 0)."""
    per = data.per_version.get(model_id) or {}
    later = [c for v, c in per.items() if v > 0 and c.get("trainer_step_ms")]
    if 0 not in per or not later:
        return None
    wait = sum(c.get("trainer_wait_ms", 0) for c in later)
    return wait / sum(c["trainer_step_ms"] for c in later)


def policies(data: RunData) -> list[str]:
    found = list(data.model_ids)
    for m in list(data.evals) + list(data.per_version):
        if m not in found:
            found.append(m)
    primary = primary_model(data)
    if primary and primary not in found:
        found.insert(0, primary)
    return found


def _versions_line(data: RunData) -> str:
    summary = data.summary or {}
    if summary.get("versions") is not None:
        return f"versions: {summary['versions']}"
    seen = [v for times in data.version_times.values() for v in times]
    seen += [v for per in data.per_version.values() for v in per]
    return f"versions: {max(seen)} (from the dataflow DB)" if seen else "versions: unknown"


def _wall_line(data: RunData) -> str:
    summary = data.summary or {}
    extra = []
    if summary.get("trainer_seconds") is not None:
        extra.append(f"trainers {summary['trainer_seconds']} s")
    if summary.get("rollout_capacity_seconds") is not None:
        extra.append(f"rollout capacity {summary['rollout_capacity_seconds']} unit-s")
    tail = f" ({'; '.join(extra)})" if extra else ""
    if summary.get("wall_s") is not None:
        return f"wall time: {summary['wall_s']} s{tail}"
    last = [t for times in data.version_times.values() for t in times.values()]
    if last and data.started_at is not None:
        return (f"wall time: ~{max(last) - data.started_at:.1f} s (dataflow start to the last "
                f"published version; summary.json has no wall_s)")
    return "wall time: unknown"


def pass_values(row: dict) -> dict[int, float]:
    """``{k: pass@k}`` of an eval result (or a benchmark's entry): its ``pass_at`` table, or for
    results written before ``eval.pass_k`` existed (old DBs, summary.json) ``{k: pass_at_k}``."""
    out: dict[int, float] = {}
    table = row.get("pass_at")
    if isinstance(table, dict):
        for key, value in table.items():
            try:
                out[int(key)] = float(value)
            except (TypeError, ValueError):
                continue
    if not out and row.get("pass_at_k") is not None and row.get("k") is not None:
        out[int(row["k"])] = float(row["pass_at_k"])
    return out


def headline(row: dict) -> float | None:
    """What "best" ranks versions by: the benchmark-average avg@k, else the overall avg@k."""
    if row.get("benchmark_average") is not None:
        return float(row["benchmark_average"])
    return float(row["avg_at_k"]) if row.get("avg_at_k") is not None else None


def best_version(table: dict[int, dict]) -> int | None:
    """The eval version with the highest :func:`headline` (ties: the later version), as papers
    report the best checkpoint (e.g. AstraFlow's Appendix A.1)."""
    ranked = [(headline(row), v) for v, row in table.items() if headline(row) is not None]
    return max(ranked)[1] if ranked else None


def benchmark_table(row: dict) -> list[str]:
    """Rows of avg@k and pass@k per benchmark, their unweighted average and all prompts."""
    k = row.get("k", "k")
    benches = {name: b for name, b in sorted((row.get("benchmarks") or {}).items())
               if isinstance(b, dict)}
    ks = sorted(set(pass_values(row)).union(*(pass_values({**b, "k": row.get("k")})
                                              for b in benches.values())))
    entries: list[tuple[str, object, float | None, dict[int, float]]] = []
    for name, b in benches.items():
        if not b.get("n_reported", 1):
            entries.append((name, b.get("n_prompts", ""), None, {}))
            continue
        entries.append((name, b.get("n_prompts", ""), b.get("avg_at_k"),
                        pass_values({**b, "k": row.get("k")})))
    if benches:
        avg_pass = {}
        for key, value in (row.get("benchmark_average_pass_at") or {}).items():
            try:
                avg_pass[int(key)] = float(value)
            except (TypeError, ValueError):
                continue
        if not avg_pass and row.get("benchmark_average_pass_at_k") is not None:
            avg_pass[int(row["k"])] = float(row["benchmark_average_pass_at_k"])
        entries.append(("average", "", row.get("benchmark_average"), avg_pass))
    entries.append(("all prompts", row.get("n_prompts", ""), row.get("avg_at_k"),
                    pass_values(row)))
    width = max(11, *(len(e[0]) for e in entries))
    header = (f"    {'benchmark':<{width}} {'prompts':>7} {f'avg@{k}':>7}"
              + "".join(f" {f'pass@{j}':>7}" for j in ks))
    lines = [header]
    for name, prompts, avg, passes in entries:
        if avg is None and not passes:
            lines.append(f"    {name:<{width}} {prompts!s:>7} {'no reports':>7}")
            continue
        lines.append(f"    {name:<{width}} {prompts!s:>7} {_pct(avg):>7}"
                     + "".join(f" {_pct(passes.get(j)):>7}" for j in ks))
    return lines


def eval_tables(model_id: str, table: dict[int, dict]) -> list[str]:
    """The per-benchmark tables of ``model_id`` at its last and at its best eval version."""
    if not table:
        return []
    last = max(table)
    best = best_version(table)
    k = table[last].get("k", "k")
    by = ("benchmark-average avg@" if table[last].get("benchmark_average") is not None
          else "avg@") + str(k)
    if best is None or best == last:
        return [f"  {model_id} v{last}, the last eval and the best by {by}:",
                *benchmark_table(table[last])]
    return [f"  {model_id} v{last}, the last eval:", *benchmark_table(table[last]),
            f"  {model_id} v{best}, the best eval by {by}:", *benchmark_table(table[best])]


def _eval_line(model_id: str, table: dict[int, dict]) -> str:
    versions = sorted(table)
    first, last = table[versions[0]], table[versions[-1]]
    k = last.get("k", "k")
    text = (f"eval {model_id}: v{versions[0]} {_pct(first['avg_at_k'])} -> v{versions[-1]} "
            f"{_pct(last['avg_at_k'])} avg@{k}")
    extra = []
    if first.get("pass_at_k") is not None and last.get("pass_at_k") is not None:
        extra.append(f"pass@{k} {_pct(first['pass_at_k'])} -> {_pct(last['pass_at_k'])}")
    if first.get("team_accuracy") is not None and last.get("team_accuracy") is not None:
        extra.append(f"team {_pct(first['team_accuracy'])} -> {_pct(last['team_accuracy'])}")
    if first.get("benchmark_average") is not None and last.get("benchmark_average") is not None:
        extra.append(f"benchmark average {_pct(first['benchmark_average'])} -> "
                     f"{_pct(last['benchmark_average'])}")
    if (first.get("benchmark_average_pass_at_k") is not None
            and last.get("benchmark_average_pass_at_k") is not None):
        extra.append(f"benchmark average pass@{k} {_pct(first['benchmark_average_pass_at_k'])} "
                     f"-> {_pct(last['benchmark_average_pass_at_k'])}")
    best = best_version(table)
    if best is not None and best != versions[-1]:
        extra.append(f"best v{best} {_pct(headline(table[best]))}")
    return text + (f" ({'; '.join(extra)})" if extra else "")


def _balance_line(data: RunData) -> str:
    summary = data.summary or {}
    report = summary.get("balance") or (data.balance[-1] if data.balance else None)
    if not report:
        return "final balance decision: none (no balance report in summary.json or balance.txt)"
    d = report.get("decision") or {}
    versions = report.get("versions") or []
    where = f" [{report.get('model_id', '?')}"
    where += f", versions {versions[0]}..{versions[1]}]" if len(versions) == 2 else "]"
    return (f"final balance decision: {d.get('action')}, pool {d.get('pool')} -> "
            f"{d.get('target')} ({d.get('reason')}); wait fraction "
            f"{_pct(report.get('wait_fraction'))}{where}")


def summary_text(data: RunData, written: list[str], skipped: dict[str, str], window: int) -> str:
    """The whole text summary (ends with a newline)."""
    names = policies(data)
    lines = [f"astralight run report: {data.run_dir}",
             f"recipe: {recipe_name(data)}",
             f"policies: {', '.join(names) if names else 'unknown'}",
             _versions_line(data),
             _wall_line(data)]
    if data.sources:
        lines.append("sources:")
        lines += [f"  {what}: {where}" for what, where in data.sources.items()]
    if data.evals:
        lines += [_eval_line(m, data.evals[m]) for m in names if data.evals.get(m)]
        lines.append("eval per benchmark (avg@k, unbiased pass@k):")
        for m in names:
            lines += eval_tables(m, data.evals.get(m) or {})
    else:
        lines.append("eval: none complete")
    parts = []
    for m in names:
        rollouts = counter_total(data, m, "rollouts_generated")
        trained = counter_total(data, m, "samples_trained")
        if rollouts is not None or trained is not None:
            parts.append(f"{m} {rollouts if rollouts is not None else '?'} / "
                         f"{trained if trained is not None else '?'}")
    lines.append("rollouts generated / samples trained: " + ("; ".join(parts) or "unknown"))
    waits = []
    for m in names:
        w = mean_wait_fraction(data, m)
        if w is not None:
            late = wait_fraction_after_start(data, m)
            waits.append(f"{m} {_pct(w[0])} ({w[1]:.1f} s waiting of {w[2]:.1f} s"
                         + (f"; {_pct(late)} after version 0" if late is not None else "") + ")")
    lines.append("mean trainer wait fraction: " + ("; ".join(waits) or "unknown"))
    lines.append(_balance_line(data))
    lines.append(f"plots written: {', '.join(written) if written else 'none'}"
                 f"{f' (smoothing window {window})' if written else ''}")
    if skipped:
        lines.append("plots skipped:")
        lines += [f"  {name}: {why}" for name, why in skipped.items()]
    if data.notes:
        lines.append("notes:")
        lines += [f"  - {note}" for note in data.notes]
    return "\n".join(lines) + "\n"
