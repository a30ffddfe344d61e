"""Eval results per benchmark: pass@k by hand, avg@k / pass@k per benchmark and their average,
read from a real SQLite store."""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import pytest

from astralight.dataflow import evals
from astralight.dataflow.evals import aggregate, benchmark_map, pass_at_k
from astralight.dataflow.store import Store
from astralight.tasks.arithmetic import ArithmeticSource
from astralight.tasks.data import AIME25Source, MathEvalSuite

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "datasets"


# ---------------------------------------------------------------- the unbiased estimator

@pytest.mark.parametrize("n, c, k, expected", [
    # n=5, c=2: 1 - C(3,k)/C(5,k)
    (5, 2, 1, Fraction(2, 5)),    # 1 - 3/5
    (5, 2, 2, Fraction(7, 10)),   # 1 - 3/10
    (5, 2, 3, Fraction(9, 10)),   # 1 - 1/10
    (5, 2, 4, Fraction(1)),       # C(3,4) = 0: every 4-subset holds a correct sample
    (5, 2, 5, Fraction(1)),
    (10, 1, 5, Fraction(1, 2)),   # 1 - C(9,5)/C(10,5) = 1 - 126/252
    (16, 4, 8, Fraction(25, 26)),  # 1 - C(12,8)/C(16,8) = 1 - 495/12870
    (8, 3, 2, Fraction(9, 14)),   # 1 - C(5,2)/C(8,2) = 1 - 10/28
    (4, 0, 1, Fraction(0)),
    (4, 4, 4, Fraction(1)),
    (7, 7, 1, Fraction(1)),
])
def test_pass_at_k_matches_hand_computed_values(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(float(expected), abs=1e-12)


def test_pass_at_1_is_the_fraction_correct_and_pass_at_k_grows_with_k():
    for n in range(1, 9):
        for c in range(n + 1):
            assert pass_at_k(n, c, 1) == pytest.approx(c / n)
            values = [pass_at_k(n, c, k) for k in range(1, n + 1)]
            assert values == sorted(values)


# ---------------------------------------------------------------- per-benchmark aggregation

@pytest.fixture
def store(tmp_path):
    return Store(tmp_path / "dataflow.db")


def report(store, version, index, n, c, s):
    store.insert_eval_report("p", version, index, f"eval:p:v{version}:{index}", n, c, float(s),
                             version, version, 1.0)


def test_aggregate_per_benchmark_and_their_average(store):
    store.insert_eval_run("p", 1, 5, 4, 0.0)  # 5 prompts, k = 4
    # aime: prompt 0; math: prompts 1..4. (n_samples, n_correct, sum_reward)
    report(store, 1, 0, 4, 1, 1.0)
    report(store, 1, 1, 4, 4, 4.0)
    report(store, 1, 2, 4, 2, 2.0)
    report(store, 1, 3, 4, 0, 0.0)
    report(store, 1, 4, 4, 1, 1.0)
    names = {0: "aime", 1: "math", 2: "math", 3: "math", 4: "math"}
    out = aggregate(store, "p", benchmarks=names)[1]
    assert out["benchmarks"] == {
        "aime": {"avg_at_k": 0.25, "pass_at_k": 1.0, "pass_at": {"4": 1.0}, "n_prompts": 1,
                 "n_reported": 1, "n_samples": 4},
        "math": {"avg_at_k": 7 / 16, "pass_at_k": 0.75, "pass_at": {"4": 0.75}, "n_prompts": 4,
                 "n_reported": 4, "n_samples": 16},
    }
    # the mean of the per-benchmark avg@k, not the sample-weighted overall avg@k (8/20)
    assert out["benchmark_average"] == pytest.approx((0.25 + 7 / 16) / 2)
    assert out["avg_at_k"] == pytest.approx(8 / 20) and out["complete"]


def test_partial_runs_unknown_prompts_and_no_map(store):
    store.insert_eval_run("p", 2, 4, 2, 0.0)
    report(store, 2, 0, 2, 2, 2.0)
    report(store, 2, 3, 2, 0, 0.0)  # prompt 3 is in no benchmark of the map
    out = aggregate(store, "p", benchmarks={0: "a", 1: "a", 2: "b"})[2]
    assert out["benchmarks"]["a"] == {"avg_at_k": 1.0, "pass_at_k": 1.0, "pass_at": {"2": 1.0},
                                      "n_prompts": 2, "n_reported": 1, "n_samples": 2}
    # nothing of b reported yet: listed, but left out of the average
    assert out["benchmarks"]["b"]["n_reported"] == 0 and out["benchmarks"]["b"]["n_prompts"] == 1
    assert out["benchmarks"]["unknown"]["avg_at_k"] == 0.0
    assert out["benchmark_average"] == pytest.approx((1.0 + 0.0) / 2)
    plain = aggregate(store, "p")[2]
    assert "benchmarks" not in plain and "benchmark_average" not in plain


def test_benchmark_map_of_sources():
    suite = MathEvalSuite({"aime25": str(FIX / "aime25.jsonl"),
                           "minerva": str(FIX / "minerva.jsonl")})
    assert benchmark_map(suite) == {0: "aime25", 1: "aime25", 2: "minerva", 3: "minerva"}
    assert benchmark_map(AIME25Source(str(FIX / "aime25.jsonl"))) == {0: "aime25", 1: "aime25"}
    assert benchmark_map(ArithmeticSource(split="eval", eval_size=5)) is None
    assert benchmark_map(None) is None


def test_scheduled_eval_prompts_line_up_with_the_benchmark_map(store):
    """schedule() numbers eval prompts as the source does, so the map and the reports agree."""
    suite = MathEvalSuite({"aime25": str(FIX / "aime25.jsonl"),
                           "minerva": str(FIX / "minerva.jsonl")})
    n = evals.schedule(store, suite, "p", 0, ["p"], 2, "single_turn", 0.0)
    assert n == len(suite) == 4
    for i, (c, s) in enumerate([(2, 2.0), (1, 1.0), (0, 0.0), (0, 0.0)]):
        report(store, 0, i, 2, c, s)
    out = aggregate(store, "p", benchmarks=benchmark_map(suite))[0]
    assert out["benchmarks"]["aime25"]["avg_at_k"] == 0.75
    assert out["benchmarks"]["minerva"]["avg_at_k"] == 0.0
    assert out["benchmark_average"] == pytest.approx(0.375)
