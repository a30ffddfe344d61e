"""Prompt curators against hand-worked sequences: GRESO (arXiv 2506.02177) streaks, kinds,
submit probabilities max(p ** streak, floor), adaptive p, floors, persistence; FilterSolved."""

from __future__ import annotations

import json

import numpy as np
import pytest

from astralight.dataflow.curators import GRESO, AcceptAll, FilterSolved
from astralight.dataflow.plugins import PromptOutcome
from astralight.tasks.base import Prompt

EASY, HARD, MIXED = [1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0]


class StubRng:
    """random() returns the given values in order; running out (an unexpected draw) fails."""

    def __init__(self, *values: float):
        self.values = list(values)

    def random(self) -> float:
        assert self.values, "unexpected random draw"
        return self.values.pop(0)


def prompt(pid: str) -> Prompt:
    return Prompt(prompt_id=pid, prompt=f"{pid}=")


def outcome(pid: str, rewards, model_id: str = "policy", version: int = 0) -> PromptOutcome:
    groups = rewards if isinstance(rewards, dict) else {model_id: list(rewards)}
    return PromptOutcome(prompt_id=pid, prompt_index=0, version=version, rewards=groups,
                         kept={m: True for m in groups})


def streak(g: GRESO, pid: str):
    return tuple(g.streaks.get(pid, (0, None)))


# -- GRESO: streak and kind ----------------------------------------------------------------------

def test_streak_counts_consecutive_zero_variance_and_kind_follows_the_latest():
    g = GRESO()
    assert streak(g, "a") == (0, None)
    g.update(outcome("a", EASY))
    assert streak(g, "a") == (1, "easy")
    g.update(outcome("a", EASY))
    g.update(outcome("a", HARD))  # still zero-variance: the streak goes on, the kind switches
    assert streak(g, "a") == (3, "hard")
    g.update(outcome("a", MIXED))  # any variance resets
    assert streak(g, "a") == (0, None)
    g.update(outcome("a", HARD))
    assert streak(g, "a") == (1, "hard")
    g.update(outcome("b", [0.7, 0.7]))  # mean 0.7 >= 0.5: easy even though not 1.0
    g.update(outcome("c", [0.5, 0.5]))  # mean == correct_threshold counts as easy
    g.update(outcome("d", [0.2, 0.2 + 5e-7]))  # within zero_variance_eps
    g.update(outcome("e", [0.2, 0.2 + 5e-6]))  # beyond it: has variance
    assert [streak(g, p) for p in "bcde"] == [(1, "easy"), (1, "easy"), (1, "hard"), (0, None)]
    m = g.metrics()
    assert (m["tracked_prompts"], m["easy_streaks"], m["hard_streaks"]) == (4, 2, 2)


def test_multi_policy_none_uses_every_group_and_a_name_only_its_own():
    both, solver = GRESO(), GRESO(model_id="solver")
    seq = [
        {"solver": [1.0, 1.0], "verifier": [0.0, 1.0]},  # verifier has variance
        {"solver": [1.0, 1.0], "verifier": [0.0, 0.0]},  # all zero-var, mean over all 0.5: easy
        {"verifier": [0.0, 0.0]},                         # no solver group: solver-GRESO ignores it
    ]
    both.update(outcome("p", seq[0]))
    solver.update(outcome("p", seq[0]))
    assert streak(both, "p") == (0, None) and streak(solver, "p") == (1, "easy")
    both.update(outcome("p", seq[1]))
    solver.update(outcome("p", seq[1]))
    assert streak(both, "p") == (1, "easy") and streak(solver, "p") == (2, "easy")
    both.update(outcome("p", seq[2]))
    solver.update(outcome("p", seq[2]))
    assert streak(both, "p") == (2, "hard") and streak(solver, "p") == (2, "easy")
    assert both.window["outcomes"] == 3 and solver.window["outcomes"] == 2


# -- GRESO: submit probabilities ------------------------------------------------------------------

@pytest.mark.parametrize("rewards,n,expected", [
    (EASY, 1, 0.5), (EASY, 2, 0.25), (EASY, 3, 0.125), (EASY, 4, 0.0625),
    (EASY, 5, 0.05),  # 0.5**5 = 0.03125 < floor_easy
    (HARD, 1, 0.5), (HARD, 2, 0.30),  # 0.25 < floor_hard
    (HARD, 60, 0.30),
])
def test_submit_probability_is_max_of_p_to_the_streak_and_floor(rewards, n, expected):
    g = GRESO()
    for _ in range(n):
        g.update(outcome("a", rewards))
    assert g.submit_prob("a") == pytest.approx(expected)
    g.rng = StubRng(expected - 1e-9, expected)  # the threshold, exactly: below submits, at it skips
    assert g.should_submit(prompt("a"), 0) is True
    assert g.should_submit(prompt("a"), 0) is False


