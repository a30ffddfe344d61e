"""The autoscaler's policy on hand-made reports and a fake clock: bounds, cooldown, retirement order,
and the service loop over a fake dataflow client and a fake backend."""

from __future__ import annotations

import io
import json

import pytest

from astralight.autoscale.policy import (Decision, Member, Policy, PolicyConfig, pool_members,
                                         report_target, retirement_order)
from astralight.autoscale.service import AutoscaleConfig, Autoscaler
from tests.fakes import FakeAutoscaleDataflow as FakeDataflow
from tests.unit.autoscale_fakes import Clock, FakeBackend


def report(action, pool, target, w=0.0, consumed=100, accepted=100, versions=(0, 9)):
    return {"versions": list(versions), "wait_fraction": w, "consumed": consumed,
            "accepted": accepted,
            "decision": {"action": action, "pool": pool, "target": target, "reason": f"r-{action}"}}


def members(n, managed=True):
    return [Member(f"auto-{i}", managed, "healthy", samples_per_s=10.0 + i, since=100.0 + i)
            for i in range(n)]


# ---------------------------------------------------------------------- config


@pytest.mark.parametrize("kwargs, field", [
    ({"min_instances": -1}, "min_instances"),
    ({"min_instances": 3, "max_instances": 2}, "max_instances"),
    ({"min_instances": 0, "max_instances": 0}, "max_instances"),
    ({"max_instances": 2.5}, "max_instances"),
    ({"cooldown_s": -1}, "cooldown_s"),
    ({"replace_backoff_s": "x"}, "replace_backoff_s"),
])
def test_bad_config_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        PolicyConfig(**kwargs)


# ---------------------------------------------------------------------- target and bounds


def test_follows_the_report_target_and_starts_a_cooldown():
    policy = Policy(PolicyConfig(min_instances=1, max_instances=8, cooldown_s=60))
    d = policy.decide(report("scale_up", 2, 4, w=0.5), members(2), now=1000.0)
    assert (d.action, d.pool, d.target, d.launch, d.retire) == ("scale_up", 2, 4, 2, [])
    assert d.report["action"] == "scale_up" and d.report["target"] == 4
    assert policy.cooldown_left(1000.0) == 60.0


def test_target_clamped_to_max_and_min():
    policy = Policy(PolicyConfig(min_instances=2, max_instances=3, cooldown_s=0))
    up = policy.decide(report("scale_up", 2, 10, w=0.8), members(2), now=0.0)
    assert up.target == 3 and up.launch == 1
    assert "clamped to max_instances 3" in up.reason
    down = policy.decide(report("scale_down", 3, 1), members(3), now=1.0)
    assert down.target == 2 and len(down.retire) == 1
    assert "clamped to min_instances 2" in down.reason


def test_at_a_bound_the_decision_is_hold():
    policy = Policy(PolicyConfig(min_instances=1, max_instances=3, cooldown_s=0))
    d = policy.decide(report("scale_up", 3, 5, w=0.5), members(3), now=0.0)
    assert d.action == "hold" and d.target == 3 and d.launch == 0
    assert policy.last_action is None  # a hold is no action: no cooldown


def test_report_hold_is_hold():
    policy = Policy(PolicyConfig(min_instances=1, max_instances=4))
    d = policy.decide(report("hold", 2, 2, w=0.07), members(2), now=0.0)
    assert d.action == "hold" and d.reason == "r-hold"


def test_report_for_another_pool_size_is_recomputed_for_this_pool():
    # the report was computed for a pool of 1, the autoscaler counts 4: ceil(4 / (1 - 0.5)) = 8
    target, action, reason = report_target(report("scale_up", 1, 2, w=0.5), pool=4)
    assert (target, action) == (8, "scale_up") and "pool 4" in reason
    # scale down: min(G, ceil(G * consumed / accepted * 1.1)) = ceil(4 * 0.25 * 1.1) = 2
    target, action, _ = report_target(report("hold", 1, 1, w=0.0, consumed=25, accepted=100), pool=4)
    assert (target, action) == (2, "scale_down")


# ---------------------------------------------------------------------- cooldown


def test_no_action_inside_the_cooldown_and_the_line_says_so():
    policy = Policy(PolicyConfig(min_instances=1, max_instances=8, cooldown_s=60))
    assert policy.decide(report("scale_up", 2, 3, w=0.4), members(2), now=0.0).action == "scale_up"
    held = policy.decide(report("scale_up", 3, 5, w=0.4), members(3), now=45.0)
    assert held.action == "hold" and held.launch == 0 and held.retire == []
    assert "cooldown: 15s left of 60s" in held.reason and "scale_up 5" in held.reason
    assert "cooldown" in held.line()
    # the cooldown is not extended by a held decision; after it, the report is followed again
    again = policy.decide(report("scale_up", 3, 5, w=0.4), members(3), now=60.0)
    assert again.action == "scale_up" and again.launch == 2


