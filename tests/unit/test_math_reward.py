"""MathVerifyReward: extraction, fast path, math-verify equivalences, timeouts, threads."""

from __future__ import annotations

import threading
import time

import pytest

from astralight.rewards.math import (MathVerifyReward, fast_compare, last_answer_line,
                                     last_boxed, last_number, math_verify_equal,
                                     normalize_answer)
from astralight.rewards.subprocess_pool import PoolError, PoolTimeout, SubprocessPool


HERE = "tests.unit.test_math_reward"


# ---------------------------------------------------------------- stubs run in pool workers

def sleepy_verify(gold: str, pred: str, timeout: int | None = None) -> bool:
    """Hangs on the answer "hang" (a verifier stuck on pathological input), else string equality."""
    if pred == "hang":
        time.sleep(60)
    return gold == pred


def failing_verify(gold: str, pred: str, timeout: int | None = None) -> bool:
    raise ValueError(f"cannot compare {pred!r}")


def add(a, b):
    return a + b


# ---------------------------------------------------------------- the equivalence table

TABLE = [
    # fractions vs decimals, \frac vs /
    ("0.5", r"so \boxed{\frac{1}{2}}", 1.0),
    (r"\frac{1}{2}", r"\boxed{1/2}", 1.0),
    (r"\frac12", r"\boxed{0.5}", 1.0),
    ("3/4", r"\boxed{\dfrac{3}{4}}", 1.0),
    ("0.75", r"\boxed{3/4}", 1.0),
    ("0.3333", r"\boxed{1/3}", 0.0),
    (r"\frac{1}{2}", r"\boxed{\frac{1}{\sqrt{4}}}", 1.0),  # nested braces
    # negative numbers
    ("-3", r"\boxed{-3}", 1.0),
    ("-3", r"\boxed{3}", 0.0),
    ("-2", r"\boxed{- 2}", 1.0),
    (r"-\frac{1}{2}", r"\boxed{-0.5}", 1.0),
    # plain numbers
    ("27", r"\boxed{27}", 1.0),
    ("27", r"\boxed{28}", 0.0),
    ("12", r"\boxed{12.0}", 1.0),
    ("1000", r"\boxed{1,000}", 1.0),
    ("2", r"\boxed{2.0000001}", 0.0),
    ("0.001", r"\boxed{10^{-3}}", 1.0),
    # sets and intervals
    ("(1,2]", r"\boxed{(1, 2]}", 1.0),
    ("(1,2)", r"\boxed{[1,2]}", 0.0),
    (r"\{1,2\}", r"\boxed{\{2, 1\}}", 1.0),
    (r"[0,\infty)", r"\boxed{[0, \infty)}", 1.0),
    # units text
    ("5", r"\boxed{5\text{ cm}}", 1.0),
    ("60", r"\boxed{60 \text{ km/h}}", 1.0),
    # latex spacing and \left/\right
    (r"\frac{1}{4}", r"\boxed{\frac{1} {4}}", 1.0),
    (r"\left( 1, 2 \right)", r"\boxed{(1,2)}", 1.0),
    # symbolic
    (r"\frac{\sqrt{2}}{2}", r"\boxed{\sqrt{2}/2}", 1.0),
    (r"2\sqrt{3}", r"\boxed{\sqrt{12}}", 1.0),
    ("x^2+2x+1", r"\boxed{(x+1)^2}", 1.0),
    (r"\pi", r"\boxed{3.14}", 0.0),
    ("x=3", r"\boxed{3}", 1.0),
    (r"10\%", r"\boxed{0.1}", 1.0),
    (r"\text{(B)}", r"\boxed{B}", 1.0),
    ("B", r"\boxed{C}", 0.0),
    # multiple boxes: the last one counts
    ("4", r"\boxed{3} wait, no: \boxed{4}", 1.0),
    ("3", r"\boxed{3} wait, no: \boxed{4}", 0.0),
    # a gold answer given as a number (parquet floats) or as a boxed solution
    (27.0, r"\boxed{27}", 1.0),
    (r"so the answer is $\boxed{\frac{3}{4}}$.", r"\boxed{0.75}", 1.0),
]


