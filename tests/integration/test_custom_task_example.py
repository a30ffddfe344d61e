"""``examples/custom_task`` with real processes: the dataflow service, started from the config
the launcher exports for the recipe and with the PYTHONPATH the launcher gives it (the recipe's
``pythonpath``), imports ``my_task.HeldOutSums`` and serves its prompts -- eval tasks of the
held-out pairs first, then train tasks of the others; a RaaS process's config parser, with the
RaaS's PYTHONPATH, builds the workflow with ``my_task.DigitCredit``. Without that PYTHONPATH the
dataflow refuses to start, naming the class path."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml

from astralight.launch import build_components, export_configs
from astralight.launch.recipe import load_recipe, with_pythonpath

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "custom_task"
RECIPE = EXAMPLE / "recipe.yaml"


def _held_out(prompt_id: str) -> bool:
    a, b = (int(x) for x in prompt_id.split("+"))
    return (a + 2 * b) % 10 == 0  # my_task.held_out, restated: this process never imports it


def _exported(tmp_path: Path, tiny_model_dir) -> dict[str, Path]:
    return {p.stem: p for p in export_configs(RECIPE, tmp_path / "configs", port=8499,
                                              run_dir=str(tmp_path / "run"),
                                              init_model=str(tiny_model_dir))}


def test_the_dataflow_process_serves_the_custom_source(tmp_path, tiny_model_dir,
                                                       dataflow_service, client_for):
    recipe = load_recipe(RECIPE)
    env = with_pythonpath(recipe, {})
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(EXAMPLE)
    # the launcher starts every component with it
    components = build_components(recipe, tmp_path / "run", "http://127.0.0.1:8499", 8499)
    assert all(c.env["PYTHONPATH"].split(os.pathsep)[0] == str(EXAMPLE) for c in components)

    cfg = yaml.safe_load(_exported(tmp_path, tiny_model_dir)["dataflow"].read_text())
    for key in ("host", "port", "state_dir"):  # the fixture's own
        cfg.pop(key)
    cfg["eval"]["source"]["init_args"]["eval_size"] = 8  # a short eval: 8 tasks before train
    url, _, _ = dataflow_service(tmp_path, env_extra={"PYTHONPATH": env["PYTHONPATH"]}, **cfg)
    client = client_for(url)
    iid = client.register(["policy"], 64, meta={"workflow": "single_turn"})["instance_id"]
    tasks = client.lease(iid, 24)
    evals = [t for t in tasks if t.kind == "eval"]
    train = [t for t in tasks if t.kind == "train"]
    assert len(evals) == 8 and train, [t.kind for t in tasks]
    for t in tasks:
        a, b = (int(x) for x in t.prompt[:-1].split("+"))
        assert t.prompt == f"{a}+{b}=" and t.metadata["answer"] == str(a + b)
    assert all(_held_out(t.prompt[:-1]) for t in evals)
    assert not any(_held_out(t.prompt[:-1]) for t in train)


def test_a_raas_process_builds_the_custom_reward_from_its_config(tmp_path, tiny_model_dir):
    recipe = load_recipe(RECIPE)
    raas_yaml = _exported(tmp_path, tiny_model_dir)["raas"]
    script = ("import sys\n"
              "from astralight.raas.config import parse_config\n"
              "cfg = parse_config(['--dataflow', 'http://127.0.0.1:8499',\n"
              "                    '--config', sys.argv[1]])\n"
              "r = cfg.workflow.reward\n"
              "print(type(r).__module__, type(r).__name__, r('82', {'answer': '82'}), "
              "r('83', {'answer': '82'}))\n")
    env = {**os.environ, **with_pythonpath(recipe, {})}
    out = subprocess.run([sys.executable, "-c", script, str(raas_yaml)], capture_output=True,
                         text=True, env=env, cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["my_task", "DigitCredit", "1.0", "0.2"]


def test_without_the_pythonpath_the_dataflow_names_the_class_it_cannot_import(tmp_path,
                                                                             tiny_model_dir):
    config = _exported(tmp_path, tiny_model_dir)["dataflow"]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(ROOT)  # astralight itself, not examples/custom_task
    out = subprocess.run([sys.executable, "-m", "astralight.dataflow.service", "--config",
                          str(config), "--state_dir", str(tmp_path / "state")],
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert out.returncode != 0
    assert "my_task" in out.stdout + out.stderr
