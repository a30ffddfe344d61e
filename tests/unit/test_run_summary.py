"""The end of a run: the full record in ``summary.json`` and one short line of it printed last
(it used to print the whole record, ~65 KB for the toy run)."""

from __future__ import annotations

import json

from astralight.launch.summary import build_summary, short_line, short_summary, write_summary


def full_summary(tmp_path) -> dict:
    evals = {v: {"complete": True, "avg_at_k": 0.2 + v / 200, "pass_at_k": 0.5}
             for v in range(0, 151, 10)}
    per_version = {str(v): {"rollouts_generated": 256, "samples_trained": 256} for v in range(151)}
    stats = {"models": {"policy": {"current_version": 150, "samples_trained": 38400}}}
    summary = build_summary(stats, evals, per_version, "policy", final_version=150)
    summary.update(trainer_wait_fraction=0.63, wall_s_to_085=61.7, wall_s=200.04,
                   stop_reason="versions", run_dir=str(tmp_path / "run"), restarts={},
                   balance={"instances": [{"instance_id": f"raas-{i}"} for i in range(8)]})
    return summary


def test_the_short_line_holds_the_headline_numbers_and_where_the_rest_is(tmp_path):
    summary = full_summary(tmp_path)
    line = short_line(summary)
    assert len(json.dumps(summary)) > 10_000 and len(line) < 500
    short = json.loads(line)
    assert short == {"eval_accuracy_start": 0.2, "eval_accuracy_end": 0.95, "eval_version_end": 150,
                     "eval_accuracy_best": 0.95, "eval_version_best": 150, "versions": 150, "samples_trained": 38400, "wall_s": 200.04,
                     "trainer_wait_fraction": 0.63, "wall_s_to_085": 61.7,
                     "stop_reason": "versions", "run_dir": str(tmp_path / "run"),
                     "summary": str(tmp_path / "run" / "summary.json")}


def test_a_multi_policy_run_shows_each_end_accuracy(tmp_path):
    summary = full_summary(tmp_path)
    summary["policies"] = {"solver": {"eval_accuracy_end": 0.612345, "team_accuracy_end": 0.7,
                                      "eval_versions": [0, 10, 20], "version_end": 20},
                           "verifier": {"eval_versions": []}}
    short = short_summary(summary)
    assert short["policies"] == {"solver": {"eval_accuracy_end": 0.6123, "team_accuracy_end": 0.7,
                                            "version_end": 20}, "verifier": {}}


def test_the_end_accuracy_is_the_last_versions_or_none(tmp_path):
    evals = {0: {"complete": True, "avg_at_k": 0.25}, 30: {"complete": True, "avg_at_k": 0.5},
             37: {"complete": False, "avg_at_k": 0.0}}
    out = build_summary({"models": {}}, evals, None, "policy", final_version=37)
    assert out["eval_accuracy_end"] is None and out["eval_version_end"] is None  # not v30's
    evals[37].update(complete=True, avg_at_k=0.75)
    out = build_summary({"models": {}}, evals, None, "policy", final_version=37)
    assert (out["eval_accuracy_end"], out["eval_version_end"]) == (0.75, 37)


def test_summary_json_is_the_full_record(tmp_path):
    summary = full_summary(tmp_path)
    path = write_summary(tmp_path, summary)
    assert path == tmp_path / "summary.json"
    assert json.loads(path.read_text())["per_version"] == summary["per_version"]


def test_a_collapsed_run_says_so_in_its_last_line(tmp_path):
    """The tool-use run that rose to 0.57 and fell to 0.00 (issue 37): the last line carries the
    best evaluation next to the last, the tool-call rates and the guard's warnings."""
    curve = {0: 0.16, 10: 0.54, 20: 0.57, 30: 0.44, 40: 0.42, 50: 0.06, 60: 0.0}
    evals = {v: {"complete": True, "avg_at_k": a, "tool_call_rate": 0.9 - v / 100}
             for v, a in curve.items()}
    summary = build_summary({"models": {"policy": {"current_version": 60}}}, evals, None,
                            "policy", final_version=60)
    summary.update(stop_reason="versions", warnings=["eval_drop (policy)"])
    short = short_summary(summary)
    assert (short["eval_accuracy_end"], short["eval_accuracy_best"],
            short["eval_version_best"]) == (0.0, 0.57, 20)
    assert (short["tool_call_rate_start"], short["tool_call_rate_end"]) == (0.9, 0.3)
    assert short["warnings"] == ["eval_drop (policy)"]


def test_an_agent_workflows_failed_episodes_are_in_the_summary_by_kind():
    from astralight.launch.summary import build_summary

    plain = build_summary({"models": {"policy": {"current_version": 3}}}, {}, None, "policy", 3)
    assert "agents_failed" not in plain  # no agent workflow, no key
    stats = {"models": {"policy": {"current_version": 3, "agent_episodes": 64,
                                   "agent_failed_error": 5}}}
    out = build_summary(stats, {}, None, "policy", 3)
    assert out["agents_failed"] == {"error": 5, "timeout": 0}