@pytest.fixture(scope="module")
def reward():
    r = MathVerifyReward(workers=2, no_answer_reward=-1.0)
    yield r
    r.close()


@pytest.mark.parametrize("gold, completion, expected", TABLE)
def test_equivalence_table(reward, gold, completion, expected):
    assert reward(completion, {"answer": gold}) == expected


def test_missing_box_scores_the_no_answer_reward(reward):
    assert reward("the answer is 4", {"answer": "4"}) == -1.0
    assert reward(r"unfinished \boxed{4", {"answer": "4"}) == -1.0  # cut at the token limit
    assert reward(r"\boxed{}", {"answer": "4"}) == -1.0
    assert MathVerifyReward(isolation="inline")("4", {"answer": "4"}) == 0.0  # default 0


def test_answer_field_is_configurable_and_missing_truth_names_the_field():
    r = MathVerifyReward(answer_key="ground_truth", isolation="inline")
    assert r(r"\boxed{7}", {"ground_truth": "7"}) == 1.0
    with pytest.raises(KeyError, match="metadata.ground_truth"):
        r(r"\boxed{7}", {"answer": "7"})


def test_answer_line_fallback_for_dapo_style_prompts():
    text = "Work...\nAnswer: 34"
    assert MathVerifyReward(isolation="inline")(text, {"answer": "34"}) == 0.0
    r = MathVerifyReward(answer_format="boxed_or_answer_line", isolation="inline")
    assert r(text, {"answer": "34"}) == 1.0
    assert r(r"Answer: 3 but \boxed{34}", {"answer": "34"}) == 1.0  # a box wins


def test_last_number_fallback_for_chat_models_that_do_not_box():
    r = MathVerifyReward(answer_format="boxed_or_last_number", isolation="inline")
    assert r("8 + 6 = 14", {"answer": "14"}) == 1.0
    assert r("12 + 35 = 50", {"answer": "47"}) == 0.0  # the last number is the answer given
    assert r("The answer is 1,234.", {"answer": "1234"}) == 1.0
    assert r(r"\boxed{7}, not 8", {"answer": "7"}) == 1.0  # a box wins
    assert r("no number at all", {"answer": "3"}) == r.no_answer_reward
    assert last_number("from -5 to 2.5 apples") == "2.5" and last_number("none") is None


def test_extraction():
    assert last_boxed(r"a \boxed{1} b \boxed{\frac{a}{b^{2}}} c") == r"\frac{a}{b^{2}}"
    assert last_boxed(r"\fbox{7}") == "7"
    assert last_boxed(r"$\boxed 5$") == "5"
    assert last_boxed(r"\boxed{\{1, 2\}}") == r"\{1, 2\}"
    assert last_boxed(r"\boxed{1} and \boxed{2") == "1"  # unclosed last box ignored
    assert last_boxed("no box") is None
    assert last_answer_line("x\n**Answer:** $12$.\n") == "12"
    assert last_answer_line("nothing") is None


def test_fast_path_settles_only_what_is_safe():
    assert fast_compare("12", "12.0") is True
    assert fast_compare("-3", "- 3") is True
    assert fast_compare(r"\dfrac{1}{2}", r"\frac{1}{2}") is True
    assert fast_compare("34", "35") is False  # two different integers
    assert fast_compare("0.5", r"\frac12") is None  # math-verify decides
    assert fast_compare("2", "2.0000001") is None  # decimals: math-verify's rounding decides
    assert normalize_answer(r"\left( 1,\, 2 \right).") == "(1,2)"


def test_fast_path_answers_without_a_worker():
    r = MathVerifyReward(verifier=f"{HERE}.failing_verify")
    assert r(r"\boxed{1,000}", {"answer": "1000"}) == 1.0
    assert r(r"\boxed{35}", {"answer": "34"}) == 0.0
    assert r._pool is None and r.stats["fast"] == 2


