"""``astralight report``: where trainer metrics and the dataflow DB are found (``lightning_logs/``,
``--tensorboard DIR``, ``--db PATH``), the summary's ``sources`` lines, the per-benchmark avg@k /
pass@k tables at the last and the best eval version, and old-format run folders."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from astralight.dataflow.store import Store
from astralight.report import main, make_report
from astralight.report.rundata import load_run
from tests.unit.run_folders import T0, _old_db, assert_png, write_summary

TB_PLOTS = ("reward.png", "staleness.png")


def lightning_logs(save_dir: Path, steps: int = 4, start: float = 0.2) -> Path:
    """What a trainer with Lightning's default logger writes: ``save_dir/lightning_logs/
    version_N/events...`` (a new version_N per fit), through the real TensorBoardLogger."""
    from lightning.pytorch.loggers import TensorBoardLogger

    logger = TensorBoardLogger(save_dir=str(save_dir))
    for step in range(steps):
        logger.log_metrics({"train/reward_mean": start + 0.1 * step,
                            "train/staleness_mean": 0.5, "train/staleness_max": 1.0}, step)
    logger.finalize("success")
    return Path(logger.log_dir)


def write_eval_db(path: Path, runs: dict[int, tuple[int, ...]], benchmarks: bool = True) -> None:
    """Eval runs of 4 prompts x n=4 samples (k=2, pass@1/2/4): ``runs[v]`` = correct samples per
    prompt (reward 1 each). With ``benchmarks`` the run folder names the TwoBenchmarks source
    (prompts 0, 1: "aime"; 2, 3: "math500")."""
    store = Store(path)
    with store.tx():
        store.set_meta("started_at", T0)
        for v, correct in runs.items():
            store.insert_eval_run("policy", v, 4, 2, T0 + v, n=4, pass_k=[1, 2, 4])
            for i, c in enumerate(correct):
                store.insert_eval_report("policy", v, i, f"e{v}-{i}", 4, c, float(c), v, v,
                                         T0 + v + 1)
    store.close()


def name_benchmarks(run_dir: Path) -> None:
    cfg = run_dir / "configs" / "dataflow.yaml"
    cfg.parent.mkdir(parents=True, exist_ok=True)
    cfg.write_text("eval:\n  source:\n    class_path: tests.unit.run_folders.TwoBenchmarks\n")


# ---------------------------------------------------------------- TensorBoard discovery

def test_lightning_logs_alone_draw_reward_and_name_their_source(tmp_path):
    run_dir = tmp_path / "run"
    lightning_logs(run_dir)
    lightning_logs(run_dir, start=0.9)  # a resumed fit: version_1, its steps win
    report = make_report(run_dir)
    for name in TB_PLOTS:
        assert_png(run_dir / "report" / name)
    assert "TensorBoard: lightning_logs [version_0, version_1]" in report.text
    assert report.data.scalars["lightning_logs"]["train/reward_mean"][0] == (0, pytest.approx(0.9))
    assert "summary.json: missing" in report.text
    assert "dataflow DB: missing (looked for dataflow/dataflow.db; pass --db PATH" in report.text


def test_any_folder_of_events_in_the_run_folder_is_read_beside_tensorboard(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    write_summary(run_dir)
    lightning_logs(run_dir / "trainer-a")
    lightning_logs(run_dir / "trainer-b", start=0.5)
    data = load_run(run_dir)
    assert sorted(data.scalars) == ["trainer-a/lightning_logs", "trainer-b/lightning_logs"]
    assert ("TensorBoard: trainer-a/lightning_logs [version_0]; trainer-b/lightning_logs "
            "[version_0]") in make_report(run_dir).text


def test_tensorboard_option_reads_trainer_logs_outside_the_run_folder(tmp_path, capsys):
    """Slurm: the dataflow state under runs/slurm-JOB/, the trainers' default_root_dir elsewhere."""
    run_dir = tmp_path / "runs" / "slurm-42"
    write_eval_db(run_dir / "dataflow" / "dataflow.db", {0: (0, 0, 0, 0), 2: (1, 1, 1, 1)})
    solver, verifier = tmp_path / "roots" / "solver", tmp_path / "roots" / "verifier"
    lightning_logs(solver)
    lightning_logs(verifier)
    before = make_report(run_dir)
    assert "reward.png" in before.skipped
    assert "--tensorboard DIR" in before.skipped["reward.png"] + before.text
    assert main([str(run_dir), "--tensorboard", str(solver), "--tensorboard", str(verifier)]) == 0
    text = capsys.readouterr().out
    for name in TB_PLOTS:
        assert_png(run_dir / "report" / name)
    # both trainers log to lightning_logs: the second is told apart by its folder
    assert (f"TensorBoard: lightning_logs <- {solver / 'lightning_logs'} (--tensorboard) "
            f"[version_0]; verifier/lightning_logs <- {verifier / 'lightning_logs'} "
            f"(--tensorboard) [version_0]") in text
    assert "dataflow DB: dataflow/dataflow.db" in text


