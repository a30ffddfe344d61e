"""``stop:``: its keys checked, ``stop.versions`` and ``trainer.max_steps`` derived from each other,
the stop conditions, and the stop sequence every stop goes through (fake trainers, a fake clock,
a fake eval request: no processes)."""

from __future__ import annotations

import copy
import signal

import pytest

from astralight.launch.stop import (MAX_WALL, TARGET_ACCURACY, TIMEOUT, TRAINER_GRACE_S,
                                 TRAINERS_FINISHED, VERSIONS, StopConditions, StopError,
                                 StopSequence, max_time_seconds, resolve_versions, stop_settings,
                                 trainer_max_time_s)


def recipe(versions=None, max_steps=None, every=1, publisher=True, model_id="policy") -> dict:
    callbacks = [{"class_path": "astralight.callbacks.WeightPublisher",
                  "init_args": {"every_n_steps": every}}] if publisher else []
    trainer = {"callbacks": callbacks}
    if max_steps is not None:
        trainer["max_steps"] = max_steps
    stop = {"model_id": "policy"} if versions is None else {"model_id": "policy",
                                                            "versions": versions}
    return {"stop": stop, "trainers": [{"trainer": trainer,
                                        "model": {"init_args": {"model_id": model_id}}}]}


# ---------------------------------------------------------------------- versions <-> max_steps


def test_versions_are_derived_from_max_steps_and_back():
    out = resolve_versions(recipe(max_steps=40, every=2))
    assert out["stop"]["versions"] == 20
    out = resolve_versions(recipe(versions=30, every=2))
    assert out["trainers"][0]["trainer"]["max_steps"] == 60
    same = recipe(versions=30, max_steps=60, every=2)
    assert resolve_versions(same) == same  # in step already
    assert resolve_versions(recipe(versions=7, max_steps=-1))["trainers"][0]["trainer"][
        "max_steps"] == 7  # -1 is Lightning's "no limit": derived too


def test_the_input_recipe_is_not_changed():
    r = recipe(versions=5)
    before = copy.deepcopy(r)
    resolve_versions(r)
    assert r == before


def test_a_contradiction_names_both_keys_and_the_fix():
    with pytest.raises(StopError) as info:
        resolve_versions(recipe(versions=150, max_steps=100))
    msg = str(info.value)
    assert "recipe.stop.versions (150)" in msg and "recipe.trainers[0].trainer.max_steps (100)" in msg
    assert "set only one of them" in msg and "max_steps = 150" in msg


def test_max_steps_that_would_leave_steps_unpublished_is_refused():
    with pytest.raises(StopError, match=r"trainers\[0\].trainer.max_steps: 7 is not a multiple"):
        resolve_versions(recipe(max_steps=7, every=2))


def test_neither_set_names_both_keys():
    with pytest.raises(StopError, match=r"recipe.stop.versions: not set.*trainer.max_steps neither"):
        resolve_versions(recipe())
    with pytest.raises(StopError, match="no WeightPublisher"):
        resolve_versions(recipe(max_steps=10, publisher=False))
    with pytest.raises(StopError, match="no trainer trains stop.model_id 'policy'"):
        resolve_versions(recipe(max_steps=10, model_id="solver"))
    assert resolve_versions(recipe(versions=3, publisher=False))["stop"]["versions"] == 3


def test_a_time_budget_alone_makes_a_time_only_run():
    r = recipe()
    r["stop"]["max_wall_s"] = 600
    r["trainers"].append({"trainer": {"callbacks": [
        {"class_path": "astralight.callbacks.WeightPublisher", "init_args": {"every_n_steps": 3}}]},
        "model": {"init_args": {"model_id": "verifier"}}})
    out = resolve_versions(r)
    assert out["stop"]["versions"] is None  # no placeholder count
    assert all("max_steps" not in t["trainer"] for t in out["trainers"])  # the budget ends them
    settings = stop_settings(out["stop"], trainer_max_time_s(out))
    assert settings["versions"] is None and settings["trainer_max_time_s"] is None
    # the trainer's own Lightning max_time is a budget too
    r = recipe()
    r["trainers"][0]["trainer"]["max_time"] = "00:00:30:00"
    out = resolve_versions(r)
    assert out["stop"]["versions"] is None and trainer_max_time_s(out) == 1800.0
    assert stop_settings(out["stop"], 1800.0)["trainer_max_time_s"] == 1800.0
    # neither a count nor a budget: refused, naming the time-only way out
    with pytest.raises(StopError, match="or stop.max_wall_s for a time-only run"):
        stop_settings({"model_id": "policy"})