def test_a_hanging_verifier_times_out_and_its_worker_is_replaced():
    r = MathVerifyReward(verifier=f"{HERE}.sleepy_verify", timeout_s=1.0, workers=1,
                         timeout_reward=-0.5, fast_path=False)
    try:
        # sleepy_verify would return True after its sleep: -0.5 proves the call was cut off
        assert r(r"\boxed{hang}", {"answer": "hang"}) == -0.5
        assert r.stats["timeouts"] == 1 and r._pool.stats["timeouts"] == 1
        # the pool killed the stuck worker; the next call gets a fresh one and a verdict
        assert r(r"\boxed{x+y}", {"answer": "x+y"}) == 1.0
        assert r._pool.stats["started"] == 2
    finally:
        r.close()


def test_a_failing_verifier_scores_the_timeout_reward_and_counts_an_error():
    r = MathVerifyReward(verifier=f"{HERE}.failing_verify", workers=1, timeout_reward=-0.25)
    try:
        assert r(r"\boxed{x}", {"answer": "y"}) == -0.25
        assert r.stats["errors"] == 1
    finally:
        r.close()


def test_calls_from_many_threads(reward):
    cases = [(g, c, e) for g, c, e in TABLE if isinstance(g, str)][:12]
    results, errors = {}, []

    def worker(t: int):
        try:
            for j, (g, c, e) in enumerate(cases):
                results[(t, j)] = reward(c, {"answer": g}) == e
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    calls_before = reward.stats["calls"]
    threads = [threading.Thread(target=worker, args=(t,)) for t in range(6)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    assert len(results) == 6 * len(cases) and all(results.values())
    assert reward.stats["calls"] - calls_before == 6 * len(cases)
    assert reward._pool.stats["started"] <= 2  # never more workers than configured


def test_inline_math_verify_works_off_the_main_thread():
    # math-verify's own timeout raises in a non-main thread; the reward must not pass one there
    out = []
    th = threading.Thread(target=lambda: out.append(math_verify_equal("0.5", r"\frac{1}{2}", 5)))
    th.start()
    th.join()
    assert out == [True]
    r = MathVerifyReward(isolation="inline")
    th = threading.Thread(target=lambda: out.append(r(r"\boxed{1/2}", {"answer": "0.5"})))
    th.start()
    th.join()
    assert out[-1] == 1.0


def test_config_errors_name_the_field():
    for kwargs, field in [({"answer_format": "last"}, "answer_format"),
                          ({"isolation": "thread"}, "isolation"),
                          ({"timeout_s": 0}, "timeout_s"), ({"workers": 0}, "workers")]:
        with pytest.raises(ValueError, match=field):
            MathVerifyReward(**kwargs)


def test_named_by_import_path_from_yaml():
    from astralight.dataflow.config import instantiate_plugin
    from astralight.rewards.base import Reward

    r = instantiate_plugin({"class_path": "astralight.rewards.math.MathVerifyReward",
                            "init_args": {"answer_key": "gt", "timeout_s": 3.0,
                                          "answer_format": "boxed_or_answer_line"}},
                           Reward, "reward")
    assert isinstance(r, MathVerifyReward) and r.answer_key == "gt" and r.timeout_s == 3.0


# ---------------------------------------------------------------- the pool itself

def test_subprocess_pool_results_errors_and_timeouts():
    pool = SubprocessPool(f"{HERE}.add", workers=1, timeout_s=5.0)
    try:
        assert pool.call(2, 3) == 5
        assert pool.call("a", "b") == "ab"
        with pytest.raises(PoolError, match="TypeError"):
            pool.call(1, "b")
        assert pool.stats["started"] == 1  # a raising function keeps its worker
    finally:
        pool.close()
    with pytest.raises(PoolError, match="closed"):
        pool.call(1, 2)

    slow = SubprocessPool(f"{HERE}.sleepy_verify", workers=1, timeout_s=0.5)
    try:
        with pytest.raises(PoolTimeout):
            slow.call("a", "hang")
        assert slow.call("a", "a") is True and slow.stats["started"] == 2
    finally:
        slow.close()


def test_subprocess_pool_bad_function_path():
    pool = SubprocessPool("astralight.rewards.math.no_such_function", workers=1)
    with pytest.raises(PoolError, match="no_such_function"):
        pool.call(1)
    pool.close()
