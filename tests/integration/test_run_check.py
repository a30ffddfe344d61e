"""``astralight run --check`` as a user types it (a real process), and a recipe's ``pythonpath``
reaching a real component process started from another folder.

The check's wall time is printed (``-s`` shows it), never asserted: tests do not assert on speed.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx
import yaml

from astralight.launch import build_components
from astralight.launch.recipe import load_recipe
from tests.conftest import free_port

ROOT = Path(__file__).resolve().parents[2]
TOY = ROOT / "examples" / "toy" / "recipe.yaml"


def check(recipe: Path, cwd: Path) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "astralight.cli", "run", "--check", str(recipe)],
                         capture_output=True, text=True, timeout=300, cwd=cwd)
    return out, time.monotonic() - t0


def test_a_trainer_typo_exits_2_naming_the_key(tmp_path):
    recipe = tmp_path / "typo.yaml"
    recipe.write_text(yaml.safe_dump({"extends": str(TOY),
                                      "trainers": {"policy": {"trainer": {"max_step": 3}}}}))
    out, seconds = check(recipe, tmp_path)
    print(f"astralight run --check (typo): {seconds:.1f}s")
    assert out.returncode == 2, out.stderr[-2000:]
    assert "recipe.trainers[0].trainer.max_step: unknown key" in out.stderr
    assert "did you mean 'max_steps'?" in out.stderr
    assert not (tmp_path / "runs").exists()  # nothing was started or written


def test_the_toy_recipe_passes_with_one_ok_line(tmp_path):
    out, seconds = check(TOY, tmp_path)
    print(f"astralight run --check (toy, OK): {seconds:.1f}s")
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("astralight run --check: OK: ")
    assert "dataflow, raas-0, trainer-policy" in lines[0]
    assert not (tmp_path / "runs").exists()


def test_pythonpath_reaches_the_launcher_check_and_a_component_process(tmp_path):
    """A prompt source in a plugin folder next to the recipe: found by ``--check`` run from
    another folder, and by the dataflow process the launcher starts (it imports the source)."""
    folder = tmp_path / "my_task"
    (folder / "plugins").mkdir(parents=True)
    (folder / "plugins" / "my_task_source.py").write_text(
        "from astralight.tasks.arithmetic import ArithmeticSource\n\n\n"
        "class MyTaskSource(ArithmeticSource):\n    \"\"\"The toy's prompts, from a plugin.\"\"\"\n")
    toy = yaml.safe_load(TOY.read_text())
    toy["pythonpath"] = ["plugins"]
    for where in (toy["dataflow"], toy["dataflow"]["eval"]):
        where["source"]["class_path"] = "my_task_source.MyTaskSource"
    recipe = folder / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(toy))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    out, _ = check(recipe, elsewhere)
    assert out.returncode == 0, out.stderr[-3000:]

    loaded = load_recipe(recipe)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    comps = build_components(loaded, tmp_path / "run", url, port)
    dataflow = comps[0]
    assert dataflow.name == "dataflow"
    dataflow.start()  # the launcher's own start: its environment, its log
    try:
        deadline = time.monotonic() + 90
        while True:
            assert dataflow.alive(), dataflow.tail()
            try:
                info = httpx.get(f"{url}/v1/info", timeout=2.0)
                if info.status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, dataflow.tail()
            time.sleep(0.3)
    finally:
        dataflow.stop()