def test_unseen_or_reset_prompts_are_submitted_without_a_random_draw():
    g = GRESO()
    g.rng = StubRng()  # any draw fails
    assert g.should_submit(prompt("new"), 0) is True
    g.update(outcome("a", EASY))
    g.update(outcome("a", MIXED))
    assert g.should_submit(prompt("a"), 0) is True


# -- GRESO: adaptive p ----------------------------------------------------------------------------

def test_on_version_moves_p_toward_the_targets():
    g = GRESO()  # alpha_easy 0.083, alpha_hard 0.167, delta_p 0.01
    for i, r in enumerate([EASY, EASY, HARD] + [MIXED] * 7):
        g.update(outcome(f"p{i}", r))
    g.on_version(1)  # easy 2/10 = 0.2 > 0.083: lower p_easy; hard 0.1 <= 0.167: raise p_hard
    m = g.metrics()
    assert m["p_easy"] == pytest.approx(0.49) and m["p_hard"] == pytest.approx(0.51)
    assert m["easy_zero_variance_ratio"] == pytest.approx(0.2)
    assert m["hard_zero_variance_ratio"] == pytest.approx(0.1)
    g.on_version(2)  # no outcomes since: no evidence, no move
    assert (g.p["easy"], g.p["hard"]) == pytest.approx((0.49, 0.51))
    for i in range(5):
        g.update(outcome(f"q{i}", MIXED))
    g.on_version(3)  # both ratios 0 <= targets: both rise
    assert (g.p["easy"], g.p["hard"]) == pytest.approx((0.50, 0.52))
    assert g.metrics()["easy_zero_variance_ratio"] == 0.0


def test_ratio_equal_to_target_raises_p():
    g = GRESO(alpha_easy=0.25, alpha_hard=0.25, delta_p=0.1)
    for i, r in enumerate([EASY, HARD, MIXED, MIXED]):
        g.update(outcome(f"p{i}", r))
    g.on_version(1)
    assert (g.p["easy"], g.p["hard"]) == pytest.approx((0.6, 0.6))


def test_p_is_clamped_to_floor_and_one():
    g = GRESO(p_easy=0.06, p_hard=0.995, floor_easy=0.05, delta_p=0.02)
    for v in range(1, 4):
        g.update(outcome(f"p{v}", EASY))  # every outcome easy-zero-variance, none hard
        g.on_version(v)
        assert g.p["easy"] == pytest.approx(0.05) and g.p["hard"] == 1.0
    g0 = GRESO(floor_easy=0.0, p_easy=0.01, delta_p=0.5)
    g0.update(outcome("a", EASY))
    g0.on_version(1)
    assert g0.p["easy"] == 0.0  # a zero floor is allowed and clamps at 0, never below


def test_fully_rejected_stream_still_submits_at_the_floor_rate():
    g = GRESO()
    g.rng = np.random.default_rng(1234)
    for _ in range(1000):
        g.update(outcome("easy", EASY))
        g.update(outcome("hard", HARD))
    assert g.submit_prob("easy") == 0.05 and g.submit_prob("hard") == 0.30
    n = 20000
    easy = sum(g.should_submit(prompt("easy"), 0) for _ in range(n)) / n
    hard = sum(g.should_submit(prompt("hard"), 0) for _ in range(n)) / n
    assert 0.04 < easy < 0.06 and 0.28 < hard < 0.32


def test_all_solved_stream_keeps_moving_alone():
    """Every prompt always all-correct: p_easy sinks to its floor, yet prompts keep flowing."""
    g = GRESO()
    g.rng = np.random.default_rng(5)
    per_version = []
    for v in range(1, 101):
        sent = [p for p in range(50) if g.should_submit(prompt(f"p{p}"), v)]
        for p in sent:
            g.update(outcome(f"p{p}", EASY))
        g.on_version(v)
        per_version.append(len(sent))
    assert per_version[0] == 50  # nothing known yet
    assert g.p["easy"] == pytest.approx(0.05)
    late = sum(per_version[-50:]) / 50  # ~ 50 prompts * floor 0.05 = 2.5 per version
    assert 1.5 < late < 3.5


# -- GRESO: determinism and persistence ------------------------------------------------------------

