"""``astralight run`` on the data-algorithm recipe ``configs/toy/algorithms/ds_replay_greso.yaml``,
shortened: every configured data algorithm must act in a real run, and nothing may be lost.

The recipe stacks the three algorithms (zero-advantage filter, half-replayed batches, GRESO
curator), so running it covers ``dynamic_sampling.yaml`` and ``ds_replay.yaml`` too;
``tests/unit/test_algorithm_recipes.py`` only parses them. Real processes on 127.0.0.1 (dataflow
service, vLLM RaaS on CPU, Lightning M2PO trainer), real SQLite.

The derived recipe ``extends:`` the real one and changes only the run's length and cost:
``stop.versions`` (with ``trainer.max_steps`` equal to it, since ``WeightPublisher.every_n_steps``
is 1: one version per step; the trainers list is restated whole because recipe lists replace
rather than merge), ``dataflow.eval.every`` (the launcher requires ``stop.versions`` to be a
multiple of it) and ``prepare.kwargs.num_threads: 1``. The warm start itself (1500 steps) is
kept: it sets the policy's solve rate, hence how many groups are zero-variance, which is exactly
what the filter and GRESO act on (measured at temperature 1: 200 steps leave 88% of groups
all-wrong, 1500 steps ~14%; with nearly every group filtered, hardly a batch would form). One
torch thread: on a loaded two-core machine the default two OpenMP threads spin-wait for each
other (measured: 1500 steps took 380 s with two threads at load 4, 42 s with one).

40 versions rather than 6-8: GRESO can only skip a prompt it has already seen give a
zero-variance group, the train stream draws operand pairs at random from ~2,250 and only ~4-9% of
this policy's groups are zero-variance, and GRESO raises p_hard / p_easy by delta_p every version
whose zero-variance share is under target (so it skips less and less). Measured: 8 versions drew
~500 prompts and skipped 2, 16 versions ~920 and 2 (0 skips is a few-percent event there);
40 versions drew ~2,500 and skipped 12 (under extra CPU load ~1,840 and 7). Versions are cheap here (~0.4 s each); the warm start
(~45 s) and the vLLM start-up (~15 s) dominate the ~80 s run (~190 s under load).

Slow (~1.5 min on two idle CPU cores, more under load): marked ``slow``, run by ``.ci/run``
after the default suite.
"""

from __future__ import annotations

import copy
import json
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from astralight.dataflow.audit import audit
from astralight.launch.recipe import load_recipe

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

RECIPE = (Path(__file__).resolve().parents[2] / "configs" / "toy" / "algorithms"
          / "ds_replay_greso.yaml")
VERSIONS = 40


def short_recipe(tmp_path: Path) -> tuple[Path, dict]:
    """A recipe that extends ds_replay_greso.yaml and runs VERSIONS versions; returns its path
    and the parent recipe (resolved)."""
    parent = load_recipe(RECIPE)
    trainers = copy.deepcopy(parent["trainers"])
    trainers[0]["trainer"]["max_steps"] = VERSIONS
    prepare_kwargs = {**parent["prepare"]["kwargs"], "num_threads": 1}
    child = {
        "extends": str(RECIPE),
        "name": "toy-ds-replay-greso-short",
        # generous: other CPU-heavy tests may share the machine; the run stops at VERSIONS anyway
        "stop": {"versions": VERSIONS, "timeout_s": 1500, "final_eval_timeout_s": 300},
        "dataflow": {"eval": {"every": VERSIONS}},
        "prepare": {"kwargs": prepare_kwargs},
        "trainers": trainers,
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(child, sort_keys=False))
    return path, parent


