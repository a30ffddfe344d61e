"""eval.n / eval.pass_k: n samples per eval prompt, the unbiased pass@k for every k <= n, per
benchmark and averaged over benchmarks; stored with the run, served by /v1/eval, logged by the
DataflowMonitor; old state folders (no such columns) still aggregate as before."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
from fastapi.testclient import TestClient

from astralight.dataflow import evals
from astralight.dataflow.app import create_app
from astralight.dataflow.config import DataflowConfig, EvalConfig, parse_config
from astralight.dataflow.evals import aggregate, pass_at_k
from astralight.dataflow.store import Store
from astralight.protocol import Sample, Task, decode
from astralight.report.rundata import ReadOnlyStore
from astralight.tasks.base import Prompt, PromptSource
from tests.unit.run_folders import _old_db

# n = 4 samples per prompt; c correct -> pass@1, pass@2, pass@4 = 1 - C(4-c, k) / C(4, k)
HAND = {2: (Fraction(1, 2), Fraction(5, 6), Fraction(1)),   # 1-2/4, 1-1/6, 1-0/1
        1: (Fraction(1, 4), Fraction(1, 2), Fraction(1)),   # 1-3/4, 1-3/6, 1-0/1
        0: (Fraction(0), Fraction(0), Fraction(0))}


class ThreePrompts(PromptSource):
    """Prompts 0, 1 of benchmark "a", prompt 2 of "b"."""

    def get(self, index: int) -> Prompt:
        if not 0 <= index < 3:
            raise IndexError(index)
        return Prompt(f"p{index}", f"{index}+1=",
                      {"answer": str(index + 1), "benchmark": "a" if index < 2 else "b"})

    def __len__(self) -> int:
        return 3


@pytest.mark.parametrize("c", [0, 1, 2])
def test_pass_at_k_n4_hand_computed(c):
    for k, expected in zip((1, 2, 4), HAND[c]):
        assert pass_at_k(4, c, k) == pytest.approx(float(expected), abs=1e-12)


# correct samples of prompts 0, 1, 2 (rewards 1.0 or 0.0)
CORRECT = (2, 1, 0)
# overall: mean over the 3 prompts; a: prompts 0, 1; b: prompt 2
OVERALL = {str(k): float(sum(HAND[c][i] for c in CORRECT) / 3) for i, k in enumerate((1, 2, 4))}
BENCH_A = {str(k): float((HAND[2][i] + HAND[1][i]) / 2) for i, k in enumerate((1, 2, 4))}
BENCH_B = {"1": 0.0, "2": 0.0, "4": 0.0}


def test_hand_values_of_the_fixture():
    assert OVERALL == pytest.approx({"1": 0.25, "2": 4 / 9, "4": 2 / 3})
    assert BENCH_A == pytest.approx({"1": 0.375, "2": 2 / 3, "4": 1.0})


def test_schedule_draws_n_samples_and_aggregate_reports_every_k(tmp_path):
    store = Store(tmp_path / "dataflow.db")
    source = ThreePrompts()
    with store.tx():
        assert evals.schedule(store, source, "p", 0, ["p"], 2, "single_turn", 0.0,
                              n=4, pass_k=[4, 1]) == 3
    payloads = store.conn.execute("SELECT payload FROM tasks WHERE kind='eval'").fetchall()
    assert [decode(bytes(r[0])).n for r in payloads] == [4, 4, 4]  # n samples, not k
    run = store.eval_runs("p")[0]
    assert (run["k"], run["n"], run["pass_k"]) == (2, 4, "[1, 2, 4]")  # k always among pass_k
    for i, c in enumerate(CORRECT):
        store.insert_eval_report("p", 0, i, f"t{i}", 4, c, float(c), 0, 0, 1.0)
    out = aggregate(store, "p", benchmarks=evals.benchmark_map(source))[0]
    assert (out["k"], out["n"], out["complete"]) == (2, 4, True)
    assert out["avg_at_k"] == pytest.approx(3 / 12)
    assert out["pass_at"] == pytest.approx(OVERALL)
    assert out["pass_at_k"] == pytest.approx(OVERALL["2"])  # the headline k, unbiased
    assert out["benchmarks"]["a"]["pass_at"] == pytest.approx(BENCH_A)
    assert out["benchmarks"]["a"]["avg_at_k"] == pytest.approx(3 / 8)
    assert out["benchmarks"]["b"]["pass_at"] == pytest.approx(BENCH_B)
    # the unweighted mean over benchmarks: (a + b) / 2, not the prompt-weighted overall
    assert out["benchmark_average"] == pytest.approx((3 / 8 + 0.0) / 2)
    assert out["benchmark_average_pass_at_k"] == pytest.approx(BENCH_A["2"] / 2)
    assert out["benchmark_average_pass_at"] == pytest.approx(
        {k: (BENCH_A[k] + BENCH_B[k]) / 2 for k in BENCH_A})
    store.close()


def test_schedule_refuses_k_above_n(tmp_path):
    store = Store(tmp_path / "dataflow.db")
    with pytest.raises(ValueError, match="eval.pass_k"):
        evals.schedule(store, ThreePrompts(), "p", 0, ["p"], 2, "single_turn", 0.0, n=4,
                       pass_k=[8])
    store.close()


def test_old_state_folders_aggregate_as_before(tmp_path):
    path = tmp_path / "dataflow.db"
    _old_db(path)
    ro = ReadOnlyStore(path)  # the report's reader: no migration
    old = aggregate(ro, "p", benchmarks={0: "x", 1: "y"})[3]
    ro.conn.close()
    assert (old["k"], old["n"], old["avg_at_k"], old["pass_at_k"]) == (4, 4, 1 / 8, 0.5)
    assert old["pass_at"] == {"4": 0.5} and "team_accuracy" not in old
    assert old["benchmark_average_pass_at_k"] == pytest.approx(0.5)
    store = Store(path)  # the service's reader migrates: the new columns are NULL
    assert store.eval_runs("p")[0]["n"] is None
    migrated = aggregate(store, "p", benchmarks={0: "x", 1: "y"})[3]
    store.close()
    assert migrated == old


# ---------------------------------------------------------------- config

def test_defaults_change_nothing():
    cfg = EvalConfig()
    assert (cfg.k, cfg.n, cfg.pass_k, cfg.samples(), cfg.pass_ks()) == (4, None, None, 4, [4])
    assert EvalConfig(k=2, n=8, pass_k=[8, 1, 1]).pass_ks() == [1, 2, 8]


@pytest.mark.parametrize("bad, match", [
    ({"k": 8, "n": 4}, r"eval\.k: 8 exceeds eval\.n=4 .*raise eval\.n"),
    ({"k": 2, "n": 4, "pass_k": [1, 8]}, r"eval\.pass_k: k=8 exceeds eval\.n=4 .*set eval\.n to >= 8"
                                         r" or drop 8 from eval\.pass_k"),
    ({"k": 4, "pass_k": [8]}, r"eval\.pass_k: k=8 exceeds eval\.n=4"),  # n defaults to k
    ({"n": 0}, r"eval\.n: must be a positive"),
    ({"k": 2, "pass_k": [0]}, r"eval\.pass_k: every k must be a positive int"),
    ({"every": 0}, r"eval\.every: must be > 0, got 0"),
])
def test_k_above_n_is_a_config_error_naming_the_field_and_the_fix(bad, match):
    with pytest.raises(ValueError, match=match):
        DataflowConfig(eval=bad)


def test_cli_sets_n_and_pass_k_and_refuses_k_above_n(capsys):
    cfg = parse_config(["--eval.k", "2", "--eval.n", "8", "--eval.pass_k", "[1, 8]"])
    assert (cfg.eval.samples(), cfg.eval.pass_ks()) == (8, [1, 2, 8])
    with pytest.raises(SystemExit):
        parse_config(["--eval.k", "2", "--eval.n", "2", "--eval.pass_k", "[4]"])
    assert "eval.pass_k: k=4 exceeds eval.n=2" in capsys.readouterr().err


# ---------------------------------------------------------------- service: info, lease, /v1/eval

def _samples(task: Task, rewards: list[float]) -> list[Sample]:
    out = []
    for i, r in enumerate(rewards):
        out.append(Sample(task_id=task.task_id, sample_index=i, model_id="policy",
                          token_ids=np.array([2, 5, 6, 7, 8, 1], np.int32),
                          logprobs=np.array([0, 0, 0, -0.5, -0.5, -0.5], np.float32),
                          loss_mask=np.array([0, 0, 0, 1, 1, 1], np.uint8),
                          versions=np.array([-1, -1, -1, 0, 0, 0], np.int32), reward=r,
                          prompt_len=3))
    return out


def test_service_issues_n_samples_and_serves_every_pass_at_k(tmp_path):
    cfg = DataflowConfig(state_dir=str(tmp_path / "state"), group_size=2,
                         eval={"source": {"class_path": "tests.unit.test_eval_pass_k.ThreePrompts",
                                          "init_args": {}},
                               "every": 1, "k": 2, "n": 4, "pass_k": [1, 4]})
    app = create_app(cfg, token="")
    with TestClient(app, base_url="http://127.0.0.1") as client:  # no token: a loopback Host
        core = app.state.dataflow
        info = client.get("/v1/info").json()["eval"]
        assert (info["k"], info["n"], info["pass_k"]) == (2, 4, [1, 2, 4])
        iid = core.register(["policy"], 8, None, {})["instance_id"]
        tasks = [t for t in core.lease(iid, 5) if t.kind == "eval"]
        assert len(tasks) == 3 and all(t.n == 4 for t in tasks)
        for t in tasks:
            c = CORRECT[int(t.task_id.rsplit(":", 1)[1])]
            core.push(iid, t.task_id, _samples(t, [1.0] * c + [0.0] * (4 - c)))
        r0 = client.get("/v1/eval/policy").json()["0"]
    assert r0["complete"] and (r0["k"], r0["n"]) == (2, 4)
    assert r0["pass_at"] == pytest.approx(OVERALL)
    assert r0["pass_at_k"] == pytest.approx(OVERALL["2"])
    assert r0["benchmark_average_pass_at"] == pytest.approx(
        {k: (BENCH_A[k] + BENCH_B[k]) / 2 for k in BENCH_A})


# ---------------------------------------------------------------- the trainer's TensorBoard

def test_monitor_logs_every_pass_at_k_and_the_benchmark_averages():
    from tests.unit.monitor_fakes import monitor_with

    result = {"complete": True, "avg_at_k": 0.25, "pass_at_k": 0.5, "k": 2,
              "pass_at": {"1": 0.25, "2": 0.5, "4": 0.75},
              "benchmarks": {"aime 25": {"avg_at_k": 0.5, "pass_at_k": 0.6, "n_reported": 1,
                                         "pass_at": {"1": 0.5, "2": 0.6}},
                             "empty": {"avg_at_k": 0.0, "pass_at_k": 0.0, "n_reported": 0}},
              "benchmark_average": 0.5, "benchmark_average_pass_at_k": 0.6,
              "benchmark_average_pass_at": {"1": 0.5, "2": 0.6}}
    monitor, trainer = monitor_with({"models": {}}, {2: result})
    monitor.poll(trainer)
    (logged, step), = [(m, s) for m, s in trainer.logger.calls if "eval/avg_at_k" in m]
    assert step == 4
    # the headline k (2) is pass_at_k only, never repeated as pass_at_2 (a duplicate tag)
    assert logged == {"eval/avg_at_k": 0.25, "eval/pass_at_k": 0.5, "eval/version": 2.0,
                      "eval/pass_at_1": 0.25, "eval/pass_at_4": 0.75,
                      "eval/benchmark_average": 0.5, "eval/benchmark_average_pass_at_k": 0.6,
                      "eval/benchmark_average_pass_at_1": 0.5,
                      "eval/aime_25/avg_at_k": 0.5, "eval/aime_25/pass_at_k": 0.6,
                      "eval/aime_25/pass_at_1": 0.5}