def test_cooldown_does_not_block_bringing_the_pool_inside_its_bounds():
    policy = Policy(PolicyConfig(min_instances=2, max_instances=4, cooldown_s=600,
                                 replace_backoff_s=10))
    policy.acted(0.0)
    d = policy.bounds(members(1), now=5.0)  # one of two died
    assert d.action == "replace" and d.launch == 1 and d.target == 2
    # a crash loop is not chased on every poll
    assert policy.bounds(members(1), now=10.0) is None
    assert policy.bounds(members(1), now=15.5).action == "replace"
    assert policy.bounds(members(2), now=100.0) is None  # inside the bounds: nothing


def test_bounds_trim_a_pool_above_max_by_the_retirement_order():
    policy = Policy(PolicyConfig(min_instances=1, max_instances=2))
    d = policy.bounds(members(3), now=0.0)
    assert d.action == "scale_down" and d.retire == ["auto-0"] and d.target == 2


# ---------------------------------------------------------------------- retirement order


def test_retirement_order_suspect_and_gone_first_then_least_productive_ties_newest():
    pool = [
        Member("fast", True, "healthy", samples_per_s=50.0, since=1.0),
        Member("slow-old", True, "healthy", samples_per_s=5.0, since=1.0),
        Member("slow-new", True, "healthy", samples_per_s=5.0, since=9.0),
        Member("suspect", True, "suspect", samples_per_s=80.0, since=2.0),
        Member("gone", True, "gone", samples_per_s=90.0, since=3.0),
        Member("starting", True, "starting", samples_per_s=0.0, since=10.0),
        Member("theirs", False, "healthy", samples_per_s=0.0, since=0.0),
    ]
    order = [m.instance_id for m in retirement_order(pool)]
    assert order == ["gone", "suspect", "starting", "slow-new", "slow-old", "fast"]
    assert "theirs" not in order  # not started by this autoscaler
    assert [m.instance_id for m in retirement_order(pool, retire_unmanaged=True)][2] == "starting"
    assert "theirs" in [m.instance_id for m in retirement_order(pool, retire_unmanaged=True)]


def test_scale_down_retires_by_the_order_and_only_managed():
    policy = Policy(PolicyConfig(min_instances=1, max_instances=8, cooldown_s=0))
    pool = [Member("a", True, "healthy", 30.0, 1.0), Member("b", True, "healthy", 3.0, 2.0),
            Member("c", True, "suspect", 40.0, 3.0), Member("x", False, "healthy", 1.0, 4.0)]
    d = policy.decide(report("scale_down", 4, 2), pool, now=0.0)
    assert d.action == "scale_down" and d.retire == ["c", "b"] and d.target == 2
    # nothing retirable: hold, saying why
    only_theirs = [Member("x", False, "healthy", 1.0, 4.0), Member("y", False, "healthy", 1.0, 4.0)]
    d = policy.decide(report("scale_down", 2, 1), only_theirs, now=1.0)
    assert d.action == "hold" and "retire_unmanaged" in d.reason


def test_pool_members_from_the_instance_table():
    table = [
        {"instance_id": "auto-0", "model_ids": ["policy"], "status": "healthy", "state": "active",
         "samples_per_s": 12.0, "registered_at": 50.0},
        {"instance_id": "auto-1", "model_ids": ["policy"], "status": "draining", "state": "draining"},
        {"instance_id": "other", "model_ids": ["policy"], "status": "suspect", "state": "active",
         "samples_pushed": 30, "alive_s": 10.0, "registered_at": 5.0},
        {"instance_id": "dead", "model_ids": ["policy"], "status": "gone"},
        {"instance_id": "left", "model_ids": ["policy"], "status": "left", "state": "left"},
        {"instance_id": "verifier-only", "model_ids": ["verifier"], "status": "healthy"},
    ]
    got = {m.instance_id: m for m in pool_members(table, {"auto-0": 40.0, "auto-1": 41.0,
                                                           "auto-2": 42.0}, "policy")}
    assert set(got) == {"auto-0", "auto-2", "other"}
    assert got["auto-0"].managed and got["auto-0"].samples_per_s == 12.0 and got["auto-0"].since == 50.0
    assert got["auto-2"].status == "starting" and got["auto-2"].since == 42.0
    assert not got["other"].managed and got["other"].samples_per_s == 3.0  # 30 / 10 s


