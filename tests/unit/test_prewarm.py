"""Prewarmed component processes (astralight.launch.prewarm): real child processes, cheap commands.

What must hold: a prewarmed process becomes exactly the component it is handed (run as
``__main__``, its environment with the tokens sent only at hand-off, its output in the
component's log, its exit status its own); one that does not fit (another environment or
pinning) or is not needed is never used and ends, leaving no file; restarts start fresh.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest
import yaml

from astralight.launch import Component
from astralight.launch.components import VLLM_IMPORTS, prewarm_plan
from astralight.launch.prewarm import PrewarmPool, enabled, without_tokens

ROOT = Path(__file__).resolve().parents[2]
PRINT_ENV = ("import os, sys; print('token', os.environ.get('ASTRALIGHT_TOKEN'), 'x', "
             "os.environ.get('PREWARM_TEST_X'), 'argv', sys.argv[1:], 'name', __name__); "
             "sys.exit(int(sys.argv[1]))")


def _env(**extra: str) -> dict[str, str]:
    return {**without_tokens(os.environ), "PREWARM_TEST_X": "1", **extra}


@pytest.fixture
def pool():
    pool = PrewarmPool()
    yield pool
    pool.close()


def _wait(proc, timeout_s: float = 60.0) -> int:
    return proc.wait(timeout=timeout_s)


def test_handed_off_process_runs_the_command_as_main_with_its_env_and_log(tmp_path, pool):
    # an import that prints goes to the component's log first; a failing one is left to the
    # component's own start
    imports = ["this_module_does_not_exist_xyz", "json"]
    warm = pool.start("raas", imports, _env(), None, signal.SIGTERM, tmp_path / "run")
    taken = pool.take("raas", _env(ASTRALIGHT_TOKEN="secret"), None, signal.SIGTERM)
    assert taken is warm and pool.waiting == []
    log = tmp_path / "logs" / "raas-0.log"
    log.parent.mkdir()
    log.write_text("earlier lifetime\n")
    proc = warm.hand_off([sys.executable, "-c", PRINT_ENV, "3"], _env(ASTRALIGHT_TOKEN="secret"),
                         log)
    assert proc is warm.proc
    assert _wait(proc) == 3  # its exit status is the command's
    text = log.read_text()
    assert text.startswith("earlier lifetime\n")  # appended, as a fresh start would
    assert "token secret x 1 argv ['3'] name __main__" in text
    assert not warm.output.exists()


def test_tokens_are_not_in_the_prewarmed_environment(tmp_path, pool):
    warm = pool.start("trainer", [], _env(ASTRALIGHT_TOKEN="t", ASTRALIGHT_TRAINER_TOKEN="u"),
                      None, signal.SIGINT, tmp_path)
    assert "ASTRALIGHT_TOKEN" not in warm.env and "ASTRALIGHT_TRAINER_TOKEN" not in warm.env
    environ = Path(f"/proc/{warm.proc.pid}/environ").read_bytes().split(b"\0")
    assert not any(item.startswith(b"ASTRALIGHT_TOKEN=") for item in environ)


def test_a_process_that_does_not_fit_is_not_taken_and_ends_when_closed(tmp_path, pool):
    warm = pool.start("raas", [], _env(), [0], signal.SIGTERM, tmp_path)
    assert pool.take("raas", _env(PREWARM_TEST_X="2"), [0], signal.SIGTERM) is None  # env
    assert pool.misfits == ["the environment differs in PREWARM_TEST_X"]  # said, by name
    assert pool.take("raas", _env(), None, signal.SIGTERM) is None  # pinning
    assert pool.take("raas", _env(), [0], signal.SIGINT) is None  # stop signal
    assert pool.take("trainer", _env(), [0], signal.SIGTERM) is None  # kind
    assert os.sched_getaffinity(warm.proc.pid) == {0}
    pool.close()
    assert warm.proc.returncode is not None and pool.waiting == []
    assert not warm.output.exists()


def test_end_of_input_ends_a_prewarmed_process(tmp_path, pool):
    # what a launcher that died leaves it (besides the parent-death signal)
    warm = pool.start("raas", ["json"], _env(), None, signal.SIGTERM, tmp_path)
    warm.proc.stdin.close()
    assert _wait(warm.proc) == 0


def test_a_dead_prewarmed_process_is_not_taken(tmp_path, pool):
    warm = pool.start("raas", [], _env(), None, signal.SIGTERM, tmp_path)
    warm.proc.kill()
    _wait(warm.proc)
    assert pool.take("raas", _env(), None, signal.SIGTERM) is None


def test_component_becomes_the_prewarmed_process_and_restarts_fresh(tmp_path, pool):
    marker = tmp_path / "running"
    code = (f"import pathlib, time; pathlib.Path({str(marker)!r}).write_text('x'); "
            "time.sleep(60)")
    comp = Component("raas-0", [sys.executable, "-c", code], tmp_path / "raas-0.log",
                     env={"PREWARM_TEST_X": "1"})
    warm = pool.start("raas", [], without_tokens(comp.child_env()), None, comp.stop_signal,
                      tmp_path)
    comp.start(pool)
    try:
        assert comp.pid == warm.proc.pid and len(comp.lifetimes) == 1 and comp.prewarmed
        deadline = time.monotonic() + 30
        while not marker.exists() and comp.alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert marker.exists() and comp.alive()  # the command runs in the prewarmed process
        comp.stop(signal.SIGTERM, timeout_s=10)
        marker.unlink()
        comp.start(pool)  # the pool is empty: a fresh process, as every restart
        assert comp.pid != warm.proc.pid and len(comp.lifetimes) == 2 and not comp.prewarmed
        assert b"time.sleep" in Path(f"/proc/{comp.pid}/cmdline").read_bytes()
    finally:
        comp.stop(signal.SIGTERM, timeout_s=10)


def test_prewarm_plan_of_the_toy_recipe():
    recipe = yaml.safe_load((ROOT / "examples" / "toy" / "recipe.yaml").read_text())
    plan = prewarm_plan(recipe)
    kinds = [kind for kind, _, _ in plan]
    assert kinds == ["raas", "trainer"]
    raas_imports, trainer_imports = plan[0][1], plan[1][1]
    assert "astralight.raas.service" in raas_imports
    assert all(m in raas_imports for m in VLLM_IMPORTS)  # the default engine is vLLM
    assert "astralight.trainer.trainer_cli" in trainer_imports
    model = recipe["trainers"][0]["model"]["class_path"].rpartition(".")[0]
    assert model in trainer_imports
    assert [sig for _, _, sig in plan] == [signal.SIGTERM, signal.SIGINT]


def test_prewarm_plan_of_other_engines_and_an_autoscaled_pool():
    recipe = {"raas": [{"engines": {"p": {"class_path": "astralight.raas.hf_engine.HFEngine"}}}],
              "trainers": [{"model": {"class_path": "{placeholder}"}}]}
    plan = prewarm_plan(recipe)
    assert plan[0][1] == ["astralight.raas.service", "astralight.raas.hf_engine"]  # no vLLM
    assert plan[1][1] == ["astralight.trainer.trainer_cli", "transformers.models.auto.modeling_auto"]
    recipe["autoscale"] = {"min_instances": 1}
    assert [kind for kind, _, _ in prewarm_plan(recipe)] == ["trainer"]


@pytest.mark.parametrize("value,on", [(None, True), ("1", True), ("0", False), ("off", False),
                                      ("False", False), ("yes", True)])
def test_switch(value, on):
    env = {} if value is None else {"ASTRALIGHT_PREWARM": value}
    assert enabled(env) is on


def _prewarmed_for(run_dir: Path) -> list[int]:
    """Pids of live prewarmed processes started for ``run_dir``."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if b"astralight.launch.prewarm" in cmdline and str(run_dir).encode() in cmdline:
            out.append(int(entry.name))
    return out


