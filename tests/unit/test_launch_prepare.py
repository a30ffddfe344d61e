"""``astralight prepare RECIPE``: the recipe's prepare step alone, into the run folder, reused by a
later launch (a model folder with a config.json is never prepared twice)."""

from __future__ import annotations

import yaml

from astralight.cli import main as cli
from astralight.launch.components import _default_recipe

PREP = '''
import json
from pathlib import Path
CALLS = Path(__file__).with_name("calls.txt")

def build(out_dir, width=1):
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    (Path(out_dir) / "config.json").write_text(json.dumps({"width": width}))
    with open(CALLS, "a") as f:
        f.write(f"{width}\\n")
'''


def _recipe(tmp_path):
    (tmp_path / "myprep.py").write_text(PREP)
    recipe = yaml.safe_load(_default_recipe().read_text())
    recipe["pythonpath"] = ["."]
    recipe["prepare"] = {"function": "myprep.build", "kwargs": {"width": 3}}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def test_prepare_builds_the_initial_model_once_into_the_run_folder(tmp_path, capsys):
    path, run = _recipe(tmp_path), tmp_path / "run"
    assert cli(["prepare", str(path), "--run-dir", str(run), "--set",
                "prepare.kwargs.width=5"]) == 0
    assert (run / "models" / "init" / "config.json").read_text() == '{"width": 5}'
    out = capsys.readouterr().out
    assert f"start with: astralight run {path} --run-dir {run}" in out
    assert cli(["prepare", str(path), "--run-dir", str(run)]) == 0  # reused, not rebuilt
    assert "reusing prepared model" in capsys.readouterr().out
    assert (tmp_path / "calls.txt").read_text() == "5\n"


def test_a_bad_recipe_key_is_named_and_nothing_is_prepared(tmp_path, capsys):
    path = _recipe(tmp_path)
    assert cli(["prepare", str(path), "--run-dir", str(tmp_path / "run"), "--set",
                "stop.versionz=3"]) == 2
    assert "versionz" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_fit_without_arguments_says_how_to_give_it_a_config(capsys):
    assert cli(["fit"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: astralight fit --config TRAINER.yaml")
    assert "{fit,validate,test,predict}" not in err and "--export-configs" in err
