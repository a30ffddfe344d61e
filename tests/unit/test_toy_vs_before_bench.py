"""The pure part of tests/benchmarks/bench_toy_vs_before.py: a finished run folder's figures,
from a summary.json of either arm's shape and a real dataflow SQLite state; the before arm's
AMX sitecustomize."""

import json
import os
import subprocess
import sys

from astralight.dataflow.store import Store
from tests.benchmarks.bench_toy_vs_before import AMX_SITECUSTOMIZE, ROOT, run_figures


def test_run_figures_reads_a_summary_without_todays_fields(tmp_path):
    store = Store(tmp_path / "dataflow" / "dataflow.db")
    store.set_meta("started_at", 1000.0)
    for version, at in ((10, 1020.0), (20, 1041.5), (30, 1060.0)):
        store.insert_version("policy", version, b"{}", at)
    store.conn.commit()
    store.close()
    # the code before issue 15 wrote neither trainer_wait_fraction nor wall_s_to_085, and its
    # "eval" holds the complete evaluations only, keyed by the version as a string
    (tmp_path / "summary.json").write_text(json.dumps({
        "counters": {"trainer_wait_ms": 640, "trainer_step_ms": 1000}, "wall_s": 99.0,
        "eval": {"0": {"avg_at_k": 0.2}, "10": {"avg_at_k": 0.7}, "20": {"avg_at_k": 0.86},
                 "30": {"avg_at_k": 0.84}}}))
    figures = run_figures(tmp_path)
    assert figures["trainer_wait_fraction"] == 0.64
    assert figures["wall_s_to_085"] == 41.5 and figures["version_085"] == 20
    assert figures["eval"] == {0: 0.2, 10: 0.7, 20: 0.86, 30: 0.84}


def test_run_figures_of_a_run_that_never_reached_085(tmp_path):
    Store(tmp_path / "dataflow" / "dataflow.db").close()
    (tmp_path / "summary.json").write_text(json.dumps({
        "counters": {}, "eval": {"0": {"avg_at_k": 0.2}, "10": {"avg_at_k": 0.5}}}))
    figures = run_figures(tmp_path)
    assert figures["wall_s_to_085"] is None and figures["version_085"] is None
    assert figures["trainer_wait_fraction"] is None


def test_the_before_arms_sitecustomize_asks_for_amx_with_todays_code(tmp_path):
    """The code before asked for no AMX permission (its RaaS died with SIGILL on an AMX CPU);
    the sitecustomize put in its tree runs in every process of the arm and asks, through
    today's raas/cpu_features.py."""
    (tmp_path / "sitecustomize.py").write_text(
        AMX_SITECUSTOMIZE.format(path=ROOT / "raas" / "cpu_features.py"))
    out = subprocess.run([sys.executable, "-c", "import sitecustomize as s; print(s._mod._result)"],
                         env={**os.environ, "PYTHONPATH": str(tmp_path)}, capture_output=True,
                         text=True, check=True, cwd=tmp_path)
    assert out.stdout.strip() in ("True", "False")  # None: request_amx was never called
