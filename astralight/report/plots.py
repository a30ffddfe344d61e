"""The report's PNG plots, one function each: ``plot_x(data, path, window) -> None | reason``.

A function draws its figure to ``path`` and returns None, or draws nothing and returns why (the
data it needs is not in the run folder): a missing source skips a plot, it never fails the report.
matplotlib (a dependency) is imported lazily through :func:`require_matplotlib`, so a command
that draws nothing never pays for it, and drawn through ``matplotlib.figure.Figure`` directly, so no pyplot
state or GUI backend is involved.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from astralight.report.rundata import RunData, max_staleness

#: TensorBoard tags each plot reads (written by astralight.policy and callbacks/weight_publisher.py)
REWARD_TAG = "train/reward_mean"
STALENESS_TAGS = ("train/staleness_mean", "train/staleness_max")
PUBLISH_SPARSITY = "publish/sparsity"
PUBLISH_BYTES = ("publish/bytes", "publish/delta_bytes", "publish/full_bytes")
PUBLISH_VERSION = "publish/published_version"
PUBLISH_KIND = "publish/kind"  # 1 = full, 0 = delta
#: where TensorBoard logs are looked for (rundata.tensorboard_loggers); the summary's sources
_LOOKED = "see `sources` in summary.txt; --tensorboard DIR adds a folder"


class MatplotlibMissing(RuntimeError):
    """matplotlib is not installed; the message says how to install it."""


def require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise MatplotlibMissing(
            "astralight report draws its plots with matplotlib, which is not installed: "
            "pip install matplotlib (a dependency of astralight: the install is broken)") from None


def _figure(nrows: int = 1, height: float = 4.0):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9.5, height * nrows if nrows > 1 else height), dpi=100,
                 layout="constrained")
    axes = fig.subplots(nrows, 1, sharex=True, squeeze=False)[:, 0]
    return fig, list(axes)


def _legend(ax) -> None:
    """Outside the axes, on the right: curves are never hidden under it."""
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)


def _integer_x(ax) -> None:
    """Versions and steps are whole numbers: no 2.5 ticks on short runs."""
    ax.xaxis.get_major_locator().set_params(integer=True)


def _save(fig, path: Path, title: str, caption: str | None = None) -> None:
    """Title on top; ``caption`` (what the figure's terms mean, what to read in it) below."""
    fig.suptitle(title)
    if caption:
        import textwrap

        fig.supxlabel("\n".join(textwrap.wrap(caption, 130)), fontsize="small", ha="center",
                      color="0.3")
    fig.savefig(path, format="png")


def later_generated(data: RunData, model_id: str, version: int, row: dict) -> int | None:
    """How much of eval ``version`` came from weights after it: the number of eval prompts with
    tokens of a later version (the DB's per-prompt reports), -1 when only the eval's overall
    ``max_version`` says so (summary.json), 0 or None (not known) otherwise."""
    later = (data.eval_later.get(model_id) or {}).get(version)
    if later is not None:
        return later
    top = row.get("max_version")
    if top is None:
        return None
    return -1 if int(top) > version else 0


def _colors():
    from matplotlib import colormaps

    cmap = colormaps["tab10"]
    return [cmap(i % 10) for i in range(10)]


def rolling_ratio(num: list[float], den: list[float], window: int) -> list[float | None]:
    """``sum(num[i-w+1..i]) / sum(den[i-w+1..i])`` at each i (None where the window's den is 0)."""
    out: list[float | None] = []
    for i in range(len(num)):
        lo = max(0, i - window + 1)
        d = sum(den[lo:i + 1])
        out.append(sum(num[lo:i + 1]) / d if d > 0 else None)
    return out


def rolling_mean(values: list[float], window: int) -> list[float]:
    out = []
    for i in range(len(values)):
        chunk = values[max(0, i - window + 1):i + 1]
        out.append(sum(chunk) / len(chunk))
    return out


# --------------------------------------------------------------------------- eval accuracy

def plot_eval_accuracy(data: RunData, path: Path, window: int) -> str | None:
    """avg@k per eval version of every policy; team accuracy (dashed), each benchmark's avg@k
    (dotted) and their unweighted average (dash-dot) when the eval has them."""
    if not data.evals:
        return ("no complete evaluation: the dataflow DB has no complete eval run and "
                "summary.json no `eval` table (is `dataflow.eval.source` set?)")
    from astralight.report.text import policies, team_table

    fig, (ax,) = _figure(height=4.8)
    colors = _colors()
    ks = set()
    flagged = 0
    team_of = team_table(data, policies(data))
    for i, (model_id, table) in enumerate(sorted(data.evals.items())):
        color = colors[i % len(colors)]
        versions = sorted(table)
        ks.update(table[v].get("k") for v in versions if table[v].get("k"))
        ax.plot(versions, [100 * table[v]["avg_at_k"] for v in versions], "o-", color=color,
                label=f"{model_id} avg@k")
        mixed = [v for v in versions if (later_generated(data, model_id, v, table[v]) or 0)]
        if mixed:
            ax.plot(mixed, [100 * table[v]["avg_at_k"] for v in mixed], "o", markersize=11,
                    markerfacecolor="none", markeredgecolor="red", markeredgewidth=1.5,
                    label=f"{model_id}: partly generated by a later version")
            flagged += len(mixed)
        if team_of is not None and team_of[0] == model_id:  # the team's figure, drawn once
            team = team_of[1]
            ax.plot(list(team), [100 * a for a in team.values()], "s--", color="0.3",
                    label="team accuracy")
        avg = [v for v in versions if table[v].get("benchmark_average") is not None]
        if avg:
            ax.plot(avg, [100 * table[v]["benchmark_average"] for v in avg], "D-.", color=color,
                    label=f"{model_id} benchmark average")
        names = sorted({b for v in versions for b in (table[v].get("benchmarks") or {})})
        for j, name in enumerate(names):
            pts = [(v, table[v]["benchmarks"][name]["avg_at_k"]) for v in versions
                   if name in (table[v].get("benchmarks") or {})
                   and table[v]["benchmarks"][name].get("n_reported", 1)]
            if pts:
                ax.plot([p[0] for p in pts], [100 * p[1] for p in pts], ":", marker=".",
                        color=color, alpha=0.5 + 0.5 * (j % 2), label=f"{model_id} {name}")
    k = str(next(iter(ks))) if len(ks) == 1 else "k"
    ax.set_xlabel("policy version")
    _integer_x(ax)
    ax.set_ylabel(f"accuracy (%, avg@{k})")
    ax.set_ylim(0, 100)
    ax.grid(alpha=0.3)
    _legend(ax)
    caption = ("An eval is labelled by the version it was scheduled at (when that version was "
               "published); the rollout services load newer weights while it runs, so some of "
               "its tokens may come from later versions")
    caption += (f": circled red, {flagged} eval(s); see summary.txt for how many prompts."
                if flagged else " (none here).")
    _save(fig, path, f"Held-out eval accuracy (avg@{k})", caption)
    return None


# --------------------------------------------------------------------------- TensorBoard series

def _series_plot(data: RunData, path: Path, tags: tuple[str, ...], title: str, ylabel: str,
                 window: int, smooth: bool, missing: str, caption: str | None = None
                 ) -> str | None:
    found = {name: {t: tb[t] for t in tags if tb.get(t)} for name, tb in data.scalars.items()}
    found = {name: series for name, series in found.items() if series}
    if not found:
        return missing
    fig, (ax,) = _figure()
    colors = _colors()
    styles = ["-", "--", ":"]
    for i, (name, series) in enumerate(sorted(found.items())):
        color = colors[i % len(colors)]
        for j, tag in enumerate(tags):
            if tag not in series:
                continue
            steps = [s for s, _ in series[tag]]
            values = [v for _, v in series[tag]]
            label = f"{name} {tag.split('/')[-1]}"
            if smooth and len(values) > 1:
                ax.plot(steps, values, styles[j % 3], color=color, alpha=0.3, linewidth=1)
                ax.plot(steps, rolling_mean(values, window), styles[j % 3], color=color,
                        label=f"{label} ({window}-step mean)")
            else:
                ax.plot(steps, values, styles[j % 3], color=color, label=label,
                        marker="." if len(values) < 60 else None)
    ax.set_xlabel("training step")
    _integer_x(ax)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    _legend(ax)
    _save(fig, path, title, caption)
    return None


def plot_reward(data: RunData, path: Path, window: int) -> str | None:
    """Mean reward of each trained batch (``train/reward_mean``) per step, raw and smoothed."""
    return _series_plot(data, path, (REWARD_TAG,), "Mean reward per training step", "reward",
                        window, smooth=True,
                        missing=f"no TensorBoard scalar {REWARD_TAG!r} in the TensorBoard logs found "
                                f"({_LOOKED})")


#: staleness values drawn as their own band; larger ones share the last band
STALENESS_BANDS = 4


def staleness_shares(table: dict[tuple[int, int], int], window: int
                     ) -> tuple[list[int], list[str], list[list[float]], list[int]]:
    """Per window of ``window`` reference versions: the share of trained samples at each
    staleness. Returns ``(window starts, band labels, shares[band][window], samples per
    window)``; bands are ``0 .. STALENESS_BANDS-2`` and ``>= STALENESS_BANDS-1``, with ``< 0``
    first when some sample is newer than its reference (a trainer resumed behind the dataflow)."""
    top = STALENESS_BANDS - 1
    negative = any(st < 0 for _, st in table)
    labels = (["< 0"] if negative else []) + [str(i) for i in range(top)] + [f">= {top}"]

    def band(st: int) -> int:
        return (0 if st < 0 else min(st, top) + int(negative))

    starts = sorted({(ref // window) * window for ref, _ in table})
    counts = {w: [0] * len(labels) for w in starts}
    for (ref, st), n in table.items():
        counts[(ref // window) * window][band(st)] += n
    totals = [sum(counts[w]) for w in starts]
    shares = [[counts[w][b] / t if t else 0.0 for w, t in zip(starts, totals)]
              for b in range(len(labels))]
    return starts, labels, shares, totals


def _band_low(label: str) -> float:
    """The smallest staleness of a band label (``"2"``, ``">= 4"``, ``"< 0"``)."""
    if label.startswith("<"):
        return float("-inf")
    return float(label.lstrip(">= "))


def mean_staleness(table: dict[tuple[int, int], int]) -> float:
    n = sum(table.values())
    return sum(st * c for (_, st), c in table.items()) / n if n else 0.0


def plot_staleness(data: RunData, path: Path, window: int) -> str | None:
    """How stale trained samples were: per window of ``window`` versions, the share of samples
    at each staleness (stacked, from the dataflow DB: every trained sample), which a per-batch
    mean and max cannot show (with staleness 0 or 1 they overlap as a comb). Without the DB,
    ``train/staleness_mean`` / ``_max`` from TensorBoard, smoothed over ``window`` steps."""
    found = {m: t for m, t in data.staleness.items() if t}
    if not found:
        return _series_plot(
            data, path, STALENESS_TAGS, "Staleness of trained samples (per batch, smoothed)",
            "policy versions behind", window, smooth=True,
            missing=(f"no TensorBoard scalars {' / '.join(STALENESS_TAGS)} in the TensorBoard "
                     f"logs found ({_LOOKED}), and no trained samples in the dataflow DB"),
            caption=("No trained samples from the dataflow DB (pass --db PATH when it is "
                     "elsewhere), so per-batch figures: staleness = the trainer's version minus "
                     "the oldest version behind a sample's loss tokens, averaged / maximised "
                     "over the batch, smoothed."))
    from matplotlib import colormaps

    bound = max_staleness(data.run_dir)
    fig, axes = _figure(nrows=len(found), height=3.6)
    cmap = colormaps["viridis"]
    for ax, (model_id, table) in zip(axes, sorted(found.items())):
        starts, labels, shares, totals = staleness_shares(table, window)
        bottom = [0.0] * len(starts)
        colors = [cmap(0.15 + 0.7 * i / max(1, len(labels) - 1)) for i in range(len(labels))]
        if labels[0] == "< 0":
            colors[0] = "0.6"
        for label, share, color in zip(labels, shares, colors):
            over = bound is not None and _band_low(label) > bound
            ax.bar(starts, share, width=window * 0.9, bottom=bottom, align="edge",
                   color=color, hatch="//" if over else None, edgecolor="white" if over else None,
                   label=f"staleness {label}" + (" (above max_staleness)" if over else ""))
            bottom = [b + x for b, x in zip(bottom, share)]
        ref = ("trainer version" if data.staleness_reference.get(model_id) == "trainer"
               else "dataflow version at serving")
        ax.set_title(f"{model_id}: {sum(totals)} trained samples, mean staleness "
                     f"{mean_staleness(table):.2f}"
                     + (f"; dataflow bound max_staleness {bound}" if bound is not None else ""),
                     fontsize="medium")
        ax.set_ylabel("share of samples")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3, axis="y")
        ax.set_xlabel(f"{ref} ({window}-version windows)")
        _integer_x(ax)
        handles, names = ax.get_legend_handles_labels()  # top band first, as stacked
        ax.legend(handles[::-1], names[::-1], fontsize="small", loc="upper left",
                  bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    reference = {data.staleness_reference.get(m) for m in found}
    caption = ("Staleness of a trained sample = the version of the weights its optimizer step "
               "was applied to (the trainer's own version, as train/staleness_* measures) minus "
               "the oldest policy version behind its loss-masked tokens; replayed samples count "
               "each time they are trained.")
    if "dataflow" in reference:
        caption += (" Where the trainer config or the acked steps are missing, the reference is "
                    "the dataflow's version when it served the batch, up to one version lower.")
    if bound is not None:
        caption += (f" Hatched: above the dataflow's bound (max_staleness {bound}), which it "
                    "applies against its own version when it serves a batch; the trainer's "
                    "version runs ahead of it by the batches in flight.")
    _save(fig, path, "Staleness of trained samples (share per staleness)", caption)
    return None


# --------------------------------------------------------------------------- wait fraction

def wait_series(counters: dict[int, dict[str, int]]) -> tuple[list[int], list[float], list[float]]:
    """Versions with timed trainer steps, and their ``trainer_wait_ms`` / ``trainer_step_ms``."""
    versions = sorted(v for v, c in counters.items() if c.get("trainer_step_ms", 0) > 0)
    return (versions, [float(counters[v].get("trainer_wait_ms", 0)) for v in versions],
            [float(counters[v]["trainer_step_ms"]) for v in versions])


def plot_wait_fraction(data: RunData, path: Path, window: int) -> str | None:
    """Fraction of the trainer's step time spent waiting for a batch, per version: the raw
    per-version ratio and ``sum(wait) / sum(step)`` over the last ``window`` versions."""
    series = {m: wait_series(c) for m, c in data.per_version.items()}
    series = {m: s for m, s in series.items() if s[0]}
    if not series:
        return ("no per-version counters trainer_wait_ms / trainer_step_ms (dataflow DB table "
                "version_counters, or summary.json `per_version`)")
    fig, (ax,) = _figure()
    colors = _colors()
    for i, (model_id, (versions, wait, step)) in enumerate(sorted(series.items())):
        color = colors[i % len(colors)]
        ax.plot(versions, [w / s for w, s in zip(wait, step)], ".", color=color, alpha=0.4)
        smooth = rolling_ratio(wait, step, window)
        ax.plot(versions, smooth, "-", color=color, label=f"{model_id} ({window}-version window)")
        mean = sum(wait) / sum(step)
        ax.axhline(mean, color=color, linestyle=":", alpha=0.7,
                   label=f"{model_id} mean {100 * mean:.1f}%")
        evals = [v for v in data.eval_versions.get(model_id, [])
                 if versions[0] <= v <= versions[-1]]
        for j, v in enumerate(evals):
            ax.axvline(v, color=color, linestyle="--", linewidth=0.8, alpha=0.35,
                       label=f"{model_id} eval scheduled" if j == 0 else None)
    ax.set_xlabel("policy version")
    _integer_x(ax)
    ax.set_ylabel("trainer wait fraction")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    _legend(ax)
    caption = ("Dashed lines: versions a held-out eval was scheduled for (every eval.every "
               "versions). Eval tasks are leased before train tasks, so while the rollout "
               "services run an eval no train samples come and the trainer waits: the sawtooth. "
               "summary.txt compares the wait at eval versions with the others.")
    _save(fig, path, "Trainer wait fraction (time waiting for data / step time)", caption)
    return None


# --------------------------------------------------------------------------- weights

def publish_series(tb: dict[str, list[tuple[int, float]]], tag: str) -> list[tuple[int, float]]:
    """``(published version, value)`` of a publisher scalar; the version is
    ``publish/published_version`` logged at the same step (the step itself when absent)."""
    version_at = {s: int(v) for s, v in tb.get(PUBLISH_VERSION, [])}
    return [(version_at.get(s, s), v) for s, v in tb.get(tag, [])]


def plot_weights(data: RunData, path: Path, window: int) -> str | None:
    """Per published version: the delta's sparsity (fraction of bf16 elements unchanged) and the
    bytes uploaded, delta bytes and the full-sync bytes for reference; full versions marked."""
    found = {n: tb for n, tb in data.scalars.items()
             if tb.get(PUBLISH_SPARSITY) or any(tb.get(t) for t in PUBLISH_BYTES)}
    if not found:
        return (f"no publisher scalars ({PUBLISH_SPARSITY}, {', '.join(PUBLISH_BYTES)}) in the "
                f"TensorBoard logs found ({_LOOKED}): was the WeightPublisher callback on?")
    fig, (ax_sp, ax_b) = _figure(nrows=2, height=3.2)
    colors = _colors()
    mib = 1024.0 * 1024.0
    for i, (name, tb) in enumerate(sorted(found.items())):
        color = colors[i % len(colors)]
        sp = publish_series(tb, PUBLISH_SPARSITY)
        if sp:
            ax_sp.plot([v for v, _ in sp], [x for _, x in sp], ".-", color=color, label=name)
        for tag, style in zip(PUBLISH_BYTES, ("-", "o", "--")):
            pts = publish_series(tb, tag)
            if pts:
                ax_b.plot([v for v, _ in pts], [x / mib for _, x in pts], style, color=color,
                          markersize=3, alpha=0.8 if style != "--" else 0.5,
                          label=f"{name} {tag.split('/')[-1]}")
        full = {v for v, k in publish_series(tb, PUBLISH_KIND) if k >= 0.5}
        uploaded = [(v, x) for v, x in publish_series(tb, PUBLISH_BYTES[0]) if v in full]
        if uploaded:
            ax_b.plot([v for v, _ in uploaded], [x / mib for _, x in uploaded], "x", color=color,
                      markersize=8, label=f"{name} full sync")
    ax_sp.set_ylabel("delta sparsity\n(share unchanged)")
    ax_sp.set_ylim(0, 1)
    ax_sp.grid(alpha=0.3)
    if ax_sp.lines:
        _legend(ax_sp)
    ax_b.set_ylabel("MiB")
    ax_b.set_xlabel("published version")
    _integer_x(ax_b)
    ax_b.set_ylim(bottom=0)
    ax_b.grid(alpha=0.3)
    _legend(ax_b)
    caption = ("Delta sparsity = the share of the policy's bf16 weight elements whose bits are "
               "unchanged since the previously published version (1 - changed / all elements). "
               "A delta version uploads only the changed elements (indices and new values, "
               "zstd-compressed): the higher the sparsity, the smaller delta_bytes against "
               "full_bytes (a full snapshot). x: full syncs (every full_every versions and for "
               "a newcomer).")
    _save(fig, path, "Published weights: delta sparsity and bytes", caption)
    return None


# --------------------------------------------------------------------------- pool

def fixed_pool(rows: list[dict], data: RunData) -> bool:
    """Whether the live instance count stayed the same from the first registration to the
    run's last publication (the instances leaving when the run stops do not count)."""
    last = max((t for times in data.version_times.values() for t in times.values()),
               default=None)
    steps = [n for t, n in pool_timeline(rows, 0.0)[:-1] if last is None or t <= last]
    return len(set(steps)) <= 1


def pool_timeline(instances: list[dict], end: float) -> list[tuple[float, int]]:
    """``(time, live instances)`` steps from the instance table's registered_at / left_at."""
    events: list[tuple[float, int]] = []
    for row in instances:
        if row.get("registered_at") is None:
            continue
        events.append((float(row["registered_at"]), 1))
        if row.get("left_at") is not None:
            events.append((float(row["left_at"]), -1))
    events.sort()
    out, live = [], 0
    for t, d in events:
        live += d
        out.append((t, live))
    if out:
        out.append((max(end, out[-1][0]), live))
    return out


def plot_pool(data: RunData, path: Path, window: int) -> str | None:
    """Live rollout instances over wall time (the dataflow's instance table) and, with an
    autoscaler, its decisions' target pool size."""
    rows = [r for r in data.instances if r.get("registered_at") is not None]
    decisions = [d for d in data.pool_decisions if d.get("target") is not None]
    if not rows and not decisions:
        return ("no RaaS instance in the dataflow DB's instance table and no autoscaler "
                "decisions log (autoscale.jsonl)")
    if not decisions and fixed_pool(rows, data):
        return (f"a fixed pool of {len(rows)} instance(s) that never changed while the run "
                "trained (no autoscaler): nothing to draw")
    times = [float(r["registered_at"]) for r in rows] + [float(d["time"]) for d in decisions]
    ends = [float(x) for r in rows for x in (r.get("left_at"), r.get("last_seen")) if x is not None]
    ends += [t for times_ in data.version_times.values() for t in times_.values()]
    t0 = data.started_at if data.started_at is not None else min(times)
    t0 = min(t0, min(times))
    end = max(ends + times)
    fig, (ax,) = _figure()
    timeline = pool_timeline(rows, end)
    if timeline:
        ax.step([t - t0 for t, _ in timeline], [n for _, n in timeline], where="post",
                label="live instances (dataflow)")
    if decisions:
        ax.step([float(d["time"]) - t0 for d in decisions] + [end - t0],
                [d["target"] for d in decisions] + [decisions[-1]["target"]], where="post",
                linestyle="--", label="autoscaler target")
        for d in decisions:
            if d.get("action") not in (None, "hold"):
                ax.annotate(str(d["action"]), (float(d["time"]) - t0, d["target"]),
                            fontsize="x-small", rotation=30)
    ax.set_xlim(left=0)
    ax.set_xlabel("seconds since the run started")
    ax.set_ylabel("rollout instances")
    ax.set_ylim(bottom=0)
    ax.yaxis.get_major_locator().set_params(integer=True)
    ax.grid(alpha=0.3)
    _legend(ax)
    _save(fig, path, "Rollout pool size")
    return None


# --------------------------------------------------------------------------- over wall time

ENTROPY_TAG = "train/entropy"
TOOL_CALL_TAG = "agent/tool_call_rate"


def version_seconds(data: RunData, model_id: str) -> dict[int, float]:
    """Seconds from the run's start to each published version of ``model_id`` (version 0 at 0)."""
    times = data.version_times.get(model_id) or {}
    if not times:
        return {}
    t0 = data.started_at if data.started_at is not None else min(times.values())
    return {0: 0.0, **{int(v): float(t) - t0 for v, t in times.items()}}


def throughput_series(data: RunData, model_id: str, window: int) -> tuple[list[float],
                                                                           list[float]]:
    """Samples trained per second over wall time: per window of ``window`` versions, the
    samples trained for those versions (the dataflow's ``samples_trained`` per version) over the
    seconds between their publications. ``(seconds at each window's end, samples/s)``."""
    secs = version_seconds(data, model_id)
    per = data.per_version.get(model_id) or {}
    versions = sorted(v for v in secs if v > 0)
    xs, ys = [], []
    for i in range(0, len(versions), max(1, window)):
        chunk = versions[i:i + max(1, window)]
        start = secs.get(chunk[0] - 1, secs.get(0, 0.0))
        span = secs[chunk[-1]] - start
        trained = sum(int((per.get(v - 1) or {}).get("samples_trained", 0)) for v in chunk)
        if span > 0:
            xs.append(secs[chunk[-1]])
            ys.append(trained / span)
    return xs, ys


def plot_wall_time(data: RunData, path: Path, window: int) -> str | None:
    """Eval accuracy against seconds since the start (the version's publication time), and the
    samples trained per second, per policy: what a run bought per unit of wall time."""
    evals = {m: t for m, t in data.evals.items() if version_seconds(data, m)}
    rates = {m: throughput_series(data, m, window) for m in data.version_times}
    rates = {m: r for m, r in rates.items() if r[0]}
    if not evals and not rates:
        return ("no publication times in the dataflow DB (its versions table), so nothing to "
                "put on a wall-time axis")
    fig, (ax_acc, ax_rate) = _figure(nrows=2, height=3.4)
    colors = _colors()
    for i, m in enumerate(sorted(set(evals) | set(rates))):
        color = colors[i % len(colors)]
        if m in evals:
            secs = version_seconds(data, m)
            vs = [v for v in sorted(evals[m]) if v in secs]
            ax_acc.plot([secs[v] for v in vs], [100 * evals[m][v]["avg_at_k"] for v in vs],
                        "o-", color=color, label=f"{m} avg@k")
        if m in rates:
            ax_rate.plot(*rates[m], ".-", color=color, label=f"{m} samples trained / s")
    ax_acc.set_ylabel("eval accuracy (%)")
    ax_rate.set_ylabel("samples trained / s")
    for ax in (ax_acc, ax_rate):
        ax.set_xlabel("seconds since the run started (a version's publication)")
        ax.set_xlim(left=0)
        ax.grid(alpha=0.3)
        _legend(ax)
    _save(fig, path, "Accuracy and throughput over wall time",
          f"Throughput per window of {window} versions: the samples trained for them over the "
          "seconds between their publications.")
    return None


def plot_entropy(data: RunData, path: Path, window: int) -> str | None:
    """The policy's mean token entropy on the trained tokens per step (``train/entropy``): a
    fall to near 0 is a collapse (the run guard's ``entropy_floor`` watches it too)."""
    return _series_plot(data, path, (ENTROPY_TAG,), "Policy entropy per training step",
                        "mean token entropy (nats)", window, smooth=True,
                        missing=f"no TensorBoard scalar {ENTROPY_TAG!r} in the TensorBoard logs "
                                f"found ({_LOOKED})")


def plot_tool_calls(data: RunData, path: Path, window: int) -> str | None:
    """The share of trained episodes that called a tool, per step (tool workflows only)."""
    return _series_plot(data, path, (TOOL_CALL_TAG,), "Tool-call rate per training step",
                        "share of episodes with a tool call", window, smooth=True,
                        missing=f"no TensorBoard scalar {TOOL_CALL_TAG!r} (not a tool workflow)")


#: every plot, in report order: (file name, function)
PLOTS: list[tuple[str, Callable[[RunData, Path, int], str | None]]] = [
    ("eval_accuracy.png", plot_eval_accuracy),
    ("wall_time.png", plot_wall_time),
    ("reward.png", plot_reward),
    ("entropy.png", plot_entropy),
    ("tool_calls.png", plot_tool_calls),
    ("wait_fraction.png", plot_wait_fraction),
    ("staleness.png", plot_staleness),
    ("weights.png", plot_weights),
    ("pool.png", plot_pool),
]