def test_a_refused_recipe_leaves_no_prewarmed_process(tmp_path, monkeypatch):
    from astralight.launch import _default_recipe, run
    from astralight.launch.recipe import RecipeError

    closed: list[int] = []
    real_close = PrewarmPool.close

    def close(self):  # how many were still waiting when the launcher gave up
        closed.append(len(self.waiting))
        real_close(self)

    monkeypatch.setattr(PrewarmPool, "close", close)
    toy = yaml.safe_load(_default_recipe().read_text())
    toy["trainers"][0]["trainer"]["max_step"] = 3
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(toy))
    run_dir = tmp_path / "run"
    with pytest.raises(RecipeError, match=r"trainer\.max_step"):
        run(path, run_dir)
    assert closed == [2]  # a RaaS and a trainer were prewarmed, and stopped
    assert _prewarmed_for(run_dir.resolve()) == []
    assert not run_dir.exists()


def test_components_inherit_the_environment_the_launch_began_with(tmp_path, monkeypatch):
    # what the launcher's own imports set later (torch sets TORCHINDUCTOR_CACHE_DIR during the
    # check) must not reach a component, or it would never fit its prewarmed process
    base = _env()
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/tmp/leaked")
    comp = Component("trainer-policy", [sys.executable, "-c", "pass"], tmp_path / "t.log",
                     env={"OMP_NUM_THREADS": 1}, base_env=base)
    env = comp.child_env()
    assert env.get("TORCHINDUCTOR_CACHE_DIR") == base.get("TORCHINDUCTOR_CACHE_DIR") != "/tmp/leaked"
    assert env["OMP_NUM_THREADS"] == "1" and env["PREWARM_TEST_X"] == "1"
