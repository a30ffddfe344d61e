"""The launcher's restart policy with fake components and a fake clock; its run-folder helpers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from astralight.launch import (
    Component,
    last_checkpoint,
    running_components,
    write_atomic,
    write_pids,
)
from astralight.launch.recipe import RecipeError, supervise_settings_checked
from astralight.launch.supervise import (
    SUPERVISE_DEFAULTS,
    GiveUp,
    Supervisor,
    backoff,
    supervise_settings,
)


class FakeComponent:
    """Alive until ``crash(rc)``; ``start()`` brings it back (counted)."""

    def __init__(self, name: str):
        self.name = name
        self._rc: int | None = None
        self.starts = 0

    def alive(self) -> bool:
        return self._rc is None

    @property
    def returncode(self):
        return self._rc

    def crash(self, rc: int = -9) -> None:
        self._rc = rc

    def start(self) -> None:
        self.starts += 1
        self._rc = None

    def tail(self, lines: int = 30) -> str:
        return f"last words of {self.name}"


def make(names=("dataflow", "raas-0", "trainer-policy"), **settings):
    comps = {n: FakeComponent(n) for n in names}
    lines: list[str] = []
    events = []
    sup = Supervisor(comps.values(), {**SUPERVISE_DEFAULTS, **settings},
                     restart=lambda c: c.start(), clock=lambda: 0.0, log=lines.append,
                     on_event=events.append)
    return sup, comps, lines, events


def test_settings_defaults_off_and_bad_keys():
    assert supervise_settings(None) == SUPERVISE_DEFAULTS
    assert supervise_settings(True) == SUPERVISE_DEFAULTS
    assert supervise_settings(False) is None
    assert supervise_settings({"enabled": False, "max_restarts": 5}) is None
    assert supervise_settings({"max_restarts": 1, "backoff_s": 0})["max_restarts"] == 1
    for bad, key in [({"max_restarts": -1}, "max_restarts"), ({"max_restarts": 1.5}, "max_restarts"),
                     ({"backoff_s": -2}, "backoff_s"), ({"backoff_factor": 0.5}, "backoff_factor"),
                     ({"retries": 3}, "retries"), ("often", "supervise"),
                     ({"enabled": "yes"}, "enabled")]:
        with pytest.raises(RecipeError, match=key):
            supervise_settings_checked(bad)


def test_backoff_grows_and_is_capped():
    s = {**SUPERVISE_DEFAULTS, "backoff_s": 2, "backoff_factor": 2, "max_backoff_s": 5}
    assert [backoff(s, k) for k in range(4)] == [2.0, 4.0, 5.0, 5.0]


def test_a_crash_is_restarted_after_its_backoff_and_counted():
    sup, comps, lines, events = make(backoff_s=2, backoff_factor=3)
    assert sup.poll(0.0) == []
    comps["raas-0"].crash(-9)
    [event] = sup.poll(10.0)
    assert (event.component, event.attempt, event.returncode, event.backoff_s) == ("raas-0", 1, -9, 2)
    assert sup.down() == {"raas-0"} and comps["raas-0"].starts == 0
    sup.poll(11.9)  # not yet due
    assert comps["raas-0"].starts == 0
    sup.poll(12.0)
    assert comps["raas-0"].starts == 1 and sup.down() == set()
    assert sup.restarts == {"dataflow": 0, "raas-0": 1, "trainer-policy": 0}
    assert event.restarted_at == 0.0  # the supervisor's clock at the restart (fake: 0)
    assert events == [event, event]  # once crashed, once restarted
    # the second crash of the same component waits backoff_s * factor
    comps["raas-0"].crash(1)
    [second] = sup.poll(20.0)
    assert second.attempt == 2 and second.backoff_s == 6
    assert any("restarting in 6s (restart 2 of 3)" in line for line in lines)


def test_gives_up_after_max_restarts_naming_the_component():
    sup, comps, _, _ = make(max_restarts=2, backoff_s=0)
    for i in range(2):
        comps["dataflow"].crash(-9)
        sup.poll(float(i))  # crash seen and (backoff 0) restarted in the same poll
        assert comps["dataflow"].starts == i + 1
    comps["dataflow"].crash(-9)
    with pytest.raises(GiveUp, match=r"dataflow exited with -9 \(SIGKILL: on Linux usually the "
                                     r"kernel's out-of-memory killer.*\) after 2 restart") as info:
        sup.poll(5.0)
    assert "max_restarts=2" in str(info.value) and "last words of dataflow" in str(info.value)
    assert info.value.restarts == 2
    # the budget is per component: the others still have theirs
    assert sup.restarts["raas-0"] == 0


def test_supervision_off_fails_on_the_first_crash():
    comps = [FakeComponent("dataflow"), FakeComponent("trainer-policy")]
    sup = Supervisor(comps, None, restart=lambda c: c.start(), clock=lambda: 0.0, log=lambda _: None)
    comps[1].crash(1)
    with pytest.raises(GiveUp, match="supervise is off"):
        sup.poll(0.0)


def test_a_trainer_exiting_zero_is_finished_not_restarted_a_service_exiting_zero_is_a_crash():
    sup, comps, _, _ = make(backoff_s=0)
    comps["trainer-policy"].crash(0)
    comps["raas-0"].crash(0)
    touched = sup.poll(0.0)
    assert [e.component for e in touched] == ["raas-0", "raas-0"]  # crashed, then restarted
    assert comps["trainer-policy"].starts == 0 and sup.finished == {"trainer-policy"}
    assert sup.finished_trainers()
    sup.poll(1.0)  # a finished trainer stays finished
    assert comps["trainer-policy"].starts == 0


def test_a_failing_restart_counts_as_another_crash():
    calls = []

    def restart(comp):
        calls.append(comp.name)
        if len(calls) == 1:
            raise OSError("no such executable")
        comp.start()

    comp = FakeComponent("raas-0")
    sup = Supervisor([comp], {**SUPERVISE_DEFAULTS, "backoff_s": 0, "max_restarts": 2}, restart,
                     clock=lambda: 0.0, log=lambda _: None)
    comp.crash(-9)
    sup.poll(0.0)  # crash, restart fails -> second crash pending
    assert sup.restarts["raas-0"] == 1 and sup.down() == {"raas-0"}
    sup.poll(1.0)
    assert comp.starts == 1 and sup.restarts["raas-0"] == 2 and len(sup.events) == 2
    summary = sup.summary()
    assert summary["restarts"] == {"raas-0": 2}
    assert [e["attempt"] for e in summary["restart_events"]] == [1, 2]


# ---------------------------------------------------------------- run-folder helpers


def test_write_atomic_replaces_whole_and_leaves_no_temp(tmp_path):
    path = tmp_path / "sub" / "x.json"
    write_atomic(path, "old")
    write_atomic(path, "new")
    assert path.read_text() == "new"
    assert sorted(p.name for p in path.parent.iterdir()) == ["x.json"]


def test_pids_json_lists_running_components_and_resume_refuses_while_they_run(tmp_path):
    run_dir = tmp_path / "run"
    # a real child whose command line names the run folder, as every component's does
    comp = Component("raas-0", [sys.executable, "-c", "import time; time.sleep(60)",
                                str(run_dir / "configs" / "raas-0.yaml")],
                     run_dir / "logs" / "raas-0.log")
    gone = Component("dataflow", [sys.executable, "-c", "pass"], run_dir / "logs" / "dataflow.log")
    comp.start()
    gone.start()
    gone.proc.wait()
    try:
        write_pids(run_dir, [gone, comp])
        assert json.loads((run_dir / "pids.json").read_text()) == {"raas-0": comp.pid}
        assert running_components(run_dir) == {"raas-0": comp.pid}
    finally:
        comp.stop()
    assert running_components(run_dir) == {}
    assert comp.returncode is not None and len(comp.lifetimes) == 1 and comp.lifetimes[0][1]
    write_pids(run_dir, [gone, comp])
    assert json.loads((run_dir / "pids.json").read_text()) == {}


def test_last_checkpoint_is_the_newest_last_ckpt_of_the_model_checkpoint_dirpath(tmp_path):
    ckpts = tmp_path / "checkpoints" / "policy"
    cfg = {"trainer": {"callbacks": [
        {"class_path": "astralight.callbacks.WeightPublisher"},
        {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
         "init_args": {"dirpath": str(ckpts), "save_last": True}}]}}
    assert last_checkpoint(cfg, tmp_path) is None
    ckpts.mkdir(parents=True)
    (ckpts / "epoch=0-step=5.ckpt").write_bytes(b"x")
    assert last_checkpoint(cfg, tmp_path) is None  # only last*.ckpt counts
    (ckpts / "last.ckpt").write_bytes(b"x")
    (ckpts / "last-v1.ckpt").write_bytes(b"x")
    old = time.time() - 100
    os.utime(ckpts / "last.ckpt", (old, old))
    assert last_checkpoint(cfg, tmp_path) == ckpts / "last-v1.ckpt"
    # no ModelCheckpoint dirpath: searched under default_root_dir
    nested = tmp_path / "root" / "lightning_logs" / "version_0" / "checkpoints"
    nested.mkdir(parents=True)
    (nested / "last.ckpt").write_bytes(b"x")
    assert last_checkpoint({"trainer": {"default_root_dir": str(tmp_path / "root")}},
                           tmp_path) == nested / "last.ckpt"


def test_component_restart_appends_to_its_log_and_sums_lifetimes(tmp_path):
    comp = Component("raas-0", [sys.executable, "-c", "print('hi')"], tmp_path / "c.log")
    for _ in range(2):
        comp.start()
        comp.proc.wait()
        assert not comp.alive()
    comp.stop()
    assert comp.log_path.read_text().count("hi") == 2
    assert len(comp.lifetimes) == 2 and comp.seconds_alive() > 0


def test_resume_needs_a_run_folder_and_its_recipe(tmp_path):
    from astralight.launch import main

    assert main(["--resume", str(tmp_path / "nope")]) == 2
    (tmp_path / "run").mkdir()
    assert main(["--resume", str(tmp_path / "run")]) == 2  # no recipe.yaml saved there
    proc = subprocess.run([sys.executable, "-m", "astralight.cli", "run", "--resume",
                           str(tmp_path / "run")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "recipe.yaml is missing" in proc.stderr


def test_resume_refuses_while_the_run_folders_components_still_run(tmp_path):
    import shutil

    from astralight.launch import _default_recipe, run

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    shutil.copy(_default_recipe(), run_dir / "recipe.yaml")
    orphan = Component("dataflow", [sys.executable, "-c", "import time; time.sleep(60)",
                                    str(run_dir / "configs" / "dataflow.yaml")],
                       run_dir / "logs" / "dataflow.log")
    orphan.start()
    try:
        write_pids(run_dir, [orphan])
        with pytest.raises(RecipeError, match=r"still running \{'dataflow': \d+\}"):
            run(None, run_dir, resume=True)
    finally:
        orphan.stop()
    assert not (run_dir / "dataflow").exists()  # refused before anything started


@pytest.mark.parametrize("name", ["trainer-policy", "raas-0", "dataflow"])
def test_a_usage_or_config_error_is_never_restarted(name):
    """Exit 2 (e.g. a typo'd trainer key: `Subcommand 'fit' does not accept option`) used to be
    restarted three times before the run failed with the same message."""
    sup, comps, _, events = make(backoff_s=0)
    comps[name].crash(2)
    with pytest.raises(GiveUp, match=f"{name} exited with 2, a usage or config error") as info:
        sup.poll(0.0)
    assert comps[name].starts == 0 and info.value.restarts == 0 and not events
    assert f"last words of {name}" in str(info.value)
    sup, comps, _, _ = make(backoff_s=0)  # any other failure is still restarted
    comps[name].crash(1)
    sup.poll(0.0)
    assert comps[name].starts == 1


def test_a_retired_component_is_never_restarted():
    """The stop sequence retires the trainers it stops early: whatever they exit with (a hard
    stop after their grace is -2 or -9), they are not restarted; a pending restart is dropped."""
    sup, comps, _, events = make(backoff_s=0)
    sup.retire("trainer-policy")
    comps["trainer-policy"].crash(-9)
    sup.poll(0.0)
    assert comps["trainer-policy"].starts == 0 and not events and sup.finished_trainers()
    sup, comps, _, _ = make(backoff_s=5)
    comps["raas-0"].crash(1)
    sup.poll(0.0)
    assert sup.down() == {"raas-0"}
    sup.retire("raas-0")
    sup.poll(10.0)
    assert sup.down() == set() and comps["raas-0"].starts == 0


def test_a_component_that_knows_why_it_exited_says_so_instead_of_the_oom_guess():
    """A Ray component's killed actor reads as -9: the supervisor's line must not blame the
    out-of-memory killer for it."""
    import types

    from astralight.launch.ray_launch import RayComponent

    sup, comps, lines, _ = make(max_restarts=0, backoff_s=0)
    raas = comps["raas-0"]
    raas.exit_reason = lambda rc: " (its Ray actor died: the node went away)"
    raas.crash(-9)
    with pytest.raises(GiveUp, match=r"raas-0 exited with -9 \(its Ray actor died: the node went "
                                     r"away\) after 0 restart") as info:
        sup.poll(0.0)
    assert "out-of-memory" not in str(info.value)
    died = types.SimpleNamespace(proc=types.SimpleNamespace(died="killed by ray.kill"))
    assert RayComponent.exit_reason(died, -9) == " (its Ray actor died: killed by ray.kill)"
    alive = types.SimpleNamespace(proc=types.SimpleNamespace(died=None))
    assert "out-of-memory" in RayComponent.exit_reason(alive, -9)
