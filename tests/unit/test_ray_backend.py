"""The Ray backend's own logic, without a cluster: ``recipe.ray`` checked with errors naming the
key, resources turned into placement-group bundles and actor options, the component commands it
places (the dataflow bound to its node's IP, the autoscaler switched to ``--backend ray``), the
environment an actor gets, the Popen-shaped handle on an actor (running, exited, killed, busy),
and a clear error naming the ``ray`` extra wherever Ray is missing. The real cluster runs in
``tests/integration/test_ray_cluster.py``.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from astralight.launch.components import Component
from astralight.launch.ray_launch import (RAY_DEFAULTS, RayComponent, actor_options,
                                          ray_components, ray_settings)
from astralight.launch.recipe import RecipeError
from astralight.launch.ray_process import (ACTOR_DIED, RayProcess, RayUnavailable, bundle,
                                    check_resources, env_overlay, require_ray)
from tests.unit.ray_fakes import FakeActor, FakeRay, FakeRayRun

# ---------------------------------------------------------------------- recipe.ray


def test_ray_settings_defaults():
    settings = ray_settings(None)
    assert settings["strategy"] == "PACK" and settings["namespace"] == "astralight"
    assert settings["raas"] == {"num_gpus": 1, "num_cpus": 1}
    assert settings["trainer"] == {"num_gpus": 1, "num_cpus": 1}
    assert settings["dataflow"] == {"num_cpus": 1} and settings["autoscale"] == {"num_cpus": 0}


def test_ray_settings_a_kind_given_replaces_its_defaults():
    settings = ray_settings({"address": "10.0.0.1:6379", "strategy": "SPREAD",
                             "trainer": {"num_gpus": 4, "num_cpus": 16, "memory": 2 << 30}})
    assert settings["address"] == "10.0.0.1:6379" and settings["strategy"] == "SPREAD"
    assert settings["trainer"] == {"num_gpus": 4, "num_cpus": 16, "memory": 2 << 30}
    assert settings["raas"] == RAY_DEFAULTS["raas"]


@pytest.mark.parametrize("spec, key", [
    ({"adress": "x"}, "recipe.ray.adress: unknown key"),
    ({"strategy": "spread"}, "recipe.ray.strategy: must be one of PACK"),
    ({"ready_timeout_s": 0}, "recipe.ray.ready_timeout_s"),
    ({"raas": {"num_gpu": 1}}, "recipe.ray.raas.num_gpu: unknown resource"),
    ({"raas": {"num_gpus": -1}}, "recipe.ray.raas.num_gpus: must be a number >= 0"),
    ({"trainer": {"resources": {"A100": "x"}}}, "recipe.ray.trainer.resources"),
    ("auto", "recipe.ray: must be a mapping"),
])
def test_ray_settings_errors_name_the_key(spec, key):
    with pytest.raises(RecipeError, match=key.replace(".", r"\.").replace("(", r"\(")):
        ray_settings(spec)


def test_the_recipe_schema_knows_the_ray_section():
    from astralight.launch.recipe_schema import SchemaError, validate_recipe

    recipe = {"dataflow": {}, "raas": [{}], "trainers": [{}], "stop": {"versions": 10},
              "ray": {"address": "auto", "raas": {"num_gpus": 1, "resources": {"A100": 1}}}}
    validate_recipe(recipe)
    recipe["ray"] = {"raas": {"num_gpu": 1}}
    with pytest.raises(SchemaError, match=r"recipe\.ray\.raas\.num_gpu: unknown key; did you "
                                          r"mean 'num_gpus'"):
        validate_recipe(recipe)


# ---------------------------------------------------------------------- resources


def test_bundle_and_actor_options():
    spec = check_resources({"num_gpus": 1, "num_cpus": 4, "memory": 1 << 30,
                            "resources": {"accelerator_type:A100": 0.001}}, "recipe.ray.raas")
    assert bundle(spec) == {"CPU": 4.0, "GPU": 1.0, "memory": float(1 << 30),
                            "accelerator_type:A100": 0.001}
    assert actor_options(spec) == {"num_cpus": 4, "num_gpus": 1, "memory": 1 << 30,
                                   "resources": {"accelerator_type:A100": 0.001}}


def test_a_cpu_less_actor_still_gets_a_bundle_and_asks_for_no_cpu():
    assert bundle({"num_cpus": 0}) == {"CPU": 0.01}  # Ray refuses an empty bundle
    assert actor_options({}) == {"num_cpus": 0, "num_gpus": 0}  # not Ray's default of 1 CPU


# ---------------------------------------------------------------------- environment


def test_env_overlay_sends_what_the_component_adds_and_removes_other_scopes():
    base = {"PATH": "/launcher/bin", "HOME": "/home/me", "ASTRALIGHT_ADMIN_TOKEN": "a" * 40,
            "ASTRALIGHT_ROLLOUT_TOKEN": "r" * 40, "VLLM_CPU_KVCACHE_SPACE": "1"}
    child = {"PATH": "/launcher/bin", "HOME": "/home/me", "ASTRALIGHT_TOKEN": "r" * 40,
             "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1"}
    overlay, removed = env_overlay(child, base)
    # the launcher's PATH and HOME say nothing about another node: not sent
    assert overlay == {"ASTRALIGHT_TOKEN": "r" * 40, "VLLM_CPU_KVCACHE_SPACE": "1",
                       "OMP_NUM_THREADS": "1"}
    assert removed == ["ASTRALIGHT_ADMIN_TOKEN", "ASTRALIGHT_ROLLOUT_TOKEN"]


# ---------------------------------------------------------------------- placing the components


def _components(tmp_path: Path, autoscale: bool) -> list[Component]:
    py = [sys.executable, "-m", "astralight.cli"]
    names = ["dataflow", "autoscale" if autoscale else "raas-0", "trainer-policy"]
    argv = {"dataflow": ["dataflow", "serve", "--config", "d.yaml"],
            "raas-0": ["raas", "serve", "--dataflow", "http://10.0.0.5:8400", "--config", "r.yaml"],
            "autoscale": ["autoscale", "--dataflow", "http://10.0.0.5:8400"],
            "trainer-policy": ["fit", "--config", "t.yaml"]}
    return [Component(n, py + argv[n], tmp_path / f"{n}.log", env={"X": "1"}, cpus=[0])
            for n in names]


def test_ray_components_keep_the_commands_and_bind_the_dataflow_to_its_node(tmp_path):
    run = FakeRayRun(ray_settings({"raas": {"num_gpus": 2}}))
    local = _components(tmp_path, autoscale=False)
    comps = ray_components(local, run)
    assert all(isinstance(c, RayComponent) for c in comps)
    assert [c.name for c in comps] == ["dataflow", "raas-0", "trainer-policy"]
    assert comps[0].argv == local[0].argv + ["--host", "10.0.0.5"]
    assert comps[1].argv == local[1].argv and comps[2].argv == local[2].argv
    assert comps[1].log_path == local[1].log_path and comps[1].env == {"X": "1"}
    assert comps[2].stop_signal == signal.SIGINT  # a trainer still stops the Lightning way
    assert run.placed == ["raas-0", "trainer-policy"]  # one bundle each; the dataflow: no bundle


def test_the_autoscaler_is_switched_to_its_ray_backend(tmp_path):
    run = FakeRayRun(ray_settings({"namespace": "ns", "raas": {"num_gpus": 1, "num_cpus": 8}}))
    comps = ray_components(_components(tmp_path, autoscale=True), run)
    argv = comps[1].argv
    tail = argv[argv.index("--backend"):]
    assert tail == ["--backend", "ray", "--ray-address", "10.0.0.5:6379", "--ray-namespace",
                    "ns", "--ray-resources", '{"num_gpus": 1, "num_cpus": 8}']
    from astralight.autoscale.service import build_parser, check_args

    args = build_parser().parse_args(argv[4:] + ["--raas-config", __file__])
    assert args.backend == "ray" and check_args(args) is None


# ---------------------------------------------------------------------- the handle on an actor


@pytest.fixture
def fake_ray(monkeypatch):
    ray = FakeRay()
    monkeypatch.setattr("astralight.launch.ray_process.require_ray", lambda *a: ray)
    return ray


def test_handle_reports_running_then_the_exit_code(fake_ray):
    proc = RayProcess(FakeActor(exit_after_polls=2, code=3), {"pid": 42})
    assert proc.pid == 42 and proc.poll() is None and proc.poll() is None
    assert proc.poll() == 3 and proc.returncode == 3 and proc.died is None
    proc.send_signal(signal.SIGTERM)  # gone: nothing sent
    assert proc.actor.signals == []


def test_handle_of_a_killed_actor_reads_as_died(fake_ray):
    actor = FakeActor()
    proc = RayProcess(actor, {"pid": 42})
    assert proc.poll() is None
    actor.dead = True  # ray.kill, a lost node
    assert proc.poll() == ACTOR_DIED and "died unexpectedly" in proc.died


def test_handle_of_a_busy_actor_counts_as_running(fake_ray):
    actor = FakeActor()
    actor.busy = True
    assert RayProcess(actor, {"pid": 1}).poll() is None


def test_handle_signals_waits_and_kills(fake_ray):
    actor = FakeActor()
    proc = RayProcess(actor, {"pid": 1})
    proc.send_signal(signal.SIGINT)
    assert actor.signals == [signal.SIGINT]
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(timeout=0.3)
    proc.kill()  # SIGKILL through the actor, then the actor ended
    assert actor.killed and proc.returncode == -9 and fake_ray.kills == [actor]


# ---------------------------------------------------------------------- without Ray


@pytest.fixture
def no_ray(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError


def test_require_ray_names_the_extra(no_ray):
    with pytest.raises(RayUnavailable, match=r"pip install 'astralight\[ray\]'"):
        require_ray()


def test_run_with_backend_ray_without_ray_names_the_extra(no_ray, tmp_path, capsys):
    from astralight.launch import main

    assert main(["--backend", "ray", "--no-check", "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "--backend ray needs Ray" in err and "astralight[ray]" in err
    assert not (tmp_path / "run").exists()  # refused before anything was built


def test_autoscale_with_backend_ray_without_ray_names_the_extra(no_ray, tmp_path, capsys):
    from astralight.autoscale.service import main

    config = tmp_path / "raas.yaml"
    config.write_text("{}\n")
    assert main(["--backend", "ray", "--raas-config", str(config)]) == 2
    assert "astralight[ray]" in capsys.readouterr().err


def test_astralight_imports_without_ray():
    code = ("import sys; sys.modules['ray'] = None\n"
            "import astralight.launch, astralight.launch.runner, astralight.launch.ray_launch\n"
            "import astralight.autoscale.service, astralight.autoscale.ray_backend\n"
            "import astralight.launch.ray_process\n"
            "print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
