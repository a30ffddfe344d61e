"""``astralight report`` on hand-made run folders: every plot, the summary's numbers, the skips.

The run folder is built from the same writers a real run uses: the dataflow's Store (SQLite),
a TensorBoard SummaryWriter with the trainer's and publisher's tag names, and the launcher's
summary.json / balance.txt layout.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from astralight.dataflow.store import Store
from astralight.report import main, make_report
from astralight.report.plots import (MatplotlibMissing, pool_timeline, require_matplotlib,
                                     rolling_ratio)
from astralight.report.rundata import RunFolderError, load_run
from tests.unit.run_folders import (ROLLOUTS, STEP_MS, T0, TRAINED, WAIT_MS, _balance, assert_png,
                                    write_summary)

PLOTS = ("eval_accuracy.png", "wall_time.png", "reward.png", "entropy.png", "tool_calls.png",
         "wait_fraction.png", "staleness.png", "weights.png", "pool.png")


def write_db(run_dir: Path, benchmarks: bool = False) -> None:
    """Two evals of 4 prompts x 2 samples (v0: 2 of 8 right = 25%; v4: 6 of 8 = 75%, the "aime"
    prompts 100%, "math500" 50%), per-version counters, 5 versions, one instance that
    registered at T0+1, a second at T0+3 that left at T0+6."""
    store = Store(run_dir / "dataflow" / "dataflow.db")
    with store.tx():
        store.set_meta("started_at", T0)
        for v in (0, 4):
            store.insert_eval_run("policy", v, 4, 2, T0 + v)
        # v0, per prompt: (correct, reward sum) of its 2 samples
        for i, (c, s) in enumerate([(0, 0.0), (1, 1.0), (0, 0.0), (1, 1.0)]):
            store.insert_eval_report("policy", 0, i, f"e0-{i}", 2, c, s, 0, 0, T0 + 1)
        for i in range(4):
            aime = i < 2
            store.insert_eval_report("policy", 4, i, f"e4-{i}", 2, 2 if aime else 1,
                                     2.0 if aime else 1.0, 4, 4, T0 + 9)
        for v in range(5):
            store.bump("policy", "trainer_wait_ms", WAIT_MS[v], version=v)
            store.bump("policy", "trainer_step_ms", STEP_MS[v], version=v)
            store.bump("policy", "rollouts_generated", ROLLOUTS[v], version=v)
            store.bump("policy", "samples_trained", TRAINED[v], version=v)
            if v:
                store.insert_version("policy", v, b"manifest", T0 + 2 * v)
        store.upsert_instance("raas-a", ["policy"], 32, {}, T0 + 1)
        store.upsert_instance("raas-b", ["policy"], 32, {}, T0 + 3)
        store.set_instance_state("raas-b", "left", T0 + 6)
    store.close()
    if benchmarks:
        cfg = run_dir / "configs" / "dataflow.yaml"
        cfg.parent.mkdir(parents=True, exist_ok=True)
        cfg.write_text("eval:\n  source:\n    class_path: tests.unit.run_folders.TwoBenchmarks\n")


def write_tensorboard(run_dir: Path, name: str = "policy", steps: int = 5) -> None:
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(run_dir / "tensorboard" / name / "version_0"))
    for step in range(steps):
        writer.add_scalar("train/reward_mean", 0.2 + 0.1 * step, step)
        writer.add_scalar("train/entropy", 1.0 - 0.1 * step, step)
        writer.add_scalar("agent/tool_call_rate", 0.2 * step, step)
        writer.add_scalar("train/staleness_mean", 0.5 * (step % 2), step)
        writer.add_scalar("train/staleness_max", float(step % 2), step)
        writer.add_scalar("train/mismatch_abs_mean", 0.01 * (step + 1), step)
        writer.add_scalar("train/mismatch_k3", 1e-4, step)
        writer.add_scalar("train/mismatch_ratio_max", 1.5 + step, step)
        writer.add_scalar("train/mismatch_tail_fraction", 0.02, step)
        # the publisher logs version step+1 at the step its snapshot was taken
        writer.add_scalar("publish/published_version", step + 1, step)
        writer.add_scalar("publish/kind", 1.0 if step == 0 else 0.0, step)
        writer.add_scalar("publish/full_bytes", 1000.0, step)
        writer.add_scalar("publish/bytes", 1000.0 if step == 0 else 400.0, step)
        if step:
            writer.add_scalar("publish/sparsity", 0.3 + 0.05 * step, step)
            writer.add_scalar("publish/delta_bytes", 400.0, step)
    writer.close()


def write_balance_txt(run_dir: Path) -> None:
    report = _balance()
    (run_dir / "balance.txt").write_text(
        "versions 0..1: wait fraction 90.0% ...\n" + json.dumps({**report, "versions": [0, 1]})
        + "\nversions 2..3: wait fraction 25.0% ...\n" + json.dumps(report) + "\n")


@pytest.fixture
def full_run(tmp_path) -> Path:
    run_dir = tmp_path / "toy-20250101-120000"
    run_dir.mkdir()
    write_summary(run_dir)
    write_balance_txt(run_dir)
    write_db(run_dir, benchmarks=True)
    write_tensorboard(run_dir)
    (run_dir / "autoscale.jsonl").write_text(
        json.dumps({"time": T0 + 0.5, "version": 0, "action": "initial", "pool": 0, "target": 1})
        + "\n" + json.dumps({"time": T0 + 2.5, "version": 2, "action": "scale_up", "pool": 1,
                             "target": 2}) + "\n")
    return run_dir


def test_full_run_writes_every_plot_and_a_matching_summary(full_run, capsys):
    dataflow_files = sorted(p.name for p in (full_run / "dataflow").iterdir())
    assert main([str(full_run)]) == 0
    out_dir = full_run / "report"
    for name in PLOTS:
        assert_png(out_dir / name)
    text = (out_dir / "summary.txt").read_text()
    assert capsys.readouterr().out.startswith(text)  # printed too
    lines = {line.split(":", 1)[0]: line for line in text.splitlines() if ":" in line}

    assert lines["recipe"] == "recipe: toy"  # from the launcher's folder name
    assert lines["versions"] == "versions: 4"
    assert lines["wall time"].startswith("wall time: 42.5 s (trainers 12.5 s")
    # the DB's eval (every policy, per benchmark), not the summary's 30% -> 70%
    assert "eval policy: v0 25.0% -> v4 75.0% avg@2" in text
    assert "benchmark average 25.0% -> 75.0%" in text  # aime 100%, math500 50% at v4
    assert (f"rollouts generated / samples trained: policy {sum(ROLLOUTS.values())} / "
            f"{sum(TRAINED.values())}") in text
    # the mismatch over 5 steps: mean of 0.01..0.05, the last step alone, the largest ratio
    assert lines["train/inference mismatch (on-policy tokens)"].endswith(
        "policy |logp diff| 0.0300 (last tenth 0.0500), k3 1.00e-04, ratio max 5.5, "
        "2.0% of tokens past 2x over 5 steps")
    wait, step = sum(WAIT_MS.values()), sum(STEP_MS.values())
    assert (f"policy {100 * wait / step:.1f}% ({wait / 1000:.1f} s waiting of "
            f"{step / 1000:.1f} s") in text
    late = sum(WAIT_MS[v] for v in range(1, 5)) / sum(STEP_MS[v] for v in range(1, 5))
    assert f"{100 * late:.1f}% after version 0" in text  # version 0 holds the start-up wait
    assert lines["final balance decision"].startswith(
        "final balance decision: scale_up, pool 1 -> 2 (trainer waited 25.0%")
    assert "versions 2..3" in lines["final balance decision"]
    assert "plots skipped" not in text
    # the report did not write into the run's dataflow folder (no -wal / -shm left behind)
    assert sorted(p.name for p in (full_run / "dataflow").iterdir()) == dataflow_files


def test_loaded_data_matches_the_inputs(full_run):
    data = load_run(full_run)
    assert data.model_ids == ["policy"]
    assert sorted(data.evals["policy"]) == [0, 4]
    v4 = data.evals["policy"][4]
    assert v4["benchmarks"]["aime"]["avg_at_k"] == 1.0
    assert v4["benchmarks"]["math500"]["avg_at_k"] == 0.5
    assert {v: c["trainer_wait_ms"] for v, c in data.per_version["policy"].items()} == WAIT_MS
    assert [s for s, _ in data.scalars["policy"]["train/reward_mean"]] == list(range(5))
    assert len(data.balance) == 2 and data.balance[-1]["versions"] == [2, 3]
    assert [d["target"] for d in data.pool_decisions] == [1, 2]
    assert data.started_at == T0
    # the pool: raas-a from T0+1, raas-b from T0+3 to T0+6
    assert pool_timeline(data.instances, T0 + 10) == [
        (T0 + 1, 1), (T0 + 3, 2), (T0 + 6, 1), (T0 + 10, 1)]


def test_rolling_ratio_is_a_window_of_sums():
    assert rolling_ratio([1, 3, 0], [2, 2, 0], 2) == [0.5, 1.0, 1.5]
    assert rolling_ratio([0], [0], 3) == [None]


def test_summary_json_alone_draws_eval_and_wait_and_skips_the_rest(tmp_path, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    write_summary(run_dir)
    out = tmp_path / "out"
    assert main([str(run_dir), "--out", str(out), "--window", "2"]) == 0
    assert_png(out / "eval_accuracy.png")
    assert_png(out / "wait_fraction.png")
    for name in ("reward.png", "staleness.png", "weights.png", "pool.png"):
        assert not (out / name).exists()
    text = (out / "summary.txt").read_text()
    assert "eval policy: v0 30.0% -> v4 70.0% avg@2" in text  # the summary's table
    assert "  reward.png: no TensorBoard scalar 'train/reward_mean'" in text
    assert "  staleness.png: no TensorBoard scalars train/staleness_mean" in text
    assert "  weights.png: no publisher scalars (publish/sparsity" in text
    assert ("  pool.png: no RaaS instance in the dataflow DB's instance table and no "
            "autoscaler") in text
    assert "dataflow DB" in text and "is missing" in text  # the note says why
    assert "balance.jsonl is missing" in text
    assert "recipe: run (the run folder's name; summary.json names no recipe)" in text
    assert not (run_dir / "report").exists()  # --out honoured


def test_db_without_evals_or_counters_skips_eval_and_wait(tmp_path):
    run_dir = tmp_path / "run"
    store = Store(run_dir / "dataflow" / "dataflow.db")
    store.close()
    write_tensorboard(run_dir, steps=3)
    report = make_report(run_dir)
    assert set(report.skipped) == {"eval_accuracy.png", "wait_fraction.png", "pool.png",
                                   "wall_time.png"}
    assert "no complete evaluation" in report.skipped["eval_accuracy.png"]
    assert "trainer_wait_ms / trainer_step_ms" in report.skipped["wait_fraction.png"]
    for name in ("reward.png", "staleness.png", "weights.png"):
        assert_png(run_dir / "report" / name)
    assert "summary.json is missing" in report.text
    assert "eval: none complete" in report.text


def test_a_rerun_removes_plots_that_are_now_skipped(full_run):
    make_report(full_run)
    assert (full_run / "report" / "reward.png").exists()
    for p in (full_run / "tensorboard").rglob("events*"):
        p.unlink()
    report = make_report(full_run)
    assert "reward.png" in report.skipped
    assert not (full_run / "report" / "reward.png").exists()


def test_a_folder_that_is_not_a_run_folder_is_an_error(tmp_path, capsys):
    (tmp_path / "logs").mkdir()
    assert main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "not an astralight run folder" in err
    assert "summary.json" in err and "dataflow/dataflow.db" in err
    assert main([str(tmp_path / "nope")]) == 2
    assert "does not exist" in capsys.readouterr().err
    with pytest.raises(RunFolderError, match="summary.json"):
        load_run(tmp_path)


def test_without_matplotlib_the_text_summary_is_still_written(full_run, monkeypatch, capsys):
    """matplotlib is a dependency; on a broken install the report still writes summary.txt
    and says why every plot is missing (it used to fail and write nothing)."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    with pytest.raises(MatplotlibMissing, match="pip install matplotlib"):
        require_matplotlib()
    report = make_report(full_run)
    assert report.written == [] and report.skipped
    assert all("pip install matplotlib" in why for why in report.skipped.values())
    text = (full_run / "report" / "summary.txt").read_text()
    assert text == report.text and "pip install matplotlib" in text
    assert not list((full_run / "report").glob("*.png"))
    assert main([str(full_run)]) == 0
    assert "pip install matplotlib" in capsys.readouterr().out