def test_ds_replay_greso_recipe_runs_and_every_algorithm_acts(tmp_path):
    path, parent = short_recipe(tmp_path)
    recipe = load_recipe(path)
    # the derived recipe is the real one but for the run's length
    changed = ("name", "stop", "trainers", "balance", "prepare")
    same = {k: v for k, v in recipe.items() if k not in changed}
    assert same["dataflow"].pop("eval") == {**parent["dataflow"]["eval"], "every": VERSIONS}
    assert recipe["prepare"]["kwargs"] == {**parent["prepare"]["kwargs"], "num_threads": 1}
    assert recipe["prepare"]["kwargs"]["sft_steps"] == parent["prepare"]["kwargs"]["sft_steps"]
    parent_rest = {k: v for k, v in parent.items() if k not in changed}
    parent_rest["dataflow"] = {k: v for k, v in parent["dataflow"].items() if k != "eval"}
    assert same == parent_rest
    assert recipe["trainers"][0]["trainer"]["max_steps"] == VERSIONS
    callbacks = recipe["trainers"][0]["trainer"]["callbacks"]
    every_n = [cb["init_args"]["every_n_steps"] for cb in callbacks
               if cb["class_path"].endswith("WeightPublisher")]
    assert every_n == [1]  # one version per trainer step: max_steps == stop.versions

    run_dir = tmp_path / "run"
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "astralight.cli", "run", str(path),
                           "--run-dir", str(run_dir)],
                          capture_output=True, text=True, timeout=1800)
    wall = time.time() - t0
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    print(proc.stdout[-3000:])
    print(f"run wall time {wall:.0f}s")
    summary = json.loads((run_dir / "summary.json").read_text())  # the full record
    c = summary["counters"]
    print(json.dumps({k: c.get(k) for k in (
        "rollouts_generated", "prompts_submitted", "prompts_skipped", "prompts_forced",
        "groups_filtered", "samples_filtered", "samples_accepted", "replay_added",
        "replay_served", "replay_stale_dropped", "samples_trained", "stale_dropped")}))
    print(json.dumps(summary["plugins"]))

    # the run completed its versions, every one trained on one full batch (fresh + replayed)
    batch = recipe["trainers"][0]["data"]["init_args"]["batch_size"]
    group = recipe["dataflow"]["group_size"]
    assert summary["versions"] == VERSIONS
    assert summary["samples_trained"] == VERSIONS * batch
    assert summary["eval_versions"] == [0, VERSIONS]

    # dynamic sampling: zero-advantage groups were dropped whole
    assert c["groups_filtered"] > 0, c
    assert c["samples_filtered"] == c["groups_filtered"] * group, c
    # replay: batches held replayed samples (their share of the acked batches is checked below)
    ratio = recipe["dataflow"]["replay"]["ratio"]
    assert c["replay_served"] > 0, c
    assert c["samples_served"] + c["replay_served"] >= VERSIONS * batch, c
    # the rollout cost covers what was accepted and what was filtered
    assert summary["rollouts_generated"] == c["rollouts_generated"]
    assert c["rollouts_generated"] >= c["samples_accepted"] + c["samples_filtered"], c

    # the durable state, read after every component stopped (the summary's counters were read
    # while the RaaS still pushed, so the final ones may be larger): audit it, nothing lost,
    # nothing trained twice, the row ledger and the counters agree
    db = run_dir / "dataflow" / "dataflow.db"
    report = audit(db)
    assert report["balanced"], report
    assert report["mismatches"] == [] and report["samples_lost"] == 0, report
    assert report["tasks"]["lost"] == 0 and report["duplicates_trained"] == 0, report
    assert report["samples_trained"] + report["replays_trained"] == VERSIONS * batch, report
    assert 0 < report["replays_trained"] <= int(batch * ratio) * VERSIONS, report
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        final = dict(conn.execute("SELECT name, value FROM counters WHERE model_id='policy'"))
        per_version: dict[int, dict] = {}
        for version, name, value in conn.execute(
                "SELECT version, name, value FROM version_counters WHERE model_id='policy'"):
            per_version.setdefault(version, {})[name] = value
        cursor = int(json.loads(conn.execute(
            "SELECT value FROM meta WHERE key='source_cursor'").fetchone()[0]))
        saved = {name: (cls, json.loads(state)) for name, cls, state in conn.execute(
            "SELECT name, class_path, state FROM plugin_state")}
    finally:
        conn.close()
    assert report["samples_filtered"] == final["samples_filtered"] >= c["samples_filtered"]
    assert final["samples_filtered"] == final["groups_filtered"] * group, final
    # the per-version ledger adds up to the totals, and each balance report (every 10 versions,
    # over completed versions only, whose counts are final) counts exactly the filtered samples
    for name in ("groups_filtered", "samples_filtered", "replay_served", "prompts_skipped"):
        assert sum(v.get(name, 0) for v in per_version.values()) == final.get(name, 0), name
    lines = (run_dir / "balance.jsonl").read_text().splitlines()
    # (the final window ends at the last version, still open when it was read: not final counts)
    reports = [r for r in map(json.loads, lines) if not r["final"]]
    assert reports, lines
    for r in reports:
        first, last = r["versions"]
        assert r["filtered"] == sum(per_version.get(v, {}).get("samples_filtered", 0)
                                    for v in range(first, last + 1)), (r, per_version)

    # GRESO: every prompt the source yielded was either submitted or skipped by the curator
    assert cursor == final["prompts_submitted"] + final.get("prompts_skipped", 0), (cursor, final)
    assert final.get("prompts_forced", 0) == 0, final  # the safety valve never had to step in
    cls, state = saved["curators[0]"]
    assert cls.endswith("GRESO"), saved
    metrics = summary["plugins"]["curators[0]"]["metrics"]
    # it learned: streaks of zero-variance prompts were tracked, and p_easy / p_hard moved off
    # their initial 0.5 by delta_p per version (Algorithm 1), persisted at shutdown
    assert metrics["tracked_prompts"] > 0, metrics
    assert state["plugin"]["streaks"], state
    greso = recipe["dataflow"]["curators"][0]["init_args"]
    moved = [abs(state["plugin"][k] - greso[k]) for k in ("p_easy", "p_hard")]
    assert max(moved) >= greso["delta_p"] - 1e-9, state["plugin"]
    # ... and it acted: prompts predicted zero-variance were skipped before rollout (reliably
    # reachable in 40 versions, not in 8: see the module docstring)
    assert final.get("prompts_skipped", 0) > 0, final
