"""The run guard (issue 37, item 3) on replayed curves: the tool-use run that collapsed (eval 0.57
-> 0.00, reward 0.8 -> 0, responses 14 -> 114 tokens, malformed calls rising) is caught, each
kind once; the healthy runs of the same table are not; its settings name the key and the fix."""

from __future__ import annotations

import pytest

from astralight.launch.guard import (GUARD_DEFAULTS, GuardError, RunGuard, TrainCurves,
                                     eval_drop_event, guard_settings, train_events)

#: issue 37's table: eval avg@4 at versions 0, 10, ..., 60
COLLAPSED = [0.16, 0.54, 0.57, 0.44, 0.42, 0.06, 0.00]
HEALTHY = ([0.18, 0.56, 0.57, 0.59, 0.59, 0.59, 0.58], [0.17, 0.54, 0.59, 0.56, 0.58, 0.57, 0.58])


def table(curve: list[float], until: int | None = None) -> dict[int, dict]:
    return {10 * i: {"complete": True, "avg_at_k": a} for i, a in enumerate(curve[:until])}


def collapsing_steps(n: int = 60) -> list[dict[str, float]]:
    """Per-step train scalars of the collapse: the reward rises to 0.8 by step 30, then falls
    to 0; responses grow from 14 to 114 tokens; malformed calls rise from 10% to 80%."""
    rows = []
    for step in range(n):
        up = min(1.0, step / 30)
        down = max(0.0, (step - 30) / 20) if step > 30 else 0.0
        rows.append({"train/reward_mean": 0.8 * up * (1 - min(1.0, down)),
                     "train/response_tokens_mean": 14 + 100 * min(1.0, down),
                     "train/entropy": 0.6 * (1 - 0.95 * min(1.0, step / 50)),
                     "agent/tool_calls": 1.0,
                     "agent/tool_errors/malformed": 0.1 + 0.7 * min(1.0, down)})
    return rows


def series(rows: list[dict[str, float]]) -> dict[str, list[float]]:
    return {tag: [r[tag] for r in rows] for tag in rows[0]}


def test_the_collapsed_eval_is_caught_and_the_healthy_ones_are_not():
    for healthy in HEALTHY:
        for until in range(2, 8):
            assert eval_drop_event(table(healthy, until), 0.25, "policy", 0.0) is None
    # 0.44 at v30 is 0.13 below the best 0.57 (within 25% of it); 0.42 at v40 is not
    assert eval_drop_event(table(COLLAPSED, 4), 0.25, "policy", 0.0) is None
    event = eval_drop_event(table(COLLAPSED, 5), 0.25, "policy", 12.5)
    assert (event.kind, event.version, event.value, event.threshold) == (
        "eval_drop", 40, 0.42, round(0.57 * 0.75, 4))
    assert "fell to 0.420 at v40 from its best 0.570 at v20" in event.message
    # a drop under MIN_EVAL_GAP is noise, whatever its share of a small best
    assert eval_drop_event(table([0.02, 0.08, 0.04]), 0.25, "policy", 0.0) is None


def test_the_collapsed_train_curves_are_caught():
    settings = {**GUARD_DEFAULTS, "entropy_floor": 0.05}
    rows = collapsing_steps()
    assert train_events(series(rows[:30]), settings, "policy", 30, 0.0) == []
    kinds = {e.kind: e for e in train_events(series(rows), settings, "policy", 60, 99.0)}
    assert set(kinds) == {"reward_drop", "length_factor", "malformed_rate", "entropy_floor"}
    assert kinds["length_factor"].value == pytest.approx(114.0)
    assert kinds["malformed_rate"].value == pytest.approx(0.8)
    assert "train reward fell to 0.000" in kinds["reward_drop"].message
    # the entropy floor is off by default: a sharpened healthy policy is as low
    assert "entropy_floor" not in {e.kind for e in train_events(series(rows), GUARD_DEFAULTS,
                                                                 "policy", 60, 0.0)}


def test_a_noisy_healthy_reward_is_not_a_drop():
    # per-batch reward of a healthy run on the structured task: 0.24-0.75 from step to step
    noisy = [0.5 + 0.25 * (-1) ** i * (i % 3) / 2 for i in range(200)]
    assert train_events({"train/reward_mean": noisy}, GUARD_DEFAULTS, "policy", 200, 0.0) == []


def test_the_guard_reads_tensorboard_as_it_grows_and_reports_each_kind_once(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    run_dir = tmp_path / "run"
    writer = SummaryWriter(str(run_dir / "tensorboard" / "policy" / "version_0"))
    rows = collapsing_steps()
    guard = RunGuard({**GUARD_DEFAULTS, "stop": True}, TrainCurves(run_dir).read)
    for step, row in enumerate(rows[:30]):
        for tag, value in row.items():
            writer.add_scalar(tag, value, step)
    writer.flush()
    assert guard.look(10.0, 30, {"policy": table(COLLAPSED, 3)}) == []
    assert not guard.stop_requested and guard.progress_text() == ""
    for step, row in enumerate(rows[30:], start=30):
        for tag, value in row.items():
            writer.add_scalar(tag, value, step)
    writer.close()
    events = guard.look(20.0, 60, {"policy": table(COLLAPSED)})
    assert {e.kind for e in events} == {"eval_drop", "reward_drop", "length_factor",
                                        "malformed_rate"}
    assert guard.stop_requested
    assert guard.progress_text().startswith(" | guard: ")
    assert guard.look(30.0, 60, {"policy": table(COLLAPSED)}) == []  # once per kind
    assert len(guard.events) == 4
    assert set(guard.events[0].as_dict()) == {"kind", "source", "version", "at_s", "value",
                                              "threshold", "message"}


def test_off_means_off():
    guard = RunGuard(guard_settings(False))
    assert guard.look(1.0, 60, {"policy": table(COLLAPSED)}) == [] and not guard.stop_requested
    warn_only = RunGuard(guard_settings({"eval_drop": 0.25}))
    assert warn_only.look(1.0, 60, {"policy": table(COLLAPSED)}) and not warn_only.stop_requested


@pytest.mark.parametrize("spec, message", [
    ({"eval_drops": 0.2}, "recipe.guard.eval_drops: unknown key"),
    ({"eval_drop": 1.5}, "recipe.guard.eval_drop: a share in (0, 1]"),
    ({"length_factor": 1}, "recipe.guard.length_factor: a factor > 1"),
    ({"entropy_floor": 0}, "recipe.guard.entropy_floor: nats per token > 0"),
    ({"window": 0}, "recipe.guard.window: train steps, an int >= 1"),
    ({"stop": "yes"}, "recipe.guard.stop: true or false"),
    ([1], "recipe.guard: expected a mapping"),
])
def test_bad_settings_name_the_key(spec, message):
    with pytest.raises(GuardError, match=message.replace("(", r"\(").replace(")", r"\)")
                       .replace("[", r"\[").replace("]", r"\]")):
        guard_settings(spec)
    assert guard_settings(None) == GUARD_DEFAULTS
    assert guard_settings({"eval_drop": None})["eval_drop"] is None