def test_a_multi_policy_summary_reports_each_policy(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    write_db(run_dir)
    store = Store(run_dir / "dataflow" / "dataflow.db")
    with store.tx():
        store.insert_eval_run("verifier", 0, 1, 2, T0)
        store.insert_eval_report("verifier", 0, 0, "v0", 2, 2, 2.0, 0, 0, T0 + 1,
                                 n_team_correct=1)
        store.bump("verifier", "trainer_wait_ms", 500, version=1)
        store.bump("verifier", "trainer_step_ms", 1000, version=1)
    store.close()
    write_tensorboard(run_dir, "policy")
    write_tensorboard(run_dir, "verifier")
    report = make_report(run_dir)
    assert "policies: policy, verifier" in report.text
    assert "eval verifier: v0 100.0% -> v0 100.0% avg@2" in report.text
    # the team's accuracy once, not on each policy's line
    assert report.text.count("team") == 1 and "team accuracy: v0 50.0% -> v0 50.0%" in report.text
    assert "verifier 50.0% (0.5 s waiting of 1.0 s)" in report.text
    assert not report.skipped


# ---------------------------------------------------------------- what the launcher's report adds


def test_the_recipe_name_is_read_from_the_saved_recipe(full_run):
    (full_run / "recipe.yaml").write_text("name: tool-use-lora\nstop: {versions: 4}\n")
    assert "recipe: tool-use-lora" in make_report(full_run).text


def test_the_final_balance_decision_is_the_last_full_windows(full_run):
    """The launcher writes a last, partial window at the end (``final``), often one version:
    too little to decide on, so the report reads the last full one."""
    report = {**_balance(), "versions": [4, 4], "final": True, "wait_fraction": 0.9,
              "decision": {"action": "hold", "pool": 2, "target": 2, "reason": "one version"}}
    (full_run / "balance.jsonl").write_text(
        json.dumps({**_balance(), "versions": [0, 1]}) + "\n" + json.dumps(_balance()) + "\n"
        + json.dumps(report) + "\n")
    text = make_report(full_run).text
    line = next(x for x in text.splitlines() if x.startswith("final balance decision"))
    assert line.startswith("final balance decision: scale_up, pool 1 -> 2") and "2..3" in line
    (full_run / "balance.jsonl").write_text(json.dumps(report) + "\n")  # only the partial one
    line = next(x for x in make_report(full_run).text.splitlines()
                if x.startswith("final balance decision"))
    assert "the last, partial window: no full one was written" in line


def test_a_fixed_pool_draws_no_pool_plot(full_run):
    (full_run / "autoscale.jsonl").unlink()
    # raas-b joined at T0+3 and left at T0+6, while versions were published (up to T0+8): an
    # elastic pool without an autoscaler, drawn
    assert "pool.png" not in make_report(full_run).skipped
    store = Store(full_run / "dataflow" / "dataflow.db")
    with store.tx():
        store.conn.execute("DELETE FROM instances WHERE instance_id='raas-b'")
        # raas-a leaves only as the run stops, after the last publication
        store.set_instance_state("raas-a", "left", T0 + 9)
    store.close()
    report = make_report(full_run)
    assert report.skipped["pool.png"].startswith("a fixed pool of 1 instance(s) that never changed")
    assert not (full_run / "report" / "pool.png").exists()


def test_the_staleness_line_names_the_dataflows_bound(full_run):
    cfg = full_run / "configs" / "dataflow.yaml"  # the dataflow's config, as the launcher exports it
    cfg.write_text(cfg.read_text() + "max_staleness: 2\n")
    data = load_run(full_run)
    data.staleness = {"policy": {(4, 0): 10, (4, 3): 2}}
    data.staleness_reference = {"policy": "trainer"}
    from astralight.report.text import _staleness_line

    line = _staleness_line(data, ["policy"])
    assert "The dataflow's bound: max_staleness 2, against its own version" in line


def test_throughput_is_samples_trained_per_second_between_publications(full_run):
    from astralight.report.plots import throughput_series, version_seconds

    data = load_run(full_run)
    # versions 1..4 published at T0 + 2, 4, 6, 8; 16 samples trained for each
    assert version_seconds(data, "policy") == {0: 0.0, 1: 2.0, 2: 4.0, 3: 6.0, 4: 8.0}
    assert throughput_series(data, "policy", window=2) == ([4.0, 8.0], [8.0, 8.0])


def test_the_bound_comes_from_the_exported_config_else_the_recipe_else_the_default(tmp_path):
    from astralight.report.rundata import max_staleness

    assert max_staleness(tmp_path) is None  # neither file: no bound to draw
    (tmp_path / "recipe.yaml").write_text("name: r\ndataflow: {group_size: 8}\n")
    assert max_staleness(tmp_path) == 4  # the dataflow's default
    (tmp_path / "recipe.yaml").write_text("name: r\ndataflow: {max_staleness: 1}\n")
    assert max_staleness(tmp_path) == 1
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "dataflow.yaml").write_text("max_staleness: 0\n")
    assert max_staleness(tmp_path) == 0