# ---------------------------------------------------------------------- the loop, with fakes


def make_scaler(tmp_path, **policy_kw):
    backend, flow, clock = FakeBackend(), FakeDataflow(), Clock()
    cfg = PolicyConfig(**{"min_instances": 1, "max_instances": 3, "cooldown_s": 30, **policy_kw})
    scaler = Autoscaler(Policy(cfg), backend, flow,
                        AutoscaleConfig(every=5, initial=1, decisions_log=str(tmp_path / "d.jsonl")),
                        clock=clock, wall=lambda: 1000.0 + clock.t, out=io.StringIO(),
                        sleep=clock.sleep)
    return scaler, backend, flow, clock


def test_loop_reports_every_k_versions_acts_and_logs(tmp_path):
    scaler, backend, flow, clock = make_scaler(tmp_path)
    scaler.start()
    assert backend.calls == [("launch", "auto-0", 1)]
    flow.rows["auto-0"] = {"instance_id": "auto-0", "model_ids": ["policy"], "status": "healthy",
                           "samples_per_s": 5.0, "registered_at": 1001.0}
    flow.version = 4
    assert scaler.step() is None and flow.balance_calls == []  # no report before version 5
    clock.t = 40.0
    flow.version = 5
    flow.next_report = report("scale_up", 1, 3, w=0.6, versions=(0, 4))
    d = scaler.step()
    assert d.action == "scale_up" and flow.balance_calls == [("policy", 5, 1)]
    assert [c for c in backend.calls if c[0] == "launch"][1:] == [("launch", "auto-1", 3),
                                                                  ("launch", "auto-2", 3)]
    flow.version = 7
    assert scaler.step() is None  # next report at 10
    clock.t = 50.0  # inside the cooldown
    flow.version = 10
    flow.next_report = report("scale_down", 3, 1, versions=(5, 9))
    assert scaler.step().action == "hold"
    clock.t = 80.0
    flow.version = 15
    flow.next_report = report("scale_down", 3, 2, versions=(10, 14))
    d = scaler.step()
    # auto-1 and auto-2 never registered (starting, 0 samples/s): newest retired first
    assert d.action == "scale_down" and d.retire == ["auto-2"]
    assert ("retire", "auto-2", 2) in backend.calls
    lines = scaler.out.getvalue().splitlines()
    assert any("cooldown" in line for line in lines)
    logged = [json.loads(x) for x in (tmp_path / "d.jsonl").read_text().splitlines()]
    assert [e["action"] for e in logged] == ["initial", "scale_up", "hold", "scale_down"]
    assert logged[1]["launched"] == ["auto-1", "auto-2"] and logged[1]["version"] == 5
    scaler.shutdown()
    assert {c[1] for c in backend.calls if c[0] == "retire"} == {"auto-0", "auto-1", "auto-2"}
    assert backend.calls[-1] == ("close",)
    assert json.loads((tmp_path / "d.jsonl").read_text().splitlines()[-1])["action"] == "shutdown"


def test_loop_replaces_a_died_instance_up_to_min(tmp_path):
    scaler, backend, flow, clock = make_scaler(tmp_path, min_instances=2)
    scaler.start()
    assert sorted(backend.running) == ["auto-0", "auto-1"]
    backend.running.discard("auto-0")  # it crashed
    clock.t = 1.0
    scaler.step()
    kinds = [e["action"] for e in scaler.decisions]
    assert kinds == ["initial", "died", "replace"]
    assert scaler.decisions[1]["instance_id"] == "auto-0" and scaler.decisions[1]["exit_code"] == -9
    assert scaler.decisions[2]["launched"] == ["auto-2"]
    assert sorted(backend.running) == ["auto-1", "auto-2"]


def test_instance_numbering_continues_after_a_restart(tmp_path):
    scaler, backend, *_ = make_scaler(tmp_path)
    scaler.start()
    scaler.shutdown()
    again, backend2, *_ = make_scaler(tmp_path)
    again.start()
    assert backend2.calls[0] == ("launch", "auto-1", 1)


def test_decision_line_names_versions_wait_and_instances():
    d = Decision("scale_down", 3, 2, retire=["auto-4"], reason="why",
                 report={"versions": [10, 19], "wait_fraction": 0.02})
    assert d.line() == "versions 10..19: wait 2.0%, pool 3 -> 2: scale_down -1 (auto-4): why"