def test_db_option_reads_a_state_folder_elsewhere(tmp_path, capsys):
    """Kubernetes: the dataflow DB on the /state volume, copied or mounted anywhere."""
    run_dir, db = tmp_path / "run", tmp_path / "state" / "dataflow.db"
    lightning_logs(run_dir)
    write_eval_db(db, {0: (0, 0, 0, 0), 2: (1, 1, 1, 1)})
    files = sorted(p.name for p in db.parent.iterdir())
    assert main([str(run_dir), "--db", str(db)]) == 0
    text = capsys.readouterr().out
    assert_png(run_dir / "report" / "eval_accuracy.png")
    assert f"dataflow DB: {db} (--db)" in text
    assert "eval policy: v0 0.0% -> v2 25.0% avg@2" in text
    assert sorted(p.name for p in db.parent.iterdir()) == files  # opened read-only


def test_missing_db_or_tensorboard_option_is_an_error_naming_it(tmp_path, capsys):
    run_dir = tmp_path / "run"
    lightning_logs(run_dir)
    assert main([str(run_dir), "--db", str(tmp_path / "nope.db")]) == 2
    assert "--db: " in capsys.readouterr().err
    assert main([str(run_dir), "--tensorboard", str(tmp_path / "nope")]) == 2
    assert "--tensorboard: " in capsys.readouterr().err
    # the options alone make a folder reportable
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main([str(empty), "--tensorboard", str(run_dir)]) == 0
    assert_png(empty / "report" / "reward.png")


# ---------------------------------------------------------------- eval tables

LAST_TABLE = """\
  policy v4, the last eval:
    benchmark   prompts   avg@2  pass@1  pass@2  pass@4
    aime              2   25.0%   25.0%   50.0%  100.0%
    math500           2   25.0%   25.0%   50.0%  100.0%
    average               25.0%   25.0%   50.0%  100.0%
    all prompts       4   25.0%   25.0%   50.0%  100.0%
"""
# v2, per prompt correct of 4: aime (4, 2), math500 (2, 0)
# pass@2 of c=2, n=4: 1 - C(2,2)/C(4,2) = 5/6; aime (1 + 5/6)/2 = 91.7%, math500 (5/6)/2 = 41.7%
BEST_TABLE = """\
  policy v2, the best eval by benchmark-average avg@2:
    benchmark   prompts   avg@2  pass@1  pass@2  pass@4
    aime              2   75.0%   75.0%   91.7%  100.0%
    math500           2   25.0%   25.0%   41.7%   50.0%
    average               50.0%   50.0%   66.7%   75.0%
    all prompts       4   50.0%   50.0%   66.7%   75.0%
"""


def test_summary_tables_at_the_last_and_the_best_version(tmp_path):
    run_dir = tmp_path / "run"
    write_eval_db(run_dir / "dataflow" / "dataflow.db",
                  {0: (0, 0, 0, 0), 2: (4, 2, 2, 0), 4: (1, 1, 1, 1)})
    name_benchmarks(run_dir)
    text = make_report(run_dir).text
    assert "eval per benchmark (avg@k, unbiased pass@k):\n" + LAST_TABLE + BEST_TABLE in text
    assert ("eval policy: v0 0.0% -> v4 25.0% avg@2 (pass@2 0.0% -> 50.0%; benchmark average "
            "0.0% -> 25.0%; benchmark average pass@2 0.0% -> 50.0%; best v2 50.0%)") in text


def test_last_is_best_and_no_benchmarks_gives_one_table(tmp_path):
    run_dir = tmp_path / "run"
    write_eval_db(run_dir / "dataflow" / "dataflow.db", {0: (0, 0, 0, 0), 2: (4, 2, 2, 0)})
    text = make_report(run_dir).text
    assert ("  policy v2, the last eval and the best by avg@2:\n"
            "    benchmark   prompts   avg@2  pass@1  pass@2  pass@4\n"
            "    all prompts       4   50.0%   50.0%   66.7%   75.0%\n") in text
    assert "the best eval" not in text


# ---------------------------------------------------------------- old-format run folders

def test_an_old_dataflow_db_still_reports(tmp_path):
    """A state folder from before eval.n / eval.pass_k: k samples, pass@k only; not migrated."""
    run_dir = tmp_path / "run"
    (run_dir / "dataflow").mkdir(parents=True)
    _old_db(run_dir / "dataflow" / "dataflow.db")
    files = sorted(p.name for p in (run_dir / "dataflow").iterdir())
    report = make_report(run_dir)
    assert "eval_accuracy.png" in report.written
    assert "eval policy" not in report.text and "eval p: v3 12.5% -> v3 12.5% avg@4" in report.text
    assert ("  p v3, the last eval and the best by avg@4:\n"
            "    benchmark   prompts   avg@4  pass@4\n"
            "    all prompts       2   12.5%   50.0%\n") in report.text
    assert sorted(p.name for p in (run_dir / "dataflow").iterdir()) == files


def test_an_old_summary_json_still_reports(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    summary = write_summary(run_dir)
    assert "pass_at" not in json.dumps(summary["eval"]).replace("pass_at_k", "")
    text = make_report(run_dir).text
    # the summary's rows: v0 30% / pass@2 50%, v4 70% / pass@2 100%; best = last = v4
    assert ("  policy v4, the last eval and the best by avg@2:\n"
            "    benchmark   prompts   avg@2  pass@2\n"
            "    all prompts       4   70.0%  100.0%\n") in text