def drive(g: GRESO, steps: range) -> list[bool]:
    """A fixed workload: prompt i%7 is easy if i%3==0, hard if i%3==1, mixed otherwise."""
    decisions = []
    for i in steps:
        pid = f"p{i % 7}"
        ok = g.should_submit(prompt(pid), i // 10)
        decisions.append(ok)
        if ok:
            g.update(outcome(pid, [EASY, HARD, MIXED][(i * 5 + i // 7) % 3]))
        if i % 10 == 9:
            g.on_version(i // 10 + 1)
    return decisions


def test_seeded_instances_decide_identically():
    a, b = GRESO(), GRESO()
    a.rng, b.rng = np.random.default_rng(7), np.random.default_rng(7)
    da, db = drive(a, range(300)), drive(b, range(300))
    assert da == db and not all(da)  # something was skipped, so the rng mattered
    assert a.state_dict() == b.state_dict()


def test_state_round_trip_continues_identically():
    a = GRESO()
    a.rng = np.random.default_rng(11)
    drive(a, range(155))  # stop mid-window, with live streaks
    state = json.loads(json.dumps(a.state_dict()))  # JSON-able, string keys
    rng_state = json.loads(json.dumps(a.rng.bit_generator.state))
    assert state["window"]["outcomes"] > 0 and state["streaks"]

    b = GRESO()
    b.load_state_dict(state)
    b.rng = np.random.default_rng()
    b.rng.bit_generator.state = rng_state
    assert b.state_dict() == a.state_dict() and b.metrics() == a.metrics()
    da, db = drive(a, range(155, 400)), drive(b, range(155, 400))
    assert da == db and not all(da)
    assert b.state_dict() == a.state_dict()


@pytest.mark.parametrize("kwargs,field", [
    ({"p_easy": 0.0}, "p_easy"), ({"p_hard": 1.5}, "p_hard"),
    ({"p_easy": 0.04, "floor_easy": 0.05}, "p_easy"), ({"p_hard": 0.2}, "p_hard"),
    ({"alpha_easy": -0.1}, "alpha_easy"), ({"alpha_hard": 2}, "alpha_hard"),
    ({"delta_p": -0.01}, "delta_p"), ({"floor_easy": 1.1}, "floor_easy"),
    ({"floor_hard": -1}, "floor_hard"), ({"correct_threshold": float("nan")}, "correct_threshold"),
    ({"zero_variance_eps": -1e-9}, "zero_variance_eps"), ({"model_id": ""}, "model_id"),
    ({"p_easy": "0.5"}, "p_easy"),
])
def test_greso_rejects_bad_args_naming_them(kwargs, field):
    with pytest.raises(ValueError, match=field):
        GRESO(**kwargs)


# -- FilterSolved and AcceptAll --------------------------------------------------------------

def test_filter_solved_ewma_and_threshold():
    f = FilterSolved(threshold=0.9, ewma_alpha=0.5)
    f.rng = StubRng()  # revisit_prob 0: never draws
    assert f.should_submit(prompt("a"), 0)
    f.update(outcome("a", [1.0, 1.0, 1.0, 0.0]))  # first outcome sets it: 0.75
    assert f.ewma["a"] == pytest.approx(0.75) and f.should_submit(prompt("a"), 0)
    f.update(outcome("a", EASY))  # 0.5*1 + 0.5*0.75
    assert f.ewma["a"] == pytest.approx(0.875) and f.should_submit(prompt("a"), 0)
    f.update(outcome("a", EASY))
    assert f.ewma["a"] == pytest.approx(0.9375) and not f.should_submit(prompt("a"), 0)
    f.update(outcome("a", HARD))  # forgetting brings it back
    assert f.ewma["a"] == pytest.approx(0.46875) and f.should_submit(prompt("a"), 0)
    assert f.metrics() == {"tracked_prompts": 1.0, "solved_prompts": 0.0}


def test_filter_solved_revisits_with_probability():
    f = FilterSolved(revisit_prob=0.2)
    f.update(outcome("a", EASY))
    f.rng = StubRng(0.2 - 1e-9, 0.2)
    assert f.should_submit(prompt("a"), 0) is True
    assert f.should_submit(prompt("a"), 0) is False
    f.rng = np.random.default_rng(3)
    rate = sum(f.should_submit(prompt("a"), 0) for _ in range(10000)) / 10000
    assert 0.18 < rate < 0.22


def test_filter_solved_model_id_and_state_round_trip():
    f = FilterSolved(model_id="solver", correct_threshold=0.8)
    f.update(outcome("a", {"verifier": [1.0, 1.0]}))  # not ours: ignored
    assert f.ewma == {}
    f.update(outcome("a", {"solver": [0.9, 0.7], "verifier": [0.0, 0.0]}))
    assert f.ewma == {"a": 0.5}
    g = FilterSolved(model_id="solver", correct_threshold=0.8)
    g.load_state_dict(json.loads(json.dumps(f.state_dict())))
    assert g.ewma == f.ewma and g.metrics() == f.metrics()


@pytest.mark.parametrize("kwargs,field", [
    ({"threshold": 0.0}, "threshold"), ({"ewma_alpha": 1.5}, "ewma_alpha"),
    ({"revisit_prob": -0.1}, "revisit_prob"), ({"model_id": 3}, "model_id"),
])
def test_filter_solved_rejects_bad_args(kwargs, field):
    with pytest.raises(ValueError, match=field):
        FilterSolved(**kwargs)


def test_accept_all_accepts_everything_and_has_no_state():
    a = AcceptAll()
    a.update(outcome("a", EASY))
    a.on_version(1)
    assert all(a.should_submit(prompt(f"p{i}"), 0) for i in range(10))
    assert a.state_dict() == {} and a.metrics() == {}