def test_lightnings_max_time_forms_are_read_and_bad_ones_named():
    import datetime

    assert max_time_seconds("01:02:03:04", "k") == 86400 + 7200 + 180 + 4
    assert max_time_seconds({"hours": 1, "minutes": 30}, "k") == 5400
    assert max_time_seconds(datetime.timedelta(minutes=2), "k") == 120
    assert max_time_seconds(None, "k") is None
    for bad in ("30m", "00:30:00", {"hour": 1}, 5, "00:00:00:00"):
        with pytest.raises(StopError, match=r"recipe.trainers\[0\].trainer.max_time"):
            max_time_seconds(bad, "recipe.trainers[0].trainer.max_time")


def test_a_time_only_run_stops_on_its_budget_or_when_its_trainers_finish():
    c = StopConditions(stop_settings({"max_wall_s": 100}), t_start=1000.0)
    assert c.reached(1050.0, 500, {}, False) is None  # no version count ends it
    assert c.reached(1100.0, 600, {}, False) == MAX_WALL
    assert c.reached(1050.0, 40, {}, True) == TRAINERS_FINISHED
    assert c.describe(TRAINERS_FINISHED, 40, {}) == ("the trainers finished at version 40 (a "
                                                     "trainer limit such as max_time)")


def test_other_trainers_without_max_steps_train_as_many_versions():
    r = recipe(versions=10)
    r["trainers"].append({"trainer": {"callbacks": [
        {"class_path": "astralight.callbacks.WeightPublisher", "init_args": {"every_n_steps": 3}}]},
        "model": {"init_args": {"model_id": "verifier"}}})
    out = resolve_versions(r)
    assert [t["trainer"]["max_steps"] for t in out["trainers"]] == [10, 30]


def test_bad_values_name_their_key():
    with pytest.raises(StopError, match="recipe.stop.versions: must be a positive int"):
        resolve_versions(recipe(versions=0))
    with pytest.raises(StopError, match=r"trainers\[0\].trainer.max_steps: must be a positive int"):
        resolve_versions(recipe(max_steps="100"))
    with pytest.raises(StopError, match="every_n_steps: must be an int >= 1"):
        resolve_versions(recipe(versions=4, every=0))


# ---------------------------------------------------------------------- settings


def test_settings_fill_defaults_and_check_each_key():
    s = stop_settings({"versions": 4})
    assert (s["timeout_s"], s["final_eval_timeout_s"], s["max_wall_s"], s["target_accuracy"],
            s["model_id"]) == (3600.0, 300.0, None, None, "policy")
    for bad, key in (({"max_wall_s": "15m"}, "max_wall_s"), ({"timeout_s": 0}, "timeout_s"),
                     ({"target_accuracy": 1.5}, "target_accuracy"),
                     ({"final_eval_timeout_s": -1}, "final_eval_timeout_s"),
                     ({"max_wal_s": 5}, "max_wal_s"), ({"versions": True}, "versions")):
        with pytest.raises(StopError, match=f"recipe.stop.{key}"):
            stop_settings({"versions": 4, **bad})


# ---------------------------------------------------------------------- conditions


def test_conditions_in_order():
    c = StopConditions(stop_settings({"versions": 10, "max_wall_s": 100, "timeout_s": 200,
                                      "target_accuracy": 0.9}), t_start=1000.0)
    done = {0: {"complete": True, "avg_at_k": 0.3}, 5: {"complete": False, "avg_at_k": 0.95}}
    assert c.reached(1050.0, 5, done, trainers_finished=False) is None
    assert c.reached(1050.0, 10, done, trainers_finished=True) == VERSIONS
    assert c.reached(1050.0, 6, done, trainers_finished=True) == TRAINERS_FINISHED
    done[5]["complete"] = True  # an incomplete eval never counts
    assert c.reached(1050.0, 5, done, trainers_finished=False) == TARGET_ACCURACY
    assert "version 5 evaluated at 0.950" in c.describe(TARGET_ACCURACY, 5, done)
    assert c.reached(1100.0, 5, {}, trainers_finished=False) == MAX_WALL
    c = StopConditions(stop_settings({"versions": 10, "timeout_s": 200}), t_start=1000.0)
    assert c.reached(1199.0, 5, {}, False) is None and c.reached(1200.0, 5, {}, False) == TIMEOUT
    assert c.describe(TIMEOUT, 5, {}) == "stop.timeout_s=200 reached at version 5"


# ---------------------------------------------------------------------- the sequence


class FakeTrainer:
    """Alive until it has had SIGTERM and ``exit()`` is called (or it is force-stopped)."""

    def __init__(self, name="trainer-policy", alive=True):
        self.name, self._alive, self.signals, self.forced = name, alive, [], False

    def alive(self) -> bool:
        return self._alive

    def send(self, sig: int) -> None:
        self.signals.append(sig)

    def exit(self) -> None:
        self._alive = False


class Recorder:
    def __init__(self, accept=True):
        self.accept, self.requests, self.retired, self.lines = accept, [], [], []

    def request(self, model_id, version) -> bool:
        self.requests.append((model_id, version))
        return self.accept

    def sequence(self, trainers, model_ids=("policy",), timeout=100.0, now=0.0) -> StopSequence:
        return StopSequence(MAX_WALL, now, trainers, list(model_ids), timeout,
                            request_eval=self.request, retire=self.retired.append,
                            force_stop=lambda c: setattr(c, "forced", True) or c.exit(),
                            log=self.lines.append)


def test_trainers_get_sigterm_then_the_last_version_is_evaluated():
    rec, trainer = Recorder(), FakeTrainer()
    seq = rec.sequence([trainer])
    assert trainer.signals == [signal.SIGTERM] and rec.retired == [trainer]  # never restarted
    assert not seq.step(10.0, {"policy": 37}, {"policy": {}}) and seq.phase == "trainers"
    assert rec.requests == []  # the trainer is still finishing its last step
    trainer.exit()
    assert not seq.step(11.0, {"policy": 38}, {"policy": {0: {"complete": True}}})
    assert seq.phase == "final_eval" and rec.requests == [("policy", 38)]
    assert not seq.step(12.0, {"policy": 38}, {"policy": {38: {"complete": False}}})
    assert rec.requests == [("policy", 38)]  # asked once
    assert seq.step(13.0, {"policy": 38}, {"policy": {38: {"complete": True}}})
    assert seq.eval_complete and seq.final_versions == {"policy": 38} and not trainer.forced


def test_an_already_scheduled_last_version_is_not_requested():
    rec = Recorder()
    seq = rec.sequence([FakeTrainer(alive=False)])  # finished on its own: no signal
    assert seq.step(1.0, {"policy": 40}, {"policy": {40: {"complete": True}}})
    assert rec.requests == [] and seq.eval_complete


def test_a_refused_request_is_asked_again_and_the_wait_is_bounded():
    rec = Recorder(accept=False)
    seq = rec.sequence([FakeTrainer(alive=False)], timeout=30.0)
    assert not seq.step(1.0, {"policy": 5}, {"policy": {}})
    assert not seq.step(2.0, {"policy": 5}, {"policy": {}})
    assert rec.requests == [("policy", 5), ("policy", 5)]
    assert seq.step(31.0, {"policy": 5}, {"policy": {}})  # final_eval_timeout_s since phase 2
    assert not seq.eval_complete and "did not complete" in rec.lines[-1]


def test_a_trainer_that_does_not_stop_is_stopped_hard_after_its_grace():
    rec, trainer = Recorder(), FakeTrainer()
    seq = rec.sequence([trainer], timeout=10.0)
    assert not seq.step(10.0 + TRAINER_GRACE_S - 1, {"policy": 3}, {})
    assert not trainer.forced
    seq.step(10.0 + TRAINER_GRACE_S, {"policy": 3}, {"policy": {}})
    assert trainer.forced and seq.phase == "final_eval"
    assert "still running" in " ".join(rec.lines)


def test_every_policy_is_evaluated_and_none_without_an_eval_source():
    rec = Recorder()
    seq = rec.sequence([FakeTrainer(alive=False)], model_ids=("solver", "verifier"))
    seq.step(1.0, {"solver": 9, "verifier": 9}, {"solver": {9: {"complete": True}},
                                                 "verifier": {}})
    assert rec.requests == [("verifier", 9)] and seq.phase == "final_eval"
    rec = Recorder()
    assert rec.sequence([FakeTrainer(alive=False)], model_ids=()).step(1.0, {}, {})
    assert rec.requests == []


def test_the_launcher_refuses_a_contradiction_before_anything_starts(tmp_path):
    import yaml

    from astralight.launch import _default_recipe, run
    from astralight.launch.recipe import RecipeError

    toy = yaml.safe_load(_default_recipe().read_text())
    toy["trainers"][0]["trainer"]["max_steps"] = toy["stop"]["versions"] + 10
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(toy))
    with pytest.raises(RecipeError, match=r"recipe.stop.versions \(150\) and "
                                          r"recipe.trainers\[0\].trainer.max_steps \(160\)"):
        run(path, tmp_path / "run", check=False)
    assert not (tmp_path / "run").exists()  # refused before the run folder, prepare, processes
